//! Reads and decode forwards through a token-slot table (SGLang's `req_to_token`:
//! `check_slot_rows`, `verify_slot_rows`, `decode_forward`): a row is never let through where a
//! reader of each of its entries, one token at a time, would be refused; a row whose entries are
//! in place is judged exactly as that reader; a window judges as the full row from its page on;
//! and a decode forward judges as its writes recorded and its windows checked by their own calls.

use kvguard::step::{DecodeForward, DecodeOutcome, SlotRead, StepError};
use kvguard::{BlockRows, OwnershipTable, PageId, Policy, PoolConfig, RequestId, RowsError, SeqWrite, TenantId};
use proptest::prelude::*;

/// Pages, token entries per row; the page size is drawn (1: each entry its own page, read in
/// place; 3 and 4: pages gathered from their first entries, at 3 a row's last page held in part).
const PAGES: u32 = 16;
const WIDTH: usize = 16;
const PS: u32 = 4;

fn table(policy: Policy, ps: u32) -> OwnershipTable {
    OwnershipTable::new(PoolConfig::new(PAGES, ps, 8).with_reserved([PageId(0)]).with_policy(policy))
        .expect("the test pool passes its audit")
}

fn page_size() -> impl Strategy<Value = u32> {
    // 3: a row of `WIDTH` entries ends inside its last page.
    prop_oneof![Just(1u32), Just(3u32), Just(PS)]
}

/// A history drawn: three requests (two tenants), each claiming pages and writing some of their
/// slots; then each one's row of slots, its entries changed here and there.
#[derive(Clone, Debug)]
struct Drawn {
    /// Per request: pages claimed (ids may repeat or be taken: refused, as an engine's may be).
    claims: Vec<Vec<u32>>,
    /// Per request: tokens written through its pages, in order.
    written: Vec<u8>,
    /// Per request: (entry, new value) changes to its row.
    changes: Vec<Vec<(u8, i32)>>,
    /// Per request: tokens read, and tokens already checked (`from`).
    reads: Vec<(u8, u8)>,
}

fn drawn() -> impl Strategy<Value = Drawn> {
    let value = prop_oneof![
        4 => 0i32..(PAGES * PS) as i32,
        1 => Just(-1i32),
        1 => Just((PAGES * PS) as i32 + 5),
        1 => Just(i32::MAX),
    ];
    (
        prop::collection::vec(prop::collection::vec(1u32..PAGES, 0..5), 3),
        prop::collection::vec(0u8..20, 3),
        prop::collection::vec(prop::collection::vec((0u8..WIDTH as u8, value), 0..3), 3),
        prop::collection::vec((0u8..40, 0u8..40), 3),
    )
        .prop_map(|(claims, written, changes, reads)| Drawn { claims, written, changes, reads })
}

/// The table after `d`'s history, and the three rows of slots (`WIDTH` entries each).
fn build(d: &Drawn, policy: Policy, change: bool, ps: u32) -> (OwnershipTable, Vec<i32>) {
    let t = table(policy, ps);
    let mut rows = vec![-1i32; 3 * WIDTH];
    for r in 0..3 {
        let req = RequestId(r as u64 + 1);
        t.admit(req, TenantId(r as u64 % 2), 4, 4).expect("admitted");
        let mut pages = Vec::new();
        for &p in &d.claims[r] {
            if t.claim(req, &[PageId(p)]).is_ok() {
                pages.push(p);
            }
        }
        let slots: Vec<i64> = pages.iter().flat_map(|&p| (0..ps).map(move |k| i64::from(p * ps + k))).collect();
        let n = (d.written[r] as usize).min(slots.len());
        let _ = t.record_step_writes(&[SeqWrite { request: req, slots: &slots[..n] }]);
        for (e, &s) in rows[r * WIDTH..(r + 1) * WIDTH].iter_mut().zip(&slots) {
            *e = s as i32;
        }
        if change {
            for &(at, v) in &d.changes[r] {
                rows[r * WIDTH + at as usize] = v;
            }
        }
    }
    (t, rows)
}

fn reads(d: &Drawn, from: bool) -> Vec<SlotRead> {
    (0..3)
        .map(|r| SlotRead {
            request: RequestId(r as u64 + 1),
            row: r as u32,
            from: if from { u64::from(d.reads[r].1.min(d.reads[r].0)) } else { 0 },
            tokens: u64::from(d.reads[r].0),
        })
        .collect()
}

