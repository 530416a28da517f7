//! A device no application thread calls into (the passive side of one-sided operations) is
//! driven by its I/O thread, which polls for a while after work rather than sleeping at once. In a
//! test binary of its own: the same-host tests run busy pollers in parallel, and on a small
//! machine they keep the I/O thread off the CPUs for longer than it polls.

mod common;

use common::pair::{pair, stats};
use common::{pattern, wait_one, Endpoint};
use softrdma_verbs::SendOp;

/// `reads` RDMA READs from `a` of the 4 KiB `data` in `b`'s region, each waited for and checked
/// byte for byte (ids from `first` on); returns how many doorbells `a` rang meanwhile. Nothing
/// touches `b`'s device meanwhile (an access to its region goes through the device, as an
/// application's call would).
fn reads(a: &Endpoint, b: &Endpoint, data: &[u8], reads: u32, first: u32) -> u64 {
    let rang = stats(a).doorbells;
    for i in 0..reads {
        let id = u64::from(first + i);
        a.mr.write(0, &[0; 4096]).unwrap();
        a.post(id, SendOp::Read { remote_addr: b.mr.addr() + 8192, rkey: b.mr.rkey() }, 0, 4096);
        wait_one(&a.cq, id);
        assert!(a.mr.to_vec(0, 4096).unwrap() == data, "read data");
    }
    stats(a).doorbells - rang
}

/// A device whose application never calls in (the passive side of RDMA READs, as perftest's READ
/// server) is driven by its I/O thread, which keeps polling for a while after it found work
/// instead of going back to sleep: READs that follow each other closely find it looking, and the
/// requester rings no doorbell for them (asleep, the I/O thread asks for one before each sleep).
/// (A loaded machine may keep the requester away longer than the I/O thread polls: up to five
/// runs of 200 READs, of which one must ring for fewer than a quarter.)
#[test]
fn a_passive_device_keeps_polling_between_requests() {
    const READS: u32 = 200;
    let (a, b, _) = pair(51, [true, true]);
    let data = pattern(4096, 7);
    b.mr.write(8192, &data).unwrap();
    reads(&a, &b, &data, 1, 0);
    let mut runs = Vec::new();
    for run in 1..=5 {
        runs.push(reads(&a, &b, &data, READS, run * 1000));
        if runs[runs.len() - 1] < u64::from(READS / 4) {
            return;
        }
    }
    panic!("rang {runs:?} doorbells in runs of {READS} READs: {:?} {:?}", stats(&a), stats(&b));
}
