//! Replay follows the engine: every row of "What replay assumes after a violation" in
//! docs/trace-format.md, the forensic summary, trace v1.1, and the bounds on hostile input.

use kvguard::ViolationKind::{self, *};
use kvguard::trace::{ReplayErrorKind, ReplayOptions, Replayer};

const POOL: &str = r#"{"ev":"pool","pages":64,"page_size":16,"max_context":256,"reserved":[0]}"#;

fn replay_with(options: ReplayOptions, lines: &[&str]) -> (Vec<(u64, ViolationKind)>, Replayer) {
    let text = std::iter::once(POOL).chain(lines.iter().copied()).collect::<Vec<_>>().join("\n");
    let mut found = Vec::new();
    let mut r = Replayer::with_options(options);
    r.replay(text.as_bytes(), |v| {
        found.push((v.line(), v.kind()));
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    (found, r)
}

fn kinds(lines: &[&str]) -> Vec<(u64, ViolationKind)> {
    replay_with(ReplayOptions::default(), lines).0
}

const A1: &str = r#"{"ev":"admit","req":1,"tenant":"acme","prompt":32,"max_new":0}"#;
const A2: &str = r#"{"ev":"admit","req":2,"tenant":"evil","prompt":32,"max_new":0}"#;

#[test]
fn a_refused_admit_still_admits() {
    let big = r#"{"ev":"admit","req":1,"tenant":"acme","prompt":300,"max_new":0}"#;
    let got = kinds(&[big, r#"{"ev":"alloc","req":1,"pages":[1]}"#, r#"{"ev":"free","req":1}"#]);
    assert_eq!(got, [(2, ExceedsMaxContext)]);
    // A duplicate admit keeps the live request as it was.
    let got = kinds(&[A1, A1, r#"{"ev":"alloc","req":1,"pages":[1]}"#]);
    assert_eq!(got, [(3, DuplicateRequest)]);
}

#[test]
fn a_refused_alloc_still_hands_the_page_over() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
        A2,
        r#"{"ev":"alloc","req":2,"pages":[5,0,99]}"#,      // 6
        r#"{"ev":"read","req":2,"pages":[5],"tokens":1}"#, // 7 nobody wrote it for req 2
        r#"{"ev":"write","req":2,"page":5,"slots":[0,16]}"#,
        r#"{"ev":"read","req":2,"pages":[5],"tokens":16}"#,
        r#"{"ev":"read","req":1,"pages":[5],"tokens":16}"#, // 10 the former owner
    ]);
    assert_eq!(got, [(6, PageNotFree), (7, UnwrittenSlots), (10, ForeignPage)]);
}

#[test]
fn a_refused_write_still_writes() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5,6]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
        r#"{"ev":"write","req":1,"page":6,"slots":[4,17]}"#, // 5 past the end: 4..16 written
        r#"{"ev":"read","req":1,"pages":[6],"tokens":4}"#,   // 6 slots 0..4 never written
        A2,
        r#"{"ev":"write","req":2,"page":5,"slots":[2,3]}"#, // 8 foreign write
        r#"{"ev":"read","req":1,"pages":[5],"tokens":2}"#,  // clean: slots 0..2 are acme's
        r#"{"ev":"read","req":1,"pages":[5],"tokens":3}"#,  // 10 reaches evil's bytes
        r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
        r#"{"ev":"read","req":1,"pages":[5],"tokens":16}"#, // clean again
        r#"{"ev":"share","req":1,"key":"k","pages":[5]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,1]}"#, // 14 write_to_shared
        r#"{"ev":"admit","req":3,"tenant":"acme","prompt":16,"max_new":0}"#,
        r#"{"ev":"attach","req":3,"key":"k"}"#,
        r#"{"ev":"read","req":3,"pages":[5],"tokens":16}"#, // 17 req 1 wrote slot 0 after sharing
        r#"{"ev":"write","req":2,"page":5,"slots":[0,1]}"#, // 18
        r#"{"ev":"read","req":3,"pages":[5],"tokens":16}"#, // 19 evil's bytes in the prefix
        r#"{"ev":"write","req":9,"page":6,"slots":[4,5]}"#, // 20 unknown request
        r#"{"ev":"read","req":1,"pages":[6],"tokens":5}"#,  // 21 slots 0..4 were never written
        r#"{"ev":"write","req":1,"page":6,"slots":[0,4]}"#,
        r#"{"ev":"read","req":1,"pages":[6],"tokens":5}"#, // 23 slot 4 holds req 9's bytes
    ]);
    assert_eq!(
        got,
        [
            (5, SlotOutOfRange),
            (6, UnwrittenSlots),
            (8, ForeignPage),
            (10, ForeignPage),
            (14, WriteToShared),
            (17, ForeignPage),
            (18, WriteToShared),
            (19, ForeignPage),
            (20, UnknownRequest),
            (21, UnwrittenSlots),
            (23, ForeignPage),
        ]
    );
}

