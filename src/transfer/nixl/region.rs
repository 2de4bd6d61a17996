//! Registered page regions (`unsafe` allowed here, as in `agent.rs`: the region's bytes): what
//! a transfer lands in or leaves from ([`PageRegion`]), kvguard's own host pages
//! ([`HostRegion`]), an engine's own pool ([`EnginePool`]), and what keeps a region registered
//! and allocated while a held transfer may still read it, or a fenced one land in it
//! ([`KeepAlive`]).

use super::{Extent, NixlAgent, NixlError, RegionLayout, Registration, Segment};

/// Pages a transfer lands in or leaves from: a region's layout (what the peer names in
/// transfers), the landed bytes the receiver checks, the scrub of a refused transfer's pages, and
/// what keeps the region alive while a held transfer may still read it.
///
/// [`HostRegion`] (kvguard's own host pages) and [`EnginePool`] (an engine's own pool) implement
/// it; an engine whose pages kvguard cannot read directly (GPU memory) implements it with a copy
/// to the host for [`page`](Self::page) and a device-side fill for [`scrub`](Self::scrub).
pub trait PageRegion {
    /// The region's address, page stride, page count, segment and device.
    fn layout(&self) -> RegionLayout;

    /// The first `len` bytes of `page`, borrowed where the memory is host memory, copied
    /// otherwise. Called only when no transfer into the page is in flight.
    fn page(&self, page: u32, len: u32) -> Result<std::borrow::Cow<'_, [u8]>, NixlError>;

    /// Zeroes whole pages (a refused or abandoned transfer's, so no byte of it stays there).
    fn scrub(&mut self, pages: &[u32]) -> Result<(), NixlError>;

    /// What keeps this region's memory registered and allocated after the caller dropped the
    /// region: a [`NixlLink`](super::NixlLink) keeps it with each transfer it holds from the
    /// region (a failed push's WRITEs, a failed [`stage_from`](super::NixlLink::stage_from)),
    /// lets it go when it hands their pages back, and leaks it if dropped while holding them;
    /// decode's side keeps it likewise with each fence a [`receive`](super::NixlLink::receive)
    /// into the region leaves (a transfer given up on that may still land), let go when
    /// [`settle_fences`](super::NixlLink::settle_fences) lifts the fence, leaked when
    /// [`release_fences`](super::NixlLink::release_fences) lifts it or the link is dropped.
    /// [`HostRegion`] hands its memory and registration, [`EnginePool`] its registration when
    /// kvguard registered it. `None` (the default: an engine's own wrapper that does not
    /// override it): nothing is kept, and the engine keeps the memory allocated and registered
    /// while [`in_flight`](super::NixlLink::in_flight) names pages of it, or
    /// [`fenced`](super::NixlLink::fenced) counts a transfer into it.
    fn keep_alive(&self) -> Option<KeepAlive> {
        None
    }
}

/// A share in a region's memory or registration ([`PageRegion::keep_alive`]): while a clone
/// lives, what it shares is neither deregistered nor freed. It gives no access to the bytes.
#[derive(Clone)]
pub struct KeepAlive {
    /// Held, never read: dropping the last share frees what it shares.
    _owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

impl KeepAlive {
    /// A share in `owner` (what an engine's [`PageRegion`] hands the link: the `Arc` its pool's
    /// memory or registration lives in).
    pub fn new<T: Send + Sync + 'static>(owner: std::sync::Arc<T>) -> KeepAlive {
        KeepAlive { _owner: owner }
    }
}

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepAlive").finish_non_exhaustive()
    }
}

