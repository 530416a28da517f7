//! What softrdmad reads from its clients, who may be hostile: control messages on the socket
//! (`Request::decode`), and work requests and completions in the shared rings' slots
//! (`decode_send`, `decode_recv`, `decode_cqe`); and what a client reads from the daemon
//! (`Response::decode`, `decode_event`). Each must give a value or an error, never panic. A send
//! slot decodes from the bytes its header says it uses (`send_used`, what the daemon copies out
//! of the ring) to what it decodes to from the whole slot, errors included.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_abi::msg::{decode_event, Request, Response};
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
});
