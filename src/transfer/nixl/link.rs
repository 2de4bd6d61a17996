//! The checked protocol between one prefill and one decode agent: pushes and pulls of a
//! request's pages with the manifest riding along, and decode's receive, which fails closed.

use super::agent::POST_CALL;
use super::held::{Held, PushWrite, Staging, distinct};
use super::{Direction, Extent, KeepAlive, NixlAgent, NixlError, Notice, NoticeKind, PageRegion, Posted, RegionLayout};
use crate::ids::{PageId, PageRef, RequestId};
use crate::transfer::{Accepted, ExpectedTransfer, Manifest, PinnedImport, TransferError, TransferHeader};
use crate::{Fence, OwnershipTable};
use std::time::Instant;

/// Notices kept for requests nobody waits for yet; past this, the oldest are dropped (a peer
/// cannot make decode hold unbounded memory).
pub const INBOX_CAP: usize = 4_096;

/// Bytes of notices kept for requests nobody waits for yet (their manifests and extents); past
/// this, the oldest are dropped, so a peer sending large notices for requests never asked for
/// holds at most this much of decode's memory.
pub const INBOX_BYTES: usize = 16 << 20;

/// Pulls that timed out, remembered so that their late `Staged` notice is answered and set
/// aside rather than taken for a retry's; past this, the oldest are forgotten.
const ABANDONED_CAP: usize = 256;

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

/// Why decode's receive did not accept a transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// kvguard refused what arrived (recorded in the table as a violation).
    #[error("refused: {0}")]
    Refused(TransferError),
    /// The transport failed or timed out, or the notification never came: aborted, no verdict on
    /// content, nothing recorded as written, the pages scrubbed.
    #[error("aborted: {0}")]
    Aborted(NixlError),
    /// The sender declined (not ready): aborted, nothing recorded, the pages scrubbed.
    #[error("declined by the sender")]
    Declined,
}

/// One side's connection to its peer: its agent, the peer's name and region, and the notices
/// that arrived for requests nobody waits for yet.
///
/// Prefill's side holds the transfers that failed while they may still read its pages (a push's
/// WRITEs NIXL has not reported complete, a staging decode has not released: see
/// [`in_flight`](Self::in_flight)), and with each the region's [`KeepAlive`]
/// ([`PageRegion::keep_alive`]): dropping a [`HostRegion`](super::HostRegion) meanwhile frees
/// nothing, and the link lets the region go when it hands those pages back. A link dropped while
/// it holds transfers releases their WRITEs (which does not stop them) and leaks their regions'
/// keep-alives: never freed under a running WRITE or READ.
#[derive(Debug)]
pub struct NixlLink<'a> {
    agent: &'a NixlAgent,
    peer: String,
    peer_region: RegionLayout,
    inbox: Vec<Notice>,
    /// Bytes the inbox holds ([`footprint`] of each notice).
    inbox_bytes: usize,
    /// Pulls whose wait timed out: the request and the page incarnations it had pinned.
    abandoned: std::collections::VecDeque<(RequestId, Vec<PageRef>)>,
    /// Pushes that timed out: their pages stay pinned until the sender is done with them.
    fenced: Vec<Fence>,
    /// Pulls whose READ was posted and did not complete (it timed out or failed): their pages
    /// stay pinned, with the READ's handle, until NIXL reports it complete. Releasing a READ
    /// still in flight does not stop it (NIXL tries to cancel, and may not).
    read_fences: Vec<ReadFence>,
    /// Prefill: WRITEs of pushes that failed, not reported complete by NIXL, and stagings that
    /// failed before decode released them: their pages may still be read, until
    /// [`settle_pushes`](NixlLink::settle_pushes) or [`settle_stages`](NixlLink::settle_stages)
    /// hands each back, once its last holder lets go.
    held: Held,
    /// Decode, once [`expect`](NixlLink::expect) was called: the requests it asked a peer
    /// for; notices for any other (with no fence and no abandoned pull) are dropped on arrival.
    expected: Option<std::collections::HashSet<RequestId>>,
    malformed: u64,
    unasked: u64,
    evicted: u64,
    part_bytes: Option<u64>,
}

