//! The `kvguard` command line: replay an engine's ownership trace, audit pool sizes.
//!
//! A thin layer over [`kvguard::trace::Replayer`] and the pool audit; exit status 0 means clean,
//! 1 means violations (or a pool that fails the audit), 2 means the input or the command line
//! was unusable.

use clap::{Args, Parser, Subcommand};
use kvguard::trace::{ReplayErrorKind, ReplayOptions, Replayer};
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

const REPLAY_HELP: &str = "\
Exit status: 0 no violation, 1 violations found, 2 unusable input (unreadable file,
malformed line: the message on stderr names the line and why).

Examples:
  kvguard replay engine-trace.jsonl
  zcat run.jsonl.gz | kvguard replay - --json | jq 'select(.kind == \"foreign_page\")'

Each violation is printed with its line number, event, kind, request, page, owner and slots:
  line 9: unwritten_slots in read by req 3 (tenant \"acme\"), page 40 gen 1, block 2, owned by req 3 (tenant \"acme\"), slots 4..16
With --json, each is one JSON object ({\"line\":9,\"ev\":\"read\",\"kind\":\"unwritten_slots\",\"req\":3,...})
and the last line is {\"summary\":{\"events\":N,\"violations\":V,...}}.

The trace format (v1) is in docs/trace-format.md: one JSON object per line, e.g.
  {\"ev\":\"pool\",\"pages\":4096,\"page_size\":16,\"max_context\":32768,\"reserved\":[0]}
  {\"ev\":\"admit\",\"req\":1,\"tenant\":\"acme\",\"prompt\":40,\"max_new\":200}
  {\"ev\":\"alloc\",\"req\":1,\"pages\":[5,6,7]}
  {\"ev\":\"write\",\"req\":1,\"page\":5,\"slots\":[0,16]}
  {\"ev\":\"read\",\"req\":1,\"pages\":[5,6,7],\"tokens\":40}
  {\"ev\":\"free\",\"req\":1}";

const AUDIT_HELP: &str = "\
For each pool, TOKENS is floored to whole pages of --page-size (1000 tokens of 64-token
pages are 15 pages, 960 tokens); the pool passes when those pages, less --reserved-pages, hold
one request of --max-context tokens.

Exit status: 0 every pool holds one max-context request, 1 at least one does not (the message
names the tokens the pool holds and the max context), 2 a usage error.

Example (a 1M-context model whose prefill pool is too small):
  kvguard audit --max-context 1048576 --page-size 64 --pool prefill=681280 --pool decode=2040000
  prefill: FAIL: 10,645 pages x 64 tokens hold 681,280 tokens, but one max-context request needs 1,048,576 tokens
  decode: ok: 31,875 pages x 64 tokens hold 2,040,000 tokens >= max context 1,048,576";

/// Memory safety for paged KV caches: check an engine's KV ownership offline.
#[derive(Parser, Debug)]
#[command(
    name = "kvguard",
    version,
    about,
    long_about = "Memory safety for paged KV caches.\n\n\
        `kvguard replay` judges a trace of what an engine's scheduler did to its KV pool (admit,\n\
        alloc, write, read, free, share, attach, evict, import, fork): every read through a page\n\
        another request owns, every slot read before it was written, every double free is\n\
        reported with its line. `kvguard audit` checks at start-up that each pool holds one\n\
        max-context request.",
    after_help = "Examples:\n  kvguard replay trace.jsonl --json\n  \
        kvguard audit --max-context 1048576 --page-size 64 --pool prefill=681280 --pool decode=2040000"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a v1 trace through the ownership table (shadow mode) and print every violation.
    #[command(after_long_help = REPLAY_HELP)]
    Replay(ReplayArgs),
    /// Check that each pool can hold one max-context request.
    #[command(after_long_help = AUDIT_HELP)]
    Audit(AuditArgs),
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// The trace: a path, or `-` for stdin.
    trace: PathBuf,
    /// One JSON object per violation, then a summary line.
    #[arg(long)]
    json: bool,
    /// The longest line accepted, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = ReplayOptions::default().max_line_bytes)]
    max_line_bytes: usize,
}

#[derive(Args, Debug)]
struct AuditArgs {
    /// The model's max context, in tokens.
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u64).range(1..))]
    max_context: u64,
    /// Token slots per page.
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..))]
    page_size: u64,
    /// A pool and its size in tokens (floored to whole pages); repeat for each pool.
    #[arg(long = "pool", value_name = "NAME=TOKENS", required = true, value_parser = parse_pool)]
    pools: Vec<(String, u64)>,
    /// Pages of each pool that are never allocated (the null page).
    #[arg(long, value_name = "N", default_value_t = 0)]
    reserved_pages: u64,
    /// One JSON object per pool.
    #[arg(long)]
    json: bool,
}

fn parse_pool(s: &str) -> Result<(String, u64), String> {
    let (name, tokens) = s.split_once('=').ok_or_else(|| format!("expected NAME=TOKENS, found {s:?}"))?;
    if name.is_empty() {
        return Err(format!("the pool in {s:?} has no name"));
    }
    let tokens = tokens.replace(['_', ','], "");
    let tokens: u64 = tokens.parse().map_err(|e| format!("TOKENS in {s:?} is not a token count: {e}"))?;
    Ok((name.to_owned(), tokens))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay(&args),
        Command::Audit(args) => audit(&args),
    }
}

fn replay(args: &ReplayArgs) -> ExitCode {
    let input: Box<dyn BufRead> = if args.trace.as_os_str() == "-" {
        Box::new(io::stdin().lock())
    } else {
        match File::open(&args.trace) {
            Ok(f) => Box::new(BufReader::with_capacity(1 << 18, f)),
            Err(e) => {
                eprintln!("kvguard: cannot read {}: {e}", args.trace.display());
                return ExitCode::from(2);
            }
        }
    };
    let options = ReplayOptions::default().with_max_line_bytes(args.max_line_bytes);
    let mut replayer = Replayer::with_options(options);
    let mut out = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    let json = args.json;
    let result = replayer.replay(input, |v| {
        if json {
            serde_json::to_writer(&mut out, v).map_err(io::Error::other)?;
            out.write_all(b"\n")
        } else {
            writeln!(out, "{v}")
        }
    });
    let summary = match result {
        Ok(summary) => summary,
        Err(e) => {
            let _ = out.flush();
            if let ReplayErrorKind::Output(io) = e.kind()
                && io.kind() == io::ErrorKind::BrokenPipe
            {
                return ExitCode::from(2);
            }
            let name = if args.trace.as_os_str() == "-" { "stdin".into() } else { args.trace.display().to_string() };
            eprintln!("kvguard: {name}: {e}");
            return ExitCode::from(2);
        }
    };
    let written = if json {
        let by_kind: serde_json::Map<String, serde_json::Value> =
            summary.by_kind.iter().map(|(k, n)| (k.as_str().to_owned(), (*n).into())).collect();
        let by_kind = serde_json::Value::Object(by_kind);
        writeln!(
            out,
            r#"{{"summary":{{"events":{},"violations":{},"lines":{},"by_kind":{by_kind}}}}}"#,
            summary.events, summary.violations, summary.lines
        )
    } else {
        let kinds: Vec<String> = summary.by_kind.iter().map(|(k, n)| format!("{} {n}", k.as_str())).collect();
        let kinds = if kinds.is_empty() { String::new() } else { format!(" ({})", kinds.join(", ")) };
        let noun = if summary.violations == 1 { "violation" } else { "violations" };
        writeln!(out, "{} events, {} {noun}{kinds}", summary.events, summary.violations)
    };
    if written.and_then(|()| out.flush()).is_err() {
        return ExitCode::from(2);
    }
    if summary.violations == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// Thousands separators for numbers people read.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn audit(args: &AuditArgs) -> ExitCode {
    let mut failed = false;
    let mut out = io::stdout().lock();
    for (name, tokens) in &args.pools {
        let pages = tokens / args.page_size;
        let allocatable = pages.saturating_sub(args.reserved_pages);
        let holds = u128::from(allocatable) * u128::from(args.page_size);
        let holds = u64::try_from(holds).unwrap_or(u64::MAX);
        let fits = holds >= args.max_context;
        failed |= !fits;
        let (pages_s, ps, holds_s, max_s) =
            (grouped(allocatable), args.page_size, grouped(holds), grouped(args.max_context));
        let floored = if pages * args.page_size != *tokens {
            format!(" ({} tokens floored to whole pages)", grouped(*tokens))
        } else {
            String::new()
        };
        let line = if args.json {
            serde_json::json!({
                "pool": name, "tokens": tokens, "pages": allocatable, "page_size": args.page_size,
                "capacity_tokens": holds, "max_context": args.max_context, "fits": fits,
            })
            .to_string()
        } else if fits {
            format!("{name}: ok: {pages_s} pages x {ps} tokens hold {holds_s} tokens >= max context {max_s}{floored}")
        } else {
            format!(
                "{name}: FAIL: {pages_s} pages x {ps} tokens hold {holds_s} tokens, \
                 but one max-context request needs {max_s} tokens{floored}"
            )
        };
        if writeln!(out, "{line}").is_err() {
            return ExitCode::from(2);
        }
    }
    if failed { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
