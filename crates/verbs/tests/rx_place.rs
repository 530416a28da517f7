//! Receiving an RC RDMA WRITE's continuation straight into the target region (crates/verbs
//! place.rs). The requester is a test-driven UDP port that builds and seals the packets itself, so
//! each test decides exactly what arrives: a FIRST (asking for an ACK, which the test waits for, so
//! the device has accepted it before the rest arrives), then MIDDLE/LAST packets as one GSO send
//! (one GRO datagram at the device) or one by one, with corruptions and strays in between.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{compare, pattern, Endpoint};
use softrdma_verbs::io::{Datagram, UdpPort};
use softrdma_verbs::{ConnectParams, DeviceBuilder, Gid, Mtu, Psn, Qpn};
use softrdma_wire::opcode::base;
use softrdma_wire::roce::seal_udp_payload_ident;
use softrdma_wire::{BthRepr, IbPacket, IbRepr, NakCode, Opcode, QpType, RethRepr, Syndrome};

const MTU: usize = 4096;
const PEER_QPN: Qpn = Qpn::new(0x99);

/// A device with one RC QP (region of `region` bytes) connected to a requester we drive by hand.
struct Rig {
    ep: Endpoint,
    peer: UdpPort,
    peer_addr: SocketAddr,
    dev_addr: SocketAddr,
}

impl Rig {
    fn new(name: &str, last_octet: u8, region: usize) -> Rig {
        let dev_ip = Ipv4Addr::new(127, 0, 81, last_octet);
        let peer_ip = Ipv4Addr::new(127, 0, 81, last_octet + 1);
        // A free port for both (the device and the requester bind it on their own addresses).
        let port = UdpSocket::bind((peer_ip, 0)).unwrap().local_addr().unwrap().port();
        let peer = UdpPort::bind(Some(peer_ip), None, port, 0).unwrap();
        let ctx = DeviceBuilder::new(name, "lo")
            .addr(IpAddr::V4(dev_ip))
            .udp_port(port)
            .same_host(false)
            .rx_place(true)
            .open()
            .unwrap();
        let ep = Endpoint::new(ctx, region, 64);
        let mut p = ConnectParams::new(PEER_QPN, Psn::new(0), Gid::from_ip(IpAddr::V4(peer_ip)), Psn::new(0));
        p.mtu = Mtu::M4096;
        ep.qp.connect(&ep.pd, &p).unwrap();
        Rig {
            ep,
            peer,
            peer_addr: SocketAddr::new(IpAddr::V4(peer_ip), port),
            dev_addr: SocketAddr::new(IpAddr::V4(dev_ip), port),
        }
    }

    /// An RC request to our QP, sealed for identification `ident`.
    fn packet(&self, op: u8, psn: u32, reth: Option<(u64, u32)>, payload: &[u8], ident: u16) -> Vec<u8> {
        self.packet_to(self.ep.qp.qpn(), op, psn, reth, payload, ident)
    }

