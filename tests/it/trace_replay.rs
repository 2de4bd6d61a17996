//! Replay semantics and malformed input, through the library API.

use kvguard::trace::{Event, Found, ReplayErrorKind, ReplayOptions, ReplayViolation, Replayer};
use kvguard::{PageId, RequestId, ViolationKind};

const POOL: &str = r#"{"ev":"pool","pages":64,"page_size":16,"max_context":256,"reserved":[0]}"#;

/// Replays `lines` after the standard pool; the violations, or the error.
fn run(lines: &[&str]) -> Result<Vec<ReplayViolation>, kvguard::trace::ReplayError> {
    let mut text = String::from(POOL);
    for l in lines {
        text.push('\n');
        text.push_str(l);
    }
    let mut found = Vec::new();
    Replayer::new().replay(text.as_bytes(), |v| {
        found.push(v.clone());
        Ok(())
    })?;
    Ok(found)
}

fn kinds(lines: &[&str]) -> Vec<(u64, ViolationKind)> {
    run(lines).unwrap_or_else(|e| panic!("{e}")).iter().map(|v| (v.line(), v.kind())).collect()
}

fn with_pool_bytes(line: &[u8]) -> Vec<u8> {
    let mut text = format!("{POOL}\n").into_bytes();
    text.extend_from_slice(line);
    text.push(b'\n');
    text
}

fn with_pool(line: &str) -> Vec<u8> {
    format!("{POOL}\n{line}\n").into_bytes()
}

#[test]
fn a_clean_request_lifecycle_has_no_violation() {
    assert_eq!(
        kinds(&[
            r#"{"ev":"admit","req":1,"tenant":"acme","prompt":20,"max_new":8}"#,
            r#"{"ev":"alloc","req":1,"pages":[3,4]}"#,
            r#"{"ev":"write","req":1,"page":3,"slots":[0,16]}"#,
            r#"{"ev":"write","req":1,"page":4,"slots":[0,4]}"#,
            r#"{"ev":"read","req":1,"pages":[3,4],"tokens":20}"#,
            r#"{"ev":"free","req":1}"#,
        ]),
        vec![]
    );
}

#[test]
fn comments_blank_lines_and_crlf_are_skipped_but_counted() {
    let text = format!("# header\n\n{POOL}\r\n   \n# c\n{}\r\n", r#"{"ev":"free","req":9}"#);
    let mut found = Vec::new();
    let summary = Replayer::new()
        .replay(text.as_bytes(), |v| {
            found.push((v.line(), v.kind()));
            Ok(())
        })
        .unwrap();
    assert_eq!(found, vec![(6, ViolationKind::UnknownRequest)]);
    assert_eq!((summary.lines, summary.events, summary.violations), (6, 2, 1));
}

#[test]
fn double_free_and_unknown_request_are_told_apart() {
    let admit = r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0}"#;
    assert_eq!(
        kinds(&[
            admit,
            r#"{"ev":"alloc","req":1,"pages":[5]}"#,
            r#"{"ev":"free","req":1}"#,
            r#"{"ev":"free","req":1}"#,
            r#"{"ev":"read","req":1,"pages":[5],"tokens":1}"#,
            r#"{"ev":"free","req":2}"#,
            r#"{"ev":"admit","req":3,"tenant":"a","prompt":300,"max_new":0}"#,
            r#"{"ev":"free","req":3}"#,
            admit,
            r#"{"ev":"alloc","req":1,"pages":[5]}"#,
            r#"{"ev":"free","req":1,"pages":[5]}"#,
            r#"{"ev":"free","req":1,"pages":[5]}"#,
        ]),
        vec![
            (5, ViolationKind::DoubleFree),
            (6, ViolationKind::UnknownRequest),
            (7, ViolationKind::UnknownRequest),
            (8, ViolationKind::ExceedsMaxContext),
            (13, ViolationKind::DoubleFree),
        ]
    );
}

