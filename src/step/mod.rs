//! An engine's step in one call: the ownership events its scheduler decided, the KV writes its
//! slot mapping makes, and the reads attention makes through its block table, judged in that
//! order against the [`OwnershipTable`], the rows incrementally ([`RowCache`]).
//!
//! What every binding calls (Python's `OwnershipTable.apply_record_and_verify_step`, C's
//! `kvg_engine_step`) and what a Rust engine calls directly. The parts stand alone too:
//! [`Events`] / [`EventBatch`] with [`OwnershipTable::apply_events`], [`StepSlots`] with
//! [`OwnershipTable::record_step_writes`], [`BlockRows`] with [`OwnershipTable::verify_rows`].
//! An engine whose table holds token slots rather than page ids (SGLang's `req_to_token`) reads
//! through [`OwnershipTable::check_slot_rows`] and runs a decode forward as one
//! [`OwnershipTable::decode_forward`] ([`DecodeForward`]); its plugin's mirror of the pool
//! ([`PoolMirror`]) says which pages a decode step's row write claims
//! ([`OwnershipTable::write_decode_rows`]).
//!
//! ```
//! use kvguard::step::{EngineStep, EventBatch, Events};
//! use kvguard::{BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, RowCache, TenantId};
//! let table = OwnershipTable::new(PoolConfig::new(64, 16, 512))?;
//! let mut cache = RowCache::new();
//! let (a, b) = (RequestId(1), RequestId(2));
//! // Step 1: both admitted, each given two pages, each prefilling 20 tokens.
//! let mut early = EventBatch::new();
//! early.admit(a, TenantId(1), 20, 8).admit(b, TenantId(2), 20, 8);
//! early.claim(a, &[PageId(3), PageId(4)]).claim(b, &[PageId(5), PageId(6)]);
//! let block_table = [3, 4, 5, 6]; // the engine's int32 rows: row 0 is a's, row 1 is b's
//! let step = EngineStep {
//!     early: early.events(),
//!     requests: &[a, b],
//!     rows: BlockRows::new(&block_table, 2)?,
//!     computed: (&[0, 0]).into(),
//!     scheduled: (&[20, 20]).into(),
//!     late: Events::none(),
//! };
//! let outcome = table.engine_step(&mut cache, &step)?;
//! assert!(outcome.is_clean());
//! // Step 2: a decode token each, and b's row names a's page: b may not run attention.
//! let block_table = [3, 4, 5, 4];
//! let step = EngineStep {
//!     early: Events::none(),
//!     rows: BlockRows::new(&block_table, 2)?,
//!     computed: (&[20, 20]).into(),
//!     scheduled: (&[1, 1]).into(),
//!     ..step
//! };
//! let outcome = table.engine_step(&mut cache, &step)?;
//! let reads = outcome.reads.expect("the events all applied");
//! assert_eq!(reads.refused.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod counts;
mod events;
mod mirror;
mod slot_rows;
mod writes;

pub use counts::{Counts, CountsIter, NegativeCount};
pub use events::{AppliedEvents, Event, EventBatch, EventKind, Events, EventsError};
pub use mirror::{
    DecodeClaim, DecodeRowWrite, DecodeWrites, Ints, IntsMut, MirrorError, PoolMirror, RowWriteOutcome, decode_writes,
};
pub use slot_rows::{DecodeForward, DecodeOutcome, SlotRead, SlotRowCache};
pub use writes::StepSlots;

use crate::ids::RequestId;
use crate::table::{BlockRows, OwnershipTable, RowCache, RowRead, RowsError, SeqWrite, StepVerdict};
use counts::Count;

/// One engine step: `early` events (admissions, claims, frees, preemptions, evictions the
/// scheduler decided before the forward), then the writes of `scheduled[i]` tokens from position
/// `computed[i]` through row `i` of `rows` by `requests[i]`, then `late` events (publishes of
/// blocks the step filled, prefix hits on them), then the reads: `requests[i]` reads its first
/// `computed[i] + scheduled[i]` tokens through row `i`.
///
/// `requests`, `computed` and `scheduled` are as long as each other; `rows` has at least that
/// many rows (row `i` is `requests[i]`'s, as vLLM's persistent batch keeps them).
#[derive(Clone, Copy, Debug)]
pub struct EngineStep<'a> {
    /// Events before the forward.
    pub early: Events<'a>,
    /// The step's requests, in row order.
    pub requests: &'a [RequestId],
    /// The block table attention reads (vLLM's `block_table.np`), in place.
    pub rows: BlockRows<'a>,
    /// Tokens each request had before the step (the engine's own array, read in place).
    pub computed: Counts<'a>,
    /// Tokens each request writes this step.
    pub scheduled: Counts<'a>,
    /// Events after the writes, before the reads.
    pub late: Events<'a>,
}

