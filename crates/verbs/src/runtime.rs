//! The embedded device at run time: the engine ([`Hca`]) and region table behind one lock, the UDP
//! endpoint, the same-host link (shared-memory lanes to other softrdma devices on this host, see
//! `same_host.rs`: packets for such a device go there instead of the socket), and the I/O thread
//! that receives packets, fires timers and sends what the engine produces.
//!
//! Verbs calls run on the caller's thread: they take the lock, act on the engine, and send any
//! packets it produced right away (no hand-over to the I/O thread on the send path). The I/O thread
//! sleeps in `ppoll` on the sockets and a wake-up socket until a packet or the next timer; a call
//! that arms a timer earlier than the one the I/O thread sleeps towards (the first request after
//! an idle period, an RNR wait) wakes it once, so the timer fires on time even if the application
//! then blocks instead of polling.

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use softrdma_device::{DeviceInfo, Gid};
use softrdma_transport::{
    AsyncEvent, Config, CqId, DeferredPayload, Hca, Instant, ModifyQp, QpState, RxInfo, SendWr, Transmit, VerbsError,
    WcOpcode, WorkCompletion,
};
use softrdma_wire::roce::{seal_udp_payload, ud_grh_area, IcrcCache, UdpVerdict, VerifyStats};
use softrdma_wire::{IbPacket, ICRC_LEN};

use crate::clock::monotonic_ns;
use crate::cm::CmState;
use crate::error::{Error, Result};
use crate::io::{self as udp, UdpPort};
use crate::loopback;
use crate::memory::{InPlace, MrTable};
use crate::multicast::{self, GroupSockets};
use crate::place::{self, Plan};
use crate::poller;
use crate::qp_traffic::QpTrafficTable;
use crate::same_host::Link;

/// Bytes per transmit slot: the largest IB packet (4096-byte MTU plus headers) with room to spare.
const TX_SLOT: usize = 4096 + 512;
/// Bytes per receive slot: a whole GRO batch (up to 64 KiB of coalesced datagrams); larger
/// datagrams are truncated by the kernel and dropped as malformed.
const RX_SLOT: usize = 65536;

/// The parts of the device state that take a received packet in (borrowed apart from the transmit
/// side, so that the flush can hand over the packets the device sends to itself: loopback.rs).
pub(crate) struct Receiver<'a> {
    pub cm: &'a mut CmState,
    pub hca: &'a mut Hca,
    pub mem: &'a mut MrTable,
    pub qp_traffic: &'a mut Option<QpTrafficTable>,
}

impl Receiver<'_> {
    /// A received packet that parsed (and passed its ICRC check, if it had one): to the CM if it
    /// is a MAD for it, else to the engine.
    pub fn deliver(&mut self, now: Instant, payload: &[u8], ib: &IbPacket<&[u8]>, src: SocketAddr, local: SocketAddr) {
        if self.cm.handle_packet(now, src.ip(), ib) {
            return;
        }
        // Only UD receives (packets with a DETH) show the 40 bytes in front of the data.
        let grh = if ib.deth().is_some() { ud_grh_area(src.ip(), local.ip(), payload.len()) } else { [0; 40] };
        let rx = RxInfo { grh };
        if let Some(mgid) = multicast::group_of(&local) {
            // Daemon mode attributes each member's drops to that member.
            let mut table = self.qp_traffic.as_mut();
            if let Some(t) = table.as_mut() {
                t.begin(self.hca.counters());
            }
            let len = payload.len();
            self.hca.handle_multicast(now, ib, &rx, &mgid, self.mem, |qpn, c| {
                if let Some(t) = table.as_mut() {
                    t.count_member(qpn, len, c);
                }
            });
            return;
        }
        self.traffic(ib.bth().dest_qp(), payload.len(), |hca, mem| hca.handle_parsed(now, ib, &rx, mem));
    }

    /// Run `f` (the engine taking in a packet of `len` bytes for QP `qpn`) and, in daemon mode, add
    /// what it did to that QP's traffic.
    pub fn traffic<R>(
        &mut self,
        qpn: softrdma_wire::Qpn,
        len: usize,
        f: impl FnOnce(&mut Hca, &mut MrTable) -> R,
    ) -> R {
        let Some(table) = self.qp_traffic.as_mut() else { return f(self.hca, self.mem) };
        table.begin(self.hca.counters());
        let r = f(self.hca, self.mem);
        if let Some(c) = table.end(qpn, self.hca.counters()) {
            c.pkts[2] += 1;
            c.pkts[3] += len as u64;
        }
        r
    }
}

/// Smallest payload the engine leaves in registered memory for the flush to send in place (an
/// iovec into the region instead of a copy into the transmit slot); below it the copy is cheaper
/// than the extra iovec entries and the ICRC in pieces. `SOFTRDMA_COPY_TX=1` copies every payload.
fn defer_payload_min() -> usize {
    if std::env::var_os("SOFTRDMA_COPY_TX").is_some() {
        0
    } else {
        1024
    }
}

/// Everything behind the device lock.
pub(crate) struct State {
    pub hca: Hca,
    pub mem: MrTable,
    /// Completion channels by CQ.
    pub channels: HashMap<CqId, Arc<ChannelShared>>,
    pub async_events: VecDeque<AsyncEvent>,
    /// ICRC verdicts of received packets.
    pub verify: VerifyStats,
    /// The ICRC pseudo-header of the last received packets' addresses and length.
    rx_icrc: IcrcCache,
    /// Datagrams the socket refused.
    pub tx_errors: u64,
    /// Posts whose packets waited for the next progress (`Device::run_post`).
    pub corked: u64,
    /// A thread polling a CQ took a completion before the packets its receive made the engine owe
    /// (ACKs) were sent: the next flush sends them (see [`Device::poll_progress`]).
    flush_owed: bool,
    /// Polls that left a flush owed.
    pub flushes_left_owed: u64,
    /// When the I/O thread will next wake up on its own (its timer deadline, or the end of its idle
    /// wait). A deadline armed anywhere else (a verbs call, a thread polling a CQ) that is earlier
    /// than this must wake it, or the timer would fire up to an idle wait late.
    pub(crate) io_wake_at: Option<Instant>,
    pub next_pd: u32,
    /// Per-QP traffic and engine counters, kept only when the device runs in the daemon (`None` in
    /// embedded mode costs nothing).
    pub qp_traffic: Option<QpTrafficTable>,
    /// The connection manager of the device (QP1).
    pub cm: CmState,
    /// The same-host link (shared-memory lanes to other softrdma devices on this host).
    pub link: Link,
    /// When the UDP sockets are due for a receive while inbound lanes are busy (see `progress_at`),
    /// and whether the last receive found datagrams (then they are polled every time).
    udp_due: Instant,
    udp_busy: bool,
    /// The last receive (`Device::receive_at`) took datagrams from the UDP sockets.
    rx_udp_now: bool,
    /// How far arming is trusted to be worth its cost (see [`Device::poll_leaves`]), back to
    /// [`ARM_CREDIT`] whenever the I/O thread took over while the application was away. Asking
    /// the lanes for doorbells: one less each time the application came back with a poll first
    /// (it polls while it waits, and takes what arrives itself). Waking the I/O thread (no lane):
    /// one less each time the application came back first at all.
    lane_credit: u8,
    wake_credit: u8,
    /// The I/O thread took over since the application last armed.
    arm_used: bool,
    tx_buf: Vec<u8>,
    /// Where a small message's packet is built before it is copied into a lane (see
    /// [`Device::post_send`]).
    ahead_buf: Vec<u8>,
    tx_meta: Vec<(usize, SocketAddr, SocketAddr, usize)>,
    /// The packets of a transmit batch the device sent to itself: (transmit slot, length, payload
    /// left in registered memory, the address).
    tx_self: Vec<(usize, usize, Option<DeferredPayload>, SocketAddr)>,
    /// The ICRC pseudo-header of the last sent packets' addresses and length.
    tx_icrc: IcrcCache,
    /// The destination GID of the last packet sent, with the UDP addresses it maps to (destination,
    /// and this device's source for it): a function of the GID alone, kept from flush to flush, as
    /// a burst, or a ping-pong, goes to one peer.
    tx_peer: Option<([u8; 16], SocketAddr, SocketAddr)>,
    rx_buf: Vec<u8>,
    /// The QP whose RC WRITE the last received packet continued (a FIRST or MIDDLE): the next
    /// datagram may be its continuation, received in place (see place.rs).
    rx_hint: Option<softrdma_wire::Qpn>,
    /// The last datagram was large: receive one at a time (a batch could swallow a WRITE's FIRST
    /// together with its continuation, which then could not be received in place).
    rx_single: bool,
    /// Packets received in place (see place.rs).
    pub rx_placed: u64,
    /// The sockets of the multicast groups the device's QPs are attached to.
    pub groups: GroupSockets,
}

impl State {
    /// Close the sockets of multicast groups no QP is attached to any more (after a detach, or a
    /// destroyed QP).
    fn forget_left_groups(&mut self) {
        self.groups.retain(self.hca.mcast_groups());
    }

    /// Destroy QP `qpn`: the engine's QP, its share of the per-QP counters (daemon mode) and the
    /// sockets of the multicast groups it was the device's last QP in.
    pub(crate) fn destroy_qp(
        &mut self,
        qpn: softrdma_wire::Qpn,
    ) -> std::result::Result<(), softrdma_transport::VerbsError> {
        let r = self.hca.destroy_qp(qpn);
        if let Some(m) = self.qp_traffic.as_mut() {
            m.remove(qpn);
        }
        self.forget_left_groups();
        r
    }

    /// Whether a packet may go ahead of the flush ([`Device::send_ahead`]): a same-host lane is up,
    /// and not in daemon mode, which attributes each packet to its QP in the flush.
    fn may_send_ahead(&self) -> bool {
        self.qp_traffic.is_none() && self.link.has_outbound_lane()
    }

    /// The receiving parts of the state.
    fn receiver(&mut self) -> Receiver<'_> {
        Receiver { cm: &mut self.cm, hca: &mut self.hca, mem: &mut self.mem, qp_traffic: &mut self.qp_traffic }
    }

    /// The earliest timer of the engine and the CM agent.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        match (self.hca.poll_timeout(), self.cm.agent.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A completion channel's shared part: a queue of CQs with events, a condition variable for
