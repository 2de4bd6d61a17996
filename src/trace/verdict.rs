//! A violation found in a trace, with the line it came from and the trace's own names.

use super::event::EventKind;
use crate::ids::grouped;
use crate::violation::{Violation, ViolationKind};
use serde::ser::{Serialize, SerializeMap, Serializer};
use std::fmt;
use std::sync::Arc;

/// One violation found by replay: the trace line and event it came from, the table's
/// [`Violation`], and the trace's tenant and key names for the numeric ids in it.
///
/// Prints as one line:
/// `line 9: unwritten_slots in read by req 3 (tenant "acme"), page 40 gen 1, block 0, owned by req 3 (tenant "acme"), slots 4..16`;
/// serializes (for `--json`) as one object with `line`, `ev`, `kind`, `req`, `page`, `owner`,
/// `slots` (null when absent) and, when known, `tenant`, `generation`, `block`, `owner_tenant`,
/// `prefix`, `found`, `limit`, and the same `message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayViolation {
    pub(crate) line: u64,
    pub(crate) ev: EventKind,
    pub(crate) violation: Violation,
    pub(crate) tenant: Option<Arc<str>>,
    pub(crate) owner_tenant: Option<Arc<str>>,
    pub(crate) prefix: Option<Arc<str>>,
    pub(crate) wide_page: Option<u64>,
    /// The `slots` of a `write` as the trace wrote them, when one is beyond `u32`.
    pub(crate) wide_slots: Option<(u64, u64)>,
    /// An `admit` whose `prompt + max_new` overflows 64 bits: the two numbers.
    pub(crate) overflow: Option<(u64, u64)>,
}

impl ReplayViolation {
    /// The 1-based line of the trace.
    pub fn line(&self) -> u64 {
        self.line
    }
    /// The event that violated.
    pub fn event(&self) -> EventKind {
        self.ev
    }
    /// The table's verdict.
    pub fn violation(&self) -> &Violation {
        &self.violation
    }
    /// The rule broken.
    pub fn kind(&self) -> ViolationKind {
        self.violation.kind()
    }
    /// The request that acted, as the trace names it.
    pub fn request(&self) -> Option<u64> {
        self.violation.request().map(|r| r.0)
    }
    /// The page concerned, as the trace names it (ids beyond `u32` included).
    pub fn page(&self) -> Option<u64> {
        match (self.violation.kind(), self.wide_page) {
            (ViolationKind::PageOutOfRange, Some(p)) if self.violation.page().is_some_and(|p| p.0 == u32::MAX) => {
                Some(p)
            }
            _ => self.violation.page().map(|p| u64::from(p.0)),
        }
    }
    /// The acting request's tenant, as the trace names it.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }
    /// The page's (or prefix's) owner.
    pub fn owner(&self) -> Option<u64> {
        self.violation.owner().map(|r| r.0)
    }
    /// The owner's tenant, as the trace names it.
    pub fn owner_tenant(&self) -> Option<&str> {
        self.owner_tenant.as_deref()
    }
    /// The prefix key concerned, as the trace names it.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }
    /// The slot range `[a, b)` concerned, as the trace names it (numbers beyond `u32` included).
    pub fn slots(&self) -> Option<(u64, u64)> {
        match (self.violation.kind(), self.wide_slots) {
            (ViolationKind::SlotOutOfRange, Some(wide)) => Some(wide),
            _ => self.violation.slots().map(|(a, b)| (u64::from(a), u64::from(b))),
        }
    }
}

impl fmt::Display for ReplayViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = &self.violation;
        write!(f, "line {}: {} in {}", self.line, v.kind().as_str(), self.ev)?;
        if let Some(r) = v.request() {
            write!(f, " by req {}", r.0)?;
            if let Some(t) = &self.tenant {
                write!(f, " (tenant {t:?})")?;
            }
        }
        if let Some(p) = self.page() {
            write!(f, ", page {p}")?;
            if let Some(g) = v.generation() {
                write!(f, " gen {}", g.0)?;
            }
        }
        if let Some(i) = v.block_index() {
            write!(f, ", block {i}")?;
        }
        if let Some(o) = v.owner() {
            // A fork onto a live child names the child as the owner of the id.
            let fork = v.kind() == ViolationKind::DuplicateRequest;
            write!(f, ", {} req {}", if fork { "child" } else { "owned by" }, o.0)?;
            if let Some(t) = &self.owner_tenant {
                write!(f, " (tenant {t:?})")?;
            }
            if fork {
                f.write_str(" is live")?;
            }
        }
        if let Some((a, b)) = self.slots() {
            write!(f, ", slots {a}..{b}")?;
            if a > b {
                f.write_str(" (reversed)")?;
            }
        }
        if let Some(k) = &self.prefix {
            write!(f, ", prefix {k:?}")?;
        }
        if let (Some((prompt, max_new)), Some((_, limit))) = (self.overflow, v.amounts()) {
            let (prompt, max_new, limit) = (grouped(prompt), grouped(max_new), grouped(limit));
            return write!(f, ", {prompt} + {max_new} tokens (more than 2^64) vs max context {limit}");
        }
        if let Some((found, limit)) = v.amounts() {
            let (found, limit) = (grouped(found), grouped(limit));
            match v.kind() {
                ViolationKind::ExceedsMaxContext => write!(f, ", {found} tokens vs max context {limit}"),
                ViolationKind::ExceedsPool => write!(f, ", {found} pages needed vs {limit} the pool can give"),
                ViolationKind::PoolTooSmall => {
                    write!(f, ", the pool holds {found} tokens but one max-context request needs {limit}")
                }
                ViolationKind::TokenCountMismatch => write!(f, ", {found} tokens arrived vs {limit} expected"),
                ViolationKind::EvictInUse => write!(f, ", still held by {found} request(s)"),
                ViolationKind::BlockTableTooShort => write!(f, ", {found} tokens vs {limit} the block table covers"),
                ViolationKind::TokenRangeReversed => write!(f, ", tokens {found}..{limit} (start after end)"),
                _ => write!(f, ", found {found} vs limit {limit}"),
            }?;
        }
        Ok(())
    }
}

impl Serialize for ReplayViolation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = &self.violation;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("line", &self.line)?;
        m.serialize_entry("ev", self.ev.as_str())?;
        m.serialize_entry("kind", v.kind().as_str())?;
        m.serialize_entry("req", &self.request())?;
        if let Some(t) = &self.tenant {
            m.serialize_entry("tenant", &**t)?;
        }
        m.serialize_entry("page", &self.page())?;
        if let Some(g) = v.generation() {
            m.serialize_entry("generation", &g.0)?;
        }
        if let Some(i) = v.block_index() {
            m.serialize_entry("block", &i)?;
        }
        m.serialize_entry("owner", &self.owner())?;
        if let Some(t) = &self.owner_tenant {
            m.serialize_entry("owner_tenant", &**t)?;
        }
        m.serialize_entry("slots", &self.slots().map(|(a, b)| [a, b]))?;
        if let Some(k) = &self.prefix {
            m.serialize_entry("prefix", &**k)?;
        }
        if let Some((prompt, max_new)) = self.overflow {
            // The true sum, which no u64 holds.
            let sum = u128::from(prompt) + u128::from(max_new);
            m.serialize_entry("found", &sum)?;
            m.serialize_entry("limit", &v.amounts().map(|a| a.1))?;
        } else if let Some((found, limit)) = v.amounts() {
            m.serialize_entry("found", &found)?;
            m.serialize_entry("limit", &limit)?;
        }
        m.serialize_entry("message", &self.to_string())?;
        m.end()
    }
}
