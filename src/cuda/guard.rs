//! [`DeviceGuard`]: the safe host API of the device checks. No `unsafe` here: what the engine
//! must promise it promises when it builds a [`Borrowed`], an [`EngineStream`] or an
//! [`UncheckedAttention`], and the launches live in `device.rs`.

use super::device::{Device, DeviceShape, UncheckedAttention};
use super::error::DeviceError;
use super::layout::{DeviceReader, DeviceTag, RingDrain};
use super::lent::{Borrowed, EngineStream};
use super::source;
use super::step::{
    AttentionCheck, AttentionElement, BlockTableStep, DecodeAttention, FenceStep, KvElement, KvStore, PageRegion,
    PagedKvStep, SlotMappingStep, TokenRowsStep,
};
use crate::config::PoolConfig;
use crate::ids::{RequestId, TenantId};
use crate::table::OwnershipTable;
use crate::violation::Violation;
use std::sync::Arc;

/// How a [`DeviceGuard`] is sized, and where its kernels come from. Every buffer is allocated
/// once, at these sizes, so launches never allocate and fit CUDA graphs.
#[derive(Clone, PartialEq, Eq)]
pub struct DeviceOptions {
    /// The CUDA device ordinal.
    pub ordinal: usize,
    /// The most sequences one step may have.
    pub max_seqs: u32,
    /// Violation records the device ring holds between drains (more are dropped and counted).
    pub ring_capacity: u32,
    /// Tag updates uploaded per launch (more are sent in several launches).
    pub update_batch: u32,
    /// Kernels built ahead of time for this GPU's architecture, e.g. by
    /// [`compile_cubin`](super::source::compile_cubin)`("sm_90")` on a build machine (or the
    /// `cuda_cubin` example). When given, NVRTC is not needed at run time (production containers
    /// often lack it): the image is checked ([`check_cubin`](super::source::check_cubin)) and
    /// loaded as is. An image that is not a CUBIN, has no code for the device's architecture, or
    /// was built from another kvguard's kernel sources is [`DeviceError::Cubin`]. `None` (the
    /// default): compile through NVRTC, once per process and architecture.
    pub cubin: Option<Arc<[u8]>>,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions { ordinal: 0, max_seqs: 1024, ring_capacity: 4096, update_batch: 16_384, cubin: None }
    }
}

impl std::fmt::Debug for DeviceOptions {
    /// The CUBIN shows as its length, not its bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceOptions")
            .field("ordinal", &self.ordinal)
            .field("max_seqs", &self.max_seqs)
            .field("ring_capacity", &self.ring_capacity)
            .field("update_batch", &self.update_batch)
            .field("cubin", &self.cubin.as_ref().map(|c| format!("{} bytes", c.len())))
            .finish()
    }
}

/// What one [`DeviceGuard::drain`] took from the device's violation ring and recorded in the
/// table.
#[derive(Clone, Debug, Default)]
pub struct Drained {
    /// The violations, oldest first, as recorded in the table.
    pub violations: Vec<Violation>,
    /// Records the device dropped because the ring was full, since the guard was created.
    pub dropped_total: u64,
    /// Records still being written when the ring was copied (lost to this drain).
    pub incomplete: u64,
    /// Findings that may have been a sequence's only record and never reached the host, since
    /// the guard was created: first findings the device dropped (more flagged sequences between
    /// two drains than half the ring holds), torn records and records of a kind this build does
    /// not know. When this grows, a sequence the
    /// device flagged (and fenced) may belong to a request the host does not know is refused:
    /// fail closed for every request read since the last drain (the plugins do,
    /// `kvguard.device_verdicts`). [`DeviceGuard::findings_lost`] reads it between drains.
    pub findings_lost: u64,
}

