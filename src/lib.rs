//! kvguard makes paged KV caches memory-safe across requests: every page carries its owner,
//! tenant and generation, every token slot whether its current owner wrote it, and every
//! attention read is checked against that.
//!
//! Inference engines hand fixed-size KV pages from request to request without clearing them; the
//! engine's bookkeeping is all that keeps one customer's keys and values out of another's answer.
//! kvguard is a second, independent bookkeeper that refuses the read when the two disagree.
//!
//! - [`OwnershipTable`]: the host-side table (allocator or shadow mode), read verification,
//!   prefixes, forks, policy and counters.
//! - [`PoolConfig`]: the pool's shape and the start-up audit.
//! - [`Violation`]: what was refused, in one line.
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
pub mod table;
pub mod trace;
pub mod transfer;
pub mod violation;

pub use config::{ConfigError, PoolConfig};
pub use error::Error;
pub use ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
pub use table::{
    ImportTicket, OwnershipTable, PageInfo, PageState, PoolSnapshot, Released, RequestInfo, SeqRead, StepVerdict,
};
pub use violation::{Op, Policy, Violation, ViolationCounters, ViolationKind};

/// The README's code blocks, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
