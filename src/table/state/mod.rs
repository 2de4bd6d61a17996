//! The table's data: one tag per page, a coverage bitmap, the free list, requests and prefixes.
//!
//! Everything here runs under the table's lock; nothing here knows about policy or threads.
//!
//! # Files
//! [`TableState`] (here) ties them together; each file uses only those below it: `coverage`,
//! `ending`, `device_tags` (the table's methods by idea) → `requests`, `free` → `tag` → `prefixes`
//! → `id_map`. `entry` stands alone: the block-table entry every check takes.

mod coverage;
mod device_tags;
mod ending;
mod entry;
mod free;
mod id_map;
mod prefixes;
mod requests;
mod tag;

pub(crate) use entry::BlockEntry;
pub(crate) use prefixes::{PrefixRecord, PrefixSlot};
pub(crate) use requests::{RequestEpochs, RequestRecord};
pub(crate) use tag::PageTag;

use super::hot::HotWord;
use super::info::PageState;
use super::mirror::ChangedPages;
use crate::config::{PageDiv, PoolConfig};
use crate::error::Error;
use crate::ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
use bitvec::prelude::{BitVec, Lsb0};
use free::FreeList;
use id_map::IdMap;
use requests::{RecentlyEnded, Requests};
use slotmap::SlotMap;
use std::collections::HashSet;
use std::sync::atomic::Ordering;

/// How many emptied page lists the table keeps for reuse, and the largest it keeps: a request's
/// list is allocated once and handed from request to request, not freed and allocated again.
pub(crate) const SPARE_LISTS: usize = 32;
pub(crate) const SPARE_LIST_MAX_CAPACITY: usize = 8192;

pub(crate) struct TableState {
    pub page_size: u32,
    /// Division by `page_size` (a shift for a power of two), for the per-slot and per-read paths.
    pub page_div: PageDiv,
    pub max_context_tokens: u64,
    pub generation_limit: u32,
    pub scrub_on_release: bool,
    pub tags: Vec<PageTag>,
    /// One [`HotWord`] per page, kept in step with `tags`.
    /// One word per page, then [`HotWord::PAST_THE_POOL`] (what a read of a page id past the
    /// pool compares).
    pub hot: Vec<HotWord>,
    pub coverage: BitVec<u64, Lsb0>,
    pub free: FreeList,
    pub requests: Requests,
    pub ended: RecentlyEnded,
    pub prefixes: SlotMap<PrefixSlot, PrefixRecord>,
    pub prefix_keys: IdMap<PrefixKey, PrefixSlot>,
    pub sharing_tenants: HashSet<TenantId>,
    pub state_counts: [u64; PageState::COUNT],
    /// The pages whose device tags changed since a device mirror last took them; marked only
    /// while `tracking_changes`.
    pub changed: ChangedPages,
    /// Pinned page → the transfer ticket that pinned it (see `pin`).
    pub pins: IdMap<PageId, u64>,
    pub next_ticket: u64,
    /// Set by the first `take_changed`; until then no page is marked changed (nobody mirrors
    /// the table, so nobody pays for it) and the first take hands back the whole pool.
    pub tracking_changes: bool,
    /// How many times the changed pages were taken ([`RequestRecord::pages_marked`]).
    pub takes: u64,
    /// Page lists of released requests, emptied, for the next admissions (see `SPARE_LISTS`).
    pub spare_page_lists: Vec<Vec<PageId>>,
    /// Request slots ([`RequestRecord::slot`]) given back by released requests, for reuse.
    pub spare_request_slots: Vec<u32>,
    /// The next request slot never handed out.
    pub next_request_slot: u32,
    /// Ticks of read rights taken ([`TableState::tick`]): the source of every request's epoch
    /// ([`RequestEpochs`]) and of `shared_epoch`.
    pub clock: u64,
    /// Each request slot's epoch and quarantine flag.
    pub epochs: RequestEpochs,
    /// When a page of a prefix that requests still held last lost a right (its coverage, its
    /// place in the prefix): every reader of shared pages is affected alike.
    pub shared_epoch: u64,
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
        let mut free = FreeList::with_room(n).ok_or_else(oom)?;
        let changed = ChangedPages::new(n).ok_or_else(oom)?;
        let mut hot = Vec::new();
        hot.try_reserve_exact(n + 1).map_err(|_| oom())?;

