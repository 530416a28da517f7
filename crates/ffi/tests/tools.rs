//! Unmodified Debian programs on softrdma: rdma-core's `ibverbs-utils` and `perftest`, run with
//! `LD_LIBRARY_PATH` pointing at our `libibverbs.so.1`. Servers use device `sr0` (127.0.0.2),
//! clients `sr1` (127.0.0.3), two processes, each with its own embedded device, on a UDP port and
//! a TCP port picked for the run.
//!
//! A program that is not installed is skipped with a message (`.ci/run` installs them, so CI runs
//! everything). `SOFTRDMA_FFI_FULL=1` adds `-a` (all message sizes) for every perftest program;
//! by default only `ib_write_bw -a` and `ib_send_lat -a` run, because perftest spends about a
//! second per size re-measuring the CPU clock and the suite must stay within two minutes.

mod common;

use std::time::Duration;

use common::{command, free_udp_port, program, run_pair, serial, PairRun};

/// Lines no successful run may print (our own failure explanations included).
const ERROR_MARKERS: [&str; 7] = ["Failed", "Couldn't", "couldn't", "Error", "error", "Unable", "softrdma libibverbs:"];

fn assert_clean(what: &str, run: &PairRun) {
    assert!(run.server_ok && run.client_ok, "{what} failed\n{}", run.describe());
    for out in [&run.server, &run.client] {
        if let Some(l) = out.lines().find(|l| ERROR_MARKERS.iter().any(|m| l.contains(m))) {
            panic!("{what} printed an error line: {l:?}\n{}", run.describe());
        }
    }
}

fn skip(name: &str) -> bool {
    if program(name).is_none() {
        eprintln!("SKIP: {name} is not installed (apt-get install ibverbs-utils perftest)");
        return true;
    }
    false
}

#[test]
fn ibv_devices_lists_the_registry() {
    if skip("ibv_devices") {
        return;
    }
    let out = command(&program("ibv_devices").unwrap(), free_udp_port()).output().expect("run ibv_devices");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ibv_devices failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("node GUID"), "{text}");
    for dev in ["sr0", "sr1"] {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(dev))
            .unwrap_or_else(|| panic!("{dev} missing:\n{text}"));
        let guid = line.split_whitespace().nth(1).expect("GUID column");
        assert!(guid.len() == 16 && guid.chars().all(|c| c.is_ascii_hexdigit()), "{line}");
    }
}

#[test]
fn ibv_devinfo_reports_the_devices() {
    if skip("ibv_devinfo") {
        return;
    }
    let _g = serial();
    let prog = program("ibv_devinfo").unwrap();
    let out = command(&prog, free_udp_port()).output().expect("run ibv_devinfo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ibv_devinfo failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "hca_id:\tsr0",
        "hca_id:\tsr1",
        "transport:\t\t\tInfiniBand (0)",
        "vendor_id:\t\t\t0xffffff",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }

    let out = command(&prog, free_udp_port()).args(["-v", "-d", "sr1"]).output().expect("run ibv_devinfo -v");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ibv_devinfo -v failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "hca_id:\tsr1",
        "max_qp_wr:\t\t\t1048576",
        "atomic_cap:\t\t\tATOMIC_HCA (1)",
        "max_srq_sge:\t\t\t27",
        "local_ca_ack_delay:\t\t15",
        "device_cap_flags_ex:\t\t0x203C76",
        "max_msg_sz:\t\t0x800000",
        "gid_tbl_len:\t\t1024",
        "phys_state:\t\tLINK_UP (5)",
        "GID[  1]:\t\t::ffff:127.0.0.3, RoCE v2",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    assert!(!text.contains("board_id"), "softrdma has no board_id:\n{text}");
}

