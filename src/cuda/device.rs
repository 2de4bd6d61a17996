//! The device: the CUDA context, compiled kernels, kvguard's own buffers and page-locked
//! staging, and every launch. Of the device side, only this file, `lent.rs` (the engine's
//! promises) and `nvrtc.rs` (the NVRTC calls) may hold `unsafe`.
//!
//! Invariants this file keeps, so that every method here is safe to call:
//! - kvguard's own buffers (tag table, canaries, ring, status words, readers, device staging)
//!   are allocated here, once, at their final sizes (`cuMemAlloc`, not stream-ordered) and never
//!   reallocated; each launch checks that the counts it passes fit them. They are freed only by
//!   `Drop`, after the whole context has synchronised, so no kernel on any stream still uses them.
//! - Engine memory reaches a kernel only as a [`Borrowed`], whose creator promised (in
//!   `Borrowed::from_raw`'s contract) that it is live device memory of the stated length; each
//!   launch checks that the elements the kernel will touch, computed from the counts and shapes
//!   it is given, lie inside every `Borrowed`.
//! - Page ids and slot numbers that come from device memory are range-checked *by the kernels*
//!   (out-of-range ids are recorded as violations or skipped, never dereferenced), except in the
//!   unchecked attention, which therefore takes an [`UncheckedAttention`], whose `unsafe`
//!   constructor carries the caller's promise that the pages are in range.
//! - A prebuilt CUBIN reaches the driver (which reads it without knowing its length) only after
//!   `source::check_cubin` proved its ELF headers and sections lie inside its bytes, and its
//!   kernels are launched only if it defines the fingerprint kernel of the sources whose
//!   argument lists the launches below follow.
//! - Every launch, memset and copy goes on the stream the caller passes with that call, an
//!   [`EngineStream`] whose `unsafe` constructor promises that it belongs to this context and is
//!   live during the call. kvguard keeps no stream of its own after construction.
//! - Host-to-device uploads go through page-locked staging, two slots per kind of upload, each
//!   with an event recorded after the last work that read it; a slot is refilled only once its
//!   event completed, so the host never overwrites bytes a copy in flight still reads, and the
//!   device staging of tag updates is never overwritten while a scatter still reads it, whatever
//!   streams the two uploads went on.
//! - Launches pass kvguard's buffers as raw device addresses, so they record and wait on no
//!   cudarc events: a capture of the check path into a CUDA graph contains only kvguard's kernel
//!   and memset nodes. Calls that stage, copy back or wait refuse a stream that is capturing.

use super::error::DeviceError;
use super::layout::{DeviceReader, DeviceTag, RingHeader};
use super::lent::{Borrowed, EngineStream};
use super::source;
use super::step::{
    AttentionCheck, AttentionElement, AttentionShape, BlockTableStep, DecodeAttention, FenceStep, KvElement, KvStore,
    PageRegion, PagedKvStep, SlotMappingStep, TokenRowsStep, fits, need, need_opt, readers_cover,
};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg, result, sys};
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
/// Attention blocks per SM the split over the KV length aims for (128 threads each, registers
/// bounded by `__launch_bounds__(128, 3)`, no spills): 12 warps per SM in flight.
const ATTENTION_BLOCKS_PER_SM: u32 = 3;
/// Threads per attention block (4 warps).
const ATTENTION_THREADS: u32 = 128;
/// Bytes of page-locked staging per slot for canary uploads (larger uploads are sent in chunks).
const CANARY_STAGING_BYTES: usize = 1 << 20;

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

/// Splits of each sequence's KV length for the attention: enough blocks for
/// `ATTENTION_BLOCKS_PER_SM` per SM over `num_seqs x head_blocks`, at most
/// [`AttentionShape::MAX_SPLITS`], and only as many as `workspace` holds (none: 1).
pub(super) fn attention_splits(shape: &AttentionShape, workspace: Option<u64>, sm_count: u32) -> u32 {
    let rows = u64::from(shape.num_seqs.max(1)) * u64::from(shape.head_blocks());
    let target = u64::from(sm_count.max(1)) * u64::from(ATTENTION_BLOCKS_PER_SM);
    let mut splits = target.div_ceil(rows).clamp(1, u64::from(AttentionShape::MAX_SPLITS)) as u32;
    let room = workspace.unwrap_or(0);
    while splits > 1 && shape.workspace_len(splits) > room {
        splits /= 2;
    }
    splits.max(1)
}

/// The attention grid: `(splits, head_blocks, num_seqs)`.
fn attention_grid(shape: &AttentionShape, splits: u32) -> LaunchConfig {
    cfg((splits, shape.head_blocks().min(MAX_GRID_Y), shape.num_seqs.min(MAX_GRID_Y)), ATTENTION_THREADS)
}

