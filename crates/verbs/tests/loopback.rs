//! Two embedded devices in one process, on two loopback addresses, doing every operation with
//! byte-for-byte checks: over real UDP sockets (the same-host link off) and over the same-host
//! link (its default); and two QPs of one device, which takes its own packets in directly (its
//! internal loopback) or, with the link off, over UDP to its own address.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use softrdma_verbs::{
    Access, AhAttr, CompletionQueue, Context, DeviceBuilder, Gid, ModifyQp, Mtu, Payload, ProtectionDomain, Psn, QpCap,
    QpInitAttr, QpState, QpType, Qpn, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

/// A port of our own per test so tests run in parallel.
fn open(last: u8, port: u16) -> Context {
    open_with(last, port, false)
}

fn open_with(last: u8, port: u16, same_host: bool) -> Context {
    DeviceBuilder::new(&format!("t{last}"), "lo")
        .addr(IpAddr::V4(Ipv4Addr::new(127, 0, 9, last)))
        .udp_port(port)
        .same_host(same_host)
        .open()
        .expect("open device")
}

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(ctx: Context, qp_type: QpType) -> Side {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4096, None).unwrap();
    let cap = QpCap { max_send_wr: 1024, max_recv_wr: 1024, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 };
    let qp =
        pd.create_qp(&QpInitAttr { qp_type, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false }).unwrap();
    Side { ctx, pd, cq, qp }
}

fn connect(a: &Side, b: &Side, mtu: Mtu) {
    for (me, peer, sq, rq) in [(a, b, 100, 200), (b, a, 200, 100)] {
        to_rts(me, peer.ctx.query_gid(1, 1).unwrap(), peer.qp.qpn(), mtu, (sq, rq), 14);
    }
}

/// Move `me`'s QP through INIT (every right) and RTR (towards `dgid`/`dest`) to RTS, with send and
/// receive PSNs `psns` and the local ACK timeout code `timeout` (0: no retransmit timer).
fn to_rts(me: &Side, dgid: Gid, dest: Qpn, mtu: Mtu, psns: (u32, u32), timeout: u8) {
    me.qp
        .modify(&ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(rights()),
            ..Default::default()
        })
        .unwrap();
    me.qp
        .modify(&ModifyQp {
            state: Some(QpState::Rtr),
            av: Some(me.pd.path(&AhAttr::new(dgid, 1)).unwrap()),
            path_mtu: Some(mtu),
            dest_qpn: Some(dest),
            rq_psn: Some(Psn::new(psns.1)),
            max_dest_rd_atomic: Some(16),
            min_rnr_timer: Some(12),
            ..Default::default()
        })
        .unwrap();
    me.qp
        .modify(&ModifyQp {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(psns.0)),
            timeout: Some(timeout),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(16),
            ..Default::default()
        })
        .unwrap();
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60), "timed out with {out:?}");
        std::thread::yield_now();
    }
    out
}

fn rights() -> Access {
    Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8).collect()
}

/// Where the two QPs of a test are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Between {
    /// Two devices, over UDP.
    Udp,
    /// Two devices, over the same-host link.
    SameHost,
    /// One device, its internal loopback.
    OneDevice,
    /// One device, over UDP to its own address (the same-host link off).
    OneDeviceUdp,
}

impl Between {
    fn sides(self, first: u8, port: u16, qp_type: QpType) -> (Side, Side) {
        let same_host = matches!(self, Between::SameHost | Between::OneDevice);
        let a = open_with(first, port, same_host);
        let b = match self {
            Between::OneDevice | Between::OneDeviceUdp => a.clone(),
            _ => open_with(first + 1, port, same_host),
        };
        (side(a, qp_type), side(b, qp_type))
    }
}

#[test]
fn rc_every_operation_and_size() {
    rc_every_operation(1, 48791, Between::Udp);
}

#[test]
fn rc_every_operation_and_size_same_host() {
    rc_every_operation(6, 48794, Between::SameHost);
}

#[test]
fn rc_every_operation_and_size_one_device() {
    rc_every_operation(21, 48801, Between::OneDevice);
}

#[test]
fn rc_every_operation_and_size_one_device_over_udp() {
    rc_every_operation(23, 48802, Between::OneDeviceUdp);
}

