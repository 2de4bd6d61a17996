//! Checked KV transfers over NIXL from Python (feature `nixl`): the core's
//! [`kvguard::transfer::nixl`] bound, not re-implemented over `nixl_cu12._api`, so that an
//! engine's Python connector (vLLM's NixlConnector, SGLang's nixl backend) gets the same
//! protocol and failure paths as the Rust side: the pin taken before the pull and held across it
//! ([`PinnedImport`](crate::transfer::PinnedImport)), check, record and scrub in one step, the
//! page CRCs and every wait run without the GIL.
//!
//! ```text
//! agent  = NixlAgent("decode")                      # UCX, no progress thread
//! region = HostRegion(agent, pages, page_bytes)     # registered host pages
//! # out of band: agent.metadata() and region.layout() (bytes) to the peer, the peer's back
//! link   = NixlLink(agent, peer_metadata, peer_layout)
//! decode:  pinned = Receiver(table).pin(...); <ask prefill>; link.receive(pinned, region)
//! prefill: link.push(region, src, dest, request, manifest) | link.stage(...) | link.decline(...)
//! ```
//!
//! Refusals are `kvguard.TransferError` (with `.kind` and `.violation`, recorded in the table);
//! a transport failure, a timeout or a decline is `kvguard.NixlError` (`.kind`), with nothing
//! recorded. Either way the pinned pages get no coverage and are scrubbed.
//!
//! | module | what it holds |
//! |---|---|
//! | this file | the exception `NixlError` and the argument and error helpers the classes share |
//! | `agent` | `NixlAgent`, and whether the library loads (`nixl_library_available`) |
//! | `region` | the regions a transfer reads and lands in: `HostRegion` (kvguard's host pages), `EnginePool` (an engine's own pool: host memory, or GPU memory behind its callbacks), and a region argument locked for one call |
//! | `link` | `NixlLink`: the protocol's calls (push, push_prompt, stage, decline, receive, expect, abandon, the fences, settling and releasing held pages), and the regions it keeps alive while held transfers may still read them |
//!
//! `unsafe` lives in `region` (an engine's memory registered by address or through its buffer
//! export) and `link` (a link's borrow of its agent), each block with its `// SAFETY:` argument.

mod agent;
mod link;
mod region;

use crate::errors::Error;
use crate::transfer::Bytes;
use crate::values::PageRef;
use kvguard::PageId;
use kvguard::transfer::nixl as core;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::time::{Duration, Instant};

pub use agent::{NixlAgent, nixl_library_available};
pub use link::NixlLink;
pub use region::{EnginePool, HostRegion};

pyo3::create_exception!(
    kvguard,
    NixlError,
    Error,
    "The NIXL transport failed: no verdict on the transfer's content, nothing recorded; a pinned\n\
     import it aborted leaves its pages without coverage, and scrubbed.\n\n\
     Attribute kind: 'library' (libnixl_capi.so cannot be loaded: put the nixl-cu12 wheel's\n\
     site-packages/.nixl_cu12.mesonpy.libs on LD_LIBRARY_PATH), 'call' (a NIXL call failed),\n\
     'timeout' (the transfer or the notification did not come by the deadline), 'declined' (the\n\
     sender declined; ask again later), 'extents' (pages outside a region, a pool description\n\
     that does not fit), 'notice' (a malformed notice or region layout), 'segment' (memory\n\
     kvguard cannot read from the host: a GPU pool without read/scrub callbacks).\n\n\
     Attribute in_flight: a push that failed after posting WRITEs NIXL has not reported\n\
     complete lists the source pages (of the region pushed from) those WRITEs may still read:\n\
     reuse them only once NixlLink.settle_pushes() hands them back; a stage that failed before\n\
     decode released it lists the staged pages decode may still READ: reuse them only once\n\
     NixlLink.settle_stages() hands them back. Empty otherwise."
);

/// A core transport error as a `NixlError` with its `.kind` (of its cause, for a push or a stage
/// that failed with its pages still read) and `.in_flight` (the source pages that may still be
/// read).
fn nixl_error(py: Python<'_>, e: &core::NixlError) -> PyErr {
    let kind = match e.cause() {
        core::NixlError::Library { .. } => "library",
        core::NixlError::Call { .. } => "call",
        core::NixlError::Timeout { .. } => "timeout",
        core::NixlError::Extents { .. } => "extents",
        core::NixlError::Notice { .. } => "notice",
        core::NixlError::Segment { .. } => "segment",
        _ => "transport",
    };
    with_pages(py, e.to_string(), kind, e.in_flight())
}

fn with_kind(py: Python<'_>, message: String, kind: &str) -> PyErr {
    with_pages(py, message, kind, &[])
}

fn with_pages(py: Python<'_>, message: String, kind: &str, in_flight: &[u32]) -> PyErr {
    let err = NixlError::new_err(message);
    let value = err.value(py);
    if let Err(e) = value.setattr("kind", kind).and_then(|()| value.setattr("in_flight", in_flight.to_vec())) {
        return e;
    }
    err
}

/// The deadline `timeout` seconds from now.
fn deadline(timeout: f64) -> PyResult<Instant> {
    let d = Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("timeout must be seconds >= 0, got {timeout}")))?;
    Instant::now().checked_add(d).ok_or_else(|| PyValueError::new_err(format!("timeout {timeout} s is too far away")))
}

/// A bytes-like argument, copied (metadata, layouts, manifests: small).
fn bytes_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u8>> {
    Ok(Bytes::open(obj, name)?.as_ref().to_vec())
}

/// `[(page, length)]` → extents.
fn extents(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<core::Extent>> {
    obj.try_iter()?
        .map(|item| {
            let (page, len): (u32, u32) = item?
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("{name} must hold (page, length) pairs of ints")))?;
            Ok(core::Extent { page, len })
        })
        .collect()
}

/// Page ids, from ints or kvguard.PageRef.
fn page_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<PageId>> {
    obj.try_iter()?
        .map(|item| {
            let item = item?;
            if let Ok(r) = item.cast::<PageRef>() {
                return Ok(kvguard::PageRef::from(*r.get()).page);
            }
            item.extract::<u32>()
                .map(PageId)
                .map_err(|_| PyTypeError::new_err(format!("{name} must hold page ids (ints) or kvguard.PageRef")))
        })
        .collect()
}

fn busy(what: &str) -> PyErr {
    PyRuntimeError::new_err(format!("a transfer is in flight on this {what} (another thread's call)"))
}
