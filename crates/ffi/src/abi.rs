//! The C ABI: `#[repr(C)]` mirrors of the structs of rdma-core 44's `<infiniband/verbs.h>` that
//! applications and the header's inline functions touch, and the enum values we use.
//!
//! Layouts are written from the header (Debian's `libibverbs-dev` 44.0) and pinned twice: by the
//! `const` assertions at the end of this file (x86-64 sizes and offsets), and by `tests/abi.c`, which
//! checks the same numbers with `offsetof`/`sizeof` against the real header. A change on either side
//! fails the build or the test.
//!
//! Naming follows the C names (`ibv_qp_attr` → [`IbvQpAttr`], fields unchanged) so that code reads
//! against the header line by line.

#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use libc::{pthread_cond_t, pthread_mutex_t};

// ---- enums (as plain integers: a C enum value we do not know must not be UB) ----------------

pub const IBV_NODE_CA: c_int = 1;
pub const IBV_TRANSPORT_IB: c_int = 0;

pub const IBV_QPT_RC: c_int = 2;
pub const IBV_QPT_UC: c_int = 3;
pub const IBV_QPT_UD: c_int = 4;

pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_SQD: c_int = 4;
pub const IBV_QPS_SQE: c_int = 5;
pub const IBV_QPS_ERR: c_int = 6;

pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_int = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_int = 6;
pub const IBV_WR_SEND_WITH_INV: c_int = 9;

pub const IBV_SEND_INLINE: c_uint = 1 << 3;

/// `ibv_qp_attr_mask` bits.
pub mod qp_mask {
    pub const STATE: i32 = 1 << 0;
    pub const CUR_STATE: i32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: i32 = 1 << 2;
    pub const ACCESS_FLAGS: i32 = 1 << 3;
    pub const PKEY_INDEX: i32 = 1 << 4;
    pub const PORT: i32 = 1 << 5;
    pub const QKEY: i32 = 1 << 6;
    pub const AV: i32 = 1 << 7;
    pub const PATH_MTU: i32 = 1 << 8;
    pub const TIMEOUT: i32 = 1 << 9;
    pub const RETRY_CNT: i32 = 1 << 10;
    pub const RNR_RETRY: i32 = 1 << 11;
    pub const RQ_PSN: i32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    pub const ALT_PATH: i32 = 1 << 14;
    pub const MIN_RNR_TIMER: i32 = 1 << 15;
    pub const SQ_PSN: i32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
    pub const PATH_MIG_STATE: i32 = 1 << 18;
    pub const CAP: i32 = 1 << 19;
    pub const DEST_QPN: i32 = 1 << 20;
    pub const RATE_LIMIT: i32 = 1 << 25;
}

pub const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

pub const IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1 << 0;
pub const IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
pub const IBV_QP_EX_WITH_SEND: u64 = 1 << 2;
pub const IBV_QP_EX_WITH_SEND_WITH_IMM: u64 = 1 << 3;
pub const IBV_QP_EX_WITH_RDMA_READ: u64 = 1 << 4;
pub const IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
pub const IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
pub const IBV_QP_EX_WITH_SEND_WITH_INV: u64 = 1 << 9;

pub const IBV_CQ_INIT_ATTR_MASK_FLAGS: u32 = 1 << 0;
pub const IBV_CQ_INIT_ATTR_MASK_PD: u32 = 1 << 1;

/// `ibv_create_cq_wc_flags`.
pub mod wc_flags_ex {
    pub const BYTE_LEN: u64 = 1 << 0;
    pub const IMM: u64 = 1 << 1;
    pub const QP_NUM: u64 = 1 << 2;
    pub const SRC_QP: u64 = 1 << 3;
    pub const SLID: u64 = 1 << 4;
    pub const SL: u64 = 1 << 5;
    pub const DLID_PATH_BITS: u64 = 1 << 6;
    pub const COMPLETION_TIMESTAMP: u64 = 1 << 7;
    pub const CVLAN: u64 = 1 << 8;
    pub const FLOW_TAG: u64 = 1 << 9;
    pub const TM_INFO: u64 = 1 << 10;
    pub const COMPLETION_TIMESTAMP_WALLCLOCK: u64 = 1 << 11;
    /// The standard fields, which every CQ can report.
    pub const STD: u64 = BYTE_LEN | IMM | QP_NUM | SRC_QP | SLID | SL | DLID_PATH_BITS;
}

