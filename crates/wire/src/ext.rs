//! The fixed-size extended transport headers: DETH, RETH, AtomicETH, AtomicAckETH, ImmDt and IETH.
//!
//! Each has a view (`XxxPacket<T>`) and a `Repr`. ImmDt and IETH are a single 32-bit word and are
//! represented as `u32` in [`crate::IbRepr`].

use crate::field::{set_u24, set_u32, set_u64, u24_at, u32_at, u64_at};
use crate::number::Qpn;
use crate::Result;

/// Length of the DETH.
pub const DETH_LEN: usize = 8;
/// Length of the RETH.
pub const RETH_LEN: usize = 16;
/// Length of the AtomicETH.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Length of the AtomicAckETH.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Length of ImmDt and of IETH.
pub const WORD_LEN: usize = 4;

view!(
    /// View of a DETH: `Q_Key(4) | reserved(1) | SrcQP(3)`.
    DethPacket,
    DETH_LEN
);
view!(
    /// View of a RETH: `VA(8) | R_Key(4) | DMA length(4)`.
    RethPacket,
    RETH_LEN
);
view!(
    /// View of an AtomicETH: `VA(8) | R_Key(4) | Swap or Add(8) | Compare(8)`.
    AtomicEthPacket,
    ATOMIC_ETH_LEN
);
view!(
    /// View of an AtomicAckETH: `original remote data(8)`.
    AtomicAckEthPacket,
    ATOMIC_ACK_ETH_LEN
);

impl<T: AsRef<[u8]>> DethPacket<T> {
    /// Queue key.
    pub fn qkey(&self) -> u32 {
        u32_at(self.buffer.as_ref(), 0)
    }
    /// Source QP.
    pub fn src_qp(&self) -> Qpn {
        Qpn::new(u24_at(self.buffer.as_ref(), 5))
    }
}
impl<T: AsRef<[u8]> + AsMut<[u8]>> DethPacket<T> {
    /// Set the queue key.
    pub fn set_qkey(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), 0, v);
    }
    /// Set the source QP (and clear the reserved byte).
    pub fn set_src_qp(&mut self, q: Qpn) {
        self.buffer.as_mut()[4] = 0;
        set_u24(self.buffer.as_mut(), 5, q.value());
    }
}

impl<T: AsRef<[u8]>> RethPacket<T> {
    /// Virtual address.
    pub fn va(&self) -> u64 {
        u64_at(self.buffer.as_ref(), 0)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        u32_at(self.buffer.as_ref(), 8)
    }
    /// DMA length.
    pub fn dma_len(&self) -> u32 {
        u32_at(self.buffer.as_ref(), 12)
    }
}
impl<T: AsRef<[u8]> + AsMut<[u8]>> RethPacket<T> {
    /// Set the virtual address.
    pub fn set_va(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), 0, v);
    }
    /// Set the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), 8, v);
    }
    /// Set the DMA length.
    pub fn set_dma_len(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), 12, v);
    }
}

impl<T: AsRef<[u8]>> AtomicEthPacket<T> {
    /// Virtual address.
    pub fn va(&self) -> u64 {
        u64_at(self.buffer.as_ref(), 0)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        u32_at(self.buffer.as_ref(), 8)
    }
    /// Swap value (compare-and-swap) or addend (fetch-and-add).
    pub fn swap_add(&self) -> u64 {
        u64_at(self.buffer.as_ref(), 12)
    }
    /// Compare value.
    pub fn compare(&self) -> u64 {
        u64_at(self.buffer.as_ref(), 20)
    }
}
impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEthPacket<T> {
    /// Set the virtual address.
    pub fn set_va(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), 0, v);
    }
    /// Set the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), 8, v);
    }
    /// Set the swap value or addend.
    pub fn set_swap_add(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), 12, v);
    }
    /// Set the compare value.
    pub fn set_compare(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), 20, v);
    }
}

