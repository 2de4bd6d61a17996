//! What a replay run found: how each request ended, counted per run.

use crate::Mode;
use kvguard::{ConfigError, RequestId, TenantId, ViolationKind};
use std::collections::BTreeMap;

/// A response that attended to KV its request did not write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    /// Slots attended that another request wrote.
    pub foreign_slots: u64,
    /// Of those, slots another tenant wrote.
    pub cross_tenant_slots: u64,
    /// Distinct requests whose KV was attended to (counted per run of slots, at most 1,000).
    pub victims: u32,
    /// The first foreign request and tenant seen (their ids' low 32 bits, as the KV stores them).
    pub first_victim: (RequestId, TenantId),
}

/// How one request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A response was produced, from the KV attention read; `leak` says whether any of it was
    /// another request's.
    Served {
        /// Another request's KV in the response, if any.
        leak: Option<Leak>,
        /// Whether the KV attended to was exactly the request's own prompt.
        faithful: bool,
    },
    /// The request was refused with an error (the client sees it; nothing leaks).
    Rejected {
        /// The violation kind that refused it.
        kind: ViolationKind,
        /// The one-line message.
        message: String,
    },
}

/// One request of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutcome {
    /// The request.
    pub request: RequestId,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its prompt length.
    pub prompt_tokens: u32,
    /// Longer than the prefill pool holds.
    pub over_long: bool,
    /// What happened.
    pub outcome: Outcome,
}

/// What one run of the replay found: one mode over the whole workload, request by request, with
/// the violations kvguard counted.
#[derive(Clone, Debug)]
pub struct RunTally {
    /// The mode it ran in.
    pub mode: Mode,
    /// Every request, in arrival order.
    pub outcomes: Vec<RequestOutcome>,
    /// Prompts the prefill engine replaced with a one-token dummy.
    pub substituted: u64,
    /// Violations counted by kind, both nodes' tables together (the canary's count in decode's).
    pub violations: Vec<(ViolationKind, u64)>,
    /// The first violation lines logged, for the printout.
    pub sample_violations: Vec<String>,
}

impl RunTally {
    /// Requests in the run.
    pub fn requests(&self) -> u64 {
        self.outcomes.len() as u64
    }
    /// Requests longer than the prefill pool.
    pub fn over_long(&self) -> u64 {
        self.outcomes.iter().filter(|o| o.over_long).count() as u64
    }
    /// Responses produced.
    pub fn served(&self) -> u64 {
        self.outcomes.iter().filter(|o| matches!(o.outcome, Outcome::Served { .. })).count() as u64
    }
    /// Requests refused with an error.
    pub fn rejected(&self) -> u64 {
        self.requests() - self.served()
    }
    /// Refusals by kind.
    pub fn rejected_by_kind(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for o in &self.outcomes {
            if let Outcome::Rejected { kind, .. } = o.outcome {
                *out.entry(kind.as_str()).or_insert(0) += 1;
            }
        }
        out
    }
    /// Responses that attended to another request's KV.
    pub fn leaks(&self) -> u64 {
        self.outcomes.iter().filter(|o| matches!(o.outcome, Outcome::Served { leak: Some(_), .. })).count() as u64
    }
    /// Responses that attended to another tenant's KV.
    pub fn cross_tenant_leaks(&self) -> u64 {
        self.outcomes
            .iter()
            .filter(|o| matches!(&o.outcome, Outcome::Served { leak: Some(l), .. } if l.cross_tenant_slots > 0))
            .count() as u64
    }
    /// Served responses whose KV was not exactly their own prompt (leaked or garbage).
    pub fn unfaithful(&self) -> u64 {
        self.outcomes.iter().filter(|o| matches!(o.outcome, Outcome::Served { faithful: false, .. })).count() as u64
    }
    /// Violations counted in all.
    pub fn violation_total(&self) -> u64 {
        self.violations.iter().map(|&(_, n)| n).sum()
    }
}

/// The start-up audit of both pools, as the replay ran it.
#[derive(Clone, Debug)]
pub struct StartupAudit {
    /// The prefill pool's audit (the incident's pool fails it).
    pub prefill: Result<(), ConfigError>,
    /// The decode pool's audit.
    pub decode: Result<(), ConfigError>,
}
