//! The CM agent: IDs and their states, the protocol's message handling, retransmission and time-wait.
//!
//! Connection states (active side): `RouteResolved` → connect → `ReqSent` → REP (QP to RTR and RTS,
//! RTU sent) → `Established` → disconnect → `DreqSent` → DREP → `TimeWait` → time-wait exit.
//! Passive side: `Listen` → REQ creates a new ID in `ReqRcvd` (CONNECT_REQUEST) → accept (QP to RTR
//! and RTS, REP sent) → `RepSent` → RTU → `Established`.
//!
//! A QP the application owns ([`ConnParam::drive_qp`] false) is never touched: the active side stops
//! in `RepRcvd` with CONNECT_RESPONSE until [`CmAgent::establish`] sends the RTU, and both sides
//! take the QP's attributes from [`CmAgent::init_qp_attr`], as the kernel's CM gives them. REQ, REP, DREQ and SIDR_REQ are
//! retransmitted every response timeout (4.096 µs × 2^timeout) up to the retry limit; a duplicate of a
//! message already answered gets the same answer again. UD IDs resolve with SIDR instead.

use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma_transport::Instant;
use softrdma_wire::cm::{
    reason, service_id, split_service_id, CmMessage, CmaHeader, DreqRepr, IdsRepr, PathRepr, RejRepr, RepRepr, ReqRepr,
    SidrRepRepr, SidrReqRepr,
};
use softrdma_wire::{Psn, Qpn};

use crate::types::{
    access, status, AgentConfig, CmError, CmEvent, ConnInfo, ConnParam, EventKind, IdHandle, Output, PortSpace, QpAttr,
    QpAttrState, QpCommand, Route, UdInfo, ACK_TIMEOUT, RDMA_UDP_QKEY,
};

/// How long a connection stays in time-wait: the kernel's CM waits `cm_convert_to_ms` of the
/// path's ACK timeout, 2^(19 − 8) ms.
const TIME_WAIT: Duration = Duration::from_millis(1 << (ACK_TIMEOUT - 8));

/// States of an ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    AddrResolved,
    RouteResolved,
    Listen,
    ReqSent,
    /// REP received for an application-owned QP: CONNECT_RESPONSE reported, RTU not sent yet.
    RepRcvd,
    ReqRcvd,
    RepSent,
    Established,
    DreqSent,
    TimeWait,
    SidrReqSent,
    SidrReqRcvd,
    /// Rejected, unreachable, timed out or time-wait over: only destroy remains.
    Done,
}

#[derive(Debug)]
struct Id {
    ps: PortSpace,
    state: State,
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    route: Option<Route>,
    param: Option<ConnParam>,
    local_comm_id: u32,
    remote_comm_id: u32,
    remote_guid: u64,
    remote_qpn: Qpn,
    remote_psn: Psn,
    local_psn: Psn,
    tid: u64,
    backlog: u32,
    listener: Option<IdHandle>,
    /// Last MAD sent that the peer must answer, for retransmission and duplicate handling.
    last: Option<(Box<[u8; 256]>, [u8; 16])>,
    retries_left: u8,
    deadline: Option<Instant>,
    /// Peer's REQ values needed at accept.
    req_info: Option<ReqInfo>,
    /// REJs "invalid service ID" still to be answered by sending the REQ again.
    no_listener_left: u8,
    /// The QP's negotiated values, as the kernel's CM keeps them: incoming reads/atomics
    /// (`max_dest_rd_atomic`), outgoing (`max_rd_atomic`), RNR and transport retries.
    resp_res: u8,
    init_depth: u8,
    rnr_retry: u8,
    retry_count: u8,
    /// Flow label of the path (the REQ's).
    flow_label: u32,
    /// The connection's QPs are UC (the kernel's `qp_type` of the ID): the REQ says so, and
    /// the QP attributes leave out what only RC takes.
    uc: bool,
}

#[derive(Debug, Clone, Copy)]
struct ReqInfo {
    rnr_retry: u8,
    retry_count: u8,
}

impl Id {
    fn new(ps: PortSpace) -> Id {
        Id {
            ps,
            state: State::Idle,
            local: None,
            remote: None,
            route: None,
            param: None,
            local_comm_id: 0,
            remote_comm_id: 0,
            remote_guid: 0,
            remote_qpn: Qpn::new(0),
            remote_psn: Psn::new(0),
            local_psn: Psn::new(0),
            tid: 0,
            backlog: 0,
            listener: None,
            last: None,
            retries_left: 0,
            deadline: None,
            req_info: None,
            no_listener_left: 0,
            resp_res: 0,
            init_depth: 0,
            rnr_retry: 0,
            retry_count: 0,
            flow_label: 0,
            uc: false,
        }
    }

    /// The QP the agent drives, if it drives one.
    fn driven_qpn(&self) -> Option<Qpn> {
        self.param.as_ref().filter(|p| p.drive_qp).map(|p| p.qpn)
    }
}

/// The connection manager of one device port.
pub struct CmAgent {
    config: AgentConfig,
    ids: BTreeMap<IdHandle, Id>,
    next_id: u32,
    rng: u64,
    out: VecDeque<Output>,
    events: VecDeque<CmEvent>,
    /// The port's link is up (see [`CmAgent::set_port_active`]).
    port_active: bool,
    /// MADs that did not parse or matched nothing.
    pub dropped: u64,
    /// The earliest deadline of the ids, once worked out ([`CmAgent::poll_timeout`]); every public
    /// `&mut self` call but `poll_output` and `poll_event` forgets it first (those that delegate,
    /// through the one they call). A busy-polling driver asks several times per poll, and a
    /// scan over a thousand ids each time would cost more than the poll.
    deadline_memo: Cell<Option<Option<Instant>>>,
}

fn mtu_code(m: softrdma_transport::Mtu) -> u8 {
    m as u8
}

fn mtu_from_code(c: u8, cap: softrdma_transport::Mtu) -> softrdma_transport::Mtu {
    softrdma_transport::Mtu::ALL.into_iter().find(|m| *m as u8 == c).unwrap_or(cap).min(cap)
}

fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

fn ip_of_gid(g: &[u8; 16]) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(*g);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

impl CmAgent {
    /// An agent with no IDs.
    pub fn new(config: AgentConfig) -> CmAgent {
        let rng = config.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        CmAgent {
            config,
            ids: BTreeMap::new(),
            next_id: 1,
            rng,
            out: VecDeque::new(),
            events: VecDeque::new(),
            port_active: true,
            dropped: 0,
            deadline_memo: Cell::new(None),
        }
    }

