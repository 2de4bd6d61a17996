//! An engine's whole step in one call (`kvg_engine_step`: the core's `OwnershipTable::engine_step`)
//! and a step's ownership events as one batch of columns (`kvg_apply_events`).

use crate::raw;
use crate::rows::{kvg_row_cache, with_cache};
use crate::status::{Failure, core_status, kvg_status};
use crate::table::{kvg_table, with_table};
use kvguard::step::{AppliedEvents, EngineStep, EventKind, Events};
use kvguard::{BlockRows, RequestId, Violation};

/// `kvg_events.kinds` entries: what an event does (the core's `kvguard::step::EventKind`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvg_event_kind {
    /// `kvg_admit`: `requests[i]`, tenant `keys[i]`, `args[2i]` prompt tokens, `args[2i+1]` max
    /// new tokens.
    Admit = 1,
    /// `kvg_claim` (shadow mode): `requests[i]` claims `pages[args[2i]..args[2i+1]]`.
    Claim = 2,
    /// `kvg_release`: `requests[i]`.
    Release = 3,
    /// `kvg_preempt`: `requests[i]`.
    Preempt = 4,
    /// Not in a batch: a publish goes through `kvg_publish_prefix` (byte-string keys).
    Publish = 5,
    /// Not in a batch: `kvg_attach_prefix`.
    Attach = 6,
    /// Not in a batch: `kvg_detach_prefix`.
    Detach = 7,
    /// Not in a batch: `kvg_evict_prefix`.
    Evict = 8,
    /// `kvg_release_pages`: `requests[i]` lets go of `pages[args[2i]..args[2i+1]]`, keeps the rest.
    ReleasePages = 9,
}

/// A step's ownership events as columns: event `i` is `kinds[i]` (a `kvg_event_kind`) with
/// `requests[i]`, `keys[i]` (an admission's tenant; 0 otherwise) and `args[2i]`, `args[2i+1]`
/// (an admission's token counts; otherwise the event's range of `pages`). Admissions, claims,
/// releases, preemptions and partial releases: prefix events name their prefixes by byte
/// strings, which the `kvg_*_prefix` calls intern, and are refused here
/// (`KVG_STATUS_INVALID_ARGUMENT`, nothing applied). `len` 0 needs no pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvg_events {
    /// Events.
    pub len: usize,
    /// `len` bytes: each a `kvg_event_kind`.
    pub kinds: *const u8,
    /// `len` request ids.
    pub requests: *const u64,
    /// `len` keys.
    pub keys: *const u64,
    /// `2 * len` arguments.
    pub args: *const u64,
    /// The pages the events' ranges index, as engines keep them (`int32_t`; negative: no page).
    pub pages: *const i32,
    /// Entries of `pages`.
    pub pages_len: usize,
}

/// One engine step for `kvg_engine_step`: the `early` events, then the writes of
/// `num_scheduled_tokens[i]` tokens from position `num_computed_tokens[i]` by `request_ids[i]`
/// through row `i` of `block_table` (its slot mapping: `row[min(p / page_size, width - 1)] *
/// page_size + p % page_size`), then the `late` events, then the reads: `request_ids[i]` reads
/// its first `num_computed_tokens[i] + num_scheduled_tokens[i]` tokens through row `i`.
/// `block_table` is `table_rows` rows of `width` page ids, row after row (at least `requests`
/// rows). The `refused_*` masks are NULL or as long as their stage (`early.len`, `requests`,
/// `late.len`, `requests`): 1 where that event, write or read was refused.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvg_step_input {
    /// `sizeof(kvg_step_input)` as the caller compiled it.
    pub struct_size: usize,
    /// Events before the forward.
    pub early: kvg_events,
    /// Events after the writes, before the reads.
    pub late: kvg_events,
    /// Requests in the step.
    pub requests: usize,
    /// `requests` ids, in row order.
    pub request_ids: *const u64,
    /// The block table attention reads, in place.
    pub block_table: *const i32,
    /// Its rows.
    pub table_rows: usize,
    /// Entries per row.
    pub width: usize,
    /// `requests` counts: tokens each request had before the step.
    pub num_computed_tokens: *const u64,
    /// `requests` counts: tokens each request writes this step.
    pub num_scheduled_tokens: *const u64,
    /// NULL or `early.len` bytes.
    pub refused_early: *mut u8,
    /// NULL or `requests` bytes.
    pub refused_writes: *mut u8,
    /// NULL or `late.len` bytes.
    pub refused_late: *mut u8,
    /// NULL or `requests` bytes.
    pub refused_reads: *mut u8,
}

