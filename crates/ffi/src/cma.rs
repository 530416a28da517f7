//! The RDMA connection manager's C API (librdmacm's `rdma_*` functions), over softrdma's CM
//! agent ([`softrdma_verbs::CmId`]).
//!
//! # Why it lives in libibverbs.so.1
//!
//! An `rdma_cm_id` hands the application verbs objects (`id->verbs`, `id->pd`, `id->qp`,
//! `id->send_cq`...) on which it calls `ibv_*`; those must be objects of *this* library, on the
//! same running device as the CM agent that drives the QP through RTR and RTS. Two shared objects
//! built from Rust each carry their own copy of every crate (and of every static: the open
//! devices, the handle tables), so the connection manager is implemented here, next to the verbs,
//! and exported under the private version node `SOFTRDMA_PRIVATE_1` with a `softrdma_` prefix.
//! `librdmacm.so.1` (`stubs/rdmacm.c`) is a thin C library that exports rdma-core 44's `rdma_*`
//! symbols with their `RDMACM_1.x` versions and forwards each call here; it depends on
//! `libibverbs.so.1` and needs nothing else. (Loading it with another libibverbs fails at load
//! time: `SOFTRDMA_PRIVATE_1` is not found.)
//!
//! # Devices
//!
//! librdmacm learns an ID's device from the kernel once an address is bound or resolved; here the
//! address chooses the device from softrdma's registry:
//!
//! * `rdma_bind_addr` and `rdma_resolve_addr` with a source address: the device whose GID table
//!   holds that address (`EADDRNOTAVAIL` if none);
//! * a wildcard bind (`0.0.0.0`, `::`), or listening unbound: a device this process has open
//!   already, else the first registry device that opens;
//! * `rdma_resolve_addr` without a source: a device already open in this process that does not
//!   own the destination, else the first such registry device that opens, else the destination's
//!   own device (a connection to oneself).
//!
//! An embedded device owns its UDP port, so the two processes of a test use two devices (two
//! loopback addresses), e.g. a server bound to 127.0.0.2 and a client that resolves from
//! 127.0.0.3 or lets the rule above pick. The CM's context on a device is opened once per process
//! and shared with the application's own `ibv_open_device` of the same device
//! ([`crate::device::open_shared`]); like librdmacm's, it stays open until the process exits, with
//! a PD that becomes `id->pd` of every ID on the device.
//!
//! # Event channels
//!
//! An `rdma_event_channel`'s fd is an epoll instance over one [`CmEventChannel`] per device its IDs
//! live on: it polls readable while an event is pending, and `rdma_get_cm_event` blocks on it
//! (unless the application set `O_NONBLOCK`, then `EAGAIN`). A thread still waiting there when the
//! application destroys the channel stays blocked, as librdmacm's does in the kernel (the channel
//! lives on, counted, until its last waiter is gone). IDs created with a NULL channel are
//! synchronous, as in librdmacm: each has a private channel, and every call that expects an event
//! waits for it and returns its outcome (`ECONNREFUSED` for a reject, the event's status
//! otherwise).
//!
//! # Differences from librdmacm over the kernel
//!
//! * The QP of an ID made by `rdma_create_qp` is driven by the CM agent (where librdmacm drives
//!   it with `rdma_init_qp_attr` and `ibv_modify_qp`): `rdma_connect`/`rdma_accept` move it to RTR
//!   and RTS when the REP is sent or received, and the active side sends the RTU itself, so that
//!   side sees ESTABLISHED. An ID without a QP (the application made its own with `ibv_create_qp`,
//!   or none) behaves as with the kernel: `rdma_init_qp_attr` gives the attributes of INIT, RTR
//!   and RTS, the active side gets CONNECT_RESPONSE and calls `rdma_establish` (RTU; the passive
//!   side then sees ESTABLISHED, this side no further event).
//! * `rdma_resolve_addr` resolves at once (a loopback route needs no neighbour discovery): the
//!   host's route lookup from the source address decides, and a refusal is ADDR_ERROR with its
//!   status (`-EINVAL` from a loopback address to a remote one, `-ENETUNREACH`); the port down
//!   gives ADDR_ERROR or ROUTE_ERROR `-ENETUNREACH`, a source address gone from the netdev
//!   ROUTE_ERROR `-ENODEV`. A peer that never answers shows as UNREACHABLE after the CM's
//!   retries.
//! * A connect that finds no listener is reported REJECTED (reason 8, invalid service ID) after
//!   about 200 ms rather than at once: the REQ is sent again 10 times, 20 ms apart
//!   ([`softrdma_cm::AgentConfig::no_listener_retries`]). Servers often start listening just
//!   after telling their client to connect (perftest's `-R` does, over its first connection);
//!   the kernel's asynchronous address and route resolution usually gives them that moment,
//!   ours takes none.
//! * Multicast is refused (`EOPNOTSUPP`), options are accepted and ignored (the ToS, the ACK
//!   timeout), ECE values are kept locally and never sent. `RDMA_PS_IPOIB` is refused
//!   (`EINVAL`); TCP, UDP and IB port spaces are supported.
//! * `rdma_get_devices` opens every registry device it can; with embedded devices that claims
//!   their addresses for this process (another process can no longer open them).
//! * `rdma_destroy_id` does not wait for the ID's events to be acknowledged; it frees the ID when
//!   the last of them is.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use softrdma_device::Gid;
use softrdma_verbs::{CmConnParam, CmEventChannel, CmEventKind, CmId, PortSpace, Qpn};

use crate::abi::*;
use crate::cma_abi::*;
use crate::device::{self, soft};
use crate::errno;
use crate::objects;

// ---- errors ------------------------------------------------------------------------------------

/// librdmacm's `ERR(e)`: set errno, return -1.
fn err(what: &str, n: c_int, why: &str) -> c_int {
    errno::refuse(what, n, why);
    -1
}

/// The errno value for a refusal of the CM agent (which the Verbs API reports as text).
fn cm_errno(e: &softrdma_verbs::Error) -> c_int {
    let text = e.to_string();
    let is = |c: softrdma_cm::CmError| text.ends_with(&c.to_string());
    if is(softrdma_cm::CmError::AddrInUse) {
        libc::EADDRINUSE
    } else if is(softrdma_cm::CmError::AddrNotAvailable) {
        libc::EADDRNOTAVAIL
    } else {
        errno::of(e)
    }
}

fn cm_fail(what: &str, e: &softrdma_verbs::Error) -> c_int {
    errno::explain(what, e);
    errno::set(cm_errno(e));
    -1
}

// ---- devices -----------------------------------------------------------------------------------

/// A device as the CM uses it: its context (`id->verbs`), default PD (`id->pd`) and addresses.
struct CmaDevice {
    ctx: *mut IbvContext,
    pd: *mut IbvPd,
    addrs: Vec<IpAddr>,
    /// `max_qp_init_rd_atom` and `max_qp_rd_atom`, for "as many as the device allows" (0xff).
    max_init_depth: u8,
    max_resp_res: u8,
}

// SAFETY: the context and PD are never freed and are used only through calls that lock.
unsafe impl Send for CmaDevice {}
// SAFETY: as above.
unsafe impl Sync for CmaDevice {}

impl CmaDevice {
    fn verbs(&self) -> &softrdma_verbs::Context {
        // SAFETY: the context is live for the whole process.
        &unsafe { soft(self.ctx) }.verbs
    }

    fn name(&self) -> &str {
        self.verbs().name()
    }

    fn has(&self, ip: IpAddr) -> bool {
        self.addrs.contains(&ip)
    }
}

/// REQs that found no listener are sent again this many times, 20 ms apart (module docs).
const NO_LISTENER_RETRIES: u8 = 10;

/// The devices the CM has opened, by first use; never closed (librdmacm keeps its contexts too).
static DEVICES: Mutex<Vec<Arc<CmaDevice>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The CM's device `name`, opened (or shared with the application's context) on first use.
fn open_device(name: &str) -> Result<Arc<CmaDevice>, c_int> {
    let mut all = lock(&DEVICES);
    if let Some(d) = all.iter().find(|d| d.name() == name) {
        return Ok(Arc::clone(d));
    }
    let Some(dev) = device::registry_device(name) else {
        return Err(libc::ENODEV);
    };
    // SAFETY: a device of ours from the registry.
    let ctx = unsafe { device::ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(errno::get().max(libc::ENODEV));
    }
    // SAFETY: the context just opened.
    let pd = unsafe { objects::ibv_alloc_pd(ctx) };
    // SAFETY: as above.
    let verbs = &unsafe { soft(ctx) }.verbs;
    let addrs = verbs.info().gids.iter().map(|(_, e)| e.gid.to_ip()).collect();
    // Give a server that is about to listen a moment (module docs). On a softrdmad device there is
    // no CM yet: creating an ID on it fails later with the reason.
    let _ = verbs.set_cm_no_listener_retries(NO_LISTENER_RETRIES);
    let attr = verbs.query_device();
    let d = Arc::new(CmaDevice {
        ctx,
        pd,
        addrs,
        max_init_depth: attr.max_qp_init_rd_atom.min(255) as u8,
        max_resp_res: attr.max_qp_rd_atom.min(255) as u8,
    });
    all.push(Arc::clone(&d));
    Ok(d)
}

/// Registry devices (name, addresses), in registry order.
fn registry() -> Vec<(String, Vec<IpAddr>)> {
    softrdma_verbs::devices()
        .unwrap_or_default()
        .into_iter()
        .map(|i| {
            let addrs = i.gids.iter().map(|(_, e)| e.gid.to_ip()).collect();
            (i.name, addrs)
        })
        .collect()
}

fn opened() -> Vec<Arc<CmaDevice>> {
    lock(&DEVICES).clone()
}

/// The device owning `ip`.
fn device_with(ip: IpAddr) -> Result<Arc<CmaDevice>, c_int> {
    if let Some(d) = opened().into_iter().find(|d| d.has(ip)) {
        return Ok(d);
    }
    match registry().into_iter().find(|(_, a)| a.contains(&ip)) {
        Some((name, _)) => open_device(&name),
        None => Err(libc::EADDRNOTAVAIL),
    }
}

/// Any device: one open in this process, else the first registry device that opens.
fn any_device() -> Result<Arc<CmaDevice>, c_int> {
    if let Some(d) = opened().into_iter().next() {
        return Ok(d);
    }
    for name in device::open_names() {
        if let Ok(d) = open_device(&name) {
            return Ok(d);
        }
    }
    registry().into_iter().find_map(|(name, _)| open_device(&name).ok()).ok_or(libc::ENODEV)
}

