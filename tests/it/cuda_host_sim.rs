//! The CUDA kernels compiled as host C++ (kernels/host/kvguard_sim.h) and run on the CPU over a
//! simulated grid, each checked against its Rust reference: layouts against the `#[repr(C)]`
//! types, canaries against `layout::canary`, CRC32 against crc32fast, tag updates against the
//! table's changed pages, scrubbing, and the reference attention against a naive one. No GPU and
//! no CUDA toolkit needed, only a C++17 compiler; without one the tests print a loud SKIPPED line
//! (and fail when `KVGUARD_REQUIRE_HOSTCXX=1`, which `scripts/ci/cuda.sh setup` exports).

/// Under `cuda::` so that `cargo test cuda` selects these.
mod cuda {
    use crate::common::host_sim::{Case, NUM_PAGES, PS, Pool, Rng, driver, pool};
    use kvguard::cuda::Bf16;
    use kvguard::cuda::layout::{DeviceKind, DeviceReader, DeviceTag, DeviceViolation, RingDrain, RingHeader, canary};
    use kvguard::{PageId, RequestId, TenantId, ViolationKind};
    use std::collections::HashMap;
    use std::path::Path;
    use std::process::Command;

    const MAX_BLOCKS: usize = 6;

    // ------------------------------------------------------------------------------------------------
    // Layout and canary
    // ------------------------------------------------------------------------------------------------

    #[test]
    fn layouts_match_rust() {
        let Some(exe) = driver() else { return };
        let o = Command::new(exe).arg("layout").output().unwrap();
        assert!(o.status.success());
        let text = String::from_utf8(o.stdout).unwrap();
        let cpp: HashMap<&str, usize> = text
            .lines()
            .map(|l| {
                let (k, v) = l.split_once(' ').unwrap();
                (k, v.parse().unwrap())
            })
            .collect();
        use std::mem::{align_of, offset_of, size_of};
        let rust: Vec<(&str, usize)> = vec![
            ("kvg_tag.size", size_of::<DeviceTag>()),
            ("kvg_tag.align", align_of::<DeviceTag>()),
            ("kvg_tag.owner", offset_of!(DeviceTag, owner)),
            ("kvg_tag.tenant", offset_of!(DeviceTag, tenant)),
            ("kvg_tag.generation", offset_of!(DeviceTag, generation)),
            ("kvg_tag.written", offset_of!(DeviceTag, written)),
            ("kvg_tag.state", offset_of!(DeviceTag, state)),
            ("kvg_tag.flags", offset_of!(DeviceTag, flags)),
            ("kvg_reader.size", size_of::<DeviceReader>()),
            ("kvg_reader.align", align_of::<DeviceReader>()),
            ("kvg_reader.request", offset_of!(DeviceReader, request)),
            ("kvg_reader.tenant", offset_of!(DeviceReader, tenant)),
            ("kvg_violation.size", size_of::<DeviceViolation>()),
            ("kvg_violation.align", align_of::<DeviceViolation>()),
            ("kvg_violation.kind", offset_of!(DeviceViolation, kind)),
            ("kvg_violation.op", offset_of!(DeviceViolation, op)),
            ("kvg_violation.seq", offset_of!(DeviceViolation, seq)),
            ("kvg_violation.block", offset_of!(DeviceViolation, block)),
            ("kvg_violation.page", offset_of!(DeviceViolation, page)),
            ("kvg_violation.slot_start", offset_of!(DeviceViolation, slot_start)),
            ("kvg_violation.slot_end", offset_of!(DeviceViolation, slot_end)),
            ("kvg_violation.expected_generation", offset_of!(DeviceViolation, expected_generation)),
            ("kvg_violation.request", offset_of!(DeviceViolation, request)),
            ("kvg_violation.tenant", offset_of!(DeviceViolation, tenant)),
            ("kvg_violation.found", offset_of!(DeviceViolation, found)),
            ("kvg_violation.sequence_no", offset_of!(DeviceViolation, sequence_no)),
            ("kvg_violation.reserved", offset_of!(DeviceViolation, reserved)),
            ("kvg_ring.size", size_of::<RingHeader>()),
            ("kvg_ring.align", align_of::<RingHeader>()),
            ("kvg_ring.head", offset_of!(RingHeader, head)),
            ("kvg_ring.dropped", offset_of!(RingHeader, dropped)),
            ("kvg_ring.consumed", offset_of!(RingHeader, consumed)),
            ("kvg_ring.capacity", offset_of!(RingHeader, capacity)),
            ("kvg_ring.lost", offset_of!(RingHeader, lost)),
            ("KVG_FLAG_SHARED_ACROSS_TENANTS", DeviceTag::FLAG_SHARED_ACROSS_TENANTS as usize),
        ];
        assert_eq!(cpp.len(), rust.len(), "the C++ side reports fields the Rust side does not check:\n{text}");
        for (name, value) in rust {
            assert_eq!(cpp.get(name), Some(&value), "{name}: C++ {:?} vs Rust {value}", cpp.get(name));
        }
    }

