//! `softrdma daemon` (also run as `softrdmad`) and the commands that manage its devices like
//! rdma-core's tools: `link show|add|delete`, `dev set NAME name NEWNAME`, `roce-mode`, `stat`.
//!
//! With a daemon running, management commands go to it (it applies and persists them); without
//! one, `link add/delete`, `dev set` and `roce-mode` edit the configuration file the daemon reads
//! when it starts, and `link show`/`stat` describe the configured devices.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use softrdma_device::attr::PortAttr;
use softrdma_device::netdev::{self, Netdev};
use softrdma_device::registry::{config_path, Registry};
use softrdma_device::{DeviceConfig, DeviceInfo};
use softrdma_verbs::daemon::admin::{Admin, DaemonDevice, DaemonStats};
use softrdma_verbs::daemon::server::{self, DaemonOptions};

/// Options of `softrdma daemon`.
#[derive(Args, Debug, Default)]
pub struct DaemonArgs {
    /// Control socket (default: $SOFTRDMA_SOCKET, /run/softrdma/softrdmad.sock for root,
    /// $XDG_RUNTIME_DIR/softrdma/softrdmad.sock otherwise).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Device configuration file (default: $SOFTRDMA_CONFIG, /etc/softrdma/devices.conf for root,
    /// $XDG_CONFIG_HOME/softrdma/devices.conf otherwise).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// UDP port of the devices (default: $SOFTRDMA_UDP_PORT or 4791).
    #[arg(long, value_name = "PORT")]
    pub udp_port: Option<u16>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9471).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Map no client memory: every region is reached with process_vm_readv/writev (one system call
    /// per access), as for memory the C library's ibv_reg_mr registers.
    #[arg(long)]
    pub no_shared_regions: bool,
}

/// `softrdma link …`.
#[derive(Subcommand, Debug)]
pub enum LinkCommand {
    /// Show links (`rdma link show [DEV]`).
    Show {
        /// Device (DEV or DEV/PORT).
        name: Option<String>,
    },
    /// Add a soft RoCE device: `link add NAME type rxe netdev IFACE [addr IP]`.
    Add {
        /// Device name.
        name: String,
        /// `type rxe netdev IFACE [addr IP]`.
        #[arg(num_args = 0.., trailing_var_arg = true)]
        rest: Vec<String>,
    },
    /// Delete a device: `link delete NAME`.
    #[command(alias = "del")]
    Delete {
        /// Device name.
        name: String,
    },
}

/// `softrdma dev …`.
#[derive(Subcommand, Debug)]
pub enum DevCommand {
    /// Rename a device: `dev set NAME name NEWNAME`.
    Set {
        /// Device name.
        name: String,
        /// `name NEWNAME`.
        #[arg(num_args = 2)]
        rest: Vec<String>,
    },
}

/// Options of `softrdma roce-mode`.
#[derive(Args, Debug)]
pub struct RoceModeArgs {
    /// Device.
    pub name: String,
    /// Port (1).
    pub port: u8,
    /// `v1` or `v2`; without it, print the current mode.
    pub mode: Option<String>,
}

/// Options of `softrdma stat`.
#[derive(Args, Debug)]
pub struct StatArgs {
    /// Device (default: all).
    pub name: Option<String>,
    /// Port (default: all).
    pub port: Option<u32>,
    /// Show counters (device and per QP) instead of the port state.
    #[arg(long)]
    pub counters: bool,
    /// With --counters: Prometheus text.
    #[arg(long, requires = "counters")]
    pub prometheus: bool,
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("softrdma: {msg}");
    ExitCode::FAILURE
}

