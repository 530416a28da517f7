//! When a thread polling a CQ takes the completion of a received request (or takes in an RDMA
//! WRITE, which completes nothing, while it watches memory), the ACK of that request leaves after
//! what the thread posts next (its reply), and it always leaves: when the thread
//! stops calling, when it destroys the QP right away, when what arrives next moves the QP to ERR.
//!
//! The peer is a plain UDP socket that speaks RoCEv2 by hand: it sends SENDs with AckReq to the
//! device's QP and reads, in order, what the device sends back.

mod common;

use std::cell::Cell;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Endpoint;
use softrdma_verbs::{ConnectParams, DeviceBuilder, Gid, Psn, Qpn, RecvWr, SendOp, WcOpcode, WcStatus, WorkCompletion};
use softrdma_wire::aeth::CREDITS_INVALID;
use softrdma_wire::opcode::base;
use softrdma_wire::{AethRepr, BthRepr, IbRepr, NakCode, Opcode, QpType as WireQpType, RethRepr, Syndrome};

const PEER_QPN: Qpn = Qpn::new(0x99);

/// The device's endpoint, connected to the socket `peer` stands for.
struct Rig {
    ep: Endpoint,
    peer: UdpSocket,
    dev: SocketAddr,
    /// SENDs the device sent (PSNs from 0x10) and the peer sent (PSNs from 0).
    sent: Cell<u32>,
    received: Cell<u32>,
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
        Rig { ep, peer, dev: SocketAddr::new(IpAddr::V4(dev_ip), port), sent: Cell::new(0), received: Cell::new(0) }
    }

    /// The peer sends an 8-byte SEND ONLY with AckReq at `psn`.
    fn peer_send(&self, psn: u32) {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::SEND_ONLY).unwrap(), self.ep.qp.qpn(), Psn::new(psn));
        let mut repr = IbRepr::new(BthRepr { ack_req: true, ..bth });
        repr.payload_len = 8;
        self.peer_emit(&repr);
    }

    /// The peer writes 8 bytes of `value` with an RDMA WRITE ONLY with AckReq at `psn` to the
    /// start of the device's region.
    fn peer_write(&self, psn: u32, value: u8) {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::WRITE_ONLY).unwrap(), self.ep.qp.qpn(), Psn::new(psn));
        let mut repr = IbRepr::new(BthRepr { ack_req: true, ..bth });
        repr.reth = Some(RethRepr { va: self.ep.mr.addr(), rkey: self.ep.mr.rkey(), dma_len: 8 });
        repr.payload_len = 8;
        let mut pkt = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut pkt).unwrap();
        pkt[repr.payload_range()].fill(value);
        pkt.truncate(n);
        softrdma_wire::roce::seal_udp_payload(self.peer.local_addr().unwrap(), self.dev, &mut pkt).unwrap();
        self.peer.send_to(&pkt, self.dev).unwrap();
    }

    /// The peer ACKs the device's requests up to `psn`.
    fn peer_ack(&self, psn: u32, msn: u32) {
        self.peer_acknowledge(psn, Syndrome::Ack { credits: CREDITS_INVALID }, msn);
    }

    fn peer_acknowledge(&self, psn: u32, syndrome: Syndrome, msn: u32) {
        let bth = BthRepr::new(Opcode::of(WireQpType::Rc, base::ACKNOWLEDGE).unwrap(), self.ep.qp.qpn(), Psn::new(psn));
        let mut repr = IbRepr::new(bth);
        repr.aeth = Some(AethRepr { syndrome, msn });
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

    /// The device posts a SEND (a reply, when a request came before), which the peer reads and
    /// ACKs. Returns what the peer read: the SEND and, if it came after it, the ACK of the
    /// peer's last request.
    fn reply(&self) -> Vec<(u8, u32)> {
        let n = self.sent.get();
        self.sent.set(n + 1);
        self.ep.post(u64::from(n), SendOp::Send, 0, 8);
        let mut got = Vec::new();
        while !got.contains(&(base::SEND_ONLY, 0x10 + n)) {
            got.push(next_packet(&self.peer, Duration::from_secs(5)).expect("the device's SEND"));
        }
        self.peer_ack(0x10 + n, n + 1);
        got
    }

    /// The peer's next SEND, which the device's polling thread takes in. Returns whether that poll
    /// left its ACK owed.
    fn request(&self) -> bool {
        let before = self.ep.ctx.flushes_left_owed();
        let psn = self.received.get();
        self.received.set(psn + 1);
        self.peer_send(psn);
        let wc = self.poll_recv();
        is_recv_of_8(&wc);
        self.ep.qp.post_recv(RecvWr { wr_id: wc.wr_id, sgl: vec![self.ep.sge(0, 64)].into() }).unwrap();
        self.ep.ctx.flushes_left_owed() > before
    }

    /// The peer's next request is an RDMA WRITE, which the device's thread notices in its region
    /// while it busy-polls its CQ (finding nothing: a WRITE completes no receive), as a
    /// `write-lat` peer does. Returns whether the poll that took it in left its ACK owed.
    fn write_request(&self) -> bool {
        let before = self.ep.ctx.flushes_left_owed();
        let psn = self.received.get();
        self.received.set(psn + 1);
        let value = (psn % 255) as u8 + 1;
        self.peer_write(psn, value);
        let mut out = Vec::new();
        let mut byte = [0u8];
        let start = Instant::now();
        loop {
            self.ep.cq.poll(1, &mut out).unwrap();
            self.ep.mr.read(7, &mut byte).unwrap();
            if byte[0] == value {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "the peer's WRITE did not arrive");
        }
        assert!(out.iter().all(|wc| (wc.status, wc.opcode) == (WcStatus::Success, WcOpcode::Send)), "{out:?}");
        self.ep.ctx.flushes_left_owed() > before
    }

    /// Get the I/O thread to stand aside for the polling thread (it is the one that takes requests
    /// in then, and may leave a flush to later): the device's SEND arms a timer, which wakes the
    /// I/O thread, while the test thread busy-polls.
    fn warm_up(&self) {
        self.poll_for(Duration::from_millis(1));
        self.reply();
        self.poll_for(Duration::from_millis(1));
    }

    /// Busy-poll the CQ for `d`, finding nothing but the completions of the device's SENDs.
    fn poll_for(&self, d: Duration) {
        let mut out = Vec::new();
        let start = Instant::now();
        while start.elapsed() < d {
            self.ep.cq.poll(1, &mut out).unwrap();
        }
        assert!(out.iter().all(|wc| (wc.status, wc.opcode) == (WcStatus::Success, WcOpcode::Send)), "{out:?}");
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

/// The tests busy-poll: one at a time, so that the I/O threads find their polling threads busy.
static SERIAL: Mutex<()> = Mutex::new(());

/// Rounds a test may take to see two (or one) polls leave their ACK owed: on a loaded machine
/// the I/O thread takes some requests in instead.
const ROUNDS: u32 = 1000;

#[test]
fn a_reply_posted_after_the_completion_leaves_before_the_ack() {
    reply_goes_before_the_ack(("ackord0", 1), "request", Rig::request);
}

#[test]
fn a_reply_posted_after_a_write_arrived_leaves_before_its_ack() {
    reply_goes_before_the_ack(("ackord4", 9), "WRITE", Rig::write_request);
}

/// On a rig (`Rig::new` of `rig`), rounds of: the peer's request (`request`, which says whether
/// the poll that took it in left its ACK owed), then the device's reply. Twice the ACK must come
/// after the reply; whenever the poll did not leave it owed, before.
fn reply_goes_before_the_ack(rig: (&str, u8), what: &str, request: impl Fn(&Rig) -> bool) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let r = Rig::new(rig.0, rig.1);
    let mut left_owed = 0;
    for _ in 0..ROUNDS {
        // Each round: the last one waited for the peer's packets without polling, and a loaded
        // machine's I/O thread, done standing aside, would take every request in.
        r.warm_up();
        let psn = r.received.get();
        let owed = request(&r);
        let got = r.reply();
        let (reply, ack) = ((base::SEND_ONLY, 0x10 + r.sent.get() - 1), (base::ACKNOWLEDGE, psn));
        if owed && got == [reply] {
            left_owed += 1;
            assert_eq!(next_packet(&r.peer, Duration::from_secs(5)), Some(ack), "{what} {psn}");
        } else {
            // The I/O thread took this request in, or flushed the ACK a poll left owed before the
            // reply was posted (the test thread was descheduled for a while): the ACK went first.
            assert_eq!(got, [ack, reply], "{what} {psn} (left owed: {owed})");
        }
        if left_owed == 2 {
            return;
        }
    }
    panic!("{left_owed} of {ROUNDS} polls left the ACK of a {what} to the reply's flush");
}

/// Runs `check` with the ACK of the peer's request `psn` owed, on a rig whose polling thread took
/// that request in and left its ACK to the next flush.
fn with_ack_owed(name: &str, last: u8, check: impl Fn(Rig, u32)) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let r = Rig::new(name, last);
    for _ in 0..ROUNDS {
        r.warm_up();
        let psn = r.received.get();
        if r.request() {
            return check(r, psn);
        }
        // The I/O thread took it in and ACKed it at once.
        assert_eq!(next_packet(&r.peer, Duration::from_secs(5)), Some((base::ACKNOWLEDGE, psn)));
    }
    panic!("no poll left its ACK owed in {ROUNDS} rounds");
}

