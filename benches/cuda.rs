//! GPU benchmarks of the device checks, printed as one table (run by `scripts/gpu-check`):
//! standalone verify µs for batch {1, 64, 256} x context {4K, 32K, 128K} at page size 16, with
//! block tables as wide as engines make them (vLLM: `max_model_len / page_size` = 8,192 entries
//! per row, whatever the context); the
//! fused check's overhead in % of the reference attention's time, same shapes; CRC32 GB/s beside
//! device-to-device memcpy GB/s; poison GB/s; tag-update µs for 1K changed pages.
//!
//! Without a GPU it prints SKIPPED and exits 0 (1 with `KVGUARD_REQUIRE_GPU=1`). With
//! `KVGUARD_CUBIN=PATH` the kernels come from that prebuilt CUBIN (`DeviceOptions::cubin`), so
//! the machine needs no NVRTC.
//! Timing: CUDA events around `iters` back-to-back launches after one warm-up.
//!
//! Every step benchmarked is clean (each sequence reads only its own written pages), and that is
//! asserted per configuration: before the status words are cleared for the next one, they are
//! read and the violation ring drained, and any flagged sequence, record or dropped record fails
//! the run.
//!
//! Cargo entry: `[[bench]] name = "cuda", harness = false, required-features = ["cuda"]`. Run it
//! with `cargo test --release --features cuda --bench cuda -- --nocapture`, which works with or
//! without that entry (without it, the libtest harness runs `gpu_benchmarks` below).
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, sys};
use kvguard::cuda::layout::{DeviceTag, canary};
use kvguard::cuda::{
    AttentionCheck, AttentionShape, BlockTableStep, Borrowed, DecodeAttention, DeviceError, DeviceGuard, DeviceOptions,
    Drained, POISON, PageRegion, UncheckedAttention,
};
use kvguard::{OwnershipTable, PoolConfig};
use std::sync::Arc;
use std::time::Instant;

const PS: u32 = 16;
const BATCHES: [u32; 3] = [1, 64, 256];
const CONTEXTS: [u32; 3] = [4096, 32_768, 131_072];
const MAX_BATCH: u32 = 256;
const MAX_CONTEXT: u32 = 131_072;
const HEADS: u32 = 8;
const KV_HEADS: u32 = 1;
const HEAD_DIM: u32 = 128;

fn lend<T>(stream: &Arc<CudaStream>, s: &CudaSlice<T>) -> Borrowed<T> {
    let (ptr, _sync) = s.device_ptr(stream);
    // SAFETY: `s` is a live allocation in the guard's context, kept alive (and the stream
    // synchronised) until the end of `main`.
    unsafe { Borrowed::from_raw(ptr, s.len()) }
}

/// Mean µs per call of `f`, over `iters` calls after one warm-up, timed with CUDA events.
fn time_us(stream: &Arc<CudaStream>, iters: u32, mut f: impl FnMut()) -> f64 {
    f();
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).unwrap();
    for _ in 0..iters {
        f();
    }
    let end = stream.record_event(flags).unwrap();
    end.synchronize().unwrap();
    f64::from(start.elapsed_ms(&end).unwrap()) * 1000.0 / f64::from(iters)
}

