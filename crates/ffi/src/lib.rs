//! `libibverbs.so.1` for softrdma: rdma-core 44's C ABI over the softrdma Verbs API, so that
//! unmodified RDMA programs (rdma-core's `ibv_*` tools and examples, perftest, anything written
//! against `<infiniband/verbs.h>`) run on softrdma devices with `LD_LIBRARY_PATH` pointing at the
//! directory holding this library.
//!
//! # How it is put together
//!
//! The library looks like an rdma-core provider (`providers/rxe/rxe.c`) with libibverbs itself
//! folded in:
//!
//! * every public object is a private `#[repr(C)]` struct whose first field is the public `ibv_*`
//!   struct ([`objects`]); a pointer the application hands back is cast to the private struct
//!   (rxe's `to_rqp`);
//! * one [`abi::IbvContextOps`] table serves the header's inline data-path calls
//!   (`ibv_post_send`, `ibv_poll_cq`, ...), and a [`abi::VerbsContext`] placed *before*
//!   `struct ibv_context` serves the extended ones (`ibv_query_device_ex`, `ibv_create_cq_ex`,
//!   `ibv_create_qp_ex`, the `ibv_query_port` inline). Ops we do not implement stay NULL, so the
//!   header's inline wrappers fail them with `EOPNOTSUPP`, the documented refusal;
//! * exported functions carry rdma-core 44's symbol versions (`symbols.txt`, `build.rs`), and the
//!   SONAME is `libibverbs.so.1`;
//! * devices come from softrdma's registry (`$SOFTRDMA_CONFIG`), never from sysfs or
//!   `/dev/infiniband`; `ibv_open_device` opens the embedded device in this process (its UDP port
//!   is `$SOFTRDMA_UDP_PORT`, default 4791).
//!
//! # Errors
//!
//! Calls fail the way rdma-core documents: functions returning `int` return an errno value (or
//! -1 with `errno` set where rdma-core does so, e.g. `ibv_query_gid`), functions returning
//! pointers return NULL with `errno` set. Posting stops at the first bad work request and points
//! `bad_wr` at it. Unsupported features (memory windows, XRC, multicast, flow steering, device
//! memory, ...) fail with `EOPNOTSUPP`. Set `SOFTRDMA_FFI_DEBUG=1` to have failures explained on
//! stderr.
//!
//! # Safety
//!
//! Everything here is `unsafe` at the boundary: the C caller promises valid pointers, as with any C
//! library. Each function checks for NULL where rdma-core tolerates it and otherwise trusts the
//! caller as rdma-core does; each `unsafe` block says what it relies on.

#![allow(clippy::missing_safety_doc)]

pub mod abi;
mod device;
mod errno;
mod ext;
mod misc;
mod objects;
mod post;
