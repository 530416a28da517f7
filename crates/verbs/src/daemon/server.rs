//! `softrdmad`: the host service that owns soft RoCE devices and serves many processes at once.
//!
//! Threads: one accepts control connections and spawns one thread per connection (its session);
//! one device loop per device runs the engine (the same [`Device`] as embedded mode: engine,
//! region table, UDP endpoint); one monitor follows the netdevs' link state; optionally one
//! answers Prometheus scrapes.
//!
//! Locks: each device has the service state ([`SvcState`]: which client owns which object, the
//! rings) and the engine lock inside [`Device`]; whoever needs both takes the service state first.
//!
//! The device loop, per pass: move work requests from every QP's and SRQ's ring into the engine,
//! receive packets, fire timers, send, move completions from the engine into the CQ rings (and send
//! a channel event when a CQ is armed), route async events to the owning client. It spins while
//! there is work and for a short while after (`SOFTRDMA_SPIN_US`, 50 µs by default), then asks
//! every work ring for a doorbell and sleeps in `ppoll` on the UDP sockets, the doorbells and a
//! wake-up socket until a packet, a doorbell or the next timer. While it polls it says its CPU in
//! every CQ ring, so that a client busy-polling on that CPU moves off it (`poller.rs`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as StdInstant};

use softrdma_abi::msg::{
    encode_event, DeviceEntry, DeviceStats, QpStats, Refusal, Request, Response, SHARED_REGION_REFUSED,
};
use softrdma_abi::ring::{ring_bytes, Consumer, Producer, RingCorrupt, ARMED_ANY};
use softrdma_abi::shm::{RegionMap, Shm};
use softrdma_abi::slot::{self, CQE_LEN};
use softrdma_abi::sock::{Conn, Listener, PeerCred};
use softrdma_device::registry::{Registry, RegistryError};
use softrdma_device::{netdev, DeviceConfig, DeviceInfo};
use softrdma_transport::{
    wr::Payload, Access, AsyncEvent, CqId, ModifyQp, PdId, QpCap, QpInit, QpState, SendOp, SendWr, Sge, SrqId,
    VerbsError, WcStatus, WorkCompletion,
};
use softrdma_wire::Qpn;

use super::loop_wait::{Loops, Wait};
use crate::error::Error;
use crate::poller;
use crate::runtime::Device;

/// How the daemon runs.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    /// Control socket path.
    pub socket: PathBuf,
    /// Device registry (devices.conf).
    pub config: PathBuf,
    /// UDP port of every device (4791).
    pub udp_port: u16,
    /// Serve Prometheus text at `http://ADDR/metrics`.
    pub metrics: Option<SocketAddr>,
    /// Map clients' `reg_mr` regions (`RegMrShared`); off, every region is reached with
    /// process_vm, as for `reg_mr_raw`.
    pub shared_regions: bool,
}

impl DaemonOptions {
    /// The defaults for this user: [`softrdma_abi::sock::listen_path`],
    /// [`softrdma_device::registry::config_path`], `$SOFTRDMA_UDP_PORT` or 4791, no metrics.
    pub fn from_env() -> DaemonOptions {
        let udp_port = std::env::var("SOFTRDMA_UDP_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(crate::ROCE_PORT);
        DaemonOptions {
            socket: softrdma_abi::sock::listen_path(),
            config: softrdma_device::registry::config_path(),
            udp_port,
            metrics: None,
            shared_regions: true,
        }
    }
}

/// Most objects (PDs, MRs, CQs, QPs, SRQs, channels) one client may hold per device.
pub const MAX_OBJECTS_PER_CLIENT: u32 = 65536;
/// Garbage messages tolerated on one connection before it is closed.
const MAX_GARBAGE: u32 = 1;

macro_rules! log {
    ($($arg:tt)*) => {{
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        eprintln!("softrdmad[{}] {}.{:03}: {}", std::process::id(), t.as_secs(), t.subsec_millis(), format_args!($($arg)*));
    }};
}

fn refuse(e: Error) -> Refusal {
    match e {
        Error::Verbs(v) => Refusal::Verbs(v),
        Error::InvalidArgument(s) => Refusal::InvalidArgument(s),
        Error::Registry(RegistryError::UnknownDevice(n)) => Refusal::UnknownDevice(n),
        other => Refusal::Other(other.to_string()),
    }
}

fn nso() -> Refusal {
    Refusal::Verbs(VerbsError::NoSuchObject)
}

/// Run the daemon until the process is killed.
pub fn run(opts: DaemonOptions) -> crate::error::Result<()> {
    let reg = Registry::load_from(&opts.config)?;
    let d = Arc::new(Daemon {
        reg: Mutex::new(reg),
        devices: Mutex::new(Vec::new()),
        next_conn: AtomicU64::new(1),
        uid: softrdma_abi::sock::geteuid(),
        garbage: AtomicU64::new(0),
        loops: Arc::new(Loops::new()),
        opts,
    });
    let configs: Vec<DeviceConfig> = d.reg.lock().expect("registry").devices().to_vec();
    for c in configs {
        match d.start_device(&c) {
            Ok(()) => log!("device {} on {} started (UDP port {})", c.name, c.netdev, d.opts.udp_port),
            Err(e) => log!("device {} not started: {e}", c.name),
        }
    }
    let listener = d.listen()?;
    log!("listening on {} (config {})", d.opts.socket.display(), d.opts.config.display());
    if let Some(addr) = d.opts.metrics {
        let l = TcpListener::bind(addr).map_err(|e| Error::io("binding the metrics port", e))?;
        log!("metrics on http://{}/metrics", l.local_addr().map(|a| a.to_string()).unwrap_or_default());
        let d2 = Arc::clone(&d);
        std::thread::Builder::new()
            .name("softrdmad-metrics".into())
            .spawn(move || d2.serve_metrics(l))
            .map_err(|e| Error::io("starting the metrics thread", e))?;
    }
    let d2 = Arc::clone(&d);
    std::thread::Builder::new()
        .name("softrdmad-monitor".into())
        .spawn(move || d2.monitor())
        .map_err(|e| Error::io("starting the monitor thread", e))?;
    loop {
        match listener.accept() {
            Ok(conn) => {
                let d2 = Arc::clone(&d);
                let _ = std::thread::Builder::new().name("softrdmad-client".into()).spawn(move || d2.serve(conn));
            }
            Err(e) => {
                log!("accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

struct Daemon {
    opts: DaemonOptions,
    reg: Mutex<Registry>,
    devices: Mutex<Vec<Arc<SvcDevice>>>,
    next_conn: AtomicU64,
    uid: u32,
    garbage: AtomicU64,
    /// The device loops that poll, for how each waits (loop_wait.rs).
    loops: Arc<Loops>,
}

impl Daemon {
    fn listen(&self) -> crate::error::Result<Listener> {
        let path = &self.opts.socket;
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                std::fs::create_dir_all(dir).map_err(|e| Error::io("creating the socket directory", e))?;
                // The system daemon's directory is world-readable so every user can connect; a
                // user's own daemon keeps its directory private.
                let mode = if self.uid == 0 { 0o755 } else { 0o700 };
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode));
            }
        }
        let l = Listener::bind(path).map_err(|e| Error::io("binding the control socket", e))?;
        // Anyone who can reach the socket may use the devices, as /dev/infiniband/uverbs* is 0666
        // for the kernel's rxe: isolation is by object ownership, not by who connects.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| Error::io("setting the control socket's permissions", e))?;
        Ok(l)
    }

    fn start_device(&self, c: &DeviceConfig) -> crate::error::Result<()> {
        let info = DeviceInfo::open(c)?;
        let up = info.netdev.is_link_up();
        let (v4, v6) = crate::device::bind_addrs(&info);
        // softrdmad's devices take part in the same-host link as embedded ones do (their loop
        // polls the lanes through `Device::progress` and sleeps on their doorbells).
        let dev = Device::new(info, v4, v6, self.opts.udp_port, crate::same_host::enabled_by_env(), false)?;
        {
            let mut st = dev.lock();
            st.qp_traffic = Some(Default::default());
            st.cm.unrouted = Some(Default::default());
            st.mem.allow_placements(placements_on());
        }
        let sd = Arc::new(SvcDevice {
            name: Mutex::new(c.name.clone()),
            config: Mutex::new(c.clone()),
            dev,
            svc: Mutex::new(SvcState::default()),
            stop: AtomicBool::new(false),
            port_up: AtomicBool::new(up),
            thread: Mutex::new(None),
            tid: AtomicI32::new(0),
            loops: Arc::clone(&self.loops),
        });
        let sd2 = Arc::clone(&sd);
        let t = std::thread::Builder::new()
            .name(format!("softrdmad-{}", c.name))
            .spawn(move || sd2.run())
            .map_err(|e| Error::io("starting a device loop", e))?;
        *sd.thread.lock().expect("thread slot") = Some(t);
        self.devices.lock().expect("devices").push(sd);
        Ok(())
    }

    fn device(&self, name: &str) -> Option<Arc<SvcDevice>> {
        self.devices.lock().expect("devices").iter().find(|d| *d.name.lock().expect("name") == name).cloned()
    }

    fn entry(&self, reg: &Registry, c: &DeviceConfig) -> DeviceEntry {
        let running = self.device(&c.name).is_some();
        let nd = if running { netdev::by_name(&c.netdev).ok() } else { None };
        DeviceEntry { config: c.clone(), roce_v1: reg.roce_v1(&c.name), netdev: nd, udp_port: self.opts.udp_port }
    }

    // ---- one client -----------------------------------------------------------------------------

    fn serve(self: Arc<Self>, conn: Conn) {
        let cred = match conn.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                log!("client without credentials: {e}");
                return;
            }
        };
        let mut s =
            Session { d: Arc::clone(&self), id: self.next_conn.fetch_add(1, Ordering::Relaxed), cred, dev: None };
        let mut garbage = 0;
        loop {
            let (buf, fds) = match conn.recv() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    log!("client pid {} uid {}: receive failed: {e}; closing", cred.pid, cred.uid);
                    break;
                }
            };
            let resp = match Request::decode(&buf) {
                Ok(req) => s.handle(req, fds),
                Err(e) => {
                    garbage += 1;
                    self.garbage.fetch_add(1, Ordering::Relaxed);
                    log!("client pid {} uid {} sent garbage ({} bytes: {e})", cred.pid, cred.uid, buf.len());
                    Err(Refusal::InvalidArgument(e.to_string()))
                }
            };
            let (resp, out) = match resp {
                Ok(r) => r,
                Err(e) => (Response::Error(e), Vec::new()),
            };
            let raw: Vec<_> = out.iter().map(|f| f.as_raw_fd()).collect();
            if conn.send(&resp.encode(), &raw).is_err() || garbage > MAX_GARBAGE {
                if garbage > MAX_GARBAGE {
                    log!("closing the connection of pid {} after {garbage} malformed messages", cred.pid);
                }
                break;
            }
        }
        if let Some(dev) = s.dev.take() {
            dev.remove_client(s.id);
        }
    }

    // ---- management ---------------------------------------------------------------------------

    fn admin(&self, cred: &PeerCred) -> Result<(), Refusal> {
        if cred.uid == 0 || cred.uid == self.uid {
            Ok(())
        } else {
            Err(Refusal::PermissionDenied(format!(
                "uid {} may not manage softrdmad's devices (root or uid {} may)",
                cred.uid, self.uid
            )))
        }
    }

    fn save(&self, reg: &Registry) -> Result<(), Refusal> {
        reg.save(&self.opts.config).map_err(|e| Refusal::Other(e.to_string()))
    }

    fn link_add(&self, c: DeviceConfig) -> Result<(), Refusal> {
        let mut reg = self.reg.lock().expect("registry");
        let mut next = reg.clone();
        next.add(c.clone()).map_err(|e| Refusal::InvalidArgument(e.to_string()))?;
        self.start_device(&c).map_err(refuse)?;
        self.save(&next)?;
        *reg = next;
        log!("link add {} netdev {}", c.name, c.netdev);
        Ok(())
    }

    fn link_delete(&self, name: &str) -> Result<(), Refusal> {
        let mut reg = self.reg.lock().expect("registry");
        let mut next = reg.clone();
        next.remove(name).map_err(|_| Refusal::UnknownDevice(name.into()))?;
        self.save(&next)?;
        *reg = next;
        let dev = {
            let mut list = self.devices.lock().expect("devices");
            let pos = list.iter().position(|d| *d.name.lock().expect("name") == name);
            pos.map(|p| list.remove(p))
        };
        if let Some(dev) = dev {
            dev.shutdown();
        }
        log!("link delete {name}");
        Ok(())
    }

    fn rename(&self, name: &str, new_name: &str) -> Result<(), Refusal> {
        let mut reg = self.reg.lock().expect("registry");
        let mut next = reg.clone();
        next.rename(name, new_name).map_err(|e| match e {
            RegistryError::UnknownDevice(n) => Refusal::UnknownDevice(n),
            e => Refusal::InvalidArgument(e.to_string()),
        })?;
        self.save(&next)?;
        *reg = next;
        if let Some(d) = self.device(name) {
            *d.name.lock().expect("name") = new_name.to_owned();
            d.config.lock().expect("config").name = new_name.to_owned();
        }
        log!("dev set {name} name {new_name}");
        Ok(())
    }

    fn roce_mode(&self, name: &str, port: u8, v1: bool) -> Result<(), Refusal> {
        if port != 1 {
            return Err(Refusal::InvalidArgument(format!("device {name} has one port (1), not {port}")));
        }
        let mut reg = self.reg.lock().expect("registry");
        let mut next = reg.clone();
        next.set_roce_v1(name, v1).map_err(|_| Refusal::UnknownDevice(name.into()))?;
        self.save(&next)?;
        *reg = next;
        log!("roce-mode {name} {port} {}", if v1 { "v1" } else { "v2" });
        Ok(())
    }

    fn stats(&self, device: Option<&str>) -> Result<Vec<DeviceStats>, Refusal> {
        let list: Vec<_> = self.devices.lock().expect("devices").clone();
        let mut out = Vec::new();
        for d in list {
            let name = d.name.lock().expect("name").clone();
            if device.is_some_and(|n| n != name) {
                continue;
            }
            let mut s = d.stats();
            s.name = name;
            s.counters.push(("garbage_messages".into(), self.garbage.load(Ordering::Relaxed)));
            out.push(s);
        }
        if let (Some(n), true) = (device, out.is_empty()) {
            return Err(Refusal::UnknownDevice(n.into()));
        }
        Ok(out)
    }

    // ---- background ---------------------------------------------------------------------------

    /// Follow each device's netdev: link down is PORT_DOWN and an `IBV_EVENT_PORT_ERR` to every
    /// client; up again is PORT_ACTIVE and `IBV_EVENT_PORT_ACTIVE`.
    fn monitor(self: Arc<Self>) {
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let list: Vec<_> = self.devices.lock().expect("devices").clone();
            for d in list {
                let nd = d.config.lock().expect("config").netdev.clone();
                let up = netdev::by_name(&nd).is_ok_and(|n| n.is_link_up());
                if d.port_up.swap(up, Ordering::Relaxed) != up {
                    let name = d.name.lock().expect("name").clone();
                    log!(
                        "device {name}: netdev {nd} link {}, port 1 {}",
                        if up { "up" } else { "down" },
                        if up { "ACTIVE" } else { "DOWN" }
                    );
                    let ev = if up { AsyncEvent::PortActive(1) } else { AsyncEvent::PortError(1) };
                    d.broadcast(ev);
                }
            }
        }
    }

    fn serve_metrics(self: Arc<Self>, l: TcpListener) {
        for stream in l.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let body = prometheus(&self.stats(None).unwrap_or_default());
            let head = format!(
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body.as_bytes()));
        }
    }
}

