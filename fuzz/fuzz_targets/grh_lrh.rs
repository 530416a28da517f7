//! GRH, LRH, VCRC and Ethernet: parse, re-emit and compare; native-IB ICRC over arbitrary pieces.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::{icrc, lrh, EthernetFrame, EthernetRepr, GrhPacket, GrhRepr, LrhPacket, LrhRepr};

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = GrhPacket::new_checked(data) {
        if let Ok(r) = GrhRepr::parse(&p) {
            let mut out = [0u8; 40];
            r.emit(&mut GrhPacket::new_unchecked(&mut out[..]));
            assert_eq!(&out[..], &data[..40]);
        }
    }
    if let Ok(p) = LrhPacket::new_checked(data) {
        if let Ok(r) = LrhRepr::parse(&p) {
            let mut out = [0u8; 8];
            r.emit(&mut LrhPacket::new_unchecked(&mut out[..]));
            assert_eq!(LrhRepr::parse(&LrhPacket::new_unchecked(&out[..])).unwrap(), r);
            let lnh_global = r.lnh == lrh::Lnh::IbaGlobal;
            let grh = if lnh_global { data.get(8..48) } else { None };
            let ib = &data[if grh.is_some() { 48 } else { 8 }.min(data.len())..];
            let _ = icrc::native(&data[..8], grh, ib);
        }
        let _ = lrh::read_vcrc(data, usize::from(p.pkt_len()) * 4);
    }
    let _ = lrh::vcrc(data);
    if let Ok(f) = EthernetFrame::new_checked(data) {
        let r = EthernetRepr::parse(&f).unwrap();
        let mut out = [0u8; 18];
        let n = r.emit(&mut out).unwrap();
        assert_eq!(&out[..n], &data[..n]);
    }
});
