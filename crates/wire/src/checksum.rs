//! The Internet checksum (RFC 1071) used by the IPv4 header and, optionally, by UDP.
//!
//! RoCEv2 senders put 0 in the UDP checksum (rxe does, over IPv6 too), so UDP checksums are only
//! computed here for completeness and for captures from other stacks.

use core::net::{Ipv4Addr, Ipv6Addr};

/// One's complement sum of `data` as big-endian 16-bit words (an odd last byte is padded with zero),
/// folded to 16 bits, not complemented.
pub fn sum(data: &[u8]) -> u16 {
    let mut acc: u64 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(u16::from_be_bytes([*last, 0]));
    }
    fold(acc)
}

/// One's complement sum of several partial sums.
pub fn combine(parts: &[u16]) -> u16 {
    fold(parts.iter().map(|&p| u64::from(p)).sum())
}

fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// Partial sum of the IPv4 UDP/TCP pseudo header.
pub fn pseudo_v4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, len: u16) -> u16 {
    let mut b = [0u8; 12];
    b[0..4].copy_from_slice(&src.octets());
    b[4..8].copy_from_slice(&dst.octets());
    b[9] = protocol;
    b[10..12].copy_from_slice(&len.to_be_bytes());
    sum(&b)
}

/// Partial sum of the IPv6 upper-layer pseudo header.
pub fn pseudo_v6(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, len: u32) -> u16 {
    let mut b = [0u8; 40];
    b[0..16].copy_from_slice(&src.octets());
    b[16..32].copy_from_slice(&dst.octets());
    b[32..36].copy_from_slice(&len.to_be_bytes());
    b[39] = next_header;
    sum(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to ddf2.
        assert_eq!(sum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]), 0xddf2);
        assert_eq!(sum(&[0xff]), 0xff00);
        assert_eq!(combine(&[0xffff, 0x0001]), 0x0001);
    }
}
