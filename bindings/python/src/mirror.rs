//! An engine plugin's mirror of its pool (kvguard.sglang's numpy arrays), read in place by the
//! core's step (`kvguard::step::PoolMirror`, `OwnershipTable::write_decode_rows`): the
//! `req_to_token` write's new pages claimed, the forward's writes recorded and each row's window
//! read, with the mirror updated in the same call.
//!
//! The mirror is the plugin's, not the table's: which request holds each row of the engine's
//! block table (`row_keys`) and whether that request is live and claims pages (`row_claimants`,
//! `row_live`), which request owns each page exclusively and which radix prefix holds it
//! (`page_owner`, `page_prefix`: one entry per page and one more, which no key owns, that every
//! page id out of range reads), and how many tokens of each row the last forward found clean
//! (`row_checked`). The table stays the judge: the mirror only says which calls a step needs.
//! This module only adapts numpy arrays to the core's [`Ints`](kvguard::step::Ints) without
//! copying them (a hostile stride-0 view of any length costs nothing).

use crate::arrays::{I64Mut, IntArray, U8Mut};
use kvguard::config::PageDiv;
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

    /// Entry `i` (`i < len`: a bound the caller checked). Always inlined: it is a per-row
    /// loop's body, where the call cost more than the read.
    #[inline(always)]
    pub fn at(&self, i: usize) -> i64 {
        match self.slice {
            Some(s) => s[i],
            None => self.array.get(i, 0),
        }
    }
}

/// The rows of a decode forward: `rows`, 1-D int, one entry per position, each non-negative
/// and within both `row_keys` and the token-slot table's `table_rows` (`ValueError` naming the
/// first row past `row_keys`, else the first past the table), checked in place to be read by
/// index. One pass in the common case.
pub fn check_step_rows(rows: &IntArray<'_>, row_keys: usize, table_rows: usize) -> PyResult<()> {
    let n = rows.len();
    rows.check_counts(n, "rows")?;
    let at = Lookup::new(rows);
    let bound = row_keys.min(table_rows) as u64;
    if (0..n).all(|i| (at.at(i) as u64) < bound) {
        return Ok(());
    }
    let first_past = |len: usize| (0..n).map(|i| (i, at.at(i))).find(|&(_, r)| r as u64 >= len as u64);
    Err(match first_past(row_keys) {
        Some((i, r)) => PyValueError::new_err(format!("rows[{i}] is {r}: row_keys has {row_keys} rows")),
        None => {
            let (i, r) = first_past(table_rows).unwrap_or((0, 0));
            PyValueError::new_err(format!("rows[{i}] is {r}: req_to_token has {table_rows} rows"))
        }
    })
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

impl kvguard::step::Ints for Lookup<'_, '_> {
    fn len(&self) -> usize {
        self.array.len()
    }
    #[inline]
    fn at(&self, i: usize) -> i64 {
        Lookup::at(self, i)
    }
}

/// A writable array of the mirror (`page_owner`, `row_checked`) as the core's step updates it.
pub struct Written<'a, 'py>(pub &'a I64Mut<'py>);

impl kvguard::step::Ints for Written<'_, '_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn at(&self, i: usize) -> i64 {
        self.0.get(i)
    }
}

impl kvguard::step::IntsMut for Written<'_, '_> {
    #[inline]
    fn set(&mut self, i: usize, v: i64) {
        self.0.set(i, v);
    }
}

/// A mirror or row write the core did not take, as Python's `ValueError` (naming the argument).
pub fn mirror_error(e: kvguard::step::MirrorError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Marks the page of each of `slots` in `flags`: `flags[slot // page_size] = 1` for every slot
/// that is not negative and whose page is below `len(flags)`; any other slot is passed over
/// (a slot outside the pool is judged where it is used, not here).
///
/// kvguard.sglang marks the pages SGLang's allocator hands out with it (`flags` its bool
/// array's `view(np.uint8)`): one call a step, where numpy took a division, a gather and a
/// scatter. `flags` must be a writable, C-contiguous 1-D uint8 array and must not share memory
/// with `slots` (`TypeError` / `ValueError`, nothing marked); `page_size` must be at least 1.
///
/// ```python
/// handed = np.zeros(pages + 1, dtype=bool)
/// kvguard.mark_pages(handed[:pages].view(np.uint8), out_cache_loc, page_size)
/// ```
#[pyfunction]
pub fn mark_pages(flags: &Bound<'_, PyAny>, slots: &Bound<'_, PyAny>, page_size: u32) -> PyResult<()> {
    if page_size == 0 {
        return Err(PyValueError::new_err("page_size must be at least 1"));
    }
    let flags = U8Mut::open(flags, "flags")?;
    let slots = IntArray::open(slots, "slots", 1)?;
    flags.apart("flags", &[(&slots, "slots")], None)?;
    let div = PageDiv::new(page_size);
    let pages = flags.len() as u64;
    let mark = |slot: i64| {
        if let Ok(slot) = u64::try_from(slot) {
            let page = div.floor(slot);
            if page < pages {
                flags.set(page as usize, 1);
            }
        }
    };
    match slots.as_i64() {
        Some(s) => s.iter().for_each(|&v| mark(v)),
        None => (0..slots.len()).for_each(|i| mark(slots.get(i, 0))),
    }
    Ok(())
}
