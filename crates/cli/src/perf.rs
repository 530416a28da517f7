//! `softrdma perf`: perftest's `ib_{write,read,send,atomic}_{bw,lat}` on softrdma.
//!
//! Same main flags as perftest (`-d -i -x -g -M -s -a -n -D -q -c -m -t -r -Q -o -A -N -p
//! --report_gbits`, `-R` accepted) and the same output: the test banner, the local/remote address
//! lines and the result tables with perftest's own printf formats (perftest 4.5/24.x,
//! `src/perftest_parameters.h`), so scripts that parse perftest parse this. Server and client run
//! in two processes and exchange their queue pair data over TCP (port 18515 by default), as
//! perftest does without `-R`; `--loopback` runs both sides in one command on two embedded devices
//! on 127.0.77.1 and 127.0.77.2.
//!
//! Two figures perftest does not print follow the table:
//! * CPU time per GB moved: user + system time of both sides (`getrusage(RUSAGE_SELF)` around each
//!   size, the server's sent to the client over the TCP connection), divided by the payload bytes;
//! * copies per payload byte, counted from the code path (see [`copies`]).
//!
//! Measurement follows perftest: bandwidth tests keep `-t` work requests in flight per QP and
//! signal every `-Q`-th; the average is payload bytes over the time from the first post to the last
//! completion, the peak the best rate over any window of completions (perftest's formula, sampled
//! on long runs); latency tests time consecutive posts of a ping-pong (halved for SEND and WRITE,
//! whose round trip is two messages) and report min, max, median ("typical"), mean, standard
//! deviation and the 99 % and 99.9 % points after dropping the two largest samples, or with `-D`
//! the mean and transactions per second. The latency loops are perftest's: each side waits for
//! the peer's message (SEND: on a receive CQ of its own; WRITE: the last byte of its buffer
//! changing), stamps, posts, and waits for the post's completion when it is signaled (with the
//! latency defaults, tx depth 1, every post is), so the ACK of each message is part of the loop as
//! it is for perftest. Every poll of an empty CQ drives the device (busy polling): latencies are
//! busy-polling latencies. One difference stays: while the WRITE loop waits for its byte it polls
//! the CQ too, which drives an embedded device; perftest's `ib_write_lat` only watches memory,
//! and on an embedded device the peer's WRITE then waits for the I/O thread, which a doorbell
//! wakes (a few to tens of microseconds a hop on a busy 2-core machine: docs/PERFORMANCE.md).
//! Until session 17 the loops let up to 8 posts wait for their completions, which perftest never
//! does with tx depth 1: their figures were 15-25 % lower than perftest's own loops get from the
//! same stack.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use softrdma_verbs::{
    devices, open_device, Access, AddressHandle, AhAttr, CompletionQueue, ConnectParams, Context, DeviceBuilder, Gid,
    MemoryRegion, Mtu, Payload, ProtectionDomain, Psn, QpCap, QpInitAttr, QpType, Qpn, QueuePair, RecvWr, SendFlags,
    SendOp, SendWr, Sge, SgeList, WcStatus, WorkCompletion,
};

mod cm;
mod stamp;

/// Request payloads from this many bytes on leave from registered memory (the devices'
/// `defer_payload_min`, crates/verbs runtime): `sendmsg` gathers them from the region itself.
pub const IN_PLACE_FROM: u64 = 1024;

/// How a payload byte of a `verb` message of `size` bytes travels with path MTU `mtu`, one entry
/// per copy. Keep it in step with the data path (crates/transport requester/responder,
/// crates/verbs runtime/io/place): the requester gathers from registered memory into the packet
/// buffer, except for SEND and WRITE payloads from [`IN_PLACE_FROM`] bytes on (`sendmsg` then reads
/// them from the region; READ responses are still gathered); `sendmsg` copies the datagram into a
/// kernel buffer; `recvmsg` copies it out into the receive buffer and the responder scatters it into
/// registered memory, except, with `SOFTRDMA_RX_PLACE=1`, for the packets of a multi-packet RC WRITE
/// after its first (`recvmsg` puts their payload straight into the region; a 64 KiB WRITE with a
/// 4 KiB MTU has 15 of its 16 packets so). The ICRC reads the payload once on each side (not copies).
fn copies(verb: Verb, rc: bool, size: u64, mtu: u64) -> [(&'static str, u32); 4] {
    let in_place = matches!(verb, Verb::Write | Verb::Send) && size >= IN_PLACE_FROM;
    let placed = rc && verb == Verb::Write && size > mtu && softrdma_verbs::rx_place_by_env();
    [
        ("gather into the packet buffer", u32::from(!in_place)),
        ("kernel sendmsg", 1),
        (if placed { "kernel recvmsg (into the region after a WRITE's first packet)" } else { "kernel recvmsg" }, 1),
        ("scatter into registered memory", u32::from(!placed)),
    ]
}

/// [`copies`] on the same-host link (crates/verbs same_host.rs), which carries the packets when
/// both devices are softrdma devices on this host: the requester builds each packet straight into
/// the slot of the shared-memory ring, and the responder scatters from that slot in place. No ICRC
/// is computed or checked on that link.
pub const COPIES_SAME_HOST: &[(&str, u32)] =
    &[("gather into the shared-memory ring slot", 1), ("scatter from the slot into registered memory", 1)];

/// [`copies`] when both QPs are on one device (its internal loopback, crates/verbs loopback.rs):
/// the packets after the first of a multi-packet RC WRITE go region to region; an RC request of
/// one packet is executed at post (crates/transport `hca/direct.rs`), its data copied through a
/// buffer of the engine; every other packet is gathered into a transmit slot and scattered from it.
fn copies_loopback(verb: Verb, rc: bool, size: u64, mtu: u64) -> Vec<(&'static str, u32)> {
    if rc && verb == Verb::Write && size > mtu && mtu >= IN_PLACE_FROM {
        vec![("region to region (a WRITE's packets after its first)", 1)]
    } else if rc && size <= mtu {
        vec![("copy into the engine's buffer", 1), ("copy into registered memory", 1)]
    } else {
        vec![("gather into the transmit slot", 1), ("scatter into registered memory", 1)]
    }
}

/// Which way the packets of a run went, as the device's counters tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathTaken {
    /// UDP sockets, with the ICRC.
    Udp,
    /// The same-host link to another device.
    SameHost,
    /// Both QPs on one device.
    Loopback,
}

const RESULT_LINE: &str = "---------------------------------------------------------------------------------------";
const DEF_QKEY: u32 = 0x1111_1111;
const UD_GRH: usize = 40;
/// perftest's `MSG_SIZE_CQ_MOD_LIMIT`: above it CQ moderation defaults to 1.
const CQ_MOD_SIZE_LIMIT: u64 = 8192;
const LAT_MEASURE_TAIL: usize = 2;

/// The test to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Test {
    /// RDMA WRITE bandwidth (ib_write_bw).
    WriteBw,
    /// RDMA READ bandwidth (ib_read_bw).
    ReadBw,
    /// SEND bandwidth (ib_send_bw).
    SendBw,
    /// Atomic bandwidth (ib_atomic_bw).
    AtomicBw,
    /// RDMA WRITE latency (ib_write_lat).
    WriteLat,
    /// RDMA READ latency (ib_read_lat).
    ReadLat,
    /// SEND latency (ib_send_lat).
    SendLat,
    /// Atomic latency (ib_atomic_lat).
    AtomicLat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Send,
    Write,
    Read,
    Atomic,
}

impl Test {
    fn verb(self) -> Verb {
        match self {
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::SendBw | Test::SendLat => Verb::Send,
            Test::AtomicBw | Test::AtomicLat => Verb::Atomic,
        }
    }

    fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw)
    }

    fn name(self) -> String {
        self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

/// Flags of `softrdma perf` (perftest's, plus `--loopback`, `--bind`, `--netdev`, `--udp-port`).
#[derive(Args, Debug, Clone)]
pub struct PerfArgs {
    /// Test to run.
    #[arg(value_enum)]
    test: Test,
    /// Server to connect to (no server name: act as the server).
    servername: Option<String>,
    /// Use IB device (default: the first device found; with --loopback or --bind: the name given
    /// to the embedded device).
    #[arg(short = 'd', long = "ib-dev")]
    ib_dev: Option<String>,
    /// Use port of IB device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// GID index to use (perftest's -x).
    #[arg(short = 'x', long = "gid-index", default_value_t = 1)]
    gid_index: u8,
    /// Send messages to a multicast group with 1 QP attached to it (SEND tests, UD). The server
    /// attaches its QP to the group and the client sends to it; in latency tests the client also
    /// attaches its QP, to the group's MGID + 1, and the server answers there.
    #[arg(short = 'g', long = "mcg")]
    mcg: bool,
    /// In multicast, use this group MGID: perftest's 16 colon-separated bytes
    /// (0:0:0:0:0:0:0:0:0:0:255:255:239:1:2:3) or an address (239.1.2.3 as ::ffff:239.1.2.3,
    /// ff0e::1). Default: ff02:0:2:c985:: when the GID of -x is IPv6 (perftest's ff01:0:2:c985::
    /// with link-local scope: Linux sends interface-local groups nowhere but on `lo`, and routes
    /// no IPv6 multicast over `lo`), else ::ffff:239.2.201.133 (an IPv4 device reaches only IPv4
    /// groups). The client of a latency test attaches to MGID + 1 with -M too (perftest: only
    /// without -M), or each side would also receive its own messages.
    #[arg(short = 'M', long = "MGID")]
    mgid: Option<String>,
    /// Size of message to exchange (default 65536 for bandwidth, 2 for latency, 8 for atomics).
    #[arg(short = 's', long = "size")]
    size: Option<u64>,
    /// Run sizes from 2 till 2^23.
    #[arg(short = 'a', long = "all")]
    all: bool,
    /// Number of exchanges (default 5000 for bandwidth, 1000 for latency).
    #[arg(short = 'n', long = "iters")]
    iters: Option<u64>,
    /// Run the test for a customized period of seconds.
    #[arg(short = 'D', long = "duration")]
    duration: Option<f64>,
    /// Num of QPs running in the process.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    qps: u32,
    /// Connection type RC/UC/UD.
    #[arg(short = 'c', long = "connection", default_value = "RC")]
    connection: String,
    /// MTU size: 256 - 4096 (default: the port's active MTU).
    #[arg(short = 'm', long = "mtu")]
    mtu: Option<usize>,
    /// Size of tx queue (default 128 for bandwidth, 1 for latency).
    #[arg(short = 't', long = "tx-depth")]
    tx_depth: Option<u32>,
    /// Rx queue size (SEND tests).
    #[arg(short = 'r', long = "rx-depth", default_value_t = 512)]
    rx_depth: u32,
    /// Generate a completion every N work requests (default 100, 1 above 8 KiB messages).
    #[arg(short = 'Q', long = "cq-mod")]
    cq_mod: Option<u32>,
    /// Number of outstanding reads/atomics (default: the device's maximum).
    #[arg(short = 'o', long = "outs")]
    outs: Option<u32>,
    /// Atomic type: CMP_AND_SWAP or FETCH_AND_ADD.
    #[arg(short = 'A', long = "atomic_type", default_value = "FETCH_AND_ADD")]
    atomic_type: String,
    /// Cancel peak-bandwidth calculation.
    #[arg(short = 'N', long = "noPeak")]
    no_peak: bool,
    /// Report max/average bandwidth in Gbit/s instead of MB/s.
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// Connect the QPs with rdma_cm (on the port of -p, at the server device's address) instead of
    /// trading QP numbers over TCP.
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// Post a list of N work requests at a time (one lock and batched sends per list).
    #[arg(short = 'l', long = "post_list", default_value_t = 1)]
    post_list: u32,
    /// Do not print the CPU frequency warning (accepted for compatibility; no effect).
    #[arg(short = 'F', long = "CPU-freq")]
    cpu_freq: bool,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    port: u16,
    /// Run server and client in this process, on two embedded devices at 127.0.77.1 and 127.0.77.2.
    #[arg(long)]
    loopback: bool,
    /// Open an embedded device on this address (of --netdev) instead of a registry device.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// Network interface of --bind and --loopback devices.
    #[arg(long, default_value = "lo")]
    netdev: String,
    /// UDP port of the devices (default 4791, or $SOFTRDMA_UDP_PORT).
    #[arg(long = "udp-port")]
    udp_port: Option<u16>,
}

/// What both sides agree to run.
#[derive(Debug, Clone)]
struct Plan {
    test: Test,
    verb: Verb,
    bw: bool,
    conn: QpType,
    sizes: Vec<u64>,
    iters: u64,
    duration: Option<Duration>,
    qps: usize,
    tx_depth: u32,
    rx_depth: u32,
    cq_mod: u32,
    post_list: u32,
    outs: u8,
    cas: bool,
    gbits: bool,
    no_peak: bool,
    gid_index: u8,
    mtu: Option<Mtu>,
    /// `-g`: the receiving QPs are attached to a multicast group (`-M`'s, or the default).
    mcast: Option<Option<Gid>>,
    /// `-s` was given.
    size_given: bool,
    /// `-a`.
    all: bool,
    /// `-R`: the QPs are connected with rdma_cm on this port.
    rdma_cm: Option<u16>,
}

/// perftest's default multicast group (`MCG_GID`, ff01:0:2:c985::) with link-local scope instead
/// of interface-local (which Linux never sends out of a real interface), used when the GID of -x
/// is IPv6.
const MCG_GID_V6: [u8; 16] = [0xff, 0x02, 0, 0, 0, 0x02, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 0];
/// An IPv4 form of it, ::ffff:239.2.201.133, used when the GID of -x is IPv4.
const MCG_GID_V4: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 2, 201, 133];

/// An MGID as `-M` takes it: 16 colon-separated bytes in decimal or `0x` hex (perftest's form), or
/// an IP address (IPv4 as `::ffff:a.b.c.d`); it must name a multicast group.
fn parse_mgid(s: &str) -> Result<Gid, String> {
    let byte = |f: &str| match f.strip_prefix("0x").or_else(|| f.strip_prefix("0X")) {
        Some(h) => u8::from_str_radix(h, 16).ok(),
        None => f.parse::<u8>().ok(),
    };
    let fields: Vec<&str> = s.split(':').collect();
    let gid = match fields.iter().map(|f| byte(f)).collect::<Option<Vec<u8>>>() {
        Some(b) if b.len() == 16 => Gid(b.try_into().expect("16 bytes")),
        _ => match s.parse::<IpAddr>() {
            Ok(ip) => Gid::from_ip(ip),
            Err(_) => return Err(format!(" Invalid MGID {s}: use 16 colon-separated bytes or an IP address")),
        },
    };
    if !softrdma_transport::hca::multicast::is_multicast_gid(&gid.0) {
        return Err(format!(" MGID {s} is not a multicast address"));
    }
    Ok(gid)
}

impl Plan {
    fn from_args(a: &PerfArgs) -> Result<Plan, String> {
        let verb = a.test.verb();
        let bw = a.test.is_bw();
        let conn = match a.connection.to_ascii_uppercase().as_str() {
            "RC" => QpType::Rc,
            "UC" => QpType::Uc,
            "UD" => QpType::Ud,
            c => return Err(format!(" Unsupported connection type {c}: use RC, UC or UD")),
        };
        match (conn, verb) {
            (QpType::Uc, Verb::Read | Verb::Atomic) => {
                return Err(" UC connection not possible in READ/ATOMIC verbs".into())
            }
            (QpType::Ud, Verb::Write | Verb::Read | Verb::Atomic) => {
                return Err(" UD connection only possible in SEND verb".into())
            }
            _ => {}
        }
        let mcast = match (a.mcg, &a.mgid) {
            (false, None) => None,
            (false, Some(_)) => return Err(" -M (MGID) needs -g (multicast)".into()),
            (true, _) if verb != Verb::Send => return Err(" MultiCast feature only available on SEND verb".into()),
            (true, _) if a.qps > 1 => return Err(" Only 1 QP supported in multicast".into()),
            (true, _) if a.rdma_cm => return Err(" Perftest still doesn't support Multicast with rdma_cm".into()),
            (true, m) => Some(m.as_deref().map(parse_mgid).transpose()?),
        };
        // Multicast runs on UD.
        let conn = if mcast.is_some() { QpType::Ud } else { conn };
        if a.qps == 0 || a.qps > MAX_QPS {
            return Err(format!(" Number of QPs should be between 1 and {MAX_QPS}"));
        }
        if !bw && a.qps > 1 {
            return Err(" Latency tests run on one QP (-q 1)".into());
        }
        let cas = match a.atomic_type.as_str() {
            "CMP_AND_SWAP" => true,
            "FETCH_AND_ADD" => false,
            t => return Err(format!(" Invalid atomic type {t}: use CMP_AND_SWAP or FETCH_AND_ADD")),
        };
        let sizes: Vec<u64> = if verb == Verb::Atomic {
            if a.size.is_some_and(|s| s != 8) {
                return Err(" Message size for atomics is 8 bytes".into());
            }
            vec![8]
        } else if a.all {
            (1..=23).map(|e| 1u64 << e).collect()
        } else {
            vec![a.size.unwrap_or(if bw { 65536 } else { 2 })]
        };
        if sizes.iter().any(|&s| s == 0 || s > 1 << 31) {
            return Err(" Size should be between 1 and 2^31".into());
        }
        let mtu = match a.mtu {
            None => None,
            Some(m) => {
                Some(Mtu::from_bytes(m).ok_or_else(|| format!(" Invalid MTU {m}: use 256, 512, 1024, 2048 or 4096"))?)
            }
        };
        let iters = a.iters.unwrap_or(if bw { 5000 } else { 1000 });
        if iters < 5 && a.duration.is_none() {
            return Err(" Iteration num must be at least 5".into());
        }
        let duration = match a.duration {
            Some(d) if d > 0.0 => Some(Duration::from_secs_f64(d)),
            Some(_) => return Err(" Duration must be positive".into()),
            None => None,
        };
        let mut tx_depth = a.tx_depth.unwrap_or(if bw { 128 } else { 1 }).max(1);
        if duration.is_none() && u64::from(tx_depth) > iters {
            tx_depth = iters as u32;
        }
        let mut cq_mod = match a.cq_mod {
            Some(q) => q.max(1),
            None if sizes[0] > CQ_MOD_SIZE_LIMIT && conn != QpType::Ud && !a.all => 1,
            None => 100,
        };
        cq_mod = cq_mod.min(tx_depth);
        Ok(Plan {
            test: a.test,
            verb,
            bw,
            conn,
            sizes,
            iters,
            duration,
            qps: a.qps as usize,
            tx_depth,
            rx_depth: a.rx_depth.max(1),
            cq_mod,
            post_list: a.post_list.clamp(1, 1024),
            outs: a.outs.unwrap_or(128).clamp(1, 128) as u8,
            cas,
            gbits: a.report_gbits,
            no_peak: a.no_peak || duration.is_some(),
            gid_index: a.gid_index,
            mtu,
            mcast,
            size_given: a.size.is_some(),
            all: a.all,
            rdma_cm: a.rdma_cm.then_some(a.port),
        })
    }

    /// A UD test whose messages would not fit in one MTU, as perftest: without -s, or with -a,
    /// the size becomes the MTU (-a: the sizes up to it), said on standard error; a size asked
    /// for is refused (by `Side::open`). `None`: nothing to change.
    fn fit_ud(&self, mtu: Mtu) -> Option<Plan> {
        let mtu = mtu.bytes() as u64;
        if self.conn != QpType::Ud || self.max_size() as u64 <= mtu || (self.size_given && !self.all) {
            return None;
        }
        eprintln!(" Max msg size in UD is MTU {mtu}");
        eprintln!(" Changing to this MTU");
        let mut p = self.clone();
        p.sizes.retain(|&s| s <= mtu);
        if !self.all {
            p.sizes = vec![mtu];
        }
        Some(p)
    }

    fn max_size(&self) -> usize {
        *self.sizes.iter().max().expect("at least one size") as usize
    }

