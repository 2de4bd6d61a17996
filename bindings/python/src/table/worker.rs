//! vLLM's worker step in one call (`record_and_verify_step`, `apply_record_and_verify_step`,
//! the binding's hottest call): the step's arrays opened and checked before any event is
//! applied (`StepArrays`), then the early events, the writes, the late events and the reads
//! through the core's `OwnershipTable::engine_step`, the GIL released once; the step's memory
//! kept for the next step (`StepRoom`), and the step's errors, built out of line.

use super::OwnershipTable;
use super::verdict::{StepVerdict, judged_verdict, resolved};
use crate::arrays::IntArray;
use crate::events::StepEvents;
use kvguard::RequestId;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

impl OwnershipTable {
    /// record_and_verify_step: the writes, `events`, the reads (no early events, a fresh room).
    #[inline]
    pub(super) fn record_and_verify(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        num_scheduled_tokens: &Bound<'_, PyAny>,
        events: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(StepVerdict, crate::events::RefusedForPython, StepVerdict)> {
        let step = StepArrays::open(req_ids, block_table, num_computed_tokens, num_scheduled_tokens)?;
        let late = StepEvents::read(events, &self.names)?;
        let (_, written, refused, read) =
            self.worker_step(py, &step, StepEvents::none(), late, &mut StepRoom::default())?;
        Ok((written, refused, read))
    }

    /// apply_record_and_verify_step: `early`, the writes, `late`, the reads, in this table's
    /// [`StepRoom`] when no other thread's step holds it.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_record_and_verify(
        &self,
        py: Python<'_>,
        early: Option<&Bound<'_, PyAny>>,
        req_ids: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        num_scheduled_tokens: &Bound<'_, PyAny>,
        late: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StepOutcome> {
        let mut room = self.step_room.try_lock().map(|mut r| std::mem::take(&mut *r)).unwrap_or_default();
        let early = StepEvents::read_in(early, &self.names, Some(&self.step_ids), std::mem::take(&mut room.early))?;
        let step = StepArrays::open(req_ids, block_table, num_computed_tokens, num_scheduled_tokens)?;
        // Late events name requests as they read after the early ones: read plain only when the
        // early ones rename nothing.
        let late = if early.renames() {
            StepEvents::Parsed(crate::events::parse_optional(late)?)
        } else {
            StepEvents::read_in(late, &self.names, Some(&self.step_ids), std::mem::take(&mut room.late))?
        };
        let outcome = self.worker_step(py, &step, early, late, &mut room);
        if let Some(mut kept) = self.step_room.try_lock() {
            *kept = room;
        }
        outcome
    }
}

/// The memory a worker step fills and lets go of (its events' batches, its request ids), kept
/// for the next step: a steady step allocates none of it (a fresh allocation of a step's size
/// is written cold, and costs the allocator's own work besides). Taken whole at a step's start
/// and given back at its end; a step that raises, or runs while another thread's step holds
/// it, makes its own.
#[derive(Default)]
pub(super) struct StepRoom {
    early: kvguard::step::EventBatch,
    late: kvguard::step::EventBatch,
    requests: Vec<RequestId>,
}

/// What apply_record_and_verify_step returns: (refused early events, writes, refused late
/// events, reads).
pub(super) type StepOutcome =
    (crate::events::RefusedForPython, StepVerdict, crate::events::RefusedForPython, StepVerdict);

/// A worker step's arrays, opened and checked (before any event is applied).
struct StepArrays<'a, 'py> {
    req_ids: &'a Bound<'py, PyAny>,
    /// Requests in the step (req_ids' length).
    n: usize,
    bt: IntArray<'a>,
    computed: crate::arrays::StepCounts<'a>,
    scheduled: crate::arrays::StepCounts<'a>,
}

impl<'a, 'py> StepArrays<'a, 'py> {
    fn open(
        req_ids: &'a Bound<'py, PyAny>,
        block_table: &'a Bound<'py, PyAny>,
        num_computed_tokens: &'a Bound<'py, PyAny>,
        num_scheduled_tokens: &'a Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let n = req_ids.len()?;
        let bt = IntArray::open(block_table, "block_table", 2)?;
        if bt.len() < n {
            return Err(too_few_rows(bt.len(), n));
        }
        let computed = crate::arrays::StepCounts::open(num_computed_tokens, "num_computed_tokens", n)?;
        let scheduled = crate::arrays::StepCounts::open(num_scheduled_tokens, "num_scheduled_tokens", n)?;
        Ok(StepArrays { req_ids, n, bt, computed, scheduled })
    }

