//! The checked protocol between one prefill and one decode agent: pushes and pulls of a
//! request's pages with the manifest riding along, and decode's receive, which fails closed.

use super::{Direction, Extent, HostRegion, NixlAgent, NixlError, Notice, NoticeKind, RegionLayout};
use crate::ids::{PageId, RequestId};
use crate::transfer::{Accepted, ExpectedTransfer, PinnedImport, TransferError};
use std::time::Instant;

/// Notices kept for requests nobody waits for yet; past this, the oldest are dropped (a peer
/// cannot make decode hold unbounded memory).
pub const INBOX_CAP: usize = 4_096;

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
#[derive(Debug)]
pub struct NixlLink<'a> {
    agent: &'a NixlAgent,
    peer: String,
    peer_region: RegionLayout,
    inbox: Vec<Notice>,
    malformed: u64,
}

impl<'a> NixlLink<'a> {
    /// Connects `agent` to the peer whose metadata and region layout came out of band.
    pub fn connect(agent: &'a NixlAgent, peer_metadata: &[u8], peer_region: RegionLayout) -> Result<Self, NixlError> {
        let peer = agent.connect(peer_metadata)?;
        agent.make_connection(&peer)?;
        Ok(NixlLink { agent, peer, peer_region, inbox: Vec::new(), malformed: 0 })
    }

    /// The peer's agent name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The peer's pages.
    pub fn peer_region(&self) -> RegionLayout {
        self.peer_region
    }

    /// Notifications from the peer that were not kvguard notices, or were damaged (dropped).
    pub fn malformed(&self) -> u64 {
        self.malformed
    }

