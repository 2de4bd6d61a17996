//! One decode-step verify and one request lifecycle, each run once, guarded and unguarded, for
//! instruction counting under callgrind (`scripts/instructions`): counts are repeatable run to
//! run where criterion's times are noisy. Each measured region is one `#[inline(never)]`
//! function whose name starts with `measured_`, so callgrind can count it alone.
//!
//! `cargo bench --bench instructions -- WORKLOAD` runs one of `decode_step/guarded`,
//! `decode_step/unguarded`, `lifecycle/guarded`, `lifecycle/unguarded`,
//! `lifecycle/guarded_tracked` (change tracking on, the changed device tags taken after each
//! request; `lifecycle/guarded_tracked_info`: taken as `PageInfo`s) (the shapes of
//! `benches/ownership.rs`: 256 sequences x 4,096 tokens at page size 16; one request of 256 pages
//! admitted, allocated, written through its slot mapping, read and released), and
//! `decode_grew/incremental` beside `decode_grew/full`: a decode step in which each of the 256
//! rows gained one token (4,095 to 4,096), read through the engine's block table (256 x 256
//! int32) by `verify_rows` with the rows' cache of the step before, and by a full `verify_step`;
//! `decode_grew/held`: the same rows held by the guard (`HeldBlockTable`), read by
//! `verify_held_rows` with their checks of the step before;
//! `decode_grew/engine_step` beside `decode_grew/separate`: the same step with its 4,096th token
//! written in it, through one `engine_step` (cache warm), and through `record_step_writes` of its
//! slot mapping and a full `verify_step`; `decode_forward/windows`: the same step through SGLang's
//! layout, a token-slot table (256 x 4,096 int32 slots), as one `decode_forward` that writes each
//! row's token and checks each row's window from its last checked token (4,095), and
//! `decode_forward/by_index` the same through `decode_forward_by`, its reads made from per-row
//! arrays as the core asks for them;
//! `decode_row_write/mirror`: SGLang's decode row write against its plugin's mirror of the pool
//! (`write_decode_rows`), 256 rows each writing its next slot, every 16th into a new page it
//! claims, the rest into pages they own; `decode_row_write/page1`: the same at page size 1,
//! where every row claims a new page each step; `slot_rows/cached` beside `slot_rows/full`:
//! SGLang's whole-row check (256 rows of 4,096 token slots, 64 tokens after the last one) through
//! a `SlotRowCache`, and by `verify_slot_rows` from token 0.

use kvguard::cuda::layout::DeviceTag;
use kvguard::step::{
    DecodeForward, DecodeOutcome, DecodeRowWrite, EngineStep, Events, PoolMirror, SlotRead, SlotRowCache,
};
use kvguard::{
    BlockRows, HeldBlockTable, OwnershipTable, PageId, PoolConfig, RequestId, RowCache, RowRead, SeqRead, SeqWrite,
    TenantId,
};
use std::hint::black_box;

#[path = "common/lifecycle.rs"]
mod common_lifecycle;
use common_lifecycle::{PAGES, PS, TOKENS, walk};

const SEQS: u32 = 256;

/// Out of line, so guarded and unguarded run the same machine code for the engine's own work, as
/// in `benches/ownership.rs`: inlined into the unguarded lifecycle, which has just pushed 256
/// pages, its bounds checks were hoisted: about 10,000 instructions a lifecycle fewer than the
/// same work in the guarded one, counted against kvguard.
#[inline(never)]
fn slot_mapping(block_table: &[PageId], tokens: u64, out: &mut Vec<u64>) {
    out.clear();
    out.extend(
        (0..tokens).map(|t| u64::from(block_table[(t / u64::from(PS)) as usize].0) * u64::from(PS) + t % u64::from(PS)),
    );
}

#[inline(never)]
fn measured_decode_step_guarded(table: &OwnershipTable, reads: &[SeqRead<'_>]) -> bool {
    table.verify_step(black_box(reads)).is_clean()
}

#[inline(never)]
fn measured_decode_step_unguarded(reads: &[SeqRead<'_>]) -> u64 {
    black_box(reads).iter().map(|r| walk(r.block_table)).sum()
}

fn decode_step(guarded: bool) {
    let table = OwnershipTable::new(PoolConfig::new(SEQS * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut tables = Vec::new();
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), TOKENS, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, PAGES).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..TOKENS).expect("write");
        tables.push((req, bt));
    }
    let reads: Vec<SeqRead<'_>> =
        tables.iter().map(|(req, bt)| SeqRead { request: *req, block_table: bt, tokens: TOKENS }).collect();
    if guarded {
        assert!(measured_decode_step_guarded(&table, &reads), "a clean step");
    } else {
        black_box(measured_decode_step_unguarded(&reads));
    }
}

