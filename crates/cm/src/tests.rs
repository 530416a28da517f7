//! Two agents talking through a test network in virtual time.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma_transport::{Instant, Mtu};
use softrdma_wire::cm::{reason, CmMessage};
use softrdma_wire::Qpn;

use crate::{AgentConfig, CmAgent, ConnParam, EventKind, IdHandle, Output, PortSpace, QpCommand};

struct Side {
    agent: CmAgent,
    gid: [u8; 16],
    qp: Vec<QpCommand>,
}

struct Pair {
    now: Instant,
    s: [Side; 2],
    /// Drop the next n MADs from side i.
    drop: [usize; 2],
    sent: Vec<(usize, &'static str)>,
    /// Every MAD sent, by side.
    mads: Vec<(usize, Box<[u8; 256]>)>,
}

fn ip(i: u8) -> IpAddr {
    IpAddr::from([10, 9, 0, i])
}

fn side(i: u8) -> Side {
    let cfg = AgentConfig {
        response_timeout: 14,
        max_retries: 3,
        ..AgentConfig::new(0x1000 + u64::from(i), vec![(ip(i), 1)], Mtu::M1024, u64::from(i))
    };
    let gid = match ip(i) {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    Side { agent: CmAgent::new(cfg), gid, qp: Vec::new() }
}

impl Pair {
    fn new() -> Pair {
        Pair { now: Instant::ZERO, s: [side(1), side(2)], drop: [0, 0], sent: Vec::new(), mads: Vec::new() }
    }

    /// Deliver everything in flight (and what it provokes) until quiet.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..2 {
                while let Some(o) = self.s[i].agent.poll_output() {
                    moved = true;
                    match o {
                        Output::Qp(c) => self.s[i].qp.push(c),
                        Output::Mad { dgid, mad } => {
                            let (_, m) = CmMessage::parse(&mad[..]).unwrap();
                            self.sent.push((i, m.name()));
                            self.mads.push((i, mad.clone()));
                            if self.drop[i] > 0 {
                                self.drop[i] -= 1;
                                continue;
                            }
                            let to = 1 - i;
                            assert_eq!(dgid, self.s[to].gid);
                            let src = self.s[i].gid;
                            self.s[to].agent.handle_mad(self.now, src, &mad[..]);
                        }
                    }
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Advance to the next timer of either side and fire it.
    fn tick(&mut self) -> bool {
        let next = self.s.iter().filter_map(|s| s.agent.poll_timeout()).min();
        let Some(t) = next else { return false };
        self.now = t;
        for s in &mut self.s {
            s.agent.handle_timeout(self.now);
        }
        self.pump();
        true
    }

    fn events(&mut self, i: usize) -> Vec<(IdHandle, EventKind)> {
        std::iter::from_fn(|| self.s[i].agent.poll_event()).map(|e| (e.id, e.kind)).collect()
    }
}

fn addr(i: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(i), port)
}

/// Side 1 listens on `port` in `ps`; side 0 has an ID of `ps` resolved to it (its events taken).
/// Returns (listener, client ID).
fn listening_and_resolved(p: &mut Pair, ps: PortSpace, port: u16) -> (IdHandle, IdHandle) {
    let l = p.s[1].agent.create_id(ps);
    p.s[1].agent.bind(l, addr(2, port)).unwrap();
    p.s[1].agent.listen(l, 4).unwrap();
    let c = p.s[0].agent.create_id(ps);
    p.s[0].agent.resolve_addr(c, None, addr(2, port)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrResolved), (c, EventKind::RouteResolved)]);
    (l, c)
}

/// Server (side 1) listens on port 7174; client (side 0) resolves and connects.
fn connect(p: &mut Pair, private: &[u8]) -> (IdHandle, IdHandle, IdHandle) {
    let (l, c) = listening_and_resolved(p, PortSpace::Tcp, 7174);
    let mut param = ConnParam::new(Qpn::new(0x20));
    param.private_data = private.to_vec();
    p.s[0].agent.connect(c, param, p.now).unwrap();
    p.pump();
    let ev: Vec<_> = std::iter::from_fn(|| p.s[1].agent.poll_event()).collect();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].kind, EventKind::ConnectRequest { listener: l });
    assert_eq!(&ev[0].conn.private_data[..private.len()], private);
    assert_eq!(ev[0].conn.remote_qpn, Qpn::new(0x20));
    assert_eq!(ev[0].conn.remote_addr.map(|a| a.ip()), Some(ip(1)));
    (c, l, ev[0].id)
}

