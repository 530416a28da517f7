//! A whole IB transport packet: BTH, the extension headers its opcode implies, payload, pad, ICRC.
//!
//! [`IbPacket`] checks once, against the opcode table, that the headers, pad and ICRC fit in the
//! buffer; after that every accessor is infallible. [`IbRepr`] holds the headers as values; it emits
//! the headers and pad and leaves the payload bytes and ICRC slot to the caller, so payload can be
//! copied straight from registered memory into the packet buffer and the ICRC filled in by the
//! encapsulation that knows the IP header ([`crate::icrc`]).

use crate::aeth::{AethPacket, AethRepr};
use crate::bth::{BthPacket, BthRepr, BTH_LEN};
use crate::ext::{
    AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr, DethPacket, DethRepr, RethPacket, RethRepr,
};
use crate::field::{set_u32, u32_at};
use crate::opcode::{Flags, HeaderSet, OpcodeInfo};
use crate::{Error, Result, ICRC_LEN};

/// Number of pad bytes that bring `payload_len` to a multiple of four.
pub const fn pad_for(payload_len: usize) -> u8 {
    ((4 - (payload_len & 3)) & 3) as u8
}

/// A checked view of an IB transport packet (BTH through ICRC).
#[derive(Debug, Clone)]
pub struct IbPacket<T: AsRef<[u8]>> {
    buffer: T,
    info: &'static OpcodeInfo,
}

impl<T: AsRef<[u8]>> IbPacket<T> {
    /// Check `buffer` against the opcode table: known opcode, version 0, every header present, pad
    /// consistent, room for the ICRC. Opcodes without payload must have none.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        let bth = BthPacket::new_checked(b)?;
        let info = bth.opcode().info().ok_or(Error::UnknownOpcode(bth.opcode().0))?;
        if bth.tver() != 0 {
            return Err(Error::BadVersion(bth.tver()));
        }
        let hdr = info.header_len();
        if b.len() < hdr + ICRC_LEN {
            return Err(Error::Truncated);
        }
        let rest = b.len() - hdr - ICRC_LEN;
        let pad = usize::from(bth.pad());
        if info.is(Flags::PAYLOAD) {
            if pad > rest {
                return Err(Error::BadPad);
            }
        } else if pad != 0 {
            return Err(Error::BadPad);
        } else if rest != 0 {
            return Err(Error::BadLength);
        }
        Ok(IbPacket { buffer, info })
    }

    /// The opcode table entry.
    pub fn info(&self) -> &'static OpcodeInfo {
        self.info
    }

    /// Give back the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The whole packet.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The BTH view.
    pub fn bth(&self) -> BthPacket<&[u8]> {
        BthPacket::new_unchecked(&self.buffer.as_ref()[..BTH_LEN])
    }

    fn header(&self, h: HeaderSet) -> Option<&[u8]> {
        let off = self.info.headers.offset_of(h)?;
        Some(&self.buffer.as_ref()[off..self.info.header_len()])
    }

    /// The DETH view, if the opcode carries one.
    pub fn deth(&self) -> Option<DethPacket<&[u8]>> {
        self.header(HeaderSet::DETH).map(DethPacket::new_unchecked)
    }
    /// The RETH view, if the opcode carries one.
    pub fn reth(&self) -> Option<RethPacket<&[u8]>> {
        self.header(HeaderSet::RETH).map(RethPacket::new_unchecked)
    }
    /// The AtomicETH view, if the opcode carries one.
    pub fn atomic_eth(&self) -> Option<AtomicEthPacket<&[u8]>> {
        self.header(HeaderSet::ATOMIC_ETH).map(AtomicEthPacket::new_unchecked)
    }
    /// The AETH view, if the opcode carries one.
    pub fn aeth(&self) -> Option<AethPacket<&[u8]>> {
        self.header(HeaderSet::AETH).map(AethPacket::new_unchecked)
    }
    /// The AtomicAckETH view, if the opcode carries one.
    pub fn atomic_ack_eth(&self) -> Option<AtomicAckEthPacket<&[u8]>> {
        self.header(HeaderSet::ATOMIC_ACK_ETH).map(AtomicAckEthPacket::new_unchecked)
    }
    /// Immediate data, if the opcode carries it.
    pub fn imm(&self) -> Option<u32> {
        self.header(HeaderSet::IMMDT).map(|h| u32_at(h, 0))
    }
    /// The rkey to invalidate, if the opcode carries an IETH.
    pub fn ieth(&self) -> Option<u32> {
        self.header(HeaderSet::IETH).map(|h| u32_at(h, 0))
    }

    /// Payload bytes, without the pad.
    pub fn payload(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let end = b.len() - ICRC_LEN - usize::from(self.bth().pad());
        &b[self.info.header_len()..end]
    }

    /// Everything the ICRC covers after the BTH-level pseudo header: the bytes before the ICRC.
    pub fn covered(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[..b.len() - ICRC_LEN]
    }

    /// The ICRC as carried (the CRC-32 value, transmitted least significant byte first as rxe does).
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        u32::from_le_bytes([b[b.len() - 4], b[b.len() - 3], b[b.len() - 2], b[b.len() - 1]])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IbPacket<T> {
    /// Mutable payload bytes, without the pad.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.info.header_len();
        let pad = usize::from(self.bth().pad());
        let b = self.buffer.as_mut();
        let end = b.len() - ICRC_LEN - pad;
        &mut b[start..end]
    }

    /// Store an ICRC value.
    pub fn set_icrc(&mut self, icrc: u32) {
        let b = self.buffer.as_mut();
        let n = b.len();
        b[n - ICRC_LEN..].copy_from_slice(&icrc.to_le_bytes());
    }
}

