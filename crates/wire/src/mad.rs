//! Management datagrams (MADs): the 256-byte messages of the IB management classes, carried in UD
//! SEND_ONLY packets to QP0/QP1. This module owns the 24-byte common MAD header; the CM class's
//! messages are in [`crate::cm`].
//!
//! ```text
//!  0 BaseVersion  1 MgmtClass  2 ClassVersion  3 R(1) Method(7)
//!  4..6 Status    6..8 ClassSpecific
//!  8..16 TransactionID
//! 16..18 AttributeID  18..20 reserved  20..24 AttributeModifier
//! 24..256 class data
//! ```

use crate::field::{set_u16, set_u32, set_u64, u16_at, u32_at, u64_at};
use crate::{Error, Result};

/// Length of a MAD.
pub const MAD_LEN: usize = 256;
/// Length of the common MAD header.
pub const MAD_HEADER_LEN: usize = 24;
/// Length of the class data that follows the header.
pub const MAD_DATA_LEN: usize = MAD_LEN - MAD_HEADER_LEN;

/// Management class of the communication manager.
pub const CLASS_CM: u8 = 0x07;
/// Q_Key of QP1 (the general services interface).
pub const GSI_QKEY: u32 = 0x8001_0000;

/// MAD methods used by the CM class.
pub mod method {
    /// Get.
    pub const GET: u8 = 0x01;
    /// Set.
    pub const SET: u8 = 0x02;
    /// Send (every CM message).
    pub const SEND: u8 = 0x03;
    /// Get response.
    pub const GET_RESP: u8 = 0x81;
}

view!(
    /// A view of a MAD.
    MadPacket, MAD_LEN
);

impl<T: AsRef<[u8]>> MadPacket<T> {
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// Base version (1).
    pub fn base_version(&self) -> u8 {
        self.b()[0]
    }
    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        self.b()[1]
    }
    /// Class version.
    pub fn class_version(&self) -> u8 {
        self.b()[2]
    }
    /// Method, with the response bit.
    pub fn method(&self) -> u8 {
        self.b()[3]
    }
    /// Status.
    pub fn status(&self) -> u16 {
        u16_at(self.b(), 4)
    }
    /// Class-specific field.
    pub fn class_specific(&self) -> u16 {
        u16_at(self.b(), 6)
    }
    /// Transaction ID.
    pub fn transaction_id(&self) -> u64 {
        u64_at(self.b(), 8)
    }
    /// Attribute ID (the CM message type).
    pub fn attribute_id(&self) -> u16 {
        u16_at(self.b(), 16)
    }
    /// Attribute modifier.
    pub fn attribute_modifier(&self) -> u32 {
        u32_at(self.b(), 20)
    }
    /// The class data (232 bytes).
    pub fn data(&self) -> &[u8] {
        &self.b()[MAD_HEADER_LEN..MAD_LEN]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> MadPacket<T> {
    /// Mutable class data.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[MAD_HEADER_LEN..MAD_LEN]
    }
}

/// The common MAD header as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MadHeader {
    /// Base version (1).
    pub base_version: u8,
    /// Management class.
    pub mgmt_class: u8,
    /// Class version.
    pub class_version: u8,
    /// Method.
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class specific.
    pub class_specific: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// Attribute ID.
    pub attribute_id: u16,
    /// Attribute modifier.
    pub attribute_modifier: u32,
}

impl MadHeader {
    /// A CM `Send` header for `attribute_id` (CM class version 2).
    pub fn cm(attribute_id: u16, transaction_id: u64) -> MadHeader {
        MadHeader {
            base_version: 1,
            mgmt_class: CLASS_CM,
            class_version: 2,
            method: method::SEND,
            status: 0,
            class_specific: 0,
            transaction_id,
            attribute_id,
            attribute_modifier: 0,
        }
    }

    /// Parse; a base version other than 1 is an error.
    pub fn parse<T: AsRef<[u8]>>(p: &MadPacket<T>) -> Result<MadHeader> {
        p.check_len()?;
        if p.base_version() != 1 {
            return Err(Error::BadVersion(p.base_version()));
        }
        Ok(MadHeader {
            base_version: p.base_version(),
            mgmt_class: p.mgmt_class(),
            class_version: p.class_version(),
            method: p.method(),
            status: p.status(),
            class_specific: p.class_specific(),
            transaction_id: p.transaction_id(),
            attribute_id: p.attribute_id(),
            attribute_modifier: p.attribute_modifier(),
        })
    }

    /// Emit into the first 24 bytes of `buf` (at least 256 bytes; the data part is left alone).
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() < MAD_LEN {
            return Err(Error::Truncated);
        }
        buf[0] = self.base_version;
        buf[1] = self.mgmt_class;
        buf[2] = self.class_version;
        buf[3] = self.method;
        set_u16(buf, 4, self.status);
        set_u16(buf, 6, self.class_specific);
        set_u64(buf, 8, self.transaction_id);
        set_u16(buf, 16, self.attribute_id);
        set_u16(buf, 18, 0);
        set_u32(buf, 20, self.attribute_modifier);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_over_junk() {
        let h = MadHeader::cm(0x0010, 0x0000_0002_7a6e_1ea5);
        let mut buf = [0xa5u8; MAD_LEN];
        h.emit(&mut buf).unwrap();
        assert_eq!(&buf[..4], &[1, 7, 2, 3]);
        assert_eq!(&buf[8..16], &[0, 0, 0, 2, 0x7a, 0x6e, 0x1e, 0xa5]);
        assert_eq!(&buf[16..20], &[0, 0x10, 0, 0]);
        let p = MadPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(MadHeader::parse(&p).unwrap(), h);
        assert_eq!(MadPacket::new_checked(&buf[..255]).unwrap_err(), Error::Truncated);
        buf[0] = 2;
        assert_eq!(MadHeader::parse(&MadPacket::new_unchecked(&buf[..])), Err(Error::BadVersion(2)));
    }
}
