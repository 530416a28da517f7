//! Property tests: every opcode round-trips through the full RoCEv2 encapsulation (IPv4 and IPv6),
//! the ICRC catches every single-bit flip of a covered byte and ignores the variant fields, and no
//! parser panics on arbitrary or truncated input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proptest::prelude::*;
use softrdma_wire::aeth::{AethRepr, Syndrome};
use softrdma_wire::bth::BthRepr;
use softrdma_wire::capture::{classify, LinkType, PcapReader};
use softrdma_wire::ext::{AtomicAckEthRepr, AtomicEthRepr, DethRepr, RethRepr};
use softrdma_wire::icrc;
use softrdma_wire::opcode::Flags;
use softrdma_wire::packet::pad_for;
use softrdma_wire::roce::{verify_udp_payload, RoceV1Packet, RoceV2Packet, RoceV2Repr, ROCE_V2_PORT};
use softrdma_wire::{
    EthernetFrame, EthernetRepr, GrhPacket, GrhRepr, HeaderSet, IbPacket, IbRepr, Ipv4Packet, Ipv4Repr, Ipv6Packet,
    Ipv6Repr, LrhPacket, LrhRepr, Opcode, Psn, Qpn, UdpPacket, UdpRepr,
};

/// Random values from which an IbRepr of a given opcode is built.
#[derive(Debug, Clone)]
struct Seed {
    op_index: usize,
    flags: [bool; 5],
    pkey: u16,
    qp: u32,
    psn: u32,
    words: [u64; 6],
    syndrome: u8,
    payload: Vec<u8>,
}

fn seed() -> impl Strategy<Value = Seed> {
    (
        any::<usize>(),
        any::<[bool; 5]>(),
        any::<u16>(),
        any::<u32>(),
        any::<u32>(),
        any::<[u64; 6]>(),
        any::<u8>(),
        prop::collection::vec(any::<u8>(), 0..300),
    )
        .prop_map(|(op_index, flags, pkey, qp, psn, words, syndrome, payload)| Seed {
            op_index,
            flags,
            pkey,
            qp,
            psn,
            words,
            syndrome,
            payload,
        })
}

fn build(s: &Seed) -> (IbRepr, Vec<u8>) {
    let ops: Vec<_> = Opcode::all().collect();
    let (op, info) = ops[s.op_index % ops.len()];
    let w = s.words;
    let mut r = IbRepr::new(BthRepr {
        opcode: op,
        solicited: s.flags[0],
        mig_req: s.flags[1],
        pad: 0,
        pkey: s.pkey,
        fecn: s.flags[2],
        becn: s.flags[3],
        dest_qp: Qpn::new(s.qp),
        ack_req: s.flags[4],
        psn: Psn::new(s.psn),
    });
    let h = info.headers;
    if h.contains(HeaderSet::DETH) {
        r.deth = Some(DethRepr { qkey: w[0] as u32, src_qp: Qpn::new((w[0] >> 32) as u32) });
    }
    if h.contains(HeaderSet::RETH) {
        r.reth = Some(RethRepr { va: w[1], rkey: w[2] as u32, dma_len: (w[2] >> 32) as u32 });
    }
    if h.contains(HeaderSet::ATOMIC_ETH) {
        r.atomic_eth = Some(AtomicEthRepr { va: w[1], rkey: w[2] as u32, swap_add: w[3], compare: w[4] });
    }
    if h.contains(HeaderSet::AETH) {
        r.aeth = Some(AethRepr { syndrome: Syndrome::from_byte(s.syndrome & 0x7f), msn: (w[5] as u32) & 0xff_ffff });
    }
    if h.contains(HeaderSet::ATOMIC_ACK_ETH) {
        r.atomic_ack_eth = Some(AtomicAckEthRepr { orig: w[3] });
    }
    if h.contains(HeaderSet::IMMDT) {
        r.imm = Some((w[5] >> 32) as u32);
    }
    if h.contains(HeaderSet::IETH) {
        r.ieth = Some(w[4] as u32);
    }
    let payload = if info.is(Flags::PAYLOAD) { s.payload.clone() } else { Vec::new() };
    r.payload_len = payload.len();
    (r, payload)
}

fn encapsulation() -> impl Strategy<Value = RoceV2Repr> {
    (any::<bool>(), any::<[u8; 16]>(), any::<[u8; 16]>(), any::<(u16, u8, u8, u32, u16, bool)>()).prop_map(
        |(v6, s, d, (port, hop, tc, flow, ident, df))| {
            let (src, dst): (IpAddr, IpAddr) = if v6 {
                // Avoid IPv4-mapped addresses, which count as IPv4.
                let (mut s, mut d) = (s, d);
                s[0] = 0xfe;
                d[0] = 0xfe;
                (Ipv6Addr::from(s).into(), Ipv6Addr::from(d).into())
            } else {
                (Ipv4Addr::new(s[0], s[1], s[2], s[3]).into(), Ipv4Addr::new(d[0], d[1], d[2], d[3]).into())
            };
            let mut r = RoceV2Repr::new(src, dst, port);
            r.hop_limit = hop;
            r.traffic_class = tc;
            if v6 {
                r.flow_label = flow & 0xf_ffff;
                r.dont_frag = false;
            } else {
                r.ident = ident;
                r.dont_frag = df;
            }
            r
        },
    )
}

