//! Device-side checks through CUDA: the tag mirror, block-table verification, canaries, CRC32 and
//! scrubbing on the engine's GPU (feature `cuda`).
//!
//! The host [`OwnershipTable`](crate::OwnershipTable) proves who *should* own a page; the GPU is
//! where pages are actually read. [`DeviceGuard`] keeps a device copy of every page's tag
//! (updated incrementally from [`take_changed_pages`](crate::OwnershipTable::take_changed_pages)),
//! verifies a step's block tables before attention without any host synchronisation, and records
//! what the kernels found in the host table's counters and log.
//!
//! The files, each importing only those below it (`unsafe` allowed only where marked):
//!
//! - `guard.rs`: [`DeviceGuard`], [`DeviceOptions`], [`Drained`]: the safe host API.
//! - `device.rs` (`unsafe`): the CUDA context, kernels, kvguard's own buffers and page-locked
//!   staging, and every launch (each on the stream its caller passes), each with its `SAFETY` argument and the invariants it relies on;
//!   [`UncheckedAttention`].
//! - `step.rs`: the launches' arguments ([`BlockTableStep`], [`PagedKvStep`], [`TokenRowsStep`], [`KvStore`],
//!   [`DecodeAttention`], [`PageRegion`], ...) and the checks that what they lend is long enough.
//! - `lent.rs` (`unsafe`: two constructors): what the engine lends, [`Borrowed`] device memory
//!   and the [`EngineStream`] each call queues its work on.
//! - [`source`]: the embedded kernel sources and their NVRTC compilation (cached), and the check
//!   of a CUBIN built ahead of time ([`DeviceOptions::cubin`]: no NVRTC at run time).
//! - `nvrtc.rs` (`unsafe`): the NVRTC calls cudarc's safe API does not cover.
//! - [`layout`]: the `#[repr(C)]` mirrors of `kernels/kvguard.cuh` (tag, reader, violation
//!   record, ring header) and the [`canary`]; plain safe Rust, tested without a GPU.
//! - `error.rs`: [`DeviceError`].
//!
//! `unsafe_code` is denied for the whole module and allowed only on those three files' `mod`
//! declarations: a lint, not a promise. What an engine must vouch for it vouches for when it
//! builds a [`Borrowed`] (device memory of that length, live until the launches complete), an
//! [`EngineStream`] (a stream of the guard's context, live during the calls given it) or an [`UncheckedAttention`] (pages in
//! range, for the unchecked baseline); the guard takes those values safely.
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
    AttentionCheck, AttentionElement, AttentionShape, Bf16, BlockTableStep, DecodeAttention, FenceStep, KvElement,
    KvStore, PageRegion, PagedKvStep, SlotMappingStep, TokenRowsStep,
};

#[cfg(feature = "cuda")]
/// Whether the CUDA driver library can be loaded, without loading it for good or panicking.
pub fn driver_available() -> bool {
    device::driver_library_present()
}