/// The device side of one KV pool: its tag mirror, canaries, violation ring and the kernels.
///
/// Every call that queues device work takes the stream to queue it on, an [`EngineStream`]:
/// kvguard keeps no stream of its own, so its work is ordered with the engine's exactly as the
/// caller chooses (the stream the step runs on; the side stream `torch.cuda.graph` captures on).
/// Calls given different streams are ordered only by the caller. `docs/cuda.md` lists what each
/// call must come after and which calls are capture-safe.
///
/// Dropping the guard waits for the whole context (kernels on any stream may still use its
/// buffers by address), then frees its memory and unloads its kernels. Destroy CUDA graphs that
/// captured its launches (or hold its pointers, e.g. a fused `kvg_check_page`) first, and never
/// drop it while a stream is capturing.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use kvguard::cuda::{BlockTableStep, Borrowed, DeviceGuard, DeviceOptions, EngineStream};
/// use kvguard::{OwnershipTable, PoolConfig, RequestId, TenantId};
/// let config = PoolConfig::new(65_536, 16, 131_072);
/// let table = OwnershipTable::new(config.clone())?;
/// let mut guard = DeviceGuard::new(&config, DeviceOptions::default())?; // typed error without a GPU
/// # let (torch_stream, bt_ptr, lens_ptr) = (std::ptr::null_mut(), 0u64, 0u64);
/// // SAFETY: the engine's current stream (`torch.cuda.current_stream().cuda_stream`), a stream
/// // of the guard's device, live during every call it is given to.
/// let stream = unsafe { EngineStream::from_raw(torch_stream) };
/// // every step, on the engine's stream: mirror the table's changes, name the readers, verify,
/// // and later drain.
/// guard.sync_tags(&table, &stream)?;
/// guard.set_readers(&[(RequestId(1), TenantId(7))], &stream)?;
/// // SAFETY: the engine's block table and seq_lens tensors, alive until the step completes.
/// let (block_table, seq_lens) =
///     unsafe { (Borrowed::from_raw(bt_ptr, 1 * 8192), Borrowed::from_raw(lens_ptr, 1)) };
/// // Canaries off: this engine's own KV store does not stamp them.
/// let step = BlockTableStep::new(block_table, seq_lens, 1, 8192);
/// guard.clear_status(&stream)?;
/// guard.verify_block_table(&step, &stream)?; // attention kernels may read guard.status_ptr()
/// let drained = guard.drain(&table, &stream)?; // off the hot path
/// # Ok(()) }
/// ```
pub struct DeviceGuard {
    device: Device,
    /// What [`Drained::findings_lost`] counts, and the device's (wrapping) count of dropped
    /// first findings it was last read from.
    findings_lost: u64,
    first_dropped_seen: u32,
    /// The changed tags of the last [`sync_tags`](Self::sync_tags), reused so a step allocates
    /// nothing.
    changed: Vec<(u32, DeviceTag)>,
}

impl std::fmt::Debug for DeviceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGuard")
            .field("ordinal", &self.device.ctx.ordinal())
            .field("num_pages", &self.device.num_pages)
            .field("page_size", &self.device.page_size)
            .field("max_seqs", &self.device.max_seqs)
            .field("ring_capacity", &self.device.ring_capacity)
            .finish()
    }
}

impl DeviceGuard {
    /// Opens the device, loads the kernels (the prebuilt [`DeviceOptions::cubin`], else compiled
    /// through NVRTC once per process and architecture) and allocates the tag table, canaries
    /// (4 bytes per slot), ring and step buffers for `config`'s pool. Every tag starts zeroed
    /// (free, generation 0): call [`sync_tags`](Self::sync_tags) with a table whose changes cover
    /// every live page, or [`upload_all_tags`](Self::upload_all_tags).
    ///
    /// Construction allocates (device memory, and page-locked memory for staging and drains:
    /// nothing allocates later) and waits for a stream of its own that zeroes the buffers; it
    /// does not synchronise the context. Create the guard at start-up, outside any capture.
    ///
    /// Errors, never panics: [`DeviceError::Argument`] and [`DeviceError::Cubin`] (an image that
    /// is not a CUBIN) before the driver is touched, then [`DeviceError::DriverNotFound`],
    /// [`DeviceError::NoDevice`], [`DeviceError::NvrtcNotFound`] and [`DeviceError::Compile`]
    /// (only without a CUBIN), [`DeviceError::Cubin`] (a CUBIN the device refuses),
    /// [`DeviceError::Loader`], [`DeviceError::Driver`].
    pub fn new(config: &PoolConfig, options: DeviceOptions) -> Result<DeviceGuard, DeviceError> {
        if options.ring_capacity == 0 || options.update_batch == 0 || options.max_seqs == 0 {
            return Err(DeviceError::Argument("max_seqs, ring_capacity and update_batch must be positive".into()));
        }
        if let Some(cubin) = &options.cubin {
            source::check_cubin(cubin)?;
        }
        let device = Device::open(DeviceShape {
            ordinal: options.ordinal,
            num_pages: config.num_pages,
            page_size: config.page_size,
            max_seqs: options.max_seqs,
            ring_capacity: options.ring_capacity,
            staging_capacity: options.update_batch,
            cubin: options.cubin,
        })?;
        Ok(DeviceGuard { device, findings_lost: 0, first_dropped_seen: 0, changed: Vec::new() })
    }

