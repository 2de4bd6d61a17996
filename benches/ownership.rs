//! The ownership table's cost beside what an engine does without it, measured in the same run.
//!
//! - `verify/{guarded,unguarded}/N`: one request reads N full pages. Unguarded walks the block
//!   table computing each page's slot base (what attention's address math does); guarded runs
//!   `verify_read` first. Throughput is per page.
//! - `decode_step/guarded`: `verify_step` over 256 sequences x 4,096 tokens at page size 16;
//!   `decode_step/guarded_2_threads`: the same step through `verify_step_parallel` on 2 threads;
//!   `decode_step/rows_incremental`: the same reads through the engine's block table (256 x 256
//!   int32) by `verify_rows`, each row unchanged since the step before (its rows' cache warm).
//! - `decode_step/writes`: `record_step_writes` of one decode step, 256 sequences of one token.
//! - `lifecycle/{guarded,unguarded}`: 1,000 requests each admitted, given 256 pages, written
//!   (slot mapping for 4,096 tokens), read and released. Unguarded is a plain free list.
//!   `lifecycle/guarded_tracked` is guarded with a device mirror's change tracking on, the
//!   changed pages taken after every request as the device tags a mirror uploads
//!   (`take_changed_tags_into`, what `DeviceGuard::sync_tags` needs).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvguard::cuda::layout::DeviceTag;
use kvguard::{
    BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, RowCache, RowRead, SeqRead, SeqWrite, TenantId,
};
use std::hint::black_box;

#[path = "common/lifecycle.rs"]
mod common_lifecycle;
use common_lifecycle::{PAGES, PS, TOKENS, walk};

/// What an engine does to store a request's KV: a slot mapping from tokens to cache slots.
fn slot_mapping(block_table: &[PageId], tokens: u64, out: &mut Vec<u64>) {
    out.clear();
    out.extend(
        (0..tokens).map(|t| u64::from(block_table[(t / u64::from(PS)) as usize].0) * u64::from(PS) + t % u64::from(PS)),
    );
}

fn verify(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify");
    for &pages in &[16u32, 1024, 65_536] {
        let table = OwnershipTable::new(
            PoolConfig::new(pages + 1, PS, u64::from(pages) * u64::from(PS)).with_reserved([PageId(0)]),
        )
        .expect("pool fits");
        let req = RequestId(1);
        let tokens = u64::from(pages) * u64::from(PS);
        table.admit(req, TenantId(1), tokens, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, pages).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..tokens).expect("write");
        group.throughput(Throughput::Elements(u64::from(pages)));
        group.bench_with_input(BenchmarkId::new("guarded", pages), &bt, |b, bt| {
            b.iter(|| {
                table.verify_read(req, black_box(bt), tokens).expect("clean read");
                black_box(walk(bt))
            })
        });
        group.bench_with_input(BenchmarkId::new("unguarded", pages), &bt, |b, bt| {
            b.iter(|| black_box(walk(black_box(bt))))
        });
    }
    group.finish();
}

fn decode_step(c: &mut Criterion) {
    const SEQS: u32 = 256;
    const TOKENS: u64 = 4096;
    let per_seq = (TOKENS / u64::from(PS)) as u32;
    let table = OwnershipTable::new(PoolConfig::new(SEQS * per_seq + 1, PS, TOKENS).with_reserved([PageId(0)]))
        .expect("pool fits");
    let mut tables = Vec::new();
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), TOKENS, 0).expect("admit");
        let bt: Vec<PageId> = table.allocate(req, per_seq).expect("allocate").iter().map(|r| r.page).collect();
        table.record_write_tokens(req, &bt, 0..TOKENS).expect("write");
        tables.push((req, bt));
    }
    let reads: Vec<SeqRead<'_>> =
        tables.iter().map(|(req, bt)| SeqRead { request: *req, block_table: bt, tokens: TOKENS }).collect();
    let mut group = c.benchmark_group("decode_step");
    group.throughput(Throughput::Elements(u64::from(SEQS * per_seq)));
    group.bench_function("guarded", |b| {
        b.iter(|| {
            let verdict = table.verify_step(black_box(&reads));
            assert!(verdict.is_clean());
        })
    });
    let two = std::num::NonZeroUsize::new(2).expect("2 is not zero");
    group.bench_function("guarded_2_threads", |b| {
        b.iter(|| {
            let verdict = table.verify_step_parallel(black_box(&reads), two);
            assert!(verdict.is_clean());
        })
    });
    let entries: Vec<i32> = tables.iter().flat_map(|(_, bt)| bt.iter().map(|p| p.0 as i32)).collect();
    let rows = BlockRows::new(&entries, per_seq as usize).expect("whole rows");
    let row_reads: Vec<RowRead> =
        (0..SEQS).map(|s| RowRead { request: RequestId(u64::from(s)), row: s, tokens: TOKENS }).collect();
    let mut cache = RowCache::new();
    group.bench_function("rows_incremental", |b| {
        b.iter(|| {
            let verdict = table.verify_rows(&mut cache, rows, black_box(&row_reads)).expect("rows in range");
            assert!(verdict.is_clean());
        })
    });
    assert!(cache.incremental() > cache.full(), "the rows were judged from their last page");
    group.bench_function("unguarded", |b| b.iter(|| black_box(reads.iter().map(|r| walk(r.block_table)).sum::<u64>())));
    group.finish();
}

