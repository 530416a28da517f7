//! QP attributes and the QP state machine's legal transitions (IBA 10.3.1, verbs `ibv_modify_qp`).
//!
//! [`ModifyQp`] is the attribute set of one modify call: the attributes present are its mask. The
//! [`transition`] table says, for each (current, next, QP type), which attributes are required and
//! which optional; anything else is refused, as the kernel's `ib_modify_qp_is_ok` does.

use crate::error::VerbsError;
use crate::memory::Access;
use softrdma_wire::{Psn, Qpn};

/// QP transport type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable connected.
    Uc,
    /// Unreliable datagram.
    Ud,
}

/// QP state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset: no packets in or out.
    Reset,
    /// Initialized: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drain: no new send WQE is started.
    Sqd,
    /// Send queue error (UC/UD): sends fail, receives go on.
    Sqe,
    /// Error: everything is flushed.
    Err,
}

impl QpState {
    /// Name as printed by verbs tools.
    pub fn name(self) -> &'static str {
        match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Err => "ERR",
        }
    }

    /// Packets are accepted by the responder.
    pub fn can_receive(self) -> bool {
        matches!(self, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe)
    }

    /// The requester may transmit.
    pub fn can_send(self) -> bool {
        matches!(self, QpState::Rts | QpState::Sqd)
    }
}

pub use softrdma_wire::Mtu;

/// Where packets of a QP (RC/UC) or of a UD work request go: the contents of an address handle.
/// The engine passes it through to [`crate::Transmit`] untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AddressVector {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Index of the source GID in the local table.
    pub sgid_index: u8,
    /// Hop limit / TTL.
    pub hop_limit: u8,
    /// Traffic class / TOS.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Destination LID (native IB only).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
}

/// Queue capacities requested at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

/// Attributes of one `modify_qp` call; the fields that are `Some` form the attribute mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModifyQp {
    /// Target state.
    pub state: Option<QpState>,
    /// Asserted current state.
    pub cur_state: Option<QpState>,
    /// P_Key index.
    pub pkey_index: Option<u16>,
    /// Port number (1).
    pub port: Option<u8>,
    /// Q_Key (UD).
    pub qkey: Option<u32>,
    /// Remote access rights granted to incoming requests (RC/UC).
    pub access: Option<Access>,
    /// Primary path.
    pub av: Option<AddressVector>,
    /// Path MTU.
    pub path_mtu: Option<Mtu>,
    /// Remote QPN.
    pub dest_qpn: Option<Qpn>,
    /// Expected receive PSN.
    pub rq_psn: Option<Psn>,
    /// Responder resources: incoming reads/atomics outstanding.
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR NAK timer code sent to the requester (0..=31).
    pub min_rnr_timer: Option<u8>,
    /// First send PSN.
    pub sq_psn: Option<Psn>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (0 = infinite).
    pub timeout: Option<u8>,
    /// Transport retries (0..=7).
    pub retry_cnt: Option<u8>,
    /// RNR retries (0..=7, 7 = infinite).
    pub rnr_retry: Option<u8>,
    /// Initiator depth: outgoing reads/atomics outstanding.
    pub max_rd_atomic: Option<u8>,
    /// Ask for an `SqDrained` event when entering SQD.
    pub en_sqd_async_notify: Option<bool>,
}

/// Attribute mask bits, one per [`ModifyQp`] field.
#[allow(missing_docs)]
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const DEST_QPN: u32 = 1 << 20;
}

