//! The ownership table: for every page, who owns it, which incarnation it is in and which token
//! slots that incarnation wrote; every read through a block table is checked against it.
//!
//! One table serves both ways of embedding kvguard:
//! - **allocator mode**: kvguard picks the pages ([`OwnershipTable::allocate`], O(1) per page from
//!   a free list);
//! - **shadow mode**: the engine keeps its allocator and reports what it handed out
//!   ([`OwnershipTable::claim`]); a page that is not free is refused.
//!
//! The table is `Send + Sync`. Reads ([`verify_read`](OwnershipTable::verify_read),
//! [`verify_step`](OwnershipTable::verify_step)) share one read lock and run in parallel; every
//! other operation takes the write lock for its own duration only. No operation calls back into
//! the engine, so no lock is ever held across engine code.
//!
//! # Memory
//! Each page costs a 24-byte tag, 4 bytes of free list (sized for the whole pool up front), up to
//! 4 bytes in its owner's or prefix's page list and up to 4 bytes in the change list for the
//! device mirror; each token slot costs one bit of coverage bitmap. That is at most 36 bytes per
//! page plus 1 bit per slot: a pool of 1,048,576 pages of 16 slots takes at most 36 MiB of
//! metadata and a 2 MiB bitmap. Each admitted request adds a small record; each prefix one more.

mod lifecycle;
mod prefix;
mod state;
mod verify;

pub use lifecycle::Released;
pub use state::PageState;

use crate::config::PoolConfig;
use crate::error::Error;
use crate::ids::{Generation, PageId, PageRef, PrefixKey, RequestId, TenantId};
use crate::violation::{Op, Policy, Violation, ViolationCounters, ViolationKind};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use state::TableState;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use verify::BlockEntry;

/// The most violations kept for [`OwnershipTable::drain_violations`]; older ones are dropped and
/// counted in [`PoolSnapshot::violations_dropped`].
pub const VIOLATION_LOG_CAPACITY: usize = 1024;

/// The host-side ownership table of one KV pool.
///
/// ```
/// use kvguard::{OwnershipTable, PoolConfig, PageId, RequestId, TenantId, ViolationKind};
///
/// let table = OwnershipTable::new(PoolConfig::new(1024, 16, 4096).with_reserved([PageId(0)]))?;
/// let (alice, bob) = (RequestId(1), RequestId(2));
/// table.admit(alice, TenantId(10), 40, 100)?;
/// table.admit(bob, TenantId(20), 40, 100)?;
///
/// // Allocator mode: kvguard picks alice's pages; her prefill writes 40 tokens.
/// let refs = table.allocate(alice, 3)?;
/// let block_table: Vec<PageId> = refs.iter().map(|r| r.page).collect();
/// table.record_write_tokens(alice, &block_table, 0..40)?;
/// table.verify_read(alice, &block_table, 40)?;
///
/// // Bob's block table pointing at alice's pages is refused, and bob is quarantined.
/// let err = table.verify_read(bob, &block_table, 16).unwrap_err();
/// assert_eq!(err.violation_kind(), Some(ViolationKind::ForeignPage));
///
/// // Alice reading past what she wrote is refused too: those slots hold someone else's KV.
/// let err = table.verify_read(alice, &block_table, 48).unwrap_err();
/// assert_eq!(err.violation_kind(), Some(ViolationKind::UnwrittenSlots));
/// # Ok::<(), kvguard::Error>(())
/// ```
pub struct OwnershipTable {
    config: PoolConfig,
    state: RwLock<TableState>,
    counters: ViolationCounters,
    log: Mutex<VecDeque<Violation>>,
    log_dropped: AtomicU64,
}

