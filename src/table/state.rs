//! The table's data: one tag per page, a coverage bitmap, the free list, requests and prefixes.
//!
//! Everything here runs under the table's lock; nothing here knows about policy or threads.

use super::hot::HotWord;
use super::info::{PageState, Released};
use super::mirror::{ChangedPages, DeviceTag};
use crate::config::{PageDiv, PoolConfig};
use crate::error::Error;
use crate::ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
use bitvec::prelude::{BitVec, Lsb0};
use slotmap::{Key, KeyData, SlotMap};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One block-table entry as the table sees it: a page, and maybe the incarnation it must be in.
pub(crate) trait BlockEntry: Copy {
    fn page(self) -> PageId;
    fn generation(self) -> Option<Generation>;
    /// The entry naming `page` in its incarnation `generation` (a page id drops it).
    fn entry(page: PageId, generation: Generation) -> Self;
}

impl BlockEntry for PageId {
    #[inline(always)]
    fn page(self) -> PageId {
        self
    }
    #[inline(always)]
    fn generation(self) -> Option<Generation> {
        None
    }
    #[inline(always)]
    fn entry(page: PageId, _: Generation) -> Self {
        page
    }
}

impl BlockEntry for PageRef {
    #[inline(always)]
    fn page(self) -> PageId {
        self.page
    }
    #[inline(always)]
    fn generation(self) -> Option<Generation> {
        Some(self.generation)
    }
    #[inline(always)]
    fn entry(page: PageId, generation: Generation) -> Self {
        PageRef { page, generation }
    }
}

slotmap::new_key_type! {
    /// A prefix's handle in the prefix store: a slot and its version. A handle kept past its
    /// prefix's end no longer matches once the slot holds another prefix, so it is caught rather
    /// than trusted. (A slot's version wraps after 2^31 reuses; a handle would have to outlive
    /// that many prefixes in one slot to match again.)
    pub(crate) struct PrefixSlot;
}

impl PrefixSlot {
    /// The handle as the 64 bits a page tag keeps.
    #[inline(always)]
    fn to_bits(self) -> u64 {
        self.data().as_ffi()
    }
    /// The handle's slot index, unique among live prefixes: a shared page's holder in its
    /// [`HotWord`].
    #[inline(always)]
    pub fn index(self) -> u32 {
        self.to_bits() as u32 // `KeyData::as_ffi` keeps the index in the low 32 bits
    }
    /// The handle from the 64 bits [`to_bits`](Self::to_bits) gave.
    #[inline(always)]
    fn from_bits(bits: u64) -> PrefixSlot {
        KeyData::from_ffi(bits).into()
    }
}

/// One page's tag: 24 bytes, plus `page_size` bits of coverage elsewhere.
///
/// Coverage is the page's [`HotWord`] FULL bit, a watermark and a bitmap: slot `s` is written iff
/// the page is whole ([`HotWord::is_full`]), or `s < watermark`, or its bit is set. Writes in order
/// (prefill chunks, decode appends) only move the watermark (and set FULL when it reaches the
/// page's end); a write of whole pages only sets their FULL bits (the watermark is left behind,
/// and later appends may move it: a whole page's written prefix is its size whatever the
/// watermark says); the bitmap is touched only by writes that leave a gap (`sparse`), and
/// cleared on release only if it was.
/// Read the written prefix through [`TableState::written_prefix`], never the field.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageTag {
    /// Owned: the owner's id. Shared: its prefix's handle ([`PrefixSlot`]; the publisher is in
    /// the prefix). Free: the last owner's id (for diagnosis only). Read it through
    /// [`owner`](Self::owner) and [`prefix`](Self::prefix). The tenant is not stored: it is the
    /// owner's (owned) or the prefix's (shared).
    pub holder: u64,
    /// The incarnation in one word, so ending it is one store: the generation in the low 32
    /// bits, the watermark above ([`generation`](Self::generation),
    /// [`watermark`](Self::watermark)).
    incarnation: u64,
    /// Where the page is, in one word, so a page changes hands in one store: the flags `SPARSE`
    /// and `PINNED` in the low bits, its state in bits 8 to 15, a hint of its owner's request
    /// slot in bits 16 to 31, its link in the high 32 bits ([`link`](Self::link),
    /// [`state`](Self::state), [`sparse`](Self::sparse), [`pinned`](Self::pinned),
    /// [`owner_slot_hint`](Self::owner_slot_hint)).
    place: u64,
}

impl PageTag {
    // The flags lowest, so a test or change of one is an instruction with a byte immediate.
    pub const SPARSE: u64 = 1;
    pub const PINNED: u64 = 1 << 1;
    const STATE_SHIFT: u32 = 8;
    const SLOT_SHIFT: u32 = 16;
    const SLOT_BITS: u64 = 0xffff << Self::SLOT_SHIFT;
    const LINK_SHIFT: u32 = 32;
    /// Added to a place, the same place at the next link.
    pub const NEXT_LINK: u64 = 1 << Self::LINK_SHIFT;

