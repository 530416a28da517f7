//! One queue pair: its attributes, state, send and receive queues, and the three engines that drive
//! it — the requester (send WQEs → request packets), the completer (responses → send completions,
//! retransmission) and the responder (requests → memory, receive completions, responses).
//!
//! Every method takes a [`Ctx`]: the clock reading, memory, CQs, SRQs, event queue, counters and
//! configuration of the HCA it belongs to. Completions are pushed into CQs in the order the verbs
//! spec requires; errors move the QP to ERR (or SQE for UC/UD send errors) and flush.

mod completer;
mod requester;
mod responder;
mod rtt;

use std::collections::VecDeque;

use crate::attr::{check_modify, AddressVector, ModifyQp, Mtu, QpInit, QpState, QpType};
use crate::config::Config;
use crate::cq::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use crate::error::VerbsError;
use crate::hca::{AsyncEvent, Ctx, Transmit};
use crate::memory::Access;
use crate::time::Instant;
use crate::wr::{Payload, RecvWr, SendFlags, SendOp, SendWr};
use softrdma_wire::{IbPacket, Psn, Qpn};

use requester::SendQueue;
pub(crate) use responder::Responder;
use responder::WaitingAck;

/// The QP's timers, in a fixed table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// Local ACK timeout: outstanding requests unanswered.
    Retransmit = 0,
    /// Waiting out an RNR NAK before retrying.
    RnrWait = 1,
    /// Sends left waiting by a post ([`Hca::cork`](crate::Hca::cork)) go out by now at the
    /// latest, should the ACK that was to bring the next flush be lost. Firing does nothing in the
    /// engine: the I/O layer's flush after `handle_timeout` sends them.
    Cork = 2,
}

const TIMERS: usize = 3;

/// A queue pair.
pub(crate) struct Qp {
    pub qpn: Qpn,
    pub init: QpInit,
    pub state: QpState,
    pub attr: QpAttrs,
    pub sq: SendQueue,
    pub rq: VecDeque<RecvWr>,
    pub resp: Responder,
    timers: [Option<Instant>; TIMERS],
    /// Enter-SQD asked for an `SqDrained` event that has not been sent yet.
    sqd_notify: bool,
    /// Packets sent in a row by this QP in the current turn (fairness between QPs).
    pub burst: u32,
    /// The deadline under which the HCA's timer index holds this QP (kept by the HCA).
    pub indexed_deadline: Option<Instant>,
    /// Counted among the HCA's busy QPs (RC with send work; kept by the HCA).
    pub busy: bool,
    /// Packets in flight as counted in the HCA's total (kept by the HCA).
    pub inflight: u32,
    /// Counted among the HCA's QPs owing a READ response (kept by the HCA).
    pub owes_read: bool,
}

/// Current values of the modifiable attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpAttrs {
    pub qkey: u32,
    pub access: Access,
    pub av: AddressVector,
    pub mtu: Mtu,
    pub dest_qpn: Qpn,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub rq_psn: Psn,
    pub sq_psn: Psn,
}

impl Default for QpAttrs {
    fn default() -> Self {
        QpAttrs {
            qkey: 0,
            access: Access::NONE,
            av: AddressVector::default(),
            mtu: Mtu::M1024,
            dest_qpn: Qpn::new(0),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            rq_psn: Psn::new(0),
            sq_psn: Psn::new(0),
        }
    }
}

/// A snapshot of a QP for `query_qp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// QP number.
    pub qpn: Qpn,
    /// State.
    pub state: QpState,
    /// Type.
    pub qp_type: QpType,
    /// Q_Key.
    pub qkey: u32,
    /// Remote access rights.
    pub access: Access,
    /// Path.
    pub av: AddressVector,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Remote QPN.
    pub dest_qpn: Qpn,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// RNR timer code.
    pub min_rnr_timer: u8,
    /// Next PSN the responder expects.
    pub rq_psn: Psn,
    /// Next PSN the requester will send.
    pub sq_psn: Psn,
    /// Send WQEs outstanding.
    pub sq_outstanding: u32,
    /// Receive WQEs posted (not counting an SRQ).
    pub rq_posted: u32,
}

impl Qp {
    pub fn new(qpn: Qpn, init: QpInit) -> Qp {
        Qp {
            qpn,
            init,
            state: QpState::Reset,
            attr: QpAttrs::default(),
            sq: SendQueue::new(),
            rq: VecDeque::new(),
            resp: Responder::new(),
            timers: [None; TIMERS],
            sqd_notify: false,
            burst: 0,
            indexed_deadline: None,
            busy: false,
            inflight: 0,
            owes_read: false,
        }
    }

    pub fn qp_type(&self) -> QpType {
        self.init.qp_type
    }

