//! Two processes, each with its own embedded device on its own loopback address, connected RC QPs,
//! and every operation (SEND, SEND with immediate, RDMA WRITE, RDMA WRITE with immediate, RDMA READ,
//! FETCH_ADD, CMP_SWAP) at every size from 0 bytes to 16 MiB, in both directions, with byte-for-byte
//! checks on both sides: the receiver or target checks what landed and that nothing beyond the
//! message changed (a guard area of canary bytes), the requester checks what it read or fetched.
//!
//! The peer is a real second process: the test binary runs itself again with
//! `--exact <this test>` and `SOFTRDMA_PROOF_ROLE` set. The two exchange QPN, PSN, GID, rkey and
//! region address, and then step through a script, over a TCP connection on 127.0.0.1 (the
//! out-of-band channel an RDMA application would also need).
//!
//! It runs twice: with the packets over UDP on loopback (the same-host link off), and over the
//! same-host link (shared-memory lanes, no ICRC), each side checking which path carried them.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{compare, compare_fill, pattern, wait_one, Endpoint};
use softrdma_verbs::{ConnectParams, DeviceBuilder, Gid, Mtu, Psn, Qpn, RecvWr, SendOp, WcFlags, WcOpcode, WcStatus};

/// This test's names (over UDP, over the same-host link), for `--exact` in the child.
const TEST_NAME: &str = "two_processes_every_operation_every_size";
const TEST_NAME_SAME_HOST: &str = "two_processes_every_operation_every_size_same_host";
/// Set in the child: `TCP:UDP:S`, the port of the parent's control listener, the devices' UDP port
/// and whether the same-host link is on (1) or off (0).
const ROLE_ENV: &str = "SOFTRDMA_PROOF_ROLE";
/// The devices' addresses (the UDP port is picked per run, so concurrent runs do not collide).
const ADDR: [Ipv4Addr; 2] = [Ipv4Addr::new(127, 0, 10, 1), Ipv4Addr::new(127, 0, 10, 2)];

/// The largest message.
const BIG: usize = 16 << 20;
/// Canary bytes checked after every landed message.
const GUARD: usize = 4096;
const CANARY: u8 = 0xa5;
/// Region layout: the area peers write, read and send into at 0, our source area at `SRC`.
const SRC: usize = BIG + GUARD;
const REGION: usize = 2 * (BIG + GUARD);

const SIZES: &[usize] = &[
    0,
    1,
    2,
    7,
    8,
    63,
    255,
    256,
    1023,
    1024,
    1025,
    2048,
    4095,
    4096,
    4097,
    12289,
    65535,
    65536,
    65537,
    1 << 20,
    (1 << 20) + 13,
    3 << 20 | 5,
    BIG,
];

#[test]
fn two_processes_every_operation_every_size() {
    run(false);
}

#[test]
fn two_processes_every_operation_every_size_same_host() {
    run(true);
}

fn run(same_host: bool) {
    match std::env::var(ROLE_ENV) {
        Ok(role) => {
            let mut w = role.split(':');
            let mut next = || w.next().expect("TCP:UDP:S").parse::<u16>().expect("a number");
            let (tcp, udp, sh) = (next(), next(), next());
            assert_eq!(sh == 1, same_host, "the child runs the parent's test");
            child(tcp, udp, same_host)
        }
        Err(_) => parent(same_host),
    }
}

/// Check which path carried the packets: the link (no ICRC verdicts) or UDP (only verdicts).
fn check_path(ep: &Endpoint, same_host: bool) {
    let icrc = ep.ctx.icrc_stats();
    let link = ep.ctx.same_host_stats();
    if same_host {
        assert!(icrc.verified == 0 && icrc.bad == 0 && icrc.recovered == 0, "ICRC verdicts {icrc:?}");
        assert!(link.rx_pkts > 0 && link.tx_pkts > 0 && link.lanes_in == 1 && link.lanes_out == 1, "{link:?}");
        assert_eq!((link.rx_malformed, link.ring_corrupt), (0, 0), "{link:?}");
    } else {
        assert!(icrc.verified > 0 && icrc.bad == 0 && icrc.recovered == 0, "ICRC verdicts {icrc:?}");
        assert_eq!((link.rx_pkts, link.tx_pkts), (0, 0), "{link:?}");
    }
}

