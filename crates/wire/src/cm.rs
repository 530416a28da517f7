//! Communication manager (CM) messages (IBA 12.6) and the rdma_cm private-data header that the Linux
//! kernel's rdma_cm puts in a REQ to carry IP addressing.
//!
//! Each message is a `XxxRepr` of plain values parsed from, and emitted into, the 232-byte data part
//! of a CM MAD ([`crate::mad`]); [`CmMessage`] ties them to their attribute IDs. Private data is
//! fixed-size on the wire (zero padded); a repr carries the bytes given and emit pads them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::field::{set_u16, set_u24, set_u32, set_u64, u16_at, u24_at, u32_at, u64_at};
use crate::mad::{MadHeader, MadPacket, CLASS_CM, MAD_HEADER_LEN, MAD_LEN};
use crate::number::{Psn, Qpn};
use crate::{Error, Result};

/// CM attribute IDs (message types).
pub mod attr {
    /// Connect request.
    pub const REQ: u16 = 0x0010;
    /// Message receipt acknowledgement.
    pub const MRA: u16 = 0x0011;
    /// Reject.
    pub const REJ: u16 = 0x0012;
    /// Connect reply.
    pub const REP: u16 = 0x0013;
    /// Ready to use.
    pub const RTU: u16 = 0x0014;
    /// Disconnect request.
    pub const DREQ: u16 = 0x0015;
    /// Disconnect reply.
    pub const DREP: u16 = 0x0016;
    /// Service ID resolution request.
    pub const SIDR_REQ: u16 = 0x0017;
    /// Service ID resolution reply.
    pub const SIDR_REP: u16 = 0x0018;
}

/// REJ reasons used by rdma_cm (IBA table 112).
pub mod reason {
    /// No QP available.
    pub const NO_QP: u16 = 1;
    /// Insufficient resources.
    pub const NO_RESOURCES: u16 = 3;
    /// Timeout.
    pub const TIMEOUT: u16 = 4;
    /// Invalid communication ID.
    pub const INVALID_COMM_ID: u16 = 6;
    /// Invalid service ID: nobody listens.
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// Stale connection.
    pub const STALE_CONN: u16 = 10;
    /// Consumer reject (rdma_reject).
    pub const CONSUMER_REJECT: u16 = 28;
}

/// Largest private data of each message.
pub mod private_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// REP.
    pub const REP: usize = 196;
    /// RTU and DREP.
    pub const RTU: usize = 224;
    /// REJ.
    pub const REJ: usize = 148;
    /// MRA.
    pub const MRA: usize = 222;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// rdma_cm port spaces (the middle of the service ID).
pub mod port_space {
    /// RDMA_PS_IPOIB.
    pub const IPOIB: u16 = 0x0002;
    /// RDMA_PS_IB.
    pub const IB: u16 = 0x013f;
    /// RDMA_PS_TCP.
    pub const TCP: u16 = 0x0106;
    /// RDMA_PS_UDP.
    pub const UDP: u16 = 0x0111;
}

/// The service ID rdma_cm uses for `port` in `space`: `0x0000_0000_01PP_PPPP`-style, e.g.
/// 0x0000000001061c06 for TCP port 7174.
pub const fn service_id(space: u16, port: u16) -> u64 {
    ((space as u64) << 16) | port as u64
}

/// Split a service ID into (port space, port), if it is an rdma_cm one.
pub const fn split_service_id(sid: u64) -> Option<(u16, u16)> {
    if sid >> 32 != 0 {
        return None;
    }
    Some(((sid >> 16) as u16, sid as u16))
}

fn put_private(buf: &mut [u8], data: &[u8]) -> Result<()> {
    if data.len() > buf.len() {
        return Err(Error::BadLength);
    }
    buf[..data.len()].copy_from_slice(data);
    buf[data.len()..].fill(0);
    Ok(())
}

/// One path of a REQ (primary or alternate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathRepr {
    /// Local port LID (0xffff on RoCE).
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// Local GID.
    pub local_gid: [u8; 16],
    /// Remote GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

impl PathRepr {
    const LEN: usize = 44;

