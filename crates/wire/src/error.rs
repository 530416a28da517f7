//! The typed errors of parsing and emitting.

use core::fmt;

/// Why a byte sequence is not a valid packet (or a buffer too small to emit one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The buffer ends before the header or packet it should hold.
    Truncated,
    /// The BTH opcode is reserved or of a transport this crate does not speak.
    UnknownOpcode(u8),
    /// BTH transport header version is not 0.
    BadVersion(u8),
    /// The pad count is inconsistent with the packet length or opcode (no payload but padded).
    BadPad,
    /// A field holds a value the specification reserves.
    Reserved,
    /// Not the protocol expected at this layer (wrong ethertype, IP version, UDP port...).
    NotRoce,
    /// A length field disagrees with the bytes present.
    BadLength,
    /// An IPv4 header checksum is wrong.
    BadChecksum,
    /// An IPv4 fragment (MF set or a non-zero fragment offset); RoCE packets are never fragmented.
    Fragmented,
    /// The ICRC of a RoCE packet does not match its contents.
    BadIcrc,
}

/// Result alias for this crate.
pub type Result<T> = core::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => write!(f, "truncated packet"),
            Error::UnknownOpcode(op) => write!(f, "unknown or unsupported opcode {op:#04x}"),
            Error::BadVersion(v) => write!(f, "unsupported transport header version {v}"),
            Error::BadPad => write!(f, "pad count inconsistent with packet"),
            Error::Reserved => write!(f, "reserved value in header field"),
            Error::NotRoce => write!(f, "not a RoCE packet"),
            Error::BadLength => write!(f, "length field disagrees with packet size"),
            Error::BadChecksum => write!(f, "bad header checksum"),
            Error::Fragmented => write!(f, "IP fragment"),
            Error::BadIcrc => write!(f, "bad ICRC"),
        }
    }
}

impl std::error::Error for Error {}