    /// The computed and scheduled counts, for the core's step.
    fn counts(&self) -> PyResult<(kvguard::step::Counts<'_>, kvguard::step::Counts<'_>)> {
        Ok((self.computed.counts("num_computed_tokens")?, self.scheduled.counts("num_scheduled_tokens")?))
    }
}

/// [`StepArrays::open`]'s error for a block table shorter than the step.
#[cold]
#[inline(never)]
fn too_few_rows(rows: usize, n: usize) -> PyErr {
    PyValueError::new_err(format!("block_table has {rows} rows, {n} requests given"))
}

impl OwnershipTable {
    /// The early events, the writes, the late events and the reads of a worker step, in that
    /// order, through the core's `OwnershipTable::engine_step` (the rows judged incrementally,
    /// with this table's row cache). A decode step (no event admits or releases a request) is
    /// one core call with the GIL released once; otherwise the early events are applied first
    /// and the requests read after them (as they read then), and late events that rename go
    /// through the core's parts one by one. Every array is checked before any event is applied.
    fn worker_step(
        &self,
        py: Python<'_>,
        step: &StepArrays<'_, '_>,
        early: StepEvents,
        late: StepEvents,
        room: &mut StepRoom,
    ) -> PyResult<StepOutcome> {
        let n = step.n;
        let (table, names) = (&self.table, &self.names);
        let mut converted = Vec::new();
        let (computed, scheduled) = step.counts()?;
        let rows = step_rows(&step.bt, n, computed, scheduled, table.config(), &mut converted)?;
        // The step's shape, checked before anything is applied (nothing built: the core's step
        // builds its slot mapping once).
        kvguard::step::StepSlots::check(rows, computed, scheduled, table.config()).map_err(step_error)?;
        let renaming_early = early.renames();
        let mut requests = std::mem::take(&mut room.requests);
        if renaming_early {
            // Every req_ids entry checked (an int in 0..2**63 or a str) before the early events
            // change anything; read again after them, as the requests read then.
            self.step_requests_into(step.req_ids, &mut requests)?;
            check_request_count(&requests, n)?;
        }
        let refused_early = if renaming_early {
            let applied = py.detach(|| early.apply(table, names));
            Some(self.refused_events(py, applied)?)
        } else {
            None
        };
        self.step_requests_into(step.req_ids, &mut requests)?;
        check_request_count(&requests, n)?;
        if late.renames() {
            let refused_early = match refused_early {
                Some(r) => r,
                None => {
                    let applied = py.detach(|| early.apply(table, names));
                    self.refused_events(py, applied)?
                }
            };
            let StepEvents::Parsed(late) = late else {
                return Err(pyo3::exceptions::PyRuntimeError::new_err("kvguard: renaming events read as a batch"));
            };
            return self.worker_step_renaming_late(py, step, rows, &requests, late, refused_early);
        }
        let (early_batch, late_batch) = {
            let n = names.lock();
            let early = if renaming_early { Some(kvguard::step::EventBatch::new()) } else { early.batch(&n) };
            (early, late.batch(&n))
        };
        // Neither renames here (checked above): each is a batch.
        let (Some(early_batch), Some(late_batch)) = (early_batch, late_batch) else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "kvguard: a renaming event reached the one-call step",
            ));
        };
        let core_step = kvguard::step::EngineStep {
            early: early_batch.events(),
            requests: &requests,
            rows,
            computed,
            scheduled,
            late: late_batch.events(),
        };
        let worker_rows = &self.worker_rows;
        let (outcome, early, written, late, read) = py.detach(|| {
            // Another thread's step holds the cache: a fresh one checks every row in full, with
            // the same verdict.
            let mut spare = kvguard::RowCache::new();
            let mut held = worker_rows.try_lock();
            let cache = held.as_deref_mut().unwrap_or(&mut spare);
            match table.engine_step(cache, &core_step) {
                Err(e) => (Err(e), Ok(Vec::new()), Vec::new(), Ok(Vec::new()), Vec::new()),
                Ok(o) => {
                    let early = crate::events::resolve_applied(names, o.early);
                    let written = resolved(names, o.writes.unwrap_or_default());
                    let late = crate::events::resolve_applied(names, o.late);
                    let read = resolved(names, o.reads.unwrap_or_default());
                    (Ok(()), early, written, late, read)
                }
            }
        });
        // The room back for the next step (the core step borrowed it).
        (room.early, room.late, room.requests) = (early_batch, late_batch, requests);
        outcome.map_err(step_error)?;
        let refused_early = match refused_early {
            Some(r) => r,
            None => self.refused_events(py, early)?,
        };
        let written = judged_verdict(py, written, n)?;
        let refused_late = self.refused_events(py, late)?;
        let read = judged_verdict(py, read, n)?;
        Ok((refused_early, written, refused_late, read))
    }

    /// The rest of a worker step whose late events admit or release requests: the writes, the
    /// late events, then the reads by the requests as they read after them, each through its
    /// core call.
    fn worker_step_renaming_late(
        &self,
        py: Python<'_>,
        step: &StepArrays<'_, '_>,
        rows: kvguard::BlockRows<'_>,
        requests: &[RequestId],
        late: Vec<crate::events::Event>,
        refused_early: crate::events::RefusedForPython,
    ) -> PyResult<StepOutcome> {
        let (table, names, n) = (&self.table, &self.names, step.n);
        let (computed, scheduled) = step.counts()?;
        let slots =
            kvguard::step::StepSlots::from_rows(rows, computed, scheduled, table.config()).map_err(step_error)?;
        let (written, applied_late) = py.detach(|| {
            let written = resolved(names, table.record_step_writes(&slots.writes(requests)));
            (written, crate::events::apply(table, names, &late))
        });
        let written = judged_verdict(py, written, n)?;
        let refused_late = self.refused_events(py, applied_late)?;
        let requests = self.step_requests(step.req_ids)?;
        check_request_count(&requests, n)?;
        let reads: Vec<kvguard::RowRead> = requests
            .iter()
            .enumerate()
            .map(|(i, &request)| kvguard::RowRead {
                request,
                row: i as u32,
                tokens: computed.get(i).saturating_add(scheduled.get(i)),
            })
            .collect();
        let worker_rows = &self.worker_rows;
        let read = py.detach(|| {
            let mut spare = kvguard::RowCache::new();
            let mut held = worker_rows.try_lock();
            let cache = held.as_deref_mut().unwrap_or(&mut spare);
            table.verify_rows(cache, rows, &reads).map(|v| resolved(names, v))
        });
        let read = judged_verdict(py, read.map_err(|e| PyValueError::new_err(e.to_string()))?, n)?;
        Ok((refused_early, written, refused_late, read))
    }
}

