//! The table's data: one tag per page, a coverage bitmap, the free list, requests and prefixes.
//!
//! Everything here runs under the table's lock; nothing here knows about policy or threads.

use super::lifecycle::Released;
use crate::config::PoolConfig;
use crate::error::Error;
use crate::ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
use bitvec::prelude::{BitVec, Lsb0};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicBool;

/// Where a page is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum PageState {
    /// In the free list (or free in shadow mode): nobody may read or write it.
    Free = 0,
    /// Owned by one request, which alone may write and read it.
    Owned = 1,
    /// Part of a read-only prefix: readable by the requests that hold it, writable by none.
    Shared = 2,
    /// Never allocatable, never readable (null/padding page).
    Reserved = 3,
    /// Its generation reached the limit: never handed out again.
    Retired = 4,
    /// Released, waiting for the engine to confirm it was poisoned or zeroed.
    AwaitingScrub = 5,
}

impl PageState {
    pub(crate) const COUNT: usize = 6;
}

/// One page's tag: 24 bytes, plus `page_size` bits of coverage elsewhere.
///
/// Coverage is a watermark plus a bitmap: slot `s` is written iff `s < written` or its bit is set.
/// Writes in order (prefill chunks, decode appends) only move the watermark; the bitmap is touched
/// only by writes that leave a gap (`sparse`), and cleared on release only if it was.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageTag {
    /// Owned: the owner. Shared: the publisher. Free: the last owner (for diagnosis only).
    /// The tenant is not stored: it is the owner's (owned) or the prefix's (shared).
    pub owner: RequestId,
    pub generation: u32,
    /// Slots `0..written` are all written by the current incarnation (the coverage watermark).
    pub written: u32,
    /// Owned: index in the owner's page list. Free: index in the free list. Shared: prefix slot.
    pub link: u32,
    pub state: PageState,
    /// Listed in `changed` since the last `take_changed`. Meaningless until the first call:
    /// changes are not tracked before a device mirror asks (`TableState::tracking_changes`),
    /// and the first `take_changed` hands back the whole pool.
    pub changed: bool,
    /// Some coverage bit of this incarnation may be set.
    pub sparse: bool,
    /// A KV transfer into this page is in flight ([`TableState::pin`]): if the page is released
    /// meanwhile it stays out of the free list until the transfer is finished or aborted, so the
    /// bytes still landing can never reach a next owner.
    pub pinned: bool,
}

pub(crate) struct RequestRecord {
    pub tenant: TenantId,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    /// Pages this request owns exclusively; `tags[p].link` is the index here.
    pub pages: Vec<PageId>,
    /// Prefix slots this request holds.
    pub prefixes: HeldPrefixes,
    /// Set by an enforced violation; checked by every read. Atomic so readers can set it under
    /// the shared lock.
    pub quarantined: AtomicBool,
}

/// The prefix slots one request holds: a sorted list, so the read path's membership test is a
/// binary search however many prefixes (one per cached block, in vLLM's style) a request holds.
#[derive(Clone, Debug, Default)]
pub(crate) struct HeldPrefixes(Vec<u32>);

impl HeldPrefixes {
    #[inline]
    pub fn contains(&self, slot: u32) -> bool {
        match self.0.len() {
            0 => false,
            1..=8 => self.0.contains(&slot),
            _ => self.0.binary_search(&slot).is_ok(),
        }
    }
    /// Adds `slot`; false if it was already held.
    pub fn insert(&mut self, slot: u32) -> bool {
        match self.0.binary_search(&slot) {
            Ok(_) => false,
            Err(at) => {
                self.0.insert(at, slot);
                true
            }
        }
    }
    /// Drops `slot`; false if it was not held.
    pub fn remove(&mut self, slot: u32) -> bool {
        match self.0.binary_search(&slot) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }
}

pub(crate) struct PrefixRecord {
    /// `None` for the anonymous prefix a fork creates; it goes when its last holder does.
    pub key: Option<PrefixKey>,
    pub tenant: TenantId,
    pub publisher: RequestId,
    pub pages: Vec<PageId>,
    pub holders: u32,
    /// A request of another tenant attached to it (under the publisher tenant's
    /// cross-tenant grant). Set on that attach (its pages are marked changed, so a device mirror
    /// re-syncs) and kept until the prefix goes: the device check, which cannot see holders,
    /// then lets any tenant read its pages.
    pub cross_tenant: bool,
}

