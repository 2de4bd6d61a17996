//! The trace recorder and replayer.

use crate::errors::TraceError;
use crate::values::PoolConfig;
use kvguard::trace as core;
use kvguard::{PageId, RequestId};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::io;
use std::sync::Arc;

fn io_err(e: io::Error) -> PyErr {
    TraceError::new_err(e.to_string())
}

fn pages(v: Vec<u32>) -> Vec<PageId> {
    v.into_iter().map(PageId).collect()
}

/// Records an engine's ownership events as a v1.1 trace (JSON lines), in memory: replay it with
/// kvguard.Replayer or the `kvguard replay` command line.
///
/// Requests are ints (the trace's ids); tenants and prefix keys are strs. text() returns the
/// trace so far; end() writes the end marker, without which replay calls the trace truncated.
#[pyclass(module = "kvguard")]
pub struct Recorder {
    inner: core::Recorder<Shared>,
    text: Shared,
}

/// The recorder's in-memory output, read back by `text()`.
#[derive(Clone, Debug, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl io::Write for Shared {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[pymethods]
impl Recorder {
    #[new]
    fn new() -> Recorder {
        let text = Shared::default();
        Recorder { inner: core::Recorder::new(text.clone()), text }
    }
    /// The pool: first event, exactly once.
    fn pool(&mut self, config: &PoolConfig) -> PyResult<()> {
        self.inner.pool(&config.inner).map_err(io_err)
    }
    /// A request starts.
    fn admit(&mut self, request: u64, tenant: &str, prompt: u64, max_new: u64) -> PyResult<()> {
        self.inner.admit(RequestId(request), tenant, prompt, max_new).map_err(io_err)
    }
    /// The engine gave `request` these pages.
    fn alloc(&mut self, request: u64, pages: Vec<u32>) -> PyResult<()> {
        self.inner.alloc(RequestId(request), &self::pages(pages)).map_err(io_err)
    }
    /// `request` wrote slots start..end of `page`.
    fn write(&mut self, request: u64, page: u32, start: u32, end: u32) -> PyResult<()> {
        self.inner.write(RequestId(request), PageId(page), start, end).map_err(io_err)
    }
    /// `request` read its first `tokens` tokens through `pages`.
    fn read(&mut self, request: u64, pages: Vec<u32>, tokens: u64) -> PyResult<()> {
        self.inner.read(RequestId(request), &self::pages(pages), tokens).map_err(io_err)
    }
    /// `request` ended (pages=None) or released just `pages`.
    #[pyo3(signature = (request, pages = None))]
    fn free(&mut self, request: u64, pages: Option<Vec<u32>>) -> PyResult<()> {
        match pages {
            None => self.inner.free(RequestId(request)),
            Some(p) => self.inner.free_pages(RequestId(request), &self::pages(p)),
        }
        .map_err(io_err)
    }
    /// `request`'s `pages` become the read-only prefix `key`.
    fn share(&mut self, request: u64, key: &str, pages: Vec<u32>) -> PyResult<()> {
        self.inner.share(RequestId(request), key, &self::pages(pages)).map_err(io_err)
    }
    /// `request` holds prefix `key`.
    fn attach(&mut self, request: u64, key: &str) -> PyResult<()> {
        self.inner.attach(RequestId(request), key).map_err(io_err)
    }
    /// The cache drops prefix `key`.
    fn evict(&mut self, key: &str) -> PyResult<()> {
        self.inner.evict(key).map_err(io_err)
    }
    /// A KV transfer wrote `tokens` tokens into `request`'s `pages`, which expected `expect`.
    fn import_kv(&mut self, request: u64, pages: Vec<u32>, tokens: u64, expect: u64) -> PyResult<()> {
        self.inner.import(RequestId(request), &self::pages(pages), tokens, expect).map_err(io_err)
    }
    /// `child` is forked from `request`.
    fn fork(&mut self, request: u64, child: u64) -> PyResult<()> {
        self.inner.fork(RequestId(request), RequestId(child)).map_err(io_err)
    }
    /// v1.1: `request` lets go of prefix `key`.
    fn detach(&mut self, request: u64, key: &str) -> PyResult<()> {
        self.inner.detach(RequestId(request), key).map_err(io_err)
    }
    /// v1.1: `request` is preempted (its pages and prefix holds released, still admitted).
    fn preempt(&mut self, request: u64) -> PyResult<()> {
        self.inner.preempt(RequestId(request)).map_err(io_err)
    }
    /// v1.1: the engine scrubbed these released pages.
    fn scrub(&mut self, pages: Vec<u32>) -> PyResult<()> {
        self.inner.scrub(&self::pages(pages)).map_err(io_err)
    }
    /// v1.1: other tenants may (allow=True) or may no longer attach to `tenant`'s prefixes.
    fn grant(&mut self, tenant: &str, allow: bool) -> PyResult<()> {
        self.inner.grant(tenant, allow).map_err(io_err)
    }
    /// v1.1: the end marker, once (later calls do nothing). A trace without it replays as
    /// truncated: call it when the engine shuts down cleanly, before the last text().
    fn end(&mut self) -> PyResult<()> {
        self.inner.end().map_err(io_err)
    }
    /// A comment line.
    fn comment(&mut self, text: &str) -> PyResult<()> {
        self.inner.comment(text).map_err(io_err)
    }
    /// Events recorded.
    #[getter]
    fn events(&self) -> u64 {
        self.inner.events()
    }
    /// The trace so far (JSON lines).
    fn text(&mut self) -> PyResult<String> {
        self.inner.flush().map_err(io_err)?;
        String::from_utf8(self.text.0.lock().clone()).map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// One violation a replay found: the line, the event, the violation; `as_dict()` is the
/// object `kvguard replay --json` prints.
#[pyclass(frozen, module = "kvguard")]
pub struct ReplayViolation {
    json: String,
    message: String,
    /// Line of the trace.
    #[pyo3(get)]
    line: u64,
    /// The event ('read', 'write', ...).
    #[pyo3(get)]
    event: &'static str,
    /// The violation kind ('foreign_page', ...).
    #[pyo3(get)]
    kind: &'static str,
    /// The request (trace id).
    #[pyo3(get)]
    request: Option<u64>,
    /// The page.
    #[pyo3(get)]
    page: Option<u64>,
    /// The request's tenant name.
    #[pyo3(get)]
    tenant: Option<String>,
    /// The page's owner.
    #[pyo3(get)]
    owner: Option<u64>,
    /// The owner's tenant name.
    #[pyo3(get)]
    owner_tenant: Option<String>,
    /// The prefix key's name.
    #[pyo3(get)]
    prefix: Option<String>,
    /// Slots (start, end).
    #[pyo3(get)]
    slots: Option<(u64, u64)>,
}

impl ReplayViolation {
    fn new(v: &core::ReplayViolation) -> PyResult<ReplayViolation> {
        Ok(ReplayViolation {
            json: serde_json::to_string(v).map_err(|e| PyValueError::new_err(e.to_string()))?,
            message: v.to_string(),
            line: v.line(),
            event: v.event().as_str(),
            kind: v.kind().as_str(),
            request: v.request(),
            page: v.page(),
            tenant: v.tenant().map(str::to_string),
            owner: v.owner(),
            owner_tenant: v.owner_tenant().map(str::to_string),
            prefix: v.prefix().map(str::to_string),
            slots: v.slots(),
        })
    }
}

#[pymethods]
impl ReplayViolation {
    /// The object `kvguard replay --json` prints for this violation.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?.call_method1("loads", (self.json.as_str(),))
    }
    fn __str__(&self) -> &str {
        &self.message
    }
    fn __repr__(&self) -> String {
        format!("<ReplayViolation {}>", self.message)
    }
}

/// Replays a v1 trace through a table in shadow mode with policy report, as `kvguard replay`
/// does: every violating event is returned with its line and changes nothing; replay goes on.
/// An unusable line raises TraceError.
#[pyclass(module = "kvguard")]
pub struct Replayer {
    inner: core::Replayer,
}

fn trace_err(e: core::ReplayError) -> PyErr {
    let line = e.line();
    let err = TraceError::new_err(e.to_string());
    Python::attach(|py| {
        let _ = err.value(py).setattr("line", line);
    });
    err
}

#[pymethods]
impl Replayer {
    #[new]
    fn new() -> Replayer {
        Replayer { inner: core::Replayer::new() }
    }

