//! softrdmad end to end: a real daemon (temporary socket, configuration and UDP port) serving
//! several client processes at once, each running verbs through the same device.
//!
//! Client processes are this test binary run again with `SOFTRDMA_ROLE` set (see [`child`]); they
//! talk to the test over stdin/stdout lines starting with `@@`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../verbs/tests/common/cpus.rs"]
mod cpus;

use cpus::{allow, allowed_cpus, cpus_to_move_between};
use softrdma_verbs::daemon::admin::Admin;
use softrdma_verbs::{
    open_device, Access, AhAttr, AsyncEvent, CmConnParam, CmEventChannel, CmEventKind, CompletionQueue, ConnectParams,
    Context, Gid, MemoryRegion, ModifyQp, Mtu, Payload, PortSpace, ProtectionDomain, Psn, QpCap, QpInitAttr, QpState,
    QpType, QueuePair, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

// ---- the daemon ---------------------------------------------------------------------------------

struct Daemon {
    child: Child,
    dir: PathBuf,
    port: u16,
    metrics: Option<u16>,
    /// More command-line arguments of `softrdma daemon`.
    args: Vec<&'static str>,
    /// More environment variables of `softrdma daemon`.
    env: Vec<(&'static str, &'static str)>,
}

fn softrdma() -> Command {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
}

impl Daemon {
    /// A fresh directory (world-readable, so `nobody` can reach the socket) with a config.
    fn dir(name: &str, config: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("softrdmad-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.join("devices.conf"), config).unwrap();
        dir
    }

    fn start(dir: &Path, port: u16, metrics: Option<u16>) -> Daemon {
        Daemon::start_with(dir, port, metrics, Vec::new())
    }

    fn start_with(dir: &Path, port: u16, metrics: Option<u16>, args: Vec<&'static str>) -> Daemon {
        Daemon::start_env(dir, port, metrics, args, Vec::new())
    }

    /// [`Daemon::start_with`], with these environment variables too.
    fn start_env(
        dir: &Path,
        port: u16,
        metrics: Option<u16>,
        args: Vec<&'static str>,
        env: Vec<(&'static str, &'static str)>,
    ) -> Daemon {
        let child = Daemon::spawn(dir, port, metrics, &args, &env);
        let d = Daemon { child, dir: dir.to_owned(), port, metrics, args, env };
        d.wait_up();
        d
    }

    /// Stop and start again on the same directory.
    fn restart(&mut self) {
        self.stop();
        self.child = Daemon::spawn(&self.dir, self.port, self.metrics, &self.args, &self.env);
        self.wait_up();
    }

    fn spawn(dir: &Path, port: u16, metrics: Option<u16>, args: &[&str], env: &[(&str, &str)]) -> Child {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("log")).unwrap();
        let mut cmd = softrdma();
        cmd.args(["daemon", "--udp-port", &port.to_string()])
            .args(args)
            .envs(env.iter().copied())
            .env("SOFTRDMA_SOCKET", dir.join("s.sock"))
            .env("SOFTRDMA_CONFIG", dir.join("devices.conf"))
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(m) = metrics {
            cmd.args(["--metrics", &format!("127.0.0.1:{m}")]);
        }
        cmd.spawn().expect("start softrdmad")
    }

    /// A daemon on UDP port `port` in a network namespace (and mount namespace, with a sysfs of
    /// its own) made for it, after the shell commands `setup` ran there (its loopback is up); up
    /// when this returns. `None` where no namespace can be made.
    fn start_in_netns(dir: &Path, port: u16, setup: &str) -> Option<Daemon> {
        if !is_root() || Command::new("unshare").args(["-n", "true"]).status().map_or(true, |s| !s.success()) {
            eprintln!("skipped: cannot create a network namespace here");
            return None;
        }
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let script = format!(
            "mount -t sysfs sysfs /sys && ip link set lo up && {setup} && exec {} daemon --udp-port {port}",
            env!("CARGO_BIN_EXE_softrdma")
        );
        let child = Command::new("unshare")
            .args(["-n", "-m", "sh", "-c", &script])
            .env("SOFTRDMA_SOCKET", dir.join("s.sock"))
            .env("SOFTRDMA_CONFIG", dir.join("devices.conf"))
            .stderr(log)
            .spawn()
            .unwrap();
        let d = Daemon { child, dir: dir.to_path_buf(), port, metrics: None, args: Vec::new(), env: Vec::new() };
        d.wait_up();
        Some(d)
    }

    fn wait_up(&self) {
        let t = Instant::now();
        while Admin::connect_to(&self.socket()).is_err() {
            assert!(t.elapsed() < Duration::from_secs(10), "softrdmad did not come up:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("s.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn admin(&self) -> Admin {
        Admin::connect_to(&self.socket()).unwrap()
    }

    fn counter(&self, name: &str) -> u64 {
        let s = self.admin().stats(Some("rxe0")).unwrap();
        s[0].counters.iter().find(|(k, _)| k == name).map(|(_, v)| *v).unwrap()
    }

    /// Wait until the daemon holds no objects for any client.
    fn wait_idle(&self) {
        let t = Instant::now();
        loop {
            let s = self.admin().stats(Some("rxe0")).unwrap();
            let busy: Vec<_> = s[0]
                .counters
                .iter()
                .filter(|(k, v)| (k.starts_with("objects_") && k != "objects_clients" || k == "engine_mrs") && *v != 0)
                .collect();
            // Our own admin connection is a client without objects.
            if busy.is_empty() {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "objects left: {busy:?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let o = softrdma()
            .args(args)
            .env("SOFTRDMA_SOCKET", self.socket())
            .env("SOFTRDMA_CONFIG", self.dir.join("devices.conf"))
            .output()
            .unwrap();
        (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

// ---- client processes ---------------------------------------------------------------------------

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    role: String,
}

impl Client {
    fn spawn(d: &Daemon, role: &str, as_nobody: bool) -> Client {
        let exe = std::env::current_exe().unwrap();
        let cmd = if as_nobody {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        Client::spawn_with(d, role, cmd, &[])
    }

    /// [`Client::spawn`] with `SOFTRDMA_MOVE_REGIONS=1`: page-aligned caller memory is moved onto
    /// memfds the daemon maps.
    fn spawn_moving(d: &Daemon, role: &str) -> Client {
        let exe = std::env::current_exe().unwrap();
        Client::spawn_with(d, role, Command::new(exe), &[("SOFTRDMA_MOVE_REGIONS", "1")])
    }

    fn spawn_with(d: &Daemon, role: &str, mut cmd: Command, env: &[(&str, &str)]) -> Client {
        cmd.envs(env.iter().copied());
        cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("SOFTRDMA_ROLE", role)
            .env("SOFTRDMA_SOCKET", d.socket())
            .env("SOFTRDMA_CONFIG", d.dir.join("devices.conf"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Client { child, stdin, stdout, role: role.into() }
    }

    /// The next `@@` line (without the marker).
    fn line(&mut self) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            let n = self.stdout.read_line(&mut l).unwrap();
            assert!(n > 0, "client {} ended early", self.role);
            if let Some(i) = l.find("@@ ") {
                return l[i + 3..].trim().to_string();
            }
            // The client's own test-harness output (and its panic message, if any).
            eprint!("[{}] {l}", self.role);
        }
    }

    fn send(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn finish(mut self) -> String {
        let last = self.line();
        let st = self.child.wait().unwrap();
        assert!(st.success(), "client {} failed ({last})", self.role);
        last
    }
}

/// Exchange the INFO lines of two clients; returns them.
fn pair(a: &mut Client, b: &mut Client) -> (String, String) {
    let ia = a.line();
    let ib = b.line();
    a.send(&ib);
    b.send(&ia);
    (ia, ib)
}

fn is_root() -> bool {
    softrdma_abi::sock::geteuid() == 0
}

/// Another session names a client's QP and memory keys: every request is refused as if the
/// objects did not exist.
fn try_foreign_handles(d: &Daemon, qpn: u32, keys: &[u32]) {
    use softrdma_abi::msg::{Refusal, Request, Response};
    use softrdma_transport::VerbsError;
    let conn = softrdma_abi::sock::Conn::connect(&d.socket()).unwrap();
    let call = |r: Request| {
        conn.send(&r.encode(), &[]).unwrap();
        Response::decode(&conn.recv().unwrap().unwrap().0).unwrap()
    };
    assert!(matches!(call(Request::OpenDevice { name: "rxe0".into() }), Response::Opened(_)));
    let refused = Response::Error(Refusal::Verbs(VerbsError::NoSuchObject));
    assert_eq!(call(Request::QueryQp { qpn }), refused);
    assert_eq!(call(Request::DestroyQp { qpn }), refused);
    let attr = softrdma_verbs::ModifyQp { state: Some(softrdma_verbs::QpState::Err), ..Default::default() };
    assert_eq!(call(Request::ModifyQp { qpn, attr }), refused);
    for &key in keys {
        assert_eq!(call(Request::DeregMr { key }), refused);
    }
}

/// Another session names a client's CM ID, its event channel and its QP: every request is refused
/// as if they did not exist, and a connection of its own cannot drive the foreign QP.
fn try_foreign_cm_handles(d: &Daemon, id: u32, channel: u32, qpn: u32) {
    use softrdma_abi::msg::{Refusal, Request, Response};
    use softrdma_transport::VerbsError;
    use std::os::fd::AsRawFd;
    let conn = softrdma_abi::sock::Conn::connect(&d.socket()).unwrap();
    let call = |r: Request, fds: &[i32]| {
        conn.send(&r.encode(), fds).unwrap();
        Response::decode(&conn.recv().unwrap().unwrap().0).unwrap()
    };
    assert!(matches!(call(Request::OpenDevice { name: "rxe0".into() }, &[]), Response::Opened(_)));
    let refused = Response::Error(Refusal::Verbs(VerbsError::NoSuchObject));
    assert_eq!(call(Request::CmQuery { id }, &[]), refused);
    assert_eq!(call(Request::CmDisconnect { id }, &[]), refused);
    assert_eq!(call(Request::CmEstablish { id }, &[]), refused);
    let state = softrdma_verbs::CmQpState::Rtr;
    assert_eq!(call(Request::CmInitQpAttr { id, state }, &[]), refused);
    assert_eq!(call(Request::CmDestroyId { id }, &[]), refused);
    assert_eq!(call(Request::CmGetEvent { channel }, &[]), refused);
    assert_eq!(call(Request::CmDestroyChannel { channel }, &[]), refused);
    let (tx, _rx) = std::os::unix::net::UnixDatagram::pair().unwrap();
    let Response::Id(mine) = call(Request::CmCreateChannel, &[tx.as_raw_fd()]) else { panic!("no channel") };
    assert_eq!(call(Request::CmCreateId { channel, ps: PortSpace::Tcp }, &[]), refused);
    let Response::Id(my_id) = call(Request::CmCreateId { channel: mine, ps: PortSpace::Tcp }, &[]) else {
        panic!("no id")
    };
    assert_eq!(call(Request::CmMigrate { id: my_id, channel }, &[]), refused);
    let param = CmConnParam::new(softrdma_verbs::Qpn::new(qpn));
    assert_eq!(call(Request::CmConnect { id: my_id, param }, &[]), refused);
}

// ---- what the clients run -----------------------------------------------------------------------

fn out(s: &str) {
    println!("@@ {s}");
    std::io::stdout().flush().unwrap();
}

fn input() -> String {
    let mut l = String::new();
    std::io::stdin().read_line(&mut l).unwrap();
    l.trim().to_string()
}

fn pattern(seed: u32, tag: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed * 7 + u32::from(tag)) as u8).collect()
}

fn wait_wcs(cq: &CompletionQueue, n: usize, secs: u64) -> Vec<WorkCompletion> {
    let mut v = Vec::new();
    let t = Instant::now();
    while v.len() < n {
        cq.poll(n - v.len(), &mut v).unwrap();
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out with {} of {n} completions: {v:?}", v.len());
        std::thread::yield_now();
    }
    v
}

const RW: Access = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);

fn rc_qp(ctx: &Context) -> (ProtectionDomain, CompletionQueue, QueuePair) {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    let cap = QpCap { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Rc, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false })
        .unwrap();
    (pd, cq, qp)
}

/// An RC QP of one SGE per request, 16 of each kind, on `cq`.
fn small_rc_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    pd.create_qp(&QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false })
        .unwrap()
}

fn send(wr_id: u64, op: SendOp, mr: &MemoryRegion, off: usize, len: usize) -> SendWr {
    SendWr {
        wr_id,
        op,
        payload: Payload::Sgl(vec![mr.sge(off, len).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    }
}

const MSGS: usize = 100;
const MSG: usize = 2048;
const AREA: usize = 64 * 1024;

/// RC: sends both ways, an RDMA WRITE and an RDMA READ, checked byte for byte; then one side
/// (told `probe`) writes where it was only granted reads and must fail, the other sees the access
/// error and its memory unchanged.
fn rc_role(ctx: &Context) {
    let (pd, cq, qp) = rc_qp(ctx);
    let me = qp.qpn().value();
    let send_mr = pd.reg_mr(MSGS * MSG, Access::LOCAL_WRITE).unwrap();
    let recv_mr = pd.reg_mr((MSGS + 1) * MSG, Access::LOCAL_WRITE).unwrap();
    let write_area = pd.reg_mr(AREA, RW).unwrap();
    let read_area = pd.reg_mr(AREA, Access::REMOTE_READ).unwrap();
    let local = pd.reg_mr(AREA, Access::LOCAL_WRITE).unwrap();
    send_mr.write(0, &pattern(me, b'S', MSGS * MSG)).unwrap();
    read_area.write(0, &pattern(me, b'R', AREA)).unwrap();
    qp.init(RW).unwrap();
    for i in 0..=MSGS {
        qp.post_recv(RecvWr { wr_id: 1000 + i as u64, sgl: vec![recv_mr.sge(i * MSG, MSG).unwrap()].into() }).unwrap();
    }
    let gid = ctx.query_gid(1, 1).unwrap();
    out(&format!("{me} {} {} {} {}", write_area.addr(), write_area.rkey(), read_area.addr(), read_area.rkey()));
    let peer: Vec<u64> = input().split(' ').map(|w| w.parse().unwrap()).collect();
    let (pqpn, pw_addr, pw_rkey, pr_addr, pr_rkey) = (peer[0] as u32, peer[1], peer[2] as u32, peer[3], peer[4] as u32);
    qp.connect(&pd, &ConnectParams::new(softrdma_verbs::Qpn::new(pqpn), Psn::new(pqpn), gid, Psn::new(me))).unwrap();

    for i in 0..MSGS {
        qp.post_send(send(i as u64, SendOp::Send, &send_mr, i * MSG, MSG)).unwrap();
    }
    let wcs = wait_wcs(&cq, 2 * MSGS, 30);
    let mut recvs = 0;
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.opcode == WcOpcode::Recv {
            recvs += 1;
            assert_eq!(wc.byte_len as usize, MSG);
        }
    }
    assert_eq!(recvs, MSGS);
    assert_eq!(recv_mr.to_vec(0, MSGS * MSG).unwrap(), pattern(pqpn, b'S', MSGS * MSG), "SEND data");

    // RDMA WRITE into the peer, then a SEND with immediate data to say it is there.
    local.write(0, &pattern(me, b'W', AREA)).unwrap();
    qp.post_send(send(1, SendOp::Write { remote_addr: pw_addr, rkey: pw_rkey }, &local, 0, AREA)).unwrap();
    qp.post_send(send(2, SendOp::SendWithImm(me), &local, 0, 0)).unwrap();
    let wcs = wait_wcs(&cq, 3, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == pqpn));
    assert_eq!(write_area.to_vec(0, AREA).unwrap(), pattern(pqpn, b'W', AREA), "RDMA WRITE data");

    // RDMA READ from the peer.
    local.fill(0);
    qp.post_send(send(3, SendOp::Read { remote_addr: pr_addr, rkey: pr_rkey }, &local, 0, AREA)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(local.to_vec(0, AREA).unwrap(), pattern(pqpn, b'R', AREA), "RDMA READ data");

    out("PHASE2");
    match input().as_str() {
        "probe" => {
            // The peer granted REMOTE_READ only on this region: a write must fail, untouched.
            qp.post_send(send(4, SendOp::Write { remote_addr: pr_addr, rkey: pr_rkey }, &local, 0, 8)).unwrap();
            let wcs = wait_wcs(&cq, 1, 30);
            assert_eq!(wcs[0].status, WcStatus::RemAccessErr, "{wcs:?}");
        }
        _ => {
            let t = Instant::now();
            loop {
                match ctx.get_async_event(Duration::from_millis(100)) {
                    Some(AsyncEvent::QpAccessError(q)) if q == qp.qpn() => break,
                    _ => assert!(t.elapsed() < Duration::from_secs(20), "no access error event"),
                }
            }
            assert_eq!(read_area.to_vec(0, AREA).unwrap(), pattern(me, b'R', AREA), "memory changed");
        }
    }
    out("OK");
}

/// UD: 64 datagrams each way through the same device, checked byte for byte.
fn ud_role(ctx: &Context) {
    const N: usize = 64;
    const LEN: usize = 1000;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(512, None).unwrap();
    let cap = QpCap { max_send_wr: 128, max_recv_wr: 128, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Ud, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: true })
        .unwrap();
    let me = qp.qpn().value();
    let smr = pd.reg_mr(N * LEN, Access::LOCAL_WRITE).unwrap();
    let rmr = pd.reg_mr(N * (LEN + 40), Access::LOCAL_WRITE).unwrap();
    qp.bring_up_ud(0x1111_1111, Psn::new(0)).unwrap();
    for i in 0..N {
        let mut p = pattern(me, i as u8, LEN);
        p[..4].copy_from_slice(&(i as u32).to_le_bytes());
        smr.write(i * LEN, &p).unwrap();
        qp.post_recv(RecvWr { wr_id: i as u64, sgl: vec![rmr.sge(i * (LEN + 40), LEN + 40).unwrap()].into() }).unwrap();
    }
    out(&me.to_string());
    let peer: u32 = input().parse().unwrap();
    let ah = pd.create_ah(&AhAttr::new(ctx.query_gid(1, 1).unwrap(), 1)).unwrap();
    for i in 0..N {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Send,
            payload: Payload::Sgl(vec![smr.sge(i * LEN, LEN).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: Some(ah.ud(softrdma_verbs::Qpn::new(peer), 0x1111_1111)),
        };
        qp.post_send(wr).unwrap();
    }
    let wcs = wait_wcs(&cq, 2 * N, 30);
    let mut seen = [false; N];
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.opcode == WcOpcode::Recv {
            assert_eq!(wc.src_qp.value(), peer);
            assert_eq!(wc.byte_len as usize, LEN + 40);
            let data = rmr.to_vec(wc.wr_id as usize * (LEN + 40) + 40, LEN).unwrap();
            let i = u32::from_le_bytes(data[..4].try_into().unwrap()) as usize;
            let mut want = pattern(peer, i as u8, LEN);
            want[..4].copy_from_slice(&(i as u32).to_le_bytes());
            assert_eq!(data, want, "datagram {i}");
            seen[i] = true;
        }
    }
    assert!(seen.iter().all(|s| *s));
    out("OK");
}

/// RC WRITEs both ways until an error completion (the peer was killed) or a deadline.
fn stream_role(ctx: &Context) {
    let (pd, cq, qp) = rc_qp(ctx);
    let me = qp.qpn().value();
    let mr = pd.reg_mr(AREA, RW).unwrap();
    out(&format!("{me} {} {}", mr.addr(), mr.rkey()));
    let peer: Vec<u64> = input().split(' ').map(|w| w.parse().unwrap()).collect();
    let mut p = ConnectParams::new(
        softrdma_verbs::Qpn::new(peer[0] as u32),
        Psn::new(0),
        ctx.query_gid(1, 1).unwrap(),
        Psn::new(0),
    );
    p.timeout = 12;
    p.retry_cnt = 2;
    p.mtu = Mtu::M1024;
    qp.connect(&pd, &p).unwrap();
    let (mut posted, mut done, mut wcs) = (0u64, 0u64, Vec::new());
    let t = Instant::now();
    let mut said = false;
    while t.elapsed() < Duration::from_secs(20) {
        while posted - done < 16 {
            qp.post_send(send(posted, SendOp::Write { remote_addr: peer[1], rkey: peer[2] as u32 }, &mr, 0, 16 * 1024))
                .unwrap();
            posted += 1;
        }
        wcs.clear();
        cq.poll(16, &mut wcs).unwrap();
        for wc in &wcs {
            done += 1;
            if wc.status != WcStatus::Success {
                out(&format!("ERR {}", wc.status.name()));
                return;
            }
        }
        if done >= 20 && !said {
            said = true;
            out("RUNNING");
        }
    }
    out("NOERR");
    std::process::exit(1);
}

/// Regions from `reg_mr`, which on a daemon device live in memfds the daemon maps, and two from
/// `reg_mr_raw`: a heap buffer that is not page-aligned (the process_vm path) and whole heap pages
/// (moved onto a memfd the daemon maps, their contents kept). SENDs of sizes across the MTU, RDMA
/// WRITEs (unaligned, and into the raw region), RDMA READs (one of the moved pages) and two
/// atomics, all towards the peer process, checked byte for byte. Then (at `PHASE2`) the test looks at the daemon's mappings and says go; each side
/// checks what the peer did to its memory, and holds its regions (`HOLDING`) until told to exit,
/// or killed.
fn shared_role(ctx: &Context) {
    const SIZES: [usize; 6] = [1, 1023, 1024, 1025, 4096 + 17, 3 * MSG + 5];
    let (pd, cq, qp) = rc_qp(ctx);
    let me = qp.qpn().value();
    // First, whole pages of this process's heap (what `ibv_reg_mr` of a page-aligned buffer
    // registers; the clients run with SOFTRDMA_MOVE_REGIONS=1): moved onto a memfd the daemon
    // maps, or, if the daemon maps none, moved back and reached by process_vm; its contents kept.
    let layout = std::alloc::Layout::from_size_align(AREA, 4096).unwrap();
    // SAFETY: a layout of non-zero size.
    let paged = unsafe { std::alloc::alloc(layout) };
    assert!(!paged.is_null());
    // SAFETY: the AREA bytes just allocated, freed at the end of this function after the region.
    let paged_bytes = unsafe { std::slice::from_raw_parts_mut(paged, AREA) };
    paged_bytes.copy_from_slice(&pattern(me, b'P', AREA));
    // SAFETY: freed after the region; the peer only reads it.
    let paged_mr = unsafe { pd.reg_mr_raw(paged, AREA, RW) }.unwrap();
    assert!(paged_bytes == &pattern(me, b'P', AREA)[..], "a registered region keeps its contents");
    let send_mr = pd.reg_mr(SIZES.len() * 8192, Access::LOCAL_WRITE).unwrap();
    let recv_mr = pd.reg_mr((SIZES.len() + 1) * 8192, Access::LOCAL_WRITE).unwrap();
    let write_area = pd.reg_mr(AREA + 3, RW).unwrap();
    let read_area = pd.reg_mr(AREA, Access::REMOTE_READ).unwrap();
    let atomic_area = pd.reg_mr(64, RW).unwrap();
    let local = pd.reg_mr(AREA + 64, Access::LOCAL_WRITE).unwrap();
    // Never page-aligned (8 bytes into a 16-byte aligned allocation): the process_vm path.
    let mut raw = vec![0u8; AREA + 8];
    // SAFETY: `raw` outlives the region (dropped after it, at the end of this function) and is
    // only read again after the peer's WRITE into it completed.
    let raw_mr = unsafe { pd.reg_mr_raw(raw.as_mut_ptr().add(8), AREA, RW) }.unwrap();
    send_mr.write(0, &pattern(me, b'S', SIZES.len() * 8192)).unwrap();
    read_area.write(0, &pattern(me, b'R', AREA)).unwrap();
    atomic_area.write(8, &(u64::from(me) * 1000).to_ne_bytes()).unwrap();
    qp.init(RW).unwrap();
    for i in 0..=SIZES.len() {
        qp.post_recv(RecvWr { wr_id: 1000 + i as u64, sgl: vec![recv_mr.sge(i * 8192, 8192).unwrap()].into() })
            .unwrap();
    }
    let gid = ctx.query_gid(1, 1).unwrap();
    out(&format!(
        "{me} {} {} {} {} {} {} {} {} {} {}",
        write_area.addr(),
        write_area.rkey(),
        read_area.addr(),
        read_area.rkey(),
        atomic_area.addr(),
        atomic_area.rkey(),
        raw_mr.addr(),
        raw_mr.rkey(),
        paged_mr.addr(),
        paged_mr.rkey()
    ));
    let peer: Vec<u64> = input().split(' ').map(|w| w.parse().unwrap()).collect();
    let pqpn = peer[0] as u32;
    let (pw, pr, pa, praw) =
        ((peer[1], peer[2] as u32), (peer[3], peer[4] as u32), (peer[5], peer[6] as u32), (peer[7], peer[8] as u32));
    let ppaged = (peer[9], peer[10] as u32);
    qp.connect(&pd, &ConnectParams::new(softrdma_verbs::Qpn::new(pqpn), Psn::new(pqpn), gid, Psn::new(me))).unwrap();

    // SENDs.
    for (i, &n) in SIZES.iter().enumerate() {
        qp.post_send(send(i as u64, SendOp::Send, &send_mr, i * 8192, n)).unwrap();
    }
    let wcs = wait_wcs(&cq, 2 * SIZES.len(), 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let peer_send = pattern(pqpn, b'S', SIZES.len() * 8192);
    for wc in wcs.iter().filter(|w| w.opcode == WcOpcode::Recv) {
        let i = (wc.wr_id - 1000) as usize;
        assert_eq!(wc.byte_len as usize, SIZES[i]);
        assert_eq!(recv_mr.to_vec(i * 8192, SIZES[i]).unwrap(), &peer_send[i * 8192..i * 8192 + SIZES[i]], "SEND {i}");
    }

    // RDMA WRITEs: into the peer's shared region at an odd offset, and into its raw region.
    local.write(0, &pattern(me, b'W', AREA)).unwrap();
    qp.post_send(send(1, SendOp::Write { remote_addr: pw.0 + 3, rkey: pw.1 }, &local, 0, AREA)).unwrap();
    qp.post_send(send(2, SendOp::Write { remote_addr: praw.0, rkey: praw.1 }, &local, 0, AREA)).unwrap();
    qp.post_send(send(3, SendOp::SendWithImm(me), &local, 0, 0)).unwrap();
    let wcs = wait_wcs(&cq, 4, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == pqpn));
    let mut want = vec![0u8; 3];
    want.extend(pattern(pqpn, b'W', AREA));
    assert_eq!(write_area.to_vec(0, AREA + 3).unwrap(), want, "RDMA WRITE data");

    // RDMA READ.
    local.fill(0);
    qp.post_send(send(4, SendOp::Read { remote_addr: pr.0, rkey: pr.1 }, &local, 0, AREA)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(local.to_vec(0, AREA).unwrap(), pattern(pqpn, b'R', AREA), "RDMA READ data");
    // And of the peer's moved heap pages.
    local.fill(0);
    qp.post_send(send(7, SendOp::Read { remote_addr: ppaged.0, rkey: ppaged.1 }, &local, 0, AREA)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(local.to_vec(0, AREA).unwrap(), pattern(pqpn, b'P', AREA), "RDMA READ of moved heap pages");

    // Atomics on the peer's word at offset 8: fetch-and-add 5, then compare-and-swap.
    let orig = u64::from(pqpn) * 1000;
    let swap = 0xdead_beef_0000_0000 | u64::from(pqpn);
    qp.post_send(send(5, SendOp::FetchAdd { remote_addr: pa.0 + 8, rkey: pa.1, add: 5 }, &local, AREA, 8)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::Success, "{wcs:?}");
    assert_eq!(local.to_vec(AREA, 8).unwrap(), orig.to_ne_bytes(), "fetch-and-add result");
    let cas = SendOp::CompareSwap { remote_addr: pa.0 + 8, rkey: pa.1, compare: orig + 5, swap };
    qp.post_send(send(6, cas, &local, AREA + 8, 8)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::Success, "{wcs:?}");
    assert_eq!(local.to_vec(AREA + 8, 8).unwrap(), (orig + 5).to_ne_bytes(), "compare-and-swap result");

    out("PHASE2");
    assert_eq!(input(), "go");
    // What the peer did here: its atomics and its WRITE into the raw region.
    let mut want = [0u8; 64];
    want[8..16].copy_from_slice(&(0xdead_beef_0000_0000 | u64::from(me)).to_ne_bytes());
    assert_eq!(atomic_area.to_vec(0, 64).unwrap(), want, "atomics");
    drop(raw_mr);
    assert_eq!(raw[8..], pattern(pqpn, b'W', AREA), "RDMA WRITE into the reg_mr_raw region");
    out("HOLDING");
    assert_eq!(input(), "exit");
    drop((send_mr, recv_mr, write_area, read_area, atomic_area, local, paged_mr, qp, cq, pd));
    // Deregistered: the pages are private again, with the same contents.
    // SAFETY: still the AREA bytes allocated above.
    let paged_bytes = unsafe { std::slice::from_raw_parts(paged, AREA) };
    assert!(paged_bytes == &pattern(me, b'P', AREA)[..], "moved back with its contents");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(!maps.contains("/memfd:softrdma-mr"), "a region's memfd is still mapped here:\n{maps}");
    // SAFETY: allocated above with this layout; its region is gone.
    unsafe { std::alloc::dealloc(paged, layout) };
    out("OK");
}

/// Buffers in the clients' own heap (`reg_mr_raw`, not page-aligned: reached by process_vm),
/// which softrdmad reads ahead and writes behind in batches (verbs client_io.rs). The side with the
/// lower QPN leads:
/// 1. it sends ROUNDS messages from one buffer, rewritten before each post: what was read ahead
///    for one pass must not serve a later one; the peer checks every message;
/// 2. ROUNDS times it posts, in one list, an RDMA WRITE of a new pattern into the peer's buffer,
///    a READ of that buffer back (it must see the write, kept behind or made) and a SEND with
///    immediate; the peer, once that SEND arrived, finds the pattern in its own memory and
///    answers, and only then does the next round start;
/// 3. ROUNDS times, in one list, the WRITE of a new pattern, the READ of it back into a buffer
///    and a fenced SEND of that buffer: the SEND was read ahead with the buffer's old contents,
///    which the READ's data must replace; the peer checks what arrives and answers;
/// 4. ROUNDS times the peer writes a new pattern into its own buffer and then sends; on arrival
///    the leader READs that buffer (its target read ahead as the READ is taken) and must get the
///    pattern; then the same with READs of several packets, whose responses are built from what
///    each flush reads ahead for them.
fn batched_role(ctx: &Context, max_inline_data: u32) {
    const ROUNDS: usize = 150;
    const LEN: usize = 64;
    const SRC: usize = 0;
    const DST: usize = 4096;
    const BACK: usize = 8192;
    const RECV: usize = 12288;
    // Multi-packet READs: their responses are built from what is read ahead at each flush.
    const BIG: usize = 3 * 4096 + 100;
    const BIG_DST: usize = 24576;
    const BIG_BACK: usize = BIG_DST + 16384;
    const SIZE: usize = BIG_BACK + 16384;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    // With no inline data the payloads are read ahead by the daemon; with room for 64 bytes the
    // client copies them into the ring at post time (except a fenced SEND's).
    let cap = QpCap { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 2, max_recv_sge: 2, max_inline_data };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Rc, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false })
        .unwrap();
    let me = qp.qpn().value();
    let mut heap = vec![0u8; SIZE + 8];
    // SAFETY: `heap` outlives the region (dropped after it, at the end of this function); this
    // process touches it only through the region, between completions.
    let mr = unsafe { pd.reg_mr_raw(heap.as_mut_ptr().add(8), SIZE, RW) }.unwrap();
    qp.init(RW).unwrap();
    let recv = |i: usize| RecvWr { wr_id: i as u64, sgl: vec![mr.sge(RECV + i * LEN, LEN).unwrap()].into() };
    for i in 0..ROUNDS {
        qp.post_recv(recv(i)).unwrap();
    }
    let gid = ctx.query_gid(1, 1).unwrap();
    out(&format!("{me} {} {}", mr.addr(), mr.rkey()));
    let peer: Vec<u64> = input().split(' ').map(|w| w.parse().unwrap()).collect();
    let (pqpn, paddr, prkey) = (peer[0] as u32, peer[1], peer[2] as u32);
    qp.connect(&pd, &ConnectParams::new(softrdma_verbs::Qpn::new(pqpn), Psn::new(pqpn), gid, Psn::new(me))).unwrap();
    let ok = |wcs: &[WorkCompletion]| assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    if me < pqpn {
        for i in 0..ROUNDS {
            mr.write(SRC, &pattern(i as u32, b's', LEN)).unwrap();
            qp.post_send(send(i as u64, SendOp::Send, &mr, SRC, LEN)).unwrap();
            ok(&wait_wcs(&cq, 1, 30));
        }
        assert_eq!(input(), "ready");
        for i in 0..ROUNDS {
            mr.write(SRC, &pattern(i as u32, b'w', LEN)).unwrap();
            qp.post_send_list([
                send(1, SendOp::Write { remote_addr: paddr + DST as u64, rkey: prkey }, &mr, SRC, LEN),
                send(2, SendOp::Read { remote_addr: paddr + DST as u64, rkey: prkey }, &mr, BACK, LEN),
                send(3, SendOp::SendWithImm(i as u32), &mr, SRC, 0),
            ])
            .unwrap();
            let wcs = wait_wcs(&cq, 4, 30);
            ok(&wcs);
            assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == i as u32), "{wcs:?}");
            assert_eq!(mr.to_vec(BACK, LEN).unwrap(), pattern(i as u32, b'w', LEN), "round {i}: READ after WRITE");
            qp.post_recv(recv(i)).unwrap();
        }
        for i in 0..ROUNDS {
            mr.write(SRC, &pattern(i as u32, b'f', LEN)).unwrap();
            let mut fenced = send(3, SendOp::Send, &mr, BACK, LEN);
            fenced.flags = SendFlags::SIGNALED.with(SendFlags::FENCE);
            qp.post_send_list([
                send(1, SendOp::Write { remote_addr: paddr + DST as u64, rkey: prkey }, &mr, SRC, LEN),
                send(2, SendOp::Read { remote_addr: paddr + DST as u64, rkey: prkey }, &mr, BACK, LEN),
                fenced,
            ])
            .unwrap();
            let wcs = wait_wcs(&cq, 4, 30);
            ok(&wcs);
            assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == i as u32), "{wcs:?}");
            qp.post_recv(recv(i)).unwrap();
        }
        for (len, dst, back) in [(LEN, DST, BACK), (BIG, BIG_DST, BIG_BACK)] {
            for i in 0..ROUNDS {
                let wcs = wait_wcs(&cq, 1, 30);
                ok(&wcs);
                assert_eq!((wcs[0].opcode, wcs[0].imm), (WcOpcode::Recv, i as u32));
                qp.post_recv(recv(i)).unwrap();
                let read = SendOp::Read { remote_addr: paddr + dst as u64, rkey: prkey };
                qp.post_send(send(4, read, &mr, back, len)).unwrap();
                ok(&wait_wcs(&cq, 1, 30));
                let got = mr.to_vec(back, len).unwrap();
                assert!(got == pattern(i as u32, b'r', len), "round {i}: READ of {len} bytes the peer wrote");
                // The peer writes the next pattern only after this answer.
                qp.post_send(send(5, SendOp::SendWithImm(i as u32), &mr, SRC, 0)).unwrap();
                ok(&wait_wcs(&cq, 1, 30));
            }
        }
    } else {
        let wcs = wait_wcs(&cq, ROUNDS, 30);
        ok(&wcs);
        for w in &wcs {
            let i = w.wr_id as usize;
            assert_eq!(mr.to_vec(RECV + i * LEN, LEN).unwrap(), pattern(i as u32, b's', LEN), "message {i}");
            qp.post_recv(recv(i)).unwrap();
        }
        out("READY");
        for i in 0..ROUNDS {
            let wcs = wait_wcs(&cq, 1, 30);
            ok(&wcs);
            assert_eq!(wcs[0].imm, i as u32);
            assert_eq!(mr.to_vec(DST, LEN).unwrap(), pattern(i as u32, b'w', LEN), "round {i}: WRITE seen");
            qp.post_recv(recv(i)).unwrap();
            qp.post_send(send(i as u64, SendOp::SendWithImm(i as u32), &mr, SRC, 0)).unwrap();
            ok(&wait_wcs(&cq, 1, 30));
        }
        for i in 0..ROUNDS {
            let wcs = wait_wcs(&cq, 1, 30);
            ok(&wcs);
            let slot = RECV + wcs[0].wr_id as usize * LEN;
            assert_eq!(wcs[0].byte_len as usize, LEN);
            assert_eq!(
                mr.to_vec(slot, LEN).unwrap(),
                pattern(i as u32, b'f', LEN),
                "round {i}: fenced SEND of READ data"
            );
            qp.post_recv(recv(wcs[0].wr_id as usize)).unwrap();
            qp.post_send(send(i as u64, SendOp::SendWithImm(i as u32), &mr, SRC, 0)).unwrap();
            ok(&wait_wcs(&cq, 1, 30));
        }
        for (len, dst) in [(LEN, DST), (BIG, BIG_DST)] {
            for i in 0..ROUNDS {
                mr.write(dst, &pattern(i as u32, b'r', len)).unwrap();
                qp.post_send(send(i as u64, SendOp::SendWithImm(i as u32), &mr, SRC, 0)).unwrap();
                // Our SEND's completion and the leader's answer, in either order.
                let wcs = wait_wcs(&cq, 2, 30);
                ok(&wcs);
                assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == i as u32), "{wcs:?}");
                for w in wcs.iter().filter(|w| w.opcode == WcOpcode::Recv) {
                    qp.post_recv(recv(w.wr_id as usize)).unwrap();
                }
            }
        }
    }
    drop((mr, qp, cq, pd));
    drop(heap);
    out("OK");
}

