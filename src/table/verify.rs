//! Read verification: every page an attention read goes through is checked against its tag.

use super::info::PageState;
use super::state::{BlockEntry, HotWord, PageTag, RequestRecord, TableState};
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
        let Some(rec) = self.requests.get(&req) else {
            return Err(Violation::new(ViolationKind::UnknownRequest, Op::Read).with_request(req, None));
        };
        if rec.quarantined.load(Ordering::Relaxed) {
            return Err(self.violation(ViolationKind::Quarantined, Op::Read, req));
        }
        let ps = u64::from(self.page_size);
        let covered = (block_table.len() as u64).saturating_mul(ps);
        if tokens > covered {
            return Err(self.violation(ViolationKind::BlockTableTooShort, Op::Read, req).with_amounts(tokens, covered));
        }
        let full = (tokens / ps) as usize;
        // Full pages come in runs of one holder: the request's own pages, a prefix's pages. A
        // run is checked by `hot_run`, which compares each page's hot word with the word of the
        // run's first page; the page that ends a run gets the full check, and if it passes, its
        // word keys the next run (see `HotWord` for why an equal word is as good as a pass).
        let mut expected = HotWord::new(rec.slot, PageState::Owned, true);
        let mut i = 0;
        while i < full {
            i += hot_run(&self.hot, &self.tags, &block_table[i..full], expected);
            let Some(&entry) = block_table[..full].get(i) else { break };
            self.check_entry(rec, req, i, entry, self.page_size)?;
            expected = self.hot[entry.page().0 as usize]; // in range: it passed
            i += 1;
        }
        let tail = (tokens % ps) as u32;
        if tail > 0 {
            self.check_entry(rec, req, full, block_table[full], tail)?;
        }
        Ok(())
    }

    /// One page of a read: slots `0..need` of `entry`'s page.
    #[inline(always)]
    fn check_entry<E: BlockEntry>(
        &self,
        rec: &RequestRecord,
        req: RequestId,
        index: usize,
        entry: E,
        need: u32,
    ) -> Result<(), Violation> {
        if let Some(tag) = self.tags.get(entry.page().0 as usize) {
            let mine = match tag.state {
                PageState::Owned => tag.owner() == req,
                PageState::Shared => rec.prefixes.contains(tag.prefix()),
                _ => false,
            };
            let current = entry.generation().is_none_or(|g| g.0 == tag.generation);
            if mine && current && tag.written >= need {
                return Ok(());
            }
        }
        Err(self.diagnose(rec, req, index, entry, need))
    }
}

