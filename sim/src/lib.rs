//! The incident model: a deterministic prefill/decode deployment whose prefill node silently
//! replaces a prompt too long for its pool with a one-token dummy, replayed without kvguard
//! ([`Mode::Unguarded`]) and through any subset of its four [`Layer`]s ([`Mode::Guarded`]).
//!
//! [`Simulation`] is the replay behind the root's `examples/incident.rs`; [`disagg`] runs the two
//! nodes as processes on loopback TCP (the `kvguard-disagg` binary).
//!
//! ```
//! use kvguard_sim::{Layer, Layers, Mode, SimConfig, Simulation};
//! let sim = Simulation::new(SimConfig { requests: 12, long_per_mille: 250, ..SimConfig::default() })?;
//! let unguarded = sim.run(Mode::Unguarded)?;
//! let table_only = sim.run(Mode::Guarded(Layers::only(Layer::Table)))?;
//! assert_eq!(table_only.leaks(), 0);
//! assert_eq!(unguarded.over_long(), table_only.rejected());
//! # Ok::<(), kvguard_sim::SimError>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod disagg;
mod engine;
pub mod kv;
mod printout;
pub mod rng;
mod tally;
pub mod workload;

pub use engine::DUMMY_TOKEN;
pub use printout::{comparison_table, result_line};
pub use tally::{Leak, Outcome, RequestOutcome, RunTally, StartupAudit};
pub use workload::RequestSpec;

use kvguard::{Error, PoolConfig};
use std::fmt;
use std::str::FromStr;

/// The replay's deployment and workload. The default is the incident at about its size: 2,000
/// requests from 8 tenants, 7.8% of them longer than the prefill pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// PRNG seed: the same seed gives the same run.
    pub seed: u64,
    /// Requests sent.
    pub requests: u32,
    /// Tenants sending them.
    pub tenants: u32,
    /// Requests per thousand longer than the prefill pool (up to the max context).
    pub long_per_mille: u32,
    /// The longest ordinary prompt.
    pub max_short_prompt: u32,
    /// New tokens each request may generate.
    pub max_new_tokens: u32,
    /// Token slots per page, both nodes.
    pub page_size: u32,
    /// Pages in the prefill pool (10,645 x 64 = 681,280 tokens).
    pub prefill_pages: u32,
    /// Pages in the decode pool.
    pub decode_pages: u32,
    /// The model's max context (1,048,576).
    pub max_context: u64,
    /// Requests decoding at once (holding decode pages).
    pub decode_batch: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 1,
            requests: 2_000,
            tenants: 8,
            long_per_mille: 78,
            max_short_prompt: 16_384,
            max_new_tokens: 256,
            page_size: 64,
            prefill_pages: 10_645,
            decode_pages: 20_480,
            max_context: 1_048_576,
            decode_batch: 8,
        }
    }
}

impl SimConfig {
    /// The prefill pool's configuration, as the incident deployed it.
    pub fn prefill_pool(&self) -> PoolConfig {
        PoolConfig::new(self.prefill_pages, self.page_size, self.max_context)
    }
    /// The decode pool's configuration.
    pub fn decode_pool(&self) -> PoolConfig {
        PoolConfig::new(self.decode_pages, self.page_size, self.max_context)
    }
}

/// Why the replay could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A configuration the replay does not model.
    #[error("invalid replay config: {0}")]
    Config(String),
    /// kvguard refused something that is not a verdict on a request (a pool config, a full pool).
    #[error(transparent)]
    Kvguard(#[from] Error),
    /// The decode pool cannot hold one request's prompt.
    #[error("decode pool of {pages} pages cannot hold a request needing {pages_needed}")]
    DecodePoolTooSmall {
        /// Pages the request needs.
        pages_needed: u64,
        /// Pages in the decode pool.
        pages: u32,
    },
    /// The sender could not build a manifest (a bug in the replay).
    #[error("manifest: {0}")]
    Build(#[from] kvguard::transfer::BuildError),
}

/// One of kvguard's layers of defence, as the replay switches them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Layer {
    /// The prefill node's table refuses a request its pool can never hold, before the engine can
    /// substitute anything.
    Admission,
    /// The decode node's table verifies attention's read: slots the transfer never wrote are
    /// refused (`unwritten_slots`).
    Table,
    /// The decode node checks the transfer manifest: token count, prompt digest, page CRCs.
    Manifest,
    /// The device canary: every slot stamped on write with request, page incarnation and slot,
    /// checked by the read.
    Canary,
}

impl Layer {
    /// Every layer, in the order they act.
    pub const ALL: [Layer; 4] = [Layer::Admission, Layer::Table, Layer::Manifest, Layer::Canary];

    /// The layer's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Layer::Admission => "admission",
            Layer::Table => "table",
            Layer::Manifest => "manifest",
            Layer::Canary => "canary",
        }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layer {
    type Err = String;
    fn from_str(s: &str) -> Result<Layer, String> {
        Layer::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| format!("unknown layer {s:?}; one of admission, table, manifest, canary"))
    }
}

