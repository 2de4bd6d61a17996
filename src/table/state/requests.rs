//! The requests: each live one's record, kept by a dense slot with its claims by id pending
//! beside it; each slot's epoch and quarantine word; and a memory of the requests recently ended.

use super::id_map::IdMap;
use super::prefixes::HeldPrefixes;
use super::tag::PageTag;
use crate::ids::{PageId, RequestId, TenantId};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A live request's record, one cache line of what the step's paths read (a claim: its page
/// list and slot; a read: its quarantine, prefixes and tenant) and the rest on a second:
/// [`Requests`] keeps them by slot.
#[repr(C, align(64))]
pub(crate) struct RequestRecord {
    /// Pages this request owns exclusively, but for those it claimed by id since the list was
    /// last settled ([`Requests::settled`]); `tags[p].link()` is a listed page's index here.
    pub pages: Vec<PageId>,
    /// Prefixes this request holds.
    pub prefixes: HeldPrefixes,
    /// Dense index, unique among live requests, reused after release: the holder an owned
    /// page's [`HotWord`] names, and where [`Requests`] keeps this record.
    ///
    /// [`HotWord`]: crate::table::hot::HotWord
    pub slot: u32,
    /// Set by an enforced violation ([`TableState::quarantine`]), with the quarantine bit of
    /// its slot's word; checked by every read. Atomic so readers can set it under the shared
    /// lock.
    ///
    /// [`TableState::quarantine`]: super::TableState::quarantine
    pub quarantined: AtomicBool,
    pub tenant: TenantId,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    /// Every page this request owns was marked changed (for a device mirror) since take number
    /// `pages_marked` ([`TableState::takes`]): while that is the last take, a batch loop over its
    /// pages (writing them whole, ending them) need not mark them again. Set at admission (no
    /// pages yet) and kept, as every page that joins a request is marked as it joins.
    ///
    /// [`TableState::takes`]: super::TableState::takes
    pub pages_marked: u64,
}

/// The live requests' records, kept by slot ([`RequestRecord::slot`]: dense, reused after a
/// release) with a hash index from request id to slot beside them. A lookup reads the index's
/// 16-byte entry and the record's first line, where a map holding the records inline read a
/// bucket of 96 bytes (two lines) scattered at random: SGLang at page size 1 claims a page for
/// every row each step, and each claim looks its request up.
///
/// A claim by id ([`TableState::take_free_page`]) touches neither the record nor its page list:
/// the page joins its request's [`Pending`] claims, chained through the pages' tags, and the
/// list takes them when something next reads it ([`settled`](Self::settled),
/// [`remove`](Self::remove), [`owned_pages`](Self::owned_pages)). At page size 1 each row claims
/// a page every step: appending to each request's list wrote one line a request a step (its
/// tail, somewhere on the heap), and reading its record one more.
///
/// [`TableState::take_free_page`]: super::TableState::take_free_page
#[derive(Default)]
pub(crate) struct Requests {
    slots: IdMap<RequestId, u32>,
    /// Slot `s`'s record, if a live request holds it.
    records: Vec<Option<RequestRecord>>,
    /// Slot `s`'s claims not yet on its record's page list, eight bytes a slot.
    pending: Vec<Pending>,
}

/// The pages a request claimed by id since its page list was last settled: `count` of them, the
/// last `last`, each pending page's tag linking to the one claimed before it (where a listed
/// page's tag holds its index in the list). Settled in claim order, so the list is as the
/// claims made one by one would have left it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pending {
    last: u32,
    count: u32,
}

