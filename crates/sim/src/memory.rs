//! Simulated registered memory: regions with keys, PDs, access rights and bounds, implementing the
//! engine's [`MemoryAccess`] exactly as a real device must (check first, then touch).

use std::collections::BTreeMap;

use softrdma_transport::{Access, AtomicOp, KeyKind, MemError, MemoryAccess, PdId};

/// One registered region.
#[derive(Debug, Clone)]
pub struct Region {
    /// Protection domain.
    pub pd: PdId,
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Rights.
    pub access: Access,
    /// Contents.
    pub bytes: Vec<u8>,
}

/// A node's memory: regions by key (lkey = rkey, as rxe does).
#[derive(Debug, Default)]
pub struct SimMemory {
    regions: BTreeMap<u32, Region>,
    next_key: u32,
    next_addr: u64,
}

impl SimMemory {
    /// Empty memory.
    pub fn new() -> SimMemory {
        SimMemory { regions: BTreeMap::new(), next_key: 0x100, next_addr: 0x1_0000_0000 }
    }

    /// Register `len` zero bytes; returns (key, address).
    pub fn register(&mut self, pd: PdId, len: usize, access: Access) -> (u32, u64) {
        let key = self.next_key;
        self.next_key += 0x100;
        let addr = self.next_addr;
        // Leave a gap between regions so out-of-bounds addresses never land in a neighbour.
        self.next_addr += (len as u64 + 0x10_0000) & !0xfff;
        self.regions.insert(key, Region { pd, addr, access, bytes: vec![0; len] });
        (key, addr)
    }

    /// Register `len` zero bytes at a chosen key (lkey = rkey) and virtual address, as a capture
    /// shows them, e.g. to replay the kernel's RETH and AtomicETH unchanged. Panics if the key is
    /// taken; keys handed out by [`SimMemory::register`] are multiples of 0x100, so pick others.
    pub fn register_at(&mut self, pd: PdId, key: u32, addr: u64, len: usize, access: Access) {
        assert!(!self.regions.contains_key(&key), "key {key:#x} is already registered");
        self.regions.insert(key, Region { pd, addr, access, bytes: vec![0; len] });
    }

    /// Deregister.
    pub fn deregister(&mut self, key: u32) {
        self.regions.remove(&key);
    }

    /// The region of `key`.
    pub fn region(&self, key: u32) -> &Region {
        &self.regions[&key]
    }

    /// Mutable region of `key`.
    pub fn region_mut(&mut self, key: u32) -> &mut Region {
        self.regions.get_mut(&key).expect("registered key")
    }

    fn resolve(&self, pd: PdId, key: u32, addr: u64, len: u64, need: Access) -> Result<(&Region, usize), MemError> {
        let r = self.regions.get(&key).ok_or(MemError::InvalidKey)?;
        if r.pd != pd {
            return Err(MemError::PdMismatch);
        }
        if !r.access.contains(need) {
            return Err(MemError::AccessDenied);
        }
        let end = addr.checked_add(len).ok_or(MemError::OutOfBounds)?;
        if addr < r.addr || end > r.addr + r.bytes.len() as u64 {
            return Err(MemError::OutOfBounds);
        }
        Ok((r, (addr - r.addr) as usize))
    }
}

fn read_right(kind: KeyKind) -> Access {
    match kind {
        KeyKind::Local => Access::NONE,
        KeyKind::Remote => Access::REMOTE_READ,
    }
}

fn write_right(kind: KeyKind) -> Access {
    match kind {
        KeyKind::Local => Access::LOCAL_WRITE,
        KeyKind::Remote => Access::REMOTE_WRITE,
    }
}

impl MemoryAccess for SimMemory {
    fn check(&self, pd: PdId, key: u32, _kind: KeyKind, addr: u64, len: u64, access: Access) -> Result<(), MemError> {
        self.resolve(pd, key, addr, len, access).map(|_| ())
    }

    fn read(&self, pd: PdId, key: u32, kind: KeyKind, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let (r, off) = self.resolve(pd, key, addr, out.len() as u64, read_right(kind))?;
        out.copy_from_slice(&r.bytes[off..off + out.len()]);
        Ok(())
    }

    fn write(&mut self, pd: PdId, key: u32, kind: KeyKind, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let (_, off) = self.resolve(pd, key, addr, data.len() as u64, write_right(kind))?;
        let r = self.regions.get_mut(&key).expect("resolved");
        r.bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn atomic(&mut self, pd: PdId, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        if !addr.is_multiple_of(8) {
            return Err(MemError::Misaligned);
        }
        let (_, off) = self.resolve(pd, rkey, addr, 8, Access::REMOTE_ATOMIC)?;
        let r = self.regions.get_mut(&rkey).expect("resolved");
        let word: &mut [u8] = &mut r.bytes[off..off + 8];
        let orig = u64::from_ne_bytes(word.try_into().expect("8 bytes"));
        word.copy_from_slice(&op.apply(orig).to_ne_bytes());
        Ok(orig)
    }

    fn invalidate(&mut self, pd: PdId, rkey: u32) -> Result<(), MemError> {
        match self.regions.get(&rkey) {
            Some(r) if r.pd == pd => {
                self.regions.remove(&rkey);
                Ok(())
            }
            Some(_) => Err(MemError::PdMismatch),
            None => Err(MemError::InvalidKey),
        }
    }
}
