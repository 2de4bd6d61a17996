//! A decode step verified across several threads (`verify_step_parallel` and its forms) gives the
//! verdict of the serial `verify_step`, and judges the same: random steps over a table of a few
//! requests (own pages, a shared prefix, released and foreign pages, unknown requests, a request
//! read twice in one step, reads past the written slots or the block table), under enforce and
//! report, on two tables built alike — one stepped serially, the other in parallel.

use kvguard::{
    OwnershipTable, PageId, PageRef, Policy, PoolConfig, PrefixKey, RequestId, SeqRead, StepVerdict, TenantId,
};
use proptest::prelude::*;
use std::num::NonZeroUsize;

const PAGE_SIZE: u32 = 4;
const REQUESTS: u64 = 6;

/// One sequence of a random step: `req` (ids past `REQUESTS` are unknown), its own block table
/// with entry `swap_at` replaced by page `swap` (when in range), reading `tokens` (modulo its
/// coverage plus two).
#[derive(Clone, Debug)]
struct Seq {
    req: u64,
    swap_at: usize,
    swap: u32,
    tokens: u64,
}

fn seq() -> impl Strategy<Value = Seq> {
    (0..REQUESTS + 1, 0usize..12, 0u32..80, any::<u64>()).prop_map(|(req, swap_at, swap, tokens)| Seq {
        req,
        swap_at,
        swap,
        tokens,
    })
}

/// The same table each time for `policy`: request `r` of tenant `r % 2` holds `r + 2` pages,
/// written up to a few tokens short of full for odd `r`; requests 1 and 3 share request 0's
/// first two pages as a prefix; request 5 is released (its ids and pages stale).
fn table(policy: Policy) -> (OwnershipTable, Vec<Vec<PageRef>>) {
    let t = OwnershipTable::new(PoolConfig::new(96, PAGE_SIZE, 64).with_policy(policy)).expect("a valid pool");
    let mut views = Vec::new();
    for r in 0..REQUESTS {
        let req = RequestId(r);
        t.admit(req, TenantId(r % 2), 40, 0).expect("room for it");
        let refs = t.allocate(req, r as u32 + 2).expect("free pages");
        let pages: Vec<PageId> = refs.iter().map(|x| x.page).collect();
        let tokens = pages.len() as u64 * u64::from(PAGE_SIZE) - (r % 2) * 3;
        t.record_write_tokens(req, &pages, 0..tokens).expect("its own pages");
        views.push(refs);
    }
    t.allow_cross_tenant_sharing(TenantId(0), true);
    t.allow_cross_tenant_sharing(TenantId(1), true);
    let prefix: Vec<PageId> = views[0][..2].iter().map(|x| x.page).collect();
    t.publish_prefix(RequestId(0), PrefixKey(7), &prefix).expect("request 0's pages");
    for r in [1, 3] {
        let shared = t.attach_prefix(RequestId(r), PrefixKey(7)).expect("published");
        views[r as usize].splice(0..0, shared);
    }
    t.release(RequestId(5)).expect("live");
    (t, views)
}

fn refs_of(views: &[Vec<PageRef>], s: &Seq) -> Vec<PageRef> {
    let mut bt = views.get(s.req as usize).cloned().unwrap_or_else(|| views[0].clone());
    if let Some(e) = bt.get_mut(s.swap_at) {
        *e = PageRef { page: PageId(s.swap), generation: e.generation };
    }
    bt
}

fn tokens_of(bt_len: usize, s: &Seq) -> u64 {
    s.tokens % (bt_len as u64 * u64::from(PAGE_SIZE) + 2)
}

fn same(serial: &StepVerdict, parallel: &StepVerdict, threads: usize) {
    assert_eq!(serial.refused, parallel.refused, "{threads} threads");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn parallel_step_verdicts_equal_the_serial_ones(steps in prop::collection::vec(seq(), 0..24), enforce: bool) {
        let policy = if enforce { Policy::Enforce } else { Policy::Report };
        let (probe, views) = table(policy);
        let refs: Vec<Vec<PageRef>> = steps.iter().map(|s| refs_of(&views, s)).collect();
        let ids: Vec<Vec<PageId>> = refs.iter().map(|bt| bt.iter().map(|r| r.page).collect()).collect();
        let by_ref: Vec<SeqRead<'_, PageRef>> = steps
            .iter()
            .zip(&refs)
            .map(|(s, bt)| SeqRead { request: RequestId(s.req), block_table: bt, tokens: tokens_of(bt.len(), s) })
            .collect();
        let by_id: Vec<SeqRead<'_>> = steps
            .iter()
            .zip(&ids)
            .map(|(s, bt)| SeqRead { request: RequestId(s.req), block_table: bt, tokens: tokens_of(bt.len(), s) })
            .collect();
        // Pure forms: one table, nothing changes.
        let serial_ids = probe.check_step(&by_id);
        let serial_refs = probe.check_step_refs(&by_ref);
        for n in 1..=5 {
            let threads = NonZeroUsize::new(n).expect("n >= 1");
            same(&serial_ids, &probe.check_step_parallel(&by_id, threads), n);
            same(&serial_refs, &probe.check_step_refs_parallel(&by_ref, threads), n);
        }
        // Judged forms: two tables built alike, the verdicts, logs, counters and quarantines equal.
        for n in 1..=5 {
            let threads = NonZeroUsize::new(n).expect("n >= 1");
            let (serial, _) = table(policy);
            let (parallel, _) = table(policy);
            same(&serial.verify_step(&by_id), &parallel.verify_step_parallel(&by_id, threads), n);
            same(&serial.verify_step_refs(&by_ref), &parallel.verify_step_refs_parallel(&by_ref, threads), n);
            prop_assert_eq!(serial.drain_violations(), parallel.drain_violations());
            prop_assert_eq!(serial.snapshot(), parallel.snapshot());
            for r in 0..=REQUESTS {
                let q = |t: &OwnershipTable| t.request_info(RequestId(r)).map(|i| i.quarantined);
                prop_assert_eq!(q(&serial), q(&parallel), "request {} quarantine", r);
            }
        }
    }
}

#[test]
fn a_request_refused_early_in_the_step_is_refused_later_in_it_under_enforce() {
    // Sequence 0 reads past request 1's written slots (refused; quarantined); sequence 3, a clean
    // read of request 1 in another thread's run, must then be refused as quarantined, as serially.
    let (serial, views) = table(Policy::Enforce);
    let (parallel, _) = table(Policy::Enforce);
    let bt: Vec<PageId> = views[1].iter().map(|r| r.page).collect();
    let other: Vec<PageId> = views[2].iter().map(|r| r.page).collect();
    let full = bt.len() as u64 * u64::from(PAGE_SIZE);
    let step = [
        SeqRead { request: RequestId(1), block_table: &bt, tokens: full },
        SeqRead { request: RequestId(2), block_table: &other, tokens: 4 },
        SeqRead { request: RequestId(2), block_table: &other, tokens: 8 },
        SeqRead { request: RequestId(1), block_table: &bt, tokens: 4 },
    ];
    let threads = NonZeroUsize::new(4).expect("4 is not zero");
    let s = serial.verify_step(&step);
    let p = parallel.verify_step_parallel(&step, threads);
    assert_eq!(s.refused.len(), 2, "{:?}", s.refused);
    assert_eq!(s.refused, p.refused);
}
