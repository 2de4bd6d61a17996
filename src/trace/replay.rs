//! Replay: a trace's events through an ownership table in shadow mode, judged one by one.

use super::error::{ReplayError, ReplayErrorKind};
use super::event::{Event, EventKind};
use super::names::{KeyEntry, Keys, Live, Tenants};
use super::parse::{ListBuffers, ListCaps, parse_line};
use super::verdict::ReplayViolation;
use crate::config::{ConfigError, MAX_PAGES, PoolConfig};
use crate::error::Error;
use crate::ids::PageId;
use crate::table::OwnershipTable;
use crate::violation::{Op, Policy, Violation, ViolationKind};
use serde::Serialize;
use std::io::{self, BufRead, Read};

/// Limits on what a replayer accepts.
///
/// ```
/// use kvguard::trace::ReplayOptions;
/// let options = ReplayOptions::default().with_max_line_bytes(1 << 20).with_max_pool_pages(1 << 20);
/// assert_eq!(options.max_line_bytes, 1 << 20);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// The longest line, in bytes (default 16 MiB): a longer one is unusable input.
    pub max_line_bytes: usize,
    /// The largest pool, in pages (default and most: [`MAX_PAGES`]). The table costs at most 36
    /// bytes per page plus one bit per slot; lower this where memory is tight.
    pub max_pool_pages: u32,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { max_line_bytes: 16 << 20, max_pool_pages: MAX_PAGES }
    }
}

impl ReplayOptions {
    /// Sets the longest line accepted, in bytes.
    pub fn with_max_line_bytes(mut self, bytes: usize) -> Self {
        self.max_line_bytes = bytes;
        self
    }

    /// Sets the largest pool accepted, in pages (at most [`MAX_PAGES`] in any case).
    pub fn with_max_pool_pages(mut self, pages: u32) -> Self {
        self.max_pool_pages = pages.min(MAX_PAGES);
        self
    }
}

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

/// Replays a v1 trace through an [`OwnershipTable`] in shadow mode with [`Policy::Report`].
///
/// Every event is judged as the table would judge the engine's call: a violating event is
/// returned with its line, counted, and changes nothing in the table; replay goes on. Unusable
/// input (a malformed line, an event before the pool) is a [`ReplayError`].
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

/// What judging needs: the table and the names the trace gave its ids.
#[derive(Debug, Default)]
struct Judge {
    options: ReplayOptions,
    table: Option<OwnershipTable>,
    tenants: Tenants,
    keys: Keys,
    live: Live,
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

    /// Tenant names, published keys and admitted requests held now: what replay memory grows with.
    pub fn live_names(&self) -> (usize, usize, usize) {
        (self.state.tenants.len(), self.state.keys.len(), self.state.live.len())
    }

