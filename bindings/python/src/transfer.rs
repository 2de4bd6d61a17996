//! Transfer manifests (build, encode, decode) and the receiver's accept, so a Python PD
//! connector can send and check manifests.
//!
//! A manifest carries the table's *int* ids: request and tenant as the receiving table knows
//! them (`OwnershipTable.request_key(rid)`, `tenant_key(t)`: a str id is interned per process,
//! so the receiver tells the sender its ids when it offers its pages).

use crate::errors::{TransferError, log_violation};
use crate::table::OwnershipTable;
use crate::values::PageRef;
use crate::violation::Violation;
use kvguard::transfer::{self as core, SenderId, TransferHeader};
use kvguard::{RequestId, TenantId};
use parking_lot::Mutex;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A contiguous byte buffer borrowed from Python (bytes, bytearray, memoryview, numpy array).
pub(crate) struct Bytes {
    buf: PyUntypedBuffer,
}

impl Bytes {
    pub(crate) fn open(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Bytes> {
        let buf = PyUntypedBuffer::get(obj).map_err(|_| {
            PyTypeError::new_err(format!("{name} must expose the buffer protocol (bytes, memoryview, numpy)"))
        })?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!("{name} must be contiguous")));
        }
        Ok(Bytes { buf })
    }
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        let len = self.buf.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: a C-contiguous buffer (checked in `open`) of `len_bytes` bytes at `buf_ptr`,
        // exported to us until `buf` is released (on drop), which the borrow of `self` outlives
        // not; u8 has no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr() as *const u8, len) }
    }
}

pub(crate) fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let a = crate::arrays::IntArray::open(obj, name, 1)?;
    (0..a.len())
        .map(|i| {
            let v = a.get(i, 0);
            u32::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: token ids are ints in 0..2**32")))
        })
        .collect()
}

