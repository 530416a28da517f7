//! Runs `softrdma devices` / `softrdma devinfo` against a temporary device configuration bound
//! to `lo` (SOFTRDMA_CONFIG), checking the layout, the exit codes and the error messages.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn run(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(args)
        .env("SOFTRDMA_CONFIG", config)
        .output()
        .expect("run softrdma")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

fn config(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("devices.conf");
    fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn devices_lists_configured_devices() {
    let (_dir, path) = config("rxe0 netdev lo\nrxe1 netdev lo addr 127.0.0.2\n");
    let o = run(&path, &["devices"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert_eq!(lines[0], "    device          \t   node GUID");
    assert_eq!(lines[1], "    ------          \t----------------");
    for (line, name) in lines[2..].iter().zip(["rxe0", "rxe1"]) {
        let (left, guid) = line.split_once('\t').unwrap();
        assert_eq!(left, format!("    {name:<16}"));
        assert_eq!(guid.len(), 16);
        assert!(guid.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    // Loopback devices get distinct, stable GUIDs.
    assert_ne!(lines[2][21..], lines[3][21..]);
    assert_eq!(stdout(&run(&path, &["devices"])), out);
}

#[test]
fn devinfo_verbose_on_lo() {
    let (_dir, path) = config("rxe0 netdev lo\n");
    let o = run(&path, &["devinfo", "-d", "rxe0", "-v"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for want in [
        "hca_id:\trxe0\n",
        "\ttransport:\t\t\tInfiniBand (0)\n",
        "\tvendor_id:\t\t\t0xffffff\n",
        "\tdevice_cap_flags:\t\t0x00203c76\n",
        "\t\tport:\t1\n",
        "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n",
        "\t\t\tmax_mtu:\t\t4096 (5)\n",
        "\t\t\tactive_mtu:\t\t4096 (5)\n",
        "\t\t\tlink_layer:\t\tEthernet\n",
        "\t\t\tphys_state:\t\tLINK_UP (5)\n",
        "\t\t\tGID[  1]:\t\t::ffff:127.0.0.1, RoCE v2\n",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    assert!(out.contains("\t\t\tGID[  0]:\t\tfe80::"), "{out}");
    assert!(out.ends_with("\n\n"));

    // Non-verbose: no device attributes, no GIDs.
    let short = stdout(&run(&path, &["devinfo"]));
    assert!(short.starts_with("hca_id:\trxe0\n"));
    assert!(!short.contains("max_qp"));
    assert!(!short.contains("GID["));
    assert!(short.contains("\t\t\tport_lmc:\t\t0x00\n"));
}

#[test]
fn devinfo_bound_address() {
    let (_dir, path) = config("rxe9 netdev lo addr 127.0.0.2\n");
    let o = run(&path, &["devinfo", "-v", "--ib-dev=rxe9"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("\t\t\tGID[  1]:\t\t::ffff:127.0.0.2, RoCE v2\n"), "{out}");
    assert!(!out.contains("GID[  2]"), "{out}");
}

#[test]
fn devinfo_errors() {
    let (_dir, path) = config("rxe0 netdev lo\n");

    let o = run(&path, &["devinfo", "-d", "nosuch"]);
    assert_eq!(o.status.code(), Some(255));
    assert_eq!(stderr(&o), "IB device 'nosuch' wasn't found\n");
    assert!(o.stdout.is_empty());

    let o = run(&path, &["devinfo", "-d", "rxe0", "-i", "2"]);
    assert_eq!(o.status.code(), Some(4));
    assert_eq!(stderr(&o), "Invalid port requested for device: rxe0: invalid port 2: the device has 1 port (1..=1)\n");

    let o = run(&path, &["devinfo", "-i", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("invalid port 0"));

    let o = run(&path, &["devinfo", "-d", "rxe0", "-i", "1"]);
    assert!(o.status.success());

    let o = run(&path, &["devinfo", "-l"]);
    assert_eq!(stdout(&o), "1 HCA found:\n\trxe0\n\n");
}

#[test]
fn config_errors() {
    let (_dir, path) = config("rxe0 netdev lo\nrxe1 netdev\n");
    let o = run(&path, &["devices"]);
    assert_eq!(o.status.code(), Some(255));
    let err = stderr(&o);
    assert!(err.contains("devices.conf:2: \"netdev\" needs a value"), "{err}");

    // A device whose interface is missing is skipped with a message.
    let (_dir, path) = config("rxe0 netdev lo\nghost netdev nosuch-if0\n");
    let o = run(&path, &["devices"]);
    assert!(o.status.success());
    assert_eq!(stdout(&o).lines().count(), 3);
    assert!(stderr(&o).contains("ghost"));
    let o = run(&path, &["devinfo", "-d", "ghost"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("network interface \"nosuch-if0\" not found"));

    // An address that is not on the interface.
    let (_dir, path) = config("rxe0 netdev lo addr 192.0.2.1\n");
    let o = run(&path, &["devinfo"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("address 192.0.2.1 is not an address of lo"));

    // No file: the implicit rxe0 on lo.
    let dir = tempfile::tempdir().unwrap();
    let o = run(&dir.path().join("absent.conf"), &["devinfo", "-l"]);
    assert_eq!(stdout(&o), "1 HCA found:\n\trxe0\n\n");

    // An empty file: no devices.
    let (_dir, path) = config("# nothing\n");
    let o = run(&path, &["devinfo"]);
    assert_eq!(o.status.code(), Some(255));
    assert_eq!(stderr(&o), "No IB devices found\n");
}