// SAFETY: `#[repr(C)]`, the first field is `struct_size: usize`, and every field is an integer,
// a raw pointer or a struct of them, so every bit pattern is valid.
unsafe impl raw::SizedStruct for kvg_step_input {
    const MIN_SIZE: usize = size_of::<Self>();
}

/// The columns behind `e`, checked (lengths, kinds, page ranges).
fn columns<'a>(e: &kvg_events, what: &str) -> Result<Events<'a>, Failure> {
    if e.len == 0 {
        return Ok(Events::none());
    }
    let kinds = raw::slice(e.kinds, e.len, &format!("{what}.kinds"))?;
    let requests = raw::slice(e.requests, e.len, &format!("{what}.requests"))?;
    let keys = raw::slice(e.keys, e.len, &format!("{what}.keys"))?;
    let args_len = e.len.checked_mul(2).ok_or_else(|| Failure::invalid(format!("{what}.len {} overflows", e.len)))?;
    let (args, _) = raw::slice(e.args, args_len, &format!("{what}.args"))?.as_chunks::<2>();
    let pages = if e.pages_len == 0 { &[][..] } else { raw::slice(e.pages, e.pages_len, &format!("{what}.pages"))? };
    let prefix = [EventKind::Publish, EventKind::Attach, EventKind::Detach, EventKind::Evict].map(|k| k as u8);
    if let Some(i) = kinds.iter().position(|k| prefix.contains(k)) {
        return Err(Failure::invalid(format!(
            "{what}.kinds[{i}] is a prefix event ({}): prefixes are named by byte strings, through kvg_publish_prefix, \
             kvg_attach_prefix, kvg_detach_prefix and kvg_evict_prefix",
            kinds[i]
        )));
    }
    Events::new(kinds, requests, keys, args, raw::pages(pages))
        .map_err(|err| Failure::invalid(format!("{what}: {err}")))
}

/// The optional mask of a stage: NULL, or `len` writable bytes, zeroed.
fn mask<'a>(ptr: *mut u8, len: usize, what: &str) -> Result<&'a mut [u8], Failure> {
    if ptr.is_null() || len == 0 {
        return Ok(&mut []);
    }
    let m = raw::slice_mut(ptr, len, what)?;
    m.fill(0);
    Ok(m)
}

fn mark(mask: &mut [u8], refused: &[(usize, Violation)]) {
    if !mask.is_empty() {
        for (i, _) in refused {
            mask[*i] = 1;
        }
    }
}

/// A batch's refusals, marked in `mask`; an event that stopped the batch as the call's failure
/// (the refusals before it marked).
fn stopped(stage: &str, applied: AppliedEvents, mask: &mut [u8]) -> Result<Vec<(usize, Violation)>, Failure> {
    mark(mask, &applied.refused);
    match applied.failed {
        None => Ok(applied.refused),
        Some((i, e)) => Err(Failure::status(
            core_status(&e),
            format!("{stage} event {i} failed: {e}; the events before it were applied"),
        )),
    }
}

/// The call's failure when something was refused: every refusal, its index within its stage.
fn refusals(what: &str, refused: Vec<(usize, Violation)>) -> Result<(), Failure> {
    match refused.first() {
        None => Ok(()),
        Some((i, v)) => {
            let text = format!("{} refused in {what}; first, index {i}: {v}", refused.len());
            Err(Failure::Refusals { text, refused })
        }
    }
}

