//! RC traffic between two devices in two network namespaces the test creates, through an impaired
//! path equivalent to `tc netem loss 5% duplicate 1% reorder 10%` in each direction, and every
//! message still arrives intact and completes once, in order.
//!
//! This machine has no netem (see `TESTING.md`), so the impairment is built from two parts:
//!
//! * **loss**: an nftables rule on the INPUT hook of each namespace drops 5% of the RoCE datagrams
//!   arriving over the veth (`numgen random mod 100 < 5`). Its counters prove it fired.
//! * **duplication and reordering**: a UDP relay of the test's own, in namespace B, owns two extra
//!   addresses of B's veth: `.12`, which A believes is B's GID, and `.11`, which B believes is A's.
//!   It forwards each datagram to the real peer from the other address, sends 1% of them twice and
//!   holds 10% back for 0.2..3 ms so later ones overtake them. Rewriting the addresses invalidates
//!   the ICRC (it covers the IP addresses), so the relay re-seals every datagram with
//!   `softrdma_wire::roce::seal_udp_payload` for the header its own socket sends (DF, IPv4
//!   identification 0, as the devices' sockets do).
//!
//! ```text
//!  ns A                         ns B
//!  dev A 10.200.N.1 ── veth ──  relay .12 (A's "B")  ──lo──  dev B 10.200.N.2
//!                   (5% loss     relay .11 (B's "A")
//!                    at each end)
//! ```
//!
//! Both devices are requesters at once: 168 messages each way (24 rounds of SEND, SEND with
//! immediate, WRITE, WRITE with immediate, READ, FETCH_ADD, CMP_SWAP) of mixed sizes up to 64 KiB
//! (64 packets at MTU 1024), 24 in flight per side. Every completion (status, opcode, order, length,
//! immediate), every landed byte (plus a canary guard after it), every READ and every atomic result
//! and target word is checked; duplicated atomics must not apply twice.
//!
//! The namespaces get unique names per run and are deleted by a drop guard, also on failure. Opening
//! a device inside a namespace: a short-lived thread enters it with `setns(CLONE_NEWNET)` and, as
//! `ip netns exec` does, gives itself a private mount namespace with the namespace's own sysfs (the
//! device model reads `/sys/class/net`), then opens the device; its sockets stay in the namespace.
//! Without root, `ip` or `nft` the test prints `skipped: <reason>`; with `SOFTRDMA_TEST_STRICT=1`
//! (set by `.ci/run`) it fails instead.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{all_rights, compare, pattern, private_sysfs, sh, Endpoint};
use softrdma_verbs::{
    ConnectParams, Context, DeviceBuilder, Gid, Mtu, Payload, Psn, RecvWr, SendFlags, SendOp, SendWr, WcFlags,
    WcOpcode, WcStatus, WorkCompletion, ROCE_PORT,
};
use softrdma_wire::roce::seal_udp_payload;

const STRICT_ENV: &str = "SOFTRDMA_TEST_STRICT";

#[test]
fn rc_survives_loss_duplication_and_reordering_between_namespaces() {
    if let Err(reason) = preconditions() {
        if std::env::var_os(STRICT_ENV).is_some_and(|v| v == "1") {
            panic!("{STRICT_ENV}=1 and the namespace test cannot run: {reason}");
        }
        println!("skipped: {reason}");
        eprintln!("skipped: {reason}");
        return;
    }
    let net = match Net::create() {
        Ok(n) => n,
        Err(e) if std::env::var_os(STRICT_ENV).is_none_or(|v| v != "1") => {
            println!("skipped: could not set up the namespaces: {e}");
            eprintln!("skipped: could not set up the namespaces: {e}");
            return;
        }
        Err(e) => panic!("setting up the namespaces: {e}"),
    };
    run(&net);
}

fn preconditions() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("network namespaces need root".into());
    }
    for (tool, pkg) in [("ip", "iproute2"), ("nft", "nftables")] {
        let ok = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("`{tool}` is not installed (Debian package {pkg})"));
        }
    }
    Ok(())
}

