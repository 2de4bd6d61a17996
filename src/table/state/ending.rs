//! The end of pages' incarnations (a release, a preemption, a prefix nobody holds): each page's
//! generation bumped or the page retired, its coverage cleared, and the page back on the free
//! list or held for a scrub.

use super::TableState;
use super::tag::PageTag;
use crate::ids::{Generation, PageId, PageRef};
use crate::table::hot::HotWord;
use crate::table::info::{PageState, Released};
use crate::table::mirror::ChangedPages;

impl TableState {
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
    /// [`pages_marked`](super::RequestRecord::pages_marked) is the last take), so the loop need not.
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