/// Host pages owned by kvguard and registered with an agent: what the tests, the demo and the
/// benchmark transfer between. An engine lands transfers in its own pool instead
/// ([`EnginePool`]).
///
/// Peers write these bytes with no call on this side but the agent's own (UCX lands them while
/// the agent polls): read a page only when no transfer into it is in flight, as the checked
/// protocol does (its pages are read after the transfer completed or its notification came).
///
/// Dropping it deregisters and frees its memory, unless a [`NixlLink`](super::NixlLink) holds a
/// transfer from it ([`in_flight`](super::NixlLink::in_flight) names pages of it: a failed push's
/// WRITEs, a failed [`stage_from`](super::NixlLink::stage_from)'s staging): the link keeps the
/// memory and its registration ([`keep_alive`](PageRegion::keep_alive)) until it hands those
/// pages back, and a link dropped while holding them never frees it (leaked: a released WRITE
/// may still read it). A staging made with [`stage`](super::NixlLink::stage), which takes no
/// region, keeps nothing: keep the region alive while its pages are held. Likewise on decode's
/// side, while a link fences a transfer [received](super::NixlLink::receive) into it that may
/// still land ([`fenced`](super::NixlLink::fenced)), until the fence is lifted on proof that
/// nothing more lands; a push given up on with [`abandon`](super::NixlLink::abandon), which
/// takes no region, keeps nothing.
pub struct HostRegion {
    memory: std::sync::Arc<HostMemory>,
}

/// A [`HostRegion`]'s memory and registration, shared with the [`KeepAlive`]s of the transfers a
/// link holds from it. Only the region reads and writes the bytes; a keep-alive only keeps them.
struct HostMemory {
    // Dropped first: deregistered before the memory is freed.
    registration: Registration,
    bytes: Box<[std::cell::UnsafeCell<u8>]>,
}

// SAFETY: the cells are read and written from Rust only through the one `HostRegion` that owns
// this memory (not `Clone`): reads through `&HostRegion`, writes through `&mut HostRegion`, so the
// borrow rules keep them apart across threads as for a `Box<[u8]>`. The other holders of the
// `Arc` (keep-alives) never touch the cells; peers' writes come through NIXL, under the region's
// contract (no read of a page a transfer writes meanwhile).
unsafe impl Sync for HostMemory {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion").field("layout", &self.memory.registration.layout()).finish_non_exhaustive()
    }
}

