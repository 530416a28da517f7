//! GIDs, node GUIDs and the per-port GID table.
//!
//! This module owns three things:
//!
//! * [`Guid`]: the 64-bit node/port GUID, derived from the netdev's MAC address the way the
//!   kernel's rxe does it (modified EUI-64, `addrconf_addr_eui48`), with a documented fallback for
//!   interfaces that have no usable MAC (loopback).
//! * [`Gid`]: a 128-bit GID with the two text forms rdma-core prints: the `inet_ntop` form
//!   (`::ffff:10.77.9.2`, used by `ibv_devinfo` for RoCE v2 entries and by `ibv_rc_pingpong`) and
//!   the full form (`fe80:0000:0000:0000:5054:00ff:fe77:0902`, used by sysfs, `ibstatus` and by
//!   `ibv_devinfo` for RoCE v1 entries).
//! * [`GidTable`]: the table of a port, built from a netdev's addresses.
//!
//! # How the table is built (and why)
//!
//! The kernel's rxe port, as captured in `shared/golden/tool-output/08-gids.txt`,
//! `04-ibv_devinfo-v-rxe0.txt` and `40-lo-setup.txt`, has:
//!
//! | index | GID | where it comes from |
//! | --- | --- | --- |
//! | 0 | `fe80::5054:ff:fe77:902` | the *default GID*: `fe80::/64` + the EUI-64 of the MAC (ib_core `make_default_gid`) |
//! | 1 | `::ffff:10.77.9.2` | each IPv4 address, IPv4-mapped, in the interface's order |
//! | 2… | e.g. `::1` on `lo` | each IPv6 address, in the interface's order, skipping duplicates |
//!
//! ib_core adds IPv4 addresses before IPv6 ones (`enum_netdev_ipv4_ips` then
//! `enum_netdev_ipv6_ips`), and `__ib_cache_gid_add` drops an entry equal to one already present,
//! which is why eth0's link-local `fe80::5054:ff:fe77:902` shows up once (it equals the default
//! GID). On `lo` the default GID (`fe80::200:ff:fe00:0`, from the all-zero MAC) is followed by
//! `::ffff:127.0.0.1` and `::1`.
//!
//! **Only RoCE v2 entries.** rxe's port advertises only `RDMA_CORE_PORT_IBA_ROCE_UDP_ENCAP`, so
//! ib_core creates one RoCE v2 entry per address and no RoCE v1 entries; the golden output shows
//! exactly that. RoCE v1 (raw Ethernet frames, ethertype 0x8915) needs an Ethernet link layer and
//! raw sockets, so it is never possible on loopback and not implemented by the UDP datapath.
//! [`GidTableOptions::roce_v1`] builds the layout a dual-mode HCA (e.g. mlx5) shows, one v1 entry
//! followed by one v2 entry per GID, for the day a v1 datapath exists; it is off by default and is
//! ignored for loopback interfaces and interfaces without a MAC.
//!
//! **Bound to one address.** A device bound to one IP address (see [`crate::registry`]) gets the
//! default GID at index 0 and only that address after it, so that index 1 is that address on both
//! IPv4 and IPv6 devices, as on an rxe device whose interface has one address.
//!
//! # Loopback GUID
//!
//! rxe takes the GUID from the MAC. `lo` has the all-zero MAC, so every rxe device on `lo` gets
//! GUID `0200:00ff:fe00:0000` (golden `40-lo-setup.txt`), and two devices on `lo` (e.g. one on
//! 127.0.0.1 and one on 127.0.0.2, how two embedded processes talk on one host) would have equal
//! GUIDs and equal default GIDs. For an interface without a usable MAC (none, or all zero) we
//! instead synthesise a locally administered unicast MAC from the 64-bit FNV-1a hash of the
//! *device* name (`02:xx:xx:xx:xx:xx` with the low bits from the hash) and take the EUI-64 of
//! that. The GUID is stable (same device name, same GUID, on every host and run) and differs
//! between devices. It shows as `0xxx:xxff:fexx:xxxx` with the universal/local bit clear.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::netdev::{MacAddr, Netdev};

