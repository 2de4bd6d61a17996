//! Read verification: every page an attention read goes through is checked against its tag.

use super::info::PageState;
use super::state::{BlockEntry, RequestRecord, TableState};
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
        for (i, &entry) in block_table[..full].iter().enumerate() {
            self.check_entry(rec, req, i, entry, self.page_size)?;
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