impl HostRegion {
    /// `pages` zeroed host pages of `page_bytes` bytes each, registered with `agent`.
    pub fn new(agent: &NixlAgent, pages: u32, page_bytes: u32) -> Result<HostRegion, NixlError> {
        let len = u64::from(pages) * u64::from(page_bytes);
        if len == 0 || usize::try_from(len).is_err() {
            return Err(NixlError::Extents { reason: format!("a region of {pages} pages x {page_bytes} bytes") });
        }
        let bytes: Box<[std::cell::UnsafeCell<u8>]> = (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect();
        let layout =
            RegionLayout { base: bytes.as_ptr() as usize as u64, page_bytes, pages, segment: Segment::Dram, device: 0 };
        // SAFETY: `bytes` is `len` host bytes, moved (not copied: the address stays) into the
        // region's `HostMemory`, which frees them only after the registration (declared first,
        // dropped first), when the region and every keep-alive are gone; its cells let peers
        // write it.
        let registration = unsafe { agent.register(layout)? };
        Ok(HostRegion { memory: std::sync::Arc::new(HostMemory { registration, bytes }) })
    }

    /// The region's address, page size, page count and segment, for the peer.
    pub fn layout(&self) -> RegionLayout {
        self.memory.registration.layout()
    }

    fn range(&self, page: u32, len: u32) -> Result<std::ops::Range<usize>, NixlError> {
        let layout = self.layout();
        let start = layout.extent_addr(&Extent { page, len })? - layout.base;
        Ok(start as usize..start as usize + len as usize)
    }

    /// The first `len` bytes of `page`.
    pub fn bytes(&self, page: u32, len: u32) -> Result<&[u8], NixlError> {
        let range = self.range(page, len)?;
        let cells = &self.memory.bytes[range];
        // SAFETY: `UnsafeCell<u8>` has the layout of `u8`; the slice lives as long as `&self`,
        // and no `&mut self` (the only writer from Rust: keep-alives never touch the cells) can
        // be taken meanwhile. No transfer writes these pages while the caller reads them (the
        // type's contract).
        Ok(unsafe { std::slice::from_raw_parts(cells.as_ptr().cast::<u8>(), cells.len()) })
    }

    /// The first `len` bytes of `page`, to fill before a transfer.
    pub fn bytes_mut(&mut self, page: u32, len: u32) -> Result<&mut [u8], NixlError> {
        let range = self.range(page, len)?;
        let cells = &self.memory.bytes[range];
        // SAFETY: `UnsafeCell<u8>` has the layout of `u8`, and its contents may be written
        // through a shared reference (the `Arc` a link's keep-alives share too). The slice is
        // exclusive for its lifetime, that of `&mut self`: the region is the only reader and
        // writer of the cells from Rust (not `Clone`; keep-alives never touch them), and
        // `&mut self` rules out any other borrow of it. No transfer writes these pages meanwhile
        // (the type's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(std::cell::UnsafeCell::raw_get(cells.as_ptr()), cells.len()) })
    }

    /// Zeroes whole pages (a refused or abandoned transfer's, so no byte of it stays there).
    pub fn scrub(&mut self, pages: impl IntoIterator<Item = u32>) -> Result<(), NixlError> {
        let page_bytes = self.layout().page_bytes;
        for page in pages {
            self.bytes_mut(page, page_bytes)?.fill(0);
        }
        Ok(())
    }
}

impl PageRegion for HostRegion {
    fn layout(&self) -> RegionLayout {
        HostRegion::layout(self)
    }
    fn page(&self, page: u32, len: u32) -> Result<std::borrow::Cow<'_, [u8]>, NixlError> {
        self.bytes(page, len).map(std::borrow::Cow::Borrowed)
    }
    fn scrub(&mut self, pages: &[u32]) -> Result<(), NixlError> {
        HostRegion::scrub(self, pages.iter().copied())
    }
    /// The region's memory and registration: freed when the region and every transfer a link
    /// holds from it are gone.
    fn keep_alive(&self) -> Option<KeepAlive> {
        Some(KeepAlive::new(self.memory.clone()))
    }
}

/// An engine's own KV pool (memory kvguard does not own), described by its layout: page `i` is
/// `page_bytes` bytes at `base + i * page_bytes`. Registered with the agent by kvguard
/// ([`register`](Self::register), deregistered on drop) or by the caller beforehand
/// ([`registered`](Self::registered)).
///
/// Host memory (`Segment::Dram`) is read and scrubbed in place. GPU memory (`Segment::Vram`) is
/// registered and transferred the same way, but kvguard cannot read it from the host: its
/// [`page`](PageRegion::page) and [`scrub`](PageRegion::scrub) fail with
/// [`NixlError::Segment`], so a receive into it is aborted (fail closed) unless the engine
/// wraps it in a [`PageRegion`] that copies the pages to the host and fills them on the device.
///
/// While a [`NixlLink`](super::NixlLink)'s [`in_flight`](super::NixlLink::in_flight) names pages
/// of the pool (a held WRITE or READ still reads them), the link keeps the registration kvguard
/// made ([`keep_alive`](PageRegion::keep_alive)): dropping the pool then deregisters nothing
/// until the link hands those pages back (never, if the link is dropped first); so does decode's
/// fence of a transfer [received](super::NixlLink::receive) into the pool that may still land,
/// until [`settle_fences`](super::NixlLink::settle_fences) lifts it. The memory is
/// the engine's: it stays allocated meanwhile (the constructors' contract), and a pool the
/// caller [registered](Self::registered) stays registered by the caller.
#[derive(Debug)]
pub struct EnginePool {
    // Dropped first: deregistered (once no link keeps it) while the caller's memory is still
    // allocated.
    registration: Option<std::sync::Arc<Registration>>,
    layout: RegionLayout,
}