/// Applies a step's ownership events in order, each judged as its single call (`kvg_admit`,
/// `kvg_claim`, ...) judges it; a run of claims under one lock. `KVG_STATUS_OK` if none was
/// refused; `KVG_STATUS_VIOLATION` with `refused` (NULL, or `events->len` bytes) marking the
/// refused ones and `kvg_last_violation(i, ...)` giving each (`row`: the event's index); the
/// status of an error that is not a violation (say `KVG_STATUS_OUT_OF_PAGES`) at the event that
/// hit it, the events before it applied. Malformed columns (a length, an unknown kind, pages out
/// of range) are `KVG_STATUS_INVALID_ARGUMENT` with nothing applied.
///
/// # Safety
/// `table` is any value (never dereferenced); `events` points to a `kvg_events` whose pointers
/// hold the lengths it gives; `refused` is NULL or has `events->len` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_apply_events(
    table: *const kvg_table,
    events: *const kvg_events,
    refused: *mut u8,
) -> kvg_status {
    with_table(table, |t| {
        let e = raw::slice(events, 1, "events")?[0];
        let batch = columns(&e, "events")?;
        let mask = mask(refused, e.len, "refused")?;
        let refused = stopped("the", t.table.apply_events(batch), mask)?;
        refusals(&format!("{} events", e.len), refused)
    })
}

/// One engine step (`kvg_step_input`): the early events, the writes, the late events and
/// the reads, each judged as its own call judges it (`kvg_apply_events`, `kvg_record_step_writes`,
/// `kvg_verify_rows` with `cache`), in one call. `KVG_STATUS_OK` when nothing was refused;
/// `KVG_STATUS_VIOLATION` with the masks marking what was (rows refused in `refused_reads` may
/// not run attention) and `kvg_last_violation(i, ...)` giving each, early events first, then
/// writes, late events, reads (`row`: the index within its stage). An event's error that is not a
/// violation is returned as its status, the stages after it not run (the step's attention must
/// not run). A wrong shape (lengths, rows, a request writing more than its row or the pool can
/// hold, malformed events) is `KVG_STATUS_INVALID_ARGUMENT` with nothing applied.
///
/// # Safety
/// `table` and `cache` are any values (never dereferenced); `step` points to a
/// `kvg_step_input` whose pointers hold the lengths it gives.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_engine_step(
    table: *const kvg_table,
    cache: *const kvg_row_cache,
    step: *const kvg_step_input,
) -> kvg_status {
    with_table(table, |t| {
        let s = raw::read_sized(step, "step")?;
        let early = columns(&s.early, "early")?;
        let late = columns(&s.late, "late")?;
        let n = s.requests;
        let (requests, computed, scheduled) = if n == 0 {
            (&[][..], &[][..], &[][..])
        } else {
            (
                raw::slice(s.request_ids, n, "request_ids")?,
                raw::slice(s.num_computed_tokens, n, "num_computed_tokens")?,
                raw::slice(s.num_scheduled_tokens, n, "num_scheduled_tokens")?,
            )
        };
        let entries = s
            .table_rows
            .checked_mul(s.width)
            .ok_or_else(|| Failure::invalid(format!("{} rows of {} entries overflow", s.table_rows, s.width)))?;
        let entries = if entries == 0 { &[][..] } else { raw::slice(s.block_table, entries, "block_table")? };
        let rows = BlockRows::new(entries, s.width).map_err(|e| Failure::invalid(e.to_string()))?;
        let masks = (
            mask(s.refused_early, s.early.len, "refused_early")?,
            mask(s.refused_writes, n, "refused_writes")?,
            mask(s.refused_late, s.late.len, "refused_late")?,
            mask(s.refused_reads, n, "refused_reads")?,
        );
        let requests: Vec<RequestId> = requests.iter().map(|&r| RequestId(r)).collect();
        let step = EngineStep {
            early,
            requests: &requests,
            rows,
            computed: computed.into(),
            scheduled: scheduled.into(),
            late,
        };
        let mut outcome = None;
        with_cache(cache, |c| {
            outcome = Some(t.table.engine_step(c, &step).map_err(|e| Failure::invalid(e.to_string()))?);
            Ok(())
        })?;
        let o = outcome.ok_or_else(|| Failure::invalid("the step was not run".into()))?;
        let early = stopped("early", o.early, masks.0)?;
        let writes = o.writes.map(|v| v.refused).unwrap_or_default();
        mark(masks.1, &writes);
        let late = stopped("late", o.late, masks.2)?;
        let reads = o.reads.map(|v| v.refused).unwrap_or_default();
        mark(masks.3, &reads);
        let refused: Vec<(usize, Violation)> = [early, writes, late, reads].into_iter().flatten().collect();
        refusals("the step (early events, writes, late events, reads)", refused)
    })
}
