//! Devices and contexts: the device list from softrdma's registry, opening and closing, and the
//! device, port, GID and P_Key queries.
//!
//! `struct ibv_device`s live for the whole process (rdma-core keeps them in a global list too): a
//! context points at its device after `ibv_free_device_list`, and a later `ibv_get_device_list`
//! hands out the same pointers for the same names.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::offset_of;
use std::ptr;
use std::sync::Mutex;

use softrdma_device::gid::GidType;
use softrdma_device::{DeviceAttr, PortAttr};
use softrdma_verbs::Context;

use crate::abi::*;
use crate::errno;
use crate::objects::{self, Handles};

/// Our `struct ibv_device`.
#[repr(C)]
pub struct SoftDevice {
    pub ibv: IbvDevice,
    pub name: String,
    /// Node GUID in network order (what `ibv_get_device_guid` returns).
    pub guid_be: u64,
    pub index: c_int,
}

/// Every device ever listed (name, `*mut SoftDevice`); never freed.
static DEVICES: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

fn copy_str(dst: &mut [c_char], s: &str) {
    let max = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(max)) {
        *d = b as c_char;
    }
}

/// The device named `name`, created on first sight.
fn device_for(name: &str, guid: u64) -> *mut SoftDevice {
    let mut all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, p)) = all.iter().find(|(n, _)| n == name) {
        return *p as *mut SoftDevice;
    }
    let index = all.len() as c_int;
    let mut ibv = IbvDevice {
        _ops: [ptr::null_mut(); 2],
        node_type: IBV_NODE_CA,
        transport_type: IBV_TRANSPORT_IB,
        name: [0; IBV_SYSFS_NAME_MAX],
        dev_name: [0; IBV_SYSFS_NAME_MAX],
        dev_path: [0; IBV_SYSFS_PATH_MAX],
        ibdev_path: [0; IBV_SYSFS_PATH_MAX],
    };
    copy_str(&mut ibv.name, name);
    // Paths of the shape rdma-core uses, under a directory no kernel creates: nothing of ours
    // lives in sysfs, and ibv_read_sysfs_file answers for these paths itself (misc.rs).
    copy_str(&mut ibv.dev_name, &format!("uverbs{index}"));
    copy_str(&mut ibv.dev_path, &format!("{SOFT_SYSFS}/class/infiniband_verbs/uverbs{index}"));
    copy_str(&mut ibv.ibdev_path, &format!("{SOFT_SYSFS}/class/infiniband/{name}"));
    let dev = Box::new(SoftDevice { ibv, name: name.to_owned(), guid_be: guid.to_be(), index });
    let p = Box::into_raw(dev);
    all.push((name.to_owned(), p as usize));
    p
}

/// The prefix of our devices' `dev_path` and `ibdev_path`.
pub const SOFT_SYSFS: &str = "/softrdma/sys";

/// Whether `p` is one of our devices.
pub fn is_ours(p: *const IbvDevice) -> bool {
    let all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    all.iter().any(|(_, d)| *d == p as usize)
}

/// `ibv_get_device_list`.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut IbvDevice {
    let infos = match softrdma_verbs::devices() {
        Ok(v) => v,
        Err(e) => {
            errno::fail("ibv_get_device_list", &e);
            return ptr::null_mut();
        }
    };
    let list: Vec<*mut IbvDevice> =
        infos.iter().map(|i| device_for(&i.name, i.node_guid().0) as *mut IbvDevice).collect();
    // SAFETY: the caller passes a writable int or NULL.
    unsafe { into_null_terminated(list, num_devices) }
}

/// `ibv_free_device_list`.
#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut IbvDevice) {
    // SAFETY: `list` came from ibv_get_device_list (or is NULL).
    unsafe { free_null_terminated(list) }
}

/// `ibv_get_device_name`.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(device: *mut IbvDevice) -> *const c_char {
    if device.is_null() {
        errno::set(libc::EINVAL);
        return ptr::null();
    }
    // SAFETY: a device pointer from ibv_get_device_list.
    unsafe { (*device).name.as_ptr() }
}