    #[test]
    fn canaries_are_bit_exact_with_rust() {
        let Some(exe) = driver() else { return };
        let mut rng = Rng(1);
        let inputs: Vec<(u64, u32, u32, u32)> = (0..2000)
            .map(|i| match i {
                0 => (0, 0, 0, 0),
                1 => (u64::MAX, u32::MAX, u32::MAX, u32::MAX),
                _ => (rng.next(), rng.next() as u32, rng.below(1 << 26) as u32, rng.below(1 << 16) as u32),
            })
            .collect();
        let mut bytes = Vec::new();
        for &(o, g, p, s) in &inputs {
            bytes.extend_from_slice(&o.to_le_bytes());
            for w in [g, p, s, 0] {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
        let mut case = Case::new("canary");
        case.bytes("canary", &bytes).run(exe, "canary");
        let device = case.out_u32("canary");
        assert_eq!(device.len(), inputs.len());
        for (&(o, g, p, s), &d) in inputs.iter().zip(&device) {
            assert_eq!(d, canary(o, g, p, s), "canary({o}, {g}, {p}, {s})");
            assert_ne!(d, 0);
        }
    }

    // ------------------------------------------------------------------------------------------------
    // CRC32
    // ------------------------------------------------------------------------------------------------

    fn crc_case(exe: &Path, data: &[u8], stride: u64, pages: &[i32], num_pages: u32, chunk: u32, lengths: &[u64]) {
        let mut case = Case::new("crc32");
        case.bytes("data", data)
            .u64s("lengths", lengths)
            .i32s("pages", pages)
            .param("stride", stride)
            .param("n_pages", pages.len())
            .param("num_pages", num_pages)
            .param("chunk", chunk)
            .param("threads", 32);
        case.run(exe, "crc32");
        let crc = case.out_u32("crc");
        assert_eq!(crc.len(), lengths.len() * pages.len());
        for (li, &len) in lengths.iter().enumerate() {
            for (pi, &page) in pages.iter().enumerate() {
                let got = crc[li * pages.len() + pi];
                let want = if page < 0 || page as u32 >= num_pages {
                    0
                } else {
                    let at = page as usize * stride as usize;
                    crc32fast::hash(&data[at..at + len as usize])
                };
                assert_eq!(got, want, "page {page}, {len} bytes, chunk {chunk}, stride {stride}");
            }
        }
    }

    #[test]
    fn crc32_is_bit_exact_with_crc32fast_across_chunk_boundaries() {
        let Some(exe) = driver() else { return };
        let mut rng = Rng(7);
        // An odd stride puts pages at every alignment; more chunks than threads makes threads loop.
        let stride = 1037u64;
        let data: Vec<u8> = (0..stride * 4).map(|_| rng.next() as u8).collect();
        let pages = [2, 0, 3, 1, -1, 4];
        let lengths: Vec<u64> = (0..=300).collect();
        crc_case(exe, &data, stride, &pages, 4, 8, &lengths);
        let lengths: Vec<u64> = vec![511, 512, 513, 1000, 1023, 1024, 1025, 1037];
        crc_case(exe, &data, stride, &pages, 4, 64, &lengths);
        crc_case(exe, &data, stride, &pages[..2], 4, 1, &[0, 1, 2, 33, 64, 65]);
    }

    #[test]
    fn crc32_of_all_zero_and_all_ones_pages_matches() {
        let Some(exe) = driver() else { return };
        let mut data = vec![0u8; 4096];
        data[2048..].fill(0xff);
        crc_case(exe, &data, 2048, &[0, 1], 2, 256, &[0, 4, 255, 256, 257, 2048]);
    }

    // ------------------------------------------------------------------------------------------------
    // Tag updates and scrubbing
    // ------------------------------------------------------------------------------------------------

    #[test]
    fn tag_updates_scatter_exactly_the_changed_pages() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let before = pool.device_tags();
        pool.table.take_changed_pages();
        // A step's worth of changes: a release, an allocation, writes.
        let (d, ..) = pool.requests[3];
        pool.table.release(d).unwrap();
        let g = RequestId(9);
        pool.table.admit(g, TenantId(40), 8, 8).unwrap();
        let pg: Vec<PageId> = pool.table.allocate(g, 3).unwrap().iter().map(|r| r.page).collect();
        pool.table.record_write_tokens(g, &pg, 0..9).unwrap();
        let changed = pool.table.take_changed_pages();
        assert!(!changed.is_empty() && changed.len() < NUM_PAGES as usize, "incremental, not a full copy");
        let mut pages: Vec<u32> = changed.iter().map(|(p, _)| p.0).collect();
        let mut updates: Vec<DeviceTag> = changed.iter().map(|(_, i)| DeviceTag::from_page_info(i)).collect();
        // An update for a page beyond the pool is ignored, never written.
        pages.push(NUM_PAGES + 1);
        updates.push(DeviceTag { owner: 666, ..DeviceTag::default() });
        let mut case = Case::new("tags");
        case.tags("tags", &before).u32s("pages", &pages).tags("updates", &updates);
        case.run(exe, "tags");
        assert_eq!(case.out_tags("tags"), pool.device_tags());
    }

    #[test]
    fn scrub_fills_released_pages_and_clears_their_canaries() {
        let Some(exe) = driver() else { return };
        let mut rng = Rng(21);
        for (offset, stride, page_bytes) in [(0u64, 64u64, 64u64), (3, 40, 37)] {
            for pattern in [0u32, kvguard::cuda::POISON] {
                let n = 6u32;
                let data: Vec<u8> = (0..offset + stride * u64::from(n) + 5).map(|_| rng.next() as u8).collect();
                let canaries: Vec<u32> = (0..n * PS).map(|_| rng.next() as u32 | 1).collect();
                let pages = [1i32, 4, -2, 99];
                let mut case = Case::new("scrub");
                case.bytes("data", &data)
                    .i32s("pages", &pages)
                    .u32s("canaries", &canaries)
                    .param("offset", offset)
                    .param("stride", stride)
                    .param("page_bytes", page_bytes)
                    .param("pattern", pattern)
                    .param("page_size", PS)
                    .param("num_pages", n);
                case.run(exe, "scrub");
                let (mut want, mut want_c) = (data.clone(), canaries.clone());
                for &p in &pages[..2] {
                    let at = (offset + p as u64 * stride) as usize;
                    for k in 0..page_bytes as usize {
                        want[at + k] = (pattern >> (8 * ((at + k - offset as usize) % 4))) as u8;
                    }
                    want_c[(p as u32 * PS) as usize..((p as u32 + 1) * PS) as usize].fill(0);
                }
                if offset == 0 {
                    assert_eq!(case.out("data"), want, "aligned pages, pattern {pattern:#x}");
                } else {
                    // Unaligned pages take the byte path; the pattern is laid by address, so compare
                    // each scrubbed byte with the pattern byte of its address modulo 4 in the buffer
                    // the driver allocated: only "every scrubbed byte came from the pattern" holds.
                    let got = case.out("data");
                    for &p in &pages[..2] {
                        let at = (offset + p as u64 * stride) as usize;
                        for k in 0..page_bytes as usize {
                            assert!(pattern.to_le_bytes().contains(&got[at + k]), "byte {k} of page {p}");
                        }
                    }
                    let untouched = |i: usize| {
                        pages[..2].iter().all(|&p| {
                            let at = (offset + p as u64 * stride) as usize;
                            i < at || i >= at + page_bytes as usize
                        })
                    };
                    for i in (0..data.len()).filter(|&i| untouched(i)) {
                        assert_eq!(got[i], data[i], "byte {i} outside the scrubbed pages changed");
                    }
                }
                assert_eq!(case.out_u32("canaries"), want_c);
                if pattern == kvguard::cuda::POISON && offset == 0 {
                    let at = stride as usize;
                    let w = f32::from_le_bytes(case.out("data")[at..at + 4].try_into().unwrap());
                    assert!(w.is_nan(), "poison reads as NaN in f32");
                }
            }
        }
    }

    // ------------------------------------------------------------------------------------------------
    // The paged decode attention (split over the KV length; f32 and bf16), with and without the
    // fused check
    // ------------------------------------------------------------------------------------------------

    struct Attn {
        q: Vec<f32>,
        kc: Vec<f32>,
        vc: Vec<f32>,
        /// `num_seqs` rows of `max_blocks` page ids.
        rows: Vec<i32>,
        max_blocks: usize,
        lens: Vec<i32>,
        heads: usize,
        kv_heads: usize,
        dim: usize,
        scale: f32,
    }

    fn naive_attention(a: &Attn) -> Vec<f32> {
        let mut out = vec![0f32; a.lens.len() * a.heads * a.dim];
        for (s, &len) in a.lens.iter().enumerate() {
            for h in 0..a.heads {
                let kvh = h / (a.heads / a.kv_heads);
                let q = &a.q[(s * a.heads + h) * a.dim..][..a.dim];
                let rows: Vec<usize> = (0..len as usize)
                    .map(|t| {
                        let page = a.rows[s * a.max_blocks + t / PS as usize] as usize;
                        ((page * PS as usize + t % PS as usize) * a.kv_heads + kvh) * a.dim
                    })
                    .collect();
                let scores: Vec<f64> = rows
                    .iter()
                    .map(|&r| {
                        q.iter().zip(&a.kc[r..r + a.dim]).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>()
                    })
                    .map(|d| d * f64::from(a.scale))
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                for d in 0..a.dim {
                    let o: f64 = rows.iter().zip(&w).map(|(&r, wt)| wt * f64::from(a.vc[r + d])).sum();
                    out[(s * a.heads + h) * a.dim + d] = if total > 0.0 { (o / total) as f32 } else { 0.0 };
                }
            }
        }
        out
    }

    /// How the attention is launched: the splits of each sequence's pages, and whether the
    /// caches are bfloat16 (the values of `Attn`, rounded).
    #[derive(Clone, Copy, Debug)]
    struct Launch {
        splits: u32,
        bf16: bool,
    }

    fn bf16_bits(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|&x| Bf16::from_f32(x).0.to_le_bytes()).collect()
    }

