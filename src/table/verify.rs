//! Read verification: every page an attention read goes through is checked against its tag.

use super::hot::HotWord;
use super::info::PageState;
use super::state::{BlockEntry, PageTag, PrefixSlot, RequestEpochs, RequestRecord, TableState};
use crate::ids::RequestId;
use crate::violation::{Op, Violation, ViolationKind};
use std::sync::atomic::Ordering;

impl TableState {
    /// Checks that `req` may read its first `tokens` tokens through `block_table`.
    pub(crate) fn check_read<E: BlockEntry>(
        &self,
        req: RequestId,
        block_table: &[E],
        tokens: u64,
    ) -> Result<(), Violation> {
        self.check_read_of(self.requests.get(&req), req, block_table, tokens)
    }

    /// [`check_read`](Self::check_read) with `req`'s record already looked up (`None`: unknown).
    pub(crate) fn check_read_of<E: BlockEntry>(
        &self,
        rec: Option<&RequestRecord>,
        req: RequestId,
        block_table: &[E],
        tokens: u64,
    ) -> Result<(), Violation> {
        let (rec, full) = self.read_start(rec, req, block_table.len(), tokens)?;
        // Full pages come in runs of one holder: the request's own pages, a prefix's pages. A
        // run is checked by `hot_run`, which compares each page's hot word with the word of the
        // run's first page; the page that ends a run gets the full check, and if it passes, its
        // word keys the next run (see `HotWord` for why an equal word is as good as a pass).
        // Where each page is a prefix of its own (vLLM publishes one per cached block), pages
        // come in the order the request took the prefixes: `prefix_run` follows that order from
        // `next`, the held prefix after the last one a page was found in, so such a row is read
        // from hot words too, not tags.
        let held = rec.prefixes.in_order();
        let mut expected = HotWord::new(rec.slot, PageState::Owned, true);
        let mut next = 0;
        let mut i = 0;
        while i < full {
            i += hot_run(&self.hot, &self.tags, &block_table[i..full], expected);
            let rest = held.get(next..).unwrap_or_default();
            let run = if rest.is_empty() { 0 } else { prefix_run(&self.hot, &self.tags, &block_table[i..full], rest) };
            if run > 0 {
                i += run;
                next += run;
                // The last page's prefix keys the next run: a prefix of several pages goes on.
                expected = HotWord::new(held[next - 1].index(), PageState::Shared, true);
                continue;
            }
            let Some(&entry) = block_table[..full].get(i) else { break };
            self.check_entry(rec, req, i, entry, self.page_size)?;
            let page = entry.page().0 as usize; // in range: it passed
            expected = self.hot[page];
            if self.tags[page].state() == PageState::Shared {
                next = rec.prefixes.position(self.tags[page].prefix()).map_or(next, |at| at + 1);
            }
            i += 1;
        }
        let tail = self.page_div.offset(tokens) as u32;
        if tail > 0 {
            self.check_entry(rec, req, full, block_table[full], tail)?;
        }
        Ok(())
    }

    /// Whether `req` may read the first `tokens` slots (at most a page) of `page`, answered from
    /// the page's tag and the request's slot word alone, with no lookup of its record: the page
    /// is `req`'s own (an owned page's owner is live), `req` is not quarantined (the word of its
    /// slot, found through the tag's owner slot hint, or the hot word where the hint does not
    /// name it: [`TableState::owner_word`]), and the page is written that far (its watermark,
    /// or its hot word's FULL bit). `true` is
    /// what [`check_read`](Self::check_read) of `page` alone says (a read of one page owned by
    /// its reader passes on exactly these); `false` says nothing, and the full check decides.
    /// A decode step's window is usually one page its reader owns and has just written.
    /// An entry naming an incarnation (a page ref) must name the page's current one.
    #[inline(always)]
    pub(crate) fn reads_own_page<E: BlockEntry>(&self, req: RequestId, entry: E, tokens: u64) -> bool {
        let page = entry.page().0 as usize;
        let Some(tag) = self.tags.get(page) else { return false };
        if !tag.owned_by(req)
            || tokens > u64::from(self.page_size)
            || entry.generation().is_some_and(|g| g.0 != tag.generation())
        {
            return false;
        }
        // Written that far: the watermark says so for an append in order (a decode step's),
        // without the hot word; a whole page by its FULL bit (`written_prefix`).
        self.owner_word(entry.page(), tag) & RequestEpochs::QUARANTINED == 0
            && (u64::from(tag.watermark()) >= tokens || self.hot[page].is_full())
    }

