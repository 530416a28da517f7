//! The extended verbs: the `verbs_context` ops table, `ibv_create_cq_ex` with its polling API,
//! `ibv_create_qp_ex` with the `ibv_wr_*` work request builder, and `ibv_qp_to_qp_ex`.
//!
//! Extended ops we do not implement (flows, counters, device memory, work queues, XRC, thread and
//! parent domains, CQ moderation, rate limits) are left NULL in the table: the header's inline
//! wrappers then fail them with `EOPNOTSUPP`, which is the documented refusal.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr;

use softrdma_transport::wr::Payload;
use softrdma_transport::{SendFlags, SendOp, SendWr, Sge, SgeList, WorkCompletion};

use crate::abi::*;
use crate::device::{query_device_ex, query_port};
use crate::errno;
use crate::objects::{create_cq_common, create_qp_common, to_cq, to_qp, Cq, Qp, QpRequest};
use crate::post::{inline_bytes, ud_dest, wc_from};

/// The `verbs_context` in front of `context`.
pub fn verbs_context(context: IbvContext) -> VerbsContext {
    VerbsContext {
        query_port: Some(query_port),
        advise_mr: None,
        alloc_null_mr: None,
        read_counters: None,
        attach_counters_point_flow: None,
        create_counters: None,
        destroy_counters: None,
        reg_dm_mr: None,
        alloc_dm: None,
        free_dm: None,
        modify_flow_action_esp: None,
        destroy_flow_action: None,
        create_flow_action_esp: None,
        modify_qp_rate_limit: None,
        alloc_parent_domain: None,
        dealloc_td: None,
        alloc_td: None,
        modify_cq: None,
        post_srq_ops: None,
        destroy_rwq_ind_table: None,
        create_rwq_ind_table: None,
        destroy_wq: None,
        modify_wq: None,
        create_wq: None,
        query_rt_values: None,
        create_cq_ex: Some(create_cq_ex),
        priv_: ptr::null_mut(),
        query_device_ex: Some(query_device_ex),
        ibv_destroy_flow: None,
        abi_placeholder2: None,
        ibv_create_flow: None,
        abi_placeholder1: None,
        open_qp: None,
        create_qp_ex: Some(create_qp_ex),
        get_srq_num: None,
        create_srq_ex: None,
        open_xrcd: None,
        close_xrcd: None,
        _abi_placeholder3: 0,
        sz: std::mem::size_of::<VerbsContext>(),
        context,
    }
}

// ---- ibv_cq_ex -----------------------------------------------------------------------------------

unsafe fn cq_of<'a>(cq: *mut IbvCqEx) -> &'a Cq {
    // SAFETY: an extended CQ of ours (the public ibv_cq is the start of ibv_cq_ex).
    unsafe { to_cq(cq as *mut IbvCq) }
}

/// Move to the next completion; ENOENT when the CQ is empty.
unsafe fn advance(cq: *mut IbvCqEx) -> c_int {
    // SAFETY: forwarded contract.
    let c = unsafe { cq_of(cq) };
    let mut ex = c.ex.lock().unwrap_or_else(|p| p.into_inner());
    if ex.batch.is_empty() {
        let mut v = Vec::with_capacity(16);
        if let Err(e) = c.cq.poll(16, &mut v) {
            return errno::fail("ibv_start_poll", &e);
        }
        ex.batch.extend(v);
    }
    ex.cur = ex.batch.pop_front();
    match ex.cur {
        Some(w) => {
            // SAFETY: the public fields of our CQ are ours to update.
            unsafe {
                (*cq).status = w.status as c_int;
                (*cq).wr_id = w.wr_id;
            }
            0
        }
        None => libc::ENOENT,
    }
}

unsafe extern "C" fn start_poll(cq: *mut IbvCqEx, attr: *mut IbvPollCqAttr) -> c_int {
    // SAFETY: NULL or readable attributes.
    if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
        return libc::EINVAL;
    }
    // SAFETY: forwarded contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut IbvCqEx) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { advance(cq) }
}

