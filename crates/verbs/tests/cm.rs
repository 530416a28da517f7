//! RDMA CM between two embedded devices on loopback: connect with private data, data over the
//! connected QPs, reject, no listener, disconnect from either side, UD resolution.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_verbs::{
    Access, CmConnParam, CmEventChannel, CmEventKind, CmId, CompletionQueue, Context, DeviceBuilder, Payload,
    PortSpace, QpCap, QpInitAttr, QpType, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 12, last))
}

fn open(last: u8, port: u16) -> Context {
    DeviceBuilder::new(&format!("cm{last}"), "lo").addr(ip(last)).udp_port(port).open().expect("open device")
}

fn qp(ctx: &Context, cq: &CompletionQueue, t: QpType) -> (softrdma_verbs::ProtectionDomain, QueuePair) {
    let pd = ctx.alloc_pd();
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp =
        pd.create_qp(&QpInitAttr { qp_type: t, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false }).unwrap();
    (pd, qp)
}

fn expect(ch: &CmEventChannel, ctx: &Context, kind: CmEventKind) -> softrdma_verbs::CmEvent {
    let ev = ch.get_event(ctx, WAIT).unwrap_or_else(|| panic!("no event, expected {kind:?}"));
    assert_eq!(ev.kind, kind, "{ev:?}");
    ev
}

fn wait_wc(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "{out:?}");
    }
    out
}

/// Server on .2, client on .1: listen, resolve, connect with private data; returns everything.
struct Conn {
    sctx: Context,
    cctx: Context,
    sch: CmEventChannel,
    cch: CmEventChannel,
    _listener: CmId,
    sid: CmId,
    cid: CmId,
    scq: CompletionQueue,
    ccq: CompletionQueue,
    spd: softrdma_verbs::ProtectionDomain,
    cpd: softrdma_verbs::ProtectionDomain,
    sqp: QueuePair,
    cqp: QueuePair,
}

fn establish(a: u8, b: u8, port: u16) -> Conn {
    let sctx = open(b, port);
    let cctx = open(a, port);
    let (sch, cch) = (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Tcp).unwrap();
    listener.bind_addr(SocketAddr::new(ip(b), 7471)).unwrap();
    listener.listen(8).unwrap();
    let cid = cctx.create_cm_id(&cch, PortSpace::Tcp).unwrap();
    cid.resolve_addr(None, SocketAddr::new(ip(b), 7471)).unwrap();
    expect(&cch, &cctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    expect(&cch, &cctx, CmEventKind::RouteResolved);
    let ccq = cctx.create_cq(64, None).unwrap();
    let (cpd, cqp) = qp(&cctx, &ccq, QpType::Rc);
    cqp.init(Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ)).unwrap();
    let mut p = CmConnParam::new(cqp.qpn());
    p.private_data = b"hello from the client".to_vec();
    cid.connect(p).unwrap();
    let req = sch.get_event(&sctx, WAIT).expect("connect request");
    assert!(matches!(req.kind, CmEventKind::ConnectRequest { .. }), "{req:?}");
    assert_eq!(&req.conn.private_data[..21], b"hello from the client");
    assert_eq!(req.conn.remote_qpn, cqp.qpn());
    assert_eq!(req.conn.remote_addr.map(|a| a.ip()), Some(ip(a)));
    let sid = req.new_id.expect("a new id");
    let scq = sctx.create_cq(64, None).unwrap();
    let (spd, sqp) = qp(&sctx, &scq, QpType::Rc);
    sqp.init(Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ)).unwrap();
    let mut p = CmConnParam::new(sqp.qpn());
    p.private_data = b"welcome".to_vec();
    sid.accept(p).unwrap();
    let est = expect(&cch, &cctx, CmEventKind::Established);
    assert_eq!(&est.conn.private_data[..7], b"welcome");
    expect(&sch, &sctx, CmEventKind::Established);
    Conn { sctx, cctx, sch, cch, _listener: listener, sid, cid, scq, ccq, spd, cpd, sqp, cqp }
}