/// The device to reach `dst` from when no source is given (module docs).
fn device_towards(dst: IpAddr) -> Result<Arc<CmaDevice>, c_int> {
    // A usable source of the destination's family: the default GID (fe80::, link-local, in every
    // device's table) is no IPv6 source.
    let family = |a: &IpAddr| match a {
        IpAddr::V4(_) => dst.is_ipv4(),
        IpAddr::V6(v6) => dst.is_ipv6() && (v6.segments()[0] & 0xffc0) != 0xfe80 && v6.to_ipv4_mapped().is_none(),
    };
    if let Some(d) = opened().into_iter().find(|d| !d.has(dst) && d.addrs.iter().any(family)) {
        return Ok(d);
    }
    let reg = registry();
    for name in device::open_names() {
        if reg.iter().any(|(n, a)| *n == name && !a.contains(&dst) && a.iter().any(family)) {
            if let Ok(d) = open_device(&name) {
                return Ok(d);
            }
        }
    }
    for (name, a) in &reg {
        if !a.contains(&dst) && a.iter().any(family) {
            if let Ok(d) = open_device(name) {
                return Ok(d);
            }
        }
    }
    device_with(dst).map_err(|_| libc::EADDRNOTAVAIL)
}

// ---- event channels ----------------------------------------------------------------------------

/// Our `struct rdma_event_channel`.
#[repr(C)]
pub struct Channel {
    pub ibv: RdmaEventChannel,
    subs: Mutex<Vec<Sub>>,
    /// Events made here rather than by a device's CM (MULTICAST_JOIN), in order, and the eventfd
    /// in the epoll set that is readable while there are any.
    local: Mutex<std::collections::VecDeque<*mut CmaEvent>>,
    local_fd: c_int,
    /// The application's handle (1 until `rdma_destroy_event_channel`) plus the threads inside
    /// `rdma_get_cm_event`: the last one out closes the fd and frees the channel.
    refs: AtomicUsize,
    /// `rdma_destroy_event_channel` was called.
    destroyed: AtomicBool,
}

/// The channel's events from one device.
struct Sub {
    dev: Arc<CmaDevice>,
    ch: CmEventChannel,
    /// The IDs reporting here: agent handle → `*mut CmaId`.
    ids: HashMap<u32, usize>,
}