/// A worker step's block table as the core reads it: a C-contiguous int32 table in place
/// (vLLM's `block_table.np`); any other, its first `n` rows converted into `converted`, only the
/// columns the step writes or reads (an entry outside `0..2**31` becomes -1, a page past any
/// pool; a table of width 0, one column of -1). At most the pool's pages and one more are
/// converted a row: a row whose step reaches
/// past them (its tokens could never be the pool's) is converted as -1 throughout, so each of
/// its writes and its read is refused as out of range, never recorded on a page it did not name.
fn step_rows<'a>(
    bt: &'a IntArray<'_>,
    n: usize,
    computed: kvguard::step::Counts<'_>,
    scheduled: kvguard::step::Counts<'_>,
    config: &kvguard::PoolConfig,
    converted: &'a mut Vec<i32>,
) -> PyResult<kvguard::BlockRows<'a>> {
    if let Some((entries, width)) = bt.as_i32_rows().filter(|(_, width)| *width > 0) {
        return kvguard::BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(e.to_string()));
    }
    let div = kvguard::config::PageDiv::new(config.page_size);
    let needs: Vec<u64> = (0..n).map(|i| div.ceil(computed.get(i).saturating_add(scheduled.get(i)))).collect();
    let cap = u64::from(config.num_pages) + 1;
    let most = needs.iter().copied().max().unwrap_or(0);
    // A table of width 0 names no page: one column of -1 stands for it.
    let width = ((bt.width() as u64).min(cap).min(most) as usize).max(1);
    converted.reserve(n.saturating_mul(width));
    for (i, &need) in needs.iter().enumerate() {
        if bt.width() == 0 || (need > width as u64 && width < bt.width()) {
            converted.extend(std::iter::repeat_n(-1, width));
        } else {
            converted.extend((0..width).map(|j| i32::try_from(bt.get(i, j)).unwrap_or(-1)));
        }
    }
    kvguard::BlockRows::new(converted, width).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A step the core could not judge, as the worker step's arguments name it (nothing applied).
/// Out of line, as every error of the step's path: the step's own code stays together.
#[cold]
#[inline(never)]
pub(super) fn step_error(e: kvguard::step::StepError) -> PyErr {
    use kvguard::step::StepError;
    PyValueError::new_err(match e {
        StepError::TooManyTokens { index, tokens, most } => format!(
            "num_scheduled_tokens[{index}] is {tokens}: a block table row addresses at most {most} tokens \
             (its width, or the pool's pages, times the page size)"
        ),
        StepError::PoolSlots { tokens, slots } => {
            format!("the step schedules {tokens} tokens: more than the pool's {slots} slots")
        }
        StepError::Overflow { index, computed, scheduled } => {
            format!("num_computed_tokens[{index}] + num_scheduled_tokens[{index}] = {computed} + {scheduled} overflows")
        }
        other => other.to_string(),
    })
}

/// req_ids read as many requests as it had when the step's arrays were checked.
#[inline]
fn check_request_count(requests: &[RequestId], n: usize) -> PyResult<()> {
    if requests.len() != n {
        return Err(request_count_changed(n, requests.len()));
    }
    Ok(())
}

/// [`check_request_count`]'s error.
#[cold]
#[inline(never)]
fn request_count_changed(then: usize, now: usize) -> PyErr {
    PyValueError::new_err(format!("req_ids changed while it was read ({then} then {now})"))
}
