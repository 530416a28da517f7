//! The control socket: `SOCK_SEQPACKET` over a Unix path, descriptors with `SCM_RIGHTS`, peer
//! credentials with `SO_PEERCRED`, and where the socket lives.
//!
//! `SOCK_SEQPACKET` rather than a stream: it is connection-oriented (the daemon sees the client
//! go away, crashed or not, as end-of-file, and gets its credentials), and it keeps record
//! boundaries, so a message and the descriptors sent with it arrive together in one `recvmsg`
//! with no framing code and no partial reads.

use std::ffi::OsString;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::msg::MAX_MSG;

/// Environment variable naming the daemon's socket.
pub const SOCKET_ENV: &str = "SOFTRDMA_SOCKET";
/// The system daemon's socket.
pub const SYSTEM_SOCKET: &str = "/run/softrdma/softrdmad.sock";
/// Most descriptors one message carries.
pub const MAX_FDS: usize = 4;

/// Where a daemon started by this user listens: `$SOFTRDMA_SOCKET`, else the system socket for
/// root, else `$XDG_RUNTIME_DIR/softrdma/softrdmad.sock` (`/run/user/UID/…` when unset).
pub fn listen_path() -> PathBuf {
    listen_path_with(|k| std::env::var_os(k), geteuid() == 0, geteuid())
}

/// [`listen_path`] with the environment supplied.
pub fn listen_path_with(env: impl Fn(&str) -> Option<OsString>, root: bool, uid: u32) -> PathBuf {
    if let Some(p) = env(SOCKET_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(p);
    }
    if root {
        return PathBuf::from(SYSTEM_SOCKET);
    }
    user_socket(&env, uid)
}

fn user_socket(env: &impl Fn(&str) -> Option<OsString>, uid: u32) -> PathBuf {
    let base = env("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()).map(PathBuf::from);
    base.unwrap_or_else(|| PathBuf::from(format!("/run/user/{uid}"))).join("softrdma").join("softrdmad.sock")
}

/// The sockets a client tries, in order: `$SOFTRDMA_SOCKET` alone if set; otherwise this user's
/// own daemon, then the system daemon.
pub fn client_paths() -> Vec<PathBuf> {
    client_paths_with(|k| std::env::var_os(k), geteuid())
}

/// [`client_paths`] with the environment supplied.
pub fn client_paths_with(env: impl Fn(&str) -> Option<OsString>, uid: u32) -> Vec<PathBuf> {
    if let Some(p) = env(SOCKET_ENV).filter(|v| !v.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut v = Vec::new();
    if uid != 0 {
        v.push(user_socket(&env, uid));
    }
    v.push(PathBuf::from(SYSTEM_SOCKET));
    v
}

/// The effective uid.
pub fn geteuid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Credentials of a connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: u32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= a.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket path too long"));
    }
    for (d, s) in a.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    Ok((a, len))
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening control socket.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
}

impl Listener {
    /// Bind and listen on `path` (an existing socket file there is replaced).
    pub fn bind(path: &Path) -> io::Result<Listener> {
        let fd = socket()?;
        let (a, len) = sockaddr(path)?;
        let _ = std::fs::remove_file(path);
        // SAFETY: `a` is a valid sockaddr_un of length `len`.
        cvt(unsafe { libc::bind(fd.as_raw_fd(), &a as *const _ as *const libc::sockaddr, len) })?;
        // SAFETY: plain listen(2).
        cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
        Ok(Listener { fd })
    }

