//! Remote access errors (NAKed by the responder, which goes to ERR with an async event) and local
//! errors (lkey, receive length), with guard bytes around every buffer.

use softrdma_sim::steps::*;
use softrdma_sim::{ConnOpts, Impairments};
use softrdma_transport::{Access, AsyncEvent, QpState, SendOp, WcOpcode, WcStatus};

use crate::{net, pair};

const GA: u8 = 0xa5;
const GB: u8 = 0xb6;

/// What the bad work request targets at B.
struct Case {
    name: &'static str,
    /// Rights of B's target region.
    mr_access: Access,
    /// Remote rights of B's QP.
    qp_access: Access,
    /// The failing operation, given B's region (its key and address) and A's buffer.
    op: fn(&Mr) -> (SendOp, usize),
    status: WcStatus,
    event: fn(softrdma_wire::Qpn) -> AsyncEvent,
}

const MR_LEN: usize = 4096;

fn cases() -> Vec<Case> {
    let rw = Access::REMOTE_READ.with(Access::REMOTE_WRITE);
    let all = ALL_ACCESS;
    vec![
        Case {
            name: "bad_rkey",
            mr_access: all,
            qp_access: all,
            op: |m| (SendOp::Write { remote_addr: m.at(0), rkey: m.key ^ 0x5500 }, 64),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "write_to_read_only_mr",
            mr_access: Access::LOCAL_WRITE.with(Access::REMOTE_READ),
            qp_access: all,
            op: |m| (SendOp::Write { remote_addr: m.at(0), rkey: m.key }, 2500),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "read_from_write_only_mr",
            mr_access: Access::LOCAL_WRITE.with(Access::REMOTE_WRITE),
            qp_access: all,
            op: |m| (SendOp::Read { remote_addr: m.at(0), rkey: m.key }, 100),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "write_one_byte_past_the_end",
            mr_access: all,
            qp_access: all,
            op: |m| (SendOp::Write { remote_addr: m.at(MR_LEN - 99), rkey: m.key }, 100),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "read_one_byte_past_the_end",
            mr_access: all,
            qp_access: all,
            op: |m| (SendOp::Read { remote_addr: m.at(1), rkey: m.key }, MR_LEN),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "atomic_on_mr_without_remote_atomic",
            mr_access: Access::LOCAL_WRITE.with(rw),
            qp_access: all,
            op: |m| (SendOp::FetchAdd { remote_addr: m.at(8), rkey: m.key, add: 1 }, 8),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "misaligned_atomic",
            mr_access: all,
            qp_access: all,
            op: |m| {
                (
                    SendOp::CompareSwap {
                        remote_addr: m.at(12),
                        rkey: m.key,
                        compare: u64::from_ne_bytes([GB; 8]),
                        swap: 0,
                    },
                    8,
                )
            },
            status: WcStatus::RemInvReqErr,
            event: AsyncEvent::QpRequestError,
        },
        Case {
            name: "write_to_qp_without_remote_write",
            mr_access: all,
            qp_access: Access::REMOTE_READ.with(Access::REMOTE_ATOMIC),
            op: |m| (SendOp::Write { remote_addr: m.at(0), rkey: m.key }, 10),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "read_from_qp_without_remote_access",
            mr_access: all,
            qp_access: Access::NONE,
            op: |m| (SendOp::Read { remote_addr: m.at(0), rkey: m.key }, 10),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
        Case {
            name: "atomic_on_qp_without_remote_atomic",
            mr_access: all,
            qp_access: Access::REMOTE_READ.with(Access::REMOTE_WRITE),
            op: |m| (SendOp::FetchAdd { remote_addr: m.at(0), rkey: m.key, add: 5 }, 8),
            status: WcStatus::RemAccessErr,
            event: AsyncEvent::QpAccessError,
        },
    ]
}

fn opcode_of(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
        SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        _ => WcOpcode::Send,
    }
}

