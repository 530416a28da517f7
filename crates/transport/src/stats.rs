//! Counters, named after the kernel rxe's hw counters where one exists.

/// Engine counters. All monotonically increasing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Packets handed to `handle_packet`.
    pub rcvd_pkts: u64,
    /// Packets produced by `poll_transmit`.
    pub sent_pkts: u64,
    /// Payload bytes received in accepted requests and read responses.
    pub rcvd_bytes: u64,
    /// Payload bytes sent.
    pub sent_bytes: u64,
    /// Packets that failed to parse (malformed).
    pub drop_malformed: u64,
    /// Packets for a QPN that does not exist.
    pub drop_unknown_qp: u64,
    /// Packets for a QP in a state that does not accept them, or of the wrong transport.
    pub drop_bad_state: u64,
    /// Packets whose P_Key does not match.
    pub drop_pkey: u64,
    /// UD packets whose Q_Key does not match.
    pub drop_qkey: u64,
    /// UD/UC packets dropped for lack of a receive WQE.
    pub drop_no_recv: u64,
    /// UC packets dropped as part of a broken message.
    pub drop_uc_msg: u64,
    /// Responses that match nothing outstanding.
    pub drop_stray_resp: u64,
    /// Duplicate requests handled by the responder (rxe `duplicate_request`).
    pub duplicate_request: u64,
    /// PSN sequence errors seen by the responder (rxe `out_of_seq_request`).
    pub out_of_seq_request: u64,
    /// NAKs with PSN sequence error received by the requester (rxe `rcvd_seq_err`).
    pub rcvd_seq_err: u64,
    /// RNR NAKs sent (rxe `send_rnr_nak`).
    pub send_rnr_nak: u64,
    /// RNR NAKs received (rxe `rcvd_rnr_err`).
    pub rcvd_rnr_err: u64,
    /// Error NAKs sent (invalid request, remote access, remote operational).
    pub send_err_nak: u64,
    /// Error NAKs received.
    pub rcvd_err_nak: u64,
    /// Retransmission rounds started (rxe `retry_exceeded_err` counts the failures).
    pub retry_rounds: u64,
    /// Request packets sent again (rxe `retransmits`... counted per packet here).
    pub retransmits: u64,
    /// Local ACK timeouts fired (rxe `completer_retry_err`).
    pub ack_timeouts: u64,
    /// Completions dropped because a CQ was full.
    pub cq_overflow: u64,
}

impl Counters {
    /// A packet received and dropped because it did not parse.
    pub fn count_malformed(&mut self) {
        self.rcvd_pkts += 1;
        self.drop_malformed += 1;
    }
}
