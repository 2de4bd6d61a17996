"""vLLM 0.33's Model Runner V2 on CPU, under vLLM's own EngineCore, with only the model stood in.

vLLM runs V2 on CPU itself: its CPU worker builds ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``
(a subclass of V2's ``GPUModelRunner``) whenever ``VllmConfig.use_v2_model_runner`` holds, after
importing ``vllm.v1.worker.cpu.shm`` (its own stand-ins for CUDA streams and events, pinned memory
and V2's UVA buffers, as host tensors). This module does the same, in a process of its own:

- ``TRITON_INTERPRET=1``: V2's Triton kernels (the staged block-table writes,
  ``gather_block_tables``, ``compute_slot_mappings``, positions, input ids, the sampled-token
  counts, ``post_update``) run in Triton's interpreter on the host tensors; vLLM's CPU platform
  runs them with triton-cpu, which this venv does not have;
- ``CUDA_VISIBLE_DEVICES=`` (empty): vLLM's Triton detection then keeps Triton without a driver,
  so ``use_v2_model_runner`` is vLLM's own default decision (True where Triton runs).

Real (vLLM's code, unmodified): ``EngineCore`` and its step loop (``step_with_batch_queue`` under
async scheduling, ``step`` otherwise), the schedulers, ``KVCacheManager``, ``BlockPool``, and V2's
``CPUModelRunner.execute_model`` / ``sample_tokens`` end to end: request states, ``BlockTables``
(staged writes applied by its kernel), ``prepare_inputs``, ``prepare_attn`` (the gather and slot
kernels), the attention metadata (``CPUAttentionMetadataBuilder.build``), the sampler's own
``__call__`` (sampled-token counts: a chunked prefill samples nothing), ``postprocess_sampled``,
``AsyncOutput``. kvguard is installed as its plugin installs it.

Stood in:

- the **executor** (``real_engine.executor_class``: in-process, completed futures, one
  full-attention layer reported instead of profiling a model, and a sliding-window one for a
  hybrid model, whose tiny Llama then has that layer too: :func:`hybrid_model_dir`);
- the attention-metadata builder's compiled op ``_C.get_scheduler_metadata``
  (``vllm._custom_ops.cpu_attn_get_scheduler_metadata``), absent from this CUDA wheel of vLLM: an
  empty tensor (it tunes vLLM's CPU attention kernel, which the stand-in model does not run);
- the **model** (:class:`StandInModel`, put in place of ``runner.model`` after ``load_model``
  built the real one, whose attention layers V2's KV cache set-up needs): it takes the attention
  metadata V2 built for the step from vLLM's forward context and writes each token's id through
  that metadata's ``slot_mapping`` (V2's ``compute_slot_mappings``) into a token-id "KV cache",
  then reads every position attention reads (``seq_lens``) back through its ``block_table``
  (V2's ``gather_block_tables``); the next token is a hash of what was read;
- the **sampler**'s sampling (``Sampler.sample``): returns the stand-in model's tokens (the rest
  of V2's ``Sampler.__call__`` runs).

The oracle, independent of kvguard: a request reads back exactly its own tokens (its prompt,
then what was sampled for it), only through blocks the scheduler gave it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if "vllm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("v2_engine must be imported before vLLM (its settings are read at vLLM's import)")
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm.v1.worker.cpu.shm  # noqa: E402,F401  vLLM's CPU worker imports it first, as here

import real_engine  # noqa: E402
from real_engine import EOS, VOCAB, RealConfig, RealEngine, StandInWorker  # noqa: E402,F401


def _no_scheduler_metadata(**kwargs: Any) -> torch.Tensor:
    """Stands in for ``_C.get_scheduler_metadata`` (vLLM's compiled CPU attention op)."""
    return torch.empty(0, dtype=torch.int32)


import vllm._custom_ops as _ops  # noqa: E402

_ops.cpu_attn_get_scheduler_metadata = _no_scheduler_metadata

# Triton's interpreter checks every 32-bit integer op for overflow in Python (a debug aid that a
# compiled kernel without debug does not run): a third of a V2 step here. The kernels' results
# do not depend on it.
import dataclasses  # noqa: E402

import triton.runtime.interpreter as _interpreter  # noqa: E402

_interpreter.interpreter_builder.options = dataclasses.replace(
    _interpreter.interpreter_builder.options, sanitize_overflow=False
)


class StandInModel(torch.nn.Module):
    """In place of the model: KV writes through the metadata's slot mapping, reads through its
    block table (see the module doc)."""

    def __init__(self, worker: V2Worker, hidden_size: int) -> None:
        super().__init__()
        self.worker = worker
        self.hidden_size = hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.worker._forward(input_ids, positions)
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden_states.shape[0], VOCAB)


