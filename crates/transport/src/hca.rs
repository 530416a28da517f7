//! The HCA endpoint: owns queue pairs, SRQs and CQs, demultiplexes packets by destination QPN,
//! and exposes the engine's inputs and outputs.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::attr::{AddressVector, ModifyQp, QpInit};
use crate::config::Config;
use crate::cq::WorkCompletion;
use crate::error::VerbsError;
use crate::memory::MemoryAccess;
use crate::qp::{Qp, QpInfo};
use crate::stats::Counters;
use crate::time::Instant;
use crate::wr::{RecvWr, SendWr, Sge};
use softrdma_wire::opcode::Flags;
use softrdma_wire::{IbPacket, Qpn};

pub use crate::qp::QpInfo as QueuePairInfo;
pub use direct::DirectMessage;

mod direct;
pub mod multicast;

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
    /// The payload was left in registered memory (see [`crate::Config::defer_payload_min`]).
    pub deferred: Option<DeferredPayload>,
}

/// A packet's payload left in registered memory: `buf[at..at + len]` is a hole the I/O layer fills
/// (or sends around) with the pieces, in order. The keys, bounds and rights were checked when the
/// packet was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeferredPayload {
    /// Offset of the payload in the packet.
    pub at: usize,
    /// Payload length (the sum of the pieces).
    pub len: usize,
    /// The protection domain the keys were checked in.
    pub pd: PdId,
    /// The pieces: `pieces[..n]` (`length` bytes at `addr` under local key `lkey`).
    pub pieces: [Sge; DeferredPayload::MAX_PIECES],
    /// Pieces used.
    pub n: usize,
}

impl DeferredPayload {
    /// Most pieces of one deferred payload; a packet whose payload spans more SGEs is copied.
    pub const MAX_PIECES: usize = 2;

    /// The pieces used.
    pub fn pieces(&self) -> &[Sge] {
        &self.pieces[..self.n]
    }
}

/// Where the payload of the next in-sequence packet of an RC RDMA WRITE in progress goes (see
/// [`Hca::rx_placement`]): `remaining` bytes at `addr` under `rkey` in `pd`, all inside the range the
/// WRITE's RETH was checked for (rkey, bounds, remote-write right) when its FIRST packet arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxPlacement {
    /// The QP.
    pub qpn: Qpn,
    /// The PSN the next packet must carry.
    pub psn: softrdma_wire::Psn,
    /// The QP's protection domain.
    pub pd: PdId,
    /// The WRITE's rkey.
    pub rkey: u32,
    /// Where the next packet's payload goes.
    pub addr: u64,
    /// Bytes of the WRITE still to come (from `addr` to the end of the RETH's range).
    pub remaining: u32,
    /// The QP's path MTU: the payload of every packet but the last.
    pub mtu: u32,
}

impl RxPlacement {
    /// Whether a request packet (its headers in `pkt`) is this WRITE's next one: a WRITE MIDDLE or
    /// LAST for this QP with the next PSN. Its length is for the caller to check.
    pub fn is_next(&self, pkt: &IbPacket<&[u8]>) -> bool {
        let (bth, info) = (pkt.bth(), pkt.info());
        info.is(Flags::WRITE)
            && !info.is(Flags::RESP)
            && !info.starts_message()
            && bth.dest_qp() == self.qpn
            && bth.psn() == self.psn
    }

    /// Whether the responder takes such a packet with a payload of `len` bytes as the WRITE's
    /// next: [`RxPlacement::is_next`], and a MIDDLE of exactly the MTU that leaves bytes to come, or
    /// a LAST that ends the WRITE. (A LAST with immediate data also needs a receive WQE, which this
    /// does not know.)
    pub fn admits(&self, pkt: &IbPacket<&[u8]>, len: usize) -> bool {
        let (mtu, remaining) = (self.mtu as usize, self.remaining as usize);
        let fits =
            if pkt.info().ends_message() { len <= mtu && len == remaining } else { len == mtu && len < remaining };
        fits && self.is_next(pkt)
    }
}

