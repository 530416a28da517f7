//! CM MADs (IB CM class 0x07, as rdma_cm sends them) and the rdma_cm header in a REQ's private
//! data: parse, and for what parses, emit → parse gives the same message back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::cm::{CmMessage, CmaHeader};

fuzz_target!(|data: &[u8]| {
    let _ = CmaHeader::parse(data);
    let Ok((h, m)) = CmMessage::parse(data) else { return };
    if let CmMessage::Req(r) = &m {
        let _ = CmaHeader::parse(&r.private_data[..]);
    }
    let mut out = [0u8; 256];
    m.emit(h.transaction_id, &mut out).expect("a parsed message emits");
    let (h2, m2) = CmMessage::parse(&out).expect("an emitted message parses");
    assert_eq!((h2.transaction_id, h2.attribute_id), (h.transaction_id, h.attribute_id));
    assert_eq!(m2, m);
});
