//! The plain values that cross the boundary: the pool configuration, page refs, what a release
//! handed back, page and request infos and the snapshot (violations are in
//! [`violation`](crate::violation)). Copied out of the table, so holding one never holds a lock.

use crate::errors::ConfigError;
use crate::names::PyId;
use kvguard::{Generation, PageId, Policy};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// Parses a policy name.
fn policy(name: &str) -> PyResult<Policy> {
    match name {
        "enforce" => Ok(Policy::Enforce),
        "report" => Ok(Policy::Report),
        _ => Err(PyValueError::new_err(format!("policy must be 'enforce' or 'report', got {name:?}"))),
    }
}

fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::Enforce => "enforce",
        Policy::Report => "report",
    }
}

/// The engine's KV pool: `num_pages` pages of `page_size` token slots, and the model's max context.
///
/// PoolConfig(num_pages, page_size, max_context_tokens, *, reserved=(), policy="enforce",
///            scrub_on_release=False, generation_limit=2**32 - 1)
///
/// reserved: pages never allocated and never readable (vLLM's null block 0).
/// policy: "enforce" (refuse, quarantine the request) or "report" (count and log, let through).
/// scrub_on_release: released pages must be confirmed scrubbed before they are handed out again.
/// audit() raises ConfigError when one max-context request cannot fit (the start-up audit).
#[pyclass(frozen, module = "kvguard")]
#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub(crate) inner: kvguard::PoolConfig,
}

#[pymethods]
impl PoolConfig {
    #[new]
    #[pyo3(signature = (num_pages, page_size, max_context_tokens, *, reserved = Vec::new(), policy = "enforce", scrub_on_release = false, generation_limit = u32::MAX))]
    fn new(
        num_pages: u32,
        page_size: u32,
        max_context_tokens: u64,
        reserved: Vec<u32>,
        policy: &str,
        scrub_on_release: bool,
        generation_limit: u32,
    ) -> PyResult<PoolConfig> {
        let inner = kvguard::PoolConfig::new(num_pages, page_size, max_context_tokens)
            .with_reserved(reserved.into_iter().map(PageId))
            .with_policy(self::policy(policy)?)
            .with_scrub_on_release(scrub_on_release)
            .with_generation_limit(generation_limit);
        Ok(PoolConfig { inner })
    }

    /// Pages in the pool, ids 0..num_pages.
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.num_pages
    }
    /// Token slots per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size
    }
    /// The most tokens (prompt + generated) one request may have.
    #[getter]
    fn max_context_tokens(&self) -> u64 {
        self.inner.max_context_tokens
    }
    /// Reserved pages, sorted.
    #[getter]
    fn reserved(&self) -> Vec<u32> {
        self.inner.reserved.iter().map(|p| p.0).collect()
    }
    /// "enforce" or "report".
    #[getter]
    fn policy(&self) -> &'static str {
        policy_name(self.inner.policy)
    }
    /// Whether released pages must be confirmed scrubbed before reuse.
    #[getter]
    fn scrub_on_release(&self) -> bool {
        self.inner.scrub_on_release
    }
    /// The generation at which a page retires.
    #[getter]
    fn generation_limit(&self) -> u32 {
        self.inner.generation_limit
    }
    /// Checks that the numbers describe a pool kvguard can track (raises ConfigError).
    fn validate(&self) -> PyResult<()> {
        self.inner.validate().map_err(|e| ConfigError::new_err(e.to_string()))
    }
    /// The start-up audit: validate(), then one max-context request must fit (raises ConfigError).
    fn audit(&self) -> PyResult<()> {
        self.inner.audit().map_err(|e| ConfigError::new_err(e.to_string()))
    }
    /// Pages that can ever be allocated: all but the reserved ones.
    fn allocatable_pages(&self) -> u32 {
        self.inner.allocatable_pages()
    }
    /// Tokens the allocatable pages hold.
    fn capacity_tokens(&self) -> u64 {
        self.inner.capacity_tokens()
    }
    /// Pages needed for `tokens` tokens (rounded up).
    fn pages_for_tokens(&self, tokens: u64) -> u64 {
        self.inner.pages_for_tokens(tokens)
    }
    fn __repr__(&self) -> String {
        format!(
            "PoolConfig(num_pages={}, page_size={}, max_context_tokens={}, reserved={:?}, policy={:?}, scrub_on_release={})",
            self.inner.num_pages,
            self.inner.page_size,
            self.inner.max_context_tokens,
            self.reserved(),
            self.policy(),
            if self.inner.scrub_on_release { "True" } else { "False" }
        )
    }
}

