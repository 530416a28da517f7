//! The responder: checks incoming requests (PSN, opcode sequence, length, keys and rights), executes
//! them against memory, completes receive WQEs, and queues the responses — ACKs, NAKs, RNR NAKs,
//! read response streams and atomic acknowledgements — in PSN order.
//!
//! Duplicates (RC) are answered without executing twice: sends and writes are re-ACKed, reads are
//! re-executed from the requested PSN, atomics are replayed from a cache of the last
//! `max_dest_rd_atomic` results. One NAK is sent per PSN sequence error (IBA 9.7.5.1.1). UC drops a
//! message with a missing packet silently; UD checks the Q_Key and puts the 40-byte GRH in front of
//! the data.

use std::collections::VecDeque;

use super::requester::Direct;
use super::Qp;
use crate::attr::{QpState, QpType};
use crate::cq::{WcFlags, WcOpcode, WcStatus};
use crate::hca::{AsyncEvent, Ctx, Queues, RxPlacement, Transmit};
use crate::memory::{self, Access, AtomicOp, KeyKind, MemError};
use crate::wr::{RecvWr, SendOp};
use softrdma_wire::aeth::CREDITS_INVALID;
use softrdma_wire::bth::DEFAULT_PKEY;
use softrdma_wire::opcode::{base, Flags};
use softrdma_wire::template::emit_acknowledge;
use softrdma_wire::{
    AethRepr, AtomicAckEthRepr, BthRepr, IbPacket, IbRepr, NakCode, Opcode, Psn, QpType as WireQpType, Syndrome,
};

/// The message being received.
#[derive(Debug)]
enum InMsg {
    /// A multi-packet SEND filling a receive WQE.
    Send { wr: RecvWr, offset: u32 },
    /// A multi-packet RDMA WRITE.
    Write { va: u64, rkey: u32, len: u32, offset: u32 },
}

/// A read or atomic remembered for duplicate handling.
#[derive(Debug, Clone, Copy)]
enum Resource {
    Read { first: Psn, last: Psn },
    Atomic { psn: Psn, orig: u64 },
}

/// A response waiting to be sent.
#[derive(Debug, Clone, Copy)]
enum Response {
    Ack { psn: Psn, syndrome: Syndrome, msn: u32 },
    AtomicAck { psn: Psn, orig: u64, msn: u32, dup: bool },
    Read { psn: Psn, va: u64, rkey: u32, remaining: u32, first: bool, msn: u32, dup: bool },
}

impl Response {
    fn is_read(&self) -> bool {
        matches!(self, Response::Read { .. })
    }
}

/// The responses waiting to be sent, oldest first, and how many of them are READ responses
/// ([`Responder::owes_read`] is asked on every busy poll that takes a packet in).
#[derive(Debug, Default)]
struct Responses {
    q: VecDeque<Response>,
    reads: usize,
}

impl Responses {
    fn push_back(&mut self, r: Response) {
        self.reads += usize::from(r.is_read());
        self.q.push_back(r);
    }

    fn pop_back(&mut self) -> Option<Response> {
        let r = self.q.pop_back()?;
        self.reads -= usize::from(r.is_read());
        Some(r)
    }

    fn pop_front(&mut self) -> Option<Response> {
        let r = self.q.pop_front()?;
        self.reads -= usize::from(r.is_read());
        Some(r)
    }

    /// Put `r` in the place of the oldest response (the rest of a READ response).
    fn replace_front(&mut self, r: Response) {
        if let Some(front) = self.q.front_mut() {
            self.reads = self.reads - usize::from(front.is_read()) + usize::from(r.is_read());
            *front = r;
        }
    }

    fn retain(&mut self, keep: impl FnMut(&Response) -> bool) {
        self.q.retain(keep);
        self.reads = self.q.iter().filter(|r| r.is_read()).count();
    }

    fn clear(&mut self) {
        self.q.clear();
        self.reads = 0;
    }

    fn front(&self) -> Option<&Response> {
        self.q.front()
    }

    fn back(&self) -> Option<&Response> {
        self.q.back()
    }

    fn iter(&self) -> impl Iterator<Item = &Response> + '_ {
        self.q.iter()
    }

    fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// A plain ACK a request packet may go before (see [`Responder::ack_may_wait`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct WaitingAck(Response);

/// Responder state of a QP.
#[derive(Debug)]
pub(crate) struct Responder {
    /// Next expected PSN.
    pub epsn: Psn,
    /// Message sequence number: messages completed.
    pub msn: u32,
    nak_sent: bool,
    cur: Option<InMsg>,
    /// UC: discarding the rest of a broken message.
    uc_drop: bool,
    res: VecDeque<Resource>,
    out: Responses,
    /// The plain ACK at the head of `out` already let one request packet of this QP go before it
    /// (see [`Qp::poll_transmit`]).
    ack_waited: bool,
    comm_est: bool,
}

