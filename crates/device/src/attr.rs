//! Device and port attributes: what `ibv_query_device` / `ibv_query_port` report.
//!
//! This module owns the attribute structs ([`DeviceAttr`], [`PortAttr`]), the small enums and
//! flag sets that appear in them ([`Mtu`], [`PortState`], [`PhysState`], [`LinkLayer`],
//! [`AtomicCap`], [`Transport`], [`DeviceCapFlags`]) with the names rdma-core's `ibv_devinfo`
//! prints, and the rules that derive port attributes from a netdev (active MTU, state, speed).
//!
//! # Values
//!
//! [`DeviceAttr::rxe`] is the kernel's rxe as captured from Linux 6.1
//! (`shared/golden/tool-output/04-ibv_devinfo-v-rxe0.txt`). [`DeviceAttr::softrdma`] is what our
//! devices report: rxe's values except where we do not (yet) implement the feature, so that an
//! application never gets promised something that fails later:
//!
//! | attribute | rxe | softrdma | why |
//! | --- | --- | --- | --- |
//! | `device_cap_flags` | `0x01223c76` | `0x00203c76` | no `MEM_WINDOW` / `MEM_WINDOW_TYPE_2B`: memory windows (bind, type 1 and 2B) are not planned in the transport |
//! | `max_mw` | 524287 | 0 | same |
//! | `device_cap_flags_ex` | `0x1223C76` | `0x203C76` | the low 32 bits repeat `device_cap_flags` |
//!
//! Everything else (queue limits, atomics `ATOMIC_HCA`, SRQ, `MEM_MGT_EXTENSIONS`, 32 SGEs,
//! 128 outstanding RDMA reads/atomics per QP, `local_ca_ack_delay` 15) is rxe's, and the transport
//! engine is expected to honour it. When a feature lands, move its value back to rxe's here and
//! drop the table row.
//!
//! # Port rules (rxe's)
//!
//! * active MTU: `rxe_set_mtu` → `eth_mtu_int_to_enum`: the largest IB MTU not above the netdev
//!   MTU minus [`RXE_MAX_HDR_LENGTH`] (80: Ethernet 14 + IPv6 40 + UDP 8 + BTH 12 + ICRC 4,
//!   rounded), at least 256, at most 4096. 1500 → 1024, 9000 → 4096, 65536 (`lo`) → 4096.
//! * state: ACTIVE when the netdev is up with carrier, else DOWN; physical state LINK_UP when
//!   ACTIVE, POLLING when up without carrier, DISABLED when down (`rxe_query_port`).
//! * width/speed: ib_core's `ib_get_eth_speed` mapping of the Ethernet link speed, with an unknown
//!   speed taken as 1 Gb/s (→ 1X, 2.5 Gbps), which is what the golden VM shows.

use crate::gid::{Guid, GID_TABLE_LEN};
use crate::netdev::Netdev;

/// Header room rxe reserves between the netdev MTU and the IB path MTU (`RXE_MAX_HDR_LENGTH`).
pub const RXE_MAX_HDR_LENGTH: u32 = 80;

/// Largest message size of an rxe port (`RXE_PORT_MAX_MSG_SZ`, 8 MiB).
pub const MAX_MSG_SZ: u32 = 0x80_0000;

/// `IBV_PORT_CM_SUP`: the port supports the connection manager (rxe's only port capability).
pub const PORT_CAP_CM_SUP: u32 = 1 << 16;

/// The default P_Key, the only entry of an rxe port's P_Key table.
pub const DEFAULT_PKEY: u16 = 0xffff;

pub use softrdma_wire::Mtu;

/// The active MTU of a RoCE port on a netdev with MTU `netdev_mtu`, as rxe computes it
/// (`rxe_set_mtu`): [`Mtu::floor`] of `netdev_mtu - 80`, or 256 when even that does not fit.
pub fn active_mtu_for_netdev(netdev_mtu: u32) -> Mtu {
    Mtu::floor(netdev_mtu.saturating_sub(RXE_MAX_HDR_LENGTH) as usize).unwrap_or(Mtu::M256)
}

/// Logical port state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    /// 1: no link.
    Down = 1,
    /// 2: link up, not yet configured by a subnet manager.
    Init = 2,
    /// 3: configured, not yet active.
    Armed = 3,
    /// 4: usable.
    Active = 4,
}

