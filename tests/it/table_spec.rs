//! The ownership table's behaviour, one rule per test: every violation kind and every error.

use kvguard::{
    BlockRows, ConfigError, Error, Generation, OwnershipTable, PageId, PageRef, PageState, Policy, PoolConfig,
    PrefixKey, RequestId, RowCache, RowRead, SeqRead, TenantId, ViolationKind,
};

const PS: u32 = 16;
const A: RequestId = RequestId(1);
const B: RequestId = RequestId(2);
const C: RequestId = RequestId(3);
const T1: TenantId = TenantId(100);
const T2: TenantId = TenantId(200);
const KEY: PrefixKey = PrefixKey(0xabc);

/// 16 pages of 16 slots, page 0 reserved as the null page, max context 128 tokens.
fn pool() -> PoolConfig {
    PoolConfig::new(16, PS, 128).with_reserved([PageId(0)])
}

fn table() -> OwnershipTable {
    OwnershipTable::new(pool()).expect("the test pool passes its audit")
}

fn kind<T: std::fmt::Debug>(r: Result<T, Error>) -> ViolationKind {
    r.expect_err("the operation must be refused").violation_kind().expect("refused as a violation")
}

fn pages(refs: &[PageRef]) -> Vec<PageId> {
    refs.iter().map(|r| r.page).collect()
}

/// `req` admitted with `tokens` of prompt, given enough pages, all written.
fn written(t: &OwnershipTable, req: RequestId, tenant: TenantId, tokens: u64) -> Vec<PageId> {
    t.admit(req, tenant, tokens, 0).unwrap();
    let bt = pages(&t.allocate(req, tokens.div_ceil(u64::from(PS)) as u32).unwrap());
    t.record_write_tokens(req, &bt, 0..tokens).unwrap();
    bt
}

// ---- configuration and admission ----

#[test]
fn construction_refuses_a_pool_that_cannot_hold_one_max_context_request() {
    let err = OwnershipTable::new(PoolConfig::new(10_645, 64, 1_048_576)).unwrap_err();
    assert!(matches!(err, Error::Config(ConfigError::PoolTooSmall { capacity_tokens: 681_280, .. })));
    let msg = err.to_string();
    assert!(msg.contains("681,280") && msg.contains("1,048,576"), "{msg}");
    // ...but a replay of such a deployment can still build it and let admission refuse.
    assert!(OwnershipTable::new_unaudited(PoolConfig::new(10_645, 64, 1_048_576)).is_ok());
}

#[test]
fn unaudited_construction_still_validates_the_shape() {
    assert!(matches!(
        OwnershipTable::new_unaudited(PoolConfig::new(0, 16, 16)),
        Err(Error::Config(ConfigError::NoPages))
    ));
}

#[test]
fn admission_refuses_more_than_max_context_before_touching_any_page() {
    let t = table();
    let before = t.snapshot();
    assert_eq!(kind(t.admit(A, T1, 100, 29)), ViolationKind::ExceedsMaxContext);
    assert_eq!(kind(t.admit(A, T1, u64::MAX, u64::MAX)), ViolationKind::ExceedsMaxContext);
    assert_eq!(t.snapshot().free, before.free);
    assert!(t.request_info(A).is_none(), "a refused request is not admitted");
    assert_eq!(kind(t.allocate(A, 1)), ViolationKind::UnknownRequest);
    t.admit(A, T1, 100, 28).unwrap();
}

#[test]
fn admission_refuses_more_pages_than_the_pool_can_ever_give() {
    let t = OwnershipTable::new_unaudited(PoolConfig::new(4, PS, 1000).with_reserved([PageId(0)])).unwrap();
    let err = t.admit(A, T1, 49, 0).unwrap_err();
    let v = err.violation().unwrap();
    assert_eq!(v.kind(), ViolationKind::ExceedsPool);
    assert_eq!(v.amounts(), Some((4, 3)));
    t.admit(A, T1, 48, 0).unwrap();
}

#[test]
fn admitting_a_live_request_twice_is_a_duplicate() {
    let t = table();
    t.admit(A, T1, 10, 10).unwrap();
    assert_eq!(kind(t.admit(A, T2, 10, 10)), ViolationKind::DuplicateRequest);
    assert_eq!(t.request_info(A).unwrap().tenant, T1, "the first admission stands");
}

// ---- allocation and claims ----

#[test]
fn allocation_never_hands_out_a_reserved_page_and_fails_whole_when_short() {
    let t = table();
    t.admit(A, T1, 128, 0).unwrap();
    t.admit(B, T1, 128, 0).unwrap();
    let got = pages(&t.allocate(A, 15).unwrap());
    assert!(!got.contains(&PageId(0)));
    assert_eq!(t.snapshot().free, 0);
    t.release_pages(A, &got[..2]).unwrap();
    assert!(matches!(t.allocate(B, 3), Err(Error::OutOfPages { requested: 3, free: 2 })));
    assert_eq!(t.snapshot().free, 2, "a failed allocation takes nothing");
}

#[test]
fn allocating_into_page_ids_gives_the_same_pages_and_errors_as_refs() {
    // Two tables, the same requests: one handed refs, the other page ids appended to a row.
    let (by_ref, by_id) = (table(), table());
    for t in [&by_ref, &by_id] {
        t.admit(A, T1, 128, 0).unwrap();
        t.admit(B, T1, 128, 0).unwrap();
    }
    let refs = by_ref.allocate(A, 5).unwrap();
    let mut row = vec![PageId(7)]; // appended after what the row holds
    by_id.allocate_pages_into(A, 5, &mut row).unwrap();
    assert_eq!(row[0], PageId(7));
    assert_eq!(row[1..], pages(&refs)[..]);
    for r in &refs {
        let info = by_id.page_info(r.page).unwrap();
        assert_eq!((info.state, info.owner, info.generation), (PageState::Owned, Some(A), r.generation));
    }
    // The pages are A's in both: written and read through the row alike.
    by_id.record_write_tokens(A, &row[1..], 0..80).unwrap();
    by_id.verify_read(A, &row[1..], 80).unwrap();
    // Refused alike: an unknown request, and more pages than are free (nothing taken).
    assert_eq!(kind(by_ref.allocate(C, 1)), kind(by_id.allocate_pages_into(C, 1, &mut row)));
    assert!(matches!(by_id.allocate_pages_into(B, 11, &mut row), Err(Error::OutOfPages { requested: 11, free: 10 })));
    assert_eq!((row.len(), by_id.snapshot().free), (6, 10), "a failed allocation appends and takes nothing");
}

#[test]
fn shadow_claims_refuse_pages_that_are_not_free_all_or_nothing() {
    let t = table();
    t.admit(A, T1, 64, 0).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    t.claim(A, &[PageId(3), PageId(4)]).unwrap();
    assert_eq!(kind(t.claim(B, &[PageId(5), PageId(4)])), ViolationKind::PageNotFree);
    assert_eq!(t.page_info(PageId(5)).unwrap().state, PageState::Free, "nothing claimed");
    assert_eq!(kind(t.claim(B, &[PageId(6), PageId(6)])), ViolationKind::PageNotFree);
    assert_eq!(kind(t.claim(B, &[PageId(0)])), ViolationKind::ReservedPage);
    assert_eq!(kind(t.claim(B, &[PageId(16)])), ViolationKind::PageOutOfRange);
    assert_eq!(kind(t.claim(B, &[PageId(u32::MAX)])), ViolationKind::PageOutOfRange);
}

#[test]
fn allocator_and_shadow_modes_share_one_set_of_tags() {
    let t = table();
    t.admit(A, T1, 64, 0).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    let first = t.allocate(A, 1).unwrap()[0];
    assert_eq!(kind(t.claim(B, &[first.page])), ViolationKind::PageNotFree);
    t.claim(B, &[PageId(9)]).unwrap();
    let more = pages(&t.allocate(A, 13).unwrap());
    assert!(!more.contains(&PageId(9)), "allocation skips a page claimed in shadow mode");
}

