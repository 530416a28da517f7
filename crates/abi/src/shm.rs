//! Shared memory for rings: sealed memfds.
//!
//! The daemon creates every shared region: `memfd_create`, `ftruncate` to the ring size, then the
//! seals `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`, so the application it passes the descriptor
//! to can neither shrink the file under the daemon's mapping (which would make the daemon's next
//! access a `SIGBUS`) nor grow it or lift the seals. Both sides map it `MAP_SHARED`.

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

impl Shm {
    /// A new sealed memfd of `len` bytes (zeroed), mapped.
    pub fn create(name: &str, len: usize) -> io::Result<Shm> {
        let cname = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid C string; the flags are valid.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
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
}
