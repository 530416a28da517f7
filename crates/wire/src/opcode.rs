//! The opcode table: the single source of truth for what each BTH opcode carries.
//!
//! For every opcode it records the transport (RC, UC, UD, CNP), the extension headers that follow the
//! BTH (always in the fixed order DETH, RETH, AtomicETH, AETH, AtomicAckETH, ImmDt, IETH), whether a
//! payload follows, and its semantic flags (request or response, first/middle/last/only, send, write,
//! read, atomic, immediate, invalidate). Engines ask the table; they never enumerate opcodes.
//! The values follow IBA volume 1 table 38 and rxe's `rxe_opcode.c`. RD and XRC opcodes are not
//! spoken and parse as [`crate::Error::UnknownOpcode`].

use core::fmt;

/// Transport service an opcode belongs to (the top three bits of the opcode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable connected.
    Uc,
    /// Unreliable datagram.
    Ud,
    /// RoCEv2 congestion notification packet.
    Cnp,
}

/// A set of extension headers, as bit flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeaderSet(u16);

impl HeaderSet {
    /// No extension header.
    pub const NONE: HeaderSet = HeaderSet(0);
    /// Datagram extended transport header (8 bytes).
    pub const DETH: HeaderSet = HeaderSet(1 << 0);
    /// RDMA extended transport header (16 bytes).
    pub const RETH: HeaderSet = HeaderSet(1 << 1);
    /// Atomic extended transport header (28 bytes).
    pub const ATOMIC_ETH: HeaderSet = HeaderSet(1 << 2);
    /// ACK extended transport header (4 bytes).
    pub const AETH: HeaderSet = HeaderSet(1 << 3);
    /// Atomic acknowledge extended transport header (8 bytes).
    pub const ATOMIC_ACK_ETH: HeaderSet = HeaderSet(1 << 4);
    /// Immediate data (4 bytes).
    pub const IMMDT: HeaderSet = HeaderSet(1 << 5);
    /// Invalidate extended transport header (4 bytes).
    pub const IETH: HeaderSet = HeaderSet(1 << 6);
    /// The 16 reserved bytes of a RoCEv2 CNP.
    pub const CNP_RSVD: HeaderSet = HeaderSet(1 << 7);

    /// Every header in wire order with its length.
    pub const ORDER: [(HeaderSet, usize); 8] = [
        (HeaderSet::DETH, 8),
        (HeaderSet::RETH, 16),
        (HeaderSet::ATOMIC_ETH, 28),
        (HeaderSet::AETH, 4),
        (HeaderSet::ATOMIC_ACK_ETH, 8),
        (HeaderSet::IMMDT, 4),
        (HeaderSet::IETH, 4),
        (HeaderSet::CNP_RSVD, 16),
    ];

    /// Union of two sets.
    pub const fn with(self, other: HeaderSet) -> HeaderSet {
        HeaderSet(self.0 | other.0)
    }

    /// Every header of `other` is in `self`.
    pub const fn contains(self, other: HeaderSet) -> bool {
        self.0 & other.0 == other.0
    }

    /// Byte offset of header `h` measured from the start of the BTH, if present.
    pub const fn offset_of(self, h: HeaderSet) -> Option<usize> {
        if !self.contains(h) || h.0.count_ones() != 1 || h.0 > Self::CNP_RSVD.0 {
            return None;
        }
        // The headers before `h` in wire order are the set's lower bits.
        Some(crate::bth::BTH_LEN + LEN_OF_SET[(self.0 & (h.0 - 1)) as usize] as usize)
    }

    /// Length of BTH plus every header of the set.
    pub const fn header_len(self) -> usize {
        crate::bth::BTH_LEN + LEN_OF_SET[(self.0 & 0xff) as usize] as usize
    }
}

/// The total length of the headers of every subset of the eight (indexed by the set's bits, which
/// follow wire order): a set's length and a header's offset are one table read, not a walk over
/// [`HeaderSet::ORDER`] (parsing asks for them several times per packet).
const LEN_OF_SET: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut s = 0;
    while s < 256 {
        let mut len = 0;
        let mut i = 0;
        while i < HeaderSet::ORDER.len() {
            let (h, l) = HeaderSet::ORDER[i];
            // ORDER lists the headers by bit, lowest first.
            assert!(h.0 == 1 << i);
            if s & (1 << i) != 0 {
                len += l;
            }
            i += 1;
        }
        t[s] = len as u8;
        s += 1;
    }
    t
};