#[test]
fn every_contract_kind_is_reachable_from_a_trace() {
    let found = kinds(&[
        r#"{"ev":"admit","req":7,"tenant":"a","prompt":200,"max_new":100}"#, // 2 exceeds_max_context
        r#"{"ev":"admit","req":1,"tenant":"a","prompt":32,"max_new":0}"#,
        r#"{"ev":"admit","req":1,"tenant":"a","prompt":32,"max_new":0}"#, // 4 duplicate_request
        r#"{"ev":"alloc","req":9,"pages":[1]}"#,                          // 5 unknown_request
        r#"{"ev":"alloc","req":1,"pages":[1,2]}"#,
        r#"{"ev":"alloc","req":1,"pages":[2]}"#,  // 7 page_not_free
        r#"{"ev":"alloc","req":1,"pages":[64]}"#, // 8 page_out_of_range
        r#"{"ev":"alloc","req":1,"pages":[0]}"#,  // 9 reserved_page
        r#"{"ev":"write","req":1,"page":1,"slots":[0,16]}"#,
        r#"{"ev":"write","req":1,"page":2,"slots":[4,17]}"#, // 11 slot_out_of_range
        r#"{"ev":"write","req":1,"page":2,"slots":[5,4]}"#,  // 12 slot_out_of_range
        r#"{"ev":"read","req":1,"pages":[1,2],"tokens":20}"#, // 13 unwritten_slots
        r#"{"ev":"admit","req":2,"tenant":"b","prompt":16,"max_new":0}"#,
        r#"{"ev":"read","req":2,"pages":[1],"tokens":16}"#, // 15 foreign_page
        r#"{"ev":"read","req":2,"pages":[3],"tokens":16}"#, // 16 freed_page
        r#"{"ev":"share","req":1,"key":"k","pages":[1]}"#,
        r#"{"ev":"write","req":1,"page":1,"slots":[0,1]}"#, // 18 write_to_shared
        r#"{"ev":"share","req":1,"key":"k","pages":[2]}"#,  // 19 duplicate_prefix
        r#"{"ev":"attach","req":2,"key":"nope"}"#,          // 20 unknown_prefix
        r#"{"ev":"attach","req":2,"key":"k"}"#,             // 21 cross_tenant_share
        r#"{"ev":"evict","key":"k"}"#,                      // 22 evict_in_use
        r#"{"ev":"alloc","req":2,"pages":[4,5]}"#,
        r#"{"ev":"import","req":2,"pages":[4,5],"tokens":20,"expect":24}"#, // 24 token_count_mismatch
        r#"{"ev":"free","req":2,"pages":[4]}"#,
        r#"{"ev":"free","req":2,"pages":[4]}"#, // 26 double_free
        r#"{"ev":"admit","req":3,"tenant":"c","prompt":16,"max_new":16}"#,
    ]);
    use ViolationKind::*;
    assert_eq!(
        found,
        vec![
            (2, ExceedsMaxContext),
            (4, DuplicateRequest),
            (5, UnknownRequest),
            (7, PageNotFree),
            (8, PageOutOfRange),
            (9, ReservedPage),
            (11, SlotOutOfRange),
            (12, SlotOutOfRange),
            (13, UnwrittenSlots),
            (15, ForeignPage),
            (16, FreedPage),
            (18, WriteToShared),
            (19, DuplicatePrefix),
            (20, UnknownPrefix),
            (21, CrossTenantShare),
            (22, EvictInUse),
            (24, TokenCountMismatch),
            (26, DoubleFree),
        ]
    );
    let small = "{\"ev\":\"pool\",\"pages\":4,\"page_size\":16,\"max_context\":64,\"reserved\":[0]}\n\
                 {\"ev\":\"admit\",\"req\":1,\"tenant\":\"a\",\"prompt\":60,\"max_new\":0}\n";
    let mut got = Vec::new();
    Replayer::new()
        .replay(small.as_bytes(), |v| {
            got.push((v.line(), v.kind()));
            Ok(())
        })
        .unwrap();
    assert_eq!(got, vec![(1, PoolTooSmall), (2, ExceedsPool)]);
}

