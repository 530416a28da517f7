//! The same-host link (shared-memory lanes between softrdma devices on one host): falling back to
//! UDP when the peer is not a softrdma device or has the link off, a peer process that dies, and a
//! hostile or broken peer that writes garbage into a ring.
//!
//! Every other RC/UD test over two devices on loopback exercises the lanes too (they are on by
//! default); `loopback.rs` and `two_process.rs` run their byte-for-byte checks over both paths.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cpus::{allow, allowed_cpus, cpus_to_move_between};
use common::pair::{connect, free_port, ip, open, pair, stats};
use common::{pattern, wait_n, wait_one, Endpoint};
use softrdma_abi::ring::{ring_bytes, Producer};
use softrdma_abi::shm::Shm;
use softrdma_abi::sock::Conn;
use softrdma_verbs::{
    ConnectParams, Gid, Payload, Psn, QpCap, QpInitAttr, QpType, Qpn, RecvWr, SendFlags, SendOp, SendWr, WcStatus,
};

/// The slot size a lane's hello must announce (same_host.rs: 8-byte header + 4608, in whole lines).
const SLOT_SIZE: u32 = 4672;

/// RDMA WRITE `len` bytes from `a` to `b`, READ them back, and compare byte for byte.
fn write_read(a: &Endpoint, b: &Endpoint, len: usize, seed: u32) {
    let data = pattern(len, seed);
    a.mr.write(0, &data).unwrap();
    a.post(1, SendOp::Write { remote_addr: b.mr.addr() + 4096, rkey: b.mr.rkey() }, 0, len);
    wait_one(&a.cq, 1);
    assert!(b.mr.to_vec(4096, len).unwrap() == data, "written data");
    a.post(2, SendOp::Read { remote_addr: b.mr.addr() + 4096, rkey: b.mr.rkey() }, 512 << 10, len);
    wait_one(&a.cq, 2);
    assert!(a.mr.to_vec(512 << 10, len).unwrap() == data, "read data");
}

/// Poll `f` until it holds, or panic after `limit`.
fn eventually(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn falls_back_to_udp_when_the_peer_has_the_link_off() {
    let (a, b, _) = pair(16, [true, false]);
    write_read(&a, &b, 100_000, 1);
    write_read(&b, &a, 5000, 2);
    let (sa, sb) = (a.ctx.same_host_stats(), b.ctx.same_host_stats());
    // A looked for B's lane and found no listener; B never tried. Everything went over UDP with
    // verified ICRCs.
    assert!(sa.enabled && sa.connect_failures >= 1 && sa.lanes_out == 0 && sa.tx_pkts == 0, "{sa:?}");
    assert!(!sb.enabled && sb.connect_failures == 0 && sb.tx_pkts == 0 && sb.rx_pkts == 0, "{sb:?}");
    assert!(a.ctx.icrc_stats().verified > 0 && b.ctx.icrc_stats().verified > 0);
    assert_eq!((a.ctx.icrc_stats().bad, b.ctx.icrc_stats().bad), (0, 0));
}

#[test]
fn falls_back_to_udp_when_the_peer_is_not_a_softrdma_device() {
    // A plain UDP socket where the peer device would be: no lane, the packet goes out over UDP,
    // sealed with a correct ICRC.
    let (ia, ib) = (ip(17, 1), ip(17, 2));
    let peer = UdpSocket::bind((ib, 0)).unwrap();
    let port = peer.local_addr().unwrap().port();
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let a = Endpoint::new(open("sh17a", ia, port, true), 1 << 16, 16);
    connect(&a, 0x99, ib);
    a.post(1, SendOp::Send, 0, 64);
    let mut buf = [0u8; 2048];
    let (n, from) = peer.recv_from(&mut buf).expect("the request over UDP");
    assert_eq!(from, SocketAddr::new(IpAddr::V4(ia), port));
    let (_, verdict) = softrdma_wire::roce::verify_udp_payload(from, peer.local_addr().unwrap(), &buf[..n]).unwrap();
    assert_eq!(verdict, softrdma_wire::roce::UdpVerdict::Verified);
    let s = a.ctx.same_host_stats();
    assert!(s.connect_failures >= 1 && s.tx_pkts == 0 && s.lanes_out == 0, "{s:?}");
}

/// Set in the child of `peer_process_death_falls_back_without_panics`: `PORT`.
const CHILD_ENV: &str = "SOFTRDMA_SAME_HOST_TEST_CHILD";

#[test]
fn peer_process_death_falls_back_without_panics() {
    if let Ok(port) = std::env::var(CHILD_ENV) {
        return child(port.parse().unwrap());
    }
    let (ia, ib) = (ip(18, 1), ip(18, 2));
    let port = free_port(&[ia, ib]);
    let a = Endpoint::new(open("sh18a", ia, port, true), 1 << 20, 64);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_process_death_falls_back_without_panics", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the peer process");
    let mut to = child.stdin.take().unwrap();
    let mut from = BufReader::new(child.stdout.take().unwrap());
    let mut child = KillOnDrop(child);
    // The child prints "PEER <qpn> <addr> <rkey>" (the test harness prints its own lines too).
    let mut line = String::new();
    let (qpn, addr, rkey) = loop {
        line.clear();
        assert!(from.read_line(&mut line).unwrap() > 0, "the child ended early");
        // The harness may have printed "test <name> ... " on the same line.
        if let Some(rest) = line.trim().split_once("PEER ").map(|(_, r)| r) {
            let v: Vec<u64> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
            break (v[0] as u32, v[1], v[2] as u32);
        }
    };
    writeln!(to, "{}", a.qp.qpn().value()).unwrap();
    connect(&a, qpn, ib);
    // Over the lane, byte for byte (the child checks nothing; we READ back what we wrote).
    let data = pattern(300_000, 7);
    a.mr.write(0, &data).unwrap();
    a.post(1, SendOp::Write { remote_addr: addr, rkey }, 0, data.len());
    wait_one(&a.cq, 1);
    a.post(2, SendOp::Read { remote_addr: addr, rkey }, 512 << 10, data.len());
    wait_one(&a.cq, 2);
    assert!(a.mr.to_vec(512 << 10, data.len()).unwrap() == data, "read back");
    let s = a.ctx.same_host_stats();
    assert!(s.lanes_out == 1 && s.lanes_in == 1 && s.tx_pkts > 0 && s.rx_pkts > 0, "{s:?}");

    // Kill the peer: its lanes hang up; ours go back to UDP, and the next request ends in a
    // retry-exceeded completion (nobody answers on UDP either) instead of hanging or panicking.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    eventually(Duration::from_secs(5), "the lanes to close", || {
        let s = a.ctx.same_host_stats();
        s.lanes_out == 0 && s.lanes_in == 0 && s.peer_gone >= 2
    });
    a.post(3, SendOp::Write { remote_addr: addr, rkey }, 0, 4096);
    let wc = wait_n(&a.cq, 1, Duration::from_secs(20)).remove(0);
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::RetryExcErr), "{wc:?}");
    let s = a.ctx.same_host_stats();
    assert_eq!((s.lanes_out, s.rx_malformed, s.ring_corrupt), (0, 0, 0), "{s:?}");
}

