//! The requester's RTT estimate and the retry probe it sets (adaptive window): seeded, in virtual
//! time, so the timings below are exact properties of the engine, not measurements.

use core::time::Duration;
use std::cell::RefCell;
use std::rc::Rc;

use softrdma_sim::{ConnOpts, Endpoint, Impairments, Net};
use softrdma_transport::wr::Payload;
use softrdma_transport::{Access, Config, SendFlags, SendOp, SendWr, Sge, WcStatus};

/// One-way delay of the simulated link: a round trip is 2 × this.
const DELAY: Duration = Duration::from_micros(250);

fn net(seed: u64) -> (Net, Endpoint, Endpoint, (u32, u64), (u32, u64)) {
    let config = Config { adaptive_window: true, ..Config::default() };
    let mut net = Net::new(2, config, Impairments { delay: DELAY, ..Impairments::NONE }, seed);
    // timeout 14: a local ACK timeout of 67 ms, far above any probe.
    let o = ConnOpts { timeout: 14, ..ConnOpts::default() };
    let (a, b) = net.connect(0, 1, &o);
    let rights = Access::REMOTE_WRITE.with(Access::LOCAL_WRITE);
    let ma = net.nodes[0].mem.register(a.pd, 1 << 20, rights);
    let mb = net.nodes[1].mem.register(b.pd, 1 << 20, rights);
    (net, a, b, ma, mb)
}

/// `n` WRITEs of `len` bytes from A to B, each signaled; runs until all complete.
fn writes(net: &mut Net, a: &Endpoint, ma: (u32, u64), mb: (u32, u64), n: u64, len: u32, first_id: u64) {
    for i in 0..n {
        let wr = SendWr {
            wr_id: first_id + i,
            op: SendOp::Write { remote_addr: mb.1 + u64::from(len) * (i % 16), rkey: mb.0 },
            payload: Payload::Sgl([Sge { addr: ma.1, length: len, lkey: ma.0 }].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        net.post_send(a, wr).unwrap();
    }
    let mut done = Vec::new();
    let ok = net.run_until(Duration::from_secs(5), |net| {
        done.extend(net.poll(a.node, a.scq));
        done.len() as u64 == n
    });
    assert!(ok, "{} of {n} writes completed", done.len());
    assert!(done.iter().all(|w| w.status == WcStatus::Success), "{done:?}");
}

#[test]
fn rtt_estimate_converges_to_the_round_trip() {
    for seed in [1, 2, 3] {
        let (mut net, a, _b, ma, mb) = net(seed);
        assert_eq!(net.nodes[0].hca.srtt(a.qpn), None, "no sample before traffic");
        writes(&mut net, &a, ma, mb, 200, 3000, 0);
        let srtt = net.nodes[0].hca.srtt(a.qpn).expect("sampled");
        // ACKs go back at once in the simulator: the round trip is two link delays.
        let rtt = 2 * DELAY;
        assert!(srtt >= rtt && srtt <= rtt + Duration::from_micros(5), "seed {seed}: srtt {srtt:?}, rtt {rtt:?}");
    }
}

#[test]
fn a_lost_retransmission_is_probed_after_about_a_round_trip() {
    let (mut net, a, _b, ma, mb) = net(7);
    // Learn the round trip first: one write at a time, one sample each, until the mean deviation
    // has decayed (it starts at half the first sample).
    for i in 0..24 {
        writes(&mut net, &a, ma, mb, 1, 3000, i);
    }
    let srtt = net.nodes[0].hca.srtt(a.qpn).expect("sampled");

    // Then drop one request packet twice: the original and its retransmission after the NAK. Only
    // the probe can recover it before the 67 ms ACK timeout (the responder NAKs a gap once).
    let target = Rc::new(RefCell::new(None::<u32>));
    let sends: Rc<RefCell<Vec<Duration>>> = Rc::new(RefCell::new(Vec::new()));
    let clock = Rc::new(RefCell::new(Duration::ZERO));
    {
        let (target, sends, clock) = (Rc::clone(&target), Rc::clone(&sends), Rc::clone(&clock));
        let mut seen = 0;
        net.filter = Some(Box::new(move |from, _to, frame: &mut Vec<u8>| {
            if from != 0 || frame.len() < 12 {
                return true;
            }
            let psn = u32::from_be_bytes([0, frame[9], frame[10], frame[11]]);
            let mut t = target.borrow_mut();
            // The 40th request packet of the burst below is the victim.
            seen += 1;
            if t.is_none() && seen == 40 {
                *t = Some(psn);
            }
            if *t == Some(psn) {
                sends.borrow_mut().push(*clock.borrow());
                return sends.borrow().len() > 2;
            }
            true
        }));
    }
    // The filter has no clock: step by hand and keep it informed.
    let n = 30u64;
    for i in 0..n {
        let wr = SendWr {
            wr_id: 1000 + i,
            op: SendOp::Write { remote_addr: mb.1, rkey: mb.0 },
            payload: Payload::Sgl([Sge { addr: ma.1, length: 3000, lkey: ma.0 }].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        net.post_send(&a, wr).unwrap();
    }
    let mut done = 0;
    let start = net.now;
    while done < n && net.now.saturating_since(start) < Duration::from_secs(1) {
        *clock.borrow_mut() = net.now.saturating_since(start);
        if !net.step() {
            break;
        }
        done += net.poll(a.node, a.scq).len() as u64;
    }
    assert_eq!(done, n, "all writes complete");
    let c = *net.nodes[0].hca.counters();
    assert_eq!(c.ack_timeouts, 0, "recovered by the probe, not the ACK timeout: {c:?}");
    let sends = sends.borrow();
    assert_eq!(sends.len(), 3, "original, retransmission after the NAK, probe: {sends:?}");
    // The probe waits the RTT estimate's timeout after the retransmission: at least a round trip,
    // little more (srtt + 4 rttvar, with rttvar small on this steady link) — not the fixed 2 ms.
    let gap = sends[2] - sends[1];
    assert!(gap >= srtt && gap <= srtt * 5 / 4, "probe after {gap:?}, srtt {srtt:?}");
}
