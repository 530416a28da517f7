//! The simulated network: nodes, packets in flight ordered by delivery time, seeded impairments.
//!
//! Each node's address is the IPv4-mapped GID `::ffff:10.0.0.N` (N = index + 1); a packet goes to
//! the node whose GID is the transmit's destination GID. Frames in flight are IB packets whose ICRC
//! is the real RoCEv2 one, computed over the IPv4/UDP header a node's UDP socket would send
//! (10.0.0.N, source port 0xc000 + index, destination port 4791, identification 0, DF); a corrupted
//! frame fails it and is counted and dropped, as a receiver must. Captures are written with those
//! headers, so they decode and verify like any RoCEv2 capture (`softrdma pcap check`).

use core::time::Duration;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::path::PathBuf;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use softrdma_transport::{Config, Hca, Instant, RxInfo};
use softrdma_wire::capture::{LinkType, PcapWriter};
use softrdma_wire::roce::{seal_udp_payload, ud_grh_area, verify_udp_payload, RoceV2Repr, UdpVerdict};

use crate::memory::SimMemory;
use crate::rng::Rng;

/// Index of a node.
pub type NodeId = usize;

/// What the network does to packets, each with its probability per packet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Impairments {
    /// Dropped.
    pub loss: f64,
    /// Delivered twice.
    pub duplicate: f64,
    /// Held back by up to `reorder_window` so later packets overtake it.
    pub reorder: f64,
    /// One random bit flipped.
    pub corrupt: f64,
    /// One-way latency.
    pub delay: Duration,
    /// Extra random delay of a reordered packet (up to).
    pub reorder_window: Duration,
}

impl Impairments {
    /// A perfect network with 2 µs latency.
    pub const NONE: Impairments = Impairments {
        loss: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
        corrupt: 0.0,
        delay: Duration::from_micros(2),
        reorder_window: Duration::from_micros(20),
    };

    /// Loss `p`, plus duplication and reordering at a tenth of it each, and corruption at a
    /// hundredth — the mixed hostile network of the scenarios.
    pub fn hostile(p: f64) -> Impairments {
        Impairments { loss: p, duplicate: p / 10.0, reorder: p / 10.0, corrupt: p / 100.0, ..Impairments::NONE }
    }
}

/// A simulated host.
pub struct Node {
    /// The engine.
    pub hca: Hca,
    /// Its registered memory.
    pub mem: SimMemory,
    /// Its GID.
    pub gid: [u8; 16],
}

/// Network counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames put on the wire.
    pub sent: u64,
    /// Frames delivered (including duplicates).
    pub delivered: u64,
    /// Frames lost.
    pub lost: u64,
    /// Extra copies made.
    pub duplicated: u64,
    /// Frames with a flipped bit.
    pub corrupted: u64,
    /// Frames dropped by the receiver's ICRC check.
    pub icrc_dropped: u64,
    /// Frames to a GID no node has.
    pub unroutable: u64,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    seq: u64,
    to: NodeId,
    from: NodeId,
    frame: Vec<u8>,
}

/// A hook that may drop (return false) or alter a frame in flight: (from, to, frame).
pub type Filter = Box<dyn FnMut(NodeId, NodeId, &mut Vec<u8>) -> bool>;

/// What became of a frame put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Put in flight (it may still fail the receiver's ICRC check if corrupted).
    Launched,
    /// Dropped by the filter hook.
    Filtered,
    /// Dropped by random loss.
    Lost,
    /// Inserted by [`Net::inject`].
    Injected,
}

/// One frame in the capture ring: the IB packet (BTH through ICRC) as the sender produced it.
#[derive(Debug, Clone)]
pub struct Captured {
    /// Virtual time it was sent.
    pub at: Instant,
    /// Sending node.
    pub from: NodeId,
    /// Receiving node.
    pub to: NodeId,
    /// The frame (after the filter altered it, if it did).
    pub frame: Vec<u8>,
    /// What happened to it.
    pub fate: Fate,
}

/// Frames kept in the capture ring unless [`Net::capture_limit`] is changed.
pub const DEFAULT_CAPTURE: usize = 4096;

/// The network and its nodes, in virtual time.
pub struct Net {
    /// Current virtual time.
    pub now: Instant,
    /// Nodes.
    pub nodes: Vec<Node>,
    /// Impairments applied to every frame.
    pub imp: Impairments,
    /// Counters.
    pub stats: NetStats,
    /// Optional hook that may drop (return false) or alter a frame in flight: (from, to, frame).
    pub filter: Option<Filter>,
    /// The last frames put on the wire, oldest first, at most `capture_limit` of them.
    pub capture: VecDeque<Captured>,
    /// Size of the capture ring (0 disables it).
    pub capture_limit: usize,
    /// Where to write the capture ring as a pcap if the thread panics while this `Net` is alive
    /// (see [`Net::pcap_on_failure`]).
    pub pcap_on_panic: Option<PathBuf>,
    flight: BinaryHeap<Reverse<InFlight>>,
    rng: Rng,
    seq: u64,
    buf: Vec<u8>,
}

