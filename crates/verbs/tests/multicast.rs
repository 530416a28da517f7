//! UD multicast between embedded devices: every QP attached to the group gets its own copy of
//! each message, byte for byte, with the group as the destination in its GRH area; a detached or
//! destroyed QP gets nothing more.
//!
//! The test runs in a network namespace of its own (`unshare(CLONE_NEWNET)` on its thread, whose
//! devices' sockets and I/O threads then live there), so packets sent to the group never reach an
//! interface of the host. That needs CAP_SYS_ADMIN (CI runs as root); without it the test says so
//! and checks nothing.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use softrdma_verbs::{
    Access, AhAttr, CompletionQueue, Context, DeviceBuilder, Gid, Payload, ProtectionDomain, Psn, QpCap, QpInitAttr,
    QpType, Qpn, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};

const QKEY: u32 = 0x1111_1111;
const PORT: u16 = 48900;
/// The group 239.7.7.7 as an MGID.
const GROUP: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 7, 7, 7];

/// Move this thread into a new network namespace with its loopback interface up.
fn own_netns() -> bool {
    // SAFETY: unshare(2) with a flag; it changes only this thread's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        eprintln!("not run: a network namespace of its own needs CAP_SYS_ADMIN");
        return false;
    }
    // SAFETY: an ioctl socket and SIOCGIFFLAGS/SIOCSIFFLAGS on a zeroed ifreq naming "lo".
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        assert!(fd >= 0);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *d = *s as libc::c_char;
        }
        assert_eq!(libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req), 0);
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        assert_eq!(libc::ioctl(fd, libc::SIOCSIFFLAGS, &req), 0);
        libc::close(fd);
    }
    true
}

fn open(last: u8) -> Context {
    DeviceBuilder::new(&format!("m{last}"), "lo")
        .addr(IpAddr::V4(Ipv4Addr::new(127, 0, 9, last)))
        .udp_port(PORT)
        .open()
        .expect("open device")
}

struct Ud {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn ud(ctx: &Context, qp_type: QpType) -> Ud {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let qp =
        pd.create_qp(&QpInitAttr { qp_type, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false }).unwrap();
    if qp_type == QpType::Ud {
        qp.bring_up_ud(QKEY, Psn::new(1)).unwrap();
    }
    Ud { pd, cq, qp }
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).unwrap();
        assert!(start.elapsed() < Duration::from_secs(30), "timed out with {out:?}");
        std::thread::yield_now();
    }
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// Post a receive of 40 + 512 bytes at offset 0 of a fresh region; returns the region.
fn expect_one(r: &Ud) -> softrdma_verbs::MemoryRegion {
    let mr = r.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    r.qp.post_recv(RecvWr { wr_id: 7, sgl: vec![mr.sge(0, 40 + 512).unwrap()].into() }).unwrap();
    mr
}

fn send_to_group(s: &Ud, mr: &softrdma_verbs::MemoryRegion, data: &[u8], imm: u32) {
    mr.write(0, data).unwrap();
    let ah = s.pd.create_ah(&AhAttr::new(Gid(GROUP), 1)).unwrap();
    s.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::SendWithImm(imm),
        payload: Payload::Sgl(vec![mr.sge(0, data.len()).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: Some(ah.ud(Qpn::MULTICAST, QKEY)),
    })
    .unwrap();
    assert_eq!(wait(&s.cq, 1)[0].status, WcStatus::Success);
}

/// The receive `mr` got: the SEND's bytes after a GRH area from 127.0.9.1 to the group.
fn check(r: &Ud, mr: &softrdma_verbs::MemoryRegion, from: Qpn, data: &[u8], imm: u32) {
    let wc = wait(&r.cq, 1);
    assert_eq!(
        (wc[0].status, wc[0].byte_len, wc[0].src_qp, wc[0].imm),
        (WcStatus::Success, 40 + data.len() as u32, from, imm)
    );
    assert_eq!(mr.to_vec(40, data.len()).unwrap(), data);
    let grh = mr.to_vec(0, 40).unwrap();
    assert_eq!(grh[20], 0x45, "IPv4 header in the second half of the GRH area");
    assert_eq!(&grh[32..36], &[127, 0, 9, 1], "source address");
    assert_eq!(&grh[36..40], &[239, 7, 7, 7], "destination address: the group");
}