fn main() {
    the_clean_step_check_can_fail();
    let pages_per_seq = MAX_CONTEXT / PS;
    let num_pages = MAX_BATCH * pages_per_seq + 1; // + the reserved page 0
    let config = PoolConfig::new(num_pages, PS, u64::from(MAX_CONTEXT));
    let cubin = std::env::var_os("KVGUARD_CUBIN").filter(|p| !p.is_empty()).map(|path| {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("KVGUARD_CUBIN={}: {e}", path.to_string_lossy()));
        println!("kernels: the prebuilt CUBIN {} ({} bytes)", path.to_string_lossy(), bytes.len());
        Arc::<[u8]>::from(bytes)
    });
    let options =
        DeviceOptions { max_seqs: MAX_BATCH, ring_capacity: 4096, update_batch: 65_536, cubin, ..Default::default() };
    let mut g = match DeviceGuard::new(&config, options) {
        Ok(g) => g,
        Err(e @ (DeviceError::DriverNotFound | DeviceError::NoDevice { .. } | DeviceError::NvrtcNotFound)) => {
            println!("SKIPPED: no GPU benchmarks here: {e}");
            let required = std::env::var("KVGUARD_REQUIRE_GPU").is_ok_and(|v| v == "1");
            std::process::exit(i32::from(required));
        }
        Err(e) => panic!("DeviceGuard::new: {e}"),
    };
    let s = g.stream().clone();
    // Only the sink of what `drain` takes from the device: every step here must leave it empty.
    let sink = OwnershipTable::new(config.clone()).unwrap();

    // Sequence b owns pages 1 + b * pages_per_seq .. (request b + 1, tenant 1), all written.
    let owner = |page: u32| u64::from((page - 1) / pages_per_seq) + 1;
    let tags: Vec<(u32, DeviceTag)> = (1..num_pages)
        .map(|p| (p, DeviceTag { owner: owner(p), tenant: 1, generation: 1, written: PS, state: 1, flags: 0 }))
        .collect();
    g.upload_tags(&tags).unwrap();
    let canaries: Vec<u32> = (0..num_pages * PS)
        .map(|slot| {
            let page = slot / PS;
            if page == 0 { 0 } else { canary(owner(page), 1, page, slot % PS) }
        })
        .collect();
    g.write_canaries(0, &canaries).unwrap();
    drop(canaries);
    let readers: Vec<_> =
        (0..MAX_BATCH).map(|b| (kvguard::RequestId(u64::from(b) + 1), kvguard::TenantId(1))).collect();
    g.set_readers(&readers).unwrap();

    // KV caches for the reference attention: [num_pages][16][1][128] f32, K and V (16 GiB each).
    let cache_len = num_pages as usize * (PS * KV_HEADS * HEAD_DIM) as usize;
    let key_cache = s.alloc_zeros::<f32>(cache_len).unwrap();
    let value_cache = s.alloc_zeros::<f32>(cache_len).unwrap();
    let q = s.alloc_zeros::<f32>((MAX_BATCH * HEADS * HEAD_DIM) as usize).unwrap();
    let out = s.alloc_zeros::<f32>((MAX_BATCH * HEADS * HEAD_DIM) as usize).unwrap();

    // The block table at the engines' real width: every row has MAX_CONTEXT / PS entries (8,192),
    // sequence b's own pages; a step of context `ctx` reads the first ctx / PS of them.
    let max_blocks = MAX_CONTEXT / PS;
    let bt: Vec<i32> =
        (0..MAX_BATCH).flat_map(|b| (0..max_blocks).map(move |j| (1 + b * pages_per_seq + j) as i32)).collect();
    let d_bt = s.clone_htod(&bt).unwrap();
    drop(bt);

    let mut rows = Vec::new();
    rows.push(
        "| batch | context | verify µs | verify+canary µs | attention µs | fused tags % | fused tags+canary % |"
            .to_string(),
    );
    rows.push("|---|---|---|---|---|---|---|".to_string());
    for &batch in &BATCHES {
        for &ctx in &CONTEXTS {
            let d_lens = s.clone_htod(&vec![ctx as i32; batch as usize]).unwrap();
            g.clear_status().unwrap();
            let mut step = BlockTableStep::new(lend(&s, &d_bt), lend(&s, &d_lens), batch, max_blocks);
            let verify = time_us(&s, 200, || g.verify_block_table(&step).unwrap());
            step.check_canaries = true;
            let verify_canary = time_us(&s, 50, || g.verify_block_table(&step).unwrap());
            let shape = AttentionShape {
                num_seqs: batch,
                max_blocks,
                num_heads: HEADS,
                num_kv_heads: KV_HEADS,
                head_dim: HEAD_DIM,
                scale: 1.0 / (HEAD_DIM as f32).sqrt(),
            };
            let attn = DecodeAttention {
                shape,
                q: lend(&s, &q),
                key_cache: lend(&s, &key_cache),
                value_cache: lend(&s, &value_cache),
                block_table: lend(&s, &d_bt),
                seq_lens: lend(&s, &d_lens),
                out: lend(&s, &out),
            };
            let iters = if u64::from(batch) * u64::from(ctx) >= 1 << 22 { 3 } else { 20 };
            // SAFETY: every block-table entry is a page of the pool (1..num_pages).
            let unchecked = unsafe { UncheckedAttention::new(attn) };
            let plain = time_us(&s, iters, || g.decode_attention_unchecked(&unchecked).unwrap());
            let tags_only = AttentionCheck { check_canaries: false, fail_closed: false };
            let fused = time_us(&s, iters, || g.decode_attention_checked(&attn, tags_only).unwrap());
            let with_canaries = AttentionCheck { check_canaries: true, fail_closed: false };
            let fused_canary = time_us(&s, iters, || g.decode_attention_checked(&attn, with_canaries).unwrap());
            let pct = |x: f64| (x - plain) / plain * 100.0;
            rows.push(format!(
                "| {batch} | {}K | {verify:.2} | {verify_canary:.2} | {plain:.0} | {:+.2} | {:+.2} |",
                ctx / 1024,
                pct(fused),
                pct(fused_canary)
            ));
            // The steps above are clean: read what they left before the next clear.
            let status = g.read_status(batch).unwrap();
            let drained = g.drain(&sink).unwrap();
            assert_clean(batch, ctx, &status, &drained);
        }
    }

    // Bandwidth: CRC32 and poison over 4 GiB of 64 KiB pages (16 tokens x 8 KV heads x 128 x
    // bf16 x K+V per layer), beside a device-to-device memcpy of the same bytes.
    let page_bytes: u64 = 64 * 1024;
    let n_pages: u32 = 65_536;
    let bytes = page_bytes * u64::from(n_pages);
    let src = s.alloc_zeros::<u8>(bytes as usize).unwrap();
    let mut dst = s.alloc_zeros::<u8>(bytes as usize).unwrap();
    let crc_out = s.alloc_zeros::<u32>(n_pages as usize).unwrap();
    let page_ids = s.clone_htod(&(0..n_pages as i32).collect::<Vec<_>>()).unwrap();
    let region = |b: Borrowed<u8>| PageRegion { base: b, page_stride: page_bytes, page_bytes, num_pages: n_pages };
    let (src_b, dst_b, crc_b, ids_b) = (lend(&s, &src), lend(&s, &dst), lend(&s, &crc_out), lend(&s, &page_ids));
    let gbs = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
    let crc = time_us(&s, 5, || g.crc32_pages(region(src_b), None, n_pages, 0, crc_b).unwrap());
    let memcpy = time_us(&s, 5, || s.memcpy_dtod(&src, &mut dst).unwrap());
    let poison = time_us(&s, 5, || g.scrub_pages(region(dst_b), ids_b, n_pages, POISON, false).unwrap());

    // Tag updates: 1,024 changed pages, host to device and scattered, end to end.
    let changed: Vec<(u32, DeviceTag)> = tags.iter().step_by(2048).take(1024).copied().collect();
    assert_eq!(changed.len(), 1024);
    s.synchronize().unwrap();
    let t0 = Instant::now();
    let n = 100;
    for _ in 0..n {
        g.upload_tags(&changed).unwrap();
    }
    s.synchronize().unwrap();
    let update_us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    let update_kernel = time_us(&s, n, || g.upload_tags(&changed).unwrap());

    println!(
        "\nkvguard device checks (page size {PS}; block tables {max_blocks} entries wide; attention: {HEADS} heads, \
         {KV_HEADS} KV head, dim {HEAD_DIM}, f32)\n"
    );
    for r in &rows {
        println!("{r}");
    }
    println!();
    println!("| measure | value | goal |");
    println!("|---|---|---|");
    println!("| CRC32 of 64 KiB pages | {:.0} GB/s | ≥ 50% of memcpy |", gbs(crc));
    println!("| device-to-device memcpy | {:.0} GB/s (bytes copied) | |", gbs(memcpy));
    println!("| CRC32 / memcpy | {:.0}% | ≥ 50% |", gbs(crc) / gbs(memcpy) * 100.0);
    println!("| poison 64 KiB pages | {:.0} GB/s | |", gbs(poison));
    println!("| tag update, 1K changed pages | {update_us:.1} µs wall ({update_kernel:.1} µs stream) | |");
    println!("\ngoals: fused check ≤ 1% of attention; verify 256 x 4K ≤ 10 µs; CRC32 ≥ 50% of memcpy");
}