struct Kernels {
    apply: CudaFunction,
    verify_block_table: CudaFunction,
    verify_paged_kv: CudaFunction,
    verify_token_rows: CudaFunction,
    store_b32: CudaFunction,
    store_b16: CudaFunction,
    verify_slot_mapping: CudaFunction,
    fence_refused: CudaFunction,
    crc32: CudaFunction,
    scrub: CudaFunction,
    attention_unchecked: CudaFunction,
    attention_checked: CudaFunction,
    attention_checked_canary: CudaFunction,
    attention_unchecked_bf16: CudaFunction,
    attention_checked_bf16: CudaFunction,
    attention_checked_canary_bf16: CudaFunction,
}

/// Device memory kvguard allocated with `cuMemAlloc`; freed by [`Device`]'s `Drop`.
#[derive(Debug)]
struct Allocation(u64);

/// Page-locked host memory kvguard allocated; freed by [`Device`]'s `Drop`.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `Pinned` owns its allocation exclusively; its bytes are touched only through `&mut
// Device` (so never from two threads at once), and page-locked memory may be used and freed
// from any thread of the process.
unsafe impl Send for Pinned {}
// SAFETY: as above: no `&self` method reads or writes the bytes.
unsafe impl Sync for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Pinned, DriverError> {
        // SAFETY: a fresh allocation of `len.max(1)` bytes (flags 0: cached, for host writes
        // and reads); its bytes are written before any copy reads them.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }?.cast::<u8>();
        Ok(Pinned { ptr, len })
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of at least `len` bytes, borrowed mutably through
        // `&mut self`; no copy in flight reads or writes it (the callers wait for the slot's
        // event first).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

use cudarc::driver::DriverError;

/// A CUDA event handle (no timing) owned by [`Device`].
struct Event(sys::CUevent);

// SAFETY: CUDA event handles may be recorded, queried and destroyed from any thread; `Event` is
// only used through `&mut Device`.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    fn new() -> Result<Event, DriverError> {
        Ok(Event(result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?))
    }
    /// Whether the work before the last record has completed (true if never recorded).
    fn is_complete(&self) -> Result<bool, DriverError> {
        // SAFETY: `self.0` is a live event of this context (destroyed only by `Device::drop`).
        match unsafe { result::event::query(self.0) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(e),
        }
    }
    fn wait(&self) -> Result<(), DriverError> {
        // SAFETY: a live event of this context.
        unsafe { result::event::synchronize(self.0) }
    }
    fn record(&self, stream: sys::CUstream) -> Result<(), DriverError> {
        // SAFETY: a live event and a stream of the same context (the `EngineStream` contract).
        unsafe { result::event::record(self.0, stream) }
    }
}

/// One staging slot: page-locked host bytes, optionally a device buffer they are copied to
/// before a kernel reads them, and the event recorded after the last work that read either.
struct Slot {
    host: Pinned,
    device: u64,
    done: Event,
}

/// Two staging slots used in turn: an upload waits only when the device has not yet finished
/// the upload before the previous one (the host is two uploads of this kind ahead).
struct Staging {
    slots: [Slot; 2],
    next: usize,
}

impl Staging {
    fn new(host_bytes: usize, device: [u64; 2]) -> Result<Staging, DriverError> {
        let slot = |d: u64| -> Result<Slot, DriverError> {
            Ok(Slot { host: Pinned::new(host_bytes)?, device: d, done: Event::new()? })
        };
        Ok(Staging { slots: [slot(device[0])?, slot(device[1])?], next: 0 })
    }
    /// The next slot, once the work that last read it has completed.
    fn acquire(&mut self) -> Result<&mut Slot, DriverError> {
        let slot = &mut self.slots[self.next];
        self.next ^= 1;
        if !slot.done.is_complete()? {
            slot.done.wait()?;
        }
        Ok(slot)
    }
    fn capacity(&self) -> usize {
        self.slots[0].host.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed once, here; `Device::drop` has
        // synchronised the context, so no copy reads or writes it any more.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: a live event, destroyed once, here.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `malloc_sync` and is freed once, here, after `Device::drop`
        // synchronised the context (no kernel on any stream still uses it). Graphs that captured
        // launches with this address must be destroyed before the guard (documented).
        let _ = unsafe { result::free_sync(self.0) };
    }
}

/// The CUDA context, compiled kernels, kvguard's own device buffers and page-locked staging.
///
/// Fields drop in declaration order after `Drop::drop` synchronised the context: device memory
/// and page-locked memory first, the module (held by the kernels) after them, the context last.
pub(super) struct Device {
    pub num_pages: u32,
    pub page_size: u32,
    pub max_seqs: u32,
    pub ring_capacity: u32,
    pub staging_capacity: u32,
    /// The device's multiprocessors: the verify, CRC32 and attention grids are sized from it.
    sm_count: u32,
    /// Readers the last `set_readers` wrote: launches over more sequences are refused.
    readers_set: u32,
    /// Raw addresses of kvguard's buffers, taken once at allocation.
    pub raw: RawBuffers,
    /// Where the tag updates' page ids start in a staging slot (the tags follow, 256-aligned).
    tags_offset: usize,
    _memory: Vec<Allocation>,
    tag_staging: Staging,
    reader_staging: Staging,
    consumed_staging: Staging,
    canary_staging: Staging,
    /// Page-locked copy of the ring, the event that says the copy in flight landed, and
    /// whether one is in flight.
    ring_copy: Pinned,
    ring_copy_done: Event,
    ring_copy_pending: bool,
    /// Page-locked copy of the status words (`read_status`).
    status_copy: Pinned,
    status_copy_done: Event,
    kernels: Kernels,
    pub ctx: Arc<CudaContext>,
}

