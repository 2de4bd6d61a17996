//! The NIXL edge (`unsafe` allowed here only): loading the C API, the agent, registered page
//! regions and the transfers between them. Everything above this file is safe Rust over these
//! types.

use super::{NixlError, RegionLayout, Segment};
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
    /// fails, or `deadline` passes; a transfer still in flight then is released (NIXL aborts it)
    /// and the result is [`NixlError::Timeout`].
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
        let in_progress = self.agent.post_xfer_req(&request, Some(&args)).map_err(call("postXferReq"))?;
        if in_progress {
            self.wait(&request, deadline)?;
        }
        Ok(())
    }

    fn wait(&self, request: &XferRequest, deadline: Instant) -> Result<(), NixlError> {
        let mut spins = 0u32;
        loop {
            match self.agent.get_xfer_status(request).map_err(call("getXferStatus"))? {
                XferStatus::Success => return Ok(()),
                XferStatus::InProgress if Instant::now() >= deadline => {
                    return Err(NixlError::Timeout { waiting_for: "the transfer to complete" });
                }
                XferStatus::InProgress => pause(&mut spins),
            }
        }
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

/// Which way a [`NixlAgent::transfer`] moves bytes, seen from the agent that posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local pages into the peer's (prefill pushes).
    Write,
    /// The peer's pages into local ones (decode pulls).
    Read,
}

/// `len` bytes at the start of page `page` of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// The page index in its region.
    pub page: u32,
    /// Bytes from the page's start (at most the region's page size).
    pub len: u32,
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

/// Host pages owned by kvguard and registered with an agent: what the tests, the demo and the
/// benchmark transfer between. An engine registers its own pool instead
/// ([`NixlAgent::register`]).
///
/// Peers write these bytes with no call on this side but the agent's own (UCX lands them while
/// the agent polls): read a page only when no transfer into it is in flight, as the checked
/// protocol does (its pages are read after the transfer completed or its notification came).
pub struct HostRegion {
    // Dropped first: deregistered before the memory is freed.
    registration: Registration,
    memory: Box<[std::cell::UnsafeCell<u8>]>,
}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion").field("layout", &self.registration.layout).finish_non_exhaustive()
    }
}

impl HostRegion {
    /// `pages` zeroed host pages of `page_bytes` bytes each, registered with `agent`.
    pub fn new(agent: &NixlAgent, pages: u32, page_bytes: u32) -> Result<HostRegion, NixlError> {
        let len = u64::from(pages) * u64::from(page_bytes);
        if len == 0 || usize::try_from(len).is_err() {
            return Err(NixlError::Extents { reason: format!("a region of {pages} pages x {page_bytes} bytes") });
        }
        let memory: Box<[std::cell::UnsafeCell<u8>]> = (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect();
        let layout = RegionLayout {
            base: memory.as_ptr() as usize as u64,
            page_bytes,
            pages,
            segment: Segment::Dram,
            device: 0,
        };
        // SAFETY: `memory` is `len` host bytes owned by the region, freed only after the
        // registration (declared first, dropped first); its cells let peers write it.
        let registration = unsafe { agent.register(layout)? };
        Ok(HostRegion { registration, memory })
    }

    /// The region's address, page size, page count and segment, for the peer.
    pub fn layout(&self) -> RegionLayout {
        self.registration.layout
    }

    fn range(&self, page: u32, len: u32) -> Result<std::ops::Range<usize>, NixlError> {
        let layout = self.layout();
        let start = layout.extent_addr(&Extent { page, len })? - layout.base;
        Ok(start as usize..start as usize + len as usize)
    }

    /// The first `len` bytes of `page`.
    pub fn bytes(&self, page: u32, len: u32) -> Result<&[u8], NixlError> {
        let range = self.range(page, len)?;
        let cells = &self.memory[range];
        // SAFETY: `UnsafeCell<u8>` has the layout of `u8`; the slice lives as long as `&self`.
        // No transfer writes these pages while the caller reads them (the type's contract).
        Ok(unsafe { std::slice::from_raw_parts(cells.as_ptr().cast::<u8>(), cells.len()) })
    }

    /// The first `len` bytes of `page`, to fill before a transfer.
    pub fn bytes_mut(&mut self, page: u32, len: u32) -> Result<&mut [u8], NixlError> {
        let range = self.range(page, len)?;
        let cells = &mut self.memory[range];
        // SAFETY: `UnsafeCell<u8>` has the layout of `u8`; the slice is borrowed mutably from
        // `&mut self` for its lifetime. No transfer writes these pages meanwhile (the type's
        // contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(cells.as_mut_ptr().cast::<u8>(), cells.len()) })
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
