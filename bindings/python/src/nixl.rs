//! Checked KV transfers over NIXL from Python (feature `nixl`): the core's
//! [`kvguard::transfer::nixl`] bound, not re-implemented over `nixl_cu12._api`, so that an
//! engine's Python connector (vLLM's NixlConnector, SGLang's nixl backend) gets the same
//! protocol and failure paths as the Rust side: the pin taken before the pull and held across it
//! ([`PinnedImport`]), check, record and scrub in one step, the page CRCs and every wait run
//! without the GIL.
//!
//! ```text
//! agent  = NixlAgent("decode")                      # UCX, no progress thread
//! region = HostRegion(agent, pages, page_bytes)     # registered host pages
//! # out of band: agent.metadata() and region.layout() (bytes) to the peer, the peer's back
//! link   = NixlLink(agent, peer_metadata, peer_layout)
//! decode:  pinned = Receiver(table).pin(...); <ask prefill>; link.receive(pinned, region)
//! prefill: link.push(region, src, dest, request, manifest) | link.stage(...) | link.decline(...)
//! ```
//!
//! Refusals are `kvguard.TransferError` (with `.kind` and `.violation`, recorded in the table);
//! a transport failure, a timeout or a decline is `kvguard.NixlError` (`.kind`), with nothing
//! recorded. Either way the pinned pages get no coverage and are scrubbed.

use crate::errors::Error;
use crate::transfer::{Accepted, Bytes, PinnedImport, land_page, refused};
use crate::values::PageRef;
use kvguard::PageId;
use kvguard::RequestId;
use kvguard::transfer::nixl as core;
use kvguard::transfer::nixl::PageRegion;
use parking_lot::Mutex;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::borrow::Cow;
use std::time::{Duration, Instant};

pyo3::create_exception!(
    kvguard,
    NixlError,
    Error,
    "The NIXL transport failed: no verdict on the transfer's content, nothing recorded; a pinned\n\
     import it aborted leaves its pages without coverage, and scrubbed.\n\n\
     Attribute kind: 'library' (libnixl_capi.so cannot be loaded: put the nixl-cu12 wheel's\n\
     site-packages/.nixl_cu12.mesonpy.libs on LD_LIBRARY_PATH), 'call' (a NIXL call failed),\n\
     'timeout' (the transfer or the notification did not come by the deadline), 'declined' (the\n\
     sender declined; ask again later), 'extents' (pages outside a region, a pool description\n\
     that does not fit), 'notice' (a malformed notice or region layout), 'segment' (memory\n\
     kvguard cannot read from the host: a GPU pool without read/scrub callbacks).\n\n\
     Attribute in_flight: a push that failed after posting WRITEs NIXL has not reported\n\
     complete lists the source pages (of the region pushed from) those WRITEs may still read:\n\
     reuse them only once NixlLink.settle_pushes() hands them back; a stage that failed before\n\
     decode released it lists the staged pages decode may still READ: reuse them only once\n\
     NixlLink.settle_stages() hands them back. Empty otherwise."
);

/// A core transport error as a `NixlError` with its `.kind` (of its cause, for a push or a stage
/// that failed with its pages still read) and `.in_flight` (the source pages that may still be
/// read).
fn nixl_error(py: Python<'_>, e: &core::NixlError) -> PyErr {
    let kind = match e.cause() {
        core::NixlError::Library { .. } => "library",
        core::NixlError::Call { .. } => "call",
        core::NixlError::Timeout { .. } => "timeout",
        core::NixlError::Extents { .. } => "extents",
        core::NixlError::Notice { .. } => "notice",
        core::NixlError::Segment { .. } => "segment",
        _ => "transport",
    };
    with_pages(py, e.to_string(), kind, e.in_flight())
}

fn with_kind(py: Python<'_>, message: String, kind: &str) -> PyErr {
    with_pages(py, message, kind, &[])
}

fn with_pages(py: Python<'_>, message: String, kind: &str, in_flight: &[u32]) -> PyErr {
    let err = NixlError::new_err(message);
    let value = err.value(py);
    if let Err(e) = value.setattr("kind", kind).and_then(|()| value.setattr("in_flight", in_flight.to_vec())) {
        return e;
    }
    err
}

/// The deadline `timeout` seconds from now.
fn deadline(timeout: f64) -> PyResult<Instant> {
    let d = Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("timeout must be seconds >= 0, got {timeout}")))?;
    Instant::now().checked_add(d).ok_or_else(|| PyValueError::new_err(format!("timeout {timeout} s is too far away")))
}

