//! errno: setting it, mapping our errors to it, and explaining failures when asked to.

use std::ffi::c_int;
use std::sync::OnceLock;

use softrdma_transport::VerbsError;
use softrdma_verbs::Error;

/// Set the calling thread's `errno`.
pub fn set(e: c_int) {
    // SAFETY: __errno_location returns the address of this thread's errno, valid for the thread's life.
    unsafe { *libc::__errno_location() = e };
}

/// This thread's errno.
pub fn get() -> c_int {
    // SAFETY: as in `set`.
    unsafe { *libc::__errno_location() }
}

/// Whether `SOFTRDMA_FFI_DEBUG` asks for failures to be explained on stderr.
pub fn debug() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SOFTRDMA_FFI_DEBUG").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Explain a failure of `what` on stderr when debugging is on.
pub fn explain(what: &str, why: &dyn std::fmt::Display) {
    if debug() {
        eprintln!("softrdma libibverbs: {what}: {why}");
    }
}

/// The errno value rdma-core's kernel path would give for `e`.
pub fn of(e: &Error) -> c_int {
    match e {
        Error::Verbs(v) => of_verbs(v),
        Error::Device(_) | Error::Registry(_) | Error::InvalidArgument(_) => libc::EINVAL,
        Error::PortInUse(_) => libc::EADDRINUSE,
        Error::Io { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
        Error::MemlockLimit { .. } => libc::ENOMEM,
        _ => libc::EINVAL,
    }
}

/// The errno value for an engine refusal.
pub fn of_verbs(e: &VerbsError) -> c_int {
    match e {
        VerbsError::QueueFull | VerbsError::CapacityExceeded(_) => libc::ENOMEM,
        VerbsError::Busy => libc::EBUSY,
        _ => libc::EINVAL,
    }
}

/// Report `e` from `what`: explain it, set errno, and return the errno value.
pub fn fail(what: &str, e: &Error) -> c_int {
    explain(what, e);
    let n = of(e);
    set(n);
    n
}

/// Refuse `what` with errno `n` (set and returned).
pub fn refuse(what: &str, n: c_int, why: &str) -> c_int {
    explain(what, &why);
    set(n);
    n
}

/// Return NULL from a pointer-returning call after `refuse`.
pub fn null<T>(what: &str, n: c_int, why: &str) -> *mut T {
    refuse(what, n, why);
    std::ptr::null_mut()
}
