//! Hot words: what a read of a whole page checks, packed in 8 bytes per page beside the tags, so
//! read verification touches one cache line per eight pages.

use super::info::PageState;

/// What a read of a whole page checks, in 8 bytes: its holder's dense index (an owned page: its
/// owner's [`RequestRecord::slot`](super::state::RequestRecord::slot); a shared page: its prefix's
/// [`PrefixSlot::index`](super::state::PrefixSlot::index)), its state,
/// and whether every slot is written. One cache line holds the words of eight pages, where it held
/// under three tags.
///
/// A live holder's index is unique among live holders of its kind, and an owned (shared) page's
/// owner (prefix) is always live, so two owned or shared pages whose words are equal have the
/// same holder. A read that passed the full check on one whole page may therefore read any other
/// page whose word equals that page's: `check_read` compares words and runs the full check only
/// where one differs. Every change to a tag's state or holder updates the word with it
/// (`hot_word_of` derives it from scratch, for the tests). A page that is neither owned nor
/// shared keeps holder 0.
///
/// The FULL bit is the one record that every slot is written: a write of whole pages sets it
/// alone and leaves the tag's watermark behind (read the written prefix through
/// `TableState::written_prefix`). A watermark that reaches the page's end sets it too, and only
/// the end of an incarnation clears it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct HotWord(u64);

impl HotWord {
    /// Zero exactly when `self` equals `other`: mismatches of several pages OR together into one
    /// test.
    #[inline(always)]
    pub fn differs(self, other: HotWord) -> u64 {
        self.0 ^ other.0
    }
    /// A [`differs`](Self::differs) value (or several ORed together, or with other bits below
    /// FULL) without the FULL bit: zero exactly when the words differ in nothing else.
    #[inline(always)]
    pub fn but_full(difference: u64) -> u64 {
        difference & !Self::FULL
    }
}

impl HotWord {
    const STATE_SHIFT: u32 = 32;
    const FULL: u64 = 1 << 40;
    /// The word after the last page's, which the read check compares for any page id past the
    /// pool: no page's word equals it (a page's word has no bit above `FULL` set), so that check
    /// needs no range test of its own.
    pub const PAST_THE_POOL: HotWord = HotWord(u64::MAX);

