//! Direct execution between two QPs of one HCA (`Hca::set_local_gids`, transport `hca/direct.rs`):
//! the same work, run once with it and once without it (every packet looped back into the same
//! HCA), must end in the same completions on every CQ, the same memory, the same QP states and
//! PSNs and the same async events; with it, the small requests it can take produce no packet.

use softrdma_sim::memory::SimMemory;
use softrdma_sim::rng::Rng;
use softrdma_transport::attr::QpCap;
use softrdma_transport::wr::Payload;
use softrdma_transport::{
    Access, AddressVector, AsyncEvent, Config, CqId, Hca, Instant, ModifyQp, Mtu, PdId, QpInit, QpState, QpType,
    RecvWr, RxInfo, SendFlags, SendOp, SendWr, Sge, SgeList, SrqId, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_wire::{Psn, Qpn};

/// The HCA's own GID (IPv4 127.0.0.1, mapped).
const OWN: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1];
const REGION: usize = 1 << 16;
const PD: PdId = PdId(1);

/// One side's objects: a QP with its own send and receive CQ, a region it sends from (filled
/// with a pattern), one it lets the peer write and read, one its receives land in, one the peer
/// may only read (filled with a pattern, never written), and one for the peer's atomics.
#[derive(Clone, Copy)]
struct Side {
    qpn: Qpn,
    send_cq: CqId,
    recv_cq: CqId,
    src: (u32, u64),
    target: (u32, u64),
    recv: (u32, u64),
    read_only: (u32, u64),
    atomic: (u32, u64),
}

struct Node {
    hca: Hca,
    mem: SimMemory,
    srq: Option<SrqId>,
    sides: [Side; 2],
    now: Instant,
    /// Packets the engine produced (and that were handed back to it).
    packets: u64,
    /// Completions taken so far, per CQ (send and receive CQ of each side, in that order).
    wcs: [Vec<WorkCompletion>; 4],
    /// Async events, in order.
    events: Vec<AsyncEvent>,
}