    /// Copies the tags of the pages `table` changed since the last call into the device table
    /// (incremental: only changed pages travel), on `stream`. Returns how many pages were
    /// updated. Not capture-safe (it stages host memory): call it before the step's graph.
    pub fn sync_tags(&mut self, table: &OwnershipTable, stream: &EngineStream) -> Result<usize, DeviceError> {
        let mut changed = std::mem::take(&mut self.changed);
        changed.clear();
        let n = table.take_changed_tags_into(&mut changed);
        let uploaded = self.upload_tags(&changed, stream);
        self.changed = changed;
        uploaded.map(|()| n)
    }

    /// Writes the tag of every page of `table` (start-up, or after the device lost its state).
    pub fn upload_all_tags(&mut self, table: &OwnershipTable, stream: &EngineStream) -> Result<(), DeviceError> {
        // Every page travels below, so the changes pending until now need not.
        self.changed.clear();
        table.take_changed_tags_into(&mut self.changed);
        self.changed.clear();
        let tags: Vec<(u32, DeviceTag)> = (0..self.device.num_pages)
            .filter_map(|p| table.page_info(crate::ids::PageId(p)).map(|i| (p, DeviceTag::from_page_info(&i))))
            .collect();
        self.upload_tags(&tags, stream)
    }

    /// Writes these tags (page, tag) into the device table, in batches of `update_batch`, each
    /// copied from page-locked staging (two slots used in turn: a batch waits only for the copy
    /// and scatter of the batch two before it) and scattered by a kernel on `stream`.
    pub fn upload_tags(&mut self, tags: &[(u32, DeviceTag)], stream: &EngineStream) -> Result<(), DeviceError> {
        for batch in tags.chunks(self.device.staging_capacity as usize) {
            let pages: Vec<u32> = batch.iter().map(|(p, _)| *p).collect();
            let tags: Vec<DeviceTag> = batch.iter().map(|(_, t)| *t).collect();
            self.device.apply_tag_updates(&pages, &tags, stream)?;
        }
        Ok(())
    }

    /// Writes the canaries of slots `first_slot..` (slot = page * page_size + slot in page): to
    /// restore them after a migration, or to seed a pool whose KV was written without the
    /// stamping store. [`layout::canary`](super::layout::canary) computes them. Staged through
    /// page-locked memory in 1 MiB chunks; not capture-safe.
    pub fn write_canaries(
        &mut self,
        first_slot: u64,
        canaries: &[u32],
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        self.device.write_canaries(first_slot, canaries, stream)
    }

    /// Names the request (and tenant) reading through each sequence of this step: call it every
    /// step, before the step's verify, store and fused check, on their stream (or one ordered
    /// before it). Launches over more sequences than the last call named are refused
    /// ([`DeviceError::Argument`], on the host, before launching): sequence `k` would otherwise
    /// be judged as whoever sat at `k` in an earlier step. Staged through page-locked memory;
    /// not capture-safe (call it before launching the step's graph: the graph reads the
    /// readers buffer when it runs).
    pub fn set_readers(&mut self, readers: &[(RequestId, TenantId)], stream: &EngineStream) -> Result<(), DeviceError> {
        let r: Vec<DeviceReader> = readers.iter().map(|&(req, t)| DeviceReader::new(req, t)).collect();
        self.device.set_readers(&r, stream)
    }

    /// Zeroes the per-sequence status words before a step (a memset, capturable in a graph).
    pub fn clear_status(&mut self, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.clear_status(stream)
    }

