//! Import tickets: a KV transfer in flight, its pages pinned until the ticket ends
//! (`kvg_begin_import`, then `kvg_import_finish` or `kvg_import_abort`).

use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::table::{kvg_table, with_table};
use crate::types::kvg_page_ref;
use kvguard::{ImportTicket, PageRef, RequestId};

/// A KV transfer in flight behind an opaque handle: while it lives, its pages are pinned (a
/// release takes them from the request, but they stay out of the free list until the ticket
/// ends, so bytes still landing never reach a next owner). Ended, and freed, by exactly one
/// `kvg_import_finish` or `kvg_import_abort`, before its table is freed. It may move between
/// threads, but not be used by two at once.
pub struct kvg_import_ticket {
    ticket: ImportTicket<'static>,
    table: *const kvg_table,
}

/// Starts a KV transfer into `refs` (`num_refs` refs of `request`'s own pages, in exactly those
/// incarnations): the pages are pinned and `*out` is the ticket (NULL on failure). Call it before
/// any byte lands. A page already receiving a transfer is `import_in_flight`; a page not the
/// request's in that incarnation is `stale_page`, `foreign_page` or `freed_page`.
///
/// # Safety
/// `table` is a live handle that outlives the ticket; `refs` holds `num_refs` entries; `out` is
/// writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_begin_import(
    table: *mut kvg_table,
    request: u64,
    refs: *const kvg_page_ref,
    num_refs: usize,
    out: *mut *mut kvg_import_ticket,
) -> kvg_status {
    with_table(table, |t| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let refs: Vec<PageRef> = raw::slice(refs, num_refs, "refs")?.iter().map(|r| r.to_core()).collect();
        let ticket = t.table.begin_import(RequestId(request), &refs)?;
        // SAFETY: the ticket borrows `t.table`, inside the `kvg_table` box behind `table`, which
        // never moves; the caller promises the table outlives the ticket (the ticket ends before
        // `kvg_table_free`), so the borrow never dangles.
        let ticket = unsafe { std::mem::transmute::<ImportTicket<'_>, ImportTicket<'static>>(ticket) };
        raw::put(out, Box::into_raw(Box::new(kvg_import_ticket { ticket, table: table.cast_const() })))
    })
}

/// Takes back the ticket's box (once).
///
/// # Safety
/// `ticket` is a non-null handle from `kvg_begin_import` not ended yet.
unsafe fn take(ticket: *mut kvg_import_ticket) -> Box<kvg_import_ticket> {
    // SAFETY: made by `Box::into_raw` in `kvg_begin_import`; the caller hands it back once.
    unsafe { Box::from_raw(ticket) }
}

/// Ends the transfer: records `tokens` tokens as landed from the first slot of the first page,
/// when `expected` were expected, and unpins the pages in the same step. A count that differs
/// (`token_count_mismatch`), or pages that changed hands meanwhile (`stale_page`,
/// `foreign_page`), record nothing. The ticket is freed whatever the outcome.
///
/// # Safety
/// `ticket` is NULL or a handle from `kvg_begin_import` not ended yet; its table is live.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_import_finish(ticket: *mut kvg_import_ticket, tokens: u64, expected: u64) -> kvg_status {
    if ticket.is_null() {
        return crate::status::guard_free(|| {
            Err(Failure::status(kvg_status::NullPointer, "ticket is NULL".to_string()))
        });
    }
    // SAFETY: non-null, and the caller's contract.
    let handle = unsafe { take(ticket) };
    let kvg_import_ticket { ticket, table } = *handle;
    // On a refused (poisoned) table the ticket is dropped unfinished, which aborts it.
    with_table(table, move |_| Ok(ticket.finish(tokens, expected)?))
}

/// Abandons the transfer (its manifest was refused, say): nothing is recorded, the pages are
/// unpinned, the ticket freed. NULL is a no-op.
///
/// # Safety
/// `ticket` is NULL or a handle from `kvg_begin_import` not ended yet; its table is live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_import_abort(ticket: *mut kvg_import_ticket) {
    if ticket.is_null() {
        return;
    }
    // SAFETY: non-null, and the caller's contract.
    let handle = unsafe { take(ticket) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle.ticket.abort()));
}