/// A bytes-like argument, copied (metadata, layouts, manifests: small).
fn bytes_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u8>> {
    Ok(Bytes::open(obj, name)?.as_ref().to_vec())
}

/// `[(page, length)]` → extents.
fn extents(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<core::Extent>> {
    obj.try_iter()?
        .map(|item| {
            let (page, len): (u32, u32) = item?
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("{name} must hold (page, length) pairs of ints")))?;
            Ok(core::Extent { page, len })
        })
        .collect()
}

/// Page ids, from ints or kvguard.PageRef.
fn page_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<PageId>> {
    obj.try_iter()?
        .map(|item| {
            let item = item?;
            if let Ok(r) = item.cast::<PageRef>() {
                return Ok(kvguard::PageRef::from(*r.get()).page);
            }
            item.extract::<u32>()
                .map(PageId)
                .map_err(|_| PyTypeError::new_err(format!("{name} must hold page ids (ints) or kvguard.PageRef")))
        })
        .collect()
}

fn busy(what: &str) -> PyErr {
    PyRuntimeError::new_err(format!("a transfer is in flight on this {what} (another thread's call)"))
}

/// Whether libnixl_capi.so can be loaded in this process (the nixl-cu12 wheel's
/// site-packages/.nixl_cu12.mesonpy.libs on LD_LIBRARY_PATH).
#[pyfunction]
pub fn nixl_library_available(py: Python<'_>) -> bool {
    py.detach(core::library_available)
}

/// One NIXL agent with the UCX back end and no progress thread: UCX moves bytes only inside this
/// agent's calls, which every wait here keeps making (no core burnt while idle).
///
/// NixlAgent(name): name unique among the agents that talk to each other. UCX reads its usual
/// variables (UCX_TLS=tcp,self UCX_NET_DEVICES=lo: loopback TCP). NixlError (kind 'library')
/// when libnixl_capi.so cannot be loaded.
#[pyclass(frozen, module = "kvguard")]
pub struct NixlAgent {
    agent: core::NixlAgent,
}

#[pymethods]
impl NixlAgent {
    #[new]
    fn new(py: Python<'_>, name: &str) -> PyResult<NixlAgent> {
        py.detach(|| core::NixlAgent::new(name)).map(|agent| NixlAgent { agent }).map_err(|e| nixl_error(py, &e))
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.agent.name()
    }

    /// This agent's metadata (bytes) for the peer's NixlLink, sent out of band; take it after
    /// registering the regions.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = py.detach(|| self.agent.metadata()).map_err(|e| nixl_error(py, &e))?;
        Ok(PyBytes::new(py, &md))
    }

    fn __repr__(&self) -> String {
        format!("NixlAgent({:?})", self.agent.name())
    }
}

/// Host pages owned by kvguard and registered with an agent: what prefill sends from and
/// decode receives into. Page i is page_bytes bytes at page_bytes * i, zeroed at first.
///
/// HostRegion(agent, pages, page_bytes). layout() is what the peer needs (bytes, out of band).
/// read/write/scrub raise RuntimeError while a transfer on this region runs in another thread.
/// A NixlLink whose failed push's WRITEs are held keeps the region it pushed from alive until it
/// holds no page; a failed stage's region too when the stage named it (`region=`): otherwise
/// keep it while in_flight names its pages.
#[pyclass(frozen, module = "kvguard")]
pub struct HostRegion {
    region: Mutex<core::HostRegion>,
    layout: core::RegionLayout,
}

#[pymethods]
impl HostRegion {
    #[new]
    fn new(py: Python<'_>, agent: &Bound<'_, NixlAgent>, pages: u32, page_bytes: u32) -> PyResult<HostRegion> {
        let agent = &agent.get().agent;
        let region = py.detach(|| core::HostRegion::new(agent, pages, page_bytes)).map_err(|e| nixl_error(py, &e))?;
        let layout = region.layout();
        Ok(HostRegion { region: Mutex::new(region), layout })
    }

    /// Pages in the region.
    #[getter]
    fn pages(&self) -> u32 {
        self.layout.pages
    }

    /// Bytes per page.
    #[getter]
    fn page_bytes(&self) -> u32 {
        self.layout.page_bytes
    }

