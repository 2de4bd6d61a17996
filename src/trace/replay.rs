//! Replay: a trace's events through an ownership table in shadow mode, judged one by one.

use super::error::{ReplayError, ReplayErrorKind};
use super::event::{Event, EventKind};
use super::judge::Judge;
use super::leaks::LeakSummary;
use super::options::ReplayOptions;
use super::parse::{ListBuffers, ListCaps, RawEvent, parse_line_into};
use super::verdict::ReplayViolation;
use crate::config::MAX_PAGES;
use crate::ids::PageId;
use crate::table::OwnershipTable;
use crate::violation::ViolationKind;
use serde::Serialize;
use std::io::{self, BufRead};

/// What a replay saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplaySummary {
    /// Lines read, comments and blank lines included.
    pub lines: u64,
    /// Events replayed.
    pub events: u64,
    /// Violations found.
    pub violations: u64,
    /// Violations per kind, in [`ViolationKind::ALL`] order, non-zero only.
    pub by_kind: Vec<(ViolationKind, u64)>,
}

/// Replays a trace (v1 or v1.1) through an [`OwnershipTable`] in shadow mode with
/// [`Policy::Report`](crate::Policy::Report), following the engine.
///
/// Every event is judged against the state the engine is really in: a violating event is
/// returned with its line and counted, and then applied as the engine applied it (a refused
/// evict still evicts, a refused alloc still hands the pages over, a refused write still
/// writes: docs/trace-format.md lists the rule for every event). Replay goes on. Unusable input
/// (a malformed line, an event before the pool) is a [`ReplayError`]. [`leaks`](Self::leaks)
/// sums up whose KV the refused reads reached.
///
/// ```
/// use kvguard::trace::Replayer;
/// use kvguard::ViolationKind;
/// let trace = r#"{"ev":"pool","pages":64,"page_size":16,"max_context":512,"reserved":[0]}
/// {"ev":"admit","req":1,"tenant":"acme","prompt":20,"max_new":8}
/// {"ev":"alloc","req":1,"pages":[5,6]}
/// {"ev":"write","req":1,"page":5,"slots":[0,16]}
/// {"ev":"read","req":1,"pages":[5,6],"tokens":20}
/// "#;
/// let mut found = Vec::new();
/// let summary = Replayer::new().replay(trace.as_bytes(), |v| Ok(found.push(v.clone())))?;
/// assert_eq!(summary.events, 5);
/// assert_eq!((found[0].line(), found[0].kind()), (5, ViolationKind::UnwrittenSlots));
/// assert_eq!(found[0].page(), Some(6));
/// # Ok::<(), kvguard::trace::ReplayError>(())
/// ```
#[derive(Debug, Default)]
pub struct Replayer {
    line: u64,
    events: u64,
    violations: u64,
    state: Judge,
    lists: ListBuffers,
    ids: Vec<PageId>,
    text: Vec<u8>,
}

impl Replayer {
    /// A replayer with the default [`ReplayOptions`].
    pub fn new() -> Replayer {
        Replayer::default()
    }

    /// A replayer with these limits.
    pub fn with_options(options: ReplayOptions) -> Replayer {
        Replayer { state: Judge { options, ..Judge::default() }, ..Replayer::default() }
    }

    /// The table, once the pool event has been seen.
    pub fn table(&self) -> Option<&OwnershipTable> {
        self.state.table.as_ref()
    }

    /// Lines, events and violations so far.
    pub fn summary(&self) -> ReplaySummary {
        ReplaySummary {
            lines: self.line,
            events: self.events,
            violations: self.violations,
            by_kind: self.state.table.as_ref().map(|t| t.counters().nonzero()).unwrap_or_default(),
        }
    }

    /// Which requests read KV other requests wrote, through the reads replay refused.
    pub fn leaks(&self) -> LeakSummary {
        self.state.leaks.summary()
    }

    /// The end of the trace: the summary, or why the trace as a whole is unusable — it has no
    /// pool event ([`ReplayErrorKind::NoPool`]), or it declares v1.1 and lacks its `end` event
    /// ([`ReplayErrorKind::Truncated`]). [`replay`](Self::replay) calls it at the end of its
    /// input; call it after the last [`feed_line`](Self::feed_line) or [`apply`](Self::apply).
    pub fn finish(&self) -> Result<ReplaySummary, ReplayError> {
        if self.state.table.is_none() {
            return Err(ReplayError::new(self.line + 1, ReplayErrorKind::NoPool));
        }
        if self.state.expects_end && !self.state.ended {
            return Err(ReplayError::new(self.line + 1, ReplayErrorKind::Truncated { lines: self.line }));
        }
        Ok(self.summary())
    }

    /// Tenant names, published keys and admitted requests held now: what replay memory grows with.
    pub fn live_names(&self) -> (usize, usize, usize) {
        (self.state.tenants.len(), self.state.keys.len(), self.state.live.len())
    }

