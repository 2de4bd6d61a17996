//! Device-side checks through CUDA: the tag mirror, block-table verification, canaries, CRC32 and
//! scrubbing on the engine's GPU (feature `cuda`).
//!
//! The host [`OwnershipTable`](crate::OwnershipTable) proves who *should* own a page; the GPU is
//! where pages are actually read. [`DeviceGuard`] keeps a device copy of every page's tag
//! (updated incrementally from [`take_changed_pages`](crate::OwnershipTable::take_changed_pages)),
//! verifies a step's block tables before attention without any host synchronisation, and reports
//! what the kernels found back into the host table's counters and log.
//!
//! - [`layout`]: the `#[repr(C)]` mirrors of `kernels/kvguard.cuh` (tag, reader, violation
//!   record, ring header) and the canary function; plain safe Rust, tested without a GPU.
//! - [`source`]: the embedded kernel sources and their NVRTC compilation (cached), and the check
//!   of a CUBIN built ahead of time ([`DeviceOptions::cubin`]: no NVRTC at run time).
//! - [`DeviceGuard`]: the safe host API. Every `unsafe` block lives in one file, `backend.rs`,
//!   with its `SAFETY` argument and the invariants it relies on; engine memory enters only as a
//!   [`Borrowed`] (device memory the engine owns, lent under a documented contract). Two
//!   `unsafe fn`s of the guard forward their contracts: adopting the engine's stream, and the
//!   unchecked reference attention.
//!
//! Without the `cuda` feature only [`layout`] and [`canary`] are here: the byte layout and the
//! canary are what an engine needs to fuse the checks into its own kernels, with or without cudarc.
//!
//! Without a driver, a device or NVRTC (when no prebuilt CUBIN is given), [`DeviceGuard::new`]
//! returns a [`DeviceError`]; it never panics. See `docs/cuda.md` for fusing the checks into an
//! engine's own kernels.
#![allow(unsafe_code)]

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod guard;
pub mod layout;
#[cfg(feature = "cuda")]
pub mod source;

#[cfg(feature = "cuda")]
pub use backend::{AttentionShape, Borrowed, KvElement, PageRegion};
#[cfg(feature = "cuda")]
pub use guard::{
    AttentionCheck, BlockTableStep, DecodeAttention, DeviceGuard, DeviceOptions, DrainReport, KvStore, POISON,
    PagedKvStep,
};
pub use layout::{DeviceKind, DeviceReader, DeviceTag, DeviceViolation, RingHeader, canary};

#[cfg(feature = "cuda")]
/// Why the device side could not be set up or a device operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The CUDA driver library (`libcuda.so`) is not installed: no NVIDIA driver here.
    #[error("the CUDA driver library (libcuda) could not be loaded: no NVIDIA driver on this machine")]
    DriverNotFound,
    /// The driver loaded but has no device of that ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: i32,
    },
    /// NVRTC (`libnvrtc.so`) could not be loaded, so the kernels cannot be compiled.
    #[error(
        "the NVRTC library (libnvrtc) could not be loaded: install the CUDA toolkit or the \
         nvidia-cuda-nvrtc-cu12 wheel and put its lib directory on LD_LIBRARY_PATH, or pass kernels \
         built ahead of time as DeviceOptions::cubin"
    )]
    NvrtcNotFound,
    /// A prebuilt CUBIN ([`DeviceOptions::cubin`]) cannot be used: not a CUDA ELF image, no
    /// code for this device's architecture, or built from other kernel sources than this
    /// kvguard's (see [`source::fingerprint_kernel`]).
    #[error("the prebuilt kvguard CUBIN cannot be used: {0}")]
    Cubin(String),
    /// NVRTC refused the kernel sources.
    #[error("kvguard kernels did not compile for {arch}: {log}")]
    Compile {
        /// The virtual architecture (`compute_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA library was found but could not be used (a missing symbol: too old a driver or
    /// toolkit for this build).
    #[error("a CUDA library could not be used: {0}")]
    Loader(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// An argument does not fit the guard's buffers or the memory it names.
    #[error("{0}")]
    Argument(String),
}

#[cfg(feature = "cuda")]
/// Whether the CUDA driver library can be loaded, without loading it for good or panicking.
pub fn driver_available() -> bool {
    backend::driver_library_present()
}

#[cfg(feature = "cuda")]
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a CUDA library panicked while loading".into())
}
