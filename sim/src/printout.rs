//! The incident example's printout: the side-by-side table of runs and the machine-readable
//! `RESULT` line.

use crate::{Outcome, RunTally, SimConfig, StartupAudit};
use kvguard::ViolationKind;
use kvguard::ids::grouped;
use std::fmt::Write as _;

/// The side-by-side table of `runs` (the first is usually unguarded) as the incident example prints
/// it, after the start-up audit and followed by one example line per run.
pub fn comparison_table(config: &SimConfig, audit: &StartupAudit, runs: &[RunTally]) -> String {
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
    let num = |f: &dyn Fn(&RunTally) -> u64| runs.iter().map(|r| grouped(f(r))).collect::<Vec<_>>();
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
fn example_line(run: &RunTally) -> Option<String> {
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
pub fn result_line(unguarded: &RunTally, guarded: &[&RunTally], main: &RunTally) -> String {
    format!(
        "RESULT unguarded_leaks={} guarded_leaks={} rejected={} violations={}",
        unguarded.leaks(),
        guarded.iter().map(|r| r.leaks()).sum::<u64>(),
        main.rejected(),
        main.violation_total()
    )
}
