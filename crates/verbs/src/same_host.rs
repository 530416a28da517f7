//! The same-host link: RoCEv2 packets between two softrdma devices on one host carried through
//! shared memory instead of UDP on loopback. It owns discovery of same-host peers, one
//! single-producer single-consumer ring per direction and peer ("lane"), its doorbells, and the
//! fall-back to UDP when a peer goes away. The runtime (`runtime.rs`) decides per packet whether
//! it goes on a lane or to the socket; the engine sees nothing of it.
//!
//! # Discovery and authority
//!
//! A device that bound its UDP socket to `ip:port` listens on the *abstract* Unix socket
//! `"\0softrdma-roce/<ip:port>"` ([`abstract_name`]). Abstract names live in the network
//! namespace, like the UDP address, and vanish with the process that holds them, so whoever
//! listens there is the process that owns the UDP address now: there is no stale file to clean
//! up and no way to claim an address one has not bound (the UDP bind comes first and is
//! exclusive). A sender with traffic for `dst` tries once to connect to `dst`'s name; a refusal is
//! cached and retried every [`RETRY`] (a peer that starts later, or a remote address, for which
//! the attempt costs a failed `connect` a second).
//!
//! Both sides check with `SO_PEERCRED` that the other runs as the same user: a lane lets the peer
//! write into memory we read (and the other way round), which we only grant to processes that
//! could `ptrace` us anyway. Devices of different users on one host keep using UDP.
//!
//! # The lane
//!
//! On success the sender creates a sealed memfd (it cannot be shrunk under the receiver's mapping)
//! holding one [`softrdma_abi::ring`] ring of [`SLOT_SIZE`]-byte slots and passes it with
//! `SCM_RIGHTS`, with a hello naming its own source `ip:port` and the destination. Both sides map
//! it with every page in place (`MAP_POPULATE`, ~2-3 ms once per lane on this VM): faulted in on
//! first touch, each slot of the first lap cost both sides a page fault while the other side
//! waited, and a ping-pong's first 9-17 ms ran 15-100× slower than the rest. The listener
//! (in its progress or I/O loop) accepts, checks the hello and maps the ring as an inbound lane.
//! A slot is a [`SLOT_HEADER`]-byte header (the packet length, little-endian u32) then the UDP
//! payload exactly as it would go on the wire (BTH … ICRC), so the engine and the CM (QP1 MADs)
//! handle it like any datagram from `src` to `local`.
//!
//! Memory does not corrupt packets, so the ICRC is neither computed by the sender nor checked by
//! the receiver on a lane (its four bytes are left as they are); such packets are counted in
//! [`SameHostStats::rx_pkts`] instead of the ICRC verdicts. Everything read from the mapping is
//! untrusted: the ring indices are checked against the capacity (a broken ring is counted in
//! [`SameHostStats::ring_corrupt`] and the lane dropped), slot lengths against the slot
//! ([`SameHostStats::rx_malformed`]), and the engine parses the packet as it parses the network's.
//!
//! A ring starts with [`FIRST_SLOTS`] slots (150 KiB): request-response traffic never has more
//! than a few packets in a lane, and with N devices talking all-to-all there are N(N-1) rings.
//! A ring found full while it is smaller than `SOFTRDMA_SAME_HOST_SLOTS` (512 by default) grows
//! [`GROWTH`] times, the sender keeping one slot free for it: the sender creates the larger ring,
//! sends its memfd on the lane's connection (a [`MOVE`] message), then publishes the kept slot with
//! the length [`MOVED`] and writes on in the new ring. The receiver, reaching that slot, maps the
//! ring the message brought (it was sent first, so it is there to read) and reads on from its
//! start, so the packets keep their order across the move. A grown ring that has carried nothing
//! for [`SHRINK_AFTER`], its receiver having taken everything, moves back to the first size the
//! same way (checked by [`Link::maintain`]). A slot that says it moved when no ring came, or a ring
//! of no lane's size, is a broken lane (dropped and counted as [`SameHostStats::ring_corrupt`]).
//!
//! A full ring does not drop: the packet that found it full waits in the lane's one-packet
//! overflow buffer and the runtime stops taking packets from the engine ([`Link::congested`])
//! until the receiver made room, so the link is lossless like a socket buffer that is never
//! full. That matters for UC and UD, which do not retransmit: a UC sender with 128 WRs of 64 KiB
//! in flight puts 2,048 packets in a row on the lane. Falling back to UDP for that packet instead
//! would reorder it behind the ring.
//!
//! # Doorbells and hang-up
//!
//! The connection stays open as the doorbell and the liveness signal. A receiver about to sleep
//! sets the ring's need-doorbell flag and looks once more ([`Link::sleep_prepare`]); a sender that
//! published entries and finds the flag set clears it and writes one byte. While the receiver busy
//! polls, sending costs no system call. Either side's death closes the connection: the receiver
//! drops the lane, the sender unmaps and goes back to UDP (with the retry delay, so a restarted
//! peer is found again).
//!
//! Connection housekeeping (accepting lanes, noticing hang-ups) is one `poll` with no timeout at
//! most every [`MAINTAIN_EVERY`] from the busy-polling path, and at once when the I/O thread wakes.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use softrdma_abi::ring::{ring_bytes, Consumer, Producer, Ring};
use softrdma_abi::shm::Shm;
use softrdma_abi::sock::{geteuid, Conn, Listener};
use softrdma_transport::Instant;