impl Channel {
    fn new() -> Result<*mut Channel, c_int> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(errno::get());
        }
        // SAFETY: plain syscalls on descriptors just made (closed again on failure).
        let local_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: u64::MAX };
        // SAFETY: as above.
        if local_fd < 0 || unsafe { libc::epoll_ctl(fd, libc::EPOLL_CTL_ADD, local_fd, &mut ev) } < 0 {
            let e = errno::get();
            // SAFETY: ours, unused.
            unsafe {
                libc::close(fd);
                if local_fd >= 0 {
                    libc::close(local_fd);
                }
            }
            return Err(e);
        }
        Ok(Box::into_raw(Box::new(Channel {
            ibv: RdmaEventChannel { fd },
            subs: Mutex::new(Vec::new()),
            local: Mutex::new(std::collections::VecDeque::new()),
            local_fd,
            refs: AtomicUsize::new(1),
            destroyed: AtomicBool::new(false),
        })))
    }

    /// The sub-channel for `dev`, made on first use. Runs `f` on it under the lock.
    fn with_sub<R>(&self, dev: &Arc<CmaDevice>, f: impl FnOnce(&mut Sub) -> R) -> Result<R, c_int> {
        let mut subs = lock(&self.subs);
        let i = match subs.iter().position(|s| Arc::ptr_eq(&s.dev, dev)) {
            Some(i) => i,
            None => {
                let ch = CmEventChannel::new().map_err(|e| errno::of(&e))?;
                let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: subs.len() as u64 };
                // SAFETY: our epoll fd and the channel's fd, both open.
                if unsafe { libc::epoll_ctl(self.ibv.fd, libc::EPOLL_CTL_ADD, ch.as_raw_fd(), &mut ev) } < 0 {
                    return Err(errno::get());
                }
                subs.push(Sub { dev: Arc::clone(dev), ch, ids: HashMap::new() });
                subs.len() - 1
            }
        };
        Ok(f(&mut subs[i]))
    }

    fn unregister(&self, dev: &Arc<CmaDevice>, handle: u32) {
        let mut subs = lock(&self.subs);
        if let Some(s) = subs.iter_mut().find(|s| Arc::ptr_eq(&s.dev, dev)) {
            s.ids.remove(&handle);
        }
    }

    /// Queue an event made here (its ID's count already raised) and wake a waiter (under the
    /// lock, so the eventfd is readable exactly while the queue holds something).
    fn push_local(&self, e: *mut CmaEvent) {
        let mut q = lock(&self.local);
        q.push_back(e);
        let one = 1u64;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.local_fd, &one as *const u64 as *const c_void, 8) };
        drop(q);
    }

    /// Take out the queued events of ID `id` (of group `mgid` only, if given), in order.
    fn take_local(&self, id: *mut CmaId, mgid: Option<&[u8; 16]>) -> Vec<*mut CmaEvent> {
        let mut q = lock(&self.local);
        let mut taken = Vec::new();
        q.retain(|&e| {
            // SAFETY: queued events are live boxes.
            let (owner, dgid) = unsafe { ((*e).owner, (*e).ibv.param.ud.ah_attr.grh.dgid.raw) };
            let mine = owner == id && mgid.is_none_or(|m| *m == dgid);
            if mine {
                taken.push(e);
            }
            !mine
        });
        self.quiet_if_empty(&q);
        taken
    }

    /// Reset the eventfd once the queue (`q`, its lock held) is empty: not readable any more.
    fn quiet_if_empty(&self, q: &std::collections::VecDeque<*mut CmaEvent>) {
        if q.is_empty() {
            let mut n = 0u64;
            // SAFETY: reading 8 bytes from our non-blocking eventfd.
            unsafe { libc::read(self.local_fd, &mut n as *mut u64 as *mut c_void, 8) };
        }
    }

    /// Drop the queued events of ID `id` (of group `mgid` only, if given): the ID is destroyed
    /// or left the group before they were reported.
    fn forget_local(&self, id: *mut CmaId, mgid: Option<&[u8; 16]>) {
        for e in self.take_local(id, mgid) {
            // SAFETY: boxed by join and never handed out; it held one count on its live owner.
            unsafe {
                drop(Box::from_raw(e));
                (*id).events.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// The oldest event made here, if any (the eventfd is reset when the queue empties).
    fn pop_local(&self) -> Option<*mut CmaEvent> {
        let mut q = lock(&self.local);
        let e = q.pop_front();
        self.quiet_if_empty(&q);
        e
    }

    /// One pending event, with the ID it is for (its event count raised), if any.
    fn take(&self) -> Option<(softrdma_verbs::CmEvent, *mut CmaId, Arc<CmaDevice>)> {
        let subs = lock(&self.subs);
        for s in subs.iter() {
            while let Some(ev) = s.ch.get_event(s.dev.verbs(), Some(Duration::ZERO)) {
                let target = match ev.kind {
                    CmEventKind::ConnectRequest { listener } => s.ids.get(&listener.0),
                    _ => s.ids.get(&ev.id),
                };
                let Some(&p) = target else {
                    // The ID was destroyed: its events go with it; a request nobody will answer
                    // is refused now rather than left to time out.
                    if let Some(n) = &ev.new_id {
                        let _ = n.reject(&[]);
                    }
                    continue;
                };
                let id = p as *mut CmaId;
                // SAFETY: registered IDs are live (destroy unregisters under this lock first).
                unsafe { (*id).events.fetch_add(1, Ordering::AcqRel) };
                return Some((ev, id, Arc::clone(&s.dev)));
            }
        }
        None
    }
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: plain syscall on the channel's fd.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Drop one reference to `ch`; the last one closes its fd and frees it.
///
/// # Safety
///
/// `ch` is a live channel and the caller holds one of its references, which it gives up.
unsafe fn release(ch: *mut Channel) {
    // SAFETY: live while the caller's reference is.
    if unsafe { (*ch).refs.fetch_sub(1, Ordering::AcqRel) } == 1 {
        // SAFETY: boxed by Channel::new; no reference is left.
        let c = unsafe { Box::from_raw(ch) };
        for e in lock(&c.local).drain(..) {
            // SAFETY: boxed by join and never handed out; its owner is live (a destroyed ID's
            // events are taken out at its destroy).
            unsafe {
                (*(*e).owner).events.fetch_sub(1, Ordering::AcqRel);
                drop(Box::from_raw(e));
            }
        }
        // SAFETY: our epoll fd and eventfd.
        unsafe {
            libc::close(c.ibv.fd);
            libc::close(c.local_fd);
        }
    }
}

/// The next event of `ch`, waiting for it unless the fd is non-blocking.
///
/// A thread waiting here when the application destroys the channel (rping's event thread, as its
/// main thread exits) stays blocked for good, as in librdmacm, whose waiter sits in the kernel on
/// the channel's file: it neither returns an error nor touches the freed channel.
unsafe fn next_event(ch: *mut Channel) -> Result<*mut RdmaCmEvent, c_int> {
    // SAFETY: a live channel (caller's contract); the reference taken here keeps it so.
    let c = unsafe { &*ch };
    c.refs.fetch_add(1, Ordering::AcqRel);
    let r = 'wait: loop {
        if c.destroyed.load(Ordering::Acquire) {
            break None;
        }
        if let Some(e) = c.pop_local() {
            // SAFETY: boxed by join, counted on its owner, which is live (a destroy takes its
            // ID's events out of the queue first).
            unsafe { process_join(&mut *e) };
            break 'wait Some(Ok(e as *mut RdmaCmEvent));
        }
        while let Some((ev, id, dev)) = c.take() {
            // SAFETY: `id` is live and counted.
            if let Some(e) = unsafe { translate(ev, id, &dev) } {
                break 'wait Some(Ok(e));
            }
        }
        if nonblocking(c.ibv.fd) {
            break Some(Err(libc::EAGAIN));
        }
        let mut out = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: our epoll fd (kept open by our reference), one writable event.
        let n = unsafe { libc::epoll_wait(c.ibv.fd, &mut out, 1, -1) };
        if n < 0 && errno::get() != libc::EINTR {
            break Some(Err(errno::get()));
        }
    };
    // SAFETY: the reference taken above.
    unsafe { release(ch) };
    match r {
        Some(r) => r,
        None => loop {
            std::thread::park();
        },
    }
}

// ---- IDs ---------------------------------------------------------------------------------------

/// Our `struct rdma_cm_id`.
#[repr(C)]
pub struct CmaId {
    pub ibv: RdmaCmId,
    /// Events reported and not yet acknowledged (CONNECT_REQUEST counts on the listener).
    events: AtomicUsize,
    destroyed: AtomicBool,
    st: Mutex<IdState>,
}

#[derive(Default)]
struct IdState {
    dev: Option<Arc<CmaDevice>>,
    cm: Option<CmId>,
    /// Created with a NULL channel: the channel is ours, calls wait for their event.
    sync: bool,
    /// `rdma_create_ep` on a passive address: the QP `rdma_get_request` creates.
    qp_init: Option<IbvQpInitAttr>,
    /// `rdma_addrinfo.ai_connect`, sent ahead of the connect's private data.
    connect_data: Vec<u8>,
    /// The CQs and channels were made by `rdma_create_qp` (librdmacm's `ucma_create_cqs`).
    own_cqs: bool,
    /// From the connection request: the peer's initiator depth and responder resources, as the
    /// kernel reports them (from the receiver's side).
    req_resources: (u8, u8),
    /// Connect or accept was called (a later disconnect of a closed connection succeeds).
    connected: bool,
    local_ece: Option<(u32, u32)>,
    /// Multicast groups joined (`rdma_join_multicast`).
    joined: Vec<Joined>,
}

/// A multicast group an ID joined.
struct Joined {
    mgid: [u8; 16],
    /// Joined as a send-only member: the ID's QP is not attached.
    send_only: bool,
    /// The ID's QP was attached to the group when the join was reported.
    attached: bool,
}

// SAFETY: the raw pointers in IdState (inside IbvQpInitAttr) are the application's, only copied.
unsafe impl Send for IdState {}

fn ps_of(ps: c_int) -> Option<PortSpace> {
    match ps {
        RDMA_PS_TCP => Some(PortSpace::Tcp),
        RDMA_PS_UDP => Some(PortSpace::Udp),
        RDMA_PS_IB => Some(PortSpace::Ib),
        _ => None,
    }
}

unsafe fn cma<'a>(id: *mut RdmaCmId) -> &'a CmaId {
    // SAFETY: the public struct is the first field of our boxed CmaId (caller's contract).
    unsafe { &*(id as *mut CmaId) }
}

unsafe fn channel_of<'a>(id: &RdmaCmId) -> &'a Channel {
    // SAFETY: every ID's channel is one of ours, live while the ID is.
    unsafe { &*(id.channel as *mut Channel) }
}

fn new_id(channel: *mut Channel, context: *mut c_void, ps: c_int, qp_type: c_int, sync: bool) -> *mut CmaId {
    // SAFETY: all-zero is a valid RdmaCmId (NULL pointers, zero integers).
    let mut ibv: RdmaCmId = unsafe { std::mem::zeroed() };
    ibv.channel = channel as *mut RdmaEventChannel;
    ibv.context = context;
    ibv.ps = ps;
    ibv.qp_type = qp_type;
    Box::into_raw(Box::new(CmaId {
        ibv,
        events: AtomicUsize::new(0),
        destroyed: AtomicBool::new(false),
        st: Mutex::new(IdState { sync, ..IdState::default() }),
    }))
}

/// Free an ID once it is destroyed and its last event acknowledged.
unsafe fn maybe_free(id: *mut CmaId) {
    // SAFETY: a live ID of ours (caller's contract).
    let c = unsafe { &*id };
    if c.destroyed.load(Ordering::Acquire) && c.events.load(Ordering::Acquire) == 0 {
        if !c.ibv.route.path_rec.is_null() {
            // SAFETY: boxed by set_route.
            drop(unsafe { Box::from_raw(c.ibv.route.path_rec) });
        }
        // SAFETY: boxed by new_id; nobody refers to it any more.
        drop(unsafe { Box::from_raw(id) });
    }
}

/// Give `id` a device: its verbs context and default PD, and an agent ID on the device reporting
/// to the ID's channel. Returns the device (the one it has if it has one).
unsafe fn attach(id: *mut CmaId, dev: Arc<CmaDevice>) -> Result<Arc<CmaDevice>, c_int> {
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *id };
    {
        let st = lock(&c.st);
        if let Some(d) = &st.dev {
            return Ok(Arc::clone(d));
        }
    }
    let ps = ps_of(c.ibv.ps).ok_or(libc::EINVAL)?;
    // SAFETY: the ID's channel is live.
    let ch = unsafe { channel_of(&c.ibv) };
    let cm = ch.with_sub(&dev, |s| {
        let cm = dev.verbs().create_cm_id(&s.ch, ps).map_err(|e| errno::of(&e))?;
        s.ids.insert(cm.handle(), id as usize);
        Ok::<_, c_int>(cm)
    })??;
    let mut st = lock(&c.st);
    st.dev = Some(Arc::clone(&dev));
    st.cm = Some(cm);
    drop(st);
    c.ibv.verbs = dev.ctx;
    c.ibv.pd = dev.pd;
    c.ibv.port_num = 1;
    Ok(dev)
}

/// Run `f` on the ID's agent ID (EINVAL if the ID has no device yet).
fn with_cm<R>(
    c: &CmaId,
    f: impl FnOnce(&CmId) -> softrdma_verbs::error::Result<R>,
) -> Result<R, Option<softrdma_verbs::Error>> {
    let st = lock(&c.st);
    match &st.cm {
        Some(cm) => f(cm).map_err(Some),
        None => Err(None),
    }
}

fn sockaddr_in(a: *const libc::sockaddr) -> Option<SocketAddr> {
    if a.is_null() {
        return None;
    }
    // SAFETY: the caller's sockaddr, at least as long as its family says.
    unsafe {
        match c_int::from((*a).sa_family) {
            libc::AF_INET => {
                let s = &*(a as *const libc::sockaddr_in);
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                    u16::from_be(s.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let s = &*(a as *const libc::sockaddr_in6);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(s.sin6_addr.s6_addr),
                    u16::from_be(s.sin6_port),
                    s.sin6_flowinfo,
                    s.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

fn store(dst: &mut libc::sockaddr_storage, a: SocketAddr) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    *dst = unsafe { std::mem::zeroed() };
    let p = dst as *mut libc::sockaddr_storage;
    // SAFETY: sockaddr_storage is large and aligned enough for either address.
    unsafe {
        match a {
            SocketAddr::V4(v4) => {
                let s = &mut *(p as *mut libc::sockaddr_in);
                s.sin_family = libc::AF_INET as libc::sa_family_t;
                s.sin_port = v4.port().to_be();
                s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            }
            SocketAddr::V6(v6) => {
                let s = &mut *(p as *mut libc::sockaddr_in6);
                s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                s.sin6_port = v6.port().to_be();
                s.sin6_addr.s6_addr = v6.ip().octets();
                s.sin6_flowinfo = v6.flowinfo();
                s.sin6_scope_id = v6.scope_id();
            }
        }
    }
}

/// Copy the agent's addresses and route into the public struct.
fn set_route(c: &mut CmaId) {
    let (addrs, route) = {
        let st = lock(&c.st);
        match &st.cm {
            Some(cm) => (cm.addrs(), cm.route()),
            None => return,
        }
    };
    if let Some(l) = addrs.0 {
        store(&mut c.ibv.route.addr.src, l);
        c.ibv.route.addr.ibaddr.sgid.raw = Gid::from_ip(l.ip()).0;
    }
    if let Some(r) = addrs.1 {
        store(&mut c.ibv.route.addr.dst, r);
        c.ibv.route.addr.ibaddr.dgid.raw = Gid::from_ip(r.ip()).0;
    }
    c.ibv.route.addr.ibaddr.pkey = 0xffffu16.to_be();
    if let Some(r) = route {
        let rec = IbvSaPathRec {
            dgid: IbvGid { raw: r.dgid },
            sgid: IbvGid { raw: r.sgid },
            dlid: 0,
            slid: 0,
            raw_traffic: 0,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            reversible: 1,
            numb_path: 1,
            pkey: 0xffffu16.to_be(),
            sl: 0,
            mtu_selector: 2,
            mtu: r.mtu as u8,
            rate_selector: 2,
            // IB_RATE_10_GBPS, what rxe's port reports.
            rate: 3,
            packet_life_time_selector: 2,
            packet_life_time: 0,
            preference: 0,
        };
        if c.ibv.route.path_rec.is_null() {
            c.ibv.route.path_rec = Box::into_raw(Box::new(rec));
        } else {
            // SAFETY: boxed above on an earlier call.
            unsafe { *c.ibv.route.path_rec = rec };
        }
        c.ibv.route.num_paths = 1;
    }
}

/// librdmacm's `ucma_complete`: on a synchronous ID, wait for the event the call caused and
/// return its outcome; keep it in `id->event` until the next call.
unsafe fn complete(id: *mut CmaId) -> c_int {
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *id };
    if !lock(&c.st).sync {
        return 0;
    }
    if !c.ibv.event.is_null() {
        // SAFETY: the event we kept.
        unsafe { softrdma_rdma_ack_cm_event(c.ibv.event) };
        c.ibv.event = ptr::null_mut();
    }
    // SAFETY: a synchronous ID's channel is its own, live.
    let ev = match unsafe { next_event(c.ibv.channel as *mut Channel) } {
        Ok(e) => e,
        Err(n) => return err("rdma_cm", n, "waiting for the ID's event"),
    };
    c.ibv.event = ev;
    // SAFETY: the event just taken.
    let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
    if status != 0 {
        let n = if kind == RDMA_CM_EVENT_REJECTED { libc::ECONNREFUSED } else { status.abs() };
        errno::set(n);
        return -1;
    }
    0
}

// ---- events ------------------------------------------------------------------------------------

/// Our `struct rdma_cm_event`, with the private data its pointers point at.
#[repr(C)]
struct CmaEvent {
    ibv: RdmaCmEvent,
    /// The ID whose event count this event holds.
    owner: *mut CmaId,
    private: [u8; RDMA_MAX_PRIVATE_DATA],
}

fn set_qp_state(id: &RdmaCmId, state: c_int) {
    if !id.qp.is_null() {
        // SAFETY: the ID's QP is live while it is set; the public state field is ours to keep.
        unsafe { (*id.qp).state = state };
    }
}

/// Make the public event for `ev` on `id` (counted); `None` drops it (and the count).
unsafe fn translate(ev: softrdma_verbs::CmEvent, id: *mut CmaId, dev: &Arc<CmaDevice>) -> Option<*mut RdmaCmEvent> {
    // SAFETY: live and counted by Channel::take.
    let c = unsafe { &mut *id };
    if c.destroyed.load(Ordering::Acquire) {
        c.events.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: the count just dropped.
        unsafe { maybe_free(id) };
        return None;
    }
    // SAFETY: all-zero is a valid event (NULL pointers, zeros).
    let mut e: Box<CmaEvent> = Box::new(unsafe { std::mem::zeroed() });
    e.owner = id;
    e.ibv.id = id as *mut RdmaCmId;
    let is_ud = c.ibv.qp_type == IBV_QPT_UD;
    let private = |e: &mut CmaEvent, data: &[u8]| -> (*const c_void, u8) {
        let n = data.len().min(255);
        e.private[..n].copy_from_slice(&data[..n]);
        let p = if n == 0 { ptr::null() } else { e.private.as_ptr() as *const c_void };
        (p, n as u8)
    };
    let conn_param = |e: &mut CmaEvent, conn: &softrdma_cm::ConnInfo, swap: bool| {
        let (p, n) = private(e, &conn.private_data);
        let (resp, init) = if swap {
            (conn.initiator_depth, conn.responder_resources)
        } else {
            (conn.responder_resources, conn.initiator_depth)
        };
        e.ibv.param.conn = RdmaConnParam {
            private_data: p,
            private_data_len: n,
            responder_resources: resp,
            initiator_depth: init,
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            qp_num: conn.remote_qpn.value(),
        };
    };
    match ev.kind {
        CmEventKind::AddrResolved => {
            set_route(c);
            e.ibv.event = RDMA_CM_EVENT_ADDR_RESOLVED;
        }
        CmEventKind::AddrError { status } => {
            e.ibv.event = RDMA_CM_EVENT_ADDR_ERROR;
            e.ibv.status = status;
        }
        CmEventKind::RouteResolved => {
            set_route(c);
            e.ibv.event = RDMA_CM_EVENT_ROUTE_RESOLVED;
        }
        CmEventKind::RouteError { status } => {
            e.ibv.event = RDMA_CM_EVENT_ROUTE_ERROR;
            e.ibv.status = status;
        }
        CmEventKind::ConnectResponse => {
            e.ibv.event = RDMA_CM_EVENT_CONNECT_RESPONSE;
            conn_param(&mut e, &ev.conn, false);
        }
        CmEventKind::ConnectRequest { .. } => {
            let Some(mut cm) = ev.new_id else {
                c.events.fetch_sub(1, Ordering::AcqRel);
                return None;
            };
            let listener_sync = lock(&c.st).sync;
            let channel = if listener_sync {
                match Channel::new() {
                    Ok(ch) => ch,
                    Err(_) => {
                        let _ = cm.reject(&[]);
                        c.events.fetch_sub(1, Ordering::AcqRel);
                        return None;
                    }
                }
            } else {
                c.ibv.channel as *mut Channel
            };
            let nid = new_id(channel, c.ibv.context, c.ibv.ps, c.ibv.qp_type, listener_sync);
            // SAFETY: the channel is live (ours or the listener's).
            let ch = unsafe { &*channel };
            let handle = cm.handle();
            let reg = ch.with_sub(dev, |s| {
                if listener_sync {
                    cm.migrate(&s.ch);
                }
                s.ids.insert(handle, nid as usize);
            });
            if reg.is_err() {
                let _ = cm.reject(&[]);
                c.events.fetch_sub(1, Ordering::AcqRel);
                return None;
            }
            // SAFETY: just made.
            let n = unsafe { &mut *nid };
            {
                let mut st = lock(&n.st);
                st.dev = Some(Arc::clone(dev));
                st.cm = Some(cm);
                st.req_resources = (ev.conn.responder_resources, ev.conn.initiator_depth);
            }
            n.ibv.verbs = dev.ctx;
            n.ibv.pd = dev.pd;
            n.ibv.port_num = 1;
            set_route(n);
            e.ibv.id = nid as *mut RdmaCmId;
            e.ibv.listen_id = id as *mut RdmaCmId;
            e.ibv.event = RDMA_CM_EVENT_CONNECT_REQUEST;
            if is_ud {
                let (p, len) = private(&mut e, &ev.conn.private_data);
                e.ibv.param.ud.private_data = p;
                e.ibv.param.ud.private_data_len = len;
            } else {
                // The kernel reports a request's resources from the receiver's side.
                conn_param(&mut e, &ev.conn, true);
            }
        }
        CmEventKind::Established => {
            e.ibv.event = RDMA_CM_EVENT_ESTABLISHED;
            if let (true, Some(ud)) = (is_ud, ev.ud) {
                let (p, len) = private(&mut e, &ev.conn.private_data);
                let sgid_index = with_cm(c, |cm| Ok(cm.route())).ok().flatten().map_or(0, |r| r.sgid_index);
                e.ibv.param.ud = RdmaUdParam {
                    private_data: p,
                    private_data_len: len,
                    ah_attr: IbvAhAttr::roce(ud.dgid, sgid_index, 64, 0, 0),
                    qp_num: ud.remote_qpn.value(),
                    qkey: ud.qkey,
                };
            } else {
                conn_param(&mut e, &ev.conn, false);
                set_qp_state(&c.ibv, IBV_QPS_RTS);
            }
        }
        CmEventKind::Rejected { reason } => {
            e.ibv.event = RDMA_CM_EVENT_REJECTED;
            e.ibv.status = c_int::from(reason);
            conn_param(&mut e, &ev.conn, false);
            set_qp_state(&c.ibv, IBV_QPS_ERR);
        }
        CmEventKind::ConnectError => {
            e.ibv.event = RDMA_CM_EVENT_CONNECT_ERROR;
            e.ibv.status = -libc::ETIMEDOUT;
            set_qp_state(&c.ibv, IBV_QPS_ERR);
        }
        CmEventKind::Unreachable => {
            e.ibv.event = RDMA_CM_EVENT_UNREACHABLE;
            e.ibv.status = -libc::ETIMEDOUT;
            set_qp_state(&c.ibv, IBV_QPS_ERR);
        }
        CmEventKind::Disconnected => {
            e.ibv.event = RDMA_CM_EVENT_DISCONNECTED;
            e.ibv.status = ev.status;
            set_qp_state(&c.ibv, IBV_QPS_ERR);
        }
        CmEventKind::TimewaitExit => e.ibv.event = RDMA_CM_EVENT_TIMEWAIT_EXIT,
        _ => {
            c.events.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
    }
    Some(Box::into_raw(e) as *mut RdmaCmEvent)
}

// ---- the API -----------------------------------------------------------------------------------

/// `rdma_create_event_channel`: ENODEV when the registry has no device (librdmacm's message:
/// "No RDMA devices were detected").
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_event_channel() -> *mut RdmaEventChannel {
    if registry().is_empty() {
        return errno::null("rdma_create_event_channel", libc::ENODEV, "no softrdma devices");
    }
    match Channel::new() {
        Ok(c) => c as *mut RdmaEventChannel,
        Err(n) => errno::null("rdma_create_event_channel", n, "epoll_create1 failed"),
    }
}

/// `rdma_destroy_event_channel`: the application has destroyed the channel's IDs.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_destroy_event_channel(channel: *mut RdmaEventChannel) {
    if channel.is_null() {
        return;
    }
    let ch = channel as *mut Channel;
    // SAFETY: a live channel of ours; the application gives up its reference (a thread still
    // waiting in rdma_get_cm_event holds its own: see `next_event`).
    unsafe {
        (*ch).destroyed.store(true, Ordering::Release);
        release(ch);
    }
}

/// `rdma_create_id`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_id(
    channel: *mut RdmaEventChannel,
    id: *mut *mut RdmaCmId,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    let qp_type = if ps == RDMA_PS_UDP || ps == RDMA_PS_IPOIB { IBV_QPT_UD } else { IBV_QPT_RC };
    // SAFETY: forwarded contract.
    unsafe { create_id2(channel, id, context, ps, qp_type) }
}

unsafe fn create_id2(
    channel: *mut RdmaEventChannel,
    id: *mut *mut RdmaCmId,
    context: *mut c_void,
    ps: c_int,
    qp_type: c_int,
) -> c_int {
    const WHAT: &str = "rdma_create_id";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    if ps_of(ps).is_none() {
        return err(WHAT, libc::EINVAL, "port space must be RDMA_PS_TCP, UDP or IB");
    }
    let (ch, sync) = if channel.is_null() {
        match Channel::new() {
            Ok(c) => (c, true),
            Err(n) => return err(WHAT, n, "cannot make the ID's channel"),
        }
    } else {
        (channel as *mut Channel, false)
    };
    let p = new_id(ch, context, ps, qp_type, sync);
    // SAFETY: `id` is writable (checked non-NULL).
    unsafe { *id = p as *mut RdmaCmId };
    0
}

/// `rdma_destroy_id`: tears a connection down (DREQ), frees the ID once its events are acked.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_destroy_id(id: *mut RdmaCmId) -> c_int {
    if id.is_null() {
        return err("rdma_destroy_id", libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if !c.ibv.event.is_null() {
        // SAFETY: the event a synchronous call kept.
        unsafe { softrdma_rdma_ack_cm_event(c.ibv.event) };
        c.ibv.event = ptr::null_mut();
    }
    let (dev, cm, sync) = {
        let mut st = lock(&c.st);
        (st.dev.take(), st.cm.take(), st.sync)
    };
    // SAFETY: the ID's channel is live.
    let ch = unsafe { channel_of(&c.ibv) };
    if let (Some(dev), Some(cm)) = (&dev, &cm) {
        ch.unregister(dev, cm.handle());
    }
    drop(cm);
    // Events made here and not yet reported go with the ID, as the kernel's do.
    ch.forget_local(p, None);
    c.destroyed.store(true, Ordering::Release);
    let channel = c.ibv.channel;
    // SAFETY: unregistered: no new event can count on it.
    unsafe { maybe_free(p) };
    if sync {
        // SAFETY: the ID's private channel.
        unsafe { softrdma_rdma_destroy_event_channel(channel) };
    }
    0
}

/// `rdma_bind_addr`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_bind_addr(id: *mut RdmaCmId, addr: *mut libc::sockaddr) -> c_int {
    const WHAT: &str = "rdma_bind_addr";
    let Some(a) = sockaddr_in(addr) else {
        return err(WHAT, libc::EINVAL, "not an IPv4 or IPv6 address");
    };
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let dev = if a.ip().is_unspecified() { any_device() } else { device_with(a.ip()) };
    let dev = match dev {
        Ok(d) => d,
        Err(n) => return err(WHAT, n, "no softrdma device has that address"),
    };
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    if let Err(n) = unsafe { attach(p, dev) } {
        return err(WHAT, n, "cannot use the device");
    }
    // SAFETY: as above.
    let c = unsafe { &mut *p };
    match with_cm(c, |cm| cm.bind_addr(a)) {
        Ok(()) => {
            set_route(c);
            0
        }
        Err(Some(e)) => cm_fail(WHAT, &e),
        Err(None) => err(WHAT, libc::EINVAL, "no device"),
    }
}

/// `rdma_resolve_addr`: picks the device (module docs); ADDR_RESOLVED follows at once.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_resolve_addr(
    id: *mut RdmaCmId,
    src_addr: *mut libc::sockaddr,
    dst_addr: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    const WHAT: &str = "rdma_resolve_addr";
    let Some(dst) = sockaddr_in(dst_addr) else {
        return err(WHAT, libc::EINVAL, "destination is not an IPv4 or IPv6 address");
    };
    let src = sockaddr_in(src_addr);
    if (!src_addr.is_null() && src.is_none()) || id.is_null() {
        return err(WHAT, libc::EINVAL, "bad source address or NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    let has_dev = lock(&c.st).dev.is_some();
    if !has_dev {
        let dev = match src.filter(|s| !s.ip().is_unspecified()) {
            Some(s) => device_with(s.ip()),
            None => device_towards(dst.ip()),
        };
        let dev = match dev {
            Ok(d) => d,
            Err(n) => return err(WHAT, n, "no softrdma device for that address"),
        };
        // SAFETY: as above.
        if let Err(n) = unsafe { attach(p, dev) } {
            return err(WHAT, n, "cannot use the device");
        }
        if let Some(s) = src.filter(|s| s.port() != 0) {
            if let Err(Some(e)) = with_cm(c, |cm| cm.bind_addr(s)) {
                return cm_fail(WHAT, &e);
            }
        }
    }
    let src_ip = src.map(|s| s.ip()).filter(|i| !i.is_unspecified());
    match with_cm(c, |cm| cm.resolve_addr(src_ip, dst)) {
        Ok(()) => {}
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "no device"),
    }
    store(&mut c.ibv.route.addr.dst, dst);
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// `rdma_resolve_route`: ROUTE_RESOLVED follows at once.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_resolve_route(id: *mut RdmaCmId, _timeout_ms: c_int) -> c_int {
    const WHAT: &str = "rdma_resolve_route";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    match with_cm(unsafe { &*p }, |cm| cm.resolve_route()) {
        Ok(()) => {}
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "resolve the address first"),
    }
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// `rdma_listen`: an unbound ID listens on a wildcard address and an ephemeral port.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_listen(id: *mut RdmaCmId, backlog: c_int) -> c_int {
    const WHAT: &str = "rdma_listen";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if lock(&c.st).dev.is_none() {
        let mut any: libc::sockaddr_storage =
            // SAFETY: all-zero is valid.
            unsafe { std::mem::zeroed() };
        store(&mut any, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        // SAFETY: forwarded.
        let r = unsafe { softrdma_rdma_bind_addr(id, &mut any as *mut _ as *mut libc::sockaddr) };
        if r != 0 {
            return r;
        }
    }
    // librdmacm's default backlog when given 0 or less (the kernel's is 1024 too).
    let backlog = if backlog <= 0 { 1024 } else { backlog as u32 };
    match with_cm(c, |cm| cm.listen(backlog)) {
        Ok(()) => {
            set_route(c);
            0
        }
        Err(Some(e)) => cm_fail(WHAT, &e),
        Err(None) => err(WHAT, libc::EINVAL, "no device"),
    }
}

/// `rdma_get_request`: the next connection request of a synchronous listener, with the QP of
/// `rdma_create_ep`'s attributes.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_request(listen: *mut RdmaCmId, id: *mut *mut RdmaCmId) -> c_int {
    const WHAT: &str = "rdma_get_request";
    if listen.is_null() || id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: a live ID of ours.
    let l = unsafe { &mut *(listen as *mut CmaId) };
    let (sync, qp_init) = {
        let st = lock(&l.st);
        // SAFETY: a plain copy of the attributes (pointers and integers).
        (st.sync, st.qp_init.as_ref().map(|a| unsafe { ptr::read(a) }))
    };
    if !sync {
        return err(WHAT, libc::EINVAL, "the listener has an event channel");
    }
    if !l.ibv.event.is_null() {
        // SAFETY: the event kept by the previous call.
        unsafe { softrdma_rdma_ack_cm_event(l.ibv.event) };
        l.ibv.event = ptr::null_mut();
    }
    // SAFETY: the listener's own channel.
    let ev = match unsafe { next_event(l.ibv.channel as *mut Channel) } {
        Ok(e) => e,
        Err(n) => return err(WHAT, n, "waiting for a request"),
    };
    // SAFETY: the event just taken.
    let (kind, status, nid) = unsafe { ((*ev).event, (*ev).status, (*ev).id) };
    let mut fail = |n: c_int| {
        l.ibv.event = ev;
        errno::set(n);
        -1
    };
    if kind == RDMA_CM_EVENT_REJECTED {
        return fail(libc::ECONNREFUSED);
    }
    if status != 0 {
        return fail(status.abs());
    }
    if kind != RDMA_CM_EVENT_CONNECT_REQUEST {
        return fail(libc::EINVAL);
    }
    if let Some(mut attr) = qp_init {
        // SAFETY: the new ID is live; the attributes are a copy.
        if unsafe { softrdma_rdma_create_qp(nid, l.ibv.pd, &mut attr) } != 0 {
            return fail(errno::get());
        }
    }
    // SAFETY: the new ID keeps the event until its next synchronous call (as librdmacm).
    unsafe {
        (*nid).event = ev;
        *id = nid;
    }
    0
}

fn conn_param_from(
    p: *const RdmaConnParam,
    qpn: u32,
    srq: bool,
    dev: &CmaDevice,
    extra: &[u8],
    defaults: (u8, u8),
) -> CmConnParam {
    let mut c = CmConnParam::new(Qpn::new(qpn));
    c.srq = srq;
    c.private_data = extra.to_vec();
    c.retry_count = 7;
    c.rnr_retry_count = 7;
    let (mut resp, mut init) = defaults;
    if !p.is_null() {
        // SAFETY: the caller's parameters.
        let p = unsafe { &*p };
        if p.responder_resources != RDMA_MAX_RESP_RES {
            resp = p.responder_resources;
        }
        if p.initiator_depth != RDMA_MAX_INIT_DEPTH {
            init = p.initiator_depth;
        }
        c.retry_count = p.retry_count;
        c.rnr_retry_count = p.rnr_retry_count;
        if !p.private_data.is_null() && p.private_data_len > 0 {
            // SAFETY: `private_data_len` readable bytes (caller's contract).
            c.private_data.extend_from_slice(unsafe {
                std::slice::from_raw_parts(p.private_data as *const u8, p.private_data_len.into())
            });
        }
    }
    c.responder_resources = resp.min(dev.max_resp_res);
    c.initiator_depth = init.min(dev.max_init_depth);
    c
}

/// `rdma_connect`: REQ (SIDR_REQ for UD); ESTABLISHED (CONNECT_RESPONSE for an ID without a QP),
/// REJECTED or UNREACHABLE follows.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_connect(id: *mut RdmaCmId, conn_param: *mut RdmaConnParam) -> c_int {
    const WHAT: &str = "rdma_connect";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if c.ibv.ps == RDMA_PS_TCP && c.ibv.qp.is_null() && conn_param.is_null() {
        return err(WHAT, libc::EINVAL, "no QP and no connection parameters");
    }
    let Some(dev) = lock(&c.st).dev.clone() else {
        return err(WHAT, libc::EINVAL, "resolve the address and route first");
    };
    let (qpn, srq) = if c.ibv.qp.is_null() {
        // SAFETY: checked non-NULL when there is no QP (TCP), else NULL-tolerant.
        let cp = unsafe { conn_param.as_ref() };
        (cp.map_or(0, |c| c.qp_num), cp.is_some_and(|c| c.srq != 0))
    } else {
        // SAFETY: the ID's QP.
        unsafe { ((*c.ibv.qp).qp_num, !(*c.ibv.qp).srq.is_null()) }
    };
    let extra = std::mem::take(&mut lock(&c.st).connect_data);
    let mut param = conn_param_from(conn_param, qpn, srq, &dev, &extra, (dev.max_resp_res, dev.max_init_depth));
    param.drive_qp = !c.ibv.qp.is_null();
    match with_cm(c, |cm| cm.connect(param)) {
        Ok(()) => {}
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "no device"),
    }
    lock(&c.st).connected = true;
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// `rdma_accept`: the ID's QP goes to RTR and RTS and the REP leaves (SIDR_REP for UD); without a
/// QP on the ID the application has moved its own (`rdma_init_qp_attr`).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_accept(id: *mut RdmaCmId, conn_param: *mut RdmaConnParam) -> c_int {
    const WHAT: &str = "rdma_accept";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if c.ibv.qp.is_null() && conn_param.is_null() {
        return err(WHAT, libc::EINVAL, "no QP and no connection parameters");
    }
    let (dev, req) = {
        let st = lock(&c.st);
        (st.dev.clone(), st.req_resources)
    };
    let Some(dev) = dev else {
        return err(WHAT, libc::EINVAL, "not a connection request");
    };
    let (qpn, srq) = if c.ibv.qp.is_null() {
        // SAFETY: checked non-NULL above.
        let cp = unsafe { &*conn_param };
        (cp.qp_num, cp.srq != 0)
    } else {
        // SAFETY: the ID's QP.
        unsafe { ((*c.ibv.qp).qp_num, !(*c.ibv.qp).srq.is_null()) }
    };
    // Defaults: what the requester offered, as far as the device allows (librdmacm).
    let mut param = conn_param_from(conn_param, qpn, srq, &dev, &[], (req.1, req.0));
    param.qkey = RDMA_UDP_QKEY;
    param.drive_qp = !c.ibv.qp.is_null();
    match with_cm(c, |cm| cm.accept(param)) {
        Ok(()) => {}
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "no device"),
    }
    lock(&c.st).connected = true;
    if c.ibv.qp_type == IBV_QPT_UD {
        return 0;
    }
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// `rdma_reject`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_reject(
    id: *mut RdmaCmId,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    const WHAT: &str = "rdma_reject";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let data = if private_data.is_null() || private_data_len == 0 {
        &[][..]
    } else {
        // SAFETY: `private_data_len` readable bytes (caller's contract).
        unsafe { std::slice::from_raw_parts(private_data as *const u8, private_data_len.into()) }
    };
    // SAFETY: a live ID of ours.
    match with_cm(unsafe { cma(id) }, |cm| cm.reject(data)) {
        Ok(()) => 0,
        Err(Some(e)) => cm_fail(WHAT, &e),
        Err(None) => err(WHAT, libc::EINVAL, "not a connection request"),
    }
}

