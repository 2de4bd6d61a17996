//! `OwnershipTable` for Python, and the one-call-per-step entry points.
//!
//! Every method converts, calls the core table with the GIL released, and converts back; the
//! names lock (request and tenant strings) is taken for the conversion only, never across the
//! core call or while Python code may run.

use crate::arrays::{I64Mut, IntArray, Ints};
use crate::errors::{self, log_violation};
use crate::events::StepEvents;
use crate::mirror;
use crate::names::{self, Names, Resolved, StepIds};
use crate::values::{PageInfo, PageRef, PoolConfig, PoolSnapshot, Released, RequestInfo};
use crate::violation::Violation;
use kvguard::step::{DecodeForward, DecodeOutcome, SlotRead};
use kvguard::{PageId, PrefixKey, RequestId, SeqClaim, SeqRead, SeqWrite};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};

pub mod import;
pub use import::ImportTicket;

/// The ownership table of one KV pool: every page's owner request, tenant, generation and
/// written slots; every attention read checked against it.
///
/// OwnershipTable(config: PoolConfig, *, audit=True)
///
/// Request and tenant ids are ints (0..2**63) or strs (vLLM's request_id, SGLang's rid); strs are
/// interned to unique ids (never hashed) and forgotten when the request is released.
///
/// Naming rule: check_* is pure (returns the verdict, records nothing); verify_* is judged (a
/// violation is counted, sent to the `kvguard` logger, and under policy "enforce" refused with
/// its request quarantined). Mutations (admit, claim, record_*, release*, ...) are always judged
/// and raise ViolationError when refused, under either policy.
///
/// One call per scheduler step, zero copy:
///   verify_step(req_ids, block_tables, seq_lens)                    vLLM's block table
///   verify_step_csr(req_ids, kv_indptr, kv_indices, kv_last_page_len) FlashInfer's paged KV
///   record_step_writes(req_ids, slot_mapping, query_start_loc)      vLLM's slot mapping
///   claim_step(req_ids, pages, indptr)                              a step's shadow claims
///   verify_step_rows(req_ids, table, rows, seq_lens)                rows read in place by index
/// each returning a StepVerdict whose refused_mask marks the rows to abort.
///
/// Thread-safe: reads run in parallel; every other call takes the table's lock for its own
/// duration; the GIL is released while the table works.
#[pyclass(frozen, module = "kvguard")]
pub struct OwnershipTable {
    table: kvguard::OwnershipTable,
    names: Mutex<Names>,
    /// The last step's id objects (see [`names::StepIds`]).
    step_ids: Mutex<StepIds>,
    /// The worker step's scratch, kept for the next step (see [`StepRoom`]).
    step_room: Mutex<StepRoom>,
    /// The worker step's block-table rows as last checked clean (see [`worker_reads`]).
    worker_rows: Mutex<kvguard::RowCache>,
    /// A token-slot table's rows as last checked clean (`cached=True` of verify_step_rows).
    slot_rows: Mutex<kvguard::step::SlotRowCache>,
}

/// The verdict on a step: which rows may not run attention (reads), or whose writes were
/// refused and not recorded (writes).
///
/// clean: no row refused. refused: `[(row, Violation)]` in row order. refused_rows: `[row]`.
/// refused_mask: numpy bool array, one entry per row of the step, True where refused.
#[pyclass(frozen, module = "kvguard")]
pub struct StepVerdict {
    rows: usize,
    refused: Vec<(usize, Py<Violation>)>,
    mask: PyOnceLock<Py<PyAny>>,
}

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

#[pymethods]
impl StepVerdict {
    /// No row was refused.
    #[getter]
    fn clean(&self) -> bool {
        self.refused.is_empty()
    }
    /// Rows in the step.
    #[getter]
    fn rows(&self) -> usize {
        self.rows
    }
    /// [(row, Violation)] for every refused row, in row order.
    #[getter]
    fn refused(&self, py: Python<'_>) -> Vec<(usize, Py<Violation>)> {
        self.refused.iter().map(|(i, v)| (*i, v.clone_ref(py))).collect()
    }
    /// The refused rows, in order.
    #[getter]
    fn refused_rows(&self) -> Vec<usize> {
        self.refused.iter().map(|(i, _)| *i).collect()
    }
    /// The violations, in row order.
    #[getter]
    fn violations(&self, py: Python<'_>) -> Vec<Py<Violation>> {
        self.refused.iter().map(|(_, v)| v.clone_ref(py)).collect()
    }
    /// numpy bool array of `rows` entries, True for each refused row (built on first access).
    #[getter]
    fn refused_mask(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mask = self.mask.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            let np = NUMPY.get_or_try_init(py, || -> PyResult<Py<PyModule>> { Ok(py.import("numpy")?.unbind()) })?;
            let np = np.bind(py);
            let mask = np.call_method1("zeros", (self.rows, np.getattr("bool_")?))?;
            for (i, _) in &self.refused {
                mask.set_item(*i, true)?;
            }
            Ok(mask.unbind())
        })?;
        Ok(mask.clone_ref(py))
    }
    /// Number of refused rows.
    fn __len__(&self) -> usize {
        self.refused.len()
    }
    fn __repr__(&self) -> String {
        format!("StepVerdict(rows={}, refused={:?})", self.rows, self.refused_rows())
    }
}

/// A step's writes: request `i` wrote `slots[qsl[i]..qsl[i + 1]]`. `qsl` has one entry more than
/// `requests`; every range must be within `slots` (one branch-free pass checks them all, then an
/// exact-size collect builds the writes: the common case is two tight loops).
fn step_writes<'a, T: Copy + Into<i64>>(
    requests: &[RequestId],
    qsl: &[T],
    slots: &'a [i64],
) -> PyResult<Vec<SeqWrite<'a>>> {
    let len = slots.len() as i64;
    let bad = |w: &[T]| (w[0].into() < 0) | (w[0].into() > w[1].into()) | (w[1].into() > len);
    if qsl.windows(2).fold(false, |any, w| any | bad(w)) {
        let i = qsl.windows(2).position(bad).unwrap_or(0);
        let (start, end) = (qsl[i].into(), qsl[i + 1].into());
        let what = if start < 0 { "must be >= 0" } else { "is not a range within slot_mapping" };
        return Err(PyValueError::new_err(format!(
            "query_start_loc[{i}..{}] = {start}..{end} {what} (slot_mapping has {len} entries)",
            i + 1
        )));
    }
    Ok(requests
        .iter()
        .zip(qsl.windows(2))
        .map(|(&request, w)| SeqWrite { request, slots: &slots[w[0].into() as usize..w[1].into() as usize] })
        .collect())
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
fn row_index(row: u64) -> PyResult<u32> {
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
fn slot_rows<'a>(
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

/// A prefix key: an int in `0..2**64` (the engine's block hash, radix node id, ...).
fn prefix_key(key: u64) -> PrefixKey {
    PrefixKey(key)
}

/// A page list argument (sequence or 1-D array of non-negative ints).
fn page_list(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<PageId>> {
    let a = IntArray::open(obj, name, 1)?;
    (0..a.len())
        .map(|i| {
            let v = a.get(i, 0);
            u32::try_from(v)
                .map(PageId)
                .map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: page ids are ints in 0..2**32")))
        })
        .collect()
}

/// A step's CSR spans: entry `i` is `indptr[i]..indptr[i + 1]`, each a range within `len` items
/// (`what` names them in the `ValueError`).
fn csr_spans(indptr: &[u64], len: usize, name: &str, what: &str) -> PyResult<Vec<std::ops::Range<usize>>> {
    indptr
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            if w[0] > w[1] || w[1] > len as u64 {
                return Err(PyValueError::new_err(format!(
                    "{name}[{i}..{}] = {}..{} is not a range within {what} (length {len})",
                    i + 1,
                    w[0],
                    w[1]
                )));
            }
            Ok(w[0] as usize..w[1] as usize)
        })
        .collect()
}

/// A 1-D page array as page ids: int32 borrowed as it is, anything else converted into `buf`
/// (a value outside `0..2**32` becomes a page beyond any pool: refused as page_out_of_range).
fn pages_view<'a>(a: &'a IntArray<'_>, buf: &'a mut Vec<PageId>) -> &'a [PageId] {
    match a.row_pages(0) {
        Some(pages) => pages,
        None => {
            a.row_pages_into(0, a.len(), buf);
            buf
        }
    }
}