impl Requests {
    /// Live requests.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn contains_key(&self, req: &RequestId) -> bool {
        self.slots.contains_key(req)
    }
    #[inline]
    pub fn get(&self, req: &RequestId) -> Option<&RequestRecord> {
        let &slot = self.slots.get(req)?;
        self.records.get(slot as usize)?.as_ref()
    }
    /// `req`'s record, its page list as last settled: for what does not read the list (its
    /// prefixes, its quarantine); what does takes [`settled`](Self::settled).
    #[inline]
    pub fn get_mut(&mut self, req: &RequestId) -> Option<&mut RequestRecord> {
        let &slot = self.slots.get(req)?;
        self.records.get_mut(slot as usize)?.as_mut()
    }
    /// `req`'s record with its pending claims on its page list (and their tags' links set to
    /// their indices there).
    pub fn settled(&mut self, req: &RequestId, tags: &mut [PageTag]) -> Option<&mut RequestRecord> {
        let &slot = self.slots.get(req)?;
        self.settle(slot, tags);
        self.records.get_mut(slot as usize)?.as_mut()
    }
    /// `req`'s slot, if it is live: where [`pend`](Self::pend) keeps its claims.
    #[inline(always)]
    pub fn slot_of(&self, req: &RequestId) -> Option<u32> {
        self.slots.get(req).copied()
    }
    /// Adds `page` to slot `slot`'s pending claims (a live request's: from
    /// [`slot_of`](Self::slot_of)); what its tag's link must hold: the claim before it.
    #[inline(always)]
    pub fn pend(&mut self, slot: u32, page: PageId) -> u32 {
        let pending = &mut self.pending[slot as usize];
        let before = pending.last;
        *pending = Pending { last: page.0, count: pending.count + 1 };
        before
    }
    /// Moves slot `slot`'s pending claims onto its record's page list, in the order they were
    /// made, each tag's link then its index there.
    fn settle(&mut self, slot: u32, tags: &mut [PageTag]) {
        let Some(pending) = self.pending.get_mut(slot as usize).filter(|p| p.count > 0) else { return };
        let Pending { last, count } = std::mem::take(pending);
        let rec = self.records[slot as usize].as_mut().expect("a slot with pending claims holds a live request");
        let start = rec.pages.len();
        rec.pages.resize(start + count as usize, PageId(0));
        let pending = &mut rec.pages[start..];
        let mut page = last;
        for i in (0..pending.len()).rev() {
            pending[i] = PageId(page);
            let tag = &mut tags[page as usize];
            page = tag.link();
            // A page list never outgrows the pool, whose size is a `u32`.
            tag.set_link((start + i) as u32);
        }
    }
    /// The pages `rec` (a live request's record) owns, in the order it came by them: its list,
    /// then its pending claims.
    pub fn owned_pages(&self, rec: &RequestRecord, tags: &[PageTag]) -> Vec<PageId> {
        let Pending { last, count } = self.pending[rec.slot as usize];
        let mut pages = Vec::with_capacity(rec.pages.len() + count as usize);
        pages.extend_from_slice(&rec.pages);
        let mut page = last;
        for _ in 0..count {
            pages.push(PageId(page));
            page = tags[page as usize].link();
        }
        pages[rec.pages.len()..].reverse();
        pages
    }
    /// Keeps `rec` for `req`, a request that is not live, at its slot, which no other live
    /// request holds (slots are handed out by [`TableState::take_request_slot`]).
    ///
    /// [`TableState::take_request_slot`]: super::TableState::take_request_slot
    pub fn insert(&mut self, req: RequestId, rec: RequestRecord) {
        let slot = rec.slot as usize;
        if slot >= self.records.len() {
            self.records.resize_with(slot + 1, || None);
        }
        // Never two requests on one slot (each would find the other's record): slots come from
        // take_request_slot, so this holds on every path; it is checked all the same.
        assert!(self.records[slot].is_none(), "request slot {slot} is another live request's");
        if slot >= self.pending.len() {
            self.pending.resize(slot + 1, Pending::default());
        }
        debug_assert_eq!(self.pending[slot], Pending::default(), "a vacant slot has no pending claims");
        self.records[slot] = Some(rec);
        // One lookup of the index: an admission's. Every caller admits only a request that is not
        // live (checked): a second record under one id would leave the first one's slot, pages
        // and pending claims reachable by nothing, so it is checked here as well.
        let old = self.slots.insert(req, slot as u32);
        assert!(old.is_none(), "request {req:?} is live already");
    }
    /// Takes `req`'s record out, settled (see [`settled`](Self::settled)).
    pub fn remove(&mut self, req: &RequestId, tags: &mut [PageTag]) -> Option<RequestRecord> {
        let slot = self.slots.remove(req)?;
        self.settle(slot, tags);
        self.records.get_mut(slot as usize)?.take()
    }
    pub fn values(&self) -> impl Iterator<Item = &RequestRecord> {
        self.records.iter().flatten()
    }
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut RequestRecord> {
        self.records.iter_mut().flatten()
    }
}