    /// What the client sends first; the server refuses a mismatch instead of hanging on it.
    fn hello(&self) -> String {
        format!(
            "HELLO softrdma-perf-2 {} {:?}{}{} qps={} sizes={:?} iters={} duration={:?}",
            self.test.name(),
            self.conn,
            if self.mcast.is_some() { " multicast" } else { "" },
            if self.rdma_cm.is_some() { " rdma_cm" } else { "" },
            self.qps,
            self.sizes,
            self.iters,
            self.duration.map(|d| d.as_millis())
        )
    }
}

/// One QP's connection data, exchanged as perftest's `KEY_PRINT_FMT_GID` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dest {
    lid: u16,
    out_reads: u16,
    qpn: u32,
    psn: u32,
    rkey: u32,
    vaddr: u64,
    gid: Gid,
}

impl Dest {
    fn to_line(self) -> String {
        let g: Vec<String> = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:{}:{:08x}:",
            self.lid,
            self.out_reads,
            self.qpn,
            self.psn,
            self.rkey,
            self.vaddr,
            g.join(":"),
            0
        )
    }

    fn from_line(s: &str) -> Option<Dest> {
        let f: Vec<&str> = s.trim_end().split(':').collect();
        if f.len() < 23 {
            return None;
        }
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(f[6 + i], 16).ok()?;
        }
        Some(Dest {
            lid: u16::from_str_radix(f[0], 16).ok()?,
            out_reads: u16::from_str_radix(f[1], 16).ok()?,
            qpn: u32::from_str_radix(f[2], 16).ok()?,
            psn: u32::from_str_radix(f[3], 16).ok()?,
            rkey: u32::from_str_radix(f[4], 16).ok()?,
            vaddr: u64::from_str_radix(f[5], 16).ok()?,
            gid: Gid(gid),
        })
    }
}

/// C's `%#0Nx`: `0x` and zero padding to N characters, but no prefix for zero.
fn hash_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$x}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

/// The out-of-band channel: newline-terminated text lines over TCP.
struct Ctl {
    sock: TcpStream,
    buf: Vec<u8>,
}

impl Ctl {
    fn new(sock: TcpStream) -> Result<Ctl, String> {
        sock.set_nodelay(true).map_err(|e| e.to_string())?;
        sock.set_nonblocking(true).map_err(|e| e.to_string())?;
        Ok(Ctl { sock, buf: Vec::new() })
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        let mut data = line.as_bytes().to_vec();
        data.push(b'\n');
        let mut off = 0;
        while off < data.len() {
            match self.sock.write(&data[off..]) {
                Ok(0) => return Err("the peer closed the connection".into()),
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT, 100),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("Couldn't send to the peer: {e}")),
            }
        }
        Ok(())
    }

    fn wait(&self, events: libc::c_short, ms: i32) {
        let mut p = libc::pollfd { fd: self.sock.as_raw_fd(), events, revents: 0 };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, ms) };
    }

    /// A line if one is complete (reading what the socket has, without blocking).
    fn try_recv(&mut self) -> Result<Option<String>, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Ok(Some(String::from_utf8_lossy(&line[..i]).into_owned()));
            }
            let mut chunk = [0u8; 4096];
            match self.sock.read(&mut chunk) {
                Ok(0) => return Err("the peer closed the connection".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("Couldn't read from the peer: {e}")),
            }
        }
    }

    fn recv(&mut self) -> Result<String, String> {
        loop {
            if let Some(l) = self.try_recv()? {
                return Ok(l);
            }
            self.wait(libc::POLLIN, 100);
        }
    }

    fn expect(&mut self, word: &str) -> Result<String, String> {
        let l = self.recv()?;
        if l.split_whitespace().next() == Some(word) {
            Ok(l)
        } else if let Some(e) = l.strip_prefix("ERR ") {
            Err(e.to_string())
        } else {
            Err(format!("protocol error: expected {word}, got {l:?}"))
        }
    }
}

/// CPU time of this process so far (user, system).
fn cpu_times() -> (Duration, Duration) {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

/// Most QPs per side: work request IDs carry the QP index in their top 16 bits.
const MAX_QPS: u32 = 65535;

/// One side: device, PD, CQs, QPs, one region (receive area, then send area), peers.
struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    /// One CQ, or as many as the QPs' completions need at `max_cqe` each (QP `i` uses
    /// `cqs[i / qps_per_cq]`).
    cqs: Vec<CompletionQueue>,
    /// SEND latency tests: the receives' CQ, apart from the sends' (`cqs[0]`), as perftest's
    /// `recv_cq`: the loop waits on each for what it expects there.
    recv_cq: Option<CompletionQueue>,
    /// The CQ the bandwidth loops poll next (they take turns: an empty poll drives the device, so
    /// polling all of them every round would cost one `recvmmsg` per CQ).
    cq_turn: usize,
    qps: Vec<QueuePair>,
    /// QP index by QPN.
    qp_index: HashMap<Qpn, usize>,
    mr: MemoryRegion,
    psns: Vec<u32>,
    remote: Vec<Dest>,
    ahs: Vec<AddressHandle>,
    /// Receives posted per QP (SEND tests).
    rx_posted: Vec<u32>,
    /// Bytes per receive buffer slot (UD: message + GRH).
    slot: usize,
    /// The gather element of every receive: the first slot of the region (checked once).
    recv_sge: Sge,
    dev_name: String,
    mtu: Mtu,
    /// The multicast group QP 0 is attached to (`-g`).
    group: Option<Gid>,
}

/// The path MTU of the test: -m, or the port's active MTU.
fn path_mtu(ctx: &Context, plan: &Plan) -> Result<Mtu, String> {
    let port = ctx.query_port(1).map_err(|e| format!("Couldn't query port: {e}"))?;
    Ok(plan.mtu.unwrap_or(port.active_mtu))
}

fn random_psn(salt: u32) -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let x = (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32) ^ u64::from(salt).wrapping_mul(0x2545_f491);
    ((x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as u32) & 0xff_ffff
}

impl Side {
    /// The side's objects for `plan`, on paths of `mtu` bytes.
    fn open(ctx: Context, plan: &Plan, mtu: Mtu) -> Result<Side, String> {
        if plan.conn == QpType::Ud && plan.max_size() > mtu.bytes() {
            return Err(" Max message size in UD cannot be greater than MTU ".into());
        }
        let pd = ctx.alloc_pd();
        // Completions one QP can have waiting at once: its signaled sends (one in cq_mod of at most
        // tx_depth outstanding) and, for SEND, its receives.
        let per_qp =
            plan.tx_depth.div_ceil(plan.cq_mod.max(1)) + 1 + if plan.verb == Verb::Send { plan.rx_depth } else { 0 };
        let max_cqe = ctx.query_device().max_cqe;
        let qps_per_cq = ((max_cqe.saturating_sub(16)) / per_qp.max(1)).max(1) as usize;
        let mut cqs = Vec::new();
        for chunk in 0..plan.qps.div_ceil(qps_per_cq) {
            let n = qps_per_cq.min(plan.qps - chunk * qps_per_cq) as u32;
            let depth = n.saturating_mul(per_qp).saturating_add(16).min(max_cqe);
            cqs.push(ctx.create_cq(depth, None).map_err(|e| format!("Couldn't create CQ: {e}"))?);
        }
        let recv_cq = if !plan.bw && plan.verb == Verb::Send {
            Some(ctx.create_cq(plan.rx_depth + 16, None).map_err(|e| format!("Couldn't create CQ: {e}"))?)
        } else {
            None
        };
        let slot = plan.max_size() + if plan.conn == QpType::Ud { UD_GRH } else { 0 };
        let rights =
            Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);
        let mr = pd.reg_mr(2 * slot.max(8), rights).map_err(|e| format!("Couldn't allocate MR: {e}"))?;
        let cap = QpCap {
            max_send_wr: plan.tx_depth.max(16),
            max_recv_wr: plan.rx_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut qps = Vec::with_capacity(plan.qps);
        let mut psns = Vec::with_capacity(plan.qps);
        let mut qp_index = HashMap::with_capacity(plan.qps);
        for i in 0..plan.qps {
            let cq = &cqs[i / qps_per_cq];
            let qp = pd
                .create_qp(&QpInitAttr {
                    qp_type: plan.conn,
                    send_cq: cq,
                    recv_cq: recv_cq.as_ref().unwrap_or(cq),
                    srq: None,
                    cap,
                    sq_sig_all: false,
                })
                .map_err(|e| format!("Couldn't create QP: {e}"))?;
            let psn = random_psn(i as u32);
            match plan.conn {
                QpType::Ud => {
                    qp.bring_up_ud(DEF_QKEY, Psn::new(psn)).map_err(|e| format!("Failed to modify QP to RTS: {e}"))?
                }
                _ => qp.init(rights).map_err(|e| format!("Failed to modify QP to INIT: {e}"))?,
            }
            qp_index.insert(qp.qpn(), i);
            qps.push(qp);
            psns.push(psn);
        }
        let dev_name = ctx.name().to_string();
        let recv_sge = mr.sge(0, slot).map_err(|e| e.to_string())?;
        Ok(Side {
            ctx,
            pd,
            cqs,
            recv_cq,
            cq_turn: 0,
            qps,
            qp_index,
            mr,
            psns,
            remote: Vec::new(),
            ahs: Vec::new(),
            rx_posted: vec![0; plan.qps],
            slot,
            recv_sge,
            dev_name,
            mtu,
            group: None,
        })
    }

    /// With `-g`: attach QP 0 to this side's group if it receives from one (the server; the
    /// client too in latency tests, to the MGID + 1, where the server answers).
    fn join_group(&mut self, plan: &Plan, role: Role) -> Result<(), String> {
        let Some(chosen) = plan.mcast else { return Ok(()) };
        if role == Role::Client && plan.bw {
            return Ok(());
        }
        let mut g = match chosen {
            Some(g) => g,
            None => {
                let own = self
                    .ctx
                    .query_gid(1, usize::from(plan.gid_index))
                    .map_err(|e| format!("Couldn't read GID {}: {e}", plan.gid_index))?;
                Gid(if own.to_ip().is_ipv4() { MCG_GID_V4 } else { MCG_GID_V6 })
            }
        };
        if role == Role::Client {
            g.0[15] = g.0[15].wrapping_add(1);
        }
        self.qps[0].attach_mcast(g).map_err(|e| format!("Couldn't attach QP to MultiCast group: {e}"))?;
        self.group = Some(g);
        Ok(())
    }