/// A responder-detected error on an RC request: the NAK to send and what else happens.
#[derive(Debug, Clone, Copy)]
struct RespError {
    nak: NakCode,
    event: fn(softrdma_wire::Qpn) -> AsyncEvent,
}

const INVALID_REQUEST: RespError = RespError { nak: NakCode::InvalidRequest, event: AsyncEvent::QpRequestError };
const REMOTE_ACCESS: RespError = RespError { nak: NakCode::RemoteAccessError, event: AsyncEvent::QpAccessError };
const REMOTE_OP: RespError = RespError { nak: NakCode::RemoteOperationalError, event: AsyncEvent::QpFatal };

impl Responder {
    pub fn new() -> Responder {
        Responder {
            epsn: Psn::new(0),
            msn: 0,
            nak_sent: false,
            cur: None,
            uc_drop: false,
            res: VecDeque::new(),
            out: Responses::default(),
            ack_waited: false,
            comm_est: false,
        }
    }

    /// The receive WQE of a SEND in progress (for flushing).
    pub fn take_in_progress(&mut self) -> Option<RecvWr> {
        match self.cur.take() {
            Some(InMsg::Send { wr, .. }) => Some(wr),
            _ => None,
        }
    }

    pub fn clear_output(&mut self) {
        self.out.clear();
        self.ack_waited = false;
    }

    fn queue_ack(&mut self, psn: Psn) {
        let r = Response::Ack { psn, syndrome: Syndrome::Ack { credits: CREDITS_INVALID }, msn: self.msn };
        // Coalesce: a newer plain ACK covers an older one still waiting.
        if let Some(Response::Ack { syndrome: Syndrome::Ack { .. }, .. }) = self.out.back() {
            self.out.pop_back();
        }
        self.out.push_back(r);
    }

    fn queue_nak(&mut self, psn: Psn, syndrome: Syndrome) {
        self.out.push_back(Response::Ack { psn, syndrome, msn: self.msn });
    }

    fn remember(&mut self, r: Resource, max: u8) {
        while self.res.len() >= usize::from(max.max(1)) {
            self.res.pop_front();
        }
        self.res.push_back(r);
    }

    /// New (not duplicate) reads and atomics whose responses are still queued: at most
    /// `max_dest_rd_atomic` when the requester keeps to its limit.
    fn pending_rd_atomic(&self) -> usize {
        let new =
            |r: &&Response| matches!(r, Response::AtomicAck { dup: false, .. } | Response::Read { dup: false, .. });
        self.out.iter().filter(new).count()
    }

    /// The data still to be sent of each READ response queued, in the order they go: `(rkey,
    /// address, bytes left)`.
    pub(crate) fn owed_reads(&self) -> impl Iterator<Item = (u32, u64, u32)> + '_ {
        self.out.iter().filter_map(|r| match *r {
            Response::Read { rkey, va, remaining, .. } => Some((rkey, va, remaining)),
            _ => None,
        })
    }

    /// Whether a READ response is queued.
    pub(crate) fn owes_read(&self) -> bool {
        self.out.reads > 0
    }

    /// The plain ACK (not a NAK) at the head of the responses, when it may still let a request
    /// packet go first (see [`Qp::poll_transmit`]).
    pub(super) fn ack_may_wait(&self) -> Option<WaitingAck> {
        match self.out.front() {
            Some(&r @ Response::Ack { syndrome: Syndrome::Ack { .. }, .. }) if !self.ack_waited => Some(WaitingAck(r)),
            _ => None,
        }
    }

    /// The QP was asked for a request packet before `ack` and `sent` one. If it did not, the
    /// request may have failed a local check (its keys and lengths are checked as it is built) and
    /// moved the QP to ERR, which drops queued responses: the ACK of the requests executed before
    /// still goes, as it would have had it gone first.
    pub(super) fn request_tried_first(&mut self, ack: WaitingAck, sent: bool) {
        if sent {
            self.ack_waited = true;
        } else if self.out.is_empty() {
            self.out.push_back(ack.0);
        }
    }

    /// No response (ACK, NAK, READ response, atomic ACK) waits to be sent.
    pub(super) fn nothing_owed(&self) -> bool {
        self.out.is_empty()
    }

    /// Nothing of an earlier request is pending: no message in progress, no response queued, no
    /// NAK outstanding (see [`Qp::take_direct`]).
    pub(super) fn idle(&self) -> bool {
        self.cur.is_none() && self.nothing_owed() && !self.nak_sent && !self.uc_drop
    }

    /// UC: forget the message in progress; a SEND's receive WQE is kept for the next message.
    fn abandon(&mut self) -> Option<RecvWr> {
        self.take_in_progress()
    }
}