/// A completion queue.
#[derive(Debug)]
struct Cq {
    entries: VecDeque<WorkCompletion>,
    /// How many of `entries` are successful receive completions (asked on every busy poll that
    /// takes a packet in: see [`Hca::cq_awaits_one`]).
    receives: usize,
    /// How many of `entries` brought their poller data ([`WorkCompletion::brings_data`]).
    with_data: usize,
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

impl Queues {
    /// The receive WQE an SRQ hands out next.
    pub fn srq_front(&self, id: SrqId) -> Option<&RecvWr> {
        self.srqs.get(&id)?.wqes.front()
    }
}

/// Everything a QP touches besides itself during one call.
pub(crate) struct Ctx<'a> {
    pub now: Instant,
    pub mem: &'a mut dyn MemoryAccess,
    pub queues: &'a mut Queues,
    pub events: &'a mut VecDeque<AsyncEvent>,
    pub stats: &'a mut Counters,
    pub config: &'a Config,
    pub ready: &'a mut ReadyList,
    /// This QP's share of the device's packets in flight (`Config::device_inflight_packets`), an
    /// upper bound on its window.
    pub share: u32,
    /// The device has `Config::device_inflight_packets` in flight: no QP may send a new packet
    /// (retransmissions may go).
    pub device_full: bool,
    /// Set by a requester that had a packet to send and was held back by `device_full` only; the
    /// HCA queues the QP until packets in flight drop below the budget.
    pub held: bool,
    /// The packet's payload (this many bytes) is already at its destination (see
    /// [`Hca::handle_placed`]); the packet itself carries none.
    pub placed: Option<usize>,
}

impl Ctx<'_> {
    /// The QP may have something to send.
    pub fn mark_ready(&mut self, qpn: Qpn) {
        self.ready.push(qpn);
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
        q.receives += usize::from(wc.is_successful_receive());
        q.with_data += usize::from(wc.brings_data());
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
}

/// A hasher for QPNs (24-bit numbers allocated in sequence): one multiply, enough to spread them
/// over a hash table's buckets. QPNs of a local set are not chosen by a peer, so no keyed hash is
/// needed.
#[derive(Default)]
pub(crate) struct QpnHasher(u64);

impl Hasher for QpnHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// QPs by number.
type QpMap = HashMap<Qpn, Qp, BuildHasherDefault<QpnHasher>>;

/// QPs that may have something to send, in turn order, each at most once. Marking a QP ready and
/// taking the next one cost O(1) whatever the number of QPs (with 10,000 QPs, a list scan per
/// packet would dominate): from [`SCAN_MAX`] QPs on, a set says which are queued. Below that the
/// list itself is scanned, which costs less than hashing (a ping-pong marks its QP ready and
/// takes it again on every message).
#[derive(Debug, Default)]
pub(crate) struct ReadyList {
    order: VecDeque<Qpn>,
    /// Empty while the list is scanned; otherwise exactly the QPs in `order`.
    members: HashSet<Qpn, BuildHasherDefault<QpnHasher>>,
}

/// Queued QPs up to which [`ReadyList`] scans its list rather than keep a set.
const SCAN_MAX: usize = 8;

impl ReadyList {
    /// Queue `qpn` at the back unless it is queued already.
    pub fn push(&mut self, qpn: Qpn) {
        // The QP queued last is queued: a post list marks its QP once per request, and this skips
        // the search.
        if self.order.back() == Some(&qpn) {
            return;
        }
        if self.members.is_empty() {
            if self.order.contains(&qpn) {
                return;
            }
            if self.order.len() + 1 >= SCAN_MAX {
                self.members.extend(self.order.iter().copied());
                self.members.insert(qpn);
            }
            self.order.push_back(qpn);
        } else if self.members.insert(qpn) {
            self.order.push_back(qpn);
        }
    }