#[test]
fn connect_accept_establish_disconnect() {
    let mut p = Pair::new();
    let (c, _l, s) = connect(&mut p, b"hello");
    let mut acc = ConnParam::new(Qpn::new(0x30));
    acc.private_data = b"welcome".to_vec();
    p.s[1].agent.accept(s, acc, p.now).unwrap();
    p.pump();
    assert_eq!(p.sent.iter().map(|s| s.1).collect::<Vec<_>>(), vec!["REQ", "REP", "RTU"]);
    let ce: Vec<_> = std::iter::from_fn(|| p.s[0].agent.poll_event()).collect();
    assert_eq!(ce.len(), 1);
    assert_eq!(ce[0].kind, EventKind::Established);
    assert_eq!(&ce[0].conn.private_data[..7], b"welcome");
    assert_eq!(p.events(1), vec![(s, EventKind::Established)]);
    // Both QPs went RTR then RTS with each other's QPN and PSN.
    let (rtr0, rts0) = (p.s[0].qp[0], p.s[0].qp[1]);
    let (rtr1, rts1) = (p.s[1].qp[0], p.s[1].qp[1]);
    let QpCommand::Rtr { dest_qpn: d0, rq_psn: r0, .. } = rtr0 else { panic!("{rtr0:?}") };
    let QpCommand::Rts { sq_psn: s0, .. } = rts0 else { panic!("{rts0:?}") };
    let QpCommand::Rtr { dest_qpn: d1, rq_psn: r1, .. } = rtr1 else { panic!("{rtr1:?}") };
    let QpCommand::Rts { sq_psn: s1, .. } = rts1 else { panic!("{rts1:?}") };
    assert_eq!((d0, d1), (Qpn::new(0x30), Qpn::new(0x20)));
    assert_eq!((r0, r1), (s1, s0));
    // Disconnect from the passive side.
    p.s[1].agent.disconnect(s, p.now).unwrap();
    p.pump();
    assert_eq!(p.events(0), vec![(c, EventKind::Disconnected)]);
    assert_eq!(p.events(1), vec![(s, EventKind::Disconnected)]);
    assert!(p.s[0].qp.contains(&QpCommand::Err { qpn: Qpn::new(0x20) }));
    assert!(p.s[1].qp.contains(&QpCommand::Err { qpn: Qpn::new(0x30) }));
    while p.tick() {}
    assert_eq!(p.events(0), vec![(c, EventKind::TimewaitExit)]);
    assert_eq!(p.events(1), vec![(s, EventKind::TimewaitExit)]);
    assert_eq!(&p.sent[3..], &[(1, "DREQ"), (0, "DREP")]);
}

#[test]
fn reject_with_private_data() {
    let mut p = Pair::new();
    let (c, _, s) = connect(&mut p, b"");
    p.s[1].agent.reject(s, b"go away").unwrap();
    p.pump();
    let ev: Vec<_> = std::iter::from_fn(|| p.s[0].agent.poll_event()).collect();
    assert_eq!(ev[0].kind, EventKind::Rejected { reason: reason::CONSUMER_REJECT });
    assert_eq!(&ev[0].conn.private_data[..7], b"go away");
    assert_eq!(ev[0].id, c);
    p.s[1].agent.destroy_id(s, p.now).unwrap();
    assert_eq!(p.s[1].agent.id_count(), 1, "only the listener is left");
}

#[test]
fn no_listener_is_rejected_at_once() {
    let mut p = Pair::new();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c, None, addr(2, 9999)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    p.events(0);
    p.s[0].agent.connect(c, ConnParam::new(Qpn::new(0x20)), p.now).unwrap();
    p.pump();
    assert_eq!(p.events(0), vec![(c, EventKind::Rejected { reason: reason::INVALID_SERVICE_ID })]);
}

