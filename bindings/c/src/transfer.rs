//! Transfer manifests and the receiver's accept, so a C++ PD connector (TensorRT-LLM's cache
//! transceiver, a NIXL or UCX sender) can send a manifest with the KV and check it on arrival:
//! `kvg_manifest_build` / `kvg_manifest_encode` on the prefill side, `kvg_accept_transfer` (or
//! `kvg_manifest_decode` to look inside) on the decode side.
//!
//! A manifest carries the receiving table's ids: the decode side tells the prefill side its
//! request and tenant ids and the page refs it offers when it asks for the transfer.

use crate::guard::{guard_free, guard_release};
use crate::handle::{Kind, Registry};
use crate::raw::{self, SizedStruct};
use crate::status::{Failure, kvg_status};
use crate::table::{kvg_table, with_table};
use crate::types::{
    kvg_accepted, kvg_expected_transfer, kvg_land_fn, kvg_manifest_info, kvg_manifest_page, kvg_page_ref,
    kvg_transfer_header,
};
use kvguard::transfer::{
    DecodeError, ExpectedTransfer, Manifest, PromptDigest, Receiver, SenderId, TransferError, TransferHeader,
    page_checksum,
};
use kvguard::{Op, PageRef, RequestId, TenantId, Violation};
use std::ffi::c_void;
use std::mem::size_of;

/// A transfer manifest behind an opaque handle (`kvg_manifest_build`, `kvg_manifest_decode`;
/// `kvg_manifest_free`). Immutable: any number of threads may read one at once. The pointer is a
/// handle, never dereferenced: a freed one is `KVG_STATUS_INVALID_HANDLE`.
pub struct kvg_manifest {
    _handle_only: [u8; 0],
}

/// The live manifests, by handle.
static MANIFESTS: Registry<Manifest> = Registry::new(Kind::Manifest);

/// Runs `body` on the manifest behind `m`; a NULL, dead or foreign handle is refused.
fn with_manifest(m: *const kvg_manifest, body: impl FnOnce(&Manifest) -> Result<(), Failure>) -> kvg_status {
    guard_free(|| {
        let manifest = MANIFESTS.get(m.addr(), "manifest")?;
        body(&manifest)
    })
}

/// The caller's page buffers: `num_pages` pointers and as many lengths (a NULL pointer only for
/// an empty page).
fn page_buffers<'a>(
    pages: *const *const u8,
    page_lens: *const usize,
    num_pages: usize,
) -> Result<Vec<&'a [u8]>, Failure> {
    let ptrs = raw::slice(pages, num_pages, "pages")?;
    let lens = raw::slice(page_lens, num_pages, "page_lens")?;
    ptrs.iter().zip(lens).enumerate().map(|(i, (&p, &len))| raw::slice(p, len, &format!("pages[{i}]"))).collect()
}

/// The refusal of undecodable manifest bytes, as the violation the receiver counts it as.
fn decode_refused(e: DecodeError) -> Failure {
    let error = TransferError::Decode(e);
    Failure::Refused { message: error.to_string(), violation: Violation::new(error.kind(), Op::Import) }
}

fn put_manifest(out: *mut *mut kvg_manifest, manifest: Manifest) -> Result<(), Failure> {
    let handle = MANIFESTS.insert(manifest)?;
    raw::put(out, std::ptr::without_provenance_mut(handle))
}

/// The checksum a manifest carries for `len` bytes at `bytes` (CRC32, 0 folded into 1), into
/// `*out`.
///
/// # Safety
/// `bytes` holds `len` bytes (NULL if 0); `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_page_checksum(bytes: *const u8, len: usize, out: *mut u32) -> kvg_status {
    guard_free(|| raw::put_required(out, page_checksum(raw::slice(bytes, len, "bytes")?), "out"))
}

/// The digest of a prompt's `len` token ids (each read as its 32 bits), into `*out`: what a
/// manifest carries and the receiver compares with its own copy of the prompt.
///
/// # Safety
/// `prompt` holds `len` entries (NULL if 0); `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_prompt_digest(prompt: *const i32, len: usize, out: *mut u64) -> kvg_status {
    guard_free(|| {
        let prompt = raw::tokens(raw::slice(prompt, len, "prompt")?);
        raw::put_required(out, PromptDigest::of_tokens(prompt).0, "out")
    })
}

