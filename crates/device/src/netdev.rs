//! Network interfaces ("netdevs") as a soft RoCE device sees them.
//!
//! This module owns the snapshot of one interface ([`Netdev`]: index, name, flags, MTU, MAC,
//! IPv4/IPv6 addresses, link speed), the enumeration of all of them ([`list`]), and the look-ups a
//! device needs: by name ([`by_name`]) and from a local IP address to its interface
//! ([`by_addr`], [`find_by_addr`]).
//!
//! # Where the data comes from, and why
//!
//! * `getifaddrs(3)`, through the `nix` crate (feature `net`): one call returns every interface
//!   with its flags as the kernel computes them for netlink (`IFF_UP`, `IFF_RUNNING`,
//!   `IFF_LOWER_UP`, `IFF_LOOPBACK`), its link-layer address (an `AF_PACKET` entry carrying the
//!   MAC and the interface index) and every IPv4 and IPv6 address with its netmask, in the
//!   kernel's order. glibc implements it over rtnetlink, so it sees exactly what `ip addr` sees.
//! * `/sys/class/net/NAME/mtu` and `.../speed` for the two numbers `getifaddrs` lacks.
//!
//! Alternatives: rtnetlink by hand (one more protocol to encode and test, for no extra
//! information), `rustix` (no `getifaddrs`), or sysfs + `/proc/net/if_inet6` alone (no IPv4
//! addresses). `nix` keeps the unsafe FFI out of this crate (`#![forbid(unsafe_code)]`) and pulls
//! in only `libc`, `bitflags` and `cfg-if`.
//!
//! Everything the rest of the crate computes from a netdev works on the plain [`Netdev`]
//! struct, so tests build synthetic ones (the golden VM's `eth0`) without touching the host.

use std::fmt;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::str::FromStr;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;
use nix::sys::socket::SockaddrStorage;

/// A 48-bit Ethernet MAC address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// Whether all six bytes are zero (`lo`, and interfaces without a hardware address).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 6]
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", m[0], m[1], m[2], m[3], m[4], m[5])
    }
}

impl FromStr for MacAddr {
    type Err = String;

    /// Parses `52:54:00:77:09:02`.
    fn from_str(s: &str) -> Result<MacAddr, String> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in out.iter_mut() {
            let p = parts.next().ok_or_else(|| format!("invalid MAC {s:?}"))?;
            if p.len() != 2 {
                return Err(format!("invalid MAC {s:?}"));
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| format!("invalid MAC {s:?}"))?;
        }
        if parts.next().is_some() {
            return Err(format!("invalid MAC {s:?}"));
        }
        Ok(MacAddr(out))
    }
}

/// The interface flags that matter to a RoCE port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfFlags {
    /// `IFF_UP`: administratively up (`ip link set up`).
    pub up: bool,
    /// `IFF_RUNNING`: operationally up (operstate UP or UNKNOWN).
    pub running: bool,
    /// `IFF_LOWER_UP`: the carrier is present.
    pub lower_up: bool,
    /// `IFF_LOOPBACK`: the loopback interface.
    pub loopback: bool,
}

/// One address of an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// The address.
    pub addr: IpAddr,
    /// Its prefix length (from the netmask).
    pub prefix_len: u8,
}

impl IfAddr {
    /// An address with a prefix length.
    pub fn new(addr: IpAddr, prefix_len: u8) -> IfAddr {
        IfAddr { addr, prefix_len }
    }
}

/// A snapshot of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Netdev {
    /// The interface index (`ifindex`).
    pub index: u32,
    /// The interface name (`eth0`).
    pub name: String,
    /// Up/running/carrier/loopback.
    pub flags: IfFlags,
    /// The MTU in bytes (layer 3).
    pub mtu: u32,
    /// The hardware address, if the interface has an Ethernet-sized one (`lo` has `00:…:00`).
    pub mac: Option<MacAddr>,
    /// IPv4 and IPv6 addresses, in the kernel's order within each family.
    pub addrs: Vec<IfAddr>,
    /// Link speed in Mb/s from sysfs, `None` when unknown (virtual interfaces, `lo`).
    pub speed_mbps: Option<u32>,
}

