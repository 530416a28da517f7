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

/// The local ACK timeout exponent of the path (4.096 µs × 2^19 ≈ 2.1 s): the REQ's
/// `local_ack_timeout`, and the QP `timeout` the kernel's CM gives both sides of a RoCE
/// connection (packet lifetime 18 plus one, against the device's ACK delay of 15).
pub const ACK_TIMEOUT: u8 = 19;

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
    /// The agent moves the QP through RTR and RTS (and to ERR on disconnect), as the kernel does
    /// for an ID whose QP was made with `rdma_create_qp`. `false`: the application owns the QP
    /// (`ibv_create_qp`, or none): the active side gets CONNECT_RESPONSE on the REP and finishes
    /// with [`crate::CmAgent::establish`]; both sides move their QP with the attributes of
    /// [`crate::CmAgent::init_qp_attr`].
    pub drive_qp: bool,
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
            drive_qp: true,
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

/// Event statuses as the kernel's rdma_cm reports them: negative Linux errno values.
pub mod status {
    /// No such device: the ID's device (netdev) is gone.
    pub const ENODEV: i32 = -19;
    /// The address is not (or no longer) one of the device's.
    pub const EADDRNOTAVAIL: i32 = -99;
    /// The network is down (the port's link).
    pub const ENETDOWN: i32 = -100;
    /// No route to the destination.
    pub const ENETUNREACH: i32 = -101;
    /// No answer in time (UNREACHABLE, CONNECT_ERROR, a DREQ never answered).
    pub const ETIMEDOUT: i32 = -110;
    /// No route to the host.
    pub const EHOSTUNREACH: i32 = -113;
}

/// The QP state [`crate::CmAgent::init_qp_attr`] is asked about (`qp_attr->qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpAttrState {
    /// RESET → INIT.
    Init,
    /// INIT → RTR.
    Rtr,
    /// RTR → RTS.
    Rts,
}

/// QP access flags of [`QpAttr::access`], with the values of `enum ibv_access_flags`.
pub mod access {
    /// IBV_ACCESS_REMOTE_WRITE.
    pub const REMOTE_WRITE: u32 = 0x2;
    /// IBV_ACCESS_REMOTE_READ.
    pub const REMOTE_READ: u32 = 0x4;
    /// IBV_ACCESS_REMOTE_ATOMIC.
    pub const REMOTE_ATOMIC: u32 = 0x8;
}

/// The attributes for one QP transition (`rdma_init_qp_attr`): each `Some` is a bit of the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// The state to move to.
    pub state: QpAttrState,
    /// P_Key index (INIT).
    pub pkey_index: Option<u16>,
    /// Port number (INIT).
    pub port: Option<u8>,
    /// Remote access flags ([`access`]; INIT of RC/UC).
    pub access: Option<u32>,
    /// Q_Key (INIT of UD).
    pub qkey: Option<u32>,
    /// The address vector (RTR): route (GIDs, GID index, MTU) plus the GRH fields below.
    pub av: Option<Route>,
    /// GRH hop limit of the address vector.
    pub hop_limit: u8,
    /// GRH traffic class of the address vector.
    pub traffic_class: u8,
    /// GRH flow label of the address vector.
    pub flow_label: u32,
    /// Path MTU (RTR).
    pub path_mtu: Option<softrdma_transport::Mtu>,
    /// Peer's QPN (RTR).
    pub dest_qpn: Option<Qpn>,
    /// Peer's starting PSN (RTR).
    pub rq_psn: Option<Psn>,
    /// Incoming reads/atomics (RTR).
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR NAK timer code (RTR).
    pub min_rnr_timer: Option<u8>,
    /// Our starting PSN (RTS).
    pub sq_psn: Option<Psn>,
    /// Local ACK timeout exponent (RTS).
    pub timeout: Option<u8>,
    /// Transport retries (RTS).
    pub retry_cnt: Option<u8>,
    /// RNR retries (RTS).
    pub rnr_retry: Option<u8>,
    /// Outgoing reads/atomics (RTS).
    pub max_rd_atomic: Option<u8>,
}

impl QpAttr {
    /// Nothing set yet.
    pub fn new(state: QpAttrState) -> QpAttr {
        QpAttr {
            state,
            pkey_index: None,
            port: None,
            access: None,
            qkey: None,
            av: None,
            hop_limit: 0,
            traffic_class: 0,
            flow_label: 0,
            path_mtu: None,
            dest_qpn: None,
            rq_psn: None,
            max_dest_rd_atomic: None,
            min_rnr_timer: None,
            sq_psn: None,
            timeout: None,
            retry_cnt: None,
            rnr_retry: None,
            max_rd_atomic: None,
        }
    }
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
    /// RDMA_CM_EVENT_ADDR_ERROR with the kernel's status (a negative errno, see [`status`]).
    AddrError {
        /// e.g. [`status::ENETUNREACH`]: no route to the destination from the device.
        status: i32,
    },
    /// RDMA_CM_EVENT_ROUTE_RESOLVED.
    RouteResolved,
    /// RDMA_CM_EVENT_ROUTE_ERROR with the kernel's status (a negative errno, see [`status`]).
    RouteError {
        /// e.g. [`status::ENETUNREACH`]: the port is down.
        status: i32,
    },
    /// RDMA_CM_EVENT_CONNECT_REQUEST, on a new ID `id`, for listener `listener`.
    ConnectRequest {
        /// The listening ID.
        listener: IdHandle,
    },
    /// RDMA_CM_EVENT_CONNECT_RESPONSE: the REP arrived for a connection whose QP the application
    /// owns ([`ConnParam::drive_qp`] false); it moves the QP to RTR and RTS and calls
    /// [`crate::CmAgent::establish`].
    ConnectResponse,
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
    /// `rdma_cm_event.status` as the kernel sets it: 0, a negative errno ([`status`]: the
    /// resolution errors' own, [`status::ETIMEDOUT`] for UNREACHABLE, CONNECT_ERROR and a
    /// DISCONNECTED whose DREQ was never answered), or the REJ reason for REJECTED.
    pub status: i32,
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
    /// Source and destination addresses of different families.
    FamilyMismatch,
}

impl std::fmt::Display for CmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmError::NoSuchId => write!(f, "no such rdma_cm id"),
            CmError::InvalidState(s) => write!(f, "invalid in this state: {s}"),
            CmError::AddrInUse => write!(f, "address already in use"),
            CmError::AddrNotAvailable => write!(f, "no local address for that destination"),
            CmError::PrivateDataTooLong => write!(f, "private data too long"),
            CmError::FamilyMismatch => write!(f, "source and destination address families differ"),
        }
    }
}

impl std::error::Error for CmError {}