unsafe extern "C" fn end_poll(cq: *mut IbvCqEx) {
    // SAFETY: forwarded contract.
    let c = unsafe { cq_of(cq) };
    c.ex.lock().unwrap_or_else(|p| p.into_inner()).cur = None;
}

/// The current completion in `ibv_wc` form (zero outside a poll).
unsafe fn cur(cq: *mut IbvCqEx) -> IbvWc {
    // SAFETY: forwarded contract.
    let c = unsafe { cq_of(cq) };
    let ex = c.ex.lock().unwrap_or_else(|p| p.into_inner());
    let w: Option<WorkCompletion> = ex.cur;
    // SAFETY: IbvWc is plain data.
    w.map_or_else(|| unsafe { std::mem::zeroed() }, |w| wc_from(&w))
}

macro_rules! reader {
    ($name:ident, $t:ty, |$w:ident| $e:expr) => {
        unsafe extern "C" fn $name(cq: *mut IbvCqEx) -> $t {
            // SAFETY: an extended CQ of ours.
            let $w = unsafe { cur(cq) };
            $e
        }
    };
}

reader!(read_opcode, c_int, |w| w.opcode);
reader!(read_vendor_err, u32, |w| w.vendor_err);
reader!(read_byte_len, u32, |w| w.byte_len);
reader!(read_imm_data, u32, |w| w.imm_data);
reader!(read_qp_num, u32, |w| w.qp_num);
reader!(read_src_qp, u32, |w| w.src_qp);
reader!(read_wc_flags, c_uint, |w| w.wc_flags);
reader!(read_slid, u32, |w| u32::from(w.slid));
reader!(read_sl, u8, |w| w.sl);
reader!(read_dlid_path_bits, u8, |w| w.dlid_path_bits);

/// `verbs_context.create_cq_ex`: the standard completion fields only; timestamps, CVLAN, flow
/// tags and tag matching are refused with EOPNOTSUPP.
unsafe extern "C" fn create_cq_ex(context: *mut IbvContext, attr: *mut IbvCqInitAttrEx) -> *mut IbvCqEx {
    const WHAT: &str = "ibv_create_cq_ex";
    if attr.is_null() {
        return errno::null(WHAT, libc::EINVAL, "NULL attributes");
    }
    // SAFETY: readable attributes (caller's contract).
    let a = unsafe { &*attr };
    if a.comp_mask & !(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD) != 0 {
        return errno::null(WHAT, libc::EINVAL, "unknown comp_mask bits");
    }
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_PD != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "parent domains are not supported");
    }
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0 && a.flags & !1 != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "only IBV_CREATE_CQ_ATTR_SINGLE_THREADED is supported");
    }
    if a.wc_flags & !wc_flags_ex::STD != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "timestamps, CVLAN, flow tag and TM info are not supported");
    }
    if a.cqe > i32::MAX as u32 || a.comp_vector > i32::MAX as u32 {
        return errno::null(WHAT, libc::EINVAL, "cqe or comp_vector out of range");
    }
    // SAFETY: forwarded contract.
    let p = match unsafe { create_cq_common(context, a.cqe as c_int, a.cq_context, a.channel, a.comp_vector as c_int) }
    {
        Ok(p) => p,
        Err(_) => return ptr::null_mut(),
    };
    // SAFETY: the CQ was just created and is not yet shared.
    let ex = unsafe { &mut (*p).ibv };
    ex.start_poll = Some(start_poll);
    ex.next_poll = Some(next_poll);
    ex.end_poll = Some(end_poll);
    ex.read_opcode = Some(read_opcode);
    ex.read_vendor_err = Some(read_vendor_err);
    ex.read_byte_len = Some(read_byte_len);
    ex.read_imm_data = Some(read_imm_data);
    ex.read_qp_num = Some(read_qp_num);
    ex.read_src_qp = Some(read_src_qp);
    ex.read_wc_flags = Some(read_wc_flags);
    ex.read_slid = Some(read_slid);
    ex.read_sl = Some(read_sl);
    ex.read_dlid_path_bits = Some(read_dlid_path_bits);
    ex
}

