//! Newtypes for the protocol's numbers: 24-bit PSNs with modular arithmetic and 24-bit QPNs.

use core::fmt;

/// Mask of a 24-bit field.
pub const MASK24: u32 = 0x00ff_ffff;

/// A packet sequence number: 24 bits, compared and advanced modulo 2^24.
///
/// Ordering follows the IB rule used by rxe's `psn_compare`: `a` is before `b` when `b - a`
/// (mod 2^24) lies in the lower half of the space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// A PSN from the low 24 bits of `v`.
    pub const fn new(v: u32) -> Psn {
        Psn(v & MASK24)
    }

    /// The raw 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// This PSN advanced by `n` (mod 2^24).
    pub const fn add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & MASK24)
    }

    /// This PSN moved back by `n` (mod 2^24).
    pub const fn sub(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n) & MASK24)
    }

    /// The next PSN.
    pub const fn next(self) -> Psn {
        self.add(1)
    }

    /// Signed distance from `other` to `self` in the 24-bit circle: positive when `self` is later.
    pub const fn diff(self, other: Psn) -> i32 {
        // Shift the 24-bit difference into the top of an i32 and back to sign-extend it.
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// `self` comes strictly before `other`.
    pub const fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }

    /// `self` comes strictly after `other`.
    pub const fn after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// A queue pair number (24 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Qpn(u32);

impl Qpn {
    /// QP0, the subnet management QP.
    pub const SMI: Qpn = Qpn(0);
    /// QP1, the general services interface (CM) QP.
    pub const GSI: Qpn = Qpn(1);
    /// The multicast QPN 0xFFFFFF.
    pub const MULTICAST: Qpn = Qpn(MASK24);

    /// A QPN from the low 24 bits of `v`.
    pub const fn new(v: u32) -> Qpn {
        Qpn(v & MASK24)
    }

    /// The raw 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_wraps_and_compares_across_zero() {
        let top = Psn::new(0xff_fffe);
        assert_eq!(top.add(3), Psn::new(1));
        assert!(top.before(Psn::new(1)));
        assert!(Psn::new(1).after(top));
        assert_eq!(Psn::new(1).diff(top), 3);
        assert_eq!(top.diff(Psn::new(1)), -3);
        assert_eq!(Psn::new(0).sub(1), Psn::new(0xff_ffff));
        assert_eq!(Psn::new(0x1234_5678).value(), 0x34_5678);
    }

    #[test]
    fn psn_half_space_boundary() {
        let a = Psn::new(0);
        assert!(Psn::new(0x7f_ffff).after(a));
        assert!(Psn::new(0x80_0000).before(a));
        assert!(!a.before(a) && !a.after(a));
    }
}
