//! The CUDA device guard.
//!
//! Device pointers are integers (`tensor.data_ptr()`), the engine's stream an integer handle
//! (`torch.cuda.current_stream().cuda_stream`) passed to every call that queues GPU work, so a
//! call lands in stream order with the engine's kernels and can be captured in a CUDA graph on a
//! side stream. kvguard cannot check a raw pointer: the caller
//! promises what [`kvguard::cuda::Borrowed::from_raw`] asks (live memory of the guard's device,
//! of at least the sizes given, untouched by unordered work until the launch completes). Without
//! a GPU, the constructor raises `kvguard.DeviceError`.

use crate::errors::{DeviceError, log_violation};
use crate::table::OwnershipTable;
use crate::values::PoolConfig;
use crate::violation::Violation;
use kvguard::cuda::{
    self as core, BlockTableStep, Borrowed, DeviceOptions, EngineStream, FenceStep, PagedKvStep, SlotMappingStep,
    TokenRowsStep,
};
use parking_lot::Mutex;
use pyo3::prelude::*;

fn dev_err(e: core::DeviceError) -> PyErr {
    DeviceError::new_err(e.to_string())
}

/// The engine's stream from its integer handle.
fn engine_stream(stream: usize) -> EngineStream {
    // SAFETY: the caller promises (documented on DeviceGuard) a live CUstream of this guard's
    // device's primary context, or 0 for the legacy default stream, during the call.
    unsafe { EngineStream::from_raw(stream as cudarc::driver::sys::CUstream) }
}

/// Whether the CUDA driver library loads here (no device needed).
#[pyfunction]
pub fn driver_available() -> bool {
    core::driver_available()
}

/// The device side of one KV pool: a mirror of the table's tags on the GPU, the verify kernels
/// over a step's block tables, a violation ring drained into the table.
///
/// DeviceGuard(config, *, device=0, max_seqs=1024, ring_capacity=4096, cubin=None)
/// Raises DeviceError without a driver, a device or NVRTC (pass cubin=bytes built ahead of time
/// to run without NVRTC).
///
/// Each step, on the engine's stream s (an int): sync_tags(table, stream=s);
/// set_readers(table, req_ids, stream=s); clear_status(stream=s); verify_block_table(...,
/// stream=s) before attention (no host sync; clear_status and verify_* can be captured in a
/// graph); drain(table, stream=s) off the hot path.
/// Pointers are ints from tensor.data_ptr(): they must be live int32 device tensors of this
/// guard's device, of at least the sizes given, until the launch completes.
#[pyclass(frozen, module = "kvguard")]
pub struct DeviceGuard {
    guard: Mutex<core::DeviceGuard>,
}

#[pymethods]
impl DeviceGuard {
    #[new]
    #[pyo3(signature = (config, *, device = 0, max_seqs = 1024, ring_capacity = 4096, cubin = None))]
    fn new(
        py: Python<'_>,
        config: &PoolConfig,
        device: usize,
        max_seqs: u32,
        ring_capacity: u32,
        cubin: Option<Vec<u8>>,
    ) -> PyResult<DeviceGuard> {
        let options = DeviceOptions {
            ordinal: device,
            max_seqs,
            ring_capacity,
            cubin: cubin.map(Into::into),
            ..DeviceOptions::default()
        };
        let config = &config.inner;
        let guard = py.detach(|| core::DeviceGuard::new(config, options)).map_err(dev_err)?;
        Ok(DeviceGuard { guard: Mutex::new(guard) })
    }

    /// Copies the tags of the pages the table changed since the last call; returns how many.
    #[pyo3(signature = (table, *, stream))]
    fn sync_tags(&self, py: Python<'_>, table: &OwnershipTable, stream: usize) -> PyResult<usize> {
        py.detach(|| self.guard.lock().sync_tags(table.core(), &engine_stream(stream))).map_err(dev_err)
    }

    /// Writes every page's tag (start-up).
    #[pyo3(signature = (table, *, stream))]
    fn upload_all_tags(&self, py: Python<'_>, table: &OwnershipTable, stream: usize) -> PyResult<()> {
        py.detach(|| self.guard.lock().upload_all_tags(table.core(), &engine_stream(stream))).map_err(dev_err)
    }