/// A line-based control channel.
struct Ctl {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Ctl {
    fn new(s: TcpStream) -> Ctl {
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s.set_nodelay(true).unwrap();
        Ctl { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.w, "{line}").expect("control channel: send");
    }

    fn recv(&mut self) -> String {
        let mut line = String::new();
        let n = self.r.read_line(&mut line).expect("control channel: receive");
        assert!(n > 0, "control channel: the peer closed it");
        let line = line.trim_end().to_string();
        if let Some(msg) = line.strip_prefix("FAIL ") {
            panic!("the peer reported: {msg}");
        }
        line
    }

    fn expect(&mut self, want: &str) {
        let got = self.recv();
        assert_eq!(got, want, "control channel out of step");
    }

    /// Report a check's outcome to the peer (so both fail with the same message) and panic on error.
    fn verdict(&mut self, r: Result<(), String>) {
        match r {
            Ok(()) => self.send("OK"),
            Err(e) => {
                self.send(&format!("FAIL {e}"));
                panic!("{e}");
            }
        }
    }
}

/// What one side tells the other.
#[derive(Debug, Clone, Copy)]
struct Hello {
    qpn: u32,
    psn: u32,
    gid: Gid,
    addr: u64,
    rkey: u32,
}

impl Hello {
    fn line(&self) -> String {
        format!("HELLO {:06x} {:06x} {} {:x} {:x}", self.qpn, self.psn, self.gid, self.addr, self.rkey)
    }

