//! A page's coverage: which token slots its current incarnation wrote (its hot word's FULL bit,
//! its tag's watermark and its bits of the coverage bitmap, as [`PageTag`](super::PageTag) says).

use super::TableState;
use crate::ids::PageId;

impl TableState {
    fn slot_range(&self, page: PageId, a: u32, b: u32) -> std::ops::Range<usize> {
        let base = page.0 as usize * self.page_size as usize;
        base + a as usize..base + b as usize
    }

    /// Slots `0..n` of `page` are all written by its current incarnation: `n` is the page size
    /// for a whole page (its [`HotWord`] FULL bit), else the watermark. The one way to read the
    /// watermark: a write of whole pages sets their FULL bits and leaves the field behind.
    ///
    /// [`HotWord`]: crate::table::hot::HotWord
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
}