/// One incarnation of a page: the page and the generation it had when handed out. A PageRef
/// kept past the page's release is stale: reads, writes and transfers through it are refused.
#[pyclass(frozen, eq, hash, module = "kvguard")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// The page id.
    #[pyo3(get)]
    pub page: u32,
    /// Its incarnation.
    #[pyo3(get)]
    pub generation: u32,
}

#[pymethods]
impl PageRef {
    #[new]
    fn new(page: u32, generation: u32) -> PageRef {
        PageRef { page, generation }
    }
    fn __repr__(&self) -> String {
        format!("PageRef(page={}, generation={})", self.page, self.generation)
    }
    /// The page id, so a PageRef can index an array.
    fn __index__(&self) -> u32 {
        self.page
    }
}

impl From<kvguard::PageRef> for PageRef {
    fn from(r: kvguard::PageRef) -> PageRef {
        PageRef { page: r.page.0, generation: r.generation.0 }
    }
}

impl From<PageRef> for kvguard::PageRef {
    fn from(r: PageRef) -> kvguard::PageRef {
        kvguard::PageRef { page: PageId(r.page), generation: Generation(r.generation) }
    }
}

/// What a release handed back: `ended` page incarnations, and with scrub_on_release the pages
/// (PageRefs) to poison or zero and then pass to OwnershipTable.confirm_scrubbed.
#[pyclass(frozen, module = "kvguard")]
#[derive(Debug)]
pub struct Released {
    /// How many page incarnations ended.
    #[pyo3(get)]
    ended: u64,
    /// Pages to scrub (empty without scrub_on_release).
    #[pyo3(get)]
    scrub: Vec<PageRef>,
}

impl From<kvguard::Released> for Released {
    fn from(r: kvguard::Released) -> Released {
        Released { ended: r.ended, scrub: r.scrub.into_iter().map(PageRef::from).collect() }
    }
}

#[pymethods]
impl Released {
    fn __repr__(&self) -> String {
        format!("Released(ended={}, scrub={} pages)", self.ended, self.scrub.len())
    }
}

fn state_name(s: kvguard::PageState) -> &'static str {
    use kvguard::PageState::*;
    match s {
        Free => "free",
        Owned => "owned",
        Shared => "shared",
        Reserved => "reserved",
        Retired => "retired",
        AwaitingScrub => "awaiting_scrub",
    }
}

/// What the table knows about one page.
#[pyclass(frozen, module = "kvguard")]
#[derive(Debug)]
pub struct PageInfo {
    /// 'free', 'owned', 'shared', 'reserved', 'retired' or 'awaiting_scrub'.
    #[pyo3(get)]
    state: &'static str,
    /// Its current incarnation.
    #[pyo3(get)]
    generation: u32,
    /// Owner (or prefix publisher) while owned or shared.
    #[pyo3(get)]
    owner: Option<Py<PyAny>>,
    /// The owner's tenant.
    #[pyo3(get)]
    tenant: Option<Py<PyAny>>,
    /// The prefix key it belongs to.
    #[pyo3(get)]
    prefix: Option<u64>,
    /// Slots 0..written_prefix are all written by this incarnation.
    #[pyo3(get)]
    written_prefix: u32,
    /// Slots written by this incarnation, in all.
    #[pyo3(get)]
    written_slots: u32,
}

impl PageInfo {
    /// The Python value of `i`, its owner and tenant resolved.
    pub(crate) fn new(
        py: Python<'_>,
        i: kvguard::PageInfo,
        owner: Option<PyId>,
        tenant: Option<PyId>,
    ) -> PyResult<PageInfo> {
        Ok(PageInfo {
            state: state_name(i.state),
            generation: i.generation.0,
            owner: owner.map(|o| o.to_py(py)).transpose()?,
            tenant: tenant.map(|t| t.to_py(py)).transpose()?,
            prefix: i.prefix.map(|p| p.0),
            written_prefix: i.written_prefix,
            written_slots: i.written_slots,
        })
    }
}

