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

/// A listener on `server` (with `backlog`) on `sctx`, and a client id on `cctx` whose address and
/// route to it are resolved, each on its own event channel: (server channel, client channel,
/// listener, client id).
fn routed(
    sctx: &Context,
    cctx: &Context,
    server: SocketAddr,
    backlog: u32,
) -> (CmEventChannel, CmEventChannel, CmId, CmId) {
    let (sch, cch) = (CmEventChannel::new().unwrap(), CmEventChannel::new().unwrap());
    let listener = sctx.create_cm_id(&sch, PortSpace::Tcp).unwrap();
    listener.bind_addr(server).unwrap();
    listener.listen(backlog).unwrap();
    let cid = cctx.create_cm_id(&cch, PortSpace::Tcp).unwrap();
    cid.resolve_addr(None, server).unwrap();
    expect(&cch, cctx, CmEventKind::AddrResolved);
    cid.resolve_route().unwrap();
    expect(&cch, cctx, CmEventKind::RouteResolved);
    (sch, cch, listener, cid)
}

fn establish(a: u8, b: u8, port: u16) -> Conn {
    let sctx = open(b, port);
    let cctx = open(a, port);
    let (sch, cch, listener, cid) = routed(&sctx, &cctx, SocketAddr::new(ip(b), 7471), 8);
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
    c.sqp.post_recv(RecvWr { wr_id: 1, sgl: [sm.sge(0, 8192).unwrap()].into() }).unwrap();
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
    // A REQ the loaded machine dropped (a burst of a thousand datagrams) comes again after the CM
    // timeout, so its CONNECT_REQUEST may follow the ESTABLISHED of connections accepted before.
    let mut servers = Vec::with_capacity(N);
    let mut established = 0;
    while servers.len() < N {
        let k = servers.len();
        let ev = sch.get_event(&sctx, WAIT).unwrap_or_else(|| panic!("connect request {k}"));
        match ev.kind {
            CmEventKind::ConnectRequest { .. } => {
                let sid = ev.new_id.expect("new id");
                sid.accept(CmConnParam::new(softrdma_verbs::Qpn::new(0x5000 + k as u32))).unwrap();
                servers.push(sid);
            }
            CmEventKind::Established => established += 1,
            _ => panic!("{ev:?}"),
        }
    }
    for _ in 0..N {
        expect(&cch, &cctx, CmEventKind::Established);
    }
    for _ in established..N {
        expect(&sch, &sctx, CmEventKind::Established);
    }
    assert_eq!((cctx.cm_id_count().unwrap(), sctx.cm_id_count().unwrap()), (N, N + 1));
    for cid in &clients {
        cid.disconnect().unwrap();
    }
    // Time-wait (2 s) may end for the first ids before the last DISCONNECTED is read when the
    // machine is busy: their TIMEWAIT_EXIT events are not counted.
    for (ch, ctx) in [(&cch, &cctx), (&sch, &sctx)] {
        let mut disconnected = 0;
        while disconnected < N {
            let ev = ch.get_event(ctx, WAIT).expect("disconnect event");
            match ev.kind {
                CmEventKind::Disconnected => disconnected += 1,
                CmEventKind::TimewaitExit => {}
                _ => panic!("{ev:?}"),
            }
        }
    }
    drop(clients);
    drop(servers);
    assert_eq!((cctx.cm_id_count().unwrap(), sctx.cm_id_count().unwrap()), (0, 1), "only the listener is left");
}

