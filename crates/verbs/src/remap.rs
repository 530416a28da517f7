//! Caller memory moved onto a memfd, so that softrdmad can map it: `ibv_reg_mr` of an unmodified
//! program names memory the program allocated (`malloc`, `posix_memalign`), which the daemon could
//! otherwise reach only with a `process_vm_readv`/`writev` system call per access (about 1 µs each;
//! three quarters of the device loop's time for perftest's small WRITEs).
//!
//! A region made of whole pages of private anonymous memory (the heap, an anonymous mapping) is
//! copied into a new memfd, which is then mapped over the same addresses (`MAP_FIXED`): the program
//! keeps its pointers and its data, and the pages are now shared with the daemon, as `reg_mr`'s own
//! regions are. Anything else (a part page, which may hold other data of the program; a file or
//! shared mapping; the stack) is left where it is.
//!
//! The copy and the new mapping are not one step: a write to the region by another thread between
//! them would be lost. Registering memory that other threads are writing is already a race in
//! verbs (the device may read either version), so the region's contents are taken as those of the
//! moment it is registered. While registered, a child created by `fork` shares the pages instead
//! of copying them. Deregistration moves them back ([`move_back`]): private anonymous pages again,
//! with the same contents, so that an allocator that later drops them (`MADV_DONTNEED`) gets the
//! zeroed pages it expects, which memfd pages would not be.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use softrdma_abi::shm::PAGE;

/// Whether `[ptr, ptr+len)` is whole pages of private anonymous read-write memory (per
/// `/proc/self/maps`).
pub(crate) fn movable(ptr: *const u8, len: usize) -> bool {
    let (start, end) = (ptr as usize, (ptr as usize).wrapping_add(len));
    if len == 0 || !start.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || end < start {
        return false;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    covered_by_anonymous(&maps, start, end)
}

/// Whether the mappings listed in `maps` (the format of `/proc/<pid>/maps`) cover `[start, end)`
/// without a gap, each private anonymous read-write memory.
fn covered_by_anonymous(maps: &str, start: usize, end: usize) -> bool {
    let mut at = start;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_offset), Some(_dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return false;
        };
        let name = f.next().unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else { return false };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { return false };
        if hi <= at || lo >= end {
            continue;
        }
        let anonymous = inode == "0" && (name.is_empty() || name == "[heap]");
        if lo > at || perms != "rw-p" || !anonymous {
            return false;
        }
        at = hi;
        if at >= end {
            return true;
        }
    }
    false
}

