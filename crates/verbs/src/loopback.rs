//! Packets a device sends to itself: traffic between two QPs of one device (the clients of one
//! softrdmad device, or two QPs of one process), and the CM's MADs between them. They take no
//! socket and no same-host lane: the flush keeps them in their transmit slots and hands them, in
//! order, to the device's own receive side once the batch is built, as an HCA's internal loopback
//! does (and as rxe does for a destination that is its own address). No ICRC is computed or
//! checked: nothing can corrupt them.
//!
//! The later packets of an RC RDMA WRITE (its FIRST accepted, so the engine knows where they go:
//! `Hca::rx_placement`) whose payload the engine left in registered memory (`Transmit::deferred`)
//! are placed without a packet buffer: the payload is copied straight from the requester's region
//! into the responder's, one copy per byte instead of two, and the engine takes the packet's
//! headers as already placed (`Hca::handle_placed`).
//!
//! `SOFTRDMA_SAME_HOST=0` turns this off with the lanes: the packets then go over UDP to the
//! device's own address, like any other (to capture them, for instance).

use std::net::SocketAddr;

use softrdma_transport::{DeferredPayload, Instant, MemError};
use softrdma_wire::opcode::Flags;
use softrdma_wire::{IbPacket, ICRC_LEN};

use crate::runtime::Receiver;

/// Most header bytes of a WRITE's MIDDLE or LAST packet around its payload: BTH, immediate data,
/// pad, ICRC.
const HDR_MAX: usize = 12 + 4 + 3 + ICRC_LEN;

/// How a looped-back packet was taken in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Looped {
    /// Its payload went straight from region to region.
    Placed,
    /// Handed over whole (its payload, if deferred, copied into it first).
    Whole,
}

/// Hand `pkt`, a packet this device built for `addr` (one of its own addresses), to its receive
/// side. `deferred`: its payload is still in registered memory and its hole in `pkt` unfilled.
pub(crate) fn hand_over(
    to: &mut Receiver<'_>,
    now: Instant,
    pkt: &mut [u8],
    deferred: Option<&DeferredPayload>,
    addr: SocketAddr,
) -> Result<Looped, MemError> {
    if let Some(d) = deferred {
        if place(to, now, pkt, d) {
            return Ok(Looped::Placed);
        }
        to.mem.fill(d, pkt)?;
    }
    match IbPacket::new_checked(&pkt[..]) {
        Ok(ib) => to.deliver(now, pkt, &ib, addr, addr),
        // The engine built it: cannot happen; counted as the receive path counts it.
        Err(_) => to.hca.counters_mut().count_malformed(),
    }
    Ok(Looped::Whole)
}

/// Take in `pkt` (its payload deferred as `d`) as already placed, if it is the next packet of the
/// RC RDMA WRITE its QP is receiving and both regions are in this process: copy the payload from
/// the requester's region to where the WRITE's next bytes go, and hand the engine the headers.
/// Every check the engine would make of the packet is made before a byte is written, so a packet
/// it refuses (a length that does not fit the responder's MTU or the WRITE, a WRITE with immediate
/// that needs a receive) writes nothing: those are handed over whole.
fn place(to: &mut Receiver<'_>, now: Instant, pkt: &[u8], d: &DeferredPayload) -> bool {
    let Ok(ib) = IbPacket::new_checked(pkt) else { return false };
    let Some(expect) = to.hca.rx_placement(ib.bth().dest_qp()) else { return false };
    // A LAST with immediate data may find no receive WQE (RNR): it goes whole, like anything the
    // responder would not take as the WRITE's next packet.
    let info = ib.info();
    if !expect.admits(&ib, d.len) || (info.ends_message() && info.is(Flags::IMM)) || pkt.len() - d.len > HDR_MAX {
        return false;
    }
    let mut hdr = [0u8; HDR_MAX];
    let (head, tail) = (&pkt[..d.at], &pkt[d.at + d.len..]);
    hdr[..head.len()].copy_from_slice(head);
    hdr[head.len()..head.len() + tail.len()].copy_from_slice(tail);
    let Ok(h) = IbPacket::new_checked(&hdr[..head.len() + tail.len()]) else { return false };
    let Some(dst) = to.mem.remote_write_ptr(expect.pd, expect.rkey, expect.addr, d.len as u64) else { return false };
    let mut src = None;
    let (Ok(()), Some(src)) = (to.mem.local_pieces(d, &mut src), src.as_ref()) else { return false };
    // SAFETY: `remote_write_ptr` resolved `d.len` bytes at `dst` inside a region of this process
    // open for remote writes, `local_pieces` the payload (`d.len` bytes) inside live regions; both
    // stay registered while the device lock is held (deregistration takes it).
    unsafe { src.copy_payload(dst) };
    to.traffic(expect.qpn, pkt.len(), |hca, mem| hca.handle_placed(now, &h, &expect, d.len, mem))
}