// ---- ibv_qp_ex -----------------------------------------------------------------------------------

const SEND_OPS_SUPPORTED: u64 = IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | IBV_QP_EX_WITH_SEND_WITH_INV;

/// `IBV_QP_INIT_ATTR_CREATE_FLAGS`: accepted when no flag is set.
const IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 3;

/// `verbs_context.create_qp_ex` (the inline calls `ibv_create_qp` itself when only the PD is given).
pub(crate) unsafe extern "C" fn create_qp_ex(_context: *mut IbvContext, attr: *mut IbvQpInitAttrEx) -> *mut IbvQp {
    const WHAT: &str = "ibv_create_qp_ex";
    if attr.is_null() {
        return errno::null(WHAT, libc::EINVAL, "NULL attributes");
    }
    // SAFETY: readable and writable attributes (caller's contract).
    let a = unsafe { &mut *attr };
    let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | IBV_QP_INIT_ATTR_CREATE_FLAGS;
    if a.comp_mask & !known != 0 {
        return errno::null(
            WHAT,
            libc::EOPNOTSUPP,
            "XRC, TSO, RSS, indirection tables and source QPNs are not supported",
        );
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "QP create flags are not supported");
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
        return errno::null(WHAT, libc::EINVAL, "a PD is required");
    }
    let is_ex = a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
    if is_ex && a.send_ops_flags & !SEND_OPS_SUPPORTED != 0 {
        return errno::null(WHAT, libc::EOPNOTSUPP, "LOCAL_INV, BIND_MW, TSO and ATOMIC_WRITE are not supported");
    }
    let mut req = QpRequest {
        pd: a.pd,
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
        is_ex,
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

/// `ibv_qp_to_qp_ex`: the extended QP of one created with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`, else
/// NULL (as rdma-core).
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut IbvQp) -> *mut IbvQpEx {
    if qp.is_null() {
        return errno::null("ibv_qp_to_qp_ex", libc::EINVAL, "NULL QP");
    }
    // SAFETY: a live QP of ours.
    if unsafe { to_qp(qp) }.is_ex {
        qp as *mut IbvQpEx
    } else {
        errno::null("ibv_qp_to_qp_ex", libc::EOPNOTSUPP, "the QP was not created with send_ops_flags")
    }
}

/// The extended QP struct with the builder functions, around `base`.
pub fn qp_ex(base: IbvQp) -> IbvQpEx {
    IbvQpEx {
        qp_base: base,
        comp_mask: 0,
        wr_id: 0,
        wr_flags: 0,
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: Some(wr_bind_mw),
        wr_local_inv: Some(wr_local_inv),
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: Some(wr_send_inv),
        wr_send_tso: Some(wr_send_tso),
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: Some(wr_set_xrc_srqn),
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: Some(wr_atomic_write),
    }
}

unsafe fn qpx<'a>(qp: *mut IbvQpEx) -> &'a Qp {
    // SAFETY: an extended QP of ours (ibv_qp is the start of ibv_qp_ex, which starts our Qp).
    unsafe { to_qp(qp as *mut IbvQp) }
}

/// Start a new work request with `op`, taking `wr_id` and `wr_flags` from the public struct.
unsafe fn begin(qp: *mut IbvQpEx, op: SendOp) {
    // SAFETY: an extended QP of ours; the public fields are readable.
    let (q, wr_id, flags) = unsafe { (qpx(qp), (*qp).wr_id, (*qp).wr_flags) };
    let mut b = q.batch.lock().unwrap_or_else(|p| p.into_inner());
    b.wrs.push(SendWr {
        wr_id,
        op,
        payload: Payload::Sgl(SgeList::new()),
        flags: SendFlags::from_bits(flags),
        ud: None,
    });
}