impl Drop for Device {
    fn drop(&mut self) {
        // Engine-stream kernels may still read kvguard's buffers by address, on streams the
        // guard no longer knows: wait for the whole context before anything is freed.
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.ctx.synchronize();
        }
    }
}

/// Device addresses of kvguard's own buffers (valid while the `Device` lives).
#[derive(Clone, Copy, Debug)]
pub(super) struct RawBuffers {
    pub tags: u64,
    pub canaries: u64,
    pub ring: u64,
    pub status: u64,
    pub readers: u64,
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

/// `n` zeroed bytes of device memory (`cuMemAlloc`, then a memset on `stream`).
fn zeroed(memory: &mut Vec<Allocation>, n: usize, stream: sys::CUstream) -> Result<u64, DriverError> {
    // SAFETY: a fresh allocation of at least one byte, owned by `memory` (freed by `Device`'s
    // drop); its bytes are zeroed on `stream` before construction returns (it waits for it).
    let ptr = unsafe { result::malloc_sync(n.max(1)) }?;
    memory.push(Allocation(ptr));
    // SAFETY: `ptr` holds `n.max(1)` bytes; `stream` is kvguard's construction stream.
    unsafe { result::memset_d8_async(ptr, 0, n.max(1), stream) }?;
    Ok(ptr)
}

/// The tag updates' layout in a staging slot: `cap` page ids, then `cap` tags 256 bytes on.
fn tag_staging_layout(cap: u32) -> (usize, usize) {
    let offset = (cap as usize * 4).next_multiple_of(256);
    (offset, offset + cap as usize * DeviceTag::SIZE)
}

/// Refuses work that must not be captured into a CUDA graph (staged uploads, copies back,
/// waits) on a stream that is capturing, naming the call.
fn refuse_capture(what: &str, stream: &EngineStream) -> Result<(), DeviceError> {
    // SAFETY: the `EngineStream` contract: a live stream of this context.
    let status = unsafe { result::stream::is_capturing(stream.as_raw()) }?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(DeviceError::Argument(format!(
            "{what} is not capture-safe (it stages host memory or waits): call it outside the graph, on the stream \
             the graph is launched on"
        )));
    }
    Ok(())
}