/// A request's pages, claimed one by one, are listed in the order it came by them, whatever
/// reads its list next: an allocation (after them), a release of some (the last listed takes
/// the released one's place), a preemption and a fork (each takes every page, the last claimed
/// too). Claims by id are kept apart from the list until something reads it (what SGLang's
/// decode step at page size 1 makes, a claim a row a step); none of them may be lost or
/// misplaced.
#[test]
fn pages_claimed_one_by_one_are_listed_in_claim_order_whatever_reads_the_list_next() {
    let t = table();
    let owned = |r: RequestId| -> Vec<PageId> { pages(&t.request_info(r).unwrap().owned_pages) };
    t.admit(A, T1, 128, 0).unwrap();
    for p in [9, 4, 12] {
        t.claim(A, &[PageId(p)]).unwrap();
    }
    assert_eq!(owned(A), [PageId(9), PageId(4), PageId(12)]);
    let more = pages(&t.allocate(A, 2).unwrap());
    t.claim(A, &[PageId(7)]).unwrap();
    assert_eq!(owned(A), [PageId(9), PageId(4), PageId(12), more[0], more[1], PageId(7)]);
    t.release_pages(A, &[PageId(4)]).unwrap();
    assert_eq!(owned(A), [PageId(9), PageId(7), PageId(12), more[0], more[1]]);
    // A page claimed and released at once, then one released from the list's middle.
    t.claim(A, &[PageId(4)]).unwrap();
    t.claim(A, &[PageId(3)]).unwrap();
    t.release_pages(A, &[PageId(4), PageId(12)]).unwrap();
    assert_eq!(owned(A), [PageId(9), PageId(7), PageId(3), more[0], more[1]]);
    assert_eq!(t.page_info(PageId(4)).unwrap().state, PageState::Free);
    // A preemption frees every page, the last claimed with the rest.
    t.claim(A, &[PageId(4)]).unwrap();
    t.preempt(A).unwrap();
    assert!(owned(A).is_empty());
    for p in [9, 7, 3, 4] {
        assert_eq!(t.page_info(PageId(p)).unwrap().state, PageState::Free, "page {p}");
    }
    // A fork shares every page, the last claimed too; the parent owns none of them after.
    t.claim(A, &[PageId(5)]).unwrap();
    t.claim(A, &[PageId(6)]).unwrap();
    t.fork(A, B).unwrap();
    assert!(owned(A).is_empty() && owned(B).is_empty());
    for p in [5, 6] {
        assert_eq!(t.page_info(PageId(p)).unwrap().state, PageState::Shared, "page {p}");
    }
    // A release ends what was claimed since: nothing stays owned by a request that is gone.
    t.claim(B, &[PageId(8)]).unwrap();
    t.release(B).unwrap();
    assert_eq!(t.page_info(PageId(8)).unwrap().state, PageState::Free);
}

// ---- writes ----

#[test]
fn writes_need_an_owned_page_and_slots_inside_it() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.admit(B, T1, 16, 0).unwrap();
    assert_eq!(kind(t.record_write(B, a[0], 0..1)), ViolationKind::ForeignPage);
    assert_eq!(kind(t.record_write(B, PageId(12), 0..1)), ViolationKind::FreedPage);
    assert_eq!(kind(t.record_write(B, PageId(0), 0..1)), ViolationKind::ReservedPage);
    assert_eq!(kind(t.record_write(B, PageId(99), 0..1)), ViolationKind::PageOutOfRange);
    assert_eq!(kind(t.record_write(A, a[0], 0..17)), ViolationKind::SlotOutOfRange);
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 5..3;
    assert_eq!(kind(t.record_write(A, a[0], reversed)), ViolationKind::SlotOutOfRange);
    assert_eq!(kind(t.record_write(RequestId(77), a[0], 0..1)), ViolationKind::UnknownRequest);
}

#[test]
fn a_token_write_through_a_block_table_is_all_or_nothing() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.admit(B, T1, 48, 0).unwrap();
    let b = pages(&t.allocate(B, 1).unwrap());
    let err = t.record_write_tokens(B, &[b[0], a[0]], 0..32).unwrap_err();
    assert_eq!(err.violation().unwrap().block_index(), Some(1));
    assert_eq!(t.page_info(b[0]).unwrap().written_slots, 0, "the first page was not marked either");
    assert_eq!(kind(t.record_write_tokens(B, &b, 0..17)), ViolationKind::BlockTableTooShort);
}

#[test]
fn a_write_refused_midway_puts_back_every_watermark_it_moved() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.admit(B, T1, 48, 0).unwrap();
    let b = pages(&t.allocate(B, 3).unwrap());
    t.record_write(B, b[1], 0..5).unwrap();
    // Whole pages between the first and last block; the foreign page comes after two of them
    // (one listed twice) have been marked.
    let table_with_foreign = [b[0], b[1], b[2], b[1], a[0], b[2], b[0]];
    let err = t.record_write_tokens(B, &table_with_foreign, 0..7 * 16).unwrap_err();
    assert_eq!(err.violation().unwrap().kind(), ViolationKind::ForeignPage);
    assert_eq!(err.violation().unwrap().block_index(), Some(4));
    assert_eq!(t.page_info(b[0]).unwrap().written_slots, 0);
    assert_eq!(t.page_info(b[1]).unwrap().written_slots, 5, "the old watermark is back");
    assert_eq!(t.page_info(b[2]).unwrap().written_slots, 0);
}

#[test]
fn a_page_written_whole_stays_whole_when_written_into_again() {
    // Tokens 0..64 over four pages: the two between the first and the last are written whole
    // (their watermarks left behind), then written into again, from a slot at and past their
    // watermark: neither write takes a slot back, and every read of the 64 tokens passes, in
    // full and through a row cache (the decode path's own-page check).
    let t = table();
    t.admit(A, T1, 64, 16).unwrap();
    let bt = pages(&t.allocate(A, 5).unwrap());
    t.record_write_tokens(A, &bt, 0..64).unwrap();
    t.record_write_tokens(A, &bt, 16..17).unwrap(); // page 1 from its first slot
    t.record_write(A, bt[2], 5..6).unwrap(); // page 2 past its watermark
    let entries: Vec<i32> = bt.iter().map(|p| p.0 as i32).collect();
    let rows = BlockRows::new(&entries, entries.len()).unwrap();
    let mut cache = RowCache::new();
    for tokens in [64, 20, 37, 64] {
        t.verify_read(A, &bt, tokens).unwrap();
        let read = [RowRead { request: A, row: 0, tokens }];
        assert!(t.verify_rows(&mut cache, rows, &read).unwrap().is_clean(), "{tokens} tokens");
    }
    // The decode path after it: each token appended to page 4, read through the cache.
    for n in 64..80 {
        t.record_write_tokens(A, &bt, n..n + 1).unwrap();
        let read = [RowRead { request: A, row: 0, tokens: n + 1 }];
        assert!(t.verify_rows(&mut cache, rows, &read).unwrap().is_clean(), "{} tokens", n + 1);
    }
    assert!(cache.incremental() > 0);
}

// ---- reads ----

#[test]
fn a_read_of_own_written_slots_passes_at_any_length() {
    let t = table();
    let a = written(&t, A, T1, 40);
    for n in 0..=40 {
        t.verify_read(A, &a, n).unwrap();
    }
}

#[test]
fn a_read_of_another_requests_page_is_foreign_and_quarantines_the_reader() {
    let t = table();
    let a = written(&t, A, T1, 16);
    let b = written(&t, B, T2, 16);
    let err = t.verify_read(B, &[a[0]], 16).unwrap_err();
    let v = err.violation().unwrap();
    assert_eq!(v.kind(), ViolationKind::ForeignPage);
    assert_eq!((v.request(), v.owner(), v.page(), v.block_index()), (Some(B), Some(A), Some(a[0]), Some(0)));
    assert_eq!(v.owner_tenant(), Some(T1));
    // Quarantined: even its own pages are refused until it is released.
    assert_eq!(kind(t.verify_read(B, &b, 16)), ViolationKind::Quarantined);
    assert!(t.request_info(B).unwrap().quarantined);
    t.release(B).unwrap();
    let b = written(&t, B, T2, 16);
    t.verify_read(B, &b, 16).unwrap();
}

