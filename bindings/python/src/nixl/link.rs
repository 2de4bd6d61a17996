//! `NixlLink`, one side's connection to its peer: its one `#[pymethods]` block holds the
//! protocol's calls (prefill's push, push_prompt, stage and decline; decode's expect, abandon,
//! forget and receive; the fences; the settling and releasing of held pages), and beside it the
//! regions the link keeps alive while held WRITEs or READs may still read them.
//!
//! `unsafe` here: the core link's borrow of the agent its Python object keeps alive, with its
//! `// SAFETY:` argument.

use super::agent::NixlAgent;
use super::region::RegionArg;
use super::{busy, bytes_arg, deadline, extents, nixl_error, page_ids, with_kind};
use crate::transfer::{Accepted, PinnedImport, land_page, refused};
use kvguard::RequestId;
use kvguard::transfer::nixl as core;
use kvguard::transfer::nixl::PageRegion;
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// One side's connection to its peer, over which the checked protocol runs (docs/transfer.md).
///
/// NixlLink(agent, peer_metadata, peer_layout, *, part_bytes=2 MiB): the peer's agent metadata
/// and region layout, received out of band; this side's pushes past part_bytes go in parts,
/// the checksums overlapped with the transfer (None: one WRITE, checked in series).
/// Prefill: push (WRITE + the manifest as the notification), stage (pull: tell decode where the
/// KV is, wait for its release) or decline. Decode: receive.
/// Every wait releases the GIL; `timeout` is in seconds. One call at a time per link (and per
/// region): a second thread's call meanwhile raises RuntimeError rather than wait.
#[pyclass(frozen, module = "kvguard")]
pub struct NixlLink {
    // Dropped first: the link borrows the agent kept alive by `agent`.
    link: Mutex<core::NixlLink<'static>>,
    /// The regions (HostRegion, EnginePool) that held WRITEs of failed pushes may still read:
    /// kept alive (registered, allocated) until the link holds no page (see `Drop`).
    held_regions: Mutex<Vec<Py<PyAny>>>,
    agent: Py<NixlAgent>,
}

impl Drop for NixlLink {
    fn drop(&mut self) {
        // Dropping the core link released its held WRITEs, which does not stop them: the regions
        // they read are never freed (leaked) rather than freed while UCX may still read them.
        if self.link.get_mut().held_pages() > 0 {
            std::mem::forget(std::mem::take(self.held_regions.get_mut()));
        }
    }
}

impl NixlLink {
    /// After a push from `region`: keeps it alive while the link holds pages (a failed push's
    /// WRITEs may still read it), lets the kept regions go once it holds none.
    fn keep_region(&self, link: &core::NixlLink<'static>, region: &Bound<'_, PyAny>, failed: bool) {
        let mut kept = self.held_regions.lock();
        if link.held_pages() == 0 {
            kept.clear();
        } else if failed && !kept.iter().any(|r| r.bind(region.py()).is(region)) {
            kept.push(region.clone().unbind());
        }
    }

    /// After a settle: lets the kept regions go once the link holds no page.
    fn let_regions_go(&self, link: &core::NixlLink<'static>) {
        if link.held_pages() == 0 {
            self.held_regions.lock().clear();
        }
    }

    /// After a release (transfers let go with nothing to prove them done: a released WRITE
    /// still runs, decode may still READ a staging): the regions kept are never freed (leaked,
    /// as when the link is dropped holding pages); any later hold keeps its region anew.
    fn leak_regions(&self, held_before: usize) {
        if held_before > 0 {
            for region in std::mem::take(&mut *self.held_regions.lock()) {
                std::mem::forget(region);
            }
        }
    }
}

