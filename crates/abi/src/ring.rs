//! Single-producer single-consumer rings in memory shared by an application and the daemon.
//!
//! Layout (all offsets in bytes, little-endian host):
//!
//! ```text
//!   0  magic u32, version u32, capacity u32, slot_size u32   (written once by the creator)
//!  16  where the producer's polling thread runs (AtomicU64, written by the producer when it
//!      changes: same-host lanes, and softrdmad's device loop in CQ rings; see
//!      `Ring::producer_cpu`): its CPU + 1 in the low 32 bits (0: not said), an id of that thread
//!      in the high 32 bits
//!  64  producer index  (AtomicU32, written only by the producer)
//!  68  writes made     (AtomicU32, written only by the producer: in CQ rings, the last batch of
//!      softrdmad's writes to clients' memory it has made; see `Ring::writes_made`)
//! 128  consumer index  (AtomicU32, written only by the consumer)
//! 192  consumer flags  (AtomicU32, written by the consumer, cleared by the producer)
//! 256  capacity × slot_size bytes of slots
//! ```
//!
//! Indices run freely and wrap at 2³²; a slot is `index & (capacity - 1)` (capacity is a power of
//! two). The producer writes a slot, then publishes it with a release store of the producer index
//! (a burst of slots can be published with one store); the consumer reads the index with acquire,
//! copies the slot out, then releases it by storing the consumer index. Each side keeps its own
//! index locally and never reads it back from shared memory, and checks the other side's index
//! against the capacity, so a corrupted or hostile peer can at worst make its own ring look full,
//! empty or garbage: never make us read out of bounds.
//!
//! Doorbells ("polling then sleeping"): before it sleeps, the consumer of a work queue sets
//! [`NEED_DOORBELL`] in the flags, issues a full fence and looks at the producer index once more.
//! The producer, after publishing, issues a full fence and, if the flag is set, clears it and rings
//! the doorbell (one `write` to an eventfd). With both fences one of the two always sees the other:
//! either the consumer sees the new entry and does not sleep, or the producer sees the flag and
//! wakes it. While the consumer is busy, posting costs no system call. Completion queues use the
//! same word for "armed" ([`ARMED_ANY`], [`ARMED_SOLICITED`]), set by the application
//! (`req_notify`) and cleared by the daemon when it sends the channel event.

use std::ptr;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// "SRNG".
pub const RING_MAGIC: u32 = 0x474e_5253;
/// Bytes before the first slot.
pub const HEADER_LEN: usize = 256;
const PRODUCER: usize = 64;
const WRITES_MADE: usize = 68;
const CONSUMER: usize = 128;
const FLAGS: usize = 192;
const PRODUCER_CPU: usize = 16;

/// How many entries ahead of the one it writes the producer asks for slots' lines (see
/// [`Producer::prefetch_ahead`]).
const PREFETCH_AHEAD: u32 = 8;

/// Whether the CPU has `prefetchw` (CPUID 0x8000_0001, ECX bit 8), asked once.
#[cfg(target_arch = "x86_64")]
fn has_prefetchw() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        #[allow(unused_unsafe)]
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 0x8000_0000 says which extended leaves do.
        let max = unsafe { __cpuid(0x8000_0000) }.eax;
        #[allow(unused_unsafe)]
        // SAFETY: as above, and leaf 0x8000_0001 is within the range the CPU reported.
        let ecx = if max >= 0x8000_0001 { unsafe { __cpuid(0x8000_0001) }.ecx } else { 0 };
        ecx & (1 << 8) != 0
    })
}

/// Where a tagged ring keeps each slot's sequence number (see [`Producer::publish_tagged`]).
pub const TAG_AT: usize = 4;

/// Work queue flag: the consumer sleeps; ring the doorbell after posting.
pub const NEED_DOORBELL: u32 = 1;
/// Completion queue flag: an event on the next completion.
pub const ARMED_ANY: u32 = 1;
/// Completion queue flag: an event on the next solicited (or error) completion.
pub const ARMED_SOLICITED: u32 = 2;

/// The other side broke the ring's invariants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingCorrupt;

impl std::fmt::Display for RingCorrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ring index out of range (corrupted by the peer)")
    }
}

/// Bytes of shared memory a ring of `capacity` slots of `slot_size` bytes needs.
pub const fn ring_bytes(capacity: u32, slot_size: u32) -> usize {
    HEADER_LEN + capacity as usize * slot_size as usize
}