    fn front(&self) -> Option<Qpn> {
        self.order.front().copied()
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    fn pop_front(&mut self) -> Option<Qpn> {
        let q = self.order.pop_front()?;
        if !self.members.is_empty() {
            self.members.remove(&q);
        }
        Some(q)
    }

    /// Move the front QP to the back (its turn is over, it still has work).
    fn rotate(&mut self) {
        if let Some(q) = self.order.pop_front() {
            self.order.push_back(q);
        }
    }

    fn remove(&mut self, qpn: Qpn) {
        let queued = if self.members.is_empty() { self.order.contains(&qpn) } else { self.members.remove(&qpn) };
        if queued {
            self.order.retain(|q| *q != qpn);
        }
    }
}

/// Every QP's earliest timer deadline, ordered, so that the next deadline and the expired QPs are
/// found in O(log n) instead of a scan over all QPs per call (the driver asks after every flush).
///
/// The index is kept *lazily*: an entry may be earlier than its QP's real deadline, never later.
/// A request arms the retransmit timer and its ACK stops it, so a ping-pong would otherwise remove
/// and insert an entry on every message; instead an entry moves only when a timer is armed
/// earlier than it, and a stale one fires as a no-op ([`Hca::handle_timeout`] then files the QP
/// under its real deadline, if any). State changes ([`Hca::modify_qp`]) file the QP exactly, so an
/// engine whose QPs were all reset or failed by their timers reports no deadline.
#[derive(Debug, Default)]
struct TimerIndex {
    /// `(deadline, qpn)` for every QP with a timer armed (or, stale, armed until recently).
    by_time: BTreeSet<(Instant, Qpn)>,
    /// Scratch list of expired QPs, kept to avoid an allocation per firing.
    due: Vec<Qpn>,
}

impl TimerIndex {
    /// Bring the index in line with `qp`'s timers after a call into it: only a deadline earlier
    /// than the entry (or the first one) moves it.
    fn sync(&mut self, qp: &mut Qp) {
        let Some(next) = qp.next_deadline() else { return };
        if qp.indexed_deadline.is_none_or(|old| next < old) {
            self.file(qp, Some(next));
        }
    }

    /// File `qp` under its exact next deadline (none: no entry).
    fn sync_exact(&mut self, qp: &mut Qp) {
        let next = qp.next_deadline();
        if next != qp.indexed_deadline {
            self.file(qp, next);
        }
    }

    fn file(&mut self, qp: &mut Qp, at: Option<Instant>) {
        if let Some(old) = qp.indexed_deadline {
            self.by_time.remove(&(old, qp.qpn));
        }
        if let Some(new) = at {
            self.by_time.insert((new, qp.qpn));
        }
        qp.indexed_deadline = at;
    }

    fn remove(&mut self, qp: &Qp) {
        if let Some(old) = qp.indexed_deadline {
            self.by_time.remove(&(old, qp.qpn));
        }
    }
}

/// What the HCA keeps about its QPs besides the QPs themselves, brought up to date after every
/// call into a QP.
struct Bookkeeping<'a> {
    timers: &'a mut TimerIndex,
    load: &'a mut Load,
    held: &'a mut ReadyList,
}

/// How busy the HCA's QPs are, summed over them by [`Bookkeeping::sync`].
#[derive(Debug)]
struct Load {
    /// `Config::device_inflight_packets`.
    budget: u32,
    /// RC QPs with send work queued (they share the budget).
    busy_qps: u32,
    /// Each busy QP's window: the budget shared among them (not below `Config::MIN_SHARE`), kept
    /// here rather than divided out on every call into a QP.
    share: u32,
    /// Packets in flight (sent, not acknowledged) over all RC QPs.
    inflight: u32,
    /// QPs with a READ response queued.
    owing_reads: u32,
}

impl Load {
    fn new(budget: u32) -> Load {
        let mut load = Load { budget, busy_qps: 0, share: 0, inflight: 0, owing_reads: 0 };
        load.set_busy(0);
        load
    }

    fn set_busy(&mut self, busy_qps: u32) {
        self.busy_qps = busy_qps;
        self.share = match self.budget {
            u32::MAX => u32::MAX,
            budget => (budget / busy_qps.max(1)).max(Config::MIN_SHARE),
        };
    }

    /// QP `qp` is gone: what it was counted for goes with it.
    fn forget(&mut self, qp: &Qp) {
        if qp.busy {
            self.set_busy(self.busy_qps - 1);
        }
        self.inflight -= qp.inflight;
        self.owing_reads -= u32::from(qp.owes_read);
    }
}