/// Number of entries a port's GID table can hold (rxe `RXE_PORT_GID_TBL_LEN`).
pub const GID_TABLE_LEN: usize = 1024;

/// A 64-bit GUID (node GUID, system image GUID, port GUID).
///
/// `Display` prints the `ibv_devinfo` form `5054:00ff:fe77:0902`; [`Guid::hex`] gives the
/// `ibv_devices` form `505400fffe770902`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Guid(pub u64);

impl Guid {
    /// The modified EUI-64 of a MAC address, as the kernel's `addrconf_addr_eui48` computes it:
    /// `ff:fe` in the middle and the universal/local bit flipped.
    /// `52:54:00:77:09:02` becomes `5054:00ff:fe77:0902`.
    pub fn from_mac(mac: MacAddr) -> Guid {
        let m = mac.0;
        Guid(u64::from_be_bytes([m[0] ^ 0x02, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]))
    }

    /// The GUID of the device named `device_name` on an interface with MAC `mac`.
    ///
    /// A real MAC gives [`Guid::from_mac`], as rxe does. Without a usable MAC (`None` or all
    /// zero, e.g. `lo`) the GUID comes from [`synthetic_mac`] (see the module docs).
    pub fn for_device(device_name: &str, mac: Option<MacAddr>) -> Guid {
        match mac {
            Some(m) if !m.is_zero() => Guid::from_mac(m),
            _ => Guid::from_mac(synthetic_mac(device_name)),
        }
    }

    /// The 16 hex digits `ibv_devices` prints (`505400fffe770902`).
    pub fn hex(self) -> String {
        format!("{:016x}", self.0)
    }

    /// The GUID's eight bytes in network order.
    pub fn to_bytes(self) -> [u8; 8] {
        self.0.to_be_bytes()
    }
}

impl fmt::Display for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.0;
        write!(f, "{:04x}:{:04x}:{:04x}:{:04x}", (g >> 48) & 0xffff, (g >> 32) & 0xffff, (g >> 16) & 0xffff, g & 0xffff)
    }
}

