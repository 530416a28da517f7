//! The requester: turns send WQEs into request packets.
//!
//! It segments each message by the path MTU, assigns PSNs (a WQE keeps its `first_psn` for life, so
//! a retransmission regenerates exactly the same packets: nothing sent is ever stored), chooses
//! opcodes from the table's base codes, asks for ACKs on the last packet of a message, every
//! `ack_req_every` packets and when the window fills, and respects `max_rd_atomic`, fences and the
//! go-back-N window. UC and UD WQEs complete as soon as their last packet is out.

use std::collections::VecDeque;

use super::rtt::RttEstimator;
use super::{send_wc_opcode, Qp, QpAttrs, Timer};
use crate::attr::{QpState, QpType};
use crate::config::Config;
use crate::cq::{WcOpcode, WcStatus};
use crate::hca::{Ctx, DeferredPayload, Transmit};
use crate::memory::{self, Access};
use crate::wr::{Payload, SendFlags, SendOp, SendWr};
use softrdma_wire::aeth::rnr_timer_micros;
use softrdma_wire::bth::DEFAULT_PKEY;
use softrdma_wire::opcode::base;
use softrdma_wire::{AtomicEthRepr, BthRepr, DataRequest, DethRepr, IbRepr, Opcode, Psn, RequestTemplate, RethRepr};

/// A send WQE and its progress.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr: SendWr,
    pub signaled: bool,
    /// Message length in bytes.
    pub len: u32,
    /// PSN of the first packet (valid once `started`).
    pub first_psn: Psn,
    /// PSNs the message consumes (read: one per response packet).
    pub npkts: u32,
    pub started: bool,
    /// A local error found when starting: completes with this status when it reaches the head.
    pub error: Option<WcStatus>,
    /// The next read response must be FIRST or ONLY (a read request was just (re)sent).
    pub read_expect_first: bool,
}

impl SendWqe {
    pub fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npkts.saturating_sub(1))
    }

    /// `psn` falls inside this WQE's PSN range.
    pub fn contains(&self, psn: Psn) -> bool {
        self.started && psn.diff(self.first_psn) >= 0 && psn.diff(self.last_psn()) <= 0
    }
}

/// Send queue with requester and completer state.
#[derive(Debug)]
pub(crate) struct SendQueue {
    pub wqes: VecDeque<SendWqe>,
    /// Index of the WQE the requester works on.
    pub cur: usize,
    /// Next packet index within `wqes[cur]`.
    pub cur_pkt: u32,
    /// PSN of the next packet to transmit.
    pub send_psn: Psn,
    /// PSN the next new WQE will start at.
    pub npsn: Psn,
    /// Oldest PSN not yet acknowledged.
    pub una: Psn,
    /// Highest PSN ever sent, plus one (to count retransmissions).
    pub sent_hw: Psn,
    /// Reads and atomics started and not completed.
    pub rd_atomic_inflight: u32,
    pub retry_left: u8,
    pub rnr_left: u8,
    /// Packets since the last AckReq.
    pub noack: u32,
    /// Transmission paused by an RNR NAK until the RNR timer fires.
    pub rnr_paused: bool,
    /// A retry from this PSN is under way: further signs of the same loss are ignored until
    /// progress or a timeout (as rxe's `started_retry`), so one loss costs one retransmission round.
    pub retrying_from: Option<Psn>,
    /// Adaptive window in packets (`Config::adaptive_window`); `u32::MAX` while no loss was seen.
    pub cwnd: u32,
    /// The retransmit timer is a short probe after a retry (see the completer's `start_retry`).
    pub probe_armed: bool,
    /// Probes that fired in the current retransmission round without progress.
    pub probes: u32,
    /// Packets acknowledged towards the next one-packet growth of the adaptive window.
    pub grow_acc: u32,
    /// Round-trip time estimate (sets the probe interval).
    pub rtt: RttEstimator,
}

