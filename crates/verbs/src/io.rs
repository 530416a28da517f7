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

/// Datagrams per `sendmmsg`/`recvmmsg` call.
pub const BATCH: usize = 32;

fn sockaddr_of(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is a valid value of the type.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn socket_addr_of(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in for AF_INET.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel wrote a sockaddr_in6 for AF_INET6.
            let sin6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            let a = std::net::SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            );
            Some(SocketAddr::V6(a))
        }
        _ => None,
    }
}

impl UdpPort {
    /// Send up to [`BATCH`] datagrams with as few `sendmmsg` calls as the address families allow.
    /// A full socket buffer drops what did not fit, as [`UdpPort::send_to`] does; other refusals
    /// drop that one datagram. Returns how many were refused.
    pub fn send_batch(&self, pkts: &[(&[u8], SocketAddr)]) -> usize {
        let mut errors = 0;
        let mut start = 0;
        while start < pkts.len() {
            // One run of datagrams of the same family goes through one socket.
            let v4 = pkts[start].1.is_ipv4();
            let end = start + pkts[start..].iter().take_while(|(_, a)| a.is_ipv4() == v4).count();
            let run = &pkts[start..end.min(start + BATCH)];
            start += run.len();
            if run.len() == 1 {
                // One datagram: a plain sendto, without setting up the batch arrays.
                errors += usize::from(self.send_to(run[0].0, run[0].1).is_err());
                continue;
            }
            let s = if v4 { self.v4.as_ref() } else { self.v6.as_ref() };
            let Some((sock, _)) = s else {
                errors += run.len();
                continue;
            };
            // SAFETY: all-zero values of these plain C structs are valid.
            let mut addrs: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut iovs: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            for (i, (buf, dst)) in run.iter().enumerate() {
                let (ss, len) = sockaddr_of(dst);
                addrs[i] = ss;
                iovs[i] = libc::iovec { iov_base: buf.as_ptr() as *mut libc::c_void, iov_len: buf.len() };
                msgs[i].msg_hdr.msg_name = &mut addrs[i] as *mut _ as *mut libc::c_void;
                msgs[i].msg_hdr.msg_namelen = len;
                msgs[i].msg_hdr.msg_iov = &mut iovs[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
            }
            let mut off = 0;
            while off < run.len() {
                // SAFETY: msgs[off..run.len()] point at live iovecs, addresses and buffers (the
                // datagrams borrowed for this call); the kernel only reads them.
                let rc = unsafe {
                    libc::sendmmsg(sock.as_raw_fd(), msgs.as_mut_ptr().add(off), (run.len() - off) as libc::c_uint, 0)
                };
                if rc > 0 {
                    off += rc as usize;
                    continue;
                }
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => {}
                    // Congested: the transport retransmits what was dropped.
                    io::ErrorKind::WouldBlock => break,
                    // This datagram was refused (e.g. an ICMP error reported late); go on.
                    _ => {
                        errors += 1;
                        off += 1;
                    }
                }
            }
        }
        errors
    }
}

/// Receive up to `meta.len()` (at most [`BATCH`]) datagrams from `sock` with one `recvmmsg`: datagram
/// `i` lands in `buf[i * slot..]`, and `meta[i]` gets its length and source, or `None` for one that was
/// truncated or came from an unknown address family. `WouldBlock` when nothing is waiting.
pub fn recv_batch(sock: &UdpSocket, buf: &mut [u8], slot: usize, meta: &mut [Option<(usize, SocketAddr)>]) -> io::Result<usize> {
    let n = meta.len().min(BATCH).min(buf.len() / slot.max(1));
    if n == 0 {
        return Ok(0);
    }
    // An empty socket (the common case of a busy poll) costs one plain recvfrom; only when a datagram
    // is there do the batch arrays get set up for the rest.
    let (len, src) = sock.recv_from(&mut buf[..slot])?;
    meta[0] = Some((len, src));
    if n == 1 {
        return Ok(1);
    }
    let (buf, meta) = (&mut buf[slot..], &mut meta[1..]);
    let n = n - 1;
    // SAFETY: all-zero values of these plain C structs are valid.
    let mut addrs: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut iovs: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    let base = buf.as_mut_ptr();
    for i in 0..n {
        // SAFETY: i * slot + slot <= buf.len() by the choice of n.
        iovs[i] = libc::iovec { iov_base: unsafe { base.add(i * slot) } as *mut libc::c_void, iov_len: slot };
        msgs[i].msg_hdr.msg_name = &mut addrs[i] as *mut _ as *mut libc::c_void;
        msgs[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msgs[i].msg_hdr.msg_iov = &mut iovs[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    // SAFETY: every message points at a distinct `slot`-byte piece of `buf` and at its own address
    // buffer, all live for the call; the socket is non-blocking, so a null timeout never waits.
    let rc = unsafe { libc::recvmmsg(sock.as_raw_fd(), msgs.as_mut_ptr(), n as libc::c_uint, 0, std::ptr::null_mut()) };
    if rc < 0 {
        return Ok(1);
    }
    let k = rc as usize;
    for i in 0..k {
        let truncated = msgs[i].msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
        meta[i] = match (truncated, socket_addr_of(&addrs[i])) {
            (false, Some(src)) => Some((msgs[i].msg_len as usize, src)),
            _ => None,
        };
    }
    Ok(k + 1)
}
