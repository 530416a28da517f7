//! The server end of the TCP connection over which `perf` and `pingpong` exchange their QPs'
//! addresses before the test (as perftest and rdma-core's pingpongs do): it accepts clients that
//! connect over IPv4 or IPv6.

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A listener on TCP `port` of every local address: one IPv6 socket that also takes IPv4 clients
/// (`IPV6_V6ONLY` off, whatever the host's default), or, where that cannot be had (no IPv6, a
/// policy against it, the port held by an IPv6-only socket), an IPv4 one as before.
pub fn listen(port: u16) -> Result<TcpListener, String> {
    dual_stack(port)
        .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
        .map_err(|e| format!("Couldn't listen to port {port}: {e}"))
}

fn dual_stack(port: u16) -> io::Result<TcpListener> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let set = |level, name, value: libc::c_int| {
        // SAFETY: a live int of the size given, on our own socket.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    set(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    // As std's listeners: a port in TIME_WAIT from the last run can be listened on again.
    set(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    // SAFETY: an all-zero sockaddr_in6 is the unspecified address, port 0.
    let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    addr.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    addr.sin6_port = port.to_be();
    let len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    // SAFETY: `addr` is a live sockaddr_in6 of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_in6).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) on our own bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    #[test]
    fn clients_connect_over_ipv4_and_ipv6() {
        let l = listen(0).unwrap();
        let port = l.local_addr().unwrap().port();
        for host in ["127.0.0.1", "::1"] {
            let mut c = TcpStream::connect((host, port)).unwrap();
            let (mut s, from) = l.accept().unwrap();
            c.write_all(b"hi").unwrap();
            let mut b = [0u8; 2];
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"hi", "{host} (accepted from {from})");
        }
    }
}
