//! Reads and decode forwards through an engine's token-slot table (SGLang's `req_to_token`: entry
//! `t` of a row is the KV slot of the row's token `t`), judged by the core
//! (`OwnershipTable::check_slot_rows`, `verify_slot_rows`, `decode_forward`).

use crate::guard::guard_free;
use crate::handle::{Kind, Registry};
use crate::raw;
use crate::rows::{new_cache, put_counts, with_locked};
use crate::status::{Failure, kvg_status};
use crate::step::{mask, verdict};
use crate::table::{kvg_table, with_table};
use kvguard::step::{DecodeOutcome, SlotRead, SlotRowCache};
use kvguard::{BlockRows, RequestId, RowRead};
use parking_lot::Mutex;

/// Where `kvg_decode_forward` stopped.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum kvg_decode_stage {
    /// Every write recorded, every window clean (`KVG_STATUS_OK`).
    Clean = 0,
    /// Some writes were refused (judged); the others were recorded and nothing was read.
    Writes = 1,
    /// The writes were recorded; some windows were refused (pure: nothing counted or
    /// quarantined): judge those rows in full (`kvg_verify_slot_rows` with no `from_tokens`).
    Window = 2,
}

/// The table's entries as rows (`table_rows` of `width`).
fn table_of<'a>(req_to_token: *const i32, table_rows: usize, width: usize) -> Result<BlockRows<'a>, Failure> {
    let entries = table_rows
        .checked_mul(width)
        .ok_or_else(|| Failure::invalid(format!("{table_rows} rows of {width} entries overflow")))?;
    let entries = if entries == 0 { &[][..] } else { raw::slice(req_to_token, entries, "req_to_token")? };
    BlockRows::new(entries, width).map_err(|e| Failure::invalid(e.to_string()))
}

/// A step's reads, checked, read in place: read `i` is `request_ids[i]` reading its first
/// `seq_lens[i]` tokens through row `rows[i]`, from token `from_tokens[i]`'s page on (NULL
/// `from_tokens`: whole rows).
struct SlotReads<'a> {
    requests: &'a [u64],
    rows: &'a [u32],
    lens: &'a [i32],
    from: Option<&'a [i32]>,
}

impl SlotReads<'_> {
    /// Read `i` (`i` below the reads' count).
    fn read(&self, i: usize) -> SlotRead {
        // Every count is non-negative (checked in `slot_reads`): `as u64` keeps its value.
        let from = self.from.map_or(0, |f| f[i] as u64);
        SlotRead { request: RequestId(self.requests[i]), row: self.rows[i], from, tokens: self.lens[i] as u64 }
    }

    /// Every read, listed.
    fn listed(&self) -> Vec<SlotRead> {
        (0..self.rows.len()).map(|i| self.read(i)).collect()
    }
}

/// The reads of a step as its arrays give them, each count checked non-negative.
fn slot_reads<'a>(
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    from_tokens: *const i32,
    seq_lens: *const i32,
) -> Result<SlotReads<'a>, Failure> {
    if reads == 0 {
        return Ok(SlotReads { requests: &[], rows: &[], lens: &[], from: None });
    }
    let requests = raw::slice(request_ids, reads, "request_ids")?;
    let rows = raw::slice(rows, reads, "rows")?;
    let lens = raw::slice(seq_lens, reads, "seq_lens")?;
    let from = if from_tokens.is_null() { None } else { Some(raw::slice(from_tokens, reads, "from_tokens")?) };
    for (name, counts) in [("seq_lens", Some(lens)), ("from_tokens", from)] {
        if let Some(counts) = counts
            && let Some(i) = raw::first_negative(counts)
        {
            return Err(Failure::invalid(format!("{name}[{i}] is {}: a token count is not negative", counts[i])));
        }
    }
    Ok(SlotReads { requests, rows, lens, from })
}

#[allow(clippy::too_many_arguments)]
fn slot_rows_step(
    table: *const kvg_table,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    from_tokens: *const i32,
    seq_lens: *const i32,
    refused: *mut u8,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let step = slot_reads(reads, request_ids, rows, from_tokens, seq_lens)?.listed();
        let matrix = table_of(req_to_token, table_rows, width)?;
        let refused = mask(refused, reads)?;
        let v = if judged { t.table.verify_slot_rows(matrix, &step) } else { t.table.check_slot_rows(matrix, &step) };
        verdict(v.map_err(|e| Failure::invalid(e.to_string()))?, reads, refused)
    })
}

