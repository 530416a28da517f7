//! A dead peer (transport retries exhausted) and receiver-not-ready (RNR retries), with exact timing
//! in virtual time.

use core::time::Duration;

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Fate, Impairments};
use softrdma_transport::{QpState, SendOp, WcOpcode, WcStatus};
use softrdma_wire::aeth::rnr_timer_micros;
use softrdma_wire::opcode::Flags;
use softrdma_wire::Syndrome;

use crate::{net, pair};

const DELAY: Duration = Impairments::NONE.delay;

fn dead() -> Impairments {
    Impairments { loss: 1.0, ..Impairments::NONE }
}

/// The local ACK timeout for an encoded `timeout`: 4.096 µs × 2^timeout.
fn ack_timeout(timeout: u8) -> Duration {
    Duration::from_nanos(4096 << timeout)
}

#[test]
fn dead_peer_retry_exceeded_then_flush() {
    for retry_cnt in [0u8, 1, 3, 6] {
        let timeout = 10;
        let mut net = net(&format!("dead_peer_retry{retry_cnt}"), dead(), 1);
        let o = ConnOpts { retry_cnt, timeout, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 8192, ALL_ACCESS, 0xaa);
        let mb = net.reg(&b, 8192, ALL_ACCESS, 0xbb);
        net.post_recv(&a, recv(100, &[ma.sge(4096, 1024)])).unwrap();
        net.post_recv(&a, recv(101, &[ma.sge(5120, 1024)])).unwrap();
        net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 3000)])).unwrap();
        let write = SendOp::Write { remote_addr: mb.at(0), rkey: mb.key };
        net.post_send(&a, unsignaled(wr(2, write, &[ma.sge(0, 100)]))).unwrap();
        let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
        net.post_send(&a, wr(3, read, &[ma.sge(0, 64)])).unwrap();
        net.post_send(&a, unsignaled(wr(4, SendOp::Send, &[ma.sge(0, 10)]))).unwrap();
        let first_psn = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
        let t0 = net.now;
        let t = ack_timeout(timeout);
        let fail_at = t0 + t * (u32::from(retry_cnt) + 1);

        // Nothing completes until the last retry has timed out.
        net.run_to(just_before(fail_at));
        assert_wcs(&net.send_wcs(&a), &[]);
        assert_eq!(net.state(&a), QpState::Rts);
        net.run_to(fail_at);
        assert_wcs(
            &net.send_wcs(&a),
            &[
                (1, WcStatus::RetryExcErr, WcOpcode::Send, 0),
                (2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
                (3, WcStatus::WrFlushErr, WcOpcode::RdmaRead, 0),
                (4, WcStatus::WrFlushErr, WcOpcode::Send, 0),
            ],
        );
        assert_wcs(
            &net.recv_wcs(&a),
            &[(100, WcStatus::WrFlushErr, WcOpcode::Recv, 0), (101, WcStatus::WrFlushErr, WcOpcode::Recv, 0)],
        );
        assert_eq!(net.state(&a), QpState::Err);
        assert_eq!(net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_outstanding, 0);

        // The first packet went out once and then once per retry, one ACK timeout apart.
        let sends: Vec<_> = net.frames().into_iter().filter(|f| f.from == 0 && f.psn == first_psn).collect();
        assert_eq!(sends.len(), usize::from(retry_cnt) + 1);
        for (k, f) in sends.iter().enumerate() {
            assert_eq!(f.at, t0 + t * k as u32, "attempt {k}");
            assert_eq!(f.fate, Fate::Lost);
            assert!(f.is(Flags::SEND) && f.is(Flags::FIRST));
        }
        assert_eq!(net.nodes[0].hca.counters().ack_timeouts, u64::from(retry_cnt) + 1);

        // Posting to a QP in ERR completes at once, flushed, signaled or not.
        net.post_send(&a, unsignaled(wr(5, SendOp::Send, &[ma.sge(0, 10)]))).unwrap();
        net.post_send(&a, wr(6, read, &[ma.sge(0, 8)])).unwrap();
        net.post_recv(&a, recv(102, &[ma.sge(0, 8)])).unwrap();
        assert_wcs(
            &net.send_wcs(&a),
            &[(5, WcStatus::WrFlushErr, WcOpcode::Send, 0), (6, WcStatus::WrFlushErr, WcOpcode::RdmaRead, 0)],
        );
        assert_wcs(&net.recv_wcs(&a), &[(102, WcStatus::WrFlushErr, WcOpcode::Recv, 0)]);
        // Nothing more is sent and nothing more happens.
        let frames = net.capture.len();
        net.settle();
        assert_eq!(net.capture.len(), frames);
        assert_eq!(net.nodes[0].hca.poll_timeout(), None);
        // The peer never heard anything: untouched.
        assert_eq!(net.state(&b), QpState::Rts);
        assert!(net.bytes(&mb).iter().all(|&x| x == 0xbb));
        assert_wcs(&net.recv_wcs(&b), &[]);
    }
}

