//! Forced transitions: what an engine did although the table refused it, for replay that
//! follows the engine (`kvguard replay` judges each event, then applies it as the engine did).
//!
//! None of these judge, count or log anything: the caller has judged the call already (and
//! recorded its violation); they only bring the table to the state the engine is in now, so the
//! events after it are judged against the truth. An engine embedding the table never needs them.

use super::info::{PageState, Released};
use super::ownership::OwnershipTable;
use super::state::{RequestRecord, TableState};
use crate::ids::{PageId, PrefixKey, RequestId, TenantId};
use std::sync::atomic::AtomicBool;

impl OwnershipTable {
    /// The engine admitted `req` although [`admit`](Self::admit) refused it for its size (beyond
    /// the max context, or the pool): `req` is admitted as asked. Returns false, changing nothing,
    /// if `req` is live already (two requests under one id cannot be told apart).
    pub fn force_admit(&self, req: RequestId, tenant: TenantId, prompt_tokens: u64, max_new_tokens: u64) -> bool {
        let mut state = self.state.write();
        if state.requests.contains_key(&req) {
            return false;
        }
        state.ended.forget(req);
        let pages = state.spare_page_lists.pop().unwrap_or_default();
        let slot = state.take_request_slot(req);
        let pages_marked = state.takes;
        state.requests.insert(
            req,
            RequestRecord {
                slot,
                tenant,
                prompt_tokens,
                max_new_tokens,
                pages,
                prefixes: Default::default(),
                quarantined: AtomicBool::new(false),
                pages_marked,
            },
        );
        true
    }

    /// The engine handed `pages` to `req` although [`claim`](Self::claim) refused some of them:
    /// each page now belongs to `req`. A free page (or one awaiting a scrub) is claimed; a page
    /// another request owns, or that a prefix or fork shares, is taken from it — its incarnation
    /// ends (coverage cleared, generation bumped) and a new one starts as `req`'s, so its former
    /// holders' later reads of it are foreign. Pages out of range, reserved, retired, pinned by
    /// a transfer, already `req`'s or listed twice are left as they are. Returns how many pages
    /// changed hands; nothing happens (0) if `req` is not admitted.
    pub fn force_claim(&self, req: RequestId, pages: &[PageId]) -> usize {
        let mut state = self.state.write();
        if !state.requests.contains_key(&req) {
            return 0;
        }
        let mut moved = 0;
        for &page in pages {
            let Some(tag) = state.tag(page) else { continue };
            if tag.pinned() || tag.owned_by(req) {
                continue;
            }
            match tag.state() {
                PageState::Owned | PageState::Shared => state.take_from_holder(page),
                PageState::AwaitingScrub => state.push_free(page),
                PageState::Free | PageState::Reserved | PageState::Retired => {}
            }
            let tag = &state.tags[page.0 as usize];
            if tag.state() == PageState::Free && !tag.pinned() && state.take_free_page(page, req) {
                moved += 1;
            }
        }
        moved
    }

    /// The engine put `pages` back in its free pool whoever held them (a `free` of pages that
    /// were another request's, or a prefix's): each owned or shared page leaves its holder and
    /// its incarnation ends. Other pages are left as they are. Returns how many were released.
    pub fn force_release_pages(&self, pages: &[PageId]) -> usize {
        let mut state = self.state.write();
        let mut released = 0;
        for &page in pages {
            if state.tag(page).is_some_and(|t| matches!(t.state(), PageState::Owned | PageState::Shared)) {
                state.take_from_holder(page);
                released += 1;
            }
        }
        released
    }

    /// The engine dropped prefix `key` although requests still held it: every hold ends, the
    /// key is unpublished and the pages are released, so the former holders' later reads of
    /// them are refused. Returns false if `key` is not published.
    pub fn force_evict_prefix(&self, key: PrefixKey) -> bool {
        let mut state = self.state.write();
        let Some(slot) = state.prefix_keys.get(&key).copied().filter(|&s| state.prefixes.contains_key(s)) else {
            return false;
        };
        for rec in state.requests.values_mut() {
            rec.prefixes.remove(slot);
        }
        // Its holders lose it: every reader of shared pages checks afresh.
        state.shared_epoch = state.tick();
        state.prefixes[slot].holders = 0;
        state.drop_prefix(slot, &mut Released::default());
        true
    }
}

impl TableState {
    /// Takes an owned or shared page from its owner or prefix and ends its incarnation (it joins
    /// the free list, or awaits a scrub, or retires).
    fn take_from_holder(&mut self, page: PageId) {
        let tag = self.tags[page.0 as usize];
        match tag.state() {
            PageState::Owned => self.detach_from_owner(page),
            PageState::Shared => {
                if let Some(prefix) = self.prefixes.get_mut(tag.prefix())
                    && let Some(at) = prefix.pages.iter().position(|&p| p == page)
                {
                    prefix.pages.remove(at);
                }
            }
            _ => return,
        }
        self.end_incarnations(&[page], tag.state(), false, &mut Released::default());
    }
}
