//! A decode step's writes and reads under one lock: each request writes one slot (its new
//! token), then reads a few pages (the window its engine has not checked yet). What
//! [`decode_forward`](crate::OwnershipTable::decode_forward) stands on.

use super::ownership::OwnershipTable;
use super::state::{BlockEntry, TableState};
use super::step::{SeqRead, StepVerdict};
use crate::error::Error;
use crate::ids::{PageId, RequestId};

impl OwnershipTable {
    /// `writers[i]` writes slot `slots[i]` (one each, as long as each other: the caller checked),
    /// recorded as [`record_step_writes`](Self::record_step_writes) records them (judged); then,
    /// if every write was recorded, `reads` checked as [`check_step`](Self::check_step) checks
    /// them (pure), under the same lock. The reads' verdict is `None` when a write was refused.
    pub(crate) fn decode_writes_then_reads<E: BlockEntry>(
        &self,
        writers: &[RequestId],
        slots: &[i64],
        reads: &[SeqRead<'_, E>],
    ) -> (StepVerdict, Option<StepVerdict>) {
        self.decode_writes_then(writers.iter().copied(), slots, |state| {
            let mut read = StepVerdict::default();
            for (i, r) in reads.iter().enumerate() {
                // A window of one page its reader owns (the page its write just went to): judged
                // from the page's words, the full check only where they do not say clean.
                if let [entry] = *r.block_table
                    && state.reads_own_page(r.request, entry, r.tokens)
                {
                    continue;
                }
                if let Err(v) = state.check_read(r.request, r.block_table, r.tokens) {
                    read.refused.push((i, v));
                }
            }
            read
        })
    }

    /// [`decode_writes_then_reads`](Self::decode_writes_then_reads) where each read is a window of
    /// one page: writer `windows[i].2` wrote `slots[i]` and reads `windows[i]`'s page, its first
    /// `windows[i].1` tokens. The same verdicts, without a read list made first (a decode step of
    /// 256 rows at page size 16 gathered 17 KiB of them, which a step touched besides the engine's
    /// own memory).
    pub(crate) fn decode_writes_then_one_page_reads(
        &self,
        windows: &[(PageId, u32, RequestId)],
        slots: &[i64],
    ) -> (StepVerdict, Option<StepVerdict>) {
        self.decode_writes_then(windows.iter().map(|w| w.2), slots, |state| {
            let mut read = StepVerdict::default();
            for (i, &(page, tokens, req)) in windows.iter().enumerate() {
                let tokens = u64::from(tokens);
                if state.reads_own_page(req, page, tokens) {
                    continue;
                }
                if let Err(v) = state.check_read(req, std::slice::from_ref(&page), tokens) {
                    read.refused.push((i, v));
                }
            }
            read
        })
    }

    /// The writes of a decode step recorded (judged), then, if all were, `reads` run on the
    /// table under the same lock.
    #[inline(always)]
    fn decode_writes_then(
        &self,
        writers: impl Iterator<Item = RequestId>,
        slots: &[i64],
        reads: impl FnOnce(&TableState) -> StepVerdict,
    ) -> (StepVerdict, Option<StepVerdict>) {
        let mut state = self.state.write();
        let mut written = StepVerdict::default();
        for (i, (req, slot)) in writers.zip(slots).enumerate() {
            if let Err(Error::Violation(v)) = state.record_slot_writes(req, std::slice::from_ref(slot)) {
                self.note(&state, &v);
                written.refused.push((i, v));
            }
        }
        if !written.is_clean() {
            return (written, None);
        }
        let read = reads(&state);
        (written, Some(read))
    }

    /// Reads through int32 page ids in place (a token-slot table at page size 1, where each
    /// entry is its own page), as [`check_step`](Self::check_step) (or, `judged`,
    /// [`verify_step`](Self::verify_step)) reads page ids: a negative entry names no page.
    pub(crate) fn step_of_entries(&self, reads: &[SeqRead<'_, i32>], judged: bool) -> StepVerdict {
        self.step(reads, judged)
    }
}