/// Two RC QPs of this process with capacities `cap` on `cq`, connected to each other with remote
/// rights `access`: their traffic stays inside the daemon's device (executed directly when it can
/// be).
fn looped_pair(
    ctx: &Context,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    cap: QpCap,
    access: Access,
) -> (QueuePair, QueuePair) {
    let gid = ctx.query_gid(1, 1).unwrap();
    let attr = QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
    let (a, b) = (pd.create_qp(&attr).unwrap(), pd.create_qp(&attr).unwrap());
    a.init(access).unwrap();
    b.init(access).unwrap();
    a.connect(pd, &ConnectParams::new(b.qpn(), Psn::new(5), gid, Psn::new(9))).unwrap();
    b.connect(pd, &ConnectParams::new(a.qpn(), Psn::new(9), gid, Psn::new(5))).unwrap();
    (a, b)
}

/// Small payloads in regions reached by process_vm are copied into the send ring's slot when
/// posted (verbs daemon/client.rs `copy_payload`): SENDs of two SGEs and WRITEs of a buffer
/// rewritten before every post arrive byte for byte, and the daemon reads none of them (the test
/// counts its system calls between "ROUNDS" and "go"), on QPs without inline data (`max_inline_data`
/// 0: the slot has room for `slot::COPY_ROOM` bytes anyway, since this process registers its
/// regions before it creates the QPs), while inline data the application
/// asks for stays bound by it; a fenced SEND of a buffer that a READ just
/// filled is not copied at post and carries the READ's data, and so does a SEND posted behind a
/// fenced one; SGEs the daemon refuses still fail
/// with LOC_PROT_ERR: an unknown key, bytes past the region, a region of another PD, a region
/// deregistered.
fn copied_role(ctx: &Context) {
    const ROUNDS: usize = 100;
    const LEN: usize = 200;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 2, max_recv_sge: 1, max_inline_data: 0 };
    let pair = || looped_pair(ctx, &pd, &cq, cap, RW);
    let mut heap = vec![0u8; 8192 + 16];
    // SAFETY: `heap` outlives the regions (dropped after them); this process touches it only
    // through them, between posts and completions.
    let (src, dst) = unsafe {
        (
            pd.reg_mr_raw(heap.as_mut_ptr().add(8), 4096, RW).unwrap(),
            pd.reg_mr_raw(heap.as_mut_ptr().add(4104), 4096, RW).unwrap(),
        )
    };
    let (a, b) = pair();
    let inline =
        SendWr { wr_id: 0, op: SendOp::Send, payload: Payload::Inline(vec![1]), flags: SendFlags::INLINE, ud: None };
    assert!(a.post_send(inline).is_err(), "inline data past max_inline_data 0");
    out("READY");
    assert_eq!(input(), "go");
    for i in 0..ROUNDS {
        let data = pattern(i as u32, b'c', 3 * LEN);
        src.write(0, &data).unwrap();
        b.post_recv(RecvWr { wr_id: i as u64, sgl: vec![dst.sge(0, LEN).unwrap()].into() }).unwrap();
        let mut two = send(1, SendOp::SendWithImm(i as u32), &src, 0, 20);
        two.payload = Payload::Sgl(vec![src.sge(0, 20).unwrap(), src.sge(2 * LEN, LEN - 20).unwrap()].into());
        a.post_send_list([
            two,
            send(2, SendOp::Write { remote_addr: dst.addr() + 1024, rkey: dst.rkey() }, &src, LEN, LEN),
        ])
        .unwrap();
        let wcs = wait_wcs(&cq, 3, 30);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert!(wcs.iter().any(|w| w.opcode == WcOpcode::Recv && w.imm == i as u32 && w.byte_len as usize == LEN));
        let mut want = data[..20].to_vec();
        want.extend_from_slice(&data[2 * LEN..3 * LEN - 20]);
        assert_eq!(dst.to_vec(0, LEN).unwrap(), want, "round {i}: SEND of two SGEs");
        assert_eq!(dst.to_vec(1024, LEN).unwrap(), data[LEN..2 * LEN], "round {i}: WRITE");
    }
    out("ROUNDS");
    assert_eq!(input(), "go");
    // READ the peer's bytes into the buffer, then a fenced SEND of it: the READ's data goes.
    let fresh = pattern(7, b'F', LEN);
    dst.write(2048, &fresh).unwrap();
    src.write(0, &[0; LEN]).unwrap();
    b.post_recv(RecvWr { wr_id: 77, sgl: vec![dst.sge(0, LEN).unwrap()].into() }).unwrap();
    let mut fenced = send(5, SendOp::Send, &src, 0, LEN);
    fenced.flags = SendFlags::SIGNALED.with(SendFlags::FENCE);
    a.post_send_list([
        send(4, SendOp::Read { remote_addr: dst.addr() + 2048, rkey: dst.rkey() }, &src, 0, LEN),
        fenced,
    ])
    .unwrap();
    let wcs = wait_wcs(&cq, 3, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(dst.to_vec(0, LEN).unwrap(), fresh, "fenced SEND of READ data");
    // A request behind a fenced one waits too: READ into the buffer, a fenced SEND of something
    // else, then a plain SEND of the buffer, which must carry the READ's data.
    let (a2, b2) = pair();
    let fresh2 = pattern(8, b'G', LEN);
    dst.write(2048, &fresh2).unwrap();
    src.write(0, &[0; LEN]).unwrap();
    for k in 0..2u64 {
        b2.post_recv(RecvWr { wr_id: 80 + k, sgl: vec![dst.sge(512 * k as usize, LEN).unwrap()].into() }).unwrap();
    }
    let mut fenced = send(7, SendOp::Send, &src, 3 * LEN, 8);
    fenced.flags = SendFlags::SIGNALED.with(SendFlags::FENCE);
    let read = send(6, SendOp::Read { remote_addr: dst.addr() + 2048, rkey: dst.rkey() }, &src, 0, LEN);
    a2.post_send_list([read, fenced, send(8, SendOp::Send, &src, 0, LEN)]).unwrap();
    let wcs = wait_wcs(&cq, 5, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(dst.to_vec(512, LEN).unwrap(), fresh2, "a SEND behind a fenced one, of READ data");
    drop((a2, b2));
    let pd2 = ctx.alloc_pd();
    // SAFETY: as above.
    let foreign = unsafe { pd2.reg_mr_raw(heap.as_mut_ptr().add(8), 64, RW) }.unwrap();
    // SAFETY: as above.
    let gone = unsafe { pd.reg_mr_raw(heap.as_mut_ptr().add(8), 64, RW) }.unwrap().lkey();
    let bad = [
        ("an unknown key", Sge { addr: src.addr(), length: 8, lkey: 0 }),
        ("bytes past the region", Sge { addr: src.addr() + 4090, length: 8, lkey: src.lkey() }),
        ("a region of another PD", Sge { addr: src.addr(), length: 8, lkey: foreign.lkey() }),
        ("a region deregistered", Sge { addr: src.addr(), length: 8, lkey: gone }),
    ];
    for (what, sge) in bad {
        let (a, b) = pair();
        // Were the request carried out, it would complete (not wait for a receive).
        b.post_recv(RecvWr { wr_id: 9, sgl: vec![dst.sge(0, 64).unwrap()].into() }).unwrap();
        let mut wr = send(3, SendOp::Send, &src, 0, 8);
        wr.payload = Payload::Sgl(vec![sge].into());
        a.post_send(wr).unwrap();
        let wcs = wait_wcs(&cq, 1, 30);
        assert_eq!(wcs[0].status, WcStatus::LocProtErr, "{what}: {wcs:?}");
    }
    drop((foreign, src, dst, a, b, cq, pd2, pd));
    drop(heap);
    out("OK");
}

/// Atomics executed directly between two QPs of one device on a word in this process's heap
/// (process_vm): their targets are read ahead with the pass and updated in the copy, so a list of
/// 32 fetch-and-adds costs the daemon a read or two (the test counts them between "READY" and
/// "ADDS"), and each still returns the word as every earlier atomic left it; compare-and-swaps
/// chain, one with a wrong compare value swaps nothing; a value this process stores before posting
/// is what the next atomic finds.
fn atomics_role(ctx: &Context) {
    const ADDS: usize = 32;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let all = RW.with(Access::REMOTE_ATOMIC);
    let (a, b) = looped_pair(ctx, &pd, &cq, cap, all);
    let mut heap = vec![0u8; 4096 + 16];
    // SAFETY: `heap` outlives the regions (dropped after them); this process touches it only
    // through them, between posts and completions.
    let (word, results) = unsafe {
        (
            pd.reg_mr_raw(heap.as_mut_ptr().add(8), 64, all).unwrap(),
            pd.reg_mr_raw(heap.as_mut_ptr().add(1024), 2048, RW).unwrap(),
        )
    };
    let get = |mr: &MemoryRegion, off: usize| u64::from_ne_bytes(mr.to_vec(off, 8).unwrap().try_into().unwrap());
    let target =
        |op: fn(u64, u32) -> SendOp, k: usize| send(k as u64, op(word.addr() + 8, word.rkey()), &results, 8 * k, 8);
    word.write(8, &1000u64.to_ne_bytes()).unwrap();
    out("READY");
    assert_eq!(input(), "go");
    let adds: Vec<SendWr> = (0..ADDS)
        .map(|k| {
            send(
                k as u64,
                SendOp::FetchAdd { remote_addr: word.addr() + 8, rkey: word.rkey(), add: k as u64 + 1 },
                &results,
                8 * k,
                8,
            )
        })
        .collect();
    a.post_send_list(adds).unwrap();
    let wcs = wait_wcs(&cq, ADDS, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::FetchAdd), "{wcs:?}");
    let mut want = 1000u64;
    for k in 0..ADDS {
        assert_eq!(get(&results, 8 * k), want, "fetch-and-add {k}");
        want += k as u64 + 1;
    }
    assert_eq!(get(&word, 8), want, "the word after the adds");
    out("ADDS");
    assert_eq!(input(), "go");
    // Compare-and-swaps in one list: each finds what the one before left; the last compares wrong.
    let mut cas: Vec<SendWr> = (0..8)
        .map(|k| {
            let v = want + 3 * k as u64;
            send(
                k as u64,
                SendOp::CompareSwap { remote_addr: word.addr() + 8, rkey: word.rkey(), compare: v, swap: v + 3 },
                &results,
                8 * k,
                8,
            )
        })
        .collect();
    cas.push(send(
        8,
        SendOp::CompareSwap { remote_addr: word.addr() + 8, rkey: word.rkey(), compare: 1, swap: 2 },
        &results,
        64,
        8,
    ));
    a.post_send_list(cas).unwrap();
    let wcs = wait_wcs(&cq, 9, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    for k in 0..8 {
        assert_eq!(get(&results, 8 * k), want + 3 * k as u64, "compare-and-swap {k}");
    }
    assert_eq!(get(&results, 64), want + 24, "the failed compare returns the word");
    assert_eq!(get(&word, 8), want + 24, "and swaps nothing");
    // A store of this process before the post is what the next atomic finds.
    word.write(8, &77u64.to_ne_bytes()).unwrap();
    a.post_send(target(|addr, rkey| SendOp::FetchAdd { remote_addr: addr, rkey, add: 1 }, 0)).unwrap();
    assert_eq!(wait_wcs(&cq, 1, 30)[0].status, WcStatus::Success);
    assert_eq!((get(&results, 0), get(&word, 8)), (77, 78));
    drop((word, results, a, b, cq, pd));
    drop(heap);
    out("OK");
}

/// A WRITE of data into the peer's heap buffer (process_vm: written behind) and then a WRITE of
/// a flag into its `reg_mr` region (mapped: written at once), on one QP: the peer spins on the flag
/// and must find the data in place whenever the flag has arrived ("data, then flag").
fn ordered_role(ctx: &Context) {
    const ROUNDS: usize = 500;
    const LEN: usize = 64;
    let (pd, cq, qp) = rc_qp(ctx);
    let me = qp.qpn().value();
    let mut heap = vec![0u8; 2 * 4096 + 8];
    // SAFETY: `heap` outlives the regions (dropped after them); this process touches it only
    // through them. The sources are heap memory too, read ahead: no read of mapped memory comes
    // between the two WRITEs.
    let data = unsafe { pd.reg_mr_raw(heap.as_mut_ptr().add(8), 4096, RW) }.unwrap();
    let src = unsafe { pd.reg_mr_raw(heap.as_mut_ptr().add(4096 + 8), 4096, RW) }.unwrap();
    let flag = pd.reg_mr(4096, RW).unwrap();
    qp.init(RW).unwrap();
    let recv = || RecvWr { wr_id: 0, sgl: vec![src.sge(2048, 8).unwrap()].into() };
    for _ in 0..16 {
        qp.post_recv(recv()).unwrap();
    }
    let gid = ctx.query_gid(1, 1).unwrap();
    out(&format!("{me} {} {} {} {}", data.addr(), data.rkey(), flag.addr(), flag.rkey()));
    let peer: Vec<u64> = input().split(' ').map(|w| w.parse().unwrap()).collect();
    let (pqpn, pdata, pflag) = (peer[0] as u32, (peer[1], peer[2] as u32), (peer[3], peer[4] as u32));
    qp.connect(&pd, &ConnectParams::new(softrdma_verbs::Qpn::new(pqpn), Psn::new(pqpn), gid, Psn::new(me))).unwrap();
    for i in 1..=ROUNDS {
        if me < pqpn {
            src.write(0, &pattern(i as u32, b'd', LEN)).unwrap();
            src.write(1024, &(i as u64).to_ne_bytes()).unwrap();
            qp.post_send_list([
                send(1, SendOp::Write { remote_addr: pdata.0, rkey: pdata.1 }, &src, 0, LEN),
                send(2, SendOp::Write { remote_addr: pflag.0, rkey: pflag.1 }, &src, 1024, 8),
            ])
            .unwrap();
            // Both WRITEs, and the peer's answer.
            let wcs = wait_wcs(&cq, 3, 30);
            assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
            qp.post_recv(recv()).unwrap();
        } else {
            let t = Instant::now();
            while flag.to_vec(0, 8).unwrap() != (i as u64).to_ne_bytes() {
                assert!(t.elapsed() < Duration::from_secs(30), "round {i}: no flag");
                std::hint::spin_loop();
            }
            assert_eq!(data.to_vec(0, LEN).unwrap(), pattern(i as u32, b'd', LEN), "round {i}: flag before data");
            qp.post_send(send(9, SendOp::Send, &src, 0, 8)).unwrap();
            let wcs = wait_wcs(&cq, 1, 30);
            assert_eq!(wcs[0].status, WcStatus::Success);
        }
    }
    drop((data, flag, src, qp, cq, pd));
    drop(heap);
    out("OK");
}

/// Registering memory of this process that is not writable, with a right to write it, is refused
/// (the daemon writes such regions after the fact, when a refusal could no longer fail the work
/// request); with read rights alone it is accepted, and so is writable memory.
fn readonly_role(ctx: &Context) {
    let pd = ctx.alloc_pd();
    // SAFETY: a fresh private anonymous mapping of two pages, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let p = p.cast::<u8>();
    // SAFETY: the second page of the mapping above.
    assert_eq!(unsafe { libc::mprotect(p.add(4096).cast(), 4096, libc::PROT_READ) }, 0);
    // SAFETY: the ranges lie in the mapping, which outlives the regions (dropped before munmap).
    unsafe {
        assert!(pd.reg_mr_raw(p.add(8), 8000, RW).is_err(), "write rights on a read-only page");
        assert!(pd.reg_mr_raw(p.add(4096), 64, Access::LOCAL_WRITE).is_err(), "local write on a read-only page");
        let ro = pd.reg_mr_raw(p.add(8), 8000, Access::REMOTE_READ).expect("read rights on readable pages");
        let rw = pd.reg_mr_raw(p.add(8), 4000, RW).expect("write rights on a writable page");
        drop((ro, rw));
        libc::munmap(p.cast(), 8192);
    }
    out("OK");
}

/// Two QPs of one process connected to each other: what a non-root user runs.
fn selftest_role(ctx: &Context) {
    let (pd, cq, a) = rc_qp(ctx);
    let b = small_rc_qp(&pd, &cq);
    let gid: Gid = ctx.query_gid(1, 1).unwrap();
    let src = pd.reg_mr(AREA, Access::LOCAL_WRITE).unwrap();
    let dst = pd.reg_mr(AREA, RW).unwrap();
    src.write(0, &pattern(1, b'X', AREA)).unwrap();
    b.init(RW).unwrap();
    b.post_recv(RecvWr { wr_id: 7, sgl: vec![dst.sge(0, 4096).unwrap()].into() }).unwrap();
    a.connect(&pd, &ConnectParams::new(b.qpn(), Psn::new(5), gid, Psn::new(9))).unwrap();
    b.connect(&pd, &ConnectParams::new(a.qpn(), Psn::new(9), gid, Psn::new(5))).unwrap();
    a.post_send(send(1, SendOp::Send, &src, 0, 4096)).unwrap();
    a.post_send(send(2, SendOp::Write { remote_addr: dst.addr(), rkey: dst.rkey() }, &src, 0, AREA)).unwrap();
    let wcs = wait_wcs(&cq, 3, 30);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    assert_eq!(dst.to_vec(0, AREA).unwrap(), pattern(1, b'X', AREA));
    // A local key of another protection domain is refused (LOC_PROT_ERR), as the engine checks
    // every SGE against the QP's PD.
    let pd2 = ctx.alloc_pd();
    let other = pd2.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    a.post_send(send(3, SendOp::Send, &other, 0, 16)).unwrap();
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!(wcs[0].status, WcStatus::LocProtErr, "{wcs:?}");

    // A posted list that fails part-way (its second request has more SGEs than max_send_sge): the
    // error comes back, the first request is carried out, the third is never posted.
    let la = small_rc_qp(&pd, &cq);
    let lb = small_rc_qp(&pd, &cq);
    lb.init(RW).unwrap();
    la.connect(&pd, &ConnectParams::new(lb.qpn(), Psn::new(50), gid, Psn::new(90))).unwrap();
    lb.connect(&pd, &ConnectParams::new(la.qpn(), Psn::new(90), gid, Psn::new(50))).unwrap();
    src.write(0, &pattern(2, b'L', 64)).unwrap();
    let write_at =
        |wr_id, off: u64| send(wr_id, SendOp::Write { remote_addr: dst.addr() + off, rkey: dst.rkey() }, &src, 0, 64);
    let mut two_sges = write_at(11, 2048);
    two_sges.payload = Payload::Sgl(vec![src.sge(0, 32).unwrap(), src.sge(32, 32).unwrap()].into());
    let untouched = dst.to_vec(3072, 64).unwrap();
    let r = la.post_send_list([write_at(10, 1024), two_sges, write_at(12, 3072)]);
    assert!(
        matches!(r, Err(softrdma_verbs::Error::Verbs(softrdma_transport::VerbsError::InvalidWorkRequest(_)))),
        "{r:?}"
    );
    let wcs = wait_wcs(&cq, 1, 30);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (10, WcStatus::Success), "{wcs:?}");
    assert_eq!(dst.to_vec(1024, 64).unwrap(), pattern(2, b'L', 64));
    std::thread::sleep(Duration::from_millis(200));
    let mut more = Vec::new();
    cq.poll(4, &mut more).unwrap();
    assert!(more.is_empty(), "{more:?}");
    assert_eq!(dst.to_vec(3072, 64).unwrap(), untouched);

    // A completion channel and an SRQ: a UD QP receiving through an SRQ, its CQ armed; the
    // channel's descriptor becomes readable and names the CQ.
    let ch = ctx.create_comp_channel().unwrap();
    let ecq = ctx.create_cq(16, Some(&ch)).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 0, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 32 };
    let ud = pd
        .create_qp(&QpInitAttr {
            qp_type: QpType::Ud,
            send_cq: &cq,
            recv_cq: &ecq,
            srq: Some(&srq),
            cap,
            sq_sig_all: false,
        })
        .unwrap();
    ud.bring_up_ud(9, Psn::new(0)).unwrap();
    srq.post_recv(RecvWr { wr_id: 77, sgl: vec![dst.sge(0, 1024).unwrap()].into() }).unwrap();
    ecq.req_notify(false).unwrap();
    let ah = pd.create_ah(&AhAttr::new(gid, 1)).unwrap();
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::SendWithImm(0xabcd),
        payload: Payload::Inline(b"through the channel".to_vec()),
        flags: SendFlags::INLINE,
        ud: Some(ah.ud(ud.qpn(), 9)),
    };
    ud.post_send(wr).unwrap();
    assert_eq!(ch.get_cq_event(Some(Duration::from_secs(10))), Some(ecq.handle()));
    let wcs = wait_wcs(&ecq, 1, 10);
    assert_eq!((wcs[0].wr_id, wcs[0].imm, wcs[0].status), (77, 0xabcd, WcStatus::Success));
    assert_eq!(dst.to_vec(40, 19).unwrap(), b"through the channel");
    // SAFETY: geteuid cannot fail.
    out(&format!("OK uid {}", unsafe { libc_geteuid() }));
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// A client that never polls its (small) CQ.
fn nopoll_role(ctx: &Context) {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4, None).unwrap();
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Ud, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: true })
        .unwrap();
    let mr = pd.reg_mr(64 * 128, Access::LOCAL_WRITE).unwrap();
    qp.bring_up_ud(7, Psn::new(0)).unwrap();
    for i in 0..32 {
        qp.post_recv(RecvWr { wr_id: i, sgl: vec![mr.sge(i as usize * 128, 128).unwrap()].into() }).unwrap();
    }
    let ah = pd.create_ah(&AhAttr::new(ctx.query_gid(1, 1).unwrap(), 1)).unwrap();
    for i in 0..32 {
        let wr = SendWr {
            wr_id: i,
            op: SendOp::Send,
            payload: Payload::Sgl(vec![mr.sge(32 * 128, 64).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: Some(ah.ud(qp.qpn(), 7)),
        };
        qp.post_send(wr).unwrap();
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if let Some(AsyncEvent::CqError(_)) = ctx.get_async_event(Duration::from_millis(100)) {
            out("OVERFLOW");
            return;
        }
    }
    out("NO OVERFLOW EVENT");
    std::process::exit(1);
}

/// Rounds of a UD QP that posts its unsignaled SENDs and is destroyed at once (as `mckey -s` does
/// before it exits), each right after the receives for them were posted to a QP of the same
/// device: every datagram posted before the destroy arrives there, exactly once.
fn lastwords_role(ctx: &Context) {
    const ROUNDS: usize = 40;
    const N: usize = 16;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    let cap = QpCap { max_send_wr: N as u32, max_recv_wr: 1024, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    fn attr(cq: &CompletionQueue, cap: QpCap) -> QpInitAttr<'_> {
        QpInitAttr { qp_type: QpType::Ud, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false }
    }
    let rx = pd.create_qp(&attr(&cq, cap)).unwrap();
    rx.bring_up_ud(0x77, Psn::new(0)).unwrap();
    let mr = pd.reg_mr(ROUNDS * N * 64, Access::LOCAL_WRITE).unwrap();
    let ah = pd.create_ah(&AhAttr::new(ctx.query_gid(1, 1).unwrap(), 1)).unwrap();
    let scq = ctx.create_cq(16, None).unwrap();
    for round in 0..ROUNDS {
        let tx = pd.create_qp(&attr(&scq, cap)).unwrap();
        tx.bring_up_ud(0x77, Psn::new(0)).unwrap();
        // Idle past the device loop's spin, so that it sleeps when the requests are posted.
        std::thread::sleep(Duration::from_millis(2));
        // The receives are posted just before the SENDs, so the destroy must take them in first.
        for i in round * N..(round + 1) * N {
            rx.post_recv(RecvWr { wr_id: i as u64, sgl: vec![mr.sge(i * 64, 64).unwrap()].into() }).unwrap();
        }
        for i in 0..N {
            let wr = SendWr {
                wr_id: i as u64,
                op: SendOp::Send,
                payload: Payload::Inline((round * N + i).to_le_bytes().to_vec()),
                flags: SendFlags::INLINE,
                ud: Some(ah.ud(rx.qpn(), 0x77)),
            };
            tx.post_send(wr).unwrap();
        }
        drop(tx);
    }
    let mut wcs = Vec::new();
    let t = Instant::now();
    while wcs.len() < ROUNDS * N && t.elapsed() < Duration::from_secs(10) {
        cq.poll(ROUNDS * N - wcs.len(), &mut wcs).unwrap();
        std::thread::yield_now();
    }
    let mut seen = vec![0u32; ROUNDS * N];
    for wc in &wcs {
        assert_eq!((wc.status, wc.opcode, wc.byte_len), (WcStatus::Success, WcOpcode::Recv, 48), "{wc:?}");
        let b = mr.to_vec(wc.wr_id as usize * 64 + 40, 8).unwrap();
        seen[usize::from_le_bytes(b.try_into().unwrap())] += 1;
    }
    let lost: Vec<usize> = (0..ROUNDS * N).filter(|&i| seen[i] == 0).collect();
    assert!(lost.is_empty(), "{} of {} datagrams lost: {lost:?}", lost.len(), ROUNDS * N);
    assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    out("OK");
}

/// A receive, then a SEND to it, both published while the device loop's pass is paused between its
/// take of the receive rings and its take of the send rings (the daemon runs with
/// `SOFTRDMA_TEST_PASS_PAUSE_MS`; a receive posted to a third QP starts the pass): the datagram
/// finds its receive, every round.
fn midpass_role(ctx: &Context) {
    const ROUNDS: usize = 3;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let attr = QpInitAttr { qp_type: QpType::Ud, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false };
    let (rx, tx, start) = (pd.create_qp(&attr).unwrap(), pd.create_qp(&attr).unwrap(), pd.create_qp(&attr).unwrap());
    for qp in [&rx, &tx, &start] {
        qp.bring_up_ud(0x77, Psn::new(0)).unwrap();
    }
    let mr = pd.reg_mr(2 * ROUNDS * 64, Access::LOCAL_WRITE).unwrap();
    let ah = pd.create_ah(&AhAttr::new(ctx.query_gid(1, 1).unwrap(), 1)).unwrap();
    for round in 0..ROUNDS {
        // Idle past the device loop's spin; then the receive that starts a paused pass.
        std::thread::sleep(Duration::from_millis(5));
        let sge = |i: usize| vec![mr.sge(i * 64, 64).unwrap()].into();
        start.post_recv(RecvWr { wr_id: 100, sgl: sge(ROUNDS + round) }).unwrap();
        // Well inside the pause (the pass started within microseconds of the receive).
        std::thread::sleep(Duration::from_millis(50));
        rx.post_recv(RecvWr { wr_id: round as u64, sgl: sge(round) }).unwrap();
        let payload = Payload::Inline((round as u64 + 0x1000).to_le_bytes().to_vec());
        let ud = Some(ah.ud(rx.qpn(), 0x77));
        tx.post_send(SendWr { wr_id: 7, op: SendOp::Send, payload, flags: SendFlags::INLINE, ud }).unwrap();
        let mut wcs = Vec::new();
        let t = Instant::now();
        while wcs.is_empty() && t.elapsed() < Duration::from_secs(3) {
            cq.poll(1, &mut wcs).unwrap();
            std::thread::yield_now();
        }
        let wc = wcs.first().unwrap_or_else(|| panic!("round {round}: the datagram found no receive"));
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (round as u64, WcStatus::Success, WcOpcode::Recv, 48)
        );
        assert_eq!(mr.to_vec(round * 64 + 40, 8).unwrap(), (round as u64 + 0x1000).to_le_bytes());
    }
    out("OK");
}