    fn parse(b: &[u8]) -> PathRepr {
        let mut local_gid = [0u8; 16];
        let mut remote_gid = [0u8; 16];
        local_gid.copy_from_slice(&b[4..20]);
        remote_gid.copy_from_slice(&b[20..36]);
        let w = u32_at(b, 36);
        PathRepr {
            local_lid: u16_at(b, 0),
            remote_lid: u16_at(b, 2),
            local_gid,
            remote_gid,
            flow_label: w >> 12,
            packet_rate: (w & 0x3f) as u8,
            traffic_class: b[40],
            hop_limit: b[41],
            sl: b[42] >> 4,
            subnet_local: b[42] & 0x08 != 0,
            local_ack_timeout: b[43] >> 3,
        }
    }

    fn emit(&self, b: &mut [u8]) {
        set_u16(b, 0, self.local_lid);
        set_u16(b, 2, self.remote_lid);
        b[4..20].copy_from_slice(&self.local_gid);
        b[20..36].copy_from_slice(&self.remote_gid);
        set_u32(b, 36, ((self.flow_label & 0xf_ffff) << 12) | u32::from(self.packet_rate & 0x3f));
        b[40] = self.traffic_class;
        b[41] = self.hop_limit;
        b[42] = ((self.sl & 0xf) << 4) | (u8::from(self.subnet_local) << 3);
        b[43] = (self.local_ack_timeout & 0x1f) << 3;
    }
}

/// Connect request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReqRepr {
    /// Sender's communication ID.
    pub local_comm_id: u32,
    /// Service ID.
    pub service_id: u64,
    /// Sender's CA GUID.
    pub local_ca_guid: u64,
    /// Sender's Q_Key (UD/RD).
    pub local_qkey: u32,
    /// Sender's QPN.
    pub local_qpn: Qpn,
    /// Responder resources offered.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Remote CM response timeout (5 bits).
    pub remote_cm_response_timeout: u8,
    /// Transport service type: 0 RC, 1 UC.
    pub transport: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// Sender's starting PSN.
    pub starting_psn: Psn,
    /// Local CM response timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Retry count (3 bits).
    pub retry_count: u8,
    /// P_Key.
    pub pkey: u16,
    /// Path MTU (IB enum 1..=5).
    pub path_mtu: u8,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// The sender uses an SRQ.
    pub srq: bool,
    /// Primary path.
    pub primary: PathRepr,
    /// Alternate path (zero when none).
    pub alternate: PathRepr,
    /// Private data (up to 92 bytes).
    pub private_data: Vec<u8>,
}

