"""kvguard's cost per vLLM scheduler step, with and without the plugin, in the same run.

256 running requests on vLLM 0.33's real Scheduler, KVCacheManager, BlockPool, InputBatch and
BlockTable on CPU (the model-free engine of tests/engines/vllm). vLLM's own step time is
schedule + update_from_output + the persistent batch / block table build; kvguard's cost is
everything the plugin adds (the scheduler-side recorder inside those calls, and the worker
check). The stand-in model is not timed.

Two engines run the same workload step by step, interleaved (the order flips every step): one
with kvguard's hooks on its classes for its steps, one without. A shared, loaded machine slows
both alike then, and per-step medians shrug off the steps the OS took the CPU away. The clock is
the thread's CPU time by default (time a loaded machine spends elsewhere is not the step's cost),
wall time with ``--clock wall``. Each round prints its figures; the last line gives
min / median / max of the cost ratio over the rounds.

    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_step.py [--requests 256] [--steps 200] [--rounds 3] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines" / "vllm"))

import numpy as np
from engine import Engine, EngineConfig

import kvguard.vllm
from kvguard.vllm import hooks


def clock() -> float:
    """The bench's clock: this thread's CPU time (``--clock cpu``, the default: what the step
    costs, whatever else the machine runs) or wall time (``--clock wall``)."""
    return _clock()


class Hooks:
    """kvguard's wrappers, switched on and off per step (install once, then swap the methods)."""

    def __init__(self) -> None:
        kvguard.vllm.install("enforce")
        self.wrapped = [(cls, name, cls.__dict__[name]) for cls, name, _ in hooks._ORIGINALS]
        self.originals = list(hooks._ORIGINALS)

    def on(self) -> None:
        for cls, name, fn in self.wrapped:
            setattr(cls, name, fn)

    def off(self) -> None:
        for cls, name, fn in self.originals:
            setattr(cls, name, fn)


class TimedEngine(Engine):
    """Times vLLM's part of each step and the worker check separately."""

    def step(self) -> tuple[float, float, bool]:  # the harness step, split into timed parts
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = clock()
        so = self.scheduler.schedule()
        self._update_states(so)
        req_ids = list(self.input_batch.req_ids)
        sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        t1 = clock()
        if self.guarded:
            hooks.worker_step(
                self, self.input_batch, so, sched, num_blocks=self.cfg.num_blocks, max_model_len=self.cfg.max_model_len
            )
        t2 = clock()
        sampled = self._forward(req_ids, sched)
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        t3 = clock()
        self.scheduler.update_from_output(so, mro)
        for rid, toks in zip(req_ids, sampled):
            if toks:
                self.tokens[rid].extend(toks)
                self.requests[rid].output_token_ids.extend(toks)
        t4 = clock()
        self.steps += 1
        decode = len(req_ids) == args.requests and int(sched.max()) == 1
        return (t1 - t0) + (t4 - t3), t2 - t1, decode


def engine(guarded: bool) -> TimedEngine:
    cfg = EngineConfig(num_blocks=256 * 8 + 64, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    e = TimedEngine(cfg, guarded=guarded)
    rng = random.Random(0)
    for i in range(args.requests):
        e.add(f"req-{i}", [rng.randrange(500) for _ in range(rng.randrange(32, 64))], 10_000)
    return e


def one_round(h: Hooks) -> float:
    h.off()
    plain = engine(False)
    h.on()
    guarded = engine(True)

    def step_plain() -> tuple[float, float, bool]:
        h.off()
        return plain.step()

    def step_guarded() -> tuple[float, float, bool]:
        h.on()
        return guarded.step()

    # Prefill, then time decode steps only (both engines take the same steps: kvguard changes
    # nothing in a clean run).
    while not (step_plain()[2] & step_guarded()[2]):
        pass
    t_plain, t_guarded, t_check = [], [], []
    for i in range(args.steps):
        if i % 2:
            p, g = step_plain(), step_guarded()
        else:
            g, p = step_guarded(), step_plain()
        t_plain.append(p[0])
        t_guarded.append(g[0])
        t_check.append(g[1])
    h.off()
    med = statistics.median
    plain_vllm, guarded_vllm, check = med(t_plain), med(t_guarded), med(t_check)
    hooks_cost = guarded_vllm - plain_vllm
    cost = hooks_cost + check
    ratio = 100 * cost / plain_vllm
    mean_ratio = 100 * (sum(t_guarded) - sum(t_plain) + sum(t_check)) / sum(t_plain)
    n = args.requests
    print(f"vllm_step/unguarded/{n}:    {plain_vllm * 1e6:9.1f} us  (median; schedule + update + batch build)")
    print(f"vllm_step/guarded/{n}:      {guarded_vllm * 1e6:9.1f} us  (the same, with the recorder hooks)")
    print(f"kvguard/worker_check/{n}:   {check * 1e6:9.1f} us")
    print(
        f"kvguard cost per step: {hooks_cost * 1e6:.1f} (hooks) + {check * 1e6:.1f} (check) = {cost * 1e6:.1f} us"
        f" = {ratio:.2f} % of vLLM's step (medians of {args.steps} decode steps; {mean_ratio:.2f} % by means)"
    )
    return ratio


def main() -> None:
    h = Hooks()
    ratios = [one_round(h) for _ in range(args.rounds)]
    print(
        f"kvguard cost / vLLM step over {args.rounds} rounds: min {min(ratios):.2f} %, "
        f"median {statistics.median(ratios):.2f} %, max {max(ratios):.2f} %"
    )
    kvguard.vllm.uninstall()


parser = argparse.ArgumentParser()
parser.add_argument("--requests", type=int, default=256)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
args = parser.parse_args()
_clock = time.thread_time if args.clock == "cpu" else time.perf_counter

if __name__ == "__main__":
    main()
