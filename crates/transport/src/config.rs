//! Engine configuration: limits and cadences, each with a documented default.

use crate::attr::Mtu;

/// Engine-wide settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Largest `max_rd_atomic` / `max_dest_rd_atomic` accepted (rxe: 128).
    pub max_rd_atomic: u8,
    /// The requester asks for an ACK on the first packet after more than this many in a row went
    /// without one (rxe's `RXE_MAX_PKT_PER_ACK`, 64: the 66th packet).
    pub ack_req_every: u32,
    /// At most this many PSNs are unacknowledged at once (go-back-N window). rxe stops when more
    /// than `RXE_MAX_UNACKED_PSNS` (128) are, so 129 behaves as rxe (the replay tests check it).
    /// The last packet sent before the window fills asks for an ACK.
    pub max_inflight_packets: u32,
    /// Port MTU: the UD message limit.
    pub port_mtu: Mtu,
    /// Largest message (rxe `max_msg_sz`: 2^31).
    pub max_msg_size: u64,
    /// Adapt the window to loss (AIMD): a retransmission round halves the requester's window (down
    /// to [`Config::MIN_WINDOW`] packets, or [`Config::MIN_WINDOW_REPEATED`] when the loss found
    /// it at that floor already), and it grows back by one packet per window of acknowledged
    /// packets (TCP's congestion avoidance), up to `max_inflight_packets`. Go-back-N resends
    /// everything after a lost packet, so a window far above what the path needs turns 1 % loss
    /// into mostly retransmissions; a halved window bounds that. A retransmission round that makes
    /// no progress is probed again after about a round trip (the requester's RTT estimate) rather
    /// than the local ACK timeout. Purely local: the peer sees the same packets, only fewer at once.
    pub adaptive_window: bool,
    /// Leave the payload of request packets of at least this many bytes (0: never) out of the
    /// transmit buffer: [`crate::Transmit::deferred`] then says where in registered memory it is, so
    /// the I/O layer can send it from there (an iovec pointing into the region) instead of the engine
    /// copying it into the buffer first. The engine still checks the keys and bounds; the buffer
    /// keeps a hole of the payload's size, and the ICRC is left for the I/O layer to compute (it
    /// seals every packet anyway).
    pub defer_payload_min: usize,
    /// Work per `poll_transmit`-driven requester step: at most this many packets from one QP before
    /// another QP gets a turn.
    pub burst: u32,
    /// Packets in flight for the whole device, shared among the RC QPs that have work: with `n` such
    /// QPs each gets a window of at most `device_inflight_packets / n` (but not below
    /// [`Config::MIN_SHARE`]). The path and the peer's receive buffer are shared by all QPs, so 64 QPs
    /// with a full window each would overflow them and lose packets that one QP alone would not.
    /// `u32::MAX` (the default) turns it off.
    pub device_inflight_packets: u32,
    /// Let sends posted to a busy RC QP wait for the next progress (the I/O layer asks
    /// [`crate::Hca::cork`] after a post): while enough of its packets are unacknowledged, their
    /// ACK comes about a round trip later and the flush that follows it sends what waited, in one
    /// batch, up to this many WQEs not yet started; should that ACK be lost, the cork timer
    /// ([`Config::CORK_WAIT`]) sends them. TCP's autocorking, for the same reason: one system call
    /// per small message costs more than the message. 0 (the default) never corks.
    pub cork_max_queued: usize,
}

impl Config {
    /// Smallest adaptive window, in packets.
    pub const MIN_WINDOW: u32 = 16;
    /// Smallest adaptive window after a loss that found the window at [`Config::MIN_WINDOW`] or
    /// below already (losses repeating faster than the window can grow).
    pub const MIN_WINDOW_REPEATED: u32 = 8;
    /// Smallest window a QP's share of `device_inflight_packets` goes down to, in packets.
    pub const MIN_SHARE: u32 = 4;
    /// Packets a QP must have unacknowledged before its new sends may wait (`cork_max_queued`): a
    /// request-response exchange with a few messages in flight is never delayed.
    pub const CORK_MIN_INFLIGHT: u32 = 8;
    /// Longest a corked send waits (`cork_max_queued`): many round trips on a LAN, far below the
    /// local ACK timeout, so a lost ACK costs this instead of a retransmission timeout.
    pub const CORK_WAIT: core::time::Duration = core::time::Duration::from_millis(1);
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_rd_atomic: 128,
            ack_req_every: 64,
            max_inflight_packets: 129,
            port_mtu: Mtu::M4096,
            max_msg_size: 1 << 31,
            burst: 16,
            adaptive_window: false,
            device_inflight_packets: u32::MAX,
            defer_payload_min: 0,
            cork_max_queued: 0,
        }
    }
}