/// UDP source port of node `n`'s frames.
fn src_port(n: NodeId) -> u16 {
    0xc000 | n as u16
}

impl Net {
    /// `n` nodes with engines built from `config`, a network with `imp`, randomness from `seed`.
    pub fn new(n: usize, config: Config, imp: Impairments, seed: u64) -> Net {
        let nodes = (0..n)
            .map(|i| {
                let mut gid = [0u8; 16];
                gid[10] = 0xff;
                gid[11] = 0xff;
                gid[12] = 10;
                gid[15] = (i + 1) as u8;
                Node { hca: Hca::new(config), mem: SimMemory::new(), gid }
            })
            .collect();
        Net {
            now: Instant::ZERO,
            nodes,
            imp,
            stats: NetStats::default(),
            filter: None,
            capture: VecDeque::new(),
            capture_limit: DEFAULT_CAPTURE,
            pcap_on_panic: None,
            flight: BinaryHeap::new(),
            rng: Rng::new(seed),
            seq: 0,
            buf: vec![0; 4096 + 256],
        }
    }

    /// The simulator's random generator (for test data).
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Let every node send what it has, putting frames in flight.
    pub fn transmit_all(&mut self) {
        for from in 0..self.nodes.len() {
            loop {
                let node = &mut self.nodes[from];
                let Some(t) = node.hca.poll_transmit(self.now, &mut node.mem, &mut self.buf) else {
                    break;
                };
                let mut frame = self.buf[..t.len].to_vec();
                self.stats.sent += 1;
                match self.nodes.iter().position(|nd| nd.gid == t.av.dgid) {
                    Some(to) => {
                        self.seal(from, to, &mut frame);
                        self.launch(from, to, frame)
                    }
                    None => self.stats.unroutable += 1,
                }
            }
        }
    }

    fn record(&mut self, from: NodeId, to: NodeId, frame: &[u8], fate: Fate) {
        if self.capture_limit == 0 {
            return;
        }
        // Reuse the oldest entry's buffer once the ring is full: no allocation per frame.
        let mut bytes = Vec::new();
        while self.capture.len() >= self.capture_limit {
            if let Some(old) = self.capture.pop_front() {
                bytes = old.frame;
            }
        }
        bytes.clear();
        bytes.extend_from_slice(frame);
        self.capture.push_back(Captured { at: self.now, from, to, frame: bytes, fate });
    }

    fn launch(&mut self, from: NodeId, to: NodeId, mut frame: Vec<u8>) {
        if let Some(f) = self.filter.as_mut() {
            if !f(from, to, &mut frame) {
                self.stats.lost += 1;
                self.record(from, to, &frame, Fate::Filtered);
                return;
            }
        }
        if self.rng.chance(self.imp.loss) {
            self.stats.lost += 1;
            self.record(from, to, &frame, Fate::Lost);
            return;
        }
        self.record(from, to, &frame, Fate::Launched);
        if self.rng.chance(self.imp.corrupt) {
            let bit = self.rng.below(frame.len() as u64 * 8);
            frame[(bit / 8) as usize] ^= 1 << (bit % 8);
            self.stats.corrupted += 1;
        }
        let copies = if self.rng.chance(self.imp.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut at = self.now + self.imp.delay;
            if self.rng.chance(self.imp.reorder) {
                let w = self.imp.reorder_window.as_nanos() as u64;
                at = at + Duration::from_nanos(self.rng.below(w.max(1)));
            }
            self.seq += 1;
            self.flight.push(Reverse(InFlight { at, seq: self.seq, to, from, frame: frame.clone() }));
        }
    }

    /// Put a frame (an IB packet with a valid ICRC, e.g. a copy of a captured one) in flight from
    /// `from` to `to`, bypassing the filter and the impairments; it arrives after the usual delay.
    pub fn inject(&mut self, from: NodeId, to: NodeId, frame: Vec<u8>) {
        self.record(from, to, &frame, Fate::Injected);
        self.seq += 1;
        self.flight.push(Reverse(InFlight { at: self.now + self.imp.delay, seq: self.seq, to, from, frame }));
    }

    /// The (address, port) node `n` sends from, or receives at (`to`).
    fn socket(&self, n: NodeId, to: bool) -> SocketAddr {
        let ip = IpAddr::V4(ipv4_of(&self.nodes[n].gid));
        SocketAddr::new(ip, if to { softrdma_wire::roce::ROCE_V2_PORT } else { src_port(n) })
    }