    /// Whether what was just posted may wait for the next progress instead of going out now
    /// (see [`Config::cork_max_queued`]): an RC QP in RTS with at least
    /// [`Config::CORK_MIN_INFLIGHT`] packets unacknowledged, whose ACK is expected to drive the
    /// next flush, and fewer than `cork_max_queued` WQEs not yet started. If so, the cork timer
    /// is armed (unless it already runs): the sends go out [`Config::CORK_WAIT`] later at the
    /// latest, whatever becomes of that ACK.
    pub fn cork(&mut self, config: &Config, now: Instant) -> bool {
        let cork = self.init.qp_type == QpType::Rc
            && self.state == QpState::Rts
            && self.sq.send_psn.diff(self.sq.una) >= Config::CORK_MIN_INFLIGHT as i32
            && self.sq.len() - self.sq.cur.min(self.sq.len()) < config.cork_max_queued;
        if cork && self.timer(Timer::Cork).is_none() {
            self.set_timer(Timer::Cork, Some(now + Config::CORK_WAIT));
        }
        cork
    }

    pub fn info(&self) -> QpInfo {
        QpInfo {
            qpn: self.qpn,
            state: self.state,
            qp_type: self.init.qp_type,
            qkey: self.attr.qkey,
            access: self.attr.access,
            av: self.attr.av,
            path_mtu: self.attr.mtu,
            dest_qpn: self.attr.dest_qpn,
            timeout: self.attr.timeout,
            retry_cnt: self.attr.retry_cnt,
            rnr_retry: self.attr.rnr_retry,
            max_rd_atomic: self.attr.max_rd_atomic,
            max_dest_rd_atomic: self.attr.max_dest_rd_atomic,
            min_rnr_timer: self.attr.min_rnr_timer,
            rq_psn: self.resp.epsn,
            sq_psn: self.sq.npsn,
            sq_outstanding: self.sq.len() as u32,
            rq_posted: self.rq.len() as u32,
        }
    }

    // ---- timers ------------------------------------------------------------------------------

    pub fn set_timer(&mut self, t: Timer, at: Option<Instant>) {
        self.timers[t as usize] = at;
    }

    pub fn timer(&self, t: Timer) -> Option<Instant> {
        self.timers[t as usize]
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.timers.iter().flatten().min().copied()
    }

    /// What packets sent at `then` started (the RTT sample, the retransmit timer they armed)
    /// starts at `now` instead (see [`crate::Hca::restamp`]).
    pub fn restamp(&mut self, then: Instant, now: Instant) {
        self.sq.rtt.restamp(then, now);
        if let Some(d) = self.ack_timeout().filter(|&d| self.timer(Timer::Retransmit) == Some(then + d)) {
            self.set_timer(Timer::Retransmit, Some(now + d));
        }
    }

    /// Fire every expired timer.
    pub fn handle_timeout(&mut self, ctx: &mut Ctx<'_>) {
        for t in [Timer::Retransmit, Timer::RnrWait, Timer::Cork] {
            if self.timer(t).is_some_and(|at| at <= ctx.now) {
                self.set_timer(t, None);
                match t {
                    Timer::Retransmit => self.on_ack_timeout(ctx),
                    Timer::RnrWait => self.on_rnr_wait_over(ctx),
                    Timer::Cork => {}
                }
            }
        }
    }

    // ---- verbs -------------------------------------------------------------------------------

    pub fn modify(&mut self, m: &ModifyQp, ctx: &mut Ctx<'_>) -> Result<(), VerbsError> {
        m.check_values(ctx.config.max_rd_atomic)?;
        let next = check_modify(self.state, self.qp_type(), m)?;
        let a = &mut self.attr;
        if let Some(v) = m.qkey {
            a.qkey = v;
        }
        if let Some(v) = m.access {
            a.access = v;
        }
        if let Some(v) = m.av {
            a.av = v;
        }
        if let Some(v) = m.path_mtu {
            a.mtu = v;
        }
        if let Some(v) = m.dest_qpn {
            a.dest_qpn = v;
        }
        if let Some(v) = m.timeout {
            a.timeout = v;
        }
        if let Some(v) = m.retry_cnt {
            a.retry_cnt = v;
        }
        if let Some(v) = m.rnr_retry {
            a.rnr_retry = v;
        }
        if let Some(v) = m.max_rd_atomic {
            a.max_rd_atomic = v;
        }
        if let Some(v) = m.max_dest_rd_atomic {
            a.max_dest_rd_atomic = v;
        }
        if let Some(v) = m.min_rnr_timer {
            a.min_rnr_timer = v;
        }
        if let Some(v) = m.rq_psn {
            a.rq_psn = v;
            self.resp.epsn = v;
        }
        if let Some(v) = m.sq_psn {
            a.sq_psn = v;
            self.sq.reset_psn(v);
        }
        if self.init.qp_type == QpType::Ud {
            a.mtu = ctx.config.port_mtu;
        }
        let prev = self.state;
        match next {
            QpState::Reset => self.reset(),
            QpState::Err if prev != QpState::Err => self.enter_error(ctx),
            QpState::Sqd => {
                self.state = QpState::Sqd;
                self.sqd_notify = prev != QpState::Sqd && m.en_sqd_async_notify == Some(true);
                self.check_drained(ctx);
            }
            QpState::Rts => {
                self.state = QpState::Rts;
                self.sq.reset_retries(&self.attr);
            }
            s => self.state = s,
        }
        ctx.mark_ready(self.qpn);
        Ok(())
    }