/// A KV transfer in flight, from [`OwnershipTable::begin_import`]: while it lives, its pages are
/// pinned. End it with [`finish`](Self::finish) (record what landed) or [`abort`](Self::abort);
/// dropping it aborts. It borrows its table and cannot be copied, so a transfer ends exactly
/// once, and only its own pins.
#[must_use = "dropping the ticket aborts the transfer"]
pub struct ImportTicket<'t> {
    table: &'t OwnershipTable,
    id: u64,
    request: RequestId,
    refs: Vec<PageRef>,
    ended: bool,
}

impl ImportTicket<'_> {
    /// The receiving request.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The pages the transfer lands in.
    pub fn pages(&self) -> &[PageRef] {
        &self.refs
    }

    /// Records `tokens` tokens as written by the request's current incarnation exactly as
    /// [`record_import_refs`](OwnershipTable::record_import_refs) does (a count that differs from
    /// `expected`, or pages that changed hands meanwhile, record nothing), and unpins the pages
    /// whatever the outcome, in the same critical section.
    pub fn finish(mut self, tokens: u64, expected: u64) -> Result<(), Error> {
        self.ended = true;
        let table = self.table;
        let mut state = table.state.write();
        let outcome = import(&mut state, self.request, &self.refs, tokens, expected);
        state.unpin(self.id, &self.refs);
        table.judge(&state, outcome)
    }

    /// Abandons the transfer (its manifest was refused, say): nothing is recorded, and the pages
    /// are unpinned.
    pub fn abort(mut self) {
        self.end();
    }

    fn end(&mut self) {
        if !std::mem::replace(&mut self.ended, true) {
            self.table.state.write().unpin(self.id, &self.refs);
        }
    }
}

impl std::fmt::Debug for ImportTicket<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportTicket").field("request", &self.request).field("pages", &self.refs).finish()
    }
}

impl Drop for ImportTicket<'_> {
    fn drop(&mut self) {
        self.end();
    }
}

/// One sequence of a decode step: a request, its block table and how many tokens attention reads.
#[derive(Clone, Copy, Debug)]
pub struct SeqRead<'a> {
    /// The reading request.
    pub request: RequestId,
    /// Its block table (page ids in token order; entries past `tokens` are not read).
    pub block_table: &'a [PageId],
    /// Tokens read: `0..tokens`.
    pub tokens: u64,
}

/// The verdict on a decode step: which sequences may not run attention.
#[derive(Debug, Default)]
pub struct StepVerdict {
    /// `(index into the step, violation)` for every refused sequence, in step order.
    pub refused: Vec<(usize, Violation)>,
}

impl StepVerdict {
    /// No sequence was refused.
    pub fn is_clean(&self) -> bool {
        self.refused.is_empty()
    }
}

/// Page counts by state, and a few totals; `free + owned + shared + reserved + retired +
/// awaiting_scrub == total_pages` always.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    /// Pages in the pool.
    pub total_pages: u64,
    /// Free pages.
    pub free: u64,
    /// Pages owned by one request.
    pub owned: u64,
    /// Pages in read-only prefixes (published, or shared by a fork).
    pub shared: u64,
    /// Reserved pages.
    pub reserved: u64,
    /// Pages retired because their generation reached the limit.
    pub retired: u64,
    /// Released pages waiting for a scrub confirmation.
    pub awaiting_scrub: u64,
    /// Admitted requests.
    pub requests: u64,
    /// Admitted requests that are quarantined.
    pub quarantined: u64,
    /// Live prefixes (named and fork-shared).
    pub prefixes: u64,
    /// Violations seen in all.
    pub violations: u64,
    /// Violations dropped from the log because nobody drained it.
    pub violations_dropped: u64,
    /// Released pages (counted in `free` or `awaiting_scrub`) that a transfer still lands in:
    /// not allocatable until its ticket ends.
    pub in_flight: u64,
}