#[test]
fn no_listener_retries_find_a_late_listener() {
    let mut p = Pair::new();
    p.s[0] = Side {
        agent: CmAgent::new(AgentConfig {
            no_listener_retries: 3,
            ..AgentConfig::new(0x1000, vec![(ip(1), 1)], Mtu::M1024, 1)
        }),
        ..side(1)
    };
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    p.events(0);
    p.s[0].agent.connect(c, ConnParam::new(Qpn::new(0x20)), p.now).unwrap();
    p.pump();
    // Rejected, but not reported: the REQ goes again after the delay.
    assert!(p.events(0).is_empty());
    assert_eq!(p.s[0].agent.poll_timeout(), Some(p.now + crate::NO_LISTENER_RETRY_DELAY));
    let l = p.s[1].agent.create_id(PortSpace::Tcp);
    p.s[1].agent.bind(l, addr(2, 7174)).unwrap();
    p.s[1].agent.listen(l, 4).unwrap();
    assert!(p.tick());
    let ev: Vec<_> = std::iter::from_fn(|| p.s[1].agent.poll_event()).collect();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].kind, EventKind::ConnectRequest { listener: l });
    // Without a listener the retries run out and REJECTED is reported.
    let c2 = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c2, None, addr(2, 9999)).unwrap();
    p.s[0].agent.resolve_route(c2).unwrap();
    p.events(0);
    p.s[0].agent.connect(c2, ConnParam::new(Qpn::new(0x21)), p.now).unwrap();
    p.pump();
    for _ in 0..3 {
        assert!(p.events(0).is_empty());
        assert!(p.tick());
    }
    assert_eq!(p.events(0), vec![(c2, EventKind::Rejected { reason: reason::INVALID_SERVICE_ID })]);
}

#[test]
fn dead_peer_is_unreachable_after_retries() {
    let mut p = Pair::new();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    p.events(0);
    p.drop[0] = usize::MAX;
    p.s[0].agent.connect(c, ConnParam::new(Qpn::new(0x20)), p.now).unwrap();
    p.pump();
    while p.tick() {}
    assert_eq!(p.events(0), vec![(c, EventKind::Unreachable)]);
    // One REQ and max_retries (3) retransmissions, one response timeout (4.096 us << 14) apart.
    assert_eq!(p.sent.iter().filter(|s| s.1 == "REQ").count(), 4);
    assert_eq!(p.now, Instant::ZERO + Duration::from_nanos(4 * (4096 << 14)));
}

#[test]
fn lost_rep_and_rtu_are_recovered() {
    let mut p = Pair::new();
    let (c, _l, s) = connect(&mut p, b"");
    // The REP is lost: the client retransmits the REQ, the server answers it with the same REP.
    p.drop[1] = 1;
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    assert!(p.events(0).is_empty());
    p.tick();
    assert_eq!(p.events(0), vec![(c, EventKind::Established)]);
    // The RTU was the client's answer; lose it too and the server's REP retransmission gets it again.
    let (c2, _, s2) = {
        let mut q = Pair::new();
        let r = connect(&mut q, b"");
        p = q;
        r
    };
    p.s[1].agent.accept(s2, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.drop[0] = 1;
    p.pump();
    assert_eq!(p.events(0), vec![(c2, EventKind::Established)]);
    assert!(p.events(1).is_empty());
    p.tick();
    assert_eq!(p.events(1), vec![(s2, EventKind::Established)]);
    let reps = p.sent.iter().filter(|x| x.1 == "REP").count();
    let rtus = p.sent.iter().filter(|x| x.1 == "RTU").count();
    assert_eq!((reps, rtus), (2, 2));
}

#[test]
fn duplicate_req_does_not_create_a_second_connection() {
    let mut p = Pair::new();
    connect(&mut p, b"");
    // Fire the client's REQ retransmission before anyone accepts.
    p.tick();
    assert!(p.events(1).is_empty(), "a duplicate REQ raised another CONNECT_REQUEST");
    assert_eq!(p.s[1].agent.id_count(), 2, "listener and one connection");
}

#[test]
fn stale_connection_is_rejected() {
    let mut p = Pair::new();
    let (_c, _l, s) = connect(&mut p, b"");
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    p.events(0);
    p.events(1);
    // The client "restarts" and connects again from the same QP while the old one is established.
    let c2 = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c2, None, addr(2, 7174)).unwrap();
    p.s[0].agent.resolve_route(c2).unwrap();
    p.events(0);
    p.s[0].agent.connect(c2, ConnParam::new(Qpn::new(0x20)), p.now).unwrap();
    p.pump();
    assert_eq!(p.events(0), vec![(c2, EventKind::Rejected { reason: reason::STALE_CONN })]);
}