pub const IBV_SRQ_MAX_WR: c_int = 1 << 0;
pub const IBV_SRQ_LIMIT: c_int = 1 << 1;

pub const IBV_SRQ_INIT_ATTR_TYPE: u32 = 1 << 0;
pub const IBV_SRQ_INIT_ATTR_PD: u32 = 1 << 1;
pub const IBV_SRQT_BASIC: c_int = 0;

pub const IBV_EVENT_CQ_ERR: c_int = 0;
pub const IBV_EVENT_QP_FATAL: c_int = 1;
pub const IBV_EVENT_QP_REQ_ERR: c_int = 2;
pub const IBV_EVENT_QP_ACCESS_ERR: c_int = 3;
pub const IBV_EVENT_COMM_EST: c_int = 4;
pub const IBV_EVENT_SQ_DRAINED: c_int = 5;
pub const IBV_EVENT_SRQ_LIMIT_REACHED: c_int = 15;
pub const IBV_EVENT_QP_LAST_WQE_REACHED: c_int = 16;

pub const IBV_GID_TYPE_IB: u32 = 0;
pub const IBV_GID_TYPE_ROCE_V1: u32 = 1;
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
/// `enum ibv_gid_type_sysfs` (the private `ibv_query_gid_type`).
pub const IBV_GID_TYPE_SYSFS_IB_ROCE_V1: c_int = 0;
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

pub const IBV_WC_GRH: c_uint = 1 << 0;

pub const IBV_FORK_DISABLED: c_int = 0;
pub const IBV_FORK_ENABLED: c_int = 1;

/// `__VERBS_ABI_IS_EXTENDED`: `ibv_context.abi_compat` of a context that has a `verbs_context`.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

// ---- structs ---------------------------------------------------------------------------------

/// `union ibv_gid`: 16 bytes, 8-byte aligned (its `global` member is two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct IbvGid {
    pub raw: [u8; 16],
}

