//! The application side of daemon mode: a session with `softrdmad` and the verbs objects it
//! holds there. Control verbs are messages; posting and polling touch only shared rings.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use softrdma_abi::msg::{decode_event, DeviceEntry, Request, Response};
use softrdma_abi::placements::{placements_bytes, Placements, Seen, State, CAPACITY};
use softrdma_abi::ring::{Consumer, Producer, ARMED_ANY, ARMED_SOLICITED};
use softrdma_abi::shm::Shm;
use softrdma_abi::slot::{self, CQE_LEN};
use softrdma_abi::sock::{self, Conn};
use softrdma_device::DeviceInfo;
use softrdma_transport::hca::QueuePairInfo;
use softrdma_transport::wr::Payload;
use softrdma_transport::{
    AsyncEvent, ModifyQp, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, VerbsError, WorkCompletion,
};
use softrdma_wire::Qpn;

use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::poller::{self, PollerStats};

/// A daemon refusal as a verbs error.
pub(crate) fn refusal(r: softrdma_abi::msg::Refusal) -> Error {
    use softrdma_abi::msg::Refusal;
    match r {
        Refusal::Verbs(v) => Error::Verbs(v),
        Refusal::InvalidArgument(s) => Error::InvalidArgument(s),
        Refusal::UnknownDevice(n) => Error::Registry(softrdma_device::registry::RegistryError::UnknownDevice(n)),
        other => Error::Daemon(other.to_string()),
    }
}

/// Engine counters from the daemon's named list.
pub(crate) fn counters_from(list: &[(String, u64)]) -> softrdma_transport::Counters {
    let get = |k: &str| list.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
    softrdma_transport::Counters {
        rcvd_pkts: get("rcvd_pkts"),
        sent_pkts: get("sent_pkts"),
        rcvd_bytes: get("rcvd_bytes"),
        sent_bytes: get("sent_bytes"),
        drop_malformed: get("drop_malformed"),
        drop_unknown_qp: get("drop_unknown_qp"),
        drop_bad_state: get("drop_bad_state"),
        drop_pkey: get("drop_pkey"),
        drop_qkey: get("drop_qkey"),
        drop_no_recv: get("drop_no_recv"),
        drop_uc_msg: get("drop_uc_msg"),
        drop_stray_resp: get("drop_stray_resp"),
        duplicate_request: get("duplicate_request"),
        out_of_seq_request: get("out_of_seq_request"),
        rcvd_seq_err: get("rcvd_seq_err"),
        send_rnr_nak: get("send_rnr_nak"),
        rcvd_rnr_err: get("rcvd_rnr_err"),
        send_err_nak: get("send_err_nak"),
        rcvd_err_nak: get("rcvd_err_nak"),
        retry_rounds: get("retry_rounds"),
        retransmits: get("retransmits"),
        ack_timeouts: get("ack_timeouts"),
        cq_overflow: get("cq_overflow"),
    }
}

/// A control connection, without a device (management, listings).
pub(crate) struct Control {
    conn: Mutex<Conn>,
    pub daemon_pid: u32,
}

impl Control {
    /// Connect to the first daemon socket that answers (see [`sock::client_paths`]).
    pub fn connect() -> Option<Control> {
        sock::client_paths().iter().find_map(|p| Control::connect_to(p).ok())
    }

    /// Connect to the daemon at `path`.
    pub fn connect_to(path: &Path) -> Result<Control> {
        let conn = Conn::connect(path).map_err(|e| Error::io("connecting to softrdmad", e))?;
        let c = Control { conn: Mutex::new(conn), daemon_pid: 0 };
        match c.call(&Request::Hello, &[])?.0 {
            Response::Hello { daemon_pid } => Ok(Control { daemon_pid, ..c }),
            _ => Err(Error::Daemon("unexpected answer to hello".into())),
        }
    }

    /// One request and its answer; a refusal is an error.
    pub fn call(&self, req: &Request, fds: &[RawFd]) -> Result<(Response, Vec<OwnedFd>)> {
        let conn = self.conn.lock().expect("control lock");
        conn.send(&req.encode(), fds).map_err(|e| Error::io("sending to softrdmad", e))?;
        let (buf, fds) = conn
            .recv()
            .map_err(|e| Error::io("receiving from softrdmad", e))?
            .ok_or_else(|| Error::Daemon("softrdmad closed the connection".into()))?;
        match Response::decode(&buf).map_err(|e| Error::Daemon(e.to_string()))? {
            Response::Error(r) => Err(refusal(r)),
            resp => Ok((resp, fds)),
        }
    }

    /// Send raw bytes, return the raw answer (tests).
    pub fn raw(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let conn = self.conn.lock().expect("control lock");
        conn.send(bytes, &[]).map_err(|e| Error::io("sending to softrdmad", e))?;
        match conn.recv().map_err(|e| Error::io("receiving from softrdmad", e))? {
            Some((b, _)) => Ok(b),
            None => Err(Error::Daemon("softrdmad closed the connection".into())),
        }
    }