/// SENDs received into this process's own heap memory (a `reg_mr_raw` region, which the daemon
/// writes with a system call) between two RC QPs of the device (executed directly): the daemon
/// publishes each completion before it makes the write, and pauses in between (it runs with
/// `SOFTRDMA_TEST_WRITES_PAUSE_MS`); the poll hands the receive's completion out only once the
/// data is in place, every round.
fn latewrite_role(ctx: &Context) {
    const ROUNDS: usize = 3;
    let pd = ctx.alloc_pd();
    // Polled busily in the first rounds, through its channel in the last two.
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let (tx, rx) = looped_pair(ctx, &pd, &cq, cap, Access::LOCAL_WRITE);
    let mut heap = vec![0u8; ROUNDS * 64 + 8];
    let base = heap.as_mut_ptr();
    // SAFETY: `heap` outlives the region (dropped after it, at the end of this function); this
    // process reads it only after the completions of the receives into it.
    let mr = unsafe { pd.reg_mr_raw(base.add(8), ROUNDS * 64, Access::LOCAL_WRITE) }.unwrap();
    // A receive `wr_id` into slot `at` of the region, and an 8-byte SEND of `value` to it.
    let send = |wr_id: u64, at: usize, value: u64| {
        rx.post_recv(RecvWr { wr_id, sgl: vec![mr.sge(at * 64, 64).unwrap()].into() }).unwrap();
        let payload = Payload::Inline(value.to_le_bytes().to_vec());
        tx.post_send(SendWr { wr_id: 7, op: SendOp::Send, payload, flags: SendFlags::INLINE, ud: None }).unwrap();
    };
    // Slot `at`'s first 8 bytes. SAFETY: the region's bytes, in `heap`, written by the daemon;
    // volatile since the compiler does not see that write.
    let slot = |at: usize| -> Vec<u8> {
        (0..8).map(|i| unsafe { std::ptr::read_volatile(base.add(8 + at * 64 + i)) }).collect()
    };
    let mut wcs = Vec::new();
    for round in 0..ROUNDS {
        let want = round as u64 + 0x5150;
        send(round as u64, round, want);
        wcs.clear();
        let t = Instant::now();
        while wcs.is_empty() && t.elapsed() < Duration::from_secs(5) {
            cq.poll(1, &mut wcs).unwrap();
            std::thread::yield_now();
        }
        let wc = wcs.first().unwrap_or_else(|| panic!("round {round}: no completion"));
        assert_eq!((wc.wr_id, wc.status, wc.opcode, wc.byte_len), (round as u64, WcStatus::Success, WcOpcode::Recv, 8));
        assert_eq!(slot(round), want.to_le_bytes(), "round {round}: the completion came before its data");
        // The completion came through the daemon's pause: it was published before the write.
        assert!(t.elapsed() >= Duration::from_millis(250), "round {round}: the pause was not taken");
    }
    // Through the completion channel: the event comes once the write is made, so the one poll
    // after it finds the completion handed out and its data in place.
    cq.req_notify(false).unwrap();
    send(99, 0, 0x5eed);
    assert_eq!(ch.get_cq_event(Some(Duration::from_secs(10))), Some(cq.handle()));
    wcs.clear();
    cq.poll(1, &mut wcs).unwrap();
    let wc = wcs.first().expect("the completion the event was for");
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (99, WcStatus::Success, 8));
    assert_eq!(slot(0), 0x5eed_u64.to_le_bytes(), "through the channel: the completion came before its data");
    // Armed while the completion is in the ring but its write not yet made: the poll finds
    // nothing to hand out, and the event still comes, once the write is made.
    send(100, 1, 0xfeed);
    // Well inside the daemon's pause.
    std::thread::sleep(Duration::from_millis(50));
    cq.req_notify(false).unwrap();
    wcs.clear();
    assert_eq!(cq.poll(1, &mut wcs).unwrap(), 0, "handed out before its write was made");
    assert_eq!(ch.get_cq_event(Some(Duration::from_secs(10))), Some(cq.handle()), "no event once it was made");
    cq.poll(1, &mut wcs).unwrap();
    let wc = wcs.first().expect("the completion the event was for");
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (100, WcStatus::Success, 8));
    assert_eq!(slot(1), 0xfeed_u64.to_le_bytes(), "armed mid-pass: the completion came before its data");
    drop((tx, rx, cq, ch));
    drop(mr);
    drop(heap);
    out("OK");
}

