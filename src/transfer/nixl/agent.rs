//! The NIXL edge (`unsafe` allowed here only): loading the C API, the agent, registered page
//! regions and the transfers between them. Everything above this file is safe Rust over these
//! types.

use super::{Extent, NixlError, RegionLayout, Segment};
use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle,
    ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shared library nixl-sys's stub API opens at run time (the `nixl-cu12` wheel ships it in
/// `site-packages/.nixl_cu12.mesonpy.libs`, which must be on `LD_LIBRARY_PATH`).
pub const NIXL_LIBRARY: &str = "libnixl_capi.so";

/// Opens [`NIXL_LIBRARY`] once, so that a missing library is an error here rather than the abort
/// nixl-sys's stubs end the process with on their first call.
fn load_library() -> Result<(), NixlError> {
    static LOADED: OnceLock<Result<libloading::Library, String>> = OnceLock::new();
    // SAFETY: loading runs the library's initialisers; libnixl_capi.so is the NIXL C API, whose
    // initialisers only set up NIXL's own state. nixl-sys's stubs dlopen the same file on their
    // first call, so this load adds nothing the stubs would not run anyway. The handle is kept
    // for the life of the process (never unloaded while the stubs hold pointers into it).
    let loaded = LOADED.get_or_init(|| unsafe { libloading::Library::new(NIXL_LIBRARY) }.map_err(|e| e.to_string()));
    match loaded {
        Ok(_) => Ok(()),
        Err(reason) => Err(NixlError::Library { reason: reason.clone() }),
    }
}

/// Whether [`NIXL_LIBRARY`] can be loaded in this process (tests skip, or fail where required).
pub fn library_available() -> bool {
    load_library().is_ok()
}

fn mem_type(segment: Segment) -> MemType {
    match segment {
        Segment::Dram => MemType::Dram,
        Segment::Vram => MemType::Vram,
    }
}

/// The NIXL call whose failure may leave part of a transfer running: the UCX back end releases
/// the operations it had started, and a released UCX operation goes on (`ucp_request_free`).
/// Every failure before it ([`NixlAgent::post`]'s checks, building the request) started nothing.
pub(crate) const POST_CALL: &str = "postXferReq";

fn call(call: &'static str) -> impl FnOnce(nixl_sys::NixlError) -> NixlError {
    move |e| NixlError::Call { call, reason: e.to_string() }
}

/// One NIXL agent with the UCX back end, its progress thread off: UCX moves bytes only inside
/// this agent's calls (posting, polling a transfer, taking notifications), so a waiting side must
/// keep calling them. No thread burns a core while idle.
pub struct NixlAgent {
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent").field("name", &self.name).finish_non_exhaustive()
    }
}