/// What the table knows about one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageInfo {
    /// Where the page is in its life.
    pub state: PageState,
    /// Its current incarnation.
    pub generation: Generation,
    /// Owner (or prefix publisher) while owned or shared.
    pub owner: Option<RequestId>,
    /// The owner's tenant.
    pub tenant: Option<TenantId>,
    /// The prefix it belongs to, if published under a key.
    pub prefix: Option<PrefixKey>,
    /// Slots `0..written_prefix` are all written by the current incarnation.
    pub written_prefix: u32,
    /// Slots written by the current incarnation, in all.
    pub written_slots: u32,
    /// Shared pages only: a request of another tenant attached to the prefix (under its
    /// tenant's [cross-tenant grant](OwnershipTable::allow_cross_tenant_sharing)), so readers are
    /// not all of the prefix's tenant. Set by that attach, kept until the prefix goes; the device
    /// check, which cannot see holders, then lets any tenant read the page.
    #[serde(default)]
    pub shared_across_tenants: bool,
}

/// What the table knows about one admitted request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestInfo {
    /// Its tenant.
    pub tenant: TenantId,
    /// Prompt tokens it was admitted with.
    pub prompt_tokens: u64,
    /// New tokens it may generate.
    pub max_new_tokens: u64,
    /// Pages it owns exclusively, in no particular order.
    pub owned_pages: Vec<PageRef>,
    /// Named prefixes it holds.
    pub prefixes: Vec<PrefixKey>,
    /// Quarantined by an enforced violation.
    pub quarantined: bool,
}

impl OwnershipTable {
    /// A table for `config`, after the start-up [audit](PoolConfig::audit): a pool that cannot
    /// hold one max-context request is refused.
    pub fn new(config: PoolConfig) -> Result<OwnershipTable, Error> {
        config.audit()?;
        Self::new_unaudited(config)
    }

    /// A table for `config` without the capacity audit (it is still [validated](PoolConfig::validate)):
    /// for replaying what a mis-sized deployment did, where admission then refuses what cannot fit.
    pub fn new_unaudited(mut config: PoolConfig) -> Result<OwnershipTable, Error> {
        config.reserved.sort_unstable();
        config.reserved.dedup();
        config.validate()?;
        let state = TableState::new(&config)?;
        Ok(OwnershipTable {
            config,
            state: RwLock::new(state),
            counters: ViolationCounters::default(),
            log: Mutex::new(VecDeque::new()),
            log_dropped: AtomicU64::new(0),
        })
    }

    /// The pool configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Token slots per page.
    pub fn page_size(&self) -> u32 {
        self.config.page_size
    }

    /// Counts and logs a violation found outside the table (a transfer, a device check), and
    /// under [`Policy::Enforce`] quarantines the request it names.
    pub fn report(&self, violation: Violation) {
        let state = self.state.read();
        self.note(&state, &violation);
    }

    fn note(&self, state: &TableState, v: &Violation) {
        self.counters.record(v.kind());
        {
            let mut log = self.log.lock();
            if log.len() == VIOLATION_LOG_CAPACITY {
                log.pop_front();
                self.log_dropped.fetch_add(1, Ordering::Relaxed);
            }
            log.push_back(v.clone());
        }
        if self.config.policy == Policy::Enforce
            && let Some(rec) = v.request().and_then(|r| state.requests.get(&r))
        {
            rec.quarantined.store(true, Ordering::Relaxed);
        }
    }

    /// Applies the policy to a mutation's outcome: violations are counted, logged and (enforce)
    /// quarantine their request; the mutation is refused either way.
    fn judge<T>(&self, state: &TableState, outcome: Result<T, Error>) -> Result<T, Error> {
        if let Err(Error::Violation(v)) = &outcome {
            self.note(state, v);
        }
        outcome
    }

    fn judge_read(&self, state: &TableState, outcome: Result<(), Violation>) -> Result<(), Error> {
        match outcome {
            Ok(()) => Ok(()),
            Err(v) => {
                self.note(state, &v);
                match self.config.policy {
                    Policy::Enforce => Err(v.into()),
                    Policy::Report => Ok(()),
                }
            }
        }
    }

