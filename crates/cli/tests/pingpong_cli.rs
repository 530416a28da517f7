//! `softrdma pingpong` as two real processes, server and client, with two devices on two loopback
//! addresses from a `devices.conf` of the test's own: exact output line shapes (those of rdma-core's
//! `ibv_rc_pingpong`), addresses that match across the two sides, exit codes; and the errors a user
//! meets first (unknown device, bad GID index, UDP port taken, nobody listening), each a non-zero
//! exit with a message that says what is wrong.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_softrdma");

/// A devices.conf in a temporary directory; `devices` are (name, loopback address).
fn config(devices: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("devices.conf");
    let text: String = devices.iter().map(|(n, a)| format!("{n} netdev lo addr {a}\n")).collect();
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// A TCP port nobody listens on right now (the server binds 0.0.0.0).
fn free_tcp_port() -> u16 {
    TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port()
}

/// A UDP port free on every address right now.
fn free_udp_port() -> u16 {
    UdpSocket::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port()
}

fn pingpong(conf: &Path, udp_port: u16, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("pingpong")
        .args(args)
        .env("SOFTRDMA_CONFIG", conf)
        .env("SOFTRDMA_UDP_PORT", udp_port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// A spawned process, killed (by its pid) if the test ends before it does.
struct Proc(Option<Child>);

impl Proc {
    /// Wait up to `limit` for the exit, then collect the output.
    fn finish(mut self, limit: Duration) -> Output {
        let mut c = self.0.take().unwrap();
        let start = Instant::now();
        while c.try_wait().unwrap().is_none() {
            if start.elapsed() > limit {
                let _ = c.kill();
                let out = c.wait_with_output().unwrap();
                panic!("still running after {limit:?}; killed. stdout:\n{}", show(&out));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        c.wait_with_output().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Whether something listens on TCP `port` of this network namespace (/proc/net/tcp, state 0A).
fn tcp_listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

fn wait_listening(port: u16, server: &mut Proc) {
    let start = Instant::now();
    while !tcp_listening(port) {
        if let Some(st) = server.0.as_mut().unwrap().try_wait().unwrap() {
            let out = server.0.take().unwrap().wait_with_output().unwrap();
            panic!("the server exited ({st}) before listening:\n{}", show(&out));
        }
        assert!(start.elapsed() < Duration::from_secs(10), "the server does not listen on TCP {port}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `  local address:  LID 0x0000, QPN 0x000011, PSN 0x1c1ff9, GID ::ffff:127.0.12.1`, exactly;
/// returns (QPN, PSN, GID text).
fn address_line(line: &str, label: &str) -> (u32, u32, String) {
    let bad = || -> ! { panic!("not an ibv_rc_pingpong address line for {label:?}: {line:?}") };
    let rest = line.strip_prefix(label).unwrap_or_else(|| bad());
    let f: Vec<&str> = rest.split(", ").collect();
    if f.len() != 4 || f[0] != "LID 0x0000" {
        bad();
    }
    let hex6 = |s: &str, key: &str| -> u32 {
        let h = s.strip_prefix(key).unwrap_or_else(|| bad());
        if h.len() != 6 || !h.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)) {
            bad();
        }
        u32::from_str_radix(h, 16).unwrap()
    };
    let qpn = hex6(f[1], "QPN 0x");
    let psn = hex6(f[2], "PSN 0x");
    let gid = f[3].strip_prefix("GID ").unwrap_or_else(|| bad()).to_string();
    (qpn, psn, gid)
}

/// A decimal with exactly two digits after the point.
fn two_decimals(s: &str, line: &str) -> f64 {
    let ok = s.split_once('.').is_some_and(|(i, d)| {
        !i.is_empty() && i.chars().all(|c| c.is_ascii_digit()) && d.len() == 2 && d.chars().all(|c| c.is_ascii_digit())
    });
    assert!(ok, "{s:?} is not a %.2f number in {line:?}");
    s.parse().unwrap()
}

/// `N bytes in X seconds = Y Mbit/sec` / `N iters in X seconds = Y usec/iter`: returns (N, X, Y).
fn rate_line(line: &str, what: &str, unit: &str) -> (u64, f64, f64) {
    let w: Vec<&str> = line.split(' ').collect();
    assert!(
        w.len() == 8 && w[1] == what && w[2] == "in" && w[4] == "seconds" && w[5] == "=" && w[7] == unit,
        "not an ibv_rc_pingpong {what} line: {line:?}"
    );
    let n = w[0].parse().unwrap_or_else(|_| panic!("count in {line:?}"));
    (n, two_decimals(w[3], line), two_decimals(w[6], line))
}

struct Report {
    local: (u32, u32, String),
    remote: (u32, u32, String),
}

/// Check one side's stdout line by line; returns the two addresses.
fn check_output(o: &Output, size: u64, iters: u64) -> Report {
    assert!(o.status.success(), "pingpong failed:\n{}", show(o));
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "four lines expected:\n{}", show(o));
    let local = address_line(lines[0], "  local address:  ");
    let remote = address_line(lines[1], "  remote address: ");
    let (bytes, secs, mbit) = rate_line(lines[2], "bytes", "Mbit/sec");
    assert_eq!(bytes, size * iters * 2, "{}", lines[2]);
    let (n, secs2, usec) = rate_line(lines[3], "iters", "usec/iter");
    assert_eq!(n, iters, "{}", lines[3]);
    assert_eq!(secs, secs2, "both lines give the same time");
    assert!(mbit > 0.0 && usec > 0.0, "{text}");
    Report { local, remote }
}

/// One server and one client, which connects to `host` for the exchange of addresses; both exit
/// 0 and print the same addresses crosswise.
fn run_pair(tag: u8, extra: &[&str], size: u64, iters: u64, host: &str) {
    let (a, b) = (format!("127.0.12.{}", 2 * tag + 1), format!("127.0.12.{}", 2 * tag + 2));
    let (_dir, conf) = config(&[("pa", &a), ("pb", &b)]);
    let udp = free_udp_port();
    let tcp = free_tcp_port().to_string();
    let (size_s, iters_s) = (size.to_string(), iters.to_string());
    let mut common = vec!["-g", "1", "-p", &tcp, "-s", &size_s, "-n", &iters_s, "-c"];
    common.extend_from_slice(extra);
    let mut server = Proc(Some(pingpong(&conf, udp, &[&["-d", "pa"][..], &common[..]].concat()).spawn().unwrap()));
    wait_listening(tcp.parse().unwrap(), &mut server);
    let client =
        Proc(Some(pingpong(&conf, udp, &[&["-d", "pb"][..], &common[..], &[host][..]].concat()).spawn().unwrap()));
    let c = client.finish(Duration::from_secs(20));
    let s = server.finish(Duration::from_secs(20));
    let (rs, rc) = (check_output(&s, size, iters), check_output(&c, size, iters));
    assert_eq!(rs.local.2, format!("::ffff:{a}"), "server GID");
    assert_eq!(rc.local.2, format!("::ffff:{b}"), "client GID");
    assert_eq!(rs.remote, rc.local, "the server's remote address is the client's local one");
    assert_eq!(rc.remote, rs.local, "the client's remote address is the server's local one");
}

#[test]
fn pingpong_polling_4k_mtu_1024() {
    run_pair(0, &[], 4096, 200, "127.0.0.1");
}

#[test]
fn pingpong_events_one_byte_exchange_over_ipv6() {
    run_pair(1, &["-e"], 1, 200, "::1");
}

#[test]
fn pingpong_multi_packet_mtu_4096() {
    run_pair(2, &["-m", "4096"], 100_000, 50, "127.0.0.1");
}

/// Run to completion; must fail with a message on stderr; returns it.
fn must_fail(cmd: &mut Command) -> String {
    let o = Proc(Some(cmd.spawn().unwrap())).finish(Duration::from_secs(20));
    assert!(!o.status.success(), "expected a failure:\n{}", show(&o));
    assert_eq!(o.status.code(), Some(1), "exit code:\n{}", show(&o));
    let err = String::from_utf8(o.stderr.clone()).unwrap();
    assert!(!err.trim().is_empty() && !err.contains("panicked"), "a clear message expected:\n{}", show(&o));
    err
}

#[test]
fn unknown_device_is_named_with_the_known_ones() {
    let (_dir, conf) = config(&[("pa", "127.0.12.21"), ("pb", "127.0.12.25")]);
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "nosuch"]));
    assert!(err.contains("IB device nosuch not found"), "{err}");
    assert!(err.contains(&format!("devices in {}: pa, pb", conf.display())), "{err}");
}

#[test]
fn missing_config_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("no-such-devices.conf");
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "pa"]));
    assert!(
        err.contains(&format!("IB device pa not found ({} does not exist", conf.display()))
            && err.contains("rxe0 on lo"),
        "{err}"
    );
}