impl NixlAgent {
    /// Creates the agent `name` (unique among the agents that talk to each other) with a UCX
    /// back end. UCX reads its usual variables: `UCX_TLS=tcp,self UCX_NET_DEVICES=lo` keeps it on
    /// loopback TCP.
    pub fn new(name: &str) -> Result<NixlAgent, NixlError> {
        load_library()?;
        let config = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Default,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &config).map_err(call("createAgent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(call("getPluginParams(UCX)"))?;
        agent.create_backend("UCX", &params).map_err(call("createBackend(UCX)"))?;
        Ok(NixlAgent { agent, name: name.to_owned() })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This agent's metadata (connection info and registered memory), for the peer's
    /// [`connect`](Self::connect), exchanged out of band. Take it after registering regions.
    pub fn metadata(&self) -> Result<Vec<u8>, NixlError> {
        self.agent.get_local_md().map_err(call("getLocalMD"))
    }

    /// Loads a peer's [`metadata`](Self::metadata); returns the peer's agent name.
    pub fn connect(&self, peer_metadata: &[u8]) -> Result<String, NixlError> {
        self.agent.load_remote_md(peer_metadata).map_err(call("loadRemoteMD"))
    }

    /// Opens the connection to `peer` now rather than on the first transfer.
    pub fn make_connection(&self, peer: &str) -> Result<(), NixlError> {
        self.agent.make_connection(peer, None).map_err(call("makeConnection"))
    }

    /// Sends `message` (binary-safe) to `peer` as a NIXL notification.
    pub fn notify(&self, peer: &str, message: &[u8]) -> Result<(), NixlError> {
        self.agent.send_notification(peer, message, None).map_err(call("genNotif"))
    }

    /// The notifications that arrived since the last call, as `(sender agent, message)`; also
    /// moves UCX along (this agent has no progress thread).
    pub fn take_notifications(&self) -> Result<Vec<(String, Vec<u8>)>, NixlError> {
        let mut map = NotificationMap::new().map_err(call("createNotifMap"))?;
        self.agent.get_notifications(&mut map, None).map_err(call("getNotifs"))?;
        let mut out = Vec::new();
        let agents: Vec<String> = map.agents().filter_map(|a| a.ok().map(str::to_owned)).collect();
        for agent in agents {
            let n = map.get_notifications_size(&agent).map_err(call("getNotifs"))?;
            for i in 0..n {
                out.push((agent.clone(), map.get_notification_bytes(&agent, i).map_err(call("getNotifs"))?));
            }
        }
        Ok(out)
    }

    /// Moves bytes between `local` and the peer's `remote` pages: `op` Write copies each local
    /// extent into the remote extent at the same position, Read the reverse. `notification`
    /// (Write only) is delivered to the peer after the data. Waits until the transfer completes,
    /// fails, or `deadline` passes; a transfer still in flight then is released and the result
    /// is [`NixlError::Timeout`]. Releasing does not stop it (see [`Posted`]): after an error,
    /// both sides' pages may still be read and written. [`NixlLink`](super::NixlLink)'s pushes
    /// and pulls keep such a transfer's handle and its pages held instead.
    #[allow(clippy::too_many_arguments)]
    pub fn transfer(
        &self,
        op: Direction,
        local: &RegionLayout,
        local_extents: &[Extent],
        peer: &str,
        remote: &RegionLayout,
        remote_extents: &[Extent],
        notification: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<(), NixlError> {
        let mut posted = self.post(op, local, local_extents, peer, remote, remote_extents, notification)?;
        self.wait(&mut posted, deadline)
    }

    /// Posts the transfer [`transfer`](Self::transfer) makes, without waiting: several may be in
    /// flight at once. [`poll`](Self::poll) or [`wait`](Self::wait) it; dropping it while in
    /// flight releases it, which does not stop it (see [`Posted`]).
    #[allow(clippy::too_many_arguments)]
    pub fn post(
        &self,
        op: Direction,
        local: &RegionLayout,
        local_extents: &[Extent],
        peer: &str,
        remote: &RegionLayout,
        remote_extents: &[Extent],
        notification: Option<&[u8]>,
    ) -> Result<Posted, NixlError> {
        if local_extents.len() != remote_extents.len() {
            return Err(NixlError::Extents {
                reason: format!("{} local, {} remote", local_extents.len(), remote_extents.len()),
            });
        }
        let mut local_list = XferDescList::new(mem_type(local.segment)).map_err(call("createXferDlist"))?;
        let mut remote_list = XferDescList::new(mem_type(remote.segment)).map_err(call("createXferDlist"))?;
        for (l, r) in local_extents.iter().zip(remote_extents) {
            if l.len != r.len {
                return Err(NixlError::Extents {
                    reason: format!("page {} has {} bytes, page {} has {}", l.page, l.len, r.page, r.len),
                });
            }
            let la = local.extent_addr(l)?;
            let ra = remote.extent_addr(r)?;
            local_list.add_desc(la as usize, l.len as usize, local.device);
            remote_list.add_desc(ra as usize, r.len as usize, remote.device);
        }
        let xfer_op = match op {
            Direction::Write => XferOp::Write,
            Direction::Read => XferOp::Read,
        };
        let mut args = OptArgs::new().map_err(call("createOptArgs"))?;
        if let Some(message) = notification {
            args.set_notification_message(message).map_err(call("setNotifMsg"))?;
            args.set_has_notification(true).map_err(call("setHasNotif"))?;
        }
        let request = self
            .agent
            .create_xfer_req(xfer_op, &local_list, &remote_list, peer, Some(&args))
            .map_err(call("createXferReq"))?;
        let in_progress = self.agent.post_xfer_req(&request, Some(&args)).map_err(call(POST_CALL))?;
        Ok(Posted { request, done: !in_progress })
    }

    /// Whether `posted` has completed (an error if it failed); moves UCX along.
    pub fn poll(&self, posted: &mut Posted) -> Result<bool, NixlError> {
        if !posted.done {
            posted.done = matches!(
                self.agent.get_xfer_status(&posted.request).map_err(call("getXferStatus"))?,
                XferStatus::Success
            );
        }
        Ok(posted.done)
    }

    /// Waits until `posted` completes, fails, or `deadline` passes ([`NixlError::Timeout`]).
    pub fn wait(&self, posted: &mut Posted, deadline: Instant) -> Result<(), NixlError> {
        let mut spins = 0u32;
        while !self.poll(posted)? {
            if Instant::now() >= deadline {
                return Err(NixlError::Timeout { waiting_for: "the transfer to complete" });
            }
            pause(&mut spins);
        }
        Ok(())
    }

    /// Registers `layout`'s memory (engine-owned pages, host or GPU) with this agent, so peers
    /// can read and write it; deregistered when the returned registration is dropped.
    ///
    /// # Safety
    /// `layout.base .. layout.base + layout.len()` must be memory of `layout.segment` on
    /// `layout.device` that stays allocated until the registration is dropped, and that the
    /// caller lets peers write at any time while it is registered (no Rust reference to it may
    /// assume it is not written meanwhile).
    pub unsafe fn register(&self, layout: RegionLayout) -> Result<Registration, NixlError> {
        let span = Span { base: layout.base, len: layout.len()?, segment: layout.segment, device: layout.device };
        let handle = self.agent.register_memory(&span, None).map_err(call("registerMem"))?;
        Ok(Registration { _handle: handle, layout })
    }
}

/// A transfer [posted](NixlAgent::post) by an agent; released on drop.
///
/// Releasing a transfer still in flight does not stop it. NIXL's `releaseXferReq` asks the back
/// end to cancel it; the UCX back end cancels and frees each UCX operation still running
/// (`ucp_request_cancel`, `ucp_request_free`) and reports success, but a UCX RMA operation goes
/// on after it is freed (NIXL's own source: "it may not be enough to cancel UCX request"), and
/// nixl-sys drops the status anyway. On loopback TCP a push of 4 WRITEs of 8 MiB released at
/// their first poll still landed whole, carrying the bytes the source pages held *after* the
/// release. Only [`NixlAgent::poll`] reporting it complete proves a transfer reads and writes
/// nothing more.
pub struct Posted {
    request: XferRequest,
    done: bool,
}

impl std::fmt::Debug for Posted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Posted").field("done", &self.done).finish_non_exhaustive()
    }
}

/// Which way a [`NixlAgent::transfer`] moves bytes, seen from the agent that posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local pages into the peer's (prefill pushes).
    Write,
    /// The peer's pages into local ones (decode pulls).
    Read,
}