#[test]
fn a_read_of_a_freed_page_is_refused() {
    let t = table();
    let a = written(&t, A, T1, 32);
    t.release_pages(A, &a[..1]).unwrap();
    assert_eq!(kind(t.verify_read(A, &a, 32)), ViolationKind::FreedPage);
}

#[test]
fn a_stale_block_table_entry_after_reuse_is_foreign_or_stale() {
    let t = table();
    let a = written(&t, A, T1, 32);
    let old = t.request_info(A).unwrap().owned_pages;
    t.release_pages(A, &a[..1]).unwrap();
    // The page goes to B, who writes it: A's stale entry now points at B's KV.
    t.admit(B, T2, 16, 0).unwrap();
    let b = t.claim(B, &[a[0]]).unwrap();
    t.record_write(B, b[0].page, 0..16).unwrap();
    assert_eq!(b[0].generation, Generation(2));
    let err = t.check_read(A, &a, 32).unwrap_err();
    assert_eq!(err.kind(), ViolationKind::ForeignPage);
    assert_eq!(err.owner(), Some(B));
    // Through a ref, the same page comes back to A itself and is still refused: a new incarnation.
    t.release(B).unwrap();
    let again = t.claim(A, &[a[0]]).unwrap();
    t.record_write(A, a[0], 0..16).unwrap();
    let stale = old.iter().find(|r| r.page == a[0]).copied().unwrap();
    assert_eq!(stale.generation, Generation(1));
    let err = t.verify_read_refs(A, &[stale], 16).unwrap_err();
    let v = err.violation().unwrap();
    assert_eq!(v.kind(), ViolationKind::StalePage);
    assert_eq!((v.generation(), v.expected_generation()), (Some(Generation(3)), Some(Generation(1))));
    assert_eq!(again[0].generation, Generation(3));
}

#[test]
fn a_read_of_unwritten_slots_names_them() {
    let t = table();
    t.admit(A, T1, 64, 0).unwrap();
    let a = pages(&t.allocate(A, 2).unwrap());
    t.record_write(A, a[0], 0..16).unwrap();
    t.record_write(A, a[1], 0..3).unwrap();
    t.record_write(A, a[1], 8..16).unwrap();
    let v = t.check_read(A, &a, 32).unwrap_err();
    assert_eq!(v.kind(), ViolationKind::UnwrittenSlots);
    assert_eq!((v.page(), v.block_index(), v.slots()), (Some(a[1]), Some(1), Some((3, 8))));
    t.record_write(A, a[1], 3..8).unwrap();
    t.verify_read(A, &a, 32).unwrap();
}

#[test]
fn the_incident_mechanism_is_refused_an_allocated_page_that_was_never_written() {
    // Decode allocated pages for the whole prompt, but prefill sent one token: the rest of the
    // pages still hold whatever their previous owner wrote.
    let t = table();
    let old = written(&t, B, T2, 64);
    t.release(B).unwrap();
    t.admit(A, T1, 64, 0).unwrap();
    let a = pages(&t.allocate(A, 4).unwrap());
    assert_eq!(a.iter().filter(|p| old.contains(p)).count(), 4, "the pool hands the old pages back");
    t.record_import(A, &a, 1, 1).unwrap();
    assert_eq!(kind(t.verify_read(A, &a, 64)), ViolationKind::UnwrittenSlots);
}

#[test]
fn a_read_of_the_reserved_null_page_is_refused() {
    let t = table();
    let a = written(&t, A, T1, 16);
    assert_eq!(kind(t.verify_read(A, &[a[0], PageId(0)], 17)), ViolationKind::ReservedPage);
}

#[test]
fn a_read_past_the_block_table_or_the_pool_is_refused() {
    let t = table();
    let a = written(&t, A, T1, 16);
    assert_eq!(t.check_read(A, &a, 17).unwrap_err().kind(), ViolationKind::BlockTableTooShort);
    assert_eq!(kind(t.verify_read(A, &a, u64::MAX)), ViolationKind::BlockTableTooShort);
    t.release(A).unwrap();
    let a = written(&t, A, T1, 16);
    assert_eq!(kind(t.verify_read(A, &[a[0], PageId(4000)], 20)), ViolationKind::PageOutOfRange);
}

#[test]
fn a_read_by_an_unknown_request_is_refused() {
    let t = table();
    assert_eq!(kind(t.verify_read(A, &[], 0)), ViolationKind::UnknownRequest);
}

#[test]
fn entries_past_the_tokens_read_are_not_checked() {
    // Engines pad block tables (with the null page, or garbage) past the sequence length.
    let t = table();
    let a = written(&t, A, T1, 16);
    t.verify_read(A, &[a[0], PageId(0), PageId(u32::MAX)], 16).unwrap();
}

#[test]
fn a_decode_step_lists_every_refused_sequence() {
    let t = table();
    let a = written(&t, A, T1, 32);
    let b = written(&t, B, T2, 32);
    let c = written(&t, C, T1, 20);
    let step = [
        SeqRead { request: A, block_table: &a, tokens: 32 },
        SeqRead { request: B, block_table: &a, tokens: 16 },
        SeqRead { request: C, block_table: &c, tokens: 21 },
        SeqRead { request: B, block_table: &b, tokens: 32 },
    ];
    let verdict = t.verify_step(&step);
    let refused: Vec<_> = verdict.refused.iter().map(|(i, v)| (*i, v.kind())).collect();
    // B's foreign read quarantines it, so its own sequence later in the step is refused too.
    assert_eq!(
        refused,
        vec![(1, ViolationKind::ForeignPage), (2, ViolationKind::UnwrittenSlots), (3, ViolationKind::Quarantined)]
    );
    assert!(!verdict.is_clean());
}

// ---- release ----

#[test]
fn releasing_bumps_generations_and_releasing_again_is_a_double_free() {
    let t = table();
    let a = written(&t, A, T1, 32);
    let released = t.release(A).unwrap();
    assert_eq!(released.ended, 2);
    for p in &a {
        let info = t.page_info(*p).unwrap();
        assert_eq!((info.state, info.generation, info.written_slots), (PageState::Free, Generation(2), 0));
    }
    assert_eq!(kind(t.release(A)), ViolationKind::DoubleFree);
    assert_eq!(kind(t.release(RequestId(12345))), ViolationKind::UnknownRequest);
}

#[test]
fn releasing_pages_one_does_not_own_is_refused_all_or_nothing() {
    let t = table();
    let a = written(&t, A, T1, 32);
    let b = written(&t, B, T1, 16);
    assert_eq!(kind(t.release_pages(A, &[a[0], b[0]])), ViolationKind::ForeignPage);
    assert_eq!(t.page_info(a[0]).unwrap().state, PageState::Owned, "nothing released");
    assert_eq!(kind(t.release_pages(A, &[a[0], a[0]])), ViolationKind::DoubleFree);
    t.release_pages(A, &[a[0]]).unwrap();
    assert_eq!(kind(t.release_pages(A, &[a[0]])), ViolationKind::DoubleFree);
    assert_eq!(kind(t.release_pages(A, &[PageId(0)])), ViolationKind::ReservedPage);
    assert!(t.request_info(A).unwrap().quarantined, "refused releases quarantine the releaser");
    assert_eq!(t.page_info(a[1]).unwrap().state, PageState::Owned, "the page it kept is still its own");
}