    /// [`reads_own_page`](Self::reads_own_page) through the hot word alone, as it was before the
    /// tag's owner slot hint: what the tests hold it to.
    #[cfg(test)]
    pub(crate) fn reads_own_page_by_hot(&self, req: RequestId, page: crate::ids::PageId, tokens: u64) -> bool {
        let Some(tag) = self.tags.get(page.0 as usize) else { return false };
        tag.owned_by(req)
            && tokens <= u64::from(self.page_size)
            && self.epochs.word(self.hot[page.0 as usize].holder()) & RequestEpochs::QUARANTINED == 0
            && u64::from(self.written_prefix(page)) >= tokens
    }

    /// What every read checks first: `req` is live and not quarantined, and a block table of
    /// `entries` entries covers `tokens`. Its record, and how many of the entries are whole pages.
    #[inline(always)]
    fn read_start<'a>(
        &self,
        rec: Option<&'a RequestRecord>,
        req: RequestId,
        entries: usize,
        tokens: u64,
    ) -> Result<(&'a RequestRecord, usize), Violation> {
        let Some(rec) = rec else {
            return Err(Violation::new(ViolationKind::UnknownRequest, Op::Read).with_request(req, None));
        };
        if rec.quarantined.load(Ordering::Relaxed) {
            return Err(self.violation(ViolationKind::Quarantined, Op::Read, req));
        }
        let ps = u64::from(self.page_size);
        let covered = (entries as u64).saturating_mul(ps);
        if tokens > covered {
            return Err(self.violation(ViolationKind::BlockTableTooShort, Op::Read, req).with_amounts(tokens, covered));
        }
        Ok((rec, self.page_div.floor(tokens) as usize))
    }

    /// One page of a read: slots `0..need` of `entry`'s page.
    #[inline(always)]
    pub(super) fn check_entry<E: BlockEntry>(
        &self,
        rec: &RequestRecord,
        req: RequestId,
        index: usize,
        entry: E,
        need: u32,
    ) -> Result<(), Violation> {
        if let Some(tag) = self.tags.get(entry.page().0 as usize) {
            let mine = match tag.state() {
                PageState::Owned => tag.owner() == req,
                PageState::Shared => rec.prefixes.contains(tag.prefix()),
                _ => false,
            };
            let current = entry.generation().is_none_or(|g| g.0 == tag.generation());
            // The watermark first: a page written in order has it current; a whole page's
            // FULL bit answers where it lags.
            if mine && current && (tag.watermark() >= need || self.written_prefix(entry.page()) >= need) {
                return Ok(());
            }
        }
        Err(self.diagnose(rec, req, index, entry, need))
    }
}

/// How many leading `entries` are pages whose hot word is `expected` — in the incarnation
/// named, for page refs. With `expected` the word of a whole page the reader may read, those are
/// whole pages it may read too: the same owner, or the same prefix (see [`HotWord`]).
#[inline(never)]
fn hot_run<E: BlockEntry>(hot: &[HotWord], tags: &[PageTag], entries: &[E], expected: HotWord) -> usize {
    leading_matches(hot, tags, entries, expected, u64::MAX)
}

/// How many leading `entries` are pages whose hot word equals `expected` in every bit of `mask`
/// (and, for page refs, whose tag is in the incarnation named): the loop under the read check's
/// runs ([`hot_run`]) and the whole-page write's check (`first_unwritable`, which masks off the
/// FULL bit).
///
/// `hot` ends with [`HotWord::PAST_THE_POOL`], which no page's word equals: a page id past the
/// pool is clamped onto it (a conditional move, not a branch). Eight entries are checked at a
/// time, their differences ORed together and masked once, so a clean run costs one branch per
/// eight pages and one eighth of a cache line per page; the first chunk with a mismatch is then
/// scanned page by page for where the run ends. Without that last word nothing matches.
#[inline(always)]
pub(super) fn leading_matches<E: BlockEntry>(
    hot: &[HotWord],
    tags: &[PageTag],
    entries: &[E],
    expected: HotWord,
    mask: u64,
) -> usize {
    let Some(past) = hot.len().checked_sub(1) else { return 0 };
    // Non-zero (before masking) where `entry` differs; the stale bit is below FULL.
    let difference = |entry: E| {
        let page = entry.page().0 as usize;
        let stale = entry.generation().is_some_and(|g| tags.get(page).is_none_or(|tag| tag.generation() != g.0));
        hot[page.min(past)].differs(expected) | u64::from(stale)
    };
    const CHUNK: usize = 8;
    let mut done = 0;
    for chunk in entries.as_chunks::<CHUNK>().0 {
        if chunk.iter().fold(0, |any, &entry| any | difference(entry)) & mask != 0 {
            break;
        }
        done += CHUNK;
    }
    done + entries[done..].iter().position(|&entry| difference(entry) & mask != 0).unwrap_or(entries.len() - done)
}

