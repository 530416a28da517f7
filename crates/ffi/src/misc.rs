//! The rest of the exported API: strings and rate tables, the sysfs helpers, fork support, address
//! handles from completions, kernel-struct conversions, UD multicast attach/detach, and the
//! features a soft device refuses (object import, ECE, dma-buf MRs).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use crate::abi::*;
use crate::device::{our_path_device, soft};
use crate::errno;
use crate::objects::{ibv_create_ah, to_pd};

// ---- strings -----------------------------------------------------------------------------------

const fn cstr(s: &'static CStr) -> *const c_char {
    s.as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    cstr(match node_type {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    })
}

#[no_mangle]
pub extern "C" fn ibv_port_state_str(port_state: c_int) -> *const c_char {
    cstr(match port_state {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active defer",
        _ => c"unknown",
    })
}

#[no_mangle]
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    const S: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    cstr(usize::try_from(event).ok().and_then(|i| S.get(i).copied()).unwrap_or(c"unknown"))
}

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    const S: [&CStr; 24] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
        c"TM software rendezvous",
    ];
    cstr(usize::try_from(status).ok().and_then(|i| S.get(i).copied()).unwrap_or(c"unknown"))
}

// ---- rates -------------------------------------------------------------------------------------

/// `enum ibv_rate` → (multiple of 2.5 Gb/s, Mb/s).
const RATES: [(c_int, c_int, c_int); 21] = [
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
    (10, 48, 120000),
    (11, -1, 14062),
    (12, -1, 56250),
    (13, -1, 112500),
    (14, -1, 168750),
    (15, -1, 25781),
    (16, -1, 103125),
    (17, -1, 206250),
    (18, -1, 309375),
    (19, -1, 28125),
    (20, -1, 53125),
    (21, -1, 425000),
    (22, -1, 637500),
];

#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES.iter().find(|r| r.1 == mult && mult > 0).map_or(0, |r| r.0)
}

#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

// ---- sysfs -------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    cstr(c"/sys")
}

/// `ibv_read_sysfs_file`: read `dir/file` (trailing newline removed), or -1. Our devices have no
/// sysfs directory: their paths answer ENOENT here (rxe has no `board_id` either), so a kernel
/// device of the same name can never leak into what tools print about ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: NUL-terminated strings (caller's contract).
    let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    if our_path_device(d).is_some() {
        errno::set(libc::ENOENT);
        return -1;
    }
    let path = format!("{}/{}", d.to_string_lossy(), f.to_string_lossy());
    match std::fs::read(&path) {
        Ok(mut bytes) => {
            let n = bytes.len().min(size - 1);
            bytes.truncate(n);
            if bytes.last() == Some(&b'\n') {
                bytes.pop();
            }
            // SAFETY: `buf` has `size` writable bytes; we write at most size-1 plus the NUL.
            unsafe {
                ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, bytes.len());
                *buf.add(bytes.len()) = 0;
            }
            bytes.len() as c_int
        }
        Err(e) => {
            errno::set(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

// ---- fork ----------------------------------------------------------------------------------------

/// Memory registration pins nothing a child could corrupt: the device runs in this process and
/// reaches registered memory by virtual address, so copy-on-write after fork() leaves the parent's
/// regions intact. rdma-core reports this case as `IBV_FORK_UNNEEDED`.
const IBV_FORK_UNNEEDED: c_int = 2;

#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    IBV_FORK_UNNEEDED
}

#[no_mangle]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

// ---- address handles from completions -----------------------------------------------------------

/// `ibv_init_ah_from_wc`: the AH attributes that reach the sender of a UD receive. On RoCE v2 the
/// 40-byte GRH area holds the IPv4 header in its last 20 bytes, or the IPv6 header.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut IbvContext,
    port_num: u8,
    wc: *mut IbvWc,
    grh: *mut IbvGrh,
    ah_attr: *mut IbvAhAttr,
) -> c_int {
    const WHAT: &str = "ibv_init_ah_from_wc";
    if context.is_null() || wc.is_null() || ah_attr.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: readable completion (caller's contract).
    let wc = unsafe { &*wc };
    if wc.wc_flags & IBV_WC_GRH == 0 || grh.is_null() {
        errno::refuse(WHAT, libc::EINVAL, "RoCE needs the GRH of the completion");
        return -1;
    }
    // SAFETY: `grh` points at the 40 bytes in front of the received data.
    let raw = unsafe { std::slice::from_raw_parts(grh as *const u8, 40) };
    let ipv4 = raw[20] >> 4 == 4 && raw[0] >> 4 != 6;
    let (sgid, dgid, hop, tclass, flow) = if ipv4 {
        let map = |a: &[u8]| {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(a);
            g
        };
        (map(&raw[32..36]), map(&raw[36..40]), raw[28], raw[21] & 0xfc, 0)
    } else {
        let vtf = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let mut s = [0u8; 16];
        let mut d = [0u8; 16];
        s.copy_from_slice(&raw[8..24]);
        d.copy_from_slice(&raw[24..40]);
        (s, d, raw[7], ((vtf >> 20) & 0xff) as u8, vtf & 0xf_ffff)
    };
    // SAFETY: a live context of ours.
    let ctx = unsafe { soft(context) };
    let Some(sgid_index) = ctx.verbs.info().gids.iter().find(|(_, e)| e.gid.0 == dgid).map(|(i, _)| i) else {
        errno::refuse(WHAT, libc::ENOENT, "the packet's destination address is not in the GID table");
        return -1;
    };
    let a = IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: IbvGid { raw: sgid },
            flow_label: flow,
            sgid_index: sgid_index as u8,
            hop_limit: if hop == 0 { 0xff } else { hop },
            traffic_class: tclass,
        },
        dlid: wc.slid,
        sl: wc.sl,
        src_path_bits: wc.dlid_path_bits,
        static_rate: 0,
        is_global: 1,
        port_num,
    };
    // SAFETY: writable out-struct.
    unsafe { ptr::write(ah_attr, a) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut IbvPd,
    wc: *mut IbvWc,
    grh: *mut IbvGrh,
    port_num: u8,
) -> *mut IbvAh {
    if pd.is_null() {
        return errno::null("ibv_create_ah_from_wc", libc::EINVAL, "NULL PD");
    }
    // SAFETY: zeroed plain data.
    let mut attr: IbvAhAttr = unsafe { std::mem::zeroed() };
    // SAFETY: live PD; forwarded contract.
    unsafe {
        if ibv_init_ah_from_wc(to_pd(pd).ibv.context, port_num, wc, grh, &mut attr) != 0 {
            return ptr::null_mut();
        }
        ibv_create_ah(pd, &mut attr)
    }
}

