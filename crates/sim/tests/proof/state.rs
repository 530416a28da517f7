//! The QP state machine through `Hca::modify_qp` (illegal transitions and masks, RESET, SQD), the
//! initiator depth (`max_rd_atomic`), fences, and the responder's atomic replay cache
//! (`max_dest_rd_atomic`).

use core::time::Duration;
use std::cell::Cell;
use std::rc::Rc;

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Fate, Impairments};
use softrdma_transport::attr::mask;
use softrdma_transport::{AsyncEvent, Config, ModifyQp, QpState, SendFlags, SendOp, VerbsError, WcOpcode, WcStatus};
use softrdma_wire::opcode::{base, Flags};
use softrdma_wire::{IbPacket, Psn, Qpn};

use crate::{net, net_with, pair};

const DELAY: Duration = Impairments::NONE.delay;

fn to(state: QpState) -> ModifyQp {
    ModifyQp { state: Some(state), ..Default::default() }
}

#[test]
fn illegal_transitions_and_masks_are_refused() {
    let mut net = net("modify_refused", Impairments::NONE, 40);
    let o = ConnOpts::default();
    let a = net.create_qp(0, &o);
    let rtr = ModifyQp {
        state: Some(QpState::Rtr),
        av: Some(Default::default()),
        path_mtu: Some(softrdma_transport::Mtu::M1024),
        dest_qpn: Some(Qpn::new(0x99)),
        rq_psn: Some(Psn::new(0)),
        max_dest_rd_atomic: Some(1),
        min_rnr_timer: Some(1),
        ..Default::default()
    };
    // RESET -> RTR skips INIT.
    assert_eq!(net.modify(&a, &rtr), Err(VerbsError::IllegalTransition { from: QpState::Reset, to: QpState::Rtr }));
    // RESET -> INIT without the port.
    let init = ModifyQp {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        access: Some(ALL_ACCESS),
        ..Default::default()
    };
    let mut no_port = init;
    no_port.port = None;
    assert_eq!(
        net.modify(&a, &no_port),
        Err(VerbsError::MissingAttributes { from: QpState::Reset, to: QpState::Init, mask: mask::PORT })
    );
    assert_eq!(net.state(&a), QpState::Reset);
    net.modify(&a, &init).unwrap();
    // INIT -> RTS skips RTR.
    assert_eq!(
        net.modify(&a, &to(QpState::Rts)),
        Err(VerbsError::IllegalTransition { from: QpState::Init, to: QpState::Rts })
    );
    // INIT -> RTR with an SQ PSN (an RTS attribute).
    let mut extra = rtr;
    extra.sq_psn = Some(Psn::new(1));
    assert_eq!(
        net.modify(&a, &extra),
        Err(VerbsError::UnexpectedAttributes { from: QpState::Init, to: QpState::Rtr, mask: mask::SQ_PSN })
    );
    let mut no_dest = rtr;
    no_dest.dest_qpn = None;
    no_dest.rq_psn = None;
    assert_eq!(
        net.modify(&a, &no_dest),
        Err(VerbsError::MissingAttributes {
            from: QpState::Init,
            to: QpState::Rtr,
            mask: mask::DEST_QPN | mask::RQ_PSN
        })
    );
    // Out-of-range values.
    let mut bad = rtr;
    bad.min_rnr_timer = Some(32);
    assert_eq!(net.modify(&a, &bad), Err(VerbsError::InvalidAttribute("min_rnr_timer")));
    assert_eq!(net.state(&a), QpState::Init);
    net.modify(&a, &rtr).unwrap();
    // RTR -> RTS without the retry attributes.
    let rts = ModifyQp { state: Some(QpState::Rts), sq_psn: Some(Psn::new(0)), ..Default::default() };
    assert_eq!(
        net.modify(&a, &rts),
        Err(VerbsError::MissingAttributes {
            from: QpState::Rtr,
            to: QpState::Rts,
            mask: mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC
        })
    );
    // A wrong asserted current state.
    let mut cur = to(QpState::Err);
    cur.cur_state = Some(QpState::Rts);
    assert_eq!(net.modify(&a, &cur), Err(VerbsError::InvalidAttribute("cur_state")));
    assert_eq!(net.state(&a), QpState::Rtr);
    // Posting a send before RTS is refused.
    let ma = net.reg(&a, 64, ALL_ACCESS, 0);
    assert_eq!(net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 8)])), Err(VerbsError::InvalidState(QpState::Rtr)));
    // ERR -> RTS is illegal; ERR -> RESET is fine.
    net.modify(&a, &to(QpState::Err)).unwrap();
    assert!(matches!(net.modify(&a, &rts), Err(VerbsError::IllegalTransition { .. })));
    net.modify(&a, &to(QpState::Reset)).unwrap();
    assert_eq!(net.state(&a), QpState::Reset);
    assert_eq!(net.send_wcs(&a), vec![]);
}