#[test]
fn ud_sidr_resolves_qpn_and_qkey() {
    let mut p = Pair::new();
    let (l, c) = listening_and_resolved(&mut p, PortSpace::Udp, 5000);
    p.s[0].agent.connect(c, ConnParam::new(Qpn::new(0x21)), p.now).unwrap();
    p.pump();
    let ev = p.events(1);
    assert_eq!(ev[0].1, EventKind::ConnectRequest { listener: l });
    p.s[1].agent.accept(ev[0].0, ConnParam::new(Qpn::new(0x44)), p.now).unwrap();
    p.pump();
    let e: Vec<_> = std::iter::from_fn(|| p.s[0].agent.poll_event()).collect();
    assert_eq!(e[0].kind, EventKind::Established);
    let ud = e[0].ud.unwrap();
    assert_eq!((ud.remote_qpn, ud.qkey, ud.dgid), (Qpn::new(0x44), crate::types::RDMA_UDP_QKEY, p.s[1].gid));
    assert_eq!(p.sent.iter().map(|s| s.1).collect::<Vec<_>>(), vec!["SIDR_REQ", "SIDR_REP"]);
}

#[test]
fn api_misuse_is_an_error() {
    let mut p = Pair::new();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    assert!(p.s[0].agent.connect(c, ConnParam::new(Qpn::new(1)), p.now).is_err());
    assert!(p.s[0].agent.resolve_route(c).is_err());
    assert!(p.s[0].agent.listen(c, 1).is_err(), "listen on an unbound id");
    assert!(p.s[0].agent.bind(c, addr(9, 1)).is_err(), "address not ours");
    let d = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.bind(c, addr(1, 4000)).unwrap();
    assert_eq!(p.s[0].agent.bind(d, addr(1, 4000)), Err(crate::CmError::AddrInUse));
    assert!(p.s[0].agent.destroy_id(IdHandle(999), p.now).is_err());
}

#[test]
fn many_connections_and_no_leak() {
    let mut p = Pair::new();
    let l = p.s[1].agent.create_id(PortSpace::Tcp);
    p.s[1].agent.bind(l, addr(2, 7174)).unwrap();
    p.s[1].agent.listen(l, 1000).unwrap();
    let mut clients = Vec::new();
    for k in 0..1000u32 {
        let c = p.s[0].agent.create_id(PortSpace::Tcp);
        p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
        p.s[0].agent.resolve_route(c).unwrap();
        p.s[0].agent.connect(c, ConnParam::new(Qpn::new(0x100 + k)), p.now).unwrap();
        clients.push(c);
    }
    p.pump();
    let reqs: Vec<_> = p.events(1);
    assert_eq!(reqs.len(), 1000);
    for (k, (id, _)) in reqs.iter().enumerate() {
        p.s[1].agent.accept(*id, ConnParam::new(Qpn::new(0x2000 + k as u32)), p.now).unwrap();
    }
    p.pump();
    let est = p.events(0).into_iter().filter(|e| e.1 == EventKind::Established).count();
    assert_eq!(est, 1000);
    for c in &clients {
        p.s[0].agent.disconnect(*c, p.now).unwrap();
    }
    p.pump();
    while p.tick() {}
    for c in clients {
        p.s[0].agent.destroy_id(c, p.now).unwrap();
    }
    for (id, _) in reqs {
        p.s[1].agent.destroy_id(id, p.now).unwrap();
    }
    assert_eq!(p.s[0].agent.id_count(), 0);
    assert_eq!(p.s[1].agent.id_count(), 1, "only the listener");
    assert!(p.s[0].agent.poll_timeout().is_none() && p.s[1].agent.poll_timeout().is_none());
}