/// A stable, locally administered unicast MAC for a device whose interface has none.
///
/// FNV-1a (64 bit) over `softrdma:` followed by the device name; the first byte gets the
/// locally-administered bit set and the multicast bit cleared.
pub fn synthetic_mac(device_name: &str) -> MacAddr {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"softrdma:".iter().chain(device_name.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let b = h.to_be_bytes();
    MacAddr([(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]])
}

/// A 128-bit GID, stored in network byte order.
///
/// `Display` prints the `inet_ntop(AF_INET6)` form rdma-core uses for RoCE v2 GIDs
/// (`fe80::5054:ff:fe77:902`, `::ffff:10.77.9.2`); [`Gid::full`] prints all eight groups
/// (`fe80:0000:0000:0000:5054:00ff:fe77:0902`). `FromStr` accepts any IPv6 text (both forms
/// above) and plain IPv4 (`10.77.9.2`, taken as IPv4-mapped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID (an unused table slot).
    pub const ZERO: Gid = Gid([0; 16]);

    /// The GID of an IP address: IPv4 addresses are IPv4-mapped (`::ffff:a.b.c.d`), as RoCE v2
    /// requires; IPv6 addresses are used as they are.
    pub fn from_ip(ip: IpAddr) -> Gid {
        match ip {
            IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }

    /// The link-local GID `fe80::/64` + `guid`: the default GID at index 0.
    pub fn link_local(guid: Guid) -> Gid {
        let mut raw = [0u8; 16];
        raw[0] = 0xfe;
        raw[1] = 0x80;
        raw[8..].copy_from_slice(&guid.to_bytes());
        Gid(raw)
    }

    /// The 16 bytes in network order.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Whether all 16 bytes are zero.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// Whether the interface-id half (bytes 8..16) is zero; `ibv_devinfo` skips such entries
    /// when listing GIDs (its `null_gid`).
    pub fn is_null_interface_id(&self) -> bool {
        self.0[8..] == [0; 8]
    }

    /// The IP address a RoCE v2 packet with this GID carries: IPv4 for IPv4-mapped GIDs, IPv6
    /// otherwise.
    pub fn to_ip(&self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// A `Display` adapter printing all eight groups with four digits each.
    pub fn full(&self) -> GidFull<'_> {
        GidFull(self)
    }
}

impl From<IpAddr> for Gid {
    fn from(ip: IpAddr) -> Gid {
        Gid::from_ip(ip)
    }
}

impl fmt::Display for Gid {
    /// `inet_ntop(AF_INET6)` exactly as glibc writes it, including its rule for embedded IPv4
    /// (`::ffff:a.b.c.d` and the deprecated IPv4-compatible `::a.b.c.d`), which differs from
    /// `std::net::Ipv6Addr`'s `Display` for the latter.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut words = [0u16; 8];
        for (i, w) in words.iter_mut().enumerate() {
            *w = u16::from_be_bytes([self.0[2 * i], self.0[2 * i + 1]]);
        }
        // Longest run of zero words (first one on ties), used only if at least two long.
        let (mut best_base, mut best_len) = (None::<usize>, 0usize);
        let mut i = 0;
        while i < 8 {
            if words[i] == 0 {
                let start = i;
                while i < 8 && words[i] == 0 {
                    i += 1;
                }
                if i - start > best_len {
                    best_base = Some(start);
                    best_len = i - start;
                }
            } else {
                i += 1;
            }
        }
        if best_len < 2 {
            best_base = None;
        }
        let mut out = String::with_capacity(46);
        for (i, word) in words.iter().enumerate() {
            if let Some(base) = best_base {
                if i >= base && i < base + best_len {
                    if i == base {
                        out.push(':');
                    }
                    continue;
                }
            }
            if i != 0 {
                out.push(':');
            }
            if i == 6 && best_base == Some(0) && (best_len == 6 || (best_len == 5 && words[5] == 0xffff)) {
                let v4 = Ipv4Addr::new(self.0[12], self.0[13], self.0[14], self.0[15]);
                out.push_str(&v4.to_string());
                return f.pad(&out);
            }
            out.push_str(&format!("{word:x}"));
        }
        if let Some(base) = best_base {
            if base + best_len == 8 {
                out.push(':');
            }
        }
        f.pad(&out)
    }
}

/// `Display` adapter for the full GID form; see [`Gid::full`].
#[derive(Clone, Copy, Debug)]
pub struct GidFull<'a>(&'a Gid);

impl fmt::Display for GidFull<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0 .0;
        let mut out = String::with_capacity(39);
        for i in 0..8 {
            if i != 0 {
                out.push(':');
            }
            out.push_str(&format!("{:02x}{:02x}", b[2 * i], b[2 * i + 1]));
        }
        f.pad(&out)
    }
}

/// Error parsing a GID from text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseGidError(String);

impl fmt::Display for ParseGidError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid GID {:?}: expected IPv6 text (fe80::1, ::ffff:10.0.0.1) or an IPv4 address", self.0)
    }
}

impl std::error::Error for ParseGidError {}

impl FromStr for Gid {
    type Err = ParseGidError;

    fn from_str(s: &str) -> Result<Gid, ParseGidError> {
        s.parse::<IpAddr>().map(Gid::from_ip).map_err(|_| ParseGidError(s.to_owned()))
    }
}

/// The type of a GID table entry (`ibv_gid_type_sysfs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidType {
    /// InfiniBand GID, or RoCE v1 on Ethernet (sysfs `IB/RoCE v1`).
    IbRoceV1,
    /// RoCE v2: the GID is an IP address, packets are UDP to port 4791 (sysfs `RoCE v2`).
    RoceV2,
}

impl GidType {
    /// The text in sysfs `gid_attrs/types/N` (`IB/RoCE v1`, `RoCE v2`).
    pub fn sysfs_name(self) -> &'static str {
        match self {
            GidType::IbRoceV1 => "IB/RoCE v1",
            GidType::RoceV2 => "RoCE v2",
        }
    }

    /// The text `ibv_devinfo -v` prints after a GID on an Ethernet port (`RoCE v1`, `RoCE v2`).
    pub fn devinfo_name(self) -> &'static str {
        match self {
            GidType::IbRoceV1 => "RoCE v1",
            GidType::RoceV2 => "RoCE v2",
        }
    }
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.sysfs_name())
    }
}