#[test]
fn every_attached_qp_receives_its_own_copy() {
    if !own_netns() {
        return;
    }
    let (a, b, c) = (open(1), open(2), open(3));
    let sender = ud(&a, QpType::Ud);
    // A QP of the sending device, two QPs of one device, one of another.
    let (a2, b1, c1, c2) = (ud(&a, QpType::Ud), ud(&b, QpType::Ud), ud(&c, QpType::Ud), ud(&c, QpType::Ud));
    for r in [&a2, &b1, &c1, &c2] {
        r.qp.attach_mcast(Gid(GROUP)).unwrap();
    }
    b1.qp.attach_mcast(Gid(GROUP)).unwrap();
    let smr = sender.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let data = pattern(512, 3);
    let mrs: Vec<_> = [&a2, &b1, &c1, &c2].iter().map(|r| expect_one(r)).collect();
    send_to_group(&sender, &smr, &data, 0x51);
    for (r, mr) in [&a2, &b1, &c1, &c2].iter().zip(&mrs) {
        check(r, mr, sender.qp.qpn(), &data, 0x51);
    }

    // Detached, b1 receives nothing more; dropped, c2 neither. The others still do.
    b1.qp.detach_mcast(Gid(GROUP)).unwrap();
    assert!(b1.qp.detach_mcast(Gid(GROUP)).is_err(), "detaching twice is refused");
    let b_mr = expect_one(&b1);
    let c2_rcvd = c.counters().rcvd_pkts;
    drop(c2);
    let mrs: Vec<_> = [&a2, &c1].iter().map(|r| expect_one(r)).collect();
    let data = pattern(512, 4);
    send_to_group(&sender, &smr, &data, 0x52);
    for (r, mr) in [&a2, &c1].iter().zip(&mrs) {
        check(r, mr, sender.qp.qpn(), &data, 0x52);
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut none = Vec::new();
    b1.cq.poll(1, &mut none).unwrap();
    assert!(none.is_empty(), "a detached QP got {none:?}");
    assert_eq!(b_mr.to_vec(40, 512).unwrap(), vec![0; 512]);
    assert_eq!(c.counters().rcvd_pkts, c2_rcvd + 1, "one copy for c1, none for the destroyed c2");

    // The last QP of a device leaves: the device no longer listens to the group.
    drop(c1);
    let mr = expect_one(&a2);
    send_to_group(&sender, &smr, &data, 0x53);
    check(&a2, &mr, sender.qp.qpn(), &data, 0x53);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.counters().rcvd_pkts, c2_rcvd + 1, "device c left the group");
}

