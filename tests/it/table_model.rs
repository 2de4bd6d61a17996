//! Model-based tests: random operation sequences run against the table and a tiny reference model
//! (`tests/model/mod.rs`); after every operation the two must agree on success, and the table's
//! pages must match the model's (states, owners, generations that only grow, coverage, disjoint
//! owners, conservation of pages); releasing everything at the end must return every page.

use crate::model::{self, Op};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = Op> {
    let small = || 0u8..8;
    prop_oneof![
        3 => (small(), small(), 0u8..30, 0u8..8).prop_map(|(req, tenant, prompt, max_new)| Op::Admit { req, tenant, prompt, max_new }),
        3 => (small(), small()).prop_map(|(req, n)| Op::Allocate { req, n }),
        1 => (small(), prop::collection::vec(0u8..14, 0..3)).prop_map(|(req, pages)| Op::Claim { req, pages }),
        4 => (small(), small(), prop::bool::weighted(0.1), 0u8..6, 0u8..6).prop_map(|(req, index, raw, a, b)| Op::Write { req, index, raw, a, b }),
        4 => (small(), any::<u8>(), small(), 0u8..14).prop_map(|(req, tokens, swap_at, swap)| Op::Read { req, tokens, swap_at, swap }),
        2 => small().prop_map(|req| Op::Release { req }),
        1 => (small(), prop::collection::vec(0u8..6, 0..3)).prop_map(|(req, indices)| Op::ReleasePages { req, indices }),
        1 => small().prop_map(|req| Op::Preempt { req }),
        1 => (small(), small(), small()).prop_map(|(req, key, count)| Op::Publish { req, key, count }),
        1 => (small(), small()).prop_map(|(req, key)| Op::Attach { req, key }),
        1 => (small(), small()).prop_map(|(req, key)| Op::Detach { req, key }),
        1 => small().prop_map(|key| Op::Evict { key }),
        1 => (small(), small()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        1 => (small(), any::<bool>()).prop_map(|(tenant, allow)| Op::AllowSharing { tenant, allow }),
        2 => (small(), any::<u8>(), any::<u8>()).prop_map(|(req, start, len)| Op::WriteTokens { req, start, len }),
        2 => (small(), any::<u8>(), any::<u8>(), prop::bool::weighted(0.2))
            .prop_map(|(req, tokens, expected, release_midway)| Op::Import { req, tokens, expected, release_midway }),
        1 => Just(Op::Sync),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, max_shrink_iters: 4096, ..ProptestConfig::default() })]

    #[test]
    fn the_table_agrees_with_the_reference_model(ops in prop::collection::vec(op(), 1..200)) {
        model::run(&ops);
    }

    /// The same with the device mirror syncing only now and then: between two takes pages change
    /// several times (allocated, written, released), and must be taken once each, with their last
    /// tags, none lost.
    /// An engine's block table read through one `RowCache` across the whole sequence: every
    /// step's incremental verdict is the full check's (`model::run_rows`).
    #[test]
    fn rows_checked_incrementally_get_the_full_checks_verdicts(ops in prop::collection::vec(op(), 1..200)) {
        model::run_rows(&ops);
    }

    /// The same through a token-slot table (SGLang's `req_to_token`) and one `SlotRowCache`,
    /// rows also changed one slot at a time behind the engine's calls (`model::run_slot_rows`).
    #[test]
    fn slot_rows_checked_incrementally_get_the_full_checks_verdicts(ops in prop::collection::vec(op(), 1..200)) {
        model::run_slot_rows(&ops);
    }

    /// The same through a block table the guard holds, its rows changed only through its calls
    /// (appended, set, truncated, copied and swapped between steps: `model::run_held_rows`).
    #[test]
    fn held_rows_checked_incrementally_get_the_full_checks_verdicts(ops in prop::collection::vec(op(), 1..200)) {
        model::run_held_rows(&ops);
    }

    #[test]
    fn a_mirror_syncing_now_and_then_matches_the_table(ops in prop::collection::vec(op(), 1..200)) {
        model::run_syncing(&ops);
    }
}

/// The rows' incremental path is taken, not only the full one: a request that writes a token a
/// step and reads it back is judged from its last page after its first check.
#[test]
fn a_row_growing_a_token_a_step_is_judged_incrementally() {
    // Each operation reads one token more: 3 tokens after the first write (checked in full),
    // then 4 after the second write and 5 to 16 over twelve mirror syncs (nothing changes):
    // thirteen reads, each from its last page.
    let mut ops = vec![
        Op::Admit { req: 1, tenant: 0, prompt: 20, max_new: 0 },
        Op::Allocate { req: 1, n: 4 },
        Op::WriteTokens { req: 1, start: 0, len: 8 },
        Op::WriteTokens { req: 1, start: 8, len: 8 },
    ];
    ops.extend(std::iter::repeat_n(Op::Sync, 12));
    assert_eq!(model::run_rows(&ops), 13, "every step after the first clean one is incremental");
    assert_eq!(model::run_slot_rows(&ops), 13, "so through a token-slot table");
    // Through a held table the syncs also move and swap rows: each row's check goes with it.
    assert_eq!(model::run_held_rows(&ops), 13, "so through a held block table");
}

