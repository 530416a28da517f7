//! The completer: ACKs, NAKs, read responses and atomic acknowledgements coming back to the
//! requester; send completions in order; retransmission on NAK, RNR and local ACK timeout.
//!
//! Every response with PSN `p` implicitly acknowledges all requests before `p` (IBA 9.7.5.1.3).
//! A read or atomic that is implicitly acknowledged without its own response means the response was
//! lost: the requester goes back to it. retry_cnt and rnr_retry count consecutive retries without
//! forward progress; 7 means retry forever for rnr_retry (IBA) and, as Linux rxe also does, for
//! retry_cnt.

use super::{Qp, Timer};
use crate::attr::QpType;
use crate::cq::WcStatus;
use crate::hca::Ctx;
use crate::memory;
use crate::wr::{Payload, SendOp};
use softrdma_wire::opcode::Flags;
use softrdma_wire::{IbPacket, NakCode, Psn, Syndrome};

/// What implicit acknowledgement found.
enum Implicit {
    /// Everything before the PSN is complete.
    Done,
    /// A read or atomic before the PSN lost its response: retransmit from `una`.
    LostResponse,
}

impl Qp {
    pub(super) fn handle_response(&mut self, pkt: &IbPacket<&[u8]>, ctx: &mut Ctx<'_>) {
        if self.init.qp_type != QpType::Rc || !self.state.can_send() {
            ctx.stats.drop_bad_state += 1;
            return;
        }
        let psn = pkt.bth().psn();
        // Responses for PSNs never sent, or older than anything outstanding, are stray.
        if !psn.before(self.sq.sent_hw) || psn.before(self.sq.una) {
            ctx.stats.drop_stray_resp += 1;
            return;
        }
        let info = pkt.info();
        let syndrome = pkt.aeth().map(|a| a.syndrome());
        match syndrome {
            Some(Syndrome::Ack { .. }) | None => {}
            Some(Syndrome::RnrNak { timer }) => return self.on_rnr_nak(psn, timer, ctx),
            Some(Syndrome::Nak(NakCode::PsnSequenceError)) => return self.on_seq_nak(psn, ctx),
            Some(Syndrome::Nak(code)) => return self.on_error_nak(psn, code, ctx),
            Some(Syndrome::Reserved(_)) => {
                ctx.stats.drop_stray_resp += 1;
                return;
            }
        }
        if info.is(Flags::READ) {
            self.on_read_response(pkt, psn, ctx);
        } else if info.is(Flags::ATOMIC) {
            self.on_atomic_ack(pkt, psn, ctx);
        } else {
            // A plain ACK acknowledges everything through `psn`.
            if let Implicit::LostResponse = self.ack_before(psn.next(), ctx) {
                return self.retry(ctx);
            }
            // An ACK inside a read's response range acknowledges data we never got.
            if self.sq.wqes.front().is_some_and(|w| w.wr.op.is_read_or_atomic() && w.contains(psn)) {
                return self.retry(ctx);
            }
            if psn.next().after(self.sq.una) {
                self.progress(psn.next(), ctx);
            }
        }
    }

    /// Complete every WQE that ends before `psn`.
    fn ack_before(&mut self, psn: Psn, ctx: &mut Ctx<'_>) -> Implicit {
        // The progress of all the WQEs completed goes in once, at the end (an ACK of a batch of
        // small messages completes several): the same state as one step per WQE.
        let mut una = None;
        let mut implicit = Implicit::Done;
        while let Some(w) = self.sq.wqes.front() {
            if !w.started || !w.last_psn().before(psn) {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                implicit = Implicit::LostResponse;
                break;
            }
            una = Some(w.last_psn().next());
            let w = self.sq.pop_head().expect("head exists");
            self.finish_send(w, WcStatus::Success, ctx);
        }
        if let Some(una) = una {
            self.progress(una, ctx);
        }
        if matches!(implicit, Implicit::Done) {
            self.complete_send_head(ctx);
        }
        implicit
    }