#[repr(C)]
pub struct IbvGidEntry {
    pub gid: IbvGid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
pub struct IbvDevice {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type Compat = Option<unsafe extern "C" fn() -> *mut c_void>;

#[repr(C)]
pub struct IbvContextOps {
    pub _compat_query_device: Option<unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int>,
    pub _compat_query_port: Option<unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int>,
    pub _compat_alloc_pd: Compat,
    pub _compat_dealloc_pd: Compat,
    pub _compat_reg_mr: Compat,
    pub _compat_rereg_mr: Compat,
    pub _compat_dereg_mr: Compat,
    pub alloc_mw: Option<unsafe extern "C" fn(*mut IbvPd, c_int) -> *mut c_void>,
    pub bind_mw: Option<unsafe extern "C" fn(*mut IbvQp, *mut c_void, *mut c_void) -> c_int>,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    pub _compat_create_cq: Compat,
    pub poll_cq: Option<unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int>,
    pub _compat_cq_event: Compat,
    pub _compat_resize_cq: Compat,
    pub _compat_destroy_cq: Compat,
    pub _compat_create_srq: Compat,
    pub _compat_modify_srq: Compat,
    pub _compat_query_srq: Compat,
    pub _compat_destroy_srq: Compat,
    pub post_srq_recv: Option<unsafe extern "C" fn(*mut IbvSrq, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int>,
    pub _compat_create_qp: Compat,
    pub _compat_query_qp: Compat,
    pub _compat_modify_qp: Compat,
    pub _compat_destroy_qp: Compat,
    pub post_send: Option<unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int>,
    pub post_recv: Option<unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int>,
    pub _compat_create_ah: Compat,
    pub _compat_destroy_ah: Compat,
    pub _compat_attach_mcast: Compat,
    pub _compat_detach_mcast: Compat,
    pub _compat_async_event: Compat,
}

#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

type Op = Option<unsafe extern "C" fn()>;

/// `struct verbs_context`: the extended ops, which live *before* `struct ibv_context` in memory.
/// An op left `None` makes the header's inline wrapper fail with `EOPNOTSUPP` (or fall back, for
/// `ibv_query_device_ex`), which is the documented refusal.
#[repr(C)]
pub struct VerbsContext {
    pub query_port: Option<unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr, usize) -> c_int>,
    pub advise_mr: Op,
    pub alloc_null_mr: Op,
    pub read_counters: Op,
    pub attach_counters_point_flow: Op,
    pub create_counters: Op,
    pub destroy_counters: Op,
    pub reg_dm_mr: Op,
    pub alloc_dm: Op,
    pub free_dm: Op,
    pub modify_flow_action_esp: Op,
    pub destroy_flow_action: Op,
    pub create_flow_action_esp: Op,
    pub modify_qp_rate_limit: Op,
    pub alloc_parent_domain: Op,
    pub dealloc_td: Op,
    pub alloc_td: Op,
    pub modify_cq: Op,
    pub post_srq_ops: Op,
    pub destroy_rwq_ind_table: Op,
    pub create_rwq_ind_table: Op,
    pub destroy_wq: Op,
    pub modify_wq: Op,
    pub create_wq: Op,
    pub query_rt_values: Op,
    pub create_cq_ex: Option<unsafe extern "C" fn(*mut IbvContext, *mut IbvCqInitAttrEx) -> *mut IbvCqEx>,
    pub priv_: *mut c_void,
    pub query_device_ex: Option<
        unsafe extern "C" fn(*mut IbvContext, *const IbvQueryDeviceExInput, *mut IbvDeviceAttrEx, usize) -> c_int,
    >,
    pub ibv_destroy_flow: Op,
    pub abi_placeholder2: Op,
    pub ibv_create_flow: Op,
    pub abi_placeholder1: Op,
    pub open_qp: Op,
    pub create_qp_ex: Option<unsafe extern "C" fn(*mut IbvContext, *mut IbvQpInitAttrEx) -> *mut IbvQp>,
    pub get_srq_num: Option<unsafe extern "C" fn(*mut IbvSrq, *mut u32) -> c_int>,
    pub create_srq_ex: Option<unsafe extern "C" fn(*mut IbvContext, *mut IbvSrqInitAttrEx) -> *mut IbvSrq>,
    pub open_xrcd: Op,
    pub close_xrcd: Op,
    pub _abi_placeholder3: u64,
    pub sz: usize,
    pub context: IbvContext,
}

#[repr(C)]
pub struct IbvDeviceAttr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
pub struct IbvQueryDeviceExInput {
    pub comp_mask: u32,
}

/// `struct ibv_device_attr_ex`. Everything after `orig_attr` and `device_cap_flags_ex` is a
/// capability a soft device does not have, reported as zero (as rxe does); the fields are kept as
/// an opaque tail whose size the assertions pin.
#[repr(C)]
pub struct IbvDeviceAttrEx {
    pub orig_attr: IbvDeviceAttr,
    pub comp_mask: u32,
    /// `struct ibv_odp_caps` (general_caps, rc/uc/ud caps).
    pub odp_caps: [u64; 3],
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    /// tso_caps .. phys_port_cnt_ex.
    pub tail: [u64; 14],
}

#[repr(C)]
pub struct IbvPortAttr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub union IbvAsyncElement {
    pub cq: *mut IbvCq,
    pub qp: *mut IbvQp,
    pub srq: *mut IbvSrq,
    pub wq: *mut c_void,
    pub port_num: c_int,
}

#[repr(C)]
pub struct IbvAsyncEvent {
    pub element: IbvAsyncElement,
    pub event_type: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network order) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvGlobalRoute {
    pub dgid: IbvGid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
pub struct IbvGrh {
    pub version_tclass_flow: u32,
    pub paylen: u16,
    pub next_hdr: u8,
    pub hop_limit: u8,
    pub sgid: IbvGid,
    pub dgid: IbvGid,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

impl IbvAhAttr {
    /// A RoCE address on port 1: global (a GRH to `dgid` from GID index `sgid_index`), no LID.
    pub fn roce(dgid: [u8; 16], sgid_index: u8, hop_limit: u8, traffic_class: u8, flow_label: u32) -> IbvAhAttr {
        IbvAhAttr {
            grh: IbvGlobalRoute { dgid: IbvGid { raw: dgid }, flow_label, sgid_index, hop_limit, traffic_class },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: 1,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct IbvSrqInitAttr {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
}

#[repr(C)]
pub struct IbvSrqInitAttrEx {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
    pub comp_mask: u32,
    pub srq_type: c_int,
    pub pd: *mut IbvPd,
    pub xrcd: *mut c_void,
    pub cq: *mut IbvCq,
    pub tm_cap: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

#[repr(C)]
pub struct IbvRxHashConf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

#[repr(C)]
pub struct IbvQpInitAttrEx {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut IbvPd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: IbvRxHashConf,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvQpAttr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvRdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvAtomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvUd {
    pub ah: *mut IbvAh,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

#[repr(C)]
pub union IbvWrUnion {
    pub rdma: IbvRdma,
    pub atomic: IbvAtomic,
    pub ud: IbvUd,
}

#[repr(C)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: IbvWrUnion,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// `bind_mw` / `tso` (unused here; 48 bytes).
    pub tail: [u64; 6],
}

#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

#[repr(C)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
    pub srq_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct IbvDataBuf {
    pub addr: *mut c_void,
    pub length: usize,
}

#[repr(C)]
pub struct IbvQpEx {
    pub qp_base: IbvQp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u64, u64)>,
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u64)>,
    pub wr_bind_mw: Option<unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, u32, *const c_void)>,
    pub wr_local_inv: Option<unsafe extern "C" fn(*mut IbvQpEx, u32)>,
    pub wr_rdma_read: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64)>,
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(*mut IbvQpEx)>,
    pub wr_send_imm: Option<unsafe extern "C" fn(*mut IbvQpEx, u32)>,
    pub wr_send_inv: Option<unsafe extern "C" fn(*mut IbvQpEx, u32)>,
    pub wr_send_tso: Option<unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, u16, u16)>,
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(*mut IbvQpEx, *mut IbvAh, u32, u32)>,
    pub wr_set_xrc_srqn: Option<unsafe extern "C" fn(*mut IbvQpEx, u32)>,
    pub wr_set_inline_data: Option<unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, usize)>,
    pub wr_set_inline_data_list: Option<unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvDataBuf)>,
    pub wr_set_sge: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u32)>,
    pub wr_set_sge_list: Option<unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvSge)>,
    pub wr_start: Option<unsafe extern "C" fn(*mut IbvQpEx)>,
    pub wr_complete: Option<unsafe extern "C" fn(*mut IbvQpEx) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(*mut IbvQpEx)>,
    pub wr_atomic_write: Option<unsafe extern "C" fn(*mut IbvQpEx, u32, u64, *const c_void)>,
}

