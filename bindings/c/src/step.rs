//! Reads and writes as engines hold them: one request's block table, or a whole step's block
//! tables as one `int32` matrix with a row stride (TensorRT-LLM's block offsets, llama.cpp's
//! per-sequence cells), and a step's writes as a slot mapping with per-request token boundaries.
//! One call per step; the block tables are read in place, never copied.

use crate::raw;
use crate::status::{Failure, kvg_status};
use crate::table::{Table, kvg_table, with_table};
use crate::types::kvg_page_ref;
use kvguard::{PageRef, RequestId, SeqClaim, SeqRead, SeqWrite, StepVerdict};

/// The rows of a step's block-table matrix, each with its request and token count.
fn step_reads<'a>(
    rows: usize,
    request_ids: *const u64,
    block_tables: *const i32,
    row_stride: usize,
    max_blocks: usize,
    seq_lens: *const i32,
) -> Result<Vec<SeqRead<'a>>, Failure> {
    if rows == 0 {
        return Ok(Vec::new());
    }
    if rows > 1 && row_stride < max_blocks {
        return Err(Failure::invalid(format!(
            "row_stride {row_stride} is below max_blocks {max_blocks}: rows overlap"
        )));
    }
    let extent = (rows - 1)
        .checked_mul(row_stride)
        .and_then(|n| n.checked_add(max_blocks))
        .ok_or_else(|| Failure::invalid(format!("{rows} rows of stride {row_stride} overflow")))?;
    let requests = raw::slice(request_ids, rows, "request_ids")?;
    let lens = raw::slice(seq_lens, rows, "seq_lens")?;
    let matrix = raw::pages(raw::slice(block_tables, extent, "block_tables")?);
    if let Some(row) = raw::first_negative(lens) {
        return Err(Failure::invalid(format!("seq_lens[{row}] is {}: a token count is not negative", lens[row])));
    }
    Ok((0..rows)
        .map(|r| SeqRead {
            request: RequestId(requests[r]),
            block_table: &matrix[r * row_stride..r * row_stride + max_blocks],
            tokens: lens[r] as u64,
        })
        .collect())
}

/// Writes the per-row refusal mask (when wanted) and turns refused rows into the call's failure.
pub(crate) fn verdict(verdict: StepVerdict, rows: usize, refused: &mut [u8]) -> Result<(), Failure> {
    if !refused.is_empty() {
        refused.fill(0);
        for (row, _) in &verdict.refused {
            refused[*row] = 1;
        }
    }
    if verdict.is_clean() { Ok(()) } else { Err(Failure::Step { refused: verdict.refused, rows }) }
}

/// The optional refusal mask: NULL, or `rows` writable bytes.
pub(crate) fn mask<'a>(refused: *mut u8, rows: usize) -> Result<&'a mut [u8], Failure> {
    if refused.is_null() { Ok(&mut []) } else { raw::slice_mut(refused, rows, "refused") }
}

#[allow(clippy::too_many_arguments)]
fn step(
    table: *const kvg_table,
    rows: usize,
    request_ids: *const u64,
    block_tables: *const i32,
    row_stride: usize,
    max_blocks: usize,
    seq_lens: *const i32,
    refused: *mut u8,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let reads = step_reads(rows, request_ids, block_tables, row_stride, max_blocks, seq_lens)?;
        judge_reads(t, &reads, refused, judged)
    })
}

/// A step's reads checked (`judged`: verified), the refusal mask filled, refused rows the failure.
fn judge_reads(t: &Table, reads: &[SeqRead<'_>], refused: *mut u8, judged: bool) -> Result<(), Failure> {
    let refused = mask(refused, reads.len())?;
    let v = if judged { t.table.verify_step(reads) } else { t.table.check_step(reads) };
    verdict(v, reads.len(), refused)
}

/// Verifies a decode step's reads, judged: row `r` is request `request_ids[r]` reading its first
/// `seq_lens[r]` tokens through the `max_blocks` page ids at `block_tables + r * row_stride`
/// (entries past the tokens read are not looked at, so padding there is fine). A refused row is
/// counted, logged and (enforce) its request quarantined; the others may run.
///
/// Returns `KVG_STATUS_OK` when every row may read, `KVG_STATUS_VIOLATION` when some may not:
/// `refused` (NULL, or `rows` bytes) gets 1 for each refused row and 0 for the others, and
/// `kvg_last_violation(i, ...)` gives each refused row's violation (its `row` field set).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `request_ids` and `seq_lens` hold `rows` entries; `block_tables`
/// holds `(rows - 1) * row_stride + max_blocks` entries; `refused` is NULL or has `rows` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_verify_step(
    table: *mut kvg_table,
    rows: usize,
    request_ids: *const u64,
    block_tables: *const i32,
    row_stride: usize,
    max_blocks: usize,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    step(table, rows, request_ids, block_tables, row_stride, max_blocks, seq_lens, refused, true)
}

