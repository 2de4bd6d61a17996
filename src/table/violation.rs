//! Violations as the table finds them: filled in with what it knows of the request and the page,
//! and the ownership checks every mutation makes before it changes anything.

use super::info::PageState;
use super::state::{BlockEntry, RequestRecord, TableState};
use crate::error::Error;
use crate::ids::{Generation, PageId, RequestId};
use crate::violation::{Op, Violation, ViolationKind};

impl TableState {
    /// A violation by `req`, with its tenant if it is admitted.
    pub(crate) fn violation(&self, kind: ViolationKind, op: Op, req: RequestId) -> Violation {
        let tenant = self.requests.get(&req).map(|r| r.tenant);
        Violation::new(kind, op).with_request(req, tenant)
    }

    /// A violation about `page`, filled in with what the table knows of it.
    pub(crate) fn page_violation(&self, kind: ViolationKind, op: Op, req: RequestId, page: PageId) -> Violation {
        let mut v = self.violation(kind, op, req);
        match self.tag(page) {
            None => v = v.with_page(page, None),
            Some(tag) => {
                v = v.with_page(page, Some(Generation(tag.generation())));
                match tag.state() {
                    PageState::Owned => {
                        if let Some(tenant) = self.page_tenant(tag) {
                            v = v.with_owner(tag.owner(), tenant);
                        }
                    }
                    PageState::Shared => {
                        if let Some(prefix) = self.prefixes.get(tag.prefix()) {
                            v = v.with_owner(prefix.publisher, prefix.tenant);
                            if let Some(key) = prefix.key {
                                v = v.with_prefix(key);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        v
    }

    /// `req` is not admitted: [`ViolationKind::DoubleFree`] for a release of a recently ended
    /// request, [`ViolationKind::UnknownRequest`] otherwise.
    pub(crate) fn unknown_request(&self, op: Op, req: RequestId) -> Error {
        let kind = if op == Op::Release && self.ended.contains(req) {
            ViolationKind::DoubleFree
        } else {
            ViolationKind::UnknownRequest
        };
        Violation::new(kind, op).with_request(req, None).into()
    }

    /// The record of an admitted request, or the violation of naming one that is not.
    pub(crate) fn record(&self, op: Op, req: RequestId) -> Result<&RequestRecord, Error> {
        self.requests.get(&req).ok_or_else(|| self.unknown_request(op, req))
    }

    /// The page exists and is not reserved.
    pub(crate) fn check_usable(&self, op: Op, req: RequestId, page: PageId) -> Result<PageState, Error> {
        match self.tag(page) {
            None => Err(self.page_violation(ViolationKind::PageOutOfRange, op, req, page).into()),
            Some(t) if t.state() == PageState::Reserved => {
                Err(self.page_violation(ViolationKind::ReservedPage, op, req, page).into())
            }
            Some(t) => Ok(t.state()),
        }
    }

    /// The page is owned exclusively by `req` (for writes, releases, publishing).
    pub(crate) fn check_owned_by(&self, op: Op, req: RequestId, page: PageId) -> Result<(), Error> {
        let state = self.check_usable(op, req, page)?;
        let tag = &self.tags[page.0 as usize];
        let kind = match state {
            PageState::Owned if tag.owned_by(req) => return Ok(()),
            PageState::Owned => ViolationKind::ForeignPage,
            PageState::Shared => {
                let held = self.requests.get(&req).is_some_and(|r| r.prefixes.contains(tag.prefix()));
                match op {
                    Op::Write | Op::Import => ViolationKind::WriteToShared,
                    _ if held => ViolationKind::PageShared,
                    _ => ViolationKind::ForeignPage,
                }
            }
            _ if op == Op::Release => ViolationKind::DoubleFree,
            _ => ViolationKind::FreedPage,
        };
        Err(self.page_violation(kind, op, req, page).into())
    }

    /// Every entry is `req`'s own page, in the incarnation it names (if it names one).
    pub(crate) fn check_entries_owned<E: BlockEntry>(
        &self,
        op: Op,
        req: RequestId,
        entries: &[E],
    ) -> Result<(), Error> {
        for (b, &entry) in entries.iter().enumerate() {
            let fine = self
                .tag(entry.page())
                .is_some_and(|t| t.owned_by(req) && entry.generation().is_none_or(|g| g.0 == t.generation()));
            if !fine {
                return Err(self.write_refusal(op, req, b, entry));
            }
        }
        Ok(())
    }

    /// Why `req` may not write (or release, or publish) through block `b`.
    #[cold]
    pub(crate) fn write_refusal<E: BlockEntry>(&self, op: Op, req: RequestId, b: usize, entry: E) -> Error {
        let page = entry.page();
        let v = match self.check_owned_by(op, req, page) {
            Err(Error::Violation(v)) => v,
            Err(other) => return other,
            Ok(()) => {
                let g = entry.generation().unwrap_or(Generation(0));
                self.page_violation(ViolationKind::StalePage, op, req, page).with_expected_generation(g)
            }
        };
        v.with_block_index(b as u32).into()
    }
}
