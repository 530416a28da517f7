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
pub(crate) const UDP_NO_CHECK6_RX: libc::c_int = 102;
/// `UDP_SEGMENT` (GSO segment size, a cmsg on send) from linux/udp.h.
const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO` (socket option; cmsg with the segment size on receive) from linux/udp.h.
pub(crate) const UDP_GRO: libc::c_int = 104;

fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    setsockopt(fd, level, name, &value)
}

/// `setsockopt` with a value of any plain C type.
pub(crate) fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live, initialised T and we pass its exact size; the kernel only reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            value as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn bind(addr: SocketAddr, ifindex: u32) -> Result<UdpSocket> {
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
    // Receive a GSO send from a local peer in one piece (split again by `recv_batch`); kernels
    // without UDP_GRO hand the segments over one by one, which works too.
    let _ = setsockopt_int(fd, libc::SOL_UDP, UDP_GRO, 1);
    match addr {
        SocketAddr::V4(a) => {
            setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)
                .map_err(|e| Error::io("setting IP_MTU_DISCOVER", e))?;
            // Packets to a multicast group leave through the device's own interface.
            let ifaddr = libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) };
            if !a.ip().is_unspecified() {
                setsockopt(fd, libc::IPPROTO_IP, libc::IP_MULTICAST_IF, &ifaddr)
                    .map_err(|e| Error::io("setting IP_MULTICAST_IF", e))?;
            }
        }
        SocketAddr::V6(_) => {
            setsockopt_int(fd, libc::SOL_UDP, UDP_NO_CHECK6_RX, 1)
                .map_err(|e| Error::io("setting UDP_NO_CHECK6_RX", e))?;
            if ifindex != 0 {
                setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_IF, ifindex as libc::c_int)
                    .map_err(|e| Error::io("setting IPV6_MULTICAST_IF", e))?;
            }
        }
    }
    Ok(sock)
}

/// The UDP sockets of one device.
#[derive(Debug)]
pub struct UdpPort {
    v4: Option<(UdpSocket, SocketAddr)>,
    v6: Option<(UdpSocket, SocketAddr)>,
    port: u16,
    /// UDP GSO works here (cleared on the first refusal).
    gso: std::sync::atomic::AtomicBool,
}

impl UdpPort {
    /// Bind `port` on the given addresses (at least one) of the interface with index `ifindex`
    /// (multicast packets leave through it; 0: unknown).
    pub fn bind(v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>, port: u16, ifindex: u32) -> Result<UdpPort> {
        if v4.is_none() && v6.is_none() {
            return Err(Error::InvalidArgument("the device has no usable IPv4 or IPv6 address".into()));
        }
        let open = |ip: IpAddr| -> Result<(UdpSocket, SocketAddr)> {
            let addr = SocketAddr::new(ip, port);
            Ok((bind(addr, ifindex)?, addr))
        };
        let v4 = v4.map(|a| open(IpAddr::V4(a))).transpose()?;
        let v6 = v6.map(|a| open(IpAddr::V6(a))).transpose()?;
        let gso = std::sync::atomic::AtomicBool::new(std::env::var_os("SOFTRDMA_NO_GSO").is_none());
        Ok(UdpPort { v4, v6, port, gso })
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
        let (s, _) =
            s.ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "no socket for this address family"))?;
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

/// A socket address as the kernel reads and writes it: room for a `sockaddr_in6`, which also holds
/// a `sockaddr_in` (both 4-byte aligned). Smaller than `sockaddr_storage` (28 bytes instead of 128),
/// which matters for the arrays of a batch: they are cleared on every call.
type RawAddr = libc::sockaddr_in6;

pub(crate) fn sockaddr_of(addr: &SocketAddr) -> (RawAddr, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_in6 is a valid value of the type.
    let mut ss: RawAddr = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in6 is larger than sockaddr_in and has the same alignment (4).
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            ss = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn socket_addr_of(ss: &RawAddr) -> Option<SocketAddr> {
    match i32::from(ss.sin6_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in for AF_INET; it fits a sockaddr_in6 and has
            // the same alignment.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            let a = std::net::SocketAddrV6::new(
                Ipv6Addr::from(ss.sin6_addr.s6_addr),
                u16::from_be(ss.sin6_port),
                ss.sin6_flowinfo,
                ss.sin6_scope_id,
            );
            Some(SocketAddr::V6(a))
        }
        _ => None,
    }
}

/// Most segments in one GSO send (the kernel's `UDP_MAX_SEGMENTS` is 64 or more).
pub const GSO_MAX_SEGS: usize = 64;
/// Most bytes in one GSO send: the super-datagram must fit one IP packet.
pub const GSO_MAX_BYTES: usize = 65000;

/// Group datagrams for UDP GSO: runs to the same destination whose datagrams all have the size of
/// the first, except that the last may be shorter, within [`GSO_MAX_SEGS`] and [`GSO_MAX_BYTES`].
/// Writes `(start, end)` ranges into `out` and returns how many. Every datagram is in one group.
pub fn gso_groups(meta: &[(usize, SocketAddr)], out: &mut [(usize, usize)]) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < meta.len() && n < out.len() {
        let (seg, dst) = meta[i];
        let mut j = i + 1;
        let mut bytes = seg;
        while j < meta.len()
            && j - i < GSO_MAX_SEGS
            && meta[j].1 == dst
            && meta[j].0 <= seg
            && meta[j].0 > 0
            && bytes + meta[j].0 <= GSO_MAX_BYTES
        {
            bytes += meta[j].0;
            j += 1;
            if meta[j - 1].0 < seg {
                break;
            }
        }
        out[n] = (i, j);
        n += 1;
        i = j;
    }
    n
}

/// Most pieces of one datagram in [`UdpPort::send_batch`] (headers, two payload pieces, trailer).
pub const MAX_PARTS: usize = 4;

/// One datagram to send, in up to [`MAX_PARTS`] pieces the kernel gathers (`parts[..n]`).
#[derive(Debug, Clone, Copy)]
pub struct Datagram<'a> {
    /// The pieces, in order.
    pub parts: [&'a [u8]; MAX_PARTS],
    /// Pieces used.
    pub n: usize,
    /// Destination.
    pub dst: SocketAddr,
}

impl<'a> Datagram<'a> {
    /// A datagram in one piece.
    pub fn one(buf: &'a [u8], dst: SocketAddr) -> Datagram<'a> {
        Datagram { parts: [buf, &[], &[], &[]], n: 1, dst }
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.parts[..self.n].iter().map(|p| p.len()).sum()
    }

    /// No bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl UdpPort {
    /// Whether sends may use UDP GSO (`UDP_SEGMENT`).
    pub fn gso(&self) -> bool {
        self.gso.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Send up to [`BATCH`] datagrams with as few `sendmmsg` calls as the address families allow.
    /// `groups` (from [`gso_groups`], or one group per datagram) says which datagrams go out as one
    /// GSO send: the kernel cuts it into datagrams of the first one's size. A full socket buffer
    /// drops what did not fit, as [`UdpPort::send_to`] does; other refusals drop that message.
    /// Returns how many datagrams were refused. A datagram's pieces become consecutive iovec
    /// entries (a GSO send's iovec holds all its datagrams' pieces; the kernel cuts by length, not
    /// by entry).
    pub fn send_batch(&self, pkts: &[Datagram<'_>], groups: &[(usize, usize)]) -> usize {
        let mut errors = 0;
        let mut g0 = 0;
        while g0 < groups.len() {
            // One run of groups of the same family goes through one socket and one sendmmsg.
            let v4 = pkts[groups[g0].0].dst.is_ipv4();
            let g1 = g0 + groups[g0..].iter().take_while(|g| pkts[g.0].dst.is_ipv4() == v4).count();
            let run = &groups[g0..g1.min(g0 + BATCH)];
            g0 += run.len();
            if run.len() == 1 && run[0].1 - run[0].0 == 1 && pkts[run[0].0].n == 1 {
                // One datagram in one piece: a plain sendto, without setting up the batch arrays.
                let d = pkts[run[0].0];
                errors += usize::from(self.send_to(d.parts[0], d.dst).is_err());
                continue;
            }
            let s = if v4 { self.v4.as_ref() } else { self.v6.as_ref() };
            let Some((sock, _)) = s else {
                errors += run.iter().map(|g| g.1 - g.0).sum::<usize>();
                continue;
            };
            // SAFETY: all-zero values of these plain C structs are valid.
            let mut addrs: [RawAddr; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut iovs: [libc::iovec; BATCH * MAX_PARTS] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            let mut cmsgs = [[0u64; 4]; BATCH];
            let mut iov_at = 0;
            for (m, &(a, b)) in run.iter().enumerate() {
                let (ss, len) = sockaddr_of(&pkts[a].dst);
                addrs[m] = ss;
                let first = iov_at;
                for d in &pkts[a..b] {
                    for part in &d.parts[..d.n] {
                        iovs[iov_at] =
                            libc::iovec { iov_base: part.as_ptr() as *mut libc::c_void, iov_len: part.len() };
                        iov_at += 1;
                    }
                }
                let h = &mut msgs[m].msg_hdr;
                h.msg_name = &mut addrs[m] as *mut _ as *mut libc::c_void;
                h.msg_namelen = len;
                h.msg_iov = &mut iovs[first];
                h.msg_iovlen = iov_at - first;
                if b - a > 1 {
                    // SAFETY: the control buffer is 32 bytes, enough for CMSG_SPACE(2) (24 on
                    // 64-bit Linux), aligned for cmsghdr; CMSG_FIRSTHDR/CMSG_DATA stay inside it.
                    unsafe {
                        h.msg_control = cmsgs[m].as_mut_ptr() as *mut libc::c_void;
                        h.msg_controllen = libc::CMSG_SPACE(2) as usize;
                        let c = libc::CMSG_FIRSTHDR(h);
                        (*c).cmsg_level = libc::SOL_UDP;
                        (*c).cmsg_type = UDP_SEGMENT;
                        (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
                        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, pkts[a].len() as u16);
                    }
                }
            }
            let mut off = 0;
            while off < run.len() {
                // SAFETY: msgs[off..run.len()] point at live iovecs, addresses, control buffers
                // and datagrams (borrowed for this call); the kernel only reads them.
                let rc = unsafe {
                    libc::sendmmsg(sock.as_raw_fd(), msgs.as_mut_ptr().add(off), (run.len() - off) as libc::c_uint, 0)
                };
                if rc > 0 {
                    off += rc as usize;
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => {}
                    // Congested: the transport retransmits what was dropped.
                    io::ErrorKind::WouldBlock => {
                        errors += run[off..].iter().map(|g| g.1 - g.0).sum::<usize>();
                        break;
                    }
                    // Refused. A GSO send the kernel cannot do (no UDP_SEGMENT, a device without
                    // checksum offload) turns GSO off for good; the transport retransmits.
                    _ => {
                        let (a, b) = run[off];
                        if b - a > 1
                            && matches!(
                                e.raw_os_error(),
                                Some(libc::EINVAL | libc::EIO | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                            )
                        {
                            self.gso.store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                        errors += b - a;
                        off += 1;
                    }
                }
            }
        }
        errors
    }
}

/// One received datagram: its length, source, and the GSO segment size when the kernel handed over
/// several coalesced datagrams at once (`UDP_GRO`).
pub type RxMeta = Option<(usize, SocketAddr, Option<u16>)>;

/// The `UDP_GRO` segment size in a received control buffer.
fn gro_size(h: &libc::msghdr) -> Option<u16> {
    // SAFETY: the kernel filled `msg_control` with `msg_controllen` bytes of cmsgs; the CMSG_*
    // helpers stay within them.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                return u16::try_from(v).ok();
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

/// What a `recvmsg` reported: `None` for a truncated datagram or an unknown address family.
fn rx_meta(h: &libc::msghdr, len: usize, addr: &RawAddr) -> RxMeta {
    let truncated = h.msg_flags & libc::MSG_TRUNC != 0;
    match (truncated, socket_addr_of(addr)) {
        (false, Some(src)) => Some((len, src, gro_size(h))),
        _ => None,
    }
}

/// Receive one datagram from `sock` into the pieces `iov` describes, in order (the kernel fills
/// them as one stream). `WouldBlock` when nothing is waiting.
///
/// # Safety
///
/// Every entry of `iov` must describe writable memory that nothing else reads or writes during the
/// call.
pub unsafe fn recv_iov(sock: &UdpSocket, iov: &mut [libc::iovec]) -> io::Result<RxMeta> {
    // SAFETY: all-zero values of these plain C structs are valid.
    let (mut h, mut addr): (libc::msghdr, RawAddr) = unsafe { std::mem::zeroed() };
    let mut ctl = [0u64; 4];
    h.msg_name = &mut addr as *mut _ as *mut libc::c_void;
    h.msg_namelen = std::mem::size_of::<RawAddr>() as libc::socklen_t;
    h.msg_iov = iov.as_mut_ptr();
    h.msg_iovlen = iov.len();
    h.msg_control = ctl.as_mut_ptr() as *mut libc::c_void;
    h.msg_controllen = std::mem::size_of::<[u64; 4]>();
    // SAFETY: `h` points at a live address, control buffer (room for the UDP_GRO cmsg) and iovec
    // array; the memory the iovecs describe is the caller's promise.
    let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut h, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rx_meta(&h, rc as usize, &addr))
}

/// Look at the next datagram on `sock` without taking it: its first `head.len()` bytes go to
/// `head`; returns its length and its `UDP_GRO` segment size. `WouldBlock` when nothing is waiting.
pub fn peek(sock: &UdpSocket, head: &mut [u8]) -> io::Result<(usize, Option<u16>)> {
    // SAFETY: an all-zero msghdr is valid.
    let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
    let mut ctl = [0u64; 4];
    let mut iov = libc::iovec { iov_base: head.as_mut_ptr() as *mut libc::c_void, iov_len: head.len() };
    h.msg_iov = &mut iov;
    h.msg_iovlen = 1;
    h.msg_control = ctl.as_mut_ptr() as *mut libc::c_void;
    h.msg_controllen = std::mem::size_of::<[u64; 4]>();
    // SAFETY: `h` points at a live iovec over `head` and a control buffer; MSG_TRUNC makes the
    // kernel return the datagram's full length, MSG_PEEK leaves it queued.
    let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut h, libc::MSG_PEEK | libc::MSG_TRUNC) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((rc as usize, gro_size(&h)))
}

/// Receive up to `meta.len()` (at most [`BATCH`]) datagrams from `sock`: datagram `i` lands in
/// `buf[i * slot..]`, and `meta[i]` gets its length, source and GRO segment size, or `None` for one
/// that was truncated or came from an unknown address family. `WouldBlock` when nothing is waiting.
/// The first datagram comes with a plain `recvmsg` (an empty socket, the common case of a busy poll,
/// costs that one call); the rest with one `recvmmsg`.
pub fn recv_batch(sock: &UdpSocket, buf: &mut [u8], slot: usize, meta: &mut [RxMeta]) -> io::Result<usize> {
    let n = meta.len().min(BATCH).min(buf.len() / slot.max(1));
    if n == 0 {
        return Ok(0);
    }
    let base = buf.as_mut_ptr();
    let setup = |i: usize, iov: &mut libc::iovec, h: &mut libc::msghdr, addr: &mut RawAddr, ctl: &mut [u64; 4]| {
        // SAFETY: i * slot + slot <= buf.len() by the choice of n.
        *iov = libc::iovec { iov_base: unsafe { base.add(i * slot) } as *mut libc::c_void, iov_len: slot };
        h.msg_name = addr as *mut _ as *mut libc::c_void;
        h.msg_namelen = std::mem::size_of::<RawAddr>() as libc::socklen_t;
        h.msg_iov = iov;
        h.msg_iovlen = 1;
        h.msg_control = ctl.as_mut_ptr() as *mut libc::c_void;
        h.msg_controllen = std::mem::size_of::<[u64; 4]>();
    };
    // The first datagram: only what one recvmsg needs is set up (an empty busy poll ends here,
    // so it must not pay for clearing the batch's arrays).
    // SAFETY: all-zero values of these plain C structs are valid.
    let (mut iov0, mut h0, mut a0): (libc::iovec, libc::msghdr, RawAddr) = unsafe { std::mem::zeroed() };
    let mut c0 = [0u64; 4];
    setup(0, &mut iov0, &mut h0, &mut a0, &mut c0);
    // SAFETY: h0 points at a live iovec over buf[..slot], an address and a control buffer (32
    // bytes: room for the UDP_GRO cmsg, CMSG_SPACE(4) = 24).
    let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut h0, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    meta[0] = rx_meta(&h0, rc as usize, &a0);
    if n == 1 {
        return Ok(1);
    }
    // SAFETY: as above.
    let mut addrs: [RawAddr; BATCH] = unsafe { std::mem::zeroed() };
    let mut ctl = [[0u64; 4]; BATCH];
    // SAFETY: as above.
    let mut iovs: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    for i in 1..n {
        let (a, c) = (&mut addrs[i], &mut ctl[i]);
        setup(i, &mut iovs[i], &mut msgs[i].msg_hdr, a, c);
    }
    // SAFETY: every message points at a distinct `slot`-byte piece of `buf` and at its own address
    // and control buffers, all live for the call; the socket is non-blocking, so a null timeout
    // never waits.
    let rc = unsafe {
        libc::recvmmsg(sock.as_raw_fd(), msgs.as_mut_ptr().add(1), (n - 1) as libc::c_uint, 0, std::ptr::null_mut())
    };
    if rc <= 0 {
        return Ok(1);
    }
    let k = rc as usize;
    for i in 1..=k {
        meta[i] = rx_meta(&msgs[i].msg_hdr, msgs[i].msg_len as usize, &addrs[i]);
    }
    Ok(k + 1)
}