    fn run_attention(
        exe: &Path,
        pool: &Pool,
        a: &Attn,
        launch: Launch,
        checked: Option<(&[DeviceReader], &[u32], bool)>,
    ) -> (Vec<f32>, Vec<u32>, RingDrain) {
        let mut case = Case::new("attention");
        if launch.bf16 {
            case.bytes("key_cache", &bf16_bits(&a.kc)).bytes("value_cache", &bf16_bits(&a.vc));
        } else {
            case.f32s("key_cache", &a.kc).f32s("value_cache", &a.vc);
        }
        case.f32s("q", &a.q)
            .param("splits", launch.splits)
            .param("bf16", u32::from(launch.bf16))
            .i32s("block_table", &a.rows)
            .i32s("seq_lens", &a.lens)
            .param("max_blocks", a.max_blocks)
            .param("num_heads", a.heads)
            .param("num_kv_heads", a.kv_heads)
            .param("head_dim", a.dim)
            .param("page_size", PS)
            .param("scale", a.scale)
            .param("ring_capacity", 256)
            .param("checked", u32::from(checked.is_some()));
        if let Some((readers, canaries, fail_closed)) = checked {
            case.tags("tags", &pool.device_tags())
                .readers("readers", readers)
                .u32s("canaries", canaries)
                .param("fail_closed", u32::from(fail_closed));
        }
        case.run(exe, "attention");
        assert!(
            case.out_u32("counters").iter().all(|&c| c == 0),
            "{launch:?}: the workspace's counters are zeroed again"
        );
        if checked.is_some() {
            (case.out_f32("out"), case.out_u32("status"), case.ring())
        } else {
            (case.out_f32("out"), Vec::new(), RingDrain::default())
        }
    }