/// Small receives, READ responses and atomic results into this process's own heap memory (a
/// `reg_mr_raw` region, which the daemon reaches by system call) are handed to this process to
/// make at its poll (verbs client_place.rs; the test counts the daemon's entries between the
/// lines): made here, each completion finds its data in place. Left unpolled, the daemon takes
/// them back before anything else touches those bytes: a READ of them sees them, a later WRITE of
/// them wins, a deregistration finds them made, and so do a move of their QP to the error state
/// and the destruction of their QP and CQ.
fn placed_role(ctx: &Context) {
    let pd = ctx.alloc_pd();
    let (cq, other_cq) = (ctx.create_cq(64, None).unwrap(), ctx.create_cq(64, None).unwrap());
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let (tx, rx) = looped_pair(ctx, &pd, &cq, cap, RW);
    // What READs and WRITEs the heap, its completions apart from the receives'.
    let (peer, _peer_rx) = looped_pair(ctx, &pd, &other_cq, cap, RW);
    let mut heap = vec![0u8; 2 * 4096];
    let base = heap.as_mut_ptr();
    // SAFETY: `heap` outlives the regions (dropped after them); this process reads it only after
    // the completions of the accesses into it.
    let (mr, other) =
        unsafe { (pd.reg_mr_raw(base, 4096, RW).unwrap(), pd.reg_mr_raw(base.add(4096), 4096, RW).unwrap()) };
    let local = pd.reg_mr(4096, RW).unwrap();
    // SAFETY: bytes of `heap`, written by the daemon or this process's polls; volatile since
    // the compiler does not see those writes.
    let at =
        |off: usize| -> Vec<u8> { (0..8).map(|i| unsafe { std::ptr::read_volatile(base.add(off + i)) }).collect() };
    let recv = |wr_id: u64, region: &MemoryRegion, off: usize| {
        rx.post_recv(RecvWr { wr_id, sgl: vec![region.sge(off, 8).unwrap()].into() }).unwrap();
    };
    // An unsignaled 8-byte SEND of `value`.
    let send_value = |value: u64| {
        let payload = Payload::Inline(value.to_le_bytes().to_vec());
        tx.post_send(SendWr { wr_id: 0, op: SendOp::Send, payload, flags: SendFlags::INLINE, ud: None }).unwrap();
    };
    let one = |cq: &CompletionQueue, wr_id: u64| {
        let wcs = wait_wcs(cq, 1, 30);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (wr_id, WcStatus::Success), "{wcs:?}");
    };
    // Until the test (which reads the daemon's counters) has seen the receive's data handed out.
    let handed_out = || {
        out("SENT");
        assert_eq!(input(), "go");
    };
    out("READY");
    assert_eq!(input(), "go");
    // Made here.
    for k in 0..8u64 {
        recv(k, &mr, 64 * k as usize);
        send_value(0xa000 + k);
        one(&cq, k);
        assert_eq!(at(64 * k as usize), (0xa000 + k).to_le_bytes(), "receive {k}: not in place");
    }
    local.write(0, &0x1234_5678_u64.to_le_bytes()).unwrap();
    tx.post_send(send(20, SendOp::Read { remote_addr: local.addr(), rkey: local.rkey() }, &mr, 1024, 8)).unwrap();
    one(&cq, 20);
    assert_eq!(at(1024), 0x1234_5678_u64.to_le_bytes(), "READ response not in place");
    local.write(64, &0x77_u64.to_le_bytes()).unwrap();
    let add = SendOp::FetchAdd { remote_addr: local.addr() + 64, rkey: local.rkey(), add: 5 };
    tx.post_send(send(21, add, &mr, 1032, 8)).unwrap();
    one(&cq, 21);
    assert_eq!(at(1032), 0x77_u64.to_le_bytes(), "atomic's original value not in place");
    assert_eq!(local.to_vec(64, 8).unwrap(), 0x7c_u64.to_le_bytes());
    // The most a placement carries (488 bytes), and one byte more (the daemon writes that).
    for (wr_id, at, len) in [(22u64, 1100usize, 488usize), (23, 3200, 489)] {
        let data = pattern(wr_id as u32, b'P', len);
        local.write(512, &data).unwrap();
        rx.post_recv(RecvWr { wr_id, sgl: vec![mr.sge(at, len).unwrap()].into() }).unwrap();
        let payload = Payload::Sgl(vec![local.sge(512, len).unwrap()].into());
        tx.post_send(SendWr { wr_id: 0, op: SendOp::Send, payload, flags: SendFlags::NONE, ud: None }).unwrap();
        one(&cq, wr_id);
        // SAFETY: bytes of `heap`, as in `at`.
        let got: Vec<u8> = (0..len).map(|i| unsafe { std::ptr::read_volatile(base.add(at + i)) }).collect();
        assert_eq!(got, data, "a {len}-byte receive not in place");
    }
    out("PLACED");
    assert_eq!(input(), "go");
    // Left unpolled, then READ by the peer: the READ sees it.
    recv(30, &mr, 2048);
    send_value(0xb0b0);
    handed_out();
    peer.post_send(send(31, SendOp::Read { remote_addr: mr.addr() + 2048, rkey: mr.rkey() }, &local, 128, 8)).unwrap();
    one(&other_cq, 31);
    assert_eq!(local.to_vec(128, 8).unwrap(), 0xb0b0_u64.to_le_bytes(), "a READ did not see a receive's data");
    one(&cq, 30);
    assert_eq!(at(2048), 0xb0b0_u64.to_le_bytes());
    // Left unpolled, then written by the peer: the WRITE wins.
    recv(40, &mr, 2112);
    send_value(0xc0c0);
    handed_out();
    local.write(192, &0xd0d0_u64.to_le_bytes()).unwrap();
    peer.post_send(send(41, SendOp::Write { remote_addr: mr.addr() + 2112, rkey: mr.rkey() }, &local, 192, 8)).unwrap();
    one(&other_cq, 41);
    one(&cq, 40);
    assert_eq!(at(2112), 0xd0d0_u64.to_le_bytes(), "a receive's data overwrote a later WRITE");
    // Left unpolled, then its region deregistered: made first.
    recv(50, &other, 0);
    send_value(0xe0e0);
    handed_out();
    drop(other);
    one(&cq, 50);
    assert_eq!(at(4096), 0xe0e0_u64.to_le_bytes(), "deregistered before its data was made");
    // Left unpolled, then its QP moved to the error state: made then (the application may take
    // the buffer back without polling, as after a destroy).
    recv(55, &mr, 3008);
    send_value(0x5555);
    handed_out();
    rx.modify(&ModifyQp { state: Some(QpState::Err), ..Default::default() }).unwrap();
    assert_eq!(at(3008), 0x5555_u64.to_le_bytes(), "not made when its QP went to error");
    // Left unpolled, then its QPs and CQ destroyed: made then, so that the buffer is the
    // application's again (its store is what a later READ finds).
    let gone_cq = ctx.create_cq(4, None).unwrap();
    let (gone_tx, gone_rx) = looped_pair(ctx, &pd, &gone_cq, cap, RW);
    gone_rx.post_recv(RecvWr { wr_id: 60, sgl: vec![mr.sge(3072, 8).unwrap()].into() }).unwrap();
    let payload = Payload::Inline(0xf0f0_u64.to_le_bytes().to_vec());
    gone_tx.post_send(SendWr { wr_id: 0, op: SendOp::Send, payload, flags: SendFlags::INLINE, ud: None }).unwrap();
    handed_out();
    drop((gone_tx, gone_rx, gone_cq));
    assert_eq!(at(3072), 0xf0f0_u64.to_le_bytes(), "not made when its QP and CQ went");
    // SAFETY: bytes of `heap`, the application's again.
    (0..8).for_each(|i| unsafe { std::ptr::write_volatile(base.add(3072 + i), 0x11) });
    peer.post_send(send(61, SendOp::Read { remote_addr: mr.addr() + 3072, rkey: mr.rkey() }, &local, 256, 8)).unwrap();
    one(&other_cq, 61);
    assert_eq!(local.to_vec(256, 8).unwrap(), [0x11; 8], "a receive's data landed after its QP went");
    assert_eq!(at(3072), [0x11; 8]);
    drop((tx, rx, peer, _peer_rx, cq, other_cq));
    drop((mr, local));
    drop(heap);
    out("OK");
}

