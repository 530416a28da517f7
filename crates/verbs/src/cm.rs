//! RDMA CM on an embedded device: the [`CmAgent`] of the device runs inside its runtime, receiving
//! MADs for QP1 and sending its own as UD packets from QP1; the application uses [`CmId`]s and a
//! [`CmEventChannel`], as with librdmacm.
//!
//! Connection setup drives the application's QP: accept and the REP's arrival move it to RTR and
//! RTS, disconnect to ERR. The QP must be in INIT (see [`crate::QueuePair::init`]) before connect or
//! accept, as `rdma_create_qp` leaves it.
//!
//! Or the application moves its QP itself, as with a QP made by `ibv_create_qp` under the kernel's
//! rdma_cm: connect and accept with [`ConnParam::drive_qp`] false; [`CmId::init_qp_attr`] gives the
//! attributes of each transition (the passive side moves its QP to RTR and RTS before accepting),
//! the active side gets CONNECT_RESPONSE instead of ESTABLISHED and calls [`CmId::establish`]
//! once its QP is in RTS.
//!
//! Address and route resolution ask the host's routing (a UDP socket bound to the source address
//! and connected to the destination: nothing is sent) as the kernel's rdma_cm does, so an
//! unroutable destination gives ADDR_ERROR or ROUTE_ERROR with the errno of that lookup; the agent
//! also follows the device's link and addresses (ROUTE_ERROR when the port is down or the source
//! GID is gone).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use softrdma_cm::{
    CmAgent, CmError, ConnInfo, ConnParam, EventKind, IdHandle, Output, PortSpace, QpAttr, QpAttrState, QpCommand,
    Route, UdInfo,
};
use softrdma_transport::{Access, AddressVector, Hca, Instant, MemoryAccess, ModifyQp, QpState};
use softrdma_wire::mad::{GSI_QKEY, MAD_LEN};
use softrdma_wire::opcode::base;
use softrdma_wire::{BthRepr, DethRepr, IbPacket, IbRepr, Opcode, Psn, QpType, Qpn};

use softrdma_abi::msg::{Request, Response};

use crate::daemon::client;
use crate::error::{Error, Result};
use crate::runtime::DeviceHandle;

/// An event of a [`CmEventChannel`].
pub struct CmEvent {
    /// The ID it concerns (for CONNECT_REQUEST: the new connection's ID is in `new_id`).
    pub id: u32,
    /// What happened.
    pub kind: EventKind,
    /// The peer's parameters and private data.
    pub conn: ConnInfo,
    /// The resolved UD peer (SIDR).
    pub ud: Option<UdInfo>,
    /// The kernel's `rdma_cm_event.status` (see [`softrdma_cm::CmEvent::status`]).
    pub status: i32,
    /// For CONNECT_REQUEST: the ID of the new connection, to accept or reject.
    pub new_id: Option<CmId>,
}

impl std::fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmEvent")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("status", &self.status)
            .field("conn", &self.conn)
            .finish()
    }
}

/// The queue behind an event channel: raw agent events until the application takes them (embedded
/// devices), and the channels this one stands for at softrdmad sessions (daemon devices: the
/// daemon queues the events and writes a byte to `tx` for each; [`CmEventChannel::get_event`]
/// fetches them).
pub(crate) struct ChannelShared {
    queue: Mutex<VecDeque<softrdma_cm::CmEvent>>,
    cv: Condvar,
    tx: UnixDatagram,
    rx: UnixDatagram,
    daemon: Mutex<Vec<(Arc<client::Session>, u32)>>,
}

impl std::fmt::Debug for ChannelShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelShared").field("queue", &self.queue).finish()
    }
}

impl ChannelShared {
    fn push(&self, ev: softrdma_cm::CmEvent) {
        self.queue.lock().expect("cm channel lock").push_back(ev);
        let _ = self.tx.send(&[1]);
        self.cv.notify_all();
    }