/// blocking waits, and a socket pair whose read end is readable while events are pending.
#[derive(Debug)]
pub(crate) struct ChannelShared {
    pub queue: Mutex<VecDeque<CqId>>,
    pub cv: Condvar,
    pub tx: UnixDatagram,
    pub rx: UnixDatagram,
}

impl ChannelShared {
    pub fn new() -> Result<ChannelShared> {
        let (tx, rx) = UnixDatagram::pair().map_err(|e| Error::io("creating a completion channel", e))?;
        tx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        rx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        Ok(ChannelShared { queue: Mutex::new(VecDeque::new()), cv: Condvar::new(), tx, rx })
    }

    fn notify(&self, cq: CqId) {
        self.queue.lock().expect("channel lock").push_back(cq);
        let _ = self.tx.send(&[1]);
        self.cv.notify_all();
    }
}

/// The device shared by its I/O thread and every verbs object.
pub(crate) struct Device {
    pub info: DeviceInfo,
    state: Mutex<State>,
    pub port: UdpPort,
    async_cv: Condvar,
    /// One byte per queued async event: the read end is readable while events are pending
    /// (`ibv_context.async_fd`).
    async_tx: UnixDatagram,
    async_rx: UnixDatagram,
    wake_tx: UnixDatagram,
    wake_rx: UnixDatagram,
    stop: AtomicBool,
    /// `CLOCK_MONOTONIC` (ns) when the device was created: the engine's clock starts there.
    epoch: u64,
    /// Clock reading (ns) of the last progress made by an application thread polling a CQ.
    app_progress: AtomicU64,
    /// The I/O thread stands aside for a polling application thread (see `io_loop`): it looks
    /// again within [`BUSY_SLEEP`] and makes progress once no poll came for [`BUSY_WINDOW`], so a
    /// poll may leave a flush owed (see [`Device::poll_progress`]). Cleared before the I/O thread
    /// takes the lock to work out how long to sleep otherwise (not at all while a flush is owed).
    io_aside: AtomicBool,
    /// A thread polling a CQ took its last completions with nothing in flight and asked the
    /// inbound lanes for doorbells: the application may now wait for something no poll sees
    /// (see [`Device::poll_leaves`]). Written under the device lock; cleared by the
    /// application's next poll or post. The I/O thread reads it without the lock.
    app_armed: AtomicBool,
    /// The inbound lanes' sockets (`Link::doorbell_fds`), for the I/O thread's sleep aside.
    lane_fds: Arc<Mutex<Vec<std::os::fd::RawFd>>>,
    /// Receive RC WRITE continuations in place (see place.rs; `DeviceBuilder::rx_place`, off by
    /// default: every payload is copied out of the receive buffer).
    rx_place: bool,
}

/// An application thread that polled within this window is busy polling (see `io_loop`).
const BUSY_WINDOW: Duration = Duration::from_micros(200);
/// How long the I/O thread sleeps before checking again while an application thread busy-polls.
const BUSY_SLEEP: Duration = Duration::from_micros(500);

/// The CM agent of a device: its GUID, the addresses its sockets are bound to with their GID
/// indices, its MTU, and a seed that differs per process and run.
fn cm_agent(info: &DeviceInfo, port: &UdpPort) -> softrdma_cm::CmAgent {
    let addrs = port
        .sockets()
        .filter_map(|(_, a)| {
            let index = info.gids.iter().find(|(_, e)| e.gid.to_ip() == a.ip()).map(|(i, _)| i)?;
            Some((a.ip(), u8::try_from(index).ok()?))
        })
        .collect();
    let mtu = info.port.active_mtu;
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seed = t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 40);
    softrdma_cm::CmAgent::new(softrdma_cm::AgentConfig::new(info.node_guid().0, addrs, mtu, seed))
}

impl Device {
    /// Bind the UDP endpoint (and the same-host link's listeners if `same_host`) and build the
    /// engine for `info`.
    pub fn new(
        info: DeviceInfo,
        v4: Option<Ipv4Addr>,
        v6: Option<Ipv6Addr>,
        udp_port: u16,
        same_host: bool,
        rx_place: bool,
    ) -> Result<Device> {
        let port = UdpPort::bind(v4, v6, udp_port, info.netdev.index)?;
        let cm = CmState::new(cm_agent(&info, &port));
        let link = Link::new(same_host, port.sockets().map(|(_, a)| *a));
        let lane_fds = link.doorbell_fds();
        let port_mtu = info.port.active_mtu;
        let max_rd_atomic = info.attr.max_qp_rd_atom.min(255) as u8;
        // Real links lose packets in bursts of congestion: adapt the go-back-N window to loss.
        // Many QPs share the path and the peer's socket buffer: together they keep about four
        // single-QP windows in flight (see `Config::device_inflight_packets`).
        let config = Config {
            port_mtu,
            max_rd_atomic,
            adaptive_window: true,
            device_inflight_packets: 512,
            defer_payload_min: defer_payload_min(),
            cork_max_queued: if std::env::var_os("SOFTRDMA_CORK").is_some_and(|v| v == "0") {
                0
            } else {
                CORK_MAX_QUEUED
            },
            ..Config::default()
        };
        let (wake_tx, wake_rx) = UnixDatagram::pair().map_err(|e| Error::io("creating the wake-up socket", e))?;
        wake_tx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        wake_rx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        let (async_tx, async_rx) = UnixDatagram::pair().map_err(|e| Error::io("creating the async event socket", e))?;
        async_tx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        async_rx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        let mut hca = Hca::new(config);
        if link.loops_back() {
            // Two QPs of this device connected to each other through one of its own addresses (what
            // the flush loops back) have their one-packet requests executed at post time.
            let own: Vec<[u8; 16]> =
                port.sockets().filter(|(_, a)| !a.ip().is_unspecified()).map(|(_, a)| Gid::from_ip(a.ip()).0).collect();
            hca.set_local_gids(&own);
        }
        let state = State {
            hca,
            mem: MrTable::default(),
            channels: HashMap::new(),
            async_events: VecDeque::new(),
            verify: VerifyStats::default(),
            rx_icrc: IcrcCache::default(),
            tx_errors: 0,
            corked: 0,
            flush_owed: false,
            flushes_left_owed: 0,
            io_wake_at: None,
            next_pd: 1,
            qp_traffic: None,
            cm,
            link,
            udp_due: Instant::from_nanos(0),
            udp_busy: false,
            rx_udp_now: false,
            lane_credit: ARM_CREDIT,
            wake_credit: ARM_CREDIT,
            arm_used: false,
            tx_buf: vec![0; udp::BATCH * TX_SLOT],
            ahead_buf: vec![0; crate::same_host::MAX_PACKET],
            tx_meta: Vec::with_capacity(udp::BATCH),
            tx_self: Vec::with_capacity(udp::BATCH),
            tx_icrc: IcrcCache::default(),
            tx_peer: None,
            rx_buf: vec![0; udp::BATCH * RX_SLOT],
            rx_hint: None,
            rx_single: false,
            rx_placed: 0,
            groups: GroupSockets::default(),
        };
        Ok(Device {
            info,
            state: Mutex::new(state),
            port,
            async_cv: Condvar::new(),
            async_tx,
            async_rx,
            wake_tx,
            wake_rx,
            stop: AtomicBool::new(false),
            epoch: monotonic_ns(),
            app_progress: AtomicU64::new(0),
            io_aside: AtomicBool::new(false),
            app_armed: AtomicBool::new(false),
            lane_fds,
            rx_place,
        })
    }

