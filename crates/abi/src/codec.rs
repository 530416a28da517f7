//! Little-endian binary encoding of control messages: a writer that appends and a reader that
//! checks every length before it reads.

use std::fmt;
use std::net::IpAddr;

/// A message that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Result of decoding.
pub type DResult<T> = Result<T, DecodeError>;

/// Longest string a message may carry.
pub const MAX_STR: usize = 4096;
/// Most elements a list in a message may carry.
pub const MAX_LIST: usize = 4096;

/// Appends values to a buffer.
#[derive(Debug, Default)]
pub struct Writer {
    /// The bytes written.
    pub buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Writer {
        Writer::default()
    }
    /// One byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// A bool as one byte.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }
    /// 16 bits.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// 32 bits.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// 64 bits.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Raw bytes (fixed length known to the reader).
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    /// A length-prefixed string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u32(s.len() as u32);
        self.raw(s.as_bytes())
    }
    /// An optional u32 (presence byte, then the value).
    pub fn opt_u32(&mut self, v: Option<u32>) -> &mut Self {
        match v {
            Some(x) => self.u8(1).u32(x),
            None => self.u8(0),
        }
    }
    /// An IP address (family byte 4 or 6, then the octets).
    pub fn ip(&mut self, ip: IpAddr) -> &mut Self {
        match ip {
            IpAddr::V4(a) => self.u8(4).raw(&a.octets()),
            IpAddr::V6(a) => self.u8(6).raw(&a.octets()),
        }
    }
}

/// Reads values from a buffer, failing on truncation.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `buf`.
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }
    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }
    /// Fails unless everything was read.
    pub fn finish(&self) -> DResult<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError("trailing bytes"))
        }
    }
    /// `n` raw bytes.
    pub fn raw(&mut self, n: usize) -> DResult<&'a [u8]> {
        if self.buf.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    /// A fixed-size array.
    pub fn array<const N: usize>(&mut self) -> DResult<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.raw(N)?);
        Ok(a)
    }
    /// One byte.
    pub fn u8(&mut self) -> DResult<u8> {
        Ok(self.raw(1)?[0])
    }
    /// A bool (0 or 1).
    pub fn bool(&mut self) -> DResult<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError("bad bool")),
        }
    }
    /// 16 bits.
    pub fn u16(&mut self) -> DResult<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    /// 32 bits.
    pub fn u32(&mut self) -> DResult<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    /// 64 bits.
    pub fn u64(&mut self) -> DResult<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A length-prefixed UTF-8 string of at most [`MAX_STR`] bytes.
    pub fn str(&mut self) -> DResult<String> {
        let n = self.u32()? as usize;
        if n > MAX_STR {
            return Err(DecodeError("string too long"));
        }
        String::from_utf8(self.raw(n)?.to_vec()).map_err(|_| DecodeError("string not UTF-8"))
    }
    /// A list length, bounded by [`MAX_LIST`].
    pub fn list_len(&mut self) -> DResult<usize> {
        let n = self.u32()? as usize;
        if n > MAX_LIST {
            return Err(DecodeError("list too long"));
        }
        Ok(n)
    }
    /// An optional u32.
    pub fn opt_u32(&mut self) -> DResult<Option<u32>> {
        Ok(if self.bool()? { Some(self.u32()?) } else { None })
    }
    /// An IP address.
    pub fn ip(&mut self) -> DResult<IpAddr> {
        match self.u8()? {
            4 => Ok(IpAddr::from(self.array::<4>()?)),
            6 => Ok(IpAddr::from(self.array::<16>()?)),
            _ => Err(DecodeError("bad address family")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::new();
        w.u8(7).u16(0x1234).u32(0xdead_beef).u64(u64::MAX).str("rxe0").opt_u32(Some(5)).opt_u32(None);
        w.ip("127.0.0.2".parse().unwrap()).ip("::1".parse().unwrap()).bool(true);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u16().unwrap(), 0x1234);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.str().unwrap(), "rxe0");
        assert_eq!(r.opt_u32().unwrap(), Some(5));
        assert_eq!(r.opt_u32().unwrap(), None);
        assert_eq!(r.ip().unwrap().to_string(), "127.0.0.2");
        assert_eq!(r.ip().unwrap().to_string(), "::1");
        assert!(r.bool().unwrap());
        r.finish().unwrap();
        for cut in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..cut]);
            let ok = (|| -> DResult<()> {
                r.u8()?;
                r.u16()?;
                r.u32()?;
                r.u64()?;
                r.str()?;
                r.opt_u32()?;
                r.opt_u32()?;
                r.ip()?;
                r.ip()?;
                r.bool()?;
                Ok(())
            })();
            assert!(ok.is_err(), "cut at {cut}");
        }
        // A huge string length is refused before any allocation.
        assert!(Reader::new(&[0xff, 0xff, 0xff, 0x7f]).str().is_err());
    }
}
