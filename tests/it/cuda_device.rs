//! `DeviceGuard` on a real GPU: verification against the host table (captured into a CUDA graph
//! and replayed; SGLang's `req_to_token` read in place), CRC32 against crc32fast, the KV store and the fused attention check.
//!
//! Without a driver or device every GPU test prints a SKIPPED line and passes, unless
//! `KVGUARD_REQUIRE_GPU=1` (set by `scripts/gpu-check`). The typed-error test runs everywhere.
//!
//! `KVGUARD_CUBIN=PATH` loads the kernels from a prebuilt CUBIN (`DeviceOptions::cubin`, written
//! by the `cuda_cubin` example) instead of NVRTC, for machines without it; `scripts/gpu-check`
//! sets it. `KVGUARD_WRONG_ARCH_CUBIN=PATH` names a CUBIN for an architecture the GPU cannot run,
//! which must be refused with `DeviceError::Cubin`.

/// Under `cuda::` so that `cargo test cuda` selects these.
mod cuda {
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, sys};
    use kvguard::cuda::{
        AttentionCheck, AttentionShape, BlockTableStep, Borrowed, DecodeAttention, DeviceError, DeviceGuard,
        DeviceKind, DeviceOptions, EngineStream, FenceStep, KvStore, PageRegion, PagedKvStep, SlotMappingStep,
        TokenRowsStep,
    };
    use kvguard::{OwnershipTable, PageId, PoolConfig, RequestId, TenantId, ViolationKind};
    use std::sync::{Arc, OnceLock};

    fn required() -> bool {
        std::env::var("KVGUARD_REQUIRE_GPU").is_ok_and(|v| v == "1")
    }

    /// The bytes of the file the environment variable `var` names (unset or empty: `None`).
    fn cubin_from_env(var: &str) -> Option<Arc<[u8]>> {
        let path = std::env::var_os(var).filter(|p| !p.is_empty())?;
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{var}={}: {e}", path.to_string_lossy()));
        Some(bytes.into())
    }

    /// The prebuilt kernels `KVGUARD_CUBIN` names, read once; `None`: compile through NVRTC.
    fn prebuilt_cubin() -> Option<Arc<[u8]>> {
        static CUBIN: OnceLock<Option<Arc<[u8]>>> = OnceLock::new();
        CUBIN.get_or_init(|| cubin_from_env("KVGUARD_CUBIN")).clone()
    }

    /// A guard on device 0 with a stream to queue its work on (a side stream of the test's own,
    /// as `torch.cuda.graph` captures on), or `None` (with a SKIPPED line) where there is no GPU.
    fn guard(config: &PoolConfig, max_seqs: u32) -> Option<(DeviceGuard, Arc<CudaStream>, EngineStream)> {
        let options = DeviceOptions {
            max_seqs,
            ring_capacity: 1024,
            update_batch: 4096,
            cubin: prebuilt_cubin(),
            ..DeviceOptions::default()
        };
        match DeviceGuard::new(config, options) {
            Ok(g) => {
                let s = g.context().new_stream().expect("a stream of the guard's context");
                // SAFETY: a stream of the guard's context; every test keeps `s` alive as long
                // as the guard and the stream handle.
                let es = unsafe { EngineStream::from_raw(s.cu_stream()) };
                Some((g, s, es))
            }
            Err(e @ (DeviceError::DriverNotFound | DeviceError::NoDevice { .. } | DeviceError::NvrtcNotFound)) => {
                assert!(!required(), "KVGUARD_REQUIRE_GPU=1 but: {e}");
                crate::common::skip::skipped(&format!("no GPU here: {e}"));
                None
            }
            Err(e) => panic!("DeviceGuard::new failed: {e}"),
        }
    }

    /// Lends a buffer the test owns to the guard.
    fn lend<T>(stream: &Arc<CudaStream>, b: &CudaSlice<T>) -> Borrowed<T> {
        let (ptr, _sync) = b.device_ptr(stream);
        // SAFETY: `b` is a live allocation of `b.len()` elements in the guard's context
        // (allocated on the test's stream); every test keeps it alive until it has synchronised
        // that stream.
        unsafe { Borrowed::from_raw(ptr, b.len()) }
    }

    #[test]
    fn a_device_guard_can_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<DeviceGuard>();
        send_sync::<Borrowed<i32>>();
    }

    #[test]
    fn the_standalone_verify_recipe_defaults_to_canaries_off() {
        // SAFETY: never launched; only the defaults are looked at.
        let (bt, lens) = unsafe { (Borrowed::<i32>::from_raw(0, 8), Borrowed::<i32>::from_raw(0, 1)) };
        let step = BlockTableStep::new(bt, lens, 1, 8);
        assert!(!step.check_canaries && step.query_lens.is_none() && step.generations.is_none());
        let step = PagedKvStep::new(lens, bt, lens, 1, 8);
        assert!(!step.check_canaries && step.query_lens.is_none() && step.generations.is_none());
    }

    #[test]
    fn device_guard_without_a_driver_is_a_typed_error_not_a_panic() {
        let config = PoolConfig::new(64, 16, 256);
        let result = std::panic::catch_unwind(|| DeviceGuard::new(&config, DeviceOptions::default()));
        let result = result.expect("DeviceGuard::new must never panic");
        if !kvguard::cuda::driver_available() {
            match result {
                Err(DeviceError::DriverNotFound) => {}
                other => panic!("expected DriverNotFound on a machine without libcuda, got {other:?}"),
            }
        }
        let bad = DeviceGuard::new(&config, DeviceOptions { ring_capacity: 0, ..DeviceOptions::default() });
        assert!(matches!(bad, Err(DeviceError::Argument(_))), "a zero ring is refused before the driver is touched");
    }

    #[test]
    fn device_guard_with_a_cubin_is_a_typed_error_not_a_panic() {
        let config = PoolConfig::new(64, 16, 256);
        let junk = DeviceOptions { cubin: Some(Arc::from(&b"\x7fELF but not really"[..])), ..DeviceOptions::default() };
        let result = std::panic::catch_unwind(|| DeviceGuard::new(&config, junk)).expect("never a panic");
        assert!(matches!(result, Err(DeviceError::Cubin(_))), "junk is refused before the driver: {result:?}");
        // A real CUBIN (KVGUARD_CUBIN) changes nothing about the missing driver.
        let Some(cubin) = prebuilt_cubin() else { return };
        let options = DeviceOptions { cubin: Some(cubin), ..DeviceOptions::default() };
        let result = std::panic::catch_unwind(|| DeviceGuard::new(&config, options)).expect("never a panic");
        if !kvguard::cuda::driver_available() {
            assert!(matches!(result, Err(DeviceError::DriverNotFound)), "got {result:?}");
        }
    }

    #[test]
    fn gpu_refuses_a_cubin_built_for_another_architecture() {
        let Some(wrong) = cubin_from_env("KVGUARD_WRONG_ARCH_CUBIN") else {
            crate::common::skip::skipped("KVGUARD_WRONG_ARCH_CUBIN is not set");
            return;
        };
        let config = PoolConfig::new(64, PS, 256);
        if guard(&config, 4).is_none() {
            return;
        }
        let options = DeviceOptions { cubin: Some(wrong), ..DeviceOptions::default() };
        match DeviceGuard::new(&config, options) {
            Err(DeviceError::Cubin(why)) => eprintln!("refused as it should be: {why}"),
            other => panic!("a CUBIN for another architecture must be DeviceError::Cubin, got {other:?}"),
        }
    }

    const PS: u32 = 16;

    /// Alice (tenant 1) and bob (tenant 2) with 3 pages each, 40 tokens written.
    fn two_requests() -> (OwnershipTable, Vec<PageId>, Vec<PageId>) {
        let config = PoolConfig::new(64, PS, 256).with_reserved([PageId(0)]);
        let table = OwnershipTable::new(config).unwrap();
        let (alice, bob) = (RequestId(1), RequestId(2));
        table.admit(alice, TenantId(1), 40, 8).unwrap();
        table.admit(bob, TenantId(2), 40, 8).unwrap();
        let pa: Vec<PageId> = table.allocate(alice, 3).unwrap().iter().map(|r| r.page).collect();
        let pb: Vec<PageId> = table.allocate(bob, 3).unwrap().iter().map(|r| r.page).collect();
        table.record_write_tokens(alice, &pa, 0..40).unwrap();
        table.record_write_tokens(bob, &pb, 0..40).unwrap();
        (table, pa, pb)
    }

    #[test]
    fn gpu_verify_agrees_with_the_table_and_replays_in_a_cuda_graph() {
        let (table, pa, pb) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 8) else { return };
        g.upload_all_tags(&table, &es).unwrap();
        let (alice, bob) = (RequestId(1), RequestId(2));
        // seq 0 alice clean; seq 1 bob reads alice's page 1 (foreign); seq 2 alice reads 41 tokens
        // (unwritten); seq 3 bob reads the reserved page; seq 4 bob clean.
        let max_blocks = 4usize;
        let rows: Vec<Vec<PageId>> = vec![pa.clone(), vec![pb[0], pa[1]], pa.clone(), vec![PageId(0)], pb.clone()];
        let readers = [alice, bob, alice, bob, bob];
        let lens = [40i32, 20, 41, 3, 40];
        let mut bt = vec![0i32; rows.len() * max_blocks];
        for (s, row) in rows.iter().enumerate() {
            for (j, p) in row.iter().enumerate() {
                bt[s * max_blocks + j] = p.0 as i32;
            }
        }
        let tenants: Vec<(RequestId, TenantId)> =
            readers.iter().map(|&r| (r, table.request_info(r).unwrap().tenant)).collect();
        g.set_readers(&tenants, &es).unwrap();
        let d_bt = s.clone_htod(&bt).unwrap();
        let d_lens = s.clone_htod(&lens).unwrap();
        let step = BlockTableStep {
            block_table: lend(&s, &d_bt),
            seq_lens: lend(&s, &d_lens),
            num_seqs: rows.len() as u32,
            max_blocks: max_blocks as u32,
            generations: None,
            check_canaries: false,
            query_lens: None,
        };
        s.synchronize().unwrap();

        // Capture the check path (status reset + verify) into a graph and replay it.
        let stream = s.clone();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        g.clear_status(&es).unwrap();
        g.verify_block_table(&step, &es).unwrap();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
        for _ in 0..2 {
            graph.launch().unwrap();
        }
        let status = g.read_status(rows.len() as u32, &es).unwrap();
        for (s, row) in rows.iter().enumerate() {
            let host = table.check_read(readers[s], row, lens[s] as u64).err();
            let device = DeviceKind::from_status(status[s]);
            match host {
                None => assert!(device.is_empty(), "seq {s}: device {device:?}, host clean"),
                Some(v) => assert_eq!(device.iter().map(|k| k.violation_kind()).collect::<Vec<_>>(), vec![v.kind()]),
            }
        }
        let report = g.drain(&table, &es).unwrap();
        assert_eq!(report.violations.len(), 2 * 3, "two replays x three refused sequences");
        assert_eq!(table.counters().get(ViolationKind::ForeignPage), 2);

        // The table changes (alice ends); the same graph, replayed, now sees her pages freed.
        table.release(alice).unwrap();
        assert!(g.sync_tags(&table, &es).unwrap() >= 3);
        graph.launch().unwrap();
        let status = g.read_status(rows.len() as u32, &es).unwrap();
        assert_eq!(status[0], 1 << DeviceKind::FreedPage.code());
        assert_eq!(status[4], 0);
    }

    /// vLLM's Model Runner V2 builds a step's block table and slot mapping on the device: both
    /// are checked there and the refused sequences fenced in place, in one captured graph, with
    /// no host synchronisation; the other sequences run untouched.
    #[test]
    fn gpu_a_device_built_step_is_checked_and_its_refused_sequences_fenced_in_place() {
        let (table, pa, pb) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 8) else { return };
        g.upload_all_tags(&table, &es).unwrap();
        let (alice, bob) = (RequestId(1), RequestId(2));
        // seq 0 alice: clean read, one token written into her own page. seq 1 bob: clean read,
        // but his one token is written into alice's page. seq 2 bob: reads alice's page 1,
        // writes his own page.
        let max_blocks = 4usize;
        let rows: Vec<Vec<PageId>> = vec![pa.clone(), pb.clone(), vec![pb[0], pa[1]]];
        let readers = [alice, bob, bob];
        let lens = [40i32, 40, 20];
        let mut bt = vec![0i32; rows.len() * max_blocks];
        for (q, row) in rows.iter().enumerate() {
            for (j, p) in row.iter().enumerate() {
                bt[q * max_blocks + j] = p.0 as i32;
            }
        }
        let slot = |p: PageId, k: u32| i64::from(p.0 * PS + k);
        // Two tokens for alice, one each for bob's sequences, then CUDA-graph padding.
        let slots = vec![slot(pa[2], 6), slot(pa[2], 7), slot(pa[0], 1), slot(pb[2], 7), -1, -1];
        let qsl = [0i32, 2, 3, 4];
        let tenants: Vec<(RequestId, TenantId)> =
            readers.iter().map(|&r| (r, table.request_info(r).unwrap().tenant)).collect();
        g.set_readers(&tenants, &es).unwrap();
        let d_bt = s.clone_htod(&bt).unwrap();
        let d_lens = s.clone_htod(&lens).unwrap();
        let d_slots = s.clone_htod(&slots).unwrap();
        let d_qsl = s.clone_htod(&qsl).unwrap();
        let n = rows.len() as u32;
        let reads = BlockTableStep::new(lend(&s, &d_bt), lend(&s, &d_lens), n, max_blocks as u32);
        let writes = SlotMappingStep {
            slot_mapping: lend(&s, &d_slots),
            num_tokens: slots.len() as u32,
            query_start_loc: lend(&s, &d_qsl),
            num_seqs: n,
        };
        let fence = FenceStep {
            query_start_loc: lend(&s, &d_qsl),
            num_seqs: n,
            block_table: Some(lend(&s, &d_bt)),
            max_blocks: max_blocks as u32,
            slot_mapping: Some(lend(&s, &d_slots)),
            num_tokens: slots.len() as u32,
        };
        s.synchronize().unwrap();
        let stream = s.clone();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        g.clear_status(&es).unwrap();
        g.verify_slot_mapping(&writes, &es).unwrap();
        g.verify_block_table(&reads, &es).unwrap();
        g.fence_refused(&fence, &es).unwrap();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
        graph.launch().unwrap();
        let status = g.read_status(n, &es).unwrap();
        assert_eq!(status[0], 0, "alice's sequence is clean");
        assert_eq!(status[1], 1 << DeviceKind::ForeignPage.code(), "bob's write into alice's page");
        assert_eq!(status[2], 1 << DeviceKind::ForeignPage.code(), "bob's read of alice's page");
        let fenced_bt = s.clone_dtoh(&d_bt).unwrap();
        let fenced_slots = s.clone_dtoh(&d_slots).unwrap();
        s.synchronize().unwrap();
        assert_eq!(&fenced_bt[..max_blocks], &bt[..max_blocks], "the clean row is untouched");
        assert!(fenced_bt[max_blocks..].iter().all(|&p| p == 0), "both refused rows read the null page");
        assert_eq!(fenced_slots, vec![slots[0], slots[1], -1, -1, -1, -1]);
        let report = g.drain(&table, &es).unwrap();
        let mut who: Vec<(RequestId, ViolationKind)> =
            report.violations.iter().map(|v| (v.request().unwrap(), v.kind())).collect();
        who.sort_by_key(|w| w.0);
        assert_eq!(who, vec![(bob, ViolationKind::ForeignPage), (bob, ViolationKind::ForeignPage)]);
    }

    #[test]
    fn gpu_a_prefix_shared_across_tenants_reads_clean_and_stale_readers_are_refused() {
        let (table, pa, pb) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 8) else { return };
        let (alice, bob) = (RequestId(1), RequestId(2));
        // Alice (tenant 1) publishes her first two pages; tenant 1 opts in; bob (tenant 2) attaches.
        table.publish_prefix(alice, kvguard::PrefixKey(9), &pa[..2]).unwrap();
        table.allow_cross_tenant_sharing(TenantId(1), true);
        table.attach_prefix(bob, kvguard::PrefixKey(9)).unwrap();
        g.sync_tags(&table, &es).unwrap(); // the first sync: every page, the flag included
        let max_blocks = 8usize; // a wide row: the launch is sized by sequence
        let mut bt = vec![0i32; 2 * max_blocks];
        for (j, p) in pa[..2].iter().chain(&pb).enumerate() {
            bt[j] = p.0 as i32; // seq 0: bob through the prefix, then his own pages
        }
        bt[max_blocks] = pa[0].0 as i32; // seq 1: alice through her prefix
        let lens = [32i32 + 40, 16];
        assert!(table.check_read(bob, &[pa[0], pa[1], pb[0], pb[1], pb[2]], 72).is_ok());
        let d_bt = s.clone_htod(&bt).unwrap();
        let d_lens = s.clone_htod(&lens).unwrap();
        let step = BlockTableStep::new(lend(&s, &d_bt), lend(&s, &d_lens), 2, max_blocks as u32);
        // Stale readers: one reader named for a two-sequence step is refused before launching.
        g.set_readers(&[(bob, TenantId(2))], &es).unwrap();
        match g.verify_block_table(&step, &es) {
            Err(DeviceError::Argument(why)) => assert!(why.contains("set_readers"), "{why}"),
            other => panic!("a step over more sequences than readers must be refused, got {other:?}"),
        }
        g.set_readers(&[(bob, TenantId(2)), (alice, TenantId(1))], &es).unwrap();
        g.clear_status(&es).unwrap();
        g.verify_block_table(&step, &es).unwrap();
        assert_eq!(g.read_status(2, &es).unwrap(), vec![0, 0], "the host allows both reads");
        assert!(g.drain(&table, &es).unwrap().violations.is_empty());
    }

    #[test]
    fn gpu_verify_paged_kv_flags_a_stale_generation() {
        let (table, pa, _) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 4) else { return };
        g.upload_all_tags(&table, &es).unwrap();
        g.set_readers(&[(RequestId(1), TenantId(1)); 2], &es).unwrap();
        let gens: Vec<u32> = pa.iter().map(|p| table.page_info(*p).unwrap().generation.0).collect();
        let indices: Vec<i32> = pa.iter().chain(&pa).map(|p| p.0 as i32).collect();
        let mut expected: Vec<u32> = gens.iter().chain(&gens).copied().collect();
        expected[4] += 1; // seq 1, block 1: an incarnation that does not exist
        let d_indptr = s.clone_htod(&[0i32, 3, 6]).unwrap();
        let d_indices = s.clone_htod(&indices).unwrap();
        let d_last = s.clone_htod(&[8i32, 8]).unwrap();
        let d_gens = s.clone_htod(&expected).unwrap();
        g.clear_status(&es).unwrap();
        g.verify_paged_kv(
            &PagedKvStep {
                kv_indptr: lend(&s, &d_indptr),
                kv_indices: lend(&s, &d_indices),
                kv_last_page_len: lend(&s, &d_last),
                num_seqs: 2,
                max_pages_per_seq: 3,
                generations: Some(lend(&s, &d_gens)),
                check_canaries: false,
                query_lens: None,
            },
            &es,
        )
        .unwrap();
        assert_eq!(g.read_status(2, &es).unwrap(), vec![0, 1 << DeviceKind::StalePage.code()]);
        let v = g.drain(&table, &es).unwrap().violations;
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].kind(), v[0].block_index()), (ViolationKind::StalePage, Some(1)));
    }

    #[test]
    fn gpu_verify_token_rows_reads_sglangs_req_to_token_in_place() {
        let (table, pa, pb) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 8) else { return };
        g.upload_all_tags(&table, &es).unwrap();
        let (alice, bob) = (RequestId(1), RequestId(2));
        // SGLang's req_to_token: one token slot per entry (page * PS + offset), 64 entries a row,
        // alice in row 3, bob in row 1, a stale copy of alice's row in row 0 that bob reads.
        let (stride, num_rows) = (64usize, 5usize);
        let mut rt = vec![-1i32; stride * num_rows];
        let mut lay = |row: usize, pages: &[PageId]| {
            for (j, p) in pages.iter().enumerate() {
                for k in 0..PS as usize {
                    rt[row * stride + j * PS as usize + k] = (p.0 * PS) as i32 + k as i32;
                }
            }
        };
        lay(3, &pa);
        lay(1, &pb);
        lay(0, &[pb[0], pa[1]]);
        // Row 2: bob's row, but the entry of its token 1 names alice's slot (off its page's place:
        // a per-token reader reads alice's KV there).
        lay(2, &pb);
        rt[2 * stride + 1] = (pa[0].0 * PS) as i32 + 1;
        // seq 0 alice clean; seq 1 bob clean; seq 2 bob reads row 0 (alice's page 1: foreign,
        // block 1); seq 3 alice reads 41 tokens (unwritten); seq 4 a row past the table; seq 5
        // bob reads row 2 (the off-place entry: foreign).
        let readers = [alice, bob, bob, alice, bob, bob];
        let rows = [3i64, 1, 0, 3, num_rows as i64, 2];
        let lens = [40i64, 40, 20, 41, 4, 40];
        let tenants: Vec<(RequestId, TenantId)> =
            readers.iter().map(|&r| (r, table.request_info(r).unwrap().tenant)).collect();
        g.set_readers(&tenants, &es).unwrap();
        let d_rt = s.clone_htod(&rt).unwrap();
        let d_rows = s.clone_htod(&rows).unwrap();
        let d_lens = s.clone_htod(&lens).unwrap();
        let step = TokenRowsStep {
            req_to_token: lend(&s, &d_rt),
            num_rows: num_rows as u32,
            row_stride: stride as u32,
            rows: lend(&s, &d_rows),
            seq_lens: lend(&s, &d_lens),
            num_seqs: readers.len() as u32,
            max_pages_per_seq: (stride as u32).div_ceil(PS),
        };
        g.clear_status(&es).unwrap();
        g.verify_token_rows(&step, &es).unwrap();
        let status = g.read_status(readers.len() as u32, &es).unwrap();
        let kinds: Vec<Vec<DeviceKind>> = status.iter().map(|&st| DeviceKind::from_status(st)).collect();
        assert_eq!(
            kinds,
            vec![
                vec![],
                vec![],
                vec![DeviceKind::ForeignPage],
                vec![DeviceKind::UnwrittenSlots],
                vec![DeviceKind::BadLayout],
                vec![DeviceKind::ForeignPage]
            ]
        );
        let v = g.drain(&table, &es).unwrap().violations;
        let foreign: Vec<_> = v.iter().filter(|v| v.kind() == ViolationKind::ForeignPage).collect();
        assert_eq!(foreign.len(), 2, "the stale row and the off-place entry: {v:?}");
        assert!(foreign.iter().all(|v| v.request() == Some(bob)));
        assert!(foreign.iter().any(|v| v.block_index() == Some(1)), "the stale row's page 1: {v:?}");
        // Lent too little of req_to_token for its rows: refused before launching.
        let short = TokenRowsStep { num_rows: num_rows as u32 + 1, ..step };
        assert!(matches!(g.verify_token_rows(&short, &es), Err(DeviceError::Argument(_))));
    }

    #[test]
    fn gpu_crc32_matches_crc32fast() {
        let config = PoolConfig::new(8, PS, 64);
        let Some((mut g, s, es)) = guard(&config, 4) else { return };
        let (stride, pages) = (70_001usize, 6usize);
        let data: Vec<u8> = (0..stride * pages).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let d_data = s.clone_htod(&data).unwrap();
        for len in [0usize, 1, 3, 1023, 1024, 1025, 65_536, 70_001] {
            let d_out = s.alloc_zeros::<u32>(pages).unwrap();
            let region = PageRegion {
                base: lend(&s, &d_data),
                page_stride: stride as u64,
                page_bytes: len as u64,
                num_pages: pages as u32,
            };
            g.crc32_pages(region, None, pages as u32, 0, lend(&s, &d_out), &es).unwrap();
            let got = s.clone_dtoh(&d_out).unwrap();
            for (p, &crc) in got.iter().enumerate() {
                assert_eq!(crc, crc32fast::hash(&data[p * stride..p * stride + len]), "page {p}, {len} bytes");
            }
        }
    }

    #[test]
    fn gpu_store_then_fused_attention_fails_closed_on_a_foreign_page() {
        let (table, pa, pb) = two_requests();
        let Some((mut g, s, es)) = guard(table.config(), 4) else { return };
        g.upload_all_tags(&table, &es).unwrap();
        let (alice, bob) = (RequestId(1), RequestId(2));
        let (heads, kv_heads, dim) = (4u32, 2u32, 64u32);
        let width = (kv_heads * dim) as usize;
        let slots = (64 * PS) as usize;
        // Store 40 tokens for each of alice and bob through the reference store (stamps canaries).
        let slot_of = |pages: &[PageId], t: usize| i64::from(pages[t / PS as usize].0 * PS) + (t % PS as usize) as i64;
        let mapping: Vec<i64> = (0..80).map(|t| if t < 40 { slot_of(&pa, t) } else { slot_of(&pb, t - 40) }).collect();
        let key: Vec<f32> = (0..80 * width).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        let value: Vec<f32> = (0..80 * width).map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0).collect();
        g.set_readers(&[(alice, TenantId(1)), (bob, TenantId(2))], &es).unwrap();
        let s = s.clone();
        let (d_k, d_v) = (s.clone_htod(&key).unwrap(), s.clone_htod(&value).unwrap());
        let d_kc = s.alloc_zeros::<f32>(slots * width).unwrap();
        let d_vc = s.alloc_zeros::<f32>(slots * width).unwrap();
        let (d_map, d_qsl) = (s.clone_htod(&mapping).unwrap(), s.clone_htod(&[0i32, 40, 80]).unwrap());
        g.store_kv(
            &KvStore {
                key: lend(&s, &d_k),
                value: lend(&s, &d_v),
                key_cache: lend(&s, &d_kc),
                value_cache: lend(&s, &d_vc),
                slot_mapping: lend(&s, &d_map),
                num_tokens: 80,
                kv_width: width as u32,
                query_start_loc: lend(&s, &d_qsl),
                num_seqs: 2,
            },
            &es,
        )
        .unwrap();
        // Decode: alice reads her 40 tokens; bob reads his first page and alice's second (foreign).
        let max_blocks = 3usize;
        let bt: Vec<i32> = vec![pa[0].0, pa[1].0, pa[2].0, pb[0].0, pa[1].0, 0].into_iter().map(|p| p as i32).collect();
        let q: Vec<f32> = (0..2 * heads * dim).map(|i| ((i * 29 % 89) as f32 / 44.0) - 1.0).collect();
        let (d_bt, d_lens, d_q) =
            (s.clone_htod(&bt).unwrap(), s.clone_htod(&[40i32, 32]).unwrap(), s.clone_htod(&q).unwrap());
        let d_out = s.alloc_zeros::<f32>((2 * heads * dim) as usize).unwrap();
        let shape = AttentionShape {
            num_seqs: 2,
            max_blocks: max_blocks as u32,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: dim,
            scale: 1.0 / (dim as f32).sqrt(),
        };
        g.clear_status(&es).unwrap();
        let attn = DecodeAttention {
            shape,
            q: lend(&s, &d_q),
            key_cache: lend(&s, &d_kc),
            value_cache: lend(&s, &d_vc),
            block_table: lend(&s, &d_bt),
            seq_lens: lend(&s, &d_lens),
            out: lend(&s, &d_out),
            workspace: None,
        };
        g.decode_attention_checked(&attn, AttentionCheck { check_canaries: true, fail_closed: true }, &es).unwrap();
        let out = s.clone_dtoh(&d_out).unwrap();
        assert_eq!(g.read_status(2, &es).unwrap(), vec![0, 1 << DeviceKind::ForeignPage.code()]);
        let per_seq = (heads * dim) as usize;
        assert!(out[per_seq..].iter().all(|&x| x == 0.0), "bob's output is zeros: fail closed");
        // Alice's output against a naive attention over what the store wrote.
        for h in 0..heads as usize {
            let kvh = h / (heads / kv_heads) as usize;
            let qh = &q[h * dim as usize..][..dim as usize];
            let rows: Vec<usize> = (0..40).map(|t| t * width + kvh * dim as usize).collect();
            let scores: Vec<f64> = rows
                .iter()
                .map(|&r| qh.iter().zip(&key[r..]).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() / 8.0)
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let total: f64 = w.iter().sum();
            for d in 0..dim as usize {
                let want = rows.iter().zip(&w).map(|(&r, wt)| wt * f64::from(value[r + d])).sum::<f64>() / total;
                let got = out[h * dim as usize + d];
                assert!((f64::from(got) - want).abs() < 1e-4, "head {h} dim {d}: {got} vs {want}");
            }
        }
        let report = g.drain(&table, &es).unwrap();
        assert_eq!(report.violations.len(), 1);
        assert_eq!(report.violations[0].kind(), ViolationKind::ForeignPage);
        assert_eq!(report.violations[0].request(), Some(bob));
    }
}
