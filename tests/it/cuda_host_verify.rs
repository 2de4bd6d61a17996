//! The verification kernels, compiled as host C++ and run on the CPU over a simulated grid
//! (kernels/host/), against the ownership table's own verdicts: both block-table layouts on
//! hand-made and random steps with injected violations (foreign, freed, reserved, out of range,
//! stale generation, unwritten, too short), the violation ring, canaries stamped by the reference
//! KV store and checked by the reads, only for the slots written before the step (query lengths);
//! prefixes shared across tenants, forks and prefix reads through the incrementally synced tag
//! mirror. Needs only a C++17 compiler (see `cuda_host_sim.rs`).

/// Under `cuda::` so that `cargo test cuda` selects these.
mod cuda {
    use crate::common::host_sim::{Case, NUM_PAGES, PS, Pool, Rng, driver, pool};
    use kvguard::cuda::layout::{DeviceKind, DeviceReader, DeviceTag, DeviceViolation, RingDrain, canary};
    use kvguard::step::SlotRead;
    use kvguard::{
        BlockRows, Generation, OwnershipTable, PageId, PageRef, PageState, Policy, PoolConfig, PrefixKey, RequestId,
        TenantId, ViolationKind,
    };
    use std::collections::HashMap;
    use std::path::Path;

    /// One sequence of a step: reader, block-table row (padded to the row stride), tokens, and the
    /// generations the engine recorded for each entry.
    #[derive(Clone, Debug)]
    struct Seq {
        reader: RequestId,
        row: Vec<i32>,
        tokens: u64,
        gens: Vec<u32>,
    }

    const MAX_BLOCKS: usize = 6;

    /// Hand-made sequences, one per kind of violation, then random ones.
    fn sequences(pool: &Pool, rng: &mut Rng, random: usize) -> Vec<Seq> {
        let t = &pool.table;
        let gen_of = |p: i32| -> u32 {
            if p >= 0 && (p as u32) < NUM_PAGES { t.page_info(PageId(p as u32)).unwrap().generation.0 } else { 1 }
        };
        let mk = |reader: RequestId, pages: &[PageId], tokens: u64, rng: &mut Rng| -> Seq {
            let mut row: Vec<i32> = pages.iter().map(|p| p.0 as i32).collect();
            while row.len() < MAX_BLOCKS {
                row.push(rng.below(u64::from(NUM_PAGES) + 8) as i32 - 4); // padding: never read
            }
            let gens = row.iter().map(|&p| gen_of(p)).collect();
            Seq { reader, row, tokens, gens }
        };
        let r = &pool.requests;
        let (a, b, c, d, f) = (&r[0], &r[1], &r[2], &r[3], &r[4]);
        let mut seqs = vec![
            mk(a.0, &a.2, 14, rng),                                      // clean
            mk(b.0, &b.2, 20, rng),                                      // clean, through a prefix
            mk(c.0, &[c.2[0], a.2[3]], 8, rng),                          // foreign page, block 1
            mk(c.0, &[pool.freed], 3, rng),                              // freed page
            mk(d.0, &[d.2[0], PageId(0)], 5, rng),                       // reserved page, block 1
            mk(d.0, &[d.2[0], PageId(NUM_PAGES + 5)], 5, rng),           // out of range, block 1
            mk(a.0, &a.2, 16, rng),                                      // unwritten slots 14..16
            mk(c.0, &c.2, (MAX_BLOCKS as u64) * u64::from(PS) + 1, rng), // block table too short
            mk(c.0, &[pool.prefix[0]], 4, rng),                          // another tenant's prefix
            mk(d.0, &d.2, 5, rng),                                       // clean
            mk(f.0, &[pool.reused], 4, rng),                             // clean (stale below)
            mk(f.0, &[], 0, rng),                                        // reads nothing
        ];
        // The engine still holds the ended incarnation of the reused page: stale.
        let mut stale = mk(f.0, &[pool.reused], 4, rng);
        stale.gens[0] = 1;
        seqs.push(stale);
        for _ in 0..random {
            let (reader, _, readable, written) = &r[rng.below(r.len() as u64) as usize];
            let n = 1 + rng.below(MAX_BLOCKS as u64) as usize;
            let pages: Vec<PageId> = (0..n)
                .map(|i| match rng.below(10) {
                    0..=6 if !readable.is_empty() => readable[i % readable.len()],
                    _ => PageId(rng.below(u64::from(NUM_PAGES) + 4) as u32),
                })
                .collect();
            let tokens = match rng.below(3) {
                0 => (*written).min(n as u64 * u64::from(PS)),
                _ => rng.below(n as u64 * u64::from(PS) + 3),
            };
            let mut s = mk(*reader, &pages, tokens, rng);
            if rng.below(8) == 0 {
                let i = rng.below(n as u64) as usize;
                s.gens[i] = s.gens[i].wrapping_add(1);
            }
            seqs.push(s);
        }
        seqs
    }

    /// The host table's verdict on one sequence: `None` or (kind, block index).
    fn host_verdict(
        pool: &Pool,
        s: &Seq,
        entries: usize,
        with_generations: bool,
    ) -> Option<(ViolationKind, Option<u32>)> {
        let row = &s.row[..entries];
        if with_generations {
            let refs: Vec<PageRef> = row
                .iter()
                .zip(&s.gens)
                .map(|(&p, &g)| PageRef { page: PageId(p as u32), generation: Generation(g) })
                .collect();
            pool.table.drain_violations();
            pool.table.verify_read_refs(s.reader, &refs, s.tokens).unwrap(); // report policy
            let mut v = pool.table.drain_violations();
            assert!(v.len() <= 1);
            v.pop().map(|v| (v.kind(), v.block_index()))
        } else {
            let pages: Vec<PageId> = row.iter().map(|&p| PageId(p as u32)).collect();
            pool.table.check_read(s.reader, &pages, s.tokens).err().map(|v| (v.kind(), v.block_index()))
        }
    }

    /// The device's verdict on sequence `i`: the first (lowest block) record, and the status word.
    fn device_verdict(records: &[DeviceViolation], status: &[u32], i: usize) -> Option<(DeviceKind, u32)> {
        let first = records.iter().filter(|r| r.seq == i as u32).min_by_key(|r| r.block);
        match (status[i], first) {
            (0, None) => None,
            (0, Some(r)) => panic!("seq {i}: a record {r:?} but a clear status"),
            (_, None) => panic!("seq {i}: status {:#x} but no record", status[i]),
            (st, Some(r)) => {
                let k = r.device_kind().unwrap();
                assert!(st & (1 << k.code()) != 0, "seq {i}: status {st:#x} lacks the recorded kind {k:?}");
                Some((k, r.block))
            }
        }
    }

    fn readers_of(pool: &Pool, seqs: &[Seq]) -> Vec<DeviceReader> {
        seqs.iter().map(|s| DeviceReader::new(s.reader, pool.tenant(s.reader))).collect()
    }

    fn run_block_table(
        exe: &Path,
        pool: &Pool,
        seqs: &[Seq],
        gens: bool,
        canaries: Option<&[u32]>,
    ) -> (Vec<u32>, RingDrain) {
        let mut case = Case::new("verify-bt");
        let table: Vec<i32> = seqs.iter().flat_map(|s| s.row.clone()).collect();
        let lens: Vec<i32> = seqs.iter().map(|s| s.tokens as i32).collect();
        case.tags("tags", &pool.device_tags())
            .readers("readers", &readers_of(pool, seqs))
            .i32s("block_table", &table)
            .i32s("seq_lens", &lens)
            .param("page_size", PS)
            .param("max_blocks", MAX_BLOCKS)
            .param("ring_capacity", 4096)
            .param("grid_x", 1)
            .param("grid_y", 3); // fewer blocks than sequences: grid-stride loops cover the rest
        if gens {
            case.u32s("generations", &seqs.iter().flat_map(|s| s.gens.clone()).collect::<Vec<_>>());
        }
        if let Some(c) = canaries {
            case.u32s("canaries", c);
        }
        case.run(exe, "verify_block_table");
        (case.out_u32("status"), case.ring())
    }

