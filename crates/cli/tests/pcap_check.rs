//! `softrdma pcap check` run as a program over the golden captures and altered copies of them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use softrdma_wire::capture::{classify, Classified, LinkType, PcapReader, PcapWriter};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden")
}

fn golden(name: &str) -> PathBuf {
    golden_dir().join(name)
}

fn golden_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("../shared/golden beside the repository")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pcap"))
        .collect();
    v.sort();
    assert!(v.len() >= 20, "expected the golden captures, found {}", v.len());
    v
}

/// Run `softrdma pcap check` and return (exit success, stdout, stderr).
fn check(files: &[&Path]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_softrdma")).arg("pcap").arg("check").args(files).output().unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// The five counts of a result line.
fn counts(line: &str) -> [u64; 5] {
    let (_, rest) = line.rsplit_once(": ").unwrap();
    let words: Vec<&str> = rest.split(", ").collect();
    let names = ["packets", "roce", "icrc-ok", "icrc-bad", "malformed"];
    assert_eq!(words.len(), 5, "{line}");
    let mut c = [0; 5];
    for (i, w) in words.iter().enumerate() {
        let (n, name) = w.split_once(' ').unwrap();
        assert_eq!(name, names[i], "{line}");
        c[i] = n.parse().unwrap();
    }
    c
}

fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("softrdma-pcap-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{tag}-{}.pcap", N.fetch_add(1, Ordering::Relaxed)))
}

/// Copy a golden capture, letting `alter` change the `n`th RoCE frame (an Ethernet frame).
fn altered(name: &str, n: usize, alter: impl Fn(&mut Vec<u8>)) -> PathBuf {
    let data = std::fs::read(golden(name)).unwrap();
    let r = PcapReader::new(&data).unwrap();
    assert_eq!(r.link_type(), LinkType::Ethernet);
    let path = temp_path(name.trim_end_matches(".pcap"));
    let mut w = PcapWriter::new(std::fs::File::create(&path).unwrap(), LinkType::Ethernet).unwrap();
    let mut seen = 0;
    for f in r {
        let f = f.unwrap();
        let mut bytes = f.data.to_vec();
        if !matches!(classify(LinkType::Ethernet, f.data), Classified::NotRoce) {
            if seen == n {
                alter(&mut bytes);
            }
            seen += 1;
        }
        let ts = std::time::Duration::new(u64::from(f.ts_sec), f.ts_nsec);
        w.write_frame(ts, &bytes).unwrap();
    }
    w.into_inner().unwrap();
    path
}

#[test]
fn every_golden_capture_is_clean() {
    let files = golden_files();
    let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    let (ok, out, err) = check(&refs);
    assert!(ok, "{out}\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), files.len());
    for (line, f) in lines.iter().zip(&files) {
        assert!(line.starts_with(&format!("{}: ", f.display())), "{line}");
        let [packets, roce, good, bad, malformed] = counts(line);
        assert!(roce <= packets);
        assert_eq!((good, bad, malformed), (roce, 0, 0), "{line}");
        let name = f.file_name().unwrap().to_str().unwrap();
        if name.starts_with("rxe_") || name.starts_with("nfsordma") || name.starts_with("peer_") {
            assert!(roce > 0, "{line}");
        }
    }
    // Counts pinned against DECODE_CHECK.txt (tshark plus an independent ICRC checker).
    let (_, out, _) = check(&[&golden("rxe_rc_pingpong.pcap"), &golden("nfsordma_v3_mount_read.pcap")]);
    let l: Vec<&str> = out.lines().collect();
    assert_eq!(counts(l[0]), [37, 22, 22, 0, 0]);
    assert_eq!(counts(l[1]), [2427, 2374, 2374, 0, 0]);
}

#[test]
fn file_name_is_printed_as_given() {
    let rel = golden("rxe_ud.pcap");
    let (ok, out, _) = check(&[&rel]);
    assert!(ok);
    assert_eq!(out, format!("{}: 22 packets, 10 roce, 10 icrc-ok, 0 icrc-bad, 0 malformed\n", rel.display()));
}

#[test]
fn flipped_payload_byte_is_a_bad_icrc() {
    // The first RoCE frame of rxe_rc_pingpong is a 64-byte SEND_ONLY: flip a payload byte.
    let p = altered("rxe_rc_pingpong.pcap", 0, |f| {
        assert_eq!(f.len(), 14 + 20 + 8 + 12 + 64 + 4);
        let at = 14 + 20 + 8 + 12 + 10;
        f[at] ^= 0x01;
    });
    let (ok, out, err) = check(&[&p]);
    assert!(!ok);
    assert_eq!(counts(out.trim()), [37, 22, 21, 1, 0]);
    assert!(err.contains("bad ICRC"), "{err}");
}

#[test]
fn flipped_bth_byte_is_a_bad_icrc() {
    // PSN low byte of the first RoCE frame of rxe_write.
    let p = altered("rxe_write.pcap", 0, |f| f[14 + 20 + 8 + 11] ^= 0x80);
    let (ok, out, _) = check(&[&p]);
    assert!(!ok);
    assert_eq!(counts(out.trim()), [221, 180, 179, 1, 0]);
}

#[test]
fn flipped_opcode_is_malformed() {
    // Opcode 0x04 (SEND_ONLY) -> 0x15 (reserved).
    let p = altered("rxe_rc_pingpong.pcap", 0, |f| f[14 + 20 + 8] = 0x15);
    let (ok, out, err) = check(&[&p]);
    assert!(!ok);
    assert_eq!(counts(out.trim()), [37, 22, 21, 0, 1]);
    assert!(err.contains("malformed"), "{err}");
}

#[test]
fn truncated_roce_packet_is_malformed() {
    let p = altered("rxe_ud.pcap", 3, |f| f.truncate(f.len() - 10));
    let (ok, out, _) = check(&[&p]);
    assert!(!ok);
    assert_eq!(counts(out.trim()), [22, 10, 9, 0, 1]);
}

#[test]
fn truncated_file_and_unreadable_files_fail() {
    let data = std::fs::read(golden("rxe_rc_pingpong.pcap")).unwrap();
    let cut = temp_path("cut");
    std::fs::write(&cut, &data[..data.len() - 7]).unwrap();
    let (ok, out, err) = check(&[&cut]);
    assert!(!ok);
    let [packets, _, _, _, malformed] = counts(out.trim());
    assert_eq!((packets, malformed), (37, 1));
    assert!(err.contains("claims"), "{err}");

    let missing = temp_path("missing");
    let (ok, out, err) = check(&[&missing, &golden("rxe_ud.pcap")]);
    assert!(!ok);
    assert_eq!(out.lines().count(), 1, "the readable file still gets its line");
    assert!(err.contains(&missing.display().to_string()) && err.contains("cannot read"), "{err}");

    let (ok, _, err) = check(&[&golden("README.md")]);
    assert!(!ok);
    assert!(err.contains("README.md") && err.contains("not a classic pcap"), "{err}");
}
