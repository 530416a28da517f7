//! Control messages between an application (or the `softrdma` CLI) and the daemon.
//!
//! One request, one response, each a single `SOCK_SEQPACKET` record: `u32 version`, `u16 kind`,
//! then the body ([`crate::codec`]). File descriptors ride along as `SCM_RIGHTS`: the tx end of a
//! completion channel with [`Request::CreateChannel`]; the doorbell eventfd and the async-event
//! socket with [`Response::Opened`]; the ring memfd with [`Response::Cq`], [`Response::Srq`] and
//! [`Response::Qp`]. The connection is the client's session: everything it created is destroyed
//! when it closes.
//!
//! The data path does not use these messages: work requests and completions go through the rings.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;

use softrdma_cm::{CmEvent, ConnInfo, ConnParam, EventKind, IdHandle, PortSpace, QpAttr, QpAttrState, Route, UdInfo};
use softrdma_device::netdev::{IfAddr, IfFlags, MacAddr, Netdev};
use softrdma_device::DeviceConfig;
use softrdma_transport::hca::QueuePairInfo;
use softrdma_transport::{
    Access, AddressVector, AsyncEvent, CqId, ModifyQp, Mtu, QpCap, QpState, QpType, SrqId, VerbsError,
};
use softrdma_wire::{Psn, Qpn};

use crate::codec::{DResult, DecodeError, Reader, Writer};
use crate::ABI_VERSION;

/// Largest control message.
pub const MAX_MSG: usize = 64 * 1024;

/// How a refusal of a `RegMrShared` for the memfd itself begins (the client then registers its
/// region for `process_vm` access instead): the daemon's kernel lacks what the checks need, or
/// the memfd failed them.
pub const SHARED_REGION_REFUSED: &str = "shared memory region refused";

/// What a client asks.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Request {
    /// First message: the client's ABI version.
    Hello,
    /// The daemon's devices.
    ListDevices,
    /// Attach this connection to a device (verbs objects need one).
    OpenDevice { name: String },
    /// Allocate a protection domain.
    AllocPd,
    /// Free a protection domain.
    DeallocPd { pd: u32 },
    /// Register `len` bytes at `addr` of the client's address space.
    RegMr { pd: u32, addr: u64, len: u64, access: u32 },
    /// Register a region that lives in a memfd shared with the daemon: the memfd comes with the
    /// request as its one descriptor (what the daemon requires of it: `shm::RegionMap::open_client`);
    /// `addr` is where the client maps it (page aligned), the region's address in SGEs and RETHs.
    /// The daemon maps the memfd itself and copies to and from its own mapping. Answered with
    /// [`Response::Id`] (the key), or refused with a message beginning [`SHARED_REGION_REFUSED`].
    RegMrShared { pd: u32, addr: u64, len: u64, access: u32 },
    /// Deregister.
    DeregMr { key: u32 },
    /// A completion channel; the datagram socket to send CQ handles on comes as a descriptor.
    CreateChannel,
    /// Close a completion channel.
    DestroyChannel { id: u32 },
    /// A CQ of at least `cqe` entries.
    CreateCq { cqe: u32, channel: Option<u32> },
    /// Destroy a CQ.
    DestroyCq { cq: u32 },
    /// An SRQ.
    CreateSrq { pd: u32, max_wr: u32, max_sge: u32 },
    /// Arm an SRQ's limit.
    ArmSrq { srq: u32, limit: u32 },
    /// Destroy an SRQ.
    DestroySrq { srq: u32 },
    /// A QP.
    CreateQp {
        pd: u32,
        qp_type: QpType,
        send_cq: u32,
        recv_cq: u32,
        srq: Option<u32>,
        cap: QpCap,
        sq_sig_all: bool,
        /// Bytes of data each send slot should have room for at least, whatever `cap` says (at
        /// most `slot::COPY_ROOM` taken): small payloads the client copies in when it posts.
        copy_room: u32,
    },
    /// Modify a QP.
    ModifyQp { qpn: u32, attr: ModifyQp },
    /// Query a QP.
    QueryQp { qpn: u32 },
    /// Destroy a QP.
    DestroyQp { qpn: u32 },
    /// `ibv_attach_mcast`: attach a UD QP to a multicast group.
    AttachMcast { qpn: u32, mgid: [u8; 16] },
    /// `ibv_detach_mcast`.
    DetachMcast { qpn: u32, mgid: [u8; 16] },
    /// Counters and object counts of one device or all.
    Stats { device: Option<String> },
    /// `link add NAME type rxe netdev IFACE [addr IP]`.
    LinkAdd { name: String, netdev: String, addr: Option<IpAddr> },
    /// `link delete NAME`.
    LinkDelete { name: String },
    /// `dev set NAME name NEWNAME`.
    Rename { name: String, new_name: String },
    /// `roce-mode NAME PORT v1|v2`.
    RoceMode { name: String, port: u8, v1: bool },
    /// An RDMA CM event channel; the datagram socket the daemon wakes it on comes as a descriptor
    /// (one byte per event; the events themselves are fetched with [`Request::CmGetEvent`]).
    CmCreateChannel,
    /// Close a CM event channel (its queued events are dropped).
    CmDestroyChannel { channel: u32 },
    /// `rdma_create_id`, reporting to `channel`.
    CmCreateId { channel: u32, ps: PortSpace },
    /// `rdma_destroy_id`.
    CmDestroyId { id: u32 },
    /// `rdma_bind_addr`.
    CmBind { id: u32, addr: SocketAddr },
    /// `rdma_resolve_addr`.
    CmResolveAddr { id: u32, src: Option<IpAddr>, dst: SocketAddr },
    /// `rdma_resolve_route`.
    CmResolveRoute { id: u32 },
    /// `rdma_listen`.
    CmListen { id: u32, backlog: u32 },
    /// `rdma_connect`.
    CmConnect { id: u32, param: ConnParam },
    /// `rdma_accept`.
    CmAccept { id: u32, param: ConnParam },
    /// `rdma_reject`.
    CmReject { id: u32, private_data: Vec<u8> },
    /// `rdma_disconnect`.
    CmDisconnect { id: u32 },
    /// `rdma_migrate_id`: later events of `id` go to `channel`.
    CmMigrate { id: u32, channel: u32 },
    /// An ID's route and addresses.
    CmQuery { id: u32 },
    /// The next event queued on `channel`, if any.
    CmGetEvent { channel: u32 },
    /// CM IDs alive on the device (all clients).
    CmIdCount,
    /// [`softrdma_cm::AgentConfig::no_listener_retries`] of the device's CM.
    CmSetNoListenerRetries { retries: u8 },
    /// `rdma_establish`: RTU for an application-owned QP after CONNECT_RESPONSE.
    CmEstablish { id: u32 },
    /// `rdma_init_qp_attr`: answered with [`Response::CmQpAttr`].
    CmInitQpAttr { id: u32, state: QpAttrState },
}