class V2Worker(StandInWorker):
    """One worker: vLLM's V2 ``CPUModelRunner`` with the model and its sampling stood in."""

    def __init__(self, vllm_config: Any, rc: RealConfig) -> None:
        super().__init__(vllm_config, rc)
        #: Per request, its tokens by position (prompt, then each sampled token): the truth.
        self.truth: dict[str, list[int]] = {}
        self.layers: list[str] = []
        self._batch: Any = None
        self._next: np.ndarray | None = None
        #: Set by a test: called with (worker, input_batch) after V2's prepare_inputs.
        self.after_prepare_inputs: Any = None
        #: Sliding-window rows V2's gather handed attention with every entry wholly before the
        #: window of the step's first token nulled (what kvguard's window check must accept).
        self.window_rows_nulled = 0

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner
        from vllm.v1.worker.worker_base import record_kv_cache_layout

        real_engine._init_distributed(self.vllm_config)
        record_kv_cache_layout(self.vllm_config.cache_config, "NHD")  # as EngineCore's workers do
        config = kv_cache_configs[0]
        with set_current_vllm_config(self.vllm_config):
            self.runner = CPUModelRunner(self.vllm_config, torch.device("cpu"))
            self.runner.load_model()
            self.runner.initialize_kv_cache(config)
        runner = self.runner
        runner.model = StandInModel(self, self.vllm_config.model_config.get_hidden_size())
        runner.sampler.sample = self._sample
        prepare_inputs = runner.prepare_inputs

        def observed_prepare_inputs(*args: Any, **kwargs: Any) -> Any:
            batch = prepare_inputs(*args, **kwargs)
            self._batch = batch
            if self.after_prepare_inputs is not None:
                self.after_prepare_inputs(self, batch)
            return batch

        runner.prepare_inputs = observed_prepare_inputs
        self.layers = [g.layer_names[0] for g in config.kv_cache_groups]
        self.kv = [np.full((config.num_blocks, self.rc.block_size), -1, dtype=np.int64) for _ in config.kv_cache_groups]
        self.windows = [
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
            for g in config.kv_cache_groups
        ]

    def execute_model(self, scheduler_output: Any) -> Any:
        from vllm.config import set_current_vllm_config

        self.steps += 1
        events = getattr(scheduler_output, "kvguard_events", None)
        for ev in (events.early + events.late) if events else ():
            self.events[str(ev[0])] = self.events.get(str(ev[0]), 0) + 1
        for new in scheduler_output.scheduled_new_reqs:
            self.hits.setdefault(new.req_id, new.num_computed_tokens)
            tokens = list(new.prefill_token_ids)
            known = self.truth.get(new.req_id, [])
            if known[: len(tokens)] != tokens[: len(known)]:
                self.oracle_errors.append((self.steps, new.req_id))
            self.truth[new.req_id] = tokens  # a resumed request: prompt and outputs so far
        with set_current_vllm_config(self.vllm_config):
            out = self.runner.execute_model(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            self.idle_steps += 1
        self._note_refusals()
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.v1.outputs import AsyncModelRunnerOutput

        with set_current_vllm_config(self.vllm_config):
            out = self.runner.sample_tokens(grammar_output)
        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()  # what UniProcExecutor does
        # Refusals found when the output is read (the device check's, drained there) belong to
        # this step too.
        self._note_refusals()
        return out

    # The stand-ins.

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        batch = self._batch
        n, total = batch.num_reqs, batch.num_tokens
        bs = self.rc.block_size
        ids = input_ids[:total].numpy().astype(np.int64)
        pos = positions[:total].numpy().astype(np.int64)
        qsl = batch.query_start_loc_np[: n + 1]
        req_ids = list(batch.req_ids[:n])
        meta = get_forward_context().attn_metadata
        metas = [meta[layer] for layer in self.layers]
        # The tokens V2 feeds are each request's own (else the harness, not kvguard, is wrong).
        for i, rid in enumerate(req_ids):
            truth = self.truth[rid]
            for k in range(int(qsl[i]), int(qsl[i + 1])):
                if pos[k] >= len(truth) or truth[pos[k]] != ids[k]:
                    self.oracle_errors.append((self.steps, rid))
                    break
        # Writes: through the slot mapping attention gets (V2's compute_slot_mappings).
        for g, m in enumerate(metas):
            slots = m.slot_mapping[:total].numpy()
            ok = slots >= 0
            self.kv[g].reshape(-1)[slots[ok]] = ids[ok]
        # Reads: every position attention reads, through the block table it gets (V2's gather).
        owned_by = self.scheduler.kv_cache_manager.get_block_ids if self.scheduler is not None else None
        nxt = np.zeros(n, dtype=np.int64)
        computed = batch.num_computed_tokens_np[:n]
        for i, rid in enumerate(req_ids):
            seq_len = int(metas[0].seq_lens[i])
            truth = np.asarray(self.truth[rid][:seq_len], dtype=np.int64)
            wrong = seq_len != int(computed[i] + batch.num_scheduled_tokens[i])
            full_read = None
            for g, m in enumerate(metas):
                row = m.block_table[i].numpy()
                window = self.windows[g]
                start = 0 if window is None else max(0, int(computed[i]) - window + 1)
                if start >= bs and not row[: start // bs].any():
                    self.window_rows_nulled += 1
                p = np.arange(start, seq_len)
                blocks = row[p // bs]
                read = self.kv[g][blocks, p % bs]
                if not np.array_equal(read, truth[start:]):
                    wrong = True
                if owned_by is not None and rid in self.scheduler.requests:
                    if not set(np.unique(blocks).tolist()) <= set(owned_by(rid)[g]) - {0}:
                        wrong = True
                if window is None:
                    full_read = read
            if wrong:
                self.oracle_errors.append((self.steps, rid))
            q = np.arange(len(full_read))
            nxt[i] = int(((full_read + 7) * (q * 2 + 1) % 1_000_003).sum()) % (VOCAB - 1)
        self._next = nxt

    def _sample(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``Sampler.sample``: the stand-in model's tokens; a request that finishes its prompt or
        decodes this step gets its token as its next position's truth."""
        batch = self._batch
        n = batch.num_reqs
        seq_lens = batch.num_computed_tokens_np[:n] + batch.num_scheduled_tokens[:n]
        for i, rid in enumerate(batch.req_ids[:n]):
            if seq_lens[i] >= batch.prefill_len_np[i] and seq_lens[i] == len(self.truth[rid]):
                self.truth[rid].append(int(self._next[i]))
        return torch.from_numpy(self._next.copy()), logits


def hybrid_model_dir(window: int) -> str:
    """A local folder holding only a tiny hybrid Llama config.json: layer 0 full attention, layer
    1 a ``window``-token sliding window (``layer_types``, which vLLM's Llama reads to give that
    layer's ``Attention`` its ``per_layer_sliding_window``; so its KV cache spec is a
    ``SlidingWindowSpec`` and V2 builds that group's attention backend from a real layer)."""
    from transformers import LlamaConfig

    d = Path(os.environ.get("KVGUARD_VLLM_MODEL_DIR", "/tmp/kvguard-vllm-tiny-llama")).with_name(
        f"kvguard-vllm-tiny-hybrid-llama-{window}"
    )
    if not (d / "config.json").exists():
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=window,
        ).save_pretrained(d)
    return str(d)


def v2_engine(rc: RealConfig) -> RealEngine:
    """vLLM's EngineCore with ``real_engine``'s stand-in executor, whose worker is a
    :class:`V2Worker`; for a hybrid ``rc`` (``sliding_window``), the model is
    :func:`hybrid_model_dir`'s, whose second layer is that window (the executor reports the same
    two layers' specs)."""
    saved = real_engine.StandInWorker, real_engine.model_dir
    real_engine.StandInWorker = V2Worker
    if rc.sliding_window is not None:
        real_engine.model_dir = lambda: hybrid_model_dir(rc.sliding_window)
    try:
        return RealEngine(rc)
    finally:
        real_engine.StandInWorker, real_engine.model_dir = saved
