//! Traces of an engine's ownership events, replayed offline.
//!
//! Engine authors cannot always link kvguard into their hot path on day one; they can record
//! what their scheduler did (the [`Recorder`]) and let kvguard judge it later (the [`Replayer`],
//! or `kvguard replay trace.jsonl`). The format, v1 (and v1.1, which adds `detach`, `preempt`,
//! `scrub`, `grant`, `revoke` and the end marker `end`), is one JSON object per line; it is
//! specified in `docs/trace-format.md` and summed up by [`Event`].
//!
//! Replay runs an [`OwnershipTable`](crate::OwnershipTable) in shadow mode with
//! [`Policy::Report`](crate::Policy::Report) and follows the engine: the engine's page choices
//! are claimed as given, every event that would break ownership is reported with its line, and
//! then applied as the engine applied it, so later events are judged against the truth. The
//! [`LeakSummary`] says whose KV the refused reads reached.

mod error;
mod event;
mod judge;
mod leaks;
mod names;
mod options;
mod parse;
mod record;
mod replay;
mod verdict;
mod writers;

pub use error::{Found, ReplayError, ReplayErrorKind};
pub use event::{Event, EventKind};
pub use leaks::{Leak, LeakSummary, MAX_LEAK_PAIRS};
pub use options::{MAX_LINE_BYTES, ReplayOptions};
pub use record::{Recorder, RecordingTable};
pub use replay::{ReplaySummary, Replayer};
pub use verdict::ReplayViolation;
