//! One side's connection to its peer ([`NixlLink`]): its agent, the peer's name and region, its
//! settings, and the inbox of the peer's notices (what a selective decode keeps, its bounds, the
//! waits); and the pages prefill holds for failed transfers. The protocol's steps over it live
//! beside it: `push.rs` (prefill WRITEs decode's pages), `stage.rs` (prefill stages its pages for
//! decode's READ), `receive.rs` (decode receives either, failing closed) and `fence.rs` (decode's
//! pages of transfers it gave up on, held until those are over).

use super::held::{Held, leak};
use super::{Extent, KeepAlive, NixlAgent, NixlError, Notice, NoticeKind, Posted, RegionLayout};
use crate::Fence;
use crate::ids::{PageRef, RequestId};
use std::time::Instant;

/// Notices kept for requests nobody waits for yet; past this, the oldest are dropped (a peer
/// cannot make decode hold unbounded memory).
pub const INBOX_CAP: usize = 4_096;

/// Bytes of notices kept for requests nobody waits for yet (their manifests and extents); past
/// this, the oldest are dropped, so a peer sending large notices for requests never asked for
/// holds at most this much of decode's memory.
pub const INBOX_BYTES: usize = 16 << 20;

/// A link's part size unless [`NixlLink::set_parts`] says otherwise: a push of more bytes than
/// this goes as several WRITEs of about this many bytes each (whole pages: a part holds at least
/// one), each with a `Part` notification, so that each side checksums a part's pages on its own
/// thread while the other parts are in flight, rather than all of them before and after the
/// transfer (benches/nixl.rs: `overlapped` against `checked`). Two MiB: 2 MiB pages go one per
/// part, while a transfer of 2 MiB or less stays one WRITE (in 1 MiB parts, 64 KiB pages lost
/// 2-4 % to the extra WRITE, and 2 MiB pages gained nothing measurable over 4 MiB parts).
pub const PART_BYTES: u64 = 2 << 20;

/// How long [`NixlLink::send`] keeps the agent busy after a notification.
pub const FLUSH: std::time::Duration = std::time::Duration::from_millis(2);

/// One side's connection to its peer: its agent, the peer's name and region, and the notices
/// that arrived for requests nobody waits for yet.
///
/// Prefill's side holds the transfers that failed while they may still read its pages (a push's
/// WRITEs NIXL has not reported complete, a staging decode has not released: see
/// [`in_flight`](Self::in_flight)), and with each the region's [`KeepAlive`](super::KeepAlive)
/// ([`PageRegion::keep_alive`](super::PageRegion::keep_alive)): dropping a
/// [`HostRegion`](super::HostRegion) meanwhile frees nothing, and the link lets the region go
/// when it hands those pages back. A link dropped while it holds transfers releases their WRITEs
/// (which does not stop them) and leaks their regions' keep-alives: never freed under a running
/// WRITE or READ.
///
/// Decode's side likewise keeps the region a transfer it gave up on may still land in (a push
/// that timed out or failed, a READ that outlived its wait) with that transfer's fence (see
/// [`fenced`](Self::fenced)): dropped when the fence is lifted on proof that nothing more lands
/// ([`settle_fences`](Self::settle_fences)), leaked when it is lifted without that proof
/// ([`release_fences`](Self::release_fences)) or when the link is dropped while fencing.
#[derive(Debug)]
pub struct NixlLink<'a> {
    pub(super) agent: &'a NixlAgent,
    pub(super) peer: String,
    pub(super) peer_region: RegionLayout,
    pub(super) inbox: Vec<Notice>,
    /// Bytes the inbox holds ([`footprint`] of each notice).
    pub(super) inbox_bytes: usize,
    /// Pulls whose wait timed out: the request and the page incarnations it had pinned.
    pub(super) abandoned: std::collections::VecDeque<(RequestId, Vec<PageRef>)>,
    /// Pushes that timed out or failed (and pulls whose READ's posting failed): their pages
    /// stay pinned until the sender is done with them, their region kept alive meanwhile.
    pub(super) fenced: Vec<Fenced>,
    /// Pulls whose READ was posted and did not complete (it timed out or failed): their pages
    /// stay pinned, with the READ's handle, until NIXL reports it complete. Releasing a READ
    /// still in flight does not stop it (NIXL tries to cancel, and may not).
    pub(super) read_fences: Vec<ReadFence>,
    /// Prefill: WRITEs of pushes that failed, not reported complete by NIXL, and stagings that
    /// failed before decode released them: their pages may still be read, until
    /// [`settle_pushes`](NixlLink::settle_pushes) or [`settle_stages`](NixlLink::settle_stages)
    /// hands each back, once its last holder lets go.
    pub(super) held: Held,
    /// Decode, once [`expect`](NixlLink::expect) was called: the requests it asked a peer
    /// for; notices for any other (with no fence and no abandoned pull) are dropped on arrival.
    pub(super) expected: Option<std::collections::HashSet<RequestId>>,
    pub(super) malformed: u64,
    pub(super) unasked: u64,
    pub(super) evicted: u64,
    pub(super) part_bytes: Option<u64>,
}

