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