#[test]
fn a_refused_free_still_frees_owned_pages_only() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5]}"#,
        A2,
        r#"{"ev":"alloc","req":2,"pages":[6]}"#,
        r#"{"ev":"write","req":2,"page":6,"slots":[0,16]}"#,
        r#"{"ev":"free","req":1,"pages":[5,6]}"#,           // 7 foreign_page
        r#"{"ev":"read","req":2,"pages":[6],"tokens":16}"#, // 8 freed under it
        r#"{"ev":"alloc","req":1,"pages":[5,6]}"#,          // clean: both went back
        r#"{"ev":"fork","req":1,"child":3}"#,
        r#"{"ev":"free","req":3,"pages":[5]}"#,             // 11 page_shared
        r#"{"ev":"write","req":1,"page":5,"slots":[0,1]}"#, // 12 still shared
        r#"{"ev":"free","req":1}"#,
        r#"{"ev":"free","req":1}"#, // 14 double_free: nothing
    ]);
    assert_eq!(got, [(7, ForeignPage), (8, FreedPage), (11, PageShared), (12, WriteToShared), (14, DoubleFree)]);
}

#[test]
fn a_refused_share_still_publishes() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
        A2,
        r#"{"ev":"alloc","req":2,"pages":[6]}"#,
        r#"{"ev":"write","req":2,"page":6,"slots":[0,16]}"#,
        r#"{"ev":"share","req":1,"key":"k","pages":[5,6]}"#,  // 8
        r#"{"ev":"read","req":2,"pages":[6],"tokens":16}"#,   // 9 no longer evil's
        r#"{"ev":"read","req":1,"pages":[5,6],"tokens":32}"#, // 10 page 6 unwritten for the prefix
        r#"{"ev":"share","req":1,"key":"k","pages":[]}"#,     // 11 duplicate: the key keeps its pages
        r#"{"ev":"read","req":1,"pages":[5],"tokens":16}"#,
    ]);
    assert_eq!(got, [(8, ForeignPage), (9, ForeignPage), (10, UnwrittenSlots), (11, DuplicatePrefix)]);
}

#[test]
fn a_refused_attach_gives_no_hold() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
        r#"{"ev":"share","req":1,"key":"k","pages":[5]}"#,
        A2,
        r#"{"ev":"attach","req":2,"key":"k"}"#,             // 7
        r#"{"ev":"read","req":2,"pages":[5],"tokens":16}"#, // 8
        r#"{"ev":"free","req":1}"#,
        r#"{"ev":"evict","key":"k"}"#, // clean: no hold was taken
    ]);
    assert_eq!(got, [(7, CrossTenantShare), (8, ForeignPage)]);
}