/// The two namespaces, their veth pair and addresses; deleted when dropped.
struct Net {
    ns_a: String,
    ns_b: String,
    /// Namespaces created so far (deleted in Drop).
    created: Vec<String>,
    a: Ipv4Addr,
    b: Ipv4Addr,
    /// B's view of A, and A's view of B: the relay's two addresses in namespace B.
    relay_a: Ipv4Addr,
    relay_b: Ipv4Addr,
}

impl Net {
    fn create() -> Result<Net, String> {
        let pid = std::process::id();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let tag = format!("srdma-{pid}-{:x}", nanos & 0xffff);
        // A subnet number per run; the addresses exist only inside our namespaces anyway.
        let n = (pid % 250) as u8 + 1;
        let ip = |last| Ipv4Addr::new(10, 200, n, last);
        let mut net = Net {
            ns_a: format!("{tag}-a"),
            ns_b: format!("{tag}-b"),
            created: Vec::new(),
            a: ip(1),
            b: ip(2),
            relay_a: ip(11),
            relay_b: ip(12),
        };
        for ns in [net.ns_a.clone(), net.ns_b.clone()] {
            sh(&["ip", "netns", "add", &ns])?;
            net.created.push(ns);
        }
        let (na, nb) = (net.ns_a.as_str(), net.ns_b.as_str());
        // Created inside A with its peer moved straight into B: no name ever exists in the host's
        // namespace.
        sh(&["ip", "-n", na, "link", "add", "vA", "type", "veth", "peer", "name", "vB", "netns", nb])?;
        sh(&["ip", "-n", na, "addr", "add", &format!("{}/24", net.a), "dev", "vA"])?;
        for addr in [net.b, net.relay_a, net.relay_b] {
            sh(&["ip", "-n", nb, "addr", "add", &format!("{addr}/24"), "dev", "vB"])?;
        }
        for (ns, dev) in [(na, "vA"), (nb, "vB"), (na, "lo"), (nb, "lo")] {
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        }
        for (ns, dev) in [(na, "vA"), (nb, "vB")] {
            let rules = format!(
                "table inet softrdma_loss {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    \
                 iifname \"{dev}\" udp dport {ROCE_PORT} numgen random mod 100 < 5 counter drop\n  }}\n}}\n"
            );
            nft(ns, &rules)?;
        }
        Ok(net)
    }

    /// Datagrams the loss rule of namespace `ns` dropped.
    fn dropped(&self, ns: &str) -> u64 {
        let text = sh(&["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "softrdma_loss"]).unwrap();
        let after = text.split("counter packets ").nth(1).unwrap_or_else(|| panic!("no counter in {text}"));
        after.split(' ').next().unwrap().parse().unwrap()
    }
}

fn nft(ns: &str, rules: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e}"))?;
    child.stdin.take().unwrap().write_all(rules.as_bytes()).map_err(|e| format!("nft: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft in {ns} failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.created {
            if let Err(e) = sh(&["ip", "netns", "del", ns]) {
                eprintln!("warning: could not delete network namespace {ns}: {e}");
            }
        }
    }
}

/// Move the calling thread into network namespace `ns` (for good: call it on a thread of its own).
fn enter_netns(ns: &str) -> Result<(), String> {
    let path = format!("/var/run/netns/{ns}");
    let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    // SAFETY: setns on a valid descriptor; it changes only this thread's network namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("setns({path}): {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Open a device on `netdev` with address `ip` inside namespace `ns`.
fn open_in(ns: &str, name: &str, netdev: &str, ip: Ipv4Addr) -> Context {
    let (ns2, name2, netdev) = (ns.to_string(), name.to_string(), netdev.to_string());
    std::thread::spawn(move || -> Result<Context, String> {
        let (ns, name) = (ns2, name2);
        enter_netns(&ns)?;
        private_sysfs()?;
        DeviceBuilder::new(&name, &netdev).addr(IpAddr::V4(ip)).udp_port(ROCE_PORT).open().map_err(|e| e.to_string())
    })
    .join()
    .expect("namespace thread")
    .unwrap_or_else(|e| panic!("opening {name} in {ns}: {e}"))
}

/// A xorshift generator: deterministic for a printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct RelayStats {
    forwarded: u64,
    duplicated: u64,
    delayed: u64,
    foreign: u64,
    send_errors: u64,
}

/// The impairment relay (see the module docs). Runs in namespace `ns` until `stop`.
struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<RelayStats>>,
}