/// The sender's side: builds the manifest for `prompt` (the `prompt_len` token ids prefilled)
/// sent as `num_pages` page buffers (`pages[i]`, `page_lens[i]` bytes: its tokens times
/// `slot_bytes`) into the receiver's `dest` pages (`num_dest` refs, one per page). `*out` is the
/// handle (NULL on failure); a malformed shape is `KVG_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `header` is a `kvg_transfer_header` of its `struct_size`; `prompt` holds `prompt_len`
/// entries, `dest` `num_dest`, `pages` and `page_lens` `num_pages`, each `pages[i]`
/// `page_lens[i]` bytes; `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_manifest_build(
    header: *const kvg_transfer_header,
    prompt: *const i32,
    prompt_len: usize,
    dest: *const kvg_page_ref,
    num_dest: usize,
    pages: *const *const u8,
    page_lens: *const usize,
    num_pages: usize,
    out: *mut *mut kvg_manifest,
) -> kvg_status {
    guard_free(|| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let h = raw::read_sized(header, "header")?;
        let header = TransferHeader {
            request: RequestId(h.request),
            tenant: TenantId(h.tenant),
            sender: SenderId(h.sender),
            page_size: h.page_size,
            slot_bytes: h.slot_bytes,
        };
        let prompt = raw::tokens(raw::slice(prompt, prompt_len, "prompt")?);
        let dest: Vec<PageRef> = raw::slice(dest, num_dest, "dest")?.iter().map(|r| r.to_core()).collect();
        let buffers = page_buffers(pages, page_lens, num_pages)?;
        let manifest = Manifest::build(header, prompt, &dest, &buffers).map_err(|e| Failure::invalid(e.to_string()))?;
        put_manifest(out, manifest)
    })
}

/// Decodes manifest bytes (`len` at `bytes`) into a handle at `*out` (NULL on failure). Bytes
/// that do not decode are refused as a violation (`KVG_STATUS_VIOLATION`, kind
/// `manifest_corrupt`, or `missing_checksum` for a page without one), counted by no table.
///
/// # Safety
/// `bytes` holds `len` bytes; `out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_manifest_decode(bytes: *const u8, len: usize, out: *mut *mut kvg_manifest) -> kvg_status {
    guard_free(|| {
        raw::put_required(out, std::ptr::null_mut(), "out")?;
        let bytes = raw::slice(bytes, len, "bytes")?;
        put_manifest(out, Manifest::decode(bytes).map_err(decode_refused)?)
    })
}

/// Encodes a manifest: `*len` (required) gets its length in bytes; with `buf` NULL that is all
/// (ask the size first), else the bytes go to `buf`, which has room for `capacity`
/// (`KVG_STATUS_BUFFER_TOO_SMALL`, nothing written, when it is shorter).
///
/// # Safety
/// `manifest` is any value (never dereferenced);
/// `buf` is NULL or has room for `capacity` bytes; `len` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_manifest_encode(
    manifest: *const kvg_manifest,
    buf: *mut u8,
    capacity: usize,
    len: *mut usize,
) -> kvg_status {
    with_manifest(manifest, |m| {
        let need = m.encoded_len();
        raw::put_required(len, need, "len")?;
        if buf.is_null() {
            return Ok(());
        }
        if capacity < need {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("the manifest is {need} bytes, `buf` has room for {capacity}"),
            ));
        }
        raw::slice_mut(buf, need, "buf")?.copy_from_slice(&m.encode());
        Ok(())
    })
}

/// What the manifest says (whose KV, which prompt, the page shape, how many pages), into `*out`.
///
/// # Safety
/// `manifest` is any value (never dereferenced);
/// `out` is a `kvg_manifest_info` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_manifest_get_info(
    manifest: *const kvg_manifest,
    out: *mut kvg_manifest_info,
) -> kvg_status {
    with_manifest(manifest, |m| {
        let info = kvg_manifest_info {
            struct_size: size_of::<kvg_manifest_info>(),
            request: m.request().0,
            tenant: m.tenant().0,
            sender: m.sender().0,
            prompt_tokens: m.prompt_tokens(),
            prompt_digest: m.prompt_digest().0,
            page_size: m.page_size(),
            slot_bytes: m.slot_bytes(),
            num_pages: m.pages().len() as u64,
        };
        raw::write_sized(out, info, "out")
    })
}

/// The manifest's pages (where each lands, its tokens, its CRC32) into `out`, which has room for
/// `capacity`; `*num_out` (required) gets how many there are. `KVG_STATUS_BUFFER_TOO_SMALL`,
/// nothing written, when `out` is shorter; `out` NULL asks the count only.
///
/// # Safety
/// `manifest` is any value (never dereferenced);
/// `out` is NULL or has room for `capacity`; `num_out` is writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_manifest_get_pages(
    manifest: *const kvg_manifest,
    out: *mut kvg_manifest_page,
    capacity: usize,
    num_out: *mut usize,
) -> kvg_status {
    with_manifest(manifest, |m| {
        let pages = m.pages();
        raw::put_required(num_out, pages.len(), "num_out")?;
        if out.is_null() {
            return Ok(());
        }
        if capacity < pages.len() {
            return Err(Failure::status(
                kvg_status::BufferTooSmall,
                format!("the manifest lists {} pages, `out` has room for {capacity}", pages.len()),
            ));
        }
        let out = raw::slice_mut(out, pages.len(), "out")?;
        for (dst, p) in out.iter_mut().zip(pages) {
            *dst = kvg_manifest_page { dest: kvg_page_ref::from_core(p.dest), tokens: p.tokens, crc32: p.crc32 };
        }
        Ok(())
    })
}