/// A view of one ring in a mapping. It does not own the memory: its owner (a [`crate::shm::Shm`])
/// must outlive it, which the [`Producer`] and [`Consumer`] wrappers' users ensure by keeping both
/// in one struct.
#[derive(Debug)]
pub struct Ring {
    base: *mut u8,
    capacity: u32,
    slot_size: u32,
}

// SAFETY: the ring is only touched through atomics and byte copies; the memory is shared with
// another process anyway, so sharing it between threads adds nothing.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    /// A ring at `base`.
    ///
    /// # Safety
    /// `base` must be 64-byte aligned and valid for reads and writes of
    /// `ring_bytes(capacity, slot_size)` bytes for as long as the ring (or anything made from it)
    /// is used. `capacity` must be a power of two.
    pub unsafe fn new(base: *mut u8, capacity: u32, slot_size: u32) -> Ring {
        assert!(capacity.is_power_of_two() && slot_size > 0 && (base as usize).is_multiple_of(64));
        Ring { base, capacity, slot_size }
    }

    /// Write the header and zero the indices (the creator does this once).
    pub fn init(&self) {
        let words = [RING_MAGIC, crate::ABI_VERSION, self.capacity, self.slot_size];
        for (i, w) in words.iter().enumerate() {
            // SAFETY: the header lies within the mapping (see `new`); offset 4*i < 16.
            unsafe { ptr::write_volatile(self.base.add(4 * i) as *mut u32, *w) };
        }
        self.word(PRODUCER).store(0, Ordering::Relaxed);
        self.word(WRITES_MADE).store(0, Ordering::Relaxed);
        self.word(CONSUMER).store(0, Ordering::Relaxed);
        self.word(FLAGS).store(0, Ordering::Relaxed);
        self.word64(PRODUCER_CPU).store(0, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Whether the header matches this ring's parameters (a client's sanity check after mapping).
    pub fn header_ok(&self) -> bool {
        let mut w = [0u32; 4];
        for (i, x) in w.iter_mut().enumerate() {
            // SAFETY: as in `init`.
            *x = unsafe { ptr::read_volatile(self.base.add(4 * i) as *const u32) };
        }
        w == [RING_MAGIC, crate::ABI_VERSION, self.capacity, self.slot_size]
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is one of the header words, inside the mapping and 4-byte aligned (the base
        // is 64-byte aligned); the mapping outlives `self`; every access to these words, in both
        // processes, is atomic.
        unsafe { AtomicU32::from_ptr(self.base.add(off) as *mut u32) }
    }

    /// Slots.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u32 {
        self.slot_size
    }

    /// The consumer flag word.
    pub fn flags(&self) -> &AtomicU32 {
        self.word(FLAGS)
    }

    /// The CPU the producer's side said its polling thread runs on, and that thread's id, if it
    /// said (read together: one word). A hint, in a line that is written rarely: the consumer of
    /// a same-host lane, finding nothing to take, gives up its core at once when the thread that
    /// should answer shares it; a client finding its CQ ring empty moves off the CPU of the
    /// daemon's device loop.
    pub fn producer_cpu(&self) -> Option<(u32, u32)> {
        let w = self.word64(PRODUCER_CPU).load(Ordering::Relaxed);
        let cpu = (w as u32).checked_sub(1)?;
        Some((cpu, (w >> 32) as u32))
    }

    /// The last batch of writes the producer says it has made (a CQ ring: softrdmad's writes to
    /// clients' memory, in batches numbered from 1 and wrapping, 0 skipped). A completion that
    /// names a batch (`slot::cqe_writes`) is handed out once this has reached it: the daemon
    /// publishes completions before it makes the writes they complete, which are system calls,
    /// so that a client's poll finds them without first giving its CPU away for nothing.
    pub fn writes_made(&self) -> u32 {
        self.word(WRITES_MADE).load(Ordering::Acquire)
    }

    /// Say that the writes of `batch` and every batch before it are made (the producer's side,
    /// after making them).
    pub fn say_writes_made(&self, batch: u32) {
        self.word(WRITES_MADE).store(batch, Ordering::Release);
    }

    /// Whether the writes of `batch` are made, as this ring says ([`Ring::writes_made`]): batches
    /// compare as wrapping sequence numbers.
    pub fn batch_made(&self, batch: u32) -> bool {
        (self.writes_made().wrapping_sub(batch) as i32) >= 0
    }

    /// Say that the producer's polling thread `id` runs on `cpu`, or with `None` that no thread
    /// polls (the producer's side; only when it changes, so that the line stays shared).
    pub fn set_producer_cpu(&self, poller: Option<(u32, u32)>) {
        let w = poller.map_or(0, |(cpu, id)| u64::from(id) << 32 | u64::from(cpu.wrapping_add(1)));
        self.word64(PRODUCER_CPU).store(w, Ordering::Relaxed);
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= HEADER_LEN);
        // SAFETY: as in `word`, for an 8-byte header word at an 8-byte aligned offset (checked
        // above; the base is 64-byte aligned).
        unsafe { AtomicU64::from_ptr(self.base.add(off) as *mut u64) }
    }

    /// The 4-byte word at byte `at` of slot `index`, as an atomic.
    fn slot_word(&self, index: u32, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= self.slot_size as usize && self.slot_size.is_multiple_of(4));
        // SAFETY: the word lies inside the slot (checked above), so inside the mapping; it is
        // 4-byte aligned (the base is 64-byte aligned, slot sizes and `at` multiples of 4); both
        // sides access it only atomically; the mapping outlives `self`.
        unsafe { AtomicU32::from_ptr(self.slot_ptr(index).add(at) as *mut u32) }
    }

    fn slot_ptr(&self, index: u32) -> *mut u8 {
        let i = (index & (self.capacity - 1)) as usize;
        // SAFETY: i < capacity, so the slot lies within the mapping.
        unsafe { self.base.add(HEADER_LEN + i * self.slot_size as usize) }
    }
}