pub(crate) fn refs(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<kvguard::PageRef>> {
    obj.try_iter()?
        .map(|i| {
            let i = i?;
            i.cast::<PageRef>()
                .map(|r| kvguard::PageRef::from(*r.get()))
                .map_err(|_| PyTypeError::new_err(format!("{name} must hold kvguard.PageRef")))
        })
        .collect()
}

/// What travels with a prefill->decode KV transfer: whose KV it is, what prompt it is the KV
/// of, where each page lands and what its bytes must hash to.
///
/// Manifest.build(request, tenant, sender, page_size, slot_bytes, prompt, dest, pages)
///   request, tenant: the receiving table's int ids (its request_key / tenant_key);
///   prompt: the tokens prefilled (ints); dest: the receiver's PageRefs, one per page;
///   pages: one bytes-like per page, tokens * slot_bytes bytes each.
/// encode() -> bytes; Manifest.decode(bytes) raises TransferError (kind 'manifest_corrupt').
#[pyclass(frozen, module = "kvguard")]
#[derive(Clone)]
pub struct Manifest {
    inner: core::Manifest,
}

#[pymethods]
impl Manifest {
    /// Builds the manifest of a transfer (TransferError when the pages do not match the prompt).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    fn build(
        request: u64,
        tenant: u64,
        sender: u64,
        page_size: u32,
        slot_bytes: u32,
        prompt: &Bound<'_, PyAny>,
        dest: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<Manifest> {
        let header = TransferHeader {
            request: RequestId(request),
            tenant: TenantId(tenant),
            sender: SenderId(sender),
            page_size,
            slot_bytes,
        };
        let prompt = tokens(prompt, "prompt")?;
        let dest = refs(dest, "dest")?;
        let pages: Vec<Bytes> = pages
            .try_iter()?
            .enumerate()
            .map(|(i, p)| Bytes::open(&p?, &format!("pages[{i}]")))
            .collect::<PyResult<_>>()?;
        let inner = core::Manifest::build(header, &prompt, &dest, &pages).map_err(|e| {
            let err = TransferError::new_err(e.to_string());
            Python::attach(|py| {
                let v = err.value(py);
                let _ = v.setattr("kind", py.None());
                let _ = v.setattr("violation", py.None());
            });
            err
        })?;
        Ok(Manifest { inner })
    }

    /// Decodes manifest bytes; TransferError (kind 'manifest_corrupt') when they do not decode.
    #[staticmethod]
    fn decode(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Manifest> {
        let bytes = Bytes::open(data, "data")?;
        core::Manifest::decode(bytes.as_ref()).map(|inner| Manifest { inner }).map_err(|e| {
            let err = TransferError::new_err(format!("manifest refused: {e}"));
            let v = err.value(py);
            let _ = v.setattr("kind", "manifest_corrupt");
            let _ = v.setattr("violation", py.None());
            err
        })
    }

    /// The wire bytes.
    fn encode<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.encode())
    }
    /// The request whose KV this is (the receiving table's int id).
    #[getter]
    fn request(&self) -> u64 {
        self.inner.request().0
    }
    /// Its tenant (the receiving table's int id).
    #[getter]
    fn tenant(&self) -> u64 {
        self.inner.tenant().0
    }
    /// The sending instance.
    #[getter]
    fn sender(&self) -> u64 {
        self.inner.sender().0
    }
    /// Tokens prefilled.
    #[getter]
    fn prompt_tokens(&self) -> u64 {
        self.inner.prompt_tokens()
    }
    /// The prompt's digest.
    #[getter]
    fn prompt_digest(&self) -> u64 {
        self.inner.prompt_digest().0
    }
    /// Token slots per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size()
    }
    /// Bytes per token slot.
    #[getter]
    fn slot_bytes(&self) -> u32 {
        self.inner.slot_bytes()
    }
    /// [(dest PageRef, tokens, crc32)] per page.
    #[getter]
    fn pages(&self) -> Vec<(PageRef, u32, u32)> {
        self.inner.pages().iter().map(|e| (PageRef::from(e.dest), e.tokens, e.crc32)).collect()
    }
    fn __eq__(&self, other: &Manifest) -> bool {
        self.inner == other.inner
    }
    fn __repr__(&self) -> String {
        format!(
            "Manifest(request={}, tenant={}, sender={}, prompt_tokens={}, pages={})",
            self.request(),
            self.tenant(),
            self.sender(),
            self.prompt_tokens(),
            self.inner.pages().len()
        )
    }
}

/// What an accepted transfer recorded: tokens and pages.
#[pyclass(frozen, module = "kvguard")]
pub struct Accepted {
    /// Tokens recorded as written.
    #[pyo3(get)]
    tokens: u64,
    /// Pages landed.
    #[pyo3(get)]
    pages: usize,
}

#[pymethods]
impl Accepted {
    fn __repr__(&self) -> String {
        format!("Accepted(tokens={}, pages={})", self.tokens, self.pages)
    }
}

/// The decode side of a transfer: checks, lands and records against the receiving table;
/// every refusal is recorded in that table (and logged).
///
/// Receiver(table).accept(request, tenant, prompt, dest, manifest, pages, *, page_size=None,
///                        slot_bytes, sender=None, land=None)
/// Only when the manifest is for exactly this request, tenant, prompt and pages, and every
/// page's bytes match their CRC32, land(index, PageRef, bytes) is called for each page
/// (copy the bytes into your pool there) and the coverage recorded. Otherwise TransferError
/// (with .kind and .violation) and nothing is recorded. If `land` raises (any exception,
/// KeyboardInterrupt included), the import fails at that page: nothing is recorded as written,
/// every receiving page's coverage is revoked (unreadable until the request writes it), a
/// landing_failed violation is recorded (it does not quarantine), and the exception `land`
/// raised propagates with a note naming the page.
#[pyclass(frozen, module = "kvguard")]
pub struct Receiver {
    table: Py<OwnershipTable>,
}

#[pymethods]
impl Receiver {
    #[new]
    fn new(table: Py<OwnershipTable>) -> Receiver {
        Receiver { table }
    }

