//! `rdma_getaddrinfo` and `rdma_freeaddrinfo`, as librdmacm's `addrinfo.c` defines them: the
//! system's `getaddrinfo` with the hints translated (RC/UD to stream/datagram, the port space to
//! TCP/UDP), its first answer as the source (`RAI_PASSIVE`) or destination address. No IB ACM
//! route lookup. Memory comes from `malloc`, so that an application may hand `rdma_freeaddrinfo`
//! buffers it put there itself, as with librdmacm.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use crate::abi::{IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD};
use crate::cma_abi::*;
use crate::errno;

/// `AF_IB` (rdma-core's `<infiniband/ib.h>`): native IB addressing, which we do not provide.
const AF_IB: c_int = 27;

unsafe fn copy_addr(
    dst: &mut *mut libc::sockaddr,
    dst_len: &mut libc::socklen_t,
    src: *const libc::sockaddr,
    len: libc::socklen_t,
) -> bool {
    // SAFETY: plain allocation.
    let p = unsafe { libc::malloc(len as usize) } as *mut libc::sockaddr;
    if p.is_null() {
        return false;
    }
    // SAFETY: `len` readable bytes at `src` (the caller's or getaddrinfo's address).
    unsafe { ptr::copy_nonoverlapping(src as *const u8, p as *mut u8, len as usize) };
    *dst = p;
    *dst_len = len;
    true
}

