"""The worker side on vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``; vLLM's CPU
platform runs it as ``CPUModelRunner``): the check of what ``prepare_attn`` hands attention (the
gathered block tables and slot mappings, read in place on host memory; on a GPU checked and fenced
by kvguard's kernels on vLLM's stream through :mod:`kvguard.vllm.device`), warm-ups told apart
from served steps, and a V2 kvguard cannot hook refused rather than run unguarded."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .attach import default, installed_mode, unsupported, wrap
from .device import HostRows, V2Device, host_slot_mappings
from .guard import StepGuard
from .runner_v1 import annotate_output, pend
from .support import context_parallelism_of, fault_tolerance_of, group_windows, speculation_of

logger = logging.getLogger("vllm.kvguard")


def v2_attn_step(runner: Any, input_batch: Any, block_tables: Any, slot_mappings: Any, scheduler_output: Any) -> None:
    """The check of one V2 step (what the ``prepare_attn`` wrapper runs), on what V2's
    ``prepare_attn`` returned: the gathered block tables and slot mappings attention gets, read in
    place as numpy views (CPU tensors: vLLM's CPU worker runs V2 on host memory). Under enforce a
    refused request's rows and slots are nulled in those same tensors."""
    guard = _v2_guard_of(runner)
    if guard is None:
        return
    if guard.device is not None:
        _v2_device_step(runner, guard, input_batch, block_tables, slot_mappings, scheduler_output)
        return
    n = input_batch.num_reqs
    report = guard.check_attn_step(
        input_batch.req_ids[:n],
        [t.numpy() for t in block_tables],
        slot_mappings.numpy(),
        input_batch.query_start_loc_np,
        input_batch.num_computed_tokens_np,
        input_batch.num_scheduled_tokens,
        getattr(scheduler_output, "kvguard_events", None),
    )
    pend(runner, guard, report)


def _v2_device_step(
    runner: Any, guard: StepGuard, input_batch: Any, block_tables: Any, slot_mappings: Any, scheduler_output: Any
) -> None:
    """The check of one V2 step on a GPU (``kvguard.vllm.device``): the host judges the step as
    V2 was asked to run it (its staged rows, mirrored), the device checks what V2 built, in
    place, on vLLM's stream, and fences what either refused."""
    dev = guard.device
    n = input_batch.num_reqs
    req_ids = input_batch.req_ids[:n]
    qsl = input_batch.query_start_loc_np
    computed = input_batch.num_computed_tokens_np
    tables = dev.rows.gather(np.asarray(input_batch.idx_mapping_np[:n]))
    slots = host_slot_mappings(tables, qsl, computed, n, guard.block_size)
    dev.stream()
    after_early = None
    if n:

        def after_early() -> None:
            dev.check_writes(guard, req_ids, slot_mappings, input_batch.query_start_loc, n)

    report = guard.check_attn_step(
        req_ids,
        tables,
        slots,
        qsl,
        computed,
        input_batch.num_scheduled_tokens,
        getattr(scheduler_output, "kvguard_events", None),
        after_early=after_early,
    )
    if n:
        refused = sorted({*report.refused_rows, *(i for i, rid in enumerate(req_ids) if rid in report.again)})
        dev.check_reads(
            guard, block_tables, input_batch.seq_lens, input_batch.query_start_loc, slot_mappings, n, refused
        )
    dev.begin_drain(guard)
    pend(runner, guard, report)


def v2_idle_step(runner: Any, scheduler_output: Any) -> None:
    """A V2 step that schedules no tokens (``execute_model`` returns before ``prepare_attn``):
    its events (the releases) are applied all the same."""
    events = getattr(scheduler_output, "kvguard_events", None)
    if not events:
        return
    guard = _v2_guard_of(runner)
    if guard is not None:
        pend(runner, guard, guard.check_attn_step([], [], None, None, None, None, events))


def _v2_guard_of(runner: Any) -> StepGuard | None:
    """A V2 runner's guard, made on first use (None when kvguard cannot check it: ``unsupported``
    said so, under report the runner goes unchecked)."""
    guard = runner.__dict__.get("_kvguard", False)
    if guard is not False:
        return guard
    guard = None
    config = runner.kv_cache_config
    windows = group_windows(config)
    sizes = set(runner.block_tables.block_sizes)
    if windows is None:
        pass
    elif runner.device.type not in ("cpu", "cuda"):
        unsupported(
            f"vLLM's V2 model runner on {runner.device.type}: kvguard's device check runs on CUDA devices"
        )
    elif runner.speculative_config is not None or speculation_of(runner.vllm_config) is not None:
        unsupported(speculation_of(runner.vllm_config) or "speculative decoding (speculative_config)")
    elif runner.pcp_manager is not None or runner.dcp_size > 1 or context_parallelism_of(runner.vllm_config):
        unsupported("context parallelism under V2 (its block tables are partitioned across ranks)")
    elif getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
        unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
    elif (tolerance := fault_tolerance_of(runner.vllm_config)) is not None:
        unsupported(tolerance)
    elif len(sizes) != 1:
        unsupported(f"KV cache groups of different block sizes {sorted(sizes)}")
    else:
        guard = StepGuard(
            config.num_blocks,
            sizes.pop(),
            runner.max_model_len,
            installed_mode() or "enforce",
            windows=windows if len(windows) > 1 or windows[0] is not None else None,
        )
        if _on_device(runner):
            guard.device = _v2_device(runner, guard)
            if guard.device is None:
                guard = None
    runner._kvguard = guard
    return guard


def _on_device(runner: Any) -> bool:
    """Whether V2 builds this runner's step tables in device memory (a GPU)."""
    return runner.device.type == "cuda"


def engine_stream() -> int:
    """vLLM's current CUDA stream, as the integer handle kvguard.DeviceGuard takes."""
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


def new_device_guard(runner: Any, guard: StepGuard) -> Any:
    """The kvguard.DeviceGuard of a V2 runner's pool, its tags uploaded."""
    import kvguard

    dg = kvguard.DeviceGuard(guard.table.config, device=runner.device.index or 0, max_seqs=runner.max_num_reqs)
    dg.upload_all_tags(guard.table, stream=engine_stream())
    return dg


def _v2_device(runner: Any, guard: StepGuard) -> V2Device | None:
    """The device half of a V2 runner's check on a GPU, or None (after ``unsupported``: under
    enforce the engine stops) where kvguard cannot run it: no driver, no NVRTC, a pool wider
    than the device check's limits, more than one rank."""
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    ranks = int(getattr(parallel, "world_size", 1) or 1)
    if ranks > 1:
        # Only the output rank's ModelRunnerOutput reaches the scheduler: a refusal another
        # rank's device check made (its rows fenced there) would never end its request.
        unsupported(f"vLLM's V2 model runner on a GPU over {ranks} ranks (a rank's device verdicts would not reach the scheduler)")
        return None
    bt = runner.block_tables
    try:
        dg = new_device_guard(runner, guard)
    except Exception as e:  # kvguard.DeviceError, or torch without CUDA
        unsupported(f"vLLM's V2 model runner on a GPU, but kvguard's device check cannot start here: {e}")
        return None
    rows = HostRows(bt)
    bt._kvguard_rows = rows
    return V2Device(dg, rows, engine_stream)


def _v2_warming_up(runner: Any) -> bool:
    """Whether a V2 runner runs vLLM's warm-up now: its worker's ``compile_or_warm_up_model``
    (kvguard's wrapper marks the runner; vLLM's kernel warm-ups and graph captures run there), or
    an elastic EP warm-up (V2 redirects every KV write to the null block then)."""
    if runner.__dict__.get("_kvguard_warming"):
        return True
    tables = runner.__dict__.get("block_tables")
    return bool(getattr(tables, "redirect_writes_to_null_block", False))


def _v2_step_without_events(runner: Any) -> None:
    """A V2 step that schedules tokens but whose ``SchedulerOutput`` never went through kvguard's
    scheduler wrapper (a ``--scheduler-cls`` whose ``schedule`` does not reach vLLM's): the table
    would judge requests it never heard of. Under enforce the engine stops (UnsupportedConfig);
    under report the runner's check is dropped (a warning, once) and the engine runs unchecked."""
    unsupported(
        "a scheduler step that did not go through kvguard's scheduler hooks (no kvguard_events on "
        "its SchedulerOutput: a --scheduler-cls whose schedule does not call vLLM's Scheduler.schedule)"
    )
    runner._kvguard = None


def mark_warm_up(worker_cls: type) -> None:
    """Wraps ``compile_or_warm_up_model`` where ``worker_cls`` (the worker class vLLM resolved in
    this process) defines it, once: while it runs, its runner is marked as warming up (vLLM's
    kernel warm-ups, which run made-up requests through the runner, all run inside it)."""
    owner = next((c for c in worker_cls.__mro__ if "compile_or_warm_up_model" in c.__dict__), None)
    if owner is None or hasattr(owner.__dict__["compile_or_warm_up_model"], "__kvguard_original__"):
        return

    def warming(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
            runner = getattr(self, "model_runner", None)
            if runner is None:
                return original(self, *args, **kw)
            outer = runner.__dict__.get("_kvguard_warming")  # a subclass's, calling its parent's
            runner._kvguard_warming = True
            try:
                return original(self, *args, **kw)
            finally:
                if outer is None:
                    runner.__dict__.pop("_kvguard_warming", None)

        return wrapper

    wrap(owner, "compile_or_warm_up_model", warming)


def _hook() -> None:
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def initialize_from_config(original: Any) -> Any:
        # The worker class is known only once vLLM resolved it by name (a platform's), and the
        # plugin may load inside init_worker itself: its warm-up is marked here, the call that
        # precedes it on every executor, so V2 steps without kvguard's events are told apart
        # (see execute_model).
        def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
            worker = self.__dict__.get("worker")
            if worker is not None:
                mark_warm_up(type(worker))
            return original(self, *args, **kw)

        return wrapper

    def prepare_attn(original: Any) -> Any:
        def wrapper(self: Any, input_batch: Any) -> Any:
            block_tables, slot_mappings = original(self, input_batch)
            step = self._kvguard_step
            if step is not None or not _v2_warming_up(self):  # a warm-up's requests are no one's
                v2_attn_step(self, input_batch, block_tables, slot_mappings, step)
            return block_tables, slot_mappings

        return wrapper

    def execute_model(original: Any) -> Any:
        def wrapper(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
            if kw.get("dummy_run") or args[1:2] == (True,):
                return original(self, scheduler_output, *args, **kw)
            if not hasattr(scheduler_output, "kvguard_events"):
                if _v2_warming_up(self):
                    # vLLM's warm-up (its worker's compile_or_warm_up_model, or an elastic EP
                    # warm-up): made-up requests the scheduler never saw, no tenant's KV.
                    return original(self, scheduler_output, *args, **kw)
                if scheduler_output.total_num_scheduled_tokens and self.__dict__.get("_kvguard", False) is not None:
                    # Any other step must come from kvguard's scheduler wrapper (a step of no
                    # tokens reads nothing: it only carries what finished).
                    _v2_step_without_events(self)
            # prepare_attn reads the step's events from here (V2 hands it the batch only).
            self._kvguard_step = scheduler_output
            try:
                out = original(self, scheduler_output, *args, **kw)
            finally:
                self._kvguard_step = None
            if not scheduler_output.total_num_scheduled_tokens:
                v2_idle_step(self, scheduler_output)
                return annotate_output(self, out, checked=False)
            return annotate_output(self, out)

        return wrapper

    def annotating(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return annotate_output(self, original(self, *args, **kwargs))

        return wrapper

    def append_block_ids(original: Any) -> Any:
        def wrapper(self: Any, req_index: int, new_block_ids: Any, overwrite: bool) -> Any:
            out = original(self, req_index, new_block_ids, overwrite)
            rows = self.__dict__.get("_kvguard_rows")
            if rows is not None:  # V2 on a GPU: the host copy of what V2 staged
                if self.redirect_writes_to_null_block:  # as V2 stages them then (elastic EP warm-up)
                    new_block_ids = tuple([0] * len(ids) for ids in new_block_ids)
                rows.append(req_index, new_block_ids, overwrite)
            return out

        return wrapper

    def initialize_kv_cache(original: Any) -> Any:
        # The runner's guard (and on a GPU its device check) made when its pool is, at start-up:
        # what kvguard cannot check stops the engine there under enforce, not at its first step.
        def wrapper(self: Any, kv_cache_config: Any, *args: Any, **kw: Any) -> Any:
            out = original(self, kv_cache_config, *args, **kw)
            if not kw.get("is_profiling", args[0] if args else False):
                self.__dict__.pop("_kvguard", None)
                _v2_guard_of(self)
            return out

        return wrapper

    default(GPUModelRunner, "_kvguard_step", None)
    wrap(WorkerWrapperBase, "initialize_from_config", initialize_from_config)
    wrap(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)
    wrap(BlockTables, "append_block_ids", append_block_ids)
    wrap(GPUModelRunner, "prepare_attn", prepare_attn)
    wrap(GPUModelRunner, "execute_model", execute_model)
    wrap(GPUModelRunner, "sample_tokens", annotating)
    if "pool" in GPUModelRunner.__dict__:  # a pooling model's step output (no sample_tokens)
        wrap(GPUModelRunner, "pool", annotating)


def install() -> None:
    """Hooks Model Runner V2; where that fails though vLLM can build a V2 runner (a part kvguard
    reads moved), that runner refuses to start under enforce (logs and runs unchecked under
    report) instead of running unguarded."""
    try:
        _hook()
        return
    except ImportError as e:
        failure = str(e)  # the except name is unbound after the block
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except ImportError:  # no Model Runner V2 in this vLLM: nothing to run unguarded
        logger.debug("kvguard: no V2 model runner to hook here (%s)", failure)
        return
    logger.error("kvguard: cannot hook Model Runner V2 (%s)", failure)
    original = v2.GPUModelRunner.__init__

    def refused(self: Any, *args: Any, **kw: Any) -> None:
        unsupported(f"Model Runner V2 (its hooks failed: {failure})")
        original(self, *args, **kw)

    v2.GPUModelRunner.__init__ = refused

