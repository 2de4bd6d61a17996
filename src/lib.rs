//! kvguard makes paged KV caches memory-safe across requests: every page carries its owner,
//! tenant and generation, every token slot whether its current owner wrote it, and every
//! attention read is checked against that.
//!
//! Inference engines hand fixed-size KV pages from request to request without clearing them; the
//! engine's bookkeeping is all that keeps one customer's keys and values out of another's answer.
//! kvguard is a second, independent bookkeeper that refuses the read when the two disagree.
//!
//! # Modules
//!
//! | module | what it holds |
//! |---|---|
//! | [`ids`] | the words: [`RequestId`], [`TenantId`], [`PageId`], [`Generation`], [`PageRef`] (one incarnation of a page), [`PrefixKey`] |
//! | [`config`] | [`PoolConfig`]: the pool's shape, and the start-up audit that refuses a pool which cannot hold one max-context request |
//! | [`table`] | [`OwnershipTable`]: every page's owner, tenant, generation and coverage; admission, allocation, writes, block-table verification, prefixes, forks, transfer pins |
//! | [`step`] | an engine's step in one call: typed event batches ([`step::Events`]), the writes its slot mapping makes ([`step::StepSlots`]), the rows attention reads, judged incrementally ([`OwnershipTable::engine_step`]) |
//! | [`violation`] | [`Violation`] and [`ViolationKind`]: what was refused, in one line; [`Policy`] (enforce or report) and the counters |
//! | [`error`] | [`Error`]: every fallible call's error type |
//! | [`transfer`] | the manifest that travels with a prefill→decode KV transfer, its wire format, and the [`Receiver`](transfer::Receiver) that fails closed; with feature `nixl`, the transport over NIXL |
//! | [`trace`] | the engine's ownership events as JSON lines: [`Recorder`](trace::Recorder) and [`Replayer`](trace::Replayer) |
//! | [`cuda`] | the device tag layout and the kernel-exact canary; with feature `cuda`, the device guard (tag mirror, verify, CRC32, scrub kernels) |
//!
//! Data flows one way: engine event → [`OwnershipTable`] (→ device mirror) → verdict. The table
//! knows nothing of CUDA, files, JSON or transports; [`cuda`], [`step`], [`trace`] and
//! [`transfer`] depend on it, never the reverse.
//!
//! # Allocator mode or shadow mode?
//!
//! One table serves both; pick by who chooses the pages.
//!
//! - **Allocator mode**: kvguard's free list is the engine's allocator. Call
//!   [`OwnershipTable::allocate`] and use the pages it returns. Choose it when you write a new
//!   engine or can swap the allocator (it is O(1) per page and the cheapest way to be checked).
//! - **Shadow mode**: the engine keeps its own allocator (vLLM's `BlockPool`, SGLang's
//!   `TokenToKVPoolAllocator`) and tells kvguard what it handed out with
//!   [`OwnershipTable::claim`]; a page that kvguard does not see as free is refused. Choose it to
//!   guard an existing engine without changing its allocation decisions, typically with
//!   [`Policy::Report`] first (count and log, refuse nothing), then [`Policy::Enforce`].
//!
//! Either way the engine records its KV writes (token slots) and verifies each step's block
//! tables before attention; a read of a page another request owns, of a stale incarnation or of a
//! slot nobody wrote for this request is a [`Violation`].
//!
//! # Features
//!
//! - `cli` (default): the `kvguard` command line (`replay`, `audit`).
//! - `cuda`: the device guard through cudarc (dynamic loading: builds without CUDA installed).
//! - `nixl`: checked prefill→decode transfers over NIXL ([`transfer::nixl`]; nixl-sys's stub API,
//!   `libnixl_capi.so` from the `nixl-cu12` wheel loaded at run time; building needs libclang).
//!
//! ```
//! use kvguard::{OwnershipTable, PoolConfig, PageId, RequestId, TenantId};
//! let table = OwnershipTable::new(PoolConfig::new(256, 16, 2048).with_reserved([PageId(0)]))?;
//! table.admit(RequestId(1), TenantId(1), 20, 12)?;
//! let pages: Vec<PageId> = table.allocate(RequestId(1), 2)?.iter().map(|r| r.page).collect();
//! table.record_write_tokens(RequestId(1), &pages, 0..20)?;
//! table.verify_read(RequestId(1), &pages, 20)?;
//! assert!(table.verify_read(RequestId(1), &pages, 21).is_err()); // slot 20 was never written
//! # Ok::<(), kvguard::Error>(())
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod cuda;
pub mod error;
pub mod ids;
mod le;
pub mod step;
pub mod table;
pub mod trace;
pub mod transfer;
pub mod violation;

pub use config::{ConfigError, PoolConfig};
pub use error::Error;
pub use ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
pub use table::{
    BlockRows, Fence, HeldBlockTable, HeldRowsError, ImportTicket, OwnershipTable, PADDING_SLOT, PageInfo, PageState,
    PoolSnapshot, Released, RequestInfo, RowCache, RowRead, RowsError, SeqClaim, SeqRead, SeqWrite, StepVerdict,
};
pub use violation::{Op, Policy, Violation, ViolationCounters, ViolationKind};

/// The README's code blocks, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