    /// Replays one line (str or bytes): its violation, or None.
    fn feed_line(&mut self, line: &Bound<'_, PyAny>) -> PyResult<Option<ReplayViolation>> {
        let bytes: Vec<u8> = match line.extract::<String>() {
            Ok(s) => s.into_bytes(),
            Err(_) => line.extract::<Vec<u8>>()?,
        };
        self.inner.feed_line(&bytes).map_err(trace_err)?.map(|v| ReplayViolation::new(&v)).transpose()
    }

    /// Replays a whole trace (str or bytes), the GIL released: its violations in line order.
    /// A trace with no pool event is unusable (TraceError).
    fn replay(&mut self, py: Python<'_>, text: &Bound<'_, PyAny>) -> PyResult<Vec<ReplayViolation>> {
        let bytes: Vec<u8> = match text.extract::<String>() {
            Ok(s) => s.into_bytes(),
            Err(_) => text.extract::<Vec<u8>>()?,
        };
        let inner = &mut self.inner;
        let mut found = Vec::new();
        py.detach(|| {
            inner.replay(&bytes[..], |v| {
                found.push(v.clone());
                Ok(())
            })
        })
        .map_err(trace_err)?;
        found.iter().map(ReplayViolation::new).collect()
    }

    /// {lines, events, violations, by_kind: {kind: count}} so far.
    fn summary<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.summary();
        let d = PyDict::new(py);
        d.set_item("lines", s.lines)?;
        d.set_item("events", s.events)?;
        d.set_item("violations", s.violations)?;
        let by = PyDict::new(py);
        for (k, n) in s.by_kind {
            by.set_item(k.as_str(), n)?;
        }
        d.set_item("by_kind", by)?;
        Ok(d)
    }
}
