//! The RDMA connection manager as a sans-IO state machine.
//!
//! A [`CmAgent`] is the CM of one device (port): it owns communication IDs, listeners and
//! connections, and speaks the IB CM protocol (REQ, MRA, REJ, REP, RTU, DREQ, DREP; SIDR_REQ and
//! SIDR_REP for UD) with the service IDs and private-data header of the Linux kernel's rdma_cm, so it
//! interoperates with it over RoCEv2. Inputs: API calls, [`CmAgent::handle_mad`] with MADs received on
//! QP1, [`CmAgent::handle_timeout`]. Outputs: [`CmAgent::poll_output`] — MADs to send to a peer's
//! QP1 and QP state changes to apply, in order — [`CmAgent::poll_event`] (rdma_cm events) and
//! [`CmAgent::poll_timeout`]. It never reads a clock or touches a socket; randomness (communication
//! IDs, PSNs, ports) comes from a seeded generator.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod agent;
mod types;

pub use agent::CmAgent;
pub use types::{
    access, status, AgentConfig, CmError, CmEvent, ConnInfo, ConnParam, EventKind, IdHandle, Output, PortSpace, QpAttr,
    QpAttrState, QpCommand, Route, UdInfo, ACK_TIMEOUT, NO_LISTENER_RETRY_DELAY,
};

#[cfg(test)]
mod tests;
