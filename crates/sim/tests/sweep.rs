//! A seed sweep over engine settings (ignored by default: run with
//! `cargo test -p softrdma-sim --test sweep -- --ignored`; `SWEEP_SEEDS=a..b` picks the seeds,
//! `SWEEP_ADAPTIVE=1` and `SWEEP_BUDGET=n` the devices' adaptive window and packet budget).
//! Each seed draws an MTU, a loss rate, an initiator depth, a window and an ACK cadence.

use core::time::Duration;
use softrdma_sim::workload::Workload;
use softrdma_sim::{ConnOpts, Impairments, Net};
use softrdma_transport::{Config, Mtu, QpType};

fn one(seed: u64) -> Result<(), String> {
    let mtu = Mtu::ALL[(seed % 5) as usize];
    let loss = [0.01, 0.05, 0.1, 0.2, 0.3, 0.4][(seed / 5 % 6) as usize];
    let rd_atomic = [1u8, 2, 4, 16][(seed / 30 % 4) as usize];
    let window = [4u32, 16, 64, 1024][(seed / 7 % 4) as usize];
    let ack_req_every = [1u32, 4, 64][(seed / 11 % 3) as usize];
    // SWEEP_ADAPTIVE=1 turns on the devices' adaptive window (loss-driven AIMD, RTT-based retry
    // probes); SWEEP_BUDGET=n a device-wide packet budget shared by the QPs.
    let adaptive_window = std::env::var_os("SWEEP_ADAPTIVE").is_some_and(|v| v == "1");
    let device_inflight_packets = std::env::var("SWEEP_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(u32::MAX);
    let config = Config {
        max_inflight_packets: window,
        ack_req_every,
        adaptive_window,
        device_inflight_packets,
        ..Config::default()
    };
    let mut net = Net::new(2, config, Impairments::hostile(loss), seed);
    let name = format!("sweep_seed{seed}");
    net.pcap_on_failure(concat!(env!("CARGO_TARGET_TMPDIR"), "/sweep"), &name);
    let o = ConnOpts {
        mtu,
        rd_atomic,
        timeout: 6,
        psn: (seed as u32).wrapping_mul(0x9e37_79b9) & 0xff_ffff,
        ..ConnOpts::default()
    };
    let (a, b) = net.connect(0, 1, &o);
    let w = Workload::plan(&mut net, &a, &b, QpType::Rc, 150, 0, 20000);
    let before_a = w.region(&net, true).to_vec();
    let before_b = w.region(&net, false).to_vec();
    let (scq, rcq) = w.run(&mut net, &a, &b, 32, Duration::from_secs(3600));
    w.check(&net, &scq, &rcq, &before_a, &before_b).map_err(|e| {
        format!(
            "seed {seed} mtu {} loss {loss} rd_atomic {rd_atomic} window {window} ack_every {ack_req_every}: {e}",
            mtu.bytes()
        )
    })?;
    net.pcap_on_panic = None;
    Ok(())
}

#[test]
#[ignore]
fn sweep() {
    let range = std::env::var("SWEEP_SEEDS").unwrap_or_else(|_| "0..300".into());
    let (a, b) = range.split_once("..").expect("a..b");
    let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
    let mut fails = Vec::new();
    for seed in a..b {
        match std::panic::catch_unwind(|| one(seed)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => fails.push(e),
            Err(_) => fails.push(format!("seed {seed}: panicked")),
        }
    }
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.join("\n"));
}
