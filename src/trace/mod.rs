//! Traces of an engine's ownership events, replayed offline.
//!
//! Engine authors cannot always link kvguard into their hot path on day one; they can record
//! what their scheduler did (the [`Recorder`]) and let kvguard judge it later (the [`Replayer`],
//! or `kvguard replay trace.jsonl`). The format, v1, is one JSON object per line; it is
//! specified in `docs/trace-format.md` and summed up by [`Event`].
//!
//! Replay runs an [`OwnershipTable`](crate::OwnershipTable) in shadow mode with
//! [`Policy::Report`](crate::Policy::Report): the engine's page choices are claimed as given, and
//! every event that would break ownership is reported with its line and changes nothing.

mod error;
mod event;
mod names;
mod parse;
mod record;
mod replay;
mod verdict;

pub use error::{Found, ReplayError, ReplayErrorKind};
pub use event::{Event, EventKind};
pub use record::{Recorder, RecordingTable};
pub use replay::{ReplayOptions, ReplaySummary, Replayer};
pub use verdict::ReplayViolation;