/// One direction: datagrams from `from` arriving on socket `rx` leave through socket `tx` to `to`.
struct Leg {
    from: SocketAddr,
    to: SocketAddr,
}

impl Relay {
    /// `a`, `b`: the devices; `ra`, `rb`: the relay's addresses B and A believe are their peers'.
    fn start(ns: &str, a: SocketAddr, b: SocketAddr, ra: SocketAddr, rb: SocketAddr, seed: u64) -> Relay {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (ns, st) = (ns.to_string(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let socks = (|| -> Result<[UdpSocket; 2], String> {
                enter_netns(&ns)?;
                let bind = |addr: SocketAddr| -> Result<UdpSocket, String> {
                    let s = UdpSocket::bind(addr).map_err(|e| format!("relay bind {addr}: {e}"))?;
                    s.set_nonblocking(true).unwrap();
                    let v: libc::c_int = libc::IP_PMTUDISC_DO;
                    // SAFETY: setsockopt reads a live c_int of the size given.
                    let rc = unsafe {
                        libc::setsockopt(
                            s.as_raw_fd(),
                            libc::IPPROTO_IP,
                            libc::IP_MTU_DISCOVER,
                            &v as *const libc::c_int as *const libc::c_void,
                            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                        )
                    };
                    assert_eq!(rc, 0, "IP_MTU_DISCOVER");
                    Ok(s)
                };
                // Socket 0 is "B" to A (it receives A's packets); socket 1 is "A" to B.
                Ok([bind(rb)?, bind(ra)?])
            })();
            match socks {
                Ok(socks) => {
                    tx.send(Ok(())).unwrap();
                    // Packets arriving on socket i come from legs[i].from and go out of the other
                    // socket to legs[i].to.
                    let legs = [Leg { from: a, to: b }, Leg { from: b, to: a }];
                    relay_loop(&socks, &legs, &st, Rng(seed))
                }
                Err(e) => {
                    tx.send(Err(e)).unwrap();
                    RelayStats::default()
                }
            }
        });
        rx.recv().unwrap().unwrap_or_else(|e| panic!("relay: {e}"));
        Relay { stop, thread: Some(thread) }
    }

