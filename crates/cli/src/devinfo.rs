//! `softrdma devices` and `softrdma devinfo`: rdma-core's `ibv_devices` and `ibv_devinfo`.
//!
//! The output is byte for byte what rdma-core 44's tools print for the kernel's rxe (golden
//! files in `tests/golden/`, copied from `shared/golden/tool-output/`), including the tabs, the
//! odp/tso/rss sections and the GID list (RoCE v2 GIDs in `inet_ntop` form, RoCE v1 GIDs in the
//! full form). Exit codes follow the tools too: 255 for "IB device 'X' wasn't found" and for an
//! unreadable device list, 4 for a port the device does not have, 1 when a device cannot be
//! opened (its netdev is missing) or for a port number of 0.
//!
//! Rendering ([`render_devices`], [`render_devinfo`]) is pure so the golden tests can feed it a
//! synthetic device; the `run_*` functions do the I/O.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use softrdma_device::attr::{speed_name, vl_name, width_name};
use softrdma_device::gid::GidType;
use softrdma_device::{DeviceInfo, Guid, Registry};

/// Options of `softrdma devinfo` (those of `ibv_devinfo`).
#[derive(Args, Debug)]
pub struct DevinfoArgs {
    /// Use IB device DEV (default: all devices).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    pub ib_dev: Option<String>,
    /// Use port PORT of the device (default: all ports).
    #[arg(short = 'i', long = "ib-port", value_name = "PORT")]
    pub ib_port: Option<u32>,
    /// Print only the device names.
    #[arg(short = 'l', long = "list")]
    pub list: bool,
    /// Print all the attributes of the device(s).
    #[arg(short = 'v', long = "verbose")]
    pub verbose: bool,
}

/// `ibv_devices`: the name and node GUID of every device.
pub fn render_devices(devices: &[(&str, Guid)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "    {:<16}\t   node GUID", "device");
    let _ = writeln!(s, "    {:<16}\t----------------", "------");
    for (name, guid) in devices {
        let _ = writeln!(s, "    {:<16}\t{}", name, guid.hex());
    }
    s
}

/// `ibv_devinfo -l`.
pub fn render_list(names: &[&str]) -> String {
    let mut s = format!("{} HCA{} found:\n", names.len(), if names.len() != 1 { "s" } else { "" });
    for n in names {
        let _ = writeln!(s, "\t{n}");
    }
    s.push('\n');
    s
}

/// `ibv_devinfo [-v] [-i PORT]` for one device. `port` must be a valid port or `None` (all).
pub fn render_devinfo(dev: &DeviceInfo, port: Option<u32>, verbose: bool) -> String {
    let a = &dev.attr;
    let mut s = String::new();
    let _ = writeln!(s, "hca_id:\t{}", dev.name);
    let _ = writeln!(s, "\ttransport:\t\t\t{} ({})", a.transport.name(), a.transport.number());
    let _ = writeln!(s, "\tfw_ver:\t\t\t\t{}", a.fw_ver_string());
    let _ = writeln!(s, "\tnode_guid:\t\t\t{}", a.node_guid);
    let _ = writeln!(s, "\tsys_image_guid:\t\t\t{}", a.sys_image_guid);
    let _ = writeln!(s, "\tvendor_id:\t\t\t0x{:04x}", a.vendor_id);
    let _ = writeln!(s, "\tvendor_part_id:\t\t\t{}", a.vendor_part_id);
    let _ = writeln!(s, "\thw_ver:\t\t\t\t0x{:X}", a.hw_ver);
    let _ = writeln!(s, "\tphys_port_cnt:\t\t\t{}", a.phys_port_cnt);
    if verbose {
        render_device_verbose(&mut s, dev);
    }
    for p in 1..=u32::from(a.phys_port_cnt) {
        if port.is_some_and(|want| want != p) {
            continue;
        }
        render_port(&mut s, dev, p, verbose);
    }
    s
}

