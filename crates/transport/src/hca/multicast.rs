//! UD multicast: which QPs are attached to which multicast group (`ibv_attach_mcast`), and the
//! delivery of a packet sent to a group (destination QPN 0xFFFFFF) to each of them.
//!
//! The group of a received packet is its destination GID, which only the I/O layer knows (for
//! RoCEv2, the destination IP address of the datagram): it passes it to
//! [`Hca::handle_multicast`]. Each attached QP takes its own copy through its usual UD receive
//! path (state, P_Key and Q_Key checks, a receive WQE of its own; a QP that fails a check is
//! skipped and the others still receive), as rxe does. The limits are rxe's.

use super::Hca;
use crate::error::VerbsError;
use crate::hca::RxInfo;
use crate::memory::MemoryAccess;
use crate::stats::Counters;
use crate::time::Instant;
use softrdma_wire::{IbPacket, Qpn};
use std::collections::BTreeMap;

/// Groups a device can have (rxe's `max_mcast_grp`).
pub const MAX_GROUPS: usize = 8192;
/// QPs attached to one group (rxe's `max_mcast_qp_attach`).
pub const MAX_QPS_PER_GROUP: usize = 56;
/// Attachments over all groups (rxe's `max_total_mcast_qp_attach`).
pub const MAX_ATTACHMENTS: usize = 0x70000;

/// Whether `gid` names a multicast group: an IPv6 multicast address (`ff00::/8`) or an IPv4-mapped
/// IPv4 multicast address (`::ffff:224.0.0.0/100`), as the kernel's `rdma_is_multicast_addr`.
pub fn is_multicast_gid(gid: &[u8; 16]) -> bool {
    if gid[0] == 0xff {
        return true;
    }
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff && gid[12] & 0xf0 == 0xe0
}

/// The attachments of one HCA.
#[derive(Debug, Default)]
pub(super) struct Groups {
    members: BTreeMap<[u8; 16], Vec<Qpn>>,
    attachments: usize,
}

impl Groups {
    /// Forget every attachment of `qpn` (its QP is destroyed).
    pub(super) fn forget_qp(&mut self, qpn: Qpn) {
        self.members.retain(|_, qps| {
            qps.retain(|&q| q != qpn);
            !qps.is_empty()
        });
        self.attachments = self.members.values().map(Vec::len).sum();
    }
}

impl Hca {
    /// Attach UD QP `qpn` to the multicast group `mgid` (`ibv_attach_mcast`; the MLID has no
    /// meaning on RoCE). Attaching a QP twice to a group is not an error and changes nothing.
    /// Refused: an unknown QP; a QP that is not UD, or a GID that is not a multicast address
    /// (`InvalidAttribute`, EINVAL); a group or the device at its limit (`CapacityExceeded`, ENOMEM).
    pub fn attach_mcast(&mut self, qpn: Qpn, mgid: [u8; 16]) -> Result<(), VerbsError> {
        let qp = self.qps.get(&qpn).ok_or(VerbsError::NoSuchObject)?;
        if qp.qp_type() != crate::attr::QpType::Ud {
            return Err(VerbsError::InvalidAttribute("multicast needs a UD QP"));
        }
        if !is_multicast_gid(&mgid) {
            return Err(VerbsError::InvalidAttribute("gid is not a multicast address"));
        }
        let g = &mut self.groups;
        match g.members.get(&mgid) {
            Some(qps) if qps.contains(&qpn) => return Ok(()),
            Some(qps) if qps.len() >= MAX_QPS_PER_GROUP => {
                return Err(VerbsError::CapacityExceeded("QPs attached to the group"));
            }
            None if g.members.len() >= MAX_GROUPS => return Err(VerbsError::CapacityExceeded("multicast groups")),
            _ => {}
        }
        if g.attachments >= MAX_ATTACHMENTS {
            return Err(VerbsError::CapacityExceeded("multicast attachments"));
        }
        g.members.entry(mgid).or_default().push(qpn);
        g.attachments += 1;
        Ok(())
    }

    /// Detach QP `qpn` from group `mgid` (`ibv_detach_mcast`); the group ends with its last QP.
    /// Refused (`InvalidAttribute`, EINVAL) when the QP is not attached to it.
    pub fn detach_mcast(&mut self, qpn: Qpn, mgid: [u8; 16]) -> Result<(), VerbsError> {
        let g = &mut self.groups;
        let qps = g.members.get_mut(&mgid).ok_or(VerbsError::InvalidAttribute("not attached to the group"))?;
        let at = qps.iter().position(|&q| q == qpn).ok_or(VerbsError::InvalidAttribute("not attached to the group"))?;
        qps.remove(at);
        if qps.is_empty() {
            g.members.remove(&mgid);
        }
        g.attachments -= 1;
        Ok(())
    }

    /// The QPs [`Hca::handle_multicast`] hands `pkt`, received as sent to group `mgid`, a copy of:
    /// the group's, if the packet is addressed to the multicast QPN; none otherwise.
    pub fn mcast_recipients(&self, pkt: &IbPacket<&[u8]>, mgid: &[u8; 16]) -> &[Qpn] {
        match self.groups.members.get(mgid) {
            Some(qps) if pkt.bth().dest_qp() == Qpn::MULTICAST => qps,
            _ => &[],
        }
    }

    /// The groups with at least one QP attached (the I/O layer listens on exactly these).
    pub fn mcast_groups(&self) -> impl Iterator<Item = &[u8; 16]> + '_ {
        self.groups.members.keys()
    }

    /// A received packet sent to multicast group `mgid` (its destination QPN is 0xFFFFFF; the I/O
    /// layer knows the group from the packet's destination address): a copy to every QP attached
    /// to the group. Counted as one packet received; a packet for a group with no QP attached, or
    /// not addressed to the multicast QPN, is dropped as for an unknown QP. `after(qpn, counters)`
    /// is called as each member QP is done with its copy, with the device's counters as they
    /// stand then: what changed since the call before (or since the packet came in) is that
    /// member's doing (a copy dropped for its Q_Key, or for want of a receive).
    pub fn handle_multicast(
        &mut self,
        now: Instant,
        pkt: &IbPacket<&[u8]>,
        rx: &RxInfo,
        mgid: &[u8; 16],
        mem: &mut dyn MemoryAccess,
        mut after: impl FnMut(Qpn, &Counters),
    ) {
        self.stats.rcvd_pkts += 1;
        // (A group has at least one QP: it ends with its last.)
        if self.mcast_recipients(pkt, mgid).is_empty() {
            self.stats.drop_unknown_qp += 1;
            return;
        }
        // Taken out while the QPs run (nothing they do changes the groups) and put back after.
        let Some(members) = self.groups.members.get_mut(mgid).map(std::mem::take) else { return };
        let (qps, mut book, mut ctx) = self.ctx(now, mem);
        for qpn in &members {
            if let Some(qp) = qps.get_mut(qpn) {
                qp.handle_packet(pkt, &rx.grh, &mut ctx);
                book.sync(qp);
                after(*qpn, ctx.stats);
            }
        }
        if let Some(qps) = self.groups.members.get_mut(mgid) {
            *qps = members;
        }
    }
}
