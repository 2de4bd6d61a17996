"""kvguard's cost per vLLM scheduler step, with and without the plugin, in the same run.

256 running requests on vLLM 0.33's real Scheduler, KVCacheManager, BlockPool, InputBatch and
BlockTable on CPU (the model-free engine of tests/engines/vllm). vLLM's own step time is
schedule + update_from_output + the persistent batch / block table build; kvguard's cost is
everything the plugin adds (the scheduler-side recorder inside those calls, and the worker
check). The stand-in model is not timed.

Two engines run the same workload, each in its own process started by this one: one with
kvguard's hooks installed (as the ``vllm.general_plugins`` entry point installs them), one
without (kvguard never imported). Their steps are interleaved in lockstep (the order flips every
step), so a shared, loaded machine slows both alike, and per-step medians shrug off the steps the
OS took the CPU away. Neither process ever swaps methods on vLLM's classes (which would throw away
CPython's specialised attribute caches on every swap and bill that to both engines). The clock is
the thread's CPU time by default (time a loaded machine spends elsewhere is not the step's cost),
wall time with ``--clock wall``.

The two-process difference swings by several per cent on a loaded machine (two processes' steps
vary more than kvguard costs), so the guarded engine also times kvguard's own work in process,
the same steps: the worker check (around ``worker_step``) and the scheduler-side recorder
(``time.perf_counter_ns`` around each of its calls: block-list appends, newly cacheable blocks,
frees, the step's event hand-off; the wrapper frames around them, about 25 plain calls a step, are
not in it). That in-process figure over the same process's vLLM step (its step minus the
recorder) is kvguard's own work; it does not see what the hooks cost vLLM's own code around
them. Each round prints its figures; the last lines give min / median / max of both ratios over
the rounds.

``--same-process`` measures the whole cost directly: each round a fresh child builds a guarded
and an unguarded engine side by side in one process, the hooks installed for both (the
unguarded engine's manager gets no recorder and it runs no worker check, so it pays only the
wrapper frames' early returns), nothing inside kvguard timed; their steps interleave, the order
flipped every step, and each round reads the median over step pairs of (guarded step + check -
unguarded step) / unguarded step. Which engine is built first alternates by round (the first
one built runs slower here). ``--same-process --control`` puts a second unguarded engine in the
guarded one's place: what the method reads when there is nothing to find. ``--same-process
--part`` splits the cost by taking parts away from the guarded engine: ``scheduler`` runs no
worker check (the recorder and the hooks alone), ``hooks`` no check and a recorder that records
nothing (the wrappers' frames and the block lists' subclasses alone); ``all``, the default, is
the whole cost. Without the check nothing is judged: those two read cost only.
``--same-process --instructions`` counts instructions instead (valgrind's callgrind, needs
valgrind): a child for each part and one for the control, only their ``--steps`` decode step
pairs counted (after a few instrumented and zeroed) and in them only the calls the timings
time; kvguard's instructions a step beside an unguarded engine's. They do not move with the machine or its load. ``--cache-sim``
adds the lines each part misses in a simulated 2 MiB L2 (callgrind's cache model; this machine
kind's L2 per core): what kvguard's work waits on, which its instructions do not show.

``--churn`` serves as an engine does: each request generates 16-127 tokens and each one that
finishes is replaced by a new one (the same arrivals in both engines), so every step admits,
prefills, publishes and releases some; every step after a warm-up of 150 is timed, not only
full decode steps.

    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_step.py [--requests 256] [--steps 200] [--rounds 3] [--clock cpu|wall] [--churn]
    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_step.py --same-process [--control | --part all|scheduler|hooks] [--rounds 6] [--churn]
    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_step.py --same-process --instructions [--cache-sim] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines" / "vllm"))
import callgrind as callgrind_tool  # noqa: E402 (this folder's helper; the script's folder is on the path)


def clock() -> float:
    """The bench's clock: this thread's CPU time (``--clock cpu``, the default: what the step
    costs, whatever else the machine runs) or wall time (``--clock wall``)."""
    return _clock()


#: Each step's empty interval of the bench's clock (seconds), taken off its timed intervals: a
#: reading is a system call in some sandboxes, and read in the middle of a step it costs far
#: more than in a tight loop (11 us against 0.6 us for the thread clock here).
CLOCK_GAPS: list[float] = []


def make_engine(guarded: bool, time_calls: bool = True):  # noqa: ANN201 (the harness engine class is imported late)
    import numpy as np
    from engine import Engine, EngineConfig

    class TimedEngine(Engine):
        """Times vLLM's part of each step and the worker check separately."""

        def timed_step(self) -> tuple[float, float, float, bool]:  # the harness step, split into timed parts
            from vllm.v1.outputs import ModelRunnerOutput

            RECORDER[:] = [0, 0]
            t0 = clock()
            so = self.scheduler.schedule()
            self._update_states(so)
            req_ids = list(self.input_batch.req_ids)
            sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
            t1 = clock()
            t1x = clock()  # an empty interval: what one reading costs here, now
            if self.guarded and args.part == "all":
                report = hooks.worker_step(
                    self, self.input_batch, so, sched, num_blocks=self.cfg.num_blocks, max_model_len=self.cfg.max_model_len
                )
                if report is not None and report.refused:
                    # A clean run: a refusal here is kvguard's mistake, not a cost to time.
                    raise RuntimeError(f"kvguard refused a clean step {self.steps}: {report.refused}")
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
            if args.churn:
                # Requests that finished are replaced (untimed): the same arrivals in both
                # engines, which finish alike.
                while len(self.scheduler.requests) < args.requests:
                    self.arrive()
                decode = self.steps > CHURN_WARMUP
            else:
                decode = len(req_ids) == args.requests and int(sched.max()) == 1
            # The recorder's time without the clock's share, and vLLM's step without the timing
            # wrappers (both zero in the unguarded engine).
            ns, calls = RECORDER
            recorder = max(0.0, ns - calls * TIMER_NS[0]) * 1e-9
            wrappers = calls * (TIMER_NS[1] - TIMER_NS[0]) * 1e-9
            # Each interval holds one clock reading's cost: this step's empty interval.
            c = t1x - t1
            CLOCK_GAPS.append(c)
            check = t2 - t1x - c if self.guarded and args.part == "all" else 0.0
            return (t1 - t0) + (t4 - t3) - 2 * c - wrappers, check, recorder, decode

        def arrive(self) -> None:
            """A new request (``--churn``): a prompt of 32-63 tokens, 16-127 to generate."""
            rng, i = self.churn_rng, self.arrived
            self.arrived += 1
            self.add(f"req-{i}", [rng.randrange(500) for _ in range(rng.randrange(32, 64))], rng.randrange(16, 128))

    if guarded:
        import kvguard.vllm
        from kvguard.vllm import hooks

        kvguard.vllm.install("enforce")
        if time_calls:
            time_recorder()
    blocks = 256 * 8 + 64 if not args.churn else args.requests * 12 + 64
    cfg = EngineConfig(num_blocks=blocks, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    e = TimedEngine(cfg, guarded=guarded)
    rng = random.Random(0)
    e.churn_rng, e.arrived = random.Random(1), 0
    for _ in range(args.requests):
        if args.churn:
            e.arrive()
        else:
            e.add(f"req-{e.arrived}", [rng.randrange(500) for _ in range(rng.randrange(32, 64))], 10_000)
            e.arrived += 1
    return e


#: ``--churn``: steps before the timed ones (the first arrivals' prefill, the first finishes).
CHURN_WARMUP = 150

#: The scheduler-side recorder's calls in the current step (guarded engine): [nanoseconds timed,
#: calls].
RECORDER = [0, 0]
#: Per timed call: the clock's own cost inside the timed interval, and the whole timing
#: wrapper's cost (both measured at start, subtracted from the step's figures).
TIMER_NS = [0.0, 0.0]


def _timed(fn):  # noqa: ANN001, ANN202
    now = time.perf_counter_ns

    def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = now()
        try:
            return fn(*a, **kw)
        finally:
            RECORDER[0] += now() - t
            RECORDER[1] += 1

    return wrapper


def time_recorder() -> None:
    """Times each call of the scheduler-side recorder (``SchedulerRecorder``'s hooks) into
    ``RECORDER`` with ``time.perf_counter_ns`` (a call is a few microseconds; the thread clock is
    a system call costing microseconds itself). A clock reading is not free either (0.7 us in
    some sandboxes): what an empty call timed this way reads, and what the timing wrapper costs
    in all, are measured here, in a loop, and taken off the step's figures. In the middle of a
    step a reading may cost more than in a loop, so the recorder's figure is an upper bound."""
    from kvguard.vllm.recorder import SchedulerRecorder

    if TIMER_NS[1]:
        return  # wrapped once per process (each round's engine reuses the class)
    for name in ("added", "cached", "freed", "evicted", "cache_reset", "take"):
        setattr(SchedulerRecorder, name, _timed(getattr(SchedulerRecorder, name)))
    empty = _timed(lambda: None)
    inside, whole = [], []
    for _ in range(50):
        RECORDER[:] = [0, 0]
        t = time.perf_counter_ns()
        for _ in range(200):
            empty()
        whole.append((time.perf_counter_ns() - t) / 200)
        inside.append(RECORDER[0] / 200)
    TIMER_NS[:] = [statistics.median(inside), statistics.median(whole)]


def interleaved(plain_step, guarded_step):  # noqa: ANN001, ANN201
    """Steps two engines through prefill untimed, then ``--steps`` decode steps with the order
    flipped every step (both take the same steps: kvguard changes nothing in a clean run);
    returns each decode step's pair of results (plain's, guarded's). A step's result says at
    index 3 whether it was a full decode step."""
    while not (plain_step()[3] & guarded_step()[3]):
        pass
    if args.callgrind:
        # Counted from the caches a step leaves, not from empty ones.
        callgrind_tool.switch("on")
        for _ in range(callgrind_tool.WARM_STEPS):
            plain_step()
            guarded_step()
        callgrind_tool.zero()
    pairs = []
    for i in range(args.steps):
        if i % 2:
            p = plain_step()
            g = guarded_step()
        else:
            g = guarded_step()
            p = plain_step()
        pairs.append((p, g))
    if args.callgrind:
        callgrind_tool.switch("off")
    return pairs


def count_phases(*engines) -> None:  # noqa: ANN002 (the harness engines)
    """Under ``--instructions``: the calls a step's figures time (vLLM's schedule, the persistent
    batch's update, update_from_output, kvguard's worker check) made through ``operator.call``,
    the one C function callgrind collects in (``--toggle-collect=_operator_call``): the stand-in
    forward and the harness are not counted. Instance attributes and kvguard's module only: no
    method of vLLM's classes is swapped."""
    def through_call(fn):  # noqa: ANN001, ANN202
        return lambda *a, **kw: callgrind_tool.counted(fn, *a, **kw)

    for e in engines:
        e.scheduler.schedule = through_call(e.scheduler.schedule)
        e.scheduler.update_from_output = through_call(e.scheduler.update_from_output)
        e._update_states = through_call(e._update_states)
    hooks.worker_step = through_call(hooks.worker_step)


def instructions() -> None:
    """``--same-process --instructions``: each part's child (and the control's) under valgrind's
    callgrind, only its ``--steps`` decode step pairs counted and in them only what the timings
    time (``count_phases``); kvguard's instructions per step (the part's pair minus the
    control's) over an unguarded engine's step (half the control's pair). Instruction counts do
    not move with the machine or its load."""
    callgrind_tool.require("vllm_step.py")
    cache = callgrind_tool.L2_CACHE
    counts, misses = {}, {}
    for part in ("control", "hooks", "scheduler", "all"):
        child = [sys.executable, __file__, "--serve", "pair", "--requests", str(args.requests), "--callgrind"]
        child += ["--steps", str(args.steps), "--guarded-first"]
        child += ["--control"] if part == "control" else ["--part", part]
        events = callgrind_tool.count(child, args.cache_sim)
        counts[part] = events["Ir"] / args.steps
        line = f"{part}: {counts[part]:,.0f} instructions a step pair"
        if args.cache_sim:
            misses[part] = callgrind_tool.misses(events) / args.steps
            line += f", {misses[part]:,.0f} lines missed in a {cache} cache"
        print(line, flush=True)
    plain = counts["control"] / 2
    print(f"an unguarded engine's step: {plain:,.0f} instructions ({args.steps} decode steps, {args.requests} requests)")
    if args.cache_sim:
        print(f"  and {misses['control'] / 2:,.0f} lines missed a step in the simulated cache ({cache}: size, ways, line)")
    for part in ("hooks", "scheduler", "all"):
        extra = counts[part] - counts["control"]
        line = f"kvguard ({part}): {extra:,.0f} instructions a step = {100 * extra / plain:.2f} % of the unguarded step"
        if args.cache_sim:
            more = misses[part] - misses["control"]
            line += f"; {more:,.0f} lines missed = {100 * more / (misses['control'] / 2):.1f} % of its misses"
        print(line)


def serve_pair(guarded_first: bool) -> None:
    """A child of ``--same-process``: a guarded and an unguarded engine in this one process, the
    hooks installed for both (the unguarded engine's manager has no recorder, and it runs no
    worker check), nothing timed inside kvguard; their decode steps interleaved, the order
    flipped every step. Prints one line: medians of the plain engine's vLLM step, the guarded
    engine's (recorder included), its worker check, and of each step pair's cost (guarded step +
    check - plain step) over the plain step."""
    global hooks
    import kvguard.vllm
    from kvguard.vllm import hooks as h

    hooks = h
    out = sys.__stdout__
    sys.stdout = sys.stderr
    kvguard.vllm.install("enforce")
    if args.part == "hooks":
        # A recorder that records nothing (this child's only recorder is the guarded engine's).
        from kvguard.vllm.recorder import SchedulerRecorder

        for name in ("added", "cached", "dropped", "evicted", "freed", "cache_reset"):
            setattr(SchedulerRecorder, name, lambda *_: None)
        SchedulerRecorder.take = lambda _self: None

    def plain_engine():  # noqa: ANN202
        e = make_engine(False)
        e.scheduler.kv_cache_manager._kvguard_recorder = None  # the hooks pass it by
        return e

    def guarded_engine():  # noqa: ANN202
        # --control: a second unguarded engine in its place (what the method reads for nothing)
        return plain_engine() if args.control else make_engine(True, time_calls=False)

    if guarded_first:
        g = guarded_engine()
        p = plain_engine()
    else:
        p = plain_engine()
        g = guarded_engine()
    if args.callgrind:
        count_phases(p, g)
    plain, guarded, check, ratio = [], [], [], []
    for a, b in interleaved(p.timed_step, g.timed_step):
        plain.append(a[0])
        guarded.append(b[0])
        check.append(b[1])
        ratio.append((b[0] + b[1] - a[0]) / a[0])
    med = statistics.median
    out.write(f"{med(plain)!r} {med(guarded)!r} {med(check)!r} {100 * med(ratio)!r}\n")
    out.flush()


def same_process() -> None:
    """``--same-process``: each round a fresh child holding both engines (which one is built
    first alternates by round)."""
    results = []
    label = "control: none" if args.control else args.part
    for r in range(args.rounds):
        cmd = [sys.executable, __file__, "--serve", "pair", "--requests", str(args.requests), "--clock", args.clock]
        cmd += ["--churn"] if args.churn else []
        cmd += ["--steps", str(args.steps), "--guarded-first" if r % 2 == 0 else "--plain-first"]
        cmd += ["--control"] if args.control else ["--part", args.part]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        reply = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False).stdout.split()
        if len(reply) != 4:
            raise RuntimeError("the bench child died; run it with --serve pair to see why")
        plain, guarded, check, ratio = (float(x) for x in reply)
        results.append(ratio)
        print(
            f"round {r}: vLLM step {plain * 1e6:.1f} us unguarded, {guarded * 1e6:.1f} us guarded (recorder included),"
            f" worker check {check * 1e6:.1f} us: kvguard ({label}) costs {ratio:.2f} % of the unguarded step"
            f" (median of {args.steps} step pairs; {'guarded' if r % 2 == 0 else 'unguarded'} engine built first)",
            flush=True,
        )
    print(
        f"kvguard ({label}) cost / vLLM step over {args.rounds} rounds, same process: min {min(results):.2f} %, "
        f"median {statistics.median(results):.2f} %, max {max(results):.2f} %"
    )


