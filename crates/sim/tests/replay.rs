//! Replay against the kernel: the RC traffic of the golden rxe captures (Linux 6.1 rdma_rxe talking
//! to itself between two guests) played against our engine, one host at a time.
//!
//! For each capture and each host, a QP is made with the captured QPN, PSNs and path MTU (1024), its
//! memory registered at the captured keys and virtual addresses and filled with what the capture
//! shows it held (read responses, atomic originals), receives posted as the tool posted them, and
//! the tool's work requests posted no later than the kernel started each message. The peer's packets
//! are fed in capture order at capture time ([`Replay`]); what we transmit is compared with what the
//! kernel transmitted from the same host, every header field and payload byte (opcode sequence, PSN,
//! dest QPN, AckReq, SE, pad, P_Key, RETH, AtomicETH, ImmDt, AETH syndrome and MSN, atomic original,
//! read data), then completions (wr_id, status, opcode, byte_len, immediate, in CQ order, as the tools
//! printed them where they did) and the memory the operations wrote. The CM exchange on QP1 (rxe_imm)
//! is not replayed. Where a side is only a responder (perftest servers) it is test (a) of the issue,
//! where only a requester (perftest clients) test (b); the pingpongs and rdma_imm exercise both on
//! one QP.
//!
//! What the kernel does, and we match exactly when driven packet by packet:
//!
//! - segmentation at the path MTU into FIRST/MIDDLE/LAST (SEND 4096 B, WRITE 8192 B) and ONLY, one
//!   PSN per packet, a READ taking one PSN per response packet; the RETH only on the first packet
//!   of a WRITE (va, rkey, whole length); ImmDt on the last; pad to four bytes;
//! - AckReq on the last packet of every message (READ and atomic requests included) and on no other
//!   (no message here is long enough for the extra AckReq of a long message: rxe asks again on
//!   the 66th packet in a row without one, we on the 64th);
//! - the responder ACKs exactly the SEND/WRITE packets with AckReq, each with its own PSN and the
//!   MSN at that point, credit field 0x1f ("invalid"), and a duplicate SEND again with the same PSN
//!   and MSN ([`acks_due`] models it; both the kernel's ACKs and ours equal the model);
//! - READ responses FIRST/MIDDLE/LAST or ONLY, AETH on FIRST, LAST and ONLY only, MSN counted when
//!   the READ arrives; ATOMIC_ACKNOWLEDGE with the original value and the MSN;
//! - the requester's window: rxe sends while its next PSN is at most 128 past the oldest unanswered
//!   one, so 64 KiB reads go out three at a time; so do ours with the default `max_inflight_packets`, 129 (ours
//!   counts the PSNs in flight before sending; the engine's default is 1024);
//! - the retransmission of an unanswered SEND after the local ACK timeout (14: 67.1 ms) in
//!   rxe_rc_pingpong, and a duplicate ACK for the retransmitted copy.
//!
//! Differences, each allowed by the spec and checked in its own way:
//!
//! - Pacing: we send each packet as soon as our inputs allow; the kernel's TCG guests were often
//!   later. Streams are compared in order, not by time, and [`assert_not_later`] checks we never
//!   needed more input than the kernel had. Our retransmission leaves exactly at the timeout, the
//!   kernel's 11 ms later (jiffies and a slow guest).
//! - ACK coalescing: with receive batches (as the verbs runtime reads up to 256 datagrams before it
//!   transmits; [`Replay::set_batched`]) our responder sends one ACK for the newest of the requests
//!   that asked for one, where rxe, answering from a per-packet tasklet, sends each. A later ACK
//!   acknowledges all earlier PSNs and a responder may coalesce (IBA 9.7.5.1). Checked by
//!   [`assert_acks_coalesced`]: every ACK of ours is one of the kernel's, field for field; every one
//!   of the kernel's is covered in time by one of ours; all other responses are identical.
//! - Signaling: the tools signal selectively (perftest's CQ moderation); the wire does not show it, so
//!   every work request here is signaled, to check every completion.
//!
//! No difference was found that the spec does not allow, so nothing in the engine changed.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use softrdma_sim::replay::{
    self, acks_due, assert_acks_coalesced, assert_not_later, assert_same, plain_acks, requests, responses,
    CapturedPacket, Replay, Setup, Tagged,
};
use softrdma_transport::wr::Payload;
use softrdma_transport::{
    Access, Counters, RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList, WcFlags, WcOpcode, WcStatus,
};
use softrdma_wire::opcode::Flags;
use softrdma_wire::Psn;

