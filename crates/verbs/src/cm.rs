//! RDMA CM on an embedded device: the [`CmAgent`] of the device runs inside its runtime, receiving
//! MADs for QP1 and sending its own as UD packets from QP1; the application uses [`CmId`]s and a
//! [`CmEventChannel`], as with librdmacm.
//!
//! Connection setup drives the application's QP: accept and the REP's arrival move it to RTR and
//! RTS, disconnect to ERR. The QP must be in INIT (see [`crate::QueuePair::init`]) before connect or
//! accept, as `rdma_create_qp` leaves it.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use softrdma_cm::{CmAgent, CmError, ConnInfo, ConnParam, EventKind, IdHandle, Output, PortSpace, QpCommand, Route, UdInfo};
use softrdma_transport::{AddressVector, Hca, Instant, MemoryAccess, ModifyQp, QpState};
use softrdma_wire::bth::DEFAULT_PKEY;
use softrdma_wire::mad::{GSI_QKEY, MAD_LEN};
use softrdma_wire::opcode::base;
use softrdma_wire::{BthRepr, DethRepr, IbPacket, IbRepr, Opcode, Psn, QpType, Qpn};

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
    /// For CONNECT_REQUEST: the ID of the new connection, to accept or reject.
    pub new_id: Option<CmId>,
}

impl std::fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmEvent").field("id", &self.id).field("kind", &self.kind).field("conn", &self.conn).finish()
    }
}

/// The queue behind an event channel: raw agent events until the application takes them.
#[derive(Debug)]
pub(crate) struct ChannelShared {
    queue: Mutex<VecDeque<softrdma_cm::CmEvent>>,
    cv: Condvar,
    tx: UnixDatagram,
    rx: UnixDatagram,
}

impl ChannelShared {
    fn push(&self, ev: softrdma_cm::CmEvent) {
        self.queue.lock().expect("cm channel lock").push_back(ev);
        let _ = self.tx.send(&[1]);
        self.cv.notify_all();
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
        Ok(CmEventChannel { shared: Arc::new(ChannelShared { queue: Mutex::new(VecDeque::new()), cv: Condvar::new(), tx, rx }) })
    }

    /// Wait for the next event (`rdma_get_cm_event`), up to `timeout` or forever with `None`.
    /// `ctx` is the device the channel's IDs live on (it makes the IDs of new connections).
    pub fn get_event(&self, ctx: &crate::Context, timeout: Option<Duration>) -> Option<CmEvent> {
        let q = self.shared.queue.lock().expect("cm channel lock");
        let mut q = match timeout {
            Some(t) => self.shared.cv.wait_timeout_while(q, t, |q| q.is_empty()).expect("cm channel lock").0,
            None => self.shared.cv.wait_while(q, |q| q.is_empty()).expect("cm channel lock"),
        };
        let ev = q.pop_front()?;
        drop(q);
        let mut b = [0u8; 1];
        let _ = self.shared.rx.recv(&mut b);
        // Only embedded devices have CM IDs, so a connection request comes with one.
        let new_id = match (&ev.kind, ctx.embedded()) {
            (EventKind::ConnectRequest { .. }, Ok(h)) => {
                Some(CmId { h: Arc::clone(h), id: ev.id, _channel: Arc::clone(&self.shared) })
            }
            _ => None,
        };
        Some(CmEvent { id: ev.id.0, kind: ev.kind, conn: ev.conn, ud: ev.ud, new_id })
    }
}

impl AsRawFd for CmEventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.rx.as_raw_fd()
    }
}

/// The CM side of a device's runtime state.
pub(crate) struct CmState {
    pub agent: CmAgent,
    channels: HashMap<IdHandle, Arc<ChannelShared>>,
    gsi_psn: Psn,
}

