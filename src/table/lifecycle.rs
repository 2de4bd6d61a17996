//! Request lifecycle on the table: admit, allocate or claim, write, release, fork.

use super::hot::HotWord;
use super::info::{PageState, Released};
use super::mirror::ChangedPages;
use super::state::{
    BlockEntry, PageTag, PrefixRecord, RequestRecord, SPARE_LIST_MAX_CAPACITY, SPARE_LISTS, TableState,
};
use super::verify::leading_matches;
use crate::config::PageDiv;
use crate::error::Error;
use crate::ids::{Generation, PageId, PageRef, RequestId, TenantId};
use crate::violation::{Op, Violation, ViolationKind};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

impl TableState {
    pub(crate) fn admit(&mut self, req: RequestId, tenant: TenantId, prompt: u64, max_new: u64) -> Result<(), Error> {
        if self.requests.contains_key(&req) {
            return Err(self.violation(ViolationKind::DuplicateRequest, Op::Admit, req).into());
        }
        let refuse = |kind, found, limit| -> Error {
            Violation::new(kind, Op::Admit).with_request(req, Some(tenant)).with_amounts(found, limit).into()
        };
        let total = prompt.saturating_add(max_new);
        if total > self.max_context_tokens {
            return Err(refuse(ViolationKind::ExceedsMaxContext, total, self.max_context_tokens));
        }
        let pages = total.div_ceil(u64::from(self.page_size));
        let obtainable = self.state_counts[PageState::Free as usize]
            + self.state_counts[PageState::Owned as usize]
            + self.state_counts[PageState::Shared as usize]
            + self.state_counts[PageState::AwaitingScrub as usize];
        if pages > obtainable {
            return Err(refuse(ViolationKind::ExceedsPool, pages, obtainable));
        }
        self.ended.forget(req);
        let pages = self.spare_page_lists.pop().unwrap_or_default();
        let slot = self.take_request_slot(req);
        self.requests.insert(
            req,
            RequestRecord {
                slot,
                tenant,
                prompt_tokens: prompt,
                max_new_tokens: max_new,
                pages,
                prefixes: Default::default(),
                quarantined: AtomicBool::new(false),
                pages_marked: self.takes,
            },
        );
        Ok(())
    }

    pub(crate) fn allocate_into<E: BlockEntry>(
        &mut self,
        req: RequestId,
        n: u32,
        out: &mut Vec<E>,
    ) -> Result<(), Error> {
        // Disjoint borrows, so the loop keeps its counts in registers.
        let TableState { tags, hot, free, changed, requests, state_counts, tracking_changes, .. } = self;
        let Some(rec) = requests.settled(&req, tags) else {
            return Err(Violation::new(ViolationKind::UnknownRequest, Op::Allocate).with_request(req, None).into());
        };
        let out_of_pages = |free: usize| Error::OutOfPages { requested: u64::from(n), free: free as u64 };
        if n as usize > free.len() {
            return Err(out_of_pages(free.len()));
        }
        // The top of the free stack, most recently freed last: hand it out from the top down.
        let Some(handed) = free.top(tags, n as usize) else { return Err(out_of_pages(free.len())) };
        // `out` grown first and filled in step with the pages: no length lives in memory
        // across pages, and no bounds check.
        let out_base = out.len();
        out.resize(out_base + handed.len(), E::entry(PageId(0), Generation(0)));
        let out = &mut out[out_base..];
        if *tracking_changes {
            give_pages::<true, E>(tags, hot, handed, out, req, rec, changed);
        } else {
            give_pages::<false, E>(tags, hot, handed, out, req, rec, changed);
        }
        rec.pages.extend(handed.iter().rev());
        state_counts[PageState::Free as usize] -= u64::from(n);
        state_counts[PageState::Owned as usize] += u64::from(n);
        free.pop(n as usize);
        Ok(())
    }

    pub(crate) fn claim(&mut self, req: RequestId, pages: &[PageId]) -> Result<Vec<PageRef>, Error> {
        self.claim_pages(req, pages)?;
        Ok(pages.iter().map(|&page| self.page_ref(page)).collect())
    }