    /// Accept one connection.
    pub fn accept(&self) -> io::Result<Conn> {
        loop {
            // SAFETY: accept4 without an address.
            let rc = unsafe {
                libc::accept4(self.fd.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
            };
            match cvt(rc) {
                // SAFETY: a new descriptor nothing else owns.
                Ok(fd) => return Ok(Conn { fd: unsafe { OwnedFd::from_raw_fd(fd) } }),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// One connection.
#[derive(Debug)]
pub struct Conn {
    fd: OwnedFd,
}

impl Conn {
    /// Connect to the daemon at `path`.
    pub fn connect(path: &Path) -> io::Result<Conn> {
        let fd = socket()?;
        let (a, len) = sockaddr(path)?;
        // SAFETY: `a` is a valid sockaddr_un of length `len`.
        cvt(unsafe { libc::connect(fd.as_raw_fd(), &a as *const _ as *const libc::sockaddr, len) })?;
        Ok(Conn { fd })
    }

    /// Wrap a connected socket (tests: a socketpair).
    pub fn from_fd(fd: OwnedFd) -> Conn {
        Conn { fd }
    }

    /// The peer's credentials.
    pub fn peer_cred(&self) -> io::Result<PeerCred> {
        let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `c`.
        cvt(unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut c as *mut _ as *mut libc::c_void,
                &mut len,
            )
        })?;
        Ok(PeerCred { pid: c.pid as u32, uid: c.uid, gid: c.gid })
    }

    /// Receive timeout (None: block).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        let tv = match t {
            Some(d) => {
                libc::timeval { tv_sec: d.as_secs() as libc::time_t, tv_usec: d.subsec_micros() as libc::suseconds_t }
            }
            None => libc::timeval { tv_sec: 0, tv_usec: 0 },
        };
        // SAFETY: setsockopt reads a timeval we own.
        cvt(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
        Ok(())
    }

    /// Send one message with descriptors.
    pub fn send(&self, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
        assert!(fds.len() <= MAX_FDS);
        let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
        let mut cbuf = [0u64; 8]; // CMSG_SPACE(4 * 4) fits in 64 bytes, u64 for alignment
                                  // SAFETY: msghdr is plain data; all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let bytes = std::mem::size_of_val(fds);
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            // SAFETY: CMSG_SPACE is a pure computation.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
            // SAFETY: msg_control points at a buffer of msg_controllen bytes (≤ 64), so the first
            // header and its data lie inside it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as usize;
                std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), bytes);
            }
        }
        loop {
            // SAFETY: `msg` points at live iovec and control buffers.
            let rc = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            match cvt(rc as libc::c_int) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Receive one message (at most [`MAX_MSG`] bytes) and the descriptors that came with it.
    /// End of file (the peer closed) is `Ok(None)`.
    pub fn recv(&self) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
        let mut buf = vec![0u8; MAX_MSG];
        let Some((n, fds)) = self.recv_into(&mut buf)? else { return Ok(None) };
        buf.truncate(n);
        Ok(Some((buf, fds)))
    }

    /// Receive one message into `buf` (a longer one is an error) and the descriptors that came
    /// with it; returns its length. End of file (the peer closed) is `Ok(None)`.
    pub fn recv_into(&self, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
        let mut cbuf = [MaybeUninit::<u64>::zeroed(); 16];
        // SAFETY: msghdr is plain data; all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = loop {
            // SAFETY: `msg` points at live buffers of the lengths given.
            let rc = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            match cvt(rc as libc::c_int) {
                Ok(n) => break n as usize,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        let mut fds = Vec::new();
        // SAFETY: walking the control messages the kernel wrote, within msg_controllen; each
        // SCM_RIGHTS payload is an array of descriptors now owned by us.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let count = ((*c).cmsg_len as usize - (data as usize - c as usize)) / size_of::<RawFd>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned((data as *const RawFd).add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 && fds.is_empty() {
            return Ok(None);
        }
        if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "message or descriptors truncated"));
        }
        Ok(Some((n, fds)))
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn messages_with_descriptors_and_credentials() {
        let dir = std::env::temp_dir().join(format!("softrdma-abi-sock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let l = Listener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let c = l.accept().unwrap();
            let cred = c.peer_cred().unwrap();
            assert_eq!(cred.pid, std::process::id());
            let (m, fds) = c.recv().unwrap().unwrap();
            assert_eq!(m, b"ping");
            let mut f = std::fs::File::from(fds.into_iter().next().unwrap());
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, "through the socket");
            c.send(b"pong", &[]).unwrap();
            assert!(c.recv().unwrap().is_none(), "EOF");
        });
        let c = Conn::connect(&path).unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        w.write_all(b"through the socket").unwrap();
        drop(w);
        c.send(b"ping", &[r.as_raw_fd()]).unwrap();
        drop(r);
        let (m, fds) = c.recv().unwrap().unwrap();
        assert_eq!(m, b"pong");
        assert!(fds.is_empty());
        drop(c);
        t.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn path_rules() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        assert_eq!(listen_path_with(env(&[("SOFTRDMA_SOCKET", "/tmp/x")]), true, 0), PathBuf::from("/tmp/x"));
        assert_eq!(listen_path_with(env(&[]), true, 0), PathBuf::from(SYSTEM_SOCKET));
        assert_eq!(
            listen_path_with(env(&[("XDG_RUNTIME_DIR", "/run/user/1000")]), false, 1000),
            PathBuf::from("/run/user/1000/softrdma/softrdmad.sock")
        );
        assert_eq!(
            client_paths_with(env(&[]), 1000),
            vec![PathBuf::from("/run/user/1000/softrdma/softrdmad.sock"), PathBuf::from(SYSTEM_SOCKET)]
        );
        assert_eq!(client_paths_with(env(&[]), 0), vec![PathBuf::from(SYSTEM_SOCKET)]);
    }
}
