//! Replaying captures of Linux rxe against the engine.
//!
//! A capture of two kernels talking holds, for one RC connection, everything each host's QP sent and
//! received. [`Replay`] plays one of the two hosts with our engine: it creates a QP with the captured
//! QPN and PSNs, feeds it the packets the *other* host sent, in capture order and at capture time,
//! and records what our engine transmits. The test posts the work requests the tool posted and then
//! compares our packets with the ones the kernel sent from the same host ([`assert_same`]), and our
//! completions and memory with what the tool reported.
//!
//! Driving rules, chosen so that differences come from the engine and not from the harness:
//!
//! - Time is virtual and follows the capture: frame `n` is processed at its timestamp (relative to the
//!   first frame, plus one second). Timers that expire between two frames fire at their own deadline.
//! - Everything our engine has to send is drained after every input (packet, timer, verb), as rxe's
//!   per-packet tasklets do. Responses therefore go out as soon as the request arrives; requests as
//!   soon as they are posted and the window allows. [`Replay::set_batched`] drains only after each
//!   run of back-to-back packets from the peer instead, as the verbs runtime does under load.
//! - After the last frame the clock runs on for a second, so a retransmission we would make (because
//!   something stayed unacknowledged) shows up as an extra packet.
//!
//! Comparisons: [`assert_same`] (every field, in order), [`assert_not_later`] (we never needed more
//! input than the kernel had), [`assert_acks_coalesced`] (the one allowed difference of batched
//! driving) and [`acks_due`] (the ACKs an RC responder owes, modelled from the AckReq packets).
//! [`Replay::pcap_on_failure`] leaves a pcap of the replay behind when a test fails.

use core::fmt;
use core::time::Duration;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use softrdma_transport::attr::QpCap;
use softrdma_transport::{
    Access, AddressVector, Config, CqId, Hca, Instant, ModifyQp, Mtu, PdId, QpInit, QpState, QpType, RecvWr, RxInfo,
    SendWr, WorkCompletion,
};
use softrdma_wire::capture::{classify, Classified, LinkType, PcapReader, PcapWriter};
use softrdma_wire::opcode::Flags;
use softrdma_wire::roce::{IpRepr, RoceV2Packet, RoceV2Repr};
use softrdma_wire::{IbPacket, IbRepr, OpcodeInfo, Psn, Qpn};

use crate::memory::SimMemory;

/// Offset added to capture-relative times, so that setup happens strictly before the first frame.
const EPOCH: Duration = Duration::from_secs(1);

/// How long the clock runs on after the last frame.
const SETTLE: Duration = Duration::from_secs(1);

/// One RoCEv2 packet of a capture.
#[derive(Debug, Clone)]
pub struct CapturedPacket {
    /// Frame number, counted from 1 as tcpdump and Wireshark do.
    pub frame: usize,
    /// Capture time, relative to the first frame (plus one second).
    pub at: Instant,
    /// IP source.
    pub src: IpAddr,
    /// IP destination.
    pub dst: IpAddr,
    /// The IB transport packet, BTH through ICRC.
    pub ib: Vec<u8>,
}

impl CapturedPacket {
    /// The headers and payload.
    pub fn packet(&self) -> Packet {
        Packet::parse(&self.ib).unwrap_or_else(|e| panic!("frame {}: {e}", self.frame))
    }
}

/// Every RoCEv2 packet of a pcap file, with its ICRC checked.
pub fn load(path: &Path) -> Vec<CapturedPacket> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reader = PcapReader::new(&data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let link = reader.link_type();
    let mut out = Vec::new();
    let mut first = None;
    for (i, frame) in reader.enumerate() {
        let frame = frame.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let ns = u64::from(frame.ts_sec) * 1_000_000_000 + u64::from(frame.ts_nsec);
        let t0 = *first.get_or_insert(ns);
        let Classified::RoceV2(ip) = classify(link, frame.data) else {
            continue;
        };
        let p = RoceV2Packet::parse_verified(ip).unwrap_or_else(|e| panic!("{} frame {}: {e}", path.display(), i + 1));
        let (src, dst) = match p.ip() {
            IpRepr::V4(v4) => (IpAddr::V4(v4.src_addr), IpAddr::V4(v4.dst_addr)),
            IpRepr::V6(v6) => (IpAddr::V6(v6.src_addr), IpAddr::V6(v6.dst_addr)),
        };
        out.push(CapturedPacket {
            frame: i + 1,
            at: Instant::from_nanos(ns - t0) + EPOCH,
            src,
            dst,
            ib: p.ib().as_bytes().to_vec(),
        });
    }
    out
}