/// `rdma_getaddrinfo`: 0, a `getaddrinfo` error (`EAI_*`), or -1 with errno.
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const RdmaAddrinfo,
    res: *mut *mut RdmaAddrinfo,
) -> c_int {
    const WHAT: &str = "rdma_getaddrinfo";
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        errno::refuse(WHAT, libc::EINVAL, "nothing to resolve");
        return -1;
    }
    // SAFETY: all-zero is valid (no hints).
    let nohints: RdmaAddrinfo = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's hints, or ours.
    let h = unsafe { hints.as_ref() }.unwrap_or(&nohints);
    // SAFETY: plain allocation.
    let rai = unsafe { libc::calloc(1, std::mem::size_of::<RdmaAddrinfo>()) } as *mut RdmaAddrinfo;
    if rai.is_null() {
        errno::set(libc::ENOMEM);
        return -1;
    }
    // SAFETY: just allocated and zeroed.
    let r = unsafe { &mut *rai };
    let mut ok = true;
    if !node.is_null() || !service.is_null() {
        // SAFETY: all-zero is valid.
        let mut ai_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
        if !hints.is_null() {
            if h.ai_flags & RAI_PASSIVE != 0 {
                ai_hints.ai_flags = libc::AI_PASSIVE;
            }
            if h.ai_flags & RAI_NUMERICHOST != 0 {
                ai_hints.ai_flags |= libc::AI_NUMERICHOST;
            }
            if h.ai_family != AF_IB {
                ai_hints.ai_family = h.ai_family;
            }
            ai_hints.ai_socktype = match h.ai_qp_type {
                IBV_QPT_RC | IBV_QPT_UC => libc::SOCK_STREAM,
                IBV_QPT_UD => libc::SOCK_DGRAM,
                _ => 0,
            };
            ai_hints.ai_protocol = match h.ai_port_space {
                RDMA_PS_TCP => libc::IPPROTO_TCP,
                RDMA_PS_UDP | RDMA_PS_IPOIB => libc::IPPROTO_UDP,
                RDMA_PS_IB if ai_hints.ai_socktype == libc::SOCK_STREAM => libc::IPPROTO_TCP,
                RDMA_PS_IB if ai_hints.ai_socktype == libc::SOCK_DGRAM => libc::IPPROTO_UDP,
                _ => 0,
            };
        }
        let mut ai: *mut libc::addrinfo = ptr::null_mut();
        // SAFETY: NUL-terminated strings or NULL (caller's contract); our hints.
        let ret =
            unsafe { libc::getaddrinfo(node, service, if hints.is_null() { ptr::null() } else { &ai_hints }, &mut ai) };
        if ret != 0 {
            // SAFETY: ours, nothing inside yet.
            unsafe { libc::free(rai as *mut c_void) };
            return ret;
        }
        // SAFETY: getaddrinfo succeeded: `ai` is its first answer.
        let a = unsafe { &*ai };
        r.ai_qp_type = if h.ai_qp_type != 0 {
            h.ai_qp_type
        } else {
            match a.ai_socktype {
                libc::SOCK_STREAM => IBV_QPT_RC,
                libc::SOCK_DGRAM => IBV_QPT_UD,
                _ => 0,
            }
        };
        r.ai_port_space = if h.ai_port_space != 0 {
            h.ai_port_space
        } else {
            match a.ai_protocol {
                libc::IPPROTO_TCP => RDMA_PS_TCP,
                libc::IPPROTO_UDP => RDMA_PS_UDP,
                _ => 0,
            }
        };
        r.ai_family = a.ai_family;
        let canon = if a.ai_canonname.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: getaddrinfo's NUL-terminated name.
            unsafe { libc::strdup(a.ai_canonname) }
        };
        // SAFETY: getaddrinfo's address, `ai_addrlen` bytes.
        ok = unsafe {
            if a.ai_flags & libc::AI_PASSIVE != 0 {
                r.ai_flags = RAI_PASSIVE;
                r.ai_src_canonname = canon;
                copy_addr(&mut r.ai_src_addr, &mut r.ai_src_len, a.ai_addr, a.ai_addrlen)
            } else {
                r.ai_dst_canonname = canon;
                copy_addr(&mut r.ai_dst_addr, &mut r.ai_dst_len, a.ai_addr, a.ai_addrlen)
            }
        };
        // SAFETY: getaddrinfo's list.
        unsafe { libc::freeaddrinfo(ai) };
    } else {
        r.ai_flags = h.ai_flags;
        r.ai_family = h.ai_family;
        r.ai_qp_type = h.ai_qp_type;
        r.ai_port_space = h.ai_port_space;
        if h.ai_dst_len > 0 && !h.ai_dst_addr.is_null() {
            // SAFETY: the hints' address, `ai_dst_len` bytes.
            ok = unsafe { copy_addr(&mut r.ai_dst_addr, &mut r.ai_dst_len, h.ai_dst_addr, h.ai_dst_len) };
        }
    }
    if ok && r.ai_src_len == 0 && h.ai_src_len > 0 && !h.ai_src_addr.is_null() {
        // SAFETY: the hints' address, `ai_src_len` bytes.
        ok = unsafe { copy_addr(&mut r.ai_src_addr, &mut r.ai_src_len, h.ai_src_addr, h.ai_src_len) };
    }
    if !ok {
        // SAFETY: ours.
        unsafe { softrdma_rdma_freeaddrinfo(rai) };
        errno::set(libc::ENOMEM);
        return -1;
    }
    // SAFETY: writable (checked non-NULL).
    unsafe { *res = rai };
    0
}

/// `rdma_freeaddrinfo`: the list and everything it points at (`free`).
#[no_mangle]
pub unsafe extern "C" fn softrdma_rdma_freeaddrinfo(res: *mut RdmaAddrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: a list from rdma_getaddrinfo; every pointer in it is malloc'd or NULL.
        unsafe {
            let r = &*p;
            let next = r.ai_next;
            for q in [
                r.ai_connect,
                r.ai_route,
                r.ai_src_canonname as *mut c_void,
                r.ai_dst_canonname as *mut c_void,
                r.ai_src_addr as *mut c_void,
                r.ai_dst_addr as *mut c_void,
            ] {
                libc::free(q);
            }
            libc::free(p as *mut c_void);
            p = next;
        }
    }
}

include!(concat!(env!("OUT_DIR"), "/symver_addrinfo.rs"));