/// Kills the peer process if the test fails before it does.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn child(port: u16) {
    let b = Endpoint::new(open("sh18b", ip(18, 2), port, true), 1 << 20, 64);
    println!("\nPEER {} {} {}", b.qp.qpn().value(), b.mr.addr(), b.mr.rkey());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    connect(&b, line.trim().parse().unwrap(), ip(18, 1));
    // Serve until killed.
    loop {
        let mut out = Vec::new();
        b.cq.poll(16, &mut out).unwrap();
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The device's lane name (same_host.rs): the abstract socket `\0softrdma-roce/<ip:port>`.
fn lane_conn(dst: SocketAddr) -> Conn {
    let mut name = vec![0u8];
    name.extend_from_slice(format!("softrdma-roce/{dst}").as_bytes());
    let path = std::path::Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&name));
    Conn::connect(path).expect("connect to the device's lane listener")
}

#[test]
fn a_corrupted_ring_is_counted_and_dropped_without_panics() {
    let (a, b, port) = pair(19, [true, true]);
    write_read(&a, &b, 70_000, 3);
    assert_eq!(stats(&b).lanes_in, 1);
    let b_addr = SocketAddr::new(IpAddr::V4(ip(19, 2)), port);
    // A hostile producer: our own lane into B, announced as coming from an address nobody has.
    let slots = 16u32;
    let shm = Shm::create("hostile", ring_bytes(slots, SLOT_SIZE)).unwrap();
    let ring = shm.ring(0, slots, SLOT_SIZE).unwrap();
    ring.init();
    let conn = lane_conn(b_addr);
    let hello = format!("softrdma-lane/2 127.0.19.9:{} {b_addr} {slots} {SLOT_SIZE}", b_addr.port());
    conn.send(hello.as_bytes(), &[shm.fd().as_raw_fd()]).unwrap();
    eventually(Duration::from_secs(5), "B to accept the lane", || stats(&b).lanes_in == 2);
    let mut p = Producer::new(ring);
    let drops = b.ctx.counters().drop_malformed;
    // 1. Lengths that do not fit the slot (u32::MAX says the ring moved: see below).
    for len in [u32::MAX - 1, SLOT_SIZE, 4096 + 512 + 1] {
        let s = p.slot_mut().unwrap();
        s[..4].copy_from_slice(&len.to_le_bytes());
        p.publish_tagged();
    }
    // 2. Lengths that fit, over bytes that are no IB packet (or a truncated one).
    for len in [0u32, 1, 11, 200, 4608] {
        let s = p.slot_mut().unwrap();
        s[..4].copy_from_slice(&len.to_le_bytes());
        for (i, x) in s[8..].iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31) ^ 0x5a;
        }
        p.publish_tagged();
    }
    eventually(Duration::from_secs(5), "B to take the garbage", || stats(&b).rx_malformed == 3);
    eventually(Duration::from_secs(5), "B to count the non-packets", || {
        b.ctx.counters().rcvd_pkts >= 5 && b.ctx.counters().drop_malformed > drops
    });
    // 3. A producer index far beyond the ring: the lane is dropped and counted, we are hung up on.
    let mut rogue = Producer::new(shm.ring(0, slots, SLOT_SIZE).unwrap());
    for _ in 0..100 {
        rogue.publish();
    }
    eventually(Duration::from_secs(5), "B to drop the broken lane", || {
        let s = stats(&b);
        s.ring_corrupt == 1 && s.lanes_in == 1
    });
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(conn.recv().unwrap().is_none(), "B hung up");
    // A's lane is untouched and B still works.
    write_read(&a, &b, 70_000, 4);
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.lanes_out == 1 && sb.lanes_in == 1 && sb.ring_corrupt == 1 && sb.rx_malformed == 3, "{sa:?} {sb:?}");
}

#[test]
fn a_hello_that_lies_is_refused() {
    let (a, b, port) = pair(20, [true, true]);
    write_read(&a, &b, 1000, 5);
    let b_addr = SocketAddr::new(IpAddr::V4(ip(20, 2)), port);
    let shm = Shm::create("liar", ring_bytes(16, SLOT_SIZE)).unwrap();
    shm.ring(0, 16, SLOT_SIZE).unwrap().init();
    for hello in [
        // Another destination than the listener's address.
        format!("softrdma-lane/2 127.0.20.9:1 127.0.20.3:{} 16 {SLOT_SIZE}", b_addr.port()),
        // A ring larger than the memory.
        format!("softrdma-lane/2 127.0.20.9:1 {b_addr} 1024 {SLOT_SIZE}"),
        // Another slot size, a count that is no power of two, garbage.
        format!("softrdma-lane/2 127.0.20.9:1 {b_addr} 16 4096"),
        format!("softrdma-lane/2 127.0.20.9:1 {b_addr} 15 {SLOT_SIZE}"),
        "softrdma-lane/2 x y z w".to_string(),
        // A peer of the first lane protocol (whose rings never move).
        format!("softrdma-lane/1 127.0.20.9:1 {b_addr} 16 {SLOT_SIZE}"),
    ] {
        let conn = lane_conn(b_addr);
        conn.send(hello.as_bytes(), &[shm.fd().as_raw_fd()]).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(conn.recv().unwrap().is_none(), "refused: {hello}");
    }
    // An unsealed memfd (its owner could shrink it under B's mapping) is refused too.
    let conn = lane_conn(b_addr);
    // SAFETY: a plain memfd_create with a valid C string.
    let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), 0) };
    assert!(raw >= 0);
    // SAFETY: we own `raw`; ftruncate to the ring's size.
    assert_eq!(unsafe { libc::ftruncate(raw, ring_bytes(16, SLOT_SIZE) as libc::off_t) }, 0);
    conn.send(format!("softrdma-lane/2 127.0.20.9:1 {b_addr} 16 {SLOT_SIZE}").as_bytes(), &[raw]).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(conn.recv().unwrap().is_none(), "unsealed memory refused");
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(raw) };
    eventually(Duration::from_secs(5), "the refusals to be counted", || stats(&b).refused == 7);
    assert_eq!(stats(&b).lanes_in, 1);
    write_read(&a, &b, 1000, 6);
}

