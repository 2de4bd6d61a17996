//! `NixlAgent`, one side's NIXL agent, and `nixl_library_available`: whether the library loads.

use super::nixl_error;
use kvguard::transfer::nixl as core;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Whether libnixl_capi.so can be loaded in this process (the nixl-cu12 wheel's
/// site-packages/.nixl_cu12.mesonpy.libs on LD_LIBRARY_PATH).
#[pyfunction]
pub fn nixl_library_available(py: Python<'_>) -> bool {
    py.detach(core::library_available)
}

/// One NIXL agent with the UCX back end and no progress thread: UCX moves bytes only inside this
/// agent's calls, which every wait here keeps making (no core burnt while idle).
///
/// NixlAgent(name): name unique among the agents that talk to each other. UCX reads its usual
/// variables (UCX_TLS=tcp,self UCX_NET_DEVICES=lo: loopback TCP). NixlError (kind 'library')
/// when libnixl_capi.so cannot be loaded.
#[pyclass(frozen, module = "kvguard")]
pub struct NixlAgent {
    pub(super) agent: core::NixlAgent,
}

#[pymethods]
impl NixlAgent {
    #[new]
    fn new(py: Python<'_>, name: &str) -> PyResult<NixlAgent> {
        py.detach(|| core::NixlAgent::new(name)).map(|agent| NixlAgent { agent }).map_err(|e| nixl_error(py, &e))
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.agent.name()
    }

    /// This agent's metadata (bytes) for the peer's NixlLink, sent out of band; take it after
    /// registering the regions.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = py.detach(|| self.agent.metadata()).map_err(|e| nixl_error(py, &e))?;
        Ok(PyBytes::new(py, &md))
    }

    fn __repr__(&self) -> String {
        format!("NixlAgent({:?})", self.agent.name())
    }
}