impl<T: AsRef<[u8]>> AtomicAckEthPacket<T> {
    /// Original remote data.
    pub fn orig(&self) -> u64 {
        u64_at(self.buffer.as_ref(), 0)
    }
}
impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEthPacket<T> {
    /// Set the original remote data.
    pub fn set_orig(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), 0, v);
    }
}

/// A DETH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DethRepr {
    /// Queue key.
    pub qkey: u32,
    /// Source QP.
    pub src_qp: Qpn,
}

impl DethRepr {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &DethPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(DethRepr { qkey: p.qkey(), src_qp: p.src_qp() })
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut DethPacket<T>) {
        p.set_qkey(self.qkey);
        p.set_src_qp(self.src_qp);
    }
}

/// A RETH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RethRepr {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length of the whole message.
    pub dma_len: u32,
}

impl RethRepr {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &RethPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(RethRepr { va: p.va(), rkey: p.rkey(), dma_len: p.dma_len() })
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut RethPacket<T>) {
        p.set_va(self.va);
        p.set_rkey(self.rkey);
        p.set_dma_len(self.dma_len);
    }
}

/// An AtomicETH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicEthRepr {
    /// Virtual address (8-byte aligned for a valid request).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &AtomicEthPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(AtomicEthRepr { va: p.va(), rkey: p.rkey(), swap_add: p.swap_add(), compare: p.compare() })
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut AtomicEthPacket<T>) {
        p.set_va(self.va);
        p.set_rkey(self.rkey);
        p.set_swap_add(self.swap_add);
        p.set_compare(self.compare);
    }
}

/// An AtomicAckETH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicAckEthRepr {
    /// The remote data before the atomic operation.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &AtomicAckEthPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(AtomicAckEthRepr { orig: p.orig() })
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut AtomicAckEthPacket<T>) {
        p.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reth_bytes() {
        let bytes: [u8; 16] =
            [0x00, 0x00, 0x55, 0x55, 0x66, 0x77, 0x80, 0x00, 0x00, 0x00, 0x12, 0x34, 0x00, 0x00, 0x20, 0x00];
        let r = RethRepr::parse(&RethPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r, RethRepr { va: 0x5555_6677_8000, rkey: 0x1234, dma_len: 0x2000 });
        let mut out = [0xa5u8; 16];
        r.emit(&mut RethPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(RethPacket::new_checked(&bytes[..15]).unwrap_err(), crate::Error::Truncated);
    }

    #[test]
    fn deth_clears_reserved_byte() {
        let r = DethRepr { qkey: 0x1111_1111, src_qp: Qpn::new(0x12) };
        let mut out = [0xa5u8; 8];
        r.emit(&mut DethPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, [0x11, 0x11, 0x11, 0x11, 0x00, 0x00, 0x00, 0x12]);
        assert_eq!(DethRepr::parse(&DethPacket::new_checked(&out[..]).unwrap()).unwrap(), r);
    }

    #[test]
    fn atomic_eth_layout() {
        let r = AtomicEthRepr { va: 0x1122_3344_5566_7788, rkey: 0xaabb_ccdd, swap_add: 1, compare: 2 };
        let mut out = [0xa5u8; 28];
        r.emit(&mut AtomicEthPacket::new_unchecked(&mut out[..]));
        assert_eq!(&out[8..12], &[0xaa, 0xbb, 0xcc, 0xdd]);
        assert_eq!(out[19], 1);
        assert_eq!(out[27], 2);
        assert_eq!(AtomicEthRepr::parse(&AtomicEthPacket::new_checked(&out[..]).unwrap()).unwrap(), r);
        let a = AtomicAckEthRepr { orig: 0xdead_beef };
        let mut o = [0u8; 8];
        a.emit(&mut AtomicAckEthPacket::new_unchecked(&mut o[..]));
        assert_eq!(AtomicAckEthRepr::parse(&AtomicAckEthPacket::new_checked(&o[..]).unwrap()).unwrap(), a);
    }
}
