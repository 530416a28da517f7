//! Where a thread busy-polling a device runs (its CPU and an id of the thread, which the runtime
//! says in its same-host lanes' ring headers and softrdmad's device loop in its clients' CQ
//! rings), and moving it off a CPU it shares with the thread it waits for.
//!
//! Two processes' polling threads often start on one CPU: the kernel puts a thread woken by
//! another (by the TCP exchange before a benchmark, a connection's handshake) on the waker's CPU,
//! and its load balancer leaves two busy, cache-hot threads together for milliseconds or longer
//! while the other CPU idles. Each hop of their exchange then costs a yield (a context switch,
//! about a microsecond; see `Device::poll_empty`) instead of a cache-line handover: a same-host
//! `send-lat` of 2,000 iterations typically took 2.3 µs instead of 0.8.
//!
//! Of two such pollers the one with the larger id moves (each sees the other's id in the lane, so
//! exactly one of them does), after [`SHARED_YIELDS`] yields for a peer on its CPU and at most
//! once per [`MOVE_EVERY`]: it restricts its affinity to the next CPU of its allowed set and at
//! once sets the allowed set back. The kernel migrates a thread when its current CPU leaves its
//! set; restoring the set leaves it where it now is, and a thread allowed a single CPU stays.
//! The set restored is the one the kernel reported: another thread changing this thread's
//! affinity at that very moment is overwritten, and on kernels that keep a thread's requested set
//! apart from its cpuset (6.2 on), CPUs the cpuset gains later are not used by a thread that
//! moved. `SOFTRDMA_POLLER_MOVE=0` turns moving off.
//!
//! A client of softrdmad waits for the daemon's device loop, which takes its work requests and
//! writes its completions: with two clients exchanging messages through one device that is three
//! busy threads, and on two CPUs the kernel often leaves one client with the device loop, which
//! then costs two yields per message instead of one (a `send-lat` through softrdmad typically
//! took 2.0 µs instead of 1.05). The device loop says its CPU in every CQ ring while it polls;
//! a client finding its CQ empty and the loop on its CPU moves the same way, always (the loop
//! serves every client, so it stays put).
//!
//! The id is random per thread, not `gettid`: thread ids of processes in different PID
//! namespaces (containers sharing a network namespace) can be equal, and a peer with our id would
//! look like this thread itself (a thread that polls both ends of a lane waits for nobody).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Duration;

/// How a process's threads busy-polling a device made room for the thread they wait for: the
/// empty polls that found it on their CPU and yielded, and the moves to another CPU (embedded
/// devices: the same-host lanes' peer pollers; softrdmad devices: the device loop).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollerStats {
    pub shared_yields: u64,
    pub moves: u64,
}

/// Yields for a peer's poller on this thread's CPU before the thread moves.
const SHARED_YIELDS: u32 = 8;

/// The shortest time between two moves of one thread.
const MOVE_EVERY: Duration = Duration::from_millis(1);

/// How often a poll that found work says where the thread runs ([`busy_poll_says`]).
const BUSY_SAY_EVERY: u32 = 64;

/// The CPU this thread runs on now (`sched_getcpu`, which glibc answers from the rseq area
/// without a system call), if the kernel says.
pub(crate) fn this_cpu() -> Option<u32> {
    // SAFETY: no arguments.
    u32::try_from(unsafe { libc::sched_getcpu() }).ok()
}

thread_local! {
    /// This thread's id: random, drawn once.
    static ID: u32 = {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        // SAFETY: no arguments.
        h.write_i32(unsafe { libc::gettid() });
        h.finish() as u32
    };

    /// Yields for a peer on this thread's CPU since its last move, and the monotonic time (ns)
    /// before which it does not move again.
    static SHARED: Cell<(u32, u64)> = const { Cell::new((0, 0)) };

    /// Polls that found work since this thread last said its CPU.
    static BUSY_POLLS: Cell<u32> = const { Cell::new(0) };
}

/// This thread's id (see the module comment).
pub(crate) fn this_id() -> u32 {
    ID.with(|t| *t)
}

/// Polls that find work say where the thread runs only now and then (`sched_getcpu` costs ~15 ns
/// on an exchange's critical path), so that a thread the kernel moved while it always found work
/// does not leave its old CPU in the lanes for long: true once every [`BUSY_SAY_EVERY`] calls.
pub(crate) fn busy_poll_says() -> bool {
    BUSY_POLLS.with(|n| {
        let k = n.get() + 1;
        n.set(if k >= BUSY_SAY_EVERY { 0 } else { k });
        k >= BUSY_SAY_EVERY
    })
}

/// Whether moving is on (`SOFTRDMA_POLLER_MOVE`, read once).
fn moving_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SOFTRDMA_POLLER_MOVE").is_none_or(|v| v != "0"))
}

/// This thread (`id`, on `cpu`), polling at monotonic time `now_ns`, found nothing while the
/// peer's poller `peer` runs on the same CPU. Returns true if it moved to another CPU (no need to
/// yield then); false if the caller should yield the core to the peer.
pub(crate) fn shared_with(peer: u32, cpu: u32, id: u32, now_ns: u64) -> bool {
    id >= peer && sharing(cpu, now_ns)
}

/// This thread, polling at monotonic time `now_ns`, found nothing while the thread that answers
/// it runs on `cpu`, this thread's CPU too, and this thread is the one to make room (a softrdmad
/// device loop never moves for its clients). Returns true if it moved to another CPU; false if
/// the caller should yield the core.
pub(crate) fn sharing(cpu: u32, now_ns: u64) -> bool {
    if !moving_on() {
        return false;
    }
    let (yields, not_before) = SHARED.with(Cell::get);
    if yields < SHARED_YIELDS || now_ns < not_before {
        SHARED.with(|s| s.set((yields + 1, not_before)));
        return false;
    }
    SHARED.with(|s| s.set((0, now_ns + MOVE_EVERY.as_nanos() as u64)));
    move_off(cpu)
}

/// How many CPUs this thread may run on (its affinity), if the kernel says.
pub(crate) fn allowed_cpus() -> Option<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid (empty) set; sched_getaffinity with pid 0 writes only
    // the set passed, of the size given, for this thread.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            return None;
        }
        usize::try_from(libc::CPU_COUNT(&allowed)).ok()
    }
}

/// Move this thread off `cpu` to the next CPU its affinity allows, leaving its affinity as it
/// was. False if it is allowed no other CPU or the kernel refused.
fn move_off(cpu: u32) -> bool {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: zeroed cpu_set_t values are valid (empty) sets; sched_getaffinity and
    // sched_setaffinity with pid 0 act on this thread and read or write only the sets passed, of
    // `size` bytes; CPU_ISSET and CPU_SET index inside the set (below CPU_SETSIZE).
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            return false;
        }
        let n = libc::CPU_SETSIZE as usize;
        let Some(to) = (1..n).map(|k| (cpu as usize + k) % n).find(|&c| libc::CPU_ISSET(c, &allowed)) else {
            return false;
        };
        let mut only: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(to, &mut only);
        let moved = libc::sched_setaffinity(0, size, &only) == 0;
        // The caller's set again, whatever happened (it holds `to`: the thread stays there).
        libc::sched_setaffinity(0, size, &allowed);
        moved
    }
}
