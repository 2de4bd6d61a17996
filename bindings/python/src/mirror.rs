//! An engine plugin's mirror of its pool (kvguard.sglang's numpy arrays), and a decode step
//! judged against it: the `req_to_token` write's new pages claimed, the forward's writes
//! recorded and each row's window read, with the mirror updated in the same call.
//!
//! The mirror is the plugin's, not the table's: which request holds each row of the engine's
//! block table (`row_keys`) and whether that request is live and claims pages (`row_claimants`,
//! `row_live`), which request owns each page exclusively and which radix prefix holds it
//! (`page_owner`, `page_prefix`: one entry per page and one more, which no key owns, that every
//! page id out of range reads), and how many tokens of each row the last forward found clean
//! (`row_checked`). The table stays the judge: the mirror only says which calls a step needs.

use crate::arrays::{I64Mut, IntArray};
use kvguard::config::PageDiv;
use kvguard::{PageId, RequestId};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A 1-D int array read by index in a per-row loop: as a slice when it is contiguous int64 (the
/// mirror's own numpy arrays), else through [`IntArray::get`].
pub struct Lookup<'a, 'py> {
    array: &'a IntArray<'py>,
    slice: Option<&'a [i64]>,
}

impl<'a, 'py> Lookup<'a, 'py> {
    pub fn new(array: &'a IntArray<'py>) -> Self {
        Lookup { array, slice: array.as_i64() }
    }

    /// Entry `i` (`i < len`: a bound the caller checked).
    #[inline]
    pub fn at(&self, i: usize) -> i64 {
        match self.slice {
            Some(s) => s[i],
            None => self.array.get(i, 0),
        }
    }
}

/// One new page of a decode step's row write: the claim it needs.
#[derive(Clone, Copy, Debug)]
pub struct DecodeClaim {
    pub request: RequestId,
    pub page: PageId,
    /// The page's index in the mirror (the last entry for a page id out of range).
    pub at: usize,
}

/// What a decode step's row write needs: the claims of new pages of live rows, and the
/// positions the table cannot take from the mirror alone (a row of no live request, a page of
/// a radix prefix), left to the plugin in order.
#[derive(Debug, Default)]
pub struct DecodeWrites {
    pub claims: Vec<DecodeClaim>,
    pub left: Vec<usize>,
}

/// The row arguments of a decode step: `rows`, 1-D int, one entry per position, each within
/// `row_keys` (`ValueError` otherwise).
pub fn step_rows(rows: &IntArray<'_>, row_keys: usize) -> PyResult<Vec<u64>> {
    let n = rows.len();
    let rows = rows.counts(n, "rows")?;
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| **r >= row_keys as u64) {
        return Err(PyValueError::new_err(format!("rows[{i}] is {r}: row_keys has {row_keys} rows")));
    }
    Ok(rows)
}

/// `page_owner` and `page_prefix` have one entry per page of the pool and one more
/// (`ValueError` otherwise): a shorter mirror would read pages the table grants as out of
/// range, and claim them again every step.
pub fn check_pages(owner: usize, prefix: usize, pool_pages: u32) -> PyResult<()> {
    let want = pool_pages as usize + 1;
    if owner != want || prefix != want {
        return Err(PyValueError::new_err(format!(
            "page_owner ({owner}) and page_prefix ({prefix}) must have one entry per page and one more ({want})"
        )));
    }
    Ok(())
}

/// `len`, a per-position argument's length, is `n`, the positions' (`ValueError` otherwise:
/// an extra entry is not dropped unread).
pub fn check_positions(name: &str, len: usize, n: usize) -> PyResult<()> {
    if len != n {
        return Err(PyValueError::new_err(format!("{name} has {len} entries, rows {n}")));
    }
    Ok(())
}

/// `row_keys` and another per-row array agree in length (`ValueError` otherwise).
pub fn check_rows(name: &str, len: usize, row_keys: usize) -> PyResult<()> {
    if len != row_keys {
        return Err(PyValueError::new_err(format!("{name} has {len} entries, row_keys {row_keys}")));
    }
    Ok(())
}

/// The arguments every decode-step call opens alike: the mirror's rows and radix prefixes, and
/// the row write's positions (`rows[i]` wrote `slots[i]`).
pub struct DecodeArgs<'py> {
    pub keys: IntArray<'py>,
    pub claimants: IntArray<'py>,
    pub prefix: IntArray<'py>,
    pub rows: Vec<u64>,
    pub slots: IntArray<'py>,
}