#[test]
fn a_read_past_the_written_slots_is_refused_by_both() {
    model::run(&[
        Op::Admit { req: 1, tenant: 0, prompt: 8, max_new: 0 },
        Op::Allocate { req: 1, n: 2 },
        Op::Write { req: 1, index: 0, raw: false, a: 0, b: 4 },
        Op::Read { req: 1, tokens: 5, swap_at: 9, swap: 0 },
    ]);
}

#[test]
#[should_panic(expected = "page 0 state")]
fn a_table_that_drifts_from_the_model_is_caught() {
    // The harness must be able to fail: give it a table whose page 0 is not reserved; the page
    // check after the very first step exposes the drift.
    let drifted = kvguard::PoolConfig::new(model::PAGES, model::PAGE_SIZE, model::MAX_CONTEXT)
        .with_generation_limit(model::GENERATION_LIMIT);
    model::run_with(
        drifted,
        &[Op::Admit { req: 1, tenant: 0, prompt: 4, max_new: 0 }, Op::Claim { req: 1, pages: vec![0] }],
    );
}

/// What one step does to a row in [`a_row_changed_behind_the_engine_at_the_same_length_is_judged_in_full`].
#[derive(Clone, Debug)]
enum RowStep {
    /// The request reads one token more.
    Grow,
    /// Entry `at` of the row becomes page `page`, behind the engine's calls; the request reads as
    /// many tokens as before.
    Swap { at: usize, page: i32 },
    /// The row is the request's own pages again; as many tokens as before.
    Restore,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Rows whose requests wrote all their pages, read through one `RowCache` step after step:
    /// growing a token, or with an entry changed behind the engine at the same length (another
    /// request's page, a free page, one past the pool), or put back. Every step's incremental
    /// verdict is a full `check_step`'s. (The model above rarely reaches a row read clean and then
    /// changed at the same length; this does every few steps.) The same rows are also kept in a
    /// block table the guard holds, each change made through its calls (`set_row`, or a truncate
    /// at the changed entry and an append), and read through `check_held_rows`: its verdicts
    /// must be the full check's too.
    #[test]
    fn a_row_changed_behind_the_engine_at_the_same_length_is_judged_in_full(
        steps in prop::collection::vec(
            (0usize..3, prop_oneof![
                2 => Just(RowStep::Grow),
                2 => (0usize..4, 0i32..20).prop_map(|(at, page)| RowStep::Swap { at, page }),
                1 => Just(RowStep::Restore),
            ]),
            1..60,
        )
    ) {
        use kvguard::{
            BlockRows, HeldBlockTable, OwnershipTable, PageId, PoolConfig, RequestId, RowCache, RowRead, SeqRead, TenantId,
        };
        const PS: u32 = 4;
        let table = OwnershipTable::new(PoolConfig::new(18, PS, 16).with_reserved([PageId(0)])).expect("pool");
        let own = |r: usize| -> Vec<i32> { (0..4).map(|k| (1 + r * 4 + k) as i32).collect() };
        for r in 0..3 {
            let req = RequestId(r as u64);
            table.admit(req, TenantId(r as u64), 16, 0).expect("admit");
            let pages: Vec<PageId> = own(r).iter().map(|&p| PageId(p as u32)).collect();
            table.claim(req, &pages).expect("claim");
            table.record_write_tokens(req, &pages, 0..16).expect("write");
        }
        let mut entries: Vec<i32> = (0..3).flat_map(own).collect();
        let mut tokens = [5u64; 3];
        let mut cache = RowCache::new();
        let mut held = HeldBlockTable::new(3, 4).expect("a small table");
        for r in 0..3 {
            held.append(r as u32, &own(r)).expect("fits");
        }
        for (r, step) in steps {
            match step {
                RowStep::Grow => tokens[r] = tokens[r] % 16 + 1,
                RowStep::Swap { at, page } => entries[r * 4 + at] = page,
                RowStep::Restore => entries[r * 4..r * 4 + 4].copy_from_slice(&own(r)),
            }
            let row = &entries[r * 4..r * 4 + 4];
            match step {
                RowStep::Swap { at, .. } if at % 2 == 1 => {
                    held.truncate(r as u32, at).expect("in range");
                    held.append(r as u32, &row[at..]).expect("fits");
                }
                _ => held.set_row(r as u32, row).expect("fits"),
            }
            let reads: Vec<RowRead> =
                (0..3).map(|i| RowRead { request: RequestId(i as u64), row: i as u32, tokens: tokens[i] }).collect();
            let rows = BlockRows::new(&entries, 4).expect("whole rows");
            let incremental = table.check_rows(&mut cache, rows, &reads).expect("rows in range");
            let pages: Vec<Vec<PageId>> = entries.chunks(4).map(|row| row.iter().map(|&e| PageId(e as u32)).collect()).collect();
            let seqs: Vec<SeqRead<'_>> =
                (0..3).map(|i| SeqRead { request: RequestId(i as u64), block_table: &pages[i], tokens: tokens[i] }).collect();
            let full = table.check_step(&seqs);
            let said = |v: &kvguard::StepVerdict| -> Vec<_> {
                v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page())).collect()
            };
            prop_assert_eq!(said(&incremental), said(&full));
            prop_assert_eq!(held.entries(), &entries[..]);
            let from_held = table.check_held_rows(&mut held, &reads).expect("rows in range");
            prop_assert_eq!(said(&from_held), said(&full), "the held rows' verdicts");
        }
    }
}

