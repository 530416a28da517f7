//! Batched access to daemon clients' own memory: payloads read ahead, placements written behind.
//!
//! softrdmad reaches a region its client registered from the client's own memory (`reg_mr_raw`,
//! the C ABI's `ibv_reg_mr` of a `malloc`ed buffer) with `process_vm_readv`/`process_vm_writev`:
//! a system call per access, about a microsecond each. A 64-byte WRITE between two such clients
//! cost two (the gather, the placing at the target) and the device loop little else. Both are
//! batched here, one system call per client per pass of the device loop:
//!
//! * [`ReadAhead`]: before a pass takes work requests from the send rings, it reads the payloads
//!   those requests name; the gathers that build their packets copy from the copy. That is reading
//!   the payload at another moment between the post and the completion, which the verbs allow (a
//!   NIC reads it whenever it gets to it), as long as the copy serves only those requests: it
//!   lives for one pass; the pass takes no request posted after the read; the pass's completions
//!   reach the clients only when it is over, so no client can have reused one of those buffers in
//!   between; every write this device makes to a client's memory drops the copies it overlaps (an
//!   atomic's updates the copy that holds its word);
//!   and it serves the gathers of those requests, and the READs and atomics among them executed
//!   directly while the pass takes them (their targets are read ahead too; an atomic's new value
//!   goes into the copy as well as behind, so a list of atomics on one word costs one read). A
//!   READ or atomic that arrives as a packet must not see bytes older than its arrival, so what
//!   those copies hold never serves it.
//! * The data of READ responses: at the start of each batch of packets a flush builds, what the
//!   READ responses the engine owes still have to send is read ahead (up to one batch's worth),
//!   and their packets copy from there. Those READs have arrived. A READ that arrives during the
//!   same flush comes from a QP of this device (loopback), posted before the pass took it, so
//!   before the flush began: bytes read since are as new as it may see. The copy is dropped at the
//!   end of the flush, before anything else can arrive.
//! * Every copy stops serving where this device writes to its bytes (but for an atomic's word,
//!   which it holds updated), and altogether after any write through a pointer into this
//!   process's memory (a mapped region may alias pages registered for process_vm too). Copies and
//!   kept writes are keyed by process and address: while any region reached by process_vm lies in
//!   a shared mapping (which another process, or another mapping, may reach at another address),
//!   nothing is served from a copy and kept writes are made in the order kept (not one call per
//!   process: [`WriteBehind::write_all`]).
//! * [`WriteBehind`]: what the device writes into a client's memory (a received SEND or WRITE, a
//!   READ response's data) is kept and written, each process's in order, before anything could tell anyone it was
//!   written or see it: before the device sends a packet (an ACK, a response, or a request a peer
//!   could act on), before the pass's completions can be handed out (made before they are
//!   published; or, a few kilobytes completing a receive, READ or atomic, right after, with the completions
//!   naming the batch the client's poll waits for: `Ring::writes_made`), and before any other
//!   access to memory (`MrTable`): a read, an atomic not served from a copy, a write to memory
//!   the daemon maps (a "data, then flag" pair of WRITEs into two regions stays in that order) —
//!   all but further writes kept behind and reads served from what was read ahead. A client polling its memory for a WRITE
//!   (as `ib_write_lat` does) sees the data up to one pass later, as it would after a NIC's DMA.
//!   Registration checks that the range is mapped and, for a region that may be written,
//!   writable; a write the client made impossible afterwards (it unmapped or write-protected a
//!   registered buffer) is lost and counted, as the data of a NIC writing to the pinned pages of
//!   such a buffer would be out of the program's sight.

/// Most bytes read ahead per pass: larger payloads are read when their packets are built; the
/// most bytes written behind before they are written at once.
const BUDGET: usize = 1 << 20;

