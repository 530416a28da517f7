//! Two RC endpoints on two embedded devices of this host connected to each other, on
//! 127.0.`net`.1 and .2 with a free UDP port (the same-host tests), and the link's counters.

use std::net::{IpAddr, Ipv4Addr, UdpSocket};

use softrdma_verbs::{ConnectParams, Context, DeviceBuilder, Gid, Psn, Qpn, SameHostStats};

use super::Endpoint;

pub fn ip(net: u8, last: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, net, last)
}

pub fn open(name: &str, addr: Ipv4Addr, port: u16, same_host: bool) -> Context {
    DeviceBuilder::new(name, "lo")
        .addr(IpAddr::V4(addr))
        .udp_port(port)
        .same_host(same_host)
        .open()
        .expect("open device")
}

/// A UDP port free on all of `addrs` right now.
pub fn free_port(addrs: &[Ipv4Addr]) -> u16 {
    'again: loop {
        let a = UdpSocket::bind((addrs[0], 0)).unwrap();
        let port = a.local_addr().unwrap().port();
        for b in &addrs[1..] {
            if UdpSocket::bind((*b, port)).is_err() {
                continue 'again;
            }
        }
        return port;
    }
}

pub fn connect(ep: &Endpoint, peer_qpn: u32, peer: Ipv4Addr) {
    let mut p = ConnectParams::new(Qpn::new(peer_qpn), Psn::new(0), Gid::from_ip(IpAddr::V4(peer)), Psn::new(0));
    // Short timeouts: a dead peer ends in a retry-exceeded completion within a second.
    p.timeout = 12;
    p.retry_cnt = 3;
    ep.qp.connect(&ep.pd, &p).expect("connect");
}

/// Two endpoints on one host connected to each other.
pub fn pair(net: u8, same_host: [bool; 2]) -> (Endpoint, Endpoint, u16) {
    let (ia, ib) = (ip(net, 1), ip(net, 2));
    let port = free_port(&[ia, ib]);
    let a = Endpoint::new(open(&format!("sh{net}a"), ia, port, same_host[0]), 1 << 20, 64);
    let b = Endpoint::new(open(&format!("sh{net}b"), ib, port, same_host[1]), 1 << 20, 64);
    connect(&a, b.qp.qpn().value(), ib);
    connect(&b, a.qp.qpn().value(), ia);
    (a, b, port)
}

/// The same-host link's counters of `ep`'s device.
pub fn stats(ep: &Endpoint) -> SameHostStats {
    ep.ctx.same_host_stats()
}
