//! Step-level helpers so scenario tests read as a sequence of verbs and checks: registered regions
//! with guard bytes, work-request builders, exact completion assertions, running to a point in
//! virtual time, and decoded views of the frames the network carried.

use core::time::Duration;

use softrdma_transport::wr::Payload;
use softrdma_transport::{
    Access, AsyncEvent, Instant, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_wire::opcode::Flags;
use softrdma_wire::{IbPacket, Psn, Syndrome};

use crate::net::{Captured, Fate, Net, NodeId};
use crate::pair::Endpoint;

/// Every access right.
pub const ALL_ACCESS: Access =
    Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);

/// A registered region on one node.
#[derive(Debug, Clone, Copy)]
pub struct Mr {
    /// Node.
    pub node: NodeId,
    /// lkey = rkey.
    pub key: u32,
    /// First byte's address.
    pub addr: u64,
    /// Length.
    pub len: usize,
}

impl Mr {
    /// Address of byte `off`.
    pub fn at(&self, off: usize) -> u64 {
        self.addr + off as u64
    }
    /// An SGE over `[off, off+len)`.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge { addr: self.at(off), length: len as u32, lkey: self.key }
    }
}

/// A send WR with `SIGNALED` over the given SGEs.
pub fn wr(wr_id: u64, op: SendOp, sgl: &[Sge]) -> SendWr {
    SendWr { wr_id, op, payload: Payload::Sgl(sgl.into()), flags: SendFlags::SIGNALED, ud: None }
}

/// The same WR without `SIGNALED`.
pub fn unsignaled(mut w: SendWr) -> SendWr {
    w.flags = SendFlags::from_bits(0);
    w
}

/// The same WR with `flag` added.
pub fn flagged(mut w: SendWr, flag: SendFlags) -> SendWr {
    w.flags = w.flags.with(flag);
    w
}

/// A receive WR.
pub fn recv(wr_id: u64, sgl: &[Sge]) -> RecvWr {
    RecvWr { wr_id, sgl: sgl.into() }
}

/// What a completion must be: (wr_id, status, opcode, byte_len).
pub type Expect = (u64, WcStatus, WcOpcode, u32);

/// Assert that `got` is exactly `want`, in order.
#[track_caller]
pub fn assert_wcs(got: &[WorkCompletion], want: &[Expect]) {
    let g: Vec<Expect> = got.iter().map(|w| (w.wr_id, w.status, w.opcode, w.byte_len)).collect();
    assert_eq!(g, want, "completions (wr_id, status, opcode, byte_len)");
}

/// `n` bytes of a recognisable pattern seeded by `seed`.
pub fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

impl Net {
    /// Register `len` bytes on `ep`'s node in its PD, filled with `guard` bytes.
    pub fn reg(&mut self, ep: &Endpoint, len: usize, access: Access, guard: u8) -> Mr {
        let mem = &mut self.nodes[ep.node].mem;
        let (key, addr) = mem.register(ep.pd, len, access);
        mem.region_mut(key).bytes.fill(guard);
        Mr { node: ep.node, key, addr, len }
    }

    /// Copy `data` into `mr` at `off`.
    pub fn fill(&mut self, mr: &Mr, off: usize, data: &[u8]) {
        self.nodes[mr.node].mem.region_mut(mr.key).bytes[off..off + data.len()].copy_from_slice(data);
    }

    /// The contents of `mr`.
    pub fn bytes(&self, mr: &Mr) -> &[u8] {
        &self.nodes[mr.node].mem.region(mr.key).bytes
    }

    /// The 8-byte word at `off` of `mr` (host order).
    pub fn word(&self, mr: &Mr, off: usize) -> u64 {
        u64::from_ne_bytes(self.bytes(mr)[off..off + 8].try_into().expect("8 bytes"))
    }

    /// Process everything due up to `t` (inclusive) and stop the clock at `t`.
    pub fn run_to(&mut self, t: Instant) {
        loop {
            self.transmit_all();
            match self.next_event() {
                Some(at) if at <= t => {
                    self.step();
                }
                _ => break,
            }
        }
        if t > self.now {
            self.now = t;
        }
    }

    /// Run for `d` of virtual time.
    pub fn run_for(&mut self, d: Duration) {
        let t = self.now + d;
        self.run_to(t);
    }

    /// Run until the network is idle (at most an hour of virtual time).
    pub fn settle(&mut self) {
        self.run_idle(Duration::from_secs(3600));
    }

    /// The QP's state.
    pub fn state(&self, ep: &Endpoint) -> QpState {
        self.nodes[ep.node].hca.query_qp(ep.qpn).expect("qp exists").state
    }

    /// Drain the node's async events.
    pub fn events(&mut self, node: NodeId) -> Vec<AsyncEvent> {
        std::iter::from_fn(|| self.nodes[node].hca.poll_event()).collect()
    }

    /// Drain the send CQ of `ep`.
    pub fn send_wcs(&mut self, ep: &Endpoint) -> Vec<WorkCompletion> {
        self.poll(ep.node, ep.scq)
    }

    /// Drain the receive CQ of `ep`.
    pub fn recv_wcs(&mut self, ep: &Endpoint) -> Vec<WorkCompletion> {
        self.poll(ep.node, ep.rcq)
    }

    /// The captured frames, decoded.
    pub fn frames(&self) -> Vec<Frame> {
        self.capture.iter().filter_map(Frame::decode).collect()
    }
}

/// A decoded frame from the capture ring.
#[derive(Debug, Clone)]
pub struct Frame {
    /// When it was sent.
    pub at: Instant,
    /// Sender.
    pub from: NodeId,
    /// Receiver.
    pub to: NodeId,
    /// Opcode base (`softrdma_wire::opcode::base`).
    pub base: u8,
    /// Table flags of the opcode.
    pub flags: Flags,
    /// PSN.
    pub psn: Psn,
    /// AckReq bit.
    pub ack_req: bool,
    /// AETH syndrome, if any.
    pub syndrome: Option<Syndrome>,
    /// AETH MSN, if any.
    pub msn: Option<u32>,
    /// RETH (va, rkey, dma_len), if any.
    pub reth: Option<(u64, u32, u32)>,
    /// Payload length.
    pub payload_len: usize,
    /// What became of it.
    pub fate: Fate,
    /// The raw frame.
    pub raw: Vec<u8>,
}

impl Frame {
    /// Decode a captured frame (None if it does not parse).
    pub fn decode(c: &Captured) -> Option<Frame> {
        let p = IbPacket::new_checked(&c.frame[..]).ok()?;
        let bth = p.bth();
        Some(Frame {
            at: c.at,
            from: c.from,
            to: c.to,
            base: bth.opcode().base(),
            flags: p.info().flags,
            psn: bth.psn(),
            ack_req: bth.ack_req(),
            syndrome: p.aeth().map(|a| a.syndrome()),
            msn: p.aeth().map(|a| a.msn()),
            reth: p.reth().map(|r| (r.va(), r.rkey(), r.dma_len())),
            payload_len: p.payload().len(),
            fate: c.fate,
            raw: c.frame.clone(),
        })
    }

    /// A request (not a response).
    pub fn is_request(&self) -> bool {
        !self.flags.contains(Flags::RESP)
    }

    /// The opcode has flag `f`.
    pub fn is(&self, f: Flags) -> bool {
        self.flags.contains(f)
    }
}

/// One nanosecond before `t`.
pub fn just_before(t: Instant) -> Instant {
    Instant::from_nanos(t.as_nanos() - 1)
}