impl Device {
    /// Opens device `shape.ordinal`, compiles (or reuses) the kernels and allocates the buffers.
    /// Never panics: missing libraries and devices are errors. Synchronises only a stream of its
    /// own (created raw, so cudarc does not synchronise the context for its first stream), once.
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
            verify_token_rows: f("kvg_verify_token_rows")?,
            store_b32: f("kvg_store_kv_b32")?,
            store_b16: f("kvg_store_kv_b16")?,
            verify_slot_mapping: f("kvg_verify_slot_mapping")?,
            fence_refused: f("kvg_fence_refused")?,
            crc32: f("kvg_crc32_pages")?,
            scrub: f("kvg_scrub_pages")?,
            attention_unchecked: f("kvg_decode_attention_unchecked")?,
            attention_checked: f("kvg_decode_attention_checked")?,
            attention_checked_canary: f("kvg_decode_attention_checked_canary")?,
            attention_unchecked_bf16: f("kvg_decode_attention_unchecked_bf16")?,
            attention_checked_bf16: f("kvg_decode_attention_checked_bf16")?,
            attention_checked_canary_bf16: f("kvg_decode_attention_checked_canary_bf16")?,
        };
        ctx.bind_to_thread()?;
        // A stream of construction's own, created raw: cudarc's `new_stream` would synchronise
        // the whole context the first time. Destroyed before returning (after waiting for it).
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        let built = Self::allocate(&shape, stream);
        // SAFETY: `stream` was created above and is destroyed once, here, after the work on it
        // completed (or failed).
        let synced = unsafe { result::stream::synchronize(stream) };
        // SAFETY: as above.
        let _ = unsafe { result::stream::destroy(stream) };
        let (memory, raw, tag_device, ring_bytes) = built?;
        synced?;
        let (tags_offset, tag_slot_bytes) = tag_staging_layout(shape.staging_capacity.max(1));
        let canary_bytes = CANARY_STAGING_BYTES.min(shape.num_pages as usize * shape.page_size as usize * 4);
        Ok(Device {
            num_pages: shape.num_pages,
            page_size: shape.page_size,
            max_seqs: shape.max_seqs,
            ring_capacity: shape.ring_capacity,
            staging_capacity: shape.staging_capacity,
            sm_count: u32::try_from(sm_count).unwrap_or(1).max(1),
            readers_set: 0,
            raw,
            tags_offset,
            _memory: memory,
            tag_staging: Staging::new(tag_slot_bytes, tag_device)?,
            reader_staging: Staging::new(shape.max_seqs.max(1) as usize * DeviceReader::SIZE, [0, 0])?,
            consumed_staging: Staging::new(8, [0, 0])?,
            canary_staging: Staging::new(canary_bytes.max(4), [0, 0])?,
            ring_copy: Pinned::new(ring_bytes)?,
            ring_copy_done: Event::new()?,
            ring_copy_pending: false,
            status_copy: Pinned::new(shape.max_seqs.max(1) as usize * 4)?,
            status_copy_done: Event::new()?,
            kernels,
            ctx,
        })
    }

    /// The device buffers, zeroed on `stream`, and the ring's header written.
    #[allow(clippy::type_complexity)]
    fn allocate(
        shape: &DeviceShape,
        stream: sys::CUstream,
    ) -> Result<(Vec<Allocation>, RawBuffers, [u64; 2], usize), DeviceError> {
        let mut memory = Vec::new();
        let slots = shape.num_pages as usize * shape.page_size as usize;
        let ring_bytes = RingHeader::ring_bytes(shape.ring_capacity);
        let raw = RawBuffers {
            tags: zeroed(&mut memory, shape.num_pages as usize * DeviceTag::SIZE, stream)?,
            canaries: zeroed(&mut memory, slots * 4, stream)?,
            ring: zeroed(&mut memory, ring_bytes, stream)?,
            status: zeroed(&mut memory, shape.max_seqs.max(1) as usize * 4, stream)?,
            readers: zeroed(&mut memory, shape.max_seqs.max(1) as usize * DeviceReader::SIZE, stream)?,
        };
        let (_, tag_slot_bytes) = tag_staging_layout(shape.staging_capacity.max(1));
        let tag_device = [zeroed(&mut memory, tag_slot_bytes, stream)?, zeroed(&mut memory, tag_slot_bytes, stream)?];
        let header = RingHeader { capacity: shape.ring_capacity, ..RingHeader::default() }.to_bytes();
        // SAFETY: the ring holds at least the 32-byte header; the source is this function's
        // array, and the copy completes before construction returns (it waits for `stream`),
        // so pageable memory is fine here.
        unsafe { result::memcpy_htod_async(raw.ring, &header[..], stream) }?;
        Ok((memory, raw, tag_device, ring_bytes))
    }

    /// The caller's stream as a cudarc stream (for the launch builder), without taking it over.
    fn on(&self, stream: &EngineStream) -> Arc<CudaStream> {
        // SAFETY: `EngineStream::from_raw`'s contract: the stream belongs to this context
        // (`self.ctx`, the primary context of its ordinal) and is live during this call. The
        // wrapper never destroys it.
        unsafe { self.ctx.wrap_borrowed_stream(stream.as_raw()) }
    }

    /// Uploads `pages.len()` changed tags (at most the staging capacity) and scatters them.
    pub fn apply_tag_updates(
        &mut self,
        pages: &[u32],
        tags: &[DeviceTag],
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        let n = pages.len();
        fits("tag updates per launch", n as u64, u64::from(self.staging_capacity))?;
        if tags.len() != n {
            return Err(DeviceError::Argument("tag updates: one tag per page".into()));
        }
        if n == 0 {
            return Ok(());
        }
        refuse_capture("a tag upload (sync_tags, upload_tags)", stream)?;
        let s = self.on(stream);
        let offset = self.tags_offset;
        self.ctx.bind_to_thread()?;
        let slot = self.tag_staging.acquire()?;
        let host = slot.host.bytes();
        for (i, (p, t)) in pages.iter().zip(tags).enumerate() {
            host[i * 4..i * 4 + 4].copy_from_slice(&p.to_le_bytes());
            host[offset + i * DeviceTag::SIZE..offset + (i + 1) * DeviceTag::SIZE].copy_from_slice(&t.to_bytes());
        }
        let (dev_pages, dev_tags) = (slot.device, slot.device + offset as u64);
        // SAFETY: both copies read page-locked bytes of this slot (written above, not touched
        // again until its event completes) into the slot's device staging (sized by
        // `tag_staging_layout` for the staging capacity >= n); `stream` is live (contract).
        unsafe {
            result::memcpy_htod_async(dev_pages, &host[..n * 4], s.cu_stream())?;
            result::memcpy_htod_async(dev_tags, &host[offset..offset + n * DeviceTag::SIZE], s.cu_stream())?;
        }
        let n32 = n as u32;
        let mut b = s.launch_builder(&self.kernels.apply);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&dev_pages).arg(&dev_tags).arg(&n32);
        // SAFETY: `kvg_apply_tag_updates(tags, num_pages, pages, updates, n)` reads n <= staging
        // capacity entries of the slot's device staging and writes only tags[page] for page <
        // num_pages, and `tags` holds num_pages tags; the argument list matches the kernel's
        // signature.
        unsafe { b.launch(cfg((blocks_for(n as u64, 256), 1, 1), 256)) }?;
        // The slot is reused only after the scatter that reads its device staging completed.
        slot.done.record(s.cu_stream())?;
        Ok(())
    }

    /// `kvg_verify_block_table` over the engine's vLLM-layout step.
    pub fn verify_block_table(&mut self, step: &BlockTableStep, stream: &EngineStream) -> Result<(), DeviceError> {
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
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.verify_block_table);
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
    pub fn verify_paged_kv(&mut self, step: &PagedKvStep, stream: &EngineStream) -> Result<(), DeviceError> {
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
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.verify_paged_kv);
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

    /// `kvg_verify_token_rows` over the engine's SGLang-layout step (`req_to_token` read in
    /// place).
    pub fn verify_token_rows(&mut self, step: &TokenRowsStep, stream: &EngineStream) -> Result<(), DeviceError> {
        let TokenRowsStep { req_to_token, num_rows, row_stride, rows, seq_lens, num_seqs, max_pages_per_seq } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        readers_cover("verify_token_rows", num_seqs, self.readers_set)?;
        need("req_to_token", &req_to_token, u64::from(num_rows) * u64::from(row_stride))?;
        need("rows", &rows, u64::from(num_seqs))?;
        need("seq_lens", &seq_lens, u64::from(num_seqs))?;
        if num_seqs == 0 {
            return Ok(());
        }
        let (rt, r, sl) = (req_to_token.ptr(), rows.ptr(), seq_lens.ptr());
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.verify_token_rows);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&rt).arg(&num_rows).arg(&row_stride);
        b.arg(&r).arg(&sl).arg(&num_seqs);
        b.arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let grid = verify_grid(num_seqs, max_pages_per_seq, self.sm_count);
        // SAFETY: rows[s], seq_lens[s], readers[s] and status[s] for s < num_seqs are in bounds
        // (checked against the Borrowed lengths, the readers set and max_seqs above); the kernel
        // refuses a row outside num_rows or a length beyond the row's pages before reading the
        // row, and reads entries j * page_size + k < row_stride of it only (k < page_size; every
        // entry read is bounded by the row's end; req_to_token lent with
        // num_rows * row_stride entries); page ids are range-checked before tags are read. Any
        // grid is complete. Arguments match `kvg_verify_token_rows`'s signature.
        unsafe { b.launch(cfg(grid, VERIFY_THREADS)) }?;
        Ok(())
    }

    /// `kvg_verify_slot_mapping` over a step's writes (the engine's slot mapping read in place).
    pub fn verify_slot_mapping(&mut self, step: &SlotMappingStep, stream: &EngineStream) -> Result<(), DeviceError> {
        let SlotMappingStep { slot_mapping, num_tokens, query_start_loc, num_seqs } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        readers_cover("verify_slot_mapping", num_seqs, self.readers_set)?;
        need("slot_mapping", &slot_mapping, u64::from(num_tokens))?;
        need("query_start_loc", &query_start_loc, u64::from(num_seqs) + 1)?;
        if num_tokens == 0 && num_seqs == 0 {
            return Ok(());
        }
        let (sm, qsl) = (slot_mapping.ptr(), query_start_loc.ptr());
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.verify_slot_mapping);
        b.arg(&self.raw.tags).arg(&self.num_pages).arg(&self.page_size).arg(&sm).arg(&num_tokens);
        b.arg(&qsl).arg(&num_seqs).arg(&self.raw.readers).arg(&self.raw.status).arg(&self.raw.ring);
        let target = self.sm_count.max(1).saturating_mul(VERIFY_BLOCKS_PER_SM);
        let blocks = blocks_for(u64::from(num_tokens.max(num_seqs)), VERIFY_THREADS).min(target.max(1));
        // SAFETY: the kernel reads slot_mapping[t] for t < num_tokens, query_start_loc[s] and
        // [s + 1] for s < num_seqs (lent with num_seqs + 1 entries), readers[s] and status[s]
        // for s < num_seqs (the readers set and max_seqs cover them, checked above); a sequence
        // found for a token is below num_seqs; page ids are range-checked before tags are read;
        // the ring is written within its capacity. Any grid is complete (grid-stride loops).
        // Arguments match `kvg_verify_slot_mapping`'s signature.
        unsafe { b.launch(cfg((blocks, 1, 1), VERIFY_THREADS)) }?;
        Ok(())
    }

    /// `kvg_fence_refused`: the flagged sequences' rows set to the null page and their slots to
    /// -1, in place, on `stream` after the step's checks.
    pub fn fence_refused(&mut self, step: &FenceStep, stream: &EngineStream) -> Result<(), DeviceError> {
        let FenceStep { query_start_loc, num_seqs, block_table, max_blocks, slot_mapping, num_tokens } = *step;
        fits("sequences", u64::from(num_seqs), u64::from(self.max_seqs))?;
        need("query_start_loc", &query_start_loc, u64::from(num_seqs) + 1)?;
        need_opt("block_table", &block_table, u64::from(num_seqs) * u64::from(max_blocks))?;
        need_opt("slot_mapping", &slot_mapping, u64::from(num_tokens))?;
        if block_table.is_none() && slot_mapping.is_none() {
            return Ok(());
        }
        let (qsl, bt, sm) = (query_start_loc.ptr(), ptr_or_null(&block_table), ptr_or_null(&slot_mapping));
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.fence_refused);
        b.arg(&self.raw.status).arg(&num_seqs).arg(&qsl).arg(&bt).arg(&max_blocks).arg(&sm).arg(&num_tokens);
        let (x, y, _) = verify_grid(num_seqs, max_blocks, self.sm_count);
        let x = x.max(blocks_for(u64::from(num_tokens), VERIFY_THREADS * y).min(MAX_GRID_X));
        // SAFETY: the kernel reads status[s] (s < num_seqs <= max_seqs, checked) and
        // query_start_loc[0..=num_seqs] (lent with num_seqs + 1 entries), writes block_table
        // rows s < num_seqs of max_blocks entries and slot_mapping[t] for t < num_tokens (both
        // checked against their Borrowed lengths; null when absent, and the kernel then skips
        // them). Any grid is complete. Arguments match `kvg_fence_refused`'s signature.
        unsafe { b.launch(cfg((x, y, 1), VERIFY_THREADS)) }?;
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
        stream: &EngineStream,
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
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.crc32);
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
        stream: &EngineStream,
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
        let s = self.on(stream);
        let mut b = s.launch_builder(&self.kernels.scrub);
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
    pub fn store_kv<T: KvElement>(&mut self, store: &KvStore<T>, stream: &EngineStream) -> Result<(), DeviceError> {
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
        let s = self.on(stream);
        let mut b = s.launch_builder(func);
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

    /// The paged decode attention with the fused check (`kvg_decode_attention_checked[_bf16]`, or
    /// `kvg_decode_attention_checked_canary[_bf16]` when `check.check_canaries`).
    pub fn decode_attention_checked<T: AttentionElement>(
        &mut self,
        step: &DecodeAttention<T>,
        check: AttentionCheck,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        step.check(self.num_pages, self.page_size)?;
        let shape = step.shape;
        fits("sequences", u64::from(shape.num_seqs), u64::from(self.max_seqs))?;
        readers_cover("decode_attention_checked", shape.num_seqs, self.readers_set)?;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let fc = u32::from(check.fail_closed);
        let splits = attention_splits(&shape, step.workspace.map(|w| w.len() as u64), self.sm_count);
        let ptrs = attention_ptrs(step);
        let k = &self.kernels;
        let func = match (T::BF16, check.check_canaries) {
            (false, false) => &k.attention_checked,
            (false, true) => &k.attention_checked_canary,
            (true, false) => &k.attention_checked_bf16,
            (true, true) => &k.attention_checked_canary_bf16,
        };
        let s = self.on(stream);
        let mut b = s.launch_builder(func);
        push_attention_args(&mut b, &shape, &ptrs, &self.page_size, &splits);
        b.arg(&self.raw.tags)
            .arg(&self.num_pages)
            .arg(&self.raw.readers)
            .arg(self.raw.canaries_if(check.check_canaries));
        b.arg(&self.raw.status).arg(&self.raw.ring).arg(&fc);
        // SAFETY: step.check verified every buffer holds the elements the kernel indexes from
        // the shape, and the workspace the `splits` chosen from its length (1 split without
        // one: not read); every page is range-checked (kvg_page_in_range) before its K/V rows
        // are read, so a page out of range is never read in either mode. Arguments match the
        // kernel.
        unsafe { b.launch(attention_grid(&shape, splits)) }?;
        Ok(())
    }

    /// The paged decode attention without any check (`kvg_decode_attention_unchecked[_bf16]`),
    /// the baseline the fused check is measured against.
    pub fn decode_attention_unchecked<T: AttentionElement>(
        &mut self,
        unchecked: &UncheckedAttention<T>,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        let step = &unchecked.step;
        step.check(self.num_pages, self.page_size)?;
        let shape = step.shape;
        if shape.num_seqs == 0 {
            return Ok(());
        }
        let splits = attention_splits(&shape, step.workspace.map(|w| w.len() as u64), self.sm_count);
        let ptrs = attention_ptrs(step);
        let func = if T::BF16 { &self.kernels.attention_unchecked_bf16 } else { &self.kernels.attention_unchecked };
        let s = self.on(stream);
        let mut b = s.launch_builder(func);
        push_attention_args(&mut b, &shape, &ptrs, &self.page_size, &splits);
        // SAFETY: buffers hold what the shape indexes, the workspace what `splits` needs
        // (checked); `UncheckedAttention::new`'s contract: the page ids read are below this
        // pool's `num_pages` (or negative, skipped). Arguments match the kernel.
        unsafe { b.launch(attention_grid(&shape, splits)) }?;
        Ok(())
    }

    /// Uploads the step's readers (one per sequence) through page-locked staging.
    pub fn set_readers(&mut self, readers: &[DeviceReader], stream: &EngineStream) -> Result<(), DeviceError> {
        fits("readers", readers.len() as u64, u64::from(self.max_seqs))?;
        refuse_capture("set_readers", stream)?;
        // Until the copy is queued, no launch may read past what the previous one wrote.
        self.readers_set = 0;
        if !readers.is_empty() {
            let bytes: Vec<u8> = readers.iter().flat_map(|r| r.to_bytes()).collect();
            self.stage(Upload::Readers, self.raw.readers, &bytes, stream)?;
        }
        self.readers_set = readers.len() as u32;
        Ok(())
    }

    /// Writes canaries for slots `first..first + canaries.len()` (migration, restore, benches),
    /// through page-locked staging in chunks.
    pub fn write_canaries(&mut self, first: u64, canaries: &[u32], stream: &EngineStream) -> Result<(), DeviceError> {
        let total = u64::from(self.num_pages) * u64::from(self.page_size);
        let end = first.checked_add(canaries.len() as u64).filter(|&e| e <= total);
        end.ok_or_else(|| DeviceError::Argument(format!("canaries: slots beyond the pool's {total}")))?;
        if canaries.is_empty() {
            return Ok(());
        }
        refuse_capture("write_canaries", stream)?;
        let per_chunk = (self.canary_staging.capacity() / 4).max(1);
        for (i, chunk) in canaries.chunks(per_chunk).enumerate() {
            let bytes: Vec<u8> = chunk.iter().flat_map(|c| c.to_le_bytes()).collect();
            let at = self.raw.canaries + (first + (i * per_chunk) as u64) * 4;
            self.stage(Upload::Canaries, at, &bytes, stream)?;
        }
        Ok(())
    }

    /// Copies `bytes` to device address `dst` on `stream` through the next staging slot of
    /// `which` (at most its capacity), and records the slot's event after the copy.
    fn stage(&mut self, which: Upload, dst: u64, bytes: &[u8], stream: &EngineStream) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread()?;
        let staging = match which {
            Upload::Readers => &mut self.reader_staging,
            Upload::Consumed => &mut self.consumed_staging,
            Upload::Canaries => &mut self.canary_staging,
        };
        let slot = staging.acquire()?;
        let host = slot.host.bytes();
        let host =
            host.get_mut(..bytes.len()).ok_or_else(|| DeviceError::Argument("staging: upload too large".into()))?;
        host.copy_from_slice(bytes);
        // SAFETY: `dst..dst + bytes.len()` lies inside a kvguard buffer (the callers computed it
        // from that buffer's checked bounds); the source is this slot's page-locked bytes, not
        // written again until the event recorded below completes; the stream is live.
        unsafe { result::memcpy_htod_async(dst, &*host, stream.as_raw()) }?;
        slot.done.record(stream.as_raw())?;
        Ok(())
    }

    /// Zeroes the per-sequence status words (a memset node, graph-capturable).
    pub fn clear_status(&mut self, stream: &EngineStream) -> Result<(), DeviceError> {
        let bytes = self.max_seqs.max(1) as usize * 4;
        self.ctx.bind_to_thread()?;
        // SAFETY: `raw.status` is kvguard's allocation of max(max_seqs, 1) words, alive as long
        // as `self`; the stream is live (contract).
        unsafe { result::memset_d8_async(self.raw.status, 0, bytes, stream.as_raw()) }?;
        Ok(())
    }

    /// Copies the status words of the first `n` sequences (waits for `stream`'s work so far).
    pub fn read_status(&mut self, n: u32, stream: &EngineStream) -> Result<Vec<u32>, DeviceError> {
        fits("sequences", u64::from(n), u64::from(self.max_seqs))?;
        refuse_capture("read_status", stream)?;
        self.ctx.bind_to_thread()?;
        let bytes = n as usize * 4;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let host = &mut self.status_copy.bytes()[..bytes];
        // SAFETY: the status buffer holds max_seqs >= n words; the destination is page-locked
        // memory of this guard, read only after the event below completed.
        unsafe { result::memcpy_dtoh_async(&mut *host, self.raw.status, stream.as_raw()) }?;
        self.status_copy_done.record(stream.as_raw())?;
        self.status_copy_done.wait()?;
        Ok(host.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Starts an asynchronous copy of the ring into page-locked host memory, ordered after the
    /// work queued so far on `stream`; nothing waits. A copy already in flight is kept.
    pub fn start_ring_copy(&mut self, stream: &EngineStream) -> Result<(), DeviceError> {
        if self.ring_copy_pending {
            return Ok(());
        }
        refuse_capture("begin_drain", stream)?;
        self.ctx.bind_to_thread()?;
        let host = self.ring_copy.bytes();
        // SAFETY: the ring allocation holds exactly `ring_copy.len` bytes; the destination is
        // page-locked memory of this guard, read only after the event below completed.
        unsafe { result::memcpy_dtoh_async(host, self.raw.ring, stream.as_raw()) }?;
        self.ring_copy_done.record(stream.as_raw())?;
        self.ring_copy_pending = true;
        Ok(())
    }

    /// The ring's bytes if the copy in flight has landed (`None`: none started, or not yet).
    /// With `wait`, blocks until it lands.
    pub fn finish_ring_copy(&mut self, wait: bool) -> Result<Option<Vec<u8>>, DeviceError> {
        if !self.ring_copy_pending {
            return Ok(None);
        }
        self.ctx.bind_to_thread()?;
        if wait {
            self.ring_copy_done.wait()?;
        } else if !self.ring_copy_done.is_complete()? {
            return Ok(None);
        }
        self.ring_copy_pending = false;
        Ok(Some(self.ring_copy.bytes().to_vec()))
    }

    /// Tells the device that records before `consumed` were drained.
    pub fn set_consumed(&mut self, consumed: u64, stream: &EngineStream) -> Result<(), DeviceError> {
        refuse_capture("a drain", stream)?;
        self.stage(Upload::Consumed, self.raw.ring + 16, &consumed.to_le_bytes(), stream)
    }
}

/// The kinds of staged upload besides tag updates (which have device staging of their own).
#[derive(Clone, Copy)]
enum Upload {
    Readers,
    Consumed,
    Canaries,
}

/// The buffers' device pointers, in the order [`push_attention_args`] takes them.
fn attention_ptrs<T: AttentionElement>(step: &DecodeAttention<T>) -> [u64; 7] {
    [
        step.q.ptr(),
        step.key_cache.ptr(),
        step.value_cache.ptr(),
        step.block_table.ptr(),
        step.seq_lens.ptr(),
        step.out.ptr(),
        ptr_or_null(&step.workspace),
    ]
}

/// Pushes the arguments both attention kernels share, in `KVG_ATTN_ARGS` order.
fn push_attention_args<'a>(
    b: &mut cudarc::driver::LaunchArgs<'a>,
    shape: &'a AttentionShape,
    ptrs: &'a [u64; 7],
    page_size: &'a u32,
    splits: &'a u32,
) {
    let [q, kc, vc, bt, sl, out, ws] = ptrs;
    b.arg(q).arg(kc).arg(vc).arg(bt).arg(&shape.max_blocks).arg(sl).arg(&shape.num_seqs).arg(&shape.num_heads);
    b.arg(&shape.num_kv_heads).arg(&shape.head_dim).arg(page_size).arg(&shape.scale).arg(out).arg(ws).arg(splits);
}

