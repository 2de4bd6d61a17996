//! A step read through rows of one engine table, by row index (vLLM's `block_table.np`,
//! SGLang's `req_to_token`): `check_step_rows`/`verify_step_rows` and the forward window
//! (`check_step_window`) over page-id or token-slot rows, and the incremental checks through a
//! `RowCache` (`check_rows`/`verify_rows`). Rows are read in place where they are C-contiguous
//! int32, otherwise only each read's window is converted.

use super::OwnershipTable;
use super::verdict::StepVerdict;
use crate::arrays::IntArray;
use kvguard::step::SlotRead;
use kvguard::{PageId, RequestId, SeqRead};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

impl OwnershipTable {
    /// Checks a step whose block tables are rows of one engine table, read in place by row
    /// index; `token_slots`: the table holds one KV slot per token (page j of a row is its entry
    /// j * page_size over page_size), else one page per entry. With `from_tokens`, request i
    /// reads only the pages from token from_tokens[i] on (its window; see check_step_window).
    /// `cached` (token slots, an int32 table read in place, no window): through the table's
    /// `SlotRowCache`, each row judged from its last clean page where it allows.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step_rows(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        from_tokens: Option<&Bound<'_, PyAny>>,
        token_slots: bool,
        cached: bool,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let t = IntArray::open(table, "table", 2)?;
        let rows = IntArray::open(rows, "rows", 1)?.counts(n, "rows")?;
        if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| **r >= t.len() as u64) {
            return Err(PyValueError::new_err(format!("rows[{i}] is {r}: table has {} rows", t.len())));
        }
        let mut lens = IntArray::open(seq_lens, "seq_lens", 1)?.counts(n, "seq_lens")?;
        let from = match from_tokens {
            Some(f) => Some(IntArray::open(f, "from_tokens", 1)?.counts(n, "from_tokens")?),
            None => None,
        };
        if token_slots
            && cached
            && from.is_none()
            && let Some((entries, width)) = t.as_i32_rows().filter(|(_, width)| *width > 0)
        {
            // Through the table's SlotRowCache (rows in range: checked above).
            let rows_in = kvguard::BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(e.to_string()))?;
            let reads: Vec<kvguard::RowRead> = (0..n)
                .map(|i| Ok(kvguard::RowRead { request: requests[i], row: row_index(rows[i])?, tokens: lens[i] }))
                .collect::<PyResult<_>>()?;
            let (core, cache) = (&self.table, &self.slot_rows);
            let v = py.detach(|| {
                // Another thread's check holds the cache: a fresh one judges every row in full,
                // with the same verdict.
                let mut spare = kvguard::step::SlotRowCache::new();
                let mut held = cache.try_lock();
                let cache = held.as_deref_mut().unwrap_or(&mut spare);
                if judged {
                    core.verify_slot_rows_cached(cache, rows_in, &reads)
                } else {
                    core.check_slot_rows_cached(cache, rows_in, &reads)
                }
            });
            let v = v.map_err(|e| PyValueError::new_err(e.to_string()))?;
            return self.verdict(py, v, n, judged);
        }
        if token_slots {
            // The core reads token-slot rows (SGLang's req_to_token): check_slot_rows.
            let reads: Vec<SlotRead> = (0..n)
                .map(|i| {
                    Ok(SlotRead {
                        request: requests[i],
                        row: row_index(rows[i])?,
                        from: from.as_ref().map_or(0, |f| f[i]),
                        tokens: lens[i],
                    })
                })
                .collect::<PyResult<_>>()?;
            let mut converted = Vec::new();
            let (table, reads) = slot_rows(&t, reads, self.table.config(), &mut converted)?;
            let core = &self.table;
            let v = py.detach(|| {
                if judged { core.verify_slot_rows(table, &reads) } else { core.check_slot_rows(table, &reads) }
            });
            let v = v.map_err(|e| PyValueError::new_err(e.to_string()))?;
            return self.verdict(py, v, n, judged);
        }
        // int32 page rows are borrowed as they are; int64 rows and windows are converted, the
        // entries each request reads only, into one buffer.
        let direct = n > 0 && from.is_none() && t.row_pages(rows[0] as usize).is_some();
        let windows = (!direct).then(|| window_pages(&t, &rows, &mut lens, from.as_deref(), self.table.config()));
        let reads: Vec<SeqRead<'_>> = match &windows {
            Some(w) => w.reads(&requests, &lens),
            None => (0..n)
                .map(|i| SeqRead {
                    request: requests[i],
                    // direct: every row is a contiguous int32 row (row_pages of one is of all).
                    block_table: t.row_pages(rows[i] as usize).unwrap_or(&[]),
                    tokens: lens[i],
                })
                .collect(),
        };
        let core = &self.table;
        let v = py.detach(|| if judged { core.verify_step(&reads) } else { core.check_step(&reads) });
        self.verdict(py, v, n, judged)
    }

    /// verify_rows / check_rows: the requests resolved here, the rows read by the core.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows_step(
        &self,
        py: Python<'_>,
        cache: &Bound<'_, crate::rows::RowCache>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let v = crate::rows::step(py, &self.table, cache.get(), &requests, table, rows, seq_lens, judged)?;
        self.verdict(py, v, requests.len(), judged)
    }
}

