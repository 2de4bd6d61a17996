"""vLLM 0.33's own engine on CPU, with only the model stood in.

Real (vLLM's code, unmodified): ``EngineCore`` and its step loop (``step``, or
``step_with_batch_queue`` under async scheduling, vLLM's default on GPUs: a batch queue of 2, step
N+1 scheduled and executed before step N's output is processed), the ``AsyncScheduler`` /
``Scheduler``, ``KVCacheManager``, ``BlockPool``, the KV cache coordinator (hybrid too), the
request block hasher, and the V1 model runner (``CPUModelRunner``, a ``GPUModelRunner``) with its
own ``_update_states`` (the persistent ``InputBatch`` and ``MultiGroupBlockTable``) and
``_prepare_inputs`` (positions, ``commit_block_table``, the slot mapping, the discard mask).
kvguard is installed the way its plugin installs it, on those classes.

Stood in:

- the **executor** (:func:`executor_class`) runs the worker in-process and returns completed
  futures (what ``UniProcExecutor`` does on one device); it reports a KV cache spec of one
  full-attention layer (and one sliding-window layer for a hybrid model) instead of profiling a
  model;
- the **model**: :meth:`StandInWorker.execute_model` calls the runner's ``_update_states`` and
  ``_prepare_inputs`` as ``GPUModelRunner.execute_model`` does (and returns vLLM's empty output
  before ``_prepare_inputs`` when nothing is scheduled, as it does), then, instead of vLLM's
  attention metadata and forward, writes each scheduled token's id through the runner's slot
  mapping into a token-id "KV cache" per KV cache group and reads every position attention
  would read back through the committed block-table rows. ``sample_tokens`` samples a hash of
  what was read for the rows the runner's own discard mask keeps, and updates the runner's
  request state as ``_bookkeeping_sync`` does (real token ids rather than the async
  placeholders); kvguard's refusals are put on the output by ``kvguard.vllm.hooks.annotate_output``,
  what its wrapper on ``GPUModelRunner.sample_tokens`` runs;
- the **slot-mapping kernel** (Triton, which vLLM's CPU platform does not run): the same formula
  in torch (``block_table[req, pos // block_size] * block_size + pos % block_size``, padding -1).

The oracle, independent of kvguard: a request reads back exactly its own tokens, and only
through blocks the scheduler gave it (``oracle_errors``).
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch


VOCAB = 512
EOS = VOCAB - 1

FULL_LAYER = "model.layers.0.self_attn.attn"
WINDOW_LAYER = "model.layers.1.self_attn.attn"


@cache
def model_dir() -> str:
    """A local folder holding only a tiny Llama config.json (no hub, no weights)."""
    from transformers import LlamaConfig

    d = Path(os.environ.get("KVGUARD_VLLM_MODEL_DIR", "/tmp/kvguard-vllm-tiny-llama"))
    if not (d / "config.json").exists():
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        ).save_pretrained(d)
    return str(d)


@dataclass
class Finished:
    tokens: list[int]
    reason: str
    error: str | None


@dataclass(frozen=True)
class RealConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    prefix_caching: bool = True
    async_scheduling: bool = True
    #: A hybrid model: a sliding-window layer (this many tokens) beside the full-attention one.
    sliding_window: int | None = None
    #: A chunked-local-attention layer (chunks of this many tokens) beside the full-attention one.
    attention_chunk: int | None = None
    #: vLLM's ``speculative_config`` (e.g. ngram), or None.
    speculative: Any = None
    #: The block tables' device copies apart from the host rows, as on a GPU (CPUModelRunner
    #: makes them one tensor): attention and the slot mapping read what vLLM committed
    #: (``commit_block_table``), not the host rows.
    device_rows: bool = False


# -- the slot-mapping kernel, in torch --------------------------------------------------------


class _SlotMappingInTorch:
    """vLLM's ``_COMPUTE_SLOT_MAPPING_KERNEL`` (Triton) as torch on CPU: same inputs, same
    output (no context parallelism)."""

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(
        self,
        num_reqs: int,
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        block_table_stride: int,
        slot_mapping: torch.Tensor,
        kv_cache_block_size: int,
        total_cp_world_size: int,
        total_cp_rank: int,
        cp_kv_cache_interleave_size: int,
    ) -> None:
        assert total_cp_world_size == 1, "the stand-in has no context parallelism"
        qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
        req = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])
        pos = positions[:num_tokens].to(torch.int64)
        blocks = block_table[req, pos // kv_cache_block_size].to(torch.int64)
        slot_mapping[:num_tokens] = blocks * kv_cache_block_size + pos % kv_cache_block_size
        slot_mapping[num_tokens:max_num_tokens] = -1


def _use_torch_slot_mapping() -> None:
    import vllm.v1.worker.block_table as block_table

    if not isinstance(block_table._COMPUTE_SLOT_MAPPING_KERNEL, _SlotMappingInTorch):
        block_table._COMPUTE_SLOT_MAPPING_KERNEL = _SlotMappingInTorch()


def _init_distributed(vllm_config: Any) -> None:
    """vLLM's process groups for one rank (gloo), once per process: the runner asks for them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state._PP is not None:
        return
    store = tempfile.mktemp(prefix="kvguard-vllm-dist-")
    atexit.register(lambda: os.path.exists(store) and os.unlink(store))
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method="file://" + store,
            local_rank=0,
            backend="gloo",
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)


