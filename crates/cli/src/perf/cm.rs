//! `perf -R`: the test's QPs connected with rdma_cm, as perftest's `-R` does, instead of by
//! trading QP numbers and PSNs over the TCP connection. The server listens on its device's
//! address; the client resolves it and connects one ID per QP (SIDR for UD). The REQ and the REP
//! (SIDR REQ and REP) carry each side's region, its address and rkey, as private data, and the CM
//! moves RC and UC QPs to RTS with the PSNs it picked. The TCP connection still carries the
//! tool's own agreement on the test, the listener's address, and the results.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use softrdma_verbs::{CmConnParam, CmEvent, CmEventChannel, CmEventKind, CmId, Gid, PortSpace, QpType};

use super::{Ctl, Dest, Plan, Role, Side, DEF_QKEY};

/// How long each step of a connection may take.
const STEP: Duration = Duration::from_secs(10);

/// The IDs of the connections and their channel, kept for as long as the test runs (an ID
/// dropped disconnects its QP).
pub(super) struct CmLinks {
    _ids: Vec<CmId>,
    _listener: Option<CmId>,
    _channel: CmEventChannel,
}

/// Connect this side's QPs (whose addresses are `mine`) to the peer's with rdma_cm on `port`,
/// and take the peer's QPs as their remote ends ([`Side::set_remote`]); returns those, as the
/// TCP exchange would have.
pub(super) fn connect(
    side: &mut Side,
    plan: &Plan,
    role: Role,
    ctl: &mut Ctl,
    mine: &mut [Dest],
    port: u16,
) -> Result<(Vec<Dest>, CmLinks), String> {
    let channel = CmEventChannel::new().map_err(|e| format!("rdma_cm: Couldn't create an event channel: {e}"))?;
    let ps = if plan.conn == QpType::Ud { PortSpace::Udp } else { PortSpace::Tcp };
    let own = mine.first().ok_or("no QPs")?.gid.to_ip();
    let (mut theirs, ids, listener) = match role {
        Role::Server => {
            let (theirs, ids, listener) = accept_all(side, plan, ctl, &channel, ps, mine, SocketAddr::new(own, port))?;
            (theirs, ids, Some(listener))
        }
        Role::Client => {
            let line = ctl.recv()?;
            if let Some(why) = line.strip_prefix("ERR ") {
                return Err(format!("the server: {why}"));
            }
            let at = line
                .strip_prefix("CM ")
                .and_then(|a| a.parse::<SocketAddr>().ok())
                .ok_or_else(|| format!("protocol error: {line:?} instead of the rdma_cm listener's address"))?;
            let (theirs, ids) = connect_all(side, plan, &channel, ps, mine, own, at)?;
            (theirs, ids, None)
        }
    };
    // The PSNs the CM picked, to print: each side's send PSN is the other's expected one. The
    // path MTU is the CM's too (the route's; an RTS QP's cannot change).
    if plan.conn != QpType::Ud {
        let mut path_mtu = side.mtu;
        for ((qp, me), peer) in side.qps.iter().zip(mine.iter_mut()).zip(theirs.iter_mut()) {
            let info = qp.query().map_err(|e| format!("Couldn't query the QP: {e}"))?;
            me.psn = info.sq_psn.value();
            peer.psn = info.rq_psn.value();
            path_mtu = info.path_mtu;
        }
        if path_mtu != side.mtu {
            if let Some(m) = plan.mtu {
                eprintln!(
                    " -m {} is not applied with -R: rdma_cm connected the QPs with MTU {}",
                    m.bytes(),
                    path_mtu.bytes()
                );
            }
            side.mtu = path_mtu;
        }
    }
    side.set_remote(plan, theirs.clone())?;
    Ok((theirs, CmLinks { _ids: ids, _listener: listener, _channel: channel }))
}

/// The server: listen at `at`, tell the client where, accept one request per QP.
fn accept_all(
    side: &Side,
    plan: &Plan,
    ctl: &mut Ctl,
    channel: &CmEventChannel,
    ps: PortSpace,
    mine: &[Dest],
    at: SocketAddr,
) -> Result<(Vec<Dest>, Vec<CmId>, CmId), String> {
    let listening =
        side.ctx.create_cm_id(channel, ps).map_err(|e| format!("rdma_cm: Couldn't create an ID: {e}")).and_then(|l| {
            l.bind_addr(at).map_err(|e| format!("rdma_cm: Couldn't bind to {at}: {e}"))?;
            l.listen(mine.len() as u32).map_err(|e| format!("rdma_cm: Couldn't listen on {at}: {e}"))?;
            Ok(l)
        });
    // The client waits for the address: it hears of a failure too.
    let listener = match listening {
        Ok(l) => l,
        Err(e) => {
            let _ = ctl.send(&format!("ERR {e}"));
            return Err(e);
        }
    };
    ctl.send(&format!("CM {at}"))?;
    let n = mine.len();
    let (mut theirs, mut ids) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // UD (SIDR) has no ESTABLISHED on this side.
    let mut to_establish = if plan.conn == QpType::Ud { 0 } else { n };
    while theirs.len() < n || to_establish > 0 {
        let ev = next_event(side, channel, "a connect request")?;
        match ev.kind {
            CmEventKind::ConnectRequest { .. } if theirs.len() < n => {
                let i = theirs.len();
                let id = ev.new_id.ok_or("rdma_cm: a connect request without its ID")?;
                let peer = ev.conn.remote_addr.ok_or("rdma_cm: a connect request without the peer's address")?;
                let (vaddr, rkey, qpn) = region(&ev.conn.private_data)?;
                theirs.push(Dest {
                    lid: 0,
                    out_reads: u16::from(ev.conn.initiator_depth),
                    // A SIDR request names no QP: the client's UD QP is in its private data.
                    qpn: if plan.conn == QpType::Ud { qpn } else { ev.conn.remote_qpn.value() },
                    psn: 0,
                    rkey,
                    vaddr,
                    gid: Gid::from_ip(peer.ip()),
                });
                id.accept(param(side, plan, i, &mine[i])).map_err(|e| format!("rdma_cm: Couldn't accept: {e}"))?;
                ids.push(id);
            }
            CmEventKind::Established if to_establish > 0 => to_establish -= 1,
            other => return Err(format!("rdma_cm: unexpected event {other:?} (status {})", ev.status)),
        }
    }
    Ok((theirs, ids, listener))
}