/// Semantic flags of an opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u16);

impl Flags {
    /// A request (requester → responder).
    pub const REQ: Flags = Flags(1 << 0);
    /// A response (responder → requester).
    pub const RESP: Flags = Flags(1 << 1);
    /// Carries payload.
    pub const PAYLOAD: Flags = Flags(1 << 2);
    /// First packet of a multi-packet message.
    pub const FIRST: Flags = Flags(1 << 3);
    /// Middle packet.
    pub const MIDDLE: Flags = Flags(1 << 4);
    /// Last packet of a multi-packet message.
    pub const LAST: Flags = Flags(1 << 5);
    /// SEND operation (consumes a receive WQE).
    pub const SEND: Flags = Flags(1 << 6);
    /// RDMA WRITE.
    pub const WRITE: Flags = Flags(1 << 7);
    /// RDMA READ (request or response).
    pub const READ: Flags = Flags(1 << 8);
    /// Atomic operation (request or acknowledge).
    pub const ATOMIC: Flags = Flags(1 << 9);
    /// Carries immediate data.
    pub const IMM: Flags = Flags(1 << 10);
    /// Carries an rkey to invalidate.
    pub const INV: Flags = Flags(1 << 11);
    /// Plain ACK/NAK.
    pub const ACK: Flags = Flags(1 << 12);
    /// Congestion notification.
    pub const CNP: Flags = Flags(1 << 13);

    /// Union.
    pub const fn with(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }

    /// All flags of `other` set.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The only packet of a message (both FIRST and LAST).
    pub const ONLY: Flags = Flags(Self::FIRST.0 | Self::LAST.0);
}

/// What the table says about one opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// Name as in the IBA and rxe (`RC_SEND_ONLY`...).
    pub name: &'static str,
    /// Transport the opcode belongs to.
    pub qp_type: QpType,
    /// Extension headers following the BTH.
    pub headers: HeaderSet,
    /// Semantic flags.
    pub flags: Flags,
}

impl OpcodeInfo {
    /// Test a flag.
    pub const fn is(&self, f: Flags) -> bool {
        self.flags.contains(f)
    }

    /// Length of BTH plus extension headers.
    pub const fn header_len(&self) -> usize {
        self.headers.header_len()
    }

    /// This is the first packet of a message (FIRST or ONLY).
    pub const fn starts_message(&self) -> bool {
        self.is(Flags::FIRST)
    }

    /// This is the last packet of a message (LAST or ONLY).
    pub const fn ends_message(&self) -> bool {
        self.is(Flags::LAST)
    }
}

/// A BTH opcode. Any byte is representable; [`Opcode::info`] says whether it is one we speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(pub u8);