    /// The daemon's devices.
    pub fn devices(&self) -> Result<Vec<DeviceEntry>> {
        match self.call(&Request::ListDevices, &[])?.0 {
            Response::Devices(d) => Ok(d),
            _ => Err(unexpected()),
        }
    }
}

fn unexpected() -> Error {
    Error::Daemon("unexpected answer from softrdmad".into())
}

/// A session attached to one of the daemon's devices: what a [`crate::Context`] holds.
pub(crate) struct Session {
    ctl: Control,
    pub info: DeviceInfo,
    pub udp_port: u16,
    doorbell: OwnedFd,
    events: UnixDatagram,
    /// The daemon maps `reg_mr` regions shared with it (`RegMrShared`); cleared at its first
    /// refusal (an older daemon, or a kernel without `F_SEAL_FUTURE_WRITE`), after which regions
    /// are registered for `process_vm` access (`RegMr`) without asking again.
    pub shared_regions: std::sync::atomic::AtomicBool,
    /// The regions of this process the daemon reaches by process_vm, by key: (PD, address,
    /// length). See [`Session::copy_payload`].
    process_regions: RwLock<HashMap<u32, (u32, u64, usize)>>,
    /// Empty CQ polls of this process's threads that found the device loop on their CPU and
    /// yielded, and the moves off it they made (see [`Cq::poll`]).
    poller_yields: AtomicU64,
    poller_moves: AtomicU64,
    /// Small writes into this process's memory the daemon left to it (`softrdma_abi::placements`).
    placements: PlacementRing,
}

/// This process's placement ring at the daemon's device: the entries its polls make.
struct PlacementRing {
    // Declared before the mapping it views: dropped first.
    ring: Placements,
    _shm: Shm,
    /// Every entry before it is made, as far as this process's polls know.
    made: AtomicU32,
}

impl PlacementRing {
    fn open(fd: OwnedFd) -> Result<PlacementRing> {
        let io = |e| Error::io("mapping the placement ring", e);
        let shm = Shm::open(fd, placements_bytes(CAPACITY)).map_err(io)?;
        let ring = shm.placements(0, CAPACITY).map_err(io)?;
        if !ring.header_ok() {
            return Err(Error::Daemon("placement ring header mismatch".into()));
        }
        let made = AtomicU32::new(ring.tail());
        Ok(PlacementRing { ring, _shm: shm, made })
    }

    /// Make every entry before `end` (a completion about to be handed out names it), in order:
    /// copy those nobody took into place, wait for those the daemon or another thread is making.
    /// False if one was still being made after [`WRITES_SPIN`]: the completion waits for a later
    /// poll.
    fn make_until(&self, end: u32) -> bool {
        // Entries from the tail on are at most the ring's capacity: an `end` outside that window
        // is at or behind the tail (made), and so is a cursor of this session's outside
        // `[tail, end]` (another session went on, or this one stood still for long).
        let tail = self.ring.tail();
        let ahead = end.wrapping_sub(tail);
        if ahead == 0 || ahead > self.ring.capacity() {
            return true;
        }
        let behind = |a: u32, b: u32| (b.wrapping_sub(a) as i32) > 0;
        let mut n = self.made.load(Ordering::Acquire);
        if n.wrapping_sub(tail) > ahead {
            n = tail;
        }
        while n != end {
            match self.ring.take(n, State::Client) {
                Ok(()) => {
                    let (addr, from, len) = self.ring.data(n);
                    // SAFETY: the daemon hands out only writes into a region this process
                    // registered with local write access, checked against its bounds (as for the
                    // process_vm_writev it stands for); registered memory stays mapped while
                    // registered, as the verbs require, and a deregistration has the daemon make
                    // what waits first (unless it gave this process up, which only a thread
                    // stopped in the middle of such a copy for 10 ms brings about). The source
                    // lies in the slot (`data` cuts the length to it). The bytes are plain data a
                    // NIC could write there at any time before the completion.
                    unsafe { std::ptr::copy_nonoverlapping(from, addr as *mut u8, len) };
                    self.ring.finish(n);
                }
                Err(Seen::Is(State::Done)) => {}
                Err(Seen::Is(by)) => {
                    // Being made by the daemon, or by another of this process's threads.
                    if !spin_until(|| self.ring.seen(n) != Seen::Is(by)) {
                        return false;
                    }
                    continue;
                }
                // Made, and its slot taken again: everything before the tail is made.
                // (The tail, the cursor and `end` lie within the ring's capacity of each other:
                // compared as wrapping numbers.)
                Err(Seen::Later) => {
                    let tail = self.ring.tail();
                    n = if !behind(tail, end) {
                        end
                    } else if behind(n, tail) {
                        tail
                    } else {
                        n.wrapping_add(1)
                    };
                    continue;
                }
                // Never written: the daemon broke the ring; nothing to make.
                Err(Seen::Missing) => {}
            }
            n = n.wrapping_add(1);
        }
        // Another thread may have gone further meanwhile: keep the furthest (a cursor outside
        // the window is stale).
        let mut seen = self.made.load(Ordering::Relaxed);
        while seen.wrapping_sub(tail) < end.wrapping_sub(tail) || seen.wrapping_sub(tail) > self.ring.capacity() {
            match self.made.compare_exchange_weak(seen, end, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => seen = now,
            }
        }
        true
    }
}

