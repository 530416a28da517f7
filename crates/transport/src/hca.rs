//! The HCA endpoint: owns queue pairs, SRQs and CQs, demultiplexes packets by destination QPN,
//! and exposes the engine's inputs and outputs.

use std::collections::{BTreeMap, VecDeque};

use crate::attr::{AddressVector, ModifyQp, QpInit};
use crate::config::Config;
use crate::cq::WorkCompletion;
use crate::error::VerbsError;
use crate::memory::MemoryAccess;
use crate::qp::{Qp, QpInfo};
use crate::stats::Counters;
use crate::time::Instant;
use crate::wr::{RecvWr, SendWr};
use softrdma_wire::{IbPacket, Qpn};

pub use crate::qp::QpInfo as QueuePairInfo;

/// A protection domain handle (allocated by the device layer; the engine only compares them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PdId(pub u32);

/// A completion queue handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CqId(pub u32);

/// A shared receive queue handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SrqId(pub u32);

/// Asynchronous events (verbs `ibv_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// First packet received in RTR (communication established).
    CommEstablished(Qpn),
    /// The send queue drained after entering SQD with notification asked.
    SqDrained(Qpn),
    /// A QP attached to an SRQ went to ERR: no more WQEs will be consumed.
    QpLastWqeReached(Qpn),
    /// The responder saw an invalid request (`IBV_EVENT_QP_REQ_ERR`).
    QpRequestError(Qpn),
    /// The responder saw an access violation (`IBV_EVENT_QP_ACCESS_ERR`).
    QpAccessError(Qpn),
    /// The QP hit a catastrophic error (`IBV_EVENT_QP_FATAL`).
    QpFatal(Qpn),
    /// An SRQ's WQE count fell below its armed limit.
    SrqLimitReached(SrqId),
    /// A CQ overflowed (`IBV_EVENT_CQ_ERR`).
    CqError(CqId),
    /// The port became active (`IBV_EVENT_PORT_ACTIVE`; reported by the device layer, never by the
    /// engine).
    PortActive(u8),
    /// The port went down (`IBV_EVENT_PORT_ERR`; reported by the device layer).
    PortError(u8),
}

/// Where a received packet came from, as far as the engine needs: the 40 bytes a UD receive puts in
/// front of the data (for RoCEv2, rxe puts the IPv4 header in the last 20 bytes, or the IPv6 header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxInfo {
    /// The GRH area delivered with UD receives.
    pub grh: [u8; 40],
}

/// One packet produced by [`Hca::poll_transmit`]: `buf[..len]` holds the IB transport packet (BTH
/// through a zeroed ICRC slot); the I/O layer wraps it and fills the ICRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Bytes written.
    pub len: usize,
    /// Destination (the QP's path, or the UD work request's address handle).
    pub av: AddressVector,
    /// Sending QP (lets the I/O layer pick a per-QP UDP source port, as rxe does).
    pub src_qpn: Qpn,
    /// Destination QP.
    pub dest_qpn: Qpn,
}

/// A completion queue.
#[derive(Debug)]
struct Cq {
    entries: VecDeque<WorkCompletion>,
    depth: usize,
    armed: Option<bool>,
    users: u32,
}

/// A shared receive queue.
#[derive(Debug)]
struct Srq {
    wqes: VecDeque<RecvWr>,
    max_wr: usize,
    max_sge: usize,
    limit: Option<usize>,
    users: u32,
}

/// CQs and SRQs, borrowed by QPs while they run.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    cqs: BTreeMap<CqId, Cq>,
    srqs: BTreeMap<SrqId, Srq>,
    /// CQs with a new completion while armed, for completion channels.
    notify: VecDeque<CqId>,
}

/// Everything a QP touches besides itself during one call.
pub(crate) struct Ctx<'a> {
    pub now: Instant,
    pub mem: &'a mut dyn MemoryAccess,
    pub queues: &'a mut Queues,
    pub events: &'a mut VecDeque<AsyncEvent>,
    pub stats: &'a mut Counters,
    pub config: &'a Config,
    pub ready: &'a mut VecDeque<Qpn>,
}

