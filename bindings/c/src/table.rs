//! The table handle and the lifecycle calls: create and free, admit, allocate or claim, writes,
//! releases, scrubs, forks, sharing, and what the table tells about itself.

use crate::guard::{guard, guard_free, guard_release};
use crate::handle::{Held, Kind, Registry};
use crate::prefix_keys::PrefixKeys;
use crate::raw::{self, SizedStruct};
use crate::status::{Failure, kvg_status};
use crate::types::{
    kvg_page_info, kvg_page_ref, kvg_policy, kvg_pool_config, kvg_pool_snapshot, kvg_released, kvg_request_info,
    kvg_violation_info,
};
use kvguard::{OwnershipTable, Policy, PoolConfig, Released, RequestId, TenantId, Violation, ViolationKind};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_char;
use std::mem::size_of;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

/// An ownership table behind an opaque handle (`kvg_table_new`, `kvg_table_free`). Safe to share
/// between threads: every call may run on any thread, concurrently with any other, `kvg_table_free`
/// included (a call already running finishes on the table; one that starts after the free is
/// `KVG_STATUS_INVALID_HANDLE`).
///
/// The pointer is a handle, never dereferenced: a freed handle (a use after free, a second
/// free), a handle of another type, or a value kvguard never handed out is refused with
/// `KVG_STATUS_INVALID_HANDLE`, even after the memory was reused.
pub struct kvg_table {
    _handle_only: [u8; 0],
}

/// The live tables, by handle.
static TABLES: Registry<Table> = Registry::new(Kind::Table);

/// What a table handle names: the core's table and what the binding keeps beside it. Held by
/// every call in flight on it and by its open import tickets ([`Held`]), so it lives until the
/// last of them ends, even after `kvg_table_free`.
pub(crate) struct Table {
    pub(crate) table: OwnershipTable,
    pub(crate) prefixes: Mutex<PrefixKeys>,
    /// Violations taken from the table's log and not yet handed out one by one.
    drained: Mutex<VecDeque<Violation>>,
    /// A call on this table panicked: its state may be half-changed, so every later call is refused.
    poisoned: AtomicBool,
    /// The import tickets still open, aborted by `kvg_table_free`.
    tickets: Mutex<OpenTickets>,
}

#[derive(Default)]
struct OpenTickets {
    /// Each open ticket's handle, and the function that aborts it by handle (given by the module
    /// that opened it, so the table names no kind of ticket).
    handles: HashMap<usize, fn(usize)>,
    /// `kvg_table_free` ran: no ticket may open any more.
    closed: bool,
}

/// Holds the live table behind `handle` (for a ticket, which keeps its table alive).
pub(crate) fn hold(handle: *const kvg_table) -> Result<Held<Table>, Failure> {
    TABLES.get(handle.addr(), "table")
}

impl Table {
    /// Marks the table refused from now on: a call on it panicked.
    pub(crate) fn poison(&self) {
        self.poisoned.store(true, Ordering::Relaxed);
    }

    /// Refuses a call on a table an earlier call panicked in.
    pub(crate) fn refuse_if_poisoned(&self) -> Result<(), Failure> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(Failure::status(
                kvg_status::Panic,
                "an earlier call on this table panicked: free it".to_string(),
            ));
        }
        Ok(())
    }

    /// Registers an import ticket as open on this table, unless the table was freed meanwhile
    /// (then the ticket is dropped, which aborts it). Its handle; `abort` ends it by that handle
    /// when `kvg_table_free` finds it still open.
    pub(crate) fn open_ticket<T: Send + Sync>(
        &self,
        registry: &'static Registry<T>,
        ticket: T,
        abort: fn(usize),
    ) -> Result<usize, Failure> {
        let mut open = self.tickets.lock();
        if open.closed {
            return Err(Failure::status(
                kvg_status::InvalidHandle,
                "table was freed by kvg_table_free during this call: no ticket opened".to_string(),
            ));
        }
        let handle = registry.insert(ticket)?;
        open.handles.insert(handle, abort);
        Ok(handle)
    }

    /// A ticket of this table ended (finished or aborted).
    pub(crate) fn forget_ticket(&self, handle: usize) {
        self.tickets.lock().handles.remove(&handle);
    }
}