    /// Verifies a vLLM-layout step before attention, on `stream`: violations go to the ring and
    /// set bit `kind` of the sequence's status word. No host synchronisation; capturable. The
    /// launch is sized by sequence, not by `max_blocks`. [`DeviceError::Argument`] before
    /// launching when `num_seqs` exceeds the readers [`set_readers`](Self::set_readers) named or
    /// a buffer is shorter than the step needs.
    pub fn verify_block_table(&mut self, step: &BlockTableStep, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.verify_block_table(step, stream)
    }

    /// Verifies a FlashInfer-layout step before attention. No host synchronisation; refused as
    /// [`verify_block_table`](Self::verify_block_table) is.
    pub fn verify_paged_kv(&mut self, step: &PagedKvStep, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.verify_paged_kv(step, stream)
    }

    /// Verifies a step in SGLang's layout, its `req_to_token` rows read in place on the device
    /// (no gather into a block table first); otherwise as
    /// [`verify_block_table`](Self::verify_block_table) is.
    pub fn verify_token_rows(&mut self, step: &TokenRowsStep, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.verify_token_rows(step, stream)
    }

    /// Checks a step's KV writes in place before the forward pass stores them (the engine's own
    /// slot mapping, e.g. what vLLM's Model Runner V2 computed on the device): each written slot
    /// must lie in a page its sequence's writer owns exclusively. Violations go to the ring and
    /// the status words, as [`verify_block_table`](Self::verify_block_table)'s do; no host
    /// synchronisation, capturable. Sync the tags as the writes must be judged (after the
    /// step's allocations, before its publishes: a page published in the step it was written is
    /// read-only only from then on).
    pub fn verify_slot_mapping(&mut self, step: &SlotMappingStep, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.verify_slot_mapping(step, stream)
    }

    /// Fences the sequences this step's checks flagged, in place, after them on the same stream:
    /// each one's row of the block table becomes page 0 (the pool's reserved null page) and its
    /// tokens' slots -1 (padding), so attention neither reads nor writes anyone's KV for it,
    /// while every other sequence runs untouched. The enforce half of a device check: the host
    /// learns which sequences were fenced when it drains the ring ([`drain`](Self::drain),
    /// [`try_finish_drain`](Self::try_finish_drain)), and aborts their requests before any of
    /// their output leaves. No host synchronisation; capturable. One launch per block table
    /// (KV cache group).
    pub fn fence_refused(&mut self, step: &FenceStep, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.fence_refused(step, stream)
    }

    /// CRC32 (crc32fast-exact) of pages of `region` (all of `0..n_pages` when `pages` is None)
    /// into `out`, for KV transfers. `chunk_bytes` is the least each thread hashes (0: 16; each
    /// of the 256 threads of a page's block takes a power-of-two share). A persistent grid of a
    /// few blocks per SM: each builds its CRC table once, then strides over the pages.
    pub fn crc32_pages(
        &mut self,
        region: PageRegion,
        pages: Option<Borrowed<i32>>,
        n_pages: u32,
        chunk_bytes: u32,
        out: Borrowed<u32>,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        self.device.crc32_pages(region, pages, n_pages, chunk_bytes, out, stream)
    }

    /// Fills released pages with `pattern` (0 zeroes; [`POISON`] is NaN in f32, f16 and bf16)
    /// and, when `region` is the pool's page layout, clears their canaries.
    pub fn scrub_pages(
        &mut self,
        region: PageRegion,
        pages: Borrowed<i32>,
        n_pages: u32,
        pattern: u32,
        clear_canaries: bool,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        self.device.scrub_pages(region, pages, n_pages, pattern, clear_canaries, stream)
    }

    /// The reference KV store: writes each token's K and V to its slot if the writing sequence
    /// (readers set by [`set_readers`](Self::set_readers)) owns the page, and stamps the slot's
    /// canary after a fence (a reader that sees the canary sees the KV); other stores are
    /// refused on the device and recorded in the violation ring.
    pub fn store_kv<T: KvElement>(&mut self, store: &KvStore<T>, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.store_kv(store, stream)
    }

    /// The paged decode attention (split over the KV length when `step.workspace` allows) with
    /// the fused per-page check (flag only, or fail-closed: a flagged sequence's output is
    /// zeros). Capturable.
    pub fn decode_attention_checked<T: AttentionElement>(
        &mut self,
        step: &DecodeAttention<T>,
        check: AttentionCheck,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        self.device.decode_attention_checked(step, check, stream)
    }

