//! Replays the incident described in the README side by side: the leak without kvguard, none
//! with it (the model is the `kvguard-sim` workspace member).
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

use clap::Parser;
use kvguard_sim::{Layer, Layers, Mode, SimConfig, Simulation, comparison_table, result_line};
use std::process::ExitCode;
use std::time::Instant;

/// The incident replayed side by side: the leak without kvguard, none with it.
#[derive(Parser)]
#[command(name = "incident")]
struct Args {
    /// PRNG seed.
    #[arg(long, default_value_t = SimConfig::default().seed)]
    seed: u64,
    /// Multiply the default 2,000 requests by F.
    #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = positive_scale)]
    scale: f64,
    /// Exact request count (overrides --scale).
    #[arg(long, value_name = "N")]
    requests: Option<u32>,
    /// Tenants sending requests.
    #[arg(long, value_name = "N", default_value_t = SimConfig::default().tenants)]
    tenants: u32,
    /// Switch a layer off in the guarded run: admission, table, manifest, canary (repeatable).
    #[arg(long, value_name = "LAYER")]
    without: Vec<Layer>,
    /// Skip the each-layer-alone runs.
    #[arg(long)]
    no_matrix: bool,
    /// Print the first violations each guarded run logged.
    #[arg(long)]
    verbose: bool,
}

fn positive_scale(s: &str) -> Result<f64, String> {
    let scale: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if scale.is_finite() && scale > 0.0 { Ok(scale) } else { Err(format!("{scale} must be positive")) }
}

impl Args {
    fn config(&self) -> SimConfig {
        let defaults = SimConfig::default();
        let requests = match self.requests {
            Some(n) => n,
            None => ((f64::from(defaults.requests) * self.scale).round() as u32).max(1),
        };
        SimConfig { seed: self.seed, requests, tenants: self.tenants, ..defaults }
    }

    fn layers(&self) -> Layers {
        self.without.iter().fold(Layers::ALL, |layers, &l| layers.with(l, false))
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let started = Instant::now();
    let sim = match Simulation::new(args.config()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let modes = if args.no_matrix {
        vec![Mode::Unguarded, Mode::Guarded(args.layers())]
    } else {
        Simulation::compare_modes(args.layers())
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
