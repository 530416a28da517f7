//! A seeded workload of mixed operations between two connected QPs, with its own checker:
//! every byte that lands is compared with what was sent, every completion with what was posted.

use core::time::Duration;

use softrdma_transport::wr::Payload;
use softrdma_transport::{
    Access, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList, WcOpcode, WcStatus, WorkCompletion,
};

use crate::net::Net;
use crate::pair::Endpoint;
use crate::rng::Rng;

/// Kinds of operation in a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// SEND.
    Send,
    /// SEND with immediate.
    SendImm,
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate.
    WriteImm,
    /// RDMA READ.
    Read,
    /// Fetch-and-add.
    FetchAdd,
    /// Compare-and-swap.
    CmpSwap,
}

/// One planned operation.
#[derive(Debug, Clone)]
pub struct Op {
    /// Kind.
    pub kind: OpKind,
    /// Length in bytes.
    pub len: u32,
    /// Offset of its area in A's and B's data regions.
    pub off: u64,
}

/// A planned workload and where its memory lives.
pub struct Workload {
    /// Operations in posting order.
    pub ops: Vec<Op>,
    a_node: usize,
    b_node: usize,
    a_key: u32,
    a_addr: u64,
    b_key: u32,
    b_addr: u64,
    /// Size of each data region.
    pub span: u64,
}

/// Sizes from 0 B to `max`, mostly small: a realistic mix with a long tail.
fn pick_len(rng: &mut Rng, max: u32) -> u32 {
    let class = rng.below(100);
    let cap = match class {
        0..=39 => 64,
        40..=69 => 4096,
        70..=94 => 65536,
        _ => 1 << 20,
    };
    (rng.below(u64::from(cap.min(max)) + 1)) as u32
}