/// What a notice kept in the inbox costs in memory, roughly.
fn footprint(n: &Notice) -> usize {
    std::mem::size_of::<Notice>() + n.manifest.len() + n.extents.len() * std::mem::size_of::<Extent>()
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

    /// Decode: gives up on `pinned` without a [`receive`](Self::receive) (the request ended
    /// while its transfer was offered). A push (`Direction::Write`) may still WRITE the offered
    /// pages at any time: they are fenced, as for a push that timed out (lifted by its late
    /// `Written` in [`settle_fences`](Self::settle_fences), or by
    /// [`release_fences`](Self::release_fences)). A pull (`Direction::Read`) has moved nothing:
    /// the pages are unpinned, and prefill's late `Staged` for it is answered when it comes.
    /// Never [`PinnedImport::abort`] an offered push: that hands its pages on while it may land.
    pub fn abandon(&mut self, direction: Direction, pinned: PinnedImport<'_>) {
        let request = pinned.request();
        match direction {
            Direction::Write => self.fenced.push(pinned.fence()),
            Direction::Read => {
                if self.abandoned.len() == ABANDONED_CAP {
                    self.abandoned.pop_front();
                }
                self.abandoned.push_back((request, pinned.pages().to_vec()));
                pinned.abort();
            }
        }
        if let Some(expected) = &mut self.expected {
            expected.remove(&request);
        }
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
    fn keeps(&self, request: RequestId, waiting: Option<RequestId>) -> bool {
        let Some(expected) = &self.expected else { return true };
        expected.contains(&request)
            || waiting == Some(request)
            || self.fenced.iter().any(|f| f.request() == request)
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
    fn drop_parts(&mut self, request: RequestId) {
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
    ///
    /// A pull whose READ did not complete (it timed out or failed) is fenced with the READ's
    /// handle, and lifted the same way once NIXL reports that READ complete, then prefill is
    /// told (`Released` naming the extents it staged: its [`settle_stages`](Self::settle_stages)
    /// hands them back); one NIXL reports failed stays fenced until
    /// [`release_fences`](Self::release_fences) (a failure is no proof that nothing more lands).
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
                let pages: Vec<u32> = fenced.fence.pages().iter().map(|r| r.page.0).collect();
                self.retire_fence(fenced.fence, &pages, table, region);
                read_done.push((fenced.request, fenced.staged));
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
        for fence in std::mem::take(&mut self.fenced) {
            if !fence.is_in(table) {
                // Another table's (a link shared by several decode tables): settled with it.
                self.fenced.push(fence);
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
                self.fenced.push(fence);
                continue;
            };
            let done = self.inbox.remove(at);
            self.inbox_bytes -= footprint(&done);
            self.retire_fence(fence, &pages, table, region);
            lifted += 1;
        }
        Ok(lifted)
    }

    /// Lifts every fence of `table`: the engine knows the peer is gone (it disconnected, its
    /// process ended, it was restarted), so no late WRITE or READ of it can land. (Decode
    /// invalidating the peer's metadata is no such proof: it does not stop the peer writing
    /// decode's memory.) Zeroes the pages first. Returns how many were lifted.
    pub fn release_fences<R: PageRegion + ?Sized>(&mut self, table: &OwnershipTable, region: &mut R) -> usize {
        let (reads, other_reads): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.read_fences).into_iter().partition(|r| r.fence.is_in(table));
        self.read_fences = other_reads;
        let (mut mine, others): (Vec<Fence>, Vec<Fence>) =
            std::mem::take(&mut self.fenced).into_iter().partition(|f| f.is_in(table));
        self.fenced = others;
        // The READs' handles released with their fences: the peer is gone.
        mine.extend(reads.into_iter().map(|r| r.fence));
        let n = mine.len();
        for fence in mine {
            let pages: Vec<u32> = fence.pages().iter().map(|r| r.page.0).collect();
            self.retire_fence(fence, &pages, table, region);
        }
        n
    }

    /// Zeroes a fence's pages, drops the `Part` notices that named them, and lifts it.
    fn retire_fence<R: PageRegion + ?Sized>(
        &mut self,
        fence: Fence,
        pages: &[u32],
        table: &OwnershipTable,
        region: &mut R,
    ) {
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
    }

    /// Bytes the notices kept for later waits hold (at most [`INBOX_BYTES`]).
    pub fn inbox_bytes(&self) -> usize {
        self.inbox_bytes
    }

    /// Takes the agent's notifications into the inbox (on a selective link, those it
    /// [keeps](Self::keeps) while waiting for `waiting`).
    fn collect(&mut self, waiting: Option<RequestId>) -> Result<(), NixlError> {
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
    fn wait_where(
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

    /// Prefill, push: WRITEs `local`'s extents into the peer's pages `dest` (position by
    /// position, same lengths) with the notice `Written { dest extents, manifest }` as the
    /// transfer's notification (NIXL delivers it after the data). With parts on
    /// ([`set_parts`](Self::set_parts)), a larger transfer goes as several WRITEs posted at once,
    /// each but the last notified by a `Part` notice naming its extents, the last by `Written`
    /// (every extent, the manifest, the number of parts). Waits for completion.
    ///
    /// # Errors
    /// [`NixlError::Extents`], before anything is sent, when `src` and `dest` differ in length,
    /// an extent lies outside its region, or a source page is still held by an earlier failed
    /// push or staging ([`in_flight`](Self::in_flight)): a retry from those pages waits until
    /// [`settle_pushes`](Self::settle_pushes) (or [`settle_stages`](Self::settle_stages)) hands
    /// them back, so a page has one holder and comes back once, and a push's `Ok` never stands
    /// for a page an earlier WRITE still reads. A push that fails after posting a WRITE NIXL
    /// has not reported complete (the deadline passed, a NIXL call failed, a later part could
    /// not be posted) returns [`NixlError::InFlight`]: that WRITE may still read its source
    /// pages, which the link keeps until NIXL reports it complete
    /// ([`settle_pushes`](Self::settle_pushes) hands them back). Any other error leaves no WRITE
    /// of the push reading: all its source pages are free.
    pub fn push<R: PageRegion + ?Sized>(
        &mut self,
        local: &R,
        src: &[Extent],
        dest: &[PageId],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        self.push_parts(local, src, dest, request, deadline, |_, _, _| Ok(manifest.to_vec()))
    }

    /// Prefill, push, checksumming on the way: [`push`](Self::push) of `local`'s extents `src`
    /// as `header`'s request's prompt `prompt` into the peer's pages `dest` (the incarnations
    /// decode offered), building the manifest itself. With parts on
    /// ([`set_parts`](Self::set_parts)) and more than one part, each part's pages are
    /// checksummed right after the part is posted, while it flies (polled between pages); the
    /// last part's before it is posted, with the manifest. Every check decode makes
    /// is the same as for [`Manifest::build`]: this only moves the sender's CRCs off the
    /// critical path. [`push_prompt_ahead`](Self::push_prompt_ahead) also takes the CRCs of
    /// pages checksummed before the offer came.
    pub fn push_prompt<R: PageRegion + ?Sized>(
        &mut self,
        local: &R,
        src: &[Extent],
        header: TransferHeader,
        prompt: &[u32],
        dest: &[PageRef],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        self.push_prompt_ahead(local, src, header, prompt, dest, &[], deadline)
    }

    /// [`push_prompt`](Self::push_prompt) with the first `ahead.len()` pages already
    /// checksummed: `ahead[i]` is `src[i]`'s length and [`page_checksum`](crate::transfer::page_checksum),
    /// taken while prefill waited for decode's offer (its pages' CRCs do not depend on where they
    /// land, so prefill can take them as soon as its KV is written, page by page until the offer
    /// comes; benches/nixl.rs: `overlapped`). The other pages are checksummed as `push_prompt`
    /// does. A page changed after its CRC was taken lands with a CRC that does not match it:
    /// decode refuses the transfer ([`TransferError::PageChecksum`]), as for any other change.
    ///
    /// # Errors
    /// [`NixlError::Extents`], before anything is sent, when `ahead` holds more entries than
    /// `src` or an entry's length is not its extent's, and when the manifest cannot be built;
    /// otherwise as [`push`](Self::push).
    #[allow(clippy::too_many_arguments)]
    pub fn push_prompt_ahead<R: PageRegion + ?Sized>(
        &mut self,
        local: &R,
        src: &[Extent],
        header: TransferHeader,
        prompt: &[u32],
        dest: &[PageRef],
        ahead: &[(usize, u32)],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        if ahead.len() > src.len() {
            return Err(NixlError::Extents {
                reason: format!("{} pages checksummed ahead of a push of {}", ahead.len(), src.len()),
            });
        }
        if let Some(index) = ahead.iter().zip(src).position(|(&(len, _), e)| len != e.len as usize) {
            return Err(NixlError::Extents {
                reason: format!(
                    "page {index} was checksummed ahead over {} bytes, its extent is {}",
                    ahead[index].0, src[index].len
                ),
            });
        }
        let build = |checksums: &[(usize, u32)]| {
            Manifest::build_checksummed(header, prompt, dest, checksums)
                .map_err(|e| NixlError::Extents { reason: format!("manifest: {e}") })
        };
        // The lengths first: nothing is sent for a manifest that cannot be built.
        let lengths: Vec<(usize, u32)> = src.iter().map(|e| (e.len as usize, 1)).collect();
        build(&lengths)?;
        let pages: Vec<PageId> = dest.iter().map(|r| r.page).collect();
        // Each part but the last is checksummed on this thread right after it is posted, while
        // it and the parts before it keep moving (polled between pages; the first part leaves
        // at once); the last part before it is posted, as its notification carries the
        // manifest. No worker thread: on a machine whose cores UCX's copies already keep busy,
        // a thread adds contention, not overlap. A page changed by the engine meanwhile gets a
        // CRC that does not match what landed: refused either way.
        let bytes = src.iter().map(|e| local.page(e.page, e.len)).collect::<Result<Vec<_>, _>>()?;
        let mut sums: Vec<(usize, u32)> = Vec::with_capacity(src.len());
        sums.extend_from_slice(ahead);
        let agent = self.agent;
        self.push_parts(local, src, &pages, header.request, deadline, |part, last, in_flight| {
            // Before part k is posted: the parts posted so far, and the last part itself (less
            // what was checksummed ahead).
            let upto = if last { part.end } else { part.start };
            for page in bytes.get(sums.len()..upto).unwrap_or_default() {
                sums.push((page.len(), crc32fast::hash(page)));
                for p in in_flight.iter_mut() {
                    agent.poll(p)?;
                }
            }
            if last { Ok(build(&sums)?.encode()) } else { Ok(Vec::new()) }
        })
    }

    /// Posts `src` → `dest` in parts (see [`push`](Self::push)); before each part is posted,
    /// `manifest(the part's extents, is it the last part, parts in flight)` runs, and what it
    /// returns for the last part is the manifest. Waits for every part. On an error once a
    /// part was posted, the parts NIXL has not reported complete are kept with their source
    /// pages ([`hold`](Self::hold)), never released.
    fn push_parts<R: PageRegion + ?Sized>(
        &mut self,
        local: &R,
        src: &[Extent],
        dest: &[PageId],
        request: RequestId,
        deadline: Instant,
        mut manifest: impl FnMut(std::ops::Range<usize>, bool, &mut [Posted]) -> Result<Vec<u8>, NixlError>,
    ) -> Result<(), NixlError> {
        if src.len() != dest.len() {
            // Never a silent truncation: a push names each of its pages' destination.
            return Err(NixlError::Extents {
                reason: format!("{} source pages, {} destination pages", src.len(), dest.len()),
            });
        }
        self.refuse_held(src, "push")?;
        let written: Vec<Extent> = src.iter().zip(dest).map(|(s, d)| Extent { page: d.0, len: s.len }).collect();
        let layout = local.layout();
        // Every extent checked before the first part is posted: a push that cannot be posted
        // whole posts nothing (a later part refused would leave the earlier ones landing).
        for (s, w) in src.iter().zip(&written) {
            layout.extent_addr(s)?;
            self.peer_region.extent_addr(w)?;
        }
        let ends = part_ends(&written, self.part_bytes);
        let agent = self.agent;
        let mut posted: Vec<Posted> = Vec::with_capacity(ends.len());
        let mut start = 0;
        for (k, &end) in ends.iter().enumerate() {
            let made = match manifest(start..end, k + 1 == ends.len(), &mut posted) {
                Ok(made) => made,
                Err(e) => return Err(self.hold(request, src, &ends, posted, None, e, local.keep_alive())),
            };
            let notice = if k + 1 == ends.len() {
                Notice {
                    kind: NoticeKind::Written,
                    request,
                    extents: written.clone(),
                    manifest: made,
                    // `part_ends` makes at most `u16::MAX + 1` parts.
                    parts: u16::try_from(k).unwrap_or(u16::MAX),
                }
            } else {
                Notice {
                    kind: NoticeKind::Part,
                    request,
                    extents: written[start..end].to_vec(),
                    manifest: Vec::new(),
                    parts: 0,
                }
            };
            let message = notice.encode();
            let part = agent.post(
                Direction::Write,
                &layout,
                &src[start..end],
                &self.peer,
                &self.peer_region,
                &written[start..end],
                Some(&message),
            );
            match part {
                Ok(part) => posted.push(part),
                Err(e) => {
                    // Posting itself failed: NIXL may have started part of this WRITE and let it
                    // go on (no handle to wait for). Any earlier failure started nothing.
                    let started = matches!(&e, NixlError::Call { call, .. } if *call == POST_CALL);
                    let started = started.then_some(start..end);
                    return Err(self.hold(request, src, &ends, posted, started, e, local.keep_alive()));
                }
            }
            start = end;
        }
        match posted.iter_mut().try_for_each(|part| agent.wait(part, deadline)) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.hold(request, src, &ends, posted, None, e, local.keep_alive())),
        }
    }

    /// A push of `request` failed with `cause` after posting `posted` (the first parts of
    /// `src`, split at `ends`), and perhaps part of the part at `started`: keeps every WRITE NIXL
    /// has not reported complete (one more poll each), with its source pages. Those pages may
    /// still be read: they are reported in [`NixlError::InFlight`], and handed back by
    /// [`settle_pushes`](Self::settle_pushes) once NIXL reports the WRITE complete (a WRITE
    /// it reports failed, or one posted part-way, only by
    /// [`release_pushes`](Self::release_pushes)). Each WRITE kept keeps `keep` (the region pushed
    /// from) too. `cause` itself when nothing is kept.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &mut self,
        request: RequestId,
        src: &[Extent],
        ends: &[usize],
        posted: Vec<Posted>,
        started: Option<std::ops::Range<usize>>,
        cause: NixlError,
        keep: Option<KeepAlive>,
    ) -> NixlError {
        let pages_of = |range: std::ops::Range<usize>| src[range].iter().map(|e| e.page).collect::<Vec<u32>>();
        let mut held = Vec::new();
        let mut start = 0;
        for (mut part, &end) in posted.into_iter().zip(ends) {
            let pages = pages_of(start..end);
            start = end;
            let failed = match self.agent.poll(&mut part) {
                // Complete: nothing of it reads its pages any more.
                Ok(true) => continue,
                Ok(false) => false,
                Err(_) => true,
            };
            held.extend_from_slice(&pages);
            self.held.hold_push(PushWrite { request, pages, posted: Some(part), failed, keep: keep.clone() });
        }
        if let Some(range) = started {
            let pages = pages_of(range);
            held.extend_from_slice(&pages);
            self.held.hold_push(PushWrite { request, pages, posted: None, failed: true, keep });
        }
        if held.is_empty() {
            return cause;
        }
        NixlError::InFlight { direction: Direction::Write, request, pages: distinct(held), cause: Box::new(cause) }
    }

    /// Refuses (`Extents`, before anything is sent) a `what` of `src` that names a page the
    /// link still holds: one page, one holder at a time, so a page comes back once, when the
    /// transfer that may read it is done, and no later transfer's success makes it look free.
    fn refuse_held(&self, src: &[Extent], what: &str) -> Result<(), NixlError> {
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
    /// [`keep_alive`](PageRegion::keep_alive) with each held transfer (a
    /// [`HostRegion`](super::HostRegion)'s memory and registration, an
    /// [`EnginePool`](super::EnginePool)'s registration when kvguard made it). What no
    /// keep-alive covers stays the engine's to keep: an engine pool's memory, a region whose
    /// [`PageRegion`] hands none, and one staged with [`stage`](Self::stage) (no region given).
    pub fn in_flight(&self) -> Vec<(RequestId, Vec<u32>)> {
        self.held.in_flight()
    }

    /// Prefill: how many distinct pages [`in_flight`](Self::in_flight) lists.
    pub fn held_pages(&self) -> usize {
        self.held.pages()
    }

    /// Prefill: how many distinct pages WRITEs NIXL reported failed (or whose posting failed
    /// part-way) hold: [`settle_pushes`](Self::settle_pushes) never hands them back (NIXL reports
    /// no completion after a failure), only [`release_pushes`](Self::release_pushes), once the
    /// engine knows the peer gone. Watch it: with a live peer they stay held for the link's life.
    pub fn held_by_failed_writes(&self) -> usize {
        self.held.failed_pages()
    }

    /// Prefill: hands back the source pages of failed pushes whose WRITEs NIXL now reports
    /// complete (nothing more of them is read), by request; polling moves UCX along, so an idle
    /// prefill calls it too. A page comes back once, when the last held WRITE or staging that
    /// names it is done (a page a staging also holds comes back from
    /// [`settle_stages`](Self::settle_stages) then). A WRITE NIXL reports failed stays held until
    /// [`release_pushes`](Self::release_pushes): a failure is no proof that nothing more is
    /// read (NIXL's UCX back end reports one operation's failure while others of the transfer
    /// may still run), and neither is releasing it (see [`Posted`]).
    pub fn settle_pushes(&mut self) -> Vec<(RequestId, Vec<u32>)> {
        let agent = self.agent;
        self.held.settle_pushes(|write| match &mut write.posted {
            Some(posted) => agent.poll(posted).map_err(|_| ()),
            // Posted part-way: marked failed when held, never polled.
            None => Err(()),
        })
    }

    /// Prefill: hands back the source pages of every failed push still held, whatever NIXL
    /// says, and releases their WRITEs: the engine knows none of them can still run (the peer
    /// is gone: its process ended or it was restarted, and this agent's transfers to it
    /// failed). Each page once; a page a held staging also names stays held until that
    /// staging is settled or released. Dropping the link releases them too, handing nothing
    /// back: keep the pages of [`in_flight`](Self::in_flight) out of circulation until the agent
    /// itself is dropped (the link leaks what keeps their regions alive rather than free memory
    /// a released WRITE may still read).
    pub fn release_pushes(&mut self) -> Vec<(RequestId, Vec<u32>)> {
        self.held.release_pushes()
    }

    /// Prefill, pull: tells decode that `request`'s KV is staged in `local`'s extents `src`,
    /// with its manifest; then waits until decode has [released](NoticeKind::Released) them:
    /// a `Released` naming exactly these extents (decode sends it once it READ them, whatever
    /// its verdict). Decode's answer to another attempt of the same request names that
    /// attempt's extents, and a bare `Released` answers a [`decline`](Self::decline): neither
    /// ends this one.
    ///
    /// # Errors
    /// [`NixlError::Extents`], before anything is sent, when a page of `src` is still held by
    /// an earlier staging or failed push (see [`in_flight`](Self::in_flight)): decode's late
    /// `Released` for an earlier staging could not be told from this one's, and a page has one
    /// holder at a time (as for [`push`](Self::push)). Any other error comes once the `Staged`
    /// notice was handed to NIXL, so decode may READ the pages at any time after the call
    /// returned: [`NixlError::InFlight`] (direction [`Read`](Direction::Read), its cause the
    /// timeout or failure) names them, and the link holds them until decode's `Released` for
    /// this staging comes ([`settle_stages`](Self::settle_stages) hands them back) or the engine
    /// knows the peer gone ([`release_stages`](Self::release_stages)). Staging no extents holds
    /// nothing: such an error is its cause alone.
    ///
    /// It takes no region, so a held staging keeps none alive: keep the region staged from
    /// registered and allocated while [`in_flight`](Self::in_flight) names its pages, or stage
    /// with [`stage_from`](Self::stage_from), which keeps it.
    pub fn stage(
        &mut self,
        src: &[Extent],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        self.stage_keeping(src, request, manifest, deadline, || None)
    }

    /// Prefill, pull: [`stage`](Self::stage) of `local`'s extents `src` (`local` being the
    /// region decode's link READs from), the link keeping `local` alive
    /// ([`keep_alive`](PageRegion::keep_alive)) while it holds the staging after a failure, as
    /// for a failed push's WRITEs.
    ///
    /// # Errors
    /// [`NixlError::Extents`], before anything is sent, when an extent lies outside `local`;
    /// otherwise as [`stage`](Self::stage).
    pub fn stage_from<R: PageRegion + ?Sized>(
        &mut self,
        local: &R,
        src: &[Extent],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        let layout = local.layout();
        for e in src {
            layout.extent_addr(e)?;
        }
        self.stage_keeping(src, request, manifest, deadline, || local.keep_alive())
    }

    /// [`stage`](Self::stage), a staging held after a failure keeping what `keep` returns.
    fn stage_keeping(
        &mut self,
        src: &[Extent],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
        keep: impl FnOnce() -> Option<KeepAlive>,
    ) -> Result<(), NixlError> {
        self.refuse_held(src, "stage")?;
        let staged =
            Notice { kind: NoticeKind::Staged, request, extents: src.to_vec(), manifest: manifest.to_vec(), parts: 0 };
        let ours = |n: &Notice| n.extents == src;
        let outcome = self
            .send(&staged)
            .and_then(|()| self.wait_where(request, &[NoticeKind::Released], ours, deadline).map(|_| ()));
        match outcome {
            Ok(()) => Ok(()),
            Err(cause) if src.is_empty() => Err(cause),
            Err(cause) => {
                let pages: Vec<u32> = src.iter().map(|e| e.page).collect();
                self.held.hold_stage(Staging { request, extents: src.to_vec(), pages: pages.clone(), keep: keep() });
                Err(NixlError::InFlight {
                    direction: Direction::Read,
                    request,
                    pages: distinct(pages),
                    cause: Box::new(cause),
                })
            }
        }
    }

    /// Prefill: hands back the pages of failed stagings that decode has now released (its
    /// `Released` naming exactly a staging's extents came: it READ them, or never will), by
    /// request, each page once, when no held WRITE or staging names it any more. Takes the
    /// notices that arrived (those for other requests stay for their own waits), which also
    /// moves UCX along: an idle prefill calls it too, and a decode READing
    /// the pages needs this side's agent called. A staging whose `Released` never comes (decode
    /// was restarted, a full inbox dropped it: [`evicted`](Self::evicted)) stays held until
    /// [`release_stages`](Self::release_stages).
    ///
    /// # Errors
    /// [`NixlError::Call`] when the notifications cannot be taken: nothing handed back.
    pub fn settle_stages(&mut self) -> Result<Vec<(RequestId, Vec<u32>)>, NixlError> {
        if !self.held.any_stage() {
            return Ok(Vec::new());
        }
        self.collect(None)?;
        let (inbox, inbox_bytes) = (&mut self.inbox, &mut self.inbox_bytes);
        Ok(self.held.settle_stages(|staging| {
            let released = |n: &Notice| {
                n.kind == NoticeKind::Released && n.request == staging.request && n.extents == staging.extents
            };
            let Some(at) = inbox.iter().position(released) else { return false };
            let n = inbox.remove(at);
            *inbox_bytes -= footprint(&n);
            true
        }))
    }

    /// Prefill: hands back the pages of every failed staging still held, whatever came: the
    /// engine knows decode will READ none of them (the peer is gone: its process ended or it
    /// was restarted). Each page once; a page a held WRITE also names stays held until that
    /// WRITE is settled or released. Dropping the link hands nothing back: keep the pages of
    /// [`in_flight`](Self::in_flight) out of circulation while the peer may still READ them (the
    /// link leaks the keep-alives of the regions [`stage_from`](Self::stage_from) staged from;
    /// one staged with [`stage`](Self::stage) is yours to keep alive).
    pub fn release_stages(&mut self) -> Vec<(RequestId, Vec<u32>)> {
        self.held.release_stages()
    }

    /// Prefill: declines `request` for now, and waits until decode has taken the decline (its
    /// bare `Released`; one naming extents is decode's answer to a staging, kept for
    /// [`settle_stages`](Self::settle_stages)): with no progress thread a notification leaves
    /// only while the agent is called.
    pub fn decline(&mut self, request: RequestId, deadline: Instant) -> Result<(), NixlError> {
        self.send(&Notice::bare(NoticeKind::Declined, request))?;
        self.wait_where(request, &[NoticeKind::Released], |n| n.extents.is_empty(), deadline).map(|_| ())
    }

    /// Decode: receives the transfer `pinned` was pinned for (pin it with
    /// [`Receiver::pin`](crate::transfer::Receiver::pin) *before* asking the peer for it), into
    /// `region`, whose page `i` is the pool's page `i`.
    ///
    /// - `Direction::Write` (push): waits for prefill's `Written` notice, which NIXL delivers
    ///   after the data; its extents must be the pinned pages, in order.
    /// - `Direction::Read` (pull): waits for prefill's `Staged` notice, READs the staged extents
    ///   into the pinned pages, then sends `Released` (whatever the verdict).
    ///
    /// Then the pinned import checks the manifest and the landed bytes ([`PinnedImport::accept`]:
    /// request, tenant, token count, prompt digest, incarnations, per-page length and CRC32) and
    /// records coverage only if all hold; `land` sees each accepted page. On a refusal, a
    /// timeout, a transport error or a decline nothing is recorded as written and the pinned
    /// pages are scrubbed.
    #[allow(clippy::too_many_arguments)]
    pub fn receive<R: PageRegion + ?Sized>(
        &mut self,
        direction: Direction,
        pinned: PinnedImport<'_>,
        expected: &ExpectedTransfer<'_>,
        region: &mut R,
        deadline: Instant,
        land: impl FnMut(usize, crate::PageRef, &[u8]) -> Result<(), crate::transfer::LandError>,
    ) -> Result<Accepted, ImportError> {
        let pages: Vec<u32> = pinned.pages().iter().map(|r| r.page.0).collect();
        let table = pinned.table();
        // Best effort: a transport error here shows again in the wait below.
        let _ = self.settle_fences(table, region);
        let outcome = self.receive_pinned(direction, pinned, expected, region, deadline, land);
        if outcome.is_err() {
            // Best effort: the pages are still the request's; zero whatever landed. Pages
            // outside the region cannot have been written through it.
            let in_region: Vec<u32> = pages.into_iter().filter(|&p| p < region.layout().pages).collect();
            let _ = region.scrub(&in_region);
        }
        // A fenced push's late notice may have come meanwhile.
        let _ = self.settle_fences(table, region);
        // Parts of this transfer that came after its end are no use to a later one.
        let request = expected.request;
        self.drop_parts(request);
        if let Some(expected) = &mut self.expected {
            expected.remove(&request);
        }
        outcome
    }

    fn receive_pinned<R: PageRegion + ?Sized>(
        &mut self,
        direction: Direction,
        pinned: PinnedImport<'_>,
        expected: &ExpectedTransfer<'_>,
        region: &mut R,
        deadline: Instant,
        land: impl FnMut(usize, crate::PageRef, &[u8]) -> Result<(), crate::transfer::LandError>,
    ) -> Result<Accepted, ImportError> {
        let request = expected.request;
        let layout = region.layout();
        // Parts of an earlier, abandoned transfer of this request name bytes since overwritten.
        self.drop_parts(request);
        let pinned_pages: Vec<u32> = pinned.pages().iter().map(|r| r.page.0).collect();
        let mut strays = Vec::new();
        let table = pinned.table();
        let waited =
            self.wait_carrying(direction, request, &pinned_pages, &layout, &*region, deadline, &mut strays, table);
        let (notice, early) = match waited {
            Ok(found) => found,
            Err(_) if !strays.is_empty() => {
                // A part's WRITE landed outside the offer: those pages hold bytes nobody asked for.
                // The push did not finish: the rest of it may still WRITE the offered pages, so
                // they stay fenced (refused, never handed on) until its sender is done.
                pinned.overwritten(&strays);
                let e = TransferError::Pages { expected: pinned_pages.len(), found: pinned_pages.len(), index: None };
                let (e, fence) = pinned.refuse_fenced(expected, e);
                self.fenced.push(fence);
                return Err(ImportError::Refused(e));
            }
            Err(Waited::Declined) => {
                pinned.abort();
                // The decline taken; if this cannot be sent, prefill's own wait times out.
                let _ = self.send(&Notice::bare(NoticeKind::Released, request));
                return Err(ImportError::Declined);
            }
            Err(Waited::Failed(e)) => {
                if direction == Direction::Read && matches!(e, NixlError::Timeout { .. }) {
                    // Prefill may still stage this attempt: its late `Staged` is answered and set
                    // aside when it comes, not taken for a retry's.
                    if self.abandoned.len() == ABANDONED_CAP {
                        self.abandoned.pop_front();
                    }
                    self.abandoned.push_back((request, pinned.pages().to_vec()));
                }
                if direction == Direction::Write {
                    // Prefill may still WRITE these pages (the wait timed out, or decode could
                    // not read its notices: no proof either way): they stay pinned (out of
                    // every other request's reach, released or not) until its late notice
                    // says it is done.
                    self.fenced.push(pinned.fence());
                    return Err(ImportError::Aborted(e));
                }
                pinned.abort();
                return Err(ImportError::Aborted(e));
            }
        };
        if direction == Direction::Write {
            // A push's WRITEs land where its notices say: exactly the offered pages, in order.
            // Any other page named was written without being offered: treated as overwritten.
            let mut outside = strays.clone();
            outside.extend(notice.extents.iter().map(|e| e.page).filter(|p| !pinned_pages.contains(p)).map(PageId));
            if !outside.is_empty() {
                pinned.overwritten(&outside);
            }
            // Refused here when a WRITE landed outside the offer; a notice naming fewer of the
            // offered pages (or another order) wrote nowhere else, and is refused below, with
            // the manifest's own verdict where it has one (a misrouted prompt, say).
            if !outside.is_empty() || notice.extents.len() > pinned_pages.len() {
                let index = notice.extents.iter().zip(&pinned_pages).position(|(e, &p)| e.page != p);
                let index = index.or(Some(pinned_pages.len()));
                let e = TransferError::Pages { expected: pinned_pages.len(), found: notice.extents.len(), index };
                return Err(ImportError::Refused(pinned.refuse(expected, e)));
            }
        }
        // Where each extent landed (push) or is to land (pull): the pinned page at its position.
        let mut landed = Vec::with_capacity(notice.extents.len().min(pinned_pages.len()));
        for (index, (extent, &page)) in notice.extents.iter().zip(&pinned_pages).enumerate() {
            if direction == Direction::Write && extent.page != page {
                let e = TransferError::Pages {
                    expected: pinned_pages.len(),
                    found: notice.extents.len(),
                    index: Some(index),
                };
                return Err(ImportError::Refused(pinned.refuse(expected, e)));
            }
            if extent.len > layout.page_bytes {
                let e = TransferError::PageLength {
                    index,
                    expected: u64::from(layout.page_bytes),
                    found: extent.len as usize,
                };
                if direction == Direction::Read {
                    // Refused before any READ: prefill may reuse what it staged. Best effort:
                    // unsent, prefill keeps its staged pages held.
                    let staged = notice.extents.clone();
                    let _ = self.send(&Notice { extents: staged, ..Notice::bare(NoticeKind::Released, request) });
                }
                return Err(ImportError::Refused(pinned.refuse(expected, e)));
            }
            landed.push(Extent { page, len: extent.len });
        }
        if direction == Direction::Read {
            let src = &notice.extents[..landed.len()];
            let posted = self.agent.post(Direction::Read, &layout, &landed, &self.peer, &self.peer_region, src, None);
            let read = match posted {
                // Never posted: nothing of it can land.
                Err(e) => Err(e),
                Ok(mut read) => match self.agent.wait(&mut read, deadline) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        // Posted and not complete: releasing it may not stop it, and the READ
                        // could land in these pages after their next owner wrote them. They
                        // stay fenced with the READ's handle until NIXL reports it complete,
                        // when prefill is told it may reuse what it staged.
                        let staged = notice.extents.clone();
                        self.read_fences.push(ReadFence { request, fence: pinned.fence(), read, staged });
                        return Err(ImportError::Aborted(e));
                    }
                },
            };
            // Naming what it read: prefill's wait for this attempt ends, no other's.
            let released =
                self.send(&Notice { extents: notice.extents.clone(), ..Notice::bare(NoticeKind::Released, request) });
            if let Err(e) = read.and(released) {
                pinned.abort();
                return Err(ImportError::Aborted(e));
            }
        }
        let mut bytes = Vec::with_capacity(landed.len());
        for e in &landed {
            match region.page(e.page, e.len) {
                Ok(b) => bytes.push(b),
                Err(err) => {
                    pinned.abort();
                    return Err(ImportError::Aborted(err));
                }
            }
        }
        // An early checksum counts only for the length it was taken over.
        let checksums: Vec<Option<u32>> = landed
            .iter()
            .zip(&early)
            .map(|(e, early)| early.filter(|&(len, _)| len == e.len).map(|(_, crc)| crc))
            .collect();
        pinned.accept_checksummed(expected, &notice.manifest, &bytes, &checksums, land).map_err(ImportError::Refused)
    }

    /// Waits for the notice that carries the manifest (`Written` for a push, `Staged` for a
    /// pull) and, for a push in parts, for as many `Part`s as it counts. Each part's pinned pages
    /// are checksummed as its notice comes (NIXL delivers it after that part's data), on this
    /// thread, while the later parts wait in the socket's buffers. Returns the notice and each
    /// pinned page's early (length, CRC32): none for a page named twice, not pinned, longer than
    /// a page, or unreadable (checked after the transfer like any other).
    ///
    /// A push's `Part` extents that name no pinned page are appended to `strays` (their WRITE
    /// landed outside the offer), also when the wait then fails.
    #[allow(clippy::too_many_arguments)]
    fn wait_carrying<R: PageRegion + ?Sized>(
        &mut self,
        direction: Direction,
        request: RequestId,
        pinned_pages: &[u32],
        layout: &RegionLayout,
        region: &R,
        deadline: Instant,
        strays: &mut Vec<PageId>,
        table: &OwnershipTable,
    ) -> Result<(Notice, Vec<EarlySum>), Waited> {
        let carrying = match direction {
            Direction::Write => NoticeKind::Written,
            Direction::Read => NoticeKind::Staged,
        };
        let mut named = vec![0u8; pinned_pages.len()];
        let mut early: Vec<EarlySum> = vec![None; pinned_pages.len()];
        let mut parts = 0usize;
        let mut notice: Option<Notice> = None;
        loop {
            if let Some(n) = &notice
                && parts >= usize::from(n.parts)
            {
                break;
            }
            let kinds: &[NoticeKind] = match notice {
                Some(_) => &[NoticeKind::Part],
                None => &[carrying, NoticeKind::Part, NoticeKind::Declined],
            };
            // A late `Written` or `Part` of a push of this request that timed out (its pages
            // fenced) is not this transfer's: a `Written` stays in the inbox for
            // `settle_fences`, a `Part` naming only fenced pages is dropped with its fence.
            // (Fenced pages stay pinned: no later attempt of the request is offered them.)
            let fenced: Vec<Vec<PageRef>> = self
                .fenced
                .iter()
                .filter(|f| f.request() == request && f.is_in(table))
                .map(|f| f.pages().to_vec())
                .collect();
            let in_a_fence = |page: u32| fenced.iter().any(|f| f.iter().any(|r| r.page.0 == page));
            let not_fenced = |n: &Notice| match n.kind {
                _ if fenced.is_empty() => true,
                NoticeKind::Written => !Manifest::decode(&n.manifest)
                    .is_ok_and(|m| fenced.iter().any(|f| m.pages().iter().map(|e| e.dest).eq(f.iter().copied()))),
                NoticeKind::Part => n.extents.is_empty() || !n.extents.iter().all(|e| in_a_fence(e.page)),
                _ => true,
            };
            let n = self.wait_where(request, kinds, not_fenced, deadline).map_err(Waited::Failed)?;
            match n.kind {
                NoticeKind::Declined => return Err(Waited::Declined),
                NoticeKind::Staged if self.answer_abandoned(&n).map_err(Waited::Failed)? => continue,
                NoticeKind::Part => {
                    parts += 1;
                    if direction != Direction::Write {
                        continue;
                    }
                    for extent in &n.extents {
                        let Some(at) = pinned_pages.iter().position(|&p| p == extent.page) else {
                            strays.push(PageId(extent.page));
                            continue;
                        };
                        named[at] = named[at].saturating_add(1);
                        if named[at] > 1 {
                            // Named twice: its bytes may have changed since; checked afterwards.
                            early[at] = None;
                            continue;
                        }
                        if extent.len > layout.page_bytes {
                            continue;
                        }
                        if let Ok(bytes) = region.page(extent.page, extent.len) {
                            early[at] = Some((extent.len, crate::transfer::page_checksum(&bytes)));
                        }
                    }
                }
                _ => notice = Some(n),
            }
        }
        // The loop leaves only once the carrying notice came.
        notice.map(|n| (n, early)).ok_or(Waited::Failed(NixlError::Notice { reason: "no carrying notice".to_owned() }))
    }
}