    /// Accepts a transfer (see the class doc). Returns Accepted.
    #[pyo3(signature = (request, tenant, prompt, dest, manifest, pages, *, slot_bytes, page_size = None, sender = None, land = None))]
    #[allow(clippy::too_many_arguments)]
    fn accept(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        tenant: &Bound<'_, PyAny>,
        prompt: &Bound<'_, PyAny>,
        dest: &Bound<'_, PyAny>,
        manifest: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        slot_bytes: u32,
        page_size: Option<u32>,
        sender: Option<u64>,
        land: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Accepted> {
        let table = self.table.get();
        let (req, ten) = {
            let rk = crate::names::key(request, "request")?;
            let tk = crate::names::key(tenant, "tenant")?;
            let names = table.names().lock();
            (names.request(rk), names.tenant(tk))
        };
        let prompt = tokens(prompt, "prompt")?;
        let dest = refs(dest, "dest")?;
        let manifest = Bytes::open(manifest, "manifest")?;
        let pages: Vec<Bytes> = pages
            .try_iter()?
            .enumerate()
            .map(|(i, p)| Bytes::open(&p?, &format!("pages[{i}]")))
            .collect::<PyResult<_>>()?;
        let page_size = page_size.unwrap_or(table.core().page_size());
        let mut expected = core::ExpectedTransfer::for_prompt(req, ten, &prompt, &dest, page_size, slot_bytes);
        if let Some(s) = sender {
            expected = expected.from_sender(SenderId(s));
        }
        let receiver = core::Receiver::new(table.core());
        let land = land.map(Bound::unbind);
        // No kvguard lock is held while `land` runs (the receiver's contract).
        let outcome =
            receiver.accept(&expected, manifest.as_ref(), &pages, |i, r, bytes| land_page(land.as_ref(), i, r, bytes));
        outcome.map(Accepted::from).map_err(|e| refused(py, table, e, &expected))
    }

    /// Pins the receiving pages *before* any byte is asked for (a transport that lands bytes in
    /// the pool itself: NIXL's writes and reads): until the returned PinnedImport accepts,
    /// refuses or aborts (also when it is garbage-collected or its `with` block ends), the pages
    /// stay `request`'s and out of every other request's reach. Same arguments as accept, less
    /// the manifest and the bytes. TransferError (with .kind and .violation, recorded in the
    /// table) when the table no longer holds the pages in the incarnations named.
    #[pyo3(signature = (request, tenant, prompt, dest, *, slot_bytes, page_size = None, sender = None))]
    #[allow(clippy::too_many_arguments)]
    fn pin(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        tenant: &Bound<'_, PyAny>,
        prompt: &Bound<'_, PyAny>,
        dest: &Bound<'_, PyAny>,
        slot_bytes: u32,
        page_size: Option<u32>,
        sender: Option<u64>,
    ) -> PyResult<PinnedImport> {
        let table = self.table.get();
        let (req, ten) = {
            let rk = crate::names::key(request, "request")?;
            let tk = crate::names::key(tenant, "tenant")?;
            let names = table.names().lock();
            (names.request(rk), names.tenant(tk))
        };
        let prompt = tokens(prompt, "prompt")?;
        let expected = Expectation {
            request: req,
            tenant: ten,
            sender: sender.map(SenderId),
            prompt_tokens: prompt.len() as u64,
            prompt_digest: core::PromptDigest::of_tokens(&prompt),
            pages: refs(dest, "dest")?,
            page_size: page_size.unwrap_or(table.core().page_size()),
            slot_bytes,
        };
        // SAFETY: the table lives inside the Python object `self.table`, which the PinnedImport
        // keeps alive (its `table` field) and which never moves while alive; the core pin that
        // borrows it is dropped first (declared first), so the borrow never outlives the table.
        let core_table: &'static kvguard::OwnershipTable = unsafe { &*std::ptr::from_ref(table.core()) };
        let pinned = py.detach(|| core::Receiver::new(core_table).pin(&expected.as_expected()));
        match pinned {
            Ok(pin) => Ok(PinnedImport { pin: Mutex::new(Some(pin)), expected, table: self.table.clone_ref(py) }),
            Err(e) => Err(refusal(py, table, &e, &expected.as_expected())),
        }
    }
}

impl From<core::Accepted> for Accepted {
    fn from(a: core::Accepted) -> Accepted {
        Accepted { tokens: a.tokens(), pages: a.pages() }
    }
}

/// A refused transfer as the exception to raise, its violation logged: `TransferError` (.kind,
/// .violation), but for a landing that raised (the import failed: its pages made unreadable,
/// `landing_failed` recorded), where the exception `land` raised is raised again, with a note
/// naming the page it failed on.
pub(crate) fn refused(
    py: Python<'_>,
    table: &OwnershipTable,
    e: core::TransferError,
    expected: &core::ExpectedTransfer<'_>,
) -> PyErr {
    let error = refusal(py, table, &e, expected);
    let core::TransferError::Landing { index, page, source } = e else { return error };
    let Ok(raised) = source.downcast::<PyErr>() else { return error };
    let note = format!(
        "kvguard: landing entry {index} of the transfer (page {}, generation {}) failed; the import was \
         abandoned (landing_failed): its pages are unreadable until the request writes them",
        page.page.0, page.generation.0
    );
    // A note that cannot be added leaves the exception as it was.
    let _ = raised.value(py).call_method1("add_note", (note,));
    *raised
}

/// A refused transfer as a `TransferError` (.kind, .violation), the violation logged.
pub(crate) fn refusal(
    py: Python<'_>,
    table: &OwnershipTable,
    e: &core::TransferError,
    expected: &core::ExpectedTransfer<'_>,
) -> PyErr {
    let v = e.to_violation(expected);
    let r = table.names().lock().resolve(&v);
    let v = match Violation::wrap(py, v, r) {
        Ok(v) => v,
        Err(err) => return err,
    };
    log_violation(py, &v);
    let err = TransferError::new_err(e.to_string());
    let value = err.value(py);
    if let Err(err) = value.setattr("kind", e.kind().as_str()).and_then(|_| value.setattr("violation", v)) {
        return err;
    }
    err
}

/// What decode expects of a pinned transfer, owned (the core's `ExpectedTransfer` borrows).
#[derive(Clone, Debug)]
pub(crate) struct Expectation {
    request: RequestId,
    tenant: TenantId,
    sender: Option<SenderId>,
    prompt_tokens: u64,
    prompt_digest: core::PromptDigest,
    pages: Vec<kvguard::PageRef>,
    page_size: u32,
    slot_bytes: u32,
}

impl Expectation {
    /// The core's view of it.
    pub(crate) fn as_expected(&self) -> core::ExpectedTransfer<'_> {
        core::ExpectedTransfer {
            request: self.request,
            tenant: self.tenant,
            sender: self.sender,
            prompt_tokens: self.prompt_tokens,
            prompt_digest: self.prompt_digest,
            pages: &self.pages,
            page_size: self.page_size,
            slot_bytes: self.slot_bytes,
        }
    }
}