    /// [`claim`](Self::claim) without the refs: all of `pages` free, then all taken (else none).
    pub(crate) fn claim_pages(&mut self, req: RequestId, pages: &[PageId]) -> Result<(), Error> {
        // One page, free and not pinned, for a live request: a decode step's claim (SGLang at page
        // size 1 makes one a row a step), taken at once. Anything else, refusals included, goes
        // the general way below, which names the violation.
        if let [page] = *pages
            && self.tags.get(page.0 as usize).is_some_and(|t| t.state() == PageState::Free && !t.pinned())
            && self.take_free_page(page, req)
        {
            return Ok(());
        }
        self.record(Op::Claim, req)?;
        let repeat = first_repeat(pages);
        for &page in pages {
            let state = self.check_usable(Op::Claim, req, page)?;
            // A pinned free page still has a transfer landing in it.
            if state != PageState::Free || self.tags[page.0 as usize].pinned() || repeat == Some(page) {
                return Err(self.page_violation(ViolationKind::PageNotFree, Op::Claim, req, page).into());
            }
        }
        for &page in pages {
            let taken = self.take_free_page(page, req);
            debug_assert!(taken, "the request was recorded above");
        }
        Ok(())
    }

    fn check_slots(&self, op: Op, req: RequestId, page: PageId, slots: &Range<u32>) -> Result<(), Error> {
        if slots.start > slots.end || slots.end > self.page_size {
            let v =
                self.page_violation(ViolationKind::SlotOutOfRange, op, req, page).with_slots(slots.start, slots.end);
            return Err(v.into());
        }
        Ok(())
    }

    pub(crate) fn record_write(&mut self, req: RequestId, page: PageId, slots: Range<u32>) -> Result<(), Error> {
        self.record(Op::Write, req)?;
        self.check_owned_by(Op::Write, req, page)?;
        self.check_slots(Op::Write, req, page, &slots)?;
        self.mark_written(page, slots.start, slots.end);
        Ok(())
    }

    /// Records one sequence's writes as the engine's slot mapping gives them: one entry per token,
    /// `page * page_size + offset`, [`PADDING_SLOT`](crate::table::PADDING_SLOT) for padding.
    /// Every page written must be `req`'s own; all or nothing.
    pub(crate) fn record_slot_writes(&mut self, req: RequestId, slots: &[i64]) -> Result<(), Error> {
        let div = self.page_div;
        // The common write: every slot in a page `req` owns. That is all the checks below ask
        // (an owned page's owner is live: a release frees its pages; an offset is within its
        // page), so its runs are marked at once, without looking the request up. A decode
        // step's one slot first, on its own.
        if let [slot] = *slots
            && let Some(page) = self.own_page_of(req, slot)
        {
            let offset = div.offset(slot as u64) as u32;
            self.mark_written(page, offset, offset + 1);
            return Ok(());
        }
        if self.all_in_own_pages(req, slots) {
            return for_each_slot_run(slots, div, |page, run| {
                self.mark_written(page, run.start, run.end);
                Ok(())
            });
        }
        self.record(Op::Write, req)?;
        for_each_slot_run(slots, div, |page, run| {
            self.check_owned_by(Op::Write, req, page)?;
            self.check_slots(Op::Write, req, page, &run)
        })?;
        for_each_slot_run(slots, div, |page, run| {
            self.mark_written(page, run.start, run.end);
            Ok(())
        })
    }

    /// The page of `slot` if `req` owns it (`None` for padding, a negative slot, one past the
    /// pool or in a page `req` does not own).
    #[inline(always)]
    fn own_page_of(&self, req: RequestId, slot: i64) -> Option<PageId> {
        let page = u32::try_from(self.page_div.floor(u64::try_from(slot).ok()?)).ok()?;
        self.tags.get(page as usize).is_some_and(|t| t.owned_by(req)).then_some(PageId(page))
    }

    /// `slots` has a slot that is not padding, and every slot that is not is in a page `req`
    /// owns.
    fn all_in_own_pages(&self, req: RequestId, slots: &[i64]) -> bool {
        let mut any = false;
        for &slot in slots {
            if slot == crate::table::PADDING_SLOT {
                continue;
            }
            if self.own_page_of(req, slot).is_none() {
                return false;
            }
            any = true;
        }
        any
    }

