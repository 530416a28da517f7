//! Runs `softrdma perf <test> --loopback` for every test type with a few iterations and checks the
//! perftest layout of the output: banner, address lines, table header and one result row; plus
//! one server/client run across two processes.
//!
//! Each test uses its own UDP port so the tests can run in parallel.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma")).args(args).output().expect("run softrdma")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const DASHES: &str = "---------------------------------------------------------------------------------------";
const BW_HEADER: &str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
const LAT_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";
const LAT_DUR_HEADER: &str = " #bytes        #iterations       t_avg[usec]    tps average";

/// The numbers of the row after `header`, checked to be `fields` many.
fn row_after(out: &str, header: &str, fields: usize) -> Vec<f64> {
    let lines: Vec<&str> = out.lines().collect();
    let i = lines.iter().position(|l| *l == header).unwrap_or_else(|| panic!("no header {header:?} in:\n{out}"));
    let row = lines[i + 1];
    assert!(row.starts_with(' '), "{row:?}");
    let nums: Vec<f64> =
        row.split_whitespace().map(|x| x.parse().unwrap_or_else(|_| panic!("{x:?} in {row:?}"))).collect();
    assert_eq!(nums.len(), fields, "{row:?}");
    assert_eq!(lines[i + 2], DASHES, "{out}");
    nums
}

fn loopback(test: &str, udp_port: u16, extra: &[&str]) -> String {
    let port = udp_port.to_string();
    let mut args = vec!["perf", test, "--loopback", "--udp-port", &port];
    args.extend_from_slice(extra);
    let o = run(&args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "softrdma {args:?} failed:\n{out}\n{}", text(&o.stderr));
    assert!(out.starts_with(&format!("{DASHES}\n")), "{out}");
    assert!(out.contains(" local address: LID 0000 QPN 0x"), "{out}");
    assert!(out.contains(" remote address: LID 0000 QPN 0x"), "{out}");
    assert!(out.contains(" GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:77:0"), "{out}");
    assert!(out.contains("\n CPU time per GB : "), "{out}");
    // Two devices of one process on one host: the same-host link carries the packets.
    assert!(out.contains("\n Copies per byte : 2 (gather into the shared-memory ring slot 1, "), "{out}");
    out
}

#[test]
fn copies_over_udp_with_the_same_host_link_off() {
    // 64 KiB WRITEs leave from registered memory (3 copies), and with SOFTRDMA_RX_PLACE=1 their
    // packets after the first are received in place (2 copies); one-packet WRITEs of 4 KiB are
    // scattered either way (3); 512-byte ones are gathered first (4).
    for (size, place, copies) in [
        ("65536", "0", "3 (gather into the packet buffer 0, "),
        ("65536", "1", "2 (gather into the packet buffer 0, "),
        ("4096", "1", "3 (gather into the packet buffer 0, "),
        ("512", "0", "4 (gather into the packet buffer 1, "),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
            .args(["perf", "write-bw", "--loopback", "--udp-port", "47320", "-n", "50", "-s", size])
            .env("SOFTRDMA_SAME_HOST", "0")
            .env("SOFTRDMA_RX_PLACE", place)
            .env("SOFTRDMA_PERF_DEBUG", "1")
            .output()
            .expect("run softrdma");
        let out = text(&o.stdout);
        assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
        assert!(out.contains(&format!("\n Copies per byte : {copies}kernel sendmsg 1, ")), "{out}");
        // The debug lines (one per side) say how many packets were received in place.
        let err = text(&o.stderr);
        let placed: u64 = err
            .lines()
            .filter_map(|l| {
                l.split_once("received in place ").and_then(|(_, n)| n.split(';').next()?.trim().parse::<u64>().ok())
            })
            .sum();
        assert_eq!(placed > 0, place == "1" && size == "65536", "{err}");
    }
}

fn bw(test: &str, title: &str, udp_port: u16, size: f64) {
    let out = loopback(test, udp_port, &["-n", "200"]);
    assert!(out.contains(&format!("\n                    {title}\n")), "{out}");
    let r = row_after(&out, BW_HEADER, 5);
    assert_eq!(r[0], size);
    assert_eq!(r[1], 200.0);
    assert!(r[3] > 0.0 && r[4] > 0.0, "{r:?}");
}