    /// This channel's id at the daemon of session `s`, created on first use.
    fn daemon_channel(&self, s: &Arc<client::Session>) -> Result<u32> {
        let mut b = self.daemon.lock().expect("cm channel lock");
        if let Some((_, id)) = b.iter().find(|(x, _)| Arc::ptr_eq(x, s)) {
            return Ok(*id);
        }
        let id = match s.call(&Request::CmCreateChannel, &[self.tx.as_raw_fd()])?.0 {
            Response::Id(id) => id,
            _ => return Err(Error::Daemon("unexpected answer from softrdmad".into())),
        };
        b.push((Arc::clone(s), id));
        Ok(id)
    }
}

impl Drop for ChannelShared {
    fn drop(&mut self) {
        for (s, id) in self.daemon.get_mut().expect("cm channel lock").drain(..) {
            s.call_quiet(&Request::CmDestroyChannel { channel: id });
        }
    }
}

/// An event channel (`rdma_create_event_channel`): blocking waits, and a file descriptor readable
/// while events are pending.
pub struct CmEventChannel {
    shared: Arc<ChannelShared>,
}

impl CmEventChannel {
    /// A new channel.
    pub fn new() -> Result<CmEventChannel> {
        let (tx, rx) = UnixDatagram::pair().map_err(|e| Error::io("creating an event channel", e))?;
        tx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        rx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        Ok(CmEventChannel {
            shared: Arc::new(ChannelShared {
                queue: Mutex::new(VecDeque::new()),
                cv: Condvar::new(),
                tx,
                rx,
                daemon: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Wait for the next event (`rdma_get_cm_event`), up to `timeout` or forever with `None`.
    /// `ctx` is the device the channel's IDs live on (it makes the IDs of new connections; events
    /// of IDs on softrdmad devices carry their own).
    pub fn get_event(&self, ctx: &crate::Context, timeout: Option<Duration>) -> Option<CmEvent> {
        if !self.shared.daemon.lock().expect("cm channel lock").is_empty() {
            return self.get_event_daemon(ctx, timeout);
        }
        let q = self.shared.queue.lock().expect("cm channel lock");
        let mut q = match timeout {
            Some(t) => self.shared.cv.wait_timeout_while(q, t, |q| q.is_empty()).expect("cm channel lock").0,
            None => self.shared.cv.wait_while(q, |q| q.is_empty()).expect("cm channel lock"),
        };
        let ev = q.pop_front()?;
        drop(q);
        let mut b = [0u8; 1];
        let _ = self.shared.rx.recv(&mut b);
        Some(self.wrap_embedded(ctx, ev))
    }

    fn wrap_embedded(&self, ctx: &crate::Context, ev: softrdma_cm::CmEvent) -> CmEvent {
        let new_id = match (&ev.kind, ctx.embedded()) {
            (EventKind::ConnectRequest { .. }, Ok(h)) => {
                Some(CmId { imp: IdImp::Embedded { h: Arc::clone(h), id: ev.id }, _channel: Arc::clone(&self.shared) })
            }
            _ => None,
        };
        CmEvent { id: ev.id.0, kind: ev.kind, conn: ev.conn, ud: ev.ud, status: ev.status, new_id }
    }

    /// `get_event` for a channel with IDs on softrdmad devices: the descriptor wakes us, the
    /// events come from the daemon (and from this process's queue, for embedded IDs).
    fn get_event_daemon(&self, ctx: &crate::Context, timeout: Option<Duration>) -> Option<CmEvent> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let sh = &self.shared;
        loop {
            // Wake-ups first: an event arriving after this leaves a byte to wake the wait below.
            let mut b = [0u8; 16];
            while sh.rx.recv(&mut b).is_ok() {}
            let binds = sh.daemon.lock().expect("cm channel lock").clone();
            let mut q = sh.queue.lock().expect("cm channel lock");
            if let Some(ev) = q.pop_front() {
                drop(q);
                let _ = sh.tx.send(&[1]);
                return Some(self.wrap_embedded(ctx, ev));
            }
            drop(q);
            for (s, ch) in &binds {
                if let Ok((Response::CmEvent { event: Some(ev), more }, _)) =
                    s.call(&Request::CmGetEvent { channel: *ch }, &[])
                {
                    if more || binds.len() > 1 {
                        // Keep the descriptor readable while events may be pending.
                        let _ = sh.tx.send(&[1]);
                    }
                    let new_id = match ev.kind {
                        EventKind::ConnectRequest { .. } => Some(CmId {
                            imp: IdImp::Daemon { s: Arc::clone(s), id: ev.id.0 },
                            _channel: Arc::clone(sh),
                        }),
                        _ => None,
                    };
                    return Some(CmEvent {
                        id: ev.id.0,
                        kind: ev.kind,
                        conn: ev.conn,
                        ud: ev.ud,
                        status: ev.status,
                        new_id,
                    });
                }
            }
            let wait = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    Some(left)
                }
                None => None,
            };
            client::wait_readable(sh.rx.as_raw_fd(), wait);
        }
    }
}

impl AsRawFd for CmEventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.rx.as_raw_fd()
    }
}

