//! Receiving the rest of an RC RDMA WRITE straight into its target region (one copy less per
//! payload byte on the UDP path). Once the responder accepted a WRITE's FIRST (or a MIDDLE) packet,
//! the engine knows where the next in-sequence payload goes (`Hca::rx_placement`). The runtime
//! peeks at the next datagram's BTH and GRO segment size; if it starts as that WRITE's next packet,
//! it is received with an iovec laid out as the WRITE's next packets would be — the bytes between
//! two payloads (ICRC, next BTH) → scratch, each payload → the region — which is usually one GRO batch of
//! MIDDLE and LAST packets. The runtime hands each packet that matches the prediction
//! (layout, QP, PSN, opcode, ICRC over the pieces) to the engine as already placed
//! (`Hca::handle_placed`); anything else is copied out of the pieces and received as usual.

use softrdma_transport::{Hca, RxPlacement};
use softrdma_wire::bth::{BthPacket, BTH_LEN};
use softrdma_wire::opcode::base;
use softrdma_wire::{Qpn, ICRC_LEN};

use crate::io::GSO_MAX_SEGS;
use crate::memory::MrTable;

/// Most packets one plan covers (a GSO send has at most this many segments).
const MAX_SEGS: usize = GSO_MAX_SEGS;
/// Scratch bytes per piece between two payloads: pad, ICRC and BTH (3 + 4 + 12), rounded up.
const SEG_SCRATCH: usize = 32;
/// Bytes of scratch pieces in front of the overflow area (see [`Plan::iovecs`]).
pub(crate) const SCRATCH: usize = (MAX_SEGS + 1) * SEG_SCRATCH;
/// The largest datagram a socket hands over (a GRO batch included); the overflow area takes
/// whatever does not fit the plan, so the plan never truncates a datagram the copying path takes.
pub(crate) const MAX_DATAGRAM: usize = 65536;
/// iovec entries of a plan: two per packet, the last packet's ICRC and the overflow area.
pub(crate) const MAX_IOV: usize = 2 * MAX_SEGS + 2;

/// The predicted layout of the next datagram: `n` packets of the WRITE in progress, each
/// `BTH_LEN + payload + pad + ICRC_LEN` bytes, every payload `mtu` bytes but possibly the last.
#[derive(Debug)]
pub(crate) struct Plan {
    expect: RxPlacement,
    /// `expect.addr` in this process (`expect.remaining` bytes, checked for remote writes).
    region: *mut u8,
    n: usize,
    last: usize,
}

impl Plan {
    /// The plan for QP `qpn`'s next packets, if the engine knows where they go and the region is
    /// in this process (a daemon's region lives in its client: the copying path serves it).
    pub(crate) fn new(hca: &Hca, mem: &MrTable, qpn: Qpn) -> Option<Plan> {
        let expect = hca.rx_placement(qpn)?;
        let mtu = expect.mtu as usize;
        let remaining = expect.remaining as usize;
        if mtu == 0 || remaining == 0 {
            return None;
        }
        let region = mem.remote_write_ptr(expect.pd, expect.rkey, expect.addr, remaining as u64)?;
        let fit = (MAX_DATAGRAM / (BTH_LEN + mtu + ICRC_LEN)).clamp(1, MAX_SEGS);
        let n = remaining.div_ceil(mtu).min(fit);
        let last = (remaining - (n - 1) * mtu).min(mtu);
        Some(Plan { expect, region, n, last })
    }

    /// Payload and pad bytes of planned packet `k`.
    fn payload(&self, k: usize) -> (usize, usize) {
        let len = if k + 1 == self.n { self.last } else { self.expect.mtu as usize };
        (len, len.wrapping_neg() & 3)
    }

    /// Where planned packet `k` starts in the datagram, and its length.
    fn span(&self, k: usize) -> (usize, usize) {
        let (len, pad) = self.payload(k);
        (k * (BTH_LEN + self.expect.mtu as usize + ICRC_LEN), BTH_LEN + len + pad + ICRC_LEN)
    }

    /// The placement the engine must report when packet `k` is next (packets before it accepted).
    fn expect(&self, k: usize) -> RxPlacement {
        let off = k as u32 * self.expect.mtu;
        RxPlacement {
            psn: self.expect.psn.add(k as u32),
            addr: self.expect.addr.wrapping_add(u64::from(off)),
            remaining: self.expect.remaining - off,
            ..self.expect
        }
    }

    /// Whether a datagram of `len` bytes (GRO segment size `seg`) starting with `head` begins as
    /// planned: the expected packet of the WRITE (QP, PSN, MIDDLE or LAST) with the planned length.
    /// Only then is it received along the plan; anything else takes the copying path untouched.
    pub(crate) fn starts(&self, head: &[u8; BTH_LEN], len: usize, seg: Option<u16>) -> bool {
        let Ok(bth) = BthPacket::new_checked(&head[..]) else { return false };
        let first = seg.map_or(len, usize::from).min(len);
        matches!(head[0], base::WRITE_MIDDLE | base::WRITE_LAST)
            && bth.dest_qp() == self.expect.qpn
            && bth.psn() == self.expect.psn
            && self.span(0).1 == first
    }

    /// The QP.
    pub(crate) fn qpn(&self) -> Qpn {
        self.expect.qpn
    }

    /// Where packet `k`'s BTH is in the scratch area (see [`Plan::iovecs`]).
    fn bth_at(k: usize) -> usize {
        k * SEG_SCRATCH + if k > 0 { ICRC_LEN } else { 0 }
    }

