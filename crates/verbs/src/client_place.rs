//! softrdmad's side of placements (`softrdma_abi::placements`): small writes into a client's own
//! memory handed to the client to make when it polls, and taken back before anything else
//! touches that memory.
//!
//! A write the device keeps behind for a region reached through process_vm (client_io.rs) costs
//! a `process_vm_writev`, about half a microsecond, during which the completion it belongs to
//! waits. When every write a pass keeps for a process is one its client's work request asked for
//! (a receive's data, a READ response's, an atomic's original value: bytes the application may
//! look at only after polling the completion) and small, they go into that process's placement
//! ring instead, and the completions published in the pass name the ring's end
//! (`slot::set_cqe_places`): the client's poll copies them into place before it hands a
//! completion out.
//!
//! The daemon must take those that are still waiting back before it touches that process's
//! memory any other way: a read (a gather, a READ's or atomic's target), a write it makes itself,
//! a deregistration. [`ClientPlacements::reclaim`] does: it takes every entry nobody has taken
//! and makes it with one `process_vm_writev`, and waits for an entry the client is copying.
//! The writes thus land in the order they were kept, whoever makes them, and before any access
//! that could see or overwrite them.
//!
//! The loop serves other clients too, so it waits for one process's copies from a budget of
//! [`CLIENT_WAIT`] that a second gives back [`REFILL_PER_SECOND`] of ([`Budget`]). A process that
//! uses it up (a thread stopped in the middle of a copy of at most 488 bytes, or a hostile
//! client) is given up on, counted, handed nothing more and never waited for again; the tail its threads see stops at the entry it holds, so none of them hands out a
//! completion past it. What it then risks is its own: that entry's copy may land after a later
//! access to the same bytes.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use softrdma_abi::placements::{placements_bytes, Placements, Seen, State, CAPACITY, DATA_MAX};
use softrdma_abi::shm::Shm;

use crate::client_io::WriteBehind;

/// Longest the device loop waits for one process's copies of entries it took, from a full
/// budget ([`Budget`]).
const CLIENT_WAIT: Duration = Duration::from_millis(10);

/// What a second of the process's life gives back of it: a thread descheduled now and then in
/// the middle of a copy is waited for, one that is stopped, or a process that holds entries on
/// purpose, uses the budget up.
const REFILL_PER_SECOND: Duration = Duration::from_millis(1);

/// Most bytes one write may have to be handed out.
pub(crate) const PLACE_MAX: usize = DATA_MAX;

/// One process's ring.
struct Ring {
    // Declared before the mapping it views: dropped first.
    ring: Placements,
    shm: Shm,
    /// The next entry to write.
    head: u32,
    /// Every entry before it is done.
    tail: u32,
    /// Sessions of the process on this device that were given the ring.
    sessions: u32,
}

/// How long the loop may still wait for one process's copies: [`CLIENT_WAIT`] at most,
/// refilled by [`REFILL_PER_SECOND`]. Emptied, the process is given up for good: nothing more is
/// handed to it and no copy of it is waited for again.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: Duration,
    at: Instant,
    given_up: bool,
}

impl Budget {
    fn full(now: Instant, size: Duration) -> Budget {
        Budget { left: size, at: now, given_up: false }
    }

    /// What the time since the last look gave back, up to `size`.
    fn refill(&mut self, now: Instant, size: Duration) {
        let gained = now.saturating_duration_since(self.at).as_secs_f64() * REFILL_PER_SECOND.as_secs_f64();
        self.left = (self.left + Duration::from_secs_f64(gained)).min(size);
        self.at = now;
    }
}

/// Counts of entries.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PlacementCounts {
    /// Written into the rings.
    pub handed_out: u64,
    /// Taken back and made by the daemon (the rest were made by their clients).
    pub taken_back: u64,
    /// Processes given up on (see [`Budget`]).
    pub given_up: u64,
}