/// Record a builder error, reported by `ibv_wr_complete`.
unsafe fn builder_error(qp: *mut IbvQpEx, n: c_int, why: &str) {
    errno::explain("ibv_wr_*", &why);
    // SAFETY: an extended QP of ours.
    let mut b = unsafe { qpx(qp) }.batch.lock().unwrap_or_else(|p| p.into_inner());
    if b.err == 0 {
        b.err = n;
    }
}

/// Apply `f` to the work request being built (an error if there is none).
unsafe fn with_last(qp: *mut IbvQpEx, f: impl FnOnce(&mut SendWr) -> Result<(), (c_int, &'static str)>) {
    // SAFETY: an extended QP of ours.
    let q = unsafe { qpx(qp) };
    let r = {
        let mut b = q.batch.lock().unwrap_or_else(|p| p.into_inner());
        match b.wrs.last_mut() {
            Some(w) => f(w),
            None => Err((libc::EINVAL, "a setter without a work request")),
        }
    };
    if let Err((n, why)) = r {
        // SAFETY: forwarded.
        unsafe { builder_error(qp, n, why) };
    }
}

unsafe extern "C" fn wr_atomic_cmp_swp(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, compare: u64, swap: u64) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::CompareSwap { remote_addr, rkey, compare, swap }) }
}
unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, add: u64) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::FetchAdd { remote_addr, rkey, add }) }
}
unsafe extern "C" fn wr_rdma_read(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::Read { remote_addr, rkey }) }
}
unsafe extern "C" fn wr_rdma_write(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::Write { remote_addr, rkey }) }
}
unsafe extern "C" fn wr_rdma_write_imm(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, imm: u32) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::WriteWithImm { remote_addr, rkey, imm: u32::from_be(imm) }) }
}
unsafe extern "C" fn wr_send(qp: *mut IbvQpEx) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::Send) }
}
unsafe extern "C" fn wr_send_imm(qp: *mut IbvQpEx, imm: u32) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::SendWithImm(u32::from_be(imm))) }
}
unsafe extern "C" fn wr_send_inv(qp: *mut IbvQpEx, rkey: u32) {
    // SAFETY: forwarded.
    unsafe { begin(qp, SendOp::SendWithInv(rkey)) }
}
unsafe extern "C" fn wr_bind_mw(qp: *mut IbvQpEx, _mw: *mut c_void, _rkey: u32, _info: *const c_void) {
    // SAFETY: forwarded.
    unsafe { builder_error(qp, libc::EOPNOTSUPP, "memory windows are not supported") }
}
unsafe extern "C" fn wr_local_inv(qp: *mut IbvQpEx, _rkey: u32) {
    // SAFETY: forwarded.
    unsafe { builder_error(qp, libc::EOPNOTSUPP, "local invalidate is not supported") }
}
unsafe extern "C" fn wr_send_tso(qp: *mut IbvQpEx, _hdr: *mut c_void, _hdr_sz: u16, _mss: u16) {
    // SAFETY: forwarded.
    unsafe { builder_error(qp, libc::EOPNOTSUPP, "TSO is not supported") }
}
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut IbvQpEx, _srqn: u32) {
    // SAFETY: forwarded.
    unsafe { builder_error(qp, libc::EOPNOTSUPP, "XRC is not supported") }
}
unsafe extern "C" fn wr_atomic_write(qp: *mut IbvQpEx, _rkey: u32, _addr: u64, _data: *const c_void) {
    // SAFETY: forwarded.
    unsafe { builder_error(qp, libc::EOPNOTSUPP, "ATOMIC_WRITE is not supported") }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut IbvQpEx, ah: *mut IbvAh, remote_qpn: u32, remote_qkey: u32) {
    if ah.is_null() {
        // SAFETY: forwarded.
        return unsafe { builder_error(qp, libc::EINVAL, "NULL address handle") };
    }
    // SAFETY: a live AH of ours.
    let d = unsafe { ud_dest(ah, remote_qpn, remote_qkey) };
    // SAFETY: forwarded.
    unsafe {
        with_last(qp, |w| {
            w.ud = Some(d);
            Ok(())
        })
    }
}

