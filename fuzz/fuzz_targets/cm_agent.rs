//! The CM agent's state machine under hostile MADs. A victim agent listens on a port and connects
//! to a peer agent; the input drives the exchange, chunk by chunk: deliver the peer's next MAD with
//! bytes XORed into it, deliver raw bytes as a MAD, fire the next timer, accept or reject a
//! pending request, disconnect, or let the victim's MADs reach the peer. Nothing may panic, and
//! every MAD the victim sends must parse.
#![no_main]

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use softrdma_cm::{AgentConfig, CmAgent, ConnParam, EventKind, IdHandle, Output, PortSpace};
use softrdma_transport::{Instant, Mtu};
use softrdma_wire::cm::CmMessage;
use softrdma_wire::Qpn;

struct Side {
    agent: CmAgent,
    gid: [u8; 16],
    /// MADs it sent, not yet delivered.
    out: VecDeque<Box<[u8; 256]>>,
    /// IDs that got a connect request or got established.
    ids: Vec<IdHandle>,
}

fn side(i: u8) -> Side {
    let ip = IpAddr::from([10, 9, 0, i]);
    let cfg = AgentConfig { response_timeout: 8, max_retries: 2, ..AgentConfig::new(u64::from(i), vec![(ip, 1)], Mtu::M1024, u64::from(i)) };
    let gid = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    Side { agent: CmAgent::new(cfg), gid, out: VecDeque::new(), ids: Vec::new() }
}

/// Take what `s` produced: its MADs (each must parse) and its events.
fn drain(s: &mut Side) {
    while let Some(o) = s.agent.poll_output() {
        if let Output::Mad { mad, .. } = o {
            CmMessage::parse(&mad[..]).expect("the agent sends well-formed MADs");
            s.out.push_back(mad);
        }
    }
    while let Some(ev) = s.agent.poll_event() {
        if matches!(ev.kind, EventKind::ConnectRequest { .. } | EventKind::Established) {
            s.ids.push(ev.id);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (mut victim, mut peer) = (side(2), side(1));
    let mut now = Instant::ZERO;
    let port = 7174;
    let l = victim.agent.create_id(PortSpace::Tcp);
    victim.agent.bind(l, SocketAddr::new(IpAddr::from([10, 9, 0, 2]), port)).unwrap();
    victim.agent.listen(l, 4).unwrap();
    // The peer connects to the victim, and the victim to a listener of the peer's.
    let pl = peer.agent.create_id(PortSpace::Tcp);
    peer.agent.bind(pl, SocketAddr::new(IpAddr::from([10, 9, 0, 1]), port)).unwrap();
    peer.agent.listen(pl, 4).unwrap();
    for (from, to) in [(&mut peer, [10, 9, 0, 2]), (&mut victim, [10, 9, 0, 1])] {
        let c = from.agent.create_id(PortSpace::Tcp);
        from.agent.resolve_addr(c, None, SocketAddr::new(IpAddr::from(to), port)).unwrap();
        from.agent.resolve_route(c).unwrap();
        from.agent.connect(c, ConnParam::new(Qpn::new(0x20)), now).unwrap();
    }
    drain(&mut peer);
    drain(&mut victim);
    for chunk in data.chunks(33) {
        let (op, bytes) = chunk.split_first().unwrap();
        match op % 7 {
            0 => {
                if let Some(mut mad) = peer.out.pop_front() {
                    for (i, b) in bytes.iter().enumerate() {
                        mad[(usize::from(*op) * 7 + i * 8) % 256] ^= b;
                    }
                    victim.agent.handle_mad(now, peer.gid, &mad[..]);
                }
            }
            1 => {
                if let Some(mad) = peer.out.pop_front() {
                    victim.agent.handle_mad(now, peer.gid, &mad[..]);
                }
            }
            2 => {
                let mut mad = [0u8; 256];
                mad[..bytes.len()].copy_from_slice(bytes);
                victim.agent.handle_mad(now, peer.gid, &mad[..usize::from(*op).max(bytes.len())]);
            }
            3 => {
                let next = [victim.agent.poll_timeout(), peer.agent.poll_timeout()].into_iter().flatten().min();
                if let Some(t) = next {
                    now = t;
                    victim.agent.handle_timeout(now);
                    peer.agent.handle_timeout(now);
                }
            }
            4 => {
                if let Some(id) = victim.ids.pop() {
                    let _ = if op & 0x80 == 0 {
                        victim.agent.accept(id, ConnParam::new(Qpn::new(0x30)), now)
                    } else {
                        victim.agent.reject(id, bytes)
                    };
                }
                if let Some(id) = peer.ids.pop() {
                    let _ = peer.agent.accept(id, ConnParam::new(Qpn::new(0x40)), now);
                }
            }
            5 => {
                if let Some(&id) = victim.ids.first() {
                    let _ = victim.agent.disconnect(id, now);
                }
                if op & 0x80 != 0 {
                    if let Some(&id) = victim.ids.first() {
                        let _ = victim.agent.destroy_id(id, now);
                        victim.ids.remove(0);
                    }
                }
            }
            _ => {
                while let Some(mad) = victim.out.pop_front() {
                    peer.agent.handle_mad(now, victim.gid, &mad[..]);
                }
            }
        }
        drain(&mut victim);
        drain(&mut peer);
    }
});