    /// A page in `state`, never written, linked at 0, in generation `generation`.
    pub fn new(state: PageState, generation: u32) -> PageTag {
        PageTag { holder: 0, incarnation: Self::incarnation_of(generation), place: Self::place_of(0, state) }
    }
    /// The [`incarnation`](Self::incarnation) word of generation `generation`, nothing written.
    #[inline(always)]
    pub fn incarnation_of(generation: u32) -> u64 {
        u64::from(generation)
    }
    /// The `place` word of a page at `link` in `state`, no flag set.
    #[inline(always)]
    pub fn place_of(link: u32, state: PageState) -> u64 {
        u64::from(link) << Self::LINK_SHIFT | (state as u64) << Self::STATE_SHIFT
    }
    /// The incarnation word: generation and watermark, as one value.
    #[inline(always)]
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
    /// The incarnation word with the watermark `watermark`.
    #[inline(always)]
    pub fn with_watermark(&self, watermark: u32) -> u64 {
        u64::from(self.generation()) | u64::from(watermark) << 32
    }
    /// The generation of an incarnation word.
    #[inline(always)]
    pub fn generation_of(incarnation: u64) -> u32 {
        incarnation as u32
    }
    /// The watermark of an incarnation word.
    #[inline(always)]
    pub fn watermark_of(incarnation: u64) -> u32 {
        (incarnation >> 32) as u32
    }
    /// Sets generation and watermark at once (see [`incarnation_of`](Self::incarnation_of)).
    #[inline(always)]
    pub fn set_incarnation(&mut self, incarnation: u64) {
        self.incarnation = incarnation;
    }
    /// The place word: link, state and flags, as one value.
    #[inline(always)]
    pub fn place(&self) -> u64 {
        self.place
    }
    /// Sets link, state and flags at once (see [`place_of`](Self::place_of) and the flag
    /// constants).
    #[inline(always)]
    pub fn set_place(&mut self, place: u64) {
        self.place = place;
    }
    /// The page's incarnation.
    #[inline(always)]
    pub fn generation(&self) -> u32 {
        Self::generation_of(self.incarnation)
    }
    #[inline(always)]
    pub fn set_generation(&mut self, generation: u32) {
        self.incarnation = (self.incarnation & !u64::from(u32::MAX)) | u64::from(generation);
    }
    /// Slots `0..watermark` are all written by the current incarnation (the coverage watermark),
    /// unless the page is whole: then every slot is, and this may lag behind (see
    /// [`TableState::written_prefix`]).
    #[inline(always)]
    pub fn watermark(&self) -> u32 {
        Self::watermark_of(self.incarnation)
    }
    #[inline(always)]
    pub fn set_watermark(&mut self, watermark: u32) {
        self.incarnation = self.with_watermark(watermark);
    }
    /// Owned: index in the owner's page list. Free: index in the free list. Shared: unused.
    #[inline(always)]
    pub fn link(&self) -> u32 {
        (self.place >> Self::LINK_SHIFT) as u32
    }
    #[inline(always)]
    pub fn set_link(&mut self, link: u32) {
        self.place = (self.place & u64::from(u32::MAX)) | u64::from(link) << Self::LINK_SHIFT;
    }
    #[inline(always)]
    pub fn state(&self) -> PageState {
        PageState::from_bits(self.state_bits())
    }
    /// The state's discriminant (`state() as u8`, without decoding it).
    #[inline(always)]
    pub fn state_bits(&self) -> u8 {
        (self.place >> Self::STATE_SHIFT) as u8
    }
    #[inline(always)]
    pub fn set_state(&mut self, state: PageState) {
        self.place = (self.place & !(0xff << Self::STATE_SHIFT)) | (state as u64) << Self::STATE_SHIFT;
    }
    /// The request slot its owner had when the page was given to it, if below `0xffff`: a hint,
    /// never an answer. A read of an owned page finds its owner's epoch word through it without
    /// the page's [`HotWord`], after [`RequestEpochs::word_of`] says the slot is its owner's
    /// ([`TableState::owner_word`]). Set where a page is given to a request
    /// ([`place_with_slot`](Self::place_with_slot)); any other change leaves it as it was, or
    /// clears it.
    #[inline(always)]
    pub fn owner_slot_hint(&self) -> Option<u32> {
        let hint = ((self.place & Self::SLOT_BITS) >> Self::SLOT_SHIFT) as u32;
        hint.checked_sub(1)
    }
    /// `place` with `slot` as its owner slot hint (none if `slot` does not fit in it).
    #[inline(always)]
    pub fn place_with_slot(place: u64, slot: u32) -> u64 {
        let hint = if slot < 0xffff { u64::from(slot + 1) << Self::SLOT_SHIFT } else { 0 };
        (place & !Self::SLOT_BITS) | hint
    }
    /// Some coverage bit of this incarnation may be set.
    #[inline(always)]
    pub fn sparse(&self) -> bool {
        self.place & Self::SPARSE != 0
    }
    #[inline(always)]
    pub fn set_sparse(&mut self, sparse: bool) {
        self.set_flag(Self::SPARSE, sparse);
    }
    /// A KV transfer into this page is in flight ([`TableState::pin`]): if the page is released
    /// meanwhile it stays out of the free list until the transfer is finished or aborted, so the
    /// bytes still landing can never reach a next owner.
    #[inline(always)]
    pub fn pinned(&self) -> bool {
        self.place & Self::PINNED != 0
    }
    #[inline(always)]
    pub fn set_pinned(&mut self, pinned: bool) {
        self.set_flag(Self::PINNED, pinned);
    }
    #[inline(always)]
    fn set_flag(&mut self, flag: u64, on: bool) {
        self.place = if on { self.place | flag } else { self.place & !flag };
    }
}