    /// Streams a whole trace, calling `on_violation` for each violation in line order; stops at
    /// the first unusable line (or the first error of `on_violation`). A trace that ends without
    /// a pool event is unusable ([`ReplayErrorKind::NoPool`]): an empty recording is not a clean one;
    /// so is a v1.1 trace that ends without its `end` event ([`ReplayErrorKind::Truncated`]).
    pub fn replay<R: BufRead>(
        &mut self,
        mut reader: R,
        mut on_violation: impl FnMut(&ReplayViolation) -> io::Result<()>,
    ) -> Result<ReplaySummary, ReplayError> {
        // Lines are read in place from the reader's buffer; only a line that straddles two
        // buffers is copied (into `text`, at most the limit's bytes: memory stays bounded).
        let mut text = std::mem::take(&mut self.text);
        text.clear();
        // The limit counts a line's bytes without its line end, `\n` or `\r\n`.
        let max = self.state.options.max_line_bytes;
        let limit = max.saturating_add(2);
        let outcome = loop {
            let buf = match reader.fill_buf() {
                Ok(buf) => buf,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(ReplayError::new(self.line + 1, ReplayErrorKind::Io(e))),
            };
            if buf.is_empty() {
                // The end of the input: the last line may lack its newline.
                if !text.is_empty() {
                    let fed = self.feed_checked(&text, max, &mut on_violation);
                    text.clear();
                    if let Err(e) = fed {
                        break Err(e);
                    }
                }
                break self.finish();
            }
            let Some(end) = newline(buf) else {
                // A line that runs past this buffer: keep it, up to the limit.
                let take = buf.len().min(limit - text.len());
                text.extend_from_slice(&buf[..take]);
                reader.consume(take);
                if text.len() >= limit {
                    break Err(ReplayError::new(self.line + 1, ReplayErrorKind::LineTooLong { max }));
                }
                continue;
            };
            let fed = if text.is_empty() {
                self.feed_checked(&buf[..=end], max, &mut on_violation)
            } else {
                let take = (end + 1).min(limit - text.len());
                text.extend_from_slice(&buf[..take]);
                let fed = self.feed_checked(&text, max, &mut on_violation);
                text.clear();
                fed
            };
            reader.consume(end + 1);
            if let Err(e) = fed {
                break Err(e);
            }
        };
        text.clear();
        self.text = text;
        outcome
    }

    /// [`feed_line`](Self::feed_line) for a line read by [`replay`](Self::replay) (its newline
    /// included, if it has one): refused when longer than `max` bytes without its line end, and
    /// its violation handed to `on_violation`.
    fn feed_checked(
        &mut self,
        line: &[u8],
        max: usize,
        on_violation: &mut impl FnMut(&ReplayViolation) -> io::Result<()>,
    ) -> Result<(), ReplayError> {
        let content = match line {
            [.., b'\r', b'\n'] => line.len() - 2,
            [.., b'\n'] => line.len() - 1,
            _ => line.len(),
        };
        if content > max {
            return Err(ReplayError::new(self.line + 1, ReplayErrorKind::LineTooLong { max }));
        }
        if let Some(v) = self.feed_line(line)? {
            on_violation(&v).map_err(|e| ReplayError::new(self.line, ReplayErrorKind::Output(e)))?;
        }
        Ok(())
    }

    /// Replays one line (its newline optional): `Ok(Some(_))` when the event violates,
    /// `Ok(None)` when it is clean, blank or a `#` comment.
    pub fn feed_line(&mut self, line: &[u8]) -> Result<Option<ReplayViolation>, ReplayError> {
        self.line += 1;
        let line_no = self.line;
        let at = |kind| ReplayError::new(line_no, kind);
        let text = trim(line);
        if text.is_empty() || text[0] == b'#' {
            return Ok(None);
        }
        let caps = self.list_caps();
        let mut raw = RawEvent::default();
        parse_line_into(text, &mut raw, &mut self.lists, caps).map_err(at)?;
        let kind = raw.kind().map_err(at)?;
        self.check_order(kind).map_err(at)?;
        let parsed = raw.event(kind, &self.lists, &mut self.ids, caps).map_err(at)?;
        let outcome = self.state.judge(&parsed.event, line_no);
        self.events += 1;
        let found = outcome.map_err(at)?;
        Ok(found.map(|mut v| {
            v.wide_page = parsed.wide_page;
            v.wide_slots = parsed.wide_slots;
            self.violations += 1;
            v
        }))
    }

    /// Replays one event, counted as the next line (for engines that judge events in process
    /// rather than through a file). Page lists are refused as in a file, except a `read`'s: it is
    /// in the caller's memory already, and the table judges it whole.
    pub fn apply(&mut self, event: &Event<'_>) -> Result<Option<ReplayViolation>, ReplayError> {
        self.line += 1;
        let line_no = self.line;
        let at = |kind| ReplayError::new(line_no, kind);
        self.check_order(event.kind()).map_err(at)?;
        let cap = self.list_caps().pages;
        for (field, len) in page_lists(event) {
            if len as u64 > cap {
                let ev = event.kind().as_str();
                return Err(at(ReplayErrorKind::ListTooLong { ev, field, len: len as u64, max: cap }));
            }
        }
        let outcome = self.state.judge(event, line_no);
        self.events += 1;
        let found = outcome.map_err(at)?;
        if found.is_some() {
            self.violations += 1;
        }
        Ok(found)
    }