/// vm1, the server of every capture.
const VM1: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 11));
/// vm2, the client.
const VM2: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 12));

fn golden(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden").join(file)
}

fn capture(name: &str) -> Vec<CapturedPacket> {
    replay::load(&golden(&format!("{name}.pcap")))
}

/// A replay of `setup`'s host that writes a pcap of what it was fed and sent if the test fails.
fn replay(name: &str, cap: &[CapturedPacket], setup: Setup, batched: bool) -> Replay {
    let mut r = Replay::new(cap, setup);
    r.set_batched(batched);
    let side = if setup.ip == VM1 { "vm1" } else { "vm2" };
    let drive = if batched { "batched" } else { "per-packet" };
    let file = format!("replay-{name}-{side}-{drive}.pcap");
    r.pcap_on_failure(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(file));
    r
}

/// The capture's notes print these lines: the QPNs, PSNs, keys and addresses used below.
fn txt_says(name: &str, lines: &[&str]) {
    let txt = std::fs::read_to_string(golden(&format!("{name}.txt"))).unwrap();
    for l in lines {
        assert!(txt.contains(l), "{name}.txt does not say {l:?}");
    }
}

fn all_access() -> Access {
    Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC)
}

/// A completion as compared: wr_id, status, opcode, byte_len, immediate data if flagged.
type Wc = (u64, WcStatus, WcOpcode, u32, Option<u32>);

fn ok(wr_id: u64, opcode: WcOpcode, byte_len: u32) -> Wc {
    (wr_id, WcStatus::Success, opcode, byte_len, None)
}

fn wcs(r: &mut Replay) -> Vec<Wc> {
    r.completions()
        .iter()
        .map(|w| {
            let imm = w.flags.contains(WcFlags::WITH_IMM).then_some(w.imm);
            (w.wr_id, w.status, w.opcode, w.byte_len, imm)
        })
        .collect()
}

fn sge(lkey: u32, addr: u64, length: usize) -> SgeList {
    SgeList::one(Sge { addr, length: length as u32, lkey })
}

fn signaled(wr_id: u64, op: SendOp, sgl: SgeList) -> SendWr {
    SendWr { wr_id, op, payload: Payload::Sgl(sgl), flags: SendFlags::SIGNALED, ud: None }
}

/// The payloads of the packets of message `k` (0-based) of a request or response stream, joined.
fn message(stream: &[Tagged], k: usize) -> Vec<u8> {
    let mut n = 0;
    let mut out = Vec::new();
    for t in stream {
        let info = t.packet.info();
        if n == k && info.is(Flags::PAYLOAD) {
            out.extend_from_slice(&t.packet.payload);
        }
        if info.ends_message() {
            n += 1;
        }
    }
    out
}

/// Compare our streams with the kernel's and check we were never later. Requests are always
/// identical. Responses are identical when driven packet by packet; with receive batches our plain
/// ACKs may be coalesced ([`assert_acks_coalesced`]). Returns (our plain ACKs, the kernel's).
#[track_caller]
fn assert_streams(r: &Replay) -> (usize, usize) {
    assert_streams_and(r, Counters::default())
}

/// [`assert_streams`], and our counters: every packet received and sent accounted for, the bytes
/// sent, and no event (drop, duplicate, NAK, timeout, retransmission...) other than `events`.
#[track_caller]
fn assert_streams_and(r: &Replay, events: Counters) -> (usize, usize) {
    let acks = compare_streams(r);
    let c = *r.hca.counters();
    let want = Counters {
        rcvd_pkts: r.kernel_received().len() as u64,
        sent_pkts: r.ours().len() as u64,
        sent_bytes: r.ours().iter().map(|t| t.packet.payload.len() as u64).sum(),
        rcvd_bytes: c.rcvd_bytes,
        ..events
    };
    assert_eq!(c, want, "counters");
    acks
}