impl Netdev {
    /// The IPv4 addresses, in order.
    pub fn ipv4(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.addrs.iter().filter_map(|a| match a.addr {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
    }

    /// The IPv6 addresses, in order.
    pub fn ipv6(&self) -> impl Iterator<Item = Ipv6Addr> + '_ {
        self.addrs.iter().filter_map(|a| match a.addr {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => None,
        })
    }

    /// Whether `ip` is a local address of this interface. On a loopback interface every
    /// loopback address counts (127.0.0.0/8 is routed to `lo` although only 127.0.0.1 is
    /// configured), so two embedded devices can use 127.0.0.1 and 127.0.0.2.
    pub fn owns(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|a| a.addr == ip) || (self.flags.loopback && ip.is_loopback())
    }

    /// Whether the link is usable: administratively up with carrier. This is rxe's test
    /// (`netif_running() && netif_carrier_ok()`) for a port in state ACTIVE.
    pub fn is_link_up(&self) -> bool {
        self.flags.up && self.flags.lower_up
    }
}

/// Why a netdev could not be listed or found.
#[derive(Debug)]
#[non_exhaustive]
pub enum NetdevError {
    /// `getifaddrs` failed.
    List(io::Error),
    /// No interface has this name.
    NotFound(String),
    /// No interface has this local address.
    NoInterfaceForAddr(IpAddr),
    /// A sysfs attribute could not be read or parsed.
    Sysfs {
        /// The file.
        path: String,
        /// What went wrong.
        error: io::Error,
    },
}

impl fmt::Display for NetdevError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetdevError::List(e) => write!(f, "cannot list network interfaces: {e}"),
            NetdevError::NotFound(n) => write!(f, "network interface {n:?} not found"),
            NetdevError::NoInterfaceForAddr(ip) => {
                write!(f, "no network interface has the address {ip}")
            }
            NetdevError::Sysfs { path, error } => write!(f, "cannot read {path}: {error}"),
        }
    }
}

impl std::error::Error for NetdevError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NetdevError::List(e) | NetdevError::Sysfs { error: e, .. } => Some(e),
            _ => None,
        }
    }
}

/// All network interfaces of the host (of this network namespace), in ifindex order.
pub fn list() -> Result<Vec<Netdev>, NetdevError> {
    let ifaddrs = getifaddrs().map_err(|e| NetdevError::List(io::Error::from(e)))?;
    let mut devs: Vec<Netdev> = Vec::new();
    for ifa in ifaddrs {
        let pos = match devs.iter().position(|d| d.name == ifa.interface_name) {
            Some(p) => p,
            None => {
                devs.push(Netdev {
                    index: 0,
                    name: ifa.interface_name.clone(),
                    flags: IfFlags::default(),
                    mtu: 0,
                    mac: None,
                    addrs: Vec::new(),
                    speed_mbps: None,
                });
                devs.len() - 1
            }
        };
        let dev = &mut devs[pos];
        dev.flags = IfFlags {
            up: ifa.flags.contains(InterfaceFlags::IFF_UP),
            running: ifa.flags.contains(InterfaceFlags::IFF_RUNNING),
            lower_up: ifa.flags.contains(InterfaceFlags::IFF_LOWER_UP),
            loopback: ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
        };
        let Some(addr) = ifa.address.as_ref() else {
            continue;
        };
        if let Some(link) = addr.as_link_addr() {
            dev.index = u32::try_from(link.ifindex()).unwrap_or(0);
            if link.halen() == 6 {
                dev.mac = link.addr().map(MacAddr);
            }
        } else if let Some(ip) = ip_of(addr) {
            let prefix_len = ifa.netmask.as_ref().and_then(ip_of).map_or(0, prefix_of);
            dev.addrs.push(IfAddr::new(ip, prefix_len));
        }
    }
    // An interface removed between getifaddrs and here has no sysfs directory any more: drop it
    // rather than fail the whole listing.
    let sys = Path::new("/sys/class/net");
    if sys.is_dir() {
        devs.retain(|d| sys.join(&d.name).exists());
    }
    for dev in &mut devs {
        dev.mtu = read_sysfs_u32(&dev.name, "mtu")?;
        if dev.index == 0 {
            dev.index = read_sysfs_u32(&dev.name, "ifindex")?;
        }
        // `speed` is unreadable (EINVAL) or -1 for links without a known speed.
        dev.speed_mbps = read_sysfs_u32(&dev.name, "speed").ok().filter(|s| *s != 0 && *s != u32::MAX);
    }
    devs.sort_by_key(|d| d.index);
    Ok(devs)
}

