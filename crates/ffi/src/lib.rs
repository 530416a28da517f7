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
//!   struct (module `objects`); a pointer the application hands back is cast to the private struct
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
//! # Using it
//!
//! ```text
//! cargo build --release -p softrdma-ffi
//! mkdir -p lib
//! cp target/release/libibverbs.so lib/libibverbs.so.1
//! cp target/release/build/softrdma-ffi-*/out/softrdma-lib/*.so.1 lib/   # librdmacm, libmlx5, libefa
//! printf 'sr0 netdev lo addr 127.0.0.2\nsr1 netdev lo addr 127.0.0.3\n' > devices.conf
//! SOFTRDMA_CONFIG=$PWD/devices.conf LD_LIBRARY_PATH=$PWD/lib ibv_rc_pingpong -d sr0 -g 1 &
//! SOFTRDMA_CONFIG=$PWD/devices.conf LD_LIBRARY_PATH=$PWD/lib ibv_rc_pingpong -d sr1 -g 1 127.0.0.1
//! SOFTRDMA_CONFIG=$PWD/devices.conf LD_LIBRARY_PATH=$PWD/lib rping -s -a 127.0.0.2 -v -C 10 &
//! SOFTRDMA_CONFIG=$PWD/devices.conf LD_LIBRARY_PATH=$PWD/lib rping -c -a 127.0.0.2 -v -C 10
//! ```
//!
//! `librdmacm.so.1` is the RDMA connection manager's drop-in: a thin C library with rdma-core 44's
//! `RDMACM_1.x` symbols that forwards to the connection manager implemented here (`src/cma.rs`
//! explains the split, how an address picks its device, and where it differs from librdmacm
//! over the kernel). rsockets are not provided.
//!
//! Each process opens its own embedded device, so a server and a client use two devices (two
//! loopback addresses); `-g 1` selects the IPv4 GID, as with the kernel's rxe (RoCE needs a GRH).
//! perftest links `libmlx5.so.1` and `libefa.so.1` directly: `build.rs` builds small stand-ins
//! that export what perftest imports and answer "not this device" (`EOPNOTSUPP`).
//!
//! The crate builds in one codegen unit (workspace `Cargo.toml`): the `.symver` directives must be
//! in the object file that defines each exported function.
//!
//! # Not provided
//!
//! * the pre-1.1 compat entry points (`ibv_get_device_list@IBVERBS_1.0` etc., for binaries built
//!   against libibverbs 1.0 in 2006) and the provider-facing `IBVERBS_PRIVATE_34` symbols
//!   (`ibv_cmd_*`, `verbs_register_driver_34`...), which only rdma-core's own providers use; the one
//!   private symbol applications import, `ibv_query_gid_type`, is exported;
//! * memory windows, XRC, multicast, flow steering, counters, device memory, work queues and RSS,
//!   thread and parent domains, CQ moderation and resizing, SRQ resizing, on-demand paging,
//!   dma-buf MRs, ECE, object import: all refused with `EOPNOTSUPP`.
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
mod addrinfo;
mod cma;
pub mod cma_abi;
mod device;
mod errno;
mod ext;
mod misc;
mod objects;
mod post;
