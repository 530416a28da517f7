//! Work requests as the engine receives them from the verbs layer.

use crate::attr::AddressVector;
use softrdma_wire::Qpn;

/// One scatter/gather element: `length` bytes at `addr` under local key `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region.
    pub lkey: u32,
}

impl Sge {
    /// An empty element (zero length), for filling arrays.
    pub const EMPTY: Sge = Sge { addr: 0, length: 0, lkey: 0 };
}

/// Scatter/gather elements kept in place, without an allocation.
const INLINE_SGES: usize = 2;

/// A scatter/gather list: up to two elements are stored in place (posting a work request with one
/// or two SGEs, the common case, allocates nothing); longer lists live on the heap. Reads as a
/// `[Sge]` slice. Two keeps a send WQE small: it is moved a few times per post, and with four in
/// place those moves showed up in callgrind's counts, for lists that are rare.
#[derive(Clone)]
pub struct SgeList(SgeRepr);

#[derive(Clone)]
enum SgeRepr {
    Inline(u8, [Sge; INLINE_SGES]),
    Heap(Vec<Sge>),
}

impl SgeList {
    /// An empty list.
    pub const fn new() -> SgeList {
        SgeList(SgeRepr::Inline(0, [Sge::EMPTY; INLINE_SGES]))
    }

    /// A list of one element.
    pub const fn one(sge: Sge) -> SgeList {
        SgeList(SgeRepr::Inline(1, [sge, Sge::EMPTY]))
    }

    /// Append an element (moves to the heap past two).
    pub fn push(&mut self, sge: Sge) {
        match &mut self.0 {
            SgeRepr::Inline(n, a) if usize::from(*n) < INLINE_SGES => {
                a[usize::from(*n)] = sge;
                *n += 1;
            }
            SgeRepr::Inline(n, a) => {
                let mut v = Vec::with_capacity(2 * INLINE_SGES);
                v.extend_from_slice(&a[..usize::from(*n)]);
                v.push(sge);
                self.0 = SgeRepr::Heap(v);
            }
            SgeRepr::Heap(v) => v.push(sge),
        }
    }

    /// The elements.
    pub fn as_slice(&self) -> &[Sge] {
        match &self.0 {
            SgeRepr::Inline(n, a) => &a[..usize::from(*n)],
            SgeRepr::Heap(v) => v,
        }
    }
}

impl Default for SgeList {
    fn default() -> SgeList {
        SgeList::new()
    }
}

impl core::ops::Deref for SgeList {
    type Target = [Sge];
    fn deref(&self) -> &[Sge] {
        self.as_slice()
    }
}

impl core::fmt::Debug for SgeList {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl PartialEq for SgeList {
    fn eq(&self, o: &SgeList) -> bool {
        self.as_slice() == o.as_slice()
    }
}

impl Eq for SgeList {}

impl FromIterator<Sge> for SgeList {
    fn from_iter<I: IntoIterator<Item = Sge>>(iter: I) -> SgeList {
        let mut l = SgeList::new();
        for s in iter {
            l.push(s);
        }
        l
    }
}

impl From<&[Sge]> for SgeList {
    fn from(s: &[Sge]) -> SgeList {
        if s.len() <= INLINE_SGES {
            s.iter().copied().collect()
        } else {
            SgeList(SgeRepr::Heap(s.to_vec()))
        }
    }
}

impl From<Vec<Sge>> for SgeList {
    fn from(v: Vec<Sge>) -> SgeList {
        if v.len() <= INLINE_SGES {
            SgeList::from(v.as_slice())
        } else {
            SgeList(SgeRepr::Heap(v))
        }
    }
}

impl<const N: usize> From<[Sge; N]> for SgeList {
    fn from(a: [Sge; N]) -> SgeList {
        SgeList::from(&a[..])
    }
}

impl<'a> IntoIterator for &'a SgeList {
    type Item = &'a Sge;
    type IntoIter = core::slice::Iter<'a, Sge>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// Flags of a send work request (verbs `IBV_SEND_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(u32);

impl SendFlags {
    /// No flag.
    pub const NONE: SendFlags = SendFlags(0);
    /// Wait for earlier reads and atomics to complete before starting.
    pub const FENCE: SendFlags = SendFlags(1);
    /// Generate a completion on success.
    pub const SIGNALED: SendFlags = SendFlags(2);
    /// Set the solicited-event bit on the last packet.
    pub const SOLICITED: SendFlags = SendFlags(4);
    /// Data was copied at post time (see [`Payload::Inline`]).
    pub const INLINE: SendFlags = SendFlags(8);

