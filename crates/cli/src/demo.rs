//! `softrdma demo`: two embedded soft RoCE devices on loopback, an RC connection between them, one
//! of every operation with its data checked, then a bandwidth and a latency figure.

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use softrdma_verbs::{
    Access, CompletionQueue, ConnectParams, Context, DeviceBuilder, MemoryRegion, Mtu, Payload, ProtectionDomain, Psn,
    QpCap, QpInitAttr, QpType, QueuePair, RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList, WcOpcode, WcStatus,
    WorkCompletion, ROCE_PORT,
};

/// Options of `softrdma demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// UDP port of the two devices (4791 is RoCEv2's; pick another if it is taken).
    #[arg(long, default_value_t = ROCE_PORT)]
    port: u16,
    /// Seconds to spend on the bandwidth figure.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
}

const REGION: usize = 4 << 20;

struct Host {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn host(name: &str, last: u8, port: u16) -> Result<Host, String> {
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 77, last));
    let ctx = DeviceBuilder::new(name, "lo").addr(ip).udp_port(port).open().map_err(|e| format!("{name}: {e}"))?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).map_err(|e| e.to_string())?;
    let cap = QpCap { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
    let qp = pd
        .create_qp(&QpInitAttr { qp_type: QpType::Rc, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false })
        .map_err(|e| e.to_string())?;
    let rights = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC);
    let mr = pd.reg_mr(REGION, rights).map_err(|e| e.to_string())?;
    Ok(Host { ctx, pd, cq, qp, mr })
}

fn wait(cq: &CompletionQueue, n: usize) -> Result<Vec<WorkCompletion>, String> {
    let mut out = Vec::with_capacity(n);
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).map_err(|e| e.to_string())?;
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!("timed out waiting for {n} completions (got {out:?})"));
        }
    }
    if let Some(bad) = out.iter().find(|w| w.status != WcStatus::Success) {
        return Err(format!("work request {} failed: {} ({})", bad.wr_id, bad.status.description(), bad.status.name()));
    }
    Ok(out)
}