impl CmState {
    pub fn new(agent: CmAgent) -> CmState {
        CmState { agent, channels: HashMap::new(), gsi_psn: Psn::new(0) }
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
    /// its events to their channels.
    pub fn drain(&mut self, hca: &mut Hca, mem: &mut dyn MemoryAccess, now: Instant, mut send: impl FnMut([u8; 16], &mut [u8])) {
        while let Some(o) = self.agent.poll_output() {
            match o {
                Output::Qp(cmd) => {
                    let (qpn, m) = modify_for(cmd);
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
            }
        }
    }

    /// A UD SEND_ONLY from QP1 to QP1 carrying `mad`.
    fn ud_packet(&mut self, mad: &[u8], buf: &mut [u8]) -> softrdma_wire::Result<usize> {
        let psn = self.gsi_psn;
        self.gsi_psn = psn.next();
        let mut repr = IbRepr::new(BthRepr {
            opcode: Opcode::of(QpType::Ud, base::SEND_ONLY).expect("UD SEND_ONLY"),
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: Qpn::GSI,
            ack_req: true,
            psn,
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
                av: Some(AddressVector { dgid: route.dgid, sgid_index: route.sgid_index, hop_limit: 64, ..Default::default() }),
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

impl crate::Context {
    /// Have this device's CM send a REQ that found no listener again, `retries` times
    /// ([`softrdma_cm::NO_LISTENER_RETRY_DELAY`] apart), before reporting REJECTED
    /// ([`softrdma_cm::AgentConfig::no_listener_retries`]; the default, 0, is the kernel's
    /// behaviour).
    pub fn set_cm_no_listener_retries(&self, retries: u8) -> Result<()> {
        self.embedded()?.dev.lock().cm.agent.set_no_listener_retries(retries);
        Ok(())
    }
}

/// A communication identifier (`struct rdma_cm_id`) on a device.
pub struct CmId {
    h: Arc<DeviceHandle>,
    id: IdHandle,
    _channel: Arc<ChannelShared>,
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
        CmId { h, id, _channel: Arc::clone(&channel.shared) }
    }

    fn run<R>(&self, f: impl FnOnce(&mut CmAgent, Instant) -> core::result::Result<R, CmError>) -> Result<R> {
        self.h.dev.run(|st, now| f(&mut st.cm.agent, now)).map_err(cm_err)
    }

    /// The ID's number (what events report).
    pub fn handle(&self) -> u32 {
        self.id.0
    }

    /// Bind to a local address (`rdma_bind_addr`); port 0 picks one.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        self.run(|a, _| a.bind(self.id, addr))
    }

    /// Resolve the destination (`rdma_resolve_addr`); ADDR_RESOLVED follows.
    pub fn resolve_addr(&self, src: Option<IpAddr>, dst: SocketAddr) -> Result<()> {
        self.run(|a, _| a.resolve_addr(self.id, src, dst))
    }

    /// Resolve the route (`rdma_resolve_route`); ROUTE_RESOLVED follows.
    pub fn resolve_route(&self) -> Result<()> {
        self.run(|a, _| a.resolve_route(self.id))
    }

    /// Listen (`rdma_listen`).
    pub fn listen(&self, backlog: u32) -> Result<()> {
        self.run(|a, _| a.listen(self.id, backlog))
    }

    /// Connect (`rdma_connect`); ESTABLISHED, REJECTED or UNREACHABLE follows.
    pub fn connect(&self, param: ConnParam) -> Result<()> {
        self.run(|a, now| a.connect(self.id, param, now))
    }

    /// Accept a connection request (`rdma_accept`).
    pub fn accept(&self, param: ConnParam) -> Result<()> {
        self.run(|a, now| a.accept(self.id, param, now))
    }

    /// Reject a connection request (`rdma_reject`).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.run(|a, _| a.reject(self.id, private_data))
    }

    /// Disconnect (`rdma_disconnect`).
    pub fn disconnect(&self) -> Result<()> {
        self.run(|a, now| a.disconnect(self.id, now))
    }

    /// The resolved route.
    pub fn route(&self) -> Option<Route> {
        self.h.dev.lock().cm.agent.route(self.id)
    }

    /// Local and peer addresses.
    pub fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        self.h.dev.lock().cm.agent.addrs(self.id)
    }

    /// Report this ID's later events to `channel` (`rdma_migrate_id`). Events already queued on
    /// the old channel stay there.
    pub fn migrate(&mut self, channel: &CmEventChannel) {
        self.h.dev.lock().cm.channels.insert(self.id, Arc::clone(&channel.shared));
        self._channel = Arc::clone(&channel.shared);
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.h.dev.run(|st, now| {
            let _ = st.cm.agent.destroy_id(self.id, now);
            st.cm.channels.remove(&self.id);
        });
    }
}