#[test]
fn remote_access_errors() {
    for c in cases() {
        let mut net = net(c.name, Impairments::NONE, 10);
        let o = ConnOpts { access: c.qp_access, ..ConnOpts::default() };
        let (a, b) = pair(&mut net, &o);
        let ma = net.reg(&a, 8192, ALL_ACCESS, GA);
        let target = net.reg(&b, MR_LEN, c.mr_access, GB);
        let rbuf = net.reg(&b, 4096, ALL_ACCESS, GB);
        let data = pattern(7, 4096);
        net.fill(&ma, 0, &data);
        net.post_recv(&b, recv(50, &[rbuf.sge(0, 4096)])).unwrap();
        net.post_recv(&b, recv(51, &[rbuf.sge(0, 4096)])).unwrap();
        let (op, len) = (c.op)(&target);
        // The bad request's local buffer sits at A's offset 4096 (guarded).
        net.post_send(&a, wr(1, op, &[ma.sge(4096, len)])).unwrap();
        net.post_send(&a, wr(2, SendOp::Send, &[ma.sge(0, 10)])).unwrap();
        let w = SendOp::Write { remote_addr: rbuf.at(0), rkey: rbuf.key };
        net.post_send(&a, unsignaled(wr(3, w, &[ma.sge(0, 10)]))).unwrap();
        net.settle();

        let ctx = c.name;
        assert_wcs(
            &net.send_wcs(&a),
            &[
                (1, c.status, opcode_of(&op), 0),
                (2, WcStatus::WrFlushErr, WcOpcode::Send, 0),
                (3, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
            ],
        );
        assert_eq!(net.state(&a), QpState::Err, "{ctx}");
        assert_eq!(net.state(&b), QpState::Err, "{ctx}");
        assert_eq!(net.events(1), vec![(c.event)(b.qpn)], "{ctx}");
        assert_eq!(net.events(0), vec![], "{ctx}");
        assert_wcs(
            &net.recv_wcs(&b),
            &[(50, WcStatus::WrFlushErr, WcOpcode::Recv, 0), (51, WcStatus::WrFlushErr, WcOpcode::Recv, 0)],
        );
        assert_wcs(&net.recv_wcs(&a), &[]);
        // Nothing outside what was allowed changed: B's regions are all guard bytes, and A's
        // result buffer too (a failed read or atomic delivers nothing).
        assert!(net.bytes(&target).iter().all(|&x| x == GB), "{ctx}: target");
        assert!(net.bytes(&rbuf).iter().all(|&x| x == GB), "{ctx}: rbuf");
        assert!(net.bytes(&ma)[4096..].iter().all(|&x| x == GA), "{ctx}: A");
        assert_eq!(&net.bytes(&ma)[..4096], &data[..], "{ctx}");
        assert_eq!(net.nodes[1].hca.counters().send_err_nak, 1, "{ctx}");
        assert_eq!(net.nodes[0].hca.counters().rcvd_err_nak, 1, "{ctx}");
    }
}

/// A good operation before the bad one completes; the ERR that follows flushes the rest in order.
#[test]
fn good_work_before_a_remote_error_completes() {
    let mut net = net("good_then_bad", Impairments::NONE, 11);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 8192, ALL_ACCESS, GA);
    let mb = net.reg(&b, 4096, ALL_ACCESS, GB);
    let data = pattern(2, 3000);
    net.fill(&ma, 0, &data);
    let good = SendOp::Write { remote_addr: mb.at(0), rkey: mb.key };
    let bad = SendOp::Write { remote_addr: mb.at(4000), rkey: mb.key };
    net.post_send(&a, wr(1, good, &[ma.sge(0, 3000)])).unwrap();
    net.post_send(&a, wr(2, bad, &[ma.sge(0, 97)])).unwrap();
    net.post_send(&a, wr(3, good, &[ma.sge(0, 5)])).unwrap();
    net.settle();
    assert_wcs(
        &net.send_wcs(&a),
        &[
            (1, WcStatus::Success, WcOpcode::RdmaWrite, 3000),
            (2, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, 0),
            (3, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
        ],
    );
    let m = net.bytes(&mb);
    assert_eq!(&m[..3000], &data[..]);
    assert!(m[3000..].iter().all(|&x| x == GB));
}

#[test]
fn bad_lkey_is_a_local_protection_error() {
    let mut net = net("bad_lkey", Impairments::NONE, 12);
    let (a, b) = pair(&mut net, &ConnOpts::default());
    let ma = net.reg(&a, 4096, ALL_ACCESS, GA);
    let mb = net.reg(&b, 4096, ALL_ACCESS, GB);
    net.post_recv(&b, recv(50, &[mb.sge(0, 4096)])).unwrap();
    net.post_recv(&b, recv(51, &[mb.sge(0, 4096)])).unwrap();
    let mut bad = ma.sge(0, 100);
    bad.lkey ^= 0x4400;
    net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 100)])).unwrap();
    net.post_send(&a, unsignaled(wr(2, SendOp::Send, &[bad]))).unwrap();
    net.post_send(&a, wr(3, SendOp::Send, &[ma.sge(0, 100)])).unwrap();
    // A read into a region without LOCAL_WRITE is a local protection error too.
    let ro = net.reg(&a, 64, Access::NONE, GA);
    net.settle();
    assert_wcs(
        &net.send_wcs(&a),
        &[
            (1, WcStatus::Success, WcOpcode::Send, 100),
            (2, WcStatus::LocProtErr, WcOpcode::Send, 0),
            (3, WcStatus::WrFlushErr, WcOpcode::Send, 0),
        ],
    );
    assert_eq!(net.state(&a), QpState::Err);
    assert_eq!(net.state(&b), QpState::Rts);
    assert_wcs(&net.recv_wcs(&b), &[(50, WcStatus::Success, WcOpcode::Recv, 100)]);

    let (a, b) = pair(&mut net, &ConnOpts::default());
    let read = SendOp::Read { remote_addr: mb.at(0), rkey: mb.key };
    net.post_send(&a, wr(7, read, &[ro.sge(0, 64)])).unwrap();
    net.settle();
    assert_wcs(&net.send_wcs(&a), &[(7, WcStatus::LocProtErr, WcOpcode::RdmaRead, 0)]);
    assert!(net.bytes(&ro).iter().all(|&x| x == GA));
    assert_eq!(net.state(&b), QpState::Rts);
}