#[test]
fn a_refused_evict_still_evicts_and_leaks_are_named() {
    let (got, r) = replay_with(
        ReplayOptions::default(),
        &[
            r#"{"ev":"admit","req":1,"tenant":"acme","prompt":16,"max_new":0}"#,
            r#"{"ev":"alloc","req":1,"pages":[5]}"#,
            r#"{"ev":"write","req":1,"page":5,"slots":[0,16]}"#,
            r#"{"ev":"share","req":1,"key":"k","pages":[5]}"#,
            r#"{"ev":"admit","req":2,"tenant":"acme","prompt":16,"max_new":0}"#,
            r#"{"ev":"attach","req":2,"key":"k"}"#,
            r#"{"ev":"free","req":1}"#,
            r#"{"ev":"evict","key":"k"}"#,
            r#"{"ev":"admit","req":3,"tenant":"evil","prompt":16,"max_new":0}"#,
            r#"{"ev":"alloc","req":3,"pages":[5]}"#,
            r#"{"ev":"write","req":3,"page":5,"slots":[0,16]}"#,
            r#"{"ev":"read","req":2,"pages":[5],"tokens":16}"#,
            r#"{"ev":"read","req":3,"pages":[5],"tokens":16}"#,
            r#"{"ev":"share","req":3,"key":"k","pages":[]}"#, // the key is free again
        ],
    );
    // The example of issue 10: acme's request 2 reads evil's KV at line 13; evil reads its own.
    assert_eq!(got, [(9, EvictInUse), (13, ForeignPage)]);
    let leaks = r.leaks();
    assert_eq!(leaks.leaks.len(), 1);
    let l = &leaks.leaks[0];
    assert_eq!((l.reader, l.writer, l.slots, l.reads, l.first_line), (2, 3, 16, 1, 13));
    assert_eq!((l.reader_tenant.as_deref(), l.writer_tenant.as_deref()), (Some("acme"), Some("evil")));
    assert!(l.cross_tenant());
}

#[test]
fn stale_bytes_are_charged_to_their_writer() {
    let (got, r) = replay_with(
        ReplayOptions::default(),
        &[
            A2,
            r#"{"ev":"alloc","req":2,"pages":[9]}"#,
            r#"{"ev":"write","req":2,"page":9,"slots":[0,16]}"#,
            r#"{"ev":"free","req":2}"#,
            A1,
            r#"{"ev":"alloc","req":1,"pages":[9]}"#,
            r#"{"ev":"write","req":1,"page":9,"slots":[0,4]}"#,
            r#"{"ev":"read","req":1,"pages":[9],"tokens":10}"#, // 9
        ],
    );
    assert_eq!(got, [(9, UnwrittenSlots)]);
    let l = &r.leaks().leaks[0];
    assert_eq!((l.reader, l.writer, l.slots), (1, 2, 6), "slots 4..10 held evil's bytes");
}

#[test]
fn a_refused_import_still_lands_and_every_listed_page_is_checked() {
    let got = kinds(&[
        A1,
        r#"{"ev":"alloc","req":1,"pages":[5,6]}"#,
        r#"{"ev":"import","req":1,"pages":[5,6],"tokens":20,"expect":32}"#, // 4
        r#"{"ev":"read","req":1,"pages":[5,6],"tokens":20}"#,
        r#"{"ev":"import","req":1,"pages":[5,6,99999],"tokens":20,"expect":20}"#, // 6 padding checked
        r#"{"ev":"import","req":1,"pages":[5,6,0],"tokens":20,"expect":20}"#,     // 7 reserved
        A2,
        r#"{"ev":"alloc","req":2,"pages":[7]}"#,
        r#"{"ev":"import","req":2,"pages":[6],"tokens":2,"expect":2}"#, // 10
        r#"{"ev":"read","req":1,"pages":[5,6],"tokens":17}"#,           // 11 evil's bytes
    ]);
    assert_eq!(
        got,
        [(4, TokenCountMismatch), (6, PageOutOfRange), (7, ReservedPage), (10, ForeignPage), (11, ForeignPage)]
    );
}

