"""kvguard's cost per step of vLLM's own engine: vLLM 0.33's ``EngineCore`` under async scheduling
(its default on GPUs: ``step_with_batch_queue``, a batch queue of 2), its ``AsyncScheduler``,
``KVCacheManager`` and ``BlockPool``, and its V1 model runner (``CPUModelRunner``, a
``GPUModelRunner``) with its own ``_update_states`` and ``_prepare_inputs`` (the persistent batch,
``commit_block_table``, positions, the slot mapping), 256 running requests in decode, guarded
beside unguarded in one process. Nothing of vLLM's step is re-implemented: the engines are the
tests' real-engine harness (``tests/engines/vllm/real_engine.py``), with only the model stood in.

What is not vLLM's step, and is taken off each step's time: the stand-in model (it writes
nothing and reads nothing here; it keeps the runner's discard mask), the stand-in sampler (a
token per row, and the host-side bookkeeping ``_bookkeeping_sync`` does), and the torch stand-in
for vLLM's Triton slot-mapping kernel (on a GPU, a kernel launch). kvguard's own calls stay in:
the scheduler-side recorder inside vLLM's calls, the worker check inside ``_prepare_inputs``'s
wrapper, ``annotate_output`` on the output.

Each round a fresh child builds both engines (which one first alternates by round), kvguard
installed as its plugin installs it (``kvguard.vllm.install("enforce")``); the unguarded
engine's scheduler has no recorder and its runner no guard, so it pays only the wrappers' early
returns. Both admit the same 256 requests (prompts of 32-63 tokens; ``--prompt-tokens N``: N to
2N-1, the rows attention reads growing with N) into a pool with room for
all of them to the end (none is preempted: every timed step decodes all 256, each claiming a
block every 16 tokens and publishing the one it filled), run their prefill untimed, then
``--steps`` decode steps interleaved, the order flipped every step. A round reads the median
over step pairs of (guarded - unguarded) / unguarded; the last line gives min / median / max
over the rounds. ``--control`` puts a second unguarded engine in the guarded one's place: what
the method reads when there is nothing to find. ``--part scheduler`` takes the worker check away
from the guarded engine (its runner has no guard; the recorder and the hooks stay): the
scheduler side's share alone, which judges nothing. The clock is the thread's CPU time
(``--clock wall``: wall time); everything runs in the one thread.

``--instructions`` counts instead of timing (valgrind's callgrind): a child holding the two
engines and one holding two unguarded ones, each under callgrind, only their ``--steps`` decode
step pairs counted (after a few instrumented and zeroed), the stand-ins not (each is called
through ``operator.call`` as the step is: callgrind's ``--toggle-collect`` turns collection off
again inside them), Python's cyclic collector off while they are counted (its passes land
where allocation counts happen to cross its thresholds, inside one child's counted steps and
outside another's). ``--cache-sim`` adds the lines missed in a simulated 2 MiB L2. ``--solo``
counts one engine a child instead (a guarded one, an unguarded one), as an engine runs in
production, one to a process: the two engines of one process share the L2, so each step there
finds the lines of the other engine's step between it and its own last one. ``--split`` runs the
guarded pair's child twice alike, counting the guarded engine's steps in one run and the
unguarded engine's in the other: the difference comes from one execution, not two children.
``--layouts N`` runs each counted child at N memory layouts (``callgrind.count``'s ``layout``)
and reads their mean, printing the range: the simulated misses move with the layout by hundreds
of lines a step.

    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_core_step.py [--rounds 6] [--steps 200] [--control | --part all|scheduler] [--clock cpu|wall] [--prompt-tokens 32]
    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_core_step.py --instructions [--cache-sim] [--solo | --split] [--part all|scheduler] [--steps 40] [--prompt-tokens 32] [--layouts N]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines" / "vllm"))
import callgrind as callgrind_tool  # noqa: E402 (this folder's helper; the script's folder is on the path)

REQUESTS = 256

#: Seconds the stand-ins (model, sampler, slot-mapping kernel) spent in the current step.
STAND_IN = [0.0]

#: Under callgrind: whether the step running is one the child counts (a ``--split`` child counts
#: one engine's steps; its stand-ins turn collection off only inside those).
COUNTING = [False]


def stood_in(fn):  # noqa: ANN001, ANN201
    """``fn``, its time added to ``STAND_IN`` (not vLLM's step); under callgrind, called through
    ``operator.call``, so inside the counted step it is not counted."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t = clock()
        try:
            return callgrind_tool.counted(fn, *a, **kw) if COUNTING[0] else fn(*a, **kw)
        finally:
            STAND_IN[0] += clock() - t

    return wrapper


def bench_worker() -> type:
    """The tests' stand-in worker with a model that does no work of its own (no oracle: the
    tests hold the verdicts; this times the step) and ``GPUModelRunner.execute_model``'s own
    sequence of calls, nothing else."""
    import numpy as np
    import real_engine

    class BenchWorker(real_engine.StandInWorker):
        def execute_model(self, scheduler_output: Any) -> Any:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            self.steps += 1
            runner = self.runner
            runner._update_states(scheduler_output)
            if not scheduler_output.total_num_scheduled_tokens:
                return EMPTY_MODEL_RUNNER_OUTPUT
            req_ids = runner.input_batch.req_ids
            tokens = [scheduler_output.num_scheduled_tokens[i] for i in req_ids]
            sched = np.array(tokens, dtype=np.int32)
            runner._prepare_inputs(scheduler_output, sched)
            self._forward(list(req_ids), sched)
            return None

        @stood_in
        def _forward(self, req_ids: list[str], sched: Any) -> None:
            n = len(req_ids)
            self._last = (req_ids, self.runner.discard_request_mask.np[:n].copy(), None)

        def sample_tokens(self, grammar_output: Any) -> Any:
            from kvguard.vllm import hooks

            return hooks.annotate_output(self.runner, self._sample())

        @stood_in
        def _sample(self) -> Any:
            req_ids, discard, _ = self._last
            self._last = None
            return self.sampled(req_ids, discard, lambda i: 1 + (i * 7 + self.steps) % 400)

    return BenchWorker


def make_engine(guarded: bool) -> Any:
    """One engine, its 256 requests admitted; unguarded: no recorder, no guard."""
    import real_engine

    real_engine.StandInWorker = bench_worker()
    rc = real_engine.RealConfig(
        # Room for every request's whole run (prompt, warm-up and timed steps): nothing is
        # preempted, all 256 run every step.
        num_blocks=REQUESTS * (-(-(2 * args.prompt_tokens + 40 + args.steps) // 16) + 1) + 64,
        block_size=16,
        max_num_seqs=REQUESTS,
        max_num_batched_tokens=max(8192, 32 * args.prompt_tokens),
        max_model_len=max(2048, 2 * args.prompt_tokens + 64 + args.steps),
        async_scheduling=True,
    )
    e = real_engine.RealEngine(rc)
    e.kind = "guarded" if guarded else "plain"
    if not guarded:
        e.core.scheduler.kv_cache_manager._kvguard_recorder = None  # the hooks pass it by
    if not guarded or args.part == "scheduler":
        e.worker.runner._kvguard = None  # no guard: worker_step returns at once
    rng = random.Random(0)
    for i in range(REQUESTS):
        n = rng.randrange(args.prompt_tokens, 2 * args.prompt_tokens)
        e.add(f"req-{i}", [rng.randrange(500) for _ in range(n)], 10_000)
    return e


def timed_step(e: Any) -> tuple[float, bool]:
    """One ``EngineCore`` step: its time without the stand-ins', and whether every request
    was running in decode."""
    STAND_IN[0] = 0.0
    t0 = clock()
    if args.callgrind and args.count in ("both", e.kind):
        COUNTING[0] = True
        try:
            callgrind_tool.counted(e.core.step_fn)
        finally:
            COUNTING[0] = False
    else:
        e.core.step_fn()
    t1 = clock()
    sched = e.core.scheduler
    decode = len(sched.running) == REQUESTS and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
    return t1 - t0 - STAND_IN[0], decode


def serve_pair(guarded_first: bool) -> None:
    """A child: both engines in this process; prints the medians of the unguarded step, the
    guarded step and the per-pair cost (per cent)."""
    import real_engine

    import kvguard.vllm

    out = sys.__stdout__
    sys.stdout = sys.stderr
    kvguard.vllm.install("enforce")
    kernel = real_engine._SlotMappingInTorch
    kernel.__call__ = stood_in(kernel.__call__)
    guarded = not args.control
    if guarded_first:
        g, p = make_engine(guarded), make_engine(False)
    else:
        p, g = make_engine(False), make_engine(guarded)
    if guarded and g.guard is not None:
        raise RuntimeError("the guard is made at the first step, not before")
    while not (timed_step(p)[1] & timed_step(g)[1]):
        pass
    for _ in range(20):  # steady decode before the timed steps
        timed_step(p)
        timed_step(g)
    if guarded and args.part == "all" and not g.guard:
        raise RuntimeError("the guarded engine runs no guard")
    if args.callgrind:
        # Counted from the caches a step leaves, not from empty ones; the collector off (see
        # quiet_collector).
        quiet_collector()
        callgrind_tool.switch("on")
        for _ in range(callgrind_tool.WARM_STEPS):
            timed_step(p)
            timed_step(g)
        callgrind_tool.zero()
    plain, guarded_t, ratio = [], [], []
    for i in range(args.steps):
        if i % 2:
            (a, da), (b, db) = timed_step(p), timed_step(g)
        else:
            (b, db), (a, da) = timed_step(g), timed_step(p)
        if not (da and db):
            raise RuntimeError(f"step {i}: not every request is running in decode")
        plain.append(a)
        guarded_t.append(b)
        ratio.append((b - a) / a)
    if args.callgrind:
        callgrind_tool.switch("off")
    if guarded and args.part == "all" and g.guard.refusals_total:
        raise RuntimeError("kvguard refused a clean run")
    med = statistics.median
    out.write(f"{med(plain)!r} {med(guarded_t)!r} {100 * med(ratio)!r}\n")
    out.flush()


def quiet_collector() -> None:
    """Under callgrind: Python's cyclic collector run now and then kept off while steps are
    counted. Its passes start where allocation counts happen to cross its thresholds, so a pass
    falls inside one child's counted steps and outside another's and moved a child's count by
    hundreds of thousands of instructions a step, more than kvguard's own; the steps themselves
    are what is compared."""
    gc.collect()
    gc.disable()


def serve_solo(guarded: bool) -> None:
    """A ``--solo`` child under callgrind: one engine in this process, its ``--steps`` decode
    steps counted."""
    import real_engine

    import kvguard.vllm

    sys.stdout = sys.stderr
    kvguard.vllm.install("enforce")
    kernel = real_engine._SlotMappingInTorch
    kernel.__call__ = stood_in(kernel.__call__)
    e = make_engine(guarded)
    while not timed_step(e)[1]:
        pass
    for _ in range(20):
        timed_step(e)
    if guarded and args.part == "all" and not e.guard:
        raise RuntimeError("the guarded engine runs no guard")
    quiet_collector()
    callgrind_tool.switch("on")
    for _ in range(callgrind_tool.WARM_STEPS):
        timed_step(e)
    callgrind_tool.zero()
    for i in range(args.steps):
        if not timed_step(e)[1]:
            raise RuntimeError(f"step {i}: not every request is running in decode")
    callgrind_tool.switch("off")
    if guarded and args.part == "all" and e.guard.refusals_total:
        raise RuntimeError("kvguard refused a clean run")


def instructions() -> None:
    """``--instructions``: the guarded pair's child and the control's under callgrind (``--solo``:
    a guarded engine's child and an unguarded one's); kvguard's instructions a step (the
    difference) over an unguarded step's."""
    callgrind_tool.require("vllm_core_step.py")
    if args.split:
        return instructions_split()
    counts, misses = {}, {}
    for part in ("control", "kvguard"):
        flags = []
        if args.solo:
            flags += ["--solo", "plain" if part == "control" else "guarded"]
        elif part == "control":
            flags += ["--control"]
        if part == "kvguard":
            flags += ["--part", args.part]
        counts[part], misses[part] = counted_child(flags, part, "a step" if args.solo else "a step pair")
    # A pair's control is two unguarded steps; a solo control, one.
    share = 1 if args.solo else 2
    plain = counts["control"] / share
    extra = counts["kvguard"] - counts["control"]
    shape = "one engine a process" if args.solo else "two engines in one process"
    print(f"an unguarded EngineCore step: {plain:,.0f} instructions ({args.steps} decode steps, {REQUESTS} requests, {shape})")
    line = f"kvguard ({args.part}): {extra:,.0f} instructions a step = {100 * extra / plain:.2f} % of the unguarded step"
    if args.cache_sim:
        more = misses["kvguard"] - misses["control"]
        base = misses["control"] / share
        line += f"; {more:,.0f} lines missed = {100 * more / base:.1f} % of its {base:,.0f}"
    print(line)


def counted_child(flags: list[str], label: str, per: str) -> tuple[float, float]:
    """A child (``--serve --callgrind`` and ``flags``) counted under callgrind: its instructions
    and lines missed (0 without ``--cache-sim``) a counted step, printed under ``label``."""
    child = [sys.executable, __file__, "--serve", "--callgrind", "--steps", str(args.steps), "--guarded-first"]
    child += ["--prompt-tokens", str(args.prompt_tokens), *flags]
    runs = [callgrind_tool.count(child, args.cache_sim, 0, layout) for layout in range(args.layouts)]
    count = statistics.fmean(e["Ir"] for e in runs) / args.steps
    each = [callgrind_tool.misses(e) / args.steps for e in runs] if args.cache_sim else [0.0]
    missed = statistics.fmean(each)
    line = f"{label}: {count:,.0f} instructions {per}"
    if args.cache_sim:
        line += f", {missed:,.0f} lines missed in a {callgrind_tool.L2_CACHE} cache"
        if len(runs) > 1:
            line += f" (mean of {len(runs)} layouts, {min(each):,.0f} to {max(each):,.0f})"
    print(line, flush=True)
    return count, missed


def instructions_split() -> None:
    """``--instructions --split``: one child holding both engines, run twice under callgrind
    alike, counting the guarded engine's steps in one run and the unguarded engine's in the
    other. The two runs execute the same program (the same seed, the collector off), so their
    difference is the guarded engine's step over its twin's, without a second child's layout
    and allocation pattern in it (which moved a control's simulated misses by several hundred
    lines a step)."""
    counts, misses = {}, {}
    for kind in ("plain", "guarded"):
        flags = ["--part", args.part, "--count", kind]
        counts[kind], misses[kind] = counted_child(flags, f"{kind} engine's steps", "a step")
    extra = counts["guarded"] - counts["plain"]
    line = (
        f"kvguard ({args.part}): {extra:,.0f} instructions a step = {100 * extra / counts['plain']:.2f} % of the"
        f" unguarded step ({args.steps} decode steps, {REQUESTS} requests, both engines in one process, each run"
        " counting one)"
    )
    if args.cache_sim:
        more = misses["guarded"] - misses["plain"]
        line += f"; {more:,.0f} lines missed = {100 * more / misses['plain']:.1f} % of its {misses['plain']:,.0f}"
    print(line)


def main() -> None:
    results = []
    label = "control: a second unguarded engine" if args.control else f"kvguard ({args.part})"
    for r in range(args.rounds):
        cmd = [sys.executable, __file__, "--serve", "--clock", args.clock, "--steps", str(args.steps)]
        cmd += ["--prompt-tokens", str(args.prompt_tokens)]
        cmd += ["--guarded-first" if r % 2 == 0 else "--plain-first"]
        cmd += ["--control"] if args.control else ["--part", args.part]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        reply = done.stdout.split()
        if len(reply) != 3:
            raise RuntimeError(f"the bench child died:\n{done.stderr[-3000:]}")
        plain, guarded, ratio = (float(x) for x in reply)
        results.append(ratio)
        print(
            f"round {r}: vLLM EngineCore step {plain * 1e6:.1f} us unguarded, {guarded * 1e6:.1f} us guarded:"
            f" {label} costs {ratio:.2f} % of the unguarded step (median of {args.steps} step pairs;"
            f" {'guarded' if r % 2 == 0 else 'unguarded'} engine built first)",
            flush=True,
        )
    print(
        f"{label} cost / vLLM EngineCore step over {args.rounds} rounds ({args.clock} clock): "
        f"min {min(results):.2f} %, median {statistics.median(results):.2f} %, max {max(results):.2f} %"
    )


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
parser.add_argument("--control", action="store_true", help="two unguarded engines (the method's own reading)")
parser.add_argument("--part", choices=["all", "scheduler"], default="all", help="scheduler: no worker check")
parser.add_argument("--instructions", action="store_true", help="instruction counts (callgrind) instead of time")
parser.add_argument("--cache-sim", action="store_true", help="with --instructions: simulated L2 misses too")
parser.add_argument("--solo", nargs="?", const="both", choices=["both", "plain", "guarded"],
                    help="with --instructions: one engine a child (see the module doc)")
parser.add_argument("--split", action="store_true",
                    help="with --instructions: one child run twice, counting each engine's steps in turn")
parser.add_argument("--layouts", type=int, default=1,
                    help="with --instructions: each counted child at this many memory layouts, their mean read")
parser.add_argument("--prompt-tokens", type=int, default=32,
                    help="prompts of N to 2N-1 tokens (default 32): the rows attention reads grow with N")
parser.add_argument("--callgrind", action="store_true", help=argparse.SUPPRESS)
parser.add_argument("--count", choices=["both", "guarded", "plain"], default="both", help=argparse.SUPPRESS)
parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
parser.add_argument("--guarded-first", dest="guarded_first", action="store_true", help=argparse.SUPPRESS)
parser.add_argument("--plain-first", dest="guarded_first", action="store_false", help=argparse.SUPPRESS)
args = parser.parse_args()
if args.rounds < 1 or args.steps < 1 or args.prompt_tokens < 1:
    parser.error("--steps, --rounds and --prompt-tokens must be at least 1")
if args.cache_sim and not args.instructions:
    parser.error("--cache-sim goes with --instructions")
if args.layouts < 1 or (args.layouts != 1 and not args.instructions):
    parser.error("--layouts is at least 1 and goes with --instructions")
if args.solo and not (args.instructions or args.serve):
    parser.error("--solo goes with --instructions")
if args.split and (not args.instructions or args.solo or args.control):
    parser.error("--split goes with --instructions, without --solo or --control")
if args.control and args.part != "all":
    parser.error("--part goes without --control")
if args.instructions and args.control:
    parser.error("--instructions runs the control itself")
clock = time.thread_time if args.clock == "cpu" else time.perf_counter

if __name__ == "__main__":
    if args.serve and args.solo:
        serve_solo(args.solo == "guarded")
    elif args.serve:
        serve_pair(args.guarded_first)
    elif args.instructions:
        instructions()
    else:
        main()
