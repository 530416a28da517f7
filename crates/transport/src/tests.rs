//! Single-engine step tests: hand-built request packets into one responder, and the exact responses
//! it produces (in the style of smoltcp's `send!`/`recv!` socket tests).

use crate::attr::{AddressVector, ModifyQp, Mtu, QpCap, QpInit, QpState, QpType};
use crate::config::Config;
use crate::hca::{Hca, PdId, RxInfo};
use crate::memory::{Access, AtomicOp, KeyKind, MemError, MemoryAccess};
use crate::time::Instant;
use crate::wr::{RecvWr, Sge, SgeList};
use crate::{WcOpcode, WcStatus};
use softrdma_wire::aeth::CREDITS_INVALID;
use softrdma_wire::opcode::base;
use softrdma_wire::{BthRepr, IbPacket, IbRepr, NakCode, Opcode, Psn, QpType as WireQpType, Qpn, Syndrome};

/// One flat region at address 0 under key 1, every right granted.
struct Flat(Vec<u8>);

impl Flat {
    fn range(&self, key: u32, addr: u64, len: u64) -> Result<core::ops::Range<usize>, MemError> {
        if key != 1 {
            return Err(MemError::InvalidKey);
        }
        let end = addr.checked_add(len).ok_or(MemError::OutOfBounds)?;
        if end > self.0.len() as u64 {
            return Err(MemError::OutOfBounds);
        }
        Ok(addr as usize..end as usize)
    }
}

impl MemoryAccess for Flat {
    fn check(&self, _: PdId, key: u32, _: KeyKind, addr: u64, len: u64, _: Access) -> Result<(), MemError> {
        self.range(key, addr, len).map(|_| ())
    }
    fn read(&self, _: PdId, key: u32, _: KeyKind, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let r = self.range(key, addr, out.len() as u64)?;
        out.copy_from_slice(&self.0[r]);
        Ok(())
    }
    fn write(&mut self, _: PdId, key: u32, _: KeyKind, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let r = self.range(key, addr, data.len() as u64)?;
        self.0[r].copy_from_slice(data);
        Ok(())
    }
    fn atomic(&mut self, _: PdId, key: u32, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        let r = self.range(key, addr, 8)?;
        let orig = u64::from_ne_bytes(self.0[r.clone()].try_into().expect("8"));
        self.0[r].copy_from_slice(&op.apply(orig).to_ne_bytes());
        Ok(orig)
    }
    fn invalidate(&mut self, _: PdId, _: u32) -> Result<(), MemError> {
        Err(MemError::InvalidKey)
    }
}

const PEER: Qpn = Qpn::new(0x77);
const EPSN: u32 = 0x100;
const RNR_CODE: u8 = 0x0e;

/// A responder: an RC QP in RTR expecting PSN 0x100, with RNR timer code 14.
struct Rig {
    hca: Hca,
    mem: Flat,
    qpn: Qpn,
    cq: crate::CqId,
    now: Instant,
}

/// An RC QP in PD 1 with `cq` for both queues, 16 WRs each way, `max_send_sge` gather elements.
fn rc_qp(hca: &mut Hca, cq: crate::CqId, max_send_sge: u32) -> Qpn {
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge, max_recv_sge: 1, max_inline_data: 0 };
    hca.create_qp(QpInit {
        qp_type: QpType::Rc,
        pd: PdId(1),
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap,
        sq_sig_all: false,
    })
    .unwrap()
}

impl Rig {
    fn new() -> Rig {
        let mut hca = Hca::new(Config::default());
        let cq = hca.create_cq(64);
        let qpn = rc_qp(&mut hca, cq, 1);
        let mut mem = Flat(vec![0; 1 << 16]);
        let now = Instant::ZERO;
        let init = ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::REMOTE_WRITE.with(Access::REMOTE_READ)),
            ..Default::default()
        };
        hca.modify_qp(qpn, &init, now, &mut mem).unwrap();
        let rtr = ModifyQp {
            state: Some(QpState::Rtr),
            av: Some(AddressVector::default()),
            path_mtu: Some(Mtu::M256),
            dest_qpn: Some(PEER),
            rq_psn: Some(Psn::new(EPSN)),
            max_dest_rd_atomic: Some(4),
            min_rnr_timer: Some(RNR_CODE),
            ..Default::default()
        };
        hca.modify_qp(qpn, &rtr, now, &mut mem).unwrap();
        Rig { hca, mem, qpn, cq, now }
    }

    /// Feed one request (`send!`).
    fn send(&mut self, op: u8, psn: u32, ack_req: bool, payload: usize) {
        let buf = request(self, op, psn & 0xff_ffff, ack_req, None, payload, 0xab);
        self.hca.handle_packet(self.now, &buf, &RxInfo { grh: [0; 40] }, &mut self.mem);
    }

    /// Everything the engine sends now (`recv!`), as (opcode base, PSN, syndrome, MSN).
    fn recv(&mut self) -> Vec<(u8, u32, Option<Syndrome>, Option<u32>)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 4096 + 64];
        while let Some(t) = self.hca.poll_transmit(self.now, &mut self.mem, &mut buf) {
            let p = IbPacket::new_checked(&buf[..t.len]).unwrap();
            assert_eq!(t.dest_qpn, PEER);
            out.push((
                p.bth().opcode().base(),
                p.bth().psn().value(),
                p.aeth().map(|a| a.syndrome()),
                p.aeth().map(|a| a.msn()),
            ));
        }
        out
    }

    fn post_recv(&mut self, wr_id: u64, len: u32) {
        let wr = RecvWr { wr_id, sgl: SgeList::one(Sge { addr: 0x1000 * wr_id, length: len, lkey: 1 }) };
        self.hca.post_recv(self.qpn, wr, self.now, &mut self.mem).unwrap();
    }
}

const ACK: Option<Syndrome> = Some(Syndrome::Ack { credits: CREDITS_INVALID });

#[test]
fn rnr_nak_carries_the_timer_code_and_the_psn() {
    let mut r = Rig::new();
    r.send(base::SEND_ONLY, EPSN, true, 10);
    let rnr = Some(Syndrome::RnrNak { timer: RNR_CODE });
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, rnr, Some(0))]);
    // The syndrome byte on the wire: 001 followed by the 5-bit timer code.
    assert_eq!(Syndrome::RnrNak { timer: RNR_CODE }.byte(), 0x2e);
    assert_eq!(r.hca.counters().send_rnr_nak, 1);
    // Nothing was consumed: the PSN is still expected, and once a receive exists it completes.
    assert_eq!(r.hca.query_qp(r.qpn).unwrap().rq_psn, Psn::new(EPSN));
    r.post_recv(1, 64);
    r.send(base::SEND_ONLY, EPSN, true, 10);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, ACK, Some(1))]);
    let mut wc = Vec::new();
    r.hca.poll_cq(r.cq, 8, &mut wc).unwrap();
    assert_eq!(
        wc.iter().map(|w| (w.wr_id, w.status, w.opcode, w.byte_len)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success, WcOpcode::Recv, 10)]
    );
}

