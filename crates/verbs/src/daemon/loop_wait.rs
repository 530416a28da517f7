//! How softrdmad's device loops wait between passes that found no work: keep polling, yield the
//! core, or sleep until a doorbell, a packet or a timer.
//!
//! A loop polls without yielding for a few microseconds after its last work only while the
//! daemon's awake loops leave at least as many CPUs to the clients as they take. A client that
//! spins on its CQ ring yields after every empty look, so a loop that yields too hands its CPU to
//! such a client, which looks once and hands it back: two context switches in the middle of a
//! round trip. Where loops would take most of the CPUs (two awake loops on two CPUs, or a loop
//! allowed one CPU), each yields after every empty pass, or the clients' work would wait for the
//! scheduler's preemption.
//!
//! The count is this daemon's: two daemons on one host (the system's and a user's) each see
//! their own loops only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::poller;

/// How long a loop keeps polling without yielding after its last work, when it may.
const SPIN_ALONE: Duration = Duration::from_micros(5);

/// What a loop does after a pass that found no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// Poll again at once.
    Spin,
    /// Give the core away for a moment, then poll again.
    Yield,
    /// Sleep until there is work.
    Sleep,
}

/// The daemon's device loops that are awake (polling), and the CPUs the daemon may use.
#[derive(Debug)]
pub(super) struct Loops {
    awake: AtomicUsize,
    /// From the daemon's start: its affinity and its control group's CPU quota.
    cpus: usize,
}

impl Loops {
    pub(super) fn new() -> Self {
        Loops { awake: AtomicUsize::new(0), cpus: std::thread::available_parallelism().map_or(1, |n| n.get()) }
    }

    /// A loop starts: awake until its [`Waiter`] rests or is dropped (a loop that ends, or
    /// panics, is counted out).
    pub(super) fn enter(&self) -> Waiter<'_> {
        let mut w = Waiter { loops: self, awake: false, cpus: self.cpus };
        w.wake();
        w
    }
}

/// One loop's part in [`Loops`].
#[derive(Debug)]
pub(super) struct Waiter<'a> {
    loops: &'a Loops,
    awake: bool,
    /// The CPUs this loop may use, as of its last wake: the daemon's, or fewer if the loop's
    /// thread was pinned since.
    cpus: usize,
}

impl Waiter<'_> {
    /// The loop polls (again).
    pub(super) fn wake(&mut self) {
        self.cpus = poller::allowed_cpus().map_or(self.loops.cpus, |n| n.min(self.loops.cpus));
        if !self.awake {
            self.awake = true;
            self.loops.awake.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The loop stops polling (it goes to sleep).
    pub(super) fn rest(&mut self) {
        if self.awake {
            self.awake = false;
            self.loops.awake.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// What the loop does after a pass that found no work, its last work `idle` ago; `spin` is
    /// how long it polls at all before it sleeps (`SOFTRDMA_SPIN_US`).
    pub(super) fn next(&self, idle: Duration, spin: Duration) -> Wait {
        decide(idle, spin, self.loops.awake.load(Ordering::Relaxed), self.cpus)
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.rest();
    }
}

/// See [`Waiter::next`]: `awake` loops (this one included) on `cpus` CPUs.
fn decide(idle: Duration, spin: Duration, awake: usize, cpus: usize) -> Wait {
    if idle >= spin {
        Wait::Sleep
    } else if idle < SPIN_ALONE && awake.saturating_mul(2) <= cpus {
        Wait::Spin
    } else {
        Wait::Yield
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(50);

    #[test]
    fn a_loop_alone_on_two_cpus_polls_on_before_it_yields() {
        assert_eq!(decide(Duration::ZERO, SPIN, 1, 2), Wait::Spin);
        assert_eq!(decide(SPIN_ALONE - Duration::from_nanos(1), SPIN, 1, 2), Wait::Spin);
        assert_eq!(decide(SPIN_ALONE, SPIN, 1, 2), Wait::Yield);
        assert_eq!(decide(SPIN - Duration::from_nanos(1), SPIN, 1, 2), Wait::Yield);
        assert_eq!(decide(SPIN, SPIN, 1, 2), Wait::Sleep);
    }

    #[test]
    fn loops_that_would_take_most_cpus_yield_at_once() {
        assert_eq!(decide(Duration::ZERO, SPIN, 2, 2), Wait::Yield);
        assert_eq!(decide(Duration::ZERO, SPIN, 1, 1), Wait::Yield);
        assert_eq!(decide(Duration::ZERO, SPIN, 3, 4), Wait::Yield);
        assert_eq!(decide(Duration::ZERO, SPIN, 2, 4), Wait::Spin);
        assert_eq!(decide(SPIN, SPIN, 2, 2), Wait::Sleep);
    }

    #[test]
    fn a_spin_time_shorter_than_the_spin_alone_still_sleeps_on_time() {
        let spin = Duration::from_micros(1);
        assert_eq!(decide(Duration::ZERO, spin, 1, 2), Wait::Spin);
        assert_eq!(decide(spin, spin, 1, 2), Wait::Sleep);
    }

    /// The count follows the loops' wakes and rests, a rest or wake twice counts once, and a
    /// loop that ends (its waiter dropped, as when it panics) is counted out.
    #[test]
    fn the_count_follows_wakes_rests_and_ends() {
        let l = Loops { awake: AtomicUsize::new(0), cpus: 2 };
        let mut a = l.enter();
        a.cpus = 2;
        assert_eq!(a.next(Duration::ZERO, SPIN), Wait::Spin);
        let b = l.enter();
        assert_eq!(a.next(Duration::ZERO, SPIN), Wait::Yield);
        a.rest();
        a.rest();
        assert_eq!(l.awake.load(Ordering::Relaxed), 1);
        drop(b);
        assert_eq!(l.awake.load(Ordering::Relaxed), 0);
        a.wake();
        a.wake();
        assert_eq!(l.awake.load(Ordering::Relaxed), 1);
        drop(a);
        assert_eq!(l.awake.load(Ordering::Relaxed), 0);
    }

    /// A loop whose thread is allowed one CPU (pinned after the daemon started) yields at once
    /// from its next wake on, though the daemon counted more.
    #[test]
    fn a_loop_pinned_to_one_cpu_yields() {
        // On a thread of its own: the pinning dies with it.
        std::thread::spawn(|| {
            let l = Loops { awake: AtomicUsize::new(0), cpus: 64 };
            let mut w = l.enter();
            assert!(w.cpus <= 64);
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let cpu = poller::this_cpu().expect("this CPU") as usize;
            // SAFETY: zeroed cpu_set_t values are valid sets; the call acts on this thread only.
            unsafe {
                let mut one: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut one);
                assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
            }
            w.wake();
            assert_eq!(w.cpus, 1);
            assert_eq!(w.next(Duration::ZERO, SPIN), Wait::Yield);
        })
        .join()
        .expect("the pinned thread's checks");
    }
}