/// An application-owned QP on both sides: the passive side reads RTR/RTS attributes before it
/// accepts, the active side gets CONNECT_RESPONSE (not ESTABLISHED) and sends the RTU with
/// `establish`; the agent emits no QP command at all; the attributes pair up (each side's rq_psn is
/// the other's sq_psn).
#[test]
fn application_owned_qp_connect_response_and_establish() {
    use crate::{access, QpAttrState, ACK_TIMEOUT};
    let mut p = Pair::new();
    let l = p.s[1].agent.create_id(PortSpace::Tcp);
    p.s[1].agent.bind(l, addr(2, 7174)).unwrap();
    p.s[1].agent.listen(l, 4).unwrap();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    // Before any connection: INIT with no remote access, RTR/RTS refused.
    let init = p.s[0].agent.init_qp_attr(c, QpAttrState::Init).unwrap();
    assert_eq!((init.pkey_index, init.port, init.access, init.qkey), (Some(0), Some(1), Some(0), None));
    assert!(p.s[0].agent.init_qp_attr(c, QpAttrState::Rtr).is_err());
    p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    p.events(0);
    let mut param = ConnParam::new(Qpn::new(0x21));
    param.drive_qp = false;
    param.responder_resources = 3;
    param.initiator_depth = 2;
    param.retry_count = 6;
    param.rnr_retry_count = 5;
    p.s[0].agent.connect(c, param, p.now).unwrap();
    p.pump();
    let ev = p.events(1);
    assert_eq!(ev.len(), 1);
    let s = ev[0].0;
    // Passive side before accept: from the REQ, the peer's depth is our resources and back.
    let rtr = p.s[1].agent.init_qp_attr(s, QpAttrState::Rtr).unwrap();
    assert_eq!(rtr.dest_qpn, Some(Qpn::new(0x21)));
    assert_eq!((rtr.max_dest_rd_atomic, rtr.min_rnr_timer, rtr.path_mtu), (Some(2), Some(0), Some(Mtu::M1024)));
    let av = rtr.av.unwrap();
    assert_eq!((av.dgid, av.sgid, av.sgid_index, rtr.hop_limit), (p.s[0].gid, p.s[1].gid, 1, 64));
    let rts = p.s[1].agent.init_qp_attr(s, QpAttrState::Rts).unwrap();
    assert_eq!(
        (rts.timeout, rts.retry_cnt, rts.rnr_retry, rts.max_rd_atomic),
        (Some(ACK_TIMEOUT), Some(6), Some(5), Some(3))
    );
    let mut acc = ConnParam::new(Qpn::new(0x31));
    acc.drive_qp = false;
    acc.responder_resources = 2;
    acc.initiator_depth = 3;
    acc.rnr_retry_count = 4;
    p.s[1].agent.accept(s, acc, p.now).unwrap();
    p.pump();
    assert_eq!(p.sent.iter().map(|s| s.1).collect::<Vec<_>>(), vec!["REQ", "REP"]);
    let ce: Vec<_> = std::iter::from_fn(|| p.s[0].agent.poll_event()).collect();
    assert_eq!(ce.len(), 1);
    assert_eq!(ce[0].kind, EventKind::ConnectResponse);
    assert_eq!(ce[0].conn.remote_qpn, Qpn::new(0x31));
    let init = p.s[0].agent.init_qp_attr(c, QpAttrState::Init).unwrap();
    assert_eq!(init.access, Some(access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC));
    let crtr = p.s[0].agent.init_qp_attr(c, QpAttrState::Rtr).unwrap();
    let crts = p.s[0].agent.init_qp_attr(c, QpAttrState::Rts).unwrap();
    assert_eq!(crtr.dest_qpn, Some(Qpn::new(0x31)));
    assert_eq!(crtr.rq_psn, rts.sq_psn);
    assert_eq!(rtr.rq_psn, crts.sq_psn);
    // From the REP: responder resources = the peer's initiator depth, and the peer's RNR retries.
    assert_eq!((crtr.max_dest_rd_atomic, crts.max_rd_atomic, crts.rnr_retry), (Some(3), Some(2), Some(4)));
    // A repeated REP before establish is ignored; establish sends the RTU; no event on our side.
    p.s[0].agent.establish(c).unwrap();
    p.pump();
    assert!(p.s[0].agent.establish(c).is_err());
    assert_eq!(p.sent.iter().map(|s| s.1).collect::<Vec<_>>(), vec!["REQ", "REP", "RTU"]);
    assert_eq!(p.events(0), vec![]);
    assert_eq!(p.events(1), vec![(s, EventKind::Established)]);
    // Disconnect: no QP command for either side, ever.
    p.s[0].agent.disconnect(c, p.now).unwrap();
    p.pump();
    assert_eq!(p.events(0), vec![(c, EventKind::Disconnected)]);
    assert_eq!(p.events(1), vec![(s, EventKind::Disconnected)]);
    assert!(p.s[0].qp.is_empty() && p.s[1].qp.is_empty(), "{:?} {:?}", p.s[0].qp, p.s[1].qp);
}

