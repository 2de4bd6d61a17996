"""kvguard's share of SGLang 0.5.23's own scheduler step, 256 running requests in steady decode, on CPU.

The step is one iteration of SGLang's ``Scheduler.event_loop_normal`` without the socket read
(``scheduler_rig.step``: ``get_next_batch_to_run``, ``run_batch``, ``process_batch_result``, its
free group and ``stream_output`` included), on SGLang's own ``Scheduler``, pools and radix cache
(on), built by ``scheduler_rig.build_scheduler``. The one stand-in is the model forward: each
layer's KV store through SGLang's real ``MHATokenToKVPool.set_kv_buffer`` (kvguard checks the
forward before it, at ``ModelRunner.forward``'s entry), the next token a vectorised function of the input token and position
(no attention read: the read loop of the test rig's model costs milliseconds per step and
would drown the scheduler). Its share of the step is measured and printed.

Two schedulers in one process, the same workload: one guarded (kvguard attached as its plugin
attaches it, under enforce) and one unguarded. Their steps are interleaved, the order flipped
every step; each round takes the median over its step pairs of (guarded - unguarded) /
unguarded, and the result is the median over the rounds (min and max printed too).
``--control`` puts a second unguarded scheduler in the guarded one's place: what the bench
reads when there is nothing to read (it should be within +-1.5 %). ``--first unguarded`` builds
the unguarded scheduler first (default: the other one first): on this project's shared 2-core
machines the scheduler built second reads faster, so a reading is taken in both orders.

Steps are timed on this thread's CPU time by default (``--clock cpu``; torch kept to one
thread): on a shared machine the time the process spends descheduled is not the step's. What
other processes do to the caches still shows; ``--clock wall`` times with ``perf_counter``.

``--hooks`` (a separate pass, after the measured rounds: the timers cost time themselves):
each kvguard hook's own time per step (the hook's wrapper minus the SGLang call it wraps, so a
hook nested inside another SGLang call counts once), the stand-in forward's time, and the gc
collections of each scheduler's steps.

``--instructions`` counts instructions instead (valgrind's callgrind; needs valgrind): for each
page size, a child with an unguarded scheduler and one with a guarded one, each brought to
steady decode uninstrumented, then ``--pairs`` steps counted (the whole step, as the timings
take it); kvguard's instructions a step beside the unguarded scheduler's. They do not move with
the machine or its load. ``--cache-sim`` adds the lines missed in a simulated 2 MiB L2 (this
machine kind's per-core L2): what the step waits on, which its instructions do not show. The
misses move with the memory layout (a fifth between hash seeds for one build, and as much with
the process's environment at one seed): ``--seeds 0,1,2`` and ``--layouts 4`` take the reading
over several and print their mean, with the range of kvguard's extra over the pairs. ``--skip forward,write`` (repeatable) adds a
guarded child with those parts of kvguard's step left out (:data:`SKIPPABLE`), attributing the
counts to them; measurement only.

Usage: python bench_scheduler_step.py [--rounds N] [--pairs N] [--control] [--hooks] [--clock cpu|wall] [page_size ...]
       python bench_scheduler_step.py --instructions [--cache-sim] [--pairs N] [--seeds S,S,...] [--layouts N]
              [--skip PARTS ...] [--jobs N] [page_size ...]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import types
from collections import defaultdict

import torch
from scheduler_rig import LAYERS, VOCAB, attach_kvguard, build_scheduler, generate_req, step

RUNNING = 256
PROMPT_SHARED = 64
"""Tokens of each group's shared system prompt (radix cache hits for its later requests)."""
GROUPS = 8
CONTEXT = 1024
MAX_NEW = 880


def _lean_model(self, fb):
    """The stand-in forward: each layer's KV store through SGLang's pool, the next token a
    function of the input token and its position (vectorised)."""
    ids = fb.input_ids.to(torch.int64)
    k = ((ids * 131 + fb.positions * 7) % 1009).to(torch.float32)[:, None, None].expand(-1, 1, 4).contiguous()
    for layer in self.layers:
        self.kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, k)
    nxt = (ids * 31 + fb.positions) % (VOCAB - 2) + 2
    if fb.extend_seq_lens is not None:
        nxt = nxt[torch.cumsum(fb.extend_seq_lens, 0) - 1]  # each request's last token
    return nxt.tolist()