impl ModifyQp {
    /// The attribute mask implied by the fields present.
    pub fn mask(&self) -> u32 {
        use mask::*;
        [
            (self.state.is_some(), STATE),
            (self.cur_state.is_some(), CUR_STATE),
            (self.en_sqd_async_notify.is_some(), EN_SQD_ASYNC_NOTIFY),
            (self.access.is_some(), ACCESS_FLAGS),
            (self.pkey_index.is_some(), PKEY_INDEX),
            (self.port.is_some(), PORT),
            (self.qkey.is_some(), QKEY),
            (self.av.is_some(), AV),
            (self.path_mtu.is_some(), PATH_MTU),
            (self.timeout.is_some(), TIMEOUT),
            (self.retry_cnt.is_some(), RETRY_CNT),
            (self.rnr_retry.is_some(), RNR_RETRY),
            (self.rq_psn.is_some(), RQ_PSN),
            (self.max_rd_atomic.is_some(), MAX_QP_RD_ATOMIC),
            (self.min_rnr_timer.is_some(), MIN_RNR_TIMER),
            (self.sq_psn.is_some(), SQ_PSN),
            (self.max_dest_rd_atomic.is_some(), MAX_DEST_RD_ATOMIC),
            (self.dest_qpn.is_some(), DEST_QPN),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .fold(0, |m, (_, b)| m | b)
    }

    /// Range checks on values, independent of the transition.
    pub fn check_values(&self, max_rd_atomic: u8) -> Result<(), VerbsError> {
        let bad = |what: &'static str| Err(VerbsError::InvalidAttribute(what));
        if self.port.is_some_and(|p| p != 1) {
            return bad("port_num");
        }
        if self.pkey_index.is_some_and(|i| i != 0) {
            return bad("pkey_index");
        }
        if self.timeout.is_some_and(|t| t > 31) {
            return bad("timeout");
        }
        if self.retry_cnt.is_some_and(|t| t > 7) {
            return bad("retry_cnt");
        }
        if self.rnr_retry.is_some_and(|t| t > 7) {
            return bad("rnr_retry");
        }
        if self.min_rnr_timer.is_some_and(|t| t > 31) {
            return bad("min_rnr_timer");
        }
        if self.max_rd_atomic.is_some_and(|t| t > max_rd_atomic) {
            return bad("max_rd_atomic");
        }
        if self.max_dest_rd_atomic.is_some_and(|t| t > max_rd_atomic) {
            return bad("max_dest_rd_atomic");
        }
        Ok(())
    }
}

/// Required and optional attribute masks of a legal transition (STATE excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// Attributes that must be present.
    pub required: u32,
    /// Attributes that may be present.
    pub optional: u32,
}

