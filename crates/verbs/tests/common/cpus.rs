//! The CPUs a thread may run on, and narrowing or widening them: for the tests of where busy
//! pollers run (this crate's `same_host.rs`, and softrdmad's in `crates/cli/tests/daemon.rs`,
//! which includes this file).

/// The CPUs this thread may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid set to fill; sched_getaffinity(0) writes this thread's.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Allow thread `tid` (0: this one) only `cpus`; false where that is refused.
pub fn allow(tid: i32, cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET writes inside it (the CPUs are below
    // CPU_SETSIZE: they come from sched_getaffinity); sched_setaffinity reads the set given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The CPUs this thread may run on, if a poller can be moved between them: at least two, and
/// moving not turned off (`SOFTRDMA_POLLER_MOVE=0`); otherwise says why the test is skipped.
pub fn cpus_to_move_between() -> Option<Vec<usize>> {
    let cpus = allowed_cpus();
    if cpus.len() < 2 || std::env::var_os("SOFTRDMA_POLLER_MOVE").is_some_and(|v| v == "0") {
        eprintln!("skipped: one CPU, or moving turned off");
        return None;
    }
    Some(cpus)
}
