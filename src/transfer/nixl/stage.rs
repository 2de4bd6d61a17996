//! Prefill's side of a pull: staging a request's pages for decode to READ and waiting for its
//! `Released`, a staging that failed held until decode releases it; and declining a request.

use super::held::{Staging, distinct};
use super::link::footprint;
use super::{Direction, Extent, KeepAlive, NixlError, NixlLink, Notice, NoticeKind, PageRegion};
use crate::ids::RequestId;
use std::time::Instant;

impl NixlLink<'_> {
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
}