/// A list of PageRefs.
fn ref_list(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<kvguard::PageRef>> {
    obj.try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a sequence of kvguard.PageRef")))?
        .map(|item| {
            let item = item?;
            item.cast::<PageRef>().map(|r| kvguard::PageRef::from(*r.get())).map_err(|_| {
                PyTypeError::new_err(format!("{name} must hold kvguard.PageRef, got a {}", item.get_type()))
            })
        })
        .collect()
}

fn refs_out(refs: Vec<kvguard::PageRef>) -> Vec<PageRef> {
    refs.into_iter().map(PageRef::from).collect()
}

impl OwnershipTable {
    fn resolve(&self) -> impl FnOnce(&kvguard::Violation) -> Resolved + '_ {
        move |v| self.names.lock().resolve(v)
    }

    /// A core error as a Python exception (a violation logged on the way).
    pub(crate) fn err(&self, py: Python<'_>, e: kvguard::Error) -> PyErr {
        errors::to_py(py, e, self.resolve())
    }

    /// The request a call names (not creating it).
    fn request(&self, obj: &Bound<'_, PyAny>) -> PyResult<RequestId> {
        let key = names::key(obj, "request")?;
        Ok(self.names.lock().request(key))
    }

    /// The requests of a step: a list/tuple of ids (int or str), or a 1-D int array.
    fn step_requests(&self, req_ids: &Bound<'_, PyAny>) -> PyResult<Vec<RequestId>> {
        let mut out = Vec::new();
        self.step_requests_into(req_ids, &mut out)?;
        Ok(out)
    }

    /// [`step_requests`](Self::step_requests) into `out` (its memory kept from the step before).
    fn step_requests_into(&self, req_ids: &Bound<'_, PyAny>, out: &mut Vec<RequestId>) -> PyResult<()> {
        if let Some(read) = names::step_requests(req_ids, &self.names, &self.step_ids, out) {
            return read;
        }
        let a = IntArray::open(req_ids, "req_ids", 1)?;
        out.clear();
        out.extend(a.counts(a.len(), "req_ids")?.into_iter().map(RequestId));
        Ok(())
    }

    /// Converts a step verdict; `judged`: its violations are logged.
    fn verdict(&self, py: Python<'_>, v: kvguard::StepVerdict, rows: usize, judged: bool) -> PyResult<StepVerdict> {
        let resolved: Vec<(usize, kvguard::Violation, Resolved)> = {
            let names = self.names.lock();
            v.refused
                .into_iter()
                .map(|(i, v)| {
                    let r = names.resolve(&v);
                    (i, v, r)
                })
                .collect()
        };
        let mut refused = Vec::with_capacity(resolved.len());
        for (i, v, r) in resolved {
            let v = Violation::wrap(py, v, r)?;
            if judged {
                log_violation(py, &v);
            }
            refused.push((i, v));
        }
        Ok(StepVerdict { rows, refused, mask: PyOnceLock::new() })
    }

    /// Checks a step in vLLM's layout; `judged` picks verify over check.
    fn step(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let bt = IntArray::open(block_tables, "block_tables", 2)?;
        if bt.len() < n {
            return Err(PyValueError::new_err(format!("block_tables has {} rows, {n} requests given", bt.len())));
        }
        let lens = IntArray::open(seq_lens, "seq_lens", 1)?.counts(n, "seq_lens")?;
        let ps = u64::from(self.table.page_size());
        let mut converted = Vec::new();
        let reads = rows_as_reads(&bt, &requests, &lens, ps, &mut converted);
        let table = &self.table;
        let v = py.detach(|| if judged { table.verify_step(&reads) } else { table.check_step(&reads) });
        drop(reads);
        self.verdict(py, v, n, judged)
    }

    /// Checks a step whose block tables are rows of one engine table, read in place by row
    /// index; `token_slots`: the table holds one KV slot per token (page j of a row is its entry
    /// j * page_size over page_size), else one page per entry. With `from_tokens`, request i
    /// reads only the pages from token from_tokens[i] on (its window; see check_step_window).
    /// `cached` (token slots, an int32 table read in place, no window): through the table's
    /// `SlotRowCache`, each row judged from its last clean page where it allows.
    #[allow(clippy::too_many_arguments)]
    fn step_rows(
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
    #[allow(clippy::too_many_arguments)]
    fn rows_step(
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

    /// Checks a step in FlashInfer's layout.
    fn step_csr(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        kv_indptr: &Bound<'_, PyAny>,
        kv_indices: &Bound<'_, PyAny>,
        kv_last_page_len: &Bound<'_, PyAny>,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let indptr = IntArray::open(kv_indptr, "kv_indptr", 1)?.counts(n + 1, "kv_indptr")?;
        let indices = IntArray::open(kv_indices, "kv_indices", 1)?;
        let last = IntArray::open(kv_last_page_len, "kv_last_page_len", 1)?.counts(n, "kv_last_page_len")?;
        let ps = u64::from(self.table.page_size());
        let mut spans = Vec::with_capacity(n);
        for i in 0..n {
            let (a, b) = (indptr[i], indptr[i + 1]);
            if a > b || b > indices.len() as u64 {
                return Err(PyValueError::new_err(format!(
                    "kv_indptr[{i}..{}] = {a}..{b} is not a range within kv_indices (length {})",
                    i + 1,
                    indices.len()
                )));
            }
            spans.push(a as usize..b as usize);
        }
        let converted = if indices.row_pages(0).is_none() {
            let mut c = Vec::with_capacity(indices.len());
            indices.row_pages_into(0, indices.len(), &mut c);
            c
        } else {
            Vec::new()
        };
        let all: &[PageId] = indices.row_pages(0).unwrap_or(&converted);
        let reads: Vec<SeqRead<'_>> = (0..n)
            .map(|i| {
                let pages = spans[i].len() as u64;
                let tokens = if pages == 0 { 0 } else { (pages - 1) * ps + last[i] };
                SeqRead { request: requests[i], block_table: &all[spans[i].clone()], tokens }
            })
            .collect();
        let table = &self.table;
        let v = py.detach(|| if judged { table.verify_step(&reads) } else { table.check_step(&reads) });
        drop(reads);
        self.verdict(py, v, n, judged)
    }

    /// Checks a step through PageRefs; `judged` picks verify over check.
    fn step_refs(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let lens = IntArray::open(seq_lens, "seq_lens", 1)?.counts(n, "seq_lens")?;
        let rows = refs
            .try_iter()
            .map_err(|_| PyTypeError::new_err("refs must be a sequence of sequences of kvguard.PageRef"))?
            .take(n)
            .map(|row| ref_list(&row?, "refs[i]"))
            .collect::<PyResult<Vec<_>>>()?;
        if rows.len() < n {
            return Err(PyValueError::new_err(format!("refs has {} rows, {n} requests given", rows.len())));
        }
        let reads: Vec<SeqRead<'_, kvguard::PageRef>> =
            (0..n).map(|i| SeqRead { request: requests[i], block_table: &rows[i][..], tokens: lens[i] }).collect();
        let table = &self.table;
        let v = py.detach(|| if judged { table.verify_step_refs(&reads) } else { table.check_step_refs(&reads) });
        drop(reads);
        self.verdict(py, v, n, judged)
    }

    /// Converts apply_events' outcome: each refusal logged and wrapped; a non-violation error
    /// raised after the refusals before it are logged.
    fn refused_events(
        &self,
        py: Python<'_>,
        outcome: Result<Vec<crate::events::RefusedEvent>, Box<crate::events::EventError>>,
    ) -> PyResult<Vec<(usize, Py<Violation>)>> {
        let (refused, error) = match outcome {
            Ok(refused) => (refused, None),
            Err(e) => {
                let e = *e;
                (e.refused, Some((e.index, e.error)))
            }
        };
        let mut out = Vec::with_capacity(refused.len());
        for (i, v, r) in refused {
            let v = Violation::wrap(py, v, r)?;
            log_violation(py, &v);
            out.push((i, v));
        }
        match error {
            None => Ok(out),
            Some((i, e)) => {
                let err = self.err(py, e);
                let note = PyValueError::new_err(format!("events[{i}] failed; the events before it were applied"));
                err.set_cause(py, Some(note));
                Err(err)
            }
        }
    }

    /// Runs a mutation with the GIL released and converts its error.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&kvguard::OwnershipTable) -> Result<T, kvguard::Error> + Send,
    ) -> PyResult<T> {
        let table = &self.table;
        py.detach(|| f(table)).map_err(|e| self.err(py, e))
    }
}

#[pymethods]
impl OwnershipTable {
    /// A table for `config`. With audit=True (the default) the start-up audit runs first: a pool
    /// that cannot hold one max-context request raises ConfigError. audit=False only validates
    /// (for replaying what a mis-sized deployment did; admission then refuses what cannot fit).
    #[new]
    #[pyo3(signature = (config, *, audit = true))]
    fn new(config: &PoolConfig, audit: bool) -> PyResult<OwnershipTable> {
        let c = config.inner.clone();
        let table = if audit { kvguard::OwnershipTable::new(c) } else { kvguard::OwnershipTable::new_unaudited(c) };
        let table = table.map_err(|e| match e {
            kvguard::Error::Config(c) => errors::ConfigError::new_err(c.to_string()),
            other => errors::Error::new_err(other.to_string()),
        })?;
        Ok(OwnershipTable {
            table,
            names: Mutex::new(Names::default()),
            step_ids: Mutex::default(),
            step_room: Mutex::default(),
            worker_rows: Mutex::default(),
            slot_rows: Mutex::default(),
        })
    }

    /// The pool configuration.
    #[getter]
    fn config(&self) -> PoolConfig {
        PoolConfig { inner: self.table.config().clone() }
    }

    /// Token slots per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.table.page_size()
    }

    /// Admits `request` of `tenant` with `prompt_tokens` that may generate `max_new_tokens`.
    /// Refused (ViolationError) before any page is touched when the total exceeds the max context
    /// or the pool, or the id is live (duplicate_request).
    fn admit(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        tenant: &Bound<'_, PyAny>,
        prompt_tokens: u64,
        max_new_tokens: u64,
    ) -> PyResult<()> {
        let (rk, tk) = (names::key(request, "request")?, names::key(tenant, "tenant")?);
        let a = self.names.lock().admit(rk, tk);
        let outcome = py.detach(|| self.table.admit(a.request, a.tenant, prompt_tokens, max_new_tokens));
        match outcome {
            Ok(()) => {
                self.names.lock().admitted(a);
                Ok(())
            }
            Err(e) => {
                let err = self.err(py, e);
                self.names.lock().refused(a);
                Err(err)
            }
        }
    }

    /// Allocator mode: hands `n` free pages to `request` (appended to its pages) and returns
    /// them as PageRefs; OutOfPagesError when fewer are free (none is taken then).
    fn allocate(&self, py: Python<'_>, request: &Bound<'_, PyAny>, n: u32) -> PyResult<Vec<PageRef>> {
        let req = self.request(request)?;
        self.run(py, |t| t.allocate(req, n)).map(refs_out)
    }

    /// Shadow mode: the engine's allocator gave `pages` to `request`; all must be free, then
    /// all are claimed (else none). Returns their PageRefs.
    fn claim(&self, py: Python<'_>, request: &Bound<'_, PyAny>, pages: &Bound<'_, PyAny>) -> PyResult<Vec<PageRef>> {
        let req = self.request(request)?;
        let pages = page_list(pages, "pages")?;
        self.run(py, |t| t.claim(req, &pages)).map(refs_out)
    }

    /// Shadow claims of a whole step in one call, under one lock, no PageRefs built: request i's
    /// allocator gave it pages[indptr[i]:indptr[i+1]] (the pages it opened this step).
    ///
    /// req_ids: the step's n requests (list of int/str, or an int array); a request may appear
    ///   more than once (its claims apply in order).
    /// pages: 1-D int32 or int64 array (or sequence) of page ids; int32 is read in place. A
    ///   negative or too-large id is refused as page_out_of_range.
    /// indptr: 1-D int, n + 1 entries, non-decreasing ranges within pages.
    /// Each request's claim is all or nothing and judged exactly as `claim(req_ids[i], ...)`
    /// called for i = 0..n in order would be: a refused one is counted, logged (enforce: its
    /// request quarantined) and marked in the returned StepVerdict; the others are claimed.
    /// At page size 1 this replaces one claim call per running request per decode step.
    fn claim_step(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        indptr: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let pages = IntArray::open(pages, "pages", 1)?;
        let indptr = IntArray::open(indptr, "indptr", 1)?.counts(n + 1, "indptr")?;
        let spans = csr_spans(&indptr, pages.len(), "indptr", "pages")?;
        let mut buf = Vec::new();
        let all = pages_view(&pages, &mut buf);
        let claims: Vec<SeqClaim<'_>> =
            requests.iter().zip(spans).map(|(&request, span)| SeqClaim { request, pages: &all[span] }).collect();
        let table = &self.table;
        let v = py.detach(|| table.claim_step(&claims));
        drop(claims);
        self.verdict(py, v, n, true)
    }

    /// Records that `request` wrote slots start..end of `page`, which it must own exclusively.
    fn record_write(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        page: u32,
        start: u32,
        end: u32,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        self.run(py, |t| t.record_write(req, PageId(page), start..end))
    }

    /// Records that `request` wrote tokens start..end of its sequence through `block_table`
    /// (token t in block t // page_size, slot t % page_size); all or nothing.
    fn record_write_tokens(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        start: u64,
        end: u64,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let pages = page_list(block_table, "block_table")?;
        self.run(py, |t| t.record_write_tokens(req, &pages, start..end))
    }

    /// record_write_tokens through PageRefs: each page must also still be in the incarnation named.
    fn record_write_tokens_refs(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        start: u64,
        end: u64,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let refs = ref_list(refs, "refs")?;
        self.run(py, |t| t.record_write_tokens_refs(req, &refs, start..end))
    }

    /// Records a whole step's KV writes in one call, from the engine's slot mapping.
    ///
    /// req_ids: the step's requests (list of int/str, or int array), n of them.
    /// slot_mapping: 1-D int64 (or int32), one entry per token: page * page_size + offset, -1
    ///   (PADDING_SLOT) for padding; entries past query_start_loc[n] are ignored.
    /// query_start_loc: 1-D int, n + 1 entries: request i wrote tokens
    ///   query_start_loc[i]..query_start_loc[i + 1] of the slot mapping.
    /// Each request is all or nothing; a refused one is judged (counted, logged, quarantined
    /// under enforce) and marked in the returned StepVerdict; the others are recorded.
    fn record_step_writes(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let slots = IntArray::open(slot_mapping, "slot_mapping", 1)?;
        let qsl = IntArray::open(query_start_loc, "query_start_loc", 1)?;
        if qsl.len() < n + 1 {
            return Err(PyValueError::new_err(format!("query_start_loc has {} entries, {} needed", qsl.len(), n + 1)));
        }
        // int64 slots are borrowed as they are; others are converted.
        let copied: Vec<i64> =
            if slots.as_i64().is_none() { (0..slots.len()).map(|j| slots.get(j, 0)).collect() } else { Vec::new() };
        let all: &[i64] = slots.as_i64().unwrap_or(&copied);
        let writes = match qsl.as_ints() {
            Some(Ints::I32(q)) => step_writes(&requests, &q[..=n], all)?,
            Some(Ints::I64(q)) => step_writes(&requests, &q[..=n], all)?,
            None => step_writes(&requests, &(0..=n).map(|i| qsl.get(i, 0)).collect::<Vec<_>>(), all)?,
        };
        let table = &self.table;
        let v = py.detach(|| table.record_step_writes(&writes));
        drop(writes);
        self.verdict(py, v, n, true)
    }

    /// Whether `request` may read its first `tokens` tokens through `block_table`: the
    /// Violation, or None. Pure: counts, logs and quarantines nothing.
    fn check_read(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        tokens: u64,
    ) -> PyResult<Option<Py<Violation>>> {
        let list = PyList::new(py, [request])?;
        let bt = block_table_row(py, block_table)?;
        let lens = PyList::new(py, [tokens])?;
        let v = self.step(py, list.as_any(), &bt, lens.as_any(), false)?;
        Ok(v.refused.into_iter().next().map(|(_, v)| v))
    }

    /// check_read, judged: a violation is counted and logged; under enforce it raises
    /// ViolationError and quarantines `request`, under report the read goes on.
    fn verify_read(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        tokens: u64,
    ) -> PyResult<()> {
        let list = PyList::new(py, [request])?;
        let bt = block_table_row(py, block_table)?;
        let lens = PyList::new(py, [tokens])?;
        let v = self.step(py, list.as_any(), &bt, lens.as_any(), true)?;
        match v.refused.into_iter().next() {
            Some((_, v)) if self.table.config().policy == kvguard::Policy::Enforce => {
                Err(errors::violation_error(py, v))
            }
            _ => Ok(()),
        }
    }

    /// check_read through PageRefs: each page must also still be in the incarnation named.
    fn check_read_refs(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        tokens: u64,
    ) -> PyResult<Option<Py<Violation>>> {
        let req = self.request(request)?;
        let refs = ref_list(refs, "refs")?;
        let outcome = py.detach(|| self.table.check_read_refs(req, &refs, tokens));
        match outcome {
            Ok(()) => Ok(None),
            Err(v) => {
                let r = self.names.lock().resolve(&v);
                Violation::wrap(py, v, r).map(Some)
            }
        }
    }

    /// verify_read through PageRefs.
    fn verify_read_refs(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        tokens: u64,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let refs = ref_list(refs, "refs")?;
        let reads = [SeqRead { request: req, block_table: &refs[..], tokens }];
        let v = py.detach(|| self.table.verify_step_refs(&reads));
        let v = self.verdict(py, v, 1, true)?;
        match v.refused.into_iter().next() {
            Some((_, v)) if self.table.config().policy == kvguard::Policy::Enforce => {
                Err(errors::violation_error(py, v))
            }
            _ => Ok(()),
        }
    }

    /// Pure check of a decode step in vLLM's layout (see verify_step); counts, logs and
    /// quarantines nothing.
    fn check_step(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step(py, req_ids, block_tables, seq_lens, false)
    }

    /// Verifies a whole decode step in one call, without copying the arrays, the GIL released.
    ///
    /// req_ids: the step's n requests (list of int/str, e.g. vLLM's input_batch.req_ids, or an
    ///   int array).
    /// block_tables: 2-D int32 or int64 array with at least n rows (vLLM's
    ///   BlockTable.block_table.np, [max_num_reqs, max_blocks], padded with the null block);
    ///   any row stride. Entries that are negative or beyond the pool are refused as
    ///   page_out_of_range.
    /// seq_lens: 1-D int array (or sequence), tokens each request reads.
    /// Returns a StepVerdict: each refused row is counted, logged and (enforce) its request
    /// quarantined; abort exactly the rows in verdict.refused_mask and keep the batch. Under
    /// report the verdict lists them too; the engine decides.
    fn verify_step(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step(py, req_ids, block_tables, seq_lens, true)
    }

    /// How the worker steps' reads were judged since the table was made: (rows judged from their
    /// last clean page, rows judged in full). record_and_verify_step and
    /// apply_record_and_verify_step read a C-contiguous int32 block table (vLLM's) through the
    /// core's incremental rows; other arrays are checked in full and counted in neither.
    fn worker_row_counts(&self) -> (u64, u64) {
        let cache = self.worker_rows.lock();
        (cache.incremental(), cache.full())
    }

    /// Pure check of a step through a block table the guard holds (see verify_held_rows).
    fn check_held_rows(
        &self,
        py: Python<'_>,
        held: &Bound<'_, crate::rows::HeldBlockTable>,
        req_ids: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let v = crate::rows::held_step(py, &self.table, held.get(), &requests, rows, seq_lens, false)?;
        self.verdict(py, v, requests.len(), false)
    }

    /// A step's reads through a block table the guard holds, judged from what changed: request
    /// i reads its first seq_lens[i] tokens through row rows[i] of `held`, and a row whose
    /// entries checked whole before were not changed since (through held's methods, the only way
    /// they change), read again by the same request who lost nothing since, is judged from its
    /// last page only, without reading the row again (docs/engine-step.md). The verdict is
    /// verify_step's on the same rows, row for row.
    ///
    /// held: a kvguard.HeldBlockTable.
    /// req_ids: the step's n requests (list of int/str, or an int array).
    /// rows: 1-D int, n entries, each a row of `held` (ValueError otherwise).
    /// seq_lens: 1-D int, n entries: tokens each request reads.
    fn verify_held_rows(
        &self,
        py: Python<'_>,
        held: &Bound<'_, crate::rows::HeldBlockTable>,
        req_ids: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let v = crate::rows::held_step(py, &self.table, held.get(), &requests, rows, seq_lens, true)?;
        self.verdict(py, v, requests.len(), true)
    }

    /// Pure check of a step through the engine's block table, incrementally (see verify_rows).
    fn check_rows(
        &self,
        py: Python<'_>,
        cache: &Bound<'_, crate::rows::RowCache>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.rows_step(py, cache, req_ids, table, rows, seq_lens, false)
    }

    /// verify_step_rows across steps, incrementally: request i reads its first seq_lens[i]
    /// tokens through row rows[i] of `table`, and a row unchanged since `cache` last saw it
    /// clean, whose request lost nothing since, is judged from its last page only
    /// (docs/engine-step.md). The verdict is verify_step's on the same rows, row for row.
    ///
    /// cache: a kvguard.RowCache kept for this block table across steps.
    /// req_ids: the step's n requests (list of int/str, or an int array).
    /// table: C-contiguous 2-D int32 array of page ids, read in place (vLLM's block_table.np;
    ///   SGLang's req_to_token at page size 1); ValueError otherwise. A negative entry is
    ///   refused as page_out_of_range.
    /// rows: 1-D int, n entries, each a row of `table` (ValueError otherwise).
    /// seq_lens: 1-D int, n entries: tokens each request reads.
    fn verify_rows(
        &self,
        py: Python<'_>,
        cache: &Bound<'_, crate::rows::RowCache>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.rows_step(py, cache, req_ids, table, rows, seq_lens, true)
    }

    /// Pure check of a step read from a table's rows by index (see verify_step_rows).
    #[pyo3(signature = (req_ids, table, rows, seq_lens, *, token_slots = false, cached = false))]
    #[allow(clippy::too_many_arguments)]
    fn check_step_rows(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        token_slots: bool,
        cached: bool,
    ) -> PyResult<StepVerdict> {
        self.step_rows(py, req_ids, table, rows, seq_lens, None, token_slots, cached, false)
    }

    /// verify_step for engines whose block tables are rows of one big table indexed per
    /// request (SGLang's req_to_token, indexed by req_pool_indices): request i reads its first
    /// seq_lens[i] tokens through row rows[i] of `table`, read in place (no gather, no copy of
    /// int32 page rows), the GIL released.
    ///
    /// req_ids: the step's n requests (list of int/str, or an int array).
    /// table: 2-D int32 or int64 array, any row stride.
    /// rows: 1-D int, n entries, each a row of `table` (ValueError otherwise).
    /// seq_lens: 1-D int, n entries: tokens each request reads.
    /// token_slots: False: one page id per entry (vLLM's layout). True: one KV slot per token
    ///   (page * page_size + offset, SGLang's req_to_token); page j of a request is its entry
    ///   j * page_size divided by page_size (what a paged attention kernel reads), and every
    ///   other entry read must be that page's slot at its offset (a per-token reader reads each
    ///   entry): one that is not is read as the page it names, up to its slot (refused, e.g.
    ///   foreign_page, when that page is not the reader's). A negative entry is refused as
    ///   page_out_of_range.
    /// cached: with token_slots and a C-contiguous int32 table (SGLang's req_to_token), the
    ///   rows go through this table's one SlotRowCache (docs/engine-step.md): a row read again
    ///   by the same request, whose entries of the pages checked whole at its last clean check
    ///   are unchanged byte for byte and from whom nothing was taken since, is judged from the
    ///   page that check ended in; any other row in full. Same verdict, row for row. Ignored
    ///   (every row in full) for any other table.
    /// The verdict is the one verify_step gives on the gathered page table.
    #[pyo3(signature = (req_ids, table, rows, seq_lens, *, token_slots = false, cached = false))]
    #[allow(clippy::too_many_arguments)]
    fn verify_step_rows(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        token_slots: bool,
        cached: bool,
    ) -> PyResult<StepVerdict> {
        self.step_rows(py, req_ids, table, rows, seq_lens, None, token_slots, cached, true)
    }

    /// Pure check of a step through PageRefs (see verify_step_refs).
    fn check_step_refs(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step_refs(py, req_ids, refs, seq_lens, false)
    }

    /// verify_step for engines that keep each page's generation: request i reads its first
    /// seq_lens[i] tokens through refs[i], a sequence of PageRefs (as allocate, claim and
    /// attach_prefix return them). Besides everything verify_step checks, a page released
    /// since its ref was taken is refused as stale_page, even if the same request owns it again.
    fn verify_step_refs(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step_refs(py, req_ids, refs, seq_lens, true)
    }

    /// Pure check of a decode step in FlashInfer's layout (see verify_step_csr).
    fn check_step_csr(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        kv_indptr: &Bound<'_, PyAny>,
        kv_indices: &Bound<'_, PyAny>,
        kv_last_page_len: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step_csr(py, req_ids, kv_indptr, kv_indices, kv_last_page_len, false)
    }

    /// verify_step for FlashInfer's paged-KV layout: request i reads pages
    /// kv_indices[kv_indptr[i]:kv_indptr[i+1]], all full but the last, which holds
    /// kv_last_page_len[i] tokens. int32 or int64, no copy of int32 indices.
    fn verify_step_csr(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        kv_indptr: &Bound<'_, PyAny>,
        kv_indices: &Bound<'_, PyAny>,
        kv_last_page_len: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        self.step_csr(py, req_ids, kv_indptr, kv_indices, kv_last_page_len, true)
    }

    /// Ends `request`: all its pages released (generation bumped), prefix holds dropped,
    /// quarantine lifted; a str id is forgotten. Releasing it again is double_free.
    fn release(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Released> {
        let req = self.request(request)?;
        let outcome = py.detach(|| self.table.release(req));
        let out = outcome.map(Released::from).map_err(|e| self.err(py, e));
        self.names.lock().forget(req);
        out
    }

    /// Releases some of `request`'s pages (sliding window, partial eviction); all or none.
    fn release_pages(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<Released> {
        let req = self.request(request)?;
        let pages = page_list(pages, "pages")?;
        self.run(py, |t| t.release_pages(req, &pages)).map(Released::from)
    }

    /// release_pages through PageRefs.
    fn release_pages_refs(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
    ) -> PyResult<Released> {
        let req = self.request(request)?;
        let refs = ref_list(refs, "refs")?;
        self.run(py, |t| t.release_pages_refs(req, &refs)).map(Released::from)
    }

    /// Preemption: releases all of `request`'s pages and prefix holds but keeps it admitted.
    fn preempt(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Released> {
        let req = self.request(request)?;
        self.run(py, |t| t.preempt(req)).map(Released::from)
    }

    /// With scrub_on_release: the engine poisoned or zeroed these released pages (PageRefs from
    /// Released.scrub); they return to the free list. ScrubError if one is not awaiting a scrub.
    fn confirm_scrubbed(&self, py: Python<'_>, refs: &Bound<'_, PyAny>) -> PyResult<()> {
        let refs = ref_list(refs, "refs")?;
        self.run(py, |t| t.confirm_scrubbed(&refs))
    }

    /// Publishes `pages` of `request` (all its own) as the read-only prefix `key` (an int);
    /// `request` holds it.
    fn publish_prefix(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        key: u64,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let pages = page_list(pages, "pages")?;
        self.run(py, |t| t.publish_prefix(req, prefix_key(key), &pages))
    }

    /// publish_prefix through PageRefs.
    fn publish_prefix_refs(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        key: u64,
        refs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let refs = ref_list(refs, "refs")?;
        self.run(py, |t| t.publish_prefix_refs(req, prefix_key(key), &refs))
    }

    /// `request` holds prefix `key` and may read its pages (returned in published order).
    /// Another tenant's prefix is cross_tenant_share unless that tenant allows sharing.
    fn attach_prefix(&self, py: Python<'_>, request: &Bound<'_, PyAny>, key: u64) -> PyResult<Vec<PageRef>> {
        let req = self.request(request)?;
        self.run(py, |t| t.attach_prefix(req, prefix_key(key))).map(refs_out)
    }

    /// `request` lets go of prefix `key`.
    fn detach_prefix(&self, py: Python<'_>, request: &Bound<'_, PyAny>, key: u64) -> PyResult<Released> {
        let req = self.request(request)?;
        self.run(py, |t| t.detach_prefix(req, prefix_key(key))).map(Released::from)
    }

    /// The cache drops prefix `key`; its pages are released. evict_in_use while held.
    fn evict_prefix(&self, py: Python<'_>, key: u64) -> PyResult<Released> {
        self.run(py, |t| t.evict_prefix(prefix_key(key))).map(Released::from)
    }

    /// Lets other tenants attach to `tenant`'s prefixes (off by default).
    fn allow_cross_tenant_sharing(&self, tenant: &Bound<'_, PyAny>, allow: bool) -> PyResult<()> {
        let key = names::key(tenant, "tenant")?;
        let id = self.names.lock().share(key, allow);
        self.table.allow_cross_tenant_sharing(id, allow);
        Ok(())
    }

    /// Parallel sampling: `child` is admitted for the same tenant, holding `parent`'s pages
    /// read-only (writes to them are refused; copy-on-write is the engine's move).
    fn fork(&self, py: Python<'_>, parent: &Bound<'_, PyAny>, child: &Bound<'_, PyAny>) -> PyResult<()> {
        let parent = self.request(parent)?;
        let ck = names::key(child, "child")?;
        let a = self.names.lock().fork(parent, ck);
        match py.detach(|| self.table.fork(parent, a.request)) {
            Ok(()) => {
                self.names.lock().admitted(a);
                Ok(())
            }
            Err(e) => {
                let err = self.err(py, e);
                self.names.lock().refused(a);
                Err(err)
            }
        }
    }

    /// Records a KV transfer that wrote `tokens` tokens into `request`'s `pages` from the first
    /// slot, when it expected `expected`; a different count is token_count_mismatch and nothing
    /// is recorded.
    fn record_import(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        tokens: u64,
        expected: u64,
    ) -> PyResult<()> {
        let req = self.request(request)?;
        let pages = page_list(pages, "pages")?;
        self.run(py, |t| t.record_import(req, &pages, tokens, expected))
    }

    /// Starts a KV transfer into `refs` (PageRefs of `request`'s own pages, in exactly those
    /// incarnations) and returns its ImportTicket: the pages are pinned until the ticket is
    /// finished or aborted (a release meanwhile keeps them out of the free list). Call it before
    /// any byte lands; a page already receiving a transfer is import_in_flight.
    ///
    ///   with table.begin_import("cmpl-7", refs) as ticket:
    ///       ...  # the bytes land, the manifest is accepted
    ///       ticket.finish(tokens, expected)
    fn begin_import(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        refs: &Bound<'_, PyAny>,
    ) -> PyResult<ImportTicket> {
        let req = slf.get().request(request)?;
        let refs = ref_list(refs, "refs")?;
        ImportTicket::begin(slf, request, req, &refs)
    }

    /// The pages whose tags changed since the last call, with what the table knows of each now:
    /// [(page, PageInfo)], each page once however often it changed. What a mirror of the tags
    /// (a device copy, an engine's own view) must refresh. Tracking starts with the first call,
    /// which lists every page of the pool.
    fn take_changed_pages(&self, py: Python<'_>) -> PyResult<Vec<(u32, PageInfo)>> {
        let changed = py.detach(|| self.table.take_changed_pages());
        let resolved: Vec<_> = {
            let names = self.names.lock();
            changed
                .into_iter()
                .map(|(page, info)| {
                    let owner = info.owner.map(|r| names.request_id(r));
                    let tenant = info.tenant.map(|t| names.tenant_id(t));
                    (page, info, owner, tenant)
                })
                .collect()
        };
        resolved
            .into_iter()
            .map(|(page, info, owner, tenant)| Ok((page.0, PageInfo::new(py, info, owner, tenant)?)))
            .collect()
    }

    /// Counts and logs a violation found outside the table (a check_* verdict the caller acts
    /// on), and under enforce quarantines its request.
    fn record_violation(&self, py: Python<'_>, violation: &Bound<'_, Violation>) {
        let v = violation.get().inner.clone();
        py.detach(|| self.table.record_violation(v));
        log_violation(py, &violation.clone().unbind());
    }

    /// Page counts by state and other totals.
    fn snapshot(&self, py: Python<'_>) -> PoolSnapshot {
        py.detach(|| self.table.snapshot()).into()
    }

    /// What the table knows about `page`, or None for an int that names no page of the pool
    /// (past its end, or negative).
    fn page_info(&self, py: Python<'_>, page: &Bound<'_, PyAny>) -> PyResult<Option<PageInfo>> {
        // Any int names a page or no page: one outside 0..2**32 (-1, say) is no page, like one
        // past the pool; what is not an int is a TypeError.
        let page = match page.extract::<u32>() {
            Ok(p) => p,
            Err(_) if page.is_instance_of::<pyo3::types::PyInt>() => return Ok(None),
            Err(_) => {
                let ty = page.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                return Err(pyo3::exceptions::PyTypeError::new_err(format!("page must be an int, got {ty}")));
            }
        };
        let Some(info) = self.table.page_info(PageId(page)) else { return Ok(None) };
        let (owner, tenant) = {
            let names = self.names.lock();
            (info.owner.map(|r| names.request_id(r)), info.tenant.map(|t| names.tenant_id(t)))
        };
        PageInfo::new(py, info, owner, tenant).map(Some)
    }

    /// What the table knows about an admitted request, or None.
    fn request_info(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Option<RequestInfo>> {
        let req = self.request(request)?;
        let Some(info) = self.table.request_info(req) else { return Ok(None) };
        let tenant = self.names.lock().tenant_id(info.tenant);
        RequestInfo::new(py, info, tenant).map(Some)
    }

    /// Violations seen per kind: {kind: count}, non-zero kinds only.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (kind, n) in self.table.counters().nonzero() {
            d.set_item(kind.as_str(), n)?;
        }
        Ok(d)
    }

    /// Takes the logged violations (the last 1,024), oldest first. str ids of requests already
    /// released read as their interned ints.
    fn drain_violations(&self, py: Python<'_>) -> PyResult<Vec<Py<Violation>>> {
        let drained = self.table.drain_violations();
        let resolved: Vec<(kvguard::Violation, Resolved)> = {
            let names = self.names.lock();
            drained
                .into_iter()
                .map(|v| {
                    let r = names.resolve(&v);
                    (v, r)
                })
                .collect()
        };
        resolved.into_iter().map(|(v, r)| Violation::wrap(py, v, r)).collect()
    }

    /// The int id the table uses for `request`: the int itself, or a live str's interned id (what
    /// a transfer manifest must carry; see kvguard.Manifest).
    fn request_key(&self, request: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.request(request)?.0)
    }

    /// The int id the table uses for `tenant`: the int itself, or a held str's interned id.
    fn tenant_key(&self, tenant: &Bound<'_, PyAny>) -> PyResult<u64> {
        let key = names::key(tenant, "tenant")?;
        Ok(self.names.lock().tenant(key).0)
    }

    /// (requests, tenants): str ids interned now. Flat over any number of released requests.
    fn interned(&self) -> (usize, usize) {
        self.names.lock().len()
    }

    fn __repr__(&self) -> String {
        let s = self.table.snapshot();
        format!(
            "<kvguard.OwnershipTable {} pages x {} slots, policy {:?}: {} free, {} owned, {} shared, {} requests>",
            s.total_pages,
            self.table.page_size(),
            self.table.config().policy,
            s.free,
            s.owned,
            s.shared,
            s.requests
        )
    }

    // ---- the forward window (SGLang decode forwards) ----------------------------------------

    /// check_step_rows over each request's window only: request i reads tokens
    /// from_tokens[i]..seq_lens[i] of row rows[i], i.e. the pages holding them (from page
    /// from_tokens[i] // page_size on), judged as a read of those pages for
    /// seq_lens[i] - first_page * page_size tokens. Pure: counts, logs and quarantines nothing.
    ///
    /// For an engine that checked each row in full once and knows nothing before from_tokens[i]
    /// changed since (the row's entries and the pages they name): a decode step then checks one
    /// page per request instead of its whole row. from_tokens[i] = 0 checks the whole row; a
    /// from_tokens[i] beyond seq_lens[i] is taken as seq_lens[i] (nothing unchecked).
    /// A window that is clean here is clean in the full check; a refused one is what the engine
    /// must judge with verify_step_rows (the violation's page index is relative to the window).
    ///
    /// req_ids, table, rows, seq_lens, token_slots: as verify_step_rows.
    /// from_tokens: 1-D int, n entries, non-negative (ValueError otherwise).
    #[pyo3(signature = (req_ids, table, rows, seq_lens, from_tokens, *, token_slots = false))]
    #[allow(clippy::too_many_arguments)]
    fn check_step_window(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        from_tokens: &Bound<'_, PyAny>,
        token_slots: bool,
    ) -> PyResult<StepVerdict> {
        self.step_rows(py, req_ids, table, rows, seq_lens, Some(from_tokens), token_slots, false, false)
    }

    /// A decode step's block-table writes, one slot per request, judged in one call against the
    /// engine's own mirror of page owners (kvguard.sglang's): request row_keys[rows[i]] wrote
    /// slot slots[i] (page slots[i] // page_size) into row rows[i].
    ///
    /// A page its row's request already owns in the mirror (page_owner[page] == its key) is
    /// nothing new. A new page of a plain row (row_claimants[row] != 0: its request is live) that
    /// is no prefix (page_prefix[page] == 0) is claimed for it: all such claims in one claim_step
    /// (judged: a refusal is counted, logged, quarantined under enforce). Anything else is left
    /// to the engine: its positions are returned, in order. Nothing is written to the arrays.
    ///
    /// row_keys, row_claimants: 1-D int, one entry per row of the engine's table.
    /// page_owner, page_prefix: 1-D int, one entry per page of the pool and one more
    ///   (num_pages + 1; a page outside the pool reads as that last entry, and is claimed, so
    ///   the table refuses it, whatever the entry holds).
    /// rows, slots: 1-D int, n entries each (rows within row_keys, ValueError otherwise).
    /// Positions of one row in one new page claim it once.
    /// Returns (StepVerdict over the claims made, in order; [positions left to the engine];
    /// granted: numpy int64 array of shape (m, 2), the (page, key) of each claim granted: what
    /// the engine's page_owner must now say).
    #[allow(clippy::too_many_arguments)]
    fn claim_decode_slots(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        page_owner: &Bound<'_, PyAny>,
        page_prefix: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<(StepVerdict, Vec<usize>, Py<PyAny>)> {
        let owner = IntArray::open(page_owner, "page_owner", 1)?;
        let arrays = MirrorArrays::open(row_keys, row_claimants, page_prefix, rows, slots)?;
        let owner = mirror::Lookup::new(&owner);
        let l = arrays.lookups();
        let mirror = l.mirror(&owner, self.table.config().num_pages)?;
        let writes = kvguard::step::decode_writes(mirror, &owner, &arrays.rows, &l.slots, self.table.page_size())
            .map_err(mirror::mirror_error)?;
        let table = &self.table;
        let v = py.detach(|| table.claim_decode(&writes));
        // (page, key) pairs as little-endian int64 bytes, numpy's view of them below.
        let never = self.table.config().num_pages as usize;
        let mut granted: Vec<u8> = Vec::with_capacity(writes.claims.len() * 16);
        for c in writes.granted(&v).filter(|c| c.at(never) < never) {
            granted.extend_from_slice(&i64::from(c.page.0).to_le_bytes());
            granted.extend_from_slice(&(c.request.0 as i64).to_le_bytes());
        }
        let np = NUMPY.get_or_try_init(py, || -> PyResult<Py<PyModule>> { Ok(py.import("numpy")?.unbind()) })?;
        let granted = np
            .bind(py)
            .call_method1("frombuffer", (pyo3::types::PyBytes::new(py, &granted), "<i8"))?
            .call_method1("reshape", (-1, 2))?;
        Ok((self.verdict(py, v, writes.claims.len(), true)?, writes.left, granted.unbind()))
    }

    /// claim_decode_slots with the mirror updated in place, for a decode step's req_to_token
    /// write (rows[i], cols[i]) = slots[i], one slot per row: each row's checked length
    /// row_checked[rows[i]] drops to cols[i] where that is lower (a negative column: to 0; one
    /// column applies to every row), and each claim granted sets page_owner[page] to its key.
    ///
    /// row_keys, row_claimants, page_prefix, rows, slots: as claim_decode_slots.
    /// page_owner: as claim_decode_slots, and writable int64 (numpy); row_checked: writable
    ///   int64, one entry per row of row_keys (TypeError / ValueError otherwise, nothing changed).
    /// Returns None when every row's page was its own or claimed cleanly (the common step:
    /// nothing is built); otherwise (StepVerdict over the claims made, [positions left to the
    /// engine]), as claim_decode_slots says them.
    #[pyo3(signature = (row_keys, row_claimants, page_owner, page_prefix, row_checked, rows, cols, slots))]
    #[allow(clippy::too_many_arguments)]
    fn write_decode_rows(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        page_owner: &Bound<'_, PyAny>,
        page_prefix: &Bound<'_, PyAny>,
        row_checked: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        cols: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(StepVerdict, Vec<usize>)>> {
        let owner = I64Mut::open(page_owner, "page_owner")?;
        let arrays = MirrorArrays::open(row_keys, row_claimants, page_prefix, rows, slots)?;
        let checked = I64Mut::open(row_checked, "row_checked")?;
        let cols = IntArray::open(cols, "cols", 1)?;
        let read = [
            (&arrays.keys, "row_keys"),
            (&arrays.claimants, "row_claimants"),
            (&arrays.prefix, "page_prefix"),
            (&arrays.slots, "slots"),
            (&cols, "cols"),
        ];
        owner.apart("page_owner", &read, Some((&checked, "row_checked")))?;
        checked.apart("row_checked", &read, None)?;
        let cols = mirror::Lookup::new(&cols);
        let l = arrays.lookups();
        let mirror = l.mirror(&mirror::Written(&owner), self.table.config().num_pages)?;
        let write = kvguard::step::DecodeRowWrite { rows: &arrays.rows, cols: &cols, slots: &l.slots };
        // The core's write_decode_rows in its three parts: the plugin's arrays are read and
        // written with the GIL held (their SAFETY: see I64Mut), the table's claims made with it
        // released (as every call into the table is). Everything is checked before anything
        // changes.
        let (mut owner_w, mut checked_w) = (mirror::Written(&owner), mirror::Written(&checked));
        let writes =
            write.sort(mirror, &owner_w, checked.len(), self.table.page_size()).map_err(mirror::mirror_error)?;
        let table = &self.table;
        let v = if writes.claims.is_empty() {
            kvguard::StepVerdict::default() // the common step: nothing to claim, no GIL round trip
        } else {
            py.detach(|| table.claim_decode(&writes))
        };
        write.update_mirror(&writes, &v, &mut owner_w, &mut checked_w);
        if v.is_clean() && writes.left.is_empty() {
            return Ok(None);
        }
        Ok(Some((self.verdict(py, v, writes.claims.len(), true)?, writes.left)))
    }

    /// A decode forward's first KV store against the mirror, in one call: request
    /// row_keys[rows[i]] wrote slot out_cache_loc[i] (one token per row), recorded as
    /// record_step_writes records it (judged); then each row's window, its tokens
    /// row_checked[rows[i]]..seq_lens[i] of req_to_token's row rows[i] (token slots), checked
    /// as check_step_window checks it (pure). When both are clean, row_checked[rows[i]] =
    /// seq_lens[i] and None is returned.
    ///
    /// Otherwise a tuple says where it stopped, and what is left is the engine's:
    /// ("full", None): a row of no live request (row_claimants[rows[i]] == 0), or not one slot
    ///   per row: nothing was done (record and verify the step as a whole);
    /// ("writes", StepVerdict): the writes' judged verdict refused some; only the clean rows'
    ///   writes were recorded, nothing was read;
    /// ("window", None): the writes were recorded and the window check found something (judge
    ///   the rows with verify_step_rows).
    ///
    /// row_keys, row_claimants: 1-D int, one entry per row; row_checked: writable int64, one
    /// entry per row; req_to_token: 2-D int (the engine's token slots per row); rows: 1-D int
    /// within row_keys; seq_lens, out_cache_loc: 1-D int, one entry per row, non-negative
    /// (TypeError / ValueError otherwise, nothing done).
    #[pyo3(signature = (row_keys, row_claimants, row_checked, req_to_token, rows, seq_lens, out_cache_loc))]
    #[allow(clippy::too_many_arguments)]
    fn check_decode_forward(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        row_checked: &Bound<'_, PyAny>,
        req_to_token: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        out_cache_loc: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(&'static str, Option<StepVerdict>)>> {
        let keys = IntArray::open(row_keys, "row_keys", 1)?;
        let claimants = IntArray::open(row_claimants, "row_claimants", 1)?;
        mirror::check_rows("row_claimants", claimants.len(), keys.len())?;
        let checked = I64Mut::open(row_checked, "row_checked")?;
        mirror::check_rows("row_checked", checked.len(), keys.len())?;
        let t = IntArray::open(req_to_token, "req_to_token", 2)?;
        let rows = IntArray::open(rows, "rows", 1)?;
        let n = rows.len();
        // Rows and lengths are checked, then read in place (no list of them).
        mirror::check_step_rows(&rows, keys.len(), t.len())?;
        let row_at = mirror::Lookup::new(&rows);
        if u32::try_from(t.len()).is_err() {
            // Rows past u32::MAX exist in such a table: the core names rows in 32 bits.
            (0..n).try_for_each(|i| row_index(row_at.at(i) as u64).map(drop))?;
        }
        let lens = IntArray::open(seq_lens, "seq_lens", 1)?;
        mirror::check_positions("seq_lens", lens.len(), n)?;
        lens.check_counts(n, "seq_lens")?;
        let len_at = mirror::Lookup::new(&lens);
        let loc = IntArray::open(out_cache_loc, "out_cache_loc", 1)?;
        // Nothing read in place may share memory with row_checked, which this call writes.
        checked.apart(
            "row_checked",
            &[
                (&keys, "row_keys"),
                (&claimants, "row_claimants"),
                (&t, "req_to_token"),
                (&loc, "out_cache_loc"),
                (&rows, "rows"),
                (&lens, "seq_lens"),
            ],
            None,
        )?;
        // The mirror's int64 arrays read as slices (the per-row loops below are the call's cost).
        let (key_of, live) = (mirror::Lookup::new(&keys), mirror::Lookup::new(&claimants));
        if loc.len() != n {
            return Ok(Some(("full", None)));
        }
        // A row whose request claims nothing makes it a full check (nothing changed by it).
        if !(0..n).all(|i| live.at(row_at.at(i) as usize) != 0) {
            return Ok(Some(("full", None)));
        }
        let copied: Vec<i64>;
        let slots: &[i64] = match loc.as_i64() {
            Some(s) => s,
            None => {
                copied = (0..n).map(|i| loc.get(i, 0)).collect();
                &copied
            }
        };
        // Read `i`: its window starts at its row's checked length (rows and lengths checked
        // above: non-negative, within the arrays).
        let read = |i: usize| {
            let r = row_at.at(i) as usize;
            SlotRead {
                request: RequestId(key_of.at(r) as u64),
                row: r as u32,
                from: checked.get(r).max(0) as u64,
                tokens: len_at.at(i) as u64,
            }
        };
        let core = &self.table;
        // Each row's checked length as its window was read from (a row twice in the step moves
        // once, from the first).
        let read_from: Vec<i64> = (0..n).map(|i| checked.get(row_at.at(i) as usize)).collect();
        // The GIL stays held: the reads are made from the plugin's mirror and SGLang's arrays as
        // the core judges them (the arrays are read only with it), and the core calls no Python,
        // so the table's lock is never held by a thread that waits for the GIL.
        let outcome = match t.as_i32_rows() {
            // SGLang's int32 table, in place: nothing lists the step's reads.
            Some((entries, width)) => {
                let table =
                    kvguard::BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(e.to_string()))?;
                core.decode_forward_by(n, read, slots, table)
            }
            // Any other table: the reads listed, their windows converted to int32.
            None => {
                let reads: Vec<SlotRead> = (0..n).map(read).collect();
                let mut converted = Vec::new();
                let (table, reads) = slot_rows(&t, reads, core.config(), &mut converted)?;
                core.decode_forward(&DecodeForward { reads: &reads, slots, rows: table })
            }
        }
        .map_err(step_error)?;
        match outcome {
            DecodeOutcome::Writes(written) => return Ok(Some(("writes", Some(self.verdict(py, written, n, true)?)))),
            DecodeOutcome::Window(_) => return Ok(Some(("window", None))),
            DecodeOutcome::Clean => {}
        }
        // Each row's checked length moves up to its length from the value its window was read
        // from (a row named twice: once).
        for (i, &was) in read_from.iter().enumerate() {
            let r = row_at.at(i) as usize;
            if checked.get(r) == was {
                checked.set(r, len_at.at(i));
            }
        }
        Ok(None)
    }

    // -- one call per step for an engine plugin (kvguard.vllm) ---------------------------------

    /// Applies a step's ownership events in order, in one call (the GIL released): what the
    /// single-event methods would do called one by one, judged the same way (a refused event is
    /// counted, logged and, under enforce, its request quarantined), and the rest applied.
    ///
    /// events: a list of tuples, each one of
    ///   ("admit", request, tenant, prompt_tokens, max_new_tokens)
    ///   ("claim", request, pages)            (a run of claims goes to the table as one claim_step)
    ///   ("release", request)  ("preempt", request)
    ///   ("publish", request, key, pages)  ("attach", request, key)  ("detach", request, key)
    ///   ("evict", request or None, key)      (request: whom the eviction is charged to; not read)
    ///   ("release_pages", request, pages)    (the request lets go of these pages, keeps the rest)
    /// Every event is checked first: a malformed one raises TypeError/ValueError and nothing is
    /// applied. Returns [(index, Violation)] of the refused events, in order. An error that is not
    /// a violation (e.g. OutOfPagesError) is raised at the event that hit it; the events before
    /// it stay applied.
    fn apply_events(&self, py: Python<'_>, events: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, Py<Violation>)>> {
        let events = crate::events::parse(events)?;
        let outcome = py.detach(|| crate::events::apply(&self.table, &self.names, &events));
        self.refused_events(py, outcome)
    }

    /// One worker step of vLLM in one call: records the step's KV writes, applies `events`,
    /// then verifies the block table, all from the arrays the worker is about to copy to the
    /// GPU (no slot mapping built in Python, no copy of int32 rows), the GIL released.
    ///
    /// req_ids: the step's n requests (list of int/str, e.g. input_batch.req_ids, or an int array).
    /// block_table: 2-D int32 or int64, at least n rows (BlockTable.block_table.np); row i is
    ///   req_ids[i]'s, page j holding tokens j*page_size .. (j+1)*page_size.
    /// num_computed_tokens: 1-D int, at least n entries: tokens each request had before the step.
    /// num_scheduled_tokens: 1-D int, at least n entries: tokens it writes this step, at positions
    ///   num_computed_tokens[i] + 0.. (the slot mapping vLLM's kernel computes from the same rows:
    ///   row[pos // page_size] * page_size + pos % page_size; a position past the row's width
    ///   takes its last entry). At most width * page_size per request (ValueError otherwise).
    /// events: None or a list as apply_events takes, applied after the writes and before the
    ///   reads (publishes of blocks the step fills, prefix hits on them).
    /// Returns (writes, refused_events, reads): the writes' StepVerdict (as record_step_writes),
    /// [(index, Violation)] of the refused events, and the reads' StepVerdict (as verify_step,
    /// each request reading num_computed_tokens[i] + num_scheduled_tokens[i] tokens).
    #[pyo3(signature = (req_ids, block_table, num_computed_tokens, num_scheduled_tokens, events = None))]
    fn record_and_verify_step(
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

    /// vLLM's whole worker step in one call, the GIL released once: applies the step's `early`
    /// events (admissions, claims, evictions, releases, preemptions, as apply_events), then what
    /// record_and_verify_step does with `late` as its events (the writes, the late events, the
    /// reads). One entry instead of apply_events + record_and_verify_step: the same judgements,
    /// in the same order.
    ///
    /// Every event of both lists, every array and every req_ids entry (an int in 0..2**63 or a
    /// str) is checked before anything is applied. The requests of req_ids are read after the
    /// early events (a request they admit or release reads as it does then). Returns
    /// (refused_early, writes, refused_late, reads): the refused events of each list as
    /// [(index, Violation)] and the two StepVerdicts. An error that is not
    /// a violation (e.g. OutOfPagesError) is raised at the event that hit it, with what came
    /// before it applied.
    #[pyo3(signature = (early, req_ids, block_table, num_computed_tokens, num_scheduled_tokens, late = None))]
    #[allow(clippy::too_many_arguments)]
    fn apply_record_and_verify_step(
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
struct StepRoom {
    early: kvguard::step::EventBatch,
    late: kvguard::step::EventBatch,
    requests: Vec<RequestId>,
}

/// What apply_record_and_verify_step returns: (refused early events, writes, refused late
/// events, reads).
type StepOutcome = (crate::events::RefusedForPython, StepVerdict, crate::events::RefusedForPython, StepVerdict);

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
fn step_error(e: kvguard::step::StepError) -> PyErr {
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

/// The step's reads from a 2-D block table: request `i` reads its first `tokens[i]` tokens
/// through row `i` (`tokens` and `requests` as long as each other, at most the table's rows).
/// int32 rows are borrowed as they are; other rows are converted into `converted`, one buffer
/// for all, only the pages each read covers.
fn rows_as_reads<'a>(
    bt: &'a IntArray<'_>,
    requests: &[RequestId],
    tokens: &[u64],
    page_size: u64,
    converted: &'a mut Vec<PageId>,
) -> Vec<SeqRead<'a>> {
    let mut spans = Vec::new();
    if !tokens.is_empty() && bt.row_pages(0).is_none() {
        for (i, &t) in tokens.iter().enumerate() {
            let need = usize::try_from(t.div_ceil(page_size)).unwrap_or(usize::MAX).min(bt.width());
            let start = converted.len();
            bt.row_pages_into(i, need, converted);
            spans.push(start..converted.len());
        }
    }
    let converted: &'a Vec<PageId> = converted;
    requests
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (&request, &tokens))| SeqRead {
            request,
            block_table: match bt.row_pages(i) {
                Some(row) => row,
                None => &converted[spans[i].clone()],
            },
            tokens,
        })
        .collect()
}

impl OwnershipTable {
    /// The core table (for the transfer receiver and the device guard).
    pub fn core(&self) -> &kvguard::OwnershipTable {
        &self.table
    }

    /// The names lock (for the transfer receiver).
    pub fn names(&self) -> &Mutex<Names> {
        &self.names
    }
}

/// One block table as a 1-row 2-D array for the step path: a 1-D array gets a new axis (no
/// copy), a sequence becomes an int64 numpy row.
fn block_table_row<'py>(py: Python<'py>, block_table: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let np = NUMPY.get_or_try_init(py, || -> PyResult<Py<PyModule>> { Ok(py.import("numpy")?.unbind()) })?;
    let np = np.bind(py);
    let arr = np.call_method1("asarray", (block_table,))?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!("block_table must be 1-D, got {ndim} dimensions")));
    }
    if arr.getattr("size")?.extract::<usize>()? == 0 {
        return np.call_method1("zeros", ((1, 0), np.getattr("int32")?));
    }
    arr.call_method1("reshape", ((1, -1),))
}