#[test]
fn rnr_on_a_write_with_immediate() {
    let mut r = Rig::new();
    let repr_write = |r: &mut Rig| {
        // WRITE_ONLY_IMM needs a RETH and ImmDt; build it by hand.
        let mut repr = IbRepr::new(BthRepr {
            ack_req: true,
            ..BthRepr::new(Opcode::of(WireQpType::Rc, base::WRITE_ONLY_IMM).unwrap(), r.qpn, Psn::new(EPSN))
        });
        repr.reth = Some(softrdma_wire::RethRepr { va: 0x100, rkey: 1, dma_len: 4 });
        repr.imm = Some(0x55);
        repr.payload_len = 4;
        let mut buf = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut buf).unwrap();
        buf[repr.payload_range()].copy_from_slice(b"abcd");
        r.hca.handle_packet(r.now, &buf[..n], &RxInfo { grh: [0; 40] }, &mut r.mem);
    };
    repr_write(&mut r);
    let rnr = Some(Syndrome::RnrNak { timer: RNR_CODE });
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, rnr, Some(0))]);
    assert_eq!(&r.mem.0[0x100..0x104], &[0; 4], "memory untouched before a receive exists");
    r.post_recv(2, 0);
    repr_write(&mut r);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, ACK, Some(1))]);
    assert_eq!(&r.mem.0[0x100..0x104], b"abcd");
}

#[test]
fn acks_coalesce_to_the_newest() {
    let mut r = Rig::new();
    r.post_recv(1, 4096);
    r.post_recv(2, 4096);
    // Two messages, every packet asking for an ACK, all arriving before the engine transmits:
    // one ACK for the newest PSN with the MSN of both messages.
    r.send(base::SEND_FIRST, EPSN, true, 256);
    r.send(base::SEND_LAST, EPSN + 1, true, 10);
    r.send(base::SEND_ONLY, EPSN + 2, true, 20);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN + 2, ACK, Some(2))]);
    // Without AckReq: no ACK at all.
    r.post_recv(3, 4096);
    r.send(base::SEND_ONLY, EPSN + 3, false, 1);
    assert_eq!(r.recv(), vec![]);
    // A read response in the queue is not folded into: ACK, then the read, then the next ACK.
    r.post_recv(4, 4096);
    r.send(base::SEND_ONLY, EPSN + 4, true, 256);
    let mut read = IbRepr::new(BthRepr {
        ack_req: true,
        ..BthRepr::new(Opcode::of(WireQpType::Rc, base::READ_REQUEST).unwrap(), r.qpn, Psn::new(EPSN + 5))
    });
    read.reth = Some(softrdma_wire::RethRepr { va: 0, rkey: 1, dma_len: 16 });
    let mut buf = vec![0u8; read.buffer_len()];
    let n = read.emit(&mut buf).unwrap();
    r.hca.handle_packet(r.now, &buf[..n], &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert_eq!(
        r.recv(),
        vec![(base::ACKNOWLEDGE, EPSN + 4, ACK, Some(4)), (base::READ_RESPONSE_ONLY, EPSN + 5, ACK, Some(5)),]
    );
}

#[test]
fn one_sequence_nak_per_gap() {
    let mut r = Rig::new();
    for i in 0..4 {
        r.post_recv(i + 1, 4096);
    }
    // PSNs 0x102 and 0x103 arrive with 0x100 missing: one NAK for the expected PSN.
    r.send(base::SEND_ONLY, EPSN + 2, true, 1);
    r.send(base::SEND_ONLY, EPSN + 3, true, 1);
    let seq = Some(Syndrome::Nak(NakCode::PsnSequenceError));
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, seq, Some(0))]);
    assert_eq!(r.hca.counters().out_of_seq_request, 2);
    // The gap is filled: the next gap gets its own NAK.
    r.send(base::SEND_ONLY, EPSN, true, 1);
    r.send(base::SEND_ONLY, EPSN + 2, true, 1);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, ACK, Some(1)), (base::ACKNOWLEDGE, EPSN + 1, seq, Some(1)),]);
}

#[test]
fn duplicate_send_is_acked_with_the_last_psn_and_not_redelivered() {
    let mut r = Rig::new();
    r.post_recv(1, 4096);
    r.post_recv(2, 4096);
    r.send(base::SEND_ONLY, EPSN, true, 5);
    r.send(base::SEND_ONLY, EPSN + 1, false, 5);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN, ACK, Some(1))]);
    // A duplicate of the first, without AckReq: still ACKed, with the newest PSN received.
    r.send(base::SEND_ONLY, EPSN, false, 5);
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN + 1, ACK, Some(2))]);
    let mut wc = Vec::new();
    r.hca.poll_cq(r.cq, 8, &mut wc).unwrap();
    assert_eq!(wc.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(r.hca.counters().duplicate_request, 1);
}

#[test]
fn comm_established_on_the_first_packet_in_rtr() {
    let mut r = Rig::new();
    r.post_recv(1, 64);
    r.send(base::SEND_ONLY, EPSN, true, 1);
    r.send(base::SEND_ONLY, EPSN + 1, true, 1);
    assert_eq!(r.hca.poll_event(), Some(crate::AsyncEvent::CommEstablished(r.qpn)));
    assert_eq!(r.hca.poll_event(), None);
}

/// A requester with `defer_payload_min` set leaves payloads of that size in memory: the holes, filled
/// from the pieces it names, give exactly the packets a copying requester builds.
#[test]
fn deferred_payload_names_the_bytes_a_gather_copies() {
    let build = |defer: usize| {
        let mut hca = Hca::new(Config { defer_payload_min: defer, ..Config::default() });
        let cq = hca.create_cq(64);
        let qpn = rc_qp(&mut hca, cq, 4);
        let mut mem = Flat((0..1 << 16).map(|i| (i * 7 + 3) as u8).collect());
        let now = Instant::ZERO;
        to_rts(&mut hca, qpn, &mut mem);
        // 700 bytes from two SGEs (300 + 400): packets of 256, 256 and 188 bytes; the second packet
        // spans both SGEs. Then a 3-SGE message of 3 × 100 bytes: its first packet has three pieces,
        // more than a deferred payload holds, so it is copied; its last (44 bytes) is below the
        // threshold.
        let sgl2 = [Sge { addr: 0x100, length: 300, lkey: 1 }, Sge { addr: 0x2000, length: 400, lkey: 1 }];
        let sgl3 = [
            Sge { addr: 0x10, length: 100, lkey: 1 },
            Sge { addr: 0x3000, length: 100, lkey: 1 },
            Sge { addr: 0x500, length: 100, lkey: 1 },
        ];
        for (id, sgl) in [(1u64, &sgl2[..]), (2, &sgl3[..])] {
            let wr = crate::SendWr {
                wr_id: id,
                op: crate::SendOp::Write { remote_addr: 0x9000, rkey: 7 },
                payload: crate::wr::Payload::Sgl(sgl.into()),
                flags: crate::SendFlags::SIGNALED,
                ud: None,
            };
            hca.post_send(qpn, wr, now, &mut mem).unwrap();
        }
        let mut out = Vec::new();
        let mut buf = vec![0u8; 4096 + 64];
        while let Some(t) = hca.poll_transmit(now, &mut mem, &mut buf) {
            let mut pkt = buf[..t.len].to_vec();
            let mut pieces = 0;
            if let Some(d) = t.deferred {
                let mut at = d.at;
                for p in d.pieces() {
                    mem.read(d.pd, p.lkey, KeyKind::Local, p.addr, &mut pkt[at..at + p.length as usize]).unwrap();
                    at += p.length as usize;
                }
                assert_eq!(at, d.at + d.len);
                pieces = d.n;
            }
            out.push((pkt, pieces));
        }
        out
    };
    let copied = build(0);
    let deferred = build(100);
    assert_eq!(copied.len(), 5);
    assert!(copied.iter().all(|(_, n)| *n == 0));
    assert_eq!(deferred.iter().map(|(_, n)| *n).collect::<Vec<_>>(), [1, 2, 1, 0, 0]);
    for ((a, _), (b, _)) in copied.iter().zip(&deferred) {
        assert_eq!(a, b);
    }
}