/// Why the daemon refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The engine refused (same meaning as in embedded mode).
    Verbs(VerbsError),
    /// A bad argument.
    InvalidArgument(String),
    /// No device of that name.
    UnknownDevice(String),
    /// Not allowed for this user.
    PermissionDenied(String),
    /// Anything else, described.
    Other(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Verbs(e) => write!(f, "{e}"),
            Refusal::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            Refusal::UnknownDevice(n) => write!(f, "IB device '{n}' wasn't found"),
            Refusal::PermissionDenied(s) => write!(f, "permission denied: {s}"),
            Refusal::Other(s) => write!(f, "{s}"),
        }
    }
}

/// One device as the daemon lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceEntry {
    /// Registry entry.
    pub config: DeviceConfig,
    /// Default RoCE mode of port 1 is v1.
    pub roce_v1: bool,
    /// The netdev as the daemon sees it now (None: missing, the device is not running).
    pub netdev: Option<Netdev>,
    /// The UDP port its endpoint uses.
    pub udp_port: u16,
}

/// Counters and objects of one device.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceStats {
    /// Device name.
    pub name: String,
    /// Device-wide counters, by name.
    pub counters: Vec<(String, u64)>,
    /// Per-QP counters: QPN, owner pid, counters by name.
    pub qps: Vec<QpStats>,
}

/// One QP's counters: QPN, owner pid, counters by name.
pub type QpStats = (u32, u32, Vec<(String, u64)>);

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Response {
    /// Done.
    Ok,
    /// Refused.
    Error(Refusal),
    /// Answer to hello.
    Hello { daemon_pid: u32 },
    /// The devices.
    Devices(Vec<DeviceEntry>),
    /// Attached (descriptors: doorbell eventfd, async-event socket).
    Opened(DeviceEntry),
    /// A new object's handle (PD, MR key, channel).
    Id(u32),
    /// A CQ (descriptor: ring memfd; one ring at offset 0).
    Cq { id: u32, capacity: u32 },
    /// An SRQ (descriptor: ring memfd; one ring at offset 0).
    Srq { id: u32, capacity: u32, slot_size: u32 },
    /// A QP (descriptor: memfd with the send ring at 0 and, without an SRQ, the receive ring at
    /// `rq_offset`).
    Qp { qpn: u32, sq_capacity: u32, sq_slot: u32, rq_capacity: u32, rq_slot: u32, rq_offset: u64 },
    /// A QP's attributes.
    QpInfo(QueuePairInfo),
    /// Statistics.
    Stats(Vec<DeviceStats>),
    /// A CM ID's route and addresses (local, peer).
    CmInfo { route: Option<Route>, local: Option<SocketAddr>, peer: Option<SocketAddr> },
    /// The next CM event of a channel (none queued: `None`), and whether more are queued.
    CmEvent { event: Option<CmEvent>, more: bool },
    /// The QP attributes of [`Request::CmInitQpAttr`].
    CmQpAttr(QpAttr),
}

// ---- helpers ---------------------------------------------------------------------------------

/// The engine's error texts are `&'static str`; across the socket they come back as owned strings,
/// interned once so the set stays bounded by the set of distinct texts.
fn intern(s: String) -> &'static str {
    static SET: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut g = SET.lock().unwrap_or_else(|e| e.into_inner());
    let set = g.get_or_insert_with(HashSet::new);
    if let Some(x) = set.get(s.as_str()) {
        return x;
    }
    if set.len() > 256 {
        return "error text unavailable";
    }
    let leaked: &'static str = Box::leak(s.into_boxed_str());
    set.insert(leaked);
    leaked
}

const STATES: [QpState; 7] =
    [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe, QpState::Err];

fn state_code(s: QpState) -> u8 {
    STATES.iter().position(|x| *x == s).unwrap_or(0) as u8
}
fn state_from(r: &mut Reader<'_>) -> DResult<QpState> {
    STATES.get(r.u8()? as usize).copied().ok_or(DecodeError("bad QP state"))
}
fn qp_type_code(t: QpType) -> u8 {
    match t {
        QpType::Rc => 0,
        QpType::Uc => 1,
        QpType::Ud => 2,
    }
}
fn qp_type_from(r: &mut Reader<'_>) -> DResult<QpType> {
    match r.u8()? {
        0 => Ok(QpType::Rc),
        1 => Ok(QpType::Uc),
        2 => Ok(QpType::Ud),
        _ => Err(DecodeError("bad QP type")),
    }
}
fn mtu_from(r: &mut Reader<'_>) -> DResult<Mtu> {
    let n = r.u8()?;
    Mtu::ALL.into_iter().find(|m| *m as u8 == n).ok_or(DecodeError("bad MTU"))
}

fn put_av(w: &mut Writer, av: &AddressVector) {
    w.raw(&av.dgid).u8(av.sgid_index).u8(av.hop_limit).u8(av.traffic_class).u32(av.flow_label).u16(av.dlid).u8(av.sl);
}
fn av_from(r: &mut Reader<'_>) -> DResult<AddressVector> {
    Ok(AddressVector {
        dgid: r.array()?,
        sgid_index: r.u8()?,
        hop_limit: r.u8()?,
        traffic_class: r.u8()?,
        flow_label: r.u32()?,
        dlid: r.u16()?,
        sl: r.u8()?,
    })
}

fn put_modify(w: &mut Writer, a: &ModifyQp) {
    w.u32(a.mask());
    if let Some(s) = a.state {
        w.u8(state_code(s));
    }
    if let Some(s) = a.cur_state {
        w.u8(state_code(s));
    }
    if let Some(v) = a.en_sqd_async_notify {
        w.bool(v);
    }
    if let Some(v) = a.access {
        w.u32(v.bits());
    }
    if let Some(v) = a.pkey_index {
        w.u16(v);
    }
    if let Some(v) = a.port {
        w.u8(v);
    }
    if let Some(v) = a.qkey {
        w.u32(v);
    }
    if let Some(v) = &a.av {
        put_av(w, v);
    }
    if let Some(v) = a.path_mtu {
        w.u8(v as u8);
    }
    for v in [a.timeout, a.retry_cnt, a.rnr_retry].into_iter().flatten() {
        w.u8(v);
    }
    if let Some(v) = a.rq_psn {
        w.u32(v.value());
    }
    if let Some(v) = a.max_rd_atomic {
        w.u8(v);
    }
    if let Some(v) = a.min_rnr_timer {
        w.u8(v);
    }
    if let Some(v) = a.sq_psn {
        w.u32(v.value());
    }
    if let Some(v) = a.max_dest_rd_atomic {
        w.u8(v);
    }
    if let Some(v) = a.dest_qpn {
        w.u32(v.value());
    }
}

