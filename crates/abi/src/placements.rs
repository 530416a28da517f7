//! Placements: small writes into a client's own memory that the client makes itself.
//!
//! softrdmad reaches memory a client registered from its own heap (`ibv_reg_mr` of a `malloc`ed
//! buffer) with `process_vm_writev`, about half a microsecond per call. For a small received
//! payload (a SEND's data, a READ response's, an atomic's original value: writes a work request
//! of the client's own asked for, which its application may look at only after polling their
//! completion) the daemon instead writes the bytes and their destination into this ring, shared
//! with the client, and the client's library copies them into place when its poll reaches the
//! completion that names them ([`crate::slot::cqe_places`]).
//!
//! Either side may make an entry, exactly once: the client when it polls, the daemon when it is
//! about to touch that client's memory otherwise (a read, another write, a deregistration) and
//! the client has not yet. Each takes an entry with a compare-and-swap of its word from
//! [`State::Pending`] to [`State::Client`] or [`State::Daemon`], copies, and stores
//! [`State::Done`]. Both walk the entries in order and wait at an entry the other side took
//! until it is done, so the writes land in the order the daemon made them, whoever makes them.
//!
//! Layout (bytes, little-endian host):
//!
//! ```text
//!   0  magic u32, version u32, capacity u32, slot size u32   (written once by the daemon)
//!  64  tail u32: every entry before it is done (written by the daemon)
//! 256  capacity × SLOT bytes of slots
//! slot: 0 word u64 (entry number in the low 32 bits, state in the high 32)
//!       8 address u64 | 16 length u32 | 24 data (up to DATA_MAX bytes)
//! ```
//!
//! Entries are numbered from 0 and wrap at 2³²; entry `n` lives in slot `n % capacity`, and its
//! word names `n`, so a walker that finds another number there knows its entry was done and the
//! slot taken again. Nothing read here is trusted beyond its bounds: a length is cut to
//! [`DATA_MAX`], and a word that names no entry the walker expects stops its walk.

use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// "SPLC".
pub const PLACEMENTS_MAGIC: u32 = 0x434c_5053;
/// Bytes before the first slot.
pub const HEADER_LEN: usize = 256;
/// Bytes per slot.
pub const SLOT: usize = 512;
/// Bytes of data before it in a slot.
const DATA_AT: usize = 24;
/// Most bytes one entry carries.
pub const DATA_MAX: usize = SLOT - DATA_AT;
/// Slots of the ring softrdmad gives each client process.
pub const CAPACITY: u32 = 256;
const TAIL: usize = 64;

/// Bytes of shared memory a ring of `capacity` slots needs.
pub const fn placements_bytes(capacity: u32) -> usize {
    HEADER_LEN + capacity as usize * SLOT
}

/// Where an entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Written by the daemon; nobody has taken it.
    Pending = 1,
    /// The client is copying it.
    Client = 2,
    /// The daemon is writing it.
    Daemon = 3,
    /// Made.
    Done = 4,
}

impl State {
    fn from(v: u32) -> Option<State> {
        Some(match v {
            1 => State::Pending,
            2 => State::Client,
            3 => State::Daemon,
            4 => State::Done,
            _ => return None,
        })
    }
}

/// What a slot's word says of entry `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The slot holds entry `n`, in this state.
    Is(State),
    /// The slot holds a later entry: `n` was done and its slot taken again.
    Later,
    /// The slot holds an earlier entry, or garbage: `n` was never written.
    Missing,
}

/// A view of one placement ring in a mapping. It does not own the memory: its owner (a
/// [`crate::shm::Shm`]) must outlive it.
#[derive(Debug)]
pub struct Placements {
    base: *mut u8,
    capacity: u32,
}

// SAFETY: the ring is only touched through atomics and byte copies; the memory is shared with
// another process anyway, so sharing it between threads adds nothing.
unsafe impl Send for Placements {}
// SAFETY: as above.
unsafe impl Sync for Placements {}

fn word_of(n: u32, s: State) -> u64 {
    u64::from(n) | (s as u64) << 32
}

impl Placements {
    /// A ring at `base`.
    ///
    /// # Safety
    /// `base` must be 64-byte aligned and valid for reads and writes of
    /// `placements_bytes(capacity)` bytes for as long as the ring is used. `capacity` must be a
    /// power of two.
    pub unsafe fn new(base: *mut u8, capacity: u32) -> Placements {
        assert!(capacity.is_power_of_two() && (base as usize).is_multiple_of(64));
        Placements { base, capacity }
    }

