//! Judging one event, then following the engine: every event is judged against the state the
//! engine is really in, reported if it violates, and then applied as the engine applied it (the
//! rules are the table "What replay assumes after a violation" in docs/trace-format.md).

use super::error::ReplayErrorKind;
use super::event::Event;
use super::leaks::Leaks;
use super::names::{KeyEntry, Keys, Live, Tenants};
use super::options::ReplayOptions;
use super::verdict::ReplayViolation;
use super::writers::{NO_TENANT, PageWriters, TenantRefs};
use crate::config::{ConfigError, PoolConfig};
use crate::error::Error;
use crate::ids::{PageId, PageRef, RequestId, TenantId};
use crate::table::{OwnershipTable, PageState};
use crate::violation::{Op, Policy, Violation, ViolationKind};
use std::collections::HashSet;
use std::sync::Arc;

/// What judging needs: the table, the names the trace gave its ids, and what replay knows
/// beyond the table (who wrote each page's bytes, the leaks found, the end marker).
#[derive(Debug, Default)]
pub(crate) struct Judge {
    pub options: ReplayOptions,
    pub table: Option<OwnershipTable>,
    pub tenants: Tenants,
    pub keys: Keys,
    pub live: Live,
    pub writers: PageWriters,
    pub leaks: Leaks,
    pub granted: HashSet<TenantId>,
    /// The pool declared v1.1: the trace must end with an `end` event.
    pub expects_end: bool,
    /// The `end` event was seen.
    pub ended: bool,
}

/// A table call's outcome as a verdict: a violation, or clean; any other error is not a verdict
/// on the trace.
fn verdict<T>(r: Result<T, Error>) -> Result<Option<Violation>, ReplayErrorKind> {
    match r {
        Ok(_) => Ok(None),
        Err(Error::Violation(v)) => Ok(Some(v)),
        Err(other) => Err(ReplayErrorKind::Table(other)),
    }
}

impl Judge {
    /// Judges one event, applies it as the engine did, and says whether it violated.
    pub fn judge(&mut self, event: &Event<'_>, line: u64) -> Result<Option<ReplayViolation>, ReplayErrorKind> {
        if self.table.is_none() {
            return self.pool(event, line);
        }
        let violation = self.apply(event, line)?;
        let Judge { tenants, keys, .. } = self;
        Ok(violation.map(|v| {
            let prefix = match v.prefix() {
                Some(k) if k != Keys::UNPUBLISHED => keys.name(k).cloned(),
                _ => event.key().map(Arc::from),
            };
            let overflow = match event {
                Event::Admit { prompt, max_new, .. } if prompt.checked_add(*max_new).is_none() => {
                    Some((*prompt, *max_new))
                }
                _ => None,
            };
            ReplayViolation {
                line,
                ev: event.kind(),
                tenant: v.tenant().and_then(|t| tenants.name(t).cloned()),
                owner_tenant: v.owner_tenant().and_then(|t| tenants.name(t).cloned()),
                prefix,
                wide_page: None,
                wide_slots: None,
                overflow,
                violation: v,
            }
        }))
    }

