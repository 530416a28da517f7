//! What softrdmad reads from its clients, who may be hostile: control messages on the socket
//! (`Request::decode`), and work requests and completions in the shared rings' slots
//! (`decode_send`, `decode_recv`, `decode_cqe`); and what a client reads from the daemon
//! (`Response::decode`, `decode_event`). Each must give a value or an error, never panic. A send
//! slot decodes from the bytes its header says it uses (`send_used`, what the daemon copies out
//! of the ring) to what it decodes to from the whole slot, errors included. What the daemon
//! reads of a placement entry a client may have rewritten stays inside its slot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_abi::msg::{decode_event, Request, Response};
use softrdma_abi::placements::{placements_bytes, Placements, State, DATA_MAX};
use softrdma_abi::slot::{decode_cqe, decode_recv, decode_send, send_used, CQE_LEN, SEND_HEADER};

fuzz_target!(|data: &[u8]| {
    let _ = Request::decode(data);
    let _ = Response::decode(data);
    let _ = decode_event(data);
    let (limits, slot) = data.split_at(data.len().min(2));
    let max_sge = u32::from(limits.first().copied().unwrap_or(4));
    let max_inline = u32::from(limits.get(1).copied().unwrap_or(64)) * 4;
    let whole = decode_send(slot, max_sge, max_inline);
    let used = send_used(&slot[..slot.len().min(SEND_HEADER)]).min(slot.len());
    let part = decode_send(&slot[..used], max_sge, max_inline);
    assert_eq!(part, whole, "a slot decodes from the bytes it uses as from the whole slot");
    let _ = decode_recv(slot, max_sge);
    if let Some(cqe) = slot.first_chunk::<CQE_LEN>() {
        let _ = decode_cqe(cqe);
    }
    placement_ring(data);
});

/// A placement ring of two slots filled with `data`, read as the daemon reads one.
fn placement_ring(data: &[u8]) {
    #[repr(C, align(64))]
    struct Mem([u8; placements_bytes(2)]);
    let mut mem = Box::new(Mem([0; placements_bytes(2)]));
    let n = data.len().min(mem.0.len());
    mem.0[..n].copy_from_slice(&data[..n]);
    // SAFETY: 64-byte aligned, `placements_bytes(2)` long, alive for the view's use below.
    let ring = unsafe { Placements::new(mem.0.as_mut_ptr(), 2) };
    let _ = ring.header_ok();
    let mut out = [0u8; DATA_MAX];
    for e in 0..4u32 {
        let _ = ring.seen(e);
        if ring.take(e, State::Daemon).is_ok() {
            let (_, len) = ring.read(e, &mut out);
            assert!(len <= DATA_MAX);
            ring.finish(e);
        }
        assert!(ring.data(e).2 <= DATA_MAX);
    }
}