def workload(n: int) -> list:
    """``n`` requests in ``GROUPS`` groups sharing a system prompt, each with its own tail of 1 to
    64 tokens (so pages open on different steps), none finishing within the bench."""
    reqs = []
    for i in range(n):
        g = i % GROUPS
        system = [2 + (g * 977 + j * 13) % 30000 for j in range(PROMPT_SHARED)]
        tail = [2 + (i * 7919 + j * 31) % 30000 for j in range(1 + (i * 37) % 64)]
        reqs.append(generate_req(f"r{i}", system + tail, max_new=MAX_NEW))
    return reqs


class _Streamer:
    """A subclass of SGLang's ``SchedulerOutputStreamer`` whose ``stream_output`` is kvguard's
    hook, given to the guarded scheduler only (SGLang's ``HookRegistry`` hooks the class in a
    guarded process; here the unguarded scheduler in the same process must not pay even its
    pass-through)."""

    cls = None

    @classmethod
    def make(cls, plugin):
        if cls.cls is None:
            from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

            inner = SchedulerOutputStreamer.stream_output

            def stream_output(self, reqs, *args, **kwargs):
                return plugin._stream_output(inner, self, reqs, *args, **kwargs)

            cls.cls = type("GuardedOutputStreamer", (SchedulerOutputStreamer,), {"__slots__": (), "stream_output": stream_output})
        return cls.cls


def scheduler(page_size: int, guarded: bool):
    """A scheduler at steady decode: every request admitted and prefilled, ``RUNNING`` decoding."""
    import kvguard.sglang as plugin
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    s = build_scheduler(
        page_size=page_size, tokens=RUNNING * CONTEXT, rows=RUNNING + 8, context_len=CONTEXT, radix_cache=True,
        disable_overlap_schedule=True,
    )
    runner = s.tp_worker.model_runner
    runner._model = types.MethodType(_lean_model, runner)
    if guarded:
        plain = SchedulerOutputStreamer.stream_output
        attach_kvguard(s, "enforce")
        # attach_kvguard hooks the class (as HookRegistry does): move the hook to this
        # scheduler's streamer alone.
        SchedulerOutputStreamer.stream_output = plain
        s.output_streamer.__class__ = _Streamer.make(plugin)
    for r in workload(RUNNING):
        s.handle_generate_request(r)
    for _ in range(200):
        step(s)
        if not s.waiting_queue and len(s.running_batch.reqs) == RUNNING and s.last_batch.forward_mode.is_decode():
            break
    else:
        raise AssertionError("the workload did not reach steady decode")
    for _ in range(5):
        step(s)
    assert len(s.running_batch.reqs) == RUNNING and s.last_batch.forward_mode.is_decode()
    return s


def _check_same(a, b) -> None:
    """Both schedulers ran the same steps (the comparison is of the same work)."""
    ra, rb = a.running_batch.reqs, b.running_batch.reqs
    assert len(ra) == len(rb) == RUNNING, (len(ra), len(rb))
    assert [len(r.output_ids) for r in ra] == [len(r.output_ids) for r in rb]


CLOCK = time.thread_time
"""The step clock: this thread's CPU time (``--clock cpu``, the default: time the process spends
descheduled on a shared machine is not counted) or the wall clock (``--clock wall``)."""