/// Hashes the table's integer ids (requests, pages, prefix keys): one multiply-xorshift round
/// keyed per process from std's random state. SipHash cost more per request than a page's whole
/// verification; the random key keeps crafted ids (a hostile trace, say) from lining up in one
/// bucket chain.
#[derive(Clone, Copy)]
pub(crate) struct IdHash {
    key: u64,
}

impl Default for IdHash {
    fn default() -> Self {
        static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let key = *KEY.get_or_init(|| {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(0x006b_7667_7561_7264_u64) | 1
        });
        IdHash { key }
    }
}

impl std::hash::BuildHasher for IdHash {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(self.key)
    }
}

/// The hasher [`IdHash`] builds.
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    #[inline]
    fn finish(&self) -> u64 {
        let x = self.0;
        (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (x >> 29)
    }
}

/// A map keyed by one of the table's ids.
pub(crate) type IdMap<K, V> = HashMap<K, V, IdHash>;

/// How many emptied page lists the table keeps for reuse, and the largest it keeps: a request's
/// list is allocated once and handed from request to request, not freed and allocated again.
pub(crate) const SPARE_LISTS: usize = 32;
pub(crate) const SPARE_LIST_MAX_CAPACITY: usize = 8192;

/// The most ended request ids remembered to tell a double free from an unknown request.
pub(crate) const ENDED_MEMORY: usize = 1 << 16;

/// A bounded memory of recently ended requests: O(1) insert, lookup and forget.
#[derive(Default)]
pub(crate) struct RecentlyEnded {
    /// Ended request → the sequence number of its entry in `order`.
    set: IdMap<RequestId, u64>,
    order: VecDeque<(RequestId, u64)>,
    next: u64,
}

impl RecentlyEnded {
    pub fn insert(&mut self, req: RequestId) {
        let seq = self.next;
        self.next += 1;
        self.set.insert(req, seq);
        self.order.push_back((req, seq));
        while self.order.len() > ENDED_MEMORY {
            if let Some((old, old_seq)) = self.order.pop_front()
                && self.set.get(&old) == Some(&old_seq)
            {
                self.set.remove(&old);
            }
        }
    }
    pub fn contains(&self, req: RequestId) -> bool {
        self.set.contains_key(&req)
    }
    /// Forgets `req` (admitted again); its stale entry in `order` is skipped when it comes due.
    pub fn forget(&mut self, req: RequestId) {
        self.set.remove(&req);
    }
}

pub(crate) struct TableState {
    pub page_size: u32,
    pub max_context_tokens: u64,
    pub generation_limit: u32,
    pub scrub_on_release: bool,
    pub tags: Vec<PageTag>,
    pub coverage: BitVec<u64, Lsb0>,
    pub free: Vec<PageId>,
    pub requests: IdMap<RequestId, RequestRecord>,
    pub ended: RecentlyEnded,
    pub prefixes: Vec<Option<PrefixRecord>>,
    pub prefix_free_slots: Vec<u32>,
    pub prefix_keys: IdMap<PrefixKey, u32>,
    pub sharing_tenants: HashSet<TenantId>,
    pub state_counts: [u64; PageState::COUNT],
    pub changed: Vec<PageId>,
    /// Pinned page → the transfer ticket that pinned it (see `pin`).
    pub pins: IdMap<PageId, u64>,
    pub next_ticket: u64,
    /// Set by the first `take_changed`; until then no page is listed as changed (see
    /// [`PageTag::changed`]).
    pub tracking_changes: bool,
    /// Page lists of released requests, emptied, for the next admissions (see `SPARE_LISTS`).
    pub spare_page_lists: Vec<Vec<PageId>>,
    /// Working space for one operation (old watermarks a refused write puts back).
    pub scratch: Vec<u32>,
}