/// retry_cnt 7 keeps retrying (as rxe does) until the peer comes back.
#[test]
fn retry_cnt_7_outlasts_an_outage() {
    let mut net = net("retry7", dead(), 2);
    let o = ConnOpts { timeout: 4, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0xbb);
    let data = pattern(3, 2500);
    net.fill(&ma, 0, &data);
    net.post_recv(&b, recv(7, &[mb.sge(0, 4096)])).unwrap();
    net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 2500)])).unwrap();
    net.run_for(ack_timeout(4) * 20);
    assert_wcs(&net.send_wcs(&a), &[]);
    assert!(net.nodes[0].hca.counters().ack_timeouts >= 19);
    net.imp.loss = 0.0;
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::Send, 2500)]);
    assert_wcs(&net.recv_wcs(&b), &[(7, WcStatus::Success, WcOpcode::Recv, 2500)]);
    assert_eq!(&net.bytes(&mb)[..2500], &data[..]);
    assert!(net.bytes(&mb)[2500..].iter().all(|&x| x == 0xbb));
}

/// RNR NAK frames sent by node `from`, with their timer code.
fn rnr_naks(net: &softrdma_sim::Net, from: usize) -> Vec<(softrdma_transport::Instant, u8)> {
    net.frames()
        .into_iter()
        .filter(|f| f.from == from)
        .filter_map(|f| match f.syndrome {
            Some(Syndrome::RnrNak { timer }) if f.is(Flags::ACK) => Some((f.at, timer)),
            _ => None,
        })
        .collect()
}

#[test]
fn rnr_retry_exceeded_with_the_encoded_timer() {
    for (rnr_retry, code) in [(0u8, 1u8), (3, 14), (5, 0x1f)] {
        let mut net = net(&format!("rnr_exc_{rnr_retry}_{code}"), Impairments::NONE, 3);
        // retry_cnt 0: the sequence-error NAK the responder sends for the packets that followed
        // the RNR'd one must not cost a transport retry.
        let o = ConnOpts { rnr_retry, retry_cnt: 0, min_rnr_timer: code, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 4096, ALL_ACCESS, 0x11);
        let mb = net.reg(&b, 4096, ALL_ACCESS, 0x22);
        net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 100)])).unwrap();
        let write = SendOp::Write { remote_addr: mb.at(0), rkey: mb.key };
        net.post_send(&a, wr(2, write, &[ma.sge(0, 100)])).unwrap();
        net.post_send(&a, unsignaled(wr(3, SendOp::Send, &[ma.sge(0, 1)]))).unwrap();
        let first_psn = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
        let t0 = net.now;
        let wait = Duration::from_micros(u64::from(rnr_timer_micros(code)));
        let round = DELAY * 2 + wait;
        let fail_at = t0 + round * u32::from(rnr_retry) + DELAY * 2;
        net.run_to(just_before(fail_at));
        assert_wcs(&net.send_wcs(&a), &[]);
        net.run_to(fail_at);
        assert_wcs(
            &net.send_wcs(&a),
            &[
                (1, WcStatus::RnrRetryExcErr, WcOpcode::Send, 0),
                (2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
                (3, WcStatus::WrFlushErr, WcOpcode::Send, 0),
            ],
        );
        assert_eq!(net.state(&a), QpState::Err);
        net.settle();
        // The responder is fine: an RNR is not an error on its side.
        assert_eq!(net.state(&b), QpState::Rts);
        assert_wcs(&net.recv_wcs(&b), &[]);
        let naks = rnr_naks(&net, 1);
        assert_eq!(naks.len(), usize::from(rnr_retry) + 1);
        let sends: Vec<_> =
            net.frames().into_iter().filter(|f| f.from == 0 && f.psn == first_psn).map(|f| f.at).collect();
        let want: Vec<_> = (0..=u32::from(rnr_retry)).map(|k| t0 + round * k).collect();
        assert_eq!(sends, want, "SEND attempts one RNR wait apart");
        for (k, (at, timer)) in naks.iter().enumerate() {
            assert_eq!(*timer, code);
            assert_eq!(*at, t0 + round * k as u32 + DELAY);
        }
        assert!(net.bytes(&mb).iter().all(|&x| x == 0x22));
        assert_eq!(net.nodes[1].hca.counters().send_rnr_nak, u64::from(rnr_retry) + 1);
    }
}