impl Ctx<'_> {
    /// The QP may have something to send.
    pub fn mark_ready(&mut self, qpn: Qpn) {
        if !self.ready.contains(&qpn) {
            self.ready.push_back(qpn);
        }
    }

    fn push_wc(&mut self, cq: CqId, wc: WorkCompletion, solicited: bool) {
        let Some(q) = self.queues.cqs.get_mut(&cq) else {
            return;
        };
        if q.entries.len() >= q.depth {
            self.stats.cq_overflow += 1;
            self.events.push_back(AsyncEvent::CqError(cq));
            return;
        }
        q.entries.push_back(wc);
        if let Some(solicited_only) = q.armed {
            if !solicited_only || solicited || wc.status != crate::cq::WcStatus::Success {
                q.armed = None;
                self.queues.notify.push_back(cq);
            }
        }
    }

    pub fn push_send_wc(&mut self, cq: CqId, wc: WorkCompletion) {
        self.push_wc(cq, wc, false);
    }

    pub fn push_recv_wc(&mut self, cq: CqId, wc: WorkCompletion) {
        self.push_wc(cq, wc, true);
    }

    pub fn srq_take(&mut self, id: SrqId) -> Option<RecvWr> {
        let srq = self.queues.srqs.get_mut(&id)?;
        let wr = srq.wqes.pop_front()?;
        if srq.limit.is_some_and(|l| srq.wqes.len() < l) {
            srq.limit = None;
            self.events.push_back(AsyncEvent::SrqLimitReached(id));
        }
        Some(wr)
    }

    pub fn srq_len(&self, id: SrqId) -> usize {
        self.queues.srqs.get(&id).map_or(0, |s| s.wqes.len())
    }
}

/// A sans-IO HCA.
pub struct Hca {
    config: Config,
    qps: BTreeMap<Qpn, Qp>,
    queues: Queues,
    events: VecDeque<AsyncEvent>,
    stats: Counters,
    ready: VecDeque<Qpn>,
    next_qpn: u32,
    next_id: u32,
}

impl Hca {
    /// An HCA with no objects. QPNs are allocated from 0x11 upwards, as rxe does.
    pub fn new(config: Config) -> Hca {
        Hca {
            config,
            qps: BTreeMap::new(),
            queues: Queues::default(),
            events: VecDeque::new(),
            stats: Counters::default(),
            ready: VecDeque::new(),
            next_qpn: 0x11,
            next_id: 1,
        }
    }

    /// Configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters.
    pub fn counters(&self) -> &Counters {
        &self.stats
    }

    /// Mutable counters (the I/O layer adds its own drops, e.g. ICRC failures).
    pub fn counters_mut(&mut self) -> &mut Counters {
        &mut self.stats
    }