    /// The engine's clock reading.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(monotonic_ns().saturating_sub(self.epoch))
    }

    /// Take the device lock.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the engine state in an unknown shape; carrying on
        // would be worse than stopping, so poisoning propagates.
        self.state.lock().expect("device lock poisoned")
    }

    /// [`Device::run`] for a call that produces no packets and arms no timer (posting a
    /// receive): completions and events are handed out (no deadline moved: the I/O thread needs
    /// no wake-up), nothing is flushed, and the clock is not read (~22 ns on a request-response
    /// path): `f` is given the time of the application's last progress call instead, never later
    /// than the clock.
    pub fn run_quiet<R>(&self, f: impl FnOnce(&mut State, Instant) -> R) -> R {
        let mut st = self.lock();
        self.app_returns(&mut st, false);
        let then = Instant::from_nanos(self.app_progress.load(Ordering::Relaxed));
        let r = f(&mut st, then);
        self.dispatch_events(&mut st);
        r
    }

    /// Run `f` on the engine, then send what it produced and dispatch notifications. What a poll
    /// left owed goes first: `f` may change a QP's state (an error state drops its queued ACKs).
    pub fn run<R>(&self, f: impl FnOnce(&mut State, Instant) -> R) -> R {
        let mut st = self.lock();
        self.app_returns(&mut st, false);
        let now = self.now();
        self.flush_owed(&mut st, now);
        let r = f(&mut st, now);
        self.flush(&mut st, now);
        r
    }

    /// Run a post `f` to QP `qpn`, then send what it produced, unless the engine lets it wait
    /// (`Hca::cork`): the QP has packets unacknowledged, so their ACK comes about a round trip
    /// later, and the progress that handles it (a polling thread, or the I/O thread) sends what
    /// waited, many small messages in one `sendmmsg`; the engine's cork timer bounds the wait
    /// (`Config::CORK_WAIT`) should that ACK be lost. Not while a same-host lane is up: a lane
    /// costs no system call per packet, so waiting would only add latency. `f` also says whether
    /// it already tried to send the QP's next packet ahead itself (see [`Device::post_send`]); if
    /// not, that is tried after it (see [`Device::send_ahead`]).
    pub fn run_post<R>(&self, qpn: softrdma_wire::Qpn, f: impl FnOnce(&mut State, Instant) -> (R, bool)) -> R {
        self.run_post_early(qpn, false, f)
    }

    /// [`Device::run_post`]; `early`: while a same-host lane is up, `f` is given the time of the
    /// application's last progress call (its poll, normally a moment before) rather than the
    /// clock's, and the clock is read once `f` has sent the post's packet ahead: what the packet
    /// started at that time (its RTT sample, the retransmit timer) is moved to the clock's
    /// (`Hca::restamp`). Reading the clock first cost a same-host `send-lat` 0.025-0.03 µs a hop.
    fn run_post_early<R>(
        &self,
        qpn: softrdma_wire::Qpn,
        early: bool,
        f: impl FnOnce(&mut State, Instant) -> (R, bool),
    ) -> R {
        let mut st = self.lock();
        self.app_returns(&mut st, false);
        let early = early && st.may_send_ahead();
        let then = if early { Instant::from_nanos(self.app_progress.load(Ordering::Relaxed)) } else { self.now() };
        let direct = st.hca.direct_executed();
        let (r, ahead) = f(&mut st, then);
        let now = if early {
            let now = self.now();
            st.hca.restamp(qpn, then, now);
            now
        } else {
            then
        };
        let direct = st.hca.direct_executed() - direct;
        if direct > 0 {
            st.link.executed_directly(now, direct);
        }
        if !st.flush_owed && !st.link.has_outbound_lane() && st.hca.cork(qpn, now) {
            st.corked += 1;
            self.dispatch(&mut st);
        } else {
            if !ahead {
                self.send_ahead(&mut st, now, qpn);
            }
            self.flush(&mut st, now);
        }
        r
    }

    /// Post one send work request `wr` to QP `qpn` and send what it produced (as
    /// [`Device::run_post`]). Where [`Device::send_ahead`] would send the QP's next packet ahead,
    /// the engine builds it in the same call as the post (`Hca::post_send_ahead`): one lookup of
    /// the QP instead of three.
    ///
    /// A small message's packet is built in a buffer of the device's and copied into the lane's
    /// slot at once, rather than built in the slot: the peer's poller reads the slot's first cache
    /// line while it waits, so a slot written piece by piece during the build (headers, payload,
    /// length, tag) had that line taken back by the reader between the pieces, each time a
    /// transfer between the cores. Copying at once takes it over once (~4 % off a same-host
    /// ping-pong). A large payload is still built in place (one copy per byte).
    pub fn post_send(&self, qpn: softrdma_wire::Qpn, wr: SendWr) -> std::result::Result<(), VerbsError> {
        self.run_post_early(qpn, true, |st, now| {
            if !st.may_send_ahead() {
                return (st.hca.post_send(qpn, wr, now, &mut st.mem), false);
            }
            let State { hca, mem, link, tx_peer, tx_errors, ahead_buf, .. } = st;
            let peer = *tx_peer;
            let mut lane = None;
            let lane_out = &mut lane;
            if wr.op.is_read_or_atomic() || wr.payload.byte_len() <= AHEAD_COPY_MAX {
                let l = &mut *link;
                let built = hca.post_send_ahead(qpn, wr, now, mem, move |dgid| {
                    *lane_out = Some(lane_ahead(l, peer, dgid, now)?);
                    l.slot_ahead((*lane_out)?)?;
                    Some(&mut ahead_buf[..])
                });
                match (built, lane) {
                    (Ok(Some((t, buf))), Some(li)) => {
                        if fill_ahead(mem, tx_errors, &t, buf) {
                            link.push(li, &buf[..t.len]);
                        }
                        (Ok(()), true)
                    }
                    // A refused request built nothing: the QP's next packet may still go ahead.
                    (Err(e), _) => (Err(e), false),
                    (Ok(_), _) => (Ok(()), true),
                }
            } else {
                let l = &mut *link;
                let built = hca.post_send_ahead(qpn, wr, now, mem, move |dgid| {
                    *lane_out = Some(lane_ahead(l, peer, dgid, now)?);
                    Link::slot_ahead(l, (*lane_out)?)
                });
                match (built, lane) {
                    (Ok(Some((t, buf))), Some(li)) => {
                        if fill_ahead(mem, tx_errors, &t, buf) {
                            link.publish(li, t.len);
                        }
                        (Ok(()), true)
                    }
                    (Err(e), _) => (Err(e), false),
                    (Ok(_), _) => (Ok(()), true),
                }
            }
        })
    }

    /// After a post to QP `qpn`, before the flush: the QP's next packet (normally the request just
    /// posted; a retransmission or a response the QP owes if that comes first in the QP's own
    /// order) leaves at once when the QP's peer is the one the last packet went to and a
    /// same-host lane leads there. It is built straight into the lane's ring, ahead of the
    /// flush's preparations and of the rest of the transmit list (the ACK a poll left owed, other
    /// QPs' packets, whose order stays as it was): in a request-response exchange the peer waits
    /// for this request and for nothing else (about 300 instructions sooner on each hop). Not in
    /// daemon mode, which attributes each packet to its QP in the flush.
    fn send_ahead(&self, st: &mut State, now: Instant, qpn: softrdma_wire::Qpn) {
        if !st.may_send_ahead() {
            return;
        }
        let State { hca, mem, link, tx_peer, tx_errors, .. } = &mut *st;
        let Some(dgid) = hca.peer_gid(qpn) else { return };
        let Some(li) = lane_ahead(link, *tx_peer, dgid, now) else { return };
        let Some(buf) = link.slot_ahead(li) else { return };
        let Some(t) = hca.poll_transmit_qp(qpn, now, mem, buf) else { return };
        if fill_ahead(mem, tx_errors, &t, buf) {
            link.publish(li, t.len);
        }
    }

    /// Modify QP `qpn` (as `Hca::modify_qp`). A connected QP that gets its path (INIT to RTR)
    /// has the same-host lane to its peer tried now rather than by its first packet, which would
    /// otherwise wait for the connection and for the ring's pages (see same_host.rs; ~2-3 ms once
    /// per lane on this VM, while the peer polls). A peer that is not a softrdma device on this
    /// host costs one refused connect, cached for a second (`Link::lane_for`), as its first
    /// packet's attempt did.
    pub fn modify_qp(
        &self,
        st: &mut State,
        qpn: softrdma_wire::Qpn,
        attr: &ModifyQp,
        now: Instant,
    ) -> std::result::Result<(), VerbsError> {
        st.hca.modify_qp(qpn, attr, now, &mut st.mem)?;
        if attr.state == Some(QpState::Rtr) {
            let addrs = st.hca.peer_gid(qpn).and_then(|dgid| self.addrs_for(dgid));
            if let Some((dst, src)) = addrs.filter(|(dst, src)| dst != src) {
                st.link.lane_for(dst, src, now);
            }
        }
        Ok(())
    }

    /// Where packets for the port with GID `dgid` go (its address at our RoCE UDP port) and the
    /// address of ours they leave from; `None` if no socket of ours has that address family.
    fn addrs_for(&self, dgid: [u8; 16]) -> Option<(SocketAddr, SocketAddr)> {
        let dst = SocketAddr::new(Gid(dgid).to_ip(), self.port.port());
        Some((dst, self.port.local_for(&dst)?))
    }

    /// Send what a poll left owed (see [`Device::poll_progress`]), if anything.
    pub(crate) fn flush_owed(&self, st: &mut State, now: Instant) {
        if st.flush_owed {
            self.flush(st, now);
        }
    }

    /// Send every packet the engine has, and hand out completion and async events.
    pub(crate) fn flush(&self, st: &mut State, now: Instant) {
        // Packets go out in batches of up to udp::BATCH per sendmmsg, each built in its own slot of
        // the transmit buffer. Consecutive packets of one size to one peer go as one UDP GSO send
        // (a multi-packet message's middle and last packets, for instance); the kernel numbers the
        // IPv4 identifications of the segments 0, 1, 2, ..., so packet k of a group is sealed for
        // identification k.
        //
        // A packet for another softrdma device on this host goes on its same-host lane instead
        // (see same_host.rs), unsealed. The engine builds each packet straight into the free slot
        // of the lane the previous packet went to: a burst goes to one peer, so the payload is
        // copied once, from registered memory into the ring. When the guess is wrong the packet is
        // copied to where it belongs (the transmit slot, or another lane).
        //
        // A packet for this device itself (one of its QPs to another) goes nowhere: it stays in its
        // slot and is handed to the device's own receive side once the batch is built
        // (loopback.rs), and what that produces is built in the next batch.
        //
        // First the CM's MADs; those to this device itself are handed to its CM at once, and what
        // that makes it say is drained in the next round.
        st.flush_owed = false;
        st.link.flush_starts();
        // Writes to daemon clients' memory kept behind are made before any packet leaves
        // (client_io.rs): here before the CM's or a parked packet; before the engine's, per batch
        // below. A flush that sends nothing leaves them to softrdmad's pass, which makes them
        // after it has published the completions that wait for them (`Ring::writes_made`).
        if st.cm.agent.has_output() || st.link.congested() {
            st.mem.write_pending();
        }
        // (Skipped, not drained empty, when the CM has nothing: this comes before the packets,
        // on the path from a request to its ACK, and an empty drain cost a same-host hop 0.02 µs.)
        for round in 0..CM_LOOP_ROUNDS {
            if !st.cm.agent.has_output() {
                break;
            }
            let mut to_self: Vec<(Vec<u8>, SocketAddr)> = Vec::new();
            let State { cm, hca, mem, link, tx_errors, .. } = &mut *st;
            let errored = cm.drain(hca, mem, now, |dgid, pkt| {
                let sent = self.addrs_for(dgid).is_some_and(|(dst, src)| {
                    if src == dst && link.loops_back() {
                        to_self.push((pkt.to_vec(), dst));
                        return true;
                    }
                    match link.lane_for(dst, src, now) {
                        Some(li) => link.push(li, pkt),
                        None => seal_udp_payload(src, dst, pkt).is_ok() && self.port.send_to(pkt, dst).is_ok(),
                    }
                });
                if !sent {
                    *tx_errors += 1;
                }
            });
            if errored {
                // The QP's buffers are its application's again (as after a destroy).
                mem.make_all_placements();
            }
            if to_self.is_empty() {
                break;
            }
            for (mut pkt, addr) in to_self {
                st.link.looped(now, false);
                // Nothing deferred to copy: cannot fail.
                let _ = loopback::hand_over(&mut st.receiver(), now, &mut pkt, None, addr);
            }
            if round + 1 == CM_LOOP_ROUNDS {
                // What the last round made the CM say waits for the next flush, which comes soon.
                st.link.loop_budget_used();
            }
        }
        let State { cm, hca, mem, tx_buf, tx_meta, tx_self, tx_icrc, tx_peer, tx_errors, qp_traffic, link, .. } =
            &mut *st;
        // Busy polling calls this on every empty poll: nothing is set up while the engine has
        // nothing to send, and the UDP batch only when a packet goes to UDP. A lane whose ring is
        // full stops the building: the packets stay in the engine until the receiver made room.
        let mut congested = link.flush_pending();
        let mut loop_batches = 0;
        while hca.has_transmit() && !congested {
            // What the last batch's packets to this device itself wrote, before this batch leaves;
            // then what the READ responses owed now read from daemon clients' memory, read ahead
            // (client_io.rs).
            mem.write_pending();
            if mem.has_process_regions() {
                // Only the first QPs in turn can send in one batch.
                mem.prefetch_owed_reads(hca.owed_reads(udp::BATCH));
            }
            // (length, destination, source, transmit slot) of the packets for UDP.
            tx_meta.clear();
            // Per UDP packet (entry j of `tx_meta`): where its deferred payload is, if it stayed in
            // registered memory. Set up with the first such packet only: the flush runs once per
            // post, and small messages and same-host traffic have none.
            let mut in_place: Option<[Option<InPlace>; udp::BATCH]> = None;
            let mut n = 0;
            for (i, slot) in tx_buf.chunks_exact_mut(TX_SLOT).enumerate() {
                // A QP leaves the engine's transmit list with its last packet: once the list is
                // empty there is nothing to ask for.
                if congested || !hca.has_transmit() {
                    break;
                }
                // Daemon mode attributes engine counters and packets to QPs (packets when built:
                // a batch's send errors are not attributed).
                if let Some(table) = qp_traffic.as_mut() {
                    table.begin(hca.counters());
                }
                let (t, built_in) = match link.spec_slot() {
                    Some((li, buf)) => {
                        let Some(t) = hca.poll_transmit(now, &mut *mem, buf) else { break };
                        // A deferred payload is copied into the ring slot: one copy on a lane.
                        if let Some(d) = &t.deferred {
                            if mem.fill(d, &mut buf[..t.len]).is_err() {
                                // The engine checked the keys under this lock: cannot happen.
                                *tx_errors += 1;
                                n += 1;
                                continue;
                            }
                        }
                        (t, Some(li))
                    }
                    None => {
                        let Some(t) = hca.poll_transmit(now, &mut *mem, slot) else { break };
                        (t, None)
                    }
                };
                n += 1;
                if let Some(q) = qp_traffic.as_mut().and_then(|m| m.end(t.src_qpn, hca.counters())) {
                    q.pkts[0] += 1;
                    q.pkts[1] += t.len as u64;
                }
                // A burst goes to one peer: its addresses are worked out when the peer changes.
                let (dst, src) = match *tx_peer {
                    Some((dgid, dst, src)) if dgid == t.av.dgid => (dst, src),
                    _ => {
                        let Some((dst, src)) = self.addrs_for(t.av.dgid) else {
                            *tx_errors += 1;
                            continue;
                        };
                        *tx_peer = Some((t.av.dgid, dst, src));
                        (dst, src)
                    }
                };
                // A packet for this device itself stays in its slot and is taken in when the
                // batch is built (loopback.rs): several requests, then one ACK for them.
                if dst == src && link.loops_back() {
                    let deferred = match built_in {
                        // Built in a lane's ring, its payload copied there: moved out whole.
                        Some(bi) => {
                            link.copy_unpublished(bi, &mut slot[..t.len]);
                            None
                        }
                        None => t.deferred,
                    };
                    link.clear_spec();
                    tx_self.push((i, t.len, deferred, dst));
                    continue;
                }
                // A deferred payload (`Config::defer_payload_min`) stays in registered memory when
                // the packet goes to UDP (`sendmsg` gathers it from there); on a lane it is copied
                // into the packet (into the ring slot when the engine built it there, above).
                let lane = link.lane_for(dst, src, now);
                if let (Some(d), None) = (&t.deferred, built_in) {
                    let resolved = match lane {
                        Some(_) => mem.fill(d, &mut slot[..t.len]),
                        // Written where the batch keeps it (an `InPlace` is too large to move
                        // around per packet).
                        None => mem.in_place(d, slot, &mut in_place.get_or_insert([None; udp::BATCH])[tx_meta.len()]),
                    };
                    // The engine checked the keys under this lock: cannot happen.
                    if resolved.is_err() {
                        *tx_errors += 1;
                        continue;
                    }
                }
                match (lane, built_in) {
                    (Some(li), Some(bi)) if li == bi => link.publish(li, t.len),
                    (Some(li), _) => {
                        if let Some(bi) = built_in {
                            link.copy_unpublished(bi, &mut slot[..t.len]);
                        }
                        // A full ring keeps the packet aside and stops the building.
                        link.push(li, &slot[..t.len]);
                        congested = link.congested();
                    }
                    (None, _) => {
                        if let Some(bi) = built_in {
                            link.copy_unpublished(bi, &mut slot[..t.len]);
                        }
                        link.clear_spec();
                        tx_meta.push((t.len, dst, src, i));
                    }
                }
            }
            if !tx_meta.is_empty() {
                *tx_errors += self.send_udp(tx_buf, tx_meta, tx_icrc, in_place.as_ref().map(|a| &a[..]));
            }
            let looped = !tx_self.is_empty();
            for (i, len, deferred, addr) in tx_self.drain(..) {
                let pkt = &mut tx_buf[i * TX_SLOT..i * TX_SLOT + len];
                let mut to = Receiver { cm, hca, mem, qp_traffic };
                match loopback::hand_over(&mut to, now, pkt, deferred.as_ref(), addr) {
                    Ok(how) => link.looped(now, how == loopback::Looped::Placed),
                    // The engine checked the keys under this lock: cannot happen.
                    Err(_) => *tx_errors += 1,
                }
            }
            // What the device said to itself may have made more to send (ACKs, replies), up to a
            // budget per flush.
            if looped {
                loop_batches += 1;
                if loop_batches == LOOP_BATCHES {
                    link.loop_budget_used();
                    break;
                }
            } else if n < udp::BATCH {
                break;
            }
        }
        // Nothing is read ahead for what arrives after this flush.
        mem.forget_owed_reads();
        link.ring_doorbells();
        self.dispatch(st);
    }

    /// Hand out completion and async events, and wake the I/O thread for an earlier deadline.
    fn dispatch(&self, st: &mut State) {
        self.dispatch_events(st);
        if let Some(t) = st.next_deadline() {
            if st.io_wake_at.is_none_or(|w| t < w) {
                // Recorded so that one earlier deadline costs one wake-up, however many calls
                // see it before the I/O thread runs.
                st.io_wake_at = Some(t);
                let _ = self.wake();
            }
        }
    }

    /// Hand out completion and async events ([`Device::dispatch`] for a call that armed no timer).
    fn dispatch_events(&self, st: &mut State) {
        while let Some(cq) = st.hca.poll_cq_event() {
            if let Some(ch) = st.channels.get(&cq) {
                ch.notify(cq);
            }
        }
        while let Some(ev) = st.hca.poll_event() {
            self.post_async(st, ev);
        }
    }

    /// Seal and send the packets `meta` lists (length, destination, source, slot of `tx_buf`) with
    /// as few system calls as GSO and `sendmmsg` allow (`icrc` keeps the pseudo-header's CRC);
    /// `in_place[j]` says where packet j's payload is when it stayed in registered memory (`None`:
    /// no packet's did). Returns how many were refused.
    fn send_udp(
        &self,
        tx_buf: &mut [u8],
        meta: &[(usize, SocketAddr, SocketAddr, usize)],
        icrc: &mut IcrcCache,
        in_place: Option<&[Option<InPlace>]>,
    ) -> u64 {
        let k = meta.len();
        let in_place = |j: usize| in_place.and_then(|a| a[j].as_ref());
        let mut groups = [(0usize, 0usize); udp::BATCH];
        let ng = if self.port.gso() {
            let mut lens = [(0usize, SocketAddr::from(([0, 0, 0, 0], 0))); udp::BATCH];
            for (l, m) in lens.iter_mut().zip(meta) {
                *l = (m.0, m.1);
            }
            udp::gso_groups(&lens[..k], &mut groups)
        } else {
            for (i, g) in groups.iter_mut().enumerate().take(k) {
                *g = (i, i + 1);
            }
            k
        };
        let mut bad = 0;
        // Packets of one length between one pair of addresses (a GSO group, a burst of small
        // messages) share the ICRC's pseudo-header: its CRC is computed once per run of them.
        for &(a, b) in &groups[..ng] {
            // A group goes to one destination (from one source); only its last packet may be
            // shorter (the cache then builds the sealer for its length).
            for (j, &(len, dst, src, slot)) in meta.iter().enumerate().take(b).skip(a) {
                let pkt = &mut tx_buf[slot * TX_SLOT..][..len];
                let ident = (j - a) as u16;
                let sealed = icrc.sealer(src, dst, len).and_then(|s| match in_place(j) {
                    None => s.seal(pkt, ident),
                    Some(ip) => {
                        let (mut parts, np) = ip.parts(pkt);
                        // The ICRC covers everything before its own four bytes.
                        parts[np - 1] = &parts[np - 1][..parts[np - 1].len() - ICRC_LEN];
                        s.icrc_parts(&parts[..np], ident).and_then(|crc| softrdma_wire::icrc::store(pkt, crc))
                    }
                });
                if sealed.is_err() {
                    bad += 1;
                }
            }
        }
        let mut pkts = [udp::Datagram::one(&[], SocketAddr::from(([0, 0, 0, 0], 0))); udp::BATCH];
        for (j, (p, &(len, dst, _, slot))) in pkts.iter_mut().zip(meta).enumerate() {
            let pkt = &tx_buf[slot * TX_SLOT..][..len];
            *p = match in_place(j) {
                None => udp::Datagram::one(pkt, dst),
                Some(ip) => {
                    let (parts, n) = ip.parts(pkt);
                    udp::Datagram { parts, n, dst }
                }
            };
        }
        // A packet that could not be sealed is sent anyway (the peer drops it, the transport
        // retransmits) so the groups stay intact; it cannot happen for packets the engine built.
        bad + self.port.send_batch(&pkts[..k], &groups[..ng]) as u64
    }

    /// Queue an async event for the application and wake whoever waits for one.
    fn post_async(&self, st: &mut State, ev: AsyncEvent) {
        st.async_events.push_back(ev);
        let _ = self.async_tx.send(&[1]);
        self.async_cv.notify_all();
    }

    /// Follow the netdev's link: down raises `PortError(1)` (IBV_EVENT_PORT_ERR), up again
    /// `PortActive(1)`, as rxe does when its netdev goes down or up.
    fn watch_link(&self, port_up: &mut bool) {
        let nd = softrdma_device::netdev::by_name(&self.info.netdev.name).ok();
        let up = nd.as_ref().is_some_and(|n| n.is_link_up());
        // The CM follows the link and the netdev's addresses (its GIDs) as well.
        self.lock().cm.follow_netdev(up, nd.as_ref().map(|n| move |ip| n.owns(ip)));
        if up != *port_up {
            *port_up = up;
            let ev = if up { AsyncEvent::PortActive(1) } else { AsyncEvent::PortError(1) };
            self.post_async(&mut self.lock(), ev);
        }
    }

    /// Wait up to `timeout` for an async event.
    pub fn wait_async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        let st = self.lock();
        let (mut st, _) =
            self.async_cv.wait_timeout_while(st, timeout, |s| s.async_events.is_empty()).expect("device lock poisoned");
        let ev = st.async_events.pop_front();
        if ev.is_some() {
            let mut b = [0u8; 1];
            let _ = self.async_rx.recv(&mut b);
        }
        ev
    }

    /// A file descriptor readable while async events are pending.
    pub fn async_event_fd(&self) -> std::os::fd::RawFd {
        self.async_rx.as_raw_fd()
    }

    /// Attach QP `qpn` to multicast group `mgid`: the engine's attachment, and the group's socket
    /// when this is the device's first QP in the group (the I/O thread is woken to listen on it).
    pub fn attach_mcast(&self, qpn: softrdma_wire::Qpn, mgid: [u8; 16]) -> Result<()> {
        let mut st = self.lock();
        let st = &mut *st;
        st.hca.attach_mcast(qpn, mgid)?;
        let family = SocketAddr::new(Gid(mgid).to_ip(), self.port.port());
        let local_ip = self.port.local_for(&family).map(|a| a.ip());
        if let Err(e) = st.groups.join(mgid, local_ip, self.info.netdev.index, self.port.port()) {
            // No socket means the group was new to the device: the attachment just made is its
            // only one.
            let _ = st.hca.detach_mcast(qpn, mgid);
            return Err(e);
        }
        let _ = self.wake();
        Ok(())
    }

    /// Detach QP `qpn` from multicast group `mgid`; the group's socket closes with its last QP.
    pub fn detach_mcast(&self, qpn: softrdma_wire::Qpn, mgid: [u8; 16]) -> Result<()> {
        let mut st = self.lock();
        st.hca.detach_mcast(qpn, mgid)?;
        st.forget_left_groups();
        Ok(())
    }

    /// One received datagram.
    fn receive(&self, st: &mut State, now: Instant, payload: &[u8], src: SocketAddr, local: SocketAddr, ident: u16) {
        let counters = st.hca.counters_mut();
        match st.rx_icrc.verify(src, local, payload, ident) {
            Err(_) => counters.count_malformed(),
            Ok((_, UdpVerdict::Bad)) => {
                counters.rcvd_pkts += 1;
                st.verify.record(UdpVerdict::Bad);
            }
            Ok((ib, verdict)) => {
                st.verify.record(verdict);
                st.receiver().deliver(now, payload, &ib, src, local);
            }
        }
    }

    /// What one receive slot holds: a datagram, or a GRO batch (`seg` the segment size), several
    /// datagrams back to back, each `seg` bytes but the last: segment k of a GSO send
    /// (identification k). Returns the size the slot was split at.
    fn receive_slot(
        &self,
        st: &mut State,
        now: Instant,
        data: &[u8],
        seg: Option<u16>,
        src: SocketAddr,
        local: SocketAddr,
    ) -> usize {
        let seg = seg.map_or(data.len(), usize::from).max(1);
        for (k, d) in data.chunks(seg).enumerate() {
            self.receive(st, now, d, src, local, k as u16);
        }
        seg
    }

    /// One packet from a same-host lane: as a datagram from `src` to `local`, without the ICRC
    /// check (shared memory does not corrupt it; the sender did not compute it).
    fn receive_local(&self, st: &mut State, now: Instant, payload: &[u8], src: SocketAddr, local: SocketAddr) {
        match IbPacket::new_checked(payload) {
            Err(_) => st.hca.counters_mut().count_malformed(),
            Ok(ib) => st.receiver().deliver(now, payload, &ib, src, local),
        }
    }

    /// Receive what is waiting on the sockets, fire due timers, send what that produced. Called by
    /// a thread polling an empty CQ (busy polling then makes progress itself instead of waiting for
    /// the I/O thread to be scheduled); the I/O thread then stays out of its way (see `io_loop`).
    pub fn progress(&self, st: &mut State) {
        let now = self.now();
        self.app_progress.store(now.as_nanos(), Ordering::Relaxed);
        self.progress_at(st, now, false);
    }

    /// [`Device::progress`] for a thread busy polling an embedded device's CQ `cq`, found empty:
    /// when no packet arrived and no timer fired the engine is as the last flush left it (every
    /// verbs call that changes it flushes on its way out, see [`Device::run`], except a corked
    /// post, whose packets wait for an ACK or the cork timer, both work here:
    /// [`Device::run_post`], and a poll that left a flush owed, see below), so the flush is
    /// skipped. That keeps an empty poll to a clock read, a look at each lane's next tag and the
    /// timer check.
    /// (Reading the clock only every 32nd empty poll made the same-host ping-pong slower, not
    /// faster: see docs/PERFORMANCE.md.)
    ///
    /// When what arrived completed one receive on `cq` (a request of a request-response exchange;
    /// a stream completes many at once), or nothing on it at all (an RDMA WRITE that changed
    /// memory the thread watches, as a `write-lat` peer does; or traffic of other QPs, an ACK, a
    /// timer, which then wait a poll too), and made the engine owe packets (the request's ACK) but
    /// no READ response (whose data is read from memory as it is built), the completions go to
    /// the polling thread first and the flush waits: the thread's next post sends the ACK after
    /// the post's own packets (`Qp::poll_transmit` lets a request go before a plain ACK), so the
    /// reply leaves before the ACK of the request it answers (over UDP, in one `sendmmsg`, instead
    /// of an ACK's `sendmsg` first). The next flush comes with the thread's next post or poll of
    /// an empty CQ (before it receives), a [`Device::run`] call (a QP's modification, before it),
    /// the QP's destruction, the device's closing, the process's exit, or the I/O thread: a poll
    /// leaves a flush owed only while that thread stands aside for the polling thread, and it
    /// flushes once no poll came for [`BUSY_WINDOW`], checked every [`BUSY_SLEEP`]. Only one poll
    /// in a row: the next poll flushes.
    ///
    /// Only for what came over UDP: there the ACK's own `sendmsg` would stand between the request
    /// and the reply. What came through same-host lanes is flushed at once (an ACK there costs no
    /// system call, and a peer that waits for its send's completion before it goes on, as
    /// perftest's latency tests do, gets the ACK before the reply instead of after it: same-host
    /// `send-lat` 0.63 → 0.58 µs, rdma-core's `ib_send_lat` 0.86 → 0.69 µs).
    ///
    /// A poll that finds nothing puts the polling thread's CPU into the device's outbound lanes,
    /// for the peers' pollers. If a peer's poller runs on this CPU, one of the two threads moves
    /// to another CPU (see poller.rs); when this one does not, the poll says so and the caller
    /// gives up the core at once (see [`Device::poll_empty`]).
    /// Returns the clock reading, whether anything happened, and whether a peer's poller shares
    /// this thread's CPU.
    pub fn poll_progress(&self, st: &mut State, cq: CqId) -> (Instant, bool, bool) {
        let now = self.now();
        self.app_progress.store(now.as_nanos(), Ordering::Relaxed);
        // What the last poll left owed goes before what arrives now can change a QP's state (an
        // error state drops queued ACKs).
        self.flush_owed(st, now);
        let work = self.receive_at(st, now, false, Some(cq));
        if work
            && st.rx_udp_now
            && st.hca.has_transmit()
            && self.io_aside.load(Ordering::Relaxed)
            && st.hca.cq_awaits_one(cq)
            && !st.hca.owes_read_response()
        {
            st.flush_owed = true;
            st.flushes_left_owed += 1;
            self.dispatch(st);
        } else if work || st.link.congested() {
            self.flush(st, now);
        }
        // The thread's CPU is asked (`sched_getcpu`, ~15 ns) and said by the polls that find
        // nothing, and now and then by one that found work: a poll that found work is on an
        // exchange's critical path, and a busy poller makes many empty ones. Of two pollers
        // sharing a CPU, one moves to another (poller.rs); the other yields.
        let mut shared = false;
        if !work || poller::busy_poll_says() {
            if let Some((cpu, id)) = poller::this_cpu().map(|cpu| (cpu, poller::this_id())) {
                st.link.poller_at(Some((cpu, id)));
                let peer = if work { None } else { st.link.peer_poller_on(cpu, id) };
                match peer {
                    Some(peer) if poller::shared_with(peer, cpu, id, now.as_nanos().wrapping_add(self.epoch)) => {
                        st.link.stats.poller_moves += 1;
                        st.link.poller_at(poller::this_cpu().map(|cpu| (cpu, id)));
                    }
                    Some(_) => {
                        st.link.stats.poller_yields += 1;
                        shared = true;
                    }
                    None => {}
                }
            }
        }
        (now, work, shared)
    }

    /// An application thread is back (`polling`: with a poll; else a post or another verb): the
    /// device a poll left armed is disarmed (see [`Device::poll_leaves`]).
    #[inline]
    pub fn app_returns(&self, st: &mut State, polling: bool) {
        if self.app_armed.load(Ordering::Relaxed) {
            self.app_armed.store(false, Ordering::Relaxed);
            // Only while the I/O thread stands aside: in its own sleep it asked for the doorbells
            // itself and must go on hearing them (cancelled, a packet would wait for its timer).
            if self.io_aside.load(Ordering::Relaxed) {
                st.link.sleep_done();
            }
            if st.arm_used {
                (st.lane_credit, st.wake_credit) = (ARM_CREDIT, ARM_CREDIT);
            } else {
                st.wake_credit = st.wake_credit.saturating_sub(1);
                if polling {
                    st.lane_credit = st.lane_credit.saturating_sub(1);
                }
            }
            st.arm_used = false;
        }
    }

    /// A poll of `cq` hands out the completions `wcs`. If they are all of sends of QPs with no
    /// receive posted, at least one a SEND or an RDMA WRITE (a READ or an atomic brings its
    /// answer with it), that left the CQ empty and no RC send is pending, the application may now
    /// wait for something no poll sees (one that waits for a message polls for it: a
    /// request-response exchange is left alone, whose peer would otherwise ring between the
    /// request and the reply, and which would pay for the arming on every message): perftest's
    /// write latency loop spins on the byte the peer's RDMA WRITE changes, and until its next
    /// post nobody would take that WRITE in but the I/O thread, which looks only every
    /// [`BUSY_SLEEP`] while a thread polls (~0.3 ms a hop). So the device is armed: the inbound
    /// lanes are asked for doorbells, which wake the I/O thread (see `io_loop`; each of its sleeps
    /// asks again while the application is away), and with no lane the I/O thread is woken so that
    /// its sleep watches the UDP sockets. The application's next poll or post disarms. Entries
    /// already waiting in a lane are taken in now.
    ///
    /// Arming has a cost when the application comes back at once. Doorbell requests cost the
    /// peer's publish a cache-line transfer and sometimes a system call: for nothing when the
    /// application polls while it waits (`softrdma perf write-lat`'s loop, +5-15 %); so they stop
    /// after [`ARM_CREDIT`] armings in a row that a poll ended before the I/O thread took over
    /// (`State::lane_credit`; a post ending them says nothing: `ib_write_lat` posts as soon as the
    /// peer's WRITE was taken in with its own ACK). A wake-up costs this thread a system call,
    /// for nothing when a bandwidth loop whose window drained posts again at once (-4 % of the UDP
    /// 64 B WRITE rate); so it stops after as many armings ended by any call
    /// (`State::wake_credit`). One takeover restores both. Without them the I/O thread finds the
    /// application away at its next look and arms then.
    pub fn poll_leaves(&self, st: &mut State, cq: CqId, wcs: &[WorkCompletion]) {
        // Cheapest first: a stream has sends pending, an exchange hands out receives, a READ or an
        // atomic hands the application what it asked for (it goes on with that; `read-lat` and
        // `atomic-lat` post again at once, and arming cost each of their round trips 0.1 µs);
        // the lookups last. (This thread's poll disarmed on its way in.)
        if wcs.is_empty()
            || st.hca.sends_pending()
            || wcs.iter().any(|wc| wc.opcode.is_receive())
            || !wcs.iter().any(|wc| matches!(wc.opcode, WcOpcode::Send | WcOpcode::RdmaWrite))
            || !st.hca.cq_is_empty(cq)
            || wcs.iter().any(|wc| st.hca.recvs_posted(wc.qp_num))
        {
            return;
        }
        self.app_armed.store(true, Ordering::Relaxed);
        st.link.stats.polls_left_armed += 1;
        if !st.link.has_inbound() {
            if st.wake_credit > 0 && self.io_aside.load(Ordering::Relaxed) {
                let _ = self.wake();
            }
            return;
        }
        if st.lane_credit == 0 {
            return;
        }
        for _ in 0..4 {
            if st.link.arm_inbound() {
                return;
            }
            let now = self.now();
            self.progress_at(st, now, false);
        }
    }

    /// A busy poll of this thread found completions or made progress (see [`Device::poll_empty`]).
    pub fn poll_found(&self) {
        EMPTY_SINCE.with(|since| since.set(0));
    }

    /// A busy poll of this thread, made at `now`, found nothing; called without the device lock.
    /// After [`YIELD_AFTER`] of such polls in a row the thread yields its core after each further
    /// one. Two busy pollers that wait for each other (the two sides of a benchmark, or of any
    /// exchange) and share one core (on a 2-core host, whenever a third thread is runnable) would
    /// otherwise each spin away its whole time slice (milliseconds) before the other can answer:
    /// 0.02–0.04 Mpps instead of 1–2 for 64-byte writes. With no other thread runnable on the core
    /// the yield returns at once.
    /// `peer_here`: the thread that should answer shares this thread's CPU (see
    /// [`Device::poll_progress`]): yield at once.
    pub fn poll_empty(&self, now: Instant, peer_here: bool) {
        // On the monotonic clock rather than this device's: a thread may poll several devices.
        let now = now.as_nanos().wrapping_add(self.epoch);
        let yield_now = EMPTY_SINCE.with(|since| {
            let (start, y) = empty_poll(since.get(), now);
            since.set(start);
            y
        });
        if yield_now || peer_here {
            // SAFETY: no arguments, no memory.
            unsafe { libc::sched_yield() };
        }
    }

    /// One round of progress. Same-host lanes come first: they cost no system call when empty.
    /// While a lane is up, the UDP sockets (one `recvmmsg` per empty poll, a microsecond or more
    /// that a busy-polling ping-pong would pay per iteration) are read only every [`UDP_EVERY`],
    /// or every time while they keep delivering, or when `full` (the I/O thread woke up): remote
    /// peers and UDP-only devices are slowed by at most that period, never starved.
    /// Returns whether anything happened (see [`Device::receive_at`]).
    fn progress_at(&self, st: &mut State, now: Instant, full: bool) -> bool {
        let work = self.receive_at(st, now, full, None);
        self.flush(st, now);
        work
    }

    /// The receiving half of [`Device::progress_at`]: lanes, sockets, timers. Returns whether
    /// anything happened (a packet, a timer, a lane opened or closed).
    ///
    /// `polled`: the CQ a polling thread found empty (see [`Device::poll_progress`]). In a
    /// request-response exchange the peer publishes its reply and then the ACK of our request, and
    /// taking that ACK in (completing our send) would only delay the reply's completion (or, for
    /// an RDMA WRITE, the thread's look at the memory it changed): an ACK right behind a request
    /// that was the first packet this call took waits for the next call when `polled` holds one
    /// receive completion or none (`Hca::cq_awaits_one`; a stream completes many, ACKs behind ACKs
    /// are all taken, and a two-way stream's call that took more goes on). A lane's first packet
    /// in a call is always taken, so no lane waits for more than one call, whatever the others
    /// carry.
    fn receive_at(&self, st: &mut State, now: Instant, full: bool, polled: Option<CqId>) -> bool {
        let mut work = st.link.maintain(now, full);
        if st.link.inbound_waiting() {
            let mut lanes = st.link.take_inbound();
            // RC's opcodes are the base opcodes: an ACK (or NAK) starts with ACKNOWLEDGE.
            let is_ack = |pkt: &[u8]| pkt.first() == Some(&softrdma_wire::opcode::base::ACKNOWLEDGE);
            // Packets this call took, and whether the last (from its lane: `taken` > 0) was no ACK.
            let (mut took, mut after_request) = (0, false);
            work |= lanes.receive(|pkt, src, local, taken| {
                let ack = is_ack(pkt);
                if taken > 0 && ack && after_request && took == 1 && polled.is_some_and(|cq| st.hca.cq_awaits_one(cq)) {
                    return false;
                }
                after_request = !ack;
                took += 1;
                self.receive_local(st, now, pkt, src, local);
                true
            }) > 0;
            st.link.put_inbound(lanes);
        }
        st.rx_udp_now = false;
        if full || st.udp_busy || now >= st.udp_due || !st.link.receives_locally(now) {
            st.udp_due = now + UDP_EVERY;
            st.udp_busy = self.receive_udp(st, now) > 0;
            st.rx_udp_now = st.udp_busy;
            work |= st.udp_busy;
        }
        if st.hca.poll_timeout().is_some_and(|t| t <= now) {
            st.hca.handle_timeout(now, &mut st.mem);
            work = true;
        }
        if st.cm.agent.poll_timeout().is_some_and(|t| t <= now) {
            st.cm.agent.handle_timeout(now);
            work = true;
        }
        work
    }

    /// Receive what waits on the UDP sockets; returns how many datagrams.
    fn receive_udp(&self, st: &mut State, now: Instant) -> usize {
        let mut got = 0;
        let mut buf = std::mem::take(&mut st.rx_buf);
        let mut meta = [None; udp::BATCH];
        // Receiving in place is on, and the regions are this process's (daemon mode attributes
        // traffic per QP on the copying path only): otherwise no hint is ever kept.
        let placing = self.rx_place && st.qp_traffic.is_none();
        for (sock, local) in self.port.sockets() {
            // Up to 256 datagrams per socket and call, udp::BATCH per recvmmsg.
            let mut budget = 256;
            while budget > 0 {
                // An RC WRITE in progress to a region of this process: receive its continuation in
                // place. A peek at the next datagram first (an empty poll costs that one call):
                // only one that starts as the WRITE's next packet is received along the plan.
                let plan = st.rx_hint.and_then(|qpn| Plan::new(&st.hca, &st.mem, qpn));
                let prev_hint = st.rx_hint.take();
                if let Some(plan) = &plan {
                    let mut head = [0u8; softrdma_wire::bth::BTH_LEN];
                    let r = match udp::peek(sock, &mut head) {
                        Ok((len, seg)) if plan.starts(&head, len, seg) => {
                            self.receive_placed(st, now, sock, *local, plan, &mut buf)
                        }
                        Ok(_) => Err(ErrorKind::InvalidData.into()),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(()) => {
                            got += 1;
                            break;
                        }
                        Err(e) if e.kind() == ErrorKind::InvalidData => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            st.rx_hint = prev_hint;
                            break;
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {
                            st.rx_hint = prev_hint;
                            continue;
                        }
                        Err(_) => break,
                    }
                }
                let want = if st.rx_single || plan.is_some() { 1 } else { udp::BATCH };
                match udp::recv_batch(sock, &mut buf, RX_SLOT, &mut meta[..want]) {
                    Ok(k) => {
                        got += k;
                        budget -= k.min(budget);
                        for (i, m) in meta.iter().take(k).enumerate() {
                            match m {
                                &Some((n, src, seg)) => {
                                    let data = &buf[i * RX_SLOT..i * RX_SLOT + n];
                                    let seg = self.receive_slot(st, now, data, seg, src, *local);
                                    if placing && i + 1 == k {
                                        st.rx_single = n >= RX_SINGLE_MIN;
                                        st.rx_hint = data.chunks(seg).last().and_then(place::write_hint);
                                    }
                                }
                                None => st.hca.counters_mut().count_malformed(),
                            }
                        }
                        // Another packet came between a WRITE's packets: its continuation may
                        // still come next.
                        if st.rx_hint.is_none() {
                            st.rx_hint = prev_hint.filter(|q| st.hca.rx_placement(*q).is_some());
                        }
                        // One large datagram at a time goes with a flush each: its ACK leaves
                        // before the next is taken (or with the next post, or before the next
                        // receive: see `poll_progress`), as after a batch that did not fill.
                        if k < want || want == 1 {
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // ICMP errors (peer port closed) surface here; the transport's timers handle
                    // a peer that went away.
                    Err(_) => break,
                }
            }
        }
        // Packets sent to a multicast group this device is a member of (up to 256 datagrams per
        // group and call, as above).
        let groups = std::mem::take(&mut st.groups);
        for (sock, local) in groups.sockets() {
            let mut budget = 256;
            while budget > 0 {
                let Ok(k) = udp::recv_batch(sock, &mut buf, RX_SLOT, &mut meta) else { break };
                got += k;
                budget -= k.min(budget);
                for (i, m) in meta.iter().take(k).enumerate() {
                    match m {
                        &Some((n, src, seg)) => {
                            self.receive_slot(st, now, &buf[i * RX_SLOT..i * RX_SLOT + n], seg, src, local);
                        }
                        None => st.hca.counters_mut().count_malformed(),
                    }
                }
                if k < meta.len() {
                    break;
                }
            }
        }
        st.groups = groups;
        st.rx_buf = buf;
        got
    }

    /// Receive the next datagram on `sock` along `plan` (see place.rs): the packets that match it
    /// go to the engine with their payload already in place, the others are copied out of the
    /// pieces and received as usual. `WouldBlock` when nothing is waiting.
    fn receive_placed(
        &self,
        st: &mut State,
        now: Instant,
        sock: &std::net::UdpSocket,
        local: SocketAddr,
        plan: &Plan,
        buf: &mut [u8],
    ) -> io::Result<()> {
        let (scratch, tmp) = buf.split_at_mut(place::SCRATCH + place::MAX_DATAGRAM);
        let scratch = scratch.as_mut_ptr();
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; place::MAX_IOV];
        let n = plan.iovecs(scratch, &mut iov);
        // SAFETY: the entries cover `scratch` (ours, not otherwise used during the call) and, for
        // the payloads, the range of the WRITE in progress in a region of this process, which stays
        // registered while we hold the device lock; why receiving into it before the ICRC is
        // checked is allowed is explained at `Plan::iovecs`.
        let meta = unsafe { udp::recv_iov(sock, &mut iov[..n]) }?;
        st.rx_single = true;
        st.rx_hint = None;
        let Some((len, src, seg)) = meta else {
            st.hca.counters_mut().count_malformed();
            return Ok(());
        };
        let seg = seg.map_or(len, usize::from).max(1);
        let mut at = 0;
        let mut k = 0;
        while at < len {
            let l = seg.min(len - at);
            let placed =
                plan.packet(scratch, k, at, l).is_some_and(|p| self.receive_one_placed(st, now, &p, src, local, k));
            if !placed {
                let d = &mut tmp[..l];
                // SAFETY: the datagram filled the pieces up to `len`; `tmp` is not among them.
                unsafe { place::copy_out(&iov[..n], at, d) };
                self.receive(st, now, d, src, local, k as u16);
                if at + l == len {
                    st.rx_hint = place::write_hint(d);
                }
            }
            at += l;
            k += 1;
        }
        if st.rx_hint.is_none() && st.hca.rx_placement(plan.qpn()).is_some() {
            st.rx_hint = Some(plan.qpn());
        }
        Ok(())
    }

    /// Packet `k` of a datagram received along a plan, if it is what the plan expected: verify its
    /// ICRC over the pieces (a full check for identification `k`: the payload is read once, where
    /// the kernel put it) and hand it to the engine as placed. `false` when it is not (the caller
    /// copies it out and receives it as usual, which also counts a bad ICRC).
    fn receive_one_placed(
        &self,
        st: &mut State,
        now: Instant,
        p: &place::Placed<'_>,
        src: SocketAddr,
        local: SocketAddr,
        k: usize,
    ) -> bool {
        let hdr = p.hdr();
        let Ok(ib) = IbPacket::new_checked(hdr) else { return false };
        if !ib.payload().is_empty() || !p.expect.is_next(&ib) {
            return false;
        }
        let bth_len = softrdma_wire::bth::BTH_LEN;
        let pad = &hdr[bth_len..hdr.len() - ICRC_LEN];
        let crc = st
            .rx_icrc
            .sealer(src, local, hdr.len() + p.payload.len())
            .and_then(|s| s.icrc_parts(&[&hdr[..bth_len], p.payload, pad], k as u16));
        if crc != Ok(ib.icrc()) {
            return false;
        }
        if !st.hca.handle_placed(now, &ib, &p.expect, p.payload.len(), &mut st.mem) {
            return false;
        }
        st.verify.record(UdpVerdict::Verified);
        st.rx_placed += 1;
        true
    }

    /// The I/O loop: receive, fire timers, send; until stopped.
    fn io_loop(&self) {
        let mut buf = [0u8; 64];
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut port_up = self.info.netdev.is_link_up();
        let mut link_checked = std::time::Instant::now();
        // Until when this thread polls instead of sleeping: IO_SPIN after the last work it did.
        let mut spin_until: Option<Instant> = None;
        // Until when it does not poll between packets (an application thread was found in).
        let mut quiet_until = Instant::ZERO;
        while !self.stop.load(Ordering::Acquire) {
            if link_checked.elapsed() >= IDLE_WAIT {
                link_checked = std::time::Instant::now();
                self.watch_link(&mut port_up);
            }
            // While an application thread busy-polls a CQ it drives the device itself; this thread
            // then sleeps (waking for its wake-up socket or every BUSY_SLEEP) instead of waking for
            // every datagram and competing for the cores and the lock. On a machine with as many
            // busy threads as cores that competition costs milliseconds of preemption.
            if self.app_polling() {
                self.io_aside.store(true, Ordering::Relaxed);
                if !self.aside_sleep(&mut fds, &mut buf) && self.app_polling() {
                    continue;
                }
            }
            // Before the lock: a poll that sees this thread aside under the lock may leave a
            // flush owed, which this thread then finds below.
            self.io_aside.store(false, Ordering::Relaxed);
            // Poll before sleeping: on a device no application thread calls into (the passive
            // side of RDMA READs, WRITEs and atomics: perftest's servers wait in a socket), this
            // thread keeps looking for IO_SPIN after it last found work. Asleep, each request
            // would cost the peer a doorbell and wait for this thread's wake-up on an idle vCPU:
            // `ib_read_lat` 29 µs a round trip instead of 0.9. An application thread that calls
            // in while this thread polls sends it back to sleeping between packets for APP_GONE:
            // two applications spinning in memory on two cores (`ib_write_lat`) leave no core to
            // spin on, and a woken thread gets one sooner; one that posts and polls all the time
            // (`write-bw -q 10000`, whose polls always find completions) would meet this thread
            // at the lock on every call (-30 % there).
            if let Some(until) = spin_until {
                let now = self.now();
                // The lock held means an application thread is in a call (a cheaper sign than a
                // count its every call would update).
                let st = self.state.try_lock();
                if st.is_err() {
                    quiet_until = now + APP_GONE;
                }
                if let (Ok(mut st), true) = (st, now < until && now >= quiet_until) {
                    // Looking now: nobody need wake this thread for a deadline.
                    st.io_wake_at = Some(now);
                    self.flush_owed(&mut st, now);
                    let work = self.progress_at(&mut st, now, false);
                    drop(st);
                    if work {
                        spin_until = Some(now + IO_SPIN);
                    } else {
                        // A look that found nothing gives the core away for a moment: the
                        // requester's polling thread may be waiting for this very core.
                        std::thread::yield_now();
                    }
                    continue;
                }
                spin_until = None;
            }
            let wait = {
                let mut st = self.lock();
                let now = self.now();
                let idle = now + IDLE_WAIT;
                let wake_at = st.next_deadline().map_or(idle, |at| at.min(idle));
                st.io_wake_at = Some(wake_at);
                fds.clear();
                let pfd = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                fds.extend(self.port.sockets().map(|(s, _)| pfd(s.as_raw_fd())));
                fds.extend(st.groups.sockets().map(|(s, _)| pfd(s.as_raw_fd())));
                fds.push(pfd(self.wake_rx.as_raw_fd()));
                // Lane entries already waiting: no sleep (but still one pass through ppoll, which
                // then returns at once, to keep one code path).
                if !st.link.sleep_prepare(&mut fds) || st.flush_owed {
                    Duration::ZERO
                } else if st.link.congested() {
                    // Nothing tells us when the receiver makes room: look again soon.
                    wake_at.saturating_since(now).min(crate::same_host::CONGESTED_WAIT)
                } else {
                    wake_at.saturating_since(now)
                }
            };
            let ts =
                libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
            // SAFETY: `fds` is a live array of pollfd of the length given; `ts` outlives the call.
            unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
            while self.wake_rx.recv(&mut buf).is_ok() {}
            let mut st = self.lock();
            st.link.sleep_done();
            // The application left armed and is still away: this is the takeover it armed for.
            if self.app_armed.load(Ordering::Relaxed) {
                st.arm_used = true;
            }
            // No thread polls now: the peers' pollers are told (they would yield for nobody).
            if !self.app_polling() {
                st.link.poller_at(None);
            }
            let now = self.now();
            // What a poll left owed goes before what arrives now can change a QP's state.
            self.flush_owed(&mut st, now);
            if self.progress_at(&mut st, now, true) && now >= quiet_until {
                spin_until = Some(now + IO_SPIN);
            }
        }
    }

    /// The I/O thread's sleep while an application thread busy-polls: up to [`BUSY_SLEEP`], or
    /// until a wake-up or a doorbell of an inbound lane (or its hang-up). A peer rings only a
    /// lane asked for one: the polling thread asks when it leaves ([`Device::poll_leaves`]), and
    /// while it is away this thread asks again before each sleep. True if the device needs
    /// progress now: a doorbell rang (or entries wait) while the application is away.
    fn aside_sleep(&self, fds: &mut Vec<libc::pollfd>, buf: &mut [u8]) -> bool {
        fds.clear();
        fds.push(libc::pollfd { fd: self.wake_rx.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        let ev = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        fds.extend(self.lane_fds.lock().expect("doorbell fds").iter().map(|&fd| ev(fd)));
        let lanes = fds.len();
        // Not the device lock unless the application is away: waiting for it behind a busy
        // application thread costs a futex sleep and wake-up (every BUSY_SLEEP: a tenth of a
        // 64 KiB WRITE stream's rate). A thread that holds it is back anyway. While it is away
        // the UDP sockets are watched too (a datagram for it would otherwise wait as long).
        if self.app_armed.load(Ordering::Relaxed) {
            if let Ok(mut st) = self.state.try_lock() {
                if self.app_armed.load(Ordering::Relaxed) && !st.link.arm_inbound() {
                    return true;
                }
            }
            fds.extend(self.port.sockets().map(|(s, _)| ev(s.as_raw_fd())));
        }
        let ts = libc::timespec { tv_sec: 0, tv_nsec: BUSY_SLEEP.as_nanos() as libc::c_long };
        // SAFETY: `fds` is a live array of pollfd of the length given; `ts` outlives the call.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        while self.wake_rx.recv(buf).is_ok() {}
        let rang = fds[1..lanes].iter().any(|f| f.revents != 0);
        if !rang && fds[lanes..].iter().all(|f| f.revents == 0) {
            return false;
        }
        // A doorbell (or a hang-up) is read; a datagram is left for the progress that follows.
        // Take over if the application is still away.
        if !rang && !self.app_armed.load(Ordering::Relaxed) {
            return false;
        }
        let mut st = self.lock();
        let now = self.now();
        st.link.maintain(now, true);
        let away = self.app_armed.load(Ordering::Relaxed);
        if away {
            st.link.stats.armed_wakeups += 1;
        }
        away
    }

    /// An application thread made progress within the last BUSY_WINDOW.
    fn app_polling(&self) -> bool {
        let last = self.app_progress.load(Ordering::Relaxed);
        last != 0 && self.now().as_nanos().saturating_sub(last) < BUSY_WINDOW.as_nanos() as u64
    }

    /// Wake the thread sleeping on [`Device::wake_fd`].
    pub(crate) fn wake(&self) -> io::Result<()> {
        self.wake_tx.send(&[1]).map(|_| ())
    }

    /// The descriptor a wake-up makes readable (the daemon's device loop polls it).
    pub(crate) fn wake_fd(&self) -> std::os::fd::RawFd {
        self.wake_rx.as_raw_fd()
    }

    /// Consume pending wake-ups.
    pub(crate) fn drain_wake(&self) {
        let mut buf = [0u8; 64];
        while self.wake_rx.recv(&mut buf).is_ok() {}
    }
}

/// The same-host lane a packet for GID `dgid` goes ahead on: the one to the peer the last packet
/// went to (`tx_peer`), when `dgid` is that peer's (see [`Device::send_ahead`]).
fn lane_ahead(
    link: &mut Link,
    tx_peer: Option<([u8; 16], SocketAddr, SocketAddr)>,
    dgid: [u8; 16],
    now: Instant,
) -> Option<usize> {
    let (_, dst, src) = tx_peer.filter(|(g, ..)| *g == dgid)?;
    if dst == src {
        return None;
    }
    link.lane_for(dst, src, now)
}

/// Packet `t` was built ahead into slot `buf`: copy in the payload the engine deferred, if any.
/// False (counted) if that failed.
fn fill_ahead(mem: &MrTable, tx_errors: &mut u64, t: &Transmit, buf: &mut [u8]) -> bool {
    match &t.deferred {
        Some(d) if mem.fill(d, &mut buf[..t.len]).is_err() => {
            // The engine checked the keys under this lock: cannot happen.
            *tx_errors += 1;
            false
        }
        _ => true,
    }
}

/// Payloads up to this many bytes are built aside and copied into the lane (see
/// [`Device::post_send`]).
const AHEAD_COPY_MAX: u64 = 256;

/// Most WQEs not yet started that a corked QP lets wait (`Config::cork_max_queued`): the post that
/// would make one more flushes them all, as one GSO send when they are of one size.
const CORK_MAX_QUEUED: usize = 32;

/// How long a thread busy-polls without finding anything before it yields its core after each
/// further empty poll (see [`Device::poll_empty`]).
const YIELD_AFTER: Duration = Duration::from_micros(20);

/// A busy poll at `now` found nothing, in a run of such polls that began at `since` (0: none yet):
/// when the run began, and whether to yield the core now.
fn empty_poll(since: u64, now: u64) -> (u64, bool) {
    match since {
        0 => (now.max(1), false),
        t => (t, now.saturating_sub(t) >= YIELD_AFTER.as_nanos() as u64),
    }
}

thread_local! {
    /// When this thread's current run of busy polls that found nothing began (`CLOCK_MONOTONIC`,
    /// ns; 0: not in one).
    static EMPTY_SINCE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A datagram this large makes the next receive take one datagram at a time (`State::rx_single`).
const RX_SINGLE_MIN: usize = 2048;

/// Batches of packets to the device itself one flush hands over (each up to `udp::BATCH`
/// packets): 2,048 packets, 8 MiB of 4 KiB-MTU WRITEs, a millisecond or two of work.
const LOOP_BATCHES: usize = 64;

/// Rounds of the CM's MADs to the device itself per flush (each answer can make an answer; a
/// connection's exchange takes three): what is left waits for the next flush, soon
/// (`Link::loop_budget_used`).
const CM_LOOP_ROUNDS: usize = 8;

/// Armings in a row that may end with the application back before the I/O thread took over and
/// still be paid for (see `State::lane_credit`).
const ARM_CREDIT: u8 = 8;

/// While same-host lanes are up, how often a busy-polling thread also reads the UDP sockets.
const UDP_EVERY: Duration = Duration::from_micros(50);

/// The longest the I/O thread sleeps without a deadline (it also rechecks `stop` this often).
const IDLE_WAIT: Duration = Duration::from_millis(200);

/// How long the I/O thread keeps polling after it last found work before it sleeps again, unless
/// it found an application thread in a call (see `io_loop`).
const IO_SPIN: Duration = Duration::from_micros(50);
/// How long the I/O thread sleeps between packets again, rather than polling, once it found an
/// application thread in a call (the device lock held) while it polled.
const APP_GONE: Duration = Duration::from_millis(10);

/// Owner of a running device: stops and joins the I/O thread when the last verbs object is gone.
pub(crate) struct DeviceHandle {
    pub dev: Arc<Device>,
    thread: Option<JoinHandle<()>>,
}

impl DeviceHandle {
    /// Start the I/O thread of `dev`.
    pub fn start(dev: Device) -> Result<DeviceHandle> {
        let dev = Arc::new(dev);
        {
            let mut running = RUNNING.lock().expect("device list");
            let pid = std::process::id();
            if running.0 != pid {
                // The first device, or the first in a child forked from the process.
                *running = (pid, Vec::new());
            }
            running.1.retain(|d| d.strong_count() > 0);
            running.1.push(Arc::downgrade(&dev));
        }
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: registers a function that takes no arguments and returns, as atexit requires.
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(flush_owed_at_exit);
        });
        let d = Arc::clone(&dev);
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{}", dev.info.name))
            .spawn(move || d.io_loop())
            .map_err(|e| Error::io("starting the device I/O thread", e))?;
        Ok(DeviceHandle { dev, thread: Some(thread) })
    }
}

/// The devices of this process, with its process ID: at its exit, what a poll left owed is sent
/// (a program that takes its last completion and exits would otherwise leave the ACK of that
/// request unsent, and its peer's send would end in a retry error).
static RUNNING: Mutex<(u32, Vec<std::sync::Weak<Device>>)> = Mutex::new((0, Vec::new()));

/// See [`RUNNING`]. Not in a child forked from the process (its copies of the devices are not its
/// own). A device whose lock another thread keeps for a millisecond (or a poisoned one) is
/// skipped: exit must not wait long.
extern "C" fn flush_owed_at_exit() {
    let devices = match RUNNING.try_lock() {
        Ok(r) if r.0 == std::process::id() => r.1.clone(),
        _ => return,
    };
    for dev in devices.iter().filter_map(std::sync::Weak::upgrade) {
        let start = std::time::Instant::now();
        loop {
            match dev.state.try_lock() {
                Ok(mut st) => break dev.flush_owed(&mut st, dev.now()),
                Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < Duration::from_millis(1) => {
                    std::thread::yield_now()
                }
                Err(_) => break,
            }
        }
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        {
            let mut st = self.dev.lock();
            self.dev.flush_owed(&mut st, self.dev.now());
        }
        self.dev.stop.store(true, Ordering::Release);
        let _ = self.dev.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of empty polls yields from YIELD_AFTER on, after each further poll; a poll that found
    /// something (the run's start back to 0) starts over.
    #[test]
    fn empty_polls_yield_after_a_while() {
        let after = YIELD_AFTER.as_nanos() as u64;
        let (start, y) = empty_poll(0, 5_000);
        assert_eq!((start, y), (5_000, false));
        assert_eq!(empty_poll(start, 5_000 + after - 1), (5_000, false));
        assert_eq!(empty_poll(start, 5_000 + after), (5_000, true));
        assert_eq!(empty_poll(start, 5_000 + 10 * after), (5_000, true));
        assert_eq!(empty_poll(0, 9_000_000), (9_000_000, false));
        // A clock reading of 0 still marks a run as begun.
        assert_eq!(empty_poll(0, 0), (1, false));
    }
}