impl Node {
    /// Two connected QPs; with `srq`, side 1 takes its receives from an SRQ armed at 3; with
    /// `rtr`, side 1 stays in RTR (it only receives).
    fn new(direct: bool, srq: bool, rtr: bool) -> Node {
        let mut hca = Hca::new(Config::default());
        if direct {
            hca.set_local_gids(&[OWN]);
        }
        let mut mem = SimMemory::new();
        let srq = srq.then(|| hca.create_srq(64, 2));
        let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
        let mut side = |hca: &mut Hca, seed: u8| {
            let (send_cq, recv_cq) = (hca.create_cq(4096), hca.create_cq(4096));
            // Side 1 takes its receives from the SRQ, if there is one: one QP per SRQ, so that which
            // receive a message takes does not depend on when the other QP's messages arrive.
            let srq = srq.filter(|_| seed == 2);
            let init = QpInit { qp_type: QpType::Rc, pd: PD, send_cq, recv_cq, srq, cap, sq_sig_all: false };
            let qpn = hca.create_qp(init).unwrap();
            let src = mem.register(PD, REGION, Access::LOCAL_WRITE);
            for (i, b) in mem.region_mut(src.0).bytes.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(7).wrapping_add(seed);
            }
            let rights = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ);
            let target = mem.register(PD, REGION, rights);
            let recv = mem.register(PD, REGION, Access::LOCAL_WRITE);
            let read_only = mem.register(PD, 0x4000, Access::LOCAL_WRITE.with(Access::REMOTE_READ));
            for (i, b) in mem.region_mut(read_only.0).bytes.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(11).wrapping_add(seed);
            }
            let atomic = mem.register(PD, 64, Access::LOCAL_WRITE.with(Access::REMOTE_ATOMIC));
            Side { qpn, send_cq, recv_cq, src, target, recv, read_only, atomic }
        };
        let sides = [side(&mut hca, 1), side(&mut hca, 2)];
        let mut n =
            Node { hca, mem, srq, sides, now: Instant::ZERO, packets: 0, wcs: Default::default(), events: vec![] };
        for (me, peer) in [(0, 1), (1, 0)] {
            n.connect(me, peer, rtr && me == 1);
        }
        if let Some(srq) = srq {
            n.hca.arm_srq(srq, 3).unwrap();
        }
        n
    }

    /// Bring side `me` to RTS (RTR if `rtr`), connected to side `peer` through the HCA's own GID.
    fn connect(&mut self, me: usize, peer: usize, rtr: bool) {
        let (qpn, dest) = (self.sides[me].qpn, self.sides[peer].qpn);
        let psn = |s: usize| Psn::new(0x00ff_fff0 + s as u32); // both PSN spaces wrap in the run
        let steps = [
            ModifyQp {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(1),
                access: Some(Access::REMOTE_WRITE.with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC)),
                ..Default::default()
            },
            ModifyQp {
                state: Some(QpState::Rtr),
                av: Some(AddressVector { dgid: OWN, ..AddressVector::default() }),
                path_mtu: Some(Mtu::M1024),
                dest_qpn: Some(dest),
                rq_psn: Some(psn(peer)),
                max_dest_rd_atomic: Some(4),
                min_rnr_timer: Some(1),
                ..Default::default()
            },
            ModifyQp {
                state: Some(QpState::Rts),
                sq_psn: Some(psn(me)),
                timeout: Some(14),
                retry_cnt: Some(7),
                rnr_retry: Some(7),
                max_rd_atomic: Some(4),
                ..Default::default()
            },
        ];
        for m in &steps[..if rtr { 2 } else { 3 }] {
            self.hca.modify_qp(qpn, m, self.now, &mut self.mem).unwrap();
        }
    }

    fn post_recv(&mut self, side: usize, wr_id: u64, len: u32) {
        let (key, addr) = self.sides[side].recv;
        // Two SGEs: the receive lands in two pieces.
        let half = len / 2;
        let mut sgl = SgeList::one(Sge { addr: addr + 64 * (wr_id % 256), length: half, lkey: key });
        sgl.push(Sge { addr: addr + 0x8000 + 64 * (wr_id % 256), length: len - half, lkey: key });
        let wr = RecvWr { wr_id, sgl };
        let qpn = self.sides[side].qpn;
        match self.srq.filter(|_| side == 1) {
            Some(srq) => self.hca.post_srq_recv(srq, wr).unwrap(),
            None => self.hca.post_recv(qpn, wr, self.now, &mut self.mem).unwrap(),
        }
    }

    fn post(&mut self, side: usize, wr: SendWr) {
        let qpn = self.sides[side].qpn;
        self.hca.post_send(qpn, wr, self.now, &mut self.mem).unwrap();
    }

    /// Hand every packet the engine has back to it (the loopback), without moving the clock.
    fn deliver(&mut self) {
        let mut buf = vec![0u8; 4096 + 128];
        while let Some(t) = self.hca.poll_transmit(self.now, &mut self.mem, &mut buf) {
            assert!(t.deferred.is_none());
            self.packets += 1;
            self.hca.handle_packet(self.now, &buf[..t.len], &RxInfo { grh: [0; 40] }, &mut self.mem);
        }
    }

    /// Hand the next packet the engine has back to it, if there is one.
    fn deliver_one(&mut self) {
        let mut buf = vec![0u8; 4096 + 128];
        if let Some(t) = self.hca.poll_transmit(self.now, &mut self.mem, &mut buf) {
            self.packets += 1;
            self.hca.handle_packet(self.now, &buf[..t.len], &RxInfo { grh: [0; 40] }, &mut self.mem);
        }
    }

    /// Deliver packets and fire timers until nothing is left to do.
    fn settle(&mut self) {
        for _ in 0..100_000 {
            self.deliver();
            match self.hca.poll_timeout() {
                Some(at) => {
                    self.now = self.now.max(at);
                    self.hca.handle_timeout(self.now, &mut self.mem);
                }
                None => break,
            }
        }
        assert!(self.hca.poll_timeout().is_none() && !self.hca.has_transmit(), "the engine did not settle");
        self.take_wcs();
    }

    fn take_wcs(&mut self) {
        for (i, cq) in self.sides.iter().flat_map(|s| [s.send_cq, s.recv_cq]).enumerate() {
            let mut out = Vec::new();
            self.hca.poll_cq(cq, usize::MAX, &mut out).unwrap();
            self.wcs[i].extend(out);
        }
        while let Some(e) = self.hca.poll_event() {
            self.events.push(e);
        }
    }
}