/// Frees a manifest. NULL is a no-op (`KVG_STATUS_OK`); a manifest freed already, or a handle
/// that is not a manifest, is `KVG_STATUS_INVALID_HANDLE`. A call reading the manifest in
/// another thread meanwhile finishes on it. The status may be ignored; a free that succeeds
/// leaves the thread's last error as it was.
///
/// # Safety
/// None beyond the type: `manifest` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvg_manifest_free(manifest: *mut kvg_manifest) -> kvg_status {
    if manifest.is_null() {
        return kvg_status::Ok;
    }
    guard_release(|| {}, || MANIFESTS.remove(manifest.addr(), "manifest").map(drop))
}

/// The receiver's side: accepts a transfer only if its manifest (`manifest_len` bytes) is for
/// `expected` in every respect (request, tenant, sender if asked, prompt length and digest, the
/// receiving pages in the offered incarnations, the page shape), every page buffer has its
/// length and CRC32, and the table still holds every receiving page for the request. The pages
/// are pinned while it runs (as `kvg_begin_import`). Only then is `land(user, i, page, bytes,
/// len)` called for each page (NULL: the bytes are already in place) and the tokens recorded as
/// written.
///
/// Returns `KVG_STATUS_OK` (and fills `accepted`, if not NULL) or `KVG_STATUS_VIOLATION`: the
/// message says which check failed, `kvg_last_violation` gives the kind (`transfer_misrouted`,
/// `prompt_digest_mismatch`, `page_checksum_mismatch`, `stale_page`, ...), and the table counted
/// and logged it. A refusal records no coverage; only the final record can be refused after
/// `land` ran (the request released its pages meanwhile). A `land` that returns nonzero fails
/// the import at that page: `KVG_STATUS_VIOLATION` of kind `landing_failed` (the message names
/// the page and the value returned), nothing recorded as written, the coverage of every
/// receiving page revoked (bytes may have landed in any), the request not quarantined.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `expected` a `kvg_expected_transfer` of its `struct_size` whose
/// arrays hold what it says; `manifest` holds `manifest_len` bytes; `pages` and `page_lens` hold
/// `num_pages` entries, each `pages[i]` `page_lens[i]` bytes; `land` must not unwind; `accepted`
/// is NULL or a `kvg_accepted` of its `struct_size` bytes.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvg_accept_transfer(
    table: *mut kvg_table,
    expected: *const kvg_expected_transfer,
    manifest: *const u8,
    manifest_len: usize,
    pages: *const *const u8,
    page_lens: *const usize,
    num_pages: usize,
    land: kvg_land_fn,
    user: *mut c_void,
    accepted: *mut kvg_accepted,
) -> kvg_status {
    with_table(table, |t| {
        let e = raw::read_sized(expected, "expected")?;
        let prompt = raw::tokens(raw::slice(e.prompt, e.prompt_len, "expected.prompt")?);
        let offered: Vec<PageRef> =
            raw::slice(e.pages, e.num_pages, "expected.pages")?.iter().map(|r| r.to_core()).collect();
        let bytes = raw::slice(manifest, manifest_len, "manifest")?;
        let buffers = page_buffers(pages, page_lens, num_pages)?;
        if !accepted.is_null() {
            raw::read_sized(accepted.cast_const(), "accepted")?;
        }
        let mut expect = ExpectedTransfer::for_prompt(
            RequestId(e.request),
            TenantId(e.tenant),
            prompt,
            &offered,
            e.page_size,
            e.slot_bytes,
        );
        if e.check_sender != 0 {
            expect = expect.from_sender(SenderId(e.sender));
        }
        let landed = Receiver::new(&t.table).accept(&expect, bytes, &buffers, |index, page, bytes| {
            let Some(land) = land else { return Ok(()) };
            // SAFETY: the caller's callback, called as its contract says: `bytes` is alive for
            // the call, `len` long.
            let status = unsafe { land(user, index, kvg_page_ref::from_core(page), bytes.as_ptr(), bytes.len()) };
            match status {
                0 => Ok(()),
                status => Err(format!("the land callback returned {status}").into()),
            }
        });
        let outcome = match landed {
            Ok(outcome) => outcome,
            Err(TransferError::Table(e)) if e.violation_kind().is_none() => return Err(Failure::Core(e)),
            Err(error) => {
                return Err(Failure::Refused { message: error.to_string(), violation: error.to_violation(&expect) });
            }
        };
        if accepted.is_null() {
            return Ok(());
        }
        let out = kvg_accepted {
            struct_size: kvg_accepted::MIN_SIZE,
            tokens: outcome.tokens(),
            pages: outcome.pages() as u64,
        };
        raw::write_sized(accepted, out, "accepted")
    })
}
