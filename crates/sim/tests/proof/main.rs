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