/// Most iovecs per `process_vm_readv`/`process_vm_writev` (the kernel's `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// One range of a client's memory read ahead or written behind.
#[derive(Debug, Clone, Copy)]
struct Range {
    pid: u32,
    addr: u64,
    len: usize,
    /// Where its bytes are in the owner's buffer.
    at: usize,
    /// A write a work request of the client's own asked for (a receive's data, a READ response's,
    /// an atomic's original value), which its application may look at only after polling the
    /// completion: one the client may make itself (`client_place.rs`). Reads: false.
    local: bool,
}

/// Bytes of clients' memory read ahead for one pass of the device loop.
#[derive(Debug, Default)]
pub(crate) struct ReadAhead {
    bytes: Vec<u8>,
    ranges: Vec<Range>,
    /// `ranges[..read]` were read by [`ReadAhead::read_all`]: none of them grows any more.
    read: usize,
    /// System calls made, ever.
    pub calls: u64,
}

impl ReadAhead {
    /// Forget everything read ahead.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.ranges.clear();
        self.read = 0;
    }

    /// Whether [`ReadAhead::add`] of `len` more bytes would fit in the budget.
    pub fn has_room(&self, len: usize) -> bool {
        self.bytes.len() + len <= BUDGET
    }

    /// Queue `len` bytes at `addr` of process `pid` for [`ReadAhead::read_all`], unless that
    /// would pass the pass's budget (or there is nothing to read): those are read when used.
    pub fn add(&mut self, pid: u32, addr: u64, len: usize) {
        if len == 0 {
            return;
        }
        // Requests usually name one buffer, or its consecutive slots, one after the other: each
        // range that starts inside the last one or right after it extends it (one iovec, one
        // page pinned once, instead of many). The last range's bytes are the buffer's last.
        let growable = self.ranges.len() > self.read;
        if let Some(last) = self.ranges.last_mut().filter(|_| growable) {
            let last_end = last.addr + last.len as u64;
            if last.pid == pid && last.addr <= addr && addr <= last_end {
                let grow = (addr + len as u64).saturating_sub(last_end) as usize;
                if self.bytes.len() + grow <= BUDGET {
                    self.bytes.resize(self.bytes.len() + grow, 0);
                    last.len += grow;
                }
                return;
            }
        }
        if !self.has_room(len) {
            return;
        }
        let at = self.bytes.len();
        self.bytes.resize(at + len, 0);
        self.ranges.push(Range { pid, addr, len, at, local: false });
    }

    /// The processes of the ranges queued and not read yet (in no order, repeats possible).
    pub fn unread_pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges[self.read..].iter().map(|r| r.pid)
    }

    /// Read every range queued since the last call: one `process_vm_readv` per process (per
    /// [`MAX_IOV`] ranges). A call stops at the first range it cannot read whole (the client
    /// unmapped it): that range and the ones after it in the call are dropped, and read by system
    /// call when (if) they are used.
    pub fn read_all(&mut self) {
        let mut ranges = self.ranges.split_off(self.read);
        ranges.sort_by_key(|r| r.pid);
        let mut kept = Vec::with_capacity(ranges.len());
        for call in ranges.chunk_by(|a, b| a.pid == b.pid).flat_map(|same| same.chunks(MAX_IOV)) {
            self.calls += 1;
            let mut done = transfer(call, self.bytes.as_mut_ptr(), false);
            for r in call {
                if r.len > done {
                    break;
                }
                done -= r.len;
                kept.push(*r);
            }
        }
        self.ranges.append(&mut kept);
        self.read = self.ranges.len();
    }

    /// Whether `len` bytes at `addr` of process `pid` were read ahead, all in one range.
    pub fn covers(&self, pid: u32, addr: u64, len: usize) -> bool {
        self.find(pid, addr, len).is_some()
    }

    /// The range read that holds `len` bytes at `addr` of process `pid` (ranges added and not
    /// read yet hold nothing).
    fn find(&self, pid: u32, addr: u64, len: usize) -> Option<&Range> {
        let end = addr.saturating_add(len as u64);
        self.ranges[..self.read].iter().find(|r| r.pid == pid && r.addr <= addr && end <= r.addr + r.len as u64)
    }

    /// Copy `out.len()` bytes at `addr` of process `pid` from what was read ahead; false if they
    /// were not (all) read ahead.
    pub fn get(&self, pid: u32, addr: u64, out: &mut [u8]) -> bool {
        let Some(r) = self.find(pid, addr, out.len()) else { return false };
        let from = r.at + (addr - r.addr) as usize;
        out.copy_from_slice(&self.bytes[from..from + out.len()]);
        true
    }

    /// `data` is being written at `addr` of process `pid`: a range read that holds all of it takes
    /// it too (it stays what the memory will hold), any other range it overlaps is dropped.
    pub fn write_through(&mut self, pid: u32, addr: u64, data: &[u8]) {
        let end = addr.saturating_add(data.len() as u64);
        let holds = |r: &Range| r.pid == pid && r.addr <= addr && end <= r.addr + r.len as u64;
        for r in self.ranges[..self.read].iter().filter(|r| holds(r)) {
            let from = r.at + (addr - r.addr) as usize;
            self.bytes[from..from + data.len()].copy_from_slice(data);
        }
        self.drop_overlapping(pid, addr, data.len(), holds);
    }

    /// `len` bytes at `addr` of process `pid` are being written: drop what was read ahead of them.
    pub fn forget_overlapping(&mut self, pid: u32, addr: u64, len: usize) {
        self.drop_overlapping(pid, addr, len, |_| false);
    }

    /// Drop the ranges that overlap `len` bytes at `addr` of process `pid`, but for ranges read
    /// that `keep` says hold what is written there now.
    fn drop_overlapping(&mut self, pid: u32, addr: u64, len: usize, keep: impl Fn(&Range) -> bool) {
        if self.ranges.is_empty() {
            return;
        }
        let end = addr.saturating_add(len as u64);
        // Ranges read and ranges waiting to be read keep their places.
        let (read, mut i, mut still_read) = (self.read, 0, 0);
        self.ranges.retain(|r| {
            let was_read = i < read;
            i += 1;
            let stays = r.pid != pid || r.addr + r.len as u64 <= addr || end <= r.addr || (was_read && keep(r));
            still_read += usize::from(stays && was_read);
            stays
        });
        self.read = still_read;
    }
}