impl PortState {
    /// The `ibv_devinfo` name (`PORT_ACTIVE`).
    pub fn name(self) -> &'static str {
        match self {
            PortState::Down => "PORT_DOWN",
            PortState::Init => "PORT_INIT",
            PortState::Armed => "PORT_ARMED",
            PortState::Active => "PORT_ACTIVE",
        }
    }

    /// The enum number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// Physical port state (IBTA PortPhysicalState).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PhysState {
    /// 1.
    Sleep = 1,
    /// 2: trying to bring the link up.
    Polling = 2,
    /// 3: administratively down.
    Disabled = 3,
    /// 4.
    PortConfigurationTraining = 4,
    /// 5: link up.
    LinkUp = 5,
    /// 6.
    LinkErrorRecovery = 6,
    /// 7.
    PhyTest = 7,
}

impl PhysState {
    /// The `ibv_devinfo` name (`LINK_UP`; rdma-core's spelling, typo included).
    pub fn name(self) -> &'static str {
        match self {
            PhysState::Sleep => "SLEEP",
            PhysState::Polling => "POLLING",
            PhysState::Disabled => "DISABLED",
            PhysState::PortConfigurationTraining => "PORT_CONFIGURATION TRAINNING",
            PhysState::LinkUp => "LINK_UP",
            PhysState::LinkErrorRecovery => "LINK_ERROR_RECOVERY",
            PhysState::PhyTest => "PHY TEST",
        }
    }

    /// The enum number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// Link layer of a port (`IBV_LINK_LAYER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkLayer {
    /// 0.
    Unspecified = 0,
    /// 1: native InfiniBand.
    InfiniBand = 1,
    /// 2: Ethernet (RoCE, iWARP).
    Ethernet = 2,
}

impl LinkLayer {
    /// The `ibv_devinfo` name.
    pub fn name(self) -> &'static str {
        match self {
            LinkLayer::Unspecified => "Unspecified",
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
        }
    }
}

/// Atomic operation support (`enum ibv_atomic_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AtomicCap {
    /// 0: no atomics.
    None = 0,
    /// 1: atomic between QPs of this device.
    Hca = 1,
    /// 2: atomic with respect to every device and the CPU.
    Glob = 2,
}

impl AtomicCap {
    /// The `ibv_devinfo` name (`ATOMIC_HCA`).
    pub fn name(self) -> &'static str {
        match self {
            AtomicCap::None => "ATOMIC_NONE",
            AtomicCap::Hca => "ATOMIC_HCA",
            AtomicCap::Glob => "ATOMIC_GLOB",
        }
    }

    /// The enum number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// Transport of a device (`enum ibv_transport_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// 0: the InfiniBand transport (also RoCE).
    InfiniBand = 0,
    /// 1: iWARP.
    Iwarp = 1,
}

impl Transport {
    /// The `ibv_devinfo` name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::InfiniBand => "InfiniBand",
            Transport::Iwarp => "iWARP",
        }
    }

    /// The enum number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// `ibv_device_attr.device_cap_flags` (`IBV_DEVICE_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceCapFlags(pub u32);

impl DeviceCapFlags {
    /// `IBV_DEVICE_BAD_PKEY_CNTR`.
    pub const BAD_PKEY_CNTR: u32 = 1 << 1;
    /// `IBV_DEVICE_BAD_QKEY_CNTR`.
    pub const BAD_QKEY_CNTR: u32 = 1 << 2;
    /// `IBV_DEVICE_AUTO_PATH_MIG`.
    pub const AUTO_PATH_MIG: u32 = 1 << 4;
    /// `IBV_DEVICE_CHANGE_PHY_PORT`.
    pub const CHANGE_PHY_PORT: u32 = 1 << 5;
    /// `IBV_DEVICE_UD_AV_PORT_ENFORCE`.
    pub const UD_AV_PORT_ENFORCE: u32 = 1 << 6;
    /// `IBV_DEVICE_PORT_ACTIVE_EVENT`.
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    /// `IBV_DEVICE_SYS_IMAGE_GUID`.
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    /// `IBV_DEVICE_RC_RNR_NAK_GEN`.
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
    /// `IBV_DEVICE_SRQ_RESIZE`.
    pub const SRQ_RESIZE: u32 = 1 << 13;
    /// `IBV_DEVICE_MEM_WINDOW`.
    pub const MEM_WINDOW: u32 = 1 << 17;
    /// `IBV_DEVICE_MEM_MGT_EXTENSIONS`.
    pub const MEM_MGT_EXTENSIONS: u32 = 1 << 21;
    /// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`.
    pub const MEM_WINDOW_TYPE_2B: u32 = 1 << 24;