/// The producing side of a ring, with its own copy of the producer index.
#[derive(Debug)]
pub struct Producer {
    ring: Ring,
    next: u32,
    /// Slots known to be free without reading the consumer index again (used by `slot_mut`,
    /// `stage` and `room`: the consumer's index lives in a cache line the consumer keeps writing,
    /// so reading it on every entry would cost a cache miss per entry).
    room: u32,
}

impl Producer {
    /// The producer of `ring` (which must be freshly initialised, or only ever produced by us).
    pub fn new(ring: Ring) -> Producer {
        Producer { ring, next: 0, room: 0 }
    }

    /// The ring.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Free slots. A consumer index that is not within `capacity` behind ours counts as a full
    /// ring (the consumer broke the protocol; we stop producing for it).
    pub fn free(&self) -> u32 {
        let cons = self.ring.word(CONSUMER).load(Ordering::Acquire);
        let used = self.next.wrapping_sub(cons);
        // A consumer index that is not within `capacity` behind ours gives 0.
        self.ring.capacity.saturating_sub(used)
    }

    /// Slots free for writing, as last known: the consumer index is read again only when none
    /// were left. At most [`Producer::free`]; a producer that only needs room for what it has
    /// saves a cache miss per call while the consumer keeps up.
    pub fn room(&mut self) -> u32 {
        if self.room == 0 {
            self.room = self.free();
        }
        self.room
    }

    /// Entries written (published or staged) since the ring began: the producer's own index.
    pub fn produced(&self) -> u32 {
        self.next
    }

    /// Entries written (published or staged) and not yet consumed.
    pub fn in_flight(&self) -> u32 {
        self.ring.capacity - self.free()
    }

    /// Copy `slot` (at most `slot_size` bytes) into the next slot and publish it; false if full.
    pub fn push(&mut self, slot: &[u8]) -> bool {
        let staged = self.stage(slot);
        if staged {
            self.publish_staged();
        }
        staged
    }

    /// Copy `slot` (at most `slot_size` bytes) into the next slot without publishing it; false if
    /// full. [`Producer::publish_staged`] then publishes every staged entry with one store, so a
    /// consumer polling the producer index sees a burst once instead of entry by entry. For rings
    /// consumed by the index (not *tagged* ones: a staged entry has no tag).
    pub fn stage(&mut self, slot: &[u8]) -> bool {
        if self.room == 0 {
            self.room = self.free();
            if self.room == 0 {
                return false;
            }
        }
        self.room -= 1;
        let n = slot.len().min(self.ring.slot_size as usize);
        // SAFETY: the destination is a slot inside the mapping (`slot_ptr`), `n` ≤ slot_size, the
        // source is a distinct local buffer. The consumer does not read this slot until the
        // release store of `publish_staged` publishes it.
        unsafe { ptr::copy_nonoverlapping(slot.as_ptr(), self.ring.slot_ptr(self.next), n) };
        self.next = self.next.wrapping_add(1);
        self.prefetch_ahead();
        true
    }