/// `kvg_verify_step`, pure: the same verdict, and nothing counted, logged or quarantined.
///
/// # Safety
/// As for `kvg_verify_step`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_check_step(
    table: *const kvg_table,
    rows: usize,
    request_ids: *const u64,
    block_tables: *const i32,
    row_stride: usize,
    max_blocks: usize,
    seq_lens: *const i32,
    refused: *mut u8,
) -> kvg_status {
    step(table, rows, request_ids, block_tables, row_stride, max_blocks, seq_lens, refused, false)
}

/// The entries that CSR offsets `indptr` span: they must not decrease, and start at 0 or above.
fn csr_total(indptr: &[i32], name: &str) -> Result<usize, Failure> {
    if let Some(s) = indptr.windows(2).position(|w| w[0] < 0 || w[1] < w[0]) {
        return Err(Failure::invalid(format!(
            "{name}[{s}..={}] is {}..{}: not non-decreasing offsets from 0 on",
            s + 1,
            indptr[s],
            indptr[s + 1]
        )));
    }
    // Non-negative: every offset is at least the first, which is.
    Ok(indptr.last().map_or(0, |&n| n as usize))
}

/// A step's reads in FlashInfer's paged-KV (CSR) form: sequence `s` reads the pages
/// `kv_indices[kv_indptr[s] .. kv_indptr[s + 1]]`, the last of them up to `kv_last_page_len[s]`
/// tokens.
fn csr_reads<'a>(
    num_seqs: usize,
    request_ids: *const u64,
    kv_indptr: *const i32,
    kv_indices: *const i32,
    kv_last_page_len: *const i32,
    page_size: u32,
) -> Result<Vec<SeqRead<'a>>, Failure> {
    if num_seqs == 0 {
        return Ok(Vec::new());
    }
    let requests = raw::slice(request_ids, num_seqs, "request_ids")?;
    let bounds_len = num_seqs.checked_add(1).ok_or_else(|| Failure::invalid("num_seqs overflows".to_string()))?;
    let indptr = raw::slice(kv_indptr, bounds_len, "kv_indptr")?;
    let last = raw::slice(kv_last_page_len, num_seqs, "kv_last_page_len")?;
    let total = csr_total(indptr, "kv_indptr")?;
    if let Some(s) = raw::first_negative(last) {
        return Err(Failure::invalid(format!("kv_last_page_len[{s}] is {}: a token count is not negative", last[s])));
    }
    let indices = raw::pages(raw::slice(kv_indices, total, "kv_indices")?);
    let ps = u64::from(page_size);
    Ok((0..num_seqs)
        .map(|s| {
            let (a, b) = (indptr[s] as usize, indptr[s + 1] as usize);
            let pages = (b - a) as u64;
            let tokens = if pages == 0 { 0 } else { (pages - 1) * ps + last[s] as u64 };
            SeqRead { request: RequestId(requests[s]), block_table: &indices[a..b], tokens }
        })
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn step_csr(
    table: *const kvg_table,
    num_seqs: usize,
    request_ids: *const u64,
    kv_indptr: *const i32,
    kv_indices: *const i32,
    kv_last_page_len: *const i32,
    refused: *mut u8,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let ps = t.table.page_size();
        let reads = csr_reads(num_seqs, request_ids, kv_indptr, kv_indices, kv_last_page_len, ps)?;
        judge_reads(t, &reads, refused, judged)
    })
}