def serve(role: str) -> None:
    """A child: one engine, stepped on each ``step`` line of stdin; answers one line per step
    (vLLM's part, the worker check, whether it was a full decode step); ``new`` starts a fresh
    engine (a new round)."""
    global hooks
    guarded = role == "guarded"
    if guarded:
        from kvguard.vllm import hooks as h

        hooks = h
    e = None
    out = sys.__stdout__
    sys.stdout = sys.stderr  # vLLM's chatter never reaches the protocol
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "new":
            e = make_engine(guarded)
            CLOCK_GAPS.clear()
            out.write(f"{TIMER_NS[0]!r} {TIMER_NS[1]!r}\n")
        elif cmd == "step":
            v, c, r, d = e.timed_step()
            out.write(f"{v!r} {c!r} {r!r} {int(d)} {statistics.median(CLOCK_GAPS)!r}\n")
        out.flush()


class Child:
    def __init__(self, role: str) -> None:
        cmd = [sys.executable, __file__, "--serve", role, "--requests", str(args.requests), "--clock", args.clock]
        cmd += ["--churn"] if args.churn else []
        # The same string hashes in both (set and dict orders inside vLLM alike).
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env
        )

    def ask(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        reply = self.p.stdout.readline()
        if not reply:
            raise RuntimeError(f"the bench child ({cmd}) died; run it with --serve to see why")
        return reply

    def step(self) -> tuple[float, float, float, bool, float]:
        """One step: vLLM's part, the worker check, the recorder, whether it was a full decode
        step, and the median empty clock interval of this engine's steps so far."""
        v, c, r, d, gap = self.ask("step").split()
        return float(v), float(c), float(r), d == "1", float(gap)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def one_round(plain: Child, guarded: Child) -> tuple[float, float]:
    """One round: fresh engines, prefill untimed, then ``--steps`` decode steps. Returns the
    in-process ratio and the two-process ratio (per cent of vLLM's step)."""
    plain.ask("new")
    timer_in, timer_all = (float(x) for x in guarded.ask("new").split())
    t_plain, t_guarded, t_check, t_rec = [], [], [], []
    for p, g in interleaved(plain.step, guarded.step):
        t_plain.append(p[0])
        t_guarded.append(g[0])
        t_check.append(g[1])
        t_rec.append(g[2])
    med = statistics.median
    plain_vllm, guarded_vllm, check, rec = med(t_plain), med(t_guarded), med(t_check), med(t_rec)
    # In process: kvguard's own work per step over the same process's vLLM step without it.
    own = [c + r for c, r in zip(t_check, t_rec)]
    base = [g - r for g, r in zip(t_guarded, t_rec)]
    in_process = 100 * med([o / b for o, b in zip(own, base)])
    hooks_cost = guarded_vllm - plain_vllm
    cost = hooks_cost + check
    ratio = 100 * cost / plain_vllm
    n = args.requests
    print(f"vllm_step/unguarded/{n}:    {plain_vllm * 1e6:9.1f} us  (median; schedule + update + batch build)")
    print(f"vllm_step/guarded/{n}:      {guarded_vllm * 1e6:9.1f} us  (the same, with the recorder hooks)")
    print(f"kvguard/worker_check/{n}:   {check * 1e6:9.1f} us  (in process)")
    print(f"kvguard/recorder/{n}:       {rec * 1e6:9.1f} us  (in process)")
    print(
        f"  (taken off: {g[4] * 1e6:.2f} us per clock interval (median), {timer_in / 1e3:.2f} us per recorder call"
        f" timed, {timer_all / 1e3:.2f} us per timing wrapper)"
    )
    print(
        f"kvguard in process: {med(own) * 1e6:.1f} us = {in_process:.2f} % of the same process's vLLM step"
        f" (median of {args.steps} decode steps' ratios)"
    )
    print(
        f"two processes: {hooks_cost * 1e6:.1f} (guarded - unguarded step) + {check * 1e6:.1f} (check)"
        f" = {cost * 1e6:.1f} us = {ratio:.2f} % of the unguarded step (medians)",
        flush=True,
    )
    return in_process, ratio


def main() -> None:
    plain, guarded = Child("plain"), Child("guarded")
    try:
        rounds = [one_round(plain, guarded) for _ in range(args.rounds)]
    finally:
        plain.close()
        guarded.close()
    for label, ratios in (("in process", [r[0] for r in rounds]), ("two processes", [r[1] for r in rounds])):
        print(
            f"kvguard cost / vLLM step over {args.rounds} rounds, {label}: min {min(ratios):.2f} %, "
            f"median {statistics.median(ratios):.2f} %, max {max(ratios):.2f} %"
        )


parser = argparse.ArgumentParser()
parser.add_argument("--requests", type=int, default=256)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
parser.add_argument(
    "--churn",
    action="store_true",
    help="requests generate 16-127 tokens and each one that finishes is replaced by a new one, "
    "so every step admits, prefills and releases some (every step timed after a warm-up)",
)
parser.add_argument(
    "--same-process", action="store_true", help="both engines in one process, the hooks installed for both (below)"
)
parser.add_argument(
    "--control", action="store_true", help="with --same-process: two unguarded engines (the method's own reading)"
)
parser.add_argument(
    "--part",
    choices=["all", "scheduler", "hooks"],
    default="all",
    help="with --same-process: the part of kvguard the guarded engine runs (below)",
)
parser.add_argument(
    "--instructions",
    action="store_true",
    help="with --same-process: instruction counts (valgrind's callgrind) of each part beside a control",
)
parser.add_argument(
    "--cache-sim",
    action="store_true",
    help="with --instructions: also the lines each part misses in a simulated 2 MiB L2 (slower)",
)
parser.add_argument("--callgrind", action="store_true", help=argparse.SUPPRESS)
parser.add_argument("--serve", choices=["plain", "guarded", "pair"], help=argparse.SUPPRESS)
parser.add_argument("--guarded-first", dest="guarded_first", action="store_true", help=argparse.SUPPRESS)
parser.add_argument("--plain-first", dest="guarded_first", action="store_false", help=argparse.SUPPRESS)
args = parser.parse_args()
if args.requests < 1 or args.rounds < 1 or args.steps < 1:
    parser.error("--requests, --steps and --rounds must be at least 1")
if args.control and not args.same_process and args.serve != "pair":
    parser.error("--control goes with --same-process")
if args.cache_sim and not args.instructions:
    parser.error("--cache-sim goes with --instructions")
if args.instructions and (args.control or args.part != "all" or not args.same_process):
    parser.error("--instructions goes with --same-process alone (it runs every part and the control)")
if args.part != "all" and (args.control or not (args.same_process or args.serve == "pair")):
    parser.error("--part goes with --same-process, not with --control")
_clock = time.thread_time if args.clock == "cpu" else time.perf_counter
hooks = None

if __name__ == "__main__":
    if args.serve == "pair":
        serve_pair(args.guarded_first)
    elif args.serve:
        serve(args.serve)
    elif args.same_process and args.instructions:
        instructions()
    elif args.same_process:
        same_process()
    else:
        main()