/// Most payload bytes a post copies into its slot (see [`Session::copy_payload`]).
const COPY_MAX: usize = 512;

impl Session {
    /// Open device `name` at the daemon; `Ok(None)` if no daemon runs or it lacks the device.
    pub fn open(name: &str) -> Result<Option<Arc<Session>>> {
        let Some(ctl) = Control::connect() else {
            return Ok(None);
        };
        let (resp, mut fds) = match ctl.call(&Request::OpenDevice { name: name.into() }, &[]) {
            Err(Error::Registry(_)) => return Ok(None),
            r => r?,
        };
        let Response::Opened(entry) = resp else {
            return Err(unexpected());
        };
        if fds.len() != 3 {
            return Err(Error::Daemon("softrdmad sent no doorbell, event socket and placement ring".into()));
        }
        let placements = PlacementRing::open(fds.pop().expect("three fds"))?;
        let events = UnixDatagram::from(fds.pop().expect("three fds"));
        let doorbell = fds.pop().expect("three fds");
        let netdev = entry.netdev.ok_or_else(|| Error::Daemon(format!("device {name} has no netdev at the daemon")))?;
        let info = DeviceInfo::new(&entry.config, netdev)?;
        allow_daemon_access(ctl.daemon_pid);
        Ok(Some(Arc::new(Session {
            ctl,
            info,
            udp_port: entry.udp_port,
            doorbell,
            events,
            shared_regions: std::sync::atomic::AtomicBool::new(true),
            process_regions: RwLock::new(HashMap::new()),
            poller_yields: AtomicU64::new(0),
            poller_moves: AtomicU64::new(0),
            placements,
        })))
    }

    /// How this process's threads polling CQs made room for the device loop.
    pub fn poller_stats(&self) -> PollerStats {
        PollerStats {
            shared_yields: self.poller_yields.load(Ordering::Relaxed),
            moves: self.poller_moves.load(Ordering::Relaxed),
        }
    }

    /// A control request.
    pub fn call(&self, req: &Request, fds: &[RawFd]) -> Result<(Response, Vec<OwnedFd>)> {
        self.ctl.call(req, fds)
    }

    /// A control request answered by an id.
    pub fn call_id(&self, req: &Request) -> Result<u32> {
        match self.call(req, &[])?.0 {
            Response::Id(id) => Ok(id),
            _ => Err(unexpected()),
        }
    }

    /// A control request answered by `Ok`; errors are dropped (destructors).
    pub fn call_quiet(&self, req: &Request) {
        let _ = self.call(req, &[]);
    }

    /// Region `key` of PD `pd`, `len` bytes of this process at `addr`, is reached by the daemon
    /// through process_vm.
    pub fn note_process_region(&self, key: u32, pd: u32, addr: u64, len: usize) {
        self.process_regions.write().expect("regions lock").insert(key, (pd, addr, len));
    }

    /// Region `key` is going away.
    pub fn forget_process_region(&self, key: u32) {
        self.process_regions.write().expect("regions lock").remove(&key);
    }

    /// Copy into `out` the bytes the SGEs `sgl` of a post to a QP of PD `pd` name, when they all
    /// lie in regions of that PD the daemon reaches by process_vm and fit in `out`; the number of
    /// bytes, or `None` (the daemon then gathers them itself, and fails a bad SGE). The daemon
    /// would read such a small payload with a system call of its own (`process_vm_readv`, a
    /// microsecond or more on a ping-pong's path); here it is a copy within this process.
    ///
    /// The payload may be read at any moment between the post and the request's start, which may
    /// as well be the post unless a fence orders it after earlier READs and atomics (which may
    /// write these bytes): a fenced request waits for them, and every request behind it waits
    /// too, so the caller copies nothing for a QP that ever posted a fenced request. The daemon's
    /// checks of the keys are made here as they stand at the post: every key known, in the QP's
    /// PD, every SGE (an empty one too) in bounds; a local gather needs no access right. A region deregistered
    /// between the post and the start is not noticed (the daemon would fail the request), and a
    /// buffer the program unmapped after registering it faults the program here, where the daemon
    /// would fail the request: both break the verbs' rules on registered memory.
    fn copy_payload(&self, pd: u32, sgl: &[Sge], out: &mut [u8]) -> Option<usize> {
        let regions = self.process_regions.read().expect("regions lock");
        let mut n = 0;
        for s in sgl {
            let &(rpd, addr, len) = regions.get(&s.lkey)?;
            let (start, end) = (s.addr, s.addr.checked_add(u64::from(s.length))?);
            if rpd != pd || start < addr || end > addr + len as u64 || n + s.length as usize > out.len() {
                return None;
            }
            let piece = &mut out[n..n + s.length as usize];
            // SAFETY: the bytes lie in a region this process registered and has not deregistered:
            // memory it owns, which registration found mapped and readable and pinned, as a NIC
            // would read it (a program that unmapped a registered buffer and still posts from it
            // faults here, as an inline send of it would).
            unsafe { std::ptr::copy_nonoverlapping(start as *const u8, piece.as_mut_ptr(), piece.len()) };
            n += piece.len();
        }
        Some(n)
    }