/// An IB transport packet's headers as values, and its payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IbRepr {
    /// Base transport header. On emit its `pad` is recomputed from `payload_len`.
    pub bth: BthRepr,
    /// DETH (UD).
    pub deth: Option<DethRepr>,
    /// RETH (first write packet, read request).
    pub reth: Option<RethRepr>,
    /// AtomicETH (atomic requests).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// AETH (acknowledgements, read responses).
    pub aeth: Option<AethRepr>,
    /// AtomicAckETH (atomic acknowledge).
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Rkey to invalidate.
    pub ieth: Option<u32>,
    /// Payload length in bytes (without pad).
    pub payload_len: usize,
}

impl IbRepr {
    /// Headers of `p` as values.
    pub fn parse<T: AsRef<[u8]>>(p: &IbPacket<T>) -> Result<IbRepr> {
        Ok(IbRepr {
            bth: BthRepr::parse(&p.bth())?,
            deth: p.deth().map(|h| DethRepr::parse(&h)).transpose()?,
            reth: p.reth().map(|h| RethRepr::parse(&h)).transpose()?,
            atomic_eth: p.atomic_eth().map(|h| AtomicEthRepr::parse(&h)).transpose()?,
            aeth: p.aeth().map(|h| AethRepr::parse(&h)).transpose()?,
            atomic_ack_eth: p.atomic_ack_eth().map(|h| AtomicAckEthRepr::parse(&h)).transpose()?,
            imm: p.imm(),
            ieth: p.ieth(),
            payload_len: p.payload().len(),
        })
    }

    /// A repr with only a BTH: extension headers are added by the caller.
    pub fn new(bth: BthRepr) -> IbRepr {
        IbRepr {
            bth,
            deth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            imm: None,
            ieth: None,
            payload_len: 0,
        }
    }

    fn present(&self) -> HeaderSet {
        let mut s = HeaderSet::NONE;
        let mut add = |on: bool, h| {
            if on {
                s = s.with(h);
            }
        };
        add(self.deth.is_some(), HeaderSet::DETH);
        add(self.reth.is_some(), HeaderSet::RETH);
        add(self.atomic_eth.is_some(), HeaderSet::ATOMIC_ETH);
        add(self.aeth.is_some(), HeaderSet::AETH);
        add(self.atomic_ack_eth.is_some(), HeaderSet::ATOMIC_ACK_ETH);
        add(self.imm.is_some(), HeaderSet::IMMDT);
        add(self.ieth.is_some(), HeaderSet::IETH);
        s
    }

