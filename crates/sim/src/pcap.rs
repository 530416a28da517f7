//! A minimal classic-pcap writer for simulator captures: nanosecond timestamps, link type 101 (raw
//! IP), each IB packet wrapped in IPv4 and UDP (destination port 4791) headers so Wireshark decodes
//! it as RoCEv2. The UDP checksum is 0 (allowed for IPv4); the ICRC is the simulator's own.

use softrdma_transport::Instant;

/// RoCEv2's UDP port.
pub const ROCE_PORT: u16 = 4791;
/// `LINKTYPE_RAW`: packets start with an IPv4 or IPv6 header.
pub const LINKTYPE_RAW: u32 = 101;
/// Magic of a classic pcap file with nanosecond timestamps.
pub const MAGIC_NS: u32 = 0xa1b2_3c4d;

/// One packet to write.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    /// Virtual time.
    pub at: Instant,
    /// IPv4 source.
    pub src: [u8; 4],
    /// IPv4 destination.
    pub dst: [u8; 4],
    /// UDP source port.
    pub src_port: u16,
    /// The IB packet, BTH through ICRC.
    pub ib: &'a [u8],
}

/// A 20-byte IPv4 header (no options, DF, TTL 64, protocol UDP) for `payload_len` bytes after it.
pub fn ipv4_header(src: [u8; 4], dst: [u8; 4], payload_len: u16) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&(20 + payload_len).to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = 64;
    h[9] = 17; // UDP
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let sum = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum::<u32>();
    let folded = (sum & 0xffff) + (sum >> 16);
    let folded = (folded & 0xffff) + (folded >> 16);
    h[10..12].copy_from_slice(&(!(folded as u16)).to_be_bytes());
    h
}

/// A whole pcap file.
pub fn write<'a>(records: impl IntoIterator<Item = Record<'a>>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC_NS.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&65535u32.to_le_bytes());
    out.extend_from_slice(&LINKTYPE_RAW.to_le_bytes());
    for r in records {
        let udp_len = (8 + r.ib.len()) as u16;
        let len = (20 + usize::from(udp_len)) as u32;
        let ns = r.at.as_nanos();
        out.extend_from_slice(&((ns / 1_000_000_000) as u32).to_le_bytes());
        out.extend_from_slice(&((ns % 1_000_000_000) as u32).to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&ipv4_header(r.src, r.dst, udp_len));
        out.extend_from_slice(&r.src_port.to_be_bytes());
        out.extend_from_slice(&ROCE_PORT.to_be_bytes());
        out.extend_from_slice(&udp_len.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(r.ib);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_checksum_verifies() {
        let h = ipv4_header([10, 0, 0, 1], [10, 0, 0, 2], 8 + 32);
        let sum: u32 = h
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
            .sum();
        let folded = (sum & 0xffff) + (sum >> 16);
        assert_eq!(folded, 0xffff);
        assert_eq!(&h[2..4], &60u16.to_be_bytes());
    }

    #[test]
    fn one_record_layout() {
        let ib = [0x64u8; 16];
        let f = write([Record {
            at: Instant::from_nanos(1_000_000_123),
            src: [10, 0, 0, 1],
            dst: [10, 0, 0, 2],
            src_port: 0xc000,
            ib: &ib,
        }]);
        assert_eq!(f.len(), 24 + 16 + 20 + 8 + 16);
        assert_eq!(&f[0..4], &[0x4d, 0x3c, 0xb2, 0xa1]);
        assert_eq!(&f[20..24], &101u32.to_le_bytes());
        assert_eq!(&f[24..28], &1u32.to_le_bytes());
        assert_eq!(&f[28..32], &123u32.to_le_bytes());
        assert_eq!(&f[32..36], &44u32.to_le_bytes());
        assert_eq!(&f[40 + 20 + 2..40 + 20 + 4], &4791u16.to_be_bytes());
        assert_eq!(&f[40 + 28..], &ib);
    }
}