/// `ibv_resolve_eth_l2_from_gid`: softrdma sends over UDP sockets and never resolves link-layer
/// addresses, so there is no MAC to report.
#[no_mangle]
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    _context: *mut IbvContext,
    _attr: *mut IbvAhAttr,
    _eth_mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    errno::refuse("ibv_resolve_eth_l2_from_gid", libc::EOPNOTSUPP, "softrdma does not resolve L2 addresses");
    -1
}

// ---- multicast -------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(qp: *mut IbvQp, gid: *const IbvGid, _lid: u16) -> c_int {
    mcast("ibv_attach_mcast", qp, gid, true)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(qp: *mut IbvQp, gid: *const IbvGid, _lid: u16) -> c_int {
    mcast("ibv_detach_mcast", qp, gid, false)
}

/// Attach or detach a UD QP to or from a multicast group (the LID means nothing on RoCE).
///
/// # Safety
///
/// `qp` must be a live QP of ours and `gid` readable, or null.
pub(crate) unsafe fn mcast(what: &str, qp: *mut IbvQp, gid: *const IbvGid, attach: bool) -> c_int {
    if qp.is_null() || gid.is_null() {
        return errno::refuse(what, libc::EINVAL, "null QP or GID");
    }
    // SAFETY: the caller's promise.
    let (q, mgid) = unsafe { (crate::objects::to_qp(qp), softrdma_verbs::Gid((*gid).raw)) };
    // Held across the call, so the record and the device agree.
    let mut groups = q.groups.lock().unwrap_or_else(|p| p.into_inner());
    let r = if attach { q.qp.attach_mcast(mgid) } else { q.qp.detach_mcast(mgid) };
    match r {
        Ok(()) => {
            groups.retain(|g| *g != mgid.0);
            if attach {
                groups.push(mgid.0);
            }
            0
        }
        Err(e) => errno::fail(what, &e),
    }
}

