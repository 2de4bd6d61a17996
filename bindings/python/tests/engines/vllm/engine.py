"""A vLLM engine without a model, on CPU: vLLM 0.33's real v1 Scheduler, KVCacheManager,
BlockPool, InputBatch and BlockTable, driven the way EngineCore and the GPU model runner drive
them, with a token-id "KV cache" standing in for the model.

Only bindings/python/bench/vllm_step.py uses it (its steps are timed part by part, which needs a
loop of its own): it re-implements EngineCore's synchronous step and the runner's
``_update_states``. The tests drive vLLM's own EngineCore and runner (real_engine.py).

The stand-in model writes each scheduled token's id into its slot (through the step's slot
mapping) and "attends" by reading every position below the sequence length back through the
block-table row; the next token is a hash of what it read. So a wrong block table changes the
output, and ``oracle_errors`` (reads that differ from the request's real tokens) is the ground
truth of which request read what it should not, independent of kvguard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch

# The tiny model and its vocabulary: the real-engine harness's, one definition for both.
from real_engine import EOS, VOCAB, model_dir  # noqa: E402


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    prefix_caching: bool = True
    chunked_prefill: bool = True


@cache
def vllm_config(cfg: EngineConfig):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(
        model=model_dir(), skip_tokenizer_init=True, max_model_len=cfg.max_model_len, dtype="float32", seed=0
    )
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=cfg.chunked_prefill,
        async_scheduling=False,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.prefix_caching)
    cache_config.num_gpu_blocks = cfg.num_blocks
    return VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache_config, device_config=DeviceConfig("cpu")
    )


@dataclass
class Finished:
    tokens: list[int]
    reason: str
    error: str | None


@dataclass
class Engine:
    """One engine: ``add`` requests, ``step`` until ``idle``. ``guarded``: the kvguard hooks are
    expected to be installed (``kvguard.vllm.install``) and the worker check runs each step."""

    cfg: EngineConfig = field(default_factory=EngineConfig)
    guarded: bool = True

    def __post_init__(self) -> None:
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.utils.hashing import sha256

        cfg = self.cfg
        vc = vllm_config(cfg)
        spec = FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
        kv = KVCacheConfig(
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=cfg.block_size,
            log_stats=False,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(cfg.block_size, sha256)
        width = -(-cfg.max_model_len // cfg.block_size)
        self.input_batch = InputBatch(
            max_num_reqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            device=torch.device("cpu"),
            vocab_size=VOCAB,
            block_sizes=[cfg.block_size],
            max_num_blocks_per_req=[width],
        )
        self.kv = np.full((cfg.num_blocks, cfg.block_size), -1, dtype=np.int64)
        self.requests: dict[str, object] = {}  # worker side: CachedRequestState
        self.tokens: dict[str, list[int]] = {}  # worker side: every token id of the request
        self.finished: dict[str, Finished] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps = 0
        #: (step, request id) where the stand-in attention read something it should not.
        self.oracle_errors: list[tuple[int, str]] = []
        #: (step, StepReport) for each step the guard refused something.
        self.reports: list[tuple[int, object]] = []
        #: Hooks a test sets to inject a bug: called with the engine before the worker check.
        self.before_check = None
        #: Scheduler decisions seen: preemptions, and kvguard events by kind.
        self.preemptions = 0
        self.events: dict[str, int] = {}

    # -- client --------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        sp.update_from_generation_config({}, eos_token_id=EOS)
        req = Request(rid, list(prompt), sp, None, cache_salt=cache_salt, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        self.outputs[rid] = []

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_unfinished_requests()

    def run(self, max_steps: int = 100_000) -> None:
        while not self.idle and self.steps < max_steps:
            self.step()

    # -- one engine step ----------------------------------------------------------------------

    def step(self) -> None:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        from kvguard.vllm import hooks

        self.steps += 1
        so = self.scheduler.schedule()
        self.preemptions += len(so.preempted_req_ids or ())
        events = getattr(so, "kvguard_events", None)
        for ev in (events.early + events.late) if events else ():
            name = ev[0].name
            self.events[name] = self.events.get(name, 0) + 1
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            out = self.scheduler.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
            self._collect(out)
            return
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        if self.before_check is not None:
            self.before_check(self, so, req_ids)
        if self.guarded:
            report = hooks.worker_step(
                self, batch, so, sched, num_blocks=self.cfg.num_blocks, max_model_len=self.cfg.max_model_len
            )
            if report is not None and report.refused:
                self.reports.append((self.steps, report))
        sampled = self._forward(req_ids, sched)
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        if self.guarded:
            mro = hooks.annotate_output(self, mro)
        out = self.scheduler.update_from_output(so, mro)
        # The worker keeps the tokens it sampled (vLLM's runner does so on the GPU).
        for rid, toks in zip(req_ids, mro.sampled_token_ids):
            if toks and rid in self.tokens:
                self.tokens[rid].extend(toks)
                self.requests[rid].output_token_ids.extend(toks)
        self._collect(out)

    def _collect(self, out) -> None:
        for outputs in out.values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    err = o.error.message if getattr(o, "error", None) is not None else None
                    self.finished[o.request_id] = Finished(
                        list(self.outputs[o.request_id]), str(o.finish_reason), err
                    )

    def _update_states(self, so) -> None:
        """What GPUModelRunner._update_states does to the persistent batch."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.tokens.pop(rid, None)
            batch.remove_request(rid)
        scheduled = so.num_scheduled_tokens.keys()
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        for rid in batch.req_id_to_index.keys() - (scheduled - resumed):
            batch.remove_request(rid)
        to_add = []
        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=new.mm_features,
                sampling_params=new.sampling_params,
                generator=None,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            to_add.append(state)
        data = so.scheduled_cached_reqs
        for i, rid in enumerate(data.req_ids):
            state = self.requests[rid]
            computed = data.num_computed_tokens[i]
            new_blocks = data.new_block_ids[i]
            state.num_computed_tokens = computed
            if rid in resumed:
                state.block_ids = new_blocks
            elif new_blocks is not None:
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            row = batch.req_id_to_index.get(rid)
            if row is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = computed
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, row)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _forward(self, req_ids: list[str], sched: np.ndarray) -> list[list[int]]:
        """The stand-in model: write the step's tokens through the slot mapping, then read every
        position below the sequence length back through the row; sample when the request's known
        tokens are all computed."""
        batch = self.input_batch
        table = batch.block_table.block_tables[0]
        bt = table.block_table.np
        bs = self.cfg.block_size
        sampled: list[list[int]] = []
        rows = []
        manager = self.scheduler.kv_cache_manager
        for i, rid in enumerate(req_ids):
            c = int(batch.num_computed_tokens_cpu[i])
            n = int(sched[i])
            toks = self.tokens[rid]
            pos = np.arange(c, c + n)
            self.kv[bt[i, pos // bs], pos % bs] = np.asarray(toks[c : c + n], dtype=np.int64)
            rows.append((i, rid, c + n, len(toks)))
        for i, rid, seq_len, known in rows:
            pos = np.arange(seq_len)
            blocks = bt[i, : -(-seq_len // bs)]
            read = self.kv[bt[i, pos // bs], pos % bs]
            truth = np.asarray(self.tokens[rid][:seq_len], dtype=np.int64)
            # Ground truth, independent of kvguard: the request reads (and wrote) only through
            # the blocks the scheduler gave it, and reads back exactly its own tokens.
            owned = set(manager.get_block_ids(rid)[0]) if rid in self.scheduler.requests else set()
            if not np.array_equal(read, truth) or not set(blocks.tolist()) <= owned:
                self.oracle_errors.append((self.steps, rid))
            if seq_len >= known:
                h = int(((read + 7) * (pos * 2 + 1) % 1_000_003).sum())
                sampled.append([h % (VOCAB - 1)])
            else:
                sampled.append([])
        return sampled