fn lat(test: &str, title: &str, udp_port: u16, size: f64) {
    let out = loopback(test, udp_port, &["-n", "100"]);
    assert!(out.contains(&format!("\n                    {title}\n")), "{out}");
    let r = row_after(&out, LAT_HEADER, 9);
    assert_eq!(r[0], size);
    assert_eq!(r[1], 100.0);
    // min <= typical <= max, percentiles ordered.
    assert!(r[2] > 0.0 && r[2] <= r[4] && r[4] <= r[3], "{r:?}");
    assert!(r[7] <= r[8], "{r:?}");
}

#[test]
fn write_bw() {
    bw("write-bw", "RDMA_Write BW Test", 47301, 65536.0);
}

#[test]
fn read_bw() {
    bw("read-bw", "RDMA_Read BW Test", 47302, 65536.0);
}

#[test]
fn send_bw() {
    bw("send-bw", "Send BW Test", 47303, 65536.0);
}

#[test]
fn atomic_bw() {
    bw("atomic-bw", "Atomic FETCH_AND_ADD BW Test", 47304, 8.0);
}

#[test]
fn write_lat() {
    lat("write-lat", "RDMA_Write Latency Test", 47305, 2.0);
}

#[test]
fn read_lat() {
    lat("read-lat", "RDMA_Read Latency Test", 47306, 2.0);
}

#[test]
fn send_lat() {
    lat("send-lat", "Send Latency Test", 47307, 2.0);
}

#[test]
fn atomic_lat() {
    lat("atomic-lat", "Atomic FETCH_AND_ADD Latency Test", 47308, 8.0);
}

#[test]
fn send_bw_ud_and_write_bw_uc_with_two_qps() {
    let out = loopback("send-bw", 47309, &["-c", "UD", "-s", "1024", "-n", "200"]);
    assert!(out.contains(" Connection type : UD\t\tUsing SRQ      : OFF\n"), "{out}");
    let r = row_after(&out, BW_HEADER, 5);
    assert_eq!(r[0], 1024.0);
    let out = loopback("write-bw", 47310, &["-c", "UC", "-q", "2", "-n", "100"]);
    assert!(out.contains(" Number of qps   : 2\t\tTransport type : IB\n"), "{out}");
    assert_eq!(row_after(&out, BW_HEADER, 5)[1], 200.0);
}

/// Many QPs (perftest's -q) in one process: data over every QP, the QP memory line, and SEND with
/// more QPs than one CQ holds receive completions for (rx_depth 512 each: three CQs polled in turn).
#[test]
fn many_qps_report_their_memory() {
    let out = loopback("write-bw", 47320, &["-q", "2000", "-s", "4096", "-t", "2", "-n", "5"]);
    assert!(
        out.contains(
            " Number of qps   : 2000		Transport type : IB
"
        ),
        "{out}"
    );
    assert_eq!(row_after(&out, BW_HEADER, 5)[1], 10000.0);
    let line = out.lines().find(|l| l.starts_with(" QP memory       : ")).expect("QP memory line");
    let per_qp: u64 = line.split_whitespace().nth(3).and_then(|v| v.parse().ok()).expect("bytes per QP");
    assert!(line.contains("for 4000 QPs created and connected"), "{line}");
    // An idle connected QP costs about a kilobyte with the tool's bookkeeping; the bound is loose.
    assert!(per_qp < 64 * 1024, "{line}");
    let out = loopback("send-bw", 47321, &["-q", "130", "-s", "256", "-n", "20"]);
    assert_eq!(row_after(&out, BW_HEADER, 5)[1], 2600.0);
}

#[test]
fn duration_and_all_sizes() {
    let out = loopback("send-lat", 47311, &["-D", "0.3"]);
    let r = row_after(&out, LAT_DUR_HEADER, 4);
    assert_eq!(r[0], 2.0);
    assert!(r[1] > 0.0 && r[2] > 0.0 && r[3] > 0.0, "{r:?}");
    let out = loopback("write-bw", 47312, &["-D", "0.3", "--report_gbits"]);
    assert!(
        out.contains(" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"),
        "{out}"
    );
    let out = loopback("write-lat", 47313, &["-a", "-n", "20"]);
    let lines: Vec<&str> = out.lines().collect();
    let i = lines.iter().position(|l| *l == LAT_HEADER).expect("header");
    for (k, line) in lines[i + 1..i + 24].iter().enumerate() {
        assert!(line.starts_with(&format!(" {:<7} 20 ", 2u64 << k)), "{line:?}");
    }
    assert_eq!(lines[i + 24], DASHES);
}