    /// Names the request reading through each sequence of the next steps (ids as the table
    /// knows them; each request's tenant is the table's).
    #[pyo3(signature = (table, req_ids, *, stream))]
    fn set_readers(
        &self,
        py: Python<'_>,
        table: &OwnershipTable,
        req_ids: Vec<Bound<'_, PyAny>>,
        stream: usize,
    ) -> PyResult<()> {
        let keys = req_ids.iter().map(|o| crate::names::key(o, "req_ids entry")).collect::<PyResult<Vec<_>>>()?;
        let requests: Vec<_> = {
            let names = table.names().lock();
            keys.into_iter().map(|k| names.request(k)).collect()
        };
        let readers: Vec<_> = requests
            .into_iter()
            .map(|r| (r, table.core().request_info(r).map_or(crate::names::UNKNOWN_TENANT, |i| i.tenant)))
            .collect();
        py.detach(|| self.guard.lock().set_readers(&readers, &engine_stream(stream))).map_err(dev_err)
    }

    /// Zeroes the per-sequence status words before a step.
    #[pyo3(signature = (*, stream))]
    fn clear_status(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        py.detach(|| self.guard.lock().clear_status(&engine_stream(stream))).map_err(dev_err)
    }

    /// Verifies a vLLM-layout step on the device: block_table int32 [num_seqs][max_blocks] and
    /// seq_lens int32 [num_seqs], device pointers. With canaries, `query_lens` (int32 [num_seqs], a
    /// device pointer) names each sequence's tokens of this step, whose canaries are not yet
    /// stamped. No host sync.
    #[pyo3(signature = (block_table, seq_lens, num_seqs, max_blocks, *, stream, check_canaries = false, query_lens = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: keyword arguments, not a struct
    fn verify_block_table(
        &self,
        py: Python<'_>,
        block_table: u64,
        seq_lens: u64,
        num_seqs: u32,
        max_blocks: u32,
        stream: usize,
        check_canaries: bool,
        query_lens: Option<u64>,
    ) -> PyResult<()> {
        let len = num_seqs as usize * max_blocks as usize;
        // SAFETY: the caller promises (documented above) live int32 device tensors of this
        // guard's device of `len` and `num_seqs` elements, untouched until the launch completes.
        let step = unsafe {
            BlockTableStep {
                block_table: Borrowed::from_raw(block_table, len),
                seq_lens: Borrowed::from_raw(seq_lens, num_seqs as usize),
                num_seqs,
                max_blocks,
                generations: None,
                check_canaries,
                query_lens: query_lens.map(|p| Borrowed::from_raw(p, num_seqs as usize)),
            }
        };
        py.detach(|| self.guard.lock().verify_block_table(&step, &engine_stream(stream))).map_err(dev_err)
    }

    /// Verifies a FlashInfer-layout step on the device (int32 device pointers: kv_indptr
    /// [num_seqs + 1], kv_indices [num_indices], kv_last_page_len [num_seqs]). No host sync.
    #[pyo3(signature = (kv_indptr, kv_indices, kv_last_page_len, num_seqs, num_indices, max_pages_per_seq, *, stream, check_canaries = false, query_lens = None))]
    #[allow(clippy::too_many_arguments)]
    fn verify_paged_kv(
        &self,
        py: Python<'_>,
        kv_indptr: u64,
        kv_indices: u64,
        kv_last_page_len: u64,
        num_seqs: u32,
        num_indices: usize,
        max_pages_per_seq: u32,
        stream: usize,
        check_canaries: bool,
        query_lens: Option<u64>,
    ) -> PyResult<()> {
        // SAFETY: the caller promises (documented above) live int32 device tensors of this
        // guard's device of these sizes, untouched until the launch completes.
        let step = unsafe {
            PagedKvStep {
                kv_indptr: Borrowed::from_raw(kv_indptr, num_seqs as usize + 1),
                kv_indices: Borrowed::from_raw(kv_indices, num_indices),
                kv_last_page_len: Borrowed::from_raw(kv_last_page_len, num_seqs as usize),
                num_seqs,
                max_pages_per_seq,
                generations: None,
                check_canaries,
                query_lens: query_lens.map(|p| Borrowed::from_raw(p, num_seqs as usize)),
            }
        };
        py.detach(|| self.guard.lock().verify_paged_kv(&step, &engine_stream(stream))).map_err(dev_err)
    }