/// Wait for the port to go down and come back.
fn portwatch_role(ctx: &Context) {
    out("READY");
    for want in [AsyncEvent::PortError(1), AsyncEvent::PortActive(1)] {
        let t = Instant::now();
        loop {
            match ctx.get_async_event(Duration::from_millis(100)) {
                Some(e) if e == want => break,
                _ => assert!(t.elapsed() < Duration::from_secs(20), "no {want:?}"),
            }
        }
        out(&format!("{want:?}"));
    }
}

/// The entry point of client processes (a no-op in a normal test run).
#[test]
fn child() {
    let Ok(role) = std::env::var("SOFTRDMA_ROLE") else {
        return;
    };
    let name = std::env::var("SOFTRDMA_DEV").unwrap_or_else(|_| "rxe0".into());
    let ctx = open_device(&name).unwrap();
    assert!(ctx.is_daemon(), "rxe0 should resolve to the daemon's device");
    match role.as_str() {
        "rc" => rc_role(&ctx),
        "ud" => ud_role(&ctx),
        "stream" => stream_role(&ctx),
        "selftest" => selftest_role(&ctx),
        "shared" => shared_role(&ctx),
        "batched" => batched_role(&ctx, 0),
        "batched-inline" => batched_role(&ctx, 64),
        "copied" => copied_role(&ctx),
        "atomics" => atomics_role(&ctx),
        "ordered" => ordered_role(&ctx),
        "readonly" => readonly_role(&ctx),
        "nopoll" => nopoll_role(&ctx),
        "lastwords" => lastwords_role(&ctx),
        "midpass" => midpass_role(&ctx),
        "latewrite" => latewrite_role(&ctx),
        "placed" => placed_role(&ctx),
        "portwatch" => portwatch_role(&ctx),
        "cmserver" => cm_server_role(&ctx),
        "cmclient" => cm_client_role(&ctx),
        "mover" => mover_role(&ctx),
        r => panic!("unknown role {r}"),
    }
}

