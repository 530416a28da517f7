//! How softrdmad's device loops wait between passes that found no work: keep polling, yield the
//! core, or sleep until a doorbell, a packet or a timer.
//!
//! A loop polls without yielding for a few microseconds after its last work only while the
//! daemon's awake loops leave at least as many CPUs to the clients as they take. A client that
//! spins on its CQ ring yields after every empty look, so a loop that yields too hands its CPU to
//! such a client, which looks once and hands it back: two context switches in the middle of a
//! round trip. Where loops would take most of the CPUs (two awake loops on two CPUs), each yields
//! after every empty pass, or the clients' work would wait for the scheduler's preemption.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

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

/// The daemon's device loops that are awake (polling), against the CPUs it may run on.
#[derive(Debug)]
pub(super) struct Loops {
    awake: AtomicUsize,
    cpus: usize,
}

impl Loops {
    pub(super) fn new() -> Self {
        // The CPUs this process may run on (its affinity mask, where the platform says it).
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Loops { awake: AtomicUsize::new(0), cpus }
    }

    /// A loop starts polling (it started, or woke from a sleep).
    pub(super) fn wake(&self) {
        self.awake.fetch_add(1, Ordering::Relaxed);
    }

    /// A loop stops polling (it goes to sleep, or ends).
    pub(super) fn rest(&self) {
        self.awake.fetch_sub(1, Ordering::Relaxed);
    }

    /// What a loop whose last work was `idle` ago does next; `spin` is how long it polls at all
    /// before it sleeps (`SOFTRDMA_SPIN_US`).
    pub(super) fn next(&self, idle: Duration, spin: Duration) -> Wait {
        decide(idle, spin, self.awake.load(Ordering::Relaxed), self.cpus)
    }
}

/// See [`Loops::next`]: `awake` loops (this one included) on `cpus` CPUs.
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

    #[test]
    fn the_count_follows_wakes_and_rests() {
        let l = Loops { awake: AtomicUsize::new(0), cpus: 2 };
        l.wake();
        assert_eq!(l.next(Duration::ZERO, SPIN), Wait::Spin);
        l.wake();
        assert_eq!(l.next(Duration::ZERO, SPIN), Wait::Yield);
        l.rest();
        assert_eq!(l.next(Duration::ZERO, SPIN), Wait::Spin);
    }
}
