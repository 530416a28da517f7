//! The embedded device at run time: the engine ([`Hca`]) and region table behind one lock, the UDP
//! endpoint, and the I/O thread that receives packets, fires timers and sends what the engine
//! produces.
//!
//! Verbs calls run on the caller's thread: they take the lock, act on the engine, and send any
//! packets it produced right away (no wake-up of the I/O thread on the send path). The I/O thread
//! sleeps in `ppoll` on the sockets and a wake-up socket until a packet or the next timer.

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use softrdma_device::DeviceInfo;
use softrdma_transport::{AsyncEvent, Config, CqId, Hca, Instant, Mtu, RxInfo};
use softrdma_wire::roce::{seal_udp_payload_ident, verify_udp_payload_ident, UdpVerdict, VerifyStats};

use crate::error::{Error, Result};
use crate::io::{self as udp, UdpPort};
use crate::memory::MrTable;

/// Bytes per transmit slot: the largest IB packet (4096-byte MTU plus headers) with room to spare.
const TX_SLOT: usize = 4096 + 512;
/// Bytes per receive slot: a whole GRO batch (up to 64 KiB of coalesced datagrams); larger
/// datagrams are truncated by the kernel and dropped as malformed.
const RX_SLOT: usize = 65536;

/// Everything behind the device lock.
pub(crate) struct State {
    pub hca: Hca,
    pub mem: MrTable,
    /// Completion channels by CQ.
    pub channels: HashMap<CqId, Arc<ChannelShared>>,
    pub async_events: VecDeque<AsyncEvent>,
    /// ICRC verdicts of received packets.
    pub verify: VerifyStats,
    /// Datagrams the socket refused.
    pub tx_errors: u64,
    pub next_pd: u32,
    tx_buf: Vec<u8>,
    rx_buf: Vec<u8>,
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
    wake_tx: UnixDatagram,
    wake_rx: UnixDatagram,
    stop: AtomicBool,
    epoch: std::time::Instant,
    /// Clock reading (ns) of the last progress made by an application thread polling a CQ.
    app_progress: AtomicU64,
}

/// An application thread that polled within this window is busy polling (see `io_loop`).
const BUSY_WINDOW: Duration = Duration::from_micros(200);
/// How long the I/O thread sleeps before checking again while an application thread busy-polls.
const BUSY_SLEEP: Duration = Duration::from_micros(500);

/// The IP address a GID stands for (IPv4-mapped GIDs are IPv4).
pub(crate) fn gid_ip(gid: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// The 40 bytes rxe puts in front of a UD receive: the IPv4 header in the last 20 bytes, or the
/// IPv6 header. Variant fields we cannot see (TOS, TTL, identification) are written as rxe's
/// defaults; the checksum is computed.
fn grh_area(src: SocketAddr, dst: SocketAddr, udp_payload: usize) -> [u8; 40] {
    let mut g = [0u8; 40];
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let h = &mut g[20..];
            h[0] = 0x45;
            h[2..4].copy_from_slice(&((20 + 8 + udp_payload) as u16).to_be_bytes());
            h[6] = 0x40;
            h[8] = 64;
            h[9] = 17;
            h[12..16].copy_from_slice(&s.octets());
            h[16..20].copy_from_slice(&d.octets());
            let sum = (0..10).map(|i| u32::from(u16::from_be_bytes([h[2 * i], h[2 * i + 1]]))).sum::<u32>();
            let sum = (sum & 0xffff) + (sum >> 16);
            let sum = (sum & 0xffff) + (sum >> 16);
            h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        }
        (s, d) => {
            let to6 = |a: IpAddr| match a {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            g[0] = 0x60;
            g[4..6].copy_from_slice(&((8 + udp_payload) as u16).to_be_bytes());
            g[6] = 17;
            g[7] = 64;
            g[8..24].copy_from_slice(&to6(s).octets());
            g[24..40].copy_from_slice(&to6(d).octets());
        }
    }
    g
}

impl Device {
    /// Bind the UDP endpoint and build the engine for `info`.
    pub fn new(info: DeviceInfo, v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>, udp_port: u16) -> Result<Device> {
        let port = UdpPort::bind(v4, v6, udp_port)?;
        let port_mtu = Mtu::from_bytes(info.port.active_mtu.bytes() as usize).unwrap_or(Mtu::M1024);
        let max_rd_atomic = info.attr.max_qp_rd_atom.min(255) as u8;
        // Real links lose packets in bursts of congestion: adapt the go-back-N window to loss.
        let config = Config { port_mtu, max_rd_atomic, adaptive_window: true, ..Config::default() };
        let (wake_tx, wake_rx) = UnixDatagram::pair().map_err(|e| Error::io("creating the wake-up socket", e))?;
        wake_tx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        wake_rx.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
        let state = State {
            hca: Hca::new(config),
            mem: MrTable::default(),
            channels: HashMap::new(),
            async_events: VecDeque::new(),
            verify: VerifyStats::default(),
            tx_errors: 0,
            next_pd: 1,
            tx_buf: vec![0; udp::BATCH * TX_SLOT],
            rx_buf: vec![0; udp::BATCH * RX_SLOT],
        };
        Ok(Device {
            info,
            state: Mutex::new(state),
            port,
            async_cv: Condvar::new(),
            wake_tx,
            wake_rx,
            stop: AtomicBool::new(false),
            epoch: std::time::Instant::now(),
            app_progress: AtomicU64::new(0),
        })
    }

