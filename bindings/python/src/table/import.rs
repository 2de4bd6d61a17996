//! `ImportTicket` for Python: a KV transfer in flight, its pages pinned until it ends. Part of
//! the table, as in the core (`kvguard::table`): only `OwnershipTable.begin_import` makes one.
//!
//! The core ticket borrows its table. Here it lives in a Python object that also holds a strong
//! reference to the table's Python object, so the table outlives it; the one `unsafe` block of
//! this module widens the borrow's lifetime on that ground.

use super::OwnershipTable;
use crate::errors;
use crate::values::PageRef;
use crate::violation::Violation;
use kvguard::RequestId;
use parking_lot::Mutex;
use pyo3::prelude::*;

/// A KV transfer in flight, from OwnershipTable.begin_import(request, refs): while it is open,
/// its pages are pinned (a release takes them from the request, but they stay out of the free
/// list until the ticket ends, so bytes still landing never reach a next owner).
///
/// End it with finish(tokens, expected) once the bytes landed and were checked, fail(index) when
/// landing them failed (bytes may have landed: the pages' coverage is revoked, landing_failed
/// recorded), or abort() when nothing landed. As a context manager, leaving the block by an
/// exception fails the ticket (the exception propagates), leaving it otherwise unfinished
/// aborts; a ticket garbage-collected while open aborts too.
///
///   with table.begin_import("cmpl-7", refs) as ticket:
///       copy_into_pool(refs, kv)   # raising here fails the import: nothing readable
///       check(kv)                  # e.g. kvguard.Manifest.decode(...) and the page CRCs
///       ticket.finish(tokens, expected)
#[pyclass(frozen, module = "kvguard")]
pub struct ImportTicket {
    /// `None` once ended. Declared before `table`, so it is dropped (aborted) first.
    ticket: Mutex<Option<kvguard::ImportTicket<'static>>>,
    table: Py<OwnershipTable>,
    request: Py<PyAny>,
}

impl ImportTicket {
    /// Starts a transfer into `refs` for `request` (the id as the caller gave it).
    pub fn begin(
        table: &Bound<'_, OwnershipTable>,
        request: &Bound<'_, PyAny>,
        req: RequestId,
        refs: &[kvguard::PageRef],
    ) -> PyResult<ImportTicket> {
        let py = table.py();
        let owner = table.get();
        let core = owner.core();
        let begun = py.detach(|| core.begin_import(req, refs));
        let ticket = begun.map_err(|e| owner.err(py, e))?;
        // SAFETY: the ticket borrows `table.get().core()`, which lives inside the Python object
        // `table` (a frozen pyclass: never moved, never mutably borrowed). The ImportTicket built
        // here keeps a strong reference to that object (`table`) for its whole life and drops
        // `ticket` before it (field order), so the borrow never outlives the table it names.
        let ticket =
            unsafe { std::mem::transmute::<kvguard::ImportTicket<'_>, kvguard::ImportTicket<'static>>(ticket) };
        Ok(ImportTicket {
            ticket: Mutex::new(Some(ticket)),
            table: table.clone().unbind(),
            request: request.clone().unbind(),
        })
    }

    fn take(&self) -> PyResult<kvguard::ImportTicket<'static>> {
        self.ticket.lock().take().ok_or_else(|| errors::Error::new_err("this import ticket has already ended"))
    }
}

#[pymethods]
impl ImportTicket {
    /// Records that `tokens` tokens landed from the first slot of the first page, when
    /// `expected` were expected, and unpins the pages in the same step. A count that differs
    /// (token_count_mismatch), or pages that changed hands meanwhile (stale_page, foreign_page),
    /// raise ViolationError and record nothing; the pages are unpinned either way.
    fn finish(&self, py: Python<'_>, tokens: u64, expected: u64) -> PyResult<()> {
        let ticket = self.take()?;
        let outcome = py.detach(|| ticket.finish(tokens, expected));
        outcome.map_err(|e| self.table.get().err(py, e))
    }

    /// Abandons the transfer because landing its bytes failed at entry `index` (None: at no
    /// page in particular): every page still the request's loses its coverage (reads of it are
    /// refused as unwritten until the request writes it again), nothing is recorded as written,
    /// the pages are unpinned, and a landing_failed violation is recorded, logged and returned
    /// (it does not quarantine the request). An ended ticket raises kvguard.Error.
    #[pyo3(signature = (index = None))]
    fn fail(&self, py: Python<'_>, index: Option<usize>) -> PyResult<Py<Violation>> {
        let ticket = self.take()?;
        let v = py.detach(|| ticket.fail(index.unwrap_or(usize::MAX)));
        let table = self.table.get();
        let resolved = table.names().lock().resolve(&v);
        let v = Violation::wrap(py, v, resolved)?;
        errors::log_violation(py, &v);
        Ok(v)
    }

    /// Abandons the transfer (its manifest was refused, say): nothing is recorded, the pages are
    /// unpinned. Doing it again does nothing.
    fn abort(&self, py: Python<'_>) {
        let ticket = self.ticket.lock().take();
        if let Some(ticket) = ticket {
            py.detach(|| ticket.abort());
        }
    }

    /// Whether the transfer is still in flight (neither finished nor aborted).
    #[getter]
    fn open(&self) -> bool {
        self.ticket.lock().is_some()
    }

    /// The receiving request, as given to begin_import.
    #[getter]
    fn request(&self, py: Python<'_>) -> Py<PyAny> {
        self.request.clone_ref(py)
    }

    /// The pages the transfer lands in (empty once ended).
    #[getter]
    fn pages(&self) -> Vec<PageRef> {
        self.ticket.lock().as_ref().map(|t| t.pages().iter().copied().map(PageRef::from).collect()).unwrap_or_default()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving the `with` block by an exception fails a ticket not finished (bytes may have
    /// landed), leaving it otherwise aborts one; exceptions propagate.
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        if exc_type.is_none() || !self.open() {
            self.abort(py);
        } else {
            self.fail(py, None)?;
        }
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let request = self.request.bind(py).repr().map(|r| r.to_string()).unwrap_or_default();
        let state = if self.open() { "open" } else { "ended" };
        format!("<kvguard.ImportTicket request={request} pages={} {state}>", self.pages().len())
    }
}