    /// Every flag `ibv_devinfo` knows, with its name, in the order it prints them.
    pub const NAMES: [(u32, &'static str); 24] = [
        (1 << 0, "RESIZE_MAX_WR"),
        (1 << 1, "BAD_PKEY_CNTR"),
        (1 << 2, "BAD_QKEY_CNTR"),
        (1 << 3, "RAW_MULTI"),
        (1 << 4, "AUTO_PATH_MIG"),
        (1 << 5, "CHANGE_PHY_PORT"),
        (1 << 6, "UD_AV_PORT_ENFORCE"),
        (1 << 7, "CURR_QP_STATE_MOD"),
        (1 << 8, "SHUTDOWN_PORT"),
        (1 << 9, "INIT_TYPE"),
        (1 << 10, "PORT_ACTIVE_EVENT"),
        (1 << 11, "SYS_IMAGE_GUID"),
        (1 << 12, "RC_RNR_NAK_GEN"),
        (1 << 13, "SRQ_RESIZE"),
        (1 << 14, "N_NOTIFY_CQ"),
        (1 << 17, "MEM_WINDOW"),
        (1 << 18, "UD_IP_CSUM"),
        (1 << 20, "XRC"),
        (1 << 21, "MEM_MGT_EXTENSIONS"),
        (1 << 23, "MEM_WINDOW_TYPE_2A"),
        (1 << 24, "MEM_WINDOW_TYPE_2B"),
        (1 << 25, "RC_IP_CSUM"),
        (1 << 26, "RAW_IP_CSUM"),
        (1 << 29, "MANAGED_FLOW_STEERING"),
    ];

    /// Whether every bit of `flag` is set.
    pub fn contains(self, flag: u32) -> bool {
        self.0 & flag == flag
    }

    /// The names of the set flags, in `ibv_devinfo` order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        Self::NAMES.into_iter().filter(move |(bit, _)| self.0 & bit != 0).map(|(_, name)| name)
    }

    /// Set bits that have no name (`ibv_devinfo` prints them as `Unknown flags: 0x…`).
    pub fn unknown(self) -> u32 {
        Self::NAMES.iter().fold(self.0, |acc, (bit, _)| acc & !bit)
    }
}

/// Device attributes (`struct ibv_device_attr` plus the `_ex` fields `ibv_devinfo -v` prints).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Transport type.
    pub transport: Transport,
    /// Raw firmware version; printed as `major.minor.sub` from bits 47..32, 31..16, 15..0.
    pub fw_ver: u64,
    /// Node GUID.
    pub node_guid: Guid,
    /// System image GUID (rxe: the node GUID).
    pub sys_image_guid: Guid,
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit mask).
    pub page_size_cap: u64,
    /// IEEE vendor id (rxe: 0xffffff).
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Maximum number of QPs.
    pub max_qp: u32,
    /// Maximum outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Capability flags.
    pub device_cap_flags: DeviceCapFlags,
    /// Maximum scatter/gather entries per WR (non-RD QPs).
    pub max_sge: u32,
    /// Maximum SGEs per RD QP WR.
    pub max_sge_rd: u32,
    /// Maximum number of CQs.
    pub max_cq: u32,
    /// Maximum CQ entries.
    pub max_cqe: u32,
    /// Maximum number of MRs.
    pub max_mr: u32,
    /// Maximum number of PDs.
    pub max_pd: u32,
    /// Outstanding RDMA reads/atomics a QP can be the target of.
    pub max_qp_rd_atom: u32,
    /// Same for EE contexts (0: no RD).
    pub max_ee_rd_atom: u32,
    /// Device-wide responder resources for RDMA reads/atomics.
    pub max_res_rd_atom: u32,
    /// Outstanding RDMA reads/atomics a QP can initiate.
    pub max_qp_init_rd_atom: u32,
    /// Same for EE contexts.
    pub max_ee_init_rd_atom: u32,
    /// Atomic support.
    pub atomic_cap: AtomicCap,
    /// Maximum number of EE contexts.
    pub max_ee: u32,
    /// Maximum number of RD domains.
    pub max_rdd: u32,
    /// Maximum number of memory windows.
    pub max_mw: u32,
    /// Maximum raw IPv6 datagram QPs.
    pub max_raw_ipv6_qp: u32,
    /// Maximum raw Ethertype QPs.
    pub max_raw_ethy_qp: u32,
    /// Maximum multicast groups.
    pub max_mcast_grp: u32,
    /// Maximum QPs attached to one multicast group.
    pub max_mcast_qp_attach: u32,
    /// Maximum QP attachments over all groups.
    pub max_total_mcast_qp_attach: u32,
    /// Maximum address handles.
    pub max_ah: u32,
    /// Maximum FMRs (obsolete; 0).
    pub max_fmr: u32,
    /// Maximum remaps per FMR.
    pub max_map_per_fmr: u32,
    /// Maximum SRQs.
    pub max_srq: u32,
    /// Maximum WRs per SRQ.
    pub max_srq_wr: u32,
    /// Maximum SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// Maximum P_Keys.
    pub max_pkeys: u16,
    /// Local CA ACK delay (4.096 µs × 2^n).
    pub local_ca_ack_delay: u8,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// `device_cap_flags_ex` (low 32 bits repeat `device_cap_flags`).
    pub device_cap_flags_ex: u64,
    /// Number of completion vectors (rxe: the number of CPUs).
    pub num_comp_vectors: u32,
}