impl EnginePool {
    /// Checks `layout` as a pool description: at least one page, pages of at least one byte,
    /// no address wrap, and (host memory) an address range this process can name.
    fn checked(layout: RegionLayout) -> Result<RegionLayout, NixlError> {
        let len = layout.len()?;
        if layout.is_empty() || layout.base == 0 {
            return Err(NixlError::Extents {
                reason: format!(
                    "a pool of {} pages x {} bytes at {:#x}: empty or null",
                    layout.pages, layout.page_bytes, layout.base
                ),
            });
        }
        if layout.segment == Segment::Dram && usize::try_from(layout.base.saturating_add(len)).is_err() {
            return Err(NixlError::Extents { reason: format!("a host pool of {len} bytes past this address space") });
        }
        Ok(layout)
    }

    /// Describes `layout`'s memory, which the caller registered with the agent that will move
    /// its bytes (NIXL refuses transfers over memory it does not know: an abort, never a landing).
    ///
    /// # Safety
    /// `layout.base .. layout.base + layout.len()` must be memory of `layout.segment` on
    /// `layout.device` that stays allocated while this pool lives, and while a link holds a
    /// transfer from it (until the link's [`in_flight`](super::NixlLink::in_flight) no longer
    /// names pages of it, or, the link dropped meanwhile, until its agent is dropped: a held
    /// WRITE or READ still reads it), and while a link fences a transfer received into it (until
    /// [`settle_fences`](super::NixlLink::settle_fences) lifts the fence; one lifted by
    /// [`release_fences`](super::NixlLink::release_fences), or left standing by a link dropped,
    /// until the agent is dropped: a late WRITE or READ may still land in it); peers may write
    /// it at any time while it is registered,
    /// and kvguard reads (host memory) and zeroes (on a refusal) the pages of the transfers it
    /// receives into it.
    pub unsafe fn registered(layout: RegionLayout) -> Result<EnginePool, NixlError> {
        Ok(EnginePool { registration: None, layout: EnginePool::checked(layout)? })
    }

    /// Registers `layout`'s memory with `agent` and describes it; deregistered when the pool is
    /// dropped and no link holds a transfer from it.
    ///
    /// # Safety
    /// As for [`registered`](Self::registered).
    pub unsafe fn register(agent: &NixlAgent, layout: RegionLayout) -> Result<EnginePool, NixlError> {
        let layout = EnginePool::checked(layout)?;
        // SAFETY: the caller's contract is `register`'s.
        let registration = unsafe { agent.register(layout)? };
        Ok(EnginePool { registration: Some(std::sync::Arc::new(registration)), layout })
    }

    /// Whether kvguard registered the memory (and deregisters it once the pool and every
    /// transfer a link holds from it are gone).
    pub fn owns_registration(&self) -> bool {
        self.registration.is_some()
    }

    /// The address of `len` bytes at the start of `page`, if the pool is host memory.
    fn host_addr(&self, page: u32, len: u32) -> Result<usize, NixlError> {
        if self.layout.segment != Segment::Dram {
            return Err(NixlError::Segment {
                reason: format!(
                    "{:?} memory on device {} cannot be read or zeroed from the host",
                    self.layout.segment, self.layout.device
                ),
            });
        }
        let addr = self.layout.extent_addr(&Extent { page, len })?;
        // `checked` made sure the whole host pool is addressable.
        usize::try_from(addr).map_err(|_| NixlError::Extents { reason: format!("address {addr:#x}") })
    }
}

impl PageRegion for EnginePool {
    fn layout(&self) -> RegionLayout {
        self.layout
    }