def measure(page_size: int, rounds: int, pairs: int, control: bool, first: str = "other") -> dict:
    gc.collect()
    # Which scheduler is built first matters: on this project's 2-core machines the one built
    # second steps up to ~10 % faster (cause not found). --first says which; run both.
    if first == "other":
        other = scheduler(page_size, guarded=not control)
        base = scheduler(page_size, guarded=False)
    else:
        base = scheduler(page_size, guarded=False)
        other = scheduler(page_size, guarded=not control)
    for _ in range(10):
        step(base)
        step(other)
    _check_same(base, other)
    per_round, tb_all, to_all, fast = [], [], [], []
    clock = CLOCK
    for _ in range(rounds):
        ratios = []
        for i in range(pairs):
            if i % 2 == 0:
                t0 = clock(); step(base); t1 = clock(); step(other); t2 = clock()
                tb, to = t1 - t0, t2 - t1
            else:
                t0 = clock(); step(other); t1 = clock(); step(base); t2 = clock()
                to, tb = t1 - t0, t2 - t1
            ratios.append((to - tb) / tb)
            tb_all.append(tb)
            to_all.append(to)
        per_round.append(statistics.median(ratios))
        fast.append((min(to_all[-pairs:]) - min(tb_all[-pairs:])) / min(tb_all[-pairs:]))
    _check_same(base, other)
    if not control:
        assert other.kvguard.violations == [], other.kvguard.violations[:2]
    return dict(rounds=per_round, fastest=fast, base=tb_all, other=to_all, schedulers=(base, other))


# ---- --hooks: each hook's own time ---------------------------------------------------------------

OWN: dict[str, float] = defaultdict(float)
"""Hook label -> seconds inside the hook's wrapper minus seconds inside the SGLang call it wraps."""
CALLS: dict[str, int] = defaultdict(int)
UNDO: list = []
"""(closure cell, its SGLang call) for every hook instrumented, put back after the pass."""


def _timed_pair(label: str, outer, inner):
    """(outer', inner'): ``outer`` timed as +own and ``inner`` timed as -own under ``label``
    (``perf_counter``, whatever ``--clock`` says: a thread-CPU-time read is a system call that
    would weigh more than the hooks it times)."""
    clock = time.perf_counter

    def timed_inner(*args, **kwargs):
        t = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            OWN[label] -= clock() - t

    def timed_outer(*args, **kwargs):
        t = clock()
        CALLS[label] += 1
        try:
            return outer(*args, **kwargs)
        finally:
            OWN[label] += clock() - t

    return timed_outer, timed_inner


def _cell(fn, name: str):
    names = fn.__code__.co_freevars
    return fn.__closure__[names.index(name)] if name in names else None


def _instrument(obj, attr: str, label: str) -> None:
    """The guard's wrapper ``obj.attr``: its closure's ``inner`` (the SGLang call; or, for the
    request releases, ``freer_call``'s, and for the allocator's releases, ``release``'s) timed
    apart from it."""
    outer = getattr(obj, attr)
    cell = _cell(outer, "inner")
    for via in ("release", "freer_call"):
        if cell is None and (fc := _cell(outer, via)) is not None:
            cell = _cell(fc.cell_contents, "inner")
    timed_outer, timed_inner = _timed_pair(label, outer, cell.cell_contents)
    UNDO.append((cell, cell.cell_contents))
    cell.cell_contents = timed_inner
    setattr(obj, attr, timed_outer)