#[test]
fn flags_refused_or_noted() {
    let o = run(&["perf", "write-bw", "-c", "UD", "--loopback"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("UD connection only possible in SEND verb"), "{}", text(&o.stderr));
    // -R in one process: both devices' CMs connect the QPs.
    let o = run(&["perf", "write-bw", "-R", "--loopback", "--udp-port", "47314", "-n", "50"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("\n rdma_cm QPs\t : ON\n"), "{}", text(&o.stdout));
    // -i names the port: a soft device has port 1 only.
    let o = run(&["perf", "write-bw", "-i", "2", "--loopback", "--udp-port", "47314"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains(" Unable to query port 2 attributes: "), "{}", text(&o.stderr));
    let o = run(&["perf", "send-bw", "-g", "-R", "--loopback"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("doesn't support Multicast with rdma_cm"), "{}", text(&o.stderr));
}

/// A free TCP port on loopback (a race with other processes is possible but unlikely).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn server_and_client_processes() {
    // The TCP exchange over IPv6 (the devices are IPv4's): the server listens on both.
    let (sout, cout) = two_processes(&["write-bw", "-n", "300"], 1, 47315, "::1");
    assert!(sout.contains("* Waiting for client to connect... *"), "{sout}");
    assert!(cout.contains(" TX depth        : 128\n") && !sout.contains(" TX depth"), "{cout}\n{sout}");
    // The passive server prints the client's figures, as perftest does.
    assert_eq!(row_after(&cout, BW_HEADER, 5), row_after(&sout, BW_HEADER, 5));
    assert!(cout.contains("\tDevice         : cli0\n") && sout.contains("\tDevice         : srv0\n"));
}

/// `softrdma perf` server and client of `args` in two processes, devices at 127.0.78.`s` and
/// 127.0.78.`s + 1`, the client connecting over TCP to `host`; both must succeed. Returns
/// (server's output, client's output), each with its standard error (`SOFTRDMA_PERF_DEBUG`'s
/// counters) after it.
fn two_processes(args: &[&str], s: u8, udp: u16, host: &str) -> (String, String) {
    let tcp = free_port().to_string();
    let udp = udp.to_string();
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let side = |last: u8, dev: &str| {
        let mut c = Command::new(bin);
        c.arg("perf").args(args).args(["-p", &tcp, "--udp-port", &udp, "-d", dev]);
        c.args(["--bind", &format!("127.0.78.{last}")]).env("SOFTRDMA_PERF_DEBUG", "1");
        c
    };
    let mut server = side(s, "srv0").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let client = side(s + 1, "cli0").arg(host).output().unwrap();
    if !client.status.success() {
        let _ = server.kill();
    }
    let server = server.wait_with_output().unwrap();
    let (cout, sout) = (text(&client.stdout), text(&server.stdout));
    assert!(client.status.success(), "{args:?}: {cout}\n{}", text(&client.stderr));
    assert!(server.status.success(), "{args:?}: {sout}\n{}", text(&server.stderr));
    (sout + &text(&server.stderr), cout + &text(&client.stderr))
}

/// The `(QPN, PSN)` of each `side` ("local" or "remote") address line of a perf output.
fn addresses(out: &str, side: &str) -> Vec<(String, String)> {
    let prefix = format!(" {side} address: LID 0000 QPN ");
    out.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), f[2].to_string())
        })
        .collect()
}