/// Busy-poll `ep`'s CQ until a completion with `wr_id` came; returns everything polled on the way.
fn poll_until(ep: &Endpoint, wr_id: u64) -> Vec<softrdma_verbs::WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while !out.iter().any(|wc: &softrdma_verbs::WorkCompletion| wc.wr_id == wr_id) {
        ep.cq.poll(16, &mut out).unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "no completion {wr_id}: {out:?}");
    }
    assert!(out.iter().all(|wc| wc.status == WcStatus::Success), "{out:?}");
    out
}

/// In a request-response exchange over a lane the peer publishes its reply and then the ACK of our
/// request: the poll that takes the reply's completion leaves the ACK in the lane, so our send's
/// completion comes with the next poll. The peer is this test: it reads A's requests from a UDP
/// socket and writes its answers into a lane of its own into A, with no doorbell (A's I/O thread
/// sleeps through it; a round in which it woke for a timer and took both in does not count).
#[test]
fn an_ack_behind_a_reply_waits_for_the_next_poll() {
    use softrdma_wire::opcode::base;
    use softrdma_wire::{AethRepr, BthRepr, IbRepr, Opcode, QpType as WireQpType, Syndrome};
    let (ia, peer_ip) = (ip(21, 1), ip(21, 2));
    let port = free_port(&[ia, peer_ip]);
    let peer = UdpSocket::bind((peer_ip, port)).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let a = Endpoint::new(open("sh21a", ia, port, true), 1 << 20, 64);
    // A long local ACK timeout (about a second): a stalled test thread must not make A retransmit.
    let mut p = ConnectParams::new(Qpn::new(0x99), Psn::new(0), Gid::from_ip(IpAddr::V4(peer_ip)), Psn::new(0));
    p.timeout = 18;
    a.qp.connect(&a.pd, &p).unwrap();
    let a_addr = SocketAddr::new(IpAddr::V4(ia), port);
    // Lanes of the test's own into A, written by hand, announced as coming from `src`.
    let shms = std::cell::RefCell::new(Vec::new());
    let open_lane = |src: Ipv4Addr, name: &str| {
        let slots = 16u32;
        let shm = Shm::create(name, ring_bytes(slots, SLOT_SIZE)).unwrap();
        let ring = shm.ring(0, slots, SLOT_SIZE).unwrap();
        ring.init();
        let conn = lane_conn(a_addr);
        let hello = format!("softrdma-lane/2 {src}:{port} {a_addr} {slots} {SLOT_SIZE}");
        conn.send(hello.as_bytes(), &[shm.fd().as_raw_fd()]).unwrap();
        shms.borrow_mut().push((shm, conn));
        Producer::new(ring)
    };
    let mut lane = open_lane(peer_ip, "replies");
    eventually(Duration::from_secs(5), "A to accept the lane", || stats(&a).lanes_in == 1);
    let mut other = open_lane(ip(21, 3), "other");
    eventually(Duration::from_secs(5), "A to accept the second lane", || stats(&a).lanes_in == 2);
    let publish = |lane: &mut Producer, repr: &IbRepr| {
        let s = lane.slot_mut().unwrap();
        let n = repr.emit(&mut s[8..]).unwrap();
        s[..4].copy_from_slice(&(n as u32).to_le_bytes());
        lane.publish_tagged();
    };
    let qpn = a.qp.qpn();
    let mut left = 0;
    // Three rounds in which the ACK waited behind the reply in its lane, then one with the ACK
    // first in another lane: a lane's first packet is always taken, so it comes with the reply.
    for round in 0..200u32 {
        a.qp.post_recv(softrdma_verbs::RecvWr { wr_id: 1 << 20, sgl: vec![a.sge(0, 64)].into() }).unwrap();
        a.post(u64::from(round), SendOp::Send, 0, 8);
        let mut buf = [0u8; 2048];
        let mut next = |want: u8| loop {
            let (n, _) = peer.recv_from(&mut buf).expect("a packet from A");
            let pkt = softrdma_wire::IbPacket::new_checked(&buf[..n]).unwrap();
            if pkt.bth().opcode().base() == want {
                return pkt.bth().psn();
            }
        };
        let psn = next(base::SEND_ONLY);
        // The reply (the peer's PSN `round`), then the ACK of A's request.
        let send = BthRepr::new(Opcode::of(WireQpType::Rc, base::SEND_ONLY).unwrap(), qpn, Psn::new(round));
        let mut reply = IbRepr::new(BthRepr { ack_req: true, ..send });
        reply.payload_len = 8;
        publish(&mut lane, &reply);
        let mut ack = IbRepr::new(BthRepr::new(Opcode::of(WireQpType::Rc, base::ACKNOWLEDGE).unwrap(), qpn, psn));
        let syndrome = Syndrome::Ack { credits: softrdma_wire::aeth::CREDITS_INVALID };
        ack.aeth = Some(AethRepr { syndrome, msn: round + 1 });
        let last = left == 3;
        publish(if last { &mut other } else { &mut lane }, &ack);
        let first = poll_until(&a, 1 << 20);
        let with_reply = first.iter().any(|wc| wc.wr_id == u64::from(round));
        if last {
            assert!(with_reply, "the ACK first in its lane waited: {first:?}");
            return;
        }
        if !with_reply {
            // The ACK waited in the lane: the next poll takes it in.
            left += 1;
            poll_until(&a, u64::from(round));
        }
        // A's ACK of the reply, over UDP.
        next(base::ACKNOWLEDGE);
    }
    panic!("no poll left the ACK behind a reply in the lane in 200 rounds");
}