/// A step verdict's violations with their ids resolved now (the names lock only; no Python).
fn resolved(names: &Mutex<Names>, v: kvguard::StepVerdict) -> Vec<(usize, kvguard::Violation, Resolved)> {
    if v.refused.is_empty() {
        return Vec::new();
    }
    let names = names.lock();
    v.refused
        .into_iter()
        .map(|(i, v)| {
            let r = names.resolve(&v);
            (i, v, r)
        })
        .collect()
}

/// A judged step verdict for Python from resolved violations, each logged.
fn judged_verdict(
    py: Python<'_>,
    refused: Vec<(usize, kvguard::Violation, Resolved)>,
    rows: usize,
) -> PyResult<StepVerdict> {
    let mut out = Vec::with_capacity(refused.len());
    for (i, v, r) in refused {
        let v = Violation::wrap(py, v, r)?;
        log_violation(py, &v);
        out.push((i, v));
    }
    Ok(StepVerdict { rows, refused: out, mask: PyOnceLock::new() })
}

/// The mirror's read-only arrays and a decode row write's positions, opened (each argument's
/// type checked, named in its error); the core checks their lengths against each other.
struct MirrorArrays<'py> {
    keys: IntArray<'py>,
    claimants: IntArray<'py>,
    prefix: IntArray<'py>,
    rows: Vec<u64>,
    slots: IntArray<'py>,
}

