//! Time stamps of the latency loops. As perftest's `get_cycles`, a stamp is the CPU's time-stamp
//! counter where it ticks at a constant rate whatever the CPU's state (`constant_tsc` and
//! `nonstop_tsc`): reading it costs about half of a `clock_gettime`, and a ping-pong takes a stamp
//! on every round trip. The stamps are turned into nanoseconds at the end of the run, by the
//! counter's rate against the monotonic clock over the same run. Elsewhere the stamps are
//! nanoseconds of the monotonic clock.

use std::time::Instant;

use softrdma_verbs::clock::{cycles, tsc_invariant};

/// The stamps of one run: taken with [`Stamps::now`], turned into nanoseconds by
/// [`Stamps::finish`].
pub(super) struct Stamps {
    t0: Instant,
    c0: u64,
    tsc: bool,
}

impl Stamps {
    /// The run starts now.
    pub fn start() -> Stamps {
        let tsc = tsc_invariant();
        Stamps { t0: Instant::now(), c0: if tsc { cycles() } else { 0 }, tsc }
    }

    /// A stamp: counter ticks, or nanoseconds, since the start.
    #[inline]
    pub fn now(&self) -> u64 {
        if self.tsc {
            cycles().wrapping_sub(self.c0)
        } else {
            self.t0.elapsed().as_nanos() as u64
        }
    }

    /// The run ends now: `stamps` in nanoseconds since the start, and the run's length in
    /// nanoseconds.
    pub fn finish(&self, mut stamps: Vec<u64>) -> (Vec<u64>, u64) {
        let (ticks, elapsed) = (self.now(), self.t0.elapsed().as_nanos() as u64);
        if self.tsc && ticks > 0 {
            for s in &mut stamps {
                *s = (u128::from(*s) * u128::from(elapsed) / u128::from(ticks)) as u64;
            }
        }
        (stamps, elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stamps grow with time and end within the run, whichever clock they come from.
    #[test]
    fn stamps_are_nanoseconds_within_the_run() {
        let s = Stamps::start();
        let mut raw = Vec::new();
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(2));
            raw.push(s.now());
        }
        let (ns, elapsed) = s.finish(raw);
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{ns:?}");
        assert!(ns[0] >= 1_500_000 && ns[2] <= elapsed, "{ns:?} within {elapsed}");
        // Two sleeps of 2 ms between the first and the last stamp.
        assert!((3_500_000..20_000_000).contains(&(ns[2] - ns[0])), "{ns:?}");
    }
}