    /// Compute the ICRC of a frame from `from` to `to` (also for a frame a test altered on purpose,
    /// so that the receiver accepts it).
    pub fn seal(&self, from: NodeId, to: NodeId, frame: &mut [u8]) {
        // Frames are whole IB packets from the engine or a test: never too short to hold an ICRC.
        seal_udp_payload(self.socket(from, false), self.socket(to, true), frame).expect("IB packet with an ICRC slot");
    }

    /// The capture ring as a classic pcap (raw IP, RoCEv2 over IPv4).
    pub fn pcap_bytes(&self) -> Vec<u8> {
        let mut w = PcapWriter::new(Vec::new(), LinkType::Raw).expect("writing to memory");
        let mut ip = Vec::new();
        for c in &self.capture {
            let (src, dst) = (self.socket(c.from, false), self.socket(c.to, true));
            let roce = RoceV2Repr::new(src.ip(), dst.ip(), src.port());
            ip.clear();
            ip.resize(roce.header_len(), 0);
            ip.extend_from_slice(&c.frame);
            // A frame the filter cut below an IB packet's size is written as its bytes alone.
            match roce.emit(&mut ip, c.frame.len()) {
                Ok(n) => w.write_frame(Duration::from_nanos(c.at.as_nanos()), &ip[..n]),
                Err(_) => w.write_frame(Duration::from_nanos(c.at.as_nanos()), &c.frame),
            }
            .expect("writing to memory");
        }
        w.into_inner().expect("writing to memory")
    }

    /// Write the capture ring to `path` (directories created).
    pub fn write_pcap(&self, path: &std::path::Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, self.pcap_bytes())
    }

    /// If the test panics while this `Net` lives, write its capture ring to `dir/name.pcap`.
    pub fn pcap_on_failure(&mut self, dir: impl Into<PathBuf>, name: &str) {
        self.pcap_on_panic = Some(dir.into().join(format!("{name}.pcap")));
    }

    fn deliver(&mut self, f: InFlight) {
        let (src, dst) = (self.socket(f.from, false), self.socket(f.to, true));
        // Frames a test cut short are malformed: the engine counts those itself.
        let verified = match verify_udp_payload(src, dst, &f.frame) {
            Ok((_, verdict)) => verdict == UdpVerdict::Verified,
            Err(_) => true,
        };
        if !verified {
            self.stats.icrc_dropped += 1;
            return;
        }
        self.stats.delivered += 1;
        // As rxe does for RoCEv2 over IPv4: the IPv4 header in the last 20 bytes of the GRH area.
        let grh = ud_grh_area(src.ip(), dst.ip(), f.frame.len());
        let node = &mut self.nodes[f.to];
        node.hca.handle_packet(self.now, &f.frame, &RxInfo { grh }, &mut node.mem);
    }

    /// The next moment something happens: a delivery or a timer.
    pub(crate) fn next_event(&self) -> Option<Instant> {
        let d = self.flight.peek().map(|Reverse(f)| f.at);
        let t = self.nodes.iter().filter_map(|n| n.hca.poll_timeout()).min();
        match (d, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Transmit, then advance to the next event and process everything due then. Returns false when
    /// nothing is left to happen.
    pub fn step(&mut self) -> bool {
        self.transmit_all();
        let Some(at) = self.next_event() else {
            return false;
        };
        if at > self.now {
            self.now = at;
        }
        while self.flight.peek().is_some_and(|Reverse(f)| f.at <= self.now) {
            let Reverse(f) = self.flight.pop().expect("peeked");
            self.deliver(f);
        }
        for node in &mut self.nodes {
            if node.hca.poll_timeout().is_some_and(|t| t <= self.now) {
                node.hca.handle_timeout(self.now, &mut node.mem);
            }
        }
        true
    }

    /// Step until `done` holds (true) or the network goes idle or `limit` of virtual time passes
    /// (false).
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&mut Net) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            if done(self) {
                return true;
            }
            if self.now > end || !self.step() {
                return done(self);
            }
        }
    }

    /// Step until nothing is left to happen or `limit` passes.
    pub fn run_idle(&mut self, limit: Duration) {
        self.run_until(limit, |_| false);
    }
}

/// The IPv4 address of an IPv4-mapped GID.
pub fn ipv4_of(gid: &[u8; 16]) -> Ipv4Addr {
    Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15])
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some(path) = self.pcap_on_panic.take() {
            if std::thread::panicking() {
                match self.write_pcap(&path) {
                    Ok(()) => eprintln!("sim: {} frames written to {}", self.capture.len(), path.display()),
                    Err(e) => eprintln!("sim: could not write {}: {e}", path.display()),
                }
            }
        }
    }
}
