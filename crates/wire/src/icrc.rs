//! The Invariant CRC (ICRC) that ends every IB transport packet, for RoCEv2, RoCEv1 and native IB.
//!
//! The ICRC is the standard CRC-32 (IEEE 802.3 polynomial, reflected, seed and result inverted: what
//! [`crc32fast`] computes) over the packet with every field that may change in flight ("variant")
//! replaced by ones. It is stored least significant byte first ([`crate::IbPacket::icrc`]); the
//! golden captures of the kernel's rxe confirm this byte order on every packet.
//!
//! What is covered, in order (IBA vol. 1 §7.8.1 and annex A17 "RoCEv2"; Linux
//! `drivers/infiniband/sw/rxe/rxe_icrc.c`, which starts its CRC at 0xdebb20e3, the state after eight
//! 0xFF bytes):
//!
//! | transport | pseudo LRH | network header (masked fields) | then |
//! | --- | --- | --- | --- |
//! | RoCEv2 / IPv4 | 8 × 0xFF | IPv4 header: TOS, TTL, header checksum | UDP header, checksum = 0xFFFF |
//! | RoCEv2 / IPv6 | 8 × 0xFF | IPv6 header: traffic class, flow label, hop limit | UDP header, checksum = 0xFFFF |
//! | RoCEv1 | 8 × 0xFF | GRH: TClass, FlowLabel, HopLmt | — |
//! | IB, global | 8 × 0xFF (the whole LRH is variant when a GRH follows: routers rewrite it) | GRH as above | — |
//! | IB, local | the LRH with VL set to 0xF | — | — |
//!
//! and then the BTH with its byte 4 (FECN, BECN, Resv6a: "Resv8a") set to 0xFF, the extension headers,
//! the payload and the pad, up to the ICRC itself.
//!
//! The IPv4 header is covered as a whole, options included (rxe assumes a 20-byte header; RoCEv2
//! senders never use options). Nothing here allocates: masked copies of the headers live on the
//! stack and the payload is hashed in place.

use crc32fast::Hasher;

use crate::bth::BTH_LEN;
use crate::grh::GRH_LEN;
use crate::lrh::LRH_LEN;
use crate::{Error, Result, ICRC_LEN};

/// The eight bytes that stand for the (absent or fully variant) LRH.
pub const MASKED_LRH: [u8; LRH_LEN] = [0xff; LRH_LEN];

/// Largest IPv4 header (IHL 15).
const IPV4_MAX_HEADER: usize = 60;
const UDP_LEN: usize = 8;
const IPV6_LEN: usize = 40;

/// Mask the variant fields of an IPv4 header copy: TOS, TTL, header checksum.
pub fn mask_ipv4(h: &mut [u8]) {
    if h.len() >= 12 {
        h[1] = 0xff;
        h[8] = 0xff;
        h[10] = 0xff;
        h[11] = 0xff;
    }
}

/// Mask the variant fields of an IPv6 header or GRH copy: traffic class, flow label, hop limit
/// (the version nibble is kept).
pub fn mask_ipv6(h: &mut [u8]) {
    if h.len() >= 8 {
        h[0] |= 0x0f;
        h[1] = 0xff;
        h[2] = 0xff;
        h[3] = 0xff;
        h[7] = 0xff;
    }
}

/// Hash the BTH (byte 4 masked) and everything after it. `ib` is the IB packet without its ICRC.
fn hash_ib(h: &mut Hasher, ib: &[u8]) -> Result<()> {
    if ib.len() < BTH_LEN {
        return Err(Error::Truncated);
    }
    let mut bth = [0u8; BTH_LEN];
    bth.copy_from_slice(&ib[..BTH_LEN]);
    bth[4] = 0xff;
    h.update(&bth);
    h.update(&ib[BTH_LEN..]);
    Ok(())
}

/// Hash a masked copy of an IP header (v4 with options, or v6).
fn hash_ip(h: &mut Hasher, ip_header: &[u8]) -> Result<()> {
    match ip_header.first().map(|b| b >> 4) {
        Some(4) if (20..=IPV4_MAX_HEADER).contains(&ip_header.len()) => {
            let mut c = [0u8; IPV4_MAX_HEADER];
            let c = &mut c[..ip_header.len()];
            c.copy_from_slice(ip_header);
            mask_ipv4(c);
            h.update(c);
            Ok(())
        }
        Some(6) if ip_header.len() == IPV6_LEN => {
            let mut c = [0u8; IPV6_LEN];
            c.copy_from_slice(ip_header);
            mask_ipv6(&mut c);
            h.update(&c);
            Ok(())
        }
        Some(4 | 6) => Err(Error::BadLength),
        Some(v) => Err(Error::BadVersion(v)),
        None => Err(Error::Truncated),
    }
}