/// Bytes in front of the packet in a slot: its length (u32, little-endian) and the slot's tag (the
/// ring is *tagged*, see [`softrdma_abi::ring::Producer::publish_tagged`]: the receiver polls the
/// tag of the next slot, not the producer index). Kept small so that a small packet (an ACK, an
/// 8-byte SEND) shares one cache line with its length and tag: one cache-line transfer between the
/// cores per packet. Large packets are copied at an 8-byte offset from a line, which costs the copy
/// nothing measurable.
pub(crate) const SLOT_HEADER: usize = 8;
/// The largest packet a slot holds: a 4096-byte MTU plus headers, as the runtime's transmit slots.
pub(crate) const MAX_PACKET: usize = 4096 + 512;
/// Bytes per slot, a whole number of cache lines.
pub(crate) const SLOT_SIZE: u32 = ((SLOT_HEADER + MAX_PACKET).div_ceil(64) * 64) as u32;
/// The most slots a lane's ring grows to unless `SOFTRDMA_SAME_HOST_SLOTS` says otherwise: four
/// QPs' full windows (129 packets each) fit, 2.3 MiB of shared memory.
pub(crate) const DEFAULT_SLOTS: u32 = 512;
/// Slots a lane's ring starts with (150 KiB): request-response traffic never has more than a few
/// packets in a lane, and a device talking to N peers makes N rings.
pub(crate) const FIRST_SLOTS: u32 = 32;
/// How much larger a ring found full is made each time, up to the link's slot count.
const GROWTH: u32 = 4;
/// The most rings a receiver keeps that its sender sent and did not move to yet (a sender moves
/// to a smaller ring only once we took everything, and growing from 4 slots to [`MAX_SLOTS`]
/// takes six moves).
const MAX_MOVES: usize = 8;
/// The most moves one receive follows on a lane (each maps a ring, up to 76 MiB populated: a
/// sender that keeps moving must not hold the device lock); the rest wait for the next call.
const MOVES_PER_CALL: usize = 2;
/// The length a slot says when the ring moved: the producer's next entries are in the ring the
/// last [`MOVE`] message on the lane's connection brought.
const MOVED: u32 = u32::MAX;
/// How long a ring larger than [`FIRST_SLOTS`] carries nothing before its sender moves back to
/// one of that size (the memory of a lane that grew in a burst goes back once it is quiet).
const SHRINK_AFTER: Duration = Duration::from_secs(2);
/// The most slots a hello may announce (a sanity bound on the mapping a peer makes us create).
const MAX_SLOTS: u32 = 1 << 14;
/// How long a destination that refused a lane (or hung one up) keeps using UDP before we try again.
pub(crate) const RETRY: Duration = Duration::from_secs(1);
/// How long the I/O thread sleeps at most while the link is [`Link::congested`].
pub(crate) const CONGESTED_WAIT: Duration = Duration::from_micros(50);
/// How long after its last packet to itself a device still counts as receiving locally
/// ([`Link::receives_locally`]).
pub(crate) const LOOPBACK_QUIET: Duration = Duration::from_millis(100);
/// Connection housekeeping period on the busy-polling path.
pub(crate) const MAINTAIN_EVERY: Duration = Duration::from_millis(1);
/// Entries taken from one lane per progress call (bounded work per call).
const LANE_BUDGET: usize = 256;
/// First word of the hello.
const HELLO: &str = "softrdma-lane/2";
/// First word of the message that brings a lane's next ring (its descriptor attached).
const MOVE: &str = "move";

/// Counters of the same-host link of one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SameHostStats {
    /// Whether the link is on (`SOFTRDMA_SAME_HOST` is not `0`).
    pub enabled: bool,
    /// Outbound lanes up now.
    pub lanes_out: u64,
    /// Inbound lanes up now.
    pub lanes_in: u64,
    /// Packets and bytes (UDP payloads) put on lanes.
    pub tx_pkts: u64,
    /// See `tx_pkts`.
    pub tx_bytes: u64,
    /// Packets and bytes taken from lanes and handed to the engine or CM without an ICRC check.
    pub rx_pkts: u64,
    /// See `rx_pkts`.
    pub rx_bytes: u64,
    /// Times a lane's ring was full (the packet waited for room; nothing is lost).
    pub tx_ring_full: u64,
    /// Packets dropped: the ring was full and a packet was already waiting for room (does not
    /// happen while the runtime stops at congestion; counted in case).
    pub tx_dropped: u64,
    /// Slots whose length did not fit the slot (dropped).
    pub rx_malformed: u64,
    /// Lanes dropped because the peer broke the ring's indices, or moved to a ring it did not
    /// send or of no lane's size (or one we could not map: out of memory or descriptors).
    pub ring_corrupt: u64,
    /// Outbound rings replaced by larger ones: each found full (its receiver behind) while it was
    /// smaller than `SOFTRDMA_SAME_HOST_SLOTS`.
    pub rings_grown: u64,
    /// Grown outbound rings moved back to the first size after carrying nothing for two seconds.
    pub rings_shrunk: u64,
    /// Slots of all outbound rings up now (each is 4,672 bytes of shared memory).
    pub ring_slots_out: u64,
    /// Lanes we opened, attempts that found no softrdma device (or were refused).
    pub connects: u64,
    /// See `connects`.
    pub connect_failures: u64,
    /// Lanes we accepted, and connections refused (bad hello, other user, bad memory).
    pub accepts: u64,
    /// See `accepts`.
    pub refused: u64,
    /// Lanes closed because the peer hung up.
    pub peer_gone: u64,
    /// Doorbells rung (one byte written to a sleeping receiver).
    pub doorbells: u64,
    /// Packets the device sent to itself (between two of its QPs, or its CM's MADs), taken in
    /// without a socket or a lane (see `loopback.rs`).
    pub loopback_pkts: u64,
    /// Of `loopback_pkts`, RDMA WRITE packets whose payload went straight from region to region.
    pub loopback_placed: u64,
    /// Flushes that stopped handing packets to the device itself at their budget, leaving the
    /// rest for the next one ([`Link::loop_budget_used`]).
    pub loopback_budget_stops: u64,
    /// Messages between two of the device's QPs executed when posted, with no packet (crates/
    /// transport `hca/direct.rs`).
    pub loopback_direct: u64,
    /// Busy polls that found nothing and gave up the core at once, a peer's polling thread
    /// (which sends to us on a lane) running on the same CPU ([`Link::peer_poller_on`]).
    pub poller_yields: u64,
    /// Moves of a polling thread off a CPU it shared with a peer's poller (poller.rs).
    pub poller_moves: u64,
    /// Polls that handed out their last send completions with nothing else to wait for and left
    /// the device armed: the application may wait elsewhere, and the I/O thread is to hear what
    /// arrives meanwhile on a lane or over UDP (see the runtime's `Device::poll_leaves`).
    pub polls_left_armed: u64,
    /// Times a doorbell (or a datagram) then woke the I/O thread from its sleep aside while the
    /// application was away.
    pub armed_wakeups: u64,
}

/// The counters of [`SameHostStats`] under the names softrdmad exports them (`same_host_` + field).
macro_rules! same_host_counters {
    ($($field:ident),*) => {
        impl SameHostStats {
            /// Every counter with its exported name (`enabled` as 0 or 1).
            pub fn named(&self) -> Vec<(String, u64)> {
                let mut v = vec![("same_host_enabled".to_string(), u64::from(self.enabled))];
                $(v.push((concat!("same_host_", stringify!($field)).to_string(), self.$field));)*
                v
            }

            /// The counters back from a named list (missing names read as 0).
            pub fn from_named(list: &[(String, u64)]) -> SameHostStats {
                let get = |k: &str| list.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
                SameHostStats {
                    enabled: get("same_host_enabled") != 0,
                    $($field: get(concat!("same_host_", stringify!($field))),)*
                }
            }
        }
    };
}
same_host_counters!(
    lanes_out,
    lanes_in,
    tx_pkts,
    tx_bytes,
    rx_pkts,
    rx_bytes,
    tx_ring_full,
    tx_dropped,
    rx_malformed,
    ring_corrupt,
    rings_grown,
    rings_shrunk,
    ring_slots_out,
    connects,
    connect_failures,
    accepts,
    refused,
    peer_gone,
    doorbells,
    loopback_pkts,
    loopback_placed,
    loopback_budget_stops,
    loopback_direct,
    poller_yields,
    poller_moves,
    polls_left_armed,
    armed_wakeups
);