fn rc_every_operation(first: u8, port: u16, between: Between) {
    let (a, b) = between.sides(first, port, QpType::Rc);
    connect(&a, &b, Mtu::M4096);
    const BIG: usize = 16 << 20;
    let ma = a.pd.reg_mr(2 * BIG, rights()).unwrap();
    let mb = b.pd.reg_mr(2 * BIG, rights()).unwrap();
    for (i, len) in [0usize, 1, 7, 4096, 4097, 65536 + 3, 1 << 20, BIG].into_iter().enumerate() {
        let data = pattern(len, i as u8);
        ma.write(0, &data).unwrap();
        // SEND with immediate.
        b.qp.post_recv(RecvWr { wr_id: 10, sgl: vec![mb.sge(0, BIG).unwrap()].into() }).unwrap();
        let sgl = vec![ma.sge(0, len).unwrap()];
        a.qp.post_send(SendWr {
            wr_id: 1,
            op: SendOp::SendWithImm(0xabcd),
            payload: Payload::Sgl(sgl.clone().into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
        let wa = wait(&a.cq, 1);
        let wb = wait(&b.cq, 1);
        assert_eq!((wa[0].status, wa[0].opcode), (WcStatus::Success, WcOpcode::Send), "len {len}");
        assert_eq!((wb[0].status, wb[0].byte_len, wb[0].imm), (WcStatus::Success, len as u32, 0xabcd), "len {len}");
        assert!(mb.to_vec(0, len).unwrap() == data, "send data, len {len}");
        // WRITE into the second half, then READ it back into A's second half.
        mb.fill(0);
        a.qp.post_send(SendWr {
            wr_id: 2,
            op: SendOp::Write { remote_addr: mb.addr() + BIG as u64, rkey: mb.rkey() },
            payload: Payload::Sgl(sgl.clone().into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
        a.qp.post_send(SendWr {
            wr_id: 3,
            op: SendOp::Read { remote_addr: mb.addr() + BIG as u64, rkey: mb.rkey() },
            payload: Payload::Sgl(vec![ma.sge(BIG, len).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
        let wa = wait(&a.cq, 2);
        assert_eq!(
            wa.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![(2, WcStatus::Success), (3, WcStatus::Success)],
            "len {len}"
        );
        assert!(mb.to_vec(BIG, len).unwrap() == data, "write data, len {len}");
        assert!(ma.to_vec(BIG, len).unwrap() == data, "read data, len {len}");
        // WRITE with immediate.
        b.qp.post_recv(RecvWr { wr_id: 11, sgl: vec![].into() }).unwrap();
        a.qp.post_send(SendWr {
            wr_id: 4,
            op: SendOp::WriteWithImm { remote_addr: mb.addr(), rkey: mb.rkey(), imm: 7 },
            payload: Payload::Sgl(sgl.into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
        let wb = wait(&b.cq, 1);
        assert_eq!((wb[0].opcode, wb[0].byte_len, wb[0].imm), (WcOpcode::RecvRdmaWithImm, len as u32, 7));
        assert!(mb.to_vec(0, len).unwrap() == data, "write-imm data, len {len}");
    }
    // Atomics.
    mb.write(64, &100u64.to_ne_bytes()).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 5,
        op: SendOp::FetchAdd { remote_addr: mb.addr() + 64, rkey: mb.rkey(), add: 5 },
        payload: Payload::Sgl(vec![ma.sge(0, 8).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    })
    .unwrap();
    a.qp.post_send(SendWr {
        wr_id: 6,
        op: SendOp::CompareSwap { remote_addr: mb.addr() + 64, rkey: mb.rkey(), compare: 105, swap: 1 },
        payload: Payload::Sgl(vec![ma.sge(8, 8).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    })
    .unwrap();
    let wa = wait(&a.cq, 2);
    assert!(wa.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(ma.to_vec(0, 16).unwrap(), [100u64.to_ne_bytes(), 105u64.to_ne_bytes()].concat());
    assert_eq!(mb.to_vec(64, 8).unwrap(), 1u64.to_ne_bytes());
    let icrc = b.ctx.icrc_stats();
    let link = (a.ctx.same_host_stats(), b.ctx.same_host_stats());
    match between {
        Between::SameHost => {
            // Every packet went through shared memory, unsealed and unchecked; none over UDP.
            assert!(link.0.tx_pkts > 0 && link.1.rx_pkts > 0 && link.1.tx_pkts > 0, "{link:?}");
            assert_eq!((link.0.lanes_out, link.1.lanes_in, link.1.rx_malformed, link.1.ring_corrupt), (1, 1, 0, 0));
            assert_eq!((icrc.verified, icrc.bad), (0, 0), "{icrc:?}");
        }
        Between::OneDevice => {
            // Taken in directly: no lane, no UDP; the WRITEs' later packets placed region to
            // region (16 MiB of WRITE and WRITE with immediate: thousands of packets).
            assert_eq!((link.0.tx_pkts, link.0.lanes_out, link.0.lanes_in), (0, 0, 0), "{link:?}");
            assert!(link.0.loopback_placed > 4000 && link.0.loopback_pkts > link.0.loopback_placed, "{link:?}");
            // SENDs and WRITEs of one packet were executed when posted, with no packet at all.
            assert!(link.0.loopback_direct > 0, "{link:?}");
            assert_eq!((icrc.verified, icrc.bad), (0, 0), "{icrc:?}");
        }
        Between::Udp | Between::OneDeviceUdp => {
            assert!(icrc.verified > 0 && icrc.bad == 0, "{icrc:?}");
            assert_eq!(
                (link.0.tx_pkts, link.1.rx_pkts, link.1.lanes_in, link.0.loopback_pkts, link.0.loopback_direct),
                (0, 0, 0, 0, 0),
                "{link:?}"
            );
        }
    }
    // A WRITE under a wrong rkey: the responder refuses it at its FIRST packet, the requester
    // completes it with a remote access error, and not a byte of the target changes.
    mb.fill(0x5a);
    a.qp.post_send(SendWr {
        wr_id: 7,
        op: SendOp::Write { remote_addr: mb.addr(), rkey: mb.rkey() ^ 0x100 },
        payload: Payload::Sgl(vec![ma.sge(0, 1 << 20).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    })
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemAccessErr);
    assert!(mb.to_vec(0, 2 * BIG).unwrap().iter().all(|&x| x == 0x5a), "the target was written");
}

/// Two devices over UDP: a WRITE and a SEND whose payload is gathered from two regions land byte
/// for byte. Their packets leave with the payload where it is (an iovec into the regions, not a
/// copy), and the one that straddles the two SGEs carries two pieces, sealed and sent in order.
#[test]
fn rc_gathers_a_payload_from_two_regions_over_udp() {
    let (a, b) = Between::Udp.sides(31, 48806, QpType::Rc);
    connect(&a, &b, Mtu::M4096);
    // 6,000 + 7,000 bytes: packets of 4,096 (first SGE), 1,904 + 2,192 (both), 4,096 and 712.
    let (one, two) = (pattern(6000, 1), pattern(7000, 2));
    let (m1, m2) = (a.pd.reg_mr(8192, rights()).unwrap(), a.pd.reg_mr(8192, rights()).unwrap());
    m1.write(100, &one).unwrap();
    m2.write(300, &two).unwrap();
    let sgl = || Payload::Sgl(vec![m1.sge(100, one.len()).unwrap(), m2.sge(300, two.len()).unwrap()].into());
    let want = [one.clone(), two.clone()].concat();
    let mb = b.pd.reg_mr(2 * 16384, rights()).unwrap();
    b.qp.post_recv(RecvWr { wr_id: 9, sgl: vec![mb.sge(16384, 16384).unwrap()].into() }).unwrap();
    for (wr_id, op) in [(1, SendOp::Write { remote_addr: mb.addr() + 5, rkey: mb.rkey() }), (2, SendOp::Send)] {
        a.qp.post_send(SendWr { wr_id, op, payload: sgl(), flags: SendFlags::SIGNALED, ud: None }).unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success, "wr {wr_id}");
    }
    assert_eq!(wait(&b.cq, 1)[0].byte_len, want.len() as u32);
    assert!(mb.to_vec(5, want.len()).unwrap() == want, "write data");
    assert!(mb.to_vec(16384, want.len()).unwrap() == want, "send data");
    let icrc = b.ctx.icrc_stats();
    assert!(icrc.verified >= 8 && icrc.bad == 0, "{icrc:?}");
}

/// Two QPs of one device: a WRITE whose packets take their payload from two SGEs (a packet split
/// across them, a last packet with pad) is placed region to region byte for byte; a WRITE with
/// immediate that finds no receive posted writes nothing of its last packet until a receive comes
/// (RNR, then retried); an rkey of the requester's PD is refused by the responder's.
#[test]
fn one_device_places_only_what_the_responder_takes() {
    let (a, b) = Between::OneDevice.sides(27, 48804, QpType::Rc);
    connect(&a, &b, Mtu::M4096);
    let ma = a.pd.reg_mr(1 << 16, rights()).unwrap();
    let mb = b.pd.reg_mr(1 << 16, rights()).unwrap();
    let src = pattern(1 << 16, 3);
    ma.write(0, &src).unwrap();
    let write = |wr_id, op, sgl: Vec<_>| {
        a.qp.post_send(SendWr { wr_id, op, payload: Payload::Sgl(sgl.into()), flags: SendFlags::SIGNALED, ud: None })
            .unwrap()
    };
    let placed = || a.ctx.same_host_stats().loopback_placed;

    // 5,000 + 7,001 bytes from two SGEs into mb at 100: packets of 4,096, 4,096 (from both SGEs)
    // and 3,809 bytes (pad 3); the last two are placed.
    mb.fill(0xee);
    let before = placed();
    write(
        1,
        SendOp::Write { remote_addr: mb.addr() + 100, rkey: mb.rkey() },
        vec![ma.sge(0, 5000).unwrap(), ma.sge(8192, 7001).unwrap()],
    );
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(placed() - before, 2);
    let got = mb.to_vec(0, 1 << 16).unwrap();
    assert!(got[..100].iter().all(|&x| x == 0xee) && got[100 + 12001..].iter().all(|&x| x == 0xee));
    assert!(got[100..5100] == src[..5000] && got[5100..100 + 12001] == src[8192..8192 + 7001]);

    // A WRITE with immediate of 2 x 4,096 + 2,000 bytes, no receive posted: its last packet is
    // refused (RNR) and must not have written its bytes.
    mb.fill(0xee);
    write(2, SendOp::WriteWithImm { remote_addr: mb.addr(), rkey: mb.rkey(), imm: 9 }, vec![ma.sge(0, 10192).unwrap()]);
    std::thread::sleep(Duration::from_millis(20));
    let mut none = Vec::new();
    assert_eq!(a.cq.poll(4, &mut none).unwrap(), 0, "completed without a receive: {none:?}");
    assert!(mb.to_vec(8192, 2000).unwrap().iter().all(|&x| x == 0xee), "the refused last packet wrote");
    b.qp.post_recv(RecvWr { wr_id: 20, sgl: vec![].into() }).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let wb = wait(&b.cq, 1);
    assert_eq!((wb[0].status, wb[0].opcode, wb[0].imm), (WcStatus::Success, WcOpcode::RecvRdmaWithImm, 9));
    assert_eq!(mb.to_vec(0, 10192).unwrap(), src[..10192]);
    assert!(b.ctx.counters().send_rnr_nak > 0);

    // The requester's own region, under its rkey: on one device still another PD than the
    // responder's QP, so a remote access error, and the region is as it was.
    write(3, SendOp::Write { remote_addr: ma.addr() + 4104, rkey: ma.rkey() }, vec![ma.sge(0, 12288).unwrap()]);
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemAccessErr);
    assert!(ma.to_vec(0, 1 << 16).unwrap() == src);
}

/// A WRITE larger than one flush hands over to the device itself (16 MiB, 4,096 packets) takes
/// more than one flush (the budget stops one), and with nobody polling the device's I/O thread
/// carries it to the end.
#[test]
fn one_device_large_write_goes_on_without_polling() {
    let (a, b) = Between::OneDevice.sides(29, 48805, QpType::Rc);
    connect(&a, &b, Mtu::M4096);
    const LEN: usize = 16 << 20;
    let ma = a.pd.reg_mr(LEN, rights()).unwrap();
    let mb = b.pd.reg_mr(LEN, rights()).unwrap();
    let data = pattern(LEN, 5);
    ma.write(0, &data).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr: mb.addr(), rkey: mb.rkey() },
        payload: Payload::Sgl(vec![ma.sge(0, LEN).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    })
    .unwrap();
    // Reading the counters makes no progress; polling the CQ would.
    let start = Instant::now();
    while a.ctx.same_host_stats().loopback_placed < 4095 {
        assert!(start.elapsed() < Duration::from_secs(30), "stalled: {:?}", a.ctx.same_host_stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    assert!(mb.to_vec(0, LEN).unwrap() == data);
    // 4,096 packets and their ACKs took more than one flush: at least one stopped at its budget
    // (whether the I/O thread or this thread's post went on from there is a race, not checked).
    assert!(a.ctx.same_host_stats().loopback_budget_stops > 0);
}

#[test]
fn ud_send_with_grh() {
    ud_send(3, 48792, Between::Udp);
}

#[test]
fn ud_send_with_grh_same_host() {
    ud_send(8, 48795, Between::SameHost);
}

#[test]
fn ud_send_with_grh_one_device() {
    ud_send(25, 48803, Between::OneDevice);
}

fn ud_send(first: u8, port: u16, between: Between) {
    let (a, b) = between.sides(first, port, QpType::Ud);
    for s in [&a, &b] {
        s.qp.modify(&ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(0x1111_1111),
            ..Default::default()
        })
        .unwrap();
        s.qp.modify(&ModifyQp { state: Some(QpState::Rtr), ..Default::default() }).unwrap();
        s.qp.modify(&ModifyQp { state: Some(QpState::Rts), sq_psn: Some(Psn::new(1)), ..Default::default() }).unwrap();
    }
    let ma = a.pd.reg_mr(4096, rights()).unwrap();
    let mb = b.pd.reg_mr(4096, rights()).unwrap();
    let data = pattern(512, 9);
    ma.write(0, &data).unwrap();
    b.qp.post_recv(RecvWr { wr_id: 1, sgl: vec![mb.sge(0, 40 + 512).unwrap()].into() }).unwrap();
    let ah = a.pd.create_ah(&AhAttr::new(b.ctx.query_gid(1, 1).unwrap(), 1)).unwrap();
    a.qp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::SendWithImm(5),
        payload: Payload::Sgl(vec![ma.sge(0, 512).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: Some(ah.ud(b.qp.qpn(), 0x1111_1111)),
    })
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let wb = wait(&b.cq, 1);
    assert_eq!((wb[0].status, wb[0].byte_len, wb[0].src_qp, wb[0].imm), (WcStatus::Success, 552, a.qp.qpn(), 5));
    assert_eq!(mb.to_vec(40, 512).unwrap(), data);
    let grh = mb.to_vec(0, 40).unwrap();
    assert_eq!(grh[20], 0x45, "IPv4 header in the second half of the GRH area");
    let to = if between == Between::OneDevice { first } else { first + 1 };
    assert_eq!(&grh[32..36], &[127, 0, 9, first], "source address");
    assert_eq!(&grh[36..40], &[127, 0, 9, to], "destination address");
    let link = b.ctx.same_host_stats();
    assert_eq!(
        (link.rx_pkts > 0, link.loopback_pkts),
        (between == Between::SameHost, u64::from(between == Between::OneDevice))
    );
}

#[test]
fn port_in_use_is_a_clear_error() {
    let _a = open(5, 48793);
    let err = DeviceBuilder::new("t5b", "lo")
        .addr(IpAddr::V4(Ipv4Addr::new(127, 0, 9, 5)))
        .udp_port(48793)
        .open()
        .err()
        .expect("second bind fails");
    assert!(err.to_string().contains("already in use"), "{err}");
}

/// Small WRITEs posted one by one to a QP with packets in flight over UDP do not each go out at
/// once: they wait for the next progress and leave together (corked). Each round checks every byte:
/// first with the application not touching the device after posting (only the I/O threads run,
/// and handling the ACKs of what is in flight sends what waited), then with it busy-polling.
#[test]
fn small_writes_to_a_busy_qp_leave_in_batches_and_all_land() {
    let a = side(open(11, 48796), QpType::Rc);
    let b = side(open(12, 48796), QpType::Rc);
    connect(&a, &b, Mtu::M1024);
    const N: usize = 1000;
    const LEN: usize = 64;
    let ma = a.pd.reg_mr(N * LEN, rights()).unwrap();
    let mb = b.pd.reg_mr(N * LEN, rights()).unwrap();
    for (round, busy_poll) in [(0u8, false), (1, true)] {
        let data = pattern(N * LEN, 40 + round);
        ma.write(0, &data).unwrap();
        mb.fill(0);
        let corked = a.ctx.corked_posts();
        for i in 0..N {
            a.qp.post_send(SendWr {
                wr_id: i as u64,
                op: SendOp::Write { remote_addr: mb.addr() + (i * LEN) as u64, rkey: mb.rkey() },
                payload: Payload::Sgl(vec![ma.sge(i * LEN, LEN).unwrap()].into()),
                flags: if i + 1 == N { SendFlags::SIGNALED } else { SendFlags::NONE },
                ud: None,
            })
            .unwrap();
        }
        if !busy_poll {
            let start = Instant::now();
            while mb.to_vec(0, N * LEN).unwrap() != data {
                assert!(start.elapsed() < Duration::from_secs(20), "round {round}: writes still missing");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let wc = wait(&a.cq, 1);
        assert_eq!((wc[0].wr_id, wc[0].status), ((N - 1) as u64, WcStatus::Success), "round {round}");
        assert!(mb.to_vec(0, N * LEN).unwrap() == data, "round {round}: written data");
        assert!(a.ctx.corked_posts() > corked, "round {round}: no post waited");
        // Nothing waited for a retransmission: no ACK timeout, nothing sent twice.
        let c = a.ctx.counters();
        assert_eq!((c.ack_timeouts, c.retransmits), (0, 0), "round {round}");
    }
}

/// Corked sends do not depend on the ACK that was to flush them: towards a peer that never
/// answers, with no retransmit timer (timeout 0: wait forever), the sends posted behind 8 packets
/// in flight still leave while the application busy-polls its CQ (which flushes only when
/// something happened: here the cork timer, and keeps the I/O thread asleep). The engine's test
/// `sends_may_wait_only_behind_enough_unacknowledged_packets` checks the timer's deadline itself.
#[test]
fn corked_sends_leave_even_if_no_ack_ever_comes() {
    let peer_ip = Ipv4Addr::new(127, 0, 9, 14);
    let peer = std::net::UdpSocket::bind((peer_ip, 48797)).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let a = side(open(13, 48797), QpType::Rc);
    to_rts(&a, Gid::from_ip(IpAddr::V4(peer_ip)), Qpn::new(0x99), Mtu::M1024, (0, 0), 0);
    let ma = a.pd.reg_mr(4096, rights()).unwrap();
    const N: u32 = 11;
    for i in 0..N {
        a.qp.post_send(SendWr {
            wr_id: u64::from(i),
            op: SendOp::Write { remote_addr: 0x1000, rkey: 0x77 },
            payload: Payload::Sgl(vec![ma.sge(0, 64).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
    }
    // The first 8 went out at once; the last 3 waited behind them.
    assert_eq!(a.ctx.corked_posts(), u64::from(N) - 8);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut wcs = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.cq.poll(16, &mut wcs).unwrap();
            }
            assert!(wcs.is_empty(), "nothing can complete: {wcs:?}");
        });
        let psns = receive_psns(&peer, N as usize);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(psns, (0..N).collect::<Vec<_>>());
    });
    assert_eq!(a.ctx.counters().ack_timeouts, 0);
}

/// The PSNs of the next `n` requests `peer` receives from 127.0.9.13:48797.
fn receive_psns(peer: &std::net::UdpSocket, n: usize) -> Vec<u32> {
    let mut buf = [0u8; 2048];
    let mut psns = Vec::new();
    while psns.len() < n {
        let (n, _) = peer.recv_from(&mut buf).expect("every request, the corked ones included");
        let (pkt, _) = softrdma_wire::roce::verify_udp_payload(
            std::net::SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 9, 13)), 48797),
            peer.local_addr().unwrap(),
            &buf[..n],
        )
        .unwrap();
        psns.push(pkt.bth().psn().value());
    }
    psns
}