/// `ibv_get_device_guid`: the node GUID, network order.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut IbvDevice) -> u64 {
    if !is_ours(device) {
        errno::set(libc::EINVAL);
        return 0;
    }
    // SAFETY: one of our devices (checked), which are never freed.
    unsafe { (*(device as *mut SoftDevice)).guid_be }
}

/// `ibv_get_device_index`: the device's position in the registry order of first listing.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_index(device: *mut IbvDevice) -> c_int {
    if !is_ours(device) {
        return -1;
    }
    // SAFETY: as above.
    unsafe { (*(device as *mut SoftDevice)).index }
}

/// Our context: the `verbs_context` (which ends with the public `ibv_context`) first, then ours.
#[repr(C)]
pub struct SoftContext {
    pub vctx: VerbsContext,
    pub verbs: Context,
    pub handles: Mutex<Handles>,
}

/// The `SoftContext` of a public context pointer.
///
/// # Safety
/// `ctx` must come from our `ibv_open_device` and not be closed.
pub unsafe fn soft<'a>(ctx: *mut IbvContext) -> &'a SoftContext {
    let off = offset_of!(SoftContext, vctx) + offset_of!(VerbsContext, context);
    // SAFETY: `ctx` points at `vctx.context` inside a live SoftContext (the caller's contract).
    unsafe { &*((ctx as *mut u8).sub(off) as *const SoftContext) }
}

unsafe extern "C" fn compat_refused() -> *mut c_void {
    errno::null("an ibv_context_ops compat entry (pre-1.1 ABI)", libc::ENOSYS, "not provided")
}

/// `ibv_open_device`.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut IbvDevice) -> *mut IbvContext {
    if !is_ours(device) {
        return errno::null("ibv_open_device", libc::ENODEV, "not a device from ibv_get_device_list");
    }
    // SAFETY: checked above: one of our devices.
    let dev = unsafe { &*(device as *mut SoftDevice) };
    let verbs = match open_shared(&dev.name) {
        Ok(c) => c,
        Err(e) => {
            // Opening is where configuration mistakes show (address not local, port taken):
            // say why even without SOFTRDMA_FFI_DEBUG, as a kernel driver would in dmesg.
            eprintln!("softrdma libibverbs: cannot open {}: {e}", dev.name);
            errno::set(errno::of(&e));
            return ptr::null_mut();
        }
    };
    let num_comp_vectors = verbs.query_device().num_comp_vectors.min(i32::MAX as u32) as c_int;
    let async_fd = verbs.async_event_fd();
    objects::make_blocking(async_fd);
    let ops = IbvContextOps {
        _compat_query_device: Some(ibv_query_device),
        _compat_query_port: Some(ibv_query_port),
        _compat_alloc_pd: Some(compat_refused),
        _compat_dealloc_pd: Some(compat_refused),
        _compat_reg_mr: Some(compat_refused),
        _compat_rereg_mr: Some(compat_refused),
        _compat_dereg_mr: Some(compat_refused),
        alloc_mw: Some(objects::alloc_mw),
        bind_mw: Some(objects::bind_mw),
        dealloc_mw: Some(objects::dealloc_mw),
        _compat_create_cq: Some(compat_refused),
        poll_cq: Some(crate::post::poll_cq),
        req_notify_cq: Some(objects::req_notify_cq),
        _compat_cq_event: Some(compat_refused),
        _compat_resize_cq: Some(compat_refused),
        _compat_destroy_cq: Some(compat_refused),
        _compat_create_srq: Some(compat_refused),
        _compat_modify_srq: Some(compat_refused),
        _compat_query_srq: Some(compat_refused),
        _compat_destroy_srq: Some(compat_refused),
        post_srq_recv: Some(crate::post::post_srq_recv),
        _compat_create_qp: Some(compat_refused),
        _compat_query_qp: Some(compat_refused),
        _compat_modify_qp: Some(compat_refused),
        _compat_destroy_qp: Some(compat_refused),
        post_send: Some(crate::post::post_send),
        post_recv: Some(crate::post::post_recv),
        _compat_create_ah: Some(compat_refused),
        _compat_destroy_ah: Some(compat_refused),
        _compat_attach_mcast: Some(compat_refused),
        _compat_detach_mcast: Some(compat_refused),
        _compat_async_event: Some(compat_refused),
    };
    // SAFETY: pthread_mutex_t is plain data for which all-zero is PTHREAD_MUTEX_INITIALIZER on glibc.
    let mutex: libc::pthread_mutex_t = unsafe { std::mem::zeroed() };
    let context =
        IbvContext { device, ops, cmd_fd: -1, async_fd, num_comp_vectors, mutex, abi_compat: VERBS_ABI_IS_EXTENDED };
    let vctx = crate::ext::verbs_context(context);
    let soft = Box::new(SoftContext { vctx, verbs, handles: Mutex::new(Handles::default()) });
    let p = Box::into_raw(soft);
    // SAFETY: `p` is the live allocation just made.
    unsafe { ptr::addr_of_mut!((*p).vctx.context) }
}