/// One `process_vm_readv` (`write` false) or `process_vm_writev` of `ranges`, all of one process,
/// their local bytes at `base + at`; returns the bytes transferred (0 on an error).
fn transfer(ranges: &[Range], base: *mut u8, write: bool) -> usize {
    let Some(first) = ranges.first() else { return 0 };
    let local: Vec<libc::iovec> = ranges
        .iter()
        // SAFETY: each range's `at + len` lies in the buffer that starts at `base` (the owner's
        // `add`/`defer` made it so), so the pointer stays in it.
        .map(|r| libc::iovec { iov_base: unsafe { base.add(r.at) }.cast(), iov_len: r.len })
        .collect();
    let remote: Vec<libc::iovec> =
        ranges.iter().map(|r| libc::iovec { iov_base: r.addr as *mut libc::c_void, iov_len: r.len }).collect();
    let (l, r, n) = (local.as_ptr(), remote.as_ptr(), ranges.len() as libc::c_ulong);
    // SAFETY: the local iovecs cover bytes of the owner's buffer, which outlives the call and is
    // not otherwise borrowed during it (read: written by the kernel, each range its own bytes;
    // write: only read); the remote iovecs are only interpreted by the kernel in the address
    // space of `pid`, with that process's permissions checked.
    let n = unsafe {
        if write {
            libc::process_vm_writev(first.pid as libc::pid_t, l, n, r, n, 0)
        } else {
            libc::process_vm_readv(first.pid as libc::pid_t, l, n, r, n, 0)
        }
    };
    usize::try_from(n).unwrap_or(0)
}

