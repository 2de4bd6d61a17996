//! `kvguard replay` and `kvguard audit`, run as a user would: exit codes, stdout, stderr.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn kvguard(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvguard"))
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvguard runs");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        pipe.write_all(input).expect("write stdin");
    }
    child.wait_with_output().expect("kvguard exits")
}

fn zoo(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/zoo").join(name).to_string_lossy().into_owned()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8 output")
}

#[test]
fn a_clean_trace_exits_0() {
    let out = kvguard(&["replay", &zoo("clean_prefix_caching.jsonl")], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(" 0 violations"), "{stdout}");
    assert!(out.stderr.is_empty());
}

#[test]
fn violations_exit_1_and_name_line_event_kind_request_page_owner_slots() {
    let out = kvguard(&["replay", &zoo("read_before_write.jsonl")], None);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let first = stdout.lines().next().expect("a violation line");
    for part in ["line 20:", "unwritten_slots", "in read", "req 6", "page 9", "owned by req 6", "slots 0..1"] {
        assert!(first.contains(part), "{part:?} missing in {first}");
    }
    assert!(stdout.lines().last().is_some_and(|l| l.contains("1 violation")), "{stdout}");
}

#[test]
fn json_prints_one_object_per_violation_then_a_summary() {
    let out = kvguard(&["replay", &zoo("dummy_prompt_disagg.jsonl"), "--json"], None);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let lines: Vec<serde_json::Value> =
        stdout.lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["line"], 33);
    assert_eq!(lines[0]["ev"], "import");
    assert_eq!(lines[0]["kind"], "token_count_mismatch");
    assert_eq!(lines[0]["req"], 101);
    assert_eq!(lines[1]["kind"], "unwritten_slots");
    assert_eq!(lines[1]["slots"], serde_json::json!([1, 16]));
    for l in &lines[..2] {
        for field in ["line", "ev", "kind", "req"] {
            assert!(l.get(field).is_some(), "{field} missing in {l}");
        }
    }
    assert_eq!(lines[2]["summary"]["events"], 28);
    assert_eq!(lines[2]["summary"]["violations"], 2);
}

#[test]
fn stdin_is_read_with_a_dash() {
    let trace = std::fs::read(zoo("double_free.jsonl")).expect("zoo trace");
    let out = kvguard(&["replay", "-", "--json"], Some(&trace));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let first: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!((first["line"].as_u64(), first["kind"].as_str()), (Some(19), Some("double_free")));
}

#[test]
fn malformed_input_exits_2_naming_the_line_and_why() {
    let pool = r#"{"ev":"pool","pages":16,"page_size":16,"max_context":64}"#;
    let cases: [(String, &str); 7] = [
        (format!("{pool}\n{{\"ev\":\"admit\",\"req\":1}}\n"), "line 2: admit: missing field \"tenant\""),
        (
            format!("{pool}\n{{\"ev\":\"free\",\"req\":-1}}\n"),
            "line 2: free: field \"req\" must be an unsigned integer",
        ),
        ("# c\n{\"ev\":\"free\",\"req\":1}\n".to_string(), "line 2: free before the pool event"),
        (format!("{pool}\n{pool}\n"), "line 2: a second pool event"),
        (format!("{pool}\nnot json\n"), "line 2: not a JSON object"),
        (format!("{pool}\n{{\"ev\":\"nap\"}}\n"), "line 2: unknown event \"nap\""),
        (String::new(), "line 1: the trace has no pool event"),
    ];
    for (input, want) in cases {
        let out = kvguard(&["replay", "-"], Some(input.as_bytes()));
        assert_eq!(out.status.code(), Some(2), "{input}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(want), "{want:?} not in {stderr:?}");
    }
    let mut bad_utf8 = format!("{pool}\n").into_bytes();
    bad_utf8.extend_from_slice(b"{\"ev\":\"evict\",\"key\":\"\xff\"}\n");
    let out = kvguard(&["replay", "-"], Some(&bad_utf8));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("line 2:"));
}

#[test]
fn violations_before_a_malformed_line_are_printed_and_the_exit_is_2() {
    let input = "{\"ev\":\"pool\",\"pages\":16,\"page_size\":16,\"max_context\":64}\n\
                 {\"ev\":\"free\",\"req\":5}\n{\"ev\":\"free\"}\n";
    let out = kvguard(&["replay", "-"], Some(input.as_bytes()));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stdout).contains("line 2: unknown_request"));
    assert!(text(&out.stderr).contains("line 3: free: missing field \"req\""));
}