impl SendQueue {
    pub fn new() -> SendQueue {
        SendQueue {
            wqes: VecDeque::new(),
            cur: 0,
            cur_pkt: 0,
            send_psn: Psn::new(0),
            npsn: Psn::new(0),
            una: Psn::new(0),
            sent_hw: Psn::new(0),
            rd_atomic_inflight: 0,
            retry_left: 7,
            rnr_left: 7,
            noack: 0,
            rnr_paused: false,
            retrying_from: None,
            cwnd: u32::MAX,
            probe_armed: false,
            probes: 0,
            grow_acc: 0,
            rtt: RttEstimator::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.wqes.len()
    }

    /// The window in packets: the configured one, or less after loss with an adaptive window.
    pub fn window(&self, config: &crate::config::Config) -> u32 {
        config.max_inflight_packets.min(self.cwnd)
    }

    /// A retransmission round started: halve the adaptive window.
    pub fn on_loss(&mut self, config: &crate::config::Config) {
        if config.adaptive_window {
            // A loss at the floor already: the path wants less than MIN_WINDOW in flight at this loss
            // rate, so the floor gives way (go-back-N resends about a window per loss).
            let w = self.window(config);
            let floor = if w <= Config::MIN_WINDOW { Config::MIN_WINDOW_REPEATED } else { Config::MIN_WINDOW };
            self.cwnd = (w / 2).max(floor);
            self.grow_acc = 0;
        }
    }

    /// `k` packets were newly acknowledged: grow the adaptive window back.
    pub fn on_acked(&mut self, k: u32, config: &crate::config::Config) {
        if self.cwnd != u32::MAX {
            // One packet per window acknowledged (TCP's congestion avoidance). Growing by a quarter
            // of every acknowledged packet, as before, settled at 1 % loss around 50 packets, and
            // every loss resent about 30 of them; one per window settles near the floor, where a
            // loss resends about 15.
            self.grow_acc = self.grow_acc.saturating_add(k);
            while self.grow_acc >= self.cwnd {
                self.grow_acc -= self.cwnd;
                self.cwnd += 1;
            }
            if self.cwnd >= config.max_inflight_packets {
                self.cwnd = u32::MAX;
            }
        }
    }

    pub fn reset_psn(&mut self, psn: Psn) {
        self.send_psn = psn;
        self.npsn = psn;
        self.una = psn;
        self.sent_hw = psn;
    }

    pub fn reset_retries(&mut self, a: &QpAttrs) {
        self.retry_left = a.retry_cnt;
        self.rnr_left = a.rnr_retry;
    }

    pub fn push(&mut self, wr: SendWr, signaled: bool) {
        let len = wr.payload.byte_len();
        self.wqes.push_back(SendWqe {
            wr,
            signaled,
            len: u32::try_from(len).unwrap_or(u32::MAX),
            first_psn: Psn::new(0),
            npkts: 0,
            started: false,
            error: if len > u64::from(u32::MAX) { Some(WcStatus::LocLenErr) } else { None },
            read_expect_first: false,
        });
    }

    /// Remove every WQE, returning `(wr_id, opcode)` in order, for flushing.
    /// Empty the queue, oldest first, without collecting into a new vector (flushing a deep
    /// queue allocates nothing).
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, WcOpcode)> + '_ {
        self.cur = 0;
        self.cur_pkt = 0;
        self.rd_atomic_inflight = 0;
        self.una = self.send_psn;
        self.wqes.drain(..).map(|w| (w.wr.wr_id, send_wc_opcode(&w.wr.op)))
    }

    /// Remove the head WQE after its completion.
    pub fn pop_head(&mut self) -> Option<SendWqe> {
        let w = self.wqes.pop_front()?;
        if self.cur > 0 {
            self.cur -= 1;
        } else {
            self.cur_pkt = 0;
        }
        if w.started && w.wr.op.is_read_or_atomic() {
            self.rd_atomic_inflight = self.rd_atomic_inflight.saturating_sub(1);
        }
        Some(w)
    }

    /// Packets sent and not yet acknowledged.
    pub fn unacked(&self) -> bool {
        self.una != self.sent_hw
    }

    pub fn nothing_in_flight(&self) -> bool {
        self.wqes.iter().all(|w| !w.started)
    }

    /// Go back to `psn`: the requester will regenerate from there.
    pub fn rewind(&mut self, psn: Psn) {
        let Some(i) = self.wqes.iter().position(|w| w.started && w.last_psn().diff(psn) >= 0) else {
            return;
        };
        let w = &mut self.wqes[i];
        let k = psn.diff(w.first_psn).max(0) as u32;
        self.cur = i;
        self.cur_pkt = k;
        self.send_psn = w.first_psn.add(k);
        if w.wr.op.is_read_or_atomic() {
            w.read_expect_first = true;
        }
        self.noack = 0;
        self.rtt.on_rewind();
    }
}