/// Prometheus text exposition of the stats.
pub fn prometheus(stats: &[DeviceStats]) -> String {
    use std::fmt::Write as _;
    let mut by_name: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in stats {
        for (k, v) in &d.counters {
            by_name.entry(format!("softrdma_{k}")).or_default().push(format!("{{device=\"{}\"}} {v}", d.name));
        }
        for (qpn, pid, c) in &d.qps {
            for (k, v) in c {
                by_name
                    .entry(format!("softrdma_qp_{k}"))
                    .or_default()
                    .push(format!("{{device=\"{}\",qpn=\"{qpn}\",pid=\"{pid}\"}} {v}", d.name));
            }
        }
    }
    let mut s = String::new();
    for (name, samples) in by_name {
        let kind =
            if name.starts_with("softrdma_objects_") || name == "softrdma_port_active" { "gauge" } else { "counter" };
        let _ = writeln!(s, "# TYPE {name} {kind}");
        for x in samples {
            let _ = writeln!(s, "{name}{x}");
        }
    }
    s
}

// ---- one device ---------------------------------------------------------------------------------

#[derive(Default)]
struct QpCounters {
    send_wrs: u64,
    recv_wrs: u64,
    completions: u64,
    error_completions: u64,
    bad_wqes: u64,
    rejected_wrs: u64,
}

struct ClientEntry {
    pid: u32,
    uid: u32,
    doorbell: OwnedFd,
    events: UnixDatagram,
    objects: u32,
}

struct CqEntry {
    client: u64,
    /// Its client's process (whose placement ring its completions name).
    pid: u32,
    ring: Producer,
    /// The last batch of writes its completions named (`Ring::writes_made`): per CQ, so that
    /// what its ring says is always that batch or the one before, and the batches of the
    /// completions it holds are at most its capacity behind (they compare as wrapping numbers).
    batch: u32,
    channel: Option<u32>,
    overflow_logged: bool,
    _shm: Shm,
}

struct QpEntry {
    client: u64,
    /// Its capacities as the engine has them: inline data up to what a send slot holds.
    cap: QpCap,
    sq: Consumer,
    rq: Option<Consumer>,
    counters: QpCounters,
    broken: bool,
    /// The engine's queue was full at the last pass: entries wait in the ring until a packet or a
    /// timer frees room, both of which wake the loop, so the loop may sleep meanwhile.
    sq_blocked: bool,
    rq_blocked: bool,
    /// Entries of the send ring whose payloads this pass read ahead: the pass takes no more.
    sq_read_ahead: u32,
    /// Those entries decoded, the ring's first first, for the pass to take without decoding
    /// them again (the ring's entries stay in place until taken, and this loop is their only
    /// consumer).
    sq_decoded: VecDeque<Result<SendWr, slot::BadSlot>>,
    _shm: Shm,
}

impl QpEntry {
    /// Take the work requests of the QP's send ring into the engine, as many as it takes (with
    /// `read_ahead`, only those the pass read ahead for); returns whether any was taken and how
    /// many ring entries were malformed. `pid` names the client in what is logged.
    fn take_sends(
        &mut self,
        qpn: Qpn,
        pid: impl Fn() -> u32,
        st: &mut crate::runtime::State,
        now: softrdma_transport::Instant,
        buf: &mut Vec<u8>,
        read_ahead: bool,
    ) -> (bool, u64) {
        if self.broken {
            return (false, 0);
        }
        let (mut work, mut bad) = (false, 0);
        self.sq_blocked = false;
        let mut left = if read_ahead { self.sq_read_ahead } else { u32::MAX };
        loop {
            if left == 0 {
                break;
            }
            left -= 1;
            // The ring's next entry, decoded by the read-ahead or now.
            let decoded = match self.sq_decoded.pop_front() {
                Some(d) => d,
                None => {
                    let report = |e: &RingCorrupt| {
                        log!("client pid {}: QP {qpn} send ring: {e}; ignoring the ring from now on", pid());
                    };
                    let Some(n) =
                        peek_entry(&self.sq, buf, &mut self.broken, report, slot::SEND_HEADER, slot::send_used)
                    else {
                        break;
                    };
                    slot::decode_send(&buf[..n], self.cap.max_send_sge, self.cap.max_inline_data)
                }
            };
            let wr = match decoded {
                Ok(wr) => wr,
                Err(e) => {
                    self.sq.advance();
                    self.counters.bad_wqes += 1;
                    bad += 1;
                    log!("client pid {}: QP {qpn}: {e}; QP to ERR", pid());
                    let _ = st.hca.modify_qp(
                        qpn,
                        &ModifyQp { state: Some(QpState::Err), ..Default::default() },
                        now,
                        &mut st.mem,
                    );
                    // As for a move to error the client asks for.
                    st.mem.make_all_placements();
                    work = true;
                    continue;
                }
            };
            match st.hca.post_send(qpn, wr, now, &mut st.mem) {
                Ok(()) => {
                    self.counters.send_wrs += 1;
                    if let Some(m) = st.hca.take_direct() {
                        // Executed at once, to another QP of this device: one packet each way.
                        st.link.executed_directly(now, 1);
                        if let Some(table) = st.qp_traffic.as_mut() {
                            table.count_direct(&m);
                        }
                    }
                }
                Err(VerbsError::QueueFull) => {
                    self.sq_blocked = true;
                    break;
                }
                Err(e) => {
                    self.counters.rejected_wrs += 1;
                    if self.counters.rejected_wrs == 1 {
                        log!("client pid {}: QP {qpn}: send WR refused: {e}", pid());
                    }
                }
            }
            self.sq.advance();
            work = true;
        }
        // What was not taken (the engine's queue is full) is decoded again next time.
        self.sq_decoded.clear();
        (work, bad)
    }
}