fn render_device_verbose(s: &mut String, dev: &DeviceInfo) {
    let a = &dev.attr;
    let _ = writeln!(s, "\tmax_mr_size:\t\t\t0x{:x}", a.max_mr_size);
    let _ = writeln!(s, "\tpage_size_cap:\t\t\t0x{:x}", a.page_size_cap);
    let _ = writeln!(s, "\tmax_qp:\t\t\t\t{}", a.max_qp);
    let _ = writeln!(s, "\tmax_qp_wr:\t\t\t{}", a.max_qp_wr);
    let _ = writeln!(s, "\tdevice_cap_flags:\t\t0x{:08x}", a.device_cap_flags.0);
    for name in a.device_cap_flags.names() {
        let _ = writeln!(s, "\t\t\t\t\t{name}");
    }
    if a.device_cap_flags.unknown() != 0 {
        let _ = writeln!(s, "\t\t\t\t\tUnknown flags: 0x{:X}", a.device_cap_flags.unknown());
    }
    let _ = writeln!(s, "\tmax_sge:\t\t\t{}", a.max_sge);
    let _ = writeln!(s, "\tmax_sge_rd:\t\t\t{}", a.max_sge_rd);
    let _ = writeln!(s, "\tmax_cq:\t\t\t\t{}", a.max_cq);
    let _ = writeln!(s, "\tmax_cqe:\t\t\t{}", a.max_cqe);
    let _ = writeln!(s, "\tmax_mr:\t\t\t\t{}", a.max_mr);
    let _ = writeln!(s, "\tmax_pd:\t\t\t\t{}", a.max_pd);
    let _ = writeln!(s, "\tmax_qp_rd_atom:\t\t\t{}", a.max_qp_rd_atom);
    let _ = writeln!(s, "\tmax_ee_rd_atom:\t\t\t{}", a.max_ee_rd_atom);
    let _ = writeln!(s, "\tmax_res_rd_atom:\t\t{}", a.max_res_rd_atom);
    let _ = writeln!(s, "\tmax_qp_init_rd_atom:\t\t{}", a.max_qp_init_rd_atom);
    let _ = writeln!(s, "\tmax_ee_init_rd_atom:\t\t{}", a.max_ee_init_rd_atom);
    let _ = writeln!(s, "\tatomic_cap:\t\t\t{} ({})", a.atomic_cap.name(), a.atomic_cap.number());
    let _ = writeln!(s, "\tmax_ee:\t\t\t\t{}", a.max_ee);
    let _ = writeln!(s, "\tmax_rdd:\t\t\t{}", a.max_rdd);
    let _ = writeln!(s, "\tmax_mw:\t\t\t\t{}", a.max_mw);
    let _ = writeln!(s, "\tmax_raw_ipv6_qp:\t\t{}", a.max_raw_ipv6_qp);
    let _ = writeln!(s, "\tmax_raw_ethy_qp:\t\t{}", a.max_raw_ethy_qp);
    let _ = writeln!(s, "\tmax_mcast_grp:\t\t\t{}", a.max_mcast_grp);
    let _ = writeln!(s, "\tmax_mcast_qp_attach:\t\t{}", a.max_mcast_qp_attach);
    let _ = writeln!(s, "\tmax_total_mcast_qp_attach:\t{}", a.max_total_mcast_qp_attach);
    let _ = writeln!(s, "\tmax_ah:\t\t\t\t{}", a.max_ah);
    let _ = writeln!(s, "\tmax_fmr:\t\t\t{}", a.max_fmr);
    if a.max_fmr != 0 {
        let _ = writeln!(s, "\tmax_map_per_fmr:\t\t{}", a.max_map_per_fmr);
    }
    let _ = writeln!(s, "\tmax_srq:\t\t\t{}", a.max_srq);
    if a.max_srq != 0 {
        let _ = writeln!(s, "\tmax_srq_wr:\t\t\t{}", a.max_srq_wr);
        let _ = writeln!(s, "\tmax_srq_sge:\t\t\t{}", a.max_srq_sge);
    }
    let _ = writeln!(s, "\tmax_pkeys:\t\t\t{}", a.max_pkeys);
    let _ = writeln!(s, "\tlocal_ca_ack_delay:\t\t{}", a.local_ca_ack_delay);
    // No on-demand paging, timestamps, TSO, RSS, packet pacing or tag matching: the sections
    // are printed empty, as for rxe.
    s.push_str("\tgeneral_odp_caps:\n");
    for t in ["rc", "uc", "ud", "xrc"] {
        let _ = writeln!(s, "\t{t}_odp_caps:\n\t\t\t\t\tNO SUPPORT");
    }
    s.push_str("\tcompletion_timestamp_mask not supported\n");
    s.push_str("\tcore clock not supported\n");
    let _ = writeln!(s, "\tdevice_cap_flags_ex:\t\t0x{:X}", a.device_cap_flags_ex);
    s.push_str("\ttso_caps:\n\t\tmax_tso:\t\t\t0\n");
    s.push_str("\trss_caps:\n");
    s.push_str("\t\tmax_rwq_indirection_tables:\t\t\t0\n");
    s.push_str("\t\tmax_rwq_indirection_table_size:\t\t\t0\n");
    s.push_str("\t\trx_hash_function:\t\t\t\t0x0\n");
    s.push_str("\t\trx_hash_fields_mask:\t\t\t\t0x0\n");
    s.push_str("\tmax_wq_type_rq:\t\t\t0\n");
    s.push_str("\tpacket_pacing_caps:\n");
    s.push_str("\t\tqp_rate_limit_min:\t0kbps\n");
    s.push_str("\t\tqp_rate_limit_max:\t0kbps\n");
    s.push_str("\ttag matching not supported\n");
    let _ = writeln!(s, "\tnum_comp_vectors:\t\t{}", a.num_comp_vectors);
}