impl RequestRecord {
    /// Every page of this request is marked changed since the last take, whose number is
    /// `takes` ([`TableState::takes`]): a batch loop over its pages need not mark them again.
    ///
    /// [`TableState::takes`]: super::TableState::takes
    #[inline(always)]
    pub fn pages_all_marked(&self, takes: u64) -> bool {
        self.pages_marked == takes
    }
}

/// Per request slot ([`RequestRecord::slot`]), the request's epoch and quarantine flag in one
/// word, `epoch << 1 | quarantined`, dense so a row's incremental check reads it without looking
/// the request up by id ([`RowCache`](crate::table::RowCache)). The flag is a copy of the record's
/// ([`RequestRecord::quarantined`], what every other read checks: through this array it cost
/// the full read check 16 instructions a read); both are set together
/// ([`TableState::quarantine`]) and both start clear with a new record.
///
/// The epoch is when the request last lost a right to read something: a tick of
/// [`TableState::clock`], taken at admission and whenever one of its pages left it, lost
/// coverage or became shared, or it let go of a prefix (see [`TableState::taking`]). A row
/// checked clean at one word reads the same pages as clean while the slot's word is that word:
/// ticks are unique across requests, so the word names one request's record (a request
/// released, or admitted again, or another admitted into its slot, never finds an old word),
/// unchanged since, not quarantined. A slot nobody holds is [`VACANT`](Self::VACANT).
///
/// Beside the words, the request each slot was last given to (left when the slot is vacated: a
/// vacant slot's word says quarantined, so nothing is let through on it), so that a page's owner
/// slot hint ([`PageTag::owner_slot_hint`]) is checked before its word is taken. Two arrays, so
/// that the rows' checks, which read the words alone, read them eight to a line.
///
/// [`TableState::quarantine`]: super::TableState::quarantine
/// [`TableState::clock`]: super::TableState::clock
/// [`TableState::taking`]: super::TableState::taking
#[derive(Default)]
pub(crate) struct RequestEpochs {
    words: Vec<AtomicU64>,
    owners: Vec<RequestId>,
}

impl RequestEpochs {
    /// The word of a slot nobody holds: odd (quarantined), so no row checked clean matches it.
    pub const VACANT: u64 = u64::MAX;
    /// The bit of a slot's word that says its request is quarantined.
    pub const QUARANTINED: u64 = 1;

