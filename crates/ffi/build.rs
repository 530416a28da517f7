//! Build script: the symbol versions of libibverbs.so.1, and the vendor stub libraries.
//!
//! * `symbols.txt` is the one table of exported symbols and their versions. From it we write the
//!   linker version script (`$OUT_DIR/libibverbs.map`, the version nodes IBVERBS_1.0 ... chained as
//!   rdma-core chains them) and, per module, `$OUT_DIR/symver_<module>.rs`: `.symver` directives
//!   binding each `#[no_mangle]` function the module defines to its node (a directive must be in
//!   the object file that defines the symbol). rustc passes its own anonymous version script
//!   listing the exported functions and GNU ld honours the first script for them; the `.symver`
//!   directives are what versions them. A function exported but not listed, or listed but not
//!   defined, fails the build.
//! * The SONAME is `libibverbs.so.1`, whatever the file is called.
//! * `stubs/rdmacm.c` becomes `$OUT_DIR/softrdma-lib/librdmacm.so.1`, the RDMA CM's drop-in
//!   library: it forwards to the connection manager in this crate (`src/cma.rs`).
//! * `stubs/mlx5.c` and `stubs/efa.c` become `$OUT_DIR/softrdma-lib/libmlx5.so.1` and
//!   `libefa.so.1` (perftest links them directly). They are C so that they need nothing from this
//!   crate; a missing C compiler only skips them, with a warning.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=symbols.txt");
    println!("cargo:rerun-if-changed=stubs");
    println!("cargo:rerun-if-changed=src");

    let table = fs::read_to_string(manifest.join("symbols.txt")).expect("read symbols.txt");
    let mut nodes: Vec<String> = Vec::new();
    let mut versions: Vec<(String, String)> = Vec::new();
    for line in table
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let mut it = line.split_whitespace();
        let (Some(version), Some(symbol), None) = (it.next(), it.next(), it.next()) else {
            panic!("symbols.txt: bad line {line:?}");
        };
        if !nodes.iter().any(|n| n == version) {
            nodes.push(version.to_owned());
        }
        versions.push((symbol.to_owned(), version.to_owned()));
    }
    // `.symver` must sit in the object file that defines the symbol, so each module gets the
    // directives for the `#[no_mangle]` functions it defines (`include!`d at its end).
    let mut defined = Vec::new();
    let mut modules: Vec<_> = fs::read_dir(manifest.join("src"))
        .expect("read src")
        .map(|e| e.unwrap().path())
        .collect();
    modules.sort();
    for path in modules
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
    {
        let src = fs::read_to_string(path).expect("read module");
        let lines: Vec<&str> = src.lines().collect();
        let mut symver = String::from("core::arch::global_asm!(\n");
        let mut any = false;
        for (i, l) in lines.iter().enumerate() {
            if l.trim() != "#[no_mangle]" {
                continue;
            }
            let decl = lines[i + 1..]
                .iter()
                .find(|l| l.contains("extern \"C\" fn "))
                .expect("fn after #[no_mangle]");
            let name = decl
                .split("fn ")
                .nth(1)
                .and_then(|r| r.split('(').next())
                .expect("fn name")
                .trim();
            let Some((_, version)) = versions.iter().find(|(s, _)| s == name) else {
                panic!(
                    "{} exports {name}, which symbols.txt does not list",
                    path.display()
                );
            };
            writeln!(symver, "    \".symver {name}, {name}@@{version}\",").unwrap();
            defined.push(name.to_owned());
            any = true;
        }
        symver.push_str(");\n");
        let stem = path.file_stem().unwrap().to_string_lossy();
        fs::write(
            out.join(format!("symver_{stem}.rs")),
            if any { symver } else { String::new() },
        )
        .expect("write symver");
    }
    for (s, _) in &versions {
        assert!(
            defined.contains(s),
            "symbols.txt lists {s}, which no module defines"
        );
    }
    // rdma-core 44 defines these nodes even where we export nothing from them.
    for n in [
        "IBVERBS_1.0",
        "IBVERBS_1.1",
        "IBVERBS_1.5",
        "IBVERBS_1.6",
        "IBVERBS_1.7",
        "IBVERBS_1.8",
        "IBVERBS_1.9",
        "IBVERBS_1.10",
        "IBVERBS_1.11",
        "IBVERBS_1.12",
        "IBVERBS_1.13",
        "IBVERBS_1.14",
        "IBVERBS_PRIVATE_34",
    ] {
        if !nodes.iter().any(|x| x == n) {
            nodes.push(n.to_owned());
        }
    }
    let mut map = String::from("/* Generated by build.rs from symbols.txt. */\n");
    let mut prev: Option<&str> = None;
    for n in &nodes {
        let local = if prev.is_none() { " local: *;" } else { "" };
        let private = n.contains("_PRIVATE");
        match (private, prev) {
            (false, Some(p)) => writeln!(map, "{n} {{{local} }} {p};").unwrap(),
            _ => writeln!(map, "{n} {{{local} }};").unwrap(),
        }
        if !private {
            prev = Some(n);
        }
    }
    fs::write(out.join("libibverbs.map"), map).expect("write map");

    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        out.join("libibverbs.map").display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");

    let lib_dir = out.join("softrdma-lib");
    fs::create_dir_all(&lib_dir).expect("create softrdma-lib");
    for (src, map, soname) in [
        ("mlx5.c", "mlx5.map", "libmlx5.so.1"),
        ("efa.c", "efa.map", "libefa.so.1"),
    ] {
        build_stub(&manifest.join("stubs"), src, map, soname, &lib_dir);
    }
    build_rdmacm(&manifest.join("stubs"), &versions, &out, &lib_dir);
}