/// An RC request for the rig's QP with `payload_len` bytes of `fill` and an optional RETH.
fn request(
    r: &Rig,
    op: u8,
    psn: u32,
    ack_req: bool,
    reth: Option<(u64, u32)>,
    payload_len: usize,
    fill: u8,
) -> Vec<u8> {
    let mut repr =
        IbRepr::new(BthRepr { ack_req, ..BthRepr::new(Opcode::of(WireQpType::Rc, op).unwrap(), r.qpn, Psn::new(psn)) });
    repr.reth = reth.map(|(va, dma_len)| softrdma_wire::RethRepr { va, rkey: 1, dma_len });
    repr.payload_len = payload_len;
    let mut buf = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut buf).unwrap();
    buf[repr.payload_range()].fill(fill);
    buf.truncate(n);
    buf
}

#[test]
fn placed_write_continuations_complete_without_a_copy() {
    let mut r = Rig::new();
    assert_eq!(r.hca.rx_placement(r.qpn), None, "no write in progress");
    // A 3-packet WRITE (MTU 256) to 0x2000: after its FIRST, the rest goes to 0x2100.
    let first = request(&r, base::WRITE_FIRST, EPSN, true, Some((0x2000, 768)), 256, 1);
    r.hca.handle_packet(r.now, &first, &RxInfo { grh: [0; 40] }, &mut r.mem);
    let p = r.hca.rx_placement(r.qpn).unwrap();
    let want = crate::RxPlacement {
        qpn: r.qpn,
        psn: Psn::new(EPSN + 1),
        pd: PdId(1),
        rkey: 1,
        addr: 0x2100,
        remaining: 512,
        mtu: 256,
    };
    assert_eq!(p, want);
    // The I/O layer put the MIDDLE's payload in place; the engine gets the headers only.
    r.mem.0[0x2100..0x2200].fill(2);
    let middle = request(&r, base::WRITE_MIDDLE, EPSN + 1, true, None, 0, 0);
    let hdr = IbPacket::new_checked(&middle[..]).unwrap();
    assert!(r.hca.handle_placed(r.now, &hdr, &p, 256, &mut r.mem));
    // The old expectation is stale now: refused, nothing done.
    assert!(!r.hca.handle_placed(r.now, &hdr, &p, 256, &mut r.mem));
    let p2 = r.hca.rx_placement(r.qpn).unwrap();
    assert_eq!((p2.psn, p2.addr, p2.remaining), (Psn::new(EPSN + 2), 0x2200, 256));
    // A response opcode or a wrong PSN is never taken as placed.
    let wrong_psn = request(&r, base::WRITE_LAST, EPSN + 3, true, None, 0, 0);
    assert!(!r.hca.handle_placed(r.now, &IbPacket::new_checked(&wrong_psn[..]).unwrap(), &p2, 256, &mut r.mem));
    r.mem.0[0x2200..0x2300].fill(3);
    let last = request(&r, base::WRITE_LAST, EPSN + 2, true, None, 0, 0);
    assert!(r.hca.handle_placed(r.now, &IbPacket::new_checked(&last[..]).unwrap(), &p2, 256, &mut r.mem));
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN + 2, ACK, Some(1))]);
    assert_eq!(r.hca.rx_placement(r.qpn), None);
    assert!(r.mem.0[0x2000..0x2100].iter().all(|&b| b == 1));
    assert!(r.mem.0[0x2100..0x2200].iter().all(|&b| b == 2));
    assert!(r.mem.0[0x2200..0x2300].iter().all(|&b| b == 3));
    assert_eq!(r.hca.counters().rcvd_bytes, 768);
}

#[test]
fn a_placed_middle_past_the_reth_length_is_an_invalid_request() {
    let mut r = Rig::new();
    let first = request(&r, base::WRITE_FIRST, EPSN, true, Some((0x2000, 512)), 256, 1);
    r.hca.handle_packet(r.now, &first, &RxInfo { grh: [0; 40] }, &mut r.mem);
    let p = r.hca.rx_placement(r.qpn).unwrap();
    assert_eq!(p.remaining, 256);
    // More than the WRITE has left is refused before anything happens.
    let middle = request(&r, base::WRITE_MIDDLE, EPSN + 1, true, None, 0, 0);
    let hdr = IbPacket::new_checked(&middle[..]).unwrap();
    assert!(!r.hca.handle_placed(r.now, &hdr, &p, 257, &mut r.mem));
    // A MIDDLE that fills the rest would leave the LAST nothing: NAKed as the copying path does.
    assert!(r.hca.handle_placed(r.now, &hdr, &p, 256, &mut r.mem));
    let inv = Some(Syndrome::Nak(NakCode::InvalidRequest));
    assert_eq!(r.recv(), vec![(base::ACKNOWLEDGE, EPSN + 1, inv, Some(0))]);
    assert_eq!(r.hca.rx_placement(r.qpn), None);
}

/// An RC requester in RTS (send PSN 5, MTU 256) with a window of `window` packets, and its CQ.
fn requester(window: u32) -> (Hca, Flat, Qpn, crate::CqId) {
    requester_with(Config { max_inflight_packets: window, ..Config::default() })
}

/// An RC requester in RTS (send PSN 5, MTU 256) on an engine configured by `config`, and its CQ.
fn requester_with(config: Config) -> (Hca, Flat, Qpn, crate::CqId) {
    let mut hca = Hca::new(config);
    let cq = hca.create_cq(64);
    let qpn = rc_qp(&mut hca, cq, 1);
    let mut mem = Flat(vec![7; 1 << 12]);
    to_rts(&mut hca, qpn, &mut mem);
    (hca, mem, qpn, cq)
}

/// Move `qpn` through INIT and RTR (MTU 256, peer [`PEER`], receive PSN 1) to RTS (send PSN 5,
/// timeout 14, unlimited retries, one READ or atomic in flight).
fn to_rts(hca: &mut Hca, qpn: Qpn, mem: &mut Flat) {
    let steps = [
        ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::NONE),
            ..Default::default()
        },
        ModifyQp {
            state: Some(QpState::Rtr),
            av: Some(AddressVector::default()),
            path_mtu: Some(Mtu::M256),
            dest_qpn: Some(PEER),
            rq_psn: Some(Psn::new(1)),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            ..Default::default()
        },
        ModifyQp {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5)),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(1),
            ..Default::default()
        },
    ];
    for m in &steps {
        hca.modify_qp(qpn, m, Instant::ZERO, mem).unwrap();
    }
}

/// A one-packet RDMA WRITE of 64 bytes from `lkey` (the test memory knows key 1 only).
fn write64(wr_id: u64, lkey: u32) -> crate::SendWr {
    crate::SendWr {
        wr_id,
        op: crate::SendOp::Write { remote_addr: 0x9000, rkey: 7 },
        payload: crate::wr::Payload::Sgl(SgeList::one(Sge { addr: 0x40, length: 64, lkey })),
        flags: crate::SendFlags::SIGNALED,
        ud: None,
    }
}