#[test]
fn reset_clears_queues_without_completions() {
    let mut net = net("reset_clears", Impairments { loss: 1.0, ..Impairments::NONE }, 41);
    let o = ConnOpts::default();
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0);
    for i in 0..5 {
        net.post_send(&a, wr(i, SendOp::Send, &[ma.sge(0, 100)])).unwrap();
        net.post_recv(&a, recv(10 + i, &[ma.sge(0, 100)])).unwrap();
    }
    net.run_for(Duration::from_millis(3));
    let q = net.nodes[0].hca.query_qp(a.qpn).unwrap();
    assert_eq!((q.sq_outstanding, q.rq_posted), (5, 5));
    net.modify(&a, &to(QpState::Reset)).unwrap();
    net.modify(&b, &to(QpState::Reset)).unwrap();
    let q = net.nodes[0].hca.query_qp(a.qpn).unwrap();
    assert_eq!((q.state, q.sq_outstanding, q.rq_posted), (QpState::Reset, 0, 0));
    assert_eq!(net.send_wcs(&a), vec![]);
    assert_eq!(net.recv_wcs(&a), vec![]);
    assert_eq!(net.nodes[0].hca.poll_timeout(), None);
    // Brought up again (new PSNs), the pair works.
    net.imp.loss = 0.0;
    net.bring_up(&a, &b, &o, 0x500, 0x900);
    net.bring_up(&b, &a, &o, 0x900, 0x500);
    let data = pattern(4, 3000);
    net.fill(&ma, 0, &data);
    net.post_recv(&b, recv(20, &[mb.sge(0, 4096)])).unwrap();
    net.post_send(&a, wr(5, SendOp::Send, &[ma.sge(0, 3000)])).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(5, WcStatus::Success, WcOpcode::Send, 3000)]);
    assert_wcs(&net.recv_wcs(&b), &[(20, WcStatus::Success, WcOpcode::Recv, 3000)]);
    assert_eq!(&net.bytes(&mb)[..3000], &data[..]);
}

#[test]
fn sqd_drains_then_rts_continues() {
    // A small window keeps the first message in flight while SQD is entered.
    let config = Config { max_inflight_packets: 4, ..Config::default() };
    let mut net = net_with("sqd", config, Impairments::NONE, 42);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 65536, ALL_ACCESS, 0);
    let mb = net.reg(&b, 65536, ALL_ACCESS, 0);
    let data = pattern(6, 32768);
    net.fill(&ma, 0, &data);
    let w = |off: usize| SendOp::Write { remote_addr: mb.at(off), rkey: mb.key };
    net.post_send(&a, wr(1, w(0), &[ma.sge(0, 16384)])).unwrap();
    net.run_for(Duration::from_micros(1));
    let mut sqd = to(QpState::Sqd);
    sqd.en_sqd_async_notify = Some(true);
    net.modify(&a, &sqd).unwrap();
    assert_eq!(net.state(&a), QpState::Sqd);
    // Posting in SQD is allowed; the WQE does not start.
    net.post_send(&a, wr(2, w(16384), &[ma.sge(16384, 16384)])).unwrap();
    let psn2 = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaWrite, 16384)]);
    assert_eq!(net.events(0), vec![AsyncEvent::SqDrained(a.qpn)]);
    assert!(net.frames().iter().all(|f| f.from != 0 || f.psn.before(psn2)));
    assert_eq!(net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_outstanding, 1);
    assert!(net.bytes(&mb)[16384..].iter().all(|&x| x == 0));
    // SQD -> SQD is legal and raises nothing more.
    net.modify(&a, &to(QpState::Sqd)).unwrap();
    assert_eq!(net.events(0), vec![]);
    net.modify(&a, &to(QpState::Rts)).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(2, WcStatus::Success, WcOpcode::RdmaWrite, 16384)]);
    assert_eq!(&net.bytes(&mb)[..32768], &data[..]);
    assert_eq!(net.events(0), vec![]);
}