/// The placement rings of a device's clients, by process.
pub(crate) struct ClientPlacements {
    rings: HashMap<u32, Ring>,
    /// Rings with entries not known to be done.
    open: usize,
    /// The wait budgets of processes that used some (kept across their rings, so that closing
    /// and opening the device again does not fill one), by process.
    budgets: HashMap<u32, Budget>,
    /// The daemon's writes of entries it took back (one call per process per reclaim).
    writes: WriteBehind,
    taken: Vec<u32>,
    pub counts: PlacementCounts,
    /// The size of a process's wait budget: [`CLIENT_WAIT`] (tests that must not depend on
    /// how soon a thread is scheduled set more).
    wait: Duration,
}

impl Default for ClientPlacements {
    fn default() -> ClientPlacements {
        ClientPlacements {
            rings: HashMap::new(),
            open: 0,
            budgets: HashMap::new(),
            writes: WriteBehind::default(),
            taken: Vec::new(),
            counts: PlacementCounts::default(),
            wait: CLIENT_WAIT,
        }
    }
}

impl std::fmt::Debug for ClientPlacements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientPlacements").field("rings", &self.rings.len()).field("counts", &self.counts).finish()
    }
}

impl ClientPlacements {
    /// A session of process `pid` opened the device: its ring (made now for its first), as a
    /// descriptor to send it.
    pub fn attach(&mut self, pid: u32) -> std::io::Result<OwnedFd> {
        if let Some(r) = self.rings.get_mut(&pid) {
            r.sessions += 1;
            return r.shm.fd().try_clone();
        }
        let shm = Shm::create("softrdma-placements", placements_bytes(CAPACITY))?;
        let ring = shm.placements(0, CAPACITY)?;
        ring.init();
        let fd = shm.fd().try_clone()?;
        self.rings.insert(pid, Ring { ring, shm, head: 0, tail: 0, sessions: 1 });
        Ok(fd)
    }

    /// A session of process `pid` closed. With its last the ring goes, and what waits in it is
    /// dropped, not made: the process's CQs on this device went with its sessions, so no
    /// completion can ever name those writes (and the process may be gone).
    pub fn detach(&mut self, pid: u32) {
        let Some(r) = self.rings.get_mut(&pid) else { return };
        r.sessions -= 1;
        if r.sessions == 0 {
            if r.head != r.tail {
                self.open -= 1;
            }
            self.rings.remove(&pid);
            // A budget full again needs no keeping; one given up on, or still short, is kept.
            if let Some(b) = self.budgets.get_mut(&pid) {
                b.refill(Instant::now(), self.wait);
                if !b.given_up && b.left == self.wait {
                    self.budgets.remove(&pid);
                }
            }
        }
    }

    /// Whether process `pid` was given up on.
    fn given_up(&self, pid: u32) -> bool {
        self.budgets.get(&pid).is_some_and(|b| b.given_up)
    }

    /// Whether `n` more entries fit in process `pid`'s ring (entries its client made are counted
    /// out first).
    pub fn room(&mut self, pid: u32, n: usize) -> bool {
        if self.given_up(pid) {
            return false;
        }
        let Some(r) = self.rings.get_mut(&pid) else { return false };
        let free = |r: &Ring| (CAPACITY - r.head.wrapping_sub(r.tail)) as usize;
        if free(r) < n && r.tail != r.head {
            while r.tail != r.head && r.ring.seen(r.tail) == Seen::Is(State::Done) {
                r.tail = r.tail.wrapping_add(1);
            }
            r.ring.set_tail(r.tail);
            if r.tail == r.head {
                self.open -= 1;
            }
        }
        free(r) >= n
    }