impl ReqRepr {
    fn parse(d: &[u8]) -> ReqRepr {
        ReqRepr {
            local_comm_id: u32_at(d, 0),
            service_id: u64_at(d, 8),
            local_ca_guid: u64_at(d, 16),
            local_qkey: u32_at(d, 28),
            local_qpn: Qpn::new(u24_at(d, 32)),
            responder_resources: d[35],
            initiator_depth: d[39],
            remote_cm_response_timeout: d[43] >> 3,
            transport: (d[43] >> 1) & 3,
            e2e_flow_control: d[43] & 1 != 0,
            starting_psn: Psn::new(u24_at(d, 44)),
            local_cm_response_timeout: d[47] >> 3,
            retry_count: d[47] & 7,
            pkey: u16_at(d, 48),
            path_mtu: d[50] >> 4,
            rnr_retry_count: d[50] & 7,
            max_cm_retries: d[51] >> 4,
            srq: d[51] & 0x08 != 0,
            primary: PathRepr::parse(&d[52..52 + PathRepr::LEN]),
            alternate: PathRepr::parse(&d[96..96 + PathRepr::LEN]),
            private_data: d[140..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        d[..140].fill(0);
        set_u32(d, 0, self.local_comm_id);
        set_u64(d, 8, self.service_id);
        set_u64(d, 16, self.local_ca_guid);
        set_u32(d, 28, self.local_qkey);
        set_u24(d, 32, self.local_qpn.value());
        d[35] = self.responder_resources;
        d[39] = self.initiator_depth;
        d[43] = ((self.remote_cm_response_timeout & 0x1f) << 3)
            | ((self.transport & 3) << 1)
            | u8::from(self.e2e_flow_control);
        set_u24(d, 44, self.starting_psn.value());
        d[47] = ((self.local_cm_response_timeout & 0x1f) << 3) | (self.retry_count & 7);
        set_u16(d, 48, self.pkey);
        d[50] = ((self.path_mtu & 0xf) << 4) | (self.rnr_retry_count & 7);
        d[51] = ((self.max_cm_retries & 0xf) << 4) | (u8::from(self.srq) << 3);
        self.primary.emit(&mut d[52..52 + PathRepr::LEN]);
        self.alternate.emit(&mut d[96..96 + PathRepr::LEN]);
        put_private(&mut d[140..232], &self.private_data)
    }
}

/// Connect reply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RepRepr {
    /// Sender's communication ID.
    pub local_comm_id: u32,
    /// The REQ sender's communication ID.
    pub remote_comm_id: u32,
    /// Sender's Q_Key.
    pub local_qkey: u32,
    /// Sender's QPN.
    pub local_qpn: Qpn,
    /// Sender's starting PSN.
    pub starting_psn: Psn,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// The sender uses an SRQ.
    pub srq: bool,
    /// Sender's CA GUID.
    pub local_ca_guid: u64,
    /// Private data (up to 196 bytes).
    pub private_data: Vec<u8>,
}

impl RepRepr {
    fn parse(d: &[u8]) -> RepRepr {
        RepRepr {
            local_comm_id: u32_at(d, 0),
            remote_comm_id: u32_at(d, 4),
            local_qkey: u32_at(d, 8),
            local_qpn: Qpn::new(u24_at(d, 12)),
            starting_psn: Psn::new(u24_at(d, 20)),
            responder_resources: d[24],
            initiator_depth: d[25],
            target_ack_delay: d[26] >> 3,
            failover_accepted: (d[26] >> 1) & 3,
            e2e_flow_control: d[26] & 1 != 0,
            rnr_retry_count: d[27] >> 5,
            srq: d[27] & 0x10 != 0,
            local_ca_guid: u64_at(d, 28),
            private_data: d[36..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        d[..36].fill(0);
        set_u32(d, 0, self.local_comm_id);
        set_u32(d, 4, self.remote_comm_id);
        set_u32(d, 8, self.local_qkey);
        set_u24(d, 12, self.local_qpn.value());
        set_u24(d, 20, self.starting_psn.value());
        d[24] = self.responder_resources;
        d[25] = self.initiator_depth;
        d[26] = ((self.target_ack_delay & 0x1f) << 3)
            | ((self.failover_accepted & 3) << 1)
            | u8::from(self.e2e_flow_control);
        d[27] = ((self.rnr_retry_count & 7) << 5) | (u8::from(self.srq) << 4);
        set_u64(d, 28, self.local_ca_guid);
        put_private(&mut d[36..232], &self.private_data)
    }
}

/// The two communication IDs and private data: RTU and DREP.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdsRepr {
    /// Sender's communication ID.
    pub local_comm_id: u32,
    /// Receiver's communication ID.
    pub remote_comm_id: u32,
    /// Private data (up to 224 bytes).
    pub private_data: Vec<u8>,
}

impl IdsRepr {
    fn parse(d: &[u8]) -> IdsRepr {
        IdsRepr { local_comm_id: u32_at(d, 0), remote_comm_id: u32_at(d, 4), private_data: d[8..232].to_vec() }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        set_u32(d, 0, self.local_comm_id);
        set_u32(d, 4, self.remote_comm_id);
        put_private(&mut d[8..232], &self.private_data)
    }
}

/// Reject.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RejRepr {
    /// Sender's communication ID (0 if it has none).
    pub local_comm_id: u32,
    /// Receiver's communication ID.
    pub remote_comm_id: u32,
    /// Which message is rejected: 0 REQ, 1 REP, 2 other.
    pub msg_rejected: u8,
    /// Reason ([`reason`]).
    pub reason: u16,
    /// Additional rejection information (up to 72 bytes).
    pub ari: Vec<u8>,
    /// Private data (up to 148 bytes).
    pub private_data: Vec<u8>,
}

impl RejRepr {
    fn parse(d: &[u8]) -> RejRepr {
        let ari_len = usize::from(d[9] >> 1).min(72);
        RejRepr {
            local_comm_id: u32_at(d, 0),
            remote_comm_id: u32_at(d, 4),
            msg_rejected: d[8] >> 6,
            reason: u16_at(d, 10),
            ari: d[12..12 + ari_len].to_vec(),
            private_data: d[84..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        if self.ari.len() > 72 {
            return Err(Error::BadLength);
        }
        set_u32(d, 0, self.local_comm_id);
        set_u32(d, 4, self.remote_comm_id);
        d[8] = (self.msg_rejected & 3) << 6;
        d[9] = (self.ari.len() as u8) << 1;
        set_u16(d, 10, self.reason);
        put_private(&mut d[12..84], &self.ari)?;
        put_private(&mut d[84..232], &self.private_data)
    }
}

/// Message receipt acknowledgement: "I got it, give me more time".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MraRepr {
    /// Sender's communication ID.
    pub local_comm_id: u32,
    /// Receiver's communication ID.
    pub remote_comm_id: u32,
    /// Which message: 0 REQ, 1 REP, 2 LAP.
    pub msg_mraed: u8,
    /// Service timeout (5 bits): 4.096 µs × 2^t more.
    pub service_timeout: u8,
    /// Private data (up to 222 bytes).
    pub private_data: Vec<u8>,
}

impl MraRepr {
    fn parse(d: &[u8]) -> MraRepr {
        MraRepr {
            local_comm_id: u32_at(d, 0),
            remote_comm_id: u32_at(d, 4),
            msg_mraed: d[8] >> 6,
            service_timeout: d[9] >> 3,
            private_data: d[10..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        set_u32(d, 0, self.local_comm_id);
        set_u32(d, 4, self.remote_comm_id);
        d[8] = (self.msg_mraed & 3) << 6;
        d[9] = (self.service_timeout & 0x1f) << 3;
        put_private(&mut d[10..232], &self.private_data)
    }
}

/// Disconnect request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DreqRepr {
    /// Sender's communication ID.
    pub local_comm_id: u32,
    /// Receiver's communication ID.
    pub remote_comm_id: u32,
    /// The receiver's QPN.
    pub remote_qpn: Qpn,
    /// Private data (up to 220 bytes).
    pub private_data: Vec<u8>,
}

impl DreqRepr {
    fn parse(d: &[u8]) -> DreqRepr {
        DreqRepr {
            local_comm_id: u32_at(d, 0),
            remote_comm_id: u32_at(d, 4),
            remote_qpn: Qpn::new(u24_at(d, 8)),
            private_data: d[12..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        set_u32(d, 0, self.local_comm_id);
        set_u32(d, 4, self.remote_comm_id);
        set_u24(d, 8, self.remote_qpn.value());
        d[11] = 0;
        put_private(&mut d[12..232], &self.private_data)
    }
}

/// Service ID resolution request (UD).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SidrReqRepr {
    /// Request ID.
    pub request_id: u32,
    /// P_Key.
    pub pkey: u16,
    /// Service ID.
    pub service_id: u64,
    /// Private data (up to 216 bytes).
    pub private_data: Vec<u8>,
}

impl SidrReqRepr {
    fn parse(d: &[u8]) -> SidrReqRepr {
        SidrReqRepr {
            request_id: u32_at(d, 0),
            pkey: u16_at(d, 4),
            service_id: u64_at(d, 8),
            private_data: d[16..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        set_u32(d, 0, self.request_id);
        set_u16(d, 4, self.pkey);
        set_u16(d, 6, 0);
        set_u64(d, 8, self.service_id);
        put_private(&mut d[16..232], &self.private_data)
    }
}

/// Service ID resolution reply (UD).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SidrRepRepr {
    /// Request ID.
    pub request_id: u32,
    /// Status: 0 valid, 1 service ID not supported, 2 rejected, 3 no QP, 4 redirect, 5 bad version.
    pub status: u8,
    /// QPN of the service.
    pub qpn: Qpn,
    /// Service ID.
    pub service_id: u64,
    /// Q_Key of the service.
    pub qkey: u32,
    /// Private data (up to 136 bytes).
    pub private_data: Vec<u8>,
}

impl SidrRepRepr {
    fn parse(d: &[u8]) -> SidrRepRepr {
        SidrRepRepr {
            request_id: u32_at(d, 0),
            status: d[4],
            qpn: Qpn::new(u24_at(d, 8)),
            service_id: u64_at(d, 12),
            qkey: u32_at(d, 20),
            private_data: d[96..232].to_vec(),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        d[..96].fill(0);
        set_u32(d, 0, self.request_id);
        d[4] = self.status;
        set_u24(d, 8, self.qpn.value());
        set_u64(d, 12, self.service_id);
        set_u32(d, 20, self.qkey);
        put_private(&mut d[96..232], &self.private_data)
    }
}

/// A CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CmMessage {
    /// REQ.
    Req(ReqRepr),
    /// MRA.
    Mra(MraRepr),
    /// REJ.
    Rej(RejRepr),
    /// REP.
    Rep(RepRepr),
    /// RTU.
    Rtu(IdsRepr),
    /// DREQ.
    Dreq(DreqRepr),
    /// DREP.
    Drep(IdsRepr),
    /// SIDR_REQ.
    SidrReq(SidrReqRepr),
    /// SIDR_REP.
    SidrRep(SidrRepRepr),
}

impl CmMessage {
    /// The attribute ID of this message.
    pub fn attribute_id(&self) -> u16 {
        match self {
            CmMessage::Req(_) => attr::REQ,
            CmMessage::Mra(_) => attr::MRA,
            CmMessage::Rej(_) => attr::REJ,
            CmMessage::Rep(_) => attr::REP,
            CmMessage::Rtu(_) => attr::RTU,
            CmMessage::Dreq(_) => attr::DREQ,
            CmMessage::Drep(_) => attr::DREP,
            CmMessage::SidrReq(_) => attr::SIDR_REQ,
            CmMessage::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// Name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            CmMessage::Req(_) => "REQ",
            CmMessage::Mra(_) => "MRA",
            CmMessage::Rej(_) => "REJ",
            CmMessage::Rep(_) => "REP",
            CmMessage::Rtu(_) => "RTU",
            CmMessage::Dreq(_) => "DREQ",
            CmMessage::Drep(_) => "DREP",
            CmMessage::SidrReq(_) => "SIDR_REQ",
            CmMessage::SidrRep(_) => "SIDR_REP",
        }
    }