/// After completions were published to CQ `id` (and a full fence): send its channel the event if
/// the client armed it for them (any completion, or `notify`: an error or a receive, for
/// solicited-only arming), disarming it.
fn wake_channel(c: &CqEntry, id: CqId, notify: bool, channels: &HashMap<u32, (u64, UnixDatagram)>) {
    let flags = c.ring.ring().flags();
    let armed = flags.load(Ordering::Relaxed);
    if armed != 0
        && (armed == ARMED_ANY || notify)
        && flags.compare_exchange(armed, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    {
        if let Some((_, sock)) = c.channel.and_then(|ch| channels.get(&ch)) {
            let _ = sock.send(&id.0.to_le_bytes());
        }
    }
}

/// The process id of client `client`, for what is logged about it (0 if it is gone): looked up
/// only when something is logged, not on every pass.
fn pid_of(clients: &HashMap<u64, ClientEntry>, client: u64) -> impl Fn() -> u32 + '_ {
    move || clients.get(&client).map_or(0, |c| c.pid)
}

/// Copy the next entry of a client's ring into `buf` (resized to a slot): its first `head`
/// bytes, then the rest of the `used(first bytes)` it takes (`Consumer::peek_used_at`: a send
/// slot's unused tail is not read). The bytes copied; `None` if the ring has none, or is broken:
/// then `broken` is set (the ring is ignored from then on) and `report` is told why.
fn peek_entry(
    ring: &Consumer,
    buf: &mut Vec<u8>,
    broken: &mut bool,
    report: impl FnOnce(&RingCorrupt),
    head: usize,
    used: impl FnOnce(&[u8]) -> usize,
) -> Option<usize> {
    buf.resize(ring.ring().slot_size() as usize, 0);
    match ring.peek_used_at(0, buf, head, used) {
        Ok(got) => got,
        Err(e) => {
            report(&e);
            *broken = true;
            None
        }
    }
}

/// The whole slot: for the receive rings, whose slots are a few SGEs long.
fn whole(head: &[u8]) -> usize {
    head.len()
}

/// Rounds of taking and sending [`take_posted`] makes at most (each one frees room in the
/// engine's queue for UD requests and whatever RC requests were acknowledged meanwhile).
const TAKE_POSTED_ROUNDS: usize = 16;

/// Carry out what QP `qpn`'s client posted to it, for a verb the client calls on the QP to act
/// after every request it posted before (the device loop may not have got to them yet): the
/// receive rings first, as the loop's passes take them (a SEND to a QP of this device finds the
/// receive its client posted before), then the QP's send ring, sending what the requests produce,
/// for as long as the engine takes more. Their completions, and those of the QPs of this device
/// they reach, go to the CQ rings in the loop's next pass.
fn take_posted(
    dev: &SvcDevice,
    svc: &mut SvcState,
    qpn: Qpn,
    st: &mut crate::runtime::State,
    now: softrdma_transport::Instant,
) {
    let mut buf = Vec::new();
    let mut work = svc.take_recvs(st, now, &mut buf);
    for _ in 0..TAKE_POSTED_ROUNDS {
        let Some(q) = svc.qps.get_mut(&qpn) else { break };
        let (taken, bad) = q.take_sends(qpn, pid_of(&svc.clients, q.client), st, now, &mut buf, false);
        svc.bad_wqes += bad;
        work |= taken;
        // A flush stops short when a same-host lane is full or its budget is spent.
        for _ in 0..TAKE_POSTED_ROUNDS {
            if !st.hca.has_transmit() {
                break;
            }
            dev.dev.flush(st, now);
        }
        if !taken || q.sq.pending().is_ok_and(|n| n == 0) {
            break;
        }
    }
    if work {
        let _ = dev.dev.wake();
    }
}

struct SrqEntry {
    client: u64,
    max_sge: u32,
    ring: Consumer,
    broken: bool,
    blocked: bool,
    _shm: Shm,
}

#[derive(Clone, Copy)]
struct CmIdEntry {
    client: u64,
    channel: u32,
}

struct CmChannelEntry {
    client: u64,
    /// One byte per event makes the client's channel readable; the event is fetched with
    /// `CmGetEvent`.
    sock: UnixDatagram,
    queue: std::collections::VecDeque<softrdma_cm::CmEvent>,
}

/// Most CM events queued on one channel; beyond, events are dropped (and logged).
const MAX_CM_EVENTS: usize = 1 << 16;

/// Hand the CM agent's events to the channels of the IDs' owners. A CONNECT_REQUEST's new ID
/// belongs to the listener's owner and reports to the listener's channel; one whose listener is
/// gone is destroyed. Returns (whether any event was handled, whether an ID was destroyed: the
/// caller then flushes the agent's output and calls again).
fn route_cm(svc: &mut SvcState, st: &mut crate::runtime::State, now: softrdma_transport::Instant) -> (bool, bool) {
    let evs: Vec<softrdma_cm::CmEvent> = match st.cm.unrouted.as_mut() {
        Some(q) if !q.is_empty() => q.drain(..).collect(),
        _ => return (false, false),
    };
    let mut destroyed = false;
    for ev in evs {
        let target = match ev.kind {
            softrdma_cm::EventKind::ConnectRequest { listener } => match svc.cm_ids.get(&listener.0).copied() {
                Some(e) => {
                    svc.cm_ids.insert(ev.id.0, e);
                    if let Some(c) = svc.clients.get_mut(&e.client) {
                        c.objects = c.objects.saturating_add(1);
                    }
                    Some(e)
                }
                None => {
                    let _ = st.cm.agent.destroy_id(ev.id, now);
                    destroyed = true;
                    None
                }
            },
            _ => svc.cm_ids.get(&ev.id.0).copied(),
        };
        let Some(e) = target else { continue };
        match svc.cm_channels.get_mut(&e.channel) {
            Some(ch) if ch.queue.len() < MAX_CM_EVENTS => {
                ch.queue.push_back(ev);
                let _ = ch.sock.send(&[1]);
            }
            Some(_) => {
                let pid = svc.clients.get(&e.client).map_or(0, |c| c.pid);
                log!("client pid {pid}: CM event channel {} full; event {:?} dropped", e.channel, ev.kind);
            }
            None => {}
        }
    }
    (true, destroyed)
}

/// Route the CM's events until none are left (destroying orphans makes more output).
fn route_cm_all(dev: &Device, svc: &mut SvcState, st: &mut crate::runtime::State) -> bool {
    let mut any = false;
    loop {
        let now = dev.now();
        let (routed, destroyed) = route_cm(svc, st, now);
        any |= routed;
        if !destroyed {
            return any;
        }
        dev.flush(st, now);
    }
}

#[derive(Default)]
struct SvcState {
    clients: HashMap<u64, ClientEntry>,
    pds: HashMap<u32, u64>,
    mrs: HashMap<u32, u64>,
    channels: HashMap<u32, (u64, UnixDatagram)>,
    next_channel: u32,
    cqs: BTreeMap<CqId, CqEntry>,
    qps: BTreeMap<Qpn, QpEntry>,
    srqs: BTreeMap<SrqId, SrqEntry>,
    bad_wqes: u64,
    /// Sleeps of the device loop that ran out while a work ring had entries waiting (see
    /// `SvcDevice::sleep`).
    late_wakeups: u64,
    /// RDMA CM IDs by handle (the agent's), with their owner and event channel.
    cm_ids: HashMap<u32, CmIdEntry>,
    /// RDMA CM event channels: owner, wake-up socket, queued events.
    cm_channels: HashMap<u32, CmChannelEntry>,
    next_cm_channel: u32,
    /// Set when the client list changed (the device loop rebuilds its poll set).
    generation: u64,
    /// Where the device loop polls (its CPU and poller id), as said in every CQ ring; `None`
    /// while it sleeps (see [`SvcState::say_loop_cpu`]).
    loop_cpu: Option<(u32, u32)>,
}

impl SvcState {
    /// Say in every CQ ring's producer word where the device loop polls (`None`: it sleeps), when
    /// that changed. A client polling an empty CQ on the loop's CPU moves off it (poller.rs).
    fn say_loop_cpu(&mut self, at: Option<(u32, u32)>) {
        if self.loop_cpu != at {
            self.loop_cpu = at;
            for c in self.cqs.values() {
                c.ring.ring().set_producer_cpu(at);
            }
        }
    }

    /// Every work ring the device loop takes from (QPs' send and receive rings, SRQs' rings), each
    /// with whether the loop leaves it alone for now: the engine's queue behind it is full, or the
    /// ring is broken.
    fn work_rings(&self) -> impl Iterator<Item = (&Consumer, bool)> {
        self.qps
            .values()
            .flat_map(|q| {
                std::iter::once((&q.sq, q.sq_blocked || q.broken))
                    .chain(q.rq.iter().map(move |r| (r, q.rq_blocked || q.broken)))
            })
            .chain(self.srqs.values().map(|s| (&s.ring, s.blocked || s.broken)))
    }
    /// Take the work requests of every receive ring and SRQ ring into the engine, as many as it
    /// takes; true if any was taken.
    fn take_recvs(
        &mut self,
        st: &mut crate::runtime::State,
        now: softrdma_transport::Instant,
        buf: &mut Vec<u8>,
    ) -> bool {
        let mut work = false;
        for (qpn, q) in self.qps.iter_mut() {
            if q.broken {
                continue;
            }
            q.rq_blocked = false;
            let pid = pid_of(&self.clients, q.client);
            let Some(rq) = q.rq.as_mut() else { continue };
            loop {
                let report = |e: &RingCorrupt| {
                    log!("client pid {}: QP {qpn} receive ring: {e}; ignoring the ring from now on", pid());
                };
                if peek_entry(rq, buf, &mut q.broken, report, usize::MAX, whole).is_none() {
                    break;
                }
                match slot::decode_recv(buf, q.cap.max_recv_sge) {
                    Ok(wr) => match st.hca.post_recv(*qpn, wr, now, &mut st.mem) {
                        Ok(()) => q.counters.recv_wrs += 1,
                        Err(VerbsError::QueueFull) => {
                            q.rq_blocked = true;
                            break;
                        }
                        Err(_) => q.counters.rejected_wrs += 1,
                    },
                    Err(e) => {
                        q.counters.bad_wqes += 1;
                        self.bad_wqes += 1;
                        log!("client pid {}: QP {qpn}: {e}", pid());
                    }
                }
                rq.advance();
                work = true;
            }
        }
        for (id, s) in self.srqs.iter_mut() {
            if s.broken {
                continue;
            }
            s.blocked = false;
            loop {
                if peek_entry(&s.ring, buf, &mut s.broken, |_| {}, usize::MAX, whole).is_none() {
                    break;
                }
                match slot::decode_recv(buf, s.max_sge) {
                    Ok(wr) => match st.hca.post_srq_recv(*id, wr) {
                        Ok(()) => {}
                        Err(VerbsError::QueueFull) => {
                            s.blocked = true;
                            break;
                        }
                        Err(_) => {}
                    },
                    Err(_) => self.bad_wqes += 1,
                }
                s.ring.advance();
                work = true;
            }
        }
        work
    }

    /// Whether a work ring the device loop takes from has entries waiting.
    fn has_waiting_work(&self) -> bool {
        self.work_rings().any(|(r, idle)| !idle && r.pending().is_ok_and(|n| n > 0))
    }
}

