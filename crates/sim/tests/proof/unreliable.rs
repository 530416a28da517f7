//! UC (no ACKs, no retransmission, a broken message dropped silently) and UD (one packet per
//! message, Q_Key check, the 40-byte GRH area, src_qp, immediate data, MTU limit).

use std::cell::Cell;
use std::rc::Rc;

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Impairments, Net};
use softrdma_transport::wr::UdDest;
use softrdma_transport::{AddressVector, QpState, QpType, SendOp, WcFlags, WcOpcode, WcStatus};
use softrdma_wire::opcode::{base, Flags};
use softrdma_wire::{IbPacket, Psn};

use crate::{net, pair};

fn uc() -> ConnOpts {
    ConnOpts { qp_type: QpType::Uc, ..ConnOpts::default() }
}

/// Drop the frame from node 0 whose PSN is `psn` (once).
fn drop_psn(net: &mut Net, psn: Psn) -> Rc<Cell<u32>> {
    let hits = Rc::new(Cell::new(0));
    let h = hits.clone();
    net.filter = Some(Box::new(move |from, _, f| {
        let p = IbPacket::new_checked(&f[..]).expect("valid frame");
        if from == 0 && p.bth().psn() == psn && h.get() == 0 {
            h.set(1);
            return false;
        }
        true
    }));
    hits
}

#[test]
fn uc_broken_message_is_dropped_and_its_receive_reused() {
    // Drop packet `k` (0 = FIRST, 1 = MIDDLE, 2 = LAST) of the second of three 3-packet SENDs.
    for k in 0..3u32 {
        let mut net = net(&format!("uc_drop_{k}"), Impairments::NONE, 20 + u64::from(k));
        let (a, b) = pair(&mut net, &uc());
        let ma = net.reg(&a, 16384, ALL_ACCESS, 0);
        let mb = net.reg(&b, 16384, ALL_ACCESS, 0xcc);
        let msgs: Vec<Vec<u8>> = (0..3).map(|i| pattern(40 + i, 3000)).collect();
        for (i, m) in msgs.iter().enumerate() {
            net.fill(&ma, i * 4096, m);
        }
        for i in 0..3 {
            net.post_recv(&b, recv(50 + i as u64, &[mb.sge(i * 4096, 4096)])).unwrap();
        }
        let psn0 = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
        let hits = drop_psn(&mut net, psn0.add(3 + k));
        for i in 0..3 {
            net.post_send(&a, wr(i as u64, SendOp::Send, &[ma.sge(i * 4096, 3000)])).unwrap();
        }
        net.settle();
        assert_eq!(hits.get(), 1);
        // The sender completes everything as soon as it is out.
        assert_wcs(
            &net.send_wcs(&a),
            &[
                (0, WcStatus::Success, WcOpcode::Send, 3000),
                (1, WcStatus::Success, WcOpcode::Send, 3000),
                (2, WcStatus::Success, WcOpcode::Send, 3000),
            ],
        );
        // The broken message consumed nothing: its WQE (51) took the third message.
        assert_wcs(
            &net.recv_wcs(&b),
            &[(50, WcStatus::Success, WcOpcode::Recv, 3000), (51, WcStatus::Success, WcOpcode::Recv, 3000)],
        );
        let m = net.bytes(&mb);
        assert_eq!(&m[..3000], &msgs[0][..]);
        assert_eq!(&m[4096..7096], &msgs[2][..], "drop {k}");
        assert!(m[8192..].iter().all(|&x| x == 0xcc), "drop {k}");
        assert_eq!(net.nodes[1].hca.query_qp(b.qpn).unwrap().rq_posted, 1);
        // No ACKs and no retransmissions: exactly nine requests, nothing back.
        let frames = net.frames();
        assert_eq!(frames.iter().filter(|f| f.from == 0).count(), 9);
        assert_eq!(frames.iter().filter(|f| f.from == 1).count(), 0);
        assert!(frames.iter().all(|f| !f.ack_req));
        assert_eq!(net.nodes[0].hca.counters().retransmits, 0);
        assert_eq!(net.state(&a), QpState::Rts);
        assert_eq!(net.state(&b), QpState::Rts);
    }
}

