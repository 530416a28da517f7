//! IB transport packets: the checked view, the repr, and the parse → emit fixpoint.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::packet::pad_for;
use softrdma_wire::{IbPacket, IbRepr};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = IbPacket::new_checked(data) else { return };
    let _ = (p.payload(), p.icrc(), p.deth(), p.reth(), p.atomic_eth(), p.aeth(), p.atomic_ack_eth());
    let _ = (p.imm(), p.ieth(), p.covered());
    let Ok(r) = IbRepr::parse(&p) else { return };
    // Emit derives the pad from the payload length; a received packet may carry another pad count
    // (IbPacket, like rxe, accepts any pad that fits), so only well-padded input is byte-for-byte.
    let well_padded = r.bth.pad == pad_for(r.payload_len);
    if well_padded {
        assert_eq!(r.buffer_len(), data.len());
    }
    let mut out = vec![0xa5u8; r.buffer_len()];
    let n = r.emit(&mut out).expect("a parsed repr emits");
    out[r.payload_range()].copy_from_slice(p.payload());
    // Emit writes reserved bits and pad as zero, so compare after a second parse: a fixpoint.
    let q = IbPacket::new_checked(&out[..n]).expect("emitted packet parses");
    let mut want = r;
    want.bth.pad = pad_for(r.payload_len);
    assert_eq!(IbRepr::parse(&q).unwrap(), want);
    assert_eq!(q.payload(), p.payload());
});