    /// Wake the daemon's device loop (one 8-byte write to the eventfd).
    fn ring_doorbell(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.doorbell.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
    }

    /// The descriptor readable while asynchronous events are pending.
    pub fn async_event_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }

    /// Wait up to `timeout` for an asynchronous event.
    pub fn async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        let mut b = [0u8; 16];
        if !wait_readable(self.events.as_raw_fd(), Some(timeout)) {
            return None;
        }
        let n = self.events.recv(&mut b).ok()?;
        decode_event(&b[..n])
    }
}

/// With Yama's `ptrace_scope` = 1, a daemon that is not root may only reach the memory of
/// processes that name it as their tracer; do so (harmless otherwise).
fn allow_daemon_access(daemon_pid: u32) {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_default();
    if scope.trim() == "1" && daemon_pid != 0 {
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, daemon_pid as libc::c_ulong, 0, 0, 0) };
    }
}

/// Wait until `fd` is readable (or the timeout passes); true if readable.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> bool {
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one live pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return rc > 0;
    }
}

/// A protection domain at the daemon.
pub(crate) struct Pd {
    pub s: Arc<Session>,
    pub id: u32,
}

impl Drop for Pd {
    fn drop(&mut self) {
        self.s.call_quiet(&Request::DeallocPd { pd: self.id });
    }
}

/// A completion channel: the daemon sends a CQ's handle on a datagram socket.
pub(crate) struct Channel {
    pub s: Arc<Session>,
    pub id: u32,
    pub rx: UnixDatagram,
}

impl Channel {
    pub fn create(s: &Arc<Session>) -> Result<Channel> {
        let (tx, rx) = UnixDatagram::pair().map_err(|e| Error::io("creating a completion channel", e))?;
        let id = match s.call(&Request::CreateChannel, &[tx.as_raw_fd()])?.0 {
            Response::Id(id) => id,
            _ => return Err(unexpected()),
        };
        Ok(Channel { s: Arc::clone(s), id, rx })
    }

    /// Wait for an event; the CQ handle.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Option<u32> {
        if !wait_readable(self.rx.as_raw_fd(), timeout) {
            return None;
        }
        let mut b = [0u8; 4];
        match self.rx.recv(&mut b) {
            Ok(4) => Some(u32::from_le_bytes(b)),
            _ => None,
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.s.call_quiet(&Request::DestroyChannel { id: self.id });
    }
}

/// A completion queue: a ring the daemon fills.
pub(crate) struct Cq {
    pub s: Arc<Session>,
    pub id: u32,
    ring: Mutex<Consumer>,
    _shm: Shm,
}

impl Cq {
    pub fn create(s: &Arc<Session>, cqe: u32, channel: Option<u32>) -> Result<Cq> {
        let (resp, mut fds) = s.call(&Request::CreateCq { cqe, channel }, &[])?;
        let Response::Cq { id, capacity } = resp else {
            return Err(unexpected());
        };
        let fd = fds.pop().ok_or_else(unexpected)?;
        let len = softrdma_abi::ring::ring_bytes(capacity, CQE_LEN as u32);
        let shm = Shm::open(fd, len).map_err(|e| Error::io("mapping a CQ ring", e))?;
        let ring = shm.ring(0, capacity, CQE_LEN as u32).map_err(|e| Error::io("mapping a CQ ring", e))?;
        if !ring.header_ok() {
            return Err(Error::Daemon("CQ ring header mismatch".into()));
        }
        Ok(Cq { s: Arc::clone(s), id, ring: Mutex::new(Consumer::new(ring)), _shm: shm })
    }

