//! A step's reads checked in the engine's own layout, each request through a block table of its
//! own: vLLM's 2-D block table (`check_step`/`verify_step`, and one read as a 1-row table),
//! FlashInfer's paged KV (`check_step_csr`/`verify_step_csr`), PageRefs (`check_step_refs`/
//! `verify_step_refs`). The arrays are read in place where their layout allows, converted
//! otherwise, and judged by the core with the GIL released.

use super::verdict::StepVerdict;
use super::{NUMPY, OwnershipTable, ref_list};
use crate::arrays::IntArray;
use kvguard::{PageId, RequestId, SeqRead};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

impl OwnershipTable {
    /// Checks a step in vLLM's layout; `judged` picks verify over check.
    #[inline]
    pub(super) fn step(
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

    /// Checks a step in FlashInfer's layout.
    #[inline]
    pub(super) fn step_csr(
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
    #[inline]
    pub(super) fn step_refs(
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

/// One block table as a 1-row 2-D array for the step path: a 1-D array gets a new axis (no
/// copy), a sequence becomes an int64 numpy row.
pub(super) fn block_table_row<'py>(py: Python<'py>, block_table: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
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