/// A request on its way to direct execution (see [`Qp::direct_request`]).
#[derive(Debug)]
pub(crate) enum Direct<'b> {
    /// A SEND's or WRITE's payload.
    Out(&'b [u8]),
    /// Where a READ's data goes, filled by the responder.
    In(&'b mut [u8]),
    /// An atomic; the original value, once the responder executed it.
    Atomic(Option<u64>),
}

impl Direct<'_> {
    /// Bytes moved: the payload, the READ's data, an atomic's 8.
    pub fn len(&self) -> usize {
        match self {
            Direct::Out(p) => p.len(),
            Direct::In(d) => d.len(),
            Direct::Atomic(_) => 8,
        }
    }
}

/// Number of PSNs a message of `len` bytes takes at `mtu`.
fn packets(len: u32, mtu: usize) -> u32 {
    (len as usize).div_ceil(mtu).max(1) as u32
}

impl Qp {
    /// The local ACK timeout: 4.096 µs × 2^timeout (none for timeout 0).
    pub(super) fn ack_timeout(&self) -> Option<core::time::Duration> {
        match self.attr.timeout {
            0 => None,
            t => Some(core::time::Duration::from_nanos(4096u64 << t)),
        }
    }

    /// RNR timer duration for an encoded value.
    pub(super) fn rnr_delay(code: u8) -> core::time::Duration {
        core::time::Duration::from_micros(u64::from(rnr_timer_micros(code)))
    }