#[test]
fn uc_lost_write_with_immediate_consumes_no_receive() {
    let mut net = net("uc_write_imm", Impairments::NONE, 23);
    let (a, b) = pair(&mut net, &uc());
    let ma = net.reg(&a, 8192, ALL_ACCESS, 0);
    let mb = net.reg(&b, 8192, ALL_ACCESS, 0xcc);
    let data = pattern(8, 2048);
    net.fill(&ma, 0, &data);
    net.post_recv(&b, recv(60, &[])).unwrap();
    let psn0 = net.nodes[0].hca.query_qp(a.qpn).unwrap().sq_psn;
    // The LAST packet (with the immediate) of the first write is lost.
    drop_psn(&mut net, psn0.add(1));
    for (i, off) in [(1u64, 0usize), (2, 4096)] {
        let op = SendOp::WriteWithImm { remote_addr: mb.at(off), rkey: mb.key, imm: i as u32 };
        net.post_send(&a, wr(i, op, &[ma.sge(0, 2048)])).unwrap();
    }
    net.settle();
    let r = net.recv_wcs(&b);
    assert_wcs(&r, &[(60, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 2048)]);
    assert_eq!(r[0].imm, 2);
    assert_eq!(&net.bytes(&mb)[4096..4096 + 2048], &data[..]);
    assert_wcs(
        &net.send_wcs(&a),
        &[(1, WcStatus::Success, WcOpcode::RdmaWrite, 2048), (2, WcStatus::Success, WcOpcode::RdmaWrite, 2048)],
    );
}

fn ud_dest(net: &Net, node: usize, qpn: softrdma_wire::Qpn, qkey: u32) -> UdDest {
    UdDest {
        av: AddressVector { dgid: net.nodes[node].gid, hop_limit: 64, ..Default::default() },
        remote_qpn: qpn,
        remote_qkey: qkey,
    }
}

const QKEY: u32 = 0x1111_1111; // what Net::bring_up gives UD QPs