# -- the worker -------------------------------------------------------------------------------


class StandInWorker:
    """One worker: vLLM's V1 model runner with the model stood in (see the module doc)."""

    #: Set by the test before the engine is built: a hook called with (worker, scheduler_output)
    #: after the runner's ``_update_states`` and before ``_prepare_inputs`` (to inject a bug).
    before_prepare: Any = None

    def __init__(self, vllm_config: Any, rc: RealConfig) -> None:
        self.vllm_config = vllm_config
        self.rc = rc
        self.runner: Any = None
        self.kv: list[np.ndarray] = []
        self.windows: list[int | None] = []
        self.steps = 0
        self.oracle_errors: list[tuple[int, str]] = []
        self.refused: list[tuple[int, str, Any]] = []
        #: kvguard's events seen, by kind; steps that scheduled no tokens; each request's
        #: prefix-cache hit (tokens computed when first scheduled).
        self.events: dict[str, int] = {}
        self.idle_steps = 0
        self.hits: dict[str, int] = {}
        self.scheduler: Any = None  # set by RealEngine: the oracle reads the scheduler's truth
        self._last: tuple[list[str], np.ndarray, list[np.ndarray]] | None = None

    # The calls EngineCore makes through the executor at start-up.

    def specs(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

        rc = self.rc
        out = {FULL_LAYER: FullAttentionSpec(block_size=rc.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)}
        if rc.sliding_window is not None:
            out[WINDOW_LAYER] = SlidingWindowSpec(
                block_size=rc.block_size,
                num_kv_heads=2,
                head_size=32,
                dtype=torch.float32,
                sliding_window=rc.sliding_window,
            )
        if rc.attention_chunk is not None:
            out[WINDOW_LAYER] = ChunkedLocalAttentionSpec(
                block_size=rc.block_size,
                num_kv_heads=2,
                head_size=32,
                dtype=torch.float32,
                attention_chunk_size=rc.attention_chunk,
            )
        return out

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return self.specs()

    def determine_available_memory(self) -> int:
        specs = self.specs()
        return self.rc.num_blocks * sum(s.page_size_bytes for s in specs.values())

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, *args: Any) -> None:
        pass

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        _use_torch_slot_mapping()
        _init_distributed(self.vllm_config)
        config = kv_cache_configs[0]
        self.runner = CPUModelRunner(self.vllm_config, torch.device("cpu"))
        # What initialize_kv_cache does for the batch (the attention backends are not built:
        # the stand-in model needs none).
        self.runner.kv_cache_config = config
        self.runner.may_reinitialize_input_batch(config)
        # A new InputBatch (several groups): its device buffers are the host ones on CPU, as
        # CPUModelRunner makes them at construction.
        self.runner._postprocess_tensors()
        if self.rc.device_rows:
            for table in self.runner.input_batch.block_table.block_tables:
                table.block_table.gpu = table.block_table.cpu.clone()
                table.slot_mapping.gpu = table.slot_mapping.cpu.clone()
        self.kv = [np.full((config.num_blocks, self.rc.block_size), -1, dtype=np.int64) for _ in config.kv_cache_groups]
        self.windows = [
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
            for g in config.kv_cache_groups
        ]

    def compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(0.0, 0.0)

    # The step.

    def execute_model(self, scheduler_output: Any) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        self.steps += 1
        events = getattr(scheduler_output, "kvguard_events", None)
        for ev in (events.early + events.late) if events else ():
            self.events[str(ev[0])] = self.events.get(str(ev[0]), 0) + 1
        for new in scheduler_output.scheduled_new_reqs:
            self.hits.setdefault(new.req_id, new.num_computed_tokens)
        runner = self.runner
        runner._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            self.idle_steps += 1
            self._note_refusals()
            return EMPTY_MODEL_RUNNER_OUTPUT  # as GPUModelRunner.execute_model does
        if self.before_prepare is not None:
            self.before_prepare(self, scheduler_output)
        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        sched = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        runner._prepare_inputs(scheduler_output, sched)
        self._note_refusals()
        self._forward(req_ids, sched)
        return None

    def _note_refusals(self) -> None:
        """Keeps what kvguard's check refused in this step (read off the guard's last report)."""
        guard = self.runner.__dict__.get("_kvguard")
        report = getattr(guard, "last_report", None)
        if report is not None and report.refused:
            self.refused.extend((self.steps, rid, r) for rid, r in report.refused.items())
            guard.last_report = None

    def _truth(self, rid: str) -> list[int]:
        state = self.runner.requests[rid]
        return list(state.prompt_token_ids) + list(state.output_token_ids)

    def _forward(self, req_ids: list[str], sched: np.ndarray) -> None:
        runner = self.runner
        batch = runner.input_batch
        bs = self.rc.block_size
        n = len(req_ids)
        total = int(sched.sum())
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        req_of_token = np.repeat(np.arange(n), sched)
        pos = np.concatenate([np.arange(c, c + s) for c, s in zip(computed, sched)])
        truths = [self._truth(rid) for rid in req_ids]
        token = np.array([truths[r][p] for r, p in zip(req_of_token, pos)], dtype=np.int64)
        tables = batch.block_table.block_tables
        # Writes: through each group's slot mapping, as the attention backend's KV write does.
        for g, table in enumerate(tables):
            slots = table.slot_mapping.gpu[:total].numpy()
            ok = slots >= 0
            self.kv[g].reshape(-1)[slots[ok]] = token[ok]
        # Reads: every position attention reads, through the committed rows (the device copy).
        owned_by = self.scheduler.kv_cache_manager.get_block_ids if self.scheduler is not None else None
        reads = []
        for i, rid in enumerate(req_ids):
            seq_len = int(computed[i] + sched[i])
            truth = np.asarray(truths[i][:seq_len], dtype=np.int64)
            wrong = False
            full_read = None
            for g, table in enumerate(tables):
                row = table.block_table.gpu[i].numpy()
                window = self.windows[g]
                # A sliding window: what attention of the step's first token reads on (the
                # later tokens read less).
                start = 0 if window is None else max(0, int(computed[i]) - window + 1)
                p = np.arange(start, seq_len)
                blocks = row[p // bs]
                read = self.kv[g][blocks, p % bs]
                if not np.array_equal(read, truth[start:]):
                    wrong = True
                if owned_by is not None and rid in self.scheduler.requests:
                    # Through blocks the scheduler gave the request, never the null block (a
                    # sliding window's list holds it where it dropped blocks, before the window).
                    if not set(np.unique(blocks).tolist()) <= set(owned_by(rid)[g]) - {0}:
                        wrong = True
                if window is None:
                    full_read = read
            if wrong:
                self.oracle_errors.append((self.steps, rid))
            reads.append(full_read)
        discard = runner.discard_request_mask.np[:n].copy()
        self._last = (req_ids, discard, reads)

    def sample_tokens(self, grammar_output: Any) -> Any:
        from kvguard.vllm import hooks

        req_ids, discard, reads = self._last
        self._last = None

        def token_of(i: int) -> int:
            read = reads[i]
            p = np.arange(len(read))
            return int(((read + 7) * (p * 2 + 1) % 1_000_003).sum()) % (VOCAB - 1)

        return hooks.annotate_output(self.runner, self.sampled(req_ids, discard, token_of))

    def sampled(self, req_ids: list[str], discard: np.ndarray, token_of: Callable[[int], int]) -> Any:
        """The step's ``ModelRunnerOutput``: a token ``token_of(i)`` for each row ``i`` not
        discarded, recorded on the host as ``_bookkeeping_sync`` records it (real ids where async
        scheduling keeps placeholders)."""
        from vllm.v1.outputs import ModelRunnerOutput

        runner = self.runner
        batch = runner.input_batch
        sampled: list[list[int]] = []
        for i, rid in enumerate(req_ids):
            if discard[i]:
                sampled.append([])
                continue
            tok = token_of(i)
            sampled.append([tok])
            end = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, end] = tok
            batch.num_tokens_no_spec[i] = end + 1
            runner.requests[rid].output_token_ids.append(tok)
        return ModelRunnerOutput(
            req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )


# -- the executor -----------------------------------------------------------------------------


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def executor_class(rc: RealConfig) -> type:
    """The stand-in executor: a subclass of vLLM's ``Executor`` whose one worker is a
    :class:`StandInWorker` for ``rc``, run in-process (completed futures)."""
    from vllm.v1.executor.abstract import Executor

    class Bound(Executor):
        def _init_executor(self) -> None:
            self.worker = StandInWorker(self.vllm_config, rc)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):  # noqa: ANN001
            fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
            out = [fn(*args, **(kwargs or {}))]
            return _done(out) if non_block else out

        def execute_model(self, scheduler_output, non_block=False):  # noqa: ANN001
            out = self.worker.execute_model(scheduler_output)
            return _done(out) if non_block else out

        def sample_tokens(self, grammar_output, non_block=False):  # noqa: ANN001
            out = self.worker.sample_tokens(grammar_output)
            return _done(out) if non_block else out

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return True

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    Bound.__name__ = Bound.__qualname__ = "StandInExecutor"
    return Bound


# -- the engine -------------------------------------------------------------------------------


@dataclass
class RealEngine:
    """vLLM's EngineCore with the stand-in executor: ``add`` requests, ``run`` to the end."""

    rc: RealConfig = field(default_factory=RealConfig)
    before_prepare: Any = None

    def __post_init__(self) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.core import EngineCore

        rc = self.rc
        executor = executor_class(rc)
        args = EngineArgs(
            model=model_dir(),
            skip_tokenizer_init=True,
            max_model_len=rc.max_model_len,
            dtype="float32",
            load_format="dummy",
            enable_prefix_caching=rc.prefix_caching,
            block_size=rc.block_size,
            max_num_seqs=rc.max_num_seqs,
            max_num_batched_tokens=rc.max_num_batched_tokens,
            num_gpu_blocks_override=rc.num_blocks,
            distributed_executor_backend=executor,
            seed=0,
            speculative_config=rc.speculative,
        )
        config = args.create_engine_config()
        # vLLM's CPU platform turns async scheduling off; on GPUs it is the default.
        config.scheduler_config.async_scheduling = rc.async_scheduling
        self.core = EngineCore(config, executor, log_stats=False)
        self.worker: StandInWorker = self.core.model_executor.worker
        self.worker.scheduler = self.core.scheduler
        self.worker.before_prepare = self.before_prepare
        self.finished: dict[str, Finished] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps = 0

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def guard(self) -> Any:
        return self.worker.runner.__dict__.get("_kvguard")

    @property
    def oracle_errors(self) -> list[tuple[int, str]]:
        return self.worker.oracle_errors

    @property
    def events(self) -> dict[str, int]:
        return self.worker.events

    @property
    def idle_steps(self) -> int:
        return self.worker.idle_steps

    @property
    def scheduler_hits(self) -> dict[str, int]:
        return self.worker.hits

    def refusals(self) -> list[tuple[int, str, Any]]:
        """(worker step, request id, Refusal) for each request kvguard refused, in order."""
        return list(self.worker.refused)

    def add(self, rid: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=EOS)
        req = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=list(prompt),
            mm_features=None,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=cache_salt,
            data_parallel_rank=None,
        )
        self.core.add_request(*self.core.preprocess_add_request(req))
        self.outputs[rid] = []

    @property
    def idle(self) -> bool:
        return not self.core.scheduler.has_requests() and not self.core.batch_queue

    def step(self) -> None:
        self.steps += 1
        outputs, _ = self.core.step_fn()
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    err = o.error.message if o.error is not None else None
                    self.finished[o.request_id] = Finished(list(self.outputs[o.request_id]), str(o.finish_reason), err)

    def run(self, max_steps: int = 100_000) -> None:
        while not self.idle and self.steps < max_steps:
            self.step()
