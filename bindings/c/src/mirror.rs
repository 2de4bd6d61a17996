//! A decode step's row write against an engine plugin's mirror of its pool (SGLang's
//! `req_to_token` write), judged and the mirror updated by the core
//! (`OwnershipTable::write_decode_rows`).

use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::table::{kvg_table, with_table};
use kvguard::step::{DecodeRowWrite, PoolMirror};

/// What `kvg_write_decode_rows` made of one position of the write.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum kvg_row_write {
    /// Nothing new: the slot is in a page the row's request owns in the mirror (or a later
    /// position of a row in a page that row claimed at an earlier position of the same write).
    Owned = 0,
    /// A new page, claimed for the row's request and granted: `page_owner` now says so.
    Claimed = 1,
    /// A new page whose claim was refused (judged: counted, logged, quarantined under enforce);
    /// `kvg_last_violation` gives each refused position's violation, in position order.
    Refused = 2,
    /// Left to the caller, who must settle it: a row of no live request (`row_claimants` 0), or
    /// a page a radix prefix holds (`page_prefix` not 0).
    Left = 3,
}

/// `(address, bytes, name)` of each array: `InvalidArgument` when a writable one shares memory
/// with any other (the core writes it while it reads them).
fn apart(written: &[(usize, usize, &str)], read: &[(usize, usize, &str)]) -> Result<(), Failure> {
    for (k, &(a, n, name)) in written.iter().enumerate() {
        let others = written.iter().enumerate().filter(|(j, _)| *j != k).map(|(_, o)| o).chain(read);
        for &(b, m, other) in others {
            if n > 0 && m > 0 && a < b.saturating_add(m) && b < a.saturating_add(n) {
                return Err(Failure::invalid(format!("{name} shares memory with {other}: pass separate arrays")));
            }
        }
    }
    Ok(())
}

fn span<T>(s: &[T], name: &'static str) -> (usize, usize, &'static str) {
    (s.as_ptr() as usize, std::mem::size_of_val(s), name)
}

/// A decode step's row write against the caller's mirror of its pool, the mirror updated in
/// place: position `i` wrote slot `slots[i]` into row `rows[i]` of the engine's table at column
/// `cols[i]` (`cols_len` is 1, one column for all, or `positions`).
///
/// The mirror: `row_keys` (the request id each row holds) and `row_claimants` (0: the row's
/// request claims no pages) have `mirror_rows` entries, as `row_checked` (tokens of each row
/// last checked clean); `page_owner` (the request owning each page exclusively) and
/// `page_prefix` (0: no radix prefix holds the page) have `page_entries` entries: the pool's
/// pages and one more, which every slot out of the pool reads.
///
/// A position whose page its row's request owns in `page_owner` is nothing new; a new page of a
/// live row that no prefix holds is claimed (once per request and page); anything else is left to
/// the caller. `outcome[i]` says which. Each row's `row_checked` drops to its column where that is
/// lower (a negative column: 0), and each claim granted sets `page_owner[page]`.
/// `KVG_STATUS_OK` when no claim was refused (check `*left` for positions left to you), else
/// `KVG_STATUS_VIOLATION`: `kvg_last_violation(k, ...)` is the `k`-th refused position's
/// violation, in position order.
/// Arrays of the wrong length, a row past the mirror, or writable arrays sharing memory with
/// any other are `KVG_STATUS_INVALID_ARGUMENT`, and nothing is claimed or changed.
///
/// # Safety
/// `table` is any value (never dereferenced); each array holds the entries said above, the
/// writable ones writable and touched by nobody else during the call; `outcome` holds
/// `positions` entries and `left` is writable (the written ones, `left` too, are checked apart
/// from every other array).
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_write_decode_rows(
    table: *mut kvg_table,
    row_keys: *const i64,
    row_claimants: *const i64,
    row_checked: *mut i64,
    mirror_rows: usize,
    page_owner: *mut i64,
    page_prefix: *const i64,
    page_entries: usize,
    positions: usize,
    rows: *const u32,
    cols: *const i64,
    cols_len: usize,
    slots: *const i64,
    outcome: *mut kvg_row_write,
    left: *mut usize,
) -> kvg_status {
    with_table(table, |t| {
        if left.is_null() {
            return Err(Failure::status(kvg_status::NullPointer, "left is NULL".to_string()));
        }
        let keys = raw::slice(row_keys, mirror_rows, "row_keys")?;
        let claimants = raw::slice(row_claimants, mirror_rows, "row_claimants")?;
        let prefix = raw::slice(page_prefix, page_entries, "page_prefix")?;
        let rows = raw::slice(rows, positions, "rows")?;
        let cols = raw::slice(cols, cols_len, "cols")?;
        let slots = raw::slice(slots, positions, "slots")?;
        // Checked apart from each other and every array read before any `&mut` is made.
        let (owner_at, checked_at) = (
            (page_owner as usize, page_entries.saturating_mul(8)),
            (row_checked as usize, mirror_rows.saturating_mul(8)),
        );
        let outcome_at = (outcome as usize, positions.saturating_mul(std::mem::size_of::<kvg_row_write>()));
        apart(
            &[
                (owner_at.0, owner_at.1, "page_owner"),
                (checked_at.0, checked_at.1, "row_checked"),
                (outcome_at.0, outcome_at.1, "outcome"),
                (left as usize, std::mem::size_of::<usize>(), "left"),
            ],
            &[
                span(keys, "row_keys"),
                span(claimants, "row_claimants"),
                span(prefix, "page_prefix"),
                span(rows, "rows"),
                span(cols, "cols"),
                span(slots, "slots"),
            ],
        )?;
        if positions > 0 && outcome.is_null() {
            return Err(Failure::status(kvg_status::NullPointer, "outcome is NULL".to_string()));
        }
        raw::put_required(left, 0, "left")?;
        let owner = raw::slice_mut(page_owner, page_entries, "page_owner")?;
        let checked = raw::slice_mut(row_checked, mirror_rows, "row_checked")?;
        let outcome = raw::slice_mut(outcome, positions, "outcome")?;
        let rows: Vec<u64> = rows.iter().map(|&r| u64::from(r)).collect();
        let mirror = PoolMirror::new(keys, claimants, prefix, &*owner, t.table.config().num_pages)
            .map_err(|e| Failure::invalid(e.to_string()))?;
        let write = DecodeRowWrite { rows: &rows, cols, slots };
        let out =
            t.table.write_decode_rows(mirror, owner, checked, write).map_err(|e| Failure::invalid(e.to_string()))?;
        outcome.fill(kvg_row_write::Owned);
        for c in &out.claims {
            outcome[c.position as usize] = kvg_row_write::Claimed;
        }
        for &i in &out.left {
            outcome[i] = kvg_row_write::Left;
        }
        raw::put(left, out.left.len())?;
        if out.verdict.is_clean() {
            return Ok(());
        }
        let refused: Vec<_> =
            out.verdict.refused.into_iter().map(|(k, v)| (out.claims[k].position as usize, v)).collect();
        for (i, _) in &refused {
            outcome[*i] = kvg_row_write::Refused;
        }
        Err(Failure::Step { refused, rows: positions })
    })
}
