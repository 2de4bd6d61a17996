"""The worker side on vLLM's V1 model runner (``GPUModelRunner``; ``CPUModelRunner`` is a
subclass): each step's check in ``_prepare_inputs`` (after ``_update_states`` built the
persistent batch, before ``commit_block_table`` copies it), the events of a step with no tokens,
and the refusals put on the step's output for the scheduler. Model Runner V2 checks through
:mod:`kvguard.vllm.runner_v2` and puts its refusals on the output the same way
(:func:`annotate_output`)."""

from __future__ import annotations

import copy
import threading
from typing import Any

from .attach import installed_mode, unsupported, wrap
from .guard import StepGuard, StepReport
from .support import context_parallelism_of, fault_tolerance_of, group_windows, speculation_of


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
    pend(owner, guard, report)
    return report


#: Guards the refusals awaiting a runner's output: vLLM may read a step's output (and drain the
#: device's verdicts into them) in another thread than the one checking the next step.
_PENDING = threading.Lock()


def pend(owner: Any, guard: StepGuard, report: StepReport) -> None:
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
        tolerance = fault_tolerance_of(vllm_config)
        if windows is None:
            pass
        elif speculation is not None:
            unsupported(speculation)
        elif parallelism is not None:
            # The worker's rows hold per-rank blocks while the scheduler's events name blocks of
            # block_size x ranks tokens: checked as they are, every request would be refused.
            unsupported(parallelism)
        elif tolerance is not None:
            unsupported(tolerance)
        elif len(windows) != len(tables):
            unsupported(f"{len(tables)} block tables for {len(windows)} KV cache groups")
        elif len(sizes) != 1:
            unsupported(f"KV cache groups of different block sizes {sorted(sizes)}")
        else:
            guard = StepGuard(
                num_blocks,
                tables[0].block_size,
                max_model_len,
                installed_mode() or "enforce",
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
    pend(owner, guard, report)


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
        pend(owner, guard, guard.device_refused(*device.drain_through(guard, step)))
    return _take_pending(owner)


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def check_config(runner: Any) -> None:
        if runner.kv_cache_config is not None and not runner.__dict__.get("_kvguard_checked_config"):
            runner._kvguard_checked_config = True
            if getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
                unsupported("a KV connector (kv_transfer_config): its imports are not recorded")
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

    wrap(GPUModelRunner, "_update_states", update_states)
    wrap(GPUModelRunner, "_prepare_inputs", prepare_inputs)
    wrap(GPUModelRunner, "execute_model", annotating)
    wrap(GPUModelRunner, "sample_tokens", annotating)