/// `-R`: the QPs are connected with rdma_cm (the region's address and rkey in the private data):
/// RC WRITEs on two QPs, UC SENDs, UD SENDs on two QPs (SIDR) and UD send-lat (the server reaches
/// the client's QP). Each side's remote addresses are the other's local ones, PSNs included,
/// which the CM picked.
#[test]
fn qps_connected_with_rdma_cm() {
    for (k, args) in [
        &["write-bw", "-R", "-q", "2", "-n", "300"][..],
        &["send-lat", "-R", "-c", "UC", "-n", "300"],
        &["send-bw", "-R", "-c", "UD", "-q", "2", "-n", "300"],
        &["send-lat", "-R", "-c", "UD", "-n", "300"],
    ]
    .into_iter()
    .enumerate()
    {
        let (sout, cout) = two_processes(args, 10 + 2 * k as u8, 47330 + k as u16, "127.0.0.1");
        // perftest's -R layout (golden tool-output/23-ib_write_bw-rxe0-rdmacm.txt): the server
        // says it waits for the CM, and the address lines name only the QPs.
        for out in [&sout, &cout] {
            assert!(out.contains("\n rdma_cm QPs\t : ON\n Data ex. method : rdma_cm\n"), "{args:?}: {out}");
            assert!(!out.contains(" RKey "), "{args:?}: {out}");
        }
        let waiting =
            "\n Waiting for client rdma_cm QP to connect\n Please run the same command with the IB/RoCE interface IP\n";
        assert!(sout.contains(waiting) && !cout.contains(waiting), "{args:?}: {sout}");
        // The CM's IDs were there through the test: one per QP, and the server's listener.
        let qps = if args.contains(&"2") { 2 } else { 1 };
        assert!(cout.contains(&format!("; CM IDs {qps}\n")), "{args:?}: {cout}");
        assert!(sout.contains(&format!("; CM IDs {}\n", qps + 1)), "{args:?}: {sout}");
        let header = if args[0].ends_with("-bw") { BW_HEADER } else { LAT_HEADER };
        row_after(&cout, header, if args[0].ends_with("-bw") { 5 } else { 9 });
        let (cl, cr, sl, sr) = (
            addresses(&cout, "local"),
            addresses(&cout, "remote"),
            addresses(&sout, "local"),
            addresses(&sout, "remote"),
        );
        assert_eq!(cl.len(), qps, "{args:?}: {cout}");
        if args.contains(&"UD") {
            // UD carries no PSN to the peer: the QP numbers match.
            let qpns = |v: &[(String, String)]| v.iter().map(|a| a.0.clone()).collect::<Vec<_>>();
            assert_eq!((qpns(&cr), qpns(&sr)), (qpns(&sl), qpns(&cl)), "{args:?}:\n{sout}\n{cout}");
        } else {
            assert_eq!((&cr, &sr), (&sl, &cl), "{args:?}:\n{sout}\n{cout}");
        }
    }
}

/// `softrdma perf` with `args`, in a network namespace of its own with its loopback up (packets
/// sent to a multicast group stay in it); `None` where no namespace can be made.
fn run_in_own_netns(args: &[&str]) -> Option<Output> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0
        || Command::new("unshare").args(["-n", "true"]).status().map_or(true, |s| !s.success())
    {
        eprintln!("skipped: cannot create a network namespace here");
        return None;
    }
    let script = format!("ip link set lo up && exec {} \"$@\"", env!("CARGO_BIN_EXE_softrdma"));
    Some(Command::new("unshare").args(["-n", "sh", "-c", &script, "sh"]).args(args).output().expect("run unshare"))
}

/// `-g`: the server's QP is attached to a multicast group and the client sends to the group (QPN
/// 0xffffff); in latency tests the client's QP is attached to the next group, where the server
/// answers. Every message arrives, or the run would not end.
#[test]
fn multicast_send_bw_and_send_lat() {
    let group = " MGID: 00:00:00:00:00:00:00:00:00:00:255:255:239:02:201:133";
    let Some(o) = run_in_own_netns(&["perf", "send-bw", "--loopback", "-g", "-n", "300", "-s", "1024"]) else { return };
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[1..3], ["                    Send BW Multicast Test", " MultiCast runs on UD!"], "{out}");
    assert!(out.contains("\n Connection type : UD\t"), "{out}");
    assert!(out.contains("\n remote address: LID 0000 QPN 0xffffff PSN 0x"), "{out}");
    assert!(out.contains(&format!("\n{group}\n")), "{out}");
    assert_eq!(row_after(&out, BW_HEADER, 5)[..2], [1024.0, 300.0]);

    let o = run_in_own_netns(&["perf", "send-lat", "--loopback", "-g", "-n", "300"]).expect("namespace");
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(out.contains("                    Send Latency Multicast Test\n MultiCast runs on UD!\n"), "{out}");
    // This side's group is the next one; the peer's is the server's.
    assert!(out.contains("\n local address: LID 0000 QPN 0xffffff PSN 0x"), "{out}");
    assert!(out.contains("\n GID: 00:00:00:00:00:00:00:00:00:00:255:255:239:02:201:134\n"), "{out}");
    assert!(out.contains(&format!("\n{group}\n")), "{out}");
    assert_eq!(row_after(&out, LAT_HEADER, 9)[..2], [2.0, 300.0]);

    // A group of one's own choosing.
    let o = run_in_own_netns(&["perf", "send-bw", "--loopback", "-g", "-M", "239.9.8.7", "-n", "100", "-s", "64"])
        .expect("ns");
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(out.contains("\n MGID: 00:00:00:00:00:00:00:00:00:00:255:255:239:09:08:07\n"), "{out}");
}