/// Completions per CQ, region contents, per QP its state, send and receive PSNs, send WQEs
/// outstanding and receives posted, and the async events.
type Outcome = (Vec<Vec<WorkCompletion>>, Vec<Vec<u8>>, Vec<(QpState, Psn, Psn, u32, u32)>, Vec<AsyncEvent>);

/// One step of a script.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Post a receive of `len` bytes (two SGEs) on `side` (or the SRQ).
    Recv { side: usize, len: u32 },
    /// SEND `len` bytes from `side`'s source region (inline when asked and short enough).
    Send { side: usize, len: u32, imm: bool, inline: bool, signaled: bool },
    /// RDMA WRITE `len` bytes into the peer's target region.
    Write { side: usize, len: u32, imm: bool, signaled: bool },
    /// RDMA WRITE into the peer's region that has no remote-write right.
    WriteReadOnly { side: usize },
    /// SEND from an SGE with a key that does not exist.
    SendBadLkey { side: usize },
    /// RDMA READ `len` bytes of the peer's read-only region.
    Read { side: usize, len: u32 },
    /// RDMA READ from the peer's receive region, which has no remote-read right.
    ReadNoRight { side: usize },
    /// An atomic on a word of the peer's atomic region (compare-and-swap or fetch-and-add), or on
    /// an address that is not 8-byte aligned.
    Atomic { side: usize, cas: bool, aligned: bool },
    /// RDMA WRITE `len` bytes at `offset` of the peer's target region.
    WriteAt { side: usize, len: u32, offset: u64 },
    /// SEND from one empty SGE whose key does not exist.
    SendEmptyBadLkey { side: usize },
    /// Hand the packets waiting back to the engine, without moving the clock.
    Deliver,
    /// Hand the next packet back to the engine.
    DeliverOne,
    /// Deliver and fire timers until nothing is left.
    Settle,
}

use Op::*;

impl Node {
    fn apply(&mut self, op: Op, wr_id: u64) {
        let flags = |signaled: bool| if signaled { SendFlags::SIGNALED } else { SendFlags::NONE };
        match op {
            Recv { side, len } => self.post_recv(side, wr_id, len),
            Send { side, len, imm, inline, signaled } => {
                let payload = if inline && len <= 64 {
                    let (key, addr) = self.sides[side].src;
                    let at = (addr - self.mem.region(key).addr) as usize + (wr_id as usize * 13) % 1024;
                    Payload::Inline(self.mem.region(key).bytes[at..at + len as usize].to_vec())
                } else {
                    self.source(side, wr_id, len)
                };
                let op = if imm { SendOp::SendWithImm(wr_id as u32 ^ 0xabcd_0000) } else { SendOp::Send };
                self.post(side, SendWr { wr_id, op, payload, flags: flags(signaled), ud: None });
            }
            Write { side, len, imm, signaled } => {
                let (rkey, base) = self.sides[1 - side].target;
                // Over the place READs land in as well (0x8000..0xc000).
                let remote_addr = base + (wr_id * 64) % (0xc000 - 0x1000);
                let op = if imm {
                    SendOp::WriteWithImm { remote_addr, rkey, imm: wr_id as u32 }
                } else {
                    SendOp::Write { remote_addr, rkey }
                };
                let payload = self.source(side, wr_id, len);
                self.post(side, SendWr { wr_id, op, payload, flags: flags(signaled), ud: None });
            }
            WriteReadOnly { side } => {
                let (rkey, remote_addr) = self.sides[1 - side].read_only;
                let payload = self.source(side, wr_id, 16);
                let op = SendOp::Write { remote_addr, rkey };
                self.post(side, SendWr { wr_id, op, payload, flags: SendFlags::SIGNALED, ud: None });
            }
            SendBadLkey { side } => {
                let (_, addr) = self.sides[side].src;
                let payload = Payload::Sgl(SgeList::one(Sge { addr, length: 16, lkey: 0xdead_0000 }));
                self.post(side, SendWr { wr_id, op: SendOp::Send, payload, flags: SendFlags::SIGNALED, ud: None });
            }
            Read { side, len } => {
                let (rkey, base) = self.sides[1 - side].read_only;
                let remote_addr = base + (wr_id * 32) % (0x4000 - u64::from(len)).max(1);
                self.read(side, wr_id, rkey, remote_addr, len);
            }
            ReadNoRight { side } => {
                let (rkey, remote_addr) = self.sides[1 - side].recv;
                self.read(side, wr_id, rkey, remote_addr, 16);
            }
            Atomic { side, cas, aligned } => {
                let (rkey, base) = self.sides[1 - side].atomic;
                let remote_addr = base + (wr_id % 4) * 8 + u64::from(!aligned) * 4;
                let op = if cas {
                    SendOp::CompareSwap { remote_addr, rkey, compare: wr_id & 1, swap: wr_id << 8 }
                } else {
                    SendOp::FetchAdd { remote_addr, rkey, add: wr_id }
                };
                let (lkey, local) = self.sides[side].target;
                let sge = Sge { addr: local + 0xc000 + (wr_id % 512) * 8, length: 8, lkey };
                let payload = Payload::Sgl(SgeList::one(sge));
                self.post(side, SendWr { wr_id, op, payload, flags: SendFlags::SIGNALED, ud: None });
            }
            WriteAt { side, len, offset } => {
                let (rkey, base) = self.sides[1 - side].target;
                let op = SendOp::Write { remote_addr: base + offset, rkey };
                let payload = self.source(side, wr_id, len);
                self.post(side, SendWr { wr_id, op, payload, flags: SendFlags::SIGNALED, ud: None });
            }
            SendEmptyBadLkey { side } => {
                let (_, addr) = self.sides[side].src;
                let payload = Payload::Sgl(SgeList::one(Sge { addr, length: 0, lkey: 0xdead_0000 }));
                self.post(side, SendWr { wr_id, op: SendOp::Send, payload, flags: SendFlags::SIGNALED, ud: None });
            }
            Deliver => self.deliver(),
            DeliverOne => self.deliver_one(),
            Settle => self.settle(),
        }
    }