/// The pages each row reads, converted into one buffer: row `rows[i]` of `t` (page ids) for
/// `lens[i]` tokens, from token `from[i]` on (its page; 0 without `from`). `lens[i]` becomes the
/// tokens of the window read as its own block table (its tokens start at its first page). A
/// negative or too-large entry becomes a page beyond any pool (refused as page_out_of_range). A
/// row is read for at most `pool_pages + 1` pages from its window's start: a read that needs more
/// than the pool holds is refused as block_table_too_short (so a huge length, or a stride-0
/// view's huge width, allocates nothing beyond that). Token-slot tables are the core's
/// (`check_slot_rows`, through [`slot_rows`]).
fn window_pages(
    t: &IntArray<'_>,
    rows: &[u64],
    lens: &mut [u64],
    from: Option<&[u64]>,
    config: &kvguard::PoolConfig,
) -> Windows {
    let ps = u64::from(config.page_size);
    let div = kvguard::config::PageDiv::new(config.page_size);
    let width = t.width();
    let most = config.num_pages as usize + 1;
    let mut out = Windows { pages: Vec::new(), spans: Vec::with_capacity(rows.len()) };
    let page_of = |v: i64| PageId(u32::try_from(v).unwrap_or(u32::MAX));
    for (i, &row) in rows.iter().enumerate() {
        let seq = lens[i];
        let first = from.map_or(0, |f| usize::try_from(div.floor(f[i].min(seq))).unwrap_or(usize::MAX)).min(width);
        let end = usize::try_from(div.ceil(seq)).unwrap_or(usize::MAX).min(width).max(first).min(first + most);
        let start = out.pages.len();
        // An int32 contiguous row is read as a slice; its entries are the engine's int32s
        // (`PageId` only borrows their bits).
        match t.row_pages(row as usize) {
            Some(r) => out.pages.extend((first..end).map(|j| page_of(i64::from(r[j].0 as i32)))),
            None => out.pages.extend((first..end).map(|j| page_of(t.get(row as usize, j)))),
        }
        out.spans.push(start..out.pages.len());
        lens[i] = seq - first as u64 * ps;
    }
    out
}

/// A row of an engine's table as the core names it (a table of 2**32 rows or more is refused).
/// Inlined into the per-row loops that call it, the error built out of line: with the error
/// inline it stayed a call, 19 instructions a row.
#[inline]
pub(super) fn row_index(row: u64) -> PyResult<u32> {
    u32::try_from(row).map_err(|_| too_many_rows(row))
}

/// [`row_index`]'s error.
#[cold]
#[inline(never)]
fn too_many_rows(row: u64) -> PyErr {
    PyValueError::new_err(format!("row {row}: a table has at most 2**32 rows"))
}

