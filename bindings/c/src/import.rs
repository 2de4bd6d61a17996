//! Import tickets: a KV transfer in flight, its pages pinned until the ticket ends
//! (`kvg_begin_import`, then `kvg_import_finish` or `kvg_import_abort`).

use crate::guard::{guard, guard_release};
use crate::handle::{Held, Kind, Registry};
use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::table::{Table, hold, kvg_table, with_table};
use crate::types::kvg_page_ref;
use kvguard::{ImportTicket, PageRef, RequestId};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

/// A KV transfer in flight behind an opaque handle: while it lives, its pages are pinned (a
/// release takes them from the request, but they stay out of the free list until the ticket
/// ends, so bytes still landing never reach a next owner). Ended, and freed, by exactly one
/// `kvg_import_finish` or `kvg_import_abort`; `kvg_table_free` aborts and frees the tickets still
/// open on its table. Ending it again, or after its table was freed, is
/// `KVG_STATUS_INVALID_HANDLE`. It may move between threads; two threads ending it at once end
/// it once (the other gets `KVG_STATUS_INVALID_HANDLE`).
pub struct kvg_import_ticket {
    _handle_only: [u8; 0],
}

/// The open tickets, by handle.
static TICKETS: Registry<Ticket> = Registry::new(Kind::ImportTicket);

/// What a ticket handle names: the core's ticket, and the table it borrows, held by the ticket
/// itself. Fields drop in order: the ticket (which aborts if still open) before the table.
pub(crate) struct Ticket {
    pinned: ImportTicket<'static>,
    table: Held<Table>,
}

impl Ticket {
    /// Ends the transfer (`kvg_import_finish`); a panic in it poisons the table.
    fn finish(self, tokens: u64, expected: u64) -> Result<(), Failure> {
        // On a refused (poisoned) table the ticket is dropped unfinished, which aborts it.
        self.table.refuse_if_poisoned()?;
        let pinned = self.pinned;
        let outcome = catch_unwind(AssertUnwindSafe(|| pinned.finish(tokens, expected))).unwrap_or_else(|panic| {
            self.table.poison();
            resume_unwind(panic)
        });
        Ok(outcome?)
    }

    /// Fails the transfer at entry `index` (`kvg_import_fail`); a panic in it poisons the table.
    fn fail(self, index: usize) -> Result<(), Failure> {
        // On a refused (poisoned) table the ticket is dropped unfinished, which aborts it; the
        // table refuses every call from then on.
        self.table.refuse_if_poisoned()?;
        let pinned = self.pinned;
        catch_unwind(AssertUnwindSafe(|| pinned.fail(index))).unwrap_or_else(|panic| {
            self.table.poison();
            resume_unwind(panic)
        });
        Ok(())
    }
}

/// Takes an open ticket out of the registry (its handle dead from then on) and off its table's
/// open list: the caller now ends it, or drops it (which aborts it).
fn take_ticket(handle: usize) -> Result<Ticket, Failure> {
    // A ticket is never held by a lookup, so taking its handle always gives the ticket back.
    let ticket = TICKETS.remove(handle, "ticket")?.ok_or_else(|| {
        Failure::status(kvg_status::InvalidHandle, "ticket is being ended by another call".to_string())
    })?;
    ticket.table.forget_ticket(handle);
    Ok(ticket)
}

/// Aborts the ticket behind `handle` if it is still open (`kvg_table_free` of its table ends its
/// open tickets so). Not found: ended meanwhile by its own finish or abort. Found: dropped, which
/// aborts it.
fn abort_open(handle: usize) {
    drop(take_ticket(handle));
}

/// Starts a KV transfer into `refs` (`num_refs` refs of `request`'s own pages, in exactly those
/// incarnations): the pages are pinned and `*out` is the ticket (NULL on failure). Call it before
/// any byte lands. A page already receiving a transfer is `import_in_flight`; a page not the
/// request's in that incarnation is `stale_page`, `foreign_page` or `freed_page`.
///
/// # Safety
/// `table` is a table handle (a dead one is refused); `refs` holds `num_refs` entries; `out` is
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
        let pinned = t.table.begin_import(RequestId(request), &refs)?;
        // The ticket holds its table too: freed meanwhile, it is refused here.
        let held = hold(table)?;
        // SAFETY: the ticket borrows `t.table`, inside the registry's slot for this table, which
        // never moves and keeps the table until its last holder lets go; the `Ticket` holds the
        // table and drops that hold only after the ticket (field order; `Ticket::finish` ends
        // the ticket before its hold goes), so the borrow never dangles.
        let pinned = unsafe { std::mem::transmute::<ImportTicket<'_>, ImportTicket<'static>>(pinned) };
        let handle = t.open_ticket(&TICKETS, Ticket { pinned, table: held }, abort_open)?;
        raw::put(out, std::ptr::without_provenance_mut(handle))
    })
}

/// Ends the transfer: records `tokens` tokens as landed from the first slot of the first page,
/// when `expected` were expected, and unpins the pages in the same step. A count that differs
/// (`token_count_mismatch`), or pages that changed hands meanwhile (`stale_page`,
/// `foreign_page`), record nothing. The ticket is freed whatever the outcome.
///
/// A ticket ended already (finished, aborted, or aborted by `kvg_table_free` of its table) is
/// `KVG_STATUS_INVALID_HANDLE`, and nothing is recorded.
///
/// # Safety
/// None beyond the type: `ticket` is never dereferenced.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_import_finish(ticket: *mut kvg_import_ticket, tokens: u64, expected: u64) -> kvg_status {
    guard(|| {}, || take_ticket(ticket.addr())?.finish(tokens, expected))
}

/// Ends the transfer because landing its bytes failed at entry `index` (the copy into the pool
/// returned an error; `SIZE_MAX`: at no page in particular): bytes may have landed in any of its
/// pages, so every page still the request's loses its coverage (reads refused as
/// `unwritten_slots` until the request writes it again), nothing is recorded as written, the
/// pages are unpinned, and a `landing_failed` violation naming the page is recorded (counted,
/// logged; it does not quarantine the request). The ticket is freed. `KVG_STATUS_OK` once done;
/// a ticket ended already is `KVG_STATUS_INVALID_HANDLE`.
///
/// # Safety
/// None beyond the type: `ticket` is never dereferenced.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_import_fail(ticket: *mut kvg_import_ticket, index: usize) -> kvg_status {
    guard(|| {}, || take_ticket(ticket.addr())?.fail(index))
}

/// Abandons the transfer (its manifest was refused, say): nothing is recorded, the pages are
/// unpinned, the ticket freed. NULL is a no-op (`KVG_STATUS_OK`); a ticket ended already is
/// `KVG_STATUS_INVALID_HANDLE`. The status may be ignored; an abort that succeeds leaves the
/// thread's last error as it was (a refused manifest's, say).
///
/// # Safety
/// None beyond the type: `ticket` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_import_abort(ticket: *mut kvg_import_ticket) -> kvg_status {
    if ticket.is_null() {
        return kvg_status::Ok;
    }
    // Dropped, the ticket aborts: its pages unpinned, nothing recorded.
    guard_release(|| {}, || take_ticket(ticket.addr()).map(drop))
}