    /// A signaled RDMA READ of `len` bytes at `remote_addr` under `rkey` into `side`'s target region.
    fn read(&mut self, side: usize, wr_id: u64, rkey: u32, remote_addr: u64, len: u32) {
        let (lkey, local) = self.sides[side].target;
        let sge = Sge { addr: local + 0x8000 + (wr_id * 32) % 0x4000, length: len, lkey };
        let op = SendOp::Read { remote_addr, rkey };
        self.post(
            side,
            SendWr { wr_id, op, payload: Payload::Sgl(SgeList::one(sge)), flags: SendFlags::SIGNALED, ud: None },
        );
    }

    /// `len` bytes of `side`'s source region, in two SGEs when there are two bytes or more.
    fn source(&self, side: usize, wr_id: u64, len: u32) -> Payload {
        let (lkey, addr) = self.sides[side].src;
        let at = addr + (wr_id * 13) % 1024;
        let first = len / 3;
        let mut sgl = SgeList::one(Sge { addr: at, length: first, lkey });
        if len - first > 0 {
            sgl.push(Sge { addr: at + u64::from(first) + 100, length: len - first, lkey });
        }
        Payload::Sgl(sgl)
    }

    /// Everything a run leaves behind that the two runs must agree on.
    fn outcome(&self) -> Outcome {
        let regions = self
            .sides
            .iter()
            .flat_map(|s| [s.src, s.target, s.recv, s.read_only, s.atomic])
            .map(|(key, _)| self.mem.region(key).bytes.clone())
            .collect();
        let qps = self
            .sides
            .iter()
            .map(|s| {
                let q = self.hca.query_qp(s.qpn).unwrap();
                (q.state, q.sq_psn, q.rq_psn, q.sq_outstanding, q.rq_posted)
            })
            .collect();
        (self.wcs.to_vec(), regions, qps, self.events.clone())
    }
}

/// Run `script` (then settle) with direct execution on or off.
fn run(direct: bool, srq: bool, rtr: bool, script: &[Op]) -> Node {
    let mut n = Node::new(direct, srq, rtr);
    for (i, op) in script.iter().enumerate() {
        n.apply(*op, i as u64 + 1);
    }
    n.settle();
    n
}

/// Run `script` both ways and check that they agree; returns (direct run, packet run).
fn same_both_ways(srq: bool, script: &[Op]) -> (Node, Node) {
    same_both_ways_from(srq, false, script)
}

