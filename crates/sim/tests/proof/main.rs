//! The transport engine's proof: deterministic simulator scenarios, each checking data byte for byte
//! and completions exactly (status, opcode, wr_id, order, byte_len). A failing scenario leaves the
//! frames of its run in `target/tmp/proof/<name>.pcap`.

mod access;
mod dup;
mod retry;
mod srq;
mod state;
mod unreliable;
mod wrap;

use softrdma_sim::{ConnOpts, Endpoint, Impairments, Net};
use softrdma_transport::Config;

/// A net of two nodes that writes its frames to a pcap if the test fails.
pub fn net(name: &str, imp: Impairments, seed: u64) -> Net {
    net_with(name, Config::default(), imp, seed)
}

/// As [`net`] with an engine configuration.
pub fn net_with(name: &str, config: Config, imp: Impairments, seed: u64) -> Net {
    let mut n = Net::new(2, config, imp, seed);
    n.pcap_on_failure(concat!(env!("CARGO_TARGET_TMPDIR"), "/proof"), name);
    n
}

/// Two connected QPs (A on node 0, B on node 1).
pub fn pair(net: &mut Net, o: &ConnOpts) -> (Endpoint, Endpoint) {
    net.connect(0, 1, o)
}

/// A panicking test leaves its frames behind as a pcap.
#[test]
fn failing_run_writes_a_pcap() {
    use softrdma_sim::steps::*;
    use softrdma_transport::SendOp;
    let dir = concat!(env!("CARGO_TARGET_TMPDIR"), "/proof");
    let path = std::path::Path::new(dir).join("deliberate_failure.pcap");
    let _ = std::fs::remove_file(&path);
    let r = std::panic::catch_unwind(|| {
        let mut n = net("deliberate_failure", Impairments::NONE, 1);
        let (a, b) = pair(&mut n, &ConnOpts::default());
        let ma = n.reg(&a, 4096, ALL_ACCESS, 0);
        let mb = n.reg(&b, 4096, ALL_ACCESS, 0);
        n.post_recv(&b, recv(1, &[mb.sge(0, 4096)])).unwrap();
        n.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 3000)])).unwrap();
        n.settle();
        panic!("deliberate");
    });
    assert!(r.is_err());
    let f = std::fs::read(&path).expect("pcap written");
    // SEND FIRST/MIDDLE/LAST (1024+1024+952 payload) and one ACK, each a RoCEv2 packet whose ICRC
    // verifies, as `softrdma pcap check` would see them.
    let reader = softrdma_wire::capture::PcapReader::new(&f).unwrap();
    let link = reader.link_type();
    let mut lens = Vec::new();
    for frame in reader {
        let frame = frame.unwrap();
        let softrdma_wire::capture::Classified::RoceV2(ip) = softrdma_wire::capture::classify(link, frame.data) else {
            panic!("not RoCEv2");
        };
        softrdma_wire::RoceV2Packet::parse_verified(ip).unwrap();
        lens.push(ip.len());
    }
    assert_eq!(lens, vec![28 + 12 + 1024 + 4, 28 + 12 + 1024 + 4, 28 + 12 + 952 + 4, 28 + 16 + 4]);
}