    /// Parse a whole MAD holding a CM message: class 0x07, version 2. Unknown attributes are
    /// [`Error::Reserved`].
    pub fn parse(mad: &[u8]) -> Result<(MadHeader, CmMessage)> {
        let p = MadPacket::new_checked(mad)?;
        let h = MadHeader::parse(&p)?;
        if h.mgmt_class != CLASS_CM {
            return Err(Error::NotRoce);
        }
        if h.class_version != 2 {
            return Err(Error::BadVersion(h.class_version));
        }
        let d = p.data();
        let m = match h.attribute_id {
            attr::REQ => CmMessage::Req(ReqRepr::parse(d)),
            attr::MRA => CmMessage::Mra(MraRepr::parse(d)),
            attr::REJ => CmMessage::Rej(RejRepr::parse(d)),
            attr::REP => CmMessage::Rep(RepRepr::parse(d)),
            attr::RTU => CmMessage::Rtu(IdsRepr::parse(d)),
            attr::DREQ => CmMessage::Dreq(DreqRepr::parse(d)),
            attr::DREP => CmMessage::Drep(IdsRepr::parse(d)),
            attr::SIDR_REQ => CmMessage::SidrReq(SidrReqRepr::parse(d)),
            attr::SIDR_REP => CmMessage::SidrRep(SidrRepRepr::parse(d)),
            _ => return Err(Error::Reserved),
        };
        Ok((h, m))
    }

