//! Every RoCE packet of every golden capture (Linux rdma_rxe, and a host-side Python peer): it
//! parses, its ICRC verifies, our emit reproduces the kernel's bytes exactly, and the IPv4
//! identification a UDP socket hides can be recovered from the ICRC.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use softrdma_wire::capture::{classify, Classified, PcapReader};
use softrdma_wire::cm::{attr, CmMessage};
use softrdma_wire::mad::{GSI_QKEY, MAD_LEN};
use softrdma_wire::roce::{verify_udp_payload, IpRepr, RoceV2Packet, UdpVerdict, VerifyStats};
use softrdma_wire::IbRepr;

fn golden_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (../shared must be beside the repository)", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pcap"))
        .collect();
    v.sort();
    assert!(v.len() >= 20);
    v
}

/// Call `f` with every RoCEv2 IP packet of every golden capture.
fn for_each_roce(mut f: impl FnMut(&Path, usize, &[u8])) -> usize {
    let mut n = 0;
    for path in golden_files() {
        let data = std::fs::read(&path).unwrap();
        let r = PcapReader::new(&data).unwrap();
        let link = r.link_type();
        for (i, frame) in r.enumerate() {
            let frame = frame.unwrap();
            match classify(link, frame.data) {
                Classified::RoceV2(ip) => {
                    f(&path, i + 1, ip);
                    n += 1;
                }
                Classified::RoceV1(_) => panic!("no RoCEv1 in the golden captures"),
                Classified::NotRoce => {}
            }
        }
    }
    n
}

#[test]
fn every_roce_packet_parses_verifies_and_reemits_byte_exact() {
    let mut v6 = 0;
    let n = for_each_roce(|path, i, ip| {
        let at = format!("{} frame {i}", path.display());
        let p = RoceV2Packet::parse_verified(ip).unwrap_or_else(|e| panic!("{at}: {e}"));
        if matches!(p.ip(), IpRepr::V6(_)) {
            v6 += 1;
        }
        // IB headers: parse -> emit reproduces BTH, extension headers and pad; payload copied in.
        let ib = p.ib();
        let repr = IbRepr::parse(ib).unwrap();
        let original = ib.as_bytes();
        let mut buf = vec![0xa5u8; original.len() + 8];
        let len = repr.emit(&mut buf).unwrap_or_else(|e| panic!("{at}: emit {e}"));
        assert_eq!(len, original.len(), "{at}");
        buf[repr.payload_range()].copy_from_slice(ib.payload());
        // The ICRC slot is zeroed by IbRepr::emit; the encapsulation fills it.
        assert_eq!(&buf[..len - 4], &original[..len - 4], "{at}: headers or pad differ");
        // IP + UDP: the parsed choices re-emitted around the same IB packet give the same packet,
        // ICRC and IPv4 checksum included.
        let roce = p.repr();
        let hl = roce.header_len();
        let mut frame = vec![0xa5u8; hl + len];
        frame[hl..].copy_from_slice(&buf[..len]);
        let total = roce.emit(&mut frame, len).unwrap();
        let ip_len = match p.ip() {
            IpRepr::V4(r) => 20 + r.payload_len,
            IpRepr::V6(r) => 40 + r.payload_len,
        };
        assert_eq!(&frame[..total], &ip[..ip_len], "{at}: encapsulation differs");
    });
    assert_eq!(n, 6745, "RoCE packets in the golden captures (DECODE_CHECK.txt)");
    assert_eq!(v6, 20);
}

#[test]
fn ipv4_identification_is_recovered_from_the_icrc_for_every_packet() {
    let mut stats = VerifyStats::default();
    let mut idents = std::collections::BTreeSet::new();
    for_each_roce(|path, i, ip| {
        let p = RoceV2Packet::parse(ip).unwrap();
        let IpRepr::V4(v4) = *p.ip() else { return };
        // Pretend to be a UDP socket: only addresses, ports and the UDP payload are visible.
        let src = SocketAddr::new(v4.src_addr.into(), p.udp().src_port);
        let dst = SocketAddr::new(v4.dst_addr.into(), p.udp().dst_port);
        let (_, verdict) = verify_udp_payload(src, dst, p.ib().as_bytes()).unwrap();
        stats.record(verdict);
        let want = if v4.ident == 0 && v4.dont_frag {
            UdpVerdict::Verified
        } else {
            UdpVerdict::VerifiedWithRecoveredId { ident: v4.ident, dont_frag: v4.dont_frag }
        };
        assert_eq!(verdict, want, "{} frame {i}", path.display());
        idents.insert(v4.ident);
        // A flipped BTH bit is rejected. (With 16 check bits left a corruption could in principle
        // alias to another identification, with probability about 2^-15; in this corpus none does.)
        let mut bad = p.ib().as_bytes().to_vec();
        bad[12] ^= 0x01;
        assert_eq!(verify_udp_payload(src, dst, &bad).unwrap().1, UdpVerdict::Bad, "{} frame {i}", path.display());
    });
    assert_eq!(stats.bad, 0);
    assert_eq!(stats.verified + stats.recovered, 6725);
    // rxe sends incrementing, non-zero identifications: nearly every packet needed recovery.
    assert!(stats.recovered > 6700, "{stats:?}");
    assert!(idents.len() > 1000);
}

/// Every CM MAD (UD SEND to QP1) in the captures parses as its CM message, and our emit of what we
/// parsed reproduces the kernel's 256 bytes exactly (reserved fields zero, private data as sent).
#[test]
fn every_cm_mad_parses_and_reemits_byte_exact() {
    let mut seen = std::collections::BTreeMap::<u16, usize>::new();
    for_each_roce(|path, i, ip| {
        let p = RoceV2Packet::parse(ip).unwrap();
        let ib = p.ib();
        let Some(deth) = ib.deth() else { return };
        if ib.bth().dest_qp().value() != 1 {
            return;
        }
        let at = format!("{} frame {i}", path.display());
        assert_eq!(deth.qkey(), GSI_QKEY, "{at}");
        let mad = ib.payload();
        assert_eq!(mad.len(), MAD_LEN, "{at}");
        let (h, m) = CmMessage::parse(mad).unwrap_or_else(|e| panic!("{at}: {e}"));
        let mut out = [0xa5u8; MAD_LEN];
        m.emit(h.transaction_id, &mut out).unwrap();
        assert_eq!(&out[..], mad, "{at}: {}", m.name());
        *seen.entry(h.attribute_id).or_default() += 1;
    });
    for a in [attr::REQ, attr::REP, attr::RTU, attr::DREQ, attr::DREP] {
        assert!(seen.get(&a).copied().unwrap_or(0) >= 4, "attribute {a:#x}: {seen:?}");
    }
}
