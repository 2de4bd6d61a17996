"""kvguard's cost per vLLM scheduler step, with and without the plugin, in the same run.

256 running requests on vLLM 0.33's real Scheduler, KVCacheManager, BlockPool, InputBatch and
BlockTable on CPU (the model-free engine of tests/engines/vllm). vLLM's own step time is
schedule + update_from_output + the persistent batch / block table build; kvguard's cost is
everything the plugin adds (the scheduler-side recorder inside those calls, and the worker
check). The stand-in model is not timed.

    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_step.py [--requests 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines" / "vllm"))

import numpy as np
from engine import Engine, EngineConfig

import kvguard.vllm
from kvguard.vllm import hooks


class TimedEngine(Engine):
    """Times vLLM's part of each step and the worker check separately."""

    def step(self) -> None:  # the harness step, split into timed parts
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self._update_states(so)
        req_ids = list(self.input_batch.req_ids)
        sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        t1 = time.perf_counter()
        if self.guarded:
            hooks.worker_step(self, self.input_batch, so, sched, num_blocks=self.cfg.num_blocks,
                              max_model_len=self.cfg.max_model_len)
        t2 = time.perf_counter()
        sampled = self._forward(req_ids, sched)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        t3 = time.perf_counter()
        self.scheduler.update_from_output(so, mro)
        for rid, toks in zip(req_ids, sampled):
            if toks:
                self.tokens[rid].extend(toks)
                self.requests[rid].output_token_ids.extend(toks)
        t4 = time.perf_counter()
        self.steps += 1
        self.t_vllm += (t1 - t0) + (t4 - t3)
        self.t_check += t2 - t1
        self.decode_steps += int(len(req_ids) == args.requests and int(sched.max()) == 1)


def run(guarded: bool) -> tuple[float, float, int]:
    if guarded:
        kvguard.vllm.install("enforce")
    else:
        kvguard.vllm.uninstall()
    cfg = EngineConfig(num_blocks=256 * 8 + 64, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    e = TimedEngine(cfg, guarded=guarded)
    e.t_vllm = e.t_check = 0.0
    e.decode_steps = 0
    rng = random.Random(0)
    for i in range(args.requests):
        e.add(f"req-{i}", [rng.randrange(500) for _ in range(rng.randrange(32, 64))], 10_000)
    # Prefill, then time decode steps only.
    while e.decode_steps == 0:
        e.step()
    e.t_vllm = e.t_check = 0.0
    e.steps = 0
    for _ in range(args.steps):
        e.step()
    kvguard.vllm.uninstall()
    return e.t_vllm / e.steps, e.t_check / e.steps, e.steps


parser = argparse.ArgumentParser()
parser.add_argument("--requests", type=int, default=256)
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

for _ in range(2):  # the second round is the one reported (warm)
    plain_vllm, _, n = run(False)
    guarded_vllm, check, _ = run(True)
per_step_cost = (guarded_vllm - plain_vllm) + check
print(f"vllm_step/unguarded/{args.requests}: {plain_vllm * 1e6:9.1f} us  (schedule + update + batch build)")
print(f"vllm_step/guarded/{args.requests}:   {guarded_vllm * 1e6:9.1f} us  (the same, with the recorder hooks)")
print(f"kvguard/worker_check/{args.requests}: {check * 1e6:9.1f} us")
print(f"kvguard cost per step: {per_step_cost * 1e6:.1f} us = {100 * per_step_cost / plain_vllm:.2f} % of vLLM's step ({n} decode steps)")