/// [`kvg_verify_step`] for a step's block tables in FlashInfer's paged-KV form (SGLang's and
/// FlashInfer's `kv_indptr` / `kv_indices` / `kv_last_page_len`, all `int32`): sequence `s` is
/// request `request_ids[s]` reading the pages `kv_indices[kv_indptr[s] .. kv_indptr[s + 1]]`, all
/// of them whole but the last, of which it reads `kv_last_page_len[s]` tokens (a sequence with no
/// pages reads nothing). The arrays are read in place. `kv_indptr` must hold `num_seqs + 1`
/// non-decreasing offsets from 0 on and `kv_last_page_len` no negative count
/// (`KVG_STATUS_INVALID_ARGUMENT`); a last-page count past the page size reads past the
/// sequence's pages and is refused as `block_table_too_short`.
///
/// Returns and fills `refused` (NULL, or `num_seqs` bytes) as `kvg_verify_step` does.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `request_ids` and `kv_last_page_len` hold `num_seqs` entries,
/// `kv_indptr` `num_seqs + 1`, `kv_indices` `kv_indptr[num_seqs]`; `refused` is NULL or has
/// `num_seqs` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_verify_step_csr(
    table: *mut kvg_table,
    num_seqs: usize,
    request_ids: *const u64,
    kv_indptr: *const i32,
    kv_indices: *const i32,
    kv_last_page_len: *const i32,
    refused: *mut u8,
) -> kvg_status {
    step_csr(table, num_seqs, request_ids, kv_indptr, kv_indices, kv_last_page_len, refused, true)
}

/// `kvg_verify_step_csr`, pure: the same verdict, and nothing counted, logged or quarantined.
///
/// # Safety
/// As for `kvg_verify_step_csr`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_check_step_csr(
    table: *const kvg_table,
    num_seqs: usize,
    request_ids: *const u64,
    kv_indptr: *const i32,
    kv_indices: *const i32,
    kv_last_page_len: *const i32,
    refused: *mut u8,
) -> kvg_status {
    step_csr(table, num_seqs, request_ids, kv_indptr, kv_indices, kv_last_page_len, refused, false)
}

/// Claims a step's newly opened pages in one call (shadow mode: the engine's allocator picked
/// them), as that many `kvg_claim` calls in a row would judge them, under one lock: sequence `s`
/// is request `request_ids[s]` claiming the pages `pages[indptr[s] .. indptr[s + 1]]`. Each
/// sequence is all or nothing; a refused claim (a page not free, reserved or out of range) is
/// judged, counted, logged and (enforce) its request quarantined, the others are claimed.
/// `indptr` must hold `num_seqs + 1` non-decreasing offsets from 0 on
/// (`KVG_STATUS_INVALID_ARGUMENT`, nothing claimed).
///
/// Returns `KVG_STATUS_OK` when every claim held, `KVG_STATUS_VIOLATION` when some did not:
/// `refused` (NULL, or `num_seqs` bytes) gets 1 for each refused sequence, and
/// `kvg_last_violation(i, ...)` gives each one's violation (its `row` field set).
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `request_ids` holds `num_seqs` entries, `indptr` `num_seqs + 1`,
/// `pages` `indptr[num_seqs]`; `refused` is NULL or has `num_seqs` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_claim_step(
    table: *mut kvg_table,
    num_seqs: usize,
    request_ids: *const u64,
    pages: *const i32,
    indptr: *const i32,
    refused: *mut u8,
) -> kvg_status {
    with_table(table, |t| {
        if num_seqs == 0 {
            return Ok(());
        }
        let requests = raw::slice(request_ids, num_seqs, "request_ids")?;
        let bounds_len = num_seqs.checked_add(1).ok_or_else(|| Failure::invalid("num_seqs overflows".to_string()))?;
        let indptr = raw::slice(indptr, bounds_len, "indptr")?;
        let total = csr_total(indptr, "indptr")?;
        let pages = raw::pages(raw::slice(pages, total, "pages")?);
        let refused = mask(refused, num_seqs)?;
        let claims: Vec<SeqClaim<'_>> = requests
            .iter()
            .zip(indptr.windows(2))
            .map(|(&r, w)| SeqClaim { request: RequestId(r), pages: &pages[w[0] as usize..w[1] as usize] })
            .collect();
        verdict(t.table.claim_step(&claims), num_seqs, refused)
    })
}

