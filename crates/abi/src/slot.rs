//! Fixed-size slot encodings of work requests and completions (little-endian).
//!
//! Send slot: a 96-byte header, then `max_send_sge` SGEs of 16 bytes or up to `max_inline_data`
//! inline bytes. Receive slot: 16 bytes, then SGEs. Completion: 48 bytes. Slot sizes are rounded up
//! to 16 bytes and fixed at QP/CQ creation, so the rings never allocate. Decoders check every
//! count against the slot and the QP's capacities and return an error for anything else.
//!
//! ```text
//! send:  0 wr_id u64 | 8 op u8 | 9 flags u8 | 10 has_ud u8 | 11 inline u8 | 12 imm/inv u32
//!       16 remote_addr u64 | 24 rkey u32 | 28 count u32 | 32 compare/add u64 | 40 swap u64
//!       48 dgid [16] | 64 sgid_index u8 | 65 hop_limit u8 | 66 tclass u8 | 67 sl u8
//!       68 flow_label u32 | 72 dlid u16 | 76 remote_qpn u32 | 80 remote_qkey u32 | 96 data
//! recv:  0 wr_id u64 | 8 count u32 | 16 SGEs
//! sge:   0 addr u64 | 8 length u32 | 12 lkey u32
//! cqe:   0 wr_id u64 | 8 status u8 | 9 opcode u8 | 12 byte_len u32 | 16 imm u32
//!       20 invalidated_rkey u32 | 24 qp_num u32 | 28 src_qp u32 | 32 flags u32
//!       36 writes u32 (0, or the batch of the daemon's writes to clients' memory that must be
//!          made before the completion is handed out: see `Ring::writes_made`)
//!       40 places u32 | 44 has_places u8 (1: the client's placements before entry `places`
//!          must be made before the completion is handed out: see `placements`)
//! ```

use softrdma_transport::wr::{Payload, UdDest};
use softrdma_transport::{
    AddressVector, RecvWr, SendFlags, SendOp, SendWr, Sge, SgeList, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_wire::Qpn;

/// Bytes before the data of a send slot.
pub const SEND_HEADER: usize = 96;
/// Bytes before the SGEs of a receive slot.
pub const RECV_HEADER: usize = 16;
/// Bytes per SGE.
pub const SGE_LEN: usize = 16;
/// Bytes per completion slot.
pub const CQE_LEN: usize = 48;

/// A slot that does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadSlot(pub &'static str);

impl std::fmt::Display for BadSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed ring slot: {}", self.0)
    }
}

/// Size of a send slot for these capacities.
pub fn send_slot_size(max_sge: u32, max_inline: u32) -> u32 {
    let data = (max_sge as usize * SGE_LEN).max(max_inline as usize);
    (SEND_HEADER + data).next_multiple_of(16) as u32
}

/// Most bytes of data a client asks softrdmad's send slots to have room for, whatever the QP's
/// capacities (`Request::CreateQp`'s `copy_room`): a small payload in the client's own memory
/// (a process_vm region) travels in the slot, copied when posted, as inline data, and the daemon
/// reads none of it. Asked for only by a process with such regions: larger slots spread a ring
/// over more lines (`perf write-bw -s 64` through a daemon, whose regions the daemon maps: 18 %
/// slower with every slot at 352 bytes).
pub const COPY_ROOM: u32 = 256;

/// Most inline bytes a send slot of `slot_size` bytes holds.
pub fn inline_room(slot_size: u32) -> u32 {
    slot_size.saturating_sub(SEND_HEADER as u32)
}

/// The bytes of a send slot the work request in it uses, by its header (the slot's first
/// [`SEND_HEADER`] bytes; a shorter one says only those): the header and its SGEs or inline data.
/// A count beyond the slot is not checked here: the caller copies at most the slot, and
/// [`decode_send`] refuses it.
pub fn send_used(header: &[u8]) -> usize {
    if header.len() < SEND_HEADER {
        return header.len();
    }
    let count = u32_at(header, 28) as usize;
    let data = if header[11] == 1 { count } else { count.saturating_mul(SGE_LEN) };
    SEND_HEADER.saturating_add(data)
}

