//! The softrdma Verbs API, and the embedded soft RoCE device behind it.
//!
//! The object model follows libibverbs: a [`Context`] on an opened device gives protection domains
//! ([`ProtectionDomain`]), which own memory regions ([`MemoryRegion`]), queue pairs ([`QueuePair`]),
//! shared receive queues ([`SharedReceiveQueue`]) and address handles ([`AddressHandle`]); completion
//! queues ([`CompletionQueue`]) are polled or waited on through a [`CompletionChannel`], whose file
//! descriptor works with poll/epoll and async runtimes. Work requests and completions are the
//! engine's own types ([`SendWr`], [`RecvWr`], [`WorkCompletion`]).
//!
//! Safe by construction:
//! * a memory region owns its buffer, so the buffer can be neither freed nor moved while the region
//!   exists; the application reads and writes it through the region, under the same lock the
//!   engine's accesses take, so there is no data race;
//! * a queue pair holds its completion queues (and SRQ) alive, so it cannot outlive them;
//! * every key and address in a work request is checked by the engine against the region table, so
//!   a wrong SGE ends in a `LOC_PROT_ERR` completion, never a wild access.
//!
//! The only `unsafe` code is in [`memory`] (copies to and from registered buffers, allocation and
//! `mlock`), [`io`] (socket options without a safe wrapper), the runtime's I/O loop (`ppoll`) and
//! the same-host link (Unix sockets, doorbells); each block says why it is sound.
//!
//! A device runs *embedded*: its engine and I/O thread live in this process and own a UDP socket on
//! port 4791 of the device's address (configurable for tests). Two processes on one host use two
//! devices on two loopback addresses; packets between two softrdma devices on one host (and in one
//! network namespace) go through shared-memory rings instead of UDP (the same-host link,
//! `same_host.rs`; `SOFTRDMA_SAME_HOST=0` turns it off, [`Context::same_host_stats`] counts it).

mod client_io;
mod client_place;
pub mod clock;
pub mod cm;
pub mod daemon;
pub mod device;
pub mod error;
pub mod io;
mod loopback;
pub mod memory;
mod multicast;
mod place;
mod poller;
mod qp_traffic;
mod remap;
mod runtime;
mod same_host;
pub mod verbs;

pub use cm::{modify_for_attr as cm_modify_for_attr, CmEvent, CmEventChannel, CmId};
pub use device::{devices, open_device, rx_place_by_env, DeviceBuilder};
pub use error::Error;
pub use memory::MemoryRegion;
pub use poller::PollerStats;
pub use same_host::SameHostStats;
pub use softrdma_cm::{
    status as cm_status, ConnParam as CmConnParam, EventKind as CmEventKind, PortSpace, QpAttr as CmQpAttr,
    QpAttrState as CmQpState,
};
pub use softrdma_device::{DeviceAttr, DeviceInfo, Gid, PortAttr};
pub use softrdma_transport::wr::{Payload, UdDest};
pub use softrdma_transport::{
    Access, AddressVector, AsyncEvent, ModifyQp, Mtu, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
    SgeList, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
pub use softrdma_wire::{Psn, Qpn};
pub use verbs::{
    AddressHandle, AhAttr, CompletionChannel, CompletionQueue, ConnectParams, Context, ProtectionDomain, QpInitAttr,
    QueuePair, SharedReceiveQueue,
};

/// The RoCEv2 UDP destination port.
pub const ROCE_PORT: u16 = 4791;