impl TableState {
    /// Builds the tags for a validated config, failing cleanly if memory runs out.
    pub fn new(config: &PoolConfig) -> Result<TableState, Error> {
        let n = config.num_pages as usize;
        let oom = || Error::OutOfMemory { pages: config.num_pages };
        let mut tags = Vec::new();
        tags.try_reserve_exact(n).map_err(|_| oom())?;
        let slots = n * config.page_size as usize;
        let mut words: Vec<u64> = Vec::new();
        words.try_reserve_exact(slots.div_ceil(64)).map_err(|_| oom())?;
        words.resize(slots.div_ceil(64), 0);
        let mut coverage = BitVec::from_vec(words);
        coverage.truncate(slots);
        let mut free = Vec::new();
        free.try_reserve_exact(n).map_err(|_| oom())?;
        let mut changed = Vec::new();
        changed.try_reserve_exact(n).map_err(|_| oom())?;

        let mut state_counts = [0u64; PageState::COUNT];
        for p in 0..config.num_pages {
            let reserved = config.reserved.binary_search(&PageId(p)).is_ok();
            let state = if reserved { PageState::Reserved } else { PageState::Free };
            state_counts[state as usize] += 1;
            tags.push(PageTag {
                owner: RequestId(0),
                generation: Generation::FIRST.0,
                written: 0,
                link: 0,
                state,
                changed: false,
                sparse: false,
                pinned: false,
            });
        }
        // Lowest ids on top of the stack, so a fresh pool hands out pages in id order.
        for p in (0..config.num_pages).rev() {
            if tags[p as usize].state == PageState::Free {
                tags[p as usize].link = free.len() as u32;
                free.push(PageId(p));
            }
        }
        Ok(TableState {
            page_size: config.page_size,
            max_context_tokens: config.max_context_tokens,
            generation_limit: config.generation_limit,
            scrub_on_release: config.scrub_on_release,
            tags,
            coverage,
            free,
            requests: IdMap::default(),
            ended: RecentlyEnded::default(),
            prefixes: Vec::new(),
            prefix_free_slots: Vec::new(),
            prefix_keys: IdMap::default(),
            sharing_tenants: HashSet::new(),
            state_counts,
            changed,
            pins: IdMap::default(),
            next_ticket: 0,
            tracking_changes: false,
            spare_page_lists: Vec::new(),
            scratch: Vec::new(),
        })
    }

    pub fn tag(&self, page: PageId) -> Option<&PageTag> {
        self.tags.get(page.0 as usize)
    }

    pub fn page_ref(&self, page: PageId) -> PageRef {
        PageRef { page, generation: Generation(self.tags[page.0 as usize].generation) }
    }

    #[inline]
    pub(super) fn mark_changed(&mut self, page: PageId) {
        let tag = &mut self.tags[page.0 as usize];
        if self.tracking_changes && !tag.changed {
            tag.changed = true;
            self.changed.push(page);
        }
    }

    #[inline]
    pub fn set_state(&mut self, page: PageId, state: PageState) {
        let tag = &mut self.tags[page.0 as usize];
        self.state_counts[tag.state as usize] -= 1;
        self.state_counts[state as usize] += 1;
        tag.state = state;
        self.mark_changed(page);
    }

    /// Takes a page off the free list (it must be free) and gives it to `req`'s page list.
    pub fn take_free_page(&mut self, page: PageId, req: RequestId) {
        let idx = self.tags[page.0 as usize].link as usize;
        debug_assert_eq!(self.free[idx], page);
        self.free.swap_remove(idx);
        if let Some(&moved) = self.free.get(idx) {
            self.tags[moved.0 as usize].link = idx as u32;
        }
        self.give_page(page, req);
    }

    /// Makes `page` owned by `req`, appended to its page list.
    fn give_page(&mut self, page: PageId, req: RequestId) {
        let rec = self.requests.get_mut(&req).expect("callers check the request is admitted");
        let tag = &mut self.tags[page.0 as usize];
        debug_assert!(tag.written == 0 && !tag.sparse, "free pages carry no coverage");
        tag.owner = req;
        tag.link = rec.pages.len() as u32;
        rec.pages.push(page);
        self.set_state(page, PageState::Owned);
    }

    /// Removes an owned page from its owner's page list (the caller changes its state next).
    pub fn detach_from_owner(&mut self, page: PageId) {
        let tag = self.tags[page.0 as usize];
        let rec = self.requests.get_mut(&tag.owner).expect("an owned page's owner is admitted");
        let idx = tag.link as usize;
        rec.pages.swap_remove(idx);
        if let Some(&moved) = rec.pages.get(idx) {
            self.tags[moved.0 as usize].link = idx as u32;
        }
    }