struct SvcDevice {
    name: Mutex<String>,
    config: Mutex<DeviceConfig>,
    dev: Device,
    svc: Mutex<SvcState>,
    stop: AtomicBool,
    port_up: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The device loop's thread id (0 until it runs), for its CPU time in the stats.
    tid: AtomicI32,
    /// The daemon's device loops that poll, this one's among them.
    loops: Arc<Loops>,
}

/// CPU time (user + system) of thread `tid` of this process, from `/proc/self/task/<tid>/stat`
/// (clock-tick resolution); zero if unreadable.
fn thread_cpu(tid: i32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else { return Duration::ZERO };
    // After the command name, in parentheses: state is field 3, utime and stime fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(") ").map_or(vec![], |(_, r)| r.split(' ').collect());
    let ticks: u64 = fields.get(11..13).map_or(0, |f| f.iter().filter_map(|t| t.parse::<u64>().ok()).sum());
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros(ticks * 1_000_000 / hz)
}

/// Whether small writes into clients' own memory are handed to them to make
/// (`SOFTRDMA_PLACEMENTS=0`: no; client_place.rs).
fn placements_on() -> bool {
    std::env::var("SOFTRDMA_PLACEMENTS").map_or(true, |v| v != "0")
}

fn spin_time() -> Duration {
    let us = std::env::var("SOFTRDMA_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    Duration::from_micros(us)
}

/// Most bytes of writes to clients' memory a pass makes after publishing the completions that
/// wait for them (see `SvcDevice::pass`): where the system call's fixed cost is what they cost.
/// Larger writes take long enough that a receiver would wait for them anyway, and go first.
const EARLY_COMPLETIONS_MAX: usize = 4096;

/// A test hook, `SOFTRDMA_TEST_PASS_PAUSE_MS`: how long a pass whose first take of the receive
/// rings took something waits before it takes the send rings, so that a test can publish work
/// requests in between (crates/cli/tests/daemon.rs). Unset: no pause.
fn pass_pause() -> Option<Duration> {
    test_pause("SOFTRDMA_TEST_PASS_PAUSE_MS")
}

/// A test hook, `SOFTRDMA_TEST_WRITES_PAUSE_MS`: how long a pass that published completions
/// waiting for its writes to clients' memory waits before it makes them, so that a test can
/// poll them meanwhile (crates/cli/tests/daemon.rs). Unset: no pause.
fn writes_pause() -> Option<Duration> {
    test_pause("SOFTRDMA_TEST_WRITES_PAUSE_MS")
}

fn test_pause(var: &str) -> Option<Duration> {
    let ms: u64 = std::env::var(var).ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

impl SvcDevice {
    fn lock_svc(&self) -> MutexGuard<'_, SvcState> {
        self.svc.lock().expect("service state poisoned")
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.dev.wake();
        if let Some(t) = self.thread.lock().expect("thread slot").take() {
            let _ = t.join();
        }
    }

    fn broadcast(&self, ev: AsyncEvent) {
        let svc = self.lock_svc();
        if let Some(b) = encode_event(&ev) {
            for c in svc.clients.values() {
                let _ = c.events.send(&b);
            }
        }
        let _ = self.dev.wake();
    }

    /// The device loop.
    fn run(self: Arc<Self>) {
        // SAFETY: gettid has no arguments.
        self.tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
        let spin = spin_time();
        let mut last_work = StdInstant::now();
        let mut scratch = Scratch { pause: pass_pause(), writes_pause: writes_pause(), ..Scratch::default() };
        let mut waiter = self.loops.enter();
        while !self.stop.load(Ordering::Acquire) {
            if self.pass(&mut scratch) {
                last_work = StdInstant::now();
                continue;
            }
            match waiter.next(last_work.elapsed(), spin) {
                Wait::Spin => std::hint::spin_loop(),
                // On a machine with fewer cores than busy threads the clients (which poll their
                // CQ rings) need the core as much as we do.
                Wait::Yield => std::thread::yield_now(),
                Wait::Sleep => {
                    waiter.rest();
                    self.sleep();
                    waiter.wake();
                    last_work = StdInstant::now() - spin;
                }
            }
        }
    }

    /// Ask every work ring for a doorbell, then sleep until a packet, a doorbell, a wake-up or the
    /// next timer.
    fn sleep(&self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        {
            let mut svc = self.lock_svc();
            let mut empty = true;
            for (r, idle) in svc.work_rings() {
                // Every ring is asked, whatever the others say.
                empty &= r.request_doorbell() || idle;
            }
            if !empty {
                return;
            }
            svc.say_loop_cpu(None);
            for c in svc.clients.values() {
                fds.push(libc::pollfd { fd: c.doorbell.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            }
        }
        for (s, _) in self.dev.port.sockets() {
            fds.push(libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        fds.push(libc::pollfd { fd: self.dev.wake_fd(), events: libc::POLLIN, revents: 0 });
        // As the embedded I/O thread does: record when we will wake on our own, so that a deadline
        // armed meanwhile by a control call (a modify) that is earlier wakes us. The device's
        // same-host lanes ring their connection sockets as doorbells once asked to.
        let wait = {
            let mut st = self.dev.lock();
            for (s, _) in st.groups.sockets() {
                fds.push(libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            }
            if !st.link.sleep_prepare(&mut fds) {
                st.link.sleep_done();
                return;
            }
            let now = self.dev.now();
            let idle = now + Duration::from_millis(200);
            let wake_at = st.next_deadline().map_or(idle, |at| at.min(idle));
            st.io_wake_at = Some(wake_at);
            let wait = wake_at.saturating_since(now);
            // A full same-host lane: nothing tells us when the receiver makes room.
            if st.link.congested() {
                wait.min(crate::same_host::CONGESTED_WAIT)
            } else {
                wait
            }
        };
        let ts =
            libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
        // SAFETY: `fds` is a live array of pollfd of the length given; `ts` outlives the call.
        let woken = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        let mut svc = self.lock_svc();
        // Drain the doorbells (non-blocking eventfds; a read resets the count).
        let mut rung = false;
        for c in svc.clients.values() {
            let mut b = [0u8; 8];
            // SAFETY: reading 8 bytes into a live buffer from our non-blocking eventfd.
            rung |= unsafe { libc::read(c.doorbell.as_raw_fd(), b.as_mut_ptr() as *mut libc::c_void, 8) } == 8;
        }
        // A sleep that ran out while a work ring had entries and no doorbell had rung: one that
        // should have woken us did not come (a ring nobody asked; none expected). A doorbell rung
        // as the sleep ran out for a timer is not one.
        if woken == 0 && !rung && svc.has_waiting_work() {
            svc.late_wakeups += 1;
        }
        drop(svc);
        self.dev.drain_wake();
        let mut st = self.dev.lock();
        st.link.sleep_done();
        // Accept lanes and notice hang-ups now rather than at the next housekeeping period.
        let now = self.dev.now();
        st.link.maintain(now, true);
    }

    /// One pass over rings, network, timers, completions and events; true if anything happened.
    fn pass(&self, sc: &mut Scratch) -> bool {
        let mut svc = self.lock_svc();
        let svc = &mut *svc;
        svc.say_loop_cpu(poller::this_cpu().map(|cpu| (cpu, poller::this_id())));
        let mut guard = self.dev.lock();
        let st = &mut *guard;
        let now = self.dev.now();

        // Work requests: from the rings into the engine, while the engine takes them. Receives
        // first: a SEND between two QPs of this device is executed when it is taken (transport
        // hca/direct.rs) if its receive is already in the engine.
        let mut work = svc.take_recvs(st, now, &mut sc.buf);
        if let (true, Some(pause)) = (work, sc.pause) {
            std::thread::sleep(pause);
        }
        // Payloads in clients' own memory (reached by a system call per access) are read ahead
        // for the work requests the send rings hold now, one call per client (client_io.rs); the
        // pass then takes only those requests.
        let read_ahead = st.mem.has_process_regions();
        if read_ahead {
            sc.sges.clear();
            // A ring found broken is ignored (the loop below skips it).
            for q in svc.qps.values_mut().filter(|q| !q.broken) {
                // A ring broken now is found broken by the loop below.
                q.sq_read_ahead = q.sq.pending().unwrap_or(1);
                q.sq_decoded.clear();
                sc.buf.resize(q.sq.ring().slot_size() as usize, 0);
                for k in 0..q.sq_read_ahead {
                    let Ok(Some(n)) = q.sq.peek_used_at(k, &mut sc.buf, slot::SEND_HEADER, slot::send_used) else {
                        break;
                    };
                    let wr = slot::decode_send(&sc.buf[..n], q.cap.max_send_sge, q.cap.max_inline_data);
                    match &wr {
                        // A READ executed directly reads its target while it is taken.
                        Ok(SendWr { op: SendOp::Read { remote_addr, rkey }, payload: Payload::Sgl(sgl), .. }) => {
                            // The client's lengths: their sum may not fit (the READ then fails).
                            let length = sgl.iter().fold(0u32, |n, s| n.saturating_add(s.length));
                            sc.sges.push(Sge { addr: *remote_addr, length, lkey: *rkey });
                        }
                        // So does an atomic, its target's eight bytes.
                        Ok(SendWr {
                            op:
                                SendOp::CompareSwap { remote_addr, rkey, .. } | SendOp::FetchAdd { remote_addr, rkey, .. },
                            ..
                        }) => sc.sges.push(Sge { addr: *remote_addr, length: 8, lkey: *rkey }),
                        Ok(wr) if !wr.op.is_read_or_atomic() => {
                            if let Payload::Sgl(sgl) = &wr.payload {
                                sc.sges.extend_from_slice(sgl);
                            }
                        }
                        _ => {}
                    }
                    q.sq_decoded.push_back(wr);
                }
            }
            st.mem.prefetch(&sc.sges);
            // Until the requests are taken, a READ's or an atomic's target is read from there too.
            st.mem.serve_remote_reads(true);
        }
        let mut sends = false;
        for (qpn, q) in svc.qps.iter_mut() {
            let (taken, bad) = q.take_sends(*qpn, pid_of(&svc.clients, q.client), st, now, &mut sc.buf, read_ahead);
            sends |= taken;
            svc.bad_wqes += bad;
        }
        work |= sends;
        st.mem.serve_remote_reads(false);
        // A client that posted receives to one QP and then sends to it from another may have
        // published both while the receives above were taken: the sends were taken, and their
        // packets are delivered by the progress below, so the receives published before them go
        // into the engine first (a UD datagram finding none is dropped, an RC SEND NAKed for RNR).
        if sends {
            work |= svc.take_recvs(st, now, &mut sc.buf);
        }
        // Network and timers.
        let before = (st.hca.counters().rcvd_pkts, st.hca.counters().sent_pkts);
        self.dev.progress(st);
        work |= before != (st.hca.counters().rcvd_pkts, st.hca.counters().sent_pkts);
        work |= route_cm_all(&self.dev, svc, st);

        // Completions: from the engine into the CQ rings. Writes to clients' memory still kept
        // behind (data in a process_vm region: a system call) are made first, unless a receive,
        // READ or atomic completes (its data is what its poller waits for) and they are few
        // (`early`): then after the completions are published, which name their CQ's next
        // batch; the client hands one out once its ring says that batch is made
        // (`Ring::writes_made`). Published first, such a completion is found by its client's next
        // look instead of after the call, during which a client that finds nothing gives its CPU
        // away (PERFORMANCE.md, session 21). Without one (an RDMA WRITE, whose target may watch
        // its memory rather than a CQ) the writes go first.
        st.mem.hand_out();
        let waiting = st.mem.writes_waiting();
        let early =
            (1..=EARLY_COMPLETIONS_MAX).contains(&waiting) && svc.cqs.keys().any(|id| st.hca.cq_brings_data(*id));
        if !early {
            st.mem.write_pending();
        }
        sc.published.clear();
        for (id, c) in svc.cqs.iter_mut() {
            // The engine's side first, and the ring's room as last known: its free count reads
            // the index its client keeps writing (a cache line from the client's core).
            if st.hca.cq_is_empty(*id) {
                continue;
            }
            let free = c.ring.room() as usize;
            if free == 0 {
                continue;
            }
            sc.wcs.clear();
            if st.hca.poll_cq(*id, free, &mut sc.wcs).unwrap_or(0) == 0 {
                continue;
            }
            work = true;
            if early {
                c.batch = c.batch.wrapping_add(1).max(1);
            }
            let mut slot = [0u8; CQE_LEN];
            let mut notify = false;
            let places = st.mem.placements_end(c.pid);
            for wc in &sc.wcs {
                slot::encode_cqe(wc, &mut slot);
                if early {
                    slot::set_cqe_writes(&mut slot, c.batch);
                }
                if let Some(end) = places {
                    slot::set_cqe_places(&mut slot, end);
                }
                c.ring.push(&slot);
                if let Some(q) = svc.qps.get_mut(&wc.qp_num) {
                    q.counters.completions += 1;
                    if wc.status != WcStatus::Success {
                        q.counters.error_completions += 1;
                    }
                }
                notify |= wc.status != WcStatus::Success || wc.opcode.is_receive();
            }
            if early {
                // Its channel is told once the writes are made (below): a client woken by the
                // event, or arming after it, finds the batch made.
                sc.published.push((*id, notify));
            } else {
                fence(Ordering::SeqCst);
                wake_channel(c, *id, notify, &svc.channels);
            }
        }
        if early {
            if let (false, Some(pause)) = (sc.published.is_empty(), sc.writes_pause) {
                std::thread::sleep(pause);
            }
            st.mem.write_pending();
            for (id, _) in &sc.published {
                if let Some(c) = svc.cqs.get(id) {
                    c.ring.ring().say_writes_made(c.batch);
                }
            }
            // One of the two sees the other: this load of the arming after the fence, or the
            // client's poll after it armed (`Cq::req_notify`) the batch made.
            fence(Ordering::SeqCst);
            for &(id, notify) in &sc.published {
                if let Some(c) = svc.cqs.get(&id) {
                    wake_channel(c, id, notify, &svc.channels);
                }
            }
        }

        // Async events: to the client owning the object.
        while let Some(ev) = st.async_events.pop_front() {
            work = true;
            let owner = match ev {
                AsyncEvent::CommEstablished(q)
                | AsyncEvent::SqDrained(q)
                | AsyncEvent::QpLastWqeReached(q)
                | AsyncEvent::QpRequestError(q)
                | AsyncEvent::QpAccessError(q)
                | AsyncEvent::QpFatal(q) => svc.qps.get(&q).map(|e| e.client),
                AsyncEvent::SrqLimitReached(s) => svc.srqs.get(&s).map(|e| e.client),
                AsyncEvent::CqError(cq) => {
                    let e = svc.cqs.get_mut(&cq);
                    if let Some(e) = e {
                        if !e.overflow_logged {
                            e.overflow_logged = true;
                            let pid = svc.clients.get(&e.client).map_or(0, |c| c.pid);
                            log!("client pid {pid}: CQ {} overflowed (the client does not poll it); completions are being dropped", cq.0);
                        }
                        Some(e.client)
                    } else {
                        None
                    }
                }
                _ => None,
            };
            if let (Some(c), Some(b)) = (owner.and_then(|o| svc.clients.get(&o)), encode_event(&ev)) {
                let _ = c.events.send(&b);
            }
        }
        // The completions of the requests read ahead for are out: what was read is not theirs
        // to use any more.
        st.mem.forget_prefetched();
        work
    }

    fn stats(&self) -> DeviceStats {
        let device_cpu = thread_cpu(self.tid.load(Ordering::Relaxed));
        let svc = self.lock_svc();
        let st = self.dev.lock();
        let c = st.hca.counters();
        let mut counters: Vec<(String, u64)> = [
            ("sent_pkts", c.sent_pkts),
            ("rcvd_pkts", c.rcvd_pkts),
            ("sent_bytes", c.sent_bytes),
            ("rcvd_bytes", c.rcvd_bytes),
            ("retransmits", c.retransmits),
            ("retry_rounds", c.retry_rounds),
            ("ack_timeouts", c.ack_timeouts),
            ("rcvd_seq_err", c.rcvd_seq_err),
            ("send_err_nak", c.send_err_nak),
            ("rcvd_err_nak", c.rcvd_err_nak),
            ("send_rnr_nak", c.send_rnr_nak),
            ("rcvd_rnr_err", c.rcvd_rnr_err),
            ("duplicate_request", c.duplicate_request),
            ("out_of_seq_request", c.out_of_seq_request),
            ("drop_malformed", c.drop_malformed),
            ("drop_unknown_qp", c.drop_unknown_qp),
            ("drop_bad_state", c.drop_bad_state),
            ("drop_pkey", c.drop_pkey),
            ("drop_qkey", c.drop_qkey),
            ("drop_no_recv", c.drop_no_recv),
            ("drop_uc_msg", c.drop_uc_msg),
            ("drop_stray_resp", c.drop_stray_resp),
            ("cq_overflow", c.cq_overflow),
            ("icrc_errors", st.verify.bad),
            ("icrc_verified", st.verify.verified),
            ("icrc_recovered_id", st.verify.recovered),
            ("device_thread_cpu_us", device_cpu.as_micros() as u64),
            ("tx_errors", st.tx_errors),
            ("client_writes_lost", st.mem.lost_writes()),
            ("client_read_calls", st.mem.client_calls().0),
            ("client_write_calls", st.mem.client_calls().1),
            ("client_placements", st.mem.placement_counts().handed_out),
            ("client_placements_taken_back", st.mem.placement_counts().taken_back),
            ("client_placements_given_up", st.mem.placement_counts().given_up),
            ("bad_wqes", svc.bad_wqes),
            ("late_wakeups", svc.late_wakeups),
            ("port_active", u64::from(self.port_up.load(Ordering::Relaxed))),
            ("objects_clients", svc.clients.len() as u64),
            ("objects_pds", svc.pds.len() as u64),
            ("objects_mrs", svc.mrs.len() as u64),
            ("objects_cqs", svc.cqs.len() as u64),
            ("objects_qps", svc.qps.len() as u64),
            ("objects_srqs", svc.srqs.len() as u64),
            ("objects_channels", svc.channels.len() as u64),
            ("objects_cm_ids", svc.cm_ids.len() as u64),
            ("objects_cm_channels", svc.cm_channels.len() as u64),
            ("engine_mrs", st.mem.len() as u64),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        counters.extend(st.link.stats().named());
        counters.shrink_to_fit();
        let qps: Vec<QpStats> = svc
            .qps
            .iter()
            .map(|(qpn, q)| {
                let t = st.qp_traffic.as_ref().and_then(|m| m.get(*qpn)).copied().unwrap_or_default();
                let pid = svc.clients.get(&q.client).map_or(0, |c| c.pid);
                let k = &q.counters;
                let e = &t.engine;
                let list = [
                    ("sent_pkts", t.pkts[0]),
                    ("sent_bytes", t.pkts[1]),
                    ("rcvd_pkts", t.pkts[2]),
                    ("rcvd_bytes", t.pkts[3]),
                    ("retransmits", e.retransmits),
                    ("retry_rounds", e.retry_rounds),
                    ("rcvd_seq_err", e.rcvd_seq_err),
                    ("out_of_seq_request", e.out_of_seq_request),
                    ("duplicate_request", e.duplicate_request),
                    ("send_err_nak", e.send_err_nak),
                    ("rcvd_err_nak", e.rcvd_err_nak),
                    ("send_rnr_nak", e.send_rnr_nak),
                    ("rcvd_rnr_err", e.rcvd_rnr_err),
                    ("drop_bad_state", e.drop_bad_state),
                    ("drop_pkey", e.drop_pkey),
                    ("drop_qkey", e.drop_qkey),
                    ("drop_no_recv", e.drop_no_recv),
                    ("drop_uc_msg", e.drop_uc_msg),
                    ("drop_stray_resp", e.drop_stray_resp),
                    ("cq_overflow", e.cq_overflow),
                    ("send_wrs", k.send_wrs),
                    ("recv_wrs", k.recv_wrs),
                    ("completions", k.completions),
                    ("error_completions", k.error_completions),
                    ("bad_wqes", k.bad_wqes),
                    ("rejected_wrs", k.rejected_wrs),
                ];
                (qpn.value(), pid, list.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            })
            .collect();
        DeviceStats { name: String::new(), counters, qps }
    }

    /// A client went away: free everything it held, as the kernel does when a process exits.
    fn remove_client(&self, id: u64) {
        let mut svc = self.lock_svc();
        let svc = &mut *svc;
        let mut st = self.dev.lock();
        let st = &mut *st;
        let Some(c) = svc.clients.remove(&id) else { return };
        // CM IDs first: disconnecting sends DREQs and moves the client's QPs to ERR while they
        // still exist.
        let cm_ids: Vec<u32> = svc.cm_ids.iter().filter(|(_, e)| e.client == id).map(|(k, _)| *k).collect();
        if !cm_ids.is_empty() {
            let now = self.dev.now();
            for i in &cm_ids {
                let _ = st.cm.agent.destroy_id(softrdma_cm::IdHandle(*i), now);
                svc.cm_ids.remove(i);
            }
            self.dev.flush(st, now);
        }
        svc.cm_channels.retain(|_, ch| ch.client != id);
        route_cm_all(&self.dev, svc, st);
        let qps: Vec<Qpn> = svc.qps.iter().filter(|(_, q)| q.client == id).map(|(k, _)| *k).collect();
        for q in &qps {
            let _ = st.destroy_qp(*q);
            svc.qps.remove(q);
        }
        let srqs: Vec<SrqId> = svc.srqs.iter().filter(|(_, s)| s.client == id).map(|(k, _)| *k).collect();
        for s in &srqs {
            let _ = st.hca.destroy_srq(*s);
            svc.srqs.remove(s);
        }
        let cqs: Vec<CqId> = svc.cqs.iter().filter(|(_, c)| c.client == id).map(|(k, _)| *k).collect();
        for cq in &cqs {
            let _ = st.hca.destroy_cq(*cq);
            svc.cqs.remove(cq);
        }
        // Before its regions go (which would make what waits in the ring, into a process that
        // may be gone).
        st.mem.detach_placements(c.pid);
        let mrs: Vec<u32> = svc.mrs.iter().filter(|(_, c)| **c == id).map(|(k, _)| *k).collect();
        for k in &mrs {
            st.mem.remove(*k);
            svc.mrs.remove(k);
        }
        let pds = svc.pds.len();
        svc.pds.retain(|_, c| *c != id);
        let pds = pds - svc.pds.len();
        svc.channels.retain(|_, (c, _)| *c != id);
        svc.generation += 1;
        if qps.len() + srqs.len() + cqs.len() + mrs.len() + pds + cm_ids.len() > 0 {
            log!(
                "client pid {} uid {} gone: freed {} QPs, {} CQs, {} SRQs, {} MRs, {} PDs, {} CM IDs",
                c.pid,
                c.uid,
                qps.len(),
                cqs.len(),
                srqs.len(),
                mrs.len(),
                pds,
                cm_ids.len()
            );
        }
    }
}

#[derive(Default)]
struct Scratch {
    buf: Vec<u8>,
    wcs: Vec<WorkCompletion>,
    /// The SGEs of the work requests a pass reads ahead for.
    sges: Vec<Sge>,
    /// The CQs a pass published completions to that wait for its writes (each names its own
    /// batch: `CqEntry::batch`), and whether any of them may wake a channel armed for solicited
    /// completions (an error or a receive).
    published: Vec<(CqId, bool)>,
    /// [`pass_pause`].
    pause: Option<Duration>,
    /// [`writes_pause`].
    writes_pause: Option<Duration>,
}

// ---- one session --------------------------------------------------------------------------------

struct Session {
    d: Arc<Daemon>,
    id: u64,
    cred: PeerCred,
    dev: Option<Arc<SvcDevice>>,
}

type Reply = Result<(Response, Vec<OwnedFd>), Refusal>;

fn ok(r: Response) -> Reply {
    Ok((r, Vec::new()))
}

/// The checks every region registration passes first: the PD is the client's (`own_pd`), remote
/// write and atomic rights come with local write, and the range fits the device and the address
/// space. Returns the rights.
fn region_rights(own_pd: bool, addr: u64, len: u64, access: u32, max_mr_size: u64) -> Result<Access, Refusal> {
    if !own_pd {
        return Err(nso());
    }
    let access = Access::from_bits(access);
    let needs_local_write = access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
    if needs_local_write && !access.contains(Access::LOCAL_WRITE) {
        return Err(Refusal::InvalidArgument("REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too".into()));
    }
    if len > max_mr_size || addr.checked_add(len).is_none() {
        return Err(Refusal::InvalidArgument(format!("memory region of {len} bytes is too large")));
    }
    Ok(access)
}

fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: plain eventfd(2).
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the daemon can reach `len` bytes at `addr` in `pid` (probes the first and last byte).
fn probe(pid: u32, addr: u64, len: u64) -> Result<(), Refusal> {
    if len == 0 {
        return Ok(());
    }
    for a in [addr, addr + len - 1] {
        let mut b = 0u8;
        let l = libc::iovec { iov_base: &mut b as *mut u8 as *mut libc::c_void, iov_len: 1 };
        let r = libc::iovec { iov_base: a as *mut libc::c_void, iov_len: 1 };
        // SAFETY: the local iovec covers one live byte; the remote one is only interpreted by the
        // kernel in `pid`'s address space.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0) };
        if n != 1 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) => Refusal::PermissionDenied(format!(
                    "softrdmad cannot reach the memory of pid {pid} (ptrace access); run it as root, or as the same user"
                )),
                _ => Refusal::InvalidArgument(format!("address {a:#x} is not mapped in the registering process")),
            });
        }
    }
    Ok(())
}

/// Whether `len` bytes at `addr` in `pid` are mapped throughout, readable and, if `writable`,
/// writable (`/proc/<pid>/maps`), as the kernel's `ibv_reg_mr` requires of the pages it pins: the
/// device's writes into such a region are made after the fact (verbs client_io.rs), when a refusal
/// could no longer fail the request. `Ok(true)` if any of it is a shared mapping (memory another
/// process, or another mapping of this one, may reach too).
fn mapped(pid: u32, addr: u64, len: u64, writable: bool) -> Result<bool, Refusal> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| Refusal::PermissionDenied(format!("softrdmad cannot read the mappings of pid {pid}: {e}")))?;
    let (mut at, end) = (addr, addr.saturating_add(len));
    let mut shared = false;
    for line in maps.lines() {
        if at >= end {
            break;
        }
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let Some((lo, hi)) = range.split_once('-') else { continue };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else { continue };
        if hi <= at {
            continue;
        }
        if lo > at {
            break;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') || (writable && p.get(1) != Some(&b'w')) {
            let what = if writable { "readable and writable" } else { "readable" };
            return Err(Refusal::InvalidArgument(format!(
                "address {at:#x} is not {what} in the registering process ({perms})"
            )));
        }
        shared |= p.get(3) == Some(&b's');
        at = hi;
    }
    if at < end {
        return Err(Refusal::InvalidArgument(format!("address {at:#x} is not mapped in the registering process")));
    }
    Ok(shared)
}

impl Session {
    fn dev(&self) -> Result<&Arc<SvcDevice>, Refusal> {
        self.dev.as_ref().ok_or_else(|| Refusal::InvalidArgument("no device opened on this connection".into()))
    }

    fn handle(&mut self, req: Request, fds: Vec<OwnedFd>) -> Reply {
        let d = Arc::clone(&self.d);
        match req {
            Request::Hello => ok(Response::Hello { daemon_pid: std::process::id() }),
            Request::ListDevices => {
                let reg = d.reg.lock().expect("registry");
                ok(Response::Devices(reg.devices().iter().map(|c| d.entry(&reg, c)).collect()))
            }
            Request::OpenDevice { name } => self.open(&name),
            Request::Stats { device } => ok(Response::Stats(d.stats(device.as_deref())?)),
            Request::LinkAdd { name, netdev, addr } => {
                d.admin(&self.cred)?;
                let mut c = DeviceConfig::new(name, netdev);
                if let Some(a) = addr {
                    c = c.with_addr(a);
                }
                d.link_add(c)?;
                ok(Response::Ok)
            }
            Request::LinkDelete { name } => {
                d.admin(&self.cred)?;
                d.link_delete(&name)?;
                ok(Response::Ok)
            }
            Request::Rename { name, new_name } => {
                d.admin(&self.cred)?;
                d.rename(&name, &new_name)?;
                ok(Response::Ok)
            }
            Request::RoceMode { name, port, v1 } => {
                d.admin(&self.cred)?;
                d.roce_mode(&name, port, v1)?;
                ok(Response::Ok)
            }
            other => {
                let dev = Arc::clone(self.dev()?);
                self.verb(&dev, other, fds)
            }
        }
    }

    fn open(&mut self, name: &str) -> Reply {
        if self.dev.is_some() {
            return Err(Refusal::InvalidArgument("this connection already has a device open".into()));
        }
        let dev = self.d.device(name).ok_or_else(|| Refusal::UnknownDevice(name.into()))?;
        let entry = {
            let reg = self.d.reg.lock().expect("registry");
            let c = reg.find(name).map_err(|_| Refusal::UnknownDevice(name.into()))?.clone();
            self.d.entry(&reg, &c)
        };
        let io = |e: std::io::Error| Refusal::Other(format!("creating the client's doorbell: {e}"));
        let doorbell = eventfd().map_err(io)?;
        let (mine, theirs) = UnixDatagram::pair().map_err(io)?;
        mine.set_nonblocking(true).map_err(io)?;
        let mut out = vec![doorbell.try_clone().map_err(io)?, OwnedFd::from(theirs)];
        {
            let mut svc = dev.lock_svc();
            let placements = dev.dev.lock().mem.attach_placements(self.cred.pid);
            out.push(placements.map_err(|e| Refusal::Other(format!("creating the client's placement ring: {e}")))?);
            svc.clients.insert(
                self.id,
                ClientEntry { pid: self.cred.pid, uid: self.cred.uid, doorbell, events: mine, objects: 0 },
            );
            svc.generation += 1;
        }
        let _ = dev.dev.wake();
        self.dev = Some(dev);
        Ok((Response::Opened(entry), out))
    }

    /// Verbs on the open device. Every object is checked to belong to this client.
    fn verb(&mut self, dev: &Arc<SvcDevice>, req: Request, mut fds: Vec<OwnedFd>) -> Reply {
        let me = self.id;
        let attr = dev.dev.info.attr.clone();
        let mut svc = dev.lock_svc();
        let svc = &mut *svc;
        let objects = svc.clients.get(&me).map_or(0, |c| c.objects);
        let creates = matches!(
            req,
            Request::AllocPd
                | Request::RegMr { .. }
                | Request::RegMrShared { .. }
                | Request::CreateChannel
                | Request::CreateCq { .. }
                | Request::CreateSrq { .. }
                | Request::CreateQp { .. }
                | Request::CmCreateChannel
                | Request::CmCreateId { .. }
        );
        if creates && objects >= MAX_OBJECTS_PER_CLIENT {
            return Err(Refusal::Verbs(VerbsError::CapacityExceeded("objects per client")));
        }
        let count = |svc: &mut SvcState, delta: i32| {
            if let Some(c) = svc.clients.get_mut(&me) {
                c.objects = c.objects.saturating_add_signed(delta);
            }
        };
        let owns_pd = |svc: &SvcState, pd: u32| svc.pds.get(&pd) == Some(&me);
        let io = |what: &'static str| move |e: std::io::Error| Refusal::Other(format!("{what}: {e}"));
        match req {
            Request::AllocPd => {
                let id = {
                    let mut st = dev.dev.lock();
                    st.next_pd += 1;
                    st.next_pd
                };
                svc.pds.insert(id, me);
                count(svc, 1);
                ok(Response::Id(id))
            }
            Request::DeallocPd { pd } => {
                if !owns_pd(svc, pd) {
                    return Err(nso());
                }
                svc.pds.remove(&pd);
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::RegMr { pd, addr, len, access } => {
                let access = region_rights(owns_pd(svc, pd), addr, len, access, attr.max_mr_size)?;
                probe(self.cred.pid, addr, len)?;
                let writes = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_ATOMIC);
                let writable = access.bits() & writes.bits() != 0;
                let shared = mapped(self.cred.pid, addr, len, writable)?;
                let key = dev.dev.lock().mem.insert_remote(PdId(pd), self.cred.pid, addr, len as usize, access, shared);
                svc.mrs.insert(key, me);
                count(svc, 1);
                ok(Response::Id(key))
            }
            Request::RegMrShared { pd, addr, len, access } => {
                let access = region_rights(owns_pd(svc, pd), addr, len, access, attr.max_mr_size)?;
                if !self.d.opts.shared_regions {
                    return Err(Refusal::InvalidArgument(format!(
                        "{SHARED_REGION_REFUSED}: off (softrdma daemon --no-shared-regions)"
                    )));
                }
                let [fd] = <[OwnedFd; 1]>::try_from(fds).map_err(|f| {
                    Refusal::InvalidArgument(format!(
                        "a shared memory region comes with exactly one memfd ({} descriptors sent)",
                        f.len()
                    ))
                })?;
                if addr % softrdma_abi::shm::PAGE as u64 != 0 {
                    // The client's mapping starts on a page: anything else would misalign the
                    // daemon's 8-byte atomics against the client's addresses.
                    return Err(Refusal::InvalidArgument(format!(
                        "{SHARED_REGION_REFUSED}: address {addr:#x} is not page aligned"
                    )));
                }
                let map = RegionMap::open_client(&fd, len as usize)
                    .map_err(|e| Refusal::InvalidArgument(format!("{SHARED_REGION_REFUSED}: {e}")))?;
                drop(fd);
                let key = dev.dev.lock().mem.insert_mapped(PdId(pd), map, addr, len as usize, access);
                svc.mrs.insert(key, me);
                count(svc, 1);
                ok(Response::Id(key))
            }
            Request::DeregMr { key } => {
                if svc.mrs.get(&key) != Some(&me) {
                    return Err(nso());
                }
                dev.dev.lock().mem.remove(key);
                svc.mrs.remove(&key);
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::CreateChannel => {
                let fd = fds.pop().ok_or_else(|| Refusal::InvalidArgument("CreateChannel needs a socket".into()))?;
                let sock = UnixDatagram::from(fd);
                sock.set_nonblocking(true).map_err(io("completion channel"))?;
                svc.next_channel += 1;
                let id = svc.next_channel;
                svc.channels.insert(id, (me, sock));
                count(svc, 1);
                ok(Response::Id(id))
            }
            Request::DestroyChannel { id } => {
                if svc.channels.get(&id).map(|c| c.0) != Some(me) {
                    return Err(nso());
                }
                svc.channels.remove(&id);
                for c in svc.cqs.values_mut() {
                    if c.channel == Some(id) {
                        c.channel = None;
                    }
                }
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::CreateCq { cqe, channel } => {
                if cqe == 0 || cqe > attr.max_cqe {
                    return Err(Refusal::InvalidArgument(format!("CQ size {cqe} outside 1..={}", attr.max_cqe)));
                }
                if channel.is_some_and(|ch| svc.channels.get(&ch).map(|c| c.0) != Some(me)) {
                    return Err(nso());
                }
                let capacity = cqe.next_power_of_two();
                let shm = Shm::create("softrdma-cq", ring_bytes(capacity, CQE_LEN as u32)).map_err(io("CQ ring"))?;
                let ring = shm.ring(0, capacity, CQE_LEN as u32).map_err(io("CQ ring"))?;
                ring.init();
                ring.set_producer_cpu(svc.loop_cpu);
                let id = dev.dev.lock().hca.create_cq(cqe);
                let fd = shm.fd().try_clone().map_err(io("CQ ring"))?;
                svc.cqs.insert(
                    id,
                    CqEntry {
                        client: me,
                        pid: self.cred.pid,
                        ring: Producer::new(ring),
                        batch: 0,
                        channel,
                        overflow_logged: false,
                        _shm: shm,
                    },
                );
                count(svc, 1);
                Ok((Response::Cq { id: id.0, capacity }, vec![fd]))
            }
            Request::DestroyCq { cq } => {
                let id = CqId(cq);
                if svc.cqs.get(&id).map(|c| c.client) != Some(me) {
                    return Err(nso());
                }
                let mut st = dev.dev.lock();
                st.hca.destroy_cq(id).map_err(Refusal::Verbs)?;
                // Its completions can no longer be polled, and their buffers are the
                // application's again: what waits for the client to make is made now.
                st.mem.make_placements(self.cred.pid);
                drop(st);
                svc.cqs.remove(&id);
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::CreateSrq { pd, max_wr, max_sge } => {
                if !owns_pd(svc, pd) {
                    return Err(nso());
                }
                if max_wr == 0 || max_wr > attr.max_srq_wr || max_sge > attr.max_srq_sge {
                    return Err(Refusal::InvalidArgument(format!(
                        "SRQ of {max_wr} WRs x {max_sge} SGEs exceeds max_srq_wr {} / max_srq_sge {}",
                        attr.max_srq_wr, attr.max_srq_sge
                    )));
                }
                let capacity = max_wr.next_power_of_two();
                let slot_size = slot::recv_slot_size(max_sge);
                let shm = Shm::create("softrdma-srq", ring_bytes(capacity, slot_size)).map_err(io("SRQ ring"))?;
                let ring = shm.ring(0, capacity, slot_size).map_err(io("SRQ ring"))?;
                ring.init();
                let id = dev.dev.lock().hca.create_srq(max_wr, max_sge);
                let fd = shm.fd().try_clone().map_err(io("SRQ ring"))?;
                svc.srqs.insert(
                    id,
                    SrqEntry {
                        client: me,
                        max_sge,
                        ring: Consumer::new(ring),
                        broken: false,
                        blocked: false,
                        _shm: shm,
                    },
                );
                count(svc, 1);
                // The device loop may be asleep having asked the rings it knew for doorbells: it
                // goes round once more and asks this one too.
                let _ = dev.dev.wake();
                Ok((Response::Srq { id: id.0, capacity, slot_size }, vec![fd]))
            }
            Request::ArmSrq { srq, limit } => {
                let id = SrqId(srq);
                if svc.srqs.get(&id).map(|s| s.client) != Some(me) {
                    return Err(nso());
                }
                dev.dev.lock().hca.arm_srq(id, limit).map_err(Refusal::Verbs)?;
                ok(Response::Ok)
            }
            Request::DestroySrq { srq } => {
                let id = SrqId(srq);
                if svc.srqs.get(&id).map(|s| s.client) != Some(me) {
                    return Err(nso());
                }
                let mut st = dev.dev.lock();
                st.hca.destroy_srq(id).map_err(Refusal::Verbs)?;
                // As for a CQ: its buffers are the application's again.
                st.mem.make_placements(self.cred.pid);
                drop(st);
                svc.srqs.remove(&id);
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::CreateQp { pd, qp_type, send_cq, recv_cq, srq, cap, sq_sig_all, copy_room } => {
                if !owns_pd(svc, pd) {
                    return Err(nso());
                }
                for cq in [send_cq, recv_cq] {
                    if svc.cqs.get(&CqId(cq)).map(|c| c.client) != Some(me) {
                        return Err(nso());
                    }
                }
                if srq.is_some_and(|s| svc.srqs.get(&SrqId(s)).map(|e| e.client) != Some(me)) {
                    return Err(nso());
                }
                if cap.max_send_wr > attr.max_qp_wr || cap.max_recv_wr > attr.max_qp_wr {
                    return Err(Refusal::InvalidArgument(format!("queue depth above max_qp_wr {}", attr.max_qp_wr)));
                }
                if cap.max_send_sge > attr.max_sge || cap.max_recv_sge > attr.max_sge {
                    return Err(Refusal::InvalidArgument(format!("SGE count above max_sge {}", attr.max_sge)));
                }
                if cap.max_inline_data > 4096 {
                    return Err(Refusal::InvalidArgument("max_inline_data above 4096".into()));
                }
                let sq_capacity = cap.max_send_wr.max(1).next_power_of_two();
                // Room for a small payload the client copies in when it posts, as it asks (at
                // most `COPY_ROOM`); inline data the application asks for stays within its
                // `max_inline_data` (the client's library checks).
                let room = cap.max_inline_data.max(copy_room.min(slot::COPY_ROOM));
                let sq_slot = slot::send_slot_size(cap.max_send_sge, room);
                let rq_offset = ring_bytes(sq_capacity, sq_slot).next_multiple_of(64);
                let rq_capacity = cap.max_recv_wr.max(1).next_power_of_two();
                let rq_slot = slot::recv_slot_size(cap.max_recv_sge);
                let len = if srq.is_some() { rq_offset } else { rq_offset + ring_bytes(rq_capacity, rq_slot) };
                let shm = Shm::create("softrdma-qp", len).map_err(io("QP rings"))?;
                let sq = shm.ring(0, sq_capacity, sq_slot).map_err(io("QP rings"))?;
                sq.init();
                let rq = if srq.is_some() {
                    None
                } else {
                    let r = shm.ring(rq_offset, rq_capacity, rq_slot).map_err(io("QP rings"))?;
                    r.init();
                    Some(Consumer::new(r))
                };
                // The engine, and the decoding of the ring's slots, take what the slot holds as
                // inline data: a payload the client copied in may pass the application's
                // `max_inline_data`.
                let cap = QpCap { max_inline_data: slot::inline_room(sq_slot), ..cap };
                let init = QpInit {
                    qp_type,
                    pd: PdId(pd),
                    send_cq: CqId(send_cq),
                    recv_cq: CqId(recv_cq),
                    srq: srq.map(SrqId),
                    cap,
                    sq_sig_all,
                };
                let qpn = {
                    let mut st = dev.dev.lock();
                    let qpn = st.hca.create_qp(init).map_err(Refusal::Verbs)?;
                    if let Some(m) = st.qp_traffic.as_mut() {
                        m.insert(qpn);
                    }
                    qpn
                };
                let fd = shm.fd().try_clone().map_err(io("QP rings"))?;
                svc.qps.insert(
                    qpn,
                    QpEntry {
                        client: me,
                        cap,
                        sq: Consumer::new(sq),
                        rq,
                        counters: QpCounters::default(),
                        broken: false,
                        sq_blocked: false,
                        sq_read_ahead: 0,
                        sq_decoded: VecDeque::new(),
                        rq_blocked: false,
                        _shm: shm,
                    },
                );
                count(svc, 1);
                // As for an SRQ: a sleeping device loop asks the new rings for doorbells too (else
                // the first posts wait for its idle timeout, 200 ms).
                let _ = dev.dev.wake();
                let resp = Response::Qp {
                    qpn: qpn.value(),
                    sq_capacity,
                    sq_slot,
                    rq_capacity,
                    rq_slot,
                    rq_offset: rq_offset as u64,
                };
                Ok((resp, vec![fd]))
            }
            Request::ModifyQp { qpn, attr: m } => {
                let qpn = Qpn::new(qpn);
                if svc.qps.get(&qpn).map(|q| q.client) != Some(me) {
                    return Err(nso());
                }
                if let Some(av) = &m.av {
                    dev.dev
                        .info
                        .gid(1, usize::from(av.sgid_index))
                        .map_err(|e| Refusal::InvalidArgument(e.to_string()))?;
                }
                dev.dev
                    .run(|st, now| {
                        // A drain (SQD) includes them, as do the flush completions of ERR.
                        take_posted(dev, svc, qpn, st, now);
                        dev.dev.modify_qp(st, qpn, &m, now)?;
                        // Reset or error: the application may take the QP's buffers back
                        // without polling (as after a destroy).
                        if matches!(m.state, Some(QpState::Reset | QpState::Err)) {
                            st.mem.make_placements(self.cred.pid);
                        }
                        Ok(())
                    })
                    .map_err(Refusal::Verbs)?;
                ok(Response::Ok)
            }
            Request::QueryQp { qpn } => {
                let qpn = Qpn::new(qpn);
                if svc.qps.get(&qpn).map(|q| q.client) != Some(me) {
                    return Err(nso());
                }
                let info = dev.dev.lock().hca.query_qp(qpn).map_err(Refusal::Verbs)?;
                ok(Response::QpInfo(info))
            }
            Request::DestroyQp { qpn } => {
                let qpn = Qpn::new(qpn);
                if svc.qps.get(&qpn).map(|q| q.client) != Some(me) {
                    return Err(nso());
                }
                // A sender that posts and destroys at once (as `mckey -s` does) loses nothing.
                dev.dev
                    .run(|st, now| {
                        take_posted(dev, svc, qpn, st, now);
                        st.destroy_qp(qpn)?;
                        // Its buffers are the application's again (see DestroyCq).
                        st.mem.make_placements(self.cred.pid);
                        Ok(())
                    })
                    .map_err(Refusal::Verbs)?;
                svc.qps.remove(&qpn);
                count(svc, -1);
                ok(Response::Ok)
            }
            Request::AttachMcast { qpn, mgid } | Request::DetachMcast { qpn, mgid } => {
                let qpn = Qpn::new(qpn);
                if svc.qps.get(&qpn).map(|q| q.client) != Some(me) {
                    return Err(nso());
                }
                match req {
                    Request::AttachMcast { .. } => dev.dev.attach_mcast(qpn, mgid),
                    _ => dev.dev.detach_mcast(qpn, mgid),
                }
                .map_err(refuse)?;
                ok(Response::Ok)
            }
            req @ (Request::CmCreateChannel
            | Request::CmDestroyChannel { .. }
            | Request::CmCreateId { .. }
            | Request::CmDestroyId { .. }
            | Request::CmBind { .. }
            | Request::CmResolveAddr { .. }
            | Request::CmResolveRoute { .. }
            | Request::CmListen { .. }
            | Request::CmConnect { .. }
            | Request::CmAccept { .. }
            | Request::CmReject { .. }
            | Request::CmDisconnect { .. }
            | Request::CmMigrate { .. }
            | Request::CmQuery { .. }
            | Request::CmGetEvent { .. }
            | Request::CmIdCount
            | Request::CmSetNoListenerRetries { .. }
            | Request::CmEstablish { .. }
            | Request::CmInitQpAttr { .. }) => {
                let r = cm_verb(dev, svc, me, req, fds);
                let mut st = dev.dev.lock();
                if route_cm_all(&dev.dev, svc, &mut st) {
                    drop(st);
                    let _ = dev.dev.wake();
                }
                r
            }
            _ => Err(Refusal::InvalidArgument("request not valid here".into())),
        }
    }
}

/// The RDMA CM calls of client `me`: every ID and channel is checked to belong to it, and the QP
/// a connection drives must be its own.
fn cm_verb(dev: &SvcDevice, svc: &mut SvcState, me: u64, req: Request, mut fds: Vec<OwnedFd>) -> Reply {
    use softrdma_cm::{CmAgent, CmError, IdHandle};
    let count = |svc: &mut SvcState, delta: i32| {
        if let Some(c) = svc.clients.get_mut(&me) {
            c.objects = c.objects.saturating_add_signed(delta);
        }
    };
    let own_id = |svc: &SvcState, id: u32| -> Result<IdHandle, Refusal> {
        match svc.cm_ids.get(&id) {
            Some(e) if e.client == me => Ok(IdHandle(id)),
            _ => Err(nso()),
        }
    };
    let own_channel = |svc: &SvcState, ch: u32| svc.cm_channels.get(&ch).is_some_and(|c| c.client == me);
    let own_qp = |svc: &SvcState, qpn: Qpn| qpn.value() == 0 || svc.qps.get(&qpn).is_some_and(|q| q.client == me);
    fn run<R>(
        dev: &SvcDevice,
        f: impl FnOnce(&mut CmAgent, softrdma_transport::Instant) -> Result<R, CmError>,
    ) -> Result<R, Refusal> {
        run_state(dev, |st, now| f(&mut st.cm.agent, now))
    }
    /// [`run`] for work that needs more of the device than its agent.
    fn run_state<R>(
        dev: &SvcDevice,
        f: impl FnOnce(&mut crate::runtime::State, softrdma_transport::Instant) -> Result<R, CmError>,
    ) -> Result<R, Refusal> {
        dev.dev.run(f).map_err(|e| Refusal::InvalidArgument(format!("rdma_cm: {e}")))
    }
    match req {
        Request::CmCreateChannel => {
            let fd = fds.pop().ok_or_else(|| Refusal::InvalidArgument("CmCreateChannel needs a socket".into()))?;
            let sock = UnixDatagram::from(fd);
            sock.set_nonblocking(true).map_err(|e| Refusal::Other(format!("CM event channel: {e}")))?;
            svc.next_cm_channel += 1;
            let id = svc.next_cm_channel;
            svc.cm_channels.insert(id, CmChannelEntry { client: me, sock, queue: Default::default() });
            count(svc, 1);
            ok(Response::Id(id))
        }
        Request::CmDestroyChannel { channel } => {
            if !own_channel(svc, channel) {
                return Err(nso());
            }
            svc.cm_channels.remove(&channel);
            count(svc, -1);
            ok(Response::Ok)
        }
        Request::CmCreateId { channel, ps } => {
            if !own_channel(svc, channel) {
                return Err(nso());
            }
            let id = dev.dev.lock().cm.agent.create_id(ps);
            svc.cm_ids.insert(id.0, CmIdEntry { client: me, channel });
            count(svc, 1);
            ok(Response::Id(id.0))
        }
        Request::CmDestroyId { id } => {
            let h = own_id(svc, id)?;
            dev.dev.run(|st, now| {
                let _ = st.cm.agent.destroy_id(h, now);
            });
            svc.cm_ids.remove(&id);
            count(svc, -1);
            ok(Response::Ok)
        }
        Request::CmBind { id, addr } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.bind(h, addr))?;
            ok(Response::Ok)
        }
        Request::CmResolveAddr { id, src, dst } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.resolve_addr_via(h, src, dst, crate::cm::route_lookup))?;
            ok(Response::Ok)
        }
        Request::CmResolveRoute { id } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.resolve_route_via(h, crate::cm::route_lookup))?;
            ok(Response::Ok)
        }
        Request::CmListen { id, backlog } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.listen(h, backlog))?;
            ok(Response::Ok)
        }
        Request::CmConnect { id, param } => {
            let h = own_id(svc, id)?;
            // A QP the CM drives must be the client's own; one the application drives is only a
            // number for the peer.
            if param.drive_qp && !own_qp(svc, param.qpn) {
                return Err(nso());
            }
            run_state(dev, |st, now| crate::cm::connect_id(st, h, param, now))?;
            ok(Response::Ok)
        }
        Request::CmAccept { id, param } => {
            let h = own_id(svc, id)?;
            if param.drive_qp && !own_qp(svc, param.qpn) {
                return Err(nso());
            }
            run(dev, |a, now| a.accept(h, param, now))?;
            ok(Response::Ok)
        }
        Request::CmEstablish { id } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.establish(h))?;
            ok(Response::Ok)
        }
        Request::CmInitQpAttr { id, state } => {
            let h = own_id(svc, id)?;
            let attr = dev.dev.lock().cm.agent.init_qp_attr(h, state);
            ok(Response::CmQpAttr(attr.map_err(|e| Refusal::InvalidArgument(format!("rdma_cm: {e}")))?))
        }
        Request::CmReject { id, private_data } => {
            let h = own_id(svc, id)?;
            run(dev, |a, _| a.reject(h, &private_data))?;
            ok(Response::Ok)
        }
        Request::CmDisconnect { id } => {
            let h = own_id(svc, id)?;
            run(dev, |a, now| a.disconnect(h, now))?;
            ok(Response::Ok)
        }
        Request::CmMigrate { id, channel } => {
            own_id(svc, id)?;
            if !own_channel(svc, channel) {
                return Err(nso());
            }
            if let Some(e) = svc.cm_ids.get_mut(&id) {
                e.channel = channel;
            }
            ok(Response::Ok)
        }
        Request::CmQuery { id } => {
            let h = own_id(svc, id)?;
            let st = dev.dev.lock();
            let (local, peer) = st.cm.agent.addrs(h);
            ok(Response::CmInfo { route: st.cm.agent.route(h), local, peer })
        }
        Request::CmGetEvent { channel } => {
            let ch = svc.cm_channels.get_mut(&channel).filter(|c| c.client == me).ok_or_else(nso)?;
            let event = ch.queue.pop_front();
            ok(Response::CmEvent { event, more: !ch.queue.is_empty() })
        }
        Request::CmIdCount => ok(Response::Id(dev.dev.lock().cm.agent.id_count() as u32)),
        Request::CmSetNoListenerRetries { retries } => {
            dev.dev.lock().cm.agent.set_no_listener_retries(retries);
            ok(Response::Ok)
        }
        _ => Err(Refusal::InvalidArgument("request not valid here".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::mapped;

    /// A registration's range is checked against the process's mappings, and one lying in a
    /// shared mapping is told apart from private memory.
    #[test]
    fn mappings_are_checked_and_shared_ones_told_apart() {
        let me = std::process::id();
        let heap = vec![0u8; 8192];
        assert_eq!(mapped(me, heap.as_ptr() as u64, 8192, true), Ok(false));
        // SAFETY: a fresh shared anonymous mapping of two pages, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(mapped(me, p as u64 + 100, 4000, true), Ok(true));
        // SAFETY: the second page of the mapping above (a page that stays ours: no other thread
        // can map anything there meanwhile, as it could into an unmapped gap).
        assert_eq!(unsafe { libc::mprotect(p.cast::<u8>().add(4096).cast(), 4096, libc::PROT_NONE) }, 0);
        assert!(mapped(me, p as u64, 8192, false).is_err(), "not readable throughout");
        // SAFETY: the mapping above, no longer used.
        unsafe { libc::munmap(p, 8192) };
    }
}
