//! An engine's block table read in place across steps and judged incrementally by the core
//! (`OwnershipTable::verify_rows`): a row cache behind an opaque handle, kept by the engine from
//! step to step, and one call per step.

use crate::guard::guard_free;
use crate::handle::{Kind, Registry};
use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::step::{mask, verdict};
use crate::table::{kvg_table, with_table};
use kvguard::{BlockRows, RequestId, RowCache, RowRead};
use parking_lot::Mutex;

/// What an engine's block-table rows were last checked clean as (`kvg_row_cache_new`;
/// `kvg_row_cache_free`): what makes `kvg_verify_rows` incremental. One per block table, kept
/// across steps; one call at a time (a second thread's call meanwhile is refused with
/// `KVG_STATUS_INVALID_ARGUMENT`, never waits). The pointer is a handle, never dereferenced.
pub struct kvg_row_cache {
    _handle_only: [u8; 0],
}

/// The live row caches, by handle.
static CACHES: Registry<Mutex<RowCache>> = Registry::new(Kind::RowCache);

/// Runs `body` on the cache behind `c`, locked; a NULL, dead or foreign handle is refused, and
/// so is a cache another thread's call holds.
pub(crate) fn with_cache(
    c: *const kvg_row_cache,
    body: impl FnOnce(&mut RowCache) -> Result<(), Failure>,
) -> Result<(), Failure> {
    with_locked(&CACHES, c.addr(), "row cache", body)
}

/// Runs `body` on the cache `what` behind `handle` in `registry`, locked; a NULL, dead or foreign
/// handle is refused, and so is a cache another thread's call holds (one call at a time per
/// cache: a call never waits). Shared by the row caches and the slot-row caches.
pub(crate) fn with_locked<T: Send>(
    registry: &'static Registry<Mutex<T>>,
    handle: usize,
    what: &str,
    body: impl FnOnce(&mut T) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let cache = registry.get(handle, what)?;
    let mut cache = cache.try_lock().ok_or_else(|| {
        Failure::invalid(format!("the {what} is in use by another thread's call: one call at a time per cache"))
    })?;
    body(&mut cache)
}

/// A new cache `value` in `registry`, its handle written to `*out` (NULL first, and on failure).
pub(crate) fn new_cache<T: Send, H>(registry: &'static Registry<Mutex<T>>, value: T, out: *mut *mut H) -> kvg_status {
    guard_free(|| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let handle = registry.insert(Mutex::new(value))?;
        raw::put(out, std::ptr::without_provenance_mut(handle))
    })
}

/// A cache's counts of rows judged incrementally and in full, written where the caller asked
/// (either pointer may be NULL).
pub(crate) fn put_counts(counts: (u64, u64), incremental: *mut u64, full: *mut u64) -> Result<(), Failure> {
    if !incremental.is_null() {
        raw::put(incremental, counts.0)?;
    }
    if !full.is_null() {
        raw::put(full, counts.1)?;
    }
    Ok(())
}

/// Makes an empty row cache at `*out` (NULL on failure): the first step checks every row in full.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_row_cache_new(out: *mut *mut kvg_row_cache) -> kvg_status {
    new_cache(&CACHES, RowCache::new(), out)
}

/// Frees a row cache. NULL is a no-op (`KVG_STATUS_OK`); one freed already, or a handle that is
/// not a row cache, is `KVG_STATUS_INVALID_HANDLE`. The status may be ignored.
///
/// # Safety
/// None beyond the type: `cache` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_row_cache_free(cache: *mut kvg_row_cache) -> kvg_status {
    if cache.is_null() {
        return kvg_status::Ok;
    }
    crate::guard::guard_release(|| {}, || CACHES.remove(cache.addr(), "row cache").map(drop))
}

/// How many rows the cache saw judged from their last clean page (`incremental`) and in full
/// (`full`) since it was made; either pointer may be NULL.
///
/// # Safety
/// `incremental` and `full` are NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_row_cache_counts(
    cache: *const kvg_row_cache,
    incremental: *mut u64,
    full: *mut u64,
) -> kvg_status {
    guard_free(|| with_cache(cache, |c| put_counts((c.incremental(), c.full()), incremental, full)))
}