#[track_caller]
fn compare_streams(r: &Replay) -> (usize, usize) {
    let kernel = r.kernel_sent();
    let ours = r.ours();
    let (oq, kq) = (requests(ours), requests(&kernel));
    assert_same("requests", &oq, &kq);
    assert_not_later("requests", &oq, &kq);
    let (or, kr) = (responses(ours), responses(&kernel));
    // The kernel ACKs exactly the SEND and WRITE packets that ask for it, each with the MSN of
    // that point, and nothing else.
    let due = acks_due(&requests(&r.kernel_received()), r.setup.rq_psn, r.setup.mtu.bytes());
    assert_eq!(plain_acks(&kr), due, "the kernel's ACKs");
    if r.batched() {
        return assert_acks_coalesced("responses", &or, &kr);
    }
    assert_same("responses", &or, &kr);
    assert_not_later("responses", &or, &kr);
    assert_eq!(plain_acks(&or), due, "our ACKs");
    (due.len(), due.len())
}

/// Replay a side packet by packet, then again with receive batches; return the ACK counts of the
/// batched run.
fn both_drives(mut side: impl FnMut(bool) -> (usize, usize)) -> (usize, usize) {
    let (ours, kernel) = side(false);
    assert_eq!(ours, kernel);
    side(true)
}

/// The widest distance, over the requests of `sent`, from a request's PSN back to the oldest PSN
/// not yet answered when it was sent, judged by the responses in `inbound` seen by then (up to the
/// frame we last processed for ours, before the request's frame for the kernel's).
fn widest_gap(sent: &[Tagged], inbound: &[Tagged], first_psn: Psn, ours: bool) -> i32 {
    requests(sent)
        .iter()
        .map(|t| {
            let seen = |r: &&Tagged| {
                if ours {
                    r.frame <= t.frame
                } else {
                    r.frame < t.frame
                }
            };
            let una = inbound.iter().rev().find(seen).map_or(first_psn, |r| r.packet.psn().next());
            t.packet.psn().diff(una)
        })
        .max()
        .unwrap_or(0)
}

// ---- ibv_rc_pingpong --------------------------------------------------------------------------

/// One side of `ibv_rc_pingpong -s size -n iters`: 500 receives of `size` bytes posted first (its
/// rx_depth), the buffer filled with 0x7b, each SEND (wr_id 2, signaled) posted once the previous
/// one and a receive (wr_id 1) completed; one CQ for both. Returns the replay for more checks.
fn pingpong_side(
    name: &str,
    cap: &[CapturedPacket],
    setup: Setup,
    size: usize,
    iters: usize,
    events: Counters,
    batched: bool,
) -> (Replay, (usize, usize)) {
    let server = setup.ip == VM1;
    let mut r = replay(name, cap, setup, batched);
    let pd = r.pd;
    let (buf, buf_va) = r.mem.register(pd, size, all_access());
    r.mem.region_mut(buf).bytes.fill(0x7b);
    let (rbuf, rbuf_va) = r.mem.register(pd, size, all_access());
    for _ in 0..500 {
        r.post_recv(RecvWr { wr_id: 1, sgl: sge(rbuf, rbuf_va, size) });
    }
    let wrs = (0..iters).map(|_| signaled(2, SendOp::Send, sge(buf, buf_va, size))).collect();
    r.post_sends_as_captured(wrs);
    let acks = assert_streams_and(&r, events);
    let recv = ok(1, WcOpcode::Recv, size as u32);
    let send = ok(2, WcOpcode::Send, size as u32);
    let pair = if server { [recv, send] } else { [send, recv] };
    let want: Vec<_> = (0..iters).flat_map(|_| pair).collect();
    assert_eq!(wcs(&mut r), want);
    assert!(r.mem.region(rbuf).bytes.iter().all(|b| *b == 0x7b));
    (r, acks)
}

