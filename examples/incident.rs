//! The autumn-2026 incident, replayed side by side: the leak without kvguard, none with it.
//!
//! ```text
//! cargo run --release --example incident
//! cargo run --release --example incident -- --seed 7 --scale 0.5 --without admission --without manifest
//! ```
//!
//! Prints the start-up audit, a table (requests, rejections by error, leaked responses,
//! violations by kind) for the unguarded engine, kvguard with the chosen layers, and each layer
//! alone, then one line `RESULT unguarded_leaks=<n> guarded_leaks=<n> rejected=<n> violations=<n>`.
//! Exits 1 if any guarded run leaked, 2 on bad arguments.

use kvguard_sim::{Layer, Layers, Mode, SimConfig, Simulation, comparison_table, result_line};
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "\
usage: incident [--seed N] [--scale F] [--requests N] [--tenants N] [--without LAYER]... [--no-matrix] [--verbose]

  --seed N          PRNG seed (default 1)
  --scale F         multiply the default 2,000 requests by F (default 1.0)
  --requests N      exact request count (overrides --scale)
  --tenants N       tenants sending requests (default 8)
  --without LAYER   switch a layer off in the guarded run: admission, table, manifest, canary (repeatable)
  --no-matrix       skip the each-layer-alone runs
  --verbose         print the first violations each guarded run logged";

struct Args {
    config: SimConfig,
    layers: Layers,
    matrix: bool,
    verbose: bool,
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut config = SimConfig::default();
    let (mut layers, mut matrix, mut verbose) = (Layers::ALL, true, false);
    let (mut scale, mut requests) = (1.0f64, None);
    while let Some(flag) = argv.next() {
        let mut value = |name: &str| argv.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--seed" => config.seed = value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--scale" => scale = value("--scale")?.parse().map_err(|e| format!("--scale: {e}"))?,
            "--requests" => requests = Some(value("--requests")?.parse().map_err(|e| format!("--requests: {e}"))?),
            "--tenants" => config.tenants = value("--tenants")?.parse().map_err(|e| format!("--tenants: {e}"))?,
            "--without" => layers = layers.with(value("--without")?.parse::<Layer>()?, false),
            "--no-matrix" => matrix = false,
            "--verbose" => verbose = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !(scale.is_finite() && scale > 0.0) {
        return Err(format!("--scale {scale} must be positive"));
    }
    config.requests = match requests {
        Some(n) => n,
        None => ((f64::from(config.requests) * scale).round() as u32).max(1),
    };
    Ok(Some(Args { config, layers, matrix, verbose }))
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let sim = match Simulation::new(args.config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let modes = if args.matrix {
        Simulation::compare_modes(args.layers)
    } else {
        vec![Mode::Unguarded, Mode::Guarded(args.layers)]
    };
    let runs = match sim.run_all(&modes) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    print!("{}", comparison_table(sim.config(), &sim.audit(), &runs));
    if args.verbose {
        for run in runs.iter().skip(1) {
            println!("\nfirst violations, {}:", run.mode);
            for line in &run.sample_violations {
                println!("  {line}");
            }
        }
    }
    let guarded: Vec<_> = runs.iter().filter(|r| r.mode != Mode::Unguarded).collect();
    println!("\nreplayed {} runs in {:.2} s", runs.len(), started.elapsed().as_secs_f64());
    println!("{}", result_line(&runs[0], &guarded, &runs[1]));
    let leaked: Vec<String> =
        guarded.iter().filter(|r| r.leaks() > 0).map(|r| format!("{} leaked {}", r.mode, r.leaks())).collect();
    if leaked.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("GUARDED RUN LEAKED: {}", leaked.join(", "));
        ExitCode::from(1)
    }
}
