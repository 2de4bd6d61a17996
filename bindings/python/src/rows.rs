//! `kvguard.RowCache`, and a step read through an engine's block table in place and judged
//! incrementally by the core (`OwnershipTable::verify_rows`): the binding only opens the arrays.

use crate::arrays::IntArray;
use kvguard::{BlockRows, RequestId, RowRead};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// What an engine's block table rows were last checked clean as, kept across steps:
/// OwnershipTable.verify_rows judges a row unchanged since then from its last page only
/// (docs/engine-step.md). One per block table; given to another table it starts over.
#[pyclass(frozen, module = "kvguard")]
pub struct RowCache {
    cache: Mutex<kvguard::RowCache>,
}

#[pymethods]
impl RowCache {
    #[new]
    fn new() -> RowCache {
        RowCache { cache: Mutex::new(kvguard::RowCache::new()) }
    }

    /// Rows judged from their last clean page since the cache was made.
    #[getter]
    fn incremental(&self) -> PyResult<u64> {
        Ok(self.lock()?.incremental())
    }

    /// Rows judged in full since the cache was made.
    #[getter]
    fn full(&self) -> PyResult<u64> {
        Ok(self.lock()?.full())
    }

    /// Forgets every row: the next step checks each in full.
    fn clear(&self) -> PyResult<()> {
        self.lock()?.clear();
        Ok(())
    }

    fn __repr__(&self) -> String {
        match self.cache.try_lock() {
            Some(c) => format!("RowCache(incremental={}, full={})", c.incremental(), c.full()),
            None => "RowCache(<in use>)".to_owned(),
        }
    }
}

impl RowCache {
    /// The cache, or RuntimeError if another thread's step holds it (a step never waits).
    fn lock(&self) -> PyResult<parking_lot::MutexGuard<'_, kvguard::RowCache>> {
        self.cache.try_lock().ok_or_else(|| {
            PyRuntimeError::new_err("this RowCache is in use by another thread's step: one step at a time per cache")
        })
    }
}

/// Request `requests[i]` reads its first `seq_lens[i]` tokens through row `rows[i]` of `table`
/// (a C-contiguous 2-D int32 array of page ids, read in place), judged (`verify_rows`) or pure,
/// the GIL released. ValueError for arrays of another shape or type, or a row past the table.
#[allow(clippy::too_many_arguments)]
pub fn step(
    py: Python<'_>,
    core: &kvguard::OwnershipTable,
    cache: &RowCache,
    requests: &[RequestId],
    table: &Bound<'_, PyAny>,
    rows: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    judged: bool,
) -> PyResult<kvguard::StepVerdict> {
    let n = requests.len();
    let t = IntArray::open(table, "table", 2)?;
    let (entries, width) = t.as_i32_rows().ok_or_else(|| {
        PyValueError::new_err(
            "table: verify_rows reads the block table in place: a C-contiguous 2-D int32 array of \
             page ids (vLLM's block_table.np; SGLang's req_to_token at page size 1)",
        )
    })?;
    let block_rows = BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(format!("table: {e}")))?;
    let rows = IntArray::open(rows, "rows", 1)?.counts(n, "rows")?;
    let lens = IntArray::open(seq_lens, "seq_lens", 1)?.counts(n, "seq_lens")?;
    let table_rows = t.len();
    let mut reads = Vec::with_capacity(n);
    for (i, ((&request, &row), &tokens)) in requests.iter().zip(&rows).zip(&lens).enumerate() {
        let Some(row) = u32::try_from(row).ok().filter(|&r| (r as usize) < table_rows) else {
            return Err(PyValueError::new_err(format!("rows[{i}] is {row}: table has {table_rows} rows")));
        };
        reads.push(RowRead { request, row, tokens });
    }
    let mut cache = cache.lock()?;
    let cache = &mut *cache;
    let verdict = py.detach(|| {
        if judged { core.verify_rows(cache, block_rows, &reads) } else { core.check_rows(cache, block_rows, &reads) }
    });
    // Every row was checked against the table's length above.
    verdict.map_err(|e| PyValueError::new_err(e.to_string()))
}