#[test]
fn rxe_rc_pingpong() {
    let name = "rxe_rc_pingpong";
    txt_says(
        name,
        &[
            "local address:  LID 0x0000, QPN 0x000011, PSN 0x81590e, GID ::ffff:10.77.0.11",
            "local address:  LID 0x0000, QPN 0x000011, PSN 0xfb7b33, GID ::ffff:10.77.0.12",
        ],
    );
    let cap = capture(name);
    // vm1 got the first SEND twice (the client's retransmission, below) and ACKed both copies.
    let server = Setup::rc(VM1, VM2, 0x11, 0x11, 0x81590e, 0xfb7b33);
    let events = Counters { duplicate_request: 1, ..Counters::default() };
    let acks = both_drives(|b| pingpong_side(name, &cap, server, 64, 5, events, b).1);
    // Batched: the first SEND and its retransmission arrive back to back; one ACK answers both.
    assert_eq!(acks, (5, 6));
    // vm2 timed out once and sent the first SEND again; the second ACK of it matched nothing
    // outstanding any more and was dropped.
    let client = Setup::rc(VM2, VM1, 0x11, 0x11, 0xfb7b33, 0x81590e);
    let events =
        Counters { ack_timeouts: 1, retry_rounds: 1, retransmits: 1, drop_stray_resp: 1, ..Counters::default() };
    let acks = both_drives(|b| pingpong_side(name, &cap, client, 64, 5, events, b).1);
    assert_eq!(acks, (5, 5));

    // The client's first SEND went unanswered for longer than the local ACK timeout (14: 67.1 ms;
    // vm1 was slow), so vm2's kernel sent it again, and so do we. Ours leaves exactly at the
    // timeout, the kernel's 11 ms later (jiffies and a TCG guest).
    let (r, _) = pingpong_side(name, &cap, client, 64, 5, events, false);
    let (ours, kernel) = (requests(r.ours()), requests(&r.kernel_sent()));
    assert_eq!(ours[0].packet.psn(), ours[1].packet.psn());
    assert_eq!(ours[1].at - ours[0].at, core::time::Duration::from_nanos(4096 << 14));
    assert!(ours[1].at <= kernel[1].at);
}

#[test]
fn rxe_rc_pingpong_4k() {
    let name = "rxe_rc_pingpong_4k";
    txt_says(
        name,
        &[
            "local address:  LID 0x0000, QPN 0x000012, PSN 0x1a3044, GID ::ffff:10.77.0.11",
            "local address:  LID 0x0000, QPN 0x000012, PSN 0xbe0d24, GID ::ffff:10.77.0.12",
        ],
    );
    let cap = capture(name);
    let server = Setup::rc(VM1, VM2, 0x12, 0x12, 0x1a3044, 0xbe0d24);
    let acks = both_drives(|b| pingpong_side(name, &cap, server, 4096, 3, Counters::default(), b).1);
    assert_eq!(acks, (3, 3));
    let client = Setup::rc(VM2, VM1, 0x12, 0x12, 0xbe0d24, 0x1a3044);
    let acks = both_drives(|b| pingpong_side(name, &cap, client, 4096, 3, Counters::default(), b).1);
    assert_eq!(acks, (3, 3));
}

// ---- perftest ---------------------------------------------------------------------------------

#[test]
fn rxe_write() {
    let name = "rxe_write";
    txt_says(
        name,
        &[
            "local address: LID 0000 QPN 0x0014 PSN 0x4eeff6 RKey 0x000564 VAddr 0x0055ee281b2000",
            "local address: LID 0000 QPN 0x0014 PSN 0xcaa95e RKey 0x0005d5 VAddr 0x00556368286000",
        ],
    );
    let cap = capture(name);
    let (size, iters) = (8192, 20);
    let data = {
        let r = Replay::new(&cap, Setup::rc(VM1, VM2, 0x14, 0x14, 0x4eeff6, 0xcaa95e));
        message(&requests(&r.kernel_received()), 0)
    };
    assert_eq!(data.len(), size);

    // Responder: vm1's buffer takes 20 writes of 8192 bytes.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, Setup::rc(VM1, VM2, 0x14, 0x14, 0x4eeff6, 0xcaa95e), batched);
        let pd = r.pd;
        r.mem.register_at(pd, 0x564, 0x55ee_281b_2000, size, all_access());
        r.run_to_end();
        let acks = assert_streams(&r);
        assert_eq!(wcs(&mut r), vec![]);
        assert!(r.mem.region(0x564).bytes == data);
        acks
    });
    // Batched: the kernel ACKed each of the 20 WRITE_LASTs; runs of them that arrived back to back
    // get one ACK from us, for the newest.
    assert_eq!(acks, (5, 20));

    // Requester: vm2 writes its buffer 20 times.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, Setup::rc(VM2, VM1, 0x14, 0x14, 0xcaa95e, 0x4eeff6), batched);
        let pd = r.pd;
        r.mem.register_at(pd, 0x5d5, 0x5563_6828_6000, size, all_access());
        r.mem.region_mut(0x5d5).bytes.copy_from_slice(&data);
        let write = SendOp::Write { remote_addr: 0x55ee_281b_2000, rkey: 0x564 };
        let wrs = (0..iters).map(|i| signaled(i, write, sge(0x5d5, 0x5563_6828_6000, size))).collect();
        r.post_sends_as_captured(wrs);
        let acks = assert_streams(&r);
        let want: Vec<_> = (0..iters).map(|i| ok(i, WcOpcode::RdmaWrite, size as u32)).collect();
        assert_eq!(wcs(&mut r), want);
        acks
    });
    assert_eq!(acks, (0, 0));
}