/// The PSNs of the packets `hca` sends now.
fn sent_psns(hca: &mut Hca, mem: &mut Flat) -> Vec<u32> {
    let mut buf = vec![0u8; 4096 + 64];
    let mut out = Vec::new();
    while let Some(t) = hca.poll_transmit(Instant::ZERO, mem, &mut buf) {
        out.push(IbPacket::new_checked(&buf[..t.len]).unwrap().bth().psn().value());
    }
    out
}

/// The ACK of everything up to `psn`.
fn ack(hca: &mut Hca, mem: &mut Flat, qpn: Qpn, psn: u32) {
    ack_at(hca, mem, qpn, psn, Instant::ZERO);
}

/// [`ack`], arriving at `at`.
fn ack_at(hca: &mut Hca, mem: &mut Flat, qpn: Qpn, psn: u32, at: Instant) {
    let mut repr =
        IbRepr::new(BthRepr::new(Opcode::of(WireQpType::Rc, base::ACKNOWLEDGE).unwrap(), qpn, Psn::new(psn)));
    repr.aeth = Some(softrdma_wire::AethRepr { syndrome: Syndrome::Ack { credits: CREDITS_INVALID }, msn: 1 });
    let mut buf = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut buf).unwrap();
    hca.handle_packet(at, &buf[..n], &RxInfo { grh: [0; 40] }, mem);
}

/// (opcode base, PSN) of the packets `hca` sends now.
fn sent_packets(hca: &mut Hca, mem: &mut Flat) -> Vec<(u8, u32)> {
    let mut buf = vec![0u8; 4096 + 64];
    let mut out = Vec::new();
    while let Some(t) = hca.poll_transmit(Instant::ZERO, mem, &mut buf) {
        let p = IbPacket::new_checked(&buf[..t.len]).unwrap();
        out.push((p.bth().opcode().base(), p.bth().psn().value()));
    }
    out
}

/// A packet sent with a time earlier than the clock's, then restamped (a driver that reads the
/// clock once the packet has left): its retransmit timer runs from the restamp, and so does its
/// RTT sample. A timer armed before that time is left where it was.
#[test]
fn a_restamped_packet_is_timed_from_when_it_left() {
    use core::time::Duration;
    let ack_timeout = Duration::from_nanos(4096 << 14);
    let (then, now) = (Instant::from_nanos(1_000_000), Instant::from_nanos(11_000_000));
    let (mut hca, mut mem, qpn, _) = requester(64);
    hca.post_send(qpn, write64(1, 1), then, &mut mem).unwrap();
    let mut buf = vec![0u8; 4096];
    assert!(hca.poll_transmit(then, &mut mem, &mut buf).is_some());
    hca.restamp(qpn, then, now);
    // Past the deadline it had from `then`: nothing is due (the index may still wake the driver).
    hca.handle_timeout(then + ack_timeout + Duration::from_millis(1), &mut mem);
    assert_eq!((sent_psns(&mut hca, &mut mem), hca.counters().retransmits), (vec![], 0));
    assert_eq!(hca.poll_timeout(), Some(now + ack_timeout));
    // Its ACK 3 µs after the restamp: a 3 µs round trip, not 10 ms more.
    ack_at(&mut hca, &mut mem, qpn, 5, now + Duration::from_micros(3));
    assert_eq!(hca.srtt(qpn), Some(Duration::from_micros(3)));
    hca.handle_timeout(now + ack_timeout, &mut mem);
    assert_eq!((sent_psns(&mut hca, &mut mem), hca.counters().retransmits), (vec![], 0));

    // A packet left unacknowledged at `early` armed the timer: a restamp of a later one leaves it.
    let early = Instant::from_nanos(500_000);
    let (mut hca, mut mem, qpn, _) = requester(64);
    hca.post_send(qpn, write64(1, 1), early, &mut mem).unwrap();
    assert!(hca.poll_transmit(early, &mut mem, &mut buf).is_some());
    hca.post_send(qpn, write64(2, 1), then, &mut mem).unwrap();
    assert!(hca.poll_transmit(then, &mut mem, &mut buf).is_some());
    hca.restamp(qpn, then, now);
    hca.handle_timeout(early + ack_timeout, &mut mem);
    assert_eq!(sent_psns(&mut hca, &mut mem), vec![5, 6], "the first timer fires where it was");
}

/// What the runtime asks before it leaves a device to its I/O thread: a send is pending from its
/// post until the ACK completes it, a QP has receives posted until a SEND takes the last, and a
/// CQ is empty once polled dry.
#[test]
fn pending_sends_posted_receives_and_an_empty_cq_are_told() {
    let (mut hca, mut mem, qpn, cq) = requester(16);
    assert!(!hca.sends_pending() && !hca.recvs_posted(qpn) && hca.cq_is_empty(cq));
    hca.post_send(qpn, write64(1, 1), Instant::ZERO, &mut mem).unwrap();
    assert!(hca.sends_pending());
    assert_eq!(sent_psns(&mut hca, &mut mem), [5]);
    assert!(hca.sends_pending(), "sent, not yet acknowledged");
    ack(&mut hca, &mut mem, qpn, 5);
    assert!(!hca.sends_pending() && !hca.cq_is_empty(cq));
    let mut wcs = Vec::new();
    assert_eq!(hca.poll_cq(cq, 4, &mut wcs), Ok(1));
    assert!(hca.cq_is_empty(cq));
    let recv = RecvWr { wr_id: 10, sgl: SgeList::one(Sge { addr: 0x100, length: 64, lkey: 1 }) };
    hca.post_recv(qpn, recv, Instant::ZERO, &mut mem).unwrap();
    assert!(hca.recvs_posted(qpn) && !hca.recvs_posted(Qpn::new(qpn.value() + 1)));
    let mut repr = IbRepr::new(BthRepr::new(Opcode::of(WireQpType::Rc, base::SEND_ONLY).unwrap(), qpn, Psn::new(1)));
    repr.payload_len = 8;
    let mut buf = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut buf).unwrap();
    hca.handle_packet(Instant::ZERO, &buf[..n], &RxInfo { grh: [0; 40] }, &mut mem);
    assert!(!hca.recvs_posted(qpn) && !hca.cq_is_empty(cq));
}