    /// Build the next request packet, if the requester may send one.
    pub(super) fn poll_request(&mut self, buf: &mut [u8], ctx: &mut Ctx<'_>) -> Option<Transmit> {
        if !self.state.can_send() || self.sq.rnr_paused {
            return None;
        }
        let mtu = self.attr.mtu.bytes();
        let idx = self.sq.cur;
        let w = self.sq.wqes.get(idx)?;
        // The send PSN before this call started the WQE, when the start left its memory check to
        // the gather.
        let mut unchecked = None;
        if !w.started {
            if self.state == QpState::Sqd || w.error.is_some() {
                return None;
            }
            if w.wr.op.is_read_or_atomic() && self.sq.rd_atomic_inflight >= u32::from(self.attr.max_rd_atomic) {
                if self.attr.max_rd_atomic == 0 {
                    self.sq.wqes[idx].error = Some(WcStatus::LocQpOpErr);
                    self.complete_send_head(ctx);
                }
                return None;
            }
            if w.wr.flags.contains(SendFlags::FENCE) && self.sq.rd_atomic_inflight > 0 {
                return None;
            }
            // A one-packet message from one SGE is read whole by its gather in this same call, and
            // that read checks the lkey, PD, rights and bounds as the start check would: the region
            // is looked up once. Unless the packet is built in this call, the start is undone (below).
            let by_gather = Self::gather_checks(w, mtu, ctx);
            if let Some(status) = self.start_check(w, !by_gather, ctx) {
                self.sq.wqes[idx].error = Some(status);
                self.complete_send_head(ctx);
                return None;
            }
            if by_gather {
                unchecked = Some(self.sq.send_psn);
            }
            let npsn = self.sq.npsn;
            let w = &mut self.sq.wqes[idx];
            w.started = true;
            w.first_psn = npsn;
            w.npkts = match (self.init.qp_type, &w.wr.op) {
                (QpType::Ud, _) => 1,
                (_, op) if op.is_atomic() => 1,
                _ => packets(w.len, mtu),
            };
            w.read_expect_first = true;
            self.sq.npsn = npsn.add(w.npkts);
            self.sq.cur_pkt = 0;
            self.sq.send_psn = npsn;
            if w.wr.op.is_read_or_atomic() {
                self.sq.rd_atomic_inflight += 1;
            }
        }
        // The PSN follows from the position: a WQE keeps its PSNs for life.
        let w = &self.sq.wqes[idx];
        self.sq.send_psn = w.first_psn.add(self.sq.cur_pkt);
        // Window: keep at most max_inflight_packets PSNs outstanding (a lone large read may exceed).
        let rc = self.init.qp_type == QpType::Rc;
        let window = self.sq.window(ctx.config).min(ctx.share);
        let inflight = self.sq.send_psn.diff(self.sq.una).max(0) as u32;
        let window_closed = rc && inflight >= window;
        // A new packet while the device's budget is spent waits for room (the HCA requeues us).
        let device_closed = rc && ctx.device_full && !self.sq.send_psn.before(self.sq.sent_hw);
        let mut force_ack = false;
        if window_closed || device_closed {
            // Never stop with packets in flight that no ACK was asked for: when the window shrank
            // under them (a smaller share) or the device filled, nothing would answer them before the
            // local ACK timeout. One more packet, asking for an ACK, closes the tail.
            if self.sq.noack == 0 || inflight == 0 {
                ctx.held = !window_closed;
                if let Some(prev) = unchecked {
                    self.unstart(idx, prev);
                }
                return None;
            }
            force_ack = true;
        }
        let t = self.build_request(buf, idx, force_ack, unchecked, ctx);
        if let (None, Some(prev)) = (&t, unchecked) {
            // Not built for another reason than its memory (that undid the start and failed the WQE).
            if self.sq.wqes.get(idx).is_some_and(|w| w.started && w.error.is_none()) {
                self.unstart(idx, prev);
            }
        }
        t
    }

    /// Whether the gather of WQE `w`'s only packet reads every byte its SGL names (one SGE, not
    /// empty, one packet, copied rather than deferred), so that its local checks are the start
    /// check's memory check.
    fn gather_checks(w: &SendWqe, mtu: usize, ctx: &Ctx<'_>) -> bool {
        let Payload::Sgl(sgl) = &w.wr.payload else { return false };
        let defer_min = ctx.config.defer_payload_min;
        sgl.len() == 1
            && sgl[0].length == w.len
            && w.len > 0
            && w.len as usize <= mtu
            && !w.wr.op.is_read_or_atomic()
            && (defer_min == 0 || (w.len as usize) < defer_min)
    }

    /// Undo the start of WQE `idx` in this call (its PSNs go back to the pool; `send_psn` was the
    /// send PSN before): as if the start had not happened.
    fn unstart(&mut self, idx: usize, send_psn: Psn) {
        let w = &mut self.sq.wqes[idx];
        w.started = false;
        w.read_expect_first = false;
        self.sq.npsn = w.first_psn;
        self.sq.send_psn = send_psn;
    }

    /// Local checks when a WQE starts; a failure is the completion status. `memory`: check the
    /// SGL's keys and bounds too.
    fn start_check(&self, w: &SendWqe, memory: bool, ctx: &Ctx<'_>) -> Option<WcStatus> {
        if u64::from(w.len) > ctx.config.max_msg_size {
            return Some(WcStatus::LocLenErr);
        }
        if self.init.qp_type == QpType::Ud && w.len as usize > self.attr.mtu.bytes() {
            return Some(WcStatus::LocLenErr);
        }
        if w.wr.op.is_atomic() && w.len != 8 {
            return Some(WcStatus::LocLenErr);
        }
        if let (Payload::Sgl(sgl), true) = (&w.wr.payload, memory) {
            let need = if w.wr.op.is_read_or_atomic() { Access::LOCAL_WRITE } else { Access::NONE };
            if memory::check_sgl(ctx.mem, self.init.pd, sgl, need).is_err() {
                return Some(WcStatus::LocProtErr);
            }
        }
        None
    }