/// `softrdma daemon`.
pub fn run_daemon(args: DaemonArgs) -> ExitCode {
    let mut opts = DaemonOptions::from_env();
    if let Some(s) = args.socket {
        opts.socket = s;
    }
    if let Some(c) = args.config {
        opts.config = c;
    }
    if let Some(p) = args.udp_port {
        opts.udp_port = p;
    }
    opts.metrics = args.metrics;
    opts.shared_regions = !args.no_shared_regions;
    match server::run(opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// One line of `rdma link show` (with its trailing blank, as iproute2 prints it).
pub fn render_link(name: &str, netdev_name: &str, nd: Option<&Netdev>) -> String {
    let (state, phys) = match nd {
        Some(n) => {
            let p = PortAttr::for_netdev(n);
            (p.state.name().trim_start_matches("PORT_").to_string(), p.phys_state.name().to_string())
        }
        None => ("DOWN".to_string(), "DISABLED".to_string()),
    };
    format!("link {name}/1 state {state} physical_state {phys} netdev {netdev_name} \n")
}

fn local_entries() -> Result<Vec<DaemonDevice>, String> {
    let reg = Registry::load().map_err(|e| e.to_string())?;
    Ok(reg
        .devices()
        .iter()
        .map(|c| DaemonDevice {
            config: c.clone(),
            roce_v1: reg.roce_v1(&c.name),
            netdev: netdev::by_name(&c.netdev).ok(),
            udp_port: 0,
        })
        .collect())
}

fn entries() -> Result<Vec<DaemonDevice>, String> {
    match Admin::connect() {
        Some(a) => a.devices().map_err(|e| e.to_string()),
        None => local_entries(),
    }
}

/// Edit the configuration file (no daemon running).
fn edit_registry(f: impl FnOnce(&mut Registry) -> Result<(), String>) -> Result<(), String> {
    let path = config_path();
    let mut reg = Registry::load_from(&path).map_err(|e| e.to_string())?;
    f(&mut reg)?;
    reg.save(&path).map_err(|e| e.to_string())
}

/// `softrdma link …`.
pub fn run_link(cmd: Option<LinkCommand>) -> ExitCode {
    match cmd.unwrap_or(LinkCommand::Show { name: None }) {
        LinkCommand::Show { name } => {
            let list = match entries() {
                Ok(l) => l,
                Err(e) => return fail(e),
            };
            let want = name.as_deref().map(|n| n.split('/').next().unwrap_or(n));
            let mut out = String::new();
            for e in &list {
                if want.is_some_and(|w| w != e.config.name) {
                    continue;
                }
                out.push_str(&render_link(&e.config.name, &e.config.netdev, e.netdev.as_ref()));
            }
            if let (Some(w), true) = (want, out.is_empty()) {
                return fail(format!("Wrong device name {w}"));
            }
            print!("{out}");
            ExitCode::SUCCESS
        }
        LinkCommand::Add { name, rest } => {
            let words: Vec<&str> = rest.iter().map(String::as_str).collect();
            let (netdev, addr) = match parse_link_add(&words) {
                Ok(x) => x,
                Err(e) => return fail(e),
            };
            let r = match Admin::connect() {
                Some(a) => a.link_add(&name, &netdev, addr).map_err(|e| e.to_string()),
                None => edit_registry(|reg| {
                    let mut c = DeviceConfig::new(&name, &netdev);
                    if let Some(a) = addr {
                        c = c.with_addr(a);
                    }
                    DeviceInfo::open(&c).map_err(|e| e.to_string())?;
                    reg.add(c).map_err(|e| e.to_string())
                }),
            };
            r.map_or_else(fail, |_| ExitCode::SUCCESS)
        }
        LinkCommand::Delete { name } => {
            let r = match Admin::connect() {
                Some(a) => a.link_delete(&name).map_err(|e| e.to_string()),
                None => edit_registry(|reg| reg.remove(&name).map(|_| ()).map_err(|e| e.to_string())),
            };
            r.map_or_else(fail, |_| ExitCode::SUCCESS)
        }
    }
}

/// `type rxe netdev IFACE [addr IP]`.
fn parse_link_add(words: &[&str]) -> Result<(String, Option<IpAddr>), String> {
    let mut ty = None;
    let mut netdev = None;
    let mut addr = None;
    let mut it = words.iter();
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("\"{k}\" needs a value"))?;
        match *k {
            "type" => ty = Some(*v),
            "netdev" => netdev = Some(v.to_string()),
            "addr" => addr = Some(v.parse::<IpAddr>().map_err(|_| format!("invalid address {v:?}"))?),
            _ => return Err(format!("unknown keyword {k:?} (link add NAME type rxe netdev IFACE [addr IP])")),
        }
    }
    match ty {
        Some("rxe") => {}
        Some(t) => return Err(format!("link type {t:?} is not supported (only rxe)")),
        None => return Err("link add NAME type rxe netdev IFACE: the type is missing".into()),
    }
    Ok((netdev.ok_or("link add NAME type rxe netdev IFACE: the netdev is missing")?, addr))
}