/// An IB packet's headers as values and its payload: what [`assert_same`] compares.
#[derive(Clone, PartialEq, Eq)]
pub struct Packet {
    /// Every header field.
    pub repr: IbRepr,
    /// Payload bytes (without pad).
    pub payload: Vec<u8>,
}

impl Packet {
    /// Parse a transport packet (BTH through ICRC).
    pub fn parse(ib: &[u8]) -> softrdma_wire::Result<Packet> {
        let p = IbPacket::new_checked(ib)?;
        Ok(Packet { repr: IbRepr::parse(&p)?, payload: p.payload().to_vec() })
    }

    /// The opcode table entry.
    pub fn info(&self) -> &'static OpcodeInfo {
        self.repr.bth.opcode.info().expect("parsed packets have known opcodes")
    }

    /// An ACK, atomic ACK or read response (sent by a responder).
    pub fn is_response(&self) -> bool {
        self.info().is(Flags::RESP)
    }

    /// The PSN.
    pub fn psn(&self) -> Psn {
        self.repr.bth.psn
    }

    /// Field-by-field differences from `kernel`, one line each (empty when equal).
    pub fn diff(&self, kernel: &Packet) -> Vec<String> {
        let mut d = Vec::new();
        let (a, b) = (&self.repr.bth, &kernel.repr.bth);
        let mut field = |name: &str, ours: String, theirs: String| {
            if ours != theirs {
                d.push(format!("{name}: ours {ours}, kernel {theirs}"));
            }
        };
        field("opcode", a.opcode.to_string(), b.opcode.to_string());
        field("psn", a.psn.to_string(), b.psn.to_string());
        field("dest qp", a.dest_qp.to_string(), b.dest_qp.to_string());
        field("AckReq", a.ack_req.to_string(), b.ack_req.to_string());
        field("SE", a.solicited.to_string(), b.solicited.to_string());
        field("MigReq", a.mig_req.to_string(), b.mig_req.to_string());
        field("pad", a.pad.to_string(), b.pad.to_string());
        field("pkey", format!("{:#06x}", a.pkey), format!("{:#06x}", b.pkey));
        field("FECN", a.fecn.to_string(), b.fecn.to_string());
        field("BECN", a.becn.to_string(), b.becn.to_string());
        let (a, b) = (&self.repr, &kernel.repr);
        field("DETH", format!("{:?}", a.deth), format!("{:?}", b.deth));
        field("RETH", format!("{:x?}", a.reth), format!("{:x?}", b.reth));
        field("AtomicETH", format!("{:x?}", a.atomic_eth), format!("{:x?}", b.atomic_eth));
        field(
            "AETH syndrome",
            format!("{:?}", a.aeth.map(|x| x.syndrome)),
            format!("{:?}", b.aeth.map(|x| x.syndrome)),
        );
        field("AETH MSN", format!("{:x?}", a.aeth.map(|x| x.msn)), format!("{:x?}", b.aeth.map(|x| x.msn)));
        field("AtomicAckETH", format!("{:x?}", a.atomic_ack_eth), format!("{:x?}", b.atomic_ack_eth));
        field("ImmDt", format!("{:x?}", a.imm), format!("{:x?}", b.imm));
        field("IETH", format!("{:x?}", a.ieth), format!("{:x?}", b.ieth));
        field("payload length", self.payload.len().to_string(), kernel.payload.len().to_string());
        if self.payload.len() == kernel.payload.len() {
            if let Some(i) = (0..self.payload.len()).find(|&i| self.payload[i] != kernel.payload[i]) {
                d.push(format!("payload differs from byte {i}"));
            }
        }
        d
    }
}

