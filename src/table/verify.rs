//! Read verification: every page an attention read goes through is checked against its tag.

use super::hot::HotWord;
use super::info::PageState;
use super::state::{BlockEntry, PageTag, RequestRecord, TableState};
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
/// `hot` ends with [`HotWord::PAST_THE_POOL`], which no page's word equals: a page id past the
/// pool is clamped onto it (a conditional move, not a branch). Eight entries are checked at a
/// time, their mismatches ORed together, so a clean read costs one branch per eight pages and
/// one eighth of a cache line per page; the first chunk with a mismatch is then scanned page by
/// page for where the run ends. Page refs also compare the generation in the page's tag.
#[inline(never)]
fn hot_run<E: BlockEntry>(hot: &[HotWord], tags: &[PageTag], entries: &[E], expected: HotWord) -> usize {
    let Some(past) = hot.len().checked_sub(1) else { return 0 };
    // Non-zero when `entry` is not a page of the run.
    let mismatch = |entry: E| {
        let page = entry.page().0 as usize;
        let stale = entry.generation().is_some_and(|g| tags.get(page).is_none_or(|tag| tag.generation != g.0));
        hot[page.min(past)].differs(expected) | u64::from(stale)
    };
    const CHUNK: usize = 8;
    let mut done = 0;
    for chunk in entries.as_chunks::<CHUNK>().0 {
        if chunk.iter().fold(0, |any, &entry| any | mismatch(entry)) != 0 {
            break;
        }
        done += CHUNK;
    }
    done + entries[done..].iter().position(|&entry| mismatch(entry) != 0).unwrap_or(entries.len() - done)
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
}