/// `softrdma dev set NAME name NEWNAME`.
pub fn run_dev(cmd: DevCommand) -> ExitCode {
    let DevCommand::Set { name, rest } = cmd;
    if rest.len() != 2 || rest[0] != "name" {
        return fail("usage: softrdma dev set NAME name NEWNAME");
    }
    let new_name = &rest[1];
    let r = match Admin::connect() {
        Some(a) => a.rename(&name, new_name).map_err(|e| e.to_string()),
        None => edit_registry(|reg| reg.rename(&name, new_name).map_err(|e| e.to_string())),
    };
    r.map_or_else(fail, |_| ExitCode::SUCCESS)
}

/// `softrdma roce-mode NAME PORT [v1|v2]`.
pub fn run_roce_mode(args: RoceModeArgs) -> ExitCode {
    let v1 = match args.mode.as_deref() {
        None => {
            let list = match entries() {
                Ok(l) => l,
                Err(e) => return fail(e),
            };
            return match list.iter().find(|e| e.config.name == args.name) {
                Some(_) if args.port != 1 => fail(format!("device {} has one port (1)", args.name)),
                Some(e) => {
                    println!("{}", if e.roce_v1 { "IB/RoCE v1" } else { "RoCE v2" });
                    ExitCode::SUCCESS
                }
                None => fail(format!("IB device '{}' wasn't found", args.name)),
            };
        }
        Some("v1") => true,
        Some("v2") => false,
        Some(m) => return fail(format!("invalid RoCE mode {m:?}: v1 or v2")),
    };
    let r = match Admin::connect() {
        Some(a) => a.roce_mode(&args.name, args.port, v1).map_err(|e| e.to_string()),
        None if args.port != 1 => Err(format!("device {} has one port (1)", args.name)),
        None => edit_registry(|reg| reg.set_roce_v1(&args.name, v1).map_err(|e| e.to_string())),
    };
    r.map_or_else(fail, |_| ExitCode::SUCCESS)
}

/// `ibstat` for one device.
pub fn render_ibstat(dev: &DeviceInfo, port: Option<u32>) -> String {
    let mut s = String::new();
    let guid = format!("0x{}", dev.node_guid().hex());
    let _ = writeln!(s, "CA '{}'", dev.name);
    let _ = writeln!(s, "\tCA type: ");
    let _ = writeln!(s, "\tNumber of ports: {}", dev.attr.phys_port_cnt);
    let _ = writeln!(s, "\tFirmware version: ");
    let _ = writeln!(s, "\tHardware version: ");
    let _ = writeln!(s, "\tNode GUID: {guid}");
    let _ = writeln!(s, "\tSystem image GUID: 0x{}", dev.attr.sys_image_guid.hex());
    for p in 1..=u32::from(dev.attr.phys_port_cnt) {
        if port.is_some_and(|w| w != p) {
            continue;
        }
        let a = &dev.port;
        let state = match a.state.name() {
            "PORT_ACTIVE" => "Active",
            "PORT_INIT" => "Initializing",
            "PORT_ARMED" => "Armed",
            _ => "Down",
        };
        let phys = match a.phys_state.name() {
            "LINK_UP" => "LinkUp",
            "POLLING" => "Polling",
            "DISABLED" => "Disabled",
            "SLEEP" => "Sleep",
            _ => "Disabled",
        };
        let _ = writeln!(s, "\tPort {p}:");
        let _ = writeln!(s, "\t\tState: {state}");
        let _ = writeln!(s, "\t\tPhysical state: {phys}");
        let _ = writeln!(s, "\t\tRate: {}", rate(a.active_width, a.active_speed));
        let _ = writeln!(s, "\t\tBase lid: {}", a.lid);
        let _ = writeln!(s, "\t\tLMC: {}", a.lmc);
        let _ = writeln!(s, "\t\tSM lid: {}", a.sm_lid);
        let _ = writeln!(s, "\t\tCapability mask: 0x{:08x}", a.port_cap_flags);
        let _ = writeln!(s, "\t\tPort GUID: {guid}");
        let _ = writeln!(s, "\t\tLink layer: Ethernet");
    }
    s
}