/// `rounds` SEND ping-pongs between `a` (on `cpus.0`) and `b` (on `cpus.1`), each side
/// busy-polling its CQ on a thread pinned to its CPU; false if pinning was refused.
fn ping_pong_on(a: &Endpoint, b: &Endpoint, cpus: (usize, usize), rounds: u64) -> bool {
    ping_pong_from(a, b, cpus, false, rounds).is_some()
}

/// How a thread of [`ping_pong_from`] ended: the CPUs it was allowed at the end.
struct Ended {
    allowed: Vec<usize>,
}

/// [`ping_pong_on`], each thread started on its CPU; `release`: then allowed every CPU this
/// thread was (it stays where it is until something moves it). `None` if pinning was refused.
fn ping_pong_from(
    a: &Endpoint,
    b: &Endpoint,
    cpus: (usize, usize),
    release: bool,
    rounds: u64,
) -> Option<(Ended, Ended)> {
    let all = allowed_cpus();
    let recv = |ep: &Endpoint, id: u64| {
        ep.qp.post_recv(softrdma_verbs::RecvWr { wr_id: id, sgl: vec![ep.sge(8192, 64)].into() }).unwrap()
    };
    // Busy-poll until the receive completes (the SENDs' own completions pass by).
    let wait_recv = |ep: &Endpoint| {
        let mut out = Vec::new();
        let t = Instant::now();
        loop {
            out.clear();
            ep.cq.poll(4, &mut out).unwrap();
            if out.iter().any(|w| w.opcode == softrdma_verbs::WcOpcode::Recv) {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "no receive");
        }
    };
    recv(a, 0);
    recv(b, 0);
    // Both threads pinned, or neither side starts.
    let pinned = std::sync::Barrier::new(2);
    let refused = std::sync::atomic::AtomicBool::new(false);
    let pin_both = |cpu| {
        if !allow(0, &[cpu]) {
            refused.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        pinned.wait();
        if release && !allow(0, &all) {
            refused.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        pinned.wait();
        !refused.load(std::sync::atomic::Ordering::SeqCst)
    };
    let ended = || Ended { allowed: allowed_cpus() };
    std::thread::scope(|s| {
        let pong = s.spawn(|| {
            if !pin_both(cpus.1) {
                return None;
            }
            for i in 0..rounds {
                wait_recv(b);
                recv(b, i + 1);
                b.post(i, SendOp::Send, 0, 8);
            }
            Some(ended())
        });
        let ping = s.spawn(|| {
            if !pin_both(cpus.0) {
                return None;
            }
            for i in 0..rounds {
                a.post(i, SendOp::Send, 0, 8);
                wait_recv(a);
                recv(a, i + 1);
            }
            Some(ended())
        });
        Some((ping.join().unwrap()?, pong.join().unwrap()?))
    })
}

/// Two busy pollers of one lane's two ends on one CPU (the kernel puts a process woken by
/// another on the waker's CPU, and may take milliseconds to spread them): each says its CPU in
/// its outbound lane, and an empty poll that finds the peer's poller on its own CPU gives up the
/// core at once instead of spinning first. Pinned there, neither can move. On two CPUs nobody
/// yields for that.
#[test]
fn pollers_on_one_cpu_give_it_up_at_once() {
    let cpus = allowed_cpus();
    let (a, b, _) = pair(42, [true, true]);
    if cpus.is_empty() || !ping_pong_on(&a, &b, (cpus[0], cpus[0]), 300) {
        eprintln!("skipped: threads cannot be pinned here");
        return;
    }
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.rx_pkts > 0 && sb.rx_pkts > 0, "{sa:?} {sb:?}");
    assert!(sa.poller_yields > 0 && sb.poller_yields > 0, "{sa:?} {sb:?}");
    if cpus.len() < 2 {
        return;
    }
    let (c, d, _) = pair(43, [true, true]);
    assert!(ping_pong_on(&c, &d, (cpus[0], cpus[1]), 300));
    let (sc, sd) = (stats(&c), stats(&d));
    assert!(sc.rx_pkts > 0, "{sc:?}");
    assert_eq!((sc.poller_yields, sd.poller_yields), (0, 0), "{sc:?} {sd:?}");
    assert_eq!((sa.poller_moves, sb.poller_moves, sc.poller_moves, sd.poller_moves), (0, 0, 0, 0));
}

/// A request that came through a lane is ACKed by the poll that takes it in, before the poll
/// returns its completion: over a lane the ACK costs no system call, and a peer waiting for its
/// send's completion before it goes on (perftest's latency tests) gets it before the reply. Over
/// UDP the poll leaves the ACK owed to go after the reply (`ack_order.rs`); here no poll does.
#[test]
fn a_request_through_a_lane_is_acked_at_once() {
    let cpus = allowed_cpus();
    let (a, b, _) = pair(44, [true, true]);
    if cpus.is_empty() || !ping_pong_on(&a, &b, (cpus[0], cpus[cpus.len() - 1]), 2000) {
        eprintln!("skipped: threads cannot be pinned here");
        return;
    }
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.rx_pkts >= 2000 && sb.rx_pkts >= 2000, "{sa:?} {sb:?}");
    assert_eq!((a.ctx.flushes_left_owed(), b.ctx.flushes_left_owed()), (0, 0));
}

/// A connected QP whose peer is a softrdma device on this host has its lane open once it is
/// ready to receive (INIT to RTR), before its first packet: the first message of an exchange
/// does not wait for the connection and the ring's memory. A peer with the link off is tried
/// and left to UDP the same way.
#[test]
fn a_connected_qp_has_its_lane_before_its_first_packet() {
    let (a, b, _) = pair(48, [true, true]);
    for ep in [&a, &b] {
        let s = stats(ep);
        assert_eq!((s.connects, s.lanes_out, s.tx_pkts), (1, 1, 0), "{s:?}");
    }
    write_read(&a, &b, 64, 3);
    let s = stats(&a);
    assert_eq!((s.connects, s.lanes_out), (1, 1), "one lane, opened once: {s:?}");
    assert!(s.tx_pkts >= 2, "{s:?}");
    let (c, _d, _) = pair(49, [true, false]);
    let s = stats(&c);
    assert_eq!((s.connects, s.connect_failures, s.lanes_out), (0, 1, 0), "{s:?}");
}