    /// Move up to `max` completions into `out`: reads of shared memory only.
    pub fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        let mut ring = self.ring.lock().expect("CQ lock");
        let mut slot = [0u8; CQE_LEN];
        let mut n = 0;
        while n < max {
            match ring.peek(&mut slot) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => return Err(Error::Daemon(e.to_string())),
            }
            // Its data may still be on its way into this process's memory (a process_vm region):
            // the daemon says when the batch it waits for is made, a system call away. Not made
            // after a short wait (or at once, when this poll has completions to hand out
            // already): the completion stays in the ring for a later poll.
            let batch = slot::cqe_writes(&slot);
            let made = || if n > 0 { ring.ring().batch_made(batch) } else { wait_for_writes(ring.ring(), batch) };
            if batch != 0 && !made() {
                break;
            }
            // Small writes of its data the daemon left to this process are made here, in order.
            if let Some(end) = slot::cqe_places(&slot) {
                if !self.s.placements.make_until(end) {
                    break;
                }
            }
            ring.advance();
            out.push(slot::decode_cqe(&slot).map_err(|e| Error::Daemon(e.to_string()))?);
            n += 1;
        }
        if n == 0 && max > 0 {
            // A busy poller of an empty CQ gives its core away for a moment: the daemon's device
            // loop, which produces the completion, may be waiting for exactly this core (on a
            // machine with fewer cores than busy threads, pure spinning costs a scheduler time
            // slice, milliseconds, per round trip; see docs/ARCHITECTURE.md). When the loop said
            // it polls on this very CPU, this thread moves to another one after a few such
            // yields (poller.rs).
            let loop_cpu = ring.ring().producer_cpu().map(|(cpu, _)| cpu);
            drop(ring);
            if let Some(cpu) = loop_cpu.filter(|&cpu| poller::this_cpu() == Some(cpu)) {
                if poller::sharing(cpu, monotonic_ns()) {
                    self.s.poller_moves.fetch_add(1, Ordering::Relaxed);
                    return Ok(0);
                }
                self.s.poller_yields.fetch_add(1, Ordering::Relaxed);
            }
            std::thread::yield_now();
        }
        Ok(n)
    }

    /// Arm for a channel event (a store to the ring's flag word).
    pub fn req_notify(&self, solicited_only: bool) {
        let ring = self.ring.lock().expect("CQ lock");
        let v = if solicited_only { ARMED_SOLICITED } else { ARMED_ANY };
        ring.ring().flags().store(v, Ordering::SeqCst);
        // Before the application's next poll looks at the ring (its producer index, the writes
        // made): either that poll sees what the daemon published, or the daemon, whose fence
        // comes after publishing, sees the arming and sends the event.
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.s.call_quiet(&Request::DestroyCq { cq: self.id });
    }
}

/// A work queue ring we produce into, with its encode buffer.
struct WorkRing {
    prod: Producer,
    buf: Vec<u8>,
}

impl WorkRing {
    fn new(prod: Producer) -> WorkRing {
        let n = prod.ring().slot_size() as usize;
        WorkRing { prod, buf: vec![0; n] }
    }

    /// Publish the encoded slot; ring the doorbell if the daemon sleeps.
    fn publish(&mut self, s: &Session) -> Result<()> {
        self.stage()?;
        self.publish_staged(s);
        Ok(())
    }

    /// Write the encoded slot into the ring without publishing it.
    fn stage(&mut self) -> Result<()> {
        match self.prod.stage(&self.buf) {
            true => Ok(()),
            false => Err(Error::Verbs(VerbsError::QueueFull)),
        }
    }

    /// Publish the staged slots (one store the daemon sees); ring the doorbell if it sleeps.
    fn publish_staged(&mut self, s: &Session) {
        self.prod.publish_staged();
        if self.prod.take_doorbell_request() {
            s.ring_doorbell();
        }
    }
}

/// Wait until CQ ring `ring` says the daemon made write batch `batch` (`Ring::writes_made`): a
/// system call of the daemon's, under a microsecond (see [`spin_until`]).
fn wait_for_writes(ring: &softrdma_abi::ring::Ring, batch: u32) -> bool {
    spin_until(|| ring.batch_made(batch))
}

/// Look until `done` says so, without giving the CPU away, for up to [`WRITES_SPIN`]: what the
/// daemon (or another thread) is making takes less; false if it is not done by then (the
/// caller's poll returns what it has, and gives its CPU away if that is nothing, as an empty
/// poll does).
fn spin_until(done: impl Fn() -> bool) -> bool {
    let start = monotonic_ns();
    while !done() {
        if monotonic_ns().saturating_sub(start) > WRITES_SPIN.as_nanos() as u64 {
            return false;
        }
        std::hint::spin_loop();
    }
    true
}

/// How long a poll waiting for the daemon's writes looks before it returns (yielding at each
/// look measured as if the completions came after the writes: 2.7 against 1.5 µs).
const WRITES_SPIN: Duration = Duration::from_micros(2);

fn map_work_ring(shm: &Shm, offset: usize, capacity: u32, slot: u32) -> Result<WorkRing> {
    let ring = shm.ring(offset, capacity, slot).map_err(|e| Error::io("mapping a work queue ring", e))?;
    if !ring.header_ok() {
        return Err(Error::Daemon("work queue ring header mismatch".into()));
    }
    Ok(WorkRing::new(Producer::new(ring)))
}

