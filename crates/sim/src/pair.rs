//! Test conveniences: create connected QPs between two nodes and post to them.

use softrdma_transport::attr::QpCap;
use softrdma_transport::{
    Access, AddressVector, CqId, ModifyQp, Mtu, PdId, QpInit, QpState, QpType, RecvWr, SendWr, SrqId, VerbsError,
    WorkCompletion,
};
use softrdma_wire::{Psn, Qpn};

use crate::net::{Net, NodeId};

/// One side of a connection (or a UD QP).
#[derive(Debug, Clone, Copy)]
pub struct Endpoint {
    /// Node.
    pub node: NodeId,
    /// Protection domain.
    pub pd: PdId,
    /// Send CQ.
    pub scq: CqId,
    /// Receive CQ.
    pub rcq: CqId,
    /// QP number.
    pub qpn: Qpn,
}

/// Connection parameters.
#[derive(Debug, Clone, Copy)]
pub struct ConnOpts {
    /// Transport.
    pub qp_type: QpType,
    /// Path MTU.
    pub mtu: Mtu,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// RNR timer code.
    pub min_rnr_timer: u8,
    /// Initiator depth and responder resources.
    pub rd_atomic: u8,
    /// First PSN of side A's requester (B's is `psn_a + 0x1000`).
    pub psn: u32,
    /// Remote rights granted by both QPs.
    pub access: Access,
    /// Queue depths.
    pub depth: u32,
}

impl Default for ConnOpts {
    fn default() -> ConnOpts {
        ConnOpts {
            qp_type: QpType::Rc,
            mtu: Mtu::M1024,
            timeout: 8,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            rd_atomic: 16,
            psn: 0x10,
            access: Access::REMOTE_WRITE.with(Access::REMOTE_READ).with(Access::REMOTE_ATOMIC),
            depth: 4096,
        }
    }
}

impl Net {
    /// A QP of `o.qp_type` on `node`, in RESET, with its own CQs and PD 1.
    pub fn create_qp(&mut self, node: NodeId, o: &ConnOpts) -> Endpoint {
        self.create_qp_srq(node, o, None)
    }

    /// As [`Net::create_qp`], receiving from `srq` if given.
    pub fn create_qp_srq(&mut self, node: NodeId, o: &ConnOpts, srq: Option<SrqId>) -> Endpoint {
        let hca = &mut self.nodes[node].hca;
        let scq = hca.create_cq(o.depth * 2);
        let rcq = hca.create_cq(o.depth * 2);
        let pd = PdId(1);
        let cap = QpCap {
            max_send_wr: o.depth,
            max_recv_wr: o.depth,
            max_send_sge: 8,
            max_recv_sge: 8,
            max_inline_data: 256,
        };
        let qpn = hca
            .create_qp(QpInit { qp_type: o.qp_type, pd, send_cq: scq, recv_cq: rcq, srq, cap, sq_sig_all: false })
            .expect("create qp");
        Endpoint { node, pd, scq, rcq, qpn }
    }

    /// Modify a QP.
    pub fn modify(&mut self, ep: &Endpoint, m: &ModifyQp) -> Result<(), VerbsError> {
        let now = self.now;
        let n = &mut self.nodes[ep.node];
        n.hca.modify_qp(ep.qpn, m, now, &mut n.mem)
    }

    /// Bring a QP to RTS towards `peer` (RC/UC) or just to RTS (UD, `peer` ignored).
    pub fn bring_up(&mut self, ep: &Endpoint, peer: &Endpoint, o: &ConnOpts, sq_psn: u32, rq_psn: u32) {
        let ud = o.qp_type == QpType::Ud;
        let init = ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: ud.then_some(0x1111_1111),
            access: (!ud).then_some(o.access),
            ..Default::default()
        };
        self.modify(ep, &init).expect("INIT");
        let rc = o.qp_type == QpType::Rc;
        let av = AddressVector { dgid: self.nodes[peer.node].gid, hop_limit: 64, ..Default::default() };
        let rtr = ModifyQp {
            state: Some(QpState::Rtr),
            av: (!ud).then_some(av),
            path_mtu: (!ud).then_some(o.mtu),
            dest_qpn: (!ud).then_some(peer.qpn),
            rq_psn: (!ud).then_some(Psn::new(rq_psn)),
            max_dest_rd_atomic: rc.then_some(o.rd_atomic),
            min_rnr_timer: rc.then_some(o.min_rnr_timer),
            ..Default::default()
        };
        self.modify(ep, &rtr).expect("RTR");
        let rts = ModifyQp {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(sq_psn)),
            timeout: rc.then_some(o.timeout),
            retry_cnt: rc.then_some(o.retry_cnt),
            rnr_retry: rc.then_some(o.rnr_retry),
            max_rd_atomic: rc.then_some(o.rd_atomic),
            ..Default::default()
        };
        self.modify(ep, &rts).expect("RTS");
    }

    /// Two connected QPs, `a` on node `na` and `b` on node `nb`.
    pub fn connect(&mut self, na: NodeId, nb: NodeId, o: &ConnOpts) -> (Endpoint, Endpoint) {
        let a = self.create_qp(na, o);
        let b = self.create_qp(nb, o);
        let (pa, pb) = (o.psn, o.psn.wrapping_add(0x1000) & 0xff_ffff);
        self.bring_up(&a, &b, o, pa, pb);
        self.bring_up(&b, &a, o, pb, pa);
        (a, b)
    }

    /// Two connected QPs, `b` (on `nb`) receiving from `srq_b`.
    pub fn connect_srq(&mut self, na: NodeId, nb: NodeId, o: &ConnOpts, srq_b: SrqId) -> (Endpoint, Endpoint) {
        let a = self.create_qp(na, o);
        let b = self.create_qp_srq(nb, o, Some(srq_b));
        let (pa, pb) = (o.psn, o.psn.wrapping_add(0x1000) & 0xff_ffff);
        self.bring_up(&a, &b, o, pa, pb);
        self.bring_up(&b, &a, o, pb, pa);
        (a, b)
    }

    /// Post a send WR.
    pub fn post_send(&mut self, ep: &Endpoint, wr: SendWr) -> Result<(), VerbsError> {
        let now = self.now;
        let n = &mut self.nodes[ep.node];
        n.hca.post_send(ep.qpn, wr, now, &mut n.mem)
    }

    /// Post a receive WR.
    pub fn post_recv(&mut self, ep: &Endpoint, wr: RecvWr) -> Result<(), VerbsError> {
        let now = self.now;
        let n = &mut self.nodes[ep.node];
        n.hca.post_recv(ep.qpn, wr, now, &mut n.mem)
    }

    /// Drain a CQ.
    pub fn poll(&mut self, node: NodeId, cq: CqId) -> Vec<WorkCompletion> {
        let mut v = Vec::new();
        self.nodes[node].hca.poll_cq(cq, usize::MAX, &mut v).expect("cq exists");
        v
    }
}
