//! Status codes, and why a call failed ([`Failure`]) before it becomes one. The guard that turns
//! a failure into a status and the thread's last error is in `guard.rs`.

use kvguard::{Error, Violation};
use std::ffi::{CStr, c_char};

/// What a call did. `KVG_STATUS_OK` is 0; every other value is a failure whose message (and, for
/// `KVG_STATUS_VIOLATION`, whose violations) the same thread reads with
/// `kvg_last_error_message` and `kvg_last_violation` before its next kvguard call.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum kvg_status {
    /// Done.
    Ok = 0,
    /// The operation would break page ownership: refused (see `kvg_last_violation`). For a step
    /// call, some rows were refused and the others went through.
    Violation = 1,
    /// Not enough free pages right now: wait, preempt or evict.
    OutOfPages = 2,
    /// The pool configuration was refused (the start-up audit or a structural check).
    ConfigInvalid = 3,
    /// A scrub confirmation for a page that is not awaiting one in that incarnation.
    NotAwaitingScrub = 4,
    /// A scrub confirmation for a page a transfer still lands in: scrub it again afterwards.
    ScrubInFlight = 5,
    /// The table's metadata could not be allocated.
    OutOfMemory = 6,
    /// A required pointer was NULL.
    NullPointer = 7,
    /// A struct's `struct_size` is too small, absurdly large, or sets fields this library does
    /// not know.
    BadStructSize = 8,
    /// An argument is malformed: a misaligned pointer, a negative count, an unknown enum value,
    /// token boundaries out of order.
    InvalidArgument = 9,
    /// An output buffer is too small. Where the operation had already happened (a release, an
    /// attach), it stays done; the message says what did not fit.
    BufferTooSmall = 10,
    /// kvguard panicked (a bug): the call was abandoned and the table is refused from then on
    /// (free it).
    Panic = 11,
    /// Another error of the core, newer than this binding; the message says what.
    Other = 12,
    /// A handle that is not live: freed or ended already (a use after free, a second free, a
    /// ticket ended twice), a handle of another type, or a value kvguard never handed out. The
    /// message says which. Nothing was done.
    InvalidHandle = 13,
}

impl kvg_status {
    /// The status's name, as the C enumerator reads without its prefix (`"ok"`, `"violation"`).
    pub(crate) fn name(self) -> &'static CStr {
        match self {
            kvg_status::Ok => c"ok",
            kvg_status::Violation => c"violation",
            kvg_status::OutOfPages => c"out_of_pages",
            kvg_status::ConfigInvalid => c"config_invalid",
            kvg_status::NotAwaitingScrub => c"not_awaiting_scrub",
            kvg_status::ScrubInFlight => c"scrub_in_flight",
            kvg_status::OutOfMemory => c"out_of_memory",
            kvg_status::NullPointer => c"null_pointer",
            kvg_status::BadStructSize => c"bad_struct_size",
            kvg_status::InvalidArgument => c"invalid_argument",
            kvg_status::BufferTooSmall => c"buffer_too_small",
            kvg_status::Panic => c"panic",
            kvg_status::Other => c"other",
            kvg_status::InvalidHandle => c"invalid_handle",
        }
    }

    const ALL: [kvg_status; 14] = [
        kvg_status::Ok,
        kvg_status::Violation,
        kvg_status::OutOfPages,
        kvg_status::ConfigInvalid,
        kvg_status::NotAwaitingScrub,
        kvg_status::ScrubInFlight,
        kvg_status::OutOfMemory,
        kvg_status::NullPointer,
        kvg_status::BadStructSize,
        kvg_status::InvalidArgument,
        kvg_status::BufferTooSmall,
        kvg_status::Panic,
        kvg_status::Other,
        kvg_status::InvalidHandle,
    ];
}

/// Why a call failed, before it becomes a status and the thread's last error.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The core refused.
    Core(Error),
    /// Rows of a step were refused: `(row, violation)`, in row order, of `rows`.
    Step { refused: Vec<(usize, Violation)>, rows: usize },
    /// Things of a batch or an engine step were refused: `(index within its stage, violation)`,
    /// in stage order, described by `text`.
    Refusals { text: String, refused: Vec<(usize, Violation)> },
    /// A status of the binding's own, with its message.
    Status(kvg_status, String),
    /// Refused as `violation`, described by `message` (more precise than the violation's own
    /// line: a transfer's refusal says which check failed); the thread's message is
    /// `"<kind>: <message>"`.
    Refused { message: String, violation: Violation },
}

impl Failure {
    pub(crate) fn status(status: kvg_status, message: String) -> Failure {
        Failure::Status(status, message)
    }

    pub(crate) fn invalid(message: String) -> Failure {
        Failure::Status(kvg_status::InvalidArgument, message)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Core(e)
    }
}

/// The status of a core error.
pub(crate) fn core_status(e: &Error) -> kvg_status {
    match e {
        Error::Config(_) => kvg_status::ConfigInvalid,
        Error::Violation(_) => kvg_status::Violation,
        Error::OutOfPages { .. } => kvg_status::OutOfPages,
        Error::NotAwaitingScrub(_) => kvg_status::NotAwaitingScrub,
        Error::ScrubInFlight(_) => kvg_status::ScrubInFlight,
        Error::OutOfMemory { .. } => kvg_status::OutOfMemory,
        _ => kvg_status::Other,
    }
}

/// The status's name without its prefix (`"ok"`, `"violation"`, ...), or `"unknown"`. Static.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_status_name(status: u32) -> *const c_char {
    kvg_status::ALL.get(status as usize).map_or(c"unknown", |s| s.name()).as_ptr()
}
