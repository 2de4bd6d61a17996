//! kvguard's integration tests, in one crate so they compile and link once.
//!
//! Each module is the specification of one area, named `area_topic`; shared code lives in
//! [`common`] and the reference model of the ownership table in [`model`] (which the `table_ops`
//! fuzz target replays too). Bug-class traces with their expected verdicts are data, in
//! `tests/zoo/`.

mod common;
mod model;

#[cfg(feature = "cli")]
mod cli_audit;
#[cfg(feature = "cli")]
mod cli_replay;
#[cfg(feature = "cuda")]
mod cuda_device;
#[cfg(feature = "cuda")]
mod cuda_host_sim;
#[cfg(feature = "cuda")]
mod cuda_host_verify;
#[cfg(feature = "cuda")]
mod cuda_nvrtc;
mod step_engine;
mod step_mirror;
mod step_slot_rows;
mod table_concurrency;
mod table_model;
mod table_spec;
mod table_step_parallel;
mod table_step_writes;
mod trace_follow;
mod trace_record;
mod trace_replay;
mod trace_zoo;
mod transfer_landing;
mod transfer_manifest;
#[cfg(feature = "nixl")]
mod transfer_nixl;