    /// From the verbs bit values.
    pub const fn from_bits(b: u32) -> SendFlags {
        SendFlags(b & 0xf)
    }
    /// Union.
    pub const fn with(self, o: SendFlags) -> SendFlags {
        SendFlags(self.0 | o.0)
    }
    /// All flags of `o` present.
    pub const fn contains(self, o: SendFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendWithImm(u32),
    /// SEND that invalidates the given rkey at the responder.
    SendWithInv(u32),
    /// RDMA WRITE.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate data (consumes a receive WQE at the responder).
    WriteWithImm {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ into the local SGEs.
    Read {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// ATOMIC compare-and-swap; the original value lands in the 8-byte local SGE.
    CompareSwap {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// ATOMIC fetch-and-add; the original value lands in the 8-byte local SGE.
    FetchAdd {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Addend.
        add: u64,
    },
}

impl SendOp {
    /// RDMA READ or atomic: bounded by `max_rd_atomic` and subject to fences.
    pub const fn is_read_or_atomic(&self) -> bool {
        matches!(self, SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
    /// An atomic.
    pub const fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
    /// A send (plain, immediate or invalidate).
    pub const fn is_send(&self) -> bool {
        matches!(self, SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_))
    }
}

/// Where the data of a send work request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// A scatter/gather list over registered memory (also the destination of reads and atomics).
    Sgl(SgeList),
    /// Bytes copied at post time (`IBV_SEND_INLINE`); no lkey involved.
    Inline(Vec<u8>),
}

impl Payload {
    /// Bytes the payload names: the inline bytes, or the SGL's lengths summed.
    pub fn byte_len(&self) -> u64 {
        match self {
            Payload::Inline(d) => d.len() as u64,
            Payload::Sgl(sgl) => crate::memory::sgl_len(sgl),
        }
    }
}

/// The destination of a UD send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    /// Address handle contents.
    pub av: AddressVector,
    /// Remote QPN.
    pub remote_qpn: Qpn,
    /// Remote Q_Key; if its high bit is set the QP's own Q_Key is used instead (IBA 10.2.5).
    pub remote_qkey: u32,
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// Data source (or destination for reads and atomics).
    pub payload: Payload,
    /// Flags.
    pub flags: SendFlags,
    /// UD destination (required on UD QPs, ignored otherwise).
    pub ud: Option<UdDest>,
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Buffers to scatter into.
    pub sgl: SgeList,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(i: u32) -> Sge {
        Sge { addr: u64::from(i) * 0x1000, length: i, lkey: i + 1 }
    }

    #[test]
    fn sge_list_in_place_and_on_the_heap() {
        let mut l = SgeList::new();
        assert!(l.is_empty());
        let want: Vec<Sge> = (0..9).map(sge).collect();
        for (i, s) in want.iter().enumerate() {
            l.push(*s);
            assert_eq!(&l[..], &want[..=i]);
        }
        assert_eq!(l, SgeList::from(want.clone()));
        assert_eq!(SgeList::from(&want[..2]), [sge(0), sge(1)].into());
        assert_eq!(SgeList::one(sge(3)).as_slice(), &[sge(3)]);
        assert_eq!(want.iter().copied().collect::<SgeList>().len(), 9);
        assert_ne!(SgeList::one(sge(1)), SgeList::new());
        assert_eq!(format!("{:?}", SgeList::one(sge(1))), format!("{:?}", [sge(1)]));
    }
}