#[test]
fn rxe_read() {
    let name = "rxe_read";
    txt_says(
        name,
        &[
            "local address: LID 0000 QPN 0x0015 PSN 0x3f12bf OUT 0x80 RKey 0x0006c7 VAddr 0x007f317ac0a000",
            "local address: LID 0000 QPN 0x0015 PSN 0xb3e098 OUT 0x80 RKey 0x0006a4 VAddr 0x007fa35f57c000",
        ],
    );
    let cap = capture(name);
    let (size, iters) = (65536usize, 20u64);
    // Both sides allow 128 reads in flight ("OUT 0x80").
    let server =
        Setup { max_dest_rd_atomic: 128, max_rd_atomic: 128, ..Setup::rc(VM1, VM2, 0x15, 0x15, 0x3f12bf, 0xb3e098) };
    let client =
        Setup { max_dest_rd_atomic: 128, max_rd_atomic: 128, ..Setup::rc(VM2, VM1, 0x15, 0x15, 0xb3e098, 0x3f12bf) };
    // rxe sends while its next PSN is at most RXE_MAX_UNACKED_PSNS (128) past the oldest one not
    // answered; our default window (129 PSNs in flight before sending) is the same limit.
    assert_eq!(client.config.max_inflight_packets, 129);
    // What vm1's buffer held: the payload of its first read response stream.
    let data = message(&responses(&Replay::new(&cap, server).kernel_sent()), 0);
    assert_eq!(data.len(), size);

    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, server, batched);
        let pd = r.pd;
        r.mem.register_at(pd, 0x6c7, 0x7f31_7ac0_a000, size, all_access());
        r.mem.region_mut(0x6c7).bytes.copy_from_slice(&data);
        r.run_to_end();
        let acks = assert_streams(&r);
        assert_eq!(wcs(&mut r), vec![]);
        acks
    });
    assert_eq!(acks, (0, 0));

    // Requester: ib_read_bw posts its 20 reads at once (TX depth 20), each into its own slot here.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, client, batched);
        let pd = r.pd;
        let base = 0x7fa3_5f57_c000;
        r.mem.register_at(pd, 0x6a4, base, size * iters as usize, all_access());
        for i in 0..iters {
            let read = SendOp::Read { remote_addr: 0x7f31_7ac0_a000, rkey: 0x6c7 };
            r.post_send(signaled(i, read, sge(0x6a4, base + i * size as u64, size)));
        }
        r.run_to_end();
        let acks = assert_streams(&r);
        // Reads 4, 5... wait for the window. The widest gap at a send between a read's PSN and the
        // oldest one unanswered, as far as the responses seen by then tell, is 128 on both sides.
        let inbound = responses(&r.kernel_received());
        assert_eq!(widest_gap(r.ours(), &inbound, client.sq_psn, true), 128);
        assert_eq!(widest_gap(&r.kernel_sent(), &inbound, client.sq_psn, false), 128);
        let want: Vec<_> = (0..iters).map(|i| ok(i, WcOpcode::RdmaRead, size as u32)).collect();
        assert_eq!(wcs(&mut r), want);
        for chunk in r.mem.region(0x6a4).bytes.chunks(size) {
            assert!(chunk == data, "a read's data did not land");
        }
        acks
    });
    assert_eq!(acks, (0, 0));
}