    fn parse(line: &str) -> Hello {
        let f: Vec<&str> = line.split(' ').collect();
        assert!(f.len() == 6 && f[0] == "HELLO", "bad hello {line:?}");
        Hello {
            qpn: u32::from_str_radix(f[1], 16).unwrap(),
            psn: u32::from_str_radix(f[2], 16).unwrap(),
            gid: f[3].parse().unwrap(),
            addr: u64::from_str_radix(f[4], 16).unwrap(),
            rkey: u32::from_str_radix(f[5], 16).unwrap(),
        }
    }
}

/// A UDP port free on both addresses right now.
fn free_udp_port() -> u16 {
    loop {
        let a = UdpSocket::bind((ADDR[0], 0)).unwrap();
        let port = a.local_addr().unwrap().port();
        if UdpSocket::bind((ADDR[1], port)).is_ok() {
            return port;
        }
    }
}

fn open(side: usize, udp_port: u16, same_host: bool) -> Endpoint {
    let ctx = DeviceBuilder::new(&format!("proof{side}"), "lo")
        .addr(IpAddr::V4(ADDR[side]))
        .udp_port(udp_port)
        .same_host(same_host)
        .open()
        .expect("open device");
    Endpoint::new(ctx, REGION, 64)
}

/// Exchange hellos and connect; returns the peer's.
fn handshake(ep: &Endpoint, ctl: &mut Ctl, psn: u32, first: bool) -> Hello {
    let me = Hello {
        qpn: ep.qp.qpn().value(),
        psn,
        gid: ep.ctx.query_gid(1, 1).unwrap(),
        addr: ep.mr.addr(),
        rkey: ep.mr.rkey(),
    };
    let peer = if first {
        ctl.send(&me.line());
        Hello::parse(&ctl.recv())
    } else {
        let p = Hello::parse(&ctl.recv());
        ctl.send(&me.line());
        p
    };
    let mut p = ConnectParams::new(Qpn::new(peer.qpn), Psn::new(peer.psn), peer.gid, Psn::new(me.psn));
    p.mtu = Mtu::M1024;
    ep.qp.connect(&ep.pd, &p).expect("connect");
    // Both QPs are in RTS before anyone sends.
    ctl.send("RTS");
    ctl.expect("RTS");
    peer
}

fn parent(same_host: bool) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let udp = free_udp_port();
    let ep = open(0, udp, same_host);
    let exe = std::env::current_exe().unwrap();
    let name = if same_host { TEST_NAME_SAME_HOST } else { TEST_NAME };
    let mut child = Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, format!("{port}:{udp}:{}", u8::from(same_host)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the peer process");
    let out = collect(child.stdout.take().unwrap());
    let err = collect(child.stderr.take().unwrap());
    let mut guard = ChildGuard(Some(child));

    let result = catch_unwind(AssertUnwindSafe(|| {
        let stream = accept(&listener, &mut guard);
        let mut ctl = Ctl::new(stream);
        let peer = handshake(&ep, &mut ctl, 0x00_1234, true);
        let t = Instant::now();
        requester(&ep, &peer, &mut ctl, 1);
        responder(&ep, &mut ctl, 2);
        // Before the goodbye: once the peer has exited its lanes are gone.
        check_path(&ep, same_host);
        ctl.send("BYE");
        ctl.expect("BYE");
        eprintln!("parent: both directions done in {:.2?}; counters {:?}", t.elapsed(), ep.ctx.counters());
    }));
    let status = guard.wait(Duration::from_secs(30));
    let out = out.join().unwrap();
    let err = err.join().unwrap();
    if let Err(p) = result {
        eprintln!("--- peer process stdout ---\n{out}\n--- peer process stderr ---\n{err}\n--- peer status {status:?}");
        resume_unwind(p);
    }
    assert!(status.is_some_and(|s| s.success()), "peer process failed ({status:?}):\n{out}\n{err}");
}

fn child(port: u16, udp: u16, same_host: bool) {
    let ep = open(1, udp, same_host);
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the parent");
    let mut ctl = Ctl::new(stream);
    let peer = handshake(&ep, &mut ctl, 0xfe_dcba, false);
    responder(&ep, &mut ctl, 1);
    requester(&ep, &peer, &mut ctl, 2);
    ctl.expect("BYE");
    ctl.send("BYE");
    check_path(&ep, same_host);
    println!("child: done; counters {:?}", ep.ctx.counters());
}

/// The requester's half of the script: every operation at every size towards the peer.
fn requester(ep: &Endpoint, peer: &Hello, ctl: &mut Ctl, dir: u32) {
    for (k, &len) in SIZES.iter().enumerate() {
        let seed = dir << 24 | (k as u32) << 8;
        // SEND and SEND with immediate: the peer posted a receive over its whole target area.
        for (i, imm) in [None, Some(0x5eed_0000 | k as u32)].into_iter().enumerate() {
            let data = pattern(len, seed + i as u32);
            ep.mr.write(SRC, &data).unwrap();
            ctl.expect("RECV_POSTED");
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            ep.post(10 + i as u64, op, SRC, len);
            let wc = wait_one(&ep.cq, 10 + i as u64);
            assert_eq!(wc.opcode, WcOpcode::Send, "send completion {wc:?}");
            ctl.send("SENT");
            ctl.expect("OK");
            assert_eq!(ep.mr.to_vec(SRC, len).unwrap(), data, "a SEND changed its own source");
        }
        // RDMA WRITE and WRITE with immediate into the peer's target area.
        for (i, imm) in [None, Some(0x1111_0000 | k as u32)].into_iter().enumerate() {
            let data = pattern(len, seed + 2 + i as u32);
            ep.mr.write(SRC, &data).unwrap();
            ctl.expect("READY");
            let op = match imm {
                None => SendOp::Write { remote_addr: peer.addr, rkey: peer.rkey },
                Some(imm) => SendOp::WriteWithImm { remote_addr: peer.addr, rkey: peer.rkey, imm },
            };
            ep.post(20 + i as u64, op, SRC, len);
            let wc = wait_one(&ep.cq, 20 + i as u64);
            assert_eq!(wc.opcode, WcOpcode::RdmaWrite, "write completion {wc:?}");
            ctl.send("DONE");
            ctl.expect("OK");
        }
        // RDMA READ of the peer's target area into our own, canary-filled, target area.
        ctl.expect("READY");
        ep.mr.write(0, &vec![CANARY; len + GUARD]).unwrap();
        ep.post(30, SendOp::Read { remote_addr: peer.addr, rkey: peer.rkey }, 0, len);
        let wc = wait_one(&ep.cq, 30);
        assert_eq!(wc.opcode, WcOpcode::RdmaRead, "read completion {wc:?}");
        let r = compare(&format!("READ of {len} bytes"), &ep.mr.to_vec(0, len).unwrap(), &pattern(len, seed + 4))
            .and_then(|_| compare_fill(&format!("guard after a READ of {len} bytes"), &ep.mr, len, GUARD, CANARY));
        ctl.send("DONE");
        ctl.expect("OK");
        if let Err(e) = r {
            panic!("{e}");
        }
    }
    atomics_requester(ep, peer, ctl);
}

/// The target's half: post receives, fill canaries, check what landed.
fn responder(ep: &Endpoint, ctl: &mut Ctl, dir: u32) {
    let mut ids = 100u64..;
    for (k, &len) in SIZES.iter().enumerate() {
        let seed = dir << 24 | (k as u32) << 8;
        for (i, imm) in [None, Some(0x5eed_0000 | k as u32)].into_iter().enumerate() {
            ep.mr.write(0, &vec![CANARY; len + GUARD]).unwrap();
            let id = ids.next().unwrap();
            ep.qp.post_recv(RecvWr { wr_id: id, sgl: vec![ep.sge(0, BIG + GUARD)].into() }).unwrap();
            ctl.send("RECV_POSTED");
            ctl.expect("SENT");
            let wc = wait_one(&ep.cq, id);
            let r = check_recv(&wc, WcOpcode::Recv, len, imm)
                .and_then(|_| {
                    compare(
                        &format!("SEND of {len} bytes"),
                        &ep.mr.to_vec(0, len).unwrap(),
                        &pattern(len, seed + i as u32),
                    )
                })
                .and_then(|_| compare_fill(&format!("guard after a SEND of {len} bytes"), &ep.mr, len, GUARD, CANARY));
            ctl.verdict(r);
        }
        for (i, imm) in [None, Some(0x1111_0000 | k as u32)].into_iter().enumerate() {
            ep.mr.write(0, &vec![CANARY; len + GUARD]).unwrap();
            let id = ids.next().unwrap();
            if imm.is_some() {
                // A WRITE with immediate consumes a receive; its (empty) buffer is not touched.
                ep.qp.post_recv(RecvWr { wr_id: id, sgl: vec![].into() }).unwrap();
            }
            ctl.send("READY");
            ctl.expect("DONE");
            let mut r = Ok(());
            if imm.is_some() {
                let wc = wait_one(&ep.cq, id);
                r = check_recv(&wc, WcOpcode::RecvRdmaWithImm, len, imm);
            } else {
                let mut none = Vec::new();
                ep.cq.poll(4, &mut none).unwrap();
                if !none.is_empty() {
                    r = Err(format!("a plain WRITE made completions at the target: {none:?}"));
                }
            }
            let what = if imm.is_some() { "WRITE with immediate" } else { "WRITE" };
            let r = r
                .and_then(|_| {
                    compare(
                        &format!("{what} of {len} bytes"),
                        &ep.mr.to_vec(0, len).unwrap(),
                        &pattern(len, seed + 2 + i as u32),
                    )
                })
                .and_then(|_| {
                    compare_fill(&format!("guard after a {what} of {len} bytes"), &ep.mr, len, GUARD, CANARY)
                });
            ctl.verdict(r);
        }
        let data = pattern(len, seed + 4);
        ep.mr.write(0, &data).unwrap();
        ctl.send("READY");
        ctl.expect("DONE");
        let r = compare(&format!("source of a READ of {len} bytes"), &ep.mr.to_vec(0, len).unwrap(), &data);
        ctl.verdict(r);
    }
    atomics_responder(ep, ctl);
}

fn check_recv(
    wc: &softrdma_verbs::WorkCompletion,
    opcode: WcOpcode,
    len: usize,
    imm: Option<u32>,
) -> Result<(), String> {
    let got_imm = wc.flags.contains(WcFlags::WITH_IMM).then_some(wc.imm);
    if wc.status != WcStatus::Success || wc.opcode != opcode || wc.byte_len as usize != len || got_imm != imm {
        return Err(format!("receive completion {wc:?}, expected {opcode:?} of {len} bytes with immediate {imm:?}"));
    }
    Ok(())
}

/// Words the atomics work on (offsets in the target area) and their starting values.
const WORD_A: usize = 64;
const WORD_B: usize = 128;
const A0: u64 = 0x0123_4567_89ab_cdef;
const ADD: u64 = 0x1111_1111_1111_1111;
const SWAP: u64 = 0xfeed_face_cafe_beef;
const B0: u64 = u64::MAX - 1;

fn atomics_requester(ep: &Endpoint, peer: &Hello, ctl: &mut Ctl) {
    ctl.expect("READY");
    ep.mr.write(SRC, &[CANARY; 64]).unwrap();
    let word = |off: usize| peer.addr + off as u64;
    let rkey = peer.rkey;
    // FETCH_ADD, then a CMP_SWAP that matches the sum, then one that does not match, then a
    // FETCH_ADD that wraps around 2^64.
    ep.post(40, SendOp::FetchAdd { remote_addr: word(WORD_A), rkey, add: ADD }, SRC, 8);
    ep.post(
        41,
        SendOp::CompareSwap { remote_addr: word(WORD_A), rkey, compare: A0.wrapping_add(ADD), swap: SWAP },
        SRC + 8,
        8,
    );
    ep.post(42, SendOp::CompareSwap { remote_addr: word(WORD_A), rkey, compare: A0, swap: 1 }, SRC + 16, 8);
    ep.post(43, SendOp::FetchAdd { remote_addr: word(WORD_B), rkey, add: 3 }, SRC + 24, 8);
    for id in 40..44 {
        let wc = wait_one(&ep.cq, id);
        let want = if id == 40 || id == 43 { WcOpcode::FetchAdd } else { WcOpcode::CompSwap };
        assert_eq!(wc.opcode, want, "atomic completion {wc:?}");
    }
    let got: Vec<u64> =
        (0..4).map(|i| u64::from_ne_bytes(ep.mr.to_vec(SRC + 8 * i, 8).unwrap().try_into().unwrap())).collect();
    let r = if got == [A0, A0.wrapping_add(ADD), SWAP, B0] {
        compare_fill("bytes after the atomics' results", &ep.mr, SRC + 32, 32, CANARY)
    } else {
        Err(format!("atomics returned {got:#x?}, expected {:#x?}", [A0, A0.wrapping_add(ADD), SWAP, B0]))
    };
    ctl.send("DONE");
    ctl.expect("OK");
    if let Err(e) = r {
        panic!("{e}");
    }
}

fn atomics_responder(ep: &Endpoint, ctl: &mut Ctl) {
    ep.mr.write(0, &[CANARY; 256]).unwrap();
    ep.mr.write(WORD_A, &A0.to_ne_bytes()).unwrap();
    ep.mr.write(WORD_B, &B0.to_ne_bytes()).unwrap();
    ctl.send("READY");
    ctl.expect("DONE");
    let mut want = vec![CANARY; 256];
    want[WORD_A..WORD_A + 8].copy_from_slice(&SWAP.to_ne_bytes());
    want[WORD_B..WORD_B + 8].copy_from_slice(&B0.wrapping_add(3).to_ne_bytes());
    let r = compare("target words after the atomics", &ep.mr.to_vec(0, 256).unwrap(), &want);
    ctl.verdict(r);
}

/// Accept the child's connection, noticing if it died first.
fn accept(listener: &TcpListener, child: &mut ChildGuard) -> TcpStream {
    listener.set_nonblocking(true).unwrap();
    let start = Instant::now();
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        if let Some(st) = child.0.as_mut().and_then(|c| c.try_wait().unwrap()) {
            panic!("the peer process exited ({st}) before connecting");
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the peer process did not connect");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn collect(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// The peer process: waited for, and killed (by its own pid) if it outlives a failure.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.0.take()?;
        let start = Instant::now();
        loop {
            if let Some(st) = c.try_wait().ok()? {
                return Some(st);
            }
            if start.elapsed() > limit {
                let _ = c.kill();
                return c.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