/// `ibv_close_device`. Objects still open keep the device running (their memory stays valid);
/// the context itself is freed, as in rdma-core.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut IbvContext) -> c_int {
    if context.is_null() {
        return libc::EINVAL;
    }
    let off = offset_of!(SoftContext, vctx) + offset_of!(VerbsContext, context);
    // SAFETY: from ibv_open_device: the context field of a boxed SoftContext.
    let soft = unsafe { Box::from_raw((context as *mut u8).sub(off) as *mut SoftContext) };
    release_shared(soft.verbs.name());
    drop(soft);
    0
}

/// The devices open in this process, with how many contexts use each. An embedded device owns
/// its UDP port, so opening it twice in one process would fail; a second `ibv_open_device` (or
/// the connection manager's own context on the device, which librdmacm opens alongside the
/// application's) shares the running instance instead, as contexts on one kernel device share
/// the hardware.
static OPEN: Mutex<Vec<(String, Context, usize)>> = Mutex::new(Vec::new());

/// Open device `name`, or share it if this process has it open already.
pub fn open_shared(name: &str) -> Result<Context, softrdma_verbs::Error> {
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ctx, users)) = open.iter_mut().find(|(n, _, _)| n == name) {
        *users += 1;
        return Ok(ctx.clone());
    }
    let ctx = softrdma_verbs::open_device(name)?;
    open.push((name.to_owned(), ctx.clone(), 1));
    Ok(ctx)
}

/// A context on `name` was closed: forget the device when it was the last (its objects keep
/// it running until they go).
fn release_shared(name: &str) {
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = open.iter().position(|(n, _, _)| n == name) {
        open[i].2 -= 1;
        if open[i].2 == 0 {
            open.remove(i);
        }
    }
}

/// Names of the devices open in this process, in the order they were opened.
pub fn open_names() -> Vec<String> {
    let open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    open.iter().map(|(n, _, _)| n.clone()).collect()
}

/// Our `struct ibv_device` for registry device `name` (as `ibv_get_device_list` lists it).
pub fn registry_device(name: &str) -> Option<*mut IbvDevice> {
    let infos = softrdma_verbs::devices().ok()?;
    let info = infos.iter().find(|i| i.name == name)?;
    Some(device_for(&info.name, info.node_guid().0) as *mut IbvDevice)
}

