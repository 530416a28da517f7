//! Helpers shared by the integration tests: one RC endpoint (device, PD, CQ, QP, one region),
//! completion waiting with a deadline, data patterns, byte comparisons that name the first
//! difference, running a command (the namespace tests), and a thread's allowed CPUs (`cpus`).

#![allow(dead_code)]

pub mod cpus;
pub mod pair;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softrdma_verbs::{
    Access, CompletionQueue, Context, MemoryRegion, Payload, ProtectionDomain, QpCap, QpInitAttr, QpType, QueuePair,
    SendFlags, SendOp, SendWr, Sge, WcStatus, WorkCompletion,
};

/// Every right a remote peer can be given.
pub fn all_rights() -> Access {
    Access::LOCAL_WRITE.with(Access::REMOTE_WRITE).with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC)
}

/// One RC endpoint on an opened device, with one registered region of `region_len` bytes.
pub struct Endpoint {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub mr: MemoryRegion,
}

impl Endpoint {
    pub fn new(ctx: Context, region_len: usize, depth: u32) -> Endpoint {
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(4 * depth, None).expect("create CQ");
        let cap =
            QpCap { max_send_wr: depth, max_recv_wr: depth, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
        let qp = pd
            .create_qp(&QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: &cq,
                recv_cq: &cq,
                srq: None,
                cap,
                sq_sig_all: false,
            })
            .expect("create QP");
        let mr = pd.reg_mr(region_len, all_rights()).expect("register memory (RLIMIT_MEMLOCK?)");
        Endpoint { ctx, pd, cq, qp, mr }
    }

    /// An SGE over our own region.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        self.mr.sge(offset, len).expect("SGE inside the region")
    }

    /// Post a signaled send work request with one SGE of our region.
    pub fn post(&self, wr_id: u64, op: SendOp, offset: usize, len: usize) {
        let wr = SendWr {
            wr_id,
            op,
            payload: Payload::Sgl(vec![self.sge(offset, len)].into()),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        self.qp.post_send(wr).expect("post_send");
    }
}

/// Poll `cq` until `n` completions arrived, or panic after `limit`.
pub fn wait_n(cq: &CompletionQueue, n: usize, limit: Duration) -> Vec<WorkCompletion> {
    let mut out = Vec::with_capacity(n);
    let start = Instant::now();
    while out.len() < n {
        cq.poll(n - out.len(), &mut out).expect("poll CQ");
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {n} completions, got {out:?}");
        if out.len() < n {
            std::thread::yield_now();
        }
    }
    out
}

/// Wait for exactly one completion and check its id and success.
pub fn wait_one(cq: &CompletionQueue, wr_id: u64) -> WorkCompletion {
    let wc = wait_n(cq, 1, Duration::from_secs(30)).remove(0);
    assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "completion {wc:?}");
    wc
}

/// `len` bytes that differ with `seed` and have no short period (so a misplaced packet shows).
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8 ^ (i >> 12) as u8
        })
        .collect()
}

/// Compare two byte strings; on a difference, say where and how many bytes differ.
pub fn compare(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} bytes, expected {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => {
            let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
            Err(format!(
                "{what}: {bad} of {} bytes differ, first at offset {i} (got {:#04x}, expected {:#04x})",
                got.len(),
                got[i],
                want[i]
            ))
        }
    }
}

/// Check that `len` bytes of `mr` at `offset` all equal `byte`.
pub fn compare_fill(what: &str, mr: &MemoryRegion, offset: usize, len: usize, byte: u8) -> Result<(), String> {
    compare(what, &mr.to_vec(offset, len).expect("read region"), &vec![byte; len])
}

/// Run a command; its stdout, or its stderr on failure.
pub fn sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// What `ip netns exec` does besides setns: a private mount namespace for this thread, with a sysfs
/// mounted afresh, so `/sys/class/net` lists the namespace's interfaces.
pub fn private_sysfs() -> Result<(), String> {
    let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    // SAFETY: plain system calls with valid NUL-terminated strings; they affect only this thread's
    // (new, private) mount namespace.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(err("unshare(CLONE_NEWNS)"));
        }
        // Keep our mounts from propagating back to the host.
        if libc::mount(
            c("none").as_ptr(),
            c("/").as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            return Err(err("making / a slave mount"));
        }
        libc::umount2(c("/sys").as_ptr(), libc::MNT_DETACH);
        if libc::mount(c("sysfs").as_ptr(), c("/sys").as_ptr(), c("sysfs").as_ptr(), 0, std::ptr::null()) != 0 {
            return Err(err("mounting sysfs"));
        }
    }
    Ok(())
}
