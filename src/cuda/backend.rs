//! The CUDA edge: every `unsafe` of the device side lives in this file.
//!
//! Invariants this file keeps, so that every method here is safe to call:
//! - kvguard's own buffers (tag table, canaries, ring, status words, readers, staging) are
//!   allocated here at their final sizes and never reallocated; each launch checks that the
//!   counts it passes fit them.
//! - Engine memory reaches a kernel only as a [`Borrowed`], whose creator promised (in
//!   `Borrowed::from_raw`'s contract) that it is live device memory of the stated length; each
//!   launch checks that the elements the kernel will touch, computed from the counts and shapes
//!   it is given, lie inside every `Borrowed`.
//! - Page ids and slot numbers that come from device memory are range-checked *by the kernels*
//!   (out-of-range ids are reported or skipped, never dereferenced), except in the unchecked
//!   reference attention, which is therefore the one `unsafe fn` here.
//! - A prebuilt CUBIN reaches the driver (which reads it without knowing its length) only after
//!   `source::check_cubin` proved its ELF headers and sections lie inside its bytes, and its
//!   kernels are launched only if it defines the fingerprint kernel of the sources whose
//!   argument lists the launches below follow.
//! - Every launch goes on `Device::stream`, so kvguard's launches are ordered with each other and
//!   with whatever else the engine puts on that stream.
//! - Launches and the status memset pass kvguard's buffers as raw device addresses (taken once,
//!   at allocation), so they record and wait on no cudarc events: a capture of the check path
//!   into a CUDA graph contains only kvguard's kernel and memset nodes.

use super::DeviceError;
use super::guard::{AttentionCheck, BlockTableStep, DecodeAttention, KvStore, PagedKvStep};
use super::layout::{DeviceReader, DeviceTag, RingHeader};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, sys,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// Device memory the engine owns and lends to kvguard: `len` elements of `T` at a device address.
/// kvguard never frees it.
#[derive(Debug, PartialEq, Eq)]
pub struct Borrowed<T> {
    ptr: u64,
    len: usize,
    elem: PhantomData<fn() -> T>,
}

impl<T> Clone for Borrowed<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Borrowed<T> {}

