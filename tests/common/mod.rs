//! Code shared by the integration-test crates: a crate that needs it declares `mod common;`.
//!
//! - [`skip`]: loud skips, for tests that cannot run on this machine.
//! - [`host_sim`]: the Rust side of the CPU simulator of the CUDA kernels
//!   (`kernels/host/kvguard_sim_main.cpp`), and a pool with every kind of page to check them on.
// Each test crate uses a different part of this module.
#![allow(dead_code)]

pub mod host_sim;
pub mod skip;