    /// The pool event: builds the table (within the options' limits).
    fn pool(&mut self, event: &Event<'_>, line: u64) -> Result<Option<ReplayViolation>, ReplayErrorKind> {
        let Event::Pool { pages, page_size, max_context, reserved, version, scrub_on_release } = event else {
            return Err(ReplayErrorKind::BeforePool(event.kind().as_str()));
        };
        let options = self.options;
        if *pages > options.max_pool_pages {
            return Err(ReplayErrorKind::PoolTooLarge { pages: u64::from(*pages), max: options.max_pool_pages });
        }
        let bytes = ReplayOptions::pool_bytes(*pages, *page_size);
        if bytes > options.max_pool_bytes {
            return Err(ReplayErrorKind::PoolOverBudget {
                pages: *pages,
                page_size: *page_size,
                bytes,
                budget: options.max_pool_bytes,
            });
        }
        self.expects_end = match version.as_deref() {
            None | Some("1") => false,
            Some("1.1") => true,
            Some(other) => return Err(ReplayErrorKind::UnsupportedVersion(other.chars().take(32).collect())),
        };
        let config = PoolConfig::new(*pages, *page_size, *max_context)
            .with_reserved(reserved.iter().copied())
            .with_scrub_on_release(*scrub_on_release)
            .with_policy(Policy::Report);
        let too_small = match config.audit() {
            Ok(()) => None,
            Err(ConfigError::PoolTooSmall { capacity_tokens, max_context_tokens, .. }) => Some(
                Violation::new(ViolationKind::PoolTooSmall, Op::Configure)
                    .with_amounts(capacity_tokens, max_context_tokens),
            ),
            Err(e) => return Err(ReplayErrorKind::InvalidPool(e)),
        };
        let table = OwnershipTable::new_unaudited(config).map_err(|e| match e {
            Error::Config(c) => ReplayErrorKind::InvalidPool(c),
            other => ReplayErrorKind::Table(other),
        })?;
        self.writers = PageWriters::new(*pages).ok_or(ReplayErrorKind::Table(Error::OutOfMemory { pages: *pages }))?;
        let table = self.table.insert(table);
        Ok(too_small.map(|v| {
            table.record_violation(v.clone());
            ReplayViolation {
                line,
                ev: event.kind(),
                tenant: None,
                owner_tenant: None,
                prefix: None,
                wide_page: None,
                wide_slots: None,
                overflow: None,
                violation: v,
            }
        }))
    }

    /// Keeps tenant names alive while the writer record refers to them.
    fn note_refs(tenants: &mut Tenants, refs: TenantRefs) {
        if let Some(t) = refs.added {
            tenants.retain(t);
        }
        for t in refs.dropped.into_iter().flatten() {
            tenants.release(t);
        }
    }