    /// Admits a request of `prompt_tokens` that may generate `max_new_tokens`.
    ///
    /// Refused before any page is touched — never truncated, never substituted — when the total
    /// exceeds the max context ([`ViolationKind::ExceedsMaxContext`]) or needs more pages than the
    /// pool can ever give ([`ViolationKind::ExceedsPool`]); a live id is
    /// [`ViolationKind::DuplicateRequest`] (and under enforce the live request is quarantined: two
    /// requests under one id cannot be told apart).
    pub fn admit(
        &self,
        req: RequestId,
        tenant: TenantId,
        prompt_tokens: u64,
        max_new_tokens: u64,
    ) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.admit(req, tenant, prompt_tokens, max_new_tokens);
        self.judge(&state, outcome)
    }

    /// Allocator mode: hands `n` free pages to `req`, appended to its pages, or none at all with
    /// [`Error::OutOfPages`].
    pub fn allocate(&self, req: RequestId, n: u32) -> Result<Vec<PageRef>, Error> {
        let mut out = Vec::new();
        self.allocate_into(req, n, &mut out)?;
        Ok(out)
    }

    /// [`allocate`](Self::allocate) into a caller's buffer (appends; no allocation when it has room).
    pub fn allocate_into(&self, req: RequestId, n: u32, out: &mut Vec<PageRef>) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.allocate_into(req, n, out);
        self.judge(&state, outcome)
    }

    /// Shadow mode: the engine's allocator gave `pages` to `req`. All must be free (else
    /// [`ViolationKind::PageNotFree`], [`ViolationKind::ReservedPage`] or
    /// [`ViolationKind::PageOutOfRange`]), and then all are claimed; otherwise none is.
    pub fn claim(&self, req: RequestId, pages: &[PageId]) -> Result<Vec<PageRef>, Error> {
        let mut state = self.state.write();
        let outcome = state.claim(req, pages);
        self.judge(&state, outcome)
    }

    /// Records that `req`'s KV store wrote `slots` of `page`, which it must own exclusively.
    pub fn record_write(&self, req: RequestId, page: PageId, slots: Range<u32>) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.record_write(req, page, slots);
        self.judge(&state, outcome)
    }

    /// Records that `req` wrote tokens `tokens` of its sequence through `block_table` (token `t`
    /// lives in block `t / page_size`, slot `t % page_size`). Every page must be `req`'s own;
    /// otherwise nothing is recorded.
    pub fn record_write_tokens(&self, req: RequestId, block_table: &[PageId], tokens: Range<u64>) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.record_write_tokens(Op::Write, req, block_table, tokens);
        self.judge(&state, outcome)
    }

    /// Records a KV transfer that wrote `tokens` tokens into `req`'s pages from the first slot of
    /// the first page, when `req` expected `expected` tokens. A count that differs is
    /// [`ViolationKind::TokenCountMismatch`] and nothing is recorded as written.
    pub fn record_import(
        &self,
        req: RequestId,
        block_table: &[PageId],
        tokens: u64,
        expected: u64,
    ) -> Result<(), Error> {
        self.import(req, block_table, tokens, expected)
    }

    /// [`record_import`](Self::record_import) through page refs: a transfer landing after its
    /// pages were released (and maybe reused) is [`ViolationKind::StalePage`] or
    /// [`ViolationKind::ForeignPage`], and nothing is recorded.
    pub fn record_import_refs(
        &self,
        req: RequestId,
        block_table: &[PageRef],
        tokens: u64,
        expected: u64,
    ) -> Result<(), Error> {
        self.import(req, block_table, tokens, expected)
    }

    fn import<E: BlockEntry>(
        &self,
        req: RequestId,
        block_table: &[E],
        tokens: u64,
        expected: u64,
    ) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = import(&mut state, req, block_table, tokens, expected);
        self.judge(&state, outcome)
    }

    /// Starts a KV transfer into `refs`: each must be `req`'s own page in exactly that
    /// incarnation, and not already receiving another transfer
    /// ([`ViolationKind::ImportInFlight`]). The pages are *pinned* while the returned ticket
    /// lives: if `req` releases them before the transfer is over, they still leave `req`, but
    /// stay out of the free list (and cannot be confirmed scrubbed) until the ticket is finished,
    /// aborted or dropped, so bytes still landing can never reach a next owner. Call it before
    /// any byte lands.
    ///
    /// ```
    /// use kvguard::{OwnershipTable, PoolConfig, RequestId, TenantId, ViolationKind};
    /// let table = OwnershipTable::new(PoolConfig::new(8, 16, 64))?;
    /// table.admit(RequestId(1), TenantId(1), 20, 0)?;
    /// let refs = table.allocate(RequestId(1), 2)?;
    /// let ticket = table.begin_import(RequestId(1), &refs)?;
    /// // ... the transfer's bytes land in the pages, its manifest is checked ...
    /// ticket.finish(20, 20)?;
    /// let pages: Vec<_> = refs.iter().map(|r| r.page).collect();
    /// table.verify_read(RequestId(1), &pages, 20)?;
    /// # Ok::<(), kvguard::Error>(())
    /// ```
    pub fn begin_import(&self, req: RequestId, refs: &[PageRef]) -> Result<ImportTicket<'_>, Error> {
        let mut state = self.state.write();
        let outcome = state.pin(req, refs);
        let id = self.judge(&state, outcome)?;
        Ok(ImportTicket { table: self, id, request: req, refs: refs.to_vec(), ended: false })
    }

    /// Checks that `req` may read its first `tokens` tokens through `block_table`: every page is
    /// its own (or a prefix it holds) and every slot read was written by the page's current
    /// incarnation. Enforce: a violation is returned and `req` quarantined. Report: counted,
    /// logged, `Ok`.
    pub fn verify_read(&self, req: RequestId, block_table: &[PageId], tokens: u64) -> Result<(), Error> {
        let state = self.state.read();
        let outcome = state.check_read(req, block_table, tokens);
        self.judge_read(&state, outcome)
    }

    /// [`verify_read`](Self::verify_read) through page refs: each page must also still be in the
    /// incarnation the ref names ([`ViolationKind::StalePage`]).
    pub fn verify_read_refs(&self, req: RequestId, block_table: &[PageRef], tokens: u64) -> Result<(), Error> {
        let state = self.state.read();
        let outcome = state.check_read(req, block_table, tokens);
        self.judge_read(&state, outcome)
    }

    /// Verifies a whole decode step under one read lock. Every refused sequence is listed (and,
    /// under enforce, quarantined); under report the verdict lists them too, but nothing is refused
    /// in the engine's name — it decides.
    pub fn verify_step(&self, reads: &[SeqRead<'_>]) -> StepVerdict {
        let state = self.state.read();
        let mut verdict = StepVerdict::default();
        for (i, read) in reads.iter().enumerate() {
            if let Err(v) = state.check_read(read.request, read.block_table, read.tokens) {
                self.note(&state, &v);
                verdict.refused.push((i, v));
            }
        }
        verdict
    }

    /// Checks a read like [`verify_read`](Self::verify_read) without counting, logging or
    /// quarantining anything: a pure question.
    pub fn check_read(&self, req: RequestId, block_table: &[PageId], tokens: u64) -> Result<(), Violation> {
        self.state.read().check_read(req, block_table, tokens)
    }

    /// Ends `req`: all its pages are released (generation bumped), its prefix holds dropped, and
    /// its quarantine lifted. Releasing it again is [`ViolationKind::DoubleFree`] (for the last
    /// 65,536 ended requests; older ids read as [`ViolationKind::UnknownRequest`]).
    pub fn release(&self, req: RequestId) -> Result<Released, Error> {
        let mut state = self.state.write();
        let outcome = state.release(req);
        self.judge(&state, outcome)
    }

    /// Releases some of `req`'s pages (sliding window, partial eviction); all or none.
    pub fn release_pages(&self, req: RequestId, pages: &[PageId]) -> Result<Released, Error> {
        let mut state = self.state.write();
        let outcome = state.release_pages(req, pages);
        self.judge(&state, outcome)
    }

    /// Preemption: releases all of `req`'s pages and prefix holds but keeps it admitted, so the
    /// engine can allocate again and recompute. A quarantine stays until the request is released.
    pub fn preempt(&self, req: RequestId) -> Result<Released, Error> {
        let mut state = self.state.write();
        let outcome = state.preempt(req);
        self.judge(&state, outcome)
    }

    /// With `scrub_on_release`: the engine poisoned or zeroed these released pages; they return
    /// to the free list. Each must be awaiting a scrub in exactly the incarnation released.
    pub fn confirm_scrubbed(&self, pages: &[PageRef]) -> Result<(), Error> {
        self.state.write().confirm_scrubbed(pages)
    }

    /// Publishes `pages` of `req` (all its own) as the read-only prefix `key`; `req` holds it.
    pub fn publish_prefix(&self, req: RequestId, key: PrefixKey, pages: &[PageId]) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.publish(req, key, pages);
        self.judge(&state, outcome)
    }

    /// `req` holds prefix `key` and may read its pages (returned in published order). Another
    /// tenant's prefix is [`ViolationKind::CrossTenantShare`] unless that tenant
    /// [allows sharing](Self::allow_cross_tenant_sharing).
    pub fn attach_prefix(&self, req: RequestId, key: PrefixKey) -> Result<Vec<PageRef>, Error> {
        let mut state = self.state.write();
        let outcome = state.attach(req, key);
        self.judge(&state, outcome)
    }

    /// `req` lets go of prefix `key`.
    pub fn detach_prefix(&self, req: RequestId, key: PrefixKey) -> Result<Released, Error> {
        let mut state = self.state.write();
        let outcome = state.detach(req, key);
        self.judge(&state, outcome)
    }

    /// The cache drops prefix `key`; its pages are released. Refused with
    /// [`ViolationKind::EvictInUse`] while any request holds it.
    pub fn evict_prefix(&self, key: PrefixKey) -> Result<Released, Error> {
        let mut state = self.state.write();
        let outcome = state.evict(key);
        self.judge(&state, outcome)
    }

    /// Lets other tenants attach to `tenant`'s prefixes (off by default).
    pub fn allow_cross_tenant_sharing(&self, tenant: TenantId, allow: bool) {
        let mut state = self.state.write();
        if allow {
            state.sharing_tenants.insert(tenant);
        } else {
            state.sharing_tenants.remove(&tenant);
        }
    }

    /// Parallel sampling: `child` is admitted for the same tenant holding `parent`'s pages
    /// read-only (they become shared; writes to them are refused, copy-on-write is the engine's
    /// move). The pages stay allocated until both have released them.
    ///
    /// A quarantined parent cannot fork ([`ViolationKind::Quarantined`]). A `child` id that is
    /// already live is [`ViolationKind::DuplicateRequest`] charged to the parent, whose call it
    /// was; unlike a duplicate [`admit`](Self::admit), the live request keeps running, since
    /// nothing was admitted under its id.
    pub fn fork(&self, parent: RequestId, child: RequestId) -> Result<(), Error> {
        let mut state = self.state.write();
        let outcome = state.fork(parent, child);
        self.judge(&state, outcome)
    }

    /// Page counts by state and other totals.
    pub fn snapshot(&self) -> PoolSnapshot {
        let state = self.state.read();
        let c = &state.state_counts;
        PoolSnapshot {
            total_pages: u64::from(self.config.num_pages),
            free: c[PageState::Free as usize],
            owned: c[PageState::Owned as usize],
            shared: c[PageState::Shared as usize],
            reserved: c[PageState::Reserved as usize],
            retired: c[PageState::Retired as usize],
            awaiting_scrub: c[PageState::AwaitingScrub as usize],
            requests: state.requests.len() as u64,
            quarantined: state.requests.values().filter(|r| r.quarantined.load(Ordering::Relaxed)).count() as u64,
            prefixes: state.prefixes.iter().filter(|p| p.is_some()).count() as u64,
            violations: self.counters.total(),
            violations_dropped: self.log_dropped.load(Ordering::Relaxed),
            in_flight: state
                .pins
                .keys()
                .filter(|p| matches!(state.tags[p.0 as usize].state, PageState::Free | PageState::AwaitingScrub))
                .count() as u64,
        }
    }

    /// What the table knows of `page`, or `None` beyond the pool.
    pub fn page_info(&self, page: PageId) -> Option<PageInfo> {
        let state = self.state.read();
        Some(page_info(&state, page, state.tag(page)?))
    }

    /// What the table knows of `req`, or `None` if it is not admitted.
    pub fn request_info(&self, req: RequestId) -> Option<RequestInfo> {
        let state = self.state.read();
        let rec = state.requests.get(&req)?;
        Some(RequestInfo {
            tenant: rec.tenant,
            prompt_tokens: rec.prompt_tokens,
            max_new_tokens: rec.max_new_tokens,
            owned_pages: rec.pages.iter().map(|&p| state.page_ref(p)).collect(),
            prefixes: rec.prefixes.iter().filter_map(|s| state.prefix(s).key).collect(),
            quarantined: rec.quarantined.load(Ordering::Relaxed),
        })
    }

    /// The pages whose tags changed since the last call, with their tags now: what a device
    /// mirror must copy (each page listed once however often it changed).
    ///
    /// Changes are tracked only once a mirror asks: the first call returns every page of the
    /// pool (the mirror has none yet), and a table nobody mirrors never pays for the list.
    pub fn take_changed_pages(&self) -> Vec<(PageId, PageInfo)> {
        let mut state = self.state.write();
        let changed = state.take_changed();
        changed.into_iter().map(|p| (p, page_info(&state, p, &state.tags[p.0 as usize]))).collect()
    }

    /// Violation counts per kind.
    pub fn counters(&self) -> &ViolationCounters {
        &self.counters
    }

    /// Takes the logged violations, oldest first (at most [`VIOLATION_LOG_CAPACITY`]).
    pub fn drain_violations(&self) -> Vec<Violation> {
        self.log.lock().drain(..).collect()
    }
}

fn import<E: BlockEntry>(
    state: &mut TableState,
    req: RequestId,
    block_table: &[E],
    tokens: u64,
    expected: u64,
) -> Result<(), Error> {
    if tokens != expected {
        state.record(Op::Import, req)?;
        let v = state.violation(ViolationKind::TokenCountMismatch, Op::Import, req).with_amounts(tokens, expected);
        return Err(v.into());
    }
    state.record_write_tokens(Op::Import, req, block_table, 0..tokens)
}

fn page_info(state: &TableState, page: PageId, tag: &state::PageTag) -> PageInfo {
    let live = matches!(tag.state, PageState::Owned | PageState::Shared);
    PageInfo {
        state: tag.state,
        generation: Generation(tag.generation),
        owner: live.then_some(tag.owner),
        tenant: state.page_tenant(tag),
        prefix: (tag.state == PageState::Shared).then(|| state.prefix(tag.link).key).flatten(),
        written_prefix: tag.written,
        written_slots: state.written_slots(page),
        shared_across_tenants: tag.state == PageState::Shared && state.prefix(tag.link).cross_tenant,
    }
}

impl std::fmt::Debug for OwnershipTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnershipTable").field("config", &self.config).field("snapshot", &self.snapshot()).finish()
    }
}
