//! Requests the command line sends to a running daemon.

use std::net::IpAddr;
use std::path::Path;

use softrdma_abi::msg::{DeviceEntry, DeviceStats, Request, Response};

use crate::daemon::client::Control;
use crate::error::{Error, Result};

pub use softrdma_abi::msg::DeviceEntry as DaemonDevice;
pub use softrdma_abi::msg::DeviceStats as DaemonStats;

/// A connection to a running daemon, for management.
pub struct Admin {
    ctl: Control,
}

impl Admin {
    /// Connect to the daemon this process would use (`$SOFTRDMA_SOCKET`, the user's daemon, the
    /// system daemon); `None` if none answers.
    pub fn connect() -> Option<Admin> {
        Control::connect().map(|ctl| Admin { ctl })
    }

    /// Connect to the daemon at `path`.
    pub fn connect_to(path: &Path) -> Result<Admin> {
        Ok(Admin { ctl: Control::connect_to(path)? })
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> u32 {
        self.ctl.daemon_pid
    }

    fn ok(&self, req: Request) -> Result<()> {
        match self.ctl.call(&req, &[])?.0 {
            Response::Ok => Ok(()),
            _ => Err(Error::Daemon("unexpected answer from softrdmad".into())),
        }
    }

    /// The daemon's devices (registry order), with their netdevs as the daemon sees them.
    pub fn devices(&self) -> Result<Vec<DeviceEntry>> {
        self.ctl.devices()
    }

    /// Counters of one device or all.
    pub fn stats(&self, device: Option<&str>) -> Result<Vec<DeviceStats>> {
        match self.ctl.call(&Request::Stats { device: device.map(str::to_owned) }, &[])?.0 {
            Response::Stats(s) => Ok(s),
            _ => Err(Error::Daemon("unexpected answer from softrdmad".into())),
        }
    }

    /// `link add NAME type rxe netdev IFACE [addr IP]` (persistent).
    pub fn link_add(&self, name: &str, netdev: &str, addr: Option<IpAddr>) -> Result<()> {
        self.ok(Request::LinkAdd { name: name.into(), netdev: netdev.into(), addr })
    }

    /// `link delete NAME` (persistent).
    pub fn link_delete(&self, name: &str) -> Result<()> {
        self.ok(Request::LinkDelete { name: name.into() })
    }

    /// `dev set NAME name NEWNAME` (persistent).
    pub fn rename(&self, name: &str, new_name: &str) -> Result<()> {
        self.ok(Request::Rename { name: name.into(), new_name: new_name.into() })
    }

    /// Default RoCE mode of a port (persistent).
    pub fn roce_mode(&self, name: &str, port: u8, v1: bool) -> Result<()> {
        self.ok(Request::RoceMode { name: name.into(), port, v1 })
    }

    /// Send raw bytes as a message and return the raw answer (tests of a misbehaving client).
    #[doc(hidden)]
    pub fn raw(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        self.ctl.raw(bytes)
    }
}

/// Prometheus text for these stats.
pub fn prometheus(stats: &[DeviceStats]) -> String {
    crate::daemon::server::prometheus(stats)
}