fn render_port(s: &mut String, dev: &DeviceInfo, port: u32, verbose: bool) {
    let p = &dev.port;
    let _ = writeln!(s, "\t\tport:\t{port}");
    let _ = writeln!(s, "\t\t\tstate:\t\t\t{} ({})", p.state.name(), p.state.number());
    let _ = writeln!(s, "\t\t\tmax_mtu:\t\t{} ({})", p.max_mtu, p.max_mtu.ib_enum());
    let _ = writeln!(s, "\t\t\tactive_mtu:\t\t{} ({})", p.active_mtu, p.active_mtu.ib_enum());
    let _ = writeln!(s, "\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
    let _ = writeln!(s, "\t\t\tport_lid:\t\t{}", p.lid);
    let _ = writeln!(s, "\t\t\tport_lmc:\t\t0x{:02x}", p.lmc);
    let _ = writeln!(s, "\t\t\tlink_layer:\t\t{}", p.link_layer.name());
    if verbose {
        let _ = writeln!(s, "\t\t\tmax_msg_sz:\t\t0x{:x}", p.max_msg_sz);
        let _ = writeln!(s, "\t\t\tport_cap_flags:\t\t0x{:08x}", p.port_cap_flags);
        let _ = writeln!(s, "\t\t\tport_cap_flags2:\t0x{:04x}", p.port_cap_flags2);
        let _ = writeln!(s, "\t\t\tmax_vl_num:\t\t{} ({})", vl_name(p.max_vl_num), p.max_vl_num);
        let _ = writeln!(s, "\t\t\tbad_pkey_cntr:\t\t0x{:x}", p.bad_pkey_cntr);
        let _ = writeln!(s, "\t\t\tqkey_viol_cntr:\t\t0x{:x}", p.qkey_viol_cntr);
        let _ = writeln!(s, "\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
        let _ = writeln!(s, "\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
        let _ = writeln!(s, "\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
        let _ = writeln!(s, "\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
        let _ = writeln!(s, "\t\t\tinit_type_reply:\t{}", p.init_type_reply);
        let _ = writeln!(s, "\t\t\tactive_width:\t\t{}X ({})", width_name(p.active_width), p.active_width);
        let _ = writeln!(s, "\t\t\tactive_speed:\t\t{} ({})", speed_name(p.active_speed), p.active_speed);
        let _ = writeln!(s, "\t\t\tphys_state:\t\t{} ({})", p.phys_state.name(), p.phys_state.number());
        for (i, e) in dev.gids.iter() {
            // ibv_devinfo skips GIDs whose interface id is zero (`null_gid`).
            if e.gid.is_null_interface_id() {
                continue;
            }
            let _ = match e.gid_type {
                GidType::RoceV2 => writeln!(s, "\t\t\tGID[{i:3}]:\t\t{}, {}", e.gid, e.gid_type.devinfo_name()),
                _ => writeln!(s, "\t\t\tGID[{i:3}]:\t\t{}, {}", e.gid.full(), e.gid_type.devinfo_name()),
            };
        }
    }
    s.push('\n');
}

/// The devices the tools show: softrdmad's when a daemon answers, otherwise the registry's;
/// prints the error the way the tools do when the list cannot be had.
pub(crate) fn load_registry() -> Result<Registry, ExitCode> {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("Failed to get IB devices list: {e}");
        ExitCode::from(255)
    };
    if let Some(admin) = softrdma_verbs::daemon::admin::Admin::connect() {
        let mut reg = Registry::empty();
        for e in admin.devices().map_err(|e| fail(&e))? {
            if e.netdev.is_some() {
                reg.add(e.config).map_err(|e| fail(&e))?;
            }
        }
        return Ok(reg);
    }
    Registry::load().map_err(|e| fail(&e))
}

/// Opens every configured device; a device whose netdev is missing is reported and skipped.
fn open_all(registry: &Registry) -> Vec<DeviceInfo> {
    registry
        .devices()
        .iter()
        .filter_map(|c| match DeviceInfo::open(c) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("softrdma: skipping device {}: {e}", c.name);
                None
            }
        })
        .collect()
}

/// `softrdma devices`.
pub fn run_devices() -> ExitCode {
    let registry = match load_registry() {
        Ok(r) => r,
        Err(code) => return code,
    };
    let devs = open_all(&registry);
    let rows: Vec<(&str, Guid)> = devs.iter().map(|d| (d.name.as_str(), d.node_guid())).collect();
    print!("{}", render_devices(&rows));
    ExitCode::SUCCESS
}

/// `softrdma devinfo`.
pub fn run_devinfo(args: DevinfoArgs) -> ExitCode {
    if args.ib_port == Some(0) {
        eprintln!("softrdma devinfo: invalid port 0: ports are numbered from 1");
        return ExitCode::from(1);
    }
    let registry = match load_registry() {
        Ok(r) => r,
        Err(code) => return code,
    };
    if args.list {
        let names: Vec<&str> = registry.devices().iter().map(|d| d.name.as_str()).collect();
        print!("{}", render_list(&names));
        return ExitCode::SUCCESS;
    }
    let configs = match &args.ib_dev {
        Some(name) => match registry.find(name) {
            Ok(c) => vec![c.clone()],
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(255);
            }
        },
        None if registry.devices().is_empty() => {
            eprintln!("No IB devices found");
            return ExitCode::from(255);
        }
        None => registry.devices().to_vec(),
    };
    let mut rc = 0u8;
    for config in &configs {
        let dev = match DeviceInfo::open(config) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("Failed to open device {}: {e}", config.name);
                rc |= 1;
                continue;
            }
        };
        if let Some(p) = args.ib_port {
            if let Err(e) = dev.check_port(p) {
                eprintln!("Invalid port requested for device: {e}");
                rc |= 4;
                continue;
            }
        }
        print!("{}", render_devinfo(&dev, args.ib_port, args.verbose));
    }
    ExitCode::from(rc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_device::attr::DeviceAttr;
    use softrdma_device::netdev::golden_eth0;
    use softrdma_device::DeviceConfig;

    const GOLDEN_DEVICES: &str = include_str!("../tests/golden/03-ibv_devices.txt");
    const GOLDEN_DEVINFO: &str = include_str!("../tests/golden/04-ibv_devinfo-v-rxe0.txt");

    /// The golden file without the harness lines: the `$ command` line first and the
    /// `[rc=0]` line last. Nothing else is excluded.
    fn tool_output(golden: &str) -> String {
        let mut lines: Vec<&str> = golden.lines().collect();
        assert!(lines[0].starts_with("$ "));
        assert_eq!(lines.pop(), Some("[rc=0]"));
        lines.remove(0);
        lines.iter().map(|l| format!("{l}\n")).collect()
    }

    fn golden_rxe0(attr: fn(Guid) -> DeviceAttr) -> DeviceInfo {
        let mut d = DeviceInfo::with_attr(&DeviceConfig::new("rxe0", "eth0"), golden_eth0(), attr).unwrap();
        // rxe reports one completion vector per CPU; the golden VM had 2.
        d.attr.num_comp_vectors = 2;
        d
    }

    fn assert_same_lines(got: &str, want: &str) {
        for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
            assert_eq!(g, w, "line {}", i + 1);
        }
        assert_eq!(got.lines().count(), want.lines().count());
        assert_eq!(got, want);
    }

    #[test]
    fn devices_matches_golden() {
        let rows = [("rxe0", Guid(0x5054_00ff_fe77_0902)), ("siw0", Guid(0xc8be_60ff_fec4_ae32))];
        assert_same_lines(&render_devices(&rows), &tool_output(GOLDEN_DEVICES));
    }

    #[test]
    fn devinfo_verbose_matches_golden_for_rxe_model() {
        let got = render_devinfo(&golden_rxe0(DeviceAttr::rxe), None, true);
        assert_same_lines(&got, &tool_output(GOLDEN_DEVINFO));
        // -i 1 selects the only port: same text.
        assert_eq!(render_devinfo(&golden_rxe0(DeviceAttr::rxe), Some(1), true), got);
    }

    #[test]
    fn devinfo_verbose_for_softrdma_differs_only_as_documented() {
        let got = render_devinfo(&golden_rxe0(DeviceAttr::softrdma), None, true);
        let want = tool_output(GOLDEN_DEVINFO);
        let got_lines: Vec<&str> = got.lines().collect();
        let missing: Vec<&str> = want.lines().filter(|l| !got_lines.contains(l)).collect();
        let extra: Vec<&str> = got.lines().filter(|l| !want.lines().any(|w| w == *l)).collect();
        // softrdma has no memory windows (attr module docs).
        assert_eq!(
            missing,
            [
                "\tdevice_cap_flags:\t\t0x01223c76",
                "\t\t\t\t\tMEM_WINDOW",
                "\t\t\t\t\tMEM_WINDOW_TYPE_2B",
                "\tmax_mw:\t\t\t\t524287",
                "\tdevice_cap_flags_ex:\t\t0x1223C76",
            ]
        );
        assert_eq!(
            extra,
            ["\tdevice_cap_flags:\t\t0x00203c76", "\tmax_mw:\t\t\t\t0", "\tdevice_cap_flags_ex:\t\t0x203C76",]
        );
    }

    #[test]
    fn devinfo_short_form() {
        // Non-verbose ibv_devinfo: the device header lines and the short port block.
        let want = "hca_id:\trxe0\n\
            \ttransport:\t\t\tInfiniBand (0)\n\
            \tfw_ver:\t\t\t\t0.0.0\n\
            \tnode_guid:\t\t\t5054:00ff:fe77:0902\n\
            \tsys_image_guid:\t\t\t5054:00ff:fe77:0902\n\
            \tvendor_id:\t\t\t0xffffff\n\
            \tvendor_part_id:\t\t\t0\n\
            \thw_ver:\t\t\t\t0x0\n\
            \tphys_port_cnt:\t\t\t1\n\
            \t\tport:\t1\n\
            \t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\
            \t\t\tmax_mtu:\t\t4096 (5)\n\
            \t\t\tactive_mtu:\t\t1024 (3)\n\
            \t\t\tsm_lid:\t\t\t0\n\
            \t\t\tport_lid:\t\t0\n\
            \t\t\tport_lmc:\t\t0x00\n\
            \t\t\tlink_layer:\t\tEthernet\n\
            \n";
        let got = render_devinfo(&golden_rxe0(DeviceAttr::softrdma), None, false);
        assert_same_lines(&got, want);
        // Every line of the short form is also in the verbose golden output.
        let golden = tool_output(GOLDEN_DEVINFO);
        for l in got.lines().filter(|l| !l.is_empty()) {
            assert!(golden.lines().any(|g| g == l), "{l:?}");
        }
    }

    #[test]
    fn devinfo_port_filter_and_list() {
        let d = golden_rxe0(DeviceAttr::softrdma);
        // A port the device does not have prints no port block (run_devinfo rejects it first).
        assert!(!render_devinfo(&d, Some(2), false).contains("\t\tport:\t"));
        assert!(render_devinfo(&d, Some(1), false).contains("\t\tport:\t1\n"));
        assert_eq!(render_list(&["rxe0"]), "1 HCA found:\n\trxe0\n\n");
        assert_eq!(render_list(&["a", "b"]), "2 HCAs found:\n\ta\n\tb\n\n");
        assert_eq!(render_list(&[]), "0 HCAs found:\n\n");
    }

    #[test]
    fn devinfo_roce_v1_gids_use_full_form() {
        use softrdma_device::gid::{GidEntry, GidTable};
        let mut d = golden_rxe0(DeviceAttr::rxe);
        let gid = |s: &str| s.parse().unwrap();
        d.gids = GidTable::from_entries([
            GidEntry { gid: gid("fe80::5054:ff:fe77:902"), gid_type: GidType::IbRoceV1 },
            GidEntry { gid: gid("fe80::"), gid_type: GidType::RoceV2 },
        ]);
        let got = render_devinfo(&d, None, true);
        assert!(got.contains("\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:5054:00ff:fe77:0902, RoCE v1\n"));
        // Null interface id: skipped, as ibv_devinfo does.
        assert!(!got.contains("GID[  1]"));
    }
}