#[test]
fn missing_interface_or_address_is_not_an_unknown_device() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("devices.conf");
    std::fs::write(&conf, "pa netdev nosuchif0\npb netdev lo addr 10.255.255.254\n").unwrap();
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "pa"]));
    assert!(
        err.contains("Couldn't get context for pa") && err.contains("network interface \"nosuchif0\" not found"),
        "{err}"
    );
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "pb"]));
    assert!(
        err.contains("Couldn't get context for pb") && err.contains("10.255.255.254 is not an address of lo"),
        "{err}"
    );
}

#[test]
fn bad_gid_index_is_named() {
    let (_dir, conf) = config(&[("pa", "127.0.12.22")]);
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "pa", "-g", "9"]));
    assert!(err.contains("can't read sgid of index 9") && err.contains("bad GID index 9"), "{err}");
    assert!(err.contains("the GID table has 2 entries"), "{err}");
}

#[test]
fn udp_port_in_use_is_named() {
    // Two devices on one address and UDP port: the second cannot have the port.
    let (_dir, conf) = config(&[("pa", "127.0.12.23"), ("pc", "127.0.12.23")]);
    let udp = free_udp_port();
    let tcp = free_tcp_port().to_string();
    let mut first = pingpong(&conf, udp, &["-d", "pa", "-p", &tcp]).spawn().unwrap();
    // The device is open (and its port bound) once the local address is printed.
    let mut line = String::new();
    BufReader::new(first.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let first = Proc(Some(first));
    assert!(line.starts_with("  local address:  "), "{line:?}");
    let err = must_fail(&mut pingpong(&conf, udp, &["-d", "pc", "-p", &free_tcp_port().to_string()]));
    assert!(
        err.contains(&format!("UDP port {udp} on 127.0.12.23 is already in use"))
            && err.contains("Couldn't get context for pc"),
        "{err}"
    );
    drop(first);
}

#[test]
fn unreachable_peer_is_named() {
    let (_dir, conf) = config(&[("pb", "127.0.12.24")]);
    let port = free_tcp_port();
    let err = must_fail(&mut pingpong(&conf, free_udp_port(), &["-d", "pb", "-p", &port.to_string(), "127.0.0.1"]));
    assert!(err.contains(&format!("Couldn't connect to 127.0.0.1:{port}")), "{err}");
}