impl fmt::Debug for Packet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.repr.bth;
        write!(f, "{} psn {} qp {}", b.opcode, b.psn, b.dest_qp)?;
        if b.ack_req {
            write!(f, " A")?;
        }
        if b.solicited {
            write!(f, " SE")?;
        }
        if let Some(r) = &self.repr.reth {
            write!(f, " RETH va {:#x} rkey {:#x} len {}", r.va, r.rkey, r.dma_len)?;
        }
        if let Some(a) = &self.repr.atomic_eth {
            write!(
                f,
                " AtomicETH va {:#x} rkey {:#x} swap/add {:#x} compare {:#x}",
                a.va, a.rkey, a.swap_add, a.compare
            )?;
        }
        if let Some(a) = &self.repr.aeth {
            write!(f, " AETH {:?} msn {:#x}", a.syndrome, a.msn)?;
        }
        if let Some(a) = &self.repr.atomic_ack_eth {
            write!(f, " orig {:#x}", a.orig)?;
        }
        if let Some(i) = self.repr.imm {
            write!(f, " imm {i:#010x}")?;
        }
        if !self.payload.is_empty() {
            write!(f, " payload {} B", self.payload.len())?;
        }
        Ok(())
    }
}

/// A packet in a stream, with where and when it was sent: for the kernel's, the capture frame and
/// its time; for ours, the last frame processed before we sent it (0: none yet) and our clock.
#[derive(Debug, Clone)]
pub struct Tagged {
    /// Frame number (see above).
    pub frame: usize,
    /// Time sent.
    pub at: Instant,
    /// The packet.
    pub packet: Packet,
}

/// The requests of a stream (SEND, WRITE, READ request, atomics).
pub fn requests(s: &[Tagged]) -> Vec<Tagged> {
    s.iter().filter(|t| !t.packet.is_response()).cloned().collect()
}

/// The responses of a stream (ACK, atomic ACK, read responses).
pub fn responses(s: &[Tagged]) -> Vec<Tagged> {
    s.iter().filter(|t| t.packet.is_response()).cloned().collect()
}

/// Assert that two streams carry the same packets in the same order, every header field and every
/// payload byte equal. Panics naming the first packet that differs and each differing field.
#[track_caller]
pub fn assert_same(what: &str, ours: &[Tagged], kernel: &[Tagged]) {
    for (i, (o, k)) in ours.iter().zip(kernel).enumerate() {
        let d = o.packet.diff(&k.packet);
        assert!(
            d.is_empty(),
            "{what}: packet {i} differs (ours after frame {}, kernel frame {}):\n  ours   {:?}\n  kernel {:?}\n  {}",
            o.frame,
            k.frame,
            o.packet,
            k.packet,
            d.join("\n  ")
        );
    }
    if ours.len() != kernel.len() {
        let extra: Vec<_> = if ours.len() > kernel.len() {
            ours[kernel.len()..].iter().take(5).collect()
        } else {
            kernel[ours.len()..].iter().take(5).collect()
        };
        panic!("{what}: we sent {} packets, the kernel {}; the first unmatched: {extra:#?}", ours.len(), kernel.len());
    }
}

/// Assert that we sent each packet no later than the kernel did: packet `i` of ours left before the
/// frame that carried the kernel's packet `i` was captured. The kernel's packet was sent knowing only
/// the frames before it, so an engine that needs more input (a smaller window, a delayed ACK) fails
/// here. Earlier is allowed: the kernel's guests were slow (TCG) and their pacing is not ours.
#[track_caller]
pub fn assert_not_later(what: &str, ours: &[Tagged], kernel: &[Tagged]) {
    for (i, (o, k)) in ours.iter().zip(kernel).enumerate() {
        assert!(
            o.frame < k.frame,
            "{what}: packet {i} ({:?}) went out only after frame {}; the kernel sent it as frame {}",
            o.packet,
            o.frame,
            k.frame
        );
    }
}

/// A plain ACK (not a NAK, not an atomic ACK, not a read response).
fn is_plain_ack(t: &Tagged) -> bool {
    let p = &t.packet;
    p.repr.bth.opcode.base() == softrdma_wire::opcode::base::ACKNOWLEDGE
        && matches!(p.repr.aeth.map(|a| a.syndrome), Some(softrdma_wire::Syndrome::Ack { .. }))
}

