//! The NIXL edge (`unsafe` allowed here and in `region.rs` only): loading the C API, the agent,
//! registering memory and the transfers between registered regions. Everything above these
//! files is safe Rust over their types.

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