    /// Build packet `cur_pkt` of WQE `idx`. `unchecked`: the WQE was started in this call with its
    /// memory check left to this gather, and the send PSN before (see `poll_request`).
    fn build_request(
        &mut self,
        buf: &mut [u8],
        idx: usize,
        force_ack: bool,
        unchecked: Option<Psn>,
        ctx: &mut Ctx<'_>,
    ) -> Option<Transmit> {
        let mtu = self.attr.mtu.bytes();
        let qp_type = self.init.qp_type;
        let k = self.sq.cur_pkt;
        let psn = self.sq.send_psn;
        let w = &self.sq.wqes[idx];
        let n = w.npkts;
        let first = k == 0;
        let last = k + 1 == n;
        let offset = k as usize * mtu;
        let wire_type = match qp_type {
            QpType::Rc => softrdma_wire::QpType::Rc,
            QpType::Uc => softrdma_wire::QpType::Uc,
            QpType::Ud => softrdma_wire::QpType::Ud,
        };
        let pick = |only: u8, fst: u8, mid: u8, lst: u8| match (first, last) {
            (true, true) => only,
            (true, false) => fst,
            (false, true) => lst,
            (false, false) => mid,
        };
        let (code, payload_len, is_read_req) = match w.wr.op {
            SendOp::Send => (pick(base::SEND_ONLY, base::SEND_FIRST, base::SEND_MIDDLE, base::SEND_LAST), true, false),
            SendOp::SendWithImm(_) => {
                (pick(base::SEND_ONLY_IMM, base::SEND_FIRST, base::SEND_MIDDLE, base::SEND_LAST_IMM), true, false)
            }
            SendOp::SendWithInv(_) => {
                (pick(base::SEND_ONLY_INV, base::SEND_FIRST, base::SEND_MIDDLE, base::SEND_LAST_INV), true, false)
            }
            SendOp::Write { .. } => {
                (pick(base::WRITE_ONLY, base::WRITE_FIRST, base::WRITE_MIDDLE, base::WRITE_LAST), true, false)
            }
            SendOp::WriteWithImm { .. } => {
                (pick(base::WRITE_ONLY_IMM, base::WRITE_FIRST, base::WRITE_MIDDLE, base::WRITE_LAST_IMM), true, false)
            }
            SendOp::Read { .. } => (base::READ_REQUEST, false, true),
            SendOp::CompareSwap { .. } => (base::COMPARE_SWAP, false, false),
            SendOp::FetchAdd { .. } => (base::FETCH_ADD, false, false),
        };
        let opcode = Opcode::of(wire_type, code)?;
        let plen = if payload_len { (w.len as usize - offset.min(w.len as usize)).min(mtu) } else { 0 };
        let message_end = last || is_read_req || w.wr.op.is_atomic();
        let solicited = message_end
            && w.wr.flags.contains(SendFlags::SOLICITED)
            && matches!(
                w.wr.op,
                SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) | SendOp::WriteWithImm { .. }
            );
        let window = self.sq.window(ctx.config).min(ctx.share);
        let window_full = self.sq.send_psn.add(1).diff(self.sq.una).max(0) as u32 >= window;
        // With an adaptive window, ask for an ACK at least twice per window: a lost last packet of a
        // full window then costs a NAK round trip (the ACK of the middle opens the window, the
        // packets that follow show the gap) instead of the local ACK timeout.
        let every = if ctx.config.adaptive_window {
            ctx.config.ack_req_every.min(window / 2).max(1)
        } else {
            ctx.config.ack_req_every
        };
        let ack_req = qp_type == QpType::Rc && (message_end || self.sq.noack > every || window_full || force_ack);
        let dest_qp = match (&w.wr.ud, qp_type) {
            (Some(ud), QpType::Ud) => ud.remote_qpn,
            _ => self.attr.dest_qpn,
        };
        let (mut imm, mut ieth, mut reth, mut atomic_eth) = (None, None, None, None);
        match w.wr.op {
            SendOp::SendWithImm(v) | SendOp::WriteWithImm { imm: v, .. } if last => imm = Some(v),
            SendOp::SendWithInv(rkey) if last => ieth = Some(rkey),
            _ => {}
        }
        match w.wr.op {
            SendOp::Write { remote_addr, rkey } | SendOp::WriteWithImm { remote_addr, rkey, .. } if first => {
                reth = Some(RethRepr { va: remote_addr, rkey, dma_len: w.len });
            }
            SendOp::Read { remote_addr, rkey } => {
                reth = Some(RethRepr {
                    va: remote_addr.wrapping_add(offset as u64),
                    rkey,
                    dma_len: w.len.saturating_sub(offset as u32),
                });
            }
            SendOp::CompareSwap { remote_addr, rkey, compare, swap } => {
                atomic_eth = Some(AtomicEthRepr { va: remote_addr, rkey, swap_add: swap, compare });
            }
            SendOp::FetchAdd { remote_addr, rkey, add } => {
                atomic_eth = Some(AtomicEthRepr { va: remote_addr, rkey, swap_add: add, compare: 0 });
            }
            _ => {}
        }
        let deth = match (&w.wr.ud, qp_type) {
            (Some(ud), QpType::Ud) => {
                let qkey = if ud.remote_qkey & 0x8000_0000 != 0 { self.attr.qkey } else { ud.remote_qkey };
                Some(DethRepr { qkey, src_qp: self.qpn })
            }
            _ => None,
        };
        // SEND and WRITE packets (the message rate path) are patched from the QP's template; reads
        // and atomics go through the generic repr. Both write the same bytes (wire's tests).
        let (len, range) = if payload_len {
            let r = DataRequest { opcode, solicited, ack_req, psn, deth, reth, imm: imm.or(ieth), payload_len: plen };
            let (hdr, len) = RequestTemplate::new(DEFAULT_PKEY, dest_qp).emit(buf, &r).ok()?;
            (len, hdr..hdr + plen)
        } else {
            let mut repr = IbRepr::new(BthRepr { solicited, ack_req, ..BthRepr::new(opcode, dest_qp, psn) });
            (repr.reth, repr.atomic_eth, repr.deth) = (reth, atomic_eth, deth);
            (repr.emit(buf).ok()?, repr.payload_range())
        };
        let mut deferred = None;
        let defer_min = ctx.config.defer_payload_min;
        let gathered = match &w.wr.payload {
            Payload::Inline(d) => {
                buf[range].copy_from_slice(&d[offset..offset + plen]);
                Ok(())
            }
            Payload::Sgl(sgl) if defer_min > 0 && plen >= defer_min => {
                let mut pieces = [crate::wr::Sge::EMPTY; DeferredPayload::MAX_PIECES];
                match memory::pieces(ctx.mem, self.init.pd, sgl, offset as u64, plen, &mut pieces) {
                    Ok(Some(n)) => {
                        deferred = Some(DeferredPayload { at: range.start, len: plen, pd: self.init.pd, pieces, n });
                        Ok(())
                    }
                    Ok(None) => memory::gather(ctx.mem, self.init.pd, sgl, offset as u64, &mut buf[range]),
                    Err(e) => Err(e),
                }
            }
            Payload::Sgl(sgl) => memory::gather(ctx.mem, self.init.pd, sgl, offset as u64, &mut buf[range]),
        };
        if gathered.is_err() {
            // The region went away after the start check (or this was the start's check): a local
            // protection error, of a WQE that never started in the latter case.
            if let Some(prev) = unchecked {
                self.unstart(idx, prev);
            }
            self.sq.wqes[idx].error = Some(WcStatus::LocProtErr);
            self.complete_send_head(ctx);
            return None;
        }
        let av = match (&w.wr.ud, qp_type) {
            (Some(ud), QpType::Ud) => ud.av,
            _ => self.attr.av,
        };