/// The (PSN, MSN) of every plain ACK of a stream, in order.
pub fn plain_acks(s: &[Tagged]) -> Vec<(Psn, u32)> {
    s.iter().filter(|t| is_plain_ack(t)).map(|t| (t.packet.psn(), t.packet.repr.aeth.map_or(0, |a| a.msn))).collect()
}

/// The plain ACKs an RC responder owes for `inbound` requests, starting at `first_psn` with path MTU
/// `mtu`, when it
/// answers each request as it arrives and only when asked: one for each SEND or WRITE packet with
/// AckReq set, carrying its PSN and the MSN — the number of messages completed so far, a READ
/// counting when it arrives (IBA C9-148) and an atomic when executed. A duplicate SEND or WRITE is
/// acknowledged again at the newest PSN received, with the current MSN (C9-105). Reads and atomics
/// are answered by their own responses, not by ACKs. Assumes no loss, NAK or RNR.
pub fn acks_due(inbound: &[Tagged], first_psn: Psn, mtu: usize) -> Vec<(Psn, u32)> {
    let mut epsn = first_psn;
    let mut msn = 0u32;
    let mut due = Vec::new();
    for t in inbound {
        let info = t.packet.info();
        let psn = t.packet.psn();
        let plain = info.is(Flags::SEND) || info.is(Flags::WRITE);
        if psn.before(epsn) {
            if plain {
                due.push((epsn.sub(1), msn));
            }
            continue;
        }
        if info.is(Flags::READ) {
            let len = t.packet.repr.reth.map_or(0, |r| r.dma_len);
            epsn = psn.add((len as usize).div_ceil(mtu).max(1) as u32);
            msn += 1;
            continue;
        }
        epsn = psn.next();
        if info.ends_message() {
            msn += 1;
        }
        if plain && t.packet.repr.bth.ack_req {
            due.push((psn, msn));
        }
    }
    due
}

/// Compare response streams when our responder may coalesce ACKs and the kernel's did not.
///
/// An ACK for PSN `n` acknowledges every request up to `n` and a responder may coalesce its
/// acknowledgements (IBA vol. 1, 9.7.5.1), so when several requests asking for an ACK are received
/// before it transmits, our responder sends only the newest ACK. rxe answers each one from its
/// tasklet as it comes. Checked:
///
/// - everything but plain ACKs (NAKs, atomic ACKs, read responses) is identical and in order;
/// - each ACK of ours is one of the kernel's, every field equal (so the PSN is one that asked for an
///   ACK, and the MSN is the count of messages completed at that PSN), in the kernel's order;
/// - each of the kernel's ACKs is covered by one of ours with the same or a later PSN, sent before
///   the kernel's went out.
///
/// Returns how many ACKs we sent and how many the kernel did.
#[track_caller]
pub fn assert_acks_coalesced(what: &str, ours: &[Tagged], kernel: &[Tagged]) -> (usize, usize) {
    let others = |s: &[Tagged]| -> Vec<Tagged> { s.iter().filter(|t| !is_plain_ack(t)).cloned().collect() };
    let (o, k) = (others(ours), others(kernel));
    assert_same(&format!("{what} (other than ACKs)"), &o, &k);
    assert_not_later(&format!("{what} (other than ACKs)"), &o, &k);
    let acks = |s: &[Tagged]| -> Vec<Tagged> { s.iter().filter(|t| is_plain_ack(t)).cloned().collect() };
    let (ours, kernel) = (acks(ours), acks(kernel));
    let mut at = 0;
    for o in &ours {
        let found = kernel[at..].iter().position(|k| o.packet.diff(&k.packet).is_empty());
        let Some(j) = found else {
            panic!("{what}: our ACK {:?} (after frame {}) is none of the kernel's remaining ACKs", o.packet, o.frame);
        };
        at += j + 1;
    }
    for k in &kernel {
        let covered = ours.iter().any(|o| o.frame < k.frame && o.packet.psn().diff(k.packet.psn()) >= 0);
        assert!(
            covered,
            "{what}: the kernel's ACK {:?} (frame {}) has no ACK of ours covering it in time",
            k.packet, k.frame
        );
    }
    (ours.len(), kernel.len())
}