impl<'py> DecodeArgs<'py> {
    /// Opens and checks them against each other, `owner_len` (page_owner's length) and the
    /// pool's pages (`TypeError` / `ValueError` naming the argument).
    pub fn open(
        row_keys: &Bound<'py, PyAny>,
        row_claimants: &Bound<'py, PyAny>,
        page_prefix: &Bound<'py, PyAny>,
        owner_len: usize,
        pool_pages: u32,
        rows: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let keys = IntArray::open(row_keys, "row_keys", 1)?;
        let claimants = IntArray::open(row_claimants, "row_claimants", 1)?;
        check_rows("row_claimants", claimants.len(), keys.len())?;
        let prefix = IntArray::open(page_prefix, "page_prefix", 1)?;
        check_pages(owner_len, prefix.len(), pool_pages)?;
        let rows = step_rows(&IntArray::open(rows, "rows", 1)?, keys.len())?;
        let slots = IntArray::open(slots, "slots", 1)?;
        check_positions("slots", slots.len(), rows.len())?;
        Ok(DecodeArgs { keys, claimants, prefix, rows, slots })
    }

    /// [`decode_writes`] over them.
    pub fn writes(&self, owner: impl Fn(usize) -> i64, page_size: u32) -> DecodeWrites {
        decode_writes(&self.keys, &self.claimants, &self.prefix, owner, &self.rows, &self.slots, page_size)
    }
}

/// The claims and leftovers of a decode step's row write: position `i` wrote slot `slots[i]`
/// (page `slots[i] // page_size`) into row `rows[i]`. A page the row's request already owns in
/// the mirror is nothing new; a new page of a live row that is no prefix is a claim, once per
/// request and page however many positions of the step write it; anything else is left.
/// `owner(at)` reads the mirror's page owner at index `at`; `slots` has an entry per position
/// (checked by [`DecodeArgs::open`]).
pub fn decode_writes(
    keys: &IntArray<'_>,
    claimants: &IntArray<'_>,
    prefix: &IntArray<'_>,
    owner: impl Fn(usize) -> i64,
    rows: &[u64],
    slots: &IntArray<'_>,
    page_size: u32,
) -> DecodeWrites {
    let div = PageDiv::new(page_size);
    let never = prefix.len() - 1;
    let mut out = DecodeWrites::default();
    // Two positions claim one page for one request only where a row comes twice (a request
    // holds one row): then, and only then, claims are kept apart by (request, page).
    let mut seen_row = vec![false; keys.len()];
    let repeats = rows.iter().any(|&r| std::mem::replace(&mut seen_row[r as usize], true));
    let mut claimed = std::collections::HashSet::new();
    let (keys, claimants, prefix, slots) =
        (Lookup::new(keys), Lookup::new(claimants), Lookup::new(prefix), Lookup::new(slots));
    for (i, &row) in rows.iter().enumerate() {
        let key = keys.at(row as usize);
        let page = div.floor_i64(slots.at(i));
        let at = usize::try_from(page).ok().filter(|&p| p < never).unwrap_or(never);
        // The last entry stands for every page out of range: no key owns it, whatever it holds.
        if at < never && owner(at) == key {
            continue;
        }
        if claimants.at(row as usize) == 0 || prefix.at(at) != 0 {
            out.left.push(i);
            continue;
        }
        let page = PageId(u32::try_from(page).unwrap_or(u32::MAX));
        if repeats && !claimed.insert((key, page)) {
            continue;
        }
        out.claims.push(DecodeClaim { request: RequestId(key as u64), page, at });
    }
    out
}

/// A row's checked length drops to the first column a row write rewrote below it: entry
/// `(rows[i], cols[i])` (`cols` of one entry applies to every row). A negative column (torch
/// counts it from the row's end) checks the whole row next. `cols` must have 1 or one entry per
/// row: see [`check_cols`], called before anything changes.
pub fn lower_checked(checked: &I64Mut, rows: &[u64], cols: &IntArray<'_>) {
    let one = cols.len() == 1;
    for (i, &row) in rows.iter().enumerate() {
        let col = cols.get(if one { 0 } else { i }, 0).max(0);
        if col < checked.get(row as usize) {
            checked.set(row as usize, col);
        }
    }
}

/// `cols` has 1 entry or one per row (`ValueError` otherwise).
pub fn check_cols(rows: usize, cols: &IntArray<'_>) -> PyResult<()> {
    if cols.len() != 1 && cols.len() != rows {
        return Err(PyValueError::new_err(format!(
            "cols has {} entries: 1 or one per row ({rows}) needed",
            cols.len()
        )));
    }
    Ok(())
}