fn modify_from(r: &mut Reader<'_>) -> DResult<ModifyQp> {
    use softrdma_transport::attr::mask as m;
    let bits = r.u32()?;
    let has = |b: u32| bits & b != 0;
    let mut a = ModifyQp::default();
    if has(m::STATE) {
        a.state = Some(state_from(r)?);
    }
    if has(m::CUR_STATE) {
        a.cur_state = Some(state_from(r)?);
    }
    if has(m::EN_SQD_ASYNC_NOTIFY) {
        a.en_sqd_async_notify = Some(r.bool()?);
    }
    if has(m::ACCESS_FLAGS) {
        a.access = Some(Access::from_bits(r.u32()?));
    }
    if has(m::PKEY_INDEX) {
        a.pkey_index = Some(r.u16()?);
    }
    if has(m::PORT) {
        a.port = Some(r.u8()?);
    }
    if has(m::QKEY) {
        a.qkey = Some(r.u32()?);
    }
    if has(m::AV) {
        a.av = Some(av_from(r)?);
    }
    if has(m::PATH_MTU) {
        a.path_mtu = Some(mtu_from(r)?);
    }
    if has(m::TIMEOUT) {
        a.timeout = Some(r.u8()?);
    }
    if has(m::RETRY_CNT) {
        a.retry_cnt = Some(r.u8()?);
    }
    if has(m::RNR_RETRY) {
        a.rnr_retry = Some(r.u8()?);
    }
    if has(m::RQ_PSN) {
        a.rq_psn = Some(Psn::new(r.u32()?));
    }
    if has(m::MAX_QP_RD_ATOMIC) {
        a.max_rd_atomic = Some(r.u8()?);
    }
    if has(m::MIN_RNR_TIMER) {
        a.min_rnr_timer = Some(r.u8()?);
    }
    if has(m::SQ_PSN) {
        a.sq_psn = Some(Psn::new(r.u32()?));
    }
    if has(m::MAX_DEST_RD_ATOMIC) {
        a.max_dest_rd_atomic = Some(r.u8()?);
    }
    if has(m::DEST_QPN) {
        a.dest_qpn = Some(Qpn::new(r.u32()?));
    }
    Ok(a)
}

fn put_qp_info(w: &mut Writer, q: &QueuePairInfo) {
    w.u32(q.qpn.value()).u8(state_code(q.state)).u8(qp_type_code(q.qp_type)).u32(q.qkey).u32(q.access.bits());
    put_av(w, &q.av);
    w.u8(q.path_mtu as u8).u32(q.dest_qpn.value());
    w.u8(q.timeout).u8(q.retry_cnt).u8(q.rnr_retry).u8(q.max_rd_atomic).u8(q.max_dest_rd_atomic).u8(q.min_rnr_timer);
    w.u32(q.rq_psn.value()).u32(q.sq_psn.value()).u32(q.sq_outstanding).u32(q.rq_posted);
}

fn qp_info_from(r: &mut Reader<'_>) -> DResult<QueuePairInfo> {
    Ok(QueuePairInfo {
        qpn: Qpn::new(r.u32()?),
        state: state_from(r)?,
        qp_type: qp_type_from(r)?,
        qkey: r.u32()?,
        access: Access::from_bits(r.u32()?),
        av: av_from(r)?,
        path_mtu: mtu_from(r)?,
        dest_qpn: Qpn::new(r.u32()?),
        timeout: r.u8()?,
        retry_cnt: r.u8()?,
        rnr_retry: r.u8()?,
        max_rd_atomic: r.u8()?,
        max_dest_rd_atomic: r.u8()?,
        min_rnr_timer: r.u8()?,
        rq_psn: Psn::new(r.u32()?),
        sq_psn: Psn::new(r.u32()?),
        sq_outstanding: r.u32()?,
        rq_posted: r.u32()?,
    })
}

fn put_netdev(w: &mut Writer, n: &Netdev) {
    w.u32(n.index).str(&n.name).bool(n.flags.up).bool(n.flags.running).bool(n.flags.lower_up).bool(n.flags.loopback);
    w.u32(n.mtu);
    match n.mac {
        Some(m) => w.u8(1).raw(&m.0),
        None => w.u8(0),
    };
    w.u32(n.addrs.len() as u32);
    for a in &n.addrs {
        w.ip(a.addr).u8(a.prefix_len);
    }
    w.opt_u32(n.speed_mbps);
}

fn netdev_from(r: &mut Reader<'_>) -> DResult<Netdev> {
    let index = r.u32()?;
    let name = r.str()?;
    let flags = IfFlags { up: r.bool()?, running: r.bool()?, lower_up: r.bool()?, loopback: r.bool()? };
    let mtu = r.u32()?;
    let mac = if r.bool()? { Some(MacAddr(r.array()?)) } else { None };
    let n = r.list_len()?;
    let mut addrs = Vec::with_capacity(n);
    for _ in 0..n {
        addrs.push(IfAddr::new(r.ip()?, r.u8()?));
    }
    Ok(Netdev { index, name, flags, mtu, mac, addrs, speed_mbps: r.opt_u32()? })
}

fn put_entry(w: &mut Writer, e: &DeviceEntry) {
    w.str(&e.config.name).str(&e.config.netdev);
    match e.config.addr {
        Some(a) => w.u8(1).ip(a),
        None => w.u8(0),
    };
    w.bool(e.roce_v1).u16(e.udp_port);
    match &e.netdev {
        Some(n) => {
            w.u8(1);
            put_netdev(w, n);
        }
        None => {
            w.u8(0);
        }
    }
}

fn entry_from(r: &mut Reader<'_>) -> DResult<DeviceEntry> {
    let name = r.str()?;
    let netdev = r.str()?;
    let mut config = DeviceConfig::new(name, netdev);
    if r.bool()? {
        config = config.with_addr(r.ip()?);
    }
    let roce_v1 = r.bool()?;
    let udp_port = r.u16()?;
    let netdev = if r.bool()? { Some(netdev_from(r)?) } else { None };
    Ok(DeviceEntry { config, roce_v1, netdev, udp_port })
}

fn put_counters(w: &mut Writer, c: &[(String, u64)]) {
    w.u32(c.len() as u32);
    for (k, v) in c {
        w.str(k).u64(*v);
    }
}

fn counters_from(r: &mut Reader<'_>) -> DResult<Vec<(String, u64)>> {
    let n = r.list_len()?;
    (0..n).map(|_| Ok((r.str()?, r.u64()?))).collect()
}

