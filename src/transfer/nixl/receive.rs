//! Decode's receive: waiting for the notice that carries the manifest (and a push's parts,
//! checksummed as they land), READing a pull's staged pages, and checking what landed; on a
//! refusal, an error, a timeout or a decline nothing is recorded and the pages are scrubbed.

use super::agent::POST_CALL;
use super::link::{Fenced, ReadFence};
use super::{Direction, Extent, NixlError, NixlLink, Notice, NoticeKind, PageRegion, RegionLayout};
use crate::OwnershipTable;
use crate::ids::{PageId, PageRef, RequestId};
use crate::transfer::{Accepted, ExpectedTransfer, Manifest, PinnedImport, TransferError};
use std::time::Instant;

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

impl NixlLink<'_> {
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
    ///
    /// A transfer given up on while it may still land (a push that timed out or failed, a READ
    /// that outlived its wait or whose posting failed) leaves its pages fenced
    /// ([`fenced`](Self::fenced)), and the link keeps `region`'s
    /// [`keep_alive`](PageRegion::keep_alive) with the fence: dropping a
    /// [`HostRegion`](super::HostRegion) meanwhile frees nothing, and the late WRITE or READ lands
    /// in memory still allocated and registered. The share goes when
    /// [`settle_fences`](Self::settle_fences) lifts the fence (nothing more lands), and is leaked
    /// when [`release_fences`](Self::release_fences) lifts it or the link is dropped while it
    /// stands. What no keep-alive covers (an engine pool's own memory, a region whose
    /// [`PageRegion`] hands none) stays the engine's to keep while [`fenced`](Self::fenced) counts
    /// a transfer into it.
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
                self.fenced.push(Fenced { fence, keep: region.keep_alive() });
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
                    self.remember_abandoned(request, pinned.pages().to_vec());
                }
                if direction == Direction::Write {
                    // Prefill may still WRITE these pages (the wait timed out, or decode could
                    // not read its notices: no proof either way): they stay pinned (out of
                    // every other request's reach, released or not) until its late notice
                    // says it is done, and `region` kept alive for it to land in.
                    self.fenced.push(Fenced { fence: pinned.fence(), keep: region.keep_alive() });
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
                Err(e) if matches!(&e, NixlError::Call { call, .. } if *call == POST_CALL) => {
                    // Posting itself failed: NIXL may have started part of this READ and let it
                    // go on, with no handle to wait for (as for a push's WRITE). Its pages stay
                    // fenced until release_fences (the peer known gone), and prefill is not told
                    // to reuse what it staged: its settle_stages keeps holding it.
                    self.fenced.push(Fenced { fence: pinned.fence(), keep: region.keep_alive() });
                    return Err(ImportError::Aborted(e));
                }
                // Never posted (an earlier call failed): nothing of it can land.
                Err(e) => Err(e),
                Ok(mut read) => match self.agent.wait(&mut read, deadline) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        // Posted and not complete: releasing it may not stop it, and the READ
                        // could land in these pages after their next owner wrote them. They
                        // stay fenced with the READ's handle until NIXL reports it complete,
                        // when prefill is told it may reuse what it staged; `region` is kept
                        // alive for it to land in meanwhile.
                        let (staged, keep) = (notice.extents.clone(), region.keep_alive());
                        self.read_fences.push(ReadFence { request, fence: pinned.fence(), read, staged, keep });
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
                .filter(|f| f.fence.request() == request && f.fence.is_in(table))
                .map(|f| f.fence.pages().to_vec())
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

/// A pinned page's (length, CRC32) taken as its part landed, if it was.
type EarlySum = Option<(u32, u32)>;

/// How waiting for the carrying notice ended without it.
enum Waited {
    Declined,
    Failed(NixlError),
}