/// The client: one ID per QP, from the device's address `own` to the listener `at`.
fn connect_all(
    side: &Side,
    plan: &Plan,
    channel: &CmEventChannel,
    ps: PortSpace,
    mine: &[Dest],
    own: IpAddr,
    at: SocketAddr,
) -> Result<(Vec<Dest>, Vec<CmId>), String> {
    let (mut theirs, mut ids) = (Vec::with_capacity(mine.len()), Vec::with_capacity(mine.len()));
    for (i, me) in mine.iter().enumerate() {
        let id = side.ctx.create_cm_id(channel, ps).map_err(|e| format!("rdma_cm: Couldn't create an ID: {e}"))?;
        id.resolve_addr(Some(own), at).map_err(|e| format!("rdma_cm: Couldn't resolve {at}: {e}"))?;
        expect(side, channel, CmEventKind::AddrResolved)?;
        id.resolve_route().map_err(|e| format!("rdma_cm: Couldn't resolve the route to {at}: {e}"))?;
        expect(side, channel, CmEventKind::RouteResolved)?;
        id.connect(param(side, plan, i, me)).map_err(|e| format!("rdma_cm: Couldn't connect to {at}: {e}"))?;
        let ev = expect(side, channel, CmEventKind::Established)?;
        let (vaddr, rkey, _) = region(&ev.conn.private_data)?;
        let (qpn, gid) = match (plan.conn, &ev.ud) {
            (QpType::Ud, Some(ud)) => (ud.remote_qpn.value(), Gid(ud.dgid)),
            (QpType::Ud, None) => return Err("rdma_cm: the SIDR reply names no QP".into()),
            _ => (ev.conn.remote_qpn.value(), Gid::from_ip(at.ip())),
        };
        let out_reads = u16::from(ev.conn.responder_resources);
        theirs.push(Dest { lid: 0, out_reads, qpn, psn: 0, rkey, vaddr, gid });
        ids.push(id);
    }
    Ok((theirs, ids))
}

/// What this side offers for its QP `i`: its region and QP number as private data, READ/atomic
/// depths, and for UD the Q_Key its QPs use.
fn param(side: &Side, plan: &Plan, i: usize, me: &Dest) -> CmConnParam {
    let mut p = CmConnParam::new(side.qps[i].qpn());
    p.private_data = [&me.vaddr.to_be_bytes()[..], &me.rkey.to_be_bytes(), &me.qpn.to_be_bytes()].concat();
    p.responder_resources = plan.outs;
    p.initiator_depth = plan.outs;
    p.qkey = DEF_QKEY;
    p
}

/// The peer's region and QP number from its private data (address, rkey, QPN, big-endian;
/// rdma_cm may pad it).
fn region(private_data: &[u8]) -> Result<(u64, u32, u32), String> {
    let bad = || format!("rdma_cm: the peer's private data does not name its region: {private_data:02x?}");
    let field = |r: std::ops::Range<usize>| private_data.get(r).ok_or_else(bad);
    let vaddr = u64::from_be_bytes(field(0..8)?.try_into().map_err(|_| bad())?);
    let rkey = u32::from_be_bytes(field(8..12)?.try_into().map_err(|_| bad())?);
    let qpn = u32::from_be_bytes(field(12..16)?.try_into().map_err(|_| bad())?);
    Ok((vaddr, rkey, qpn))
}

fn next_event(side: &Side, channel: &CmEventChannel, what: &str) -> Result<CmEvent, String> {
    channel
        .get_event(&side.ctx, Some(STEP))
        .ok_or_else(|| format!("rdma_cm: no event within {STEP:?} (waiting for {what})"))
}

fn expect(side: &Side, channel: &CmEventChannel, kind: CmEventKind) -> Result<CmEvent, String> {
    let ev = next_event(side, channel, &format!("{kind:?}"))?;
    if ev.kind == kind {
        Ok(ev)
    } else {
        Err(format!("rdma_cm: {:?} (status {}) instead of {kind:?}", ev.kind, ev.status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_region_rides_in_the_private_data() {
        let pd =
            [&0x7f00_1234_5000u64.to_be_bytes()[..], &0xabcd_0102u32.to_be_bytes(), &0x11u32.to_be_bytes(), &[0; 40]]
                .concat();
        assert_eq!(region(&pd), Ok((0x7f00_1234_5000, 0xabcd_0102, 0x11)));
        assert!(region(&pd[..15]).unwrap_err().contains("does not name its region"));
    }
}