unsafe extern "C" fn wr_set_sge(qp: *mut IbvQpEx, lkey: u32, addr: u64, length: u32) {
    // SAFETY: forwarded.
    unsafe {
        with_last(qp, |w| {
            w.payload = Payload::Sgl(SgeList::one(Sge { addr, length, lkey }));
            Ok(())
        })
    }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut IbvQpEx, num_sge: usize, sg_list: *const IbvSge) {
    if num_sge > i32::MAX as usize {
        // SAFETY: forwarded.
        return unsafe { builder_error(qp, libc::EINVAL, "too many SGEs") };
    }
    // SAFETY: `sg_list` holds `num_sge` elements (caller's contract).
    match unsafe { crate::post::sges(sg_list, num_sge as c_int) } {
        Ok(v) => unsafe {
            with_last(qp, |w| {
                w.payload = Payload::Sgl(v);
                Ok(())
            })
        },
        // SAFETY: forwarded.
        Err(n) => unsafe { builder_error(qp, n, "bad sg_list") },
    }
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut IbvQpEx, addr: *mut c_void, length: usize) {
    let one = IbvDataBuf { addr, length };
    // SAFETY: forwarded.
    unsafe { wr_set_inline_data_list(qp, 1, &one) }
}

unsafe extern "C" fn wr_set_inline_data_list(qp: *mut IbvQpEx, num_buf: usize, buf_list: *const IbvDataBuf) {
    // SAFETY: an extended QP of ours.
    let max = unsafe { qpx(qp) }.cap.max_inline_data;
    let mut sgl = Vec::with_capacity(num_buf);
    for i in 0..num_buf {
        // SAFETY: `buf_list` holds `num_buf` elements (caller's contract).
        let b = unsafe { &*buf_list.add(i) };
        if b.length > u32::MAX as usize {
            // SAFETY: forwarded.
            return unsafe { builder_error(qp, libc::EINVAL, "inline data too long") };
        }
        sgl.push(Sge { addr: b.addr as u64, length: b.length as u32, lkey: 0 });
    }
    // SAFETY: the buffers are the caller's readable memory (ibv_wr_set_inline_data's contract).
    match unsafe { inline_bytes(&sgl, max) } {
        Ok(bytes) => unsafe {
            with_last(qp, |w| {
                w.payload = Payload::Inline(bytes);
                w.flags = w.flags.with(SendFlags::INLINE);
                Ok(())
            })
        },
        // SAFETY: forwarded.
        Err(n) => unsafe { builder_error(qp, n, "inline data longer than max_inline_data") },
    }
}

unsafe extern "C" fn wr_start(qp: *mut IbvQpEx) {
    // SAFETY: an extended QP of ours.
    let mut b = unsafe { qpx(qp) }.batch.lock().unwrap_or_else(|p| p.into_inner());
    b.wrs.clear();
    b.err = 0;
}

unsafe extern "C" fn wr_abort(qp: *mut IbvQpEx) {
    // SAFETY: forwarded.
    unsafe { wr_start(qp) }
}

/// Post what was built; a builder error discards the whole batch and is returned.
unsafe extern "C" fn wr_complete(qp: *mut IbvQpEx) -> c_int {
    // SAFETY: an extended QP of ours.
    let q = unsafe { qpx(qp) };
    let (wrs, err) = {
        let mut b = q.batch.lock().unwrap_or_else(|p| p.into_inner());
        (std::mem::take(&mut b.wrs), std::mem::replace(&mut b.err, 0))
    };
    if err != 0 {
        return err;
    }
    for w in wrs {
        if let Err(e) = q.qp.post_send(w) {
            return errno::fail("ibv_wr_complete", &e);
        }
    }
    0
}

include!(concat!(env!("OUT_DIR"), "/symver_ext.rs"));
