"""What kvguard can check in a vLLM engine, read from its configuration: KV cache groups of full
attention and sliding windows (one block size, the hash block size), no speculative decoding
(nor a diffusion model, which runs on its path), no context parallelism, no engine fault
tolerance. The scheduler side asks when vLLM builds its scheduler, the worker side when a runner
makes its guard; anything else goes to :func:`kvguard.vllm.attach.unsupported`."""

from __future__ import annotations

from typing import Any

from .attach import unsupported


def groups_supported(kv_cache_manager: Any) -> bool:
    """Whether kvguard can check this manager's KV cache groups (else ``unsupported``: raises
    under enforce, warns under report): full-attention groups and sliding-window groups (a
    hybrid model: one block pool, one table), each with the hash block size as its block size."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    managers = kv_cache_manager.coordinator.single_type_managers
    kinds = [type(m) for m in managers]
    if not managers or any(k not in (FullAttentionManager, SlidingWindowManager) for k in kinds):
        unsupported(
            f"KV cache groups {[k.__name__ for k in kinds]} (full-attention and sliding-window groups only)"
        )
        return False
    if any(m.block_size != kv_cache_manager.block_pool.hash_block_size for m in managers):
        unsupported("a block size different from the hash block size (partial-block prefix caching)")
        return False
    return True


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


def group_windows(kv_cache_config: Any) -> list[int | None] | None:
    """Per KV cache group of ``kv_cache_config``: its sliding window (tokens), None for full
    attention; None (after ``unsupported``) when a group is neither: the worker runs the same
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
            unsupported(f"a KV cache group of {type(spec).__name__} (full-attention and sliding-window groups only)")
            return None
    return out


def fault_tolerance_of(vllm_config: Any) -> str | None:
    """vLLM's engine fault tolerance in ``vllm_config`` (None: off). On a fault its recovery
    (``EngineCoreSentinel``) aborts every request and discards the outputs of the steps already
    sent to the workers: a step whose worker failed before kvguard's check never applies its
    ownership events (the releases of requests that finished, the claims of new blocks), so the
    table would go on holding pages vLLM handed to others and refuse a later request given one;
    a discarded output's refusals never reach the scheduler, so the blocks a refused row never
    wrote stay cached; and the recovery would catch kvguard's own ``UnsupportedConfig``."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is not None and getattr(parallel, "enable_fault_tolerance", False):
        return (
            "vLLM's fault tolerance (enable_fault_tolerance): its recovery drops steps whose "
            "ownership events the workers may never apply"
        )
    return None