    /// The region's layout (address, page size, page count, segment, device) as the 32 bytes
    /// the peer's NixlLink takes.
    fn layout<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.layout.encode())
    }

    /// The first `length` bytes of `page` (the whole page by default), copied.
    #[pyo3(signature = (page, length = None))]
    fn read<'py>(&self, py: Python<'py>, page: u32, length: Option<u32>) -> PyResult<Bound<'py, PyBytes>> {
        let region = self.region.try_lock().ok_or_else(|| busy("region"))?;
        let bytes = region.bytes(page, length.unwrap_or(self.layout.page_bytes)).map_err(|e| nixl_error(py, &e))?;
        Ok(PyBytes::new(py, bytes))
    }

    /// `(length, crc32)` of the first `length` bytes of `page` (the whole page by default), read
    /// in place: what `NixlLink.push_prompt(..., ahead=...)` takes for a page checksummed while
    /// prefill waits for decode's offer. The CRC is `kvguard.page_checksum`'s.
    #[pyo3(signature = (page, length = None))]
    fn checksum(&self, py: Python<'_>, page: u32, length: Option<u32>) -> PyResult<(usize, u32)> {
        let region = self.region.try_lock().ok_or_else(|| busy("region"))?;
        let bytes = region.bytes(page, length.unwrap_or(self.layout.page_bytes)).map_err(|e| nixl_error(py, &e))?;
        Ok((bytes.len(), py.detach(|| kvguard::transfer::page_checksum(bytes))))
    }

    /// Copies `data` (bytes-like, at most a page) to the start of `page`.
    fn write(&self, py: Python<'_>, page: u32, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = bytes_arg(data, "data")?;
        let len = u32::try_from(data.len()).map_err(|_| PyValueError::new_err("data is longer than a page"))?;
        let mut region = self.region.try_lock().ok_or_else(|| busy("region"))?;
        region.bytes_mut(page, len).map_err(|e| nixl_error(py, &e))?.copy_from_slice(&data);
        Ok(())
    }

    /// Zeroes whole pages.
    fn scrub(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let pages = page_ids(pages, "pages")?;
        let mut region = self.region.try_lock().ok_or_else(|| busy("region"))?;
        region.scrub(pages.into_iter().map(|p| p.0)).map_err(|e| nixl_error(py, &e))
    }

    fn __repr__(&self) -> String {
        format!("HostRegion(pages={}, page_bytes={})", self.layout.pages, self.layout.page_bytes)
    }
}

/// An engine's GPU pool as a core page region: NIXL moves its bytes, the engine's callbacks
/// copy a page to the host for the check and zero pages on a refusal.
struct DevicePool {
    pool: core::EnginePool,
    read: Py<PyAny>,
    scrub: Py<PyAny>,
}

impl PageRegion for DevicePool {
    fn layout(&self) -> core::RegionLayout {
        self.pool.layout()
    }

    fn page(&self, page: u32, len: u32) -> Result<Cow<'_, [u8]>, core::NixlError> {
        let layout = self.pool.layout();
        layout.extent_addr(&core::Extent { page, len })?;
        Python::attach(|py| {
            let failed = |why: String| core::NixlError::Segment { reason: format!("read({page}, {len}): {why}") };
            let out = self.read.call1(py, (page, len)).map_err(|e| failed(e.to_string()))?;
            let bytes = Bytes::open(out.bind(py), "read's result").map_err(|e| failed(e.to_string()))?;
            let bytes = bytes.as_ref();
            if bytes.len() != len as usize {
                return Err(failed(format!("returned {} bytes", bytes.len())));
            }
            Ok(Cow::Owned(bytes.to_vec()))
        })
    }

    fn scrub(&mut self, pages: &[u32]) -> Result<(), core::NixlError> {
        let layout = self.pool.layout();
        for &page in pages {
            layout.extent_addr(&core::Extent { page, len: layout.page_bytes })?;
        }
        Python::attach(|py| {
            self.scrub
                .call1(py, (pages.to_vec(),))
                .map(drop)
                .map_err(|e| core::NixlError::Segment { reason: format!("scrub: {e}") })
        })
    }
    /// The registration kvguard made for the pool, as the core pool keeps it.
    fn keep_alive(&self) -> Option<core::KeepAlive> {
        self.pool.keep_alive()
    }
}

/// What an [`EnginePool`] describes: host memory kvguard reads in place (a buffer it holds, or
/// an address whose owner it keeps alive), or GPU memory behind the engine's callbacks.
enum PoolMemory {
    Host {
        // Dropped first: deregistered while the memory is still there.
        pool: core::EnginePool,
        _buffer: Option<PyUntypedBuffer>,
        _owner: Option<Py<PyAny>>,
    },
    Device {
        // Dropped first, as above.
        pool: DevicePool,
        _owner: Option<Py<PyAny>>,
    },
}

