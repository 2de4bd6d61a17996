//! The simulated KV pool: a few bytes per token slot saying which token of which request of which
//! tenant was written there, pages handed out LIFO and never cleared — as engines do.

use crate::rng::mix64;
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
    /// The device canary per slot (see [`canary`]); 0 = never stamped.
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
            self.canaries[i] = canary(request, page, slot);
        }
    }

    /// The canary stamped on a slot.
    #[inline]
    pub fn canary_at(&self, page: PageId, slot: u32) -> u32 {
        self.canaries[self.slot_index(page, slot)]
    }
}

/// The device canary: 32 bits binding a slot to the request, page incarnation and slot that wrote
/// it; never 0, so a never-written slot fails too. A slot left over from another request or an
/// earlier incarnation matches with probability 2^-32.
#[inline]
pub fn canary(request: RequestId, page: PageRef, slot: u32) -> u32 {
    let h = mix64(
        request.0 ^ mix64((u64::from(page.generation.0) << 32) | u64::from(page.page.0)) ^ (u64::from(slot) << 40),
    );
    match (h ^ (h >> 32)) as u32 {
        0 => 1,
        c => c,
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
    fn canaries_differ_per_request_incarnation_and_slot() {
        let r = PageRef { page: PageId(3), generation: Generation(1) };
        let c = canary(RequestId(1), r, 0);
        assert_ne!(c, canary(RequestId(2), r, 0));
        assert_ne!(c, canary(RequestId(1), PageRef { generation: Generation(2), ..r }, 0));
        assert_ne!(c, canary(RequestId(1), PageRef { page: PageId(4), ..r }, 0));
        assert_ne!(c, canary(RequestId(1), r, 1));
    }
}