fn put_refusal(w: &mut Writer, e: &Refusal) {
    match e {
        Refusal::Verbs(v) => {
            w.u8(0);
            let (code, a, b, mask, text): (u8, QpState, QpState, u32, &str) = match v {
                VerbsError::NoSuchObject => (0, QpState::Reset, QpState::Reset, 0, ""),
                VerbsError::IllegalTransition { from, to } => (1, *from, *to, 0, ""),
                VerbsError::MissingAttributes { from, to, mask } => (2, *from, *to, *mask, ""),
                VerbsError::UnexpectedAttributes { from, to, mask } => (3, *from, *to, *mask, ""),
                VerbsError::InvalidAttribute(s) => (4, QpState::Reset, QpState::Reset, 0, s),
                VerbsError::QueueFull => (5, QpState::Reset, QpState::Reset, 0, ""),
                VerbsError::InvalidState(s) => (6, *s, QpState::Reset, 0, ""),
                VerbsError::InvalidWorkRequest(s) => (7, QpState::Reset, QpState::Reset, 0, s),
                VerbsError::CapacityExceeded(s) => (8, QpState::Reset, QpState::Reset, 0, s),
                VerbsError::Busy => (9, QpState::Reset, QpState::Reset, 0, ""),
                #[allow(unreachable_patterns)]
                other => {
                    w.buf.pop();
                    w.u8(4).str(&other.to_string());
                    return;
                }
            };
            w.u8(code).u8(state_code(a)).u8(state_code(b)).u32(mask).str(text);
        }
        Refusal::InvalidArgument(s) => {
            w.u8(1).str(s);
        }
        Refusal::UnknownDevice(s) => {
            w.u8(2).str(s);
        }
        Refusal::PermissionDenied(s) => {
            w.u8(3).str(s);
        }
        Refusal::Other(s) => {
            w.u8(4).str(s);
        }
    }
}

fn refusal_from(r: &mut Reader<'_>) -> DResult<Refusal> {
    Ok(match r.u8()? {
        0 => {
            let code = r.u8()?;
            let a = state_from(r)?;
            let b = state_from(r)?;
            let mask = r.u32()?;
            let text = r.str()?;
            Refusal::Verbs(match code {
                0 => VerbsError::NoSuchObject,
                1 => VerbsError::IllegalTransition { from: a, to: b },
                2 => VerbsError::MissingAttributes { from: a, to: b, mask },
                3 => VerbsError::UnexpectedAttributes { from: a, to: b, mask },
                4 => VerbsError::InvalidAttribute(intern(text)),
                5 => VerbsError::QueueFull,
                6 => VerbsError::InvalidState(a),
                7 => VerbsError::InvalidWorkRequest(intern(text)),
                8 => VerbsError::CapacityExceeded(intern(text)),
                9 => VerbsError::Busy,
                _ => return Err(DecodeError("bad verbs error code")),
            })
        }
        1 => Refusal::InvalidArgument(r.str()?),
        2 => Refusal::UnknownDevice(r.str()?),
        3 => Refusal::PermissionDenied(r.str()?),
        4 => Refusal::Other(r.str()?),
        _ => return Err(DecodeError("bad refusal kind")),
    })
}

fn header(w: &mut Writer, kind: u16) {
    w.u32(ABI_VERSION).u16(kind);
}

fn read_header(r: &mut Reader<'_>) -> DResult<u16> {
    if r.u32()? != ABI_VERSION {
        return Err(DecodeError("ABI version mismatch"));
    }
    r.u16()
}

// ---- RDMA CM values ---------------------------------------------------------------------------

/// Private data and similar byte strings: at most this long.
const MAX_BYTES: usize = 4096;