#[test]
fn preemption_releases_pages_but_keeps_the_request_admitted() {
    let t = table();
    let a = written(&t, A, T1, 32);
    t.preempt(A).unwrap();
    assert_eq!(t.check_read(A, &a, 32).unwrap_err().kind(), ViolationKind::FreedPage);
    assert!(t.request_info(A).unwrap().owned_pages.is_empty());
    let again = pages(&t.allocate(A, 2).unwrap());
    t.record_write_tokens(A, &again, 0..32).unwrap();
    t.verify_read(A, &again, 32).unwrap();
}

#[test]
fn a_quarantine_outlasts_preemption_and_ends_with_release() {
    let t = table();
    let a = written(&t, A, T1, 16);
    assert_eq!(kind(t.verify_read(A, &[PageId(0)], 1)), ViolationKind::ReservedPage);
    t.preempt(A).unwrap();
    let again = pages(&t.allocate(A, 1).unwrap());
    t.record_write_tokens(A, &again, 0..16).unwrap();
    assert_eq!(kind(t.verify_read(A, &again, 16)), ViolationKind::Quarantined);
    t.release(A).unwrap();
    let a2 = written(&t, A, T1, 16);
    t.verify_read(A, &a2, 16).unwrap();
    assert_ne!(a, Vec::<PageId>::new());
}

#[test]
fn a_released_request_can_be_admitted_again() {
    let t = table();
    written(&t, A, T1, 16);
    t.release(A).unwrap();
    let a = written(&t, A, T1, 16);
    t.verify_read(A, &a, 16).unwrap();
}

// ---- prefixes and forks ----

#[test]
fn a_published_prefix_is_readable_by_its_holders_only() {
    let t = table();
    let a = written(&t, A, T1, 32);
    t.publish_prefix(A, KEY, &a).unwrap();
    t.verify_read(A, &a, 32).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    assert_eq!(kind(t.verify_read(B, &a, 32)), ViolationKind::ForeignPage);
    t.release(B).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    let refs = t.attach_prefix(B, KEY).unwrap();
    assert_eq!(pages(&refs), a);
    t.verify_read_refs(B, &refs, 32).unwrap();
    assert_eq!(t.page_info(a[0]).unwrap().prefix, Some(KEY));
}

#[test]
fn writing_a_shared_page_is_refused() {
    let t = table();
    let a = written(&t, A, T1, 20);
    t.publish_prefix(A, KEY, &a).unwrap();
    assert_eq!(kind(t.record_write(A, a[1], 4..5)), ViolationKind::WriteToShared);
    assert_eq!(kind(t.release_pages(A, &a[..1])), ViolationKind::PageShared);
    assert_eq!(kind(t.publish_prefix(A, PrefixKey(9), &a)), ViolationKind::PageShared);
}

#[test]
fn publishing_a_key_twice_or_a_foreign_page_is_refused() {
    let t = table();
    let a = written(&t, A, T1, 16);
    let b = written(&t, B, T1, 16);
    t.publish_prefix(A, KEY, &a).unwrap();
    assert_eq!(kind(t.publish_prefix(B, KEY, &b)), ViolationKind::DuplicatePrefix);
    assert_eq!(kind(t.publish_prefix(B, PrefixKey(2), &a)), ViolationKind::ForeignPage);
    assert_eq!(kind(t.publish_prefix(B, PrefixKey(2), &[PageId(13)])), ViolationKind::FreedPage);
}

#[test]
fn attaching_across_tenants_needs_the_owners_consent() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.publish_prefix(A, KEY, &a).unwrap();
    t.admit(B, T2, 16, 0).unwrap();
    let err = t.attach_prefix(B, KEY).unwrap_err();
    let v = err.violation().unwrap();
    assert_eq!(v.kind(), ViolationKind::CrossTenantShare);
    assert_eq!((v.tenant(), v.owner_tenant()), (Some(T2), Some(T1)));
    t.allow_cross_tenant_sharing(T1, true);
    t.release(B).unwrap();
    t.admit(B, T2, 16, 0).unwrap();
    t.attach_prefix(B, KEY).unwrap();
    t.verify_read(B, &a, 16).unwrap();
}

#[test]
fn evicting_a_held_prefix_is_refused_and_pages_return_after_the_last_holder() {
    let t = table();
    let a = written(&t, A, T1, 32);
    t.publish_prefix(A, KEY, &a).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    t.attach_prefix(B, KEY).unwrap();
    let v = t.evict_prefix(KEY).unwrap_err();
    assert_eq!(v.violation_kind(), Some(ViolationKind::EvictInUse));
    assert_eq!(v.violation().unwrap().amounts(), Some((2, 0)));
    t.release(A).unwrap();
    t.verify_read(B, &a, 32).unwrap();
    t.detach_prefix(B, KEY).unwrap();
    assert_eq!(t.page_info(a[0]).unwrap().state, PageState::Shared, "cached until evicted");
    let free_before = t.snapshot().free;
    assert_eq!(t.evict_prefix(KEY).unwrap().ended, 2);
    assert_eq!(t.snapshot().free, free_before + 2);
    // A phantom hit after eviction: the key is gone.
    assert_eq!(kind(t.attach_prefix(B, KEY)), ViolationKind::UnknownPrefix);
    assert_eq!(kind(t.evict_prefix(KEY)), ViolationKind::UnknownPrefix);
    assert_eq!(kind(t.detach_prefix(B, KEY)), ViolationKind::UnknownPrefix);
}

#[test]
fn a_fork_shares_the_parents_pages_read_only_until_both_release() {
    let t = table();
    let a = written(&t, A, T1, 24);
    t.fork(A, B).unwrap();
    assert_eq!(t.request_info(B).unwrap().tenant, T1);
    t.verify_read(B, &a, 24).unwrap();
    t.verify_read(A, &a, 24).unwrap();
    // The half-full last page is shared now: appending to it is the engine's copy-on-write.
    assert_eq!(kind(t.record_write(A, a[1], 8..9)), ViolationKind::WriteToShared);
    assert_eq!(kind(t.verify_read(A, &a, 24)), ViolationKind::Quarantined, "the offender is quarantined");
    t.release(A).unwrap();
    t.verify_read(B, &a, 24).unwrap();
    assert_eq!(t.page_info(a[0]).unwrap().state, PageState::Shared);
    t.release(B).unwrap();
    assert_eq!(t.page_info(a[0]).unwrap().state, PageState::Free);
    assert_eq!(kind(t.fork(A, C)), ViolationKind::UnknownRequest);
    let a = written(&t, A, T1, 16);
    let c = written(&t, C, T2, 16);
    // Forking onto a live id is the parent's fault: the live child is not quarantined.
    let err = t.fork(A, C).unwrap_err();
    let v = err.violation().unwrap();
    assert_eq!((v.kind(), v.request(), v.owner()), (ViolationKind::DuplicateRequest, Some(A), Some(C)));
    t.verify_read(C, &c, 16).unwrap();
    assert_eq!(kind(t.verify_read(A, &a, 16)), ViolationKind::Quarantined);
    // A quarantined parent cannot hand its pages to an unquarantined child.
    assert_eq!(kind(t.fork(A, B)), ViolationKind::Quarantined);
    assert!(t.request_info(B).is_none());
}

#[test]
fn an_import_with_the_wrong_token_count_records_nothing() {
    let t = table();
    t.admit(A, T1, 40, 0).unwrap();
    let refs = t.allocate(A, 3).unwrap();
    let err = t.record_import_refs(A, &refs, 1, 40).unwrap_err();
    assert_eq!(err.violation().unwrap().amounts(), Some((1, 40)));
    assert_eq!(err.violation_kind(), Some(ViolationKind::TokenCountMismatch));
    assert_eq!(t.page_info(refs[0].page).unwrap().written_slots, 0);
    assert!(t.request_info(A).unwrap().quarantined, "a short transfer quarantines its request");
    // Ended and redone with the right count, the transfer lands and is readable.
    t.release(A).unwrap();
    t.admit(A, T1, 40, 0).unwrap();
    let refs = t.allocate(A, 3).unwrap();
    t.record_import_refs(A, &refs, 40, 40).unwrap();
    t.verify_read_refs(A, &refs, 40).unwrap();
}