/// The QP and its attributes for one replayed host.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// The host we play.
    pub ip: IpAddr,
    /// The other host.
    pub peer_ip: IpAddr,
    /// Our QPN (as the tool printed it).
    pub qpn: Qpn,
    /// The peer's QPN.
    pub dest_qpn: Qpn,
    /// First PSN our requester sends.
    pub sq_psn: Psn,
    /// First PSN our responder expects (the peer's first request PSN).
    pub rq_psn: Psn,
    /// Path MTU.
    pub mtu: Mtu,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// RNR timer code sent in RNR NAKs.
    pub min_rnr_timer: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// Remote access rights of the QP.
    pub access: Access,
    /// Work queue depths.
    pub depth: u32,
    /// Engine configuration.
    pub config: Config,
}

impl Setup {
    /// An RC QP with the attributes of `ibv_rc_pingpong` and perftest (MTU 1024, timeout 14, retry
    /// and RNR retry 7, RNR timer 12, one read/atomic each way) and every remote right.
    pub fn rc(ip: IpAddr, peer_ip: IpAddr, qpn: u32, dest_qpn: u32, sq_psn: u32, rq_psn: u32) -> Setup {
        Setup {
            ip,
            peer_ip,
            qpn: Qpn::new(qpn),
            dest_qpn: Qpn::new(dest_qpn),
            sq_psn: Psn::new(sq_psn),
            rq_psn: Psn::new(rq_psn),
            mtu: Mtu::M1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            access: Access::LOCAL_WRITE
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_READ)
                .with(Access::REMOTE_ATOMIC),
            depth: 1024,
            config: Config::default(),
        }
    }
}

/// One host of a capture, played by our engine.
pub struct Replay {
    /// The setup it was made with.
    pub setup: Setup,
    /// The engine.
    pub hca: Hca,
    /// Registered memory.
    pub mem: SimMemory,
    /// Protection domain of the QP and of the regions tests register.
    pub pd: PdId,
    /// The one CQ for sends and receives (as `ibv_rc_pingpong` has).
    pub cq: CqId,
    frames: Vec<CapturedPacket>,
    next: usize,
    now: Instant,
    last_frame: usize,
    batched: bool,
    sent: Vec<Tagged>,
    buf: Vec<u8>,
    /// Every packet fed and sent, in order, for the failure pcap.
    log: Vec<(Instant, IpAddr, IpAddr, Vec<u8>)>,
    pcap_on_failure: Option<PathBuf>,
}

