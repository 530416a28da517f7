//! The data path behind the header's inline calls: `ibv_post_send`, `ibv_post_recv`,
//! `ibv_post_srq_recv` (through `ibv_context.ops`) and `ibv_poll_cq`.
//!
//! Posting walks the list and stops at the first work request that fails, pointing `bad_wr` at it
//! and returning its errno (`EINVAL` for a malformed request, `ENOMEM` for a full queue); the ones
//! before it are posted. This is rdma-core's contract.

use std::ffi::{c_int, c_uint};
use std::ptr;

use softrdma_transport::wr::{Payload, UdDest};
use softrdma_transport::{RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList, WcFlags, WorkCompletion};
use softrdma_wire::Qpn;

use crate::abi::*;
use crate::errno;
use crate::objects::{to_ah, to_cq, to_qp, to_srq, Qp};

/// The SGEs of a work request. An empty list for `num_sge == 0`.
///
/// # Safety
/// `sg_list` holds `num_sge` readable elements when `num_sge > 0`.
pub unsafe fn sges(sg_list: *const IbvSge, num_sge: c_int) -> Result<SgeList, c_int> {
    if num_sge < 0 || (num_sge > 0 && sg_list.is_null()) {
        return Err(libc::EINVAL);
    }
    let mut v = SgeList::new();
    for i in 0..num_sge as usize {
        // SAFETY: in bounds of the caller's array.
        let s = unsafe { *sg_list.add(i) };
        v.push(Sge { addr: s.addr, length: s.length, lkey: s.lkey });
    }
    Ok(v)
}

/// Copy the bytes the SGEs point at (`IBV_SEND_INLINE`: no lkey involved, copied at post time).
///
/// # Safety
/// Each SGE's `[addr, addr+length)` is readable memory of the caller's, as `ibv_post_send` with
/// `IBV_SEND_INLINE` requires.
pub unsafe fn inline_bytes(sgl: &[Sge], max: u32) -> Result<Vec<u8>, c_int> {
    let total: u64 = sgl.iter().map(|s| u64::from(s.length)).sum();
    if total > u64::from(max) {
        return Err(libc::EINVAL);
    }
    let mut v = Vec::with_capacity(total as usize);
    for s in sgl {
        if s.length > 0 {
            // SAFETY: the caller's buffer (function contract).
            v.extend_from_slice(unsafe { std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize) });
        }
    }
    Ok(v)
}

/// One `ibv_send_wr` as the engine's work request.
///
/// # Safety
/// `wr` is a readable work request whose pointers are valid (the caller's contract).
unsafe fn send_wr(q: &Qp, wr: &IbvSendWr) -> Result<SendWr, (c_int, &'static str)> {
    let bad = |why| (libc::EINVAL, why);
    // SAFETY: the union member is chosen by the opcode, as the header documents.
    let (rdma, atomic, ud) = unsafe { (wr.wr.rdma, wr.wr.atomic, wr.wr.ud) };
    let imm = u32::from_be(wr.imm_data);
    let op = match wr.opcode {
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm(imm),
        IBV_WR_SEND_WITH_INV => SendOp::SendWithInv(wr.imm_data),
        IBV_WR_RDMA_WRITE => SendOp::Write { remote_addr: rdma.remote_addr, rkey: rdma.rkey },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm { remote_addr: rdma.remote_addr, rkey: rdma.rkey, imm },
        IBV_WR_RDMA_READ => SendOp::Read { remote_addr: rdma.remote_addr, rkey: rdma.rkey },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
            remote_addr: atomic.remote_addr,
            rkey: atomic.rkey,
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => {
            SendOp::FetchAdd { remote_addr: atomic.remote_addr, rkey: atomic.rkey, add: atomic.compare_add }
        }
        7 | 8 | 10 | 15 => {
            return Err((libc::EOPNOTSUPP, "LOCAL_INV, BIND_MW, TSO and ATOMIC_WRITE are not supported"));
        }
        _ => return Err(bad("unknown opcode")),
    };
    // SAFETY: forwarded contract.
    let sgl = unsafe { sges(wr.sg_list, wr.num_sge) }.map_err(|n| (n, "bad sg_list"))?;
    let payload = if wr.send_flags & IBV_SEND_INLINE != 0 && !op.is_read_or_atomic() {
        // SAFETY: forwarded contract.
        Payload::Inline(unsafe { inline_bytes(&sgl, q.cap.max_inline_data) }.map_err(|n| (n, "inline data too long"))?)
    } else {
        Payload::Sgl(sgl)
    };
    let ud = if q.ibv.qp_base.qp_type == IBV_QPT_UD {
        if ud.ah.is_null() {
            return Err(bad("UD send without an address handle"));
        }
        // SAFETY: a live AH of ours.
        Some(unsafe { to_ah(ud.ah) }.ah.ud(Qpn::new(ud.remote_qpn & 0xff_ffff), ud.remote_qkey))
    } else {
        None
    };
    Ok(SendWr { wr_id: wr.wr_id, op, payload, flags: SendFlags::from_bits(wr.send_flags), ud })
}