    /// The blocks `first..last` that tokens `range` touch, or `token_range_reversed`, or
    /// `block_table_too_short`.
    fn token_blocks(&self, op: Op, req: RequestId, blocks: usize, range: &Range<u64>) -> Result<Range<usize>, Error> {
        if range.start > range.end {
            let v = self.violation(ViolationKind::TokenRangeReversed, op, req).with_amounts(range.start, range.end);
            return Err(v.into());
        }
        if range.start == range.end {
            return Ok(0..0); // an empty write touches no page
        }
        let covered = (blocks as u64).saturating_mul(u64::from(self.page_size));
        if range.end > covered {
            let v = self.violation(ViolationKind::BlockTableTooShort, op, req).with_amounts(range.end, covered);
            return Err(v.into());
        }
        Ok(self.page_div.floor(range.start) as usize..self.page_div.ceil(range.end) as usize)
    }

    pub(crate) fn record_write_tokens<E: BlockEntry>(
        &mut self,
        op: Op,
        req: RequestId,
        block_table: &[E],
        tokens: Range<u64>,
    ) -> Result<(), Error> {
        let rec = self.record(op, req)?;
        let (slot, marked) = (rec.slot, rec.pages_all_marked(self.takes));
        let blocks = self.token_blocks(op, req, block_table.len(), &tokens)?;
        if blocks.is_empty() {
            return Ok(());
        }
        // All or nothing. The first and last blocks (maybe partial) are checked first; the ones
        // between are written whole, checked and marked in one pass that keeps each old watermark
        // and puts them back if a later page is refused.
        let (first, last) = (blocks.start, blocks.end - 1);
        let writable = |state: &TableState, entry: E| {
            state
                .tag(entry.page())
                .is_some_and(|t| t.owned_by(req) && entry.generation().is_none_or(|g| g.0 == t.generation()))
        };
        for b in [first, last] {
            if !writable(self, block_table[b]) {
                return Err(self.write_refusal(op, req, b, block_table[b]));
            }
        }
        if last > first + 1 {
            let middle = &block_table[first + 1..last];
            // A page owned by `req` has `req`'s slot in its hot word (a live request's slot is
            // unique, see `HotWord`), so a page id is checked by its word alone; a ref also by
            // its tag's generation. All checked first (loads only), then all written: a refusal
            // leaves nothing to put back.
            let owned = HotWord::new(slot, PageState::Owned, false);
            if let Some(k) = first_unwritable(&self.tags, &self.hot, middle, owned) {
                return Err(self.write_refusal(op, req, first + 1 + k, middle[k]));
            }
            let TableState { tags, hot, changed, tracking_changes, .. } = self;
            if *tracking_changes && !marked {
                write_whole::<true, E>(tags, hot, middle, owned, changed);
            } else {
                write_whole::<false, E>(tags, hot, middle, owned, changed);
            }
        }
        let ps = u64::from(self.page_size);
        let slots = |b: usize| {
            let page_start = b as u64 * ps;
            let a = tokens.start.max(page_start) - page_start;
            let e = tokens.end.min(page_start + ps) - page_start;
            (a as u32, e as u32)
        };
        let (a, e) = slots(first);
        self.mark_written(block_table[first].page(), a, e);
        if last > first {
            let (a, e) = slots(last);
            self.mark_written(block_table[last].page(), a, e);
        }
        Ok(())
    }

    pub(crate) fn release(&mut self, req: RequestId) -> Result<Released, Error> {
        let Some(rec) = self.requests.remove(&req, &mut self.tags) else {
            return Err(self.unknown_request(Op::Release, req));
        };
        let mut released = Released::default();
        let marked = rec.pages_all_marked(self.takes);
        self.end_incarnations(&rec.pages, PageState::Owned, marked, &mut released);
        for slot in rec.prefixes.iter() {
            self.drop_hold(slot, &mut released);
        }
        self.ended.insert(req);
        self.give_back_request_slot(rec.slot);
        self.keep_spare(rec.pages);
        Ok(released)
    }