impl Qp {
    pub(super) fn handle_request(&mut self, pkt: &IbPacket<&[u8]>, grh: &[u8; 40], ctx: &mut Ctx<'_>) {
        if pkt.bth().pkey() & 0x7fff != DEFAULT_PKEY & 0x7fff {
            ctx.stats.drop_pkey += 1;
            return;
        }
        if self.state == QpState::Rtr && !self.resp.comm_est {
            self.resp.comm_est = true;
            ctx.events.push_back(AsyncEvent::CommEstablished(self.qpn));
        }
        match self.init.qp_type {
            QpType::Ud => self.ud_request(pkt, grh, ctx),
            QpType::Rc | QpType::Uc => self.connected_request(pkt, ctx),
        }
    }

    fn take_recv(&mut self, ctx: &mut Ctx<'_>) -> Option<RecvWr> {
        match self.init.srq {
            Some(srq) => ctx.srq_take(srq),
            None => self.rq.pop_front(),
        }
    }

    /// The receive WQE [`Qp::take_recv`] would take, left in place.
    fn next_recv<'a>(&'a self, queues: &'a Queues) -> Option<&'a RecvWr> {
        match self.init.srq {
            Some(srq) => queues.srq_front(srq),
            None => self.rq.front(),
        }
    }

    fn ud_request(&mut self, pkt: &IbPacket<&[u8]>, grh: &[u8; 40], ctx: &mut Ctx<'_>) {
        let Some(deth) = pkt.deth() else {
            ctx.stats.drop_malformed += 1;
            return;
        };
        if deth.qkey() != self.attr.qkey {
            ctx.stats.drop_qkey += 1;
            return;
        }
        let Some(wr) = self.take_recv(ctx) else {
            ctx.stats.drop_no_recv += 1;
            return;
        };
        let payload = pkt.payload();
        let total = 40 + payload.len() as u64;
        let mut wc = self.wc(wr.wr_id, WcStatus::Success, WcOpcode::Recv, total as u32);
        wc.src_qp = deth.src_qp();
        wc.flags = WcFlags::GRH;
        if let Some(imm) = pkt.imm() {
            wc.imm = imm;
            wc.flags = wc.flags.with(WcFlags::WITH_IMM);
        }
        if total > memory::sgl_len(&wr.sgl) {
            wc.status = WcStatus::LocLenErr;
            wc.byte_len = 0;
        } else if memory::scatter(ctx.mem, self.init.pd, &wr.sgl, 0, grh).is_err()
            || memory::scatter(ctx.mem, self.init.pd, &wr.sgl, 40, payload).is_err()
        {
            wc.status = WcStatus::LocProtErr;
            wc.byte_len = 0;
        } else {
            ctx.stats.rcvd_bytes += payload.len() as u64;
        }
        ctx.push_recv_wc(self.init.recv_cq, wc);
    }

