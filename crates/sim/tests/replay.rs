//! Replay of the golden rxe captures (WIP).

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use softrdma_sim::replay::{
    self, assert_not_later, assert_same, requests, responses, CapturedPacket, Replay, Setup, Tagged,
};
use softrdma_transport::wr::Payload;
use softrdma_transport::{
    Access, RecvWr, SendFlags, SendOp, SendWr, Sge, WcFlags, WcOpcode, WcStatus,
};
use softrdma_wire::opcode::Flags;
use softrdma_wire::Psn;

/// vm1, the server of every capture.
const VM1: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 11));
/// vm2, the client.
const VM2: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 12));

fn golden(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/golden")
        .join(file)
}

fn capture(name: &str) -> Vec<CapturedPacket> {
    replay::load(&golden(&format!("{name}.pcap")))
}

/// The capture's notes print these lines: the QPNs, PSNs, keys and addresses used below.
fn txt_says(name: &str, lines: &[&str]) {
    let txt = std::fs::read_to_string(golden(&format!("{name}.txt"))).unwrap();
    for l in lines {
        assert!(txt.contains(l), "{name}.txt does not say {l:?}");
    }
}

fn all_access() -> Access {
    Access::LOCAL_WRITE
        .with(Access::REMOTE_WRITE)
        .with(Access::REMOTE_READ)
        .with(Access::REMOTE_ATOMIC)
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

fn sge(lkey: u32, addr: u64, length: usize) -> Vec<Sge> {
    vec![Sge {
        addr,
        length: length as u32,
        lkey,
    }]
}

fn signaled(wr_id: u64, op: SendOp, sgl: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        payload: Payload::Sgl(sgl),
        flags: SendFlags::SIGNALED,
        ud: None,
    }
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

/// Compare both of our streams with the kernel's, exactly, and check we were never later.
#[track_caller]
fn assert_streams(r: &Replay) {
    let kernel = r.kernel_sent();
    let ours = r.ours();
    for (what, o, k) in [
        ("requests", requests(ours), requests(&kernel)),
        ("responses", responses(ours), responses(&kernel)),
    ] {
        assert_same(what, &o, &k);
        assert_not_later(what, &o, &k);
    }
}

/// The widest distance, over the requests of `sent`, from a request's PSN back to the oldest PSN
/// not yet answered when it was sent, judged by the responses in `inbound` seen by then (up to the
/// frame we last processed for ours, before the request's frame for the kernel's).
fn widest_gap(sent: &[Tagged], inbound: &[Tagged], first_psn: Psn, ours: bool) -> i32 {
    requests(sent)
        .iter()
        .map(|t| {
            let una = inbound
                .iter()
                .filter(|r| {
                    if ours {
                        r.frame <= t.frame
                    } else {
                        r.frame < t.frame
                    }
                })
                .last()
                .map_or(first_psn, |r| r.packet.psn().next());
            t.packet.psn().diff(una)
        })
        .max()
        .unwrap_or(0)
}

// ---- ibv_rc_pingpong --------------------------------------------------------------------------

/// One side of `ibv_rc_pingpong -s size -n iters`: 500 receives of `size` bytes posted first (its
/// rx_depth), the buffer filled with 0x7b, each SEND (wr_id 2, signaled) posted once the previous
/// one and a receive (wr_id 1) completed; one CQ for both.
fn pingpong_side(cap: &[CapturedPacket], setup: Setup, size: usize, iters: usize, server: bool) {
    let mut r = Replay::new(cap, setup);
    let pd = r.pd;
    let (buf, buf_va) = r.mem.register(pd, size, all_access());
    r.mem.region_mut(buf).bytes.fill(0x7b);
    let (rbuf, rbuf_va) = r.mem.register(pd, size, all_access());
    for _ in 0..500 {
        r.post_recv(RecvWr {
            wr_id: 1,
            sgl: sge(rbuf, rbuf_va, size),
        });
    }
    let wrs = (0..iters)
        .map(|_| signaled(2, SendOp::Send, sge(buf, buf_va, size)))
        .collect();
    r.post_sends_as_captured(wrs);
    assert_streams(&r);
    let recv = ok(1, WcOpcode::Recv, size as u32);
    let send = ok(2, WcOpcode::Send, size as u32);
    let pair = if server { [recv, send] } else { [send, recv] };
    let want: Vec<_> = (0..iters).flat_map(|_| pair).collect();
    assert_eq!(wcs(&mut r), want);
    assert!(r.mem.region(rbuf).bytes.iter().all(|b| *b == 0x7b));
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
    let server = Setup::rc(VM1, VM2, 0x11, 0x11, 0x81590e, 0xfb7b33);
    pingpong_side(&cap, server, 64, 5, true);
    let client = Setup::rc(VM2, VM1, 0x11, 0x11, 0xfb7b33, 0x81590e);
    pingpong_side(&cap, client, 64, 5, false);
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
    pingpong_side(&cap, server, 4096, 3, true);
    let client = Setup::rc(VM2, VM1, 0x12, 0x12, 0xbe0d24, 0x1a3044);
    pingpong_side(&cap, client, 4096, 3, false);
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

    // Responder: vm1's buffer takes 20 writes of 8192 bytes.
    let mut r = Replay::new(&cap, Setup::rc(VM1, VM2, 0x14, 0x14, 0x4eeff6, 0xcaa95e));
    let pd = r.pd;
    r.mem
        .register_at(pd, 0x564, 0x55ee_281b_2000, size, all_access());
    r.run_to_end();
    assert_streams(&r);
    assert_eq!(wcs(&mut r), vec![]);
    let data = message(&requests(&r.kernel_received()), 0);
    assert_eq!(data.len(), size);
    assert_eq!(r.mem.region(0x564).bytes, data);

    // Requester: vm2 writes its buffer 20 times.
    let mut r = Replay::new(&cap, Setup::rc(VM2, VM1, 0x14, 0x14, 0xcaa95e, 0x4eeff6));
    let pd = r.pd;
    r.mem
        .register_at(pd, 0x5d5, 0x5563_6828_6000, size, all_access());
    r.mem.region_mut(0x5d5).bytes = data;
    let write = SendOp::Write {
        remote_addr: 0x55ee_281b_2000,
        rkey: 0x564,
    };
    let wrs = (0..iters)
        .map(|i| signaled(i, write, sge(0x5d5, 0x5563_6828_6000, size)))
        .collect();
    r.post_sends_as_captured(wrs);
    assert_streams(&r);
    let want: Vec<_> = (0..iters)
        .map(|i| ok(i, WcOpcode::RdmaWrite, size as u32))
        .collect();
    assert_eq!(wcs(&mut r), want);
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
    let server = Setup {
        max_dest_rd_atomic: 128,
        max_rd_atomic: 128,
        ..Setup::rc(VM1, VM2, 0x15, 0x15, 0x3f12bf, 0xb3e098)
    };
    let mut r = Replay::new(&cap, server);
    // What vm1's buffer held: the payload of its first read response stream.
    let data = message(&responses(&r.kernel_sent()), 0);
    assert_eq!(data.len(), size);
    let pd = r.pd;
    r.mem
        .register_at(pd, 0x6c7, 0x7f31_7ac0_a000, size, all_access());
    r.mem.region_mut(0x6c7).bytes.copy_from_slice(&data);
    r.run_to_end();
    assert_streams(&r);
    assert_eq!(wcs(&mut r), vec![]);

    // Requester: ib_read_bw posts its 20 reads at once (TX depth 20), each into its own slot here.
    let mut client = Setup {
        max_dest_rd_atomic: 128,
        max_rd_atomic: 128,
        ..Setup::rc(VM2, VM1, 0x15, 0x15, 0xb3e098, 0x3f12bf)
    };
    client.config.max_inflight_packets = 129;
    let mut r = Replay::new(&cap, client);
    let pd = r.pd;
    let base = 0x7fa3_5f57_c000;
    r.mem
        .register_at(pd, 0x6a4, base, size * iters as usize, all_access());
    for i in 0..iters {
        let read = SendOp::Read {
            remote_addr: 0x7f31_7ac0_a000,
            rkey: 0x6c7,
        };
        r.post_send(signaled(i, read, sge(0x6a4, base + i * size as u64, size)));
    }
    r.run_to_end();
    assert_streams(&r);
    // Reads 4, 5... wait for the window: rxe sends while its next PSN is at most
    // RXE_MAX_UNACKED_PSNS (128) past the oldest unanswered one, and so do we (window 129, since
    // ours counts the PSNs in flight before sending). The widest gap at a send, as far as the
    // responses seen so far tell, is 128 on both sides.
    let psn0 = client.sq_psn;
    let inbound = responses(&r.kernel_received());
    assert_eq!(widest_gap(r.ours(), &inbound, psn0, true), 128);
    assert_eq!(widest_gap(&r.kernel_sent(), &inbound, psn0, false), 128);
    let want: Vec<_> = (0..iters)
        .map(|i| ok(i, WcOpcode::RdmaRead, size as u32))
        .collect();
    assert_eq!(wcs(&mut r), want);
    for chunk in r.mem.region(0x6a4).bytes.chunks(size) {
        assert!(chunk == data, "a read's data did not land");
    }
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

    // Responder: vm1 posted its 20 receives (RX depth 20) before the client started; each gets its
    // own slot here so every message can be checked.
    let mut r = Replay::new(&cap, Setup::rc(VM1, VM2, 0x16, 0x16, 0x14ec52, 0x762725));
    let pd = r.pd;
    let (rkey, rva) = r.mem.register(pd, size * iters as usize, all_access());
    for i in 0..iters {
        r.post_recv(RecvWr {
            wr_id: i,
            sgl: sge(rkey, rva + i * size as u64, size),
        });
    }
    r.run_to_end();
    assert_streams(&r);
    let want: Vec<_> = (0..iters)
        .map(|i| ok(i, WcOpcode::Recv, size as u32))
        .collect();
    assert_eq!(wcs(&mut r), want);
    let inbound = requests(&r.kernel_received());
    for (i, slot) in r.mem.region(rkey).bytes.chunks(size).enumerate() {
        assert!(slot == message(&inbound, i), "message {i} did not land");
    }
    let data = message(&inbound, 0);

    // Requester: vm2 sends its buffer 20 times.
    let mut r = Replay::new(&cap, Setup::rc(VM2, VM1, 0x16, 0x16, 0x762725, 0x14ec52));
    let pd = r.pd;
    let (lkey, va) = r.mem.register(pd, size, all_access());
    r.mem.region_mut(lkey).bytes = data;
    let wrs = (0..iters)
        .map(|i| signaled(i, SendOp::Send, sge(lkey, va, size)))
        .collect();
    r.post_sends_as_captured(wrs);
    assert_streams(&r);
    let want: Vec<_> = (0..iters)
        .map(|i| ok(i, WcOpcode::Send, size as u32))
        .collect();
    assert_eq!(wcs(&mut r), want);
}

/// `ib_atomic_bw -n 20` (FETCH_AND_ADD or CMP_AND_SWAP): 20 atomics on successive 64-byte lines of
/// vm1's buffer, whose contents were whatever the allocation held — the captured ATOMIC_ACKNOWLEDGE
/// packets tell what, so the responder's memory is filled from them.
fn atomic(name: &str, qpn: u32, server_psn: u32, client_psn: u32, cas: bool) {
    let cap = capture(name);
    let server = Setup {
        max_dest_rd_atomic: 128,
        max_rd_atomic: 128,
        ..Setup::rc(VM1, VM2, qpn, qpn, server_psn, client_psn)
    };
    let mut r = Replay::new(&cap, server);
    let reqs = requests(&r.kernel_received());
    let acks = responses(&r.kernel_sent());
    assert_eq!((reqs.len(), acks.len()), (20, 20));
    let eth = |t: &Tagged| t.packet.repr.atomic_eth.expect("AtomicETH");
    let orig = |t: &Tagged| t.packet.repr.atomic_ack_eth.expect("AtomicAckETH").orig;
    let (rkey, base) = (eth(&reqs[0]).rkey, eth(&reqs[0]).va);
    let pd = r.pd;
    r.mem.register_at(pd, rkey, base, 4096, all_access());
    for (q, a) in reqs.iter().zip(&acks) {
        assert_eq!(q.packet.psn(), a.packet.psn());
        let off = (eth(q).va - base) as usize;
        r.mem.region_mut(rkey).bytes[off..off + 8].copy_from_slice(&orig(a).to_ne_bytes());
    }
    r.run_to_end();
    assert_streams(&r);
    assert_eq!(wcs(&mut r), vec![]);
    for (q, a) in reqs.iter().zip(&acks) {
        let off = (eth(q).va - base) as usize;
        let word = &r.mem.region(rkey).bytes[off..off + 8];
        let now = u64::from_ne_bytes(word.try_into().unwrap());
        let e = eth(q);
        let want = if cas {
            if orig(a) == e.compare {
                e.swap_add
            } else {
                orig(a)
            }
        } else {
            orig(a).wrapping_add(e.swap_add)
        };
        assert_eq!(now, want, "word at {:#x}", e.va);
    }

    // Requester: the tool posts all 20 at once (TX depth 20); each original value lands in its
    // own 8-byte slot here.
    let client = Setup {
        max_dest_rd_atomic: 128,
        max_rd_atomic: 128,
        ..Setup::rc(VM2, VM1, qpn, qpn, client_psn, server_psn)
    };
    let mut r = Replay::new(&cap, client);
    let pd = r.pd;
    let (lkey, va) = r.mem.register(pd, 8 * reqs.len(), all_access());
    for (i, q) in reqs.iter().enumerate() {
        let e = eth(q);
        let op = if cas {
            SendOp::CompareSwap {
                remote_addr: e.va,
                rkey: e.rkey,
                compare: e.compare,
                swap: e.swap_add,
            }
        } else {
            SendOp::FetchAdd {
                remote_addr: e.va,
                rkey: e.rkey,
                add: e.swap_add,
            }
        };
        r.post_send(signaled(i as u64, op, sge(lkey, va + 8 * i as u64, 8)));
    }
    r.run_to_end();
    assert_streams(&r);
    let opcode = if cas {
        WcOpcode::CompSwap
    } else {
        WcOpcode::FetchAdd
    };
    let want: Vec<_> = (0..20).map(|i| ok(i, opcode, 8)).collect();
    assert_eq!(wcs(&mut r), want);
    for (slot, a) in r.mem.region(lkey).bytes.chunks(8).zip(&acks) {
        assert_eq!(u64::from_ne_bytes(slot.try_into().unwrap()), orig(a));
    }
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
    txt_says(
        name,
        &[
            "Atomic CMP_AND_SWAP BW Test",
            "local address: LID 0000 QPN 0x0018 PSN 0x622eca",
        ],
    );
    atomic(name, 0x18, 0x622eca, 0x622eca, true);
}