impl NixlLink {
    /// Runs `body` on the link, `table`'s core and `region` (locked), the GIL released: the
    /// fence calls' shared shape.
    fn with_fences<T: Send>(
        &self,
        py: Python<'_>,
        table: &Bound<'_, crate::table::OwnershipTable>,
        region: &Bound<'_, PyAny>,
        body: impl FnOnce(&mut core::NixlLink<'static>, &kvguard::OwnershipTable, &mut (dyn PageRegion + Send)) -> T + Send,
    ) -> PyResult<T> {
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let mut region = RegionArg::lock(region)?;
        let table = table.get().core();
        let (link, region) = (&mut *link, region.region());
        Ok(py.detach(|| body(link, table, region)))
    }
}

#[pymethods]
impl NixlLink {
    #[new]
    #[pyo3(signature = (agent, peer_metadata, peer_layout, *, part_bytes = Some(core::PART_BYTES)))]
    fn new(
        py: Python<'_>,
        agent: Py<NixlAgent>,
        peer_metadata: &Bound<'_, PyAny>,
        peer_layout: &Bound<'_, PyAny>,
        part_bytes: Option<u64>,
    ) -> PyResult<NixlLink> {
        let metadata = bytes_arg(peer_metadata, "peer_metadata")?;
        let layout =
            core::RegionLayout::decode(&bytes_arg(peer_layout, "peer_layout")?).map_err(|e| nixl_error(py, &e))?;
        // SAFETY: the agent lives inside the Python object `agent`, which this link keeps alive
        // (its `agent` field) and which never moves while alive; the core link that borrows it
        // is dropped first (declared first), so the borrow never outlives the agent.
        let core_agent: &'static core::NixlAgent = unsafe { &*std::ptr::from_ref(&agent.get().agent) };
        let mut link =
            py.detach(|| core::NixlLink::connect(core_agent, &metadata, layout)).map_err(|e| nixl_error(py, &e))?;
        link.set_parts(part_bytes);
        Ok(NixlLink { link: Mutex::new(link), held_regions: Mutex::new(Vec::new()), agent })
    }