    /// List lengths for the next line: page lists up to the pool's page count; a `read`'s block
    /// table up to that plus one max-context block table of padding (memory stays bounded by the
    /// pool and the model, not by the input).
    fn list_caps(&self) -> ListCaps {
        match &self.state.table {
            Some(t) => {
                let config = t.config();
                let pages = u64::from(config.num_pages);
                let padding = config.pages_for_tokens(config.max_context_tokens).min(u64::from(MAX_PAGES));
                ListCaps { pages, read: pages + padding, page_size: u64::from(config.page_size) }
            }
            None => ListCaps::strict(u64::from(self.state.options.max_pool_pages)),
        }
    }

    fn check_order(&self, kind: EventKind) -> Result<(), ReplayErrorKind> {
        if self.state.ended {
            return Err(ReplayErrorKind::AfterEnd(kind.as_str()));
        }
        match (kind, self.state.table.is_some()) {
            (EventKind::Pool, true) => Err(ReplayErrorKind::SecondPool),
            (EventKind::Pool, false) | (_, true) => Ok(()),
            (other, false) => Err(ReplayErrorKind::BeforePool(other.as_str())),
        }
    }
}

/// The page lists an event carries that are capped at the pool's page count, with their field
/// names (a `read`'s block table is not: it may be padded).
fn page_lists<'e>(event: &'e Event<'_>) -> impl Iterator<Item = (&'static str, usize)> + 'e {
    let (field, list): (&'static str, Option<&[PageId]>) = match event {
        Event::Pool { reserved, .. } => ("reserved", Some(reserved)),
        Event::Alloc { pages, .. }
        | Event::Share { pages, .. }
        | Event::Import { pages, .. }
        | Event::Scrub { pages }
        | Event::Free { pages: Some(pages), .. } => ("pages", Some(pages)),
        _ => ("pages", None),
    };
    list.map(|l| (field, l.len())).into_iter()
}

/// The line without its newline and surrounding ASCII whitespace.
fn trim(line: &[u8]) -> &[u8] {
    let start = line.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(line.len());
    let end = line.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(start, |i| i + 1);
    &line[start..end]
}

/// The first `\n` in `buf` (memchr: vectorised where the CPU allows).
fn newline(buf: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    /// A replay's outcome as text: each violation's line and kind, then the summary or error.
    fn outcome(text: &[u8], options: ReplayOptions, capacity: Option<usize>) -> String {
        let mut shown = String::new();
        let mut replayer = Replayer::with_options(options);
        let on = |v: &ReplayViolation| {
            shown.push_str(&format!("{}:{:?} ", v.line(), v.kind()));
            Ok(())
        };
        let end = match capacity {
            None => replayer.replay(text, on),
            Some(c) => replayer.replay(BufReader::with_capacity(c, text), on),
        };
        format!("{shown}{end:?}")
    }

    #[test]
    fn lines_that_straddle_buffers_replay_as_whole_ones() {
        let trace = concat!(
            "{\"ev\":\"pool\",\"pages\":64,\"page_size\":16,\"max_context\":512,\"reserved\":[0]}\r\n",
            "\n# a comment\n",
            "{\"ev\":\"admit\",\"req\":1,\"tenant\":\"acme\",\"prompt\":20,\"max_new\":8}\n",
            "{\"ev\":\"alloc\",\"req\":1,\"pages\":[5,6]}\n",
            "{\"ev\":\"write\",\"req\":1,\"page\":5,\"slots\":[0,16]}\n",
            "{\"ev\":\"read\",\"req\":1,\"pages\":[5,6],\"tokens\":20}\n",
            "{\"ev\":\"read\",\"req\":1,\"pages\":[5,6],\"tokens\":20}",
        );
        let broken = trace.replace("\"tokens\":20}\n", "\"tokens\":2x}\n");
        for text in [trace, &broken[..], &trace[..trace.len() - 10]] {
            for max in [40, 60, 70, 71, 72, 73, 80, 1 << 20] {
                let options = ReplayOptions::default().with_max_line_bytes(max);
                let want = outcome(text.as_bytes(), options, None);
                for capacity in 1..=90 {
                    let got = outcome(text.as_bytes(), options, Some(capacity));
                    assert_eq!(got, want, "max {max}, capacity {capacity}");
                }
            }
        }
    }

    #[test]
    fn newlines_are_found_at_any_offset() {
        for len in 0..40 {
            for at in 0..=len {
                let mut buf = vec![b'x'; len];
                if at < len {
                    buf[at] = b'\n';
                }
                assert_eq!(newline(&buf), (at < len).then_some(at));
            }
        }
        assert_eq!(newline(b"\x8a\x0a"), Some(1));
    }
}