impl Workload {
    /// Plan `n` operations of the kinds the QP type allows, plus one of `big` bytes (0 = none),
    /// register and fill memory on both nodes, and post receives on B for every SEND and WRITE
    /// with immediate.
    pub fn plan(net: &mut Net, a: &Endpoint, b: &Endpoint, qp_type: QpType, n: usize, big: u32, max: u32) -> Workload {
        let mut rng = net.rng().clone();
        let kinds: &[OpKind] = match qp_type {
            QpType::Rc => &[
                OpKind::Send,
                OpKind::SendImm,
                OpKind::Write,
                OpKind::WriteImm,
                OpKind::Read,
                OpKind::FetchAdd,
                OpKind::CmpSwap,
            ],
            QpType::Uc => &[OpKind::Send, OpKind::SendImm, OpKind::Write, OpKind::WriteImm],
            QpType::Ud => &[OpKind::Send, OpKind::SendImm],
        };
        let mut ops = Vec::with_capacity(n + 1);
        let mut off = 0u64;
        for i in 0..n + usize::from(big > 0) {
            let kind = kinds[rng.below(kinds.len() as u64) as usize];
            let len = match kind {
                OpKind::FetchAdd | OpKind::CmpSwap => 8,
                _ if i == n => big,
                _ => pick_len(&mut rng, max),
            };
            ops.push(Op { kind, len, off });
            off += (u64::from(len) + 8 + 63) & !63;
        }
        let span = off.max(64);
        let rights =
            Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);
        let (a_key, a_addr) = net.nodes[a.node].mem.register(a.pd, span as usize, rights);
        let (b_key, b_addr) = net.nodes[b.node].mem.register(b.pd, span as usize, rights);
        rng.fill(&mut net.nodes[a.node].mem.region_mut(a_key).bytes);
        rng.fill(&mut net.nodes[b.node].mem.region_mut(b_key).bytes);
        let w = Workload { ops, a_node: a.node, b_node: b.node, a_key, a_addr, b_key, b_addr, span };
        for (i, op) in w.ops.iter().enumerate() {
            if matches!(op.kind, OpKind::Send | OpKind::SendImm | OpKind::WriteImm) {
                let sgl = if op.kind == OpKind::WriteImm {
                    vec![]
                } else {
                    vec![Sge { addr: b_addr + op.off, length: op.len.max(1), lkey: b_key }]
                };
                net.post_recv(b, RecvWr { wr_id: i as u64, sgl: sgl.into() }).expect("post recv");
            }
        }
        net.rng().clone_from(&rng);
        w
    }

    /// Zero B's compare-and-swap targets so their expected value is known (done by `run`).
    pub fn prepare(&self, net: &mut Net) {
        for op in self.ops.iter().filter(|o| o.kind == OpKind::CmpSwap) {
            net.nodes[self.b_node].mem.region_mut(self.b_key).bytes[op.off as usize..op.off as usize + 8].fill(0);
        }
    }

    /// The send WR of operation `i` (posted on A).
    pub fn wr(&self, i: usize) -> SendWr {
        let op = &self.ops[i];
        let local = Sge { addr: self.a_addr + op.off, length: op.len, lkey: self.a_key };
        let remote = self.b_addr + op.off;
        let rkey = self.b_key;
        let op_ = match op.kind {
            OpKind::Send => SendOp::Send,
            OpKind::SendImm => SendOp::SendWithImm(i as u32),
            OpKind::Write => SendOp::Write { remote_addr: remote, rkey },
            OpKind::WriteImm => SendOp::WriteWithImm { remote_addr: remote, rkey, imm: i as u32 },
            OpKind::Read => SendOp::Read { remote_addr: remote, rkey },
            OpKind::FetchAdd => SendOp::FetchAdd { remote_addr: remote, rkey, add: i as u64 },
            OpKind::CmpSwap => SendOp::CompareSwap { remote_addr: remote, rkey, compare: 0, swap: i as u64 },
        };
        SendWr {
            wr_id: i as u64,
            op: op_,
            payload: Payload::Sgl(SgeList::one(local)),
            flags: SendFlags::SIGNALED,
            ud: None,
        }
    }

    /// Post everything (as the send queue has room) and run until all completions are in, or
    /// `limit` virtual time passes. Returns the send and receive completions.
    pub fn run(
        &self,
        net: &mut Net,
        a: &Endpoint,
        b: &Endpoint,
        depth: usize,
        limit: Duration,
    ) -> (Vec<WorkCompletion>, Vec<WorkCompletion>) {
        // Atomics target words whose value we know: make B's word 0 for CAS, keep it for FA.
        self.prepare(net);
        let mut next = 0;
        let mut scq = Vec::new();
        let mut rcq = Vec::new();
        let end = net.now + limit;
        while scq.len() < self.ops.len() && net.now <= end {
            while next < self.ops.len() && next - scq.len() < depth {
                net.post_send(a, self.wr(next)).expect("post send");
                next += 1;
            }
            if !net.step() && next == self.ops.len() {
                break;
            }
            scq.extend(net.poll(a.node, a.scq));
            rcq.extend(net.poll(b.node, b.rcq));
        }
        net.run_idle(Duration::from_millis(100));
        rcq.extend(net.poll(b.node, b.rcq));
        (scq, rcq)
    }

    /// Check completions and memory: every op succeeded, completions arrived in order, every byte
    /// is where it should be. `before_a`/`before_b` are the region contents before the run.
    pub fn check(
        &self,
        net: &Net,
        scq: &[WorkCompletion],
        rcq: &[WorkCompletion],
        before_a: &[u8],
        before_b: &[u8],
    ) -> Result<(), String> {
        if scq.len() != self.ops.len() {
            return Err(format!("{} of {} send completions", scq.len(), self.ops.len()));
        }
        for (i, wc) in scq.iter().enumerate() {
            if wc.wr_id != i as u64 || wc.status != WcStatus::Success {
                return Err(format!("send completion {i}: {wc:?}"));
            }
        }
        let a_now = &self.region(net, true);
        let b_now = &self.region(net, false);
        let mut recv_i = 0;
        for (i, op) in self.ops.iter().enumerate() {
            let r = op.off as usize..(op.off + u64::from(op.len)) as usize;
            match op.kind {
                OpKind::Send | OpKind::SendImm | OpKind::WriteImm => {
                    let wc = rcq.get(recv_i).ok_or(format!("missing receive completion for op {i}"))?;
                    recv_i += 1;
                    let want_op = if op.kind == OpKind::WriteImm { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
                    if wc.wr_id != i as u64
                        || wc.status != WcStatus::Success
                        || wc.opcode != want_op
                        || wc.byte_len != op.len
                    {
                        return Err(format!("receive completion for op {i} ({op:?}): {wc:?}"));
                    }
                    if op.kind != OpKind::Send && wc.imm != i as u32 {
                        return Err(format!("op {i}: immediate {:#x}", wc.imm));
                    }
                    if b_now[r.clone()] != before_a[r.clone()] {
                        return Err(format!("op {i} ({op:?}): data differs at B"));
                    }
                }
                OpKind::Write => {
                    if b_now[r.clone()] != before_a[r.clone()] {
                        return Err(format!("op {i} ({op:?}): written data differs at B"));
                    }
                }
                OpKind::Read => {
                    if a_now[r.clone()] != before_b[r.clone()] {
                        return Err(format!("op {i} ({op:?}): read data differs at A"));
                    }
                }
                OpKind::FetchAdd => {
                    let orig = u64::from_ne_bytes(before_b[r.clone()].try_into().unwrap());
                    let got = u64::from_ne_bytes(a_now[r.clone()].try_into().unwrap());
                    let now = u64::from_ne_bytes(b_now[r.clone()].try_into().unwrap());
                    if got != orig || now != orig.wrapping_add(i as u64) {
                        return Err(format!("op {i}: fetch-add orig {got:#x} (want {orig:#x}), now {now:#x}"));
                    }
                }
                OpKind::CmpSwap => {
                    let got = u64::from_ne_bytes(a_now[r.clone()].try_into().unwrap());
                    let now = u64::from_ne_bytes(b_now[r.clone()].try_into().unwrap());
                    if got != 0 || now != i as u64 {
                        return Err(format!("op {i}: compare-swap orig {got:#x}, now {now:#x}"));
                    }
                }
            }
        }
        if recv_i != rcq.len() {
            return Err(format!("{} unexpected receive completions", rcq.len() - recv_i));
        }
        Ok(())
    }

    /// Contents of A's (`true`) or B's data region.
    pub fn region<'n>(&self, net: &'n Net, a_side: bool) -> &'n [u8] {
        let (node, key) = if a_side { (self.a_node, self.a_key) } else { (self.b_node, self.b_key) };
        &net.nodes[node].mem.region(key).bytes
    }
}