/// `rdma_reject_ece`: a reject (ECE is not negotiated here).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_reject_ece(
    id: *mut RdmaCmId,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { softrdma_rdma_reject(id, private_data, private_data_len) }
}

/// `rdma_notify`: nothing to do, the agent establishes on the RTU or the first packet.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_notify(id: *mut RdmaCmId, _event: c_int) -> c_int {
    if id.is_null() {
        return err("rdma_notify", libc::EINVAL, "NULL id");
    }
    0
}

/// `rdma_disconnect`: QP to ERR, DREQ; DISCONNECTED follows. Disconnecting a connection the peer
/// already closed succeeds, as with the kernel.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_disconnect(id: *mut RdmaCmId) -> c_int {
    const WHAT: &str = "rdma_disconnect";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if !c.ibv.qp.is_null() && c.ibv.qp_type != IBV_QPT_UD {
        // SAFETY: all-zero is a valid attribute set; the ID's QP is live.
        let mut attr: IbvQpAttr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_ERR;
        // SAFETY: as above.
        unsafe { objects::ibv_modify_qp(c.ibv.qp, &mut attr, qp_mask::STATE) };
    }
    let connected = lock(&c.st).connected;
    match with_cm(c, |cm| cm.disconnect()) {
        Ok(()) => {}
        Err(Some(_)) if connected => {}
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "not connected"),
    }
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// `rdma_establish`: after CONNECT_RESPONSE on an ID without a QP, the RTU (the application has
/// moved its QP to RTS). As librdmacm: `EINVAL` on an ID with a QP (the agent established it).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_establish(id: *mut RdmaCmId) -> c_int {
    const WHAT: &str = "rdma_establish";
    // SAFETY: NULL-checked.
    if id.is_null() || !unsafe { (*id).qp }.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id, or the ID has a QP");
    }
    // SAFETY: a live ID of ours.
    match with_cm(unsafe { cma(id) }, |cm| cm.establish()) {
        Ok(()) => 0,
        Err(Some(e)) => cm_fail(WHAT, &e),
        Err(None) => err(WHAT, libc::EINVAL, "not connecting"),
    }
}

