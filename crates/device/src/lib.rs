//! The softrdma device model: what a soft RoCE device *is*, independent of how it runs.
//!
//! A device (rxe's equivalent) is bound to a network interface, or to one address of it, and
//! reports InfiniBand-style attributes derived from that interface. This crate owns:
//!
//! * [`netdev`]: enumerating network interfaces (name, index, flags, MTU, MAC, addresses) and
//!   resolving a local IP address to its interface;
//! * [`gid`]: GUIDs, GIDs (and their rdma-core text forms) and the GID table rxe builds from an
//!   interface's addresses;
//! * [`attr`]: device and port attributes with rxe's values and rules (active MTU, port state);
//! * [`registry`]: which devices exist (the `devices.conf` file, or the implicit `rxe0` on `lo`);
//! * [`device`]: [`DeviceInfo`], one device's full description, and the errors for bad input
//!   (unknown device, bad port, bad GID index).
//!
//! The transport engine and the UDP I/O that drive a device are not here; they consume
//! [`DeviceInfo`].
//!
//! # Example
//!
//! ```no_run
//! use softrdma_device::{DeviceInfo, Registry};
//!
//! let registry = Registry::load()?;
//! for config in registry.devices() {
//!     let dev = DeviceInfo::open(config)?;
//!     println!("{}\t{}", dev.name, dev.node_guid().hex());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod attr;
pub mod device;
pub mod gid;
pub mod netdev;
pub mod registry;

pub use attr::{DeviceAttr, Mtu, PortAttr};
pub use device::{DeviceError, DeviceInfo};
pub use gid::{Gid, GidTable, GidType, Guid};
pub use netdev::{MacAddr, Netdev};
pub use registry::{DeviceConfig, Registry};