// ---- RDMA CM through the daemon ------------------------------------------------------------------

const CM_WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn cm_expect(ch: &CmEventChannel, ctx: &Context, kind: CmEventKind) -> softrdma_verbs::CmEvent {
    let ev = ch.get_event(ctx, CM_WAIT).unwrap_or_else(|| panic!("no event, expected {kind:?}"));
    assert_eq!(ev.kind, kind, "{ev:?}");
    ev
}

/// Listens on the device's address: accepts the first request (private data carries the address
/// and rkey of a region for the peer's RDMA WRITE), checks the SEND and the WRITE, sees the
/// peer's disconnect; rejects the second request.
fn cm_server_role(ctx: &Context) {
    let ch = CmEventChannel::new().unwrap();
    let listener = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    listener.bind_addr("127.0.0.1:7471".parse().unwrap()).unwrap();
    listener.listen(4).unwrap();
    assert_eq!(listener.addrs().0, Some("127.0.0.1:7471".parse().unwrap()));
    out("LISTENING");
    let (pd, cq, qp) = rc_qp(ctx);
    let mr = pd.reg_mr(16384, RW).unwrap();
    qp.init(RW).unwrap();
    qp.post_recv(RecvWr { wr_id: 1, sgl: vec![mr.sge(0, 8192).unwrap()].into() }).unwrap();
    let req = ch.get_event(ctx, CM_WAIT).expect("connect request");
    assert!(matches!(req.kind, CmEventKind::ConnectRequest { .. }), "{req:?}");
    assert_eq!(&req.conn.private_data[..21], b"hello from the client");
    let sid = req.new_id.expect("a new id");
    let mut p = CmConnParam::new(qp.qpn());
    p.private_data = b"welcome".to_vec();
    p.private_data.extend_from_slice(&(mr.addr() + 10000).to_le_bytes());
    p.private_data.extend_from_slice(&mr.rkey().to_le_bytes());
    sid.accept(p).unwrap();
    cm_expect(&ch, ctx, CmEventKind::Established);
    let w = wait_wcs(&cq, 1, 10);
    assert_eq!((w[0].status, w[0].byte_len), (WcStatus::Success, 5000));
    assert_eq!(mr.to_vec(0, 5000).unwrap(), pattern(1, b'C', 5000));
    cm_expect(&ch, ctx, CmEventKind::Disconnected);
    assert_eq!(mr.to_vec(10000, 100).unwrap(), pattern(1, b'C', 100));
    assert_eq!(qp.query().unwrap().state, softrdma_verbs::QpState::Err);
    drop(sid);
    // The second request: rejected with private data.
    let req = ch.get_event(ctx, CM_WAIT).expect("second connect request");
    assert!(matches!(req.kind, CmEventKind::ConnectRequest { .. }), "{req:?}");
    req.new_id.unwrap().reject(b"not today").unwrap();
    out("DONE");
    assert_eq!(input(), "bye");
    drop(listener);
    assert_eq!(ctx.cm_id_count().unwrap(), 0);
    out("OK");
}