/// `rdma_init_qp_attr`: the attributes and mask for moving a QP to `qp_attr->qp_state` (INIT, RTR
/// or RTS), as the kernel's CM gives them (`softrdma_cm::CmAgent::init_qp_attr`).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_init_qp_attr(
    id: *mut RdmaCmId,
    qp_attr: *mut IbvQpAttr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    const WHAT: &str = "rdma_init_qp_attr";
    if id.is_null() || qp_attr.is_null() || qp_attr_mask.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: the caller's writable struct.
    let out = unsafe { &mut *qp_attr };
    let state = match out.qp_state {
        IBV_QPS_INIT => softrdma_verbs::CmQpState::Init,
        IBV_QPS_RTR => softrdma_verbs::CmQpState::Rtr,
        IBV_QPS_RTS => softrdma_verbs::CmQpState::Rts,
        _ => return err(WHAT, libc::EINVAL, "qp_state must be INIT, RTR or RTS"),
    };
    // SAFETY: a live ID of ours.
    let a = match with_cm(unsafe { cma(id) }, |cm| cm.init_qp_attr(state)) {
        Ok(a) => a,
        Err(Some(e)) => return cm_fail(WHAT, &e),
        Err(None) => return err(WHAT, libc::EINVAL, "the ID has no device yet (bind or resolve first)"),
    };
    let mut mask = qp_mask::STATE;
    let mut set = |bit: i32, on: bool| {
        if on {
            mask |= bit;
        }
    };
    set(qp_mask::PKEY_INDEX, a.pkey_index.is_some());
    set(qp_mask::PORT, a.port.is_some());
    set(qp_mask::ACCESS_FLAGS, a.access.is_some());
    set(qp_mask::QKEY, a.qkey.is_some());
    set(qp_mask::AV, a.av.is_some());
    set(qp_mask::PATH_MTU, a.path_mtu.is_some());
    set(qp_mask::DEST_QPN, a.dest_qpn.is_some());
    set(qp_mask::RQ_PSN, a.rq_psn.is_some());
    set(qp_mask::MAX_DEST_RD_ATOMIC, a.max_dest_rd_atomic.is_some());
    set(qp_mask::MIN_RNR_TIMER, a.min_rnr_timer.is_some());
    set(qp_mask::SQ_PSN, a.sq_psn.is_some());
    set(qp_mask::TIMEOUT, a.timeout.is_some());
    set(qp_mask::RETRY_CNT, a.retry_cnt.is_some());
    set(qp_mask::RNR_RETRY, a.rnr_retry.is_some());
    set(qp_mask::MAX_QP_RD_ATOMIC, a.max_rd_atomic.is_some());
    out.pkey_index = a.pkey_index.unwrap_or(out.pkey_index);
    out.port_num = a.port.unwrap_or(out.port_num);
    out.qp_access_flags = a.access.unwrap_or(out.qp_access_flags);
    out.qkey = a.qkey.unwrap_or(out.qkey);
    if let Some(r) = a.av {
        out.ah_attr = IbvAhAttr::roce(r.dgid, r.sgid_index, a.hop_limit, a.traffic_class, a.flow_label);
    }
    if let Some(m) = a.path_mtu {
        out.path_mtu = c_int::from(m as u8);
    }
    out.dest_qp_num = a.dest_qpn.map_or(out.dest_qp_num, |q| q.value());
    out.rq_psn = a.rq_psn.map_or(out.rq_psn, |p| p.value());
    out.max_dest_rd_atomic = a.max_dest_rd_atomic.unwrap_or(out.max_dest_rd_atomic);
    out.min_rnr_timer = a.min_rnr_timer.unwrap_or(out.min_rnr_timer);
    out.sq_psn = a.sq_psn.map_or(out.sq_psn, |p| p.value());
    out.timeout = a.timeout.unwrap_or(out.timeout);
    out.retry_cnt = a.retry_cnt.unwrap_or(out.retry_cnt);
    out.rnr_retry = a.rnr_retry.unwrap_or(out.rnr_retry);
    out.max_rd_atomic = a.max_rd_atomic.unwrap_or(out.max_rd_atomic);
    // SAFETY: the caller's writable int.
    unsafe { *qp_attr_mask = mask };
    0
}