    /// Judges a non-pool event and brings the table to the state the engine is in after it.
    fn apply(&mut self, event: &Event<'_>, line: u64) -> Result<Option<Violation>, ReplayErrorKind> {
        let max_live = self.options.max_live_requests;
        let max_prefixes = self.options.max_prefixes;
        let Judge { table, tenants, keys, live, writers, leaks, granted, ended, .. } = self;
        let t = table.as_ref().expect("apply runs once the pool exists");
        let ps = t.config().page_size;
        let v = match event {
            Event::Pool { .. } => return Err(ReplayErrorKind::SecondPool),
            Event::Admit { req, tenant, prompt, max_new } => {
                if live.tenant(*req).is_none() && live.len() >= max_live {
                    return Err(ReplayErrorKind::TooManyLive { what: "requests", max: max_live });
                }
                let id = tenants.intern(tenant);
                let v = verdict(t.admit(*req, id, *prompt, *max_new))?;
                // Too large for the context or the pool: the engine admitted it all the same.
                let admitted = match &v {
                    None => true,
                    Some(v) if matches!(v.kind(), ViolationKind::ExceedsMaxContext | ViolationKind::ExceedsPool) => {
                        t.force_admit(*req, id, *prompt, *max_new)
                    }
                    Some(_) => false,
                };
                if admitted {
                    live.insert(*req, id);
                    tenants.retain(id);
                }
                tenants.forget_if_unused(id);
                v
            }
            Event::Alloc { req, pages } => {
                let v = verdict(t.claim(*req, pages))?;
                if v.is_some() {
                    t.force_claim(*req, pages); // the pages are the request's now, whoever had them
                }
                v
            }
            Event::Write { req, page, slots: [a, b] } => {
                let v = verdict(t.record_write(*req, *page, *a..*b))?;
                let end = (*b).min(ps);
                match &v {
                    None => wrote(live, writers, tenants, *page, *a, end, *req, false),
                    // Past the page's end: the slots inside it were written.
                    Some(v) if v.kind() == ViolationKind::SlotOutOfRange => {
                        if *a < end && verdict(t.record_write(*req, *page, *a..end))?.is_none() {
                            wrote(live, writers, tenants, *page, *a, end, *req, false);
                        }
                    }
                    Some(_) => wrote(live, writers, tenants, *page, *a, end, *req, true),
                }
                return Ok(v);
            }
            Event::Read { req, pages, tokens } => {
                let v = match t.check_read(*req, pages, *tokens) {
                    Ok(()) if writers.any_forced() => forced_bytes_read(t, writers, live, *req, pages, *tokens),
                    Ok(()) => None,
                    Err(v) => Some(v),
                };
                if let Some(v) = &v {
                    t.record_violation(v.clone());
                    attribute(t, tenants, live, writers, leaks, line, *req, pages, *tokens);
                }
                return Ok(v);
            }
            Event::Free { req, pages: None } => {
                let v = verdict(t.release(*req))?;
                if v.is_none()
                    && let Some(id) = live.remove(*req)
                {
                    tenants.release(id);
                }
                v
            }
            Event::Free { req, pages: Some(pages) } => {
                let v = verdict(t.release_pages(*req, pages))?;
                if v.is_some() {
                    // The engine's allocator took back every page it was told to, whoever owned
                    // it; a page a prefix or fork shares only loses the caller's reference (the
                    // caller keeps its hold on the whole prefix: the table holds per prefix).
                    let owned: Vec<PageId> = pages
                        .iter()
                        .copied()
                        .filter(|&p| t.page_info(p).is_some_and(|i| i.state == PageState::Owned))
                        .collect();
                    t.force_release_pages(&owned);
                }
                v
            }
            Event::Share { req, key, pages } => {
                let known = keys.get(key);
                if known.is_none() && keys.len() >= max_prefixes {
                    return Err(ReplayErrorKind::TooManyLive { what: "prefixes", max: max_prefixes });
                }
                let id = known.map_or_else(|| keys.next_id(), |k| k.id);
                let mut v = verdict(t.publish_prefix(*req, id, pages))?;
                let mut published = v.is_none();
                if let Some(found) = &v
                    && !matches!(found.kind(), ViolationKind::UnknownRequest | ViolationKind::DuplicatePrefix)
                {
                    // The engine published the pages it named: those that were not the
                    // request's become its own first (new incarnations: readers of the prefix
                    // see bytes nobody wrote for it), then the prefix is published.
                    t.force_claim(*req, pages);
                    let own: Vec<PageId> = pages
                        .iter()
                        .copied()
                        .filter(|&p| {
                            t.page_info(p).is_some_and(|i| i.state == PageState::Owned && i.owner == Some(*req))
                        })
                        .collect();
                    let again = verdict(t.publish_prefix(*req, id, &own))?;
                    debug_assert!(again.is_none(), "publishing the request's own pages under a free key");
                    published = again.is_none();
                    if again.is_some() {
                        v = again;
                    }
                }
                if published
                    && known.is_none()
                    && let Some(tenant) = live.tenant(*req)
                {
                    keys.insert(key, KeyEntry { id, tenant });
                    tenants.retain(tenant);
                }
                v
            }
            // A refused attach gives no hold: the reads through it are each refused (a hold the
            // table refused is never a licence to read).
            Event::Attach { req, key } => {
                let id = keys.get(key).map_or(Keys::UNPUBLISHED, |k| k.id);
                verdict(t.attach_prefix(*req, id))?
            }
            Event::Detach { req, key } => {
                let id = keys.get(key).map_or(Keys::UNPUBLISHED, |k| k.id);
                verdict(t.detach_prefix(*req, id))?
            }
            Event::Evict { key } => {
                let id = keys.get(key).map_or(Keys::UNPUBLISHED, |k| k.id);
                let v = verdict(t.evict_prefix(id))?;
                // Evicted although held: the engine dropped it all the same.
                let gone = match &v {
                    None => true,
                    Some(v) if v.kind() == ViolationKind::EvictInUse => t.force_evict_prefix(id),
                    Some(_) => false,
                };
                if gone && let Some(entry) = keys.remove(key) {
                    tenants.release(entry.tenant);
                }
                v
            }
            Event::Import { req, pages, tokens, expect } => {
                let mut v = verdict(t.record_import(*req, pages, *tokens, *expect))?;
                let filled = filled_blocks(*tokens, ps, pages.len());
                if v.is_none() {
                    // Every listed page is checked, not only those the tokens fill.
                    for &p in &pages[filled..] {
                        if let Some(found) = verdict(t.record_write(*req, p, 0..0))? {
                            v = Some(found);
                            break;
                        }
                    }
                }
                // What landed, landed: the request's own pages are written, others carry bytes
                // the table refused (the request's, where they do not belong).
                for (k, &p) in pages[..filled].iter().enumerate() {
                    let (a, b) = block_slots(k, *tokens, ps);
                    let own = v.is_none()
                        || (t.page_info(p).is_some_and(|i| i.state == PageState::Owned && i.owner == Some(*req))
                            && verdict(t.record_write(*req, p, a..b))?.is_none());
                    wrote(live, writers, tenants, p, a, b, *req, !own);
                }
                return Ok(v);
            }
            Event::Fork { req, child } => {
                if live.tenant(*child).is_none() && live.len() >= max_live {
                    return Err(ReplayErrorKind::TooManyLive { what: "requests", max: max_live });
                }
                let v = verdict(t.fork(*req, *child))?;
                if v.is_none()
                    && let Some(tenant) = live.tenant(*req)
                {
                    live.insert(*child, tenant);
                    tenants.retain(tenant);
                }
                v
            }
            Event::Preempt { req } => verdict(t.preempt(*req))?,
            Event::Scrub { pages } => {
                let mut first = None;
                for (k, &p) in pages.iter().enumerate() {
                    let Some(info) = t.page_info(p) else {
                        first.get_or_insert_with(|| scrub_violation(ViolationKind::PageOutOfRange, p, None, k));
                        continue;
                    };
                    match info.state {
                        PageState::AwaitingScrub => {
                            let released =
                                PageRef { page: p, generation: crate::ids::Generation(info.generation.0 - 1) };
                            // Listed twice: the second is no longer awaiting, and is free.
                            let _ = t.confirm_scrubbed(&[released]);
                        }
                        PageState::Free | PageState::Retired => {}
                        PageState::Reserved => {
                            first.get_or_insert_with(|| {
                                scrub_violation(ViolationKind::ReservedPage, p, Some(info.generation), k)
                            });
                        }
                        PageState::Owned | PageState::Shared => {
                            first.get_or_insert_with(|| {
                                scrub_violation(ViolationKind::PageNotFree, p, Some(info.generation), k)
                            });
                        }
                    }
                    // Whatever its state, the engine wiped its bytes.
                    let refs = writers.scrub(p);
                    Self::note_refs(tenants, refs);
                }
                if let Some(v) = &first {
                    t.record_violation(v.clone());
                }
                first
            }
            Event::Grant { tenant } => {
                let id = tenants.intern(tenant);
                if granted.insert(id) {
                    tenants.retain(id);
                }
                t.allow_cross_tenant_sharing(id, true);
                tenants.forget_if_unused(id);
                None
            }
            Event::Revoke { tenant } => {
                let id = tenants.intern(tenant);
                t.allow_cross_tenant_sharing(id, false);
                if granted.remove(&id) {
                    tenants.release(id);
                }
                tenants.forget_if_unused(id);
                None
            }
            Event::End => {
                *ended = true;
                None
            }
        };
        Ok(v)
    }
}

