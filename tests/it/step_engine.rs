//! An engine's step in one call (`OwnershipTable::engine_step`): it judges exactly as the calls
//! it stands for, made one by one (each event through its own call, the writes through
//! `record_step_writes`, the reads through a full `verify_step`), for any step; and a step whose
//! shape is wrong applies nothing.

use kvguard::step::{Counts, EngineStep, Event, EventBatch, Events, EventsError, StepError, StepSlots};
use kvguard::{BlockRows, PageId, Policy, PrefixKey, RequestId, RowCache, TenantId};
use proptest::prelude::*;

use crate::model::step::{Drawn, Ev, PAGES, PS, WIDTH, same_as_one_by_one, table};

fn ev() -> impl Strategy<Value = Ev> {
    let page_list = || prop::collection::vec(0u32..PAGES + 1, 0..3);
    prop_oneof![
        3 => (any::<u8>(), 0u8..3, 0u8..24).prop_map(|(r, t, p)| Ev::Admit(r, t, p)),
        4 => (any::<u8>(), page_list()).prop_map(|(r, p)| Ev::Claim(r, p)),
        1 => any::<u8>().prop_map(Ev::Release),
        1 => any::<u8>().prop_map(Ev::Preempt),
        1 => (any::<u8>(), 0u8..3, page_list()).prop_map(|(r, k, p)| Ev::Publish(r, k, p)),
        1 => (any::<u8>(), 0u8..3).prop_map(|(r, k)| Ev::Attach(r, k)),
        1 => (any::<u8>(), 0u8..3).prop_map(|(r, k)| Ev::Detach(r, k)),
        1 => (0u8..3).prop_map(Ev::Evict),
        1 => (any::<u8>(), page_list()).prop_map(|(r, p)| Ev::ReleasePages(r, p)),
    ]
}

fn drawn() -> impl Strategy<Value = Drawn> {
    let entry = prop_oneof![8 => 1i32..PAGES as i32, 1 => Just(-1i32), 1 => Just(PAGES as i32 + 3)];
    let row = (prop::array::uniform6(entry), 0u8..12, 0u8..6);
    (prop::collection::vec(ev(), 0..6), prop::collection::vec(row, 4), prop::collection::vec(ev(), 0..3))
        .prop_map(|(early, rows, late)| Drawn { early, rows, late })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    /// Any sequence of steps (garbage rows, foreign pages, refused events included) is judged by
    /// `engine_step` exactly as by the calls it stands for, one by one, and leaves the same table.
    #[test]
    fn an_engine_step_judges_as_its_calls_one_by_one(steps in prop::collection::vec(drawn(), 1..12)) {
        same_as_one_by_one(&steps, Policy::Enforce);
        same_as_one_by_one(&steps, Policy::Report);
    }
}

/// A decode step of a request that wrote its prompt: clean, and the row is then judged from its
/// last page.
#[test]
fn a_clean_prefill_then_decode_is_clean_and_the_second_step_is_incremental() {
    let t = table(Policy::Enforce);
    let mut cache = RowCache::new();
    let a = RequestId(1);
    let mut early = EventBatch::new();
    early.admit(a, TenantId(1), 6, 4).claim(a, &[PageId(3), PageId(4)]);
    let entries = [3, 4, -1, -1, -1, -1];
    let step = EngineStep {
        early: early.events(),
        requests: &[a],
        rows: BlockRows::new(&entries, WIDTH).unwrap(),
        computed: (&[0]).into(),
        scheduled: (&[6]).into(),
        late: Events::none(),
    };
    assert!(t.engine_step(&mut cache, &step).unwrap().is_clean());
    let step = EngineStep { early: Events::none(), computed: (&[6]).into(), scheduled: (&[1]).into(), ..step };
    assert!(t.engine_step(&mut cache, &step).unwrap().is_clean());
    assert_eq!((cache.full(), cache.incremental()), (1, 1));
}