/// A plain ACK lets one request packet of its QP go first, so a reply leaves before the ACK of
/// the request it answers; one only, so requests behind it do not hold the ACK back. A NAK never
/// waits.
#[test]
fn one_request_packet_goes_before_a_plain_ack() {
    let (mut hca, mut mem, qpn, cq) = requester(16);
    let peer_send = |hca: &mut Hca, mem: &mut Flat, psn: u32| {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::SEND_ONLY).unwrap(), qpn, Psn::new(psn));
        let mut repr = IbRepr::new(BthRepr { ack_req: true, ..bth });
        repr.payload_len = 8;
        let mut buf = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut buf).unwrap();
        hca.handle_packet(Instant::ZERO, &buf[..n], &RxInfo { grh: [0; 40] }, mem);
    };
    let recv = RecvWr { wr_id: 10, sgl: SgeList::one(Sge { addr: 0x100, length: 64, lkey: 1 }) };
    hca.post_recv(qpn, recv, Instant::ZERO, &mut mem).unwrap();
    // The peer's SEND (PSN 1) arrives, then two WRITEs are posted before the engine transmits.
    peer_send(&mut hca, &mut mem, 1);
    hca.post_send(qpn, write64(1, 1), Instant::ZERO, &mut mem).unwrap();
    hca.post_send(qpn, write64(2, 1), Instant::ZERO, &mut mem).unwrap();
    assert_eq!(
        sent_packets(&mut hca, &mut mem),
        [(base::WRITE_ONLY, 5), (base::ACKNOWLEDGE, 1), (base::WRITE_ONLY, 6)]
    );
    // With no request to send the ACK goes at once.
    let recv = RecvWr { wr_id: 11, sgl: SgeList::one(Sge { addr: 0x100, length: 64, lkey: 1 }) };
    hca.post_recv(qpn, recv, Instant::ZERO, &mut mem).unwrap();
    peer_send(&mut hca, &mut mem, 2);
    assert_eq!(sent_packets(&mut hca, &mut mem), [(base::ACKNOWLEDGE, 2)]);
    // No receive posted: the RNR NAK goes before the WRITE posted after it arrived.
    peer_send(&mut hca, &mut mem, 3);
    hca.post_send(qpn, write64(3, 1), Instant::ZERO, &mut mem).unwrap();
    assert_eq!(sent_packets(&mut hca, &mut mem), [(base::ACKNOWLEDGE, 3), (base::WRITE_ONLY, 7)]);
    // A WRITE that fails its local check (key 9 is unknown) as it is built moves the QP to ERR,
    // which drops queued responses: the ACK of the SEND received before it still goes.
    ack(&mut hca, &mut mem, qpn, 7);
    let recv = RecvWr { wr_id: 12, sgl: SgeList::one(Sge { addr: 0x100, length: 64, lkey: 1 }) };
    hca.post_recv(qpn, recv, Instant::ZERO, &mut mem).unwrap();
    peer_send(&mut hca, &mut mem, 3);
    hca.post_send(qpn, write64(4, 9), Instant::ZERO, &mut mem).unwrap();
    assert_eq!(sent_packets(&mut hca, &mut mem), [(base::ACKNOWLEDGE, 3)]);
    let mut wc = Vec::new();
    hca.poll_cq(cq, 16, &mut wc).unwrap();
    let got: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
    assert!(got.contains(&(12, WcStatus::Success)), "{got:?}");
    assert!(got.contains(&(4, WcStatus::LocProtErr)), "{got:?}");
}