/// For a refused read, charges each page the read could not have made to the requests whose
/// bytes it held in the slots read.
#[cold]
#[allow(clippy::too_many_arguments)]
fn attribute(
    t: &OwnershipTable,
    tenants: &Tenants,
    live: &Live,
    writers: &PageWriters,
    leaks: &mut Leaks,
    line: u64,
    req: RequestId,
    pages: &[PageId],
    tokens: u64,
) {
    let ps = t.config().page_size;
    let reader = (req, live.tenant(req).unwrap_or(NO_TENANT));
    let name = |id: TenantId| tenants.name(id).cloned();
    for (k, &p) in pages[..filled_blocks(tokens, ps, pages.len())].iter().enumerate() {
        let need = block_slots(k, tokens, ps).1;
        let clean = t.check_read(req, &[p], u64::from(need)).is_ok();
        if clean && writers.foreign_forced(p, need, req).is_none() {
            continue;
        }
        // Slots the reader's own incarnation wrote are its own; the rest are charged.
        let written = t.page_info(p).map_or(0, |i| i.written_prefix.min(need));
        let from = if written > 0
            && t.check_read(req, &[p], u64::from(written)).is_ok()
            && writers.foreign_forced(p, written, req).is_none()
        {
            written
        } else {
            0
        };
        for run in writers.writers(p, need) {
            let (a, b) = (run.a.max(from), run.b);
            if a < b && run.req != req {
                leaks.add(line, reader, (run.req, run.tenant), u64::from(b - a), name);
            }
        }
    }
}

