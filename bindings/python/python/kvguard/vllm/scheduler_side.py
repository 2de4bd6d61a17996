"""The scheduler side's wrappers (the engine-core process): what vLLM's KV cache manager
decides, heard by the step's :class:`~kvguard.vllm.recorder.SchedulerRecorder` and put on the
``SchedulerOutput`` it sends the workers (``kvguard_events``); the refusals that come back on the
``ModelRunnerOutput`` ended as vLLM ends a request in error; and the start-up handshake that
every worker checks in the scheduler's mode. The attachments are listed in
:mod:`kvguard.vllm.hooks`."""

from __future__ import annotations

import copy
from typing import Any

from .attach import default, installed_mode, unsupported, wrap
from .recorder import SchedulerRecorder
from .support import context_parallelism_of, fault_tolerance_of, groups_supported, speculation_of


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


def check_scheduler(scheduler: Any) -> None:
    """What kvguard cannot check in this engine, found when its scheduler is built: under
    enforce an UnsupportedConfig stops the engine there; under report a warning, and the engine
    runs unchecked. (The recorder itself is made at the first ``schedule``.)"""
    scheduler._kvguard_checked_config = True
    config = scheduler.vllm_config
    speculation = speculation_of(config)
    if speculation is not None:
        unsupported(
            f"{speculation}: the worker writes draft tokens whose rejection rolls the "
            "computed-token count back, which the table does not record"
        )
        scheduler.kv_cache_manager._kvguard_recorder = None
        return
    for why in (context_parallelism_of(config), fault_tolerance_of(config)):
        if why is not None:
            unsupported(why)
            scheduler.kv_cache_manager._kvguard_recorder = None
            return
    if getattr(scheduler, "connector", None) is not None:
        unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
        scheduler.kv_cache_manager._kvguard_recorder = None
        return
    if not groups_supported(scheduler.kv_cache_manager):
        scheduler.kv_cache_manager._kvguard_recorder = None


def install() -> None:
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

    wrap(SingleTypeKVCacheManager, "_remove_blocks_in_range", remove_blocks_in_range)
    wrap(KVCacheManager, "free", freeing)
    wrap(KVCacheManager, "pop_blocks_for_free", freeing)
    wrap(KVCacheManager, "reset_prefix_cache", reset_prefix_cache)
    default(BlockPool, "_kvguard_recorder", None)
    wrap(BlockPool, "evict_blocks", evict_blocks)
    wrap(BlockPool, "cache_full_blocks", cache_full_blocks)
    wrap(Scheduler, "__init__", init)
    wrap(Scheduler, "schedule", schedule)
    wrap(Scheduler, "update_from_output", update_from_output)
    _install_handshake()


def worker_mode(_worker: Any) -> str | None:
    """Run on every worker by the engine's start-up handshake (``collective_rpc``): the mode
    kvguard checks that worker's steps in (None: kvguard's hooks are not installed there)."""
    return installed_mode()


def check_workers(engine_core: Any) -> None:
    """After ``EngineCore.__init__``: every worker checks in the mode the scheduler records for.
    The plugin loads separately in each process (a worker node started on its own, Ray's, takes
    its own environment and packages; ``VLLM_PLUGINS`` may leave kvguard out): a worker without
    kvguard would run its steps unchecked while the scheduler records them. Under enforce a
    worker that runs another mode, none, or cannot be asked stops the engine at start-up."""
    mode = installed_mode()
    if mode is None:
        return
    executor = getattr(engine_core, "model_executor", None)
    if executor is None:
        unsupported("an engine whose workers cannot be asked whether kvguard runs there (no model_executor)")
        return
    try:
        modes = list(executor.collective_rpc(worker_mode))
    except Exception as e:  # noqa: BLE001 - a worker that cannot run kvguard's function lacks kvguard
        unsupported(f"workers that cannot say whether kvguard runs there ({e!r}: is kvguard installed on every node?)")
        return
    off = {i: m for i, m in enumerate(modes) if m != mode}
    if off or not modes:
        unsupported(
            f"worker(s) where kvguard runs {off or 'nowhere'} while the scheduler records for {mode!r} "
            "(KVGUARD_VLLM, VLLM_PLUGINS or the installed packages differ between processes)"
        )


def _install_handshake() -> None:
    from vllm.v1.engine.core import EngineCore

    def init(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, *args, **kwargs)
            check_workers(self)

        return wrapper

    wrap(EngineCore, "__init__", init)

