//! `Hca::create_qp_with_qpn`: a QP at a number the caller picks, without disturbing allocation.

use softrdma_transport::attr::QpCap;
use softrdma_transport::{Config, Hca, PdId, QpInit, QpType, VerbsError};
use softrdma_wire::Qpn;

fn init(hca: &mut Hca) -> QpInit {
    let cq = hca.create_cq(16);
    QpInit {
        qp_type: QpType::Rc,
        pd: PdId(1),
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
        sq_sig_all: false,
    }
}

#[test]
fn chosen_qpn_is_used_and_the_counter_is_untouched() {
    let mut hca = Hca::new(Config::default());
    let i = init(&mut hca);
    assert_eq!(hca.create_qp_with_qpn(i, Qpn::new(0x14)), Ok(Qpn::new(0x14)));
    assert_eq!(hca.query_qp(Qpn::new(0x14)).unwrap().qpn, Qpn::new(0x14));
    // Ordinary allocation still starts at 0x11 and skips the number taken.
    assert_eq!(hca.create_qp(i), Ok(Qpn::new(0x11)));
    assert_eq!(hca.create_qp(i), Ok(Qpn::new(0x12)));
    assert_eq!(hca.create_qp(i), Ok(Qpn::new(0x13)));
    assert_eq!(hca.create_qp(i), Ok(Qpn::new(0x15)));
}

#[test]
fn reserved_and_taken_numbers_are_refused() {
    let mut hca = Hca::new(Config::default());
    let i = init(&mut hca);
    for q in [0, 1, 0x10, 0xff_ffff] {
        assert_eq!(hca.create_qp_with_qpn(i, Qpn::new(q)), Err(VerbsError::InvalidAttribute("qpn reserved")));
    }
    hca.create_qp_with_qpn(i, Qpn::new(0x1a)).unwrap();
    assert_eq!(hca.create_qp_with_qpn(i, Qpn::new(0x1a)), Err(VerbsError::InvalidAttribute("qpn in use")));
    // A refused call leaves no QP behind.
    assert_eq!(hca.create_qp(i), Ok(Qpn::new(0x11)));
    assert!(hca.query_qp(Qpn::new(0x12)).is_err());
}