def instrument_hooks(s) -> None:
    """Every kvguard hook on the guarded scheduler ``s`` (instances, SGLang's module functions,
    the forward and the output streamer)."""
    import kvguard.sglang as plugin
    from scheduler_rig import CpuModelRunner
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache import allocation

    import functools

    g = s.kvguard
    pool, alloc, tree = s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache
    for name in ("alloc", "free", "write"):
        _instrument(pool, name, f"ReqToTokenPool.{name}")
    for name in ("alloc", "alloc_extend", "alloc_decode", "free", "free_page_ids", "_release_page_ids", "free_group_end"):
        if name in vars(alloc):
            _instrument(alloc, name, f"allocator.{name}")
    for name in ("insert", "checkpoint", "free_kv_row", "evict", "_evict"):
        if name in vars(tree):
            _instrument(tree, name, f"{type(tree).__name__}.{name}")
    for mod, name in ((schedule_batch, "alloc_for_decode"), (schedule_batch, "alloc_for_extend"),
                      (allocation, "write_cache_indices")):
        # Process-wide: the unguarded scheduler's calls pass through it too, and count here.
        _instrument(mod, name, f"{mod.__name__.rsplit('.', 1)[1]}.{name} (process-wide: both schedulers' calls)")
    # attach_kvguard's forward is functools.partial(plugin._forward, CpuModelRunner.forward, runner):
    # rebuilt around a timed CpuModelRunner.forward.
    runner = s.tp_worker.model_runner
    label = "ModelRunner.forward (begin/end)"
    fwd_outer, fwd_inner = _timed_pair(label, None, CpuModelRunner.forward)
    runner.forward = _timed_pair(label, functools.partial(plugin._forward, fwd_inner, runner), None)[0]
    # The forward's check (inside the forward's hook): its own label, out of the hook's.
    check_outer = _timed_pair("the forward's check (record + rows)", g.row_check.check, None)[0]
    g.row_check.check = _timed_pair(label, None, check_outer)[1]
    streamer_cls = type(s.output_streamer)
    outer_so = streamer_cls.stream_output
    inner_so = _cell(outer_so, "inner")
    so_outer, so_inner = _timed_pair("SchedulerOutputStreamer.stream_output (rows before output)", outer_so,
                                     inner_so.cell_contents)
    inner_so.cell_contents = so_inner
    streamer_cls.stream_output = so_outer


