//! Many RC QPs on one pair of nodes sharing a device-wide packet budget
//! (`Config::device_inflight_packets`): every QP gets its turn (QPs held back by a full budget are
//! requeued as room frees), no QP waits for the local ACK timeout because its window shrank under
//! packets that asked for no ACK, and the bytes arrive intact, with and without loss.

use core::time::Duration;

use softrdma_sim::{ConnOpts, Endpoint, Impairments, Net};
use softrdma_transport::wr::Payload;
use softrdma_transport::{Access, Config, SendFlags, SendOp, SendWr, Sge, WcStatus};

const PAIRS: usize = 48;
/// Writes per QP, each of `LEN` bytes: 7 packets at MTU 1024, so a QP's turns (`burst`) and
/// windows end in the middle of messages, where no packet asks for an ACK by itself.
const WRITES: usize = 6;
const LEN: usize = 7000;

fn run(seed: u64, loss: f64, budget: u32, burst: u32) -> Net {
    let config = Config { adaptive_window: true, device_inflight_packets: budget, burst, ..Config::default() };
    let imp = Impairments { loss, delay: Duration::from_micros(20), ..Impairments::NONE };
    let mut net = Net::new(2, config, imp, seed);
    let o = ConnOpts { timeout: 14, ..ConnOpts::default() };
    let rights = Access::REMOTE_WRITE.with(Access::LOCAL_WRITE);
    let mut eps: Vec<(Endpoint, Endpoint)> = Vec::new();
    for _ in 0..PAIRS {
        eps.push(net.connect(0, 1, &o));
    }
    let (pa, pb) = (eps[0].0.pd, eps[0].1.pd);
    let (ka, va) = net.nodes[0].mem.register(pa, PAIRS * WRITES * LEN, rights);
    let (kb, vb) = net.nodes[1].mem.register(pb, PAIRS * WRITES * LEN, rights);
    let src = &mut net.nodes[0].mem.region_mut(ka).bytes;
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 131 + seed as usize + i / 977) as u8;
    }
    for (q, (a, _)) in eps.iter().enumerate() {
        for w in 0..WRITES {
            let off = ((q * WRITES + w) * LEN) as u64;
            let wr = SendWr {
                wr_id: (q * WRITES + w) as u64,
                op: SendOp::Write { remote_addr: vb + off, rkey: kb },
                payload: Payload::Sgl([Sge { addr: va + off, length: LEN as u32, lkey: ka }].into()),
                flags: SendFlags::SIGNALED,
                ud: None,
            };
            net.post_send(a, wr).unwrap();
        }
    }
    let mut done = 0;
    let ok = net.run_until(Duration::from_secs(30), |net| {
        for (a, _) in &eps {
            for wc in net.poll(a.node, a.scq) {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                done += 1;
            }
        }
        done == PAIRS * WRITES
    });
    assert!(ok, "seed {seed} loss {loss}: {done} of {} writes completed", PAIRS * WRITES);
    let a = net.nodes[0].mem.region(ka).bytes.clone();
    assert!(net.nodes[1].mem.region(kb).bytes == a, "seed {seed} loss {loss}: data differs");
    net
}

#[test]
fn a_small_budget_serves_every_qp_without_timeouts() {
    for seed in [1, 2, 3] {
        // 48 QPs with 42 packets each to send, 32 packets in flight for the whole device, turns of
        // 3 packets: QPs are held back mid-message all the time.
        let net = run(seed, 0.0, 32, 3);
        let c = net.nodes[0].hca.counters();
        assert_eq!(c.ack_timeouts, 0, "seed {seed}: {c:?}");
        assert_eq!(c.retransmits, 0, "seed {seed}: {c:?}");
    }
}

#[test]
fn a_budget_under_loss_delivers_everything() {
    for seed in [4, 5, 6] {
        let net = run(seed, 0.02, 64, 16);
        assert!(net.stats.lost > 0, "seed {seed}: the loss had no effect");
    }
}