#[test]
fn rnr_infinite_until_a_receive_is_posted() {
    let mut net = net("rnr_infinite", Impairments::NONE, 4);
    let o = ConnOpts {
        rnr_retry: 7,
        min_rnr_timer: 5, // 60 µs
        ..ConnOpts::default()
    };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0x5a);
    let data = pattern(9, 3000);
    net.fill(&ma, 0, &data);
    net.post_send(&a, wr(1, SendOp::SendWithImm(0xfeed), &[ma.sge(0, 3000)])).unwrap();
    net.run_for(Duration::from_millis(5));
    let naks = net.nodes[1].hca.counters().send_rnr_nak;
    // 5 ms / (60 µs + 2 × 2 µs) ≈ 78 rounds.
    assert_eq!(naks, 5000 / 64 + 1);
    assert_wcs(&net.send_wcs(&a), &[]);
    assert!(net.bytes(&mb).iter().all(|&x| x == 0x5a));
    net.post_recv(&b, recv(9, &[mb.sge(100, 4000)])).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::Send, 3000)]);
    let r = net.recv_wcs(&b);
    assert_wcs(&r, &[(9, WcStatus::Success, WcOpcode::Recv, 3000)]);
    assert_eq!(r[0].imm, 0xfeed);
    let m = net.bytes(&mb);
    assert_eq!(&m[100..3100], &data[..]);
    assert!(m[..100].iter().chain(&m[3100..]).all(|&x| x == 0x5a));
    assert_eq!(net.state(&a), QpState::Rts);
    assert_eq!(net.state(&b), QpState::Rts);
}

#[test]
fn write_with_immediate_without_a_receive_is_rnr() {
    // One packet and three packets (MTU 1024): memory is untouched until a receive exists.
    for len in [500usize, 2500] {
        let mut net = net(&format!("rnr_write_imm_{len}"), Impairments::NONE, 5);
        let o = ConnOpts { min_rnr_timer: 3, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
        let mb = net.reg(&b, 4096, ALL_ACCESS, 0x77);
        let data = pattern(1, len);
        net.fill(&ma, 0, &data);
        let op = SendOp::WriteWithImm { remote_addr: mb.at(16), rkey: mb.key, imm: 0x1234_5678 };
        net.post_send(&a, wr(1, op, &[ma.sge(0, len)])).unwrap();
        net.run_for(Duration::from_millis(1));
        assert!(net.nodes[1].hca.counters().send_rnr_nak >= 10);
        assert_wcs(&net.send_wcs(&a), &[]);
        if len <= 1024 {
            assert!(net.bytes(&mb).iter().all(|&x| x == 0x77));
        }
        net.post_recv(&b, recv(3, &[])).unwrap();
        net.settle();
        assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaWrite, len as u32)]);
        let r = net.recv_wcs(&b);
        assert_wcs(&r, &[(3, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len as u32)]);
        assert_eq!(r[0].imm, 0x1234_5678);
        let m = net.bytes(&mb);
        assert_eq!(&m[16..16 + len], &data[..]);
        assert!(m[..16].iter().chain(&m[16 + len..]).all(|&x| x == 0x77));
    }
}

/// Receives trickle in while a stream of SENDs, WRITEs with immediate and reads runs over a lossy,
/// duplicating, reordering network: RNR NAKs interleave with sequence NAKs and timeouts, and
/// everything still completes exactly once, in order, with the right bytes.
#[test]
fn rnr_under_loss_with_late_receives() {
    let seeds: std::ops::Range<u64> = match std::env::var("RNR_SEEDS") {
        Ok(r) => {
            let (a, b) = r.split_once("..").expect("a..b");
            a.parse().unwrap()..b.parse().unwrap()
        }
        Err(_) => 0..12,
    };
    for seed in seeds {
        rnr_under_loss(seed);
    }
}