/// A token-slot table as the core reads it ([`kvguard::BlockRows`] of int32 slots) and the
/// reads through it: a C-contiguous int32 table (SGLang's `req_to_token`) in place; any other
/// array converted, each read into a row of its own in `converted`, laid out so that the core
/// judges it exactly as it judges the same read in place (the same pages, entries and tokens,
/// so the same verdicts and the same table changes): [`SlotWindow`]. Only each read's window is
/// converted (at most the pool's pages plus one, as the core reads in place: a huge length or
/// window start, or a stride-0 view's huge width, allocates nothing beyond that). An entry
/// outside int32 names no slot (-1, refused as page_out_of_range). The reads' rows are within
/// `t` (checked by the caller).
pub(super) fn slot_rows<'a>(
    t: &'a IntArray<'_>,
    mut reads: Vec<SlotRead>,
    config: &kvguard::PoolConfig,
    converted: &'a mut Vec<i32>,
) -> PyResult<(kvguard::BlockRows<'a>, Vec<SlotRead>)> {
    let shape = |e: kvguard::RowsError| PyValueError::new_err(e.to_string());
    if let Some((entries, width)) = t.as_i32_rows() {
        return Ok((kvguard::BlockRows::new(entries, width).map_err(shape)?, reads));
    }
    let entries = t.width();
    if entries == 0 {
        // No entry to convert: the core refuses these reads as it refuses them in place.
        return Ok((kvguard::BlockRows::new(&[], 0).map_err(shape)?, reads));
    }
    let ps = config.page_size.max(1) as usize;
    let div = kvguard::config::PageDiv::new(config.page_size);
    let most = config.num_pages as usize + 1;
    let windows: Vec<SlotWindow> = reads.iter().map(|r| SlotWindow::of(r, entries, ps, div, most)).collect();
    // Whole pages, at least one: every window fits, and a row read past holds whole pages only.
    let width = windows.iter().map(|w| w.pages * ps).max().unwrap_or(0).max(ps);
    converted.reserve(reads.len().saturating_mul(width));
    let entry = |row: usize, j: usize| if j < entries { i32::try_from(t.get(row, j)).unwrap_or(-1) } else { -1 };
    for (i, (r, w)) in reads.iter_mut().zip(&windows).enumerate() {
        let row = r.row as usize;
        let lo = w.first * ps;
        let start = converted.len();
        converted.resize(start + width, -1);
        let out = &mut converted[start..];
        if w.short {
            // The row's whole pages at the end of the converted row, the read starting at them
            // and running past it: the core reads those pages, then refuses the read as
            // block_table_too_short for the same tokens and the same pages it covers.
            let at = width - w.pages * ps;
            for (k, slot) in out[at..].iter_mut().enumerate() {
                *slot = entry(row, lo + k);
            }
            *r = SlotRead { row: i as u32, from: at as u64, tokens: w.tokens.saturating_add(at as u64), ..*r };
        } else {
            // The entries the core reads (up to the read's last token), the read starting there.
            let read = usize::try_from(w.tokens).unwrap_or(usize::MAX).min(width);
            for (k, slot) in out[..read].iter_mut().enumerate() {
                *slot = entry(row, lo + k);
            }
            *r = SlotRead { row: i as u32, from: 0, tokens: w.tokens, ..*r };
        }
    }
    Ok((kvguard::BlockRows::new(converted, width).map_err(shape)?, reads))
}

/// A read's window in its row of `entries` entries as the core takes it in place
/// (`check_slot_rows`): from the page of its `from` token (the row's end, if that is past it)
/// to the page of its last token, at most `most` pages; a read past the row's end reads only
/// the row's whole pages. The read is of `tokens` tokens from the window's first page; `short`:
/// more than its `pages` hold (refused as block_table_too_short). At page size 1 the core reads
/// a row in place with no page limit: converted, a read of more tokens than the pool has pages
/// plus one is `short` (refused; in place it passes only where its row names a page twice).
struct SlotWindow {
    first: usize,
    pages: usize,
    tokens: u64,
    short: bool,
}

impl SlotWindow {
    fn of(r: &SlotRead, entries: usize, ps: usize, div: kvguard::config::PageDiv, most: usize) -> SlotWindow {
        let seq = r.tokens;
        let width = entries.div_ceil(ps);
        let first = usize::try_from(div.floor(r.from.min(seq))).unwrap_or(usize::MAX).min(width);
        let in_row = if seq > entries as u64 { entries / ps } else { width };
        let end =
            usize::try_from(div.ceil(seq)).unwrap_or(usize::MAX).min(in_row).max(first).min(first.saturating_add(most));
        let pages = end - first;
        // `first` pages end at or before token `from.min(seq)`: no underflow.
        let tokens = seq - first as u64 * ps as u64;
        SlotWindow { first, pages, tokens, short: tokens > pages as u64 * ps as u64 }
    }
}

/// What [`window_pages`] read: each row's pages (`pages[spans[i]]`).
struct Windows {
    pages: Vec<PageId>,
    spans: Vec<std::ops::Range<usize>>,
}

impl Windows {
    /// The step's reads: row `i` as `requests[i]` reading `lens[i]` tokens of its pages.
    fn reads<'a>(&'a self, requests: &[RequestId], lens: &[u64]) -> Vec<SeqRead<'a>> {
        (0..self.spans.len())
            .map(|i| SeqRead { request: requests[i], block_table: &self.pages[self.spans[i].clone()], tokens: lens[i] })
            .collect()
    }
}
