"""kvguard's hooks on SGLang's module functions, installed once per process.

``mem_cache.allocation.write_cache_indices`` (an extend batch's row write, on SGLang's GPU
branch done by ``write_req_to_token_pool_triton``) and ``managers.schedule_batch``'s
``alloc_for_extend`` / ``alloc_for_decode`` (a batch's requests, in order). Each finds the guard of
the ``ReqToTokenPool`` it works on (``pool.kvguard_guard``); a pool without one passes through.
``_GenerationStreamAccumulator.to_payload`` (the outputs SGLang decided to send this step) is
judged by the guard whose ``stream_output`` is running (:data:`STREAMING`); none: it passes through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .arrays import _flat


_WRITER_HOOKED = False


def _hook_cache_index_writer() -> None:
    """SGLang's extend row write, ``mem_cache.allocation.write_cache_indices``: on a GPU whose
    attention backend supports Triton it writes ``req_to_token`` with
    ``write_req_to_token_pool_triton``, never calling ``ReqToTokenPool.write``. Wrapped once per
    process; the guard whose ``ReqToTokenPool`` it writes judges the same claims the two
    ``ReqToTokenPool.write`` calls of its other branch would, from its arguments (the
    allocator's ``out_cache_loc`` and the radix cache's prefix), never from the rows."""
    global _WRITER_HOOKED
    if _WRITER_HOOKED:
        return
    try:
        from sglang.srt.mem_cache import allocation
    except ImportError:  # an SGLang without this writer: its row writes all go through write
        return
    inner = allocation.write_cache_indices

    def write_cache_indices(out_cache_loc: Any, req_pool_indices_tensor: Any, req_pool_indices_cpu: Any,
                            prefix_lens_tensor: Any, prefix_lens_cpu: Any, seq_lens_tensor: Any, seq_lens_cpu: Any,
                            extend_lens_tensor: Any, extend_lens_cpu: Any, prefix_tensors: Any,
                            req_to_token_pool: Any, *args: Any, **kwargs: Any) -> Any:
        guard = getattr(req_to_token_pool, "kvguard_guard", None)
        if guard is None:
            return inner(out_cache_loc, req_pool_indices_tensor, req_pool_indices_cpu, prefix_lens_tensor,
                         prefix_lens_cpu, seq_lens_tensor, seq_lens_cpu, extend_lens_tensor, extend_lens_cpu,
                         prefix_tensors, req_to_token_pool, *args, **kwargs)
        guard._cache_indices_written(out_cache_loc, req_pool_indices_cpu, prefix_lens_cpu, extend_lens_cpu, prefix_tensors)
        guard._writing_cache_indices = True
        try:
            return inner(out_cache_loc, req_pool_indices_tensor, req_pool_indices_cpu, prefix_lens_tensor,
                         prefix_lens_cpu, seq_lens_tensor, seq_lens_cpu, extend_lens_tensor, extend_lens_cpu,
                         prefix_tensors, req_to_token_pool, *args, **kwargs)
        finally:
            guard._writing_cache_indices = False

    allocation.write_cache_indices = write_cache_indices
    _WRITER_HOOKED = True


_BATCH_HOOKED = False


def _hook_batch_allocs() -> None:
    """``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` allocate through
    ``alloc_for_extend`` / ``alloc_for_decode`` (names in ``managers.schedule_batch``): wrapped
    once per process, they tell the pool's guard which requests the batch holds, in order."""
    global _BATCH_HOOKED
    if _BATCH_HOOKED:
        return
    try:
        from sglang.srt.managers import schedule_batch
    except ImportError:
        return
    for name, before in (("alloc_for_extend", False), ("alloc_for_decode", True)):
        inner = getattr(schedule_batch, name, None)
        if inner is not None:
            setattr(schedule_batch, name, _batch_alloc(inner, before=before))
    _BATCH_HOOKED = True


def _on_device(t: Any) -> bool:
    """Whether ``t`` is a tensor on a device (its values reach the host only by a copy)."""
    return getattr(t, "is_cpu", True) is False


def _decode_rows_on_host(batch: Any) -> tuple[Any, Any, Any] | None:
    """For a decode batch whose ``req_pool_indices`` is on a device (the caller asks
    :func:`_on_device`): that tensor, with the host copies SGLang keeps of it and of the
    columns its row write writes (``req_pool_indices_cpu``,
    and ``seq_lens_cpu`` before the step's increment, as ``alloc_for_decode`` writes at
    ``seq_lens``; None for an encoder-decoder model, which writes past its encoder's length).
    The row write (``Guard._wrap_row_write``) reads these instead of copying its device tensors."""
    rows = batch.req_pool_indices
    rows_cpu = getattr(batch, "req_pool_indices_cpu", None)
    if rows_cpu is None or _on_device(rows_cpu):
        return None
    cols = getattr(batch, "seq_lens_cpu", None)
    if getattr(getattr(batch, "model_config", None), "is_encoder_decoder", True) or _on_device(cols):
        cols = None
    return rows, rows_cpu, cols


def _batch_alloc(inner: Callable[..., Any], *, before: bool) -> Callable[..., Any]:
    """``before``: the batch's requests are gathered before the allocation (a decode batch: its
    row write happens inside, judged against them); else after it (an extend batch: its new
    requests get their rows, and a retracted one its new key, inside)."""

    def alloc(batch: Any, *args: Any, **kwargs: Any) -> Any:
        guard = getattr(getattr(batch, "req_to_token_pool", None), "kvguard_guard", None)
        if guard is not None:
            guard._readers = guard._reader_rows = None
            if before and guard._suspects:  # (_batch_reqs gathers nothing without suspects)
                guard._batch_reqs(batch.reqs)
            if before and _on_device(getattr(batch, "req_pool_indices", None)):
                guard._decode_rows_host = _decode_rows_on_host(batch)
        try:
            out = inner(batch, *args, **kwargs)
        except BaseException:
            if guard is not None:
                guard._readers = guard._reader_rows = None
                guard._written_slots = None
            raise
        finally:
            if guard is not None:
                guard._writers = None
                if guard._decode_rows_host is not None:
                    guard._decode_rows_host = None
        if guard is not None and before and guard._written_slots is not None:
            # The row write's slots were copied from the device: the forward reads that copy.
            written, guard._written_slots = guard._written_slots, None
            guard._note_loc(out, written)
        if guard is not None and not before:
            if guard._suspects:
                guard._batch_reqs(batch.reqs)
            guard._writers = None
        if guard is not None and guard._readers is not None:
            # The rows the batch's forward will read, so the readers are used for that forward
            # only (alloc_for_extend returns them; a decode batch has them already).
            rows = out[2] if isinstance(out, tuple) and len(out) == 3 else batch.req_pool_indices
            guard._reader_rows = _flat(rows).astype(np.int64, copy=True)
        return out

    return alloc



_PREALLOC_HOOKED = False


def _hook_decode_prealloc() -> None:
    """A PD decode scheduler preallocates a request's pages before its transfer
    (``DecodePreallocQueue._pre_alloc``): ``disaggregation.decode.alloc_for_decode_prealloc``
    allocates them (the allocator's decision) and ``_pre_alloc`` then writes them into the
    request's row. Wrapped once per process: the guard of the ``ReqToTokenPool`` it is given
    claims the allocated pages for the request as they are allocated, so the row write that
    follows is judged against them (a row write that names other pages is refused on the
    request, and the pages it was given are its own, returned when it is released)."""
    global _PREALLOC_HOOKED
    if _PREALLOC_HOOKED:
        return
    try:
        from sglang.srt.disaggregation import decode
    except ImportError:  # an SGLang without PD
        return
    inner = getattr(decode, "alloc_for_decode_prealloc", None)
    if inner is None:
        return

    def alloc_for_decode_prealloc(allocator: Any, *args: Any, **kwargs: Any) -> Any:
        kv_loc = inner(allocator, *args, **kwargs)
        pool = kwargs.get("req_to_token_pool")
        guard = getattr(pool, "kvguard_guard", None)
        req = kwargs.get("req")
        if guard is not None and req is not None and kv_loc is not None:
            guard._preallocated(req, kv_loc)
        return kv_loc

    decode.alloc_for_decode_prealloc = alloc_for_decode_prealloc
    _PREALLOC_HOOKED = True


STREAMING: list[Any] = []
"""The guard whose scheduler's ``stream_output`` is running (kvguard's hook pushes it, innermost
last): the accumulator's ``to_payload`` is judged by it."""

_PAYLOAD_HOOKED = False


def _hook_output_payload() -> bool:
    """SGLang's ``stream_output`` passes a decode batch's every request to its accumulator, which
    takes (``accept``) only those whose output leaves now: finished, streamed at their interval,
    or a non-streamed one every ``SGLANG_FORCE_STREAM_INTERVAL`` tokens. Its ``to_payload``, once
    per ``stream_output``, is wrapped once per process: the guard in :data:`STREAMING` checks
    the rows of exactly the requests SGLang is sending (``acc.output_reqs``), before the payload
    is built (:meth:`kvguard.sglang.Guard._before_payload`), instead of every request's row each
    step. Returns whether it is hooked (False: an SGLang without this accumulator; the
    ``stream_output`` hook then checks every request it is given, as before)."""
    global _PAYLOAD_HOOKED
    if _PAYLOAD_HOOKED:
        return True
    try:
        from sglang.srt.managers.scheduler_components import output_streamer

        cls = output_streamer._GenerationStreamAccumulator
        inner = cls.to_payload
        fields = cls.__dataclass_fields__
    except (ImportError, AttributeError):
        return False
    if "output_reqs" not in fields or "rids" not in fields:
        return False

    def to_payload(acc: Any, *args: Any, **kwargs: Any) -> Any:
        if STREAMING and acc.output_reqs:
            STREAMING[-1]._before_payload(acc)
        return inner(acc, *args, **kwargs)

    cls.to_payload = to_payload
    _PAYLOAD_HOOKED = True
    return True