    /// Hand `data` (at most [`PLACE_MAX`] bytes) for `addr` of process `pid` to its client, in a
    /// slot [`ClientPlacements::room`] found.
    pub fn hand_out(&mut self, pid: u32, addr: u64, data: &[u8]) {
        let r = self.rings.get_mut(&pid).expect("room was found");
        if r.head == r.tail {
            self.open += 1;
        }
        r.ring.write(r.head, addr, data);
        r.head = r.head.wrapping_add(1);
        self.counts.handed_out += 1;
    }

    /// The end of process `pid`'s entries (what its completions name), if it has a ring.
    pub fn end(&self, pid: u32) -> Option<u32> {
        self.rings.get(&pid).map(|r| r.head)
    }

    /// Make every entry of process `pid` still waiting, before the device touches its memory:
    /// take those nobody took and write them (one call), wait for those its client is copying.
    pub fn reclaim(&mut self, pid: u32) {
        if self.open == 0 {
            return;
        }
        let Some(r) = self.rings.get_mut(&pid) else { return };
        if r.tail == r.head {
            return;
        }
        let mut data = [0u8; DATA_MAX];
        // The first entry left to a client that is still copying it (given up on): the tail
        // its threads see stops there, so that none hands out a completion past it.
        let mut held = None;
        let mut n = r.tail;
        while n != r.head {
            match r.ring.take(n, State::Daemon) {
                Ok(()) => {
                    let (addr, len) = r.ring.read(n, &mut data);
                    if !self.writes.defer(pid, addr, &data[..len], false) {
                        write_taken(&mut self.writes, &r.ring, &mut self.taken);
                        // Empty now, so an entry (at most DATA_MAX bytes) fits.
                        self.writes.defer(pid, addr, &data[..len], false);
                    }
                    self.taken.push(n);
                    self.counts.taken_back += 1;
                }
                Err(Seen::Is(State::Client)) => {
                    // The client copies it: the entries taken before it go first, then wait,
                    // within what is left of the process's budget.
                    write_taken(&mut self.writes, &r.ring, &mut self.taken);
                    let start = Instant::now();
                    let wait = self.wait;
                    let b = self.budgets.entry(pid).or_insert_with(|| Budget::full(start, wait));
                    b.refill(start, wait);
                    while !b.given_up && r.ring.seen(n) == Seen::Is(State::Client) {
                        if start.elapsed() > b.left {
                            self.counts.given_up += 1;
                            b.given_up = true;
                        }
                        std::thread::yield_now();
                    }
                    b.left = b.left.saturating_sub(start.elapsed());
                    if r.ring.seen(n) == Seen::Is(State::Client) {
                        held.get_or_insert(n);
                    }
                }
                // Done by its client (or a slot its client broke: nothing to make).
                Err(_) => {}
            }
            n = n.wrapping_add(1);
        }
        write_taken(&mut self.writes, &r.ring, &mut self.taken);
        // Nothing is handed out past a held entry (the process was given up on): the slots
        // after it are never needed again.
        r.tail = r.head;
        r.ring.set_tail(held.unwrap_or(r.tail));
        self.open -= 1;
    }

    /// [`ClientPlacements::reclaim`] for each of `pids` (repeats cost a look each), before the
    /// device touches their memory; nothing at all while no entry waits.
    pub fn reclaim_each(&mut self, pids: impl Iterator<Item = u32>) {
        if self.open == 0 {
            return;
        }
        pids.for_each(|pid| self.reclaim(pid));
    }

    /// [`ClientPlacements::reclaim`] for every process.
    pub fn reclaim_all(&mut self) {
        if self.open == 0 {
            return;
        }
        let pids: Vec<u32> = self.rings.keys().copied().collect();
        self.reclaim_each(pids.into_iter());
    }

    /// Writes of entries taken back that the client's memory refused.
    pub fn lost(&self) -> u64 {
        self.writes.lost
    }

    /// System calls that made entries taken back.
    pub fn calls(&self) -> u64 {
        self.writes.calls
    }
}

