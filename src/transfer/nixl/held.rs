//! Prefill's held pages: the source pages that WRITEs of failed pushes may still read (NIXL has
//! not reported them complete) and that decode may still READ for failed stagings (its
//! `Released` has not come), counted per page, so that each page comes back once, when the last
//! transfer that may read it lets go of it. Each held transfer keeps the region it reads alive
//! ([`KeepAlive`]) until NIXL proves it done (a WRITE complete, decode's `Released`); one let
//! go without that proof (released, or the link dropped while holding it) leaks its share.

use super::{KeepAlive, Posted};
use crate::ids::RequestId;
use std::collections::BTreeMap;

/// The link's held transfers and how many of them name each page.
#[derive(Debug, Default)]
pub(super) struct Held {
    pushes: Vec<PushWrite>,
    stages: Vec<Staging>,
    /// Each held page and how many times held entries (WRITEs and stagings) name it; a page
    /// leaves the map, and is handed back, when the last of them lets go.
    holders: BTreeMap<u32, u32>,
}

/// A WRITE of a push that failed, not reported complete by NIXL: the source pages it may still
/// read.
#[derive(Debug)]
pub(super) struct PushWrite {
    pub(super) request: RequestId,
    /// Source pages of the region pushed from, in the order pushed.
    pub(super) pages: Vec<u32>,
    /// Its handle, kept (never released) while it may run; `None` when posting it failed
    /// part-way (NIXL gave no handle to wait for).
    pub(super) posted: Option<Posted>,
    /// NIXL reported it failed, or posting it failed part-way: no completion will prove it
    /// done; only [`Held::release_pushes`] hands its pages back.
    pub(super) failed: bool,
    /// What keeps the region pushed from registered and allocated while the WRITE may read it
    /// (`None`: the engine's region keeps itself). Declared after `posted`: dropped after it.
    pub(super) keep: Option<KeepAlive>,
}

/// A staging that failed before decode released it: decode may still READ its pages.
#[derive(Debug)]
pub(super) struct Staging {
    pub(super) request: RequestId,
    /// What was staged: decode's `Released` for it names exactly these.
    pub(super) extents: Vec<super::Extent>,
    /// Their pages, in the order staged.
    pub(super) pages: Vec<u32>,
    /// What keeps the region staged from registered and allocated while decode may READ it
    /// (`None`: staged without a region, or the engine's region keeps itself).
    pub(super) keep: Option<KeepAlive>,
}

/// Pages by request, the requests in the order they first appear, each page once (under the
/// first request that names it).
pub(super) type ByRequest = Vec<(RequestId, Vec<u32>)>;

fn by_request<'p>(entries: impl Iterator<Item = (RequestId, &'p [u32])>) -> ByRequest {
    let mut out: ByRequest = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (request, pages) in entries {
        let fresh: Vec<u32> = pages.iter().copied().filter(|&p| seen.insert(p)).collect();
        match out.iter_mut().find(|(r, _)| *r == request) {
            Some((_, all)) => all.extend(fresh),
            None if fresh.is_empty() => {}
            None => out.push((request, fresh)),
        }
    }
    out
}

/// `pages` without repeats, in their first order.
pub(super) fn distinct(pages: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut seen = std::collections::BTreeSet::new();
    pages.into_iter().filter(|&p| seen.insert(p)).collect()
}

impl Held {
    fn count(&mut self, pages: &[u32]) {
        for &p in pages {
            *self.holders.entry(p).or_insert(0) += 1;
        }
    }