/// Records a step's KV writes in one call, as the engine's slot mapping gives them: sequence `s`
/// is request `request_ids[s]` writing `slot_mapping[query_start_loc[s] .. query_start_loc[s+1]]`,
/// one entry per token, `page * page_size + offset`, -1 for padding (vLLM's `slot_mapping` and
/// `query_start_loc`). Entries past `query_start_loc[num_seqs]` are ignored.
///
/// Each sequence is all or nothing: one writing a page that is not its own is refused, nothing of
/// it recorded (`refused[s]` = 1, `KVG_STATUS_VIOLATION`); the others are recorded.
/// `query_start_loc` must hold `num_seqs + 1` non-decreasing offsets within `num_slots`.
///
/// # Safety
/// `table` is any value (never dereferenced);
/// `request_ids` holds `num_seqs` entries, `query_start_loc`
/// `num_seqs + 1`, `slot_mapping` `num_slots`; `refused` is NULL or has `num_seqs` bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_record_step_writes(
    table: *mut kvg_table,
    num_seqs: usize,
    request_ids: *const u64,
    slot_mapping: *const i64,
    num_slots: usize,
    query_start_loc: *const i32,
    refused: *mut u8,
) -> kvg_status {
    with_table(table, |t| {
        let requests = raw::slice(request_ids, num_seqs, "request_ids")?;
        let bounds_len = num_seqs.checked_add(1).ok_or_else(|| Failure::invalid("num_seqs overflows".to_string()))?;
        let bounds = raw::slice(query_start_loc, bounds_len, "query_start_loc")?;
        let slots = raw::slice(slot_mapping, num_slots, "slot_mapping")?;
        let refused = mask(refused, num_seqs)?;
        let mut writes = Vec::with_capacity(num_seqs);
        for (s, pair) in bounds.windows(2).enumerate() {
            let (start, end) = (pair[0], pair[1]);
            if start < 0 || end < start || end as usize > num_slots {
                return Err(Failure::invalid(format!(
                    "query_start_loc[{s}..={}] is {start}..{end}: not non-decreasing within the {num_slots} slots",
                    s + 1
                )));
            }
            writes.push(SeqWrite { request: RequestId(requests[s]), slots: &slots[start as usize..end as usize] });
        }
        verdict(t.table.record_step_writes(&writes), num_seqs, refused)
    })
}

fn read(
    table: *const kvg_table,
    request: u64,
    block_table: *const i32,
    num_blocks: usize,
    tokens: u64,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let bt = raw::pages(raw::slice(block_table, num_blocks, "block_table")?);
        let req = RequestId(request);
        if judged {
            Ok(t.table.verify_read(req, bt, tokens)?)
        } else {
            Ok(t.table.check_read(req, bt, tokens).map_err(kvguard::Error::from)?)
        }
    })
}

fn read_refs(
    table: *const kvg_table,
    request: u64,
    refs: *const kvg_page_ref,
    num_refs: usize,
    tokens: u64,
    judged: bool,
) -> kvg_status {
    with_table(table, |t| {
        let refs: Vec<PageRef> = raw::slice(refs, num_refs, "block_table")?.iter().map(|r| r.to_core()).collect();
        let req = RequestId(request);
        if judged {
            Ok(t.table.verify_read_refs(req, &refs, tokens)?)
        } else {
            Ok(t.table.check_read_refs(req, &refs, tokens).map_err(kvguard::Error::from)?)
        }
    })
}

/// Whether `request` may read its first `tokens` tokens through `block_table`: every page its own
/// (or a prefix it holds), every slot read written by the page's current incarnation. Judged: a
/// violation is counted, logged and (enforce) refused with the request quarantined.
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_verify_read(
    table: *mut kvg_table,
    request: u64,
    block_table: *const i32,
    num_blocks: usize,
    tokens: u64,
) -> kvg_status {
    read(table, request, block_table, num_blocks, tokens, true)
}

/// `kvg_verify_read`, pure: the same verdict, nothing counted, logged or quarantined.
///
/// # Safety
/// As for `kvg_verify_read`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_check_read(
    table: *const kvg_table,
    request: u64,
    block_table: *const i32,
    num_blocks: usize,
    tokens: u64,
) -> kvg_status {
    read(table, request, block_table, num_blocks, tokens, false)
}

/// `kvg_verify_read` through page refs: a page no longer in the incarnation named is also
/// refused (`stale_page`).
///
/// # Safety
/// `table` is any value (never dereferenced); `block_table` holds `num_blocks` refs.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_verify_read_refs(
    table: *mut kvg_table,
    request: u64,
    block_table: *const kvg_page_ref,
    num_blocks: usize,
    tokens: u64,
) -> kvg_status {
    read_refs(table, request, block_table, num_blocks, tokens, true)
}

/// `kvg_verify_read_refs`, pure.
///
/// # Safety
/// As for `kvg_verify_read_refs`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvg_check_read_refs(
    table: *const kvg_table,
    request: u64,
    block_table: *const kvg_page_ref,
    num_blocks: usize,
    tokens: u64,
) -> kvg_status {
    read_refs(table, request, block_table, num_blocks, tokens, false)
}
