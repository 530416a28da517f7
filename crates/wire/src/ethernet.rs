//! Ethernet II frames, with at most one 802.1Q (or 802.1ad) VLAN tag.
//!
//! ```text
//!  0..6    destination MAC
//!  6..12   source MAC
//! 12..14   EtherType, or TPID 0x8100 / 0x88a8 followed by TCI(2) and the real EtherType
//! ```
//!
//! Needed to read captures and to carry RoCEv1 (EtherType [`ETHERTYPE_ROCE_V1`], a GRH directly after
//! the Ethernet header). The frame check sequence is never present in captures and is not handled.

use crate::field::{set_u16, u16_at};
use crate::{Error, Result};

/// Length of an untagged Ethernet II header.
pub const HEADER_LEN: usize = 14;
/// Length of one VLAN tag (TPID + TCI).
pub const VLAN_TAG_LEN: usize = 4;
/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// EtherType of ARP.
pub const ETHERTYPE_ARP: u16 = 0x0806;
/// EtherType of IPv6.
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// TPID of an 802.1Q VLAN tag.
pub const ETHERTYPE_VLAN: u16 = 0x8100;
/// TPID of an 802.1ad service tag.
pub const ETHERTYPE_QINQ: u16 = 0x88a8;
/// EtherType of RoCEv1 (IBA annex A16): a GRH follows.
pub const ETHERTYPE_ROCE_V1: u16 = 0x8915;

/// A 48-bit MAC address.
pub type MacAddr = [u8; 6];

mod field {
    pub const DST: usize = 0;
    pub const SRC: usize = 6;
    pub const TYPE: usize = 12;
    pub const TCI: usize = 14;
}

fn is_tag(t: u16) -> bool {
    t == ETHERTYPE_VLAN || t == ETHERTYPE_QINQ
}

view!(
    /// A view of an Ethernet II frame.
    EthernetFrame
);

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// Check that the header (and the VLAN tag, if the TPID says there is one) is present.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if is_tag(u16_at(b, field::TYPE)) && b.len() < HEADER_LEN + VLAN_TAG_LEN {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Destination MAC.
    pub fn dst_addr(&self) -> MacAddr {
        let mut m = [0; 6];
        m.copy_from_slice(&self.buffer.as_ref()[field::DST..field::DST + 6]);
        m
    }

    /// Source MAC.
    pub fn src_addr(&self) -> MacAddr {
        let mut m = [0; 6];
        m.copy_from_slice(&self.buffer.as_ref()[field::SRC..field::SRC + 6]);
        m
    }

    /// The EtherType field at offset 12 (a TPID if the frame is tagged).
    pub fn outer_ethertype(&self) -> u16 {
        u16_at(self.buffer.as_ref(), field::TYPE)
    }

    /// The VLAN tag control information (PCP, DEI, VID), if the frame is tagged.
    pub fn vlan_tci(&self) -> Option<u16> {
        is_tag(self.outer_ethertype()).then(|| u16_at(self.buffer.as_ref(), field::TCI))
    }

    /// The EtherType of the payload, after the VLAN tag if there is one.
    pub fn ethertype(&self) -> u16 {
        if self.vlan_tci().is_some() {
            u16_at(self.buffer.as_ref(), field::TYPE + VLAN_TAG_LEN)
        } else {
            self.outer_ethertype()
        }
    }

    /// Length of the header including the VLAN tag.
    pub fn header_len(&self) -> usize {
        HEADER_LEN + if self.vlan_tci().is_some() { VLAN_TAG_LEN } else { 0 }
    }

    /// The bytes after the header (may include trailing Ethernet padding).
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    /// Mutable bytes after the header.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let h = self.header_len();
        &mut self.buffer.as_mut()[h..]
    }
}

/// An 802.1Q/802.1ad tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VlanTag {
    /// Tag protocol identifier ([`ETHERTYPE_VLAN`] or [`ETHERTYPE_QINQ`]).
    pub tpid: u16,
    /// Tag control information: PCP(3) DEI(1) VID(12).
    pub tci: u16,
}

/// An Ethernet II header as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EthernetRepr {
    /// Destination MAC.
    pub dst_addr: MacAddr,
    /// Source MAC.
    pub src_addr: MacAddr,
    /// VLAN tag, if any.
    pub vlan: Option<VlanTag>,
    /// EtherType of the payload.
    pub ethertype: u16,
}