#[test]
fn v1_1_events_replay_and_the_end_marker_is_required() {
    let lines = [
        r#"{"ev":"pool","pages":8,"page_size":16,"max_context":64,"reserved":[0],"version":"1.1","scrub_on_release":true}"#,
        r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0}"#,
        r#"{"ev":"alloc","req":1,"pages":[1]}"#,
        r#"{"ev":"write","req":1,"page":1,"slots":[0,16]}"#,
        r#"{"ev":"share","req":1,"key":"k","pages":[1]}"#,
        r#"{"ev":"grant","tenant":"a"}"#,
        r#"{"ev":"admit","req":2,"tenant":"b","prompt":16,"max_new":0}"#,
        r#"{"ev":"attach","req":2,"key":"k"}"#,
        r#"{"ev":"read","req":2,"pages":[1],"tokens":16}"#,
        r#"{"ev":"detach","req":2,"key":"k"}"#,
        r#"{"ev":"read","req":2,"pages":[1],"tokens":16}"#, // 11 foreign: detached
        r#"{"ev":"revoke","tenant":"a"}"#,
        r#"{"ev":"attach","req":2,"key":"k"}"#, // 13 cross_tenant_share
        r#"{"ev":"preempt","req":1}"#,
        r#"{"ev":"evict","key":"k"}"#,
        r#"{"ev":"alloc","req":2,"pages":[1]}"#, // 16 awaiting a scrub: not free (handed over anyway)
        r#"{"ev":"scrub","pages":[1]}"#,         // 17 so it is req 2's when scrubbed
        r#"{"ev":"free","req":2}"#,
        r#"{"ev":"end"}"#,
    ];
    let run = |text: String| {
        let mut found = Vec::new();
        Replayer::new()
            .replay(text.as_bytes(), |v| {
                found.push((v.line(), v.kind()));
                Ok(())
            })
            .map(|_| found)
    };
    let found = run(lines.join("\n")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(found, [(11, ForeignPage), (13, CrossTenantShare), (16, PageNotFree), (17, PageNotFree)]);
    let cut = run(lines[..18].join("\n")).unwrap_err();
    assert!(matches!(cut.kind(), ReplayErrorKind::Truncated { lines: 18 }), "{cut}");
    assert!(cut.to_string().contains("truncated"), "{cut}");
    let after = run(format!("{}\n{}", lines.join("\n"), lines[1])).unwrap_err();
    assert!(matches!(after.kind(), ReplayErrorKind::AfterEnd("admit")), "{after}");
    let v2 = run(lines[0].replace("1.1", "2")).unwrap_err();
    assert!(matches!(v2.kind(), ReplayErrorKind::UnsupportedVersion(_)), "{v2}");
    // v1 needs no end marker.
    assert!(run(format!("{POOL}\n{A1}")).is_ok());
}

#[test]
fn the_pool_memory_budget_refuses_a_huge_pool_before_allocating() {
    let huge = br#"{"ev":"pool","pages":67108864,"page_size":256,"max_context":512}"#;
    let options = ReplayOptions::default().with_max_pool_bytes(1 << 30);
    let start = std::time::Instant::now();
    let err = Replayer::with_options(options).replay(&huge[..], |_| Ok(())).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::PoolOverBudget { .. }), "{err}");
    assert!(start.elapsed().as_secs() < 2);
    assert_eq!(ReplayOptions::pool_bytes(64, 16), 64 * (45 + 64) + 128);
}

#[test]
fn live_requests_and_prefixes_are_capped() {
    let options = ReplayOptions::default().with_max_live_requests(100).with_max_prefixes(10);
    let admits: Vec<String> =
        (0..101).map(|i| format!(r#"{{"ev":"admit","req":{i},"tenant":"t","prompt":0,"max_new":0}}"#)).collect();
    let text = format!("{POOL}\n{}", admits.join("\n"));
    let err = Replayer::with_options(options).replay(text.as_bytes(), |_| Ok(())).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::TooManyLive { what: "requests", max: 100 }), "{err}");
    assert_eq!(err.line(), 102);
    let shares: Vec<String> = (0..11).map(|i| format!(r#"{{"ev":"share","req":1,"key":"k{i}","pages":[]}}"#)).collect();
    let text = format!("{POOL}\n{A1}\n{}", shares.join("\n"));
    let err = Replayer::with_options(options).replay(text.as_bytes(), |_| Ok(())).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::TooManyLive { what: "prefixes", max: 10 }), "{err}");
}