/// Runs `body` on the table behind `t`, inside [`guard`]: a NULL, dead or foreign handle is
/// refused, and so is a poisoned table; a panic in `body` poisons it. The call holds the table
/// until it returns, so a `kvg_table_free` racing with it never frees it under it.
pub(crate) fn with_table(t: *const kvg_table, body: impl FnOnce(&Held<Table>) -> Result<(), Failure>) -> kvg_status {
    guard(
        || {},
        || {
            let table = TABLES.get(t.addr(), "table")?;
            table.refuse_if_poisoned()?;
            catch_unwind(AssertUnwindSafe(|| body(&table))).unwrap_or_else(|panic| {
                table.poison();
                resume_unwind(panic)
            })
        },
    )
}

fn policy(value: u32) -> Result<Policy, Failure> {
    match value {
        v if v == kvg_policy::Enforce as u32 => Ok(Policy::Enforce),
        v if v == kvg_policy::Report as u32 => Ok(Policy::Report),
        v => Err(Failure::invalid(format!("policy {v} is not a kvg_policy"))),
    }
}

fn pool_config(config: *const kvg_pool_config) -> Result<PoolConfig, Failure> {
    let c = raw::read_sized(config, "config")?;
    let reserved = raw::slice(c.reserved, c.num_reserved, "config.reserved")?;
    let mut pool = PoolConfig::new(c.num_pages, c.page_size, c.max_context_tokens)
        .with_reserved(raw::pages(reserved).iter().copied())
        .with_policy(policy(c.policy)?)
        .with_scrub_on_release(c.scrub_on_release != 0);
    if c.generation_limit != 0 {
        pool = pool.with_generation_limit(c.generation_limit);
    }
    Ok(pool)
}

/// Checks a caller's output struct before the operation runs, so a bad one refuses the call
/// instead of being found after the table changed.
fn check_out<T: SizedStruct>(out: *mut T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Ok(());
    }
    raw::read_sized(out.cast_const(), what).map(drop)
}

/// Checks a caller's `kvg_released` before a release: NULL, or a valid struct whose `scrub` has
/// room for `scrub_capacity` entries.
pub(crate) fn check_released(out: *mut kvg_released) -> Result<(), Failure> {
    if out.is_null() {
        return Ok(());
    }
    let c = raw::read_sized(out.cast_const(), "released")?;
    raw::slice_mut(c.scrub, c.scrub_capacity, "released.scrub").map(drop)
}

/// Hands a release's outcome back through a `kvg_released` already checked by [`check_released`].
pub(crate) fn put_released(out: *mut kvg_released, released: Released) -> Result<(), Failure> {
    if out.is_null() {
        return Ok(());
    }
    let mut c = raw::read_sized(out.cast_const(), "released")?;
    let room = raw::slice_mut(c.scrub, c.scrub_capacity, "released.scrub")?;
    for (dst, r) in room.iter_mut().zip(&released.scrub) {
        *dst = kvg_page_ref::from_core(*r);
    }
    c.ended = released.ended;
    c.scrub_len = released.scrub.len();
    // In-out: the caller's `struct_size` stays, so its in-fields are checked again next time.
    raw::fill_sized(out, c.struct_size, c, "released")?;
    if released.scrub.len() > c.scrub_capacity {
        return Err(Failure::status(
            kvg_status::BufferTooSmall,
            format!(
                "released, but {} pages await a scrub and `scrub` has room for {}: the rest read awaiting_scrub in kvg_get_page_info",
                released.scrub.len(),
                c.scrub_capacity
            ),
        ));
    }
    Ok(())
}

/// The version of the C ABI the header describes: bumped on every incompatible change (a
/// callback's signature, a struct's layout). Version 2: `kvg_land_fn` returns an `int` status;
/// `kvg_table_free`, `kvg_manifest_free` and `kvg_import_abort` return a `kvg_status` (a freed or
/// invalid handle is `KVG_STATUS_INVALID_HANDLE`).
/// Compare it with [`kvg_abi_version`] at start-up to catch a header and a library that differ.
pub const KVG_ABI_VERSION: u32 = 2;