/// The interface named `name`.
pub fn by_name(name: &str) -> Result<Netdev, NetdevError> {
    list()?.into_iter().find(|d| d.name == name).ok_or_else(|| NetdevError::NotFound(name.to_owned()))
}

/// The interface that owns the local address `ip` (see [`Netdev::owns`]).
pub fn by_addr(ip: IpAddr) -> Result<Netdev, NetdevError> {
    let devs = list()?;
    find_by_addr(&devs, ip).cloned().ok_or(NetdevError::NoInterfaceForAddr(ip))
}

/// The interface in `devs` that owns `ip`: an exact address match first, then (for loopback
/// addresses) the loopback interface.
pub fn find_by_addr(devs: &[Netdev], ip: IpAddr) -> Option<&Netdev> {
    devs.iter().find(|d| d.addrs.iter().any(|a| a.addr == ip)).or_else(|| devs.iter().find(|d| d.owns(ip)))
}

fn ip_of(sa: &SockaddrStorage) -> Option<IpAddr> {
    if let Some(v4) = sa.as_sockaddr_in() {
        Some(IpAddr::V4(v4.ip()))
    } else {
        sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
    }
}

fn prefix_of(mask: IpAddr) -> u8 {
    let ones = match mask {
        IpAddr::V4(m) => u32::from(m).count_ones(),
        IpAddr::V6(m) => u128::from(m).count_ones(),
    };
    u8::try_from(ones).unwrap_or(0)
}

fn read_sysfs_u32(ifname: &str, attr: &str) -> Result<u32, NetdevError> {
    let path = format!("/sys/class/net/{ifname}/{attr}");
    let text = fs::read_to_string(&path).map_err(|error| NetdevError::Sysfs { path: path.clone(), error })?;
    let t = text.trim();
    // `speed` is -1 when unknown; map it to u32::MAX so the caller can filter it.
    if t == "-1" {
        return Ok(u32::MAX);
    }
    t.parse().map_err(|_| NetdevError::Sysfs {
        path,
        error: io::Error::new(io::ErrorKind::InvalidData, format!("not a number: {t:?}")),
    })
}

/// The golden VM's eth0 (shared/golden/tool-output/00-setup.txt), for tests (feature `fixtures`
/// for other crates').
#[cfg(any(test, feature = "fixtures"))]
pub fn golden_eth0() -> Netdev {
    Netdev {
        index: 2,
        name: "eth0".into(),
        flags: IfFlags { up: true, running: true, lower_up: true, loopback: false },
        mtu: 1500,
        mac: Some(MacAddr([0x52, 0x54, 0x00, 0x77, 0x09, 0x02])),
        addrs: vec![
            IfAddr::new("10.77.9.2".parse().unwrap(), 24),
            IfAddr::new("fe80::5054:ff:fe77:902".parse().unwrap(), 64),
        ],
        speed_mbps: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_text_round_trip() {
        let m: MacAddr = "52:54:00:77:09:02".parse().unwrap();
        assert_eq!(m.0, [0x52, 0x54, 0, 0x77, 9, 2]);
        assert_eq!(m.to_string(), "52:54:00:77:09:02");
        assert!("52:54:00:77:09".parse::<MacAddr>().is_err());
        assert!("52:54:00:77:09:02:01".parse::<MacAddr>().is_err());
        assert!("52:54:00:77:09:zz".parse::<MacAddr>().is_err());
        assert!(MacAddr::default().is_zero());
    }

    #[test]
    fn prefix_from_netmask() {
        assert_eq!(prefix_of("255.255.255.0".parse().unwrap()), 24);
        assert_eq!(prefix_of("ffff:ffff:ffff:ffff::".parse().unwrap()), 64);
    }

    #[test]
    fn host_has_loopback() {
        // Every Linux network namespace has `lo`, up, with 127.0.0.1.
        let devs = list().unwrap();
        let lo = devs.iter().find(|d| d.flags.loopback).unwrap();
        assert!(lo.index >= 1);
        assert!(lo.mtu > 0);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(find_by_addr(&devs, ip).unwrap().name, lo.name);
        assert_eq!(by_addr("127.0.0.2".parse().unwrap()).unwrap().name, lo.name);
        assert_eq!(by_name(&lo.name).unwrap().index, lo.index);
        assert!(matches!(by_name("nosuch-if0"), Err(NetdevError::NotFound(_))));
        assert!(matches!(by_addr("192.0.2.254".parse().unwrap()), Err(NetdevError::NoInterfaceForAddr(_))));
    }
}