fn put_bytes(w: &mut Writer, b: &[u8]) {
    w.u32(b.len() as u32).raw(b);
}
fn bytes_from(r: &mut Reader<'_>) -> DResult<Vec<u8>> {
    let n = r.u32()? as usize;
    if n > MAX_BYTES {
        return Err(DecodeError("byte string too long"));
    }
    Ok(r.raw(n)?.to_vec())
}
fn put_sa(w: &mut Writer, a: &SocketAddr) {
    w.ip(a.ip()).u16(a.port());
}
fn sa_from(r: &mut Reader<'_>) -> DResult<SocketAddr> {
    Ok(SocketAddr::new(r.ip()?, r.u16()?))
}
fn put_opt_sa(w: &mut Writer, a: &Option<SocketAddr>) {
    match a {
        Some(a) => {
            w.u8(1);
            put_sa(w, a);
        }
        None => {
            w.u8(0);
        }
    }
}
fn opt_sa_from(r: &mut Reader<'_>) -> DResult<Option<SocketAddr>> {
    Ok(if r.bool()? { Some(sa_from(r)?) } else { None })
}
fn ps_code(ps: PortSpace) -> u8 {
    match ps {
        PortSpace::Tcp => 0,
        PortSpace::Udp => 1,
        PortSpace::Ib => 2,
    }
}
fn ps_from(r: &mut Reader<'_>) -> DResult<PortSpace> {
    match r.u8()? {
        0 => Ok(PortSpace::Tcp),
        1 => Ok(PortSpace::Udp),
        2 => Ok(PortSpace::Ib),
        _ => Err(DecodeError("bad port space")),
    }
}
fn put_param(w: &mut Writer, p: &ConnParam) {
    w.u32(p.qpn.value());
    put_bytes(w, &p.private_data);
    w.u8(p.responder_resources).u8(p.initiator_depth).u8(p.retry_count).u8(p.rnr_retry_count).bool(p.srq).u32(p.qkey);
    w.bool(p.drive_qp);
}
fn param_from(r: &mut Reader<'_>) -> DResult<ConnParam> {
    Ok(ConnParam {
        qpn: Qpn::new(r.u32()?),
        private_data: bytes_from(r)?,
        responder_resources: r.u8()?,
        initiator_depth: r.u8()?,
        retry_count: r.u8()?,
        rnr_retry_count: r.u8()?,
        srq: r.bool()?,
        qkey: r.u32()?,
        drive_qp: r.bool()?,
    })
}
fn qp_state_code(s: QpAttrState) -> u8 {
    match s {
        QpAttrState::Init => 1,
        QpAttrState::Rtr => 2,
        QpAttrState::Rts => 3,
    }
}
fn qp_state_from(r: &mut Reader<'_>) -> DResult<QpAttrState> {
    match r.u8()? {
        1 => Ok(QpAttrState::Init),
        2 => Ok(QpAttrState::Rtr),
        3 => Ok(QpAttrState::Rts),
        _ => Err(DecodeError("bad QP state")),
    }
}
fn put_opt_u8(w: &mut Writer, v: Option<u8>) {
    w.bool(v.is_some()).u8(v.unwrap_or(0));
}
fn opt_u8_from(r: &mut Reader<'_>) -> DResult<Option<u8>> {
    let (some, v) = (r.bool()?, r.u8()?);
    Ok(some.then_some(v))
}
fn put_opt_u32(w: &mut Writer, v: Option<u32>) {
    w.bool(v.is_some()).u32(v.unwrap_or(0));
}
fn opt_u32_from(r: &mut Reader<'_>) -> DResult<Option<u32>> {
    let (some, v) = (r.bool()?, r.u32()?);
    Ok(some.then_some(v))
}
fn put_qp_attr(w: &mut Writer, a: &QpAttr) {
    w.u8(qp_state_code(a.state));
    put_opt_u32(w, a.pkey_index.map(u32::from));
    put_opt_u8(w, a.port);
    put_opt_u32(w, a.access);
    put_opt_u32(w, a.qkey);
    match &a.av {
        Some(rt) => {
            w.u8(1);
            put_route(w, rt);
        }
        None => {
            w.u8(0);
        }
    }
    w.u8(a.hop_limit).u8(a.traffic_class).u32(a.flow_label);
    put_opt_u8(w, a.path_mtu.map(|m| m as u8));
    put_opt_u32(w, a.dest_qpn.map(|q| q.value()));
    put_opt_u32(w, a.rq_psn.map(|p| p.value()));
    put_opt_u8(w, a.max_dest_rd_atomic);
    put_opt_u8(w, a.min_rnr_timer);
    put_opt_u32(w, a.sq_psn.map(|p| p.value()));
    put_opt_u8(w, a.timeout);
    put_opt_u8(w, a.retry_cnt);
    put_opt_u8(w, a.rnr_retry);
    put_opt_u8(w, a.max_rd_atomic);
}
fn qp_attr_from(r: &mut Reader<'_>) -> DResult<QpAttr> {
    let mut a = QpAttr::new(qp_state_from(r)?);
    a.pkey_index = opt_u32_from(r)?.map(|v| v as u16);
    a.port = opt_u8_from(r)?;
    a.access = opt_u32_from(r)?;
    a.qkey = opt_u32_from(r)?;
    a.av = if r.bool()? { Some(route_from(r)?) } else { None };
    a.hop_limit = r.u8()?;
    a.traffic_class = r.u8()?;
    a.flow_label = r.u32()?;
    a.path_mtu = match opt_u8_from(r)? {
        Some(c) => Some(Mtu::ALL.into_iter().find(|m| *m as u8 == c).ok_or(DecodeError("bad MTU"))?),
        None => None,
    };
    a.dest_qpn = opt_u32_from(r)?.map(Qpn::new);
    a.rq_psn = opt_u32_from(r)?.map(Psn::new);
    a.max_dest_rd_atomic = opt_u8_from(r)?;
    a.min_rnr_timer = opt_u8_from(r)?;
    a.sq_psn = opt_u32_from(r)?.map(Psn::new);
    a.timeout = opt_u8_from(r)?;
    a.retry_cnt = opt_u8_from(r)?;
    a.rnr_retry = opt_u8_from(r)?;
    a.max_rd_atomic = opt_u8_from(r)?;
    Ok(a)
}
fn put_route(w: &mut Writer, rt: &Route) {
    w.u8(rt.sgid_index).raw(&rt.sgid).raw(&rt.dgid).u8(rt.mtu as u8);
}
fn route_from(r: &mut Reader<'_>) -> DResult<Route> {
    Ok(Route { sgid_index: r.u8()?, sgid: r.array()?, dgid: r.array()?, mtu: mtu_from(r)? })
}
fn put_kind(w: &mut Writer, k: &EventKind) {
    match k {
        EventKind::AddrResolved => w.u8(0),
        EventKind::AddrError { status } => w.u8(1).u32(*status as u32),
        EventKind::RouteResolved => w.u8(2),
        EventKind::RouteError { status } => w.u8(3).u32(*status as u32),
        EventKind::ConnectRequest { listener } => w.u8(4).u32(listener.0),
        EventKind::ConnectError => w.u8(5),
        EventKind::Unreachable => w.u8(6),
        EventKind::Rejected { reason } => w.u8(7).u16(*reason),
        EventKind::Established => w.u8(8),
        EventKind::Disconnected => w.u8(9),
        EventKind::TimewaitExit => w.u8(10),
        EventKind::ConnectResponse => w.u8(11),
        #[allow(unreachable_patterns)]
        _ => w.u8(255),
    };
}
fn kind_from(r: &mut Reader<'_>) -> DResult<EventKind> {
    Ok(match r.u8()? {
        0 => EventKind::AddrResolved,
        1 => EventKind::AddrError { status: r.u32()? as i32 },
        2 => EventKind::RouteResolved,
        3 => EventKind::RouteError { status: r.u32()? as i32 },
        4 => EventKind::ConnectRequest { listener: IdHandle(r.u32()?) },
        5 => EventKind::ConnectError,
        6 => EventKind::Unreachable,
        7 => EventKind::Rejected { reason: r.u16()? },
        8 => EventKind::Established,
        9 => EventKind::Disconnected,
        10 => EventKind::TimewaitExit,
        11 => EventKind::ConnectResponse,
        _ => return Err(DecodeError("bad CM event kind")),
    })
}
fn put_cm_event(w: &mut Writer, e: &CmEvent) {
    w.u32(e.id.0).u32(e.status as u32);
    put_kind(w, &e.kind);
    let c = &e.conn;
    put_bytes(w, &c.private_data);
    w.u8(c.responder_resources).u8(c.initiator_depth).u32(c.remote_qpn.value());
    put_opt_sa(w, &c.remote_addr);
    put_opt_sa(w, &c.local_addr);
    match &e.ud {
        Some(u) => {
            w.u8(1).raw(&u.dgid).u32(u.remote_qpn.value()).u32(u.qkey);
        }
        None => {
            w.u8(0);
        }
    }
}
fn cm_event_from(r: &mut Reader<'_>) -> DResult<CmEvent> {
    let id = IdHandle(r.u32()?);
    let status = r.u32()? as i32;
    let kind = kind_from(r)?;
    let conn = ConnInfo {
        private_data: bytes_from(r)?,
        responder_resources: r.u8()?,
        initiator_depth: r.u8()?,
        remote_qpn: Qpn::new(r.u32()?),
        remote_addr: opt_sa_from(r)?,
        local_addr: opt_sa_from(r)?,
    };
    let ud = if r.bool()? {
        Some(UdInfo { dgid: r.array()?, remote_qpn: Qpn::new(r.u32()?), qkey: r.u32()? })
    } else {
        None
    };
    Ok(CmEvent { id, kind, conn, ud, status })
}