/// Whether a reader of each token, one at a time, may read row `row` for `tokens` tokens: each
/// entry names a slot whose page the reader may read up to that slot (and the reader may read at
/// all: live, not quarantined).
fn per_token(t: &OwnershipTable, req: RequestId, row: &[i32], tokens: u64, ps: u32) -> bool {
    t.check_read(req, &[], 0).is_ok()
        && (0..tokens as usize).all(|k| {
            let Some(&slot) = row.get(k) else { return false };
            let Ok(slot) = u32::try_from(slot) else { return false };
            t.check_read(req, &[PageId(slot / ps)], u64::from(slot % ps) + 1).is_ok()
        })
}

fn refused_rows(v: &kvguard::StepVerdict) -> Vec<usize> {
    v.refused.iter().map(|(i, _)| *i).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

    /// A row is never let through where the per-token reader is refused; rows left in place are
    /// judged exactly as that reader.
    #[test]
    fn a_row_is_judged_at_least_as_strictly_as_reading_each_token(d in drawn(), change in any::<bool>(), ps in page_size()) {
        let (t, entries) = build(&d, Policy::Enforce, change, ps);
        let rows = BlockRows::new(&entries, WIDTH).unwrap();
        let reads = reads(&d, false);
        let refused = refused_rows(&t.check_slot_rows(rows, &reads).unwrap());
        for (i, r) in reads.iter().enumerate() {
            let row = &entries[i * WIDTH..(i + 1) * WIDTH];
            let reference = per_token(&t, r.request, row, r.tokens, ps);
            if !refused.contains(&i) {
                prop_assert!(reference, "row {i} let through, a per-token reader is refused: {row:?}");
            } else if !change {
                prop_assert!(!reference, "row {i} in place refused, a per-token reader is not: {row:?}");
            }
        }
    }

    /// A window (`from` > 0) judges as the full row read from the window's first page on: where
    /// the full row is clean, so is every window of it; a window refused is refused in full.
    #[test]
    fn a_window_is_never_looser_than_the_full_row(d in drawn(), change in any::<bool>(), ps in page_size()) {
        let (t, entries) = build(&d, Policy::Enforce, change, ps);
        let rows = BlockRows::new(&entries, WIDTH).unwrap();
        let full = refused_rows(&t.check_slot_rows(rows, &reads(&d, false)).unwrap());
        let window = refused_rows(&t.check_slot_rows(rows, &reads(&d, true)).unwrap());
        for i in &window {
            prop_assert!(full.contains(i), "row {i}'s window refused, its full row clean");
        }
        // A window from token 0 is the full row.
        prop_assert_eq!(refused_rows(&t.check_slot_rows(rows, &reads(&d, false)).unwrap()), full);
    }

    /// A decode forward judges as its writes recorded by `record_step_writes` and, if all were,
    /// its windows checked by `check_slot_rows`, and leaves the table as those calls do.
    #[test]
    fn a_decode_forward_judges_as_its_calls_one_by_one(
        d in drawn(),
        drawn_slots in prop::collection::vec(prop_oneof![3 => Just(None), 1 => (-2i64..(PAGES * PS) as i64 + 2).prop_map(Some)], 3),
        enforce in any::<bool>(),
        ps in page_size(),
    ) {
        decode_forward_as_its_calls(&d, &reads(&d, true), &drawn_slots, enforce, ps)?;
    }

    /// The same for decode-shaped reads, each row read up to one token past its checked length
    /// (mostly a window of one page, the step the forward checks without gathering its reads;
    /// sometimes past the row's end).
    #[test]
    fn a_decode_forward_of_one_page_windows_judges_as_its_calls_one_by_one(
        d in drawn(),
        drawn_slots in prop::collection::vec(prop_oneof![3 => Just(None), 1 => (-2i64..(PAGES * PS) as i64 + 2).prop_map(Some)], 3),
        enforce in any::<bool>(),
        ps in page_size(),
    ) {
        let reads: Vec<SlotRead> = reads(&d, false)
            .into_iter()
            .map(|r| {
                let tokens = r.tokens % (WIDTH as u64 + 3) + 1;
                SlotRead { tokens, from: tokens - 1, ..r }
            })
            .collect();
        decode_forward_as_its_calls(&d, &reads, &drawn_slots, enforce, ps)?;
    }
}