    fn dests(&self, plan: &Plan) -> Result<Vec<Dest>, String> {
        let gid = self
            .ctx
            .query_gid(1, usize::from(plan.gid_index))
            .map_err(|e| format!("Couldn't read GID {}: {e}", plan.gid_index))?;
        Ok(self
            .qps
            .iter()
            .zip(&self.psns)
            .map(|(qp, &psn)| Dest {
                lid: 0,
                out_reads: u16::from(plan.outs),
                // A side that receives from a group is reached there (perftest's QPNUM_MCAST).
                qpn: if self.group.is_some() { Qpn::MULTICAST.value() } else { qp.qpn().value() },
                psn,
                rkey: self.mr.rkey(),
                vaddr: self.mr.addr(),
                gid: self.group.unwrap_or(gid),
            })
            .collect())
    }

    fn connect(&mut self, plan: &Plan, remote: Vec<Dest>) -> Result<(), String> {
        if remote.len() != self.qps.len() {
            return Err(format!("the peer has {} QPs, this side {}", remote.len(), self.qps.len()));
        }
        if plan.conn != QpType::Ud {
            for ((qp, &psn), r) in self.qps.iter().zip(&self.psns).zip(&remote) {
                let mut p = ConnectParams::new(Qpn::new(r.qpn), Psn::new(r.psn), r.gid, Psn::new(psn));
                p.mtu = self.mtu;
                p.sgid_index = plan.gid_index;
                p.rd_atomic = plan.outs.min(r.out_reads.min(255) as u8).max(1);
                qp.connect(&self.pd, &p).map_err(|e| format!("Failed to modify QP to RTR/RTS: {e}"))?;
            }
        }
        self.set_remote(plan, remote)
    }

    /// Take `remote` as the peer's QPs, the QPs connected to them (UD: an address handle each).
    fn set_remote(&mut self, plan: &Plan, remote: Vec<Dest>) -> Result<(), String> {
        if plan.conn == QpType::Ud {
            for r in &remote {
                let ah = self
                    .pd
                    .create_ah(&AhAttr::new(r.gid, plan.gid_index))
                    .map_err(|e| format!("Failed to create AH: {e}"))?;
                self.ahs.push(ah);
            }
        }
        self.remote = remote;
        Ok(())
    }

    /// Top up every QP's receive queue to `rx_depth` (SEND tests).
    fn fill_receives(&mut self, plan: &Plan) -> Result<(), String> {
        for i in 0..self.qps.len() {
            while self.rx_posted[i] < plan.rx_depth {
                self.post_recv(i)?;
            }
        }
        Ok(())
    }

    fn post_recv(&mut self, i: usize) -> Result<(), String> {
        self.qps[i]
            .post_recv(RecvWr { wr_id: i as u64, sgl: SgeList::one(self.recv_sge) })
            .map_err(|e| format!("Couldn't post receive: {e}"))?;
        self.rx_posted[i] += 1;
        Ok(())
    }

    /// The send work request of this test on QP `i`.
    fn send_wr(&self, plan: &Plan, i: usize, size: u64, wr_id: u64, signaled: bool) -> Result<SendWr, String> {
        let r = &self.remote[i];
        let (op, sge_off) = match plan.verb {
            Verb::Send => (SendOp::Send, self.slot),
            Verb::Write => (SendOp::Write { remote_addr: r.vaddr, rkey: r.rkey }, self.slot),
            Verb::Read => (SendOp::Read { remote_addr: r.vaddr + self.slot as u64, rkey: r.rkey }, 0),
            Verb::Atomic if plan.cas => {
                (SendOp::CompareSwap { remote_addr: r.vaddr, rkey: r.rkey, compare: 0, swap: 0 }, self.slot)
            }
            Verb::Atomic => (SendOp::FetchAdd { remote_addr: r.vaddr, rkey: r.rkey, add: 1 }, self.slot),
        };
        let sge = self.mr.sge(sge_off, size as usize).map_err(|e| e.to_string())?;
        Ok(SendWr {
            wr_id,
            op,
            payload: Payload::Sgl(SgeList::one(sge)),
            flags: if signaled { SendFlags::SIGNALED } else { SendFlags::NONE },
            ud: self.ahs.get(i).map(|ah| ah.ud(Qpn::new(r.qpn), DEF_QKEY)),
        })
    }

    fn qp_index(&self, qpn: Qpn) -> Option<usize> {
        self.qp_index.get(&qpn).copied()
    }

    /// Poll the CQ of the latency tests (one QP; a SEND test's send CQ), up to 16 completions
    /// appended to `wcs`.
    fn poll_lat_cq(&self, wcs: &mut Vec<WorkCompletion>) -> Result<usize, String> {
        self.cqs[0].poll(16, wcs).map_err(|e| format!("poll CQ failed: {e}"))
    }

    /// Poll a SEND latency test's receive CQ for one completion.
    fn poll_lat_recv_cq(&self, wcs: &mut Vec<WorkCompletion>) -> Result<usize, String> {
        self.recv_cq.as_ref().unwrap_or(&self.cqs[0]).poll(1, wcs).map_err(|e| format!("poll CQ failed: {e}"))
    }

    /// Poll the CQ whose turn it is (bandwidth loops).
    fn poll_next_cq(&mut self, max: usize, wcs: &mut Vec<WorkCompletion>) -> Result<usize, String> {
        let i = self.cq_turn % self.cqs.len();
        self.cq_turn = self.cq_turn.wrapping_add(1);
        self.cqs[i].poll(max, wcs).map_err(|e| format!("poll CQ failed: {e}"))
    }
}

fn check(wc: &WorkCompletion) -> Result<(), String> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(format!(
            " Completion with error at {}:\n Failed status {}: wr_id {} syndrom 0x{:x}",
            if wc.opcode.is_receive() { "server" } else { "client" },
            wc.status as u32,
            wc.wr_id,
            0
        ))
    }
}

/// Nanoseconds since `t0`.
fn ns(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

// ---- results ---------------------------------------------------------------------------------

struct BwResult {
    iters: u64,
    peak: f64,
    avg: f64,
    msg_rate: f64,
    bytes: u64,
}

fn bw_row(plan: &Plan, size: u64, r: &BwResult) -> String {
    let _ = plan;
    format!(" {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}", size, r.iters, r.peak, r.avg, r.msg_rate)
}

/// Units per byte/s: MB/s (2^20, as perftest's "MB") or Gbit/s.
fn bw_factor(plan: &Plan) -> f64 {
    if plan.gbits {
        125_000_000.0
    } else {
        1_048_576.0
    }
}

/// perftest's bandwidth figures from per-WR post and completion times (ns).
fn bw_from_times(plan: &Plan, size: u64, posted: &[u64], completed: &[u64]) -> BwResult {
    let n = posted.len().min(completed.len());
    if n == 0 {
        return BwResult { iters: 0, peak: 0.0, avg: 0.0, msg_rate: 0.0, bytes: 0 };
    }
    let total_ns = (completed[n - 1].saturating_sub(posted[0])).max(1) as f64;
    let secs = total_ns / 1e9;
    let avg = size as f64 * n as f64 / secs / bw_factor(plan);
    let msg_rate = n as f64 / secs / 1e6;
    let mut peak = 0.0;
    if !plan.no_peak {
        // perftest: min over i, j of (completed[j] - posted[i]) / (j - i + 1), j at completion points.
        let cq_mod = plan.cq_mod.max(1) as usize;
        let mut best = total_ns / n as f64;
        let step_i = (n / 2000).max(1);
        let step_j = cq_mod.max(n / 2000);
        let mut i = 0;
        while i < n {
            let mut j = (i + 1).div_ceil(cq_mod) * cq_mod - 1;
            while j < n {
                let t = completed[j].saturating_sub(posted[i]) as f64 / (j - i + 1) as f64;
                if t > 0.0 && t < best {
                    best = t;
                }
                j += step_j;
            }
            i += step_i;
        }
        peak = size as f64 / (best / 1e9) / bw_factor(plan);
    }
    BwResult { iters: n as u64, peak, avg, msg_rate, bytes: size * n as u64 }
}

struct LatResult {
    row: String,
    bytes: u64,
}

/// RTT factor: SEND and WRITE latency is half a ping-pong; READ and atomics one round trip.
fn rtt_factor(plan: &Plan) -> f64 {
    match plan.verb {
        Verb::Read | Verb::Atomic => 1.0,
        Verb::Send | Verb::Write => 2.0,
    }
}

fn lat_row(plan: &Plan, size: u64, posts: &[u64], elapsed_ns: u64) -> LatResult {
    let rtt = rtt_factor(plan);
    let moved = if rtt == 2.0 { 2 } else { 1 };
    let n = posts.len();
    if plan.duration.is_some() {
        let iters = n.max(1) as f64;
        let lat = elapsed_ns as f64 / 1e3 / rtt / iters;
        let tps = iters / (elapsed_ns.max(1) as f64 / 1e9);
        return LatResult {
            row: format!(" {:<7}       {}            {:<7.2}        {:<7.2}", size, n, lat, tps),
            bytes: size * n as u64 * moved,
        };
    }
    let mut d: Vec<f64> = posts.windows(2).map(|w| (w[1] - w[0]) as f64 / 1e3 / rtt).collect();
    d.sort_by(|a, b| a.total_cmp(b));
    if d.len() <= LAT_MEASURE_TAIL + 1 {
        return LatResult { row: format!(" {:<7} {}          (too few iterations)", size, n), bytes: 0 };
    }
    let cnt = d.len() - LAT_MEASURE_TAIL;
    let median = if (cnt - 1) % 2 == 1 { (d[cnt / 2] + d[cnt / 2 - 1]) / 2.0 } else { d[cnt / 2] };
    let avg = d[..cnt].iter().sum::<f64>() / cnt as f64;
    let stdev = (d[..cnt].iter().map(|x| (x - avg).powi(2)).sum::<f64>() / cnt as f64).sqrt();
    let i99 = ((cnt as f64 * 0.99).ceil() as usize).min(d.len() - 1);
    let i999 = ((cnt as f64 * 0.999).ceil() as usize).min(d.len() - 1);
    let row = format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        size, n, d[0], d[cnt], median, avg, stdev, d[i99], d[i999]
    );
    LatResult { row, bytes: size * n as u64 * moved }
}