/// The application owns its QPs (as with `ibv_create_qp` under the kernel's rdma_cm): the CM
/// never touches them; each side moves its QP with `init_qp_attr`'s attributes (the passive side
/// before it accepts), the active side gets CONNECT_RESPONSE and finishes with `establish`, after
/// which only the passive side sees ESTABLISHED. Then a SEND, an RDMA WRITE and an RDMA READ,
/// every byte checked, and a disconnect that leaves the QPs where the application put them.
#[test]
fn application_owned_qps_with_init_qp_attr_and_establish() {
    use softrdma_verbs::CmQpState;
    let (a, b, port) = (31, 32, 47921);
    let sctx = open(b, port);
    let cctx = open(a, port);
    let (sch, cch, _listener, cid) = routed(&sctx, &cctx, SocketAddr::new(ip(b), 7471), 4);
    let ccq = cctx.create_cq(64, None).unwrap();
    let (cpd, cqp) = qp(&cctx, &ccq, QpType::Rc);
    // Before the connection: INIT with no remote access; RTR is refused.
    let init = cid.init_qp_attr(CmQpState::Init).unwrap();
    assert_eq!((init.pkey_index, init.port, init.access), (Some(0), Some(1), Some(0)));
    assert!(cid.init_qp_attr(CmQpState::Rtr).is_err());
    cid.modify_qp(&cqp, CmQpState::Init).unwrap();
    let cmr = cpd.reg_mr(8192, Access::LOCAL_WRITE.with(Access::REMOTE_WRITE)).unwrap();
    cqp.post_recv(RecvWr { wr_id: 10, sgl: [cmr.sge(4096, 4096).unwrap()].into() }).unwrap();
    let mut p = CmConnParam::new(cqp.qpn());
    p.drive_qp = false;
    p.private_data = b"own qp".to_vec();
    p.responder_resources = 4;
    p.initiator_depth = 4;
    cid.connect(p).unwrap();

    let req = sch.get_event(&sctx, WAIT).expect("connect request");
    assert!(matches!(req.kind, CmEventKind::ConnectRequest { .. }), "{req:?}");
    assert_eq!(&req.conn.private_data[..6], b"own qp");
    let sid = req.new_id.expect("a new id");
    let scq = sctx.create_cq(64, None).unwrap();
    let (spd, sqp) = qp(&sctx, &scq, QpType::Rc);
    let sinit = sid.init_qp_attr(CmQpState::Init).unwrap();
    let all_remote = Access::REMOTE_WRITE.with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC).bits();
    assert_eq!(sinit.access, Some(all_remote));
    sid.modify_qp(&sqp, CmQpState::Init).unwrap();
    let smr = spd.reg_mr(8192, Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ)).unwrap();
    smr.write(0, &pattern(8192, 7)).unwrap();
    sqp.post_recv(RecvWr { wr_id: 1, sgl: [smr.sge(4096, 4096).unwrap()].into() }).unwrap();
    let srtr = sid.init_qp_attr(CmQpState::Rtr).unwrap();
    assert_eq!(srtr.dest_qpn, Some(cqp.qpn()));
    assert_eq!((srtr.max_dest_rd_atomic, srtr.min_rnr_timer, srtr.hop_limit), (Some(4), Some(0), 64));
    let av = srtr.av.expect("an address vector");
    assert_eq!(av.dgid, cctx.query_gid(1, 1).unwrap().0);
    assert_eq!(av.sgid, sctx.query_gid(1, 1).unwrap().0);
    sid.modify_qp(&sqp, CmQpState::Rtr).unwrap();
    let srts = sid.init_qp_attr(CmQpState::Rts).unwrap();
    assert_eq!(
        (srts.timeout, srts.retry_cnt, srts.rnr_retry, srts.max_rd_atomic),
        (Some(19), Some(7), Some(7), Some(4))
    );
    sid.modify_qp(&sqp, CmQpState::Rts).unwrap();
    let mut p = CmConnParam::new(sqp.qpn());
    p.drive_qp = false;
    p.private_data = b"mine too".to_vec();
    sid.accept(p).unwrap();

    let resp = expect(&cch, &cctx, CmEventKind::ConnectResponse);
    assert_eq!(&resp.conn.private_data[..8], b"mine too");
    assert_eq!(resp.conn.remote_qpn, sqp.qpn());
    // The passive side is not established before the RTU.
    assert!(sch.get_event(&sctx, Some(Duration::from_millis(100))).is_none());
    // librdmacm's order: INIT again (the connection's access flags), RTR, RTS, then establish.
    cid.modify_qp(&cqp, CmQpState::Init).unwrap();
    let crtr = cid.init_qp_attr(CmQpState::Rtr).unwrap();
    assert_eq!((crtr.dest_qpn, crtr.rq_psn), (Some(sqp.qpn()), srts.sq_psn));
    assert_eq!(srtr.rq_psn, cid.init_qp_attr(CmQpState::Rts).unwrap().sq_psn);
    cid.modify_qp(&cqp, CmQpState::Rtr).unwrap();
    cid.modify_qp(&cqp, CmQpState::Rts).unwrap();
    cid.establish().unwrap();
    expect(&sch, &sctx, CmEventKind::Established);
    assert!(cch.get_event(&cctx, Some(Duration::from_millis(100))).is_none(), "no event after establish");
    assert_eq!(cqp.query().unwrap().state, softrdma_verbs::QpState::Rts);

    // Data both ways, byte-checked.
    let cbuf = pattern(4096, 3);
    cmr.write(0, &cbuf).unwrap();
    let send = |qp: &QueuePair, wr_id, op, sge| {
        qp.post_send(SendWr { wr_id, op, payload: Payload::Sgl([sge].into()), flags: SendFlags::SIGNALED, ud: None })
            .unwrap()
    };
    send(&cqp, 2, SendOp::Send, cmr.sge(0, 3000).unwrap());
    send(&cqp, 3, SendOp::Write { remote_addr: smr.addr() + 1000, rkey: smr.rkey() }, cmr.sge(100, 2000).unwrap());
    send(&cqp, 4, SendOp::Read { remote_addr: smr.addr() + 7200, rkey: smr.rkey() }, cmr.sge(5000, 900).unwrap());
    let w = wait_wc(&ccq, 3);
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    let r = wait_wc(&scq, 1);
    assert_eq!((r[0].wr_id, r[0].status, r[0].byte_len), (1, WcStatus::Success, 3000));
    let want = pattern(8192, 7);
    assert!(smr.to_vec(4096, 3000).unwrap() == cbuf[..3000], "SEND payload differs");
    assert!(smr.to_vec(1000, 2000).unwrap() == cbuf[100..2100], "WRITE payload differs");
    assert!(cmr.to_vec(5000, 900).unwrap() == want[7200..8100], "READ payload differs");
    send(&sqp, 5, SendOp::Send, smr.sge(0, 4096).unwrap());
    assert_eq!(wait_wc(&scq, 1)[0].status, WcStatus::Success);
    let r = wait_wc(&ccq, 1);
    assert_eq!((r[0].wr_id, r[0].status, r[0].byte_len), (10, WcStatus::Success, 4096));
    assert!(cmr.to_vec(4096, 4096).unwrap() == want[..4096], "server's SEND payload differs");

    // Disconnect: events on both sides, the QPs untouched by the CM (the application's to move).
    cid.disconnect().unwrap();
    expect(&cch, &cctx, CmEventKind::Disconnected);
    expect(&sch, &sctx, CmEventKind::Disconnected);
    assert_eq!(cqp.query().unwrap().state, softrdma_verbs::QpState::Rts);
    assert_eq!(sqp.query().unwrap().state, softrdma_verbs::QpState::Rts);
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// ADDR_ERROR with the kernel's statuses: a destination the host does not route from a loopback
/// source (`-EINVAL`, what `ip_route_output` answers, with no packet sent), a family the device
/// has no address of (`-ENETUNREACH`); a source that is not the device's is refused at once.
#[test]
fn addr_error_statuses() {
    let ctx = open(33, 47922);
    let ch = CmEventChannel::new().unwrap();
    let id = ctx.create_cm_id(&ch, PortSpace::Tcp).unwrap();
    // 198.51.100.0/24 is TEST-NET-2: the route lookup refuses it from 127.0.12.33; nothing is sent.
    id.resolve_addr(None, "198.51.100.7:7471".parse().unwrap()).unwrap();
    expect(&ch, &ctx, CmEventKind::AddrError { status: -22 });
    id.resolve_addr(None, "[::1]:7471".parse().unwrap()).unwrap();
    expect(&ch, &ctx, CmEventKind::AddrError { status: softrdma_verbs::cm_status::ENETUNREACH });
    assert!(id.resolve_addr(Some(ip(34)), SocketAddr::new(ip(33), 7471)).is_err());
    // The ID is still usable: a reachable destination resolves.
    id.resolve_addr(None, SocketAddr::new(ip(33), 7471)).unwrap();
    expect(&ch, &ctx, CmEventKind::AddrResolved);
    id.resolve_route().unwrap();
    expect(&ch, &ctx, CmEventKind::RouteResolved);
}