#[test]
fn receive_buffer_too_small() {
    for len in [1500usize, 800] {
        let mut net = net(&format!("recv_too_small_{len}"), Impairments::NONE, 13);
        let (a, b) = pair(&mut net, &ConnOpts::default());
        let ma = net.reg(&a, 4096, ALL_ACCESS, GA);
        let mb = net.reg(&b, 8192, ALL_ACCESS, GB);
        let data = pattern(5, 3000);
        net.fill(&ma, 0, &data);
        // The receive buffer is mb[1000..1000+len]; everything else in mb is guard.
        net.post_recv(&b, recv(50, &[mb.sge(1000, len)])).unwrap();
        net.post_recv(&b, recv(51, &[mb.sge(5000, 3000)])).unwrap();
        net.post_send(&a, wr(1, SendOp::Send, &[ma.sge(0, 3000)])).unwrap();
        net.post_send(&a, wr(2, SendOp::Send, &[ma.sge(0, 10)])).unwrap();
        net.settle();
        assert_wcs(
            &net.send_wcs(&a),
            &[(1, WcStatus::RemInvReqErr, WcOpcode::Send, 0), (2, WcStatus::WrFlushErr, WcOpcode::Send, 0)],
        );
        assert_wcs(
            &net.recv_wcs(&b),
            &[(50, WcStatus::LocLenErr, WcOpcode::Recv, 0), (51, WcStatus::WrFlushErr, WcOpcode::Recv, 0)],
        );
        assert_eq!(net.state(&b), QpState::Err);
        assert_eq!(net.state(&a), QpState::Err);
        assert_eq!(net.events(1), vec![AsyncEvent::QpRequestError(b.qpn)]);
        let m = net.bytes(&mb);
        assert!(m[..1000].iter().all(|&x| x == GB));
        assert!(m[1000 + len..].iter().all(|&x| x == GB));
    }
}