    #[test]
    fn the_split_attention_matches_naive_and_the_fused_check_fails_closed() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(31);
        let (heads, kv_heads, dim) = (4usize, 2usize, 64usize);
        let cache = (NUM_PAGES * PS) as usize * kv_heads * dim;
        let r = &pool.requests;
        // Clean reads (alice, bob through the prefix, dave), then carol reading alice's page
        // (foreign), then alice again with a corrupted canary.
        let reads: Vec<(RequestId, Vec<PageId>, u64)> = vec![
            (r[0].0, r[0].2.clone(), 14),
            (r[1].0, r[1].2.clone(), 20),
            (r[3].0, r[3].2.clone(), 5),
            (r[2].0, vec![r[2].2[0], r[0].2[2]], 7),
            (r[0].0, r[0].2.clone(), 13),
        ];
        let mut rows = Vec::new();
        for (_, pages, _) in &reads {
            let mut row: Vec<i32> = pages.iter().map(|p| p.0 as i32).collect();
            row.resize(MAX_BLOCKS, 0);
            rows.extend(row);
        }
        let a = Attn {
            q: (0..reads.len() * heads * dim).map(|_| rng.f32()).collect(),
            kc: (0..cache).map(|_| rng.f32()).collect(),
            vc: (0..cache).map(|_| rng.f32()).collect(),
            rows,
            max_blocks: MAX_BLOCKS,
            lens: reads.iter().map(|r| r.2 as i32).collect(),
            heads,
            kv_heads,
            dim,
            scale: 1.0 / (dim as f32).sqrt(),
        };
        let readers: Vec<DeviceReader> = reads.iter().map(|(q, ..)| DeviceReader::new(*q, pool.tenant(*q))).collect();
        let mut canaries = pool.canaries();
        canaries[(r[0].2[2].0 * PS + 1) as usize] = 0; // seqs 0 and 4 read this slot of alice's
        // One block per sequence, the pages split over three blocks, and bfloat16 caches.
        for launch in
            [Launch { splits: 1, bf16: false }, Launch { splits: 3, bf16: false }, Launch { splits: 2, bf16: true }]
        {
            attention_case(exe, &pool, &a, launch, &readers, &canaries, reads.len());
        }
    }

    fn attention_case(
        exe: &Path,
        pool: &Pool,
        a: &Attn,
        launch: Launch,
        readers: &[DeviceReader],
        canaries: &[u32],
        n_reads: usize,
    ) {
        let (heads, dim) = (a.heads, a.dim);
        let rounded;
        let naive = if launch.bf16 {
            let round = |v: &[f32]| v.iter().map(|&x| Bf16::from_f32(x).to_f32()).collect::<Vec<_>>();
            rounded = Attn {
                kc: round(&a.kc),
                vc: round(&a.vc),
                q: a.q.clone(),
                rows: a.rows.clone(),
                lens: a.lens.clone(),
                ..*a
            };
            naive_attention(&rounded)
        } else {
            naive_attention(a)
        };
        let (plain, ..) = run_attention(exe, pool, a, launch, None);
        for (i, (x, y)) in plain.iter().zip(&naive).enumerate() {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{launch:?} out[{i}]: kernel {x} vs naive {y}");
        }
        // Report mode: same output as unchecked, violations flagged and recorded once per page.
        let (report, status, ring) = run_attention(exe, pool, a, launch, Some((readers, canaries, false)));
        assert_eq!(report, plain, "report mode computes exactly what the unchecked kernel does");
        let foreign = 1 << DeviceKind::ForeignPage.code();
        let canary_bit = 1 << DeviceKind::CanaryMismatch.code();
        assert_eq!(status, vec![canary_bit, 0, 0, foreign, canary_bit]);
        let mut recs: Vec<(u32, u32, ViolationKind)> =
            ring.records.iter().map(|r| (r.seq, r.block, r.to_violation().unwrap().kind())).collect();
        recs.sort_by_key(|x| (x.0, x.1));
        assert_eq!(
            recs,
            vec![
                (0, 2, ViolationKind::UnwrittenSlots),
                (3, 1, ViolationKind::ForeignPage),
                (4, 2, ViolationKind::UnwrittenSlots)
            ],
            "one record per bad page, from head 0 only"
        );
        // Fail closed: flagged sequences output zeros, the others are untouched.
        let (closed, status2, _) = run_attention(exe, pool, a, launch, Some((readers, canaries, true)));
        assert_eq!(status2, status);
        let per_seq = heads * dim;
        for s in 0..n_reads {
            let got = &closed[s * per_seq..(s + 1) * per_seq];
            if status[s] != 0 {
                assert!(got.iter().all(|&x| x == 0.0), "seq {s} was flagged: its output must be zeros");
            } else {
                assert_eq!(got, &plain[s * per_seq..(s + 1) * per_seq], "seq {s} is clean");
            }
        }
    }

    /// The fused check judges a warp's tags 32 pages at a time (one ballot bit per page): rows of
    /// 300 pages cross several batches of every warp, and a foreign page at the first and last
    /// position, at a batch's first and middle page, and in a later split is each caught where it
    /// is, with and without canaries, while a clean row of the same length is untouched.
    #[test]
    fn the_batched_tag_check_catches_a_bad_page_at_any_position_of_a_long_row() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(47);
        let (heads, kv_heads, dim, max_blocks) = (2usize, 1usize, 32usize, 300usize);
        let cache = (NUM_PAGES * PS) as usize * kv_heads * dim;
        let r = &pool.requests;
        // Carol's four full pages, cycled; alice's first (full) page is foreign to her. With 4
        // warps, block j is a warp's batch (j / 4) / 32, at position (j / 4) % 32 in it: 0 and 299
        // are the ends, 128 opens warp 0's second batch, 193 is the middle (16) of warp 1's.
        let carol = r[2].0;
        let own: Vec<i32> = r[2].2.iter().map(|p| p.0 as i32).collect();
        assert_eq!(r[2].3, 4 * u64::from(PS), "carol's pages are all full");
        let foreign = r[0].2[0].0 as i32;
        let bad_at = [0usize, 128, 193, 299];
        let clean: Vec<i32> = (0..max_blocks).map(|j| own[j % own.len()]).collect();
        let mut dirty = clean.clone();
        for &j in &bad_at {
            dirty[j] = foreign;
        }
        let a = Attn {
            q: (0..2 * heads * dim).map(|_| rng.f32()).collect(),
            kc: (0..cache).map(|_| rng.f32()).collect(),
            vc: (0..cache).map(|_| rng.f32()).collect(),
            rows: clean.iter().chain(&dirty).copied().collect(),
            max_blocks,
            lens: vec![(max_blocks as u32 * PS) as i32; 2],
            heads,
            kv_heads,
            dim,
            scale: 1.0 / (dim as f32).sqrt(),
        };
        let readers = vec![DeviceReader::new(carol, pool.tenant(carol)); 2];
        let canaries = pool.canaries();
        let foreign_bit = 1 << DeviceKind::ForeignPage.code();
        for launch in [Launch { splits: 1, bf16: false }, Launch { splits: 2, bf16: false }] {
            let (plain, ..) = run_attention(exe, &pool, &a, launch, None);
            for with_canaries in [false, true] {
                let c: &[u32] = if with_canaries { &canaries } else { &[] };
                let what = format!("{launch:?}, canaries {with_canaries}");
                let (report, status, ring) = run_attention(exe, &pool, &a, launch, Some((&readers, c, false)));
                assert_eq!(report, plain, "{what}: report mode computes what the unchecked kernel does");
                assert_eq!(status, vec![0, foreign_bit], "{what}: only the dirty row is flagged");
                let mut recs: Vec<(u32, u32, i32, ViolationKind)> =
                    ring.records.iter().map(|x| (x.seq, x.block, x.page, x.to_violation().unwrap().kind())).collect();
                recs.sort_by_key(|x| x.1);
                let want: Vec<_> = bad_at.iter().map(|&j| (1, j as u32, foreign, ViolationKind::ForeignPage)).collect();
                assert_eq!(recs, want, "{what}: one record per foreign page, where it is");
                let (closed, status2, _) = run_attention(exe, &pool, &a, launch, Some((&readers, c, true)));
                assert_eq!(status2, status, "{what}");
                let per_seq = heads * dim;
                assert_eq!(closed[..per_seq], plain[..per_seq], "{what}: the clean row is untouched");
                assert!(closed[per_seq..].iter().all(|&x| x == 0.0), "{what}: the flagged row is zeros");
            }
        }
    }

    /// Every way a lane's share of a V row is loaded (2 bytes: one element at a time; 4, 8 and
    /// 16 bytes: several rows in flight; 32 bytes: two 16-byte loads per row) computes what the
    /// naive attention does, f32 and bfloat16, with and without splits.
    #[test]
    fn the_attention_matches_naive_for_every_width_of_a_lanes_v_share() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(53);
        let r = &pool.requests;
        let reads = [(&r[0].2, 14i32), (&r[2].2, 16), (&r[3].2, 5)];
        let mut rows = Vec::new();
        for (pages, _) in &reads {
            let mut row: Vec<i32> = pages.iter().map(|p| p.0 as i32).collect();
            row.resize(MAX_BLOCKS, 0);
            rows.extend(row);
        }
        // (head_dim, bf16): the lane's share is head_dim / 32 elements.
        for (dim, bf16) in [(32usize, true), (32, false), (128, false), (256, true), (256, false)] {
            let (heads, kv_heads) = (2usize, 1usize);
            let cache = (NUM_PAGES * PS) as usize * kv_heads * dim;
            let a = Attn {
                q: (0..reads.len() * heads * dim).map(|_| rng.f32()).collect(),
                kc: (0..cache).map(|_| rng.f32()).collect(),
                vc: (0..cache).map(|_| rng.f32()).collect(),
                rows: rows.clone(),
                max_blocks: MAX_BLOCKS,
                lens: reads.iter().map(|x| x.1).collect(),
                heads,
                kv_heads,
                dim,
                scale: 1.0 / (dim as f32).sqrt(),
            };
            let naive = if bf16 {
                let round = |v: &[f32]| v.iter().map(|&x| Bf16::from_f32(x).to_f32()).collect::<Vec<_>>();
                naive_attention(&Attn {
                    kc: round(&a.kc),
                    vc: round(&a.vc),
                    q: a.q.clone(),
                    rows: a.rows.clone(),
                    lens: a.lens.clone(),
                    ..a
                })
            } else {
                naive_attention(&a)
            };
            for splits in [1, 2] {
                let launch = Launch { splits, bf16 };
                let (got, ..) = run_attention(exe, &pool, &a, launch, None);
                let share = dim / 32 * if bf16 { 2 } else { 4 };
                for (i, (x, y)) in got.iter().zip(&naive).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "{launch:?}, dim {dim} ({share}-byte share), out[{i}]: kernel {x} vs naive {y}"
                    );
                }
            }
        }
    }
}