/// How many leading `entries` are whole pages of the prefixes `held`, one page each, in that
/// order — in the incarnation named, for page refs. A held prefix is live, and a live prefix's
/// slot index is unique among live prefixes, so a page whose hot word is (shared, whole, held
/// prefix's index) is a whole page of that prefix: what the full check would pass.
#[inline(never)]
fn prefix_run<E: BlockEntry>(hot: &[HotWord], tags: &[PageTag], entries: &[E], held: &[PrefixSlot]) -> usize {
    let Some(past) = hot.len().checked_sub(1) else { return 0 };
    entries
        .iter()
        .zip(held)
        .take_while(|&(&entry, &slot)| {
            let page = entry.page().0 as usize;
            hot[page.min(past)] == HotWord::new(slot.index(), PageState::Shared, true)
                && entry.generation().is_none_or(|g| tags.get(page).is_some_and(|tag| tag.generation() == g.0))
        })
        .count()
}

#[cfg(test)]
impl TableState {
    /// [`check_read`](Self::check_read) the long way, for the tests: every page gets the full
    /// check, no hot word is looked at.
    pub(crate) fn check_read_reference<E: BlockEntry>(
        &self,
        req: RequestId,
        block_table: &[E],
        tokens: u64,
    ) -> Result<(), Violation> {
        let (rec, full) = self.read_start(self.requests.get(&req), req, block_table.len(), tokens)?;
        for (i, &entry) in block_table[..full].iter().enumerate() {
            self.check_entry(rec, req, i, entry, self.page_size)?;
        }
        let tail = self.page_div.offset(tokens) as u32;
        if tail > 0 {
            self.check_entry(rec, req, full, block_table[full], tail)?;
        }
        Ok(())
    }
}

