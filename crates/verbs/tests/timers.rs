//! Timers armed by a verbs call on the application's thread fire on time even when the application
//! then blocks (waits on a completion channel) instead of polling: the device's I/O thread must
//! learn about a deadline earlier than the one it sleeps towards.
//!
//! The peer is a plain UDP socket that never answers, so every request is retransmitted after the
//! local ACK timeout (timeout 10: 4.096 µs × 2^10 ≈ 4.2 ms); the socket timestamps what arrives.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::Endpoint;
use softrdma_verbs::{ConnectParams, DeviceBuilder, Gid, Psn, Qpn, SendOp};

#[test]
fn retransmission_timer_armed_by_post_send_fires_without_polling() {
    // The silent peer first, on a port of its own; the device then takes that port too.
    let peer_ip = Ipv4Addr::new(127, 0, 14, 2);
    let peer = UdpSocket::bind(SocketAddr::new(IpAddr::V4(peer_ip), 0)).unwrap();
    let udp_port = peer.local_addr().unwrap().port();
    peer.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let ctx = DeviceBuilder::new("timer0", "lo")
        .addr(IpAddr::V4(Ipv4Addr::new(127, 0, 14, 1)))
        .udp_port(udp_port)
        .open()
        .unwrap();
    let ep = Endpoint::new(ctx, 4096, 16);
    let mut p = ConnectParams::new(Qpn::new(0x99), Psn::new(0), Gid::from_ip(IpAddr::V4(peer_ip)), Psn::new(0));
    p.timeout = 10;
    ep.qp.connect(&ep.pd, &p).unwrap();
    let mut buf = [0u8; 2048];
    // Let the I/O thread settle into its idle sleep (no deadline: up to 200 ms) first.
    std::thread::sleep(Duration::from_millis(30));
    ep.post(1, SendOp::Send, 0, 64);
    peer.recv_from(&mut buf).expect("the request");
    let first = Instant::now();
    peer.recv_from(&mut buf).expect("its retransmission");
    let gap = first.elapsed();
    assert!(gap < Duration::from_millis(60), "a 4.2 ms retransmission timer fired after {gap:?}");
}