    /// Forward progress to `una`: reset the retry budgets and the retransmit timer.
    fn progress(&mut self, una: Psn, ctx: &mut Ctx<'_>) {
        if una.after(self.sq.una) {
            self.sq.probe_armed = false;
            self.sq.probes = 0;
            self.sq.rtt.on_ack(una, ctx.now);
            let k = una.diff(self.sq.una) as u32;
            self.sq.on_acked(k, ctx.config);
            self.sq.una = una;
            self.sq.retrying_from = None;
        }
        self.sq.reset_retries(&self.attr);
        let at = if self.sq.unacked() { self.ack_timeout().map(|d| ctx.now + d) } else { None };
        self.set_timer(Timer::Retransmit, at);
        ctx.mark_ready(self.qpn);
    }

    /// Go back to the oldest unacknowledged PSN, spending one retry — unless a retry from there is
    /// already under way.
    fn retry(&mut self, ctx: &mut Ctx<'_>) {
        if self.sq.retrying_from == Some(self.sq.una) {
            return;
        }
        self.start_retry(ctx);
    }

    fn start_retry(&mut self, ctx: &mut Ctx<'_>) {
        if self.attr.retry_cnt != 7 {
            if self.sq.retry_left == 0 {
                return self.fail_head(WcStatus::RetryExcErr, ctx);
            }
            self.sq.retry_left -= 1;
        }
        ctx.stats.retry_rounds += 1;
        self.sq.on_loss(ctx.config);
        let una = self.sq.una;
        self.sq.retrying_from = Some(una);
        self.sq.rewind(una);
        // With an adaptive window, a retransmission that is lost again is probed for after about
        // a round trip (`rtt`) instead of the whole local ACK timeout: the responder already NAKed
        // that PSN and stays silent until it arrives (IBA 9.7.5.1.1), so nothing else would tell us.
        self.sq.probes = 0;
        self.arm_probe_or_timeout(ctx);
        ctx.mark_ready(self.qpn);
    }

    /// Arm the retransmit timer for the next probe of this round, or for the full local ACK timeout
    /// once the probe interval (doubling with each probe) reaches it.
    fn arm_probe_or_timeout(&mut self, ctx: &mut Ctx<'_>) {
        let probe = self.sq.rtt.probe_interval(self.sq.probes);
        let at = match self.ack_timeout() {
            Some(full) if ctx.config.adaptive_window && full > probe => {
                self.sq.probe_armed = true;
                Some(ctx.now + probe)
            }
            d => {
                self.sq.probe_armed = false;
                d.map(|d| ctx.now + d)
            }
        };
        self.set_timer(Timer::Retransmit, at);
    }

    /// The head WQE fails with `status`; the QP goes to ERR and flushes the rest.
    fn fail_head(&mut self, status: WcStatus, ctx: &mut Ctx<'_>) {
        if let Some(w) = self.sq.pop_head() {
            self.finish_send(w, status, ctx);
        }
        self.enter_error(ctx);
    }

    pub(super) fn on_ack_timeout(&mut self, ctx: &mut Ctx<'_>) {
        if !self.sq.unacked() || self.sq.rnr_paused {
            return;
        }
        if std::mem::take(&mut self.sq.probe_armed) {
            // No progress since the retry began: resend from `una` once more, without spending the
            // retry budget, and probe again after twice the interval (the full timeout at most).
            ctx.stats.retry_rounds += 1;
            let una = self.sq.una;
            self.sq.rewind(una);
            self.sq.probes += 1;
            self.arm_probe_or_timeout(ctx);
            ctx.mark_ready(self.qpn);
            return;
        }
        ctx.stats.ack_timeouts += 1;
        self.start_retry(ctx);
    }

    fn on_seq_nak(&mut self, psn: Psn, ctx: &mut Ctx<'_>) {
        ctx.stats.rcvd_seq_err += 1;
        if let Implicit::LostResponse = self.ack_before(psn, ctx) {
            return self.retry(ctx);
        }
        if psn.after(self.sq.una) {
            self.progress(psn, ctx);
        }
        self.retry(ctx);
    }