/// `decode_step/writes`: one decode step's KV writes through the slot mapping, 256 sequences of
/// one token each (the Python binding's `record_step_writes` is measured against this).
fn decode_step_writes(c: &mut Criterion) {
    const SEQS: u32 = 256;
    let table =
        OwnershipTable::new(PoolConfig::new(SEQS * 256 + 1, PS, 4096).with_reserved([PageId(0)])).expect("pool fits");
    let mut slots = Vec::new();
    for s in 0..SEQS {
        let req = RequestId(u64::from(s));
        table.admit(req, TenantId(u64::from(s % 8)), 4096, 0).expect("admit");
        let page = table.allocate(req, 1).expect("allocate")[0].page;
        slots.push(i64::from(page.0) * i64::from(PS) + 3);
    }
    let writes: Vec<SeqWrite<'_>> =
        (0..SEQS as usize).map(|s| SeqWrite { request: RequestId(s as u64), slots: &slots[s..s + 1] }).collect();
    let mut group = c.benchmark_group("decode_step");
    group.throughput(Throughput::Elements(u64::from(SEQS)));
    group.bench_function("writes", |b| b.iter(|| assert!(table.record_step_writes(black_box(&writes)).is_clean())));
    group.finish();
}

/// One request's life in `lifecycle/guarded`: admitted, given its pages, written, read, released.
#[inline(always)]
fn one_request(table: &OwnershipTable, r: u64, bt: &mut Vec<PageId>, slots: &mut Vec<u64>) {
    common_lifecycle::one_request(table, r, bt, slots, slot_mapping);
}

fn lifecycle(c: &mut Criterion) {
    const REQUESTS: u64 = 1000;
    let mut group = c.benchmark_group("lifecycle");
    group.throughput(Throughput::Elements(REQUESTS));
    let table =
        OwnershipTable::new(PoolConfig::new(2 * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)])).expect("fits");
    let mut bt: Vec<PageId> = Vec::with_capacity(PAGES as usize);
    let mut slots = Vec::with_capacity(TOKENS as usize);
    group.bench_function("guarded", |b| {
        b.iter(|| {
            for r in 0..REQUESTS {
                one_request(&table, r, &mut bt, &mut slots);
            }
        })
    });
    // The same with a device mirror's change tracking on: the changed pages are taken after
    // every request, as a mirror syncing once per step would.
    let tracked =
        OwnershipTable::new(PoolConfig::new(2 * PAGES + 1, PS, TOKENS).with_reserved([PageId(0)])).expect("fits");
    let mut upload: Vec<(u32, DeviceTag)> = Vec::new();
    tracked.take_changed_tags_into(&mut upload);
    group.bench_function("guarded_tracked", |b| {
        b.iter(|| {
            for r in 0..REQUESTS {
                one_request(&tracked, r, &mut bt, &mut slots);
                upload.clear();
                tracked.take_changed_tags_into(&mut upload);
                black_box(&upload);
            }
        })
    });
    let mut free: Vec<PageId> = (1..=2 * PAGES).rev().map(PageId).collect();
    group.bench_function("unguarded", |b| {
        b.iter(|| {
            for _ in 0..REQUESTS {
                bt.clear();
                for _ in 0..PAGES {
                    bt.push(free.pop().expect("pool holds a request"));
                }
                slot_mapping(&bt, TOKENS, &mut slots);
                black_box(&slots);
                black_box(walk(&bt));
                free.extend(bt.iter().rev());
            }
        })
    });
    group.finish();
}

criterion_group!(benches, verify, decode_step, decode_step_writes, lifecycle);
criterion_main!(benches);