#[test]
fn an_unreadable_file_exits_2() {
    let out = kvguard(&["replay", "/no/such/trace.jsonl"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("/no/such/trace.jsonl"));
    let dir = env!("CARGO_MANIFEST_DIR");
    let out = kvguard(&["replay", dir], None);
    assert_eq!(out.status.code(), Some(2), "a directory is not a trace");
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["audit", "--max-context", "10", "--page-size", "16"][..],
        &["audit", "--max-context", "10", "--page-size", "0", "--pool", "a=1"],
        &["audit", "--max-context", "10", "--page-size", "16", "--pool", "a"],
        &["audit", "--max-context", "10", "--page-size", "16", "--pool", "a=-1"],
        &["replay"],
        &["frobnicate"],
    ] {
        let out = kvguard(args, None);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn help_explains_both_commands_with_examples() {
    let out = kvguard(&["--help"], None);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    assert!(help.contains("replay") && help.contains("audit") && help.contains("Examples"), "{help}");
    let out = kvguard(&["replay", "--help"], None);
    let help = text(&out.stdout);
    assert!(help.contains("--json") && help.contains("Exit status") && help.contains("kvguard replay"), "{help}");
    let out = kvguard(&["audit", "--help"], None);
    let help = text(&out.stdout);
    assert!(help.contains("floored") && help.contains("--pool prefill=681280"), "{help}");
}

#[test]
fn bounds_name_their_flags_and_leaks_name_whose_kv() {
    let huge = br#"{"ev":"pool","pages":67108864,"page_size":256,"max_context":512}"#;
    let out = kvguard(&["replay", "-"], Some(huge));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--max-pool-mib"), "{}", text(&out.stderr));
    let out = kvguard(&["replay", "--max-line-bytes", "18446744073709551615", "-"], Some(b""));
    assert_eq!(out.status.code(), Some(2));
    let out = kvguard(&["replay", "--leaks", &zoo("follow_evict.jsonl")], None);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(r#"req 2 (tenant "acme") read 16 slot(s) written by req 3 (tenant "evil")"#), "{stdout}");
    let out = kvguard(&["replay", "--leaks", "--json", &zoo("follow_evict.jsonl")], None);
    let last: serde_json::Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(last["summary"]["leaks"][0]["writer_tenant"], "evil");
}

#[test]
fn audit_token_separators_go_only_between_digits() {
    for bad in ["a=,,1_,_0", "a=_10", "a=10_", "a=1__0"] {
        let out = kvguard(&["audit", "--max-context", "16", "--page-size", "16", "--pool", bad], None);
        assert_eq!(out.status.code(), Some(2), "{bad}");
    }
    let out = kvguard(&["audit", "--max-context", "16", "--page-size", "16", "--pool", "a=1_024,0"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// A v1 trace of `n` violations: one request reading a page it never wrote, `n` times.
fn noisy_trace(n: usize) -> Vec<u8> {
    let mut trace = String::from(
        "{\"ev\":\"pool\",\"pages\":8,\"page_size\":16,\"max_context\":64}\n\
         {\"ev\":\"admit\",\"req\":1,\"tenant\":\"acme\",\"prompt\":16,\"max_new\":0}\n\
         {\"ev\":\"alloc\",\"req\":1,\"pages\":[5]}\n",
    );
    for _ in 0..n {
        trace.push_str("{\"ev\":\"read\",\"req\":1,\"pages\":[5],\"tokens\":16}\n");
    }
    trace.into_bytes()
}

/// `kvguard replay - <extra>` of a trace of `violations` violations whose reader went away
/// before the output (`kvguard replay ... | head -0`). The trace goes in after the reader left, so
/// every write meets the closed pipe: with many violations, a write during the replay; with one,
/// the final flush.
fn replay_into_a_closed_pipe(extra: &[&str], violations: usize) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvguard"))
        .args(["replay", "-"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvguard runs");
    drop(child.stdout.take());
    let mut stdin = child.stdin.take().expect("piped stdin");
    // From another thread: the child may exit before it has read all of it.
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&noisy_trace(violations));
    });
    let out = child.wait_with_output().expect("kvguard exits");
    writer.join().expect("the writer thread ends");
    out
}

#[test]
fn text_mode_exits_2_silently_on_a_broken_pipe() {
    for (extra, violations) in [(&[][..], 20_000), (&[][..], 1), (&["--leaks"][..], 20_000), (&["--leaks"][..], 1)] {
        let out = replay_into_a_closed_pipe(extra, violations);
        assert_eq!(out.status.code(), Some(2), "{extra:?}, {violations} violations");
        assert!(out.stderr.is_empty(), "{extra:?}: {}", text(&out.stderr));
    }
}

#[test]
fn json_mode_exits_2_silently_on_a_broken_pipe() {
    for (extra, violations) in [(&["--json"][..], 20_000), (&["--json"][..], 1), (&["--json", "--leaks"][..], 1)] {
        let out = replay_into_a_closed_pipe(extra, violations);
        assert_eq!(out.status.code(), Some(2), "{extra:?}, {violations} violations");
        assert!(out.stderr.is_empty(), "{extra:?}: {}", text(&out.stderr));
    }
}
