//! The guard every entry point runs in: a panic is caught there and never crosses into C, and a
//! failure becomes a status and the thread's last error, which the `kvg_last_*` calls read.

use crate::raw;
use crate::status::{Failure, core_status, kvg_status};
use crate::types::kvg_violation_info;
use kvguard::{Error, Violation};
use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The thread's last failure: its status, its one-line message, its violations (with the step
/// row each came from, for step calls).
#[derive(Default)]
struct LastError {
    status: Option<kvg_status>,
    message: CString,
    violations: Vec<(Option<usize>, Violation)>,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError::default());
}

fn message(text: String) -> CString {
    // A message never holds a NUL; if one did, it is cut there rather than lost.
    CString::new(text).unwrap_or_else(|e| {
        let cut = e.nul_position();
        let mut bytes = e.into_vec();
        bytes.truncate(cut);
        CString::new(bytes).unwrap_or_default()
    })
}

fn record(failure: Failure) -> kvg_status {
    let (status, text, violations) = match failure {
        Failure::Core(e) => {
            let status = core_status(&e);
            let text = e.to_string();
            let violations = match e {
                Error::Violation(v) => vec![(None, v)],
                _ => Vec::new(),
            };
            (status, text, violations)
        }
        Failure::Step { refused, rows } => {
            let text = match refused.first() {
                Some((row, v)) => format!("{} of {rows} rows refused; first, row {row}: {v}", refused.len()),
                None => format!("0 of {rows} rows refused"),
            };
            let violations = refused.into_iter().map(|(row, v)| (Some(row), v)).collect();
            (kvg_status::Violation, text, violations)
        }
        Failure::Refusals { text, refused } => {
            (kvg_status::Violation, text, refused.into_iter().map(|(i, v)| (Some(i), v)).collect())
        }
        Failure::Status(status, text) => (status, text, Vec::new()),
        Failure::Refused { message, violation } => {
            (kvg_status::Violation, format!("{}: {message}", violation.kind().as_str()), vec![(None, violation)])
        }
    };
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        last.status = Some(status);
        last.message = message(text);
        last.violations = violations;
    });
    status
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    format!("kvguard panicked (a bug; the table is refused from now on): {what}")
}

/// Runs one entry point: clears the thread's last error, runs `body`, turns its failure (or its
/// panic) into a status and the thread's last error. `on_panic` runs after a caught panic (the
/// table marks itself poisoned there).
pub(crate) fn guard(on_panic: impl FnOnce(), body: impl FnOnce() -> Result<(), Failure>) -> kvg_status {
    LAST.with(|last| {
        if let Ok(mut last) = last.try_borrow_mut()
            && last.status.is_some()
        {
            *last = LastError::default();
        }
    });
    guard_release(on_panic, body)
}

/// [`guard`] for a call that frees a handle (`kvg_table_free`, `kvg_manifest_free`,
/// `kvg_import_abort`): the thread's last error is replaced only when the free fails, so a
/// caller can free what failed before reading why.
pub(crate) fn guard_release(on_panic: impl FnOnce(), body: impl FnOnce() -> Result<(), Failure>) -> kvg_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => kvg_status::Ok,
        Ok(Err(failure)) => catch_unwind(AssertUnwindSafe(|| record(failure))).unwrap_or(kvg_status::Panic),
        Err(payload) => {
            on_panic();
            let text = panic_text(&*payload);
            catch_unwind(AssertUnwindSafe(|| record(Failure::Status(kvg_status::Panic, text))))
                .unwrap_or(kvg_status::Panic)
        }
    }
}

/// [`guard`] for a call that touches no table.
pub(crate) fn guard_free(body: impl FnOnce() -> Result<(), Failure>) -> kvg_status {
    guard(|| {}, body)
}

/// The thread's last error message: one line, NUL-terminated, `""` when the thread's last kvguard
/// call succeeded. Valid until the thread's next kvguard call; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_last_error_message() -> *const c_char {
    catch_unwind(|| LAST.with(|last| last.borrow().message.as_ptr())).unwrap_or(c"kvguard panicked".as_ptr())
}

/// The status of the thread's last kvguard call that returned one (`KVG_STATUS_OK` after a
/// success).
#[unsafe(no_mangle)]
pub extern "C" fn kvg_last_status() -> kvg_status {
    catch_unwind(|| LAST.with(|last| last.borrow().status.unwrap_or(kvg_status::Ok))).unwrap_or(kvg_status::Panic)
}

/// How many violations the thread's last failed call left: 1 for a refused operation, one per
/// refused row for a step call, 0 otherwise.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_last_violation_count() -> usize {
    catch_unwind(|| LAST.with(|last| last.borrow().violations.len())).unwrap_or(0)
}

/// Copies violation `index` (`0..kvg_last_violation_count()`) of the thread's last failed call
/// into `*out` (whose `struct_size` the caller sets). Reading it does not clear it.
///
/// Returns `KVG_STATUS_INVALID_ARGUMENT` when there is no such violation.
///
/// # Safety
/// `out` is NULL or points to a writable `kvg_violation_info` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_last_violation(index: usize, out: *mut kvg_violation_info) -> kvg_status {
    // Read before `guard` clears the thread's last error; a failure here replaces it.
    let found = catch_unwind(|| {
        LAST.with(|last| {
            last.borrow().violations.get(index).map(|(row, v)| kvg_violation_info::from_violation(v, *row))
        })
    })
    .unwrap_or(None);
    let count = kvg_last_violation_count();
    match found {
        // The copy goes out without `guard`, so the thread's last error stays readable.
        Some(info) => match catch_unwind(AssertUnwindSafe(|| raw::write_sized(out, info, "out"))) {
            Ok(Ok(())) => kvg_status::Ok,
            Ok(Err(failure)) => guard_free(|| Err(failure)),
            Err(_) => kvg_status::Panic,
        },
        None => guard_free(|| Err(Failure::invalid(format!("no violation {index}: the last call left {count}")))),
    }
}