/// Why a step could not be judged: nothing was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// `computed` or `scheduled` is not as long as `requests`, or the block table has fewer rows.
    #[error(
        "a step of {requests} requests has {computed} computed counts, {scheduled} scheduled counts and {rows} rows"
    )]
    Shape {
        /// Entries of `requests`.
        requests: usize,
        /// Entries of `computed`.
        computed: usize,
        /// Entries of `scheduled`.
        scheduled: usize,
        /// Rows of the block table.
        rows: usize,
    },
    /// A request writes more tokens than its row (or the pool) can address.
    #[error("request {index} writes {tokens} tokens: a row addresses at most {most}")]
    TooManyTokens {
        /// The request's index in the step.
        index: usize,
        /// Tokens it writes.
        tokens: u64,
        /// The most a row addresses (its width, or the pool's pages, times the page size).
        most: u64,
    },
    /// The step writes more tokens than the pool has slots.
    #[error("the step writes {tokens} tokens: more than the pool's {slots} slots")]
    PoolSlots {
        /// Tokens written.
        tokens: u64,
        /// Slots in the pool.
        slots: u64,
    },
    /// A position overflows: `computed[index] + scheduled[index]` is past `u64`.
    #[error("request {index}: {computed} computed + {scheduled} scheduled tokens overflow")]
    Overflow {
        /// The request's index in the step.
        index: usize,
        /// Its computed tokens.
        computed: u64,
        /// Its scheduled tokens.
        scheduled: u64,
    },
    /// A decode forward's slots are not one per read ([`DecodeForward`]).
    #[error("a decode forward of {reads} reads has {slots} slots: one each")]
    Slots {
        /// Reads in the step.
        reads: usize,
        /// Slots given.
        slots: usize,
    },
    /// The block table's rows could not be read.
    #[error(transparent)]
    Rows(#[from] RowsError),
}

/// What a step did: each stage's verdict, in order. A stage after an event that failed with an
/// error that is not a violation did not run (`None`): the step's attention must not run.
#[derive(Debug, Default)]
#[must_use]
pub struct StepOutcome {
    /// The early events.
    pub early: AppliedEvents,
    /// The writes (refused writes are not recorded): `None` if the early events stopped.
    pub writes: Option<StepVerdict>,
    /// The late events (empty if the early events stopped).
    pub late: AppliedEvents,
    /// The reads (rows refused may not run attention): `None` if an event stopped the step.
    pub reads: Option<StepVerdict>,
}

impl StepOutcome {
    /// Every stage ran, and nothing was refused.
    pub fn is_clean(&self) -> bool {
        self.early.refused.is_empty()
            && self.late.refused.is_empty()
            && self.early.completed()
            && self.late.completed()
            && self.writes.as_ref().is_some_and(StepVerdict::is_clean)
            && self.reads.as_ref().is_some_and(StepVerdict::is_clean)
    }
}

impl EngineStep<'_> {
    /// The shape checks, before anything is applied: `computed[i] + scheduled[i]` (request `i`'s
    /// tokens read) overflows for no `i`.
    fn check(&self) -> Result<(), StepError> {
        let n = self.requests.len();
        let rows_named = u32::try_from(n).is_ok();
        if self.computed.len() != n || self.scheduled.len() != n || self.rows.rows() < n || !rows_named {
            return Err(StepError::Shape {
                requests: n,
                computed: self.computed.len(),
                scheduled: self.scheduled.len(),
                rows: self.rows.rows(),
            });
        }
        let overflow = counts::with_count_slices!(self.computed, self.scheduled, |c, s| {
            c.iter().zip(s).position(|(c, s)| c.count().checked_add(s.count()).is_none())
        });
        match overflow {
            Some(index) => Err(StepError::Overflow {
                index,
                computed: self.computed.get(index),
                scheduled: self.scheduled.get(index),
            }),
            None => Ok(()),
        }
    }
}

impl OwnershipTable {
    /// One engine step ([`EngineStep`]): the early events, the writes, the late events, the
    /// reads, each judged as its own call judges it ([`apply_events`](Self::apply_events),
    /// [`record_step_writes`](Self::record_step_writes), [`verify_rows`](Self::verify_rows)
    /// with `cache`). A [`StepError`] (the step's shape) is found before anything is applied.
    pub fn engine_step(&self, cache: &mut RowCache, step: &EngineStep<'_>) -> Result<StepOutcome, StepError> {
        step.check()?;
        // The slot mapping in the room the cache kept from the step before (given back below;
        // a step that stops early leaves it to be made again).
        let mut slots = StepSlots::in_room(std::mem::take(&mut cache.step_room));
        slots.fill_from_rows(step.rows, step.computed, step.scheduled, self.config())?;
        let mut outcome = StepOutcome { early: self.apply_events(step.early), ..StepOutcome::default() };
        if !outcome.early.completed() {
            return Ok(outcome);
        }
        // Each write and each read made as it is judged, not listed first: a list of them is
        // memory the step would write cold and read back (what a step costs an engine is the
        // lines it touches, more than its instructions).
        let requests = step.requests;
        outcome.writes =
            Some(self.record_writes_by(requests.len(), |i| SeqWrite { request: requests[i], slots: slots.of(i) }));
        outcome.late = self.apply_events(step.late);
        if !outcome.late.completed() {
            return Ok(outcome);
        }
        // Row `i` is request `i`'s; its tokens do not overflow (checked).
        let (computed, scheduled) = (step.computed, step.scheduled);
        let read =
            |i: usize| RowRead { request: requests[i], row: i as u32, tokens: computed.get(i) + scheduled.get(i) };
        outcome.reads = Some(self.rows_by(cache, step.rows, requests.len(), read, true)?);
        cache.step_room = slots.into_room();
        Ok(outcome)
    }
}