/// [`same_both_ways`], with side 1 left in RTR if `rtr`.
fn same_both_ways_from(srq: bool, rtr: bool, script: &[Op]) -> (Node, Node) {
    let (d, p) = (run(true, srq, rtr, script), run(false, srq, rtr, script));
    let (od, op) = (d.outcome(), p.outcome());
    for (i, (a, b)) in od.0.iter().zip(&op.0).enumerate() {
        assert_eq!(a, b, "CQ {i} (send/recv of side 0, then of side 1) differs; script {script:?}");
    }
    assert!(od.1 == op.1, "memory differs; script {script:?}");
    assert_eq!(od.2, op.2, "QP states or PSNs differ; script {script:?}");
    assert_eq!(od.3, op.3, "async events differ; script {script:?}");
    (d, p)
}

#[test]
fn small_requests_of_every_kind_complete_at_post_with_no_packet() {
    let mut n = Node::new(true, false, false);
    let (a, b) = (n.sides[0], n.sides[1]);
    // A post to a QP that does not exist is refused, and changes nothing for the others.
    let wr = SendWr { wr_id: 0, op: SendOp::Send, payload: Payload::Inline(vec![1]), flags: SendFlags::NONE, ud: None };
    assert_eq!(n.hca.post_send(Qpn::new(0x999), wr, n.now, &mut n.mem), Err(VerbsError::NoSuchObject));
    n.apply(Recv { side: 1, len: 256 }, 1);
    n.apply(Send { side: 0, len: 200, imm: true, inline: false, signaled: true }, 2);
    n.apply(Write { side: 0, len: 100, imm: false, signaled: true }, 3);
    // Completed at post: nothing was sent.
    n.take_wcs();
    n.deliver();
    assert_eq!(n.packets, 0);
    let recv = &n.wcs[3];
    assert_eq!(recv.len(), 1);
    assert_eq!((recv[0].wr_id, recv[0].status, recv[0].opcode), (1, WcStatus::Success, WcOpcode::Recv));
    assert_eq!((recv[0].byte_len, recv[0].imm, recv[0].qp_num), (200, 2 ^ 0xabcd_0000, b.qpn));
    let sent: Vec<_> = n.wcs[0].iter().map(|w| (w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num)).collect();
    assert_eq!(
        sent,
        [(2, WcStatus::Success, WcOpcode::Send, 200, a.qpn), (3, WcStatus::Success, WcOpcode::RdmaWrite, 100, a.qpn)]
    );
    // The payloads, byte for byte: the SEND in the receive's two pieces, the WRITE at its address.
    let src = &n.mem.region(a.src.0).bytes;
    let sent_send: Vec<u8> = [&src[26..26 + 66], &src[26 + 66 + 100..26 + 200 + 100]].concat();
    let rcv = &n.mem.region(b.recv.0).bytes;
    assert_eq!([&rcv[64..64 + 128], &rcv[0x8000 + 64..0x8000 + 64 + 128]].concat()[..200], sent_send[..]);
    let sent_write: Vec<u8> = [&src[39..39 + 33], &src[39 + 33 + 100..39 + 100 + 100]].concat();
    assert_eq!(&n.mem.region(b.target.0).bytes[192..292], &sent_write[..]);
    // Both PSN spaces moved on by one packet per message.
    assert_eq!(n.hca.query_qp(a.qpn).unwrap().sq_psn, Psn::new(0x00ff_fff0).add(2));
    assert_eq!(n.hca.query_qp(b.qpn).unwrap().rq_psn, Psn::new(0x00ff_fff0).add(2));
    assert_eq!(n.hca.take_direct().map(|m| (m.requester, m.responder, m.len)), Some((a.qpn, b.qpn, 100)));
    assert_eq!(n.hca.counters().sent_pkts, 2);
    assert_eq!(n.hca.counters().rcvd_pkts, 2);
    // A READ and two atomics of side 0: their results in its SGEs at once.
    n.apply(Read { side: 0, len: 100 }, 4);
    n.apply(Atomic { side: 0, cas: false, aligned: true }, 5);
    n.apply(Atomic { side: 0, cas: true, aligned: true }, 9);
    n.take_wcs();
    n.deliver();
    assert_eq!(n.packets, 0);
    let done: Vec<_> = n.wcs[0][2..].iter().map(|w| (w.wr_id, w.status, w.opcode, w.byte_len)).collect();
    assert_eq!(
        done,
        [
            (4, WcStatus::Success, WcOpcode::RdmaRead, 100),
            (5, WcStatus::Success, WcOpcode::FetchAdd, 8),
            (9, WcStatus::Success, WcOpcode::CompSwap, 8)
        ]
    );
    let (peer_ro, mine) = (&n.mem.region(b.read_only.0).bytes, &n.mem.region(a.target.0).bytes);
    assert_eq!(&mine[0x8000 + 128..0x8000 + 228], &peer_ro[128..228]);
    // Word 1 (wr_id 5 and 9 both land on it): 0, +5 = 5; compare 1 against 5 fails, so it stays 5.
    let word = |bytes: &[u8], at: usize| u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap());
    assert_eq!(word(&n.mem.region(b.atomic.0).bytes, 8), 5);
    assert_eq!((word(mine, 0xc000 + 5 * 8), word(mine, 0xc000 + 9 * 8)), (0, 5));
    n.settle();
    assert_eq!(n.packets, 0);
}