impl DeviceAttr {
    /// The kernel rxe's attributes (Linux 6.1, golden `04-ibv_devinfo-v-rxe0.txt`), with
    /// `num_comp_vectors` set to 1 (rxe reports the number of CPUs; set it as needed).
    pub fn rxe(node_guid: Guid) -> DeviceAttr {
        let flags = DeviceCapFlags::BAD_PKEY_CNTR
            | DeviceCapFlags::BAD_QKEY_CNTR
            | DeviceCapFlags::AUTO_PATH_MIG
            | DeviceCapFlags::CHANGE_PHY_PORT
            | DeviceCapFlags::UD_AV_PORT_ENFORCE
            | DeviceCapFlags::PORT_ACTIVE_EVENT
            | DeviceCapFlags::SYS_IMAGE_GUID
            | DeviceCapFlags::RC_RNR_NAK_GEN
            | DeviceCapFlags::SRQ_RESIZE
            | DeviceCapFlags::MEM_WINDOW
            | DeviceCapFlags::MEM_MGT_EXTENSIONS
            | DeviceCapFlags::MEM_WINDOW_TYPE_2B;
        DeviceAttr {
            transport: Transport::InfiniBand,
            fw_ver: 0,
            node_guid,
            sys_image_guid: node_guid,
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            vendor_id: 0xff_ffff,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: (1 << 20) - 16,
            max_qp_wr: 1 << 20,
            device_cap_flags: DeviceCapFlags(flags),
            max_sge: 32,
            max_sge_rd: 32,
            max_cq: 1 << 20,
            max_cqe: (1 << 15) - 1,
            max_mr: (1 << 19) - 1,
            max_pd: 1 << 20,
            max_qp_rd_atom: 128,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 0x3f000,
            max_qp_init_rd_atom: 128,
            max_ee_init_rd_atom: 0,
            atomic_cap: AtomicCap::Hca,
            max_ee: 0,
            max_rdd: 0,
            max_mw: (1 << 19) - 1,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: 8192,
            max_mcast_qp_attach: 56,
            max_total_mcast_qp_attach: 0x70000,
            max_ah: (1 << 15) - 1,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: (1 << 20) - 0x20001,
            max_srq_wr: 1 << 20,
            max_srq_sge: 27,
            max_pkeys: 64,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            device_cap_flags_ex: u64::from(flags),
            num_comp_vectors: 1,
        }
    }

    /// What a softrdma device reports: [`DeviceAttr::rxe`] minus the features listed in the
    /// module docs, with `num_comp_vectors` = the number of CPUs available to this process.
    pub fn softrdma(node_guid: Guid) -> DeviceAttr {
        let mut a = DeviceAttr::rxe(node_guid);
        let flags = a.device_cap_flags.0 & !(DeviceCapFlags::MEM_WINDOW | DeviceCapFlags::MEM_WINDOW_TYPE_2B);
        a.device_cap_flags = DeviceCapFlags(flags);
        a.device_cap_flags_ex = u64::from(flags);
        a.max_mw = 0;
        a.num_comp_vectors =
            std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX));
        a
    }

    /// The firmware version text (`0.0.0`), as rdma-core's rxe provider formats it.
    pub fn fw_ver_string(&self) -> String {
        format!("{}.{}.{}", (self.fw_ver >> 32) & 0xffff, (self.fw_ver >> 16) & 0xffff, self.fw_ver & 0xffff)
    }
}