    /// Lets go of `entries`' holds; returns the pages no other held entry names any more, by
    /// the request of the entry that let go last, each once.
    fn let_go<'p>(&mut self, entries: impl Iterator<Item = (RequestId, &'p [u32])>) -> ByRequest {
        let mut out: ByRequest = Vec::new();
        for (request, pages) in entries {
            let mut freed = Vec::new();
            for &p in pages {
                let Some(n) = self.holders.get_mut(&p) else { continue };
                *n -= 1;
                if *n == 0 {
                    self.holders.remove(&p);
                    freed.push(p);
                }
            }
            match out.iter_mut().find(|(r, _)| *r == request) {
                Some((_, all)) => all.extend(freed),
                None if freed.is_empty() => {}
                None => out.push((request, freed)),
            }
        }
        out
    }

    /// Holds a push's WRITE.
    pub(super) fn hold_push(&mut self, write: PushWrite) {
        self.count(&write.pages);
        self.pushes.push(write);
    }

    /// Holds a staging.
    pub(super) fn hold_stage(&mut self, staging: Staging) {
        self.count(&staging.pages);
        self.stages.push(staging);
    }

    /// Which of `pages` are held (by a WRITE or a staging), each once, in their order.
    pub(super) fn among(&self, pages: impl IntoIterator<Item = u32>) -> Vec<u32> {
        distinct(pages.into_iter().filter(|p| self.holders.contains_key(p)))
    }

    /// Every held page, by request (pushes' first, then stagings'), each once.
    pub(super) fn in_flight(&self) -> ByRequest {
        let pushed = self.pushes.iter().map(|w| (w.request, w.pages.as_slice()));
        by_request(pushed.chain(self.stages.iter().map(|s| (s.request, s.pages.as_slice()))))
    }

    /// How many distinct pages are held.
    pub(super) fn pages(&self) -> usize {
        self.holders.len()
    }

    /// How many distinct pages WRITEs NIXL reported failed (or posted part-way) name: held
    /// until [`release_pushes`](Self::release_pushes).
    pub(super) fn failed_pages(&self) -> usize {
        distinct(self.pushes.iter().filter(|w| w.failed).flat_map(|w| w.pages.iter().copied())).len()
    }

    /// Whether a held staging is `request`'s.
    pub(super) fn stages(&self, request: RequestId) -> bool {
        self.stages.iter().any(|s| s.request == request)
    }

    /// Whether any staging is held.
    pub(super) fn any_stage(&self) -> bool {
        !self.stages.is_empty()
    }

    /// Lets go of the WRITEs `poll` reports complete (`Ok(true)`; an `Err` marks one failed:
    /// held until [`release_pushes`](Self::release_pushes)); failed ones are not polled.
    /// Returns the pages no held entry names any more.
    pub(super) fn settle_pushes(&mut self, mut poll: impl FnMut(&mut PushWrite) -> Result<bool, ()>) -> ByRequest {
        let mut done = Vec::new();
        for mut write in std::mem::take(&mut self.pushes) {
            if !write.failed {
                match poll(&mut write) {
                    Ok(true) => {
                        done.push(write);
                        continue;
                    }
                    Ok(false) => {}
                    Err(()) => write.failed = true,
                }
            }
            self.pushes.push(write);
        }
        self.let_go(done.iter().map(|w| (w.request, w.pages.as_slice())))
    }

    /// Lets go of every WRITE (their handles released, which does not stop them: see
    /// [`Posted`]); their regions' shares are leaked, never dropped. Returns the pages no held
    /// staging names.
    pub(super) fn release_pushes(&mut self) -> ByRequest {
        let mut all = std::mem::take(&mut self.pushes);
        leak(all.iter_mut().map(|w| w.keep.take()));
        self.let_go(all.iter().map(|w| (w.request, w.pages.as_slice())))
    }

    /// Lets go of the stagings `released` says decode released; returns the pages no held
    /// entry names any more.
    pub(super) fn settle_stages(&mut self, mut released: impl FnMut(&Staging) -> bool) -> ByRequest {
        let (done, kept): (Vec<Staging>, Vec<Staging>) =
            std::mem::take(&mut self.stages).into_iter().partition(|s| released(s));
        self.stages = kept;
        self.let_go(done.iter().map(|s| (s.request, s.pages.as_slice())))
    }

    /// Lets go of every staging (decode may still READ it: their regions' shares are leaked,
    /// never dropped); returns the pages no held WRITE names.
    pub(super) fn release_stages(&mut self) -> ByRequest {
        let mut all = std::mem::take(&mut self.stages);
        leak(all.iter_mut().map(|s| s.keep.take()));
        self.let_go(all.iter().map(|s| (s.request, s.pages.as_slice())))
    }
}