/// Access of a connected QP: local write and every remote access, which the kernel's CM grants
/// once responder resources are negotiated (its `ib_cm_init_qp_attr`).
const REMOTE_ACCESS: u32 = 0x1 | 0x2 | 0x4 | 0x8;

/// librdmacm's `ucma_create_cqs`: a channel and a CQ (context: the ID) for each side lacking one.
unsafe fn create_cqs(c: &mut CmaId, send: u32, recv: u32) -> Result<(), c_int> {
    let id = c as *mut CmaId as *mut c_void;
    for (size, is_recv) in [(recv, true), (send, false)] {
        if size == 0 {
            continue;
        }
        // SAFETY: the ID's context is live.
        let ch = unsafe { objects::ibv_create_comp_channel(c.ibv.verbs) };
        if ch.is_null() {
            return Err(errno::get());
        }
        // SAFETY: as above.
        let cq = unsafe { objects::ibv_create_cq(c.ibv.verbs, size as c_int, id, ch, 0) };
        if cq.is_null() {
            let n = errno::get();
            // SAFETY: the channel just made, unused.
            unsafe { objects::ibv_destroy_comp_channel(ch) };
            return Err(n);
        }
        if is_recv {
            c.ibv.recv_cq_channel = ch;
            c.ibv.recv_cq = cq;
        } else {
            c.ibv.send_cq_channel = ch;
            c.ibv.send_cq = cq;
        }
    }
    Ok(())
}

unsafe fn destroy_cqs(c: &mut CmaId) {
    // SAFETY: CQs and channels made by create_cqs, no QP uses them any more.
    unsafe {
        for cq in [c.ibv.recv_cq, c.ibv.send_cq] {
            if !cq.is_null() {
                objects::ibv_destroy_cq(cq);
            }
        }
        for ch in [c.ibv.recv_cq_channel, c.ibv.send_cq_channel] {
            if !ch.is_null() {
                objects::ibv_destroy_comp_channel(ch);
            }
        }
    }
    c.ibv.recv_cq = ptr::null_mut();
    c.ibv.send_cq = ptr::null_mut();
    c.ibv.recv_cq_channel = ptr::null_mut();
    c.ibv.send_cq_channel = ptr::null_mut();
}

/// `rdma_create_qp_ex`: the QP on the ID's device and PD, moved to INIT (UD: to RTS), as
/// librdmacm does.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_qp_ex(id: *mut RdmaCmId, attr: *mut IbvQpInitAttrEx) -> c_int {
    const WHAT: &str = "rdma_create_qp";
    if id.is_null() || attr.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: a live ID of ours; the caller's attributes.
    let (c, a) = unsafe { (&mut *(id as *mut CmaId), &mut *attr) };
    if !c.ibv.qp.is_null() {
        return err(WHAT, libc::EINVAL, "the ID has a QP");
    }
    if c.ibv.verbs.is_null() {
        return err(WHAT, libc::EINVAL, "the ID has no device yet (bind or resolve first)");
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
        a.comp_mask |= IBV_QP_INIT_ATTR_PD;
        a.pd = c.ibv.pd;
    } else {
        // SAFETY: the caller's PD.
        if unsafe { (*a.pd).context } != c.ibv.verbs {
            return err(WHAT, libc::EINVAL, "the PD is on another device");
        }
    }
    if (!c.ibv.recv_cq.is_null() && !a.recv_cq.is_null() && c.ibv.recv_cq != a.recv_cq)
        || (!c.ibv.send_cq.is_null() && !a.send_cq.is_null() && c.ibv.send_cq != a.send_cq)
    {
        return err(WHAT, libc::EINVAL, "CQs differ from the ID's");
    }
    let send = if a.send_cq.is_null() && c.ibv.send_cq.is_null() { a.cap.max_send_wr } else { 0 };
    let recv = if a.recv_cq.is_null() && c.ibv.recv_cq.is_null() { a.cap.max_recv_wr } else { 0 };
    // SAFETY: as above.
    if let Err(n) = unsafe { create_cqs(c, send, recv) } {
        return err(WHAT, n, "cannot create the ID's CQs");
    }
    if send > 0 || recv > 0 {
        lock(&c.st).own_cqs = true;
    }
    if a.send_cq.is_null() {
        a.send_cq = c.ibv.send_cq;
    }
    if a.recv_cq.is_null() {
        a.recv_cq = c.ibv.recv_cq;
    }
    if !c.ibv.srq.is_null() && a.srq.is_null() {
        a.srq = c.ibv.srq;
    }
    // SAFETY: the ID's context and the completed attributes.
    let qp = unsafe { crate::ext::create_qp_ex(c.ibv.verbs, attr) };
    if qp.is_null() {
        let n = errno::get();
        // SAFETY: as above.
        unsafe { destroy_cqs(c) };
        errno::set(n);
        return -1;
    }
    // SAFETY: the QP just made.
    let r = unsafe { init_qp(c, qp) };
    if r != 0 {
        let n = errno::get();
        // SAFETY: as above.
        unsafe {
            objects::ibv_destroy_qp(qp);
            destroy_cqs(c);
        }
        errno::set(n);
        return -1;
    }
    // SAFETY: as above.
    c.ibv.pd = unsafe { (*qp).pd };
    c.ibv.qp = qp;
    0
}

/// INIT (RC, UC) or INIT, RTR, RTS with `RDMA_UDP_QKEY` (UD), as librdmacm's `ucma_init_*_qp`.
unsafe fn init_qp(c: &CmaId, qp: *mut IbvQp) -> c_int {
    // SAFETY: all-zero is a valid attribute set.
    let mut a: IbvQpAttr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = 1;
    // The agent takes this QP to RTR and RTS without another INIT (librdmacm repeats INIT with
    // the connection's access flags first): grant them now.
    let mask = if c.ibv.qp_type == IBV_QPT_UD {
        a.qkey = RDMA_UDP_QKEY;
        qp_mask::STATE | qp_mask::PKEY_INDEX | qp_mask::PORT | qp_mask::QKEY
    } else {
        a.qp_access_flags = REMOTE_ACCESS;
        qp_mask::STATE | qp_mask::PKEY_INDEX | qp_mask::PORT | qp_mask::ACCESS_FLAGS
    };
    // SAFETY: the QP is live.
    let r = unsafe { objects::ibv_modify_qp(qp, &mut a, mask) };
    if r != 0 {
        errno::set(r);
        return -1;
    }
    // SAFETY: the QP is live.
    if unsafe { (*qp).qp_type } != IBV_QPT_UD {
        return 0;
    }
    a.qp_state = IBV_QPS_RTR;
    // SAFETY: as above.
    let r = unsafe { objects::ibv_modify_qp(qp, &mut a, qp_mask::STATE) };
    if r != 0 {
        errno::set(r);
        return -1;
    }
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    // SAFETY: as above.
    let r = unsafe { objects::ibv_modify_qp(qp, &mut a, qp_mask::STATE | qp_mask::SQ_PSN) };
    if r != 0 {
        errno::set(r);
        return -1;
    }
    0
}