    /// Streams a whole trace, calling `on_violation` for each violation in line order; stops at
    /// the first unusable line (or the first error of `on_violation`). A trace that ends without
    /// a pool event is unusable ([`ReplayErrorKind::NoPool`]): an empty recording is not a clean one.
    pub fn replay<R: BufRead>(
        &mut self,
        mut reader: R,
        mut on_violation: impl FnMut(&ReplayViolation) -> io::Result<()>,
    ) -> Result<ReplaySummary, ReplayError> {
        let mut text = std::mem::take(&mut self.text);
        let outcome = loop {
            text.clear();
            let limit = (self.state.options.max_line_bytes as u64).saturating_add(1);
            match reader.by_ref().take(limit).read_until(b'\n', &mut text) {
                Ok(0) if self.state.table.is_none() => {
                    break Err(ReplayError::new(self.line + 1, ReplayErrorKind::NoPool));
                }
                Ok(0) => break Ok(self.summary()),
                Ok(_) => {}
                Err(e) => break Err(ReplayError::new(self.line + 1, ReplayErrorKind::Io(e))),
            }
            if text.last() != Some(&b'\n') && text.len() > self.state.options.max_line_bytes {
                let max = self.state.options.max_line_bytes;
                break Err(ReplayError::new(self.line + 1, ReplayErrorKind::LineTooLong { max }));
            }
            match self.feed_line(&text) {
                Ok(Some(v)) => {
                    if let Err(e) = on_violation(&v) {
                        break Err(ReplayError::new(self.line, ReplayErrorKind::Output(e)));
                    }
                }
                Ok(None) => {}
                Err(e) => break Err(e),
            }
        };
        self.text = text;
        outcome
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
        let raw = parse_line(text, &mut self.lists, caps).map_err(at)?;
        let kind = raw.kind().map_err(at)?;
        self.check_order(kind).map_err(at)?;
        let parsed = raw.event(kind, &self.lists, &mut self.ids, caps).map_err(at)?;
        let outcome = self.state.judge(&parsed.event, line_no);
        self.events += 1;
        let found = outcome.map_err(at)?;
        Ok(found.map(|mut v| {
            v.wide_page = parsed.wide_page;
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
        match (kind, self.state.table.is_some()) {
            (EventKind::Pool, true) => Err(ReplayErrorKind::SecondPool),
            (EventKind::Pool, false) | (_, true) => Ok(()),
            (other, false) => Err(ReplayErrorKind::BeforePool(other.as_str())),
        }
    }
}

impl Judge {
    /// Applies one event to the table and says whether it violated.
    fn judge(&mut self, event: &Event<'_>, line: u64) -> Result<Option<ReplayViolation>, ReplayErrorKind> {
        let Judge { options, table, tenants, keys, live } = self;
        let ev = event.kind();
        let found = |v: Violation, tenants: &Tenants, keys: &Keys| {
            let prefix = match v.prefix() {
                Some(k) if k != Keys::UNPUBLISHED => keys.name(k).cloned(),
                _ => event.key().map(std::sync::Arc::from),
            };
            ReplayViolation {
                line,
                ev,
                tenant: v.tenant().and_then(|t| tenants.name(t).cloned()),
                owner_tenant: v.owner_tenant().and_then(|t| tenants.name(t).cloned()),
                prefix,
                wide_page: None,
                violation: v,
            }
        };
        let Some(t) = table.as_ref() else {
            let Event::Pool { pages, page_size, max_context, reserved } = event else {
                return Err(ReplayErrorKind::BeforePool(ev.as_str()));
            };
            if *pages > options.max_pool_pages {
                return Err(ReplayErrorKind::PoolTooLarge { pages: u64::from(*pages), max: options.max_pool_pages });
            }
            let config = PoolConfig::new(*pages, *page_size, *max_context)
                .with_reserved(reserved.iter().copied())
                .with_policy(Policy::Report);
            let too_small = match config.audit() {
                Ok(()) => None,
                Err(ConfigError::PoolTooSmall { capacity_tokens, max_context_tokens, .. }) => Some(
                    Violation::new(ViolationKind::PoolTooSmall, Op::Configure)
                        .with_amounts(capacity_tokens, max_context_tokens),
                ),
                Err(e) => return Err(ReplayErrorKind::InvalidPool(e)),
            };
            let new = OwnershipTable::new_unaudited(config).map_err(|e| match e {
                Error::Config(c) => ReplayErrorKind::InvalidPool(c),
                other => ReplayErrorKind::Table(other),
            })?;
            let new = table.insert(new);
            return Ok(too_small.map(|v| {
                new.record_violation(v.clone());
                found(v, tenants, keys)
            }));
        };
        // Mutations that violate come back as violations (already counted by the table) and
        // change nothing; any other error is not a verdict on the trace.
        let verdict = |r: Result<(), Error>| -> Result<Option<Violation>, ReplayErrorKind> {
            match r {
                Ok(()) => Ok(None),
                Err(Error::Violation(v)) => Ok(Some(v)),
                Err(other) => Err(ReplayErrorKind::Table(other)),
            }
        };
        let violation = match event {
            Event::Pool { .. } => return Err(ReplayErrorKind::SecondPool),
            Event::Admit { req, tenant, prompt, max_new } => {
                let id = tenants.intern(tenant);
                let v = verdict(t.admit(*req, id, *prompt, *max_new))?;
                if v.is_none() {
                    live.insert(*req, id);
                    tenants.retain(id);
                }
                let out = v.map(|v| found(v, tenants, keys));
                tenants.forget_if_unused(id);
                return Ok(out);
            }
            Event::Alloc { req, pages } => verdict(t.claim(*req, pages).map(drop))?,
            Event::Write { req, page, slots: [a, b] } => verdict(t.record_write(*req, *page, *a..*b))?,
            // The pure check, recorded here: replay returns every violation, where the judged
            // `verify_read` lets one through under `Policy::Report`.
            Event::Read { req, pages, tokens } => match t.check_read(*req, pages, *tokens) {
                Ok(()) => None,
                Err(v) => {
                    t.record_violation(v.clone());
                    Some(v)
                }
            },
            Event::Free { req, pages: None } => {
                let v = verdict(t.release(*req).map(drop))?;
                if v.is_none()
                    && let Some(id) = live.remove(*req)
                {
                    tenants.release(id);
                }
                v
            }
            Event::Free { req, pages: Some(pages) } => verdict(t.release_pages(*req, pages).map(drop))?,
            Event::Share { req, key, pages } => {
                let known = keys.get(key);
                let id = known.map_or_else(|| keys.next_id(), |k| k.id);
                let v = verdict(t.publish_prefix(*req, id, pages))?;
                if v.is_none()
                    && known.is_none()
                    && let Some(tenant) = live.tenant(*req)
                {
                    keys.insert(key, KeyEntry { id, tenant });
                    tenants.retain(tenant);
                }
                v
            }
            Event::Attach { req, key } => {
                let id = keys.get(key).map_or(Keys::UNPUBLISHED, |k| k.id);
                verdict(t.attach_prefix(*req, id).map(drop))?
            }
            Event::Evict { key } => {
                let id = keys.get(key).map_or(Keys::UNPUBLISHED, |k| k.id);
                let v = verdict(t.evict_prefix(id).map(drop))?;
                if v.is_none()
                    && let Some(entry) = keys.remove(key)
                {
                    tenants.release(entry.tenant);
                }
                v
            }
            Event::Import { req, pages, tokens, expect } => verdict(t.record_import(*req, pages, *tokens, *expect))?,
            Event::Fork { req, child } => {
                let v = verdict(t.fork(*req, *child))?;
                if v.is_none()
                    && let Some(tenant) = live.tenant(*req)
                {
                    live.insert(*child, tenant);
                    tenants.retain(tenant);
                }
                v
            }
        };
        Ok(violation.map(|v| found(v, tenants, keys)))
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
