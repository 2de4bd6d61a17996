//! The `kvguard` command line: replay an engine's ownership trace, audit pool sizes.
//!
//! A thin layer over [`kvguard::trace::Replayer`] and [`kvguard::PoolConfig::audit`]; exit status 0
//! means clean, 1 means violations (or a pool that fails the audit), 2 means the input or the
//! command line was unusable.

use clap::{Args, Parser, Subcommand};
use kvguard::config::{MAX_PAGE_SIZE, MAX_PAGES};
use kvguard::ids::grouped;
use kvguard::trace::{LeakSummary, MAX_LINE_BYTES, ReplayErrorKind, ReplayOptions, Replayer};
use kvguard::{ConfigError, PageId, PoolConfig};
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

With --leaks, a forensic section follows: for each request whose refused reads reached KV that
another request wrote, the writer (request and tenant), the slots read and the first line.

Bounds (each refused with exit 2 and a message naming its flag): --max-pool-mib (default 1024),
--max-live-requests and --max-prefixes (default 262,144 each), --max-line-bytes (default 16 MiB).

The trace format (v1, v1.1) is in docs/trace-format.md: one JSON object per line, e.g.
  {\"ev\":\"pool\",\"pages\":4096,\"page_size\":16,\"max_context\":32768,\"reserved\":[0]}
  {\"ev\":\"admit\",\"req\":1,\"tenant\":\"acme\",\"prompt\":40,\"max_new\":200}
  {\"ev\":\"alloc\",\"req\":1,\"pages\":[5,6,7]}
  {\"ev\":\"write\",\"req\":1,\"page\":5,\"slots\":[0,16]}
  {\"ev\":\"read\",\"req\":1,\"pages\":[5,6,7],\"tokens\":40}
  {\"ev\":\"free\",\"req\":1}";

const AUDIT_HELP: &str = "\
For each pool, TOKENS is floored to whole pages of --page-size (1000 tokens of 64-token
pages are 15 pages, 960 tokens); the pool passes when the ownership table can track it (1 to
67,108,864 pages, page size 1 to 65,536, at most 2^34 token slots) and those pages, less
--reserved-pages, hold one request of --max-context tokens: the check kvguard::PoolConfig::audit
makes at start-up.

Exit status: 0 every pool passes, 1 at least one does not (its line names the pool, the tokens
it holds and the max context, or why the table refuses it), 2 a usage error.

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
    /// After the violations, say whose KV the refused reads reached: per reader and writer
    /// request (and tenant), the slots read and the first line. With --json, a "leaks" list in
    /// the summary object.
    #[arg(long)]
    leaks: bool,
    /// The longest line accepted, in bytes (at most 1 GiB).
    #[arg(long, value_name = "BYTES", default_value_t = ReplayOptions::default().max_line_bytes as u64,
          value_parser = clap::value_parser!(u64).range(1..=MAX_LINE_BYTES as u64))]
    max_line_bytes: u64,
    /// The memory the pool's state may take, in MiB (45 + 64 bytes per page and one bit per
    /// slot); a trace whose pool needs more is refused (exit 2). At most 1,048,576 (1 TiB).
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_POOL_MIB,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_pool_mib: u64,
    /// The most requests admitted at once; one more is refused (exit 2). At most 67,108,864.
    #[arg(long, value_name = "N", default_value_t = ReplayOptions::default().max_live_requests as u64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 26))]
    max_live_requests: u64,
    /// The most prefixes published at once; one more is refused (exit 2). At most 67,108,864.
    #[arg(long, value_name = "N", default_value_t = ReplayOptions::default().max_prefixes as u64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 26))]
    max_prefixes: u64,
}

/// The default memory budget of `kvguard replay` for the pool's state: 1 GiB, which a laptop has
/// (a pool of about 10 million 16-slot pages).
const DEFAULT_POOL_MIB: u64 = 1024;

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
    /// Pages of each pool that are never allocated (the null page), at most 4,096: engines
    /// reserve one or a few, and the audit lists each.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=4096))]
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
    // Digits, with `_` or `,` allowed only between two digits (681_280, 2,040,000).
    let bytes = tokens.as_bytes();
    let separator = |b: u8| b == b'_' || b == b',';
    let well_placed = bytes.iter().enumerate().all(|(i, &b)| {
        b.is_ascii_digit()
            || (separator(b)
                && i > 0
                && bytes[i - 1].is_ascii_digit()
                && bytes.get(i + 1).is_some_and(u8::is_ascii_digit))
    });
    if tokens.is_empty() || !well_placed {
        return Err(format!("TOKENS in {s:?} is not a token count: digits, with `_` or `,` only between two digits"));
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
    // Each bound is capped by its argument's range, so every conversion fits.
    let options = ReplayOptions::default()
        .with_max_line_bytes(usize::try_from(args.max_line_bytes).unwrap_or(MAX_LINE_BYTES))
        .with_max_pool_bytes(args.max_pool_mib << 20)
        .with_max_live_requests(usize::try_from(args.max_live_requests).unwrap_or(usize::MAX))
        .with_max_prefixes(usize::try_from(args.max_prefixes).unwrap_or(usize::MAX));
    let mut replayer = Replayer::with_options(options);
    let mut out = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    let json = args.json;
    let result = replayer.replay(input, |v| {
        if json {
            // A failed write keeps its kind (a broken pipe stays one).
            serde_json::to_writer(&mut out, v).map_err(io::Error::from)?;
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
            let hint = match e.kind() {
                ReplayErrorKind::PoolOverBudget { .. } => " (raise --max-pool-mib to replay it)",
                ReplayErrorKind::TooManyLive { what: "requests", .. } => " (raise --max-live-requests)",
                ReplayErrorKind::TooManyLive { .. } => " (raise --max-prefixes)",
                ReplayErrorKind::LineTooLong { .. } => " (raise --max-line-bytes)",
                _ => "",
            };
            eprintln!("kvguard: {name}: {e}{hint}");
            return ExitCode::from(2);
        }
    };
    let leaks = args.leaks.then(|| replayer.leaks());
    let written = if json {
        let by_kind: serde_json::Map<String, serde_json::Value> =
            summary.by_kind.iter().map(|(k, n)| (k.as_str().to_owned(), (*n).into())).collect();
        let by_kind = serde_json::Value::Object(by_kind);
        let leaks = match &leaks {
            Some(l) => format!(
                r#","leaks":{},"leak_pairs_dropped":{}"#,
                serde_json::to_string(&l.leaks).unwrap_or_else(|_| "[]".into()),
                l.pairs_dropped
            ),
            None => String::new(),
        };
        writeln!(
            out,
            r#"{{"summary":{{"events":{},"violations":{},"lines":{},"by_kind":{by_kind}{leaks}}}}}"#,
            summary.events, summary.violations, summary.lines
        )
    } else {
        if let Some(l) = &leaks
            && write_leaks(&mut out, l).is_err()
        {
            return ExitCode::from(2);
        }
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

/// The forensic section of `--leaks`: one line per reader and writer.
fn write_leaks(out: &mut impl Write, leaks: &LeakSummary) -> io::Result<()> {
    let who = |req: u64, tenant: &Option<std::sync::Arc<str>>| match tenant {
        Some(t) => format!("req {req} (tenant {t:?})"),
        None => format!("req {req}"),
    };
    if leaks.leaks.is_empty() {
        return writeln!(out, "leaks: no refused read reached another request's KV");
    }
    writeln!(
        out,
        "leaks: {} reader/writer pair(s), {} across tenants",
        leaks.leaks.len(),
        leaks.cross_tenant().count()
    )?;
    for l in &leaks.leaks {
        let reads = if l.reads == 1 { "read" } else { "reads" };
        writeln!(
            out,
            "  {} read {} slot(s) written by {} in {} {reads}, first at line {}{}",
            who(l.reader, &l.reader_tenant),
            grouped(l.slots),
            who(l.writer, &l.writer_tenant),
            grouped(l.reads),
            l.first_line,
            if l.cross_tenant() { ", across tenants" } else { "" }
        )?;
    }
    if leaks.pairs_dropped > 0 {
        writeln!(out, "  ... and {} more pair(s) not kept", grouped(leaks.pairs_dropped))?;
    }
    Ok(())
}

/// Why a pool fails the audit.
#[derive(Debug, thiserror::Error)]
enum PoolRefusal {
    /// The table refuses the pool, or it cannot hold one max-context request.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A page size beyond `u32`: no pool config can carry it.
    #[error("page size {0} is not in 1..={MAX_PAGE_SIZE}")]
    PageSize(u64),
    /// More pages than `u32` counts: no pool config can carry them.
    #[error("the pool has {} pages, more than the {} kvguard tracks", grouped(*.0), grouped(u64::from(MAX_PAGES)))]
    TooManyPages(u64),
}

/// The pool of `tokens` floored to whole pages, pages `0..reserved` never allocated, as the
/// ownership table would be built for it; audited.
fn pool_config(tokens: u64, page_size: u64, max_context: u64, reserved: u64) -> Result<PoolConfig, PoolRefusal> {
    let size = u32::try_from(page_size).map_err(|_| PoolRefusal::PageSize(page_size))?;
    let pages = tokens / page_size;
    let num_pages = u32::try_from(pages).map_err(|_| PoolRefusal::TooManyPages(pages))?;
    let config = PoolConfig::new(num_pages, size, max_context);
    config.validate()?;
    // More reserved pages than the pool has: the first beyond it is out of range.
    let reserved = reserved.min(u64::from(num_pages) + 1);
    let reserved = u32::try_from(reserved).expect("validate: num_pages <= MAX_PAGES, so num_pages + 1 fits u32");
    let config = config.with_reserved((0..reserved).map(PageId));
    config.audit()?;
    Ok(config)
}

fn audit(args: &AuditArgs) -> ExitCode {
    let mut failed = false;
    let mut out = io::stdout().lock();
    let (ps, max_s) = (args.page_size, grouped(args.max_context));
    for (name, tokens) in &args.pools {
        let outcome = pool_config(*tokens, ps, args.max_context, args.reserved_pages);
        failed |= outcome.is_err();
        // Allocatable pages and the tokens they hold, for a pool the table can track.
        let held = match &outcome {
            Ok(config) => Some((config.allocatable_pages(), config.capacity_tokens())),
            Err(PoolRefusal::Config(ConfigError::PoolTooSmall { allocatable_pages, capacity_tokens, .. })) => {
                Some((*allocatable_pages, *capacity_tokens))
            }
            Err(_) => None,
        };
        let page_size_refused =
            matches!(outcome, Err(PoolRefusal::PageSize(_) | PoolRefusal::Config(ConfigError::PageSize { .. })));
        let floored = if !page_size_refused && (tokens / ps) * ps != *tokens {
            format!(" ({} tokens floored to whole pages)", grouped(*tokens))
        } else {
            String::new()
        };
        let line = if args.json {
            serde_json::json!({
                "pool": name, "tokens": tokens, "pages": held.map(|h| h.0), "page_size": ps,
                "capacity_tokens": held.map(|h| h.1), "max_context": args.max_context, "fits": outcome.is_ok(),
                "error": outcome.as_ref().err().map(ToString::to_string),
            })
            .to_string()
        } else {
            match (&outcome, held) {
                (Ok(_), Some((pages, holds))) => format!(
                    "{name}: ok: {} pages x {ps} tokens hold {} tokens >= max context {max_s}{floored}",
                    grouped(u64::from(pages)),
                    grouped(holds)
                ),
                (Err(_), Some((pages, holds))) => format!(
                    "{name}: FAIL: {} pages x {ps} tokens hold {} tokens, \
                     but one max-context request needs {max_s} tokens{floored}",
                    grouped(u64::from(pages)),
                    grouped(holds)
                ),
                (Err(e), None) => format!("{name}: FAIL: {e}{floored}"),
                (Ok(_), None) => unreachable!("an audited pool has its numbers"),
            }
        };
        if writeln!(out, "{line}").is_err() {
            return ExitCode::from(2);
        }
    }
    if failed { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
