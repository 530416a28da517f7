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

use crate::placements::{placements_bytes, Placements};
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

/// Map `len` bytes of `fd` shared; `populate`: fault every page in now (`MAP_POPULATE`).
fn map(fd: &OwnedFd, len: usize, populate: bool) -> io::Result<*mut u8> {
    let flags = if populate { libc::MAP_SHARED | libc::MAP_POPULATE } else { libc::MAP_SHARED };
    // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as *mut u8)
}

/// A new memfd (close-on-exec) of `len` bytes, zeroed, sealed with
/// `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`.
pub fn sealed_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    memfd(name, len, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
}

/// A new memfd of `len` bytes (zeroed) for a memory region a client shares with softrdmad:
/// sealed against shrinking and growing, but not with `F_SEAL_SEAL`, so that the daemon can add
/// `F_SEAL_FUTURE_WRITE` once it has mapped it (see [`RegionMap::open_client`]).
pub fn region_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    memfd(name, len, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
}

/// A new memfd of `len` bytes (zeroed) with `seals`.
fn memfd(name: &str, len: usize, seals: libc::c_int) -> io::Result<OwnedFd> {
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
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0
        || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

impl Shm {
    /// A new sealed memfd of `len` bytes (zeroed), mapped. Its pages come to be on first touch.
    pub fn create(name: &str, len: usize) -> io::Result<Shm> {
        Shm::create_with(name, len, false)
    }

    /// [`Shm::create`] with every page allocated and mapped now (`MAP_POPULATE`), for a ring
    /// whose first lap carries latency-sensitive traffic: a same-host lane (2.3 MiB) faulted in
    /// slot by slot made both sides take a page fault per slot for its first lap, which on a VM
    /// cost the first 9-17 ms of a ping-pong 15-100× their steady speed (docs/PERFORMANCE.md).
    pub fn create_populated(name: &str, len: usize) -> io::Result<Shm> {
        Shm::create_with(name, len, true)
    }

    fn create_with(name: &str, len: usize, populate: bool) -> io::Result<Shm> {
        let fd = sealed_memfd(name, len)?;
        let ptr = map(&fd, len, populate)?;
        Ok(Shm { fd, ptr, len })
    }

    /// Map a memfd received from the daemon, checking that it is at least `len` bytes long and
    /// sealed against shrinking.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<Shm> {
        Shm::open_with(fd, len, false)
    }

    /// [`Shm::open`] with every page mapped now (see [`Shm::create_populated`]).
    pub fn open_populated(fd: OwnedFd, len: usize) -> io::Result<Shm> {
        Shm::open_with(fd, len, true)
    }

    fn open_with(fd: OwnedFd, len: usize, populate: bool) -> io::Result<Shm> {
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
        let ptr = map(&fd, len, populate)?;
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
    /// A placement ring at byte `offset` of the mapping (kept alive by the caller as for
    /// [`Shm::ring`]).
    pub fn placements(&self, offset: usize, capacity: u32) -> io::Result<Placements> {
        let end = offset.checked_add(placements_bytes(capacity));
        if !capacity.is_power_of_two() || !offset.is_multiple_of(64) || end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "placement ring does not fit the shared memory"));
        }
        // SAFETY: as in `ring`: inside the page-aligned mapping, which outlives the view.
        Ok(unsafe { Placements::new(self.ptr.add(offset), capacity) })
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: unmapping the region mapped in `create`/`open`; no ring made from it outlives us.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// The page size the mappings are rounded to, and a shared region's client address is aligned to.
pub const PAGE: usize = 4096;

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
    /// Map the first `len` bytes (rounded up to pages) of `fd` read/write, shared.
    pub fn map(fd: &OwnedFd, len: usize) -> io::Result<RegionMap> {
        if len > isize::MAX as usize / 2 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let mapped = len.max(1).next_multiple_of(PAGE);
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(RegionMap { ptr: p as *mut u8, mapped })
    }

    /// Map a region's memfd that a client sent (the daemon's side), so that no access through the
    /// mapping can ever fault or allocate memory: refused unless
    /// - it is a memfd (a regular file on the kernel's internal tmpfs; hugetlbfs is refused too);
    /// - its seals include `F_SEAL_SHRINK` and `F_SEAL_GROW` (read *before* the size, which they
    ///   freeze: a client cannot shrink it between the check and the mapping);
    /// - it is at least `len` bytes long and mappable read/write;
    /// - the daemon can add `F_SEAL_FUTURE_WRITE` after mapping it (Linux 5.1 or later, and no
    ///   `F_SEAL_SEAL`): from then on nobody can punch holes into it (`fallocate`, `MADV_REMOVE`),
    ///   which would make the daemon's next access allocate a page, or fault under strict
    ///   accounting; the client's and the daemon's existing mappings stay writable;
    /// - it has no hole in its first `len` bytes: every page is allocated (the client pinned them),
    ///   so a sparse file cannot make the daemon allocate memory the client never paid for.
    ///
    /// The error says which check failed.
    pub fn open_client(fd: &OwnedFd, len: usize) -> io::Result<RegionMap> {
        let refuse = |why: String| Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        let raw = fd.as_raw_fd();
        // SAFETY: fstat into a zeroed struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(raw, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstatfs into a zeroed struct we own.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let fs_ok = unsafe { libc::fstatfs(raw, &mut fs) } == 0;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || !fs_ok || fs.f_type != libc::TMPFS_MAGIC {
            return refuse("the descriptor is not a memfd".into());
        }
        // SAFETY: F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return refuse("the memfd is not sealed with F_SEAL_SHRINK and F_SEAL_GROW".into());
        }
        // The size now, after the seals that freeze it.
        // SAFETY: as above.
        if unsafe { libc::fstat(raw, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size < 0 || (st.st_size as u64) < len as u64 {
            return refuse(format!("the memfd has {} bytes, fewer than the region's {len}", st.st_size));
        }
        let map = RegionMap::map(fd, len)
            .map_err(|e| io::Error::new(e.kind(), format!("the memfd cannot be mapped read/write: {e}")))?;
        // SAFETY: F_ADD_SEALS with an int argument on a descriptor we hold.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) } != 0 {
            let e = io::Error::last_os_error();
            return refuse(format!(
                "the memfd cannot be sealed with F_SEAL_FUTURE_WRITE (needs Linux 5.1; no F_SEAL_SEAL): {e}"
            ));
        }
        if len > 0 {
            // SAFETY: lseek on a descriptor we hold; SEEK_HOLE finds the first hole at or after 0
            // (the end of the file counts as one).
            let hole = unsafe { libc::lseek(raw, 0, libc::SEEK_HOLE) };
            if hole < 0 || (hole as u64) < len as u64 {
                return refuse(format!(
                    "the memfd has unallocated pages from byte {hole}: a region's pages must all be allocated (pinned)"
                ));
            }
        }
        Ok(map)
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

    /// Bytes of the mapping at `ptr` that have a page mapped now (its `Rss` in /proc/self/smaps).
    fn resident(ptr: *mut u8) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let at = ptr as usize;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((a, b)) = range.filter(|_| !line.ends_with(" kB")) {
                let (a, b) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16));
                inside = matches!((a, b), (Ok(a), Ok(b)) if (a..b).contains(&at));
            } else if let Some(kb) = line.strip_prefix("Rss:").filter(|_| inside) {
                return kb.trim().trim_end_matches(" kB").trim().parse::<usize>().unwrap() * 1024;
            }
        }
        panic!("mapping at {ptr:?} not in /proc/self/smaps");
    }

    /// A populated mapping has every page in place before it is touched, on the side that creates
    /// the memfd and on the side that opens it; a plain one has none.
    #[test]
    fn populated_mappings_have_their_pages_from_the_start() {
        let len = 64 * PAGE;
        let plain = Shm::create("test", len).unwrap();
        assert_eq!(resident(plain.ptr), 0);
        let made = Shm::create_populated("test", len).unwrap();
        assert_eq!(resident(made.ptr), len);
        let opened = Shm::open_populated(made.fd().try_clone().unwrap(), len).unwrap();
        assert_eq!(resident(opened.ptr), len);
        let opened_plain = Shm::open(made.fd().try_clone().unwrap(), len).unwrap();
        assert_eq!(resident(opened_plain.ptr), 0);
    }

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

    /// Touch every page of `map` (as a client's pinning does), so the file has no hole.
    fn fill(map: &RegionMap) {
        // SAFETY: the mapping covers `mapped_len` bytes.
        unsafe { std::ptr::write_bytes(map.as_ptr(), 0, map.mapped_len()) };
    }

    #[test]
    fn region_memfd_shared_and_checked() {
        // Pages never touched are holes: refused (a sparse file would make the daemon allocate).
        let fd = region_memfd("sparse", 8192).unwrap();
        let e = RegionMap::open_client(&fd, 8000).unwrap_err();
        assert!(e.to_string().contains("unallocated pages from byte 0"), "{e}");

        let fd = region_memfd("mr", 8192).unwrap();
        let client = RegionMap::map(&fd, 8000).unwrap();
        assert_eq!(client.mapped_len(), 8192);
        fill(&client);
        let daemon = RegionMap::open_client(&fd, 8000).unwrap();
        // Sealed against future writes now: nobody can punch a hole under the daemon's mapping.
        // SAFETY: fcntl and fallocate on our memfd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_FUTURE_WRITE, 0);
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: as above.
        assert_ne!(unsafe { libc::fallocate(fd.as_raw_fd(), punch, 0, 4096) }, 0, "hole punched");
        drop(fd);
        // SAFETY: both mappings cover 8192 bytes of the same file, and stay writable.
        unsafe {
            client.as_ptr().add(7999).write(0xa5);
            assert_eq!(daemon.as_ptr().add(7999).read(), 0xa5);
            daemon.as_ptr().write(0x5a);
            assert_eq!(client.as_ptr().read(), 0x5a);
        }

        let fd = region_memfd("short", 4096).unwrap();
        fill(&RegionMap::map(&fd, 4096).unwrap());
        let e = RegionMap::open_client(&fd, 4097).unwrap_err();
        assert!(e.to_string().contains("fewer than"), "{e}");

        // Sealed with F_SEAL_SEAL (as rings are): the daemon cannot add its seal.
        let fd = sealed_memfd("sealed", 4096).unwrap();
        fill(&RegionMap::map(&fd, 4096).unwrap());
        let e = RegionMap::open_client(&fd, 4096).unwrap_err();
        assert!(e.to_string().contains("F_SEAL_FUTURE_WRITE"), "{e}");

        // A hole in the middle: refused from there.
        let fd = region_memfd("hole", 3 * 4096).unwrap();
        let m = RegionMap::map(&fd, 3 * 4096).unwrap();
        fill(&m);
        // SAFETY: fallocate on our memfd (not yet sealed against it).
        assert_eq!(unsafe { libc::fallocate(fd.as_raw_fd(), punch, 4096, 4096) }, 0);
        let e = RegionMap::open_client(&fd, 3 * 4096).unwrap_err();
        assert!(e.to_string().contains("unallocated pages from byte 4096"), "{e}");

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
