//! Errors of verbs calls made on the engine (API misuse and resource limits).

use crate::attr::QpState;
use core::fmt;

/// Why a verbs call was refused. Nothing changed when one of these is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerbsError {
    /// No such QP, CQ or SRQ.
    NoSuchObject,
    /// The modify names a transition the state machine does not allow.
    IllegalTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Required attributes are missing (mask bits in [`crate::attr::mask`]).
    MissingAttributes {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// Missing bits.
        mask: u32,
    },
    /// Attributes not allowed for this transition were given.
    UnexpectedAttributes {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
        /// Offending bits.
        mask: u32,
    },
    /// An attribute value is out of range.
    InvalidAttribute(&'static str),
    /// The work queue is full.
    QueueFull,
    /// Posting is not allowed in the QP's current state.
    InvalidState(QpState),
    /// The work request is malformed for this QP (too many SGEs, inline too long, op not supported by
    /// the QP type, UD destination missing...).
    InvalidWorkRequest(&'static str),
    /// A capacity asked for exceeds the device limits.
    CapacityExceeded(&'static str),
    /// The object is still in use (a CQ or SRQ with QPs attached).
    Busy,
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerbsError::NoSuchObject => write!(f, "no such object"),
            VerbsError::IllegalTransition { from, to } => {
                write!(f, "illegal QP state transition {} -> {}", from.name(), to.name())
            }
            VerbsError::MissingAttributes { from, to, mask } => {
                write!(f, "modify {} -> {} misses required attributes (mask {mask:#x})", from.name(), to.name())
            }
            VerbsError::UnexpectedAttributes { from, to, mask } => {
                write!(f, "modify {} -> {} has attributes it may not carry (mask {mask:#x})", from.name(), to.name())
            }
            VerbsError::InvalidAttribute(a) => write!(f, "invalid value for attribute {a}"),
            VerbsError::QueueFull => write!(f, "work queue full"),
            VerbsError::InvalidState(s) => {
                write!(f, "operation not allowed in QP state {}", s.name())
            }
            VerbsError::InvalidWorkRequest(w) => write!(f, "invalid work request: {w}"),
            VerbsError::CapacityExceeded(w) => write!(f, "capacity exceeds device limit: {w}"),
            VerbsError::Busy => write!(f, "object still in use"),
        }
    }
}

impl std::error::Error for VerbsError {}