    /// Emit as a whole 256-byte MAD with transaction ID `tid`.
    pub fn emit(&self, tid: u64, buf: &mut [u8]) -> Result<()> {
        if buf.len() < MAD_LEN {
            return Err(Error::Truncated);
        }
        MadHeader::cm(self.attribute_id(), tid).emit(buf)?;
        let d = &mut buf[MAD_HEADER_LEN..MAD_LEN];
        match self {
            CmMessage::Req(m) => m.emit(d),
            CmMessage::Mra(m) => m.emit(d),
            CmMessage::Rej(m) => m.emit(d),
            CmMessage::Rep(m) => m.emit(d),
            CmMessage::Rtu(m) | CmMessage::Drep(m) => m.emit(d),
            CmMessage::Dreq(m) => m.emit(d),
            CmMessage::SidrReq(m) => m.emit(d),
            CmMessage::SidrRep(m) => m.emit(d),
        }
    }
}

/// The header rdma_cm puts at the start of a REQ's (and SIDR_REQ's) private data: version, IP
/// version, the active side's port and both IP addresses (IPv4 in the last 4 of 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmaHeader {
    /// Source (active side) port.
    pub src_port: u16,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
}

impl CmaHeader {
    /// Length of the header.
    pub const LEN: usize = 36;

    /// Parse from the start of private data.
    pub fn parse(b: &[u8]) -> Result<CmaHeader> {
        if b.len() < Self::LEN {
            return Err(Error::Truncated);
        }
        if b[0] != 0 {
            return Err(Error::BadVersion(b[0]));
        }
        let addr = |at: usize, v6: bool| -> IpAddr {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[at..at + 16]);
            if v6 {
                IpAddr::V6(Ipv6Addr::from(a))
            } else {
                IpAddr::V4(Ipv4Addr::new(a[12], a[13], a[14], a[15]))
            }
        };
        let v6 = match b[1] >> 4 {
            4 => false,
            6 => true,
            v => return Err(Error::BadVersion(v)),
        };
        Ok(CmaHeader { src_port: u16_at(b, 2), src: addr(4, v6), dst: addr(20, v6) })
    }