    fn random(&mut self) -> u32 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
    }

    fn response_timeout(&self) -> Duration {
        Duration::from_nanos(4096u64 << self.config.response_timeout.min(31))
    }

    fn id(&mut self, h: IdHandle) -> Result<&mut Id, CmError> {
        self.ids.get_mut(&h).ok_or(CmError::NoSuchId)
    }

    fn event(&mut self, id: IdHandle, kind: EventKind, conn: ConnInfo, ud: Option<UdInfo>) {
        let status = match kind {
            EventKind::AddrError { status } | EventKind::RouteError { status } => status,
            EventKind::Unreachable | EventKind::ConnectError => status::ETIMEDOUT,
            EventKind::Rejected { reason } => i32::from(reason),
            _ => 0,
        };
        self.events.push_back(CmEvent { id, kind, conn, ud, status });
    }

    /// Change [`AgentConfig::no_listener_retries`] for later connects.
    pub fn set_no_listener_retries(&mut self, retries: u8) {
        self.deadline_memo.set(None);
        self.config.no_listener_retries = retries;
    }

    /// The port's link went down (`false`) or up again: while it is down, address and route
    /// resolution fail (ADDR_ERROR, ROUTE_ERROR with [`status::ENETUNREACH`]).
    pub fn set_port_active(&mut self, up: bool) {
        self.deadline_memo.set(None);
        self.port_active = up;
    }

    /// The device's addresses changed (an address was removed from or added to its netdev, so its
    /// GID table changed): later resolutions use the new set; a route from an address that is gone
    /// fails with ROUTE_ERROR ([`status::ENODEV`]).
    pub fn set_addrs(&mut self, addrs: Vec<(IpAddr, u8)>) {
        self.deadline_memo.set(None);
        self.config.addrs = addrs;
    }

    /// The device's addresses with their GID indices.
    pub fn local_addrs(&self) -> &[(IpAddr, u8)] {
        &self.config.addrs
    }

    /// IDs alive (for leak checks).
    pub fn id_count(&self) -> usize {
        self.ids.len()
    }

    // ---- API -------------------------------------------------------------------------------------

    /// Create an ID (`rdma_create_id`).
    pub fn create_id(&mut self, ps: PortSpace) -> IdHandle {
        self.deadline_memo.set(None);
        let h = IdHandle(self.next_id);
        self.next_id += 1;
        self.ids.insert(h, Id::new(ps));
        h
    }

    /// Destroy an ID (`rdma_destroy_id`): a live connection is torn down with a DREQ first.
    pub fn destroy_id(&mut self, h: IdHandle, now: Instant) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.ids.get(&h).ok_or(CmError::NoSuchId)?;
        if matches!(id.state, State::Established | State::RepSent) {
            let _ = self.disconnect(h, now);
        } else if id.state == State::RepRcvd {
            // The application never established: refuse the REP (ib_cm's destroy in REP_RCVD).
            let (dgid, tid, local, remote) =
                (id.route.map_or([0; 16], |r| r.dgid), id.tid, id.local_comm_id, id.remote_comm_id);
            self.send_rej(dgid, tid, local, remote, reason::CONSUMER_REJECT);
        }
        self.release_backlog(h);
        self.ids.remove(&h);
        Ok(())
    }

    fn port_in_use(&self, ps: PortSpace, addr: SocketAddr) -> bool {
        self.ids.values().any(|i| {
            i.ps == ps
                && i.remote.is_none()
                && i.local.is_some_and(|l| {
                    l.port() == addr.port()
                        && (l.ip() == addr.ip() || l.ip().is_unspecified() || addr.ip().is_unspecified())
                })
        })
    }

    fn ephemeral_port(&mut self, ps: PortSpace, ip: IpAddr) -> u16 {
        loop {
            let p = 32768 + (self.random() % 28232) as u16;
            if !self.port_in_use(ps, SocketAddr::new(ip, p)) {
                return p;
            }
        }
    }

    /// Bind to a local address (`rdma_bind_addr`); port 0 picks one.
    pub fn bind(&mut self, h: IdHandle, mut addr: SocketAddr) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let ps = self.id(h)?.ps;
        if !addr.ip().is_unspecified() && !self.config.addrs.iter().any(|(a, _)| *a == addr.ip()) {
            return Err(CmError::AddrNotAvailable);
        }
        if addr.port() == 0 {
            addr.set_port(self.ephemeral_port(ps, addr.ip()));
        } else if self.port_in_use(ps, addr) {
            return Err(CmError::AddrInUse);
        }
        self.id(h)?.local = Some(addr);
        Ok(())
    }

    /// Resolve the destination (`rdma_resolve_addr`): picks the local address, raises ADDR_RESOLVED
    /// or ADDR_ERROR. No route check: see [`CmAgent::resolve_addr_via`].
    pub fn resolve_addr(&mut self, h: IdHandle, src: Option<IpAddr>, dst: SocketAddr) -> Result<(), CmError> {
        self.resolve_addr_via(h, src, dst, |_, _| Ok(()))
    }

    /// [`CmAgent::resolve_addr`] with the device's route lookup: `route(local, dst)` answers
    /// whether the host routes from `local` to `dst` (`Err` with a negative errno otherwise, e.g.
    /// [`status::ENETUNREACH`]; the driver asks its IP stack, the agent does no I/O).
    ///
    /// As the kernel: a source address that is not the device's, or of the other family than the
    /// destination, is refused at once; an unspecified destination is the source itself
    /// (loopback); no address of the destination's family, no route, or the port down give
    /// ADDR_ERROR with the status.
    pub fn resolve_addr_via(
        &mut self,
        h: IdHandle,
        src: Option<IpAddr>,
        mut dst: SocketAddr,
        route: impl FnOnce(IpAddr, SocketAddr) -> Result<(), i32>,
    ) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.id(h)?;
        if !matches!(id.state, State::Idle | State::AddrResolved) {
            return Err(CmError::InvalidState("resolve_addr"));
        }
        let ps = id.ps;
        let wanted = src.or(id.local.map(|l| l.ip())).filter(|ip| !ip.is_unspecified());
        if let Some(ip) = wanted {
            if ip.is_ipv4() != dst.is_ipv4() {
                return Err(CmError::FamilyMismatch);
            }
            if !self.config.addrs.iter().any(|(a, _)| *a == ip) {
                return Err(CmError::AddrNotAvailable);
            }
        }
        let local = wanted.or_else(|| {
            let same_family = self.config.addrs.iter().map(|(a, _)| *a).filter(|a| a.is_ipv4() == dst.is_ipv4());
            // A destination of the device's own is reached from that address.
            let mut all = same_family.clone();
            all.find(|a| *a == dst.ip()).or_else(|| same_family.clone().next())
        });
        let Some(local_ip) = local else {
            self.event(h, EventKind::AddrError { status: status::ENETUNREACH }, ConnInfo::default(), None);
            return Ok(());
        };
        if dst.ip().is_unspecified() {
            dst.set_ip(local_ip);
        }
        let verdict = if self.port_active { route(local_ip, dst) } else { Err(status::ENETUNREACH) };
        if let Err(st) = verdict {
            self.event(h, EventKind::AddrError { status: st }, ConnInfo::default(), None);
            return Ok(());
        }
        let port = match self.ids[&h].local {
            Some(l) if l.port() != 0 => l.port(),
            _ => self.ephemeral_port(ps, local_ip),
        };
        let id = self.id(h)?;
        id.local = Some(SocketAddr::new(local_ip, port));
        id.remote = Some(dst);
        id.state = State::AddrResolved;
        self.event(h, EventKind::AddrResolved, ConnInfo::default(), None);
        Ok(())
    }

    /// Resolve the route (`rdma_resolve_route`): ROUTE_RESOLVED or ROUTE_ERROR. No route check:
    /// see [`CmAgent::resolve_route_via`].
    pub fn resolve_route(&mut self, h: IdHandle) -> Result<(), CmError> {
        self.resolve_route_via(h, |_, _| Ok(()))
    }

    /// [`CmAgent::resolve_route`] with the device's route lookup (as for
    /// [`CmAgent::resolve_addr_via`]). ROUTE_ERROR, the ID staying address-resolved, when the port
    /// is down ([`status::ENETUNREACH`]), the source address is no longer the device's (its GID
    /// left the table: [`status::ENODEV`], as the kernel's port/GID validation reports), or the
    /// destination is no longer routed (the lookup's status).
    pub fn resolve_route_via(
        &mut self,
        h: IdHandle,
        route: impl FnOnce(IpAddr, SocketAddr) -> Result<(), i32>,
    ) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let mtu = self.config.mtu;
        let port_active = self.port_active;
        let addrs = self.config.addrs.clone();
        let id = self.id(h)?;
        if id.state != State::AddrResolved {
            return Err(CmError::InvalidState("resolve_route before resolve_addr"));
        }
        let (local, remote) = (id.local.expect("resolved"), id.remote.expect("resolved"));
        let verdict = if !port_active {
            Err(status::ENETUNREACH)
        } else if !addrs.iter().any(|(a, _)| *a == local.ip()) {
            Err(status::ENODEV)
        } else {
            route(local.ip(), remote)
        };
        if let Err(st) = verdict {
            self.event(h, EventKind::RouteError { status: st }, ConnInfo::default(), None);
            return Ok(());
        }
        let id = self.id(h)?;
        let sgid_index = addrs.iter().find(|(a, _)| *a == local.ip()).map_or(0, |(_, i)| *i);
        id.route = Some(Route { sgid_index, sgid: gid_of(local.ip()), dgid: gid_of(remote.ip()), mtu });
        id.state = State::RouteResolved;
        self.event(h, EventKind::RouteResolved, ConnInfo::default(), None);
        Ok(())
    }

    /// The route of a resolved or connected ID.
    pub fn route(&self, h: IdHandle) -> Option<Route> {
        self.ids.get(&h).and_then(|i| i.route)
    }

    /// Local and remote addresses of an ID.
    pub fn addrs(&self, h: IdHandle) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.ids.get(&h).map_or((None, None), |i| (i.local, i.remote))
    }

    /// Listen (`rdma_listen`); the ID must be bound.
    pub fn listen(&mut self, h: IdHandle, backlog: u32) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.id(h)?;
        if id.local.is_none() {
            return Err(CmError::InvalidState("listen on an unbound id"));
        }
        if !matches!(id.state, State::Idle | State::Listen) {
            return Err(CmError::InvalidState("listen"));
        }
        id.state = State::Listen;
        id.backlog = backlog.max(1);
        Ok(())
    }

    fn send(&mut self, dgid: [u8; 16], msg: &CmMessage, tid: u64) -> Box<[u8; 256]> {
        let mut mad = Box::new([0u8; 256]);
        // Our own messages always fit: private data lengths are checked at the API.
        msg.emit(tid, &mut mad[..]).expect("CM message fits a MAD");
        self.out.push_back(Output::Mad { dgid, mad: mad.clone() });
        mad
    }

    /// Send a message the peer must answer, and arm its retransmission.
    fn send_tracked(&mut self, h: IdHandle, dgid: [u8; 16], msg: &CmMessage, now: Instant) {
        let tid = self.ids[&h].tid;
        let mad = self.send(dgid, msg, tid);
        let deadline = now + self.response_timeout();
        let retries = self.config.max_retries;
        let id = self.ids.get_mut(&h).expect("caller checked");
        id.last = Some((mad, dgid));
        id.retries_left = retries;
        id.deadline = Some(deadline);
    }

    /// Whether the ID's connection is UC (the kernel's `qp_type` of the ID; the device tells it
    /// from the QP before [`CmAgent::connect`]): its REQ says UC, and [`CmAgent::init_qp_attr`]
    /// leaves out what only RC QPs take. A passive side learns it from the REQ.
    pub fn set_uc(&mut self, h: IdHandle, uc: bool) -> Result<(), CmError> {
        self.id(h)?.uc = uc;
        Ok(())
    }

    /// Connect (`rdma_connect`): REQ (RC/UC) or SIDR_REQ (UD).
    pub fn connect(&mut self, h: IdHandle, param: ConnParam, now: Instant) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let guid = self.config.ca_guid;
        let no_listener_retries = self.config.no_listener_retries;
        let comm_id = self.random();
        let psn = Psn::new(self.random());
        let tid = u64::from(self.random()) << 8 | 0x2;
        let id = self.id(h)?;
        if id.state != State::RouteResolved {
            return Err(CmError::InvalidState("connect before resolve_route"));
        }
        let (local, remote, route) =
            (id.local.expect("resolved"), id.remote.expect("resolved"), id.route.expect("resolved"));
        let mut pd = vec![0u8; CmaHeader::LEN];
        CmaHeader { src_port: local.port(), src: local.ip(), dst: remote.ip() }.emit(&mut pd).expect("36 bytes");
        pd.extend_from_slice(&param.private_data);
        let sid = service_id(id.ps.code(), remote.port());
        id.local_comm_id = comm_id;
        id.local_psn = psn;
        id.tid = tid;
        id.resp_res = param.responder_resources;
        id.init_depth = param.initiator_depth;
        id.retry_count = param.retry_count.min(7);
        id.rnr_retry = param.rnr_retry_count.min(7);
        id.flow_label = u32::from(local.port() ^ remote.port()) & 0xf_ffff;
        let flow_label = id.flow_label;
        let msg = if id.ps.is_ud() {
            if pd.len() > softrdma_wire::cm::private_len::SIDR_REQ {
                return Err(CmError::PrivateDataTooLong);
            }
            id.state = State::SidrReqSent;
            CmMessage::SidrReq(SidrReqRepr { request_id: comm_id, pkey: 0xffff, service_id: sid, private_data: pd })
        } else {
            if pd.len() > softrdma_wire::cm::private_len::REQ {
                return Err(CmError::PrivateDataTooLong);
            }
            id.state = State::ReqSent;
            let timeout = 20;
            CmMessage::Req(ReqRepr {
                local_comm_id: comm_id,
                service_id: sid,
                local_ca_guid: guid,
                local_qkey: 0,
                local_qpn: param.qpn,
                responder_resources: param.responder_resources,
                initiator_depth: param.initiator_depth,
                remote_cm_response_timeout: timeout,
                transport: u8::from(id.uc),
                e2e_flow_control: false,
                starting_psn: psn,
                local_cm_response_timeout: timeout,
                retry_count: param.retry_count.min(7),
                pkey: 0xffff,
                path_mtu: mtu_code(route.mtu),
                rnr_retry_count: param.rnr_retry_count.min(7),
                max_cm_retries: 15,
                srq: param.srq,
                primary: PathRepr {
                    local_lid: 0xffff,
                    remote_lid: 0xffff,
                    local_gid: route.sgid,
                    remote_gid: route.dgid,
                    flow_label,
                    packet_rate: 2,
                    hop_limit: 64,
                    local_ack_timeout: ACK_TIMEOUT,
                    ..PathRepr::default()
                },
                alternate: PathRepr::default(),
                private_data: pd,
            })
        };
        id.param = Some(param);
        id.no_listener_left = no_listener_retries;
        self.send_tracked(h, route.dgid, &msg, now);
        Ok(())
    }

    /// Accept a connection request (`rdma_accept`): the QP goes to RTR and RTS, then REP (or
    /// SIDR_REP for UD).
    pub fn accept(&mut self, h: IdHandle, param: ConnParam, now: Instant) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let guid = self.config.ca_guid;
        let id = self.id(h)?;
        let route = id.route.ok_or(CmError::InvalidState("accept"))?;
        let psn = id.local_psn;
        match id.state {
            State::SidrReqRcvd => {
                let msg = CmMessage::SidrRep(SidrRepRepr {
                    request_id: id.remote_comm_id,
                    status: 0,
                    qpn: param.qpn,
                    service_id: service_id(id.ps.code(), id.local.map_or(0, |l| l.port())),
                    qkey: param.qkey,
                    private_data: param.private_data.clone(),
                });
                if param.private_data.len() > softrdma_wire::cm::private_len::SIDR_REP {
                    return Err(CmError::PrivateDataTooLong);
                }
                id.state = State::Established;
                let tid = id.tid;
                let mad = self.send(route.dgid, &msg, tid);
                self.ids.get_mut(&h).expect("checked").last = Some((mad, route.dgid));
                self.release_backlog(h);
                Ok(())
            }
            State::ReqRcvd => {
                if param.private_data.len() > softrdma_wire::cm::private_len::REP {
                    return Err(CmError::PrivateDataTooLong);
                }
                let info = id.req_info.expect("set with ReqRcvd");
                id.local_comm_id = id.local_comm_id.max(1);
                id.resp_res = param.responder_resources;
                id.init_depth = param.initiator_depth;
                let rtr = QpCommand::Rtr {
                    qpn: param.qpn,
                    dest_qpn: id.remote_qpn,
                    rq_psn: id.remote_psn,
                    route,
                    max_dest_rd_atomic: param.responder_resources,
                    min_rnr_timer: 12,
                };
                let rts = QpCommand::Rts {
                    qpn: param.qpn,
                    sq_psn: psn,
                    timeout: 14,
                    retry_cnt: info.retry_count,
                    rnr_retry: info.rnr_retry,
                    max_rd_atomic: param.initiator_depth,
                };
                let msg = CmMessage::Rep(RepRepr {
                    local_comm_id: id.local_comm_id,
                    remote_comm_id: id.remote_comm_id,
                    local_qkey: 0,
                    local_qpn: param.qpn,
                    starting_psn: psn,
                    responder_resources: param.responder_resources,
                    initiator_depth: param.initiator_depth,
                    target_ack_delay: 15,
                    failover_accepted: 0,
                    e2e_flow_control: false,
                    rnr_retry_count: param.rnr_retry_count.min(7),
                    srq: param.srq,
                    local_ca_guid: guid,
                    private_data: param.private_data.clone(),
                });
                id.state = State::RepSent;
                let drive = param.drive_qp;
                id.param = Some(param);
                if drive {
                    self.out.push_back(Output::Qp(rtr));
                    self.out.push_back(Output::Qp(rts));
                }
                self.send_tracked(h, route.dgid, &msg, now);
                self.release_backlog(h);
                Ok(())
            }
            _ => Err(CmError::InvalidState("accept without a connection request")),
        }
    }

    /// Reject a connection request (`rdma_reject`): REJ with reason "consumer reject" (SIDR_REP with
    /// status "rejected" for UD).
    pub fn reject(&mut self, h: IdHandle, private_data: &[u8]) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.id(h)?;
        let route = id.route.ok_or(CmError::InvalidState("reject"))?;
        let msg = match id.state {
            State::ReqRcvd => {
                if private_data.len() > softrdma_wire::cm::private_len::REJ {
                    return Err(CmError::PrivateDataTooLong);
                }
                CmMessage::Rej(RejRepr {
                    local_comm_id: id.local_comm_id,
                    remote_comm_id: id.remote_comm_id,
                    msg_rejected: 0,
                    reason: reason::CONSUMER_REJECT,
                    ari: Vec::new(),
                    private_data: private_data.to_vec(),
                })
            }
            State::SidrReqRcvd => CmMessage::SidrRep(SidrRepRepr {
                request_id: id.remote_comm_id,
                status: 2,
                private_data: private_data.to_vec(),
                ..SidrRepRepr::default()
            }),
            _ => return Err(CmError::InvalidState("reject without a connection request")),
        };
        id.state = State::Done;
        let tid = id.tid;
        self.send(route.dgid, &msg, tid);
        self.release_backlog(h);
        Ok(())
    }

    fn release_backlog(&mut self, h: IdHandle) {
        if let Some(l) = self.ids.get(&h).and_then(|i| i.listener) {
            if let Some(li) = self.ids.get_mut(&l) {
                li.backlog += 1;
            }
            if let Some(i) = self.ids.get_mut(&h) {
                i.listener = None;
            }
        }
    }

    /// Disconnect (`rdma_disconnect`): the QP goes to ERR and a DREQ is sent.
    pub fn disconnect(&mut self, h: IdHandle, now: Instant) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.id(h)?;
        if !matches!(id.state, State::Established | State::RepSent) {
            return Err(CmError::InvalidState("disconnect without a connection"));
        }
        let route = id.route.expect("connected");
        if id.ps.is_ud() {
            id.state = State::Done;
            return Ok(());
        }
        let qpn = id.driven_qpn();
        let msg = CmMessage::Dreq(DreqRepr {
            local_comm_id: id.local_comm_id,
            remote_comm_id: id.remote_comm_id,
            remote_qpn: id.remote_qpn,
            private_data: Vec::new(),
        });
        id.state = State::DreqSent;
        if let Some(qpn) = qpn {
            self.out.push_back(Output::Qp(QpCommand::Err { qpn }));
        }
        self.send_tracked(h, route.dgid, &msg, now);
        Ok(())
    }

    // ---- inputs ----------------------------------------------------------------------------------

    /// A MAD received on QP1 from `src_gid`.
    pub fn handle_mad(&mut self, now: Instant, src_gid: [u8; 16], mad: &[u8]) {
        self.deadline_memo.set(None);
        let Ok((h, msg)) = CmMessage::parse(mad) else {
            self.dropped += 1;
            return;
        };
        let tid = h.transaction_id;
        match msg {
            CmMessage::Req(r) => self.on_req(src_gid, tid, r),
            CmMessage::Rep(r) => self.on_rep(r),
            CmMessage::Rtu(r) => self.on_rtu(r),
            CmMessage::Rej(r) => self.on_rej(now, r),
            CmMessage::Mra(r) => self.on_mra(now, r.remote_comm_id, r.service_timeout),
            CmMessage::Dreq(r) => self.on_dreq(now, src_gid, tid, r),
            CmMessage::Drep(r) => self.on_drep(now, r),
            CmMessage::SidrReq(r) => self.on_sidr_req(src_gid, tid, r),
            CmMessage::SidrRep(r) => self.on_sidr_rep(r),
            _ => self.dropped += 1,
        }
    }

    fn find(&self, f: impl Fn(&Id) -> bool) -> Option<IdHandle> {
        self.ids.iter().find(|(_, i)| f(i)).map(|(h, _)| *h)
    }

    fn find_listener(&self, ps: u16, port: u16, dst: Option<IpAddr>) -> Option<IdHandle> {
        self.find(|i| {
            i.state == State::Listen
                && i.ps.code() == ps
                && i.local.is_some_and(|l| l.port() == port && (l.ip().is_unspecified() || Some(l.ip()) == dst))
        })
    }

    fn resend_last(&mut self, h: IdHandle) {
        if let Some((mad, dgid)) = self.ids.get(&h).and_then(|i| i.last.clone()) {
            self.out.push_back(Output::Mad { dgid, mad });
        }
    }

    fn on_req(&mut self, src_gid: [u8; 16], tid: u64, r: ReqRepr) {
        // A retransmitted REQ for a connection we already know.
        let known = |i: &Id| {
            i.remote_comm_id == r.local_comm_id && i.remote_guid == r.local_ca_guid && i.state != State::Listen
        };
        if let Some(h) = self.find(known) {
            match self.ids[&h].state {
                State::RepSent | State::Established => self.resend_last(h),
                State::TimeWait => self.send_rej(src_gid, tid, 0, r.local_comm_id, reason::STALE_CONN),
                _ => {}
            }
            return;
        }
        let Some((ps, port)) = split_service_id(r.service_id) else {
            return self.send_rej(src_gid, tid, 0, r.local_comm_id, reason::INVALID_SERVICE_ID);
        };
        let cma = CmaHeader::parse(&r.private_data).ok();
        let Some(l) = self.find_listener(ps, port, cma.map(|c| c.dst)) else {
            return self.send_rej(src_gid, tid, 0, r.local_comm_id, reason::INVALID_SERVICE_ID);
        };
        // The same remote QP still connected under another communication ID: stale.
        if self
            .find(|i| i.remote_guid == r.local_ca_guid && i.remote_qpn == r.local_qpn && i.state == State::Established)
            .is_some()
        {
            return self.send_rej(src_gid, tid, 0, r.local_comm_id, reason::STALE_CONN);
        }
        if self.ids[&l].backlog == 0 {
            return self.send_rej(src_gid, tid, 0, r.local_comm_id, reason::NO_RESOURCES);
        }
        let local_comm_id = self.random().max(1);
        // Our starting PSN is chosen now: an application that owns its QP moves it to RTS
        // (`init_qp_attr`) before it accepts.
        let local_psn = Psn::new(self.random());
        let listener = &self.ids[&l];
        let (lps, lport) = (listener.ps, listener.local.map_or(port, |a| a.port()));
        let local_ip =
            cma.map(|c| c.dst).or_else(|| listener.local.map(|a| a.ip())).unwrap_or(ip_of_gid(&r.primary.remote_gid));
        let remote_addr = cma.map(|c| SocketAddr::new(c.src, c.src_port));
        let sgid_index = self.config.addrs.iter().find(|(a, _)| *a == local_ip).map_or(0, |(_, i)| *i);
        let mtu = mtu_from_code(r.path_mtu, self.config.mtu);
        let route = Route { sgid_index, sgid: gid_of(local_ip), dgid: src_gid, mtu };
        let h = self.create_id(lps);
        let id = self.ids.get_mut(&h).expect("just created");
        id.state = State::ReqRcvd;
        id.local_psn = local_psn;
        // The kernel's CM, from the REQ: the peer's initiator depth is our responder resources
        // and the other way round, until accept says otherwise.
        id.resp_res = r.initiator_depth;
        id.init_depth = r.responder_resources;
        id.rnr_retry = r.rnr_retry_count;
        id.retry_count = r.retry_count;
        id.flow_label = r.primary.flow_label;
        id.uc = r.transport == 1;
        id.local = Some(SocketAddr::new(local_ip, lport));
        id.remote = remote_addr;
        id.route = Some(route);
        id.local_comm_id = local_comm_id;
        id.remote_comm_id = r.local_comm_id;
        id.remote_guid = r.local_ca_guid;
        id.remote_qpn = r.local_qpn;
        id.remote_psn = r.starting_psn;
        id.tid = tid;
        id.listener = Some(l);
        id.req_info = Some(ReqInfo { rnr_retry: r.rnr_retry_count, retry_count: r.retry_count });
        if let Some(li) = self.ids.get_mut(&l) {
            li.backlog -= 1;
        }
        let private = if cma.is_some() { r.private_data[CmaHeader::LEN..].to_vec() } else { r.private_data.clone() };
        let conn = ConnInfo {
            private_data: private,
            responder_resources: r.responder_resources,
            initiator_depth: r.initiator_depth,
            remote_qpn: r.local_qpn,
            remote_addr,
            local_addr: Some(SocketAddr::new(local_ip, lport)),
        };
        self.event(h, EventKind::ConnectRequest { listener: l }, conn, None);
    }

    fn send_rej(&mut self, dgid: [u8; 16], tid: u64, local: u32, remote: u32, why: u16) {
        let msg = CmMessage::Rej(RejRepr {
            local_comm_id: local,
            remote_comm_id: remote,
            msg_rejected: 0,
            reason: why,
            ari: Vec::new(),
            private_data: Vec::new(),
        });
        self.send(dgid, &msg, tid);
    }

    fn on_rep(&mut self, r: RepRepr) {
        let Some(h) = self.find(|i| i.local_comm_id == r.remote_comm_id && i.state != State::Listen) else {
            self.dropped += 1;
            return;
        };
        match self.ids[&h].state {
            State::ReqSent => {}
            // Our RTU was lost: answer the repeated REP again.
            State::Established => return self.resend_last(h),
            // The application has not established yet: it has the first REP already.
            State::RepRcvd => return,
            _ => {
                self.dropped += 1;
                return;
            }
        }
        let id = self.ids.get_mut(&h).expect("found");
        id.remote_comm_id = r.local_comm_id;
        id.remote_guid = r.local_ca_guid;
        id.remote_qpn = r.local_qpn;
        id.remote_psn = r.starting_psn;
        id.deadline = None;
        // The kernel's CM, from the REP: the peer's initiator depth is our responder resources.
        id.resp_res = r.initiator_depth;
        id.init_depth = r.responder_resources;
        id.rnr_retry = r.rnr_retry_count;
        let route = id.route.expect("connected");
        let param = id.param.clone().expect("connect stored it");
        let local_psn = id.local_psn;
        let conn = ConnInfo {
            private_data: r.private_data.clone(),
            responder_resources: r.responder_resources,
            initiator_depth: r.initiator_depth,
            remote_qpn: r.local_qpn,
            remote_addr: id.remote,
            local_addr: id.local,
        };
        if !param.drive_qp {
            id.state = State::RepRcvd;
            self.event(h, EventKind::ConnectResponse, conn, None);
            return;
        }
        id.state = State::Established;
        self.out.push_back(Output::Qp(QpCommand::Rtr {
            qpn: param.qpn,
            dest_qpn: r.local_qpn,
            rq_psn: r.starting_psn,
            route,
            max_dest_rd_atomic: param.responder_resources,
            min_rnr_timer: 12,
        }));
        self.out.push_back(Output::Qp(QpCommand::Rts {
            qpn: param.qpn,
            sq_psn: local_psn,
            timeout: 14,
            retry_cnt: param.retry_count,
            rnr_retry: r.rnr_retry_count,
            max_rd_atomic: param.initiator_depth,
        }));
        let rtu = CmMessage::Rtu(IdsRepr {
            local_comm_id: r.remote_comm_id,
            remote_comm_id: r.local_comm_id,
            private_data: Vec::new(),
        });
        let tid = self.ids[&h].tid;
        let mad = self.send(route.dgid, &rtu, tid);
        self.ids.get_mut(&h).expect("found").last = Some((mad, route.dgid));
        self.event(h, EventKind::Established, conn, None);
    }

    /// Finish a connection whose QP the application owns (`rdma_establish`), after
    /// CONNECT_RESPONSE: the RTU goes out and the connection is established. As with the kernel,
    /// no event follows on this side (the peer gets ESTABLISHED).
    pub fn establish(&mut self, h: IdHandle) -> Result<(), CmError> {
        self.deadline_memo.set(None);
        let id = self.id(h)?;
        if id.state != State::RepRcvd {
            return Err(CmError::InvalidState("establish without a connect response"));
        }
        let route = id.route.expect("connected");
        let rtu = CmMessage::Rtu(IdsRepr {
            local_comm_id: id.local_comm_id,
            remote_comm_id: id.remote_comm_id,
            private_data: Vec::new(),
        });
        id.state = State::Established;
        let tid = id.tid;
        let mad = self.send(route.dgid, &rtu, tid);
        self.ids.get_mut(&h).expect("checked").last = Some((mad, route.dgid));
        Ok(())
    }

    /// The attributes that move a QP of this ID to `state` (`rdma_init_qp_attr`), as the kernel's
    /// CM gives them: INIT any time the ID has a device (remote access once a connection exists,
    /// none before; UD: the Q_Key); RTR and RTS once a connection request or response is known
    /// (the peer's QPN and PSN, the negotiated reads/atomics and retries, the path).
    pub fn init_qp_attr(&self, h: IdHandle, state: QpAttrState) -> Result<QpAttr, CmError> {
        let id = self.ids.get(&h).ok_or(CmError::NoSuchId)?;
        let mut a = QpAttr::new(state);
        if id.ps.is_ud() {
            // UD: the same INIT attributes whatever the state (the kernel's cma_ib_init_qp_attr).
            a.pkey_index = Some(0);
            a.port = Some(1);
            a.qkey = Some(id.param.as_ref().map_or(RDMA_UDP_QKEY, |p| p.qkey));
            return Ok(a);
        }
        let connection =
            matches!(id.state, State::ReqSent | State::ReqRcvd | State::RepRcvd | State::RepSent | State::Established);
        let known = matches!(id.state, State::ReqRcvd | State::RepRcvd | State::RepSent | State::Established);
        match state {
            QpAttrState::Init => {
                a.pkey_index = Some(0);
                a.port = Some(1);
                a.access = Some(match (connection, id.resp_res) {
                    (false, _) => 0,
                    (true, 0) => access::REMOTE_WRITE,
                    (true, _) => access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
                });
            }
            QpAttrState::Rtr => {
                if !known {
                    return Err(CmError::InvalidState("init_qp_attr(RTR) before the peer answered"));
                }
                let route = id.route.expect("connected");
                a.av = Some(route);
                a.hop_limit = 64;
                a.flow_label = id.flow_label;
                a.path_mtu = Some(route.mtu);
                a.dest_qpn = Some(id.remote_qpn);
                a.rq_psn = Some(id.remote_psn);
                if !id.uc {
                    a.max_dest_rd_atomic = Some(id.resp_res);
                    a.min_rnr_timer = Some(0);
                }
            }
            QpAttrState::Rts => {
                if !known {
                    return Err(CmError::InvalidState("init_qp_attr(RTS) before the peer answered"));
                }
                a.sq_psn = Some(id.local_psn);
                if !id.uc {
                    a.timeout = Some(ACK_TIMEOUT);
                    a.retry_cnt = Some(id.retry_count);
                    a.rnr_retry = Some(id.rnr_retry);
                    a.max_rd_atomic = Some(id.init_depth);
                }
            }
        }
        Ok(a)
    }

    fn on_rtu(&mut self, r: IdsRepr) {
        let Some(h) = self.find(|i| i.local_comm_id == r.remote_comm_id && i.state == State::RepSent) else {
            self.dropped += 1;
            return;
        };
        let id = self.ids.get_mut(&h).expect("found");
        id.state = State::Established;
        id.deadline = None;
        let conn =
            ConnInfo { remote_qpn: id.remote_qpn, remote_addr: id.remote, local_addr: id.local, ..ConnInfo::default() };
        self.event(h, EventKind::Established, conn, None);
    }

    fn on_rej(&mut self, now: Instant, r: RejRepr) {
        let Some(h) = self.find(|i| {
            i.local_comm_id == r.remote_comm_id && matches!(i.state, State::ReqSent | State::RepSent | State::RepRcvd)
        }) else {
            self.dropped += 1;
            return;
        };
        let id = self.ids.get_mut(&h).expect("found");
        if id.state == State::ReqSent && r.reason == reason::INVALID_SERVICE_ID && id.no_listener_left > 0 {
            // Nobody listens yet: the retransmission timer sends the same REQ again (the peer
            // kept no state for it).
            id.no_listener_left -= 1;
            id.retries_left = id.retries_left.max(1);
            id.deadline = Some(now + crate::types::NO_LISTENER_RETRY_DELAY);
            return;
        }
        let qpn = id.driven_qpn();
        let was_rep_sent = id.state == State::RepSent;
        id.state = State::Done;
        id.deadline = None;
        if let (true, Some(qpn)) = (was_rep_sent, qpn) {
            self.out.push_back(Output::Qp(QpCommand::Err { qpn }));
        }
        let conn = ConnInfo { private_data: r.private_data, ..ConnInfo::default() };
        self.event(h, EventKind::Rejected { reason: r.reason }, conn, None);
    }

    fn on_mra(&mut self, now: Instant, comm_id: u32, service_timeout: u8) {
        let extra = Duration::from_nanos(4096u64 << service_timeout.min(31));
        let base = self.response_timeout();
        if let Some(h) = self.find(|i| i.local_comm_id == comm_id && matches!(i.state, State::ReqSent | State::RepSent))
        {
            let id = self.ids.get_mut(&h).expect("found");
            id.deadline = Some(now + base + extra);
        }
    }

    fn on_dreq(&mut self, now: Instant, src_gid: [u8; 16], tid: u64, r: DreqRepr) {
        let h = self.find(|i| i.local_comm_id == r.remote_comm_id && i.state != State::Listen);
        let drep = CmMessage::Drep(IdsRepr {
            local_comm_id: r.remote_comm_id,
            remote_comm_id: r.local_comm_id,
            private_data: Vec::new(),
        });
        let Some(h) = h else {
            // Unknown connection: answer so the peer can finish (IBA 12.9.8.3).
            self.send(src_gid, &drep, tid);
            return;
        };
        let state = self.ids[&h].state;
        let mad = self.send(src_gid, &drep, tid);
        if !matches!(state, State::Established | State::RepSent | State::DreqSent) {
            return;
        }
        let timewait = now + TIME_WAIT;
        let id = self.ids.get_mut(&h).expect("found");
        let qpn = id.driven_qpn();
        id.state = State::TimeWait;
        id.last = Some((mad, src_gid));
        id.deadline = Some(timewait);
        let conn = ConnInfo { remote_qpn: id.remote_qpn, ..ConnInfo::default() };
        if let (Some(qpn), false) = (qpn, state == State::DreqSent) {
            self.out.push_back(Output::Qp(QpCommand::Err { qpn }));
        }
        self.event(h, EventKind::Disconnected, conn, None);
    }

    fn on_drep(&mut self, now: Instant, r: IdsRepr) {
        let Some(h) = self.find(|i| i.local_comm_id == r.remote_comm_id && i.state == State::DreqSent) else {
            self.dropped += 1;
            return;
        };
        let timewait = now + TIME_WAIT;
        let id = self.ids.get_mut(&h).expect("found");
        id.state = State::TimeWait;
        id.deadline = Some(timewait);
        id.last = None;
        let conn = ConnInfo { remote_qpn: id.remote_qpn, ..ConnInfo::default() };
        self.event(h, EventKind::Disconnected, conn, None);
    }

    fn on_sidr_req(&mut self, src_gid: [u8; 16], tid: u64, r: SidrReqRepr) {
        let known = |i: &Id| {
            i.ps.is_ud()
                && i.remote_comm_id == r.request_id
                && i.route.is_some_and(|rt| rt.dgid == src_gid)
                && matches!(i.state, State::SidrReqRcvd | State::Established)
        };
        if let Some(h) = self.find(known) {
            if self.ids[&h].state == State::Established {
                self.resend_last(h);
            }
            return;
        }
        let refuse = |this: &mut CmAgent, status: u8| {
            let msg = CmMessage::SidrRep(SidrRepRepr {
                request_id: r.request_id,
                status,
                service_id: r.service_id,
                ..SidrRepRepr::default()
            });
            this.send(src_gid, &msg, tid);
        };
        let Some((ps, port)) = split_service_id(r.service_id) else {
            return refuse(self, 1);
        };
        let cma = CmaHeader::parse(&r.private_data).ok();
        let Some(l) = self.find_listener(ps, port, cma.map(|c| c.dst)) else {
            return refuse(self, 1);
        };
        if self.ids[&l].backlog == 0 {
            return refuse(self, 2);
        }
        let listener = &self.ids[&l];
        let (lps, lport) = (listener.ps, listener.local.map_or(port, |a| a.port()));
        let local_ip = cma.map(|c| c.dst).or_else(|| listener.local.map(|a| a.ip())).unwrap_or(ip_of_gid(&src_gid));
        let remote_addr = cma.map(|c| SocketAddr::new(c.src, c.src_port));
        let sgid_index = self.config.addrs.iter().find(|(a, _)| *a == local_ip).map_or(0, |(_, i)| *i);
        let route = Route { sgid_index, sgid: gid_of(local_ip), dgid: src_gid, mtu: self.config.mtu };
        let h = self.create_id(lps);
        let id = self.ids.get_mut(&h).expect("just created");
        id.state = State::SidrReqRcvd;
        id.local = Some(SocketAddr::new(local_ip, lport));
        id.remote = remote_addr;
        id.route = Some(route);
        id.remote_comm_id = r.request_id;
        id.tid = tid;
        id.listener = Some(l);
        if let Some(li) = self.ids.get_mut(&l) {
            li.backlog -= 1;
        }
        let private = if cma.is_some() { r.private_data[CmaHeader::LEN..].to_vec() } else { r.private_data.clone() };
        let conn = ConnInfo {
            private_data: private,
            remote_addr,
            local_addr: Some(SocketAddr::new(local_ip, lport)),
            ..ConnInfo::default()
        };
        self.event(h, EventKind::ConnectRequest { listener: l }, conn, None);
    }

    fn on_sidr_rep(&mut self, r: SidrRepRepr) {
        let Some(h) = self.find(|i| i.local_comm_id == r.request_id && i.state == State::SidrReqSent) else {
            self.dropped += 1;
            return;
        };
        let id = self.ids.get_mut(&h).expect("found");
        id.deadline = None;
        let route = id.route.expect("resolved");
        let conn = ConnInfo {
            private_data: r.private_data,
            remote_qpn: r.qpn,
            remote_addr: id.remote,
            local_addr: id.local,
            ..ConnInfo::default()
        };
        if r.status == 0 {
            id.state = State::Established;
            id.remote_qpn = r.qpn;
            let ud = UdInfo { dgid: route.dgid, remote_qpn: r.qpn, qkey: r.qkey };
            self.event(h, EventKind::Established, conn, Some(ud));
        } else {
            id.state = State::Done;
            self.event(h, EventKind::Rejected { reason: u16::from(r.status) }, conn, None);
        }
    }

    /// Fire expired timers: retransmit, give up, or end time-wait.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.deadline_memo.set(None);
        let due: Vec<IdHandle> =
            self.ids.iter().filter(|(_, i)| i.deadline.is_some_and(|d| d <= now)).map(|(h, _)| *h).collect();
        let timeout = self.response_timeout();
        for h in due {
            let id = self.ids.get_mut(&h).expect("listed");
            id.deadline = None;
            if id.state == State::TimeWait {
                id.state = State::Done;
                self.event(h, EventKind::TimewaitExit, ConnInfo::default(), None);
                continue;
            }
            if id.retries_left > 0 {
                id.retries_left -= 1;
                id.deadline = Some(now + timeout);
                self.resend_last(h);
                continue;
            }
            let state = id.state;
            let qpn = id.driven_qpn();
            id.state = State::Done;
            match state {
                State::ReqSent | State::SidrReqSent => self.event(h, EventKind::Unreachable, ConnInfo::default(), None),
                State::RepSent => {
                    if let Some(qpn) = qpn {
                        self.out.push_back(Output::Qp(QpCommand::Err { qpn }));
                    }
                    // The kernel's CM reports a REP never answered (IB_CM_REP_ERROR) as
                    // UNREACHABLE, as it does an unanswered REQ.
                    self.event(h, EventKind::Unreachable, ConnInfo::default(), None);
                }
                State::DreqSent => {
                    let id = self.ids.get_mut(&h).expect("listed");
                    id.state = State::TimeWait;
                    id.deadline = Some(now + TIME_WAIT);
                    // The DREQ was never answered (IB_CM_DREQ_ERROR): DISCONNECTED, -ETIMEDOUT.
                    let conn = ConnInfo::default();
                    self.events.push_back(CmEvent {
                        id: h,
                        kind: EventKind::Disconnected,
                        conn,
                        ud: None,
                        status: status::ETIMEDOUT,
                    });
                }
                _ => {}
            }
        }
    }

    /// The earliest deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let scan = || self.ids.values().filter_map(|i| i.deadline).min();
        if let Some(d) = self.deadline_memo.get() {
            // Every test run that uses the CM checks that no change went unnoticed.
            debug_assert_eq!(d, scan(), "a CM call changed a deadline without forgetting the memo");
            return d;
        }
        let d = scan();
        self.deadline_memo.set(Some(d));
        d
    }

    /// Whether [`CmAgent::poll_output`] or [`CmAgent::poll_event`] has something: a driver skips
    /// draining an agent with nothing to say.
    pub fn has_output(&self) -> bool {
        !self.out.is_empty() || !self.events.is_empty()
    }

    /// The next output: a QP change to make, or a MAD to send.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }
}
