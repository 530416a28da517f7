//! The values the CM agent takes and gives: handles, parameters, events, outputs, errors.

use std::net::{IpAddr, SocketAddr};

use softrdma_transport::Mtu;
use softrdma_wire::cm::port_space;
use softrdma_wire::{Psn, Qpn};

/// A communication identifier (`struct rdma_cm_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdHandle(pub u32);

/// rdma_cm port spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// RDMA_PS_TCP: reliable connected (RC).
    Tcp,
    /// RDMA_PS_UDP: unreliable datagram (UD), resolved with SIDR.
    Udp,
    /// RDMA_PS_IB: any QP type.
    Ib,
}

impl PortSpace {
    /// The 16-bit code in service IDs.
    pub fn code(self) -> u16 {
        match self {
            PortSpace::Tcp => port_space::TCP,
            PortSpace::Udp => port_space::UDP,
            PortSpace::Ib => port_space::IB,
        }
    }

    /// Whether connections in this space are UD (SIDR).
    pub fn is_ud(self) -> bool {
        self == PortSpace::Udp
    }
}

/// The Q_Key rdma_cm uses for RDMA_PS_UDP (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// What the agent knows about its device.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Node / CA GUID.
    pub ca_guid: u64,
    /// Local addresses and the GID index each appears at.
    pub addrs: Vec<(IpAddr, u8)>,
    /// Port active MTU.
    pub mtu: Mtu,
    /// CM response timeout exponent (rdma_cm: 20, i.e. 4.3 s).
    pub response_timeout: u8,
    /// CM retries (rdma_cm: 15).
    pub max_retries: u8,
    /// Seed of the generator for communication IDs, PSNs and ports.
    pub seed: u64,
    /// How many times a REQ rejected with "invalid service ID" (nobody listens on the port) is
    /// sent again, [`NO_LISTENER_RETRY_DELAY`] apart, before REJECTED is reported. The kernel
    /// reports it at once (0, the default). On one host a server often calls `rdma_listen`
    /// moments after telling its client to go ahead (perftest's `-R` does, over its first
    /// connection); the kernel's asynchronous address and route resolution usually gives it that
    /// moment, softrdma's resolves at once, so librdmacm users get a short grace period instead.
    pub no_listener_retries: u8,
}

/// The wait before a REQ that found no listener is sent again (see
/// [`AgentConfig::no_listener_retries`]).
pub const NO_LISTENER_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

impl AgentConfig {
    /// rdma_cm's timeouts with the given device facts.
    pub fn new(ca_guid: u64, addrs: Vec<(IpAddr, u8)>, mtu: Mtu, seed: u64) -> AgentConfig {
        AgentConfig { ca_guid, addrs, mtu, response_timeout: 20, max_retries: 15, seed, no_listener_retries: 0 }
    }
}

/// A resolved route: where the CM and the QP send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Local GID index.
    pub sgid_index: u8,
    /// Local GID.
    pub sgid: [u8; 16],
    /// Remote GID.
    pub dgid: [u8; 16],
    /// Path MTU.
    pub mtu: Mtu,
}

/// Connection parameters (`struct rdma_conn_param`) plus the QP they apply to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// The local QP (RC/UC) or UD QP.
    pub qpn: Qpn,
    /// Private data for the peer.
    pub private_data: Vec<u8>,
    /// Incoming reads/atomics allowed (responder resources).
    pub responder_resources: u8,
    /// Outgoing reads/atomics (initiator depth).
    pub initiator_depth: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry_count: u8,
    /// The QP uses an SRQ.
    pub srq: bool,
    /// Q_Key of a UD QP (RDMA_UDP_QKEY by default).
    pub qkey: u32,
}

impl ConnParam {
    /// Defaults as rping/librdmacm use them: one read/atomic each way, 7 retries.
    pub fn new(qpn: Qpn) -> ConnParam {
        ConnParam {
            qpn,
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            qkey: RDMA_UDP_QKEY,
        }
    }
}

