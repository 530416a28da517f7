//! Finding and opening devices: the registry's devices, or one built by hand (tests, tools).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use softrdma_device::{DeviceConfig, DeviceInfo, Registry};

use crate::daemon::client::{Control, Session};
use crate::error::Result;
use crate::runtime::{Device, DeviceHandle};
use crate::verbs::Context;
use crate::ROCE_PORT;

/// The devices, as `ibv_get_device_list` returns them: softrdmad's running devices when a daemon
/// answers (see [`crate::daemon`]), otherwise those of the registry (`devices.conf`, or the
/// implicit `rxe0` on `lo`) whose interface exists.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    if let Some(ctl) = Control::connect() {
        let list = ctl.devices()?;
        return Ok(list
            .into_iter()
            .filter_map(|e| {
                let nd = e.netdev?;
                DeviceInfo::new(&e.config, nd).ok()
            })
            .collect());
    }
    let reg = Registry::load()?;
    Ok(reg.devices().iter().filter_map(|c| DeviceInfo::open(c).ok()).collect())
}

/// Open a device by name: softrdmad's device of that name if a daemon answers and has it (the
/// application then shares it with every other process, see [`crate::daemon`]); otherwise the
/// registry's device, embedded in this process, on the RoCEv2 port (or `$SOFTRDMA_UDP_PORT`).
pub fn open_device(name: &str) -> Result<Context> {
    if let Some(s) = Session::open(name)? {
        return Ok(Context::daemon(s));
    }
    let reg = Registry::load()?;
    let config = reg.find(name)?.clone();
    DeviceBuilder::from_config(config).open()
}

/// Builds and opens an embedded device.
#[derive(Debug, Clone)]
pub struct DeviceBuilder {
    config: DeviceConfig,
    udp_port: u16,
    same_host: bool,
    rx_place: bool,
}

impl DeviceBuilder {
    /// A device `name` on network interface `netdev`.
    pub fn new(name: &str, netdev: &str) -> DeviceBuilder {
        DeviceBuilder::from_config(DeviceConfig::new(name, netdev))
    }

    /// A device from a registry entry.
    pub fn from_config(config: DeviceConfig) -> DeviceBuilder {
        let udp_port = std::env::var("SOFTRDMA_UDP_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(ROCE_PORT);
        DeviceBuilder { config, udp_port, same_host: crate::same_host::enabled_by_env(), rx_place: rx_place_by_env() }
    }

    /// Use only this address of the interface (e.g. 127.0.0.2 on `lo`).
    pub fn addr(mut self, ip: IpAddr) -> DeviceBuilder {
        self.config = self.config.with_addr(ip);
        self
    }

    /// Use this UDP port instead of 4791 (peers must use the same).
    pub fn udp_port(mut self, port: u16) -> DeviceBuilder {
        self.udp_port = port;
        self
    }

    /// Whether packets to other softrdma devices on this host go through shared memory (the
    /// same-host link) rather than UDP. Default: on, unless `SOFTRDMA_SAME_HOST=0`.
    pub fn same_host(mut self, on: bool) -> DeviceBuilder {
        self.same_host = on;
        self
    }

    /// Whether an RC WRITE's packets after its first are received straight into the region
    /// (crates/verbs place.rs) instead of being copied there from the receive buffer. Default:
    /// off (measured slower on loopback: the kernel's copy into many iovec pieces costs more than
    /// the copy it saves, see docs/PERFORMANCE.md), unless `SOFTRDMA_RX_PLACE=1`.
    pub fn rx_place(mut self, on: bool) -> DeviceBuilder {
        self.rx_place = on;
        self
    }

    /// Open the device: resolve the interface, bind the UDP port, start the I/O thread.
    pub fn open(self) -> Result<Context> {
        let info = DeviceInfo::open(&self.config)?;
        let (v4, v6) = bind_addrs(&info);
        let dev = Device::new(info, v4, v6, self.udp_port, self.same_host, self.rx_place)?;
        Ok(Context::new(Arc::new(DeviceHandle::start(dev)?)))
    }
}

/// The addresses the device's sockets bind: the bound address, or the interface's first IPv4 and
/// first non-link-local IPv6 address (link-local needs a scope the GID does not carry).
pub(crate) fn bind_addrs(info: &DeviceInfo) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
    match info.bind {
        Some(IpAddr::V4(a)) => (Some(a), None),
        Some(IpAddr::V6(a)) => (None, Some(a)),
        None => {
            let v4 = info.netdev.ipv4().next();
            let v6 = info.netdev.ipv6().find(|a| (a.segments()[0] & 0xffc0) != 0xfe80);
            (v4, v6)
        }
    }
}

/// Whether `SOFTRDMA_RX_PLACE=1` asks embedded devices to receive RC WRITEs in place (see
/// [`DeviceBuilder::rx_place`]).
pub fn rx_place_by_env() -> bool {
    std::env::var("SOFTRDMA_RX_PLACE").is_ok_and(|v| v == "1")
}
