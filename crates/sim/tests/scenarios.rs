//! The scenario matrix: thousands of mixed operations at every MTU under loss, duplication,
//! reordering and corruption, with byte-for-byte and completion checks. RC runs at 0, 1, 10 and
//! 30 % loss; UC (which loses messages by design) runs lossless. A failing scenario writes the last
//! frames of its run to `target/tmp/scenarios/<name>.pcap`.

use core::time::Duration;
use softrdma_sim::workload::Workload;
use softrdma_sim::{ConnOpts, Impairments, Net};
use softrdma_transport::{Config, Mtu, QpType};

fn scenario(mtu: Mtu, loss: f64, seed: u64, n: usize, big: u32, max: u32) {
    scenario_on(QpType::Rc, mtu, loss, seed, n, big, max)
}

fn scenario_on(qp_type: QpType, mtu: Mtu, loss: f64, seed: u64, n: usize, big: u32, max: u32) {
    let window = if loss >= 0.1 { 32 } else { 256 };
    let config = Config { max_inflight_packets: window, ..Config::default() };
    let mut net = Net::new(2, config, Impairments::hostile(loss), seed);
    let name = format!("{qp_type:?}_mtu{}_loss{loss}_seed{seed}", mtu.bytes());
    net.pcap_on_failure(concat!(env!("CARGO_TARGET_TMPDIR"), "/scenarios"), &name);
    let o = ConnOpts { qp_type, mtu, ..ConnOpts::default() };
    let (a, b) = net.connect(0, 1, &o);
    let w = Workload::plan(&mut net, &a, &b, qp_type, n, big, max);
    let before_a = w.region(&net, true).to_vec();
    let before_b = w.region(&net, false).to_vec();
    let (scq, rcq) = w.run(&mut net, &a, &b, 64, Duration::from_secs(3600));
    if let Err(e) = w.check(&net, &scq, &rcq, &before_a, &before_b) {
        panic!(
            "{name}: {e}\nnet {:?}\nA {:?}\nB {:?}",
            net.stats,
            net.nodes[0].hca.counters(),
            net.nodes[1].hca.counters()
        );
    }
    if loss > 0.0 {
        assert!(net.stats.lost > 0 && net.nodes[0].hca.counters().retransmits > 0, "impairments had no effect");
    }
}

#[test]
fn lossless_every_mtu() {
    for (i, mtu) in Mtu::ALL.into_iter().enumerate() {
        scenario(mtu, 0.0, 100 + i as u64, 1500, 4 << 20, 1 << 20);
    }
}

#[test]
fn one_percent_loss_every_mtu() {
    for (i, mtu) in Mtu::ALL.into_iter().enumerate() {
        scenario(mtu, 0.01, 200 + i as u64, 1500, 4 << 20, 1 << 20);
    }
}

#[test]
fn ten_percent_loss_every_mtu() {
    for (i, mtu) in Mtu::ALL.into_iter().enumerate() {
        scenario(mtu, 0.10, 300 + i as u64, 1000, 4 << 20, 256 << 10);
    }
}

#[test]
fn thirty_percent_loss_every_mtu() {
    for (i, mtu) in Mtu::ALL.into_iter().enumerate() {
        scenario(mtu, 0.30, 400 + i as u64, 1000, 1 << 20, 64 << 10);
    }
}

#[test]
fn uc_lossless_every_mtu() {
    for (i, mtu) in Mtu::ALL.into_iter().enumerate() {
        scenario_on(QpType::Uc, mtu, 0.0, 500 + i as u64, 1500, 4 << 20, 1 << 20);
    }
}