#[test]
fn the_ack_leaves_when_the_application_stops_calling() {
    with_ack_owed("ackord1", 3, |r, psn| {
        // No verbs call any more: the I/O thread takes over once the polling stopped.
        let start = Instant::now();
        assert_eq!(next_packet(&r.peer, Duration::from_secs(2)), Some((base::ACKNOWLEDGE, psn)));
        // About a millisecond: the I/O thread looks every BUSY_SLEEP (0.5 ms) while it stands aside.
        assert!(start.elapsed() < Duration::from_millis(30), "the ACK took {:?}", start.elapsed());
    });
}

#[test]
fn the_ack_leaves_when_the_qp_is_destroyed_at_once() {
    with_ack_owed("ackord2", 5, |r, psn| {
        let Rig { ep, peer, .. } = r;
        drop(ep.qp);
        assert_eq!(next_packet(&peer, Duration::from_secs(2)), Some((base::ACKNOWLEDGE, psn)));
    });
}

#[test]
fn the_ack_leaves_before_an_error_that_arrives_next() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let r = Rig::new("ackord3", 7);
    for _ in 0..ROUNDS {
        r.warm_up();
        // A SEND of the device's, which the peer will NAK.
        let n = r.sent.get();
        r.sent.set(n + 1);
        r.ep.post(1000, SendOp::Send, 0, 8);
        assert_eq!(next_packet(&r.peer, Duration::from_secs(5)), Some((base::SEND_ONLY, 0x10 + n)));
        let psn = r.received.get();
        if !r.request() {
            // The I/O thread took the request in and ACKed it at once: again.
            assert_eq!(next_packet(&r.peer, Duration::from_secs(5)), Some((base::ACKNOWLEDGE, psn)));
            r.peer_ack(0x10 + n, n + 1);
            continue;
        }
        // The NAK moves the QP to ERR, which drops queued responses: the owed ACK went before.
        r.peer_acknowledge(0x10 + n, Syndrome::Nak(NakCode::RemoteAccessError), n);
        let mut out = Vec::new();
        let start = Instant::now();
        while !out.iter().any(|wc: &WorkCompletion| wc.wr_id == 1000) {
            r.ep.cq.poll(16, &mut out).unwrap();
            assert!(start.elapsed() < Duration::from_secs(5), "no completion for the NAKed SEND: {out:?}");
        }
        let wc = out.iter().find(|wc| wc.wr_id == 1000).unwrap();
        assert_eq!(wc.status, WcStatus::RemAccessErr);
        assert_eq!(next_packet(&r.peer, Duration::from_secs(2)), Some((base::ACKNOWLEDGE, psn)));
        return;
    }
    panic!("no poll left its ACK owed in {ROUNDS} rounds");
}
