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