/// The ABI version this library was built with ([`KVG_ABI_VERSION`] of its header).
#[unsafe(no_mangle)]
pub extern "C" fn kvg_abi_version() -> u32 {
    KVG_ABI_VERSION
}

/// The library's version (`"0.1.0"`), static and NUL-terminated.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_version() -> *const c_char {
    c"0.1.0".as_ptr()
}

/// Fills `*config` with the defaults (enforce, no reserved pages, no scrubbing, the default
/// generation limit, zero pages), zeroes the rest of its `struct_size` bytes, and sets its
/// `struct_size` to `struct_size`, which the caller passes as `sizeof(kvg_pool_config)`.
///
/// The caller's size is kept, not this library's: a caller built against a newer header that
/// sets a newer field after this call has that field refused by `kvg_table_new`
/// (`KVG_STATUS_BAD_STRUCT_SIZE`) when this library does not know it, never silently ignored.
/// A `struct_size` below the first version's `sizeof(kvg_pool_config)`, or above 4,096, is
/// `KVG_STATUS_BAD_STRUCT_SIZE` and nothing is written.
///
/// # Safety
/// `config` is NULL or points to `struct_size` writable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_pool_config_init(config: *mut kvg_pool_config, struct_size: usize) -> kvg_status {
    guard_free(|| {
        let defaults = kvg_pool_config {
            struct_size,
            num_pages: 0,
            page_size: 0,
            max_context_tokens: 0,
            reserved: std::ptr::null(),
            num_reserved: 0,
            policy: kvg_policy::Enforce as u32,
            scrub_on_release: 0,
            generation_limit: 0,
        };
        raw::fill_sized(config, struct_size, defaults, "config")
    })
}

/// The start-up audit alone: `KVG_STATUS_OK` when the pool is well formed and one
/// max-context request fits, else `KVG_STATUS_CONFIG_INVALID` with the numbers in the message.
///
/// # Safety
/// `config` is NULL or points to a `kvg_pool_config` of its `struct_size` bytes whose
/// `reserved` holds `num_reserved` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_pool_config_audit(config: *const kvg_pool_config) -> kvg_status {
    guard_free(|| Ok(pool_config(config)?.audit().map_err(kvguard::Error::from)?))
}

fn new_table(
    config: *const kvg_pool_config,
    out: *mut *mut kvg_table,
    make: fn(PoolConfig) -> Result<OwnershipTable, kvguard::Error>,
) -> kvg_status {
    guard_free(|| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let table = make(pool_config(config)?)?;
        let handle = TABLES.insert(Table {
            table,
            prefixes: Mutex::new(PrefixKeys::default()),
            drained: Mutex::new(VecDeque::new()),
            poisoned: AtomicBool::new(false),
            tickets: Mutex::new(OpenTickets::default()),
        })?;
        raw::put(out, std::ptr::without_provenance_mut(handle))
    })
}

/// Creates a table for `config` after the start-up audit; `*out` is the handle (NULL on failure).
///
/// # Safety
/// `config` as for `kvg_pool_config_audit`; `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_table_new(config: *const kvg_pool_config, out: *mut *mut kvg_table) -> kvg_status {
    new_table(config, out, OwnershipTable::new)
}

/// Creates a table without the capacity audit (the pool is still validated): for replaying
/// what a mis-sized deployment did, where admission then refuses what cannot fit.
///
/// # Safety
/// As for `kvg_table_new`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_table_new_unaudited(
    config: *const kvg_pool_config,
    out: *mut *mut kvg_table,
) -> kvg_status {
    new_table(config, out, OwnershipTable::new_unaudited)
}