#[test]
fn sqd_without_notify_and_with_a_read_outstanding() {
    let mut net = net("sqd_read", Impairments::NONE, 43);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0);
    let data = pattern(1, 4096);
    net.fill(&mb, 0, &data);
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    net.post_send(&a, wr(1, read, &[ma.sge(0, 4096)])).unwrap();
    net.run_for(Duration::from_nanos(1));
    let mut sqd = to(QpState::Sqd);
    sqd.en_sqd_async_notify = Some(true);
    net.modify(&a, &sqd).unwrap();
    // Not drained while the read's responses are outstanding.
    assert_eq!(net.events(0), vec![]);
    net.settle();
    assert_eq!(net.events(0), vec![AsyncEvent::SqDrained(a.qpn)]);
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaRead, 4096)]);
    assert_eq!(&net.bytes(&ma)[..4096], &data[..]);
    // Without notify: no event.
    net.modify(&a, &to(QpState::Rts)).unwrap();
    net.modify(&a, &to(QpState::Sqd)).unwrap();
    net.settle();
    assert_eq!(net.events(0), vec![]);
}

/// Watch requests and responses on the wire: the most reads/atomics ever outstanding at once.
fn watch_rd_atomic(net: &mut softrdma_sim::Net) -> Rc<Cell<(u32, u32)>> {
    let cell = Rc::new(Cell::new((0u32, 0u32))); // (outstanding, max)
    let c = cell.clone();
    net.filter = Some(Box::new(move |from, _, f| {
        let p = IbPacket::new_checked(&f[..]).unwrap();
        let info = p.info();
        let (mut cur, mut max) = c.get();
        if from == 0 && (info.is(Flags::READ) || info.is(Flags::ATOMIC)) && !info.is(Flags::RESP) {
            cur += 1;
            max = max.max(cur);
        }
        let b = p.bth().opcode().base();
        if from == 1
            && (b == base::READ_RESPONSE_LAST || b == base::READ_RESPONSE_ONLY || b == base::ATOMIC_ACKNOWLEDGE)
        {
            cur -= 1;
        }
        c.set((cur, max));
        true
    }));
    cell
}

#[test]
fn max_rd_atomic_bounds_outstanding_reads_and_atomics() {
    for depth in [1u8, 2, 4] {
        let mut net = net(&format!("max_rd_atomic_{depth}"), Impairments::NONE, 44);
        let o = ConnOpts { rd_atomic: depth, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 65536, ALL_ACCESS, 0);
        let mb = net.reg(&b, 65536, ALL_ACCESS, 0);
        let data = pattern(2, 8 * 3000);
        net.fill(&mb, 0, &data);
        let seen = watch_rd_atomic(&mut net);
        let mut want = Vec::new();
        for i in 0..8u64 {
            let off = i as usize * 3000;
            let op = if i % 3 == 2 {
                SendOp::FetchAdd { remote_addr: mb.at(32768 + off / 375), rkey: mb.key, add: 1 }
            } else {
                SendOp::Read { remote_addr: mb.at(off), rkey: mb.key }
            };
            let (len, opc) = if op.is_atomic() { (8, WcOpcode::FetchAdd) } else { (3000, WcOpcode::RdmaRead) };
            net.post_send(&a, wr(i, op, &[ma.sge(off, len)])).unwrap();
            want.push((i, WcStatus::Success, opc, len as u32));
        }
        net.settle();
        assert_wcs(&net.send_wcs(&a), &want);
        assert_eq!(seen.get(), (0, u32::from(depth)), "depth {depth}");
        for i in (0..8).filter(|i| i % 3 != 2) {
            let r = i * 3000..i * 3000 + 3000;
            assert_eq!(&net.bytes(&ma)[r.clone()], &data[r]);
        }
    }
}

#[test]
fn fence_waits_for_earlier_reads() {
    let mut net = net("fence", Impairments::NONE, 45);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 65536, ALL_ACCESS, 0);
    let mb = net.reg(&b, 65536, ALL_ACCESS, 0);
    let data = pattern(8, 8192);
    net.fill(&mb, 0, &data);
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    let w = |off: usize| SendOp::Write { remote_addr: mb.at(off), rkey: mb.key };
    net.post_send(&a, wr(1, read, &[ma.sge(0, 8192)])).unwrap();
    net.post_send(&a, wr(2, w(16384), &[ma.sge(32768, 10)])).unwrap();
    let fenced = flagged(wr(3, w(20000), &[ma.sge(32768, 10)]), SendFlags::FENCE);
    net.post_send(&a, fenced).unwrap();
    let psn0 = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    net.settle();
    assert_wcs(
        &net.send_wcs(&a),
        &[
            (1, WcStatus::Success, WcOpcode::RdmaRead, 8192),
            (2, WcStatus::Success, WcOpcode::RdmaWrite, 10),
            (3, WcStatus::Success, WcOpcode::RdmaWrite, 10),
        ],
    );
    let frames = net.frames();
    let at = |pred: &dyn Fn(&Frame) -> bool| frames.iter().find(|f| pred(f)).unwrap().at;
    let t0 = at(&|f| f.from == 0 && f.psn == psn0);
    // The unfenced write goes right behind the read request...
    assert_eq!(at(&|f| f.from == 0 && f.psn == psn0.add(8)), t0);
    // ...the fenced one only once the last read response has arrived.
    let last_resp = at(&|f| f.from == 1 && f.base == base::READ_RESPONSE_LAST);
    assert_eq!(at(&|f| f.from == 0 && f.psn == psn0.add(9)), last_resp + DELAY);
    assert_eq!(&net.bytes(&ma)[..8192], &data[..]);
}