/// One valid entry of a GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
}

/// Choices for [`GidTable::build`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GidTableOptions {
    /// List only the default GID and this address (a device bound to one address).
    pub bind: Option<IpAddr>,
    /// Also add RoCE v1 entries (v1 then v2 for every GID) where v1 is possible: not on
    /// loopback, not without a MAC. Off by default, as on rxe.
    pub roce_v1: bool,
}

/// A GID index that names no entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadGidIndex {
    /// The index asked for.
    pub index: usize,
    /// How many entries the table has.
    pub len: usize,
}

impl fmt::Display for BadGidIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.len {
            0 => write!(f, "bad GID index {}: the GID table is empty", self.index),
            1 => write!(f, "bad GID index {}: the GID table has 1 entry (index 0)", self.index),
            n => write!(f, "bad GID index {}: the GID table has {} entries (indices 0..={})", self.index, n, n - 1),
        }
    }
}

impl std::error::Error for BadGidIndex {}

/// The GID table of one port: valid entries at indices `0..len()`, no holes.
///
/// The kernel's table has [`GID_TABLE_LEN`] slots, and that is what `gid_tbl_len` reports;
/// slots past [`GidTable::len`] are empty (zero GID), as in the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GidTable {
    entries: Vec<GidEntry>,
}

impl GidTable {
    /// Builds the table for `netdev` and node GUID `guid` the way rxe/ib_core does (see the
    /// module docs). A `bind` address that the interface does not have is still listed: checking
    /// that the address is local is the caller's job ([`crate::device::DeviceInfo::new`]).
    pub fn build(netdev: &Netdev, guid: Guid, opts: &GidTableOptions) -> GidTable {
        let v1_possible = !netdev.flags.loopback && netdev.mac.is_some_and(|m| !m.is_zero());
        let types: &[GidType] =
            if opts.roce_v1 && v1_possible { &[GidType::IbRoceV1, GidType::RoceV2] } else { &[GidType::RoceV2] };
        let mut gids = vec![Gid::link_local(guid)];
        match opts.bind {
            Some(ip) => gids.push(Gid::from_ip(ip)),
            None => {
                gids.extend(netdev.ipv4().map(|a| Gid::from_ip(IpAddr::V4(a))));
                gids.extend(netdev.ipv6().map(|a| Gid::from_ip(IpAddr::V6(a))));
            }
        }
        let mut table = GidTable::default();
        for gid in gids {
            for &gid_type in types {
                table.push(GidEntry { gid, gid_type });
            }
        }
        table
    }

    /// Builds a table from explicit entries (duplicates and entries past [`GID_TABLE_LEN`] are
    /// dropped, as the kernel does).
    pub fn from_entries(entries: impl IntoIterator<Item = GidEntry>) -> GidTable {
        let mut table = GidTable::default();
        for e in entries {
            table.push(e);
        }
        table
    }

    fn push(&mut self, entry: GidEntry) {
        if self.entries.len() < GID_TABLE_LEN && !self.entries.contains(&entry) {
            self.entries.push(entry);
        }
    }

    /// The number of valid entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table has no valid entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry at `index`, or an error naming the valid range.
    pub fn get(&self, index: usize) -> Result<&GidEntry, BadGidIndex> {
        self.entries.get(index).ok_or(BadGidIndex { index, len: self.entries.len() })
    }

    /// The index of `gid` with type `gid_type`, if present.
    pub fn find(&self, gid: &Gid, gid_type: GidType) -> Option<usize> {
        self.entries.iter().position(|e| e.gid == *gid && e.gid_type == gid_type)
    }

    /// `(index, entry)` for every valid entry, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &GidEntry)> {
        self.entries.iter().enumerate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netdev::{IfAddr, IfFlags};

