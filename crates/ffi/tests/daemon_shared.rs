//! Unmodified rdma-core programs on ONE device shared through softrdmad: the daemon owns the device
//! (127.0.0.9) and both the server and the client process open it through our `libibverbs.so.1`.

mod common;

use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use common::{free_tcp_port, free_udp_port, lib_dir, program, wait_limit};
use softrdma_verbs::daemon::server::{run, DaemonOptions};

struct Daemon {
    dir: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    udp: u16,
}

fn start_daemon(tag: &str) -> Daemon {
    start_daemon_with(tag, "sd0 netdev lo addr 127.0.0.9\n")
}

/// A daemon serving the devices of `conf` (a devices.conf).
fn start_daemon_with(tag: &str, conf: &str) -> Daemon {
    let dir = std::env::temp_dir().join(format!("softrdma-ffi-daemon-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("devices.conf");
    std::fs::write(&config, conf).unwrap();
    let socket = dir.join("softrdmad.sock");
    let udp = free_udp_port();
    let opts = DaemonOptions {
        socket: socket.clone(),
        config: config.clone(),
        udp_port: udp,
        metrics: None,
        shared_regions: true,
    };
    std::thread::spawn(move || run(opts));
    let start = Instant::now();
    while !socket.exists() {
        assert!(start.elapsed() < Duration::from_secs(10), "daemon did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon { dir, config, socket, udp }
}

/// `prog` set up to use the daemon's device through our `libibverbs.so.1`, its output captured.
fn on_daemon(d: &Daemon, prog: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new(prog);
    c.env("LD_LIBRARY_PATH", lib_dir())
        .env("SOFTRDMA_CONFIG", &d.config)
        .env("SOFTRDMA_SOCKET", &d.socket)
        .env("SOFTRDMA_UDP_PORT", d.udp.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c
}

fn run_shared(d: &Daemon, prog: &str, args: &[&str], port_flag: &str) -> (Output, Output) {
    run_shared_env(d, prog, args, port_flag, &[])
}

/// [`run_shared`] with more environment for both programs.
fn run_shared_env(d: &Daemon, prog: &str, args: &[&str], port_flag: &str, env: &[(&str, &str)]) -> (Output, Output) {
    let prog = program(prog).unwrap();
    let tcp = free_tcp_port().to_string();
    let cmd = |extra: &[&str]| {
        let mut c = on_daemon(d, &prog);
        c.envs(env.iter().copied()).args(["-d", "sd0"]).args(args).args([port_flag, &tcp]).args(extra);
        c
    };
    let server = cmd(&[]).spawn().expect("server");
    std::thread::sleep(Duration::from_millis(500));
    let client = cmd(&["127.0.0.1"]).spawn().expect("client");
    let (c, ck) = wait_limit(client, Duration::from_secs(60));
    let (s, sk) = wait_limit(server, Duration::from_secs(if ck { 1 } else { 60 }));
    let text = |o: &Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!ck && !sk && c.status.success() && s.status.success(), "server:\n{}\nclient:\n{}", text(&s), text(&c));
    (s, c)
}

#[test]
fn rc_pingpong_and_write_bw_share_one_daemon_device() {
    if program("ibv_rc_pingpong").is_none() || program("ib_write_bw").is_none() {
        eprintln!("SKIP: ibv_rc_pingpong / ib_write_bw not installed (apt-get install ibverbs-utils perftest)");
        return;
    }
    let d = start_daemon("shared");
    let (s, c) = run_shared(&d, "ibv_rc_pingpong", &["-g", "1", "-n", "200", "-s", "4096"], "-p");
    for o in [&s, &c] {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("1638400 bytes in"), "{out}");
        assert!(out.contains("200 iters in"), "{out}");
        // Both QPs live on the same device: their GIDs are the daemon device's.
        assert_eq!(out.matches("GID ::ffff:127.0.0.9").count(), 2, "{out}");
    }
    let (_, c) = run_shared(&d, "ib_write_bw", &["-x", "1", "-F", "-n", "200"], "-p");
    let out = String::from_utf8_lossy(&c.stdout);
    assert!(out.contains("#bytes"), "{out}");
    let row =
        out.lines().find(|l| l.trim_start().starts_with("65536")).unwrap_or_else(|| panic!("no result row:\n{out}"));
    assert_eq!(row.split_whitespace().nth(1), Some("200"), "{row}");
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// With `SOFTRDMA_MOVE_REGIONS=1` the programs' own page-aligned buffers are moved onto memfds the
/// daemon maps (crates/verbs `remap.rs`): `ibv_rc_pingpong -c` checks every byte it receives, and
/// perftest's WRITE and READ bandwidth tests run to their result rows.
#[test]
fn programs_whose_buffers_are_moved_onto_shared_memory() {
    if program("ibv_rc_pingpong").is_none() || program("ib_read_bw").is_none() {
        eprintln!("SKIP: ibv_rc_pingpong / ib_read_bw not installed (apt-get install ibverbs-utils perftest)");
        return;
    }
    let d = start_daemon("moved");
    let moving = [("SOFTRDMA_MOVE_REGIONS", "1")];
    let args = ["-g", "1", "-n", "200", "-s", "4096", "-c"];
    let (s, c) = run_shared_env(&d, "ibv_rc_pingpong", &args, "-p", &moving);
    for o in [&s, &c] {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("200 iters in"), "{out}");
    }
    for prog in ["ib_write_bw", "ib_read_bw"] {
        let (_, c) = run_shared_env(&d, prog, &["-x", "1", "-F", "-n", "200"], "-p", &moving);
        let out = String::from_utf8_lossy(&c.stdout);
        let row = out.lines().find(|l| l.trim_start().starts_with("65536")).unwrap_or_else(|| panic!("{prog}:\n{out}"));
        assert_eq!(row.split_whitespace().nth(1), Some("200"), "{row}");
    }
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// A server and a client of an rdmacm-utils program, two processes on the one daemon device.
fn run_cm_shared(d: &Daemon, prog: &str, server: &[&str], client: &[&str]) -> (String, String) {
    run_cm_shared_when(d, prog, server, client, || true)
}

/// [`run_cm_shared`], the client started once `ready()` (checked for up to 10 s) and half a second
/// have passed since the server started.
fn run_cm_shared_when(
    d: &Daemon,
    prog: &str,
    server: &[&str],
    client: &[&str],
    ready: impl Fn() -> bool,
) -> (String, String) {
    let prog = program(prog).unwrap();
    let cmd = |args: &[&str]| {
        let mut c = on_daemon(d, &prog);
        c.args(args);
        c
    };
    let server = cmd(server).spawn().expect("server");
    let start = std::time::Instant::now();
    while !ready() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let client = cmd(client).spawn().expect("client");
    let (c, ck) = wait_limit(client, Duration::from_secs(60));
    let (s, sk) = wait_limit(server, Duration::from_secs(if ck { 1 } else { 60 }));
    let text = |o: &Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!ck && !sk && c.status.success() && s.status.success(), "server:\n{}\nclient:\n{}", text(&s), text(&c));
    (text(&s), text(&c))
}

/// rdma-core's unmodified `rping`, server and client as two processes on the one daemon device:
/// the RDMA CM (listen, resolve, connect, accept, disconnect) runs in softrdmad.
#[test]
fn rping_through_one_daemon_device() {
    if program("rping").is_none() {
        eprintln!("SKIP: rping not installed (apt-get install rdmacm-utils)");
        return;
    }
    let d = start_daemon("rping");
    let port = free_tcp_port().to_string();
    let common = ["-a", "127.0.0.9", "-p", &port, "-C", "10", "-v", "-V"];
    let (so, co) = run_cm_shared(&d, "rping", &[&["-s"][..], &common].concat(), &[&["-c"][..], &common].concat());
    assert_eq!(co.matches("ping data: rdma-ping-").count(), 10, "{co}");
    assert_eq!(so.matches("server ping data: rdma-ping-").count(), 10, "{so}");
    assert!(so.contains("server DISCONNECT EVENT..."), "{so}");
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// `ucmatose` (two RC connections, sends both ways) and `udaddy` (UD, resolved with SIDR) on the
/// one daemon device.
#[test]
fn ucmatose_and_udaddy_through_one_daemon_device() {
    if program("ucmatose").is_none() || program("udaddy").is_none() {
        eprintln!("SKIP: ucmatose / udaddy not installed (apt-get install rdmacm-utils)");
        return;
    }
    let d = start_daemon("cmatose");
    let port = free_tcp_port().to_string();
    let runs = [
        run_cm_shared(
            &d,
            "ucmatose",
            &["-b", "127.0.0.9", "-p", &port, "-c", "2", "-C", "20", "-S", "4000"],
            &["-s", "127.0.0.9", "-p", &port, "-c", "2", "-C", "20", "-S", "4000"],
        ),
        run_cm_shared(&d, "udaddy", &["-b", "127.0.0.9", "-C", "20"], &["-s", "127.0.0.9", "-C", "20"]),
    ];
    for (s, c) in &runs {
        for out in [s, c] {
            for want in ["data transfers complete", "test complete", "return status 0"] {
                assert!(out.contains(want), "missing {want:?}\nserver:\n{s}\nclient:\n{c}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// `mckey` on the one daemon device: the receiver's and the sender's joins (`rdma_join_multicast`,
/// the receiver's QP attached through the daemon), every message sent to the group over UDP and
/// back to the daemon's group socket. The daemon (a thread of this test) and the programs run in a
/// network namespace of the test's own.
#[test]
fn mckey_through_one_daemon_device() {
    if program("mckey").is_none() {
        eprintln!("SKIP: mckey not installed (apt-get install rdmacm-utils)");
        return;
    }
    if !common::own_netns() {
        return;
    }
    let d = start_daemon("mckey");
    // The sender starts once the receiver's QP is attached: the daemon's socket for the group is
    // bound then (a loaded machine can take longer than the half second the others wait).
    let group = format!("{:02X}{:02X}{:02X}{:02X}:{:04X}", 4, 2, 1, 239, d.udp);
    let joined = || {
        std::fs::read_to_string("/proc/thread-self/net/udp")
            .is_ok_and(|t| t.lines().skip(1).any(|l| l.split_whitespace().nth(1) == Some(group.as_str())))
    };
    let (s, c) = run_cm_shared_when(
        &d,
        "mckey",
        &["-m", "239.1.2.4", "-b", "127.0.0.9", "-C", "40"],
        &["-m", "239.1.2.4", "-b", "127.0.0.9", "-s", "-C", "40"],
        joined,
    );
    for out in [&s, &c] {
        for want in ["mckey: joined dgid: ::ffff:239.1.2.4", "data transfers complete", "return status 0"] {
            assert!(out.contains(want), "missing {want:?}\nreceiver:\n{s}\nsender:\n{c}");
        }
    }
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// rdma_cm over IPv6: unmodified `rping` server and client on `::1` (one daemon device bound to
/// ::1, two processes), also with `-q` (QPs of the programs' own: `rdma_init_qp_attr` and
/// `rdma_establish` through the daemon), and `ucmatose` with two connections over it: IPv6
/// addresses through resolve, the rdma_cm header, connect, accept, data and disconnect.
#[test]
fn rping_and_ucmatose_over_ipv6_loopback() {
    if program("rping").is_none() || program("ucmatose").is_none() {
        eprintln!("SKIP: rping / ucmatose not installed (apt-get install rdmacm-utils)");
        return;
    }
    let d = start_daemon_with("ipv6", "sd6 netdev lo addr ::1\n");
    let port = free_tcp_port().to_string();
    let common = ["-a", "::1", "-p", &port, "-C", "10", "-v", "-V"];
    let (so, co) = run_cm_shared(&d, "rping", &[&["-s"][..], &common].concat(), &[&["-c"][..], &common].concat());
    assert_eq!(co.matches("ping data: rdma-ping-").count(), 10, "{co}");
    assert_eq!(so.matches("server ping data: rdma-ping-").count(), 10, "{so}");
    assert!(so.contains("server DISCONNECT EVENT..."), "{so}");
    // `rping -q`: the QPs are the programs' own, moved with rdma_init_qp_attr; rdma_establish.
    let port = free_tcp_port().to_string();
    let common = ["-q", "-a", "::1", "-p", &port, "-C", "10", "-v", "-V"];
    let (so, co) = run_cm_shared(&d, "rping", &[&["-s"][..], &common].concat(), &[&["-c", "-d"][..], &common].concat());
    assert_eq!(co.matches("ping data: rdma-ping-").count(), 10, "{co}");
    assert_eq!(so.matches("server ping data: rdma-ping-").count(), 10, "{so}");
    assert!(co.contains("cma_event type RDMA_CM_EVENT_CONNECT_RESPONSE"), "{co}");
    let port = free_tcp_port().to_string();
    let (s, c) = run_cm_shared(
        &d,
        "ucmatose",
        &["-b", "::1", "-p", &port, "-c", "2", "-C", "10", "-S", "1000"],
        &["-s", "::1", "-p", &port, "-c", "2", "-C", "10", "-S", "1000"],
    );
    for out in [&s, &c] {
        for want in ["data transfers complete", "test complete", "return status 0"] {
            assert!(out.contains(want), "missing {want:?}\nserver:\n{s}\nclient:\n{c}");
        }
    }
    let _ = std::fs::remove_dir_all(&d.dir);
}
