//! Packet captures: a classic pcap reader and writer, and a classifier that finds RoCE frames.
//!
//! The reader takes the whole file as a byte slice and yields frames that borrow from it, so it
//! never allocates; every truncation is a typed [`CaptureError`], never a panic. It accepts both
//! byte orders and both timestamp resolutions (magic 0xa1b2c3d4 for microseconds, 0xa1b23c4d for
//! nanoseconds; the golden captures are little-endian microsecond files of link type Ethernet).
//! pcapng is not read.
//!
//! The writer (for the simulator to record failing runs) writes little-endian microsecond files
//! of link type Ethernet or raw IP.
//!
//! [`classify`] sorts a captured frame: Ethernet/SLL/raw IP → IPv4/IPv6 → UDP port 4791 is RoCEv2,
//! EtherType 0x8915 is RoCEv1, anything else is not RoCE. It looks only as deep as it must to decide;
//! whether the RoCE packet is well formed is for [`crate::roce`] to say.

use core::fmt;

use crate::ethernet::{EthernetFrame, ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETHERTYPE_ROCE_V1};
use crate::field::u16_at;
use crate::ipv4::PROTOCOL_UDP;
use crate::roce::ROCE_V2_PORT;

/// Length of the pcap file header.
pub const FILE_HEADER_LEN: usize = 24;
/// Length of a pcap record header.
pub const RECORD_HEADER_LEN: usize = 16;
/// Magic of a microsecond-resolution pcap file (as a native-endian u32).
pub const MAGIC_MICROS: u32 = 0xa1b2_c3d4;
/// Magic of a nanosecond-resolution pcap file.
pub const MAGIC_NANOS: u32 = 0xa1b2_3c4d;
/// Snapshot length the writer declares.
pub const WRITER_SNAPLEN: u32 = 0x0004_0000;

/// A pcap link type (the `network` field of the file header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkType {
    /// 1: Ethernet II.
    Ethernet,
    /// 101: raw IP (v4 or v6 by the version nibble).
    Raw,
    /// 228: raw IPv4.
    Ipv4,
    /// 229: raw IPv6.
    Ipv6,
    /// 113: Linux cooked capture v1 (16-byte header).
    LinuxSll,
    /// 276: Linux cooked capture v2 (20-byte header).
    LinuxSll2,
    /// Any other link type, kept as read.
    Unknown(u32),
}

impl LinkType {
    /// From the file header's value.
    pub const fn from_u32(v: u32) -> LinkType {
        match v {
            1 => LinkType::Ethernet,
            101 => LinkType::Raw,
            228 => LinkType::Ipv4,
            229 => LinkType::Ipv6,
            113 => LinkType::LinuxSll,
            276 => LinkType::LinuxSll2,
            x => LinkType::Unknown(x),
        }
    }

    /// The file header's value.
    pub const fn to_u32(self) -> u32 {
        match self {
            LinkType::Ethernet => 1,
            LinkType::Raw => 101,
            LinkType::Ipv4 => 228,
            LinkType::Ipv6 => 229,
            LinkType::LinuxSll => 113,
            LinkType::LinuxSll2 => 276,
            LinkType::Unknown(x) => x,
        }
    }
}

/// Why a capture file cannot be read (further).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaptureError {
    /// The file is shorter than the 24-byte file header.
    TruncatedFileHeader,
    /// The magic number is not a classic pcap one (pcapng starts 0x0a0d0d0a).
    BadMagic(u32),
    /// A record header is cut off at this file offset.
    TruncatedRecordHeader {
        /// File offset of the record header.
        offset: usize,
    },
    /// A record's data is cut off.
    TruncatedRecord {
        /// File offset of the record header.
        offset: usize,
        /// Captured length the record header claims.
        incl_len: u32,
        /// Bytes left in the file.
        available: usize,
    },
}

impl fmt::Display for CaptureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureError::TruncatedFileHeader => write!(f, "file shorter than a pcap header"),
            CaptureError::BadMagic(m) => write!(f, "not a classic pcap file (magic {m:#010x})"),
            CaptureError::TruncatedRecordHeader { offset } => {
                write!(f, "record header truncated at offset {offset}")
            }
            CaptureError::TruncatedRecord { offset, incl_len, available } => {
                write!(f, "record at offset {offset} claims {incl_len} bytes but only {available} remain")
            }
        }
    }
}