/// A one-packet WRITE's region is checked by its gather only (one lookup): a WQE started while
/// the window is closed is started again, with the same PSN, when it opens.
#[test]
fn a_one_packet_write_behind_a_closed_window_keeps_its_psn() {
    let (mut hca, mut mem, qpn, cq) = requester(1);
    hca.post_send(qpn, write64(1, 1), Instant::ZERO, &mut mem).unwrap();
    hca.post_send(qpn, write64(2, 1), Instant::ZERO, &mut mem).unwrap();
    assert_eq!(sent_psns(&mut hca, &mut mem), [5]);
    ack(&mut hca, &mut mem, qpn, 5);
    assert_eq!(sent_psns(&mut hca, &mut mem), [6]);
    ack(&mut hca, &mut mem, qpn, 6);
    let mut wcs = Vec::new();
    hca.poll_cq(cq, 8, &mut wcs).unwrap();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

/// A bad lkey found by the gather of a one-packet WRITE (behind a closed window or not) is the
/// same local protection error as the start check's: nothing sent, the WQE completes in order
/// with LOC_PROT_ERR, the QP goes to ERR and the rest is flushed.
#[test]
fn a_bad_lkey_found_by_the_gather_fails_the_wqe_as_the_start_check_would() {
    for window in [1, 128] {
        let (mut hca, mut mem, qpn, cq) = requester(window);
        hca.post_send(qpn, write64(1, 1), Instant::ZERO, &mut mem).unwrap();
        hca.post_send(qpn, write64(2, 9), Instant::ZERO, &mut mem).unwrap();
        hca.post_send(qpn, write64(3, 1), Instant::ZERO, &mut mem).unwrap();
        assert_eq!(sent_psns(&mut hca, &mut mem), [5]);
        let mut wcs = Vec::new();
        hca.poll_cq(cq, 8, &mut wcs).unwrap();
        assert!(wcs.is_empty());
        ack(&mut hca, &mut mem, qpn, 5);
        assert_eq!(sent_psns(&mut hca, &mut mem), Vec::<u32>::new());
        hca.poll_cq(cq, 8, &mut wcs).unwrap();
        assert_eq!(
            wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            [(1, WcStatus::Success), (2, WcStatus::LocProtErr), (3, WcStatus::WrFlushErr)]
        );
        assert_eq!(hca.query_qp(qpn).unwrap().state, QpState::Err);
    }
}

/// One ACK covering several messages completes them all, in order, and brings the retransmit
/// timer in line once: armed while something is unacknowledged, stopped when nothing is.
#[test]
fn an_ack_of_several_messages_completes_them_in_order() {
    let (mut hca, mut mem, qpn, cq) = requester(128);
    for id in 1..=4 {
        hca.post_send(qpn, write64(id, 1), Instant::ZERO, &mut mem).unwrap();
    }
    assert_eq!(sent_psns(&mut hca, &mut mem), [5, 6, 7, 8]);
    assert!(hca.poll_timeout().is_some());
    let mut wcs = Vec::new();
    ack(&mut hca, &mut mem, qpn, 7);
    hca.poll_cq(cq, 8, &mut wcs).unwrap();
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(hca.poll_timeout().is_some());
    ack(&mut hca, &mut mem, qpn, 8);
    hca.poll_cq(cq, 8, &mut wcs).unwrap();
    assert_eq!(wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>().last(), Some(&(4, WcStatus::Success)));
    // Stopped: the lazy timer index may keep the entry until its time, when it fires nothing.
    if let Some(t) = hca.poll_timeout() {
        hca.handle_timeout(t, &mut mem);
        assert_eq!(sent_psns(&mut hca, &mut mem), Vec::<u32>::new());
        assert_eq!(hca.counters().ack_timeouts, 0);
    }
    assert_eq!(hca.poll_timeout(), None);
}

/// New sends on an RC QP may wait for the next progress (`Config::cork_max_queued`) only while at
/// least `CORK_MIN_INFLIGHT` packets are unacknowledged (their ACK is to drive a flush) and fewer
/// than `cork_max_queued` WQEs are not started; never with corking off. A cork arms the cork
/// timer, so the engine asks to be woken by `CORK_WAIT` at the latest even if no ACK ever comes;
/// it fires as a no-op (the I/O layer's flush after it sends what waited).
#[test]
fn sends_may_wait_only_behind_enough_unacknowledged_packets() {
    let now = Instant::ZERO;
    for cork_max_queued in [0, 4] {
        let (mut hca, mut mem, qpn, _) = requester_with(Config { cork_max_queued, ..Config::default() });
        let on = cork_max_queued > 0;
        let min = Config::CORK_MIN_INFLIGHT as u64;
        for id in 1..min {
            hca.post_send(qpn, write64(id, 1), now, &mut mem).unwrap();
        }
        assert_eq!(sent_psns(&mut hca, &mut mem).len() as u64, min - 1);
        assert!(!hca.cork(qpn, now), "{} packets in flight", min - 1);
        let ack_timeout = hca.poll_timeout().expect("retransmit timer");
        assert!(ack_timeout > now + Config::CORK_WAIT, "the test needs the ACK timeout later than the cork's");
        hca.post_send(qpn, write64(min, 1), now, &mut mem).unwrap();
        assert!(!hca.cork(qpn, now), "not sent yet: still {} in flight", min - 1);
        sent_psns(&mut hca, &mut mem);
        assert_eq!(hca.cork(qpn, now), on, "{min} in flight, nothing queued");
        let want = if on { now + Config::CORK_WAIT } else { ack_timeout };
        assert_eq!(hca.poll_timeout(), Some(want));
        for (k, id) in (min + 1..=min + 4).enumerate() {
            hca.post_send(qpn, write64(id, 1), now, &mut mem).unwrap();
            assert_eq!(hca.cork(qpn, now), on && k + 1 < 4, "{} queued", k + 1);
        }
        // The cork timer fires: nothing happens in the engine (the packets were ready all along),
        // no retransmission, no timeout counted; the retransmit timer stays.
        if on {
            hca.handle_timeout(want, &mut mem);
            assert_eq!(hca.poll_timeout(), Some(ack_timeout));
        }
        assert_eq!(sent_psns(&mut hca, &mut mem).len(), 4);
        assert_eq!((hca.counters().ack_timeouts, hca.counters().retransmits), (0, 0));
        assert_eq!(hca.cork(qpn, now + Config::CORK_WAIT), on);
        // Everything acknowledged: nothing would bring a flush, so nothing may wait.
        ack(&mut hca, &mut mem, qpn, 5 + min as u32 + 3);
        assert!(!hca.cork(qpn, now));
        assert!(!hca.cork(Qpn::new(0x7777), now), "unknown QP");
    }
}

/// A QP leaves the transmit list with its last packet: the flush that takes that packet makes no
/// further call to find there is nothing (`Hca::has_transmit` is false at once), while a QP with
/// more to send, or a response owed, stays on it.
#[test]
fn a_qp_leaves_the_transmit_list_with_its_last_packet() {
    let now = Instant::ZERO;
    let (mut hca, mut mem, qpn, _) = requester_with(Config::default());
    let mut buf = vec![0u8; 4096 + 64];
    for id in 1..=2 {
        hca.post_send(qpn, write64(id, 1), now, &mut mem).unwrap();
    }
    assert!(hca.has_transmit());
    assert!(hca.poll_transmit(now, &mut mem, &mut buf).is_some());
    assert!(hca.has_transmit(), "one request still to send");
    assert!(hca.poll_transmit(now, &mut mem, &mut buf).is_some());
    assert!(!hca.has_transmit(), "nothing left after the last packet");
    assert!(hca.poll_transmit(now, &mut mem, &mut buf).is_none());
    // A 4-packet WRITE (MTU 256) keeps its QP on the list until its last packet.
    let mut wr = write64(3, 1);
    wr.payload = crate::wr::Payload::Sgl(SgeList::one(Sge { addr: 0x40, length: 1024, lkey: 1 }));
    hca.post_send(qpn, wr, now, &mut mem).unwrap();
    for k in 0..4 {
        assert!(hca.has_transmit(), "packet {k}");
        assert!(hca.poll_transmit(now, &mut mem, &mut buf).is_some());
    }
    assert!(!hca.has_transmit());
}

/// `Hca::owed_reads` names what each queued READ response still has to read, as its packets go:
/// the rkey, the address of the next packet's data and the bytes left; nothing once sent.
/// `Hca::owes_read_response` says whether there is any.
#[test]
fn owed_reads_follow_the_read_responses_as_they_go() {
    let mut r = Rig::new();
    assert_eq!(r.hca.owed_reads(8).count(), 0);
    assert!(!r.hca.owes_read_response());
    // Two READs (MTU 256): 600 bytes from 0x2000, then 100 from 0x3000.
    let a = request(&r, base::READ_REQUEST, EPSN, true, Some((0x2000, 600)), 0, 0);
    r.hca.handle_packet(r.now, &a, &RxInfo { grh: [0; 40] }, &mut r.mem);
    let b = request(&r, base::READ_REQUEST, EPSN + 3, true, Some((0x3000, 100)), 0, 0);
    r.hca.handle_packet(r.now, &b, &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert_eq!(r.hca.owed_reads(8).collect::<Vec<_>>(), [(1, 0x2000, 600), (1, 0x3000, 100)]);
    assert_eq!(r.hca.owed_reads(0).count(), 0, "only the first QPs in turn are asked");
    let mut buf = vec![0u8; 4096 + 64];
    assert!(r.hca.poll_transmit(r.now, &mut r.mem, &mut buf).is_some());
    assert_eq!(r.hca.owed_reads(8).collect::<Vec<_>>(), [(1, 0x2100, 344), (1, 0x3000, 100)]);
    assert!(r.hca.owes_read_response());
    let sent = r.recv();
    assert_eq!(sent.len(), 3, "the rest of the first response and the second: {sent:?}");
    assert_eq!(r.hca.owed_reads(8).count(), 0);
    assert!(!r.hca.owes_read_response());
}

/// A duplicate READ replaces the response queued for it, and an error drops every queued
/// response: `Hca::owes_read_response` follows both.
#[test]
fn owed_reads_follow_a_duplicate_read_and_an_error() {
    let mut r = Rig::new();
    let a = request(&r, base::READ_REQUEST, EPSN, true, Some((0x2000, 600)), 0, 0);
    r.hca.handle_packet(r.now, &a, &RxInfo { grh: [0; 40] }, &mut r.mem);
    let mut buf = vec![0u8; 4096 + 64];
    assert!(r.hca.poll_transmit(r.now, &mut r.mem, &mut buf).is_some());
    // The requester asks again: the response starts over, once.
    r.hca.handle_packet(r.now, &a, &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert_eq!(r.hca.owed_reads(8).collect::<Vec<_>>(), [(1, 0x2000, 600)]);
    assert!(r.hca.owes_read_response());
    assert_eq!(r.recv().len(), 3);
    assert!(!r.hca.owes_read_response());
    let b = request(&r, base::READ_REQUEST, EPSN + 3, true, Some((0x3000, 100)), 0, 0);
    r.hca.handle_packet(r.now, &b, &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert!(r.hca.owes_read_response());
    let err = ModifyQp { state: Some(QpState::Err), ..Default::default() };
    r.hca.modify_qp(r.qpn, &err, r.now, &mut r.mem).unwrap();
    assert!(!r.hca.owes_read_response());
    assert_eq!(r.hca.owed_reads(8).count(), 0);
}

/// A receive posted in the error state completes at once, flushed, on the QP's receive CQ; one
/// posted in RESET is refused.
#[test]
fn a_receive_posted_in_error_is_flushed_at_once() {
    let mut r = Rig::new();
    let err = ModifyQp { state: Some(QpState::Err), ..Default::default() };
    r.hca.modify_qp(r.qpn, &err, r.now, &mut r.mem).unwrap();
    r.post_recv(7, 64);
    let mut wc = Vec::new();
    r.hca.poll_cq(r.cq, 8, &mut wc).unwrap();
    let got: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status, w.opcode, w.qp_num)).collect();
    assert_eq!(got, [(7, WcStatus::WrFlushErr, WcOpcode::Recv, r.qpn)]);
    let reset = ModifyQp { state: Some(QpState::Reset), ..Default::default() };
    r.hca.modify_qp(r.qpn, &reset, r.now, &mut r.mem).unwrap();
    let wr = RecvWr { wr_id: 8, sgl: SgeList::one(Sge { addr: 0x1000, length: 64, lkey: 1 }) };
    assert_eq!(r.hca.post_recv(r.qpn, wr, r.now, &mut r.mem), Err(crate::VerbsError::InvalidState(QpState::Reset)));
}

/// A QP reset, or destroyed, with a READ response queued owes nothing any more.
#[test]
fn owed_reads_go_with_a_reset_or_destroyed_qp() {
    let mut r = Rig::new();
    let a = request(&r, base::READ_REQUEST, EPSN, true, Some((0x2000, 600)), 0, 0);
    r.hca.handle_packet(r.now, &a, &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert!(r.hca.owes_read_response());
    let reset = ModifyQp { state: Some(QpState::Reset), ..Default::default() };
    r.hca.modify_qp(r.qpn, &reset, r.now, &mut r.mem).unwrap();
    assert!(!r.hca.owes_read_response());

    let mut r = Rig::new();
    r.hca.handle_packet(r.now, &a, &RxInfo { grh: [0; 40] }, &mut r.mem);
    assert!(r.hca.owes_read_response());
    r.hca.destroy_qp(r.qpn).unwrap();
    assert!(!r.hca.owes_read_response());
}

/// A UD QP in PD 1 on `cq`, brought up to RTS with Q_Key `qkey`.
fn ud_qp(hca: &mut Hca, mem: &mut Flat, cq: crate::CqId, qkey: u32) -> Qpn {
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 256 };
    let qpn = hca
        .create_qp(QpInit {
            qp_type: QpType::Ud,
            pd: PdId(1),
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap,
            sq_sig_all: true,
        })
        .unwrap();
    let now = Instant::ZERO;
    let init = ModifyQp {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        qkey: Some(qkey),
        ..Default::default()
    };
    hca.modify_qp(qpn, &init, now, mem).unwrap();
    hca.modify_qp(qpn, &ModifyQp { state: Some(QpState::Rtr), ..Default::default() }, now, mem).unwrap();
    let rts = ModifyQp { state: Some(QpState::Rts), sq_psn: Some(Psn::new(0)), ..Default::default() };
    hca.modify_qp(qpn, &rts, now, mem).unwrap();
    qpn
}

/// The packet a UD QP sends for a SEND of `payload` to multicast group `mgid` with Q_Key `qkey`.
fn multicast_send(mgid: [u8; 16], qkey: u32, payload: &[u8]) -> Vec<u8> {
    let mut hca = Hca::new(Config::default());
    let mut mem = Flat(vec![0; 4096]);
    let cq = hca.create_cq(16);
    let qpn = ud_qp(&mut hca, &mut mem, cq, qkey);
    let av = AddressVector { dgid: mgid, ..Default::default() };
    let wr = crate::SendWr {
        wr_id: 1,
        op: crate::SendOp::Send,
        payload: crate::wr::Payload::Inline(payload.to_vec()),
        flags: crate::SendFlags::INLINE,
        ud: Some(crate::wr::UdDest { av, remote_qpn: Qpn::MULTICAST, remote_qkey: qkey }),
    };
    hca.post_send(qpn, wr, Instant::ZERO, &mut mem).unwrap();
    let mut buf = vec![0u8; 4096 + 64];
    let t = hca.poll_transmit(Instant::ZERO, &mut mem, &mut buf).expect("one packet");
    assert_eq!((t.dest_qpn, t.av.dgid), (Qpn::MULTICAST, mgid));
    assert!(hca.poll_transmit(Instant::ZERO, &mut mem, &mut buf).is_none());
    buf.truncate(t.len);
    buf
}

#[test]
fn a_multicast_send_reaches_every_attached_qp_that_passes_its_checks() {
    let group: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3];
    let other: [u8; 16] = [0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
    let mut hca = Hca::new(Config::default());
    let mut mem = Flat(vec![0; 1 << 16]);
    let cq = hca.create_cq(64);
    let now = Instant::ZERO;
    let a = ud_qp(&mut hca, &mut mem, cq, 0x1111_1111);
    let b = ud_qp(&mut hca, &mut mem, cq, 0x1111_1111);
    let wrong_qkey = ud_qp(&mut hca, &mut mem, cq, 0x2222_2222);
    let no_recv = ud_qp(&mut hca, &mut mem, cq, 0x1111_1111);
    let not_attached = ud_qp(&mut hca, &mut mem, cq, 0x1111_1111);
    for q in [a, b, wrong_qkey, no_recv] {
        hca.attach_mcast(q, group).unwrap();
    }
    // A second attach changes nothing: still one copy per QP.
    hca.attach_mcast(a, group).unwrap();
    hca.attach_mcast(b, other).unwrap();
    assert_eq!(hca.mcast_groups().copied().collect::<Vec<_>>(), vec![group, other]);
    for (i, q) in [a, b, wrong_qkey, not_attached].into_iter().enumerate() {
        let wr = RecvWr { wr_id: i as u64, sgl: SgeList::one(Sge { addr: 0x1000 * i as u64, length: 256, lkey: 1 }) };
        hca.post_recv(q, wr, now, &mut mem).unwrap();
    }
    let payload: Vec<u8> = (0..100u8).collect();
    let pkt = multicast_send(group, 0x1111_1111, &payload);
    let parsed = IbPacket::new_checked(&pkt[..]).unwrap();
    let mut grh = [0u8; 40];
    grh[24..].copy_from_slice(&group);
    // Each member as it is done with its copy, and the drops counted so far: each drop is its.
    let mut done = Vec::new();
    hca.handle_multicast(now, &parsed, &RxInfo { grh }, &group, &mut mem, |q, c| {
        done.push((q, c.drop_qkey, c.drop_no_recv))
    });
    assert_eq!(done, vec![(a, 0, 0), (b, 0, 0), (wrong_qkey, 1, 0), (no_recv, 1, 1)]);
    let mut wcs = Vec::new();
    hca.poll_cq(cq, 16, &mut wcs).unwrap();
    let got: Vec<_> = wcs.iter().map(|w| (w.qp_num, w.wr_id, w.status, w.opcode, w.byte_len)).collect();
    let want = |q, id| (q, id, WcStatus::Success, WcOpcode::Recv, 140);
    assert_eq!(got, vec![want(a, 0), want(b, 1)]);
    for i in 0..2usize {
        assert_eq!(&mem.0[0x1000 * i..0x1000 * i + 40], &grh[..]);
        assert_eq!(&mem.0[0x1000 * i + 40..0x1000 * i + 140], &payload[..]);
    }
    assert_eq!(hca.counters().drop_qkey, 1);
    assert_eq!(hca.counters().drop_no_recv, 1);
    // The same packet sent to another group, or to a group of this device's but not to the
    // multicast QPN, reaches nobody.
    let drops = hca.counters().drop_unknown_qp;
    let unknown = [0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];
    hca.handle_multicast(now, &parsed, &RxInfo { grh }, &unknown, &mut mem, |_, _| {});
    let mut unicast = pkt.clone();
    unicast[5..8].copy_from_slice(&a.value().to_be_bytes()[1..]);
    let unicast = IbPacket::new_checked(&unicast[..]).unwrap();
    hca.handle_multicast(now, &unicast, &RxInfo { grh }, &group, &mut mem, |_, _| {});
    assert_eq!(hca.counters().drop_unknown_qp, drops + 2);
    // Detached, b no longer receives; destroyed, a leaves its groups.
    hca.detach_mcast(b, group).unwrap();
    assert_eq!(hca.detach_mcast(b, group), Err(crate::VerbsError::InvalidAttribute("not attached to the group")));
    for (i, q) in [(4u64, a), (5, b)] {
        let wr = RecvWr { wr_id: i, sgl: SgeList::one(Sge { addr: 0x1000 * i, length: 256, lkey: 1 }) };
        hca.post_recv(q, wr, now, &mut mem).unwrap();
    }
    hca.handle_multicast(now, &parsed, &RxInfo { grh }, &group, &mut mem, |_, _| {});
    wcs.clear();
    hca.poll_cq(cq, 16, &mut wcs).unwrap();
    assert_eq!(wcs.iter().map(|w| (w.qp_num, w.wr_id)).collect::<Vec<_>>(), vec![(a, 4)]);
    hca.destroy_qp(a).unwrap();
    assert_eq!(hca.mcast_groups().copied().collect::<Vec<_>>(), vec![group, other]);
    // a is gone from the group: b, attached again, takes the only copy.
    hca.attach_mcast(b, group).unwrap();
    hca.handle_multicast(now, &parsed, &RxInfo { grh }, &group, &mut mem, |_, _| {});
    wcs.clear();
    hca.poll_cq(cq, 16, &mut wcs).unwrap();
    assert_eq!(wcs.iter().map(|w| (w.qp_num, w.wr_id)).collect::<Vec<_>>(), vec![(b, 5)]);
    hca.detach_mcast(b, group).unwrap();
    hca.detach_mcast(wrong_qkey, group).unwrap();
    hca.detach_mcast(no_recv, group).unwrap();
    assert_eq!(hca.mcast_groups().copied().collect::<Vec<_>>(), vec![other]);
}

#[test]
fn attaching_needs_a_ud_qp_a_multicast_gid_and_room() {
    use crate::hca::multicast::{is_multicast_gid, MAX_QPS_PER_GROUP};
    let mut hca = Hca::new(Config::default());
    let mut mem = Flat(vec![0; 4096]);
    let cq = hca.create_cq(64);
    let group: [u8; 16] = [0xff, 0x01, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 0];
    let unicast: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1];
    assert!(is_multicast_gid(&group));
    assert!(!is_multicast_gid(&unicast));
    assert!(is_multicast_gid(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 224, 0, 0, 1]));
    assert!(!is_multicast_gid(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 240, 0, 0, 1]));
    let rc = rc_qp(&mut hca, cq, 1);
    assert_eq!(hca.attach_mcast(rc, group), Err(crate::VerbsError::InvalidAttribute("multicast needs a UD QP")));
    let ud = ud_qp(&mut hca, &mut mem, cq, 1);
    assert_eq!(
        hca.attach_mcast(ud, unicast),
        Err(crate::VerbsError::InvalidAttribute("gid is not a multicast address"))
    );
    assert_eq!(hca.attach_mcast(Qpn::new(0x999), group), Err(crate::VerbsError::NoSuchObject));
    hca.attach_mcast(ud, group).unwrap();
    for _ in 1..MAX_QPS_PER_GROUP {
        let q = ud_qp(&mut hca, &mut mem, cq, 1);
        hca.attach_mcast(q, group).unwrap();
    }
    let last = ud_qp(&mut hca, &mut mem, cq, 1);
    assert_eq!(hca.attach_mcast(last, group), Err(crate::VerbsError::CapacityExceeded("QPs attached to the group")));
    hca.detach_mcast(ud, group).unwrap();
    hca.attach_mcast(last, group).unwrap();
}

