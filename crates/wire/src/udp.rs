//! UDP header (RFC 768), the carrier of RoCEv2.
//!
//! ```text
//!  0..2    Source port        RoCEv2: entropy, fixed per QP by rxe
//!  2..4    Destination port   RoCEv2: 4791
//!  4..6    Length             header + payload
//!  6..8    Checksum           variant for the ICRC; RoCEv2 senders put 0 (rxe: over IPv6 too)
//! ```

use core::net::{IpAddr, Ipv6Addr};

use crate::checksum;
use crate::field::{set_u16, u16_at};
use crate::ipv4::PROTOCOL_UDP;
use crate::{Error, Result};

/// Length of the UDP header.
pub const HEADER_LEN: usize = 8;

mod field {
    pub const SRC_PORT: usize = 0;
    pub const DST_PORT: usize = 2;
    pub const LENGTH: usize = 4;
    pub const CHECKSUM: usize = 6;
}

view!(
    /// A view of a UDP datagram.
    UdpPacket
);

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// Check that the header is present, the length field covers it and the buffer holds the length.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let l = usize::from(self.len());
        if l < HEADER_LEN {
            return Err(Error::BadLength);
        }
        if len < l {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        u16_at(self.buffer.as_ref(), field::SRC_PORT)
    }
    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        u16_at(self.buffer.as_ref(), field::DST_PORT)
    }
    /// Length of header and payload.
    pub fn len(&self) -> u16 {
        u16_at(self.buffer.as_ref(), field::LENGTH)
    }
    /// Whether the length field says there is no payload.
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) <= HEADER_LEN
    }
    /// Checksum as carried (0: none).
    pub fn checksum(&self) -> u16 {
        u16_at(self.buffer.as_ref(), field::CHECKSUM)
    }
    /// The header.
    pub fn header(&self) -> &[u8] {
        &self.buffer.as_ref()[..HEADER_LEN]
    }
    /// The payload, up to the length field.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.len())]
    }

    fn sum_with(&self, pseudo: u16) -> u16 {
        let dgram = &self.buffer.as_ref()[..usize::from(self.len())];
        checksum::combine(&[pseudo, checksum::sum(dgram)])
    }

    /// Whether the checksum is correct for the given addresses. A zero checksum ("none") is accepted
    /// over both IPv4 and IPv6, because RoCEv2 senders use it on both.
    pub fn verify_checksum(&self, src: IpAddr, dst: IpAddr) -> bool {
        if self.checksum() == 0 {
            return true;
        }
        self.sum_with(pseudo(src, dst, self.len())) == 0xffff
    }
}

fn pseudo(src: IpAddr, dst: IpAddr, len: u16) -> u16 {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => checksum::pseudo_v4(s, d, PROTOCOL_UDP, len),
        (s, d) => checksum::pseudo_v6(v6(s), v6(d), PROTOCOL_UDP, u32::from(len)),
    }
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
    /// Set the source port.
    pub fn set_src_port(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::SRC_PORT, v);
    }
    /// Set the destination port.
    pub fn set_dst_port(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::DST_PORT, v);
    }
    /// Set the length (invalidates `check_len`).
    pub fn set_len(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::LENGTH, v);
    }
    /// Set the checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::CHECKSUM, v);
    }
    /// Compute and store the checksum over the pseudo header, header and payload (0 is sent as
    /// 0xffff).
    pub fn fill_checksum(&mut self, src: IpAddr, dst: IpAddr) {
        self.set_checksum(0);
        let c = !self.sum_with(pseudo(src, dst, self.len()));
        self.set_checksum(if c == 0 { 0xffff } else { c });
    }
    /// The payload, mutably.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let n = usize::from(self.len());
        &mut self.buffer.as_mut()[HEADER_LEN..n]
    }
}

/// A UDP header as plain values (the checksum is a choice at emit time, not part of the repr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Payload length in bytes.
    pub payload_len: usize,
}

impl UdpRepr {
    /// Parse (the checksum is not verified here; see [`UdpPacket::verify_checksum`]).
    pub fn parse<T: AsRef<[u8]>>(p: &UdpPacket<T>) -> Result<UdpRepr> {
        p.check_len()?;
        Ok(UdpRepr { src_port: p.src_port(), dst_port: p.dst_port(), payload_len: usize::from(p.len()) - HEADER_LEN })
    }

    /// Header length (8).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header with checksum 0 ("none", as RoCEv2 senders do) into the start of `buf`.
    /// Fails with [`Error::BadLength`] if the payload does not fit the 16-bit length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        if buf.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let len = u16::try_from(HEADER_LEN + self.payload_len).map_err(|_| Error::BadLength)?;
        let mut p = UdpPacket::new_unchecked(&mut buf[..HEADER_LEN]);
        p.set_src_port(self.src_port);
        p.set_dst_port(self.dst_port);
        p.set_len(len);
        p.set_checksum(0);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HDR: [u8; 8] = [0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00];

    #[test]
    fn deconstruct_parse_emit() {
        let mut b = [0u8; 28];
        b[..8].copy_from_slice(&HDR);
        let p = UdpPacket::new_checked(&b[..]).unwrap();
        let r = UdpRepr::parse(&p).unwrap();
        assert_eq!(r, UdpRepr { src_port: 0xc121, dst_port: 4791, payload_len: 20 });
        assert_eq!(p.payload().len(), 20);
        let mut out = [0xa5u8; 8];
        assert_eq!(r.emit(&mut out), Ok(8));
        assert_eq!(out, HDR);
        assert_eq!(UdpPacket::new_checked(&b[..27]).unwrap_err(), Error::Truncated);
        b[5] = 4;
        assert_eq!(UdpPacket::new_checked(&b[..]).unwrap_err(), Error::BadLength);
    }

    #[test]
    fn checksum_roundtrip_v4_and_v6() {
        let mut b = [0u8; 13];
        b[..8].copy_from_slice(&HDR);
        b[5] = 13;
        b[8..].copy_from_slice(b"hello");
        let (s4, d4) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let s6: IpAddr = "fe80::1".parse().unwrap();
        let d6: IpAddr = "fe80::2".parse().unwrap();
        for (s, d) in [(s4, d4), (s6, d6)] {
            let mut p = UdpPacket::new_unchecked(&mut b[..]);
            p.fill_checksum(s, d);
            assert_ne!(p.checksum(), 0);
            assert!(p.verify_checksum(s, d));
            b[9] ^= 1;
            assert!(!UdpPacket::new_unchecked(&b[..]).verify_checksum(s, d));
            b[9] ^= 1;
        }
    }
}