/// The host's route lookup for the CM agent (`CmAgent::resolve_addr_via`): a UDP socket bound to
/// `local` and connected to `dst`; connecting a datagram socket sends nothing, the kernel only
/// looks the route up (the same lookup, `ip_route_output`, as its rdma_cm's address resolution).
/// A refusal is the negative errno (`-EINVAL` from a loopback source to a remote host,
/// `-ENETUNREACH` with no route).
///
/// The lookup runs in the calling thread's network namespace: when the device's address is not
/// there (a device opened inside another namespace) nothing is checked; the agent still follows
/// the device's own link and addresses.
pub(crate) fn route_lookup(local: IpAddr, dst: SocketAddr) -> core::result::Result<(), i32> {
    let errno = |e: std::io::Error| -e.raw_os_error().unwrap_or(libc::EHOSTUNREACH);
    let Ok(sock) = std::net::UdpSocket::bind(SocketAddr::new(local, 0)) else { return Ok(()) };
    let _ = sock.set_broadcast(true);
    let port = if dst.port() == 0 { crate::ROCE_PORT } else { dst.port() };
    sock.connect(SocketAddr::new(dst.ip(), port)).map_err(errno)
}

/// The verbs modify for a CM QP attribute set (`rdma_init_qp_attr`'s answer).
pub fn modify_for_attr(a: &QpAttr) -> ModifyQp {
    ModifyQp {
        state: Some(match a.state {
            QpAttrState::Init => QpState::Init,
            QpAttrState::Rtr => QpState::Rtr,
            QpAttrState::Rts => QpState::Rts,
        }),
        pkey_index: a.pkey_index,
        port: a.port,
        qkey: a.qkey,
        access: a.access.map(Access::from_bits),
        av: a.av.map(|r| AddressVector {
            dgid: r.dgid,
            sgid_index: r.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
            flow_label: a.flow_label,
            ..Default::default()
        }),
        path_mtu: a.path_mtu,
        dest_qpn: a.dest_qpn,
        rq_psn: a.rq_psn,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        sq_psn: a.sq_psn,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        max_rd_atomic: a.max_rd_atomic,
        ..Default::default()
    }
}

/// The CM side of a device's runtime state.
pub(crate) struct CmState {
    pub agent: CmAgent,
    /// The device's addresses and GID indices when it opened: the agent's set is those of them
    /// still on the netdev (see [`CmState::follow_netdev`]).
    all_addrs: Vec<(IpAddr, u8)>,
    channels: HashMap<IdHandle, Arc<ChannelShared>>,
    /// In the daemon: events of IDs without an in-process channel (all of them), for the daemon
    /// to route to the owning client. `None` (embedded mode): such events are dropped.
    pub unrouted: Option<VecDeque<softrdma_cm::CmEvent>>,
    gsi_psn: Psn,
}

impl CmState {
    pub fn new(agent: CmAgent) -> CmState {
        let all_addrs = agent.local_addrs().to_vec();
        CmState { agent, all_addrs, channels: HashMap::new(), unrouted: None, gsi_psn: Psn::new(0) }
    }