impl PoolMemory {
    fn region(&mut self) -> &mut (dyn PageRegion + Send) {
        match self {
            PoolMemory::Host { pool, .. } => pool,
            PoolMemory::Device { pool, .. } => pool,
        }
    }
}

/// An engine's own KV pool, described by the caller, for receiving (and sending) checked
/// transfers in place: page i is page_bytes bytes at base + page_bytes * i. Registered with the
/// agent by kvguard (register=True, the default; deregistered when the pool is dropped) or
/// already registered with it by the engine (register=False: NIXL refuses transfers over memory
/// the agent does not know, which aborts the receive).
///
/// EnginePool(agent, buffer, page_bytes, *, register=True): host memory the engine owns, given
/// as a writable C-contiguous buffer (a numpy array; a torch CPU tensor through .numpy()),
/// held for the pool's life; its length must be a whole number of pages.
///
/// EnginePool.at(agent, address, length, page_bytes, *, segment='dram', device=0,
/// register=True, owner=None, read=None, scrub=None): memory named by address (a tensor's
/// data_ptr()); owner is kept alive for the pool's life. The caller vouches that the memory
/// stays allocated meanwhile. segment 'vram' (GPU memory on CUDA device `device`) needs
/// read(page, length) -> bytes (a copy to the host, for the check) and scrub(pages) (zeroes
/// whole pages on the device): kvguard cannot touch GPU memory from the host.
///
/// A refused or aborted receive into the pool leaves its pinned pages zeroed.
#[pyclass(frozen, module = "kvguard")]
pub struct EnginePool {
    memory: Mutex<PoolMemory>,
    layout: core::RegionLayout,
}

/// `pages` of `page_bytes` in `length` bytes, or a NixlError (kind 'extents').
fn whole_pages(py: Python<'_>, length: u64, page_bytes: u32) -> PyResult<u32> {
    let bad = |why: String| nixl_error(py, &core::NixlError::Extents { reason: why });
    if page_bytes == 0 || length == 0 || !length.is_multiple_of(u64::from(page_bytes)) {
        return Err(bad(format!("{length} bytes are not a whole number of {page_bytes}-byte pages")));
    }
    u32::try_from(length / u64::from(page_bytes)).map_err(|_| bad(format!("{length} bytes: too many pages")))
}

