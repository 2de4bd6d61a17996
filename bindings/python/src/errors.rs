//! The exception hierarchy, the conversion of core errors into it, and violations sent to
//! Python's `logging` (logger `kvguard`).
//!
//! ```text
//! kvguard.Error
//!  ├── ViolationError    a violation refused the call (.violation, .kind, .request, .tenant, .page, ...)
//!  ├── ConfigError       the pool configuration was refused
//!  ├── OutOfPagesError   not enough free pages right now (.requested, .free)
//!  ├── ScrubError        a scrub confirmation for a page not awaiting one
//!  ├── TransferError     a manifest that cannot be built or decoded, or a refused transfer (.kind)
//!  ├── TraceError        an unusable trace line (.line)
//!  └── DeviceError       the CUDA device guard could not be set up or a launch failed
//! ```
//! Wrong argument types and shapes are `TypeError` / `ValueError`, naming what was expected.

use crate::names::Resolved;
use crate::violation::Violation;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

pyo3::create_exception!(kvguard, Error, pyo3::exceptions::PyException, "The base of every kvguard error.");
pyo3::create_exception!(
    kvguard,
    ViolationError,
    Error,
    "A violation refused the call: a read, write, release or transfer that would break page ownership.\n\n\
     Attributes: violation (kvguard.Violation), kind (str, e.g. 'foreign_page'), op, request, tenant,\n\
     page, generation, owner, owner_tenant, slots ((start, end) or None), block_index, prefix.\n\
     str() is the violation's one-line message."
);
pyo3::create_exception!(
    kvguard,
    ConfigError,
    Error,
    "The pool configuration was refused (validation or start-up audit)."
);
pyo3::create_exception!(
    kvguard,
    OutOfPagesError,
    Error,
    "Not enough free pages right now: wait, preempt or evict. Attributes: requested, free."
);
pyo3::create_exception!(
    kvguard,
    ScrubError,
    Error,
    "A scrub confirmation for a page that is not awaiting one in that incarnation, or that a transfer still lands in."
);
pyo3::create_exception!(
    kvguard,
    TransferError,
    Error,
    "A manifest that cannot be built or decoded, or a KV transfer the receiver refused.\n\n\
     Attributes: kind (the violation kind, e.g. 'page_checksum_mismatch', or None for a build error),\n\
     violation (kvguard.Violation or None)."
);
pyo3::create_exception!(
    kvguard,
    TraceError,
    Error,
    "An unusable trace: a malformed line, an event before the pool. Attribute: line."
);
pyo3::create_exception!(
    kvguard,
    DeviceError,
    Error,
    "The CUDA device guard could not be set up (no driver, no device, no NVRTC) or a device operation failed."
);

/// A `ViolationError` for `v`, its attributes set.
pub fn violation_error(py: Python<'_>, v: Py<Violation>) -> PyErr {
    let err = ViolationError::new_err(v.get().message.clone());
    if let Err(e) = set_violation_attrs(py, err.value(py).as_any(), &v) {
        return e;
    }
    err
}

/// Copies a violation's fields onto an exception instance.
pub fn set_violation_attrs(py: Python<'_>, obj: &Bound<'_, PyAny>, v: &Py<Violation>) -> PyResult<()> {
    let b = v.bind(py);
    obj.setattr("violation", b)?;
    for attr in [
        "kind",
        "op",
        "request",
        "tenant",
        "page",
        "generation",
        "owner",
        "owner_tenant",
        "slots",
        "block_index",
        "prefix",
    ] {
        obj.setattr(attr, b.getattr(attr)?)?;
    }
    Ok(())
}

/// Converts a core error; a violation becomes a `ViolationError` and is logged first (the
/// table judged it), its ids named by `resolve` (which takes the names lock and drops it).
pub fn to_py(py: Python<'_>, e: kvguard::Error, resolve: impl FnOnce(&kvguard::Violation) -> Resolved) -> PyErr {
    match e {
        kvguard::Error::Violation(v) => {
            let ids = resolve(&v);
            match Violation::wrap(py, v, ids) {
                Ok(v) => {
                    log_violation(py, &v);
                    violation_error(py, v)
                }
                Err(e) => e,
            }
        }
        kvguard::Error::Config(c) => ConfigError::new_err(c.to_string()),
        kvguard::Error::OutOfPages { requested, free } => {
            let err = OutOfPagesError::new_err(e.to_string());
            let value = err.value(py);
            if let Err(e) = value.setattr("requested", requested).and_then(|_| value.setattr("free", free)) {
                return e;
            }
            err
        }
        kvguard::Error::NotAwaitingScrub(_) | kvguard::Error::ScrubInFlight(_) => ScrubError::new_err(e.to_string()),
        other => Error::new_err(other.to_string()),
    }
}

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Sends a judged violation to the `kvguard` logger (level WARNING; the violation object in
/// `extra={"kvguard_violation": v}`). Called with no Rust lock held. A failing log handler does
/// not turn into an error of the call.
pub fn log_violation(py: Python<'_>, v: &Py<Violation>) {
    let logged = (|| -> PyResult<()> {
        let logger = LOGGER.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            Ok(py.import("logging")?.call_method1("getLogger", ("kvguard",))?.unbind())
        })?;
        let logger = logger.bind(py);
        if !logger.call_method1("isEnabledFor", (30,))?.is_truthy()? {
            return Ok(());
        }
        let extra = PyDict::new(py);
        extra.set_item("kvguard_violation", v.bind(py))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("extra", extra)?;
        logger.call_method("warning", ("%s", v.get().message.as_str()), Some(&kwargs))?;
        Ok(())
    })();
    if let Err(e) = logged {
        e.write_unraisable(py, None);
    }
}