/// A shared receive queue.
pub(crate) struct Srq {
    pub s: Arc<Session>,
    pub id: u32,
    max_sge: u32,
    ring: Mutex<WorkRing>,
    _shm: Shm,
}

impl Srq {
    pub fn create(s: &Arc<Session>, pd: u32, max_wr: u32, max_sge: u32) -> Result<Srq> {
        let (resp, mut fds) = s.call(&Request::CreateSrq { pd, max_wr, max_sge }, &[])?;
        let Response::Srq { id, capacity, slot_size } = resp else {
            return Err(unexpected());
        };
        let fd = fds.pop().ok_or_else(unexpected)?;
        let shm = Shm::open(fd, softrdma_abi::ring::ring_bytes(capacity, slot_size))
            .map_err(|e| Error::io("mapping an SRQ ring", e))?;
        let ring = map_work_ring(&shm, 0, capacity, slot_size)?;
        Ok(Srq { s: Arc::clone(s), id, max_sge, ring: Mutex::new(ring), _shm: shm })
    }

    pub fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        if wr.sgl.len() > self.max_sge as usize {
            return Err(Error::Verbs(VerbsError::InvalidWorkRequest("more SGEs than max_sge")));
        }
        let mut r = self.ring.lock().expect("SRQ lock");
        let r = &mut *r;
        slot::encode_recv(wr, &mut r.buf).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        r.publish(&self.s)
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.s.call_quiet(&Request::DestroySrq { srq: self.id });
    }
}

/// A queue pair: send and receive rings, and the state this process last set (posting in RESET or
/// INIT is refused here, synchronously, as the engine would).
pub(crate) struct Qp {
    pub s: Arc<Session>,
    pub qpn: Qpn,
    pd: u32,
    /// A fenced request was posted: from then on no payload is copied at post (it may wait behind
    /// the fence; see [`Session::copy_payload`]).
    fenced: std::sync::atomic::AtomicBool,
    qp_type: QpType,
    cap: QpCap,
    has_srq: bool,
    state: AtomicU8,
    sq: Mutex<WorkRing>,
    rq: Option<Mutex<WorkRing>>,
    _shm: Shm,
}

const STATES: [QpState; 7] =
    [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe, QpState::Err];

impl Qp {
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        s: &Arc<Session>,
        pd: u32,
        qp_type: QpType,
        send_cq: u32,
        recv_cq: u32,
        srq: Option<u32>,
        cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<Qp> {
        // Slots with room for small payloads copied at post, for a process that registered its
        // own memory (reached by process_vm) already: the C ABI's programs (perftest registers
        // before it creates its QPs). Others keep slots as small as their capacities.
        let copy_room = if s.process_regions.read().expect("regions lock").is_empty() { 0 } else { slot::COPY_ROOM };
        let req = Request::CreateQp { pd, qp_type, send_cq, recv_cq, srq, cap, sq_sig_all, copy_room };
        let (resp, mut fds) = s.call(&req, &[])?;
        let Response::Qp { qpn, sq_capacity, sq_slot, rq_capacity, rq_slot, rq_offset } = resp else {
            return Err(unexpected());
        };
        let fd = fds.pop().ok_or_else(unexpected)?;
        let rq_offset = rq_offset as usize;
        let len = if srq.is_some() {
            softrdma_abi::ring::ring_bytes(sq_capacity, sq_slot)
        } else {
            rq_offset + softrdma_abi::ring::ring_bytes(rq_capacity, rq_slot)
        };
        let shm = Shm::open(fd, len).map_err(|e| Error::io("mapping QP rings", e))?;
        let sq = map_work_ring(&shm, 0, sq_capacity, sq_slot)?;
        let rq =
            if srq.is_some() { None } else { Some(Mutex::new(map_work_ring(&shm, rq_offset, rq_capacity, rq_slot)?)) };
        Ok(Qp {
            s: Arc::clone(s),
            qpn: Qpn::new(qpn),
            pd,
            fenced: std::sync::atomic::AtomicBool::new(false),
            qp_type,
            cap,
            has_srq: srq.is_some(),
            state: AtomicU8::new(0),
            sq: Mutex::new(sq),
            rq,
            _shm: shm,
        })
    }

    fn state(&self) -> QpState {
        STATES[self.state.load(Ordering::Relaxed) as usize % STATES.len()]
    }

    fn set_state(&self, s: QpState) {
        let i = STATES.iter().position(|x| *x == s).unwrap_or(0);
        self.state.store(i as u8, Ordering::Relaxed);
    }

    pub fn modify(&self, attr: &ModifyQp) -> Result<()> {
        self.s.call(&Request::ModifyQp { qpn: self.qpn.value(), attr: *attr }, &[])?;
        if let Some(st) = attr.state {
            self.set_state(st);
        }
        Ok(())
    }