impl<T> Borrowed<T> {
    /// Lends `len` elements of `T` at device address `ptr` (a `CUdeviceptr`, e.g. a PyTorch
    /// tensor's `data_ptr()`).
    ///
    /// # Safety
    /// - `ptr` is an address in the CUDA context of the [`DeviceGuard`](super::DeviceGuard) this
    ///   is passed to, aligned for `T` (and to 16 bytes for pages given to the scrub kernel's
    ///   vector path, which it checks itself), and `len * size_of::<T>()` bytes from it are one
    ///   live allocation (`len == 0` needs no allocation);
    /// - the memory stays allocated, and is not handed to anything else, until every kvguard
    ///   launch given this value has completed on its stream;
    /// - nothing else writes memory a launch reads, or touches memory a launch writes, unless
    ///   ordered with the launch on the stream (the usual rule for a CUDA kernel's arguments).
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Borrowed<T> {
        Borrowed { ptr, len, elem: PhantomData }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements lent.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Whether the CUDA driver library can be loaded, without loading it for good or panicking.
pub(super) fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver library's names and drops
    // what it opened; no driver code runs.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded, without loading it for good or panicking.
pub(super) fn nvrtc_library_present() -> bool {
    // SAFETY: as above, for NVRTC's library names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` with NVRTC `options` straight to a CUBIN (SASS for one real architecture,
/// `--gpu-architecture=sm_XY`): loading it needs no PTX JIT, so a driver older than the NVRTC
/// that compiled it still loads it. `Err` carries NVRTC's log or error. The caller has checked
/// that NVRTC is present.
pub(super) fn nvrtc_cubin(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: `self.0` came from `create_program` and is destroyed exactly once, here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let src = std::ffi::CString::new(source).map_err(|_| "the source contains a NUL byte".to_string())?;
    let name = c"kvguard.cu";
    let program = Program(result::create_program(&src, Some(name)).map_err(|e| format!("{e:?}"))?);
    // SAFETY: `program.0` is a live program; the options are NUL-free strings copied by NVRTC.
    if let Err(e) = unsafe { result::compile_program(program.0, options) } {
        // SAFETY: the program is live; the log is a NUL-terminated copy owned by the Vec.
        let log = unsafe { result::get_program_log(program.0) }.unwrap_or_default();
        let bytes: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
        return Err(format!("{e:?}: {}", String::from_utf8_lossy(&bytes)));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }.result().map_err(|e| format!("{e:?}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for.
    unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }.result().map_err(|e| format!("{e:?}"))?;
    Ok(cubin)
}

fn need<T>(what: &str, b: &Borrowed<T>, elements: u64) -> Result<(), DeviceError> {
    if (b.len as u64) < elements {
        return Err(DeviceError::Argument(format!("{what}: {elements} elements needed, {} lent", b.len)));
    }
    Ok(())
}

fn need_opt<T>(what: &str, b: &Option<Borrowed<T>>, elements: u64) -> Result<(), DeviceError> {
    b.as_ref().map_or(Ok(()), |b| need(what, b, elements))
}

fn fits(what: &str, count: u64, capacity: u64) -> Result<(), DeviceError> {
    if count > capacity {
        return Err(DeviceError::Argument(format!("{what}: {count} exceeds the capacity {capacity}")));
    }
    Ok(())
}

fn ptr_or_null<T>(b: &Option<Borrowed<T>>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr)
}

fn cfg(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Grid sizes are capped: kernels are grid-stride loops, so a capped grid is still complete.
const MAX_GRID_X: u32 = 1 << 16;
const MAX_GRID_Y: u32 = 65_535;

fn blocks_for(n: u64, threads: u32) -> u32 {
    n.div_ceil(u64::from(threads)).clamp(1, u64::from(MAX_GRID_X)) as u32
}

struct Kernels {
    apply: CudaFunction,
    verify_block_table: CudaFunction,
    verify_paged_kv: CudaFunction,
    store_b32: CudaFunction,
    store_b16: CudaFunction,
    crc32: CudaFunction,
    scrub: CudaFunction,
    attention_unchecked: CudaFunction,
    attention_checked: CudaFunction,
}

/// A pool region of engine memory: page `p` is `page_bytes` bytes at `base + p * page_stride`.
#[derive(Clone, Copy, Debug)]
pub struct PageRegion {
    /// The region's memory.
    pub base: Borrowed<u8>,
    /// Bytes from one page to the next.
    pub page_stride: u64,
    /// Bytes per page (at most `page_stride`).
    pub page_bytes: u64,
    /// Pages in the region.
    pub num_pages: u32,
}

impl PageRegion {
    fn check(&self) -> Result<(), DeviceError> {
        if self.page_bytes > self.page_stride && self.num_pages > 1 {
            return Err(DeviceError::Argument("page region: page_bytes exceeds page_stride".into()));
        }
        let end = match self.num_pages {
            0 => 0,
            n => u64::from(n - 1).saturating_mul(self.page_stride).saturating_add(self.page_bytes),
        };
        need("page region", &self.base, end)
    }
}

/// The CUDA context, stream, compiled kernels and kvguard's own device buffers.
pub(super) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    kernels: Kernels,
    pub num_pages: u32,
    pub page_size: u32,
    pub max_seqs: u32,
    pub ring_capacity: u32,
    pub staging_capacity: u32,
    /// Raw addresses of the buffers below, taken once at allocation.
    pub raw: RawBuffers,
    // The tag table is used through `raw` only; this owns the allocation.
    _tags: CudaSlice<u8>,
    canaries: CudaSlice<u32>,
    ring: CudaSlice<u8>,
    status: CudaSlice<u32>,
    readers: CudaSlice<u8>,
    staging_pages: CudaSlice<u32>,
    staging_tags: CudaSlice<u8>,
    /// Page-locked host copy of the ring, and the event that says the copy in flight landed.
    ring_copy: Option<PinnedHostSlice<u8>>,
    ring_copy_done: Option<CudaEvent>,
}

/// Device addresses of kvguard's own buffers (valid while the `Device` lives).
#[derive(Clone, Copy, Debug)]
pub(super) struct RawBuffers {
    pub tags: u64,
    pub canaries: u64,
    pub ring: u64,
    pub status: u64,
    pub readers: u64,
    pub staging_pages: u64,
    pub staging_tags: u64,
}

/// A null device pointer, for optional kernel arguments.
static NULL_PTR: u64 = 0;

impl RawBuffers {
    /// The canary array as a kernel argument when `wanted`, else a null pointer (the kernels
    /// skip canaries on null).
    fn canaries_if(&self, wanted: bool) -> &u64 {
        if wanted { &self.canaries } else { &NULL_PTR }
    }
}

pub(super) struct DeviceShape {
    pub ordinal: usize,
    pub num_pages: u32,
    pub page_size: u32,
    pub max_seqs: u32,
    pub ring_capacity: u32,
    pub staging_capacity: u32,
    /// Kernels built ahead of time, already through `source::check_cubin`; `None`: NVRTC.
    pub cubin: Option<Arc<[u8]>>,
}

/// Driver errors that say the image itself is unusable on this device (rather than the device
/// or driver being in trouble).
fn image_refused(e: &cudarc::driver::DriverError) -> bool {
    use sys::cudaError_enum as E;
    matches!(
        e.0,
        E::CUDA_ERROR_NO_BINARY_FOR_GPU
            | E::CUDA_ERROR_INVALID_IMAGE
            | E::CUDA_ERROR_INVALID_SOURCE
            | E::CUDA_ERROR_INVALID_PTX
            | E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
            | E::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED
    )
}

/// A copy of a CUBIN for the driver, with a page of zero bytes after it.
fn padded(cubin: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(cubin.len() + 4096);
    bytes.extend_from_slice(cubin);
    bytes.resize(cubin.len() + 4096, 0);
    bytes
}

/// Loads a prebuilt CUBIN (checked by `source::check_cubin`) into `ctx`; errors that blame the
/// image are [`DeviceError::Cubin`], naming the device's architecture.
fn load_cubin(ctx: &Arc<CudaContext>, cubin: &[u8], arch: &str) -> Result<Arc<CudaModule>, DeviceError> {
    // The driver reads the image without its length: `check_cubin` proved that the ELF headers
    // and every section they name lie inside these bytes; zero padding after them stops any
    // string read that the check could not foresee.
    ctx.load_module(cudarc::nvrtc::Ptx::from_binary(padded(cubin))).map_err(|e| {
        if image_refused(&e) {
            let built = super::source::cubin_arch(cubin).map_or(String::new(), |a| format!("built for {a}, "));
            DeviceError::Cubin(format!(
                "{built}the driver refused it for this {arch} device ({e}): build it for {arch}"
            ))
        } else {
            DeviceError::Driver(e)
        }
    })
}

impl Device {
    /// Opens device `shape.ordinal`, compiles (or reuses) the kernels and allocates the buffers.
    /// Never panics: missing libraries and devices are errors.
    pub fn open(shape: DeviceShape) -> Result<Device, DeviceError> {
        if !driver_library_present() {
            return Err(DeviceError::DriverNotFound);
        }
        // cudarc panics when a driver symbol it needs is missing; keep that an error.
        let ctx = std::panic::catch_unwind(|| -> Result<Arc<CudaContext>, DeviceError> {
            let count = CudaContext::device_count()?;
            if shape.ordinal >= count.max(0) as usize {
                return Err(DeviceError::NoDevice { ordinal: shape.ordinal, count });
            }
            Ok(CudaContext::new(shape.ordinal)?)
        })
        .map_err(|p| DeviceError::Loader(super::panic_message(p)))??;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        // SASS for this GPU (no JIT, so no driver-vs-NVRTC version constraint): the prebuilt
        // CUBIN, or NVRTC's; PTX for the JIT only when this NVRTC does not know the architecture.
        let module = match &shape.cubin {
            Some(cubin) => load_cubin(&ctx, cubin, &arch)?,
            None => match super::source::compile_cubin(&arch) {
                Ok(cubin) => ctx.load_module(cudarc::nvrtc::Ptx::from_binary(padded(&cubin)))?,
                Err(DeviceError::Compile { .. }) => {
                    let ptx = super::source::compile_ptx(&format!("compute_{major}{minor}"))?;
                    ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))?
                }
                Err(e) => return Err(e),
            },
        };
        // A prebuilt image must come from these sources: same kernels, same arguments, same
        // layouts. Its fingerprint kernel says so; a kernel missing from it is its fault too.
        let prebuilt = shape.cubin.is_some();
        let from_other_sources = |what: String| {
            DeviceError::Cubin(format!(
                "{what}: it was built from other kernel sources than this kvguard's; rebuild it \
                 with this version's kvguard::cuda::source::compile_cubin(\"{arch}\")"
            ))
        };
        if prebuilt {
            let fingerprint = super::source::fingerprint_kernel();
            module.load_function(&fingerprint).map_err(|_| from_other_sources(format!("{fingerprint} is missing")))?;
        }
        let f = |name: &str| {
            module.load_function(name).map_err(|e| {
                if prebuilt {
                    from_other_sources(format!("kernel {name} is missing ({e})"))
                } else {
                    DeviceError::Driver(e)
                }
            })
        };
        let kernels = Kernels {
            apply: f("kvg_apply_tag_updates")?,
            verify_block_table: f("kvg_verify_block_table")?,
            verify_paged_kv: f("kvg_verify_paged_kv")?,
            store_b32: f("kvg_store_kv_b32")?,
            store_b16: f("kvg_store_kv_b16")?,
            crc32: f("kvg_crc32_pages")?,
            scrub: f("kvg_scrub_pages")?,
            attention_unchecked: f("kvg_decode_attention_unchecked")?,
            attention_checked: f("kvg_decode_attention_checked")?,
        };
        // A stream of kvguard's own (the legacy default stream cannot be captured into a graph);
        // engines hand theirs in with `use_stream`.
        let stream = ctx.new_stream()?;
        let slots = u64::from(shape.num_pages) * u64::from(shape.page_size);
        let tags = stream.alloc_zeros::<u8>(shape.num_pages as usize * DeviceTag::SIZE)?;
        let canaries = stream.alloc_zeros::<u32>(slots as usize)?;
        let mut ring = stream.alloc_zeros::<u8>(RingHeader::ring_bytes(shape.ring_capacity))?;
        let header = RingHeader { capacity: shape.ring_capacity, ..RingHeader::default() };
        stream.memcpy_htod(&header.to_bytes(), &mut ring.slice_mut(0..RingHeader::SIZE))?;
        let status = stream.alloc_zeros::<u32>(shape.max_seqs.max(1) as usize)?;
        let readers = stream.alloc_zeros::<u8>(shape.max_seqs.max(1) as usize * DeviceReader::SIZE)?;
        let staging_pages = stream.alloc_zeros::<u32>(shape.staging_capacity.max(1) as usize)?;
        let staging_tags = stream.alloc_zeros::<u8>(shape.staging_capacity.max(1) as usize * DeviceTag::SIZE)?;
        stream.synchronize()?;
        let raw = RawBuffers {
            tags: tags.device_ptr(&stream).0,
            canaries: canaries.device_ptr(&stream).0,
            ring: ring.device_ptr(&stream).0,
            status: status.device_ptr(&stream).0,
            readers: readers.device_ptr(&stream).0,
            staging_pages: staging_pages.device_ptr(&stream).0,
            staging_tags: staging_tags.device_ptr(&stream).0,
        };
        Ok(Device {
            raw,
            ctx,
            stream,
            kernels,
            num_pages: shape.num_pages,
            page_size: shape.page_size,
            max_seqs: shape.max_seqs,
            ring_capacity: shape.ring_capacity,
            staging_capacity: shape.staging_capacity,
            _tags: tags,
            canaries,
            ring,
            status,
            readers,
            staging_pages,
            staging_tags,
            ring_copy: None,
            ring_copy_done: None,
        })
    }

    /// Launches on the engine's stream from now on.
    ///
    /// # Safety
    /// `stream` is a live `CUstream` of this device's context, and stays alive as long as this
    /// `Device` (or any launch on it) may use it.
    pub unsafe fn use_stream(&mut self, stream: sys::CUstream) -> Result<(), DeviceError> {
        // Everything kvguard queued so far completes before work queued on the new stream.
        self.stream.synchronize()?;
        // SAFETY: the caller guarantees `stream` belongs to `self.ctx` and outlives this wrapper.
        self.stream = unsafe { self.ctx.wrap_borrowed_stream(stream) };
        Ok(())
    }

    /// Uploads `pages.len()` changed tags (at most the staging capacity) and scatters them.
    pub fn apply_tag_updates(&mut self, pages: &[u32], tag_bytes: &[u8]) -> Result<(), DeviceError> {
        let n = pages.len();
        fits("tag updates per launch", n as u64, u64::from(self.staging_capacity))?;
        if tag_bytes.len() != n * DeviceTag::SIZE {
            return Err(DeviceError::Argument("tag updates: one 32-byte tag per page".into()));
        }
        if n == 0 {
            return Ok(());
        }
        self.stream.memcpy_htod(pages, &mut self.staging_pages.slice_mut(0..n))?;
        self.stream.memcpy_htod(tag_bytes, &mut self.staging_tags.slice_mut(0..tag_bytes.len()))?;
        let n32 = n as u32;
        let mut b = self.stream.launch_builder(&self.kernels.apply);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.raw.staging_pages).arg(&self.raw.staging_tags).arg(&n32);
        // SAFETY: `kvg_apply_tag_updates(tags, num_pages, pages, updates, n)` reads n <= staging
        // capacity entries of both staging buffers and writes only tags[page] for page < num_pages,
        // and `tags` holds num_pages tags; the argument list matches the kernel's signature.
        unsafe { b.launch(cfg((blocks_for(n as u64, 256), 1, 1), 256)) }?;
        Ok(())
    }