    /// The word of a page held by `holder` (a dense index) in `state`, whole (`full`) or not.
    #[inline(always)]
    pub fn new(holder: u32, state: PageState, full: bool) -> HotWord {
        HotWord(u64::from(holder) | (state as u64) << Self::STATE_SHIFT | if full { Self::FULL } else { 0 })
    }
    /// A page that nobody holds, in `state`, with nothing written.
    #[inline(always)]
    pub fn unheld(state: PageState) -> HotWord {
        HotWord::new(0, state, false)
    }
    /// The same word in `state`: its holder kept if the page is still held, dropped if not.
    #[inline(always)]
    pub fn with_state(self, state: PageState) -> HotWord {
        match state {
            PageState::Owned | PageState::Shared => {
                HotWord((self.0 & !(0xff << Self::STATE_SHIFT)) | (state as u64) << Self::STATE_SHIFT)
            }
            _ => HotWord::new(0, state, self.is_full()),
        }
    }
    /// The holder's dense index: 0 for a page nobody holds.
    #[inline(always)]
    pub fn holder(self) -> u32 {
        self.0 as u32
    }
    /// The page is owned or shared (its holder is live).
    #[inline(always)]
    pub fn is_held(self) -> bool {
        PageState::held_bits((self.0 >> Self::STATE_SHIFT) as u8)
    }
    /// Every slot of the page is written.
    #[inline(always)]
    pub fn is_full(self) -> bool {
        self.0 & Self::FULL != 0
    }
    /// The same word with every slot written, or not.
    #[inline(always)]
    pub fn with_full(self, full: bool) -> HotWord {
        HotWord((self.0 & !Self::FULL) | if full { Self::FULL } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use crate::table::info::PageState;
    use crate::table::state::{PageTag, RequestEpochs, TableState};
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
            3 => (r(), 0u8..4, 0u8..6).prop_map(|(a, b, c)| Step::Publish(a, b, c)),
            3 => (r(), 0u8..4).prop_map(|(a, b)| Step::Attach(a, b)),
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
        let own = state.requests.owned_pages(rec, &state.tags);
        let pages = own.iter().chain(held.flat_map(|prefix| prefix.pages.iter()));
        pages.map(|&page| state.page_ref(page)).collect()
    }

    fn in_sync(state: &TableState) -> Result<(), TestCaseError> {
        for p in 0..state.tags.len() as u32 {
            let page = PageId(p);
            prop_assert_eq!(state.hot[p as usize], state.hot_word_of(page), "page {}", p);
            // A one-page read judged through the tag's owner slot hint is judged as through the
            // hot word, by every request, written or not that far; and a hint taken names the
            // slot the hot word does.
            let tag = state.tags[p as usize];
            for r in (0..6).map(req).chain([tag.owner()]) {
                for tokens in [1, PS / 2, PS, PS + 1] {
                    let tokens = u64::from(tokens);
                    prop_assert_eq!(
                        state.reads_own_page(r, page, tokens),
                        state.reads_own_page_by_hot(r, page, tokens),
                        "page {} read by {:?} for {} tokens",
                        p,
                        r,
                        tokens
                    );
                }
            }
            if tag.state() == PageState::Owned
                && let Some(slot) = tag.owner_slot_hint()
                && state.epochs.word_of(slot, tag.owner()).is_some_and(|w| w != RequestEpochs::VACANT)
            {
                prop_assert_eq!(slot, state.hot[p as usize].holder(), "page {}'s hint", p);
            }
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
            let state = t.state.read();
            state.requests.get(&req(r)).map(|rec| state.requests.owned_pages(rec, &state.tags)).unwrap_or_default()
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
                    let tokens = start..start + u64::from(*len % 24);
                    let before = t.state.read().hot.clone();
                    if t.record_write_tokens(req(*r), &bt, tokens.clone()).is_err() {
                        // All or nothing: a refused write (whole pages' FULL bits included)
                        // leaves every word as it was.
                        prop_assert_eq!(&t.state.read().hot, &before);
                    } else {
                        // Every page the write covers whole reads whole, however its watermark
                        // lags behind its FULL bit.
                        let state = t.state.read();
                        let whole = tokens.start.div_ceil(u64::from(PS))..tokens.end / u64::from(PS);
                        for b in whole {
                            let page = bt[b as usize];
                            prop_assert_eq!(state.written_prefix(page), PS, "page {}", page.0);
                            prop_assert_eq!(state.written_slots(page), PS, "page {}", page.0);
                        }
                    }
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
                            state.tag(swap).map_or(entry.generation, |tag| crate::Generation(tag.generation()));
                        *entry = PageRef { page: swap, generation };
                    }
                    let ids: Vec<PageId> = refs.iter().map(|r| r.page).collect();
                    // The whole view too: every page a full one, the swapped one included.
                    let whole = refs.len() as u64 * u64::from(PS);
                    prop_assert_eq!(
                        state.check_read(req(*r), &ids, whole),
                        state.check_read_reference(req(*r), &ids, whole)
                    );
                    let tokens = u64::from(*tokens) % (whole + 2);
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

    /// A page's owner slot hint is a hint: one naming another request's slot (no change the
    /// table makes leaves one so; here it is written by hand) is not taken, and the read is
    /// judged through the hot word: a quarantined owner still reads nothing.
    #[test]
    fn an_owner_slot_hint_naming_another_requests_slot_is_not_taken() {
        let t = OwnershipTable::new(PoolConfig::new(PAGES, PS, 16)).expect("a small pool");
        let (a, b) = (req(0), req(1));
        t.admit(a, TenantId(1), 4, 4).unwrap();
        t.admit(b, TenantId(2), 4, 4).unwrap();
        let page = t.allocate(a, 1).unwrap()[0].page;
        t.record_write(a, page, 0..PS).unwrap();
        let mut state = t.state.write();
        let slot = |r| state.requests.get(&r).map(|rec| rec.slot).unwrap();
        let (slot_a, slot_b) = (slot(a), slot(b));
        assert_eq!(state.tags[page.0 as usize].owner_slot_hint(), Some(slot_a), "the table sets it");
        assert!(state.reads_own_page(a, page, u64::from(PS)));
        state.quarantine(state.requests.get(&a).unwrap());
        let tag = &mut state.tags[page.0 as usize];
        tag.set_place(PageTag::place_with_slot(tag.place(), slot_b));
        assert!(!state.reads_own_page(a, page, u64::from(PS)), "b's slot is not a's: its word is not taken");
        assert_eq!(state.reads_own_page(a, page, u64::from(PS)), state.reads_own_page_by_hot(a, page, u64::from(PS)));
    }
}
