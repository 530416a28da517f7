//! Wire formats of the InfiniBand transport as carried by RoCE.
//!
//! Every header is a typed view over a byte buffer (`XxxPacket<T: AsRef<[u8]>>`, checked once with
//! `new_checked`, then infallible getters) paired with a plain-value `XxxRepr` that can `parse` and
//! `emit`. Protocol facts live in one place, the [`opcode`] table; code above this crate tests the
//! flags of an opcode and never lists opcodes itself.
//!
//! Below the IB transport headers the crate also owns what carries them: [`lrh`] and [`grh`] (native
//! IB links and RoCEv1, with the link-level VCRC), [`ipv4`], [`ipv6`] and [`udp`] (RoCEv2),
//! [`ethernet`], the [`icrc`] over each of these encapsulations, [`roce`] (build and verify whole
//! RoCE packets, including the receiver-side check for a plain UDP socket), [`template`] (data
//! request headers patched from a per-QP template, and acknowledgements) and [`capture`] (pcap files and a RoCE frame
//! classifier).
//!
//! No parser here panics or reads out of bounds on any input: every byte sequence yields a value or a
//! typed [`Error`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod view;

pub mod aeth;
pub mod bth;
pub mod capture;
pub mod checksum;
pub mod cm;
pub mod error;
pub mod ethernet;
pub mod ext;
mod field;
pub mod grh;
pub mod icrc;
pub mod ipv4;
pub mod ipv6;
pub mod lrh;
pub mod mad;
pub mod mtu;
pub mod number;
pub mod opcode;
pub mod packet;
pub mod roce;
pub mod template;
pub mod udp;

pub use aeth::{AethRepr, NakCode, Syndrome};
pub use bth::BthRepr;
pub use error::{Error, Result};
pub use ethernet::{EthernetFrame, EthernetRepr};
pub use ext::{AtomicAckEthRepr, AtomicEthRepr, DethRepr, RethRepr};
pub use grh::{GrhPacket, GrhRepr};
pub use ipv4::{Ipv4Packet, Ipv4Repr};
pub use ipv6::{Ipv6Packet, Ipv6Repr};
pub use lrh::{LrhPacket, LrhRepr};
pub use mtu::Mtu;
pub use number::{Psn, Qpn};
pub use opcode::{HeaderSet, Opcode, OpcodeInfo, QpType};
pub use packet::{IbPacket, IbRepr};
pub use roce::{RoceV1Packet, RoceV2Packet, RoceV2Repr, UdpVerdict};
pub use template::{DataRequest, RequestTemplate};
pub use udp::{UdpPacket, UdpRepr};

/// Length in bytes of the invariant CRC trailing every IB transport packet.
pub const ICRC_LEN: usize = 4;