/// A UC connection, as the kernel's CM makes one: the REQ's transport says UC, and on both sides
/// the QP attributes leave out what only RC takes (READ/atomic depths, RNR timer, ACK timeout
/// and retries).
#[test]
fn uc_connection_says_so_and_gets_uc_attributes() {
    use crate::QpAttrState;
    let mut p = Pair::new();
    let (_, c) = listening_and_resolved(&mut p, PortSpace::Tcp, 7174);
    p.s[0].agent.set_uc(c, true).unwrap();
    let mut param = ConnParam::new(Qpn::new(0x21));
    param.drive_qp = false;
    p.s[0].agent.connect(c, param, p.now).unwrap();
    p.pump();
    let (_, req) = p.mads.iter().find(|(i, _)| *i == 0).expect("a REQ");
    let Ok((_, CmMessage::Req(r))) = CmMessage::parse(&req[..]) else { panic!("not a REQ") };
    assert_eq!(r.transport, 1, "UC");
    let ev = p.events(1);
    let s = ev[0].0;
    let rc_only = |a: &crate::QpAttr| {
        (a.max_dest_rd_atomic, a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic)
    };
    let rtr = p.s[1].agent.init_qp_attr(s, QpAttrState::Rtr).unwrap();
    let rts = p.s[1].agent.init_qp_attr(s, QpAttrState::Rts).unwrap();
    assert_eq!((rtr.dest_qpn, rtr.path_mtu), (Some(Qpn::new(0x21)), Some(Mtu::M1024)));
    assert!(rtr.rq_psn.is_some() && rts.sq_psn.is_some());
    assert_eq!(
        (rc_only(&rtr), rc_only(&rts)),
        ((None, None, None, None, None, None), (None, None, None, None, None, None))
    );
    let mut acc = ConnParam::new(Qpn::new(0x31));
    acc.drive_qp = false;
    p.s[1].agent.accept(s, acc, p.now).unwrap();
    p.pump();
    let crts = p.s[0].agent.init_qp_attr(c, QpAttrState::Rts).unwrap();
    assert_eq!(rc_only(&crts), (None, None, None, None, None, None));
    // An RC connection keeps them (and its REQ says RC).
    let mut q = Pair::new();
    let (_, _, srv) = connect(&mut q, b"");
    let Ok((_, CmMessage::Req(r))) = CmMessage::parse(&q.mads[0].1[..]) else { panic!("not a REQ") };
    assert_eq!(r.transport, 0);
    assert!(q.s[1].agent.init_qp_attr(srv, QpAttrState::Rts).unwrap().timeout.is_some());
}