#[test]
fn a_late_import_after_release_and_reuse_is_refused() {
    let t = table();
    t.admit(A, T1, 16, 0).unwrap();
    let refs = t.allocate(A, 1).unwrap();
    t.release(A).unwrap();
    assert_eq!(kind(t.record_import_refs(A, &refs, 16, 16)), ViolationKind::UnknownRequest);
    t.admit(A, T1, 16, 0).unwrap();
    let again = t.claim(A, &[refs[0].page]).unwrap();
    assert_eq!(kind(t.record_import_refs(A, &refs, 16, 16)), ViolationKind::StalePage);
    assert_eq!(t.page_info(again[0].page).unwrap().written_slots, 0);
}

// ---- policy, scrubbing, retirement, visibility ----

#[test]
fn report_policy_counts_and_logs_but_lets_reads_through() {
    let t = OwnershipTable::new(pool().with_policy(Policy::Report)).unwrap();
    let a = written(&t, A, T1, 16);
    t.admit(B, T2, 16, 0).unwrap();
    t.verify_read(B, &a, 16).unwrap();
    t.verify_read(B, &a, 16).unwrap();
    assert!(!t.request_info(B).unwrap().quarantined);
    assert_eq!(t.counters().get(ViolationKind::ForeignPage), 2);
    let log = t.drain_violations();
    assert_eq!(log.len(), 2);
    assert!(log[0].to_string().starts_with("foreign_page: req 2 (tenant 200) read page"), "{}", log[0]);
    assert!(t.drain_violations().is_empty());
    // Mutations the table cannot represent are still refused.
    assert_eq!(kind(t.claim(B, &[a[0]])), ViolationKind::PageNotFree);
}

#[test]
fn scrubbed_pools_hold_released_pages_until_the_scrub_is_confirmed() {
    let t = OwnershipTable::new(PoolConfig::new(8, PS, 16).with_scrub_on_release(true)).unwrap();
    t.admit(A, T1, 16, 0).unwrap();
    let all = t.allocate(A, 8).unwrap();
    let released = t.release(A).unwrap();
    assert_eq!(released.scrub.len(), 8);
    assert_eq!(t.snapshot().awaiting_scrub, 8);
    t.admit(B, T1, 16, 0).unwrap();
    assert!(matches!(t.allocate(B, 1), Err(Error::OutOfPages { .. })));
    assert_eq!(kind(t.claim(B, &[all[0].page])), ViolationKind::PageNotFree);
    let wrong = PageRef { page: all[0].page, generation: Generation(7) };
    assert!(matches!(t.confirm_scrubbed(&[wrong]), Err(Error::NotAwaitingScrub(_))));
    t.confirm_scrubbed(&released.scrub[..1]).unwrap();
    assert!(matches!(t.confirm_scrubbed(&released.scrub[..1]), Err(Error::NotAwaitingScrub(_))));
    assert_eq!(t.allocate(B, 1).unwrap()[0].page, released.scrub[0].page);
}

#[test]
fn a_page_whose_generation_reaches_the_limit_is_retired_not_wrapped() {
    let t = OwnershipTable::new(PoolConfig::new(2, PS, 32).with_generation_limit(3)).unwrap();
    let mut gens = Vec::new();
    for round in 0..6 {
        t.admit(A, T1, 16, 0).unwrap();
        match t.claim(A, &[PageId(0)]) {
            Ok(r) => gens.push(r[0].generation.0),
            Err(e) => {
                assert_eq!(e.violation_kind(), Some(ViolationKind::PageNotFree), "round {round}");
                assert_eq!(t.page_info(PageId(0)).unwrap().state, PageState::Retired);
            }
        }
        t.release(A).unwrap();
    }
    assert_eq!(gens, vec![1, 2, 3]);
    let s = t.snapshot();
    assert_eq!((s.retired, s.free), (1, 1));
    // Admission now knows the pool lost a page for good.
    assert_eq!(kind(t.admit(A, T1, 17, 0)), ViolationKind::ExceedsPool);
}

#[test]
fn the_snapshot_accounts_for_every_page() {
    let t = table();
    let a = written(&t, A, T1, 32);
    written(&t, B, T1, 16);
    t.publish_prefix(A, KEY, &a[..1]).unwrap();
    let s = t.snapshot();
    assert_eq!((s.total_pages, s.reserved, s.owned, s.shared, s.free), (16, 1, 2, 1, 12));
    assert_eq!(s.free + s.owned + s.shared + s.reserved + s.retired + s.awaiting_scrub, s.total_pages);
    assert_eq!((s.requests, s.prefixes, s.quarantined), (2, 1, 0));
}

#[test]
fn changed_pages_are_listed_once_until_taken() {
    let t = table();
    written(&t, C, T1, 16);
    // Nothing is tracked until a mirror first asks: the first call hands back the whole pool.
    let first: Vec<PageId> = t.take_changed_pages().iter().map(|(p, _)| *p).collect();
    assert_eq!(first, (0..16).map(PageId).collect::<Vec<_>>());
    assert!(t.take_changed_pages().is_empty());
    let a = written(&t, A, T1, 32);
    let changed = t.take_changed_pages();
    let mut ids: Vec<PageId> = changed.iter().map(|(p, _)| *p).collect();
    ids.sort();
    assert_eq!(ids, a);
    assert!(changed.iter().all(|(_, i)| i.state == PageState::Owned && i.owner == Some(A) && i.written_prefix == 16));
    assert!(t.take_changed_pages().is_empty());
    t.release(A).unwrap();
    assert_eq!(t.take_changed_pages().len(), 2);
}

#[test]
fn external_violations_are_counted_and_quarantine_under_enforce() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.record_violation(
        kvguard::Violation::new(ViolationKind::TokenCountMismatch, kvguard::Op::Import).with_request(A, None),
    );
    assert_eq!(t.counters().get(ViolationKind::TokenCountMismatch), 1);
    assert_eq!(kind(t.verify_read(A, &a, 16)), ViolationKind::Quarantined);
}

#[test]
fn the_violation_log_is_bounded() {
    let t = OwnershipTable::new(pool().with_policy(Policy::Report)).unwrap();
    t.admit(A, T1, 16, 0).unwrap();
    for _ in 0..(kvguard::table::VIOLATION_LOG_CAPACITY + 10) {
        t.verify_read(A, &[PageId(5)], 1).unwrap();
    }
    assert_eq!(t.drain_violations().len(), kvguard::table::VIOLATION_LOG_CAPACITY);
    assert_eq!(t.snapshot().violations_dropped, 10);
}

#[test]
fn the_table_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<OwnershipTable>();
}

#[test]
fn hostile_sizes_get_typed_errors_never_panics() {
    let t = table();
    t.admit(A, T1, 16, 0).unwrap();
    assert!(matches!(t.allocate(A, u32::MAX), Err(Error::OutOfPages { requested: 4_294_967_295, .. })));
    let a = pages(&t.allocate(A, 1).unwrap());
    assert_eq!(kind(t.record_write_tokens(A, &a, u64::MAX - 1..u64::MAX)), ViolationKind::BlockTableTooShort);
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 9..3;
    let refused = t.record_write_tokens(A, &a, reversed.clone()).unwrap_err();
    assert_eq!(refused.violation_kind(), Some(ViolationKind::TokenRangeReversed));
    assert!(refused.to_string().contains("tokens 9..3 (start after end)"), "{refused}");
    let refs = t.request_info(A).unwrap().owned_pages;
    assert_eq!(kind(t.record_write_tokens_refs(A, &refs, reversed)), ViolationKind::TokenRangeReversed);
    assert_eq!(kind(t.record_write(A, a[0], u32::MAX - 1..u32::MAX)), ViolationKind::SlotOutOfRange);
    assert_eq!(kind(t.record_import(A, &a, u64::MAX, u64::MAX)), ViolationKind::BlockTableTooShort);
    t.release(A).unwrap();
    t.admit(A, T1, 16, 0).unwrap();
    // A block table of a million entries and a read of u64::MAX tokens.
    let huge = vec![PageId(u32::MAX); 1 << 20];
    assert_eq!(t.check_read(A, &huge, u64::MAX).unwrap_err().kind(), ViolationKind::BlockTableTooShort);
    assert_eq!(t.check_read(A, &huge, 1 << 24).unwrap_err().kind(), ViolationKind::PageOutOfRange);
    // Long id lists are checked in linear time, and refused whole.
    let many: Vec<PageId> = (0..200_000).map(PageId).collect();
    assert_eq!(kind(t.claim(A, &many)), ViolationKind::ReservedPage);
    assert_eq!(kind(t.release_pages(A, &many[1..])), ViolationKind::DoubleFree);
    assert_eq!(kind(t.admit(RequestId(u64::MAX), TenantId(u64::MAX), u64::MAX, 1)), ViolationKind::ExceedsMaxContext);
    assert!(t.page_info(PageId(u32::MAX)).is_none());
    assert!(t.request_info(RequestId(u64::MAX)).is_none());
    let s = t.snapshot();
    assert_eq!(s.free + s.reserved, s.total_pages, "nothing leaked: {s:?}");
}