#[test]
fn rxe_send() {
    let name = "rxe_send";
    txt_says(
        name,
        &[
            "local address: LID 0000 QPN 0x0016 PSN 0x14ec52",
            "local address: LID 0000 QPN 0x0016 PSN 0x762725",
            "RX depth        : 20",
        ],
    );
    let cap = capture(name);
    let (size, iters) = (4096usize, 20u64);
    let server = Setup::rc(VM1, VM2, 0x16, 0x16, 0x14ec52, 0x762725);
    let inbound = requests(&Replay::new(&cap, server).kernel_received());

    // Responder: vm1 posted its 20 receives (RX depth 20) before the client started; each gets its
    // own slot here so every message can be checked.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, server, batched);
        let pd = r.pd;
        let (rkey, rva) = r.mem.register(pd, size * iters as usize, all_access());
        for i in 0..iters {
            r.post_recv(RecvWr { wr_id: i, sgl: sge(rkey, rva + i * size as u64, size) });
        }
        r.run_to_end();
        let acks = assert_streams(&r);
        let want: Vec<_> = (0..iters).map(|i| ok(i, WcOpcode::Recv, size as u32)).collect();
        assert_eq!(wcs(&mut r), want);
        for (i, slot) in r.mem.region(rkey).bytes.chunks(size).enumerate() {
            assert!(slot == message(&inbound, i), "message {i} did not land");
        }
        acks
    });
    // Batched: all 80 SEND packets arrived before vm1 answered; one ACK covers the 20 messages.
    assert_eq!(acks, (1, 20));

    // Requester: vm2 sends its buffer 20 times.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, Setup::rc(VM2, VM1, 0x16, 0x16, 0x762725, 0x14ec52), batched);
        let pd = r.pd;
        let (lkey, va) = r.mem.register(pd, size, all_access());
        r.mem.region_mut(lkey).bytes = message(&inbound, 0);
        let wrs = (0..iters).map(|i| signaled(i, SendOp::Send, sge(lkey, va, size))).collect();
        r.post_sends_as_captured(wrs);
        let acks = assert_streams(&r);
        let want: Vec<_> = (0..iters).map(|i| ok(i, WcOpcode::Send, size as u32)).collect();
        assert_eq!(wcs(&mut r), want);
        acks
    });
    assert_eq!(acks, (0, 0));
}