/// Size of a receive slot for `max_sge` SGEs.
pub fn recv_slot_size(max_sge: u32) -> u32 {
    (RECV_HEADER + max_sge.max(1) as usize * SGE_LEN).next_multiple_of(16) as u32
}

fn put<const N: usize>(b: &mut [u8], at: usize, v: [u8; N]) {
    b[at..at + N].copy_from_slice(&v);
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn put_sges(b: &mut [u8], at: usize, sgl: &[Sge]) {
    for (i, s) in sgl.iter().enumerate() {
        let o = at + i * SGE_LEN;
        put(b, o, s.addr.to_le_bytes());
        put(b, o + 8, s.length.to_le_bytes());
        put(b, o + 12, s.lkey.to_le_bytes());
    }
}

fn sges(b: &[u8], at: usize, n: usize) -> SgeList {
    // A plain loop: collecting from an iterator cost four times as much for the usual one SGE.
    let mut list = SgeList::new();
    for o in (at..at + n * SGE_LEN).step_by(SGE_LEN) {
        list.push(Sge { addr: u64_at(b, o), length: u32_at(b, o + 8), lkey: u32_at(b, o + 12) });
    }
    list
}

/// Encode a send WR into `slot` (its size from [`send_slot_size`]); fails if it does not fit.
pub fn encode_send(wr: &SendWr, slot: &mut [u8]) -> Result<(), BadSlot> {
    encode_send_header(wr, slot)?;
    match &wr.payload {
        Payload::Sgl(sgl) => {
            if SEND_HEADER + sgl.len() * SGE_LEN > slot.len() {
                return Err(BadSlot("too many SGEs for the slot"));
            }
            put(slot, 28, (sgl.len() as u32).to_le_bytes());
            put_sges(slot, SEND_HEADER, sgl);
            Ok(())
        }
        Payload::Inline(data) => put_inline(slot, data),
    }
}

/// Encode a send WR into `slot` with `data` as its inline payload in place of its own: the bytes
/// its SGEs name, which the poster copied at post time.
pub fn encode_send_copied(wr: &SendWr, data: &[u8], slot: &mut [u8]) -> Result<(), BadSlot> {
    encode_send_header(wr, slot)?;
    put_inline(slot, data)
}

fn put_inline(slot: &mut [u8], data: &[u8]) -> Result<(), BadSlot> {
    if SEND_HEADER + data.len() > slot.len() {
        return Err(BadSlot("inline data too long for the slot"));
    }
    slot[11] = 1;
    put(slot, 28, (data.len() as u32).to_le_bytes());
    slot[SEND_HEADER..SEND_HEADER + data.len()].copy_from_slice(data);
    Ok(())
}

/// Everything of a send slot but its payload.
fn encode_send_header(wr: &SendWr, slot: &mut [u8]) -> Result<(), BadSlot> {
    if slot.len() < SEND_HEADER {
        return Err(BadSlot("slot too small"));
    }
    slot[..SEND_HEADER].fill(0);
    put(slot, 0, wr.wr_id.to_le_bytes());
    let (op, imm, raddr, rkey, a, b) = match wr.op {
        SendOp::Send => (0u8, 0, 0, 0, 0, 0),
        SendOp::SendWithImm(i) => (1, i, 0, 0, 0, 0),
        SendOp::SendWithInv(k) => (2, k, 0, 0, 0, 0),
        SendOp::Write { remote_addr, rkey } => (3, 0, remote_addr, rkey, 0, 0),
        SendOp::WriteWithImm { remote_addr, rkey, imm } => (4, imm, remote_addr, rkey, 0, 0),
        SendOp::Read { remote_addr, rkey } => (5, 0, remote_addr, rkey, 0, 0),
        SendOp::CompareSwap { remote_addr, rkey, compare, swap } => (6, 0, remote_addr, rkey, compare, swap),
        SendOp::FetchAdd { remote_addr, rkey, add } => (7, 0, remote_addr, rkey, add, 0),
    };
    slot[8] = op;
    slot[9] = (0..4).fold(
        0u8,
        |acc, bit| {
            if wr.flags.contains(SendFlags::from_bits(1 << bit)) {
                acc | (1 << bit)
            } else {
                acc
            }
        },
    );
    put(slot, 12, imm.to_le_bytes());
    put(slot, 16, raddr.to_le_bytes());
    put(slot, 24, rkey.to_le_bytes());
    put(slot, 32, a.to_le_bytes());
    put(slot, 40, b.to_le_bytes());
    if let Some(ud) = &wr.ud {
        slot[10] = 1;
        put(slot, 48, ud.av.dgid);
        slot[64] = ud.av.sgid_index;
        slot[65] = ud.av.hop_limit;
        slot[66] = ud.av.traffic_class;
        slot[67] = ud.av.sl;
        put(slot, 68, ud.av.flow_label.to_le_bytes());
        put(slot, 72, ud.av.dlid.to_le_bytes());
        put(slot, 76, ud.remote_qpn.value().to_le_bytes());
        put(slot, 80, ud.remote_qkey.to_le_bytes());
    }
    Ok(())
}

/// Decode a send slot, allowing at most `max_sge` SGEs and `max_inline` inline bytes.
pub fn decode_send(slot: &[u8], max_sge: u32, max_inline: u32) -> Result<SendWr, BadSlot> {
    if slot.len() < SEND_HEADER {
        return Err(BadSlot("slot too small"));
    }
    let wr_id = u64_at(slot, 0);
    let imm = u32_at(slot, 12);
    let remote_addr = u64_at(slot, 16);
    let rkey = u32_at(slot, 24);
    let count = u32_at(slot, 28) as usize;
    let (a, b) = (u64_at(slot, 32), u64_at(slot, 40));
    let op = match slot[8] {
        0 => SendOp::Send,
        1 => SendOp::SendWithImm(imm),
        2 => SendOp::SendWithInv(imm),
        3 => SendOp::Write { remote_addr, rkey },
        4 => SendOp::WriteWithImm { remote_addr, rkey, imm },
        5 => SendOp::Read { remote_addr, rkey },
        6 => SendOp::CompareSwap { remote_addr, rkey, compare: a, swap: b },
        7 => SendOp::FetchAdd { remote_addr, rkey, add: a },
        _ => return Err(BadSlot("unknown opcode")),
    };
    if slot[9] & !0xf != 0 {
        return Err(BadSlot("unknown send flags"));
    }
    let flags = SendFlags::from_bits(u32::from(slot[9]));
    let ud = match slot[10] {
        0 => None,
        1 => Some(UdDest {
            av: AddressVector {
                dgid: slot[48..64].try_into().expect("16 bytes"),
                sgid_index: slot[64],
                hop_limit: slot[65],
                traffic_class: slot[66],
                flow_label: u32_at(slot, 68),
                dlid: u16::from_le_bytes([slot[72], slot[73]]),
                sl: slot[67],
            },
            remote_qpn: Qpn::new(u32_at(slot, 76)),
            remote_qkey: u32_at(slot, 80),
        }),
        _ => return Err(BadSlot("bad UD marker")),
    };
    let payload = match slot[11] {
        0 => {
            if count > max_sge as usize || SEND_HEADER + count * SGE_LEN > slot.len() {
                return Err(BadSlot("SGE count above the QP's max_send_sge"));
            }
            Payload::Sgl(sges(slot, SEND_HEADER, count))
        }
        1 => {
            if count > max_inline as usize || SEND_HEADER + count > slot.len() {
                return Err(BadSlot("inline length above the QP's max_inline_data"));
            }
            Payload::Inline(slot[SEND_HEADER..SEND_HEADER + count].to_vec())
        }
        _ => return Err(BadSlot("bad payload marker")),
    };
    Ok(SendWr { wr_id, op, payload, flags, ud })
}

/// Encode a receive WR.
pub fn encode_recv(wr: &RecvWr, slot: &mut [u8]) -> Result<(), BadSlot> {
    if RECV_HEADER + wr.sgl.len() * SGE_LEN > slot.len() {
        return Err(BadSlot("too many SGEs for the slot"));
    }
    slot[..RECV_HEADER].fill(0);
    put(slot, 0, wr.wr_id.to_le_bytes());
    put(slot, 8, (wr.sgl.len() as u32).to_le_bytes());
    put_sges(slot, RECV_HEADER, &wr.sgl);
    Ok(())
}

/// Decode a receive slot with at most `max_sge` SGEs.
pub fn decode_recv(slot: &[u8], max_sge: u32) -> Result<RecvWr, BadSlot> {
    if slot.len() < RECV_HEADER {
        return Err(BadSlot("slot too small"));
    }
    let count = u32_at(slot, 8) as usize;
    if count > max_sge as usize || RECV_HEADER + count * SGE_LEN > slot.len() {
        return Err(BadSlot("SGE count above max_recv_sge"));
    }
    Ok(RecvWr { wr_id: u64_at(slot, 0), sgl: sges(slot, RECV_HEADER, count) })
}

/// Encode a completion into a [`CQE_LEN`]-byte slot.
pub fn encode_cqe(wc: &WorkCompletion, slot: &mut [u8; CQE_LEN]) {
    slot.fill(0);
    put(slot, 0, wc.wr_id.to_le_bytes());
    slot[8] = wc.status as u8;
    slot[9] = wc.opcode as u8;
    put(slot, 12, wc.byte_len.to_le_bytes());
    put(slot, 16, wc.imm.to_le_bytes());
    put(slot, 20, wc.invalidated_rkey.to_le_bytes());
    put(slot, 24, wc.qp_num.value().to_le_bytes());
    put(slot, 28, wc.src_qp.value().to_le_bytes());
    put(slot, 32, wc.flags.bits().to_le_bytes());
}

fn status_from(n: u8) -> Option<WcStatus> {
    use WcStatus::*;
    [
        Success,
        LocLenErr,
        LocQpOpErr,
        LocProtErr,
        WrFlushErr,
        BadRespErr,
        LocAccessErr,
        RemInvReqErr,
        RemAccessErr,
        RemOpErr,
        RetryExcErr,
        RnrRetryExcErr,
        FatalErr,
        GeneralErr,
    ]
    .into_iter()
    .find(|s| *s as u8 == n)
}

fn opcode_from(n: u8) -> Option<WcOpcode> {
    use WcOpcode::*;
    [Send, RdmaWrite, RdmaRead, CompSwap, FetchAdd, Recv, RecvRdmaWithImm].into_iter().find(|o| *o as u8 == n)
}

/// Say in an encoded completion that write batch `batch` (never 0) must be made before it is
/// handed out (see [`cqe_writes`]).
pub fn set_cqe_writes(slot: &mut [u8; CQE_LEN], batch: u32) {
    put(slot, 36, batch.to_le_bytes());
}

/// The write batch a completion slot waits for; 0: none.
pub fn cqe_writes(slot: &[u8; CQE_LEN]) -> u32 {
    u32_at(slot, 36)
}

/// Say in an encoded completion that the entries of its client's placement ring before `end`
/// must be made before it is handed out (see [`cqe_places`]).
pub fn set_cqe_places(slot: &mut [u8; CQE_LEN], end: u32) {
    put(slot, 40, end.to_le_bytes());
    slot[44] = 1;
}

/// The placement entry a completion slot's placements end before, if it names any.
pub fn cqe_places(slot: &[u8; CQE_LEN]) -> Option<u32> {
    (slot[44] == 1).then(|| u32_at(slot, 40))
}

/// Decode a completion slot.
pub fn decode_cqe(slot: &[u8; CQE_LEN]) -> Result<WorkCompletion, BadSlot> {
    let mut flags = WcFlags::NONE;
    let bits = u32_at(slot, 32);
    for f in [WcFlags::GRH, WcFlags::WITH_IMM, WcFlags::WITH_INV] {
        if bits & f.bits() != 0 {
            flags = flags.with(f);
        }
    }
    Ok(WorkCompletion {
        wr_id: u64_at(slot, 0),
        status: status_from(slot[8]).ok_or(BadSlot("unknown status"))?,
        opcode: opcode_from(slot[9]).ok_or(BadSlot("unknown opcode"))?,
        byte_len: u32_at(slot, 12),
        imm: u32_at(slot, 16),
        invalidated_rkey: u32_at(slot, 20),
        qp_num: Qpn::new(u32_at(slot, 24)),
        src_qp: Qpn::new(u32_at(slot, 28)),
        flags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send slot says the bytes it uses: the header and its SGEs, or its inline bytes; a
    /// header alone, or less, says itself.
    #[test]
    fn a_send_slot_says_the_bytes_it_uses() {
        let sge = |addr| Sge { addr, length: 8, lkey: 1 };
        let mut slot = vec![0u8; send_slot_size(4, 64) as usize];
        let wr = |wr_id, payload| SendWr { wr_id, op: SendOp::Send, payload, flags: SendFlags::NONE, ud: None };
        let two = wr(1, Payload::Sgl(vec![sge(0x1000), sge(0x2000)].into()));
        encode_send(&two, &mut slot).unwrap();
        assert_eq!(send_used(&slot[..SEND_HEADER]), SEND_HEADER + 2 * SGE_LEN);
        assert_eq!(decode_send(&slot[..send_used(&slot[..SEND_HEADER])], 4, 64).unwrap(), two);
        let inline = wr(2, Payload::Inline(vec![7; 13]));
        encode_send(&inline, &mut slot).unwrap();
        assert_eq!(send_used(&slot[..SEND_HEADER]), SEND_HEADER + 13);
        assert_eq!(decode_send(&slot[..SEND_HEADER + 13], 4, 64).unwrap(), inline);
        assert_eq!(send_used(&slot[..40]), 40);
        // A count that lies is cut by the copy (to the slot) and refused by the decoder; so is a
        // payload marker that is neither SGEs nor inline bytes.
        slot[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        slot[11] = 0;
        let used = send_used(&slot[..SEND_HEADER]);
        assert_eq!(used, SEND_HEADER.saturating_add((u32::MAX as usize).saturating_mul(SGE_LEN)));
        assert!(decode_send(&slot[..used.min(slot.len())], 4, 64).is_err());
        slot[28..32].copy_from_slice(&1u32.to_le_bytes());
        slot[11] = 2;
        assert_eq!(send_used(&slot[..SEND_HEADER]), SEND_HEADER + SGE_LEN);
        assert!(decode_send(&slot[..SEND_HEADER + SGE_LEN], 4, 64).is_err());
    }

    #[test]
    fn send_round_trips() {
        let sge = |a| Sge { addr: a, length: 77, lkey: 0x1234 };
        let av = AddressVector {
            dgid: [7; 16],
            sgid_index: 1,
            hop_limit: 64,
            traffic_class: 3,
            flow_label: 9,
            dlid: 0,
            sl: 2,
        };
        let ops = [
            SendOp::Send,
            SendOp::SendWithImm(5),
            SendOp::SendWithInv(6),
            SendOp::Write { remote_addr: 1 << 40, rkey: 9 },
            SendOp::WriteWithImm { remote_addr: 8, rkey: 9, imm: 10 },
            SendOp::Read { remote_addr: 8, rkey: 9 },
            SendOp::CompareSwap { remote_addr: 8, rkey: 9, compare: 1, swap: 2 },
            SendOp::FetchAdd { remote_addr: 8, rkey: 9, add: 3 },
        ];
        let size = send_slot_size(4, 64) as usize;
        for op in ops {
            for payload in [
                Payload::Sgl(vec![sge(1), sge(2), sge(3)].into()),
                Payload::Inline(vec![0xab; 64]),
                Payload::Sgl(vec![].into()),
            ] {
                for ud in [None, Some(UdDest { av, remote_qpn: Qpn::new(0x42), remote_qkey: 0x1111 })] {
                    let wr = SendWr {
                        wr_id: 0xfeed,
                        op,
                        payload: payload.clone(),
                        flags: SendFlags::SIGNALED.with(SendFlags::SOLICITED),
                        ud,
                    };
                    let mut slot = vec![0x5a; size];
                    encode_send(&wr, &mut slot).unwrap();
                    assert_eq!(decode_send(&slot, 4, 64).unwrap(), wr);
                    // The same request with bytes copied at post time in place of its payload.
                    encode_send_copied(&wr, &[0xcd; 40], &mut slot).unwrap();
                    let copied = SendWr { payload: Payload::Inline(vec![0xcd; 40]), ..wr.clone() };
                    assert_eq!(decode_send(&slot, 4, 64).unwrap(), copied);
                }
            }
        }
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            payload: Payload::Sgl(vec![sge(1); 3].into()),
            flags: SendFlags::NONE,
            ud: None,
        };
        let mut slot = vec![0; size];
        encode_send(&wr, &mut slot).unwrap();
        assert!(decode_send(&slot, 2, 64).is_err(), "above max_sge");
        slot[8] = 99;
        assert!(decode_send(&slot, 4, 64).is_err());
    }

    /// A completion names the batch of writes it waits for (none when encoded), and decodes the
    /// same with or without one.
    #[test]
    fn a_completion_names_the_writes_it_waits_for() {
        let wc = WorkCompletion {
            wr_id: 9,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 8,
            imm: 0,
            invalidated_rkey: 0,
            qp_num: Qpn::new(0x11),
            src_qp: Qpn::new(0),
            flags: WcFlags::NONE,
        };
        let mut slot = [0xffu8; CQE_LEN];
        encode_cqe(&wc, &mut slot);
        assert_eq!(cqe_writes(&slot), 0);
        set_cqe_writes(&mut slot, 0xdead_beef);
        assert_eq!(cqe_writes(&slot), 0xdead_beef);
        assert_eq!(cqe_places(&slot), None);
        set_cqe_places(&mut slot, 0);
        assert_eq!(cqe_places(&slot), Some(0));
        set_cqe_places(&mut slot, 77);
        assert_eq!(cqe_places(&slot), Some(77));
        assert_eq!(decode_cqe(&slot).unwrap(), wc);
    }

    #[test]
    fn recv_and_cqe_round_trip() {
        let wr = RecvWr { wr_id: 3, sgl: vec![Sge { addr: 1, length: 2, lkey: 3 }].into() };
        let mut slot = vec![0xee; recv_slot_size(2) as usize];
        encode_recv(&wr, &mut slot).unwrap();
        assert_eq!(decode_recv(&slot, 2).unwrap(), wr);
        slot[8] = 9;
        assert!(decode_recv(&slot, 2).is_err());
        let wc = WorkCompletion {
            wr_id: 9,
            status: WcStatus::RetryExcErr,
            opcode: WcOpcode::RecvRdmaWithImm,
            byte_len: 100,
            imm: 7,
            invalidated_rkey: 0,
            qp_num: Qpn::new(0x11),
            src_qp: Qpn::new(0x12),
            flags: WcFlags::WITH_IMM.with(WcFlags::GRH),
        };
        let mut c = [0u8; CQE_LEN];
        encode_cqe(&wc, &mut c);
        assert_eq!(decode_cqe(&c).unwrap(), wc);
    }
}
