//! One soft device's description: the registry entry, its netdev, attributes and GID table.
//!
//! This module owns [`DeviceInfo`], the run-time independent model of a device that
//! `ibv_query_device`, `ibv_query_port`, `ibv_query_gid` and `ibv_query_pkey` answer from, and the
//! checks that turn bad user input into clear errors ([`DeviceError`]): unknown device, a netdev
//! that is missing, a bound address the netdev does not have, a bad port number, a bad GID index.
//! The queue-pair engine and the UDP I/O live elsewhere and take a `DeviceInfo` as input.

use std::fmt;
use std::net::IpAddr;

use crate::attr::{DeviceAttr, PortAttr, DEFAULT_PKEY};
use crate::gid::{BadGidIndex, GidEntry, GidTable, GidTableOptions, Guid};
use crate::netdev::{self, Netdev, NetdevError};
use crate::registry::{DeviceConfig, RegistryError};

/// A device as applications see it, built from a [`DeviceConfig`] and a [`Netdev`] snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`rxe0`).
    pub name: String,
    /// The interface snapshot it was built from.
    pub netdev: Netdev,
    /// The bound address, if the device uses only one.
    pub bind: Option<IpAddr>,
    /// Device attributes.
    pub attr: DeviceAttr,
    /// Attributes of port 1, the only port.
    pub port: PortAttr,
    /// GID table of port 1.
    pub gids: GidTable,
    /// P_Key table of port 1 (one entry, the default P_Key 0xffff).
    pub pkeys: Vec<u16>,
}

impl DeviceInfo {
    /// Builds the description of `config` on `netdev` with softrdma's attributes
    /// ([`DeviceAttr::softrdma`]). Fails if the bound address is not local to `netdev`.
    pub fn new(config: &DeviceConfig, netdev: Netdev) -> Result<DeviceInfo, DeviceError> {
        DeviceInfo::with_attr(config, netdev, DeviceAttr::softrdma)
    }

    /// Like [`DeviceInfo::new`], with the device attributes made by `attr` from the node GUID
    /// (e.g. [`DeviceAttr::rxe`] to model the kernel's device exactly).
    pub fn with_attr(
        config: &DeviceConfig,
        netdev: Netdev,
        attr: impl FnOnce(Guid) -> DeviceAttr,
    ) -> Result<DeviceInfo, DeviceError> {
        if let Some(ip) = config.addr {
            if !netdev.owns(ip) {
                return Err(DeviceError::AddrNotOnNetdev {
                    device: config.name.clone(),
                    addr: ip,
                    netdev: netdev.name.clone(),
                });
            }
        }
        let guid = Guid::for_device(&config.name, netdev.mac);
        let opts = GidTableOptions { bind: config.addr, roce_v1: false };
        Ok(DeviceInfo {
            name: config.name.clone(),
            bind: config.addr,
            attr: attr(guid),
            port: PortAttr::for_netdev(&netdev),
            gids: GidTable::build(&netdev, guid, &opts),
            pkeys: vec![DEFAULT_PKEY],
            netdev,
        })
    }

    /// Looks up the device's netdev on this host and builds its description.
    pub fn open(config: &DeviceConfig) -> Result<DeviceInfo, DeviceError> {
        let nd = netdev::by_name(&config.netdev)
            .map_err(|source| DeviceError::Netdev { device: config.name.clone(), source })?;
        DeviceInfo::new(config, nd)
    }

    /// The node GUID.
    pub fn node_guid(&self) -> Guid {
        self.attr.node_guid
    }

    /// Checks a 1-based port number.
    pub fn check_port(&self, port: u32) -> Result<(), DeviceError> {
        if port >= 1 && port <= u32::from(self.attr.phys_port_cnt) {
            Ok(())
        } else {
            Err(DeviceError::BadPort { device: self.name.clone(), port, ports: self.attr.phys_port_cnt })
        }
    }

    /// Attributes of port `port` (1-based).
    pub fn port_attr(&self, port: u32) -> Result<&PortAttr, DeviceError> {
        self.check_port(port)?;
        Ok(&self.port)
    }

    /// GID table of port `port`.
    pub fn gid_table(&self, port: u32) -> Result<&GidTable, DeviceError> {
        self.check_port(port)?;
        Ok(&self.gids)
    }

    /// GID `index` of port `port`.
    pub fn gid(&self, port: u32, index: usize) -> Result<&GidEntry, DeviceError> {
        self.gid_table(port)?.get(index).map_err(|source| DeviceError::BadGidIndex {
            device: self.name.clone(),
            port,
            source,
        })
    }
}

