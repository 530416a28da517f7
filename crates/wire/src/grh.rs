//! Global Route Header (GRH, 40 bytes, IBA vol. 1 §8.3): the IB network-layer header.
//!
//! ```text
//!  0..4    IPVer(4)=6 TClass(8) FlowLabel(20)   TClass and FlowLabel are variant for the ICRC
//!  4..6    PayLen      bytes after the GRH up to and including the ICRC (not the VCRC)
//!  6       NxtHdr      0x1B: an IBA transport header (BTH) follows
//!  7       HopLmt                                 variant for the ICRC
//!  8..24   SGID
//! 24..40   DGID
//! ```
//!
//! It has the layout of an IPv6 header on purpose. It follows the LRH on native IB links when
//! LNH = 3, and is the first header of a RoCEv1 frame (EtherType 0x8915).

use crate::ipv6::Ipv6Packet;
use crate::{Error, Result};

/// Length of the GRH.
pub const GRH_LEN: usize = 40;
/// IPVer of a GRH.
pub const IP_VERSION: u8 = 6;
/// NxtHdr value meaning "IBA transport header follows".
pub const NXT_HDR_IBA: u8 = 0x1b;

/// A 128-bit global identifier (an IPv6 address for RoCE).
pub type Gid = [u8; 16];

view!(
    /// A view of a GRH at the start of a buffer. Its fields are an IPv6 header's, read and
    /// written through [`Ipv6Packet`]'s accessors, with GIDs for addresses.
    GrhPacket, GRH_LEN
);

impl<T: AsRef<[u8]>> GrhPacket<T> {
    fn ip(&self) -> Ipv6Packet<&[u8]> {
        Ipv6Packet::new_unchecked(self.buffer.as_ref())
    }

    /// IP version (6).
    pub fn ip_version(&self) -> u8 {
        self.ip().version()
    }
    /// Traffic class.
    pub fn traffic_class(&self) -> u8 {
        self.ip().traffic_class()
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        self.ip().flow_label()
    }
    /// Payload length: bytes after the GRH through the ICRC.
    pub fn payload_len(&self) -> u16 {
        self.ip().payload_len()
    }
    /// Next header.
    pub fn next_header(&self) -> u8 {
        self.ip().next_header()
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.ip().hop_limit()
    }
    /// Source GID.
    pub fn sgid(&self) -> Gid {
        self.ip().src_addr().octets()
    }
    /// Destination GID.
    pub fn dgid(&self) -> Gid {
        self.ip().dst_addr().octets()
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> GrhPacket<T> {
    fn ip_mut(&mut self) -> Ipv6Packet<&mut [u8]> {
        Ipv6Packet::new_unchecked(self.buffer.as_mut())
    }

    /// Set IPVer 6, the traffic class and the flow label (low 20 bits).
    pub fn set_version_class_flow(&mut self, traffic_class: u8, flow_label: u32) {
        self.ip_mut().set_version_class_flow(traffic_class, flow_label);
    }
    /// Set the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        self.ip_mut().set_payload_len(v);
    }
    /// Set the next header.
    pub fn set_next_header(&mut self, v: u8) {
        self.ip_mut().set_next_header(v);
    }
    /// Set the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.ip_mut().set_hop_limit(v);
    }
    /// Set the source GID.
    pub fn set_sgid(&mut self, g: &Gid) {
        self.ip_mut().set_src_addr((*g).into());
    }
    /// Set the destination GID.
    pub fn set_dgid(&mut self, g: &Gid) {
        self.ip_mut().set_dst_addr((*g).into());
    }
}

/// A GRH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrhRepr {
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Bytes after the GRH through the ICRC.
    pub payload_len: u16,
    /// Next header ([`NXT_HDR_IBA`] for IB transport).
    pub next_header: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Source GID.
    pub sgid: Gid,
    /// Destination GID.
    pub dgid: Gid,
}

impl GrhRepr {
    /// Parse; rejects an IPVer other than 6. Any next header is accepted (the caller decides).
    pub fn parse<T: AsRef<[u8]>>(p: &GrhPacket<T>) -> Result<GrhRepr> {
        p.check_len()?;
        if p.ip_version() != IP_VERSION {
            return Err(Error::BadVersion(p.ip_version()));
        }
        Ok(GrhRepr {
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
            payload_len: p.payload_len(),
            next_header: p.next_header(),
            hop_limit: p.hop_limit(),
            sgid: p.sgid(),
            dgid: p.dgid(),
        })
    }

    /// Bytes needed to emit (40).
    pub const fn buffer_len(&self) -> usize {
        GRH_LEN
    }

    /// Write into the first 40 bytes of `p`.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut GrhPacket<T>) {
        p.set_version_class_flow(self.traffic_class, self.flow_label);
        p.set_payload_len(self.payload_len);
        p.set_next_header(self.next_header);
        p.set_hop_limit(self.hop_limit);
        p.set_sgid(&self.sgid);
        p.set_dgid(&self.dgid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BYTES: [u8; 40] = [
        0x61, 0x23, 0x45, 0x67, 0x00, 0x1c, 0x1b, 0x40, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54,
        0x00, 0xff, 0xfe, 0x77, 0x00, 0x11, 0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x50, 0x54, 0x00, 0xff,
        0xfe, 0x77, 0x00, 0x12,
    ];

    fn repr() -> GrhRepr {
        let mut sgid = [0u8; 16];
        sgid[..2].copy_from_slice(&[0xfe, 0x80]);
        sgid[8..].copy_from_slice(&[0x50, 0x54, 0x00, 0xff, 0xfe, 0x77, 0x00, 0x11]);
        let mut dgid = sgid;
        dgid[15] = 0x12;
        GrhRepr {
            traffic_class: 0x12,
            flow_label: 0x3_4567,
            payload_len: 28,
            next_header: NXT_HDR_IBA,
            hop_limit: 64,
            sgid,
            dgid,
        }
    }

    #[test]
    fn deconstruct_parse_emit() {
        let p = GrhPacket::new_checked(&BYTES[..]).unwrap();
        assert_eq!(p.traffic_class(), 0x12);
        assert_eq!(p.flow_label(), 0x3_4567);
        assert_eq!(GrhRepr::parse(&p).unwrap(), repr());
        let mut buf = [0xa5u8; 40];
        repr().emit(&mut GrhPacket::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn truncated_and_bad_version() {
        assert_eq!(GrhPacket::new_checked(&BYTES[..39]).unwrap_err(), Error::Truncated);
        let mut b = BYTES;
        b[0] = 0x41;
        assert_eq!(GrhRepr::parse(&GrhPacket::new_unchecked(&b[..])), Err(Error::BadVersion(4)));
    }
}