const fn base(op: u8) -> Option<(&'static str, HeaderSet, Flags)> {
    use Flags as F;
    use HeaderSet as H;
    let req_send = F::REQ.with(F::SEND).with(F::PAYLOAD);
    let req_write = F::REQ.with(F::WRITE).with(F::PAYLOAD);
    Some(match op {
        0x00 => ("SEND_FIRST", H::NONE, req_send.with(F::FIRST)),
        0x01 => ("SEND_MIDDLE", H::NONE, req_send.with(F::MIDDLE)),
        0x02 => ("SEND_LAST", H::NONE, req_send.with(F::LAST)),
        0x03 => ("SEND_LAST_WITH_IMMEDIATE", H::IMMDT, req_send.with(F::LAST).with(F::IMM)),
        0x04 => ("SEND_ONLY", H::NONE, req_send.with(F::ONLY)),
        0x05 => ("SEND_ONLY_WITH_IMMEDIATE", H::IMMDT, req_send.with(F::ONLY).with(F::IMM)),
        0x06 => ("RDMA_WRITE_FIRST", H::RETH, req_write.with(F::FIRST)),
        0x07 => ("RDMA_WRITE_MIDDLE", H::NONE, req_write.with(F::MIDDLE)),
        0x08 => ("RDMA_WRITE_LAST", H::NONE, req_write.with(F::LAST)),
        0x09 => ("RDMA_WRITE_LAST_WITH_IMMEDIATE", H::IMMDT, req_write.with(F::LAST).with(F::IMM)),
        0x0a => ("RDMA_WRITE_ONLY", H::RETH, req_write.with(F::ONLY)),
        0x0b => ("RDMA_WRITE_ONLY_WITH_IMMEDIATE", H::RETH.with(H::IMMDT), req_write.with(F::ONLY).with(F::IMM)),
        0x0c => ("RDMA_READ_REQUEST", H::RETH, F::REQ.with(F::READ).with(F::ONLY)),
        0x0d => ("RDMA_READ_RESPONSE_FIRST", H::AETH, F::RESP.with(F::READ).with(F::PAYLOAD).with(F::FIRST)),
        0x0e => ("RDMA_READ_RESPONSE_MIDDLE", H::NONE, F::RESP.with(F::READ).with(F::PAYLOAD).with(F::MIDDLE)),
        0x0f => ("RDMA_READ_RESPONSE_LAST", H::AETH, F::RESP.with(F::READ).with(F::PAYLOAD).with(F::LAST)),
        0x10 => ("RDMA_READ_RESPONSE_ONLY", H::AETH, F::RESP.with(F::READ).with(F::PAYLOAD).with(F::ONLY)),
        0x11 => ("ACKNOWLEDGE", H::AETH, F::RESP.with(F::ACK).with(F::ONLY)),
        0x12 => ("ATOMIC_ACKNOWLEDGE", H::AETH.with(H::ATOMIC_ACK_ETH), F::RESP.with(F::ATOMIC).with(F::ONLY)),
        0x13 => ("COMPARE_SWAP", H::ATOMIC_ETH, F::REQ.with(F::ATOMIC).with(F::ONLY)),
        0x14 => ("FETCH_ADD", H::ATOMIC_ETH, F::REQ.with(F::ATOMIC).with(F::ONLY)),
        0x16 => ("SEND_LAST_WITH_INVALIDATE", H::IETH, req_send.with(F::LAST).with(F::INV)),
        0x17 => ("SEND_ONLY_WITH_INVALIDATE", H::IETH, req_send.with(F::ONLY).with(F::INV)),
        _ => return None,
    })
}

const fn build(op: u8) -> Option<OpcodeInfo> {
    let low = op & 0x1f;
    match op >> 5 {
        // RC
        0 => match base(low) {
            Some((name, headers, flags)) => Some(OpcodeInfo { name, qp_type: QpType::Rc, headers, flags }),
            None => None,
        },
        // UC: sends and writes only, no responses, no invalidate.
        1 if low <= 0x0b => match base(low) {
            Some((name, headers, flags)) => Some(OpcodeInfo { name, qp_type: QpType::Uc, headers, flags }),
            None => None,
        },
        // UD: SEND_ONLY and SEND_ONLY_WITH_IMMEDIATE, each with a DETH.
        3 if low == 0x04 || low == 0x05 => match base(low) {
            Some((name, headers, flags)) => {
                Some(OpcodeInfo { name, qp_type: QpType::Ud, headers: HeaderSet::DETH.with(headers), flags })
            }
            None => None,
        },
        // 0x81: RoCEv2 congestion notification packet.
        4 if low == 0x01 => {
            Some(OpcodeInfo { name: "CNP", qp_type: QpType::Cnp, headers: HeaderSet::CNP_RSVD, flags: Flags::CNP })
        }
        _ => None,
    }
}

const fn build_table() -> [Option<OpcodeInfo>; 256] {
    let mut t = [None; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = build(i as u8);
        i += 1;
    }
    t
}

static TABLE: [Option<OpcodeInfo>; 256] = build_table();