/// rdma_cm over IPv6 loopback on one device bound to ::1 (a connection to itself): resolve,
/// connect with private data, the peer's IPv6 address from the rdma_cm header, data, disconnect.
#[test]
fn ipv6_loopback_connection() {
    let v6: IpAddr = "::1".parse().unwrap();
    let ctx = DeviceBuilder::new("cm6", "lo").addr(v6).udp_port(47923).open().expect("open device on ::1");
    let gid = ctx.query_gid(1, 1).unwrap().0;
    assert_eq!(gid, std::net::Ipv6Addr::LOCALHOST.octets());
    let (sch, cch, _listener, cid) = routed(&ctx, &ctx, SocketAddr::new(v6, 7471), 2);
    let route = cid.route().unwrap();
    assert_eq!((route.sgid, route.dgid), (gid, gid));
    let local = cid.addrs().0.expect("a local address");
    assert_eq!(local.ip(), v6);
    let cq = ctx.create_cq(64, None).unwrap();
    let (pd, cqp) = qp(&ctx, &cq, QpType::Rc);
    cqp.init(Access::LOCAL_WRITE.with(Access::REMOTE_WRITE)).unwrap();
    let mut p = CmConnParam::new(cqp.qpn());
    p.private_data = b"over six".to_vec();
    cid.connect(p).unwrap();
    let req = sch.get_event(&ctx, WAIT).expect("connect request");
    assert_eq!(&req.conn.private_data[..8], b"over six");
    assert_eq!(req.conn.remote_addr, Some(local));
    assert_eq!(req.conn.local_addr, Some(SocketAddr::new(v6, 7471)));
    let sid = req.new_id.expect("a new id");
    let (spd, sqp) = qp(&ctx, &cq, QpType::Rc);
    sqp.init(Access::LOCAL_WRITE.with(Access::REMOTE_WRITE)).unwrap();
    sid.accept(CmConnParam::new(sqp.qpn())).unwrap();
    expect(&cch, &ctx, CmEventKind::Established);
    expect(&sch, &ctx, CmEventKind::Established);
    assert_eq!(sid.addrs(), (Some(SocketAddr::new(v6, 7471)), Some(local)));
    // A SEND from the client's QP to the server's, byte-checked (both QPs share the PD and CQ).
    let mr = pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let smr = spd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let data = pattern(3000, 9);
    mr.write(0, &data).unwrap();
    sqp.post_recv(RecvWr { wr_id: 1, sgl: [smr.sge(0, 4096).unwrap()].into() }).unwrap();
    cqp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Send,
        payload: Payload::Sgl([mr.sge(0, 3000).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: None,
    })
    .unwrap();
    let w = wait_wc(&cq, 2);
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    assert!(smr.to_vec(0, 3000).unwrap() == data, "payload differs");
    sid.disconnect().unwrap();
    expect(&sch, &ctx, CmEventKind::Disconnected);
    expect(&cch, &ctx, CmEventKind::Disconnected);
}
