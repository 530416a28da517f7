//! Unmodified Debian programs that connect through the RDMA CM — `rdmacm-utils` (`rping`,
//! `ucmatose`, `udaddy`, `rdma_server`/`rdma_client`) and perftest with `-R` — run on softrdma
//! with `LD_LIBRARY_PATH` pointing at our `librdmacm.so.1` and `libibverbs.so.1`. The server binds
//! device `sr0` (127.0.0.2); the client uses `sr1` (127.0.0.3), by source address or by the
//! "not the destination's device" rule; two processes, a UDP port picked for each run.
//!
//! A program that is not installed is skipped with a message (`.ci/run` installs them).

mod common;

use std::path::Path;
use std::process::{Child, Output};
use std::time::{Duration, Instant};

use common::{command, free_tcp_port, free_udp_port, program, serial, wait_limit, PairRun};

const SERVER_IP: &str = "127.0.0.2";
const CLIENT_IP: &str = "127.0.0.3";

fn skip(name: &str) -> bool {
    if program(name).is_none() {
        eprintln!("SKIP: {name} is not installed (apt-get install rdmacm-utils perftest)");
        return true;
    }
    false
}

/// Whether a UDP socket is bound to `ip:port` (the server's device is open).
fn udp_bound(ip: [u8; 4], port: u16) -> bool {
    let want = format!("{:02X}{:02X}{:02X}{:02X}:{port:04X}", ip[3], ip[2], ip[1], ip[0]);
    // This thread's network namespace (a test may have one of its own: `common::own_netns`).
    std::fs::read_to_string("/proc/thread-self/net/udp")
        .is_ok_and(|t| t.lines().skip(1).any(|l| l.split_whitespace().nth(1) == Some(&want)))
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Start `server_args`, wait until its device is up (plus a moment for `rdma_listen`, which
/// follows the bind at once), run `client_args`; both on one fresh UDP port.
fn run_cm_pair(prog: &Path, server_args: &[&str], client_args: &[&str]) -> PairRun {
    run_cm_pair_limit(prog, server_args, client_args, Duration::from_secs(30))
}

/// [`run_cm_pair`], the server given `server_limit` once the client is done.
fn run_cm_pair_limit(prog: &Path, server_args: &[&str], client_args: &[&str], server_limit: Duration) -> PairRun {
    let limit = Duration::from_secs(30);
    let udp = free_udp_port();
    let server: Child = command(prog, udp).args(server_args).spawn().expect("spawn server");
    let start = Instant::now();
    while !udp_bound([127, 0, 0, 2], udp) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let client = command(prog, udp).args(client_args).spawn().expect("spawn client");
    let (c, ckilled) = wait_limit(client, limit);
    let (s, skilled) = wait_limit(server, if ckilled { Duration::from_secs(1) } else { server_limit });
    PairRun {
        server: text(&s),
        client: text(&c),
        server_ok: s.status.success() && !skilled,
        client_ok: c.status.success() && !ckilled,
    }
}

fn assert_ok(what: &str, run: &PairRun) {
    assert!(run.server_ok && run.client_ok, "{what} failed\n{}", run.describe());
    for out in [&run.server, &run.client] {
        assert!(!out.contains("softrdma libibverbs:"), "{what} reported a failure\n{}", run.describe());
    }
}

/// The ping-pong text rping puts in its buffer for ping `n` (64-byte buffer).
/// `rping -v` with `-C count` showed every ping's data on both sides, and the server saw the
/// client disconnect.
fn assert_pings(run: &PairRun, count: usize) {
    for n in 0..count {
        let line = rping_line(n);
        assert!(
            run.client.contains(&format!("ping data: {line}\n")),
            "client lacks ping {n}: {line}\n{}",
            run.describe()
        );
        assert!(
            run.server.contains(&format!("server ping data: {line}\n")),
            "server lacks ping {n}\n{}",
            run.describe()
        );
    }
    assert!(run.server.contains("server DISCONNECT EVENT..."), "{}", run.describe());
}

fn rping_line(n: usize) -> String {
    let head = format!("rdma-ping-{n}: ");
    let mut s = head.clone();
    let mut c = 65 + (n as u8 % 58);
    while s.len() < 63 {
        s.push(c as char);
        c = if c >= 122 { 65 } else { c + 1 };
    }
    s
}

#[test]
fn rping_client_with_source_address() {
    if skip("rping") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let run = run_cm_pair(
        &program("rping").unwrap(),
        &["-s", "-a", SERVER_IP, "-p", &port, "-C", "10", "-v", "-V"],
        &["-c", "-a", SERVER_IP, "-I", CLIENT_IP, "-p", &port, "-C", "10", "-v", "-V"],
    );
    assert_ok("rping", &run);
    assert_pings(&run, 10);
}

/// `rping -q`: both sides create their QPs with `ibv_create_qp` and move them themselves with
/// `rdma_init_qp_attr`; the client gets CONNECT_RESPONSE and calls `rdma_establish`.
#[test]
fn rping_with_application_owned_qps() {
    if skip("rping") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let run = run_cm_pair(
        &program("rping").unwrap(),
        &["-s", "-q", "-a", SERVER_IP, "-p", &port, "-C", "10", "-v", "-V"],
        &["-c", "-q", "-d", "-a", SERVER_IP, "-I", CLIENT_IP, "-p", &port, "-C", "10", "-v", "-V"],
    );
    assert_ok("rping -q", &run);
    // The client's CM events (-d): CONNECT_RESPONSE, never ESTABLISHED.
    assert!(run.client.contains("cma_event type RDMA_CM_EVENT_CONNECT_RESPONSE"), "{}", run.describe());
    assert!(!run.client.contains("RDMA_CM_EVENT_ESTABLISHED"), "{}", run.describe());
    assert_pings(&run, 10);
}

#[test]
fn rping_client_picks_the_other_device() {
    if skip("rping") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let run = run_cm_pair(
        &program("rping").unwrap(),
        &["-s", "-a", SERVER_IP, "-p", &port, "-C", "3", "-v"],
        &["-c", "-a", SERVER_IP, "-p", &port, "-C", "3", "-v"],
    );
    assert_ok("rping without -I", &run);
    assert_eq!(run.client.matches("ping data: rdma-ping-").count(), 3, "{}", run.describe());
}

#[test]
fn rping_without_a_listener_is_rejected() {
    if skip("rping") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    // A server on another port: the device answers the REQ with a REJ (invalid service ID).
    let run = run_cm_pair_limit(
        &program("rping").unwrap(),
        &["-s", "-a", SERVER_IP, "-p", &port, "-C", "1"],
        &["-c", "-a", SERVER_IP, "-I", CLIENT_IP, "-p", "1", "-C", "1"],
        Duration::from_millis(100),
    );
    assert!(!run.client_ok, "{}", run.describe());
    assert!(run.client.contains("cma event RDMA_CM_EVENT_REJECTED, error 8"), "{}", run.describe());
}

#[test]
fn ucmatose_two_connections() {
    if skip("ucmatose") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let run = run_cm_pair(
        &program("ucmatose").unwrap(),
        &["-b", SERVER_IP, "-p", &port, "-c", "2", "-C", "20", "-S", "4000"],
        &["-s", SERVER_IP, "-b", CLIENT_IP, "-p", &port, "-c", "2", "-C", "20", "-S", "4000"],
    );
    assert_ok("ucmatose", &run);
    for out in [&run.server, &run.client] {
        for want in ["data transfers complete", "test complete", "return status 0"] {
            assert!(out.contains(want), "missing {want:?}\n{}", run.describe());
        }
    }
    assert!(run.server.contains("disconnected"), "{}", run.describe());
}

/// `mckey`: a receiver joins a multicast group (`rdma_join_multicast`: its QP attached, then
/// MULTICAST_JOIN with the group's address handle, QPN 0xFFFFFF and Q_Key), the sender joins and
/// sends every message to the group; the receiver ends only once it got them all. Then again with
/// the sender a send-only member (`rdma_join_multicast_ex`, its QP not attached). In a network
/// namespace of the test's own.
#[test]
fn mckey_joins_and_sends_to_a_group() {
    if skip("mckey") || !common::own_netns() {
        return;
    }
    let _g = serial();
    let prog = program("mckey").unwrap();
    let receiver = ["-m", "239.1.2.3", "-b", SERVER_IP, "-C", "50"];
    for sender in [
        &["-m", "239.1.2.3", "-b", CLIENT_IP, "-s", "-C", "50"][..],
        &["-m", "239.1.2.3", "-b", CLIENT_IP, "-s", "-o", "-C", "50"],
    ] {
        let run = run_cm_pair(&prog, &receiver, sender);
        assert_ok("mckey", &run);
        for out in [&run.server, &run.client] {
            for want in ["mckey: joined dgid: ::ffff:239.1.2.3", "data transfers complete", "return status 0"] {
                assert!(out.contains(want), "missing {want:?}\n{}", run.describe());
            }
        }
        assert!(run.server.contains("receiving data transfers"), "{}", run.describe());
    }
}

#[test]
fn udaddy_resolves_and_exchanges_datagrams() {
    if skip("udaddy") {
        return;
    }
    let _g = serial();
    // udaddy's port is fixed (7174); the CM port space is per device, so runs cannot collide.
    let run = run_cm_pair(&program("udaddy").unwrap(), &["-b", SERVER_IP, "-C", "20"], &["-s", SERVER_IP, "-C", "20"]);
    assert_ok("udaddy", &run);
    for out in [&run.server, &run.client] {
        for want in ["data transfers complete", "test complete", "return status 0"] {
            assert!(out.contains(want), "missing {want:?}\n{}", run.describe());
        }
    }
}

#[test]
fn rdma_server_and_rdma_client() {
    if skip("rdma_server") || skip("rdma_client") {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let udp = free_udp_port();
    // rdma_server binds 0.0.0.0 by default: it takes the first registry device, sr0.
    let server = command(&program("rdma_server").unwrap(), udp).args(["-p", &port]).spawn().expect("spawn rdma_server");
    let start = Instant::now();
    while !udp_bound([127, 0, 0, 2], udp) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let client = command(&program("rdma_client").unwrap(), udp)
        .args(["-s", SERVER_IP, "-p", &port])
        .spawn()
        .expect("spawn rdma_client");
    let (c, _) = wait_limit(client, Duration::from_secs(30));
    let (s, _) = wait_limit(server, Duration::from_secs(10));
    let run =
        PairRun { server: text(&s), client: text(&c), server_ok: s.status.success(), client_ok: c.status.success() };
    assert_ok("rdma_server/rdma_client", &run);
    assert!(run.client.contains("rdma_client: end 0"), "{}", run.describe());
    assert!(run.server.contains("rdma_server: end 0"), "{}", run.describe());
}

fn perftest_cm(name: &str, extra: &[&str], result: &str) {
    if skip(name) {
        return;
    }
    let _g = serial();
    let port = free_tcp_port().to_string();
    let mut server = vec!["-R", "-d", "sr0", "-p", &port];
    server.extend_from_slice(extra);
    let mut client = vec!["-R", "-d", "sr1", "-p", &port];
    client.extend_from_slice(extra);
    client.push(SERVER_IP);
    let run = run_cm_pair(&program(name).unwrap(), &server, &client);
    assert_ok(name, &run);
    for out in [&run.server, &run.client] {
        assert!(out.contains("rdma_cm QPs\t : ON"), "{}", run.describe());
        assert!(out.contains("Data ex. method : rdma_cm"), "{}", run.describe());
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with(result))
            .unwrap_or_else(|| panic!("no result row {result:?}\n{}", run.describe()));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert!(cols.len() >= 4, "{row}");
    }
}

#[test]
fn ib_write_bw_over_rdma_cm() {
    perftest_cm("ib_write_bw", &["-n", "2000"], "65536      2000");
}

#[test]
fn ib_send_lat_over_rdma_cm() {
    perftest_cm("ib_send_lat", &["-n", "500"], "2       500");
}

/// `tests/abi_rdmacm.c` against rdma-core's headers, linked to our two libraries (skipped
/// without `librdmacm-dev` or a C compiler).
#[test]
fn c_abi_program() {
    run_c_program("abi_rdmacm", "abi0 netdev lo addr 127.0.0.9\nabi1 netdev lo addr 127.0.0.10\n");
}

/// `tests/cm_app_qp.c`: QPs of the application's own with `rdma_init_qp_attr` and
/// `rdma_establish`, ADDR_ERROR statuses, an IPv6 connection over ::1.
#[test]
fn c_application_owned_qps_addr_errors_and_ipv6() {
    run_c_program(
        "cm_app_qp",
        "app0 netdev lo addr 127.0.0.11\napp1 netdev lo addr 127.0.0.12\napp6 netdev lo addr ::1\n",
    );
}

/// Compile `tests/<name>.c` against rdma-core's headers and our libraries and run it with the
/// devices of `conf`; it prints ", 0 failed" when every check passed.
fn run_c_program(name: &str, conf: &str) {
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        eprintln!("SKIP: /usr/include/rdma/rdma_cma.h missing (apt-get install librdmacm-dev)");
        return;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let lib = common::lib_dir();
    let dir = std::env::temp_dir().join(format!("softrdma-ffi-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/{name}.c"));
    let built = match std::process::Command::new(&cc)
        .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg(format!("-L{}", lib.display()))
        .args(["-l:librdmacm.so.1", "-l:libibverbs.so.1"])
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP: no C compiler ({cc}: {e})");
            return;
        }
    };
    assert!(built.status.success(), "compiling {name}.c failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let devices = dir.join("devices.conf");
    std::fs::write(&devices, conf).expect("write devices.conf");
    let _g = serial();
    let child = std::process::Command::new(&exe)
        .env("LD_LIBRARY_PATH", lib)
        .env("SOFTRDMA_CONFIG", &devices)
        .env("SOFTRDMA_UDP_PORT", free_udp_port().to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let (out, killed) = wait_limit(child, Duration::from_secs(30));
    let t = text(&out);
    assert!(!killed && out.status.success(), "{name} failed:\n{t}");
    assert!(t.contains(", 0 failed"), "{t}");
}