/// Spin a little, then yield, then sleep: a waiting side keeps calling into NIXL (which is what
/// moves UCX along) without burning a core for long.
pub(crate) fn pause(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 64 {
        std::hint::spin_loop();
    } else if *spins < 1_024 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Memory NIXL is told about: address, length, segment and device.
#[derive(Debug)]
struct Span {
    base: u64,
    len: u64,
    segment: Segment,
    device: u64,
}

impl MemoryRegion for Span {
    // SAFETY (of the contract): the pointer is the address the caller of `register` vouched for;
    // NIXL records it and never dereferences it in this process beyond the registered length.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.base as usize as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        mem_type(self.segment)
    }
    fn device_id(&self) -> u64 {
        self.device
    }
}

/// Memory registered with an agent ([`NixlAgent::register`]); deregistered on drop.
#[derive(Debug)]
pub struct Registration {
    _handle: RegistrationHandle,
    layout: RegionLayout,
}

impl Registration {
    /// What was registered.
    pub fn layout(&self) -> RegionLayout {
        self.layout
    }
}

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
    /// lets it go when it hands their pages back, and leaks it if dropped while holding them.
    /// [`HostRegion`] hands its memory and registration, [`EnginePool`] its registration when
    /// kvguard registered it. `None` (the default: an engine's own wrapper that does not
    /// override it): nothing is kept, and the engine keeps the memory allocated and registered
    /// while [`in_flight`](super::NixlLink::in_flight) names pages of it.
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
/// region, keeps nothing: keep the region alive while its pages are held.
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
        f.debug_struct("HostRegion").field("layout", &self.memory.registration.layout).finish_non_exhaustive()
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
        self.memory.registration.layout
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
/// until the link hands those pages back (never, if the link is dropped first). The memory is
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
    /// WRITE or READ still reads it); peers may write it at any time while it is registered,
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
