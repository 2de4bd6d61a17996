"""Where kvguard attaches to vLLM 0.33, and why each attachment is a wrapper.

vLLM offers ``vllm.general_plugins`` (code run in every process it starts) but no callback on
the KV cache manager's decisions nor on the worker's block table, so the plugin wraps these
methods at load, on the classes, once (each wrapper calls the original and only observes, except
the two marked *acts*):

scheduler process (engine core)
  ``req_to_blocks`` of the manager       a dict of per-request lists that report what the manager
                                         adds: prefix-cache hits (blocks with a hash), new blocks
                                         (without one) and the evictions they cost (new blocks the
                                         recorder had published); not a method: the manager's
                                         attribute is replaced, same contents
  ``BlockPool.cache_full_blocks``        blocks that became cacheable
  ``KVCacheManager.free``                free on finish (release) and on preemption
  ``KVCacheManager.pop_blocks_for_free`` the same, for vLLM's deferred frees
  ``KVCacheManager.reset_prefix_cache``  every cached block dropped
  ``SingleTypeKVCacheManager._remove_blocks_in_range``  a sliding window dropped blocks that left
                                         it (partial releases of the request)
  ``BlockPool.evict_blocks``             a KV connector's evictions (unsupported; recorded)
  ``Scheduler.__init__``                 what kvguard cannot check, found at start-up (enforce:
                                         ``UnsupportedConfig`` stops the engine)
  ``Scheduler.schedule``                 the step's events put on ``SchedulerOutput.kvguard_events``
  ``Scheduler.update_from_output``       *acts*: the refused requests' tokens of the step are
                                         dropped and those requests end with FINISHED_ERROR and a
                                         ``RequestError`` the client sees (vLLM's per-request
                                         error path, the one grammar errors take); the blocks they
                                         published leave the prefix cache
worker process
  ``GPUModelRunner._update_states``      a step that schedules no tokens (the runner returns
                                         before ``_prepare_inputs``): its events applied
  ``GPUModelRunner._prepare_inputs``     *acts*: the check, after ``_update_states`` built the
                                         persistent batch and before ``commit_block_table`` copies
                                         it; under enforce refused rows are nulled
  ``GPUModelRunner.execute_model`` / ``sample_tokens``  refusals put on the ModelRunnerOutput
                                         (``kvguard_refused``) that goes back to the scheduler
worker process, Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``; vLLM's CPU
platform runs it as ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``)
  ``GPUModelRunner.prepare_attn``        *acts*: the check of what V2 hands attention, the gathered
                                         block tables and slot mappings its kernels just built
                                         (host tensors on the CPU platform, read in place; device
                                         tensors on a GPU, checked and fenced by kvguard's
                                         kernels on vLLM's stream: ``kvguard.vllm.device``); under
                                         enforce a refused request's rows and slots are nulled
  ``BlockTables.append_block_ids``       on a GPU only: the host copy of the rows V2 stages
  ``GPUModelRunner.initialize_kv_cache`` the runner's guard made with its pool (start-up: what
                                         kvguard cannot check stops the engine there)
  ``GPUModelRunner.execute_model``       a step with no tokens (returns before ``prepare_attn``):
                                         its events applied; refusals put on the output. A step
                                         with tokens and no events that is not vLLM's warm-up
                                         stops the engine (enforce)
  ``WorkerWrapperBase.initialize_from_config``  marks the worker class's
                                         ``compile_or_warm_up_model``, where vLLM's warm-ups run
                                         made-up requests (not checked)
  ``GPUModelRunner.sample_tokens``       refusals put on the (async) output (``pool``'s too, for
                                         a pooling model)

The scheduler's truth reaches the worker on the ``SchedulerOutput`` it already sends each step
(by reference in-process, pickled through vLLM's shared-memory broadcast otherwise), and the
refusals come back on the ``ModelRunnerOutput`` the same way: no extra channel, no extra round
trip. Supported: full-attention and sliding-window KV cache groups (hybrid models too), block
size equal to the hash block size, no KV connector, no speculative decoding (nor a diffusion
model, which runs on its path), no context parallelism, vLLM's V1 model runner
(``CPUModelRunner`` is a subclass), and Model Runner V2 with the same groups (on host
memory, vLLM's CPU platform, and on a GPU through the device check); anything else is
found when vLLM builds its scheduler (a wrapper on ``Scheduler.__init__``): refused there under
enforce, so the engine never starts, and left unchecked (with a warning) under report.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from typing import Any

import numpy as np

from .device import HostRows, V2Device, host_slot_mappings
from .guard import StepGuard, StepReport
from .recorder import SchedulerRecorder

__all__ = ["annotate_output", "install", "installed_mode", "uninstall", "worker_step"]

logger = logging.getLogger("vllm.kvguard")

_MODE: str | None = None
_ORIGINALS: list[tuple[type, str, Any]] = []


class UnsupportedConfig(RuntimeError):
    """kvguard cannot check this vLLM configuration."""


def installed_mode() -> str | None:
    return _MODE


def _wrap(cls: type, name: str, make: Any) -> None:
    original = cls.__dict__[name]
    _ORIGINALS.append((cls, name, original))
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__kvguard_original__ = original
    setattr(cls, name, wrapper)


def _default(cls: type, name: str, value: Any) -> None:
    """A class attribute the wrappers read (removed again by :func:`uninstall`): a plain
    attribute load in the hot wrappers instead of an instance ``__dict__`` lookup."""
    _ORIGINALS.append((cls, name, cls.__dict__.get(name, _ABSENT)))
    setattr(cls, name, value)


_ABSENT = object()


def uninstall() -> None:
    global _MODE
    while _ORIGINALS:
        cls, name, original = _ORIGINALS.pop()
        if original is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    _MODE = None


def _unsupported(what: str) -> None:
    if _MODE == "enforce":
        raise UnsupportedConfig(f"kvguard (KVGUARD_VLLM=enforce) cannot check {what}")
    logger.warning("kvguard: cannot check %s; this engine runs unchecked", what)


# -- scheduler side --------------------------------------------------------------------------


def recorder_of(kv_cache_manager: Any, requests: dict[str, Any] | None = None) -> SchedulerRecorder | None:
    """The recorder of a ``KVCacheManager`` (created on first use; None when unsupported).
    ``requests``: the scheduler's request dict, read at admission."""
    rec = kv_cache_manager.__dict__.get("_kvguard_recorder", False)
    if rec is not False:
        if rec is not None and requests is not None and rec.requests is not requests:
            rec.requests = requests
        return rec
    rec = None
    if groups_supported(kv_cache_manager):
        managers = list(kv_cache_manager.coordinator.single_type_managers)
        rec = SchedulerRecorder(managers, kv_cache_manager.max_model_len, requests)
        kv_cache_manager.block_pool._kvguard_recorder = rec
    kv_cache_manager._kvguard_recorder = rec
    return rec