    /// The iovec for receiving the next datagram along the plan into `iov`; returns the entries
    /// used. `scratch` must have room for [`SCRATCH`] + [`MAX_DATAGRAM`] bytes. The bytes between
    /// two payloads (a packet's ICRC and the next packet's BTH; only the last packet can have pad)
    /// go to one scratch piece each, `scratch[32j..]`, so a packet costs two entries; the payloads
    /// go to the region; the rest of the datagram beyond the plan to `scratch[SCRATCH..]`.
    ///
    /// Writing a payload that is not verified yet into the region is allowed: every byte the
    /// payload entries cover lies in `[expect.addr, expect.addr + expect.remaining)`, inside the
    /// range the WRITE's RETH was checked for (rkey, PD, bounds, remote-write right) when its FIRST
    /// packet was accepted, and the region stays registered while the device lock is held (the
    /// caller holds it from the plan to the last packet). That range's contents are undefined until
    /// the WRITE completes (as with a NIC placing packets of a message before its last arrives). A
    /// packet that fails its ICRC or does not match the prediction is dropped or processed as a
    /// copy (and NAKed if out of sequence), so the requester retransmits and overwrites it; no byte
    /// is ever written outside the range.
    pub(crate) fn iovecs(&self, scratch: *mut u8, iov: &mut [libc::iovec; MAX_IOV]) -> usize {
        let mut at = 0;
        let mut put = |base: *mut u8, len: usize| {
            iov[at] = libc::iovec { iov_base: base as *mut libc::c_void, iov_len: len };
            at += 1;
        };
        for k in 0..=self.n {
            // The previous packet's pad and ICRC, then this packet's BTH.
            let trailer = if k > 0 { self.payload(k - 1).1 + ICRC_LEN } else { 0 };
            let head = if k < self.n { BTH_LEN } else { 0 };
            // SAFETY: the caller's scratch has SCRATCH ((MAX_SEGS + 1) * SEG_SCRATCH) bytes in front
            // of the overflow area, k <= n <= MAX_SEGS, and a piece is at most 3 + 4 + 12 <
            // SEG_SCRATCH bytes; `new` resolved `remaining` bytes at `region`, and
            // k * mtu + len <= remaining.
            unsafe {
                put(scratch.add(k * SEG_SCRATCH), trailer + head);
                if k < self.n {
                    put(self.region.add(k * self.expect.mtu as usize), self.payload(k).0);
                }
            }
        }
        // SAFETY: as above; the caller's scratch has MAX_DATAGRAM bytes after SCRATCH.
        put(unsafe { scratch.add(SCRATCH) }, MAX_DATAGRAM);
        at
    }

    /// Planned packet `k`, received at `[at, at + len)` of the datagram along [`Plan::iovecs`], if it
    /// sits where the plan put it: its headers, pad and ICRC (gathered from `scratch`), its payload
    /// (in the region), and the placement the engine must still report for it.
    pub(crate) fn packet(&self, scratch: *const u8, k: usize, at: usize, len: usize) -> Option<Placed<'_>> {
        if k >= self.n || self.span(k) != (at, len) {
            return None;
        }
        let (plen, pad) = self.payload(k);
        let mut hdr = [0u8; HDR_MAX];
        let tl = pad + ICRC_LEN;
        // SAFETY: these ranges were given to recvmsg by `iovecs` and are filled (the datagram
        // reached `at + len`); the region stays registered while the device lock is held. The
        // application may be changing those region bytes meanwhile, as it may under a NIC's DMA:
        // they are plain bytes, any value is valid, and a changed byte only fails the ICRC.
        let payload = unsafe {
            std::ptr::copy_nonoverlapping(scratch.add(Self::bth_at(k)), hdr.as_mut_ptr(), BTH_LEN);
            std::ptr::copy_nonoverlapping(scratch.add((k + 1) * SEG_SCRATCH), hdr[BTH_LEN..].as_mut_ptr(), tl);
            std::slice::from_raw_parts(self.region.add(k * self.expect.mtu as usize), plen)
        };
        Some(Placed { hdr, hdr_len: BTH_LEN + tl, payload, expect: self.expect(k) })
    }
}

/// Bytes of a planned packet without its payload: BTH, pad, ICRC.
const HDR_MAX: usize = BTH_LEN + 3 + ICRC_LEN;

/// One packet received along a [`Plan`].
pub(crate) struct Placed<'a> {
    hdr: [u8; HDR_MAX],
    hdr_len: usize,
    /// The payload, in the region.
    pub payload: &'a [u8],
    /// The placement it was received for.
    pub expect: RxPlacement,
}

impl Placed<'_> {
    /// BTH, pad and ICRC: the packet without its payload.
    pub(crate) fn hdr(&self) -> &[u8] {
        &self.hdr[..self.hdr_len]
    }
}

/// Copy bytes `[at, at + out.len())` of a datagram received into the pieces `iov` into `out`.
///
/// # Safety
///
/// The pieces must be readable and hold the datagram up to `at + out.len()`.
pub(crate) unsafe fn copy_out(iov: &[libc::iovec], mut at: usize, out: &mut [u8]) {
    let mut done = 0;
    for v in iov {
        if done == out.len() {
            break;
        }
        if at >= v.iov_len {
            at -= v.iov_len;
            continue;
        }
        let take = (v.iov_len - at).min(out.len() - done);
        // SAFETY: the caller's promise; `out` is a distinct buffer.
        unsafe { std::ptr::copy_nonoverlapping((v.iov_base as *const u8).add(at), out[done..].as_mut_ptr(), take) };
        done += take;
        at = 0;
    }
}

/// The QP whose WRITE continues after a received packet `d` (an RC WRITE FIRST or MIDDLE).
pub(crate) fn write_hint(d: &[u8]) -> Option<Qpn> {
    let bth = BthPacket::new_checked(d).ok()?;
    matches!(bth.opcode().0, base::WRITE_FIRST | base::WRITE_MIDDLE).then(|| bth.dest_qp())
}
