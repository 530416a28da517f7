//! Registered memory: page-aligned pinned buffers owned by [`MemoryRegion`]s, and the region table
//! through which the engine reaches them ([`MrTable`], the device's [`MemoryAccess`]).
//!
//! Soundness: a table entry holds a raw pointer to a buffer owned by a live `MemoryRegion`. The
//! region removes its entry (under the device lock) before its buffer is freed, and every copy in
//! or out of a buffer — the engine's through this table, the application's through
//! [`MemoryRegion::read`]/[`MemoryRegion::write`] — happens while that same lock is held, after a
//! bounds check against the entry. So no access touches freed memory, none goes out of bounds, and
//! no two accesses race. The one exception is the unsafe `reg_mr_raw` entry point for the C ABI,
//! where the caller owns the memory and promises it outlives the region, as `ibv_reg_mr` requires.
//!
//! In the daemon (softrdmad) the table also holds clients' regions: a region registered with
//! `reg_mr_raw` stays in its process and is reached with `process_vm_readv/writev`; one allocated by
//! `reg_mr` lives in a sealed memfd the client sent, which the table entry maps and *owns*
//! ([`MrTable::insert_mapped`]): removing the entry (under the device lock, like every access)
//! unmaps it, so no access can follow the unmap, and the seals mean the client cannot shrink the
//! file under the mapping.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;

use softrdma_abi::shm::{RegionMap, PAGE};
use softrdma_transport::{Access, AtomicOp, DeferredPayload, KeyKind, MemError, MemoryAccess, PdId, Sge};

use crate::client_io::{ReadAhead, WriteBehind};
use crate::client_place::{ClientPlacements, PlacementCounts, PLACE_MAX};
use crate::error::{Error, Result};
use crate::verbs::Dev;

/// A zeroed, page-aligned heap buffer.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this value; access is synchronised by the device lock.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` gives no access to the bytes by itself.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1).next_multiple_of(PAGE), PAGE).expect("valid layout")
    }

    fn new(len: usize) -> Result<AlignedBuf> {
        if len > isize::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("memory region of {len} bytes is too large")));
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(Self::layout(len)) };
        if ptr.is_null() {
            return Err(Error::io("allocating a memory region", std::io::Error::from(std::io::ErrorKind::OutOfMemory)));
        }
        Ok(AlignedBuf { ptr, len })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// Pin `len` bytes at `ptr`, turning a memlock refusal into a message that names the fix.
fn pin(ptr: *mut u8, len: usize) -> Result<()> {
    // SAFETY: mlock only changes paging of our own allocation.
    if unsafe { libc::mlock(ptr as *const libc::c_void, len.max(1)) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if matches!(err.raw_os_error(), Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN)) {
        let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the struct we pass.
        unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
        return Err(Error::MemlockLimit { requested: len, limit: rl.rlim_cur });
    }
    Err(Error::io("mlock", err))
}

fn unpin(ptr: *mut u8, len: usize) {
    // SAFETY: munlock of a range we locked.
    unsafe { libc::munlock(ptr as *const libc::c_void, len.max(1)) };
}

/// Where a region's bytes are.
#[derive(Debug)]
enum Home {
    /// In this process, at the entry's `ptr`.
    Here,
    /// In another process (a daemon client, its pid): `ptr` is an address there, reached only
    /// through `process_vm_readv`/`process_vm_writev`, never dereferenced; whether (some of) it is
    /// a shared mapping, which other registrations may alias.
    Process(u32, bool),
    /// In a client's memfd that this entry maps (and unmaps when it is dropped): `ptr` is the
    /// client's address of the first byte (what SGEs and RETHs name), the map's first byte is ours.
    Mapped(RegionMap),
}

/// One region in the table.
#[derive(Debug)]
struct Entry {
    pd: PdId,
    ptr: *mut u8,
    len: usize,
    access: Access,
    home: Home,
}

impl Entry {
    /// Whether `[addr, addr + len)` lies in the region.
    fn covers(&self, addr: u64, len: u64) -> bool {
        let start = self.ptr as u64;
        addr >= start && addr.checked_add(len).is_some_and(|end| end <= start + self.len as u64)
    }
}

/// Where a resolved access goes.
enum Loc {
    Local(*mut u8),
    Remote(u32, u64),
}

/// Copy between our buffer and another process's memory, as a NIC's DMA would (the daemon's
/// path to its clients' registered memory). A short transfer (the client unmapped the range) is an
/// access error, and nothing is assumed about the bytes.
fn process_vm(pid: u32, addr: u64, local: *mut u8, len: usize, write: bool) -> core::result::Result<(), MemError> {
    if len == 0 {
        return Ok(());
    }
    let l = libc::iovec { iov_base: local as *mut libc::c_void, iov_len: len };
    let r = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: the local iovec covers a live Rust buffer of `len` bytes owned by the caller (read:
    // written by the kernel; write: only read); the remote iovec is only interpreted by the kernel
    // in the address space of `pid`, with that process's permissions checked.
    let n = unsafe {
        if write {
            libc::process_vm_writev(pid as libc::pid_t, &l, 1, &r, 1, 0)
        } else {
            libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0)
        }
    };
    if n == len as isize {
        Ok(())
    } else {
        Err(MemError::AccessDenied)
    }
}

/// Hashes a region key for [`MrTable`]: one multiplication folded to 64 bits, instead of the
/// standard library's SipHash (a keyed hash against collision attacks, ~100 instructions per
/// lookup, and lookups are per packet). Only the device inserts keys, and it allocates them
/// sequentially, so a peer cannot fill a bucket; a peer's unknown key costs one probe sequence.
#[derive(Debug, Default, Clone, Copy)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        let p = u128::from(self.0 ^ v) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Most bytes of READ responses' data read ahead at the start of a batch of packets
/// ([`MrTable::prefetch_owed_reads`]): what a batch sends at most (32 packets of the largest
/// MTU). A batch that sends less (a smaller MTU, a full same-host ring) reads some again next time.
const OWED_READ_WINDOW: usize = crate::io::BATCH * MAX_PACKET_PAYLOAD;

/// The largest payload a packet carries (the largest path MTU).
const MAX_PACKET_PAYLOAD: usize = 4096;

type KeyMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// The device's region table: keys to buffers, with PD, bounds and rights.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    entries: KeyMap<Entry>,
    next_index: u32,
    /// Entries reached through process_vm (daemon clients' own memory).
    process_regions: usize,
    /// Those of them lying (partly) in shared mappings. Copies and kept writes are keyed by process
    /// and address, so while one exists, memory reached at two addresses (two processes mapping
    /// one memfd or shm segment, or one process mapping it twice) could be seen stale or written
    /// out of order: then nothing is served from a copy (and READ responses' data is not read
    /// ahead), and kept writes are made in the order they were kept, not one call per process
    /// (client_io.rs).
    shared_process_regions: usize,
    /// Their bytes read ahead for the work requests of one pass of softrdmad's device loop.
    read_ahead: ReadAhead,
    /// Reads with remote keys are served from `read_ahead` too: only while the pass takes the
    /// requests it read ahead for, whose READs and atomics executed directly read their targets
    /// then.
    serve_remote: bool,
    /// Their bytes that READ responses owed during one flush still have to send, read ahead
    /// ([`MrTable::prefetch_owed_reads`]).
    owed_reads: ReadAhead,
    /// Writes made through pointers into this process's memory (buffers here and mapped client
    /// regions), counted: one of them may alias bytes read ahead (the same pages registered both
    /// mapped and for process_vm), so a copy serves only while this count is what it was when the
    /// copy was read (`ahead_writes`, `owed_writes`; see [`MrTable::copies_current`]).
    local_writes: std::cell::Cell<u64>,
    /// process_vm system calls made one access at a time (reads, writes); those of the
    /// read-ahead and the writes kept behind are counted there.
    single_calls: std::cell::Cell<(u64, u64)>,
    ahead_writes: u64,
    owed_writes: u64,
    /// The READ responses' ranges looked at by the last [`MrTable::prefetch_owed_reads`]: (pid,
    /// address, length, whether their next packet was read ahead already).
    owed_scratch: Vec<(u32, u64, usize, bool)>,
    /// Writes to them not yet made (see client_io.rs); made before any other access (a read, for
    /// instance, must see them, whether through the same address or another mapping of the same
    /// memory), hence a cell: reads take `&self`.
    write_behind: std::cell::RefCell<WriteBehind>,
    /// Writes handed to clients to make themselves (client_place.rs), taken back before any other
    /// access to their memory.
    placements: std::cell::RefCell<ClientPlacements>,
    /// Whether writes may be handed out (`SOFTRDMA_PLACEMENTS=0` says no).
    placements_off: bool,
    /// The processes [`MrTable::hand_out`] looks at, kept for its next pass.
    hand_out_pids: Vec<u32>,
}

// SAFETY: the raw pointers refer to buffers owned by live MemoryRegions (see the module docs); the
// table is only used under the device lock.
unsafe impl Send for MrTable {}

impl MrTable {
    /// Register `len` bytes at `addr` in process `pid` (the daemon registering a client's region).
    /// `shared`: some of it is a shared mapping (see [`MrTable::shared_process_regions`]).
    pub(crate) fn insert_remote(
        &mut self,
        pd: PdId,
        pid: u32,
        addr: u64,
        len: usize,
        access: Access,
        shared: bool,
    ) -> u32 {
        self.insert_entry(Entry { pd, ptr: addr as *mut u8, len, access, home: Home::Process(pid, shared) })
    }

    /// Register `len` bytes of a client's memfd region, mapped here as `map`, that the client
    /// addresses at `client_addr` (the daemon's path for `reg_mr`). The table owns the mapping
    /// from now on: [`MrTable::remove`] unmaps it. `len` is cut to the mapping's length.
    pub(crate) fn insert_mapped(
        &mut self,
        pd: PdId,
        map: RegionMap,
        client_addr: u64,
        len: usize,
        access: Access,
    ) -> u32 {
        let len = len.min(map.mapped_len());
        self.insert_entry(Entry { pd, ptr: client_addr as *mut u8, len, access, home: Home::Mapped(map) })
    }

    fn insert(&mut self, pd: PdId, ptr: *mut u8, len: usize, access: Access) -> u32 {
        self.insert_entry(Entry { pd, ptr, len, access, home: Home::Here })
    }

    fn insert_entry(&mut self, entry: Entry) -> u32 {
        self.write_pending();
        self.read_ahead.clear();
        self.owed_reads.clear();
        if let Home::Process(_, shared) = entry.home {
            self.process_regions += 1;
            self.shared_process_regions += usize::from(shared);
            if shared {
                // Another address may reach what a client would place: nothing is handed out
                // from now on, and what waits is made.
                self.placements.get_mut().reclaim_all();
            }
        }
        // rxe-style keys: an index in the upper 24 bits and a rolling key byte in the lower 8.
        loop {
            self.next_index = self.next_index.wrapping_add(1);
            let key = ((self.next_index & 0xff_ffff) << 8) | (self.next_index.wrapping_mul(0x9d) & 0xff);
            if key != 0 && !self.entries.contains_key(&key) {
                self.entries.insert(key, entry);
                return key;
            }
        }
    }

    /// Forget region `key`; a mapped client region is unmapped here, after which no access can
    /// reach it (callers hold the device lock, as for every access).
    pub(crate) fn remove(&mut self, key: u32) {
        self.write_pending();
        self.read_ahead.clear();
        self.owed_reads.clear();
        if let Some(Entry { home: Home::Process(pid, shared), .. }) = self.entries.remove(&key) {
            // Entries waiting for its client may be for this region: made while it is registered.
            self.placements.get_mut().reclaim(pid);
            self.process_regions -= 1;
            self.shared_process_regions -= usize::from(shared);
        }
    }

    /// Whether any region is reached through process_vm (a daemon client registered its own
    /// memory): then [`MrTable::prefetch`] is worth its look at the work requests.
    pub(crate) fn has_process_regions(&self) -> bool {
        self.process_regions > 0
    }