    fn finish(mut self) -> RelayStats {
        self.stop.store(true, Ordering::Release);
        self.thread.take().unwrap().join().expect("relay thread")
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn relay_loop(socks: &[UdpSocket; 2], legs: &[Leg; 2], stop: &AtomicBool, mut rng: Rng) -> RelayStats {
    let mut stats = RelayStats::default();
    // Held-back datagrams: (due, outgoing socket, destination, bytes).
    let mut held: Vec<(Instant, usize, SocketAddr, Vec<u8>)> = Vec::new();
    let mut buf = vec![0u8; 65536];
    let local = [socks[0].local_addr().unwrap(), socks[1].local_addr().unwrap()];
    let send = |stats: &mut RelayStats, out: usize, to: SocketAddr, pkt: &[u8]| {
        if socks[out].send_to(pkt, to).is_err() {
            stats.send_errors += 1;
        }
    };
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let wait = held.iter().map(|h| h.0.saturating_duration_since(now)).min().unwrap_or(Duration::from_millis(20));
        let ts = libc::timespec { tv_sec: 0, tv_nsec: wait.min(Duration::from_millis(20)).as_nanos() as libc::c_long };
        let mut fds = [0, 1].map(|i| libc::pollfd { fd: socks[i].as_raw_fd(), events: libc::POLLIN, revents: 0 });
        // SAFETY: a live array of two pollfds and a live timespec.
        unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        for i in 0..2 {
            while let Ok((n, src)) = socks[i].recv_from(&mut buf) {
                if src != legs[i].from {
                    stats.foreign += 1;
                    continue;
                }
                let out = 1 - i;
                let to = legs[i].to;
                let mut pkt = buf[..n].to_vec();
                // The datagram now travels local[out] -> to: the ICRC must cover that header.
                if seal_udp_payload(local[out], to, &mut pkt).is_err() {
                    stats.foreign += 1;
                    continue;
                }
                stats.forwarded += 1;
                let copies = if rng.below(100) == 0 { 2 } else { 1 };
                stats.duplicated += copies - 1;
                for _ in 0..copies {
                    if rng.below(10) == 0 {
                        let delay = Duration::from_micros(200 + rng.below(2800));
                        held.push((Instant::now() + delay, out, to, pkt.clone()));
                        stats.delayed += 1;
                    } else {
                        send(&mut stats, out, to, &pkt);
                    }
                }
            }
        }
        let now = Instant::now();
        let mut k = 0;
        while k < held.len() {
            if held[k].0 <= now {
                let (_, out, to, pkt) = held.swap_remove(k);
                send(&mut stats, out, to, &pkt);
            } else {
                k += 1;
            }
        }
    }
    stats
}

/// The operations, in the order each round uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    FetchAdd,
    CmpSwap,
}

const OPS: [Op; 7] = [Op::Send, Op::SendImm, Op::Write, Op::WriteImm, Op::Read, Op::FetchAdd, Op::CmpSwap];
const ROUNDS: usize = 24;
const SIZES: [usize; 12] = [0, 1, 63, 1000, 1024, 1025, 2048, 4096, 5000, 16384, 30000, 65536];
const GUARD: usize = 64;
const CANARY: u8 = 0x5a;
const WINDOW: usize = 24;

/// One message of a side's workload, with its slot (same offset in both regions' halves).
#[derive(Debug, Clone, Copy)]
struct Msg {
    op: Op,
    len: usize,
    off: usize,
    seed: u32,
    imm: u32,
    /// Atomics: starting value of the target word and the operands.
    init: u64,
    arg1: u64,
    arg2: u64,
}

impl Msg {
    fn consumes_recv(&self) -> bool {
        matches!(self.op, Op::Send | Op::SendImm | Op::WriteImm)
    }

    /// The target word after the atomic, and the value returned.
    fn atomic_result(&self) -> (u64, u64) {
        match self.op {
            Op::FetchAdd => (self.init.wrapping_add(self.arg1), self.init),
            Op::CmpSwap if self.init == self.arg1 => (self.arg2, self.init),
            Op::CmpSwap => (self.init, self.init),
            _ => unreachable!(),
        }
    }
}

fn workload(dir: u32, rng: &mut Rng) -> (Vec<Msg>, usize) {
    let mut msgs = Vec::new();
    let mut off = 0;
    for r in 0..ROUNDS {
        for (k, &op) in OPS.iter().enumerate() {
            let i = r * OPS.len() + k;
            let len = match op {
                Op::FetchAdd | Op::CmpSwap => 8,
                _ => SIZES[(i * 5 + dir as usize) % SIZES.len()],
            };
            let init = rng.next();
            // Half of the compare-and-swaps match.
            let arg1 = if op == Op::CmpSwap && r % 2 == 0 { init } else { rng.next() };
            msgs.push(Msg {
                op,
                len,
                off,
                seed: dir << 16 | i as u32,
                imm: 0xc0de_0000 | i as u32,
                init,
                arg1,
                arg2: rng.next(),
            });
            off += (len + GUARD).next_multiple_of(64);
        }
    }
    (msgs, off)
}