/// `ibv_context.ops.post_send`. The chain is posted as one list (one device lock or one
/// publication of the daemon's ring for all of it); the first work request that cannot be
/// converted ends the list, and the one the QP refuses ends the posting.
pub unsafe extern "C" fn post_send(qp: *mut IbvQp, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> c_int {
    // SAFETY: a live QP of ours.
    let q = unsafe { to_qp(qp) };
    // The next request to convert, the one handed to the QP last (the refused one, if one is), and
    // why the one at `next` could not be converted.
    let (mut next, mut last) = (wr, ptr::null_mut());
    let mut unconvertible = None;
    let list = std::iter::from_fn(|| {
        if next.is_null() || unconvertible.is_some() {
            return None;
        }
        // SAFETY: the caller's list of readable work requests.
        let w = unsafe { &*next };
        // SAFETY: forwarded contract.
        match unsafe { send_wr(q, w) } {
            Ok(s) => {
                last = next;
                next = w.next;
                Some(s)
            }
            Err(e) => {
                unconvertible = Some(e);
                None
            }
        }
    });
    let (failed, (n, why)) = match q.qp.post_send_list(list) {
        Ok(()) => match unconvertible {
            None => return 0,
            Some(e) => (next, e),
        },
        Err(e) => {
            errno::explain("ibv_post_send", &e);
            // Refused before the QP took any request (its state): the first one.
            (if last.is_null() { wr } else { last }, (errno::of(&e), "refused by the QP"))
        }
    };
    errno::explain("ibv_post_send", &why);
    if !bad_wr.is_null() {
        // SAFETY: writable out-pointer.
        unsafe { *bad_wr = failed };
    }
    n
}

/// Post a chain of receive work requests with `post`.
unsafe fn post_recv_chain(
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
    what: &str,
    post: impl Fn(RecvWr) -> softrdma_verbs::error::Result<()>,
) -> c_int {
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's list of readable work requests.
        let w = unsafe { &*cur };
        // SAFETY: forwarded contract.
        let r = match unsafe { sges(w.sg_list, w.num_sge) } {
            Ok(sgl) => post(RecvWr { wr_id: w.wr_id, sgl }).map_err(|e| errno::fail(what, &e)),
            Err(n) => Err(errno::refuse(what, n, "bad sg_list")),
        };
        if let Err(n) = r {
            if !bad_wr.is_null() {
                // SAFETY: writable out-pointer.
                unsafe { *bad_wr = cur };
            }
            return n;
        }
        cur = w.next;
    }
    0
}

/// `ibv_context.ops.post_recv`.
pub unsafe extern "C" fn post_recv(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad_wr: *mut *mut IbvRecvWr) -> c_int {
    // SAFETY: a live QP of ours; forwarded contract.
    unsafe {
        let q = to_qp(qp);
        post_recv_chain(wr, bad_wr, "ibv_post_recv", |r| q.qp.post_recv(r))
    }
}

/// `ibv_context.ops.post_srq_recv`.
pub unsafe extern "C" fn post_srq_recv(srq: *mut IbvSrq, wr: *mut IbvRecvWr, bad_wr: *mut *mut IbvRecvWr) -> c_int {
    // SAFETY: a live SRQ of ours; forwarded contract.
    unsafe {
        let s = to_srq(srq);
        post_recv_chain(wr, bad_wr, "ibv_post_srq_recv", |r| s.srq.post_recv(r))
    }
}

/// A completion in `ibv_wc` form.
pub fn wc_from(w: &WorkCompletion) -> IbvWc {
    let imm_data = if w.flags.contains(WcFlags::WITH_IMM) {
        w.imm.to_be()
    } else if w.flags.contains(WcFlags::WITH_INV) {
        w.invalidated_rkey
    } else {
        0
    };
    IbvWc {
        wr_id: w.wr_id,
        status: w.status as c_int,
        opcode: w.opcode as c_int,
        vendor_err: 0,
        byte_len: w.byte_len,
        imm_data,
        qp_num: w.qp_num.value(),
        src_qp: w.src_qp.value(),
        wc_flags: w.flags.bits() as c_uint,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// `ibv_context.ops.poll_cq`.
pub unsafe extern "C" fn poll_cq(cq: *mut IbvCq, num_entries: c_int, wc: *mut IbvWc) -> c_int {
    if num_entries <= 0 {
        return 0;
    }
    if wc.is_null() {
        return -libc::EINVAL;
    }
    // SAFETY: a live CQ of ours.
    let c = unsafe { to_cq(cq) };
    let mut buf = c.buf.lock().unwrap_or_else(|p| p.into_inner());
    buf.clear();
    let n = match c.cq.poll(num_entries as usize, &mut buf) {
        Ok(n) => n,
        Err(e) => {
            errno::fail("ibv_poll_cq", &e);
            return -1;
        }
    };
    for (i, w) in buf.iter().take(n).enumerate() {
        // SAFETY: `wc` holds `num_entries` writable elements and i < n <= num_entries.
        unsafe { ptr::write(wc.add(i), wc_from(w)) };
    }
    n as c_int
}

/// A UD destination for the `ibv_wr_set_ud_addr` builder.
///
/// # Safety
/// `ah` is a live AH of ours.
pub unsafe fn ud_dest(ah: *mut IbvAh, remote_qpn: u32, remote_qkey: u32) -> UdDest {
    // SAFETY: forwarded contract.
    unsafe { to_ah(ah) }.ah.ud(Qpn::new(remote_qpn & 0xff_ffff), remote_qkey)
}