    pub fn attach_mcast(&self, mgid: [u8; 16]) -> Result<()> {
        self.s.call(&Request::AttachMcast { qpn: self.qpn.value(), mgid }, &[])?;
        Ok(())
    }

    pub fn detach_mcast(&self, mgid: [u8; 16]) -> Result<()> {
        self.s.call(&Request::DetachMcast { qpn: self.qpn.value(), mgid }, &[])?;
        Ok(())
    }

    pub fn query(&self) -> Result<QueuePairInfo> {
        match self.s.call(&Request::QueryQp { qpn: self.qpn.value() }, &[])?.0 {
            Response::QpInfo(i) => {
                self.set_state(i.state);
                Ok(i)
            }
            _ => Err(unexpected()),
        }
    }

    /// Whether the QP's state lets it send, checked at post time as the engine would, so misuse
    /// is reported synchronously as in embedded mode.
    fn check_sendable(&self) -> Result<()> {
        let mut st = self.state();
        if matches!(st, QpState::Reset | QpState::Init | QpState::Rtr) {
            // The daemon's RDMA CM moves QPs on its own (connect, accept): ask before refusing.
            st = self.query()?.state;
        }
        if matches!(st, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(Error::Verbs(VerbsError::InvalidState(st)));
        }
        Ok(())
    }