#[test]
fn an_empty_write_touches_no_page() {
    let t = table();
    let a = written(&t, A, T1, 16);
    let b = written(&t, B, T1, 16);
    t.record_write_tokens(B, &[b[0], a[0]], 5..5).unwrap();
    t.record_write_tokens(B, &[], 40..40).unwrap();
    assert!(!t.request_info(B).unwrap().quarantined);
}

#[test]
fn every_refused_read_names_the_slots_it_wanted() {
    let t = table();
    let a = written(&t, A, T1, 16);
    t.admit(B, T2, 16, 0).unwrap();
    let v = t.check_read(B, &a, 9).unwrap_err();
    assert_eq!((v.kind(), v.slots()), (ViolationKind::ForeignPage, Some((0, 9))));
    assert!(v.to_string().ends_with("slots 0..9"), "{v}");
}

#[test]
fn a_request_holding_many_prefixes_reads_them_all() {
    // One prefix per cached block, vLLM-style: membership must stay exact as the list grows.
    let t = OwnershipTable::new(PoolConfig::new(600, PS, 600 * 16)).unwrap();
    t.admit(A, T1, 512 * 16, 0).unwrap();
    let a = pages(&t.allocate(A, 512).unwrap());
    t.record_write_tokens(A, &a, 0..512 * 16).unwrap();
    for (i, p) in a.iter().enumerate().rev() {
        t.publish_prefix(A, PrefixKey(i as u64), &[*p]).unwrap();
    }
    t.admit(B, T1, 512 * 16, 0).unwrap();
    for i in (0..512).step_by(2) {
        t.attach_prefix(B, PrefixKey(i)).unwrap();
    }
    let even: Vec<PageId> = a.iter().step_by(2).copied().collect();
    t.verify_read(B, &even, 256 * 16).unwrap();
    assert_eq!(t.check_read(B, &a[..2], 32).unwrap_err().kind(), ViolationKind::ForeignPage);
    t.verify_read(A, &a, 512 * 16).unwrap();
}

// ---- transfers in flight ----

#[test]
fn a_transfer_lands_between_begin_import_and_its_tickets_finish() {
    let t = table();
    t.admit(A, T1, 40, 0).unwrap();
    let refs = t.allocate(A, 3).unwrap();
    let ticket = t.begin_import(A, &refs).unwrap();
    assert_eq!((ticket.request(), ticket.pages()), (A, &refs[..]));
    ticket.finish(40, 40).unwrap();
    t.verify_read_refs(A, &refs, 40).unwrap();
    // Finished: the pages can take another transfer.
    let again = t.begin_import(A, &refs[2..]).unwrap();
    again.abort();
    assert_eq!(t.page_info(refs[2].page).unwrap().written_slots, 8, "an aborted transfer records nothing");
}

#[test]
fn two_transfers_into_one_page_at_once_are_refused() {
    let t = table();
    t.admit(A, T1, 40, 0).unwrap();
    let refs = t.allocate(A, 3).unwrap();
    let first = t.begin_import(A, &refs[1..]).unwrap();
    assert_eq!(kind(t.begin_import(A, &refs[..2])), ViolationKind::ImportInFlight);
    assert_eq!(kind(t.begin_import(A, &[refs[0], refs[0]])), ViolationKind::ImportInFlight);
    first.abort();
}

#[test]
fn pages_released_while_a_transfer_is_in_flight_are_not_handed_out_until_it_ends() {
    let t = table();
    t.admit(A, T1, 32, 0).unwrap();
    let refs = t.allocate(A, 2).unwrap();
    let ticket = t.begin_import(A, &refs).unwrap();
    // The request ends while its bytes are still landing.
    t.release(A).unwrap();
    assert_eq!(t.page_info(refs[0].page).unwrap().state, PageState::Free);
    t.admit(B, T2, 128, 0).unwrap();
    assert_eq!(kind(t.claim(B, &[refs[0].page])), ViolationKind::PageNotFree);
    let got = pages(&t.allocate(B, 13).unwrap());
    assert!(!got.contains(&refs[0].page) && !got.contains(&refs[1].page));
    assert!(matches!(t.allocate(B, 1), Err(Error::OutOfPages { .. })), "the pinned pages are not free to give");
    // The landing transfer is refused, and only then do the pages return.
    assert_eq!(kind(ticket.finish(32, 32)), ViolationKind::UnknownRequest);
    let more = pages(&t.allocate(B, 2).unwrap());
    assert!(more.contains(&refs[0].page) && more.contains(&refs[1].page));
    assert_eq!(t.page_info(refs[0].page).unwrap().written_slots, 0);
}

#[test]
fn a_transfer_must_name_the_requests_current_pages() {
    let t = table();
    t.admit(A, T1, 32, 0).unwrap();
    let refs = t.allocate(A, 2).unwrap();
    let b = written(&t, B, T2, 16);
    let stale = PageRef { page: refs[0].page, generation: Generation(9) };
    assert_eq!(kind(t.begin_import(A, &[stale])), ViolationKind::StalePage);
    assert_eq!(kind(t.begin_import(C, &refs)), ViolationKind::UnknownRequest);
    t.release(A).unwrap();
    t.admit(A, T1, 32, 0).unwrap();
    let foreign = PageRef { page: b[0], generation: Generation(1) };
    assert_eq!(kind(t.begin_import(A, &[foreign])), ViolationKind::ForeignPage);
    assert_eq!(t.page_info(b[0]).unwrap().written_slots, 16, "nothing changed for the owner");
}

#[test]
fn a_scrubbed_pool_keeps_in_flight_pages_out_until_both_scrub_and_transfer_end() {
    let t = OwnershipTable::new(PoolConfig::new(4, PS, 16).with_scrub_on_release(true)).unwrap();
    t.admit(A, T1, 16, 0).unwrap();
    let refs = t.allocate(A, 1).unwrap();
    let ticket = t.begin_import(A, &refs).unwrap();
    let released = t.release(A).unwrap();
    // A scrub while bytes may still land does not count.
    assert!(matches!(t.confirm_scrubbed(&released.scrub), Err(Error::ScrubInFlight(r)) if r == released.scrub[0]));
    assert_eq!(t.snapshot().in_flight, 1);
    t.admit(B, T1, 16, 0).unwrap();
    assert_eq!(kind(t.claim(B, &[refs[0].page])), ViolationKind::PageNotFree);
    ticket.abort();
    assert_eq!(kind(t.claim(B, &[refs[0].page])), ViolationKind::PageNotFree, "still unscrubbed");
    t.confirm_scrubbed(&released.scrub).unwrap();
    t.claim(B, &[refs[0].page]).unwrap();
}

