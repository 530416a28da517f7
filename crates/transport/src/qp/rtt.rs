//! The requester's round-trip time estimate, and the retry probe interval derived from it.
//!
//! One packet at a time is timed: a new packet (never sent before) that asks for an ACK. When an
//! acknowledgement moves the oldest unacknowledged PSN past it, `now - sent` is a sample. A rewind
//! abandons the packet being timed, so a sample never mixes an original and a retransmission
//! (Karn's rule). Samples feed the smoothed RTT and its mean deviation as TCP does (RFC 6298:
//! gains 1/8 and 1/4), and the probe interval is `srtt + 4 * rttvar`, as TCP's retransmission
//! timeout, bounded below by [`MIN_PROBE`].
//!
//! The probe is what a retransmission round waits before resending once more when it made no
//! progress (see the completer's `start_retry`): the responder NAKs a sequence error once and then
//! stays silent until the expected PSN arrives (IBA 9.7.5.1.1), so a retransmission lost again
//! would otherwise cost the whole local ACK timeout. Waiting about one round trip instead of a
//! fixed 2 ms recovers in a fraction of the time on a fast path, and never probes too early on a
//! slow one. Everything here is local to the requester: the peer sees the same packets either way,
//! so it works against rxe's go-back-N responder as against ours.

use core::time::Duration;

use crate::time::Instant;
use softrdma_wire::Psn;

/// The probe interval before any RTT sample: several loopback or LAN round trips.
pub(crate) const INITIAL_PROBE: Duration = Duration::from_millis(2);
/// The shortest probe interval: below this, scheduling noise on a loaded host (a descheduled
/// receiver thread) would be mistaken for loss.
pub(crate) const MIN_PROBE: Duration = Duration::from_micros(200);

/// RTT estimate of one requester.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RttEstimator {
    /// Smoothed RTT in ns (none before the first sample).
    srtt: Option<u64>,
    /// Mean deviation of the RTT in ns.
    rttvar: u64,
    /// The packet being timed and when it left.
    timed: Option<(Psn, Instant)>,
}

impl RttEstimator {
    /// A new packet `psn` asking for an ACK left at `now`: time it unless one is being timed.
    pub fn on_send(&mut self, psn: Psn, now: Instant) {
        if self.timed.is_none() {
            self.timed = Some((psn, now));
        }
    }

    /// Everything before `una` is acknowledged at `now`.
    pub fn on_ack(&mut self, una: Psn, now: Instant) {
        if let Some((psn, sent)) = self.timed {
            if una.diff(psn) > 0 {
                self.timed = None;
                self.sample(now.saturating_since(sent).as_nanos() as u64);
            }
        }
    }

    /// The packet being timed left at `now`, not at `then` as it was told (see
    /// [`crate::Hca::restamp`]).
    pub fn restamp(&mut self, then: Instant, now: Instant) {
        if let Some((_, sent)) = self.timed.as_mut().filter(|(_, sent)| *sent == then) {
            *sent = now;
        }
    }

    /// The requester rewinds: whatever is being timed may be sent twice, its ACK is ambiguous.
    pub fn on_rewind(&mut self) {
        self.timed = None;
    }

    /// Fold in one measured round trip of `r` ns.
    pub fn sample(&mut self, r: u64) {
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                self.rttvar = (3 * self.rttvar + s.abs_diff(r)) / 4;
                self.srtt = Some((7 * s + r) / 8);
            }
        }
    }

    /// The smoothed RTT, once there was a sample.
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt.map(Duration::from_nanos)
    }

    /// The probe interval of the `attempt`-th probe of a retransmission round (0 for the first):
    /// `srtt + 4 * rttvar` (at least [`MIN_PROBE`]; [`INITIAL_PROBE`] before any sample), doubled
    /// for each probe before it that made no progress either.
    pub fn probe_interval(&self, attempt: u32) -> Duration {
        let base = match self.srtt {
            Some(s) => Duration::from_nanos(s + 4 * self.rttvar).max(MIN_PROBE),
            None => INITIAL_PROBE,
        };
        base.saturating_mul(1 << attempt.min(16))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converges_to_a_steady_rtt_and_probes_at_its_multiples() {
        let mut r = RttEstimator::default();
        assert_eq!(r.probe_interval(0), INITIAL_PROBE);
        let mut now = Instant::ZERO;
        for i in 0..64u32 {
            r.on_send(Psn::new(i), now);
            r.on_send(Psn::new(i + 1), now); // already timing i: ignored
            now = now + Duration::from_micros(300);
            r.on_ack(Psn::new(i + 1), now);
        }
        let s = r.srtt().unwrap();
        assert!(s.abs_diff(Duration::from_micros(300)) < Duration::from_micros(5), "{s:?}");
        let p = r.probe_interval(0);
        assert!(p >= Duration::from_micros(300) && p < Duration::from_micros(330), "{p:?}");
        assert_eq!(r.probe_interval(2), p * 4);
    }

    #[test]
    fn a_rewind_discards_the_timed_packet() {
        let mut r = RttEstimator::default();
        r.on_send(Psn::new(10), Instant::ZERO);
        r.on_rewind();
        r.on_ack(Psn::new(11), Instant::from_nanos(5_000_000));
        assert!(r.srtt().is_none());
        r.on_send(Psn::new(0xff_ffff), Instant::ZERO);
        r.on_ack(Psn::new(0xff_ffff), Instant::from_nanos(1000));
        assert!(r.srtt().is_none(), "not yet acknowledged");
        r.on_ack(Psn::new(1), Instant::from_nanos(1000)); // across the 24-bit wrap
        assert_eq!(r.srtt(), Some(Duration::from_nanos(1000)));
        assert_eq!(r.probe_interval(0), MIN_PROBE);
    }
}
