//! `kvguard audit`: the start-up pool check, run as a user would.

use std::process::{Command, Output};

fn kvguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvguard")).args(args).output().expect("kvguard runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8 output")
}

#[test]
fn audit_fails_naming_both_numbers() {
    let args = [
        "audit",
        "--pool",
        "prefill=681280",
        "--pool",
        "decode=2040000",
        "--max-context",
        "1048576",
        "--page-size",
        "64",
    ];
    let out = kvguard(&args);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let prefill = stdout.lines().find(|l| l.starts_with("prefill")).expect("prefill line");
    assert!(prefill.contains("FAIL") && prefill.contains("681,280") && prefill.contains("1,048,576"), "{prefill}");
    let decode = stdout.lines().find(|l| l.starts_with("decode")).expect("decode line");
    assert!(decode.contains("ok") && decode.contains("2,040,000"), "{decode}");
}

#[test]
fn audit_passes_floors_partial_pages_and_counts_reserved_pages() {
    let out = kvguard(&["audit", "--max-context", "1024", "--page-size", "64", "--pool", "a=1087"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("floored"));
    let out =
        kvguard(&["audit", "--max-context", "1024", "--page-size", "64", "--pool", "a=1087", "--reserved-pages", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let out = kvguard(&["audit", "--max-context", "1024", "--page-size", "16", "--pool", "a=1024", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["pool"].as_str(), v["fits"].as_bool(), v["pages"].as_u64()), (Some("a"), Some(true), Some(64)));
}

/// The table's limits hold on the command line too: a pool the table refuses fails the audit
/// (exit 1, its line naming the pool and why), never passes, never wraps.
#[test]
fn audit_refuses_a_page_size_above_the_table_limit() {
    let out = kvguard(&["audit", "--max-context", "1048576", "--page-size", "1048576", "--pool", "p=8589934592000"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let stdout = text(&out.stdout);
    let line = stdout.lines().next().expect("a line for the pool");
    assert!(line.starts_with("p: FAIL: ") && line.contains("page size 1048576") && line.contains("65536"), "{line}");
    let out = kvguard(&["audit", "--max-context", "64", "--page-size", "5000000000", "--pool", "p=1", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["pool"].as_str(), v["fits"].as_bool()), (Some("p"), Some(false)));
    assert!(v["error"].as_str().is_some_and(|e| e.contains("page size 5000000000")), "{v}");
}

#[test]
fn audit_reports_pages_beyond_u32_without_truncating_them() {
    // 8,589,934,592,000 tokens of 16 are 536,870,912,000 pages: 2^32 x 125, so a u32 would read 0.
    let args =
        ["audit", "--max-context", "1024", "--page-size", "16", "--pool", "ok=1024", "--pool", "huge=8589934592000"];
    let out = kvguard(&args);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let stdout = text(&out.stdout);
    assert!(stdout.lines().any(|l| l.starts_with("ok: ok: ")), "{stdout}");
    let huge = stdout.lines().find(|l| l.starts_with("huge: ")).expect("huge line");
    assert!(
        huge.starts_with("huge: FAIL: ") && huge.contains("536,870,912,000") && huge.contains("67,108,864"),
        "{huge}"
    );
    let out =
        kvguard(&["audit", "--max-context", "1024", "--page-size", "16", "--pool", "huge=8589934592000", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["fits"].as_bool(), v["pages"].as_u64()), (Some(false), None));
}

#[test]
fn audit_applies_the_table_limits_within_u32() {
    let cases = [
        ("16", "p=1073741824", 0, "ok: 67,108,864 pages"), // exactly MAX_PAGES pages
        ("16", "p=1073741840", 1, "67,108,865 pages, more than the 67,108,864"),
        ("65536", "p=68719476736", 1, "token slots"), // 2^20 pages x 2^16 slots = 2^36 > 2^34
        ("16", "p=15", 1, "no pages"),
    ];
    for (page_size, pool, code, says) in cases {
        let out = kvguard(&["audit", "--max-context", "16", "--page-size", page_size, "--pool", pool]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(code), "{page_size} {pool}: {stdout}");
        assert!(stdout.starts_with("p: ") && stdout.contains(says), "{page_size} {pool}: {stdout}");
    }
}

#[test]
fn audit_counts_more_reserved_pages_than_the_pool_has_as_a_refusal() {
    let out =
        kvguard(&["audit", "--max-context", "16", "--page-size", "16", "--pool", "p=64", "--reserved-pages", "9"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("p: FAIL: ") && stdout.contains("outside the pool of 4 pages"), "{stdout}");
}