/// A poll that hands out a READ's or an atomic's completion does not arm the device: the
/// application has what it asked for (perftest's read and atomic latency loops post again at
/// once, and arming cost each round trip 0.1 µs); an RDMA WRITE's completion, with nothing else
/// to wait for, does.
#[test]
fn a_read_or_atomic_completion_leaves_the_device_unarmed() {
    let (a, b, _) = pair(50, [true, true]);
    let remote = |off: u64| (b.mr.addr() + off, b.mr.rkey());
    for round in 0..20u64 {
        let (remote_addr, rkey) = remote(4096);
        a.post(round * 3 + 1, SendOp::Read { remote_addr, rkey }, 0, 64);
        wait_one(&a.cq, round * 3 + 1);
        let (remote_addr, rkey) = remote(8192);
        a.post(round * 3 + 2, SendOp::FetchAdd { remote_addr, rkey, add: 1 }, 256, 8);
        wait_one(&a.cq, round * 3 + 2);
    }
    assert_eq!(stats(&a).polls_left_armed, 0, "{:?}", stats(&a));
    assert_eq!(b.mr.to_vec(8192, 8).unwrap(), 20u64.to_ne_bytes(), "every FETCH_ADD executed once");
    let (remote_addr, rkey) = remote(4096);
    a.post(100, SendOp::Write { remote_addr, rkey }, 0, 64);
    wait_one(&a.cq, 100);
    assert_eq!(stats(&a).polls_left_armed, 1, "{:?}", stats(&a));
}

/// An application that waits for its peer's RDMA WRITE by watching its memory and polls no CQ
/// meanwhile (perftest's write latency loop) is not left waiting for the I/O thread's next look:
/// the poll that handed out its own WRITE's completion, with no receive posted and nothing else
/// pending, left the inbound lanes asking for doorbells, and the peer's WRITE rings the I/O
/// thread awake. Each side writes a counter into the other's region and waits in memory for the
/// other's; every value arrives, and the doorbells woke the I/O threads.
#[test]
fn a_write_awaited_in_memory_rings_the_io_thread_awake() {
    let (a, b, _) = pair(45, [true, true]);
    writes_awaited_in_memory(&a, &b);
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.rx_pkts > 0 && sb.rx_pkts > 0, "{sa:?} {sb:?}");
}

/// As [`a_write_awaited_in_memory_rings_the_io_thread_awake`], over UDP: the I/O thread, woken
/// when the application left, watches the UDP sockets while it is away.
#[test]
fn a_write_awaited_in_memory_over_udp_wakes_the_io_thread() {
    let (a, b, _) = pair(46, [false, false]);
    writes_awaited_in_memory(&a, &b);
    assert_eq!(stats(&a).rx_pkts + stats(&b).rx_pkts, 0);
}

/// Each side writes a counter into the other's region and waits in memory for the other's; every
/// value must arrive, both sides must have left polls armed and a doorbell or datagram have woken
/// an I/O thread from its sleep aside. (On a loaded machine a watcher may be away long enough for
/// its I/O thread to stop standing aside in every round of a run, and take over on its own: up to
/// five runs of 50 rounds.)
fn writes_awaited_in_memory(a: &Endpoint, b: &Endpoint) {
    for run in 0..5u8 {
        writes_awaited_in_memory_once(a, b, run * 50);
        let (sa, sb) = (stats(a), stats(b));
        assert!(sa.polls_left_armed > 0 && sb.polls_left_armed > 0, "{sa:?} {sb:?}");
        if sa.armed_wakeups + sb.armed_wakeups > 0 {
            return;
        }
    }
    panic!("no I/O thread was woken while its application waited in memory: {:?} {:?}", stats(a), stats(b));
}

/// 50 rounds of [`writes_awaited_in_memory`], the counters starting after `base`.
fn writes_awaited_in_memory_once(a: &Endpoint, b: &Endpoint, base: u8) {
    const ROUNDS: u8 = 50;
    const AT: usize = 100;
    let write = |me: &Endpoint, peer: &Endpoint, v: u8| {
        me.mr.write(0, &[v]).unwrap();
        me.post(u64::from(v), SendOp::Write { remote_addr: peer.mr.addr() + AT as u64, rkey: peer.mr.rkey() }, 0, 1);
        wait_one(&me.cq, u64::from(v));
    };
    let watch = |me: &Endpoint, v: u8| {
        let t = Instant::now();
        let mut byte = [0u8];
        while byte[0] != v {
            me.mr.read(AT, &mut byte).unwrap();
            assert!(t.elapsed() < Duration::from_secs(20), "value {v} never arrived (last {})", byte[0]);
            // Four watching threads on a small machine would keep the I/O threads off the CPUs.
            std::thread::yield_now();
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            for v in base + 1..=base + ROUNDS {
                write(a, b, v);
                watch(a, v);
            }
        });
        s.spawn(|| {
            for v in base + 1..=base + ROUNDS {
                watch(b, v);
                write(b, a, v);
            }
        });
    });
}

/// Arming leaves the I/O thread's own doorbell requests alone. An event-driven WRITE client
/// (no receive posted) arms with the poll that takes each completion, then sleeps; its I/O
/// thread, no longer standing aside, asks the lane for doorbells in its own sleep; the next post
/// disarms. Were that to withdraw the I/O thread's requests, the peer's ACK would ring nobody and
/// wait for the I/O thread's timer (tens of milliseconds): the peer rings for (nearly) every ACK.
#[test]
fn disarming_leaves_the_io_threads_doorbells_alone() {
    const ROUNDS: u64 = 8;
    let (a, b, _) = pair(47, [true, true]);
    write_read(&a, &b, 64, 1);
    let ch = a.ctx.create_comp_channel().unwrap();
    let cq = a.ctx.create_cq(64, Some(&ch)).unwrap();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = |cq| QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
    let qa = a.pd.create_qp(&attr(&cq)).unwrap();
    let qb = b.pd.create_qp(&attr(&b.cq)).unwrap();
    let params = |qpn, ip| ConnectParams::new(qpn, Psn::new(0), Gid::from_ip(IpAddr::V4(ip)), Psn::new(0));
    qa.connect(&a.pd, &params(qb.qpn(), ip(47, 2))).unwrap();
    qb.connect(&b.pd, &params(qa.qpn(), ip(47, 1))).unwrap();
    let rings = stats(&b).doorbells;
    for round in 1..=ROUNDS {
        cq.req_notify(false).unwrap();
        let write = SendOp::Write { remote_addr: b.mr.addr() + 100, rkey: b.mr.rkey() };
        let payload = Payload::Sgl(vec![a.sge(0, 8)].into());
        qa.post_send(SendWr { wr_id: round, op: write, payload, flags: SendFlags::SIGNALED, ud: None }).unwrap();
        assert!(ch.get_cq_event(Some(Duration::from_secs(10))).is_some(), "no completion event");
        assert_eq!(wait_n(&cq, 1, Duration::from_secs(10))[0].wr_id, round);
        // Away long enough for the I/O thread to stop standing aside and sleep on its own.
        std::thread::sleep(Duration::from_millis(5));
    }
    let sa = stats(&a);
    assert!(sa.polls_left_armed >= ROUNDS - 1, "{sa:?}");
    let rang = stats(&b).doorbells - rings;
    assert!(rang >= ROUNDS / 2, "the peer rang {rang} times in {ROUNDS} rounds: {sa:?}");
}