    fn on_rnr_nak(&mut self, psn: Psn, timer: u8, ctx: &mut Ctx<'_>) {
        ctx.stats.rcvd_rnr_err += 1;
        if let Implicit::LostResponse = self.ack_before(psn, ctx) {
            return self.retry(ctx);
        }
        if psn.after(self.sq.una) {
            self.progress(psn, ctx);
        }
        if self.attr.rnr_retry != 7 {
            if self.sq.rnr_left == 0 {
                return self.fail_head(WcStatus::RnrRetryExcErr, ctx);
            }
            self.sq.rnr_left -= 1;
        }
        self.sq.rnr_paused = true;
        // The requester goes back to `una` when the wait is over: that is the retry for this
        // PSN. A sequence-error NAK for the packets that followed the RNR'd one (the responder
        // sends one) is the same loss and must not spend a transport retry.
        self.sq.retrying_from = Some(self.sq.una);
        self.set_timer(Timer::Retransmit, None);
        self.set_timer(Timer::RnrWait, Some(ctx.now + Self::rnr_delay(timer)));
    }

    fn on_error_nak(&mut self, psn: Psn, code: NakCode, ctx: &mut Ctx<'_>) {
        ctx.stats.rcvd_err_nak += 1;
        if let Implicit::LostResponse = self.ack_before(psn, ctx) {
            return self.retry(ctx);
        }
        let status = match code {
            NakCode::InvalidRequest | NakCode::InvalidRdRequest => WcStatus::RemInvReqErr,
            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
            NakCode::RemoteOperationalError => WcStatus::RemOpErr,
            NakCode::PsnSequenceError | NakCode::Unknown(_) => WcStatus::BadRespErr,
        };
        self.fail_head(status, ctx);
    }

    fn on_read_response(&mut self, pkt: &IbPacket<&[u8]>, psn: Psn, ctx: &mut Ctx<'_>) {
        if let Implicit::LostResponse = self.ack_before(psn, ctx) {
            return self.retry(ctx);
        }
        let mtu = self.attr.mtu.bytes();
        let Some(w) = self.sq.wqes.front() else {
            ctx.stats.drop_stray_resp += 1;
            return;
        };
        if !matches!(w.wr.op, SendOp::Read { .. }) || !w.contains(psn) {
            ctx.stats.drop_stray_resp += 1;
            return;
        }
        if psn != self.sq.una {
            // Responses before this one were lost.
            return self.retry(ctx);
        }
        let info = pkt.info();
        if info.starts_message() != w.read_expect_first {
            ctx.stats.drop_stray_resp += 1;
            return;
        }
        let k = psn.diff(w.first_psn) as u32;
        let offset = k as usize * mtu;
        let expect = (w.len as usize - offset.min(w.len as usize)).min(mtu);
        let is_last_pkt = k + 1 == w.npkts;
        let payload = pkt.payload();
        if payload.len() != expect || info.ends_message() != is_last_pkt {
            return self.fail_head(WcStatus::BadRespErr, ctx);
        }
        if let Payload::Sgl(sgl) = &w.wr.payload {
            if memory::scatter(ctx.mem, self.init.pd, sgl, offset as u64, payload).is_err() {
                return self.fail_head(WcStatus::LocProtErr, ctx);
            }
        }
        ctx.stats.rcvd_bytes += payload.len() as u64;
        self.sq.wqes[0].read_expect_first = false;
        self.progress(psn.next(), ctx);
        if is_last_pkt {
            let w = self.sq.pop_head().expect("head exists");
            self.finish_send(w, WcStatus::Success, ctx);
            self.complete_send_head(ctx);
        }
    }

    fn on_atomic_ack(&mut self, pkt: &IbPacket<&[u8]>, psn: Psn, ctx: &mut Ctx<'_>) {
        if let Implicit::LostResponse = self.ack_before(psn, ctx) {
            return self.retry(ctx);
        }
        let Some(w) = self.sq.wqes.front() else {
            ctx.stats.drop_stray_resp += 1;
            return;
        };
        if !w.wr.op.is_atomic() || w.first_psn != psn || psn != self.sq.una {
            ctx.stats.drop_stray_resp += 1;
            return;
        }
        let orig = pkt.atomic_ack_eth().map(|a| a.orig()).unwrap_or(0);
        if let Payload::Sgl(sgl) = &w.wr.payload {
            if memory::scatter(ctx.mem, self.init.pd, sgl, 0, &orig.to_ne_bytes()).is_err() {
                return self.fail_head(WcStatus::LocProtErr, ctx);
            }
        }
        self.progress(psn.next(), ctx);
        let w = self.sq.pop_head().expect("head exists");
        self.finish_send(w, WcStatus::Success, ctx);
        self.complete_send_head(ctx);
    }
}