/// Frees a table. NULL is a no-op (`KVG_STATUS_OK`). Import tickets still open on it are
/// aborted (their pages unpinned, nothing recorded) and freed: their handles are dead from then
/// on, and finishing or aborting one is `KVG_STATUS_INVALID_HANDLE`. A call running on the table
/// in another thread meanwhile finishes on it, and the memory goes when it returns.
///
/// Returns `KVG_STATUS_INVALID_HANDLE` (and frees nothing) for a table freed already, or a handle
/// that is not a table. The status may be ignored (the header does not insist on it); a free
/// that succeeds leaves the thread's last error as it was, so a failure can still be read after
/// freeing the table it happened on.
///
/// # Safety
/// None beyond the type: `table` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_table_free(table: *mut kvg_table) -> kvg_status {
    if table.is_null() {
        return kvg_status::Ok;
    }
    guard_release(
        || {},
        || {
            // Held while its tickets are aborted; dropped here, or by the last call in flight.
            let t = TABLES.get(table.addr(), "table")?;
            TABLES.remove(table.addr(), "table")?;
            let open = {
                let mut open = t.tickets.lock();
                open.closed = true;
                std::mem::take(&mut open.handles)
            };
            for (ticket, abort) in open {
                abort(ticket);
            }
            Ok(())
        },
    )
}

/// Admits request `request` of tenant `tenant`: `prompt_tokens` now, up to `max_new_tokens`
/// more. Refused before any page is touched when it can never fit (`exceeds_max_context`,
/// `exceeds_pool`) or the id is live (`duplicate_request`).
///
/// # Safety
/// `table` is any value (never dereferenced).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_admit(
    table: *mut kvg_table,
    request: u64,
    tenant: u64,
    prompt_tokens: u64,
    max_new_tokens: u64,
) -> kvg_status {
    with_table(table, |t| Ok(t.table.admit(RequestId(request), TenantId(tenant), prompt_tokens, max_new_tokens)?))
}

/// Allocator mode: hands `count` free pages to `request` (all or none) and writes their refs to
/// `out`, which has room for `capacity` (at least `count`, checked before anything happens).
///
/// # Safety
/// `table` is any value (never dereferenced); `out` has room for `capacity` entries (NULL if 0).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_allocate(
    table: *mut kvg_table,
    request: u64,
    count: u32,
    out: *mut kvg_page_ref,
    capacity: usize,
) -> kvg_status {
    with_table(table, |t| {
        if capacity < count as usize {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("room for {capacity} page refs, {count} asked for: nothing allocated"),
            ));
        }
        let out = raw::slice_mut(out, count as usize, "out")?;
        let refs = t.table.allocate(RequestId(request), count)?;
        for (dst, r) in out.iter_mut().zip(refs) {
            *dst = kvg_page_ref::from_core(r);
        }
        Ok(())
    })
}

/// Shadow mode: the engine's allocator gave `pages` to `request`. All must be free (else
/// `page_not_free`, `reserved_page` or `page_out_of_range`; a negative id is out of range), and
/// then all are claimed; otherwise none is. Their refs go to `out` when it is not NULL (room for
/// `capacity`, at least `num_pages`).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `pages` holds `num_pages` entries; `out` is NULL or has room for
/// `capacity`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_claim(
    table: *mut kvg_table,
    request: u64,
    pages: *const i32,
    num_pages: usize,
    out: *mut kvg_page_ref,
    capacity: usize,
) -> kvg_status {
    with_table(table, |t| {
        let pages = raw::slice(pages, num_pages, "pages")?;
        let out = if out.is_null() {
            &mut []
        } else if capacity < num_pages {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("room for {capacity} page refs, {num_pages} claimed: nothing claimed"),
            ));
        } else {
            raw::slice_mut(out, num_pages, "out")?
        };
        let refs = t.table.claim(RequestId(request), raw::pages(pages))?;
        for (dst, r) in out.iter_mut().zip(refs) {
            *dst = kvg_page_ref::from_core(r);
        }
        Ok(())
    })
}

/// Records that `request` wrote slots `slot_start..slot_end` of `page`, which it must own
/// exclusively.
///
/// # Safety
/// `table` is any value (never dereferenced).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_write(
    table: *mut kvg_table,
    request: u64,
    page: i32,
    slot_start: u32,
    slot_end: u32,
) -> kvg_status {
    with_table(table, |t| Ok(t.table.record_write(RequestId(request), raw::page(page), slot_start..slot_end)?))
}