    /// Verifies an SGLang-layout step on the device, its rows read in place (device pointers:
    /// req_to_token int32 [num_rows, row_stride], one token slot per entry; rows and seq_lens
    /// int64 [num_seqs], the forward batch's req_pool_indices and seq_lens). Page j of sequence s
    /// is the page of req_to_token[rows[s], j * page_size], and every other entry read must be
    /// that page's slot at its offset (one that is not is checked as the page it names). No host
    /// sync.
    #[pyo3(signature = (req_to_token, num_rows, row_stride, rows, seq_lens, num_seqs, max_pages_per_seq, *, stream))]
    #[allow(clippy::too_many_arguments)]
    fn verify_token_rows(
        &self,
        py: Python<'_>,
        req_to_token: u64,
        num_rows: u32,
        row_stride: u32,
        rows: u64,
        seq_lens: u64,
        num_seqs: u32,
        max_pages_per_seq: u32,
        stream: usize,
    ) -> PyResult<()> {
        let cells = num_rows as usize * row_stride as usize;
        // SAFETY: the caller promises (documented above) live device tensors of this guard's
        // device: req_to_token int32 of `cells` elements, rows and seq_lens int64 of `num_seqs`,
        // untouched until the launch completes.
        let step = unsafe {
            TokenRowsStep {
                req_to_token: Borrowed::from_raw(req_to_token, cells),
                num_rows,
                row_stride,
                rows: Borrowed::from_raw(rows, num_seqs as usize),
                seq_lens: Borrowed::from_raw(seq_lens, num_seqs as usize),
                num_seqs,
                max_pages_per_seq,
            }
        };
        py.detach(|| self.guard.lock().verify_token_rows(&step, &engine_stream(stream))).map_err(dev_err)
    }

    /// Checks a step's KV writes on the device before the forward pass stores them (device
    /// pointers: slot_mapping int64 [num_tokens], negative for padding; query_start_loc int32
    /// [num_seqs + 1], sequence s writing tokens query_start_loc[s] .. [s + 1]): each written
    /// slot must lie in a page its sequence's reader (set_readers) owns exclusively. No host sync.
    #[pyo3(signature = (slot_mapping, num_tokens, query_start_loc, num_seqs, *, stream))]
    fn verify_slot_mapping(
        &self,
        py: Python<'_>,
        slot_mapping: u64,
        num_tokens: u32,
        query_start_loc: u64,
        num_seqs: u32,
        stream: usize,
    ) -> PyResult<()> {
        // SAFETY: the caller promises (documented above) live device tensors of this guard's
        // device: slot_mapping int64 of `num_tokens`, query_start_loc int32 of `num_seqs + 1`
        // elements, untouched until the launch completes.
        let step = unsafe {
            SlotMappingStep {
                slot_mapping: Borrowed::from_raw(slot_mapping, num_tokens as usize),
                num_tokens,
                query_start_loc: Borrowed::from_raw(query_start_loc, num_seqs as usize + 1),
                num_seqs,
            }
        };
        py.detach(|| self.guard.lock().verify_slot_mapping(&step, &engine_stream(stream))).map_err(dev_err)
    }

    /// Fences, in place and after this step's checks on the same stream, every sequence they
    /// flagged: its row of block_table (int32 [num_seqs, max_blocks], a device pointer, or None)
    /// set to page 0, the reserved null page, and its tokens' slots in slot_mapping (int64
    /// [num_tokens], or None) set to -1; a slot of a token in no sequence becomes -1 too. One call
    /// per KV cache group. No host sync.
    #[pyo3(signature = (query_start_loc, num_seqs, *, stream, block_table = None, max_blocks = 0, slot_mapping = None, num_tokens = 0))]
    #[allow(clippy::too_many_arguments)] // the Python signature: keyword arguments, not a struct
    fn fence_refused(
        &self,
        py: Python<'_>,
        query_start_loc: u64,
        num_seqs: u32,
        stream: usize,
        block_table: Option<u64>,
        max_blocks: u32,
        slot_mapping: Option<u64>,
        num_tokens: u32,
    ) -> PyResult<()> {
        let cells = num_seqs as usize * max_blocks as usize;
        // SAFETY: the caller promises (documented above) live device tensors of this guard's
        // device of these sizes, untouched by unordered work until the launch completes.
        let step = unsafe {
            FenceStep {
                query_start_loc: Borrowed::from_raw(query_start_loc, num_seqs as usize + 1),
                num_seqs,
                block_table: block_table.map(|p| Borrowed::from_raw(p, cells)),
                max_blocks,
                slot_mapping: slot_mapping.map(|p| Borrowed::from_raw(p, num_tokens as usize)),
                num_tokens,
            }
        };
        py.detach(|| self.guard.lock().fence_refused(&step, &engine_stream(stream))).map_err(dev_err)
    }