/// Port attributes (`struct ibv_port_attr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// GID table size.
    pub gid_tbl_len: u32,
    /// `IBV_PORT_*` capability bits.
    pub port_cap_flags: u32,
    /// `IBV_PORT_*2` capability bits.
    pub port_cap_flags2: u16,
    /// Largest message.
    pub max_msg_sz: u32,
    /// Bad P_Key counter.
    pub bad_pkey_cntr: u32,
    /// Q_Key violation counter.
    pub qkey_viol_cntr: u32,
    /// P_Key table size.
    pub pkey_tbl_len: u16,
    /// Base LID (0 on RoCE).
    pub lid: u16,
    /// Subnet manager LID (0 on RoCE).
    pub sm_lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// Number of VLs, as the `enum` value (1 → 1 VL).
    pub max_vl_num: u8,
    /// Subnet manager SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// Init type reply.
    pub init_type_reply: u8,
    /// Active width (`IB_WIDTH_*` bit: 1 = 1X, 2 = 4X, 4 = 8X, 8 = 12X, 16 = 2X).
    pub active_width: u8,
    /// Active speed (`IB_SPEED_*` bit: 1 = SDR 2.5 Gbps, …).
    pub active_speed: u8,
    /// Physical state.
    pub phys_state: PhysState,
    /// Link layer.
    pub link_layer: LinkLayer,
}

impl PortAttr {
    /// Port 1 of a RoCE device on `netdev`, by rxe's rules (see the module docs).
    pub fn for_netdev(netdev: &Netdev) -> PortAttr {
        let (state, phys_state) = if netdev.is_link_up() {
            (PortState::Active, PhysState::LinkUp)
        } else if netdev.flags.up {
            (PortState::Down, PhysState::Polling)
        } else {
            (PortState::Down, PhysState::Disabled)
        };
        let (active_width, active_speed) = ib_width_speed(netdev.speed_mbps);
        PortAttr {
            state,
            max_mtu: Mtu::M4096,
            active_mtu: active_mtu_for_netdev(netdev.mtu),
            gid_tbl_len: GID_TABLE_LEN as u32,
            port_cap_flags: PORT_CAP_CM_SUP,
            port_cap_flags2: 0,
            max_msg_sz: MAX_MSG_SZ,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width,
            active_speed,
            phys_state,
            link_layer: LinkLayer::Ethernet,
        }
    }
}

/// ib_core's `ib_get_eth_speed`: IB `(width, speed)` for an Ethernet speed in Mb/s; unknown is
/// taken as 1000.
pub fn ib_width_speed(speed_mbps: Option<u32>) -> (u8, u8) {
    const W1X: u8 = 1;
    const W4X: u8 = 2;
    const SDR: u8 = 1;
    const DDR: u8 = 2;
    const FDR10: u8 = 8;
    const EDR: u8 = 32;
    match speed_mbps.unwrap_or(1000) {
        0..=1000 => (W1X, SDR),
        1001..=10_000 => (W1X, FDR10),
        10_001..=20_000 => (W4X, DDR),
        20_001..=25_000 => (W1X, EDR),
        25_001..=40_000 => (W4X, FDR10),
        _ => (W4X, EDR),
    }
}

/// `ibv_devinfo`'s text for an active width (`1` for 1X; it appends the `X`).
pub fn width_name(width: u8) -> &'static str {
    match width {
        1 => "1",
        2 => "4",
        4 => "8",
        8 => "12",
        16 => "2",
        _ => "invalid width",
    }
}

/// `ibv_devinfo`'s text for an active speed (`2.5 Gbps`).
pub fn speed_name(speed: u8) -> &'static str {
    match speed {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        _ => "invalid speed",
    }
}