/// A step's reads as the caller's arrays: request ids, rows, token counts.
pub(crate) type ReadColumns<'a> = (&'a [u64], &'a [u32], &'a [i32]);

/// A step's reads as the caller's columns: read `i` is `request_ids[i]` reading its first
/// `seq_lens[i]` tokens through row `rows[i]` of the engine's block table; every length checked
/// not negative.
pub(crate) fn read_columns<'a>(
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
) -> Result<ReadColumns<'a>, Failure> {
    let requests = raw::slice(request_ids, reads, "request_ids")?;
    let rows = raw::slice(rows, reads, "rows")?;
    let lens = raw::slice(seq_lens, reads, "seq_lens")?;
    if let Some(i) = raw::first_negative(lens) {
        return Err(Failure::invalid(format!("seq_lens[{i}] is {}: a token count is not negative", lens[i])));
    }
    Ok((requests, rows, lens))
}

/// A step's reads (see [`read_columns`]) as the core's `RowRead`s.
fn row_reads(
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
) -> Result<Vec<RowRead>, Failure> {
    let (requests, rows, lens) = read_columns(reads, request_ids, rows, seq_lens)?;
    let step = requests.iter().zip(rows).zip(lens);
    Ok(step.map(|((&r, &row), &n)| RowRead { request: RequestId(r), row, tokens: n as u64 }).collect())
}

#[allow(clippy::too_many_arguments)]
fn rows_step(
    table: *const kvg_table,
    cache: *mut kvg_row_cache,
    block_table: *const i32,
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
        let step = row_reads(reads, request_ids, rows, seq_lens)?;
        let entries = table_rows
            .checked_mul(width)
            .ok_or_else(|| Failure::invalid(format!("{table_rows} rows of {width} entries overflow")))?;
        let entries = if entries == 0 { &[][..] } else { raw::slice(block_table, entries, "block_table")? };
        let block_rows = BlockRows::new(entries, width).map_err(|e| Failure::invalid(e.to_string()))?;
        let refused = mask(refused, reads)?;
        with_cache(cache, |c| {
            let v = if judged {
                t.table.verify_rows(c, block_rows, &step)
            } else {
                t.table.check_rows(c, block_rows, &step)
            };
            verdict(v.map_err(|e| Failure::invalid(e.to_string()))?, reads, refused)
        })
    })
}

/// Verifies a decode step's reads through the engine's own block table, incrementally and
/// judged: `block_table` is `table_rows` rows of `width` page ids (row after row, no gap; a
/// negative entry names no page and is refused as `page_out_of_range`), and read `i` is request
/// `request_ids[i]` reading its first `seq_lens[i]` tokens through row `rows[i]`. A row
/// unchanged since `cache` last saw it clean, whose request lost nothing since, is judged from
/// its last page only (docs/engine-step.md); the verdict is `kvg_verify_step`'s on the same rows,
/// row for row: `KVG_STATUS_OK`, or `KVG_STATUS_VIOLATION` with `refused` (NULL, or `reads`
/// bytes) marking the refused reads and `kvg_last_violation(i, ...)` giving each. A row past the
/// table is `KVG_STATUS_INVALID_ARGUMENT`, nothing checked.
///
/// # Safety
/// `table` and `cache` are any values (never dereferenced); `block_table` holds
/// `table_rows * width` entries; `request_ids`, `rows` and `seq_lens` hold `reads` entries;
/// `refused` is NULL or has `reads` bytes.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_verify_rows(
    table: *mut kvg_table,
    cache: *mut kvg_row_cache,
    block_table: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    rows_step(table, cache, block_table, table_rows, width, reads, request_ids, rows, seq_lens, refused, true)
}

/// `kvg_verify_rows`, pure: the same verdict, and nothing counted, logged or quarantined (the
/// cache learns what was clean).
///
/// # Safety
/// As for `kvg_verify_rows`.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_check_rows(
    table: *const kvg_table,
    cache: *mut kvg_row_cache,
    block_table: *const i32,
    table_rows: usize,
    width: usize,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    rows_step(table, cache, block_table, table_rows, width, reads, request_ids, rows, seq_lens, refused, false)
}
