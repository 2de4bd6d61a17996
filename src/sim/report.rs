//! What a replay run found, and the side-by-side table the incident example prints.

use super::{Mode, SimConfig};
use crate::config::ConfigError;
use crate::ids::{RequestId, TenantId, grouped};
use crate::violation::ViolationKind;
use std::collections::BTreeMap;
use std::fmt::Write as _;

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

/// One run of the replay: one mode over the whole workload.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// The mode it ran in.
    pub mode: Mode,
    /// Every request, in arrival order.
    pub outcomes: Vec<RequestOutcome>,
    /// Prompts the prefill engine replaced with a one-token dummy.
    pub substituted: u64,
    /// Violations counted by kind, both nodes' tables together (the canary reports to decode's).
    pub violations: Vec<(ViolationKind, u64)>,
    /// The first violation lines logged, for the printout.
    pub sample_violations: Vec<String>,
}

impl RunReport {
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
pub struct AuditReport {
    /// The prefill pool's audit (the incident's pool fails it).
    pub prefill: Result<(), ConfigError>,
    /// The decode pool's audit.
    pub decode: Result<(), ConfigError>,
}

/// Renders the side-by-side table of `runs` (the first is usually unguarded), with the audit and
/// one example line per run.
pub fn render(config: &SimConfig, audit: &AuditReport, runs: &[RunReport]) -> String {
    let mut out = String::new();
    let prefill_tokens = u64::from(config.prefill_pages) * u64::from(config.page_size);
    let decode_tokens = u64::from(config.decode_pages) * u64::from(config.page_size);
    let _ = writeln!(
        out,
        "kvguard incident replay: seed {}, {} requests from {} tenants; model max context {} tokens",
        config.seed,
        grouped(u64::from(config.requests)),
        config.tenants,
        grouped(config.max_context)
    );
    let _ = writeln!(out, "start-up audit (layer 1):");
    match &audit.prefill {
        Ok(()) => {
            let _ = writeln!(out, "  prefill pool ({} tokens): ok", grouped(prefill_tokens));
        }
        Err(e) => {
            let _ = writeln!(out, "  prefill pool: REFUSED: {e}");
            let _ =
                writeln!(out, "    (replayed unaudited, as the incident ran it; per-request admission then refuses)");
        }
    }
    match &audit.decode {
        Ok(()) => {
            let _ = writeln!(out, "  decode pool ({} tokens): ok", grouped(decode_tokens));
        }
        Err(e) => {
            let _ = writeln!(out, "  decode pool: REFUSED: {e}");
        }
    }
    let _ = writeln!(out);

    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let num = |f: &dyn Fn(&RunReport) -> u64| runs.iter().map(|r| grouped(f(r))).collect::<Vec<_>>();
    rows.push(("requests".into(), num(&|r| r.requests())));
    rows.push((format!("over-long (> {} tokens)", grouped(prefill_tokens)), num(&|r| r.over_long())));
    rows.push(("prompts replaced by a dummy".into(), num(&|r| r.substituted)));
    rows.push(("served".into(), num(&|r| r.served())));
    rows.push(("rejected with an error".into(), num(&|r| r.rejected())));
    let mut kinds: Vec<&'static str> = runs.iter().flat_map(|r| r.rejected_by_kind().into_keys()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for k in &kinds {
        rows.push((format!("  {k}"), num(&|r| r.rejected_by_kind().get(k).copied().unwrap_or(0))));
    }
    rows.push(("LEAKED responses".into(), num(&|r| r.leaks())));
    rows.push(("  from another tenant".into(), num(&|r| r.cross_tenant_leaks())));
    rows.push(("violations".into(), num(&|r| r.violation_total())));
    let mut vkinds: Vec<ViolationKind> = runs.iter().flat_map(|r| r.violations.iter().map(|&(k, _)| k)).collect();
    vkinds.sort_by_key(|k| k.as_str());
    vkinds.dedup();
    for k in vkinds {
        rows.push((
            format!("  {}", k.as_str()),
            num(&|r| r.violations.iter().find(|&&(x, _)| x == k).map_or(0, |&(_, n)| n)),
        ));
    }

    let headers: Vec<String> = runs.iter().map(|r| r.mode.to_string()).collect();
    let label_w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0).max(8);
    let col_w: Vec<usize> = headers
        .iter()
        .enumerate()
        .map(|(i, h)| rows.iter().map(|(_, v)| v[i].len()).max().unwrap_or(0).max(h.len()))
        .collect();
    let _ = write!(out, "{:label_w$}", "");
    for (h, w) in headers.iter().zip(&col_w) {
        let _ = write!(out, "  {h:>w$}");
    }
    let _ = writeln!(out);
    for (label, values) in &rows {
        let _ = write!(out, "{label:label_w$}");
        for (v, w) in values.iter().zip(&col_w) {
            let _ = write!(out, "  {v:>w$}");
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out);
    for run in runs {
        if let Some(line) = example_line(run) {
            let _ = writeln!(out, "{:>label_w$}: {line}", run.mode.to_string());
        }
    }
    out
}

/// One line showing what happened to the first over-long request (or the first leak).
fn example_line(run: &RunReport) -> Option<String> {
    let o = run
        .outcomes
        .iter()
        .find(|o| matches!(o.outcome, Outcome::Served { leak: Some(_), .. }))
        .or_else(|| run.outcomes.iter().find(|o| o.over_long))?;
    Some(match &o.outcome {
        Outcome::Served { leak: Some(l), .. } => format!(
            "{} ({}, {} prompt tokens) answered from {} slots of other requests' KV ({} from other tenants), first {} ({})",
            o.request,
            o.tenant,
            grouped(u64::from(o.prompt_tokens)),
            grouped(l.foreign_slots),
            grouped(l.cross_tenant_slots),
            l.first_victim.0,
            l.first_victim.1
        ),
        Outcome::Served { leak: None, .. } => format!("{} served from its own KV", o.request),
        Outcome::Rejected { message, .. } => format!("{} refused: {message}", o.request),
    })
}

/// The machine-readable last line: `RESULT unguarded_leaks=<n> guarded_leaks=<n> rejected=<n>
/// violations=<n>`. Guarded leaks are summed over every guarded run; rejected and violations are
/// `main`'s (the guarded run with the layers asked for).
pub fn result_line(unguarded: &RunReport, guarded: &[&RunReport], main: &RunReport) -> String {
    format!(
        "RESULT unguarded_leaks={} guarded_leaks={} rejected={} violations={}",
        unguarded.leaks(),
        guarded.iter().map(|r| r.leaks()).sum::<u64>(),
        main.rejected(),
        main.violation_total()
    )
}
