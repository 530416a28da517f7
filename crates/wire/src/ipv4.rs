//! IPv4 header (RFC 791), as far as RoCEv2 encapsulation and capture reading need it.
//!
//! ```text
//!  0       Version(4) IHL(4)             IHL in 4-byte words, 5..=15
//!  1       DSCP(6) ECN(2)                "TOS": variant for the ICRC
//!  2..4    Total length                  header + payload, in bytes
//!  4..6    Identification
//!  6..8    reserved(1) DF(1) MF(1) Fragment offset(13)
//!  8       TTL                           variant for the ICRC
//!  9       Protocol
//! 10..12   Header checksum               variant for the ICRC
//! 12..16   Source address
//! 16..20   Destination address
//! 20..     Options (IHL*4 - 20 bytes)
//! ```
//!
//! The view handles options (it finds the payload after IHL*4 bytes and rejects IHL < 5); the
//! [`Ipv4Repr`] ignores options on parse and never emits them.

use core::net::Ipv4Addr;

use crate::checksum;
use crate::field::{set_u16, u16_at};
use crate::{Error, Result};

/// Length of an IPv4 header without options.
pub const HEADER_LEN: usize = 20;
/// IP protocol number of UDP.
pub const PROTOCOL_UDP: u8 = 17;
/// IP protocol number of TCP.
pub const PROTOCOL_TCP: u8 = 6;

mod field {
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const LENGTH: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
}

/// Byte offsets of the fields of an IPv4 header, for code that masks or patches headers.
pub mod offsets {
    /// DSCP/ECN ("TOS") byte.
    pub const TOS: usize = super::field::TOS;
    /// Identification (2 bytes).
    pub const IDENT: usize = super::field::IDENT;
    /// Flags and fragment offset (2 bytes).
    pub const FLAGS_FRAG: usize = super::field::FLAGS_FRAG;
    /// TTL byte.
    pub const TTL: usize = super::field::TTL;
    /// Header checksum (2 bytes).
    pub const CHECKSUM: usize = super::field::CHECKSUM;
}

/// The DF ("don't fragment") bit of the flags/fragment-offset word.
pub const FLAG_DF: u16 = 0x4000;
/// The MF ("more fragments") bit of the flags/fragment-offset word.
pub const FLAG_MF: u16 = 0x2000;