/// Address and route errors with the kernel's statuses.
#[test]
fn addr_and_route_errors() {
    use crate::status;
    let mut p = Pair::new();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    // No IPv6 address on the device: ADDR_ERROR -ENETUNREACH.
    p.s[0].agent.resolve_addr(c, None, "[2001:db8::1]:7174".parse().unwrap()).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrError { status: status::ENETUNREACH })]);
    // A source that is not ours, or of the other family: refused at once.
    assert_eq!(p.s[0].agent.resolve_addr(c, Some(ip(7)), addr(2, 1)), Err(crate::CmError::AddrNotAvailable));
    assert_eq!(
        p.s[0].agent.resolve_addr(c, Some(ip(1)), "[::1]:1".parse().unwrap()),
        Err(crate::CmError::FamilyMismatch)
    );
    // The driver's route lookup says unreachable: its status.
    p.s[0].agent.resolve_addr_via(c, None, addr(2, 7174), |_, _| Err(status::EHOSTUNREACH)).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrError { status: status::EHOSTUNREACH })]);
    // Port down: ADDR_ERROR -ENETUNREACH.
    p.s[0].agent.set_port_active(false);
    p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrError { status: status::ENETUNREACH })]);
    p.s[0].agent.set_port_active(true);
    p.s[0].agent.resolve_addr(c, None, addr(2, 7174)).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrResolved)]);
    // Port down between address and route: ROUTE_ERROR -ENETUNREACH, and the ID stays resolved.
    p.s[0].agent.set_port_active(false);
    p.s[0].agent.resolve_route(c).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::RouteError { status: status::ENETUNREACH })]);
    p.s[0].agent.set_port_active(true);
    // The destination stopped being routed: the lookup's status.
    p.s[0].agent.resolve_route_via(c, |_, _| Err(status::ENETUNREACH)).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::RouteError { status: status::ENETUNREACH })]);
    // The source address (its GID) left the device: -ENODEV.
    let addrs = p.s[0].agent.local_addrs().to_vec();
    p.s[0].agent.set_addrs(vec![(ip(9), 2)]);
    p.s[0].agent.resolve_route(c).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::RouteError { status: status::ENODEV })]);
    p.s[0].agent.set_addrs(addrs);
    p.s[0].agent.resolve_route(c).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::RouteResolved)]);
    assert!(p.s[0].agent.route(c).is_some());
}

/// IPv6 addresses end to end: the rdma_cm header carries them (IP version 6), the passive side
/// learns the peer's address from it, the route's GIDs are the addresses themselves.
#[test]
fn ipv6_connection() {
    let v6 = |i: u8| IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(i)));
    let side6 = |i: u8| {
        let cfg = AgentConfig::new(0x1000 + u64::from(i), vec![(v6(i), 2)], Mtu::M1024, u64::from(i));
        let gid = match v6(i) {
            IpAddr::V6(a) => a.octets(),
            IpAddr::V4(_) => unreachable!(),
        };
        Side { agent: CmAgent::new(cfg), gid, qp: Vec::new() }
    };
    let mut p = Pair { now: Instant::ZERO, s: [side6(1), side6(2)], drop: [0, 0], sent: Vec::new(), mads: Vec::new() };
    let l = p.s[1].agent.create_id(PortSpace::Tcp);
    p.s[1].agent.bind(l, SocketAddr::new("::".parse().unwrap(), 7174)).unwrap();
    p.s[1].agent.listen(l, 4).unwrap();
    let c = p.s[0].agent.create_id(PortSpace::Tcp);
    p.s[0].agent.resolve_addr(c, None, SocketAddr::new(v6(2), 7174)).unwrap();
    p.s[0].agent.resolve_route(c).unwrap();
    assert_eq!(p.events(0), vec![(c, EventKind::AddrResolved), (c, EventKind::RouteResolved)]);
    let route = p.s[0].agent.route(c).unwrap();
    assert_eq!((route.sgid, route.dgid, route.sgid_index), (p.s[0].gid, p.s[1].gid, 2));
    let mut param = ConnParam::new(Qpn::new(0x20));
    param.private_data = b"six".to_vec();
    p.s[0].agent.connect(c, param, p.now).unwrap();
    p.pump();
    let ev: Vec<_> = std::iter::from_fn(|| p.s[1].agent.poll_event()).collect();
    assert_eq!(ev.len(), 1);
    let local = p.s[0].agent.addrs(c).0.unwrap();
    assert_eq!(ev[0].conn.remote_addr, Some(local));
    assert_eq!(ev[0].conn.local_addr, Some(SocketAddr::new(v6(2), 7174)));
    assert_eq!(&ev[0].conn.private_data[..3], b"six");
    p.s[1].agent.accept(ev[0].id, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    assert_eq!(p.events(0), vec![(c, EventKind::Established)]);
    assert_eq!(p.events(1), vec![(ev[0].id, EventKind::Established)]);
    // The REQ on the wire: the path's GIDs are the IPv6 addresses, and its private data starts
    // with the kernel's cma_hdr for IPv6: version 0, IP version 6 in the high nibble, the source
    // port, then the two 16-byte addresses (struct in6_addr), then the application's data.
    let (_, req) = &p.mads[0];
    let Ok((_, CmMessage::Req(r))) = CmMessage::parse(&req[..]) else { panic!("the first MAD is no REQ") };
    assert_eq!((r.primary.local_gid, r.primary.remote_gid), (p.s[0].gid, p.s[1].gid));
    let pd = &r.private_data;
    assert_eq!(&pd[..2], &[0x00, 0x60]);
    assert_eq!(&pd[2..4], &local.port().to_be_bytes());
    assert_eq!(&pd[4..20], &p.s[0].gid);
    assert_eq!(&pd[20..36], &p.s[1].gid);
    assert_eq!(&pd[36..39], b"six");
    assert_eq!(p.s[0].agent.addrs(c).1, Some(SocketAddr::new(v6(2), 7174)));
}