    fn packet_to(&self, qpn: Qpn, op: u8, psn: u32, reth: Option<(u64, u32)>, payload: &[u8], ident: u16) -> Vec<u8> {
        let mut repr = IbRepr::new(BthRepr {
            ack_req: reth.is_some() || matches!(op, base::WRITE_LAST),
            ..BthRepr::new(Opcode::of(QpType::Rc, op).unwrap(), qpn, Psn::new(psn))
        });
        repr.reth = reth.map(|(va, dma_len)| RethRepr { va, rkey: self.ep.mr.rkey(), dma_len });
        repr.payload_len = payload.len();
        let mut buf = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut buf).unwrap();
        buf.truncate(n);
        buf[repr.payload_range()].copy_from_slice(payload);
        seal_udp_payload_ident(self.peer_addr, self.dev_addr, &mut buf, ident).unwrap();
        buf
    }

    /// Send `pkts` as one GSO send (one GRO datagram at the device), or one by one.
    fn send(&self, pkts: &[Vec<u8>], gso: bool) {
        let d: Vec<Datagram<'_>> = pkts.iter().map(|p| Datagram::one(p, self.dev_addr)).collect();
        if gso {
            assert!(self.peer.gso(), "UDP GSO unavailable");
            assert_eq!(self.peer.send_batch(&d, &[(0, d.len())]), 0);
        } else {
            let groups: Vec<(usize, usize)> = (0..d.len()).map(|i| (i, i + 1)).collect();
            assert_eq!(self.peer.send_batch(&d, &groups), 0);
        }
    }

    /// The next response from the device: (PSN, syndrome).
    fn response(&self) -> (u32, Syndrome) {
        let (sock, _) = self.peer.sockets().next().unwrap();
        let mut buf = [0u8; 2048];
        let start = Instant::now();
        loop {
            match sock.recv_from(&mut buf) {
                Ok((n, _)) => {
                    let p = IbPacket::new_checked(&buf[..n]).unwrap();
                    assert_eq!(p.bth().opcode().base(), base::ACKNOWLEDGE);
                    return (p.bth().psn().value(), p.aeth().unwrap().syndrome());
                }
                Err(_) => {
                    assert!(start.elapsed() < Duration::from_secs(10), "no response from the device");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// The FIRST packet of a WRITE of `data` to `va`, and wait for its ACK.
    fn first(&self, va: u64, dma_len: usize, data: &[u8]) {
        self.send(&[self.packet(base::WRITE_FIRST, 0, Some((va, dma_len as u32)), &data[..MTU], 0)], false);
        assert_eq!(self.response(), (0, ACK));
    }

    /// Packets `from..to` (PSNs; packet i carries `data[i * MTU..]`) of a WRITE of `data`, sealed
    /// as segments of one GSO send.
    fn rest(&self, data: &[u8], from: usize, to: usize) -> Vec<Vec<u8>> {
        let last = data.len().div_ceil(MTU) - 1;
        (from..to)
            .map(|i| {
                let op = if i == last { base::WRITE_LAST } else { base::WRITE_MIDDLE };
                let chunk = &data[i * MTU..((i + 1) * MTU).min(data.len())];
                self.packet(op, i as u32, None, chunk, (i - from) as u16)
            })
            .collect()
    }

    fn region(&self, offset: usize, len: usize) -> Vec<u8> {
        self.ep.mr.to_vec(offset, len).unwrap()
    }
}

const ACK: Syndrome = Syndrome::Ack { credits: softrdma_wire::aeth::CREDITS_INVALID };

fn check(what: &str, got: &[u8], want: &[u8]) {
    if let Err(e) = compare(what, got, want) {
        panic!("{e}");
    }
}

#[test]
fn a_write_continuation_lands_in_place() {
    let r = Rig::new("place0", 10, 1 << 17);
    let data = pattern(1 << 16, 1);
    let va = r.ep.mr.addr() + 4096;
    r.first(va, data.len(), &data);
    // The 15 packets after the FIRST as one GRO datagram: all received into the region.
    r.send(&r.rest(&data, 1, 16), true);
    assert_eq!(r.response(), (15, ACK));
    check("region", &r.region(4096, data.len()), &data);
    assert_eq!(r.ep.ctx.rx_placed(), 15);
    let v = r.ep.ctx.icrc_stats();
    assert_eq!((v.verified, v.bad), (16, 0));
}

#[test]
fn an_odd_length_write_lands_in_place_pad_and_all() {
    let r = Rig::new("place4", 18, 1 << 16);
    r.ep.mr.fill(0xee);
    // 3 packets after the FIRST, the last with 1001 bytes and 3 bytes of pad.
    let data = pattern(3 * MTU + 1001, 5);
    r.first(r.ep.mr.addr(), data.len(), &data);
    r.send(&r.rest(&data, 1, 4), true);
    assert_eq!(r.response(), (3, ACK));
    check("region", &r.region(0, data.len()), &data);
    check("after the write", &r.region(data.len(), 64), &[0xee; 64]);
    assert_eq!(r.ep.ctx.rx_placed(), 3);
}

#[test]
fn a_corrupted_in_place_packet_is_dropped_and_the_retransmission_repairs_it() {
    let r = Rig::new("place1", 12, 1 << 16);
    let data = pattern(8 * MTU, 2);
    let va = r.ep.mr.addr();
    r.first(va, data.len(), &data);
    // Packet 3 of the GRO datagram (PSN 3) has a payload byte flipped after sealing.
    let mut rest = r.rest(&data, 1, 8);
    rest[2][100] ^= 0x40;
    r.send(&rest, true);
    // PSNs 1 and 2 were placed, 3 failed its ICRC, 4.. are out of sequence: one NAK for PSN 3.
    assert_eq!(r.response(), (3, Syndrome::Nak(NakCode::PsnSequenceError)));
    assert_eq!(r.ep.ctx.icrc_stats().bad, 1);
    assert_eq!(r.ep.ctx.counters().out_of_seq_request, 4);
    // Go-back-N from PSN 3, as a requester does: the region ends up exact.
    r.send(&r.rest(&data, 3, 8), true);
    assert_eq!(r.response(), (7, ACK));
    check("region", &r.region(0, data.len()), &data);
    assert_eq!(r.ep.ctx.rx_placed(), 2 + 5);
}

#[test]
fn mispredicted_datagrams_take_the_copying_path() {
    let r = Rig::new("place2", 14, 1 << 16);
    let data = pattern(6 * MTU, 3);
    let va = r.ep.mr.addr();
    r.first(va, data.len(), &data);
    // While the continuation is expected: a packet for another QP, a duplicate of the FIRST (another
    // size, an old PSN: re-ACKed), an ACK (a response: not for a responder in place), and a
    // continuation packet alone (not a GRO batch) — each received as it is.
    let stray = r.packet_to(Qpn::new(0xabcdef), base::WRITE_ONLY, 0, Some((va, 16)), &[7; 16], 0);
    r.send(&[stray], false);
    r.send(&[r.packet(base::WRITE_FIRST, 0, Some((va, data.len() as u32)), &data[..MTU], 0)], false);
    assert_eq!(r.response(), (0, ACK));
    let mut ack =
        IbRepr::new(BthRepr::new(Opcode::of(QpType::Rc, base::ACKNOWLEDGE).unwrap(), r.ep.qp.qpn(), Psn::new(1)));
    ack.aeth = Some(softrdma_wire::AethRepr { syndrome: ACK, msn: 0 });
    let mut buf = vec![0u8; ack.buffer_len()];
    ack.emit(&mut buf).unwrap();
    seal_udp_payload_ident(r.peer_addr, r.dev_addr, &mut buf, 0).unwrap();
    r.send(&[buf], false);
    r.send(&r.rest(&data, 1, 2), false);
    // The rest, with segments of another size first: a GRO datagram of two 1 KiB SENDs to another
    // QP is not the continuation either.
    let small: Vec<Vec<u8>> =
        (0..2).map(|i| r.packet_to(Qpn::new(0xabcdef), base::SEND_ONLY, i, None, &[9; 1024], i as u16)).collect();
    r.send(&small, true);
    r.send(&r.rest(&data, 2, 6), true);
    assert_eq!(r.response(), (5, ACK));
    check("region", &r.region(0, data.len()), &data);
    let c = r.ep.ctx.counters();
    assert_eq!((c.drop_unknown_qp, c.duplicate_request, c.drop_malformed), (3, 1, 0));
    // The continuation's packets were received in place all the same.
    assert_eq!(r.ep.ctx.rx_placed(), 5);
    assert_eq!(r.ep.ctx.icrc_stats().bad, 0);
}

#[test]
fn nothing_lands_past_the_reth_range() {
    let r = Rig::new("place3", 16, 1 << 16);
    r.ep.mr.fill(0xee);
    // A WRITE of 3 packets to [4096, 16384) of the region, but the requester sends 4: the FIRST and
    // three MIDDLEs, the last of which would run past the RETH's length.
    let data = pattern(4 * MTU, 4);
    let va = r.ep.mr.addr() + 4096;
    r.first(va, 3 * MTU, &data);
    let rest: Vec<Vec<u8>> = (1..4)
        .map(|i| r.packet(base::WRITE_MIDDLE, i as u32, None, &data[i * MTU..(i + 1) * MTU], (i - 1) as u16))
        .collect();
    r.send(&rest, true);
    // The second MIDDLE leaves the LAST nothing: an invalid request, as on the copying path.
    assert_eq!(r.response(), (2, Syndrome::Nak(NakCode::InvalidRequest)));
    check("before the range", &r.region(0, 4096), &[0xee; 4096]);
    check("after the range", &r.region(16384, (1 << 16) - 16384), &vec![0xee; (1 << 16) - 16384]);
    check("the range's first two packets", &r.region(4096, 2 * MTU), &data[..2 * MTU]);
}