    /// The same attention without any check: the baseline for the check's cost. The caller
    /// vouched for the pages when it built the [`UncheckedAttention`].
    pub fn decode_attention_unchecked<T: AttentionElement>(
        &mut self,
        step: &UncheckedAttention<T>,
        stream: &EngineStream,
    ) -> Result<(), DeviceError> {
        self.device.decode_attention_unchecked(step, stream)
    }

    /// The status words of the first `n` sequences (bit `k` set: a [`DeviceKind`](super::DeviceKind)
    /// of code `k` was found), copied after the work queued on `stream`. Waits for `stream`:
    /// for tests and diagnosis, not the hot path; refused on a capturing stream.
    pub fn read_status(&mut self, n: u32, stream: &EngineStream) -> Result<Vec<u32>, DeviceError> {
        self.device.read_status(n, stream)
    }

    /// Starts draining the violation ring without waiting: an asynchronous copy to page-locked
    /// memory (allocated with the guard), ordered after the work queued so far on `stream`.
    /// Finish with [`try_finish_drain`](Self::try_finish_drain) whenever convenient (e.g. next
    /// step). Every launch that may report must be ordered before the copy (on `stream`, or
    /// joined to it by an event): a record still being written when the ring is copied is
    /// lost to this drain (counted in [`Drained::incomplete`]).
    pub fn begin_drain(&mut self, stream: &EngineStream) -> Result<(), DeviceError> {
        self.device.start_ring_copy(stream)
    }

    /// If the copy started by [`begin_drain`](Self::begin_drain) has landed, records each violation
    /// in `table` (counters, log, and under enforce, quarantine) and tells the device, on
    /// `stream`, that those records are consumed; `None` if it has not landed yet. Never waits
    /// for the GPU.
    pub fn try_finish_drain(
        &mut self,
        table: &OwnershipTable,
        stream: &EngineStream,
    ) -> Result<Option<Drained>, DeviceError> {
        match self.device.finish_ring_copy(false)? {
            None => Ok(None),
            Some(bytes) => self.record_drained(&bytes, table, stream).map(Some),
        }
    }

    /// Finishes the drain [`begin_drain`](Self::begin_drain) started: waits for its copy (only
    /// for the work queued on the stream before it, not for what came after), then records as
    /// [`try_finish_drain`](Self::try_finish_drain) does; `None` if no drain was begun.
    pub fn finish_drain(
        &mut self,
        table: &OwnershipTable,
        stream: &EngineStream,
    ) -> Result<Option<Drained>, DeviceError> {
        match self.device.finish_ring_copy(true)? {
            None => Ok(None),
            Some(bytes) => self.record_drained(&bytes, table, stream).map(Some),
        }
    }

    /// Drains the violation ring now: [`begin_drain`](Self::begin_drain), wait for the copy, and
    /// record. Waits for the work queued so far on `stream`; off the step's critical path.
    pub fn drain(&mut self, table: &OwnershipTable, stream: &EngineStream) -> Result<Drained, DeviceError> {
        // A copy begun earlier shows the ring as it was then: let it land and copy again. Its
        // records were not marked consumed, so the fresh copy still holds them: none is lost.
        let _older = self.device.finish_ring_copy(true)?;
        self.device.start_ring_copy(stream)?;
        let bytes = self.device.finish_ring_copy(true)?.unwrap_or_default();
        self.record_drained(&bytes, table, stream)
    }

    /// Parses a copy of the ring, records each violation in `table` and tells the device those
    /// records are consumed.
    fn record_drained(
        &mut self,
        ring: &[u8],
        table: &OwnershipTable,
        stream: &EngineStream,
    ) -> Result<Drained, DeviceError> {
        let drain =
            RingDrain::parse(ring).ok_or_else(|| DeviceError::Argument("the device ring header is corrupt".into()))?;
        self.device.set_consumed(drain.consumed, stream)?;
        let violations: Vec<Violation> = drain.records.iter().filter_map(|r| r.to_violation()).collect();
        // A record of a kind this build does not know (kernels of another version) names no
        // finding the host can judge: counted as lost, so the caller fails closed.
        let unreadable = (drain.records.len() - violations.len()) as u64;
        for v in &violations {
            table.record_violation(v.clone());
        }
        self.findings_lost += u64::from(drain.first_findings_dropped.wrapping_sub(self.first_dropped_seen))
            + drain.incomplete
            + unreadable;
        self.first_dropped_seen = drain.first_findings_dropped;
        Ok(Drained {
            violations,
            dropped_total: drain.dropped_total,
            incomplete: drain.incomplete,
            findings_lost: self.findings_lost,
        })
    }