    /// Keeps an ended request's page list for the next admission, if there is room for it.
    fn keep_spare(&mut self, mut pages: Vec<PageId>) {
        if self.spare_page_lists.len() < SPARE_LISTS && pages.capacity() <= SPARE_LIST_MAX_CAPACITY {
            pages.clear();
            self.spare_page_lists.push(pages);
        }
    }

    /// Releases the pages and prefix holds of `req` but keeps it admitted (recompute preemption).
    /// A quarantine stays: it lasts until the request is released.
    pub(crate) fn preempt(&mut self, req: RequestId) -> Result<Released, Error> {
        if !self.requests.contains_key(&req) {
            return Err(self.unknown_request(Op::Release, req));
        }
        self.taking_from(req);
        let rec = self.requests.settled(&req, &mut self.tags).expect("checked above");
        let pages = std::mem::take(&mut rec.pages);
        let prefixes = std::mem::take(&mut rec.prefixes);
        let marked = rec.pages_all_marked(self.takes);
        let mut released = Released::default();
        self.end_incarnations(&pages, PageState::Owned, marked, &mut released);
        for slot in prefixes.iter() {
            self.drop_hold(slot, &mut released);
        }
        Ok(released)
    }

    pub(crate) fn release_pages(&mut self, req: RequestId, pages: &[PageId]) -> Result<Released, Error> {
        let marked = self.record(Op::Release, req)?.pages_all_marked(self.takes);
        for &page in pages {
            self.check_owned_by(Op::Release, req, page)?;
        }
        if let Some(page) = first_repeat(pages) {
            return Err(self.page_violation(ViolationKind::DoubleFree, Op::Release, req, page).into());
        }
        for &page in pages {
            self.detach_from_owner(page);
        }
        let mut released = Released::default();
        self.end_incarnations(pages, PageState::Owned, marked, &mut released);
        Ok(released)
    }

    pub(crate) fn confirm_scrubbed(&mut self, refs: &[PageRef]) -> Result<(), Error> {
        for r in refs {
            let awaiting = self.tag(r.page).is_some_and(|t| {
                t.state() == PageState::AwaitingScrub && Some(t.generation()) == r.generation.0.checked_add(1)
            });
            if !awaiting {
                return Err(Error::NotAwaitingScrub(*r));
            }
            if self.tags[r.page.0 as usize].pinned() {
                // A scrub done while bytes may still land does not count: scrub again after.
                return Err(Error::ScrubInFlight(*r));
            }
        }
        if let Some(r) = first_repeat(refs) {
            return Err(Error::NotAwaitingScrub(r));
        }
        for r in refs {
            self.push_free(r.page);
        }
        Ok(())
    }

    pub(crate) fn fork(&mut self, parent: RequestId, child: RequestId) -> Result<(), Error> {
        let rec = self.record(Op::Fork, parent)?;
        if rec.quarantined.load(Ordering::Relaxed) {
            // A child would inherit the parent's pages without its quarantine.
            return Err(self.violation(ViolationKind::Quarantined, Op::Fork, parent).into());
        }
        if let Some(live) = self.requests.get(&child) {
            // Attributed to the parent, which made the call: the live child is the victim.
            let v = self.violation(ViolationKind::DuplicateRequest, Op::Fork, parent).with_owner(child, live.tenant);
            return Err(v.into());
        }
        let rec = self.requests.settled(&parent, &mut self.tags).expect("checked above");
        let (tenant, prompt, max_new) = (rec.tenant, rec.prompt_tokens, rec.max_new_tokens);
        let pages = std::mem::take(&mut rec.pages);
        let mut held = rec.prefixes.clone();
        if !pages.is_empty() {
            let slot = self.prefixes.insert(PrefixRecord {
                key: None,
                tenant,
                publisher: parent,
                pages: Vec::new(),
                holders: 1,
                cross_tenant: false,
            });
            for &page in &pages {
                self.share_page(page, slot);
            }
            self.prefixes[slot].pages = pages;
            self.requests.get_mut(&parent).expect("checked above").prefixes.insert(slot);
            held.insert(slot);
        }
        for slot in held.iter() {
            if let Some(prefix) = self.prefixes.get_mut(slot) {
                prefix.holders += 1;
            }
        }
        self.ended.forget(child);
        let slot = self.take_request_slot(child);
        self.requests.insert(
            child,
            RequestRecord {
                slot,
                tenant,
                prompt_tokens: prompt,
                max_new_tokens: max_new,
                pages: Vec::new(),
                prefixes: held,
                quarantined: AtomicBool::new(false),
                pages_marked: self.takes,
            },
        );
        Ok(())
    }