/// One pingpong run: both sides print the bytes and iterations lines.
fn pingpong(name: &str, args: &[&str]) {
    if skip(name) {
        return;
    }
    let _g = serial();
    let run = run_pair(&program(name).unwrap(), args, "-p", Duration::from_secs(60));
    let what = format!("{name} {}", args.join(" "));
    assert_clean(&what, &run);
    for out in [&run.server, &run.client] {
        assert!(out.contains("local address:") && out.contains("remote address:"), "{what}\n{}", run.describe());
        assert!(out.lines().any(|l| l.contains(" bytes in ") && l.contains("Mbit/sec")), "{what}\n{}", run.describe());
        assert!(out.lines().any(|l| l.contains(" iters in ") && l.contains("usec/iter")), "{what}\n{}", run.describe());
    }
}

#[test]
fn rc_pingpong() {
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "200"]);
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "200", "-e"]);
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "100", "-s", "1"]);
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "100", "-s", "1000", "-m", "512"]);
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "50", "-s", "65536", "-m", "4096", "-e"]);
    pingpong("ibv_rc_pingpong", &["-g", "1", "-n", "1000", "-s", "64", "-c"]);
}

#[test]
fn uc_pingpong() {
    pingpong("ibv_uc_pingpong", &["-g", "1", "-n", "200"]);
    pingpong("ibv_uc_pingpong", &["-g", "1", "-n", "100", "-e", "-s", "2048"]);
}

#[test]
fn ud_pingpong() {
    pingpong("ibv_ud_pingpong", &["-g", "1", "-n", "200"]);
    pingpong("ibv_ud_pingpong", &["-g", "1", "-n", "100", "-e", "-s", "1024"]);
}

#[test]
fn srq_pingpong() {
    pingpong("ibv_srq_pingpong", &["-g", "1", "-n", "200"]);
    pingpong("ibv_srq_pingpong", &["-g", "1", "-n", "100", "-e", "-q", "4"]);
}

/// RC without `-g` must fail the way it does on the kernel's rxe: RoCE needs a GRH.
#[test]
fn rc_pingpong_without_gid_fails_cleanly() {
    if skip("ibv_rc_pingpong") {
        return;
    }
    let _g = serial();
    let run = run_pair(&program("ibv_rc_pingpong").unwrap(), &["-n", "10"], "-p", Duration::from_secs(20));
    assert!(!run.client_ok && !run.server_ok, "expected a refusal\n{}", run.describe());
    let both = format!("{}{}", run.server, run.client);
    assert!(both.contains("Failed to modify QP to RTR"), "{}", run.describe());
    assert!(both.contains("RoCE needs a GRH"), "our explanation is missing\n{}", run.describe());
}

fn perftest_run(name: &str, args: &[&str]) -> PairRun {
    let prog = program(name).unwrap();
    let mut run = run_pair(&prog, args, "-p", Duration::from_secs(90));
    // perftest measures the CPU clock by a regression of the TSC against gettimeofday and, when
    // the fit is poor ("Correlation coefficient r^2: ... < 0.9", which happens on a loaded
    // two-core machine whatever the device), gives up: a latency client fails, a bandwidth side
    // prints an all-zero row (it divides by a clock of 0 MHz). Up to two retries, for that
    // message only.
    for _ in 0..2 {
        if ![&run.server, &run.client].iter().any(|o| o.contains("Correlation coefficient")) {
            break;
        }
        run = run_pair(&prog, args, "-p", Duration::from_secs(90));
    }
    run
}

