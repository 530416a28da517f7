//! Per-QP shares of a device's traffic and engine counters, kept when the device runs in softrdmad
//! (`softrdma stat` shows them per QP).
//!
//! Packets and bytes are counted per packet. The engine's other counters (retransmits, NAKs,
//! drops) change rarely, so they are not copied and compared around every packet: a cheap sum of
//! them says whether anything changed, and only then is the difference since the last look added
//! to the QP whose work changed it. Changes made between two such pieces of work (timers) are
//! taken as seen without being attributed to any QP.

use std::collections::BTreeMap;

use softrdma_transport::{Counters, DirectMessage};
use softrdma_wire::Qpn;

/// One QP's share of the device's traffic and engine counters.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct QpTraffic {
    /// Packets sent, bytes sent, packets received, bytes received (UDP payloads; a message
    /// executed directly counts as its request packet and, for a READ or atomic, its response,
    /// each of the length of the data it carries: see [`QpTrafficTable::count_direct`]).
    pub pkts: [u64; 4],
    /// The increments of the engine's rare counters (the ones `rare!` lists) while handling this
    /// QP's packets (received, or produced by `poll_transmit`). Timer work (`ack_timeouts`, retry
    /// rounds started by a timeout) is not attributed to a QP. One `poll_transmit` may also do
    /// work for other QPs that send nothing (an SQ flushed after an error): that goes to the QP
    /// whose packet it returns, or to none if it returns none. The packet and byte fields stay 0
    /// (`pkts` has those).
    pub engine: Counters,
}

/// Calls `$m!` with the engine counters that are attributed to QPs: all but the per-packet ones.
macro_rules! rare {
    ($m:ident, $($arg:expr),*) => {
        $m!(
            $($arg),*;
            drop_malformed,
            drop_unknown_qp,
            drop_bad_state,
            drop_pkey,
            drop_qkey,
            drop_no_recv,
            drop_uc_msg,
            drop_stray_resp,
            duplicate_request,
            out_of_seq_request,
            rcvd_seq_err,
            send_rnr_nak,
            rcvd_rnr_err,
            send_err_nak,
            rcvd_err_nak,
            retry_rounds,
            retransmits,
            ack_timeouts,
            cq_overflow
        )
    };
}

/// The sum of the fields listed. The pattern names every field of `Counters` (the per-packet ones
/// ignored), so a counter added to the engine fails to compile here until it is listed in `rare!`
/// or ignored.
macro_rules! sum_of {
    ($c:expr; $($f:ident),*) => {{
        let Counters { rcvd_pkts: _, sent_pkts: _, rcvd_bytes: _, sent_bytes: _, $($f),* } = *$c;
        0u64 $( .wrapping_add($f) )*
    }};
}

macro_rules! add_delta_of {
    ($acc:expr, $a:expr, $b:expr; $($f:ident),*) => {
        $( $acc.$f = $acc.$f.wrapping_add($b.$f.wrapping_sub($a.$f)); )*
    };
}

/// A sum of the rare counters: it changes whenever one of them does (they only grow).
fn rare_sum(c: &Counters) -> u64 {
    rare!(sum_of, c)
}

/// The per-QP table of a device in daemon mode.
#[derive(Debug, Default)]
pub(crate) struct QpTrafficTable {
    qps: BTreeMap<Qpn, QpTraffic>,
    /// The engine's counters when the last attributed piece of work ended (or when a change made
    /// outside one was noticed), and their [`rare_sum`].
    seen: Counters,
    seen_sum: u64,
}

impl QpTrafficTable {
    /// Start counting for a new QP.
    pub fn insert(&mut self, qpn: Qpn) {
        self.qps.insert(qpn, QpTraffic::default());
    }

    /// Forget a destroyed QP.
    pub fn remove(&mut self, qpn: Qpn) {
        self.qps.remove(&qpn);
    }

    /// What QP `qpn` has been counted for.
    pub fn get(&self, qpn: Qpn) -> Option<&QpTraffic> {
        self.qps.get(&qpn)
    }

    /// A message the engine executed directly between two QPs of the device (transport
    /// `hca/direct.rs`): a request packet from the requester to the responder, carrying the bytes
    /// of a SEND or WRITE; for a READ or atomic, a response packet back with its bytes. It changes
    /// no rare counter.
    pub fn count_direct(&mut self, m: &DirectMessage) {
        let len = u64::from(m.len);
        // (packets, bytes) of the request and of the response.
        let request = (1, if m.response { 0 } else { len });
        let response = if m.response { (1, len) } else { (0, 0) };
        self.add_packets(m.requester, request, response);
        self.add_packets(m.responder, response, request);
    }

    /// A packet sent to a multicast group, taken in by the engine (after [`Self::begin`]): the
    /// group's QP `qpn` is done with its copy of `len` bytes, and the engine's counters stand at
    /// `now`. What they changed by since the member before (a copy dropped for a wrong Q_Key or
    /// for want of a receive) is this member's.
    pub fn count_member(&mut self, qpn: Qpn, len: usize, now: &Counters) {
        self.end(qpn, now);
        self.add_packets(qpn, (0, 0), (1, len as u64));
    }