    /// Follow the netdev: its link is the port's state, its addresses the agent's (an address
    /// removed takes its GID with it). `owns` answers whether the netdev has an address; `None`
    /// when the netdev could not be read (the addresses stay as they are, the link is down).
    pub fn follow_netdev(&mut self, link_up: bool, owns: Option<impl Fn(IpAddr) -> bool>) {
        self.agent.set_port_active(link_up);
        let Some(owns) = owns else { return };
        let now: Vec<(IpAddr, u8)> = self.all_addrs.iter().filter(|(a, _)| owns(*a)).copied().collect();
        if now.as_slice() != self.agent.local_addrs() {
            self.agent.set_addrs(now);
        }
    }

    /// A packet for QP1 carrying a MAD: hand it to the agent. Returns whether it was one.
    pub fn handle_packet(&mut self, now: Instant, src: IpAddr, ib: &IbPacket<&[u8]>) -> bool {
        if ib.bth().dest_qp() != Qpn::GSI {
            return false;
        }
        if ib.deth().is_some_and(|d| d.qkey() == GSI_QKEY) {
            let gid = match src {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                IpAddr::V6(v6) => v6.octets(),
            };
            self.agent.handle_mad(now, gid, ib.payload());
        } else {
            self.agent.dropped += 1;
        }
        true
    }

    /// Apply the agent's outputs in order (QP changes to the engine, MADs through `send`) and hand
    /// its events to their channels. True if a QP was moved to the error state (softrdmad then
    /// makes what waits for its clients to place: `MrTable::make_all_placements`).
    pub fn drain(
        &mut self,
        hca: &mut Hca,
        mem: &mut dyn MemoryAccess,
        now: Instant,
        mut send: impl FnMut([u8; 16], &mut [u8]),
    ) -> bool {
        let mut errored = false;
        while let Some(o) = self.agent.poll_output() {
            match o {
                Output::Qp(cmd) => {
                    errored |= matches!(cmd, QpCommand::Err { .. });
                    let (qpn, mut m) = modify_for(cmd);
                    if hca.query_qp(qpn).is_ok_and(|q| q.qp_type == softrdma_transport::QpType::Uc) {
                        m = for_uc(m);
                    }
                    // A QP the application destroyed or left in RESET: the peer's retries or
                    // timeouts end the connection; nothing else to do here.
                    let _ = hca.modify_qp(qpn, &m, now, mem);
                }
                Output::Mad { dgid, mad } => {
                    let mut buf = [0u8; 12 + 8 + MAD_LEN + 4];
                    if self.ud_packet(&mad[..], &mut buf).is_ok() {
                        send(dgid, &mut buf);
                    }
                }
            }
        }
        while let Some(ev) = self.agent.poll_event() {
            let ch = match ev.kind {
                EventKind::ConnectRequest { listener } => {
                    let ch = self.channels.get(&listener).cloned();
                    if let Some(c) = &ch {
                        self.channels.insert(ev.id, Arc::clone(c));
                    }
                    ch
                }
                _ => self.channels.get(&ev.id).cloned(),
            };
            if let Some(ch) = ch {
                ch.push(ev);
            } else if let Some(q) = self.unrouted.as_mut() {
                q.push_back(ev);
            }
        }
        errored
    }

    /// A UD SEND_ONLY from QP1 to QP1 carrying `mad`.
    fn ud_packet(&mut self, mad: &[u8], buf: &mut [u8]) -> softrdma_wire::Result<usize> {
        let psn = self.gsi_psn;
        self.gsi_psn = psn.next();
        let mut repr = IbRepr::new(BthRepr {
            ack_req: true,
            ..BthRepr::new(Opcode::of(QpType::Ud, base::SEND_ONLY).expect("UD SEND_ONLY"), Qpn::GSI, psn)
        });
        repr.deth = Some(DethRepr { qkey: GSI_QKEY, src_qp: Qpn::GSI });
        repr.payload_len = mad.len();
        let n = repr.emit(buf)?;
        buf[repr.payload_range()].copy_from_slice(mad);
        Ok(n)
    }
}