/// Verifies reads through a token-slot table, judged: `req_to_token` is `table_rows` rows of
/// `width` int32 slots (row after row, no gap; a negative entry names no slot), and read `i` is
/// request `request_ids[i]` reading its first `seq_lens[i]` tokens through row `rows[i]`, from
/// token `from_tokens[i]`'s page on (NULL: each whole row). Page `j` of a row is its entry
/// `j * page_size` divided by the page size; every other entry read must be that page's slot at
/// its offset, or it is read as the slot it names. `KVG_STATUS_OK`, or `KVG_STATUS_VIOLATION`
/// with `refused` (NULL, or `reads` bytes) marking the refused reads and
/// `kvg_last_violation(i, ...)` giving each (a window's page index counts from its first page).
/// A row past the table or a negative count is `KVG_STATUS_INVALID_ARGUMENT`, nothing checked.
///
/// # Safety
/// `table` is any value (never dereferenced); `req_to_token` holds `table_rows * width`
/// entries; `request_ids`, `rows`, `seq_lens` and `from_tokens` (unless NULL) hold `reads`
/// entries; `refused` is NULL or has `reads` bytes.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_verify_slot_rows(
    table: *mut kvg_table,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    from_tokens: *const i32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    slot_rows_step(
        table,
        req_to_token,
        table_rows,
        width,
        reads,
        request_ids,
        rows,
        from_tokens,
        seq_lens,
        refused,
        true,
    )
}

/// `kvg_verify_slot_rows`, pure: the same verdict, and nothing counted, logged or quarantined.
///
/// # Safety
/// As for `kvg_verify_slot_rows`.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_check_slot_rows(
    table: *const kvg_table,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    from_tokens: *const i32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    slot_rows_step(
        table,
        req_to_token,
        table_rows,
        width,
        reads,
        request_ids,
        rows,
        from_tokens,
        seq_lens,
        refused,
        false,
    )
}

/// A decode forward's first KV store in one call (SGLang's decode step): request
/// `request_ids[i]` wrote slot `slots[i]` (its one new token), recorded as
/// `kvg_record_step_writes` records it (judged); then, if every write was recorded, each read's
/// window checked as `kvg_check_slot_rows` checks it (pure), reads as there (`from_tokens`:
/// tokens of each row already checked clean; NULL: whole rows). `*stage` says where it stopped:
/// `KVG_DECODE_STAGE_CLEAN` (`KVG_STATUS_OK`), `KVG_DECODE_STAGE_WRITES` or
/// `KVG_DECODE_STAGE_WINDOW` (`KVG_STATUS_VIOLATION`, `refused` and `kvg_last_violation` as for
/// `kvg_verify_slot_rows`). Malformed arguments are refused before anything is recorded.
///
/// # Safety
/// As for `kvg_verify_slot_rows`; `slots` holds `reads` entries; `stage` is writable.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_decode_forward(
    table: *mut kvg_table,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    from_tokens: *const i32,
    seq_lens: *const i32,
    slots: *const i64,
    refused: *mut u8,
    stage: *mut kvg_decode_stage,
) -> kvg_status {
    with_table(table, |t| {
        raw::put_required(stage, kvg_decode_stage::Clean, "stage")?;
        let step = slot_reads(reads, request_ids, rows, from_tokens, seq_lens)?;
        let slots = if reads == 0 { &[][..] } else { raw::slice(slots, reads, "slots")? };
        let matrix = table_of(req_to_token, table_rows, width)?;
        let refused = mask(refused, reads)?;
        // The caller's arrays read in place as the core judges them (no list of the reads).
        let outcome = t.table.decode_forward_by(reads, |i| step.read(i), slots, matrix);
        let (at, v) = match outcome.map_err(|e| Failure::invalid(e.to_string()))? {
            DecodeOutcome::Clean => (kvg_decode_stage::Clean, kvguard::StepVerdict::default()),
            DecodeOutcome::Writes(v) => (kvg_decode_stage::Writes, v),
            DecodeOutcome::Window(v) => (kvg_decode_stage::Window, v),
        };
        raw::put(stage, at)?;
        verdict(v, reads, refused)
    })
}

/// What a token-slot table's rows were last checked clean as (`kvg_slot_row_cache_new`;
/// `kvg_slot_row_cache_free`): what makes `kvg_verify_slot_rows_cached` incremental. One per
/// token-slot table, kept across checks; one call at a time (a second thread's call meanwhile is
/// refused with `KVG_STATUS_INVALID_ARGUMENT`, never waits). The pointer is a handle, never
/// dereferenced.
pub struct kvg_slot_row_cache {
    _handle_only: [u8; 0],
}

