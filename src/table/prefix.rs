//! Prefixes: pages published read-only under a key and held by the requests that reuse them.
//!
//! A fork is a prefix too: the parent's pages become an anonymous prefix held by parent and child,
//! which goes back to the pool when its last holder is released.

use super::info::{PageState, Released};
use super::state::{PrefixRecord, PrefixSlot, TableState};
use crate::error::Error;
use crate::ids::{PageId, PageRef, PrefixKey, RequestId};
use crate::violation::{Op, Violation, ViolationKind};

impl TableState {
    /// Frees a prefix's pages and its slot (whose version moves on, so old handles stop matching).
    pub(crate) fn drop_prefix(&mut self, slot: PrefixSlot, released: &mut Released) {
        let Some(record) = self.prefixes.remove(slot) else {
            debug_assert!(false, "dropping a prefix that is gone");
            return;
        };
        if let Some(key) = record.key {
            self.prefix_keys.remove(&key);
        }
        self.end_incarnations(&record.pages, PageState::Shared, false, released);
    }

    /// One holder lets go; an anonymous (fork) prefix goes with its last holder. A handle to a
    /// prefix that is gone changes nothing.
    pub(crate) fn drop_hold(&mut self, slot: PrefixSlot, released: &mut Released) {
        let Some(prefix) = self.prefixes.get_mut(slot) else {
            debug_assert!(false, "a request held a prefix that is gone");
            return;
        };
        prefix.holders -= 1;
        if prefix.holders == 0 && prefix.key.is_none() {
            self.drop_prefix(slot, released);
        }
    }

    /// The live prefix published under `key`.
    fn prefix_slot(&self, op: Op, req: Option<RequestId>, key: PrefixKey) -> Result<PrefixSlot, Error> {
        let live = self.prefix_keys.get(&key).copied().filter(|&slot| self.prefixes.contains_key(slot));
        live.ok_or_else(|| {
            let mut v = Violation::new(ViolationKind::UnknownPrefix, op).with_prefix(key);
            if let Some(r) = req {
                v = v.with_request(r, self.requests.get(&r).map(|r| r.tenant));
            }
            v.into()
        })
    }

    pub(crate) fn publish(&mut self, req: RequestId, key: PrefixKey, pages: &[PageId]) -> Result<(), Error> {
        let tenant = self.record(Op::Publish, req)?.tenant;
        if self.prefix_keys.contains_key(&key) {
            return Err(self.violation(ViolationKind::DuplicatePrefix, Op::Publish, req).with_prefix(key).into());
        }
        for &page in pages {
            self.check_owned_by(Op::Publish, req, page)?;
        }
        let slot = self.prefixes.insert(PrefixRecord {
            key: Some(key),
            tenant,
            publisher: req,
            pages: Vec::new(),
            holders: 1,
            cross_tenant: false,
        });
        // The caller's order, for `attach` to hand back; a page listed twice is published once
        // (the second time round it is already shared).
        let mut ordered = Vec::with_capacity(pages.len());
        for &page in pages {
            if self.tags[page.0 as usize].state() == PageState::Owned {
                self.detach_from_owner(page);
                self.share_page(page, slot);
                ordered.push(page);
            }
        }
        self.prefixes[slot].pages = ordered;
        self.prefix_keys.insert(key, slot);
        self.requests.get_mut(&req).expect("checked above").prefixes.insert(slot);
        Ok(())
    }

    pub(crate) fn attach(&mut self, req: RequestId, key: PrefixKey) -> Result<Vec<PageRef>, Error> {
        let tenant = self.record(Op::Attach, req)?.tenant;
        let slot = self.prefix_slot(Op::Attach, Some(req), key)?;
        let prefix = &self.prefixes[slot];
        if prefix.tenant != tenant && !self.sharing_tenants.contains(&prefix.tenant) {
            let v = self
                .violation(ViolationKind::CrossTenantShare, Op::Attach, req)
                .with_owner(prefix.publisher, prefix.tenant)
                .with_prefix(key);
            return Err(v.into());
        }
        let rec = self.requests.get_mut(&req).expect("checked above");
        if rec.prefixes.insert(slot) {
            self.prefixes[slot].holders += 1;
        }
        let prefix = &mut self.prefixes[slot];
        if prefix.tenant != tenant && !prefix.cross_tenant {
            // The device mirror must learn that another tenant now reads these pages.
            prefix.cross_tenant = true;
            for i in 0..self.prefixes[slot].pages.len() {
                let page = self.prefixes[slot].pages[i];
                self.mark_changed(page);
            }
        }
        Ok(self.prefixes[slot].pages.iter().map(|&p| self.page_ref(p)).collect())
    }

    pub(crate) fn detach(&mut self, req: RequestId, key: PrefixKey) -> Result<Released, Error> {
        self.record(Op::Detach, req)?;
        let slot = self.prefix_slot(Op::Detach, Some(req), key)?;
        let rec = self.requests.get_mut(&req).expect("checked above");
        if !rec.prefixes.remove(slot) {
            return Err(self.violation(ViolationKind::UnknownPrefix, Op::Detach, req).with_prefix(key).into());
        }
        self.taking_from(req);
        let mut released = Released::default();
        self.drop_hold(slot, &mut released);
        Ok(released)
    }

    pub(crate) fn evict(&mut self, key: PrefixKey) -> Result<Released, Error> {
        let slot = self.prefix_slot(Op::Evict, None, key)?;
        let prefix = &self.prefixes[slot];
        if prefix.holders > 0 {
            let v = Violation::new(ViolationKind::EvictInUse, Op::Evict)
                .with_owner(prefix.publisher, prefix.tenant)
                .with_prefix(key)
                .with_amounts(u64::from(prefix.holders), 0);
            return Err(v.into());
        }
        let mut released = Released::default();
        self.drop_prefix(slot, &mut released);
        Ok(released)
    }
}