    fn connected_request(&mut self, pkt: &IbPacket<&[u8]>, ctx: &mut Ctx<'_>) {
        let rc = self.init.qp_type == QpType::Rc;
        let psn = pkt.bth().psn();
        let info = pkt.info();
        let d = psn.diff(self.resp.epsn);
        if d < 0 {
            if rc {
                self.duplicate(pkt, ctx);
            } else {
                ctx.stats.drop_uc_msg += 1;
            }
            return;
        }
        if d > 0 {
            ctx.stats.out_of_seq_request += 1;
            if rc {
                if !self.resp.nak_sent {
                    self.resp.nak_sent = true;
                    let epsn = self.resp.epsn;
                    self.resp.queue_nak(epsn, Syndrome::Nak(NakCode::PsnSequenceError));
                }
                return;
            }
            // UC: packets were lost; the message they belonged to is gone.
            self.uc_abandon();
            self.resp.epsn = psn;
            if !info.starts_message() {
                self.resp.uc_drop = true;
            }
        }
        self.resp.nak_sent = false;
        if !rc && self.resp.uc_drop {
            if !info.starts_message() {
                self.resp.epsn = psn.next();
                ctx.stats.drop_uc_msg += 1;
                return;
            }
            self.resp.uc_drop = false;
        }
        if !rc && info.starts_message() && self.resp.cur.is_some() {
            self.uc_abandon();
        }
        // Opcode sequence: a FIRST/ONLY only between messages, a MIDDLE/LAST only inside one of its kind.
        let in_order = if info.starts_message() {
            self.resp.cur.is_none()
        } else {
            match &self.resp.cur {
                Some(InMsg::Send { .. }) => info.is(Flags::SEND),
                Some(InMsg::Write { .. }) => info.is(Flags::WRITE),
                None => false,
            }
        };
        let mtu = self.attr.mtu.bytes();
        let plen = ctx.placed.unwrap_or(pkt.payload().len());
        let len_ok = if !info.is(Flags::PAYLOAD) {
            true
        } else if info.ends_message() {
            plen <= mtu
        } else {
            plen == mtu
        };
        if !in_order || !len_ok {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        }
        let result = if info.is(Flags::SEND) {
            self.execute_send(pkt, ctx)
        } else if info.is(Flags::WRITE) {
            self.execute_write(pkt, ctx)
        } else if info.is(Flags::READ) && rc {
            return self.execute_read(pkt, psn, ctx);
        } else if info.is(Flags::ATOMIC) && rc {
            return self.execute_atomic(pkt, psn, ctx);
        } else {
            Err(Step::Error(INVALID_REQUEST))
        };
        match result {
            Ok(()) => {
                ctx.stats.rcvd_bytes += plen as u64;
                self.resp.epsn = psn.next();
                if rc && pkt.bth().ack_req() {
                    self.resp.queue_ack(psn);
                }
            }
            Err(Step::Rnr) => {
                ctx.stats.send_rnr_nak += 1;
                if rc {
                    let timer = self.attr.min_rnr_timer;
                    self.resp.queue_nak(psn, Syndrome::RnrNak { timer });
                } else {
                    // UC: no receive posted, the message is dropped.
                    ctx.stats.drop_no_recv += 1;
                    self.resp.epsn = psn.next();
                    self.resp.uc_drop = !info.ends_message();
                }
            }
            Err(Step::Error(e)) => self.request_error(psn, e, ctx),
        }
    }

    fn uc_abandon(&mut self) {
        if let Some(wr) = self.resp.abandon() {
            // Keep the receive WQE for the next message.
            self.rq.push_front(wr);
        }
    }

    /// An RC request failed the responder's checks: NAK it and go to ERR. UC drops the message.
    fn request_error(&mut self, psn: Psn, e: RespError, ctx: &mut Ctx<'_>) {
        if self.init.qp_type != QpType::Rc {
            ctx.stats.drop_uc_msg += 1;
            self.uc_abandon();
            self.resp.epsn = psn.next();
            self.resp.uc_drop = true;
            return;
        }
        ctx.stats.send_err_nak += 1;
        ctx.events.push_back((e.event)(self.qpn));
        self.enter_error(ctx);
        self.resp.queue_nak(psn, Syndrome::Nak(e.nak));
    }

    fn fail_recv(&mut self, wr: RecvWr, status: WcStatus, ctx: &mut Ctx<'_>) {
        let wc = self.wc(wr.wr_id, status, WcOpcode::Recv, 0);
        ctx.push_recv_wc(self.init.recv_cq, wc);
    }

    fn execute_send(&mut self, pkt: &IbPacket<&[u8]>, ctx: &mut Ctx<'_>) -> Result<(), Step> {
        let info = pkt.info();
        let (wr, offset) = match self.resp.cur.take() {
            Some(InMsg::Send { wr, offset }) => (wr, offset),
            _ => match self.take_recv(ctx) {
                Some(wr) => (wr, 0),
                None => return Err(Step::Rnr),
            },
        };
        let payload = pkt.payload();
        if u64::from(offset) + payload.len() as u64 > memory::sgl_len(&wr.sgl) {
            self.fail_recv(wr, WcStatus::LocLenErr, ctx);
            return Err(Step::Error(INVALID_REQUEST));
        }
        if memory::scatter(ctx.mem, self.init.pd, &wr.sgl, u64::from(offset), payload).is_err() {
            self.fail_recv(wr, WcStatus::LocProtErr, ctx);
            return Err(Step::Error(REMOTE_OP));
        }
        let offset = offset + payload.len() as u32;
        if !info.ends_message() {
            self.resp.cur = Some(InMsg::Send { wr, offset });
            return Ok(());
        }
        let mut wc = self.wc(wr.wr_id, WcStatus::Success, WcOpcode::Recv, offset);
        if let Some(imm) = pkt.imm() {
            wc.imm = imm;
            wc.flags = wc.flags.with(WcFlags::WITH_IMM);
        }
        if let Some(rkey) = pkt.ieth() {
            if ctx.mem.invalidate(self.init.pd, rkey).is_err() {
                self.fail_recv(wr, WcStatus::LocProtErr, ctx);
                return Err(Step::Error(INVALID_REQUEST));
            }
            wc.invalidated_rkey = rkey;
            wc.flags = wc.flags.with(WcFlags::WITH_INV);
        }
        ctx.push_recv_wc(self.init.recv_cq, wc);
        self.resp.msn = (self.resp.msn + 1) & 0xff_ffff;
        Ok(())
    }