    /// Ends the incarnations of `pages`, all in state `from` (owned or shared): coverage cleared, generation
    /// bumped (or the page retired), and each page returned to the free list — unless a transfer
    /// pins it — or held for a scrub. `released` counts them and lists those to scrub.
    ///
    /// Written for the release path's speed. One tight loop ends every ordinary incarnation and
    /// leaves the rare pages (retiring, pinned, or with gaps in their coverage) as they were; if
    /// there were none, the free list grows by one copy of `pages`, otherwise a second, general
    /// pass finishes the rare pages and rebuilds the free-list links. Pushing one page at a time,
    /// or bumping the shared counters per page, kept a length in memory: a store-to-load chain per
    /// page that cost more than all the rest.
    pub fn end_incarnations(&mut self, pages: &[PageId], from: PageState, released: &mut Released) {
        let n = pages.len();
        let (limit, scrub) = (self.generation_limit, self.scrub_on_release);
        let next_state = if scrub { PageState::AwaitingScrub } else { PageState::Free };
        // Disjoint borrows, so the loop keeps its counts in registers.
        let TableState { tags, free, changed, tracking_changes, .. } = self;
        let free_base = free.len();
        let changed_base = changed.len();
        // A page is listed as changed at most once, so the list never outgrows the pool; and
        // while nobody tracks changes no page is listed at all.
        let tracking = *tracking_changes;
        let room = if tracking { n.min(tags.len() - changed_base) } else { 0 };
        changed.resize(changed_base + room, PageId(0));
        let changed_slots = &mut changed[changed_base..];
        let tags = tags.as_mut_slice(); // its pointer and length stay in registers
        let (mut changed_count, mut rare) = (0usize, 0usize);
        for (i, &page) in pages.iter().enumerate() {
            // Read before anything is written: a byte loaded just after a neighbouring byte of
            // the same tag was stored waits for that store to retire.
            let tag = &mut tags[page.0 as usize];
            let old = *tag;
            debug_assert!(old.state == from, "ending a {:?} page as {from:?}", old.state);
            if tracking && !old.changed {
                tag.changed = true;
                changed_slots[changed_count] = page;
                changed_count += 1;
            }
            if old.sparse | old.pinned | (old.generation >= limit) {
                rare += 1; // left in its old state for the general pass
                continue;
            }
            tag.written = 0;
            tag.generation = old.generation + 1;
            tag.state = next_state;
            tag.link = (free_base + i) as u32;
        }
        changed.truncate(changed_base + changed_count);
        debug_assert!(matches!(from, PageState::Owned | PageState::Shared));
        self.state_counts[from as usize] -= n as u64;
        released.ended += n as u64;
        if rare == 0 && !scrub {
            self.free.extend_from_slice(pages);
            self.state_counts[PageState::Free as usize] += n as u64;
        } else {
            self.end_incarnations_rare(pages, released);
        }
    }

    /// The general pass of [`end_incarnations`](Self::end_incarnations): ends the incarnations
    /// the fast loop left alone, lists pages to scrub, and puts the free ones on the free list.
    #[cold]
    fn end_incarnations_rare(&mut self, pages: &[PageId], released: &mut Released) {
        let (limit, ps) = (self.generation_limit, self.page_size as usize);
        for &page in pages {
            let tag = &mut self.tags[page.0 as usize];
            if matches!(tag.state, PageState::Owned | PageState::Shared) {
                tag.written = 0;
                if std::mem::replace(&mut tag.sparse, false) {
                    let base = page.0 as usize * ps;
                    self.coverage[base..base + ps].fill(false);
                }
                let tag = &mut self.tags[page.0 as usize];
                if tag.generation >= limit {
                    tag.state = PageState::Retired;
                } else {
                    tag.generation += 1;
                    tag.state = if self.scrub_on_release { PageState::AwaitingScrub } else { PageState::Free };
                }
            }
            let tag = &mut self.tags[page.0 as usize];
            let state = tag.state;
            match state {
                PageState::AwaitingScrub => {
                    released.scrub.push(PageRef { page, generation: Generation(tag.generation - 1) });
                }
                // A pinned page waits outside the free list until its transfer is over.
                PageState::Free if !tag.pinned => {
                    tag.link = self.free.len() as u32;
                    self.free.push(page);
                }
                _ => {}
            }
            self.state_counts[state as usize] += 1;
        }
    }

