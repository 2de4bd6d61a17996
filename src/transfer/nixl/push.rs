//! Prefill's push: WRITEs of a request's pages into decode's, in parts whose checksums overlap
//! the transfer, the manifest riding on the last part's notification; and the WRITEs of a push
//! that failed, held with their source pages until NIXL reports them complete.

use super::agent::POST_CALL;
use super::held::{PushWrite, distinct};
use super::{Direction, Extent, KeepAlive, NixlError, NixlLink, Notice, NoticeKind, PageRegion, Posted};
use crate::ids::{PageId, PageRef, RequestId};
use crate::transfer::{Manifest, TransferHeader};
use std::time::Instant;

impl NixlLink<'_> {
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
    /// decode refuses the transfer
    /// ([`TransferError::PageChecksum`](crate::transfer::TransferError::PageChecksum)), as for
    /// any other change.
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
    pub(super) fn hold(
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