/// The peer's side of a connection, as events report it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnInfo {
    /// Private data the peer sent (after rdma_cm's own header, for a REQ).
    pub private_data: Vec<u8>,
    /// Peer's responder resources.
    pub responder_resources: u8,
    /// Peer's initiator depth.
    pub initiator_depth: u8,
    /// Peer's QPN.
    pub remote_qpn: Qpn,
    /// Peer's address (from rdma_cm's header, or the route).
    pub remote_addr: Option<SocketAddr>,
    /// Our address the peer asked for.
    pub local_addr: Option<SocketAddr>,
}

/// What a UD peer resolved to (SIDR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdInfo {
    /// Peer's GID.
    pub dgid: [u8; 16],
    /// Peer's QPN.
    pub remote_qpn: Qpn,
    /// Peer's Q_Key.
    pub qkey: u32,
}

/// rdma_cm event types.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventKind {
    /// RDMA_CM_EVENT_ADDR_RESOLVED.
    AddrResolved,
    /// RDMA_CM_EVENT_ADDR_ERROR.
    AddrError,
    /// RDMA_CM_EVENT_ROUTE_RESOLVED.
    RouteResolved,
    /// RDMA_CM_EVENT_ROUTE_ERROR.
    RouteError,
    /// RDMA_CM_EVENT_CONNECT_REQUEST, on a new ID `id`, for listener `listener`.
    ConnectRequest {
        /// The listening ID.
        listener: IdHandle,
    },
    /// RDMA_CM_EVENT_CONNECT_ERROR.
    ConnectError,
    /// RDMA_CM_EVENT_UNREACHABLE: the peer never answered.
    Unreachable,
    /// RDMA_CM_EVENT_REJECTED with the REJ reason (or SIDR status).
    Rejected {
        /// IB CM reason code.
        reason: u16,
    },
    /// RDMA_CM_EVENT_ESTABLISHED.
    Established,
    /// RDMA_CM_EVENT_DISCONNECTED.
    Disconnected,
    /// RDMA_CM_EVENT_TIMEWAIT_EXIT.
    TimewaitExit,
}

/// An event for the application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmEvent {
    /// The ID it concerns.
    pub id: IdHandle,
    /// What happened.
    pub kind: EventKind,
    /// The peer's side, where there is one.
    pub conn: ConnInfo,
    /// The UD peer, for SIDR.
    pub ud: Option<UdInfo>,
}

/// A QP state change the device must apply before the MADs that follow it are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpCommand {
    /// INIT → RTR towards the peer.
    Rtr {
        /// Local QP.
        qpn: Qpn,
        /// Peer's QP.
        dest_qpn: Qpn,
        /// Peer's starting PSN.
        rq_psn: Psn,
        /// Route.
        route: Route,
        /// Responder resources.
        max_dest_rd_atomic: u8,
        /// RNR NAK timer code.
        min_rnr_timer: u8,
    },
    /// RTR → RTS.
    Rts {
        /// Local QP.
        qpn: Qpn,
        /// Our starting PSN.
        sq_psn: Psn,
        /// Local ACK timeout exponent.
        timeout: u8,
        /// Transport retries.
        retry_cnt: u8,
        /// RNR retries.
        rnr_retry: u8,
        /// Initiator depth.
        max_rd_atomic: u8,
    },
    /// To ERR (disconnect).
    Err {
        /// Local QP.
        qpn: Qpn,
    },
}

/// Something for the device to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send a 256-byte MAD to the peer's QP1.
    Mad {
        /// Destination GID.
        dgid: [u8; 16],
        /// The MAD.
        mad: Box<[u8; 256]>,
    },
    /// Change a QP's state.
    Qp(QpCommand),
}

/// Why an API call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CmError {
    /// No such ID.
    NoSuchId,
    /// The call does not fit the ID's state (e.g. connect before resolve_route).
    InvalidState(&'static str),
    /// The address or port is taken.
    AddrInUse,
    /// No local address can reach that destination.
    AddrNotAvailable,
    /// Private data too long for the message.
    PrivateDataTooLong,
}

impl std::fmt::Display for CmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmError::NoSuchId => write!(f, "no such rdma_cm id"),
            CmError::InvalidState(s) => write!(f, "invalid in this state: {s}"),
            CmError::AddrInUse => write!(f, "address already in use"),
            CmError::AddrNotAvailable => write!(f, "no local address for that destination"),
            CmError::PrivateDataTooLong => write!(f, "private data too long"),
        }
    }
}

impl std::error::Error for CmError {}