impl NixlLink<'_> {
    /// Whether `staged` is the late answer to a pull of its request that timed out (its
    /// manifest names exactly the page incarnations that pull had pinned): then prefill is told
    /// it may reuse those staged pages (`Released` naming them) and the notice is set aside. A
    /// retry's own `Staged` names the retry's incarnations, and a stale one for any other
    /// attempt is still refused by the checks.
    fn answer_abandoned(&mut self, staged: &Notice) -> Result<bool, NixlError> {
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
    fn answer_late_stagings(&mut self) -> Result<(), NixlError> {
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

/// A pull whose READ was posted and did not complete: its pages fenced with the READ's handle,
/// and the extents prefill staged, to release when the READ is over.
#[derive(Debug)]
struct ReadFence {
    request: RequestId,
    fence: Fence,
    read: Posted,
    staged: Vec<Extent>,
}

/// A pinned page's (length, CRC32) taken as its part landed, if it was.
type EarlySum = Option<(u32, u32)>;

/// How waiting for the carrying notice ended without it.
enum Waited {
    Declined,
    Failed(NixlError),
}

/// Where each part of a push ends (exclusive indices into its extents): consecutive extents
/// adding up to about `part_bytes`, at most `u16::MAX + 1` parts, never an empty one; one part
/// when parts are off.
fn part_ends(extents: &[Extent], part_bytes: Option<u64>) -> Vec<usize> {
    let Some(part_bytes) = part_bytes else { return vec![extents.len()] };
    let total: u64 = extents.iter().map(|e| u64::from(e.len)).sum();
    let part = part_bytes.max(total.div_ceil(u64::from(u16::MAX) + 1));
    let mut ends = Vec::new();
    let mut bytes = 0u64;
    for (i, e) in extents.iter().enumerate() {
        bytes += u64::from(e.len);
        if bytes >= part && i + 1 < extents.len() {
            ends.push(i + 1);
            bytes = 0;
        }
    }
    ends.push(extents.len());
    ends
}