#[test]
fn attaching_many_prefixes_in_descending_order_is_linear() {
    let n = 20_000;
    let mut lines = vec![format!("{POOL}"), A1.to_owned(), A2.replace("evil", "acme")];
    lines.extend((0..n).map(|i| format!(r#"{{"ev":"share","req":1,"key":"k{i}","pages":[]}}"#)));
    let asc: Vec<String> = (0..n).map(|i| format!(r#"{{"ev":"attach","req":2,"key":"k{i}"}}"#)).collect();
    let time = |attaches: &[String]| {
        let text = [&lines[..], attaches].concat().join("\n");
        let start = std::time::Instant::now();
        Replayer::new().replay(text.as_bytes(), |_| Ok(())).unwrap();
        start.elapsed()
    };
    let desc: Vec<String> = asc.iter().rev().cloned().collect();
    let (a, d) = (time(&asc), time(&desc));
    // Quadratic, descending took ~10x ascending at 400k; linear, they are alike.
    assert!(d < a * 4 + std::time::Duration::from_millis(200), "ascending {a:?}, descending {d:?}");
}

#[test]
fn the_line_limit_counts_content_without_the_line_end() {
    let opts = ReplayOptions::default().with_max_line_bytes(POOL.len());
    for end in ["\n", "\r\n"] {
        let text = format!("{POOL}{end}");
        assert!(Replayer::with_options(opts).replay(text.as_bytes(), |_| Ok(())).is_ok(), "{end:?}");
    }
    let text = format!("{POOL} \n");
    assert!(Replayer::with_options(opts).replay(text.as_bytes(), |_| Ok(())).is_err());
    assert_eq!(ReplayOptions::default().with_max_line_bytes(usize::MAX).max_line_bytes, kvguard::trace::MAX_LINE_BYTES);
}

#[test]
fn ignored_fields_must_be_utf8_and_shallow_and_reserved_fits_the_pool() {
    let bad = [
        b"{\"ev\":\"pool\",\"pages\":8,\"page_size\":16,\"max_context\":64,\"x\":\"\xff\"}".to_vec(),
        format!(
            r#"{{"ev":"pool","pages":8,"page_size":16,"max_context":64,"x":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        )
        .into_bytes(),
        br#"{"ev":"pool","pages":2,"page_size":16,"max_context":16,"reserved":[0,1,1]}"#.to_vec(),
    ];
    for text in bad {
        let err = Replayer::new().replay(&text[..], |_| Ok(())).unwrap_err();
        assert_eq!(err.line(), 1, "{err}");
    }
    let deep = format!(
        r#"{{"ev":"pool","pages":8,"page_size":16,"max_context":64,"x":{}1{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    assert!(Replayer::new().replay(deep.as_bytes(), |_| Ok(())).is_ok());
}

#[test]
fn wide_numbers_and_overflowing_sums_are_shown_as_written() {
    let mut shown = Vec::new();
    let text = format!(
        "{POOL}\n{A1}\n{}\n{}\n{}",
        r#"{"ev":"alloc","req":1,"pages":[5]}"#,
        r#"{"ev":"write","req":1,"page":5,"slots":[0,5000000000]}"#,
        r#"{"ev":"admit","req":2,"tenant":"a","prompt":18446744073709551615,"max_new":2}"#
    );
    Replayer::new()
        .replay(text.as_bytes(), |v| {
            shown.push((v.to_string(), serde_json::to_string(v).unwrap()));
            Ok(())
        })
        .unwrap();
    assert!(shown[0].0.contains("slots 0..5000000000"), "{}", shown[0].0);
    assert!(shown[0].1.contains(r#""slots":[0,5000000000]"#), "{}", shown[0].1);
    assert!(shown[1].0.contains("18,446,744,073,709,551,615 + 2 tokens (more than 2^64)"), "{}", shown[1].0);
    assert!(shown[1].1.contains(r#""found":18446744073709551617"#), "{}", shown[1].1);
}
