//! The InfiniBand path MTU (`enum ibv_mtu`, the 4-bit code in CM messages): how many payload
//! bytes one packet of a message carries. One type for every layer: the engine's packetization,
//! the port attributes a device reports, the verbs ABI and the CM's path records.

use core::fmt;

/// An InfiniBand path MTU; the discriminant is the `enum ibv_mtu` / `enum ib_mtu` number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes (enum value 1).
    M256 = 1,
    /// 512 bytes (2).
    M512 = 2,
    /// 1024 bytes (3).
    M1024 = 3,
    /// 2048 bytes (4).
    M2048 = 4,
    /// 4096 bytes (5).
    M4096 = 5,
}

impl Mtu {
    /// All MTUs, smallest first.
    pub const ALL: [Mtu; 5] = [Mtu::M256, Mtu::M512, Mtu::M1024, Mtu::M2048, Mtu::M4096];

    /// Payload bytes per packet.
    pub const fn bytes(self) -> usize {
        128 << (self as usize)
    }

    /// The MTU of exactly `bytes` bytes (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: usize) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.bytes() == bytes)
    }

    /// The `enum ibv_mtu` number (1..=5).
    pub const fn ib_enum(self) -> u8 {
        self as u8
    }

    /// The MTU for an `enum ibv_mtu` number.
    pub fn from_ib_enum(n: u8) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.ib_enum() == n)
    }

    /// The largest MTU not above `bytes`, if any (rxe's `rxe_mtu_int_to_enum`).
    pub fn floor(bytes: usize) -> Option<Mtu> {
        Mtu::ALL.into_iter().rev().find(|m| m.bytes() <= bytes)
    }
}

impl fmt::Display for Mtu {
    /// The byte count, as `ibv_devinfo` prints it (`1024`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.bytes(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions() {
        for (m, bytes, n) in [
            (Mtu::M256, 256, 1),
            (Mtu::M512, 512, 2),
            (Mtu::M1024, 1024, 3),
            (Mtu::M2048, 2048, 4),
            (Mtu::M4096, 4096, 5),
        ] {
            assert_eq!(m.bytes(), bytes);
            assert_eq!(Mtu::from_bytes(bytes), Some(m));
            assert_eq!(m.ib_enum(), n);
            assert_eq!(Mtu::from_ib_enum(n), Some(m));
            assert_eq!(m.to_string(), bytes.to_string());
        }
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_ib_enum(0), None);
        assert_eq!(Mtu::from_ib_enum(6), None);
        assert_eq!(Mtu::floor(255), None);
        assert_eq!(Mtu::floor(1500), Some(Mtu::M1024));
        assert_eq!(Mtu::floor(1 << 20), Some(Mtu::M4096));
    }
}
