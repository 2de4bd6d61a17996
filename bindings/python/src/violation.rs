//! `Violation` for Python: a core violation, its requests and tenants named as the caller names
//! them. The exceptions that carry one are in [`errors`](crate::errors).

use crate::names::{PyId, Resolved};
use pyo3::prelude::*;

/// A read, write, release or transfer that would break ownership, in one line (str()).
///
/// Attributes: kind ('foreign_page', ...), op ('read', 'write', ...), request, tenant (as the
/// caller named them: str ids while the request lives, else int), page, generation, owner,
/// owner_tenant, slots ((start, end) or None), block_index, expected_generation, prefix.
#[pyclass(frozen, module = "kvguard")]
#[derive(Debug)]
pub struct Violation {
    pub(crate) inner: kvguard::Violation,
    pub(crate) message: String,
    request: Option<Py<PyAny>>,
    tenant: Option<Py<PyAny>>,
    owner: Option<Py<PyAny>>,
    owner_tenant: Option<Py<PyAny>>,
}

impl Violation {
    /// Wraps a core violation, its requests and tenants named as the caller names them: a str
    /// id reads as the engine's own (`req "cmpl-7" (tenant "acme")`), never as its internal key.
    pub fn wrap(py: Python<'_>, v: kvguard::Violation, ids: Resolved) -> PyResult<Py<Violation>> {
        let mut message = v.to_string();
        for (id, word, n) in [
            (&ids.request, "req", v.request().map(|r| r.0)),
            (&ids.owner, "req", v.owner().map(|r| r.0)),
            (&ids.tenant, "tenant", v.tenant().map(|t| t.0)),
            (&ids.owner_tenant, "tenant", v.owner_tenant().map(|t| t.0)),
        ] {
            if let (Some(PyId::Name(s)), Some(n)) = (id, n) {
                message = named(&message, word, n, s);
            }
        }
        let obj = |id: &Option<PyId>| id.as_ref().map(|i| i.to_py(py)).transpose();
        let (request, tenant, owner, owner_tenant) =
            (obj(&ids.request)?, obj(&ids.tenant)?, obj(&ids.owner)?, obj(&ids.owner_tenant)?);
        Py::new(py, Violation { inner: v, message, request, tenant, owner, owner_tenant })
    }
}

/// `message` with every `{word} {n}` (not followed by another digit) written `{word} "{name}"`.
fn named(message: &str, word: &str, n: u64, name: &str) -> String {
    let key = format!("{word} {n}");
    let mut out = String::with_capacity(message.len() + name.len());
    let mut rest = message;
    while let Some(at) = rest.find(&key) {
        let after = &rest[at + key.len()..];
        out.push_str(&rest[..at]);
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            out.push_str(&key);
        } else {
            out.push_str(&format!("{word} {name:?}"));
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

fn opt(py: Python<'_>, o: &Option<Py<PyAny>>) -> Option<Py<PyAny>> {
    o.as_ref().map(|o| o.clone_ref(py))
}

#[pymethods]
impl Violation {
    /// The rule broken: a stable snake_case name ('foreign_page').
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind().as_str()
    }
    /// The operation it happened in ('read', 'write', 'admit', ...).
    #[getter]
    fn op(&self) -> String {
        format!("{:?}", self.inner.op()).to_lowercase()
    }
    /// The request that did it.
    #[getter]
    fn request(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        opt(py, &self.request)
    }
    /// Its tenant.
    #[getter]
    fn tenant(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        opt(py, &self.tenant)
    }
    /// The page involved.
    #[getter]
    fn page(&self) -> Option<u32> {
        self.inner.page().map(|p| p.0)
    }
    /// The page's generation at the time.
    #[getter]
    fn generation(&self) -> Option<u32> {
        self.inner.generation().map(|g| g.0)
    }
    /// The generation the caller named (stale refs).
    #[getter]
    fn expected_generation(&self) -> Option<u32> {
        self.inner.expected_generation().map(|g| g.0)
    }
    /// Index in the block table.
    #[getter]
    fn block_index(&self) -> Option<u32> {
        self.inner.block_index()
    }
    /// The page's owner.
    #[getter]
    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        opt(py, &self.owner)
    }
    /// The owner's tenant.
    #[getter]
    fn owner_tenant(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        opt(py, &self.owner_tenant)
    }
    /// Slots involved, (start, end) half-open.
    #[getter]
    fn slots(&self) -> Option<(u32, u32)> {
        self.inner.slots()
    }
    /// The prefix key involved.
    #[getter]
    fn prefix(&self) -> Option<u64> {
        self.inner.prefix().map(|p| p.0)
    }
    /// (found, limit) for counts (tokens, pages); (start, end) for token_range_reversed.
    #[getter]
    fn amounts(&self) -> Option<(u64, u64)> {
        self.inner.amounts()
    }
    fn __str__(&self) -> &str {
        &self.message
    }
    fn __repr__(&self) -> String {
        format!("<Violation {}>", self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::named;

    #[test]
    fn a_named_id_replaces_its_key_and_no_longer_key() {
        let m = "foreign_page: req 12 (tenant 3) read page 4, owned by req 123 (tenant 3)";
        assert_eq!(
            named(m, "req", 12, "cmpl-7"),
            r#"foreign_page: req "cmpl-7" (tenant 3) read page 4, owned by req 123 (tenant 3)"#
        );
        assert_eq!(
            named(m, "tenant", 3, "acme"),
            r#"foreign_page: req 12 (tenant "acme") read page 4, owned by req 123 (tenant "acme")"#
        );
        assert_eq!(named(m, "req", 7, "x"), m);
    }
}