/// Write the entries taken back (`taken`, their bytes kept in `writes`), then say they are done.
fn write_taken(writes: &mut WriteBehind, ring: &Placements, taken: &mut Vec<u32>) {
    if taken.is_empty() {
        return;
    }
    writes.write_all(true);
    for &n in taken.iter() {
        ring.finish(n);
    }
    taken.clear();
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn me() -> u32 {
        std::process::id()
    }

    /// The client's view of process `pid`'s ring, mapped from the descriptor it would be sent.
    fn client_view(fd: OwnedFd) -> (Placements, Shm) {
        let shm = Shm::open(fd, placements_bytes(CAPACITY)).unwrap();
        let ring = shm.placements(0, CAPACITY).unwrap();
        assert!(ring.header_ok());
        (ring, shm)
    }

    /// `buf`'s bytes as they are now.
    pub(crate) fn bytes(buf: &[u8]) -> Vec<u8> {
        // SAFETY: in bounds of `buf`; volatile, since the kernel (process_vm_writev) or a poll
        // wrote them through an address the compiler does not see.
        (0..buf.len()).map(|i| unsafe { std::ptr::read_volatile(buf.as_ptr().add(i)) }).collect()
    }

    #[test]
    fn entries_taken_back_are_written_in_order_after_those_the_client_made() {
        let mut p = ClientPlacements::default();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let buf = vec![0u8; 16];
        let at = buf.as_ptr() as u64;
        assert!(p.room(me(), 3));
        p.hand_out(me(), at, &[1; 8]);
        p.hand_out(me(), at, &[2; 8]);
        p.hand_out(me(), at + 8, &[3; 4]);
        assert_eq!(p.end(me()), Some(3));
        // The client made the first (as its poll does: take, copy, finish).
        view.take(0, State::Client).unwrap();
        view.finish(0);
        p.reclaim(me());
        assert_eq!(bytes(&buf), [[2; 8].as_slice(), &[3; 4], &[0; 4]].concat());
        assert_eq!(p.counts, PlacementCounts { handed_out: 3, taken_back: 2, given_up: 0 });
        assert_eq!((view.seen(1), view.seen(2), view.tail()), (Seen::Is(State::Done), Seen::Is(State::Done), 3));
        assert_eq!(p.open, 0);
        // Nothing waits now: another reclaim writes nothing.
        p.reclaim(me());
        assert_eq!(p.calls(), 1);
    }

    /// Waits that must not end in giving up, however late the test's other thread runs.
    fn patient() -> ClientPlacements {
        ClientPlacements { wait: Duration::from_secs(10), ..ClientPlacements::default() }
    }

    #[test]
    fn an_entry_the_client_is_copying_is_waited_for() {
        let mut p = patient();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let buf = vec![0u8; 8];
        let at = buf.as_ptr() as u64;
        assert!(p.room(me(), 2));
        p.hand_out(me(), at, &[5; 8]);
        p.hand_out(me(), at, &[6; 8]);
        view.take(0, State::Client).unwrap();
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(5));
                let (addr, from, len) = view.data(0);
                // SAFETY: `buf`'s bytes (its address handed out above), from the slot.
                unsafe { std::ptr::copy_nonoverlapping(from, addr as *mut u8, len) };
                view.finish(0);
            });
            p.reclaim(me());
        });
        assert!(start.elapsed() >= Duration::from_millis(5), "did not wait for the client's copy");
        assert_eq!(bytes(&buf), [6; 8], "the later entry went first");
        assert_eq!((p.counts.taken_back, p.counts.given_up), (1, 0));
    }

    #[test]
    fn a_client_that_never_finishes_is_given_up_on() {
        let mut p = ClientPlacements::default();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let buf = [0u8; 8];
        assert!(p.room(me(), 1));
        p.hand_out(me(), buf.as_ptr() as u64, &[7; 8]);
        view.take(0, State::Client).unwrap();
        let start = Instant::now();
        p.reclaim(me());
        assert!(start.elapsed() >= CLIENT_WAIT);
        assert_eq!((p.counts.taken_back, p.counts.given_up), (0, 1));
        assert_eq!(p.open, 0);
        assert!(!p.room(me(), 1), "handed more after it was given up on");
    }

    #[test]
    fn a_client_holding_many_entries_costs_the_loop_its_budget_once() {
        let mut p = ClientPlacements::default();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let buf = [0u8; 8];
        assert!(p.room(me(), 20));
        for n in 0..20 {
            p.hand_out(me(), buf.as_ptr() as u64, &[1; 8]);
            view.take(n, State::Client).unwrap();
        }
        let start = Instant::now();
        p.reclaim(me());
        let took = start.elapsed();
        // Not 20 waits of the budget (200 ms).
        assert!(took >= CLIENT_WAIT && took < 10 * CLIENT_WAIT, "{took:?}");
        assert_eq!(p.counts.given_up, 1);
        assert_eq!(view.tail(), 0, "the tail went past an entry the client holds");
        // Given up on: handed nothing more, waited for no more, also in a ring opened later.
        assert!(!p.room(me(), 1));
        p.detach(me());
        let _view = client_view(p.attach(me()).unwrap());
        assert!(!p.room(me(), 1));
    }

    #[test]
    fn a_budget_refills_with_time_up_to_its_size() {
        let t0 = Instant::now();
        let mut b = Budget::full(t0, CLIENT_WAIT);
        b.left = Duration::ZERO;
        b.refill(t0 + Duration::from_secs(4), CLIENT_WAIT);
        assert!((b.left.as_secs_f64() - 0.004).abs() < 1e-6, "{:?}", b.left);
        b.refill(t0 + Duration::from_secs(1000), CLIENT_WAIT);
        assert_eq!(b.left, CLIENT_WAIT);
        // A clock that reads earlier gives nothing back.
        b.left = Duration::ZERO;
        b.refill(t0, CLIENT_WAIT);
        assert_eq!(b.left, Duration::ZERO);
    }

    #[test]
    fn a_budget_short_of_full_outlives_the_ring() {
        let mut p = patient();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let buf = [0u8; 8];
        assert!(p.room(me(), 1));
        p.hand_out(me(), buf.as_ptr() as u64, &[3; 8]);
        view.take(0, State::Client).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(3));
                view.finish(0);
            });
            p.reclaim(me());
        });
        assert_eq!(p.counts.given_up, 0);
        let left = p.budgets[&me()].left;
        assert!(left <= p.wait - Duration::from_millis(3), "{left:?}");
        // Closing and opening again does not fill it.
        p.detach(me());
        let _view = client_view(p.attach(me()).unwrap());
        assert!(p.budgets[&me()].left < p.wait);
    }

    #[test]
    fn room_counts_out_what_the_client_made_and_the_ring_goes_with_the_last_session() {
        let mut p = ClientPlacements::default();
        let (view, _shm) = client_view(p.attach(me()).unwrap());
        let _second = p.attach(me()).unwrap();
        let buf = vec![0u8; 8];
        assert!(p.room(me(), CAPACITY as usize));
        for _ in 0..CAPACITY {
            p.hand_out(me(), buf.as_ptr() as u64, &[1]);
        }
        assert!(!p.room(me(), 1));
        for n in 0..2 {
            view.take(n, State::Client).unwrap();
            view.finish(n);
        }
        assert!(p.room(me(), 2));
        assert!(!p.room(me(), 3));
        assert_eq!(view.tail(), 2);
        assert!(!p.room(me() + 1, 1), "a process without a ring");
        p.detach(me());
        assert_eq!(p.end(me()), Some(CAPACITY), "one session still has it");
        p.detach(me());
        assert_eq!(p.end(me()), None);
        assert_eq!(p.open, 0);
        assert_eq!(p.counts.taken_back, 0, "dropped, not made");
        assert_eq!(bytes(&buf)[0], 0);
    }
}