#[inline(never)]
fn measured_decode_grew_incremental(
    table: &OwnershipTable,
    cache: &mut RowCache,
    rows: BlockRows<'_>,
    reads: &[RowRead],
) -> bool {
    table.verify_rows(cache, black_box(rows), black_box(reads)).expect("rows in range").is_clean()
}

#[inline(never)]
fn measured_decode_grew_held(table: &OwnershipTable, held: &mut HeldBlockTable, reads: &[RowRead]) -> bool {
    table.verify_held_rows(held, black_box(reads)).expect("rows in range").is_clean()
}

#[inline(never)]
fn measured_decode_engine_step(table: &OwnershipTable, cache: &mut RowCache, step: &EngineStep<'_>) -> bool {
    table.engine_step(cache, black_box(step)).expect("the step's shape").is_clean()
}

#[inline(never)]
fn measured_decode_separate(table: &OwnershipTable, writes: &[SeqWrite<'_>], reads: &[SeqRead<'_>]) -> bool {
    let written = table.record_step_writes(black_box(writes));
    let read = table.verify_step(black_box(reads));
    written.is_clean() && read.is_clean()
}

#[inline(never)]
fn measured_decode_forward(table: &OwnershipTable, step: &DecodeForward<'_>) -> bool {
    matches!(table.decode_forward(black_box(step)).expect("the step's shape"), DecodeOutcome::Clean)
}

#[inline(never)]
fn measured_decode_forward_by(
    table: &OwnershipTable,
    requests: &[u64],
    checked: &[i64],
    lens: &[i64],
    slots: &[i64],
    rows: BlockRows<'_>,
) -> bool {
    // As a binding reads an engine's arrays: row i is request i's, its read from its checked
    // length to its length.
    let read = |i: usize| SlotRead {
        request: RequestId(requests[i]),
        row: i as u32,
        from: checked[i] as u64,
        tokens: lens[i] as u64,
    };
    let outcome = table.decode_forward_by(requests.len(), read, black_box(slots), rows);
    matches!(outcome.expect("the step's shape"), DecodeOutcome::Clean)
}

/// `decode_grew`'s step in SGLang's layout: 256 rows of 4,096 token slots (`req_to_token`), 4,095
/// tokens written and checked, then one `decode_forward` writing each row's 4,096th token and
/// reading each row's window from token 4,095 (its last page); `by_index`: the same step through
/// `decode_forward_by`, its reads made from per-row arrays as the core asks for them.
fn decode_forward(by_index: bool) {
    let table = OwnershipTable::new(PoolConfig::new(SEQS * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut entries: Vec<i32> = Vec::with_capacity((SEQS as u64 * TOKENS) as usize);
    let mut slots = Vec::new();
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), TOKENS, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, PAGES).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..TOKENS - 1).expect("write");
        entries.extend(bt.iter().flat_map(|p| (0..PS).map(move |k| (p.0 * PS + k) as i32)));
        slots.push(*entries.last().expect("a row") as i64);
    }
    let rows = BlockRows::new(&entries, TOKENS as usize).expect("whole rows");
    if by_index {
        let requests: Vec<u64> = (0..u64::from(SEQS)).collect();
        let (checked, lens) = (vec![TOKENS as i64 - 1; SEQS as usize], vec![TOKENS as i64; SEQS as usize]);
        assert!(measured_decode_forward_by(&table, &requests, &checked, &lens, &slots, rows), "a clean step");
        return;
    }
    let reads: Vec<SlotRead> = (0..SEQS)
        .map(|s| SlotRead { request: RequestId(u64::from(s)), row: s, from: TOKENS - 1, tokens: TOKENS })
        .collect();
    assert!(measured_decode_forward(&table, &DecodeForward { reads: &reads, slots: &slots, rows }), "a clean step");
}

#[inline(never)]
fn measured_slot_rows(
    table: &OwnershipTable,
    cache: Option<&mut SlotRowCache>,
    rows: BlockRows<'_>,
    reads: &[RowRead],
) -> bool {
    let verdict = match cache {
        Some(cache) => table.verify_slot_rows_cached(cache, rows, black_box(reads)),
        None => {
            let whole: Vec<SlotRead> =
                reads.iter().map(|r| SlotRead { request: r.request, row: r.row, from: 0, tokens: r.tokens }).collect();
            table.verify_slot_rows(rows, black_box(&whole))
        }
    };
    verdict.expect("rows in range").is_clean()
}

