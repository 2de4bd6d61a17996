//! The incident replay at small scale: the unguarded engine leaks, kvguard with all layers and
//! with each layer alone does not, and every over-long request gets a clear error.

use kvguard::ViolationKind;
use kvguard_sim::{Layer, Layers, Mode, Outcome, RunTally, SimConfig, Simulation, comparison_table, result_line};
use std::sync::OnceLock;

fn small(seed: u64) -> SimConfig {
    SimConfig { seed, requests: 48, long_per_mille: 150, max_short_prompt: 4096, ..SimConfig::default() }
}

/// Every mode of the default comparison, run once for the whole test binary.
fn runs() -> &'static (Simulation, Vec<RunTally>) {
    static RUNS: OnceLock<(Simulation, Vec<RunTally>)> = OnceLock::new();
    RUNS.get_or_init(|| {
        let sim = Simulation::new(small(3)).unwrap();
        let runs = sim.run_all(&Simulation::compare_modes(Layers::ALL)).unwrap();
        (sim, runs)
    })
}

fn run(mode: Mode) -> &'static RunTally {
    runs().1.iter().find(|r| r.mode == mode).unwrap()
}

#[test]
fn the_workload_has_over_long_requests_from_several_tenants() {
    let (sim, _) = runs();
    let prefill_tokens = 681_280;
    let long = sim.workload().iter().filter(|r| r.prompt_tokens > prefill_tokens).count();
    assert!(long >= 3, "{long} over-long requests");
    assert!(sim.workload().iter().all(|r| u64::from(r.prompt_tokens + r.max_new_tokens) <= 1_048_576));
    let mut tenants: Vec<_> = sim.workload().iter().map(|r| r.tenant).collect();
    tenants.sort_unstable();
    tenants.dedup();
    assert!(tenants.len() >= 4);
}

#[test]
fn unguarded_leaks_other_requests_kv() {
    let r = run(Mode::Unguarded);
    assert!(r.leaks() > 0, "the unguarded replay did not reproduce the leak");
    assert!(r.cross_tenant_leaks() > 0);
    assert_eq!(r.rejected(), 0, "the unguarded engine answers everything with 200");
    assert_eq!(r.substituted, r.over_long());
    // Every leak is an over-long request answered from a one-token transfer.
    for o in &r.outcomes {
        if let Outcome::Served { leak: Some(l), .. } = &o.outcome {
            assert!(o.over_long, "{} leaked without being over-long", o.request);
            assert!(l.foreign_slots > 0 && l.first_victim.0 != o.request);
        }
    }
}

#[test]
fn guarded_with_every_layer_leaks_nothing() {
    let r = run(Mode::Guarded(Layers::ALL));
    assert_eq!(r.leaks(), 0);
    assert_eq!(r.rejected(), r.over_long());
    assert_eq!(r.substituted, 0, "admission refuses before the engine can substitute");
}

#[test]
fn each_layer_alone_stops_the_leak() {
    for (layer, kind) in [
        (Layer::Admission, ViolationKind::ExceedsPool),
        (Layer::Table, ViolationKind::UnwrittenSlots),
        (Layer::Manifest, ViolationKind::TokenCountMismatch),
        (Layer::Canary, ViolationKind::CanaryMismatch),
    ] {
        let r = run(Mode::Guarded(Layers::only(layer)));
        assert_eq!(r.leaks(), 0, "{layer} alone leaked");
        assert_eq!(r.unfaithful(), 0, "{layer} alone served a response from KV that was not its prompt");
        assert_eq!(r.rejected(), r.over_long(), "{layer} alone");
        assert_eq!(r.violations, vec![(kind, r.over_long())], "{layer} alone");
    }
}

#[test]
fn every_over_long_request_gets_a_clear_error_and_every_other_is_served() {
    for run in &runs().1[1..] {
        for o in &run.outcomes {
            match (&o.outcome, o.over_long) {
                (Outcome::Rejected { kind, message }, true) => {
                    assert!(!message.is_empty() && !message.contains('\n'));
                    assert!(message.starts_with(kind.as_str()), "{message}");
                    if *kind == ViolationKind::ExceedsPool {
                        assert!(message.contains("10,645"), "{message}");
                    }
                }
                (Outcome::Served { leak: None, faithful: true }, false) => {}
                (other, long) => panic!("{}: {} (over-long {long}) ended {other:?}", run.mode, o.request),
            }
        }
    }
}

#[test]
fn without_any_layer_kvguard_only_bookkeeps_and_the_leak_returns() {
    let sim = Simulation::new(SimConfig { requests: 24, ..small(3) }).unwrap();
    let r = sim.run(Mode::Guarded(Layers::NONE)).unwrap();
    assert!(r.leaks() > 0);
}

#[test]
fn the_replay_is_deterministic_per_seed() {
    let a = Simulation::new(small(11)).unwrap();
    let b = Simulation::new(small(11)).unwrap();
    let c = Simulation::new(small(12)).unwrap();
    assert_eq!(a.workload(), b.workload());
    assert_ne!(a.workload(), c.workload());
    let (ra, rb) = (a.run(Mode::Unguarded).unwrap(), b.run(Mode::Unguarded).unwrap());
    assert_eq!(ra.outcomes, rb.outcomes);
}

#[test]
fn the_printout_shows_the_audit_the_table_and_the_result_line() {
    let (sim, runs) = runs();
    let text = comparison_table(sim.config(), &sim.audit(), runs);
    assert!(text.contains("681,280") && text.contains("1,048,576"), "{text}");
    assert!(text.contains("REFUSED: pool too small"));
    for header in ["unguarded", "guarded", "admission only", "table only", "manifest only", "canary only"] {
        assert!(text.contains(header), "missing column {header}");
    }
    assert!(text.contains("LEAKED responses"));
    let guarded: Vec<_> = runs[1..].iter().collect();
    let line = result_line(&runs[0], &guarded, &runs[1]);
    assert_eq!(
        line,
        format!(
            "RESULT unguarded_leaks={} guarded_leaks=0 rejected={} violations={}",
            runs[0].leaks(),
            runs[1].rejected(),
            runs[1].violation_total()
        )
    );
}
