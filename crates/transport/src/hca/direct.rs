//! Direct execution between two QPs of this HCA: a one-packet RC request (SEND or RDMA WRITE,
//! either with immediate, RDMA READ, atomic) posted to a QP whose peer is another QP of the same
//! HCA, connected back to it, is carried out at post time: its data goes from the requester's
//! memory to the responder's (a READ's data or an atomic's original value back), the responder
//! completes its receive, and the requester its send, with no packet built, taken in or
//! acknowledged. This is the internal loopback of a hardware HCA; rxe loops such packets back
//! through its own receive path, which costs a packet each way.
//!
//! It applies only where the outcome is the packet path's: the requester has nothing queued or in
//! flight and owes its peer no response (so nothing can be overtaken), the responder has nothing in
//! progress or pending and expects that PSN, and every check the packet would pass holds. Anything
//! else (an RNR, a bad key, a receive too short, a multi-packet message) takes the packet path,
//! which produces the exact NAK, completion and state change. A direct message consumes one PSN on
//! both sides, as its packet would, and counts as its request packet (and a READ's or atomic's
//! response).
//!
//! The I/O layer says which destination GIDs are this HCA's own ([`Hca::set_local_gids`]): none
//! (the default) turns direct execution off.

use super::Hca;
use crate::memory::MemoryAccess;
use crate::time::Instant;
use crate::wr::SendWr;
use softrdma_wire::Qpn;

/// Largest payload executed directly: the largest path MTU.
const MAX_PAYLOAD: usize = 4096;

/// One message executed directly (see [`Hca::take_direct`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectMessage {
    /// The QP that posted it.
    pub requester: Qpn,
    /// The QP that took it.
    pub responder: Qpn,
    /// Bytes moved: a SEND's or WRITE's payload, a READ's data, an atomic's 8.
    pub len: u32,
    /// The bytes went from the responder to the requester (a READ or an atomic), whose request
    /// carried none.
    pub response: bool,
}

/// The HCA's direct-execution state.
#[derive(Debug, Default)]
pub(super) struct Direct {
    /// The GIDs that lead to this HCA itself.
    gids: Vec<[u8; 16]>,
    /// The payload on its way (kept to avoid zeroing a buffer per message).
    buf: Vec<u8>,
    /// The last message executed, until taken.
    last: Option<DirectMessage>,
    /// Messages executed.
    executed: u64,
}

impl Direct {
    /// Direct execution is on.
    pub(super) fn is_on(&self) -> bool {
        !self.gids.is_empty()
    }
}

impl Hca {
    /// Set the destination GIDs that are this HCA's own (the I/O layer's addresses), turning direct
    /// execution between its QPs on (none: off).
    pub fn set_local_gids(&mut self, gids: &[[u8; 16]]) {
        self.direct.gids = gids.to_vec();
        self.direct.buf.resize(if gids.is_empty() { 0 } else { MAX_PAYLOAD }, 0);
    }

    /// The last message executed directly, if one was since the last call (the I/O layer counts it
    /// for the two QPs).
    pub fn take_direct(&mut self) -> Option<DirectMessage> {
        self.direct.last.take()
    }

    /// How many messages were executed directly.
    pub fn direct_executed(&self) -> u64 {
        self.direct.executed
    }

    /// Execute `wr`, posted to `qpn`, directly if it may be (see the module comment): `true` when
    /// done, `false` when nothing was done and the request is to be posted as usual.
    pub(super) fn post_direct(&mut self, qpn: Qpn, wr: &SendWr, now: Instant, mem: &mut dyn MemoryAccess) -> bool {
        // Only toward one of this HCA's own GIDs (checked before the buffer is taken: most posts go
        // elsewhere).
        let local = |q: &crate::qp::Qp| self.direct.gids.contains(&q.attr.av.dgid);
        if !self.direct.is_on() || !self.qps.get(&qpn).is_some_and(local) {
            return false;
        }
        let mut buf = std::mem::take(&mut self.direct.buf);
        let done = self.execute(qpn, wr, now, mem, &mut buf);
        self.direct.buf = buf;
        if let Some(m) = done {
            self.direct.last = Some(m);
            self.direct.executed += 1;
        }
        done.is_some()
    }

    fn execute(
        &mut self,
        qpn: Qpn,
        wr: &SendWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
        buf: &mut [u8],
    ) -> Option<DirectMessage> {
        // The two QPs are each other's peers, both through one of this HCA's own GIDs.
        let local = |dgid: &[u8; 16]| self.direct.gids.contains(dgid);
        let r = self.qps.get(&qpn)?;
        let peer = r.attr.dest_qpn;
        let s = self.qps.get(&peer)?;
        if peer == qpn || s.attr.dest_qpn != qpn || !local(&r.attr.av.dgid) || !local(&s.attr.av.dgid) {
            return None;
        }
        let (qps, _, mut ctx) = self.ctx(now, mem);
        let r = qps.get(&qpn)?;
        let psn = r.sq.npsn;
        let mut d = r.direct_request(wr, &ctx, buf)?;
        if !qps.get_mut(&peer).is_some_and(|s| s.take_direct(psn, &wr.op, &mut d, &mut ctx)) {
            return None;
        }
        // Nothing was queued and nothing is: no window or ready list to bring up to date (and a
        // requester that failed moved to ERR, which stops its timers).
        qps.get_mut(&qpn)?.complete_direct(wr, &d, &mut ctx);
        let response = wr.op.is_read_or_atomic();
        Some(DirectMessage { requester: qpn, responder: peer, len: d.len() as u32, response })
    }
}