/// Records `req`'s write of slots `a..b` of `page` in the writer record.
#[allow(clippy::too_many_arguments)]
fn wrote(
    live: &Live,
    writers: &mut PageWriters,
    tenants: &mut Tenants,
    page: PageId,
    a: u32,
    b: u32,
    req: RequestId,
    forced: bool,
) {
    let refs = writers.write(page, a, b, req, || live.tenant(req).unwrap_or(NO_TENANT), forced);
    Judge::note_refs(tenants, refs);
}

/// Blocks of a `pages`-long list that `tokens` tokens fill.
fn filled_blocks(tokens: u64, page_size: u32, pages: usize) -> usize {
    usize::try_from(tokens.div_ceil(u64::from(page_size))).unwrap_or(usize::MAX).min(pages)
}

/// Slots `a..b` of block `k` that tokens `0..tokens` fill (`a` is 0).
fn block_slots(k: usize, tokens: u64, page_size: u32) -> (u32, u32) {
    let start = k as u64 * u64::from(page_size);
    (0, tokens.saturating_sub(start).min(u64::from(page_size)) as u32)
}

/// A clean table verdict on a read, checked against bytes the table refused but the engine
/// wrote: the first page whose slots read hold another request's forced bytes is foreign.
fn forced_bytes_read(
    t: &OwnershipTable,
    writers: &PageWriters,
    live: &Live,
    req: RequestId,
    pages: &[PageId],
    tokens: u64,
) -> Option<Violation> {
    let ps = t.config().page_size;
    for (k, &p) in pages[..filled_blocks(tokens, ps, pages.len())].iter().enumerate() {
        let need = block_slots(k, tokens, ps).1;
        if let Some(run) = writers.foreign_forced(p, need, req) {
            let generation = t.page_info(p).map(|i| i.generation);
            return Some(
                Violation::new(ViolationKind::ForeignPage, Op::Read)
                    .with_request(req, live.tenant(req))
                    .with_page(p, generation)
                    .with_block_index(k as u32)
                    .with_owner(run.req, run.tenant)
                    .with_slots(run.a, run.b),
            );
        }
    }
    None
}

fn scrub_violation(
    kind: ViolationKind,
    page: PageId,
    generation: Option<crate::ids::Generation>,
    k: usize,
) -> Violation {
    Violation::new(kind, Op::Scrub).with_page(page, generation).with_block_index(k as u32)
}