impl std::error::Error for CaptureError {}

/// One captured frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Timestamp, seconds.
    pub ts_sec: u32,
    /// Timestamp, nanoseconds within the second (microsecond files are scaled).
    pub ts_nsec: u32,
    /// Length of the frame on the wire (may exceed `data.len()` when the capture was snapped).
    pub orig_len: u32,
    /// The captured bytes.
    pub data: &'a [u8],
}

/// A classic pcap reader over a whole file in memory. Iterating yields frames until the end of the
/// data or the first error (after which it yields nothing).
#[derive(Debug, Clone)]
pub struct PcapReader<'a> {
    data: &'a [u8],
    pos: usize,
    big_endian: bool,
    nanos: bool,
    link_type: LinkType,
    snaplen: u32,
    failed: bool,
}

impl<'a> PcapReader<'a> {
    /// Read the file header.
    pub fn new(data: &'a [u8]) -> Result<PcapReader<'a>, CaptureError> {
        let hdr = data.get(..FILE_HEADER_LEN).ok_or(CaptureError::TruncatedFileHeader)?;
        let le = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let (big_endian, nanos) = match le {
            MAGIC_MICROS => (false, false),
            MAGIC_NANOS => (false, true),
            m if m.swap_bytes() == MAGIC_MICROS => (true, false),
            m if m.swap_bytes() == MAGIC_NANOS => (true, true),
            m => return Err(CaptureError::BadMagic(m.swap_bytes())),
        };
        let mut r = PcapReader {
            data,
            pos: FILE_HEADER_LEN,
            big_endian,
            nanos,
            link_type: LinkType::Ethernet,
            snaplen: 0,
            failed: false,
        };
        r.snaplen = r.u32_at(16);
        r.link_type = LinkType::from_u32(r.u32_at(20) & 0x0fff_ffff);
        Ok(r)
    }

    fn u32_at(&self, at: usize) -> u32 {
        let b = [self.data[at], self.data[at + 1], self.data[at + 2], self.data[at + 3]];
        if self.big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    }

    /// The link type of every frame.
    pub fn link_type(&self) -> LinkType {
        self.link_type
    }
    /// The snapshot length declared by the file header.
    pub fn snaplen(&self) -> u32 {
        self.snaplen
    }
    /// Whether timestamps are in nanoseconds.
    pub fn is_nanosecond(&self) -> bool {
        self.nanos
    }
    /// Whether the file is big-endian.
    pub fn is_big_endian(&self) -> bool {
        self.big_endian
    }

    /// The next frame, `None` at the end of the data, or the error that stops reading.
    pub fn next_frame(&mut self) -> Option<Result<Frame<'a>, CaptureError>> {
        if self.failed || self.pos >= self.data.len() {
            return None;
        }
        let offset = self.pos;
        if self.data.len() - offset < RECORD_HEADER_LEN {
            self.failed = true;
            return Some(Err(CaptureError::TruncatedRecordHeader { offset }));
        }
        let ts_sec = self.u32_at(offset);
        let frac = self.u32_at(offset + 4);
        let incl_len = self.u32_at(offset + 8);
        let orig_len = self.u32_at(offset + 12);
        let start = offset + RECORD_HEADER_LEN;
        let available = self.data.len() - start;
        let n = incl_len as usize;
        if n > available {
            self.failed = true;
            return Some(Err(CaptureError::TruncatedRecord { offset, incl_len, available }));
        }
        self.pos = start + n;
        let ts_nsec = if self.nanos { frac } else { frac.saturating_mul(1000) };
        Some(Ok(Frame { ts_sec, ts_nsec, orig_len, data: &self.data[start..start + n] }))
    }
}

impl<'a> Iterator for PcapReader<'a> {
    type Item = Result<Frame<'a>, CaptureError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_frame()
    }
}

/// A pcap writer (little-endian, microsecond timestamps).
#[derive(Debug)]
pub struct PcapWriter<W: std::io::Write> {
    out: W,
}

impl<W: std::io::Write> PcapWriter<W> {
    /// Write the file header for `link_type` (use [`LinkType::Ethernet`] or [`LinkType::Raw`]).
    pub fn new(mut out: W, link_type: LinkType) -> std::io::Result<PcapWriter<W>> {
        let mut h = [0u8; FILE_HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC_MICROS.to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes());
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        h[16..20].copy_from_slice(&WRITER_SNAPLEN.to_le_bytes());
        h[20..24].copy_from_slice(&link_type.to_u32().to_le_bytes());
        out.write_all(&h)?;
        Ok(PcapWriter { out })
    }