#[test]
fn ending_one_transfer_never_unpins_another_transfers_pages() {
    let t = table();
    t.admit(A, T1, 16, 0).unwrap();
    let refs = t.allocate(A, 1).unwrap();
    let first = t.begin_import(A, &refs).unwrap();
    first.finish(16, 16).unwrap();
    // The page goes round: released, reallocated to B, and B's own transfer pins it.
    t.release(A).unwrap();
    t.admit(B, T2, 16, 0).unwrap();
    let b_refs = t.claim(B, &[refs[0].page]).unwrap();
    let second = t.begin_import(B, &b_refs).unwrap();
    // A stale transfer for A's old incarnation cannot even start, so it cannot end B's pin...
    t.admit(A, T1, 16, 0).unwrap();
    assert_eq!(kind(t.begin_import(A, &refs)), ViolationKind::ForeignPage);
    // ...and B, released mid-transfer, keeps the page out of the pool until its own ticket ends.
    t.release(B).unwrap();
    assert_eq!(kind(t.claim(A, &[refs[0].page])), ViolationKind::PageNotFree);
    second.abort();
    t.claim(A, &[refs[0].page]).unwrap();
}

#[test]
fn a_dropped_ticket_aborts_its_transfer() {
    let t = table();
    t.admit(A, T1, 32, 0).unwrap();
    let refs = t.allocate(A, 2).unwrap();
    {
        let _ticket = t.begin_import(A, &refs).unwrap();
        t.release(A).unwrap();
        let s = t.snapshot();
        assert_eq!(s.in_flight, 2, "released but still receiving: {s:?}");
        // An early return in the engine's transfer path drops the ticket here.
    }
    assert_eq!(t.snapshot().in_flight, 0);
    t.admit(B, T2, 32, 0).unwrap();
    t.claim(B, &[refs[0].page, refs[1].page]).unwrap();
}

#[test]
fn a_ticket_ends_only_its_own_tables_pins() {
    // Two pools, one transfer manager: the same page ids pinned in both.
    let (x, y) = (table(), table());
    for t in [&x, &y] {
        t.admit(A, T1, 16, 0).unwrap();
    }
    let (rx, ry) = (x.allocate(A, 1).unwrap(), y.allocate(A, 1).unwrap());
    assert_eq!(rx, ry);
    let tx = x.begin_import(A, &rx).unwrap();
    let ty = y.begin_import(A, &ry).unwrap();
    y.release(A).unwrap();
    tx.abort();
    y.admit(B, T2, 16, 0).unwrap();
    assert_eq!(kind(y.claim(B, &[ry[0].page])), ViolationKind::PageNotFree, "y's transfer is still in flight");
    drop(ty);
    y.claim(B, &[ry[0].page]).unwrap();
}

// ---- pure and judged forms, ids and refs ----

/// A's page `a[0]` released and claimed again by A: the ref A held before names an ended
/// incarnation. Returns (the stale ref, the current refs of A's pages).
fn stale_and_current(t: &OwnershipTable) -> (PageRef, Vec<PageRef>) {
    let a = written(t, A, T1, 32);
    let old = t.request_info(A).unwrap().owned_pages;
    let stale = old.iter().find(|r| r.page == a[0]).copied().unwrap();
    t.release_pages(A, &a[..1]).unwrap();
    t.claim(A, &[a[0]]).unwrap();
    let current = a.iter().map(|&p| PageRef { page: p, generation: t.page_info(p).unwrap().generation }).collect();
    (stale, current)
}

#[test]
fn check_forms_are_pure_and_verify_forms_are_judged_under_either_policy() {
    for policy in [Policy::Enforce, Policy::Report] {
        let t = OwnershipTable::new(pool().with_policy(policy)).unwrap();
        let a = written(&t, A, T1, 16);
        t.admit(B, T2, 16, 0).unwrap();
        let step = [SeqRead { request: B, block_table: &a, tokens: 16 }];
        // Pure: the verdict, and nothing counted, logged or quarantined.
        assert_eq!(t.check_read(B, &a, 16).unwrap_err().kind(), ViolationKind::ForeignPage);
        assert_eq!(t.check_step(&step).refused.len(), 1);
        assert_eq!(t.counters().total(), 0);
        assert!(!t.request_info(B).unwrap().quarantined);
        // Judged: counted and logged; enforce refuses and quarantines, report lets it through.
        let read = t.verify_read(B, &a, 16);
        assert_eq!(read.is_err(), policy == Policy::Enforce);
        assert_eq!(t.counters().total(), 1);
        assert_eq!(t.drain_violations().len(), 1);
        assert_eq!(t.request_info(B).unwrap().quarantined, policy == Policy::Enforce);
        assert_eq!(t.verify_step(&step).refused.len(), 1);
        assert_eq!(t.counters().total(), 2);
    }
}

#[test]
fn every_block_table_method_has_a_refs_form_that_refuses_a_stale_ref() {
    // Report: the refused calls below do not quarantine A, so the clean ones after them run.
    let t = OwnershipTable::new(pool().with_policy(Policy::Report)).unwrap();
    let (stale, current) = stale_and_current(&t);
    let stale_kind = |r: Result<(), kvguard::Violation>| r.unwrap_err().kind();
    assert_eq!(stale_kind(t.check_read_refs(A, &[stale], 1)), ViolationKind::StalePage);
    t.verify_read_refs(A, &[stale], 1).unwrap(); // judged under report: counted, let through
    assert_eq!(t.drain_violations()[0].kind(), ViolationKind::StalePage);
    let step = [SeqRead { request: A, block_table: &current[1..], tokens: 16 }];
    assert!(t.check_step_refs(&step).is_clean());
    assert!(t.verify_step_refs(&step).is_clean());
    let step = [SeqRead { request: A, block_table: &[stale][..], tokens: 1 }];
    assert_eq!(t.check_step_refs(&step).refused[0].1.kind(), ViolationKind::StalePage);
    assert_eq!(kind(t.record_write_tokens_refs(A, &[stale], 0..1)), ViolationKind::StalePage);
    assert_eq!(kind(t.record_import_refs(A, &[stale], 1, 1)), ViolationKind::StalePage);
    assert_eq!(kind(t.release_pages_refs(A, &[stale])), ViolationKind::StalePage);
    assert_eq!(kind(t.publish_prefix_refs(A, KEY, &[stale])), ViolationKind::StalePage);
    // Current refs go through, and each refused call above changed nothing.
    t.record_write_tokens_refs(A, &current, 0..32).unwrap();
    t.check_read_refs(A, &current, 32).unwrap();
    t.publish_prefix_refs(A, KEY, &current[1..]).unwrap();
    assert_eq!(t.page_info(current[1].page).unwrap().state, PageState::Shared);
    assert_eq!(t.release_pages_refs(A, &current[..1]).unwrap().ended, 1);
}

#[test]
fn a_prefix_slot_reused_by_a_new_prefix_is_not_the_old_one() {
    // A's fork prefix ends with its holders; C's new prefix takes the same slot. B, who held
    // the old one, must not read C's pages through it.
    let t = table();
    let a = written(&t, A, T1, 16);
    t.fork(A, B).unwrap();
    t.release(A).unwrap();
    t.release(B).unwrap();
    let c = written(&t, C, T1, 16);
    t.publish_prefix(C, KEY, &c).unwrap();
    t.admit(B, T1, 16, 0).unwrap();
    assert_eq!(t.check_read(B, &c, 16).unwrap_err().kind(), ViolationKind::ForeignPage);
    assert_eq!(t.check_read(B, &a, 16).unwrap_err().kind(), ViolationKind::ForeignPage);
    let info = t.page_info(c[0]).unwrap();
    assert_eq!((info.owner, info.prefix, info.tenant), (Some(C), Some(KEY), Some(T1)));
    assert_eq!(t.snapshot().prefixes, 1);
}