/// Two busy pollers that start on one CPU but may run on others: one of them (the one with the
/// larger poller id) moves to another CPU once it has yielded to the other a few times, and its
/// allowed CPUs are the same afterwards. (The kernel may spread them first, or put them together
/// again: each round needs its yields; every round whose mover yielded enough must have moved it.)
#[test]
fn a_poller_sharing_its_cpu_with_its_peer_moves_off() {
    let Some(cpus) = cpus_to_move_between() else { return };
    let mut checked = 0;
    // Up to 120 rounds: alongside the other tests of this binary the kernel sometimes spreads
    // the two within their first round trips for a score of rounds in a row (once in CI).
    for round in 0..120u8 {
        let (a, b, _) = pair(100 + round, [true, true]);
        let Some((ea, eb)) = ping_pong_from(&a, &b, (cpus[0], cpus[0]), true, 400) else {
            eprintln!("skipped: threads cannot be pinned here");
            return;
        };
        assert_eq!((&ea.allowed, &eb.allowed), (&cpus, &cpus), "the threads' allowed CPUs changed");
        let (sa, sb) = (stats(&a), stats(&b));
        // One of the two moves (the larger id); the other never does. The mover yields 8 times
        // and moves at the 9th poll that finds the other on its CPU: once both sides counted 9
        // yields or moves, the mover has moved.
        assert!(sa.poller_moves == 0 || sb.poller_moves == 0, "both moved: {sa:?} {sb:?}");
        if (sa.poller_yields + sa.poller_moves).min(sb.poller_yields + sb.poller_moves) >= 9 {
            assert!(sa.poller_moves + sb.poller_moves >= 1, "yielded without moving: {sa:?} {sb:?}");
            checked += 1;
        }
        if checked == 2 {
            return;
        }
    }
    // Spreading them within 8 round trips, 120 times out of 120, is not something the kernel does.
    assert!(checked > 0, "the pollers never yielded enough to move");
}