    /// Emit into the first 36 bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        if b.len() < Self::LEN {
            return Err(Error::Truncated);
        }
        let put = |b: &mut [u8], a: IpAddr| match a {
            IpAddr::V4(v4) => {
                b[..12].fill(0);
                b[12..16].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => b.copy_from_slice(&v6.octets()),
        };
        b[0] = 0;
        b[1] = if self.src.is_ipv4() { 0x40 } else { 0x60 };
        set_u16(b, 2, self.src_port);
        put(&mut b[4..20], self.src);
        put(&mut b[20..36], self.dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ReqRepr {
        let mut pd = vec![0u8; 36];
        CmaHeader { src_port: 0xa577, src: "10.77.0.12".parse().unwrap(), dst: "10.77.0.11".parse().unwrap() }
            .emit(&mut pd)
            .unwrap();
        let gid = |last: u8| {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(&[10, 77, 0, last]);
            g
        };
        ReqRepr {
            local_comm_id: 0xa51e_6e7a,
            service_id: service_id(port_space::TCP, 0x1c06),
            local_ca_guid: 0x5054_00ff_fe77_0012,
            local_qpn: Qpn::new(0x19),
            responder_resources: 1,
            initiator_depth: 1,
            remote_cm_response_timeout: 0x14,
            starting_psn: Psn::new(0xed7333),
            local_cm_response_timeout: 0x14,
            retry_count: 7,
            pkey: 0xffff,
            path_mtu: 3,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            primary: PathRepr {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: gid(12),
                remote_gid: gid(11),
                flow_label: 0x4256f,
                hop_limit: 0x40,
                local_ack_timeout: 0x13,
                ..PathRepr::default()
            },
            private_data: pd,
            ..ReqRepr::default()
        }
    }

    #[test]
    fn req_matches_the_kernel_bytes() {
        // The first 96 data bytes of the REQ in rxe_rdmacm.pcap, and its private data header.
        let want: [&str; 6] = [
            "a51e6e7a00000000000000000106",
            "1c06505400fffe77001200000000000000000000",
            "1901000000010000 00a0ed7333a7",
            "ffff37f0ffffffff0000000000000000",
            "0000ffff0a4d000c0000000000000000",
            "0000ffff0a4d000b4256f00000400098",
        ];
        let hex: String = want.concat().replace(' ', "");
        let bytes: Vec<u8> =
            (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
        let mut mad = [0xa5u8; MAD_LEN];
        CmMessage::Req(req()).emit(0x2_7a6e_1ea5, &mut mad).unwrap();
        assert_eq!(&mad[24..24 + 96], &bytes[..]);
        assert_eq!(&mad[24 + 140..24 + 144], &[0x00, 0x40, 0xa5, 0x77]);
        let (h, m) = CmMessage::parse(&mad).unwrap();
        assert_eq!(h.transaction_id, 0x2_7a6e_1ea5);
        let CmMessage::Req(r) = m else { panic!("not a REQ") };
        let mut want_req = req();
        want_req.private_data.resize(private_len::REQ, 0);
        assert_eq!(r, want_req);
        let cma = CmaHeader::parse(&r.private_data).unwrap();
        assert_eq!(cma.src_port, 0xa577);
        assert_eq!(cma.dst, "10.77.0.11".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn every_message_round_trips() {
        let msgs = vec![
            CmMessage::Rep(RepRepr {
                local_comm_id: 0xc31d_001b,
                remote_comm_id: 0xa51e_6e7a,
                local_qpn: Qpn::new(0x19),
                starting_psn: Psn::new(0xfdac9d),
                responder_resources: 1,
                initiator_depth: 1,
                target_ack_delay: 15,
                rnr_retry_count: 7,
                local_ca_guid: 0x5054_00ff_fe77_0011,
                private_data: vec![0; private_len::REP],
                ..RepRepr::default()
            }),
            CmMessage::Rtu(IdsRepr { local_comm_id: 1, remote_comm_id: 2, private_data: vec![0; private_len::RTU] }),
            CmMessage::Drep(IdsRepr { local_comm_id: 1, remote_comm_id: 2, private_data: vec![7; private_len::RTU] }),
            CmMessage::Dreq(DreqRepr {
                local_comm_id: 3,
                remote_comm_id: 4,
                remote_qpn: Qpn::new(0x19),
                private_data: vec![0; private_len::DREQ],
            }),
            CmMessage::Rej(RejRepr {
                local_comm_id: 5,
                remote_comm_id: 6,
                msg_rejected: 0,
                reason: reason::CONSUMER_REJECT,
                ari: vec![1, 2],
                private_data: vec![9; private_len::REJ],
            }),
            CmMessage::Mra(MraRepr {
                local_comm_id: 7,
                remote_comm_id: 8,
                msg_mraed: 1,
                service_timeout: 20,
                private_data: vec![0; private_len::MRA],
            }),
            CmMessage::SidrReq(SidrReqRepr {
                request_id: 9,
                pkey: 0xffff,
                service_id: service_id(port_space::UDP, 7),
                private_data: vec![0; private_len::SIDR_REQ],
            }),
            CmMessage::SidrRep(SidrRepRepr {
                request_id: 9,
                status: 0,
                qpn: Qpn::new(0x33),
                service_id: 7,
                qkey: 0x0123_4567,
                private_data: vec![0; private_len::SIDR_REP],
            }),
        ];
        for m in msgs {
            let mut mad = [0xa5u8; MAD_LEN];
            m.emit(42, &mut mad).unwrap();
            let (h, back) = CmMessage::parse(&mad).unwrap();
            assert_eq!((h.attribute_id, h.transaction_id), (m.attribute_id(), 42));
            assert_eq!(back, m, "{}", m.name());
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut mad = [0u8; MAD_LEN];
        CmMessage::Rtu(IdsRepr::default()).emit(1, &mut mad).unwrap();
        assert!(CmMessage::parse(&mad[..200]).is_err());
        mad[17] = 0x99;
        assert_eq!(CmMessage::parse(&mad).unwrap_err(), Error::Reserved);
        mad[2] = 1;
        assert_eq!(CmMessage::parse(&mad).unwrap_err(), Error::BadVersion(1));
        let too_long = CmMessage::Rtu(IdsRepr { private_data: vec![0; 300], ..IdsRepr::default() });
        assert_eq!(too_long.emit(1, &mut [0u8; MAD_LEN]), Err(Error::BadLength));
        assert!(CmaHeader::parse(&[0u8; 10]).is_err());
        assert!(CmaHeader::parse(&[0u8; 36]).is_err(), "IP version 0");
    }
}