def hook_pass(page_size: int, steps: int) -> None:
    """Each hook's own time per step, the stand-in forward's time, gc collections per step."""
    base = scheduler(page_size, guarded=False)
    guarded = scheduler(page_size, guarded=True)
    model_time = {"unguarded": 0.0, "guarded": 0.0}
    for name, s in (("unguarded", base), ("guarded", guarded)):
        runner = s.tp_worker.model_runner
        lean = runner._model

        def timed(fb, _lean=lean, _name=name):
            t = CLOCK()
            try:
                return _lean(fb)
            finally:
                model_time[_name] += CLOCK() - t

        runner._model = timed
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache import allocation

    shared = [(schedule_batch, "alloc_for_decode"), (schedule_batch, "alloc_for_extend"),
              (allocation, "write_cache_indices"), (type(guarded.output_streamer), "stream_output")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in shared]
    inner_so = _cell(type(guarded.output_streamer).stream_output, "inner")
    saved_inner = inner_so.cell_contents
    instrument_hooks(guarded)
    OWN.clear()
    CALLS.clear()
    collections = {"unguarded": [0, 0, 0], "guarded": [0, 0, 0]}
    current = ["unguarded"]

    def on_gc(phase, info):
        if phase == "start":
            collections[current[0]][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    step_time = {"unguarded": 0.0, "guarded": 0.0}
    try:
        for i in range(steps):
            for name, s in ((("unguarded", base), ("guarded", guarded)) if i % 2 == 0 else
                            (("guarded", guarded), ("unguarded", base))):
                current[0] = name
                t = CLOCK()
                step(s)
                step_time[name] += CLOCK() - t
    finally:
        gc.callbacks.remove(on_gc)
        # The process-wide hooks back as they were (the next page size's pass instruments anew).
        for obj, name, value in saved:
            setattr(obj, name, value)
        inner_so.cell_contents = saved_inner
        for cell, value in UNDO:
            cell.cell_contents = value
        UNDO.clear()
    assert guarded.kvguard.violations == []
    us = 1e6 / steps
    print(f"  hooks ({steps} steps each, timed: the timers add to both): mean step unguarded "
          f"{step_time['unguarded'] * us:.0f} us, guarded {step_time['guarded'] * us:.0f} us")
    print(f"    stand-in forward (KV stores + next token): unguarded {model_time['unguarded'] * us:.0f} us a step "
          f"({100 * model_time['unguarded'] / step_time['unguarded']:.1f} % of its step); guarded "
          f"{model_time['guarded'] * us:.0f} us (kvguard's forward check is before it, in the forward's hook)")
    total = 0.0
    for label in sorted(OWN, key=lambda k: -OWN[k]):
        if CALLS[label]:
            total += OWN[label]
            print(f"    {label}: {OWN[label] * us:.1f} us own time a step ({CALLS[label] / steps:.2f} calls a step)")
    print(f"    all hooks: {total * us:.1f} us a step ({100 * total / step_time['unguarded']:.1f} % of the unguarded step)")
    for name in ("unguarded", "guarded"):
        c = collections[name]
        print(f"    gc collections in {name} steps: gen0 {c[0]}, gen1 {c[1]}, gen2 {c[2]} ({steps} steps)")


# ---- --instructions: callgrind's counts ------------------------------------------------------------


def _callgrind():
    """The engine benches' callgrind helper (``bindings/python/bench/callgrind.py``)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import callgrind

    return callgrind


#: ``--skip``: each part of kvguard's decode step a guarded child can leave out, to attribute the
#: step's instructions and missed lines (measurement only: the step is then not guarded as
#: kvguard guards it). A name -> what it leaves out, and the function leaving it out of the
#: guarded scheduler ``s``.
SKIPPABLE = {
    "forward": "the decode forward check at the forward's entry (check_decode_forward)",
    "write": "the decode row write's claims (write_decode_rows; only with forward, which would refuse "
             "the unclaimed writes)",
    "output": "the rows checked before output (check_rows_before_output)",
}


def _skip(s, parts: list[str]) -> None:
    """Leaves ``parts`` (names of :data:`SKIPPABLE`) out of the guarded scheduler ``s``'s steps."""
    g = s.kvguard
    if "forward" in parts:
        g.row_check.check = lambda loc: loc
    if "write" in parts:
        g._decode_rows_written = lambda rows, cols, slots: None
    if "output" in parts:
        g.check_rows_before_output = lambda reqs: []


def count_child(page_size: int, guarded: bool, steps: int, skip: list[str]) -> None:
    """A child of ``--instructions`` (under valgrind, instrumentation off): one scheduler at steady
    decode (``skip``: those parts of kvguard's step left out from here on), then callgrind's
    instrumentation on, a few steps run and their counts zeroed, and ``steps`` steps counted,
    Python's cyclic collector off."""
    callgrind = _callgrind()
    s = scheduler(page_size, guarded)
    if skip:
        _skip(s, skip)
    for _ in range(10):
        step(s)
    # The cyclic collector off while counted: its passes land where allocation counts happen to
    # cross its thresholds, inside one child's counted steps and outside another's.
    gc.collect()
    gc.disable()
    callgrind.switch("on")
    for _ in range(callgrind.WARM_STEPS):
        callgrind.counted(step, s)
    callgrind.zero()  # counted from the caches a step leaves, not from empty ones
    for _ in range(steps):
        callgrind.counted(step, s)
    callgrind.switch("off")
    if guarded:
        assert s.kvguard.violations == [], s.kvguard.violations[:2]


def instructions(page_sizes: list[int], steps: int, cache_sim: bool, seeds: list[int], skips: list[str],
                 jobs: int, layouts: int = 1) -> None:
    """``--instructions``: each page size's unguarded and guarded child under callgrind, once per
    hash seed (``seeds``) and memory layout (``layouts``: ``callgrind.count``'s ``layout`` 0 to
    ``layouts - 1``), each seed's reading the mean over its layouts, and the mean over all of them
    printed after the seeds when there are several, with the range of kvguard's extra over the
    pairs (an unguarded and a guarded child of one seed and layout); and a guarded child for each
    of ``skips`` (comma-separated names of :data:`SKIPPABLE`) with those parts left out: what
    they cost is the guarded child's count less its own. ``jobs`` children at a time (their
    counts do not depend on it)."""
    from concurrent.futures import ThreadPoolExecutor

    callgrind = _callgrind()
    callgrind.require("bench_scheduler_step.py")
    kinds = [("unguarded", ""), ("guarded", "")] + [("guarded", sk) for sk in skips]
    samples = [(seed, lay) for seed in seeds for lay in range(layouts)]
    for ps in page_sizes:
        runs = {}
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for seed, lay in samples:
                for kind, sk in kinds:
                    child = [sys.executable, __file__, "--count-child", kind, "--pairs", str(steps), str(ps)]
                    if sk:
                        child += ["--skip", sk]
                    runs[(seed, lay), kind, sk] = pool.submit(callgrind.count, child, cache_sim, seed, lay)
        per = {key: (f.result()["Ir"] / steps, callgrind.misses(f.result()) / steps if cache_sim else 0.0)
               for key, f in runs.items()}
        for seed in seeds + (["mean"] if len(samples) > 1 and len(seeds) > 1 else []):
            over = samples if seed == "mean" else [x for x in samples if x[0] == seed]

            def at(kind: str, sk: str = "", over: list = over) -> tuple[float, float]:
                return (statistics.fmean(per[x, kind, sk][0] for x in over),
                        statistics.fmean(per[x, kind, sk][1] for x in over))

            (ir_u, miss_u), (ir_g, miss_g) = at("unguarded"), at("guarded")
            extra = ir_g - ir_u
            where = f"seed {seed}" if seed != "mean" else f"mean of seeds {' '.join(map(str, seeds))}"
            if layouts > 1:
                where += f", {layouts} layouts"
            line = (f"page_size {ps}, {where}: unguarded step {ir_u:,.0f} instructions, guarded {ir_g:,.0f}: "
                    f"kvguard {extra:,.0f} instructions a step = {100 * extra / ir_u:+.2f} %")
            if cache_sim:
                more = miss_g - miss_u
                line += (f"; lines missed in a simulated {callgrind.L2_CACHE} cache {miss_u:,.0f} unguarded, "
                         f"kvguard {more:,.0f} more = {100 * more / miss_u:+.1f} %")
                if len(over) > 1:
                    pairs = [per[x, "guarded", ""][1] - per[x, "unguarded", ""][1] for x in over]
                    line += f" (pairs {min(pairs):,.0f} to {max(pairs):,.0f})"
            print(f"{line} ({steps} decode steps, {RUNNING} running)", flush=True)
            for sk in skips:
                ir_s, miss_s = at("guarded", sk)
                line = f"    without {sk}: {ir_g - ir_s:,.0f} instructions a step less"
                if cache_sim:
                    line += f", {miss_g - miss_s:,.0f} lines missed less"
                print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="kvguard's share of SGLang's own scheduler step (256 running, CPU)")
    parser.add_argument("page_sizes", nargs="*", type=int, default=[16, 1], help="page sizes (default: 16 1)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (default 6; at least 6 for a reading)")
    parser.add_argument("--pairs", type=int, default=20, help="step pairs per round (default 20)")
    parser.add_argument("--control", action="store_true", help="two unguarded schedulers (the bench's own noise)")
    parser.add_argument("--hooks", action="store_true", help="also each hook's own time, the forward's, gc")
    parser.add_argument("--first", choices=("other", "unguarded"), default="other",
                        help="which scheduler is built first: the guarded one (or the control's second; default) "
                        "or the unguarded one")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this thread's CPU time (default; steady on a shared machine); wall: perf_counter")
    parser.add_argument("--instructions", action="store_true",
                        help="instruction counts (callgrind) of --pairs steps, guarded beside unguarded")
    parser.add_argument("--cache-sim", action="store_true",
                        help="with --instructions: also the lines missed in a simulated 2 MiB L2 (slower)")
    parser.add_argument("--seeds", default="0", metavar="S,S,...",
                        help="with --instructions: PYTHONHASHSEED of each pair of children, comma-separated "
                        "(default 0); several: a reading over as many memory layouts, the mean printed after them")
    parser.add_argument("--layouts", type=int, default=1, metavar="N",
                        help="with --instructions: each seed's children run at N memory layouts (default 1), their "
                        "mean read; the simulated misses move with the layout by hundreds of lines a step")
    parser.add_argument("--skip", action="append", default=[], metavar="PARTS",
                        help="with --instructions: also a guarded child with these parts of kvguard's step left out "
                        "(comma-separated: " + ", ".join(SKIPPABLE) + "; repeatable), to attribute the counts; "
                        "measurement only")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="with --instructions: children run at a time (default: 2 or the cpus, if fewer)")
    parser.add_argument("--count-child", choices=("guarded", "unguarded"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.rounds < 1 or opts.pairs < 1 or any(ps < 1 for ps in opts.page_sizes):
        parser.error("--rounds, --pairs and page sizes must be at least 1")
    if opts.instructions and (opts.control or opts.hooks):
        parser.error("--instructions goes without --control and --hooks")
    if opts.cache_sim and not opts.instructions:
        parser.error("--cache-sim goes with --instructions")
    try:
        seeds = [int(x) for x in opts.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, not {opts.seeds!r}")
    if len(set(seeds)) != len(seeds) or any(not 0 <= x <= 4294967295 for x in seeds):
        parser.error("--seeds: distinct hash seeds, each 0 to 4294967295")
    skips = [",".join(sorted(set(sk.split(",")))) for sk in opts.skip]
    for sk in skips:
        unknown = [p for p in sk.split(",") if p not in SKIPPABLE]
        if unknown:
            parser.error(f"--skip: no part named {unknown[0]!r} (the parts: {', '.join(SKIPPABLE)})")
        if "write" in sk.split(",") and "forward" not in sk.split(","):
            parser.error("--skip write goes with forward (the forward check refuses writes nobody claimed): "
                         "--skip forward,write")
    if (skips or seeds != [0] or opts.layouts != 1) and not (opts.instructions or opts.count_child):
        parser.error("--seeds, --layouts and --skip go with --instructions")
    if opts.jobs < 1 or opts.layouts < 1:
        parser.error("--jobs and --layouts must be at least 1")

    if opts.count_child:
        torch.set_num_threads(1)
        count_child(opts.page_sizes[0], opts.count_child == "guarded", opts.pairs,
                    skips[0].split(",") if skips else [])
        return
    if opts.instructions:
        instructions(opts.page_sizes, opts.pairs, opts.cache_sim, seeds, skips, opts.jobs, opts.layouts)
        return

    global CLOCK
    CLOCK = time.thread_time if opts.clock == "cpu" else time.perf_counter
    # One thread does the work (torch's intra-op pool would put CPU time on other threads).
    torch.set_num_threads(1)
    print(f"clock {opts.clock}; load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} on {os.cpu_count()} cpus; "
          f"{'control: two unguarded schedulers' if opts.control else 'guarded (enforce) beside unguarded'}; "
          f"{opts.rounds} rounds x {opts.pairs} step pairs; built first: "
          f"{'the unguarded' if opts.first == 'unguarded' else 'the second unguarded' if opts.control else 'the guarded'}")
    for ps in opts.page_sizes:
        m = measure(ps, opts.rounds, opts.pairs, opts.control, opts.first)
        r = sorted(m["rounds"])
        med_b, med_o = statistics.median(m["base"]), statistics.median(m["other"])
        what = "second unguarded" if opts.control else "guarded"
        print(f"page_size {ps}: step unguarded {med_b * 1e3:.2f} ms, {what} {med_o * 1e3:.2f} ms (medians); "
              f"mean {statistics.fmean(m['base']) * 1e3:.2f} / {statistics.fmean(m['other']) * 1e3:.2f} ms "
              f"({100 * (statistics.fmean(m['other']) / statistics.fmean(m['base']) - 1):+.2f} %: every step, "
              f"those a median leaves out too); "
              f"share median of rounds {100 * statistics.median(r):+.2f} % "
              f"(rounds min {100 * r[0]:+.2f} / max {100 * r[-1]:+.2f} %)")
        print("    rounds: " + " ".join(f"{100 * x:+.2f}" for x in m["rounds"]))
        f = sorted(m["fastest"])
        print(f"    fastest step of each round, {what} against unguarded: median {100 * statistics.median(f):+.2f} % "
              f"(min {100 * f[0]:+.2f} / max {100 * f[-1]:+.2f} %)")
        del m
        gc.collect()
        if opts.hooks and not opts.control:
            hook_pass(ps, opts.rounds * opts.pairs)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
