//! Shared receive queues: two QPs consuming one SRQ in arrival order, the limit event, and a QP
//! going to ERR (LastWqeReached, the SRQ's WQEs left for the others).

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Endpoint, Impairments, Net};
use softrdma_transport::{AsyncEvent, ModifyQp, Mtu, QpState, SendOp, SrqId, VerbsError, WcOpcode, WcStatus};

use crate::net;

struct Setup {
    net: Net,
    a1: Endpoint,
    b1: Endpoint,
    a2: Endpoint,
    b2: Endpoint,
    srq: SrqId,
    ma: Mr,
    mb: Mr,
}

/// Two RC connections A1-B1 and A2-B2; B1 and B2 share an SRQ holding `n` 1 KiB WQEs
/// (ids 100.., buffer `i` at mb[i*1024..]).
fn setup(name: &str, n: usize) -> Setup {
    setup_mtu(name, n, Mtu::M1024)
}

fn setup_mtu(name: &str, n: usize, mtu: Mtu) -> Setup {
    let mut net = net(name, Impairments::NONE, 30);
    let srq = net.nodes[1].hca.create_srq(16, 2);
    let o = ConnOpts { mtu, ..ConnOpts::default() };
    let (a1, b1) = net.connect_srq(0, 1, &o, srq);
    let (a2, b2) = net.connect_srq(0, 1, &o, srq);
    let ma = net.reg(&a1, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b1, 16 * 1024, ALL_ACCESS, 0xee);
    for i in 0..n {
        net.nodes[1].hca.post_srq_recv(srq, recv(100 + i as u64, &[mb.sge(i * 1024, 1024)])).unwrap();
    }
    Setup { net, a1, b1, a2, b2, srq, ma, mb }
}

fn send(s: &mut Setup, from: Endpoint, id: u64, len: usize) {
    let w = wr(id, SendOp::Send, &[s.ma.sge(id as usize * 16, len)]);
    s.net.post_send(&from, w).unwrap();
    s.net.settle();
}

#[test]
fn two_qps_share_an_srq_with_a_limit_event() {
    let mut s = setup("srq_share", 6);
    let data = pattern(3, 8192);
    s.net.fill(&s.ma, 0, &data);
    s.net.nodes[1].hca.arm_srq(s.srq, 3).unwrap();
    // Posting to the QP itself is refused.
    let err = s.net.post_recv(&s.b1, recv(1, &[s.mb.sge(0, 8)]));
    assert!(matches!(err, Err(VerbsError::InvalidWorkRequest(_))));

    let (a1, a2, b1, b2) = (s.a1, s.a2, s.b1, s.b2);
    send(&mut s, a1, 1, 500);
    send(&mut s, a2, 2, 600);
    send(&mut s, a1, 3, 700);
    assert_eq!(s.net.events(1), vec![], "3 WQEs left: not below the limit");
    send(&mut s, a2, 4, 800);
    assert_eq!(s.net.events(1), vec![AsyncEvent::SrqLimitReached(s.srq)]);
    send(&mut s, a2, 5, 900);
    assert_eq!(s.net.events(1), vec![], "the limit fires once per arming");

    let r1 = s.net.recv_wcs(&b1);
    assert_wcs(&r1, &[(100, WcStatus::Success, WcOpcode::Recv, 500), (102, WcStatus::Success, WcOpcode::Recv, 700)]);
    let r2 = s.net.recv_wcs(&b2);
    assert_wcs(
        &r2,
        &[
            (101, WcStatus::Success, WcOpcode::Recv, 600),
            (103, WcStatus::Success, WcOpcode::Recv, 800),
            (104, WcStatus::Success, WcOpcode::Recv, 900),
        ],
    );
    assert!(r1.iter().all(|w| w.qp_num == b1.qpn));
    assert!(r2.iter().all(|w| w.qp_num == b2.qpn));
    let m = s.net.bytes(&s.mb).to_vec();
    for (wqe, id, len) in [(0, 1, 500), (1, 2, 600), (2, 3, 700), (3, 4, 800), (4, 5, 900)] {
        let want = &data[id * 16..id * 16 + len];
        assert_eq!(&m[wqe * 1024..wqe * 1024 + len], want, "wqe {wqe}");
        assert!(m[wqe * 1024 + len..(wqe + 1) * 1024].iter().all(|&x| x == 0xee));
    }
    assert!(m[5 * 1024..].iter().all(|&x| x == 0xee));
}