/// SGLang's full checks of whole rows (each forced send's rows, every 64th forward) in its layout:
/// 256 rows of 4,096 token slots, checked clean at 4,032 tokens, then read again at 4,096 (64
/// tokens later, as the output check every 50): through a `SlotRowCache` (`cached`: each row
/// compared with its copy, its last 64 tokens judged) or in full (`verify_slot_rows` from 0).
fn slot_rows(cached: bool) {
    let table = OwnershipTable::new(PoolConfig::new(SEQS * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut entries: Vec<i32> = Vec::with_capacity((SEQS as u64 * TOKENS) as usize);
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), TOKENS, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, PAGES).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..TOKENS).expect("write");
        entries.extend(bt.iter().flat_map(|p| (0..PS).map(move |k| (p.0 * PS + k) as i32)));
    }
    let rows = BlockRows::new(&entries, TOKENS as usize).expect("whole rows");
    let at = |tokens| -> Vec<RowRead> {
        (0..SEQS).map(|s| RowRead { request: RequestId(u64::from(s)), row: s, tokens }).collect()
    };
    let mut cache = SlotRowCache::new();
    assert!(table.verify_slot_rows_cached(&mut cache, rows, &at(TOKENS - 64)).expect("rows").is_clean());
    assert!(measured_slot_rows(&table, cached.then_some(&mut cache), rows, &at(TOKENS)), "a clean check");
    if cached {
        assert_eq!(cache.incremental(), u64::from(SEQS), "every row judged from its last clean page");
    }
}

#[inline(never)]
fn measured_decode_row_write(
    table: &OwnershipTable,
    mirror: PoolMirror<'_>,
    owner: &mut [i64],
    checked: &mut [i64],
    write: DecodeRowWrite<'_>,
) -> bool {
    table.write_decode_rows(mirror, owner, checked, black_box(write)).expect("a well-formed write").is_clean()
}