/// `reads` as one decode forward on a table built from `d`, and as its writes recorded by
/// `record_step_writes` and (if all were) its windows checked by `check_slot_rows` on a twin:
/// the same verdicts, counters, pages and requests. Each read writes `drawn_slots`' slot, or
/// where that is None the slot of its row's token `from` (what the engine writes). The same
/// forward with its reads made by index (`decode_forward_by`, on a third twin) gives the same
/// outcome and leaves the same table.
fn decode_forward_as_its_calls(
    d: &Drawn,
    reads: &[SlotRead],
    drawn_slots: &[Option<i64>],
    enforce: bool,
    ps: u32,
) -> Result<(), TestCaseError> {
    let policy = if enforce { Policy::Enforce } else { Policy::Report };
    let (one, entries) = build(d, policy, true, ps);
    let (two, _) = build(d, policy, true, ps);
    let rows = BlockRows::new(&entries, WIDTH).unwrap();
    let slots: Vec<i64> = reads
        .iter()
        .zip(drawn_slots)
        .map(|(r, s)| {
            s.unwrap_or_else(|| entries.get(r.row as usize * WIDTH + r.from as usize).map_or(-1, |&e| i64::from(e)))
        })
        .collect();
    let outcome = one.decode_forward(&DecodeForward { reads, slots: &slots, rows }).unwrap();
    let (three, _) = build(d, policy, true, ps);
    let by_index = three.decode_forward_by(reads.len(), |i| reads[i], &slots, rows).unwrap();
    prop_assert_eq!(format!("{by_index:?}"), format!("{outcome:?}"));
    let writes: Vec<SeqWrite<'_>> =
        reads.iter().zip(slots.chunks(1)).map(|(r, s)| SeqWrite { request: r.request, slots: s }).collect();
    let written = two.record_step_writes(&writes);
    match outcome {
        DecodeOutcome::Writes(v) => {
            prop_assert!(!written.is_clean());
            prop_assert_eq!(format!("{:?}", v.refused), format!("{:?}", written.refused));
        }
        other => {
            prop_assert!(written.is_clean());
            let read = two.check_slot_rows(rows, reads).unwrap();
            match other {
                DecodeOutcome::Clean => prop_assert!(read.is_clean(), "clean, its calls refuse {:?}", read.refused),
                DecodeOutcome::Window(v) => {
                    prop_assert_eq!(format!("{:?}", v.refused), format!("{:?}", read.refused))
                }
                DecodeOutcome::Writes(_) => unreachable!(),
            }
        }
    }
    prop_assert_eq!(one.counters().total(), two.counters().total());
    prop_assert_eq!(one.counters().total(), three.counters().total());
    for p in 0..PAGES {
        prop_assert_eq!(one.page_info(PageId(p)), two.page_info(PageId(p)));
        prop_assert_eq!(one.page_info(PageId(p)), three.page_info(PageId(p)));
    }
    for r in 1..=3 {
        prop_assert_eq!(one.request_info(RequestId(r)), two.request_info(RequestId(r)));
        prop_assert_eq!(one.request_info(RequestId(r)), three.request_info(RequestId(r)));
    }
    Ok(())
}

/// A decode forward with its reads made by index refuses what the one given a slice refuses,
/// with the same errors and nothing recorded: slots not one per read, a row past the table.
#[test]
fn a_decode_forward_by_index_refuses_as_the_one_given_a_slice() {
    let t = table(Policy::Enforce, 4);
    let a = RequestId(1);
    t.admit(a, TenantId(1), 4, 4).unwrap();
    t.claim(a, &[PageId(1), PageId(2)]).unwrap();
    let entries: Vec<i32> = (4..12).collect();
    let rows = BlockRows::new(&entries, 8).unwrap();
    let one_page = SlotRead { request: a, row: 0, from: 0, tokens: 1 };
    let two_pages = SlotRead { tokens: 5, ..one_page };
    let past = SlotRead { row: 1, ..one_page };
    // Slots not one per read; a row past the table after a one-page window, and after a window
    // of two pages (which the general path gathers).
    let cases: [(&[SlotRead], &[i64]); 3] =
        [(&[one_page], &[4, 5]), (&[one_page, past], &[4, 5]), (&[two_pages, past], &[4, 5])];
    for (reads, slots) in cases {
        let sliced = t.decode_forward(&DecodeForward { reads, slots, rows }).unwrap_err();
        let by_index = t.decode_forward_by(reads.len(), |i| reads[i], slots, rows).unwrap_err();
        assert_eq!(by_index.to_string(), sliced.to_string());
    }
    for p in [1, 2] {
        assert_eq!(t.page_info(PageId(p)).unwrap().written_slots, 0, "nothing recorded");
    }
}