/// Why a device could not be described or queried.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceError {
    /// The registry has no such device, or could not be read.
    Registry(RegistryError),
    /// The device's netdev could not be found.
    Netdev {
        /// The device.
        device: String,
        /// What went wrong.
        source: NetdevError,
    },
    /// The configured address is not an address of the netdev.
    AddrNotOnNetdev {
        /// The device.
        device: String,
        /// The address.
        addr: IpAddr,
        /// The netdev.
        netdev: String,
    },
    /// A port number outside `1..=phys_port_cnt`.
    BadPort {
        /// The device.
        device: String,
        /// The port asked for.
        port: u32,
        /// How many ports the device has.
        ports: u8,
    },
    /// A GID index with no entry.
    BadGidIndex {
        /// The device.
        device: String,
        /// The port.
        port: u32,
        /// The index and the table size.
        source: BadGidIndex,
    },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::Registry(e) => e.fmt(f),
            DeviceError::Netdev { device, source } => write!(f, "{device}: {source}"),
            DeviceError::AddrNotOnNetdev { device, addr, netdev } => {
                write!(f, "{device}: address {addr} is not an address of {netdev}")
            }
            DeviceError::BadPort { device, port, ports } => write!(
                f,
                "{device}: invalid port {port}: the device has {} (1..={ports})",
                if *ports == 1 { "1 port".to_owned() } else { format!("{ports} ports") }
            ),
            DeviceError::BadGidIndex { device, port, source } => write!(f, "{device} port {port}: {source}"),
        }
    }
}

impl std::error::Error for DeviceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DeviceError::Registry(e) => Some(e),
            DeviceError::Netdev { source, .. } => Some(source),
            DeviceError::BadGidIndex { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<RegistryError> for DeviceError {
    fn from(e: RegistryError) -> DeviceError {
        DeviceError::Registry(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attr::{Mtu, PortState};

    #[test]
    fn describes_golden_rxe0() {
        let d = DeviceInfo::new(&DeviceConfig::new("rxe0", "eth0"), crate::netdev::golden_eth0()).unwrap();
        assert_eq!(d.node_guid().to_string(), "5054:00ff:fe77:0902");
        assert_eq!(d.attr.sys_image_guid, d.node_guid());
        assert_eq!(d.port.state, PortState::Active);
        assert_eq!(d.port.active_mtu, Mtu::M1024);
        assert_eq!(d.gid(1, 1).unwrap().gid.to_string(), "::ffff:10.77.9.2");
        assert_eq!(d.pkeys, [0xffff]);
    }

    #[test]
    fn clear_errors() {
        let d = DeviceInfo::new(&DeviceConfig::new("rxe0", "eth0"), crate::netdev::golden_eth0()).unwrap();
        assert_eq!(
            d.gid(1, 5).unwrap_err().to_string(),
            "rxe0 port 1: bad GID index 5: the GID table has 2 entries (indices 0..=1)"
        );
        assert_eq!(d.gid(2, 0).unwrap_err().to_string(), "rxe0: invalid port 2: the device has 1 port (1..=1)");
        assert!(d.port_attr(0).is_err());
        assert!(d.port_attr(1).is_ok());
        let cfg = DeviceConfig::new("rxe0", "eth0").with_addr("10.77.9.3".parse().unwrap());
        assert_eq!(
            DeviceInfo::new(&cfg, crate::netdev::golden_eth0()).unwrap_err().to_string(),
            "rxe0: address 10.77.9.3 is not an address of eth0"
        );
        let cfg = DeviceConfig::new("rxe0", "nosuch-if0");
        let e = DeviceInfo::open(&cfg).unwrap_err().to_string();
        assert_eq!(e, "rxe0: network interface \"nosuch-if0\" not found");
    }

    #[test]
    fn bound_device() {
        let cfg = DeviceConfig::new("rxe0", "eth0").with_addr("10.77.9.2".parse().unwrap());
        let d = DeviceInfo::with_attr(&cfg, crate::netdev::golden_eth0(), DeviceAttr::rxe).unwrap();
        assert_eq!(d.gids.len(), 2);
        assert_eq!(d.bind, cfg.addr);
        assert_eq!(d.attr, DeviceAttr::rxe(d.node_guid()));
    }

    #[test]
    fn opens_loopback_device_on_this_host() {
        let d = DeviceInfo::open(&DeviceConfig::new("rxe0", "lo")).unwrap();
        assert_eq!(d.port.active_mtu, Mtu::M4096);
        assert!(d.gids.find(&"127.0.0.1".parse().unwrap(), crate::gid::GidType::RoceV2).is_some());
    }
}
