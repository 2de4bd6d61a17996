//! Trace replay throughput: `replay/events` streams a clean, realistic v1 trace (32 interleaved
//! requests of three tenants: prefill, decode steps of one write and one read each, frees) through
//! a `Replayer`, counting events per second.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvguard::trace::Replayer;
use std::hint::black_box;

#[path = "common/trace.rs"]
mod common_trace;
use common_trace::trace;

fn replay(c: &mut Criterion) {
    let (text, events) = trace(200_000);
    // The trace must be clean, or the benchmark measures error paths.
    let summary = Replayer::new().replay(text.as_bytes(), |_| Ok(())).expect("well formed");
    assert_eq!((summary.events as usize, summary.violations), (events, 0));
    let mut group = c.benchmark_group("replay");
    group.throughput(Throughput::Elements(events as u64));
    group.sample_size(10);
    group.bench_function("events", |b| {
        b.iter(|| {
            let summary = Replayer::new().replay(black_box(text.as_bytes()), |_| Ok(())).expect("well formed");
            black_box(summary.events)
        })
    });
    group.finish();
}

criterion_group!(benches, replay);
criterion_main!(benches);
