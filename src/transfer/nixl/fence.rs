//! Decode's fences: the pages of a transfer decode gave up on that may still land (a push's late
//! WRITEs, a READ that outlived its wait) stay pinned until the transfer is proven over, the
//! region it lands in kept alive meanwhile; and the pulls it gave up on, whose late `Staged` is
//! answered without a READ.

use super::held::leak;
use super::link::{Fenced, ReadFence, footprint};
use super::{Direction, KeepAlive, NixlError, NixlLink, Notice, NoticeKind, PageRegion};
use crate::ids::{PageRef, RequestId};
use crate::transfer::{Manifest, PinnedImport};
use crate::{Fence, OwnershipTable};

/// Pulls that timed out, remembered so that their late `Staged` notice is answered and set
/// aside rather than taken for a retry's; past this, the oldest are forgotten.
const ABANDONED_CAP: usize = 256;

impl NixlLink<'_> {
    /// Decode: gives up on `pinned` without a [`receive`](Self::receive) (the request ended
    /// while its transfer was offered). A push (`Direction::Write`) may still WRITE the offered
    /// pages at any time: they are fenced, as for a push that timed out (lifted by its late
    /// `Written` in [`settle_fences`](Self::settle_fences), or by
    /// [`release_fences`](Self::release_fences)). A pull (`Direction::Read`) has moved nothing:
    /// the pages are unpinned, and prefill's late `Staged` for it is answered when it comes.
    /// Never [`PinnedImport::abort`] an offered push: that hands its pages on while it may land.
    ///
    /// It takes no region, so the push's fence keeps none alive (unlike
    /// [`receive`](Self::receive)'s, which keeps its region's
    /// [`keep_alive`](PageRegion::keep_alive)): keep the region the pages are in allocated and
    /// registered yourself while [`fenced`](Self::fenced) counts the fence.
    pub fn abandon(&mut self, direction: Direction, pinned: PinnedImport<'_>) {
        let request = pinned.request();
        match direction {
            Direction::Write => self.fenced.push(Fenced { fence: pinned.fence(), keep: None }),
            Direction::Read => {
                self.remember_abandoned(request, pinned.pages().to_vec());
                pinned.abort();
            }
        }
        if let Some(expected) = &mut self.expected {
            expected.remove(&request);
        }
    }

    /// Transfers whose pages are still fenced (see [`settle_fences`](Self::settle_fences)):
    /// pushes that timed out or failed, and pulls whose READ did not complete.
    pub fn fenced(&self) -> usize {
        self.fenced.len() + self.read_fences.len()
    }

    /// Lifts the fences of timed-out pushes whose sender is done: a push decode gave up on may
    /// still WRITE its pages, so [`receive`](Self::receive) keeps them pinned
    /// ([`Fence`]: out of circulation even once the request releases them) rather than let a
    /// late WRITE land in a next owner's KV. When that push's `Written` notice arrives (NIXL
    /// delivers it after the data: nothing more of it will land), its pages are zeroed in
    /// `region` and the fence lifted in `table` (the table the pages were pinned in). Runs at the
    /// start of every `receive`; call it also when idle. Returns how many fences were lifted.
    /// A fence lifted here lets go of the region its [`receive`](Self::receive) kept alive
    /// ([`keep_alive`](PageRegion::keep_alive)): nothing more of its transfer lands.
    ///
    /// A pull whose READ did not complete (it timed out or failed) is fenced with the READ's
    /// handle, and lifted the same way once NIXL reports that READ complete, then prefill is
    /// told (`Released` naming the extents it staged: its [`settle_stages`](Self::settle_stages)
    /// hands them back); one NIXL reports failed, or whose posting failed (NIXL may have started
    /// it and gave no handle), stays fenced until [`release_fences`](Self::release_fences) (a
    /// failure is no proof that nothing more lands), prefill not told.
    /// A late `Staged` for a pull that timed out before it came (or was
    /// [abandoned](Self::abandon)) is answered here too, `Released` naming its extents: decode
    /// never READs it.
    pub fn settle_fences<R: PageRegion + ?Sized>(
        &mut self,
        table: &OwnershipTable,
        region: &mut R,
    ) -> Result<usize, NixlError> {
        let mut lifted = 0;
        let mut read_done = Vec::new();
        for mut fenced in std::mem::take(&mut self.read_fences) {
            if fenced.fence.is_in(table) && matches!(self.agent.poll(&mut fenced.read), Ok(true)) {
                let ReadFence { request, fence, read, staged, keep } = fenced;
                // Complete: its handle goes first, then the region it landed in.
                drop(read);
                self.retire_fence(fence, keep, table, region);
                read_done.push((request, staged));
                lifted += 1;
            } else {
                self.read_fences.push(fenced);
            }
        }
        for (request, staged) in read_done {
            // Best effort: unsent, prefill keeps the staged pages until it knows this side gone.
            let _ = self.send(&Notice { extents: staged, ..Notice::bare(NoticeKind::Released, request) });
        }
        if self.fenced.is_empty() && self.abandoned.is_empty() {
            return Ok(lifted);
        }
        self.collect(None)?;
        self.answer_late_stagings()?;
        for fenced in std::mem::take(&mut self.fenced) {
            let fence = &fenced.fence;
            if !fence.is_in(table) {
                // Another table's (a link shared by several decode tables): settled with it.
                self.fenced.push(fenced);
                continue;
            }
            let pages: Vec<u32> = fence.pages().iter().map(|r| r.page.0).collect();
            let theirs = |n: &Notice| {
                n.request == fence.request()
                    && match Manifest::decode(&n.manifest) {
                        Ok(m) => m.pages().iter().map(|e| e.dest).eq(fence.pages().iter().copied()),
                        Err(_) => n.extents.iter().map(|e| e.page).eq(pages.iter().copied()),
                    }
            };
            let Some(at) = self.inbox.iter().position(|n| n.kind == NoticeKind::Written && theirs(n)) else {
                self.fenced.push(fenced);
                continue;
            };
            let done = self.inbox.remove(at);
            self.inbox_bytes -= footprint(&done);
            self.retire_fence(fenced.fence, fenced.keep, table, region);
            lifted += 1;
        }
        Ok(lifted)
    }

    /// Lifts every fence of `table`: the engine knows the peer is gone (it disconnected, its
    /// process ended, it was restarted), so no late WRITE or READ of it can land. (Decode
    /// invalidating the peer's metadata is no such proof: it does not stop the peer writing
    /// decode's memory.) Zeroes the pages first. Returns how many were lifted.
    ///
    /// The regions their [`receive`](Self::receive)s kept alive are never freed (their
    /// keep-alives leaked): a READ queued in this agent may still run after its handle is
    /// released, and the engine's word is no proof that nothing more lands.
    pub fn release_fences<R: PageRegion + ?Sized>(&mut self, table: &OwnershipTable, region: &mut R) -> usize {
        let (reads, other_reads): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.read_fences).into_iter().partition(|r| r.fence.is_in(table));
        self.read_fences = other_reads;
        let (mut mine, others): (Vec<Fenced>, Vec<Fenced>) =
            std::mem::take(&mut self.fenced).into_iter().partition(|f| f.fence.is_in(table));
        self.fenced = others;
        // The READs' handles released with their fences (the peer is gone), their regions kept.
        mine.extend(reads.into_iter().map(|r| Fenced { fence: r.fence, keep: r.keep }));
        let n = mine.len();
        for Fenced { fence, keep } in mine {
            leak(std::iter::once(keep));
            self.retire_fence(fence, None, table, region);
        }
        n
    }

    /// Zeroes a fence's pages, drops the `Part` notices that named them, and lifts it; then
    /// drops `keep` (the share in the region the fenced transfer could land in: passed only once
    /// nothing more of it lands).
    pub(super) fn retire_fence<R: PageRegion + ?Sized>(
        &mut self,
        fence: Fence,
        keep: Option<KeepAlive>,
        table: &OwnershipTable,
        region: &mut R,
    ) {
        let pages: Vec<u32> = fence.pages().iter().map(|r| r.page.0).collect();
        let pages = pages.as_slice();
        let request = fence.request();
        let mut freed = 0;
        self.inbox.retain(|n| {
            let keep = !(n.request == request
                && n.kind == NoticeKind::Part
                && n.extents.iter().all(|e| pages.contains(&e.page)));
            if !keep {
                freed += footprint(n);
            }
            keep
        });
        self.inbox_bytes -= freed;
        let in_region: Vec<u32> = pages.iter().copied().filter(|&p| p < region.layout().pages).collect();
        // Best effort, like a refusal's scrub: the pages carry no coverage either way.
        let _ = region.scrub(&in_region);
        // Callers pass only this table's fences.
        let _ = table.lift_fence(fence);
        drop(keep);
    }

    /// Remembers a pull decode gave up on: `request` and the page incarnations it had `pinned`,
    /// so that its late `Staged` is answered and set aside rather than taken for a retry's (past
    /// [`ABANDONED_CAP`], the oldest is forgotten).
    pub(super) fn remember_abandoned(&mut self, request: RequestId, pinned: Vec<PageRef>) {
        if self.abandoned.len() == ABANDONED_CAP {
            self.abandoned.pop_front();
        }
        self.abandoned.push_back((request, pinned));
    }

    /// Whether `staged` is the late answer to a pull of its request that timed out (its
    /// manifest names exactly the page incarnations that pull had pinned): then prefill is told
    /// it may reuse those staged pages (`Released` naming them) and the notice is set aside. A
    /// retry's own `Staged` names the retry's incarnations, and a stale one for any other
    /// attempt is still refused by the checks.
    pub(super) fn answer_abandoned(&mut self, staged: &Notice) -> Result<bool, NixlError> {
        let Some(at) = self.abandoned_attempt(staged) else { return Ok(false) };
        self.abandoned.remove(at);
        let released = Notice { extents: staged.extents.clone(), ..Notice::bare(NoticeKind::Released, staged.request) };
        self.send(&released)?;
        Ok(true)
    }

    /// Where in `abandoned` the pull is whose late answer `staged` is, if it is one.
    fn abandoned_attempt(&self, staged: &Notice) -> Option<usize> {
        let Ok(manifest) = Manifest::decode(&staged.manifest) else { return None };
        let named: Vec<PageRef> = manifest.pages().iter().map(|e| e.dest).collect();
        self.abandoned.iter().position(|(r, refs)| *r == staged.request && *refs == named)
    }

    /// Answers the late `Staged` notices in the inbox of pulls that timed out before they came
    /// ([`answer_abandoned`](Self::answer_abandoned)), so that prefill reuses those pages
    /// without waiting for a retry of the request to come across them.
    pub(super) fn answer_late_stagings(&mut self) -> Result<(), NixlError> {
        while let Some(at) = self.inbox.iter().position(|n| {
            n.kind == NoticeKind::Staged
                && self.abandoned.iter().any(|(r, _)| *r == n.request)
                && self.abandoned_attempt(n).is_some()
        }) {
            let late = self.inbox.remove(at);
            self.inbox_bytes -= footprint(&late);
            self.answer_abandoned(&late)?;
        }
        Ok(())
    }
}