fn wr(id: u64, op: SendOp, sgl: Vec<Sge>) -> SendWr {
    SendWr { wr_id: id, op, payload: Payload::Sgl(sgl.into()), flags: SendFlags::SIGNALED, ud: None }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn check(what: &str, ok: bool) -> Result<(), String> {
    if ok {
        println!("  {what}: ok");
        Ok(())
    } else {
        Err(format!("{what}: data mismatch"))
    }
}

/// Run the demo.
pub fn run(args: DemoArgs) -> ExitCode {
    match demo(&args) {
        Ok(()) => {
            println!("demo finished: every check passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn demo(args: &DemoArgs) -> Result<(), String> {
    let a = host("demo0", 1, args.port)?;
    let b = host("demo1", 2, args.port)?;
    for h in [&a, &b] {
        let gid = h.ctx.query_gid(1, 1).map_err(|e| e.to_string())?;
        let port = h.ctx.query_port(1).map_err(|e| e.to_string())?;
        println!(
            "device {}: node_guid {}, GID[1] {gid}, UDP port {}, port {} active_mtu {}",
            h.ctx.name(),
            h.ctx.info().node_guid(),
            h.ctx.udp_port(),
            port.state.name(),
            port.active_mtu
        );
    }
    let (pa, pb) = (Psn::new(0x1000), Psn::new(0x2000));
    for (me, peer, mine, theirs) in [(&a, &b, pa, pb), (&b, &a, pb, pa)] {
        let gid = peer.ctx.query_gid(1, 1).map_err(|e| e.to_string())?;
        let mut p = ConnectParams::new(peer.qp.qpn(), theirs, gid, mine);
        p.mtu = Mtu::M4096;
        me.qp.connect(&me.pd, &p).map_err(|e| e.to_string())?;
    }
    println!("RC QP {} <-> QP {} connected (path MTU 4096)", a.qp.qpn().value(), b.qp.qpn().value());

    // SEND with immediate.
    let data = pattern(4096, 1);
    a.mr.write(0, &data).map_err(|e| e.to_string())?;
    b.qp.post_recv(RecvWr { wr_id: 100, sgl: [b.mr.sge(0, 8192).map_err(|e| e.to_string())?].into() })
        .map_err(|e| e.to_string())?;
    a.qp.post_send(wr(1, SendOp::SendWithImm(0xc0ffee), vec![a.mr.sge(0, 4096).map_err(|e| e.to_string())?]))
        .map_err(|e| e.to_string())?;
    wait(&a.cq, 1)?;
    let r = wait(&b.cq, 1)?;
    println!("SEND with immediate, 4096 bytes: receiver got {} bytes, imm {:#x}", r[0].byte_len, r[0].imm);
    check("send data", b.mr.to_vec(0, 4096).map_err(|e| e.to_string())? == data && r[0].imm == 0xc0ffee)?;

    // RDMA WRITE 1 MiB.
    let data = pattern(1 << 20, 2);
    a.mr.write(0, &data).map_err(|e| e.to_string())?;
    a.qp.post_send(wr(
        2,
        SendOp::Write { remote_addr: b.mr.addr() + (1 << 20), rkey: b.mr.rkey() },
        vec![a.mr.sge(0, 1 << 20).map_err(|e| e.to_string())?],
    ))
    .map_err(|e| e.to_string())?;
    wait(&a.cq, 1)?;
    println!("RDMA WRITE, 1 MiB into the peer's region at offset 1 MiB");
    check("write data", b.mr.to_vec(1 << 20, 1 << 20).map_err(|e| e.to_string())? == data)?;

    // RDMA WRITE with immediate.
    let data = pattern(65536, 3);
    a.mr.write(0, &data).map_err(|e| e.to_string())?;
    b.qp.post_recv(RecvWr { wr_id: 101, sgl: SgeList::new() }).map_err(|e| e.to_string())?;
    a.qp.post_send(wr(
        3,
        SendOp::WriteWithImm { remote_addr: b.mr.addr(), rkey: b.mr.rkey(), imm: 0x5eed },
        vec![a.mr.sge(0, 65536).map_err(|e| e.to_string())?],
    ))
    .map_err(|e| e.to_string())?;
    wait(&a.cq, 1)?;
    let r = wait(&b.cq, 1)?;
    println!(
        "RDMA WRITE with immediate, 64 KiB: receiver completion {:?} len {} imm {:#x}",
        r[0].opcode, r[0].byte_len, r[0].imm
    );
    check(
        "write-with-immediate data",
        b.mr.to_vec(0, 65536).map_err(|e| e.to_string())? == data && r[0].opcode == WcOpcode::RecvRdmaWithImm,
    )?;

    // RDMA READ 1 MiB back.
    let remote = b.mr.to_vec(1 << 20, 1 << 20).map_err(|e| e.to_string())?;
    a.qp.post_send(wr(
        4,
        SendOp::Read { remote_addr: b.mr.addr() + (1 << 20), rkey: b.mr.rkey() },
        vec![a.mr.sge(2 << 20, 1 << 20).map_err(|e| e.to_string())?],
    ))
    .map_err(|e| e.to_string())?;
    wait(&a.cq, 1)?;
    println!("RDMA READ, 1 MiB from the peer");
    check("read data", a.mr.to_vec(2 << 20, 1 << 20).map_err(|e| e.to_string())? == remote)?;

    // Atomics on an 8-byte word of B.
    let word = b.mr.addr() + 8;
    b.mr.write(8, &40u64.to_ne_bytes()).map_err(|e| e.to_string())?;
    a.qp.post_send(wr(
        5,
        SendOp::FetchAdd { remote_addr: word, rkey: b.mr.rkey(), add: 2 },
        vec![a.mr.sge(0, 8).map_err(|e| e.to_string())?],
    ))
    .map_err(|e| e.to_string())?;
    a.qp.post_send(wr(
        6,
        SendOp::CompareSwap { remote_addr: word, rkey: b.mr.rkey(), compare: 42, swap: 7 },
        vec![a.mr.sge(8, 8).map_err(|e| e.to_string())?],
    ))
    .map_err(|e| e.to_string())?;
    wait(&a.cq, 2)?;
    let got = a.mr.to_vec(0, 16).map_err(|e| e.to_string())?;
    let fa = u64::from_ne_bytes(got[..8].try_into().expect("8 bytes"));
    let cs = u64::from_ne_bytes(got[8..].try_into().expect("8 bytes"));
    let now = u64::from_ne_bytes(b.mr.to_vec(8, 8).map_err(|e| e.to_string())?.try_into().expect("8 bytes"));
    println!("ATOMIC fetch-and-add 2 on 40 returned {fa}; compare-and-swap 42->7 returned {cs}; word is now {now}");
    check("atomics", fa == 40 && cs == 42 && now == 7)?;

    // Bandwidth: RDMA WRITEs of 64 KiB, 32 in flight.
    const MSG: usize = 64 << 10;
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds.max(0.1));
    let start = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wcs = Vec::new();
    while Instant::now() < deadline || done < posted {
        while posted - done < 32 && Instant::now() < deadline {
            let off = (posted as usize % (REGION / MSG)) * MSG;
            let sge = a.mr.sge(off, MSG).map_err(|e| e.to_string())?;
            a.qp.post_send(wr(
                posted,
                SendOp::Write { remote_addr: b.mr.addr() + off as u64, rkey: b.mr.rkey() },
                vec![sge],
            ))
            .map_err(|e| e.to_string())?;
            posted += 1;
        }
        wcs.clear();
        a.cq.poll(32, &mut wcs).map_err(|e| e.to_string())?;
        b.cq.poll(1, &mut wcs).map_err(|e| e.to_string())?;
        if let Some(w) = wcs.iter().find(|w| w.status != WcStatus::Success) {
            return Err(format!("bandwidth run: {}", w.status.description()));
        }
        done += wcs.len() as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = done as f64 * MSG as f64;
    println!(
        "bandwidth: {done} RDMA WRITEs of 64 KiB in {secs:.2} s = {:.1} MB/s ({:.2} Gbit/s)",
        bytes / secs / 1e6,
        bytes * 8.0 / secs / 1e9
    );

    // Latency: 64-byte SEND ping-pong, busy polling.
    const ITERS: usize = 2000;
    let mut rtts = Vec::with_capacity(ITERS);
    for i in 0..ITERS {
        for h in [&a, &b] {
            let sgl = vec![h.mr.sge(REGION - 64, 64).map_err(|e| e.to_string())?];
            h.qp.post_recv(RecvWr { wr_id: 200 + i as u64, sgl: sgl.into() }).map_err(|e| e.to_string())?;
        }
        let t = Instant::now();
        a.qp.post_send(wr(i as u64, SendOp::Send, vec![a.mr.sge(0, 64).map_err(|e| e.to_string())?]))
            .map_err(|e| e.to_string())?;
        wait(&b.cq, 1)?;
        b.qp.post_send(wr(i as u64, SendOp::Send, vec![b.mr.sge(0, 64).map_err(|e| e.to_string())?]))
            .map_err(|e| e.to_string())?;
        let mut got = wait(&a.cq, 2)?;
        got.extend(wait(&b.cq, 1)?);
        rtts.push(t.elapsed());
    }
    rtts.sort();
    let med = rtts[ITERS / 2].as_secs_f64() * 1e6;
    println!("latency: 64-byte SEND ping-pong, busy polling, {ITERS} round trips: median {:.1} us round trip, {:.1} us one way", med, med / 2.0);
    let c = a.ctx.counters();
    println!(
        "device demo0 counters: {} packets sent, {} received, {} retransmitted, {} dropped",
        c.sent_pkts,
        c.rcvd_pkts,
        c.retransmits,
        c.drop_malformed + c.drop_bad_state + c.drop_unknown_qp
    );
    Ok(())
}