/// `ib_atomic_bw -n 20` (FETCH_AND_ADD or CMP_AND_SWAP): 20 atomics on successive 64-byte lines of
/// vm1's buffer, whose contents were whatever the allocation held — the captured ATOMIC_ACKNOWLEDGE
/// packets tell what, so the responder's memory is filled from them.
fn atomic(name: &str, qpn: u32, server_psn: u32, client_psn: u32, cas: bool) {
    let cap = capture(name);
    let server =
        Setup { max_dest_rd_atomic: 128, max_rd_atomic: 128, ..Setup::rc(VM1, VM2, qpn, qpn, server_psn, client_psn) };
    let client =
        Setup { max_dest_rd_atomic: 128, max_rd_atomic: 128, ..Setup::rc(VM2, VM1, qpn, qpn, client_psn, server_psn) };
    let (reqs, acks) = {
        let r = Replay::new(&cap, server);
        (requests(&r.kernel_received()), responses(&r.kernel_sent()))
    };
    assert_eq!((reqs.len(), acks.len()), (20, 20));
    let eth = |t: &Tagged| t.packet.repr.atomic_eth.expect("AtomicETH");
    let orig = |t: &Tagged| t.packet.repr.atomic_ack_eth.expect("AtomicAckETH").orig;
    let (rkey, base) = (eth(&reqs[0]).rkey, eth(&reqs[0]).va);

    let n = both_drives(|batched| {
        let mut r = replay(name, &cap, server, batched);
        let pd = r.pd;
        r.mem.register_at(pd, rkey, base, 4096, all_access());
        for (q, a) in reqs.iter().zip(&acks) {
            assert_eq!(q.packet.psn(), a.packet.psn());
            let off = (eth(q).va - base) as usize;
            r.mem.region_mut(rkey).bytes[off..off + 8].copy_from_slice(&orig(a).to_ne_bytes());
        }
        r.run_to_end();
        let n = assert_streams(&r);
        assert_eq!(wcs(&mut r), vec![]);
        for (q, a) in reqs.iter().zip(&acks) {
            let e = eth(q);
            let off = (e.va - base) as usize;
            let word = &r.mem.region(rkey).bytes[off..off + 8];
            let now = u64::from_ne_bytes(word.try_into().unwrap());
            let want = match (cas, orig(a) == e.compare) {
                (true, true) => e.swap_add,
                (true, false) => orig(a),
                (false, _) => orig(a).wrapping_add(e.swap_add),
            };
            assert_eq!(now, want, "word at {:#x}", e.va);
        }
        n
    });
    assert_eq!(n, (0, 0));

    // Requester: the tool posts all 20 at once (TX depth 20); each original value lands in its
    // own 8-byte slot here.
    let n = both_drives(|batched| {
        let mut r = replay(name, &cap, client, batched);
        let pd = r.pd;
        let (lkey, va) = r.mem.register(pd, 8 * reqs.len(), all_access());
        for (i, q) in reqs.iter().enumerate() {
            let e = eth(q);
            let op = if cas {
                SendOp::CompareSwap { remote_addr: e.va, rkey: e.rkey, compare: e.compare, swap: e.swap_add }
            } else {
                SendOp::FetchAdd { remote_addr: e.va, rkey: e.rkey, add: e.swap_add }
            };
            r.post_send(signaled(i as u64, op, sge(lkey, va + 8 * i as u64, 8)));
        }
        r.run_to_end();
        let n = assert_streams(&r);
        let opcode = if cas { WcOpcode::CompSwap } else { WcOpcode::FetchAdd };
        let want: Vec<_> = (0..20).map(|i| ok(i, opcode, 8)).collect();
        assert_eq!(wcs(&mut r), want);
        for (slot, a) in r.mem.region(lkey).bytes.chunks(8).zip(&acks) {
            assert_eq!(u64::from_ne_bytes(slot.try_into().unwrap()), orig(a));
        }
        n
    });
    assert_eq!(n, (0, 0));
}

#[test]
fn rxe_atomic() {
    let name = "rxe_atomic";
    txt_says(
        name,
        &[
            "Atomic FETCH_AND_ADD BW Test",
            "local address: LID 0000 QPN 0x0017 PSN 0x646e82",
            "local address: LID 0000 QPN 0x0017 PSN 0xf68c4f",
        ],
    );
    atomic(name, 0x17, 0x646e82, 0xf68c4f, false);
}

#[test]
fn rxe_atomic_cas() {
    let name = "rxe_atomic_cas";
    txt_says(name, &["Atomic CMP_AND_SWAP BW Test", "local address: LID 0000 QPN 0x0018 PSN 0x622eca"]);
    atomic(name, 0x18, 0x622eca, 0x622eca, true);
}

// ---- rdma_imm (rdma_cm; the CM exchange on QP1 is not replayed) ---------------------------------