impl Request {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Request::Hello => header(&mut w, 1),
            Request::ListDevices => header(&mut w, 2),
            Request::OpenDevice { name } => {
                header(&mut w, 3);
                w.str(name);
            }
            Request::AllocPd => header(&mut w, 4),
            Request::DeallocPd { pd } => {
                header(&mut w, 5);
                w.u32(*pd);
            }
            Request::RegMr { pd, addr, len, access } => {
                header(&mut w, 6);
                w.u32(*pd).u64(*addr).u64(*len).u32(*access);
            }
            Request::RegMrShared { pd, addr, len, access } => {
                header(&mut w, 24);
                w.u32(*pd).u64(*addr).u64(*len).u32(*access);
            }
            Request::DeregMr { key } => {
                header(&mut w, 7);
                w.u32(*key);
            }
            Request::CreateChannel => header(&mut w, 8),
            Request::DestroyChannel { id } => {
                header(&mut w, 9);
                w.u32(*id);
            }
            Request::CreateCq { cqe, channel } => {
                header(&mut w, 10);
                w.u32(*cqe).opt_u32(*channel);
            }
            Request::DestroyCq { cq } => {
                header(&mut w, 11);
                w.u32(*cq);
            }
            Request::CreateSrq { pd, max_wr, max_sge } => {
                header(&mut w, 12);
                w.u32(*pd).u32(*max_wr).u32(*max_sge);
            }
            Request::ArmSrq { srq, limit } => {
                header(&mut w, 13);
                w.u32(*srq).u32(*limit);
            }
            Request::DestroySrq { srq } => {
                header(&mut w, 14);
                w.u32(*srq);
            }
            Request::CreateQp { pd, qp_type, send_cq, recv_cq, srq, cap, sq_sig_all, copy_room } => {
                header(&mut w, 15);
                w.u32(*pd).u8(qp_type_code(*qp_type)).u32(*send_cq).u32(*recv_cq).opt_u32(*srq);
                w.u32(cap.max_send_wr).u32(cap.max_recv_wr).u32(cap.max_send_sge).u32(cap.max_recv_sge);
                w.u32(cap.max_inline_data).bool(*sq_sig_all).u32(*copy_room);
            }
            Request::ModifyQp { qpn, attr } => {
                header(&mut w, 16);
                w.u32(*qpn);
                put_modify(&mut w, attr);
            }
            Request::QueryQp { qpn } => {
                header(&mut w, 17);
                w.u32(*qpn);
            }
            Request::DestroyQp { qpn } => {
                header(&mut w, 18);
                w.u32(*qpn);
            }
            Request::AttachMcast { qpn, mgid } => {
                header(&mut w, 25);
                w.u32(*qpn).raw(mgid);
            }
            Request::DetachMcast { qpn, mgid } => {
                header(&mut w, 26);
                w.u32(*qpn).raw(mgid);
            }
            Request::Stats { device } => {
                header(&mut w, 19);
                match device {
                    Some(d) => w.u8(1).str(d),
                    None => w.u8(0),
                };
            }
            Request::LinkAdd { name, netdev, addr } => {
                header(&mut w, 20);
                w.str(name).str(netdev);
                match addr {
                    Some(a) => w.u8(1).ip(*a),
                    None => w.u8(0),
                };
            }
            Request::LinkDelete { name } => {
                header(&mut w, 21);
                w.str(name);
            }
            Request::Rename { name, new_name } => {
                header(&mut w, 22);
                w.str(name).str(new_name);
            }
            Request::RoceMode { name, port, v1 } => {
                header(&mut w, 23);
                w.str(name).u8(*port).bool(*v1);
            }
            Request::CmCreateChannel => header(&mut w, 40),
            Request::CmDestroyChannel { channel } => {
                header(&mut w, 41);
                w.u32(*channel);
            }
            Request::CmCreateId { channel, ps } => {
                header(&mut w, 42);
                w.u32(*channel).u8(ps_code(*ps));
            }
            Request::CmDestroyId { id } => {
                header(&mut w, 43);
                w.u32(*id);
            }
            Request::CmBind { id, addr } => {
                header(&mut w, 44);
                w.u32(*id);
                put_sa(&mut w, addr);
            }
            Request::CmResolveAddr { id, src, dst } => {
                header(&mut w, 45);
                w.u32(*id);
                match src {
                    Some(a) => w.u8(1).ip(*a),
                    None => w.u8(0),
                };
                put_sa(&mut w, dst);
            }
            Request::CmResolveRoute { id } => {
                header(&mut w, 46);
                w.u32(*id);
            }
            Request::CmListen { id, backlog } => {
                header(&mut w, 47);
                w.u32(*id).u32(*backlog);
            }
            Request::CmConnect { id, param } => {
                header(&mut w, 48);
                w.u32(*id);
                put_param(&mut w, param);
            }
            Request::CmAccept { id, param } => {
                header(&mut w, 49);
                w.u32(*id);
                put_param(&mut w, param);
            }
            Request::CmReject { id, private_data } => {
                header(&mut w, 50);
                w.u32(*id);
                put_bytes(&mut w, private_data);
            }
            Request::CmDisconnect { id } => {
                header(&mut w, 51);
                w.u32(*id);
            }
            Request::CmMigrate { id, channel } => {
                header(&mut w, 52);
                w.u32(*id).u32(*channel);
            }
            Request::CmQuery { id } => {
                header(&mut w, 53);
                w.u32(*id);
            }
            Request::CmGetEvent { channel } => {
                header(&mut w, 54);
                w.u32(*channel);
            }
            Request::CmIdCount => header(&mut w, 55),
            Request::CmSetNoListenerRetries { retries } => {
                header(&mut w, 56);
                w.u8(*retries);
            }
            Request::CmEstablish { id } => {
                header(&mut w, 57);
                w.u32(*id);
            }
            Request::CmInitQpAttr { id, state } => {
                header(&mut w, 58);
                w.u32(*id).u8(qp_state_code(*state));
            }
        }
        w.buf
    }

    /// Decode; anything malformed is an error.
    pub fn decode(buf: &[u8]) -> DResult<Request> {
        let mut r = Reader::new(buf);
        let req = match read_header(&mut r)? {
            1 => Request::Hello,
            2 => Request::ListDevices,
            3 => Request::OpenDevice { name: r.str()? },
            4 => Request::AllocPd,
            5 => Request::DeallocPd { pd: r.u32()? },
            6 => Request::RegMr { pd: r.u32()?, addr: r.u64()?, len: r.u64()?, access: r.u32()? },
            7 => Request::DeregMr { key: r.u32()? },
            8 => Request::CreateChannel,
            9 => Request::DestroyChannel { id: r.u32()? },
            10 => Request::CreateCq { cqe: r.u32()?, channel: r.opt_u32()? },
            11 => Request::DestroyCq { cq: r.u32()? },
            12 => Request::CreateSrq { pd: r.u32()?, max_wr: r.u32()?, max_sge: r.u32()? },
            13 => Request::ArmSrq { srq: r.u32()?, limit: r.u32()? },
            14 => Request::DestroySrq { srq: r.u32()? },
            15 => Request::CreateQp {
                pd: r.u32()?,
                qp_type: qp_type_from(&mut r)?,
                send_cq: r.u32()?,
                recv_cq: r.u32()?,
                srq: r.opt_u32()?,
                cap: QpCap {
                    max_send_wr: r.u32()?,
                    max_recv_wr: r.u32()?,
                    max_send_sge: r.u32()?,
                    max_recv_sge: r.u32()?,
                    max_inline_data: r.u32()?,
                },
                sq_sig_all: r.bool()?,
                copy_room: r.u32()?,
            },
            16 => Request::ModifyQp { qpn: r.u32()?, attr: modify_from(&mut r)? },
            17 => Request::QueryQp { qpn: r.u32()? },
            18 => Request::DestroyQp { qpn: r.u32()? },
            19 => Request::Stats { device: if r.bool()? { Some(r.str()?) } else { None } },
            20 => Request::LinkAdd {
                name: r.str()?,
                netdev: r.str()?,
                addr: if r.bool()? { Some(r.ip()?) } else { None },
            },
            21 => Request::LinkDelete { name: r.str()? },
            22 => Request::Rename { name: r.str()?, new_name: r.str()? },
            23 => Request::RoceMode { name: r.str()?, port: r.u8()?, v1: r.bool()? },
            24 => Request::RegMrShared { pd: r.u32()?, addr: r.u64()?, len: r.u64()?, access: r.u32()? },
            25 => Request::AttachMcast { qpn: r.u32()?, mgid: r.array()? },
            26 => Request::DetachMcast { qpn: r.u32()?, mgid: r.array()? },
            40 => Request::CmCreateChannel,
            41 => Request::CmDestroyChannel { channel: r.u32()? },
            42 => Request::CmCreateId { channel: r.u32()?, ps: ps_from(&mut r)? },
            43 => Request::CmDestroyId { id: r.u32()? },
            44 => Request::CmBind { id: r.u32()?, addr: sa_from(&mut r)? },
            45 => Request::CmResolveAddr {
                id: r.u32()?,
                src: if r.bool()? { Some(r.ip()?) } else { None },
                dst: sa_from(&mut r)?,
            },
            46 => Request::CmResolveRoute { id: r.u32()? },
            47 => Request::CmListen { id: r.u32()?, backlog: r.u32()? },
            48 => Request::CmConnect { id: r.u32()?, param: param_from(&mut r)? },
            49 => Request::CmAccept { id: r.u32()?, param: param_from(&mut r)? },
            50 => Request::CmReject { id: r.u32()?, private_data: bytes_from(&mut r)? },
            51 => Request::CmDisconnect { id: r.u32()? },
            52 => Request::CmMigrate { id: r.u32()?, channel: r.u32()? },
            53 => Request::CmQuery { id: r.u32()? },
            54 => Request::CmGetEvent { channel: r.u32()? },
            55 => Request::CmIdCount,
            56 => Request::CmSetNoListenerRetries { retries: r.u8()? },
            57 => Request::CmEstablish { id: r.u32()? },
            58 => Request::CmInitQpAttr { id: r.u32()?, state: qp_state_from(&mut r)? },
            _ => return Err(DecodeError("unknown request")),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Response {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Response::Ok => header(&mut w, 1),
            Response::Error(e) => {
                header(&mut w, 2);
                put_refusal(&mut w, e);
            }
            Response::Hello { daemon_pid } => {
                header(&mut w, 3);
                w.u32(*daemon_pid);
            }
            Response::Devices(list) => {
                header(&mut w, 4);
                w.u32(list.len() as u32);
                for e in list {
                    put_entry(&mut w, e);
                }
            }
            Response::Opened(e) => {
                header(&mut w, 5);
                put_entry(&mut w, e);
            }
            Response::Id(id) => {
                header(&mut w, 6);
                w.u32(*id);
            }
            Response::Cq { id, capacity } => {
                header(&mut w, 7);
                w.u32(*id).u32(*capacity);
            }
            Response::Srq { id, capacity, slot_size } => {
                header(&mut w, 8);
                w.u32(*id).u32(*capacity).u32(*slot_size);
            }
            Response::Qp { qpn, sq_capacity, sq_slot, rq_capacity, rq_slot, rq_offset } => {
                header(&mut w, 9);
                w.u32(*qpn).u32(*sq_capacity).u32(*sq_slot).u32(*rq_capacity).u32(*rq_slot).u64(*rq_offset);
            }
            Response::QpInfo(q) => {
                header(&mut w, 10);
                put_qp_info(&mut w, q);
            }
            Response::Stats(list) => {
                header(&mut w, 11);
                w.u32(list.len() as u32);
                for d in list {
                    w.str(&d.name);
                    put_counters(&mut w, &d.counters);
                    w.u32(d.qps.len() as u32);
                    for (qpn, pid, c) in &d.qps {
                        w.u32(*qpn).u32(*pid);
                        put_counters(&mut w, c);
                    }
                }
            }
            Response::CmInfo { route, local, peer } => {
                header(&mut w, 40);
                match route {
                    Some(rt) => {
                        w.u8(1);
                        put_route(&mut w, rt);
                    }
                    None => {
                        w.u8(0);
                    }
                }
                put_opt_sa(&mut w, local);
                put_opt_sa(&mut w, peer);
            }
            Response::CmEvent { event, more } => {
                header(&mut w, 41);
                match event {
                    Some(e) => {
                        w.u8(1);
                        put_cm_event(&mut w, e);
                    }
                    None => {
                        w.u8(0);
                    }
                }
                w.bool(*more);
            }
            Response::CmQpAttr(a) => {
                header(&mut w, 42);
                put_qp_attr(&mut w, a);
            }
        }
        w.buf
    }

    /// Decode.
    pub fn decode(buf: &[u8]) -> DResult<Response> {
        let mut r = Reader::new(buf);
        let resp = match read_header(&mut r)? {
            1 => Response::Ok,
            2 => Response::Error(refusal_from(&mut r)?),
            3 => Response::Hello { daemon_pid: r.u32()? },
            4 => {
                let n = r.list_len()?;
                Response::Devices((0..n).map(|_| entry_from(&mut r)).collect::<DResult<_>>()?)
            }
            5 => Response::Opened(entry_from(&mut r)?),
            6 => Response::Id(r.u32()?),
            7 => Response::Cq { id: r.u32()?, capacity: r.u32()? },
            8 => Response::Srq { id: r.u32()?, capacity: r.u32()?, slot_size: r.u32()? },
            9 => Response::Qp {
                qpn: r.u32()?,
                sq_capacity: r.u32()?,
                sq_slot: r.u32()?,
                rq_capacity: r.u32()?,
                rq_slot: r.u32()?,
                rq_offset: r.u64()?,
            },
            10 => Response::QpInfo(qp_info_from(&mut r)?),
            11 => {
                let n = r.list_len()?;
                let mut list = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = r.str()?;
                    let counters = counters_from(&mut r)?;
                    let q = r.list_len()?;
                    let mut qps = Vec::with_capacity(q);
                    for _ in 0..q {
                        qps.push((r.u32()?, r.u32()?, counters_from(&mut r)?));
                    }
                    list.push(DeviceStats { name, counters, qps });
                }
                Response::Stats(list)
            }
            40 => Response::CmInfo {
                route: if r.bool()? { Some(route_from(&mut r)?) } else { None },
                local: opt_sa_from(&mut r)?,
                peer: opt_sa_from(&mut r)?,
            },
            41 => Response::CmEvent {
                event: if r.bool()? { Some(cm_event_from(&mut r)?) } else { None },
                more: r.bool()?,
            },
            42 => Response::CmQpAttr(qp_attr_from(&mut r)?),
            _ => return Err(DecodeError("unknown response")),
        };
        r.finish()?;
        Ok(resp)
    }
}