impl Bookkeeping<'_> {
    fn sync(&mut self, qp: &mut Qp) {
        self.timers.sync(qp);
        let load = &mut *self.load;
        let inflight = if qp.init.qp_type == crate::attr::QpType::Rc && qp.state.can_send() {
            qp.sq.sent_hw.diff(qp.sq.una).max(0) as u32
        } else {
            0
        };
        if inflight != qp.inflight {
            load.inflight = (load.inflight - qp.inflight) + inflight;
            qp.inflight = inflight;
        }
        let busy = qp.init.qp_type == crate::attr::QpType::Rc && qp.sq.len() > 0;
        if busy != qp.busy {
            qp.busy = busy;
            load.set_busy(if busy { load.busy_qps + 1 } else { load.busy_qps - 1 });
        }
        let owes_read = qp.resp.owes_read();
        if owes_read != qp.owes_read {
            qp.owes_read = owes_read;
            load.owing_reads = if owes_read { load.owing_reads + 1 } else { load.owing_reads - 1 };
        }
    }
}

/// A sans-IO HCA.
pub struct Hca {
    config: Config,
    /// The QPs by number (looked up several times per packet and per verb: a hash map costs the
    /// same with 10,000 QPs as with one).
    qps: QpMap,
    queues: Queues,
    events: VecDeque<AsyncEvent>,
    stats: Counters,
    ready: ReadyList,
    timers: TimerIndex,
    load: Load,
    /// QPs held back by a full device budget, in the order they were refused.
    held: ReadyList,
    next_qpn: u32,
    next_id: u32,
    /// Direct execution between this HCA's QPs (hca/direct.rs).
    direct: direct::Direct,
    /// Multicast groups and the QPs attached to them (hca/multicast.rs).
    groups: multicast::Groups,
}