/// Shares of regions a transfer may still read with nothing left to prove it done: never
/// dropped, so the memory they keep is never deregistered or freed (decode's fences lifted or
/// dropped without proof leak theirs the same way).
pub(super) fn leak(keeps: impl Iterator<Item = Option<KeepAlive>>) {
    for keep in keeps.flatten() {
        std::mem::forget(keep);
    }
}

impl Drop for Held {
    /// The link is dropped while holding transfers: its WRITEs are released, which does not stop
    /// them (see [`Posted`]), and decode may still READ its stagings. The regions they read are
    /// never freed: their keep-alives are leaked, not dropped.
    fn drop(&mut self) {
        let pushed = self.pushes.iter_mut().map(|w| w.keep.take());
        leak(pushed.chain(self.stages.iter_mut().map(|s| s.keep.take())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: RequestId = RequestId(1);
    const B: RequestId = RequestId(2);

    fn write(request: RequestId, pages: &[u32], failed: bool) -> PushWrite {
        PushWrite { request, pages: pages.to_vec(), posted: None, failed, keep: None }
    }

    fn staging(request: RequestId, pages: &[u32]) -> Staging {
        let extents = pages.iter().map(|&page| super::super::Extent { page, len: 8 }).collect();
        Staging { request, extents, pages: pages.to_vec(), keep: None }
    }

    #[test]
    fn a_page_two_writes_read_comes_back_once_when_the_second_completes() {
        let mut held = Held::default();
        held.hold_push(write(A, &[0, 1, 2, 3], false));
        held.hold_push(write(A, &[0, 1, 2, 3], false));
        assert_eq!(held.in_flight(), vec![(A, vec![0, 1, 2, 3])]);
        assert_eq!(held.pages(), 4);
        // The first WRITE completes: the second still reads every page.
        let mut first = true;
        let handed = held.settle_pushes(|_| Ok(std::mem::replace(&mut first, false)));
        assert_eq!(handed, vec![]);
        assert_eq!(held.in_flight(), vec![(A, vec![0, 1, 2, 3])]);
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![(A, vec![0, 1, 2, 3])]);
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![]);
        assert_eq!(held.pages(), 0);
    }

    #[test]
    fn a_failed_write_is_not_settled_and_comes_back_once_by_release() {
        let mut held = Held::default();
        held.hold_push(write(A, &[0, 1], false));
        // Posted part-way: no handle, failed from the start.
        held.hold_push(write(B, &[1, 2], true));
        assert_eq!(held.failed_pages(), 2);
        assert_eq!(held.settle_pushes(|_| Err(())), vec![], "a failure is no proof it is done");
        assert_eq!(held.failed_pages(), 3);
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![], "failed WRITEs are never polled again");
        assert_eq!(held.in_flight(), vec![(A, vec![0, 1]), (B, vec![2])]);
        assert_eq!(held.release_pushes(), vec![(A, vec![0]), (B, vec![1, 2])]);
        assert_eq!(held.release_pushes(), vec![]);
        assert_eq!((held.pages(), held.failed_pages()), (0, 0));
    }