    /// Read ahead, one system call per client, what the SGEs of work requests taken from the send
    /// rings (`sges`: their payloads, and the targets of their READs and atomics, an rkey in place
    /// of the lkey)
    /// name in regions reached through process_vm, replacing what was read ahead before; their
    /// gathers in this pass then copy from there (see client_io.rs). SGEs with an unknown key or
    /// out of their region's bounds are left to the access, which fails them.
    pub(crate) fn prefetch<'a>(&mut self, sges: impl IntoIterator<Item = &'a Sge>) {
        self.write_pending();
        self.read_ahead.clear();
        self.ahead_writes = self.local_writes.get();
        for s in sges {
            let Some(e) = self.entries.get(&s.lkey) else { continue };
            let Home::Process(pid, _) = e.home else { continue };
            if e.covers(s.addr, u64::from(s.length)) {
                self.read_ahead.add(pid, s.addr, s.length as usize);
            }
        }
        self.placements.get_mut().reclaim_each(self.read_ahead.unread_pids());
        self.read_ahead.read_all();
    }

    /// While the pass takes the requests read ahead for (`on`), a read with a remote key, which
    /// then can only be a READ or an atomic among them executed directly, is served from the
    /// read-ahead too; a READ or atomic that arrives as a packet later never is, so it never sees
    /// bytes older than its arrival.
    pub(crate) fn serve_remote_reads(&mut self, on: bool) {
        self.serve_remote = on;
    }

    /// Forget what [`MrTable::prefetch`] read (the pass it was read for is over).
    pub(crate) fn forget_prefetched(&mut self) {
        self.read_ahead.clear();
    }

    /// Read ahead, one system call per client, what the READ responses the engine owes now still
    /// have to send from regions reached through process_vm (`owed`: rkey, address and bytes left
    /// of each, from `Hca::owed_reads`, in the order they go), up to [`OWED_READ_WINDOW`] bytes
    /// of them, skipping a response whose next packet's bytes were read ahead already; the packets
    /// of those responses then copy from there. The READs have arrived, so these bytes are as new
    /// as the READs may see; a request that arrives later in the same flush (from a QP of this
    /// device, posted before the flush began) may be served from them too. The copy is dropped at
    /// the end of the flush ([`MrTable::forget_owed_reads`]), before anything new can arrive;
    /// where this device writes to those bytes, and wholly when it writes through a pointer (which
    /// may alias them).
    pub(crate) fn prefetch_owed_reads(&mut self, owed: impl Iterator<Item = (u32, u64, u32)>) {
        if self.shared_process_regions > 0 {
            // Nothing read ahead would serve a READ (see `copies_current`).
            return;
        }
        self.write_pending();
        if self.owed_writes != self.local_writes.get() {
            // Written through another mapping since: nothing read may be served.
            self.owed_reads.clear();
            self.owed_writes = self.local_writes.get();
        }
        let mut look = std::mem::take(&mut self.owed_scratch);
        look.clear();
        let (mut window, mut fresh) = (OWED_READ_WINDOW, 0);
        for (rkey, va, left) in owed {
            if window == 0 {
                break;
            }
            let Some(e) = self.entries.get(&rkey) else { continue };
            let Home::Process(pid, _) = e.home else { continue };
            let len = (left as usize).min(window);
            if len == 0 || !e.covers(va, len as u64) {
                continue;
            }
            window -= len;
            let done = self.owed_reads.covers(pid, va, len.min(MAX_PACKET_PAYLOAD));
            if !done {
                fresh += len;
            }
            look.push((pid, va, len, done));
        }
        if fresh > 0 {
            // The bytes of packets sent since they were read make room; what is still to be sent
            // is read again.
            let all = !self.owed_reads.has_room(fresh);
            if all {
                self.owed_reads.clear();
            }
            for &(pid, va, len, done) in &look {
                if all || !done {
                    self.owed_reads.add(pid, va, len);
                }
            }
            self.placements.get_mut().reclaim_each(self.owed_reads.unread_pids());
            self.owed_reads.read_all();
        }
        self.owed_scratch = look;
    }

    /// Forget what [`MrTable::prefetch_owed_reads`] read (the flush it was read for is over).
    pub(crate) fn forget_owed_reads(&mut self) {
        self.owed_reads.clear();
    }

    /// Make the writes to regions reached through process_vm that were kept behind (see
    /// client_io.rs): before anything can tell anyone they were made (a packet sent, completions
    /// handed out) and before any access to memory but another such write, a read served from what
    /// was read ahead, or an atomic on a word read ahead.
    pub(crate) fn write_pending(&self) {
        // Only a region reached through process_vm has writes kept (and `remove` makes them
        // before its region goes): an embedded device pays this comparison.
        if self.process_regions == 0 {
            return;
        }
        let mut w = self.write_behind.borrow_mut();
        if !w.is_empty() {
            // Entries handed out to those processes are made first: they were kept first.
            self.placements.borrow_mut().reclaim_each(w.pids());
            w.write_all(self.shared_process_regions == 0);
        }
    }

    /// Hand the writes kept behind for a process to its client to make (client_place.rs) where
    /// every one of them is a small write for a work request of its own and its ring has room;
    /// the rest stay kept. Nothing is handed out while a region lies in a shared mapping.
    pub(crate) fn hand_out(&mut self) {
        if self.process_regions == 0 || self.shared_process_regions > 0 || self.placements_off {
            return;
        }
        let w = self.write_behind.get_mut();
        if w.is_empty() {
            return;
        }
        let p = self.placements.get_mut();
        // (A list kept from pass to pass: no allocation per pass.)
        let pids = &mut self.hand_out_pids;
        pids.clear();
        pids.extend(w.pids());
        pids.sort_unstable();
        pids.dedup();
        for &pid in pids.iter() {
            let Some(n) = w.placeable(pid, PLACE_MAX) else { continue };
            if p.room(pid, n) {
                w.take(pid, |addr, data| p.hand_out(pid, addr, data));
            }
        }
    }

    /// Whether writes may be handed out to clients (softrdmad's `SOFTRDMA_PLACEMENTS=0`: no).
    pub(crate) fn allow_placements(&mut self, on: bool) {
        self.placements_off = !on;
    }

    /// A session of daemon client `pid` opened the device: the descriptor of its placement ring.
    pub(crate) fn attach_placements(&mut self, pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
        self.placements.get_mut().attach(pid)
    }

    /// A session of daemon client `pid` closed.
    pub(crate) fn detach_placements(&mut self, pid: u32) {
        self.placements.get_mut().detach(pid);
    }

    /// Make what waits in process `pid`'s placement ring now (its client destroyed or reset
    /// objects whose completions would have named it).
    pub(crate) fn make_placements(&mut self, pid: u32) {
        // Writes still kept (from a flush just made) go too, after the entries before them.
        self.write_pending();
        self.placements.get_mut().reclaim(pid);
    }

    /// [`MrTable::make_placements`] for every process (a QP went to error where its owner is
    /// not at hand: the RDMA CM, a malformed work request).
    pub(crate) fn make_all_placements(&mut self) {
        self.write_pending();
        self.placements.get_mut().reclaim_all();
    }

    /// The end of process `pid`'s placement entries, for the completions published to it.
    pub(crate) fn placements_end(&self, pid: u32) -> Option<u32> {
        // Without regions reached by process_vm nothing is handed out: no lookup on the path of
        // every completion of clients whose regions the daemon maps.
        if self.process_regions == 0 {
            return None;
        }
        self.placements.borrow().end(pid)
    }

    /// Placement entries handed out, and by whom they were made.
    pub(crate) fn placement_counts(&self) -> PlacementCounts {
        self.placements.borrow().counts
    }

    /// The bytes of the writes kept behind that wait to be made ([`MrTable::write_pending`]).
    pub(crate) fn writes_waiting(&self) -> usize {
        if self.process_regions == 0 {
            return 0;
        }
        self.write_behind.borrow().bytes()
    }

    /// Writes to a region reached through process_vm that its process refused after they were
    /// kept behind (it unmapped or write-protected the range after registering it): their data is
    /// lost.
    pub(crate) fn lost_writes(&self) -> u64 {
        self.write_behind.borrow().lost + self.placements.borrow().lost()
    }

    /// System calls that read and that wrote clients' memory reached through process_vm (`reg_mr_raw`
    /// regions of daemon clients): what batching them saves shows here.
    pub(crate) fn client_calls(&self) -> (u64, u64) {
        let (r, w) = self.single_calls.get();
        let w = w + self.write_behind.borrow().calls + self.placements.borrow().calls();
        (r + self.read_ahead.calls + self.owed_reads.calls, w)
    }

    /// Whether copies read when `local_writes` was `then` may still serve: no write through a
    /// pointer since (it may alias them: a fenced SEND must carry what a READ just placed through
    /// a mapped alias), and no region in a shared mapping (another address may reach the same
    /// bytes, and copies are kept by address).
    fn copies_current(&self, then: u64) -> bool {
        then == self.local_writes.get() && self.shared_process_regions == 0
    }

    /// Keep `data` to be written at `addr` of process `pid` (client_io.rs), or write it now when
    /// the writes kept behind are full even once made.
    /// `local`: a write a work request of the client's own asked for (client_io.rs, `Range`).
    fn keep_write(&mut self, pid: u32, addr: u64, data: &[u8], local: bool) -> core::result::Result<(), MemError> {
        if !self.write_behind.get_mut().defer(pid, addr, data, local) {
            self.write_pending();
            if !self.write_behind.get_mut().defer(pid, addr, data, local) {
                return self.process_vm(pid, addr, data.as_ptr() as *mut u8, data.len(), true);
            }
        }
        Ok(())
    }

    /// A write through a pointer is about to be made (see `local_writes`).
    fn note_local_write(&self) {
        self.local_writes.set(self.local_writes.get() + 1);
    }

    /// `len` bytes at `addr` of process `pid` are being written: drop the copies of them.
    fn forget_copies(&mut self, pid: u32, addr: u64, len: usize) {
        self.read_ahead.forget_overlapping(pid, addr, len);
        self.owed_reads.forget_overlapping(pid, addr, len);
    }

    /// One process_vm system call, counted.
    fn process_vm(
        &self,
        pid: u32,
        addr: u64,
        local: *mut u8,
        len: usize,
        write: bool,
    ) -> core::result::Result<(), MemError> {
        let (r, w) = self.single_calls.get();
        self.single_calls.set(if write { (r, w + 1) } else { (r + 1, w) });
        self.placements.borrow_mut().reclaim(pid);
        process_vm(pid, addr, local, len, write)
    }

    /// Regions registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    fn resolve(&self, pd: PdId, key: u32, addr: u64, len: u64, need: Access) -> core::result::Result<Loc, MemError> {
        let e = self.entries.get(&key).ok_or(MemError::InvalidKey)?;
        if e.pd != pd {
            return Err(MemError::PdMismatch);
        }
        if !e.access.contains(need) {
            return Err(MemError::AccessDenied);
        }
        if !e.covers(addr, len) {
            return Err(MemError::OutOfBounds);
        }
        let base = match &e.home {
            Home::Here => e.ptr,
            Home::Process(pid, _) => return Ok(Loc::Remote(*pid, addr)),
            Home::Mapped(m) => m.as_ptr(),
        };
        // SAFETY: `covers` checked addr - e.ptr < e.len, so the offset stays inside the allocation
        // (for a mapped region, inside the mapping, which is at least e.len bytes: see
        // `insert_mapped`).
        Ok(Loc::Local(unsafe { base.add((addr - e.ptr as u64) as usize) }))
    }
}