def groups_supported(kv_cache_manager: Any) -> bool:
    """Whether kvguard can check this manager's KV cache groups (else ``_unsupported``: raises
    under enforce, warns under report): full-attention groups and sliding-window groups (a
    hybrid model: one block pool, one table), each with the hash block size as its block size."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    managers = kv_cache_manager.coordinator.single_type_managers
    kinds = [type(m) for m in managers]
    if not managers or any(k not in (FullAttentionManager, SlidingWindowManager) for k in kinds):
        _unsupported(
            f"KV cache groups {[k.__name__ for k in kinds]} (full-attention and sliding-window groups only)"
        )
        return False
    if any(m.block_size != kv_cache_manager.block_pool.hash_block_size for m in managers):
        _unsupported("a block size different from the hash block size (partial-block prefix caching)")
        return False
    return True


def refused_cached_blocks(scheduler: Any, refused: Any) -> set[int]:
    """The cached blocks the refused requests hold (read before vLLM frees them)."""
    rec = scheduler.kv_cache_manager.__dict__.get("_kvguard_recorder")
    blocks: set[int] = set()
    if rec is not None:
        for rid in refused:
            blocks.update(rec.published_of(rid))
    return blocks


def withheld_output(output: Any, refused: Any) -> Any:
    """A copy of a step's ``ModelRunnerOutput`` carrying nothing of the ``refused`` requests:
    no sampled token, no prompt logprobs, no pooling output (vLLM's own object is never
    changed: it may be shared). A refused request then ends with its error, not with what it
    computed; and vLLM never sees prompt logprobs on a request that emits nothing this step
    (its scheduler asserts that they come only with an output)."""
    out = copy.copy(output)
    index = out.req_id_to_index
    rows = [index[rid] for rid in refused if rid in index]
    sampled = list(out.sampled_token_ids)
    for row in rows:
        if row < len(sampled):
            sampled[row] = []
    out.sampled_token_ids = sampled
    for name in ("prompt_logprobs_dict", "prompt_token_id_logprobs_dict"):
        per_request = getattr(out, name, None)
        if per_request and any(rid in per_request for rid in refused):
            setattr(out, name, {rid: v for rid, v in per_request.items() if rid not in refused})
    pooled = getattr(out, "pooler_output", None)
    if pooled:
        pooled = list(pooled)
        for row in rows:
            if row < len(pooled):
                pooled[row] = None
        out.pooler_output = pooled
    return out


def forget_refused_writes(scheduler: Any, blocks: set[int]) -> None:
    """Takes the cached blocks refused requests hold out of vLLM's prefix cache. A refused row is
    nulled before the copy, so the blocks vLLM hashed for that step (and any later one, under
    async scheduling) were never written: left cached, every later request of the tenant that
    hits them would read what nobody wrote (and be refused for it). Blocks they published before,
    or took as prefix-cache hits, are dropped too (a few cache hits lost after a refusal, never a
    wrong read); their other holders keep them. The recorder hears of it as evictions, as it does
    of a KV connector's, after the refused requests' releases (so the table, where the refused
    request held them, evicts them then, before anything claims them again)."""
    if blocks:
        scheduler.kv_cache_manager.block_pool.evict_blocks(blocks)


def speculation_of(vllm_config: Any) -> str | None:
    """What of ``vllm_config`` schedules tokens the worker may take back (None: nothing):
    speculative decoding, and a diffusion (dLLM) model, which runs on the same path (its canvas
    is scheduled as draft tokens). A rejected draft rolls the computed-token count back, which
    the table does not record."""
    if vllm_config is None:
        return None
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding (speculative_config)"
    if getattr(vllm_config, "diffusion_config", None) is not None:
        return "a diffusion model (diffusion_config: its canvas runs as speculative tokens)"
    try:
        tokens = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
    except Exception as e:  # a config kvguard cannot read is one it cannot check
        return f"speculative tokens it cannot read ({e!r})"
    if tokens > 0:
        return f"{tokens} speculative tokens a step (num_speculative_tokens)"
    return None


def context_parallelism_of(vllm_config: Any) -> str | None:
    """Decode or prefill context parallelism in ``vllm_config`` (None: neither): its KV cache is
    sharded across ranks, so a scheduler block is ``block_size x ranks`` tokens while each
    rank's block table holds per-rank blocks, which the table cannot check."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return None
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        return (
            f"context parallelism (decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}): "
            "its KV cache is sharded across ranks"
        )
    return None