    fn page(&self, page: u32, len: u32) -> Result<std::borrow::Cow<'_, [u8]>, NixlError> {
        let addr = self.host_addr(page, len)?;
        if len == 0 {
            return Ok(std::borrow::Cow::Borrowed(&[]));
        }
        // SAFETY: `addr .. addr + len` lies inside one page of the pool (`extent_addr`), host
        // memory that stays allocated while the pool lives (the constructor's contract); u8 has
        // no alignment or validity requirement. It is read only when no transfer into the page is
        // in flight (the trait's contract).
        Ok(std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }))
    }

    fn scrub(&mut self, pages: &[u32]) -> Result<(), NixlError> {
        let page_bytes = self.layout.page_bytes;
        for &page in pages {
            let addr = self.host_addr(page, page_bytes)?;
            // SAFETY: one whole page of the pool, host memory the caller lets kvguard zero on a
            // refusal (the constructor's contract); `&mut self`: no read of it from this pool is
            // alive.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, page_bytes as usize) };
        }
        Ok(())
    }

    /// The registration kvguard made ([`register`](EnginePool::register)); `None` for memory the
    /// caller [registered](EnginePool::registered), which the caller keeps registered.
    fn keep_alive(&self) -> Option<KeepAlive> {
        self.registration.clone().map(KeepAlive::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::nixl::{NIXL_LIBRARY, library_available};
    use std::sync::Arc;

    /// An agent, or `None` (skipped) where the library is absent.
    fn agent(name: &str) -> Option<NixlAgent> {
        if !library_available() {
            let required = std::env::var("KVGUARD_REQUIRE_NIXL").is_ok_and(|v| v == "1");
            assert!(!required, "KVGUARD_REQUIRE_NIXL=1 but {NIXL_LIBRARY} cannot be loaded");
            eprintln!("skipped: {NIXL_LIBRARY} not loadable");
            return None;
        }
        Some(NixlAgent::new(name).expect("agent"))
    }

    #[test]
    fn a_host_regions_memory_and_registration_outlive_it_while_a_keep_alive_lives() {
        let Some(agent) = agent("keep-host") else { return };
        let mut region = HostRegion::new(&agent, 2, 64).unwrap();
        let memory = Arc::downgrade(&region.memory);
        let keep = region.keep_alive().expect("a host region keeps its memory");
        // The region reads and writes its pages as before while a link holds a share.
        region.bytes_mut(1, 4).unwrap().copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(region.bytes(1, 4).unwrap(), &[1, 2, 3, 4]);
        PageRegion::scrub(&mut region, &[1]).unwrap();
        assert_eq!(region.page(1, 4).unwrap().as_ref(), &[0; 4]);
        drop(region);
        assert_eq!(memory.strong_count(), 1, "registered and allocated while the keep-alive lives");
        drop(keep);
        assert_eq!(memory.strong_count(), 0, "deregistered and freed with the last share");
    }

    #[test]
    fn an_engine_pool_keeps_only_the_registration_kvguard_made() {
        let Some(agent) = agent("keep-pool") else { return };
        let mut memory = vec![0u8; 128];
        let layout = RegionLayout {
            base: memory.as_mut_ptr() as usize as u64,
            page_bytes: 64,
            pages: 2,
            segment: Segment::Dram,
            device: 0,
        };
        // SAFETY: `memory` is 128 host bytes that outlive both pools and every keep-alive here.
        let ours = unsafe { EnginePool::register(&agent, layout) }.unwrap();
        let registration = Arc::downgrade(ours.registration.as_ref().expect("kvguard registered it"));
        let keep = ours.keep_alive().expect("the registration kvguard made is kept");
        drop(ours);
        assert_eq!(registration.strong_count(), 1, "still registered while the keep-alive lives");
        drop(keep);
        assert_eq!(registration.strong_count(), 0, "deregistered with the last share");
        // SAFETY: as above.
        let theirs = unsafe { EnginePool::registered(layout) }.unwrap();
        assert!(theirs.keep_alive().is_none(), "the caller's registration is the caller's to keep");
        drop(theirs);
        drop(memory);
    }
}