fn fill_device_attr(a: &DeviceAttr, out: &mut IbvDeviceAttr) {
    let clamp = |v: u32| v.min(i32::MAX as u32) as c_int;
    // SAFETY: IbvDeviceAttr is plain integers, for which zero is valid.
    *out = unsafe { std::mem::zeroed() };
    copy_str(&mut out.fw_ver, &a.fw_ver_string());
    out.node_guid = a.node_guid.0.to_be();
    out.sys_image_guid = a.sys_image_guid.0.to_be();
    out.max_mr_size = a.max_mr_size;
    out.page_size_cap = a.page_size_cap;
    out.vendor_id = a.vendor_id;
    out.vendor_part_id = a.vendor_part_id;
    out.hw_ver = a.hw_ver;
    out.max_qp = clamp(a.max_qp);
    out.max_qp_wr = clamp(a.max_qp_wr);
    out.device_cap_flags = a.device_cap_flags.0;
    out.max_sge = clamp(a.max_sge);
    out.max_sge_rd = clamp(a.max_sge_rd);
    out.max_cq = clamp(a.max_cq);
    out.max_cqe = clamp(a.max_cqe);
    out.max_mr = clamp(a.max_mr);
    out.max_pd = clamp(a.max_pd);
    out.max_qp_rd_atom = clamp(a.max_qp_rd_atom);
    out.max_ee_rd_atom = clamp(a.max_ee_rd_atom);
    out.max_res_rd_atom = clamp(a.max_res_rd_atom);
    out.max_qp_init_rd_atom = clamp(a.max_qp_init_rd_atom);
    out.max_ee_init_rd_atom = clamp(a.max_ee_init_rd_atom);
    out.atomic_cap = c_int::from(a.atomic_cap.number());
    out.max_ee = clamp(a.max_ee);
    out.max_rdd = clamp(a.max_rdd);
    out.max_mw = clamp(a.max_mw);
    out.max_raw_ipv6_qp = clamp(a.max_raw_ipv6_qp);
    out.max_raw_ethy_qp = clamp(a.max_raw_ethy_qp);
    out.max_mcast_grp = clamp(a.max_mcast_grp);
    out.max_mcast_qp_attach = clamp(a.max_mcast_qp_attach);
    out.max_total_mcast_qp_attach = clamp(a.max_total_mcast_qp_attach);
    out.max_ah = clamp(a.max_ah);
    out.max_fmr = clamp(a.max_fmr);
    out.max_map_per_fmr = clamp(a.max_map_per_fmr);
    out.max_srq = clamp(a.max_srq);
    out.max_srq_wr = clamp(a.max_srq_wr);
    out.max_srq_sge = clamp(a.max_srq_sge);
    out.max_pkeys = a.max_pkeys;
    out.local_ca_ack_delay = a.local_ca_ack_delay;
    out.phys_port_cnt = a.phys_port_cnt;
}

/// `ibv_query_device`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(context: *mut IbvContext, device_attr: *mut IbvDeviceAttr) -> c_int {
    if context.is_null() || device_attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live context of ours; `device_attr` is writable (caller's contract).
    unsafe { fill_device_attr(soft(context).verbs.query_device(), &mut *device_attr) };
    0
}

/// The extended op behind `ibv_query_device_ex`: the base attributes, `device_cap_flags_ex`, and
/// zero for every capability a soft device lacks (ODP, timestamps, TSO, RSS, packet pacing, tag
/// matching, CQ moderation, device memory), as rxe reports them.
pub unsafe extern "C" fn query_device_ex(
    context: *mut IbvContext,
    input: *const IbvQueryDeviceExInput,
    attr: *mut IbvDeviceAttrEx,
    attr_size: usize,
) -> c_int {
    // SAFETY: `input` is NULL or readable (caller's contract).
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return libc::EINVAL;
    }
    if attr.is_null() || attr_size < std::mem::size_of::<IbvDeviceAttr>() {
        return libc::EINVAL;
    }
    // SAFETY: a live context of ours.
    let a = unsafe { soft(context) }.verbs.query_device();
    // SAFETY: IbvDeviceAttrEx is plain integers; zero is valid.
    let mut full: IbvDeviceAttrEx = unsafe { std::mem::zeroed() };
    fill_device_attr(a, &mut full.orig_attr);
    full.device_cap_flags_ex = a.device_cap_flags_ex;
    let n = attr_size.min(std::mem::size_of::<IbvDeviceAttrEx>());
    // SAFETY: `attr` has `attr_size` writable bytes (the header passes sizeof its struct); we
    // write the first min(attr_size, ours) and zero the rest, as rdma-core does for newer callers.
    unsafe {
        ptr::copy_nonoverlapping(&full as *const IbvDeviceAttrEx as *const u8, attr as *mut u8, n);
        if attr_size > n {
            ptr::write_bytes((attr as *mut u8).add(n), 0, attr_size - n);
        }
    }
    0
}

fn fill_port_attr(p: &PortAttr) -> IbvPortAttr {
    IbvPortAttr {
        state: c_int::from(p.state.number()),
        max_mtu: c_int::from(p.max_mtu.ib_enum()),
        active_mtu: c_int::from(p.active_mtu.ib_enum()),
        gid_tbl_len: p.gid_tbl_len.min(i32::MAX as u32) as c_int,
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        bad_pkey_cntr: p.bad_pkey_cntr,
        qkey_viol_cntr: p.qkey_viol_cntr,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        subnet_timeout: p.subnet_timeout,
        init_type_reply: p.init_type_reply,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state.number(),
        link_layer: p.link_layer as u8,
        flags: 0,
        port_cap_flags2: p.port_cap_flags2,
    }
}