// ---- the runs --------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Client,
    Server,
}

/// Check the control channel every this many idle polls.
const CTL_EVERY: u32 = 256;

/// Bandwidth, the active side: keep tx_depth WRs in flight per QP, signal every cq_mod-th.
fn bw_client(side: &mut Side, plan: &Plan, size: u64) -> Result<BwResult, String> {
    let nqp = side.qps.len();
    let iters = plan.iters;
    let timed = plan.duration.is_none();
    let cap = if timed { iters as usize * nqp } else { 0 };
    let (mut tposted, mut tcompleted) = (vec![0u64; cap], vec![0u64; cap]);
    let (mut posted, mut done, mut stopped) = (vec![0u64; nqp], vec![0u64; nqp], vec![false; nqp]);
    let cq_mod = u64::from(plan.cq_mod);
    let t0 = Instant::now();
    let deadline = plan.duration.map(|d| t0 + d);
    let mut wcs = Vec::with_capacity(64);
    let mut list = Vec::with_capacity(plan.post_list as usize);
    // One WR per QP built up front, copied per post with its id and flags (as perftest reuses its
    // prepared WRs): building each from scratch cost more than posting it.
    let templates = (0..nqp).map(|q| side.send_wr(plan, q, size, 0, false)).collect::<Result<Vec<_>, _>>()?;
    let wr = |q: usize, wr_id: u64, signaled: bool| {
        let mut w = templates[q].clone();
        w.wr_id = wr_id;
        w.flags = if signaled { SendFlags::SIGNALED } else { SendFlags::NONE };
        w
    };
    loop {
        let past = deadline.is_some_and(|d| Instant::now() >= d);
        for q in 0..nqp {
            while !stopped[q] && posted[q] - done[q] < u64::from(plan.tx_depth) {
                // Up to post_list WRs go in one post (perftest's -l), with one time stamp (as perftest's
                // `tposted`: a clock read per WR cost more than the post of a 64-byte WR in a list).
                list.clear();
                let tpost = if timed { ns(t0) } else { 0 };
                while list.len() < plan.post_list as usize
                    && !stopped[q]
                    && posted[q] + (list.len() as u64) - done[q] < u64::from(plan.tx_depth)
                {
                    let seq = posted[q] + list.len() as u64;
                    let last = if timed { seq + 1 == iters } else { past };
                    let signaled = (seq + 1).is_multiple_of(cq_mod) || last;
                    list.push(wr(q, ((q as u64) << 48) | seq, signaled));
                    if timed {
                        tposted[q * iters as usize + seq as usize] = tpost;
                    }
                    if last {
                        stopped[q] = true;
                    }
                }
                let n = list.len() as u64;
                let r = if n == 1 {
                    side.qps[q].post_send(list.pop().expect("one WR"))
                } else {
                    side.qps[q].post_send_list(list.drain(..))
                };
                r.map_err(|e| format!("Couldn't post send: qp {q} scnt={}: {e}", posted[q]))?;
                posted[q] += n;
            }
        }
        wcs.clear();
        side.poll_next_cq(64, &mut wcs)?;
        if !wcs.is_empty() {
            let now = ns(t0);
            for wc in &wcs {
                check(wc)?;
                let q = (wc.wr_id >> 48) as usize;
                let seq = wc.wr_id & 0xffff_ffff_ffff;
                if timed {
                    for k in done[q]..=seq {
                        tcompleted[q * iters as usize + k as usize] = now;
                    }
                }
                done[q] = seq + 1;
            }
        }
        if (0..nqp).all(|q| stopped[q] && done[q] == posted[q]) {
            break;
        }
    }
    if timed {
        // perftest orders the samples as posted; with several QPs, merge by time.
        if nqp > 1 {
            tposted.sort_unstable();
            tcompleted.sort_unstable();
        }
        Ok(bw_from_times(plan, size, &tposted, &tcompleted))
    } else {
        let n: u64 = done.iter().sum();
        let secs = t0.elapsed().as_secs_f64();
        Ok(BwResult {
            iters: n,
            peak: 0.0,
            avg: size as f64 * n as f64 / secs / bw_factor(plan),
            msg_rate: n as f64 / secs / 1e6,
            bytes: size * n,
        })
    }
}

/// Bandwidth, the passive side: drive the device until the client says DONE; for SEND, count and
/// re-post receives and time them.
fn bw_server(side: &mut Side, plan: &Plan, size: u64, ctl: &mut Ctl) -> Result<Option<BwResult>, String> {
    let t0 = Instant::now();
    let mut wcs = Vec::with_capacity(64);
    let mut times: Vec<u64> = Vec::new();
    let mut spins = 0u32;
    loop {
        wcs.clear();
        side.poll_next_cq(64, &mut wcs)?;
        if !wcs.is_empty() {
            let now = ns(t0);
            for wc in &wcs {
                check(wc)?;
                if let Some(i) = side.qp_index(wc.qp_num) {
                    side.rx_posted[i] -= 1;
                    side.post_recv(i)?;
                }
                times.push(now);
            }
        }
        spins += 1;
        if spins.is_multiple_of(CTL_EVERY) {
            if let Some(l) = ctl.try_recv()? {
                if l == "DONE" {
                    break;
                }
                return Err(format!("protocol error: expected DONE, got {l:?}"));
            }
        }
    }
    if plan.verb != Verb::Send {
        return Ok(None);
    }
    let n = times.len();
    if n < 2 {
        return Ok(Some(BwResult { iters: n as u64, peak: 0.0, avg: 0.0, msg_rate: 0.0, bytes: size * n as u64 }));
    }
    // The receiver's view: from the first to the last receive completion.
    let secs = (times[n - 1] - times[0]).max(1) as f64 / 1e9;
    Ok(Some(BwResult {
        iters: n as u64,
        peak: 0.0,
        avg: size as f64 * n as f64 / secs / bw_factor(plan),
        msg_rate: n as f64 / secs / 1e6,
        bytes: size * n as u64,
    }))
}

/// Poll until a completion arrives, or (passive side) the client says DONE.
fn wait_wc(side: &Side, wcs: &mut Vec<WorkCompletion>, ctl: Option<&mut Ctl>) -> Result<bool, String> {
    wait_on(side, Side::poll_lat_cq, wcs, ctl)
}

/// [`wait_wc`] on the CQ `poll` polls.
fn wait_on(
    side: &Side,
    poll: fn(&Side, &mut Vec<WorkCompletion>) -> Result<usize, String>,
    wcs: &mut Vec<WorkCompletion>,
    ctl: Option<&mut Ctl>,
) -> Result<bool, String> {
    let mut spins = 0u32;
    let mut ctl = ctl;
    loop {
        poll(side, wcs)?;
        if !wcs.is_empty() {
            return Ok(true);
        }
        spins += 1;
        if spins.is_multiple_of(CTL_EVERY) {
            if let Some(c) = ctl.as_deref_mut() {
                if let Some(l) = c.try_recv()? {
                    if l == "DONE" {
                        return Ok(false);
                    }
                    return Err(format!("protocol error: expected DONE, got {l:?}"));
                }
            }
        }
    }
}

/// Wait until the last byte of the message at `at` in our region is `v` (the peer's write
/// landed), polling the CQ meanwhile (it drives an embedded device; any completion is checked).
/// With `ctl`, a DONE from the client ends the wait: false then.
fn wait_byte(
    side: &Side,
    at: usize,
    v: u8,
    byte: &mut [u8; 1],
    wcs: &mut Vec<WorkCompletion>,
    mut ctl: Option<&mut Ctl>,
) -> Result<bool, String> {
    let mut spins = 0u32;
    loop {
        side.mr.read(at, byte).map_err(|e| e.to_string())?;
        if byte[0] == v {
            return Ok(true);
        }
        wcs.clear();
        side.poll_lat_cq(wcs)?;
        wcs.iter().try_for_each(check)?;
        spins += 1;
        if spins.is_multiple_of(CTL_EVERY) {
            if let Some(c) = ctl.as_deref_mut() {
                if let Some(l) = c.try_recv()? {
                    if l != "DONE" {
                        return Err(format!("protocol error: expected DONE, got {l:?}"));
                    }
                    return Ok(false);
                }
            }
        }
    }
}

/// The send-latency loop's receive completions: each is checked and its receive posted again.
fn absorb_recv(side: &mut Side, wcs: &[WorkCompletion]) -> Result<(), String> {
    for wc in wcs {
        check(wc)?;
        side.rx_posted[0] -= 1;
        side.post_recv(0)?;
    }
    Ok(())
}

