//! The device: the CUDA context, stream, kernels and kvguard's own buffers, and every launch.
//! Of the device side, only this file, `lent.rs` (the engine's promises) and `nvrtc.rs` (the
//! NVRTC calls) may hold `unsafe`.
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
//!   (out-of-range ids are recorded as violations or skipped, never dereferenced), except in the
//!   unchecked reference attention, which therefore takes an [`UncheckedAttention`], whose
//!   `unsafe` constructor carries the caller's promise that the pages are in range.
//! - A prebuilt CUBIN reaches the driver (which reads it without knowing its length) only after
//!   `source::check_cubin` proved its ELF headers and sections lie inside its bytes, and its
//!   kernels are launched only if it defines the fingerprint kernel of the sources whose
//!   argument lists the launches below follow.
//! - Every launch goes on `Device::stream`, so kvguard's launches are ordered with each other and
//!   with whatever else the engine puts on that stream. The stream is kvguard's own, or the
//!   engine's, lent as an [`EngineStream`] whose `unsafe` constructor promises that it belongs to
//!   this context and outlives the device.
//! - Launches and the status memset pass kvguard's buffers as raw device addresses (taken once,
//!   at allocation), so they record and wait on no cudarc events: a capture of the check path
//!   into a CUDA graph contains only kvguard's kernel and memset nodes.

use super::error::DeviceError;
use super::layout::{DeviceReader, DeviceTag, RingHeader};
use super::lent::{Borrowed, EngineStream};
use super::source;
use super::step::{
    AttentionCheck, AttentionShape, BlockTableStep, DecodeAttention, KvElement, KvStore, PageRegion, PagedKvStep, fits,
    need, need_opt, readers_cover,
};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, sys,
};
use std::sync::Arc;

/// Whether the CUDA driver library can be loaded, without loading it for good or panicking.
pub(super) fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver library's names and drops
    // what it opened; no driver code runs.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn ptr_or_null<T>(b: &Option<Borrowed<T>>) -> u64 {
    b.as_ref().map_or(0, Borrowed::ptr)
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

/// Threads per block of the verify kernels.
const VERIFY_THREADS: u32 = 128;
/// Verify blocks per SM the launch aims for in all: one wave, enough warps to hide latency.
const VERIFY_BLOCKS_PER_SM: u32 = 8;
/// CRC32 blocks per SM: 256 threads and 5 KiB of shared memory each, so 8 are resident on sm_80
/// and sm_90; each builds its table once and then strides over the pages.
const CRC_BLOCKS_PER_SM: u32 = 8;

/// The verify grid: `(x, num_seqs)` blocks, where blocks `(.., s)` stride over sequence `s`'s
/// used pages (at most `pages_bound`). Sized by sequence, not by the block table's width: `x`
/// spreads about `VERIFY_BLOCKS_PER_SM` blocks per SM over the sequences, and is never more
/// than a row's pages need, so a launch has at most `max(num_seqs, 2 x that)` blocks whatever
/// `max_blocks` is (vLLM's rows are `max_model_len / page_size` wide, e.g. 8,192).
pub(super) fn verify_grid(num_seqs: u32, pages_bound: u32, sm_count: u32) -> (u32, u32, u32) {
    let y = num_seqs.clamp(1, MAX_GRID_Y);
    let target = sm_count.max(1).saturating_mul(VERIFY_BLOCKS_PER_SM);
    let row = pages_bound.div_ceil(VERIFY_THREADS).max(1);
    let x = target.div_ceil(y).clamp(1, row).min(MAX_GRID_X);
    (x, y, 1)
}