/// A transfer whose receiving pages are pinned (Receiver.pin) while its bytes are on their way.
///
/// It ends exactly once: accept(manifest, pages, land=None) checks and records (Accepted, or
/// TransferError and nothing recorded), abort() gives up with no verdict (nothing recorded), and
/// so does leaving a `with` block or being garbage-collected unended. A transport's receive
/// (NixlLink.receive) ends it too. Calls after the end raise RuntimeError.
#[pyclass(frozen, module = "kvguard")]
pub struct PinnedImport {
    // Dropped first: the core pin borrows the table kept alive by `table`.
    pin: Mutex<Option<core::PinnedImport<'static>>>,
    expected: Expectation,
    table: Py<OwnershipTable>,
}

impl PinnedImport {
    /// Takes the pin out (it ends here), with what it expects and its table.
    pub(crate) fn take(&self) -> PyResult<(core::PinnedImport<'static>, &Expectation, &Py<OwnershipTable>)> {
        let pin = self.pin.lock().take().ok_or_else(|| PyRuntimeError::new_err("this PinnedImport has ended"))?;
        Ok((pin, &self.expected, &self.table))
    }
}

#[pymethods]
impl PinnedImport {
    /// The pinned pages (PageRefs, in token order).
    #[getter]
    fn pages(&self) -> Vec<PageRef> {
        self.expected.pages.iter().map(|&r| PageRef::from(r)).collect()
    }