    /// `slot` is taken by request `owner`, admitted at tick `epoch`, not quarantined.
    pub fn admit(&mut self, slot: u32, epoch: u64, owner: RequestId) {
        let slot = slot as usize;
        if slot >= self.words.len() {
            // Slots are handed out densely: a new one is the next past the end.
            self.words.resize_with(slot + 1, || AtomicU64::new(Self::VACANT));
            self.owners.resize(slot + 1, RequestId(0));
        }
        *self.words[slot].get_mut() = epoch << 1;
        self.owners[slot] = owner;
    }
    /// `slot`'s request is released.
    pub fn vacate(&mut self, slot: u32) {
        if let Some(word) = self.words.get_mut(slot as usize) {
            *word.get_mut() = Self::VACANT;
        }
    }
    /// `slot`'s request lost a right to read at tick `epoch`; its quarantine stays.
    #[inline]
    pub fn set_epoch(&mut self, slot: u32, epoch: u64) {
        let word = self.words[slot as usize].get_mut();
        *word = epoch << 1 | (*word & Self::QUARANTINED);
    }
    /// Quarantines `slot`'s request (under the shared lock: atomic). Only through
    /// [`TableState::quarantine`], which sets the record's flag with it.
    ///
    /// [`TableState::quarantine`]: super::TableState::quarantine
    pub fn quarantine(&self, slot: u32) {
        self.words[slot as usize].fetch_or(Self::QUARANTINED, Ordering::Relaxed);
    }
    /// `slot`'s word: what a row checked clean keeps and compares ([`VACANT`](Self::VACANT)
    /// past the slots handed out).
    #[inline(always)]
    pub fn word(&self, slot: u32) -> u64 {
        self.words.get(slot as usize).map_or(Self::VACANT, |w| w.load(Ordering::Relaxed))
    }
    /// `slot`'s word if `slot` was last given to `req` (`None` otherwise, or past the slots
    /// handed out). A live request holds one slot, the last given to it; a slot it held before
    /// and that nobody took since is vacant, its word [`VACANT`](Self::VACANT).
    #[inline(always)]
    pub fn word_of(&self, slot: u32, req: RequestId) -> Option<u64> {
        (self.owners.get(slot as usize) == Some(&req)).then(|| self.word(slot))
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Random admit / force_admit / fork / release / preempt / allocate /
    /// force_claim histories; after each op every live id finds its own record, the slots are
    /// unique, the index and the records agree, and each owned page's owner lists it.
    #[test]
    fn every_live_request_finds_its_own_record_whatever_came_before() {
        use crate::config::PoolConfig;
        use crate::table::ownership::OwnershipTable;
        use std::collections::HashMap as Model;
        for seed in 1..=16u64 {
            let t = OwnershipTable::new(PoolConfig::new(64, 4, 256)).unwrap();
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut rnd = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let mut model: Model<u64, u64> = Model::new(); // id -> tenant
            for step in 0..2000 {
                let id = rnd(24);
                let tenant = 1 + rnd(3);
                match rnd(7) {
                    0 => {
                        let ok = t.admit(RequestId(id), TenantId(tenant), 4, 4).is_ok();
                        assert_eq!(ok, !model.contains_key(&id), "seed {seed} step {step} admit {id}");
                        if ok {
                            model.insert(id, tenant);
                        }
                    }
                    1 => {
                        let ok = t.force_admit(RequestId(id), TenantId(tenant), 4, 4);
                        assert_eq!(ok, !model.contains_key(&id));
                        if ok {
                            model.insert(id, tenant);
                        }
                    }
                    2 => {
                        let child = rnd(24);
                        if t.fork(RequestId(id), RequestId(child)).is_ok() {
                            assert!(model.contains_key(&id) && !model.contains_key(&child));
                            let pt = model[&id];
                            model.insert(child, pt);
                        }
                    }
                    3 | 4 => {
                        let ok = t.release(RequestId(id)).is_ok();
                        assert_eq!(ok, model.remove(&id).is_some());
                    }
                    5 => {
                        let _ = t.allocate(RequestId(id), 1 + rnd(2) as u32);
                    }
                    _ => {
                        if rnd(2) == 0 {
                            let _ = t.preempt(RequestId(id));
                        } else {
                            let _ = t.force_claim(RequestId(id), &[PageId(rnd(64) as u32)]);
                        }
                    }
                }
                let s = t.state.read();
                assert_eq!(s.requests.len(), model.len());
                assert_eq!(s.requests.values().count(), model.len(), "records and index agree");
                let mut seen = std::collections::HashSet::new();
                for (&id, &tenant) in &model {
                    let rec = s.requests.get(&RequestId(id)).expect("live id finds a record");
                    assert_eq!(rec.tenant, TenantId(tenant), "seed {seed} step {step}: {id}'s own record");
                    assert!(seen.insert(rec.slot), "slot {} twice", rec.slot);
                    assert_eq!(s.requests.slots[&RequestId(id)], rec.slot);
                    assert_eq!(s.epochs.owners[rec.slot as usize], RequestId(id));
                    // Listed pages link to their index; pending ones (claimed by id since)
                    // follow, each owned by the request.
                    for (i, &p) in rec.pages.iter().enumerate() {
                        let tag = &s.tags[p.0 as usize];
                        assert!(tag.owned_by(RequestId(id)) && tag.link() as usize == i);
                    }
                    for p in s.requests.owned_pages(rec, &s.tags) {
                        assert!(s.tags[p.0 as usize].owned_by(RequestId(id)));
                    }
                }
                for (p, tag) in s.tags.iter().enumerate() {
                    if tag.state() == crate::table::info::PageState::Owned {
                        let rec = s.requests.get(&tag.owner()).expect("owner live");
                        let owned = s.requests.owned_pages(rec, &s.tags);
                        assert_eq!(owned.iter().filter(|&&q| q == PageId(p as u32)).count(), 1, "page {p} once");
                    }
                }
            }
        }
    }

    #[test]
    fn a_request_is_found_by_id_whatever_slot_it_was_given_and_a_released_slot_finds_nothing() {
        let record = |slot: u32, tenant: u64| RequestRecord {
            pages: vec![],
            prefixes: HeldPrefixes::default(),
            slot,
            quarantined: AtomicBool::new(false),
            tenant: TenantId(tenant),
            prompt_tokens: 0,
            max_new_tokens: 0,
            pages_marked: 0,
        };
        let mut r = Requests::default();
        r.insert(RequestId(10), record(0, 1));
        r.insert(RequestId(20), record(1, 2));
        assert_eq!(r.remove(&RequestId(10), &mut []).map(|x| x.tenant), Some(TenantId(1)));
        assert!(r.get(&RequestId(10)).is_none() && r.remove(&RequestId(10), &mut []).is_none());
        // Slot 0 reused by another request: the old id still finds nothing, the new one its own.
        r.insert(RequestId(30), record(0, 3));
        assert!(r.get(&RequestId(10)).is_none());
        assert_eq!(r.get(&RequestId(30)).map(|x| (x.slot, x.tenant)), Some((0, TenantId(3))));
        assert_eq!(r.get_mut(&RequestId(20)).map(|x| x.tenant), Some(TenantId(2)));
        assert_eq!(r.len(), 2);
        let mut tenants: Vec<u64> = r.values().map(|x| x.tenant.0).collect();
        tenants.sort();
        assert_eq!(tenants, [2, 3]);
        assert!(r.contains_key(&RequestId(30)) && !r.contains_key(&RequestId(10)));
        // The hot fields share the record's first line.
        assert_eq!(std::mem::align_of::<RequestRecord>(), 64);
        assert!(std::mem::offset_of!(RequestRecord, tenant) + 8 <= 64);
    }

    #[test]
    #[should_panic(expected = "is live already")]
    fn a_second_record_under_a_live_id_is_a_bug_caught_where_it_is_made() {
        // Every admission checks the id first; a record under a live id would leave the first
        // one's slot and pending claims reachable by nothing (a slot handed on with them).
        let record = |slot: u32| RequestRecord {
            pages: vec![],
            prefixes: HeldPrefixes::default(),
            slot,
            quarantined: AtomicBool::new(false),
            tenant: TenantId(1),
            prompt_tokens: 0,
            max_new_tokens: 0,
            pages_marked: 0,
        };
        let mut r = Requests::default();
        r.insert(RequestId(20), record(0));
        r.insert(RequestId(20), record(1));
    }
}