        // Advance.
        if self.sq.send_psn.before(self.sq.sent_hw) {
            ctx.stats.retransmits += 1;
        } else if ack_req {
            self.sq.rtt.on_send(psn, ctx.now);
        }
        let consumed = if is_read_req { n - k } else { 1 };
        self.sq.send_psn = psn.add(consumed);
        if self.sq.send_psn.after(self.sq.sent_hw) {
            self.sq.sent_hw = self.sq.send_psn;
        }
        self.sq.noack = if ack_req { 0 } else { self.sq.noack + 1 };
        if is_read_req || w.wr.op.is_atomic() {
            self.sq.wqes[idx].read_expect_first = true;
        }
        if is_read_req || last {
            self.sq.cur += 1;
            self.sq.cur_pkt = 0;
        } else {
            self.sq.cur_pkt += 1;
        }
        ctx.stats.sent_pkts += 1;
        ctx.stats.sent_bytes += plen as u64;
        match qp_type {
            QpType::Rc => {
                if self.timer(Timer::Retransmit).is_none() {
                    let at = self.ack_timeout().map(|d| ctx.now + d);
                    self.set_timer(Timer::Retransmit, at);
                }
            }
            // Unreliable: done when the last packet is out.
            QpType::Uc | QpType::Ud => {
                self.sq.una = self.sq.send_psn;
                if last {
                    self.complete_send_head(ctx);
                }
            }
        }
        Some(Transmit { len, av, src_qpn: self.qpn, dest_qpn: dest_qp, deferred })
    }

    /// What `wr` carries to the responder when this QP may have it executed directly by a QP of
    /// this HCA (see `hca/direct.rs`) instead of sending it: an RC QP in RTS with nothing queued or
    /// unacknowledged, and `wr` a valid one-packet SEND or RDMA WRITE (with or without immediate;
    /// its payload gathered into `buf`), one-packet RDMA READ (into `buf`) or atomic, with SGEs it
    /// may read, or write for a READ or atomic. `None`: the request takes the usual path, which
    /// also reports what is wrong with it.
    pub(crate) fn direct_request<'b>(&self, wr: &SendWr, ctx: &Ctx<'_>, buf: &'b mut [u8]) -> Option<Direct<'b>> {
        let sq = &self.sq;
        if self.init.qp_type != QpType::Rc
            || self.state != QpState::Rts
            || !self.resp.idle()
            || !sq.wqes.is_empty()
            || sq.rnr_paused
            || sq.una != sq.npsn
            || sq.send_psn != sq.npsn
            || self.init.cap.max_send_wr == 0
            || matches!(wr.op, SendOp::SendWithInv(_))
            || (wr.op.is_read_or_atomic() && self.attr.max_rd_atomic == 0)
            || self.validate_send(wr).is_err()
        {
            return None;
        }
        // One packet, and within the largest message (as the start check has it).
        let mtu =
            self.attr.mtu.bytes().min(buf.len()).min(usize::try_from(ctx.config.max_msg_size).unwrap_or(usize::MAX));
        match &wr.payload {
            Payload::Inline(d) if d.len() <= mtu => {
                buf[..d.len()].copy_from_slice(d);
                Some(Direct::Out(&buf[..d.len()]))
            }
            Payload::Sgl(sgl) if memory::sgl_len(sgl) <= mtu as u64 => {
                let len = memory::sgl_len(sgl) as usize;
                if !wr.op.is_read_or_atomic() {
                    // Every SGE is checked, as the start check does (the gather skips empty ones),
                    // unless the gather of one SGE reads all of it.
                    if !(sgl.len() == 1 && len > 0) {
                        memory::check_sgl(ctx.mem, self.init.pd, sgl, Access::NONE).ok()?;
                    }
                    memory::gather(ctx.mem, self.init.pd, sgl, 0, &mut buf[..len]).ok()?;
                    return Some(Direct::Out(&buf[..len]));
                }
                // The result lands in the SGEs: they must take it before the responder acts.
                memory::check_sgl(ctx.mem, self.init.pd, sgl, Access::LOCAL_WRITE).ok()?;
                match wr.op {
                    SendOp::Read { .. } => Some(Direct::In(&mut buf[..len])),
                    _ if len == 8 => Some(Direct::Atomic(None)),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// `wr`, which [`Qp::direct_request`] turned into `d`, was carried out by the responder
    /// directly: its PSN is used up and acknowledged, a READ's data or an atomic's original value
    /// lands in its SGEs, and it completes as its response would have completed it.
    pub(crate) fn complete_direct(&mut self, wr: &SendWr, d: &Direct<'_>, ctx: &mut Ctx<'_>) {
        let next = self.sq.npsn.next();
        self.sq.reset_psn(next);
        self.sq.on_acked(1, ctx.config);
        self.sq.reset_retries(&self.attr);
        ctx.stats.sent_pkts += 1;
        // What comes back into the SGEs: a READ's data, an atomic's original value.
        let orig;
        let back: Option<&[u8]> = match d {
            Direct::Out(p) => {
                ctx.stats.sent_bytes += p.len() as u64;
                None
            }
            Direct::In(data) => {
                ctx.stats.rcvd_bytes += data.len() as u64;
                Some(data)
            }
            Direct::Atomic(v) => {
                orig = v.unwrap_or(0).to_ne_bytes();
                Some(&orig)
            }
        };
        if let (Some(back), Payload::Sgl(sgl)) = (back, &wr.payload) {
            ctx.stats.rcvd_pkts += 1;
            // Checked by direct_request; memory another process lends may still refuse it (a
            // softrdmad process_vm region, for a write too large to be kept behind and made
            // later), as it would the response's: the completer's error.
            if memory::scatter(ctx.mem, self.init.pd, sgl, 0, back).is_err() {
                let wc = self.wc(wr.wr_id, WcStatus::LocProtErr, send_wc_opcode(&wr.op), 0);
                ctx.push_send_wc(self.init.send_cq, wc);
                self.enter_error(ctx);
                return;
            }
        }
        if self.signaled(wr) {
            let wc = self.wc(wr.wr_id, WcStatus::Success, send_wc_opcode(&wr.op), d.len() as u32);
            ctx.push_send_wc(self.init.send_cq, wc);
        }
    }

    /// Complete WQEs at the head that are finished: a local error, or (UC/UD) fully sent.
    pub(super) fn complete_send_head(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(w) = self.sq.wqes.front() {
            if let Some(status) = w.error {
                let w = self.sq.pop_head().expect("head exists");
                let wc = self.wc(w.wr.wr_id, status, send_wc_opcode(&w.wr.op), 0);
                ctx.push_send_wc(self.init.send_cq, wc);
                match self.init.qp_type {
                    QpType::Rc => self.enter_error(ctx),
                    QpType::Uc | QpType::Ud => self.enter_sq_error(ctx),
                }
                return;
            }
            let done = self.init.qp_type != QpType::Rc && w.started && self.sq.cur > 0;
            if !done {
                return;
            }
            let w = self.sq.pop_head().expect("head exists");
            self.finish_send(w, WcStatus::Success, ctx);
        }
    }

    /// Emit the completion of a finished send WQE (successful ones only when signaled).
    pub(super) fn finish_send(&mut self, w: SendWqe, status: WcStatus, ctx: &mut Ctx<'_>) {
        if status != WcStatus::Success || w.signaled {
            let byte_len = if status == WcStatus::Success { w.len } else { 0 };
            let wc = self.wc(w.wr.wr_id, status, send_wc_opcode(&w.wr.op), byte_len);
            ctx.push_send_wc(self.init.send_cq, wc);
        }
        self.check_drained(ctx);
    }

    pub(super) fn on_rnr_wait_over(&mut self, ctx: &mut Ctx<'_>) {
        self.sq.rnr_paused = false;
        let una = self.sq.una;
        self.sq.rewind(una);
        ctx.stats.retry_rounds += 1;
        ctx.mark_ready(self.qpn);
    }
}