    /// The receiving request (the table's int id: what the manifest must carry).
    #[getter]
    fn request(&self) -> u64 {
        self.expected.request.0
    }

    /// Whether the pin still holds (not accepted, aborted or received yet).
    #[getter]
    fn pinned(&self) -> bool {
        self.pin.lock().is_some()
    }

    /// Checks `manifest` and `pages` (the bytes that landed; one bytes-like per page) as
    /// Receiver.accept does, under the pin; `land(index, PageRef, bytes)` is called per page
    /// only when everything holds, then the coverage is recorded (a `land` that raises fails the
    /// import as in Receiver.accept). The CRCs run without the GIL.
    #[pyo3(signature = (manifest, pages, land = None))]
    fn accept(
        &self,
        py: Python<'_>,
        manifest: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        land: Option<Py<PyAny>>,
    ) -> PyResult<Accepted> {
        let manifest = Bytes::open(manifest, "manifest")?;
        let pages: Vec<Bytes> = pages
            .try_iter()?
            .enumerate()
            .map(|(i, p)| Bytes::open(&p?, &format!("pages[{i}]")))
            .collect::<PyResult<_>>()?;
        let (pin, expected, table) = self.take()?;
        let outcome = py.detach(|| {
            let expected = expected.as_expected();
            pin.accept(&expected, manifest.as_ref(), &pages, |i, r, bytes| land_page(land.as_ref(), i, r, bytes))
        });
        outcome.map(Accepted::from).map_err(|e| refused(py, table.get(), e, &expected.as_expected()))
    }

    /// Gives up with no verdict on content: nothing recorded, the pages unpinned. A no-op once
    /// the import has ended. Not for a transfer offered to a peer that may still write the pages
    /// (a NIXL push): NixlLink.abandon fences them instead.
    fn abort(&self) {
        if let Some(pin) = self.pin.lock().take() {
            pin.abort();
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.abort();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "PinnedImport(request={}, pages={}, pinned={})",
            self.expected.request.0,
            self.expected.pages.len(),
            self.pinned()
        )
    }
}

/// Calls the caller's `land` for one accepted page (taking the GIL). Whatever it raises
/// (KeyboardInterrupt included) fails the import at that page; [`refused`] raises it again.
pub(crate) fn land_page(
    land: Option<&Py<PyAny>>,
    index: usize,
    page: kvguard::PageRef,
    bytes: &[u8],
) -> Result<(), core::LandError> {
    let Some(f) = land else { return Ok(()) };
    Python::attach(|py| {
        let view = PyBytes::new(py, bytes);
        f.call1(py, (index, PageRef::from(page), view)).map(drop).map_err(|e| Box::new(e) as core::LandError)
    })
}

/// The checksum a manifest carries for `data`: CRC32 (crc32fast), 0 folded into 1.
#[pyfunction]
pub fn page_checksum(data: &Bound<'_, PyAny>) -> PyResult<u32> {
    Ok(core::page_checksum(Bytes::open(data, "data")?.as_ref()))
}

/// The digest of a prompt's tokens that a manifest carries.
#[pyfunction]
pub fn prompt_digest(prompt: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(core::PromptDigest::of_tokens(&tokens(prompt, "prompt")?).0)
}