    /// The checks of one send WR the engine makes at post time that do not need its state.
    fn check_send_wr(&self, wr: &SendWr) -> Result<()> {
        let bad = |m| Err(Error::Verbs(VerbsError::InvalidWorkRequest(m)));
        match &wr.payload {
            Payload::Sgl(sgl) if sgl.len() > self.cap.max_send_sge as usize => {
                return bad("more SGEs than max_send_sge")
            }
            Payload::Inline(d) if d.len() > self.cap.max_inline_data as usize => {
                return bad("inline data longer than max_inline_data")
            }
            Payload::Inline(_) if wr.op.is_read_or_atomic() => return bad("inline data on a read or atomic"),
            _ => {}
        }
        let allowed = match self.qp_type {
            QpType::Rc => true,
            QpType::Uc => !wr.op.is_read_or_atomic() && !matches!(wr.op, SendOp::SendWithInv(_)),
            QpType::Ud => matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)),
        };
        if !allowed {
            return bad("operation not supported on this QP type");
        }
        if self.qp_type == QpType::Ud && wr.ud.is_none() {
            return bad("UD send without an address handle");
        }
        Ok(())
    }

    /// Post a send: encode into the ring; a doorbell only if the daemon sleeps.
    pub fn post_send(&self, wr: &SendWr) -> Result<()> {
        self.post_send_list([wr])
    }

    /// Post a list of sends: each is encoded into the ring, and all are published together (the
    /// daemon sees the burst at once). On the first refused one the error is returned; the ones
    /// before it are posted (verbs' `bad_wr`). The list is walked with the SQ's lock held.
    pub fn post_send_list<W: Borrow<SendWr>>(&self, wrs: impl IntoIterator<Item = W>) -> Result<()> {
        let mut wrs = wrs.into_iter().peekable();
        if wrs.peek().is_none() {
            return Ok(());
        }
        self.check_sendable()?;
        let mut r = self.sq.lock().expect("SQ lock");
        let r = &mut *r;
        let mut staged = 0;
        let mut copied = [0u8; COPY_MAX];
        // Small payloads in process_vm regions go in the slot, as inline data (the daemon makes
        // room for `slot::COPY_ROOM` bytes at least).
        let room = copied.len().min(slot::inline_room(r.prod.ring().slot_size()) as usize);
        let result = wrs.try_for_each(|wr| {
            let wr = wr.borrow();
            self.check_send_wr(wr)?;
            if wr.flags.contains(SendFlags::FENCE) {
                self.fenced.store(true, Ordering::Relaxed);
            }
            let n = match &wr.payload {
                Payload::Sgl(sgl) if room > 0 && !wr.op.is_read_or_atomic() && !self.fenced.load(Ordering::Relaxed) => {
                    self.s.copy_payload(self.pd, sgl, &mut copied[..room])
                }
                _ => None,
            };
            match n {
                Some(n) => slot::encode_send_copied(wr, &copied[..n], &mut r.buf),
                None => slot::encode_send(wr, &mut r.buf),
            }
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            r.stage()?;
            staged += 1;
            Ok(())
        });
        if staged > 0 {
            r.publish_staged(&self.s);
        }
        result
    }

    pub fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        let Some(rq) = &self.rq else {
            debug_assert!(self.has_srq);
            return Err(Error::Verbs(VerbsError::InvalidWorkRequest("QP uses an SRQ: post to the SRQ")));
        };
        if self.state() == QpState::Reset && self.query()?.state == QpState::Reset {
            return Err(Error::Verbs(VerbsError::InvalidState(QpState::Reset)));
        }
        if wr.sgl.len() > self.cap.max_recv_sge as usize {
            return Err(Error::Verbs(VerbsError::InvalidWorkRequest("more SGEs than max_recv_sge")));
        }
        let mut r = rq.lock().expect("RQ lock");
        let r = &mut *r;
        slot::encode_recv(wr, &mut r.buf).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        r.publish(&self.s)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.s.call_quiet(&Request::DestroyQp { qpn: self.qpn.value() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client_place::tests::bytes;
    use crate::client_place::ClientPlacements;

    /// A daemon's side and a client's view of one ring of this process.
    fn rings() -> (ClientPlacements, PlacementRing, OwnedFd) {
        let mut d = ClientPlacements::default();
        let fd = d.attach(std::process::id()).unwrap();
        let client = PlacementRing::open(fd.try_clone().unwrap()).unwrap();
        (d, client, fd)
    }

    #[test]
    fn a_poll_makes_the_entries_before_its_end_in_order() {
        let (mut d, client, _fd) = rings();
        let me = std::process::id();
        let buf = [0u8; 16];
        let at = buf.as_ptr() as u64;
        assert!(d.room(me, 3));
        d.hand_out(me, at, &[1; 8]);
        d.hand_out(me, at, &[2; 8]);
        d.hand_out(me, at + 8, &[3; 8]);
        assert!(client.make_until(2));
        assert_eq!(bytes(&buf), [[2; 8], [0; 8]].concat(), "the later of two writes to the same bytes wins");
        assert!(client.make_until(3));
        assert_eq!(bytes(&buf), [[2; 8], [3; 8]].concat());
        // The daemon finds them all made: nothing to take back.
        d.reclaim(me);
        assert_eq!(d.counts.taken_back, 0);
    }

    #[test]
    fn an_entry_of_the_most_a_slot_carries_is_made_whole() {
        let (mut d, client, _fd) = rings();
        let me = std::process::id();
        let buf = [0u8; softrdma_abi::placements::DATA_MAX + 8];
        let data: Vec<u8> = (0..softrdma_abi::placements::DATA_MAX).map(|i| i as u8 ^ 0x5a).collect();
        assert!(d.room(me, 1));
        d.hand_out(me, buf.as_ptr() as u64 + 4, &data);
        assert!(client.make_until(1));
        let got = bytes(&buf);
        assert_eq!(
            (&got[..4], &got[4..4 + data.len()], &got[4 + data.len()..]),
            (&[0u8; 4][..], &data[..], &[0u8; 4][..])
        );
    }

    #[test]
    fn a_cursor_far_behind_the_ring_starts_at_its_tail() {
        // A session that opened late, or stood still while others went on: its cursor is more
        // than half the number space behind the ring's tail.
        let shm = Shm::create("test-placements", placements_bytes(CAPACITY)).unwrap();
        let ring = shm.placements(0, CAPACITY).unwrap();
        ring.init();
        let client = PlacementRing::open(shm.fd().try_clone().unwrap()).unwrap();
        let buf = [0u8; 8];
        let n = 0x8000_0005u32;
        ring.set_tail(n);
        ring.write(n, buf.as_ptr() as u64, &[9; 8]);
        assert!(client.make_until(n.wrapping_add(1)));
        assert_eq!(bytes(&buf), [9; 8], "the entry before `end` was not made");
        // An end at or behind the tail asks for nothing.
        assert!(client.make_until(n.wrapping_sub(7)));
    }

    #[test]
    fn a_poll_waits_for_an_entry_another_thread_holds_even_after_the_daemon_gave_up() {
        let (mut d, t2, fd) = rings();
        let t1 = PlacementRing::open(fd).unwrap();
        let me = std::process::id();
        let buf = [0u8; 16];
        let at = buf.as_ptr() as u64;
        assert!(d.room(me, 2));
        d.hand_out(me, at, &[1; 8]);
        d.hand_out(me, at + 8, &[2; 8]);
        // Thread 1 takes entry 0 and stops; the daemon waits its budget, gives up, makes entry 1.
        t1.ring.take(0, State::Client).unwrap();
        d.reclaim(me);
        assert_eq!((d.counts.given_up, d.counts.taken_back), (1, 1));
        assert_eq!(bytes(&buf)[8..], [2; 8]);
        // Thread 2's completion names both: it is not handed out before entry 0 is made.
        assert!(!t2.make_until(2), "handed out before its data was placed");
        let (addr, from, len) = t1.ring.data(0);
        // SAFETY: `buf`'s first bytes, from the slot.
        unsafe { std::ptr::copy_nonoverlapping(from, addr as *mut u8, len) };
        t1.ring.finish(0);
        assert!(t2.make_until(2));
        assert_eq!(bytes(&buf), [[1; 8], [2; 8]].concat());
    }
}
