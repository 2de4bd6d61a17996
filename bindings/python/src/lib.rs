//! The Python binding of kvguard: the extension module `kvguard._kvguard`, re-exported by the
//! pure-Python package `kvguard` (`python/kvguard/__init__.py`).
//!
//! A binding adds no semantics: every function converts its arguments, calls the core crate and
//! converts the result back. What this crate does on its own:
//!
//! | module | what it holds |
//! |---|---|
//! | [`names`] | request and tenant ids as engines have them (`int` or `str`); strings interned, released with the request; a step's ids remembered by object |
//! | [`arrays`] | zero-copy views of the engine's arrays (numpy, buffer protocol, host DLPack), int32 and int64, each checked against its owner's memory |
//! | [`errors`] | the exception hierarchy, and violations sent to Python's `logging` |
//! | [`values`] | the plain values: pool config, page refs, infos, snapshot |
//! | [`violation`] | `Violation`: a core violation, its ids named as the caller names them |
//! | [`table`] | `OwnershipTable`, the one-call-per-step entry points and their verdict |
//! | [`mirror`] | an engine plugin's mirror of its pool (kvguard.sglang's arrays) and a decode step judged against it |
//! | [`table::import`] | `ImportTicket`: a KV transfer in flight, its pages pinned until it ends (the table's, as in the core: only `OwnershipTable.begin_import` makes one) |
//! | [`transfer`] | manifests and the receiver |
//! | [`trace`] | the trace recorder and replayer |
//! | [`device`] | the CUDA device guard (a typed error without a GPU) |
//! | `nixl` | checked transfers over NIXL (feature `nixl`): agent, regions (kvguard's host pages, an engine's pool), link |
//!
//! All `unsafe` of the Python binding lives in [`arrays`], [`names`] (a step's id list read with
//! borrowed items), [`table::import`] and [`transfer`] (a ticket's or pin's borrow of its table, kept
//! alive by the Python object), [`device`] and `nixl` (buffers borrowed from Python; a link's
//! borrow of its agent), each block with its `// SAFETY:` argument.

use pyo3::prelude::*;

pub mod arrays;
pub mod device;
pub mod errors;
pub mod events;
pub mod mirror;
pub mod names;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod rows;
pub mod table;
pub mod trace;
pub mod transfer;
pub mod values;
pub mod violation;

/// The extension module: classes, exceptions and functions, re-exported by `kvguard`.
#[pymodule]
fn _kvguard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PADDING_SLOT", kvguard::PADDING_SLOT)?;
    m.add("Error", py.get_type::<errors::Error>())?;
    m.add("ViolationError", py.get_type::<errors::ViolationError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add("OutOfPagesError", py.get_type::<errors::OutOfPagesError>())?;
    m.add("ScrubError", py.get_type::<errors::ScrubError>())?;
    m.add("TransferError", py.get_type::<errors::TransferError>())?;
    m.add("TraceError", py.get_type::<errors::TraceError>())?;
    m.add("DeviceError", py.get_type::<errors::DeviceError>())?;
    m.add_class::<values::PoolConfig>()?;
    m.add_class::<values::PageRef>()?;
    m.add_class::<violation::Violation>()?;
    m.add_class::<values::Released>()?;
    m.add_class::<values::PageInfo>()?;
    m.add_class::<values::RequestInfo>()?;
    m.add_class::<values::PoolSnapshot>()?;
    m.add_class::<table::OwnershipTable>()?;
    m.add_function(wrap_pyfunction!(mirror::mark_pages, m)?)?;
    m.add_class::<table::StepVerdict>()?;
    m.add_class::<rows::RowCache>()?;
    m.add_class::<rows::HeldBlockTable>()?;
    m.add_class::<table::ImportTicket>()?;
    m.add_class::<transfer::Manifest>()?;
    m.add_class::<transfer::Receiver>()?;
    m.add_class::<transfer::Accepted>()?;
    m.add_class::<transfer::PinnedImport>()?;
    m.add_function(wrap_pyfunction!(transfer::page_checksum, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::prompt_digest, m)?)?;
    m.add_class::<trace::Recorder>()?;
    m.add_class::<trace::Replayer>()?;
    m.add_class::<trace::ReplayViolation>()?;
    m.add_class::<device::DeviceGuard>()?;
    m.add_function(wrap_pyfunction!(device::driver_available, m)?)?;
    #[cfg(feature = "nixl")]
    {
        m.add("NixlError", py.get_type::<nixl::NixlError>())?;
        m.add_class::<nixl::NixlAgent>()?;
        m.add_class::<nixl::HostRegion>()?;
        m.add_class::<nixl::EnginePool>()?;
        m.add_class::<nixl::NixlLink>()?;
        m.add_function(wrap_pyfunction!(nixl::nixl_library_available, m)?)?;
    }
    m.add("VIOLATION_KINDS", kvguard::ViolationKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>())?;
    Ok(())
}
