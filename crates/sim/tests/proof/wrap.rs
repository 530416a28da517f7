//! PSN wrap: multi-megabyte mixed workloads whose PSNs cross 0xFFFFFF -> 0, under loss.

use core::time::Duration;

use softrdma_sim::steps::*;
use softrdma_sim::workload::Workload;
use softrdma_sim::{ConnOpts, Impairments};
use softrdma_transport::{Config, Mtu, QpType, SendOp, WcOpcode, WcStatus};
use softrdma_wire::Psn;

use crate::{net_with, pair};

fn run(name: &str, mtu: Mtu, psn: u32, loss: f64, seed: u64, n: usize, big: u32) {
    let config = Config { max_inflight_packets: 64, ..Config::default() };
    let mut net = net_with(name, config, Impairments::hostile(loss), seed);
    let o = ConnOpts { mtu, psn, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let w = Workload::plan(&mut net, &a, &b, QpType::Rc, n, big, 256 << 10);
    let before_a = w.region(&net, true).to_vec();
    let before_b = w.region(&net, false).to_vec();
    let (scq, rcq) = w.run(&mut net, &a, &b, 64, Duration::from_secs(3600));
    if let Err(e) = w.check(&net, &scq, &rcq, &before_a, &before_b) {
        panic!("{name}: {e}");
    }
    // The requester really crossed the wrap.
    let end = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    assert!(end.value() < psn, "{name}: PSN {end:?} did not wrap");
    if loss > 0.0 {
        assert!(net.nodes[0].hca.counters().retransmits > 0);
    }
}

#[test]
fn psn_wrap_with_loss() {
    // ~6 MB at MTU 256 is ~25k PSNs: wraps from 0xFFFF00 within the first 64 KB.
    run("wrap_256_loss", Mtu::M256, 0xff_ff00, 0.02, 60, 200, 4 << 20);
    run("wrap_4096_loss", Mtu::M4096, 0xff_fff0, 0.05, 61, 300, 2 << 20);
}

#[test]
fn psn_wrap_lossless_from_the_last_psn() {
    run("wrap_ffffff", Mtu::M1024, 0xff_ffff, 0.0, 62, 100, 1 << 20);
}

/// One read whose response PSNs straddle the wrap, with its middle response lost.
#[test]
fn read_response_across_the_wrap() {
    let mut net = crate::net("wrap_read", Impairments::NONE, 63);
    let o = ConnOpts { psn: 0xff_fffe, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0);
    let data = pattern(5, 5000);
    net.fill(&mb, 0, &data);
    let mut lost = false;
    net.filter = Some(Box::new(move |from, _, f| {
        let p = softrdma_wire::IbPacket::new_checked(&f[..]).unwrap();
        if from == 1 && p.bth().psn() == Psn::new(0) && !lost {
            lost = true;
            return false;
        }
        true
    }));
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    net.post_send(&a, wr(1, read, &[ma.sge(0, 5000)])).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(1, WcStatus::Success, WcOpcode::RdmaRead, 5000)]);
    assert_eq!(&net.bytes(&ma)[..5000], &data[..]);
    assert_eq!(net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn, Psn::new(3));
    assert_eq!(net.nodes[1].hca.query_qp(b.qpn).unwrap().rq_psn, Psn::new(3));
}

/// Both sides run a mixed workload towards each other at once: every QP is requester and
/// responder, responses and requests interleave on the same QP, under loss.
#[test]
fn bidirectional_workloads_under_loss() {
    for (seed, loss, mtu) in [(70u64, 0.0, Mtu::M1024), (71, 0.05, Mtu::M256), (72, 0.2, Mtu::M4096)] {
        let config = Config { max_inflight_packets: 32, ..Config::default() };
        let name = format!("bidir_{seed}");
        let mut net = net_with(&name, config, Impairments::hostile(loss), seed);
        let o = ConnOpts { mtu, rd_atomic: 4, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let w1 = Workload::plan(&mut net, &a, &b, QpType::Rc, 300, 0, 64 << 10);
        let w2 = Workload::plan(&mut net, &b, &a, QpType::Rc, 300, 0, 64 << 10);
        w1.prepare(&mut net);
        w2.prepare(&mut net);
        let snap =
            |net: &softrdma_sim::Net, w: &Workload| (w.region(net, true).to_vec(), w.region(net, false).to_vec());
        let (b1a, b1b) = snap(&net, &w1);
        let (b2a, b2b) = snap(&net, &w2);
        let (mut n1, mut n2) = (0, 0);
        let (mut s1, mut r1, mut s2, mut r2) = (vec![], vec![], vec![], vec![]);
        while s1.len() < w1.ops.len() || s2.len() < w2.ops.len() {
            while n1 < w1.ops.len() && n1 - s1.len() < 32 {
                net.post_send(&a, w1.wr(n1)).unwrap();
                n1 += 1;
            }
            while n2 < w2.ops.len() && n2 - s2.len() < 32 {
                net.post_send(&b, w2.wr(n2)).unwrap();
                n2 += 1;
            }
            assert!(net.step(), "{name}: stalled");
            s1.extend(net.send_wcs(&a));
            s2.extend(net.send_wcs(&b));
            r1.extend(net.recv_wcs(&b));
            r2.extend(net.recv_wcs(&a));
        }
        net.settle();
        r1.extend(net.recv_wcs(&b));
        r2.extend(net.recv_wcs(&a));
        w1.check(&net, &s1, &r1, &b1a, &b1b).unwrap_or_else(|e| panic!("{name} A->B: {e}"));
        w2.check(&net, &s2, &r2, &b2a, &b2b).unwrap_or_else(|e| panic!("{name} B->A: {e}"));
    }
}
