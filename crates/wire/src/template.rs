//! Data request headers (SEND and RDMA WRITE, every transport) written from a per-QP template, and
//! RC acknowledgements written directly.
//!
//! Consecutive request packets of a QP differ only in a few fields: opcode, SE, pad, AckReq, PSN, and
//! the RETH, DETH and immediate of the packets that carry them. [`RequestTemplate`] keeps the fixed
//! part of the BTH (P_Key, FECN/BECN clear, destination QP) as bytes and [`RequestTemplate::emit`]
//! patches the rest in place: one opcode-table lookup to check the headers asked for, no per-header
//! offset search. The bytes are those [`crate::IbRepr::emit`] writes for the same packet (a test
//! compares them, ICRC included, for every opcode this covers); parsing stays with the views.
//! [`emit_acknowledge`] does the same for the 20-byte ACKNOWLEDGE a responder sends per message.

use crate::aeth::{AethPacket, AethRepr, AETH_LEN};
use crate::bth::BTH_LEN;
use crate::ext::{DethPacket, DethRepr, RethPacket, RethRepr, DETH_LEN, RETH_LEN};
use crate::number::{Psn, Qpn};
use crate::opcode::{base, Flags, HeaderSet, Opcode};
use crate::packet::pad_for;
use crate::{Error, Result, ICRC_LEN};

/// The fixed bytes of a QP's BTHs: P_Key and destination QP (bytes 2..8), the rest zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTemplate {
    head: [u8; 8],
}

/// The per-packet fields of a SEND or RDMA WRITE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataRequest {
    /// A SEND or RDMA WRITE opcode of any transport.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
    /// DETH (UD opcodes).
    pub deth: Option<DethRepr>,
    /// RETH (first or only packet of a WRITE).
    pub reth: Option<RethRepr>,
    /// Immediate data, or the rkey to invalidate, for the opcodes that carry an ImmDt or an IETH.
    pub imm: Option<u32>,
    /// Payload length in bytes (without pad).
    pub payload_len: usize,
}

impl RequestTemplate {
    /// The template of requests to `dest_qp` in partition `pkey`.
    pub fn new(pkey: u16, dest_qp: Qpn) -> RequestTemplate {
        let mut head = [0u8; 8];
        head[2..4].copy_from_slice(&pkey.to_be_bytes());
        head[4..8].copy_from_slice(&dest_qp.value().to_be_bytes());
        head[4] = 0;
        RequestTemplate { head }
    }

    /// Write the headers of `r` into `buf`, zero its pad and ICRC slot, and leave the payload bytes
    /// (`buf[header length..][..payload_len]`) to the caller. Returns the header length and the packet
    /// length. Refused: an opcode that is not a SEND or WRITE request, or headers other than the
    /// opcode's.
    pub fn emit(&self, buf: &mut [u8], r: &DataRequest) -> Result<(usize, usize)> {
        let info = r.opcode.info().ok_or(Error::UnknownOpcode(r.opcode.0))?;
        let mut want = HeaderSet::NONE;
        if r.deth.is_some() {
            want = want.with(HeaderSet::DETH);
        }
        if r.reth.is_some() {
            want = want.with(HeaderSet::RETH);
        }
        if r.imm.is_some() {
            want = want.with(if info.is(Flags::INV) { HeaderSet::IETH } else { HeaderSet::IMMDT });
        }
        if !info.is(Flags::REQ) || !info.is(Flags::PAYLOAD) || info.headers != want {
            return Err(Error::Reserved);
        }
        let hdr = want.header_len();
        let pad = pad_for(r.payload_len);
        let len = hdr + r.payload_len + usize::from(pad) + ICRC_LEN;
        let buf = buf.get_mut(..len).ok_or(Error::Truncated)?;
        let mut bth = self.head;
        bth[0] = r.opcode.0;
        bth[1] = (u8::from(r.solicited) << 7) | (pad << 4);
        buf[..8].copy_from_slice(&bth);
        buf[8..BTH_LEN].copy_from_slice(&((u32::from(r.ack_req) << 31) | r.psn.value()).to_be_bytes());
        let mut at = BTH_LEN;
        if let Some(d) = &r.deth {
            d.emit(&mut DethPacket::new_unchecked(&mut buf[at..at + DETH_LEN]));
            at += DETH_LEN;
        }
        if let Some(h) = &r.reth {
            h.emit(&mut RethPacket::new_unchecked(&mut buf[at..at + RETH_LEN]));
            at += RETH_LEN;
        }
        if let Some(v) = r.imm {
            buf[at..at + 4].copy_from_slice(&v.to_be_bytes());
        }
        // Pad (at most three bytes) and ICRC slot: two fixed-size stores, overlapping when the pad
        // is short (the tail is four to seven bytes).
        let tail = hdr + r.payload_len;
        buf[tail..tail + ICRC_LEN].fill(0);
        buf[len - ICRC_LEN..].fill(0);
        Ok((hdr, len))
    }
}