/// The engine modify for a CM QP command.
fn modify_for(cmd: QpCommand) -> (Qpn, ModifyQp) {
    match cmd {
        QpCommand::Rtr { qpn, dest_qpn, rq_psn, route, max_dest_rd_atomic, min_rnr_timer } => (
            qpn,
            ModifyQp {
                state: Some(QpState::Rtr),
                av: Some(AddressVector {
                    dgid: route.dgid,
                    sgid_index: route.sgid_index,
                    hop_limit: 64,
                    ..Default::default()
                }),
                path_mtu: Some(route.mtu),
                dest_qpn: Some(dest_qpn),
                rq_psn: Some(rq_psn),
                max_dest_rd_atomic: Some(max_dest_rd_atomic),
                min_rnr_timer: Some(min_rnr_timer),
                ..Default::default()
            },
        ),
        QpCommand::Rts { qpn, sq_psn, timeout, retry_cnt, rnr_retry, max_rd_atomic } => (
            qpn,
            ModifyQp {
                state: Some(QpState::Rts),
                sq_psn: Some(sq_psn),
                timeout: Some(timeout),
                retry_cnt: Some(retry_cnt),
                rnr_retry: Some(rnr_retry),
                max_rd_atomic: Some(max_rd_atomic),
                ..Default::default()
            },
        ),
        QpCommand::Err { qpn } => (qpn, ModifyQp { state: Some(QpState::Err), ..Default::default() }),
    }
}

/// `rdma_connect` on the device's agent: the connection is UC when the QP it names is a UC QP of
/// the device (the REQ says so, as the kernel's does from the ID's QP type).
pub(crate) fn connect_id(
    st: &mut crate::runtime::State,
    h: IdHandle,
    param: ConnParam,
    now: Instant,
) -> core::result::Result<(), CmError> {
    let uc = st.hca.query_qp(param.qpn).is_ok_and(|q| q.qp_type == softrdma_transport::QpType::Uc);
    st.cm.agent.set_uc(h, uc)?;
    st.cm.agent.connect(h, param, now)
}

/// A CM modify for a UC QP: without the READ/atomic depths, the RNR timer and the ACK timeout
/// and retries, which a UC QP's transitions do not take (the kernel's rdma_cm masks its QP
/// attributes by type the same way).
fn for_uc(m: ModifyQp) -> ModifyQp {
    ModifyQp {
        max_dest_rd_atomic: None,
        min_rnr_timer: None,
        timeout: None,
        retry_cnt: None,
        rnr_retry: None,
        max_rd_atomic: None,
        ..m
    }
}

impl crate::Context {
    /// RDMA CM IDs alive on this device (listeners, connections, IDs in time-wait): for leak checks.
    pub fn cm_id_count(&self) -> Result<usize> {
        if let Some(s) = self.daemon_session() {
            return Ok(s.call_id(&Request::CmIdCount)? as usize);
        }
        Ok(self.embedded()?.dev.lock().cm.agent.id_count())
    }

    /// Have this device's CM send a REQ that found no listener again, `retries` times
    /// ([`softrdma_cm::NO_LISTENER_RETRY_DELAY`] apart), before reporting REJECTED
    /// ([`softrdma_cm::AgentConfig::no_listener_retries`]; the default, 0, is the kernel's
    /// behaviour).
    /// On a softrdmad device the setting is the device's, for every client.
    pub fn set_cm_no_listener_retries(&self, retries: u8) -> Result<()> {
        if let Some(s) = self.daemon_session() {
            s.call(&Request::CmSetNoListenerRetries { retries }, &[])?;
            return Ok(());
        }
        self.embedded()?.dev.lock().cm.agent.set_no_listener_retries(retries);
        Ok(())
    }
}

/// A communication identifier (`struct rdma_cm_id`) on a device.
pub struct CmId {
    imp: IdImp,
    _channel: Arc<ChannelShared>,
}

enum IdImp {
    /// On an embedded device: the agent runs in this process.
    Embedded { h: Arc<DeviceHandle>, id: IdHandle },
    /// On a softrdmad device: the agent runs in the daemon; `id` is its handle there.
    Daemon { s: Arc<client::Session>, id: u32 },
}