    /// The peer's agent name.
    #[getter]
    fn peer(&self) -> PyResult<String> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.peer().to_owned())
    }

    /// Notifications from the peer that were not kvguard notices or were damaged (dropped).
    #[getter]
    fn malformed(&self) -> PyResult<u64> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.malformed())
    }

    /// Notices a selective link (see expect) dropped on arrival: for requests it did not expect.
    #[getter]
    fn unasked(&self) -> PyResult<u64> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.unasked())
    }

    /// Notices dropped from a full inbox (oldest first) to make room: a transfer that lost one
    /// times out (a push's pages fenced), never accepted on a guess.
    #[getter]
    fn evicted(&self) -> PyResult<u64> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.evicted())
    }

    /// Bytes of notices kept for requests nobody waits for yet (at most 16 MiB).
    #[getter]
    fn inbox_bytes(&self) -> PyResult<usize> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.inbox_bytes())
    }

    /// Decode: `request`'s (int) transfer is coming over this link; call it before asking the
    /// peer for it. The first call makes the link selective: from then on a notice for a request
    /// it does not expect (and with no fenced push or abandoned pull here) is dropped as it
    /// arrives (counted by unasked). receive forgets the request when it ends: expect it again
    /// before a retry. A link never told (prefill's) keeps every notice, within its bounds.
    fn expect(&self, request: u64) -> PyResult<()> {
        self.link.try_lock().ok_or_else(|| busy("link"))?.expect(RequestId(request));
        Ok(())
    }

    /// Decode: gives up on `pinned` (a PinnedImport) without a receive, the request having
    /// ended while its transfer was offered. direction 'write' (a push, which may still WRITE
    /// the offered pages): they stay fenced until its late notice comes (settle_fences) or
    /// release_fences; 'read' (a pull, nothing moved): unpinned. Never abort() an offered push.
    fn abandon(&self, pinned: &Bound<'_, PinnedImport>, direction: &str) -> PyResult<()> {
        let direction = match direction {
            "write" => core::Direction::Write,
            "read" => core::Direction::Read,
            other => return Err(PyValueError::new_err(format!("direction must be 'write' or 'read', got {other:?}"))),
        };
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let (pin, _expected, _table) = pinned.get().take()?;
        link.abandon(direction, pin);
        Ok(())
    }

    /// Decode: no longer expects `request` (given up on without a receive); its notices kept so
    /// far are dropped. Returns whether it was expected.
    fn forget(&self, request: u64) -> PyResult<bool> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.forget(RequestId(request)))
    }

    /// Transfers whose pages are still fenced (pushes that did not finish, pulls whose READ did
    /// not complete): pinned in their table, out of every other request's reach even once
    /// released, until the transfer is known done with them.
    #[getter]
    fn fenced(&self) -> PyResult<usize> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.fenced())
    }

    /// Lifts the fences of `table` whose transfer is done (a push's late notice has come, a
    /// pull's READ completed: nothing more of them will land): their pages are zeroed in
    /// `region` (a HostRegion or an EnginePool) and unpinned. receive does it at its start and end; call it when idle too. Returns how
    /// many were lifted.
    fn settle_fences(
        &self,
        py: Python<'_>,
        table: &Bound<'_, crate::table::OwnershipTable>,
        region: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        self.with_fences(py, table, region, |link, table, region| link.settle_fences(table, region))
            .and_then(|lifted| lifted.map_err(|e| nixl_error(py, &e)))
    }

    /// Lifts every fence of `table`: the engine knows the peer is gone (disconnected, its
    /// process ended, restarted), so no late WRITE or READ can land. The pages are zeroed in `region` first.
    fn release_fences(
        &self,
        py: Python<'_>,
        table: &Bound<'_, crate::table::OwnershipTable>,
        region: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        self.with_fences(py, table, region, |link, table, region| link.release_fences(table, region))
    }

    /// Prefill: [(request, [page])] the source pages that WRITEs of failed pushes, or decode's
    /// READs of failed stagings, may still read (their NixlError.in_flight), each page once: not
    /// to be reused, pushed or staged until settle_pushes or settle_stages hands them back.
    #[getter]
    fn in_flight(&self) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        Ok(link.in_flight().into_iter().map(|(r, pages)| (r.0, pages)).collect())
    }

    /// Prefill: how many distinct pages in_flight lists.
    #[getter]
    fn held_pages(&self) -> PyResult<usize> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.held_pages())
    }

    /// Prefill: how many distinct pages WRITEs NIXL reported failed (or posted part-way) hold:
    /// settle_pushes never hands them back (NIXL reports no completion after a failure), only
    /// release_pushes once the peer is known gone; with a live peer, held for the link's life.
    #[getter]
    fn held_by_failed_writes(&self) -> PyResult<usize> {
        Ok(self.link.try_lock().ok_or_else(|| busy("link"))?.held_by_failed_writes())
    }

    /// Prefill: [(request, [page])] the source pages of failed pushes whose WRITEs NIXL now
    /// reports complete: free to reuse; a page comes back once, when no held WRITE or staging
    /// reads it any more. Moves UCX along; call it when idle too. A WRITE NIXL reports failed
    /// stays held until release_pushes.
    fn settle_pushes(&self, py: Python<'_>) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let link = &mut *link;
        let done = py.detach(|| link.settle_pushes());
        self.let_regions_go(link);
        Ok(done.into_iter().map(|(r, pages)| (r.0, pages)).collect())
    }

    /// Prefill: [(request, [page])] every held push's source pages, whatever NIXL says: the
    /// engine knows none of their WRITEs can still run (the peer is gone and its transfers
    /// failed).
    fn release_pushes(&self) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let held_before = link.held_pages();
        let released = link.release_pushes();
        self.leak_regions(held_before);
        Ok(released.into_iter().map(|(r, pages)| (r.0, pages)).collect())
    }

    /// Prefill: [(request, [page])] the pages of failed stagings decode has now released (its
    /// Released naming a staging's extents came: it READ them, or never will): free to reuse.
    /// Takes the notices that came, which moves UCX along (decode's READ needs this side's agent
    /// called): call it when idle too. NixlError when the notices cannot be taken.
    fn settle_stages(&self, py: Python<'_>) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let link = &mut *link;
        let done = py.detach(|| link.settle_stages()).map_err(|e| nixl_error(py, &e))?;
        self.let_regions_go(link);
        Ok(done.into_iter().map(|(r, pages)| (r.0, pages)).collect())
    }

    /// Prefill: [(request, [page])] every held staging's pages, whatever came: the engine knows
    /// decode will READ none of them (the peer is gone).
    fn release_stages(&self) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let held_before = link.held_pages();
        let released = link.release_stages();
        self.leak_regions(held_before);
        Ok(released.into_iter().map(|(r, pages)| (r.0, pages)).collect())
    }

    /// Prefill, push: WRITEs `region`'s (a HostRegion or an EnginePool) extents `src`
    /// ([(page, length)]) into the peer's pages `dest` (ints or PageRefs, position by position)
    /// with the manifest (bytes) as the transfer's notification, delivered after the data;
    /// `request` is decode's int id.
    /// Returns when the transfer completed; NixlError otherwise: kind 'extents', before anything
    /// is sent, when a source page is still held (in_flight) by an earlier failed push or
    /// staging (retry from it once settle_pushes or settle_stages hands it back); after posting,
    /// its in_flight lists the source pages WRITEs NIXL has not reported complete may still
    /// read (reuse them once settle_pushes hands them back); every other source page is free.
    /// While the link holds pages, it keeps `region` alive (registered, its memory allocated:
    /// a held WRITE reads it); a link dropped with pages held never frees the regions it kept.
    /// An EnginePool's memory is the engine's: keep it allocated while in_flight names its pages.
    #[pyo3(signature = (region, src, dest, request, manifest, *, timeout = 20.0))]
    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        dest: &Bound<'_, PyAny>,
        request: u64,
        manifest: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<()> {
        let (src, dest) = (extents(src, "src")?, page_ids(dest, "dest")?);
        if src.len() != dest.len() {
            return Err(PyValueError::new_err(format!("{} src extents, {} dest pages", src.len(), dest.len())));
        }
        let manifest = bytes_arg(manifest, "manifest")?;
        let deadline = deadline(timeout)?;
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let mut locked = RegionArg::lock(region)?;
        // `&mut`: a HostRegion may be sent to another thread, not shared with one.
        let (core_link, core_region) = (&mut *link, locked.region());
        let pushed =
            py.detach(move || core_link.push(core_region, &src, &dest, RequestId(request), &manifest, deadline));
        self.keep_region(&link, region, pushed.as_ref().is_err_and(|e| !e.in_flight().is_empty()));
        pushed.map_err(|e| nixl_error(py, &e))
    }

    /// Prefill, push, building the manifest on the way: WRITEs `region`'s extents `src`
    /// ([(page, length)]) into the peer's pages `dest` (decode's PageRefs, in the incarnations
    /// it offered) as the KV of `prompt` (ints) for decode's `request` of `tenant`, from
    /// `sender`, with pages of `page_size` slots of `slot_bytes`. With part_bytes set and more
    /// than one part, each part's page CRCs run right after it is posted, while it flies; the
    /// last part's before it, and it carries the manifest. `ahead`: the (length, crc32) of the
    /// first pages of `src`, taken while waiting for decode's offer (`HostRegion.checksum`,
    /// `kvguard.page_checksum`); those pages are not checksummed again, and one changed since
    /// is refused by decode. NixlError (kind 'extents') when the extents do not fit the prompt
    /// or `ahead` does not fit `src`, before anything is sent; a failure after posting is as
    /// for push (NixlError.in_flight, settle_pushes).
    #[pyo3(signature = (region, src, dest, request, tenant, sender, page_size, slot_bytes, prompt, *, ahead = None, timeout = 20.0))]
    #[allow(clippy::too_many_arguments)]
    fn push_prompt(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        dest: &Bound<'_, PyAny>,
        request: u64,
        tenant: u64,
        sender: u64,
        page_size: u32,
        slot_bytes: u32,
        prompt: &Bound<'_, PyAny>,
        ahead: Option<&Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<()> {
        let src = extents(src, "src")?;
        let dest = crate::transfer::refs(dest, "dest")?;
        let prompt = crate::transfer::tokens(prompt, "prompt")?;
        let ahead = match ahead {
            None => Vec::new(),
            Some(ahead) => ahead
                .try_iter()?
                .map(|item| {
                    item?
                        .extract::<(usize, u32)>()
                        .map_err(|_| PyTypeError::new_err("ahead must hold (length, crc32) pairs of non-negative ints"))
                })
                .collect::<PyResult<Vec<_>>>()?,
        };
        let header = kvguard::transfer::TransferHeader {
            request: RequestId(request),
            tenant: kvguard::TenantId(tenant),
            sender: kvguard::transfer::SenderId(sender),
            page_size,
            slot_bytes,
        };
        let deadline = deadline(timeout)?;
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let mut locked = RegionArg::lock(region)?;
        let (core_link, core_region) = (&mut *link, locked.region());
        let pushed =
            py.detach(move || core_link.push_prompt_ahead(core_region, &src, header, &prompt, &dest, &ahead, deadline));
        self.keep_region(&link, region, pushed.as_ref().is_err_and(|e| !e.in_flight().is_empty()));
        pushed.map_err(|e| nixl_error(py, &e))
    }

    /// Prefill, pull: tells decode that `request`'s KV is staged in this side's extents `src`
    /// ([(page, length)]) with its manifest, then waits until decode released them (a Released
    /// naming exactly these extents: it READ them, whatever its verdict): only then may prefill
    /// reuse those pages. NixlError otherwise: kind 'extents', before anything is sent, when a
    /// page is still held (in_flight) by an earlier staging or failed push, or (with `region`)
    /// an extent lies outside `region`; any other failure comes after the staged notice left,
    /// so decode may READ the pages later: its in_flight lists them, held until settle_stages
    /// hands them back (or release_stages, the peer gone).
    ///
    /// `region`: the HostRegion or EnginePool the extents are in (decode READs it). Given, the
    /// extents are checked against it first, and after a failure that leaves pages held the
    /// link keeps it alive (registered, allocated) until it holds no page, as for a push; it is
    /// never locked. Without it, keep the region alive yourself while in_flight names its pages.
    #[pyo3(signature = (src, request, manifest, *, timeout = 20.0, region = None))]
    fn stage(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        request: u64,
        manifest: &Bound<'_, PyAny>,
        timeout: f64,
        region: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let src = extents(src, "src")?;
        let manifest = bytes_arg(manifest, "manifest")?;
        let deadline = deadline(timeout)?;
        if let Some(region) = region {
            let layout = RegionArg::layout_of(region)?;
            for e in &src {
                layout.extent_addr(e).map_err(|e| nixl_error(py, &e))?;
            }
        }
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let link = &mut *link;
        let staged = py.detach(|| link.stage(&src, RequestId(request), &manifest, deadline));
        if let Some(region) = region {
            self.keep_region(link, region, staged.as_ref().is_err_and(|e| !e.in_flight().is_empty()));
        }
        staged.map_err(|e| nixl_error(py, &e))
    }

    /// Prefill: declines `request` for now and waits until decode took the decline (its bare
    /// Released; one naming extents answers a staging and is left for settle_stages).
    #[pyo3(signature = (request, *, timeout = 20.0))]
    fn decline(&self, py: Python<'_>, request: u64, timeout: f64) -> PyResult<()> {
        let deadline = deadline(timeout)?;
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let link = &mut *link;
        py.detach(|| link.decline(RequestId(request), deadline)).map_err(|e| nixl_error(py, &e))
    }

    /// Decode: receives the transfer `pinned` was pinned for (Receiver.pin, *before* asking the
    /// peer) into `region` (a HostRegion, or the engine's own EnginePool), whose page i is the
    /// pool's page i. direction 'write' (push: waits
    /// for prefill's notice, delivered after the data) or 'read' (pull: waits for the staged
    /// notice, READs into the pinned pages, releases prefill's).
    ///
    /// Then checks the manifest and the landed bytes (request, tenant, token count, prompt
    /// digest, incarnations, per-page length and CRC32) and records the coverage only if all
    /// hold: Accepted; `land(index, PageRef, bytes)` sees each accepted page. Otherwise the
    /// pinned import ends with nothing recorded as written and its pages scrubbed: TransferError
    /// (refused: .kind, .violation, recorded in the table) or NixlError (timeout, transport
    /// failure, declined: no verdict). The pinned import has ended either way.
    #[pyo3(signature = (pinned, region, *, direction = "write", timeout = 20.0, land = None))]
    fn receive(
        &self,
        py: Python<'_>,
        pinned: &Bound<'_, PinnedImport>,
        region: &Bound<'_, PyAny>,
        direction: &str,
        timeout: f64,
        land: Option<Py<PyAny>>,
    ) -> PyResult<Accepted> {
        let direction = match direction {
            "write" => core::Direction::Write,
            "read" => core::Direction::Read,
            other => return Err(PyValueError::new_err(format!("direction must be 'write' or 'read', got {other:?}"))),
        };
        let deadline = deadline(timeout)?;
        let mut link = self.link.try_lock().ok_or_else(|| busy("link"))?;
        let mut region = RegionArg::lock(region)?;
        let (pin, expected, table) = pinned.get().take()?;
        let (link, region) = (&mut *link, region.region());
        let outcome = py.detach(|| {
            link.receive(direction, pin, &expected.as_expected(), region, deadline, |i, r, b| {
                land_page(land.as_ref(), i, r, b)
            })
        });
        match outcome {
            Ok(a) => Ok(Accepted::from(a)),
            Err(core::ImportError::Refused(e)) => Err(refused(py, table.get(), e, &expected.as_expected())),
            Err(core::ImportError::Aborted(e)) => Err(nixl_error(py, &e)),
            Err(core::ImportError::Declined) => Err(with_kind(py, "declined by the sender".to_owned(), "declined")),
            Err(e) => Err(with_kind(py, e.to_string(), "transport")),
        }
    }

    fn __repr__(&self) -> String {
        let peer = self.link.try_lock().map(|l| l.peer().to_owned()).unwrap_or_else(|| "?".to_owned());
        format!("NixlLink({} -> {peer})", self.agent.get().agent.name())
    }
}