    /// The engine's clock reading.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Take the device lock.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the engine state in an unknown shape; carrying on
        // would be worse than stopping, so poisoning propagates.
        self.state.lock().expect("device lock poisoned")
    }

    /// Run `f` on the engine, then send what it produced and dispatch notifications.
    pub fn run<R>(&self, f: impl FnOnce(&mut State, Instant) -> R) -> R {
        let mut st = self.lock();
        let now = self.now();
        let r = f(&mut st, now);
        self.flush(&mut st, now);
        r
    }

    /// Send every packet the engine has, and hand out completion and async events.
    fn flush(&self, st: &mut State, now: Instant) {
        // Packets go out in batches of up to udp::BATCH per sendmmsg, each built in its own slot of
        // the transmit buffer. Consecutive packets of one size to one peer go as one UDP GSO send
        // (a multi-packet message's middle and last packets, for instance); the kernel numbers the
        // IPv4 identifications of the segments 0, 1, 2, ..., so packet k of a group is sealed for
        // identification k.
        let State { hca, mem, tx_buf, tx_errors, .. } = &mut *st;
        let gso = self.port.gso();
        loop {
            let mut meta = [(0usize, SocketAddr::from(([0, 0, 0, 0], 0)), SocketAddr::from(([0, 0, 0, 0], 0))); udp::BATCH];
            let mut slots = [0usize; udp::BATCH];
            let (mut n, mut k) = (0, 0);
            for (i, slot) in tx_buf.chunks_exact_mut(TX_SLOT).enumerate() {
                let Some(t) = hca.poll_transmit(now, &mut *mem, slot) else { break };
                n += 1;
                let dst = SocketAddr::new(gid_ip(&t.av.dgid), self.port.port());
                let Some(src) = self.port.local_for(&dst) else {
                    *tx_errors += 1;
                    continue;
                };
                meta[k] = (t.len, dst, src);
                slots[k] = i;
                k += 1;
            }
            let mut groups = [(0usize, 0usize); udp::BATCH];
            let ng = if gso {
                let mut lens = [(0usize, SocketAddr::from(([0, 0, 0, 0], 0))); udp::BATCH];
                for (l, m) in lens.iter_mut().zip(&meta[..k]) {
                    *l = (m.0, m.1);
                }
                udp::gso_groups(&lens[..k], &mut groups)
            } else {
                for (i, g) in groups.iter_mut().enumerate().take(k) {
                    *g = (i, i + 1);
                }
                k
            };
            let mut ok = [true; udp::BATCH];
            for &(a, b) in &groups[..ng] {
                for j in a..b {
                    let (len, dst, src) = meta[j];
                    let pkt = &mut tx_buf[slots[j] * TX_SLOT..][..len];
                    if seal_udp_payload_ident(src, dst, pkt, (j - a) as u16).is_err() {
                        ok[j] = false;
                    }
                }
            }
            let mut pkts: [(&[u8], SocketAddr); udp::BATCH] = [(&[], SocketAddr::from(([0, 0, 0, 0], 0))); udp::BATCH];
            for j in 0..k {
                pkts[j] = (&tx_buf[slots[j] * TX_SLOT..][..meta[j].0], meta[j].1);
            }
            // A packet that could not be sealed is sent anyway (the peer drops it, the transport
            // retransmits) so the groups stay intact; it cannot happen for packets the engine built.
            *tx_errors += ok[..k].iter().filter(|o| !**o).count() as u64;
            *tx_errors += self.port.send_batch(&pkts[..k], &groups[..ng]) as u64;
            if n < udp::BATCH {
                break;
            }
        }
        while let Some(cq) = st.hca.poll_cq_event() {
            if let Some(ch) = st.channels.get(&cq) {
                ch.notify(cq);
            }
        }
        let mut any = false;
        while let Some(ev) = st.hca.poll_event() {
            st.async_events.push_back(ev);
            any = true;
        }
        if any {
            self.async_cv.notify_all();
        }
    }

    /// Wait up to `timeout` for an async event.
    pub fn wait_async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        let st = self.lock();
        let (mut st, _) = self
            .async_cv
            .wait_timeout_while(st, timeout, |s| s.async_events.is_empty())
            .expect("device lock poisoned");
        st.async_events.pop_front()
    }

    /// One received datagram.
    fn receive(&self, st: &mut State, now: Instant, payload: &[u8], src: SocketAddr, local: SocketAddr, ident: u16) {
        let counters = st.hca.counters_mut();
        match verify_udp_payload_ident(src, local, payload, ident) {
            Err(_) => {
                counters.rcvd_pkts += 1;
                counters.drop_malformed += 1;
            }
            Ok((_, UdpVerdict::Bad)) => {
                counters.rcvd_pkts += 1;
                st.verify.record(UdpVerdict::Bad);
            }
            Ok((_, verdict)) => {
                st.verify.record(verdict);
                let rx = RxInfo { grh: grh_area(src, local, payload.len()) };
                st.hca.handle_packet(now, payload, &rx, &mut st.mem);
            }
        }
    }

    /// Receive what is waiting on the sockets, fire due timers, send what that produced. Called by
    /// a thread polling an empty CQ (busy polling then makes progress itself instead of waiting for
    /// the I/O thread to be scheduled); the I/O thread then stays out of its way (see `io_loop`).
    pub fn progress(&self, st: &mut State) {
        let now = self.now();
        self.app_progress.store(now.as_nanos(), Ordering::Relaxed);
        self.progress_at(st, now);
    }

    fn progress_at(&self, st: &mut State, now: Instant) {
        let mut buf = std::mem::take(&mut st.rx_buf);
        let mut meta = [None; udp::BATCH];
        for (sock, local) in self.port.sockets() {
            // Up to 256 datagrams per socket and call, udp::BATCH per recvmmsg.
            for _ in 0..256 / udp::BATCH {
                match udp::recv_batch(sock, &mut buf, RX_SLOT, &mut meta) {
                    Ok(k) => {
                        for (i, m) in meta.iter().take(k).enumerate() {
                            match m {
                                &Some((n, src, seg)) => {
                                    // A GRO batch is several datagrams back to back, each `seg`
                                    // bytes but the last: segment k of a GSO send (identification k).
                                    let data = &buf[i * RX_SLOT..i * RX_SLOT + n];
                                    let seg = seg.map_or(n, usize::from).max(1);
                                    for (k, d) in data.chunks(seg).enumerate() {
                                        self.receive(st, now, d, src, *local, k as u16);
                                    }
                                }
                                None => {
                                    let c = st.hca.counters_mut();
                                    c.rcvd_pkts += 1;
                                    c.drop_malformed += 1;
                                }
                            }
                        }
                        if k < udp::BATCH {
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
        st.rx_buf = buf;
        if st.hca.poll_timeout().is_some_and(|t| t <= now) {
            st.hca.handle_timeout(now, &mut st.mem);
        }
        self.flush(st, now);
    }

    /// The I/O loop: receive, fire timers, send; until stopped.
    fn io_loop(&self) {
        let mut buf = [0u8; 64];
        let mut fds: Vec<libc::pollfd> = self
            .port
            .sockets()
            .map(|(s, _)| s.as_raw_fd())
            .chain(std::iter::once(self.wake_rx.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let nsock = fds.len() - 1;
        while !self.stop.load(Ordering::Acquire) {
            // While an application thread busy-polls a CQ it drives the device itself; this thread
            // then sleeps (waking for its wake-up socket or every BUSY_SLEEP) instead of waking for
            // every datagram and competing for the cores and the lock. On a machine with as many
            // busy threads as cores that competition costs milliseconds of preemption.
            if self.app_polling() {
                let ts = libc::timespec { tv_sec: 0, tv_nsec: BUSY_SLEEP.as_nanos() as libc::c_long };
                // SAFETY: one live pollfd (the wake-up socket, the last entry); `ts` outlives the call.
                unsafe { libc::ppoll(fds[nsock..].as_mut_ptr(), 1, &ts, std::ptr::null()) };
                while self.wake_rx.recv(&mut buf).is_ok() {}
                if self.app_polling() {
                    continue;
                }
            }
            let deadline = self.lock().hca.poll_timeout();
            let wait = match deadline {
                Some(at) => at.saturating_since(self.now()).min(Duration::from_millis(200)),
                None => Duration::from_millis(200),
            };
            let ts = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
            // SAFETY: `fds` is a live array of pollfd of the length given; `ts` outlives the call.
            unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
            while self.wake_rx.recv(&mut buf).is_ok() {}
            let mut st = self.lock();
            let now = self.now();
            self.progress_at(&mut st, now);
            for f in fds.iter_mut() {
                f.revents = 0;
            }
        }
    }

    /// An application thread made progress within the last BUSY_WINDOW.
    fn app_polling(&self) -> bool {
        let last = self.app_progress.load(Ordering::Relaxed);
        last != 0 && self.now().as_nanos().saturating_sub(last) < BUSY_WINDOW.as_nanos() as u64
    }

    fn wake(&self) -> io::Result<()> {
        self.wake_tx.send(&[1]).map(|_| ())
    }
}

/// Owner of a running device: stops and joins the I/O thread when the last verbs object is gone.
pub(crate) struct DeviceHandle {
    pub dev: Arc<Device>,
    thread: Option<JoinHandle<()>>,
}

impl DeviceHandle {
    /// Start the I/O thread of `dev`.
    pub fn start(dev: Device) -> Result<DeviceHandle> {
        let dev = Arc::new(dev);
        let d = Arc::clone(&dev);
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{}", dev.info.name))
            .spawn(move || d.io_loop())
            .map_err(|e| Error::io("starting the device I/O thread", e))?;
        Ok(DeviceHandle { dev, thread: Some(thread) })
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        self.dev.stop.store(true, Ordering::Release);
        let _ = self.dev.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