    /// Findings that never reached the host since the guard was created, as of the last drain
    /// ([`Drained::findings_lost`]): 0 while every sequence the device flagged is named in a
    /// drained record.
    pub fn findings_lost(&self) -> u64 {
        self.findings_lost
    }

    /// Device address of the tag table (`const kvg_tag*`), for engines fusing `kvg_check_page`.
    pub fn tags_ptr(&self) -> u64 {
        self.device_ptr(Buffer::Tags)
    }
    /// Device address of the canaries (`uint32_t*`, one per slot), for `kvg_stamp_canary` /
    /// `kvg_canary_ok` in the engine's own kernels.
    pub fn canaries_ptr(&self) -> u64 {
        self.device_ptr(Buffer::Canaries)
    }
    /// Device address of the ring (`kvg_ring*`), for `kvg_report`.
    pub fn ring_ptr(&self) -> u64 {
        self.device_ptr(Buffer::Ring)
    }
    /// Device address of the per-sequence status words (`uint32_t*`).
    pub fn status_ptr(&self) -> u64 {
        self.device_ptr(Buffer::Status)
    }
    /// Device address of the step's readers (`const kvg_reader*`).
    pub fn readers_ptr(&self) -> u64 {
        self.device_ptr(Buffer::Readers)
    }

    fn device_ptr(&self, which: Buffer) -> u64 {
        let raw = &self.device.raw;
        match which {
            Buffer::Tags => raw.tags,
            Buffer::Canaries => raw.canaries,
            Buffer::Ring => raw.ring,
            Buffer::Status => raw.status,
            Buffer::Readers => raw.readers,
        }
    }

    /// The CUDA context the guard's buffers live in (the primary context of its ordinal): the
    /// context every [`EngineStream`] given to it must belong to.
    pub fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        &self.device.ctx
    }
}

enum Buffer {
    Tags,
    Canaries,
    Ring,
    Status,
    Readers,
}

/// The poison pattern: `0x7fa57fa5` is a NaN as f32, and each half is a NaN as f16 and bf16.
pub const POISON: u32 = 0x7fa5_7fa5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_default_to_compiling_through_nvrtc() {
        let options = DeviceOptions::default();
        assert_eq!(options.cubin, None);
        let with = DeviceOptions { cubin: Some(vec![7u8; 300_000].into()), ..DeviceOptions::default() };
        let shown = format!("{with:?}");
        assert!(shown.contains("cubin: Some(\"300000 bytes\")") && shown.len() < 200, "{shown}");
    }

    #[test]
    fn an_image_that_is_not_a_cubin_is_refused_before_the_driver_is_touched() {
        let config = PoolConfig::new(64, 16, 256);
        let options = DeviceOptions { cubin: Some(Arc::from(&b"not a cubin"[..])), ..DeviceOptions::default() };
        match DeviceGuard::new(&config, options) {
            Err(DeviceError::Cubin(why)) => assert!(why.contains("not an ELF image"), "{why}"),
            other => panic!("expected DeviceError::Cubin, got {other:?}"),
        }
    }

    #[test]
    fn with_a_cubin_and_no_driver_the_error_is_still_driver_not_found() {
        let config = PoolConfig::new(64, 16, 256);
        let options = DeviceOptions { cubin: Some(source::tests::tiny_cubin().into()), ..Default::default() };
        let result = std::panic::catch_unwind(|| DeviceGuard::new(&config, options));
        let result = result.expect("DeviceGuard::new must never panic");
        if !super::super::driver_available() {
            assert!(matches!(result, Err(DeviceError::DriverNotFound)), "got {result:?}");
        }
    }
}