/// One step of [`a_slot_changed_behind_the_engine_is_judged_in_full`] for one row.
#[derive(Clone, Debug)]
enum SlotStep {
    /// One token more read.
    Grow,
    /// Entry `at` of the row set to `slot` behind the engine's calls (another request's slot, a
    /// free page's, one past the pool, the row's own at another offset).
    Swap { at: usize, slot: i32 },
    /// The row is the request's own slots again.
    Restore,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// The token-slot twin of the test above: three requests' rows of a token-slot table
    /// (`req_to_token`), at page size 1 (each entry its own page) and 4, read through one
    /// `SlotRowCache` step after step, growing, changed one slot at a time at the same length, or
    /// put back. Every step's cached verdict is a full `check_slot_rows`'s.
    #[test]
    fn a_slot_changed_behind_the_engine_is_judged_in_full(
        ps in prop_oneof![Just(1u32), Just(4u32)],
        steps in prop::collection::vec(
            (0usize..3, prop_oneof![
                2 => Just(SlotStep::Grow),
                2 => (0usize..16, -1i32..80).prop_map(|(at, slot)| SlotStep::Swap { at, slot }),
                1 => Just(SlotStep::Restore),
            ]),
            1..60,
        )
    ) {
        use kvguard::step::{SlotRead, SlotRowCache};
        use kvguard::{BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, RowRead, TenantId};
        let per = (16 / ps) as usize; // pages a request holds
        let table = OwnershipTable::new(PoolConfig::new(3 * per as u32 + 4, ps, 16).with_reserved([PageId(0)])).expect("pool");
        let own = |r: usize| -> Vec<i32> { (0..16).map(|t| ((1 + r * per) * ps as usize + t) as i32).collect() };
        for r in 0..3 {
            let req = RequestId(r as u64);
            table.admit(req, TenantId(r as u64), 16, 0).expect("admit");
            let pages: Vec<PageId> = (0..per).map(|k| PageId((1 + r * per + k) as u32)).collect();
            table.claim(req, &pages).expect("claim");
            table.record_write_tokens(req, &pages, 0..16).expect("write");
        }
        let mut entries: Vec<i32> = (0..3).flat_map(own).collect();
        let mut tokens = [5u64; 3];
        let mut cache = SlotRowCache::new();
        for (r, step) in steps {
            match step {
                SlotStep::Grow => tokens[r] = tokens[r] % 16 + 1,
                SlotStep::Swap { at, slot } => entries[r * 16 + at] = slot,
                SlotStep::Restore => entries[r * 16..r * 16 + 16].copy_from_slice(&own(r)),
            }
            let reads: Vec<RowRead> =
                (0..3).map(|i| RowRead { request: RequestId(i as u64), row: i as u32, tokens: tokens[i] }).collect();
            let rows = BlockRows::new(&entries, 16).expect("whole rows");
            let cached = table.check_slot_rows_cached(&mut cache, rows, &reads).expect("rows in range");
            let whole: Vec<SlotRead> =
                reads.iter().map(|r| SlotRead { request: r.request, row: r.row, from: 0, tokens: r.tokens }).collect();
            let full = table.check_slot_rows(rows, &whole).expect("rows in range");
            let said = |v: &kvguard::StepVerdict| -> Vec<_> {
                v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page())).collect()
            };
            prop_assert_eq!(said(&cached), said(&full));
        }
    }
}
