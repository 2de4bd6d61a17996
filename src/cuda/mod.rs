//! Device-side checks through CUDA: the tag mirror, block-table verification, canaries, CRC32 and
//! scrubbing on the engine's GPU (feature `cuda`).
//!
//! The host [`OwnershipTable`](crate::OwnershipTable) proves who *should* own a page; the GPU is
//! where pages are actually read. [`DeviceGuard`] keeps a device copy of every page's tag
//! (updated incrementally from [`take_changed_pages`](crate::OwnershipTable::take_changed_pages)),
//! verifies a step's block tables before attention without any host synchronisation, and records
//! what the kernels found in the host table's counters and log.
//!
//! The files, each importing only those below it:
//!
//! | file | holds | `unsafe` |
//! |---|---|---|
//! | `guard.rs` | [`DeviceGuard`], [`DeviceOptions`], [`Drained`]: the safe host API | denied |
//! | `device.rs` | the CUDA context, stream, kernels, kvguard's buffers and every launch; [`UncheckedAttention`] | allowed |
//! | `step.rs` | the launches' arguments ([`BlockTableStep`], [`PagedKvStep`], [`KvStore`], [`DecodeAttention`], [`PageRegion`], ...) and their checks | denied |
//! | `lent.rs` | what the engine lends: [`Borrowed`] memory and an [`EngineStream`] | allowed (two `unsafe fn` constructors) |
//! | [`source`] | the embedded kernel sources, their compilation (cached), the check of a prebuilt CUBIN ([`DeviceOptions::cubin`]: no NVRTC at run time) | denied |
//! | `nvrtc.rs` | the NVRTC calls cudarc's safe API does not cover | allowed |
//! | [`layout`] | the `#[repr(C)]` mirrors of `kernels/kvguard.cuh` and the [`canary`]: plain safe Rust, tested without a GPU | denied |
//! | `error.rs` | [`DeviceError`] | denied |
//!
//! `unsafe_code` is denied for the whole module and allowed only for `device.rs`, `lent.rs` and
//! `nvrtc.rs`, where every `unsafe` block has its `SAFETY` argument and every `unsafe fn` its
//! `# Safety` contract. What an engine must promise, it promises when it builds a [`Borrowed`]
//! (device memory of that length, live until the launches complete), an [`EngineStream`] (a
//! stream of the guard's context) or an [`UncheckedAttention`] (pages in range, for the
//! unchecked baseline); the guard takes those values safely.
//!
//! Without the `cuda` feature only [`layout`] and [`canary`] are here: the byte layout and the
//! canary are what an engine needs to fuse the checks into its own kernels, with or without cudarc.
//!
//! Without a driver, a device or NVRTC (when no prebuilt CUBIN is given), [`DeviceGuard::new`]
//! returns a [`DeviceError`]; it never panics. See `docs/cuda.md` for fusing the checks into an
//! engine's own kernels.
#![deny(unsafe_code)]
// Without `cuda` the guard and its types are absent, and so are the links to them above.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod device;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
mod guard;
pub mod layout;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod lent;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod nvrtc;
#[cfg(feature = "cuda")]
pub mod source;
#[cfg(feature = "cuda")]
mod step;

#[cfg(feature = "cuda")]
pub use device::UncheckedAttention;
#[cfg(feature = "cuda")]
pub use error::DeviceError;
#[cfg(feature = "cuda")]
pub use guard::{DeviceGuard, DeviceOptions, Drained, POISON};
pub use layout::{DeviceKind, DeviceReader, DeviceTag, DeviceViolation, RingHeader, canary};
#[cfg(feature = "cuda")]
pub use lent::{Borrowed, EngineStream};
#[cfg(feature = "cuda")]
pub use step::{
    AttentionCheck, AttentionShape, BlockTableStep, DecodeAttention, KvElement, KvStore, PageRegion, PagedKvStep,
};

#[cfg(feature = "cuda")]
/// Whether the CUDA driver library can be loaded, without loading it for good or panicking.
pub fn driver_available() -> bool {
    device::driver_library_present()
}