    /// Publish the entries [`Producer::stage`] wrote (one release store of the producer index).
    pub fn publish_staged(&mut self) {
        self.ring.word(PRODUCER).store(self.next, Ordering::Release);
    }

    /// The next free slot, to build an entry in place (no staging copy); `None` if the ring is
    /// full. Nothing is published until [`Producer::publish`]; taking the slot again without
    /// publishing returns the same slot.
    pub fn slot_mut(&mut self) -> Option<&mut [u8]> {
        self.slot_mut_keeping(0)
    }

    /// [`Producer::slot_mut`] that leaves the last `keep` free slots alone: `None` when no more
    /// than `keep` are free. (A same-host lane keeps one for the entry that says its ring moved.)
    pub fn slot_mut_keeping(&mut self, keep: u32) -> Option<&mut [u8]> {
        if self.room <= keep {
            self.room = self.free();
            if self.room <= keep {
                return None;
            }
        }
        // SAFETY: the slot lies inside the mapping (`slot_ptr` masks the index) and is
        // `slot_size` bytes long. It is ours until we publish it: the consumer reads only slots
        // below the producer index, and `free` checked that the consumer released this one. The
        // borrow of `self` keeps the mapping's owner (which outlives `self`) in place.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ring.slot_ptr(self.next), self.ring.slot_size as usize) })
    }

    /// Publish the slot [`Producer::slot_mut`] gave (one release store).
    pub fn publish(&mut self) {
        self.room = self.room.saturating_sub(1);
        self.next = self.next.wrapping_add(1);
        self.ring.word(PRODUCER).store(self.next, Ordering::Release);
        self.prefetch_ahead();
    }

    /// Ask for the first lines of the slot [`PREFETCH_AHEAD`] entries ahead for writing
    /// (`prefetchw`). The consumer read them a lap ago, so its cache still shares them; a store to
    /// a shared line waits for the other core to give it up, and stores leave the core in order:
    /// one such wait per entry held up everything the producer stored after it. Taking the lines
    /// early moves that wait off the producer's path.
    fn prefetch_ahead(&self) {
        #[cfg(target_arch = "x86_64")]
        if has_prefetchw() {
            let p = self.ring.slot_ptr(self.next.wrapping_add(PREFETCH_AHEAD));
            // SAFETY: the CPU has the instruction (checked above). A prefetch only hints the
            // cache: it changes no memory and never faults (the lines are inside the mapping
            // anyway: the slot is, and a second line is asked for only when the slot is longer
            // than one).
            unsafe {
                std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
                if self.ring.slot_size > 64 {
                    std::arch::asm!("prefetchw [{0} + 64]", in(reg) p, options(nostack, preserves_flags, readonly));
                }
            }
        }
    }

    /// Publish the slot [`Producer::slot_mut`] gave in a *tagged* ring: the slot's word at
    /// [`TAG_AT`] gets the entry's sequence number (its index plus one) with a release store,
    /// then the producer index is updated as by [`Producer::publish`]. A consumer using
    /// [`Consumer::front_tagged`] learns of the entry from the slot itself, so a small entry
    /// costs one cache-line transfer between the cores instead of two (the slot and the index).
    /// The entry's own bytes must leave [`TAG_AT`]..+4 alone.
    pub fn publish_tagged(&mut self) {
        let tag = self.next.wrapping_add(1);
        self.ring.slot_word(self.next, TAG_AT).store(tag, Ordering::Release);
        self.publish();
    }

    /// After publishing: whether the consumer asked for a doorbell; clears the request.
    pub fn take_doorbell_request(&self) -> bool {
        fence(Ordering::SeqCst);
        let f = self.ring.flags();
        f.load(Ordering::Relaxed) & NEED_DOORBELL != 0
            && f.fetch_and(!NEED_DOORBELL, Ordering::AcqRel) & NEED_DOORBELL != 0
    }
}

/// The consuming side of a ring, with its own copy of the consumer index.
#[derive(Debug)]
pub struct Consumer {
    ring: Ring,
    next: u32,
}

impl Consumer {
    /// The consumer of `ring`.
    pub fn new(ring: Ring) -> Consumer {
        Consumer { ring, next: 0 }
    }

    /// The ring.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Entries waiting, or an error if the producer index is not within `capacity` ahead of ours.
    pub fn pending(&self) -> Result<u32, RingCorrupt> {
        let prod = self.ring.word(PRODUCER).load(Ordering::Acquire);
        let n = prod.wrapping_sub(self.next);
        if n > self.ring.capacity {
            Err(RingCorrupt)
        } else {
            Ok(n)
        }
    }