fn cm_err(e: CmError) -> Error {
    Error::InvalidArgument(format!("rdma_cm: {e}"))
}

impl CmId {
    pub(crate) fn create(h: Arc<DeviceHandle>, channel: &CmEventChannel, ps: PortSpace) -> CmId {
        let mut st = h.dev.lock();
        let id = st.cm.agent.create_id(ps);
        st.cm.channels.insert(id, Arc::clone(&channel.shared));
        drop(st);
        CmId { imp: IdImp::Embedded { h, id }, _channel: Arc::clone(&channel.shared) }
    }

    pub(crate) fn create_daemon(s: &Arc<client::Session>, channel: &CmEventChannel, ps: PortSpace) -> Result<CmId> {
        let ch = channel.shared.daemon_channel(s)?;
        let id = s.call_id(&Request::CmCreateId { channel: ch, ps })?;
        Ok(CmId { imp: IdImp::Daemon { s: Arc::clone(s), id }, _channel: Arc::clone(&channel.shared) })
    }

    /// Run `f` on the embedded agent, or send `req` to the daemon.
    fn run(
        &self,
        f: impl FnOnce(&mut CmAgent, IdHandle, Instant) -> core::result::Result<(), CmError>,
        req: impl FnOnce(u32) -> Request,
    ) -> Result<()> {
        self.run_state(|st, id, now| f(&mut st.cm.agent, id, now), req)
    }

    /// [`CmId::run`] for work that needs more of the embedded device than its agent.
    fn run_state(
        &self,
        f: impl FnOnce(&mut crate::runtime::State, IdHandle, Instant) -> core::result::Result<(), CmError>,
        req: impl FnOnce(u32) -> Request,
    ) -> Result<()> {
        match &self.imp {
            IdImp::Embedded { h, id } => h.dev.run(|st, now| f(st, *id, now)).map_err(cm_err),
            IdImp::Daemon { s, id } => s.call(&req(*id), &[]).map(|_| ()),
        }
    }

    /// The ID's number (what events report).
    pub fn handle(&self) -> u32 {
        match &self.imp {
            IdImp::Embedded { id, .. } => id.0,
            IdImp::Daemon { id, .. } => *id,
        }
    }