impl Replay {
    /// Create the QP of `setup` at its QPN and bring it to RTS, and keep the frames of `capture`
    /// that belong to this connection: RC packets from us to the peer's QP and from the peer to ours.
    pub fn new(capture: &[CapturedPacket], setup: Setup) -> Replay {
        let frames: Vec<CapturedPacket> = capture
            .iter()
            .filter(|c| {
                let p = c.packet();
                let rc = p.info().qp_type == softrdma_wire::QpType::Rc;
                let qp = p.repr.bth.dest_qp;
                rc && ((c.src == setup.ip && c.dst == setup.peer_ip && qp == setup.dest_qpn)
                    || (c.src == setup.peer_ip && c.dst == setup.ip && qp == setup.qpn))
            })
            .cloned()
            .collect();
        assert!(!frames.is_empty(), "no frames of this connection");
        let mut hca = Hca::new(setup.config);
        let mut mem = SimMemory::new();
        let pd = PdId(1);
        let cq = hca.create_cq(setup.depth * 4);
        let cap = QpCap {
            max_send_wr: setup.depth,
            max_recv_wr: setup.depth,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        };
        let init = QpInit { qp_type: QpType::Rc, pd, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
        let qpn = hca.create_qp_with_qpn(init, setup.qpn).expect("QP at the captured QPN");
        let now = Instant::ZERO;
        let steps = [
            ModifyQp {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(1),
                access: Some(setup.access),
                ..Default::default()
            },
            ModifyQp {
                state: Some(QpState::Rtr),
                av: Some(AddressVector::default()),
                path_mtu: Some(setup.mtu),
                dest_qpn: Some(setup.dest_qpn),
                rq_psn: Some(setup.rq_psn),
                max_dest_rd_atomic: Some(setup.max_dest_rd_atomic),
                min_rnr_timer: Some(setup.min_rnr_timer),
                ..Default::default()
            },
            ModifyQp {
                state: Some(QpState::Rts),
                sq_psn: Some(setup.sq_psn),
                timeout: Some(setup.timeout),
                retry_cnt: Some(setup.retry_cnt),
                rnr_retry: Some(setup.rnr_retry),
                max_rd_atomic: Some(setup.max_rd_atomic),
                ..Default::default()
            },
        ];
        for m in &steps {
            hca.modify_qp(qpn, m, now, &mut mem).expect("modify QP");
        }
        let now = frames[0].at;
        Replay {
            setup,
            hca,
            mem,
            pd,
            cq,
            frames,
            next: 0,
            now,
            last_frame: 0,
            batched: false,
            sent: Vec::new(),
            buf: vec![0; 8192],
            log: Vec::new(),
            pcap_on_failure: None,
        }
    }

    /// Drive like the verbs runtime under load instead of like rxe's per-packet tasklet: take every
    /// run of back-to-back frames from the peer (no frame of ours between them) as one receive batch,
    /// and transmit only after the batch. Queued plain ACKs then coalesce (see
    /// [`assert_acks_coalesced`]).
    pub fn set_batched(&mut self, on: bool) {
        self.batched = on;
    }

    /// If the thread panics (a failed assertion) while this replay is alive, write what was fed to
    /// our engine and what it sent, in order, to a pcap at `path` (raw IP, RoCEv2, ICRCs filled).
    pub fn pcap_on_failure(&mut self, path: PathBuf) {
        self.pcap_on_failure = Some(path);
    }

    /// Write the packets fed and sent so far as a pcap.
    pub fn write_pcap(&self, path: &Path) -> std::io::Result<()> {
        let file = std::io::BufWriter::new(std::fs::File::create(path)?);
        let mut w = PcapWriter::new(file, LinkType::Raw)?;
        let mut frame = vec![0u8; 16384];
        for (at, src, dst, ib) in &self.log {
            let repr = RoceV2Repr::new(*src, *dst, 0xc000);
            let hl = repr.header_len();
            frame[hl..hl + ib.len()].copy_from_slice(ib);
            let n = repr
                .emit(&mut frame, ib.len())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
            w.write_frame(Duration::from_nanos(at.as_nanos()), &frame[..n])?;
        }
        w.into_inner().map(|_| ())
    }

    /// Whether receive batches are on.
    pub fn batched(&self) -> bool {
        self.batched
    }

    /// The frames of this connection (both directions).
    pub fn frames(&self) -> &[CapturedPacket] {
        &self.frames
    }

    /// What the kernel sent from the host we play, in capture order.
    pub fn kernel_sent(&self) -> Vec<Tagged> {
        self.frames
            .iter()
            .filter(|c| c.src == self.setup.ip)
            .map(|c| Tagged { frame: c.frame, at: c.at, packet: c.packet() })
            .collect()
    }

    /// What the peer sent us, in capture order.
    pub fn kernel_received(&self) -> Vec<Tagged> {
        self.frames
            .iter()
            .filter(|c| c.src == self.setup.peer_ip)
            .map(|c| Tagged { frame: c.frame, at: c.at, packet: c.packet() })
            .collect()
    }

    /// What our engine sent so far.
    pub fn ours(&self) -> &[Tagged] {
        &self.sent
    }

    /// Frames where the kernel's requester on our host started a message (FIRST, ONLY, read
    /// request, atomic), retransmissions left out: the latest moment the tool had posted it.
    pub fn message_starts(&self) -> Vec<usize> {
        let mut seen: Vec<Psn> = Vec::new();
        let mut v = Vec::new();
        for t in requests(&self.kernel_sent()) {
            if t.packet.info().starts_message() && !seen.contains(&t.packet.psn()) {
                seen.push(t.packet.psn());
                v.push(t.frame);
            }
        }
        v
    }

    /// Post a send work request now.
    pub fn post_send(&mut self, wr: SendWr) {
        self.hca.post_send(self.setup.qpn, wr, self.now, &mut self.mem).expect("post_send");
        self.drain();
    }

    /// Post a receive work request now.
    pub fn post_recv(&mut self, wr: RecvWr) {
        self.hca.post_recv(self.setup.qpn, wr, self.now, &mut self.mem).expect("post_recv");
        self.drain();
    }

    /// Post each work request just before the frame where the kernel started the matching message
    /// (see [`Replay::message_starts`]), running the capture in between, then run it to the end.
    pub fn post_sends_as_captured(&mut self, wrs: Vec<SendWr>) {
        let starts = self.message_starts();
        assert_eq!(wrs.len(), starts.len(), "work requests vs messages the kernel started");
        for (wr, frame) in wrs.into_iter().zip(starts) {
            self.run_until(frame);
            self.post_send(wr);
        }
        self.run_to_end();
    }

    /// Process every frame numbered below `frame`.
    pub fn run_until(&mut self, frame: usize) {
        while self.next < self.frames.len() && self.frames[self.next].frame < frame {
            self.step();
        }
        // A post happens at the time of the next frame, just before it.
        if let Some(f) = self.frames.get(self.next) {
            self.advance(f.at);
        }
    }

    /// Process every remaining frame, then let a second pass for timers.
    pub fn run_to_end(&mut self) {
        while self.next < self.frames.len() {
            self.step();
        }
        let end = self.now + SETTLE;
        self.advance(end);
    }

    /// Drain the CQ.
    pub fn completions(&mut self) -> Vec<WorkCompletion> {
        let mut v = Vec::new();
        self.hca.poll_cq(self.cq, usize::MAX, &mut v).expect("CQ exists");
        v
    }

    fn step(&mut self) {
        let f = self.frames[self.next].clone();
        self.next += 1;
        self.advance(f.at);
        if f.src == self.setup.peer_ip {
            let rx = RxInfo { grh: [0; 40] };
            self.hca.handle_packet(self.now, &f.ib, &rx, &mut self.mem);
            self.log.push((self.now, f.src, f.dst, f.ib.clone()));
        }
        self.last_frame = f.frame;
        let more = self.frames.get(self.next).is_some_and(|n| n.src == self.setup.peer_ip);
        if !(self.batched && more) {
            self.drain();
        }
    }

    /// Move the clock to `to`, firing each timer at its own deadline on the way.
    fn advance(&mut self, to: Instant) {
        for _ in 0..10_000 {
            let Some(t) = self.hca.poll_timeout().filter(|t| *t <= to) else {
                self.now = self.now.max(to);
                return;
            };
            self.now = self.now.max(t);
            self.hca.handle_timeout(self.now, &mut self.mem);
            self.drain();
        }
        panic!("timers keep firing");
    }

    fn drain(&mut self) {
        for _ in 0..100_000 {
            let Some(t) = self.hca.poll_transmit(self.now, &mut self.mem, &mut self.buf) else {
                return;
            };
            assert_eq!(t.src_qpn, self.setup.qpn, "transmit source QP");
            assert_eq!(t.dest_qpn, self.setup.dest_qpn, "transmit destination QP");
            let bytes = self.buf[..t.len].to_vec();
            self.log.push((self.now, self.setup.ip, self.setup.peer_ip, bytes));
            let packet = Packet::parse(&self.buf[..t.len]).unwrap_or_else(|e| panic!("our packet does not parse: {e}"));
            self.sent.push(Tagged { frame: self.last_frame, at: self.now, packet });
        }
        panic!("the engine keeps transmitting");
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        if let (true, Some(path)) = (std::thread::panicking(), &self.pcap_on_failure) {
            match self.write_pcap(path) {
                Ok(()) => eprintln!("replay: packets fed and sent written to {}", path.display()),
                Err(e) => eprintln!("replay: could not write {}: {e}", path.display()),
            }
        }
    }
}