/// Latency. Returns the post times and the elapsed time; `None` if the client said DONE first
/// (duration mode, passive side) — then the DONE is consumed.
fn lat_run(
    side: &mut Side,
    plan: &Plan,
    size: u64,
    role: Role,
    ctl: &mut Ctl,
) -> Result<(Vec<u64>, u64, bool), String> {
    let t0 = Instant::now();
    let deadline = plan.duration.map(|d| t0 + d);
    let iters = if plan.duration.is_some() { u64::MAX } else { plan.iters };
    let clock = stamp::Stamps::start();
    let mut posts = Vec::with_capacity(plan.iters.min(1 << 24) as usize);
    let mut wcs = Vec::with_capacity(16);
    let mut done_seen = false;
    let poll_at = size as usize - 1;
    let send_at = side.slot;
    // Built and checked once, as perftest does: each iteration posts a copy with its own id.
    let wr0 = side.send_wr(plan, 0, size, 0, true)?;
    match (plan.verb, role) {
        (Verb::Read | Verb::Atomic, Role::Server) => {
            // Passive: the client reads or updates our memory.
            bw_server(side, plan, size, ctl)?;
            return Ok((posts, 0, true));
        }
        (Verb::Read | Verb::Atomic, Role::Client) => {
            let mut i = 0u64;
            while i < iters && deadline.is_none_or(|d| Instant::now() < d) {
                posts.push(clock.now());
                let wr = SendWr { wr_id: i, ..wr0.clone() };
                side.qps[0].post_send(wr).map_err(|e| format!("Couldn't post send: {e}"))?;
                wcs.clear();
                wait_wc(side, &mut wcs, None)?;
                wcs.iter().try_for_each(check)?;
                i += 1;
            }
        }
        (Verb::Send, _) => {
            // As perftest's send latency loop: wait for the peer's message on the receive CQ (the
            // client's first round has none yet) and post its receive again; stamp; post the send
            // and, when it is signaled (every cq_mod-th and the last: with the latency defaults,
            // tx depth 1, every one), wait for its completion on the send CQ before going on.
            let wr_quiet = side.send_wr(plan, 0, size, 0, false)?;
            let every = u64::from(plan.cq_mod.max(1));
            let mut i = 0u64;
            while i < iters {
                if role == Role::Client && deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                if role == Role::Server || i > 0 {
                    wcs.clear();
                    let ctl = if role == Role::Server { Some(&mut *ctl) } else { None };
                    if !wait_on(side, Side::poll_lat_recv_cq, &mut wcs, ctl)? {
                        done_seen = true;
                        break;
                    }
                    absorb_recv(side, &wcs)?;
                }
                posts.push(clock.now());
                let signaled = (i + 1).is_multiple_of(every) || i + 1 == iters;
                let wr = SendWr { wr_id: i, ..if signaled { wr0.clone() } else { wr_quiet.clone() } };
                side.qps[0].post_send(wr).map_err(|e| format!("Couldn't post send: {e}"))?;
                if signaled {
                    wcs.clear();
                    wait_wc(side, &mut wcs, None)?;
                    wcs.iter().try_for_each(check)?;
                }
                i += 1;
            }
            // The client's last round: the answer to its last message (with -D too: the server
            // answers every message, and a reply left behind would answer the next size's first).
            if role == Role::Client && i > 0 {
                wcs.clear();
                wait_on(side, Side::poll_lat_recv_cq, &mut wcs, None)?;
                absorb_recv(side, &wcs)?;
            }
        }
        (Verb::Write, _) => {
            // As perftest's write latency loop: wait for the peer's write to change our last
            // byte (the server first), stamp, write, and wait for the write's completion when it
            // is signaled (every cq_mod-th and the last: with the defaults, every one).
            let wr_quiet = side.send_wr(plan, 0, size, 0, false)?;
            let every = u64::from(plan.cq_mod.max(1));
            let mut i = 0u64;
            let mut byte = [0u8; 1];
            while i < iters {
                if role == Role::Client && deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                let v = (i % 255) as u8 + 1;
                if role == Role::Server {
                    let ctl = Some(&mut *ctl);
                    if !wait_byte(side, poll_at, v, &mut byte, &mut wcs, ctl)? {
                        done_seen = true;
                        break;
                    }
                }
                posts.push(clock.now());
                side.mr.write(send_at + poll_at, &[v]).map_err(|e| e.to_string())?;
                let signaled = (i + 1).is_multiple_of(every) || i + 1 == iters;
                let wr = SendWr { wr_id: i, ..if signaled { wr0.clone() } else { wr_quiet.clone() } };
                side.qps[0].post_send(wr).map_err(|e| format!("Couldn't post send: {e}"))?;
                if signaled {
                    wcs.clear();
                    wait_wc(side, &mut wcs, None)?;
                    wcs.iter().try_for_each(check)?;
                }
                if role == Role::Client {
                    wait_byte(side, poll_at, v, &mut byte, &mut wcs, None)?;
                }
                i += 1;
            }
        }
    }
    let (posts, elapsed) = clock.finish(posts);
    Ok((posts, elapsed, done_seen))
}

// ---- printing --------------------------------------------------------------------------------

struct Out {
    quiet: bool,
}

impl Out {
    fn line(&self, s: &str) {
        if !self.quiet {
            println!("{s}");
        }
    }
}

fn print_banner(out: &Out, plan: &Plan, role: Role, side: &Side) {
    out.line(RESULT_LINE);
    let verb = match plan.verb {
        Verb::Send => "Send",
        Verb::Write => "RDMA_Write",
        Verb::Read => "RDMA_Read",
        Verb::Atomic => "Atomic",
    };
    let atomic = match (plan.verb, plan.cas) {
        (Verb::Atomic, true) => "CMP_AND_SWAP ",
        (Verb::Atomic, false) => "FETCH_AND_ADD ",
        _ => "",
    };
    let kind = match (plan.bw, plan.post_list > 1) {
        (true, true) => "Post List BW ",
        (true, false) => "BW ",
        (false, _) => "Latency ",
    };
    let mcast = if plan.mcast.is_some() { "Multicast " } else { "" };
    out.line(&format!("                    {verb} {atomic}{kind}{mcast}Test"));
    if plan.mcast.is_some() {
        out.line(" MultiCast runs on UD!");
    }
    out.line(&format!(" Dual-port       : OFF\t\tDevice         : {}", side.dev_name));
    out.line(&format!(" Number of qps   : {}\t\tTransport type : IB", plan.qps));
    let conn = match plan.conn {
        QpType::Rc => "RC",
        QpType::Uc => "UC",
        QpType::Ud => "UD",
    };
    out.line(&format!(" Connection type : {conn}\t\tUsing SRQ      : OFF"));
    out.line(" PCIe relax order: Unsupported");
    out.line(" ibv_wr* API     : OFF");
    if role == Role::Client {
        out.line(&format!(" TX depth        : {}", plan.tx_depth));
    }
    if plan.post_list > 1 && role == Role::Client {
        out.line(&format!(" Post List       : {}", plan.post_list));
    }
    if plan.verb == Verb::Send && role == Role::Server {
        out.line(&format!(" RX depth        : {}", plan.rx_depth));
    }
    if plan.bw {
        out.line(&format!(" CQ Moderation   : {}", plan.cq_mod));
    }
    out.line(&format!(" Mtu             : {}[B]", side.mtu.bytes()));
    out.line(" Link type       : Ethernet");
    out.line(&format!(" GID index       : {}", plan.gid_index));
    if matches!(plan.verb, Verb::Read | Verb::Atomic) {
        out.line(&format!(" Outstand reads  : {}", plan.outs));
    } else {
        out.line(" Max inline data : 0[B]");
    }
    out.line(if plan.rdma_cm.is_some() { " rdma_cm QPs\t : ON" } else { " rdma_cm QPs\t : OFF" });
    out.line(if plan.rdma_cm.is_some() { " Data ex. method : rdma_cm" } else { " Data ex. method : Ethernet" });
    out.line(RESULT_LINE);
    if plan.rdma_cm.is_some() && role == Role::Server {
        out.line(" Waiting for client rdma_cm QP to connect");
        out.line(" Please run the same command with the IB/RoCE interface IP");
        out.line(RESULT_LINE);
    }
}

/// One address line pair. With `-g`, the GID line of the server's own address and of the
/// client's peer (the group the client sends to) says "MGID", as perftest's.
fn print_dest(out: &Out, plan: &Plan, role: Role, side: &str, d: &Dest) {
    let mut s = format!(
        " {side} address: LID {} QPN {} PSN {}",
        hash_hex(u64::from(d.lid), 4),
        hash_hex(u64::from(d.qpn), 6),
        hash_hex(u64::from(d.psn), 6)
    );
    // With -R the region went in the CM's private data, and perftest prints only the QP.
    if plan.verb == Verb::Read && plan.rdma_cm.is_none() {
        s += &format!(" OUT {}", hash_hex(u64::from(d.out_reads), 4));
    }
    if matches!(plan.verb, Verb::Read | Verb::Write) && plan.rdma_cm.is_none() {
        s += &format!(" RKey {} VAddr {}", hash_hex(u64::from(d.rkey), 8), hash_hex(d.vaddr, 16));
    }
    out.line(&s);
    let g: Vec<String> = d.gid.0.iter().map(|b| format!("{b:02}")).collect();
    let mgid = plan.mcast.is_some() && (role == Role::Server) == (side == "local");
    out.line(&format!(" {}: {}", if mgid { "MGID" } else { "GID" }, g.join(":")));
}

fn table_header(plan: &Plan) -> &'static str {
    match (plan.bw, plan.gbits, plan.duration.is_some()) {
        (true, false, _) => " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]",
        (true, true, _) => " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]",
        (false, _, false) => " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ",
        (false, _, true) => " #bytes        #iterations       t_avg[usec]    tps average",
    }
}

/// One side's CPU time for one size, as the two sides exchange it: user and system time of the
/// process, and its softrdmad device loop's (service mode).
struct SideCpu {
    user: Duration,
    sys: Duration,
    device: Option<Duration>,
    /// The GID of the device whose loop `device` is: two sides on one softrdmad device count its
    /// loop once. (The addresses the sides exchange do not tell: with `-g` they are groups.)
    device_gid: Option<Gid>,
}

impl SideCpu {
    /// Fields in [`SideCpu::encode`].
    const FIELDS: usize = 4;

    /// `<user ns> <system ns> <device ns, or -> <device GID in hex, or ->`.
    fn encode(&self) -> String {
        let device = self.device.map_or("-".to_string(), |d| d.as_nanos().to_string());
        let gid = self.device_gid.map_or("-".to_string(), |g| g.0.iter().map(|b| format!("{b:02x}")).collect());
        format!("{} {} {device} {gid}", self.user.as_nanos(), self.sys.as_nanos())
    }

    /// The fields of [`SideCpu::encode`]; a missing or garbled one reads as none.
    fn decode(f: &[&str]) -> SideCpu {
        let time = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).map(Duration::from_nanos);
        let gid = f.get(3).filter(|x| x.len() == 32).and_then(|x| {
            let mut g = [0u8; 16];
            for (k, b) in g.iter_mut().enumerate() {
                *b = u8::from_str_radix(x.get(2 * k..2 * k + 2)?, 16).ok()?;
            }
            Some(Gid(g))
        });
        SideCpu {
            user: time(0).unwrap_or_default(),
            sys: time(1).unwrap_or_default(),
            device: time(2),
            device_gid: gid,
        }
    }

    /// Whether this side and `peer` timed the same softrdmad device's loop.
    fn same_device(&self, peer: &SideCpu) -> bool {
        self.device.is_some() && self.device_gid.is_some() && self.device_gid == peer.device_gid
    }
}

