//! When a thread polling a CQ takes the completion of a received request, the ACK of that request
//! leaves after what the thread posts next (its reply), and it always leaves: when the thread
//! stops calling, when it destroys the QP right away.
//!
//! The peer is a plain UDP socket that speaks RoCEv2 by hand: it sends SENDs with AckReq to the
//! device's QP and reads, in order, what the device sends back.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::Endpoint;
use softrdma_verbs::{ConnectParams, DeviceBuilder, Gid, Psn, Qpn, RecvWr, SendOp, WcOpcode, WcStatus, WorkCompletion};
use softrdma_wire::aeth::CREDITS_INVALID;
use softrdma_wire::opcode::base;
use softrdma_wire::{AethRepr, BthRepr, IbRepr, Opcode, QpType as WireQpType, Syndrome};

const PEER_QPN: Qpn = Qpn::new(0x99);

/// The device's endpoint, connected to the socket `peer` stands for.
struct Rig {
    ep: Endpoint,
    peer: UdpSocket,
    dev: SocketAddr,
}

impl Rig {
    fn new(name: &str, last: u8) -> Rig {
        let peer_ip = Ipv4Addr::new(127, 0, 15, last + 1);
        let peer = UdpSocket::bind(SocketAddr::new(IpAddr::V4(peer_ip), 0)).unwrap();
        let port = peer.local_addr().unwrap().port();
        let dev_ip = Ipv4Addr::new(127, 0, 15, last);
        let ctx = DeviceBuilder::new(name, "lo").addr(IpAddr::V4(dev_ip)).udp_port(port).open().unwrap();
        let ep = Endpoint::new(ctx, 4096, 64);
        // The peer's requests start at PSN 0, the device's at 0x10.
        let p = ConnectParams::new(PEER_QPN, Psn::new(0), Gid::from_ip(IpAddr::V4(peer_ip)), Psn::new(0x10));
        ep.qp.connect(&ep.pd, &p).unwrap();
        for i in 0..32 {
            ep.qp.post_recv(RecvWr { wr_id: 100 + i, sgl: vec![ep.sge(0, 64)].into() }).unwrap();
        }
        Rig { ep, peer, dev: SocketAddr::new(IpAddr::V4(dev_ip), port) }
    }

    /// The peer sends an 8-byte SEND ONLY with AckReq at `psn`.
    fn peer_send(&self, psn: u32) {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::SEND_ONLY).unwrap(), self.ep.qp.qpn(), Psn::new(psn));
        let mut repr = IbRepr::new(BthRepr { ack_req: true, ..bth });
        repr.payload_len = 8;
        self.peer_emit(&repr);
    }

    /// The peer ACKs the device's requests up to `psn`.
    fn peer_ack(&self, psn: u32, msn: u32) {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::ACKNOWLEDGE).unwrap(), self.ep.qp.qpn(), Psn::new(psn));
        let mut repr = IbRepr::new(bth);
        repr.aeth = Some(AethRepr { syndrome: Syndrome::Ack { credits: CREDITS_INVALID }, msn });
        self.peer_emit(&repr);
    }

    fn peer_emit(&self, repr: &IbRepr) {
        let mut pkt = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut pkt).unwrap();
        pkt.truncate(n);
        softrdma_wire::roce::seal_udp_payload(self.peer.local_addr().unwrap(), self.dev, &mut pkt).unwrap();
        self.peer.send_to(&pkt, self.dev).unwrap();
    }

    /// Busy-poll the CQ until a receive completed (the I/O thread stands aside meanwhile); the
    /// completions of the device's own SENDs on the way must be successes.
    fn poll_recv(&self) -> WorkCompletion {
        let mut out = Vec::new();
        let start = Instant::now();
        loop {
            self.ep.cq.poll(1, &mut out).unwrap();
            if let Some(wc) = out.pop() {
                if wc.opcode == WcOpcode::Recv {
                    return wc;
                }
                assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send), "{wc:?}");
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no receive completion");
        }
    }

    /// Get the I/O thread to stand aside for the polling thread (it is the one that takes requests
    /// in then, and may leave a flush to later): a SEND of the device's, which arms a timer that
    /// wakes the I/O thread, while the test thread busy-polls; the peer ACKs it.
    fn warm_up(&self) {
        self.poll_for(Duration::from_millis(1));
        self.ep.post(99, SendOp::Send, 0, 8);
        assert_eq!(next_packet(&self.peer, Duration::from_secs(5)), Some((base::SEND_ONLY, 0x10)));
        self.peer_ack(0x10, 1);
        let wc = common::wait_n(&self.ep.cq, 1, Duration::from_secs(5)).remove(0);
        assert_eq!((wc.wr_id, wc.status), (99, WcStatus::Success));
        self.poll_for(Duration::from_millis(5));
    }

    /// Busy-poll the CQ, finding nothing, for `d`.
    fn poll_for(&self, d: Duration) {
        let mut out = Vec::new();
        let start = Instant::now();
        while start.elapsed() < d {
            self.ep.cq.poll(1, &mut out).unwrap();
        }
        assert!(out.is_empty(), "unexpected completions {out:?}");
    }
}