/// Every wrong shape is found before anything is applied: the early events' admission did not
/// happen.
#[test]
fn a_step_whose_shape_is_wrong_applies_nothing() {
    let t = table(Policy::Enforce);
    let mut cache = RowCache::new();
    let mut early = EventBatch::new();
    early.admit(RequestId(9), TenantId(1), 4, 4);
    let entries = [3i32; WIDTH * 2];
    let rows = BlockRows::new(&entries, WIDTH).unwrap();
    let base = EngineStep {
        early: early.events(),
        requests: &[RequestId(1), RequestId(2)],
        rows,
        computed: (&[0, 0]).into(),
        scheduled: (&[1, 1]).into(),
        late: Events::none(),
    };
    let three = [RequestId(1), RequestId(2), RequestId(3)];
    let too_many = [1, WIDTH as u64 * u64::from(PS) + 1];
    type Expected = fn(&StepError) -> bool;
    let cases: Vec<(EngineStep<'_>, Expected)> = vec![
        (EngineStep { computed: (&[0]).into(), ..base }, |e| matches!(e, StepError::Shape { computed: 1, .. })),
        (EngineStep { scheduled: (&[0, 0, 0]).into(), ..base }, |e| matches!(e, StepError::Shape { scheduled: 3, .. })),
        (EngineStep { requests: &three, computed: (&[0; 3]).into(), scheduled: (&[0; 3]).into(), ..base }, |e| {
            matches!(e, StepError::Shape { rows: 2, requests: 3, .. })
        }),
        (EngineStep { scheduled: (&too_many).into(), ..base }, |e| {
            matches!(e, StepError::TooManyTokens { index: 1, most: 24, .. })
        }),
        (EngineStep { computed: (&[u64::MAX, 0]).into(), ..base }, |e| {
            matches!(e, StepError::Overflow { index: 0, .. })
        }),
    ];
    for (step, expected) in cases {
        let e = t.engine_step(&mut cache, &step).expect_err("a wrong shape");
        assert!(expected(&e), "{e}");
        assert!(!e.to_string().is_empty());
        assert!(t.request_info(RequestId(9)).is_none(), "{e}: the early admission was applied");
    }
    // More slots than the pool has: 8 requests of one row each writing a full row.
    let wide = [1i32; 24 * 8];
    let reqs: Vec<RequestId> = (1..=8).map(RequestId).collect();
    let step = EngineStep {
        requests: &reqs,
        rows: BlockRows::new(&wide, 24).unwrap(),
        computed: (&[0; 8]).into(),
        scheduled: (&[20; 8]).into(),
        ..base
    };
    assert!(matches!(t.engine_step(&mut cache, &step), Err(StepError::PoolSlots { tokens: 160, slots: 96 })));
    assert!(t.request_info(RequestId(9)).is_none());
}

/// A step's slot mapping from its rows, as vLLM's kernel computes it: one token or several a
/// row, a position past the row's width on its last entry, a negative entry a slot no pool has;
/// counts not as long as each other, or more than the rows, are a shape error, never a panic.
#[test]
fn a_slot_mapping_is_built_from_the_rows_as_the_engines_kernel_builds_it() {
    let t = table(Policy::Enforce);
    let ps = i64::from(PS);
    let entries = [[5i32, 6, -1], [7, 8, 9]].concat();
    let rows = BlockRows::new(&entries, 3).unwrap();
    // Row 0: one token at position PS (its second page); row 1: three from 2 * PS - 1, the
    // last of them past the row's width (its last entry).
    let computed = [u64::from(PS), 2 * u64::from(PS) - 1];
    let slots = StepSlots::from_rows(rows, (&computed).into(), (&[1, 3]).into(), t.config()).unwrap();
    assert_eq!(slots.slots(), &[6 * ps, 8 * ps + ps - 1, 9 * ps, 9 * ps + 1]);
    // Row 0's third entry is negative: no pool's slot.
    let slots = StepSlots::from_rows(rows, (&[2 * u64::from(PS)]).into(), (&[1]).into(), t.config()).unwrap();
    assert_eq!(slots.slots(), &[i64::MIN]);
    for (computed, scheduled) in
        [(&[0u64, 0, 0][..], &[1u64, 1, 1][..]), (&[0, 0][..], &[1][..]), (&[0][..], &[1, 1][..])]
    {
        let (computed, scheduled) = (computed.into(), scheduled.into());
        let e = StepSlots::from_rows(rows, computed, scheduled, t.config()).expect_err("a wrong shape");
        assert!(matches!(e, StepError::Shape { rows: 2, .. }), "{e}");
        assert!(StepSlots::check(rows, computed, scheduled, t.config()).is_err());
    }
}