        let mut state_counts = [0u64; PageState::COUNT];
        for p in 0..config.num_pages {
            let reserved = config.reserved.binary_search(&PageId(p)).is_ok();
            let state = if reserved { PageState::Reserved } else { PageState::Free };
            state_counts[state as usize] += 1;
            hot.push(HotWord::unheld(state));
            tags.push(PageTag::new(state, Generation::FIRST.0));
        }
        hot.push(HotWord::PAST_THE_POOL);
        // Lowest ids on top of the stack, so a fresh pool hands out pages in id order.
        free.list_free(&mut tags);
        Ok(TableState {
            page_size: config.page_size,
            page_div: PageDiv::new(config.page_size),
            max_context_tokens: config.max_context_tokens,
            generation_limit: config.generation_limit,
            scrub_on_release: config.scrub_on_release,
            tags,
            hot,
            coverage,
            free,
            requests: Requests::default(),
            ended: RecentlyEnded::default(),
            prefixes: SlotMap::with_key(),
            prefix_keys: IdMap::default(),
            sharing_tenants: HashSet::new(),
            state_counts,
            changed,
            pins: IdMap::default(),
            next_ticket: 0,
            tracking_changes: false,
            takes: 0,
            spare_page_lists: Vec::new(),
            spare_request_slots: Vec::new(),
            next_request_slot: 0,
            clock: 0,
            epochs: RequestEpochs::default(),
            shared_epoch: 0,
        })
    }

    /// A request slot for a request being admitted (see [`RequestRecord::slot`]), its epoch a
    /// new tick and its quarantine lifted ([`RequestEpochs`]).
    pub fn take_request_slot(&mut self, req: RequestId) -> u32 {
        let slot = self.spare_request_slots.pop().unwrap_or_else(|| {
            let slot = self.next_request_slot;
            // Live requests are far fewer than 2^32: each holds a record in memory.
            self.next_request_slot += 1;
            slot
        });
        let epoch = self.tick();
        self.epochs.admit(slot, epoch, req);
        slot
    }

    /// The epoch word of `page`'s owner, given that `page` is owned: through the tag's owner slot
    /// hint where the slot is its owner's ([`RequestEpochs::word_of`]), else through the page's
    /// [`HotWord`]. Either way the word of the slot the owner holds (a slot it held before and
    /// nobody took since is vacant: its word lets nothing through).
    #[inline(always)]
    pub fn owner_word(&self, page: PageId, tag: &PageTag) -> u64 {
        match tag.owner_slot_hint().and_then(|slot| self.epochs.word_of(slot, tag.owner())) {
            Some(word) => word,
            None => self.epochs.word(self.hot[page.0 as usize].holder()),
        }
    }

    /// Quarantines `rec`'s request: its record's flag and its slot's word.
    pub fn quarantine(&self, rec: &RequestRecord) {
        rec.quarantined.store(true, Ordering::Relaxed);
        self.epochs.quarantine(rec.slot);
    }

    /// The next tick of [`clock`](Self::clock): later than every epoch handed out.
    #[inline]
    pub fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// `req` loses a right to read (a page, a page's coverage, a prefix): its epoch moves on,
    /// so no row checked clean before is taken as clean without a full check.
    #[inline]
    pub fn taking_from(&mut self, req: RequestId) {
        let now = self.tick();
        if let Some(rec) = self.requests.get(&req) {
            self.epochs.set_epoch(rec.slot, now);
        }
    }

    /// `page`'s holder is about to lose a right to it (the page's incarnation ends, or it loses
    /// coverage): the owner's epoch moves on, or for a page of a prefix that requests still hold,
    /// the shared epoch (a prefix nobody holds is read by no clean row). Every change that can
    /// turn a clean read unclean goes through here or through
    /// [`taking_from`](Self::taking_from): the rows' incremental check depends on it
    /// (`table::rows`' tests take each way). A page that becomes shared takes nothing: its
    /// owner holds the prefix it joins (publish, fork). Nor does leaving the owner's page list
    /// ([`detach_from_owner`](Self::detach_from_owner)): the page is then shared, or its
    /// incarnation ends (which ticks).
    #[inline]
    pub fn taking(&mut self, page: PageId) {
        let Some(&tag) = self.tags.get(page.0 as usize) else { return };
        match tag.state() {
            PageState::Owned => self.taking_from(tag.owner()),
            PageState::Shared if self.prefixes.get(tag.prefix()).is_some_and(|p| p.holders > 0) => {
                self.shared_epoch = self.tick();
            }
            _ => {}
        }
    }

    /// Gives back the slot of a released request; none of its pages is owned any more.
    pub fn give_back_request_slot(&mut self, slot: u32) {
        self.epochs.vacate(slot);
        self.spare_request_slots.push(slot);
    }

    /// `page`'s [`HotWord`] derived from its tag alone; `hot[page]` must always equal it.
    #[cfg(test)]
    pub fn hot_word_of(&self, page: PageId) -> HotWord {
        let tag = &self.tags[page.0 as usize];
        // A whole-page write sets FULL alone, so FULL is not derived from the watermark; but a
        // watermark at the page's end must have it set.
        let full = self.hot[page.0 as usize].is_full() || tag.watermark() >= self.page_size;
        match tag.state() {
            PageState::Owned => {
                let slot = self.requests.get(&tag.owner()).expect("an owned page's owner is admitted").slot;
                HotWord::new(slot, PageState::Owned, full)
            }
            PageState::Shared => HotWord::new(tag.prefix().index(), PageState::Shared, full),
            state => HotWord::new(0, state, full),
        }
    }

    /// Makes an owned page part of `prefix`, shared.
    pub fn share_page(&mut self, page: PageId, prefix: PrefixSlot) {
        self.tags[page.0 as usize].set_prefix(prefix);
        let full = self.hot[page.0 as usize].is_full();
        self.hot[page.0 as usize] = HotWord::new(prefix.index(), PageState::Shared, full);
        self.set_state(page, PageState::Shared);
    }

    pub fn tag(&self, page: PageId) -> Option<&PageTag> {
        self.tags.get(page.0 as usize)
    }

    pub fn page_ref(&self, page: PageId) -> PageRef {
        PageRef { page, generation: Generation(self.tags[page.0 as usize].generation()) }
    }

    /// Marks `page` changed for a device mirror, if one tracks the table.
    #[inline]
    pub(super) fn mark_changed(&mut self, page: PageId) {
        if self.tracking_changes {
            self.changed.mark(page);
        }
    }

    #[inline]
    pub fn set_state(&mut self, page: PageId, state: PageState) {
        let tag = &mut self.tags[page.0 as usize];
        self.state_counts[tag.state() as usize] -= 1;
        self.state_counts[state as usize] += 1;
        tag.set_state(state);
        let hot = &mut self.hot[page.0 as usize];
        *hot = hot.with_state(state);
        self.mark_changed(page);
    }

    /// Takes a page off the free list (it must be free and not pinned: listed) and gives it to
    /// `req`, a pending claim until its page list is next read ([`Requests`]): false, and nothing
    /// changed, if `req` is not admitted. One lookup of the request's slot; its free-list entry
    /// goes stale ([`FreeList::take`]).
    #[must_use]
    pub fn take_free_page(&mut self, page: PageId, req: RequestId) -> bool {
        let Some(slot) = self.requests.slot_of(&req) else { return false };
        // A pending claim: neither the record nor its page list is touched (see `Requests`).
        let link = self.requests.pend(slot, page);
        self.free.take();
        let tag = &mut self.tags[page.0 as usize];
        debug_assert!(tag.watermark() == 0 && !tag.sparse(), "free pages carry no coverage");
        tag.set_owner(req);
        tag.set_place(PageTag::place_with_slot(tag.place(), slot));
        tag.set_link(link);
        self.hot[page.0 as usize] = HotWord::new(slot, PageState::Owned, false);
        self.set_state(page, PageState::Owned);
        true
    }

    /// Removes an owned page from its owner's page list (the caller changes its state next).
    pub fn detach_from_owner(&mut self, page: PageId) {
        let owner = self.tags[page.0 as usize].owner();
        let rec = self.requests.settled(&owner, &mut self.tags).expect("an owned page's owner is admitted");
        let idx = self.tags[page.0 as usize].link() as usize;
        rec.pages.swap_remove(idx);
        if let Some(&moved) = rec.pages.get(idx) {
            self.tags[moved.0 as usize].set_link(idx as u32);
        }
    }

    /// Marks `page` free; it joins the free list unless a transfer still pins it.
    #[inline]
    pub fn push_free(&mut self, page: PageId) {
        self.taking(page);
        if !self.tags[page.0 as usize].pinned() {
            self.free.make_room(1);
            self.free.push(&mut self.tags, page);
        }
        self.set_state(page, PageState::Free);
    }

    /// The tenant whose data a live page holds: its owner's, or its prefix's.
    pub fn page_tenant(&self, tag: &PageTag) -> Option<TenantId> {
        match tag.state() {
            PageState::Owned => self.requests.get(&tag.owner()).map(|r| r.tenant),
            PageState::Shared => self.prefixes.get(tag.prefix()).map(|p| p.tenant),
            _ => None,
        }
    }
}