    /// Copy the oldest entry into `out` (up to `slot_size` bytes) without consuming it; false if
    /// the ring is empty.
    pub fn peek(&self, out: &mut [u8]) -> Result<bool, RingCorrupt> {
        self.peek_at(0, out)
    }

    /// [`Consumer::peek_at`] that copies only the bytes entry `k` uses: its first `head` bytes,
    /// then the rest of the `used(first bytes)` it says it takes (at most `out.len()` and
    /// `slot_size` in all). The bytes of the slot beyond are not read: an earlier lap left them,
    /// often in the producer's cache, and each line read would be a transfer from its core.
    /// Returns the bytes copied (`None` if fewer than `k + 1` entries wait); the entry is what
    /// these bytes say, whatever the producer writes to the slot meanwhile.
    pub fn peek_used_at(
        &self,
        k: u32,
        out: &mut [u8],
        head: usize,
        used: impl FnOnce(&[u8]) -> usize,
    ) -> Result<Option<usize>, RingCorrupt> {
        if self.pending()? <= k {
            return Ok(None);
        }
        let max = out.len().min(self.ring.slot_size as usize);
        let head = head.min(max);
        let src = self.ring.slot_ptr(self.next.wrapping_add(k));
        // SAFETY: as in `peek_at`: the slot lies in the mapping, `head` ≤ slot_size, the acquire
        // load in `pending` ordered the producer's writes before our reads.
        unsafe { ptr::copy_nonoverlapping(src, out.as_mut_ptr(), head) };
        let n = used(&out[..head]).clamp(head, max);
        // SAFETY: as above, for bytes `head..n` of the slot (n ≤ slot_size).
        unsafe { ptr::copy_nonoverlapping(src.add(head), out.as_mut_ptr().add(head), n - head) };
        Ok(Some(n))
    }

    /// Copy entry `k` (0: the oldest) into `out` (up to `slot_size` bytes) without consuming
    /// anything; false if fewer than `k + 1` entries wait.
    pub fn peek_at(&self, k: u32, out: &mut [u8]) -> Result<bool, RingCorrupt> {
        if self.pending()? <= k {
            return Ok(false);
        }
        let n = out.len().min(self.ring.slot_size as usize);
        // SAFETY: the source is a slot inside the mapping (`slot_ptr` masks the index), `n` ≤
        // slot_size; the acquire load in `pending` ordered the producer's writes of this slot
        // before our read. We copy before we decode, so a producer rewriting the slot meanwhile can
        // only garble its own request.
        unsafe { ptr::copy_nonoverlapping(self.ring.slot_ptr(self.next.wrapping_add(k)), out.as_mut_ptr(), n) };
        Ok(true)
    }

    /// The oldest entry in place (the whole slot, `slot_size` bytes), without copying or consuming
    /// it; `None` if the ring is empty.
    ///
    /// The slot is ours until [`Consumer::advance`]: the producer writes only slots it has not
    /// published or that we released. A producer that breaks that rule and rewrites the slot while
    /// we read it can only garble its own entry's contents, as with [`Consumer::peek`] it could
    /// before the copy: the slice's bounds are ours, so a reader that treats the bytes as untrusted
    /// input (checks every length it reads from them against the slice) stays in bounds.
    pub fn front(&self) -> Result<Option<&[u8]>, RingCorrupt> {
        if self.pending()? == 0 {
            return Ok(None);
        }
        // SAFETY: the slot lies inside the mapping (`slot_ptr` masks the index), `slot_size` bytes;
        // the acquire load in `pending` ordered the producer's writes of it before our reads; the
        // borrow of `self` ends before `advance` can release the slot.
        Ok(Some(unsafe { std::slice::from_raw_parts(self.ring.slot_ptr(self.next), self.ring.slot_size as usize) }))
    }

    /// The oldest entry of a tagged ring (see [`Producer::publish_tagged`]) in place, judged by
    /// the slot's tag alone: `Some` if the slot carries the sequence number of the entry we expect
    /// next. A tag the producer did not write (garbage, a stale lap) reads as "not yet"; the
    /// producer index is not read (check [`Consumer::pending`] now and then to notice a broken
    /// one). The slot is borrowed as in [`Consumer::front`].
    pub fn front_tagged(&self) -> Option<&[u8]> {
        let tag = self.ring.slot_word(self.next, TAG_AT).load(Ordering::Acquire);
        if tag != self.next.wrapping_add(1) {
            return None;
        }
        // SAFETY: as in `front`: the slot lies inside the mapping; the acquire load of its tag
        // ordered the producer's writes of the slot before our reads; the borrow of `self` ends
        // before `advance` can release it.
        Some(unsafe { std::slice::from_raw_parts(self.ring.slot_ptr(self.next), self.ring.slot_size as usize) })
    }