#[test]
fn qp_error_raises_last_wqe_reached_and_leaves_the_srq() {
    let mut s = setup("srq_err", 4);
    let (a1, a2, b1, b2) = (s.a1, s.a2, s.b1, s.b2);
    send(&mut s, a1, 1, 100);
    assert_wcs(&s.net.recv_wcs(&b1), &[(100, WcStatus::Success, WcOpcode::Recv, 100)]);

    // B1 fails on a remote access error: its events, and no flush of the SRQ's WQEs.
    let bad = SendOp::Write { remote_addr: s.mb.at(0), rkey: 0xdead_0000 };
    s.net.post_send(&a1, wr(2, bad, &[s.ma.sge(0, 8)])).unwrap();
    s.net.settle();
    assert_wcs(
        &s.net.send_wcs(&a1),
        &[(1, WcStatus::Success, WcOpcode::Send, 100), (2, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, 0)],
    );
    assert_eq!(s.net.state(&b1), QpState::Err);
    assert_eq!(s.net.events(1), vec![AsyncEvent::QpAccessError(b1.qpn), AsyncEvent::QpLastWqeReached(b1.qpn)]);
    assert_wcs(&s.net.recv_wcs(&b1), &[]);

    // The three WQEs left all go to B2.
    for id in 3..6 {
        send(&mut s, a2, id, 10 * id as usize);
    }
    assert_wcs(
        &s.net.recv_wcs(&b2),
        &[
            (101, WcStatus::Success, WcOpcode::Recv, 30),
            (102, WcStatus::Success, WcOpcode::Recv, 40),
            (103, WcStatus::Success, WcOpcode::Recv, 50),
        ],
    );
    assert_wcs(&s.net.recv_wcs(&b1), &[]);
}

/// A multi-packet SEND in progress on B1 when it is moved to ERR: the WQE it took from the SRQ is
/// flushed on B1's CQ; the SRQ's other WQEs stay.
#[test]
fn modify_to_err_mid_message() {
    let mut s = setup_mtu("srq_err_mid", 3, Mtu::M256);
    let (a1, a2, b1, b2) = (s.a1, s.a2, s.b1, s.b2);
    // Lose every SEND_LAST so the 4-packet message stays in progress.
    s.net.filter = Some(Box::new(move |_, _, f| {
        let p = softrdma_wire::IbPacket::new_checked(&f[..]).unwrap();
        p.bth().opcode().base() != softrdma_wire::opcode::base::SEND_LAST
    }));
    s.net.post_send(&a1, wr(1, SendOp::Send, &[s.ma.sge(0, 1000)])).unwrap();
    s.net.run_for(core::time::Duration::from_micros(50));
    let now = s.net.now;
    let n = &mut s.net.nodes[1];
    let to_err = ModifyQp { state: Some(QpState::Err), ..Default::default() };
    n.hca.modify_qp(b1.qpn, &to_err, now, &mut n.mem).unwrap();
    // (A1 would retry forever against a QP in ERR.)
    s.net.modify(&a1, &to_err).unwrap();
    assert_eq!(s.net.events(1), vec![AsyncEvent::QpLastWqeReached(b1.qpn)]);
    assert_wcs(&s.net.recv_wcs(&b1), &[(100, WcStatus::WrFlushErr, WcOpcode::Recv, 0)]);
    s.net.filter = None;
    send(&mut s, a2, 2, 20);
    send(&mut s, a2, 3, 30);
    assert_wcs(
        &s.net.recv_wcs(&b2),
        &[(101, WcStatus::Success, WcOpcode::Recv, 20), (102, WcStatus::Success, WcOpcode::Recv, 30)],
    );
}