/// Records that `request` wrote tokens `token_start..token_end` of its sequence through its block
/// table (token `n` lives in block `n / page_size`, slot `n % page_size`); all or nothing.
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_write_tokens(
    table: *mut kvg_table,
    request: u64,
    block_table: *const i32,
    num_blocks: usize,
    token_start: u64,
    token_end: u64,
) -> kvg_status {
    with_table(table, |t| {
        let bt = raw::slice(block_table, num_blocks, "block_table")?;
        Ok(t.table.record_write_tokens(RequestId(request), raw::pages(bt), token_start..token_end)?)
    })
}

/// The caller's page refs as the core's.
pub(crate) fn refs(ptr: *const kvg_page_ref, len: usize, what: &str) -> Result<Vec<kvguard::PageRef>, Failure> {
    Ok(raw::slice(ptr, len, what)?.iter().map(|r| r.to_core()).collect())
}

/// `kvg_record_write_tokens` through page refs: each page must also still be in the incarnation
/// its ref names (`stale_page`), so a write landing after its page changed hands is refused.
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` refs.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_write_tokens_refs(
    table: *mut kvg_table,
    request: u64,
    block_table: *const kvg_page_ref,
    num_blocks: usize,
    token_start: u64,
    token_end: u64,
) -> kvg_status {
    with_table(table, |t| {
        let bt = refs(block_table, num_blocks, "block_table")?;
        Ok(t.table.record_write_tokens_refs(RequestId(request), &bt, token_start..token_end)?)
    })
}

/// `kvg_record_import` through page refs: a transfer landing after its pages were released (and
/// maybe reused) is `stale_page` or `foreign_page`, and nothing is recorded.
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` refs.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_import_refs(
    table: *mut kvg_table,
    request: u64,
    block_table: *const kvg_page_ref,
    num_blocks: usize,
    tokens: u64,
    expected: u64,
) -> kvg_status {
    with_table(table, |t| {
        let bt = refs(block_table, num_blocks, "block_table")?;
        Ok(t.table.record_import_refs(RequestId(request), &bt, tokens, expected)?)
    })
}

/// Records a KV transfer that wrote `tokens` tokens into `request`'s pages from the first slot,
/// when it expected `expected`: a count that differs is `token_count_mismatch`, nothing recorded.
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_import(
    table: *mut kvg_table,
    request: u64,
    block_table: *const i32,
    num_blocks: usize,
    tokens: u64,
    expected: u64,
) -> kvg_status {
    with_table(table, |t| {
        let bt = raw::slice(block_table, num_blocks, "block_table")?;
        Ok(t.table.record_import(RequestId(request), raw::pages(bt), tokens, expected)?)
    })
}

/// Ends `request`: its pages are released (generations bumped) and its prefix holds dropped.
/// Releasing it again is `double_free`. `released` (NULL if not wanted) gets what was handed back.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `released` is NULL or a `kvg_released` of its `struct_size` whose
/// `scrub` has room for `scrub_capacity`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_release(table: *mut kvg_table, request: u64, released: *mut kvg_released) -> kvg_status {
    with_table(table, |t| {
        check_released(released)?;
        put_released(released, t.table.release(RequestId(request))?)
    })
}

/// Releases some of `request`'s pages (sliding window, partial eviction); all or none.
///
/// # Safety
/// As for `kvg_release`; `pages` holds `num_pages` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_release_pages(
    table: *mut kvg_table,
    request: u64,
    pages: *const i32,
    num_pages: usize,
    released: *mut kvg_released,
) -> kvg_status {
    with_table(table, |t| {
        let pages = raw::slice(pages, num_pages, "pages")?;
        check_released(released)?;
        put_released(released, t.table.release_pages(RequestId(request), raw::pages(pages))?)
    })
}

/// `kvg_release_pages` through page refs: each page must still be in the incarnation its ref
/// names (`stale_page`), so a late release never frees the page's next incarnation.
///
/// # Safety
/// As for `kvg_release`; `pages` holds `num_pages` refs.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_release_pages_refs(
    table: *mut kvg_table,
    request: u64,
    pages: *const kvg_page_ref,
    num_pages: usize,
    released: *mut kvg_released,
) -> kvg_status {
    with_table(table, |t| {
        let pages = refs(pages, num_pages, "pages")?;
        check_released(released)?;
        put_released(released, t.table.release_pages_refs(RequestId(request), &pages)?)
    })
}

