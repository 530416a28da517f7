//! `softrdma pingpong`: rdma-core's `ibv_rc_pingpong` — same flags, same out-of-band exchange on
//! TCP port 18515 (so it interoperates with itself and with the real tool's message format), same
//! output lines.
//!
//! On RoCE a GID is required; `ibv_rc_pingpong` needs `-g`, here it defaults to index 1 (the
//! first IPv4 address of the device).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use softrdma_device::registry::{RegistryError, Source};
use softrdma_device::Registry;
use softrdma_verbs::{
    devices, open_device, Access, CompletionQueue, ConnectParams, Context, Gid, Mtu, Payload, Psn, QpCap, QpInitAttr,
    QpType, Qpn, RecvWr, SendFlags, SendOp, SendWr, SgeList, WcStatus, WorkCompletion,
};

/// Flags of `ibv_rc_pingpong`.
#[derive(Args, Debug)]
pub struct PingpongArgs {
    /// Listen on / connect to TCP port.
    #[arg(short = 'p', long = "port", default_value_t = 18515)]
    port: u16,
    /// Use IB device (default: the first device found).
    #[arg(short = 'd', long = "ib-dev")]
    ib_dev: Option<String>,
    /// Use port of IB device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// Size of message to exchange.
    #[arg(short = 's', long = "size", default_value_t = 4096)]
    size: usize,
    /// Path MTU.
    #[arg(short = 'm', long = "mtu", default_value_t = 1024)]
    mtu: usize,
    /// Number of receives to post at a time.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 500)]
    rx_depth: u32,
    /// Number of exchanges.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    iters: u32,
    /// Service level value.
    #[arg(short = 'l', long = "sl", default_value_t = 0)]
    sl: u8,
    /// Sleep on CQ events (default poll).
    #[arg(short = 'e', long = "events")]
    events: bool,
    /// Local port GID index.
    #[arg(short = 'g', long = "gid-idx")]
    gid_idx: Option<u8>,
    /// Validate received buffer.
    #[arg(short = 'c', long = "chk")]
    chk: bool,
    /// Server to connect to (no server name: act as the server).
    servername: Option<String>,
}

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;

/// One side's connection data, as `ibv_rc_pingpong` exchanges it: `LLLL:QQQQQQ:PPPPPP:GID32` + NUL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: Gid,
}

impl Dest {
    const WIRE_LEN: usize = 52;

    fn to_wire(self) -> [u8; Self::WIRE_LEN] {
        let hex: String = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        let s = format!("{:04x}:{:06x}:{:06x}:{hex}", self.lid, self.qpn, self.psn);
        let mut out = [0u8; Self::WIRE_LEN];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    }

    fn from_wire(b: &[u8]) -> Option<Dest> {
        let text = std::str::from_utf8(b.split(|&c| c == 0).next()?).ok()?;
        let mut it = text.split(':');
        let lid = u16::from_str_radix(it.next()?, 16).ok()?;
        let qpn = u32::from_str_radix(it.next()?, 16).ok()?;
        let psn = u32::from_str_radix(it.next()?, 16).ok()?;
        let g = it.next()?;
        if g.len() != 32 || it.next().is_some() {
            return None;
        }
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(g.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Dest { lid, qpn, psn, gid: Gid(gid) })
    }

    fn print(&self, what: &str) {
        println!("  {what} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}", self.lid, self.qpn, self.psn, self.gid);
    }
}

/// Which devices there are, and where they come from, for an unknown `-d`.
fn known_devices() -> String {
    let Ok(reg) = Registry::load() else {
        return "the device list cannot be read".into();
    };
    let names: Vec<&str> = reg.devices().iter().map(|d| d.name.as_str()).collect();
    match reg.source() {
        Source::File(path) => format!("devices in {}: {}", path.display(), names.join(", ")),
        Source::Implicit(path) => {
            let implicit: Vec<String> = reg.devices().iter().map(|d| format!("{} on {}", d.name, d.netdev)).collect();
            format!("{} does not exist, so the only device is the implicit {}", path.display(), implicit.join(", "))
        }
        _ => format!("devices: {}", names.join(", ")),
    }
}

fn random_psn() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let x = (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32);
    let x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((x >> 40) as u32) & 0xff_ffff
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("{msg}");
    ExitCode::FAILURE
}