    /// Take a one-packet RC request with PSN `psn` straight from a QP of this HCA (see
    /// `hca/direct.rs`), when it succeeds here: the PSN is the next expected one, nothing earlier is
    /// pending, and every check its packet would pass is made first (a receive WQE that holds a
    /// SEND's payload in memory the QP may write, the rkey's range and rights, a responder resource
    /// for a READ or atomic). Then it is carried out as its packet would be: memory (a READ's data
    /// into `d`, an atomic's original value into `d`), receive completion, MSN and expected PSN,
    /// the record kept for duplicates, counters. `false` leaves everything as it was: the request
    /// then takes the packet path, which answers a failing check with its NAK and error.
    pub(crate) fn take_direct(&mut self, psn: Psn, op: &SendOp, d: &mut Direct<'_>, ctx: &mut Ctx<'_>) -> bool {
        if self.init.qp_type != QpType::Rc || !self.state.can_receive() || !self.resp.idle() || psn != self.resp.epsn {
            return false;
        }
        let pd = self.init.pd;
        let done = match (*op, &mut *d) {
            (SendOp::Read { remote_addr, rkey }, Direct::In(data)) => {
                self.attr.max_dest_rd_atomic > 0
                    && data.len() <= self.attr.mtu.bytes()
                    && self.remote_check(ctx, rkey, remote_addr, data.len() as u64, Access::REMOTE_READ).is_ok()
                    && (data.is_empty() || ctx.mem.read(pd, rkey, KeyKind::Remote, remote_addr, data).is_ok())
            }
            (SendOp::CompareSwap { remote_addr, rkey, compare, swap }, Direct::Atomic(orig)) => {
                self.direct_atomic(remote_addr, rkey, AtomicOp::CompareSwap { compare, swap }, orig, ctx)
            }
            (SendOp::FetchAdd { remote_addr, rkey, add }, Direct::Atomic(orig)) => {
                self.direct_atomic(remote_addr, rkey, AtomicOp::FetchAdd { add }, orig, ctx)
            }
            (op, Direct::Out(payload)) => return self.take_direct_payload(psn, &op, payload, ctx),
            _ => false,
        };
        if !done {
            return false;
        }
        self.direct_comm_est(ctx);
        // A READ or atomic: remembered for duplicates, answered (the requester takes the answer).
        let res = match (*op, &*d) {
            (_, Direct::Atomic(orig)) => Resource::Atomic { psn, orig: orig.unwrap_or(0) },
            _ => Resource::Read { first: psn, last: psn },
        };
        self.resp.remember(res, self.attr.max_dest_rd_atomic);
        self.direct_done(psn, ctx);
        ctx.stats.sent_pkts += 1;
        if let Direct::In(data) = d {
            ctx.stats.sent_bytes += data.len() as u64;
        }
        true
    }

    /// An atomic for [`Qp::take_direct`]: performed (its original value into `orig`) if it may be.
    fn direct_atomic(&self, va: u64, rkey: u32, op: AtomicOp, orig: &mut Option<u64>, ctx: &mut Ctx<'_>) -> bool {
        if self.attr.max_dest_rd_atomic == 0
            || !self.attr.access.contains(Access::REMOTE_ATOMIC)
            || !va.is_multiple_of(8)
        {
            return false;
        }
        // Checked before it touches memory: an error leaves the word as it was.
        *orig = ctx.mem.atomic(self.init.pd, rkey, va, op).ok();
        orig.is_some()
    }