/// Most writes kept behind at once (each an iovec of the call that makes them).
const MAX_WRITES: usize = 256;

/// Writes to clients' memory kept to be written together, each process's in order (see
/// [`WriteBehind::write_all`]).
#[derive(Debug, Default)]
pub(crate) struct WriteBehind {
    bytes: Vec<u8>,
    ranges: Vec<Range>,
    /// Writes the client's memory refused (it unmapped the range).
    pub lost: u64,
    /// System calls made, ever.
    pub calls: u64,
}

impl WriteBehind {
    /// Nothing waits to be written.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The bytes waiting to be written.
    pub fn bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.len).sum()
    }

    /// The processes written to (in no order, repeats possible).
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges.iter().map(|r| r.pid)
    }

    /// How many writes to process `pid` wait, if every one of them is one its client may make
    /// itself (`local`) of at most `max` bytes; `None` if any is not.
    pub fn placeable(&self, pid: u32, max: usize) -> Option<usize> {
        let mut n = 0;
        for r in self.ranges.iter().filter(|r| r.pid == pid) {
            if !r.local || r.len > max {
                return None;
            }
            n += 1;
        }
        Some(n)
    }

    /// Hand the writes to process `pid` to `f` (address, bytes), in the order they were kept,
    /// and forget them.
    pub fn take(&mut self, pid: u32, mut f: impl FnMut(u64, &[u8])) {
        for r in self.ranges.iter().filter(|r| r.pid == pid) {
            f(r.addr, &self.bytes[r.at..r.at + r.len]);
        }
        self.ranges.retain(|r| r.pid != pid);
        // The rest moved together to the front, in order, so that the last write's bytes are
        // the buffer's last again (what `defer` extends).
        let mut to = 0;
        for r in &mut self.ranges {
            self.bytes.copy_within(r.at..r.at + r.len, to);
            r.at = to;
            to += r.len;
        }
        self.bytes.truncate(to);
    }

    /// Keep `data` to be written at `addr` of process `pid` (`local`: see [`Range`]); false
    /// (nothing kept) when it does not fit: write what waits ([`WriteBehind::write_all`]) and
    /// then this one at once.
    pub fn defer(&mut self, pid: u32, addr: u64, data: &[u8], local: bool) -> bool {
        if self.bytes.len() + data.len() > BUDGET {
            return false;
        }
        // The same bytes written again right after the last write replace its data (only the
        // later can ever be seen); the bytes right after it extend it (written in one piece, in
        // the same order). The last write's bytes are the buffer's last.
        if let Some(last) = self.ranges.last_mut().filter(|r| r.pid == pid) {
            if last.addr == addr && last.len == data.len() {
                self.bytes[last.at..].copy_from_slice(data);
                last.local = local;
                return true;
            }
            // (Checked: the daemon's writes of placement entries a client took back carry an
            // address the client could have changed.)
            if last.addr.checked_add(last.len as u64) == Some(addr) {
                self.bytes.extend_from_slice(data);
                last.len += data.len();
                last.local &= local;
                return true;
            }
        }
        if self.ranges.len() == MAX_WRITES {
            return false;
        }
        let at = self.bytes.len();
        self.bytes.extend_from_slice(data);
        self.ranges.push(Range { pid, addr, len: data.len(), at, local });
        true
    }

    /// Write everything that waits, in the order the writes were kept, one `process_vm_writev` per
    /// run of writes to one process (per [`MAX_IOV`] writes); or, `by_process`, one per process,
    /// each process's writes in the order they were kept. A write the process refuses is counted
    /// in `lost` and the ones after it are still written.
    ///
    /// `by_process` is for writes to memory no two processes share (the caller knows: no region
    /// lies in a shared mapping). Then nothing the verbs define tells the order of two writes to
    /// two processes: no completion and no packet leaves before both are made (a program reading
    /// its buffers before their completions, and telling another by some other channel, could).
    /// Two clients alternating (a fetch-and-add's word at one, its result at the other) then cost
    /// a call each, not one per write. With shared memory one QP's ordered requests could land in
    /// two processes and in the same bytes (a fenced WRITE after a READ), so the order is kept.
    pub fn write_all(&mut self, by_process: bool) {
        let mut ranges = std::mem::take(&mut self.ranges);
        let base = self.bytes.as_mut_ptr();
        if by_process {
            // Stable: each process's writes stay in their order.
            ranges.sort_by_key(|r| r.pid);
        }
        for run in ranges.chunk_by(|a, b| a.pid == b.pid) {
            let mut rest = run;
            while !rest.is_empty() {
                let call = &rest[..rest.len().min(MAX_IOV)];
                self.calls += 1;
                let mut done = transfer(call, base, true);
                let mut whole = 0;
                while whole < call.len() && call[whole].len <= done {
                    done -= call[whole].len;
                    whole += 1;
                }
                if whole < call.len() {
                    // The call stopped in this write: it is lost; go on after it.
                    self.lost += 1;
                    whole += 1;
                }
                rest = &rest[whole..];
            }
        }
        self.bytes.clear();
        self.ranges = ranges;
        self.ranges.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        std::process::id()
    }

    /// A pid above any `pid_max`: no process has it, so nothing can be written to it by mistake.
    const NO_PROCESS: u32 = i32::MAX as u32;

    /// Ranges of this process's memory are read in one call and served from the copy: later
    /// changes to the memory are not seen (the copy is what was read), sub-ranges are served,
    /// anything not wholly read ahead is not.
    #[test]
    fn ranges_read_ahead_are_served_from_the_copy() {
        let mut a: Vec<u8> = (0..200u8).collect();
        let b = [9u8; 64];
        let mut p = ReadAhead::default();
        p.add(me(), a.as_ptr() as u64 + 10, 100);
        p.add(me(), b.as_ptr() as u64, 64);
        p.read_all();
        a[20] = 0xee;
        let mut out = [0u8; 30];
        assert!(p.get(me(), a.as_ptr() as u64 + 15, &mut out));
        assert_eq!(out.to_vec(), (15..45u8).collect::<Vec<_>>(), "the bytes as read, before the change");
        let mut out = [0u8; 64];
        assert!(p.get(me(), b.as_ptr() as u64, &mut out));
        assert_eq!(out, [9u8; 64]);
        let mut out = [0u8; 8];
        assert!(!p.get(me(), a.as_ptr() as u64 + 105, &mut out), "runs past the range");
        assert!(!p.get(me(), a.as_ptr() as u64 + 5, &mut out), "starts before it");
        assert!(!p.get(NO_PROCESS, a.as_ptr() as u64 + 15, &mut out), "another process");
        p.clear();
        assert!(!p.get(me(), b.as_ptr() as u64, &mut out));
    }

    /// Ranges that continue one another are read as one; a write drops exactly the ranges it
    /// overlaps.
    #[test]
    fn a_write_drops_the_ranges_it_overlaps() {
        let a = vec![1u8; 400];
        let base = a.as_ptr() as u64;
        let mut p = ReadAhead::default();
        p.add(me(), base, 100);
        p.add(me(), base + 50, 100);
        p.add(me(), base + 150, 50);
        p.add(me(), base + 250, 100);
        p.add(me(), base + 360, 40);
        assert_eq!(p.ranges.len(), 3, "[0, 200) in one, then two apart");
        p.read_all();
        let mut out = [0u8; 100];
        assert!(p.get(me(), base + 90, &mut out), "across what were three ranges");
        p.forget_overlapping(me(), base + 349, 2);
        assert!(p.get(me(), base, &mut out));
        assert!(!p.get(me(), base + 250, &mut out));
        assert!(p.get(me(), base + 360, &mut out[..40]));
        p.forget_overlapping(NO_PROCESS, base, 100);
        assert!(p.get(me(), base, &mut out), "another process's write");
    }

    /// A range the process does not have mapped stops its call there: it and the ranges after it
    /// in the call are not served; the ones before are.
    #[test]
    fn an_unreadable_range_drops_itself_and_what_follows_it() {
        let a = [5u8; 64];
        let mut p = ReadAhead::default();
        p.add(me(), a.as_ptr() as u64, 32);
        p.add(me(), 8, 32);
        p.add(me(), a.as_ptr() as u64 + 32, 32);
        p.read_all();
        let mut out = [0u8; 32];
        assert!(p.get(me(), a.as_ptr() as u64, &mut out));
        assert_eq!(out, [5u8; 32]);
        assert!(!p.get(me(), 8, &mut out));
        assert!(!p.get(me(), a.as_ptr() as u64 + 32, &mut out));
    }

    /// A second read reads only the ranges added since the first: those read before keep the
    /// bytes they were read with and do not grow; ranges added are served only once read; a write
    /// that drops a range read before leaves the ranges added since it still to be read.
    #[test]
    fn ranges_read_before_are_kept_and_not_read_again() {
        let mut a = vec![3u8; 256];
        let base = a.as_mut_ptr() as u64;
        let mut p = ReadAhead::default();
        p.add(me(), base, 64);
        p.read_all();
        a[10] = 4;
        p.add(me(), base + 64, 64);
        assert_eq!(p.ranges.len(), 2, "a range read before does not grow");
        assert!(!p.covers(me(), base + 64, 64), "added, not read yet");
        a[70] = 5;
        p.read_all();
        let mut out = [0u8; 64];
        assert!(p.get(me(), base, &mut out));
        assert_eq!(out[10], 3, "not read again");
        assert!(p.get(me(), base + 64, &mut out));
        assert_eq!(out[6], 5, "read by the second call");
        p.add(me(), base + 200, 8);
        p.forget_overlapping(me(), base, 1);
        a[200] = 9;
        p.read_all();
        assert!(!p.covers(me(), base, 1), "dropped by the write");
        assert!(p.get(me(), base + 200, &mut out[..8]));
        assert_eq!(out[0], 9, "still read after a range read before it was dropped");
        assert!(!p.covers(me(), base + 120, 16), "across two ranges");
        assert!(p.has_room(BUDGET - 136) && !p.has_room(BUDGET - 135), "bytes of dropped ranges count");
    }

    /// A write through a range read takes its bytes into the copy where the range holds all of
    /// it; a range it only overlaps, and a range not read yet, are dropped.
    #[test]
    fn a_write_through_updates_the_range_that_holds_it() {
        let a = vec![3u8; 256];
        let base = a.as_ptr() as u64;
        let mut p = ReadAhead::default();
        p.add(me(), base, 64);
        p.add(me(), base + 100, 20);
        p.read_all();
        p.add(me(), base + 200, 8);
        p.write_through(me(), base + 8, &[7; 8]);
        let mut out = [0u8; 24];
        assert!(p.get(me(), base, &mut out));
        assert_eq!(out, [[3u8; 8], [7; 8], [3; 8]].concat()[..], "updated where written");
        p.write_through(me(), base + 110, &[9; 20]);
        assert!(!p.covers(me(), base + 100, 1), "overlapped, not held: dropped");
        p.write_through(me(), base + 200, &[1]);
        p.read_all();
        assert!(!p.covers(me(), base + 200, 8), "not read yet: dropped");
        assert!(p.covers(me(), base, 64));
        p.write_through(NO_PROCESS, base, &[5; 8]);
        assert!(p.get(me(), base, &mut out) && out[0] == 3, "another process's write");
    }

    /// Writes kept behind are made when asked, in the order they were kept (the later wins where
    /// two overlap): to this process's memory here.
    #[test]
    fn writes_kept_behind_are_made_in_order() {
        let target = Box::new([0u8; 64]);
        let base = target.as_ptr() as u64;
        let mut w = WriteBehind::default();
        assert!(w.is_empty());
        assert!(w.defer(me(), base + 8, &[1; 16], false));
        assert!(w.defer(me(), base + 16, &[2; 16], false));
        assert!(w.defer(me(), base + 32, &[4; 8], false));
        assert!(w.defer(me(), base + 32, &[5; 8], false), "the same bytes again");
        assert!(w.defer(me(), base + 40, &[6; 8], false), "right after");
        assert_eq!(w.ranges.len(), 3);
        assert!(w.defer(NO_PROCESS, base, &[3; 64], false), "another process");
        assert!(!w.is_empty());
        // SAFETY: a plain read of `target`'s buffer, which only the kernel writes (process_vm).
        let before = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 64]) };
        assert_eq!(before, [0u8; 64], "not made yet");
        w.write_all(true);
        assert!(w.is_empty());
        // SAFETY: as above.
        let now = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 64]) };
        let mut want = [0u8; 64];
        want[8..16].fill(1);
        want[16..32].fill(2);
        want[32..40].fill(5);
        want[40..48].fill(6);
        assert_eq!(now, want);
        assert_eq!(w.lost, 1, "the other process's write: there is no such process");
    }

    /// The writes to one process are handed away whole, in order, when every one of them is its
    /// own work request's and small enough; the rest stay kept, in order, and a write right after
    /// the last one left still extends it.
    #[test]
    fn a_process_s_writes_are_taken_whole_and_the_rest_stay_in_order() {
        let target = Box::new([0u8; 64]);
        let base = target.as_ptr() as u64;
        let mut w = WriteBehind::default();
        assert!(w.defer(NO_PROCESS, 0x1000, &[1; 8], true));
        assert!(w.defer(me(), base, &[2; 8], false));
        assert!(w.defer(NO_PROCESS, 0x2000, &[3; 4], true));
        assert!(w.defer(me(), base + 8, &[4; 8], false));
        assert_eq!(w.placeable(NO_PROCESS, 8), Some(2));
        assert_eq!(w.placeable(NO_PROCESS, 7), None, "one is longer");
        assert_eq!(w.placeable(me(), 64), None, "not its own work request's");
        assert_eq!(w.placeable(12345, 8), Some(0));
        let mut taken = Vec::new();
        w.take(NO_PROCESS, |addr, data| taken.push((addr, data.to_vec())));
        assert_eq!(taken, [(0x1000, vec![1; 8]), (0x2000, vec![3; 4])]);
        assert_eq!(w.bytes(), 16);
        assert_eq!(w.ranges.len(), 2);
        assert!(w.defer(me(), base + 16, &[5; 8], false), "right after the last one left");
        assert_eq!(w.ranges.len(), 2, "extends it");
        assert!(w.defer(me(), base + 24, &[6; 8], true));
        // A write the client may make, extended by one it may not: no longer the client's to make.
        let mut v = WriteBehind::default();
        assert!(v.defer(NO_PROCESS, 0x1000, &[1; 8], true));
        assert!(v.defer(NO_PROCESS, 0x1008, &[1; 8], false));
        assert_eq!(v.ranges.len(), 1);
        assert_eq!(v.placeable(NO_PROCESS, 64), None);
        // Sizes up to the most a placement carries.
        let mut v = WriteBehind::default();
        assert!(v.defer(NO_PROCESS, 0x1000, &[1; crate::client_place::PLACE_MAX], true));
        assert_eq!(v.placeable(NO_PROCESS, crate::client_place::PLACE_MAX), Some(1));
        assert!(v.defer(NO_PROCESS, 0x9000, &[1; crate::client_place::PLACE_MAX + 1], true));
        assert_eq!(v.placeable(NO_PROCESS, crate::client_place::PLACE_MAX), None);
        w.write_all(true);
        // SAFETY: a plain read of `target`'s buffer, which only the kernel writes (process_vm).
        let now = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 64]) };
        let mut want = [0u8; 64];
        want[..8].fill(2);
        want[8..16].fill(4);
        want[16..24].fill(5);
        want[24..32].fill(6);
        assert_eq!(now, want);
        assert_eq!(w.lost, 0);
    }

    /// Writes to two processes that alternate are made with one call per process (and not one per
    /// run of writes to one process), each process's in the order they were kept (the later of
    /// two overlapping writes wins); not by process, with a call per run.
    #[test]
    fn writes_to_two_processes_take_a_call_each() {
        let target = Box::new([0u8; 16]);
        let base = target.as_ptr() as u64;
        let mut w = WriteBehind::default();
        for k in 0..4u8 {
            assert!(w.defer(me(), base + 4 * u64::from(k % 2), &[k + 1; 8], false));
            assert!(w.defer(NO_PROCESS, base + 64 * u64::from(k), &[9; 8], false));
        }
        w.write_all(true);
        // This process's four writes in one call; the missing process refuses each of its own, and
        // each refusal ends its call (a call per write there).
        assert_eq!((w.calls, w.lost), (1 + 4, 4));
        // SAFETY: as above.
        let now = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 16]) };
        assert_eq!(now[..12], [[3u8; 4].as_slice(), &[4; 8]].concat()[..], "in the order kept");
        // Not by process (shared memory): a call per run, all in the order kept.
        for k in 0..4u8 {
            assert!(w.defer(me(), base + 4 * u64::from(k % 2), &[k + 5; 8], false));
            assert!(w.defer(NO_PROCESS, base + 64 * u64::from(k), &[9; 8], false));
        }
        w.write_all(false);
        assert_eq!(w.calls, 5 + 8);
        // SAFETY: as above.
        let now = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 16]) };
        assert_eq!(now[..12], [[7u8; 4].as_slice(), &[8; 8]].concat()[..]);
    }

    /// A write the process refuses (its page is not mapped) is counted and the ones after it are
    /// still made; a full buffer refuses more.
    #[test]
    fn a_refused_write_is_counted_and_the_rest_are_made() {
        let target = Box::new([0u8; 8]);
        let mut w = WriteBehind::default();
        assert!(w.defer(me(), 8, &[1; 4], false), "page 0 is never mapped");
        assert!(w.defer(me(), target.as_ptr() as u64, &[7; 8], false));
        w.write_all(true);
        assert_eq!(w.lost, 1);
        // SAFETY: as above.
        let now = unsafe { std::ptr::read_volatile(target.as_ptr() as *const [u8; 8]) };
        assert_eq!(now, [7; 8]);
        let apart = vec![0u8; 2 * MAX_WRITES + 2];
        for k in 0..MAX_WRITES {
            assert!(w.defer(me(), apart.as_ptr() as u64 + 2 * k as u64, &[1], false));
        }
        assert!(!w.defer(me(), apart.as_ptr() as u64 + 2 * MAX_WRITES as u64, &[1], false), "MAX_WRITES");
        w.write_all(true);
        assert!(!w.defer(me(), target.as_ptr() as u64, &vec![0; BUDGET + 1], false), "over the budget");
    }

    /// The budget bounds what one pass reads ahead; a range that does not fit (or is empty) is
    /// left out, and smaller ones after it are still read ahead.
    #[test]
    fn the_budget_bounds_a_pass() {
        let buf = Box::new([4u8; 64]);
        let mut p = ReadAhead::default();
        p.add(me(), buf.as_ptr() as u64, 0);
        p.add(me(), 4096, BUDGET + 1);
        p.add(me(), buf.as_ptr() as u64, 64);
        p.read_all();
        let mut out = [0u8; 64];
        assert!(p.get(me(), buf.as_ptr() as u64, &mut out));
        assert_eq!(out, [4u8; 64]);
        p.clear();
        p.add(me(), buf.as_ptr() as u64, 32);
        p.add(me(), 4096, BUDGET - 31);
        assert_eq!(p.bytes.len(), 32, "what does not fit is left out");
    }
}