/// The CRC32 grid: a persistent one of `CRC_BLOCKS_PER_SM` blocks per SM (fewer for fewer
/// pages), so each block builds its 4 KiB table once and amortises it over many pages.
pub(super) fn crc_grid(n_pages: u32, sm_count: u32) -> (u32, u32, u32) {
    let persistent = sm_count.max(1).saturating_mul(CRC_BLOCKS_PER_SM);
    (n_pages.clamp(1, persistent.min(MAX_GRID_X)), 1, 1)
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
    /// The device's multiprocessors: the verify and CRC32 grids are sized from it.
    sm_count: u32,
    /// Readers the last `set_readers` wrote: launches over more sequences are refused.
    readers_set: u32,
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
            let built = source::cubin_arch(cubin).map_or(String::new(), |a| format!("built for {a}, "));
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
        .map_err(|p| DeviceError::Loader(super::error::panic_message(p)))??;
        let (major, minor) = ctx.compute_capability()?;
        let sm_count = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let arch = format!("sm_{major}{minor}");
        // SASS for this GPU (no JIT, so no driver-vs-NVRTC version constraint): the prebuilt
        // CUBIN, or NVRTC's; PTX for the JIT only when this NVRTC does not know the architecture.
        let module = match &shape.cubin {
            Some(cubin) => load_cubin(&ctx, cubin, &arch)?,
            None => match source::compile_cubin(&arch) {
                Ok(cubin) => ctx.load_module(cudarc::nvrtc::Ptx::from_binary(padded(&cubin)))?,
                Err(DeviceError::Compile { .. }) => {
                    let ptx = source::compile_ptx(&format!("compute_{major}{minor}"))?;
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
            let fingerprint = source::fingerprint_kernel();
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
            sm_count: u32::try_from(sm_count).unwrap_or(1).max(1),
            readers_set: 0,
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
    pub fn use_stream(&mut self, stream: EngineStream) -> Result<(), DeviceError> {
        // Everything kvguard queued so far completes before work queued on the new stream.
        self.stream.synchronize()?;
        // SAFETY: `EngineStream::from_raw`'s contract: the stream belongs to this guard's context
        // (`self.ctx`, the primary context of its ordinal) and outlives this `Device`.
        self.stream = unsafe { self.ctx.wrap_borrowed_stream(stream.as_raw()) };
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
        let BlockTableStep { block_table, seq_lens, num_seqs, max_blocks, generations, check_canaries, query_lens } =
            *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        readers_cover("verify_block_table", num_seqs, self.readers_set)?;
        let cells = u64::from(num_seqs) * u64::from(max_blocks);
        need("block_table", &block_table, cells)?;
        need("seq_lens", &seq_lens, u64::from(num_seqs))?;
        need_opt("expected generations", &generations, cells)?;
        need_opt("query_lens", &query_lens, u64::from(num_seqs))?;
        if num_seqs == 0 {
            return Ok(());
        }
        let (bt, sl, gens, ql) =
            (block_table.ptr(), seq_lens.ptr(), ptr_or_null(&generations), ptr_or_null(&query_lens));
        let mut b = self.stream.launch_builder(&self.kernels.verify_block_table);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&bt).arg(&num_seqs).arg(&max_blocks);
        b.arg(&sl).arg(&gens).arg(self.raw.canaries_if(check_canaries)).arg(&ql);
        b.arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let grid = verify_grid(num_seqs, max_blocks, self.sm_count);
        // SAFETY: the kernel reads block_table/expected generations rows s < num_seqs of
        // max_blocks entries, seq_lens[s], query_lens[s], readers[s] (s < num_seqs <= the
        // readers set) and writes status[s] for s < num_seqs (checked against the Borrowed
        // lengths and max_seqs above); page ids are range-checked in the kernel before tags or
        // canaries are read; the ring is written within its capacity. Any grid is complete
        // (grid-stride loops). Arguments match `kvg_verify_block_table`'s signature.
        unsafe { b.launch(cfg(grid, VERIFY_THREADS)) }?;
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
            query_lens,
        } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        readers_cover("verify_paged_kv", num_seqs, self.readers_set)?;
        need("kv_indptr", &kv_indptr, u64::from(num_seqs) + 1)?;
        need("kv_last_page_len", &kv_last_page_len, u64::from(num_seqs))?;
        need_opt("expected generations", &generations, kv_indices.len() as u64)?;
        need_opt("query_lens", &query_lens, u64::from(num_seqs))?;
        let num_indices = u32::try_from(kv_indices.len())
            .map_err(|_| DeviceError::Argument("kv_indices: more than 2^32 entries".into()))?;
        if num_seqs == 0 {
            return Ok(());
        }
        let (ip, ix, lp) = (kv_indptr.ptr(), kv_indices.ptr(), kv_last_page_len.ptr());
        let (gens, ql) = (ptr_or_null(&generations), ptr_or_null(&query_lens));
        let mut b = self.stream.launch_builder(&self.kernels.verify_paged_kv);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&ip).arg(&ix).arg(&lp).arg(&num_seqs);
        b.arg(&num_indices).arg(&gens).arg(self.raw.canaries_if(check_canaries)).arg(&ql);
        b.arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let grid = verify_grid(num_seqs, max_pages_per_seq, self.sm_count);
        // SAFETY: indptr[0..=num_seqs], last_page_len[0..num_seqs], query_lens[0..num_seqs]
        // and readers[0..num_seqs] are in bounds (checked); the kernel refuses any indptr range
        // beyond num_indices (= the lent length) before reading kv_indices or the generations
        // (lent with at least as many entries); page ids are range-checked before tags are
        // read. Any grid is complete. Arguments match `kvg_verify_paged_kv`.
        unsafe { b.launch(cfg(grid, VERIFY_THREADS)) }?;
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
        let (base, pg, o) = (region.base.ptr(), ptr_or_null(&pages), out.ptr());
        let mut b = self.stream.launch_builder(&self.kernels.crc32);
        b.arg(&base).arg(&region.page_stride).arg(&region.page_bytes).arg(&pg).arg(&n_pages);
        b.arg(&region.num_pages).arg(&chunk_bytes).arg(&o);
        // SAFETY: the kernel reads page_bytes bytes of pages id < region.num_pages only, all
        // inside the lent region (checked), pages[0..n_pages] (checked) and writes
        // out[0..n_pages] (checked). Arguments match `kvg_crc32_pages`.
        unsafe { b.launch(cfg(crc_grid(n_pages, self.sm_count), 256)) }?;
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
        let (base, pg) = (region.base.ptr(), pages.ptr());
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
        readers_cover("store_kv", num_seqs, self.readers_set)?;
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
            (key.ptr(), value.ptr(), key_cache.ptr(), value_cache.ptr(), slot_mapping.ptr(), query_start_loc.ptr());
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
        step.check(self.num_pages, self.page_size)?;
        let shape = step.shape;
        fits("sequences", u64::from(shape.num_seqs), u64::from(self.max_seqs))?;
        readers_cover("decode_attention_checked", shape.num_seqs, self.readers_set)?;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let fc = u32::from(check.fail_closed);
        let ptrs = attention_ptrs(step);
        let mut b = self.stream.launch_builder(&self.kernels.attention_checked);
        push_attention_args(&mut b, &shape, &ptrs, &self.page_size);
        b.arg(&self.raw.tags)
            .arg(&self.num_pages)
            .arg(&self.raw.readers)
            .arg(self.raw.canaries_if(check.check_canaries));
        b.arg(&self.raw.status).arg(&self.raw.ring).arg(&fc);
        // SAFETY: step.check verified every buffer holds the elements the kernel indexes from
        // the shape; pages are range-checked (kvg_check_page) before any K/V row is read, and a
        // page out of range is never read in either mode. Arguments match the kernel.
        unsafe { b.launch(attention_grid(&shape)) }?;
        Ok(())
    }

    /// The reference decode attention without any check (`kvg_decode_attention_unchecked`),
    /// the baseline the fused check is measured against.
    pub fn decode_attention_unchecked(&mut self, unchecked: &UncheckedAttention) -> Result<(), DeviceError> {
        let step = &unchecked.step;
        step.check(self.num_pages, self.page_size)?;
        let shape = step.shape;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let ptrs = attention_ptrs(step);
        let mut b = self.stream.launch_builder(&self.kernels.attention_unchecked);
        push_attention_args(&mut b, &shape, &ptrs, &self.page_size);
        // SAFETY: buffers hold what the shape indexes (checked); `UncheckedAttention::new`'s
        // contract: the page ids read are below this pool's `num_pages` (or negative, skipped).
        // Arguments match `kvg_decode_attention_unchecked`.
        unsafe { b.launch(attention_grid(&shape)) }?;
        Ok(())
    }

    /// Uploads the step's readers (one per sequence).
    pub fn set_readers(&mut self, readers: &[DeviceReader]) -> Result<(), DeviceError> {
        fits("readers", readers.len() as u64, u64::from(self.max_seqs))?;
        let bytes: Vec<u8> = readers.iter().flat_map(|r| r.to_bytes()).collect();
        // Until the copy is queued, no launch may read past what the previous one wrote.
        self.readers_set = 0;
        if !bytes.is_empty() {
            self.stream.memcpy_htod(&bytes, &mut self.readers.slice_mut(0..bytes.len()))?;
        }
        self.readers_set = readers.len() as u32;
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

/// The buffers' device pointers, in the order [`push_attention_args`] takes them.
fn attention_ptrs(step: &DecodeAttention) -> [u64; 6] {
    [
        step.q.ptr(),
        step.key_cache.ptr(),
        step.value_cache.ptr(),
        step.block_table.ptr(),
        step.seq_lens.ptr(),
        step.out.ptr(),
    ]
}

/// Pushes the arguments both attention kernels share, in `KVG_ATTN_ARGS` order.
fn push_attention_args<'a>(
    b: &mut cudarc::driver::LaunchArgs<'a>,
    shape: &'a AttentionShape,
    ptrs: &'a [u64; 6],
    page_size: &'a u32,
) {
    let [q, kc, vc, bt, sl, out] = ptrs;
    b.arg(q).arg(kc).arg(vc).arg(bt).arg(&shape.max_blocks).arg(sl).arg(&shape.num_seqs).arg(&shape.num_heads);
    b.arg(&shape.num_kv_heads).arg(&shape.head_dim).arg(page_size).arg(&shape.scale).arg(out);
}

fn attention_grid(shape: &AttentionShape) -> LaunchConfig {
    cfg((shape.num_heads.min(MAX_GRID_X), shape.num_seqs.min(MAX_GRID_Y), 1), 128)
}

/// A [`DecodeAttention`] whose block-table entries the caller vouches for, for
/// [`DeviceGuard::decode_attention_unchecked`](super::DeviceGuard::decode_attention_unchecked):
/// the reference attention without any check, the baseline the fused check is measured against.
#[derive(Clone, Copy, Debug)]
pub struct UncheckedAttention {
    step: DecodeAttention,
}

impl UncheckedAttention {
    /// Vouches for `step`'s pages. The buffers' lengths are still checked at launch; the page ids
    /// the kernel reads from the block table are not.
    ///
    /// # Safety
    /// Every block-table entry among the first `ceil(seq_lens[s] / page_size)` of each sequence
    /// is a page id below the `num_pages` of the pool of the [`DeviceGuard`](super::DeviceGuard)
    /// it is launched on (or negative, which is skipped), when the launch runs: the kernel reads K
    /// and V at those pages without checking.
    pub unsafe fn new(step: DecodeAttention) -> UncheckedAttention {
        UncheckedAttention { step }
    }

    /// The step.
    pub fn step(&self) -> &DecodeAttention {
        &self.step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verify_grid_is_sized_by_sequence_not_by_the_block_table_width() {
        let sms = 132; // H100 SXM / H200
        // vLLM's real width at max_model_len 131,072 / page size 16: 8,192 entries per row.
        let (x, y, _) = verify_grid(256, 8192, sms);
        assert_eq!(y, 256);
        let blocks = x * y;
        assert!(blocks <= 2 * sms * VERIFY_BLOCKS_PER_SM + 256, "{blocks} blocks at width 8,192");
        assert!(blocks < 16_384 / 8, "the width-sized grid launched 16,384 blocks");
        // The same step at a tight width launches no more.
        assert!(verify_grid(256, 256, sms).0 <= x);
        // Few sequences still spread over the GPU, up to one thread per page of a row.
        assert_eq!(verify_grid(1, 8192, sms), (64, 1, 1));
        assert_eq!(verify_grid(1, 100, sms), (1, 1, 1));
        // Degenerate inputs never give an empty grid.
        assert_eq!(verify_grid(0, 0, 0), (1, 1, 1));
        assert_eq!(verify_grid(1 << 20, 8192, sms).1, MAX_GRID_Y);
    }

    #[test]
    fn the_crc_grid_is_persistent() {
        assert_eq!(crc_grid(65_536, 132), (132 * CRC_BLOCKS_PER_SM, 1, 1));
        assert_eq!(crc_grid(10, 132), (10, 1, 1));
        assert_eq!(crc_grid(0, 0), (1, 1, 1));
    }
}