/// Whether byte `i`, bit `bit`, of a RoCEv2 IP packet with an `ip_len`-byte IP header is variant.
fn is_variant(v6: bool, ip_len: usize, i: usize, bit: u8) -> bool {
    let ip_variant =
        if v6 { i == 1 || i == 2 || i == 3 || i == 7 || (i == 0 && bit < 4) } else { [1, 8, 10, 11].contains(&i) };
    ip_variant || i == ip_len + 6 || i == ip_len + 7 || i == ip_len + 8 + 4
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_opcode_roundtrips_through_roce_v2(s in seed(), roce in encapsulation()) {
        let (repr, payload) = build(&s);
        let mut buf = vec![0xa5u8; 512];
        let n = roce.emit_ib(&repr, &payload, &mut buf).unwrap();
        let p = RoceV2Packet::parse_verified(&buf[..n]).unwrap();
        prop_assert_eq!(p.repr(), roce);
        let mut want = repr;
        want.bth.pad = pad_for(payload.len());
        prop_assert_eq!(IbRepr::parse(p.ib()).unwrap(), want);
        prop_assert_eq!(p.ib().payload(), &payload[..]);
        // The same IB packet seen through a UDP socket verifies too (IPv4: maybe with a recovered id).
        let src = SocketAddr::new(roce.src_addr, roce.src_port);
        let dst = SocketAddr::new(roce.dst_addr, ROCE_V2_PORT);
        let (_, v) = verify_udp_payload(src, dst, p.ib().as_bytes()).unwrap();
        prop_assert_ne!(v, softrdma_wire::UdpVerdict::Bad);
    }

    #[test]
    fn single_bit_flips_in_covered_bytes_break_the_icrc(s in seed(), roce in encapsulation(), pos in any::<usize>(), bit in 0u8..8) {
        let (repr, payload) = build(&s);
        let mut buf = vec![0u8; 512];
        let n = roce.emit_ib(&repr, &payload, &mut buf).unwrap();
        let frame = &mut buf[..n];
        let v6 = !roce.is_ipv4();
        let ip_len = if v6 { 40 } else { 20 };
        let hl = ip_len + 8;
        let i = pos % n;
        frame[i] ^= 1 << bit;
        let carried = u32::from_le_bytes(frame[n - 4..].try_into().unwrap());
        let computed = icrc::roce_v2(&frame[..ip_len], &frame[ip_len..hl], &frame[hl..n - 4]);
        if is_variant(v6, ip_len, i, bit) {
            prop_assert_eq!(computed, Ok(carried), "variant byte {} changed the ICRC", i);
        } else {
            prop_assert_ne!(computed, Ok(carried), "flip at byte {} bit {} not caught", i, bit);
        }
    }

    #[test]
    fn parsers_never_panic_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        exercise(&bytes);
    }

    #[test]
    fn parsers_never_panic_on_damaged_roce_frames(s in seed(), roce in encapsulation(), cut in any::<usize>(), pos in any::<usize>(), val in any::<u8>()) {
        let (repr, payload) = build(&s);
        let mut buf = vec![0u8; 512];
        let n = roce.emit_ib(&repr, &payload, &mut buf).unwrap();
        let mut frame = buf[..n].to_vec();
        exercise(&frame[..cut % (n + 1)]);
        frame[pos % n] = val;
        exercise(&frame);
        exercise(&frame[..cut % (n + 1)]);
    }
}

/// Run every parser over `b`, as the network or a capture file could present it.
fn exercise(b: &[u8]) {
    if let Ok(f) = EthernetFrame::new_checked(b) {
        let _ = EthernetRepr::parse(&f);
        let _ = f.payload();
    }
    if let Ok(p) = Ipv4Packet::new_checked(b) {
        let _ = (Ipv4Repr::parse(&p), p.payload(), p.options(), p.verify_checksum());
    }
    if let Ok(p) = Ipv6Packet::new_checked(b) {
        let _ = (Ipv6Repr::parse(&p), p.payload());
    }
    if let Ok(p) = UdpPacket::new_checked(b) {
        let _ = (UdpRepr::parse(&p), p.payload(), p.verify_checksum([1, 2, 3, 4].into(), [5, 6, 7, 8].into()));
    }
    if let Ok(p) = GrhPacket::new_checked(b) {
        let _ = GrhRepr::parse(&p);
    }
    if let Ok(p) = LrhPacket::new_checked(b) {
        let _ = LrhRepr::parse(&p);
    }
    let _ = softrdma_wire::lrh::vcrc(b);
    if let Ok(p) = IbPacket::new_checked(b) {
        let _ = (p.payload(), p.icrc(), p.deth(), p.reth(), p.aeth(), p.imm());
        if let Ok(r) = IbRepr::parse(&p) {
            let mut out = vec![0u8; r.buffer_len()];
            r.emit(&mut out).unwrap();
        }
    }
    if let Ok(p) = RoceV2Packet::parse(b) {
        let _ = (p.icrc_ok(), p.repr());
    }
    if let Ok(p) = RoceV1Packet::parse(b) {
        let _ = p.icrc_ok();
    }
    let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
    let z: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let _ = verify_udp_payload(a, z, b);
    let _ = icrc::roce_v2(b, b.get(..8).unwrap_or(b), b);
    let _ = icrc::roce_v1(b, b);
    let _ = icrc::native(b.get(..8).unwrap_or(b), Some(b), b);
    for link in [LinkType::Ethernet, LinkType::Raw, LinkType::LinuxSll, LinkType::LinuxSll2, LinkType::Ipv6] {
        let _ = classify(link, b);
    }
    if let Ok(r) = PcapReader::new(b) {
        for f in r {
            if f.is_err() {
                break;
            }
        }
    }
}