/// One perftest run: both sides print the result table with a row per size and no error.
fn perftest(name: &str, args: &[&str]) {
    if skip(name) {
        return;
    }
    let _g = serial();
    let mut all = vec!["-x", "1", "-F"];
    all.extend_from_slice(args);
    let what = format!("{name} {}", all.join(" "));
    let run = perftest_run(name, &all);
    assert_clean(&what, &run);
    let lat = name.ends_with("_lat");
    // Rows needed: every size of -a (2 B .. 8 MiB, as perftest runs them here, or the one atomic
    // size), else the default size.
    let want_rows = if args.contains(&"-a") && !name.contains("atomic") { 20 } else { 1 };
    // Latency results are printed by the client, bandwidth results by both (a write or read
    // server, which takes no part in the loop, only for the last size).
    let outputs: Vec<(&String, usize)> =
        if lat { vec![(&run.client, want_rows)] } else { vec![(&run.server, 1), (&run.client, want_rows)] };
    for (out, want_rows) in outputs {
        let header = if lat { "t_avg[usec]" } else { "BW average[MB/sec]" };
        let mut lines = out.lines().skip_while(|l| !(l.contains("#bytes") && l.contains(header)));
        assert!(lines.next().is_some(), "{what}: no result table\n{}", run.describe());
        let rows: Vec<Vec<f64>> = lines
            .map(|l| l.split_whitespace().filter_map(|w| w.parse::<f64>().ok()).collect::<Vec<_>>())
            .take_while(|n| n.len() >= 5)
            .collect();
        assert!(rows.len() >= want_rows, "{what}: {} result rows, want {want_rows}\n{}", rows.len(), run.describe());
        for r in &rows {
            assert!(r[0] >= 1.0 && r[1] >= 1.0, "{what}: no bytes or iterations in {r:?}");
            assert!(r[2..].iter().any(|n| *n > 0.0), "{what}: all-zero result {r:?}");
        }
        if want_rows > 1 {
            assert!(rows.windows(2).all(|w| w[1][0] > w[0][0]), "{what}: sizes not increasing");
        }
    }
}

fn full() -> bool {
    std::env::var_os("SOFTRDMA_FFI_FULL").is_some_and(|v| v != "0")
}

#[test]
fn perftest_bandwidth_rc() {
    perftest("ib_write_bw", &["-n", "200"]);
    perftest("ib_read_bw", &["-n", "200"]);
    perftest("ib_send_bw", &["-n", "200"]);
    perftest("ib_atomic_bw", &["-n", "200"]);
    perftest("ib_write_bw", &["-a", "-n", "5"]);
    if full() {
        perftest("ib_read_bw", &["-a", "-n", "5"]);
        perftest("ib_send_bw", &["-a", "-n", "5"]);
    }
}

#[test]
fn perftest_latency_rc() {
    perftest("ib_write_lat", &["-n", "200"]);
    perftest("ib_read_lat", &["-n", "200"]);
    perftest("ib_send_lat", &["-n", "200"]);
    perftest("ib_atomic_lat", &["-n", "200"]);
    perftest("ib_send_lat", &["-a", "-n", "5"]);
    if full() {
        perftest("ib_write_lat", &["-a", "-n", "5"]);
        perftest("ib_read_lat", &["-a", "-n", "5"]);
    }
}

/// `ib_send_bw -g`: the server's QP attached to a multicast group with `ibv_attach_mcast`, the
/// client sending to it (QPN 0xffffff), in a network namespace of the test's own. The group is
/// given with -M: perftest's default is an IPv6 group and these devices are IPv4.
#[test]
fn perftest_multicast() {
    if skip("ib_send_bw") || !common::own_netns() {
        return;
    }
    perftest("ib_send_bw", &["-g", "-M", "0:0:0:0:0:0:0:0:0:0:255:255:239:1:2:3", "-n", "200"]);
}

#[test]
fn perftest_ud_and_uc() {
    perftest("ib_send_bw", &["-c", "UD", "-n", "200"]);
    perftest("ib_send_lat", &["-c", "UD", "-n", "200"]);
    perftest("ib_write_bw", &["-c", "UC", "-n", "200"]);
    perftest("ib_send_bw", &["-c", "UC", "-n", "200"]);
    perftest("ib_write_lat", &["-c", "UC", "-n", "200"]);
    perftest("ib_send_lat", &["-c", "UC", "-n", "200"]);
}
