//! The bug zoo: every trace in tests/zoo replays to the verdict its `#` header states.
//!
//! Header lines: one `# expect: line=N kind=K` per violation, in order (every one the trace
//! yields), or `# expect: clean`; and `# violations: V` (how many in all).

use kvguard::ViolationKind;
use kvguard::trace::{ReplayViolation, Replayer};
use std::path::{Path, PathBuf};

/// One trace per bug class the zoo covers, and the clean workloads.
const REQUIRED: &[&str] = &[
    "dummy_prompt_disagg",
    "prefix_evicted_while_held",
    "sliding_window_stale_entry",
    "read_before_write",
    "late_transfer_after_reuse",
    "cross_tenant_prefix_hit",
    "null_page_read",
    "double_free",
    "phantom_prefix_after_eviction",
    "clean_prefix_caching",
    "clean_sliding_window",
    "clean_preemption",
    "clean_disagg_import",
    "clean_fork",
    // Replay follows the engine: one trace per event whose violation still changes the state.
    "follow_admit",
    "follow_alloc",
    "follow_write",
    "follow_free",
    "follow_share",
    "follow_evict",
    "follow_import",
];

#[derive(Debug, PartialEq, Eq)]
enum Expect {
    Clean,
    At { line: u64, kind: ViolationKind },
}

struct Header {
    expect: Vec<Expect>,
    total: Option<u64>,
}

fn header(path: &Path, text: &str) -> Header {
    let mut expect = Vec::new();
    let mut total = None;
    for line in text.lines().take_while(|l| l.starts_with('#') || l.trim().is_empty()) {
        let line = line.trim_start_matches('#').trim();
        if let Some(rest) = line.strip_prefix("expect:") {
            let rest = rest.trim();
            expect.push(if rest == "clean" {
                Expect::Clean
            } else {
                let mut at = None;
                let mut kind = None;
                for part in rest.split_whitespace() {
                    match part.split_once('=') {
                        Some(("line", n)) => at = n.parse().ok(),
                        Some(("kind", k)) => kind = ViolationKind::from_name(k),
                        _ => panic!("{}: bad expect part {part:?}", path.display()),
                    }
                }
                let (Some(line), Some(kind)) = (at, kind) else {
                    panic!("{}: expect needs line=N kind=K: {rest:?}", path.display())
                };
                Expect::At { line, kind }
            });
        } else if let Some(rest) = line.strip_prefix("violations:") {
            total = Some(rest.trim().parse().unwrap_or_else(|_| panic!("{}: bad violations header", path.display())));
        }
    }
    assert!(!expect.is_empty(), "{}: no `# expect:` header", path.display());
    if expect.contains(&Expect::Clean) {
        assert_eq!(expect.len(), 1, "{}: clean and violations both expected", path.display());
        expect.clear();
    }
    Header { expect, total }
}

fn zoo() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/zoo");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/zoo exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    files
}

fn replay(path: &Path) -> (Vec<ReplayViolation>, u64) {
    let text = std::fs::read(path).expect("readable trace");
    let mut found = Vec::new();
    let summary = Replayer::new()
        .replay(&text[..], |v| {
            found.push(v.clone());
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{}: unusable: {e}", path.display()));
    (found, summary.events)
}

#[test]
fn every_required_bug_class_has_a_trace() {
    let files = zoo();
    let stems: Vec<String> =
        files.iter().filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned())).collect();
    for name in REQUIRED {
        assert!(stems.iter().any(|s| s == name), "tests/zoo/{name}.jsonl is missing");
    }
    assert!(files.len() >= REQUIRED.len(), "tests/zoo has {} traces, fewer than {}", files.len(), REQUIRED.len());
}

#[test]
fn every_zoo_trace_replays_to_its_stated_verdict() {
    let files = zoo();
    assert!(!files.is_empty());
    for path in &files {
        let text = std::fs::read_to_string(path).expect("zoo traces are UTF-8");
        let want = header(path, &text);
        let (found, events) = replay(path);
        assert!(events > 5, "{}: only {events} events", path.display());
        let got: Vec<Expect> = found.iter().map(|v| Expect::At { line: v.line(), kind: v.kind() }).collect();
        let all: Vec<String> = found.iter().map(ToString::to_string).collect();
        assert_eq!(got, want.expect, "{}: verdicts differ; all:\n{}", path.display(), all.join("\n"));
        if let Some(total) = want.total {
            assert_eq!(found.len() as u64, total, "{}: violations:\n{}", path.display(), all.join("\n"));
        }
        // Each violation's line really holds an event of the kind the message names.
        for v in &found {
            let line = text.lines().nth(v.line() as usize - 1).expect("line exists");
            assert!(line.contains(&format!("\"ev\":\"{}\"", v.event())), "{}: {line}", path.display());
        }
    }
}

#[test]
fn clean_traces_use_several_tenants_and_page_size_16() {
    for path in zoo() {
        let text = std::fs::read_to_string(&path).expect("UTF-8");
        assert!(text.contains("\"page_size\":16"), "{}", path.display());
    }
    let tenants = |name: &str| {
        let text =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/zoo").join(name)).expect("trace");
        let mut seen: Vec<&str> = text.split("\"tenant\":\"").skip(1).filter_map(|s| s.split('"').next()).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.len()
    };
    assert!(tenants("clean_prefix_caching.jsonl") >= 2);
    assert!(tenants("clean_disagg_import.jsonl") >= 3);
}