#[test]
fn connect_transfer_disconnect() {
    let c = establish(1, 2, 47911);
    // Data flows over the QPs the CM connected: a SEND and an RDMA WRITE.
    let sm = c.spd.reg_mr(8192, Access::LOCAL_WRITE.with(Access::REMOTE_WRITE)).unwrap();
    let cm = c.cpd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    cm.write(0, &[7u8; 5000]).unwrap();
    c.sqp.post_recv(RecvWr { wr_id: 1, sgl: vec![sm.sge(0, 8192).unwrap()].into() }).unwrap();
    c.cqp
        .post_send(SendWr {
            wr_id: 2,
            op: SendOp::Send,
            payload: Payload::Sgl(vec![cm.sge(0, 5000).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
    c.cqp
        .post_send(SendWr {
            wr_id: 3,
            op: SendOp::Write { remote_addr: sm.addr() + 6000, rkey: sm.rkey() },
            payload: Payload::Sgl(vec![cm.sge(0, 100).unwrap()].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        })
        .unwrap();
    let w = wait_wc(&c.ccq, 2);
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    let r = wait_wc(&c.scq, 1);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 5000));
    assert_eq!(sm.to_vec(0, 5000).unwrap(), vec![7u8; 5000]);
    assert_eq!(sm.to_vec(6000, 100).unwrap(), vec![7u8; 100]);
    // Disconnect from the client: both see DISCONNECTED, the QPs go to ERR.
    c.cid.disconnect().unwrap();
    expect(&c.cch, &c.cctx, CmEventKind::Disconnected);
    expect(&c.sch, &c.sctx, CmEventKind::Disconnected);
    assert_eq!(c.cqp.query().unwrap().state, softrdma_verbs::QpState::Err);
    assert_eq!(c.sqp.query().unwrap().state, softrdma_verbs::QpState::Err);
}

#[test]
fn disconnect_from_the_passive_side() {
    let c = establish(3, 4, 47912);
    c.sid.disconnect().unwrap();
    expect(&c.sch, &c.sctx, CmEventKind::Disconnected);
    expect(&c.cch, &c.cctx, CmEventKind::Disconnected);
}

#[test]
fn reject_and_no_listener() {
    let sctx = open(6, 47913);
    let cctx = open(5, 47913);
    let (sch, cch) = (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Tcp).unwrap();
    listener.bind_addr(SocketAddr::new(ip(6), 7471)).unwrap();
    listener.listen(1).unwrap();
    let ccq = cctx.create_cq(8, None).unwrap();
    let (_pd, cqp) = qp(&cctx, &ccq, QpType::Rc);
    cqp.init(Access::LOCAL_WRITE).unwrap();
    for (port, rejected_by_app) in [(7471u16, true), (7472, false)] {
        let cid = cctx.create_cm_id(&cch, PortSpace::Tcp).unwrap();
        cid.resolve_addr(None, SocketAddr::new(ip(6), port)).unwrap();
        expect(&cch, &cctx, CmEventKind::AddrResolved);
        cid.resolve_route().unwrap();
        expect(&cch, &cctx, CmEventKind::RouteResolved);
        cid.connect(CmConnParam::new(cqp.qpn())).unwrap();
        if rejected_by_app {
            let req = sch.get_event(&sctx, WAIT).unwrap();
            req.new_id.unwrap().reject(b"not today").unwrap();
            let ev = expect(&cch, &cctx, CmEventKind::Rejected { reason: 28 });
            assert_eq!(&ev.conn.private_data[..9], b"not today");
        } else {
            // Nobody listens on 7472: the server's CM rejects with "invalid service ID".
            expect(&cch, &cctx, CmEventKind::Rejected { reason: 8 });
        }
    }
}

#[test]
fn ud_resolution_with_sidr() {
    let sctx = open(8, 47914);
    let cctx = open(7, 47914);
    let (sch, cch) = (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Udp).unwrap();
    listener.bind_addr(SocketAddr::new(ip(8), 7000)).unwrap();
    listener.listen(1).unwrap();
    let scq = sctx.create_cq(8, None).unwrap();
    let (_spd, sqp) = qp(&sctx, &scq, QpType::Ud);
    let cid = cctx.create_cm_id(&cch, PortSpace::Udp).unwrap();
    cid.resolve_addr(None, SocketAddr::new(ip(8), 7000)).unwrap();
    expect(&cch, &cctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    expect(&cch, &cctx, CmEventKind::RouteResolved);
    cid.connect(CmConnParam::new(softrdma_verbs::Qpn::new(0))).unwrap();
    let req = sch.get_event(&sctx, WAIT).unwrap();
    req.new_id.unwrap().accept(CmConnParam::new(sqp.qpn())).unwrap();
    let ev = expect(&cch, &cctx, CmEventKind::Established);
    let ud = ev.ud.expect("UD peer");
    assert_eq!(ud.remote_qpn, sqp.qpn());
    assert_eq!(ud.qkey, 0x0123_4567);
    assert_eq!(ud.dgid, sctx.query_gid(1, 1).unwrap().0);
}

#[test]
fn migrate_moves_later_events_to_another_channel() {
    let sctx = open(10, 47915);
    let cctx = open(9, 47915);
    let (sch, cch, other) =
        (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Tcp).unwrap();
    listener.bind_addr(SocketAddr::new(ip(10), 7471)).unwrap();
    listener.listen(1).unwrap();
    let mut cid = cctx.create_cm_id(&cch, PortSpace::Tcp).unwrap();
    cid.resolve_addr(None, SocketAddr::new(ip(10), 7471)).unwrap();
    expect(&cch, &cctx, CmEventKind::AddrResolved);
    cid.migrate(&other);
    cid.resolve_route().unwrap();
    expect(&other, &cctx, CmEventKind::RouteResolved);
    assert!(cch.get_event(&cctx, Some(Duration::from_millis(50))).is_none());
}

/// A thousand connections to one listener over real sockets, all established, all torn down, and no
/// CM ID left behind on either device.
#[test]
fn a_thousand_connections_and_no_leak() {
    const N: usize = 1000;
    let sctx = open(10, 47916);
    let cctx = open(9, 47916);
    let (sch, cch) = (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Tcp).unwrap();
    listener.bind_addr(SocketAddr::new(ip(10), 7471)).unwrap();
    listener.listen(N as u32).unwrap();
    let mut clients = Vec::with_capacity(N);
    for _ in 0..N {
        let cid = cctx.create_cm_id(&cch, PortSpace::Tcp).unwrap();
        cid.resolve_addr(None, SocketAddr::new(ip(10), 7471)).unwrap();
        cid.resolve_route().unwrap();
        clients.push(cid);
    }
    for _ in 0..2 * N {
        let ev = cch.get_event(&cctx, WAIT).expect("resolution event");
        assert!(matches!(ev.kind, CmEventKind::AddrResolved | CmEventKind::RouteResolved), "{ev:?}");
    }
    // QPN-less connections: the CM's QP changes find no QP and are skipped; the protocol runs.
    for (k, cid) in clients.iter().enumerate() {
        cid.connect(CmConnParam::new(softrdma_verbs::Qpn::new(0x1000 + k as u32))).unwrap();
    }
    let mut servers = Vec::with_capacity(N);
    for k in 0..N {
        let req = sch.get_event(&sctx, WAIT).unwrap_or_else(|| panic!("connect request {k}"));
        let sid = req.new_id.expect("new id");
        sid.accept(CmConnParam::new(softrdma_verbs::Qpn::new(0x5000 + k as u32))).unwrap();
        servers.push(sid);
    }
    for _ in 0..N {
        expect(&cch, &cctx, CmEventKind::Established);
        expect(&sch, &sctx, CmEventKind::Established);
    }
    assert_eq!((cctx.cm_id_count().unwrap(), sctx.cm_id_count().unwrap()), (N, N + 1));
    for cid in &clients {
        cid.disconnect().unwrap();
    }
    for _ in 0..N {
        expect(&cch, &cctx, CmEventKind::Disconnected);
        expect(&sch, &sctx, CmEventKind::Disconnected);
    }
    drop(clients);
    drop(servers);
    assert_eq!((cctx.cm_id_count().unwrap(), sctx.cm_id_count().unwrap()), (0, 1), "only the listener is left");
}