/// The legal transition from `cur` to `next` for a QP of type `t`, or `None` if illegal.
pub fn transition(cur: QpState, next: QpState, t: QpType) -> Option<Transition> {
    use mask::*;
    use QpState::*;
    let by_type = |ud: (u32, u32), uc: (u32, u32), rc: (u32, u32)| {
        let (required, optional) = match t {
            QpType::Ud => ud,
            QpType::Uc => uc,
            QpType::Rc => rc,
        };
        Some(Transition { required, optional })
    };
    let none = Some(Transition { required: 0, optional: 0 });
    match (cur, next) {
        (_, Reset) | (_, Err) => none,
        (Reset, Init) => by_type(
            (PKEY_INDEX | PORT | QKEY, 0),
            (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
            (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
        ),
        (Init, Init) => by_type(
            (0, PKEY_INDEX | PORT | QKEY),
            (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
            (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
        ),
        (Init, Rtr) => by_type(
            (0, PKEY_INDEX | QKEY),
            (AV | PATH_MTU | DEST_QPN | RQ_PSN, ACCESS_FLAGS | PKEY_INDEX),
            (AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER, ACCESS_FLAGS | PKEY_INDEX),
        ),
        (Rtr, Rts) => by_type(
            (SQ_PSN, CUR_STATE | QKEY),
            (SQ_PSN, CUR_STATE | ACCESS_FLAGS),
            (TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC, CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER),
        ),
        (Rts, Rts) | (Sqd, Rts) => {
            by_type((0, CUR_STATE | QKEY), (0, CUR_STATE | ACCESS_FLAGS), (0, CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER))
        }
        (Rts, Sqd) => by_type((0, EN_SQD_ASYNC_NOTIFY), (0, EN_SQD_ASYNC_NOTIFY), (0, EN_SQD_ASYNC_NOTIFY)),
        (Sqd, Sqd) => by_type(
            (0, PKEY_INDEX | QKEY),
            (0, AV | ACCESS_FLAGS | PKEY_INDEX),
            (
                0,
                PORT | AV
                    | TIMEOUT
                    | RETRY_CNT
                    | RNR_RETRY
                    | MAX_QP_RD_ATOMIC
                    | MAX_DEST_RD_ATOMIC
                    | ACCESS_FLAGS
                    | PKEY_INDEX
                    | MIN_RNR_TIMER,
            ),
        ),
        (Sqe, Rts) if t != QpType::Rc => by_type((0, CUR_STATE | QKEY), (0, CUR_STATE | ACCESS_FLAGS), (0, 0)),
        _ => None,
    }
}

/// Check a modify against the transition table, from the QP's current state.
pub fn check_modify(cur: QpState, t: QpType, attr: &ModifyQp) -> Result<QpState, VerbsError> {
    if let Some(asserted) = attr.cur_state {
        if asserted != cur {
            return Err(VerbsError::InvalidAttribute("cur_state"));
        }
    }
    let next = attr.state.unwrap_or(cur);
    let tr = transition(cur, next, t).ok_or(VerbsError::IllegalTransition { from: cur, to: next })?;
    let given = attr.mask() & !mask::STATE;
    if given & tr.required != tr.required {
        return Err(VerbsError::MissingAttributes { from: cur, to: next, mask: tr.required & !given });
    }
    let extra = given & !(tr.required | tr.optional);
    if extra != 0 {
        return Err(VerbsError::UnexpectedAttributes { from: cur, to: next, mask: extra });
    }
    Ok(next)
}

/// Everything needed to create a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInit {
    /// Transport type.
    pub qp_type: QpType,
    /// Protection domain.
    pub pd: crate::hca::PdId,
    /// CQ for send completions.
    pub send_cq: crate::hca::CqId,
    /// CQ for receive completions.
    pub recv_cq: crate::hca::CqId,
    /// Shared receive queue, if any.
    pub srq: Option<crate::hca::SrqId>,
    /// Capacities.
    pub cap: QpCap,
    /// Every send WR generates a completion (`sq_sig_all`).
    pub sq_sig_all: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rc_rtr() -> ModifyQp {
        ModifyQp {
            state: Some(QpState::Rtr),
            av: Some(AddressVector::default()),
            path_mtu: Some(Mtu::M1024),
            dest_qpn: Some(Qpn::new(0x11)),
            rq_psn: Some(Psn::new(1)),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            ..Default::default()
        }
    }

    #[test]
    fn legal_and_illegal_transitions() {
        assert_eq!(check_modify(QpState::Init, QpType::Rc, &rc_rtr()), Ok(QpState::Rtr));
        // RESET -> RTR skips INIT.
        assert!(matches!(
            check_modify(QpState::Reset, QpType::Rc, &rc_rtr()),
            Err(VerbsError::IllegalTransition { .. })
        ));
        // Missing DEST_QPN.
        let mut m = rc_rtr();
        m.dest_qpn = None;
        assert_eq!(
            check_modify(QpState::Init, QpType::Rc, &m),
            Err(VerbsError::MissingAttributes { from: QpState::Init, to: QpState::Rtr, mask: mask::DEST_QPN })
        );
        // SQ_PSN is not allowed INIT->RTR.
        let mut m = rc_rtr();
        m.sq_psn = Some(Psn::new(0));
        assert!(matches!(check_modify(QpState::Init, QpType::Rc, &m), Err(VerbsError::UnexpectedAttributes { .. })));
        // UC INIT->RTR must not carry RC-only attributes.
        assert!(matches!(
            check_modify(QpState::Init, QpType::Uc, &rc_rtr()),
            Err(VerbsError::UnexpectedAttributes { .. })
        ));
        // SQE -> RTS is for UC/UD only.
        let to_rts = ModifyQp { state: Some(QpState::Rts), ..Default::default() };
        assert_eq!(check_modify(QpState::Sqe, QpType::Ud, &to_rts), Ok(QpState::Rts));
        assert!(check_modify(QpState::Sqe, QpType::Rc, &to_rts).is_err());
        // Anything to ERR and RESET.
        for s in [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe, QpState::Err] {
            let e = ModifyQp { state: Some(QpState::Err), ..Default::default() };
            assert_eq!(check_modify(s, QpType::Rc, &e), Ok(QpState::Err));
        }
        // ERR -> RTS is illegal.
        assert!(check_modify(QpState::Err, QpType::Rc, &to_rts).is_err());
        // A wrong asserted current state.
        let m = ModifyQp { state: Some(QpState::Rts), cur_state: Some(QpState::Init), ..Default::default() };
        assert_eq!(check_modify(QpState::Rts, QpType::Ud, &m), Err(VerbsError::InvalidAttribute("cur_state")));
    }

    #[test]
    fn mtu_sizes() {
        assert_eq!(Mtu::M256.bytes(), 256);
        assert_eq!(Mtu::M4096.bytes(), 4096);
        assert_eq!(Mtu::from_bytes(2048), Some(Mtu::M2048));
        assert_eq!(Mtu::from_bytes(1500), None);
    }

    #[test]
    fn value_ranges() {
        let m = ModifyQp { retry_cnt: Some(8), ..Default::default() };
        assert_eq!(m.check_values(16), Err(VerbsError::InvalidAttribute("retry_cnt")));
        let m = ModifyQp { max_rd_atomic: Some(17), ..Default::default() };
        assert_eq!(m.check_values(16), Err(VerbsError::InvalidAttribute("max_rd_atomic")));
        let m = ModifyQp { port: Some(2), ..Default::default() };
        assert!(m.check_values(16).is_err());
    }
}