/// The live slot-row caches, by handle.
static SLOT_CACHES: Registry<Mutex<SlotRowCache>> = Registry::new(Kind::SlotRowCache);

/// Runs `body` on the cache behind `c`, locked (see `rows::with_locked`).
fn with_slot_cache(
    c: *const kvg_slot_row_cache,
    body: impl FnOnce(&mut SlotRowCache) -> Result<(), Failure>,
) -> Result<(), Failure> {
    with_locked(&SLOT_CACHES, c.addr(), "slot row cache", body)
}

/// Makes an empty slot-row cache at `*out` (NULL on failure): the first check judges every row
/// in full.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_slot_row_cache_new(out: *mut *mut kvg_slot_row_cache) -> kvg_status {
    new_cache(&SLOT_CACHES, SlotRowCache::new(), out)
}

/// Frees a slot-row cache. NULL is a no-op (`KVG_STATUS_OK`); one freed already, or a handle
/// that is not a slot-row cache, is `KVG_STATUS_INVALID_HANDLE`. The status may be ignored.
///
/// # Safety
/// None beyond the type: `cache` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_slot_row_cache_free(cache: *mut kvg_slot_row_cache) -> kvg_status {
    if cache.is_null() {
        return kvg_status::Ok;
    }
    crate::guard::guard_release(|| {}, || SLOT_CACHES.remove(cache.addr(), "slot row cache").map(drop))
}

/// How many rows the cache saw judged from their last clean page (`incremental`) and in full
/// (`full`) since it was made; either pointer may be NULL.
///
/// # Safety
/// `incremental` and `full` are NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_slot_row_cache_counts(
    cache: *const kvg_slot_row_cache,
    incremental: *mut u64,
    full: *mut u64,
) -> kvg_status {
    guard_free(|| with_slot_cache(cache, |c| put_counts((c.incremental(), c.full()), incremental, full)))
}

#[allow(clippy::too_many_arguments)]
fn cached_step(
    table: *const kvg_table,
    cache: *mut kvg_slot_row_cache,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let step: Vec<RowRead> = slot_reads(reads, request_ids, rows, std::ptr::null(), seq_lens)?
            .listed()
            .into_iter()
            .map(|r| RowRead { request: r.request, row: r.row, tokens: r.tokens })
            .collect();
        let matrix = table_of(req_to_token, table_rows, width)?;
        let refused = mask(refused, reads)?;
        with_slot_cache(cache, |c| {
            let v = if judged {
                t.table.verify_slot_rows_cached(c, matrix, &step)
            } else {
                t.table.check_slot_rows_cached(c, matrix, &step)
            };
            verdict(v.map_err(|e| Failure::invalid(e.to_string()))?, reads, refused)
        })
    })
}

/// `kvg_verify_slot_rows` of whole rows (no `from_tokens`) across calls through `cache`: a row
/// read again by the same request, whose entries of the pages checked whole at its last clean
/// check are unchanged and from whom nothing was taken since, is judged from the page that check
/// ended in (docs/engine-step.md, `SlotRowCache`); any other row in full. The verdict is
/// `kvg_verify_slot_rows`'s on the same rows, row for row: `KVG_STATUS_OK`, or
/// `KVG_STATUS_VIOLATION` with `refused` (NULL, or `reads` bytes) marking the refused reads and
/// `kvg_last_violation(i, ...)` giving each. A row past the table or a negative count is
/// `KVG_STATUS_INVALID_ARGUMENT`, nothing checked.
///
/// # Safety
/// `table` and `cache` are any values (never dereferenced); `req_to_token` holds
/// `table_rows * width` entries; `request_ids`, `rows` and `seq_lens` hold `reads` entries;
/// `refused` is NULL or has `reads` bytes.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_verify_slot_rows_cached(
    table: *mut kvg_table,
    cache: *mut kvg_slot_row_cache,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    cached_step(table, cache, req_to_token, table_rows, width, reads, request_ids, rows, seq_lens, refused, true)
}

/// `kvg_verify_slot_rows_cached`, pure: the same verdict, and nothing counted, logged or
/// quarantined (the cache learns what was clean).
///
/// # Safety
/// As for `kvg_verify_slot_rows_cached`.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_check_slot_rows_cached(
    table: *const kvg_table,
    cache: *mut kvg_slot_row_cache,
    req_to_token: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    cached_step(table, cache, req_to_token, table_rows, width, reads, request_ids, rows, seq_lens, refused, false)
}