    /// What the header's first four words say of this ring.
    fn header_words(&self) -> [u32; 4] {
        [PLACEMENTS_MAGIC, crate::ABI_VERSION, self.capacity, SLOT as u32]
    }

    /// Write the header (the daemon, once, on zeroed memory: every slot's word is 0, no entry).
    pub fn init(&self) {
        for (i, w) in self.header_words().iter().enumerate() {
            self.header(4 * i).store(*w, Ordering::Relaxed);
        }
        self.header(TAIL).store(0, Ordering::Release);
    }

    /// Whether the header matches this ring's parameters (the client's check after mapping).
    pub fn header_ok(&self) -> bool {
        self.header_words().iter().enumerate().all(|(i, w)| self.header(4 * i).load(Ordering::Relaxed) == *w)
    }

    /// Slots.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Every entry before this one is done (as the daemon last said).
    pub fn tail(&self) -> u32 {
        self.header(TAIL).load(Ordering::Acquire)
    }

    /// Say that every entry before `n` is done (the daemon).
    pub fn set_tail(&self, n: u32) {
        self.header(TAIL).store(n, Ordering::Release);
    }

    /// Write entry `n`: `data` (at most [`DATA_MAX`] bytes) to be placed at `addr`; published
    /// [`State::Pending`] with a release store after the bytes (the daemon, into a slot whose
    /// entry is done).
    pub fn write(&self, n: u32, addr: u64, data: &[u8]) {
        assert!(data.len() <= DATA_MAX);
        let s = self.slot(n);
        // SAFETY: the slot lies in the mapping (`slot`); the header fields and data fit in SLOT
        // bytes (asserted above); nobody else writes a slot whose entry is done, and a reader
        // looks at these bytes only after the release store below names entry `n`.
        unsafe {
            ptr::write_unaligned(s.add(8) as *mut u64, addr);
            ptr::write_unaligned(s.add(16) as *mut u32, data.len() as u32);
            ptr::copy_nonoverlapping(data.as_ptr(), s.add(DATA_AT), data.len());
        }
        self.word(n).store(word_of(n, State::Pending), Ordering::Release);
    }

    /// What slot of entry `n` says of it.
    pub fn seen(&self, n: u32) -> Seen {
        see(n, self.word(n).load(Ordering::Acquire))
    }

    /// Take entry `n` for `by` ([`State::Client`] or [`State::Daemon`]) if nobody has: `Ok` when
    /// taken, else what its slot says now.
    pub fn take(&self, n: u32, by: State) -> Result<(), Seen> {
        self.word(n)
            .compare_exchange(word_of(n, State::Pending), word_of(n, by), Ordering::Acquire, Ordering::Acquire)
            .map(|_| ())
            .map_err(|w| see(n, w))
    }

    /// The destination and bytes of entry `n`, taken by the caller: the address, and the data
    /// copied into `out` (at least [`DATA_MAX`] bytes); returns the length.
    pub fn read(&self, n: u32, out: &mut [u8]) -> (u64, usize) {
        let (addr, from, len) = self.data(n);
        let len = len.min(out.len());
        // SAFETY: `data` keeps the bytes inside the slot, in the mapping; `len` fits `out`.
        unsafe { ptr::copy_nonoverlapping(from, out.as_mut_ptr(), len) };
        (addr, len)
    }

    /// The destination, and a pointer to the bytes and their length, of entry `n`, taken by the
    /// caller (the client copies from the ring straight into place).
    pub fn data(&self, n: u32) -> (u64, *const u8, usize) {
        let s = self.slot(n);
        // SAFETY: the slot lies in the mapping; the header fields lie in the slot, and the
        // length is cut to DATA_MAX so that the bytes do too.
        unsafe {
            let addr = ptr::read_unaligned(s.add(8) as *const u64);
            let len = (ptr::read_unaligned(s.add(16) as *const u32) as usize).min(DATA_MAX);
            (addr, s.add(DATA_AT), len)
        }
    }

    /// Entry `n`, taken by the caller, is made.
    pub fn finish(&self, n: u32) {
        self.word(n).store(word_of(n, State::Done), Ordering::Release);
    }

    fn header(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is one of the header words, inside the mapping and 4-byte aligned; every
        // access to them, in both processes, is atomic; the mapping outlives `self`.
        unsafe { AtomicU32::from_ptr(self.base.add(off) as *mut u32) }
    }

