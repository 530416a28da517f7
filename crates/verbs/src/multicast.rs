//! The device's multicast sockets: one UDP socket per group that a QP of the device is attached to
//! (`Hca::mcast_groups`), bound to the group's address and the device's RoCEv2 port, a member of
//! the group on the device's interface. The device's own sockets are bound to its unicast
//! addresses and never see a packet sent to a group; a packet read from one of these sockets is
//! handed to the engine as sent to that group (`Hca::handle_multicast`).
//!
//! A group's IP address is its MGID as an address: `::ffff:a.b.c.d` is the IPv4 group a.b.c.d,
//! anything else the IPv6 group itself (as rxe and the kernel's rdma_cm map them). Several devices
//! and processes of a host may be members of one group: each socket sets `SO_REUSEADDR` and gets
//! its own copy of every packet, and `IP_MULTICAST_ALL` is off so that a socket receives only its
//! own group's packets.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd};

use softrdma_device::Gid;

use crate::error::{Error, Result};
use crate::io::{setsockopt, UDP_GRO, UDP_NO_CHECK6_RX};

/// `IPV6_MULTICAST_ALL` from linux/in6.h (not in every libc crate version).
const IPV6_MULTICAST_ALL: libc::c_int = 29;

/// One group's socket.
#[derive(Debug)]
struct Member {
    mgid: [u8; 16],
    sock: UdpSocket,
    /// The group's address and the device's port: the local address of every packet received.
    local: SocketAddr,
}

/// The device's multicast sockets, one per group with a QP attached.
#[derive(Debug, Default)]
pub(crate) struct GroupSockets {
    members: Vec<Member>,
}

impl GroupSockets {
    /// Open a socket for `mgid` if none is open (the device joins the group through the
    /// interface that owns `local_ip`, its address of the group's family, with index `ifindex`).
    pub fn join(&mut self, mgid: [u8; 16], local_ip: Option<IpAddr>, ifindex: u32, port: u16) -> Result<()> {
        if self.members.iter().any(|m| m.mgid == mgid) {
            return Ok(());
        }
        let group = Gid(mgid).to_ip();
        let local = match group {
            // Interface- and link-local groups are bound with the interface as their scope.
            IpAddr::V6(g) if matches!(g.segments()[0] & 0xf, 1 | 2) => {
                SocketAddr::V6(std::net::SocketAddrV6::new(g, port, 0, ifindex))
            }
            _ => SocketAddr::new(group, port),
        };
        let sock = match (group, local_ip) {
            (IpAddr::V4(g), Some(IpAddr::V4(ifaddr))) => {
                let sock = open(local)?;
                let mreq = libc::ip_mreq {
                    imr_multiaddr: libc::in_addr { s_addr: u32::from_ne_bytes(g.octets()) },
                    imr_interface: libc::in_addr { s_addr: u32::from_ne_bytes(ifaddr.octets()) },
                };
                setsockopt(sock.as_raw_fd(), libc::IPPROTO_IP, libc::IP_ADD_MEMBERSHIP, &mreq)
                    .map_err(|e| Error::io("joining the IPv4 multicast group", e))?;
                sock
            }
            (IpAddr::V6(g), Some(IpAddr::V6(_))) => {
                let sock = open(local)?;
                let mreq = libc::ipv6_mreq {
                    ipv6mr_multiaddr: libc::in6_addr { s6_addr: g.octets() },
                    ipv6mr_interface: ifindex,
                };
                setsockopt(sock.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_ADD_MEMBERSHIP, &mreq)
                    .map_err(|e| Error::io("joining the IPv6 multicast group", e))?;
                sock
            }
            _ => {
                let family = if group.is_ipv4() { "IPv4" } else { "IPv6" };
                return Err(Error::InvalidArgument(format!(
                    "multicast group {group} is {family}, and the device has no {family} address"
                )));
            }
        };
        self.members.push(Member { mgid, sock, local });
        Ok(())
    }

    /// Close the sockets of groups that are not in `keep` (their last QP left).
    pub fn retain<'a>(&mut self, keep: impl Iterator<Item = &'a [u8; 16]>) {
        let keep: Vec<[u8; 16]> = keep.copied().collect();
        self.members.retain(|m| keep.contains(&m.mgid));
    }

    /// Each socket with the local address its packets are received at (the group's).
    pub fn sockets(&self) -> impl Iterator<Item = (&UdpSocket, SocketAddr)> + '_ {
        self.members.iter().map(|m| (&m.sock, m.local))
    }
}

/// The group address of a packet received at `local` (a group socket's local address), as a
/// GID, or `None` for a unicast address.
pub fn group_of(local: &SocketAddr) -> Option<[u8; 16]> {
    local.ip().is_multicast().then(|| Gid::from_ip(local.ip()).0)
}

/// A non-blocking UDP socket bound to the group address `local`, shared with other members.
fn open(local: SocketAddr) -> Result<UdpSocket> {
    let family = if local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2) call; the descriptor is owned by the UdpSocket made from it below.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::io("opening a multicast socket", io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let sock = unsafe { UdpSocket::from_raw_fd(fd) };
    let on: libc::c_int = 1;
    let off: libc::c_int = 0;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, &on).map_err(|e| Error::io("setting SO_REUSEADDR", e))?;
    // As the device's own sockets: room for bursts, and a GSO send of a local sender in one piece.
    let buffer: libc::c_int = 4 << 20;
    let _ = setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &buffer);
    let _ = setsockopt(fd, libc::SOL_UDP, UDP_GRO, &on);
    match local {
        SocketAddr::V4(_) => setsockopt(fd, libc::IPPROTO_IP, libc::IP_MULTICAST_ALL, &off),
        SocketAddr::V6(_) => setsockopt(fd, libc::IPPROTO_IPV6, IPV6_MULTICAST_ALL, &off)
            .and_then(|()| setsockopt(fd, libc::SOL_UDP, UDP_NO_CHECK6_RX, &on)),
    }
    .map_err(|e| Error::io("setting up a multicast socket", e))?;
    let (addr, len) = crate::io::sockaddr_of(&local);
    // SAFETY: `addr` is a live sockaddr of `len` bytes.
    if unsafe { libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(Error::io("binding a multicast socket", io::Error::last_os_error()));
    }
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_address_is_the_mgid_as_an_address() {
        let v4: SocketAddr = "239.1.2.3:4791".parse().unwrap();
        assert_eq!(group_of(&v4), Some([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3]));
        let v6: SocketAddr = "[ff01:0:2:c985::1]:4791".parse().unwrap();
        assert_eq!(group_of(&v6), Some([0xff, 1, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 1]));
        assert_eq!(group_of(&"127.0.0.1:4791".parse().unwrap()), None);
    }
}