/// `ibv_devinfo`'s text for `max_vl_num`.
pub fn vl_name(vl_num: u8) -> &'static str {
    match vl_num {
        1 => "1",
        2 => "2",
        3 => "4",
        4 => "8",
        5 => "15",
        _ => "invalid value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netdev::{IfFlags, MacAddr};

    #[test]
    fn active_mtu_like_rxe() {
        for (netdev_mtu, want) in [
            (0, Mtu::M256),
            (300, Mtu::M256),
            (1023 + 80, Mtu::M512),
            (1024 + 80, Mtu::M1024),
            (1500, Mtu::M1024), // golden eth0
            (2047 + 80, Mtu::M1024),
            (2048 + 80, Mtu::M2048),
            (4176, Mtu::M4096),
            (9000, Mtu::M4096),
            (65536, Mtu::M4096), // lo
        ] {
            assert_eq!(active_mtu_for_netdev(netdev_mtu), want, "{netdev_mtu}");
        }
    }

    #[test]
    fn cap_flags_names() {
        let rxe = DeviceAttr::rxe(Guid(1));
        assert_eq!(rxe.device_cap_flags.0, 0x0122_3c76);
        let names: Vec<_> = rxe.device_cap_flags.names().collect();
        assert_eq!(names.len(), 12);
        assert_eq!(names[0], "BAD_PKEY_CNTR");
        assert_eq!(names[11], "MEM_WINDOW_TYPE_2B");
        assert_eq!(rxe.device_cap_flags.unknown(), 0);
        assert_eq!(DeviceCapFlags(1 << 31 | 1).unknown(), 1 << 31);
        assert!(rxe.device_cap_flags.contains(DeviceCapFlags::MEM_WINDOW));
    }

    #[test]
    fn softrdma_differs_from_rxe_only_as_documented() {
        let g = Guid(0x5054_00ff_fe77_0902);
        let mut ours = DeviceAttr::softrdma(g);
        assert_eq!(ours.device_cap_flags.0, 0x0020_3c76);
        assert!(!ours.device_cap_flags.contains(DeviceCapFlags::MEM_WINDOW));
        assert_eq!(ours.device_cap_flags_ex, 0x20_3c76);
        assert!(ours.num_comp_vectors >= 1);
        // Put the documented differences back: the rest must equal rxe.
        let rxe = DeviceAttr::rxe(g);
        ours.device_cap_flags = rxe.device_cap_flags;
        ours.device_cap_flags_ex = rxe.device_cap_flags_ex;
        ours.max_mw = rxe.max_mw;
        ours.num_comp_vectors = rxe.num_comp_vectors;
        assert_eq!(ours, rxe);
        assert_eq!(rxe.fw_ver_string(), "0.0.0");
        let v = DeviceAttr { fw_ver: (1 << 32) | (2 << 16) | 3, ..rxe };
        assert_eq!(v.fw_ver_string(), "1.2.3");
    }

    fn nd(up: bool, lower_up: bool, mtu: u32, speed: Option<u32>) -> Netdev {
        Netdev {
            index: 2,
            name: "eth0".into(),
            flags: IfFlags { up, running: up && lower_up, lower_up, loopback: false },
            mtu,
            mac: Some(MacAddr([0x52, 0x54, 0, 0x77, 9, 2])),
            addrs: vec![],
            speed_mbps: speed,
        }
    }

    #[test]
    fn port_from_netdev() {
        let p = PortAttr::for_netdev(&nd(true, true, 1500, None));
        assert_eq!(p.state, PortState::Active);
        assert_eq!(p.phys_state, PhysState::LinkUp);
        assert_eq!(p.active_mtu, Mtu::M1024);
        assert_eq!(p.max_mtu, Mtu::M4096);
        assert_eq!((p.active_width, p.active_speed), (1, 1));
        assert_eq!(p.gid_tbl_len, 1024);
        assert_eq!(p.port_cap_flags, 0x0001_0000);
        assert_eq!(p.link_layer, LinkLayer::Ethernet);
        let p = PortAttr::for_netdev(&nd(true, false, 1500, None));
        assert_eq!((p.state, p.phys_state), (PortState::Down, PhysState::Polling));
        let p = PortAttr::for_netdev(&nd(false, false, 1500, None));
        assert_eq!((p.state, p.phys_state), (PortState::Down, PhysState::Disabled));
        assert_eq!(p.phys_state.name(), "DISABLED");
        assert_eq!(PortState::Down.name(), "PORT_DOWN");
    }

    #[test]
    fn eth_speed_mapping() {
        assert_eq!(ib_width_speed(None), (1, 1));
        assert_eq!(ib_width_speed(Some(100)), (1, 1));
        assert_eq!(ib_width_speed(Some(10_000)), (1, 8));
        assert_eq!(ib_width_speed(Some(25_000)), (1, 32));
        assert_eq!(ib_width_speed(Some(100_000)), (2, 32));
        assert_eq!(width_name(1), "1");
        assert_eq!(speed_name(1), "2.5 Gbps");
        assert_eq!(speed_name(8), "10.0 Gbps");
        assert_eq!(vl_name(1), "1");
    }
}
