//! How the engine reaches registered memory: the [`MemoryAccess`] trait and the scatter/gather
//! helpers built on it.
//!
//! The engine never holds a pointer. Every access names a key (lkey for local work requests, rkey for
//! remote requests), the protection domain of the QP, an address and a length; the implementation
//! resolves the key, checks bounds, PD and access rights and either performs the access or returns a
//! [`MemError`]. The engine turns that error into the right completion status or NAK.

use crate::hca::PdId;
use crate::wr::Sge;

/// Memory region access rights (verbs `IBV_ACCESS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No rights beyond local read.
    pub const NONE: Access = Access(0);
    /// The local HCA may write (receive buffers, read/atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote RDMA WRITE.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote RDMA READ.
    pub const REMOTE_READ: Access = Access(4);
    /// Remote atomics.
    pub const REMOTE_ATOMIC: Access = Access(8);

    /// From the verbs bit values.
    pub const fn from_bits(b: u32) -> Access {
        Access(b & 0xf)
    }
    /// The verbs bit values.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Union.
    pub const fn with(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
    /// All rights of `o` present.
    pub const fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

/// Whether a key is used by the local HCA on behalf of a work request or by a remote peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// An lkey from an SGE.
    Local,
    /// An rkey from a RETH or AtomicETH.
    Remote,
}

/// Why a memory access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemError {
    /// No region has this key (or it was invalidated).
    InvalidKey,
    /// The region belongs to another protection domain.
    PdMismatch,
    /// The region lacks the access right this operation needs.
    AccessDenied,
    /// The address range is not inside the region.
    OutOfBounds,
    /// An atomic target is not 8-byte aligned.
    Misaligned,
}

/// An atomic operation on an 8-byte word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Replace with `swap` if equal to `compare`.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Add `add`, wrapping.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

impl AtomicOp {
    /// The value stored given the original.
    pub fn apply(self, orig: u64) -> u64 {
        match self {
            AtomicOp::CompareSwap { compare, swap } if orig == compare => swap,
            AtomicOp::CompareSwap { .. } => orig,
            AtomicOp::FetchAdd { add } => orig.wrapping_add(add),
        }
    }
}

/// Access to registered memory, with key, bounds, PD and rights checks.
///
/// Local reads need no right; local writes need `LOCAL_WRITE`; remote reads, writes and atomics need
/// `REMOTE_READ`, `REMOTE_WRITE` and `REMOTE_ATOMIC`. Implementations must check before touching
/// memory: an `Err` means nothing was read or written.
pub trait MemoryAccess {
    /// Check that `[addr, addr+len)` under `key` is accessible with `access` from `pd`.
    fn check(&self, pd: PdId, key: u32, kind: KeyKind, addr: u64, len: u64, access: Access) -> Result<(), MemError>;
    /// Copy memory into `out`.
    fn read(&self, pd: PdId, key: u32, kind: KeyKind, addr: u64, out: &mut [u8]) -> Result<(), MemError>;
    /// Copy `data` into memory.
    fn write(&mut self, pd: PdId, key: u32, kind: KeyKind, addr: u64, data: &[u8]) -> Result<(), MemError>;
    /// Perform an atomic on the 8-byte word at `addr` (host byte order), returning the original value.
    fn atomic(&mut self, pd: PdId, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, MemError>;
    /// Invalidate a remote key (SEND with invalidate). Implementations without memory windows or
    /// fast-registration may refuse with `InvalidKey`.
    fn invalidate(&mut self, pd: PdId, rkey: u32) -> Result<(), MemError>;
}

/// Total length of a scatter/gather list.
pub fn sgl_len(sgl: &[Sge]) -> u64 {
    sgl.iter().map(|s| u64::from(s.length)).sum()
}

/// Check every SGE of a list for local access with `access`.
pub fn check_sgl(mem: &dyn MemoryAccess, pd: PdId, sgl: &[Sge], access: Access) -> Result<(), MemError> {
    sgl.iter().try_for_each(|s| mem.check(pd, s.lkey, KeyKind::Local, s.addr, u64::from(s.length), access))
}

/// Walk the pieces of `sgl` covering `[offset, offset+len)`, calling `f(sge, addr, range_in_piece)`.
fn walk(
    sgl: &[Sge],
    mut offset: u64,
    len: usize,
    mut f: impl FnMut(&Sge, u64, core::ops::Range<usize>) -> Result<(), MemError>,
) -> Result<(), MemError> {
    let mut done = 0usize;
    for s in sgl {
        if done == len {
            break;
        }
        let slen = u64::from(s.length);
        if offset >= slen {
            offset -= slen;
            continue;
        }
        let take = ((slen - offset) as usize).min(len - done);
        f(s, s.addr + offset, done..done + take)?;
        done += take;
        offset = 0;
    }
    if done == len {
        Ok(())
    } else {
        Err(MemError::OutOfBounds)
    }
}

/// Gather `out.len()` bytes starting at byte `offset` of the message described by `sgl`.
pub fn gather(mem: &dyn MemoryAccess, pd: PdId, sgl: &[Sge], offset: u64, out: &mut [u8]) -> Result<(), MemError> {
    let len = out.len();
    walk(sgl, offset, len, |s, addr, r| mem.read(pd, s.lkey, KeyKind::Local, addr, &mut out[r]))
}

/// The pieces of registered memory holding bytes `[offset, offset+len)` of the message described by
/// `sgl`, each checked for a local read as [`gather`] would read it, written into `out`: `Some(n)`
/// for `out[..n]`, `None` when they are more than `out` holds (nothing is checked then; gather
/// instead).
pub fn pieces(
    mem: &dyn MemoryAccess,
    pd: PdId,
    sgl: &[Sge],
    offset: u64,
    len: usize,
    out: &mut [Sge],
) -> Result<Option<usize>, MemError> {
    let mut n = 0;
    let mut overflow = false;
    walk(sgl, offset, len, |s, addr, r| {
        if n < out.len() {
            out[n] = Sge { addr, length: r.len() as u32, lkey: s.lkey };
        } else {
            overflow = true;
        }
        n += 1;
        Ok(())
    })?;
    if overflow {
        return Ok(None);
    }
    for p in &out[..n] {
        mem.check(pd, p.lkey, KeyKind::Local, p.addr, u64::from(p.length), Access::NONE)?;
    }
    Ok(Some(n))
}

/// Scatter `data` into the buffers of `sgl` starting at byte `offset` of the message.
pub fn scatter(mem: &mut dyn MemoryAccess, pd: PdId, sgl: &[Sge], offset: u64, data: &[u8]) -> Result<(), MemError> {
    walk(sgl, offset, data.len(), |s, addr, r| mem.write(pd, s.lkey, KeyKind::Local, addr, &data[r]))
}