    fn gid(s: &str) -> Gid {
        s.parse().unwrap()
    }

    #[test]
    fn guid_from_mac_is_eui64() {
        let g = Guid::from_mac(MacAddr([0x52, 0x54, 0x00, 0x77, 0x09, 0x02]));
        assert_eq!(g.to_string(), "5054:00ff:fe77:0902");
        assert_eq!(g.hex(), "505400fffe770902");
        // siw0's MAC from the golden setup, for a second vector.
        let g = Guid::from_mac(MacAddr([0xca, 0xbe, 0x60, 0xc4, 0xae, 0x32]));
        assert_eq!(g.hex(), "c8be60fffec4ae32");
        // The all-zero MAC of lo gives what rxe shows for rxelo's default GID.
        let g = Guid::from_mac(MacAddr([0; 6]));
        assert_eq!(Gid::link_local(g).full().to_string(), "fe80:0000:0000:0000:0200:00ff:fe00:0000");
    }

    #[test]
    fn loopback_guid_is_stable_and_per_device() {
        let a = Guid::for_device("rxe0", None);
        assert_eq!(a, Guid::for_device("rxe0", Some(MacAddr([0; 6]))));
        assert_eq!(a, Guid::for_device("rxe0", None));
        assert_ne!(a, Guid::for_device("rxe1", None));
        // Locally administered MAC -> universal/local bit of the EUI-64 clear, ff:fe inserted.
        let b = a.to_bytes();
        assert_eq!(b[0] & 0x03, 0);
        assert_eq!(&b[3..5], &[0xff, 0xfe]);
        let mac = MacAddr([0x52, 0x54, 0, 0x77, 9, 2]);
        assert_eq!(Guid::for_device("x", Some(mac)), Guid::from_mac(mac));
    }

    #[test]
    fn gid_text_forms_match_rdma_core() {
        let ll = Gid::link_local(Guid(0x5054_00ff_fe77_0902));
        assert_eq!(ll.to_string(), "fe80::5054:ff:fe77:902");
        assert_eq!(ll.full().to_string(), "fe80:0000:0000:0000:5054:00ff:fe77:0902");
        let v4 = Gid::from_ip("10.77.9.2".parse().unwrap());
        assert_eq!(v4.to_string(), "::ffff:10.77.9.2");
        assert_eq!(v4.full().to_string(), "0000:0000:0000:0000:0000:ffff:0a4d:0902");
        assert_eq!(Gid::ZERO.to_string(), "::");
        assert_eq!(gid("::1").to_string(), "::1");
        // glibc prints IPv4-compatible addresses dotted, unlike std.
        assert_eq!(gid("::10.0.0.1").to_string(), "::10.0.0.1");
        assert_eq!(gid("1:0:0:2:0:0:0:3").to_string(), "1:0:0:2::3");
        assert_eq!(gid("1:0:2:3:4:5:6:7").to_string(), "1:0:2:3:4:5:6:7");
        assert_eq!(gid("1::").to_string(), "1::");
        assert_eq!(gid("1:0:0:2:2:0:0:3").to_string(), "1::2:2:0:0:3");
        assert_eq!(format!("{:>8}", gid("::1")), "     ::1");
    }