/// Preemption: releases all of `request`'s pages and prefix holds but keeps it admitted.
///
/// # Safety
/// As for `kvg_release`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_preempt(table: *mut kvg_table, request: u64, released: *mut kvg_released) -> kvg_status {
    with_table(table, |t| {
        check_released(released)?;
        put_released(released, t.table.preempt(RequestId(request))?)
    })
}

/// With `scrub_on_release`: the engine poisoned or zeroed these released pages (each in exactly
/// the incarnation released); they return to the free list. All or none.
///
/// # Safety
/// `table` is any value (never dereferenced); `pages` holds `num_pages` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_confirm_scrubbed(
    table: *mut kvg_table,
    pages: *const kvg_page_ref,
    num_pages: usize,
) -> kvg_status {
    with_table(table, |t| {
        let refs: Vec<kvguard::PageRef> = raw::slice(pages, num_pages, "pages")?.iter().map(|r| r.to_core()).collect();
        Ok(t.table.confirm_scrubbed(&refs)?)
    })
}

/// Parallel sampling: `child` is admitted for `parent`'s tenant, holding `parent`'s pages
/// read-only (they become shared).
///
/// # Safety
/// `table` is any value (never dereferenced).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_fork(table: *mut kvg_table, parent: u64, child: u64) -> kvg_status {
    with_table(table, |t| Ok(t.table.fork(RequestId(parent), RequestId(child))?))
}

/// Lets other tenants attach to `tenant`'s prefixes (`allow` non-zero), or stops it (0).
///
/// # Safety
/// `table` is any value (never dereferenced).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_allow_cross_tenant_sharing(table: *mut kvg_table, tenant: u64, allow: u32) -> kvg_status {
    with_table(table, |t| {
        t.table.allow_cross_tenant_sharing(TenantId(tenant), allow != 0);
        Ok(())
    })
}

/// Page counts by state and other totals, into `*out` (whose `struct_size` the caller sets).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `out` is NULL or a `kvg_pool_snapshot` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_snapshot(table: *const kvg_table, out: *mut kvg_pool_snapshot) -> kvg_status {
    with_table(table, |t| raw::write_sized(out, kvg_pool_snapshot::from_core(t.table.snapshot()), "out"))
}

/// What the table knows of `page`, into `*out`; a page beyond the pool (or negative) is
/// `KVG_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `out` is NULL or a `kvg_page_info` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_get_page_info(table: *const kvg_table, page: i32, out: *mut kvg_page_info) -> kvg_status {
    with_table(table, |t| {
        check_out(out, "out")?;
        let info = t
            .table
            .page_info(raw::page(page))
            .ok_or_else(|| Failure::invalid(format!("page {page} is not in the pool")))?;
        raw::write_sized(out, kvg_page_info::from_core(info), "out")
    })
}

/// What the table knows of admitted request `request`, into `*out`; one not admitted is
/// `KVG_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `out` is NULL or a `kvg_request_info` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_get_request_info(
    table: *const kvg_table,
    request: u64,
    out: *mut kvg_request_info,
) -> kvg_status {
    with_table(table, |t| {
        check_out(out, "out")?;
        let info = t
            .table
            .request_info(RequestId(request))
            .ok_or_else(|| Failure::invalid(format!("req {request} is not admitted")))?;
        let c = kvg_request_info {
            struct_size: size_of::<kvg_request_info>(),
            tenant: info.tenant.0,
            prompt_tokens: info.prompt_tokens,
            max_new_tokens: info.max_new_tokens,
            owned_pages: info.owned_pages.len() as u64,
            prefixes: info.prefixes.len() as u64,
            quarantined: u32::from(info.quarantined),
        };
        raw::write_sized(out, c, "out")
    })
}