/// A mirror kept from the changed device tags alone, in a pool large enough for whole 64-page
/// words (the take builds those from one slice of tags) beside partial ones (a bit scan), after
/// several operations between two takes: every page's tag equals the one built from its info,
/// each listed page once, in page order.
#[test]
fn a_large_pools_changed_tags_match_each_pages_info() {
    use kvguard::cuda::layout::DeviceTag;
    const N: u32 = 300;
    let t = OwnershipTable::new(PoolConfig::new(N, PS, 64 * u64::from(PS)).with_reserved([PageId(0)])).unwrap();
    t.allow_cross_tenant_sharing(T1, true);
    let mut mirror = vec![DeviceTag::default(); N as usize];
    let mut upload = Vec::new();
    let mut sync = |mirror: &mut Vec<DeviceTag>, round: u32| {
        upload.clear();
        let n = t.take_changed_tags_into(&mut upload);
        assert_eq!(n, upload.len());
        assert!(upload.windows(2).all(|w| w[0].0 < w[1].0), "round {round}: listed twice or out of order");
        for &(p, tag) in &upload {
            mirror[p as usize] = tag;
        }
        for p in 0..N {
            let reference = DeviceTag::from_page_info(&t.page_info(PageId(p)).unwrap());
            assert_eq!(mirror[p as usize], reference, "round {round}: page {p}");
        }
    };
    sync(&mut mirror, 0);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    // Live requests, their pages, and how many of them they published (shared: not writable).
    let mut live: Vec<(RequestId, Vec<PageId>, usize)> = Vec::new();
    for round in 1..60u32 {
        // Requests admitted before the last take write on (their pages are not all marked).
        for (req, bt, published) in &live {
            if next(2) == 0 {
                let from = *published as u64 * u64::from(PS);
                t.record_write_tokens(*req, bt, from..bt.len() as u64 * u64::from(PS)).unwrap();
            }
        }
        for i in 0..3u64 {
            let req = RequestId(u64::from(round) * 10 + i);
            let tenant = if i == 2 { T2 } else { T1 };
            if t.admit(req, tenant, 64 * u64::from(PS), 0).is_err() {
                continue;
            }
            let Ok(refs) = t.allocate(req, 1 + next(64) as u32) else {
                t.release(req).unwrap();
                continue;
            };
            let bt = pages(&refs);
            let tokens = next(bt.len() as u64 * u64::from(PS) + 1);
            t.record_write_tokens(req, &bt, 0..tokens).unwrap();
            let mut published = 0;
            if next(4) == 0 && tokens >= 2 * u64::from(PS) {
                let key = PrefixKey(u64::from(round) * 10 + i);
                t.publish_prefix(req, key, &bt[..2]).unwrap();
                published = 2;
                if let Some((other, ..)) = live.last() {
                    let _ = t.attach_prefix(*other, key); // across tenants too, where granted
                }
            }
            live.push((req, bt, published));
        }
        while live.len() > 4 || (!live.is_empty() && next(3) == 0) {
            let (req, ..) = live.remove(next(live.len() as u64) as usize);
            t.release(req).unwrap();
        }
        if next(3) != 0 {
            sync(&mut mirror, round);
        }
    }
    sync(&mut mirror, 60);
}

// ---- the free list ----

/// Pages claimed by id (shadow mode) stay in the free list as stale entries: allocate hands out
/// exactly the pages still free, most recently freed first, never one claimed since.
#[test]
fn allocate_hands_out_exactly_the_free_pages_whatever_was_claimed_by_id() {
    let t = table();
    t.admit(A, T1, 64, 0).unwrap();
    t.admit(B, T1, 64, 0).unwrap();
    t.claim(A, &[PageId(2), PageId(5)]).unwrap();
    // A fresh pool hands out pages in id order: 1, 3, 4 (2 was claimed by id).
    assert_eq!(pages(&t.allocate(B, 3).unwrap()), [PageId(1), PageId(3), PageId(4)]);
    t.release(A).unwrap(); // 2 and 5 come back, on top
    let again = pages(&t.allocate(B, 1).unwrap());
    assert!(again == [PageId(5)] || again == [PageId(2)], "{again:?}");
    t.claim(B, &[PageId(if again == [PageId(5)] { 2 } else { 5 })]).unwrap();
    // 15 usable pages: 5 are B's; 10 are left, none of them B's.
    let c = RequestId(9);
    t.admit(c, T2, 128, 0).unwrap();
    let rest = pages(&t.allocate(c, 8).unwrap());
    assert!(rest.iter().all(|p| t.page_info(*p).unwrap().owner == Some(c)));
    assert_eq!(t.snapshot().free, 2);
}

mod free_list {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Clone, Debug)]
    enum Op {
        ClaimById(u8, u8),
        Allocate(u8, u8),
        Release(u8),
        Pin(u8),
        Unpin,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..4, 1u8..16).prop_map(|(r, p)| Op::ClaimById(r, p)),
            2 => (0u8..4, 0u8..4).prop_map(|(r, n)| Op::Allocate(r, n)),
            3 => (0u8..4).prop_map(Op::Release),
            1 => (0u8..4).prop_map(Op::Pin),
            1 => Just(Op::Unpin),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Any history of claims by id (each leaving a stale entry), allocations, releases and
        /// pins, long enough to fill the free list's room several times over: every page
        /// allocate hands out was free and not pinned, and at the end (pins let go) allocate
        /// hands out every free page once and no more.
        #[test]
        fn allocate_only_ever_hands_out_free_pages_once(ops in proptest::collection::vec(op(), 1..300)) {
            // 16 pages, page 0 reserved, a request may hold all 15 others.
            let t = OwnershipTable::new(PoolConfig::new(16, PS, 15 * u64::from(PS)).with_reserved([PageId(0)])).unwrap();
            let req = |r: u8| RequestId(u64::from(r) + 1);
            let mut tickets = Vec::new();
            for op in &ops {
                match *op {
                    Op::ClaimById(r, p) => {
                        let _ = t.admit(req(r), T1, 15 * u64::from(PS), 0);
                        let _ = t.claim(req(r), &[PageId(u32::from(p))]);
                    }
                    Op::Allocate(r, n) => {
                        let _ = t.admit(req(r), T1, 15 * u64::from(PS), 0);
                        let before: Vec<_> = (0..16).map(|p| t.page_info(PageId(p)).unwrap()).collect();
                        if let Ok(refs) = t.allocate(req(r), u32::from(n)) {
                            let got: BTreeSet<_> = refs.iter().map(|x| x.page).collect();
                            prop_assert_eq!(got.len(), refs.len(), "a page handed out twice");
                            for x in &refs {
                                let was = &before[x.page.0 as usize];
                                prop_assert_eq!(was.state, PageState::Free, "{:?} was not free", x.page);
                            }
                        }
                    }
                    Op::Release(r) => {
                        let _ = t.release(req(r));
                    }
                    Op::Pin(r) => {
                        let owned: Vec<PageRef> = (1..16)
                            .map(|p| (PageId(p), t.page_info(PageId(p)).unwrap()))
                            .filter(|(_, i)| i.owner == Some(req(r)) && i.state == PageState::Owned)
                            .map(|(page, i)| PageRef { page, generation: i.generation })
                            .collect();
                        if let Ok(ticket) = t.begin_import(req(r), &owned) {
                            tickets.push(ticket);
                        }
                    }
                    Op::Unpin => {
                        if let Some(ticket) = tickets.pop() {
                            ticket.abort();
                        }
                    }
                }
            }
            for ticket in tickets.drain(..) {
                ticket.abort();
            }
            let free: BTreeSet<PageId> =
                (0..16).map(PageId).filter(|p| t.page_info(*p).unwrap().state == PageState::Free).collect();
            prop_assert_eq!(t.snapshot().free as usize, free.len());
            let z = RequestId(99);
            t.admit(z, T2, 15 * u64::from(PS), 0).unwrap();
            let all: BTreeSet<PageId> = pages(&t.allocate(z, free.len() as u32).unwrap()).into_iter().collect();
            prop_assert_eq!(all, free);
            prop_assert!(t.allocate(z, 1).is_err());
        }
    }
}