    fn assert_agrees(pool: &Pool, seqs: &[Seq], status: &[u32], ring: &RingDrain, gens: bool, flashinfer: bool) {
        assert_eq!(ring.incomplete, 0);
        assert_eq!(ring.dropped_total, 0);
        let mut caught = HashMap::new();
        for (i, s) in seqs.iter().enumerate() {
            let entries = if flashinfer { s.tokens.div_ceil(u64::from(PS)) as usize } else { MAX_BLOCKS };
            let host = host_verdict(pool, s, entries, gens);
            let device = device_verdict(&ring.records, status, i);
            match (host, device) {
                (None, None) => {}
                (Some((hk, hb)), Some((dk, db))) => {
                    assert_eq!(dk.violation_kind(), hk, "seq {i} {s:?}: device {dk:?} vs host {hk:?}");
                    if hk != ViolationKind::BlockTableTooShort {
                        assert_eq!(Some(db), hb, "seq {i} {s:?}: device block {db} vs host {hb:?}");
                    }
                    *caught.entry(hk).or_insert(0) += 1;
                }
                (h, d) => panic!("seq {i} {s:?}: host {h:?} vs device {d:?}"),
            }
        }
        let mut want = vec![
            ViolationKind::ForeignPage,
            ViolationKind::FreedPage,
            ViolationKind::ReservedPage,
            ViolationKind::PageOutOfRange,
            ViolationKind::UnwrittenSlots,
        ];
        if gens {
            want.push(ViolationKind::StalePage);
        }
        if !flashinfer {
            want.push(ViolationKind::BlockTableTooShort);
        }
        for k in want {
            assert!(caught.get(&k).copied().unwrap_or(0) > 0, "no {k:?} among the injected violations: {caught:?}");
        }
    }