/// The kernel's timings and outcomes: a REP the active side never answers ends in UNREACHABLE
/// (IB_CM_REP_ERROR) with the passive QP in ERR; time-wait lasts 2^(19-8) ms after the DREP.
#[test]
fn rep_timeout_is_unreachable_and_timewait_is_the_kernels() {
    let mut p = Pair::new();
    let (_c, _l, s) = connect(&mut p, b"");
    p.drop[1] = usize::MAX;
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    p.events(0);
    while p.tick() {}
    assert_eq!(p.events(1), vec![(s, EventKind::Unreachable)]);
    assert_eq!(p.s[1].qp.last(), Some(&QpCommand::Err { qpn: Qpn::new(0x30) }));

    let mut p = Pair::new();
    let (c, _l, s) = connect(&mut p, b"");
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    p.s[0].agent.disconnect(c, p.now).unwrap();
    p.pump();
    let t0 = p.now;
    assert_eq!(p.events(0), vec![(c, EventKind::Established), (c, EventKind::Disconnected)]);
    assert!(p.tick());
    assert_eq!(p.now, t0 + Duration::from_millis(2048));
    assert_eq!(p.events(0), vec![(c, EventKind::TimewaitExit)]);
}

/// A DREQ never answered: DISCONNECTED with -ETIMEDOUT (IB_CM_DREQ_ERROR); an ordinary one: 0.
#[test]
fn unanswered_dreq_is_disconnected_with_etimedout() {
    let mut p = Pair::new();
    let (c, _l, s) = connect(&mut p, b"");
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    p.events(0);
    p.events(1);
    p.drop[0] = usize::MAX;
    p.s[0].agent.disconnect(c, p.now).unwrap();
    p.pump();
    let mut evs = Vec::new();
    while evs.is_empty() && p.tick() {
        evs.extend(std::iter::from_fn(|| p.s[0].agent.poll_event()));
    }
    assert_eq!(evs.len(), 1);
    assert_eq!((evs[0].kind.clone(), evs[0].status), (EventKind::Disconnected, crate::status::ETIMEDOUT));
    let mut p = Pair::new();
    let (c, _l, s) = connect(&mut p, b"");
    p.s[1].agent.accept(s, ConnParam::new(Qpn::new(0x30)), p.now).unwrap();
    p.pump();
    p.s[1].agent.disconnect(s, p.now).unwrap();
    p.pump();
    let evs: Vec<_> = std::iter::from_fn(|| p.s[0].agent.poll_event()).collect();
    assert_eq!(
        evs.iter().map(|e| (e.kind.clone(), e.status)).collect::<Vec<_>>(),
        vec![(EventKind::Established, 0), (EventKind::Disconnected, 0)]
    );
    let _ = c;
}
