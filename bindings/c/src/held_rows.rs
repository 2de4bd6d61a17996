//! A block table the guard holds (`kvguard::HeldBlockTable`) behind an opaque handle: the engine
//! changes its rows through these calls and reads them through one pointer, and each step is
//! judged from what changed (`OwnershipTable::verify_held_rows`; docs/engine-step.md).

use crate::guard::guard_free;
use crate::handle::{Kind, Registry};
use crate::raw;
use crate::rows::{put_counts, read_columns, with_locked};
use crate::status::{Failure, kvg_status};
use crate::step::{mask, verdict};
use crate::table::{kvg_table, with_table};
use kvguard::{HeldBlockTable, HeldRowsError, RequestId, RowRead};
use parking_lot::Mutex;

/// A block table the guard holds (`kvg_held_rows_new`; `kvg_held_rows_free`): rows of int32 page
/// ids the engine changes only through `kvg_held_rows_append`, `_set_row`, `_truncate`,
/// `_copy_row` and `_swap_rows`, and reads through `kvg_held_rows_entries`. One call at a time
/// (a second thread's call meanwhile is refused with `KVG_STATUS_INVALID_ARGUMENT`, never
/// waits). The pointer is a handle, never dereferenced.
pub struct kvg_held_rows {
    _handle_only: [u8; 0],
}

/// The live held block tables, by handle.
static HELD: Registry<Mutex<HeldBlockTable>> = Registry::new(Kind::HeldRows);

/// Runs `body` on the held table behind `h`, locked; a NULL, dead or foreign handle is refused,
/// and so is a table another thread's call holds.
fn with_held(
    h: *const kvg_held_rows,
    body: impl FnOnce(&mut HeldBlockTable) -> Result<(), Failure>,
) -> Result<(), Failure> {
    with_locked(&HELD, h.addr(), "held block table", body)
}

/// A refused change or size as the status it is.
fn failure(e: HeldRowsError) -> Failure {
    let status = match e {
        HeldRowsError::OutOfMemory { .. } => kvg_status::OutOfMemory,
        _ => kvg_status::InvalidArgument,
    };
    Failure::status(status, e.to_string())
}

/// Makes a held block table of `rows` empty rows of `width` entries (every entry -1) at `*out`
/// (NULL on failure): `KVG_STATUS_INVALID_ARGUMENT` if it cannot be indexed (2^32 rows or more,
/// rows of 2^32 entries or more), `KVG_STATUS_OUT_OF_MEMORY` if the system will not give it.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_new(rows: usize, width: usize, out: *mut *mut kvg_held_rows) -> kvg_status {
    guard_free(|| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let held = HeldBlockTable::new(rows, width).map_err(failure)?;
        let handle = HELD.insert(Mutex::new(held))?;
        raw::put(out, std::ptr::without_provenance_mut(handle))
    })
}

/// Frees a held block table (its entries' pointer dies with it). NULL is a no-op
/// (`KVG_STATUS_OK`); one freed already, or a handle that is not one, is
/// `KVG_STATUS_INVALID_HANDLE`. The status may be ignored.
///
/// # Safety
/// None beyond the type: `held` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_held_rows_free(held: *mut kvg_held_rows) -> kvg_status {
    if held.is_null() {
        return kvg_status::Ok;
    }
    crate::guard::guard_release(|| {}, || HELD.remove(held.addr(), "held block table").map(drop))
}

/// Every row's entries, row after row, `width` a row (-1 past each row's length), at `*entries`
/// (`*rows` rows of `*width`; any of the three may be NULL). The pointer stays valid until the
/// table is freed and shows each change as it is made: read it between calls (to copy the rows
/// to the device, say), never write through it (a row changed so is not seen by the checks),
/// never during another thread's call on the table.
///
/// # Safety
/// `entries`, `rows` and `width` are NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_entries(
    held: *const kvg_held_rows,
    entries: *mut *const i32,
    rows: *mut usize,
    width: *mut usize,
) -> kvg_status {
    guard_free(|| {
        with_held(held, |h| {
            raw::put(entries, h.entries().as_ptr())?;
            raw::put(rows, h.rows())?;
            raw::put(width, h.width())
        })
    })
}

/// How many entries row `row` holds, at `*len`; a row past the table is
/// `KVG_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `len` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_len(held: *const kvg_held_rows, row: u32, len: *mut usize) -> kvg_status {
    guard_free(|| {
        with_held(held, |h| {
            let n = h.row(row).map(<[i32]>::len).ok_or_else(|| failure(HeldRowsError::Row { row, rows: h.rows() }))?;
            raw::put_required(len, n, "len")
        })
    })
}