    fn ctx<'a>(&'a mut self, now: Instant, mem: &'a mut dyn MemoryAccess) -> (&'a mut BTreeMap<Qpn, Qp>, Ctx<'a>) {
        let Hca { config, qps, queues, events, stats, ready, .. } = self;
        (qps, Ctx { now, mem, queues, events, stats, config, ready })
    }

    // ---- CQ / SRQ ----------------------------------------------------------------------------

    /// Create a CQ holding up to `depth` completions.
    pub fn create_cq(&mut self, depth: u32) -> CqId {
        let id = CqId(self.next_id);
        self.next_id += 1;
        self.queues
            .cqs
            .insert(id, Cq { entries: VecDeque::new(), depth: depth.max(1) as usize, armed: None, users: 0 });
        id
    }

    /// Destroy a CQ; refused while QPs use it.
    pub fn destroy_cq(&mut self, cq: CqId) -> Result<(), VerbsError> {
        match self.queues.cqs.get(&cq) {
            None => Err(VerbsError::NoSuchObject),
            Some(c) if c.users > 0 => Err(VerbsError::Busy),
            Some(_) => {
                self.queues.cqs.remove(&cq);
                Ok(())
            }
        }
    }

    /// Take up to `max` completions, oldest first.
    pub fn poll_cq(&mut self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        let q = self.queues.cqs.get_mut(&cq).ok_or(VerbsError::NoSuchObject)?;
        let n = max.min(q.entries.len());
        out.extend(q.entries.drain(..n));
        Ok(n)
    }

    /// Ask for a completion event on the next completion (only solicited or error ones if
    /// `solicited_only`).
    pub fn req_notify_cq(&mut self, cq: CqId, solicited_only: bool) -> Result<(), VerbsError> {
        let q = self.queues.cqs.get_mut(&cq).ok_or(VerbsError::NoSuchObject)?;
        q.armed = Some(solicited_only);
        Ok(())
    }

    /// The next CQ that got a completion while armed.
    pub fn poll_cq_event(&mut self) -> Option<CqId> {
        self.queues.notify.pop_front()
    }

    /// Create an SRQ.
    pub fn create_srq(&mut self, max_wr: u32, max_sge: u32) -> SrqId {
        let id = SrqId(self.next_id);
        self.next_id += 1;
        self.queues.srqs.insert(
            id,
            Srq { wqes: VecDeque::new(), max_wr: max_wr as usize, max_sge: max_sge as usize, limit: None, users: 0 },
        );
        id
    }

    /// Arm the SRQ limit: an event fires when fewer than `limit` WQEs remain.
    pub fn arm_srq(&mut self, srq: SrqId, limit: u32) -> Result<(), VerbsError> {
        let s = self.queues.srqs.get_mut(&srq).ok_or(VerbsError::NoSuchObject)?;
        s.limit = (limit > 0).then_some(limit as usize);
        Ok(())
    }

    /// Post a receive to an SRQ.
    pub fn post_srq_recv(&mut self, srq: SrqId, wr: RecvWr) -> Result<(), VerbsError> {
        let s = self.queues.srqs.get_mut(&srq).ok_or(VerbsError::NoSuchObject)?;
        if wr.sgl.len() > s.max_sge {
            return Err(VerbsError::InvalidWorkRequest("more SGEs than max_sge"));
        }
        if s.wqes.len() >= s.max_wr {
            return Err(VerbsError::QueueFull);
        }
        s.wqes.push_back(wr);
        Ok(())
    }

    /// Destroy an SRQ; refused while QPs use it.
    pub fn destroy_srq(&mut self, srq: SrqId) -> Result<(), VerbsError> {
        match self.queues.srqs.get(&srq) {
            None => Err(VerbsError::NoSuchObject),
            Some(s) if s.users > 0 => Err(VerbsError::Busy),
            Some(_) => {
                self.queues.srqs.remove(&srq);
                Ok(())
            }
        }
    }

    // ---- QPs ---------------------------------------------------------------------------------

    /// Create a QP in RESET.
    pub fn create_qp(&mut self, init: QpInit) -> Result<Qpn, VerbsError> {
        if !self.queues.cqs.contains_key(&init.send_cq) || !self.queues.cqs.contains_key(&init.recv_cq) {
            return Err(VerbsError::NoSuchObject);
        }
        if let Some(srq) = init.srq {
            self.queues.srqs.get_mut(&srq).ok_or(VerbsError::NoSuchObject)?.users += 1;
        }
        for cq in [init.send_cq, init.recv_cq] {
            if let Some(c) = self.queues.cqs.get_mut(&cq) {
                c.users += 1;
            }
        }
        let mut qpn = Qpn::new(self.next_qpn);
        while self.qps.contains_key(&qpn) || qpn.value() < 0x11 {
            self.next_qpn = self.next_qpn.wrapping_add(1);
            qpn = Qpn::new(self.next_qpn);
        }
        self.next_qpn = self.next_qpn.wrapping_add(1);
        self.qps.insert(qpn, Qp::new(qpn, init));
        Ok(qpn)
    }

    /// Create a QP in RESET with a QPN chosen by the caller instead of the next free one: for
    /// replaying a capture, or restoring a QP whose number a peer already knows. The allocation
    /// counter is left where it was. Refused for QP0, QP1 and the other reserved numbers below 0x11,
    /// for the multicast QPN and for a number in use.
    pub fn create_qp_with_qpn(&mut self, init: QpInit, qpn: Qpn) -> Result<Qpn, VerbsError> {
        if qpn.value() < 0x11 || qpn == Qpn::MULTICAST {
            return Err(VerbsError::InvalidAttribute("qpn reserved"));
        }
        if self.qps.contains_key(&qpn) {
            return Err(VerbsError::InvalidAttribute("qpn in use"));
        }
        let saved = self.next_qpn;
        self.next_qpn = qpn.value();
        let created = self.create_qp(init);
        self.next_qpn = saved;
        match created {
            Ok(got) if got != qpn => {
                // create_qp no longer allocates from the counter: undo and refuse.
                let _ = self.destroy_qp(got);
                Err(VerbsError::InvalidAttribute("qpn"))
            }
            r => r,
        }
    }

    /// Destroy a QP (no completions are generated for what it held).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<(), VerbsError> {
        let qp = self.qps.remove(&qpn).ok_or(VerbsError::NoSuchObject)?;
        for cq in [qp.init.send_cq, qp.init.recv_cq] {
            if let Some(c) = self.queues.cqs.get_mut(&cq) {
                c.users -= 1;
            }
        }
        if let Some(s) = qp.init.srq.and_then(|s| self.queues.srqs.get_mut(&s)) {
            s.users -= 1;
        }
        self.ready.retain(|q| *q != qpn);
        Ok(())
    }

    /// Modify a QP's state and attributes.
    pub fn modify_qp(
        &mut self,
        qpn: Qpn,
        attr: &ModifyQp,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        let (qps, mut ctx) = self.ctx(now, mem);
        qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?.modify(attr, &mut ctx)
    }

    /// Query a QP.
    pub fn query_qp(&self, qpn: Qpn) -> Result<QpInfo, VerbsError> {
        self.qps.get(&qpn).map(|q| q.info()).ok_or(VerbsError::NoSuchObject)
    }

    /// Post a send work request.
    pub fn post_send(
        &mut self,
        qpn: Qpn,
        wr: SendWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        let (qps, mut ctx) = self.ctx(now, mem);
        qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?.post_send(wr, &mut ctx)
    }

    /// Post a receive work request.
    pub fn post_recv(
        &mut self,
        qpn: Qpn,
        wr: RecvWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        let (qps, mut ctx) = self.ctx(now, mem);
        qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?.post_recv(wr, &mut ctx)
    }

    // ---- packets and time --------------------------------------------------------------------

    /// A received IB transport packet (BTH through ICRC; the ICRC was checked by the I/O layer).
    /// Malformed packets and packets for unknown QPs are counted and dropped.
    pub fn handle_packet(&mut self, now: Instant, bytes: &[u8], rx: &RxInfo, mem: &mut dyn MemoryAccess) {
        self.stats.rcvd_pkts += 1;
        let pkt = match IbPacket::new_checked(bytes) {
            Ok(p) => p,
            Err(_) => {
                self.stats.drop_malformed += 1;
                return;
            }
        };
        let qpn = pkt.bth().dest_qp();
        let (qps, mut ctx) = self.ctx(now, mem);
        match qps.get_mut(&qpn) {
            Some(qp) => qp.handle_packet(&pkt, &rx.grh, &mut ctx),
            None => ctx.stats.drop_unknown_qp += 1,
        }
    }

    /// Fire expired timers.
    pub fn handle_timeout(&mut self, now: Instant, mem: &mut dyn MemoryAccess) {
        let (qps, mut ctx) = self.ctx(now, mem);
        for qp in qps.values_mut() {
            if qp.next_deadline().is_some_and(|t| t <= now) {
                qp.handle_timeout(&mut ctx);
            }
        }
    }

    /// The earliest timer deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps.values().filter_map(|q| q.next_deadline()).min()
    }

    /// Whether [`Hca::poll_transmit`] may have a packet: false means it would return `None` (a
    /// driver polling in a tight loop skips setting up its transmit batch).
    pub fn has_transmit(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Write the next packet to send into `buf` (at least MTU + 64 bytes long).
    pub fn poll_transmit(&mut self, now: Instant, mem: &mut dyn MemoryAccess, buf: &mut [u8]) -> Option<Transmit> {
        let burst = self.config.burst;
        let (qps, mut ctx) = self.ctx(now, mem);
        while let Some(&qpn) = ctx.ready.front() {
            let Some(qp) = qps.get_mut(&qpn) else {
                ctx.ready.pop_front();
                continue;
            };
            match qp.poll_transmit(buf, &mut ctx) {
                Some(t) => {
                    qp.burst += 1;
                    if qp.burst >= burst {
                        qp.burst = 0;
                        ctx.ready.retain(|q| *q != qpn);
                        ctx.ready.push_back(qpn);
                    }
                    return Some(t);
                }
                None => {
                    qp.burst = 0;
                    ctx.ready.retain(|q| *q != qpn);
                }
            }
        }
        None
    }

    /// The next asynchronous event.
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }
}