/// `rdma_create_qp`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_qp(
    id: *mut RdmaCmId,
    pd: *mut IbvPd,
    qp_init_attr: *mut IbvQpInitAttr,
) -> c_int {
    if id.is_null() || qp_init_attr.is_null() {
        return err("rdma_create_qp", libc::EINVAL, "NULL argument");
    }
    // SAFETY: all-zero is a valid extended attribute set; the caller's attributes are readable.
    let mut ex: IbvQpInitAttrEx = unsafe { std::mem::zeroed() };
    // SAFETY: the base struct is the prefix of the extended one (rdma-core's memcpy).
    unsafe {
        ptr::copy_nonoverlapping(
            qp_init_attr as *const u8,
            &mut ex as *mut IbvQpInitAttrEx as *mut u8,
            size_of::<IbvQpInitAttr>(),
        )
    };
    ex.comp_mask = IBV_QP_INIT_ATTR_PD;
    // SAFETY: a live ID.
    ex.pd = if pd.is_null() { unsafe { (*id).pd } } else { pd };
    // SAFETY: forwarded.
    let r = unsafe { softrdma_rdma_create_qp_ex(id, &mut ex) };
    // SAFETY: as above, back.
    unsafe {
        ptr::copy_nonoverlapping(
            &ex as *const IbvQpInitAttrEx as *const u8,
            qp_init_attr as *mut u8,
            size_of::<IbvQpInitAttr>(),
        )
    };
    r
}

/// `rdma_destroy_qp`: the QP, and the CQs `rdma_create_qp` made.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_destroy_qp(id: *mut RdmaCmId) {
    if id.is_null() {
        return;
    }
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *(id as *mut CmaId) };
    if !c.ibv.qp.is_null() {
        // The groups the ID joined let go of the QP (the kernel's would refuse to destroy it).
        for j in lock(&c.st).joined.iter_mut() {
            detach_joined(c, j);
        }
        // SAFETY: the ID's QP.
        unsafe { objects::ibv_destroy_qp(c.ibv.qp) };
        c.ibv.qp = ptr::null_mut();
    }
    let own = std::mem::take(&mut lock(&c.st).own_cqs);
    if own {
        // SAFETY: our CQs, now unused.
        unsafe { destroy_cqs(c) };
    }
}

/// `rdma_create_srq_ex` (basic SRQs).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_srq_ex(id: *mut RdmaCmId, attr: *mut IbvSrqInitAttrEx) -> c_int {
    const WHAT: &str = "rdma_create_srq";
    if id.is_null() || attr.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: caller's attributes; a live ID.
    let (c, a) = unsafe { (&mut *(id as *mut CmaId), &mut *attr) };
    if a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && a.srq_type != IBV_SRQT_BASIC {
        return err(WHAT, libc::EOPNOTSUPP, "only basic SRQs are supported");
    }
    let pd = if a.comp_mask & IBV_SRQ_INIT_ATTR_PD != 0 && !a.pd.is_null() { a.pd } else { c.ibv.pd };
    let mut init = IbvSrqInitAttr { srq_context: a.srq_context, attr: a.attr };
    // SAFETY: the PD and attributes are valid.
    let srq = unsafe { objects::ibv_create_srq(pd, &mut init) };
    if srq.is_null() {
        return -1;
    }
    a.attr = init.attr;
    c.ibv.srq = srq;
    c.ibv.pd = pd;
    0
}

/// `rdma_create_srq`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_srq(
    id: *mut RdmaCmId,
    pd: *mut IbvPd,
    attr: *mut IbvSrqInitAttr,
) -> c_int {
    if attr.is_null() {
        return err("rdma_create_srq", libc::EINVAL, "NULL attributes");
    }
    // SAFETY: caller's attributes.
    let a = unsafe { &mut *attr };
    let mut ex = IbvSrqInitAttrEx {
        srq_context: a.srq_context,
        attr: a.attr,
        comp_mask: IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
        srq_type: IBV_SRQT_BASIC,
        pd,
        xrcd: ptr::null_mut(),
        cq: ptr::null_mut(),
        tm_cap: [0; 2],
    };
    // SAFETY: forwarded.
    let r = unsafe { softrdma_rdma_create_srq_ex(id, &mut ex) };
    a.attr = ex.attr;
    r
}

/// `rdma_destroy_srq`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_destroy_srq(id: *mut RdmaCmId) {
    if id.is_null() {
        return;
    }
    // SAFETY: a live ID.
    let c = unsafe { &mut *id };
    if !c.srq.is_null() {
        // SAFETY: the ID's SRQ.
        unsafe { objects::ibv_destroy_srq(c.srq) };
        c.srq = ptr::null_mut();
    }
}

/// `rdma_get_cm_event`: waits unless the channel's fd is non-blocking (then `EAGAIN`).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_cm_event(
    channel: *mut RdmaEventChannel,
    event: *mut *mut RdmaCmEvent,
) -> c_int {
    if channel.is_null() || event.is_null() {
        return err("rdma_get_cm_event", libc::EINVAL, "NULL argument");
    }
    // SAFETY: a live channel of ours.
    match unsafe { next_event(channel as *mut Channel) } {
        Ok(e) => {
            // SAFETY: writable (checked non-NULL).
            unsafe { *event = e };
            0
        }
        Err(n) => {
            errno::set(n);
            -1
        }
    }
}

/// `rdma_ack_cm_event`: frees the event (its private data goes with it).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_ack_cm_event(event: *mut RdmaCmEvent) -> c_int {
    if event.is_null() {
        return err("rdma_ack_cm_event", libc::EINVAL, "NULL event");
    }
    // SAFETY: boxed by translate; the application gives it up.
    let e = unsafe { Box::from_raw(event as *mut CmaEvent) };
    let owner = e.owner;
    drop(e);
    // SAFETY: the owner is live until its count drops to zero with destroy.
    unsafe {
        (*owner).events.fetch_sub(1, Ordering::AcqRel);
        maybe_free(owner);
    }
    0
}

/// `rdma_event_str`.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_event_str(event: c_int) -> *const c_char {
    usize::try_from(event).ok().and_then(|i| EVENT_NAMES.get(i)).map_or(c"UNKNOWN EVENT".as_ptr(), |s| s.as_ptr())
}

fn port_of(a: &libc::sockaddr_storage) -> u16 {
    let p = a as *const libc::sockaddr_storage;
    // SAFETY: the family says which view is valid; both fit the storage.
    unsafe {
        match c_int::from(a.ss_family) {
            libc::AF_INET => (*(p as *const libc::sockaddr_in)).sin_port,
            libc::AF_INET6 => (*(p as *const libc::sockaddr_in6)).sin6_port,
            _ => 0,
        }
    }
}

/// `rdma_get_src_port` (network order).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_src_port(id: *mut RdmaCmId) -> u16 {
    // SAFETY: a live ID.
    unsafe { id.as_ref() }.map_or(0, |i| port_of(&i.route.addr.src))
}

/// `rdma_get_dst_port` (network order).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_dst_port(id: *mut RdmaCmId) -> u16 {
    // SAFETY: a live ID.
    unsafe { id.as_ref() }.map_or(0, |i| port_of(&i.route.addr.dst))
}

/// `rdma_get_devices`: a context on every registry device that opens, NULL-terminated.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_devices(num_devices: *mut c_int) -> *mut *mut IbvContext {
    let list: Vec<*mut IbvContext> =
        registry().into_iter().filter_map(|(n, _)| open_device(&n).ok().map(|d| d.ctx)).collect();
    // SAFETY: writable or NULL (caller's contract).
    unsafe { into_null_terminated(list, num_devices) }
}

/// `rdma_free_devices`: the list only (the contexts stay, as librdmacm's do).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_free_devices(list: *mut *mut IbvContext) {
    // SAFETY: from rdma_get_devices (or NULL).
    unsafe { free_null_terminated(list) }
}

/// `rdma_set_option`: the ToS, REUSEADDR, AFONLY, ACK timeout and IB path options are accepted
/// and have no effect here.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_set_option(
    id: *mut RdmaCmId,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    const WHAT: &str = "rdma_set_option";
    if id.is_null() || optval.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    let ok = match (level, optname) {
        (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS | RDMA_OPTION_ID_ACK_TIMEOUT) => optlen == 1,
        (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR | RDMA_OPTION_ID_AFONLY) => optlen == size_of::<c_int>(),
        (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => optlen > 0,
        _ => return err(WHAT, libc::ENOSYS, "unknown option"),
    };
    if !ok {
        return err(WHAT, libc::EINVAL, "wrong option length");
    }
    0
}

/// `rdma_migrate_id`: later events of the ID go to `channel` (NULL: make it synchronous).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_migrate_id(id: *mut RdmaCmId, channel: *mut RdmaEventChannel) -> c_int {
    const WHAT: &str = "rdma_migrate_id";
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    let was_sync = lock(&c.st).sync;
    if was_sync && channel.is_null() {
        return err(WHAT, libc::EINVAL, "the ID is synchronous already");
    }
    let new = if channel.is_null() {
        match Channel::new() {
            Ok(ch) => ch,
            Err(n) => return err(WHAT, n, "cannot make a channel"),
        }
    } else {
        channel as *mut Channel
    };
    let old = c.ibv.channel;
    // SAFETY: both channels are live.
    let (oldc, newc) = unsafe { (&*(old as *mut Channel), &*new) };
    let mut st = lock(&c.st);
    if let (Some(dev), Some(cm)) = (st.dev.clone(), st.cm.as_mut()) {
        oldc.unregister(&dev, cm.handle());
        let r = newc.with_sub(&dev, |s| {
            cm.migrate(&s.ch);
            s.ids.insert(cm.handle(), p as usize);
        });
        if let Err(n) = r {
            return err(WHAT, n, "cannot use the channel");
        }
    }
    st.sync = channel.is_null();
    drop(st);
    // Events made here and not yet reported follow the ID (the kernel's `ucma_move_events`).
    for e in oldc.take_local(p, None) {
        newc.push_local(e);
    }
    c.ibv.channel = new as *mut RdmaEventChannel;
    if was_sync {
        if !c.ibv.event.is_null() {
            // SAFETY: the event a synchronous call kept.
            unsafe { softrdma_rdma_ack_cm_event(c.ibv.event) };
            c.ibv.event = ptr::null_mut();
        }
        // SAFETY: the ID's old private channel.
        unsafe { softrdma_rdma_destroy_event_channel(old) };
    }
    0
}

/// `rdma_join_multicast`: join the group of multicast address `addr` as a full member.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_join_multicast(
    id: *mut RdmaCmId,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller's pointers, checked there.
    unsafe { join("rdma_join_multicast", id, addr, context, false) }
}

/// `rdma_join_multicast_ex`: a full member, or a send-only one (its QP is not attached).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_join_multicast_ex(
    id: *mut RdmaCmId,
    attr: *mut RdmaCmJoinMcAttrEx,
    context: *mut c_void,
) -> c_int {
    const WHAT: &str = "rdma_join_multicast_ex";
    if attr.is_null() {
        return err(WHAT, libc::EINVAL, "NULL attributes");
    }
    // SAFETY: readable (checked non-NULL).
    let a = unsafe { &*attr };
    let need = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS;
    if a.comp_mask & !need != 0 {
        return err(WHAT, libc::EOPNOTSUPP, "unknown comp_mask bits");
    }
    if a.comp_mask & need != need {
        return err(WHAT, libc::EINVAL, "comp_mask must name the address and the join flags");
    }
    let send_only = match a.join_flags {
        RDMA_MC_JOIN_FLAG_FULLMEMBER => false,
        RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER => true,
        _ => return err(WHAT, libc::EINVAL, "unknown join flags"),
    };
    // SAFETY: the caller's pointers, checked there.
    unsafe { join(WHAT, id, a.addr, context, send_only) }
}