#[pymethods]
impl PageInfo {
    fn __repr__(&self, py: Python<'_>) -> String {
        let owner = self.owner.as_ref().map(|o| o.bind(py).repr().map(|r| r.to_string()).unwrap_or_default());
        format!(
            "PageInfo(state={:?}, generation={}, owner={}, written_slots={})",
            self.state,
            self.generation,
            owner.unwrap_or_else(|| "None".into()),
            self.written_slots
        )
    }
}

/// What the table knows about one admitted request.
#[pyclass(frozen, module = "kvguard")]
#[derive(Debug)]
pub struct RequestInfo {
    /// Its tenant.
    #[pyo3(get)]
    tenant: Py<PyAny>,
    /// Prompt tokens it was admitted with.
    #[pyo3(get)]
    prompt_tokens: u64,
    /// New tokens it may generate.
    #[pyo3(get)]
    max_new_tokens: u64,
    /// Pages it owns exclusively (PageRefs, in no particular order).
    #[pyo3(get)]
    owned_pages: Vec<PageRef>,
    /// Prefix keys it holds.
    #[pyo3(get)]
    prefixes: Vec<u64>,
    /// Quarantined by an enforced violation.
    #[pyo3(get)]
    quarantined: bool,
}

impl RequestInfo {
    /// The Python value of `i`, its tenant resolved.
    pub(crate) fn new(py: Python<'_>, i: kvguard::RequestInfo, tenant: PyId) -> PyResult<RequestInfo> {
        Ok(RequestInfo {
            tenant: tenant.to_py(py)?,
            prompt_tokens: i.prompt_tokens,
            max_new_tokens: i.max_new_tokens,
            owned_pages: i.owned_pages.into_iter().map(PageRef::from).collect(),
            prefixes: i.prefixes.into_iter().map(|p| p.0).collect(),
            quarantined: i.quarantined,
        })
    }
}

#[pymethods]
impl RequestInfo {
    fn __repr__(&self) -> String {
        format!(
            "RequestInfo(prompt_tokens={}, max_new_tokens={}, owned_pages={} pages, quarantined={})",
            self.prompt_tokens,
            self.max_new_tokens,
            self.owned_pages.len(),
            if self.quarantined { "True" } else { "False" }
        )
    }
}

/// Page counts by state and other totals; free + owned + shared + reserved + retired +
/// awaiting_scrub == total_pages always.
#[pyclass(frozen, module = "kvguard")]
#[derive(Debug)]
pub struct PoolSnapshot {
    inner: kvguard::PoolSnapshot,
}

impl From<kvguard::PoolSnapshot> for PoolSnapshot {
    fn from(inner: kvguard::PoolSnapshot) -> PoolSnapshot {
        PoolSnapshot { inner }
    }
}

macro_rules! snapshot_fields {
    ($($(#[$doc:meta])* $f:ident),*) => {
        #[pymethods]
        impl PoolSnapshot {
            $( $(#[$doc])* #[getter] fn $f(&self) -> u64 { self.inner.$f } )*
            /// The snapshot as a dict.
            fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
                let d = pyo3::types::PyDict::new(py);
                $( d.set_item(stringify!($f), self.inner.$f)?; )*
                Ok(d)
            }
            fn __repr__(&self) -> String {
                let mut s = String::from("PoolSnapshot(");
                $( s.push_str(&format!("{}={}, ", stringify!($f), self.inner.$f)); )*
                s.truncate(s.len() - 2);
                s.push(')');
                s
            }
        }
    };
}

snapshot_fields!(
    /// Pages in the pool.
    total_pages,
    /// Free pages.
    free,
    /// Pages owned by one request.
    owned,
    /// Pages in read-only prefixes.
    shared,
    /// Reserved pages.
    reserved,
    /// Retired pages.
    retired,
    /// Released pages awaiting a scrub confirmation.
    awaiting_scrub,
    /// Admitted requests.
    requests,
    /// Quarantined requests.
    quarantined,
    /// Live prefixes.
    prefixes,
    /// Violations seen in all.
    violations,
    /// Violations dropped from the log because nobody drained it.
    violations_dropped,
    /// Released pages a transfer still lands in.
    in_flight
);

/// A str for Python from a Rust str (used by the other modules).
pub fn py_str<'py>(py: Python<'py>, s: &str) -> Bound<'py, PyString> {
    PyString::new(py, s)
}
