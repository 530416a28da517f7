//! Scale (issue #6): 10,000 RC QPs on one embedded device in one process, connected pairwise to each
//! other over the device's own UDP socket, with bounded memory per QP and data moved over a sample
//! of the pairs with byte checks.
//!
//! The memory bound is the resident set growth from before the QPs were created to after all of them
//! reached RTS, divided by the number of QPs. It is deliberately generous (tens of KiB, where an idle
//! QP costs about a kilobyte): it catches per-QP preallocation proportional to queue depth, not
//! allocator noise. This test is alone in its binary so no other test's allocations land in the
//! measurement.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use softrdma_verbs::{
    Access, CompletionQueue, ConnectParams, DeviceBuilder, Payload, Psn, QpCap, QpInitAttr, QpType, QueuePair, RecvWr,
    SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

/// QPs on the device (5,000 connected pairs).
const QPS: usize = 10_000;
/// Pairs that move data.
const SAMPLE: usize = 64;
/// Bytes per sampled WRITE: three packets at the 1024-byte path MTU used here.
const LEN: usize = 3000;
/// Upper bound on resident memory per QP.
const MAX_BYTES_PER_QP: u64 = 32 * 1024;

/// Resident set size in bytes (`VmRSS` in `/proc/self/status`).
fn vm_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let l = s.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).expect("VmRSS value") * 1024
}

fn wait_wcs(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60), "{} of {n} completions: {out:?}", out.len());
    }
    out
}

fn pattern(pair: usize, i: usize) -> u8 {
    (pair.wrapping_mul(31) ^ i.wrapping_mul(7) ^ (i >> 8)) as u8
}

#[test]
fn ten_thousand_rc_qps_on_one_device() {
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 31, 1));
    let ctx = DeviceBuilder::new("scale0", "lo").addr(ip).udp_port(48831).open().expect("open device");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * SAMPLE as u32 + 16, None).unwrap();
    let rights = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE);
    // Per sampled pair: the WRITE's source, its target, and a receive buffer for the SEND back.
    let mr = pd.reg_mr(SAMPLE * 3 * LEN, rights).unwrap();
    for p in 0..SAMPLE {
        let src: Vec<u8> = (0..LEN).map(|i| pattern(p, i)).collect();
        mr.write(p * 3 * LEN, &src).unwrap();
        mr.write(p * 3 * LEN + LEN, &vec![0; 2 * LEN]).unwrap();
    }
    let gid = ctx.query_gid(1, 1).unwrap();

    let before = vm_rss();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = QpInitAttr { qp_type: QpType::Rc, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false };
    let qps: Vec<QueuePair> = (0..QPS).map(|_| pd.create_qp(&attr).unwrap()).collect();
    for pair in qps.chunks_exact(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let (pa, pb) = (Psn::new(a.qpn().value() * 3), Psn::new(b.qpn().value() * 5));
        for (me, peer, mine, theirs) in [(a, b, pa, pb), (b, a, pb, pa)] {
            let mut p = ConnectParams::new(peer.qpn(), theirs, gid, mine);
            p.sgid_index = 1;
            p.access = rights;
            me.connect(&pd, &p).unwrap();
        }
    }
    let after = vm_rss();
    let per_qp = after.saturating_sub(before) / QPS as u64;
    eprintln!("{QPS} RC QPs created and connected: VmRSS +{} KiB, {per_qp} bytes per QP", (after - before) / 1024);
    assert!(per_qp <= MAX_BYTES_PER_QP, "{per_qp} bytes per QP (bound {MAX_BYTES_PER_QP})");

    // Data over a sample of pairs spread over the whole range: a WRITE from the even QP to the odd
    // one, and a SEND back, all in flight at once.
    let pairs: Vec<usize> = (0..SAMPLE).map(|k| k * (QPS / 2) / SAMPLE + k % 7).collect();
    for (k, &p) in pairs.iter().enumerate() {
        let base = k * 3 * LEN;
        let back = mr.sge(base + 2 * LEN, LEN).unwrap();
        qps[2 * p].post_recv(RecvWr { wr_id: k as u64, sgl: [back].into() }).unwrap();
    }
    for (k, &p) in pairs.iter().enumerate() {
        let base = k * 3 * LEN;
        let write = SendWr {
            wr_id: k as u64,
            op: SendOp::Write { remote_addr: mr.addr() + (base + LEN) as u64, rkey: mr.rkey() },
            payload: Payload::Sgl([mr.sge(base, LEN).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        qps[2 * p].post_send(write).unwrap();
        let send = SendWr {
            wr_id: (SAMPLE + k) as u64,
            op: SendOp::Send,
            payload: Payload::Sgl([mr.sge(base, LEN).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        qps[2 * p + 1].post_send(send).unwrap();
    }
    let wcs = wait_wcs(&cq, 3 * SAMPLE);
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }
    assert_eq!(wcs.iter().filter(|w| w.opcode == WcOpcode::RdmaWrite).count(), SAMPLE);
    assert_eq!(wcs.iter().filter(|w| w.opcode == WcOpcode::Recv).count(), SAMPLE);
    for (k, pair) in pairs.iter().enumerate() {
        let mut got = vec![0u8; 2 * LEN];
        mr.read(k * 3 * LEN + LEN, &mut got).unwrap();
        let want: Vec<u8> = (0..LEN).map(|i| pattern(k, i)).collect();
        assert!(got[..LEN] == want[..], "WRITE of pair {pair} corrupted");
        assert!(got[LEN..] == want[..], "SEND of pair {pair} corrupted");
    }
    // Every QP is still usable: the QPs not in the sample stayed in RTS with nothing queued.
    for q in qps.iter().step_by(997) {
        let info = q.query().unwrap();
        assert_eq!(info.sq_outstanding, 0);
    }
}
