//! What the C ABI costs over the Rust call, measured in the same run on identical tables:
//! - `verify_step/{rust,c_abi}/65536`: a decode step of 256 sequences x 4,096 tokens at page size
//!   16 (256 x 256 int32 block table, 65,536 pages, all clean), as `decode_step/guarded` in the
//!   core's benches; the C call takes the engine's int32 matrix with its row stride.
//! - `verify_step/{rust,c_abi}/16`: one sequence of 16 pages: the call's fixed cost.
//! - `verify_rows/{rust,c_abi}/65536`: the same step read through the block table by
//!   `verify_rows` / `kvg_verify_rows`, each with its row cache warm (rows unchanged since the
//!   step before: judged from their last page).
//! - `held_rows/{rust,c_abi}/65536`: the same rows held by the guard (`HeldBlockTable` /
//!   `kvg_held_rows`) through `verify_held_rows` / `kvg_verify_held_rows`, each warm.
//! - `engine_step/{rust,c_abi}/65536`: the same step through the one-call engine step
//!   (`engine_step` / `kvg_engine_step`: no events, no tokens written, every row read).
//! - `decode_forward/{rust,c_abi}/65536`: the same rows in SGLang's layout (token slots, 256 x
//!   4,096 int32) through one decode forward (`decode_forward` / `kvg_decode_forward`: each row's
//!   last slot written, its window from the token before read).
//!
//! `examples/overhead_count.rs` gives the same comparison in instructions (callgrind).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
mod fixture;
use fixture::Fixture;
use kvguard::{BlockRows, HeldBlockTable, RowCache};
use std::hint::black_box;

fn verify_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify_step");
    for (rows, blocks) in [(256usize, 256usize), (1, 16)] {
        let f = Fixture::new(rows, blocks);
        let pages = (rows * blocks) as u64;
        group.throughput(Throughput::Elements(pages));
        group.bench_function(BenchmarkId::new("rust", pages), |b| {
            let reads = f.reads();
            b.iter(|| assert!(f.table.verify_step(black_box(&reads)).is_clean()))
        });
        group.bench_function(BenchmarkId::new("c_abi", pages), |b| {
            b.iter(|| assert!(f.verify_step_c(black_box(&f.matrix))))
        });
    }
    group.finish();
}

fn verify_rows(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify_rows");
    let f = Fixture::new(256, 256);
    group.throughput(Throughput::Elements(256 * 256));
    group.bench_function(BenchmarkId::new("rust", 256 * 256), |b| {
        let reads = f.row_reads();
        let mut cache = RowCache::new();
        b.iter(|| {
            let rows = BlockRows::new(black_box(&f.matrix), f.blocks()).expect("whole rows");
            assert!(f.table.verify_rows(&mut cache, rows, &reads).expect("rows in range").is_clean())
        })
    });
    group.bench_function(BenchmarkId::new("c_abi", 256 * 256), |b| {
        b.iter(|| assert!(f.verify_rows_c(black_box(&f.matrix))))
    });
    group.finish();
}

fn held_rows(c: &mut Criterion) {
    let mut group = c.benchmark_group("held_rows");
    let f = Fixture::new(256, 256);
    group.throughput(Throughput::Elements(256 * 256));
    group.bench_function(BenchmarkId::new("rust", 256 * 256), |b| {
        let reads = f.row_reads();
        let mut held = HeldBlockTable::new(256, f.blocks()).expect("fits");
        for (r, row) in f.matrix.chunks(f.blocks()).enumerate() {
            held.append(r as u32, row).expect("fits");
        }
        b.iter(|| assert!(f.table.verify_held_rows(&mut held, black_box(&reads)).expect("rows in range").is_clean()))
    });
    group.bench_function(BenchmarkId::new("c_abi", 256 * 256), |b| b.iter(|| assert!(f.verify_held_rows_c())));
    group.finish();
}

fn engine_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_step");
    let f = Fixture::new(256, 256);
    let computed = f.tokens();
    let scheduled = vec![0u64; computed.len()];
    group.throughput(Throughput::Elements(256 * 256));
    group.bench_function(BenchmarkId::new("rust", 256 * 256), |b| {
        let mut cache = RowCache::new();
        b.iter(|| assert!(f.engine_step_rust(&mut cache, black_box(&f.matrix), &computed, &scheduled)))
    });
    group.bench_function(BenchmarkId::new("c_abi", 256 * 256), |b| {
        b.iter(|| assert!(f.engine_step_c(black_box(&f.matrix), &computed, &scheduled)))
    });
    group.finish();
}

fn decode_forward(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_forward");
    let f = Fixture::new(256, 256);
    let (table, slots) = f.token_slots();
    group.throughput(Throughput::Elements(256 * 256));
    group.bench_function(BenchmarkId::new("rust", 256 * 256), |b| {
        b.iter(|| assert!(f.decode_forward_rust(black_box(&table), &slots)))
    });
    group.bench_function(BenchmarkId::new("c_abi", 256 * 256), |b| {
        b.iter(|| assert!(f.decode_forward_c(black_box(&table), &slots)))
    });
    group.finish();
}

criterion_group!(benches, verify_step, verify_rows, held_rows, engine_step, decode_forward);
criterion_main!(benches);