/// A packet whose payload stays in registered memory of this process (the engine deferred it, see
/// `Config::defer_payload_min`): sent as an iovec of the headers in the transmit slot, the payload
/// pieces where they are, and the slot's tail (pad and ICRC). Saves the copy into the slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InPlace {
    at: usize,
    len: usize,
    n: usize,
    ptrs: [(*const u8, usize); DeferredPayload::MAX_PIECES],
}

impl InPlace {
    /// The packet `pkt` (its slot, `len` bytes: headers, the hole, the tail) as gather pieces:
    /// headers, payload pieces, tail.
    ///
    /// The payload slices point into registered regions. They stay valid while the device lock is
    /// held (deregistration takes it); the caller sends them before releasing it.
    pub(crate) fn parts<'a>(&self, pkt: &'a [u8]) -> ([&'a [u8]; 4], usize) {
        let (head, tail) = (&pkt[..self.at], &pkt[self.at + self.len..]);
        let piece = |i: usize| {
            let (p, l) = self.ptrs[i];
            // SAFETY: `MrTable::in_place` resolved (p, l) inside a live registered buffer of this
            // process; it stays registered while the device lock is held (see above). The bytes may
            // be changed by the application meanwhile, as a NIC's DMA may read changing memory; they
            // are plain bytes, any value is valid.
            unsafe { std::slice::from_raw_parts(p, l) }
        };
        // Each arm builds the array whole: filled in by index, its pieces were stored in halves
        // and read back whole, a stall on store forwarding per piece (2 % of a UDP sender's time).
        const _: () = assert!(DeferredPayload::MAX_PIECES == 2);
        match self.n {
            0 => ([head, tail, &[], &[]], 2),
            1 => ([head, piece(0), tail, &[]], 3),
            _ => ([head, piece(0), piece(1), tail], 4),
        }
    }

    /// Copy the payload, piece by piece, from where it is to `dst`. Each piece may overlap its
    /// destination (a WRITE within one region) and is moved as `memmove` would; where the source
    /// and the target of a WRITE overlap across pieces or packets the result is what the verbs
    /// leave it: undefined, as with a NIC (but never outside the two ranges).
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of the payload's length, and the regions must stay
    /// registered meanwhile (the device lock is held).
    pub(crate) unsafe fn copy_payload(&self, dst: *mut u8) {
        debug_assert_eq!(self.ptrs[..self.n].iter().map(|p| p.1).sum::<usize>(), self.len);
        let mut at = 0;
        for &(p, l) in &self.ptrs[..self.n] {
            // SAFETY: (p, l) was resolved inside a live region (`MrTable::local_pieces`); `dst` has
            // room for the payload (the caller's promise), of which this piece is a part.
            unsafe { std::ptr::copy(p, dst.add(at), l) };
            at += l;
        }
    }
}

impl MrTable {
    /// Copy a deferred payload into its hole in `pkt` (a packet that does not go out by `sendmsg`
    /// from registered memory: a region of another process, or the same-host link).
    pub(crate) fn fill(&self, d: &DeferredPayload, pkt: &mut [u8]) -> core::result::Result<(), MemError> {
        let mut at = d.at;
        for s in d.pieces() {
            let end = at + s.length as usize;
            self.read(d.pd, s.lkey, KeyKind::Local, s.addr, pkt.get_mut(at..end).ok_or(MemError::OutOfBounds)?)?;
            at = end;
        }
        Ok(())
    }

    /// Resolve a deferred payload to pointers into this process's memory (a client's mapped memfd
    /// region included), written to `out`. A region reached through process_vm (daemon mode,
    /// `reg_mr_raw`) cannot be sent from in place: the payload is copied into the hole in `pkt`
    /// instead and `out` left `None`.
    pub(crate) fn in_place(
        &self,
        d: &DeferredPayload,
        pkt: &mut [u8],
        out: &mut Option<InPlace>,
    ) -> core::result::Result<(), MemError> {
        self.local_pieces(d, out)?;
        if out.is_none() {
            self.fill(d, pkt)?;
        }
        Ok(())
    }