/// `librdmacm.so.1`: `stubs/rdmacm.c` forwards each `rdma_*` to `softrdma_rdma_*` of
/// `SOFTRDMA_PRIVATE_1` in our libibverbs.so.1. That library is not built yet, so the shim links
/// against a stand-in built from the same file (`-DSOFTRDMA_LINK_STUB`), which gives it the
/// `DT_NEEDED` entry and the versioned references. The forwarded names and symbols.txt's
/// `SOFTRDMA_PRIVATE_1` entries must be the same set.
fn build_rdmacm(dir: &Path, versions: &[(String, String)], out: &Path, lib_dir: &Path) {
    let src = fs::read_to_string(dir.join("rdmacm.c")).expect("read rdmacm.c");
    let mut forwarded: Vec<String> = src
        .lines()
        .filter(|l| l.starts_with("FWD(") || l.starts_with("FWDV("))
        .filter_map(|l| {
            l.split([',', '('])
                .map(str::trim)
                .find(|t| t.starts_with("rdma_"))
                .map(|t| format!("softrdma_{t}"))
        })
        .collect();
    forwarded.sort();
    let mut private: Vec<String> = versions
        .iter()
        .filter(|(_, v)| v == "SOFTRDMA_PRIVATE_1")
        .map(|(s, _)| s.clone())
        .collect();
    private.sort();
    assert_eq!(
        forwarded, private,
        "stubs/rdmacm.c forwards and symbols.txt's SOFTRDMA_PRIVATE_1 lists must match"
    );
    let stub_dir = out.join("rdmacm-link");
    fs::create_dir_all(&stub_dir).expect("create rdmacm-link");
    let stub_map = stub_dir.join("private.map");
    fs::write(
        &stub_map,
        format!(
            "SOFTRDMA_PRIVATE_1 {{ global: {}; local: *; }};\n",
            private.join("; ")
        ),
    )
    .expect("write private.map");
    println!("cargo:rerun-if-changed=stubs/rdmacm.c");
    println!("cargo:rerun-if-changed=stubs/rdmacm.map");
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let run = |what: &str, c: &mut Command| match c.status() {
        Ok(s) if s.success() => true,
        Ok(s) => panic!("{cc} failed building {what}: {s}"),
        Err(e) => {
            println!("cargo:warning=no C compiler ({cc}: {e}): {what} not built");
            false
        }
    };
    let common = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"];
    if !run(
        "the libibverbs.so.1 link stand-in",
        Command::new(&cc)
            .args(common)
            .args(["-DSOFTRDMA_LINK_STUB", "-Wno-unused-parameter"])
            .arg("-Wl,-soname,libibverbs.so.1")
            .arg(format!("-Wl,--version-script={}", stub_map.display()))
            .arg("-o")
            .arg(stub_dir.join("libibverbs.so.1"))
            .arg(dir.join("rdmacm.c")),
    ) {
        return;
    }
    run(
        "librdmacm.so.1",
        Command::new(&cc)
            .args(common)
            .arg("-Wl,-soname,librdmacm.so.1")
            .arg(format!(
                "-Wl,--version-script={}",
                dir.join("rdmacm.map").display()
            ))
            .arg("-Wl,--no-undefined")
            .arg("-o")
            .arg(lib_dir.join("librdmacm.so.1"))
            .arg(dir.join("rdmacm.c"))
            .arg(stub_dir.join("libibverbs.so.1")),
    );
}

fn build_stub(dir: &Path, src: &str, map: &str, soname: &str, lib_dir: &Path) {
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg(format!("-Wl,--version-script={}", dir.join(map).display()))
        .arg("-o")
        .arg(lib_dir.join(soname))
        .arg(dir.join(src))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{cc} failed on stubs/{src}: {s}"),
        Err(e) => println!(
            "cargo:warning=no C compiler ({cc}: {e}): {soname} not built; perftest needs it"
        ),
    }
}
