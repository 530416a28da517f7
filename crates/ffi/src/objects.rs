//! The verbs objects: each is a private `#[repr(C)]` struct whose first field is the public
//! `ibv_*` struct, so the pointer handed to the application is also a pointer to ours (rxe's
//! `to_rqp`). Creation boxes the struct and leaks it to the application; destruction takes it
//! back.
//!
//! Lifetimes follow the kernel's rules: a PD with objects, a CQ with QPs, an SRQ with QPs, a
//! completion channel with CQs cannot be destroyed (`EBUSY`). A memory region can be deregistered
//! while work requests name it: later accesses fail their key check (`LOC_PROT_ERR`), never touch
//! the memory.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::mem::offset_of;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use softrdma_device::Gid;
use softrdma_transport::{Access, AddressVector, AsyncEvent, ModifyQp, Mtu, QpCap, QpState, QpType, WorkCompletion};
use softrdma_verbs::{
    AddressHandle, AhAttr, CompletionChannel, CompletionQueue, MemoryRegion, ProtectionDomain, QpInitAttr, QueuePair,
    SharedReceiveQueue,
};
use softrdma_wire::{Psn, Qpn};

use crate::abi::*;
use crate::device::{soft, SoftContext};
use crate::errno;

/// Largest inline payload, rxe's (`RXE_MAX_INLINE_DATA`: a 512-byte WQE).
pub const MAX_INLINE: u32 = 512;

/// Objects the device reports by number (async events, channel events), by that number.
#[derive(Default)]
pub struct Handles {
    pub qps: HashMap<u32, usize>,
    pub cqs: HashMap<u32, usize>,
    pub srqs: HashMap<u32, usize>,
}

fn zeroed_sync() -> (libc::pthread_mutex_t, libc::pthread_cond_t) {
    // SAFETY: all-zero is PTHREAD_MUTEX_INITIALIZER / PTHREAD_COND_INITIALIZER on glibc.
    unsafe { (std::mem::zeroed(), std::mem::zeroed()) }
}

// ---- protection domains ------------------------------------------------------------------------

/// Our `struct ibv_pd`.
#[repr(C)]
pub struct Pd {
    pub ibv: IbvPd,
    pub pd: ProtectionDomain,
    /// MRs, QPs, SRQs and AHs created in it.
    pub users: AtomicU32,
}