    /// A deferred payload's pieces as pointers into this process's memory (a client's mapped
    /// memfd region included), written to `out`; `out` is left `None` when a piece is in a region
    /// reached through process_vm, or on an error. Written where the caller keeps it: an
    /// `InPlace` is 56 bytes, and moving it out through the results cost the UDP sender's flush
    /// stalls on forwarding its stores.
    pub(crate) fn local_pieces(
        &self,
        d: &DeferredPayload,
        out: &mut Option<InPlace>,
    ) -> core::result::Result<(), MemError> {
        let ip = out.insert(InPlace {
            at: d.at,
            len: d.len,
            n: d.n,
            ptrs: [(std::ptr::null(), 0); DeferredPayload::MAX_PIECES],
        });
        for (slot, s) in ip.ptrs.iter_mut().zip(d.pieces()) {
            match self.resolve(d.pd, s.lkey, s.addr, u64::from(s.length), Access::NONE) {
                Ok(Loc::Local(p)) => *slot = (p as *const u8, s.length as usize),
                remote_or_error => {
                    *out = None;
                    return remote_or_error.map(|_| ());
                }
            }
        }
        // The pieces are read through the pointers: after the writes kept behind.
        self.write_pending();
        Ok(())
    }
}

impl MrTable {
    /// A pointer to `[addr, addr + len)` of a region of this process that `rkey` in `pd` opens
    /// for remote writes, for receiving a payload in place (see `place.rs`), a client's mapped memfd
    /// region included; `None` for anything else, a region reached through process_vm (daemon
    /// mode, `reg_mr_raw`) included. Valid while the device lock is held.
    pub(crate) fn remote_write_ptr(&self, pd: PdId, rkey: u32, addr: u64, len: u64) -> Option<*mut u8> {
        match self.resolve(pd, rkey, addr, len, Access::REMOTE_WRITE) {
            Ok(Loc::Local(p)) => {
                // The caller writes through the pointer: after the writes kept behind.
                self.write_pending();
                self.note_local_write();
                Some(p)
            }
            _ => None,
        }
    }
}

fn read_right(kind: KeyKind) -> Access {
    match kind {
        KeyKind::Local => Access::NONE,
        KeyKind::Remote => Access::REMOTE_READ,
    }
}

fn write_right(kind: KeyKind) -> Access {
    match kind {
        KeyKind::Local => Access::LOCAL_WRITE,
        KeyKind::Remote => Access::REMOTE_WRITE,
    }
}

impl MemoryAccess for MrTable {
    fn check(
        &self,
        pd: PdId,
        key: u32,
        _kind: KeyKind,
        addr: u64,
        len: u64,
        access: Access,
    ) -> core::result::Result<(), MemError> {
        self.resolve(pd, key, addr, len, access).map(|_| ())
    }