impl EthernetRepr {
    /// Parse the header of `f`.
    pub fn parse<T: AsRef<[u8]>>(f: &EthernetFrame<T>) -> Result<EthernetRepr> {
        f.check_len()?;
        Ok(EthernetRepr {
            dst_addr: f.dst_addr(),
            src_addr: f.src_addr(),
            vlan: f.vlan_tci().map(|tci| VlanTag { tpid: f.outer_ethertype(), tci }),
            ethertype: f.ethertype(),
        })
    }

    /// Header length (14, or 18 with a tag).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + if self.vlan.is_some() { VLAN_TAG_LEN } else { 0 }
    }

    /// Write the header into the start of `buf`; returns its length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let n = self.buffer_len();
        if buf.len() < n {
            return Err(Error::Truncated);
        }
        buf[field::DST..field::DST + 6].copy_from_slice(&self.dst_addr);
        buf[field::SRC..field::SRC + 6].copy_from_slice(&self.src_addr);
        match self.vlan {
            Some(tag) => {
                set_u16(buf, field::TYPE, tag.tpid);
                set_u16(buf, field::TCI, tag.tci);
                set_u16(buf, field::TYPE + VLAN_TAG_LEN, self.ethertype);
            }
            None => set_u16(buf, field::TYPE, self.ethertype),
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // First bytes of a RoCEv2 frame of rxe_rc_pingpong (vm2 -> vm1).
    const UNTAGGED: [u8; 16] =
        [0x52, 0x54, 0x00, 0x77, 0x00, 0x11, 0x52, 0x54, 0x00, 0x77, 0x00, 0x12, 0x08, 0x00, 0x45, 0x00];
    const TAGGED: [u8; 20] = [
        0x52, 0x54, 0x00, 0x77, 0x00, 0x11, 0x52, 0x54, 0x00, 0x77, 0x00, 0x12, 0x81, 0x00, 0x60, 0x07, 0x89, 0x15,
        0x60, 0x00,
    ];

    fn repr(vlan: Option<VlanTag>, ethertype: u16) -> EthernetRepr {
        EthernetRepr {
            dst_addr: [0x52, 0x54, 0x00, 0x77, 0x00, 0x11],
            src_addr: [0x52, 0x54, 0x00, 0x77, 0x00, 0x12],
            vlan,
            ethertype,
        }
    }

    #[test]
    fn deconstruct_untagged() {
        let f = EthernetFrame::new_checked(&UNTAGGED[..]).unwrap();
        assert_eq!(f.ethertype(), ETHERTYPE_IPV4);
        assert_eq!(f.vlan_tci(), None);
        assert_eq!(f.payload(), &[0x45, 0x00]);
        assert_eq!(EthernetRepr::parse(&f).unwrap(), repr(None, ETHERTYPE_IPV4));
    }

    #[test]
    fn deconstruct_tagged_roce_v1() {
        let f = EthernetFrame::new_checked(&TAGGED[..]).unwrap();
        assert_eq!(f.vlan_tci(), Some(0x6007));
        assert_eq!(f.ethertype(), ETHERTYPE_ROCE_V1);
        assert_eq!(f.header_len(), 18);
        assert_eq!(f.payload(), &[0x60, 0x00]);
    }

    #[test]
    fn emit_over_junk() {
        let mut buf = [0xa5u8; 18];
        let tag = VlanTag { tpid: ETHERTYPE_VLAN, tci: 0x6007 };
        assert_eq!(repr(Some(tag), ETHERTYPE_ROCE_V1).emit(&mut buf), Ok(18));
        assert_eq!(buf[..], TAGGED[..18]);
        let mut buf = [0xa5u8; 14];
        assert_eq!(repr(None, ETHERTYPE_IPV4).emit(&mut buf), Ok(14));
        assert_eq!(buf[..], UNTAGGED[..14]);
        assert_eq!(repr(None, ETHERTYPE_IPV4).emit(&mut buf[..13]), Err(Error::Truncated));
    }

    #[test]
    fn truncated() {
        assert_eq!(EthernetFrame::new_checked(&UNTAGGED[..13]).unwrap_err(), Error::Truncated);
        assert_eq!(EthernetFrame::new_checked(&TAGGED[..17]).unwrap_err(), Error::Truncated);
    }
}
