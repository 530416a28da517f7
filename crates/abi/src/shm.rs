//! Shared memory: sealed memfds, for rings ([`Shm`]) and for memory regions ([`RegionMap`]).
//!
//! The daemon creates every ring's memory: `memfd_create`, `ftruncate` to the ring size, then the
//! seals `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`, so the application it passes the descriptor
//! to can neither shrink the file under the daemon's mapping (which would make the daemon's next
//! access a `SIGBUS`) nor grow it or lift the seals. Both sides map it `MAP_SHARED`.
//!
//! A memory region allocated by `reg_mr` on a daemon device goes the other way: the *client*
//! creates and seals the memfd ([`sealed_memfd`]) and passes it with the registration; the daemon
//! accepts it only after [`RegionMap::open_client`] checked that it is a memfd sealed against
//! shrinking and growing and long enough, so its mapping can never lose pages under it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::ring::{ring_bytes, Ring};

/// A `MAP_SHARED` mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub struct Shm {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics or byte copies
// (see `ring`), and the pointer stays valid until drop.
unsafe impl Send for Shm {}
// SAFETY: as above.
unsafe impl Sync for Shm {}

fn map(fd: &OwnedFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as *mut u8)
}

/// A new memfd (close-on-exec) of `len` bytes, zeroed, sealed with
/// `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`.
pub fn sealed_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid C string; the flags are valid.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain syscalls on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

impl Shm {
    /// A new sealed memfd of `len` bytes (zeroed), mapped.
    pub fn create(name: &str, len: usize) -> io::Result<Shm> {
        let fd = sealed_memfd(name, len)?;
        let ptr = map(&fd, len)?;
        Ok(Shm { fd, ptr, len })
    }

    /// Map a memfd received from the daemon, checking that it is at least `len` bytes long and
    /// sealed against shrinking.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<Shm> {
        // SAFETY: fstat into a zeroed struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if (st.st_size as usize) < len || seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "shared ring memory of the wrong size or unsealed"));
        }
        let ptr = map(&fd, len)?;
        Ok(Shm { fd, ptr, len })
    }

    /// The descriptor (to pass to the peer).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A ring at byte `offset` of the mapping.
    ///
    /// The caller keeps the `Shm` alive as long as the ring: both live in one struct, the ring
    /// declared (and so dropped) first.
    pub fn ring(&self, offset: usize, capacity: u32, slot_size: u32) -> io::Result<Ring> {
        let end = offset.checked_add(ring_bytes(capacity, slot_size));
        if !capacity.is_power_of_two() || !offset.is_multiple_of(64) || end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "ring does not fit the shared memory"));
        }
        // SAFETY: the ring lies inside the mapping (checked above), which is page aligned, so the
        // ring base is 64-byte aligned; the mapping lives until `self` is dropped, and callers keep
        // `self` alive while they use the ring (see above).
        Ok(unsafe { Ring::new(self.ptr.add(offset), capacity, slot_size) })
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: unmapping the region mapped in `create`/`open`; no ring made from it outlives us.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

const PAGE: usize = 4096;

/// A read/write `MAP_SHARED` mapping of a memory region's memfd, owned by this value and unmapped
/// when it is dropped; the descriptor itself is not kept (one region, no open file).
///
/// The client maps the memfd it created ([`RegionMap::map`]); the daemon maps the one a client
/// sent only through [`RegionMap::open_client`], which refuses anything that could shrink.
#[derive(Debug)]
pub struct RegionMap {
    ptr: *mut u8,
    /// Mapped bytes: the region's length rounded up to whole pages (at least one).
    mapped: usize,
}

// SAFETY: the mapping is plain shared memory, valid until drop; who may touch it when is the
// owner's contract (the daemon: under its device lock; the client: through completions).
unsafe impl Send for RegionMap {}
// SAFETY: as above; `&RegionMap` gives only the address.
unsafe impl Sync for RegionMap {}