    fn read(&self, pd: PdId, key: u32, kind: KeyKind, addr: u64, out: &mut [u8]) -> core::result::Result<(), MemError> {
        let p = match self.resolve(pd, key, addr, out.len() as u64, read_right(kind))? {
            Loc::Local(p) => p,
            // A gather for a work request of this pass, or a READ among them executed directly
            // while the pass takes them, may have been read ahead (client_io.rs).
            Loc::Remote(pid, a)
                if (kind == KeyKind::Local || self.serve_remote)
                    && self.copies_current(self.ahead_writes)
                    && self.read_ahead.get(pid, a, out) =>
            {
                return Ok(())
            }
            // A READ response's data, read ahead for the flush building it.
            Loc::Remote(pid, a)
                if kind == KeyKind::Remote
                    && self.copies_current(self.owed_writes)
                    && self.owed_reads.get(pid, a, out) =>
            {
                return Ok(())
            }
            Loc::Remote(pid, a) => {
                self.write_pending();
                return self.process_vm(pid, a, out.as_mut_ptr(), out.len(), false);
            }
        };
        self.write_pending();
        // SAFETY: `resolve` checked the range lies in a live registered buffer; the device lock is
        // held, so nothing else touches it; `out` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(
        &mut self,
        pd: PdId,
        key: u32,
        kind: KeyKind,
        addr: u64,
        data: &[u8],
    ) -> core::result::Result<(), MemError> {
        let p = match self.resolve(pd, key, addr, data.len() as u64, write_right(kind))? {
            Loc::Local(p) => p,
            Loc::Remote(pid, a) => {
                self.forget_copies(pid, a, data.len());
                return self.keep_write(pid, a, data, kind == KeyKind::Local);
            }
        };
        self.write_pending();
        self.note_local_write();
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    fn atomic(&mut self, pd: PdId, rkey: u32, addr: u64, op: AtomicOp) -> core::result::Result<u64, MemError> {
        if !addr.is_multiple_of(8) {
            return Err(MemError::Misaligned);
        }
        let p = match self.resolve(pd, rkey, addr, 8, Access::REMOTE_ATOMIC)? {
            Loc::Local(p) => {
                self.write_pending();
                self.note_local_write();
                p as *mut u64
            }
            // Atomic with respect to every other RDMA access (all run under the device lock), as
            // IBV_ATOMIC_HCA promises; not with respect to the client's own CPU accesses.
            Loc::Remote(pid, a) => {
                let mut w = [0u8; 8];
                // An atomic executed directly while the pass takes it: its target was read ahead,
                // and the copy is what the memory holds once the writes kept behind are made
                // (every write this device makes updates or drops it).
                if self.serve_remote && self.copies_current(self.ahead_writes) && self.read_ahead.get(pid, a, &mut w) {
                    let orig = u64::from_ne_bytes(w);
                    let new = op.apply(orig);
                    // A compare that fails (or an add of 0) writes nothing, as an HCA would not.
                    if new != orig {
                        self.read_ahead.write_through(pid, a, &new.to_ne_bytes());
                        self.owed_reads.forget_overlapping(pid, a, 8);
                        self.keep_write(pid, a, &new.to_ne_bytes(), false)?;
                    }
                    return Ok(orig);
                }
                self.write_pending();
                self.process_vm(pid, a, w.as_mut_ptr(), 8, false)?;
                let orig = u64::from_ne_bytes(w);
                let new = op.apply(orig);
                if new != orig {
                    self.forget_copies(pid, a, 8);
                    self.process_vm(pid, a, new.to_ne_bytes().as_ptr() as *mut u8, 8, true)?;
                }
                return Ok(orig);
            }
        };
        // SAFETY: in bounds and 8-byte aligned (the buffer or mapping is page aligned and
        // addr % 8 == 0); the device lock serialises every access to registered memory. Volatile:
        // a mapped region is shared with its client process, which the compiler cannot see; the
        // read-modify-write is atomic with respect to RDMA accesses only (IBV_ATOMIC_HCA).
        unsafe {
            let orig = p.read_volatile();
            let new = op.apply(orig);
            if new != orig {
                p.write_volatile(new);
            }
            Ok(orig)
        }
    }

    fn invalidate(&mut self, _pd: PdId, _rkey: u32) -> core::result::Result<(), MemError> {
        // Regions registered with reg_mr cannot be invalidated remotely (no memory windows or
        // fast-registration MRs yet): the IBA says such an rkey is an invalid request.
        Err(MemError::InvalidKey)
    }
}

/// A registered memory region: a pinned buffer it owns ([`crate::ProtectionDomain::reg_mr`]), or
/// memory of the caller's registered through the unsafe [`crate::ProtectionDomain::reg_mr_raw`] (the
/// C ABI's `ibv_reg_mr`).
///
/// In daemon mode `reg_mr`'s buffer is a sealed memfd this region maps and owns, shared with
/// softrdmad, which maps it too and copies to and from it directly; memory registered with
/// `reg_mr_raw` stays the caller's and softrdmad reaches it with
/// `process_vm_readv`/`process_vm_writev` (as a NIC would by DMA). The region's own
/// [`read`](MemoryRegion::read)/[`write`](MemoryRegion::write) copy without a lock: ordering them
/// against the device's accesses is the application's job, through completions, as with hardware.
pub struct MemoryRegion {
    dev: Dev,
    key: u32,
    access: Access,
    ptr: *mut u8,
    len: usize,
    _owned: Backing,
}

/// The memory a [`MemoryRegion`] owns.
enum Backing {
    /// The caller's (`reg_mr_raw`).
    Caller,
    /// The caller's, moved onto a memfd shared with softrdmad (`remap.rs`), moved back when the
    /// region goes.
    Moved,
    /// A heap buffer (embedded devices), freed with the region.
    Heap { _buf: AlignedBuf },
    /// A sealed memfd shared with softrdmad (daemon devices), mapped here, unmapped with the region.
    Shared { _map: RegionMap },
}

// SAFETY: the pointer is to memory owned by this region or promised live by the caller of
// `reg_mr_raw`; every access through it takes the device lock (embedded mode), or races only with
// the daemon's DMA-like copies, which the application orders through completions (daemon mode).
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    fn check_access(access: Access) -> Result<()> {
        let needs_local_write = access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
        if needs_local_write && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too (as ibv_reg_mr requires)".into(),
            ));
        }
        Ok(())
    }

    /// Enter `[ptr, ptr+len)` in the device's region table (embedded) or register it at the daemon.
    fn enter(dev: &Dev, pd: PdId, ptr: *mut u8, len: usize, access: Access) -> Result<u32> {
        match dev {
            Dev::Embedded(h) => Ok(h.dev.lock().mem.insert(pd, ptr, len, access)),
            Dev::Daemon(s) => {
                let req = softrdma_abi::msg::Request::RegMr {
                    pd: pd.0,
                    addr: ptr as u64,
                    len: len as u64,
                    access: access.bits(),
                };
                let key = s.call_id(&req)?;
                s.note_process_region(key, pd.0, ptr as u64, len);
                Ok(key)
            }
        }
    }

    pub(crate) fn register(dev: Dev, pd: PdId, len: usize, access: Access) -> Result<MemoryRegion> {
        Self::check_access(access)?;
        if let Dev::Daemon(s) = &dev {
            if s.shared_regions.load(std::sync::atomic::Ordering::Relaxed) {
                let s = std::sync::Arc::clone(s);
                match Self::register_shared(dev.clone(), &s, pd, len, access)? {
                    Some(mr) => return Ok(mr),
                    // Refused (an older daemon, an older kernel): the heap buffer below, reached
                    // by process_vm, from now on.
                    None => s.shared_regions.store(false, std::sync::atomic::Ordering::Relaxed),
                }
            }
        }
        let buf = AlignedBuf::new(len)?;
        pin(buf.ptr, len)?;
        let (ptr, len) = (buf.ptr, buf.len);
        let key = match Self::enter(&dev, pd, ptr, len, access) {
            Ok(k) => k,
            Err(e) => {
                unpin(ptr, len);
                return Err(e);
            }
        };
        Ok(MemoryRegion { dev, key, access, ptr, len, _owned: Backing::Heap { _buf: buf } })
    }

    /// `reg_mr` on a daemon device: the buffer is a new sealed memfd (zeroed, whole pages), mapped
    /// and pinned here, and sent to the daemon, which maps it too (see `RegMrShared`). The
    /// descriptor is closed once sent; the two mappings keep the memory. `Ok(None)` when the daemon
    /// does not take shared regions (an older one answers an unknown request; one on a kernel
    /// without `F_SEAL_FUTURE_WRITE` refuses the memfd).
    fn register_shared(
        dev: Dev,
        s: &crate::daemon::client::Session,
        pd: PdId,
        len: usize,
        access: Access,
    ) -> Result<Option<MemoryRegion>> {
        if len > isize::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("memory region of {len} bytes is too large")));
        }
        let io = |e| Error::io("allocating a shared memory region", e);
        let fd = softrdma_abi::shm::region_memfd("softrdma-mr", len.max(1).next_multiple_of(PAGE)).map_err(io)?;
        let map = RegionMap::map(&fd, len).map_err(io)?;
        let ptr = map.as_ptr();
        // Pinning allocates every page, which the daemon requires (a sparse file is refused).
        let Some(key) = Self::share(s, &fd, pd, ptr, len, access)? else { return Ok(None) };
        Ok(Some(MemoryRegion { dev, key, access, ptr, len, _owned: Backing::Shared { _map: map } }))
    }

    /// Register caller memory.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be valid, writable memory that stays allocated and mapped until the
    /// returned region is dropped. The device reads and writes it at any time while the region
    /// exists, as a NIC does by DMA; accesses by the caller that race with those are the caller's
    /// to order (through completions), exactly as with a hardware device.
    pub(crate) unsafe fn register_raw(
        dev: Dev,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        Self::check_access(access)?;
        if ptr.is_null() && len > 0 {
            return Err(Error::InvalidArgument("null address".into()));
        }
        if let Dev::Daemon(s) = &dev {
            if s.shared_regions.load(std::sync::atomic::Ordering::Relaxed) && crate::remap::movable(ptr, len) {
                let s = std::sync::Arc::clone(s);
                // SAFETY: forwarded from this function's contract.
                match unsafe { Self::register_moved(dev.clone(), &s, pd, ptr, len, access)? } {
                    Some(mr) => return Ok(mr),
                    // Refused: process_vm from now on, and no more memory moved for nothing.
                    None => s.shared_regions.store(false, std::sync::atomic::Ordering::Relaxed),
                }
            }
        }
        pin(ptr, len)?;
        let key = match Self::enter(&dev, pd, ptr, len, access) {
            Ok(k) => k,
            Err(e) => {
                unpin(ptr, len);
                return Err(e);
            }
        };
        crate::remap::note(ptr, len);
        Ok(MemoryRegion { dev, key, access, ptr, len, _owned: Backing::Caller })
    }

    /// `reg_mr_raw` on a daemon device of whole pages of plain private anonymous memory, with
    /// `SOFTRDMA_MOVE_REGIONS=1`: the pages are moved onto a new sealed memfd at the same addresses
    /// (crates/verbs `remap.rs`) and registered as a shared region, which the daemon maps.
    /// `Ok(None)` when they could not be moved, or the daemon does not take them (they are moved
    /// back): the caller then registers them for process_vm access. An error of the registration
    /// itself (a memlock limit, a bad PD) moves them back too.
    ///
    /// # Safety
    /// As [`MemoryRegion::register_raw`], and [`crate::remap::movable`] accepted (and noted) the
    /// range; it is forgotten again unless the region is made.
    unsafe fn register_moved(
        dev: Dev,
        s: &crate::daemon::client::Session,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Option<MemoryRegion>> {
        let moved = softrdma_abi::shm::region_memfd("softrdma-mr", len).ok().filter(|fd| {
            // SAFETY: forwarded from this function's contract.
            unsafe { crate::remap::move_onto(fd, ptr, len) }.is_ok()
        });
        let Some(fd) = moved else {
            crate::remap::forget(ptr, len);
            return Ok(None);
        };
        let shared = Self::share(s, &fd, pd, ptr, len, access);
        if !matches!(shared, Ok(Some(_))) {
            // SAFETY: as above; the daemon did not keep the memfd.
            let _ = unsafe { crate::remap::move_back(ptr, len) };
            crate::remap::forget(ptr, len);
        }
        let Some(key) = shared? else { return Ok(None) };
        Ok(Some(MemoryRegion { dev, key, access, ptr, len, _owned: Backing::Moved }))
    }

    /// Pin `[ptr, ptr+len)`, the mapping of the memfd `fd` here, and register it with the daemon as
    /// a shared region (`RegMrShared`): its key, or `None` (unpinned again) when the daemon does not
    /// take shared regions (an older one answers an unknown request; one on a kernel without
    /// `F_SEAL_FUTURE_WRITE` refuses the memfd).
    fn share(
        s: &crate::daemon::client::Session,
        fd: &std::os::fd::OwnedFd,
        pd: PdId,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Option<u32>> {
        pin(ptr, len)?;
        let req = softrdma_abi::msg::Request::RegMrShared {
            pd: pd.0,
            addr: ptr as u64,
            len: len as u64,
            access: access.bits(),
        };
        let r = s.call(&req, &[std::os::fd::AsRawFd::as_raw_fd(fd)]);
        if !matches!(r, Ok((softrdma_abi::msg::Response::Id(_), _))) {
            unpin(ptr, len);
        }
        match r {
            Ok((softrdma_abi::msg::Response::Id(key), _)) => Ok(Some(key)),
            Ok(_) => Err(Error::Daemon("unexpected answer to a shared region registration".into())),
            Err(Error::Daemon(_)) => Ok(None),
            Err(Error::InvalidArgument(m)) if m.starts_with(softrdma_abi::msg::SHARED_REGION_REFUSED) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key (equal to the local key, as in rxe).
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Virtual address of the first byte, as peers use it in RDMA requests.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.access
    }

    /// An SGE for `len` bytes at `offset`, or an error if it does not fit.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.check(offset, len)?;
        Ok(Sge { addr: self.addr() + offset as u64, length: len as u32, lkey: self.key })
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && len <= u32::MAX as usize => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} do not fit in a memory region of {} bytes",
                self.len
            ))),
        }
    }

    /// The embedded device's lock, which excludes the engine's accesses; in daemon mode there is
    /// none to take (see the type's docs).
    fn guard(&self) -> Option<std::sync::MutexGuard<'_, crate::runtime::State>> {
        match &self.dev {
            Dev::Embedded(h) => Some(h.dev.lock()),
            Dev::Daemon(_) => None,
        }
    }

    /// Copy `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        let _guard = self.guard();
        // SAFETY: bounds checked above; the device lock excludes the engine's accesses.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
        Ok(())
    }

    /// Copy bytes of the region at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        let _guard = self.guard();
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Fill the whole region with `byte`.
    pub fn fill(&self, byte: u8) {
        let _guard = self.guard();
        // SAFETY: the whole buffer, under the device lock.
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) };
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        match &self.dev {
            Dev::Embedded(h) => h.dev.lock().mem.remove(self.key),
            Dev::Daemon(s) => {
                s.forget_process_region(self.key);
                s.call_quiet(&softrdma_abi::msg::Request::DeregMr { key: self.key })
            }
        }
        unpin(self.ptr, self.len);
        if let Backing::Moved = self._owned {
            // SAFETY: the caller's memory, still allocated (register_raw's contract), which the
            // daemon no longer maps; if it is no longer read-write, or the move fails, it stays
            // shared, with the same contents.
            let _ = unsafe { crate::remap::move_back(self.ptr, self.len) };
        }
        // Only now may another registration move these pages.
        if let Backing::Caller | Backing::Moved = self._owned {
            crate::remap::forget(self.ptr, self.len);
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &self.key)
            .field("addr", &self.addr())
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapped client region is addressed by the client's address, checked as any other region,
    /// and every access lands in the memfd (seen through a second mapping, as the client sees it).
    #[test]
    fn mapped_region_is_reached_by_client_address() {
        let fd = softrdma_abi::shm::region_memfd("mr-test", 8192).unwrap();
        let client = RegionMap::map(&fd, 8192).unwrap();
        // SAFETY: the mapping covers 8192 bytes; every page allocated, as a client's pinning does.
        unsafe { std::ptr::write_bytes(client.as_ptr(), 0, 8192) };
        let map = RegionMap::open_client(&fd, 6000).unwrap();
        let mut t = MrTable::default();
        let (pd, at) = (PdId(3), 0x7f00_0000_1000u64);
        let rw = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);
        let key = t.insert_mapped(pd, map, at, 6000, rw);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 1) as u8).collect();
        t.write(pd, key, KeyKind::Remote, at + 5000, &data).unwrap();
        let mut seen = vec![0u8; 1000];
        // SAFETY: 5000 + 1000 bytes lie inside the client's 8192-byte mapping.
        unsafe { std::ptr::copy_nonoverlapping(client.as_ptr().add(5000), seen.as_mut_ptr(), 1000) };
        assert_eq!(seen, data);
        let mut back = vec![0u8; 1000];
        t.read(pd, key, KeyKind::Remote, at + 5000, &mut back).unwrap();
        assert_eq!(back, data);
        // SAFETY: offset 8 is inside the client's mapping and 8-byte aligned.
        unsafe { (client.as_ptr().add(8) as *mut u64).write(40) };
        assert_eq!(t.atomic(pd, key, at + 8, AtomicOp::FetchAdd { add: 2 }), Ok(40));
        // SAFETY: as above.
        assert_eq!(unsafe { (client.as_ptr().add(8) as *const u64).read() }, 42);
        // Bounds are the registered length at the client's address, not the mapping's.
        assert_eq!(t.write(pd, key, KeyKind::Remote, at + 5001, &data), Err(MemError::OutOfBounds));
        assert_eq!(t.read(pd, key, KeyKind::Remote, at - 1, &mut back), Err(MemError::OutOfBounds));
        assert_eq!(t.read(PdId(4), key, KeyKind::Remote, at, &mut back), Err(MemError::PdMismatch));
        assert_eq!(t.atomic(pd, key, at + 4, AtomicOp::FetchAdd { add: 1 }), Err(MemError::Misaligned));
        assert!(t.remote_write_ptr(pd, key, at, 6000).is_some());
        assert!(t.remote_write_ptr(pd, key, at, 6001).is_none());
        t.remove(key);
        assert_eq!(t.read(pd, key, KeyKind::Remote, at, &mut back), Err(MemError::InvalidKey));
        assert_eq!(t.len(), 0);
    }

    /// What READ responses still owe from a process_vm region (this process's heap here) is read
    /// ahead for one flush: it serves reads with a remote key only, as the memory was when it was
    /// read; a response whose next bytes were read is not read again; a write through the table
    /// drops what it overlaps; after the flush every read goes to memory.
    #[test]
    fn owed_reads_are_read_ahead_for_one_flush() {
        let mut heap = vec![1u8; 3 * 4096];
        let at = heap.as_mut_ptr() as u64;
        let mut t = MrTable::default();
        let pd = PdId(2);
        let rw = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ);
        let key = t.insert_remote(pd, std::process::id(), at, heap.len(), rw, false);
        // Two responses; an unknown key and one out of bounds are left alone.
        t.prefetch_owed_reads(
            [(key, at, 4096), (key, at + 8192, 4096), (key + 1, at, 8), (key, at, 20000)].into_iter(),
        );
        heap[10] = 2;
        heap[8200] = 2;
        let read = |t: &MrTable, kind, addr| {
            let mut b = [0u8; 1];
            t.read(pd, key, kind, addr, &mut b).unwrap();
            b[0]
        };
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 1, "served from what was read ahead");
        assert_eq!(read(&t, KeyKind::Local, at + 10), 2, "a gather reads the memory");
        // The first response's next bytes were read: not read again (the old byte still served).
        t.prefetch_owed_reads([(key, at + 8, 4088), (key, at + 4096, 16)].into_iter());
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 1);
        heap[4100] = 3;
        assert_eq!(read(&t, KeyKind::Remote, at + 4100), 1, "the third range was read");
        t.write(pd, key, KeyKind::Remote, at + 8196, &[7; 2]).unwrap();
        assert_eq!(read(&t, KeyKind::Remote, at + 8200), 2, "the write dropped the second range");
        assert_eq!(read(&t, KeyKind::Remote, at + 8197), 7, "and was made before the read");
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 1, "the first range is not touched by it");
        t.forget_owed_reads();
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 2, "after the flush");
        assert_eq!(read(&t, KeyKind::Remote, at + 4100), 3);
        // A write through a pointer (here: a region of this process) may alias what was read:
        // nothing read ahead before it is served after it.
        let mut other = vec![0u8; 64];
        let here = t.insert(pd, other.as_mut_ptr(), other.len(), rw);
        t.prefetch_owed_reads([(key, at, 4096)].into_iter());
        heap[10] = 4;
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 2);
        t.write(pd, here, KeyKind::Remote, other.as_ptr() as u64, &[1]).unwrap();
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 4, "after a write through a pointer");
        t.prefetch_owed_reads([(key, at, 4096)].into_iter());
        heap[10] = 5;
        assert_eq!(read(&t, KeyKind::Remote, at + 10), 4, "read again after that write");
        t.remove(here);
        t.remove(key);
        drop((heap, other));
    }

    /// A write through a pointer to memory that a process_vm region reaches too (here the same
    /// buffer registered both ways) is seen by a gather from the other region: what was read
    /// ahead before it does not serve any more (a fenced SEND carries what a READ just placed).
    #[test]
    fn a_write_through_an_alias_stales_the_gathers_copy() {
        let mut buf = vec![1u8; 64];
        let at = buf.as_mut_ptr() as u64;
        let mut t = MrTable::default();
        let pd = PdId(2);
        let rw = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ);
        let far = t.insert_remote(pd, std::process::id(), at, 64, rw, false);
        let near = t.insert(pd, buf.as_mut_ptr(), 64, rw);
        t.prefetch([Sge { addr: at, length: 64, lkey: far }].iter());
        let gather = |t: &MrTable| {
            let mut b = [0u8; 8];
            t.read(pd, far, KeyKind::Local, at, &mut b).unwrap();
            b[0]
        };
        assert_eq!(gather(&t), 1);
        t.write(pd, near, KeyKind::Local, at, &[2; 8]).unwrap();
        assert_eq!(gather(&t), 2, "the write through the alias is seen");
        t.remove(near);
        t.remove(far);
        drop(buf);
    }

    /// An atomic executed while the pass takes its request takes its word from the read-ahead
    /// and leaves its new value there and behind; a compare that fails writes nothing; with a
    /// region in a shared mapping registered (memory two addresses may reach), atomics and READs
    /// read the memory itself.
    #[test]
    fn atomics_use_the_read_ahead_unless_memory_may_be_shared() {
        let mut heap = vec![0u64; 8];
        let at = heap.as_mut_ptr() as u64;
        let mut t = MrTable::default();
        let pd = PdId(2);
        let all = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);
        let key = t.insert_remote(pd, std::process::id(), at, 64, all, false);
        heap[1] = 10;
        t.prefetch([Sge { addr: at + 8, length: 8, lkey: key }].iter());
        t.serve_remote_reads(true);
        heap[1] = 20;
        let add = AtomicOp::FetchAdd { add: 1 };
        assert_eq!(t.atomic(pd, key, at + 8, add), Ok(10), "from the copy");
        assert_eq!(t.atomic(pd, key, at + 8, add), Ok(11), "the copy holds the new value");
        t.write_pending();
        assert_eq!(heap[1], 12, "both adds made");
        // This process stores into the word; a compare that fails (on the copy's 12) must not
        // write the 12 back over it.
        heap[1] = 50;
        assert_eq!(t.atomic(pd, key, at + 8, AtomicOp::CompareSwap { compare: 0, swap: 5 }), Ok(12));
        t.write_pending();
        assert_eq!(heap[1], 50, "the failed compare wrote nothing");
        heap[1] = 30;
        let shared = t.insert_remote(pd, std::process::id(), at + 32, 32, all, true);
        t.prefetch([Sge { addr: at + 8, length: 8, lkey: key }].iter());
        heap[1] = 40;
        let mut b = [0u8; 8];
        t.read(pd, key, KeyKind::Remote, at + 8, &mut b).unwrap();
        assert_eq!(u64::from_ne_bytes(b), 40, "a READ too reads the memory");
        assert_eq!(t.atomic(pd, key, at + 8, add), Ok(40), "the memory, not the copy");
        assert_eq!(heap[1], 41);
        t.remove(shared);
        t.remove(key);
        drop(heap);
    }
}