/// Which layers a guarded run has on.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Layers {
    /// [`Layer::Admission`].
    pub admission: bool,
    /// [`Layer::Table`].
    pub table: bool,
    /// [`Layer::Manifest`].
    pub manifest: bool,
    /// [`Layer::Canary`].
    pub canary: bool,
}

impl Layers {
    /// Every layer on.
    pub const ALL: Layers = Layers { admission: true, table: true, manifest: true, canary: true };
    /// Every layer off (kvguard only bookkeeps).
    pub const NONE: Layers = Layers { admission: false, table: false, manifest: false, canary: false };

    /// Just `layer`.
    pub fn only(layer: Layer) -> Layers {
        Layers::NONE.with(layer, true)
    }

    /// These layers with `layer` switched on or off.
    pub fn with(mut self, layer: Layer, on: bool) -> Layers {
        *match layer {
            Layer::Admission => &mut self.admission,
            Layer::Table => &mut self.table,
            Layer::Manifest => &mut self.manifest,
            Layer::Canary => &mut self.canary,
        } = on;
        self
    }

    /// Whether `layer` is on.
    pub fn has(self, layer: Layer) -> bool {
        match layer {
            Layer::Admission => self.admission,
            Layer::Table => self.table,
            Layer::Manifest => self.manifest,
            Layer::Canary => self.canary,
        }
    }
}

impl fmt::Display for Layers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on: Vec<&str> = Layer::ALL.into_iter().filter(|&l| self.has(l)).map(Layer::name).collect();
        match on.len() {
            4 => f.write_str("guarded"),
            0 => f.write_str("guarded, no layer"),
            1 => write!(f, "{} only", on[0]),
            _ => write!(f, "guarded: {}", on.join("+")),
        }
    }
}

/// How a run treats the workload.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Mode {
    /// The engine as the incident ran it: no kvguard.
    Unguarded,
    /// Through kvguard with these layers.
    Guarded(Layers),
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Unguarded => f.write_str("unguarded"),
            Mode::Guarded(l) => l.fmt(f),
        }
    }
}

/// A replay: its configuration and workload, run in as many modes as asked.
#[derive(Clone, Debug)]
pub struct Simulation {
    config: SimConfig,
    workload: Vec<RequestSpec>,
}

impl Simulation {
    /// Generates the workload for `config`.
    pub fn new(config: SimConfig) -> Result<Simulation, SimError> {
        config.prefill_pool().validate().map_err(Error::from)?;
        config.decode_pool().validate().map_err(Error::from)?;
        if config.max_context > u64::from(u32::MAX) {
            return Err(SimError::Config(format!("max context {} beyond u32 tokens", config.max_context)));
        }
        if config.tenants == 0 || config.tenants > 255 {
            return Err(SimError::Config(format!("{} tenants; 1..=255 supported", config.tenants)));
        }
        if config.long_per_mille > 1000 {
            return Err(SimError::Config(format!("long_per_mille {} above 1000", config.long_per_mille)));
        }
        if config.max_short_prompt == 0 {
            return Err(SimError::Config("max_short_prompt is 0".into()));
        }
        let workload = workload::generate(&config);
        Ok(Simulation { config, workload })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The requests, in arrival order.
    pub fn workload(&self) -> &[RequestSpec] {
        &self.workload
    }

    /// The start-up audit of both pools (layer 1's first half).
    pub fn audit(&self) -> StartupAudit {
        StartupAudit { prefill: self.config.prefill_pool().audit(), decode: self.config.decode_pool().audit() }
    }

    /// Runs the whole workload in `mode`.
    pub fn run(&self, mode: Mode) -> Result<RunTally, SimError> {
        engine::run(&self.config, &self.workload, mode)
    }

    /// Runs every mode of `modes`, in parallel where the machine has cores; the tallies come in
    /// the order of `modes`.
    pub fn run_all(&self, modes: &[Mode]) -> Result<Vec<RunTally>, SimError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(modes.len()).max(1);
        let chunk = modes.len().div_ceil(threads).max(1);
        let results: Vec<Result<Vec<RunTally>, SimError>> = std::thread::scope(|s| {
            let handles: Vec<_> = modes
                .chunks(chunk)
                .map(|part| s.spawn(move || part.iter().map(|&m| self.run(m)).collect::<Result<Vec<_>, _>>()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(SimError::Config("a replay thread panicked".into()))))
                .collect()
        });
        let mut out = Vec::with_capacity(modes.len());
        for r in results {
            out.extend(r?);
        }
        Ok(out)
    }

    /// The side-by-side comparison: unguarded, guarded with `layers`, and each layer alone.
    pub fn compare_modes(layers: Layers) -> Vec<Mode> {
        let mut modes = vec![Mode::Unguarded, Mode::Guarded(layers)];
        for l in Layer::ALL {
            let m = Mode::Guarded(Layers::only(l));
            if !modes.contains(&m) {
                modes.push(m);
            }
        }
        modes
    }
}
