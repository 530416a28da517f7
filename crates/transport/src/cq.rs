//! Work completions: status, opcode and flags with the verbs numbering.

use softrdma_wire::Qpn;

/// Completion status (verbs `ibv_wc_status`, same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// Success.
    Success = 0,
    /// Local length error: message too long for the receive buffer or the path.
    LocLenErr = 1,
    /// Local QP operation error.
    LocQpOpErr = 2,
    /// Local protection error: a local SGE failed its key, bounds or rights check.
    LocProtErr = 4,
    /// Flushed because the QP went to the error state.
    WrFlushErr = 5,
    /// Bad response: an unexpected opcode from the responder.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// The responder NAKed with invalid request.
    RemInvReqErr = 9,
    /// The responder NAKed with remote access error.
    RemAccessErr = 10,
    /// The responder NAKed with remote operational error.
    RemOpErr = 11,
    /// Transport retry counter exceeded (no response).
    RetryExcErr = 12,
    /// RNR retry counter exceeded.
    RnrRetryExcErr = 13,
    /// Fatal error.
    FatalErr = 19,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// The text of `ibv_wc_status_str`.
    pub fn description(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::FatalErr => "fatal error",
            WcStatus::GeneralErr => "general error",
        }
    }

    /// The verbs name, as `ibv_wc_status_str` prints in upper case.
    pub fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "SUCCESS",
            WcStatus::LocLenErr => "LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "LOC_PROT_ERR",
            WcStatus::WrFlushErr => "WR_FLUSH_ERR",
            WcStatus::BadRespErr => "BAD_RESP_ERR",
            WcStatus::LocAccessErr => "LOC_ACCESS_ERR",
            WcStatus::RemInvReqErr => "REM_INV_REQ_ERR",
            WcStatus::RemAccessErr => "REM_ACCESS_ERR",
            WcStatus::RemOpErr => "REM_OP_ERR",
            WcStatus::RetryExcErr => "RETRY_EXC_ERR",
            WcStatus::RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            WcStatus::FatalErr => "FATAL_ERR",
            WcStatus::GeneralErr => "GENERAL_ERR",
        }
    }
}

/// Completion opcode (verbs `ibv_wc_opcode`, same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// SEND (any kind).
    Send = 0,
    /// RDMA WRITE (with or without immediate).
    RdmaWrite = 1,
    /// RDMA READ.
    RdmaRead = 2,
    /// Compare-and-swap.
    CompSwap = 3,
    /// Fetch-and-add.
    FetchAdd = 4,
    /// A receive consumed by a SEND.
    Recv = 128,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// The completion of a receive WQE (`IBV_WC_RECV` or `IBV_WC_RECV_RDMA_WITH_IMM`): the
    /// receive-side opcodes, from 128 on.
    pub fn is_receive(self) -> bool {
        matches!(self, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
    }
}

/// Completion flags (verbs `IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WcFlags(u32);

impl WcFlags {
    /// No flag.
    pub const NONE: WcFlags = WcFlags(0);
    /// A GRH occupies the first 40 bytes of the receive buffer (UD).
    pub const GRH: WcFlags = WcFlags(1);
    /// `imm_data` is valid.
    pub const WITH_IMM: WcFlags = WcFlags(2);
    /// `invalidated_rkey` is valid.
    pub const WITH_INV: WcFlags = WcFlags(8);

    /// Union.
    pub const fn with(self, o: WcFlags) -> WcFlags {
        WcFlags(self.0 | o.0)
    }
    /// All flags of `o` present.
    pub const fn contains(self, o: WcFlags) -> bool {
        self.0 & o.0 == o.0
    }
    /// The verbs bit values.
    pub const fn bits(self) -> u32 {
        self.0
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's identifier.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode (meaningful on success; flushed receives report `Recv`).
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: message length, plus 40 for the GRH on UD).
    pub byte_len: u32,
    /// Immediate data (host order), when `flags` has `WITH_IMM`.
    pub imm: u32,
    /// Invalidated rkey, when `flags` has `WITH_INV`.
    pub invalidated_rkey: u32,
    /// Local QP.
    pub qp_num: Qpn,
    /// Source QP (UD receives).
    pub src_qp: Qpn,
    /// Flags.
    pub flags: WcFlags,
}

impl WorkCompletion {
    /// A receive that succeeded (a message arrived).
    pub fn is_successful_receive(&self) -> bool {
        self.status == WcStatus::Success && self.opcode.is_receive()
    }

    /// Whether this completion brought its poller data into its own memory: a receive, an RDMA
    /// READ's response, an atomic's original value (successful ones).
    pub fn brings_data(&self) -> bool {
        self.status == WcStatus::Success
            && (self.opcode.is_receive()
                || matches!(self.opcode, WcOpcode::RdmaRead | WcOpcode::CompSwap | WcOpcode::FetchAdd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A successful receive, READ or atomic brings its poller data; a send, a WRITE or a failure
    /// does not.
    #[test]
    fn which_completions_bring_data() {
        let wc = |opcode, status| WorkCompletion {
            wr_id: 1,
            status,
            opcode,
            byte_len: 8,
            imm: 0,
            invalidated_rkey: 0,
            qp_num: Qpn::new(2),
            src_qp: Qpn::new(0),
            flags: WcFlags::NONE,
        };
        for op in
            [WcOpcode::Recv, WcOpcode::RecvRdmaWithImm, WcOpcode::RdmaRead, WcOpcode::CompSwap, WcOpcode::FetchAdd]
        {
            assert!(wc(op, WcStatus::Success).brings_data(), "{op:?}");
            assert!(!wc(op, WcStatus::WrFlushErr).brings_data(), "{op:?} flushed");
        }
        for op in [WcOpcode::Send, WcOpcode::RdmaWrite] {
            assert!(!wc(op, WcStatus::Success).brings_data(), "{op:?}");
        }
    }
}
