//! KV transfers landing in the table: what a transfer wrote ([`OwnershipTable::record_import`])
//! and the transfer in flight, its pages pinned until its ticket ends ([`ImportTicket`]).

use super::info::PageState;
use super::ownership::OwnershipTable;
use super::state::{BlockEntry, TableState};
use crate::error::Error;
use crate::ids::{PageId, PageRef, RequestId};
use crate::violation::{Op, Violation, ViolationKind};

impl OwnershipTable {
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
        self.mutate(|state| import(state, req, block_table, tokens, expected))
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
        self.mutate(|state| import(state, req, block_table, tokens, expected))
    }

    /// Records that a transfer into `req`'s offered pages also wrote `pages`, which it did not offer
    /// (a push whose notice named more pages than were pinned: a one-sided WRITE can land
    /// anywhere in the registered pool). Each such page that is held (owned, or shared in a
    /// prefix) loses the coverage of its current incarnation, so its holders' reads of the
    /// overwritten slots are refused as unwritten until they are written again, and every page
    /// named is recorded as a [`ViolationKind::TransferPagesMismatch`] by `req` naming the page
    /// and its owner: never silent. The owners are not quarantined (they did nothing); `req`
    /// is, under enforce (its transfer is refused anyway). Page ids past the pool are skipped, a
    /// page named twice counts once. Returns the violations recorded.
    pub fn record_overwritten(&self, req: RequestId, pages: &[PageId]) -> Vec<Violation> {
        let mut state = self.state.write();
        let mut found = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(pages.len());
        for &page in pages {
            let Some(tag) = state.tag(page) else { continue };
            if !seen.insert(page) {
                continue;
            }
            let v = state.page_violation(ViolationKind::TransferPagesMismatch, Op::Import, req, page);
            if matches!(tag.state(), PageState::Owned | PageState::Shared) {
                state.revoke_coverage(page);
            }
            self.note(&state, &v);
            found.push(v);
        }
        found
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
        let id = self.mutate(|state| state.pin(req, refs))?;
        Ok(ImportTicket { table: self, id, request: req, refs: refs.to_vec(), ended: false })
    }
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
        let (id, request, refs) = (self.id, self.request, std::mem::take(&mut self.refs));
        self.table.mutate(|state| {
            let outcome = import(state, request, &refs, tokens, expected);
            state.unpin(id, &refs);
            outcome
        })
    }

    /// Abandons the transfer because landing its bytes failed at entry `index` (the copy
    /// returned an error, raised or panicked): bytes may have landed in any of its pages, so
    /// every page still the request's in the pinned incarnation loses its coverage (reads of it
    /// are refused as unwritten until the request writes it again), nothing is recorded as
    /// written, the pages are unpinned, and a [`ViolationKind::LandingFailed`] naming the page at
    /// `index` is recorded, all in one critical section. That kind does not quarantine the
    /// request: the failure is the receiver's copy, not anything the request did. Returns the
    /// violation.
    ///
    /// ```
    /// use kvguard::{OwnershipTable, PoolConfig, RequestId, TenantId, ViolationKind};
    /// let table = OwnershipTable::new(PoolConfig::new(8, 16, 64))?;
    /// table.admit(RequestId(1), TenantId(1), 20, 0)?;
    /// let refs = table.allocate(RequestId(1), 2)?;
    /// let ticket = table.begin_import(RequestId(1), &refs)?;
    /// // ... the copy of the second page fails ...
    /// let v = ticket.fail(1);
    /// assert_eq!((v.kind(), v.page()), (ViolationKind::LandingFailed, Some(refs[1].page)));
    /// let pages: Vec<_> = refs.iter().map(|r| r.page).collect();
    /// let refused = table.verify_read(RequestId(1), &pages, 20).unwrap_err();
    /// assert_eq!(refused.violation_kind(), Some(ViolationKind::UnwrittenSlots));
    /// # Ok::<(), kvguard::Error>(())
    /// ```
    pub fn fail(mut self, index: usize) -> Violation {
        self.ended = true;
        let (id, request, refs) = (self.id, self.request, std::mem::take(&mut self.refs));
        let mut state = self.table.state.write();
        for r in &refs {
            if state.tag(r.page).is_some_and(|t| t.owned_by(request) && t.generation() == r.generation.0) {
                state.revoke_coverage(r.page);
            }
        }
        state.unpin(id, &refs);
        let v = match refs.get(index) {
            Some(r) => state
                .page_violation(ViolationKind::LandingFailed, Op::Import, request, r.page)
                .with_block_index(index as u32),
            None => state.violation(ViolationKind::LandingFailed, Op::Import, request),
        };
        self.table.note(&state, &v);
        v
    }

    /// Ends the transfer with its pages still pinned, because bytes may still land in them (a
    /// one-sided WRITE decode gave up waiting for): nothing is recorded as written, and the pages
    /// stay out of circulation, released or not (never handed to another request, never
    /// confirmed scrubbed), until [`OwnershipTable::lift_fence`] says the sender is done. Pages a
    /// fence holds cannot take another transfer either ([`ViolationKind::ImportInFlight`]).
    pub fn fence(mut self) -> Fence {
        self.ended = true;
        Fence { table: self.table.id(), id: self.id, request: self.request, refs: std::mem::take(&mut self.refs) }
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

/// Pages kept pinned after their transfer ended ([`ImportTicket::fence`]) until the sender is
/// known to be done with them; [`OwnershipTable::lift_fence`] ends it. Dropping a fence keeps
/// the pages out of circulation for good (fail closed: capacity lost, never data).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a fence dropped keeps its pages out of circulation for good: lift it"]
pub struct Fence {
    /// The table its pins are in ([`OwnershipTable::id`]).
    table: u64,
    id: u64,
    request: RequestId,
    refs: Vec<PageRef>,
}

impl Fence {
    /// The request whose transfer it was.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The pages it holds, in the incarnations pinned.
    pub fn pages(&self) -> &[PageRef] {
        &self.refs
    }

    /// Whether its pins are in `table`.
    pub fn is_in(&self, table: &OwnershipTable) -> bool {
        self.table == table.id()
    }
}

impl OwnershipTable {
    /// Lifts `fence`: the sender is done with its pages (its late notice came, or it is known
    /// dead), and the caller has zeroed them. Each page still the request's in the pinned
    /// incarnation loses its coverage (bytes landed there after the request's own writes), and
    /// the pages are unpinned: a released one joins the free list (or awaits its scrub). A fence
    /// of another table is handed back untouched.
    pub fn lift_fence(&self, fence: Fence) -> Result<(), Fence> {
        if !fence.is_in(self) {
            return Err(fence);
        }
        let mut state = self.state.write();
        for r in &fence.refs {
            if state.tag(r.page).is_some_and(|t| t.owned_by(fence.request) && t.generation() == r.generation.0) {
                state.revoke_coverage(r.page);
            }
        }
        state.unpin(fence.id, &fence.refs);
        Ok(())
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

/// A transfer's tokens, recorded as written from the first slot of the first page if the count
/// is the one expected.
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
