"""How far vLLM 0.33's V2 model runner runs on CPU (not a test: kvguard refuses V2 under
enforce; this records what was tried, docs/vllm.md says what it showed).

    cd bindings/python/tests/engines/vllm && VLLM_TARGET_DEVICE=cpu python v2_probe.py

Run as its own process: the settings below must be in place before vLLM is imported.

- ``TRITON_INTERPRET=1`` runs V2's Triton kernels in Triton's interpreter, on CPU tensors;
- ``CUDA_VISIBLE_DEVICES=`` (empty) keeps vLLM's Triton detection from disabling Triton on a
  machine without a driver (``vllm.triton_utils.importing`` allows no active driver then);
- ``buffer_utils.is_uva_available`` false: vLLM's own non-UVA buffers stand in for the pinned,
  device-mapped ones (CPU tensors here);
- ``torch.cuda.Stream``: a no-op stand-in (V2's runner makes one at construction).

Part 1 runs V2's ``BlockTables`` kernels on a two-group (full + sliding-window) table and prints
what attention would get. Part 2 builds V2's ``GPUModelRunner`` under vLLM's ``EngineCore`` (the
stand-in executor of real_engine.py with V2's runner in its worker) and runs its
``execute_model`` until it stops, printing the block tables and slot mappings its
``prepare_attn`` handed on.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import vllm.v1.worker.gpu.buffer_utils as buffer_utils  # noqa: E402

buffer_utils.is_uva_available = lambda: False


class _NoStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


torch.cuda.Stream = _NoStream  # type: ignore[misc]


def block_tables_kernels() -> None:
    from vllm.v1.worker.gpu.block_table import BlockTables

    bt = BlockTables(
        [16, 16],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8, 8],
        device=torch.device("cpu"),
        sliding_window_reach=[0, 47],
    )
    bt.append_block_ids(0, ([1, 2, 3, 9, 11], [4, 5, 6, 10, 12]), overwrite=True)
    bt.append_block_ids(1, ([7], [8]), overwrite=True)
    bt.apply_staged_writes()
    idx = torch.tensor([1, 0], dtype=torch.int32)
    computed = torch.tensor([70, 3, 0, 0], dtype=torch.int32)
    tables = bt.gather_block_tables(idx, 2, num_computed_tokens=computed)
    slots = bt.compute_slot_mappings(
        idx, torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([3, 70, 71]), 4
    )
    print("V2 gather_block_tables (full, sliding window):", [t.tolist() for t in tables])
    print("V2 compute_slot_mappings:", slots.tolist())


def v2_runner_under_engine_core() -> None:
    import real_engine
    from real_engine import RealConfig, RealEngine, StandInWorker
    from vllm.config import set_current_vllm_config

    class V2Worker(StandInWorker):
        def initialize_from_config(self, kv_cache_configs):  # noqa: ANN001
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner
            from vllm.v1.worker.worker_base import record_kv_cache_layout

            real_engine._init_distributed(self.vllm_config)
            record_kv_cache_layout(self.vllm_config.cache_config, "NHD")  # as EngineCore does
            with set_current_vllm_config(self.vllm_config):
                self.runner = GPUModelRunner(self.vllm_config, torch.device("cpu"))
                self.runner.load_model()
                self.runner.initialize_kv_cache(kv_cache_configs[0])
            original = self.runner.prepare_attn

            def prepare_attn(input_batch):  # noqa: ANN001
                tables, slots = original(input_batch)
                print("V2 prepare_attn handed on:", [t.tolist() for t in tables], slots.tolist())
                return tables, slots

            self.runner.prepare_attn = prepare_attn

        def execute_model(self, scheduler_output):  # noqa: ANN001
            with set_current_vllm_config(self.vllm_config):
                return self.runner.execute_model(scheduler_output)

        def sample_tokens(self, grammar_output):  # noqa: ANN001
            with set_current_vllm_config(self.vllm_config):
                return self.runner.sample_tokens(grammar_output)

    real_engine.StandInWorker = V2Worker
    # Block size 32: the CPU attention backend's multiple.
    e = RealEngine(RealConfig(num_blocks=64, block_size=32, max_model_len=512, max_num_seqs=8, async_scheduling=False))
    e.add("a", list(range(1, 40)), 4)
    e.add("b", list(range(50, 60)), 4)
    try:
        e.run(max_steps=20)
        print("V2 ran to the end:", e.finished)
    except Exception as ex:  # what stops it is the finding
        print(f"V2's execute_model stopped: {type(ex).__name__}: {ex}")
        traceback.print_exc(limit=-3)


if __name__ == "__main__":
    block_tables_kernels()
    v2_runner_under_engine_core()
