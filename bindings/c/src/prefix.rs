//! Prefixes under byte-string keys (an engine's block hash, a radix node's token run): the
//! `kvg_*_prefix` calls, each key turned into its table-wide id by `PrefixKeys` (prefix_keys.rs).

use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::table::{Table, check_released, kvg_table, put_released, with_table};
use crate::types::{kvg_page_ref, kvg_released};
use kvguard::{PrefixKey, RequestId};

/// The caller's key bytes (at least one byte).
fn key<'a>(ptr: *const u8, len: usize) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Err(Failure::invalid("a prefix key is at least one byte".to_string()));
    }
    raw::slice(ptr, len, "key")
}

/// Publishes `pages` of `request` (all its own) as the read-only prefix under the byte-string
/// key `key` (`key_len` bytes); `request` holds it. A key already published is
/// `duplicate_prefix`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `key` holds `key_len` bytes; `pages` holds `num_pages` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_publish_prefix(
    table: *mut kvg_table,
    request: u64,
    key: *const u8,
    key_len: usize,
    pages: *const i32,
    num_pages: usize,
) -> kvg_status {
    with_table(table, |t| {
        let key = self::key(key, key_len)?;
        let pages = raw::pages(raw::slice(pages, num_pages, "pages")?);
        publish(t, key, |id| t.table.publish_prefix(RequestId(request), id, pages))
    })
}

/// `kvg_publish_prefix` through page refs: each page must also still be in the incarnation its
/// ref names (`stale_page`).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `key` holds `key_len` bytes; `pages` holds `num_pages` refs.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_publish_prefix_refs(
    table: *mut kvg_table,
    request: u64,
    key: *const u8,
    key_len: usize,
    pages: *const kvg_page_ref,
    num_pages: usize,
) -> kvg_status {
    with_table(table, |t| {
        let key = self::key(key, key_len)?;
        let refs = crate::table::refs(pages, num_pages, "pages")?;
        publish(t, key, |id| t.table.publish_prefix_refs(RequestId(request), id, &refs))
    })
}

/// Publishes under `key` with `publish(id)`: a key already published keeps its id (the core
/// refuses it as `duplicate_prefix`); a new one gets the next id if the publish succeeds.
fn publish(
    t: &Table,
    key: &[u8],
    publish: impl FnOnce(PrefixKey) -> Result<(), kvguard::Error>,
) -> Result<(), Failure> {
    // Held across the core's call: two publishes of one key must not both get fresh ids.
    let mut keys = t.prefixes.lock();
    if let Some(id) = keys.published(key) {
        // The core refuses it (`duplicate_prefix`) and counts it.
        return Ok(publish(id)?);
    }
    let id = keys.next();
    publish(id)?;
    keys.insert(key, id);
    Ok(())
}

/// `request` holds the prefix under `key` and may read its pages, whose refs (in published
/// order) go to `out` when it is not NULL; `*num_out` (if not NULL) gets how many there are.
/// Another tenant's prefix is `cross_tenant_share` unless that tenant allows sharing. When `out`
/// is too small the attach stays done and `KVG_STATUS_BUFFER_TOO_SMALL` says so.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `key` holds `key_len` bytes; `out` is NULL or has room for
/// `capacity`; `num_out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_attach_prefix(
    table: *mut kvg_table,
    request: u64,
    key: *const u8,
    key_len: usize,
    out: *mut kvg_page_ref,
    capacity: usize,
    num_out: *mut usize,
) -> kvg_status {
    with_table(table, |t| {
        let key = self::key(key, key_len)?;
        let wanted = !out.is_null();
        let out = if wanted { raw::slice_mut(out, capacity, "out")? } else { &mut [] };
        let id = t.prefixes.lock().get(key);
        let refs = t.table.attach_prefix(RequestId(request), id)?;
        for (dst, r) in out.iter_mut().zip(&refs) {
            *dst = kvg_page_ref::from_core(*r);
        }
        raw::put(num_out, refs.len())?;
        if wanted && refs.len() > out.len() {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("attached, but the prefix has {} pages and `out` room for {}", refs.len(), out.len()),
            ));
        }
        Ok(())
    })
}

/// `request` lets go of the prefix under `key`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `key` holds `key_len` bytes; `released` as for `kvg_release`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_detach_prefix(
    table: *mut kvg_table,
    request: u64,
    key: *const u8,
    key_len: usize,
    released: *mut kvg_released,
) -> kvg_status {
    with_table(table, |t| {
        let key = self::key(key, key_len)?;
        check_released(released)?;
        let id = t.prefixes.lock().get(key);
        put_released(released, t.table.detach_prefix(RequestId(request), id)?)
    })
}

/// The cache drops the prefix under `key`; its pages are released. Refused with `evict_in_use`
/// while any request holds it.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `key` holds `key_len` bytes; `released` as for `kvg_release`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_evict_prefix(
    table: *mut kvg_table,
    key: *const u8,
    key_len: usize,
    released: *mut kvg_released,
) -> kvg_status {
    with_table(table, |t| {
        let key = self::key(key, key_len)?;
        check_released(released)?;
        // Held across the core's call, so a publish of the same key waits for the evict.
        let mut keys = t.prefixes.lock();
        let id = keys.get(key);
        let outcome = t.table.evict_prefix(id)?;
        keys.remove(key);
        drop(keys);
        put_released(released, outcome)
    })
}
