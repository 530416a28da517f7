//! Duplicates: a read re-executed from the requested PSN, sends and writes re-ACKed and never
//! delivered twice (checked against buffers changed in between), and corrupted packets dropped by
//! the ICRC check with the transfer recovering.

use core::time::Duration;
use std::cell::Cell;
use std::rc::Rc;

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Impairments, Net};
use softrdma_transport::{QpState, SendOp, WcOpcode, WcStatus};
use softrdma_wire::opcode::{base, Flags};
use softrdma_wire::{IbPacket, Syndrome};

use crate::{net, pair};

/// Drop the first frame from `node` that `pred` picks.
fn drop_once(net: &mut Net, node: usize, pred: impl Fn(&IbPacket<&[u8]>) -> bool + 'static) -> Rc<Cell<bool>> {
    let done = Rc::new(Cell::new(false));
    let d = done.clone();
    net.filter = Some(Box::new(move |from, _, f| {
        let p = IbPacket::new_checked(&f[..]).unwrap();
        if from == node && !d.get() && pred(&p) {
            d.set(true);
            return false;
        }
        true
    }));
    done
}

#[test]
fn lost_read_response_restarts_the_read_at_its_psn() {
    let mut net = net("dup_read", Impairments::NONE, 50);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0x11);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0);
    let data = pattern(12, 4096);
    net.fill(&mb, 0, &data);
    let psn0 = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    let dropped = drop_once(&mut net, 1, move |p| p.bth().psn() == psn0.add(1));
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    net.post_send(&a, wr(1, read, &[ma.sge(100, 4096)])).unwrap();
    net.settle();
    assert!(dropped.get());
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaRead, 4096)]);
    let m = net.bytes(&ma);
    assert_eq!(&m[100..4196], &data[..]);
    assert!(m[..100].iter().chain(&m[4196..]).all(|&x| x == 0x11));
    // The requests on the wire: the read, then the read again from the lost PSN for the rest.
    let reqs: Vec<_> = net.frames().into_iter().filter(|f| f.from == 0).map(|f| (f.psn, f.reth)).collect();
    assert_eq!(reqs, vec![(psn0, Some((mb.at(0), mb.key, 4096))), (psn0.add(1), Some((mb.at(1024), mb.key, 3072))),]);
    // The responder answered the second request as FIRST..LAST from that PSN.
    let resps: Vec<_> = net.frames().into_iter().filter(|f| f.from == 1).map(|f| (f.psn, f.base)).collect();
    assert_eq!(
        resps,
        vec![
            (psn0, base::READ_RESPONSE_FIRST),
            (psn0.add(1), base::READ_RESPONSE_MIDDLE),
            (psn0.add(2), base::READ_RESPONSE_MIDDLE),
            (psn0.add(3), base::READ_RESPONSE_LAST),
            (psn0.add(1), base::READ_RESPONSE_FIRST),
            (psn0.add(2), base::READ_RESPONSE_MIDDLE),
            (psn0.add(3), base::READ_RESPONSE_LAST),
        ]
    );
    assert_eq!(net.nodes[1].hca.counters().duplicate_request, 1);
}

/// A duplicated read request is executed again (reads current memory), not replayed.
#[test]
fn duplicate_read_reads_memory_again() {
    let mut net = net("dup_read_again", Impairments::NONE, 51);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0);
    net.fill(&mb, 0, &pattern(1, 2000));
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    net.post_send(&a, wr(1, read, &[ma.sge(0, 2000)])).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaRead, 2000)]);
    let req = net.frames().into_iter().find(|f| f.from == 0).unwrap();
    let fresh = pattern(99, 2000);
    net.fill(&mb, 0, &fresh);
    let before = net.capture.len();
    net.inject(0, 1, req.raw.clone());
    net.settle();
    let payload: Vec<u8> = net
        .capture
        .iter()
        .skip(before)
        .filter(|c| c.from == 1)
        .flat_map(|c| IbPacket::new_checked(&c.frame[..]).unwrap().payload().to_vec())
        .collect();
    assert_eq!(payload, fresh);
    // The requester ignores the stray responses; its buffer keeps the first read's data.
    assert_eq!(&net.bytes(&ma)[..2000], &pattern(1, 2000)[..]);
    assert_eq!(net.nodes[0].hca.counters().drop_stray_resp, 2);
    assert_eq!(net.send_wcs(&a), vec![]);
    assert_eq!(net.state(&a), QpState::Rts);
}