/// SGLang's decode row write: 256 live rows, each owning two pages (the mirror says so), write
/// their next slot: rows `16k` into a fresh page (claimed), the others into their second page.
fn decode_row_write(ps: u32, claim_every: u32) {
    let pages = SEQS * 3 + 1;
    let table = OwnershipTable::new(PoolConfig::new(pages, ps, 3 * u64::from(ps)).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut owner = vec![0i64; pages as usize + 1];
    let (mut keys, mut slots, mut cols) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..SEQS {
        let req = RequestId(u64::from(s) + 1);
        table.admit(req, TenantId(u64::from(s % 8)), 2 * u64::from(ps), u64::from(ps)).expect("admit");
        let got = table.allocate(req, 2).expect("allocate");
        for r in &got {
            owner[r.page.0 as usize] = req.0 as i64;
        }
        keys.push(req.0 as i64);
        let fresh = s % claim_every == 0;
        let page = if fresh { SEQS * 2 + 1 + s / claim_every } else { got[1].page.0 };
        let offset = if fresh { 0 } else { 3 };
        slots.push(i64::from(page * ps + offset));
        cols.push(i64::from(ps + offset));
    }
    let claimants = vec![1i64; keys.len()];
    let prefix = vec![0i64; pages as usize + 1];
    let mut checked = cols.clone();
    let rows: Vec<u64> = (0..u64::from(SEQS)).collect();
    let mirror = PoolMirror::new(&keys[..], &claimants[..], &prefix[..], &owner[..], pages).expect("fits");
    let write = DecodeRowWrite { rows: &rows, cols: &cols[..], slots: &slots[..] };
    assert!(measured_decode_row_write(&table, mirror, &mut owner, &mut checked, write), "a clean write");
}

/// How a decode step is judged in `decode_grew`.
#[derive(Clone, Copy, PartialEq)]
enum Grew {
    /// The 4,096th token written beforehand (not counted); `verify_rows` with the warm cache.
    Incremental,
    /// The same, a full `verify_step`.
    Full,
    /// The same rows held by the guard (`HeldBlockTable`), `verify_held_rows` with their checks
    /// of the step before (`decode_grew/held`).
    Held,
    /// The write and the read in one `engine_step`, the cache warm (`decode_grew/engine_step`).
    EngineStep,
    /// The write as `record_step_writes` of the step's slot mapping and a full `verify_step`
    /// (`decode_grew/separate`): what `engine_step` stands for without its row cache.
    Separate,
}

/// 256 rows of 256 pages, 4,095 tokens written and checked (the step before, through the rows'
/// cache), then each row's 4,096th token written; the step reads 4,096 tokens a row,
/// incrementally or in full (or writes and reads it in one engine step, or in two full calls).
fn decode_grew(mode: Grew) {
    let table = OwnershipTable::new(PoolConfig::new(SEQS * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut entries: Vec<i32> = Vec::with_capacity((SEQS * PAGES) as usize);
    let mut tables = Vec::new();
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), TOKENS, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, PAGES).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..TOKENS - 1).expect("write");
        entries.extend(bt.iter().map(|p| p.0 as i32));
        tables.push((req, bt));
    }
    let rows = BlockRows::new(&entries, PAGES as usize).expect("whole rows");
    let at = |tokens| -> Vec<RowRead> {
        (0..SEQS).map(|s| RowRead { request: RequestId(u64::from(s)), row: s, tokens }).collect()
    };
    let mut cache = RowCache::new();
    assert!(table.verify_rows(&mut cache, rows, &at(TOKENS - 1)).expect("rows").is_clean());
    if mode == Grew::EngineStep {
        let requests: Vec<RequestId> = tables.iter().map(|(req, _)| *req).collect();
        let (computed, scheduled) = (vec![TOKENS - 1; SEQS as usize], vec![1; SEQS as usize]);
        let step = EngineStep {
            early: Events::none(),
            requests: &requests,
            rows,
            computed: (&computed).into(),
            scheduled: (&scheduled).into(),
            late: Events::none(),
        };
        assert!(measured_decode_engine_step(&table, &mut cache, &step), "a clean step");
        assert_eq!(cache.incremental(), u64::from(SEQS), "every row judged from its last page");
        return;
    }
    if mode == Grew::Separate {
        let slots: Vec<[i64; 1]> = tables
            .iter()
            .map(|(_, bt)| [i64::from(bt[PAGES as usize - 1].0) * i64::from(PS) + i64::from(PS) - 1])
            .collect();
        let writes: Vec<SeqWrite<'_>> =
            tables.iter().zip(&slots).map(|((req, _), s)| SeqWrite { request: *req, slots: s }).collect();
        let reads: Vec<SeqRead<'_>> =
            tables.iter().map(|(req, bt)| SeqRead { request: *req, block_table: bt, tokens: TOKENS }).collect();
        assert!(measured_decode_separate(&table, &writes, &reads), "a clean step");
        return;
    }
    for (req, bt) in &tables {
        table.record_write_tokens(*req, bt, TOKENS - 1..TOKENS).expect("write");
    }
    if mode == Grew::Held {
        let mut held = HeldBlockTable::new(SEQS as usize, PAGES as usize).expect("fits");
        for (s, row) in entries.chunks(PAGES as usize).enumerate() {
            held.append(s as u32, row).expect("fits");
        }
        // The step before, checked in full (the 4,096th token is written above, not read).
        assert!(table.verify_held_rows(&mut held, &at(TOKENS - 1)).expect("rows").is_clean());
        assert!(measured_decode_grew_held(&table, &mut held, &at(TOKENS)), "a clean step");
        assert_eq!(held.incremental(), u64::from(SEQS), "every row judged from its last page");
    } else if mode == Grew::Incremental {
        assert!(measured_decode_grew_incremental(&table, &mut cache, rows, &at(TOKENS)), "a clean step");
        assert_eq!(cache.incremental(), u64::from(SEQS), "every row judged from its last page");
    } else {
        let reads: Vec<SeqRead<'_>> =
            tables.iter().map(|(req, bt)| SeqRead { request: *req, block_table: bt, tokens: TOKENS }).collect();
        assert!(measured_decode_step_guarded(&table, &reads), "a clean step");
    }
}

/// One request's life: admitted, given its pages, written, read, released.
#[inline(always)]
fn one_request(table: &OwnershipTable, r: u64, bt: &mut Vec<PageId>, slots: &mut Vec<u64>) {
    common_lifecycle::one_request(table, r, bt, slots, slot_mapping);
}

#[inline(never)]
fn measured_lifecycle_guarded(table: &OwnershipTable, r: u64, bt: &mut Vec<PageId>, slots: &mut Vec<u64>) {
    one_request(table, r, bt, slots);
}

#[inline(never)]
fn measured_lifecycle_unguarded(free: &mut Vec<PageId>, bt: &mut Vec<PageId>, slots: &mut Vec<u64>) {
    bt.clear();
    for _ in 0..PAGES {
        bt.push(free.pop().expect("pool holds a request"));
    }
    slot_mapping(bt, TOKENS, slots);
    black_box(&slots);
    black_box(walk(bt));
    free.extend(bt.iter().rev());
}

