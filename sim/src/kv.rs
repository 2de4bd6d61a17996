//! The simulated KV pool: a few bytes per token slot saying which token of which request of which
//! tenant was written there, pages handed out LIFO and never cleared — as engines do.

use kvguard::cuda::canary;
use kvguard::{PageId, PageRef, RequestId, TenantId};

/// Bytes of simulated KV per token slot: token id, request id, tenant id (`u32` LE each).
pub const SLOT_BYTES: u32 = 12;

/// What one slot holds, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotKv {
    /// The token id.
    pub token: u32,
    /// The request that wrote it (low 32 bits; 0 = never written).
    pub request: u32,
    /// Its tenant (low 32 bits; 0 = never written).
    pub tenant: u32,
}

impl SlotKv {
    /// The KV `request` of `tenant` writes for `token`.
    pub fn new(token: u32, request: RequestId, tenant: TenantId) -> SlotKv {
        SlotKv { token, request: request.0 as u32, tenant: tenant.0 as u32 }
    }
}

/// A pool of `pages` pages of `page_size` slots; bytes start zeroed and are never cleared again.
#[derive(Debug)]
pub struct KvPool {
    page_size: u32,
    bytes: Vec<u8>,
    /// The device canary per slot ([`canary`], kvguard's kernel-exact one); 0 = never stamped.
    canaries: Vec<u32>,
    /// The engine's own free list (LIFO), independent of kvguard.
    free: Vec<u32>,
}

impl KvPool {
    /// A zeroed pool with every page free.
    pub fn new(pages: u32, page_size: u32) -> KvPool {
        let slots = pages as usize * page_size as usize;
        KvPool {
            page_size,
            bytes: vec![0; slots * SLOT_BYTES as usize],
            canaries: vec![0; slots],
            free: (0..pages).rev().collect(),
        }
    }

    /// Token slots per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Free pages.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// The engine allocator: `n` pages, most recently freed first, or `None` if too few are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<PageId>> {
        let at = self.free.len().checked_sub(n)?;
        Some(self.free.drain(at..).rev().map(PageId).collect())
    }

    /// Returns pages to the free list, without clearing them.
    pub fn free(&mut self, pages: &[PageId]) {
        self.free.extend(pages.iter().rev().map(|p| p.0));
    }

    fn slot_index(&self, page: PageId, slot: u32) -> usize {
        page.0 as usize * self.page_size as usize + slot as usize
    }

    /// Writes one slot.
    pub fn write(&mut self, page: PageId, slot: u32, kv: SlotKv) {
        let at = self.slot_index(page, slot) * SLOT_BYTES as usize;
        let b = &mut self.bytes[at..at + SLOT_BYTES as usize];
        b[0..4].copy_from_slice(&kv.token.to_le_bytes());
        b[4..8].copy_from_slice(&kv.request.to_le_bytes());
        b[8..12].copy_from_slice(&kv.tenant.to_le_bytes());
    }

    /// Reads one slot.
    #[inline]
    pub fn read(&self, page: PageId, slot: u32) -> SlotKv {
        let at = self.slot_index(page, slot) * SLOT_BYTES as usize;
        let word = |o: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&self.bytes[at + o..at + o + 4]);
            u32::from_le_bytes(w)
        };
        SlotKv { token: word(0), request: word(4), tenant: word(8) }
    }

    /// The bytes of `page`'s first `slots` slots: what a transfer sends.
    pub fn page_bytes(&self, page: PageId, slots: u32) -> &[u8] {
        let at = self.slot_index(page, 0) * SLOT_BYTES as usize;
        &self.bytes[at..at + slots as usize * SLOT_BYTES as usize]
    }

    /// Copies transferred bytes into `page` from slot 0 (whole slots; a ragged tail is dropped).
    pub fn land(&mut self, page: PageId, bytes: &[u8]) {
        let max = self.page_size as usize * SLOT_BYTES as usize;
        let len = bytes.len().min(max) / SLOT_BYTES as usize * SLOT_BYTES as usize;
        let at = self.slot_index(page, 0) * SLOT_BYTES as usize;
        self.bytes[at..at + len].copy_from_slice(&bytes[..len]);
    }

    /// The KV-write path's canary stamp for slots `0..slots` of `page` written by `request`.
    pub fn stamp(&mut self, request: RequestId, page: PageRef, slots: u32) {
        for slot in 0..slots.min(self.page_size) {
            let i = self.slot_index(page.page, slot);
            self.canaries[i] = canary(request.0, page.generation.0, page.page.0, slot);
        }
    }

    /// The read path's canary check: whether `slot` of `page` holds the canary `request` stamps
    /// there in this incarnation (a never-stamped slot never does: canaries are never 0).
    #[inline]
    pub fn canary_matches(&self, request: RequestId, page: PageRef, slot: u32) -> bool {
        self.canaries[self.slot_index(page.page, slot)] == canary(request.0, page.generation.0, page.page.0, slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvguard::Generation;

    #[test]
    fn pages_are_reused_lifo_and_keep_their_bytes() {
        let mut pool = KvPool::new(4, 2);
        let a = pool.allocate(2).unwrap();
        assert_eq!(a, vec![PageId(0), PageId(1)]);
        pool.write(a[1], 1, SlotKv { token: 7, request: 1, tenant: 2 });
        pool.free(&a);
        let b = pool.allocate(1).unwrap();
        assert_eq!(b, vec![PageId(0)]);
        let c = pool.allocate(1).unwrap();
        assert_eq!(c, vec![PageId(1)]);
        assert_eq!(pool.read(c[0], 1), SlotKv { token: 7, request: 1, tenant: 2 });
        assert!(pool.allocate(3).is_none());
    }

    #[test]
    fn a_canary_matches_only_its_writer_incarnation_and_slot() {
        let mut pool = KvPool::new(8, 4);
        let r = PageRef { page: PageId(3), generation: Generation(1) };
        pool.stamp(RequestId(1), r, 2);
        assert!(pool.canary_matches(RequestId(1), r, 0) && pool.canary_matches(RequestId(1), r, 1));
        assert!(!pool.canary_matches(RequestId(2), r, 0), "another request");
        assert!(!pool.canary_matches(RequestId(1), PageRef { generation: Generation(2), ..r }, 0), "next incarnation");
        assert!(!pool.canary_matches(RequestId(1), r, 2), "a slot never stamped");
    }
}