impl RegionMap {
    /// Map the first `len` bytes (rounded up to pages) of `fd` read/write, shared. With
    /// `populate`, the page tables are filled at once (`MAP_POPULATE`), so later accesses do
    /// not fault.
    pub fn map(fd: &OwnedFd, len: usize, populate: bool) -> io::Result<RegionMap> {
        if len > isize::MAX as usize / 2 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let mapped = len.max(1).next_multiple_of(PAGE);
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), mapped, libc::PROT_READ | libc::PROT_WRITE, flags, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(RegionMap { ptr: p as *mut u8, mapped })
    }

    /// Map a region's memfd that a client sent (the daemon's side): refused unless it is a memfd
    /// (a regular file on the kernel's internal tmpfs; hugetlbfs is refused too) whose seals
    /// include `F_SEAL_SHRINK` and `F_SEAL_GROW`, at least `len` bytes long, and mappable
    /// read/write. The error says which check failed.
    pub fn open_client(fd: &OwnedFd, len: usize) -> io::Result<RegionMap> {
        let refuse = |why: String| Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        // SAFETY: fstat into a zeroed struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstatfs into a zeroed struct we own.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let fs_ok = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } == 0;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || !fs_ok || fs.f_type != libc::TMPFS_MAGIC {
            return refuse("the descriptor is not a memfd".into());
        }
        // SAFETY: F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return refuse("the memfd is not sealed with F_SEAL_SHRINK and F_SEAL_GROW".into());
        }
        if st.st_size < 0 || (st.st_size as u64) < len as u64 {
            return refuse(format!("the memfd has {} bytes, fewer than the region's {len}", st.st_size));
        }
        RegionMap::map(fd, len, true)
            .map_err(|e| io::Error::new(e.kind(), format!("the memfd cannot be mapped read/write: {e}")))
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes mapped (whole pages).
    pub fn mapped_len(&self) -> usize {
        self.mapped
    }
}

impl Drop for RegionMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`; the owner guarantees no pointer into
        // it is used afterwards.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.mapped) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{Consumer, Producer};

    #[test]
    fn sealed_memfd_shared_by_two_mappings() {
        let a = Shm::create("test", 4096).unwrap();
        let dup = a.fd().try_clone().unwrap();
        // SAFETY: ftruncate on our own descriptor; must fail because of the seals.
        assert_ne!(unsafe { libc::ftruncate(dup.as_raw_fd(), 0) }, 0);
        let b = Shm::open(dup, 4096).unwrap();
        let ra = a.ring(0, 8, 64).unwrap();
        ra.init();
        let rb = b.ring(0, 8, 64).unwrap();
        assert!(rb.header_ok());
        let mut p = Producer::new(ra);
        let mut c = Consumer::new(rb);
        assert!(p.push(b"hello"));
        let mut out = [0u8; 64];
        assert!(c.pop(&mut out).unwrap());
        assert_eq!(&out[..5], b"hello");
        assert!(a.ring(0, 64, 64).is_err(), "does not fit");
        assert!(Shm::open(a.fd().try_clone().unwrap(), 8192).is_err(), "too short");
    }

    #[test]
    fn region_memfd_shared_and_checked() {
        let fd = sealed_memfd("mr", 8192).unwrap();
        let client = RegionMap::map(&fd, 8000, false).unwrap();
        assert_eq!(client.mapped_len(), 8192);
        let daemon = RegionMap::open_client(&fd, 8000).unwrap();
        drop(fd);
        // SAFETY: both mappings cover 8192 bytes of the same file.
        unsafe {
            client.as_ptr().add(7999).write(0xa5);
            assert_eq!(daemon.as_ptr().add(7999).read(), 0xa5);
            daemon.as_ptr().write(0x5a);
            assert_eq!(client.as_ptr().read(), 0x5a);
        }

        let fd = sealed_memfd("short", 4096).unwrap();
        let e = RegionMap::open_client(&fd, 4097).unwrap_err();
        assert!(e.to_string().contains("fewer than"), "{e}");

        // Unsealed: a memfd without seals.
        // SAFETY: valid C string and flags.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate of our memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let e = RegionMap::open_client(&fd, 4096).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        // Sealed against shrinking only.
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        assert!(RegionMap::open_client(&fd, 4096).unwrap_err().to_string().contains("not sealed"));

        // Not a memfd: a pipe, and a regular file.
        let (r, _w) = std::io::pipe().unwrap();
        let e = RegionMap::open_client(&OwnedFd::from(r), 1).unwrap_err();
        assert!(e.to_string().contains("not a memfd"), "{e}");
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(RegionMap::open_client(&OwnedFd::from(f), 1).is_err());
    }
}