#[test]
fn ud_grh_qkey_src_qp_and_immediate() {
    let mut net = net("ud", Impairments::NONE, 24);
    let o = ConnOpts { qp_type: QpType::Ud, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 16384, ALL_ACCESS, 0);
    let mb = net.reg(&b, 16384, ALL_ACCESS, 0xdd);
    let data = pattern(11, 4096);
    net.fill(&ma, 0, &data);
    for i in 0..3 {
        net.post_recv(&b, recv(70 + i as u64, &[mb.sge(i * 4200, 4200)])).unwrap();
    }
    let send = |id, op, len, qkey, net: &mut Net| {
        let mut w = wr(id, op, &[ma.sge(0, len)]);
        w.ud = Some(ud_dest(net, 1, b.qpn, qkey));
        net.post_send(&a, w).unwrap();
    };
    send(1, SendOp::Send, 100, QKEY, &mut net);
    send(2, SendOp::Send, 100, 0x2222_2222, &mut net); // wrong Q_Key: dropped
    send(3, SendOp::SendWithImm(0xabcd_ef01), 4096, QKEY, &mut net); // a full MTU
    send(4, SendOp::Send, 7, 0x8000_0000, &mut net); // "use the QP's Q_Key"
    send(5, SendOp::Send, 4097, QKEY, &mut net); // larger than the MTU
    send(6, SendOp::Send, 1, QKEY, &mut net);
    net.settle();
    assert_wcs(
        &net.send_wcs(&a),
        &[
            (1, WcStatus::Success, WcOpcode::Send, 100),
            (2, WcStatus::Success, WcOpcode::Send, 100),
            (3, WcStatus::Success, WcOpcode::Send, 4096),
            (4, WcStatus::Success, WcOpcode::Send, 7),
            (5, WcStatus::LocLenErr, WcOpcode::Send, 0),
            (6, WcStatus::WrFlushErr, WcOpcode::Send, 0),
        ],
    );
    assert_eq!(net.state(&a), QpState::Sqe);
    let r = net.recv_wcs(&b);
    assert_wcs(
        &r,
        &[
            (70, WcStatus::Success, WcOpcode::Recv, 140),
            (71, WcStatus::Success, WcOpcode::Recv, 4136),
            (72, WcStatus::Success, WcOpcode::Recv, 47),
        ],
    );
    for wc in &r {
        assert_eq!(wc.src_qp, a.qpn);
        assert_eq!(wc.qp_num, b.qpn);
        assert!(wc.flags.contains(WcFlags::GRH));
    }
    assert_eq!(r[0].flags, WcFlags::GRH);
    assert_eq!(r[1].flags, WcFlags::GRH.with(WcFlags::WITH_IMM));
    assert_eq!(r[1].imm, 0xabcd_ef01);
    assert_eq!(net.nodes[1].hca.counters().drop_qkey, 1);

    // One packet per message: SEND_ONLY / SEND_ONLY_IMM, and the 40-byte GRH area in front of
    // the data (RoCEv2 over IPv4: 20 zero bytes, then the IPv4 header of the packet).
    let frames = net.frames();
    let sent: Vec<_> = frames.iter().filter(|f| f.from == 0).collect();
    assert_eq!(sent.len(), 4);
    assert!(sent.iter().all(|f| f.is(Flags::ONLY) && f.is(Flags::SEND)));
    assert_eq!(sent[2].base, base::SEND_ONLY_IMM);
    let m = net.bytes(&mb);
    for (i, (len, frame)) in [(100usize, sent[0]), (4096, sent[2]), (7, sent[3])].into_iter().enumerate() {
        let buf = &m[i * 4200..];
        assert_eq!(&buf[..20], &[0u8; 20]);
        let mut ip = [0u8; 20];
        softrdma_wire::Ipv4Repr {
            src_addr: [10, 0, 0, 1].into(),
            dst_addr: [10, 0, 0, 2].into(),
            protocol: 17,
            payload_len: 8 + frame.raw.len(),
            ttl: 64,
            tos: 0,
            ident: 0,
            dont_frag: true,
        }
        .emit(&mut ip)
        .unwrap();
        assert_eq!(&buf[20..40], &ip[..]);
        assert_eq!(&buf[40..40 + len], &data[..len]);
        assert!(buf[40 + len..4200].iter().all(|&x| x == 0xdd));
    }

    // SQE only stops sending: A still receives.
    let mut w = wr(9, SendOp::Send, &[mb.sge(0, 3)]);
    w.ud = Some(ud_dest(&net, 0, a.qpn, QKEY));
    net.post_recv(&a, recv(80, &[ma.sge(8192, 100)])).unwrap();
    net.post_send(&b, w).unwrap();
    net.settle();
    assert_wcs(&net.recv_wcs(&a), &[(80, WcStatus::Success, WcOpcode::Recv, 43)]);
    assert_eq!(net.recv_wcs(&a), vec![]);
}

#[test]
fn ud_receive_too_small_and_no_receive() {
    let mut net = net("ud_small", Impairments::NONE, 25);
    let o = ConnOpts { qp_type: QpType::Ud, ..ConnOpts::default() };
    let (a, b) = pair(&mut net, &o);
    let ma = net.reg(&a, 4096, ALL_ACCESS, 0);
    let mb = net.reg(&b, 4096, ALL_ACCESS, 0xdd);
    // Room for the GRH and 59 bytes: a 60-byte message does not fit.
    net.post_recv(&b, recv(1, &[mb.sge(0, 99)])).unwrap();
    for id in [1, 2] {
        let mut w = wr(id, SendOp::Send, &[ma.sge(0, 60)]);
        w.ud = Some(ud_dest(&net, 1, b.qpn, QKEY));
        net.post_send(&a, w).unwrap();
    }
    net.settle();
    assert_wcs(&net.recv_wcs(&b), &[(1, WcStatus::LocLenErr, WcOpcode::Recv, 0)]);
    assert!(net.bytes(&mb)[99..].iter().all(|&x| x == 0xdd));
    assert_eq!(net.nodes[1].hca.counters().drop_no_recv, 1);
    assert_eq!(net.state(&b), QpState::Rts);
}