/// What a notice kept in the inbox costs in memory, roughly.
pub(super) fn footprint(n: &Notice) -> usize {
    std::mem::size_of::<Notice>() + n.manifest.len() + n.extents.len() * std::mem::size_of::<Extent>()
}

/// A transfer decode gave up on that may still land in its pages (a push's late WRITEs, a READ
/// whose posting failed): the pages fenced, and what keeps the region they land in alive.
#[derive(Debug)]
pub(super) struct Fenced {
    pub(super) fence: Fence,
    /// What keeps the region the transfer may still land in registered and allocated
    /// ([`PageRegion::keep_alive`](super::PageRegion::keep_alive)): dropped when the fence is
    /// lifted on proof that nothing more lands, leaked otherwise. `None`: the region keeps
    /// itself, or none was given ([`abandon`](NixlLink::abandon)).
    pub(super) keep: Option<KeepAlive>,
}

/// A pull whose READ was posted and did not complete: its pages fenced with the READ's handle,
/// the extents prefill staged, to release when the READ is over, and what keeps the region the
/// READ lands in alive until then.
#[derive(Debug)]
pub(super) struct ReadFence {
    pub(super) request: RequestId,
    pub(super) fence: Fence,
    pub(super) read: Posted,
    pub(super) staged: Vec<Extent>,
    /// As [`Fenced::keep`]. Declared after `read`: dropped after it.
    pub(super) keep: Option<KeepAlive>,
}

impl Drop for NixlLink<'_> {
    /// Dropped while decode fences transfers it gave up on: a late WRITE, or a READ whose handle
    /// is released now (which may not stop it), may still land in their regions, so those are
    /// never freed: their keep-alives are leaked, not dropped, as prefill's held transfers'
    /// are.
    fn drop(&mut self) {
        let pushed = self.fenced.iter_mut().map(|f| f.keep.take());
        leak(pushed.chain(self.read_fences.iter_mut().map(|r| r.keep.take())));
    }
}

impl<'a> NixlLink<'a> {
    /// Connects `agent` to the peer whose metadata and region layout came out of band.
    pub fn connect(agent: &'a NixlAgent, peer_metadata: &[u8], peer_region: RegionLayout) -> Result<Self, NixlError> {
        let peer = agent.connect(peer_metadata)?;
        agent.make_connection(&peer)?;
        Ok(NixlLink {
            agent,
            peer,
            peer_region,
            inbox: Vec::new(),
            inbox_bytes: 0,
            abandoned: std::collections::VecDeque::new(),
            fenced: Vec::new(),
            read_fences: Vec::new(),
            held: Held::default(),
            expected: None,
            malformed: 0,
            unasked: 0,
            evicted: 0,
            part_bytes: Some(PART_BYTES),
        })
    }

    /// The peer's agent name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Pushes from this side in parts of about `part_bytes` (by default [`PART_BYTES`]), the
    /// checksums overlapped with the transfer; `None`: every push is one WRITE, checked in series.
    /// Decode needs no setting: it takes a push in parts or in one WRITE alike.
    pub fn set_parts(&mut self, part_bytes: Option<u64>) {
        self.part_bytes = part_bytes.map(|b| b.max(1));
    }

    /// The peer's pages.
    pub fn peer_region(&self) -> RegionLayout {
        self.peer_region
    }

    /// Notifications from the peer that were not kvguard notices, or were damaged (dropped).
    pub fn malformed(&self) -> u64 {
        self.malformed
    }