#[test]
fn attaching_needs_a_ud_qp_and_a_multicast_gid() {
    if !own_netns() {
        return;
    }
    let a = open(1);
    let rc = ud(&a, QpType::Rc);
    assert!(rc.qp.attach_mcast(Gid(GROUP)).unwrap_err().to_string().contains("UD"));
    let q = ud(&a, QpType::Ud);
    let unicast = Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 9, 2]);
    assert!(q.qp.attach_mcast(unicast).unwrap_err().to_string().contains("multicast"));
    assert!(q.qp.detach_mcast(Gid(GROUP)).is_err(), "not attached");
    // An IPv6 group on a device with no IPv6 address: refused, and nothing stays attached.
    let v6 = Gid([0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
    assert!(q.qp.attach_mcast(v6).unwrap_err().to_string().contains("no IPv6 address"));
    assert!(q.qp.detach_mcast(v6).is_err());
}

/// 32 SENDs of distinct payloads posted at once, in runs of one size (sent as GSO batches, which
/// the group's socket receives coalesced) and alternating sizes (datagrams one by one, several per
/// receive call): each receiver gets each payload once, in order.
#[test]
fn a_burst_arrives_whole_and_in_order() {
    if !own_netns() {
        return;
    }
    const N: usize = 32;
    // 16 of 512 bytes, then 16 alternating between 300 and 400.
    let len = |i: usize| if i < 16 { 512 } else { 300 + 100 * (i % 2) };
    let (a, b) = (open(1), open(2));
    let sender = ud(&a, QpType::Ud);
    let (r1, r2) = (ud(&b, QpType::Ud), ud(&b, QpType::Ud));
    let mut mrs = Vec::new();
    for r in [&r1, &r2] {
        r.qp.attach_mcast(Gid(GROUP)).unwrap();
        let mr = r.pd.reg_mr(N * 1024, Access::LOCAL_WRITE).unwrap();
        for i in 0..N {
            r.qp.post_recv(RecvWr { wr_id: i as u64, sgl: vec![mr.sge(i * 1024, 40 + 512).unwrap()].into() }).unwrap();
        }
        mrs.push(mr);
    }
    let smr = sender.pd.reg_mr(N * 512, Access::LOCAL_WRITE).unwrap();
    let ah = sender.pd.create_ah(&AhAttr::new(Gid(GROUP), 1)).unwrap();
    let wrs: Vec<SendWr> = (0..N)
        .map(|i| {
            smr.write(i * 512, &pattern(len(i), i as u8)).unwrap();
            SendWr {
                wr_id: i as u64,
                op: SendOp::Send,
                payload: Payload::Sgl(vec![smr.sge(i * 512, len(i)).unwrap()].into()),
                flags: SendFlags::SIGNALED,
                ud: Some(ah.ud(Qpn::MULTICAST, QKEY)),
            }
        })
        .collect();
    sender.qp.post_send_list(wrs).unwrap();
    assert!(wait(&sender.cq, N).iter().all(|w| w.status == WcStatus::Success));
    for (r, mr) in [&r1, &r2].iter().zip(&mrs) {
        let wcs = wait(&r.cq, N);
        assert_eq!(
            wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            (0..N as u64).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
        );
        for (i, wc) in wcs.iter().enumerate() {
            assert_eq!(wc.byte_len as usize, 40 + len(i), "message {i}");
            assert_eq!(mr.to_vec(i * 1024 + 40, len(i)).unwrap(), pattern(len(i), i as u8), "message {i}");
        }
    }
}

/// An IPv6 group over a veth pair (Linux routes no IPv6 multicast over the loopback interface):
/// a device on each end, a QP on each attached to the link-local group ff02::1:5 (its socket bound
/// with the interface as scope). The sender's own QP gets its copy through the kernel's multicast
/// loopback, the peer's over the wire, with the IPv6 addresses in the GRH area.
#[test]
fn an_ipv6_link_local_group_over_a_veth_pair() {
    if !own_netns() {
        return;
    }
    common::private_sysfs().expect("a sysfs of this namespace");
    for cmd in [
        "ip link add d0 type veth peer name d1",
        "ip link set d0 up",
        "ip link set d1 up",
        "ip -6 addr add fd00::1/64 dev d0 nodad",
        "ip -6 addr add fd00::2/64 dev d1 nodad",
    ] {
        common::sh(&cmd.split(' ').collect::<Vec<_>>()).expect("set up the veth pair");
    }
    let group = Gid([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 5]);
    let open6 = |name: &str, netdev: &str, ip: Ipv6Addr| {
        DeviceBuilder::new(name, netdev).addr(IpAddr::V6(ip)).udp_port(PORT).open().expect("open device")
    };
    let (a_ip, b_ip) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
    let (a, b) = (open6("m6a", "d0", a_ip), open6("m6b", "d1", b_ip));
    let (s, ra, rb) = (ud(&a, QpType::Ud), ud(&a, QpType::Ud), ud(&b, QpType::Ud));
    ra.qp.attach_mcast(group).unwrap();
    rb.qp.attach_mcast(group).unwrap();
    let (ma, mb) = (expect_one(&ra), expect_one(&rb));
    let data = pattern(512, 6);
    let smr = s.pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    smr.write(0, &data).unwrap();
    let own = Gid::from_ip(IpAddr::V6(a_ip));
    let sgid = (0..16u8).find(|&i| a.query_gid(1, usize::from(i)).is_ok_and(|g| g == own)).expect("fd00::1's GID");
    let ah = s.pd.create_ah(&AhAttr::new(group, sgid)).unwrap();
    s.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Sgl(vec![smr.sge(0, 512).unwrap()].into()),
        flags: SendFlags::SIGNALED,
        ud: Some(ah.ud(Qpn::MULTICAST, QKEY)),
    })
    .unwrap();
    assert_eq!(wait(&s.cq, 1)[0].status, WcStatus::Success);
    for (r, mr) in [(&ra, &ma), (&rb, &mb)] {
        let wc = wait(&r.cq, 1);
        assert_eq!((wc[0].status, wc[0].byte_len, wc[0].src_qp), (WcStatus::Success, 40 + 512, s.qp.qpn()));
        assert_eq!(mr.to_vec(40, 512).unwrap(), data);
        let grh = mr.to_vec(0, 40).unwrap();
        assert_eq!(&grh[8..24], &a_ip.octets(), "source GID");
        assert_eq!(&grh[24..40], &group.0, "destination GID: the group");
    }
}

/// An IPv6 group of interface-local scope (perftest's default MGID) is joined on the device's
/// interface (its socket bound with the interface as scope, which Linux requires). Linux routes
/// no IPv6 multicast over the loopback interface, so nothing is sent here.
#[test]
fn an_ipv6_interface_local_group_is_joined() {
    if !own_netns() {
        return;
    }
    let group = Gid([0xff, 0x01, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 0]);
    let ctx = DeviceBuilder::new("m6", "lo")
        .addr(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST))
        .udp_port(PORT)
        .open()
        .expect("open device");
    let r = ud(&ctx, QpType::Ud);
    r.qp.attach_mcast(group).unwrap();
    r.qp.detach_mcast(group).unwrap();
    let v4 = r.qp.attach_mcast(Gid(GROUP)).unwrap_err().to_string();
    assert!(v4.contains("no IPv4 address"), "{v4}");
}
