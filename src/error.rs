//! The crate's error type.

use crate::config::ConfigError;
use crate::ids::{PageRef, grouped};
use crate::violation::{Violation, ViolationKind};

/// Why a kvguard operation was refused.
///
/// Ownership breaks are [`Error::Violation`]; the rest are a bad configuration, an exhausted pool or
/// a misuse of the scrub protocol. Every public operation that can fail returns this.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pool configuration was refused.
    #[error("invalid pool config: {0}")]
    Config(#[from] ConfigError),
    /// The operation would break page ownership.
    #[error("{0}")]
    Violation(#[from] Violation),
    /// Not enough free pages right now (the engine should wait, preempt or evict).
    #[error("pool exhausted: {} pages requested, {} free", grouped(*requested), grouped(*free))]
    OutOfPages {
        /// Pages asked for.
        requested: u64,
        /// Pages free at the time.
        free: u64,
    },
    /// A scrub confirmation for a page that is not awaiting one in that incarnation.
    #[error("{0} is not awaiting a scrub")]
    NotAwaitingScrub(PageRef),
    /// A scrub confirmation for a page a transfer still lands in: the scrub may predate the
    /// bytes, so it does not count; scrub again once the transfer's ticket has ended.
    #[error("{0} still receives a transfer: scrub it again after the transfer ends")]
    ScrubInFlight(PageRef),
    /// The table's metadata could not be allocated.
    #[error("could not allocate page tags for {} pages", grouped(u64::from(*pages)))]
    OutOfMemory {
        /// Pages in the pool.
        pages: u32,
    },
}

impl Error {
    /// The violation, if this error is one.
    pub fn violation(&self) -> Option<&Violation> {
        match self {
            Error::Violation(v) => Some(v),
            _ => None,
        }
    }

    /// The violation's kind, if this error is one.
    pub fn violation_kind(&self) -> Option<ViolationKind> {
        self.violation().map(Violation::kind)
    }
}