impl Hca {
    /// An HCA with no objects. QPNs are allocated from 0x11 upwards, as rxe does.
    pub fn new(config: Config) -> Hca {
        let budget = config.device_inflight_packets;
        Hca {
            config,
            qps: QpMap::default(),
            queues: Queues::default(),
            events: VecDeque::new(),
            stats: Counters::default(),
            ready: ReadyList::default(),
            timers: TimerIndex::default(),
            load: Load::new(budget),
            held: ReadyList::default(),
            next_qpn: 0x11,
            next_id: 1,
            direct: direct::Direct::default(),
            groups: multicast::Groups::default(),
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

    fn ctx<'a>(&'a mut self, now: Instant, mem: &'a mut dyn MemoryAccess) -> (&'a mut QpMap, Bookkeeping<'a>, Ctx<'a>) {
        let Hca { config, qps, queues, events, stats, ready, timers, load, held, .. } = self;
        let (share, device_full) = (load.share, load.inflight >= load.budget);
        let ctx = Ctx { now, mem, queues, events, stats, config, ready, share, device_full, held: false, placed: None };
        (qps, Bookkeeping { timers, load, held }, ctx)
    }

    /// Run `f` on QP `qpn`, then update the timer index with whatever `f` armed or stopped.
    fn with_qp<R>(
        &mut self,
        qpn: Qpn,
        now: Instant,
        mem: &mut dyn MemoryAccess,
        f: impl FnOnce(&mut Qp, &mut Ctx<'_>) -> Result<R, VerbsError>,
    ) -> Result<R, VerbsError> {
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        let qp = qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?;
        let r = f(qp, &mut ctx);
        book.sync(qp);
        r
    }

    // ---- CQ / SRQ ----------------------------------------------------------------------------

    /// Create a CQ holding up to `depth` completions.
    pub fn create_cq(&mut self, depth: u32) -> CqId {
        let id = CqId(self.next_id);
        self.next_id += 1;
        self.queues.cqs.insert(
            id,
            Cq {
                entries: VecDeque::new(),
                receives: 0,
                with_data: 0,
                depth: depth.max(1) as usize,
                armed: None,
                users: 0,
            },
        );
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
        // A busy poll mostly finds the queue empty: skip setting up the drain.
        if n > 0 {
            let start = out.len();
            out.extend(q.entries.drain(..n));
            q.receives -= out[start..].iter().filter(|w| w.is_successful_receive()).count();
            q.with_data -= out[start..].iter().filter(|w| w.brings_data()).count();
        }
        Ok(n)
    }

    /// Whether an RC QP has send work requests not yet completed (sent and waiting for their
    /// ACK, or still to send).
    pub fn sends_pending(&self) -> bool {
        self.load.busy_qps > 0
    }

    /// Whether QP `qpn` has receive work requests posted (on its own queue, or on its SRQ).
    pub fn recvs_posted(&self, qpn: Qpn) -> bool {
        self.qps.get(&qpn).is_some_and(|qp| match qp.init.srq {
            Some(srq) => self.queues.srqs.get(&srq).is_some_and(|s| !s.wqes.is_empty()),
            None => !qp.rq.is_empty(),
        })
    }

    /// Whether CQ `cq` holds no completion (true for a CQ that does not exist).
    pub fn cq_is_empty(&self, cq: CqId) -> bool {
        self.queues.cqs.get(&cq).is_none_or(|q| q.entries.is_empty())
    }

    /// Whether CQ `cq` holds a completion that brought its poller data into its memory (a
    /// receive, a READ, an atomic: [`WorkCompletion::brings_data`]); false for a CQ that does not
    /// exist.
    pub fn cq_brings_data(&self, cq: CqId) -> bool {
        self.queues.cqs.get(&cq).is_some_and(|q| q.with_data > 0)
    }

    /// Whether CQ `cq` holds no completion at all, or one successful receive completion (besides
    /// any of sends): what a thread polling it in a request-response exchange finds when the
    /// peer's request arrived (its receive completion, or nothing when an RDMA WRITE only changed
    /// memory the thread watches), as against a stream's many receive completions. True for a CQ
    /// that does not exist.
    pub fn cq_awaits_one(&self, cq: CqId) -> bool {
        self.queues.cqs.get(&cq).is_none_or(|q| q.entries.is_empty() || q.receives == 1)
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
        while self.qps.contains_key(&qpn) || qpn.value() < 0x11 || qpn == Qpn::MULTICAST {
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
        self.groups.forget_qp(qpn);
        self.timers.remove(&qp);
        self.load.forget(&qp);
        self.held.remove(qpn);
        for cq in [qp.init.send_cq, qp.init.recv_cq] {
            if let Some(c) = self.queues.cqs.get_mut(&cq) {
                c.users -= 1;
            }
        }
        if let Some(s) = qp.init.srq.and_then(|s| self.queues.srqs.get_mut(&s)) {
            s.users -= 1;
        }
        self.ready.remove(qpn);
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
        let r = self.with_qp(qpn, now, mem, |qp, ctx| qp.modify(attr, ctx));
        // A QP reset or moved to ERR stops its timers: its entry goes now, not when it would fire.
        if let Some(qp) = self.qps.get_mut(&qpn) {
            self.timers.sync_exact(qp);
        }
        r
    }

    /// Query a QP.
    pub fn query_qp(&self, qpn: Qpn) -> Result<QpInfo, VerbsError> {
        self.qps.get(&qpn).map(|q| q.info()).ok_or(VerbsError::NoSuchObject)
    }

    /// The requester's smoothed round-trip time of QP `qpn`, from the ACKs of packets sent once
    /// (`None` before the first sample or for an unknown QP). It sets the retry probe interval.
    pub fn srtt(&self, qpn: Qpn) -> Option<core::time::Duration> {
        self.qps.get(&qpn).and_then(|q| q.sq.rtt.srtt())
    }

    /// The packets QP `qpn` sent in the last call were given the time `then`, earlier than `now`:
    /// what they started (the RTT sample, a retransmit timer they armed) starts at `now` instead.
    /// A driver may build and send a post's packet with the time of its application's last poll,
    /// a moment earlier, and read the clock only once the packet has left: off the path from the
    /// post to the packet. Timers armed before `then` are left alone.
    pub fn restamp(&mut self, qpn: Qpn, then: Instant, now: Instant) {
        if then >= now {
            return;
        }
        if let Some(qp) = self.qps.get_mut(&qpn) {
            qp.restamp(then, now);
            // A later deadline leaves an earlier index entry, which fires as a no-op and files
            // the QP again (see `TimerIndex`).
            self.timers.sync(qp);
        }
    }

    /// Post a send work request.
    pub fn post_send(
        &mut self,
        qpn: Qpn,
        wr: SendWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        if self.post_direct(qpn, &wr, now, mem) {
            return Ok(());
        }
        self.with_qp(qpn, now, mem, |qp, ctx| qp.post_send(wr, ctx))
    }

    /// [`Hca::post_send`], then, if `slot` gives a buffer for the GID the QP's packets go to (RC
    /// and UC), the QP's next packet built into it as by [`Hca::poll_transmit_qp`] (normally the
    /// request just posted), with the buffer: a driver that sends a post's first packet at once
    /// looks the QP up once for both. `None` when the request was executed directly, `slot` gave
    /// no buffer, or the QP had no packet to send.
    pub fn post_send_ahead<'b>(
        &mut self,
        qpn: Qpn,
        wr: SendWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
        slot: impl FnOnce([u8; 16]) -> Option<&'b mut [u8]>,
    ) -> Result<Option<(Transmit, &'b mut [u8])>, VerbsError> {
        if self.post_direct(qpn, &wr, now, mem) {
            return Ok(None);
        }
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        let qp = qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?;
        let posted = qp.post_send(wr, &mut ctx);
        book.sync(qp);
        posted?;
        if qp.init.qp_type == crate::attr::QpType::Ud {
            return Ok(None);
        }
        let Some(buf) = slot(qp.attr.av.dgid) else { return Ok(None) };
        // The post may have made the QP busy: the share and budget as the bookkeeping has them now.
        ctx.share = book.load.share;
        ctx.device_full = book.load.inflight >= book.load.budget;
        let t = qp.poll_transmit(buf, &mut ctx);
        book.sync(qp);
        Ok(t.map(|t| (t, buf)))
    }

    /// Post a list of send work requests to one QP (a chained `ibv_post_send`): the QP is looked up
    /// and the HCA's bookkeeping brought up to date once for the list. Stops at the first refused
    /// request and returns its error; the requests before it stay posted.
    pub fn post_send_list(
        &mut self,
        qpn: Qpn,
        wrs: impl IntoIterator<Item = SendWr>,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        if !self.direct.is_on() {
            return self.with_qp(qpn, now, mem, |qp, ctx| wrs.into_iter().try_for_each(|wr| qp.post_send(wr, ctx)));
        }
        // Requests may be executed directly one by one (hca/direct.rs), each once those before it
        // are done.
        wrs.into_iter().try_for_each(|wr| self.post_send(qpn, wr, now, mem))
    }

    /// Asked by the I/O layer right after a post to `qpn`: whether what it produced may wait for
    /// the next progress instead of being flushed now (`Config::cork_max_queued`; false for an
    /// unknown QP). True arms the QP's cork timer, so [`Hca::poll_timeout`] brings the flush by
    /// [`Config::CORK_WAIT`] at the latest.
    pub fn cork(&mut self, qpn: Qpn, now: Instant) -> bool {
        if self.config.cork_max_queued == 0 {
            return false;
        }
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        let cork = qp.cork(&self.config, now);
        self.timers.sync(qp);
        cork
    }

    /// Post a receive work request. Posting arms and reads no timer: `now` may be a recent time
    /// the driver already has rather than a fresh clock reading.
    pub fn post_recv(
        &mut self,
        qpn: Qpn,
        wr: RecvWr,
        now: Instant,
        mem: &mut dyn MemoryAccess,
    ) -> Result<(), VerbsError> {
        let qp = self.qps.get_mut(&qpn).ok_or(VerbsError::NoSuchObject)?;
        // A receive changes nothing the bookkeeping follows (timers, the send queue): no sync. Only
        // one posted in the error state completes at once (flushed).
        if let Some((cq, wc)) = qp.post_recv(wr)? {
            let (_, _, mut ctx) = self.ctx(now, mem);
            ctx.push_recv_wc(cq, wc);
        }
        Ok(())
    }

    // ---- packets and time --------------------------------------------------------------------

    /// A received IB transport packet (BTH through ICRC; the ICRC was checked by the I/O layer).
    /// Malformed packets and packets for unknown QPs are counted and dropped.
    pub fn handle_packet(&mut self, now: Instant, bytes: &[u8], rx: &RxInfo, mem: &mut dyn MemoryAccess) {
        match IbPacket::new_checked(bytes) {
            Ok(p) => self.handle_parsed(now, &p, rx, mem),
            Err(_) => self.stats.count_malformed(),
        }
    }

    /// [`Hca::handle_packet`] for a packet already checked with [`IbPacket::new_checked`] (the I/O
    /// layer parses it to verify the ICRC; parsing it again costs ~100 instructions per packet).
    pub fn handle_parsed(&mut self, now: Instant, pkt: &IbPacket<&[u8]>, rx: &RxInfo, mem: &mut dyn MemoryAccess) {
        self.stats.rcvd_pkts += 1;
        let qpn = pkt.bth().dest_qp();
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        match qps.get_mut(&qpn) {
            Some(qp) => {
                qp.handle_packet(pkt, &rx.grh, &mut ctx);
                book.sync(qp);
            }
            None => ctx.stats.drop_unknown_qp += 1,
        }
    }

    /// Where the payload of QP `qpn`'s next in-sequence request packet goes, when that is known
    /// before the packet arrives: an RC RDMA WRITE whose FIRST (or a MIDDLE) packet was accepted.
    /// A pure query; the I/O layer may receive the next packet's payload straight into that range.
    pub fn rx_placement(&self, qpn: Qpn) -> Option<RxPlacement> {
        self.qps.get(&qpn)?.rx_placement()
    }

    /// A request packet whose payload the I/O layer already put where `expect` (from
    /// [`Hca::rx_placement`]) said: `pkt` holds the headers, pad and ICRC but no payload, and
    /// `len` payload bytes are at `expect.addr`. Handled as [`Hca::handle_parsed`] would handle the
    /// whole packet, without the copy. Returns `false`, having done nothing, unless `expect` is
    /// still the QP's placement and `pkt` is its next in-sequence packet; the caller then hands
    /// the whole packet to [`Hca::handle_parsed`].
    pub fn handle_placed(
        &mut self,
        now: Instant,
        pkt: &IbPacket<&[u8]>,
        expect: &RxPlacement,
        len: usize,
        mem: &mut dyn MemoryAccess,
    ) -> bool {
        if !expect.is_next(pkt)
            || len > expect.remaining as usize
            || !pkt.payload().is_empty()
            || self.rx_placement(expect.qpn).as_ref() != Some(expect)
        {
            return false;
        }
        self.stats.rcvd_pkts += 1;
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        let Some(qp) = qps.get_mut(&expect.qpn) else { return false };
        ctx.placed = Some(len);
        qp.handle_packet(pkt, &[0; 40], &mut ctx);
        book.sync(qp);
        true
    }

    /// Fire expired timers: each QP with a deadline at or before `now` once, in deadline order.
    pub fn handle_timeout(&mut self, now: Instant, mem: &mut dyn MemoryAccess) {
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        let mut due = std::mem::take(&mut book.timers.due);
        due.clear();
        due.extend(book.timers.by_time.iter().take_while(|(at, _)| *at <= now).map(|(_, q)| *q));
        for qpn in &due {
            if let Some(qp) = qps.get_mut(qpn) {
                qp.handle_timeout(&mut ctx);
                // The entry was due: it is filed again under the QP's real deadline (a stale one
                // fired nothing).
                book.timers.sync_exact(qp);
                book.sync(qp);
            }
        }
        book.timers.due = due;
    }

    /// The earliest timer deadline, or a moment before it: a timer stopped (by an ACK) keeps its
    /// place until then, and [`Hca::handle_timeout`] at that moment fires nothing (see
    /// `TimerIndex`). An engine with no timer armed since its QPs changed state reports `None`.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.by_time.first().map(|(at, _)| *at)
    }

    /// A READ response is queued (its data is read from memory as its packets are built).
    pub fn owes_read_response(&self) -> bool {
        // Asked on every busy poll that completes a receive: a count, kept by the bookkeeping.
        self.load.owing_reads > 0
    }

    /// Whether [`Hca::poll_transmit`] may have a packet: false means it would return `None` (a
    /// driver polling in a tight loop skips setting up its transmit batch).
    pub fn has_transmit(&self) -> bool {
        // QPs held back by the device budget take their turn once it has room.
        !self.ready.is_empty() || (!self.held.is_empty() && self.load.inflight < self.load.budget)
    }

    /// What the READ responses queued by the first `qps` QPs that may send now (in turn order)
    /// still have to read from memory: `(rkey, address, bytes left)` per response, in the order
    /// each QP sends them. A driver whose memory is slow to reach per access reads it ahead in one
    /// go before [`Hca::poll_transmit`] builds the packets (the READs have arrived, so any moment
    /// from now on is theirs to read).
    pub fn owed_reads(&self, qps: usize) -> impl Iterator<Item = (u32, u64, u32)> + '_ {
        let queued = self.ready.order.iter().chain(self.held.order.iter()).take(qps);
        queued.filter_map(|q| self.qps.get(q)).flat_map(|qp| qp.resp.owed_reads())
    }