    /// A SEND or WRITE (with or without immediate) for [`Qp::take_direct`].
    fn take_direct_payload(&mut self, psn: Psn, op: &SendOp, payload: &[u8], ctx: &mut Ctx<'_>) -> bool {
        if payload.len() > self.attr.mtu.bytes() {
            return false;
        }
        let (pd, len) = (self.init.pd, payload.len() as u64);
        let (write, imm) = match *op {
            SendOp::Send => (None, None),
            SendOp::SendWithImm(imm) => (None, Some(imm)),
            SendOp::Write { remote_addr, rkey } => (Some((remote_addr, rkey)), None),
            SendOp::WriteWithImm { remote_addr, rkey, imm } => (Some((remote_addr, rkey)), Some(imm)),
            _ => return false,
        };
        // The receive WQE a SEND fills, or a WRITE with immediate completes: looked at, not taken.
        let next = self.next_recv(ctx.queues);
        let written = match (write, next) {
            (Some(_), None) if imm.is_some() => false,
            (Some((va, rkey)), _) => {
                self.remote_check(ctx, rkey, va, len, Access::REMOTE_WRITE).is_ok()
                    && (len == 0 || ctx.mem.write(pd, rkey, KeyKind::Remote, va, payload).is_ok())
            }
            (None, None) => false,
            (None, Some(wr)) => {
                memory::sgl_len(&wr.sgl) >= len
                    && memory::check_sgl(ctx.mem, pd, &wr.sgl, Access::LOCAL_WRITE).is_ok()
                    && memory::scatter(ctx.mem, pd, &wr.sgl, 0, payload).is_ok()
            }
        };
        if !written {
            return false;
        }
        // Checked and written: from here on it cannot fail.
        self.direct_comm_est(ctx);
        if write.is_none() || imm.is_some() {
            let wr = self.take_recv(ctx).expect("a receive WQE was found above");
            let opcode = if write.is_some() { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
            let mut wc = self.wc(wr.wr_id, WcStatus::Success, opcode, len as u32);
            if let Some(imm) = imm {
                wc.imm = imm;
                wc.flags = WcFlags::WITH_IMM;
            }
            ctx.push_recv_wc(self.init.recv_cq, wc);
        }
        self.direct_done(psn, ctx);
        ctx.stats.rcvd_bytes += len;
        true
    }

    /// The first request taken in RTR establishes communication, as its packet would have, before
    /// anything it does raises an event.
    fn direct_comm_est(&mut self, ctx: &mut Ctx<'_>) {
        if self.state == QpState::Rtr && !self.resp.comm_est {
            self.resp.comm_est = true;
            ctx.events.push_back(AsyncEvent::CommEstablished(self.qpn));
        }
    }

    /// The end of every request [`Qp::take_direct`] carried out: as when its packet was taken in.
    fn direct_done(&mut self, psn: Psn, ctx: &mut Ctx<'_>) {
        self.resp.msn = (self.resp.msn + 1) & 0xff_ffff;
        self.resp.epsn = psn.next();
        ctx.stats.rcvd_pkts += 1;
    }

    fn remote_check(&self, ctx: &Ctx<'_>, rkey: u32, va: u64, len: u64, need: Access) -> Result<(), Step> {
        if !self.attr.access.contains(need) {
            return Err(Step::Error(REMOTE_ACCESS));
        }
        if len == 0 {
            return Ok(());
        }
        ctx.mem.check(self.init.pd, rkey, KeyKind::Remote, va, len, need).map_err(|_| Step::Error(REMOTE_ACCESS))
    }

    fn execute_write(&mut self, pkt: &IbPacket<&[u8]>, ctx: &mut Ctx<'_>) -> Result<(), Step> {
        let info = pkt.info();
        let (va, rkey, len, offset) = match (self.resp.cur.take(), pkt.reth()) {
            (None, Some(reth)) => {
                self.remote_check(ctx, reth.rkey(), reth.va(), u64::from(reth.dma_len()), Access::REMOTE_WRITE)?;
                (reth.va(), reth.rkey(), reth.dma_len(), 0u32)
            }
            (Some(InMsg::Write { va, rkey, len, offset }), None) => (va, rkey, len, offset),
            _ => return Err(Step::Error(INVALID_REQUEST)),
        };
        // A placed payload (`Hca::handle_placed`) is already at va + offset: only its length counts.
        let payload = pkt.payload();
        let plen = ctx.placed.unwrap_or(payload.len());
        let end = u64::from(offset) + plen as u64;
        let len_ok = if info.ends_message() { end == u64::from(len) } else { end < u64::from(len) };
        if !len_ok {
            return Err(Step::Error(INVALID_REQUEST));
        }
        // A write with immediate needs a receive WQE; ask for it before touching memory.
        if info.ends_message() && info.is(Flags::IMM) && self.next_recv(ctx.queues).is_none() {
            self.resp.cur = (!info.starts_message()).then_some(InMsg::Write { va, rkey, len, offset });
            return Err(Step::Rnr);
        }
        if !payload.is_empty() && ctx.placed.is_none() {
            let addr = va.wrapping_add(u64::from(offset));
            ctx.mem
                .write(self.init.pd, rkey, KeyKind::Remote, addr, payload)
                .map_err(|_| Step::Error(REMOTE_ACCESS))?;
        }
        if !info.ends_message() {
            self.resp.cur = Some(InMsg::Write { va, rkey, len, offset: end as u32 });
            return Ok(());
        }
        if let Some(imm) = pkt.imm() {
            let wr = self.take_recv(ctx).ok_or(Step::Rnr)?;
            let mut wc = self.wc(wr.wr_id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len);
            wc.imm = imm;
            wc.flags = WcFlags::WITH_IMM;
            ctx.push_recv_wc(self.init.recv_cq, wc);
        }
        self.resp.msn = (self.resp.msn + 1) & 0xff_ffff;
        Ok(())
    }

    /// See [`crate::Hca::rx_placement`].
    pub(crate) fn rx_placement(&self) -> Option<RxPlacement> {
        match self.resp.cur {
            Some(InMsg::Write { va, rkey, len, offset })
                if self.init.qp_type == QpType::Rc && self.state.can_receive() && offset < len =>
            {
                Some(RxPlacement {
                    qpn: self.qpn,
                    psn: self.resp.epsn,
                    pd: self.init.pd,
                    rkey,
                    addr: va.wrapping_add(u64::from(offset)),
                    remaining: len - offset,
                    mtu: self.attr.mtu.bytes() as u32,
                })
            }
            _ => None,
        }
    }

    fn execute_read(&mut self, pkt: &IbPacket<&[u8]>, psn: Psn, ctx: &mut Ctx<'_>) {
        let Some(reth) = pkt.reth() else {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        };
        if self.resp.pending_rd_atomic() >= usize::from(self.attr.max_dest_rd_atomic) {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        }
        let len = reth.dma_len();
        if let Err(Step::Error(e)) = self.remote_check(ctx, reth.rkey(), reth.va(), u64::from(len), Access::REMOTE_READ)
        {
            return self.request_error(psn, e, ctx);
        }
        let npkts = (len as usize).div_ceil(self.attr.mtu.bytes()).max(1) as u32;
        let last = psn.add(npkts - 1);
        self.resp.remember(Resource::Read { first: psn, last }, self.attr.max_dest_rd_atomic);
        self.resp.msn = (self.resp.msn + 1) & 0xff_ffff;
        let msn = self.resp.msn;
        self.resp.out.push_back(Response::Read {
            psn,
            va: reth.va(),
            rkey: reth.rkey(),
            remaining: len,
            first: true,
            msn,
            dup: false,
        });
        self.resp.epsn = last.next();
    }

    fn execute_atomic(&mut self, pkt: &IbPacket<&[u8]>, psn: Psn, ctx: &mut Ctx<'_>) {
        let Some(a) = pkt.atomic_eth() else {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        };
        if self.resp.pending_rd_atomic() >= usize::from(self.attr.max_dest_rd_atomic) {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        }
        if !self.attr.access.contains(Access::REMOTE_ATOMIC) {
            return self.request_error(psn, REMOTE_ACCESS, ctx);
        }
        if a.va() % 8 != 0 {
            return self.request_error(psn, INVALID_REQUEST, ctx);
        }
        let op = if pkt.bth().opcode().base() == base::COMPARE_SWAP {
            AtomicOp::CompareSwap { compare: a.compare(), swap: a.swap_add() }
        } else {
            AtomicOp::FetchAdd { add: a.swap_add() }
        };
        let orig = match ctx.mem.atomic(self.init.pd, a.rkey(), a.va(), op) {
            Ok(v) => v,
            Err(MemError::Misaligned) => return self.request_error(psn, INVALID_REQUEST, ctx),
            Err(_) => return self.request_error(psn, REMOTE_ACCESS, ctx),
        };
        self.resp.remember(Resource::Atomic { psn, orig }, self.attr.max_dest_rd_atomic);
        self.resp.msn = (self.resp.msn + 1) & 0xff_ffff;
        let msn = self.resp.msn;
        let ack = Response::AtomicAck { psn, orig, msn, dup: false };
        self.resp.out.push_back(ack);
        self.resp.epsn = psn.next();
    }

    /// An RC request with a PSN already seen.
    fn duplicate(&mut self, pkt: &IbPacket<&[u8]>, ctx: &mut Ctx<'_>) {
        ctx.stats.duplicate_request += 1;
        let psn = pkt.bth().psn();
        let info = pkt.info();
        if info.is(Flags::SEND) || info.is(Flags::WRITE) {
            let last = self.resp.epsn.sub(1);
            self.resp.queue_ack(last);
            return;
        }
        let found = self.resp.res.iter().rev().copied().find(|r| match *r {
            Resource::Read { first, last } => psn.diff(first) >= 0 && psn.diff(last) <= 0,
            Resource::Atomic { psn: p, .. } => p == psn,
        });
        let msn = self.resp.msn;
        match (found, pkt.reth()) {
            (Some(Resource::Read { first, last }), Some(reth)) if info.is(Flags::READ) => {
                let len = reth.dma_len();
                if self.remote_check(ctx, reth.rkey(), reth.va(), u64::from(len), Access::REMOTE_READ).is_err() {
                    return;
                }
                // A stream of the same read still queued restarts here instead; it keeps its
                // place in the count of new requests.
                let same = |p: Psn| p.diff(first) >= 0 && p.diff(last) <= 0;
                let was_new =
                    self.resp.out.iter().any(|r| matches!(*r, Response::Read { psn: p, dup: false, .. } if same(p)));
                self.resp.out.retain(|r| !matches!(*r, Response::Read { psn: p, .. } if same(p)));
                self.resp.out.push_back(Response::Read {
                    psn,
                    va: reth.va(),
                    rkey: reth.rkey(),
                    remaining: len,
                    first: true,
                    msn,
                    dup: !was_new,
                });
            }
            (Some(Resource::Atomic { psn, orig }), _) if info.is(Flags::ATOMIC) => {
                let queued = self.resp.out.iter().any(|r| matches!(*r, Response::AtomicAck { psn: p, .. } if p == psn));
                if !queued {
                    let ack = Response::AtomicAck { psn, orig, msn, dup: true };
                    self.resp.out.push_back(ack);
                }
            }
            _ => ctx.stats.drop_stray_resp += 1,
        }
    }

    /// Build the next queued response.
    pub(super) fn poll_response(&mut self, buf: &mut [u8], ctx: &mut Ctx<'_>) -> Option<Transmit> {
        let r = *self.resp.out.front()?;
        let bth = |op: u8, psn: Psn| {
            BthRepr::new(Opcode::of(WireQpType::Rc, op).expect("RC response opcode"), self.attr.dest_qpn, psn)
        };
        let ack = |msn| AethRepr { syndrome: Syndrome::Ack { credits: CREDITS_INVALID }, msn };
        let mtu = self.attr.mtu.bytes();
        let len = match r {
            Response::Ack { psn, syndrome, msn } => {
                self.resp.out.pop_front();
                self.resp.ack_waited = false;
                emit_acknowledge(buf, DEFAULT_PKEY, self.attr.dest_qpn, psn, &AethRepr { syndrome, msn }).ok()?
            }
            Response::AtomicAck { psn, orig, msn, .. } => {
                self.resp.out.pop_front();
                let mut repr = IbRepr::new(bth(base::ATOMIC_ACKNOWLEDGE, psn));
                repr.aeth = Some(ack(msn));
                repr.atomic_ack_eth = Some(AtomicAckEthRepr { orig });
                repr.emit(buf).ok()?
            }
            Response::Read { psn, va, rkey, remaining, first, msn, dup } => {
                let plen = (remaining as usize).min(mtu);
                let last = remaining as usize <= mtu;
                let op = match (first, last) {
                    (true, true) => base::READ_RESPONSE_ONLY,
                    (true, false) => base::READ_RESPONSE_FIRST,
                    (false, true) => base::READ_RESPONSE_LAST,
                    (false, false) => base::READ_RESPONSE_MIDDLE,
                };
                let mut repr = IbRepr::new(bth(op, psn));
                if first || last {
                    repr.aeth = Some(ack(msn));
                }
                repr.payload_len = plen;
                let n = repr.emit(buf).ok()?;
                let range = repr.payload_range();
                if plen > 0 && ctx.mem.read(self.init.pd, rkey, KeyKind::Remote, va, &mut buf[range]).is_err() {
                    // The region went away between the request and the response.
                    self.request_error(psn, REMOTE_ACCESS, ctx);
                    return self.poll_response(buf, ctx);
                }
                if last {
                    self.resp.out.pop_front();
                } else {
                    self.resp.out.replace_front(Response::Read {
                        psn: psn.next(),
                        va: va.wrapping_add(plen as u64),
                        rkey,
                        remaining: remaining - plen as u32,
                        first: false,
                        msn,
                        dup,
                    });
                }
                ctx.stats.sent_bytes += plen as u64;
                n
            }
        };
        ctx.stats.sent_pkts += 1;
        Some(Transmit { len, av: self.attr.av, src_qpn: self.qpn, dest_qpn: self.attr.dest_qpn, deferred: None })
    }
}

/// Outcome of executing one request packet, when it is not plain success.
enum Step {
    /// No receive WQE: RNR NAK (RC) or drop (UC).
    Rnr,
    /// A responder-detected error.
    Error(RespError),
}