#[test]
fn rxe_imm() {
    let name = "rxe_imm";
    txt_says(
        name,
        &[
            "server: device=rxe0 qp_num=0x00001a",
            "client: device=rxe0 qp_num=0x00001a",
            "client: server buffer vaddr=0x56256a8f5500 rkey=0xdac",
            "server: buf+1024 now \"write-with-imm\"",
            "client: read back \"read-me: 0123456789abcdef\"",
            "server: recv bufs: \"send-with-imm\" \"\" \"bye\"",
        ],
    );
    let cap = capture(name);
    // The PSNs are not printed: rdma_cm chose them; they are the first request PSN of each side.
    let server = Setup::rc(VM1, VM2, 0x1a, 0x1a, 0xa2f831, 0x9495aa);
    let client = Setup::rc(VM2, VM1, 0x1a, 0x1a, 0x9495aa, 0xa2f831);
    let (buf_va, buf_key) = (0x5625_6a8f_5500u64, 0xdacu32);
    // The server's first message: its buffer's address and key, little-endian.
    let hello: Vec<u8> = buf_va.to_le_bytes().into_iter().chain(buf_key.to_le_bytes()).collect();
    // What the server's buffer held at +2048: the payload of its read response.
    let read_me = message(&responses(&Replay::new(&cap, server).kernel_sent()), 2);
    assert_eq!(read_me.len(), 32);
    assert!(read_me.starts_with(b"read-me: 0123456789abcdef"));

    // Server (vm1): three receives, then one SEND telling the client its buffer's address and key;
    // it answers a SEND with immediate, a WRITE with immediate to buf+1024, a READ of buf+2048 and
    // a SEND.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, server, batched);
        let pd = r.pd;
        r.mem.register_at(pd, buf_key, buf_va, 4096, all_access());
        r.mem.region_mut(buf_key).bytes[2048..2048 + 32].copy_from_slice(&read_me);
        let (rkey, rva) = r.mem.register(pd, 3 * 64, all_access());
        for i in 0..3 {
            r.post_recv(RecvWr { wr_id: 10 + i, sgl: sge(rkey, rva + 64 * i, 64) });
        }
        let (skey, sva) = r.mem.register(pd, hello.len(), all_access());
        r.mem.region_mut(skey).bytes.copy_from_slice(&hello);
        r.post_sends_as_captured(vec![signaled(1, SendOp::Send, sge(skey, sva, 12))]);
        let acks = assert_streams(&r);
        // The server's completions, as it printed them.
        assert_eq!(
            wcs(&mut r),
            vec![
                ok(1, WcOpcode::Send, 12),
                (10, WcStatus::Success, WcOpcode::Recv, 14, Some(0x1122_3344)),
                (11, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 15, Some(0x5566_7788)),
                ok(12, WcOpcode::Recv, 4),
            ]
        );
        let b = &r.mem.region(buf_key).bytes;
        assert_eq!(&b[1024..1024 + 15], b"write-with-imm\0");
        let slots = &r.mem.region(rkey).bytes;
        assert_eq!(&slots[..14], b"send-with-imm\0");
        assert!(slots[64..128].iter().all(|b| *b == 0));
        assert_eq!(&slots[128..132], b"bye\0");
        acks
    });
    assert_eq!(acks, (3, 3));

    // Client (vm2): one receive for the server's message, then the four operations, each posted
    // once the previous one completed.
    let acks = both_drives(|batched| {
        let mut r = replay(name, &cap, client, batched);
        let pd = r.pd;
        let (key, va) = r.mem.register(pd, 4096, all_access());
        let msgs: [&[u8]; 3] = [b"send-with-imm\0", b"write-with-imm\0", b"bye\0"];
        for (i, m) in msgs.iter().enumerate() {
            r.mem.region_mut(key).bytes[i * 64..i * 64 + m.len()].copy_from_slice(m);
        }
        r.post_recv(RecvWr { wr_id: 10, sgl: sge(key, va + 1024, 64) });
        let wrs = vec![
            signaled(1, SendOp::SendWithImm(0x1122_3344), sge(key, va, 14)),
            signaled(
                2,
                SendOp::WriteWithImm { remote_addr: buf_va + 1024, rkey: buf_key, imm: 0x5566_7788 },
                sge(key, va + 64, 15),
            ),
            signaled(3, SendOp::Read { remote_addr: buf_va + 2048, rkey: buf_key }, sge(key, va + 2048, 32)),
            signaled(4, SendOp::Send, sge(key, va + 128, 4)),
        ];
        r.post_sends_as_captured(wrs);
        let acks = assert_streams(&r);
        // The client's completions, as it printed them.
        assert_eq!(
            wcs(&mut r),
            vec![
                ok(10, WcOpcode::Recv, 12),
                ok(1, WcOpcode::Send, 14),
                ok(2, WcOpcode::RdmaWrite, 15),
                ok(3, WcOpcode::RdmaRead, 32),
                ok(4, WcOpcode::Send, 4),
            ]
        );
        let b = &r.mem.region(key).bytes;
        assert_eq!(&b[1024..1024 + 12], &hello[..]);
        assert_eq!(&b[2048..2048 + 32], &read_me[..]);
        acks
    });
    assert_eq!(acks, (1, 1));
}