/// `ibstat`'s rate: lanes × per-lane speed in Gb/s.
fn rate(width: u8, speed: u8) -> String {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => 0.0,
    };
    let per = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => 0.0,
    };
    let r: f64 = lanes * per;
    if r.fract() == 0.0 {
        format!("{}", r as u64)
    } else {
        format!("{r}")
    }
}

/// Counters as `rdma statistic show` prints them, then one line per QP.
pub fn render_counters(stats: &[DaemonStats]) -> String {
    let mut s = String::new();
    for d in stats {
        let _ = write!(s, "link {}/1", d.name);
        for (k, v) in &d.counters {
            let _ = write!(s, " {k} {v}");
        }
        s.push_str(" \n");
        for (qpn, pid, c) in &d.qps {
            let _ = write!(s, "qp {}/1 lqpn {qpn} pid {pid}", d.name);
            for (k, v) in c {
                let _ = write!(s, " {k} {v}");
            }
            s.push_str(" \n");
        }
    }
    s
}

/// `softrdma stat [DEV [PORT]] [--counters [--prometheus]]`.
pub fn run_stat(args: StatArgs) -> ExitCode {
    if args.counters {
        let Some(a) = Admin::connect() else {
            return fail("no softrdmad answers: counters are kept by the daemon (start it with `softrdma daemon`)");
        };
        return match a.stats(args.name.as_deref()) {
            Ok(s) if args.prometheus => {
                print!("{}", softrdma_verbs::daemon::admin::prometheus(&s));
                ExitCode::SUCCESS
            }
            Ok(s) => {
                print!("{}", render_counters(&s));
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    let list = match entries() {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let mut shown = 0;
    for e in &list {
        if args.name.as_deref().is_some_and(|n| n != e.config.name) {
            continue;
        }
        let Some(nd) = e.netdev.clone() else { continue };
        match DeviceInfo::new(&e.config, nd) {
            Ok(d) => {
                if args.port.is_some_and(|p| d.check_port(p).is_err()) {
                    return fail(format!("'{}' port {} not found", e.config.name, args.port.unwrap_or(0)));
                }
                print!("{}", render_ibstat(&d, args.port));
                shown += 1;
            }
            Err(err) => eprintln!("softrdma: {}: {err}", e.config.name),
        }
    }
    match (&args.name, shown) {
        (Some(n), 0) => fail(format!("'{n}' IB device can't be found")),
        _ => ExitCode::SUCCESS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_device::netdev::{IfAddr, IfFlags, MacAddr};

    const GOLDEN_IBSTAT: &str = include_str!("../tests/golden/06-ibstat.txt");

    fn eth0(up: bool) -> Netdev {
        Netdev {
            index: 2,
            name: "eth0".into(),
            flags: IfFlags { up, running: up, lower_up: up, loopback: false },
            mtu: 1500,
            mac: Some(MacAddr([0x52, 0x54, 0x00, 0x77, 0x09, 0x02])),
            addrs: vec![IfAddr::new("10.77.9.2".parse().unwrap(), 24)],
            speed_mbps: None,
        }
    }

    #[test]
    fn link_show_line_matches_iproute2() {
        assert_eq!(
            render_link("rxe0", "eth0", Some(&eth0(true))),
            "link rxe0/1 state ACTIVE physical_state LINK_UP netdev eth0 \n"
        );
        let down = render_link("rxe0", "eth0", Some(&eth0(false)));
        assert!(down.starts_with("link rxe0/1 state DOWN physical_state "), "{down}");
    }

    #[test]
    fn ibstat_matches_golden() {
        let dev =
            DeviceInfo::with_attr(&DeviceConfig::new("rxe0", "eth0"), eth0(true), softrdma_device::DeviceAttr::rxe)
                .unwrap();
        let want: String =
            GOLDEN_IBSTAT.lines().skip(1).filter(|l| !l.starts_with("[rc=")).map(|l| format!("{l}\n")).collect();
        assert_eq!(render_ibstat(&dev, None), want);
    }

    #[test]
    fn link_add_words() {
        assert_eq!(parse_link_add(&["type", "rxe", "netdev", "lo"]).unwrap(), ("lo".into(), None));
        assert!(parse_link_add(&["type", "siw", "netdev", "lo"]).is_err());
        assert!(parse_link_add(&["netdev", "lo"]).is_err());
        assert!(parse_link_add(&["type", "rxe"]).is_err());
    }
}
