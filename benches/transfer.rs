//! What the receiver's manifest check costs beside copying the same bytes:
//! `transfer/verify/{64KiB,2MiB}` (every check of [`kvguard::transfer::verify`], dominated by
//! the page CRC32) against `transfer/memcpy/{64KiB,2MiB}` (copying the page once).

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use kvguard::transfer::{ExpectedTransfer, Manifest, SenderId, TransferHeader, verify};
use kvguard::{Generation, PageId, PageRef, RequestId, TenantId};

const PAGE_SIZE: u32 = 64;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("transfer");
    for (label, bytes) in [("64KiB", 64usize << 10), ("2MiB", 2usize << 20)] {
        let slot_bytes = (bytes / PAGE_SIZE as usize) as u32;
        let page: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
        let prompt: Vec<u32> = (0..PAGE_SIZE).collect();
        let dest = [PageRef { page: PageId(7), generation: Generation(3) }];
        let header = TransferHeader {
            request: RequestId(1),
            tenant: TenantId(1),
            sender: SenderId(1),
            page_size: PAGE_SIZE,
            slot_bytes,
        };
        let pages = [page.as_slice()];
        let manifest = Manifest::build(header, &prompt, &dest, &pages).expect("a consistent page");
        let expected = ExpectedTransfer::for_prompt(RequestId(1), TenantId(1), &prompt, &dest, PAGE_SIZE, slot_bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("verify", label), &pages, |b, pages| {
            b.iter(|| verify(black_box(&expected), black_box(&manifest), black_box(pages)).is_ok())
        });
        let mut dst = vec![0u8; bytes];
        group.bench_with_input(BenchmarkId::new("memcpy", label), &page, |b, page| {
            b.iter(|| {
                dst.copy_from_slice(black_box(page));
                black_box(&mut dst);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
