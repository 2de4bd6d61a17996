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

/// The step's reads: request `requests[i]` reading `seq_lens[i]` tokens through row `rows[i]`
/// of a table of `table_rows` rows (`what`, in the `ValueError` a row past it raises).
fn row_reads(
    requests: &[RequestId],
    rows: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    table_rows: usize,
    what: &str,
) -> PyResult<Vec<RowRead>> {
    let n = requests.len();
    let rows = IntArray::open(rows, "rows", 1)?.counts(n, "rows")?;
    let lens = IntArray::open(seq_lens, "seq_lens", 1)?.counts(n, "seq_lens")?;
    let mut reads = Vec::with_capacity(n);
    for (i, ((&request, &row), &tokens)) in requests.iter().zip(&rows).zip(&lens).enumerate() {
        let Some(row) = u32::try_from(row).ok().filter(|&r| (r as usize) < table_rows) else {
            return Err(PyValueError::new_err(format!("rows[{i}] is {row}: {what} has {table_rows} rows")));
        };
        reads.push(RowRead { request, row, tokens });
    }
    Ok(reads)
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
    let t = IntArray::open(table, "table", 2)?;
    let (entries, width) = t.as_i32_rows().ok_or_else(|| {
        PyValueError::new_err(
            "table: verify_rows reads the block table in place: a C-contiguous 2-D int32 array of \
             page ids (vLLM's block_table.np; SGLang's req_to_token at page size 1)",
        )
    })?;
    let block_rows = BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(format!("table: {e}")))?;
    let reads = row_reads(requests, rows, seq_lens, t.len(), "table")?;
    let mut cache = cache.lock()?;
    let cache = &mut *cache;
    let verdict = py.detach(|| {
        if judged { core.verify_rows(cache, block_rows, &reads) } else { core.check_rows(cache, block_rows, &reads) }
    });
    // Every row was checked against the table's length above.
    verdict.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A block table the guard holds (kvguard::HeldBlockTable): rows of int32 page ids the engine
/// changes only through append, set_row, truncate, clear_row, copy_row and swap_rows, and reads
/// through a read-only buffer (`numpy.asarray(held)`: rows x width int32, -1 past each row's
/// length; it shows each change as it is made). OwnershipTable.verify_held_rows judges each step
/// from what changed, without reading the rows again (docs/engine-step.md).
#[pyclass(frozen, module = "kvguard")]
pub struct HeldBlockTable {
    held: Mutex<kvguard::HeldBlockTable>,
    /// The entries' address: the core allocates them once and never moves them.
    entries: usize,
    /// The buffer's shape and strides (bytes), for the views it lends.
    shape: [pyo3::ffi::Py_ssize_t; 2],
    strides: [pyo3::ffi::Py_ssize_t; 2],
}