#[test]
fn fork_keeps_pages_until_both_end_and_share_holds_for_the_publisher() {
    assert_eq!(
        kinds(&[
            r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":16}"#,
            r#"{"ev":"alloc","req":1,"pages":[7]}"#,
            r#"{"ev":"write","req":1,"page":7,"slots":[0,16]}"#,
            r#"{"ev":"fork","req":1,"child":2}"#,
            r#"{"ev":"free","req":1}"#,
            r#"{"ev":"read","req":2,"pages":[7],"tokens":16}"#,
            r#"{"ev":"free","req":2}"#,
            r#"{"ev":"read","req":2,"pages":[7],"tokens":16}"#,
            r#"{"ev":"admit","req":3,"tenant":"a","prompt":16,"max_new":0}"#,
            r#"{"ev":"alloc","req":3,"pages":[7]}"#,
            r#"{"ev":"fork","req":3,"child":3}"#,
        ]),
        vec![(9, ViolationKind::UnknownRequest), (12, ViolationKind::DuplicateRequest)]
    );
}

#[test]
fn wide_page_ids_are_page_out_of_range_and_reported_as_written() {
    let found = run(&[
        r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0}"#,
        r#"{"ev":"alloc","req":1,"pages":[5000000000]}"#,
        r#"{"ev":"write","req":1,"page":18446744073709551615,"slots":[0,1]}"#,
    ])
    .unwrap();
    assert_eq!(found.len(), 2);
    assert_eq!((found[0].kind(), found[0].page()), (ViolationKind::PageOutOfRange, Some(5_000_000_000)));
    assert_eq!(found[1].page(), Some(u64::MAX));
    assert!(found[0].to_string().contains("page 5000000000"), "{}", found[0]);
}

