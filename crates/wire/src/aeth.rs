//! ACK extended transport header (AETH, 4 bytes): syndrome and message sequence number.
//!
//! The syndrome byte is `0 | kind(2) | value(5)`: kind 00 is an ACK with a credit count, 01 an RNR
//! NAK with an encoded timer, 11 a NAK with a code, 10 is reserved (IBA 9.7.5.1).

use crate::field::{set_u24, u24_at};
use crate::Result;

/// Length of the AETH.
pub const AETH_LEN: usize = 4;

/// Credit count meaning "no end-to-end flow control information" (rxe sends this).
pub const CREDITS_INVALID: u8 = 0x1f;

/// NAK codes (IBA table 44).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// PSN sequence error: a packet arrived ahead of the expected PSN.
    PsnSequenceError,
    /// Invalid request: an opcode or length the responder cannot accept.
    InvalidRequest,
    /// Remote access error: bad R_Key, address, length or access rights.
    RemoteAccessError,
    /// Remote operational error: the responder could not complete the request.
    RemoteOperationalError,
    /// Invalid RD request.
    InvalidRdRequest,
    /// A reserved code, kept as received.
    Unknown(u8),
}

impl NakCode {
    /// Decode the 5-bit code.
    pub const fn from_bits(v: u8) -> NakCode {
        match v & 0x1f {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            x => NakCode::Unknown(x),
        }
    }

    /// Encode as the 5-bit code.
    pub const fn bits(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Unknown(x) => x & 0x1f,
        }
    }
}

/// The AETH syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with a credit count (0x1f: invalid / unlimited).
    Ack {
        /// Encoded credit count.
        credits: u8,
    },
    /// Receiver not ready; retry after the encoded timer ([`rnr_timer_micros`]).
    RnrNak {
        /// Encoded RNR timer (0..=31).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
    /// Kind `10`, reserved: kept as the raw syndrome byte.
    Reserved(u8),
}

impl Syndrome {
    /// Decode a syndrome byte (bit 7 is reserved and ignored).
    pub const fn from_byte(b: u8) -> Syndrome {
        let v = b & 0x1f;
        match (b >> 5) & 3 {
            0 => Syndrome::Ack { credits: v },
            1 => Syndrome::RnrNak { timer: v },
            3 => Syndrome::Nak(NakCode::from_bits(v)),
            _ => Syndrome::Reserved(b & 0x7f),
        }
    }

    /// Encode as a syndrome byte.
    pub const fn byte(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            Syndrome::Nak(code) => 0x60 | code.bits(),
            Syndrome::Reserved(b) => 0x40 | (b & 0x1f),
        }
    }
}

/// The RNR NAK timer encodings of IBA table 45, in microseconds (code 0 is the longest, 655.36 ms).
pub const RNR_TIMER_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
    10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
];

/// The delay an encoded RNR timer asks for, in microseconds.
pub const fn rnr_timer_micros(code: u8) -> u32 {
    RNR_TIMER_MICROS[(code & 0x1f) as usize]
}

view!(
    /// A read/write view of an AETH.
    AethPacket, AETH_LEN
);

impl<T: AsRef<[u8]>> AethPacket<T> {
    /// Syndrome.
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from_byte(self.buffer.as_ref()[0])
    }
    /// Message sequence number.
    pub fn msn(&self) -> u32 {
        u24_at(self.buffer.as_ref(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AethPacket<T> {
    /// Set the syndrome.
    pub fn set_syndrome(&mut self, s: Syndrome) {
        self.buffer.as_mut()[0] = s.byte();
    }
    /// Set the MSN (24 bits).
    pub fn set_msn(&mut self, msn: u32) {
        set_u24(self.buffer.as_mut(), 1, msn);
    }
}

/// An AETH as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AethRepr {
    /// Syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl AethRepr {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &AethPacket<T>) -> Result<AethRepr> {
        p.check_len()?;
        Ok(AethRepr { syndrome: p.syndrome(), msn: p.msn() })
    }
    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        AETH_LEN
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut AethPacket<T>) {
        p.set_syndrome(self.syndrome);
        p.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syndromes_round_trip_every_byte() {
        for b in 0u8..0x80 {
            let s = Syndrome::from_byte(b);
            assert_eq!(Syndrome::from_byte(s.byte()), s, "{b:#x}");
            if !matches!(s, Syndrome::Reserved(_)) {
                assert_eq!(s.byte(), b);
            }
        }
        assert_eq!(Syndrome::from_byte(0x1f), Syndrome::Ack { credits: CREDITS_INVALID });
        assert_eq!(Syndrome::from_byte(0x60), Syndrome::Nak(NakCode::PsnSequenceError));
        assert_eq!(Syndrome::from_byte(0x62), Syndrome::Nak(NakCode::RemoteAccessError));
        assert_eq!(Syndrome::from_byte(0x2e), Syndrome::RnrNak { timer: 14 });
    }

    #[test]
    fn view_and_repr() {
        let bytes = [0x1fu8, 0x00, 0x00, 0x05];
        let p = AethPacket::new_checked(&bytes[..]).unwrap();
        let r = AethRepr::parse(&p).unwrap();
        assert_eq!(r, AethRepr { syndrome: Syndrome::Ack { credits: 0x1f }, msn: 5 });
        let mut out = [0xa5u8; 4];
        r.emit(&mut AethPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(AethPacket::new_checked(&bytes[..3]).unwrap_err(), crate::Error::Truncated);
    }

    #[test]
    fn rnr_timer_table_ends() {
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(rnr_timer_micros(1), 10);
        assert_eq!(rnr_timer_micros(31), 491_520);
    }
}