    /// Bind to a local address (`rdma_bind_addr`); port 0 picks one.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        self.run(|a, id, _| a.bind(id, addr), |id| Request::CmBind { id, addr })
    }

    /// Resolve the destination (`rdma_resolve_addr`); ADDR_RESOLVED follows, or ADDR_ERROR with
    /// the kernel's status (no route from the device to `dst`, the port down).
    pub fn resolve_addr(&self, src: Option<IpAddr>, dst: SocketAddr) -> Result<()> {
        self.run(
            |a, id, _| a.resolve_addr_via(id, src, dst, route_lookup),
            |id| Request::CmResolveAddr { id, src, dst },
        )
    }

    /// Resolve the route (`rdma_resolve_route`); ROUTE_RESOLVED follows, or ROUTE_ERROR with the
    /// kernel's status (the port down, the source address gone, the destination unroutable).
    pub fn resolve_route(&self) -> Result<()> {
        self.run(|a, id, _| a.resolve_route_via(id, route_lookup), |id| Request::CmResolveRoute { id })
    }

    /// Finish a connection whose QP the application owns (`rdma_establish`), after
    /// CONNECT_RESPONSE and once the QP is in RTS: the RTU goes out. As with the kernel, no event
    /// follows here; the peer gets ESTABLISHED.
    pub fn establish(&self) -> Result<()> {
        self.run(|a, id, _| a.establish(id), |id| Request::CmEstablish { id })
    }

    /// The CM's attributes for moving this ID's QP to `state` (`rdma_init_qp_attr`), as the
    /// kernel's CM gives them; see [`modify_for_attr`] for the verbs modify.
    pub fn init_qp_attr(&self, state: QpAttrState) -> Result<QpAttr> {
        match &self.imp {
            IdImp::Embedded { h, id } => h.dev.lock().cm.agent.init_qp_attr(*id, state).map_err(cm_err),
            IdImp::Daemon { s, id } => match s.call(&Request::CmInitQpAttr { id: *id, state }, &[])?.0 {
                Response::CmQpAttr(a) => Ok(a),
                _ => Err(Error::Daemon("unexpected answer from softrdmad".into())),
            },
        }
    }

    /// Move `qp` to `state` with [`CmId::init_qp_attr`]'s attributes (`rdma_init_qp_attr` then
    /// `ibv_modify_qp`).
    pub fn modify_qp(&self, qp: &crate::QueuePair, state: QpAttrState) -> Result<()> {
        let m = modify_for_attr(&self.init_qp_attr(state)?);
        qp.modify(&if qp.query()?.qp_type == softrdma_transport::QpType::Uc { for_uc(m) } else { m })
    }

    /// Listen (`rdma_listen`).
    pub fn listen(&self, backlog: u32) -> Result<()> {
        self.run(|a, id, _| a.listen(id, backlog), |id| Request::CmListen { id, backlog })
    }

    /// Connect (`rdma_connect`); ESTABLISHED (CONNECT_RESPONSE when [`ConnParam::drive_qp`] is
    /// false), REJECTED or UNREACHABLE follows.
    pub fn connect(&self, param: ConnParam) -> Result<()> {
        let p = param.clone();
        self.run_state(|st, id, now| connect_id(st, id, param, now), |id| Request::CmConnect { id, param: p })
    }

    /// Accept a connection request (`rdma_accept`). With [`ConnParam::drive_qp`] false the QP is
    /// not touched: move it to RTS with [`CmId::init_qp_attr`] first.
    pub fn accept(&self, param: ConnParam) -> Result<()> {
        let p = param.clone();
        self.run(|a, id, now| a.accept(id, param, now), |id| Request::CmAccept { id, param: p })
    }

    /// Reject a connection request (`rdma_reject`).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.run(
            |a, id, _| a.reject(id, private_data),
            |id| Request::CmReject { id, private_data: private_data.to_vec() },
        )
    }

    /// Disconnect (`rdma_disconnect`).
    pub fn disconnect(&self) -> Result<()> {
        self.run(|a, id, now| a.disconnect(id, now), |id| Request::CmDisconnect { id })
    }

    fn query(s: &client::Session, id: u32) -> Option<(Option<Route>, Option<SocketAddr>, Option<SocketAddr>)> {
        match s.call(&Request::CmQuery { id }, &[]) {
            Ok((Response::CmInfo { route, local, peer }, _)) => Some((route, local, peer)),
            _ => None,
        }
    }

    /// The resolved route.
    pub fn route(&self) -> Option<Route> {
        match &self.imp {
            IdImp::Embedded { h, id } => h.dev.lock().cm.agent.route(*id),
            IdImp::Daemon { s, id } => Self::query(s, *id).and_then(|q| q.0),
        }
    }

    /// Local and peer addresses.
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        match &self.imp {
            IdImp::Embedded { h, id } => h.dev.lock().cm.agent.addrs(*id),
            IdImp::Daemon { s, id } => Self::query(s, *id).map_or((None, None), |q| (q.1, q.2)),
        }
    }

    /// Report this ID's later events to `channel` (`rdma_migrate_id`). Events already queued on
    /// the old channel stay there.
    pub fn migrate(&mut self, channel: &CmEventChannel) {
        match &self.imp {
            IdImp::Embedded { h, id } => {
                h.dev.lock().cm.channels.insert(*id, Arc::clone(&channel.shared));
            }
            IdImp::Daemon { s, id } => {
                let Ok(ch) = channel.shared.daemon_channel(s) else { return };
                if s.call(&Request::CmMigrate { id: *id, channel: ch }, &[]).is_err() {
                    return;
                }
            }
        }
        self._channel = Arc::clone(&channel.shared);
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        match &self.imp {
            IdImp::Embedded { h, id } => h.dev.run(|st, now| {
                let _ = st.cm.agent.destroy_id(*id, now);
                st.cm.channels.remove(id);
            }),
            IdImp::Daemon { s, id } => s.call_quiet(&Request::CmDestroyId { id: *id }),
        }
    }
}