    /// Starts copying the violation ring to the host after the work queued on `stream`, without
    /// waiting; finish with finish_drain.
    #[pyo3(signature = (*, stream))]
    fn begin_drain(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        py.detach(|| self.guard.lock().begin_drain(&engine_stream(stream))).map_err(dev_err)
    }

    /// Finishes the drain begin_drain started and returns its violations, recorded in the table
    /// as drain records them; None if no drain was begun, or (wait=False) its copy has not
    /// landed yet. With wait (the default) it waits for the copy, that is only for the work
    /// queued on the stream before begin_drain; without, it never waits for the GPU.
    #[pyo3(signature = (table, *, stream, wait = true))]
    fn finish_drain(
        &self,
        py: Python<'_>,
        table: &OwnershipTable,
        stream: usize,
        wait: bool,
    ) -> PyResult<Option<Vec<Py<Violation>>>> {
        let drained = py
            .detach(|| {
                let mut guard = self.guard.lock();
                let stream = engine_stream(stream);
                if wait {
                    guard.finish_drain(table.core(), &stream)
                } else {
                    guard.try_finish_drain(table.core(), &stream)
                }
            })
            .map_err(dev_err)?;
        drained.map(|d| wrap_drained(py, table, d.violations)).transpose()
    }

    /// The first `n` per-sequence status words (bit k set: a violation of kind k). Syncs.
    #[pyo3(signature = (n, *, stream))]
    fn read_status(&self, py: Python<'_>, n: u32, stream: usize) -> PyResult<Vec<u32>> {
        py.detach(|| self.guard.lock().read_status(n, &engine_stream(stream))).map_err(dev_err)
    }

    /// Takes the device's violation ring into the table (counted, logged, judged) and returns
    /// the violations. Off the hot path: it syncs.
    #[pyo3(signature = (table, *, stream))]
    fn drain(&self, py: Python<'_>, table: &OwnershipTable, stream: usize) -> PyResult<Vec<Py<Violation>>> {
        let drained = py.detach(|| self.guard.lock().drain(table.core(), &engine_stream(stream))).map_err(dev_err)?;
        wrap_drained(py, table, drained.violations)
    }

    /// Findings of the device that never reached the host since the guard was created, as of
    /// the last drain: first findings the device dropped (more flagged sequences between two
    /// drains than half the ring holds), torn records, records of a kind this build does not
    /// know. 0 while every sequence the device flagged is named in a drained record; when it
    /// grows, fail closed for every request read since the drain before.
    #[getter]
    fn findings_lost(&self) -> u64 {
        self.guard.lock().findings_lost()
    }

    /// Device address of the per-sequence status words (attention kernels may read it).
    #[getter]
    fn status_ptr(&self) -> u64 {
        self.guard.lock().status_ptr()
    }
    /// Device address of the tag table.
    #[getter]
    fn tags_ptr(&self) -> u64 {
        self.guard.lock().tags_ptr()
    }
    /// Device address of the canaries.
    #[getter]
    fn canaries_ptr(&self) -> u64 {
        self.guard.lock().canaries_ptr()
    }
}

/// Drained violations as Python objects, named as the table names them, each logged.
fn wrap_drained(
    py: Python<'_>,
    table: &OwnershipTable,
    violations: Vec<kvguard::Violation>,
) -> PyResult<Vec<Py<Violation>>> {
    let resolved: Vec<_> = {
        let names = table.names().lock();
        violations
            .into_iter()
            .map(|v| {
                let r = names.resolve(&v);
                (v, r)
            })
            .collect()
    };
    let mut out = Vec::with_capacity(resolved.len());
    for (v, r) in resolved {
        let v = Violation::wrap(py, v, r)?;
        log_violation(py, &v);
        out.push(v);
    }
    Ok(out)
}