/// Whether the link is on: `SOFTRDMA_SAME_HOST=0` (or `off`, `false`) turns it off.
pub(crate) fn enabled_by_env() -> bool {
    std::env::var("SOFTRDMA_SAME_HOST").map_or(true, |v| !matches!(v.trim(), "0" | "off" | "false" | "no"))
}

fn slots_by_env() -> u32 {
    std::env::var("SOFTRDMA_SAME_HOST_SLOTS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|n| n.is_power_of_two() && (4..=MAX_SLOTS).contains(n))
        .unwrap_or(DEFAULT_SLOTS)
}

/// The abstract socket name of the device that owns UDP address `addr` (leading NUL included).
pub(crate) fn abstract_name(addr: SocketAddr) -> Vec<u8> {
    let mut v = vec![0u8];
    v.extend_from_slice(format!("softrdma-roce/{addr}").as_bytes());
    v
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL take an int.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Our half of a lane we send on.
struct OutLane {
    prod: Producer,
    /// Free slots no packet may take: one while the ring may still grow (for the entry that says
    /// it moved), else none.
    keep: u32,
    /// A packet that found the ring full (`pending_len` bytes; 0: none), allocated with the lane.
    pending: Vec<u8>,
    pending_len: usize,
    conn: Conn,
    /// Keeps the ring's memory mapped; declared after `prod`.
    _shm: Shm,
    /// Entries published since the last doorbell check.
    dirty: bool,
    /// The producer's index at the last [`Link::maintain`] that saw it change, and when.
    quiet: (u32, Instant),
}

impl OutLane {
    /// The next free slot for a packet, `None` if the ring is full.
    fn slot(&mut self) -> Option<&mut [u8]> {
        self.prod.slot_mut_keeping(self.keep)
    }

    /// Copy the packet waiting for room into the free slot, unpublished: its length, or `None` if
    /// no packet waits or the ring is still full.
    fn unpark(&mut self) -> Option<usize> {
        let len = self.pending_len;
        let s = self.prod.slot_mut_keeping(self.keep).filter(|_| len > 0)?;
        s[SLOT_HEADER..][..len].copy_from_slice(&self.pending[..len]);
        self.pending_len = 0;
        Some(len)
    }
}

/// A destination we have sent to: its lane, or when to try again.
struct Outbound {
    dst: SocketAddr,
    lane: Option<OutLane>,
    retry_at: Instant,
}

/// A lane we receive on.
struct Inbound {
    cons: Consumer,
    conn: Conn,
    _shm: Shm,
    /// The sender's UDP address (from its hello) and ours.
    src: SocketAddr,
    local: SocketAddr,
    /// The sender hung up: deliver what is left in the ring (its last packets, a DREQ, are as
    /// good as datagrams still in a socket buffer), then drop the lane.
    closing: bool,
    /// Rings the sender sent ([`MOVE`] messages read from the connection), with their slot counts,
    /// oldest first: each is where the entries go on after a [`MOVED`] slot.
    moves: VecDeque<(OwnedFd, u32)>,
    /// The sender moved to a ring it did not send (or one of no lane's size, or one we could not
    /// map): drop the lane.
    broken: bool,
}

impl Inbound {
    /// The current ring said it [`MOVED`]: go on in the next ring the sender sent.
    fn move_on(&mut self) -> io::Result<()> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        if self.moves.is_empty() && !drain(self) {
            // The sender sends the ring before it publishes the slot that says it moved; what
            // drain found is kept, and the lane goes once the ring is read.
            self.closing = true;
        }
        let (fd, slots) = self.moves.pop_front().ok_or_else(|| bad("moved to no ring"))?;
        if !slots_ok(slots) || slots == self.cons.ring().capacity() {
            return Err(bad("moved to a ring of no lane's size, or of its own"));
        }
        let shm = Shm::open_populated(fd, ring_bytes(slots, SLOT_SIZE))?;
        let ring = shm.ring(0, slots, SLOT_SIZE)?;
        if !ring.header_ok() {
            return Err(bad("ring header"));
        }
        // The old consumer goes before the mapping it reads.
        self.cons = Consumer::new(ring);
        self._shm = shm;
        Ok(())
    }
}

/// The same-host link of one device (behind the device lock).
#[derive(Default)]
pub(crate) struct Link {
    enabled: bool,
    slots: u32,
    listeners: Vec<(Listener, SocketAddr)>,
    inbound: Vec<Inbound>,
    outbound: Vec<Outbound>,
    /// The outbound lane the last packet went to: the next one is built in its ring.
    spec: Option<usize>,
    next_maintain: Instant,
    pfds: Vec<libc::pollfd>,
    /// When the device last sent a packet to itself (see `loopback.rs`).
    looped_at: Option<Instant>,
    /// The last flush left packets to the device itself in the engine ([`Link::loop_budget_used`]).
    loop_backlog: bool,
    /// The CPU our polling thread last said it runs on, and its poller id (poller.rs), in every
    /// outbound lane ([`Link::poller_at`]).
    poller_cpu: Option<(u32, u32)>,
    /// The sockets of the inbound lanes that are not closing, as of the last [`Link::maintain`]
    /// (which accepts and closes lanes): the I/O thread reads them without the device lock.
    doorbell_fds: Arc<Mutex<Vec<RawFd>>>,
    /// The counters. The gauges of what is up now (`lanes_out`, `lanes_in`, `ring_slots_out`)
    /// are not kept here: [`Link::stats`] reads them off the lanes.
    pub stats: SameHostStats,
}

impl Link {
    /// The link of a device whose UDP sockets are bound to `locals`; off if `enabled` is false.
    /// An address whose name cannot be listened on only receives over UDP.
    pub fn new(enabled: bool, locals: impl Iterator<Item = SocketAddr>) -> Link {
        let mut l = Link { enabled, slots: slots_by_env(), ..Link::default() };
        l.stats.enabled = enabled;
        if enabled {
            for a in locals {
                let name = abstract_name(a);
                if let Ok(lis) = Listener::bind(Path::new(OsStr::from_bytes(&name))) {
                    if set_nonblocking(lis.as_raw_fd()).is_ok() {
                        l.listeners.push((lis, a));
                    }
                }
            }
        }
        l
    }

    /// Whether packets a device sends to itself skip the socket too (see `loopback.rs`): with the
    /// link, `SOFTRDMA_SAME_HOST=0` sends them over UDP.
    pub fn loops_back(&self) -> bool {
        self.enabled
    }

    /// Count a packet the device sent to itself at `now`; `placed`: it went region to region.
    pub fn looped(&mut self, now: Instant, placed: bool) {
        self.looped_at = Some(now);
        self.stats.loopback_pkts += 1;
        self.stats.loopback_placed += u64::from(placed);
    }

    /// Count `n` messages the engine executed directly between two of the device's QPs at `now`
    /// (traffic to itself, as [`Link::looped`] counts).
    pub fn executed_directly(&mut self, now: Instant, n: u64) {
        self.looped_at = Some(now);
        self.stats.loopback_direct += n;
    }

    /// Whether packets arrive without a socket: an inbound lane is up, or the device sent itself a
    /// packet within [`LOOPBACK_QUIET`]. A busy poll then reads the UDP sockets less often (see
    /// the runtime's `UDP_EVERY`).
    pub fn receives_locally(&self, now: Instant) -> bool {
        !self.inbound.is_empty() || self.looped_at.is_some_and(|t| now < t + LOOPBACK_QUIET)
    }

    /// The link's counters, with the lanes and ring slots up now.
    pub fn stats(&self) -> SameHostStats {
        let out = || self.outbound.iter().filter_map(|o| o.lane.as_ref());
        SameHostStats {
            lanes_out: out().count() as u64,
            lanes_in: self.inbound.len() as u64,
            ring_slots_out: out().map(|l| u64::from(l.prod.ring().capacity())).sum(),
            ..self.stats
        }
    }

    /// Whether any outbound lane is up.
    pub fn has_outbound_lane(&self) -> bool {
        self.outbound.iter().any(|o| o.lane.is_some())
    }

    /// The outbound lane for `dst` (sending from `src`), opening one if none was tried recently.
    pub fn lane_for(&mut self, dst: SocketAddr, src: SocketAddr, now: Instant) -> Option<usize> {
        // A multicast group's packets go to the network, where every member receives them.
        if !self.enabled || dst.ip().is_multicast() {
            return None;
        }
        if let Some(i) = self.spec.filter(|&i| self.outbound[i].dst == dst && self.outbound[i].lane.is_some()) {
            return Some(i);
        }
        let i = match self.outbound.iter().position(|o| o.dst == dst) {
            Some(i) => i,
            None => {
                self.outbound.push(Outbound { dst, lane: None, retry_at: now });
                self.outbound.len() - 1
            }
        };
        let o = &mut self.outbound[i];
        if o.lane.is_some() {
            return Some(i);
        }
        if now < o.retry_at {
            return None;
        }
        o.retry_at = now + RETRY;
        match connect(src, dst, self.slots, now) {
            Ok(lane) => {
                lane.prod.ring().set_producer_cpu(self.poller_cpu);
                o.lane = Some(lane);
                self.stats.connects += 1;
                Some(i)
            }
            Err(_) => {
                self.stats.connect_failures += 1;
                None
            }
        }
    }

    /// The thread with poller id `id` (poller.rs), polling this device for completions, runs on
    /// `cpu`, given as `(cpu, id)` (`None`: no thread polls now, the I/O thread does the work):
    /// say so in every outbound lane when it changed, for the peers' pollers
    /// ([`Link::peer_poller_on`]).
    pub fn poller_at(&mut self, poller: Option<(u32, u32)>) {
        if self.poller_cpu != poller {
            self.poller_cpu = poller;
            for l in self.outbound.iter().filter_map(|o| o.lane.as_ref()) {
                l.prod.ring().set_producer_cpu(poller);
            }
        }
    }

    /// The poller id of a peer's polling thread (a peer that sends to us on a lane) that said it
    /// runs on `cpu` and is not the thread `id` itself (a thread that polls both ends of a lane
    /// waits for nobody). Two busy pollers waiting for each other on one core (the kernel places a
    /// process woken by another on the waker's CPU, and may take milliseconds to spread them) get
    /// nowhere until the waiting one gives up the core, or one of them moves (poller.rs).
    pub fn peer_poller_on(&self, cpu: u32, id: u32) -> Option<u32> {
        self.inbound
            .iter()
            .find_map(|l| l.cons.ring().producer_cpu().filter(|&(c, p)| c == cpu && p != id).map(|(_, p)| p))
    }

    /// Where to build the next packet: the free slot (packet area) of the lane the last one went to.
    pub fn spec_slot(&mut self) -> Option<(usize, &mut [u8])> {
        let i = self.spec?;
        let s = self.outbound[i].lane.as_mut()?.slot()?;
        Some((i, &mut s[SLOT_HEADER..]))
    }

    /// The free slot (packet area) of outbound lane `i` for a packet that goes out ahead of a
    /// flush (the runtime's `send_ahead`): `None` if the lane is down, its ring is full, or a
    /// packet waits parked for it (that one goes first). Publish with [`Link::publish`].
    pub fn slot_ahead(&mut self, i: usize) -> Option<&mut [u8]> {
        let lane = self.outbound.get_mut(i)?.lane.as_mut().filter(|l| l.pending_len == 0)?;
        let s = lane.slot()?;
        Some(&mut s[SLOT_HEADER..])
    }

    /// Publish the packet of `len` bytes built in lane `i`'s [`Link::spec_slot`].
    pub fn publish(&mut self, i: usize, len: usize) {
        let Some(lane) = self.outbound[i].lane.as_mut() else { return };
        let Some(s) = lane.slot() else { return };
        s[..4].copy_from_slice(&(len as u32).to_le_bytes());
        lane.prod.publish_tagged();
        lane.dirty = true;
        self.stats.tx_pkts += 1;
        self.stats.tx_bytes += len as u64;
        self.spec = Some(i);
    }

    /// Copy the packet of `len` bytes built in lane `i`'s unpublished slot into `out`.
    pub fn copy_unpublished(&mut self, i: usize, out: &mut [u8]) {
        if let Some(s) = self.outbound[i].lane.as_mut().and_then(|l| l.slot()) {
            out.copy_from_slice(&s[SLOT_HEADER..][..out.len()]);
        }
    }

    /// Copy `pkt` into lane `i` and publish it. A full ring grows if it may ([`Link::grow`]), or
    /// keeps the packet in the lane's overflow buffer (the link is then [`Link::congested`]);
    /// false (counted) if that is taken too, or the packet is too large.
    pub fn push(&mut self, i: usize, pkt: &[u8]) -> bool {
        let Some(lane) = self.outbound[i].lane.as_ref() else { return false };
        if pkt.len() > MAX_PACKET {
            return false;
        }
        if lane.pending_len == 0 {
            let room = self.make_room(i);
            if let Some(s) = self.outbound[i].lane.as_mut().filter(|_| room).and_then(OutLane::slot) {
                s[SLOT_HEADER..][..pkt.len()].copy_from_slice(pkt);
                self.publish(i, pkt.len());
                return true;
            }
            let Some(lane) = self.outbound[i].lane.as_mut() else { return false };
            lane.pending[..pkt.len()].copy_from_slice(pkt);
            lane.pending_len = pkt.len();
            self.stats.tx_ring_full += 1;
            return true;
        }
        self.stats.tx_dropped += 1;
        false
    }

    /// Move the packets waiting in overflow buffers into their rings where there is room now.
    /// Returns whether the link is still [`Link::congested`].
    pub fn flush_pending(&mut self) -> bool {
        let mut congested = false;
        for i in 0..self.outbound.len() {
            if self.outbound[i].lane.as_ref().is_none_or(|l| l.pending_len == 0) {
                continue;
            }
            let room = self.make_room(i);
            match self.outbound[i].lane.as_mut().filter(|_| room).and_then(OutLane::unpark) {
                Some(len) => self.publish(i, len),
                None => congested = true,
            }
        }
        congested
    }

    /// Whether lane `i` has a free slot for a packet, its ring grown first if it was full and may
    /// grow ([`Link::grow`]).
    fn make_room(&mut self, i: usize) -> bool {
        let Some(lane) = self.outbound[i].lane.as_mut() else { return false };
        lane.slot().is_some() || self.grow(i)
    }

    /// Replace lane `i`'s full ring with one [`GROWTH`] times larger, if it is smaller than the
    /// link's slot count ([`Link::move_ring`]). Returns whether it grew. A ring that cannot be
    /// made or sent (no memory, a receiver that does not read its connection) ends the lane's
    /// growing: the kept slot is free for packets, and no later full ring tries again.
    fn grow(&mut self, i: usize) -> bool {
        let Some(lane) = self.outbound[i].lane.as_mut().filter(|l| l.keep > 0) else { return false };
        let slots = lane.prod.ring().capacity().saturating_mul(GROWTH).min(self.slots);
        if !self.move_ring(i, slots) {
            if let Some(lane) = self.outbound[i].lane.as_mut() {
                lane.keep = 0;
            }
            return false;
        }
        self.stats.rings_grown += 1;
        true
    }

    /// Move lane `i` to a new ring of `slots` slots: the receiver gets it first (a [`MOVE`]
    /// message with its descriptor), then a free slot of the old ring (the kept one, when the ring
    /// is full) says [`MOVED`], and the next packets go to the new ring. False if the old ring
    /// has no free slot, or the new one cannot be made or sent; the lane is then as it was.
    ///
    /// A receiver that asked the old ring for a doorbell is rung here: it may have read the
    /// message and gone back to sleep before the slot said it moved, and later doorbell checks
    /// look at the new ring only.
    fn move_ring(&mut self, i: usize, slots: u32) -> bool {
        let (poller, max) = (self.poller_cpu, self.slots);
        let Some(lane) = self.outbound[i].lane.as_mut() else { return false };
        if lane.prod.slot_mut().is_none() {
            return false;
        }
        let sent = new_ring(slots).and_then(|(shm, ring)| {
            lane.conn.send(format!("{MOVE} {slots}").as_bytes(), &[shm.fd().as_raw_fd()])?;
            Ok((shm, ring))
        });
        // The slot is still free: nothing else produces into this ring.
        let (Ok((shm, ring)), Some(s)) = (sent, lane.prod.slot_mut()) else { return false };
        s[..4].copy_from_slice(&MOVED.to_le_bytes());
        lane.prod.publish_tagged();
        if lane.prod.take_doorbell_request() {
            ring_doorbell(&lane.conn);
            self.stats.doorbells += 1;
        }
        ring.set_producer_cpu(poller);
        // The old producer goes before the mapping it writes.
        lane.prod = Producer::new(ring);
        lane._shm = shm;
        lane.keep = u32::from(slots < max);
        lane.dirty = true;
        // The new ring's index starts again from 0: its quiet spell starts at the next look.
        lane.quiet.0 = u32::MAX;
        true
    }

    /// Move every grown outbound ring that has carried nothing for [`SHRINK_AFTER`], and whose
    /// receiver has taken everything, back to a ring of the first size.
    fn shrink_quiet(&mut self, now: Instant) {
        let first = self.slots.min(FIRST_SLOTS);
        for i in 0..self.outbound.len() {
            let Some(lane) = self.outbound[i].lane.as_mut() else { continue };
            let at = lane.prod.produced();
            if at != lane.quiet.0 {
                lane.quiet = (at, now);
                continue;
            }
            // Not grown, not quiet long enough, a packet waiting for room (the receiver stalled:
            // the traffic did not stop), or entries the receiver has not taken yet.
            let small = lane.prod.ring().capacity() <= first;
            if small || now < lane.quiet.1 + SHRINK_AFTER || lane.pending_len > 0 || lane.prod.in_flight() > 0 {
                continue;
            }
            let moved = self.move_ring(i, first);
            self.stats.rings_shrunk += u64::from(moved);
            if let Some(lane) = self.outbound[i].lane.as_mut() {
                // Tried again after another quiet spell if it failed.
                lane.quiet = (lane.prod.produced(), now);
            }
        }
    }

    /// Whether a lane's ring is full with a packet waiting, or the last flush stopped taking
    /// packets to the device itself at its budget ([`Link::loop_budget_used`]): the runtime takes
    /// no more packets from the engine (they stay queued there) and comes back soon
    /// ([`CONGESTED_WAIT`]).
    pub fn congested(&self) -> bool {
        self.loop_backlog || self.outbound.iter().any(|o| o.lane.as_ref().is_some_and(|l| l.pending_len > 0))
    }

    /// The flush handed over as much to the device itself as one flush may: the rest waits (in
    /// the engine, or the CM) for the next flush, so that one post of a large transfer between two
    /// QPs of the device does not keep the device (and its lock) for all of it.
    pub fn loop_budget_used(&mut self) {
        self.loop_backlog = true;
        self.stats.loopback_budget_stops += 1;
    }

    /// A flush starts: it takes over any backlog the last one left.
    pub fn flush_starts(&mut self) {
        self.loop_backlog = false;
    }

    /// The next packets go to UDP: build them in the transmit buffer.
    pub fn clear_spec(&mut self) {
        self.spec = None;
    }

    /// After a batch of sends: wake each receiver that sleeps and got entries.
    pub fn ring_doorbells(&mut self) {
        for o in &mut self.outbound {
            let Some(lane) = o.lane.as_mut().filter(|l| l.dirty) else { continue };
            lane.dirty = false;
            if lane.prod.take_doorbell_request() {
                self.stats.doorbells += 1;
                ring_doorbell(&lane.conn);
            }
        }
    }

    /// Whether an inbound lane has an entry waiting (or is closing and must be looked at): an
    /// empty busy poll then leaves the lanes where they are.
    pub fn inbound_waiting(&self) -> bool {
        self.inbound.iter().any(|l| l.closing || l.cons.front_tagged().is_some())
    }

    /// The inbound lanes, taken out for [`Lanes::receive`] (so that the packets they hand over can
    /// be delivered to the rest of the device state); give them back with [`Link::put_inbound`].
    pub fn take_inbound(&mut self) -> Lanes {
        Lanes { lanes: std::mem::take(&mut self.inbound), stats: LaneCounts::default() }
    }

    /// Give back what [`Link::take_inbound`] took, with the counts of its receive.
    pub fn put_inbound(&mut self, lanes: Lanes) {
        let (s, d) = (&mut self.stats, &lanes.stats);
        s.rx_pkts += d.rx_pkts;
        s.rx_bytes += d.rx_bytes;
        s.rx_malformed += d.rx_malformed;
        s.ring_corrupt += d.ring_corrupt;
        s.peer_gone += d.peer_gone;
        self.inbound = lanes.lanes;
    }

    /// Accept new lanes, notice hung-up ones and move quiet grown rings back to the first size:
    /// at most every [`MAINTAIN_EVERY`] unless `force`. Returns whether a lane came or went.
    pub fn maintain(&mut self, now: Instant, force: bool) -> bool {
        if !self.enabled || (!force && now < self.next_maintain) {
            return false;
        }
        let changed = self.maintain_now(now);
        let open = || self.inbound.iter().filter(|l| !l.closing).map(|l| l.conn.as_raw_fd());
        let mut shared = self.doorbell_fds.lock().expect("doorbell fds");
        // Rebuilt only when a lane came or went (no allocation on every maintenance).
        if !shared.iter().copied().eq(open()) {
            shared.clear();
            shared.extend(open());
        }
        changed
    }

    fn maintain_now(&mut self, now: Instant) -> bool {
        let before = (self.stats.accepts, self.stats.peer_gone, self.stats.ring_corrupt);
        // A producer index that is not within the ring: nothing that ring says can be trusted any
        // more. Hang up (the peer falls back to UDP). Checked here rather than per packet: the
        // receive path reads the slots' tags only, not the index the producer keeps writing.
        let n = self.inbound.len();
        self.inbound.retain(|l| l.cons.tagged_index_ok());
        self.stats.ring_corrupt += (n - self.inbound.len()) as u64;
        self.next_maintain = now + MAINTAIN_EVERY;
        self.shrink_quiet(now);
        let mut pfds = std::mem::take(&mut self.pfds);
        pfds.clear();
        let ev = |fd: RawFd, events: libc::c_short| libc::pollfd { fd, events, revents: 0 };
        pfds.extend(self.listeners.iter().map(|(l, _)| ev(l.as_raw_fd(), libc::POLLIN)));
        // A closing lane's socket stays readable (end of file): leave it out, or poll would never wait.
        let open: Vec<usize> = (0..self.inbound.len()).filter(|&i| !self.inbound[i].closing).collect();
        pfds.extend(open.iter().map(|&i| ev(self.inbound[i].conn.as_raw_fd(), libc::POLLIN)));
        pfds.extend(self.outbound.iter().filter_map(|o| o.lane.as_ref()).map(|l| ev(l.conn.as_raw_fd(), 0)));
        if pfds.is_empty() {
            self.pfds = pfds;
            return false;
        }
        // SAFETY: `pfds` is a live array of pollfd of the length given; a zero timeout never waits.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 0) };
        if n > 0 {
            let (nl, ni) = (self.listeners.len(), open.len());
            let hup = libc::POLLHUP | libc::POLLERR | libc::POLLNVAL;
            // Outbound lanes first (their indices are stable: entries are never removed).
            let mut k = nl + ni;
            for o in &mut self.outbound {
                if o.lane.is_none() {
                    continue;
                }
                if pfds[k].revents & hup != 0 {
                    o.lane = None;
                    o.retry_at = now + RETRY;
                    self.stats.peer_gone += 1;
                }
                k += 1;
            }
            if self.spec.is_some_and(|i| self.outbound[i].lane.is_none()) {
                self.spec = None;
            }
            for (k, &i) in open.iter().enumerate() {
                let r = pfds[nl + k].revents;
                let lane = &mut self.inbound[i];
                let mut gone = r & hup != 0;
                if r & libc::POLLIN != 0 {
                    gone |= !drain(lane);
                }
                if gone {
                    lane.closing = true;
                    self.stats.peer_gone += 1;
                }
            }
            for (li, p) in pfds[..nl].iter().enumerate() {
                if p.revents & libc::POLLIN != 0 {
                    self.accept_all(li);
                }
            }
        }
        self.pfds = pfds;
        before != (self.stats.accepts, self.stats.peer_gone, self.stats.ring_corrupt)
    }

    fn accept_all(&mut self, li: usize) {
        loop {
            let (lis, local) = &self.listeners[li];
            let local = *local;
            let conn = match lis.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            match accept(conn, local) {
                Ok(lane) => {
                    self.inbound.push(lane);
                    self.stats.accepts += 1;
                }
                Err(_) => self.stats.refused += 1,
            }
        }
    }

    /// Before the I/O thread sleeps: add the link's descriptors to `fds` and ask every inbound
    /// lane for a doorbell. Returns false if a lane has entries already (do not sleep).
    pub fn sleep_prepare(&mut self, fds: &mut Vec<libc::pollfd>) -> bool {
        let ev = |fd: RawFd, events: libc::c_short| libc::pollfd { fd, events, revents: 0 };
        fds.extend(self.listeners.iter().map(|(l, _)| ev(l.as_raw_fd(), libc::POLLIN)));
        fds.extend(self.outbound.iter().filter_map(|o| o.lane.as_ref()).map(|l| ev(l.conn.as_raw_fd(), 0)));
        let mut empty = true;
        for l in &self.inbound {
            if l.closing {
                // Entries left to deliver: do not sleep; its socket is at end of file.
                empty &= l.cons.front_tagged().is_none();
                continue;
            }
            fds.push(ev(l.conn.as_raw_fd(), libc::POLLIN));
            empty &= l.cons.request_doorbell();
        }
        empty
    }

    /// Ask every inbound lane that is not closing for a doorbell. Returns false if a lane has
    /// entries already (nobody would ring for those).
    pub fn arm_inbound(&mut self) -> bool {
        let mut empty = true;
        for l in self.inbound.iter().filter(|l| !l.closing) {
            empty &= l.cons.request_doorbell();
        }
        empty
    }

    /// The sockets of the inbound lanes that are not closing (readable when the peer rings, or
    /// hangs up), kept up to date by [`Link::maintain`] for a thread that does not hold the
    /// device lock. A lane dropped since may leave a closed or reused descriptor there until the
    /// next `maintain`: a spurious wake-up at worst.
    pub fn doorbell_fds(&self) -> Arc<Mutex<Vec<RawFd>>> {
        Arc::clone(&self.doorbell_fds)
    }

    /// Whether any inbound lane is open (one that a peer can ring).
    pub fn has_inbound(&self) -> bool {
        self.inbound.iter().any(|l| !l.closing)
    }

    /// After the sleep: withdraw the doorbell requests (the thread polls again).
    pub fn sleep_done(&mut self) {
        for l in &self.inbound {
            l.cons.cancel_doorbell();
        }
    }
}

/// The inbound lanes of a [`Link`] while they are being read, and the counts of that read.
pub(crate) struct Lanes {
    lanes: Vec<Inbound>,
    stats: LaneCounts,
}

/// What one [`Lanes::receive`] counts, added to [`SameHostStats`] when the lanes go back.
#[derive(Debug, Default)]
struct LaneCounts {
    rx_pkts: u64,
    rx_bytes: u64,
    rx_malformed: u64,
    ring_corrupt: u64,
    peer_gone: u64,
}

impl Lanes {
    /// Hand every waiting inbound packet (up to a budget per lane) to `f(packet, src, local,
    /// taken)`, `taken` being how many this call took from the packet's lane before it; `f`
    /// returns false to leave that packet, and the rest of its lane, for the next call. Returns
    /// how many it took. Broken lanes are dropped.
    pub fn receive(&mut self, mut f: impl FnMut(&[u8], SocketAddr, SocketAddr, usize) -> bool) -> usize {
        let mut got = 0;
        for lane in &mut self.lanes {
            let (mut taken, mut moved) = (0, 0);
            // A slot saying the ring moved is not a packet: a lane's first packet in a call is
            // taken with `taken` 0 wherever it is. Moves have a budget of their own (a sender
            // that keeps moving cannot hold the device here).
            while taken < LANE_BUDGET && moved < MOVES_PER_CALL {
                // The slot's tag says whether it holds the next entry (one cache line for a small
                // packet); the producer index is checked by `Link::maintain`.
                let Some(slot) = lane.cons.front_tagged() else { break };
                let len = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
                if len == MOVED {
                    let was_closing = lane.closing;
                    let ok = lane.move_on().is_ok();
                    self.stats.peer_gone += u64::from(lane.closing && !was_closing);
                    if !ok {
                        lane.broken = true;
                        self.stats.ring_corrupt += 1;
                        break;
                    }
                    moved += 1;
                    continue;
                }
                let len = len as usize;
                match slot.get(SLOT_HEADER..).and_then(|p| p.get(..len)).filter(|_| len <= MAX_PACKET) {
                    Some(pkt) => {
                        if !f(pkt, lane.src, lane.local, taken) {
                            break;
                        }
                        self.stats.rx_pkts += 1;
                        self.stats.rx_bytes += len as u64;
                        got += 1;
                    }
                    None => self.stats.rx_malformed += 1,
                }
                lane.cons.advance();
                taken += 1;
            }
        }
        if self.lanes.iter().any(|l| l.closing || l.broken) {
            self.lanes.retain(|l| !l.broken && (!l.closing || l.cons.front_tagged().is_some()));
        }
        got
    }
}

/// Wake the receiver at the other end of `conn`: one byte.
fn ring_doorbell(conn: &Conn) {
    // SAFETY: a one-byte send from a live buffer on our socket; never blocks. A full socket means
    // a doorbell is already pending, which is as good.
    unsafe {
        libc::send(conn.as_raw_fd(), [1u8].as_ptr() as *const libc::c_void, 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    };
}

/// Read what waits on an inbound lane's (non-blocking) connection: doorbells, and the sender's
/// next rings ([`MOVE`] messages, kept in [`Inbound::moves`] until the ring says it moved);
/// false if the peer hung up.
fn drain(lane: &mut Inbound) -> bool {
    let mut b = [0u8; 64];
    loop {
        match lane.conn.recv_into(&mut b) {
            Ok(Some((n, mut fds))) => {
                let mut words = std::str::from_utf8(&b[..n]).unwrap_or("").split(' ');
                if words.next() == Some(MOVE) && fds.len() == 1 {
                    if lane.moves.len() == MAX_MOVES {
                        // More rings than a lane can grow through: not a softrdma sender.
                        return false;
                    }
                    // A count that does not parse is refused when the ring says it moved.
                    let slots = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                    lane.moves.push_back((fds.remove(0), slots));
                }
            }
            Ok(None) => return false,
            // A message too long for a doorbell or a ring is nothing we sent: skip it.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => continue,
            Err(e) => return e.kind() == io::ErrorKind::WouldBlock,
        }
    }
}

fn same_user(conn: &Conn) -> io::Result<()> {
    if conn.peer_cred()?.uid != geteuid() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "same-host peer runs as another user"));
    }
    Ok(())
}

