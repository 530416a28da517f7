//! IPv6 fixed header (RFC 8200), as far as RoCEv2 encapsulation and capture reading need it.
//!
//! ```text
//!  0..4    Version(4) Traffic class(8) Flow label(20)   class and label are variant for the ICRC
//!  4..6    Payload length
//!  6       Next header
//!  7       Hop limit                                      variant for the ICRC
//!  8..24   Source address
//! 24..40   Destination address
//! ```
//!
//! Extension headers are not walked: RoCEv2 puts UDP directly after the fixed header, and a packet
//! with any other next header is simply not RoCE.

use core::net::Ipv6Addr;

use crate::field::{set_u16, set_u32, u16_at, u32_at};
use crate::{Error, Result};

/// Length of the IPv6 fixed header.
pub const HEADER_LEN: usize = 40;

mod field {
    pub const VER_TC_FLOW: usize = 0;
    pub const LENGTH: usize = 4;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: usize = 8;
    pub const DST: usize = 24;
}

fn addr_at(b: &[u8], at: usize) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[at..at + 16]);
    Ipv6Addr::from(a)
}

view!(
    /// A view of an IPv6 packet.
    Ipv6Packet
);

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    /// Check that the fixed header and the payload length are present (extra trailing bytes, such as
    /// Ethernet padding, are allowed and ignored).
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN || len < HEADER_LEN + usize::from(self.payload_len()) {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// IP version (6 for a valid packet).
    pub fn version(&self) -> u8 {
        self.b()[field::VER_TC_FLOW] >> 4
    }
    /// Traffic class.
    pub fn traffic_class(&self) -> u8 {
        (u32_at(self.b(), field::VER_TC_FLOW) >> 20) as u8
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        u32_at(self.b(), field::VER_TC_FLOW) & 0x000f_ffff
    }
    /// Payload length (everything after the fixed header).
    pub fn payload_len(&self) -> u16 {
        u16_at(self.b(), field::LENGTH)
    }
    /// Next header.
    pub fn next_header(&self) -> u8 {
        self.b()[field::NEXT_HEADER]
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.b()[field::HOP_LIMIT]
    }
    /// Source address.
    pub fn src_addr(&self) -> Ipv6Addr {
        addr_at(self.b(), field::SRC)
    }
    /// Destination address.
    pub fn dst_addr(&self) -> Ipv6Addr {
        addr_at(self.b(), field::DST)
    }
    /// The fixed header.
    pub fn header(&self) -> &[u8] {
        &self.b()[..HEADER_LEN]
    }
    /// The payload, up to the payload length.
    pub fn payload(&self) -> &[u8] {
        &self.b()[HEADER_LEN..HEADER_LEN + usize::from(self.payload_len())]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    /// Set version 6, the traffic class and the flow label (low 20 bits).
    pub fn set_version_class_flow(&mut self, traffic_class: u8, flow_label: u32) {
        let w = (6 << 28) | (u32::from(traffic_class) << 20) | (flow_label & 0x000f_ffff);
        set_u32(self.buffer.as_mut(), field::VER_TC_FLOW, w);
    }
    /// Set the payload length (invalidates `check_len`).
    pub fn set_payload_len(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::LENGTH, v);
    }
    /// Set the next header.
    pub fn set_next_header(&mut self, v: u8) {
        self.buffer.as_mut()[field::NEXT_HEADER] = v;
    }
    /// Set the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = v;
    }
    /// Set the source address.
    pub fn set_src_addr(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::SRC..field::SRC + 16].copy_from_slice(&a.octets());
    }
    /// Set the destination address.
    pub fn set_dst_addr(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::DST..field::DST + 16].copy_from_slice(&a.octets());
    }
    /// The payload, mutably.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let n = usize::from(self.payload_len());
        &mut self.buffer.as_mut()[HEADER_LEN..HEADER_LEN + n]
    }
}

/// An IPv6 fixed header as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Repr {
    /// Source address.
    pub src_addr: Ipv6Addr,
    /// Destination address.
    pub dst_addr: Ipv6Addr,
    /// Next header.
    pub next_header: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
}

impl Ipv6Repr {
    /// Parse; rejects a version other than 6.
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv6Packet<T>) -> Result<Ipv6Repr> {
        p.check_len()?;
        if p.version() != 6 {
            return Err(Error::BadVersion(p.version()));
        }
        Ok(Ipv6Repr {
            src_addr: p.src_addr(),
            dst_addr: p.dst_addr(),
            next_header: p.next_header(),
            payload_len: usize::from(p.payload_len()),
            hop_limit: p.hop_limit(),
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
        })
    }

    /// Header length (40).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the fixed header into the start of `buf`. Fails with [`Error::BadLength`] if the
    /// payload does not fit the 16-bit payload length (jumbograms are not supported).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        if buf.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let len = u16::try_from(self.payload_len).map_err(|_| Error::BadLength)?;
        let mut p = Ipv6Packet::new_unchecked(&mut buf[..HEADER_LEN]);
        p.set_version_class_flow(self.traffic_class, self.flow_label);
        p.set_payload_len(len);
        p.set_next_header(self.next_header);
        p.set_hop_limit(self.hop_limit);
        p.set_src_addr(self.src_addr);
        p.set_dst_addr(self.dst_addr);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The IPv6 header of an rxe ACK over link-local GIDs (rxe_rc_pingpong_ipv6).
    const HDR: [u8; 40] = [
        0x60, 0x00, 0x00, 0x00, 0x00, 0x1c, 0x11, 0x40, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54,
        0x00, 0xff, 0xfe, 0x77, 0x00, 0x11, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54, 0x00, 0xff,
        0xfe, 0x77, 0x00, 0x12,
    ];

    fn repr() -> Ipv6Repr {
        Ipv6Repr {
            src_addr: "fe80::5054:ff:fe77:11".parse().unwrap(),
            dst_addr: "fe80::5054:ff:fe77:12".parse().unwrap(),
            next_header: 17,
            payload_len: 28,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
        }
    }

    #[test]
    fn deconstruct_and_parse() {
        let mut b = [0u8; 68];
        b[..40].copy_from_slice(&HDR);
        let p = Ipv6Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.payload().len(), 28);
        assert_eq!(Ipv6Repr::parse(&p).unwrap(), repr());
        assert_eq!(Ipv6Packet::new_checked(&b[..67]).unwrap_err(), Error::Truncated);
        assert_eq!(Ipv6Packet::new_checked(&b[..39]).unwrap_err(), Error::Truncated);
        b[0] = 0x40;
        assert_eq!(Ipv6Repr::parse(&Ipv6Packet::new_unchecked(&b[..])), Err(Error::BadVersion(4)));
    }

    #[test]
    fn emit_over_junk_and_class_flow_bits() {
        let mut buf = [0xa5u8; 40];
        assert_eq!(repr().emit(&mut buf), Ok(40));
        assert_eq!(buf, HDR);
        let r = Ipv6Repr { traffic_class: 0xab, flow_label: 0xc_def0, ..repr() };
        r.emit(&mut buf).unwrap();
        assert_eq!(&buf[..4], &[0x6a, 0xbc, 0xde, 0xf0]);
        let p = Ipv6Packet::new_unchecked(&buf[..]);
        assert_eq!((p.traffic_class(), p.flow_label()), (0xab, 0xc_def0));
    }
}