impl<'py> MirrorArrays<'py> {
    fn open(
        row_keys: &Bound<'py, PyAny>,
        row_claimants: &Bound<'py, PyAny>,
        page_prefix: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let keys = IntArray::open(row_keys, "row_keys", 1)?;
        let claimants = IntArray::open(row_claimants, "row_claimants", 1)?;
        let prefix = IntArray::open(page_prefix, "page_prefix", 1)?;
        let rows = IntArray::open(rows, "rows", 1)?;
        let rows = rows.counts(rows.len(), "rows")?;
        let slots = IntArray::open(slots, "slots", 1)?;
        Ok(MirrorArrays { keys, claimants, prefix, rows, slots })
    }

    fn lookups(&self) -> MirrorLookups<'_, 'py> {
        MirrorLookups {
            keys: mirror::Lookup::new(&self.keys),
            claimants: mirror::Lookup::new(&self.claimants),
            prefix: mirror::Lookup::new(&self.prefix),
            slots: mirror::Lookup::new(&self.slots),
        }
    }
}

/// [`MirrorArrays`] read by index, as the core reads them.
struct MirrorLookups<'a, 'py> {
    keys: mirror::Lookup<'a, 'py>,
    claimants: mirror::Lookup<'a, 'py>,
    prefix: mirror::Lookup<'a, 'py>,
    slots: mirror::Lookup<'a, 'py>,
}

impl<'a, 'py> MirrorLookups<'a, 'py> {
    /// The core's mirror, checked against `page_owner` and the pool (`ValueError` naming the
    /// array).
    fn mirror(
        &self,
        page_owner: &impl kvguard::step::Ints,
        pool_pages: u32,
    ) -> PyResult<kvguard::step::PoolMirror<'_, mirror::Lookup<'a, 'py>>> {
        kvguard::step::PoolMirror::new(&self.keys, &self.claimants, &self.prefix, page_owner, pool_pages)
            .map_err(mirror::mirror_error)
    }
}
