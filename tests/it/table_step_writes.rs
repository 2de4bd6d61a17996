//! A step's KV writes recorded in one call from the engine's slot mapping
//! (`OwnershipTable::record_step_writes`): each sequence all or nothing, padding skipped, garbage
//! refused rather than truncated onto a real page.

use kvguard::{OwnershipTable, PADDING_SLOT, PageId, Policy, PoolConfig, RequestId, SeqWrite, TenantId, ViolationKind};

const PS: u32 = 16;

fn table(policy: Policy) -> OwnershipTable {
    OwnershipTable::new(PoolConfig::new(16, PS, 128).with_reserved([PageId(0)]).with_policy(policy))
        .expect("the test pool passes its audit")
}

/// Slots `tokens` of a sequence whose block table is `pages`, as a slot mapping gives them.
fn slots(pages: &[u32], tokens: std::ops::Range<u64>) -> Vec<i64> {
    tokens.map(|t| i64::from(pages[(t / u64::from(PS)) as usize] * PS) + (t % u64::from(PS)) as i64).collect()
}

#[test]
fn a_clean_step_records_every_sequence_and_skips_padding() {
    let t = table(Policy::Enforce);
    let (a, b) = (RequestId(1), RequestId(2));
    t.admit(a, TenantId(1), 20, 0).unwrap();
    t.admit(b, TenantId(2), 5, 0).unwrap();
    t.claim(a, &[PageId(3), PageId(4)]).unwrap();
    t.claim(b, &[PageId(9)]).unwrap();
    let mut sa = slots(&[3, 4], 0..20);
    sa.push(PADDING_SLOT);
    let sb = slots(&[9], 0..5);
    let v = t.record_step_writes(&[SeqWrite { request: a, slots: &sa }, SeqWrite { request: b, slots: &sb }]);
    assert!(v.is_clean(), "{v:?}");
    t.verify_read(a, &[PageId(3), PageId(4)], 20).unwrap();
    t.verify_read(b, &[PageId(9)], 5).unwrap();
    // Exactly what was written: one slot more is unwritten.
    assert_eq!(t.check_read(b, &[PageId(9)], 6).unwrap_err().kind(), ViolationKind::UnwrittenSlots);
}

#[test]
fn a_sequence_writing_a_foreign_page_is_refused_whole_and_the_others_are_recorded() {
    for policy in [Policy::Enforce, Policy::Report] {
        let t = table(policy);
        let (a, b) = (RequestId(1), RequestId(2));
        t.admit(a, TenantId(1), 32, 0).unwrap();
        t.admit(b, TenantId(2), 16, 0).unwrap();
        t.claim(a, &[PageId(3), PageId(4)]).unwrap();
        t.claim(b, &[PageId(9)]).unwrap();
        // a's slot mapping runs into b's page 9 after its own page 3.
        let sa: Vec<i64> = slots(&[3], 0..16).into_iter().chain(slots(&[9], 0..4)).collect();
        let sb = slots(&[9], 0..16);
        let v = t.record_step_writes(&[SeqWrite { request: a, slots: &sa }, SeqWrite { request: b, slots: &sb }]);
        assert_eq!(v.refused.len(), 1, "{policy:?}");
        let (index, violation) = &v.refused[0];
        assert_eq!((*index, violation.kind(), violation.request()), (0, ViolationKind::ForeignPage, Some(a)));
        assert_eq!(violation.page(), Some(PageId(9)));
        // Nothing of a's sequence was recorded, not even its own page 3.
        assert_eq!(t.page_info(PageId(3)).unwrap().written_slots, 0, "{policy:?}");
        t.verify_read(b, &[PageId(9)], 16).unwrap();
        assert_eq!(t.counters().get(ViolationKind::ForeignPage), 1, "judged under {policy:?}");
    }
}

#[test]
fn non_contiguous_slots_record_exactly_those_slots() {
    let t = table(Policy::Enforce);
    let a = RequestId(1);
    t.admit(a, TenantId(1), 16, 0).unwrap();
    t.claim(a, &[PageId(5)]).unwrap();
    let base = i64::from(5 * PS);
    let v = t.record_step_writes(&[SeqWrite { request: a, slots: &[base, base + 1, base + 3] }]);
    assert!(v.is_clean());
    t.verify_read(a, &[PageId(5)], 2).unwrap();
    let gap = t.check_read(a, &[PageId(5)], 4).unwrap_err();
    assert_eq!((gap.kind(), gap.slots()), (ViolationKind::UnwrittenSlots, Some((2, 3))));
}