    #[test]
    fn a_page_a_write_and_a_staging_hold_comes_back_with_the_last_of_them() {
        let mut held = Held::default();
        held.hold_push(write(A, &[0, 1], false));
        held.hold_stage(staging(B, &[1, 2]));
        assert_eq!(held.among([2, 3, 1, 1]), vec![2, 1]);
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![(A, vec![0])]);
        assert_eq!(held.release_stages(), vec![(B, vec![1, 2])]);
        held.hold_push(write(A, &[5], false));
        held.hold_stage(staging(B, &[5]));
        assert_eq!(held.settle_stages(|_| true), vec![]);
        assert_eq!(held.release_pushes(), vec![(A, vec![5])]);
        assert_eq!(held.pages(), 0);
    }

    /// A region's memory as the link's keep-alives see it: `Weak::strong_count` says whether it
    /// is still alive (0: freed).
    fn region() -> (std::sync::Arc<Vec<u8>>, std::sync::Weak<Vec<u8>>) {
        let memory = std::sync::Arc::new(vec![0u8; 64]);
        let alive = std::sync::Arc::downgrade(&memory);
        (memory, alive)
    }

    fn kept(memory: &std::sync::Arc<Vec<u8>>) -> Option<KeepAlive> {
        Some(KeepAlive::new(memory.clone()))
    }

    #[test]
    fn a_region_held_writes_read_outlives_its_owners_drop_until_the_last_is_settled() {
        let mut held = Held::default();
        let (memory, alive) = region();
        held.hold_push(PushWrite { keep: kept(&memory), ..write(A, &[0, 1], false) });
        held.hold_push(PushWrite { keep: kept(&memory), ..write(A, &[2], false) });
        // The engine drops its region while the WRITEs may still read it.
        drop(memory);
        assert_eq!(alive.strong_count(), 2, "each held WRITE keeps the region it reads");
        let mut first = true;
        assert_eq!(held.settle_pushes(|_| Ok(std::mem::replace(&mut first, false))), vec![(A, vec![0, 1])]);
        assert_eq!(alive.strong_count(), 1, "the second WRITE still reads it");
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![(A, vec![2])]);
        assert_eq!(alive.strong_count(), 0, "freed once no held WRITE reads it");
    }

    #[test]
    fn a_region_is_freed_once_its_transfer_is_proven_done_and_never_when_released() {
        let mut held = Held::default();
        let (pushed_from, pushed_alive) = region();
        let (staged_from, staged_alive) = region();
        held.hold_push(PushWrite { keep: kept(&pushed_from), ..write(A, &[0], true) });
        held.hold_stage(Staging { keep: kept(&staged_from), ..staging(B, &[1]) });
        drop((pushed_from, staged_from));
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![], "a failed WRITE is never settled");
        assert_eq!(held.settle_stages(|_| false), vec![], "decode has not released the staging");
        assert_eq!((pushed_alive.strong_count(), staged_alive.strong_count()), (1, 1));
        // Released: its pages come back, but the WRITE may still read: its region is leaked.
        assert_eq!(held.release_pushes(), vec![(A, vec![0])]);
        assert_eq!((pushed_alive.strong_count(), staged_alive.strong_count()), (1, 1));
        assert_eq!(held.settle_stages(|_| true), vec![(B, vec![1])]);
        assert_eq!(staged_alive.strong_count(), 0, "freed once decode released the staging");
        let (staged_again, alive_again) = region();
        held.hold_stage(Staging { keep: kept(&staged_again), ..staging(B, &[1]) });
        drop(staged_again);
        assert_eq!(held.release_stages(), vec![(B, vec![1])]);
        assert_eq!(alive_again.strong_count(), 1, "released, not proven read: leaked");
        let (settled_from, settled_alive) = region();
        held.hold_push(PushWrite { keep: kept(&settled_from), ..write(A, &[2], false) });
        drop(settled_from);
        assert_eq!(held.settle_pushes(|_| Ok(true)), vec![(A, vec![2])]);
        assert_eq!(settled_alive.strong_count(), 0, "freed once NIXL reported the WRITE complete");
    }

    #[test]
    fn a_link_dropped_while_holding_transfers_never_frees_their_regions() {
        let mut held = Held::default();
        let (pushed_from, pushed_alive) = region();
        let (staged_from, staged_alive) = region();
        held.hold_push(PushWrite { keep: kept(&pushed_from), ..write(A, &[0], false) });
        held.hold_stage(Staging { keep: kept(&staged_from), ..staging(B, &[1]) });
        drop((pushed_from, staged_from));
        // Its WRITEs released (which does not stop them), decode free to READ the staging.
        drop(held);
        assert_eq!(
            (pushed_alive.strong_count(), staged_alive.strong_count()),
            (1, 1),
            "leaked, not freed under a running WRITE or READ"
        );
    }

    #[test]
    fn a_page_named_twice_by_one_write_counts_twice() {
        let mut held = Held::default();
        held.hold_push(write(A, &[3, 3], false));
        assert_eq!(held.in_flight(), vec![(A, vec![3])]);
        assert_eq!(held.release_pushes(), vec![(A, vec![3])]);
    }
}