/// `-g` with an IPv6 GID (-x 0, the link-local default GID) takes the default group
/// ff02:0:2:c985:: (perftest's, with link-local scope). Linux routes no IPv6 multicast over `lo`,
/// so the two processes' devices are the two ends of a veth pair in a namespace of the test's own.
#[test]
fn multicast_to_the_default_ipv6_group_over_a_veth_pair() {
    let b = env!("CARGO_BIN_EXE_softrdma");
    let perf = "perf send-bw -g -x 0 -s 1024 -n 200";
    let script = format!(
        "mount -t sysfs sysfs /sys && ip link set lo up && ip link add d0 type veth peer name d1 && \
         ip link set d0 up && ip link set d1 up && ip -6 addr add fd00::1/64 dev d0 nodad && \
         ip -6 addr add fd00::2/64 dev d1 nodad && \
         {{ {b} {perf} --bind fd00::1 --netdev d0 >/dev/null 2>&1 & }} && sleep 0.5 && \
         exec {b} {perf} --bind fd00::2 --netdev d1 127.0.0.1"
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0
        || Command::new("unshare").args(["-n", "-m", "true"]).status().map_or(true, |s| !s.success())
    {
        eprintln!("skipped: cannot create a network namespace here");
        return;
    }
    let o = Command::new("unshare").args(["-n", "-m", "sh", "-c", &script]).output().expect("run unshare");
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(out.contains("\n MGID: 255:02:00:00:00:02:201:133:00:00:00:00:00:00:00:00\n"), "{out}");
    assert_eq!(row_after(&out, BW_HEADER, 5)[..2], [1024.0, 200.0]);
}

#[test]
fn multicast_flags_refused_where_perftest_refuses_them() {
    for (args, why) in [
        (&["perf", "write-bw", "-g"][..], "MultiCast feature only available on SEND verb"),
        (&["perf", "send-bw", "-g", "-q", "2"], "Only 1 QP supported in multicast"),
        (&["perf", "send-bw", "-g", "-R"], "Perftest still doesn't support Multicast with rdma_cm"),
        (&["perf", "send-bw", "-M", "239.1.1.1"], "-M (MGID) needs -g"),
        (&["perf", "send-bw", "-g", "-M", "127.0.0.1"], "MGID 127.0.0.1 is not a multicast address"),
        (&["perf", "send-bw", "-g", "-M", "1:2:x"], "Invalid MGID 1:2:x"),
    ] {
        let o = run(&[args, &["--loopback"]].concat());
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o.stderr).contains(why), "{args:?}: {}", text(&o.stderr));
    }
}

/// UD messages are at most one MTU, as perftest makes them: without -s the size becomes the MTU
/// (said on standard error), -a stops at the MTU, and a larger -s is refused.
#[test]
fn ud_messages_fit_the_mtu_as_perftest_makes_them() {
    let base = ["perf", "send-bw", "--loopback", "--udp-port", "47318", "-c", "UD", "-m", "1024", "-n", "50"];
    let o = run(&base);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains(" Max msg size in UD is MTU 1024\n Changing to this MTU\n"), "{err}");
    assert_eq!(row_after(&out, BW_HEADER, 5)[0], 1024.0);
    let o = run(&[&base[..], &["-a"]].concat());
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    let sizes: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(' ') && l.ends_with(|c: char| c.is_ascii_digit()))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.parse::<u64>().is_ok())
        .collect();
    assert_eq!(sizes, ["2", "4", "8", "16", "32", "64", "128", "256", "512", "1024"], "{out}");
    let o = run(&[&base[..], &["-s", "2048"]].concat());
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("Max message size in UD cannot be greater than MTU"), "{}", text(&o.stderr));
}