/// Join on RoCE, as the kernel's rdma_cm and librdmacm do it: the group's MGID is its address
/// (`::ffff:a.b.c.d` for IPv4) and RDMA_CM_EVENT_MULTICAST_JOIN follows with the address handle
/// attributes of the group, QPN 0xFFFFFF, `RDMA_UDP_QKEY` and `context` as
/// `param.ud.private_data`. When the event is reported the ID's QP, if it has one then and the
/// member is not send-only, is attached to the group ([`process_join`]). The device joins the IP
/// group (IGMP/MLD) when a QP is attached. Joining a group twice is allowed, as there.
///
/// # Safety
///
/// `id` is a live ID of ours or NULL; `addr` a readable socket address or NULL.
unsafe fn join(
    what: &str,
    id: *mut RdmaCmId,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
    send_only: bool,
) -> c_int {
    let Some(a) = sockaddr_in(addr) else {
        return err(what, libc::EINVAL, "not an IPv4 or IPv6 address");
    };
    if id.is_null() || !a.ip().is_multicast() {
        return err(what, libc::EINVAL, "NULL id, or not a multicast address");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &mut *p };
    if c.ibv.qp_type != IBV_QPT_UD {
        return err(what, libc::EINVAL, "multicast needs a UD ID (RDMA_PS_UDP or RDMA_PS_IPOIB)");
    }
    let mgid = Gid::from_ip(a.ip()).0;
    let sgid_index = {
        let mut st = lock(&c.st);
        // The GID of the ID's own address (bound or resolved) is the source of the group's packets.
        let sgid_index = match (&st.dev, st.cm.as_ref().and_then(|cm| cm.addrs().0)) {
            (Some(dev), Some(local)) if !local.ip().is_unspecified() => {
                let want = Gid::from_ip(local.ip());
                let gids = &dev.verbs().info().gids;
                gids.iter().find(|(_, e)| e.gid == want).and_then(|(i, _)| u8::try_from(i).ok())
            }
            _ => None,
        };
        let Some(sgid_index) = sgid_index else {
            drop(st);
            return err(what, libc::EINVAL, "the ID has no address yet: bind or resolve one first");
        };
        st.joined.push(Joined { mgid, send_only, attached: false });
        sgid_index
    };
    // SAFETY: all-zero is a valid event (NULL pointers, zeros).
    let mut e: Box<CmaEvent> = Box::new(unsafe { std::mem::zeroed() });
    e.owner = p;
    e.ibv.id = id;
    e.ibv.event = RDMA_CM_EVENT_MULTICAST_JOIN;
    e.ibv.param.ud = RdmaUdParam {
        private_data: context,
        private_data_len: 0,
        ah_attr: IbvAhAttr::roce(mgid, sgid_index, 64, 0, 0),
        qp_num: Qpn::MULTICAST.value(),
        qkey: RDMA_UDP_QKEY,
    };
    c.events.fetch_add(1, Ordering::AcqRel);
    // SAFETY: the ID's channel is live.
    unsafe { channel_of(&c.ibv) }.push_local(Box::into_raw(e));
    // SAFETY: as above.
    unsafe { complete(p) }
}

/// A MULTICAST_JOIN being reported (librdmacm's `ucma_process_join`): attach the ID's QP, if it
/// has one and joined as a full member; a refused attach turns it into MULTICAST_ERROR, status -1.
///
/// # Safety
///
/// `e` is a queued event whose owner is live.
unsafe fn process_join(e: &mut CmaEvent) {
    // SAFETY: the caller's promise.
    let c = unsafe { &*e.owner };
    let mgid = e.ibv.param.ud.ah_attr.grh.dgid.raw;
    let mut st = lock(&c.st);
    let Some(j) = st.joined.iter_mut().find(|j| j.mgid == mgid && !j.attached) else { return };
    if j.send_only || c.ibv.qp.is_null() {
        return;
    }
    let gid = IbvGid { raw: mgid };
    // SAFETY: the ID's QP is live while set.
    if unsafe { crate::misc::mcast("rdma_join_multicast", c.ibv.qp, &gid, true) } == 0 {
        j.attached = true;
    } else {
        e.ibv.event = RDMA_CM_EVENT_MULTICAST_ERROR;
        e.ibv.status = -1;
    }
}

/// Detach the ID's QP from a group it was attached to when its join was reported.
fn detach_joined(c: &CmaId, j: &mut Joined) {
    if j.attached && !c.ibv.qp.is_null() {
        let gid = IbvGid { raw: j.mgid };
        // SAFETY: the ID's QP is live while set.
        unsafe { crate::misc::mcast("rdma_leave_multicast", c.ibv.qp, &gid, false) };
    }
    j.attached = false;
}

/// `rdma_leave_multicast`: EADDRNOTAVAIL for a group the ID did not join.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_leave_multicast(id: *mut RdmaCmId, addr: *mut libc::sockaddr) -> c_int {
    const WHAT: &str = "rdma_leave_multicast";
    let Some(a) = sockaddr_in(addr) else {
        return err(WHAT, libc::EINVAL, "not an IPv4 or IPv6 address");
    };
    if id.is_null() {
        return err(WHAT, libc::EINVAL, "NULL id");
    }
    let p = id as *mut CmaId;
    // SAFETY: a live ID of ours.
    let c = unsafe { &*p };
    let mgid = Gid::from_ip(a.ip()).0;
    let mut st = lock(&c.st);
    let Some(at) = st.joined.iter().position(|j| j.mgid == mgid) else {
        return err(WHAT, libc::EADDRNOTAVAIL, "not joined");
    };
    let mut j = st.joined.remove(at);
    detach_joined(c, &mut j);
    drop(st);
    // A join not yet reported is not reported any more (the kernel's `ucma_cleanup_mc_events`).
    // SAFETY: the ID's channel is live.
    unsafe { channel_of(&c.ibv) }.forget_local(p, Some(&mgid));
    0
}

/// `rdma_set_local_ece`: kept, never sent.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_set_local_ece(id: *mut RdmaCmId, ece: *mut IbvEce) -> c_int {
    // SAFETY: NULL-checked pointers of the caller.
    unsafe {
        if id.is_null() || !(*id).qp.is_null() || ece.is_null() || (*ece).vendor_id == 0 || (*ece).comp_mask != 0 {
            return err("rdma_set_local_ece", libc::EINVAL, "bad ECE or the ID has a QP");
        }
        lock(&cma(id).st).local_ece = Some(((*ece).vendor_id, (*ece).options));
    }
    0
}

/// `rdma_get_remote_ece`: the peer's ECE is never received here: zeros.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_get_remote_ece(id: *mut RdmaCmId, ece: *mut IbvEce) -> c_int {
    // SAFETY: NULL-checked pointers of the caller.
    unsafe {
        if id.is_null() || !(*id).qp.is_null() || ece.is_null() {
            return err("rdma_get_remote_ece", libc::EINVAL, "NULL argument or the ID has a QP");
        }
        (*ece).vendor_id = 0;
        (*ece).options = 0;
        (*ece).comp_mask = 0;
    }
    0
}

// ---- endpoints (rdma_create_ep) ----------------------------------------------------------------

/// `rdma_create_ep`: a synchronous ID bound (passive) or resolved with a QP (active).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_create_ep(
    id: *mut *mut RdmaCmId,
    res: *mut RdmaAddrinfo,
    pd: *mut IbvPd,
    qp_init_attr: *mut IbvQpInitAttr,
) -> c_int {
    const WHAT: &str = "rdma_create_ep";
    if id.is_null() || res.is_null() {
        return err(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: the caller's addrinfo.
    let r = unsafe { &*res };
    let mut cm_id: *mut RdmaCmId = ptr::null_mut();
    // SAFETY: forwarded.
    let ret = unsafe { create_id2(ptr::null_mut(), &mut cm_id, ptr::null_mut(), r.ai_port_space, r.ai_qp_type) };
    if ret != 0 {
        return ret;
    }
    // SAFETY: the new ID; forwarded calls.
    let ret = unsafe { ep_setup(cm_id, r, pd, qp_init_attr) };
    if ret != 0 {
        let n = errno::get();
        // SAFETY: as above.
        unsafe { softrdma_rdma_destroy_ep(cm_id) };
        errno::set(n);
        return ret;
    }
    // SAFETY: writable (checked).
    unsafe { *id = cm_id };
    0
}

unsafe fn ep_setup(cm_id: *mut RdmaCmId, r: &RdmaAddrinfo, pd: *mut IbvPd, qp_init_attr: *mut IbvQpInitAttr) -> c_int {
    // SAFETY: a new ID of ours.
    let c = unsafe { &mut *(cm_id as *mut CmaId) };
    if r.ai_flags & RAI_PASSIVE != 0 {
        // SAFETY: forwarded.
        let ret = unsafe { softrdma_rdma_bind_addr(cm_id, r.ai_src_addr) };
        if ret != 0 {
            return ret;
        }
        if !pd.is_null() {
            c.ibv.pd = pd;
        }
        if !qp_init_attr.is_null() {
            // SAFETY: the caller's attributes, copied.
            let mut a = unsafe { ptr::read(qp_init_attr) };
            a.qp_type = r.ai_qp_type;
            lock(&c.st).qp_init = Some(a);
        }
        return 0;
    }
    // SAFETY: forwarded.
    let ret = unsafe { softrdma_rdma_resolve_addr(cm_id, r.ai_src_addr, r.ai_dst_addr, 2000) };
    if ret != 0 {
        return ret;
    }
    // SAFETY: forwarded.
    let ret = unsafe { softrdma_rdma_resolve_route(cm_id, 2000) };
    if ret != 0 {
        return ret;
    }
    if !qp_init_attr.is_null() {
        // SAFETY: the caller's attributes.
        unsafe { (*qp_init_attr).qp_type = r.ai_qp_type };
        // SAFETY: forwarded.
        let ret = unsafe { softrdma_rdma_create_qp(cm_id, pd, qp_init_attr) };
        if ret != 0 {
            return ret;
        }
    }
    if r.ai_connect_len > 0 && !r.ai_connect.is_null() {
        // SAFETY: `ai_connect_len` readable bytes.
        let data = unsafe { std::slice::from_raw_parts(r.ai_connect as *const u8, r.ai_connect_len) };
        lock(&c.st).connect_data = data.to_vec();
    }
    0
}

/// `rdma_destroy_ep`: QP, SRQ and ID.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_destroy_ep(id: *mut RdmaCmId) {
    if id.is_null() {
        return;
    }
    // SAFETY: forwarded, live ID.
    unsafe {
        if !(*id).qp.is_null() {
            softrdma_rdma_destroy_qp(id);
        }
        if !(*id).srq.is_null() {
            softrdma_rdma_destroy_srq(id);
        }
        softrdma_rdma_destroy_id(id);
    }
}

include!(concat!(env!("OUT_DIR"), "/symver_cma.rs"));
