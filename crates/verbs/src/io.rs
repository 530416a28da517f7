//! The device's UDP endpoint: one socket per address family on the RoCEv2 port, set up so the
//! packets we send carry the IP header we computed the ICRC over, and the packets the kernel's rxe
//! sends are received.
//!
//! * IPv4: `IP_MTU_DISCOVER = IP_PMTUDISC_DO` on an unconnected socket makes Linux send DF with
//!   identification 0, the header [`softrdma_wire::roce::seal_udp_payload`] assumes.
//! * IPv6: rxe sends UDP checksum 0, which a default Linux UDPv6 socket drops; `UDP_NO_CHECK6_RX`
//!   accepts it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use crate::error::{Error, Result};

/// `UDP_NO_CHECK6_RX` from linux/udp.h.
const UDP_NO_CHECK6_RX: libc::c_int = 102;

fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: we pass a pointer to a live c_int and its size; the kernel only reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &value as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn bind(addr: SocketAddr) -> Result<UdpSocket> {
    let sock = UdpSocket::bind(addr).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => Error::PortInUse(addr),
        _ => Error::io("binding the device's UDP socket", e),
    })?;
    sock.set_nonblocking(true).map_err(|e| Error::io("setting O_NONBLOCK", e))?;
    let fd = sock.as_raw_fd();
    let sndbuf = 4 << 20;
    // Larger buffers absorb bursts of a window of MTU-sized packets; failure only costs speed.
    let _ = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, sndbuf);
    let _ = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, sndbuf);
    match addr {
        SocketAddr::V4(_) => setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)
            .map_err(|e| Error::io("setting IP_MTU_DISCOVER", e))?,
        SocketAddr::V6(_) => setsockopt_int(fd, libc::SOL_UDP, UDP_NO_CHECK6_RX, 1)
            .map_err(|e| Error::io("setting UDP_NO_CHECK6_RX", e))?,
    }
    Ok(sock)
}

/// The UDP sockets of one device.
#[derive(Debug)]
pub struct UdpPort {
    v4: Option<(UdpSocket, SocketAddr)>,
    v6: Option<(UdpSocket, SocketAddr)>,
    port: u16,
}

impl UdpPort {
    /// Bind `port` on the given addresses (at least one).
    pub fn bind(v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>, port: u16) -> Result<UdpPort> {
        if v4.is_none() && v6.is_none() {
            return Err(Error::InvalidArgument("the device has no usable IPv4 or IPv6 address".into()));
        }
        let open = |ip: IpAddr| -> Result<(UdpSocket, SocketAddr)> {
            let addr = SocketAddr::new(ip, port);
            Ok((bind(addr)?, addr))
        };
        let v4 = v4.map(|a| open(IpAddr::V4(a))).transpose()?;
        let v6 = v6.map(|a| open(IpAddr::V6(a))).transpose()?;
        Ok(UdpPort { v4, v6, port })
    }

    /// The UDP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The local socket address for sending to `dst`'s family.
    pub fn local_for(&self, dst: &SocketAddr) -> Option<SocketAddr> {
        let s = if dst.is_ipv4() { self.v4.as_ref() } else { self.v6.as_ref() };
        s.map(|(_, a)| *a)
    }

    /// Send one datagram. A full socket buffer drops it, as a congested link would: the transport
    /// retransmits.
    pub fn send_to(&self, buf: &[u8], dst: SocketAddr) -> io::Result<()> {
        let s = if dst.is_ipv4() { self.v4.as_ref() } else { self.v6.as_ref() };
        let (s, _) = s.ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "no socket for this address family"))?;
        match s.send_to(buf, dst) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The sockets with their local addresses, for polling and receiving.
    pub fn sockets(&self) -> impl Iterator<Item = &(UdpSocket, SocketAddr)> {
        self.v4.iter().chain(self.v6.iter())
    }
}