impl PageTag {
    /// The owner (owned), or the last owner (free).
    #[inline(always)]
    pub fn owner(&self) -> RequestId {
        RequestId(self.holder)
    }
    /// Owned by `req`.
    #[inline(always)]
    pub fn owned_by(&self, req: RequestId) -> bool {
        self.state() == PageState::Owned && self.holder == req.0
    }
    /// The prefix a shared page belongs to.
    #[inline(always)]
    pub fn prefix(&self) -> PrefixSlot {
        PrefixSlot::from_bits(self.holder)
    }
    /// Makes the page owned by `req` (the caller sets the state).
    #[inline(always)]
    pub fn set_owner(&mut self, req: RequestId) {
        self.holder = req.0;
    }
    /// Makes the page part of `prefix` (the caller sets the state).
    #[inline(always)]
    pub fn set_prefix(&mut self, prefix: PrefixSlot) {
        self.holder = prefix.to_bits();
    }
}

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
    pub slot: u32,
    /// Set by an enforced violation ([`TableState::quarantine`]), with the quarantine bit of
    /// its slot's word; checked by every read. Atomic so readers can set it under the shared
    /// lock.
    pub quarantined: AtomicBool,
    pub tenant: TenantId,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    /// Every page this request owns was marked changed (for a device mirror) since take number
    /// `pages_marked` ([`TableState::takes`]): while that is the last take, a batch loop over its
    /// pages (writing them whole, ending them) need not mark them again. Set at admission (no
    /// pages yet) and kept, as every page that joins a request is marked as it joins.
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
    #[inline(always)]
    pub fn pages_all_marked(&self, takes: u64) -> bool {
        self.pages_marked == takes
    }
}

/// Per request slot ([`RequestRecord::slot`]), the request's epoch and quarantine flag in one
/// word, `epoch << 1 | quarantined`, dense so a row's incremental check reads it without looking
/// the request up by id ([`RowCache`](super::RowCache)). The flag is a copy of the record's
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

/// The prefixes one request holds, in the order it took them: a short list scanned in place,
/// and past [`HeldPrefixes::INLINE`] a list with a hash index beside it, so the membership test,
/// adding a hold and dropping one stay O(1) however many prefixes (one per cached block, in
/// vLLM's style) a request holds, and in whatever order it takes them. (A sorted list cost a
/// shift per insert: 400,000 holds taken in descending order were quadratic.) Dropping a hold
/// moves the last one into its place.
///
/// The order is what a read's prefix run follows ([`in_order`](Self::in_order)): an engine that
/// takes one prefix per cached block takes them in the order its block table lists them.
///
/// The indexed form is boxed, so that a request's record stays small (the hash index alone is
/// 32 bytes): a claim looks its record up, and a record of 128 bytes spread over three cache
/// lines where one of 88 spreads over two.
#[derive(Clone, Debug)]
pub(crate) enum HeldPrefixes {
    Few(Vec<PrefixSlot>),
    Many(Box<ManyHeld>),
}

/// [`HeldPrefixes`] past [`HeldPrefixes::INLINE`].
#[derive(Clone, Debug)]
pub(crate) struct ManyHeld {
    order: Vec<PrefixSlot>,
    /// Each held slot's place in `order`.
    at: HashMap<PrefixSlot, u32, IdHash>,
}

impl Default for HeldPrefixes {
    fn default() -> Self {
        HeldPrefixes::Few(Vec::new())
    }
}

impl HeldPrefixes {
    /// Holds kept in a plain list before the list gets an index.
    pub const INLINE: usize = 8;