/// A row whose width is not a whole number of pages ends inside its last page: a read of more
/// tokens than the row has entries is refused as too short, though the slots of that page past
/// the row's end are written and the reader's own.
#[test]
fn a_read_past_a_rows_end_inside_its_last_page_is_refused() {
    let t = table(Policy::Enforce, 3);
    let a = RequestId(1);
    t.admit(a, TenantId(1), 4, 4).unwrap();
    let pages: Vec<PageId> = (1..=6).map(PageId).collect();
    t.claim(a, &pages).unwrap();
    let slots: Vec<i64> = (3..21).collect(); // pages 1 to 6, every slot written
    assert!(t.record_step_writes(&[SeqWrite { request: a, slots: &slots }]).is_clean());
    // A row of 16 entries: five whole pages and one entry of the sixth.
    let entries: Vec<i32> = (3..19).collect();
    let rows = BlockRows::new(&entries, 16).unwrap();
    let read = |from, tokens| SlotRead { request: a, row: 0, from, tokens };
    for from in [0, 15, 16] {
        assert!(t.check_slot_rows(rows, &[read(from, 16)]).unwrap().is_clean(), "from {from}");
        let refused = t.check_slot_rows(rows, &[read(from, 17)]).unwrap();
        assert_eq!(refused.refused.len(), 1, "from {from}");
        assert_eq!(refused.refused[0].1.kind(), kvguard::ViolationKind::BlockTableTooShort, "from {from}");
    }
    let step = DecodeForward { reads: &[read(16, 17)], slots: &[19], rows };
    assert!(matches!(t.decode_forward(&step).unwrap(), DecodeOutcome::Window(_)));
}

/// A read past the table, or slots not one per read, is an error before anything is recorded.
#[test]
fn a_decode_forward_of_the_wrong_shape_records_nothing() {
    let t = table(Policy::Enforce, PS);
    let a = RequestId(1);
    t.admit(a, TenantId(1), 4, 4).unwrap();
    t.claim(a, &[PageId(3)]).unwrap();
    let entries = [12, 13, 14, 15];
    let rows = BlockRows::new(&entries, 4).unwrap();
    let read = SlotRead { request: a, row: 0, from: 0, tokens: 1 };
    let past = SlotRead { row: 1, ..read };
    let err = t.decode_forward(&DecodeForward { reads: &[read, past], slots: &[12, 13], rows }).unwrap_err();
    assert_eq!(err, StepError::Rows(RowsError::Row { index: 1, row: 1, rows: 1 }));
    let err = t.decode_forward(&DecodeForward { reads: &[read], slots: &[12, 13], rows }).unwrap_err();
    assert_eq!(err, StepError::Slots { reads: 1, slots: 2 });
    // Nothing was written: the page's first slot is still unwritten.
    assert!(t.check_read(a, &[PageId(3)], 1).is_err());
    assert!(matches!(
        t.decode_forward(&DecodeForward { reads: &[read], slots: &[12], rows }).unwrap(),
        DecodeOutcome::Clean
    ));
}

/// An entry inside a page that names another request's slot is read as that slot: refused,
/// though the page the row's first entry names is the reader's own.
#[test]
fn an_entry_inside_a_page_naming_another_requests_slot_is_refused() {
    let t = table(Policy::Enforce, PS);
    let (a, b) = (RequestId(1), RequestId(2));
    t.admit(a, TenantId(1), 4, 4).unwrap();
    t.admit(b, TenantId(2), 4, 4).unwrap();
    t.claim(a, &[PageId(3)]).unwrap();
    t.claim(b, &[PageId(5)]).unwrap();
    let (sa, sb): (Vec<i64>, Vec<i64>) = ((12..16).collect(), (20..24).collect());
    let writes = [SeqWrite { request: a, slots: &sa }, SeqWrite { request: b, slots: &sb }];
    assert!(t.record_step_writes(&writes).is_clean());
    let entries = [12, 13, 22, 15];
    let rows = BlockRows::new(&entries, 4).unwrap();
    let v = t.check_slot_rows(rows, &[SlotRead { request: a, row: 0, from: 0, tokens: 4 }]).unwrap();
    assert_eq!(v.refused.len(), 1);
    assert_eq!(v.refused[0].1.page(), Some(PageId(5)));
    // Read only up to the entry before it: clean.
    let v = t.check_slot_rows(rows, &[SlotRead { request: a, row: 0, from: 0, tokens: 2 }]).unwrap();
    assert!(v.is_clean());
}