    /// Append one frame with a timestamp since the epoch (or since the start of a simulation).
    pub fn write_frame(&mut self, ts: core::time::Duration, data: &[u8]) -> std::io::Result<()> {
        let len = u32::try_from(data.len())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too long for pcap"))?;
        let mut h = [0u8; RECORD_HEADER_LEN];
        h[0..4].copy_from_slice(&(ts.as_secs() as u32).to_le_bytes());
        h[4..8].copy_from_slice(&ts.subsec_micros().to_le_bytes());
        h[8..12].copy_from_slice(&len.to_le_bytes());
        h[12..16].copy_from_slice(&len.to_le_bytes());
        self.out.write_all(&h)?;
        self.out.write_all(data)
    }

    /// Flush and give back the sink.
    pub fn into_inner(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// What a captured frame carries, as far as RoCE is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classified<'a> {
    /// An IP packet to UDP port 4791 (the slice starts at the IP header).
    RoceV2(&'a [u8]),
    /// A RoCEv1 frame (the slice starts at the GRH).
    RoceV1(&'a [u8]),
    /// Anything else (ARP, TCP, other UDP, IPv6 ND, unknown link types, frames too short to tell).
    NotRoce,
}

/// Sort a frame of link type `link`.
pub fn classify(link: LinkType, frame: &[u8]) -> Classified<'_> {
    match link {
        LinkType::Ethernet => match EthernetFrame::new_checked(frame) {
            Ok(f) => {
                let h = f.header_len();
                by_ethertype(f.ethertype(), &frame[h..])
            }
            Err(_) => Classified::NotRoce,
        },
        LinkType::LinuxSll if frame.len() >= 16 => by_ethertype(u16_at(frame, 14), &frame[16..]),
        LinkType::LinuxSll2 if frame.len() >= 20 => by_ethertype(u16_at(frame, 0), &frame[20..]),
        LinkType::Raw | LinkType::Ipv4 | LinkType::Ipv6 => by_ip(frame),
        _ => Classified::NotRoce,
    }
}

fn by_ethertype(ethertype: u16, payload: &[u8]) -> Classified<'_> {
    match ethertype {
        ETHERTYPE_IPV4 | ETHERTYPE_IPV6 => by_ip(payload),
        ETHERTYPE_ROCE_V1 => Classified::RoceV1(payload),
        _ => Classified::NotRoce,
    }
}

/// Whether an IP packet is UDP to port 4791, reading only the bytes needed to decide.
fn by_ip(ip: &[u8]) -> Classified<'_> {
    let udp_at = match ip.first().map(|b| b >> 4) {
        Some(4) if ip.len() >= 20 => {
            let ihl = usize::from(ip[0] & 0xf) * 4;
            // A non-first fragment carries no UDP header.
            let frag_offset = u16_at(ip, 6) & 0x1fff;
            if ip[9] != PROTOCOL_UDP || ihl < 20 || frag_offset != 0 {
                return Classified::NotRoce;
            }
            ihl
        }
        Some(6) if ip.len() >= 40 => {
            if ip[6] != PROTOCOL_UDP {
                return Classified::NotRoce;
            }
            40
        }
        _ => return Classified::NotRoce,
    };
    match ip.get(udp_at + 2..udp_at + 4) {
        Some(p) if u16::from_be_bytes([p[0], p[1]]) == ROCE_V2_PORT => Classified::RoceV2(ip),
        _ => Classified::NotRoce,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(big_endian: bool, nanos: bool, link: u32, records: &[(u32, &[u8])]) -> Vec<u8> {
        let w32 = |v: u32| if big_endian { v.to_be_bytes() } else { v.to_le_bytes() };
        let w16 = |v: u16| if big_endian { v.to_be_bytes() } else { v.to_le_bytes() };
        let mut f = Vec::new();
        f.extend(w32(if nanos { MAGIC_NANOS } else { MAGIC_MICROS }));
        f.extend(w16(2));
        f.extend(w16(4));
        f.extend([0; 8]);
        f.extend(w32(65535));
        f.extend(w32(link));
        for (frac, d) in records {
            f.extend(w32(7));
            f.extend(w32(*frac));
            f.extend(w32(d.len() as u32));
            f.extend(w32(d.len() as u32 + 1));
            f.extend(*d);
        }
        f
    }

    #[test]
    fn reads_all_four_magics() {
        for be in [false, true] {
            for ns in [false, true] {
                let f = file(be, ns, 101, &[(5, b"abc"), (6, b"")]);
                let mut r = PcapReader::new(&f).unwrap();
                assert_eq!((r.is_big_endian(), r.is_nanosecond(), r.link_type()), (be, ns, LinkType::Raw));
                assert_eq!(r.snaplen(), 65535);
                let a = r.next().unwrap().unwrap();
                assert_eq!(a, Frame { ts_sec: 7, ts_nsec: if ns { 5 } else { 5000 }, orig_len: 4, data: b"abc" });
                assert_eq!(r.next().unwrap().unwrap().data, b"");
                assert!(r.next().is_none());
            }
        }
    }

    #[test]
    fn truncations_are_typed_errors() {
        let f = file(false, false, 1, &[(0, b"abcdef")]);
        assert_eq!(PcapReader::new(&f[..23]).unwrap_err(), CaptureError::TruncatedFileHeader);
        let mut bad = f.clone();
        bad[0] = 0;
        assert!(matches!(PcapReader::new(&bad), Err(CaptureError::BadMagic(_))));
        let mut r = PcapReader::new(&f[..30]).unwrap();
        assert_eq!(r.next(), Some(Err(CaptureError::TruncatedRecordHeader { offset: 24 })));
        assert_eq!(r.next(), None);
        let mut r = PcapReader::new(&f[..f.len() - 1]).unwrap();
        assert_eq!(r.next(), Some(Err(CaptureError::TruncatedRecord { offset: 24, incl_len: 6, available: 5 })));
        assert_eq!(r.next(), None);
    }

    #[test]
    fn writer_roundtrip() {
        let mut w = PcapWriter::new(Vec::new(), LinkType::Raw).unwrap();
        w.write_frame(core::time::Duration::new(3, 4_000_000), b"\x45hello").unwrap();
        let out = w.into_inner().unwrap();
        let mut r = PcapReader::new(&out).unwrap();
        assert_eq!(r.link_type(), LinkType::Raw);
        let fr = r.next().unwrap().unwrap();
        assert_eq!((fr.ts_sec, fr.ts_nsec, fr.orig_len, fr.data), (3, 4_000_000, 6, &b"\x45hello"[..]));
    }

    #[test]
    fn classifier() {
        let mut ip = [0u8; 28];
        ip[0] = 0x45;
        ip[9] = 17;
        ip[22..24].copy_from_slice(&4791u16.to_be_bytes());
        assert_eq!(classify(LinkType::Raw, &ip), Classified::RoceV2(&ip));
        let mut eth = [0u8; 42];
        eth[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        eth[14..].copy_from_slice(&ip);
        assert_eq!(classify(LinkType::Ethernet, &eth), Classified::RoceV2(&eth[14..]));
        let mut sll = [0u8; 44];
        sll[14..16].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        sll[16..].copy_from_slice(&ip);
        assert_eq!(classify(LinkType::LinuxSll, &sll), Classified::RoceV2(&sll[16..]));
        let mut sll2 = [0u8; 48];
        sll2[0..2].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        sll2[20..].copy_from_slice(&ip);
        assert_eq!(classify(LinkType::LinuxSll2, &sll2), Classified::RoceV2(&sll2[20..]));
        eth[12..14].copy_from_slice(&ETHERTYPE_ROCE_V1.to_be_bytes());
        assert_eq!(classify(LinkType::Ethernet, &eth), Classified::RoceV1(&eth[14..]));
        ip[23] = 0xb8;
        assert_eq!(classify(LinkType::Raw, &ip), Classified::NotRoce);
        ip[23] = 0xb7;
        ip[9] = 6;
        assert_eq!(classify(LinkType::Raw, &ip), Classified::NotRoce);
        assert_eq!(classify(LinkType::Raw, &ip[..21]), Classified::NotRoce);
        assert_eq!(classify(LinkType::Unknown(147), &ip), Classified::NotRoce);
    }
}