#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct IbvPollCqAttr {
    pub comp_mask: u32,
}

#[repr(C)]
pub struct IbvWcTmInfo {
    pub tag: u64,
    pub priv_: u32,
}

type CqExFn<R> = Option<unsafe extern "C" fn(*mut IbvCqEx) -> R>;

#[repr(C)]
pub struct IbvCqEx {
    pub cq: IbvCq,
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut IbvCqEx, *mut IbvPollCqAttr) -> c_int>,
    pub next_poll: CqExFn<c_int>,
    pub end_poll: Option<unsafe extern "C" fn(*mut IbvCqEx)>,
    pub read_opcode: CqExFn<c_int>,
    pub read_vendor_err: CqExFn<u32>,
    pub read_byte_len: CqExFn<u32>,
    pub read_imm_data: CqExFn<u32>,
    pub read_qp_num: CqExFn<u32>,
    pub read_src_qp: CqExFn<u32>,
    pub read_wc_flags: CqExFn<c_uint>,
    pub read_slid: CqExFn<u32>,
    pub read_sl: CqExFn<u8>,
    pub read_dlid_path_bits: CqExFn<u8>,
    pub read_completion_ts: CqExFn<u64>,
    pub read_cvlan: CqExFn<u16>,
    pub read_flow_tag: CqExFn<u32>,
    pub read_tm_info: Option<unsafe extern "C" fn(*mut IbvCqEx, *mut IbvWcTmInfo)>,
    pub read_completion_wallclock_ns: CqExFn<u64>,
}

