//! IPv4/IPv6/UDP/RoCEv2 parsing, ICRC verification, the UDP-socket verifier with identification
//! recovery, RoCEv1, and re-emission of whatever parses.
#![no_main]

use std::net::{IpAddr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use softrdma_wire::roce::{verify_udp_payload, RoceV1Packet, RoceV2Packet, UdpVerdict};
use softrdma_wire::{Ipv4Packet, Ipv4Repr, Ipv6Packet, Ipv6Repr, UdpPacket, UdpRepr};

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Ipv4Packet::new_checked(data) {
        let _ = (Ipv4Repr::parse(&p), p.options(), p.payload());
    }
    if let Ok(p) = Ipv6Packet::new_checked(data) {
        let _ = (Ipv6Repr::parse(&p), p.payload());
    }
    if let Ok(p) = UdpPacket::new_checked(data) {
        let _ = UdpRepr::parse(&p);
    }
    if let Ok(p) = RoceV2Packet::parse(data) {
        let ok = p.icrc_ok();
        // Re-emit around the same IB packet: the ICRC of the result always verifies.
        let r = p.repr();
        let ib = p.ib().as_bytes();
        let mut buf = vec![0u8; r.header_len() + ib.len()];
        buf[r.header_len()..].copy_from_slice(ib);
        if let Ok(n) = r.emit(&mut buf, ib.len()) {
            let q = RoceV2Packet::parse_verified(&buf[..n]).expect("re-emitted packet verifies");
            assert_eq!(q.ib().payload(), p.ib().payload());
            if ok && p.ip_header().len() == q.ip_header().len() {
                assert_eq!(q.ib().icrc(), p.ib().icrc());
            }
        }
        // The UDP-socket view of the same packet never contradicts a full verification, as long as
        // the header is one a socket can produce (IPv4: no options, reserved flag clear; IPv6: not
        // IPv4-mapped addresses, which a dual-stack socket would report as IPv4).
        let src = SocketAddr::new(r.src_addr, r.src_port);
        let dst = SocketAddr::new(r.dst_addr, r.dst_port);
        let h = p.ip_header();
        let socket_shaped = match (r.src_addr, r.dst_addr) {
            (IpAddr::V4(_), _) => h.len() == 20 && h[6] & 0x80 == 0,
            (IpAddr::V6(s), IpAddr::V6(d)) => s.to_ipv4_mapped().is_none() && d.to_ipv4_mapped().is_none(),
            _ => false,
        };
        if let Ok((_, v)) = verify_udp_payload(src, dst, ib) {
            if ok && socket_shaped {
                assert_ne!(v, UdpVerdict::Bad);
            }
        }
    }
    if let Ok(p) = RoceV1Packet::parse(data) {
        let _ = p.icrc_ok();
    }
    // The UDP payload alone, as a socket would deliver it.
    let a: SocketAddr = "10.1.2.3:49152".parse().unwrap();
    let b: SocketAddr = "10.1.2.4:4791".parse().unwrap();
    let _ = verify_udp_payload(a, b, data);
});