    /// Count (packets, bytes) sent and received by QP `qpn`.
    fn add_packets(&mut self, qpn: Qpn, sent: (u64, u64), rcvd: (u64, u64)) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.pkts[0] += sent.0;
            q.pkts[1] += sent.1;
            q.pkts[2] += rcvd.0;
            q.pkts[3] += rcvd.1;
        }
    }

    /// Before a piece of work for one QP: what changed since the last one is nobody's.
    pub fn begin(&mut self, now: &Counters) {
        let sum = rare_sum(now);
        if sum != self.seen_sum {
            self.seen = *now;
            self.seen_sum = sum;
        }
    }

    /// After that piece of work, done for QP `qpn` (now known): add what changed to the QP's
    /// counters, and return its entry (for the packets) if the QP is counted.
    pub fn end(&mut self, qpn: Qpn, now: &Counters) -> Option<&mut QpTraffic> {
        let mut q = self.qps.get_mut(&qpn);
        let sum = rare_sum(now);
        if sum != self.seen_sum {
            if let Some(q) = q.as_deref_mut() {
                rare!(add_delta_of, q.engine, self.seen, now);
            }
            self.seen = *now;
            self.seen_sum = sum;
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qpn(n: u32) -> Qpn {
        Qpn::new(n)
    }

    #[test]
    fn rare_changes_go_to_the_qp_whose_work_made_them_and_timer_changes_to_none() {
        let mut t = QpTrafficTable::default();
        t.insert(qpn(17));
        t.insert(qpn(18));
        let mut c = Counters::default();

        // QP 17's packet: one sent, a retransmit and a NAK counted during it.
        t.begin(&c);
        c.sent_pkts += 1;
        c.retransmits += 2;
        c.rcvd_err_nak += 1;
        t.end(qpn(17), &c).expect("counted").pkts[0] += 1;

        // A timer between two packets: an ACK timeout and a retry round, nobody's.
        c.ack_timeouts += 1;
        c.retry_rounds += 1;

        // QP 18's packet: a drop, and the per-packet counters (not attributed).
        t.begin(&c);
        c.rcvd_pkts += 1;
        c.drop_no_recv += 1;
        t.end(qpn(18), &c);

        // QP 18 again, nothing rare.
        t.begin(&c);
        c.rcvd_pkts += 1;
        t.end(qpn(18), &c);

        let a = t.get(qpn(17)).expect("17");
        assert_eq!(a.pkts, [1, 0, 0, 0]);
        assert_eq!((a.engine.retransmits, a.engine.rcvd_err_nak), (2, 1));
        assert_eq!((a.engine.ack_timeouts, a.engine.retry_rounds, a.engine.drop_no_recv), (0, 0, 0));
        let b = t.get(qpn(18)).expect("18");
        assert_eq!(b.engine.drop_no_recv, 1);
        assert_eq!((b.engine.ack_timeouts, b.engine.retry_rounds, b.engine.retransmits), (0, 0, 0));
        assert_eq!((b.engine.rcvd_pkts, b.engine.sent_pkts), (0, 0));
    }

    #[test]
    fn a_direct_message_counts_as_its_request_and_response_packets() {
        let mut t = QpTrafficTable::default();
        t.insert(qpn(17));
        t.insert(qpn(18));
        t.count_direct(&DirectMessage { requester: qpn(17), responder: qpn(18), len: 64, response: false });
        t.count_direct(&DirectMessage { requester: qpn(18), responder: qpn(17), len: 8, response: false });
        assert_eq!(t.get(qpn(17)).expect("17").pkts, [1, 64, 1, 8]);
        assert_eq!(t.get(qpn(18)).expect("18").pkts, [1, 8, 1, 64]);
        // A READ of 100 bytes by 17: its request goes out empty, the data comes back.
        t.count_direct(&DirectMessage { requester: qpn(17), responder: qpn(18), len: 100, response: true });
        assert_eq!(t.get(qpn(17)).expect("17").pkts, [2, 64, 2, 108]);
        assert_eq!(t.get(qpn(18)).expect("18").pkts, [2, 108, 2, 64]);
    }

    #[test]
    fn a_multicast_packet_counts_as_received_by_each_member_and_a_drop_by_the_member_that_dropped() {
        let mut t = QpTrafficTable::default();
        for n in [17, 18, 19] {
            t.insert(qpn(n));
        }
        let mut c = Counters::default();
        t.begin(&c);
        c.rcvd_pkts += 1;
        // 17 takes its copy; 19 drops its own (a wrong Q_Key).
        t.count_member(qpn(17), 100, &c);
        c.drop_qkey += 1;
        t.count_member(qpn(19), 100, &c);
        // The next piece of work does not inherit the drop.
        t.begin(&c);
        t.end(qpn(18), &c);
        assert_eq!(t.get(qpn(17)).expect("17").pkts, [0, 0, 1, 100]);
        assert_eq!(t.get(qpn(18)).expect("18").pkts, [0, 0, 0, 0]);
        assert_eq!(t.get(qpn(19)).expect("19").pkts, [0, 0, 1, 100]);
        let drops = |n| t.get(qpn(n)).expect("qp").engine.drop_qkey;
        assert_eq!((drops(17), drops(18), drops(19)), (0, 0, 1));
    }
}