    /// Pins `refs` (all owned by `req` in exactly these incarnations) for a KV transfer about to
    /// land in them, under a new ticket id. All or none.
    pub(crate) fn pin(&mut self, req: RequestId, refs: &[PageRef]) -> Result<u64, Error> {
        self.record(Op::Import, req)?;
        self.check_entries_owned(Op::Import, req, refs)?;
        for (b, r) in refs.iter().enumerate() {
            if self.tags[r.page.0 as usize].pinned() {
                let v = self.page_violation(ViolationKind::ImportInFlight, Op::Import, req, r.page);
                return Err(v.with_block_index(b as u32).into());
            }
        }
        if let Some(r) = first_repeat(refs) {
            return Err(self.page_violation(ViolationKind::ImportInFlight, Op::Import, req, r.page).into());
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        for r in refs {
            self.tags[r.page.0 as usize].set_pinned(true);
            self.pins.insert(r.page, ticket);
        }
        Ok(ticket)
    }

    /// Unpins the pages `ticket` pinned (and only those: a page is never unpinned for another
    /// transfer); a page released while pinned joins the free list now.
    pub(crate) fn unpin(&mut self, ticket: u64, refs: &[PageRef]) {
        for r in refs {
            if self.pins.get(&r.page) != Some(&ticket) {
                continue;
            }
            self.pins.remove(&r.page);
            let tag = &mut self.tags[r.page.0 as usize];
            tag.set_pinned(false);
            if tag.state() == PageState::Free {
                self.free.make_room(1);
                self.free.push(&mut self.tags, r.page);
            }
        }
    }
}

/// The first item that repeats an earlier one: linear for short lists, hashed for long ones, so a
/// caller-sized list never costs quadratic time.
pub(crate) fn first_repeat<T: Copy + Eq + std::hash::Hash>(items: &[T]) -> Option<T> {
    if items.len() <= 16 {
        return items.iter().enumerate().find(|(i, x)| items[..*i].contains(x)).map(|(_, &x)| x);
    }
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    items.iter().copied().find(|x| !seen.insert(*x))
}

/// The first of the whole pages [`record_write_tokens`](TableState::record_write_tokens) writes
/// between the first and last that may not be written: not owned by the request whose word is
/// `owned` (any watermark: the FULL bit masked off), or, for a ref, not in its incarnation.
/// Reads only; the read check's loop ([`leading_matches`]), so a page id past the pool is never
/// writable.
#[inline(never)] // apart, so only the loop's own values compete for registers
fn first_unwritable<E: BlockEntry>(tags: &[PageTag], hot: &[HotWord], pages: &[E], owned: HotWord) -> Option<usize> {
    let writable = leading_matches(hot, tags, pages, owned, HotWord::but_full(u64::MAX));
    (writable < pages.len()).then_some(writable)
}

/// [`record_write_tokens`](TableState::record_write_tokens)' loop over the whole pages between
/// the first and last, all checked writable ([`first_unwritable`]): each made whole (its word
/// becomes `owned`'s with the FULL bit, which says every slot is written: the tag's watermark is
/// not touched), and marked changed if `TRACK`.
#[inline(never)] // apart, so only the loop's own values compete for registers
fn write_whole<const TRACK: bool, E: BlockEntry>(
    tags: &[PageTag],
    hot: &mut [HotWord],
    pages: &[E],
    owned: HotWord,
    changed: &mut ChangedPages,
) {
    let whole = owned.with_full(true);
    // Hot words only (the word past the pool is never written).
    let hot = &mut hot[..tags.len()];
    // Local, so its fields stay in registers.
    let mut changed = changed.marking();
    for &entry in pages {
        let page = entry.page();
        // Checked by `first_unwritable`: in range. A page listed twice is written twice, alike.
        if let Some(word) = hot.get_mut(page.0 as usize) {
            *word = whole;
            if TRACK {
                changed.mark(page);
            }
        }
    }
}

/// [`allocate_into`](TableState::allocate_into)'s loop: the free `pages`, top of the stack
/// first, made `rec`'s (owned by `req`, linked after its current pages), their refs (or ids)
/// written to `out` (as long as `pages`), each marked changed if `TRACK`.
#[inline(never)] // apart, so only the loop's own values compete for registers
fn give_pages<const TRACK: bool, E: BlockEntry>(
    tags: &mut [PageTag],
    hot: &mut [HotWord],
    pages: &[PageId],
    out: &mut [E],
    req: RequestId,
    rec: &RequestRecord,
    changed: &mut ChangedPages,
) {
    // As long as `tags`, so a page in range of one needs no second bounds check.
    let hot = &mut hot[..tags.len()];
    let owned = HotWord::new(rec.slot, PageState::Owned, false);
    // A page list never outgrows the pool, whose size is a `u32`. A given page's place: its
    // link (counted up from the first's), owned, and no flag (a free page in the free list is
    // neither pinned nor sparse).
    let mut place = PageTag::place_with_slot(PageTag::place_of(rec.pages.len() as u32, PageState::Owned), rec.slot);
    // One count for both lists, each cut to it, so neither index needs a bounds check.
    let n = out.len().min(pages.len());
    let (out, pages) = (&mut out[..n], &pages[..n]);
    // Local, so its fields stay in registers.
    let mut changed = changed.marking();
    for k in 0..n {
        let page = pages[n - 1 - k];
        let tag = &mut tags[page.0 as usize];
        debug_assert!(tag.state() == PageState::Free && tag.watermark() == 0 && !tag.sparse() && !tag.pinned());
        out[k] = E::entry(page, Generation(tag.generation()));
        tag.set_owner(req);
        tag.set_place(place);
        place += PageTag::NEXT_LINK;
        hot[page.0 as usize] = owned;
        if TRACK {
            changed.mark(page);
        }
    }
}

/// Calls `f` on every maximal run of consecutive slots of one page in a slot mapping, in order;
/// [`PADDING_SLOT`](crate::table::PADDING_SLOT) entries are skipped. Any other negative entry,
/// or one past the last page a `u32` can name, becomes a run on page `u32::MAX`, which no pool has
/// (`page_out_of_range`): never truncated onto a real page.
fn for_each_slot_run(
    slots: &[i64],
    div: PageDiv,
    mut f: impl FnMut(PageId, Range<u32>) -> Result<(), Error>,
) -> Result<(), Error> {
    const NO_PAGE: PageId = PageId(u32::MAX);
    let mut run: Option<(PageId, u32, u32)> = None;
    for &slot in slots {
        let (page, offset) = match u64::try_from(slot) {
            Ok(s) => (u32::try_from(div.floor(s)).map_or(NO_PAGE, PageId), div.offset(s) as u32),
            Err(_) if slot == crate::table::PADDING_SLOT => continue,
            Err(_) => (NO_PAGE, 0),
        };
        run = match run {
            Some((p, a, b)) if p == page && b == offset => Some((p, a, b + 1)),
            Some((p, a, b)) => {
                f(p, a..b)?;
                Some((page, offset, offset + 1))
            }
            None => Some((page, offset, offset + 1)),
        };
    }
    match run {
        Some((p, a, b)) => f(p, a..b),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::first_repeat;

    #[test]
    fn first_repeat_finds_the_first_second_occurrence() {
        assert_eq!(first_repeat::<u32>(&[]), None);
        assert_eq!(first_repeat(&[1, 2, 3]), None);
        assert_eq!(first_repeat(&[1, 2, 2, 1]), Some(2));
        let long: Vec<u32> = (0..1000).chain([500, 7]).collect();
        assert_eq!(first_repeat(&long), Some(500));
        let distinct: Vec<u32> = (0..100_000).collect();
        assert_eq!(first_repeat(&distinct), None);
    }
}