/// Move `[ptr, ptr+len)`, which [`movable`] accepted, onto `fd` (a memfd of `len` bytes): its
/// contents are copied into the memfd, which is then mapped read-write and shared at `ptr`.
///
/// # Safety
/// The range is memory of this process that nothing else maps or changes during the call (see the
/// module comment); after it, the same addresses hold the same bytes.
pub(crate) unsafe fn move_onto(fd: &OwnedFd, ptr: *mut u8, len: usize) -> io::Result<()> {
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new shared mapping of our memfd, `len` bytes long, at an address the kernel picks.
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if tmp == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both ranges are `len` bytes of readable/writable memory and do not overlap (`tmp` is
    // a new mapping).
    unsafe { std::ptr::copy_nonoverlapping(ptr, tmp.cast::<u8>(), len) };
    // SAFETY: replaces the caller's pages at `ptr` (the caller's contract) with the memfd, which
    // now holds the same bytes.
    let moved = unsafe { libc::mmap(ptr.cast(), len, rw, libc::MAP_SHARED | libc::MAP_FIXED, fd.as_raw_fd(), 0) };
    let err = io::Error::last_os_error();
    // SAFETY: unmaps only our temporary mapping.
    unsafe { libc::munmap(tmp, len) };
    if moved == libc::MAP_FAILED {
        return Err(err);
    }
    Ok(())
}

/// Move `[ptr, ptr+len)`, moved by [`move_onto`], back to private anonymous pages with the same
/// contents: they are copied into a new anonymous mapping, which then replaces the memfd's at
/// `ptr` (`mremap`, one step).
///
/// # Safety
/// As [`move_onto`]: memory of this process that nothing else changes during the call.
pub(crate) unsafe fn move_back(ptr: *mut u8, len: usize) -> io::Result<()> {
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new private anonymous mapping at an address the kernel picks.
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    if tmp == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both ranges are `len` bytes of readable/writable memory and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(ptr, tmp.cast::<u8>(), len) };
    // SAFETY: moves our new mapping over the caller's range (the caller's contract), replacing the
    // memfd pages there.
    let moved =
        unsafe { libc::mremap(tmp, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, ptr.cast::<libc::c_void>()) };
    if moved == libc::MAP_FAILED {
        let err = io::Error::last_os_error();
        // SAFETY: unmaps only our temporary mapping, which did not move.
        unsafe { libc::munmap(tmp, len) };
        return Err(err);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0a0000000-55d0a0021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000004000 rw-p 00000000 00:00 0 
7f0000004000-7f0000008000 rw-p 00000000 00:00 0 
7f0000008000-7f000000a000 r--p 00000000 00:00 0 
7f000000a000-7f000000c000 rw-s 00000000 00:01 1234                       /memfd:x (deleted)
7f000000c000-7f000000e000 rw-p 00001000 08:01 5678                       /usr/lib/libfoo.so
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
";

    #[test]
    fn only_private_anonymous_read_write_pages_without_a_gap_are_movable() {
        let ok = |lo: usize, hi: usize| covered_by_anonymous(MAPS, lo, hi);
        assert!(ok(0x55d0_a000_1000, 0x55d0_a000_3000), "inside the heap");
        assert!(ok(0x7f00_0000_2000, 0x7f00_0000_6000), "across two adjacent anonymous mappings");
        assert!(!ok(0x7f00_0000_6000, 0x7f00_0000_9000), "runs into a read-only mapping");
        assert!(!ok(0x7f00_0000_a000, 0x7f00_0000_b000), "a shared mapping");
        assert!(!ok(0x7f00_0000_c000, 0x7f00_0000_d000), "a file mapping");
        assert!(!ok(0x7ffc_0000_0000, 0x7ffc_0000_1000), "the stack");
        assert!(!ok(0x55d0_a002_0000, 0x55d0_a002_2000), "past the end of the heap");
        assert!(!ok(0x1000, 0x2000), "not mapped at all");
    }

    #[test]
    fn moved_memory_keeps_its_bytes_is_the_memfd_and_moves_back() {
        let len = 4 * PAGE;
        // SAFETY: a new private anonymous mapping of our own.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        }
        .cast::<u8>();
        assert_ne!(p.cast(), libc::MAP_FAILED);
        // SAFETY: `len` bytes of our mapping.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        assert!(movable(p, len));
        assert!(!movable(p.wrapping_add(1), PAGE), "not page-aligned");
        assert!(!movable(p, PAGE + 1), "a part page");
        let fd = softrdma_abi::shm::region_memfd("remap-test", len).unwrap();
        // SAFETY: our mapping, which nothing else touches.
        unsafe { move_onto(&fd, p, len) }.unwrap();
        // SAFETY: still `len` bytes mapped at `p`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i * 7 % 251) as u8), "contents kept");
        // The pages are the memfd's now: a write at `p` is read back through the descriptor.
        bytes[PAGE + 5] = 0xee;
        let mut got = [0u8; 1];
        // SAFETY: a one-byte read into our buffer.
        assert_eq!(unsafe { libc::pread(fd.as_raw_fd(), got.as_mut_ptr().cast(), 1, (PAGE + 5) as i64) }, 1);
        assert_eq!(got[0], 0xee);
        assert!(!movable(p, len), "shared now");
        // And back: private anonymous pages with the same bytes, the memfd no longer behind them.
        // SAFETY: our mapping, which nothing else touches.
        unsafe { move_back(p, len) }.unwrap();
        assert!(movable(p, len), "private anonymous again");
        // SAFETY: still `len` bytes mapped at `p`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        assert_eq!(bytes[PAGE + 5], 0xee);
        assert!(bytes.iter().enumerate().all(|(i, &b)| i == PAGE + 5 || b == (i * 7 % 251) as u8), "contents kept");
        bytes[0] = 0x11;
        // SAFETY: a one-byte read into our buffer.
        assert_eq!(unsafe { libc::pread(fd.as_raw_fd(), got.as_mut_ptr().cast(), 1, 0) }, 1);
        assert_eq!(got[0], 0, "a write no longer reaches the memfd");
        // SAFETY: our mapping.
        unsafe { libc::munmap(p.cast(), len) };
    }
}