/// Corrupted and truncated copies of a multicast SEND (seeded; no ICRC here, which the I/O layer
/// checks, to stop them): the engine takes each without a panic, every completion it makes is a
/// receive, and afterwards the intact packet still reaches every member, byte for byte.
#[test]
fn corrupted_multicast_packets_are_dropped_or_delivered_whole() {
    let group: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 9, 9, 9];
    let mut hca = Hca::new(Config::default());
    let mut mem = Flat(vec![0; 1 << 16]);
    let cq = hca.create_cq(4096);
    let now = Instant::ZERO;
    let members = [ud_qp(&mut hca, &mut mem, cq, 7), ud_qp(&mut hca, &mut mem, cq, 7)];
    for q in members {
        hca.attach_mcast(q, group).unwrap();
    }
    let payload: Vec<u8> = (0..64u8).collect();
    let pkt = multicast_send(group, 7, &payload);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut wcs = Vec::new();
    for _ in 0..3000 {
        let mut bad = pkt.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % bad.len();
            bad[at] ^= 1 << (next() % 8);
        }
        bad.truncate(bad.len() - (next() as usize % 3) * (next() as usize % 20));
        for (i, q) in members.iter().enumerate() {
            let wr =
                RecvWr { wr_id: i as u64, sgl: SgeList::one(Sge { addr: 0x1000 * i as u64, length: 256, lkey: 1 }) };
            hca.post_recv(*q, wr, now, &mut mem).unwrap();
        }
        if let Ok(p) = IbPacket::new_checked(&bad[..]) {
            hca.handle_multicast(now, &p, &RxInfo { grh: [0; 40] }, &group, &mut mem, |_, _| {});
        }
        wcs.clear();
        hca.poll_cq(cq, 16, &mut wcs).unwrap();
        assert!(wcs.iter().all(|w| w.opcode == WcOpcode::Recv), "{wcs:?}");
        // Receives not used stay posted; drain them for the next round with a valid packet.
        let p = IbPacket::new_checked(&pkt[..]).unwrap();
        hca.handle_multicast(now, &p, &RxInfo { grh: [0; 40] }, &group, &mut mem, |_, _| {});
        hca.poll_cq(cq, 64, &mut Vec::new()).unwrap();
    }
    for (i, q) in members.iter().enumerate() {
        let wr =
            RecvWr { wr_id: 100 + i as u64, sgl: SgeList::one(Sge { addr: 0x1000 * i as u64, length: 256, lkey: 1 }) };
        hca.post_recv(*q, wr, now, &mut mem).unwrap();
    }
    let p = IbPacket::new_checked(&pkt[..]).unwrap();
    hca.handle_multicast(now, &p, &RxInfo { grh: [0; 40] }, &group, &mut mem, |_, _| {});
    wcs.clear();
    hca.poll_cq(cq, 16, &mut wcs).unwrap();
    assert_eq!(
        wcs.iter().map(|w| (w.qp_num, w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(members[0], 100, WcStatus::Success), (members[1], 101, WcStatus::Success)]
    );
    for i in 0..2usize {
        assert_eq!(&mem.0[0x1000 * i + 40..0x1000 * i + 104], &payload[..]);
    }
}
