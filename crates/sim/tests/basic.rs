//! Every operation once over a perfect network, with byte and completion checks.

use core::time::Duration;
use softrdma_sim::{ConnOpts, Impairments, Net};
use softrdma_transport::wr::Payload;
use softrdma_transport::{Access, Config, RecvWr, SendFlags, SendOp, SendWr, Sge, WcFlags, WcOpcode, WcStatus};

fn all_access() -> Access {
    Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC)
}

#[test]
fn every_operation_once() {
    let mut net = Net::new(2, Config::default(), Impairments::NONE, 1);
    let o = ConnOpts::default();
    let (a, b) = net.connect(0, 1, &o);
    let (ka, va) = net.nodes[0].mem.register(a.pd, 1 << 16, all_access());
    let (kb, vb) = net.nodes[1].mem.register(b.pd, 1 << 16, all_access());
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    net.nodes[0].mem.region_mut(ka).bytes[..5000].copy_from_slice(&data);

    // SEND with immediate, 5000 bytes = 5 packets at MTU 1024.
    net.post_recv(&b, RecvWr { wr_id: 100, sgl: vec![Sge { addr: vb, length: 8192, lkey: kb }].into() }).unwrap();
    let sgl = vec![Sge { addr: va, length: 5000, lkey: ka }];
    net.post_send(
        &a,
        SendWr {
            wr_id: 1,
            op: SendOp::SendWithImm(0x1122_3344),
            payload: Payload::Sgl(sgl.clone().into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    )
    .unwrap();
    // WRITE to offset 8192.
    net.post_send(
        &a,
        SendWr {
            wr_id: 2,
            op: SendOp::Write { remote_addr: vb + 8192, rkey: kb },
            payload: Payload::Sgl(sgl.clone().into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    )
    .unwrap();
    // READ it back into A at offset 16384.
    net.post_send(
        &a,
        SendWr {
            wr_id: 3,
            op: SendOp::Read { remote_addr: vb + 8192, rkey: kb },
            payload: Payload::Sgl(vec![Sge { addr: va + 16384, length: 5000, lkey: ka }].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    )
    .unwrap();
    // FETCH_ADD and CMP_SWAP on B's word at 32768.
    net.nodes[1].mem.region_mut(kb).bytes[32768..32776].copy_from_slice(&40u64.to_ne_bytes());
    net.post_send(
        &a,
        SendWr {
            wr_id: 4,
            op: SendOp::FetchAdd { remote_addr: vb + 32768, rkey: kb, add: 2 },
            payload: Payload::Sgl(vec![Sge { addr: va + 32768, length: 8, lkey: ka }].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    )
    .unwrap();
    net.post_send(
        &a,
        SendWr {
            wr_id: 5,
            op: SendOp::CompareSwap { remote_addr: vb + 32768, rkey: kb, compare: 42, swap: 7 },
            payload: Payload::Sgl(vec![Sge { addr: va + 32776, length: 8, lkey: ka }].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    )
    .unwrap();
    // WRITE with immediate needs a receive.
    net.post_recv(&b, RecvWr { wr_id: 101, sgl: vec![].into() }).unwrap();
    net.post_send(
        &a,
        SendWr {
            wr_id: 6,
            op: SendOp::WriteWithImm { remote_addr: vb + 40000, rkey: kb, imm: 0x5566_7788 },
            payload: Payload::Inline(b"inline!".to_vec()),
            flags: SendFlags::SIGNALED.with(SendFlags::INLINE),
            ud: None,
        },
    )
    .unwrap();

    net.run_idle(Duration::from_secs(1));
    let sc = net.poll(0, a.scq);
    let ids: Vec<_> = sc.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(
        ids,
        vec![
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaWrite),
            (3, WcStatus::Success, WcOpcode::RdmaRead),
            (4, WcStatus::Success, WcOpcode::FetchAdd),
            (5, WcStatus::Success, WcOpcode::CompSwap),
            (6, WcStatus::Success, WcOpcode::RdmaWrite),
        ]
    );
    let rc = net.poll(1, b.rcq);
    assert_eq!(rc.len(), 2);
    assert_eq!((rc[0].wr_id, rc[0].status, rc[0].byte_len, rc[0].imm), (100, WcStatus::Success, 5000, 0x1122_3344));
    assert!(rc[0].flags.contains(WcFlags::WITH_IMM));
    assert_eq!(
        (rc[1].wr_id, rc[1].opcode, rc[1].byte_len, rc[1].imm),
        (101, WcOpcode::RecvRdmaWithImm, 7, 0x5566_7788)
    );
    let bm = &net.nodes[1].mem.region(kb).bytes;
    assert_eq!(&bm[..5000], &data[..]);
    assert_eq!(&bm[8192..13192], &data[..]);
    assert_eq!(&bm[40000..40007], b"inline!");
    assert_eq!(u64::from_ne_bytes(bm[32768..32776].try_into().unwrap()), 7);
    let am = &net.nodes[0].mem.region(ka).bytes;
    assert_eq!(&am[16384..21384], &data[..]);
    assert_eq!(u64::from_ne_bytes(am[32768..32776].try_into().unwrap()), 40);
    assert_eq!(u64::from_ne_bytes(am[32776..32784].try_into().unwrap()), 42);
}
