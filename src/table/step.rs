//! A decode step: the reads of all its sequences, and the verdict on them.

use crate::ids::{PageId, RequestId};
use crate::violation::Violation;

/// One sequence of a decode step: a request, its block table and how many tokens attention reads.
///
/// The block table holds page ids (`SeqRead<'_>`, for
/// [`check_step`](crate::OwnershipTable::check_step) and
/// [`verify_step`](crate::OwnershipTable::verify_step)) or page refs (`SeqRead<'_, PageRef>`, for
/// the `_refs` forms, which also refuse a page no longer in the incarnation named).
///
/// [`PageRef`]: crate::PageRef
#[derive(Clone, Copy, Debug)]
pub struct SeqRead<'a, E = PageId> {
    /// The reading request.
    pub request: RequestId,
    /// Its block table (in token order; entries past `tokens` are not read).
    pub block_table: &'a [E],
    /// Tokens read: `0..tokens`.
    pub tokens: u64,
}

/// The slot-mapping entry that marks a padding token (vLLM's `PAD_SLOT_ID`): nothing is written.
pub const PADDING_SLOT: i64 = -1;

/// One sequence's KV writes in a step, as the engine's slot mapping gives them: one entry per
/// token written, `page * page_size + offset` (vLLM's `slot_mapping`, SGLang's `out_cache_loc`
/// with page size 1), [`PADDING_SLOT`] for padding.
#[derive(Clone, Copy, Debug)]
pub struct SeqWrite<'a> {
    /// The writing request.
    pub request: RequestId,
    /// Its slots, in token order.
    pub slots: &'a [i64],
}

/// One request's pages opened in a step, as the engine's allocator handed them out (shadow
/// mode): for [`claim_step`](crate::OwnershipTable::claim_step).
#[derive(Clone, Copy, Debug)]
pub struct SeqClaim<'a> {
    /// The claiming request.
    pub request: RequestId,
    /// The pages its allocator gave it this step.
    pub pages: &'a [PageId],
}

/// The verdict on a step: which sequences may not run attention (reads), or whose writes were
/// refused and not recorded (writes).
#[derive(Debug, Default)]
pub struct StepVerdict {
    /// `(index into the step, violation)` for every refused sequence, in step order.
    pub refused: Vec<(usize, Violation)>,
}

impl StepVerdict {
    /// No sequence was refused.
    pub fn is_clean(&self) -> bool {
        self.refused.is_empty()
    }
}