/// The ACK of a SEND and of a WRITE is lost; while the requester waits for its timeout, the
/// receive buffer and the write target are changed. The retransmissions are re-ACKed and not
/// delivered again: no second receive completion, no rewrite.
#[test]
fn duplicate_send_and_write_are_acked_not_redelivered() {
    for write in [false, true] {
        let mut net = net(&format!("dup_sendwrite_{write}"), Impairments::NONE, 52);
        let o = ConnOpts { timeout: 8, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
        let mb = net.reg(&b, 8192, ALL_ACCESS, 0x33);
        let data = pattern(21, 3000);
        net.fill(&ma, 0, &data);
        net.post_recv(&b, recv(1, &[mb.sge(0, 4096)])).unwrap();
        net.post_recv(&b, recv(2, &[mb.sge(4096, 4096)])).unwrap();
        let dropped = drop_once(&mut net, 1, |p| p.info().is(Flags::ACK));
        let (op, opc) = if write {
            let op = SendOp::Write { remote_addr: mb.at(0), rkey: mb.key };
            (op, WcOpcode::RdmaWrite)
        } else {
            (SendOp::Send, WcOpcode::Send)
        };
        net.post_send(&a, wr(7, op, &[ma.sge(0, 3000)])).unwrap();
        net.run_for(Duration::from_micros(20));
        assert!(dropped.get());
        assert_eq!(&net.bytes(&mb)[..3000], &data[..]);
        let changed = vec![0x44u8; 3000];
        net.fill(&mb, 0, &changed);
        net.settle();
        assert_wcs(&net.send_wcs(&a), &[(7, WcStatus::Success, opc, 3000)]);
        if write {
            assert_wcs(&net.recv_wcs(&b), &[]);
        } else {
            assert_wcs(&net.recv_wcs(&b), &[(1, WcStatus::Success, WcOpcode::Recv, 3000)]);
        }
        let m = net.bytes(&mb);
        assert_eq!(&m[..3000], &changed[..], "rewritten by a duplicate");
        assert!(m[3000..].iter().all(|&x| x == 0x33));
        assert_eq!(net.nodes[1].hca.query_qp(b.qpn).unwrap().rq_posted, if write { 2 } else { 1 });
        assert_eq!(net.nodes[1].hca.counters().duplicate_request, 3);
        // Three packets went twice; each duplicate last packet was ACKed.
        let acks: Vec<_> = net.frames().into_iter().filter(|f| f.from == 1).map(|f| (f.psn, f.syndrome)).collect();
        let psn0 = net.frames()[0].psn;
        let ack = Some(Syndrome::Ack { credits: 0x1f });
        assert_eq!(acks, vec![(psn0.add(2), ack), (psn0.add(2), ack)]);
    }
}

/// Flip one bit of a chosen frame: the receiver's ICRC check drops it and the transfer recovers.
fn corrupt_once(net: &mut Net, node: usize, pred: impl Fn(&IbPacket<&[u8]>) -> bool + 'static) -> Rc<Cell<bool>> {
    let done = Rc::new(Cell::new(false));
    let d = done.clone();
    net.filter = Some(Box::new(move |from, _, f| {
        let hit = {
            let p = IbPacket::new_checked(&f[..]).unwrap();
            from == node && !d.get() && pred(&p)
        };
        if hit {
            d.set(true);
            let i = f.len() / 2;
            f[i] ^= 0x10;
        }
        true
    }));
    done
}

#[test]
fn corrupted_packets_are_dropped_and_recovered() {
    type Pick = fn(&IbPacket<&[u8]>) -> bool;
    let cases: [(&str, usize, Pick); 4] = [
        ("first_of_message", 0, |p| p.bth().opcode().base() == base::SEND_FIRST),
        ("ack", 1, |p| p.bth().opcode().base() == base::ACKNOWLEDGE),
        ("read_response", 1, |p| p.bth().opcode().base() == base::READ_RESPONSE_MIDDLE),
        ("atomic_ack", 1, |p| p.bth().opcode().base() == base::ATOMIC_ACKNOWLEDGE),
    ];
    for (name, node, pick) in cases {
        let mut net = net(&format!("corrupt_{name}"), Impairments::NONE, 53);
        let (a, b) = pair(&mut net, &ConnOpts::default());
        let ma = net.reg(&a, 16384, ALL_ACCESS, 0);
        let mb = net.reg(&b, 16384, ALL_ACCESS, 0);
        let sdata = pattern(31, 3000);
        let rdata = pattern(32, 3000);
        net.fill(&ma, 0, &sdata);
        net.fill(&mb, 8192, &rdata);
        net.fill(&mb, 12288, &77u64.to_ne_bytes());
        let hit = corrupt_once(&mut net, node, pick);
        net.post_recv(&b, recv(1, &[mb.sge(0, 4096)])).unwrap();
        net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 3000)])).unwrap();
        let read = SendOp::Read { remote_addr: mb.at(8192), rkey: mb.key };
        net.post_send(&a, wr(2, read, &[ma.sge(4096, 3000)])).unwrap();
        let fa = SendOp::FetchAdd { remote_addr: mb.at(12288), rkey: mb.key, add: 3 };
        net.post_send(&a, wr(3, fa, &[ma.sge(8192, 8)])).unwrap();
        net.settle();
        assert!(hit.get(), "{name}");
        assert_eq!(net.stats.icrc_dropped, 1, "{name}");
        assert_wcs(
            &net.send_wcs(&a),
            &[
                (1, WcStatus::Success, WcOpcode::Send, 3000),
                (2, WcStatus::Success, WcOpcode::RdmaRead, 3000),
                (3, WcStatus::Success, WcOpcode::FetchAdd, 8),
            ],
        );
        assert_wcs(&net.recv_wcs(&b), &[(1, WcStatus::Success, WcOpcode::Recv, 3000)]);
        assert_eq!(&net.bytes(&mb)[..3000], &sdata[..], "{name}");
        assert_eq!(&net.bytes(&ma)[4096..7096], &rdata[..], "{name}");
        assert_eq!(net.word(&ma, 8192), 77, "{name}");
        assert_eq!(net.word(&mb, 12288), 80, "{name}");
    }
}
