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
    Sgl(Vec<Sge>),
    /// Bytes copied at post time (`IBV_SEND_INLINE`); no lkey involved.
    Inline(Vec<u8>),
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
    pub sgl: Vec<Sge>,
}