#[test]
fn garbage_slots_are_refused_never_truncated_onto_a_real_page() {
    let t = table(Policy::Enforce);
    let a = RequestId(1);
    t.admit(a, TenantId(1), 16, 0).unwrap();
    t.claim(a, &[PageId(5)]).unwrap();
    // -7 is not padding; 2^32 * 16 + 80 would be page 5 again if the page number were truncated.
    for bad in [-7, (1i64 << 32) * i64::from(PS) + 80, i64::from(16 * PS)] {
        let v = t.record_step_writes(&[SeqWrite { request: a, slots: &[80, bad] }]);
        assert_eq!(v.refused.len(), 1, "slot {bad}");
        assert_eq!(v.refused[0].1.kind(), ViolationKind::PageOutOfRange, "slot {bad}");
        assert_eq!(t.page_info(PageId(5)).unwrap().written_slots, 0, "slot {bad}");
    }
}

#[test]
fn an_unknown_request_is_refused_and_the_step_goes_on() {
    let t = table(Policy::Enforce);
    t.admit(RequestId(1), TenantId(1), 16, 0).unwrap();
    t.claim(RequestId(1), &[PageId(5)]).unwrap();
    let v = t.record_step_writes(&[
        SeqWrite { request: RequestId(77), slots: &[80] },
        SeqWrite { request: RequestId(1), slots: &[80] },
    ]);
    assert_eq!(v.refused.len(), 1);
    assert_eq!((v.refused[0].0, v.refused[0].1.kind()), (0, ViolationKind::UnknownRequest));
    t.verify_read(RequestId(1), &[PageId(5)], 1).unwrap();
    // Writing nothing (no slot, or padding only) is still a write by a request the table must
    // know.
    let v = t.record_step_writes(&[
        SeqWrite { request: RequestId(78), slots: &[] },
        SeqWrite { request: RequestId(79), slots: &[PADDING_SLOT, PADDING_SLOT] },
        SeqWrite { request: RequestId(1), slots: &[PADDING_SLOT] },
    ]);
    let refused: Vec<_> = v.refused.iter().map(|(i, v)| (*i, v.kind())).collect();
    assert_eq!(refused, [(0, ViolationKind::UnknownRequest), (1, ViolationKind::UnknownRequest)]);
}

/// `claim_step` judges exactly as the same `claim` calls in a row: random steps of claims
/// (fresh pages, pages taken earlier in the step, reserved and out-of-range pages, unknown
/// requests), run both ways on two tables, give the same refused rows, kinds and page states;
/// every fourth step of 33 to 80 claims, whose refusals far into the step keep their places.
#[test]
fn claim_step_judges_as_claims_in_a_row() {
    use kvguard::SeqClaim;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for round in 0..200 {
        let policy = if round % 2 == 0 { Policy::Enforce } else { Policy::Report };
        let (one, batch) = (table(policy), table(policy));
        for r in 1..=4 {
            one.admit(RequestId(r), TenantId(r), 16, 0).unwrap();
            batch.admit(RequestId(r), TenantId(r), 16, 0).unwrap();
        }
        let len = if round % 4 == 3 { 33 + next(48) } else { next(6) };
        let claims: Vec<(RequestId, Vec<PageId>)> = (0..len)
            .map(|_| {
                let pages = (0..next(3)).map(|_| PageId(next(18) as u32)).collect();
                (RequestId(next(6)), pages)
            })
            .collect();
        let mut expected = Vec::new();
        for (i, (req, pages)) in claims.iter().enumerate() {
            if let Err(kvguard::Error::Violation(v)) = one.claim(*req, pages) {
                expected.push((i, v.kind()));
            }
        }
        let step: Vec<SeqClaim<'_>> = claims.iter().map(|(r, p)| SeqClaim { request: *r, pages: p }).collect();
        let got: Vec<_> = batch.claim_step(&step).refused.iter().map(|(i, v)| (*i, v.kind())).collect();
        assert_eq!(got, expected, "round {round}: {claims:?}");
        for p in 0..16 {
            let (a, b) = (one.page_info(PageId(p)).unwrap(), batch.page_info(PageId(p)).unwrap());
            assert_eq!((a.state, a.owner, a.generation), (b.state, b.owner, b.generation), "page {p}");
        }
        assert_eq!(one.counters().nonzero(), batch.counters().nonzero());
    }
}