/// One size's extra figures, printed after the table.
struct CpuLine {
    size: u64,
    user: Duration,
    sys: Duration,
    /// The softrdmad device loops' share, both sides' devices counted once (service mode;
    /// clock-tick resolution).
    device: Option<Duration>,
    bytes: u64,
}

fn print_extras(out: &Out, verb: Verb, rc: bool, mtu: u64, cpu: &[CpuLine], path: PathTaken) {
    for c in cpu {
        let cpu = (c.user + c.sys + c.device.unwrap_or_default()).as_secs_f64();
        let gb = c.bytes as f64 / 1e9;
        let per_gb = if gb > 0.0 { format!("{:.3} s", cpu / gb) } else { "n/a".into() };
        let device = c.device.map_or(String::new(), |d| format!(" + softrdmad device loops {:.3} s", d.as_secs_f64()));
        out.line(&format!(
            " CPU time per GB : {per_gb} (#bytes {}: user {:.3} s + system {:.3} s, both sides{device}, for {:.3} GB)",
            c.size,
            c.user.as_secs_f64(),
            c.sys.as_secs_f64(),
            gb
        ));
    }
    // Of the largest size run (with -a, smaller sizes may take the copying path).
    let size = cpu.iter().map(|c| c.size).max().unwrap_or(0);
    let (copies, icrc) = match path {
        PathTaken::SameHost => (COPIES_SAME_HOST.to_vec(), "same-host link, no ICRC"),
        PathTaken::Loopback => (copies_loopback(verb, rc, size, mtu), "one device's internal loopback, no ICRC"),
        PathTaken::Udp => (copies(verb, rc, size, mtu).to_vec(), "plus one ICRC pass over the payload on each side"),
    };
    let total: u32 = copies.iter().map(|c| c.1).sum();
    let parts: Vec<String> = copies.iter().map(|(what, n)| format!("{what} {n}")).collect();
    out.line(&format!(" Copies per byte : {total} ({}; {icrc})", parts.join(", ")));
}

// ---- one side, end to end ---------------------------------------------------------------------

/// Resident set size of this process in bytes (`VmRSS` of `/proc/self/status`; 0 if unreadable).
fn vm_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            l.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// How a side reports the memory its QPs take: the RSS growth from `base` (taken now if `None`)
/// to the end of the connection setup, divided by `qps` (this side's QPs, or both sides' when both
/// run in this process).
#[derive(Debug, Clone, Copy)]
struct MemProbe {
    base: Option<u64>,
    qps: usize,
}

fn run_side(
    ctx: Context,
    plan: &Plan,
    role: Role,
    mut ctl: Ctl,
    out: &Out,
    count_cpu: bool,
    probe: MemProbe,
) -> Result<(), String> {
    let rss0 = probe.base.unwrap_or_else(vm_rss);
    let mtu = path_mtu(&ctx, plan)?;
    let fitted = plan.fit_ud(mtu);
    let plan = fitted.as_ref().unwrap_or(plan);
    let mut side = Side::open(ctx, plan, mtu)?;
    side.join_group(plan, role)?;
    if plan.verb == Verb::Send {
        side.fill_receives(plan)?;
    }
    print_banner(out, plan, role, &side);
    let mut mine = side.dests(plan)?;
    // The client says which test it runs; the server refuses a mismatch.
    match role {
        Role::Client => {
            ctl.send(&plan.hello())?;
            ctl.expect("OK")?;
        }
        Role::Server => {
            let hello = ctl.recv()?;
            if hello != plan.hello() {
                let msg = format!("the client runs a different test: {hello:?}, this side {:?}", plan.hello());
                let _ = ctl.send(&format!("ERR {msg}"));
                return Err(msg);
            }
            ctl.send("OK")?;
        }
    }
    // The QPs' addresses: with -R the CM trades them (its IDs live as long as the test); else,
    // as perftest's exchange, the client sends its own and the server answers with its.
    let mut _cm_links = None;
    let theirs = match (role, plan.rdma_cm) {
        (_, Some(port)) => {
            let (theirs, links) = cm::connect(&mut side, plan, role, &mut ctl, &mut mine, port)?;
            _cm_links = Some(links);
            theirs
        }
        (Role::Client, None) => {
            for d in &mine {
                ctl.send(&d.to_line())?;
            }
            let mut r = Vec::new();
            for _ in 0..mine.len() {
                r.push(Dest::from_line(&ctl.recv()?).ok_or("Couldn't parse the remote address")?);
            }
            side.connect(plan, r.clone())?;
            r
        }
        (Role::Server, None) => {
            let mut r = Vec::new();
            for _ in 0..mine.len() {
                r.push(Dest::from_line(&ctl.recv()?).ok_or("Couldn't parse the remote address")?);
            }
            side.connect(plan, r.clone())?;
            for d in &mine {
                ctl.send(&d.to_line())?;
            }
            r
        }
    };
    for d in &mine {
        print_dest(out, plan, role, "local", d);
    }
    for d in &theirs {
        print_dest(out, plan, role, "remote", d);
    }
    // The device this side's loop time is of (softrdmad: one device loop does the work of both
    // sides on it).
    let device_gid = side.ctx.query_gid(1, usize::from(plan.gid_index)).ok();
    // Everything this side (and, in one process, the peer: it connected before answering) created
    // for its QPs is in place now: PD, CQs, QPs in RTS, the tool's own per-QP bookkeeping.
    let rss1 = vm_rss();
    if rss0 > 0 && rss1 > 0 {
        let grown = rss1.saturating_sub(rss0);
        out.line(&format!(
            " QP memory       : {} bytes per QP (VmRSS +{} KiB for {} QPs created and connected)",
            grown / probe.qps.max(1) as u64,
            grown / 1024,
            probe.qps
        ));
    }
    out.line(RESULT_LINE);
    let passive_lat = !plan.bw && matches!(plan.verb, Verb::Read | Verb::Atomic) && role == Role::Server;
    if !passive_lat {
        out.line(table_header(plan));
    }
    let mut cpu = Vec::new();
    for &size in &plan.sizes {
        // Barrier: the server has its receives posted before the client starts.
        match role {
            Role::Client => {
                ctl.send(&format!("SIZE {size}"))?;
                ctl.expect("READY")?;
            }
            Role::Server => {
                let l = ctl.expect("SIZE")?;
                if l != format!("SIZE {size}") {
                    return Err(format!("protocol error: {l:?} for size {size}"));
                }
                if plan.verb == Verb::Send {
                    side.fill_receives(plan)?;
                }
                ctl.send("READY")?;
            }
        }
        let (u0, s0) = cpu_times();
        let dev0 = side.ctx.device_thread_cpu();
        let mut row: Option<String> = None;
        let mut bytes = 0u64;
        if plan.bw {
            match role {
                Role::Client => {
                    let r = bw_client(&mut side, plan, size)?;
                    bytes = r.bytes;
                    row = Some(bw_row(plan, size, &r));
                    ctl.send("DONE")?;
                }
                Role::Server => {
                    if let Some(r) = bw_server(&mut side, plan, size, &mut ctl)? {
                        row = Some(bw_row(plan, size, &r));
                    }
                }
            }
        } else {
            let (posts, elapsed, done_seen) = lat_run(&mut side, plan, size, role, &mut ctl)?;
            if !passive_lat {
                let r = lat_row(plan, size, &posts, elapsed);
                bytes = r.bytes;
                row = Some(r.row);
            }
            match role {
                Role::Client => ctl.send("DONE")?,
                Role::Server if !done_seen => {
                    ctl.expect("DONE")?;
                }
                Role::Server => {}
            }
        }
        let (u1, s1) = cpu_times();
        let (du, ds) = if count_cpu { (u1 - u0, s1 - s0) } else { (Duration::ZERO, Duration::ZERO) };
        // A softrdmad device's loop does the device work of its clients: each side measures its
        // device's, and the two count it once when they share that device (same GID).
        let device = match (dev0, side.ctx.device_thread_cpu()) {
            (Some(a), Some(b)) if count_cpu => Some(b.saturating_sub(a)),
            _ => None,
        };
        let mine = SideCpu { user: du, sys: ds, device, device_gid };
        // Results: each side sends its CPU times (the server first); the client also sends its row
        // (the passive server of WRITE/READ/atomic bandwidth prints the client's figures, as
        // perftest's does).
        let (peer, bytes) = match role {
            Role::Server => {
                ctl.send(&format!("RESULT {}", mine.encode()))?;
                let l = ctl.expect("ROW")?;
                // ROW <bytes> <the client's SideCpu fields> <row text>
                let f: Vec<&str> = l.splitn(SideCpu::FIELDS + 3, ' ').collect();
                if plan.bw && plan.verb != Verb::Send {
                    row = Some(f.get(SideCpu::FIELDS + 2).unwrap_or(&"").to_string());
                }
                let cpu = SideCpu::decode(f.get(2..SideCpu::FIELDS + 2).unwrap_or_default());
                (cpu, f.get(1).and_then(|b| b.parse().ok()).unwrap_or(0))
            }
            Role::Client => {
                let l = ctl.expect("RESULT")?;
                ctl.send(&format!("ROW {bytes} {} {}", mine.encode(), row.clone().unwrap_or_default()))?;
                (SideCpu::decode(&l.split(' ').skip(1).collect::<Vec<_>>()), bytes)
            }
        };
        let device = match (mine.device, peer.device.filter(|_| !mine.same_device(&peer))) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or_default() + b.unwrap_or_default()),
        };
        cpu.push(CpuLine { size, user: du + peer.user, sys: ds + peer.sys, device, bytes });
        if let Some(r) = row {
            if !passive_lat {
                out.line(&r);
            }
        }
    }
    out.line(RESULT_LINE);
    if !passive_lat {
        // The path the packets took: the same-host link if this device used a lane and received
        // nothing over UDP; the device's own loopback if it used neither but sent itself packets.
        let (link, icrc) = (side.ctx.same_host_stats(), side.ctx.icrc_stats());
        let path = match (link.tx_pkts + link.rx_pkts > 0, icrc.verified + icrc.recovered + icrc.bad > 0) {
            (_, true) => PathTaken::Udp,
            (true, false) => PathTaken::SameHost,
            (false, false) if link.loopback_pkts + link.loopback_direct > 0 => PathTaken::Loopback,
            (false, false) => PathTaken::Udp,
        };
        print_extras(out, plan.test.verb(), plan.conn == QpType::Rc, side.mtu.bytes() as u64, &cpu, path);
    }
    if std::env::var_os("SOFTRDMA_PERF_DEBUG").is_some() {
        let (c, v, link) = (side.ctx.counters(), side.ctx.icrc_stats(), side.ctx.same_host_stats());
        eprintln!(
            "{}: sent {} rcvd {} retransmits {} seq-naks {} ack-timeouts {} retry-rounds {}; ICRC verified {} recovered-id {} bad {}; corked posts {}; received in place {}; same-host poller yields {} moves {}; polls left armed {} armed wake-ups {}; CM IDs {}",
            side.dev_name,
            c.sent_pkts,
            c.rcvd_pkts,
            c.retransmits,
            c.rcvd_seq_err,
            c.ack_timeouts,
            c.retry_rounds,
            v.verified,
            v.recovered,
            v.bad,
            side.ctx.corked_posts(),
            side.ctx.rx_placed(),
            link.poller_yields,
            link.poller_moves,
            link.polls_left_armed,
            link.armed_wakeups,
            side.ctx.cm_id_count().unwrap_or(0)
        );
    }
    Ok(())
}