/// The per-side state of the run.
struct Side<'a> {
    ep: &'a Endpoint,
    /// Our workload (towards the peer) and the peer's (towards us).
    mine: &'a [Msg],
    theirs: &'a [Msg],
    /// Offsets of the halves of our region: our requests' slots, the peer's requests' slots.
    half: usize,
    peer_addr: u64,
    peer_rkey: u32,
    posted: usize,
    sends_done: Vec<WorkCompletion>,
    recvs_done: Vec<WorkCompletion>,
}

impl Side<'_> {
    /// Fill both halves: our sources, read destinations and result words; the landing slots,
    /// read sources and atomic words of the peer's requests. Post the receives the peer's requests
    /// will consume, in order.
    fn prepare(&self) {
        let mr = &self.ep.mr;
        for m in self.mine {
            match m.op {
                Op::Send | Op::SendImm | Op::Write | Op::WriteImm => mr.write(m.off, &pattern(m.len, m.seed)).unwrap(),
                _ => mr.write(m.off, &vec![CANARY; m.len + GUARD]).unwrap(),
            }
        }
        for (i, m) in self.theirs.iter().enumerate() {
            let at = self.half + m.off;
            match m.op {
                Op::Read => mr.write(at, &pattern(m.len, m.seed)).unwrap(),
                Op::FetchAdd | Op::CmpSwap => mr.write(at, &m.init.to_ne_bytes()).unwrap(),
                _ => mr.write(at, &vec![CANARY; m.len + GUARD]).unwrap(),
            }
            if m.consumes_recv() {
                let sgl = if m.op == Op::WriteImm { vec![] } else { vec![self.ep.sge(at, m.len + GUARD)] };
                self.ep.qp.post_recv(RecvWr { wr_id: i as u64, sgl: sgl.into() }).unwrap();
            }
        }
    }

    /// Post requests while fewer than WINDOW are outstanding.
    fn post_more(&mut self) {
        while self.posted < self.mine.len() && self.posted - self.sends_done.len() < WINDOW {
            let i = self.posted;
            let m = self.mine[i];
            let remote = self.peer_addr + (self.half + m.off) as u64;
            let rkey = self.peer_rkey;
            let op = match m.op {
                Op::Send => SendOp::Send,
                Op::SendImm => SendOp::SendWithImm(m.imm),
                Op::Write => SendOp::Write { remote_addr: remote, rkey },
                Op::WriteImm => SendOp::WriteWithImm { remote_addr: remote, rkey, imm: m.imm },
                Op::Read => SendOp::Read { remote_addr: remote, rkey },
                Op::FetchAdd => SendOp::FetchAdd { remote_addr: remote, rkey, add: m.arg1 },
                Op::CmpSwap => SendOp::CompareSwap { remote_addr: remote, rkey, compare: m.arg1, swap: m.arg2 },
            };
            let sgl = vec![self.ep.sge(m.off, m.len)];
            let wr =
                SendWr { wr_id: i as u64, op, payload: Payload::Sgl(sgl.into()), flags: SendFlags::SIGNALED, ud: None };
            self.ep.qp.post_send(wr).expect("post_send");
            self.posted += 1;
        }
    }

    fn poll(&mut self) {
        let mut wcs = Vec::new();
        self.ep.cq.poll(64, &mut wcs).unwrap();
        for wc in wcs {
            assert_eq!(wc.status, WcStatus::Success, "completion {wc:?} (status {})", wc.status.description());
            if wc.opcode.is_receive() {
                self.recvs_done.push(wc);
            } else {
                self.sends_done.push(wc);
            }
        }
    }

    fn done(&self) -> bool {
        self.sends_done.len() == self.mine.len()
            && self.recvs_done.len() == self.theirs.iter().filter(|m| m.consumes_recv()).count()
    }

    /// Every completion and every byte of both halves.
    fn check(&self) -> Result<(), String> {
        let mr = &self.ep.mr;
        for (i, (wc, m)) in self.sends_done.iter().zip(self.mine).enumerate() {
            let want = match m.op {
                Op::Send | Op::SendImm => WcOpcode::Send,
                Op::Write | Op::WriteImm => WcOpcode::RdmaWrite,
                Op::Read => WcOpcode::RdmaRead,
                Op::FetchAdd => WcOpcode::FetchAdd,
                Op::CmpSwap => WcOpcode::CompSwap,
            };
            if wc.wr_id != i as u64 || wc.opcode != want {
                return Err(format!("send completion {i}: {wc:?}, expected wr_id {i} {want:?}"));
            }
            let what = format!("{}: requester side of {:?} #{i} ({} bytes)", self.ep.ctx.name(), m.op, m.len);
            match m.op {
                Op::Send | Op::SendImm | Op::Write | Op::WriteImm => {
                    compare(&what, &mr.to_vec(m.off, m.len).unwrap(), &pattern(m.len, m.seed))?
                }
                Op::Read => compare(&what, &mr.to_vec(m.off, m.len).unwrap(), &pattern(m.len, m.seed))?,
                Op::FetchAdd | Op::CmpSwap => {
                    compare(&what, &mr.to_vec(m.off, 8).unwrap(), &m.atomic_result().1.to_ne_bytes())?
                }
            }
            if !matches!(m.op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm) {
                compare(&format!("{what}, guard"), &mr.to_vec(m.off + m.len, GUARD).unwrap(), &[CANARY; GUARD])?;
            }
        }
        let consumers: Vec<(usize, &Msg)> = self.theirs.iter().enumerate().filter(|(_, m)| m.consumes_recv()).collect();
        for (wc, (i, m)) in self.recvs_done.iter().zip(&consumers) {
            let (opcode, imm) = match m.op {
                Op::Send => (WcOpcode::Recv, None),
                Op::SendImm => (WcOpcode::Recv, Some(m.imm)),
                _ => (WcOpcode::RecvRdmaWithImm, Some(m.imm)),
            };
            let got_imm = wc.flags.contains(WcFlags::WITH_IMM).then_some(wc.imm);
            if wc.wr_id != *i as u64 || wc.opcode != opcode || wc.byte_len as usize != m.len || got_imm != imm {
                return Err(format!(
                    "receive completion for #{i}: {wc:?}, expected {opcode:?} of {} bytes, imm {imm:?}",
                    m.len
                ));
            }
        }
        for (i, m) in self.theirs.iter().enumerate() {
            let at = self.half + m.off;
            let what = format!("{}: target side of {:?} #{i} ({} bytes)", self.ep.ctx.name(), m.op, m.len);
            match m.op {
                Op::FetchAdd | Op::CmpSwap => {
                    compare(&what, &mr.to_vec(at, 8).unwrap(), &m.atomic_result().0.to_ne_bytes())?
                }
                _ => compare(&what, &mr.to_vec(at, m.len).unwrap(), &pattern(m.len, m.seed))?,
            }
            if !matches!(m.op, Op::FetchAdd | Op::CmpSwap | Op::Read) {
                compare(&format!("{what}, guard"), &mr.to_vec(at + m.len, GUARD).unwrap(), &[CANARY; GUARD])?;
            }
        }
        Ok(())
    }
}