/// Write an RC ACKNOWLEDGE to `dest_qp` in partition `pkey` (BTH, AETH, zeroed ICRC slot) into
/// `buf`; returns its length. The bytes are those [`crate::IbRepr::emit`] writes for it.
pub fn emit_acknowledge(buf: &mut [u8], pkey: u16, dest_qp: Qpn, psn: Psn, aeth: &AethRepr) -> Result<usize> {
    const LEN: usize = BTH_LEN + AETH_LEN + ICRC_LEN;
    let buf = buf.get_mut(..LEN).ok_or(Error::Truncated)?;
    // The fixed part as a request's; RC's opcode prefix is 0; no SE, MigReq, pad, version or AckReq.
    let mut bth = RequestTemplate::new(pkey, dest_qp).head;
    bth[0] = base::ACKNOWLEDGE;
    buf[..8].copy_from_slice(&bth);
    buf[8..BTH_LEN].copy_from_slice(&psn.value().to_be_bytes());
    aeth.emit(&mut AethPacket::new_unchecked(&mut buf[BTH_LEN..BTH_LEN + AETH_LEN]));
    buf[LEN - ICRC_LEN..].fill(0);
    Ok(LEN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bth::{BthRepr, DEFAULT_PKEY};
    use crate::roce::{seal_udp_payload_ident, UdpSealer};
    use crate::{IbPacket, IbRepr};
    use core::net::SocketAddr;

    /// The repr of the same packet as `r` (template for `pkey`, `dest_qp`).
    fn repr(r: &DataRequest, pkey: u16, dest_qp: Qpn) -> IbRepr {
        let mut ib = IbRepr::new(BthRepr {
            solicited: r.solicited,
            ack_req: r.ack_req,
            pkey,
            ..BthRepr::new(r.opcode, dest_qp, r.psn)
        });
        ib.deth = r.deth;
        ib.reth = r.reth;
        if r.opcode.info().unwrap().is(Flags::INV) {
            ib.ieth = r.imm;
        } else {
            ib.imm = r.imm;
        }
        ib.payload_len = r.payload_len;
        ib
    }

    #[test]
    fn template_packets_are_the_repr_packets() {
        let (src, dst): (SocketAddr, SocketAddr) =
            ("10.0.0.1:49152".parse().unwrap(), "10.0.0.2:4791".parse().unwrap());
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut covered = 0;
        for (opcode, info) in Opcode::all().filter(|(_, i)| i.is(Flags::REQ) && i.is(Flags::PAYLOAD)) {
            covered += 1;
            for (k, payload_len) in [0usize, 1, 2, 3, 4, 64, 255].into_iter().enumerate() {
                let (pkey, dest_qp) =
                    if k % 2 == 0 { (DEFAULT_PKEY, Qpn::new(0x11)) } else { (0x8001, Qpn::new(0xabcdef)) };
                let r = DataRequest {
                    opcode,
                    solicited: k % 3 == 0,
                    ack_req: k % 2 == 1,
                    psn: Psn::new(0xfffff0 + k as u32),
                    deth: info
                        .headers
                        .contains(HeaderSet::DETH)
                        .then_some(DethRepr { qkey: 0x8001_1234 + k as u32, src_qp: Qpn::new(0x123456) }),
                    reth: info.headers.contains(HeaderSet::RETH).then_some(RethRepr {
                        va: 0x0123_4567_89ab_cdef ^ k as u64,
                        rkey: 0xdead_beef,
                        dma_len: 4096 + k as u32,
                    }),
                    imm: (info.headers.contains(HeaderSet::IMMDT) || info.headers.contains(HeaderSet::IETH))
                        .then_some(0x0a0b_0c0d),
                    payload_len,
                };
                let ib = repr(&r, pkey, dest_qp);
                let (mut a, mut b) = ([0xa5u8; 512], [0x5au8; 512]);
                let n = ib.emit(&mut a).unwrap();
                a[ib.payload_range()].copy_from_slice(&data[..payload_len]);
                let (hdr, m) = RequestTemplate::new(pkey, dest_qp).emit(&mut b, &r).unwrap();
                assert_eq!((hdr, m), (ib.payload_range().start, n), "{}", info.name);
                b[hdr..hdr + payload_len].copy_from_slice(&data[..payload_len]);
                assert_eq!(a[..n], b[..m], "{}", info.name);
                assert!(IbPacket::new_checked(&b[..m]).is_ok());
                // Sealed, the ICRCs agree too (the generic sealer and the per-run one).
                let ident = k as u16;
                seal_udp_payload_ident(src, dst, &mut a[..n], ident).unwrap();
                UdpSealer::new(src, dst, m).unwrap().seal(&mut b[..m], ident).unwrap();
                assert_eq!(a[..n], b[..m], "{}", info.name);
            }
        }
        // RC: 8 SEND, 6 WRITE; UC: 6 SEND, 6 WRITE; UD: 2 SEND.
        assert_eq!(covered, 14 + 12 + 2);
    }

    #[test]
    fn template_refuses_other_headers_and_opcodes() {
        let t = RequestTemplate::new(DEFAULT_PKEY, Qpn::new(0x11));
        let mut r = DataRequest {
            opcode: Opcode(0x0a), // RC RDMA WRITE ONLY
            solicited: false,
            ack_req: true,
            psn: Psn::new(1),
            deth: None,
            reth: None,
            imm: None,
            payload_len: 8,
        };
        let mut buf = [0u8; 64];
        assert_eq!(t.emit(&mut buf, &r), Err(Error::Reserved));
        r.reth = Some(RethRepr { va: 0, rkey: 1, dma_len: 8 });
        assert_eq!(t.emit(&mut buf, &r), Ok((28, 40)));
        assert_eq!(t.emit(&mut buf[..39], &r), Err(Error::Truncated));
        r.imm = Some(5);
        assert_eq!(t.emit(&mut buf, &r), Err(Error::Reserved));
        r.imm = None;
        r.opcode = Opcode(0x0c); // RC RDMA READ REQUEST: no payload, not a data request
        assert_eq!(t.emit(&mut buf, &r), Err(Error::Reserved));
        r.opcode = Opcode(0xff);
        assert_eq!(t.emit(&mut buf, &r), Err(Error::UnknownOpcode(0xff)));
    }

    #[test]
    fn acknowledgements_are_the_repr_packets() {
        use crate::aeth::Syndrome;
        let syndromes = [
            Syndrome::Ack { credits: crate::aeth::CREDITS_INVALID },
            Syndrome::Ack { credits: 3 },
            Syndrome::RnrNak { timer: 14 },
            Syndrome::Nak(crate::aeth::NakCode::PsnSequenceError),
            Syndrome::Nak(crate::aeth::NakCode::RemoteAccessError),
        ];
        for (k, syndrome) in syndromes.into_iter().enumerate() {
            let (pkey, dest_qp, psn) = if k % 2 == 0 {
                (DEFAULT_PKEY, Qpn::new(0x11), Psn::new(0))
            } else {
                (0x8001, Qpn::new(0xabcdef), Psn::new(0xff_ffff))
            };
            let aeth = AethRepr { syndrome, msn: 0x12_3456 + k as u32 };
            let mut ib = IbRepr::new(BthRepr { pkey, ..BthRepr::new(Opcode(base::ACKNOWLEDGE), dest_qp, psn) });
            ib.aeth = Some(aeth);
            let mut want = [0xeeu8; 32];
            let n = ib.emit(&mut want).unwrap();
            let mut got = [0x55u8; 32];
            assert_eq!(emit_acknowledge(&mut got, pkey, dest_qp, psn, &aeth), Ok(n));
            assert_eq!(got[..n], want[..n], "{syndrome:?}");
            assert_eq!(IbPacket::new_checked(&got[..n]).unwrap().aeth().map(|a| a.msn()), Some(aeth.msn));
        }
        assert_eq!(
            emit_acknowledge(
                &mut [0u8; 19],
                DEFAULT_PKEY,
                Qpn::new(1),
                Psn::new(1),
                &AethRepr { syndrome: Syndrome::Ack { credits: 0 }, msn: 0 }
            ),
            Err(Error::Truncated)
        );
    }
}