impl TableState {
    /// The slow path: says exactly what is wrong with one entry of a read.
    #[cold]
    fn diagnose<E: BlockEntry>(
        &self,
        rec: &RequestRecord,
        req: RequestId,
        index: usize,
        entry: E,
        need: u32,
    ) -> Violation {
        let page = entry.page();
        let at =
            |kind| self.page_violation(kind, Op::Read, req, page).with_block_index(index as u32).with_slots(0, need);
        let Some(tag) = self.tag(page) else {
            return at(ViolationKind::PageOutOfRange);
        };
        let kind = match tag.state() {
            PageState::Reserved => ViolationKind::ReservedPage,
            PageState::Free | PageState::AwaitingScrub | PageState::Retired => ViolationKind::FreedPage,
            PageState::Owned if tag.owner() != req => ViolationKind::ForeignPage,
            PageState::Shared if !rec.prefixes.contains(tag.prefix()) => ViolationKind::ForeignPage,
            _ => match entry.generation() {
                Some(g) if g.0 != tag.generation() => {
                    return at(ViolationKind::StalePage).with_expected_generation(g);
                }
                _ => {
                    let (a, b) = self.unwritten_run(page, need);
                    return at(ViolationKind::UnwrittenSlots).with_slots(a, b);
                }
            },
        };
        let v = at(kind);
        match entry.generation() {
            Some(g) if g.0 != tag.generation() => v.with_expected_generation(g),
            _ => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{OwnershipTable, PageId, PoolConfig, PrefixKey, RequestId, TenantId, ViolationKind};

    #[test]
    fn a_bad_page_deep_in_a_run_is_found_at_its_index() {
        // Runs of a prefix's pages and the reader's own, long enough for whole chunks of eight.
        let t = OwnershipTable::new(PoolConfig::new(128, 4, 400).with_reserved([PageId(0)])).unwrap();
        let (a, b) = (RequestId(1), RequestId(2));
        t.admit(a, TenantId(1), 200, 0).unwrap();
        t.admit(b, TenantId(1), 200, 0).unwrap();
        let pa: Vec<PageId> = t.allocate(a, 20).unwrap().iter().map(|r| r.page).collect();
        t.record_write_tokens(a, &pa, 0..80).unwrap();
        t.publish_prefix(a, PrefixKey(9), &pa).unwrap();
        t.attach_prefix(b, PrefixKey(9)).unwrap();
        let pb: Vec<PageId> = t.allocate(b, 20).unwrap().iter().map(|r| r.page).collect();
        t.record_write_tokens(b, &pb, 0..80).unwrap();
        let bt: Vec<PageId> = pa.iter().chain(&pb).copied().collect();
        t.check_read(b, &bt, 160).unwrap();
        for (at, page, kind) in [
            (13, PageId(200), ViolationKind::PageOutOfRange),
            // The index of the word past the pool's last, and the largest id: both out of range.
            (4, PageId(128), ViolationKind::PageOutOfRange),
            (8, PageId(u32::MAX), ViolationKind::PageOutOfRange),
            (27, PageId(0), ViolationKind::ReservedPage),
            (35, PageId(127), ViolationKind::FreedPage),
        ] {
            let mut bad = bt.clone();
            bad[at] = page;
            let v = t.check_read(b, &bad, 160).unwrap_err();
            assert_eq!((v.kind(), v.block_index()), (kind, Some(at as u32)), "{v}");
        }
        // The reader's own pages are not the publisher's.
        let v = t.check_read(a, &bt, 160).unwrap_err();
        assert_eq!((v.kind(), v.block_index()), (ViolationKind::ForeignPage, Some(20)));
    }

    #[test]
    fn a_page_id_past_the_pool_is_refused_when_the_last_page_is_the_readers() {
        // The reader holds every page, the last one included: an id past the pool must not
        // read as that page.
        let t = OwnershipTable::new(PoolConfig::new(17, 4, 64).with_reserved([PageId(0)])).unwrap();
        let r = RequestId(1);
        t.admit(r, TenantId(1), 64, 0).unwrap();
        let bt: Vec<PageId> = t.allocate(r, 16).unwrap().iter().map(|p| p.page).collect();
        assert_eq!(bt.last(), Some(&PageId(16)));
        t.record_write_tokens(r, &bt, 0..64).unwrap();
        t.check_read(r, &bt, 64).unwrap();
        for at in [0, 3, 8, 15] {
            for page in [PageId(17), PageId(18), PageId(u32::MAX)] {
                let mut bad = bt.clone();
                bad[at] = page;
                let v = t.check_read(r, &bad, 64).unwrap_err();
                assert_eq!((v.kind(), v.block_index()), (ViolationKind::PageOutOfRange, Some(at as u32)), "{v}");
            }
        }
    }

    /// `reads_own_page` says clean only where the full check of that one page does, and says
    /// it for the common window: a page its reader owns, written that far.
    #[test]
    fn a_page_read_from_its_words_alone_passes_only_what_the_full_check_passes() {
        use crate::{PageRef, Policy};
        let t = OwnershipTable::new(PoolConfig::new(16, 8, 64).with_reserved([PageId(0)]).with_policy(Policy::Enforce))
            .unwrap();
        let (a, b, q) = (RequestId(1), RequestId(2), RequestId(3));
        for r in [a, b, q] {
            t.admit(r, TenantId(r.0), 32, 0).unwrap();
        }
        let pa = t.allocate(a, 3).unwrap();
        let (part, whole, unwritten) = (pa[0], pa[1], pa[2]);
        t.record_write(a, part.page, 0..5).unwrap();
        t.record_write_tokens(a, &[whole.page], 0..8).unwrap();
        let pq = t.allocate(q, 1).unwrap()[0];
        t.record_write(q, pq.page, 0..8).unwrap();
        assert!(t.verify_read(q, &[part.page], 1).is_err(), "q reads a's page: refused, quarantined");
        t.publish_prefix(b, PrefixKey(1), &[t.allocate(b, 1).unwrap()[0].page]).ok();
        let stale = PageRef { generation: crate::Generation(part.generation.0 + 1), ..part };
        let state = t.state.read();
        let case = |req: RequestId, entry: PageRef, tokens: u64| {
            let fast = state.reads_own_page(req, entry, tokens);
            let full = state.check_read(req, &[entry], tokens).is_ok();
            assert!(!fast || full, "{req:?} {entry:?} {tokens}: clean from the words, refused in full");
            fast
        };
        for tokens in 0..=5 {
            assert!(case(a, part, tokens), "a's own page, written that far");
            assert!(case(a, PageRef { page: part.page, ..part }, tokens));
        }
        assert!(!case(a, part, 6), "past the watermark");
        assert!(case(a, whole, 8), "a whole page");
        assert!(!case(a, whole, 9), "more than a page");
        assert!(case(a, unwritten, 0) && !case(a, unwritten, 1));
        assert!(!case(b, part, 1), "another request's page");
        assert!(!case(q, pq, 1), "a quarantined reader, on its own page");
        assert!(!case(a, stale, 1), "an incarnation that is not the page's");
        assert!(
            !case(a, PageRef { page: PageId(16), ..part }, 1)
                && !case(a, PageRef { page: PageId(u32::MAX), ..part }, 1)
        );
        assert!(!case(RequestId(9), part, 1), "an unknown reader");
    }

    /// vLLM's shape: every cached block a prefix of its own, taken in the order of the row.
    #[test]
    fn a_row_of_single_page_prefixes_is_checked_page_by_page() {
        let t = OwnershipTable::new(PoolConfig::new(64, 4, 200).with_reserved([PageId(0)])).unwrap();
        let (a, b, c) = (RequestId(1), RequestId(2), RequestId(3));
        t.admit(a, TenantId(1), 100, 0).unwrap();
        t.admit(b, TenantId(1), 100, 0).unwrap();
        t.admit(c, TenantId(2), 100, 0).unwrap();
        let pa: Vec<PageId> = t.allocate(a, 12).unwrap().iter().map(|r| r.page).collect();
        t.record_write_tokens(a, &pa, 0..48).unwrap();
        for (k, &page) in pa.iter().enumerate() {
            t.publish_prefix(a, PrefixKey(k as u64), &[page]).unwrap();
        }
        // b takes the first ten in row order, then two more pages of its own.
        for k in 0..10 {
            t.attach_prefix(b, PrefixKey(k)).unwrap();
        }
        let own: Vec<PageId> = t.allocate(b, 2).unwrap().iter().map(|r| r.page).collect();
        t.record_write_tokens(b, &own, 0..8).unwrap();
        let bt: Vec<PageId> = pa[..10].iter().chain(&own).copied().collect();
        t.check_read(b, &bt, 48).unwrap();
        // The same pages out of the order b took them read as well (the full check finds each).
        let mut shuffled = bt.clone();
        shuffled.swap(2, 7);
        shuffled.swap(0, 9);
        t.check_read(b, &shuffled, 48).unwrap();
        // A whole page of another request's own, a's pages b does not hold (whole, shared), a
        // page of another tenant, a free page: refused where they stand, in the prefix run.
        let pc: Vec<PageId> = t.allocate(c, 1).unwrap().iter().map(|r| r.page).collect();
        t.record_write_tokens(c, &pc, 0..4).unwrap();
        for (at, page, kind) in [
            (0, pa[10], ViolationKind::ForeignPage),
            (4, pa[11], ViolationKind::ForeignPage),
            (9, pa[10], ViolationKind::ForeignPage),
            (3, pc[0], ViolationKind::ForeignPage),
            (5, PageId(63), ViolationKind::FreedPage),
            (11, pa[11], ViolationKind::ForeignPage),
        ] {
            let mut bad = bt.clone();
            bad[at] = page;
            let v = t.check_read(b, &bad, 48).unwrap_err();
            assert_eq!((v.kind(), v.block_index()), (kind, Some(at as u32)), "{v}");
        }
        // A prefix b let go of: its page is foreign at once, before and after the ones it holds.
        t.detach_prefix(b, PrefixKey(4)).unwrap();
        let v = t.check_read(b, &bt, 48).unwrap_err();
        assert_eq!((v.kind(), v.block_index()), (ViolationKind::ForeignPage, Some(4)), "{v}");
        let mut rest = bt.clone();
        rest.remove(4);
        t.check_read(b, &rest, 44).unwrap();
    }
}