#[repr(C)]
pub struct IbvCqInitAttrEx {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut IbvCompChannel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut IbvPd,
}

#[repr(C)]
pub struct IbvAh {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub handle: u32,
}

#[repr(C)]
pub struct IbvEce {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

// ---- layout pins (x86-64, rdma-core 44; tests/abi.c checks the same numbers in C) -------------

macro_rules! pin {
    ($t:ty, size $s:expr $(, $f:ident @ $o:expr)*) => {
        const _: () = assert!(std::mem::size_of::<$t>() == $s);
        $(const _: () = assert!(std::mem::offset_of!($t, $f) == $o);)*
    };
}

pin!(IbvDevice, size 664, node_type @ 16, name @ 24, dev_name @ 88, dev_path @ 152, ibdev_path @ 408);
pin!(IbvContextOps, size 256, poll_cq @ 88, req_notify_cq @ 96, post_srq_recv @ 160, post_send @ 200, post_recv @ 208);
pin!(IbvContext, size 328, ops @ 8, cmd_fd @ 264, async_fd @ 268, num_comp_vectors @ 272, mutex @ 280, abi_compat @ 320);
pin!(VerbsContext, size 648, create_cq_ex @ 200, query_device_ex @ 216, create_qp_ex @ 264, get_srq_num @ 272,
    create_srq_ex @ 280, sz @ 312, context @ 320);
pin!(IbvDeviceAttr, size 232, node_guid @ 64, max_mr_size @ 80, vendor_id @ 96, max_qp @ 108, device_cap_flags @ 116,
    atomic_cap @ 164, max_srq_sge @ 220, max_pkeys @ 224, phys_port_cnt @ 227);
pin!(IbvDeviceAttrEx, size 400, comp_mask @ 232, odp_caps @ 240, completion_timestamp_mask @ 264,
    hca_core_clock @ 272, device_cap_flags_ex @ 280);
pin!(IbvPortAttr, size 52, gid_tbl_len @ 12, pkey_tbl_len @ 32, lmc @ 38, active_width @ 43, phys_state @ 45,
    link_layer @ 46, flags @ 47, port_cap_flags2 @ 48);
pin!(IbvGidEntry, size 32, gid_index @ 16, gid_type @ 24);
pin!(IbvAsyncEvent, size 16, event_type @ 8);
pin!(IbvWc, size 48, status @ 8, opcode @ 12, byte_len @ 20, imm_data @ 24, qp_num @ 28, src_qp @ 32,
    wc_flags @ 36, pkey_index @ 40, sl @ 44);
pin!(IbvPd, size 16, handle @ 8);
pin!(IbvMr, size 48, addr @ 16, length @ 24, handle @ 32, lkey @ 36, rkey @ 40);
pin!(IbvAhAttr, size 32, dlid @ 24, sl @ 26, is_global @ 29, port_num @ 30);
pin!(IbvGlobalRoute, size 24, flow_label @ 16, sgid_index @ 20, hop_limit @ 21, traffic_class @ 22);
pin!(IbvGrh, size 40, sgid @ 8, dgid @ 24);
pin!(IbvSrqInitAttr, size 24, attr @ 8);
pin!(IbvSrqInitAttrEx, size 64, comp_mask @ 20, srq_type @ 24, pd @ 32, cq @ 48, tm_cap @ 56);
pin!(IbvQpInitAttr, size 64, cap @ 32, qp_type @ 52, sq_sig_all @ 56);
pin!(IbvQpInitAttrEx, size 136, comp_mask @ 60, pd @ 64, create_flags @ 80, rwq_ind_tbl @ 88,
    rx_hash_conf @ 96, source_qpn @ 120, send_ops_flags @ 128);
pin!(IbvQpAttr, size 144, qkey @ 16, dest_qp_num @ 28, qp_access_flags @ 32, cap @ 36, ah_attr @ 56,
    alt_ah_attr @ 88, pkey_index @ 120, en_sqd_async_notify @ 124, max_rd_atomic @ 126, min_rnr_timer @ 128,
    port_num @ 129, timeout @ 130, retry_cnt @ 131, rnr_retry @ 132, rate_limit @ 136);
pin!(IbvSendWr, size 128, sg_list @ 16, num_sge @ 24, opcode @ 28, send_flags @ 32, imm_data @ 36, wr @ 40,
    remote_srqn @ 72, tail @ 80);
pin!(IbvRecvWr, size 32, num_sge @ 24);
pin!(IbvSrq, size 128, handle @ 24, mutex @ 32, cond @ 72, events_completed @ 120);
pin!(IbvQp, size 160, handle @ 48, qp_num @ 52, state @ 56, qp_type @ 60, mutex @ 64, cond @ 104,
    events_completed @ 152);
pin!(IbvQpEx, size 352, comp_mask @ 160, wr_id @ 168, wr_flags @ 176, wr_atomic_cmp_swp @ 184, wr_send @ 240,
    wr_set_ud_addr @ 272, wr_set_sge @ 304, wr_start @ 320, wr_complete @ 328, wr_abort @ 336, wr_atomic_write @ 344);
pin!(IbvCompChannel, size 16, fd @ 8, refcnt @ 12);
pin!(IbvCq, size 128, handle @ 24, cqe @ 28, mutex @ 32, cond @ 72, comp_events_completed @ 120);
pin!(IbvCqEx, size 288, comp_mask @ 128, status @ 132, wr_id @ 136, start_poll @ 144, read_opcode @ 168,
    read_wc_flags @ 216, read_completion_wallclock_ns @ 280);
pin!(IbvCqInitAttrEx, size 56, channel @ 16, comp_vector @ 24, wc_flags @ 32, comp_mask @ 40, flags @ 44,
    parent_domain @ 48);
pin!(IbvAh, size 24, handle @ 16);

/// Hand `list` to C as a NULL-terminated array (rdma-core's device lists), storing its length in
/// `*num` unless `num` is NULL. Free it with [`free_null_terminated`].
///
/// # Safety
/// `num` is NULL or writable.
pub unsafe fn into_null_terminated<T>(mut list: Vec<*mut T>, num: *mut c_int) -> *mut *mut T {
    if !num.is_null() {
        // SAFETY: writable (caller's contract).
        unsafe { *num = list.len() as c_int };
    }
    list.push(std::ptr::null_mut());
    Box::into_raw(list.into_boxed_slice()) as *mut *mut T
}

/// Free an array from [`into_null_terminated`] (not what it points to); NULL is ignored.
///
/// # Safety
/// `list` is NULL or came from [`into_null_terminated`] and is not used afterwards.
pub unsafe fn free_null_terminated<T>(list: *mut *mut T) {
    if list.is_null() {
        return;
    }
    let mut n = 0;
    // SAFETY: a NULL-terminated boxed slice (caller's contract).
    unsafe {
        while !(*list.add(n)).is_null() {
            n += 1;
        }
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1)));
    }
}