    /// Marks `page` free; it joins the free list unless a transfer still pins it.
    #[inline]
    pub fn push_free(&mut self, page: PageId) {
        if !self.tags[page.0 as usize].pinned {
            self.tags[page.0 as usize].link = self.free.len() as u32;
            self.free.push(page);
        }
        self.set_state(page, PageState::Free);
    }

    fn slot_range(&self, page: PageId, a: u32, b: u32) -> std::ops::Range<usize> {
        let base = page.0 as usize * self.page_size as usize;
        base + a as usize..base + b as usize
    }

    /// Records slots `a..b` of `page` as written and advances the watermark.
    #[inline]
    pub fn mark_written(&mut self, page: PageId, a: u32, b: u32) {
        let tag = &mut self.tags[page.0 as usize];
        if b <= tag.written.max(a) {
            return; // empty, or already written by this incarnation
        }
        if a <= tag.written && !tag.sparse {
            // The common case: appending to the written prefix.
            tag.written = b;
            if self.tracking_changes && !std::mem::replace(&mut tag.changed, true) {
                self.changed.push(page);
            }
            return;
        }
        self.mark_written_sparse(page, a, b);
    }

    /// [`mark_written`](Self::mark_written) when the write leaves a gap or may close one.
    #[cold]
    fn mark_written_sparse(&mut self, page: PageId, a: u32, b: u32) {
        let tag = self.tags[page.0 as usize];
        let written = if a <= tag.written {
            let rest = &self.coverage[self.slot_range(page, b, self.page_size)];
            b + rest.first_zero().unwrap_or(rest.len()) as u32
        } else {
            let range = self.slot_range(page, a, b);
            self.coverage[range].fill(true);
            self.tags[page.0 as usize].sparse = true;
            tag.written
        };
        self.tags[page.0 as usize].written = written;
        self.mark_changed(page);
    }

    /// The first run of unwritten slots in `0..need` of `page`, given `written < need`.
    pub fn unwritten_run(&self, page: PageId, need: u32) -> (u32, u32) {
        let tag = &self.tags[page.0 as usize];
        let start = tag.written;
        if !tag.sparse {
            return (start, need);
        }
        let gap = &self.coverage[self.slot_range(page, start, need)];
        (start, start + gap.first_one().unwrap_or(gap.len()) as u32)
    }

    /// Slots of `page` its current incarnation wrote.
    pub fn written_slots(&self, page: PageId) -> u32 {
        let tag = &self.tags[page.0 as usize];
        if !tag.sparse {
            return tag.written;
        }
        tag.written + self.coverage[self.slot_range(page, tag.written, self.page_size)].count_ones() as u32
    }

    /// The tenant whose data a live page holds: its owner's, or its prefix's.
    pub fn page_tenant(&self, tag: &PageTag) -> Option<TenantId> {
        match tag.state {
            PageState::Owned => self.requests.get(&tag.owner).map(|r| r.tenant),
            PageState::Shared => Some(self.prefix(tag.link).tenant),
            _ => None,
        }
    }

    pub fn prefix(&self, slot: u32) -> &PrefixRecord {
        self.prefixes[slot as usize].as_ref().expect("live prefix slots are Some")
    }

    pub fn prefix_mut(&mut self, slot: u32) -> &mut PrefixRecord {
        self.prefixes[slot as usize].as_mut().expect("live prefix slots are Some")
    }

    pub fn take_changed(&mut self) -> Vec<PageId> {
        if !self.tracking_changes {
            // The first call: every page counts as changed, and tracking starts now.
            self.tracking_changes = true;
            for tag in &mut self.tags {
                tag.changed = false;
            }
            return (0..self.tags.len() as u32).map(PageId).collect();
        }
        // Drained, not taken: the list keeps its pool-sized capacity.
        let changed: Vec<PageId> = self.changed.drain(..).collect();
        for p in &changed {
            self.tags[p.0 as usize].changed = false;
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_tag_is_24_bytes() {
        // The memory figure in the table's docs and the README depends on it.
        assert_eq!(std::mem::size_of::<PageTag>(), 24);
    }
}
