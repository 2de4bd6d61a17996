//! Transfer manifests (build, encode, decode) and the receiver's accept, so a Python PD
//! connector can send and check manifests.
//!
//! A manifest carries the table's *int* ids: request and tenant as the receiving table knows
//! them (`OwnershipTable.request_key(rid)`, `tenant_key(t)`: a str id is interned per process,
//! so the receiver tells the sender its ids when it offers its pages).

use crate::errors::{TransferError, log_violation};
use crate::table::OwnershipTable;
use crate::values::{PageRef, Violation};
use kvguard::transfer::{self as core, SenderId, TransferHeader};
use kvguard::{RequestId, TenantId};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A contiguous byte buffer borrowed from Python (bytes, bytearray, memoryview, numpy array).
struct Bytes {
    buf: PyUntypedBuffer,
}

impl Bytes {
    fn open(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Bytes> {
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

fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let a = crate::arrays::IntArray::open(obj, name, 1)?;
    (0..a.len())
        .map(|i| {
            let v = a.get(i, 0);
            u32::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: token ids are ints in 0..2**32")))
        })
        .collect()
}

fn refs(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<kvguard::PageRef>> {
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
/// (with .kind and .violation) and nothing is recorded.
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
        let mut land_err: Option<PyErr> = None;
        let outcome = receiver.accept(&expected, manifest.as_ref(), &pages, |i, r, bytes| {
            if land_err.is_some() {
                return;
            }
            if let Some(f) = &land {
                // No kvguard lock is held while `land` runs (the receiver's contract).
                let view = PyBytes::new(py, bytes);
                if let Err(e) = f.call1((i, PageRef::from(r), view)) {
                    land_err = Some(e);
                }
            }
        });
        if let Some(e) = land_err {
            return Err(e);
        }
        match outcome {
            Ok(a) => Ok(Accepted { tokens: a.tokens(), pages: a.pages() }),
            Err(e) => {
                let kind = e.kind().as_str();
                let v = e.to_violation(&expected);
                let r = table.names().lock().resolve(&v);
                let v = Violation::wrap(py, v, r)?;
                log_violation(py, &v);
                let err = TransferError::new_err(e.to_string());
                let value = err.value(py);
                value.setattr("kind", kind)?;
                value.setattr("violation", v)?;
                Err(err)
            }
        }
    }
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