    /// Write the next packet to send into `buf` (at least MTU + 64 bytes long).
    pub fn poll_transmit(&mut self, now: Instant, mem: &mut dyn MemoryAccess, buf: &mut [u8]) -> Option<Transmit> {
        let burst = self.config.burst;
        // Room in the device budget again: QPs held back take their turn, oldest first, as many as
        // there are packets of room (each may fill its window; the budget check stops the rest).
        let mut room = self.load.budget.saturating_sub(self.load.inflight);
        while room > 0 {
            let Some(q) = self.held.pop_front() else { break };
            self.ready.push(q);
            room -= 1;
        }
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        while let Some(qpn) = ctx.ready.front() {
            let Some(qp) = qps.get_mut(&qpn) else {
                ctx.ready.pop_front();
                continue;
            };
            ctx.held = false;
            let t = qp.poll_transmit(buf, &mut ctx);
            book.sync(qp);
            if ctx.held {
                book.held.push(qpn);
            }
            match t {
                Some(t) => {
                    if qp.nothing_to_transmit() {
                        // Its next call would find nothing and leave the list: it leaves now, and
                        // the flush that sent this packet makes no call for nothing.
                        qp.burst = 0;
                        ctx.ready.pop_front();
                    } else {
                        qp.burst += 1;
                        if qp.burst >= burst {
                            qp.burst = 0;
                            // The QP is at the front (a QP is queued once): its turn is over.
                            ctx.ready.rotate();
                        }
                    }
                    return Some(t);
                }
                None => {
                    qp.burst = 0;
                    ctx.ready.pop_front();
                }
            }
        }
        None
    }