/// Connects to the server's listener with private data, SENDs and WRITEs over the connected QP,
/// disconnects; then is rejected on a second attempt.
fn cm_client_role(ctx: &Context) {
    assert_eq!(input(), "go");
    let ch = CmEventChannel::new().unwrap();
    let cid = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    let dst: std::net::SocketAddr = "127.0.0.1:7471".parse().unwrap();
    cid.resolve_addr(None, dst).unwrap();
    cm_expect(&ch, ctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    cm_expect(&ch, ctx, CmEventKind::RouteResolved);
    assert!(cid.route().is_some());
    assert_eq!(cid.addrs().1, Some(dst));
    let (pd, cq, qp) = rc_qp(ctx);
    let mr = pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    mr.write(0, &pattern(1, b'C', 5000)).unwrap();
    qp.init(RW).unwrap();
    let mut p = CmConnParam::new(qp.qpn());
    p.private_data = b"hello from the client".to_vec();
    cid.connect(p).unwrap();
    let est = cm_expect(&ch, ctx, CmEventKind::Established);
    let pd_ = &est.conn.private_data;
    assert_eq!(&pd_[..7], b"welcome");
    let raddr = u64::from_le_bytes(pd_[7..15].try_into().unwrap());
    let rkey = u32::from_le_bytes(pd_[15..19].try_into().unwrap());
    qp.post_send(send(1, SendOp::Send, &mr, 0, 5000)).unwrap();
    qp.post_send(send(2, SendOp::Write { remote_addr: raddr, rkey }, &mr, 0, 100)).unwrap();
    let w = wait_wcs(&cq, 2, 10);
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    cid.disconnect().unwrap();
    cm_expect(&ch, ctx, CmEventKind::Disconnected);
    assert_eq!(qp.query().unwrap().state, softrdma_verbs::QpState::Err);
    drop(cid);
    // Again, on a fresh QP: the server rejects.
    let (_pd2, _cq2, qp2) = rc_qp(ctx);
    qp2.init(RW).unwrap();
    let cid = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    cid.resolve_addr(None, dst).unwrap();
    cm_expect(&ch, ctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    cm_expect(&ch, ctx, CmEventKind::RouteResolved);
    cid.connect(CmConnParam::new(qp2.qpn())).unwrap();
    let ev = cm_expect(&ch, ctx, CmEventKind::Rejected { reason: 28 });
    assert_eq!(&ev.conn.private_data[..9], b"not today");
    // Nobody listens on another port: the CM itself rejects ("invalid service ID").
    let cid2 = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    cid2.resolve_addr(None, "127.0.0.1:7472".parse().unwrap()).unwrap();
    cm_expect(&ch, ctx, CmEventKind::AddrResolved);
    cid2.resolve_route().unwrap();
    cm_expect(&ch, ctx, CmEventKind::RouteResolved);
    cid2.connect(CmConnParam::new(qp2.qpn())).unwrap();
    cm_expect(&ch, ctx, CmEventKind::Rejected { reason: 8 });
    out("OK");
}

// ---- the tests ----------------------------------------------------------------------------------

/// Several processes run RC and UD traffic through one device at once, with byte-for-byte checks
/// and an rkey access violation between two of them; afterwards the daemon holds nothing.
#[test]
fn many_processes_share_one_device() {
    let dir = Daemon::dir("many", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18961, None);
    let mut rc: Vec<Client> = (0..4).map(|_| Client::spawn(&d, "rc", false)).collect();
    let mut ud: Vec<Client> = (0..2).map(|_| Client::spawn(&d, "ud", false)).collect();
    let (a, b) = rc.split_at_mut(1);
    let (info, _) = pair(&mut a[0], &mut b[0]);
    let w: Vec<u64> = info.split(' ').map(|x| x.parse().unwrap()).collect();
    try_foreign_handles(&d, w[0] as u32, &[w[2] as u32, w[4] as u32]);
    let (c, e) = rc.split_at_mut(3);
    pair(&mut c[2], &mut e[0]);
    let (u, v) = ud.split_at_mut(1);
    pair(&mut u[0], &mut v[0]);
    for i in [0, 2] {
        assert_eq!(rc[i].line(), "PHASE2");
        assert_eq!(rc[i + 1].line(), "PHASE2");
        rc[i].send("probe");
        rc[i + 1].send("wait");
    }
    for c in rc.into_iter().chain(ud) {
        assert_eq!(c.finish(), "OK");
    }
    d.wait_idle();
    assert!(d.counter("sent_pkts") > 0);
    assert_eq!(d.counter("same_host_enabled"), u64::from(std::env::var("SOFTRDMA_SAME_HOST").as_deref() != Ok("0")));
}

/// Work requests posted just before their QP is destroyed are carried out: the daemon takes what
/// the QP's send ring holds before it destroys the QP, whether or not its device loop got to them.
#[test]
fn sends_posted_before_a_destroy_go_out() {
    let dir = Daemon::dir("lastwords", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18979, None);
    assert_eq!(Client::spawn(&d, "lastwords", false).finish(), "OK");
    d.wait_idle();
}

/// A pass of the device loop takes the receive rings, then the send rings. Receives and a SEND to
/// them that a client publishes between the two takes go in in their order: the pass takes the
/// receive rings again before its progress delivers what it took (found through a CI failure of
/// the test above, in which 15 datagrams of a round found no receive). The daemon pauses each
/// pass at that point (a test hook) while the client posts.
#[test]
fn work_published_between_a_pass_takes_goes_in_in_order() {
    let dir = Daemon::dir("midpass", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start_env(&dir, 18985, None, Vec::new(), vec![("SOFTRDMA_TEST_PASS_PAUSE_MS", "500")]);
    assert_eq!(Client::spawn(&d, "midpass", false).finish(), "OK");
    d.wait_idle();
}

/// Completions are published before the daemon's writes into clients' own memory that they
/// complete (a system call each batch), and name the batch: the client's poll hands one out only
/// once the ring says the batch is made. The daemon pauses between the two (a test hook) while
/// the client polls; it hands no write to its client to make (`SOFTRDMA_PLACEMENTS=0`), which it
/// otherwise does with these.
#[test]
fn a_completion_waits_for_the_write_into_client_memory() {
    let dir = Daemon::dir("latewrite", "rxe0 netdev lo addr 127.0.0.1\n");
    let env = vec![("SOFTRDMA_TEST_WRITES_PAUSE_MS", "300"), ("SOFTRDMA_PLACEMENTS", "0")];
    let d = Daemon::start_env(&dir, 18986, None, Vec::new(), env);
    assert_eq!(Client::spawn(&d, "latewrite", false).finish(), "OK");
    assert_eq!(d.counter("client_placements"), 0);
    d.wait_idle();
}

/// Small writes into a client's own memory that its work requests asked for are handed to it to
/// make at its poll (`client_placements`), and taken back by the daemon before anything else
/// touches those bytes (`client_placements_taken_back`): the role says how.
#[test]
fn small_writes_into_client_memory_are_made_by_the_client_or_taken_back_first() {
    let dir = Daemon::dir("placed", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18987, None);
    let mut c = Client::spawn(&d, "placed", false);
    assert_eq!(c.line(), "READY");
    let handed = d.counter("client_placements");
    c.send("go");
    assert_eq!(c.line(), "PLACED");
    assert_eq!(d.counter("client_placements"), handed + 11, "8 receives, a READ, an atomic, 488 bytes");
    assert_eq!(d.counter("client_placements_taken_back"), 0, "made by the daemon, not the client");
    // Five receives left unpolled: each handed out before the role goes on.
    let mut handed = d.counter("client_placements");
    c.send("go");
    for _ in 0..5 {
        assert_eq!(c.line(), "SENT");
        let t = Instant::now();
        while d.counter("client_placements") == handed {
            assert!(t.elapsed() < Duration::from_secs(10), "the receive's data was not handed out");
            std::thread::sleep(Duration::from_millis(1));
        }
        handed = d.counter("client_placements");
        c.send("go");
    }
    assert_eq!(c.finish(), "OK");
    let back = d.counter("client_placements_taken_back");
    assert_eq!(back, 5, "before a READ, a WRITE, a deregistration, at an error, at a destroy");
    assert_eq!(d.counter("client_placements_given_up"), 0);
    assert_eq!(d.counter("client_writes_lost"), 0);
    d.wait_idle();
}

/// A process killed with SIGKILL mid-transfer: its peer gets error completions, another pair
/// keeps running to the end, and the daemon frees the dead process's objects.
#[test]
fn sigkill_mid_transfer() {
    let dir = Daemon::dir("kill", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18962, None);
    let mut victim = Client::spawn(&d, "stream", false);
    let mut survivor = Client::spawn(&d, "stream", false);
    let mut x = Client::spawn(&d, "rc", false);
    let mut y = Client::spawn(&d, "rc", false);
    pair(&mut victim, &mut survivor);
    pair(&mut x, &mut y);
    assert_eq!(victim.line(), "RUNNING");
    assert_eq!(survivor.line(), "RUNNING");
    let pid = victim.pid();
    // Per-QP counters name the owner and count its traffic.
    let (ok, text, _) = d.cli(&["stat", "--counters", "rxe0"]);
    let line = text.lines().find(|l| l.contains(&format!(" pid {pid} "))).unwrap_or_else(|| panic!("{text}"));
    assert!(ok && line.starts_with("qp rxe0/1 lqpn ") && line.contains(" retransmits "), "{line}");
    let sent: u64 = line.split(" sent_pkts ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(sent > 0, "{line}");
    // SAFETY: kill(2) on our own child.
    unsafe { kill(pid as i32, 9) };
    let _ = victim.child.wait();
    let err = survivor.finish();
    assert!(err.starts_with("ERR "), "{err}");
    assert_eq!(x.line(), "PHASE2");
    assert_eq!(y.line(), "PHASE2");
    x.send("probe");
    y.send("wait");
    assert_eq!(x.finish(), "OK");
    assert_eq!(y.finish(), "OK");
    d.wait_idle();
    let log = d.log();
    assert!(log.contains(&format!("client pid {pid} uid 0 gone: freed 1 QPs, 1 CQs")), "{log}");
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// A user other than root (nobody) uses the root daemon's device.
#[test]
fn non_root_user_uses_the_device() {
    if !is_root() {
        eprintln!("skipped: switching to nobody needs root");
        return;
    }
    let dir = Daemon::dir("nobody", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18963, None);
    let c = Client::spawn(&d, "selftest", true);
    assert_eq!(c.finish(), "OK uid 65534");
    d.wait_idle();
}

/// Garbage on the control socket and a client that never polls its CQ are logged; the daemon
/// goes on serving.
#[test]
fn misbehaving_clients_are_survived() {
    let dir = Daemon::dir("bad", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18964, Some(18974));
    let a = d.admin();
    let answer = a.raw(b"\xff\xfe garbage").unwrap();
    assert!(!answer.is_empty());
    assert!(a.raw(b"more garbage").is_err() || a.raw(b"x").is_err(), "connection not closed");
    let c = Client::spawn(&d, "nopoll", false);
    assert_eq!(c.finish(), "OVERFLOW");
    d.wait_idle();
    let log = d.log();
    assert!(log.contains("sent garbage"), "{log}");
    assert!(log.contains("overflowed (the client does not poll it)"), "{log}");
    assert!(d.counter("garbage_messages") >= 1);
    // Still serving: a client works, and Prometheus text is there.
    assert!(Client::spawn(&d, "selftest", false).finish().starts_with("OK"));
    let mut s = TcpStream::connect(("127.0.0.1", 18974)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.contains("softrdma_objects_qps{device=\"rxe0\"} 0"), "{body}");
    assert!(body.contains("# TYPE softrdma_sent_pkts counter"), "{body}");
    let (ok, text, _) = d.cli(&["stat", "--counters"]);
    assert!(ok && text.starts_with("link rxe0/1 sent_pkts "), "{text}");
}

/// The port follows its netdev: link down is PORT_DOWN and an async event to clients, link up
/// again is ACTIVE. The daemon runs in a network namespace of its own with a veth pair;
/// clients reach it through its socket, from the host's namespace.
#[test]
fn port_state_follows_the_netdev() {
    let dir = Daemon::dir("port", "rxd netdev d0\n");
    let veth = "ip link add d0 type veth peer name d1 && ip link set d1 up && ip addr add 10.99.0.1/24 dev d0 && \
                ip link set d0 up";
    let Some(d) = Daemon::start_in_netns(&dir, 18966, veth) else { return };
    let ip = |args: &str| {
        let pid = d.child.id().to_string();
        let st = Command::new("nsenter").args(["-t", &pid, "-n", "ip"]).args(args.split(' ')).status().unwrap();
        assert!(st.success(), "ip {args}");
    };
    // The veth's carrier comes up a moment after the daemon starts.
    let t = Instant::now();
    while d.cli(&["link", "show"]).1 != "link rxd/1 state ACTIVE physical_state LINK_UP netdev d0 \n" {
        assert!(t.elapsed() < Duration::from_secs(10), "{}", d.cli(&["link", "show"]).1);
        std::thread::sleep(Duration::from_millis(50));
    }
    let exe = std::env::current_exe().unwrap();
    let mut c = Client::spawn_with(&d, "portwatch", Command::new(exe), &[("SOFTRDMA_DEV", "rxd")]);
    assert_eq!(c.line(), "READY");
    ip("link set d0 down");
    assert_eq!(c.line(), "PortError(1)");
    let (_, show, _) = d.cli(&["link", "show", "rxd"]);
    assert_eq!(show, "link rxd/1 state DOWN physical_state DISABLED netdev d0 \n");
    let (_, stat, _) = d.cli(&["stat", "rxd"]);
    assert!(stat.contains("\t\tState: Down\n"), "{stat}");
    ip("link set d0 up");
    assert_eq!(c.finish(), "PortActive(1)");
    assert!(d.log().contains("netdev d0 link down, port 1 DOWN"), "{}", d.log());
}

/// A client that writes garbage into its own rings (a malformed WQE; a producer index far beyond
/// the ring) gets its QP moved to ERR or its ring ignored, logged; the daemon and its other clients
/// go on, and everything of the hostile client is freed when it goes.
#[test]
fn hostile_rings_are_contained() {
    use softrdma_abi::msg::{Request, Response};
    use std::os::unix::fs::FileExt;
    let dir = Daemon::dir("rings", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18967, None);
    let conn = softrdma_abi::sock::Conn::connect(&d.socket()).unwrap();
    let call = |r: Request| {
        conn.send(&r.encode(), &[]).unwrap();
        let (b, fds) = conn.recv().unwrap().unwrap();
        (Response::decode(&b).unwrap(), fds)
    };
    assert!(matches!(call(Request::OpenDevice { name: "rxe0".into() }).0, Response::Opened(_)));
    let Response::Id(pd) = call(Request::AllocPd).0 else { panic!() };
    let Response::Cq { id: cq, .. } = call(Request::CreateCq { cqe: 16, channel: None }).0 else { panic!() };
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let mut qps = Vec::new();
    // Send slots as the capacities say, and with room asked for copied payloads (more than the
    // daemon gives: it gives `COPY_ROOM`).
    for (copy_room, want) in [(0, 96 + 16), (4096, 96 + softrdma_abi::slot::COPY_ROOM)] {
        let req = Request::CreateQp {
            pd,
            qp_type: QpType::Rc,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap,
            sq_sig_all: false,
            copy_room,
        };
        let (Response::Qp { qpn, sq_slot, .. }, mut fds) = call(req) else { panic!() };
        assert_eq!(sq_slot, want, "copy room {copy_room}");
        qps.push((qpn, sq_slot, std::fs::File::from(fds.pop().unwrap())));
    }
    // A region of this process's memory (reached by process_vm): the device loop now reads ahead
    // for the send rings, decoding their entries before it takes them.
    let mem = vec![0u8; 4096];
    let reg = Request::RegMr { pd, addr: mem.as_ptr() as u64, len: mem.len() as u64, access: 0 };
    assert!(matches!(call(reg).0, Response::Id(_)));
    // QP 1: a slot of garbage (opcode 0xee), published properly.
    let (qpn1, slot, f) = &qps[0];
    let garbage = vec![0xeeu8; *slot as usize];
    f.write_all_at(&garbage, softrdma_abi::ring::HEADER_LEN as u64).unwrap();
    f.write_all_at(&1u32.to_le_bytes(), 64).unwrap();
    // QP 2: a producer index a million slots ahead.
    let (qpn2, _, f2) = &qps[1];
    f2.write_all_at(&1_000_000u32.to_le_bytes(), 64).unwrap();
    let t = Instant::now();
    while !(d.log().contains("malformed ring slot") && d.log().contains("ignoring the ring")) {
        assert!(t.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let Response::QpInfo(info) = call(Request::QueryQp { qpn: *qpn1 }).0 else { panic!() };
    assert_eq!(info.state, softrdma_verbs::QpState::Err);
    assert!(matches!(call(Request::QueryQp { qpn: *qpn2 }).0, Response::QpInfo(_)));
    assert!(d.counter("bad_wqes") >= 1);
    // Others are served meanwhile.
    assert!(Client::spawn(&d, "selftest", false).finish().starts_with("OK"));
    drop(conn);
    d.wait_idle();
    assert!(d.log().contains("gone: freed 2 QPs, 1 CQs, 0 SRQs, 1 MRs"), "{}", d.log());
    drop(mem);
}

/// link add/show/rename/roce-mode/delete round trips survive a daemon restart.
#[test]
fn link_management_survives_restart() {
    let dir = Daemon::dir("links", "rxe0 netdev lo addr 127.0.0.1\n");
    let mut d = Daemon::start(&dir, 18965, None);
    let (ok, _, err) = d.cli(&["link", "add", "rxe1", "type", "rxe", "netdev", "lo", "addr", "127.0.0.2"]);
    assert!(ok, "{err}");
    let (ok, _, err) = d.cli(&["link", "add", "rxe1", "type", "rxe", "netdev", "lo"]);
    assert!(!ok && err.contains("defined twice"), "{err}");
    let (_, show, _) = d.cli(&["link", "show"]);
    assert_eq!(
        show,
        "link rxe0/1 state ACTIVE physical_state LINK_UP netdev lo \nlink rxe1/1 state ACTIVE physical_state LINK_UP netdev lo \n"
    );
    assert!(d.cli(&["dev", "set", "rxe1", "name", "rxe7"]).0);
    assert!(d.cli(&["roce-mode", "rxe7", "1", "v1"]).0);
    d.restart();
    let (_, show, _) = d.cli(&["link", "show", "rxe7"]);
    assert_eq!(show, "link rxe7/1 state ACTIVE physical_state LINK_UP netdev lo \n");
    assert_eq!(d.cli(&["roce-mode", "rxe7", "1"]).1, "IB/RoCE v1\n");
    let (_, devices, _) = d.cli(&["devices"]);
    assert!(devices.contains("rxe0") && devices.contains("rxe7"), "{devices}");
    let (_, stat, _) = d.cli(&["stat", "rxe7"]);
    assert!(stat.starts_with("CA 'rxe7'\n") && stat.contains("\t\tState: Active\n"), "{stat}");
    assert!(d.cli(&["link", "delete", "rxe7"]).0);
    d.restart();
    let (_, show, _) = d.cli(&["link", "show"]);
    assert_eq!(show, "link rxe0/1 state ACTIVE physical_state LINK_UP netdev lo \n");
    let (ok, _, err) = d.cli(&["link", "show", "rxe7"]);
    assert!(!ok && err.contains("rxe7"), "{err}");
}

/// The RDMA CM on a daemon device: two processes, each its own session, connect through the
/// daemon's CM (listen, connect and accept with private data), move data over the connected QPs
/// and disconnect; a second request is rejected, one to a port nobody listens on too; the daemon
/// is left holding nothing, CM IDs included.
#[test]
fn rdma_cm_between_two_processes() {
    let dir = Daemon::dir("cm", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18968, None);
    let mut server = Client::spawn(&d, "cmserver", false);
    let mut client = Client::spawn(&d, "cmclient", false);
    assert_eq!(server.line(), "LISTENING");
    client.send("go");
    assert_eq!(client.finish(), "OK");
    assert_eq!(server.line(), "DONE");
    server.send("bye");
    assert_eq!(server.finish(), "OK");
    d.wait_idle();
    assert_eq!(d.counter("objects_cm_ids"), 0);
}

/// A process that dies holding CM IDs (a listener, an established connection) has them destroyed
/// by the daemon: its peer sees DISCONNECTED, and no CM ID is left.
#[test]
fn rdma_cm_ids_of_a_dead_process_are_destroyed() {
    let dir = Daemon::dir("cmkill", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18969, None);
    let mut server = Client::spawn(&d, "cmserver", false);
    assert_eq!(server.line(), "LISTENING");
    let ctx = {
        std::env::set_var("SOFTRDMA_SOCKET", d.socket());
        std::env::set_var("SOFTRDMA_CONFIG", d.dir.join("devices.conf"));
        open_device("rxe0").unwrap()
    };
    assert!(ctx.is_daemon());
    let ch = CmEventChannel::new().unwrap();
    let cid = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    cid.resolve_addr(None, "127.0.0.1:7471".parse().unwrap()).unwrap();
    cm_expect(&ch, &ctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    cm_expect(&ch, &ctx, CmEventKind::RouteResolved);
    let (_pd, _cq, qp) = rc_qp(&ctx);
    qp.init(RW).unwrap();
    let mut p = CmConnParam::new(qp.qpn());
    p.private_data = b"hello from the client".to_vec();
    cid.connect(p).unwrap();
    cm_expect(&ch, &ctx, CmEventKind::Established);
    assert_eq!(ctx.cm_id_count().unwrap(), 3);
    // The server's channel is the daemon's first, ours the second.
    try_foreign_cm_handles(&d, cid.handle(), 2, qp.qpn().value());
    // The foreign session's own ID goes with its connection.
    let t = Instant::now();
    while ctx.cm_id_count().unwrap() != 3 {
        assert!(t.elapsed() < Duration::from_secs(10), "the foreign session's CM ID is left");
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = server.child.kill();
    let _ = server.child.wait();
    cm_expect(&ch, &ctx, CmEventKind::Disconnected);
    drop(cid);
    let t = Instant::now();
    while ctx.cm_id_count().unwrap() != 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "CM IDs left");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How many of the daemon's mappings are clients' region memfds (`reg_mr` on a daemon device).
fn region_maps(d: &Daemon) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.child.id())).unwrap();
    maps.lines().filter(|l| l.contains("/memfd:softrdma-mr")).count()
}

/// Regions of `reg_mr` live in memfds the daemon maps: SEND, WRITE, READ and atomics between two
/// processes land byte for byte (and a `reg_mr_raw` region still works through process_vm); the
/// daemon's mappings go when a client deregisters (exit) and when it is killed.
#[test]
fn shared_regions_between_two_processes() {
    let dir = Daemon::dir("shared", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18970, None);
    assert_eq!(region_maps(&d), 0);
    let mut a = Client::spawn_moving(&d, "shared");
    let mut b = Client::spawn_moving(&d, "shared");
    pair(&mut a, &mut b);
    assert_eq!(a.line(), "PHASE2");
    assert_eq!(b.line(), "PHASE2");
    // Seven memfd regions per client, mapped by the daemon: six of `reg_mr`, and the moved heap
    // pages of `reg_mr_raw` (the other `reg_mr_raw` region is not page-aligned: process_vm).
    assert_eq!(region_maps(&d), 14);
    a.send("go");
    b.send("go");
    assert_eq!(a.line(), "HOLDING");
    assert_eq!(b.line(), "HOLDING");
    let pid = a.pid();
    // SAFETY: kill(2) on our own child.
    unsafe { kill(pid as i32, 9) };
    let _ = a.child.wait();
    b.send("exit");
    assert_eq!(b.finish(), "OK");
    // The two clients' QPs are on one device: their packets never left the daemon, and the
    // WRITEs between mapped regions went region to region.
    assert!(d.counter("same_host_loopback_placed") > 0);
    assert_eq!((d.counter("same_host_tx_pkts"), d.counter("icrc_verified")), (0, 0));
    d.wait_idle();
    assert_eq!(region_maps(&d), 0, "the daemon still maps regions of gone clients");
    assert!(
        d.log().contains(&format!("client pid {pid} uid 0 gone: freed 1 QPs, 1 CQs, 0 SRQs, 7 MRs")),
        "{}",
        d.log()
    );
}

/// Clients' own memory, reached by process_vm, is read ahead and written behind in batches
/// (verbs client_io.rs) and never served stale: a buffer rewritten before every SEND, a READ right
/// behind a WRITE into the same bytes, a WRITE seen by the peer once a later SEND arrived, a fenced
/// SEND of a buffer a READ just filled.
#[test]
fn batched_access_to_client_memory_is_never_stale() {
    let dir = Daemon::dir("batched", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18971, None);
    // Payloads read ahead by the daemon, then small ones copied at post by the clients.
    for role in ["batched", "batched-inline"] {
        let mut a = Client::spawn(&d, role, false);
        let mut b = Client::spawn(&d, role, false);
        let (ia, ib) = pair(&mut a, &mut b);
        let qpn = |info: &str| info.split(' ').next().unwrap().parse::<u32>().unwrap();
        let (mut lead, mut follow) = if qpn(&ia) < qpn(&ib) { (a, b) } else { (b, a) };
        // The follower has checked every message of phase 1 and posted its receives again.
        assert_eq!(follow.line(), "READY");
        lead.send("ready");
        assert_eq!(follow.finish(), "OK", "{role}");
        assert_eq!(lead.finish(), "OK", "{role}");
    }
    assert_eq!(d.counter("client_writes_lost"), 0);
    d.wait_idle();
}

/// Small payloads of regions reached by process_vm travel in the send ring, copied at post time,
/// and arrive as they were then; SGEs the daemon would refuse still fail.
#[test]
fn small_payloads_of_process_memory_are_copied_at_post() {
    let dir = Daemon::dir("copied", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18976, None);
    let mut c = Client::spawn(&d, "copied", false);
    assert_eq!(c.line(), "READY");
    let (reads, writes) = (d.counter("client_read_calls"), d.counter("client_write_calls"));
    c.send("go");
    assert_eq!(c.line(), "ROUNDS");
    assert_eq!(d.counter("client_read_calls"), reads, "the daemon read a payload copied at post");
    assert!(d.counter("client_write_calls") > writes, "the data was placed by process_vm");
    c.send("go");
    assert_eq!(c.finish(), "OK");
    assert_eq!(d.counter("client_writes_lost"), 0);
    d.wait_idle();
}

/// Atomics on a word of a client's own memory, executed directly, are served from the pass's
/// read-ahead (a read or two for a list of 32) and each finds what the one before left.
#[test]
fn atomics_on_process_memory_are_read_ahead_and_chain() {
    let dir = Daemon::dir("atomics", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18978, None);
    let mut c = Client::spawn(&d, "atomics", false);
    assert_eq!(c.line(), "READY");
    let reads = d.counter("client_read_calls");
    c.send("go");
    assert_eq!(c.line(), "ADDS");
    let used = d.counter("client_read_calls") - reads;
    assert!(used <= 4, "{used} reads for 32 atomics");
    c.send("go");
    assert_eq!(c.finish(), "OK");
    assert_eq!(d.counter("client_writes_lost"), 0);
    d.wait_idle();
}

/// Writes kept behind stay in order with writes made at once: a flag WRITE into a mapped region
/// never arrives before the data WRITE into a process_vm region that was posted before it; and
/// memory that cannot be written is not registered for writing.
#[test]
fn kept_writes_stay_in_order_and_need_writable_memory() {
    let dir = Daemon::dir("ordered", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18975, None);
    let mut a = Client::spawn(&d, "ordered", false);
    let mut b = Client::spawn(&d, "ordered", false);
    pair(&mut a, &mut b);
    assert_eq!(a.finish(), "OK");
    assert_eq!(b.finish(), "OK");
    assert_eq!(Client::spawn(&d, "readonly", false).finish(), "OK");
    assert_eq!(d.counter("client_writes_lost"), 0);
    d.wait_idle();
}

/// A daemon that maps no client memory (`--no-shared-regions`, as an older daemon or a kernel
/// without `F_SEAL_FUTURE_WRITE` would refuse): the clients' `reg_mr` regions fall back to
/// process_vm access, and the same traffic lands byte for byte.
#[test]
fn regions_fall_back_to_process_vm_when_the_daemon_maps_none() {
    let dir = Daemon::dir("noshared", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start_with(&dir, 18972, None, vec!["--no-shared-regions"]);
    let mut a = Client::spawn_moving(&d, "shared");
    let mut b = Client::spawn_moving(&d, "shared");
    pair(&mut a, &mut b);
    assert_eq!(a.line(), "PHASE2");
    assert_eq!(b.line(), "PHASE2");
    assert_eq!(region_maps(&d), 0, "the daemon mapped a region");
    a.send("go");
    b.send("go");
    assert_eq!(a.line(), "HOLDING");
    assert_eq!(b.line(), "HOLDING");
    a.send("exit");
    b.send("exit");
    assert_eq!(a.finish(), "OK");
    assert_eq!(b.finish(), "OK");
    // Looped back inside the daemon, but no region is in its memory to place a payload in.
    assert!(d.counter("same_host_loopback_pkts") > 0);
    assert_eq!(d.counter("same_host_loopback_placed"), 0);
    d.wait_idle();
}

/// Registrations of shared regions that could fault the daemon or do not match are refused with
/// a reason: no descriptor, two, a pipe, an unsealed memfd, one sealed against shrinking only, one
/// too short, a foreign PD; a proper one is accepted, and the daemon keeps serving.
#[test]
fn bad_shared_region_registrations_are_refused() {
    use softrdma_abi::msg::{Refusal, Request, Response};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let dir = Daemon::dir("badshm", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18973, None);
    let conn = softrdma_abi::sock::Conn::connect(&d.socket()).unwrap();
    let call = |r: Request, fds: &[i32]| {
        conn.send(&r.encode(), fds).unwrap();
        Response::decode(&conn.recv().unwrap().unwrap().0).unwrap()
    };
    assert!(matches!(call(Request::OpenDevice { name: "rxe0".into() }, &[]), Response::Opened(_)));
    let Response::Id(pd) = call(Request::AllocPd, &[]) else { panic!() };
    let reg = |len: u64| Request::RegMrShared { pd, addr: 0x7000_0000, len, access: RW.bits() };
    let refused = |r: Response, why: &str| match r {
        Response::Error(Refusal::InvalidArgument(m)) => assert!(m.contains(why), "{m}"),
        other => panic!("not refused ({why}): {other:?}"),
    };
    // A memfd of `len` bytes with `seals`; its pages allocated unless `sparse`.
    let memfd = |name: &std::ffi::CStr, len: i64, seals: i32, sparse: bool| {
        // SAFETY: a valid C string and flags; the new descriptor is owned at once.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING)) };
        // SAFETY: plain calls on our own memfd.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len), 0);
            if !sparse {
                // Written, not just fallocated: tmpfs counts fallocated pages as holes until then.
                let zeros = vec![0u8; len as usize];
                assert_eq!(libc::pwrite(fd.as_raw_fd(), zeros.as_ptr().cast(), zeros.len(), 0), len as isize);
            }
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
        fd
    };
    let both = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    refused(call(reg(4096), &[]), "exactly one memfd");
    let good = memfd(c"softrdma-mr", 8192, both, false);
    refused(call(reg(4096), &[good.as_raw_fd(), good.as_raw_fd()]), "exactly one memfd");
    let (r, _w) = std::io::pipe().unwrap();
    refused(call(reg(4096), &[r.as_raw_fd()]), "not a memfd");
    let file = std::fs::File::open(env!("CARGO_BIN_EXE_softrdma")).unwrap();
    refused(call(reg(4096), &[file.as_raw_fd()]), "not a memfd");
    refused(call(reg(4096), &[memfd(c"unsealed", 4096, 0, false).as_raw_fd()]), "not sealed");
    refused(call(reg(4096), &[memfd(c"shrink", 4096, libc::F_SEAL_SHRINK, false).as_raw_fd()]), "not sealed");
    refused(call(reg(4096), &[memfd(c"grow", 4096, libc::F_SEAL_GROW, false).as_raw_fd()]), "not sealed");
    refused(call(reg(8193), &[good.as_raw_fd()]), "fewer than the region's 8193");
    // Sparse: the daemon would allocate what the client never did.
    refused(call(reg(8192), &[memfd(c"sparse", 8192, both, true).as_raw_fd()]), "unallocated pages from byte 0");
    // Sealed for good: the daemon cannot seal it against hole punching.
    let sealed = memfd(c"sealed", 8192, both | libc::F_SEAL_SEAL, false);
    refused(call(reg(8192), &[sealed.as_raw_fd()]), "F_SEAL_FUTURE_WRITE");
    // Not where a client's mapping starts: the daemon's atomics would be misaligned.
    let odd = Request::RegMrShared { pd, addr: 0x7000_0004, len: 4096, access: RW.bits() };
    refused(call(odd, &[good.as_raw_fd()]), "not page aligned");
    let Response::Error(Refusal::Verbs(_)) =
        call(Request::RegMrShared { pd: pd + 1000, addr: 0x7000_0000, len: 4096, access: 1 }, &[good.as_raw_fd()])
    else {
        panic!("foreign PD accepted")
    };
    assert_eq!(region_maps(&d), 0);
    let r = call(reg(8192), &[good.as_raw_fd()]);
    let Response::Id(key) = r else { panic!("good memfd refused: {r:?}") };
    assert_eq!(region_maps(&d), 1);
    assert_eq!(call(Request::DeregMr { key }, &[]), Response::Ok);
    assert_eq!(region_maps(&d), 0);
    // Still serving.
    assert!(Client::spawn(&d, "selftest", false).finish().starts_with("OK"));
    drop(conn);
    d.wait_idle();
}

/// `softrdma perf` between two processes on one softrdmad device: the packets never leave the
/// daemon (its internal loopback: no lane, no UDP), a 64 KiB WRITE's payload is copied once, region
/// to region, and the CPU line counts the device loop, which does both sides' device work.
#[test]
fn perf_between_two_clients_of_one_device() {
    let dir = Daemon::dir("perf", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18966, None);
    let args = ["perf", "write-bw", "-d", "rxe0", "-s", "65536", "-n", "10000", "-p", "18977"];
    let mut server = softrdma()
        .args(args)
        .env("SOFTRDMA_SOCKET", d.socket())
        .env("SOFTRDMA_CONFIG", dir.join("devices.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (ok, out, err) = d.cli(&[&args[..], &["127.0.0.1"]].concat());
    assert!(server.wait().unwrap().success());
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("\n Copies per byte : 1 (region to region (a WRITE's packets after its first) 1; one device's"),
        "{out}"
    );
    let cpu = out.lines().find(|l| l.starts_with(" CPU time per GB : ")).expect("a CPU line");
    assert!(cpu.contains(" both sides + softrdmad device loops "), "{cpu}");
    assert!(d.counter("same_host_loopback_placed") > 10000 * 14, "{out}");
    assert_eq!((d.counter("same_host_tx_pkts"), d.counter("icrc_verified")), (0, 0));
    assert!(d.counter("device_thread_cpu_us") > 0);
    // The QPs were created while the device loop slept (it sleeps 50 µs after its last work):
    // their rings were asked for doorbells all the same, so no post waited for its idle timeout.
    assert_eq!(d.counter("late_wakeups"), 0);
}

/// `softrdma perf -R` between two clients of one softrdmad device: the daemon's CM connects the
/// QPs (both IDs on its device), and the WRITEs go to the region named in the private data.
#[test]
fn perf_with_rdma_cm_through_the_daemon() {
    let dir = Daemon::dir("perfcm", "rxe0 netdev lo addr 127.0.0.1\n");
    let d = Daemon::start(&dir, 18980, None);
    let args = ["perf", "write-bw", "-R", "-q", "2", "-d", "rxe0", "-n", "500", "-p", "18981"];
    let on_daemon = |extra: &[&str]| {
        let mut c = softrdma();
        c.args(args)
            .args(extra)
            .env("SOFTRDMA_SOCKET", d.socket())
            .env("SOFTRDMA_CONFIG", dir.join("devices.conf"))
            .env("SOFTRDMA_PERF_DEBUG", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut server = on_daemon(&[]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let client = on_daemon(&["127.0.0.1"]).output().unwrap();
    if !client.status.success() {
        let _ = server.kill();
    }
    let server = server.wait_with_output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&client.stdout), String::from_utf8_lossy(&client.stderr));
    assert!(client.status.success(), "{out}\n{err}");
    assert!(server.status.success(), "{}", String::from_utf8_lossy(&server.stderr));
    assert!(out.contains("\n rdma_cm QPs\t : ON\n"), "{out}");
    // The device's CM IDs as the client finished: its own two at least (the server's may be gone).
    let ids: u32 = err
        .split("; CM IDs ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no CM ID count:\n{err}"));
    assert!(ids >= 2, "{err}");
    let row = out.lines().find(|l| l.trim_start().starts_with("65536")).unwrap_or_else(|| panic!("no row:\n{out}"));
    // 500 WRITEs on each of the two QPs.
    assert_eq!(row.split_whitespace().nth(1), Some("1000"), "{row}");
    d.wait_idle();
}

/// Multicast through softrdmad: `softrdma perf send-bw -g` between two clients of one daemon
/// device. The server's QP is attached to the group through the daemon, which joins it on the
/// device's interface; the client's SENDs to the group leave over UDP and come back through the
/// group's socket (ICRC checked). The daemon runs in a network namespace of its own, so the group's
/// packets stay there.
#[test]
fn multicast_through_the_daemon() {
    let dir = Daemon::dir("mcast", "rxe0 netdev lo addr 127.0.0.1\n");
    let Some(d) = Daemon::start_in_netns(&dir, 18968, "true") else { return };
    let args = ["perf", "send-bw", "-g", "-d", "rxe0", "-s", "512", "-n", "2000", "-p", "18978"];
    let server = softrdma()
        .args(args)
        .env("SOFTRDMA_SOCKET", d.socket())
        .env("SOFTRDMA_CONFIG", dir.join("devices.conf"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, out, err) = d.cli(&[&args[..], &["127.0.0.1"]].concat());
    let server = server.wait_with_output().unwrap();
    assert!(ok, "{out}\n{err}");
    assert!(server.status.success(), "{}", String::from_utf8_lossy(&server.stderr));
    let sout = String::from_utf8_lossy(&server.stdout);
    assert!(sout.contains("\n local address: LID 0000 QPN 0xffffff PSN 0x"), "{sout}");
    assert!(sout.contains("\n MGID: 00:00:00:00:00:00:00:00:00:00:255:255:239:02:201:133\n"), "{sout}");
    assert!(out.contains("\n remote address: LID 0000 QPN 0xffffff PSN 0x"), "{out}");
    // Every message went to the group over UDP and came back through its socket.
    assert!(d.counter("icrc_verified") >= 2000, "{}", d.counter("icrc_verified"));
    assert_eq!(d.counter("same_host_loopback_pkts"), 0);
}

// ---- where clients poll -------------------------------------------------------------------------

/// A client thread that polls an empty CQ on the CPU softrdmad's device loop polls on
/// (`SOFTRDMA_LOOP_CPU`: the test pinned the daemon there) moves to another CPU after a few
/// yields, and is allowed the same CPUs afterwards. Each round starts the thread on that CPU and
/// then allows it every CPU again; a round in which it yielded 8 times for the loop must have
/// moved it at the 9th poll (the kernel may move it first: such a round has fewer yields and is
/// not checked). Prints `OK <rounds checked>`.
fn mover_role(ctx: &Context) {
    let cpu: usize = std::env::var("SOFTRDMA_LOOP_CPU").unwrap().parse().unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16, None).unwrap();
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (a, b) = looped_pair(ctx, &pd, &cq, cap, RW);
    // A SEND between the two keeps the loop polling for the daemon's SOFTRDMA_SPIN_US after it.
    let mr = pd.reg_mr(64, RW).unwrap();
    b.post_recv(RecvWr { wr_id: 1, sgl: vec![mr.sge(32, 32).unwrap()].into() }).unwrap();
    a.post_send(send(2, SendOp::Send, &mr, 0, 32)).unwrap();
    assert!(wait_wcs(&cq, 2, 10).iter().all(|wc| wc.status == WcStatus::Success));
    let all = allowed_cpus();
    let mut checked = 0;
    for _ in 0..20 {
        // A thread moves at most once a millisecond.
        std::thread::sleep(Duration::from_millis(2));
        assert!(allow(0, &[cpu]) && allow(0, &all), "pinning refused");
        let before = ctx.poller_stats();
        let mut wcs = Vec::new();
        for _ in 0..100 {
            cq.poll(1, &mut wcs).unwrap();
            if ctx.poller_stats().moves > before.moves {
                break;
            }
        }
        assert!(wcs.is_empty(), "{wcs:?}");
        assert_eq!(allowed_cpus(), all, "the thread's allowed CPUs changed");
        let after = ctx.poller_stats();
        let (yields, moves) = (after.shared_yields - before.shared_yields, after.moves - before.moves);
        assert!(moves <= 1, "{before:?} {after:?}");
        if yields + moves >= 9 {
            assert_eq!(moves, 1, "yielded to the device loop without moving: {before:?} {after:?}");
            checked += 1;
        }
        if checked == 3 {
            break;
        }
    }
    out(&format!("OK {checked}"));
}

/// softrdmad's device loop says its CPU in the clients' CQ rings while it polls, and a client
/// polling an empty CQ on that CPU moves off it (verbs poller.rs): with two clients exchanging
/// messages through one device on two CPUs, the loop then keeps a CPU to itself.
#[test]
fn a_client_polling_on_the_device_loops_cpu_moves_off() {
    let Some(cpus) = cpus_to_move_between() else { return };
    let dir = Daemon::dir("mover", "rxe0 netdev lo addr 127.0.0.1\n");
    // The loop keeps polling (and saying its CPU) for 5 s after the client's SEND.
    let d = Daemon::start_env(&dir, 18982, None, Vec::new(), vec![("SOFTRDMA_SPIN_US", "5000000")]);
    // Every thread of the daemon (one that ended meanwhile, a start-up helper, aside).
    let tasks = std::fs::read_dir(format!("/proc/{}/task", d.child.id())).unwrap();
    for t in tasks {
        let tid: i32 = t.unwrap().file_name().to_str().unwrap().parse().unwrap();
        if !allow(tid, &[cpus[0]]) && std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH) {
            eprintln!("skipped: softrdmad's threads cannot be pinned here");
            return;
        }
    }
    let cpu = cpus[0].to_string();
    let exe = std::env::current_exe().unwrap();
    let c = Client::spawn_with(&d, "mover", Command::new(exe), &[("SOFTRDMA_LOOP_CPU", &cpu)]);
    let last = c.finish();
    let checked: u32 = last.strip_prefix("OK ").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{last}"));
    eprintln!("rounds checked: {checked}");
    // The kernel moving the thread off within 8 polls, 20 times out of 20, is not what it does.
    assert!(checked > 0, "the client never yielded enough to move");
}
