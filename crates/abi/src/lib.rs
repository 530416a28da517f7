//! The ABI between applications and `softrdmad`: what crosses the process boundary.
//!
//! * [`ring`]: single-producer single-consumer rings in shared memory (`#[repr(C)]` header with the
//!   producer and consumer indices on separate cache lines and a consumer flag word: "doorbell
//!   wanted" on work queues, "armed" on completion queues), and the fixed-size slot encodings of
//!   send and receive work requests and of completions ([`slot`]).
//! * [`shm`]: sealed memfd mappings that carry the rings.
//! * [`placements`]: a ring per client process of small writes into its own memory that the
//!   client makes itself when it polls the completion that names them, or the daemon before it
//!   touches that memory otherwise.
//! * [`msg`]: the versioned control messages (open a device, create and destroy objects, modify
//!   and query QPs, manage links) and their binary encoding ([`codec`]).
//! * [`sock`]: the control socket (`SOCK_SEQPACKET`, file descriptors passed with `SCM_RIGHTS`,
//!   the peer's pid and uid from `SO_PEERCRED`) and the socket path rules.
//!
//! Nothing read from shared memory or from a socket is trusted: ring indices are checked against
//! the capacity, slots are copied out before they are decoded, and decoders return errors, never
//! panic. `unsafe` is confined to [`ring`] and [`placements`] (atomics and copies over the
//! mapping), [`shm`] (mmap)
//! and [`sock`] (sendmsg/recvmsg with ancillary data), each block with its `SAFETY:` argument.

pub mod codec;
pub mod msg;
pub mod placements;
pub mod ring;
pub mod shm;
pub mod slot;
pub mod sock;

/// Version of the ABI; both sides refuse a peer of another version. 2: completions may name a
/// batch of writes to wait for (`slot::cqe_writes`, `ring::Ring::writes_made`). 3: opening a
/// device brings a placement ring, and completions may name entries of it to make first
/// (`slot::cqe_places`). 4: the daemon takes inline data up to what a send slot holds. 5: a QP's
/// send slots may be asked to hold `slot::COPY_ROOM` bytes of data whatever its inline size
/// (`Request::CreateQp`'s `copy_room`), and placement slots are 512 bytes.
pub const ABI_VERSION: u32 = 5;