view!(
    /// A view of an IPv4 packet.
    Ipv4Packet
);

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// Check that the fixed header is present, that IHL >= 5 and the total length covers the header,
    /// and that the buffer holds the whole header and total length. Bytes after the total length
    /// (Ethernet padding) are allowed and ignored.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let hl = self.header_len();
        if hl < HEADER_LEN {
            return Err(Error::BadLength);
        }
        if len < hl {
            return Err(Error::Truncated);
        }
        let total = usize::from(self.total_len());
        if total < hl {
            return Err(Error::BadLength);
        }
        if len < total {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// IP version (4 for a valid packet).
    pub fn version(&self) -> u8 {
        self.b()[field::VER_IHL] >> 4
    }
    /// Header length in bytes (IHL * 4).
    pub fn header_len(&self) -> usize {
        usize::from(self.b()[field::VER_IHL] & 0xf) * 4
    }
    /// DSCP and ECN as one byte (the old TOS byte).
    pub fn tos(&self) -> u8 {
        self.b()[field::TOS]
    }
    /// Total length (header and payload) in bytes.
    pub fn total_len(&self) -> u16 {
        u16_at(self.b(), field::LENGTH)
    }
    /// Identification.
    pub fn ident(&self) -> u16 {
        u16_at(self.b(), field::IDENT)
    }
    /// Don't fragment.
    pub fn dont_frag(&self) -> bool {
        u16_at(self.b(), field::FLAGS_FRAG) & FLAG_DF != 0
    }
    /// More fragments.
    pub fn more_frags(&self) -> bool {
        u16_at(self.b(), field::FLAGS_FRAG) & FLAG_MF != 0
    }
    /// Fragment offset in 8-byte units.
    pub fn frag_offset(&self) -> u16 {
        u16_at(self.b(), field::FLAGS_FRAG) & 0x1fff
    }
    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.b()[field::TTL]
    }
    /// Protocol of the payload.
    pub fn protocol(&self) -> u8 {
        self.b()[field::PROTOCOL]
    }
    /// Header checksum as carried.
    pub fn checksum(&self) -> u16 {
        u16_at(self.b(), field::CHECKSUM)
    }
    /// Source address.
    pub fn src_addr(&self) -> Ipv4Addr {
        let b = self.b();
        Ipv4Addr::new(b[field::SRC], b[field::SRC + 1], b[field::SRC + 2], b[field::SRC + 3])
    }
    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Addr {
        let b = self.b();
        Ipv4Addr::new(b[field::DST], b[field::DST + 1], b[field::DST + 2], b[field::DST + 3])
    }
    /// The whole header, options included.
    pub fn header(&self) -> &[u8] {
        &self.b()[..self.header_len()]
    }
    /// The options bytes.
    pub fn options(&self) -> &[u8] {
        &self.b()[HEADER_LEN..self.header_len()]
    }
    /// The payload, up to the total length.
    pub fn payload(&self) -> &[u8] {
        &self.b()[self.header_len()..usize::from(self.total_len())]
    }
    /// Whether the header checksum is correct.
    pub fn verify_checksum(&self) -> bool {
        checksum::sum(self.header()) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    /// Set version 4 and the header length in bytes (a multiple of 4; invalidates `check_len`).
    pub fn set_version_and_header_len(&mut self, header_len: usize) {
        self.bm()[field::VER_IHL] = 0x40 | ((header_len / 4) as u8 & 0xf);
    }
    /// Set the DSCP/ECN byte.
    pub fn set_tos(&mut self, v: u8) {
        self.bm()[field::TOS] = v;
    }
    /// Set the total length (invalidates `check_len`).
    pub fn set_total_len(&mut self, v: u16) {
        set_u16(self.bm(), field::LENGTH, v);
    }
    /// Set the identification.
    pub fn set_ident(&mut self, v: u16) {
        set_u16(self.bm(), field::IDENT, v);
    }
    /// Set the flags and fragment offset word: DF as given, MF clear, offset 0.
    pub fn set_dont_frag(&mut self, df: bool) {
        set_u16(self.bm(), field::FLAGS_FRAG, if df { FLAG_DF } else { 0 });
    }
    /// Set the TTL.
    pub fn set_ttl(&mut self, v: u8) {
        self.bm()[field::TTL] = v;
    }
    /// Set the protocol.
    pub fn set_protocol(&mut self, v: u8) {
        self.bm()[field::PROTOCOL] = v;
    }
    /// Set the checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        set_u16(self.bm(), field::CHECKSUM, v);
    }
    /// Set the source address.
    pub fn set_src_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::SRC..field::SRC + 4].copy_from_slice(&a.octets());
    }
    /// Set the destination address.
    pub fn set_dst_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::DST..field::DST + 4].copy_from_slice(&a.octets());
    }
    /// Compute and store the header checksum (over IHL*4 bytes).
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let c = !checksum::sum(self.header());
        self.set_checksum(c);
    }
    /// The payload, up to the total length, mutably.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (h, t) = (self.header_len(), usize::from(self.total_len()));
        &mut self.bm()[h..t]
    }
}

/// An IPv4 header (without options) as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src_addr: Ipv4Addr,
    /// Destination address.
    pub dst_addr: Ipv4Addr,
    /// Protocol of the payload.
    pub protocol: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// Time to live.
    pub ttl: u8,
    /// DSCP and ECN.
    pub tos: u8,
    /// Identification.
    pub ident: u16,
    /// Don't fragment.
    pub dont_frag: bool,
}

