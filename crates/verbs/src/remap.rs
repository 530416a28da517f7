//! Caller memory moved onto a memfd, so that softrdmad can map it (opt-in:
//! `SOFTRDMA_MOVE_REGIONS=1`). `ibv_reg_mr` of an unmodified program names memory the program
//! allocated (`malloc`, `posix_memalign`), which the daemon can otherwise reach only with a
//! `process_vm_readv`/`writev` system call per access (about 1 µs each; three quarters of the
//! device loop's time for perftest's small WRITEs).
//!
//! A region made of whole pages of plain private anonymous memory (the heap, an anonymous mapping,
//! with no flags beyond the default ones: not locked, not `MADV_DONTFORK`, `WIPEONFORK`, huge-page
//! advised, mergeable or under userfaultfd, no protection key), overlapping no other region this
//! process registered, is copied into a new memfd, which is then mapped over the same addresses
//! (`MAP_FIXED`): the program keeps its pointers and its data, and the pages are shared with the
//! daemon, as `reg_mr`'s own regions are. Deregistration moves them back ([`move_back`]): private
//! anonymous pages again, with the same contents, so that an allocator that later drops them
//! (`MADV_DONTNEED`) gets the zeroed pages it expects.
//!
//! Why it is not the default:
//! * The copy and the new mapping are not one step: a write to those pages by another thread
//!   during `ibv_reg_mr` (a pool the program sub-allocates from, allocator metadata) is lost.
//! * While registered, a child created by `fork` shares the pages instead of copying them.
//! * The range's mapping is split from its neighbours for good: a program that registers and
//!   deregisters many different ranges (a registration cache) adds mappings towards
//!   `vm.max_map_count`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use softrdma_abi::shm::PAGE;

/// Whether moving is asked for (`SOFTRDMA_MOVE_REGIONS=1`).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SOFTRDMA_MOVE_REGIONS").is_ok_and(|v| v == "1"))
}

/// The caller-memory ranges this process has registered (`[start, end)`, once per region): a range
/// overlapping one is not moved, since the daemon may be writing to it during the move.
static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Note a registered range of caller memory.
pub(crate) fn note(ptr: *const u8, len: usize) {
    REGISTERED.lock().expect("registered ranges").push((ptr as usize, ptr as usize + len));
}

/// Forget one registration of a range noted with [`note`].
pub(crate) fn forget(ptr: *const u8, len: usize) {
    let mut r = REGISTERED.lock().expect("registered ranges");
    if let Some(i) = r.iter().position(|&x| x == (ptr as usize, ptr as usize + len)) {
        r.swap_remove(i);
    }
}

/// Whether `[ptr, ptr+len)` may be moved: moving is on, the range is whole pages of plain private
/// anonymous read-write memory (per `/proc/self/smaps`), and no registered range overlaps it. If
/// so the range is noted as registered at once (so that no other thread moves it too); the caller
/// forgets it should the registration not happen.
pub(crate) fn movable(ptr: *const u8, len: usize) -> bool {
    if !enabled() || !plain_pages(ptr, len) {
        return false;
    }
    let mut r = REGISTERED.lock().expect("registered ranges");
    if overlaps(&r, ptr, len) {
        return false;
    }
    r.push((ptr as usize, ptr as usize + len));
    true
}

/// Whether one of the `registered` ranges overlaps `[ptr, ptr+len)`.
fn overlaps(registered: &[(usize, usize)], ptr: *const u8, len: usize) -> bool {
    let (start, end) = (ptr as usize, ptr as usize + len);
    registered.iter().any(|&(a, b)| a < end && start < b)
}

/// Whether `[ptr, ptr+len)` is whole pages of plain private anonymous read-write memory.
fn plain_pages(ptr: *const u8, len: usize) -> bool {
    let (start, end) = (ptr as usize, (ptr as usize).wrapping_add(len));
    if len == 0 || !start.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || end < start {
        return false;
    }
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else { return false };
    covered_by_plain_anonymous(&smaps, start, end)
}

