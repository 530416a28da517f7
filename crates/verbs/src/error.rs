//! Errors of the Verbs API: each says what is wrong and, where there is one, the fix.

use std::fmt;
use std::net::SocketAddr;

use softrdma_device::device::DeviceError;
use softrdma_device::registry::RegistryError;
use softrdma_transport::VerbsError;

/// Why a verbs call failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The device model refused: unknown device, missing netdev, bad port or GID index.
    Device(DeviceError),
    /// The device registry could not be read.
    Registry(RegistryError),
    /// The engine refused the call (illegal modify, full queue, bad work request...).
    Verbs(VerbsError),
    /// The device's UDP port is already taken by another process or device.
    PortInUse(SocketAddr),
    /// An operating-system call failed.
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        err: std::io::Error,
    },
    /// Pinning the memory would exceed RLIMIT_MEMLOCK.
    MemlockLimit {
        /// Bytes asked for.
        requested: usize,
        /// The soft limit in bytes.
        limit: u64,
    },
    /// An argument is invalid; the text says which and why.
    InvalidArgument(String),
    /// softrdmad refused or failed; the text says why.
    Daemon(String),
}

/// Result alias.
pub type Result<T> = core::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Device(e) => write!(f, "{e}"),
            Error::Registry(e) => write!(f, "{e}"),
            Error::Verbs(e) => write!(f, "{e}"),
            Error::PortInUse(a) => write!(
                f,
                "UDP port {} on {} is already in use (another softrdma device, softrdmad, or the kernel's rdma_rxe owns it)",
                a.port(),
                a.ip()
            ),
            Error::Io { what, err } => write!(f, "{what}: {err}"),
            Error::MemlockLimit { requested, limit } => write!(
                f,
                "cannot pin {requested} bytes of memory: RLIMIT_MEMLOCK is {limit} bytes. Raise it, e.g. with \
                 `ulimit -l unlimited`, or for the rdma group in /etc/security/limits.conf:\n\
                 @rdma soft memlock unlimited\n@rdma hard memlock unlimited"
            ),
            Error::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            Error::Daemon(s) => write!(f, "softrdmad: {s}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<VerbsError> for Error {
    fn from(e: VerbsError) -> Error {
        Error::Verbs(e)
    }
}

impl From<DeviceError> for Error {
    fn from(e: DeviceError) -> Error {
        Error::Device(e)
    }
}

impl From<RegistryError> for Error {
    fn from(e: RegistryError) -> Error {
        Error::Registry(e)
    }
}

impl Error {
    pub(crate) fn io(what: &'static str, err: std::io::Error) -> Error {
        Error::Io { what, err }
    }
}