/// Event columns are checked whole: a wrong length, an unknown kind or pages outside the page
/// column is an error naming it, and no `Events` is made.
#[test]
fn event_columns_are_checked_before_use() {
    let pages = [PageId(3)];
    assert_eq!(
        Events::new(&[1, 3], &[1], &[0, 0], &[[0, 0]; 2], &pages).unwrap_err(),
        EventsError::Columns { kinds: 2, requests: 1, keys: 2, args: 2 }
    );
    assert_eq!(Events::new(&[0], &[1], &[0], &[[0, 0]], &pages).unwrap_err(), EventsError::Kind { index: 0, kind: 0 });
    assert_eq!(
        Events::new(&[10], &[1], &[0], &[[0, 0]], &pages).unwrap_err(),
        EventsError::Kind { index: 0, kind: 10 }
    );
    assert_eq!(
        Events::new(&[5], &[1], &[0], &[[1, 0]], &pages).unwrap_err(),
        EventsError::Pages { index: 0, start: 1, end: 0, len: 1 }
    );
    assert_eq!(
        Events::new(&[9], &[1], &[0], &[[0, 2]], &pages).unwrap_err(),
        EventsError::Pages { index: 0, start: 0, end: 2, len: 1 }
    );
    // Kinds without pages do not read args as a range.
    let e = Events::new(&[1, 3], &[1, 1], &[7, 0], &[[u64::MAX, 3], [9, 1]], &pages).unwrap();
    assert_eq!(
        e.get(0),
        Event::Admit { request: RequestId(1), tenant: TenantId(7), prompt_tokens: u64::MAX, max_new_tokens: 3 }
    );
    assert_eq!(e.get(1), Event::Release { request: RequestId(1) });
}

/// What `EventBatch` builds reads back event for event.
#[test]
fn a_batch_reads_back_what_was_pushed() {
    let (p, q) = ([PageId(1), PageId(2)], [PageId(5)]);
    let events = [
        Event::Admit { request: RequestId(1), tenant: TenantId(2), prompt_tokens: 3, max_new_tokens: 4 },
        Event::Claim { request: RequestId(1), pages: &p },
        Event::Publish { request: RequestId(1), key: PrefixKey(8), pages: &q },
        Event::Attach { request: RequestId(2), key: PrefixKey(8) },
        Event::Detach { request: RequestId(2), key: PrefixKey(8) },
        Event::ReleasePages { request: RequestId(1), pages: &q },
        Event::Evict { key: PrefixKey(8) },
        Event::Preempt { request: RequestId(1) },
        Event::Release { request: RequestId(1) },
        Event::Claim { request: RequestId(3), pages: &[] },
    ];
    let mut b = EventBatch::new();
    for e in events {
        b.push(e);
    }
    let got: Vec<Event<'_>> = (0..b.len()).map(|i| b.events().get(i)).collect();
    assert_eq!(got, events);
    b.clear();
    assert!(b.is_empty() && b.events().is_empty());
}

/// An engine's int32 counts (vLLM's `num_computed_tokens_cpu`) are read where they are: the
/// same counts judge a step as their `u64` copy does, and a negative one is refused when
/// wrapped, naming it, before any step is made of it.
#[test]
fn an_engines_int32_counts_judge_as_their_u64_copy() {
    let entries = [[3i32, 4, -1, -1, -1, -1], [5, 6, -1, -1, -1, -1]].concat();
    let rows = BlockRows::new(&entries, WIDTH).unwrap();
    let (a, b) = (RequestId(1), RequestId(2));
    let outcome = |computed: Counts<'_>, scheduled: Counts<'_>| {
        let t = table(Policy::Enforce);
        let mut early = EventBatch::new();
        early.admit(a, TenantId(1), 6, 4).claim(a, &[PageId(3), PageId(4)]);
        early.admit(b, TenantId(2), 6, 4).claim(b, &[PageId(5)]); // row 1's page 6 is not b's
        let step =
            EngineStep { early: early.events(), requests: &[a, b], rows, computed, scheduled, late: Events::none() };
        let o = t.engine_step(&mut RowCache::new(), &step).unwrap();
        let refused = |v: &kvguard::StepVerdict| v.refused.iter().map(|(i, _)| *i).collect::<Vec<_>>();
        (refused(o.writes.as_ref().unwrap()), refused(o.reads.as_ref().unwrap()))
    };
    let (computed, scheduled) = ([0i32, 3], [6i32, 6]);
    let in_place = outcome(Counts::from_i32(&computed).unwrap(), Counts::from_i32(&scheduled).unwrap());
    assert_eq!(in_place, outcome((&[0u64, 3]).into(), (&[6u64, 6]).into()));
    assert_eq!(in_place, (vec![1], vec![1]), "b writes and reads page 6, which it does not own");
    let e = Counts::from_i32(&[4, 0, -2, -7]).expect_err("a negative count");
    assert_eq!((e.index, e.value), (2, -2));
}