/// ICRC of a RoCEv2 packet: `ip_header` is the whole IPv4 header (options included) or the 40-byte
/// IPv6 header, `udp_header` the 8-byte UDP header, `ib` the IB packet from the BTH up to (not
/// including) the ICRC.
pub fn roce_v2(ip_header: &[u8], udp_header: &[u8], ib: &[u8]) -> Result<u32> {
    let mut h = Hasher::new();
    h.update(&MASKED_LRH);
    hash_ip(&mut h, ip_header)?;
    if udp_header.len() != UDP_LEN {
        return Err(Error::BadLength);
    }
    let mut u = [0u8; UDP_LEN];
    u.copy_from_slice(udp_header);
    u[6] = 0xff;
    u[7] = 0xff;
    h.update(&u);
    hash_ib(&mut h, ib)?;
    Ok(h.finalize())
}

/// Hash a masked GRH copy.
fn hash_grh(h: &mut Hasher, grh: &[u8]) -> Result<()> {
    if grh.len() != GRH_LEN {
        return Err(Error::BadLength);
    }
    let mut c = [0u8; GRH_LEN];
    c.copy_from_slice(grh);
    mask_ipv6(&mut c);
    h.update(&c);
    Ok(())
}

/// ICRC of a RoCEv1 packet: `grh` is the 40-byte GRH, `ib` the IB packet without its ICRC.
pub fn roce_v1(grh: &[u8], ib: &[u8]) -> Result<u32> {
    let mut h = Hasher::new();
    h.update(&MASKED_LRH);
    hash_grh(&mut h, grh)?;
    hash_ib(&mut h, ib)?;
    Ok(h.finalize())
}

/// ICRC of a native IB packet: `lrh` the 8-byte LRH, `grh` the GRH if LNH says one follows, `ib` the
/// IB packet without its ICRC. With a GRH the LRH counts as all ones; without, only its VL is.
pub fn native(lrh: &[u8], grh: Option<&[u8]>, ib: &[u8]) -> Result<u32> {
    if lrh.len() != LRH_LEN {
        return Err(Error::BadLength);
    }
    let mut h = Hasher::new();
    match grh {
        Some(g) => {
            h.update(&MASKED_LRH);
            hash_grh(&mut h, g)?;
        }
        None => {
            let mut l = [0u8; LRH_LEN];
            l.copy_from_slice(lrh);
            l[0] |= 0xf0;
            h.update(&l);
        }
    }
    hash_ib(&mut h, ib)?;
    Ok(h.finalize())
}

/// Split an IB packet (BTH through ICRC) into the covered part and the ICRC as carried.
pub fn split(ib_with_icrc: &[u8]) -> Result<(&[u8], u32)> {
    if ib_with_icrc.len() < BTH_LEN + ICRC_LEN {
        return Err(Error::Truncated);
    }
    let (covered, tail) = ib_with_icrc.split_at(ib_with_icrc.len() - ICRC_LEN);
    Ok((covered, u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]])))
}

