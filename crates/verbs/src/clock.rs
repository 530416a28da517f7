//! The monotonic clock of the runtime: `CLOCK_MONOTONIC` in nanoseconds, read from the CPU's
//! time-stamp counter where that ticks at one rate on every CPU and in every state.
//!
//! A busy-polling thread reads the clock on every poll and on every post; a `clock_gettime`
//! through the vDSO costs about 22 ns on the test VMs, a `rdtsc` about 10. The counter's rate is
//! measured against `clock_gettime` over the first [`CALIBRATION`] of the process's readings
//! (those are `clock_gettime` readings themselves, each paired with a counter reading taken
//! between two of them no more than a microsecond apart); from then on a reading is the counter's
//! ticks since the end of that interval, scaled, added to the `clock_gettime` reading taken there.
//! The pairs are exact to about half a microsecond, so the rate is to about 50 ppm (a millisecond
//! timer fires within 50 ns of its time), and the two clocks drift apart by as much: far finer
//! than anything the engine times (its shortest timer is a millisecond or so). Every engine time
//! of the process comes from here, so it never compares one clock with the other.
//!
//! The counter is used only where the kernel itself used it as its clock source (`tsc`) when the
//! process first read the clock, and the CPU says it is invariant (`constant_tsc` and
//! `nonstop_tsc`): the kernel then checked that the CPUs' counters agree. A kernel that later
//! gives up the counter (its watchdog found it unstable) is not followed: the process keeps
//! reading it. Elsewhere every reading is a `clock_gettime`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// How long the counter's rate is measured before it is used.
const CALIBRATION: Duration = Duration::from_millis(20);

/// The counter's scale, once measured: ns = `base_ns` + ((ticks − `base_ticks`) × `mult`) >> 32.
struct Scale {
    base_ticks: u64,
    base_ns: u64,
    mult: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds (see the module comment for where it comes from).
#[inline]
pub fn monotonic_ns() -> u64 {
    match SCALE.get() {
        Some(s) => s.at(cycles()),
        None => calibrating(),
    }
}

impl Scale {
    /// The time at counter reading `ticks`. A reading below the base (a counter of another CPU a
    /// little behind, or a reading taken before the scale was set) gives the base: never a wrap.
    #[inline]
    fn at(&self, ticks: u64) -> u64 {
        let since = ticks.saturating_sub(self.base_ticks);
        self.base_ns.wrapping_add(((u128::from(since) * u128::from(self.mult)) >> 32) as u64)
    }
}

static SCALE: OnceLock<Scale> = OnceLock::new();
/// The first reading while calibrating: its counter and its nanoseconds (0: none yet).
static START_TICKS: AtomicU64 = AtomicU64::new(0);
static START_NS: AtomicU64 = AtomicU64::new(0);

/// A reading before the counter's scale is known: `clock_gettime`, and the scale is set once
/// [`CALIBRATION`] has passed since the first such reading.
#[cold]
fn calibrating() -> u64 {
    if !tsc_usable() {
        return clock_gettime_ns();
    }
    let Some((ns, ticks)) = paired_reading() else { return clock_gettime_ns() };
    let start = START_TICKS.load(Ordering::Acquire);
    if start == 0 {
        // The first reading starts the interval (a race between two first readings leaves one).
        if START_TICKS.compare_exchange(0, ticks, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            START_NS.store(ns, Ordering::Release);
        }
        return ns;
    }
    let start_ns = START_NS.load(Ordering::Acquire);
    if start_ns == 0 || ns.saturating_sub(start_ns) < CALIBRATION.as_nanos() as u64 || ticks <= start {
        return ns;
    }
    // ns per tick in 32.32 fixed point.
    let mult = ((u128::from(ns - start_ns) << 32) / u128::from(ticks - start)) as u64;
    SCALE.get_or_init(|| Scale { base_ticks: ticks, base_ns: ns, mult }).at(ticks)
}

/// A `clock_gettime` reading and the counter at the same moment: the counter read between two
/// readings of the clock, and their middle, if they are close enough (no preemption between
/// them); `None` after a few tries that were not.
fn paired_reading() -> Option<(u64, u64)> {
    (0..4).find_map(|_| {
        let before = clock_gettime_ns();
        let ticks = cycles();
        let after = clock_gettime_ns();
        (after.saturating_sub(before) <= PAIR_MAX_NS).then(|| (before + (after - before) / 2, ticks))
    })
}

/// Widest a [`paired_reading`] may be, in nanoseconds.
const PAIR_MAX_NS: u64 = 1_000;

fn clock_gettime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// Whether the time-stamp counter ticks at one rate on every CPU and in every state
/// (`constant_tsc` and `nonstop_tsc`), checked once.
pub fn tsc_invariant() -> bool {
    static INVARIANT: OnceLock<bool> = OnceLock::new();
    *INVARIANT.get_or_init(|| {
        cfg!(target_arch = "x86_64")
            && std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| {
                c.lines().find(|l| l.starts_with("flags")).is_some_and(|l| {
                    let has = |name: &str| l.split_whitespace().any(|x| x == name);
                    has("constant_tsc") && has("nonstop_tsc")
                })
            })
    })
}

/// Whether this clock reads the counter: it is invariant and the kernel's own clock source.
/// `SOFTRDMA_TSC_CLOCK=0` says no.
fn tsc_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        std::env::var_os("SOFTRDMA_TSC_CLOCK").is_none_or(|v| v != "0")
            && tsc_invariant()
            && std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
                .is_ok_and(|s| s.trim() == "tsc")
    })
}

/// The time-stamp counter (0 where there is none).
#[inline]
pub fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `rdtsc` exists on every x86_64 CPU, reads a counter and touches no memory.
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the calibration the clock keeps pace with `clock_gettime` (whichever it reads) and
    /// never goes back.
    #[test]
    fn keeps_pace_with_clock_gettime() {
        let first = monotonic_ns();
        std::thread::sleep(CALIBRATION + Duration::from_millis(5));
        let mut last = monotonic_ns();
        assert!(last > first);
        let (t0, c0) = (clock_gettime_ns(), monotonic_ns());
        for _ in 0..100_000 {
            let t = monotonic_ns();
            assert!(t >= last, "{t} after {last}");
            last = t;
        }
        std::thread::sleep(Duration::from_millis(30));
        let (t1, c1) = (clock_gettime_ns(), monotonic_ns());
        // Both clocks measured the same ≥ 30 ms, to within 1 %.
        let (real, ours) = ((t1 - t0) as i64, (c1 - c0) as i64);
        assert!(real >= 30_000_000, "{real}");
        assert!((ours - real).abs() < real / 100, "ours {ours} ns, clock_gettime {real} ns");
        // And they read about the same time (to within a millisecond).
        assert!(c1.abs_diff(t1) < 1_000_000, "ours {c1}, clock_gettime {t1}");
    }
}