    /// Decode: `request`'s transfer is coming over this link; call it before asking the peer
    /// for it (before the offer of a push, or the request for a pull). The first call makes the
    /// link *selective*: from then on a notice for a request it does not expect, and that has no
    /// fenced push or abandoned pull here, is dropped as it arrives ([`unasked`](Self::unasked)
    /// counts them) and takes none of the inbox. [`receive`](Self::receive) forgets the request
    /// when it ends (expect it again before a retry); a link never told stays permissive (the
    /// prefill side, which waits for decode's answers), its inbox bounded by [`INBOX_CAP`] and
    /// [`INBOX_BYTES`] alone.
    ///
    /// ```no_run
    /// # use kvguard::transfer::nixl::NixlLink;
    /// # use kvguard::RequestId;
    /// # fn ask_prefill(_: RequestId) {}
    /// # fn f(link: &mut NixlLink<'_>) {
    /// let request = RequestId(7);
    /// link.expect(request); // before prefill can send anything about it
    /// ask_prefill(request);
    /// // ... link.receive(...) takes its notices; any other request's are dropped on arrival.
    /// # }
    /// ```
    pub fn expect(&mut self, request: RequestId) {
        self.expected.get_or_insert_with(Default::default).insert(request);
    }

    /// Decode: no longer expects `request` (the engine gave up on it without a
    /// [`receive`](Self::receive)); its notices still in the inbox are dropped. Returns whether
    /// it was expected.
    pub fn forget(&mut self, request: RequestId) -> bool {
        let Some(expected) = &mut self.expected else { return false };
        let was = expected.remove(&request);
        if !self.keeps(request, None) {
            let mut freed = 0;
            self.inbox.retain(|n| {
                let keep = n.request != request;
                if !keep {
                    freed += footprint(n);
                }
                keep
            });
            self.inbox_bytes -= freed;
        }
        was
    }

    /// Notices a selective link dropped on arrival: for requests it was not
    /// [expecting](Self::expect).
    pub fn unasked(&self) -> u64 {
        self.unasked
    }

    /// Notices dropped from a full inbox ([`INBOX_CAP`], [`INBOX_BYTES`]), oldest first, to
    /// make room. A transfer that loses one this way is never accepted on a guess: its wait
    /// times out (a push's pages fenced), and a fence whose `Written` was dropped stays until
    /// [`release_fences`](Self::release_fences). Counted so an operator sees a link flooded.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Whether a notice about `request` is kept: the link is not selective, or it expects the
    /// request, waits for it, or has a fenced push, an abandoned pull or a held staging of it.
    pub(super) fn keeps(&self, request: RequestId, waiting: Option<RequestId>) -> bool {
        let Some(expected) = &self.expected else { return true };
        expected.contains(&request)
            || waiting == Some(request)
            || self.fenced.iter().any(|f| f.fence.request() == request)
            || self.read_fences.iter().any(|r| r.fence.request() == request)
            || self.abandoned.iter().any(|(r, _)| *r == request)
            || self.held.stages(request)
    }