/// Store `icrc` in the last four bytes of `ib_with_icrc`, least significant byte first.
pub fn store(ib_with_icrc: &mut [u8], icrc: u32) -> Result<()> {
    let n = ib_with_icrc.len();
    if n < ICRC_LEN {
        return Err(Error::Truncated);
    }
    ib_with_icrc[n - ICRC_LEN..].copy_from_slice(&icrc.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // An rxe ACK of rxe_rc_pingpong: IPv4 header, UDP header, BTH + AETH + ICRC.
    const V4: [u8; 48] = [
        0x45, 0x00, 0x00, 0x30, 0x78, 0x10, 0x40, 0x00, 0x40, 0x11, 0xad, 0xfc, 0x0a, 0x4d, 0x00, 0x0b, 0x0a, 0x4d,
        0x00, 0x0c, 0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, 0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11,
        0x00, 0xfb, 0x7b, 0x33, 0x1f, 0x00, 0x00, 0x01, 0xe4, 0x41, 0xa3, 0x2e,
    ];
    // The same over IPv6 link-local GIDs (rxe_rc_pingpong_ipv6).
    const V6: [u8; 68] = [
        0x60, 0x00, 0x00, 0x00, 0x00, 0x1c, 0x11, 0x40, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54,
        0x00, 0xff, 0xfe, 0x77, 0x00, 0x11, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54, 0x00, 0xff,
        0xfe, 0x77, 0x00, 0x12, 0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, 0x11, 0x00, 0xff, 0xff, 0x00, 0x00,
        0x00, 0x11, 0x00, 0x2e, 0x73, 0x5c, 0x1f, 0x00, 0x00, 0x01, 0x84, 0xcc, 0xc5, 0xf9,
    ];

    #[test]
    fn rxe_ipv4_ack_little_endian() {
        let (covered, carried) = split(&V4[28..]).unwrap();
        assert_eq!(carried, 0x2ea3_41e4);
        assert_eq!(roce_v2(&V4[..20], &V4[20..28], covered), Ok(carried));
    }

    #[test]
    fn rxe_ipv6_ack() {
        let (covered, carried) = split(&V6[48..]).unwrap();
        assert_eq!(roce_v2(&V6[..40], &V6[40..48], covered), Ok(carried));
    }

    #[test]
    fn variant_fields_do_not_matter_invariant_ones_do() {
        let (covered, carried) = split(&V4[28..]).unwrap();
        let mut ip = [0u8; 20];
        ip.copy_from_slice(&V4[..20]);
        (ip[1], ip[8], ip[10], ip[11]) = (0xb8, 3, 0x12, 0x34);
        let mut udp = [0u8; 8];
        udp.copy_from_slice(&V4[20..28]);
        udp[6..].copy_from_slice(&[0xab, 0xcd]);
        let mut ib = [0u8; 16];
        ib.copy_from_slice(covered);
        ib[4] = 0xc0;
        assert_eq!(roce_v2(&ip, &udp, &ib), Ok(carried));
        ip[4] ^= 1; // identification is covered
        assert_ne!(roce_v2(&ip, &udp, &ib), Ok(carried));

        let (covered, carried) = split(&V6[48..]).unwrap();
        let mut ip6 = [0u8; 40];
        ip6.copy_from_slice(&V6[..40]);
        ip6[..4].copy_from_slice(&[0x6f, 0xff, 0x12, 0x34]);
        ip6[7] = 1;
        assert_eq!(roce_v2(&ip6, &V6[40..48], covered), Ok(carried));
        ip6[0] = 0x5f; // the version is covered
        assert_eq!(roce_v2(&ip6, &V6[40..48], covered), Err(Error::BadVersion(5)));
    }

    #[test]
    fn native_and_v1_masking() {
        let ib = &V4[28..44];
        let lrh = [0x00, 0x02, 0x00, 0x02, 0x00, 0x09, 0x00, 0x01];
        let mut lrh_vl = lrh;
        lrh_vl[0] = 0x70;
        assert_eq!(native(&lrh, None, ib), native(&lrh_vl, None, ib));
        let mut lrh_sl = lrh;
        lrh_sl[1] = 0x12;
        assert_ne!(native(&lrh, None, ib), native(&lrh_sl, None, ib));
        // With a GRH the whole LRH is variant, and the result equals RoCEv1's.
        let grh = &V6[..40];
        assert_eq!(native(&lrh, Some(grh), ib), native(&lrh_sl, Some(grh), ib));
        assert_eq!(native(&lrh, Some(grh), ib), roce_v1(grh, ib));
    }

    #[test]
    fn bad_pieces_are_errors_not_panics() {
        assert_eq!(roce_v2(&[], &[0; 8], &[0; 12]), Err(Error::Truncated));
        assert_eq!(roce_v2(&[0x45; 19], &[0; 8], &[0; 12]), Err(Error::BadLength));
        assert_eq!(roce_v2(&V4[..20], &[0; 7], &[0; 12]), Err(Error::BadLength));
        assert_eq!(roce_v2(&V4[..20], &[0; 8], &[0; 11]), Err(Error::Truncated));
        assert_eq!(roce_v1(&[0x60; 39], &[0; 12]), Err(Error::BadLength));
        assert_eq!(split(&[0; 15]), Err(Error::Truncated));
        assert_eq!(store(&mut [0; 3], 1), Err(Error::Truncated));
    }
}