#[test]
fn scripted_work_ends_the_same_with_and_without_direct_execution() {
    let script = [
        Recv { side: 1, len: 4096 },
        Recv { side: 1, len: 4096 },
        Recv { side: 0, len: 4096 },
        // Executed directly.
        Send { side: 0, len: 8, imm: false, inline: true, signaled: true },
        Send { side: 0, len: 0, imm: true, inline: false, signaled: false },
        Write { side: 0, len: 1024, imm: false, signaled: true },
        Write { side: 1, len: 64, imm: true, signaled: true },
        // A WRITE of three packets, then small requests behind it: they must not overtake it.
        Write { side: 0, len: 3000, imm: false, signaled: true },
        Write { side: 0, len: 16, imm: false, signaled: true },
        Deliver,
        Recv { side: 1, len: 4096 },
        Send { side: 0, len: 1000, imm: true, inline: false, signaled: true },
        // A READ, then a small WRITE behind it.
        Read { side: 0, len: 2500 },
        Write { side: 0, len: 32, imm: false, signaled: true },
        Settle,
        Recv { side: 1, len: 64 },
        Recv { side: 1, len: 4096 },
        Send { side: 0, len: 64, imm: false, inline: true, signaled: true },
        Send { side: 0, len: 4000, imm: false, inline: false, signaled: true },
        Write { side: 1, len: 512, imm: false, signaled: false },
        Send { side: 1, len: 100, imm: false, inline: false, signaled: true },
        Recv { side: 0, len: 4096 },
        Settle,
        // READs and atomics of one packet, executed directly, then behind a queued WRITE.
        Read { side: 0, len: 1000 },
        Read { side: 1, len: 0 },
        Atomic { side: 0, cas: false, aligned: true },
        Atomic { side: 0, cas: true, aligned: true },
        Atomic { side: 1, cas: true, aligned: true },
        Write { side: 0, len: 2048, imm: false, signaled: true },
        Atomic { side: 0, cas: false, aligned: true },
        Read { side: 0, len: 64 },
        Read { side: 0, len: 3000 },
    ];
    for srq in [false, true] {
        let (d, p) = same_both_ways(srq, &script);
        assert!(d.packets < p.packets, "direct {} packets, plain {}", d.packets, p.packets);
        assert!(d.wcs[0].iter().chain(&d.wcs[2]).all(|w| w.status == WcStatus::Success));
    }
}

#[test]
fn requests_that_would_fail_take_the_packet_path() {
    // A SEND with no receive posted (RNR; the receive comes before the retry), one longer than its
    // receive, a WRITE into a region without the remote-write right, a SEND from a bad lkey.
    let scripts: [&[Op]; 7] = [
        &[Send { side: 0, len: 10, imm: false, inline: false, signaled: true }, Deliver, Recv { side: 1, len: 64 }],
        &[Recv { side: 1, len: 64 }, Send { side: 0, len: 100, imm: false, inline: false, signaled: true }],
        &[WriteReadOnly { side: 0 }, Send { side: 0, len: 10, imm: false, inline: false, signaled: true }],
        &[Recv { side: 1, len: 64 }, SendBadLkey { side: 0 }],
        &[ReadNoRight { side: 0 }, Read { side: 0, len: 8 }],
        &[Atomic { side: 1, cas: false, aligned: false }, Atomic { side: 1, cas: true, aligned: true }],
        &[Recv { side: 1, len: 64 }, SendEmptyBadLkey { side: 0 }],
    ];
    let want = [
        WcStatus::Success,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::LocProtErr,
        WcStatus::RemAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::LocProtErr,
    ];
    for (script, want) in scripts.iter().zip(want) {
        let (d, _) = same_both_ways(false, script);
        let sent = d.wcs[0].iter().chain(&d.wcs[2]).next();
        assert_eq!(sent.map(|w| w.status), Some(want), "{script:?}");
        if want != WcStatus::LocProtErr {
            assert!(d.packets > 0, "{script:?} took the packet path");
        }
    }
}