impl Ipv4Repr {
    /// Parse: version 4, a correct header checksum, not a fragment. Options are skipped.
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv4Packet<T>) -> Result<Ipv4Repr> {
        p.check_len()?;
        if p.version() != 4 {
            return Err(Error::BadVersion(p.version()));
        }
        if !p.verify_checksum() {
            return Err(Error::BadChecksum);
        }
        if p.more_frags() || p.frag_offset() != 0 {
            return Err(Error::Fragmented);
        }
        Ok(Ipv4Repr {
            src_addr: p.src_addr(),
            dst_addr: p.dst_addr(),
            protocol: p.protocol(),
            payload_len: p.payload().len(),
            ttl: p.ttl(),
            tos: p.tos(),
            ident: p.ident(),
            dont_frag: p.dont_frag(),
        })
    }

    /// Header length emitted (20: no options).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the 20-byte header, checksum included, into the start of `buf`. Fails with
    /// [`Error::BadLength`] if the payload does not fit the 16-bit total length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        if buf.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let total = u16::try_from(HEADER_LEN + self.payload_len).map_err(|_| Error::BadLength)?;
        let mut p = Ipv4Packet::new_unchecked(&mut buf[..HEADER_LEN]);
        p.set_version_and_header_len(HEADER_LEN);
        p.set_tos(self.tos);
        p.set_total_len(total);
        p.set_ident(self.ident);
        p.set_dont_frag(self.dont_frag);
        p.set_ttl(self.ttl);
        p.set_protocol(self.protocol);
        p.set_src_addr(self.src_addr);
        p.set_dst_addr(self.dst_addr);
        p.fill_checksum();
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The IPv4 header of an rxe ACK (rxe_rc_pingpong): DF, TTL 64, id 0x7810.
    const HDR: [u8; 20] = [
        0x45, 0x00, 0x00, 0x30, 0x78, 0x10, 0x40, 0x00, 0x40, 0x11, 0xad, 0xfc, 0x0a, 0x4d, 0x00, 0x0b, 0x0a, 0x4d,
        0x00, 0x0c,
    ];

    fn packet() -> [u8; 48] {
        let mut b = [0u8; 48];
        b[..20].copy_from_slice(&HDR);
        b
    }

    fn repr() -> Ipv4Repr {
        Ipv4Repr {
            src_addr: Ipv4Addr::new(10, 77, 0, 11),
            dst_addr: Ipv4Addr::new(10, 77, 0, 12),
            protocol: PROTOCOL_UDP,
            payload_len: 28,
            ttl: 64,
            tos: 0,
            ident: 0x7810,
            dont_frag: true,
        }
    }

    #[test]
    fn deconstruct_and_parse() {
        let b = packet();
        let p = Ipv4Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.header_len(), 20);
        assert_eq!(p.total_len(), 48);
        assert!(p.dont_frag() && !p.more_frags());
        assert_eq!(p.checksum(), 0xadfc);
        assert!(p.verify_checksum());
        assert_eq!(p.payload().len(), 28);
        assert_eq!(Ipv4Repr::parse(&p).unwrap(), repr());
    }

    #[test]
    fn emit_over_junk() {
        let mut buf = [0xa5u8; 20];
        assert_eq!(repr().emit(&mut buf), Ok(20));
        assert_eq!(buf, HDR);
    }

    #[test]
    fn options_are_skipped() {
        let mut b = [0u8; 52];
        b[..20].copy_from_slice(&HDR);
        b[20..24].copy_from_slice(&[0x01, 0x01, 0x01, 0x00]); // NOP NOP NOP EOL
        let mut p = Ipv4Packet::new_unchecked(&mut b[..]);
        p.set_version_and_header_len(24);
        p.set_total_len(52);
        p.fill_checksum();
        let p = Ipv4Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.options(), &[1, 1, 1, 0]);
        assert_eq!(p.payload().len(), 28);
        assert_eq!(Ipv4Repr::parse(&p).unwrap(), repr());
    }

    #[test]
    fn rejects_bad_shapes() {
        let b = packet();
        assert_eq!(Ipv4Packet::new_checked(&b[..19]).unwrap_err(), Error::Truncated);
        assert_eq!(Ipv4Packet::new_checked(&b[..47]).unwrap_err(), Error::Truncated);
        let mut c = b;
        c[0] = 0x44; // IHL 4
        assert_eq!(Ipv4Packet::new_checked(&c[..]).unwrap_err(), Error::BadLength);
        let mut c = b;
        c[0] = 0x4f; // IHL 15 = 60 bytes > total length 48
        assert_eq!(Ipv4Packet::new_checked(&c[..]).unwrap_err(), Error::Truncated);
        let mut c = b;
        c[3] = 0x10; // total length 16 < header
        assert_eq!(Ipv4Packet::new_checked(&c[..]).unwrap_err(), Error::BadLength);
        let mut c = b;
        c[11] ^= 1;
        assert_eq!(Ipv4Repr::parse(&Ipv4Packet::new_unchecked(&c[..])), Err(Error::BadChecksum));
        let mut c = b;
        c[0] = 0x65;
        assert_eq!(Ipv4Repr::parse(&Ipv4Packet::new_unchecked(&c[..])), Err(Error::BadVersion(6)));
        let mut c = b;
        let mut p = Ipv4Packet::new_unchecked(&mut c[..]);
        set_u16(p.bm(), field::FLAGS_FRAG, FLAG_MF);
        p.fill_checksum();
        assert_eq!(Ipv4Repr::parse(&Ipv4Packet::new_unchecked(&c[..])), Err(Error::Fragmented));
    }
}