def check_scheduler(scheduler: Any) -> None:
    """What kvguard cannot check in this engine, found when its scheduler is built: under
    enforce an UnsupportedConfig stops the engine there; under report a warning, and the engine
    runs unchecked. (The recorder itself is made at the first ``schedule``.)"""
    scheduler._kvguard_checked_config = True
    config = scheduler.vllm_config
    speculation = speculation_of(config)
    if speculation is not None:
        _unsupported(
            f"{speculation}: the worker writes draft tokens whose rejection rolls the "
            "computed-token count back, which the table does not record"
        )
        scheduler.kv_cache_manager._kvguard_recorder = None
        return
    parallelism = context_parallelism_of(config)
    if parallelism is not None:
        _unsupported(parallelism)
        scheduler.kv_cache_manager._kvguard_recorder = None
        return
    if getattr(scheduler, "connector", None) is not None:
        _unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
        scheduler.kv_cache_manager._kvguard_recorder = None
        return
    if not groups_supported(scheduler.kv_cache_manager):
        scheduler.kv_cache_manager._kvguard_recorder = None


def _install_scheduler() -> None:
    from vllm.outputs import RequestError
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    # Nothing wraps allocate_slots (once per running request per step), get_new_blocks nor
    # anything per block: the recorder hears of new blocks and prefix hits through the
    # request's block list (a fresh block has no hash, a prefix hit has one; a fresh block the
    # recorder had published was evicted by vLLM for this reuse), of newly cacheable blocks
    # through cache_full_blocks, both of which run only when something changes. The wrappers
    # read the recorder as a plain attribute (a class default of None).

    def evict_blocks(original: Any) -> Any:
        # A KV connector's evictions (unsupported configuration; recorded all the same).
        def wrapper(self: Any, block_ids: Any) -> Any:
            out = original(self, block_ids)
            rec = self._kvguard_recorder
            if rec is not None:
                rec.evicted(block_ids)
            return out

        return wrapper

    def cache_full_blocks(original: Any) -> Any:
        def wrapper(
            self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int, *args: Any, **kw: Any
        ) -> Any:
            out = original(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kw)
            rec = self._kvguard_recorder
            if rec is not None:
                rec.cached(request.request_id, blocks, num_cached_blocks, num_full_blocks)
            return out

        return wrapper

    def freeing(original: Any) -> Any:
        def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            rec = recorder_of(self)
            # The published blocks of a request that is preempted or finishes (a client's abort,
            # a stop), read while it still holds them: a refusal of its last step may reach the
            # scheduler after it gave them back (async scheduling), and they must leave the cache.
            held = None if rec is None else rec.published_of(request.request_id)
            out = original(self, request, *args, **kwargs)
            if rec is not None:
                rec.freed(request, held)
            return out

        return wrapper

    def reset_prefix_cache(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            ok = original(self, *args, **kwargs)
            rec = recorder_of(self)
            if ok and rec is not None:
                rec.cache_reset()
            return ok

        return wrapper

    def init(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, *args, **kwargs)
            # At start-up, not at the first step: under enforce an engine kvguard cannot check
            # never serves.
            check_scheduler(self)

        return wrapper

    def schedule(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.__dict__.get("_kvguard_checked_config"):
                check_scheduler(self)
            rec = recorder_of(self.kv_cache_manager, self.requests)
            if rec is None:
                out = original(self, *args, **kwargs)
                out.kvguard_events = None
                return out
            rec.in_schedule = True
            try:
                out = original(self, *args, **kwargs)
            finally:
                rec.in_schedule = False
            out.kvguard_events = rec.take()
            return out

        return wrapper

    def update_from_output(original: Any) -> Any:
        def wrapper(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            refused = getattr(model_runner_output, "kvguard_refused", None)
            if not refused:
                return original(self, scheduler_output, model_runner_output)
            blocks = refused_cached_blocks(self, refused)
            model_runner_output = withheld_output(model_runner_output, refused)
            for rid, message in refused.items():
                if rid in self.requests:
                    self.grammar_compile_error_reqs[rid] = RequestError(code="kvguard_violation", message=message)
            out = original(self, scheduler_output, model_runner_output)
            forget_refused_writes(self, blocks)
            return out

        return wrapper

    def remove_blocks_in_range(original: Any) -> Any:
        # A sliding window dropping the blocks that left it (the null block put in their
        # place, then freed): runs only when a request's window moves past a block.
        def wrapper(self: Any, request_id: str, first_block: int, last_block: int) -> Any:
            blocks = self.req_to_blocks.get(request_id)
            rec = getattr(blocks, "_recorder", None)
            if rec is None:
                return original(self, request_id, first_block, last_block)
            before = list.__getitem__(blocks, slice(first_block, last_block))
            out = original(self, request_id, first_block, last_block)
            after = list.__getitem__(blocks, slice(first_block, first_block + len(before)))
            gone = [b for b, now in zip(before, after) if b is not now]
            if gone:
                rec.dropped(request_id, gone)
            return out

        return wrapper

    _wrap(SingleTypeKVCacheManager, "_remove_blocks_in_range", remove_blocks_in_range)
    _wrap(KVCacheManager, "free", freeing)
    _wrap(KVCacheManager, "pop_blocks_for_free", freeing)
    _wrap(KVCacheManager, "reset_prefix_cache", reset_prefix_cache)
    _default(BlockPool, "_kvguard_recorder", None)
    _wrap(BlockPool, "evict_blocks", evict_blocks)
    _wrap(BlockPool, "cache_full_blocks", cache_full_blocks)
    _wrap(Scheduler, "__init__", init)
    _wrap(Scheduler, "schedule", schedule)
    _wrap(Scheduler, "update_from_output", update_from_output)
    _install_handshake()


def worker_mode(_worker: Any) -> str | None:
    """Run on every worker by the engine's start-up handshake (``collective_rpc``): the mode
    kvguard checks that worker's steps in (None: kvguard's hooks are not installed there)."""
    return _MODE


def check_workers(engine_core: Any) -> None:
    """After ``EngineCore.__init__``: every worker checks in the mode the scheduler records for.
    The plugin loads separately in each process (a worker node started on its own, Ray's, takes
    its own environment and packages; ``VLLM_PLUGINS`` may leave kvguard out): a worker without
    kvguard would run its steps unchecked while the scheduler records them. Under enforce a
    worker that runs another mode, none, or cannot be asked stops the engine at start-up."""
    if _MODE is None:
        return
    executor = getattr(engine_core, "model_executor", None)
    if executor is None:
        _unsupported("an engine whose workers cannot be asked whether kvguard runs there (no model_executor)")
        return
    try:
        modes = list(executor.collective_rpc(worker_mode))
    except Exception as e:  # noqa: BLE001 - a worker that cannot run kvguard's function lacks kvguard
        _unsupported(f"workers that cannot say whether kvguard runs there ({e!r}: is kvguard installed on every node?)")
        return
    off = {i: m for i, m in enumerate(modes) if m != _MODE}
    if off or not modes:
        _unsupported(
            f"worker(s) where kvguard runs {off or 'nowhere'} while the scheduler records for {_MODE!r} "
            "(KVGUARD_VLLM, VLLM_PLUGINS or the installed packages differ between processes)"
        )


def _install_handshake() -> None:
    from vllm.v1.engine.core import EngineCore

    def init(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, *args, **kwargs)
            check_workers(self)

        return wrapper

    _wrap(EngineCore, "__init__", init)


# -- worker side -----------------------------------------------------------------------------


def worker_step(
    owner: Any,
    input_batch: Any,
    scheduler_output: Any,
    num_scheduled_tokens: Any,
    *,
    num_blocks: int,
    max_model_len: int,
) -> StepReport | None:
    """The worker's check of one step (what the ``_prepare_inputs`` wrapper runs; a harness
    driving ``InputBatch`` itself calls it at the same point). ``owner`` keeps the guard
    (``owner._kvguard``) and the refusals awaiting the step's output."""
    guard = _guard_of(owner, input_batch, num_blocks, max_model_len)
    if guard is None:
        return None
    events = getattr(scheduler_output, "kvguard_events", None)
    tables = input_batch.block_table.block_tables
    if guard.windows is None:
        table = tables[0]
        report = guard.check_step(
            input_batch.req_ids,
            table.block_table.np,
            table.num_blocks_per_row,
            input_batch.num_computed_tokens_cpu,
            num_scheduled_tokens,
            events,
        )
    else:
        report = guard.check_groups_step(
            input_batch.req_ids,
            [(t.block_table.np, t.num_blocks_per_row) for t in tables],
            input_batch.num_computed_tokens_cpu,
            num_scheduled_tokens,
            events,
        )
    _pend(owner, guard, report)
    return report


#: Guards the refusals awaiting a runner's output: vLLM may read a step's output (and drain the
#: device's verdicts into them) in another thread than the one checking the next step.
_PENDING = threading.Lock()


def _pend(owner: Any, guard: StepGuard, report: StepReport) -> None:
    """Keeps a step's refusals (enforce) for the step's output (``annotate_output``)."""
    if report.refused and guard.mode == "enforce":
        with _PENDING:
            pending = owner.__dict__.setdefault("_kvguard_refused", {})
            for rid, refusal in report.refused.items():
                pending[rid] = refusal.client_message(rid)


def _take_pending(owner: Any) -> dict[str, str]:
    """The refusals awaiting ``owner``'s output, taken."""
    with _PENDING:
        pending = owner.__dict__.get("_kvguard_refused")
        if not pending:
            return {}
        refused = dict(pending)
        pending.clear()
        return refused


def group_windows(kv_cache_config: Any) -> list[int | None] | None:
    """Per KV cache group of ``kv_cache_config``: its sliding window (tokens), None for full
    attention; None (after ``_unsupported``) when a group is neither: the worker runs the same
    test the scheduler does (the manager class vLLM picks for the group's spec), so under report
    a worker of an engine kvguard cannot check judges nothing."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    out: list[int | None] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        manager = KVCacheSpecRegistry.get_manager_class(spec, getattr(group, "role", None))
        if manager is FullAttentionManager:
            out.append(None)
        elif manager is SlidingWindowManager:
            out.append(int(spec.sliding_window))
        else:
            _unsupported(f"a KV cache group of {type(spec).__name__} (full-attention and sliding-window groups only)")
            return None
    return out


def _guard_of(owner: Any, input_batch: Any, num_blocks: int, max_model_len: int) -> StepGuard | None:
    """``owner``'s guard, made on first use (None when the configuration is unsupported)."""
    guard = owner.__dict__.get("_kvguard", False)
    if guard is False:
        tables = input_batch.block_table.block_tables
        guard = None
        config = getattr(owner, "kv_cache_config", None)
        windows = group_windows(config) if config is not None else [None] * len(tables)
        sizes = {t.block_size for t in tables}
        vllm_config = getattr(owner, "vllm_config", None)
        speculation = speculation_of(vllm_config)
        parallelism = context_parallelism_of(vllm_config)
        if windows is None:
            pass
        elif speculation is not None:
            _unsupported(speculation)
        elif parallelism is not None:
            # The worker's rows hold per-rank blocks while the scheduler's events name blocks of
            # block_size x ranks tokens: checked as they are, every request would be refused.
            _unsupported(parallelism)
        elif len(windows) != len(tables):
            _unsupported(f"{len(tables)} block tables for {len(windows)} KV cache groups")
        elif len(sizes) != 1:
            _unsupported(f"KV cache groups of different block sizes {sorted(sizes)}")
        else:
            guard = StepGuard(
                num_blocks,
                tables[0].block_size,
                max_model_len,
                _MODE or "enforce",
                windows=windows if len(windows) > 1 or windows[0] is not None else None,
            )
        owner._kvguard = guard
    return guard


def idle_step(owner: Any, input_batch: Any, scheduler_output: Any, *, num_blocks: int, max_model_len: int) -> None:
    """A step that schedules no tokens (vLLM sends one to tell the worker what finished; its
    runner returns before ``_prepare_inputs``): its events (the releases) are applied all the
    same, so the table frees what vLLM freed."""
    events = getattr(scheduler_output, "kvguard_events", None)
    if not events:
        return
    guard = _guard_of(owner, input_batch, num_blocks, max_model_len)
    if guard is None:
        return
    tables = input_batch.block_table.block_tables
    if guard.windows is None:
        table = tables[0]
        report = guard.check_step(
            [], table.block_table.np, table.num_blocks_per_row, input_batch.num_computed_tokens_cpu, None, events
        )
    else:
        report = guard.check_groups_step(
            [],
            [(t.block_table.np, t.num_blocks_per_row) for t in tables],
            input_batch.num_computed_tokens_cpu,
            None,
            events,
        )
    _pend(owner, guard, report)


def annotate_output(owner: Any, output: Any, *, checked: bool = True) -> Any:
    """Puts the refusals awaiting ``owner``'s step output on it (``kvguard_refused``); on a GPU
    (V2), with the device check's verdicts of every step up to this one, drained when the output
    is read (the ring's copy was queued before the step's sampled tokens, so it has landed).
    ``checked=False``: the output of a step that ran no check (no tokens scheduled), which takes
    no device verdict: under async scheduling the last checked step's output may still be on its
    way, and its verdicts must ride it (an idle output taking them would let that step's tokens
    of a refused request leave)."""
    guard = owner.__dict__.get("_kvguard")
    device = getattr(guard, "device", None) if checked else None
    if (device is None and not owner.__dict__.get("_kvguard_refused")) or output is None:
        return output
    step = device.steps if device is not None else 0
    if hasattr(output, "req_id_to_index"):
        refused = _with_device_refusals(owner, guard, device, step)
        if refused:
            output = copy.copy(output)  # never mutate vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT
            output.kvguard_refused = refused
    elif hasattr(output, "get_output"):
        get_output = output.get_output
        refused_now = _take_pending(owner)

        def get_output_with_refusals() -> Any:
            out = get_output()
            refused = {**refused_now, **_with_device_refusals(owner, guard, device, step)}
            if not refused:
                return out
            out = copy.copy(out)
            out.kvguard_refused = refused
            return out

        output.get_output = get_output_with_refusals
    elif _is_intermediate(output):
        # A pipeline stage before the last: its output goes to the next stage, never to the
        # scheduler, and the last stage checks the same rows and refuses the same requests.
        # What awaits this stage's output is let go (it would pile up, step after step).
        _with_device_refusals(owner, guard, device, step)
    return output


def _is_intermediate(output: Any) -> bool:
    """Whether ``output`` is a pipeline stage's hidden states for the next stage."""
    from vllm.sequence import IntermediateTensors

    return isinstance(output, IntermediateTensors)


def _with_device_refusals(owner: Any, guard: Any, device: Any, step: int) -> dict[str, str]:
    """The refusals awaiting ``owner``'s output, the device's of every step up to ``step``
    among them (taken from the pending ones)."""
    if device is not None:
        _pend(owner, guard, guard.device_refused(*device.drain_through(guard, step)))
    return _take_pending(owner)


def _install_worker() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def check_config(runner: Any) -> None:
        if runner.kv_cache_config is not None and not runner.__dict__.get("_kvguard_checked_config"):
            runner._kvguard_checked_config = True
            if getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
                _unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
                runner._kvguard = None

    def update_states(original: Any) -> Any:
        def wrapper(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
            out = original(self, scheduler_output, *args, **kw)
            if not scheduler_output.total_num_scheduled_tokens and self.kv_cache_config is not None:
                check_config(self)
                idle_step(
                    self,
                    self.input_batch,
                    scheduler_output,
                    num_blocks=self.kv_cache_config.num_blocks,
                    max_model_len=self.max_model_len,
                )
            return out

        return wrapper

    def prepare_inputs(original: Any) -> Any:
        def wrapper(self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *args: Any, **kw: Any) -> Any:
            check_config(self)
            worker_step(
                self,
                self.input_batch,
                scheduler_output,
                num_scheduled_tokens,
                num_blocks=self.kv_cache_config.num_blocks,
                max_model_len=self.max_model_len,
            )
            return original(self, scheduler_output, num_scheduled_tokens, *args, **kw)

        return wrapper

    def annotating(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return annotate_output(self, original(self, *args, **kwargs))

        return wrapper

    _wrap(GPUModelRunner, "_update_states", update_states)
    _wrap(GPUModelRunner, "_prepare_inputs", prepare_inputs)
    _wrap(GPUModelRunner, "execute_model", annotating)
    _wrap(GPUModelRunner, "sample_tokens", annotating)


# -- worker side, Model Runner V2 ---------------------------------------------------------------


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
    _pend(runner, guard, report)


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
    _pend(runner, guard, report)


def v2_idle_step(runner: Any, scheduler_output: Any) -> None:
    """A V2 step that schedules no tokens (``execute_model`` returns before ``prepare_attn``):
    its events (the releases) are applied all the same."""
    events = getattr(scheduler_output, "kvguard_events", None)
    if not events:
        return
    guard = _v2_guard_of(runner)
    if guard is not None:
        _pend(runner, guard, guard.check_attn_step([], [], None, None, None, None, events))


def _v2_guard_of(runner: Any) -> StepGuard | None:
    """A V2 runner's guard, made on first use (None when kvguard cannot check it: ``_unsupported``
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
        _unsupported(
            f"vLLM's V2 model runner on {runner.device.type}: kvguard's device check runs on CUDA devices"
        )
    elif runner.speculative_config is not None or speculation_of(runner.vllm_config) is not None:
        _unsupported(speculation_of(runner.vllm_config) or "speculative decoding (speculative_config)")
    elif runner.pcp_manager is not None or runner.dcp_size > 1 or context_parallelism_of(runner.vllm_config):
        _unsupported("context parallelism under V2 (its block tables are partitioned across ranks)")
    elif getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
        _unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
    elif len(sizes) != 1:
        _unsupported(f"KV cache groups of different block sizes {sorted(sizes)}")
    else:
        guard = StepGuard(
            config.num_blocks,
            sizes.pop(),
            runner.max_model_len,
            _MODE or "enforce",
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
    """The device half of a V2 runner's check on a GPU, or None (after ``_unsupported``: under
    enforce the engine stops) where kvguard cannot run it: no driver, no NVRTC, a pool wider
    than the device check's limits, more than one rank."""
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    ranks = int(getattr(parallel, "world_size", 1) or 1)
    if ranks > 1:
        # Only the output rank's ModelRunnerOutput reaches the scheduler: a refusal another
        # rank's device check made (its rows fenced there) would never end its request.
        _unsupported(f"vLLM's V2 model runner on a GPU over {ranks} ranks (a rank's device verdicts would not reach the scheduler)")
        return None
    bt = runner.block_tables
    try:
        dg = new_device_guard(runner, guard)
    except Exception as e:  # kvguard.DeviceError, or torch without CUDA
        _unsupported(f"vLLM's V2 model runner on a GPU, but kvguard's device check cannot start here: {e}")
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
    _unsupported(
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

    _wrap(owner, "compile_or_warm_up_model", warming)


def _install_worker_v2() -> None:
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

    _default(GPUModelRunner, "_kvguard_step", None)
    _wrap(WorkerWrapperBase, "initialize_from_config", initialize_from_config)
    _wrap(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)
    _wrap(BlockTables, "append_block_ids", append_block_ids)
    _wrap(GPUModelRunner, "prepare_attn", prepare_attn)
    _wrap(GPUModelRunner, "execute_model", execute_model)
    _wrap(GPUModelRunner, "sample_tokens", annotating)
    if "pool" in GPUModelRunner.__dict__:  # a pooling model's step output (no sample_tokens)
        _wrap(GPUModelRunner, "pool", annotating)


def _install_v2_or_refuse() -> None:
    """Hooks Model Runner V2; where that fails though vLLM can build a V2 runner (a part kvguard
    reads moved), that runner refuses to start under enforce (logs and runs unchecked under
    report) instead of running unguarded."""
    try:
        _install_worker_v2()
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
        _unsupported(f"Model Runner V2 (its hooks failed: {failure})")
        original(self, *args, **kw)

    v2.GPUModelRunner.__init__ = refused


def install(mode: str) -> None:
    """Wraps vLLM's methods in this process (idempotent; a second mode replaces the first)."""
    global _MODE
    if _MODE is not None:
        _MODE = mode
        return
    _MODE = mode
    # The user's runner is theirs to pick: kvguard checks the V1 runner, and V2 on host memory
    # (vLLM's CPU platform) and on a GPU (vLLM's default where Triton runs: the device check).
    _install_scheduler()
    try:
        _install_worker()
    except ImportError as e:  # a platform without the GPU model runner module
        _unsupported(f"this worker ({e})")
    _install_v2_or_refuse()
    logger.info("kvguard: checking every step's block table (%s)", mode)