#[test]
fn malformed_input_is_a_typed_error_naming_the_line() {
    use ReplayErrorKind as K;
    type Case = (Vec<u8>, u64, fn(&K) -> bool);
    let cases: Vec<Case> = vec![
        (br#"{"ev":"admit","req":1,"tenant":"a","prompt":1,"max_new":1}"#.to_vec(), 1, |k| {
            matches!(k, K::BeforePool("admit"))
        }),
        (format!("{POOL}\n{POOL}").into_bytes(), 2, |k| matches!(k, K::SecondPool)),
        (Vec::new(), 1, |k| matches!(k, K::NoPool)),
        (b"# only a comment\n\n".to_vec(), 3, |k| matches!(k, K::NoPool)),
        (POOL.as_bytes()[..40].to_vec(), 1, |k| matches!(k, K::Json(_))),
        (with_pool(r#"{"ev":"write","req":1,"page":1,"slots":[1]}"#), 2, |k| matches!(k, K::SlotsNotPair { .. })),
        (with_pool(r#"{"ev":"free","req":99999999999999999999}"#), 2, |k| {
            matches!(k, K::WrongType { found: Found::NotU64, .. })
        }),
        (with_pool(r#"{"ev":"free","req":-3}"#), 2, |k| matches!(k, K::WrongType { found: Found::Negative, .. })),
        (with_pool(r#"{"ev":"read","req":1,"pages":[1],"tokens":2.0}"#), 2, |k| {
            matches!(k, K::WrongType { field: "tokens", found: Found::NotU64, .. })
        }),
        (with_pool("[1,2,3]"), 2, |k| matches!(k, K::Json(_))),
        (with_pool("\"admit\""), 2, |k| matches!(k, K::Json(_))),
        (with_pool_bytes(b"{\"ev\":\"evict\",\"key\":\"\xc3\x28\"}"), 2, |k| matches!(k, K::Json(_))),
        (with_pool_bytes(b"\xff\xfe"), 2, |k| matches!(k, K::Json(_))),
        (with_pool(r#"{"ev":"launch","req":1}"#), 2, |k| matches!(k, K::UnknownEvent(e) if e == "launch")),
        (with_pool(r#"{"req":1}"#), 2, |k| matches!(k, K::MissingEvent)),
        (with_pool(r#"{"ev":7}"#), 2, |k| matches!(k, K::WrongType { field: "ev", .. })),
        (with_pool(r#"{"ev":"attach","req":1}"#), 2, |k| matches!(k, K::MissingField { ev: "attach", field: "key" })),
        (with_pool(r#"{"ev":"attach","req":1,"key":"a","key":"b"}"#), 2, |k| matches!(k, K::DuplicateField("key"))),
        (with_pool(r#"{"ev":"free","req":1,"pages":null}"#), 2, |k| {
            matches!(k, K::WrongType { found: Found::Null, .. })
        }),
        (with_pool(&format!(r#"{{"ev":"alloc","req":1,"pages":[{}]}}"#, vec!["1"; 65].join(","))), 2, |k| {
            matches!(k, K::ListTooLong { field: "pages", len: 65, max: 64, .. })
        }),
        (
            with_pool(&format!(r#"{{"ev":"read","req":1,"tokens":1281,"pages":[{}]}}"#, vec!["1"; 81].join(","))),
            2,
            |k| matches!(k, K::ReadTooLong { len: 81, tokens: 1281, max: 80 }),
        ),
        (with_pool(r#"{"ev":"write","req":1,"page":1,"slots":[]}"#), 2, |k| {
            matches!(k, K::SlotsNotPair { len: 0, .. })
        }),
        (with_pool(r#"{"ev":"write","req":1,"page":1,"slots":[0,"16"]}"#), 2, |k| {
            matches!(k, K::WrongType { field: "slots", found: Found::ListOfOther, .. })
        }),
        (br#"{"ev":"pool","pages":0,"page_size":16,"max_context":64}"#.to_vec(), 1, |k| matches!(k, K::InvalidPool(_))),
        (br#"{"ev":"pool","pages":4,"page_size":16,"max_context":64,"reserved":[4]}"#.to_vec(), 1, |k| {
            matches!(k, K::InvalidPool(_))
        }),
        (br#"{"ev":"pool","pages":4294967296,"page_size":16,"max_context":64}"#.to_vec(), 1, |k| {
            matches!(k, K::PoolTooLarge { .. })
        }),
        (br#"{"ev":"pool","pages":4,"page_size":4294967296,"max_context":64}"#.to_vec(), 1, |k| {
            matches!(k, K::InvalidPool(_))
        }),
    ];
    for (text, line, check) in cases {
        let err = Replayer::new().replay(&text[..], |_| Ok(())).expect_err(&String::from_utf8_lossy(&text));
        assert_eq!(err.line(), line, "{err}");
        assert!(check(err.kind()), "{}: {err}", String::from_utf8_lossy(&text));
        assert!(err.to_string().starts_with(&format!("line {line}: ")), "{err}");
    }
}

#[test]
fn unknown_fields_of_any_type_are_ignored() {
    assert_eq!(
        kinds(&[
            r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0,"slots":"x","pages":{"a":1},"ts":1.5}"#,
            r#"{"engine":"vllm","ev":"free","req":1,"tenant":7,"key":[1,2]}"#,
        ]),
        vec![]
    );
}

#[test]
fn long_lines_are_refused_before_they_are_buffered_whole() {
    let opts = ReplayOptions::default().with_max_line_bytes(200);
    let long = format!(r#"{{"ev":"read","req":1,"tokens":1,"pages":[{}]}}"#, vec!["1"; 500].join(","));
    let text = format!("{POOL}\n{long}\n");
    let err = Replayer::with_options(opts).replay(text.as_bytes(), |_| Ok(())).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::LineTooLong { max: 200 }));
    assert_eq!(err.line(), 2);
}

#[test]
fn pools_above_the_replayer_limit_are_refused() {
    let opts = ReplayOptions::default().with_max_pool_pages(1000);
    let text = br#"{"ev":"pool","pages":1001,"page_size":16,"max_context":64}"#;
    let err = Replayer::with_options(opts).replay(&text[..], |_| Ok(())).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::PoolTooLarge { pages: 1001, max: 1000 }));
}

#[test]
fn names_are_forgotten_when_nothing_refers_to_them() {
    let mut r = Replayer::new();
    r.feed_line(POOL.as_bytes()).unwrap();
    for i in 0..10_000u64 {
        let lines = [
            format!(r#"{{"ev":"admit","req":{i},"tenant":"t{i}","prompt":16,"max_new":0}}"#),
            format!(r#"{{"ev":"alloc","req":{i},"pages":[{}]}}"#, 1 + i % 60),
            format!(r#"{{"ev":"write","req":{i},"page":{},"slots":[0,16]}}"#, 1 + i % 60),
            format!(r#"{{"ev":"share","req":{i},"key":"k{i}","pages":[{}]}}"#, 1 + i % 60),
            format!(r#"{{"ev":"free","req":{i}}}"#),
            format!(r#"{{"ev":"evict","key":"k{i}"}}"#),
            format!(r#"{{"ev":"admit","req":{i},"tenant":"refused{i}","prompt":9999,"max_new":0}}"#),
            format!(r#"{{"ev":"free","req":{i}}}"#),
        ];
        for (n, l) in lines.iter().enumerate() {
            let v = r.feed_line(l.as_bytes()).unwrap();
            assert_eq!(v.is_some(), n == 6, "{l}");
        }
    }
    // The writer record keeps the tenants whose bytes are still in a page: at most two per page.
    let (tenants, keys, live) = r.live_names();
    assert!(tenants <= 2 * 64, "{tenants} tenant names kept");
    assert_eq!((keys, live), (0, 0));
}

#[test]
fn the_typed_api_judges_events_like_lines() {
    let mut r = Replayer::new();
    let pool = Event::Pool {
        pages: 8,
        page_size: 16,
        max_context: 64,
        reserved: vec![PageId(0)].into(),
        version: None,
        scrub_on_release: false,
    };
    assert!(r.apply(&pool).unwrap().is_none());
    assert!(r.apply(&pool).is_err());
    let admit = Event::Admit { req: RequestId(1), tenant: "a".into(), prompt: 16, max_new: 0 };
    assert!(r.apply(&admit).unwrap().is_none());
    let read = Event::Read { req: RequestId(1), pages: vec![PageId(0)].into(), tokens: 1 };
    let v = r.apply(&read).unwrap().unwrap();
    assert_eq!((v.line(), v.kind(), v.tenant()), (4, ViolationKind::ReservedPage, Some("a")));
    let too_long = Event::Alloc { req: RequestId(1), pages: vec![PageId(1); 9].into() };
    assert!(matches!(r.apply(&too_long).unwrap_err().kind(), ReplayErrorKind::ListTooLong { .. }));
}

#[test]
fn json_verdicts_carry_the_trace_names() {
    let found = run(&[
        r#"{"ev":"admit","req":1,"tenant":"acme","prompt":16,"max_new":0}"#,
        r#"{"ev":"alloc","req":1,"pages":[1]}"#,
        r#"{"ev":"write","req":1,"page":1,"slots":[0,16]}"#,
        r#"{"ev":"share","req":1,"key":"sys\"v1","pages":[1]}"#,
        r#"{"ev":"admit","req":2,"tenant":"globex","prompt":16,"max_new":0}"#,
        r#"{"ev":"read","req":2,"pages":[1],"tokens":16}"#,
    ])
    .unwrap();
    let json: serde_json::Value = serde_json::to_value(&found[0]).unwrap();
    assert_eq!(json["line"], 7);
    assert_eq!(json["ev"], "read");
    assert_eq!(json["kind"], "foreign_page");
    assert_eq!(json["req"], 2);
    assert_eq!(json["tenant"], "globex");
    assert_eq!(json["page"], 1);
    assert_eq!(json["owner"], 1);
    assert_eq!(json["owner_tenant"], "acme");
    assert_eq!(json["prefix"], "sys\"v1");
    // The slots the read would have taken from the foreign page.
    assert_eq!(json["slots"], serde_json::json!([0, 16]));
    assert!(!found[0].to_string().contains('\n'));
}

/// Long page lists take a linear path; the verdicts must be the table's own for the whole list.
#[test]
fn long_page_lists_get_the_same_verdict_as_the_table() {
    use kvguard::{OwnershipTable, Policy, PoolConfig, TenantId};
    let list = |pages: &[u32]| pages.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let base: Vec<u32> = (10..3010).collect();
    let variants: Vec<Vec<u32>> = vec![
        base.clone(),
        [&base[..], &[77]].concat(),                   // a repeat at the end
        [&base[..2900], &[0], &base[2900..]].concat(), // the null page late
        [&base[..], &[8192]].concat(),                 // out of range
        [&base[..], &[5]].concat(),                    // owned by req 2
    ];
    for alloc in &variants {
        for release in &variants {
            let text = format!(
                "{{\"ev\":\"pool\",\"pages\":8192,\"page_size\":16,\"max_context\":64,\"reserved\":[0]}}\n\
                 {{\"ev\":\"admit\",\"req\":1,\"tenant\":\"a\",\"prompt\":16,\"max_new\":0}}\n\
                 {{\"ev\":\"admit\",\"req\":2,\"tenant\":\"a\",\"prompt\":16,\"max_new\":0}}\n\
                 {{\"ev\":\"alloc\",\"req\":2,\"pages\":[5]}}\n\
                 {{\"ev\":\"alloc\",\"req\":1,\"pages\":[{}]}}\n{{\"ev\":\"free\",\"req\":1,\"pages\":[{}]}}\n",
                list(alloc),
                list(release),
            );
            let mut found = Vec::new();
            let mut replayer = Replayer::new();
            replayer
                .replay(text.as_bytes(), |v| {
                    found.push(v.violation().clone());
                    Ok(())
                })
                .unwrap();
            let table = OwnershipTable::new(
                PoolConfig::new(8192, 16, 64).with_reserved([PageId(0)]).with_policy(Policy::Report),
            )
            .unwrap();
            table.admit(RequestId(1), TenantId(0), 16, 0).unwrap();
            table.admit(RequestId(2), TenantId(0), 16, 0).unwrap();
            table.claim(RequestId(2), &[PageId(5)]).unwrap();
            let ids = |v: &[u32]| v.iter().map(|&p| PageId(p)).collect::<Vec<_>>();
            let mut direct = Vec::new();
            // Replay follows the engine: a refused claim still hands the pages over, a refused
            // release still releases the owned pages listed.
            if let Err(e) = table.claim(RequestId(1), &ids(alloc)) {
                direct.push(e.violation().unwrap().clone());
                table.force_claim(RequestId(1), &ids(alloc));
            }
            if let Err(e) = table.release_pages(RequestId(1), &ids(release)) {
                direct.push(e.violation().unwrap().clone());
                let owned: Vec<PageId> = ids(release)
                    .into_iter()
                    .filter(|&p| table.page_info(p).is_some_and(|i| i.state == kvguard::PageState::Owned))
                    .collect();
                table.force_release_pages(&owned);
            }
            assert_eq!(found, direct);
            assert_eq!(replayer.table().unwrap().snapshot(), table.snapshot());
        }
    }
}

#[test]
fn a_100k_page_alloc_and_release_replays_in_linear_time() {
    let pages: Vec<String> = (1..100_001).map(|p: u32| p.to_string()).collect();
    let pages = pages.join(",");
    let text = format!(
        "{{\"ev\":\"pool\",\"pages\":131072,\"page_size\":16,\"max_context\":1048576,\"reserved\":[0]}}\n\
         {{\"ev\":\"admit\",\"req\":1,\"tenant\":\"a\",\"prompt\":1048576,\"max_new\":0}}\n\
         {{\"ev\":\"alloc\",\"req\":1,\"pages\":[{pages}]}}\n{{\"ev\":\"free\",\"req\":1,\"pages\":[{pages}]}}\n"
    );
    let start = std::time::Instant::now();
    let summary = Replayer::new().replay(text.as_bytes(), |v| panic!("{v}")).unwrap();
    assert_eq!(summary.events, 4);
    // Quadratic checks would take minutes here (5e9 comparisons per event).
    assert!(start.elapsed().as_secs() < 30, "{:?}", start.elapsed());
}

/// `slots` is a pair whatever the pool's size: in a one-page pool a write of slots `[0,16]` is two
/// numbers, not "two pages".
#[test]
fn slots_are_a_pair_even_in_a_one_page_pool() {
    let pool = r#"{"ev":"pool","pages":1,"page_size":16,"max_context":16}"#;
    let clean = [
        pool,
        r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0}"#,
        r#"{"ev":"alloc","req":1,"pages":[0]}"#,
        r#"{"ev":"write","req":1,"page":0,"slots":[0,16]}"#,
        r#"{"ev":"read","req":1,"pages":[0],"tokens":16}"#,
        r#"{"ev":"free","req":1}"#,
    ]
    .join("\n");
    let summary = Replayer::new().replay(clean.as_bytes(), |v| panic!("{v}")).unwrap();
    assert_eq!((summary.events, summary.violations), (6, 0));

    let after_pool = |line: &str| {
        let text = format!("{pool}\n{}\n{line}\n", r#"{"ev":"admit","req":1,"tenant":"a","prompt":16,"max_new":0}"#);
        Replayer::new().replay(text.as_bytes(), |_| Ok(())).map(|s| s.violations)
    };
    let long = format!(r#"{{"ev":"write","req":1,"page":0,"slots":[{}]}}"#, vec!["1"; 5000].join(","));
    for (line, len) in [(r#"{"ev":"write","req":1,"page":0,"slots":[3]}"#, 1), (&long[..], 5000)] {
        let err = after_pool(line).unwrap_err();
        assert!(matches!(err.kind(), ReplayErrorKind::SlotsNotPair { len: l, .. } if *l == len), "{err}");
        assert_eq!(err.line(), 3);
    }
    // Page lists keep the pool's cap.
    let err = after_pool(r#"{"ev":"alloc","req":1,"pages":[0,0]}"#).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::ListTooLong { len: 2, max: 1, .. }), "{err}");
    // A write past the page is the table's verdict, not malformed input.
    assert_eq!(after_pool(r#"{"ev":"write","req":1,"page":0,"slots":[0,17]}"#).unwrap(), 1);
}

/// Engines pad block tables (with the null page, up to the model's max blocks per sequence);
/// a read reads only the entries its tokens cover, so a padded table longer than the pool is
/// judged on those, exactly as the table judges the whole list.
#[test]
fn padded_block_tables_are_judged_on_the_entries_read() {
    // 64 pages of 16, max context 256: a replay keeps 64 + 16 entries of a read.
    let padded = |head: &[u32], len: usize, tokens: u64| {
        let mut pages: Vec<u32> = head.to_vec();
        pages.resize(len, 0);
        let list = pages.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        (format!(r#"{{"ev":"read","req":1,"pages":[{list}],"tokens":{tokens}}}"#), pages)
    };
    let setup = [
        r#"{"ev":"admit","req":1,"tenant":"acme","prompt":20,"max_new":8}"#,
        r#"{"ev":"alloc","req":1,"pages":[3,4]}"#,
        r#"{"ev":"write","req":1,"page":3,"slots":[0,16]}"#,
        r#"{"ev":"write","req":1,"page":4,"slots":[0,16]}"#,
    ];
    let cases: Vec<(usize, u64, Option<ViolationKind>)> = vec![
        (16, 20, None),                                        // padded to max blocks per sequence
        (80, 20, None),                                        // all a replay keeps
        (81, 20, None),                                        // longer: the padding is never read
        (100_000, 20, None),                                   // far longer
        (100_000, 33, Some(ViolationKind::ReservedPage)),      // the count runs into the null page
        (100_000, 80 * 16, Some(ViolationKind::ReservedPage)), // the last entry kept
    ];
    for (len, tokens, want) in cases {
        let (line, pages) = padded(&[3, 4], len, tokens);
        let mut lines = setup.to_vec();
        lines.push(&line);
        let found = run(&lines).unwrap_or_else(|e| panic!("{len} entries, {tokens} tokens: {e}"));
        assert_eq!(found.first().map(|v| v.kind()), want, "{len} entries, {tokens} tokens");
        // The same read handed whole to the table (the typed API keeps no cap on reads).
        let mut r = Replayer::new();
        r.feed_line(POOL.as_bytes()).unwrap();
        for l in &setup {
            assert!(r.feed_line(l.as_bytes()).unwrap().is_none());
        }
        let read = Event::Read { req: RequestId(1), pages: pages.iter().map(|&p| PageId(p)).collect(), tokens };
        let direct = r.apply(&read).unwrap();
        assert_eq!(found.first().map(|v| v.violation()), direct.as_ref().map(|v| v.violation()));
    }
    // Tokens past the entries kept: malformed, since the replay no longer has those entries.
    let (line, _) = padded(&[3, 4], 100_000, 80 * 16 + 1);
    let err = run(&[setup[0], setup[1], &line]).unwrap_err();
    assert!(matches!(err.kind(), ReplayErrorKind::ReadTooLong { len: 100_000, max: 80, .. }), "{err}");
    assert_eq!(err.line(), 4);
    // A short block table is still the table's verdict.
    assert_eq!(
        kinds(&[setup[0], r#"{"ev":"read","req":1,"pages":[3],"tokens":20}"#]),
        vec![(3, ViolationKind::BlockTableTooShort)]
    );
}

/// A `fork` onto a live child is the parent's call: reported against the parent, naming the
/// live child (which keeps its pages and its tenant).
#[test]
fn fork_onto_a_live_child_is_reported_against_the_parent() {
    let found = run(&[
        r#"{"ev":"admit","req":1,"tenant":"acme","prompt":16,"max_new":16}"#,
        r#"{"ev":"alloc","req":1,"pages":[7]}"#,
        r#"{"ev":"admit","req":2,"tenant":"globex","prompt":16,"max_new":0}"#,
        r#"{"ev":"alloc","req":2,"pages":[8]}"#,
        r#"{"ev":"write","req":2,"page":8,"slots":[0,16]}"#,
        r#"{"ev":"fork","req":1,"child":2}"#,
        r#"{"ev":"read","req":2,"pages":[8],"tokens":16}"#,
    ])
    .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    let v = &found[0];
    assert_eq!((v.line(), v.kind(), v.request(), v.owner()), (7, ViolationKind::DuplicateRequest, Some(1), Some(2)));
    assert_eq!((v.tenant(), v.owner_tenant()), (Some("acme"), Some("globex")));
    let text = v.to_string();
    assert!(text.contains("in fork by req 1 (tenant \"acme\"), child req 2 (tenant \"globex\") is live"), "{text}");
}

/// After a fork the parent's pages are shared with the child: neither may free them page by page
/// (`page_shared`, nothing released); they go when both have ended.
#[test]
fn freeing_forked_pages_page_by_page_is_page_shared() {
    assert_eq!(
        kinds(&[
            r#"{"ev":"admit","req":1,"tenant":"a","prompt":32,"max_new":16}"#,
            r#"{"ev":"alloc","req":1,"pages":[7,8]}"#,
            r#"{"ev":"write","req":1,"page":7,"slots":[0,16]}"#,
            r#"{"ev":"write","req":1,"page":8,"slots":[0,16]}"#,
            r#"{"ev":"fork","req":1,"child":2}"#,
            r#"{"ev":"free","req":1,"pages":[7]}"#, // 7 page_shared: the parent
            r#"{"ev":"free","req":2,"pages":[7]}"#, // 8 page_shared: the child
            r#"{"ev":"alloc","req":1,"pages":[9]}"#,
            r#"{"ev":"free","req":1,"pages":[9]}"#, // its own page after the fork: fine
            r#"{"ev":"free","req":1}"#,
            r#"{"ev":"read","req":2,"pages":[7,8],"tokens":32}"#,
            r#"{"ev":"free","req":2}"#,
            r#"{"ev":"read","req":2,"pages":[7],"tokens":16}"#, // 14 unknown_request
        ]),
        vec![(7, ViolationKind::PageShared), (8, ViolationKind::PageShared), (14, ViolationKind::UnknownRequest)]
    );
}