    /// `kvg_verify_block_table` over the engine's vLLM-layout step.
    pub fn verify_block_table(&mut self, step: &BlockTableStep) -> Result<(), DeviceError> {
        let BlockTableStep { block_table, seq_lens, num_seqs, max_blocks, generations, check_canaries } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        let cells = u64::from(num_seqs) * u64::from(max_blocks);
        need("block_table", &block_table, cells)?;
        need("seq_lens", &seq_lens, u64::from(num_seqs))?;
        need_opt("expected generations", &generations, cells)?;
        if num_seqs == 0 {
            return Ok(());
        }
        let (bt, sl, gens) = (block_table.ptr, seq_lens.ptr, ptr_or_null(&generations));
        let mut b = self.stream.launch_builder(&self.kernels.verify_block_table);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&bt).arg(&num_seqs).arg(&max_blocks);
        b.arg(&sl).arg(&gens).arg(self.raw.canaries_if(check_canaries));
        b.arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let grid = (blocks_for(u64::from(max_blocks), 128), num_seqs.min(MAX_GRID_Y), 1);
        // SAFETY: the kernel reads block_table/expected generations rows s < num_seqs of
        // max_blocks entries, seq_lens[s], readers[s] and writes status[s] for s < num_seqs
        // (checked against the Borrowed lengths and max_seqs above); page ids are range-checked
        // in the kernel before tags or canaries are read; the ring is written within its
        // capacity. Arguments match `kvg_verify_block_table`'s signature in order and type.
        unsafe { b.launch(cfg(grid, 128)) }?;
        Ok(())
    }

    /// `kvg_verify_paged_kv` over the engine's FlashInfer-layout step.
    pub fn verify_paged_kv(&mut self, step: &PagedKvStep) -> Result<(), DeviceError> {
        let PagedKvStep {
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            num_seqs,
            max_pages_per_seq,
            generations,
            check_canaries,
        } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        need("kv_indptr", &kv_indptr, u64::from(num_seqs) + 1)?;
        need("kv_last_page_len", &kv_last_page_len, u64::from(num_seqs))?;
        need_opt("expected generations", &generations, kv_indices.len as u64)?;
        let num_indices = u32::try_from(kv_indices.len)
            .map_err(|_| DeviceError::Argument("kv_indices: more than 2^32 entries".into()))?;
        if num_seqs == 0 {
            return Ok(());
        }
        let (ip, ix, lp, gens) = (kv_indptr.ptr, kv_indices.ptr, kv_last_page_len.ptr, ptr_or_null(&generations));
        let mut b = self.stream.launch_builder(&self.kernels.verify_paged_kv);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&ip).arg(&ix).arg(&lp).arg(&num_seqs);
        b.arg(&num_indices).arg(&gens).arg(self.raw.canaries_if(check_canaries));
        b.arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let grid = (blocks_for(u64::from(max_pages_per_seq), 128), num_seqs.min(MAX_GRID_Y), 1);
        // SAFETY: indptr[0..=num_seqs] and last_page_len[0..num_seqs] are in bounds (checked);
        // the kernel refuses any indptr range beyond num_indices (= the lent length) before
        // reading kv_indices or the generations (lent with at least as many entries); page ids
        // are range-checked before tags are read. Arguments match `kvg_verify_paged_kv`.
        unsafe { b.launch(cfg(grid, 128)) }?;
        Ok(())
    }

    /// `kvg_crc32_pages`: CRC32 of `n_pages` pages of `region` into `out`.
    pub fn crc32_pages(
        &mut self,
        region: PageRegion,
        pages: Option<Borrowed<i32>>,
        n_pages: u32,
        chunk_bytes: u32,
        out: Borrowed<u32>,
    ) -> Result<(), DeviceError> {
        region.check()?;
        need_opt("pages", &pages, u64::from(n_pages))?;
        need("crc out", &out, u64::from(n_pages))?;
        if pages.is_none() {
            fits("pages", u64::from(n_pages), u64::from(region.num_pages))?;
        }
        if n_pages == 0 {
            return Ok(());
        }
        let (base, pg, o) = (region.base.ptr, ptr_or_null(&pages), out.ptr);
        let mut b = self.stream.launch_builder(&self.kernels.crc32);
        b.arg(&base).arg(&region.page_stride).arg(&region.page_bytes).arg(&pg).arg(&n_pages);
        b.arg(&region.num_pages).arg(&chunk_bytes).arg(&o);
        // SAFETY: the kernel reads page_bytes bytes of pages id < region.num_pages only, all
        // inside the lent region (checked), pages[0..n_pages] (checked) and writes
        // out[0..n_pages] (checked). Arguments match `kvg_crc32_pages`.
        unsafe { b.launch(cfg((n_pages.min(MAX_GRID_X), 1, 1), 256)) }?;
        Ok(())
    }

    /// `kvg_scrub_pages`: fills pages of `region` with `pattern`; clears their canaries if asked.
    pub fn scrub_pages(
        &mut self,
        region: PageRegion,
        pages: Borrowed<i32>,
        n_pages: u32,
        pattern: u32,
        clear_canaries: bool,
    ) -> Result<(), DeviceError> {
        region.check()?;
        need("pages", &pages, u64::from(n_pages))?;
        if clear_canaries && region.num_pages > self.num_pages {
            return Err(DeviceError::Argument("scrub: the region has more pages than the pool".into()));
        }
        if n_pages == 0 {
            return Ok(());
        }
        let (base, pg) = (region.base.ptr, pages.ptr);
        let mut b = self.stream.launch_builder(&self.kernels.scrub);
        b.arg(&base).arg(&region.page_stride).arg(&region.page_bytes).arg(&pg).arg(&n_pages);
        b.arg(&region.num_pages).arg(&pattern).arg(self.raw.canaries_if(clear_canaries));
        b.arg(&self.page_size);
        // SAFETY: the kernel writes page_bytes bytes of pages id < region.num_pages (inside the
        // lent region, checked) and, if asked, canaries of those pages (num_pages <= the pool's,
        // checked). Arguments match `kvg_scrub_pages`.
        unsafe { b.launch(cfg((n_pages.min(MAX_GRID_X), 1, 1), 256)) }?;
        Ok(())
    }

    /// `kvg_store_kv_b16` / `_b32`: the reference KV store with canary stamping.
    pub fn store_kv<T: KvElement>(&mut self, store: &KvStore<T>) -> Result<(), DeviceError> {
        let KvStore {
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            num_tokens,
            kv_width,
            query_start_loc,
            num_seqs,
        } = *store;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        let io = u64::from(num_tokens) * u64::from(kv_width);
        let cache = u64::from(self.num_pages) * u64::from(self.page_size) * u64::from(kv_width);
        need("key", &key, io)?;
        need("value", &value, io)?;
        need("key_cache", &key_cache, cache)?;
        need("value_cache", &value_cache, cache)?;
        need("slot_mapping", &slot_mapping, u64::from(num_tokens))?;
        need("query_start_loc", &query_start_loc, u64::from(num_seqs) + 1)?;
        if num_tokens == 0 || num_seqs == 0 {
            return Ok(());
        }
        let (k, v, kc, vc, sm, qsl) =
            (key.ptr, value.ptr, key_cache.ptr, value_cache.ptr, slot_mapping.ptr, query_start_loc.ptr);
        let func = if T::BYTES == 2 { &self.kernels.store_b16 } else { &self.kernels.store_b32 };
        let mut b = self.stream.launch_builder(func);
        b.arg(&k).arg(&v).arg(&kc).arg(&vc).arg(&sm).arg(&num_tokens).arg(&kv_width).arg(&self.page_size);
        b.arg(&qsl).arg(&num_seqs).arg(&self.raw.readers).arg(&self.raw.tags).arg(&self.num_pages);
        b.arg(&self.raw.canaries).arg(&self.raw.status).arg(&self.raw.ring);
        // SAFETY: tokens t < num_tokens read key/value rows in bounds (checked); a slot is written
        // only after its page passed kvg_check_store, which requires page < num_pages, so cache
        // writes stay within num_pages * page_size * kv_width (checked) and canary writes within
        // the pool's canaries; the writer index comes from a binary search bounded by num_seqs.
        // Arguments match `kvg_store_kv_b16/b32` for the element size.
        unsafe { b.launch(cfg((num_tokens.min(MAX_GRID_X), 1, 1), 128)) }?;
        Ok(())
    }

    /// The reference decode attention with the fused check (`kvg_decode_attention_checked`).
    pub fn decode_attention_checked(
        &mut self,
        step: &DecodeAttention,
        check: AttentionCheck,
    ) -> Result<(), DeviceError> {
        step.check(self)?;
        let shape = step.shape;
        fits("sequences", u64::from(shape.num_seqs), u64::from(self.max_seqs))?;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let fc = u32::from(check.fail_closed);
        let ptrs = step.ptrs();
        let mut b = self.stream.launch_builder(&self.kernels.attention_checked);
        shape.push(&mut b, &ptrs, &self.page_size);
        b.arg(&self.raw.tags)
            .arg(&self.num_pages)
            .arg(&self.raw.readers)
            .arg(self.raw.canaries_if(check.check_canaries));
        b.arg(&self.raw.status).arg(&self.raw.ring).arg(&fc);
        // SAFETY: step.check verified every buffer holds the elements the kernel indexes from
        // the shape; pages are range-checked (kvg_check_page) before any K/V row is read, and a
        // page out of range is never read in either mode. Arguments match the kernel.
        unsafe { b.launch(shape.grid()) }?;
        Ok(())
    }

    /// The reference decode attention without any check (`kvg_decode_attention_unchecked`),
    /// the baseline the fused check is measured against.
    ///
    /// # Safety
    /// Every block-table entry among the first `ceil(seq_lens[s] / page_size)` of each sequence
    /// is a page id below the pool's `num_pages` (or negative, which is skipped): the kernel reads
    /// K and V at those pages without checking.
    pub unsafe fn decode_attention_unchecked(&mut self, step: &DecodeAttention) -> Result<(), DeviceError> {
        step.check(self)?;
        let shape = step.shape;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let ptrs = step.ptrs();
        let mut b = self.stream.launch_builder(&self.kernels.attention_unchecked);
        shape.push(&mut b, &ptrs, &self.page_size);
        // SAFETY: buffers hold what the shape indexes (checked); the caller guarantees the page
        // ids read are in range. Arguments match `kvg_decode_attention_unchecked`.
        unsafe { b.launch(shape.grid()) }?;
        Ok(())
    }

    /// Uploads the step's readers (one per sequence).
    pub fn set_readers(&mut self, readers: &[DeviceReader]) -> Result<(), DeviceError> {
        fits("readers", readers.len() as u64, u64::from(self.max_seqs))?;
        let bytes: Vec<u8> = readers.iter().flat_map(|r| r.to_bytes()).collect();
        if !bytes.is_empty() {
            self.stream.memcpy_htod(&bytes, &mut self.readers.slice_mut(0..bytes.len()))?;
        }
        Ok(())
    }

    /// Writes canaries for slots `first..first + canaries.len()` (migration, restore, benches).
    pub fn write_canaries(&mut self, first: u64, canaries: &[u32]) -> Result<(), DeviceError> {
        let total = u64::from(self.num_pages) * u64::from(self.page_size);
        let end = first.checked_add(canaries.len() as u64).filter(|&e| e <= total);
        let end = end.ok_or_else(|| DeviceError::Argument(format!("canaries: slots beyond the pool's {total}")))?;
        if !canaries.is_empty() {
            let mut dst = self.canaries.slice_mut(first as usize..end as usize);
            self.stream.memcpy_htod(canaries, &mut dst)?;
        }
        Ok(())
    }

    /// Zeroes the per-sequence status words (a memset node, graph-capturable).
    pub fn clear_status(&mut self) -> Result<(), DeviceError> {
        let bytes = self.max_seqs.max(1) as usize * 4;
        self.ctx.bind_to_thread()?;
        // SAFETY: `raw.status` is kvguard's allocation of max(max_seqs, 1) words, alive as long
        // as `self`; the memset is ordered on `self.stream` with every launch that uses it.
        unsafe { cudarc::driver::result::memset_d8_async(self.raw.status, 0, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Copies the status words of the first `n` sequences (synchronises the stream).
    pub fn read_status(&self, n: u32) -> Result<Vec<u32>, DeviceError> {
        fits("sequences", u64::from(n), u64::from(self.max_seqs))?;
        let mut all = self.stream.clone_dtoh(&self.status)?;
        all.truncate(n as usize);
        Ok(all)
    }

    /// Starts an asynchronous copy of the ring into page-locked host memory, ordered after the
    /// work queued so far on the stream; nothing waits. A copy already in flight is kept.
    pub fn start_ring_copy(&mut self) -> Result<(), DeviceError> {
        if self.ring_copy_done.is_some() {
            return Ok(());
        }
        let buffer = match self.ring_copy.take() {
            Some(b) => b,
            // SAFETY: the buffer's bytes are read only through `finish_ring_copy`, after the
            // device-to-host copy of its whole length has completed (its event says so), so
            // its uninitialised contents are never observed. Flags 0: cached, for host reads.
            None => unsafe { self.ctx.alloc_pinned_with_flags::<u8>(self.ring.len(), 0) }?,
        };
        let buffer = self.ring_copy.insert(buffer);
        self.stream.memcpy_dtoh(&self.ring, buffer)?;
        self.ring_copy_done = Some(self.stream.record_event(None)?);
        Ok(())
    }

    /// The ring's bytes if the copy in flight has landed (`None`: none started, or not yet).
    /// With `wait`, blocks until it lands.
    pub fn finish_ring_copy(&mut self, wait: bool) -> Result<Option<Vec<u8>>, DeviceError> {
        let Some(done) = &self.ring_copy_done else { return Ok(None) };
        if wait {
            done.synchronize()?;
        } else if !done.try_is_complete()? {
            return Ok(None);
        }
        self.ring_copy_done = None;
        let copy = self.ring_copy.as_ref().map(|b| b.as_slice().map(<[u8]>::to_vec)).transpose()?;
        Ok(copy)
    }

    /// Tells the device that records before `consumed` were drained.
    pub fn set_consumed(&mut self, consumed: u64) -> Result<(), DeviceError> {
        self.stream.memcpy_htod(&consumed.to_le_bytes(), &mut self.ring.slice_mut(16..24))?;
        Ok(())
    }
}

/// Element types the reference KV store moves (it copies bits: f16 and bf16 are `u16`).
pub trait KvElement: sealed::Sealed {
    /// Bytes per element.
    const BYTES: usize;
}
impl KvElement for u16 {
    const BYTES: usize = 2;
}
impl KvElement for u32 {
    const BYTES: usize = 4;
}
impl KvElement for f32 {
    const BYTES: usize = 4;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
    impl Sealed for f32 {}
}

/// The shape of a reference decode-attention launch (vLLM layout, f32, GQA).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Sequences in the step.
    pub num_seqs: u32,
    /// Entries per block-table row.
    pub max_blocks: u32,
    /// Query heads.
    pub num_heads: u32,
    /// KV heads (divides `num_heads`).
    pub num_kv_heads: u32,
    /// Head dimension: a multiple of 32, at most 256.
    pub head_dim: u32,
    /// Softmax scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl DecodeAttention {
    /// Every buffer holds what the shape makes the kernels index.
    fn check(&self, d: &Device) -> Result<(), DeviceError> {
        let s = &self.shape;
        if s.head_dim == 0 || !s.head_dim.is_multiple_of(32) || s.head_dim > 256 {
            return Err(DeviceError::Argument("attention: head_dim must be a multiple of 32, at most 256".into()));
        }
        if s.num_kv_heads == 0 || !s.num_heads.is_multiple_of(s.num_kv_heads) {
            return Err(DeviceError::Argument("attention: num_kv_heads must divide num_heads".into()));
        }
        let io = u64::from(s.num_seqs) * u64::from(s.num_heads) * u64::from(s.head_dim);
        let cache = u64::from(d.num_pages) * u64::from(d.page_size) * u64::from(s.num_kv_heads) * u64::from(s.head_dim);
        need("q", &self.q, io)?;
        need("out", &self.out, io)?;
        need("key_cache", &self.key_cache, cache)?;
        need("value_cache", &self.value_cache, cache)?;
        need("block_table", &self.block_table, u64::from(s.num_seqs) * u64::from(s.max_blocks))?;
        need("seq_lens", &self.seq_lens, u64::from(s.num_seqs))
    }

    /// The buffers' device pointers, in the order [`AttentionShape::push`] takes them.
    fn ptrs(&self) -> [u64; 6] {
        [self.q.ptr, self.key_cache.ptr, self.value_cache.ptr, self.block_table.ptr, self.seq_lens.ptr, self.out.ptr]
    }
}

impl AttentionShape {
    /// Pushes the arguments both attention kernels share, in `KVG_ATTN_ARGS` order.
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>, ptrs: &'a [u64; 6], page_size: &'a u32) {
        let [q, kc, vc, bt, sl, out] = ptrs;
        b.arg(q).arg(kc).arg(vc).arg(bt).arg(&self.max_blocks).arg(sl).arg(&self.num_seqs).arg(&self.num_heads);
        b.arg(&self.num_kv_heads).arg(&self.head_dim).arg(page_size).arg(&self.scale).arg(out);
    }

    fn grid(&self) -> LaunchConfig {
        cfg((self.num_heads.min(MAX_GRID_X), self.num_seqs.min(MAX_GRID_Y), 1), 128)
    }
}