/// The flags (`VmFlags` of smaps) of memory that may be moved: read, write, may read/write/exec,
/// accountable or not reserved (glibc's thread arenas), soft-dirty. Any other (locked, don't-fork,
/// wipe-on-fork, huge-page advice, mergeable, userfaultfd, grows-down, ...) keeps the memory where
/// it is.
const PLAIN_FLAGS: [&str; 8] = ["rd", "wr", "mr", "mw", "me", "ac", "nr", "sd"];

/// One mapping of `/proc/<pid>/smaps`: its range, whether it is plain private anonymous read-write
/// memory as far as seen, and whether its `VmFlags` line was seen (older kernels lack it: nothing
/// is moved then).
struct Vma {
    lo: usize,
    hi: usize,
    plain: bool,
    flags_seen: bool,
}

/// The mappings listed in `smaps` (the format of `/proc/<pid>/smaps`), in order; `None` if a header
/// does not parse.
fn vmas(smaps: &str) -> Option<Vec<Vma>> {
    let mut out: Vec<Vma> = Vec::new();
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
            let (perms, _offset, _dev, inode) = (f.next()?, f.next()?, f.next()?, f.next()?);
            let name = f.next().unwrap_or("");
            let plain = perms == "rw-p" && inode == "0" && (name.is_empty() || name == "[heap]");
            out.push(Vma { lo, hi, plain, flags_seen: false });
        } else if let Some(v) = out.last_mut() {
            match first {
                "VmFlags:" => {
                    v.flags_seen = true;
                    v.plain &= f.all(|flag| PLAIN_FLAGS.contains(&flag));
                }
                "ProtectionKey:" => v.plain &= f.next() == Some("0"),
                _ => {}
            }
        }
    }
    Some(out)
}

/// Whether the mappings in `smaps` cover `[start, end)` without a gap, each plain private anonymous
/// read-write memory.
fn covered_by_plain_anonymous(smaps: &str, start: usize, end: usize) -> bool {
    let Some(vmas) = vmas(smaps) else { return false };
    let mut at = start;
    for v in vmas.iter().filter(|v| v.hi > start && v.lo < end) {
        if v.lo > at || !v.plain || !v.flags_seen {
            return false;
        }
        at = v.hi;
        if at >= end {
            return true;
        }
    }
    false
}