/// The same at every entry of pages of 8, 12, 16 and 20 slots (checked eight entries at a time,
/// then the rest): whichever entry of the reader's page names another request's slot, the read
/// through it is refused on that page, and a read stopping before it is clean.
#[test]
fn an_entry_naming_another_requests_slot_is_found_at_every_offset_of_a_large_page() {
    for ps in [8u32, 12, 16, 20] {
        for k in 0..ps as usize {
            let t = OwnershipTable::new(PoolConfig::new(8, ps, 32).with_reserved([PageId(0)])).unwrap();
            let (a, b) = (RequestId(1), RequestId(2));
            t.admit(a, TenantId(1), 24, 4).unwrap();
            t.admit(b, TenantId(2), 24, 4).unwrap();
            t.claim(a, &[PageId(3)]).unwrap();
            t.claim(b, &[PageId(5)]).unwrap();
            let slots = |p: u32| (p * ps..(p + 1) * ps).map(i64::from).collect::<Vec<_>>();
            let (sa, sb) = (slots(3), slots(5));
            assert!(
                t.record_step_writes(&[SeqWrite { request: a, slots: &sa }, SeqWrite { request: b, slots: &sb }])
                    .is_clean()
            );
            let mut entries: Vec<i32> = sa.iter().map(|&s| s as i32).collect();
            entries[k] = sb[k] as i32;
            let rows = BlockRows::new(&entries, ps as usize).unwrap();
            let all = SlotRead { request: a, row: 0, from: 0, tokens: u64::from(ps) };
            let v = t.check_slot_rows(rows, &[all]).unwrap();
            assert_eq!(v.refused.len(), 1, "page size {ps}, entry {k}");
            assert_eq!(v.refused[0].1.page(), Some(PageId(5)), "page size {ps}, entry {k}");
            let before = SlotRead { tokens: k as u64, ..all };
            assert!(t.check_slot_rows(rows, &[before]).unwrap().is_clean(), "page size {ps}, entry {k}");
        }
    }
}

/// A row checked clean through a `SlotRowCache`, unchanged since, whose request lost a page it
/// names (a partial release) or was quarantined: judged in full next time, so refused as the full
/// check refuses it, never let through from its last page. At page size 1 and 4.
#[test]
fn a_cached_row_whose_reader_lost_a_right_is_judged_in_full() {
    use kvguard::RowRead;
    use kvguard::step::SlotRowCache;
    for ps in [1u32, PS] {
        for lose in ["release_pages", "quarantine"] {
            let t = table(Policy::Enforce, ps);
            let a = RequestId(1);
            t.admit(a, TenantId(1), 8, 0).expect("admit");
            let per = (8 / ps) as usize;
            let pages: Vec<PageId> = (0..per).map(|k| PageId(1 + k as u32)).collect();
            t.claim(a, &pages).expect("claim");
            t.record_write_tokens(a, &pages, 0..8).expect("write");
            let mut row = vec![-1i32; WIDTH];
            for (k, e) in row.iter_mut().take(8).enumerate() {
                *e = (ps as usize + k) as i32; // page 1 on
            }
            let mut cache = SlotRowCache::new();
            let rows = BlockRows::new(&row, WIDTH).expect("one row");
            let read = |tokens| [RowRead { request: a, row: 0, tokens }];
            assert!(t.check_slot_rows_cached(&mut cache, rows, &read(6)).expect("row 0").is_clean());
            assert!(t.check_slot_rows_cached(&mut cache, rows, &read(7)).expect("row 0").is_clean());
            assert_eq!(
                (cache.full(), cache.incremental()),
                (1, 1),
                "page size {ps}: the second read from its last page"
            );
            match lose {
                "release_pages" => {
                    t.release_pages(a, &pages[..1]).expect("the first page let go");
                }
                _ => {
                    let v =
                        t.verify_step(&[kvguard::SeqRead { request: a, block_table: &[PageId(PAGES + 3)], tokens: 1 }]);
                    assert!(!v.is_clean(), "a read past the pool quarantines under enforce");
                }
            }
            let cached = t.check_slot_rows_cached(&mut cache, rows, &read(8)).expect("row 0");
            let full = t.check_slot_rows(rows, &[SlotRead { request: a, row: 0, from: 0, tokens: 8 }]).expect("row 0");
            assert!(!full.is_clean(), "page size {ps}, {lose}: the full check refuses the row");
            let said = |v: &kvguard::StepVerdict| -> Vec<_> {
                v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page())).collect()
            };
            assert_eq!(said(&cached), said(&full), "page size {ps}, {lose}");
            assert_eq!(cache.full(), 2, "page size {ps}, {lose}: judged in full");
        }
    }
}