    /// Sends `notice` to the peer, then moves UCX along for a moment ([`FLUSH`]): with no
    /// progress thread a notification leaves only while the agent is called, and NIXL has no
    /// completion for it. Notices that arrive meanwhile are kept.
    pub fn send(&mut self, notice: &Notice) -> Result<(), NixlError> {
        self.agent.notify(&self.peer, &notice.encode())?;
        let until = Instant::now() + FLUSH;
        while Instant::now() < until {
            self.collect(None)?;
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Drops the `Part` notices of `request` from the inbox.
    pub(super) fn drop_parts(&mut self, request: RequestId) {
        let mut freed = 0;
        self.inbox.retain(|n| {
            let keep = !(n.request == request && n.kind == NoticeKind::Part);
            if !keep {
                freed += footprint(n);
            }
            keep
        });
        self.inbox_bytes -= freed;
    }

    /// Bytes the notices kept for later waits hold (at most [`INBOX_BYTES`]).
    pub fn inbox_bytes(&self) -> usize {
        self.inbox_bytes
    }

    /// Takes the agent's notifications into the inbox (on a selective link, those it
    /// [keeps](Self::keeps) while waiting for `waiting`).
    pub(super) fn collect(&mut self, waiting: Option<RequestId>) -> Result<(), NixlError> {
        for (from, bytes) in self.agent.take_notifications()? {
            if from != self.peer {
                continue;
            }
            match Notice::decode(&bytes) {
                Ok(n) if !self.keeps(n.request, waiting) => self.unasked += 1,
                Ok(n) => {
                    let size = footprint(&n);
                    while !self.inbox.is_empty()
                        && (self.inbox.len() >= INBOX_CAP || self.inbox_bytes + size > INBOX_BYTES)
                    {
                        let oldest = self.inbox.remove(0);
                        self.inbox_bytes -= footprint(&oldest);
                        self.evicted += 1;
                    }
                    self.inbox_bytes += size;
                    self.inbox.push(n);
                }
                Err(_) => self.malformed += 1,
            }
        }
        Ok(())
    }

    /// Waits until a notice about `request` of one of `kinds` comes from the peer, or
    /// `deadline`. Notices for other requests are kept for their own wait (at most
    /// [`INBOX_CAP`]); notices from other agents and malformed ones are dropped.
    pub fn wait(&mut self, request: RequestId, kinds: &[NoticeKind], deadline: Instant) -> Result<Notice, NixlError> {
        self.wait_where(request, kinds, |_| true, deadline)
    }

    /// [`wait`](Self::wait) for a notice that also satisfies `also`.
    pub(super) fn wait_where(
        &mut self,
        request: RequestId,
        kinds: &[NoticeKind],
        also: impl Fn(&Notice) -> bool,
        deadline: Instant,
    ) -> Result<Notice, NixlError> {
        let wanted = |n: &Notice| n.request == request && kinds.contains(&n.kind) && also(n);
        let mut spins = 0u32;
        loop {
            if let Some(i) = self.inbox.iter().position(wanted) {
                let n = self.inbox.remove(i);
                self.inbox_bytes -= footprint(&n);
                return Ok(n);
            }
            self.collect(Some(request))?;
            if self.inbox.iter().any(wanted) {
                continue;
            }
            if Instant::now() >= deadline {
                return Err(NixlError::Timeout { waiting_for: "the peer's notification" });
            }
            super::agent::pause(&mut spins);
        }
    }

    /// Refuses (`Extents`, before anything is sent) a `what` of `src` that names a page the
    /// link still holds: one page, one holder at a time, so a page comes back once, when the
    /// transfer that may read it is done, and no later transfer's success makes it look free.
    pub(super) fn refuse_held(&self, src: &[Extent], what: &str) -> Result<(), NixlError> {
        let held = self.held.among(src.iter().map(|e| e.page));
        if held.is_empty() {
            return Ok(());
        }
        Err(NixlError::Extents {
            reason: format!(
                "pages {held:?} are still held (in_flight): an earlier push's WRITE or staging's READ may still read them; {what} them once settle_pushes or settle_stages hands them back"
            ),
        })
    }

    /// Prefill: the source pages that WRITEs of failed pushes, or decode's READs of failed
    /// stagings, may still read, by request, each page once (page ids of the region each was
    /// pushed or staged from, as in [`NixlError::InFlight`]): not to be reused (written by
    /// another request's KV), pushed or staged again until [`settle_pushes`](Self::settle_pushes)
    /// or [`settle_stages`](Self::settle_stages) hands them back. The prefill side's counterpart
    /// of decode's [`fenced`](Self::fenced).
    ///
    /// A held WRITE or READ reads its region with no call on this side, so the link keeps the
    /// region registered and allocated until it hands the pages back: it keeps the region's
    /// [`keep_alive`](super::PageRegion::keep_alive) with each held transfer (a
    /// [`HostRegion`](super::HostRegion)'s memory and registration, an
    /// [`EnginePool`](super::EnginePool)'s registration when kvguard made it). What no
    /// keep-alive covers stays the engine's to keep: an engine pool's memory, a region whose
    /// [`PageRegion`](super::PageRegion) hands none, and one staged with [`stage`](Self::stage)
    /// (no region given).
    pub fn in_flight(&self) -> Vec<(RequestId, Vec<u32>)> {
        self.held.in_flight()
    }

    /// Prefill: how many distinct pages [`in_flight`](Self::in_flight) lists.
    pub fn held_pages(&self) -> usize {
        self.held.pages()
    }
}