/// The pages admitted request `request` owns exclusively, in the order it got them, as refs
/// into `out`, which has room for `capacity`; `*num_out` (required) gets how many there are.
/// `out` NULL asks the count only; a shorter `out` is `KVG_STATUS_BUFFER_TOO_SMALL`, nothing
/// written. One not admitted is `KVG_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `out` is NULL or has room for `capacity`; `num_out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_get_request_pages(
    table: *const kvg_table,
    request: u64,
    out: *mut kvg_page_ref,
    capacity: usize,
    num_out: *mut usize,
) -> kvg_status {
    with_table(table, |t| {
        raw::put_required(num_out, 0, "num_out")?;
        let info = t
            .table
            .request_info(RequestId(request))
            .ok_or_else(|| Failure::invalid(format!("req {request} is not admitted")))?;
        let pages = info.owned_pages;
        raw::put(num_out, pages.len())?;
        if out.is_null() {
            return Ok(());
        }
        if capacity < pages.len() {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("req {request} owns {} pages, `out` has room for {capacity}", pages.len()),
            ));
        }
        for (dst, r) in raw::slice_mut(out, pages.len(), "out")?.iter_mut().zip(pages) {
            *dst = kvg_page_ref::from_core(r);
        }
        Ok(())
    })
}

/// How many violations of kind `kind` (a `kvg_violation_kind`; 0 for all kinds) the table has
/// counted, into `*out`.
///
/// # Safety
/// `table` is any value (never dereferenced); `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_violation_count(table: *const kvg_table, kind: u32, out: *mut u64) -> kvg_status {
    with_table(table, |t| {
        let counters = t.table.counters();
        let n = match kind {
            0 => counters.total(),
            k => match ViolationKind::ALL.get(k as usize - 1) {
                Some(&kind) => counters.get(kind),
                None => return Err(Failure::invalid(format!("kind {k} is not a kvg_violation_kind"))),
            },
        };
        raw::put_required(out, n, "out")
    })
}

/// Takes the oldest logged violation into `*out` and sets `*found` to 1, or sets `*found` to 0
/// when none is left (the log keeps the last 1,024; `violations_dropped` counts the rest).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `out` is NULL or a `kvg_violation_info` of its `struct_size` bytes;
/// `found` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_drain_violation(
    table: *mut kvg_table,
    out: *mut kvg_violation_info,
    found: *mut u32,
) -> kvg_status {
    with_table(table, |t| {
        raw::put_required(found, 0, "found")?;
        if out.is_null() {
            return Err(Failure::status(kvg_status::NullPointer, "out is NULL".to_string()));
        }
        check_out(out, "out")?;
        let next = {
            let mut drained = t.drained.lock();
            if drained.is_empty() {
                drained.extend(t.table.drain_violations());
            }
            drained.pop_front()
        };
        if let Some(v) = next {
            raw::write_sized(out, kvg_violation_info::from_violation(&v, None), "out")?;
            raw::put(found, 1)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> *mut kvg_table {
        let mut config = std::mem::MaybeUninit::<kvg_pool_config>::uninit();
        // SAFETY: `config` has room for a `kvg_pool_config`; `init` fills every byte of it.
        let mut config = unsafe {
            assert_eq!(kvg_pool_config_init(config.as_mut_ptr(), size_of::<kvg_pool_config>()), kvg_status::Ok);
            config.assume_init()
        };
        (config.num_pages, config.page_size, config.max_context_tokens) = (8, 16, 64);
        let mut t = std::ptr::null_mut();
        // SAFETY: a valid config and a writable out pointer.
        assert_eq!(unsafe { kvg_table_new(&config, &mut t) }, kvg_status::Ok);
        t
    }

    #[test]
    fn a_panic_is_caught_and_the_table_refused_from_then_on() {
        let t = table();
        let status = with_table(t, |_| panic!("a bug"));
        assert_eq!(status, kvg_status::Panic);
        assert_eq!(crate::guard::kvg_last_status(), kvg_status::Panic);
        // SAFETY: `t` is live until freed below.
        assert_eq!(unsafe { kvg_admit(t, 1, 1, 16, 0) }, kvg_status::Panic);
        // SAFETY: made by `kvg_table_new`, freed once.
        unsafe { kvg_table_free(t) };
    }
}
