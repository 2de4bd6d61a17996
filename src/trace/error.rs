//! Why a trace could not be replayed: the input is unusable (as opposed to a violation, which is a
//! verdict on a usable trace).

use crate::config::ConfigError;
use std::fmt;
use std::io;

/// A trace the replayer cannot use: the 1-based line, and why.
///
/// Opaque and cheap to move; [`kind`](Self::kind) says what went wrong and
/// [`Display`](fmt::Display) says it in one line (`line 7: admit: missing field "tenant"`).
#[derive(Debug)]
pub struct ReplayError {
    line: u64,
    kind: Box<ReplayErrorKind>,
}

impl ReplayError {
    pub(crate) fn new(line: u64, kind: ReplayErrorKind) -> ReplayError {
        ReplayError { line, kind: Box::new(kind) }
    }

    /// The 1-based line of the trace (for [`ReplayErrorKind::Io`]: the line being read).
    pub fn line(&self) -> u64 {
        self.line
    }

    /// What was wrong with it.
    pub fn kind(&self) -> &ReplayErrorKind {
        &self.kind
    }
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.kind)
    }
}

impl std::error::Error for ReplayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.kind)
    }
}

/// What made a line unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayErrorKind {
    /// The trace could not be read.
    #[error("cannot read the trace: {0}")]
    Io(#[source] io::Error),
    /// A violation could not be written out (the sink given to [`Replayer::replay`](super::Replayer::replay) failed).
    #[error("cannot write the verdict: {0}")]
    Output(#[source] io::Error),
    /// The line is longer than [`ReplayOptions::max_line_bytes`](super::ReplayOptions).
    #[error("line longer than {max} bytes")]
    LineTooLong {
        /// The limit.
        max: usize,
    },
    /// Not one JSON object: a syntax error, invalid UTF-8, nesting too deep, trailing characters,
    /// or another JSON type.
    #[error("not a JSON object: {0}")]
    Json(#[source] serde_json::Error),
    /// The object has no `ev` field.
    #[error("missing field \"ev\"")]
    MissingEvent,
    /// `ev` names no v1 event.
    #[error("unknown event {0:?}")]
    UnknownEvent(String),
    /// A field the event requires is absent.
    #[error("{ev}: missing field {field:?}")]
    MissingField {
        /// The event.
        ev: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field the event uses has the wrong JSON type (or a number that is not an unsigned
    /// 64-bit integer).
    #[error("{ev}: field {field:?} must be {expected}, found {found}")]
    WrongType {
        /// The event (`"?"` for `ev` itself).
        ev: &'static str,
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What the line had.
        found: Found,
    },
    /// A field appears twice in one object.
    #[error("field {0:?} appears twice")]
    DuplicateField(&'static str),
    /// `slots` is not a pair `[a,b]` (a list of unsigned integers of another length).
    #[error("{ev}: field \"slots\" must be a pair [a,b], found {len} numbers")]
    SlotsNotPair {
        /// The event.
        ev: &'static str,
        /// How many numbers it had.
        len: u64,
    },
    /// A page list (other than a `read`'s) with more entries than the pool has pages: no valid
    /// event names a page twice.
    #[error("{ev}: field {field:?} lists {len} pages, more than the pool's {max}")]
    ListTooLong {
        /// The event.
        ev: &'static str,
        /// The field.
        field: &'static str,
        /// Entries in the list.
        len: u64,
        /// The pool's page count (or the replayer's page limit before the pool).
        max: u64,
    },
    /// A `read` whose block table is longer than a replay keeps (the pool's pages plus one
    /// max-context block table of padding) and whose `tokens` run past the entries kept.
    #[error(
        "read: field \"pages\" lists {len} pages and {tokens} tokens run past the first {max}, \
         all a replay keeps of a block table (the pool's pages plus one max-context block table)"
    )]
    ReadTooLong {
        /// Entries in the list.
        len: u64,
        /// The read's `tokens`.
        tokens: u64,
        /// Entries kept.
        max: u64,
    },
    /// An event before the `pool` event.
    #[error("{0} before the pool event (the first event must be \"pool\")")]
    BeforePool(&'static str),
    /// The trace ended without a `pool` event (empty, or only comments): nothing was judged.
    #[error("the trace has no pool event (empty, or only comments)")]
    NoPool,
    /// A second `pool` event.
    #[error("a second pool event (a trace has exactly one)")]
    SecondPool,
    /// A pool kvguard cannot track (no pages, too many, a page size out of range, ...).
    #[error("pool cannot be tracked: {0}")]
    InvalidPool(#[source] ConfigError),
    /// A pool larger than [`ReplayOptions::max_pool_pages`](super::ReplayOptions).
    #[error("pool of {pages} pages is above this replayer's limit of {max}")]
    PoolTooLarge {
        /// Pages in the trace's pool.
        pages: u64,
        /// The limit.
        max: u32,
    },
    /// The pool's state would take more memory than
    /// [`ReplayOptions::max_pool_bytes`](super::ReplayOptions) allows.
    #[error(
        "pool of {pages} pages of {page_size} slots needs {} of replay memory, above the budget of {}",
        mib(*bytes), mib(*budget)
    )]
    PoolOverBudget {
        /// Pages in the trace's pool.
        pages: u32,
        /// Slots per page.
        page_size: u32,
        /// What its state would take, in bytes.
        bytes: u64,
        /// The budget, in bytes.
        budget: u64,
    },
    /// More live requests (or published prefixes) than the replayer's cap
    /// ([`ReplayOptions::max_live_requests`](super::ReplayOptions), `max_prefixes`).
    #[error("more than {max} {what} live at once, the replay's cap")]
    TooManyLive {
        /// `"requests"` or `"prefixes"`.
        what: &'static str,
        /// The cap.
        max: usize,
    },
    /// The pool declares a format version this replayer does not read (it reads 1 and 1.1).
    #[error("trace format version {0:?} is not one this replayer reads (1, 1.1)")]
    UnsupportedVersion(String),
    /// An event after the `end` event.
    #[error("{0} after the end event (nothing may follow it)")]
    AfterEnd(&'static str),
    /// The trace declares v1.1 but ends without its `end` event: the recording was cut short,
    /// and what it lacks was never judged.
    #[error("the recording is truncated: it declares version 1.1 but its {lines} lines end without an end event")]
    Truncated {
        /// Lines read.
        lines: u64,
    },
    /// The ownership table failed for a reason that is not a violation (out of memory).
    #[error("ownership table: {0}")]
    Table(#[source] crate::Error),
}

/// Bytes in MiB (or KiB below one MiB), rounded up, for messages.
fn mib(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{} KiB", bytes.div_ceil(1 << 10))
    } else {
        format!("{} MiB", crate::ids::grouped(bytes.div_ceil(1 << 20)))
    }
}

/// The JSON type found where another was required, for [`ReplayErrorKind::WrongType`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Found {
    /// An unsigned integer.
    Uint,
    /// A negative integer.
    Negative,
    /// A float, or an integer beyond `u64`.
    NotU64,
    /// A string.
    Text,
    /// `true` or `false`.
    Bool,
    /// `null`.
    Null,
    /// A list.
    List,
    /// A list with an element that is not an unsigned integer.
    ListOfOther,
    /// An object.
    Object,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Found::Uint => "a number",
            Found::Negative => "a negative number",
            Found::NotU64 => "a number that is not an unsigned 64-bit integer",
            Found::Text => "a string",
            Found::Bool => "a boolean",
            Found::Null => "null",
            Found::List => "a list",
            Found::ListOfOther => "a list with an element that is not an unsigned integer",
            Found::Object => "an object",
        })
    }
}
