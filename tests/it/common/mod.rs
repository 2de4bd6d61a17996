//! Code shared by the integration tests.
//!
//! - [`skip`]: loud skips, for tests that cannot run on this machine.
//! - [`host_sim`]: the Rust side of the CPU simulator of the CUDA kernels
//!   (`kernels/host/kvguard_sim_main.cpp`), and a pool with every kind of page to check them on.

#[cfg(feature = "cuda")]
pub mod host_sim;
#[cfg(any(feature = "cuda", feature = "nixl"))]
pub mod skip;