    #[test]
    fn gid_parse_and_ip() {
        assert_eq!(gid("10.77.9.2"), gid("::ffff:10.77.9.2"));
        assert_eq!(gid("fe80:0000:0000:0000:5054:00ff:fe77:0902"), gid("fe80::5054:ff:fe77:902"));
        assert_eq!(gid("::ffff:127.0.0.1").to_ip(), "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(gid("::1").to_ip(), "::1".parse::<IpAddr>().unwrap());
        assert!("fe80::zz".parse::<Gid>().is_err());
        assert!("".parse::<Gid>().is_err());
        assert!(!Gid::from_ip("0.0.0.1".parse().unwrap()).is_null_interface_id());
        assert!(gid("fe80::").is_null_interface_id());
    }

    fn lo() -> Netdev {
        Netdev {
            index: 1,
            name: "lo".into(),
            flags: IfFlags { up: true, running: true, lower_up: true, loopback: true },
            mtu: 65536,
            mac: Some(MacAddr([0; 6])),
            addrs: vec![IfAddr::new("127.0.0.1".parse().unwrap(), 8), IfAddr::new("::1".parse().unwrap(), 128)],
            speed_mbps: None,
        }
    }

    fn listed(t: &GidTable) -> Vec<String> {
        t.iter().map(|(i, e)| format!("{i} {} {}", e.gid.full(), e.gid_type)).collect()
    }

    #[test]
    fn table_matches_golden_rxe0_on_eth0() {
        // golden tool-output/08-gids.txt
        let nd = crate::netdev::golden_eth0();
        let guid = Guid::for_device("rxe0", nd.mac);
        let t = GidTable::build(&nd, guid, &GidTableOptions::default());
        assert_eq!(
            listed(&t),
            ["0 fe80:0000:0000:0000:5054:00ff:fe77:0902 RoCE v2", "1 0000:0000:0000:0000:0000:ffff:0a4d:0902 RoCE v2",]
        );
        assert_eq!(t.get(2), Err(BadGidIndex { index: 2, len: 2 }));
        assert_eq!(t.get(7).unwrap_err().to_string(), "bad GID index 7: the GID table has 2 entries (indices 0..=1)");
        assert_eq!(t.find(&gid("10.77.9.2"), GidType::RoceV2), Some(1));
        assert_eq!(t.find(&gid("10.77.9.2"), GidType::IbRoceV1), None);
    }

    #[test]
    fn table_matches_golden_rxelo_except_guid() {
        // golden tool-output/40-lo-setup.txt: default GID, ::ffff:127.0.0.1, ::1. Index 0 uses our
        // synthetic GUID instead of rxe's 0200:00ff:fe00:0000 (see module docs).
        let nd = lo();
        let guid = Guid::for_device("rxelo", nd.mac);
        let t = GidTable::build(&nd, guid, &GidTableOptions::default());
        assert_eq!(t.len(), 3);
        assert_eq!(t.get(0).unwrap().gid, Gid::link_local(guid));
        assert_eq!(t.get(1).unwrap().gid.full().to_string(), "0000:0000:0000:0000:0000:ffff:7f00:0001");
        assert_eq!(t.get(2).unwrap().gid.full().to_string(), "0000:0000:0000:0000:0000:0000:0000:0001");
        // v1 is never possible on loopback.
        let opts = GidTableOptions { roce_v1: true, ..Default::default() };
        assert_eq!(GidTable::build(&nd, guid, &opts).len(), 3);
    }

    #[test]
    fn table_bound_and_v1_layouts() {
        let nd = lo();
        let guid = Guid::for_device("rxe1", nd.mac);
        let opts = GidTableOptions { bind: Some("127.0.0.2".parse().unwrap()), roce_v1: false };
        let t = GidTable::build(&nd, guid, &opts);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(1).unwrap().gid.to_string(), "::ffff:127.0.0.2");

        let nd = crate::netdev::golden_eth0();
        let opts = GidTableOptions { bind: None, roce_v1: true };
        let t = GidTable::build(&nd, Guid::for_device("rxe0", nd.mac), &opts);
        let types: Vec<_> = t.iter().map(|(_, e)| e.gid_type).collect();
        assert_eq!(types, [GidType::IbRoceV1, GidType::RoceV2, GidType::IbRoceV1, GidType::RoceV2]);
    }

    #[test]
    fn table_is_capped_and_deduplicated() {
        let e = |i: u16| GidEntry {
            gid: Gid::from_ip(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, i))),
            gid_type: GidType::RoceV2,
        };
        let t = GidTable::from_entries((0..2000).map(e).chain([e(1)]));
        assert_eq!(t.len(), GID_TABLE_LEN);
        let t = GidTable::from_entries([e(1), e(1), e(2)]);
        assert_eq!(t.len(), 2);
        assert!(GidTable::default().is_empty());
        assert_eq!(GidTable::default().get(0).unwrap_err().to_string(), "bad GID index 0: the GID table is empty");
    }
}