/// Whether `[ptr, ptr+len)` is still mapped read-write (per `/proc/self/maps`).
fn read_write(ptr: *const u8, len: usize) -> bool {
    let (start, end) = (ptr as usize, ptr as usize + len);
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    let mut at = start;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { return false };
        let Some((lo, hi)) = range.split_once('-') else { return false };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { return false };
        if hi <= at || lo >= end {
            continue;
        }
        if lo > at || !perms.starts_with("rw") {
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
    // Protections the program changed since (read-only, none) are its own: the pages stay.
    if !read_write(ptr, len) {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "no longer mapped read-write"));
    }
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

    /// Two lines per mapping (its header and its flags; smaps has more, which do not matter here).
    const SMAPS: &str = "\
55d0a0000000-55d0a0021000 rw-p 00000000 00:00 0                          [heap]
VmFlags: rd wr mr mw me ac sd
7f0000000000-7f0000004000 rw-p 00000000 00:00 0 
Rss:                  16 kB
VmFlags: rd wr mr mw me ac
7f0000004000-7f0000008000 rw-p 00000000 00:00 0 
ProtectionKey:         0
VmFlags: rd wr mr mw me nr
7f0000008000-7f000000a000 r--p 00000000 00:00 0 
VmFlags: rd mr mw me ac
7f000000a000-7f000000c000 rw-s 00000000 00:01 1234                       /memfd:x (deleted)
VmFlags: rd wr sh mr mw me ms sd
7f000000c000-7f000000e000 rw-p 00001000 08:01 5678                       /usr/lib/libfoo.so
VmFlags: rd wr mr mw me ac sd
7f0000010000-7f0000012000 rw-p 00000000 00:00 0 
VmFlags: rd wr mr mw me lo ac
7f0000012000-7f0000014000 rw-p 00000000 00:00 0 
VmFlags: rd wr mr mw me dc ac
7f0000014000-7f0000016000 rw-p 00000000 00:00 0 
VmFlags: rd wr mr mw me ac hg
7f0000016000-7f0000018000 rw-p 00000000 00:00 0 
ProtectionKey:         1
VmFlags: rd wr mr mw me ac
7f0000018000-7f000001a000 rw-p 00000000 00:00 0 
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
VmFlags: rd wr mr mw me gd ac
";

    #[test]
    fn only_plain_private_anonymous_read_write_pages_without_a_gap_are_movable() {
        let ok = |lo: usize, hi: usize| covered_by_plain_anonymous(SMAPS, lo, hi);
        assert!(ok(0x55d0_a000_1000, 0x55d0_a000_3000), "inside the heap");
        assert!(ok(0x7f00_0000_2000, 0x7f00_0000_6000), "across two adjacent anonymous mappings");
        assert!(!ok(0x7f00_0000_6000, 0x7f00_0000_9000), "runs into a read-only mapping");
        assert!(!ok(0x7f00_0000_a000, 0x7f00_0000_b000), "a shared mapping");
        assert!(!ok(0x7f00_0000_c000, 0x7f00_0000_d000), "a file mapping");
        assert!(!ok(0x7f00_0000_e000, 0x7f00_0000_f000), "not mapped at all");
        assert!(!ok(0x7f00_0001_0000, 0x7f00_0001_1000), "mlocked");
        assert!(!ok(0x7f00_0001_2000, 0x7f00_0001_3000), "MADV_DONTFORK");
        assert!(!ok(0x7f00_0001_4000, 0x7f00_0001_5000), "MADV_HUGEPAGE");
        assert!(!ok(0x7f00_0001_6000, 0x7f00_0001_7000), "a protection key");
        assert!(!ok(0x7f00_0001_8000, 0x7f00_0001_9000), "no VmFlags line");
        assert!(!ok(0x7ffc_0000_0000, 0x7ffc_0000_1000), "the stack");
        assert!(!ok(0x55d0_a002_0000, 0x55d0_a002_2000), "past the end of the heap");
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
        assert!(plain_pages(p, len));
        assert!(!plain_pages(p.wrapping_add(1), PAGE), "not page-aligned");
        assert!(!plain_pages(p, PAGE + 1), "a part page");
        // A registration over part of it keeps the rest from moving while it lasts.
        note(p.wrapping_add(PAGE), PAGE);
        let registered = || REGISTERED.lock().unwrap().clone();
        assert!(overlaps(&registered(), p, len) && !overlaps(&registered(), p.wrapping_add(2 * PAGE), PAGE));
        forget(p.wrapping_add(PAGE), PAGE);
        assert!(!overlaps(&registered(), p, len));
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
        assert!(!plain_pages(p, len), "shared now");
        // And back: private anonymous pages with the same bytes, the memfd no longer behind them.
        // SAFETY: our mapping, which nothing else touches.
        unsafe { move_back(p, len) }.unwrap();
        assert!(plain_pages(p, len), "private anonymous again");
        // Made read-only by the program: not moved back (it stays as the program left it).
        // SAFETY: our mapping.
        assert_eq!(unsafe { libc::mprotect(p.cast(), PAGE, libc::PROT_READ) }, 0);
        // SAFETY: our mapping.
        assert!(unsafe { move_back(p, len) }.is_err());
        // SAFETY: our mapping.
        assert_eq!(unsafe { libc::mprotect(p.cast(), PAGE, libc::PROT_READ | libc::PROT_WRITE) }, 0);
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
