//! The C ABI test: `tests/abi.c`, compiled against rdma-core's `<infiniband/verbs.h>` (Debian
//! `libibverbs-dev`) and linked to our `libibverbs.so.1`, checks struct layouts and runs the data
//! path and the error paths through the header's inline functions.
//!
//! Skipped with a message when the header or a C compiler is missing (`.ci/run` installs both).

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn c_abi_program() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        eprintln!("SKIP: /usr/include/infiniband/verbs.h missing (apt-get install libibverbs-dev)");
        return;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let lib = common::lib_dir();
    let dir = std::env::temp_dir().join(format!("softrdma-ffi-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join("abi");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/abi.c");
    let built = match Command::new(&cc)
        .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg(format!("-L{}", lib.display()))
        .arg("-l:libibverbs.so.1")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP: no C compiler ({cc}: {e})");
            return;
        }
    };
    assert!(built.status.success(), "compiling abi.c failed:\n{}", String::from_utf8_lossy(&built.stderr));

    let conf = dir.join("devices.conf");
    std::fs::write(&conf, "abi0 netdev lo addr 127.0.0.9\n").expect("write devices.conf");
    let _g = common::serial();
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", lib)
        .env("SOFTRDMA_CONFIG", &conf)
        .env("SOFTRDMA_UDP_PORT", common::free_udp_port().to_string())
        .output()
        .expect("run abi");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "abi.c failed:\n{text}");
    assert!(text.contains(", 0 failed"), "{text}");
    // The binary really uses our library, with rdma-core's symbol versions.
    let deps = Command::new("objdump").arg("-T").arg(&exe).output();
    if let Ok(d) = deps {
        let t = String::from_utf8_lossy(&d.stdout);
        assert!(t.contains("IBVERBS_1.1") && t.contains("ibv_open_device"), "{t}");
    }
}

/// The library exports what rdma-core 44's does, with the same versions, and its SONAME.
#[test]
fn exported_symbols_and_soname() {
    let lib = common::lib_dir().join("libibverbs.so.1");
    let Ok(out) = Command::new("objdump").arg("-T").arg("-p").arg(&lib).output() else {
        eprintln!("SKIP: objdump missing");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("SONAME               libibverbs.so.1"), "{text}");
    let table = include_str!("../symbols.txt");
    for line in table.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let mut it = line.split_whitespace();
        let (v, s) = (it.next().unwrap(), it.next().unwrap());
        let found = text.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() >= 2 && cols[cols.len() - 1] == s && cols[cols.len() - 2] == v && l.contains(".text")
        });
        assert!(found, "{s}@@{v} not exported");
    }
    // Nothing of Rust's leaks out unversioned.
    let base: Vec<&str> = text.lines().filter(|l| l.contains(" Base ") && l.contains(".text")).collect();
    assert!(base.is_empty(), "unversioned exports: {base:?}");
}
