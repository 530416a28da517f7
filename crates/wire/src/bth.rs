//! Base transport header (BTH, 12 bytes), present in every IB transport packet.
//!
//! ```text
//!  0       opcode
//!  1       SE(1) M(1) PadCnt(2) TVer(4)
//!  2..4    P_Key
//!  4       FECN(1) BECN(1) reserved(6)     <- the whole byte is variant for the ICRC
//!  5..8    DestQP
//!  8       AckReq(1) reserved(7)
//!  9..12   PSN
//! ```

use crate::field::{set_u16, set_u24, u16_at, u24_at, Field};
use crate::number::{Psn, Qpn};
use crate::opcode::Opcode;
use crate::{Error, Result};

/// Length of the BTH.
pub const BTH_LEN: usize = 12;

mod field {
    use super::Field;
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: usize = 2;
    pub const FECN_BECN: usize = 4;
    pub const DEST_QP: usize = 5;
    pub const ACK_REQ: usize = 8;
    pub const PSN: usize = 9;
    pub const ALL: Field = 0..12;
}

/// The default P_Key (full member of the default partition), as rxe uses.
pub const DEFAULT_PKEY: u16 = 0xffff;

view!(
    /// A read/write view of a BTH at the start of a buffer.
    BthPacket, field::ALL.end
);

impl<T: AsRef<[u8]>> BthPacket<T> {
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.b()[field::OPCODE])
    }
    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.b()[field::FLAGS] & 0x80 != 0
    }
    /// Migration state.
    pub fn mig_req(&self) -> bool {
        self.b()[field::FLAGS] & 0x40 != 0
    }
    /// Pad count: bytes of padding after the payload (0..=3).
    pub fn pad(&self) -> u8 {
        (self.b()[field::FLAGS] >> 4) & 0x3
    }
    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.b()[field::FLAGS] & 0xf
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        u16_at(self.b(), field::PKEY)
    }
    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.b()[field::FECN_BECN] & 0x80 != 0
    }
    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.b()[field::FECN_BECN] & 0x40 != 0
    }
    /// Destination queue pair.
    pub fn dest_qp(&self) -> Qpn {
        Qpn::new(u24_at(self.b(), field::DEST_QP))
    }
    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.b()[field::ACK_REQ] & 0x80 != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(u24_at(self.b(), field::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthPacket<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    /// Set the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.bm()[field::OPCODE] = op.0;
    }
    /// Set SE, M, PadCnt and TVer at once.
    pub fn set_flags(&mut self, solicited: bool, mig_req: bool, pad: u8, tver: u8) {
        self.bm()[field::FLAGS] =
            (u8::from(solicited) << 7) | (u8::from(mig_req) << 6) | ((pad & 3) << 4) | (tver & 0xf);
    }
    /// Set the pad count, leaving the other bits of its byte alone.
    pub fn set_pad(&mut self, pad: u8) {
        let b = &mut self.bm()[field::FLAGS];
        *b = (*b & !0x30) | ((pad & 3) << 4);
    }
    /// Set the partition key.
    pub fn set_pkey(&mut self, v: u16) {
        set_u16(self.bm(), field::PKEY, v);
    }
    /// Set FECN and BECN (the six reserved bits are cleared).
    pub fn set_ecn(&mut self, fecn: bool, becn: bool) {
        self.bm()[field::FECN_BECN] = (u8::from(fecn) << 7) | (u8::from(becn) << 6);
    }
    /// Set the destination QP.
    pub fn set_dest_qp(&mut self, q: Qpn) {
        set_u24(self.bm(), field::DEST_QP, q.value());
    }
    /// Set AckReq (the seven reserved bits are cleared).
    pub fn set_ack_req(&mut self, v: bool) {
        self.bm()[field::ACK_REQ] = u8::from(v) << 7;
    }
    /// Set the PSN.
    pub fn set_psn(&mut self, p: Psn) {
        set_u24(self.bm(), field::PSN, p.value());
    }
}

/// A BTH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration state.
    pub mig_req: bool,
    /// Pad count.
    pub pad: u8,
    /// Partition key.
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// Destination QP.
    pub dest_qp: Qpn,
    /// AckReq.
    pub ack_req: bool,
    /// PSN.
    pub psn: Psn,
}

impl BthRepr {
    /// The BTH most packets carry: no flags, no pad, the default P_Key. Other fields are set with
    /// struct update syntax (`BthRepr { ack_req: true, ..BthRepr::new(op, qp, psn) }`).
    pub fn new(opcode: Opcode, dest_qp: Qpn, psn: Psn) -> BthRepr {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    /// Parse a BTH; rejects a header version other than 0. Reserved bits are ignored, as rxe does.
    pub fn parse<T: AsRef<[u8]>>(p: &BthPacket<T>) -> Result<BthRepr> {
        p.check_len()?;
        if p.tver() != 0 {
            return Err(Error::BadVersion(p.tver()));
        }
        Ok(BthRepr {
            opcode: p.opcode(),
            solicited: p.solicited(),
            mig_req: p.mig_req(),
            pad: p.pad(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qp: p.dest_qp(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        BTH_LEN
    }

    /// Write into the first 12 bytes of `p` (reserved bits zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut BthPacket<T>) {
        p.set_opcode(self.opcode);
        p.set_flags(self.solicited, self.mig_req, self.pad, 0);
        p.set_pkey(self.pkey);
        p.set_ecn(self.fecn, self.becn);
        p.set_dest_qp(self.dest_qp);
        p.set_ack_req(self.ack_req);
        p.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RC SEND_ONLY, pad 0, pkey ffff, QP 0x11, AckReq, PSN 0xfb7b33 (rxe_rc_pingpong).
    const BYTES: [u8; 12] = [0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0xfb, 0x7b, 0x33];

    fn repr() -> BthRepr {
        BthRepr {
            opcode: Opcode(0x04),
            solicited: false,
            mig_req: false,
            pad: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: Qpn::new(0x11),
            ack_req: true,
            psn: Psn::new(0xfb7b33),
        }
    }

    #[test]
    fn deconstruct_and_parse() {
        let p = BthPacket::new_checked(&BYTES[..]).unwrap();
        assert_eq!(p.dest_qp(), Qpn::new(0x11));
        assert_eq!(BthRepr::parse(&p).unwrap(), repr());
    }

    #[test]
    fn emit_over_junk() {
        let mut buf = [0xa5u8; 12];
        repr().emit(&mut BthPacket::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn truncated_and_bad_version() {
        assert_eq!(BthPacket::new_checked(&BYTES[..11]).unwrap_err(), Error::Truncated);
        let mut b = BYTES;
        b[1] = 0x01;
        assert_eq!(BthRepr::parse(&BthPacket::new_unchecked(&b[..])), Err(Error::BadVersion(1)));
    }
}