/// The device the test runs on, with the port of `-i` checked (a soft device has port 1 only).
fn open_ctx(a: &PerfArgs, name: &str, ip: Option<IpAddr>) -> Result<Context, String> {
    let ctx = open_named(a, name, ip)?;
    ctx.query_port(a.ib_port).map_err(|e| format!(" Unable to query port {} attributes: {e}", a.ib_port))?;
    Ok(ctx)
}

fn open_named(a: &PerfArgs, name: &str, ip: Option<IpAddr>) -> Result<Context, String> {
    match ip {
        Some(ip) => {
            let mut b = DeviceBuilder::new(name, &a.netdev).addr(ip);
            if let Some(p) = a.udp_port {
                b = b.udp_port(p);
            }
            b.open().map_err(|e| format!("Couldn't open device {name} on {ip}: {e}"))
        }
        None => match &a.ib_dev {
            Some(n) => open_device(n).map_err(|e| format!("Couldn't get context for {n}: {e}")),
            None => {
                let list = devices().map_err(|e| format!("Failed to get IB devices list: {e}"))?;
                let first = list.first().ok_or(" No IB devices found")?;
                open_device(&first.name).map_err(|e| format!("Couldn't get context for {}: {e}", first.name))
            }
        },
    }
}

fn perf(a: &PerfArgs) -> Result<(), String> {
    let plan = Plan::from_args(a)?;
    if a.loopback {
        return loopback(a, &plan);
    }
    let name = a.ib_dev.clone().unwrap_or_else(|| "softrdma0".into());
    match &a.servername {
        Some(host) => {
            let ctx = open_ctx(a, &name, a.bind)?;
            let addrs = (host.as_str(), a.port).to_socket_addrs().map_err(|e| format!("{host}: {e}"))?;
            let sock = addrs
                .into_iter()
                .find_map(|ad| connect_retry(ad, Duration::from_secs(5)))
                .ok_or_else(|| format!("Couldn't connect to {host}:{}", a.port))?;
            let probe = MemProbe { base: None, qps: plan.qps };
            run_side(ctx, &plan, Role::Client, Ctl::new(sock)?, &Out { quiet: false }, true, probe)
        }
        None => {
            let ctx = open_ctx(a, &name, a.bind)?;
            let listener = crate::exchange::listen(a.port)?;
            println!();
            println!("************************************");
            println!("* Waiting for client to connect... *");
            println!("************************************");
            let (sock, _) = listener.accept().map_err(|e| format!("accept() failed: {e}"))?;
            let probe = MemProbe { base: None, qps: plan.qps };
            run_side(ctx, &plan, Role::Server, Ctl::new(sock)?, &Out { quiet: false }, true, probe)
        }
    }
}

fn connect_retry(addr: SocketAddr, total: Duration) -> Option<TcpStream> {
    let until = Instant::now() + total;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => return Some(s),
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => return None,
        }
    }
}

/// Both sides in this process: the server on a thread (quiet), the client printing. CPU time is
/// the whole process's, so the server reports none of its own.
fn loopback(a: &PerfArgs, plan: &Plan) -> Result<(), String> {
    let name = a.ib_dev.clone().unwrap_or_else(|| "softrdma".into());
    let ip_s = IpAddr::V4(Ipv4Addr::new(127, 0, 77, 1));
    let ip_c = IpAddr::V4(Ipv4Addr::new(127, 0, 77, 2));
    let ctx_s = open_ctx(a, &format!("{name}0"), Some(ip_s))?;
    let ctx_c = open_ctx(a, &format!("{name}1"), Some(ip_c))?;
    // Both sides' QPs count in this process's RSS: the client reports the growth over both.
    let rss0 = vm_rss();
    let sprobe = MemProbe { base: None, qps: plan.qps };
    let cprobe = MemProbe { base: Some(rss0), qps: 2 * plan.qps };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("Couldn't listen: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let splan = plan.clone();
    let server = std::thread::Builder::new()
        .name("perf-server".into())
        .spawn(move || -> Result<(), String> {
            let (sock, _) = listener.accept().map_err(|e| format!("accept() failed: {e}"))?;
            run_side(ctx_s, &splan, Role::Server, Ctl::new(sock)?, &Out { quiet: true }, false, sprobe)
        })
        .map_err(|e| e.to_string())?;
    let sock = connect_retry(addr, Duration::from_secs(5)).ok_or("Couldn't connect to the loopback server")?;
    let res = run_side(ctx_c, plan, Role::Client, Ctl::new(sock)?, &Out { quiet: false }, true, cprobe);
    let sres = server.join().map_err(|_| "the server thread panicked".to_string())?;
    res.and(sres)
}

/// Run `softrdma perf`.
pub fn run(args: PerfArgs) -> ExitCode {
    match perf(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sides on one softrdmad device count its loop once; with `-g` (the exchanged addresses
    /// are groups, so unlike) as well.
    #[test]
    fn a_shared_device_loop_is_told_by_the_device_gid() {
        let g = |last: u8| Some(Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, last]));
        let ms = |n| Some(Duration::from_millis(n));
        let side =
            |device, device_gid| SideCpu { user: Duration::from_nanos(7), sys: Duration::ZERO, device, device_gid };
        let a = side(ms(30), g(1));
        let wire = a.encode();
        assert_eq!(wire, "7 0 30000000 00000000000000000000ffff7f000001");
        let back = SideCpu::decode(&wire.split(' ').collect::<Vec<_>>());
        assert_eq!((back.user, back.sys, back.device, back.device_gid), (a.user, a.sys, a.device, a.device_gid));
        assert!(a.same_device(&back));
        assert!(!a.same_device(&side(ms(30), g(2))));
        // Embedded devices have no loop to share; a peer that sends no GID shares none.
        assert!(!side(None, g(1)).same_device(&side(None, g(1))));
        assert!(!a.same_device(&SideCpu::decode(&["7", "0", "30000000"])));
        assert_eq!(SideCpu::decode(&["7", "0", "-", "-"]).device_gid, None);
    }

    #[test]
    fn dest_line_round_trips_in_perftest_format() {
        let d = Dest {
            lid: 0,
            out_reads: 0x80,
            qpn: 0x1a,
            psn: 0xaf11f2,
            rkey: 0x1094,
            vaddr: 0x7f58_afae_f000,
            gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 10, 77, 9, 2]),
        };
        let l = d.to_line();
        assert_eq!(l.len() + 1, 108, "KEY_MSG_SIZE_GID with its NUL");
        assert!(l.starts_with("0000:0080:00001a:af11f2:00001094:00007f58afaef000:00:00:"));
        assert_eq!(Dest::from_line(&l), Some(d));
    }

    #[test]
    fn c_hash_hex() {
        assert_eq!(hash_hex(0, 4), "0000");
        assert_eq!(hash_hex(0x1a, 6), "0x001a");
        assert_eq!(hash_hex(0x97f01, 6), "0x97f01");
        assert_eq!(hash_hex(0x7f58_afae_f000, 16), "0x007f58afaef000");
    }

    #[test]
    fn rows_match_perftest_spacing() {
        let a = PerfArgs {
            test: Test::WriteBw,
            servername: None,
            ib_dev: None,
            ib_port: 1,
            gid_index: 1,
            mcg: false,
            mgid: None,
            size: None,
            all: false,
            iters: None,
            duration: Some(5.0),
            qps: 1,
            connection: "RC".into(),
            mtu: None,
            tx_depth: None,
            rx_depth: 512,
            cq_mod: None,
            outs: None,
            atomic_type: "FETCH_AND_ADD".into(),
            no_peak: false,
            report_gbits: false,
            rdma_cm: false,
            post_list: 1,
            cpu_freq: false,
            port: 18515,
            loopback: false,
            bind: None,
            netdev: "lo".into(),
            udp_port: None,
        };
        let plan = Plan::from_args(&a).unwrap();
        let r = BwResult { iters: 2464, peak: 0.0, avg: 51.31, msg_rate: 0.000821, bytes: 0 };
        // From golden/tool-output/20-ib_write_bw-rxe0.txt.
        assert_eq!(bw_row(&plan, 65536, &r), " 65536      2464             0.00               51.31  \t\t   0.000821");
        let mut lp = plan.clone();
        lp.verb = Verb::Send;
        lp.bw = false;
        let posts: Vec<u64> = (0..=137017u64).map(|i| i * 21900).collect();
        let row = lat_row(&lp, 2, &posts[..137017], 137017 * 21900).row;
        // From golden/tool-output/22-ib_write_lat-rxe0.txt (t_avg 10.95, tps 45662).
        assert!(row.starts_with(" 2             137017            10.95          45662.1"), "{row:?}");
    }
}