impl Opcode {
    /// The table entry, or `None` for a reserved / unsupported code.
    pub fn info(self) -> Option<&'static OpcodeInfo> {
        TABLE[self.0 as usize].as_ref()
    }

    /// The opcode of `qp_type` whose base (low five bits) is `base`, if that pair exists.
    pub fn of(qp_type: QpType, base: u8) -> Option<Opcode> {
        let prefix = match qp_type {
            QpType::Rc => 0x00,
            QpType::Uc => 0x20,
            QpType::Ud => 0x60,
            QpType::Cnp => 0x80,
        };
        let op = Opcode(prefix | (base & 0x1f));
        op.info().map(|_| op)
    }

    /// The opcode with the transport bits removed (e.g. 0x04 for RC, UC and UD SEND_ONLY).
    pub const fn base(self) -> u8 {
        self.0 & 0x1f
    }

    /// Every opcode the table knows, in numeric order.
    pub fn all() -> impl Iterator<Item = (Opcode, &'static OpcodeInfo)> {
        TABLE.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|info| (Opcode(i as u8), info)))
    }
}

/// Base opcodes (low five bits), shared by RC, UC and UD, named for callers that build packets.
pub mod base {
    /// SEND_FIRST.
    pub const SEND_FIRST: u8 = 0x00;
    /// SEND_MIDDLE.
    pub const SEND_MIDDLE: u8 = 0x01;
    /// SEND_LAST.
    pub const SEND_LAST: u8 = 0x02;
    /// SEND_LAST_WITH_IMMEDIATE.
    pub const SEND_LAST_IMM: u8 = 0x03;
    /// SEND_ONLY.
    pub const SEND_ONLY: u8 = 0x04;
    /// SEND_ONLY_WITH_IMMEDIATE.
    pub const SEND_ONLY_IMM: u8 = 0x05;
    /// RDMA_WRITE_FIRST.
    pub const WRITE_FIRST: u8 = 0x06;
    /// RDMA_WRITE_MIDDLE.
    pub const WRITE_MIDDLE: u8 = 0x07;
    /// RDMA_WRITE_LAST.
    pub const WRITE_LAST: u8 = 0x08;
    /// RDMA_WRITE_LAST_WITH_IMMEDIATE.
    pub const WRITE_LAST_IMM: u8 = 0x09;
    /// RDMA_WRITE_ONLY.
    pub const WRITE_ONLY: u8 = 0x0a;
    /// RDMA_WRITE_ONLY_WITH_IMMEDIATE.
    pub const WRITE_ONLY_IMM: u8 = 0x0b;
    /// RDMA_READ_REQUEST.
    pub const READ_REQUEST: u8 = 0x0c;
    /// RDMA_READ_RESPONSE_FIRST.
    pub const READ_RESPONSE_FIRST: u8 = 0x0d;
    /// RDMA_READ_RESPONSE_MIDDLE.
    pub const READ_RESPONSE_MIDDLE: u8 = 0x0e;
    /// RDMA_READ_RESPONSE_LAST.
    pub const READ_RESPONSE_LAST: u8 = 0x0f;
    /// RDMA_READ_RESPONSE_ONLY.
    pub const READ_RESPONSE_ONLY: u8 = 0x10;
    /// ACKNOWLEDGE.
    pub const ACKNOWLEDGE: u8 = 0x11;
    /// ATOMIC_ACKNOWLEDGE.
    pub const ATOMIC_ACKNOWLEDGE: u8 = 0x12;
    /// COMPARE_SWAP.
    pub const COMPARE_SWAP: u8 = 0x13;
    /// FETCH_ADD.
    pub const FETCH_ADD: u8 = 0x14;
    /// SEND_LAST_WITH_INVALIDATE.
    pub const SEND_LAST_INV: u8 = 0x16;
    /// SEND_ONLY_WITH_INVALIDATE.
    pub const SEND_ONLY_INV: u8 = 0x17;
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.info() {
            Some(info) => {
                let t = match info.qp_type {
                    QpType::Rc => "RC_",
                    QpType::Uc => "UC_",
                    QpType::Ud => "UD_",
                    QpType::Cnp => "",
                };
                write!(f, "{t}{}", info.name)
            }
            None => write!(f, "OPCODE_{:#04x}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_counts_per_transport() {
        let count = |t| Opcode::all().filter(|(_, i)| i.qp_type == t).count();
        assert_eq!(count(QpType::Rc), 23);
        assert_eq!(count(QpType::Uc), 12);
        assert_eq!(count(QpType::Ud), 2);
        assert_eq!(count(QpType::Cnp), 1);
    }

    #[test]
    fn offsets_and_lengths_match_a_walk_over_the_order() {
        for bits in 0u16..256 {
            let set = HeaderSet(bits);
            let mut off = crate::bth::BTH_LEN;
            for (h, len) in HeaderSet::ORDER {
                assert_eq!(set.offset_of(h), set.contains(h).then_some(off), "{bits:#x} {h:?}");
                if set.contains(h) {
                    off += len;
                }
            }
            assert_eq!(set.header_len(), off);
            assert_eq!(set.offset_of(HeaderSet::NONE), None);
            assert_eq!(set.offset_of(HeaderSet::RETH.with(HeaderSet::AETH)), None);
        }
    }

    #[test]
    fn known_offsets() {
        let wr_imm = Opcode(0x0b).info().unwrap();
        assert_eq!(wr_imm.headers.offset_of(HeaderSet::RETH), Some(12));
        assert_eq!(wr_imm.headers.offset_of(HeaderSet::IMMDT), Some(28));
        assert_eq!(wr_imm.header_len(), 32);
        let ud_imm = Opcode(0x65).info().unwrap();
        assert_eq!(ud_imm.headers.offset_of(HeaderSet::DETH), Some(12));
        assert_eq!(ud_imm.headers.offset_of(HeaderSet::IMMDT), Some(20));
        let aack = Opcode(0x12).info().unwrap();
        assert_eq!(aack.headers.offset_of(HeaderSet::ATOMIC_ACK_ETH), Some(16));
        assert_eq!(aack.header_len(), 24);
        assert_eq!(Opcode(0x13).info().unwrap().header_len(), 40);
        assert_eq!(Opcode(0x81).info().unwrap().header_len(), 28);
    }

    #[test]
    fn every_entry_is_consistent() {
        for (op, info) in Opcode::all() {
            // Exactly one direction (CNP is neither).
            assert!(info.is(Flags::CNP) || (info.is(Flags::REQ) != info.is(Flags::RESP)), "{op}");
            // Immediate and invalidate flags match their headers.
            assert_eq!(info.is(Flags::IMM), info.headers.contains(HeaderSet::IMMDT), "{op}");
            assert_eq!(info.is(Flags::INV), info.headers.contains(HeaderSet::IETH), "{op}");
            // Writes carry a RETH exactly on their first packet.
            if info.is(Flags::WRITE) {
                assert_eq!(info.starts_message(), info.headers.contains(HeaderSet::RETH), "{op}");
            }
            // Read responses carry an AETH except in the middle.
            if info.is(Flags::READ) && info.is(Flags::RESP) {
                assert_eq!(!info.is(Flags::MIDDLE), info.headers.contains(HeaderSet::AETH), "{op}");
            }
            // UD requests always carry a DETH, nobody else does.
            assert_eq!(info.qp_type == QpType::Ud, info.headers.contains(HeaderSet::DETH), "{op}");
            // Offsets strictly increase and end at header_len.
            let mut last = 0;
            for (h, len) in HeaderSet::ORDER {
                if let Some(off) = info.headers.offset_of(h) {
                    assert!(off >= last.max(12), "{op}");
                    last = off + len;
                }
            }
            assert!(last == 0 || last == info.header_len(), "{op}");
            // Opcode::of reaches the same code from its transport and base.
            assert_eq!(Opcode::of(info.qp_type, op.base()), Some(op));
        }
    }

    #[test]
    fn every_rc_request_has_a_response_opcode() {
        for (op, info) in Opcode::all().filter(|(_, i)| i.qp_type == QpType::Rc && i.is(Flags::REQ)) {
            let resp = if info.is(Flags::READ) {
                base::READ_RESPONSE_ONLY
            } else if info.is(Flags::ATOMIC) {
                base::ATOMIC_ACKNOWLEDGE
            } else {
                base::ACKNOWLEDGE
            };
            assert!(Opcode::of(QpType::Rc, resp).unwrap().info().unwrap().is(Flags::RESP), "{op}");
        }
    }

    #[test]
    fn reserved_codes_are_unknown() {
        for op in [0x15u8, 0x18, 0x1f, 0x2c, 0x31, 0x40, 0x60, 0x66, 0x80, 0x82, 0xc0, 0xff] {
            assert!(Opcode(op).info().is_none(), "{op:#x}");
        }
    }
}