/// A lane's ring starts with 32 slots and grows four times at a time, up to 512, whenever its
/// sender finds it full, and goes back to 32 once it has been quiet for two seconds. The receiver
/// here is the test itself, which takes nothing until A has sent everything: A fills the 32-slot
/// ring (31 packets and the slot saying it moved), then the 128-slot one, then writes on in the
/// 512-slot one. Read back in order, following the rings as a device does, the packets are all
/// there, PSN after PSN, and so are those sent after the ring shrank.
#[test]
fn a_lane_ring_starts_small_grows_when_full_and_shrinks_when_quiet() {
    use softrdma_abi::ring::Consumer;
    use softrdma_abi::sock::Listener;
    let (ia, ib) = (ip(54, 1), ip(54, 2));
    let port = free_port(&[ia, ib]);
    let b_addr = SocketAddr::new(IpAddr::V4(ib), port);
    // B's UDP address and lane name, held by the test.
    let _udp = UdpSocket::bind(b_addr).unwrap();
    let mut name = vec![0u8];
    name.extend_from_slice(format!("softrdma-roce/{b_addr}").as_bytes());
    let listener =
        Listener::bind(std::path::Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&name)))
            .unwrap();
    let a = Endpoint::new(open("sh54a", ia, port, true), 1 << 20, 64);
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = QpInitAttr { qp_type: QpType::Uc, send_cq: &a.cq, recv_cq: &a.cq, srq: None, cap, sq_sig_all: false };
    let qa = a.pd.create_qp(&attr).unwrap();
    // Reaching RTR opens the lane: to the test's listener.
    let mut peer = ConnectParams::new(Qpn::new(0x77), Psn::new(0), Gid::from_ip(IpAddr::V4(ib)), Psn::new(0));
    peer.mtu = softrdma_verbs::Mtu::M4096;
    qa.connect(&a.pd, &peer).unwrap();
    let conn = listener.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (hello, mut fds) = conn.recv().unwrap().expect("A's hello");
    let hello = String::from_utf8(hello).unwrap();
    assert_eq!(hello, format!("softrdma-lane/2 {} {b_addr} 32 {SLOT_SIZE}", SocketAddr::new(IpAddr::V4(ia), port)));
    let mut shm = Shm::open(fds.remove(0), ring_bytes(32, SLOT_SIZE)).unwrap();
    let mut cons = Consumer::new(shm.ring(0, 32, SLOT_SIZE).unwrap());
    assert_eq!(stats(&a).ring_slots_out, 32);
    // Asleep on the first ring, as a device's I/O thread would be: A rings it when the ring moves
    // (later doorbell checks look at the new ring only).
    assert!(cons.request_doorbell());
    // 50 WRITEs of 16 KiB: 200 packets, none taken until all are sent. The lane is quiet from a
    // moment after `t`.
    let t = Instant::now();
    const MSG: usize = 16 << 10;
    let wrs = (0..50).map(|k| SendWr {
        wr_id: k as u64,
        op: SendOp::Write { remote_addr: 0x1000 + (k * MSG) as u64, rkey: 0x99 },
        payload: Payload::Sgl(vec![a.sge(k * MSG, MSG)].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    });
    qa.post_send_list(wrs).unwrap();
    let wcs = wait_n(&a.cq, 50, Duration::from_secs(30));
    assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success), "{wcs:?}");
    let sa = stats(&a);
    assert!(sa.rings_grown == 2 && sa.ring_slots_out == 512 && sa.tx_pkts == 200, "{sa:?}");
    let (mut psn, mut rings, mut doorbells) = (0u32, vec![32], 0);
    // Take the packets up to PSN `until`, following the rings as a device does.
    let mut take = |until: u32, psn: &mut u32, rings: &mut Vec<u32>| {
        while *psn < until {
            let slot = cons.front_tagged().unwrap_or_else(|| panic!("packet {psn} missing"));
            let len = u32::from_le_bytes(slot[..4].try_into().unwrap());
            if len == u32::MAX {
                let (mut msg, mut fds) = conn.recv().unwrap().expect("the next ring");
                while msg == [1] {
                    doorbells += 1;
                    (msg, fds) = conn.recv().unwrap().expect("the next ring");
                }
                let slots: u32 = String::from_utf8(msg).unwrap().strip_prefix("move ").unwrap().parse().unwrap();
                rings.push(slots);
                let next = Shm::open(fds.remove(0), ring_bytes(slots, SLOT_SIZE)).unwrap();
                cons = Consumer::new(next.ring(0, slots, SLOT_SIZE).unwrap());
                shm = next;
                continue;
            }
            let pkt = softrdma_wire::IbPacket::new_checked(&slot[8..][..len as usize]).unwrap();
            assert_eq!(pkt.bth().psn().value(), *psn, "packets out of order");
            assert_eq!(pkt.payload().len(), 4096);
            *psn += 1;
            cons.advance();
        }
        assert!(cons.front_tagged().is_none(), "more than {until} packets");
    };
    take(200, &mut psn, &mut rings);
    assert_eq!(rings, [32, 128, 512]);
    assert_eq!(stats(&a).doorbells, 1, "the first ring's doorbell, rung as it moved");
    // Quiet for two seconds with everything taken: A moves back to 32 slots (its maintenance runs
    // while it polls), and its next packets come in that ring.
    while stats(&a).rings_shrunk == 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the grown ring never shrank: {:?}", stats(&a));
        a.cq.poll(1, &mut Vec::new()).unwrap();
        std::thread::yield_now();
    }
    assert!(t.elapsed() >= Duration::from_secs(2), "shrank before the lane was quiet for 2 s");
    let sa = stats(&a);
    assert!(sa.rings_shrunk == 1 && sa.ring_slots_out == 32 && sa.rings_grown == 2, "{sa:?}");
    let wrs = (0..4).map(|k| SendWr {
        wr_id: 100 + k as u64,
        op: SendOp::Write { remote_addr: 0x1000 + (k * MSG) as u64, rkey: 0x99 },
        payload: Payload::Sgl(vec![a.sge(k * MSG, MSG)].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    });
    qa.post_send_list(wrs).unwrap();
    wait_n(&a.cq, 4, Duration::from_secs(30));
    take(216, &mut psn, &mut rings);
    assert_eq!(rings, [32, 128, 512, 32]);
    assert_eq!((doorbells, stats(&a).doorbells), (1, 1));
    drop(shm);
}

/// A lane that grows and shrinks loses nothing: UC WRITEs (which nothing retransmits, so a packet
/// lost or reordered where the ring moves leaves a WRITE missing or torn in the receiver's memory)
/// from A to B, 256 packets at once in one flush (the receiver's doorbell comes at its end), until
/// the lane has grown, and again after it shrank on its own; each round checked byte for byte.
/// Then RC traffic both ways.
#[test]
fn a_growing_lane_loses_no_packet() {
    let (a, b, _) = pair(52, [true, true]);
    for seed in 0..20 {
        write_read(&a, &b, 64, seed);
    }
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.lanes_out == 1 && sa.ring_slots_out == 32 && sa.rings_grown == 0, "{sa:?}");
    assert!(sb.lanes_out == 1 && sb.ring_slots_out == 32 && sb.rings_grown == 0, "{sb:?}");
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = |cq| QpInitAttr { qp_type: QpType::Uc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
    let (qa, qb) = (a.pd.create_qp(&attr(&a.cq)).unwrap(), b.pd.create_qp(&attr(&b.cq)).unwrap());
    let params = |qpn, ip| ConnectParams::new(qpn, Psn::new(0), Gid::from_ip(IpAddr::V4(ip)), Psn::new(0));
    qa.connect(&a.pd, &params(qb.qpn(), ip(52, 2))).unwrap();
    qb.connect(&b.pd, &params(qa.qpn(), ip(52, 1))).unwrap();
    // Each round: 64 WRITEs of 16 KiB (four packets each) in one post.
    const MSG: usize = 16 << 10;
    let round = |seed: u32| {
        let data = pattern(64 * MSG, seed);
        a.mr.write(0, &data).unwrap();
        qa.post_send_list((0..64).map(|k| SendWr {
            wr_id: k as u64,
            op: SendOp::Write { remote_addr: b.mr.addr() + (k * MSG) as u64, rkey: b.mr.rkey() },
            payload: Payload::Sgl(vec![a.sge(k * MSG, MSG)].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        }))
        .unwrap();
        let wcs = wait_n(&a.cq, 64, Duration::from_secs(30));
        assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success), "{wcs:?}");
        eventually(Duration::from_secs(10), "every WRITE of the round in B's memory", || {
            b.mr.to_vec(0, 64 * MSG).unwrap() == data
        });
    };
    for seed in 100..150 {
        round(seed);
        if stats(&a).rings_grown > 0 {
            break;
        }
    }
    let (sa, sb) = (stats(&a), stats(&b));
    assert!(sa.lanes_out == 1 && sa.rings_grown >= 1 && sa.tx_dropped == 0, "never grew: {sa:?}");
    assert!(sb.lanes_in == 1 && sb.ring_corrupt == 0 && sb.rx_malformed == 0 && sb.peer_gone == 0, "{sb:?}");
    // Left alone (no thread polls A: its I/O thread looks every 200 ms), the lane goes back to 32
    // slots after 2 s, B follows, and the next round arrives whole in the small ring.
    eventually(Duration::from_secs(30), "the quiet lane to shrink", || stats(&a).rings_shrunk == 1);
    assert_eq!(stats(&a).ring_slots_out, 32);
    round(200);
    let sb = stats(&b);
    assert!(sb.lanes_in == 1 && sb.ring_corrupt == 0 && sb.rx_malformed == 0 && sb.peer_gone == 0, "{sb:?}");
    // The grown lane carries RC traffic both ways as before.
    write_read(&a, &b, 300_000, 7);
    write_read(&b, &a, 300_000, 8);
    assert_eq!(stats(&a).lanes_out, 1);
}