    /// [`Hca::poll_transmit`] for QP `qpn` alone, out of its turn: its next packet, if it has one
    /// it may send now (a request goes before a plain ACK it owes, as in its turn). A driver that
    /// has just posted to `qpn` sends the request at once, before working through the rest of the
    /// transmit list, whose order this leaves as it was. `qpn` stays listed, and a later
    /// [`Hca::poll_transmit`] that finds it has nothing left takes it off.
    pub fn poll_transmit_qp(
        &mut self,
        qpn: Qpn,
        now: Instant,
        mem: &mut dyn MemoryAccess,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        let qp = qps.get_mut(&qpn)?;
        let t = qp.poll_transmit(buf, &mut ctx);
        book.sync(qp);
        // A QP the device budget holds back (`ctx.held`) built no request; its turn in the list
        // files it with the held QPs.
        t
    }

    /// The GID of the port a connected (RC or UC) QP `qpn` sends to: where its packets go.
    pub fn peer_gid(&self, qpn: Qpn) -> Option<[u8; 16]> {
        let qp = self.qps.get(&qpn)?;
        (qp.init.qp_type != crate::attr::QpType::Ud).then_some(qp.attr.av.dgid)
    }

    /// The next asynchronous event.
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each QP queued once, in the order first queued, whether the list is scanned or keeps a set,
    /// across the switch both ways.
    #[test]
    fn ready_list_queues_each_qp_once_in_order() {
        let mut r = ReadyList::default();
        let q = Qpn::new;
        let taken = |r: &mut ReadyList| std::iter::from_fn(|| r.pop_front()).map(|q| q.value()).collect::<Vec<_>>();
        for n in [3, 5, 3, 1, 5] {
            r.push(q(n));
        }
        assert_eq!(taken(&mut r), [3, 5, 1]);
        // Past SCAN_MAX: a set, with duplicates of early and late QPs, one removed, one rotated.
        for n in (1..=20).chain([2, 20, 7, SCAN_MAX as u32, SCAN_MAX as u32 + 1]) {
            r.push(q(n));
        }
        assert!(!r.members.is_empty());
        r.remove(q(4));
        r.remove(q(99));
        r.rotate();
        r.push(q(1));
        let want: Vec<u32> = (2..=20).filter(|&n| n != 4).chain([1]).collect();
        assert_eq!(taken(&mut r), want);
        assert!(r.members.is_empty() && r.is_empty());
        // Scanned again once empty.
        r.push(q(7));
        r.push(q(7));
        r.remove(q(7));
        r.push(q(9));
        assert_eq!(taken(&mut r), [9]);
    }
}