fn run(net: &Net) {
    let seed = std::env::var("SOFTRDMA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("namespaces {} and {}, relay seed {seed} (SOFTRDMA_TEST_SEED to repeat)", net.ns_a, net.ns_b);
    let mut rng = Rng(seed ^ 0x5eed);
    let (work_a, len_a) = workload(1, &mut rng);
    let (work_b, len_b) = workload(2, &mut rng);
    let half = len_a.max(len_b).next_multiple_of(4096);

    let sa = |ip| SocketAddr::new(IpAddr::V4(ip), ROCE_PORT);
    let relay = Relay::start(&net.ns_b, sa(net.a), sa(net.b), sa(net.relay_a), sa(net.relay_b), seed);
    let dev_a = open_in(&net.ns_a, "nsa", "vA", net.a);
    let dev_b = open_in(&net.ns_b, "nsb", "vB", net.b);
    let ea = Endpoint::new(dev_a, 2 * half, 512);
    let eb = Endpoint::new(dev_b, 2 * half, 512);
    // Each believes the relay's address is its peer's.
    for (me, peer, peer_gid, mine, theirs) in
        [(&ea, &eb, net.relay_b, 0x10_0000, 0x20_0000), (&eb, &ea, net.relay_a, 0x20_0000, 0x10_0000)]
    {
        let gid = Gid::from_ip(IpAddr::V4(peer_gid));
        let mut p = ConnectParams::new(peer.qp.qpn(), Psn::new(theirs), gid, Psn::new(mine));
        p.mtu = Mtu::M1024;
        p.timeout = 12; // 16.8 ms: above the relay's longest hold plus a round trip.
        p.access = all_rights();
        me.qp.connect(&me.pd, &p).expect("connect");
    }
    let mut a = Side {
        ep: &ea,
        mine: &work_a,
        theirs: &work_b,
        half,
        peer_addr: eb.mr.addr(),
        peer_rkey: eb.mr.rkey(),
        posted: 0,
        sends_done: vec![],
        recvs_done: vec![],
    };
    let mut b = Side {
        ep: &eb,
        mine: &work_b,
        theirs: &work_a,
        half,
        peer_addr: ea.mr.addr(),
        peer_rkey: ea.mr.rkey(),
        posted: 0,
        sends_done: vec![],
        recvs_done: vec![],
    };
    a.prepare();
    b.prepare();
    let start = Instant::now();
    while !(a.done() && b.done()) {
        a.post_more();
        b.post_more();
        a.poll();
        b.poll();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: A {}/{} sends {}, recvs {}; B {}/{} sends {}, recvs {}; counters A {:?} B {:?}",
            a.posted,
            a.mine.len(),
            a.sends_done.len(),
            a.recvs_done.len(),
            b.posted,
            b.mine.len(),
            b.sends_done.len(),
            b.recvs_done.len(),
            ea.ctx.counters(),
            eb.ctx.counters()
        );
        std::thread::yield_now();
    }
    let elapsed = start.elapsed();
    let stats = relay.finish();
    let (drop_a, drop_b) = (net.dropped(&net.ns_a), net.dropped(&net.ns_b));
    let (ca, cb) = (ea.ctx.counters(), eb.ctx.counters());
    println!("traffic done in {elapsed:.2?}; relay {stats:?}; nft drops: into A {drop_a}, into B {drop_b}");
    println!("A: {ca:?}\nB: {cb:?}\nICRC A {:?} B {:?}", ea.ctx.icrc_stats(), eb.ctx.icrc_stats());
    a.check().unwrap_or_else(|e| panic!("{e}"));
    b.check().unwrap_or_else(|e| panic!("{e}"));
    // The impairments really happened, and the transport really worked around them.
    assert!(drop_a > 0 && drop_b > 0, "the loss rules dropped nothing ({drop_a}, {drop_b})");
    assert!(stats.duplicated > 0 && stats.delayed > 0, "relay {stats:?}");
    assert_eq!((stats.foreign, stats.send_errors), (0, 0), "relay {stats:?}");
    assert!(ca.retransmits + cb.retransmits > 0, "no retransmission despite loss");
    assert!(ca.duplicate_request + cb.duplicate_request > 0, "no duplicate reached a responder");
    for (name, ctx) in [("A", &ea.ctx), ("B", &eb.ctx)] {
        let v = ctx.icrc_stats();
        assert!(v.bad == 0 && v.recovered == 0 && v.verified > 0, "{name}: ICRC verdicts {v:?}");
    }
}