    /// Sends `notice` to the peer, then moves UCX along for a moment ([`FLUSH`]): with no
    /// progress thread a notification leaves only while the agent is called, and NIXL has no
    /// completion for it. Notices that arrive meanwhile are kept.
    pub fn send(&mut self, notice: &Notice) -> Result<(), NixlError> {
        self.agent.notify(&self.peer, &notice.encode())?;
        let until = Instant::now() + FLUSH;
        while Instant::now() < until {
            self.collect()?;
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Takes the agent's notifications into the inbox.
    fn collect(&mut self) -> Result<(), NixlError> {
        for (from, bytes) in self.agent.take_notifications()? {
            if from != self.peer {
                continue;
            }
            match Notice::decode(&bytes) {
                Ok(n) => {
                    if self.inbox.len() == INBOX_CAP {
                        self.inbox.remove(0);
                    }
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
        let wanted = |n: &Notice| n.request == request && kinds.contains(&n.kind);
        let mut spins = 0u32;
        loop {
            if let Some(i) = self.inbox.iter().position(wanted) {
                return Ok(self.inbox.remove(i));
            }
            self.collect()?;
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
    /// transfer's notification (NIXL delivers it after the data). Waits for completion.
    pub fn push(
        &self,
        local: &HostRegion,
        src: &[Extent],
        dest: &[PageId],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        let written: Vec<Extent> = src.iter().zip(dest).map(|(s, d)| Extent { page: d.0, len: s.len }).collect();
        let notice =
            Notice { kind: NoticeKind::Written, request, extents: written.clone(), manifest: manifest.to_vec() };
        let src = &src[..written.len()];
        let message = notice.encode();
        self.agent.transfer(
            Direction::Write,
            &local.layout(),
            src,
            &self.peer,
            &self.peer_region,
            &written,
            Some(&message),
            deadline,
        )
    }

    /// Prefill, pull: tells decode that `request`'s KV is staged in `local`'s extents `src`,
    /// with its manifest; then waits until decode has [released](NoticeKind::Released) them.
    pub fn stage(
        &mut self,
        src: &[Extent],
        request: RequestId,
        manifest: &[u8],
        deadline: Instant,
    ) -> Result<(), NixlError> {
        self.send(&Notice { kind: NoticeKind::Staged, request, extents: src.to_vec(), manifest: manifest.to_vec() })?;
        self.wait(request, &[NoticeKind::Released], deadline).map(|_| ())
    }

    /// Prefill: declines `request` for now, and waits until decode has taken the decline (its
    /// `Released`): with no progress thread a notification leaves only while the agent is called.
    pub fn decline(&mut self, request: RequestId, deadline: Instant) -> Result<(), NixlError> {
        self.send(&Notice::bare(NoticeKind::Declined, request))?;
        self.wait(request, &[NoticeKind::Released], deadline).map(|_| ())
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
    pub fn receive(
        &mut self,
        direction: Direction,
        pinned: PinnedImport<'_>,
        expected: &ExpectedTransfer<'_>,
        region: &mut HostRegion,
        deadline: Instant,
        land: impl FnMut(usize, crate::PageRef, &[u8]),
    ) -> Result<Accepted, ImportError> {
        let pages: Vec<u32> = pinned.pages().iter().map(|r| r.page.0).collect();
        let outcome = self.receive_pinned(direction, pinned, expected, region, deadline, land);
        if outcome.is_err() {
            // Best effort: the pages are still the request's; zero whatever landed. Pages
            // outside the region cannot have been written through it.
            let in_region: Vec<u32> = pages.into_iter().filter(|&p| p < region.layout().pages).collect();
            let _ = region.scrub(in_region);
        }
        outcome
    }

    fn receive_pinned(
        &mut self,
        direction: Direction,
        pinned: PinnedImport<'_>,
        expected: &ExpectedTransfer<'_>,
        region: &mut HostRegion,
        deadline: Instant,
        land: impl FnMut(usize, crate::PageRef, &[u8]),
    ) -> Result<Accepted, ImportError> {
        let request = expected.request;
        let carrying = match direction {
            Direction::Write => NoticeKind::Written,
            Direction::Read => NoticeKind::Staged,
        };
        let notice = match self.wait(request, &[carrying, NoticeKind::Declined], deadline) {
            Ok(n) if n.kind == NoticeKind::Declined => {
                pinned.abort();
                // The decline taken; if this cannot be sent, prefill's own wait times out.
                let _ = self.send(&Notice::bare(NoticeKind::Released, request));
                return Err(ImportError::Declined);
            }
            Ok(n) => n,
            Err(e) => {
                pinned.abort();
                return Err(ImportError::Aborted(e));
            }
        };
        let layout = region.layout();
        // Where each extent landed (push) or is to land (pull): the pinned page at its position.
        let mut landed = Vec::with_capacity(notice.extents.len().min(pinned.pages().len()));
        for (index, (extent, page)) in notice.extents.iter().zip(pinned.pages()).enumerate() {
            if direction == Direction::Write && extent.page != page.page.0 {
                let e = TransferError::Pages {
                    expected: pinned.pages().len(),
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
                return Err(ImportError::Refused(pinned.refuse(expected, e)));
            }
            landed.push(Extent { page: page.page.0, len: extent.len });
        }
        if direction == Direction::Read {
            let src = &notice.extents[..landed.len()];
            let read = self.agent.transfer(
                Direction::Read,
                &layout,
                &landed,
                &self.peer,
                &self.peer_region,
                src,
                None,
                deadline,
            );
            let released = self.send(&Notice::bare(NoticeKind::Released, request));
            if let Err(e) = read.and(released) {
                pinned.abort();
                return Err(ImportError::Aborted(e));
            }
        }
        let mut bytes = Vec::with_capacity(landed.len());
        for e in &landed {
            match region.bytes(e.page, e.len) {
                Ok(b) => bytes.push(b),
                Err(err) => {
                    pinned.abort();
                    return Err(ImportError::Aborted(err));
                }
            }
        }
        pinned.accept(expected, &notice.manifest, &bytes, land).map_err(ImportError::Refused)
    }
}