    /// Check that the headers present are exactly those the opcode carries.
    fn check(&self) -> Result<&'static OpcodeInfo> {
        let info = self.bth.opcode.info().ok_or(Error::UnknownOpcode(self.bth.opcode.0))?;
        let want =
            HeaderSet::ORDER.iter().filter(|(h, _)| *h != HeaderSet::CNP_RSVD).fold(HeaderSet::NONE, |s, (h, _)| {
                if info.headers.contains(*h) {
                    s.with(*h)
                } else {
                    s
                }
            });
        if want != self.present() {
            return Err(Error::Reserved);
        }
        if !info.is(Flags::PAYLOAD) && self.payload_len != 0 {
            return Err(Error::BadLength);
        }
        Ok(info)
    }

    /// Length of the headers (BTH and extensions).
    pub fn header_len(&self) -> usize {
        self.bth.opcode.info().map_or(BTH_LEN, |i| i.header_len())
    }

    /// Total packet length: headers, payload, pad and ICRC.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload_len + usize::from(pad_for(self.payload_len)) + ICRC_LEN
    }

    /// Byte range of the payload in an emitted packet.
    pub fn payload_range(&self) -> core::ops::Range<usize> {
        let h = self.header_len();
        h..h + self.payload_len
    }

    /// Write headers and zero pad into `buf[..self.buffer_len()]`. The payload range is left as it is
    /// (the caller fills it, before or after) and the ICRC slot is zeroed. Returns the packet length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let info = self.check()?;
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error::Truncated);
        }
        let buf = &mut buf[..len];
        let hdrs = info.headers;
        let at = |h| hdrs.offset_of(h).unwrap_or(0);
        let mut bth = self.bth;
        bth.pad = pad_for(self.payload_len);
        bth.emit(&mut BthPacket::new_unchecked(&mut buf[..BTH_LEN]));
        if let Some(h) = &self.deth {
            h.emit(&mut DethPacket::new_unchecked(&mut buf[at(HeaderSet::DETH)..]));
        }
        if let Some(h) = &self.reth {
            h.emit(&mut RethPacket::new_unchecked(&mut buf[at(HeaderSet::RETH)..]));
        }
        if let Some(h) = &self.atomic_eth {
            h.emit(&mut AtomicEthPacket::new_unchecked(&mut buf[at(HeaderSet::ATOMIC_ETH)..]));
        }
        if let Some(h) = &self.aeth {
            h.emit(&mut AethPacket::new_unchecked(&mut buf[at(HeaderSet::AETH)..]));
        }
        if let Some(h) = &self.atomic_ack_eth {
            h.emit(&mut AtomicAckEthPacket::new_unchecked(&mut buf[at(HeaderSet::ATOMIC_ACK_ETH)..]));
        }
        if let Some(v) = self.imm {
            set_u32(buf, at(HeaderSet::IMMDT), v);
        }
        if let Some(v) = self.ieth {
            set_u32(buf, at(HeaderSet::IETH), v);
        }
        if hdrs.contains(HeaderSet::CNP_RSVD) {
            let off = at(HeaderSet::CNP_RSVD);
            buf[off..off + 16].fill(0);
        }
        let pad_start = self.header_len() + self.payload_len;
        buf[pad_start..].fill(0);
        Ok(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aeth::Syndrome;
    use crate::number::{Psn, Qpn};
    use crate::opcode::Opcode;

    fn bth(op: u8) -> BthRepr {
        BthRepr::new(Opcode(op), Qpn::new(0x11), Psn::new(7))
    }

    #[test]
    fn emit_then_view_write_only_with_imm_and_odd_payload() {
        let mut r = IbRepr::new(bth(0x0b));
        r.reth = Some(RethRepr { va: 0x1000, rkey: 0x42, dma_len: 5 });
        r.imm = Some(0x5566_7788);
        r.payload_len = 5;
        let mut buf = [0xa5u8; 64];
        let n = r.emit(&mut buf).unwrap();
        assert_eq!(n, 32 + 5 + 3 + 4);
        buf[r.payload_range()].copy_from_slice(b"hello");
        let p = IbPacket::new_checked(&buf[..n]).unwrap();
        assert_eq!(p.payload(), b"hello");
        assert_eq!(p.bth().pad(), 3);
        assert_eq!(p.imm(), Some(0x5566_7788));
        let mut back = IbRepr::parse(&p).unwrap();
        back.bth.pad = 0;
        assert_eq!(back, r);
    }

    #[test]
    fn emit_rejects_missing_or_extra_headers() {
        let r = IbRepr::new(bth(0x0a)); // WRITE_ONLY without RETH
        assert_eq!(r.emit(&mut [0u8; 64]), Err(Error::Reserved));
        let mut r = IbRepr::new(bth(0x04));
        r.aeth = Some(AethRepr { syndrome: Syndrome::Ack { credits: 0 }, msn: 0 });
        assert_eq!(r.emit(&mut [0u8; 64]), Err(Error::Reserved));
        let mut r = IbRepr::new(bth(0x11));
        r.aeth = Some(AethRepr { syndrome: Syndrome::Ack { credits: 0 }, msn: 0 });
        r.payload_len = 4;
        assert_eq!(r.emit(&mut [0u8; 64]), Err(Error::BadLength));
        let mut r = IbRepr::new(bth(0x04));
        r.payload_len = 100;
        assert_eq!(r.emit(&mut [0u8; 64]), Err(Error::Truncated));
    }

    #[test]
    fn checked_view_rejects_bad_shapes() {
        let mut ack = IbRepr::new(bth(0x11));
        ack.aeth = Some(AethRepr { syndrome: Syndrome::Ack { credits: 0x1f }, msn: 1 });
        let mut buf = [0u8; 20];
        assert_eq!(ack.emit(&mut buf), Ok(20));
        assert!(IbPacket::new_checked(&buf[..]).is_ok());
        assert_eq!(IbPacket::new_checked(&buf[..19]).unwrap_err(), Error::Truncated);
        let mut long = [0u8; 24];
        long[..20].copy_from_slice(&buf);
        assert_eq!(IbPacket::new_checked(&long[..]).unwrap_err(), Error::BadLength);
        buf[1] = 0x10; // pad on an ACK
        assert_eq!(IbPacket::new_checked(&buf[..]).unwrap_err(), Error::BadPad);
        buf[1] = 0;
        buf[0] = 0x15;
        assert_eq!(IbPacket::new_checked(&buf[..]).unwrap_err(), Error::UnknownOpcode(0x15));
        // SEND_ONLY claiming 3 pad bytes with only 2 bytes after the BTH.
        let mut send = [0u8; 18];
        send[0] = 0x04;
        send[1] = 0x30;
        send[2] = 0xff;
        assert_eq!(IbPacket::new_checked(&send[..]).unwrap_err(), Error::BadPad);
    }
}
