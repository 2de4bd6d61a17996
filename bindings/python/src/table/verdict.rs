//! `StepVerdict`, what a step's call returns to Python, and the core's verdicts and refused
//! events converted into it: each violation's ids resolved through the names lock, wrapped as a
//! `Violation`, and logged where the call is judged.

use super::{NUMPY, OwnershipTable};
use crate::errors::log_violation;
use crate::names::{Names, Resolved};
use crate::violation::Violation;
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// The verdict on a step: which rows may not run attention (reads), or whose writes were
/// refused and not recorded (writes).
///
/// clean: no row refused. refused: `[(row, Violation)]` in row order. refused_rows: `[row]`.
/// refused_mask: numpy bool array, one entry per row of the step, True where refused.
#[pyclass(frozen, module = "kvguard")]
pub struct StepVerdict {
    rows: usize,
    pub(super) refused: Vec<(usize, Py<Violation>)>,
    mask: PyOnceLock<Py<PyAny>>,
}

#[pymethods]
impl StepVerdict {
    /// No row was refused.
    #[getter]
    fn clean(&self) -> bool {
        self.refused.is_empty()
    }
    /// Rows in the step.
    #[getter]
    fn rows(&self) -> usize {
        self.rows
    }
    /// [(row, Violation)] for every refused row, in row order.
    #[getter]
    fn refused(&self, py: Python<'_>) -> Vec<(usize, Py<Violation>)> {
        self.refused.iter().map(|(i, v)| (*i, v.clone_ref(py))).collect()
    }
    /// The refused rows, in order.
    #[getter]
    fn refused_rows(&self) -> Vec<usize> {
        self.refused.iter().map(|(i, _)| *i).collect()
    }
    /// The violations, in row order.
    #[getter]
    fn violations(&self, py: Python<'_>) -> Vec<Py<Violation>> {
        self.refused.iter().map(|(_, v)| v.clone_ref(py)).collect()
    }
    /// numpy bool array of `rows` entries, True for each refused row (built on first access).
    #[getter]
    fn refused_mask(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mask = self.mask.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            let np = NUMPY.get_or_try_init(py, || -> PyResult<Py<PyModule>> { Ok(py.import("numpy")?.unbind()) })?;
            let np = np.bind(py);
            let mask = np.call_method1("zeros", (self.rows, np.getattr("bool_")?))?;
            for (i, _) in &self.refused {
                mask.set_item(*i, true)?;
            }
            Ok(mask.unbind())
        })?;
        Ok(mask.clone_ref(py))
    }
    /// Number of refused rows.
    fn __len__(&self) -> usize {
        self.refused.len()
    }
    fn __repr__(&self) -> String {
        format!("StepVerdict(rows={}, refused={:?})", self.rows, self.refused_rows())
    }
}

impl OwnershipTable {
    /// Converts a step verdict; `judged`: its violations are logged.
    pub(super) fn verdict(
        &self,
        py: Python<'_>,
        v: kvguard::StepVerdict,
        rows: usize,
        judged: bool,
    ) -> PyResult<StepVerdict> {
        let resolved: Vec<(usize, kvguard::Violation, Resolved)> = {
            let names = self.names.lock();
            v.refused
                .into_iter()
                .map(|(i, v)| {
                    let r = names.resolve(&v);
                    (i, v, r)
                })
                .collect()
        };
        let mut refused = Vec::with_capacity(resolved.len());
        for (i, v, r) in resolved {
            let v = Violation::wrap(py, v, r)?;
            if judged {
                log_violation(py, &v);
            }
            refused.push((i, v));
        }
        Ok(StepVerdict { rows, refused, mask: PyOnceLock::new() })
    }

    /// Converts apply_events' outcome: each refusal logged and wrapped; a non-violation error
    /// raised after the refusals before it are logged.
    pub(super) fn refused_events(
        &self,
        py: Python<'_>,
        outcome: Result<Vec<crate::events::RefusedEvent>, Box<crate::events::EventError>>,
    ) -> PyResult<Vec<(usize, Py<Violation>)>> {
        let (refused, error) = match outcome {
            Ok(refused) => (refused, None),
            Err(e) => {
                let e = *e;
                (e.refused, Some((e.index, e.error)))
            }
        };
        let mut out = Vec::with_capacity(refused.len());
        for (i, v, r) in refused {
            let v = Violation::wrap(py, v, r)?;
            log_violation(py, &v);
            out.push((i, v));
        }
        match error {
            None => Ok(out),
            Some((i, e)) => {
                let err = self.err(py, e);
                let note = PyValueError::new_err(format!("events[{i}] failed; the events before it were applied"));
                err.set_cause(py, Some(note));
                Err(err)
            }
        }
    }
}

/// A step verdict's violations with their ids resolved now (the names lock only; no Python).
pub(super) fn resolved(names: &Mutex<Names>, v: kvguard::StepVerdict) -> Vec<(usize, kvguard::Violation, Resolved)> {
    if v.refused.is_empty() {
        return Vec::new();
    }
    let names = names.lock();
    v.refused
        .into_iter()
        .map(|(i, v)| {
            let r = names.resolve(&v);
            (i, v, r)
        })
        .collect()
}

/// A judged step verdict for Python from resolved violations, each logged.
pub(super) fn judged_verdict(
    py: Python<'_>,
    refused: Vec<(usize, kvguard::Violation, Resolved)>,
    rows: usize,
) -> PyResult<StepVerdict> {
    let mut out = Vec::with_capacity(refused.len());
    for (i, v, r) in refused {
        let v = Violation::wrap(py, v, r)?;
        log_violation(py, &v);
        out.push((i, v));
    }
    Ok(StepVerdict { rows, refused: out, mask: PyOnceLock::new() })
}