/// An asynchronous event as sent on the per-connection event socket: 8 bytes, kind then id.
pub fn encode_event(ev: &AsyncEvent) -> Option<[u8; 8]> {
    let (k, id): (u32, u32) = match *ev {
        AsyncEvent::CommEstablished(q) => (1, q.value()),
        AsyncEvent::SqDrained(q) => (2, q.value()),
        AsyncEvent::QpLastWqeReached(q) => (3, q.value()),
        AsyncEvent::QpRequestError(q) => (4, q.value()),
        AsyncEvent::QpAccessError(q) => (5, q.value()),
        AsyncEvent::QpFatal(q) => (6, q.value()),
        AsyncEvent::SrqLimitReached(s) => (7, s.0),
        AsyncEvent::CqError(c) => (8, c.0),
        AsyncEvent::PortActive(p) => (9, u32::from(p)),
        AsyncEvent::PortError(p) => (10, u32::from(p)),
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&k.to_le_bytes());
    b[4..].copy_from_slice(&id.to_le_bytes());
    Some(b)
}

/// Decode an event datagram.
pub fn decode_event(b: &[u8]) -> Option<AsyncEvent> {
    if b.len() != 8 {
        return None;
    }
    let k = u32::from_le_bytes(b[..4].try_into().ok()?);
    let id = u32::from_le_bytes(b[4..].try_into().ok()?);
    Some(match k {
        1 => AsyncEvent::CommEstablished(Qpn::new(id)),
        2 => AsyncEvent::SqDrained(Qpn::new(id)),
        3 => AsyncEvent::QpLastWqeReached(Qpn::new(id)),
        4 => AsyncEvent::QpRequestError(Qpn::new(id)),
        5 => AsyncEvent::QpAccessError(Qpn::new(id)),
        6 => AsyncEvent::QpFatal(Qpn::new(id)),
        7 => AsyncEvent::SrqLimitReached(SrqId(id)),
        8 => AsyncEvent::CqError(CqId(id)),
        9 => AsyncEvent::PortActive(id as u8),
        10 => AsyncEvent::PortError(id as u8),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_garbage_is_refused() {
        let av = AddressVector {
            dgid: [1; 16],
            sgid_index: 1,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 5,
            dlid: 0,
            sl: 0,
        };
        let reqs = vec![
            Request::Hello,
            Request::OpenDevice { name: "rxe0".into() },
            Request::RegMr { pd: 2, addr: 0x7fff_0000, len: 4096, access: 7 },
            Request::RegMrShared { pd: 3, addr: 0x7f12_3456_7000, len: 65_537, access: 0xf },
            Request::CreateCq { cqe: 16, channel: Some(3) },
            Request::AttachMcast { qpn: 0x12, mgid: [0xff, 1, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 1] },
            Request::DetachMcast { qpn: 0x13, mgid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3] },
            Request::CreateQp {
                pd: 2,
                qp_type: QpType::Ud,
                send_cq: 1,
                recv_cq: 2,
                srq: None,
                cap: QpCap { max_send_wr: 1, max_recv_wr: 2, max_send_sge: 3, max_recv_sge: 4, max_inline_data: 5 },
                sq_sig_all: true,
                copy_room: 256,
            },
            Request::ModifyQp {
                qpn: 0x11,
                attr: ModifyQp {
                    state: Some(QpState::Rtr),
                    av: Some(av),
                    path_mtu: Some(Mtu::M1024),
                    dest_qpn: Some(Qpn::new(0x12)),
                    rq_psn: Some(Psn::new(7)),
                    max_dest_rd_atomic: Some(16),
                    min_rnr_timer: Some(12),
                    timeout: Some(3),
                    ..Default::default()
                },
            },
            Request::LinkAdd { name: "rxe1".into(), netdev: "lo".into(), addr: Some("127.0.0.2".parse().unwrap()) },
            Request::Stats { device: None },
            Request::CmCreateId { channel: 3, ps: PortSpace::Udp },
            Request::CmResolveAddr { id: 9, src: None, dst: "127.0.0.1:7471".parse().unwrap() },
            Request::CmConnect {
                id: 9,
                param: ConnParam { private_data: b"hello".to_vec(), ..ConnParam::new(Qpn::new(0x11)) },
            },
            Request::CmReject { id: 4, private_data: b"no".to_vec() },
            Request::CmSetNoListenerRetries { retries: 3 },
            Request::CmEstablish { id: 5 },
            Request::CmInitQpAttr { id: 5, state: QpAttrState::Rtr },
            Request::CmAccept { id: 9, param: ConnParam { drive_qp: false, ..ConnParam::new(Qpn::new(0x11)) } },
        ];
        for q in reqs {
            let b = q.encode();
            assert_eq!(Request::decode(&b).unwrap(), q);
            for cut in 0..b.len() {
                assert!(Request::decode(&b[..cut]).is_err());
            }
        }
        assert!(Request::decode(b"garbage!garbage!").is_err());
        let e = Response::Error(Refusal::Verbs(VerbsError::MissingAttributes {
            from: QpState::Init,
            to: QpState::Rtr,
            mask: 0x80,
        }));
        assert_eq!(Response::decode(&e.encode()).unwrap(), e);
        let e = Response::Error(Refusal::Verbs(VerbsError::InvalidWorkRequest("more SGEs than max_sge")));
        assert_eq!(Response::decode(&e.encode()).unwrap(), e);
        let ev = Response::CmEvent {
            event: Some(CmEvent {
                id: IdHandle(7),
                kind: EventKind::ConnectRequest { listener: IdHandle(2) },
                conn: ConnInfo {
                    private_data: b"hi".to_vec(),
                    responder_resources: 1,
                    initiator_depth: 2,
                    remote_qpn: Qpn::new(0x12),
                    remote_addr: Some("127.0.0.1:5000".parse().unwrap()),
                    local_addr: None,
                },
                ud: Some(UdInfo { dgid: [3; 16], remote_qpn: Qpn::new(5), qkey: 9 }),
                status: -110,
            }),
            more: true,
        };
        assert_eq!(Response::decode(&ev.encode()).unwrap(), ev);
        for kind in
            [EventKind::AddrError { status: -101 }, EventKind::RouteError { status: -19 }, EventKind::ConnectResponse]
        {
            let ev = Response::CmEvent {
                event: Some(CmEvent { id: IdHandle(1), kind, conn: ConnInfo::default(), ud: None, status: -101 }),
                more: false,
            };
            assert_eq!(Response::decode(&ev.encode()).unwrap(), ev);
        }
        let mut a = QpAttr::new(QpAttrState::Rtr);
        a.av = Some(Route { sgid_index: 1, sgid: [1; 16], dgid: [2; 16], mtu: Mtu::M1024 });
        a.hop_limit = 64;
        a.flow_label = 0x12345;
        a.path_mtu = Some(Mtu::M1024);
        a.dest_qpn = Some(Qpn::new(0x33));
        a.rq_psn = Some(Psn::new(0xabcdef));
        a.max_dest_rd_atomic = Some(4);
        a.min_rnr_timer = Some(0);
        let qa = Response::CmQpAttr(a);
        assert_eq!(Response::decode(&qa.encode()).unwrap(), qa);
        let info = Response::CmInfo {
            route: Some(Route { sgid_index: 1, sgid: [1; 16], dgid: [2; 16], mtu: Mtu::M1024 }),
            local: Some("127.0.0.1:1".parse().unwrap()),
            peer: None,
        };
        assert_eq!(Response::decode(&info.encode()).unwrap(), info);
    }
}
