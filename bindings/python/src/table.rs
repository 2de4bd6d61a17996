//! `OwnershipTable` for Python: the class, its whole Python surface, its lifecycle (admit,
//! claims, writes, releases, prefixes, forks, imports) and what the table tells; the logic of the
//! larger one-call-per-step entry points lives in the submodules.
//!
//! Every method converts, calls the core table with the GIL released, and converts back; the
//! names lock (request and tenant strings) is taken for the conversion only, never across the
//! core call or while Python code may run.
//!
//! PyO3 takes one `#[pymethods]` block per class (more need its `multiple-pymethods` feature
//! and the `inventory` registry): that block, here, holds each method's signature and docstring,
//! and its body where that is a few lines; a larger call forwards to the submodule of its idea:
//!
//! | module | what it holds |
//! |---|---|
//! | `verdict` | `StepVerdict`, and the core's verdicts and refused events converted into it |
//! | `reads` | a step's reads in the engine's layout: 2-D block tables, FlashInfer's paged KV, PageRefs |
//! | `row_reads` | a step read through rows of one engine table by index: windows, token slots, row caches |
//! | `writes` | a step's shadow claims and KV writes, one call each |
//! | `worker` | vLLM's worker step in one call |
//! | `decode` | SGLang's decode calls, judged against the plugin's mirror |
//! | [`import`] | `ImportTicket`: a KV transfer in flight |

use crate::arrays::IntArray;
use crate::errors::{self, log_violation};
use crate::names::{self, Names, Resolved, StepIds};
use crate::values::{PageInfo, PageRef, PoolConfig, PoolSnapshot, Released, RequestInfo};
use crate::violation::Violation;
use kvguard::{PageId, PrefixKey, RequestId, SeqRead};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};
use reads::block_table_row;
use worker::{StepOutcome, StepRoom};

mod decode;
pub mod import;
mod reads;
mod row_reads;
mod verdict;
mod worker;
mod writes;

pub use import::ImportTicket;
pub use verdict::StepVerdict;

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
    /// The worker step's scratch, kept for the next step (see [`worker::StepRoom`]).
    step_room: Mutex<StepRoom>,
    /// The worker step's block-table rows as last checked clean (see [`OwnershipTable::worker_step`]).
    worker_rows: Mutex<kvguard::RowCache>,
    /// A token-slot table's rows as last checked clean (`cached=True` of verify_step_rows).
    slot_rows: Mutex<kvguard::step::SlotRowCache>,
}

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

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
        self.step_claims(py, req_ids, pages, indptr)
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
        self.step_slot_writes(py, req_ids, slot_mapping, query_start_loc)
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
        self.decode_slot_claims(py, row_keys, row_claimants, page_owner, page_prefix, rows, slots)
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
        self.decode_row_writes(py, row_keys, row_claimants, page_owner, page_prefix, row_checked, rows, cols, slots)
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
        self.decode_forward_check(py, row_keys, row_claimants, row_checked, req_to_token, rows, seq_lens, out_cache_loc)
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
        self.record_and_verify(py, req_ids, block_table, num_computed_tokens, num_scheduled_tokens, events)
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
        self.apply_record_and_verify(py, early, req_ids, block_table, num_computed_tokens, num_scheduled_tokens, late)
    }
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