#[test]
fn a_step_of_many_sequences_names_each_refused_one_by_its_index() {
    // More sequences than one warmed batch: the refused ones keep their places in the step.
    // (Report: a refused request is not quarantined, so its page reads as unwritten below.)
    let t = OwnershipTable::new(PoolConfig::new(128, PS, 128).with_reserved([PageId(0)]).with_policy(Policy::Report))
        .expect("the test pool passes its audit");
    let n = 100u32;
    for r in 0..n {
        t.admit(RequestId(u64::from(r)), TenantId(1), 1, 0).unwrap();
        t.claim(RequestId(u64::from(r)), &[PageId(r + 1)]).unwrap();
    }
    // Sequences 33 and 99 write the page of the one before them; the others their own.
    let slots: Vec<Vec<i64>> = (0..n).map(|r| slots(&[if r == 33 || r == 99 { r } else { r + 1 }], 0..1)).collect();
    let writes: Vec<SeqWrite<'_>> =
        (0..n).map(|r| SeqWrite { request: RequestId(u64::from(r)), slots: &slots[r as usize] }).collect();
    let v = t.record_step_writes(&writes);
    let refused: Vec<(usize, RequestId)> = v.refused.iter().map(|(i, v)| (*i, v.request().unwrap())).collect();
    assert_eq!(refused, [(33, RequestId(33)), (99, RequestId(99))]);
    t.verify_read(RequestId(34), &[PageId(35)], 1).unwrap();
    assert_eq!(t.check_read(RequestId(33), &[PageId(34)], 1).unwrap_err().kind(), ViolationKind::UnwrittenSlots);
}

#[test]
fn any_page_size_maps_slots_to_the_same_pages_and_offsets() {
    // Powers of two take a shift inside the table, others a division: both must say the same.
    for ps in [1u32, 3, 12, 16, 48, 64] {
        let t = OwnershipTable::new(PoolConfig::new(16, ps, 15 * u64::from(ps)).with_reserved([PageId(0)]))
            .expect("the test pool passes its audit");
        let a = RequestId(1);
        let tokens = 2 * u64::from(ps) + u64::from(ps).div_ceil(2); // two pages and part of a third
        t.admit(a, TenantId(1), tokens, 0).unwrap();
        let pages = [PageId(5), PageId(2), PageId(11), PageId(7)];
        t.claim(a, &pages).unwrap();
        let mapping: Vec<i64> = (0..tokens)
            .map(|tok| i64::from(pages[(tok / u64::from(ps)) as usize].0 * ps) + (tok % u64::from(ps)) as i64)
            .collect();
        // Written in two steps, the second from the middle of a page on (a decode step's shape).
        let half = (tokens / 2) as usize;
        for part in [&mapping[..half], &mapping[half..]] {
            assert!(t.record_step_writes(&[SeqWrite { request: a, slots: part }]).is_clean(), "ps {ps}");
        }
        t.verify_read(a, &pages, tokens).unwrap();
        let v = t.check_read(a, &pages, tokens + 1).unwrap_err();
        assert_eq!(v.kind(), ViolationKind::UnwrittenSlots, "ps {ps}");
        let next = pages[(tokens / u64::from(ps)) as usize];
        assert_eq!(v.page(), Some(next), "ps {ps}: the slot after the last written one");
        let written = pages.iter().map(|p| t.page_info(*p).unwrap().written_slots).collect::<Vec<_>>();
        let third = (tokens - 2 * u64::from(ps)) as u32;
        assert_eq!(&written[..3], &[ps, ps, third], "ps {ps}");
        // A slot one page past the pool is refused as such, never folded onto a real page.
        let beyond = [i64::from(16 * ps)];
        let v = t.record_step_writes(&[SeqWrite { request: a, slots: &beyond }]);
        assert_eq!(v.refused[0].1.kind(), ViolationKind::PageOutOfRange, "ps {ps}");
    }
}