    #[test]
    fn verify_block_table_agrees_with_the_table() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(11);
        let seqs = sequences(&pool, &mut rng, 60);
        for gens in [false, true] {
            let (status, ring) = run_block_table(exe, &pool, &seqs, gens, None);
            assert_agrees(&pool, &seqs, &status, &ring, gens, false);
            // Every record says who read what, and converts to a host violation.
            for r in &ring.records {
                let v = r.to_violation().unwrap();
                assert_eq!(v.request(), Some(seqs[r.seq as usize].reader));
            }
        }
    }

    fn run_paged_kv(exe: &Path, pool: &Pool, seqs: &[Seq], gens: bool) -> (Vec<u32>, RingDrain) {
        let (mut indptr, mut indices, mut last, mut g) = (vec![0i32], Vec::new(), Vec::new(), Vec::new());
        for s in seqs {
            let n = s.tokens.div_ceil(u64::from(PS)) as usize;
            indices.extend_from_slice(&s.row[..n]);
            g.extend_from_slice(&s.gens[..n]);
            indptr.push(indices.len() as i32);
            last.push(if n == 0 { 0 } else { (s.tokens - (n as u64 - 1) * u64::from(PS)) as i32 });
        }
        let mut case = Case::new("verify-pkv");
        case.tags("tags", &pool.device_tags())
            .readers("readers", &readers_of(pool, seqs))
            .i32s("kv_indptr", &indptr)
            .i32s("kv_indices", &indices)
            .i32s("kv_last_page_len", &last)
            .param("page_size", PS)
            .param("ring_capacity", 4096)
            .param("grid_x", 1)
            .param("grid_y", 4);
        if gens {
            case.u32s("generations", &g);
        }
        case.run(exe, "verify_paged_kv");
        (case.out_u32("status"), case.ring())
    }

    #[test]
    fn verify_paged_kv_agrees_with_the_table() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(12);
        let seqs: Vec<Seq> = sequences(&pool, &mut rng, 60)
            .into_iter()
            .filter(|s| s.tokens <= (MAX_BLOCKS as u64) * u64::from(PS)) // the layout cannot be short
            .collect();
        for gens in [false, true] {
            let (status, ring) = run_paged_kv(exe, &pool, &seqs, gens);
            assert_agrees(&pool, &seqs, &status, &ring, gens, true);
        }
    }

    #[test]
    fn verify_paged_kv_refuses_malformed_steps() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let (a, t, pages, _) = &pool.requests[0];
        let reader = DeviceReader::new(*a, *t);
        let indices: Vec<i32> = pages.iter().map(|p| p.0 as i32).collect();
        // seq 0: last_page_len 0 with pages; seq 1: last_page_len > page_size; seq 2: indptr past
        // kv_indices; seq 3: indptr going backwards.
        let indptr = [0, 2, 3, 9, 4];
        let last = [0, PS as i32 + 1, 2, 4];
        let mut case = Case::new("verify-pkv-bad");
        case.tags("tags", &pool.device_tags())
            .readers("readers", &[reader; 4])
            .i32s("kv_indptr", &indptr)
            .i32s("kv_indices", &indices)
            .i32s("kv_last_page_len", &last)
            .param("page_size", PS)
            .param("ring_capacity", 64)
            .param("grid_x", 1)
            .param("grid_y", 4);
        case.run(exe, "verify_paged_kv");
        let status = case.out_u32("status");
        let bad = 1 << DeviceKind::BadLayout.code();
        assert_eq!(&status[..3], &[bad, bad, bad]);
        assert_eq!(status[3], bad);
        let kinds: Vec<_> = case.ring().records.iter().map(|r| r.to_violation().unwrap().kind()).collect();
        assert_eq!(kinds, vec![ViolationKind::SlotOutOfRange; 4]);
    }

    /// `seqs` laid out as SGLang's `req_to_token`: one token slot per entry (`page * PS +
    /// offset`, -1 for a padding entry), each sequence's row at a scrambled place among rows
    /// nobody reads (never assigned: -1).
    fn token_rows(seqs: &[Seq]) -> (Vec<i32>, Vec<i64>, usize) {
        let stride = MAX_BLOCKS * PS as usize;
        let num_rows = 2 * seqs.len() + 1;
        let mut rt = vec![-1i32; num_rows * stride];
        let at: Vec<i64> = (0..seqs.len()).map(|i| (num_rows - 2 - 2 * i) as i64).collect();
        for (s, &row) in seqs.iter().zip(&at) {
            for (j, &page) in s.row.iter().enumerate() {
                for k in 0..PS as usize {
                    let slot = if page < 0 { -1 } else { page * PS as i32 + k as i32 };
                    rt[row as usize * stride + j * PS as usize + k] = slot;
                }
            }
        }
        (rt, at, num_rows)
    }

    fn run_token_rows(exe: &Path, pool: &Pool, seqs: &[Seq], rows: &[i64], lens: &[i64]) -> (Vec<u32>, RingDrain) {
        let (rt, _, num_rows) = token_rows(seqs);
        run_token_rows_in(exe, pool, seqs, &rt, num_rows, rows, lens)
    }

    fn run_token_rows_in(
        exe: &Path,
        pool: &Pool,
        seqs: &[Seq],
        rt: &[i32],
        num_rows: usize,
        rows: &[i64],
        lens: &[i64],
    ) -> (Vec<u32>, RingDrain) {
        run_token_rows_of_stride(exe, pool, seqs, (rt, MAX_BLOCKS * PS as usize), num_rows, rows, lens)
    }

    fn run_token_rows_of_stride(
        exe: &Path,
        pool: &Pool,
        seqs: &[Seq],
        (rt, stride): (&[i32], usize),
        num_rows: usize,
        rows: &[i64],
        lens: &[i64],
    ) -> (Vec<u32>, RingDrain) {
        let mut case = Case::new("verify-rows");
        case.tags("tags", &pool.device_tags())
            .readers("readers", &readers_of(pool, seqs))
            .i32s("req_to_token", rt)
            .i64s("rows", rows)
            .i64s("seq_lens", lens)
            .param("page_size", PS)
            .param("row_stride", stride)
            .param("num_rows", num_rows)
            .param("ring_capacity", 4096)
            .param("grid_x", 1)
            .param("grid_y", 5);
        case.run(exe, "verify_token_rows");
        (case.out_u32("status"), case.ring())
    }

    #[test]
    fn verify_token_rows_agrees_with_the_table() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(13);
        let seqs = sequences(&pool, &mut rng, 60);
        let (_, rows, _) = token_rows(&seqs);
        let lens: Vec<i64> = seqs.iter().map(|s| s.tokens as i64).collect();
        let (status, ring) = run_token_rows(exe, &pool, &seqs, &rows, &lens);
        // The rows read in place say what the same pages as a block table say, block by block.
        assert_agrees(&pool, &seqs, &status, &ring, false, false);
        for r in &ring.records {
            assert_eq!(r.to_violation().unwrap().request(), Some(seqs[r.seq as usize].reader));
        }
    }

    #[test]
    fn verify_token_rows_reads_every_entry_of_a_page_as_a_per_token_reader_would() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(15);
        let clean: Vec<Seq> = sequences(&pool, &mut rng, 0).into_iter().take(1).collect();
        let seqs = vec![clean[0].clone(); 3];
        let (mut rt, rows, num_rows) = token_rows(&seqs);
        let stride = MAX_BLOCKS * PS as usize;
        let tokens = clean[0].tokens as usize;
        let foreign = pool.requests[2].2[0].0 as i32 * PS as i32 + 1;
        // seq 0: clean; 1: a token inside its first page names another request's slot; 2: the
        // same entry past the tokens read (not read).
        rt[rows[1] as usize * stride + 1] = foreign;
        rt[rows[2] as usize * stride + tokens] = foreign;
        let lens = vec![tokens as i64; 3];
        let (status, ring) = run_token_rows_in(exe, &pool, &seqs, &rt, num_rows, &rows, &lens);
        assert_eq!(status, vec![0, 1 << DeviceKind::ForeignPage.code(), 0]);
        let kinds: Vec<_> = ring.records.iter().map(|r| (r.seq, r.to_violation().unwrap().kind())).collect();
        assert_eq!(kinds, vec![(1, ViolationKind::ForeignPage)]);
    }

    #[test]
    fn verify_token_rows_refuses_malformed_steps() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(14);
        let clean: Vec<Seq> = sequences(&pool, &mut rng, 0).into_iter().take(1).collect();
        let seqs = vec![clean[0].clone(); 5];
        let (_, rows, num_rows) = token_rows(&seqs);
        let max = (MAX_BLOCKS * PS as usize) as i64;
        // seq 0: clean; 1: a row past the table; 2: a negative row; 3: a negative length;
        // 4: more tokens than the row has entries.
        let rows = [rows[0], num_rows as i64, -1, rows[3], rows[4]];
        let lens = [clean[0].tokens as i64, 4, 4, -1, max + 1];
        let (status, ring) = run_token_rows(exe, &pool, &seqs, &rows, &lens);
        let bad = 1 << DeviceKind::BadLayout.code();
        assert_eq!(&status[..4], &[0, bad, bad, bad]);
        assert_eq!(status[4], 1 << DeviceKind::BlockTableTooShort.code());
        let mut kinds: Vec<_> = ring.records.iter().map(|r| (r.seq, r.to_violation().unwrap().kind())).collect();
        kinds.sort_by_key(|k| k.0);
        assert_eq!(
            kinds,
            vec![
                (1, ViolationKind::SlotOutOfRange),
                (2, ViolationKind::SlotOutOfRange),
                (3, ViolationKind::SlotOutOfRange),
                (4, ViolationKind::BlockTableTooShort)
            ]
        );
    }

    /// A row need not end at a page's end (SGLang's rows are the model's context length): a read
    /// may run to the row's last entry, and one past it is refused as `block_table_too_short`,
    /// whatever the slots of the page the row ends inside hold, as the host check says.
    #[test]
    fn verify_token_rows_refuses_a_read_past_a_rows_end_inside_its_last_page() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let (c, pages) = (pool.requests[2].0, &pool.requests[2].2); // 4 pages, 16 tokens written
        // Rows of two pages and one entry (9 entries): c's in place at row 1 of three. Its third
        // page's first slots are written, but the row has an entry for one of them only.
        let stride = 2 * PS as usize + 1;
        let slot = |i: usize| pages[i / PS as usize].0 as i32 * PS as i32 + (i % PS as usize) as i32;
        let mut rt = vec![-1i32; 3 * stride];
        for i in 0..stride {
            rt[stride + i] = slot(i);
        }
        let seqs = vec![Seq { reader: c, row: vec![], tokens: 0, gens: vec![] }; 4];
        let lens = [9i64, 10, 12, 1];
        let (status, ring) = run_token_rows_of_stride(exe, &pool, &seqs, (&rt, stride), 3, &[1, 1, 1, 1], &lens);
        let short = 1 << DeviceKind::BlockTableTooShort.code();
        assert_eq!(status, vec![0, short, short, 0]);
        // The host check of the same row says the same, with the same amounts.
        let row = BlockRows::new(&rt[stride..2 * stride], stride).unwrap();
        let reads: Vec<_> = lens.iter().map(|&n| SlotRead { request: c, row: 0, from: 0, tokens: n as u64 }).collect();
        let host = pool.table.check_slot_rows(row, &reads).unwrap();
        let mut device: Vec<_> = ring.records.iter().map(|r| (r.seq as usize, r.to_violation().unwrap())).collect();
        device.sort_by_key(|d| d.0);
        assert_eq!(device.len(), host.refused.len());
        for ((ds, dv), (hs, hv)) in device.iter().zip(&host.refused) {
            assert_eq!((*ds, dv.kind(), dv.amounts()), (*hs, hv.kind(), hv.amounts()));
        }
        assert_eq!(device.iter().map(|d| d.1.amounts()).collect::<Vec<_>>(), vec![Some((10, 8)), Some((12, 8))]);
    }

    /// A page's slots may run past `i32::MAX` (a pool of 2^31 slots or more, at a page size that
    /// is not a power of two): an entry is compared with its page's slot in 64 bits, as the host
    /// check compares it, so an entry that `own + k` in int32 would wrap onto is refused.
    #[test]
    fn verify_token_rows_compares_entries_past_i32_max_without_wrapping() {
        let Some(exe) = driver() else { return };
        // Page 42,966 of 49,981 slots starts at 2^31 - 2: its third slot is 2^31, past any entry.
        let (ps, num_pages) = (49_981u32, 42_967u32);
        let t = OwnershipTable::new(PoolConfig::new(num_pages, ps, 1 << 20).with_policy(Policy::Report)).unwrap();
        let a = RequestId(1);
        t.admit(a, TenantId(1), 3, 0).unwrap();
        let page = PageId(num_pages - 1);
        t.claim(a, &[page]).unwrap();
        t.record_write(a, page, 0..3).unwrap();
        let own = (page.0 * ps) as i32;
        assert_eq!(own, i32::MAX - 1);
        let tags: Vec<DeviceTag> =
            (0..num_pages).map(|p| DeviceTag::from_page_info(&t.page_info(PageId(p)).unwrap())).collect();
        // In place, then the third entry as `own + 2` wraps in int32, then any other negative entry.
        for (third, refused) in [(None, false), (Some(i32::MIN), true), (Some(-7), true)] {
            let row = match third {
                Some(e) => vec![own, own + 1, e],
                None => vec![own, own + 1, -1], // two tokens read: the third entry is not read
            };
            let tokens = if third.is_some() { 3 } else { 2 };
            let host = t
                .check_slot_rows(BlockRows::new(&row, 3).unwrap(), &[SlotRead { request: a, row: 0, from: 0, tokens }])
                .unwrap();
            let mut case = Case::new("verify-rows-wide");
            case.tags("tags", &tags)
                .readers("readers", &[DeviceReader::new(a, TenantId(1))])
                .i32s("req_to_token", &row)
                .i64s("rows", &[0])
                .i64s("seq_lens", &[tokens as i64])
                .param("page_size", ps)
                .param("row_stride", 3)
                .param("num_rows", 1)
                .param("ring_capacity", 64)
                .param("grid_x", 1)
                .param("grid_y", 1);
            case.run(exe, "verify_token_rows");
            let status = case.out_u32("status");
            let device: Vec<_> = case.ring().records.iter().map(|r| r.to_violation().unwrap().kind()).collect();
            let host: Vec<_> = host.refused.iter().map(|(_, v)| v.kind()).collect();
            assert_eq!(host, device, "third entry {third:?}");
            assert_eq!(status[0] != 0, refused, "third entry {third:?}");
            assert_eq!(host.is_empty(), !refused);
        }
    }

    /// A token past the last sequence's range (or in no ordered range) has no writer: the store
    /// writes nothing for it and reports it, as the slot-mapping check does; the sequences' own
    /// tokens are stored as before.
    #[test]
    fn the_store_writes_nothing_for_a_token_of_no_sequence() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let (a, ta, pa, _) = pool.requests[0].clone();
        let kv_width = 4usize;
        let n_slots = (NUM_PAGES * PS) as usize;
        // Token 0 is a's (query_start_loc [0, 1]); token 1 is nobody's and names a written slot of
        // a's own page, which a writer-less store must not overwrite.
        let mapping = [i64::from(pa[3].0 * PS) + 2, i64::from(pa[2].0 * PS) + 1];
        let key: Vec<u32> = (0..mapping.len() * kv_width).map(|i| 1000 + i as u32).collect();
        let cache = vec![7u32; n_slots * kv_width];
        let mut case = Case::new("store-nobody");
        case.u32s("key", &key)
            .u32s("value", &key)
            .u32s("key_cache", &cache)
            .u32s("value_cache", &cache)
            .i64s("slot_mapping", &mapping)
            .i32s("query_start_loc", &[0, 1])
            .readers("writers", &[DeviceReader::new(a, ta)])
            .tags("tags", &pool.device_tags())
            .u32s("canaries", &vec![0u32; n_slots])
            .param("kv_width", kv_width)
            .param("page_size", PS)
            .param("ring_capacity", 64);
        case.run(exe, "store");
        let out = case.out_u32("key_cache");
        let (own, nobody) = (mapping[0] as usize * kv_width, mapping[1] as usize * kv_width);
        assert_eq!(&out[own..own + kv_width], &key[..kv_width], "a's own token is stored");
        assert_eq!(&out[nobody..nobody + kv_width], &cache[nobody..nobody + kv_width], "nobody's token is not");
        assert_eq!(case.out_u32("canaries")[mapping[1] as usize], 0, "nor its canary stamped");
        assert_eq!(case.out_u32("status"), vec![0], "no sequence is flagged for it");
        let records: Vec<_> = case.ring().records.iter().map(|r| (r.seq, r.device_kind())).collect();
        assert_eq!(records, vec![(1, Some(DeviceKind::BadLayout))]);
    }

    /// `n` sequences of request `c`, each reading its own first page then `bad` foreign blocks.
    fn foreign_reads(pool: &Pool, n: usize, bad: &[usize]) -> (Vec<Seq>, Vec<i32>) {
        let c = &pool.requests[2];
        let foreign = pool.requests[0].2[3];
        let seqs: Vec<Seq> = (0..n)
            .map(|i| {
                let mut row = vec![c.2[0].0 as i32; MAX_BLOCKS];
                for b in row.iter_mut().skip(1).take(bad[i]) {
                    *b = foreign.0 as i32;
                }
                Seq { reader: c.0, row, tokens: (bad[i] as u64 + 1) * u64::from(PS), gens: vec![1; MAX_BLOCKS] }
            })
            .collect();
        let lens = seqs.iter().map(|s| s.tokens as i32).collect();
        (seqs, lens)
    }

    fn run_ring(
        exe: &Path,
        pool: &Pool,
        seqs: &[Seq],
        lens: &[i32],
        capacity: u32,
        name: &str,
    ) -> (Vec<u32>, RingDrain) {
        let mut case = Case::new(name);
        let table: Vec<i32> = seqs.iter().flat_map(|s| s.row.clone()).collect();
        case.tags("tags", &pool.device_tags())
            .readers("readers", &readers_of(pool, seqs))
            .i32s("block_table", &table)
            .i32s("seq_lens", lens)
            .param("page_size", PS)
            .param("max_blocks", MAX_BLOCKS)
            .param("ring_capacity", capacity)
            .param("grid_x", 1)
            .param("grid_y", seqs.len() as u32);
        case.run(exe, "verify_block_table");
        (case.out_u32("status"), case.ring())
    }

    #[test]
    fn a_full_ring_drops_and_counts_instead_of_overwriting() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        // 5 sequences x 2 foreign blocks = 10 findings, 5 of them first; a ring of 4.
        let (seqs, lens) = foreign_reads(&pool, 5, &[2; 5]);
        let (status, ring) = run_ring(exe, &pool, &seqs, &lens, 4, "ring-full");
        assert!(status.iter().all(|&s| s == 1 << DeviceKind::ForeignPage.code()));
        assert!(ring.records.len() <= 4 && !ring.records.is_empty());
        assert_eq!(ring.incomplete, 0, "no position reserved and left unwritten");
        assert_eq!(ring.dropped_total, 10 - ring.records.len() as u64, "every finding kept or counted");
        assert_eq!(ring.consumed, ring.records.len() as u64 + u64::from(ring.first_findings_dropped));
        // Each sequence is named in a record, or counted as a first finding lost.
        let named: std::collections::BTreeSet<u32> = ring.records.iter().map(|r| r.seq).collect();
        assert_eq!(named.len() as u32 + ring.first_findings_dropped, 5, "{:?}", ring.records);
        assert!(ring.first_findings_dropped >= 1, "5 first findings cannot all fit in 4 records");
    }

    #[test]
    fn one_request_with_every_page_bad_cannot_crowd_out_anothers_finding() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        // Sequence 0 reads 5 foreign blocks, sequence 1 one. A ring of 4: sequence 0's further
        // findings take at most half of it, whichever is checked first.
        let (seqs, lens) = foreign_reads(&pool, 2, &[5, 1]);
        let (status, ring) = run_ring(exe, &pool, &seqs, &lens, 4, "ring-crowd");
        assert!(status.iter().all(|&s| s == 1 << DeviceKind::ForeignPage.code()));
        let per_seq = |s: u32| ring.records.iter().filter(|r| r.seq == s).count();
        assert_eq!(per_seq(1), 1, "the other request's finding kept: {:?}", ring.records);
        assert!(per_seq(0) >= 1 && per_seq(0) <= 3, "{:?}", ring.records);
        assert_eq!(ring.first_findings_dropped, 0);
        assert_eq!(ring.dropped_total, 6 - ring.records.len() as u64);
        assert_eq!(ring.incomplete, 0);
    }

    // ------------------------------------------------------------------------------------------------
    // Canaries: stamped by the store, checked by the reads
    // ------------------------------------------------------------------------------------------------

    #[test]
    fn canaries_catch_kv_the_current_incarnation_never_wrote() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(5);
        let seqs = sequences(&pool, &mut rng, 0);
        let good = pool.canaries();
        // With correct canaries, the canary check adds nothing to what the tags decide.
        let (status, ring) = run_block_table(exe, &pool, &seqs, false, Some(&good));
        assert_agrees(&pool, &seqs, &status, &ring, false, false);

        // The incident: the table says alice's page is hers and written, but slot 2 of her page 1
        // holds KV the previous incarnation wrote (the engine's write went elsewhere).
        let (a, ..) = pool.requests[0];
        let page = pool.requests[0].2[1];
        let mut bad = good.clone();
        bad[(page.0 * PS + 2) as usize] = canary(a.0, 0, page.0, 2);
        assert!(pool.table.check_read(a, &pool.requests[0].2, 14).is_ok(), "the host table sees nothing wrong");
        let (status, ring) = run_block_table(exe, &pool, &seqs, false, Some(&bad));
        assert_eq!(status[0], 1 << DeviceKind::CanaryMismatch.code());
        let r = ring.records.iter().find(|r| r.seq == 0).unwrap();
        assert_eq!((r.block, r.page, r.slot_start, r.slot_end), (1, page.0 as i32, 2, 3));
        let v = r.to_violation().unwrap();
        assert_eq!(v.kind(), ViolationKind::UnwrittenSlots);
        assert_eq!(v.slots(), Some((2, 3)));

        // The reused page still carries the canaries its last incarnation stamped: refused.
        let f = &pool.requests[4];
        let mut stale = good.clone();
        for s in 0..PS {
            stale[(pool.reused.0 * PS + s) as usize] = canary(5, 1, pool.reused.0, s);
        }
        let (status, _) = run_block_table(exe, &pool, &seqs, false, Some(&stale));
        let i = seqs.iter().position(|s| s.reader == f.0 && s.tokens == 4).unwrap();
        assert_eq!(status[i], 1 << DeviceKind::CanaryMismatch.code());
    }

    #[test]
    fn the_store_writes_owned_slots_stamps_their_canaries_and_refuses_the_rest() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(9);
        let kv_width = 8usize;
        let slots = (NUM_PAGES * PS) as usize;
        let (a, ta, pa, _) = pool.requests[0].clone();
        let (c, tc, pc, _) = pool.requests[2].clone();
        let slot = |p: PageId, s: u32| i64::from(p.0 * PS + s);
        // seq 0 = alice: two stores into her own page 2, padding, one into a prefix page (shared),
        // one into carol's page (foreign). seq 1 = carol: one into her own page, one into a free page,
        // one out of range.
        let mapping = vec![
            slot(pa[2], 2),
            slot(pa[3], 1),
            -1,
            slot(pool.prefix[0], 1),
            slot(pc[0], 0),
            slot(pc[1], 1),
            slot(pool.freed, 0),
            i64::from(NUM_PAGES * PS + 7),
        ];
        let query_start_loc = [0, 5, mapping.len() as i32];
        let writers = [DeviceReader::new(a, ta), DeviceReader::new(c, tc)];
        let key: Vec<u32> = (0..mapping.len() * kv_width).map(|_| rng.next() as u32).collect();
        let value: Vec<u32> = (0..mapping.len() * kv_width).map(|_| rng.next() as u32).collect();
        let kc: Vec<u32> = (0..slots * kv_width).map(|_| rng.next() as u32).collect();
        let vc: Vec<u32> = (0..slots * kv_width).map(|_| rng.next() as u32).collect();
        // Alice's slots the store is about to write have no canary yet: a read of them fails now.
        let mut canaries = pool.canaries();
        canaries[(pa[2].0 * PS + 2) as usize] = 0;
        canaries[(pa[3].0 * PS + 1) as usize] = 0;
        let alice_reads =
            Seq { reader: a, row: pa.iter().map(|p| p.0 as i32).chain([0, 0]).collect(), tokens: 14, gens: vec![0; 6] };
        let (status, _) = run_block_table(exe, &pool, std::slice::from_ref(&alice_reads), false, Some(&canaries));
        assert_eq!(status[0], 1 << DeviceKind::CanaryMismatch.code());
        let mut case = Case::new("store");
        case.u32s("key", &key)
            .u32s("value", &value)
            .u32s("key_cache", &kc)
            .u32s("value_cache", &vc)
            .i64s("slot_mapping", &mapping)
            .i32s("query_start_loc", &query_start_loc)
            .readers("writers", &writers)
            .tags("tags", &pool.device_tags())
            .u32s("canaries", &canaries)
            .param("kv_width", kv_width)
            .param("page_size", PS)
            .param("ring_capacity", 64);
        case.run(exe, "store");

        // The reference: what the host table allows each writer to write.
        let (mut want_k, mut want_v, mut want_c) = (kc.clone(), vc.clone(), canaries.clone());
        let mut refused = Vec::new();
        for (t, &s) in mapping.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let (writer, tenant) = if t < 5 { (a, ta) } else { (c, tc) };
            let (page, in_page) = ((s / i64::from(PS)) as u32, (s % i64::from(PS)) as u32);
            let owned = pool
                .table
                .page_info(PageId(page))
                .is_some_and(|i| i.state == PageState::Owned && i.owner == Some(writer));
            if owned {
                let generation = pool.table.page_info(PageId(page)).unwrap().generation.0;
                let (dst, src) = (s as usize * kv_width, t * kv_width);
                want_k[dst..dst + kv_width].copy_from_slice(&key[src..src + kv_width]);
                want_v[dst..dst + kv_width].copy_from_slice(&value[src..src + kv_width]);
                want_c[s as usize] = canary(writer.0, generation, page, in_page);
            } else {
                refused.push((t as u32, writer, tenant));
            }
        }
        assert_eq!(case.out_u32("key_cache"), want_k);
        assert_eq!(case.out_u32("value_cache"), want_v);
        assert_eq!(case.out_u32("canaries"), want_c);
        let ring = case.ring();
        let mut got: Vec<(u32, ViolationKind)> =
            ring.records.iter().map(|r| (r.seq, r.to_violation().unwrap().kind())).collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(
            got,
            vec![
                (3, ViolationKind::WriteToShared),
                (4, ViolationKind::ForeignPage),
                (6, ViolationKind::FreedPage),
                (7, ViolationKind::PageOutOfRange),
            ]
        );
        assert_eq!(refused.iter().map(|r| r.0).collect::<Vec<_>>(), vec![3, 4, 6, 7]);
        for r in &ring.records {
            let v = r.to_violation().unwrap();
            assert_eq!(v.op(), kvguard::Op::Write);
            assert_eq!(v.request(), Some(if r.seq < 5 { a } else { c }));
        }
        let status = case.out_u32("status");
        assert_ne!(status[0], 0);
        assert_ne!(status[1], 0);

        // Round trip: after the store, alice's read passes the canary check; one flipped bit fails it.
        let mut stamped = case.out_u32("canaries");
        assert_eq!(stamped, pool.canaries(), "the store stamped exactly what the reference stamps");
        let (status, _) = run_block_table(exe, &pool, std::slice::from_ref(&alice_reads), false, Some(&stamped));
        assert_eq!(status[0], 0);
        stamped[(pa[3].0 * PS + 1) as usize] ^= 1;
        let (status, ring) = run_block_table(exe, &pool, std::slice::from_ref(&alice_reads), false, Some(&stamped));
        assert_eq!(status[0], 1 << DeviceKind::CanaryMismatch.code());
        assert_eq!((ring.records[0].block, ring.records[0].slot_start), (3, 1));
    }

    // ------------------------------------------------------------------------------------------------
    // One step on the simulated grid, from explicit tags and readers
    // ------------------------------------------------------------------------------------------------

    /// One sequence of a step for [`run_rows`]: who reads, which pages, how many tokens.
    struct Read {
        reader: DeviceReader,
        pages: Vec<PageId>,
        tokens: u64,
    }

    /// Runs `kvg_verify_block_table` over `reads` (rows padded to `MAX_BLOCKS` with the reserved
    /// page, never read) against `tags`; canaries and query lengths when given.
    fn run_rows(
        exe: &Path,
        tags: &[DeviceTag],
        reads: &[Read],
        canaries: Option<&[u32]>,
        query_lens: Option<&[i32]>,
    ) -> (Vec<u32>, RingDrain) {
        let mut table = Vec::new();
        for r in reads {
            let mut row: Vec<i32> = r.pages.iter().map(|p| p.0 as i32).collect();
            row.resize(MAX_BLOCKS, 0);
            table.extend(row);
        }
        let mut case = Case::new("verify-rows");
        case.tags("tags", tags)
            .readers("readers", &reads.iter().map(|r| r.reader).collect::<Vec<_>>())
            .i32s("block_table", &table)
            .i32s("seq_lens", &reads.iter().map(|r| r.tokens as i32).collect::<Vec<_>>())
            .param("page_size", PS)
            .param("max_blocks", MAX_BLOCKS)
            .param("ring_capacity", 256)
            .param("grid_x", 1)
            .param("grid_y", 2);
        if let Some(c) = canaries {
            case.u32s("canaries", c);
        }
        if let Some(q) = query_lens {
            case.i32s("query_lens", q);
        }
        case.run(exe, "verify_block_table");
        (case.out_u32("status"), case.ring())
    }

    // ------------------------------------------------------------------------------------------------
    // Prefixes shared across tenants, forks and prefix reads
    // ------------------------------------------------------------------------------------------------

    /// The device tag mirror as `DeviceGuard::sync_tags` keeps it: only the pages
    /// `take_changed_pages` lists travel. Returns the pages that changed.
    fn sync(table: &OwnershipTable, mirror: &mut [DeviceTag]) -> Vec<PageId> {
        let changed = table.take_changed_pages();
        for (p, info) in &changed {
            mirror[p.0 as usize] = DeviceTag::from_page_info(info);
        }
        changed.into_iter().map(|(p, _)| p).collect()
    }

    #[test]
    fn prefixes_shared_across_tenants_forks_and_prefix_reads_agree_with_the_table() {
        let Some(exe) = driver() else { return };
        let config = PoolConfig::new(NUM_PAGES, PS, 64).with_reserved([PageId(0)]).with_policy(Policy::Report);
        let table = OwnershipTable::new(config).unwrap();
        let mut mirror = vec![DeviceTag::default(); NUM_PAGES as usize];
        sync(&table, &mut mirror); // the first call: the whole pool
        let (acme, globex, initech) = (TenantId(10), TenantId(20), TenantId(30));
        let (publisher, colleague, guest, stranger, child) =
            (RequestId(1), RequestId(2), RequestId(3), RequestId(4), RequestId(5));
        for (r, t) in [(publisher, acme), (colleague, acme), (guest, globex), (stranger, initech)] {
            table.admit(r, t, 20, 20).unwrap();
        }
        let tenant_of = |r: RequestId| table.request_info(r).unwrap().tenant;
        let alloc =
            |r: RequestId, n: u32| -> Vec<PageId> { table.allocate(r, n).unwrap().iter().map(|x| x.page).collect() };
        // acme's public prefix: two full pages, published under key 7 and held by a colleague.
        let prefix = alloc(publisher, 2);
        table.record_write_tokens(publisher, &prefix, 0..8).unwrap();
        table.publish_prefix(publisher, PrefixKey(7), &prefix).unwrap();
        table.attach_prefix(colleague, PrefixKey(7)).unwrap();
        let guest_own = alloc(guest, 1);
        table.record_write_tokens(guest, &guest_own, 0..3).unwrap();
        let through = |own: &[PageId]| -> Vec<PageId> { prefix.iter().chain(own).copied().collect() };

        // The host's verdicts and the device's, on the mirror as synced, must agree.
        let agree = |mirror: &[DeviceTag], reads: &[(RequestId, Vec<PageId>, u64)]| {
            let step: Vec<Read> = reads
                .iter()
                .map(|(r, pages, tokens)| Read {
                    reader: DeviceReader::new(*r, tenant_of(*r)),
                    pages: pages.clone(),
                    tokens: *tokens,
                })
                .collect();
            let (status, ring) = run_rows(exe, mirror, &step, None, None);
            for (i, (r, pages, tokens)) in reads.iter().enumerate() {
                let host = table.check_read(*r, pages, *tokens).err().map(|v| v.kind());
                let device = device_verdict(&ring.records, &status, i).map(|(k, _)| k.violation_kind());
                assert_eq!(device, host, "read {i} by {r:?} of {pages:?}, {tokens} tokens");
            }
        };

        // Before any grant: the prefix is acme's alone; globex reading it is foreign on both.
        let changed = sync(&table, &mut mirror);
        assert!(prefix.iter().all(|p| changed.contains(p)), "publishing changed the prefix pages");
        assert!(prefix.iter().all(|p| mirror[p.0 as usize].flags == 0));
        agree(
            &mirror,
            &[
                (colleague, prefix.clone(), 8),   // a prefix read, same tenant
                (publisher, prefix.clone(), 8),   // the publisher holds it too
                (guest, through(&guest_own), 11), // another tenant, not a holder
                (guest, guest_own.clone(), 3),    // its own page
                (stranger, prefix.clone(), 4),    // a third tenant
            ],
        );

        // acme opts in and globex's request attaches: the grant changes no read by itself, the
        // attach does, and the mirror learns it from the changed pages.
        table.allow_cross_tenant_sharing(acme, true);
        assert!(sync(&table, &mut mirror).is_empty(), "a grant alone changes no read verdict");
        table.attach_prefix(guest, PrefixKey(7)).unwrap();
        let changed = sync(&table, &mut mirror);
        assert_eq!(changed.len(), prefix.len(), "exactly the prefix's pages re-sync: {changed:?}");
        for p in &prefix {
            assert!(table.page_info(*p).unwrap().shared_across_tenants);
            assert_eq!(mirror[p.0 as usize].flags, DeviceTag::FLAG_SHARED_ACROSS_TENANTS);
        }
        assert_eq!(mirror[guest_own[0].0 as usize].flags, 0, "only shared pages carry the flag");
        agree(
            &mirror,
            &[
                (guest, through(&guest_own), 11), // the cross-tenant holder: allowed on both now
                (colleague, prefix.clone(), 8),
                (guest, vec![prefix[1]], 4),
            ],
        );
        // Without the flag the device would refuse that legitimate read (the wrong verdict fixed here).
        let mut unflagged = mirror.clone();
        for p in &prefix {
            unflagged[p.0 as usize].flags = 0;
        }
        let guest_read = Read { reader: DeviceReader::new(guest, globex), pages: through(&guest_own), tokens: 11 };
        let (status, _) = run_rows(exe, &unflagged, std::slice::from_ref(&guest_read), None, None);
        assert_eq!(status[0], 1 << DeviceKind::ForeignPage.code());

        // A fork of the guest: the child (globex) holds the prefix and the parent's pages.
        table.fork(guest, child).unwrap();
        sync(&table, &mut mirror);
        agree(
            &mirror,
            &[(child, through(&guest_own), 11), (guest, through(&guest_own), 11), (child, prefix.clone(), 5)],
        );

        // Revoking the grant keeps existing holders reading on the host; the device agrees.
        table.allow_cross_tenant_sharing(acme, false);
        sync(&table, &mut mirror);
        agree(&mirror, &[(guest, through(&guest_own), 11), (child, prefix.clone(), 8)]);

        // The documented difference: the device cannot see holders, so once the prefix is shared
        // across tenants a non-holder of a third tenant passes there; the host refuses it.
        let stranger_read = Read { reader: DeviceReader::new(stranger, initech), pages: prefix.clone(), tokens: 8 };
        let (status, _) = run_rows(exe, &mirror, std::slice::from_ref(&stranger_read), None, None);
        assert_eq!(status[0], 0);
        assert_eq!(table.check_read(stranger, &prefix, 8).unwrap_err().kind(), ViolationKind::ForeignPage);

        // The prefix goes: its pages are freed and lose the flag; reads of them are refused on both.
        for r in [colleague, guest, child, publisher] {
            table.release(r).unwrap();
        }
        table.evict_prefix(PrefixKey(7)).unwrap();
        sync(&table, &mut mirror);
        assert!(prefix.iter().all(|p| mirror[p.0 as usize].flags == 0));
        agree(&mirror, &[(stranger, prefix.clone(), 8)]);
    }

    // ------------------------------------------------------------------------------------------------
    // Canaries: only the slots written before this step
    // ------------------------------------------------------------------------------------------------

    #[test]
    fn canaries_are_checked_only_for_slots_written_before_the_step() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let tags = pool.device_tags();
        let (a, ta, pa, _) = pool.requests[0].clone();
        let (c, tc, pc, _) = pool.requests[2].clone();
        // Alice decodes token 14 (slot 2 of her page 3): its KV is stored later in this step, so
        // its canary is still 0 when a verify placed before the forward pass runs. Carol runs a
        // prefill chunk of 6 tokens, 10..16: none of them is stamped yet.
        let mut canaries = pool.canaries();
        canaries[(pa[3].0 * PS + 2) as usize] = 0;
        for t in 10..16u32 {
            canaries[(pc[(t / PS) as usize].0 * PS + t % PS) as usize] = 0;
        }
        let reads = [
            Read { reader: DeviceReader::new(a, ta), pages: pa.clone(), tokens: 15 },
            Read { reader: DeviceReader::new(c, tc), pages: pc.clone(), tokens: 16 },
        ];
        let mut tags15 = tags.clone();
        tags15[pa[3].0 as usize].written = PS; // the host table recorded the step's writes
        // Without query lengths every read slot must be stamped: both sequences are flagged.
        let (status, ring) = run_rows(exe, &tags15, &reads, Some(&canaries), None);
        let canary_bit = 1 << DeviceKind::CanaryMismatch.code();
        assert_eq!(status, vec![canary_bit, canary_bit]);
        let first: Vec<(u32, u32, u32)> = ring.records.iter().map(|r| (r.seq, r.block, r.slot_start)).collect();
        assert!(first.contains(&(0, 3, 2)) && first.contains(&(1, 2, 2)), "{first:?}");
        // With this step's query lengths, the unstamped slots are this step's own: clean.
        let (status, ring) = run_rows(exe, &tags15, &reads, Some(&canaries), Some(&[1, 6]));
        assert_eq!(status, vec![0, 0], "{:?}", ring.records);
        assert!(ring.records.is_empty());
        // A prefill of the whole sequence has nothing stamped before it: zeroed canaries pass.
        let zeroed = vec![0u32; canaries.len()];
        let (status, _) = run_rows(exe, &tags15, &reads, Some(&zeroed), Some(&[15, 16]));
        assert_eq!(status, vec![0, 0]);
        // KV written before the step that this incarnation never stamped is still caught.
        let mut bad = canaries.clone();
        bad[(pa[1].0 * PS + 2) as usize] = canary(a.0, 0, pa[1].0, 2);
        let (status, ring) = run_rows(exe, &tags15, &reads, Some(&bad), Some(&[1, 6]));
        assert_eq!(status, vec![canary_bit, 0]);
        assert_eq!((ring.records[0].block, ring.records[0].slot_start, ring.records[0].slot_end), (1, 2, 3));
        // A query length below 0 or above the sequence's length is a malformed step.
        let (status, ring) = run_rows(exe, &tags15, &reads, Some(&canaries), Some(&[-1, 17]));
        let bad_layout = 1 << DeviceKind::BadLayout.code();
        assert_eq!(status, vec![bad_layout, bad_layout]);
        assert!(ring.records.iter().all(|r| r.to_violation().unwrap().kind() == ViolationKind::SlotOutOfRange));
        // Query lengths are read only with canaries: without them they change nothing.
        let (status, _) = run_rows(exe, &tags15, &reads, None, Some(&[-1, 17]));
        assert_eq!(status, vec![0, 0]);
    }

    #[test]
    fn the_paged_kv_verify_checks_canaries_only_before_the_step_too() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let (a, ta, pa, _) = pool.requests[0].clone();
        let mut tags = pool.device_tags();
        tags[pa[3].0 as usize].written = PS;
        let mut canaries = pool.canaries();
        canaries[(pa[3].0 * PS + 2) as usize] = 0; // token 14, this step's
        let run = |query_lens: Option<&[i32]>| {
            let mut case = Case::new("verify-pkv-window");
            case.tags("tags", &tags)
                .readers("readers", &[DeviceReader::new(a, ta)])
                .i32s("kv_indptr", &[0, 4])
                .i32s("kv_indices", &pa.iter().map(|p| p.0 as i32).collect::<Vec<_>>())
                .i32s("kv_last_page_len", &[3])
                .u32s("canaries", &canaries)
                .param("page_size", PS)
                .param("ring_capacity", 16)
                .param("grid_x", 1)
                .param("grid_y", 1);
            if let Some(q) = query_lens {
                case.i32s("query_lens", q);
            }
            case.run(exe, "verify_paged_kv");
            case.out_u32("status")
        };
        assert_eq!(run(None), vec![1 << DeviceKind::CanaryMismatch.code()]);
        assert_eq!(run(Some(&[1])), vec![0]);
        assert_eq!(run(Some(&[16])), vec![1 << DeviceKind::BadLayout.code()]);
    }

    // ------------------------------------------------------------------------------------------------
    // A step built on the device (vLLM's Model Runner V2): its writes checked, refused rows fenced
    // ------------------------------------------------------------------------------------------------

    /// Runs `kvg_verify_slot_mapping` then `kvg_fence_refused` on one status array, as one stream
    /// does. Returns (status after the check, fenced slots, fenced table, ring).
    #[allow(clippy::too_many_arguments)]
    fn slots_and_fence(
        exe: &Path,
        pool: &Pool,
        writers: &[DeviceReader],
        slots: &[i64],
        query_start_loc: &[i32],
        table: &[i32],
        status_before: &[u32],
        grid: (u32, u32),
    ) -> (Vec<u32>, Vec<i64>, Vec<i32>, RingDrain) {
        let mut case = Case::new("slots");
        case.i64s("slot_mapping", slots)
            .i32s("query_start_loc", query_start_loc)
            .readers("writers", writers)
            .tags("tags", &pool.device_tags())
            .i32s("block_table", table)
            .u32s("status", status_before)
            .param("page_size", PS)
            .param("max_blocks", MAX_BLOCKS)
            .param("ring_capacity", 256)
            .param("grid_x", grid.0)
            .param("grid_y", grid.1);
        case.run(exe, "slots_and_fence");
        let i64s = |b: Vec<u8>| b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        let i32s = |b: Vec<u8>| b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        (case.out_u32("checked_status"), i64s(case.out("slot_mapping")), i32s(case.out("block_table")), case.ring())
    }

    #[test]
    fn the_device_write_check_refuses_what_the_table_refuses_and_the_fence_nulls_only_the_flagged() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let mut rng = Rng(41);
        let slots_in_pool = i64::from(NUM_PAGES * PS);
        for round in 0..24 {
            // Each live request writes a few tokens: mostly into its own pages, sometimes into any
            // page of the pool (foreign, shared, free, reserved), out of range, or padding.
            let seqs: Vec<usize> = (0..pool.requests.len()).filter(|_| rng.below(4) != 0).collect();
            let mut slots = Vec::new();
            let mut qsl = vec![0i32];
            for &i in &seqs {
                let (_, _, pages, _) = &pool.requests[i];
                for _ in 0..1 + rng.below(5) {
                    slots.push(match rng.below(10) {
                        0 => -1,
                        1 => slots_in_pool + rng.below(9) as i64,
                        2 | 3 => rng.below(slots_in_pool as u64) as i64,
                        _ => {
                            i64::from(pages[rng.below(pages.len() as u64) as usize].0 * PS)
                                + rng.below(PS.into()) as i64
                        }
                    });
                }
                qsl.push(slots.len() as i32);
            }
            // Padding tokens after the last sequence (CUDA-graph padding): -1, or, once, a slot.
            slots.extend([-1, -1]);
            if round % 6 == 5 {
                slots.push(i64::from(pool.requests[0].2[0].0 * PS));
            }
            let writers: Vec<DeviceReader> =
                seqs.iter().map(|&i| DeviceReader::new(pool.requests[i].0, pool.requests[i].1)).collect();
            // An earlier check of the same step (the reads) flagged one sequence.
            let mut before = vec![0u32; seqs.len()];
            let read_refused = (round % 3 == 0 && !seqs.is_empty()).then(|| rng.below(seqs.len() as u64) as usize);
            if let Some(s) = read_refused {
                before[s] = 1 << DeviceKind::ForeignPage.code();
            }
            let table: Vec<i32> =
                (0..seqs.len() * MAX_BLOCKS).map(|_| 1 + rng.below(u64::from(NUM_PAGES) - 1) as i32).collect();
            let grid = [(1, 1), (2, 3), (5, 1)][round % 3];
            let (status, fenced, fenced_table, ring) =
                slots_and_fence(exe, &pool, &writers, &slots, &qsl, &table, &before, grid);

            // The reference: the host table's rule for a write (an exclusively owned page).
            let mut want_status = before.clone();
            let mut want_records = Vec::new();
            for (t, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                let Some(s) = (0..seqs.len()).find(|&s| (qsl[s]..qsl[s + 1]).contains(&(t as i32))) else {
                    want_records.push((seqs.len() as u32, t as u32, DeviceKind::BadLayout));
                    continue;
                };
                let writer = pool.requests[seqs[s]].0;
                let page = slot / i64::from(PS);
                let info = u32::try_from(page).ok().and_then(|p| pool.table.page_info(PageId(p)));
                let kind = match info {
                    None => Some(DeviceKind::PageOutOfRange),
                    Some(i) if i.state == PageState::Owned && i.owner == Some(writer) => None,
                    Some(i) if i.state == PageState::Owned => Some(DeviceKind::ForeignPage),
                    Some(i) if i.state == PageState::Shared => Some(DeviceKind::WriteToShared),
                    Some(i) if i.state == PageState::Reserved => Some(DeviceKind::ReservedPage),
                    Some(_) => Some(DeviceKind::FreedPage),
                };
                if let Some(k) = kind {
                    want_status[s] |= 1 << k.code();
                    want_records.push((s as u32, t as u32, k));
                }
            }
            assert_eq!(status, want_status, "round {round}: status words after the write check");
            let mut got: Vec<(u32, u32, DeviceKind)> =
                ring.records.iter().map(|r| (r.seq, r.block, DeviceKind::from_code(r.kind).unwrap())).collect();
            got.sort_by_key(|g| (g.1, g.0));
            assert_eq!(got, want_records, "round {round}: the ring");
            for r in &ring.records {
                assert_eq!(r.op, kvguard::cuda::layout::OP_WRITE);
                let writer = seqs.get(r.seq as usize).map_or(0, |&i| pool.requests[i].0.0);
                assert_eq!(r.request, writer, "round {round}: the record names the writer (0: none)");
            }

            // The fence: a flagged sequence's row is the null page and its slots padding; every
            // other row and slot is untouched; a slot outside every sequence is padding.
            for s in 0..seqs.len() {
                let row = &fenced_table[s * MAX_BLOCKS..(s + 1) * MAX_BLOCKS];
                let was = &table[s * MAX_BLOCKS..(s + 1) * MAX_BLOCKS];
                if want_status[s] != 0 {
                    assert!(row.iter().all(|&p| p == 0), "round {round}: flagged row {s} fenced");
                } else {
                    assert_eq!(row, was, "round {round}: clean row {s} untouched");
                }
            }
            for (t, (&got, &was)) in fenced.iter().zip(&slots).enumerate() {
                let seq = (0..seqs.len()).find(|&s| (qsl[s]..qsl[s + 1]).contains(&(t as i32)));
                let keep = seq.is_some_and(|s| want_status[s] == 0);
                assert_eq!(got, if keep || was < 0 { was } else { -1 }, "round {round}: slot of token {t}");
            }
        }
    }

    #[test]
    fn a_malformed_query_start_loc_flags_its_sequence_and_fences_its_tokens() {
        let Some(exe) = driver() else { return };
        let pool = pool();
        let (a, ta, pa, _) = pool.requests[0].clone();
        let (c, tc, pc, _) = pool.requests[2].clone();
        let own = |p: PageId| i64::from(p.0 * PS);
        let writers = [DeviceReader::new(a, ta), DeviceReader::new(c, tc)];
        let slots = [own(pa[2]), own(pa[2]) + 1, own(pc[0]), own(pc[0]) + 1];
        let table = vec![5i32; 2 * MAX_BLOCKS];
        // Decreasing: sequence 0 ends before it starts.
        let (status, fenced, fenced_table, ring) =
            slots_and_fence(exe, &pool, &writers, &slots, &[0, -1, 4], &table, &[0, 0], (1, 1));
        assert_eq!(status[0], 1 << DeviceKind::BadLayout.code());
        assert!(fenced_table[..MAX_BLOCKS].iter().all(|&p| p == 0));
        assert_eq!(fenced.iter().filter(|&&s| s == -1).count(), 4, "no token lies in a well-formed range");
        assert!(ring.records.iter().any(|r| r.seq == 0 && r.kind == DeviceKind::BadLayout.code()));
        // Past the tokens there are: sequence 1 claims 9 of 4.
        let (status, fenced, _, _) = slots_and_fence(exe, &pool, &writers, &slots, &[0, 2, 9], &table, &[0, 0], (2, 2));
        assert_eq!(status, vec![0, 1 << DeviceKind::BadLayout.code()]);
        assert_eq!(fenced, vec![slots[0], slots[1], -1, -1]);
        // Well formed: both clean, nothing fenced.
        let (status, fenced, fenced_table, ring) =
            slots_and_fence(exe, &pool, &writers, &slots, &[0, 2, 4], &table, &[0, 0], (2, 2));
        assert_eq!(status, vec![0, 0]);
        assert_eq!(fenced, slots.to_vec());
        assert_eq!(fenced_table, table);
        assert!(ring.records.is_empty());
    }
}