/// Write port attributes into the caller's `len` bytes.
unsafe fn query_port_into(context: *mut IbvContext, port_num: u8, out: *mut IbvPortAttr, len: usize) -> c_int {
    if context.is_null() || out.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a live context of ours.
    let ctx = unsafe { soft(context) };
    let p = match ctx.verbs.query_port(port_num) {
        Ok(p) => fill_port_attr(p),
        Err(e) => {
            errno::explain("ibv_query_port", &e);
            return libc::EINVAL;
        }
    };
    let n = len.min(std::mem::size_of::<IbvPortAttr>());
    // SAFETY: `out` has `len` writable bytes (the caller's struct).
    unsafe {
        ptr::copy_nonoverlapping(&p as *const IbvPortAttr as *const u8, out as *mut u8, n);
        if len > n {
            ptr::write_bytes((out as *mut u8).add(n), 0, len - n);
        }
    }
    0
}

/// `ibv_query_port@IBVERBS_1.1`: the compat entry, which fills `struct _compat_ibv_port_attr`
/// (the struct without `port_cap_flags2`, 48 bytes). New code reaches [`query_port`] through the
/// header's inline wrapper instead.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(context: *mut IbvContext, port_num: u8, port_attr: *mut IbvPortAttr) -> c_int {
    // SAFETY: forwarded; the compat struct is the first 48 bytes of ours.
    unsafe { query_port_into(context, port_num, port_attr, offset_of!(IbvPortAttr, port_cap_flags2)) }
}

/// `verbs_context.query_port`, called by the `ibv_query_port` inline with the caller's struct size.
pub unsafe extern "C" fn query_port(
    context: *mut IbvContext,
    port_num: u8,
    port_attr: *mut IbvPortAttr,
    len: usize,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { query_port_into(context, port_num, port_attr, len) }
}

/// One GID table entry: `Ok(None)` for an empty slot inside the table.
fn gid_entry(ctx: &SoftContext, port: u32, index: u32) -> Result<Option<IbvGidEntry>, c_int> {
    let info = ctx.verbs.info();
    let table = info.gid_table(port).map_err(|_| libc::EINVAL)?;
    if index as usize >= info.port.gid_tbl_len as usize {
        return Err(libc::EINVAL);
    }
    let Ok(e) = table.get(index as usize) else {
        return Ok(None);
    };
    Ok(Some(IbvGidEntry {
        gid: IbvGid { raw: e.gid.0 },
        gid_index: index,
        port_num: port,
        gid_type: match e.gid_type {
            GidType::RoceV2 => IBV_GID_TYPE_ROCE_V2,
            _ => IBV_GID_TYPE_ROCE_V1,
        },
        ndev_ifindex: info.netdev.index,
    }))
}

/// `ibv_query_gid`: -1 for a bad port or index, a zero GID for an empty slot.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut IbvContext,
    port_num: u8,
    index: c_int,
    gid: *mut IbvGid,
) -> c_int {
    if context.is_null() || gid.is_null() || index < 0 {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live context of ours; `gid` writable.
    match gid_entry(unsafe { soft(context) }, u32::from(port_num), index as u32) {
        Ok(e) => {
            // SAFETY: `gid` is writable (checked non-NULL; caller's contract).
            unsafe { (*gid).raw = e.map_or([0; 16], |e| e.gid.raw) };
            0
        }
        Err(n) => {
            errno::set(n);
            -1
        }
    }
}

/// `_ibv_query_gid_ex` (behind the `ibv_query_gid_ex` inline): EINVAL for a bad port or index,
/// ENODATA for an empty slot.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut IbvContext,
    port_num: u32,
    gid_index: u32,
    entry: *mut IbvGidEntry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if context.is_null() || entry.is_null() || entry_size < std::mem::size_of::<IbvGidEntry>() {
        return libc::EINVAL;
    }
    if flags != 0 {
        return libc::EINVAL;
    }
    // SAFETY: a live context of ours; `entry` writable.
    match gid_entry(unsafe { soft(context) }, port_num, gid_index) {
        Ok(Some(e)) => {
            // SAFETY: `entry` is writable (checked non-NULL, size checked).
            unsafe { ptr::write(entry, e) };
            0
        }
        Ok(None) => libc::ENODATA,
        Err(n) => n,
    }
}

