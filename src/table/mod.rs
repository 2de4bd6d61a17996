//! The ownership table: for every page, who owns it, which incarnation it is in and which token
//! slots that incarnation wrote; every read through a block table is checked against it.
//!
//! One table serves both ways of embedding kvguard:
//! - **allocator mode**: kvguard picks the pages ([`OwnershipTable::allocate`], O(1) per page from
//!   a free list);
//! - **shadow mode**: the engine keeps its allocator and tells the table what it handed out
//!   ([`OwnershipTable::claim`]); a page that is not free is refused.
//!
//! The table is `Send + Sync`. Reads ([`check_read`](OwnershipTable::check_read),
//! [`verify_read`](OwnershipTable::verify_read), [`verify_step`](OwnershipTable::verify_step))
//! share one read lock and run in parallel; every other operation takes the write lock for its
//! own duration only. No operation calls back into the engine, so no lock is ever held across
//! engine code.
//!
//! # Pure and judged
//! One rule names every method that checks a block table:
//! - `check_*` is **pure**: it returns the verdict and records nothing — no count, no log, no
//!   quarantine, whatever the [`Policy`](crate::Policy);
//! - `verify_*` is **judged**: the same check, and a violation is counted, logged and handled by
//!   the policy (enforce: refused, its request quarantined; report: let through).
//!
//! A mutation (`admit`, `claim`, `record_*`, `release*`, `publish_prefix`, ...) is always judged,
//! and refused under either policy: a table never records what would break ownership. A caller
//! that acts on a pure verdict itself records it with
//! [`record_violation`](OwnershipTable::record_violation).
//!
//! Replay, which follows an engine that went ahead anyway, brings the table to the engine's
//! state after a refused call with the `force_*` methods (`force_admit`, `force_claim`,
//! `force_release_pages`, `force_evict_prefix`): they judge and record nothing.
//!
//! Every method that takes a block table or page list has a `_refs` form taking
//! [`PageRef`](crate::PageRef)s, which also refuses a page no longer in the incarnation named
//! ([`ViolationKind::StalePage`](crate::ViolationKind::StalePage)): `check_read`, `verify_read`,
//! `check_step`, `verify_step` (through [`SeqRead<'_, PageRef>`](SeqRead)), `record_write_tokens`,
//! `record_import`, `release_pages`, `publish_prefix`. `claim` has none: the pages it takes are
//! free, and a free page's incarnation is not the engine's to name. `begin_import` and
//! `confirm_scrubbed` take refs only.
//!
//! # Memory
//! Each page costs a 24-byte tag and an 8-byte hot word (what a read of a whole page checks, kept
//! apart so a read touches one cache line per eight pages), 8 bytes of free list (room for two
//! entries a page, reserved up front: a page claimed by id leaves a stale entry behind), up to 4
//! bytes in its owner's or prefix's page list and one bit in the map of pages changed for the
//! device mirror; each token slot costs one bit of coverage bitmap. That is at most 44 bytes per
//! page plus 1 bit per page and 1 per slot: a pool of 1,048,576 pages of 16 slots takes at most
//! 44 MiB of metadata, a 128 KiB change map and a 2 MiB bitmap.
//! Each admitted request adds a small record; each prefix one more.
//!
//! # Files
//! Each file uses only those below it: `decode`, `forced`, `import` → `ownership` → `lifecycle` → `prefix`, `verify`
//! → `violation` → `state` → `hot`, `mirror` → `info`, `step`; `info` and `step` hold the public values
//! re-exported here; `hot` holds the per-page words read verification compares; `mirror` the device
//! tag and the map of pages changed since a device mirror last took them.

mod decode;
mod forced;
mod held;
mod hot;
mod import;
mod info;
mod lifecycle;
mod mirror;
mod ownership;
mod prefix;
mod rows;
mod state;
mod step;
mod verify;
mod violation;

pub use held::{HeldBlockTable, HeldRowsError};
pub use import::{Fence, ImportTicket};
pub use info::{PageInfo, PageState, PoolSnapshot, Released, RequestInfo};
pub use mirror::DeviceTag;
pub use ownership::{OwnershipTable, VIOLATION_LOG_CAPACITY};
pub(crate) use rows::ReadStamp;
pub use rows::{BlockRows, RowCache, RowRead, RowsError};
pub use step::{PADDING_SLOT, SeqClaim, SeqRead, SeqWrite, StepVerdict};