/// Why a configuration's steps were not clean (a sequence flagged, a record in the ring, one
/// dropped or half-written), or `None`.
fn unclean(batch: u32, ctx: u32, status: &[u32], drained: &Drained) -> Option<String> {
    let flagged = status.iter().filter(|&&w| w != 0).count();
    let clean = flagged == 0 && drained.violations.is_empty() && drained.dropped_total == 0 && drained.incomplete == 0;
    (!clean).then(|| {
        format!(
            "batch {batch} x context {ctx}: the benchmark's steps are clean, yet {flagged} sequence(s) were flagged, \
             {} violation(s) recorded (first: {:?}), {} dropped, {} incomplete",
            drained.violations.len(),
            drained.violations.first().map(ToString::to_string),
            drained.dropped_total,
            drained.incomplete
        )
    })
}

fn assert_clean(batch: u32, ctx: u32, status: &[u32], drained: &Drained) {
    if let Some(why) = unclean(batch, ctx, status, drained) {
        panic!("{why}");
    }
}

/// The clean-step check must be able to fail: run first, with or without a GPU (the bench has no
/// test harness, so this is its test).
fn the_clean_step_check_can_fail() {
    let none = Drained::default();
    assert_eq!(unclean(2, 4096, &[0, 0], &none), None);
    assert!(unclean(2, 4096, &[0, 1 << 4], &none).is_some(), "a flagged sequence");
    assert!(unclean(2, 4096, &[0, 0], &Drained { dropped_total: 1, ..Drained::default() }).is_some(), "a drop");
    assert!(unclean(2, 4096, &[0, 0], &Drained { incomplete: 1, ..Drained::default() }).is_some(), "a torn record");
    let foreign = kvguard::Violation::new(kvguard::ViolationKind::ForeignPage, kvguard::Op::Read);
    let recorded = Drained { violations: vec![foreign], ..Drained::default() };
    assert!(unclean(2, 4096, &[0, 0], &recorded).is_some(), "a record");
}

#[cfg(test)]
mod harness {
    #[test]
    fn gpu_benchmarks() {
        super::main();
    }
}
