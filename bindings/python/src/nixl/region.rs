//! The regions a transfer reads and lands in: `HostRegion` (host pages kvguard owns),
//! `EnginePool` (an engine's own pool, described by buffer or address: host memory kvguard reads
//! in place, or GPU memory behind the engine's read and scrub callbacks, `DevicePool`), and
//! `RegionArg`, either of them locked for one call.
//!
//! `unsafe` here: an engine's memory registered by address or through its buffer export, each
//! block with its `// SAFETY:` argument.

use super::agent::NixlAgent;
use super::{busy, bytes_arg, nixl_error, page_ids};
use crate::transfer::Bytes;
use kvguard::transfer::nixl as core;
use kvguard::transfer::nixl::PageRegion;
use parking_lot::Mutex;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::borrow::Cow;

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
pub(super) struct DevicePool {
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
pub(super) enum PoolMemory {
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
        // `base`, held by this pool object so the exporter keeps the memory allocated while the
        // object lives; the registration may outlive the object inside a core link's share (a
        // held transfer), and the NixlLink holding it keeps this object alive until the share
        // goes (or leaks both: released or dropped while holding). Peers writing it and kvguard
        // zeroing refused pages is what the caller asked for by handing it over.
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
                // SAFETY: the caller vouches for the memory (the class doc); `owner`, kept by this
                // pool object, keeps it allocated while the object lives, and a NixlLink holding
                // a transfer from the pool keeps the object alive (or leaks it) for as long as the
                // core link's share of the registration may live.
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
pub(super) enum RegionArg<'a> {
    Host(parking_lot::MutexGuard<'a, core::HostRegion>),
    Engine(parking_lot::MutexGuard<'a, PoolMemory>),
}

impl<'a> RegionArg<'a> {
    /// The layout of `region` (a HostRegion or an EnginePool) as the object keeps it, without
    /// locking it (a transfer on it in another thread is no reason to refuse).
    pub(super) fn layout_of(region: &Bound<'_, PyAny>) -> PyResult<core::RegionLayout> {
        if let Ok(r) = region.cast::<HostRegion>() {
            return Ok(r.get().layout);
        }
        if let Ok(p) = region.cast::<EnginePool>() {
            return Ok(p.get().layout);
        }
        Err(PyTypeError::new_err("region must be a kvguard.HostRegion or a kvguard.EnginePool"))
    }

    pub(super) fn lock(region: &'a Bound<'_, PyAny>) -> PyResult<RegionArg<'a>> {
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

    pub(super) fn region(&mut self) -> &mut (dyn PageRegion + Send) {
        match self {
            RegionArg::Host(r) => &mut **r,
            RegionArg::Engine(p) => p.region(),
        }
    }
}