/// How many leading `entries` are pages whose hot word is `expected` — in the incarnation
/// named, for page refs. With `expected` the word of a whole page the reader may read, those are
/// whole pages it may read too: the same owner, or the same prefix (see [`HotWord`]).
///
/// Eight entries are checked at a time without a branch between them, so the loop keeps its
/// few values in registers and a clean read costs a handful of instructions and one eighth of a
/// cache line per page. Page refs also compare the generation in the page's tag.
#[inline(never)]
fn hot_run<E: BlockEntry>(hot: &[HotWord], tags: &[PageTag], entries: &[E], expected: HotWord) -> usize {
    let fits = |entry: E| {
        let page = entry.page().0 as usize;
        hot.get(page).is_some_and(|&word| word == expected)
            && entry.generation().is_none_or(|g| tags.get(page).is_some_and(|tag| tag.generation == g.0))
    };
    const CHUNK: usize = 8;
    let mut done = 0;
    for chunk in entries.as_chunks::<CHUNK>().0 {
        if !chunk.iter().all(|&entry| fits(entry)) {
            break;
        }
        done += CHUNK;
    }
    done + entries[done..].iter().position(|&entry| !fits(entry)).unwrap_or(entries.len() - done)
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
        let Some(rec) = self.requests.get(&req) else {
            return Err(Violation::new(ViolationKind::UnknownRequest, Op::Read).with_request(req, None));
        };
        if rec.quarantined.load(Ordering::Relaxed) {
            return Err(self.violation(ViolationKind::Quarantined, Op::Read, req));
        }
        let ps = u64::from(self.page_size);
        let covered = (block_table.len() as u64).saturating_mul(ps);
        if tokens > covered {
            return Err(self.violation(ViolationKind::BlockTableTooShort, Op::Read, req).with_amounts(tokens, covered));
        }
        let full = (tokens / ps) as usize;
        for (i, &entry) in block_table[..full].iter().enumerate() {
            self.check_entry(rec, req, i, entry, self.page_size)?;
        }
        let tail = (tokens % ps) as u32;
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
        let kind = match tag.state {
            PageState::Reserved => ViolationKind::ReservedPage,
            PageState::Free | PageState::AwaitingScrub | PageState::Retired => ViolationKind::FreedPage,
            PageState::Owned if tag.owner() != req => ViolationKind::ForeignPage,
            PageState::Shared if !rec.prefixes.contains(tag.prefix()) => ViolationKind::ForeignPage,
            _ => match entry.generation() {
                Some(g) if g.0 != tag.generation => {
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
            Some(g) if g.0 != tag.generation => v.with_expected_generation(g),
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

    mod hot_words {
        use crate::table::state::TableState;
        use crate::{OwnershipTable, PageId, PageRef, PoolConfig, PrefixKey, RequestId, TenantId};
        use proptest::prelude::*;

        const PAGES: u32 = 24;
        const PS: u32 = 4;

        #[derive(Clone, Debug)]
        enum Step {
            Admit(u8, u8),
            Allocate(u8, u8),
            Claim(u8, Vec<u8>),
            WriteTokens(u8, u8, u8),
            WriteSlots(u8, u8, u8, u8),
            Release(u8),
            ReleasePages(u8, Vec<u8>),
            Preempt(u8),
            Publish(u8, u8, u8),
            Attach(u8, u8),
            Detach(u8, u8),
            Evict(u8),
            Fork(u8, u8),
            ForceClaim(u8, Vec<u8>),
            ForceRelease(Vec<u8>),
            ForceEvict(u8),
            Scrub,
            /// A read by a request: through its own pages, then its prefixes', with entry `.2`
            /// replaced by page `.3` (when in range), `.1` tokens.
            Read(u8, u8, u8, u8),
        }

        fn step() -> impl Strategy<Value = Step> {
            let r = || 0u8..6;
            let page = || 0u8..(PAGES as u8 + 2);
            prop_oneof![
                3 => (r(), 0u8..3).prop_map(|(a, b)| Step::Admit(a, b)),
                3 => (r(), 0u8..6).prop_map(|(a, b)| Step::Allocate(a, b)),
                1 => (r(), prop::collection::vec(page(), 0..3)).prop_map(|(a, b)| Step::Claim(a, b)),
                3 => (r(), any::<u8>(), any::<u8>()).prop_map(|(a, b, c)| Step::WriteTokens(a, b, c)),
                2 => (r(), 0u8..8, 0u8..5, 0u8..5).prop_map(|(a, b, c, d)| Step::WriteSlots(a, b, c, d)),
                1 => r().prop_map(Step::Release),
                1 => (r(), prop::collection::vec(0u8..8, 0..3)).prop_map(|(a, b)| Step::ReleasePages(a, b)),
                1 => r().prop_map(Step::Preempt),
                1 => (r(), 0u8..4, 0u8..6).prop_map(|(a, b, c)| Step::Publish(a, b, c)),
                1 => (r(), 0u8..4).prop_map(|(a, b)| Step::Attach(a, b)),
                1 => (r(), 0u8..4).prop_map(|(a, b)| Step::Detach(a, b)),
                1 => (0u8..4).prop_map(Step::Evict),
                1 => (r(), r()).prop_map(|(a, b)| Step::Fork(a, b)),
                1 => (r(), prop::collection::vec(page(), 0..3)).prop_map(|(a, b)| Step::ForceClaim(a, b)),
                1 => prop::collection::vec(page(), 0..3).prop_map(Step::ForceRelease),
                1 => (0u8..4).prop_map(Step::ForceEvict),
                1 => Just(Step::Scrub),
                6 => (r(), any::<u8>(), 0u8..40, page()).prop_map(|(a, b, c, d)| Step::Read(a, b, c, d)),
            ]
        }

        fn req(r: u8) -> RequestId {
            RequestId(1000 + u64::from(r))
        }

        /// The pages `r` may read, its own first, as the table lists them.
        fn view(t: &OwnershipTable, r: u8) -> Vec<PageRef> {
            let state = t.state.read();
            let Some(rec) = state.requests.get(&req(r)) else { return Vec::new() };
            let held = rec.prefixes.iter().filter_map(|slot| state.prefixes.get(slot));
            let pages = rec.pages.iter().chain(held.flat_map(|prefix| prefix.pages.iter()));
            pages.map(|&page| state.page_ref(page)).collect()
        }

        fn in_sync(state: &TableState) -> Result<(), TestCaseError> {
            for p in 0..state.tags.len() as u32 {
                prop_assert_eq!(state.hot[p as usize], state.hot_word_of(PageId(p)), "page {}", p);
            }
            Ok(())
        }

        fn run(scrub: bool, limit: u32, steps: &[Step]) -> Result<(), TestCaseError> {
            let config = PoolConfig::new(PAGES, PS, u64::from(PAGES * PS))
                .with_reserved([PageId(0)])
                .with_scrub_on_release(scrub)
                .with_generation_limit(limit);
            let t = OwnershipTable::new_unaudited(config).expect("a small pool");
            let mut to_scrub: Vec<PageRef> = Vec::new();
            let keep = |to_scrub: &mut Vec<PageRef>, released: Result<crate::Released, crate::Error>| {
                if let Ok(r) = released {
                    to_scrub.extend(r.scrub);
                }
            };
            let own = |t: &OwnershipTable, r: u8| -> Vec<PageId> {
                t.state.read().requests.get(&req(r)).map(|rec| rec.pages.clone()).unwrap_or_default()
            };
            let pick = |t: &OwnershipTable, r: u8, picks: &[u8]| -> Vec<PageId> {
                let mine = own(t, r);
                picks.iter().filter_map(|&i| mine.get(i as usize).copied()).collect()
            };
            let raw = |pages: &[u8]| -> Vec<PageId> { pages.iter().map(|&p| PageId(u32::from(p))).collect() };
            for step in steps {
                match step {
                    Step::Admit(r, tenant) => {
                        let _ = t.admit(req(*r), TenantId(u64::from(*tenant)), 12, 4);
                    }
                    Step::Allocate(r, n) => {
                        let _ = t.allocate(req(*r), u32::from(*n));
                    }
                    Step::Claim(r, pages) => {
                        let _ = t.claim(req(*r), &raw(pages));
                    }
                    Step::WriteTokens(r, start, len) => {
                        let bt = own(&t, *r);
                        let start = u64::from(*start) % (bt.len() as u64 * u64::from(PS) + 1);
                        let _ = t.record_write_tokens(req(*r), &bt, start..start + u64::from(*len % 24));
                    }
                    Step::WriteSlots(r, i, a, b) => {
                        if let Some(&page) = own(&t, *r).get(*i as usize) {
                            let _ = t.record_write(req(*r), page, u32::from(*a)..u32::from(*b));
                        }
                    }
                    Step::Release(r) => keep(&mut to_scrub, t.release(req(*r))),
                    Step::ReleasePages(r, picks) => keep(&mut to_scrub, t.release_pages(req(*r), &pick(&t, *r, picks))),
                    Step::Preempt(r) => keep(&mut to_scrub, t.preempt(req(*r))),
                    Step::Publish(r, key, n) => {
                        let pages: Vec<PageId> = own(&t, *r).into_iter().take(*n as usize).collect();
                        let _ = t.publish_prefix(req(*r), PrefixKey(u64::from(*key)), &pages);
                    }
                    Step::Attach(r, key) => {
                        let _ = t.attach_prefix(req(*r), PrefixKey(u64::from(*key)));
                    }
                    Step::Detach(r, key) => keep(&mut to_scrub, t.detach_prefix(req(*r), PrefixKey(u64::from(*key)))),
                    Step::Evict(key) => keep(&mut to_scrub, t.evict_prefix(PrefixKey(u64::from(*key)))),
                    Step::Fork(parent, child) => {
                        let _ = t.fork(req(*parent), req(*child));
                    }
                    Step::ForceClaim(r, pages) => {
                        t.force_claim(req(*r), &raw(pages));
                    }
                    Step::ForceRelease(pages) => {
                        t.force_release_pages(&raw(pages));
                    }
                    Step::ForceEvict(key) => {
                        t.force_evict_prefix(PrefixKey(u64::from(*key)));
                    }
                    Step::Scrub => {
                        let _ = t.confirm_scrubbed(&std::mem::take(&mut to_scrub));
                    }
                    Step::Read(r, tokens, at, page) => {
                        let mut refs = view(&t, *r);
                        let state = t.state.read();
                        if let Some(entry) = refs.get_mut(*at as usize) {
                            let swap = PageId(u32::from(*page));
                            let generation =
                                state.tag(swap).map_or(entry.generation, |tag| crate::Generation(tag.generation));
                            *entry = PageRef { page: swap, generation };
                        }
                        let ids: Vec<PageId> = refs.iter().map(|r| r.page).collect();
                        let tokens = u64::from(*tokens) % (refs.len() as u64 * u64::from(PS) + 2);
                        prop_assert_eq!(
                            state.check_read(req(*r), &ids, tokens),
                            state.check_read_reference(req(*r), &ids, tokens)
                        );
                        prop_assert_eq!(
                            state.check_read(req(*r), &refs, tokens),
                            state.check_read_reference(req(*r), &refs, tokens)
                        );
                        // A ref from an older incarnation, where one is in the table.
                        if let Some(entry) = refs.get_mut(*at as usize) {
                            entry.generation = crate::Generation(entry.generation.0.saturating_sub(1));
                            prop_assert_eq!(
                                state.check_read(req(*r), &refs, tokens),
                                state.check_read_reference(req(*r), &refs, tokens)
                            );
                        }
                    }
                }
                in_sync(&t.state.read())?;
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

            /// Every change keeps each page's hot word equal to the word its tag gives, and a read
            /// checked through the hot words gets the verdict of the full check page by page.
            #[test]
            fn the_hot_path_agrees_with_the_reference_path(
                scrub in any::<bool>(),
                limit in prop_oneof![Just(3u32), Just(u32::MAX - 1)],
                steps in prop::collection::vec(step(), 1..120),
            ) {
                run(scrub, limit, &steps)?;
            }
        }
    }
}