/// The next packet `peer` receives within `limit`: (opcode base, PSN).
fn next_packet(peer: &UdpSocket, limit: Duration) -> Option<(u8, u32)> {
    peer.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 2048];
    let (n, from) = peer.recv_from(&mut buf).ok()?;
    let (pkt, _) = softrdma_wire::roce::verify_udp_payload(from, peer.local_addr().unwrap(), &buf[..n])
        .expect("a packet with a valid ICRC");
    Some((pkt.bth().opcode().base(), pkt.bth().psn().value()))
}

fn is_recv_of_8(wc: &WorkCompletion) {
    assert_eq!((wc.status, wc.opcode, wc.byte_len), (WcStatus::Success, WcOpcode::Recv, 8), "{wc:?}");
}

#[test]
fn a_reply_posted_after_the_completion_leaves_before_the_ack() {
    let r = Rig::new("ackord0", 1);
    r.warm_up();
    let (mut reply_first, rounds) = (0, 10);
    for i in 0..rounds {
        r.peer_send(i);
        is_recv_of_8(&r.poll_recv());
        r.ep.post(u64::from(i), SendOp::Send, 0, 8);
        let got = [next_packet(&r.peer, Duration::from_secs(5)), next_packet(&r.peer, Duration::from_secs(5))];
        let (reply, ack) = (Some((base::SEND_ONLY, 0x11 + i)), Some((base::ACKNOWLEDGE, i)));
        if got == [reply, ack] {
            reply_first += 1;
        } else {
            // The I/O thread took this request in (the test thread was descheduled for a while):
            // the ACK went at once, before the reply was posted.
            assert_eq!(got, [ack, reply], "round {i}");
        }
        r.peer_ack(0x11 + i, i + 2);
    }
    assert!(reply_first * 2 >= rounds, "the reply went first in {reply_first} of {rounds} rounds");
}

#[test]
fn the_ack_leaves_when_the_application_stops_calling() {
    let r = Rig::new("ackord1", 3);
    r.warm_up();
    r.peer_send(0);
    is_recv_of_8(&r.poll_recv());
    // No verbs call any more: the I/O thread takes over once the polling stopped.
    let start = Instant::now();
    assert_eq!(next_packet(&r.peer, Duration::from_secs(2)), Some((base::ACKNOWLEDGE, 0)));
    // About a millisecond: the I/O thread looks every BUSY_SLEEP (0.5 ms) while it stands aside.
    assert!(start.elapsed() < Duration::from_millis(30), "the ACK took {:?}", start.elapsed());
}

#[test]
fn the_ack_leaves_when_the_qp_is_destroyed_at_once() {
    let r = Rig::new("ackord2", 5);
    r.warm_up();
    r.peer_send(0);
    is_recv_of_8(&r.poll_recv());
    let Rig { ep, peer, .. } = r;
    drop(ep.qp);
    assert_eq!(next_packet(&peer, Duration::from_secs(2)), Some((base::ACKNOWLEDGE, 0)));
}
