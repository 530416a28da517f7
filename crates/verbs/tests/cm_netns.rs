//! ROUTE_ERROR and ADDR_ERROR when the device's port goes down or its address leaves the netdev:
//! a device on one end of a veth pair inside a network namespace the test creates (no traffic leaves
//! it). The runtime follows the netdev (link and addresses) as rxe does; the CM then refuses
//! routes with the kernel's statuses.
//!
//! Opening the device inside the namespace: a short-lived thread enters it with
//! `setns(CLONE_NEWNET)` and a private mount namespace with the namespace's own sysfs, as
//! `tests/netns_impairment.rs` does. Without root or `ip` the test prints `skipped: <reason>`;
//! with `SOFTRDMA_TEST_STRICT=1` it fails instead.

mod common;

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::sh;
use softrdma_verbs::{cm_status, AsyncEvent, CmEventChannel, CmEventKind, Context, DeviceBuilder, PortSpace};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.0]);
    }
}

fn enter(ns: &str) -> Result<(), String> {
    let path = format!("/var/run/netns/{ns}");
    let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    let c = |s: &str| CString::new(s).unwrap();
    // SAFETY: plain system calls on a valid descriptor and NUL-terminated strings; they change only
    // this thread's network and (new, private) mount namespaces.
    unsafe {
        if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
            return Err(err("setns"));
        }
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(err("unshare(CLONE_NEWNS)"));
        }
        let flags = libc::MS_REC | libc::MS_SLAVE;
        if libc::mount(c("none").as_ptr(), c("/").as_ptr(), std::ptr::null(), flags, std::ptr::null()) != 0 {
            return Err(err("making / a slave mount"));
        }
        libc::umount2(c("/sys").as_ptr(), libc::MNT_DETACH);
        if libc::mount(c("sysfs").as_ptr(), c("/sys").as_ptr(), c("sysfs").as_ptr(), 0, std::ptr::null()) != 0 {
            return Err(err("mounting sysfs"));
        }
    }
    Ok(())
}

fn setup() -> Result<(Netns, Context, Ipv4Addr), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("network namespaces need root".into());
    }
    sh(&["ip", "-V"]).map_err(|_| "`ip` is not installed (iproute2)".to_string())?;
    let ns = Netns(format!("srdma-cm-{}", std::process::id()));
    sh(&["ip", "netns", "add", &ns.0])?;
    let ip = Ipv4Addr::new(10, 203, (std::process::id() % 250) as u8, 1);
    let cidr = format!("{ip}/24");
    for cmd in [
        &["link", "add", "cm0", "type", "veth", "peer", "name", "cm1"][..],
        &["addr", "add", &cidr, "dev", "cm0"],
        &["link", "set", "cm1", "up"],
        &["link", "set", "cm0", "up"],
        &["link", "set", "lo", "up"],
    ] {
        sh(&[&["ip", "-n", &ns.0][..], cmd].concat())?;
    }
    let name = ns.0.clone();
    let ctx = std::thread::spawn(move || -> Result<Context, String> {
        enter(&name)?;
        DeviceBuilder::new("cmns0", "cm0").addr(IpAddr::V4(ip)).open().map_err(|e| e.to_string())
    })
    .join()
    .expect("namespace thread")?;
    Ok((ns, ctx, ip))
}

fn wait_port(ctx: &Context, want: AsyncEvent) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if ctx.get_async_event(Duration::from_millis(100)) == Some(want) {
            return;
        }
    }
    panic!("no {want:?}");
}

#[test]
fn route_and_addr_errors_follow_the_port_and_its_addresses() {
    let (ns, ctx, ip) = match setup() {
        Ok(s) => s,
        Err(reason) => {
            assert!(std::env::var_os("SOFTRDMA_TEST_STRICT").is_none_or(|v| v != "1"), "{reason}");
            eprintln!("skipped: {reason}");
            return;
        }
    };
    let n = |args: &[&str]| sh(&[&["ip", "-n", &ns.0][..], args].concat()).unwrap();
    let ch = CmEventChannel::new().unwrap();
    let expect = |kind: CmEventKind| {
        let ev = ch.get_event(&ctx, WAIT).unwrap_or_else(|| panic!("no event, expected {kind:?}"));
        assert_eq!(ev.kind, kind, "{ev:?}");
    };
    let dst = SocketAddr::new(IpAddr::V4(ip), 7471);
    let id = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    id.resolve_addr(None, dst).unwrap();
    expect(CmEventKind::AddrResolved);
    // The port goes down between address and route resolution: ROUTE_ERROR -ENETUNREACH, and the
    // ID stays address-resolved.
    n(&["link", "set", "cm0", "down"]);
    wait_port(&ctx, AsyncEvent::PortError(1));
    id.resolve_route().unwrap();
    expect(CmEventKind::RouteError { status: cm_status::ENETUNREACH });
    // A new resolution while it is down: ADDR_ERROR -ENETUNREACH.
    let id2 = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    id2.resolve_addr(None, dst).unwrap();
    expect(CmEventKind::AddrError { status: cm_status::ENETUNREACH });
    n(&["link", "set", "cm0", "up"]);
    wait_port(&ctx, AsyncEvent::PortActive(1));
    // The address (the device's GID) leaves the netdev: ROUTE_ERROR -ENODEV.
    n(&["addr", "del", &format!("{ip}/24"), "dev", "cm0"]);
    std::thread::sleep(Duration::from_millis(800));
    id.resolve_route().unwrap();
    expect(CmEventKind::RouteError { status: cm_status::ENODEV });
    // Back again: the route resolves.
    n(&["addr", "add", &format!("{ip}/24"), "dev", "cm0"]);
    std::thread::sleep(Duration::from_millis(800));
    id.resolve_route().unwrap();
    expect(CmEventKind::RouteResolved);
}