/// Appends `count` entries to row `row` (a step's new pages). A row past the table, or one that
/// would hold more than the width, is `KVG_STATUS_INVALID_ARGUMENT`, nothing changed.
///
/// # Safety
/// `entries` holds `count` entries (NULL if 0).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_append(
    held: *mut kvg_held_rows,
    row: u32,
    entries: *const i32,
    count: usize,
) -> kvg_status {
    guard_free(|| {
        let entries = raw::slice(entries, count, "entries")?;
        with_held(held, |h| h.append(row, entries).map_err(failure))
    })
}

/// Row `row` becomes the `count` entries given (a request given the row). As for
/// `kvg_held_rows_append`.
///
/// # Safety
/// `entries` holds `count` entries (NULL if 0).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_set_row(
    held: *mut kvg_held_rows,
    row: u32,
    entries: *const i32,
    count: usize,
) -> kvg_status {
    guard_free(|| {
        let entries = raw::slice(entries, count, "entries")?;
        with_held(held, |h| h.set_row(row, entries).map_err(failure))
    })
}

/// Row `row` keeps its first `len` entries (all of them if it has no more; 0 empties it).
///
/// # Safety
/// None beyond the type: `held` is never dereferenced.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_truncate(held: *mut kvg_held_rows, row: u32, len: usize) -> kvg_status {
    guard_free(|| with_held(held, |h| h.truncate(row, len).map_err(failure)))
}

/// Row `to` becomes a copy of row `from` (an engine condensing its rows); what `from` was
/// checked clean as goes with it.
///
/// # Safety
/// None beyond the type: `held` is never dereferenced.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_copy_row(held: *mut kvg_held_rows, from: u32, to: u32) -> kvg_status {
    guard_free(|| with_held(held, |h| h.copy_row(from, to).map_err(failure)))
}

/// Rows `a` and `b` trade places, each with what it was checked clean as.
///
/// # Safety
/// None beyond the type: `held` is never dereferenced.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_swap_rows(held: *mut kvg_held_rows, a: u32, b: u32) -> kvg_status {
    guard_free(|| with_held(held, |h| h.swap_rows(a, b).map_err(failure)))
}

/// How many rows were judged from their last clean page (`incremental`) and in full (`full`)
/// since the table was made; either pointer may be NULL.
///
/// # Safety
/// `incremental` and `full` are NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_held_rows_counts(
    held: *const kvg_held_rows,
    incremental: *mut u64,
    full: *mut u64,
) -> kvg_status {
    guard_free(|| with_held(held, |h| put_counts((h.incremental(), h.full()), incremental, full)))
}

#[allow(clippy::too_many_arguments)]
fn held_step(
    table: *const kvg_table,
    held: *mut kvg_held_rows,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let (requests, rows, lens) = read_columns(reads, request_ids, rows, seq_lens)?;
        // The reads as the core takes them, straight from the caller's arrays (none built).
        let step = requests.iter().zip(rows).zip(lens).map(|((&r, &row), &n)| RowRead {
            request: RequestId(r),
            row,
            tokens: n as u64, // not negative: checked
        });
        let refused = mask(refused, reads)?;
        with_held(held, |h| {
            let v = if judged { t.table.verify_held_reads(h, step) } else { t.table.check_held_reads(h, step) };
            verdict(v.map_err(|e| Failure::invalid(e.to_string()))?, reads, refused)
        })
    })
}

/// Verifies a step's reads through the held block table, incrementally and judged: read `i` is
/// request `request_ids[i]` reading its first `seq_lens[i]` tokens through row `rows[i]`. A row
/// whose entries checked whole before were not changed since, read again by the same request
/// who lost nothing since, is judged from its last page only, without reading the row again;
/// the verdict is `kvg_verify_step`'s on the same rows, row for row: `KVG_STATUS_OK`, or
/// `KVG_STATUS_VIOLATION` with `refused` (NULL, or `reads` bytes) marking the refused reads and
/// `kvg_last_violation(i, ...)` giving each. A row past the table is
/// `KVG_STATUS_INVALID_ARGUMENT`, nothing checked.
///
/// # Safety
/// `table` and `held` are any values (never dereferenced); `request_ids`, `rows` and `seq_lens`
/// hold `reads` entries; `refused` is NULL or has `reads` bytes.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_verify_held_rows(
    table: *mut kvg_table,
    held: *mut kvg_held_rows,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    held_step(table, held, reads, request_ids, rows, seq_lens, refused, true)
}

/// `kvg_verify_held_rows`, pure: the same verdict, and nothing counted, logged or quarantined
/// (the held table learns what was clean).
///
/// # Safety
/// As for `kvg_verify_held_rows`.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_check_held_rows(
    table: *const kvg_table,
    held: *mut kvg_held_rows,
    reads: usize,
    request_ids: *const u64,
    rows: *const u32,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    held_step(table, held, reads, request_ids, rows, seq_lens, refused, false)
}