    fn slot(&self, n: u32) -> *mut u8 {
        let i = (n & (self.capacity - 1)) as usize;
        // SAFETY: i < capacity, so the slot lies within the mapping.
        unsafe { self.base.add(HEADER_LEN + i * SLOT) }
    }

    fn word(&self, n: u32) -> &AtomicU64 {
        // SAFETY: the word opens the slot, inside the mapping and 8-byte aligned (the base is
        // 64-byte aligned, slots multiples of 64); both sides access it only atomically.
        unsafe { AtomicU64::from_ptr(self.slot(n) as *mut u64) }
    }
}

fn see(n: u32, w: u64) -> Seen {
    let (at, state) = (w as u32, (w >> 32) as u32);
    match (at.wrapping_sub(n) as i32, State::from(state)) {
        (0, Some(s)) => Seen::Is(s),
        (d, Some(_)) if d > 0 => Seen::Later,
        _ => Seen::Missing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::Shm;

    fn ring(capacity: u32) -> (Shm, Placements) {
        let shm = Shm::create("test-placements", placements_bytes(capacity)).unwrap();
        let p = shm.placements(0, capacity).unwrap();
        p.init();
        (shm, p)
    }

    #[test]
    fn an_entry_is_taken_once_and_reads_back() {
        let (_shm, p) = ring(4);
        assert!(p.header_ok());
        assert_eq!(p.seen(0), Seen::Missing);
        p.write(0, 0x1234, b"payload");
        assert_eq!(p.seen(0), Seen::Is(State::Pending));
        assert_eq!(p.take(0, State::Client), Ok(()));
        assert_eq!(p.take(0, State::Daemon), Err(Seen::Is(State::Client)));
        let mut out = [0u8; DATA_MAX];
        assert_eq!(p.read(0, &mut out), (0x1234, 7));
        assert_eq!(&out[..7], b"payload");
        let (addr, ptr, len) = p.data(0);
        // SAFETY: the pointer and length name bytes inside the slot.
        assert_eq!((addr, unsafe { std::slice::from_raw_parts(ptr, len) }), (0x1234, &b"payload"[..]));
        p.finish(0);
        assert_eq!(p.seen(0), Seen::Is(State::Done));
        assert_eq!(p.take(0, State::Daemon), Err(Seen::Is(State::Done)));
    }

    #[test]
    fn a_slot_taken_again_says_its_old_entry_is_done() {
        let (_shm, p) = ring(4);
        for n in 0..5 {
            p.write(n, u64::from(n), &[n as u8]);
            assert_eq!(p.take(n, State::Daemon), Ok(()));
            p.finish(n);
        }
        // Entry 4 lives where entry 0 did.
        assert_eq!(p.seen(0), Seen::Later);
        assert_eq!(p.take(0, State::Client), Err(Seen::Later));
        // Entry 8, not written yet, is missing; so is one the slot's word never named.
        assert_eq!(p.seen(8), Seen::Missing);
        assert_eq!(p.seen(1), Seen::Is(State::Done));
        // Numbers wrap.
        p.write(u32::MAX, 9, b"x");
        assert_eq!(p.seen(u32::MAX), Seen::Is(State::Pending));
        assert_eq!(p.seen(u32::MAX - 4), Seen::Later);
    }

    #[test]
    fn garbage_in_a_slot_is_cut_to_the_slot() {
        let (shm, p) = ring(2);
        p.write(1, 7, b"abc");
        // A hostile length: the read stays inside the slot.
        let at = HEADER_LEN + SLOT + 16;
        // SAFETY: a test's own mapping, inside its bounds.
        unsafe { ptr::write_unaligned(shm_ptr(&shm).add(at) as *mut u32, u32::MAX) };
        let mut out = [0u8; 4 * DATA_MAX];
        assert_eq!(p.read(1, &mut out).1, DATA_MAX);
        assert_eq!(p.data(1).2, DATA_MAX);
        // A word with an unknown state names no entry.
        // SAFETY: as above.
        unsafe { ptr::write_unaligned(shm_ptr(&shm).add(HEADER_LEN + SLOT) as *mut u64, 1 | 9 << 32) };
        assert_eq!(p.seen(1), Seen::Missing);
        assert_eq!(p.take(1, State::Client), Err(Seen::Missing));
    }

    fn shm_ptr(shm: &Shm) -> *mut u8 {
        shm.placements(0, 2).unwrap().base
    }
}