/// Whether a ring of `slots` slots is one a lane may have (a power of two, at most [`MAX_SLOTS`]).
fn slots_ok(slots: u32) -> bool {
    slots.is_power_of_two() && slots <= MAX_SLOTS
}

/// A new lane ring of `slots` slots, every page in place (see the module comment).
fn new_ring(slots: u32) -> io::Result<(Shm, Ring)> {
    let shm = Shm::create_populated("softrdma-lane", ring_bytes(slots, SLOT_SIZE))?;
    let ring = shm.ring(0, slots, SLOT_SIZE)?;
    ring.init();
    Ok((shm, ring))
}

/// Open a lane to the device that owns `dst` at `now`, with a ring that may grow to `max_slots`.
fn connect(src: SocketAddr, dst: SocketAddr, max_slots: u32, now: Instant) -> io::Result<OutLane> {
    // A non-blocking connect: a listener with a full backlog refuses (EAGAIN) instead of making
    // us wait with the device lock held.
    // SAFETY: plain socket(2).
    let raw =
        unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let name = abstract_name(dst);
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > a.sun_path.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    for (d, s) in a.sun_path.iter_mut().zip(&name) {
        *d = *s as libc::c_char;
    }
    // The same length softrdma_abi::sock::Listener binds with (family, name, one NUL).
    let len = (std::mem::size_of::<libc::sa_family_t>() + name.len() + 1) as libc::socklen_t;
    // SAFETY: `a` is a valid sockaddr_un of length `len`.
    if unsafe { libc::connect(fd.as_raw_fd(), &a as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let conn = Conn::from_fd(fd);
    same_user(&conn)?;
    let slots = max_slots.min(FIRST_SLOTS);
    let (shm, ring) = new_ring(slots)?;
    let hello = format!("{HELLO} {src} {dst} {slots} {SLOT_SIZE}");
    conn.send(hello.as_bytes(), &[shm.fd().as_raw_fd()])?;
    Ok(OutLane {
        prod: Producer::new(ring),
        keep: u32::from(slots < max_slots),
        quiet: (0, now),
        pending: vec![0; MAX_PACKET],
        pending_len: 0,
        conn,
        _shm: shm,
        dirty: false,
    })
}

/// Check a connection's hello and map its ring.
fn accept(conn: Conn, local: SocketAddr) -> io::Result<Inbound> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    same_user(&conn)?;
    // The sender sends its hello right after connecting; bound the wait for a peer that does not.
    conn.set_read_timeout(Some(Duration::from_millis(100)))?;
    let (msg, mut fds) = conn.recv()?.ok_or_else(|| bad("hung up before its hello"))?;
    let text = std::str::from_utf8(&msg).map_err(|_| bad("hello not text"))?;
    let w: Vec<&str> = text.split(' ').collect();
    let [magic, src, dst, slots, slot_size] = w[..] else { return Err(bad("hello of the wrong shape")) };
    let src: SocketAddr = src.parse().map_err(|_| bad("bad source"))?;
    let dst: SocketAddr = dst.parse().map_err(|_| bad("bad destination"))?;
    let slots: u32 = slots.parse().map_err(|_| bad("bad slot count"))?;
    let slot_size: u32 = slot_size.parse().map_err(|_| bad("bad slot size"))?;
    if magic != HELLO || dst != local || src.port() == 0 || slot_size != SLOT_SIZE || !slots_ok(slots) || fds.len() != 1
    {
        return Err(bad("hello refused"));
    }
    let fd = fds.pop().ok_or_else(|| bad("no ring"))?;
    // Shm::open checks the memfd is sealed against shrinking: the peer cannot truncate it under
    // our mapping (a SIGBUS on our next read). Populated, as on the sender's side.
    let shm = Shm::open_populated(fd, ring_bytes(slots, SLOT_SIZE))?;
    let ring = shm.ring(0, slots, SLOT_SIZE)?;
    if !ring.header_ok() {
        return Err(bad("ring header"));
    }
    conn.set_read_timeout(None)?;
    set_nonblocking(conn.as_raw_fd())?;
    Ok(Inbound {
        cons: Consumer::new(ring),
        conn,
        _shm: shm,
        src,
        local,
        closing: false,
        moves: VecDeque::new(),
        broken: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane's ring and a producer writing into it, as a sender has them.
    fn ring(slots: u32) -> (Shm, Consumer, Producer) {
        let (shm, ring) = new_ring(slots).unwrap();
        let cons = Consumer::new(shm.ring(0, slots, SLOT_SIZE).unwrap());
        (shm, cons, Producer::new(ring))
    }

    /// Publish a slot whose length field is `len` and whose packet area starts with `bytes`.
    fn publish(p: &mut Producer, len: u32, bytes: &[u8]) {
        let s = p.slot_mut().unwrap();
        s[..4].copy_from_slice(&len.to_le_bytes());
        s[SLOT_HEADER..SLOT_HEADER + bytes.len()].copy_from_slice(bytes);
        p.publish_tagged();
    }

    /// A slot saying the ring moved is no packet: the first packet after it is handed over as
    /// its lane's first of the call (`taken` 0), so the receive's rule for a lane's first packet
    /// (always taken) holds across a move; and the lane goes on in the new ring.
    #[test]
    fn a_moved_slot_uses_none_of_the_lanes_budget() {
        let (shm, cons, mut old) = ring(FIRST_SLOTS);
        let (new_shm, _, mut new) = ring(4 * FIRST_SLOTS);
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let addr: SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let inbound = Inbound {
            cons,
            conn: Conn::from_fd(a.into()),
            _shm: shm,
            src: addr,
            local: addr,
            closing: false,
            moves: VecDeque::from([(new_shm.fd().try_clone().unwrap(), 4 * FIRST_SLOTS)]),
            broken: false,
        };
        publish(&mut old, MOVED, &[]);
        publish(&mut new, 4, b"one!");
        publish(&mut new, 4, b"2222");
        let mut lanes = Lanes { lanes: vec![inbound], stats: LaneCounts::default() };
        let mut seen = Vec::new();
        let got = lanes.receive(|pkt, _, _, taken| {
            seen.push((pkt.to_vec(), taken));
            true
        });
        assert_eq!(got, 2);
        assert_eq!(seen, [(b"one!".to_vec(), 0), (b"2222".to_vec(), 1)]);
        assert_eq!((lanes.stats.rx_pkts, lanes.stats.rx_malformed), (2, 0));
        assert_eq!(lanes.lanes[0].cons.ring().capacity(), 4 * FIRST_SLOTS);
        assert!(!lanes.lanes[0].broken);
    }

    /// Every counter survives the trip through softrdmad's named list, under its own name.
    #[test]
    fn named_counters_round_trip() {
        let mut s = SameHostStats { enabled: true, ..SameHostStats::default() };
        let names = s.named();
        for (i, (name, _)) in names.iter().enumerate().skip(1) {
            let field = SameHostStats::from_named(&[(name.clone(), 100 + i as u64)]);
            assert_ne!(field, SameHostStats::default(), "{name} maps to no field");
        }
        let list: Vec<(String, u64)> = names.iter().enumerate().map(|(i, (n, _))| (n.clone(), i as u64)).collect();
        s = SameHostStats::from_named(&list);
        assert_eq!(s.named(), list);
        assert_eq!(names.len(), 28);
        assert!(names.iter().all(|(n, _)| n.starts_with("same_host_")));
    }
}
