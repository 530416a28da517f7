//! The sans-IO InfiniBand transport engine.
//!
//! An [`Hca`] holds queue pairs, shared receive queues and completion queues. It is driven purely by
//! its inputs — verbs calls, [`Hca::handle_packet`] with received bytes, [`Hca::handle_timeout`] with
//! the current [`Instant`] — and produces outputs through polling: [`Hca::poll_transmit`] (packets
//! to send), [`Hca::poll_cq`] (work completions), [`Hca::poll_event`] (async events) and
//! [`Hca::poll_timeout`] (the next deadline). It never reads a clock, opens a socket or spawns a
//! thread; registered memory is reached only through the [`MemoryAccess`] trait.
//!
//! Call order for a driver: feed packets and timeouts as they come, then loop on `poll_transmit`
//! until it returns `None`, drain completions and events, and sleep until `poll_timeout`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod attr;
pub mod config;
pub mod cq;
pub mod error;
pub mod hca;
pub mod memory;
mod qp;
pub mod stats;
#[cfg(test)]
mod tests;
pub mod time;
pub mod wr;

pub use attr::{AddressVector, ModifyQp, Mtu, QpCap, QpInit, QpState, QpType};
pub use config::Config;
pub use cq::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
pub use error::VerbsError;
pub use hca::{AsyncEvent, CqId, DeferredPayload, DirectMessage, Hca, PdId, RxInfo, RxPlacement, SrqId, Transmit};
pub use memory::{Access, AtomicOp, KeyKind, MemError, MemoryAccess};
pub use stats::Counters;
pub use time::Instant;
pub use wr::{RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList};