#[inline(never)]
fn measured_lifecycle_guarded_tracked(
    table: &OwnershipTable,
    r: u64,
    bt: &mut Vec<PageId>,
    slots: &mut Vec<u64>,
    upload: &mut Vec<(u32, DeviceTag)>,
) {
    one_request(table, r, bt, slots);
    upload.clear();
    table.take_changed_tags_into(upload);
    black_box(upload);
}

#[inline(never)]
fn measured_lifecycle_guarded_tracked_info(table: &OwnershipTable, r: u64, bt: &mut Vec<PageId>, slots: &mut Vec<u64>) {
    one_request(table, r, bt, slots);
    black_box(table.take_changed_pages());
}

/// A lifecycle with a device mirror's change tracking on, the changed pages taken after it as
/// device tags (`info`: as `PageInfo`s, the older path).
fn lifecycle_tracked(info: bool) {
    let table =
        OwnershipTable::new(PoolConfig::new(2 * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)])).expect("fits");
    let (mut bt, mut slots, mut upload) = (Vec::new(), Vec::new(), Vec::new());
    table.take_changed_tags_into(&mut upload);
    for r in 0..5 {
        if info {
            measured_lifecycle_guarded_tracked_info(&table, r, &mut bt, &mut slots);
        } else {
            measured_lifecycle_guarded_tracked(&table, r, &mut bt, &mut slots, &mut upload);
        }
    }
}

fn lifecycle(guarded: bool) {
    let table =
        OwnershipTable::new(PoolConfig::new(2 * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)])).expect("fits");
    let mut bt: Vec<PageId> = Vec::with_capacity(PAGES as usize);
    let mut slots = Vec::with_capacity(TOKENS as usize);
    let mut free: Vec<PageId> = (1..=2 * PAGES).rev().map(PageId).collect();
    // A few requests first, so the counted one finds warm spare lists, as in steady state.
    for r in 0..4 {
        if guarded {
            measured_lifecycle_guarded(&table, r, &mut bt, &mut slots);
        } else {
            measured_lifecycle_unguarded(&mut free, &mut bt, &mut slots);
        }
    }
    if guarded {
        measured_lifecycle_guarded(&table, 4, &mut bt, &mut slots);
    } else {
        measured_lifecycle_unguarded(&mut free, &mut bt, &mut slots);
    }
}

#[path = "common/trace.rs"]
mod common_trace;

#[inline(never)]
fn measured_replay(text: &[u8]) -> u64 {
    kvguard::trace::Replayer::new().replay(black_box(text), |_| Ok(())).expect("a clean trace").events
}

/// 20,000 events of `benches/replay.rs`'s trace replayed (instructions per event = count / 20,000).
fn replay() {
    let (text, events) = common_trace::trace(20_000);
    assert_eq!(measured_replay(text.as_bytes()) as usize, events, "every event replayed");
}

fn main() {
    // cargo bench passes `--bench`; the workload is the one other argument.
    let workload = std::env::args().skip(1).find(|a| !a.starts_with("--")).unwrap_or_default();
    match workload.as_str() {
        "decode_step/guarded" => decode_step(true),
        "decode_step/unguarded" => decode_step(false),
        "decode_grew/incremental" => decode_grew(Grew::Incremental),
        "decode_grew/full" => decode_grew(Grew::Full),
        "decode_grew/held" => decode_grew(Grew::Held),
        "decode_grew/engine_step" => decode_grew(Grew::EngineStep),
        "decode_grew/separate" => decode_grew(Grew::Separate),
        "decode_forward/windows" => decode_forward(false),
        "decode_forward/by_index" => decode_forward(true),
        "decode_row_write/mirror" => decode_row_write(PS, 16),
        "slot_rows/cached" => slot_rows(true),
        "slot_rows/full" => slot_rows(false),
        "decode_row_write/page1" => decode_row_write(1, 1),
        "lifecycle/guarded" => lifecycle(true),
        "lifecycle/unguarded" => lifecycle(false),
        "lifecycle/guarded_tracked" => lifecycle_tracked(false),
        "lifecycle/guarded_tracked_info" => lifecycle_tracked(true),
        "replay/events" => replay(),
        _ => {
            eprintln!(
                "usage: instructions decode_step/guarded|decode_step/unguarded|decode_grew/incremental|decode_grew/full|decode_grew/engine_step|decode_grew/separate|decode_forward/windows|decode_forward/by_index|decode_row_write/mirror|slot_rows/cached|slot_rows/full|decode_row_write/page1|lifecycle/guarded|lifecycle/unguarded|lifecycle/guarded_tracked[_info]|replay/events"
            );
            std::process::exit(2);
        }
    }
}