    #[inline]
    pub fn contains(&self, slot: PrefixSlot) -> bool {
        self.position(slot).is_some()
    }
    /// Where `slot` is in [`in_order`](Self::in_order), if held.
    #[inline]
    pub fn position(&self, slot: PrefixSlot) -> Option<usize> {
        match self {
            HeldPrefixes::Few(list) => list.iter().position(|&s| s == slot),
            HeldPrefixes::Many(m) => m.at.get(&slot).map(|&i| i as usize),
        }
    }
    /// The held slots, in the order they were taken (but where a dropped hold's place went to
    /// the last one).
    #[inline]
    pub fn in_order(&self) -> &[PrefixSlot] {
        match self {
            HeldPrefixes::Few(list) => list,
            HeldPrefixes::Many(m) => &m.order,
        }
    }
    /// Adds `slot`; false if it was already held.
    pub fn insert(&mut self, slot: PrefixSlot) -> bool {
        match self {
            HeldPrefixes::Few(list) if list.contains(&slot) => false,
            HeldPrefixes::Few(list) if list.len() < Self::INLINE => {
                list.push(slot);
                true
            }
            HeldPrefixes::Few(list) => {
                let mut order = std::mem::take(list);
                order.push(slot);
                let at = order.iter().enumerate().map(|(i, &s)| (s, i as u32)).collect();
                *self = HeldPrefixes::Many(Box::new(ManyHeld { order, at }));
                true
            }
            HeldPrefixes::Many(m) => {
                let ManyHeld { order, at } = &mut **m;
                if at.contains_key(&slot) {
                    return false;
                }
                // A request's holds fit in u32: each is a live prefix, and slot indices are u32.
                at.insert(slot, order.len() as u32);
                order.push(slot);
                true
            }
        }
    }
    /// Drops `slot`; false if it was not held.
    pub fn remove(&mut self, slot: PrefixSlot) -> bool {
        match self {
            HeldPrefixes::Few(list) => match list.iter().position(|&s| s == slot) {
                Some(i) => {
                    list.swap_remove(i);
                    true
                }
                None => false,
            },
            HeldPrefixes::Many(m) => match m.at.remove(&slot) {
                Some(i) => {
                    let ManyHeld { order, at } = &mut **m;
                    order.swap_remove(i as usize);
                    if let Some(&moved) = order.get(i as usize) {
                        at.insert(moved, i);
                    }
                    true
                }
                None => false,
            },
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = PrefixSlot> + '_ {
        self.in_order().iter().copied()
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

/// Hashes the table's integer ids (requests, pages, prefix keys): foldhash, seeded at random
/// per map. SipHash cost more per request than a page's whole verification. foldhash's quality
/// variant finishes with a second folded multiply, so every input bit reaches the low bits a map
/// picks buckets with whatever the process's seed: ids crafted to collide (a hostile trace's, say)
/// still spread. The fast variant skips it, and for about one process seed in sixty ids differing
/// only above bit 47 fell into a seventh of the buckets.
pub(crate) type IdHash = foldhash::quality::RandomState;

/// A map keyed by one of the table's ids.
/// The free pages allocator mode hands out: a stack, the most recently freed on top, each free
/// page's tag linking to its entry. A page claimed by id (shadow mode: the engine chose it, as
/// SGLang and vLLM do for every page) is not looked for here: its entry goes stale where it lies
/// ([`take`](Self::take)), which saves a claim two scattered lines (this list's, and the tag of
/// the entry a removal would move into its place). An entry at `i` is live while its page is
/// free, not pinned and linked to `i`; [`top`](Self::top) drops the stale ones it meets on its
/// way down. When stale entries would overflow the room (twice the pool's pages, reserved up
/// front) the entries are dropped, all at once ([`make_room`](Self::make_room)), and the next
/// [`top`](Self::top) lists the free pages again from the tags, in one pass in page order: an
/// engine that only claims by id never pays for that pass, one that allocates too pays it at
/// most once for every pool's worth of claims by id.
#[derive(Debug)]
pub(crate) struct FreeList {
    entries: Vec<PageId>,
    /// Free pages not pinned, whether listed or not.
    live: usize,
    /// The entries were dropped: some live pages are not listed.
    dropped: bool,
}

impl FreeList {
    /// An empty list with room for `2 * pages` entries; `None` if the memory is not there.
    fn with_room(pages: usize) -> Option<FreeList> {
        let mut entries = Vec::new();
        entries.try_reserve_exact(pages.checked_mul(2)?).ok()?;
        Some(FreeList { entries, live: 0, dropped: false })
    }

    /// Free pages not pinned: what allocate can hand out.
    pub fn len(&self) -> usize {
        self.live
    }

    fn is_live(tags: &[PageTag], at: usize, page: PageId) -> bool {
        let tag = &tags[page.0 as usize];
        tag.state() == PageState::Free && !tag.pinned() && tag.link() as usize == at
    }

    /// Room for `more` entries: the entries dropped if stale ones fill it.
    pub fn make_room(&mut self, more: usize) {
        if self.entries.len() + more > self.entries.capacity() {
            self.entries.clear();
            self.dropped = true;
        }
        debug_assert!(more <= self.entries.capacity(), "the room is twice the pool");
    }

    /// Lists every free page not pinned, the lowest ids on top (as a fresh pool hands them out).
    #[cold]
    #[inline(never)]
    fn list_free(&mut self, tags: &mut [PageTag]) {
        self.entries.clear();
        for (p, tag) in tags.iter_mut().enumerate().rev() {
            if tag.state() == PageState::Free && !tag.pinned() {
                // The pool's size is a `u32`.
                tag.set_link(self.entries.len() as u32);
                self.entries.push(PageId(p as u32));
            }
        }
        self.live = self.entries.len();
        self.dropped = false;
    }

    /// The link the next entry gets (the first of a run that [`extend`](Self::extend) adds).
    pub fn next_link(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Lists `page` (free, not pinned), after [`make_room`](Self::make_room).
    pub fn push(&mut self, tags: &mut [PageTag], page: PageId) {
        debug_assert!(self.entries.len() < self.entries.capacity(), "make_room first");
        tags[page.0 as usize].set_link(self.next_link());
        self.entries.push(page);
        self.live += 1;
    }

    /// Lists `pages` (free, not pinned), their tags linked from [`next_link`](Self::next_link)
    /// up already, after [`make_room`](Self::make_room).
    pub fn extend(&mut self, pages: &[PageId]) {
        debug_assert!(self.entries.len() + pages.len() <= self.entries.capacity(), "make_room first");
        self.entries.extend_from_slice(pages);
        self.live += pages.len();
    }

    /// A live page taken by id: its entry, if any, stays, stale.
    pub fn take(&mut self) {
        self.live -= 1;
    }

    /// The top `n` live entries (`n` at most [`len`](Self::len)), the stale ones above and among
    /// them dropped, for allocate to hand out and then [`pop`](Self::pop); the free pages listed
    /// again first if the entries were dropped. `None` only if the live count was off (a bug):
    /// the free pages are listed again, and the caller refuses the allocation.
    pub fn top(&mut self, tags: &mut [PageTag], n: usize) -> Option<&[PageId]> {
        if self.dropped {
            let live = self.live;
            self.list_free(tags);
            debug_assert_eq!(self.live, live, "the live count was off");
        }
        let len = self.entries.len();
        // Live entries packed up from the top as they are met; `read` walks down.
        let (mut read, mut write) = (len, len);
        while len - write < n {
            if read == 0 {
                self.list_free(tags);
                return None;
            }
            read -= 1;
            let page = self.entries[read];
            if Self::is_live(tags, read, page) {
                write -= 1;
                self.entries[write] = page;
            }
        }
        self.entries.drain(read..write);
        Some(&self.entries[self.entries.len() - n..])
    }

    /// Removes the top `n` entries (live, as [`top`](Self::top) left them): handed out.
    pub fn pop(&mut self, n: usize) {
        self.entries.truncate(self.entries.len() - n);
        self.live -= n;
    }
}

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
    ///
    /// `marked`: the pages are marked changed already (their owner's
    /// [`pages_marked`](RequestRecord::pages_marked) is the last take), so the loop need not.
    pub fn end_incarnations(&mut self, pages: &[PageId], from: PageState, marked: bool, released: &mut Released) {
        let n = pages.len();
        if let Some(&first) = pages.first() {
            // Owned pages end with their owner's release (its record gone), its preemption or a
            // release of some of them (which detached them first): one owner, one tick. Shared
            // pages end with a prefix nobody holds, or by force (`force_evict_prefix` ticks).
            self.taking(first);
        }
        let (limit, scrub) = (self.generation_limit, self.scrub_on_release);
        let next_state = if scrub { PageState::AwaitingScrub } else { PageState::Free };
        // Disjoint borrows, so the loop keeps its counts in registers.
        let TableState { tags, hot, free, changed, tracking_changes, .. } = self;
        free.make_room(n);
        let first_link = free.next_link();
        let ends = Ending { limit, next_state, next_hot: HotWord::unheld(next_state), first_link };
        debug_assert!(
            pages.iter().all(|p| tags.get(p.0 as usize).is_some_and(|t| t.state() == from)),
            "ending a page that is not {from:?}"
        );
        let rare = if *tracking_changes && !marked {
            ends.run::<true>(tags, hot, pages, changed)
        } else {
            ends.run::<false>(tags, hot, pages, changed)
        };
        debug_assert!(matches!(from, PageState::Owned | PageState::Shared));
        self.state_counts[from as usize] -= n as u64;
        released.ended += n as u64;
        if rare == 0 && !scrub {
            self.free.extend(pages);
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
            if matches!(tag.state(), PageState::Owned | PageState::Shared) {
                tag.set_watermark(0);
                if tag.sparse() {
                    tag.set_sparse(false);
                    let base = page.0 as usize * ps;
                    self.coverage[base..base + ps].fill(false);
                }
                let tag = &mut self.tags[page.0 as usize];
                if tag.generation() >= limit {
                    tag.set_state(PageState::Retired);
                } else {
                    tag.set_generation(tag.generation() + 1);
                    tag.set_state(if self.scrub_on_release { PageState::AwaitingScrub } else { PageState::Free });
                }
                self.hot[page.0 as usize] = HotWord::unheld(tag.state());
            }
            let tag = &mut self.tags[page.0 as usize];
            let state = tag.state();
            match state {
                PageState::AwaitingScrub => {
                    released.scrub.push(PageRef { page, generation: Generation(tag.generation() - 1) });
                }
                // A pinned page waits outside the free list until its transfer is over.
                PageState::Free if !tag.pinned() => self.free.push(&mut self.tags, page),
                _ => {}
            }
            self.state_counts[state as usize] += 1;
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

    fn slot_range(&self, page: PageId, a: u32, b: u32) -> std::ops::Range<usize> {
        let base = page.0 as usize * self.page_size as usize;
        base + a as usize..base + b as usize
    }

    /// Slots `0..n` of `page` are all written by its current incarnation: `n` is the page size
    /// for a whole page (its [`HotWord`] FULL bit), else the watermark. The one way to read the
    /// watermark: a write of whole pages sets their FULL bits and leaves the field behind.
    #[inline]
    pub fn written_prefix(&self, page: PageId) -> u32 {
        if self.hot[page.0 as usize].is_full() { self.page_size } else { self.tags[page.0 as usize].watermark() }
    }

    /// Forgets every slot `page`'s current incarnation wrote (a transfer that failed part-way may
    /// have overwritten them): reads of it are refused as unwritten until it is written again.
    pub fn revoke_coverage(&mut self, page: PageId) {
        self.taking(page);
        let tag = &mut self.tags[page.0 as usize];
        tag.set_watermark(0);
        if tag.sparse() {
            tag.set_sparse(false);
            let range = self.slot_range(page, 0, self.page_size);
            self.coverage[range].fill(false);
        }
        let hot = &mut self.hot[page.0 as usize];
        *hot = hot.with_full(false);
        self.mark_changed(page);
    }

    /// Records slots `a..b` of `page` as written and advances the watermark.
    ///
    /// The common write, appending to the written prefix (a decode step's token, a prefill's
    /// chunk), reads and writes the tag alone: the hot word's FULL bit is set when the write
    /// reaches the page's end and otherwise left as it is (a whole page's stays whole; its
    /// watermark, left behind by the whole-page write, moves on harmlessly). A decode step's
    /// write then touches one line (the tag), not two; the FULL bit is read only for a write
    /// that leaves a gap.
    #[inline(always)]
    pub fn mark_written(&mut self, page: PageId, a: u32, b: u32) {
        let tag = &mut self.tags[page.0 as usize];
        let watermark = tag.watermark();
        if b <= watermark.max(a) {
            return; // empty, or already written by this incarnation
        }
        if a <= watermark && !tag.sparse() {
            // The common case: appending to the written prefix.
            tag.set_watermark(b);
            if b >= self.page_size {
                let hot = &mut self.hot[page.0 as usize];
                *hot = hot.with_full(true);
            }
            self.mark_changed(page);
            return;
        }
        if self.hot[page.0 as usize].is_full() {
            return; // every slot is written already
        }
        self.mark_written_sparse(page, a, b);
    }

    /// [`mark_written`](Self::mark_written) when the write leaves a gap or may close one; the
    /// page is not whole.
    #[cold]
    fn mark_written_sparse(&mut self, page: PageId, a: u32, b: u32) {
        let tag = self.tags[page.0 as usize];
        let written = if a <= tag.watermark() {
            let rest = &self.coverage[self.slot_range(page, b, self.page_size)];
            b + rest.first_zero().unwrap_or(rest.len()) as u32
        } else {
            let range = self.slot_range(page, a, b);
            self.coverage[range].fill(true);
            self.tags[page.0 as usize].set_sparse(true);
            tag.watermark()
        };
        self.tags[page.0 as usize].set_watermark(written);
        let hot = &mut self.hot[page.0 as usize];
        *hot = hot.with_full(written >= self.page_size);
        self.mark_changed(page);
    }

    /// The first run of unwritten slots in `0..need` of `page`, given
    /// [`written_prefix`](Self::written_prefix) `< need` (so the page is not whole).
    pub fn unwritten_run(&self, page: PageId, need: u32) -> (u32, u32) {
        let tag = &self.tags[page.0 as usize];
        let start = self.written_prefix(page);
        if !tag.sparse() {
            return (start, need);
        }
        let gap = &self.coverage[self.slot_range(page, start, need.max(start))];
        (start, start + gap.first_one().unwrap_or(gap.len()) as u32)
    }

    /// Slots of `page` its current incarnation wrote.
    pub fn written_slots(&self, page: PageId) -> u32 {
        let (tag, prefix) = (&self.tags[page.0 as usize], self.written_prefix(page));
        if !tag.sparse() {
            return prefix;
        }
        prefix + self.coverage[self.slot_range(page, prefix, self.page_size)].count_ones() as u32
    }

    /// The tenant whose data a live page holds: its owner's, or its prefix's.
    pub fn page_tenant(&self, tag: &PageTag) -> Option<TenantId> {
        match tag.state() {
            PageState::Owned => self.requests.get(&tag.owner()).map(|r| r.tenant),
            PageState::Shared => self.prefixes.get(tag.prefix()).map(|p| p.tenant),
            _ => None,
        }
    }

    /// Counts a take (so no request's pages count as marked any more), first starting to track
    /// changes if nobody did yet (every page then counts as changed: a new mirror has none of
    /// the tags).
    fn start_take(&mut self) {
        if !self.tracking_changes {
            self.tracking_changes = true;
            self.changed.mark_all(self.tags.len());
        }
        self.takes += 1;
    }

    /// Appends the device tag of every changed page to `out`, in page order, and unmarks them
    /// (see [`take_changed`](Self::take_changed)); returns how many it appended.
    pub fn take_changed_tags_into(&mut self, out: &mut Vec<(u32, DeviceTag)>) -> usize {
        self.start_take();
        let before = out.len();
        let TableState { tags, hot, changed, requests, prefixes, page_size, .. } = self;
        let holders = Holders { requests, prefixes, last_owner: None };
        device_tags_into(tags, hot, changed, *page_size, holders, out);
        out.len() - before
    }

    /// The pages changed since the last call, in page order, each once, and unmarks them; the
    /// first call returns the whole pool and starts the tracking.
    pub fn take_changed(&mut self) -> Vec<PageId> {
        self.start_take();
        let mut pages = Vec::new();
        self.changed.take_into(&mut pages);
        pages
    }
}

/// What a device tag names of a held page's holder, looked up by
/// [`device_tags_into`] off its loop.
struct Holders<'a> {
    requests: &'a Requests,
    prefixes: &'a SlotMap<PrefixSlot, PrefixRecord>,
    /// The last owner looked up and its tenant: changed pages come in runs of one owner.
    last_owner: Option<(u64, u64)>,
}

/// The device tag of a page nobody holds (its tag `tag`, its hot word `word`): no holder, and
/// its watermark is its written prefix (the FULL bit went with its last incarnation).
#[inline(always)]
fn unheld_device_tag(tag: &PageTag, word: HotWord) -> DeviceTag {
    let incarnation = tag.incarnation();
    // The word's holder, 0 for a page nobody holds: a zero from memory, not a constant, so the
    // compiler writes the fields one by one instead of copying a zeroed template through the
    // stack (a 16-byte load of a just-stored, misaligned 16 bytes: a stall per page).
    let nobody = u64::from(word.holder());
    DeviceTag {
        owner: nobody,
        tenant: nobody,
        generation: PageTag::generation_of(incarnation),
        written: PageTag::watermark_of(incarnation),
        state: u32::from(tag.state_bits()),
        flags: 0,
    }
}

impl Holders<'_> {
    /// The device tag of a page whose tag is `tag`; `full` tells whether a held page is whole
    /// (its hot word's FULL bit, read only for a held page).
    #[inline(always)]
    fn device_tag(&mut self, tag: &PageTag, full: impl FnOnce() -> bool, page_size: u32) -> DeviceTag {
        // As a page nobody holds: no holder, its watermark its written prefix (the FULL bit went
        // with its last incarnation).
        let state = tag.state_bits();
        let (mut owner, mut tenant, mut flags, mut incarnation) = (0, 0, 0, tag.incarnation());
        if PageState::held_bits(state) {
            // Held: its holder's, and whole if its FULL bit says so.
            if state == PageState::Owned as u8 {
                (owner, tenant) = (tag.holder, self.owner_tenant(tag.holder));
            } else {
                (owner, tenant, flags) = self.prefix(tag.holder);
            }
            if full() {
                incarnation = tag.with_watermark(page_size);
            }
        }
        // Generation and written prefix from one word: stored as one.
        DeviceTag {
            owner,
            tenant,
            generation: PageTag::generation_of(incarnation),
            written: PageTag::watermark_of(incarnation),
            state: u32::from(state),
            flags,
        }
    }

    /// The tenant of the owner `holder` of an owned page.
    #[inline(always)]
    fn owner_tenant(&mut self, holder: u64) -> u64 {
        match self.last_owner {
            Some((owner, tenant)) if owner == holder => tenant,
            _ => self.look_up_owner(holder),
        }
    }
    #[cold]
    #[inline(never)]
    fn look_up_owner(&mut self, holder: u64) -> u64 {
        let tenant = self.requests.get(&RequestId(holder)).map_or(0, |r| r.tenant.0);
        self.last_owner = Some((holder, tenant));
        tenant
    }
    /// A shared page's publisher, tenant and device flags, from its prefix handle `holder`.
    #[cold]
    #[inline(never)]
    fn prefix(&self, holder: u64) -> (u64, u64, u32) {
        match self.prefixes.get(PrefixSlot::from_bits(holder)) {
            Some(p) => {
                (p.publisher.0, p.tenant.0, if p.cross_tenant { DeviceTag::FLAG_SHARED_ACROSS_TENANTS } else { 0 })
            }
            None => (0, 0, 0),
        }
    }
}

/// [`TableState::take_changed_tags_into`]'s loop: appends the device tag of each page marked in
/// `changed` to `out`, in page order, and unmarks them.
///
/// Word by word, each word's tags appended by an `extend` whose length is known (room made once
/// per word, no capacity test or length in memory per page); the holders of held pages looked up
/// off the loop.
#[inline(never)] // apart, so only the loop's own values compete for registers
fn device_tags_into(
    tags: &[PageTag],
    hot: &[HotWord],
    changed: &mut ChangedPages,
    page_size: u32,
    mut holders: Holders<'_>,
    out: &mut Vec<(u32, DeviceTag)>,
) {
    // As long as `tags`, so a page in range of one needs no second bounds check.
    let hot = &hot[..tags.len()];
    changed.take_words(|first, mut bits| {
        let holders = &mut holders;
        let (from, to) = (first as usize, first as usize + ChangedPages::WORD);
        if bits == u64::MAX
            && let (Some(run), Some(words)) = (tags.get(from..to), hot.get(from..to))
        {
            if words.iter().all(|w| !w.is_held()) {
                // And nobody holds any (a batch released): no holder to look up, no call in
                // the loop, so its values stay in registers.
                out.extend(
                    run.iter().zip(words).zip(first..).map(|((tag, &word), page)| (page, unheld_device_tag(tag, word))),
                );
                return;
            }
            // All 64 pages of the word changed (a batch of neighbours): their tags as one slice,
            // no bit scan and one bounds check. `extend` over zipped slices knows its length.
            out.extend(
                run.iter()
                    .zip(words)
                    .zip(first..)
                    .map(|((tag, word), page)| (page, holders.device_tag(tag, || word.is_full(), page_size))),
            );
            return;
        }
        // `extend` over a range's map knows its length: room for the word's pages is made once,
        // and each tag written in place. The word's bits moved into the closure, so they stay in
        // a register.
        out.extend((0..bits.count_ones()).map(move |_| {
            let page = first + bits.trailing_zeros();
            bits &= bits - 1;
            // A marked page is in the pool; past it, one would be listed retired (fail closed).
            let tag = tags.get(page as usize).copied().unwrap_or(PageTag::new(PageState::Retired, 0));
            (page, holders.device_tag(&tag, || hot[page as usize].is_full(), page_size))
        }));
    });
}

/// The fast loop of [`TableState::end_incarnations`]: what an ordinary page becomes.
struct Ending {
    limit: u32,
    next_state: PageState,
    next_hot: HotWord,
    /// The free-list index of the first page.
    first_link: u32,
}

impl Ending {
    /// Ends the incarnation of every ordinary page of `pages` (marking each changed if `TRACK`,
    /// the rare ones too: the general pass changes them) and leaves the rare ones (retiring,
    /// pinned, or with gaps in their coverage) as they were; returns how many it left.
    #[inline(never)] // apart, so only the loop's own values compete for registers
    fn run<const TRACK: bool>(
        &self,
        tags: &mut [PageTag],
        hot: &mut [HotWord],
        pages: &[PageId],
        changed: &mut ChangedPages,
    ) -> usize {
        // As long as `tags`, so a page in range of one needs no second bounds check.
        let hot = &mut hot[..tags.len()];
        // An ended page's place: its link (counted up from the first's), the next state, and no
        // flag (pinned and sparse pages are rare).
        let first_place = PageTag::place_of(self.first_link, self.next_state);
        let mut rare = 0usize;
        // Local, so its fields stay in registers; the page marked as the loop reaches it (a
        // separate pass after the loop cost more time: its chain of ORs overlaps nothing).
        let mut changed = changed.marking();
        let mut end = |page: PageId, place: u64| {
            // Read before anything is written: a word loaded just after part of it was stored
            // waits for that store to retire.
            let tag = &mut tags[page.0 as usize];
            let (generation, old_place) = (tag.generation(), tag.place());
            if TRACK {
                changed.mark(page);
            }
            if (old_place & (PageTag::SPARSE | PageTag::PINNED) != 0) | (generation >= self.limit) {
                rare += 1; // left in its old state for the general pass
            } else {
                // The next generation, nothing written: one store; and one for the place.
                tag.set_incarnation(PageTag::incarnation_of(generation + 1));
                tag.set_place(place);
                hot[page.0 as usize] = self.next_hot;
            }
        };
        // Four pages a round: one loop test per four.
        const ROUND: usize = 4;
        let (rounds, rest) = pages.as_chunks::<ROUND>();
        let mut place = first_place;
        for round in rounds {
            for &page in round {
                end(page, place);
                place += PageTag::NEXT_LINK;
            }
        }
        for &page in rest {
            end(page, place);
            place += PageTag::NEXT_LINK;
        }
        rare
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

    #[test]
    fn ids_differing_only_in_high_bits_spread_over_the_low_bits() {
        // A hash map picks buckets with the low bits of the hash. Ids a hostile trace crafts to
        // differ only above bit 47 must still land in many different buckets, or each insert
        // probes a cluster as long as the map (131,072 such ids took seconds to admit).
        use std::hash::BuildHasher;
        let ids = 1u64 << 17;
        let mask = (1u64 << 16) - 1;
        let hasher = IdMap::<RequestId, ()>::default().hasher().clone();
        let low: HashSet<u64> = (0..ids).map(|i| hasher.hash_one(RequestId(i << 47)) & mask).collect();
        // Random hashes would fill about 87% of the 65,536 buckets; a quarter is generous. The
        // seed is the process's, so one run checks one seed: a hash that spreads only for most
        // seeds fails here now and then, which is how the fast variant was caught.
        assert!(low.len() as u64 > mask / 4, "{} of {} low-bit buckets used", low.len(), mask + 1);
    }

    #[test]
    fn a_prefix_handle_kept_past_its_prefix_matches_nothing() {
        let record = || PrefixRecord {
            key: None,
            tenant: TenantId(1),
            publisher: RequestId(1),
            pages: vec![],
            holders: 1,
            cross_tenant: false,
        };
        let mut store: SlotMap<PrefixSlot, PrefixRecord> = SlotMap::with_key();
        let old = store.insert(record());
        let mut held = HeldPrefixes::default();
        held.insert(old);
        store.remove(old);
        let new = store.insert(record()); // the same slot, a new version
        assert_ne!(old, new);
        assert!(store.get(old).is_none() && !held.contains(new));
        // A page tag carries the handle whole.
        let mut tag = PageTag::new(PageState::Shared, 1);
        tag.set_prefix(new);
        assert_eq!(tag.prefix(), new);
        assert!(!held.contains(tag.prefix()));
    }

    #[test]
    fn a_page_tag_is_24_bytes() {
        // The memory figure in the table's docs and the README depends on it.
        assert_eq!(std::mem::size_of::<PageTag>(), 24);
        assert_eq!(std::mem::size_of::<HotWord>(), 8);
    }
}