/// `_ibv_query_gid_table` (behind `ibv_query_gid_table`): the valid entries; a negative errno on
/// failure.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut IbvContext,
    entries: *mut IbvGidEntry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    if context.is_null() || (entries.is_null() && max_entries > 0) || entry_size < std::mem::size_of::<IbvGidEntry>() {
        return -(libc::EINVAL as isize);
    }
    if flags != 0 {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: a live context of ours.
    let ctx = unsafe { soft(context) };
    let n = ctx.verbs.info().gids.len();
    if n > max_entries {
        return -(libc::EINVAL as isize);
    }
    for i in 0..n {
        if let Ok(Some(e)) = gid_entry(ctx, 1, i as u32) {
            // SAFETY: `entries` holds `max_entries` elements of `entry_size` bytes (caller's contract).
            unsafe { ptr::write((entries as *mut u8).add(i * entry_size) as *mut IbvGidEntry, e) };
        }
    }
    n as isize
}

/// `ibv_query_gid_type@IBVERBS_PRIVATE_34` (used by `ibv_devinfo`): `IB/RoCE v1` or `RoCE v2`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut IbvContext,
    port_num: u8,
    index: u32,
    gid_type: *mut c_int,
) -> c_int {
    if context.is_null() || gid_type.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live context of ours; `gid_type` writable.
    match gid_entry(unsafe { soft(context) }, u32::from(port_num), index) {
        Ok(e) => {
            let t = match e {
                Some(e) if e.gid_type == IBV_GID_TYPE_ROCE_V2 => IBV_GID_TYPE_SYSFS_ROCE_V2,
                _ => IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
            };
            // SAFETY: `gid_type` is writable (checked non-NULL; caller's contract).
            unsafe { *gid_type = t };
            0
        }
        Err(n) => {
            errno::set(n);
            -1
        }
    }
}

/// `ibv_query_pkey`: the P_Key in network order; -1 for a bad port or index.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(context: *mut IbvContext, port_num: u8, index: c_int, pkey: *mut u16) -> c_int {
    if context.is_null() || pkey.is_null() || index < 0 {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live context of ours; `pkey` writable.
    match unsafe { soft(context) }.verbs.query_pkey(port_num, index as usize) {
        Ok(p) => {
            // SAFETY: `pkey` is writable (checked non-NULL; caller's contract).
            unsafe { *pkey = p.to_be() };
            0
        }
        Err(e) => {
            errno::fail("ibv_query_pkey", &e);
            -1
        }
    }
}

/// `ibv_get_pkey_index`: the index of a P_Key (network order), or -1.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(context: *mut IbvContext, port_num: u8, pkey: u16) -> c_int {
    if context.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: a live context of ours.
    let ctx = unsafe { soft(context) };
    for i in 0.. {
        match ctx.verbs.query_pkey(port_num, i) {
            Ok(p) if p.to_be() == pkey => return i as c_int,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    errno::set(libc::ENOENT);
    -1
}

/// The device name of a device path we made (for `ibv_read_sysfs_file`).
pub fn our_path_device(dir: &CStr) -> Option<String> {
    let dir = dir.to_str().ok()?;
    let all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    all.iter().find_map(|(name, p)| {
        // SAFETY: devices are never freed.
        let d = unsafe { &*(*p as *const SoftDevice) };
        // SAFETY: NUL-terminated by construction (copy_str leaves the last byte 0).
        let ib = unsafe { CStr::from_ptr(d.ibv.ibdev_path.as_ptr()) };
        let uv = unsafe { CStr::from_ptr(d.ibv.dev_path.as_ptr()) };
        let ours = ib.to_str().ok()? == dir || uv.to_str().ok()? == dir || dir.starts_with(SOFT_SYSFS);
        ours.then(|| name.clone())
    })
}

include!(concat!(env!("OUT_DIR"), "/symver_device.rs"));