#[test]
fn a_request_does_not_overtake_the_responses_its_qp_owes() {
    // Side 1 READs 2,500 bytes of side 0 into its target at 0x8020; only the request is delivered,
    // so side 0 owes the response when it WRITEs 100 bytes to that same place: the response goes
    // first, the WRITE lands over it.
    let script = [Read { side: 1, len: 2500 }, DeliverOne, WriteAt { side: 0, len: 100, offset: 0x8020 }];
    let (d, _) = same_both_ways(false, &script);
    let (src, target) = (&d.mem.region(d.sides[0].src.0).bytes, &d.mem.region(d.sides[1].target.0).bytes);
    let written: Vec<u8> = [&src[39..39 + 33], &src[39 + 33 + 100..39 + 100 + 100]].concat();
    assert_eq!(&target[0x8020..0x8020 + 100], &written[..]);
}

#[test]
fn a_responder_in_rtr_raises_comm_established_first() {
    // Side 1 in RTR, its SRQ armed at 3 with 3 receives: the first SEND establishes communication
    // and leaves 2 receives, below the limit.
    let mut script = vec![Recv { side: 1, len: 256 }; 3];
    script.extend([Send { side: 0, len: 16, imm: false, inline: false, signaled: true }; 2]);
    let (d, _) = same_both_ways_from(true, true, &script);
    let b = d.sides[1].qpn;
    assert!(matches!(d.events[..], [AsyncEvent::CommEstablished(q), AsyncEvent::SrqLimitReached(_)] if q == b));
    assert_eq!(d.packets, 0);
}

#[test]
fn seeded_work_ends_the_same_with_and_without_direct_execution() {
    for seed in 1..=24u64 {
        let mut rng = Rng::new(seed);
        let mut script = Vec::new();
        // Receives posted and not yet taken, per side; every settle finds enough of them (RNR
        // retries are unlimited), though a delivery before it may not.
        let mut posted = [0i64; 2];
        for _ in 0..40 {
            for (side, posted) in posted.iter_mut().enumerate() {
                for _ in 0..rng.below(3) {
                    if *posted < 32 {
                        script.push(Recv { side, len: 4096 });
                        *posted += 1;
                    }
                }
            }
            for _ in 0..1 + rng.below(4) {
                let side = rng.below(2) as usize;
                let len = match rng.below(4) {
                    0 => rng.below(65) as u32,
                    1 => rng.below(1025) as u32,
                    2 => 1024 + rng.below(3000) as u32,
                    _ => 8,
                };
                let (imm, signaled) = (rng.chance(0.3), rng.chance(0.7));
                let op = match rng.below(6) {
                    0 | 1 => Send { side, len, imm, inline: rng.chance(0.3), signaled },
                    2 | 3 => Write { side, len, imm, signaled },
                    4 => Read { side, len },
                    _ => Atomic { side, cas: rng.chance(0.5), aligned: true },
                };
                if matches!(op, Send { .. } | Write { imm: true, .. }) {
                    posted[1 - side] -= 1;
                }
                script.push(op);
            }
            if rng.chance(0.3) {
                script.push(Deliver);
            }
            for _ in 0..rng.below(3) {
                script.push(DeliverOne);
            }
            for (side, posted) in posted.iter_mut().enumerate() {
                while *posted < 0 {
                    script.push(Recv { side, len: 4096 });
                    *posted += 1;
                }
            }
            if rng.chance(0.5) {
                script.push(Settle);
            }
        }
        let (d, p) = same_both_ways(seed % 2 == 0, &script);
        assert!(d.packets < p.packets, "seed {seed}: direct {} packets, plain {}", d.packets, p.packets);
    }
}