/// A [`DecodeAttention`] whose block-table entries the caller vouches for, for
/// [`DeviceGuard::decode_attention_unchecked`](super::DeviceGuard::decode_attention_unchecked):
/// the attention without any check, the baseline the fused check is measured against.
#[derive(Clone, Copy, Debug)]
pub struct UncheckedAttention<T: AttentionElement = f32> {
    step: DecodeAttention<T>,
}

impl<T: AttentionElement> UncheckedAttention<T> {
    /// Vouches for `step`'s pages. The buffers' lengths are still checked at launch; the page ids
    /// the kernel reads from the block table are not.
    ///
    /// # Safety
    /// Every block-table entry among the first `ceil(seq_lens[s] / page_size)` of each sequence
    /// is a page id below the `num_pages` of the pool of the [`DeviceGuard`](super::DeviceGuard)
    /// it is launched on (or negative, which is skipped), when the launch runs: the kernel reads K
    /// and V at those pages without checking.
    pub unsafe fn new(step: DecodeAttention<T>) -> UncheckedAttention<T> {
        UncheckedAttention { step }
    }

    /// The step.
    pub fn step(&self) -> &DecodeAttention<T> {
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
    fn the_attention_splits_the_kv_length_only_as_far_as_the_workspace_holds() {
        let shape =
            AttentionShape { num_seqs: 1, max_blocks: 8192, num_heads: 8, num_kv_heads: 1, head_dim: 128, scale: 1.0 };
        // One sequence on 132 SMs: as many splits as allowed, if the workspace holds them.
        let full = shape.workspace_len(AttentionShape::MAX_SPLITS);
        assert_eq!(attention_splits(&shape, Some(full), 132), AttentionShape::MAX_SPLITS);
        assert_eq!(attention_splits(&shape, None, 132), 1, "no workspace: no split");
        assert_eq!(attention_splits(&shape, Some(shape.workspace_len(5)), 132), 4, "a power of two that fits");
        // 256 sequences already fill the GPU: one split each.
        let wide = AttentionShape { num_seqs: 256, ..shape };
        assert_eq!(wide.head_blocks(), 2, "eight query heads of one KV head: two blocks of four");
        assert_eq!(attention_splits(&wide, Some(wide.workspace_len(64)), 132), 1);
        assert_eq!(attention_grid(&wide, 1).grid_dim, (1, 2, 256));
    }

    #[test]
    fn the_crc_grid_is_persistent() {
        assert_eq!(crc_grid(65_536, 132), (132 * CRC_BLOCKS_PER_SM, 1, 1));
        assert_eq!(crc_grid(10, 132), (10, 1, 1));
        assert_eq!(crc_grid(0, 0), (1, 1, 1));
    }
}