    /// For a tagged ring: whether the producer index is plausible. The producer stores the tag
    /// before the index, so a consumer going by tags may be one entry ahead of the index for a
    /// moment; anything else further than `capacity` from our index is a broken ring.
    pub fn tagged_index_ok(&self) -> bool {
        let prod = self.ring.word(PRODUCER).load(Ordering::Acquire);
        prod.wrapping_sub(self.next) <= self.ring.capacity || self.next.wrapping_sub(prod) <= 1
    }

    /// Release the oldest entry.
    pub fn advance(&mut self) {
        self.next = self.next.wrapping_add(1);
        self.ring.word(CONSUMER).store(self.next, Ordering::Release);
    }

    /// Copy out and release the oldest entry.
    pub fn pop(&mut self, out: &mut [u8]) -> Result<bool, RingCorrupt> {
        let got = self.peek(out)?;
        if got {
            self.advance();
        }
        Ok(got)
    }

    /// Before sleeping: ask for a doorbell, then look again. Returns true if the ring is still
    /// empty (safe to sleep); false if entries arrived (the request stays set; harmless).
    pub fn request_doorbell(&self) -> bool {
        self.ring.flags().fetch_or(NEED_DOORBELL, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        matches!(self.pending(), Ok(0))
    }

    /// Withdraw a doorbell request (the consumer is polling again).
    pub fn cancel_doorbell(&self) {
        self.ring.flags().fetch_and(!NEED_DOORBELL, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(64))]
    struct Mem([u8; 256 + 4 * 32]);

    fn ring(mem: &mut Mem) -> Ring {
        // SAFETY: the buffer is aligned and large enough for 4 slots of 32 bytes, and outlives
        // the ring within the test.
        unsafe { Ring::new(mem.0.as_mut_ptr(), 4, 32) }
    }

    #[test]
    fn staged_entries_appear_together_when_published() {
        let mut mem = Mem([0; 256 + 128]);
        ring(&mut mem).init();
        let mut p = Producer::new(ring(&mut mem));
        let mut c = Consumer::new(ring(&mut mem));
        let mut out = [0u8; 32];
        for round in 0..3u8 {
            assert!(p.stage(&[round, 0]));
            assert!(p.stage(&[round, 1]));
            assert_eq!(c.pending().unwrap(), 0, "staged, not published");
            assert!(!c.pop(&mut out).unwrap());
            p.publish_staged();
            assert_eq!(c.pending().unwrap(), 2);
            assert!(p.stage(&[round, 2]) && p.stage(&[round, 3]));
            assert!(!p.stage(&[9]), "staged entries take room: the ring is full");
            p.publish_staged();
            for i in 0..4u8 {
                assert!(c.pop(&mut out).unwrap());
                assert_eq!(&out[..2], &[round, i]);
            }
            assert!(!c.pop(&mut out).unwrap());
        }
    }

    /// A peek of the used bytes copies the head, then what the head says is used, never beyond
    /// the slot or the buffer, and leaves the rest of the buffer as it was.
    #[test]
    fn peek_used_copies_only_what_the_entry_says_it_uses() {
        let mut mem = Mem([0; 256 + 128]);
        ring(&mut mem).init();
        let mut p = Producer::new(ring(&mut mem));
        let c = Consumer::new(ring(&mut mem));
        let mut out = [0xeeu8; 32];
        assert_eq!(c.peek_used_at(0, &mut out, 4, |_| 32).unwrap(), None);
        let entry: Vec<u8> = (0..32).collect();
        assert!(p.push(&entry));
        // The first byte says how many bytes the entry uses.
        let mut e = entry.clone();
        e[0] = 10;
        assert!(p.push(&e));
        let used = |h: &[u8]| usize::from(h[0]);
        assert_eq!(c.peek_used_at(0, &mut out, 4, used).unwrap(), Some(4), "uses 0: the head still");
        assert_eq!(&out[..4], &entry[..4]);
        assert!(out[4..].iter().all(|&b| b == 0xee), "nothing beyond the head");
        assert_eq!(c.peek_used_at(1, &mut out, 4, used).unwrap(), Some(10));
        assert_eq!(&out[..10], &e[..10]);
        assert!(out[10..].iter().all(|&b| b == 0xee));
        // More than the slot or the buffer holds: cut to them.
        assert_eq!(c.peek_used_at(1, &mut out, 4, |_| 1000).unwrap(), Some(32));
        assert_eq!(&out[..], &e[..]);
        let mut small = [0u8; 8];
        assert_eq!(c.peek_used_at(1, &mut small, 4, |_| 1000).unwrap(), Some(8));
        assert_eq!(&small[..], &e[..8]);
        assert_eq!(c.peek_used_at(2, &mut out, 4, used).unwrap(), None);
        // A buffer longer than the slot gets the slot only, and a head longer than both the slot.
        let mut long = [0xeeu8; 100];
        assert_eq!(c.peek_used_at(1, &mut long, 4, |_| 1000).unwrap(), Some(32));
        assert_eq!(&long[..32], &e[..]);
        assert!(long[32..].iter().all(|&b| b == 0xee), "nothing beyond the slot");
        long.fill(0xee);
        assert_eq!(c.peek_used_at(1, &mut long, usize::MAX, <[u8]>::len).unwrap(), Some(32));
        assert_eq!(&long[..32], &e[..]);
        assert!(long[32..].iter().all(|&b| b == 0xee));
    }

    /// The batch of writes a ring says is made: none at first, then what the producer said last;
    /// a batch counts as made once one at or after it (as wrapping sequence numbers) is said.
    #[test]
    fn a_ring_says_which_writes_are_made() {
        let mut mem = Mem([0; 256 + 128]);
        let r = ring(&mut mem);
        r.word(WRITES_MADE).store(77, Ordering::Relaxed);
        r.init();
        assert_eq!(r.writes_made(), 0);
        assert!(!r.batch_made(1));
        r.say_writes_made(3);
        assert!(r.batch_made(1) && r.batch_made(3) && !r.batch_made(4));
        r.say_writes_made(u32::MAX);
        assert!(r.batch_made(u32::MAX - 5) && !r.batch_made(1));
        r.say_writes_made(2);
        assert!(r.batch_made(u32::MAX) && r.batch_made(1) && r.batch_made(2) && !r.batch_made(3));
        // The producer index beside it is its own word.
        assert_eq!(Consumer::new(ring(&mut mem)).pending(), Ok(0));
    }

    /// The room as last known is what is left of the last reading of the consumer index; the
    /// index is read again only once none is left, and never more than is free is claimed.
    #[test]
    fn room_is_read_again_only_when_none_is_left() {
        let mut mem = Mem([0; 256 + 128]);
        ring(&mut mem).init();
        let mut p = Producer::new(ring(&mut mem));
        let mut c = Consumer::new(ring(&mut mem));
        let mut out = [0u8; 32];
        assert_eq!(p.room(), 4);
        assert!(p.push(&[1]) && p.push(&[2]) && p.push(&[3]));
        assert_eq!(p.room(), 1);
        assert!(c.pop(&mut out).unwrap() && c.pop(&mut out).unwrap());
        assert_eq!(p.free(), 3);
        assert_eq!(p.room(), 1, "one left as last known: the index is not read again");
        assert!(p.push(&[4]));
        assert_eq!(p.room(), 2, "none left: read again");
        assert!(p.push(&[5]) && p.push(&[6]));
        assert_eq!((p.room(), p.free()), (0, 0));
        assert!(!p.push(&[7]));
    }

    /// The producer's CPU and poller: none until said (CPU 0 included), then what was said last,
    /// none again once withdrawn; the header's other words are untouched.
    #[test]
    fn the_producer_says_its_cpu() {
        let mut mem = Mem([0; 256 + 128]);
        ring(&mut mem).init();
        let p = Producer::new(ring(&mut mem));
        let c = Consumer::new(ring(&mut mem));
        assert_eq!(c.ring().producer_cpu(), None);
        for (cpu, id) in [(0, 4242), (1, 0), (63, u32::MAX), (1000, 0x8000_0001)] {
            p.ring().set_producer_cpu(Some((cpu, id)));
            assert_eq!(c.ring().producer_cpu(), Some((cpu, id)));
        }
        p.ring().set_producer_cpu(None);
        assert_eq!(c.ring().producer_cpu(), None);
        assert!(c.ring().header_ok());
    }

    /// `peek_at` sees the k-th waiting entry without consuming anything, across the wrap, and
    /// nothing beyond what waits.
    #[test]
    fn peek_at_looks_ahead_without_consuming() {
        let mut mem = Mem([0; 256 + 128]);
        ring(&mut mem).init();
        let mut p = Producer::new(ring(&mut mem));
        let mut c = Consumer::new(ring(&mut mem));
        let mut out = [0u8; 32];
        for round in 0..5u8 {
            for i in 0..3u8 {
                assert!(p.push(&[round, i]));
            }
            for k in 0..3u8 {
                assert!(c.peek_at(u32::from(k), &mut out).unwrap());
                assert_eq!(out[..2], [round, k]);
            }
            assert!(!c.peek_at(3, &mut out).unwrap(), "only three wait");
            assert_eq!(c.pending().unwrap(), 3, "nothing consumed");
            for i in 0..3u8 {
                assert!(c.pop(&mut out).unwrap());
                assert_eq!(out[..2], [round, i]);
            }
        }
    }

    #[test]
    fn push_pop_wrap_full_and_doorbell() {
        let mut mem = Mem([0; 256 + 128]);
        let r = ring(&mut mem);
        r.init();
        assert!(r.header_ok());
        let mut p = Producer::new(ring(&mut mem));
        let mut c = Consumer::new(ring(&mut mem));
        let mut out = [0u8; 32];
        assert!(!c.pop(&mut out).unwrap());
        for round in 0..10u8 {
            for i in 0..4u8 {
                assert!(p.push(&[round, i]));
            }
            assert!(!p.push(&[9]), "full");
            assert_eq!(c.pending().unwrap(), 4);
            for i in 0..4u8 {
                assert!(c.pop(&mut out).unwrap());
                assert_eq!(&out[..2], &[round, i]);
            }
        }
        assert!(c.request_doorbell());
        assert!(p.push(&[1]));
        assert!(p.take_doorbell_request());
        assert!(!p.take_doorbell_request(), "cleared");
        assert!(!c.request_doorbell(), "not empty");
    }

    #[test]
    fn in_place_slots() {
        let mut mem = Mem([0; 256 + 128]);
        let r = ring(&mut mem);
        r.init();
        let mut p = Producer::new(ring(&mut mem));
        let c = Consumer::new(ring(&mut mem));
        let mut c = c;
        assert_eq!(c.front().unwrap(), None);
        for round in 0..3u8 {
            for i in 0..4u8 {
                let s = p.slot_mut().expect("free slot");
                assert_eq!(s.len(), 32);
                s[0] = round;
                s[1] = i;
                p.publish();
            }
            assert!(p.slot_mut().is_none(), "full");
            for i in 0..4u8 {
                let s = c.front().unwrap().expect("entry");
                assert_eq!(&s[..2], &[round, i]);
                c.advance();
            }
            assert_eq!(c.front().unwrap(), None);
        }
        // Tagged: the consumer goes by the slots' tags.
        for round in 0..6u8 {
            assert!(c.front_tagged().is_none());
            let s = p.slot_mut().expect("free slot");
            s[0] = round;
            p.publish_tagged();
            let s = c.front_tagged().expect("entry");
            assert_eq!(s[0], round);
            c.advance();
        }
        assert!(c.front_tagged().is_none());
        // The consumer may run one entry ahead of the producer index (tag stored first), no more.
        assert!(c.tagged_index_ok());
        let prod = r.word(PRODUCER).load(Ordering::Relaxed);
        r.word(PRODUCER).store(prod.wrapping_sub(1), Ordering::Relaxed);
        assert!(c.tagged_index_ok());
        r.word(PRODUCER).store(prod.wrapping_sub(2), Ordering::Relaxed);
        assert!(!c.tagged_index_ok());
        r.word(PRODUCER).store(prod.wrapping_add(5), Ordering::Relaxed);
        assert!(!c.tagged_index_ok());
        r.word(PRODUCER).store(prod, Ordering::Relaxed);
    }

    #[test]
    fn hostile_indices_are_refused() {
        let mut mem = Mem([0; 256 + 128]);
        let r = ring(&mut mem);
        r.init();
        let c = Consumer::new(ring(&mut mem));
        r.word(PRODUCER).store(1000, Ordering::Relaxed);
        assert_eq!(c.pending(), Err(RingCorrupt));
        let mut out = [0u8; 32];
        assert!(c.peek(&mut out).is_err());
        let p = Producer::new(ring(&mut mem));
        r.word(CONSUMER).store(77, Ordering::Relaxed);
        assert_eq!(p.free(), 0);
    }
}