#[test]
fn lost_atomic_ack_is_answered_from_the_replay_cache() {
    let mut net = net("atomic_replay", Impairments::NONE, 46);
    let o = ConnOpts { rd_atomic: 2, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0);
    net.fill(&mb, 0, &1000u64.to_ne_bytes());
    // Lose the first atomic acknowledgement.
    let lost = Rc::new(Cell::new(false));
    let l = lost.clone();
    net.filter = Some(Box::new(move |from, _, f| {
        let p = IbPacket::new_checked(&f[..]).unwrap();
        if from == 1 && p.bth().opcode().base() == base::ATOMIC_ACKNOWLEDGE && !l.get() {
            l.set(true);
            return false;
        }
        true
    }));
    let fa = |add| SendOp::FetchAdd { remote_addr: mb.at(0), rkey: mb.key, add };
    net.post_send(&a, wr(1, fa(1), &[ma.sge(0, 8)])).unwrap();
    net.post_send(&a, wr(2, fa(10), &[ma.sge(8, 8)])).unwrap();
    net.settle();
    assert!(lost.get());
    assert_wcs(
        &net.send_wcs(&a),
        &[(1, WcStatus::Success, WcOpcode::FetchAdd, 8), (2, WcStatus::Success, WcOpcode::FetchAdd, 8)],
    );
    // Executed once each: the replays returned the original values.
    assert_eq!(net.word(&ma, 0), 1000);
    assert_eq!(net.word(&ma, 8), 1001);
    assert_eq!(net.word(&mb, 0), 1011);
    assert!(net.nodes[1].hca.counters().duplicate_request >= 1);
}

/// Re-inject copies of old atomic requests: the two most recent (max_dest_rd_atomic = 2) are
/// answered from the cache with their original values; an older one is not answered at all;
/// memory is never touched again.
#[test]
fn atomic_replay_cache_holds_max_dest_rd_atomic_entries() {
    let mut net = net("atomic_cache", Impairments::NONE, 47);
    let o = ConnOpts { rd_atomic: 2, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0);
    net.fill(&mb, 0, &5u64.to_ne_bytes());
    for i in 0..3u64 {
        let op = SendOp::CompareSwap { remote_addr: mb.at(0), rkey: mb.key, compare: 5 + i, swap: 6 + i };
        net.post_send(&a, wr(i, op, &[ma.sge(i as usize * 8, 8)])).unwrap();
    }
    net.settle();
    assert_eq!(net.send_wcs(&a).len(), 3);
    assert_eq!(net.word(&mb, 0), 8);
    let reqs: Vec<Frame> = net.frames().into_iter().filter(|f| f.from == 0 && f.is(Flags::ATOMIC)).collect();
    assert_eq!(reqs.len(), 3);
    net.fill(&mb, 0, &5u64.to_ne_bytes()); // would make a re-executed CAS #0 succeed
    let answers = |net: &mut softrdma_sim::Net, i: usize| {
        let before = net.capture.len();
        net.inject(0, 1, reqs[i].raw.clone());
        net.settle();
        net.capture
            .iter()
            .skip(before)
            .filter(|c| c.from == 1 && c.fate == Fate::Launched)
            .map(|c| {
                let p = IbPacket::new_checked(&c.frame[..]).unwrap();
                (p.bth().psn(), p.atomic_ack_eth().map(|x| x.orig()))
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(answers(&mut net, 2), vec![(reqs[2].psn, Some(7))]);
    assert_eq!(answers(&mut net, 1), vec![(reqs[1].psn, Some(6))]);
    assert_eq!(answers(&mut net, 0), vec![], "evicted: not answered, not executed");
    assert_eq!(net.word(&mb, 0), 5);
    assert_eq!(net.send_wcs(&a), vec![]);
    assert_eq!(net.state(&a), QpState::Rts);
    assert_eq!(net.state(&b), QpState::Rts);
}
