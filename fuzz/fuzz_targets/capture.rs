//! The pcap reader and the frame classifier over arbitrary files.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::capture::{classify, Classified, PcapReader};
use softrdma_wire::roce::{RoceV1Packet, RoceV2Packet};

fuzz_target!(|data: &[u8]| {
    let Ok(r) = PcapReader::new(data) else { return };
    let link = r.link_type();
    for frame in r {
        let Ok(f) = frame else { break };
        match classify(link, f.data) {
            Classified::RoceV2(ip) => {
                if let Ok(p) = RoceV2Packet::parse(ip) {
                    let _ = p.icrc_ok();
                }
            }
            Classified::RoceV1(g) => {
                if let Ok(p) = RoceV1Packet::parse(g) {
                    let _ = p.icrc_ok();
                }
            }
            Classified::NotRoce => {}
        }
    }
});