/// The client's side of the exchange: send ours, read the server's, say "done".
fn client_exchange(host: &str, port: u16, me: &Dest) -> Result<Dest, String> {
    let mut buf = [0u8; Dest::WIRE_LEN];
    let addrs = (host, port).to_socket_addrs().map_err(|e| format!("{host}: {e}"))?;
    let mut stream = addrs
        .into_iter()
        .find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(5)).ok())
        .ok_or_else(|| format!("Couldn't connect to {host}:{port}"))?;
    stream.write_all(&me.to_wire()).map_err(|_| "Couldn't send local address".to_string())?;
    stream.read_exact(&mut buf).map_err(|_| "Couldn't read remote address".to_string())?;
    stream.write_all(b"done\0").map_err(|_| "Couldn't send \"done\"".to_string())?;
    Dest::from_wire(&buf).ok_or_else(|| "Couldn't parse remote address".to_string())
}

/// Run `softrdma pingpong`.
pub fn run(args: PingpongArgs) -> ExitCode {
    match pingpong(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn pingpong(args: &PingpongArgs) -> Result<(), String> {
    let mtu = Mtu::from_bytes(args.mtu)
        .ok_or_else(|| format!("Invalid MTU {}: use 256, 512, 1024, 2048 or 4096", args.mtu))?;
    if args.size == 0 || args.size > u32::MAX as usize {
        return Err(format!("Invalid size {}", args.size));
    }
    let ctx: Context = match &args.ib_dev {
        Some(name) => open_device(name).map_err(|e| match e {
            softrdma_verbs::Error::Registry(RegistryError::UnknownDevice(_)) => {
                format!("IB device {name} not found ({})", known_devices())
            }
            softrdma_verbs::Error::Registry(e) => format!("Failed to get IB devices list: {e}"),
            // The device exists; its interface or address does not (or its port is taken).
            e => format!("Couldn't get context for {name}: {e}"),
        })?,
        None => {
            let list = devices().map_err(|e| format!("Failed to get IB devices list: {e}"))?;
            let first = list.first().ok_or("No IB devices found")?;
            open_device(&first.name).map_err(|e| format!("Couldn't get context for {}: {e}", first.name))?
        }
    };
    ctx.query_port(args.ib_port).map_err(|e| format!("Couldn't get port info: {e}"))?;
    let gid_idx = args.gid_idx.unwrap_or(1);
    let gid = ctx
        .query_gid(args.ib_port, usize::from(gid_idx))
        .map_err(|e| format!("can't read sgid of index {gid_idx}: {e}"))?;
    let pd = ctx.alloc_pd();
    // Receive buffer and send buffer side by side.
    let mr = pd.reg_mr(2 * args.size, Access::LOCAL_WRITE).map_err(|e| format!("Couldn't register MR: {e}"))?;
    let pattern: Vec<u8> = (0..args.size).map(|i| (i % 251) as u8).collect();
    mr.write(args.size, &pattern).map_err(|e| e.to_string())?;
    let channel = if args.events { Some(ctx.create_comp_channel().map_err(|e| e.to_string())?) } else { None };
    let cq = ctx.create_cq(args.rx_depth + 1, channel.as_ref()).map_err(|e| format!("Couldn't create CQ: {e}"))?;
    let cap =
        QpCap { max_send_wr: 1, max_recv_wr: args.rx_depth, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Rc, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false })
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    qp.init(Access::NONE).map_err(|e| format!("Failed to modify QP to INIT: {e}"))?;
    let recv = || RecvWr { wr_id: RECV_WRID, sgl: SgeList::one(mr.sge(0, args.size).expect("fits")) };
    for _ in 0..args.rx_depth {
        qp.post_recv(recv()).map_err(|e| format!("Couldn't post receive: {e}"))?;
    }
    let mut routs = args.rx_depth;
    if args.events {
        cq.req_notify(false).map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }
    let me = Dest { lid: 0, qpn: qp.qpn().value(), psn: random_psn(), gid };
    me.print("local address: ");

    let connect = |rem: &Dest| -> Result<(), String> {
        let mut p = ConnectParams::new(Qpn::new(rem.qpn), Psn::new(rem.psn), rem.gid, Psn::new(me.psn));
        p.mtu = mtu;
        p.sgid_index = gid_idx;
        p.access = Access::NONE;
        p.rd_atomic = 1;
        qp.connect(&pd, &p).map_err(|e| format!("Failed to modify QP: {e}"))
    };
    let rem = match &args.servername {
        Some(host) => {
            let rem = client_exchange(host, args.port, &me)?;
            connect(&rem)?;
            rem
        }
        None => {
            let listener = crate::exchange::listen(args.port)?;
            let (mut stream, _) = listener.accept().map_err(|e| format!("accept() failed: {e}"))?;
            let mut buf = [0u8; Dest::WIRE_LEN];
            stream.read_exact(&mut buf).map_err(|_| "Couldn't read remote address".to_string())?;
            let rem = Dest::from_wire(&buf).ok_or("Couldn't parse remote address")?;
            connect(&rem)?;
            stream.write_all(&me.to_wire()).map_err(|_| "Couldn't send local address".to_string())?;
            let mut done = [0u8; 5];
            stream.read_exact(&mut done).map_err(|_| "Couldn't read \"done\"".to_string())?;
            rem
        }
    };
    rem.print("remote address:");

    let send = || SendWr {
        wr_id: SEND_WRID,
        op: SendOp::Send,
        payload: Payload::Sgl(SgeList::one(mr.sge(args.size, args.size).expect("fits"))),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    let start = Instant::now();
    let mut pending = RECV_WRID;
    if args.servername.is_some() {
        qp.post_send(send()).map_err(|_| "Couldn't post send".to_string())?;
        pending |= SEND_WRID;
    }
    let (mut scnt, mut rcnt) = (0u32, 0u32);
    let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(2);
    while rcnt < args.iters || scnt < args.iters {
        wcs.clear();
        if let Some(ch) = &channel {
            ch.get_cq_event(None);
            cq.req_notify(false).map_err(|_| "Couldn't request CQ notification".to_string())?;
        }
        wait_some(&cq, &mut wcs, channel.is_none())?;
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                return Err(format!(
                    "Failed status {} ({}) for wr_id {}",
                    wc.status.description(),
                    wc.status as u32,
                    wc.wr_id
                ));
            }
            match wc.wr_id {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    routs -= 1;
                    if routs <= 1 {
                        while routs < args.rx_depth {
                            qp.post_recv(recv()).map_err(|_| "Couldn't post receive".to_string())?;
                            routs += 1;
                        }
                    }
                    rcnt += 1;
                    if args.chk && mr.to_vec(0, args.size).map_err(|e| e.to_string())? != pattern {
                        return Err(format!("Received data does not match at iteration {rcnt}"));
                    }
                }
                id => return Err(format!("Completion for unknown wr_id {id}")),
            }
            pending &= !wc.wr_id;
            if scnt < args.iters && pending == 0 {
                qp.post_send(send()).map_err(|_| "Couldn't post send".to_string())?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    let usec = start.elapsed().as_secs_f64() * 1e6;
    let bytes = args.size as u64 * u64::from(args.iters) * 2;
    println!("{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec", usec / 1e6, bytes as f64 * 8.0 / usec);
    println!("{} iters in {:.2} seconds = {:.2} usec/iter", args.iters, usec / 1e6, usec / f64::from(args.iters));
    Ok(())
}

/// Poll until at least one completion (busy polling, or one pass after a channel event).
fn wait_some(cq: &CompletionQueue, out: &mut Vec<WorkCompletion>, busy: bool) -> Result<(), String> {
    let idle_limit = Instant::now() + Duration::from_secs(3600);
    loop {
        cq.poll(2, out).map_err(|e| format!("poll CQ failed: {e}"))?;
        if !out.is_empty() || !busy {
            return Ok(());
        }
        if Instant::now() > idle_limit {
            return Err("no completion for an hour".into());
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_matches_rc_pingpong() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0x81590e,
            gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 11]),
        };
        let w = d.to_wire();
        assert_eq!(&w[..51], b"0000:000011:81590e:00000000000000000000ffff0a4d000b");
        assert_eq!(w[51], 0);
        assert_eq!(Dest::from_wire(&w), Some(d));
        assert_eq!(Dest::from_wire(b"0000:000011:81590e:00"), None);
        assert_eq!(Dest::from_wire(b"zz"), None);
    }
}