/// Registers (or only describes) `layout` for `agent`.
///
/// # Safety
/// `layout` names memory of its segment that stays allocated while the returned pool lives.
unsafe fn engine_pool(
    py: Python<'_>,
    agent: &core::NixlAgent,
    layout: core::RegionLayout,
    register: bool,
) -> PyResult<core::EnginePool> {
    let pool = py.detach(|| {
        if register {
            // SAFETY: the caller's contract.
            unsafe { core::EnginePool::register(agent, layout) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { core::EnginePool::registered(layout) }
        }
    });
    pool.map_err(|e| nixl_error(py, &e))
}

#[pymethods]
impl EnginePool {
    #[new]
    #[pyo3(signature = (agent, buffer, page_bytes, *, register = true))]
    fn new(
        py: Python<'_>,
        agent: &Bound<'_, NixlAgent>,
        buffer: &Bound<'_, PyAny>,
        page_bytes: u32,
        register: bool,
    ) -> PyResult<EnginePool> {
        let buf = PyUntypedBuffer::get(buffer)
            .map_err(|_| PyTypeError::new_err("buffer must expose the buffer protocol (a numpy array, a bytearray)"))?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("buffer must be C-contiguous"));
        }
        if buf.readonly() {
            return Err(PyValueError::new_err("buffer must be writable: transfers land in it"));
        }
        let pages = whole_pages(py, buf.len_bytes() as u64, page_bytes)?;
        let layout = core::RegionLayout {
            base: buf.buf_ptr() as usize as u64,
            page_bytes,
            pages,
            segment: core::Segment::Dram,
            device: 0,
        };
        // SAFETY: `buf` is a writable, C-contiguous export of `pages * page_bytes` host bytes at
        // `base`, held by the pool (dropped after the registration) so the exporter keeps the
        // memory allocated; peers writing it and kvguard zeroing refused pages is what the
        // caller asked for by handing it over.
        let pool = unsafe { engine_pool(py, &agent.get().agent, layout, register)? };
        Ok(EnginePool { memory: Mutex::new(PoolMemory::Host { pool, _buffer: Some(buf), _owner: None }), layout })
    }

    /// An engine pool at `address` (see the class doc).
    #[staticmethod]
    #[pyo3(signature = (agent, address, length, page_bytes, *, segment = "dram", device = 0, register = true, owner = None, read = None, scrub = None))]
    #[allow(clippy::too_many_arguments)]
    fn at(
        py: Python<'_>,
        agent: &Bound<'_, NixlAgent>,
        address: u64,
        length: u64,
        page_bytes: u32,
        segment: &str,
        device: u64,
        register: bool,
        owner: Option<Py<PyAny>>,
        read: Option<Py<PyAny>>,
        scrub: Option<Py<PyAny>>,
    ) -> PyResult<EnginePool> {
        let segment = match segment {
            "dram" => core::Segment::Dram,
            "vram" => core::Segment::Vram,
            other => return Err(PyValueError::new_err(format!("segment must be 'dram' or 'vram', got {other:?}"))),
        };
        let pages = whole_pages(py, length, page_bytes)?;
        let layout = core::RegionLayout { base: address, page_bytes, pages, segment, device };
        let memory = match (segment, read, scrub) {
            (core::Segment::Dram, None, None) => {
                // SAFETY: the caller vouches for the memory (the class doc); `owner`, kept by the
                // pool until after the registration is dropped, is what keeps it allocated.
                let pool = unsafe { engine_pool(py, &agent.get().agent, layout, register)? };
                PoolMemory::Host { pool, _buffer: None, _owner: owner }
            }
            (core::Segment::Vram, Some(read), Some(scrub)) => {
                // SAFETY: as above; kvguard never dereferences GPU memory, only NIXL moves it.
                let pool = unsafe { engine_pool(py, &agent.get().agent, layout, register)? };
                PoolMemory::Device { pool: DevicePool { pool, read, scrub }, _owner: owner }
            }
            (core::Segment::Dram, _, _) => {
                return Err(PyValueError::new_err("read and scrub are for 'vram' pools: kvguard reads host pools"));
            }
            _ => return Err(PyValueError::new_err("a 'vram' pool needs read(page, length) and scrub(pages)")),
        };
        Ok(EnginePool { memory: Mutex::new(memory), layout })
    }

    /// Pages in the pool.
    #[getter]
    fn pages(&self) -> u32 {
        self.layout.pages
    }

    /// Bytes per page (the page stride).
    #[getter]
    fn page_bytes(&self) -> u32 {
        self.layout.page_bytes
    }

    /// 'dram' or 'vram'.
    #[getter]
    fn segment(&self) -> &'static str {
        match self.layout.segment {
            core::Segment::Dram => "dram",
            core::Segment::Vram => "vram",
        }
    }

    /// The pool's layout as the 32 bytes the peer's NixlLink takes.
    fn layout<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.layout.encode())
    }

    fn __repr__(&self) -> String {
        format!(
            "EnginePool(base={:#x}, pages={}, page_bytes={}, segment={:?})",
            self.layout.base,
            self.layout.pages,
            self.layout.page_bytes,
            self.segment()
        )
    }
}

/// A region argument: kvguard's HostRegion or an engine's EnginePool, locked for one call.
enum RegionArg<'a> {
    Host(parking_lot::MutexGuard<'a, core::HostRegion>),
    Engine(parking_lot::MutexGuard<'a, PoolMemory>),
}

impl<'a> RegionArg<'a> {
    fn lock(region: &'a Bound<'_, PyAny>) -> PyResult<RegionArg<'a>> {
        if let Ok(r) = region.cast::<HostRegion>() {
            let r: &'a HostRegion = r.get();
            return Ok(RegionArg::Host(r.region.try_lock().ok_or_else(|| busy("region"))?));
        }
        if let Ok(p) = region.cast::<EnginePool>() {
            let p: &'a EnginePool = p.get();
            return Ok(RegionArg::Engine(p.memory.try_lock().ok_or_else(|| busy("pool"))?));
        }
        Err(PyTypeError::new_err("region must be a kvguard.HostRegion or a kvguard.EnginePool"))
    }

    fn region(&mut self) -> &mut (dyn PageRegion + Send) {
        match self {
            RegionArg::Host(r) => &mut **r,
            RegionArg::Engine(p) => p.region(),
        }
    }
}

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

    /// After a settle or release: lets the kept regions go once the link holds no page.
    fn let_regions_go(&self, link: &core::NixlLink<'static>) {
        if link.held_pages() == 0 {
            self.held_regions.lock().clear();
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
        let released = link.release_pushes();
        self.let_regions_go(&link);
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
        let released = link.release_stages();
        self.let_regions_go(&link);
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
    /// not locked while the stage waits. Without it, keep the region alive yourself while
    /// in_flight names its pages.
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
            let layout = RegionArg::lock(region)?.region().layout();
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