/// # Safety
/// `pd` comes from our `ibv_alloc_pd` and is not deallocated.
pub unsafe fn to_pd<'a>(pd: *mut IbvPd) -> &'a Pd {
    // SAFETY: `ibv` is the first field of the boxed Pd (caller's contract).
    unsafe { &*(pd as *const Pd) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut IbvContext) -> *mut IbvPd {
    if context.is_null() {
        return errno::null("ibv_alloc_pd", libc::EINVAL, "NULL context");
    }
    // SAFETY: a live context of ours.
    let pd = unsafe { soft(context) }.verbs.alloc_pd();
    let handle = pd.id().0;
    Box::into_raw(Box::new(Pd { ibv: IbvPd { context, handle }, pd, users: AtomicU32::new(0) })) as *mut IbvPd
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live PD of ours.
    if unsafe { to_pd(pd) }.users.load(Ordering::Acquire) > 0 {
        return errno::refuse("ibv_dealloc_pd", libc::EBUSY, "the PD still has MRs, QPs, SRQs or AHs");
    }
    // SAFETY: boxed in ibv_alloc_pd; the application gives up the pointer.
    drop(unsafe { Box::from_raw(pd as *mut Pd) });
    0
}

// ---- memory regions ----------------------------------------------------------------------------

/// Our `struct ibv_mr`.
#[repr(C)]
pub struct Mr {
    pub ibv: IbvMr,
    pub mr: MemoryRegion,
    pub pd: *mut Pd,
}

const ACCESS_LOCAL: c_uint = 0xf;
const ACCESS_MW_BIND: c_uint = 1 << 4;
const ACCESS_ZERO_BASED: c_uint = 1 << 5;
const ACCESS_ON_DEMAND: c_uint = 1 << 6;
const ACCESS_HUGETLB: c_uint = 1 << 7;
const ACCESS_FLUSH: c_uint = (1 << 8) | (1 << 9);
/// `IBV_ACCESS_OPTIONAL_RANGE`: hints a provider may ignore (relaxed ordering...).
const ACCESS_OPTIONAL_RANGE: c_uint = 0x3ff0_0000;

unsafe fn reg_mr_common(pd: *mut IbvPd, addr: *mut c_void, length: usize, iova: u64, access: c_uint) -> *mut IbvMr {
    const WHAT: &str = "ibv_reg_mr";
    if pd.is_null() {
        return errno::null(WHAT, libc::EINVAL, "NULL PD");
    }
    let access = access & !ACCESS_OPTIONAL_RANGE;
    if access & (ACCESS_ON_DEMAND | ACCESS_ZERO_BASED | ACCESS_FLUSH) != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "on-demand paging, zero-based and flush access are not supported");
    }
    if access & !(ACCESS_LOCAL | ACCESS_MW_BIND | ACCESS_HUGETLB) != 0 {
        return errno::null(WHAT, libc::EINVAL, "unknown access flags");
    }
    if iova != addr as u64 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "an IOVA other than the address is not supported");
    }
    // SAFETY: a live PD of ours.
    let p = unsafe { to_pd(pd) };
    // SAFETY: ibv_reg_mr's contract: [addr, addr+length) is the caller's memory and stays mapped
    // until ibv_dereg_mr, which drops the region first.
    let mr = match unsafe { p.pd.reg_mr_raw(addr as *mut u8, length, Access::from_bits(access & ACCESS_LOCAL)) } {
        Ok(mr) => mr,
        Err(e) => {
            errno::fail(WHAT, &e);
            return ptr::null_mut();
        }
    };
    p.users.fetch_add(1, Ordering::AcqRel);
    let ibv = IbvMr { context: p.ibv.context, pd, addr, length, handle: mr.lkey(), lkey: mr.lkey(), rkey: mr.rkey() };
    Box::into_raw(Box::new(Mr { ibv, mr, pd: pd as *mut Pd })) as *mut IbvMr
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut IbvPd, addr: *mut c_void, length: usize, access: c_int) -> *mut IbvMr {
    // SAFETY: forwarded contract.
    unsafe { reg_mr_common(pd, addr, length, addr as u64, access as c_uint) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut IbvMr {
    // SAFETY: forwarded contract.
    unsafe { reg_mr_common(pd, addr, length, iova, access as c_uint) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut IbvMr {
    // SAFETY: forwarded contract.
    unsafe { reg_mr_common(pd, addr, length, iova, access) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: boxed in reg_mr_common; the application gives up the pointer.
    let mr = unsafe { Box::from_raw(mr as *mut Mr) };
    // SAFETY: the PD outlives its MRs (dealloc_pd refuses while users > 0).
    unsafe { (*mr.pd).users.fetch_sub(1, Ordering::AcqRel) };
    drop(mr);
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut IbvMr,
    flags: c_int,
    _pd: *mut IbvPd,
    _addr: *mut c_void,
    _length: usize,
    _access: c_int,
) -> c_int {
    if mr.is_null() || flags & !0x7 != 0 {
        // IBV_REREG_MR_ERR_INPUT
        errno::set(libc::EINVAL);
        return -1;
    }
    errno::refuse("ibv_rereg_mr", libc::EOPNOTSUPP, "re-registration is not supported; deregister and register again");
    libc::EOPNOTSUPP
}

pub unsafe extern "C" fn alloc_mw(_pd: *mut IbvPd, _type: c_int) -> *mut c_void {
    errno::null("ibv_alloc_mw", libc::EOPNOTSUPP, "memory windows are not supported (max_mw is 0)")
}

pub unsafe extern "C" fn bind_mw(_qp: *mut IbvQp, _mw: *mut c_void, _bind: *mut c_void) -> c_int {
    errno::refuse("ibv_bind_mw", libc::EOPNOTSUPP, "memory windows are not supported")
}

pub unsafe extern "C" fn dealloc_mw(_mw: *mut c_void) -> c_int {
    errno::refuse("ibv_dealloc_mw", libc::EOPNOTSUPP, "memory windows are not supported")
}

// ---- completion channels and queues -----------------------------------------------------------

/// Our `struct ibv_comp_channel`.
#[repr(C)]
pub struct Channel {
    pub ibv: IbvCompChannel,
    pub ch: CompletionChannel,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut IbvContext) -> *mut IbvCompChannel {
    if context.is_null() {
        return errno::null("ibv_create_comp_channel", libc::EINVAL, "NULL context");
    }
    // SAFETY: a live context of ours.
    match unsafe { soft(context) }.verbs.create_comp_channel() {
        Ok(ch) => {
            use std::os::fd::AsRawFd;
            make_blocking(ch.as_raw_fd());
            let ibv = IbvCompChannel { context, fd: ch.as_raw_fd(), refcnt: 0 };
            Box::into_raw(Box::new(Channel { ibv, ch })) as *mut IbvCompChannel
        }
        Err(e) => {
            errno::fail("ibv_create_comp_channel", &e);
            ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut IbvCompChannel) -> c_int {
    if channel.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live channel of ours; refcnt counts its CQs.
    if unsafe { (*channel).refcnt } > 0 {
        return errno::refuse("ibv_destroy_comp_channel", libc::EBUSY, "CQs still use the channel");
    }
    // SAFETY: boxed in ibv_create_comp_channel.
    drop(unsafe { Box::from_raw(channel as *mut Channel) });
    0
}

/// State of an extended poll (`ibv_start_poll` .. `ibv_end_poll`).
#[derive(Default)]
pub struct ExPoll {
    pub batch: std::collections::VecDeque<WorkCompletion>,
    pub cur: Option<WorkCompletion>,
}

/// Our `struct ibv_cq` (and `struct ibv_cq_ex`, of which `ibv_cq` is the start).
#[repr(C)]
pub struct Cq {
    pub ibv: IbvCqEx,
    pub cq: CompletionQueue,
    pub channel: *mut Channel,
    /// QPs using this CQ.
    pub users: AtomicU32,
    /// Reused completion buffer of `ibv_poll_cq`.
    pub buf: Mutex<Vec<WorkCompletion>>,
    pub ex: Mutex<ExPoll>,
    /// Serialises the event counters of the public struct.
    pub events: Mutex<()>,
}

/// # Safety
/// `cq` comes from our create calls and is not destroyed.
pub unsafe fn to_cq<'a>(cq: *mut IbvCq) -> &'a Cq {
    // SAFETY: the public struct is the first field of the boxed Cq.
    unsafe { &*(cq as *const Cq) }
}

/// Create a CQ; the extended fields are filled by the caller for `ibv_create_cq_ex`.
pub unsafe fn create_cq_common(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> Result<*mut Cq, c_int> {
    const WHAT: &str = "ibv_create_cq";
    if context.is_null() {
        return Err(errno::refuse(WHAT, libc::EINVAL, "NULL context"));
    }
    // SAFETY: a live context of ours.
    let ctx = unsafe { soft(context) };
    // SAFETY: the public context is valid.
    let nvec = unsafe { (*context).num_comp_vectors };
    if comp_vector < 0 || comp_vector >= nvec {
        return Err(errno::refuse(WHAT, libc::EINVAL, "comp_vector out of range"));
    }
    if cqe <= 0 {
        return Err(errno::refuse(WHAT, libc::EINVAL, "cqe must be positive"));
    }
    let ch = channel as *mut Channel;
    // SAFETY: `channel` is NULL or a live channel of ours.
    let verbs_ch = if ch.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { &(*ch).ch })
    };
    let cq = ctx.verbs.create_cq(cqe as u32, verbs_ch).map_err(|e| errno::fail(WHAT, &e))?;
    let (mutex, cond) = zeroed_sync();
    let base = IbvCq {
        context,
        channel,
        cq_context,
        handle: cq.handle(),
        cqe,
        mutex,
        cond,
        comp_events_completed: 0,
        async_events_completed: 0,
    };
    let ibv = IbvCqEx {
        cq: base,
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: None,
        next_poll: None,
        end_poll: None,
        read_opcode: None,
        read_vendor_err: None,
        read_byte_len: None,
        read_imm_data: None,
        read_qp_num: None,
        read_src_qp: None,
        read_wc_flags: None,
        read_slid: None,
        read_sl: None,
        read_dlid_path_bits: None,
        read_completion_ts: None,
        read_cvlan: None,
        read_flow_tag: None,
        read_tm_info: None,
        read_completion_wallclock_ns: None,
    };
    let handle = cq.handle();
    let p = Box::into_raw(Box::new(Cq {
        ibv,
        cq,
        channel: ch,
        users: AtomicU32::new(0),
        buf: Mutex::new(Vec::with_capacity(64)),
        ex: Mutex::new(ExPoll::default()),
        events: Mutex::new(()),
    }));
    let mut h = ctx.handles.lock().unwrap_or_else(|p| p.into_inner());
    if !ch.is_null() {
        // SAFETY: live channel; the count is only touched under the context's handle lock.
        unsafe { (*ch).ibv.refcnt += 1 };
    }
    h.cqs.insert(handle, p as usize);
    Ok(p)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    // SAFETY: forwarded contract.
    match unsafe { create_cq_common(context, cqe, cq_context, channel, comp_vector) } {
        Ok(p) => p as *mut IbvCq,
        Err(_) => ptr::null_mut(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut IbvCq, _cqe: c_int) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    errno::refuse("ibv_resize_cq", libc::EOPNOTSUPP, "CQ resizing is not supported")
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live CQ of ours.
    let c = unsafe { to_cq(cq) };
    if c.users.load(Ordering::Acquire) > 0 {
        return errno::refuse("ibv_destroy_cq", libc::EBUSY, "QPs still use the CQ");
    }
    // SAFETY: the CQ's context is live (contexts outlive their objects in correct programs).
    let ctx = unsafe { soft(c.ibv.cq.context) };
    {
        let mut h = ctx.handles.lock().unwrap_or_else(|p| p.into_inner());
        h.cqs.remove(&c.ibv.cq.handle);
        if !c.channel.is_null() {
            // SAFETY: the channel outlives its CQs (destroy_comp_channel refuses while refcnt > 0).
            unsafe { (*c.channel).ibv.refcnt -= 1 };
        }
    }
    // SAFETY: boxed in create_cq_common.
    drop(unsafe { Box::from_raw(cq as *mut Cq) });
    0
}

pub unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    // SAFETY: a live CQ of ours.
    match unsafe { to_cq(cq) }.cq.req_notify(solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => errno::fail("ibv_req_notify_cq", &e),
    }
}

/// Clear `O_NONBLOCK` on a notification descriptor handed to the application, so that the flag
/// says what the application wants: rdma-core's `ibv_get_cq_event` / `ibv_get_async_event` block
/// unless the application made the descriptor non-blocking, and then fail with EAGAIN. (The
/// Verbs API reads these descriptors only for a byte it knows is there, so blocking mode never
/// stalls it.)
pub fn make_blocking(fd: c_int) {
    // SAFETY: fcntl on a descriptor the device owns; no memory is passed.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
}

fn is_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL on a descriptor we own; no memory is passed.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if channel.is_null() || cq.is_null() || cq_context.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live channel of ours.
    let ch = unsafe { &*(channel as *const Channel) };
    // SAFETY: the channel's context is live.
    let ctx = unsafe { soft(ch.ibv.context) };
    let nonblock = is_nonblocking(ch.ibv.fd);
    loop {
        let timeout = if nonblock { Some(Duration::ZERO) } else { None };
        let Some(handle) = ch.ch.get_cq_event(timeout) else {
            errno::set(libc::EAGAIN);
            return -1;
        };
        let found = ctx.handles.lock().unwrap_or_else(|p| p.into_inner()).cqs.get(&handle).copied();
        if let Some(p) = found {
            let c = p as *mut Cq;
            // SAFETY: registered CQs are live; out-pointers are writable.
            unsafe {
                *cq = c as *mut IbvCq;
                *cq_context = (*c).ibv.cq.cq_context;
            }
            return 0;
        }
        // The CQ was destroyed after the event was queued: skip it.
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut IbvCq, nevents: c_uint) {
    if cq.is_null() {
        return;
    }
    // SAFETY: a live CQ of ours; the counter is only written under `events`.
    let c = unsafe { to_cq(cq) };
    let _g = c.events.lock();
    unsafe { (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents) };
}

// ---- shared receive queues ---------------------------------------------------------------------

/// Our `struct ibv_srq`.
#[repr(C)]
pub struct Srq {
    pub ibv: IbvSrq,
    pub srq: SharedReceiveQueue,
    pub pd: *mut Pd,
    pub users: AtomicU32,
    pub attr: Mutex<IbvSrqAttr>,
}

/// # Safety
/// `srq` comes from our `ibv_create_srq` and is not destroyed.
pub unsafe fn to_srq<'a>(srq: *mut IbvSrq) -> &'a Srq {
    // SAFETY: the public struct is the first field of the boxed Srq.
    unsafe { &*(srq as *const Srq) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(pd: *mut IbvPd, init: *mut IbvSrqInitAttr) -> *mut IbvSrq {
    const WHAT: &str = "ibv_create_srq";
    if pd.is_null() || init.is_null() {
        return errno::null(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: live PD; readable and writable init attributes (caller's contract).
    let (p, init) = unsafe { (to_pd(pd), &mut *init) };
    if init.attr.srq_limit > init.attr.max_wr {
        return errno::null(WHAT, libc::EINVAL, "srq_limit above max_wr");
    }
    let srq = match p.pd.create_srq(init.attr.max_wr, init.attr.max_sge.max(1)) {
        Ok(s) => s,
        Err(e) => {
            errno::fail(WHAT, &e);
            return ptr::null_mut();
        }
    };
    if init.attr.srq_limit > 0 {
        let _ = srq.arm(init.attr.srq_limit);
    }
    init.attr.max_sge = init.attr.max_sge.max(1);
    let (mutex, cond) = zeroed_sync();
    let handle = srq.handle();
    let ibv =
        IbvSrq { context: p.ibv.context, srq_context: init.srq_context, pd, handle, mutex, cond, events_completed: 0 };
    p.users.fetch_add(1, Ordering::AcqRel);
    let s = Box::into_raw(Box::new(Srq {
        ibv,
        srq,
        pd: pd as *mut Pd,
        users: AtomicU32::new(0),
        attr: Mutex::new(init.attr),
    }));
    // SAFETY: the context is live.
    unsafe { soft(p.ibv.context) }.handles.lock().unwrap_or_else(|p| p.into_inner()).srqs.insert(handle, s as usize);
    s as *mut IbvSrq
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr, mask: c_int) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live SRQ; readable attributes.
    let (s, a) = unsafe { (to_srq(srq), &*attr) };
    if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
        return errno::refuse("ibv_modify_srq", libc::EINVAL, "unknown attribute mask bits");
    }
    if mask & IBV_SRQ_MAX_WR != 0 {
        return errno::refuse("ibv_modify_srq", libc::EOPNOTSUPP, "SRQ resizing is not supported");
    }
    if mask & IBV_SRQ_LIMIT != 0 {
        let mut cur = s.attr.lock().unwrap_or_else(|p| p.into_inner());
        if a.srq_limit > cur.max_wr {
            return errno::refuse("ibv_modify_srq", libc::EINVAL, "srq_limit above max_wr");
        }
        if let Err(e) = s.srq.arm(a.srq_limit) {
            return errno::fail("ibv_modify_srq", &e);
        }
        cur.srq_limit = a.srq_limit;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live SRQ; writable attributes.
    unsafe { *attr = *to_srq(srq).attr.lock().unwrap_or_else(|p| p.into_inner()) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut IbvSrq) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live SRQ of ours.
    let s = unsafe { to_srq(srq) };
    if s.users.load(Ordering::Acquire) > 0 {
        return errno::refuse("ibv_destroy_srq", libc::EBUSY, "QPs still use the SRQ");
    }
    // SAFETY: the context and PD outlive the SRQ.
    unsafe {
        soft(s.ibv.context).handles.lock().unwrap_or_else(|p| p.into_inner()).srqs.remove(&s.ibv.handle);
        (*s.pd).users.fetch_sub(1, Ordering::AcqRel);
        drop(Box::from_raw(srq as *mut Srq));
    }
    0
}

// ---- queue pairs -------------------------------------------------------------------------------

/// A work request being built with the `ibv_wr_*` API.
#[derive(Default)]
pub struct WrBatch {
    pub wrs: Vec<softrdma_transport::SendWr>,
    /// The first builder error, reported by `ibv_wr_complete`.
    pub err: c_int,
}

/// Our `struct ibv_qp` (and `struct ibv_qp_ex`, of which `ibv_qp` is the start).
#[repr(C)]
pub struct Qp {
    pub ibv: IbvQpEx,
    pub qp: QueuePair,
    pub pd: *mut Pd,
    pub send_cq: *mut Cq,
    pub recv_cq: *mut Cq,
    pub srq: *mut Srq,
    pub cap: IbvQpCap,
    pub sq_sig_all: bool,
    /// Whether the QP was created with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` (has an `ibv_qp_ex`).
    pub is_ex: bool,
    pub batch: Mutex<WrBatch>,
    /// The multicast groups the QP is attached to (`ibv_destroy_qp` refuses while any).
    pub groups: Mutex<Vec<[u8; 16]>>,
}

/// # Safety
/// `qp` comes from our create calls and is not destroyed.
pub unsafe fn to_qp<'a>(qp: *mut IbvQp) -> &'a Qp {
    // SAFETY: the public struct is the first field of the boxed Qp.
    unsafe { &*(qp as *const Qp) }
}

/// What `ibv_create_qp` and `ibv_create_qp_ex` share.
pub struct QpRequest {
    pub pd: *mut IbvPd,
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub is_ex: bool,
}

/// Create a QP; on success `req.cap` holds the capacities granted.
pub unsafe fn create_qp_common(req: &mut QpRequest) -> Result<*mut Qp, c_int> {
    const WHAT: &str = "ibv_create_qp";
    if req.pd.is_null() || req.send_cq.is_null() || req.recv_cq.is_null() {
        return Err(errno::refuse(WHAT, libc::EINVAL, "PD and both CQs are required"));
    }
    let qp_type = match req.qp_type {
        IBV_QPT_RC => QpType::Rc,
        IBV_QPT_UC => QpType::Uc,
        IBV_QPT_UD => QpType::Ud,
        _ => return Err(errno::refuse(WHAT, libc::EOPNOTSUPP, "only RC, UC and UD QPs are supported")),
    };
    // SAFETY: live objects of ours (caller's contract).
    let (pd, scq, rcq) = unsafe { (to_pd(req.pd), to_cq(req.send_cq), to_cq(req.recv_cq)) };
    // SAFETY: NULL or a live SRQ.
    let srq = if req.srq.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { to_srq(req.srq) })
    };
    let max_sge = pd_max_sge(pd);
    let c = req.cap;
    if c.max_inline_data > MAX_INLINE || c.max_send_sge > max_sge || c.max_recv_sge > max_sge {
        return Err(errno::refuse(WHAT, libc::EINVAL, "capacities exceed the device's (max_sge 32, inline 512)"));
    }
    // rxe's rounding: the send WQE holds max(SGEs, inline data), and both report what fits.
    let wqe = (c.max_send_sge * 16).max(c.max_inline_data);
    let cap = IbvQpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: if srq.is_some() { 0 } else { c.max_recv_wr },
        max_send_sge: (wqe / 16).min(max_sge),
        max_recv_sge: if srq.is_some() { 0 } else { c.max_recv_sge.max(1) },
        max_inline_data: wqe.min(MAX_INLINE),
    };
    let attr = QpInitAttr {
        qp_type,
        send_cq: &scq.cq,
        recv_cq: &rcq.cq,
        srq: srq.map(|s| &s.srq),
        cap: QpCap {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: cap.max_recv_wr,
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            max_inline_data: cap.max_inline_data,
        },
        sq_sig_all: req.sq_sig_all != 0,
    };
    let qp = pd.pd.create_qp(&attr).map_err(|e| errno::fail(WHAT, &e))?;
    req.cap = cap;
    let qpn = qp.qpn().value();
    let (mutex, cond) = zeroed_sync();
    let base = IbvQp {
        context: pd.ibv.context,
        qp_context: req.qp_context,
        pd: req.pd,
        send_cq: req.send_cq,
        recv_cq: req.recv_cq,
        srq: req.srq,
        handle: qpn,
        qp_num: qpn,
        state: IBV_QPS_RESET,
        qp_type: req.qp_type,
        mutex,
        cond,
        events_completed: 0,
    };
    let ibv = crate::ext::qp_ex(base);
    for u in [&pd.users, &scq.users, &rcq.users] {
        u.fetch_add(1, Ordering::AcqRel);
    }
    if let Some(s) = srq {
        s.users.fetch_add(1, Ordering::AcqRel);
    }
    let p = Box::into_raw(Box::new(Qp {
        ibv,
        qp,
        pd: req.pd as *mut Pd,
        send_cq: req.send_cq as *mut Cq,
        recv_cq: req.recv_cq as *mut Cq,
        srq: req.srq as *mut Srq,
        cap,
        sq_sig_all: req.sq_sig_all != 0,
        is_ex: req.is_ex,
        batch: Mutex::new(WrBatch::default()),
        groups: Mutex::new(Vec::new()),
    }));
    // SAFETY: the context is live.
    unsafe { soft(pd.ibv.context) }.handles.lock().unwrap_or_else(|p| p.into_inner()).qps.insert(qpn, p as usize);
    Ok(p)
}

fn pd_max_sge(pd: &Pd) -> u32 {
    // SAFETY: the PD's context is live.
    unsafe { soft(pd.ibv.context) }.verbs.query_device().max_sge
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut IbvPd, init: *mut IbvQpInitAttr) -> *mut IbvQp {
    if pd.is_null() || init.is_null() {
        return errno::null("ibv_create_qp", libc::EINVAL, "NULL argument");
    }
    // SAFETY: readable and writable init attributes (caller's contract).
    let a = unsafe { &mut *init };
    let mut req = QpRequest {
        pd,
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
        is_ex: false,
    };
    // SAFETY: forwarded contract.
    match unsafe { create_qp_common(&mut req) } {
        Ok(p) => {
            a.cap = req.cap;
            p as *mut IbvQp
        }
        Err(_) => ptr::null_mut(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live QP of ours (the caller's promise).
    if !unsafe { to_qp(qp) }.groups.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
        return errno::refuse("ibv_destroy_qp", libc::EBUSY, "the QP is attached to a multicast group");
    }
    // SAFETY: boxed in create_qp_common; the objects it used outlive it (their destroy refuses
    // while it exists).
    unsafe {
        let q = Box::from_raw(qp as *mut Qp);
        soft(q.ibv.qp_base.context).handles.lock().unwrap_or_else(|p| p.into_inner()).qps.remove(&q.ibv.qp_base.qp_num);
        (*q.pd).users.fetch_sub(1, Ordering::AcqRel);
        (*q.send_cq).users.fetch_sub(1, Ordering::AcqRel);
        (*q.recv_cq).users.fetch_sub(1, Ordering::AcqRel);
        if !q.srq.is_null() {
            (*q.srq).users.fetch_sub(1, Ordering::AcqRel);
        }
        drop(q);
    }
    0
}

fn state_from(n: c_int) -> Option<QpState> {
    Some(match n {
        IBV_QPS_RESET => QpState::Reset,
        IBV_QPS_INIT => QpState::Init,
        IBV_QPS_RTR => QpState::Rtr,
        IBV_QPS_RTS => QpState::Rts,
        IBV_QPS_SQD => QpState::Sqd,
        IBV_QPS_SQE => QpState::Sqe,
        IBV_QPS_ERR => QpState::Err,
        _ => return None,
    })
}

fn state_to(s: QpState) -> c_int {
    match s {
        QpState::Reset => IBV_QPS_RESET,
        QpState::Init => IBV_QPS_INIT,
        QpState::Rtr => IBV_QPS_RTR,
        QpState::Rts => IBV_QPS_RTS,
        QpState::Sqd => IBV_QPS_SQD,
        QpState::Sqe => IBV_QPS_SQE,
        QpState::Err => IBV_QPS_ERR,
    }
}

/// An address vector from `ibv_ah_attr`; RoCE needs the GRH (`is_global`).
pub fn av_from(a: &IbvAhAttr) -> Result<AddressVector, &'static str> {
    if a.is_global == 0 {
        return Err("RoCE needs a GRH: is_global must be set (rc_pingpong: pass -g)");
    }
    if a.port_num > 1 {
        return Err("port_num must be 1");
    }
    Ok(AddressVector {
        dgid: a.grh.dgid.raw,
        sgid_index: a.grh.sgid_index,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
        flow_label: a.grh.flow_label & 0xf_ffff,
        dlid: a.dlid,
        sl: a.sl,
    })
}

fn ah_attr_from(av: &AddressVector) -> IbvAhAttr {
    IbvAhAttr {
        dlid: av.dlid,
        sl: av.sl,
        ..IbvAhAttr::roce(av.dgid, av.sgid_index, av.hop_limit, av.traffic_class, av.flow_label)
    }
}

fn modify_from(a: &IbvQpAttr, mask: c_int) -> Result<ModifyQp, (c_int, &'static str)> {
    use qp_mask as m;
    let known = m::STATE
        | m::CUR_STATE
        | m::EN_SQD_ASYNC_NOTIFY
        | m::ACCESS_FLAGS
        | m::PKEY_INDEX
        | m::PORT
        | m::QKEY
        | m::AV
        | m::PATH_MTU
        | m::TIMEOUT
        | m::RETRY_CNT
        | m::RNR_RETRY
        | m::RQ_PSN
        | m::MAX_QP_RD_ATOMIC
        | m::MIN_RNR_TIMER
        | m::SQ_PSN
        | m::MAX_DEST_RD_ATOMIC
        | m::DEST_QPN;
    if mask & (m::ALT_PATH | m::PATH_MIG_STATE | m::RATE_LIMIT) != 0 {
        return Err((libc::EOPNOTSUPP, "alternate paths, path migration and rate limits are not supported"));
    }
    if mask & !known != 0 {
        return Err((libc::EINVAL, "attribute mask bits not valid for ibv_modify_qp"));
    }
    let on = |b: c_int| mask & b != 0;
    let bad = |why| (libc::EINVAL, why);
    Ok(ModifyQp {
        state: if on(m::STATE) { Some(state_from(a.qp_state).ok_or(bad("qp_state"))?) } else { None },
        cur_state: if on(m::CUR_STATE) { Some(state_from(a.cur_qp_state).ok_or(bad("cur_qp_state"))?) } else { None },
        pkey_index: on(m::PKEY_INDEX).then_some(a.pkey_index),
        port: on(m::PORT).then_some(a.port_num),
        qkey: on(m::QKEY).then_some(a.qkey),
        access: on(m::ACCESS_FLAGS).then(|| Access::from_bits(a.qp_access_flags & 0xf)),
        av: if on(m::AV) { Some(av_from(&a.ah_attr).map_err(bad)?) } else { None },
        path_mtu: if on(m::PATH_MTU) {
            Some(u8::try_from(a.path_mtu).ok().and_then(Mtu::from_ib_enum).ok_or(bad("path_mtu"))?)
        } else {
            None
        },
        dest_qpn: on(m::DEST_QPN).then(|| Qpn::new(a.dest_qp_num & 0xff_ffff)),
        rq_psn: on(m::RQ_PSN).then(|| Psn::new(a.rq_psn & 0xff_ffff)),
        max_dest_rd_atomic: on(m::MAX_DEST_RD_ATOMIC).then_some(a.max_dest_rd_atomic),
        min_rnr_timer: on(m::MIN_RNR_TIMER).then_some(a.min_rnr_timer),
        sq_psn: on(m::SQ_PSN).then(|| Psn::new(a.sq_psn & 0xff_ffff)),
        timeout: on(m::TIMEOUT).then_some(a.timeout),
        retry_cnt: on(m::RETRY_CNT).then_some(a.retry_cnt),
        rnr_retry: on(m::RNR_RETRY).then_some(a.rnr_retry),
        max_rd_atomic: on(m::MAX_QP_RD_ATOMIC).then_some(a.max_rd_atomic),
        en_sqd_async_notify: on(m::EN_SQD_ASYNC_NOTIFY).then_some(a.en_sqd_async_notify != 0),
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, attr_mask: c_int) -> c_int {
    const WHAT: &str = "ibv_modify_qp";
    if qp.is_null() || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live QP of ours; readable attributes.
    let (q, a) = unsafe { (to_qp(qp), &*attr) };
    let m = match modify_from(a, attr_mask) {
        Ok(m) => m,
        Err((n, why)) => return errno::refuse(WHAT, n, why),
    };
    if let Err(e) = q.qp.modify(&m) {
        return errno::fail(WHAT, &e);
    }
    if let Some(s) = m.state {
        // SAFETY: the public struct is ours to update, as rdma-core does after a modify.
        unsafe { (*qp).state = state_to(s) };
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _attr_mask: c_int,
    init_attr: *mut IbvQpInitAttr,
) -> c_int {
    if qp.is_null() || attr.is_null() || init_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: live QP of ours.
    let q = unsafe { to_qp(qp) };
    let info = match q.qp.query() {
        Ok(i) => i,
        Err(e) => return errno::fail("ibv_query_qp", &e),
    };
    // SAFETY: IbvQpAttr is plain data; zero is valid.
    let mut a: IbvQpAttr = unsafe { std::mem::zeroed() };
    a.qp_state = state_to(info.state);
    a.cur_qp_state = a.qp_state;
    a.path_mtu = info.path_mtu as c_int;
    a.qkey = info.qkey;
    a.rq_psn = info.rq_psn.value();
    a.sq_psn = info.sq_psn.value();
    a.dest_qp_num = info.dest_qpn.value();
    a.qp_access_flags = info.access.bits();
    a.cap = q.cap;
    a.ah_attr = ah_attr_from(&info.av);
    a.max_rd_atomic = info.max_rd_atomic;
    a.max_dest_rd_atomic = info.max_dest_rd_atomic;
    a.min_rnr_timer = info.min_rnr_timer;
    a.port_num = 1;
    a.timeout = info.timeout;
    a.retry_cnt = info.retry_cnt;
    a.rnr_retry = info.rnr_retry;
    let b = &q.ibv.qp_base;
    let init = IbvQpInitAttr {
        qp_context: b.qp_context,
        send_cq: b.send_cq,
        recv_cq: b.recv_cq,
        srq: b.srq,
        cap: q.cap,
        qp_type: b.qp_type,
        sq_sig_all: c_int::from(q.sq_sig_all),
    };
    // SAFETY: writable out-structs (caller's contract).
    unsafe {
        *attr = a;
        *init_attr = init;
        (*qp).state = a.qp_state;
    }
    0
}

// ---- address handles ---------------------------------------------------------------------------

/// Our `struct ibv_ah`.
#[repr(C)]
pub struct Ah {
    pub ibv: IbvAh,
    pub ah: AddressHandle,
    pub pd: *mut Pd,
}

static AH_HANDLE: AtomicU32 = AtomicU32::new(1);

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut IbvPd, attr: *mut IbvAhAttr) -> *mut IbvAh {
    const WHAT: &str = "ibv_create_ah";
    if pd.is_null() || attr.is_null() {
        return errno::null(WHAT, libc::EINVAL, "NULL argument");
    }
    // SAFETY: live PD; readable attributes.
    let (p, a) = unsafe { (to_pd(pd), &*attr) };
    let av = match av_from(a) {
        Ok(av) => av,
        Err(why) => return errno::null(WHAT, libc::EINVAL, why),
    };
    let attr = AhAttr {
        dgid: Gid(av.dgid),
        sgid_index: av.sgid_index,
        hop_limit: av.hop_limit,
        traffic_class: av.traffic_class,
        flow_label: av.flow_label,
        port: 1,
    };
    let ah = match p.pd.create_ah(&attr) {
        Ok(ah) => ah,
        Err(e) => {
            errno::fail(WHAT, &e);
            return ptr::null_mut();
        }
    };
    p.users.fetch_add(1, Ordering::AcqRel);
    let ibv = IbvAh { context: p.ibv.context, pd, handle: AH_HANDLE.fetch_add(1, Ordering::Relaxed) };
    Box::into_raw(Box::new(Ah { ibv, ah, pd: pd as *mut Pd })) as *mut IbvAh
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut IbvAh) -> c_int {
    if ah.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: boxed in ibv_create_ah; its PD outlives it.
    unsafe {
        let a = Box::from_raw(ah as *mut Ah);
        (*a.pd).users.fetch_sub(1, Ordering::AcqRel);
    }
    0
}

/// # Safety
/// `ah` comes from our `ibv_create_ah` and is not destroyed.
pub unsafe fn to_ah<'a>(ah: *mut IbvAh) -> &'a Ah {
    // SAFETY: the public struct is the first field of the boxed Ah.
    unsafe { &*(ah as *const Ah) }
}

// ---- asynchronous events -----------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(context: *mut IbvContext, event: *mut IbvAsyncEvent) -> c_int {
    if context.is_null() || event.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live context of ours.
    let ctx: &SoftContext = unsafe { soft(context) };
    // SAFETY: the public context is valid.
    let nonblock = is_nonblocking(unsafe { (*context).async_fd });
    loop {
        let wait = if nonblock { Duration::ZERO } else { Duration::from_secs(3600) };
        let Some(ev) = ctx.verbs.get_async_event(wait) else {
            if nonblock {
                errno::set(libc::EAGAIN);
                return -1;
            }
            continue;
        };
        let h = ctx.handles.lock().unwrap_or_else(|p| p.into_inner());
        let qp = |n: Qpn| h.qps.get(&n.value()).map(|p| *p as *mut IbvQp);
        let (elem, ty) = match ev {
            AsyncEvent::CommEstablished(n) => (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_COMM_EST),
            AsyncEvent::SqDrained(n) => (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_SQ_DRAINED),
            AsyncEvent::QpLastWqeReached(n) => {
                (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_QP_LAST_WQE_REACHED)
            }
            AsyncEvent::QpRequestError(n) => (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_QP_REQ_ERR),
            AsyncEvent::QpAccessError(n) => (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_QP_ACCESS_ERR),
            AsyncEvent::QpFatal(n) => (qp(n).map(|q| IbvAsyncElement { qp: q }), IBV_EVENT_QP_FATAL),
            AsyncEvent::SrqLimitReached(s) => {
                (h.srqs.get(&s.0).map(|p| IbvAsyncElement { srq: *p as *mut IbvSrq }), IBV_EVENT_SRQ_LIMIT_REACHED)
            }
            AsyncEvent::CqError(c) => {
                (h.cqs.get(&c.0).map(|p| IbvAsyncElement { cq: *p as *mut IbvCq }), IBV_EVENT_CQ_ERR)
            }
            _ => (None, 0),
        };
        // An event for an object already destroyed is dropped, as the kernel does.
        if let Some(element) = elem {
            // SAFETY: writable event (caller's contract).
            unsafe { ptr::write(event, IbvAsyncEvent { element, event_type: ty }) };
            return 0;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut IbvAsyncEvent) {
    if event.is_null() {
        return;
    }
    // SAFETY: an event from ibv_get_async_event whose object is still live (rdma-core requires
    // acking before destroying). The counters are informational.
    unsafe {
        let e = &*event;
        match e.event_type {
            IBV_EVENT_CQ_ERR => {
                let cq = e.element.cq;
                let _g = to_cq(cq).events.lock();
                (*cq).async_events_completed = (*cq).async_events_completed.wrapping_add(1);
            }
            IBV_EVENT_SRQ_LIMIT_REACHED => {
                let srq = e.element.srq;
                (*srq).events_completed = (*srq).events_completed.wrapping_add(1);
            }
            IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_QP_LAST_WQE_REACHED => {
                let qp = e.element.qp;
                (*qp).events_completed = (*qp).events_completed.wrapping_add(1);
            }
            _ => {}
        }
    }
}

/// Offset check used by `ext`: the QP's public struct starts our struct.
const _: () = assert!(offset_of!(Qp, ibv) == 0 && offset_of!(Cq, ibv) == 0 && offset_of!(Pd, ibv) == 0);

include!(concat!(env!("OUT_DIR"), "/symver_objects.rs"));