    /// Back to RESET: queues emptied without completions, as the verbs spec says. What the HCA
    /// counted the QP for stays as counted, for its bookkeeping to take off.
    fn reset(&mut self) {
        let (qpn, init, indexed, busy, inflight, owes_read) =
            (self.qpn, self.init, self.indexed_deadline, self.busy, self.inflight, self.owes_read);
        *self = Qp::new(qpn, init);
        self.indexed_deadline = indexed;
        self.busy = busy;
        self.inflight = inflight;
        self.owes_read = owes_read;
    }

    pub fn post_send(&mut self, wr: SendWr, ctx: &mut Ctx<'_>) -> Result<(), VerbsError> {
        if matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(VerbsError::InvalidState(self.state));
        }
        self.validate_send(&wr)?;
        if self.sq.len() >= self.init.cap.max_send_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        let signaled = self.signaled(&wr);
        if matches!(self.state, QpState::Err | QpState::Sqe) {
            // Posted to a QP in error: completes at once, flushed.
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, send_wc_opcode(&wr.op), 0);
            ctx.push_send_wc(self.init.send_cq, wc);
            return Ok(());
        }
        self.sq.push(wr, signaled);
        ctx.mark_ready(self.qpn);
        Ok(())
    }

    /// Whether `wr` completes with a completion when it succeeds.
    fn signaled(&self, wr: &SendWr) -> bool {
        self.init.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED)
    }

    fn validate_send(&self, wr: &SendWr) -> Result<(), VerbsError> {
        let cap = &self.init.cap;
        match &wr.payload {
            Payload::Sgl(sgl) if sgl.len() > cap.max_send_sge as usize => {
                return Err(VerbsError::InvalidWorkRequest("more SGEs than max_send_sge"));
            }
            Payload::Inline(d) if d.len() > cap.max_inline_data as usize => {
                return Err(VerbsError::InvalidWorkRequest("inline data longer than max_inline_data"));
            }
            Payload::Inline(_) if wr.op.is_read_or_atomic() => {
                return Err(VerbsError::InvalidWorkRequest("inline data on a read or atomic"));
            }
            _ => {}
        }
        let allowed = match self.qp_type() {
            QpType::Rc => true,
            QpType::Uc => !wr.op.is_read_or_atomic() && !matches!(wr.op, SendOp::SendWithInv(_)),
            QpType::Ud => matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)),
        };
        if !allowed {
            return Err(VerbsError::InvalidWorkRequest("operation not supported on this QP type"));
        }
        if self.qp_type() == QpType::Ud && wr.ud.is_none() {
            return Err(VerbsError::InvalidWorkRequest("UD send without an address handle"));
        }
        Ok(())
    }

    /// Queue a receive. In the error state it is flushed at once: the completion to push, and its
    /// CQ, come back.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<Option<(crate::CqId, WorkCompletion)>, VerbsError> {
        if self.init.srq.is_some() {
            return Err(VerbsError::InvalidWorkRequest("QP uses an SRQ: post to the SRQ"));
        }
        if self.state == QpState::Reset {
            return Err(VerbsError::InvalidState(self.state));
        }
        if wr.sgl.len() > self.init.cap.max_recv_sge as usize {
            return Err(VerbsError::InvalidWorkRequest("more SGEs than max_recv_sge"));
        }
        if self.rq.len() >= self.init.cap.max_recv_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if self.state == QpState::Err {
            return Ok(Some((self.init.recv_cq, self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0))));
        }
        self.rq.push_back(wr);
        Ok(None)
    }

    // ---- packets -----------------------------------------------------------------------------

    /// A packet addressed to this QP.
    pub fn handle_packet(&mut self, pkt: &IbPacket<&[u8]>, grh: &[u8; 40], ctx: &mut Ctx<'_>) {
        if !self.state.can_receive() {
            ctx.stats.drop_bad_state += 1;
            return;
        }
        let info = pkt.info();
        let expected = match self.qp_type() {
            QpType::Rc => softrdma_wire::QpType::Rc,
            QpType::Uc => softrdma_wire::QpType::Uc,
            QpType::Ud => softrdma_wire::QpType::Ud,
        };
        if info.qp_type != expected {
            ctx.stats.drop_bad_state += 1;
            return;
        }
        if info.is(softrdma_wire::opcode::Flags::RESP) {
            self.handle_response(pkt, ctx);
        } else {
            self.handle_request(pkt, grh, ctx);
        }
        ctx.mark_ready(self.qpn);
    }

    /// Whether [`Qp::poll_transmit`] would find nothing, with no side effect: no response owed and
    /// no work request left to (re)transmit. Anything that changes that (a post, a packet, a timer)
    /// queues the QP again.
    pub fn nothing_to_transmit(&self) -> bool {
        self.resp.nothing_owed() && self.sq.cur >= self.sq.len()
    }

    /// Produce the next packet to send, responses first, except that a plain ACK lets one request
    /// packet of this QP go before it. The two go opposite ways (the ACK to the peer's requester,
    /// the request to its responder), so nothing orders them; sending the request first puts the
    /// reply of a request-response exchange on the wire before the ACK of the request it answers
    /// (in one `sendmmsg`, the reply reaches the peer while the ACK is still being sent). One
    /// packet of this QP at most: a stream of requests never holds an ACK back for longer (should
    /// that packet end the QP's turn, the ACK waits for the other QPs' turns in the same flush).
    pub fn poll_transmit(&mut self, buf: &mut [u8], ctx: &mut Ctx<'_>) -> Option<Transmit> {
        if let Some(ack) = self.resp.ack_may_wait() {
            return self.request_before_ack(ack, buf, ctx);
        }
        if let Some(t) = self.poll_response(buf, ctx) {
            return Some(t);
        }
        self.poll_request(buf, ctx)
    }

    /// [`Qp::poll_transmit`] with a plain ACK at the head of the responses that may wait: a request
    /// packet if there is one, else the ACK. Out of line, so that the usual path keeps building the
    /// request straight into the caller's result.
    #[cold]
    #[inline(never)]
    fn request_before_ack(&mut self, ack: WaitingAck, buf: &mut [u8], ctx: &mut Ctx<'_>) -> Option<Transmit> {
        let t = self.poll_request(buf, ctx);
        self.resp.request_tried_first(ack, t.is_some());
        t.or_else(|| self.poll_response(buf, ctx))
    }

    // ---- errors and completions --------------------------------------------------------------

    pub fn wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, byte_len: u32) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len,
            imm: 0,
            invalidated_rkey: 0,
            qp_num: self.qpn,
            src_qp: Qpn::new(0),
            flags: WcFlags::NONE,
        }
    }

    /// Move to ERR: flush every send and receive WQE (in order), stop timers, raise the events due.
    pub fn enter_error(&mut self, ctx: &mut Ctx<'_>) {
        self.state = QpState::Err;
        self.timers = [None; TIMERS];
        self.flush_sq(ctx);
        if let Some(wr) = self.resp.take_in_progress() {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            ctx.push_recv_wc(self.init.recv_cq, wc);
        }
        while let Some(wr) = self.rq.pop_front() {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            ctx.push_recv_wc(self.init.recv_cq, wc);
        }
        self.resp.clear_output();
        if self.init.srq.is_some() {
            ctx.events.push_back(AsyncEvent::QpLastWqeReached(self.qpn));
        }
    }

    /// Complete every send WQE with WR_FLUSH_ERR, oldest first.
    fn flush_sq(&mut self, ctx: &mut Ctx<'_>) {
        let (qpn, cq) = (self.qpn, self.init.send_cq);
        for (wr_id, op) in self.sq.drain() {
            ctx.push_send_wc(cq, flushed_wc(qpn, wr_id, op));
        }
    }

    /// A UC/UD send failed locally: SQE, the rest of the send queue flushed, receives go on.
    pub fn enter_sq_error(&mut self, ctx: &mut Ctx<'_>) {
        self.state = QpState::Sqe;
        self.flush_sq(ctx);
    }

    /// Report `SqDrained` once the send queue has nothing in flight after entering SQD.
    fn check_drained(&mut self, ctx: &mut Ctx<'_>) {
        if self.state == QpState::Sqd && self.sqd_notify && self.sq.nothing_in_flight() {
            self.sqd_notify = false;
            ctx.events.push_back(AsyncEvent::SqDrained(self.qpn));
        }
    }
}

/// A flushed completion of `wr_id` on `qpn` (as [`Qp::wc`] with WR_FLUSH_ERR and no bytes).
fn flushed_wc(qpn: Qpn, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status: WcStatus::WrFlushErr,
        opcode,
        byte_len: 0,
        imm: 0,
        invalidated_rkey: 0,
        qp_num: qpn,
        src_qp: Qpn::new(0),
        flags: WcFlags::NONE,
    }
}

/// The completion opcode of a send operation.
pub(crate) fn send_wc_opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => WcOpcode::Send,
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
        SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
    }
}