/// A change or size the held table refused, as Python's exception.
fn held_error(e: kvguard::HeldRowsError) -> PyErr {
    match e {
        kvguard::HeldRowsError::OutOfMemory { .. } => pyo3::exceptions::PyMemoryError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// `entries` (a sequence or 1-D int array) as int32 page ids; ValueError for one outside int32.
fn held_entries(entries: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let a = IntArray::open(entries, "entries", 1)?;
    (0..a.len())
        .map(|i| {
            let v = a.get(i, 0);
            i32::try_from(v).map_err(|_| {
                PyValueError::new_err(format!("entries[{i}] is {v}: a block table's entries are int32 page ids"))
            })
        })
        .collect()
}

/// A row index: an int in 0..2**32 (the core says whether the table has it).
fn held_row(row: i64, name: &str) -> PyResult<u32> {
    u32::try_from(row).map_err(|_| PyValueError::new_err(format!("{name} is {row}: rows are ints in 0..2**32")))
}

#[pymethods]
impl HeldBlockTable {
    /// `rows` empty rows of `width` entries. ValueError if it cannot be indexed (2**32 rows or
    /// more, rows of 2**32 entries or more), MemoryError if the system will not give it.
    #[new]
    fn new(rows: usize, width: usize) -> PyResult<HeldBlockTable> {
        let held = kvguard::HeldBlockTable::new(rows, width).map_err(held_error)?;
        let entries = held.entries().as_ptr().addr();
        // Both fit: the core refused anything past 2**32 rows or entries a row.
        let (r, w) = (rows as pyo3::ffi::Py_ssize_t, width as pyo3::ffi::Py_ssize_t);
        Ok(HeldBlockTable { held: Mutex::new(held), entries, shape: [r, w], strides: [w * 4, 4] })
    }

    /// How many rows.
    #[getter]
    fn rows(&self) -> usize {
        self.shape[0] as usize
    }

    /// Entries a row holds at most.
    #[getter]
    fn width(&self) -> usize {
        self.shape[1] as usize
    }

    /// Rows judged from their last clean page since the table was made.
    #[getter]
    fn incremental(&self) -> PyResult<u64> {
        Ok(self.lock()?.incremental())
    }

    /// Rows judged in full since the table was made.
    #[getter]
    fn full(&self) -> PyResult<u64> {
        Ok(self.lock()?.full())
    }

    /// Row `row`'s entries set, as a list (ValueError past the table).
    fn row(&self, row: i64) -> PyResult<Vec<i32>> {
        let r = held_row(row, "row")?;
        let held = self.lock()?;
        held.row(r)
            .map(<[i32]>::to_vec)
            .ok_or_else(|| held_error(kvguard::HeldRowsError::Row { row: r, rows: held.rows() }))
    }

    /// Appends `entries` to row `row` (a step's new pages). ValueError, nothing changed, for a
    /// row past the table or one that would hold more than the width.
    fn append(&self, row: i64, entries: &Bound<'_, PyAny>) -> PyResult<()> {
        let (row, entries) = (held_row(row, "row")?, held_entries(entries)?);
        self.lock()?.append(row, &entries).map_err(held_error)
    }

    /// Row `row` becomes `entries` (a request given the row). As for append.
    fn set_row(&self, row: i64, entries: &Bound<'_, PyAny>) -> PyResult<()> {
        let (row, entries) = (held_row(row, "row")?, held_entries(entries)?);
        self.lock()?.set_row(row, &entries).map_err(held_error)
    }

    /// Row `row` keeps its first `length` entries (all of them if it has no more).
    fn truncate(&self, row: i64, length: usize) -> PyResult<()> {
        let row = held_row(row, "row")?;
        self.lock()?.truncate(row, length).map_err(held_error)
    }

    /// Row `row` emptied (its request gone).
    fn clear_row(&self, row: i64) -> PyResult<()> {
        let row = held_row(row, "row")?;
        self.lock()?.clear_row(row).map_err(held_error)
    }

    /// Row `dst` becomes a copy of row `src` (an engine condensing its rows), with what `src`
    /// was checked clean as.
    fn copy_row(&self, src: i64, dst: i64) -> PyResult<()> {
        let (src, dst) = (held_row(src, "src")?, held_row(dst, "dst")?);
        self.lock()?.copy_row(src, dst).map_err(held_error)
    }

    /// Rows `a` and `b` trade places, each with what it was checked clean as.
    fn swap_rows(&self, a: i64, b: i64) -> PyResult<()> {
        let (a, b) = (held_row(a, "a")?, held_row(b, "b")?);
        self.lock()?.swap_rows(a, b).map_err(held_error)
    }

    /// Forgets every row's last clean check: the next step judges each in full.
    fn forget(&self) -> PyResult<()> {
        self.lock()?.forget();
        Ok(())
    }

    fn __repr__(&self) -> String {
        let (rows, width) = (self.rows(), self.width());
        match self.held.try_lock() {
            Some(h) => format!(
                "HeldBlockTable(rows={rows}, width={width}, incremental={}, full={})",
                h.incremental(),
                h.full()
            ),
            None => format!("HeldBlockTable(rows={rows}, width={width}, <in use>)"),
        }
    }

    /// The entries as a read-only buffer: rows x width int32, C order. BufferError for a
    /// writable one.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        use pyo3::ffi;
        if view.is_null() {
            return Err(pyo3::exceptions::PyBufferError::new_err("no view to fill"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "a HeldBlockTable's entries are read-only: change them through its methods",
            ));
        }
        let this = slf.get();
        let (rows, width) = (this.shape[0], this.shape[1]);
        let nd = flags & ffi::PyBUF_ND == ffi::PyBUF_ND;
        let strided = flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES;
        // SAFETY: `view` is non-null (checked) and CPython hands a Py_buffer to fill. The
        // entries live as long as the table, which the view keeps alive through `obj` (a new
        // reference); the core never moves or resizes them; the shape and strides are fields of
        // the frozen table, alive as long. The view is read-only: changes are made only through
        // the methods, under the GIL, which a reader of the view holds too.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = std::ptr::with_exposed_provenance_mut::<std::os::raw::c_void>(this.entries);
            (*view).len = rows * width * 4;
            (*view).readonly = 1;
            (*view).itemsize = 4;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"i".as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = if nd { 2 } else { 1 };
            (*view).shape = if nd { this.shape.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            (*view).strides = if strided { this.strides.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// Nothing to release: the view borrowed the table's own memory.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

impl HeldBlockTable {
    /// The held table, or RuntimeError if another thread's call holds it (a call never waits).
    fn lock(&self) -> PyResult<parking_lot::MutexGuard<'_, kvguard::HeldBlockTable>> {
        self.held.try_lock().ok_or_else(|| {
            PyRuntimeError::new_err("this HeldBlockTable is in use by another thread's call: one call at a time")
        })
    }
}

/// Request `requests[i]` reads its first `seq_lens[i]` tokens through row `rows[i]` of `held`,
/// judged (`verify_held_rows`) or pure, the GIL released. ValueError for a row past the table.
#[allow(clippy::too_many_arguments)]
pub fn held_step(
    py: Python<'_>,
    core: &kvguard::OwnershipTable,
    held: &HeldBlockTable,
    requests: &[RequestId],
    rows: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    judged: bool,
) -> PyResult<kvguard::StepVerdict> {
    let reads = row_reads(requests, rows, seq_lens, held.rows(), "the held table")?;
    let mut h = held.lock()?;
    let h = &mut *h;
    let verdict = py.detach(|| if judged { core.verify_held_rows(h, &reads) } else { core.check_held_rows(h, &reads) });
    verdict.map_err(|e| PyValueError::new_err(e.to_string()))
}