/// A sender that says its ring moved without sending the ring, or moves to a ring of no lane's
/// size, has its lane dropped (counted in `ring_corrupt`, and hung up on); one that sends a ring
/// first is followed into it; one that sends more rings than a lane moves through is hung up on.
/// The device's other lane works throughout.
#[test]
fn a_ring_that_moves_where_it_sent_no_ring_is_dropped() {
    let (a, b, port) = pair(53, [true, true]);
    write_read(&a, &b, 70_000, 9);
    let b_addr = SocketAddr::new(IpAddr::V4(ip(53, 2)), port);
    let ring_of = |slots: u32| {
        let shm = Shm::create("mover", ring_bytes(slots, SLOT_SIZE)).unwrap();
        shm.ring(0, slots, SLOT_SIZE).unwrap().init();
        shm
    };
    let say_moved = |p: &mut Producer| {
        let s = p.slot_mut().unwrap();
        s[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        p.publish_tagged();
    };
    let open_lane = |from: u8| {
        let shm = ring_of(16);
        let conn = lane_conn(b_addr);
        let hello = format!("softrdma-lane/2 127.0.53.{from}:{port} {b_addr} 16 {SLOT_SIZE}");
        conn.send(hello.as_bytes(), &[shm.fd().as_raw_fd()]).unwrap();
        eventually(Duration::from_secs(5), "B to accept the lane", || stats(&b).lanes_in == 2);
        (Producer::new(shm.ring(0, 16, SLOT_SIZE).unwrap()), shm, conn)
    };
    let hung_up = |conn: &Conn| {
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(conn.recv().unwrap().is_none(), "B hung up");
    };
    // The lane is dropped as broken (the `corrupt`th), B hangs up, its other lane stays.
    let dropped = |conn: &Conn, corrupt: u64| {
        eventually(Duration::from_secs(5), "B to drop the lane", || stats(&b).ring_corrupt == corrupt);
        hung_up(conn);
        eventually(Duration::from_secs(5), "the lane gone", || stats(&b).lanes_in == 1);
    };
    // 1. Moved, and no ring sent.
    let (mut p, _shm, conn) = open_lane(9);
    say_moved(&mut p);
    dropped(&conn, 1);
    // A lane from `from` that sends a ring of `slots` slots announced with `msg`, then moves.
    let move_with = |from: u8, slots: u32, msg: &[u8]| {
        let (mut p, shm, conn) = open_lane(from);
        let next = ring_of(slots);
        conn.send(msg, &[next.fd().as_raw_fd()]).unwrap();
        say_moved(&mut p);
        (shm, conn)
    };
    // 2. Moved to a ring of a size no lane has.
    let (_shm, conn) = move_with(10, 8, b"move 12");
    dropped(&conn, 2);
    // 3. Moved to a ring of its own size (no sender does: it grows, or goes back to the first size).
    let (_shm, conn) = move_with(12, 16, b"move 16");
    dropped(&conn, 3);
    // 4. A larger ring sent first: B reads on in it (the garbage length there is counted).
    let (mut p, _shm, conn) = open_lane(11);
    let large = ring_of(64);
    conn.send(b"move 64", &[large.fd().as_raw_fd()]).unwrap();
    say_moved(&mut p);
    let mut q = Producer::new(large.ring(0, 64, SLOT_SIZE).unwrap());
    let malformed = stats(&b).rx_malformed;
    let s = q.slot_mut().unwrap();
    s[..4].copy_from_slice(&(SLOT_SIZE + 1).to_le_bytes());
    q.publish_tagged();
    eventually(Duration::from_secs(5), "B to read the new ring", || stats(&b).rx_malformed == malformed + 1);
    let sb = stats(&b);
    assert!(sb.lanes_in == 2 && sb.ring_corrupt == 3, "{sb:?}");
    // 5. More rings than any lane grows through, never moved to: hung up on as a peer gone.
    let gone = stats(&b).peer_gone;
    for _ in 0..9 {
        conn.send(b"move 128", &[large.fd().as_raw_fd()]).unwrap();
    }
    hung_up(&conn);
    eventually(Duration::from_secs(5), "the lane gone", || {
        let s = stats(&b);
        s.lanes_in == 1 && s.peer_gone == gone + 1
    });
    write_read(&a, &b, 70_000, 10);
    assert_eq!(stats(&a).lanes_out, 1);
}

/// A post toward a lane is built with the time of the application's last poll, and the clock is
/// read once its packet has left (`Hca::restamp`). After a pause longer than the QP's ACK timeout
/// (16.8 ms here), the retransmit timer the packet armed still runs from when it left: the first
/// poll after the post, long before the peer's ACK can come (nobody polls the peer: its I/O thread
/// answers), finds nothing expired and retransmits nothing.
#[test]
fn a_post_after_a_pause_times_its_packet_from_when_it_left() {
    let (a, b, _) = pair(55, [true, true]);
    eventually(Duration::from_secs(5), "the lane", || stats(&a).lanes_out == 1);
    for round in 0..3u64 {
        b.qp.post_recv(RecvWr { wr_id: round, sgl: vec![b.sge(0, 64)].into() }).unwrap();
        let mut wcs = Vec::new();
        a.cq.poll(1, &mut wcs).unwrap();
        assert!(wcs.is_empty());
        std::thread::sleep(Duration::from_millis(40));
        a.mr.write(0, &round.to_le_bytes()).unwrap();
        a.post(round, SendOp::Send, 0, 8);
        wait_one(&a.cq, round);
        assert_eq!(wait_one(&b.cq, round).byte_len, 8);
        assert_eq!(b.mr.to_vec(0, 8).unwrap(), round.to_le_bytes());
        assert_eq!(a.ctx.counters().retransmits, 0, "round {round}: a retransmission before the ACK could come");
    }
}