// ---- refused features ----------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn ibv_import_device(_cmd_fd: c_int) -> *mut IbvContext {
    errno::null("ibv_import_device", libc::EOPNOTSUPP, "softrdma contexts are not backed by a uverbs fd")
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(_context: *mut IbvContext, _handle: u32) -> *mut IbvPd {
    errno::null("ibv_import_pd", libc::EOPNOTSUPP, "objects cannot be shared between contexts")
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(_pd: *mut IbvPd, _handle: u32) -> *mut IbvMr {
    errno::null("ibv_import_mr", libc::EOPNOTSUPP, "objects cannot be shared between contexts")
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_dm(_context: *mut IbvContext, _handle: u32) -> *mut c_void {
    errno::null("ibv_import_dm", libc::EOPNOTSUPP, "device memory is not supported")
}

/// Nothing can have been imported, so there is nothing to release.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(_pd: *mut IbvPd) {}

/// Nothing can have been imported, so there is nothing to release.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(_mr: *mut IbvMr) {}

/// Nothing can have been imported, so there is nothing to release.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_dm(_dm: *mut c_void) {}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    _pd: *mut IbvPd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut IbvMr {
    errno::null("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP, "dma-buf memory cannot be reached by a soft device")
}

#[no_mangle]
pub unsafe extern "C" fn ibv_set_ece(_qp: *mut IbvQp, _ece: *mut IbvEce) -> c_int {
    errno::refuse("ibv_set_ece", libc::EOPNOTSUPP, "enhanced connection establishment is not supported");
    libc::EOPNOTSUPP
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_ece(_qp: *mut IbvQp, _ece: *mut IbvEce) -> c_int {
    errno::refuse("ibv_query_ece", libc::EOPNOTSUPP, "enhanced connection establishment is not supported");
    libc::EOPNOTSUPP
}

/// Whether RDMA data lands in order: rdma-core's answer without a provider op is 0 (not
/// guaranteed), and applications must not rely on more from a soft device.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(_qp: *mut IbvQp, _op: c_int, flags: u32) -> c_int {
    if flags != 0 {
        return 0;
    }
    0
}

// ---- kernel struct conversions (used by librdmacm with the kernel's rdma_cm) -----------------------

#[repr(C)]
pub struct UverbsGlobalRoute {
    dgid: [u8; 16],
    flow_label: u32,
    sgid_index: u8,
    hop_limit: u8,
    traffic_class: u8,
    reserved: u8,
}

#[repr(C)]
pub struct UverbsAhAttr {
    grh: UverbsGlobalRoute,
    dlid: u16,
    sl: u8,
    src_path_bits: u8,
    static_rate: u8,
    is_global: u8,
    port_num: u8,
    reserved: u8,
}

#[repr(C)]
pub struct UverbsQpAttr {
    qp_attr_mask: u32,
    qp_state: u32,
    cur_qp_state: u32,
    path_mtu: u32,
    path_mig_state: u32,
    qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    dest_qp_num: u32,
    qp_access_flags: u32,
    ah_attr: UverbsAhAttr,
    alt_ah_attr: UverbsAhAttr,
    cap: [u32; 5],
    pkey_index: u16,
    alt_pkey_index: u16,
    bytes: [u8; 11],
    reserved: [u8; 5],
}

#[repr(C)]
pub struct UserPathRec {
    dgid: [u8; 16],
    sgid: [u8; 16],
    dlid: u16,
    slid: u16,
    raw_traffic: u32,
    flow_label: u32,
    reversible: u32,
    mtu: u32,
    pkey: u16,
    hop_limit: u8,
    traffic_class: u8,
    numb_path: u8,
    sl: u8,
    mtu_selector: u8,
    rate_selector: u8,
    rate: u8,
    packet_life_time_selector: u8,
    packet_life_time: u8,
    preference: u8,
}

#[repr(C)]
pub struct SaPathRec {
    dgid: [u8; 16],
    sgid: [u8; 16],
    dlid: u16,
    slid: u16,
    raw_traffic: c_int,
    flow_label: u32,
    hop_limit: u8,
    traffic_class: u8,
    reversible: c_int,
    numb_path: u8,
    pkey: u16,
    sl: u8,
    mtu_selector: u8,
    mtu: u8,
    rate_selector: u8,
    rate: u8,
    packet_life_time_selector: u8,
    packet_life_time: u8,
    preference: u8,
}

const _: () = assert!(std::mem::size_of::<UverbsQpAttr>() == 144);
const _: () = assert!(std::mem::size_of::<UserPathRec>() == 64);
const _: () = assert!(std::mem::size_of::<SaPathRec>() == 64);

fn ah_from_kern(s: &UverbsAhAttr) -> IbvAhAttr {
    IbvAhAttr {
        grh: IbvGlobalRoute {
            dgid: IbvGid { raw: s.grh.dgid },
            flow_label: s.grh.flow_label,
            sgid_index: s.grh.sgid_index,
            hop_limit: s.grh.hop_limit,
            traffic_class: s.grh.traffic_class,
        },
        dlid: s.dlid,
        sl: s.sl,
        src_path_bits: s.src_path_bits,
        static_rate: s.static_rate,
        is_global: s.is_global,
        port_num: s.port_num,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_copy_ah_attr_from_kern(dst: *mut IbvAhAttr, src: *const UverbsAhAttr) {
    // SAFETY: valid pointers (caller's contract).
    unsafe { *dst = ah_from_kern(&*src) };
}

#[no_mangle]
pub unsafe extern "C" fn ibv_copy_qp_attr_from_kern(dst: *mut IbvQpAttr, src: *const UverbsQpAttr) {
    // SAFETY: valid pointers (caller's contract).
    let (d, s) = unsafe { (&mut *dst, &*src) };
    d.qp_state = s.qp_state as c_int;
    d.cur_qp_state = s.cur_qp_state as c_int;
    d.path_mtu = s.path_mtu as c_int;
    d.path_mig_state = s.path_mig_state as c_int;
    d.qkey = s.qkey;
    d.rq_psn = s.rq_psn;
    d.sq_psn = s.sq_psn;
    d.dest_qp_num = s.dest_qp_num;
    d.qp_access_flags = s.qp_access_flags;
    d.cap = IbvQpCap {
        max_send_wr: s.cap[0],
        max_recv_wr: s.cap[1],
        max_send_sge: s.cap[2],
        max_recv_sge: s.cap[3],
        max_inline_data: s.cap[4],
    };
    d.ah_attr = ah_from_kern(&s.ah_attr);
    d.alt_ah_attr = ah_from_kern(&s.alt_ah_attr);
    d.pkey_index = s.pkey_index;
    d.alt_pkey_index = s.alt_pkey_index;
    let b = &s.bytes;
    d.en_sqd_async_notify = b[0];
    d.sq_draining = b[1];
    d.max_rd_atomic = b[2];
    d.max_dest_rd_atomic = b[3];
    d.min_rnr_timer = b[4];
    d.port_num = b[5];
    d.timeout = b[6];
    d.retry_cnt = b[7];
    d.rnr_retry = b[8];
    d.alt_port_num = b[9];
    d.alt_timeout = b[10];
}

#[no_mangle]
pub unsafe extern "C" fn ibv_copy_path_rec_from_kern(dst: *mut SaPathRec, src: *const UserPathRec) {
    // SAFETY: valid pointers (caller's contract).
    let (d, s) = unsafe { (&mut *dst, &*src) };
    *d = SaPathRec {
        dgid: s.dgid,
        sgid: s.sgid,
        dlid: s.dlid,
        slid: s.slid,
        raw_traffic: s.raw_traffic as c_int,
        flow_label: s.flow_label,
        hop_limit: s.hop_limit,
        traffic_class: s.traffic_class,
        reversible: s.reversible as c_int,
        numb_path: s.numb_path,
        pkey: s.pkey,
        sl: s.sl,
        mtu_selector: s.mtu_selector,
        mtu: s.mtu as u8,
        rate_selector: s.rate_selector,
        rate: s.rate,
        packet_life_time_selector: s.packet_life_time_selector,
        packet_life_time: s.packet_life_time,
        preference: s.preference,
    };
}

#[no_mangle]
pub unsafe extern "C" fn ibv_copy_path_rec_to_kern(dst: *mut UserPathRec, src: *const SaPathRec) {
    // SAFETY: valid pointers (caller's contract).
    let (d, s) = unsafe { (&mut *dst, &*src) };
    *d = UserPathRec {
        dgid: s.dgid,
        sgid: s.sgid,
        dlid: s.dlid,
        slid: s.slid,
        raw_traffic: s.raw_traffic as u32,
        flow_label: s.flow_label,
        reversible: s.reversible as u32,
        mtu: u32::from(s.mtu),
        pkey: s.pkey,
        hop_limit: s.hop_limit,
        traffic_class: s.traffic_class,
        numb_path: s.numb_path,
        sl: s.sl,
        mtu_selector: s.mtu_selector,
        rate_selector: s.rate_selector,
        rate: s.rate,
        packet_life_time_selector: s.packet_life_time_selector,
        packet_life_time: s.packet_life_time,
        preference: s.preference,
    };
}

include!(concat!(env!("OUT_DIR"), "/symver_misc.rs"));