fn rnr_under_loss(seed: u64) {
    use softrdma_sim::Rng;
    let loss = [0.0, 0.02, 0.1][(seed % 3) as usize];
    let mut net = net(&format!("rnr_loss_{seed}"), Impairments::hostile(loss), 100 + seed);
    let o = ConnOpts {
        mtu: softrdma_transport::Mtu::M256,
        min_rnr_timer: 1 + (seed % 4) as u8,
        timeout: 5,
        ..ConnOpts::default()
    };
    let (a, b) = pair(&mut net, &o);
    let n = 40usize;
    let ma = net.reg(&a, n * 2048, ALL_ACCESS, 0);
    let mb = net.reg(&b, n * 2048, ALL_ACCESS, 0xee);
    let mut rng = Rng::new(seed);
    let mut src = vec![0u8; n * 2048];
    rng.fill(&mut src);
    net.fill(&ma, 0, &src);
    net.fill(&mb, 0, &src.iter().map(|x| !x).collect::<Vec<_>>());
    let rsrc = net.bytes(&mb).to_vec();
    let mut want_s = Vec::new();
    let mut want_r = Vec::new();
    for i in 0..n {
        let len = rng.below(1500) as usize;
        let off = i * 2048;
        let (op, opc) = match i % 4 {
            0 | 1 => (SendOp::Send, WcOpcode::Send),
            2 => (SendOp::WriteWithImm { remote_addr: mb.at(off), rkey: mb.key, imm: i as u32 }, WcOpcode::RdmaWrite),
            _ => (SendOp::Read { remote_addr: mb.at(off), rkey: mb.key }, WcOpcode::RdmaRead),
        };
        if i % 4 != 3 {
            let ropc = if i % 4 == 2 { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
            want_r.push((i as u64, WcStatus::Success, ropc, len as u32));
        }
        want_s.push((i as u64, WcStatus::Success, opc, len as u32));
        net.post_send(&a, wr(i as u64, op, &[ma.sge(off, len)])).unwrap();
    }
    let mut got_s = Vec::new();
    let mut got_r = Vec::new();
    for i in (0..n).filter(|i| i % 4 != 3) {
        net.run_for(Duration::from_micros(rng.below(300)));
        let sgl = if i % 4 == 2 { vec![] } else { vec![mb.sge(i * 2048, 2048)] };
        net.post_recv(&b, recv(i as u64, &sgl)).unwrap();
        got_s.extend(net.send_wcs(&a));
        got_r.extend(net.recv_wcs(&b));
    }
    net.run_until(Duration::from_secs(60), |n| {
        got_s.extend(n.send_wcs(&a));
        got_s.len() == want_s.len()
    });
    net.settle();
    got_r.extend(net.recv_wcs(&b));
    assert_wcs(&got_s, &want_s);
    assert_wcs(&got_r, &want_r);
    assert!(net.nodes[1].hca.counters().send_rnr_nak > 0, "seed {seed}: no RNR");
    for (i, w) in want_s.iter().enumerate() {
        let r = i * 2048..i * 2048 + w.3 as usize;
        if i % 4 == 3 {
            assert_eq!(&net.bytes(&ma)[r.clone()], &rsrc[r], "seed {seed} read {i}");
        } else {
            assert_eq!(&net.bytes(&mb)[r.clone()], &src[r], "seed {seed} op {i}");
        }
    }
}

/// The engine files a QP's retransmit timer lazily (an ACK that stops it leaves the entry where it
/// was): the stale entry must fire as a no-op, and a timer armed later must still fire exactly one
/// ACK timeout after its packet, not at the stale time. Once everything fired, no deadline is left.
#[test]
fn a_stopped_retransmit_timer_fires_nothing_and_a_later_one_fires_on_time() {
    let timeout = 10;
    let t = ack_timeout(timeout);
    let mut net = net("stale_retransmit_timer", Impairments::NONE, 1);
    let o = ConnOpts { timeout, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0xaa);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0xbb);
    net.post_recv(&b, recv(100, &[mb.sge(0, 64)])).unwrap();
    net.post_recv(&b, recv(101, &[mb.sge(64, 64)])).unwrap();

    // The first message is acknowledged at once: its timer stops, its entry (at t0 + t) stays.
    let t0 = net.now;
    net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 64)])).unwrap();
    net.run_for(DELAY * 4);
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::Send, 64)]);
    assert!(net.nodes[0].hca.poll_timeout().is_none_or(|d| d <= t0 + t));

    // Half a timeout later the second message is lost: its timer runs from t1.
    net.run_to(t0 + t / 2);
    net.imp.loss = 1.0;
    let t1 = net.now;
    let psn = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    net.post_send(&a, wr(2, SendOp::Send, &[ma.sge(64, 64)])).unwrap();

    // The stale entry comes due at t0 + t: nothing is resent, the QP is filed under t1 + t.
    net.run_to(t0 + t);
    assert_eq!(net.nodes[0].hca.counters().ack_timeouts, 0);
    assert_eq!(net.nodes[0].hca.poll_timeout(), Some(t1 + t));

    // The real timeout resends at t1 + t exactly; this time it gets through.
    net.imp.loss = 0.0;
    net.run_to(just_before(t1 + t));
    assert_eq!(net.nodes[0].hca.counters().ack_timeouts, 0);
    net.run_to(t1 + t);
    let sends: Vec<_> = net.frames().into_iter().filter(|f| f.from == 0 && f.psn == psn).map(|f| f.at).collect();
    assert_eq!(sends, vec![t1, t1 + t]);
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(2, WcStatus::Success, WcOpcode::Send, 64)]);
    assert_wcs(
        &net.recv_wcs(&b),
        &[(100, WcStatus::Success, WcOpcode::Recv, 64), (101, WcStatus::Success, WcOpcode::Recv, 64)],
    );
    assert_eq!(net.nodes[0].hca.counters().ack_timeouts, 1);
    assert_eq!(net.nodes[0].hca.poll_timeout(), None);
}
