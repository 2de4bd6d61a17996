"""Per-step cost of kvguard at 256 running requests on CPU, with and without it, interleaved.

One step = what SGLang's allocator and cache bookkeeping do for a decode step (alloc, the
req_to_token write, the KV store at one layer, the scheduler's per-request length updates) plus,
guarded, kvguard's hooks on those calls and the forward-batch check. Runs alternate unguarded and
guarded engines (the machine may be shared), each the median of its steps; the ratio
(guarded - unguarded) / unguarded is reported as min / median / max over the pairs.
Also the fastest step of each engine (min over its steps, over the pairs), guarded against
unguarded: on a loaded machine the medians swing, the fastest steps much less.
``--hooks``: also each kvguard hook's median time per step (over the guarded runs), so a loaded
machine's noise in the ratio can be told from kvguard's own time.
Usage: python bench_step.py [--pairs N] [--hooks] [page_size ...]"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

from harness import Engine


HOOKS: dict[str, list[float]] = defaultdict(list)
"""Per-hook step times of the guarded runs (``--hooks``)."""


def _timed(obj, name: str, label: str) -> None:
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            HOOKS[label].append(time.perf_counter() - t)

    setattr(obj, name, call)


def _time_hooks(eng: Engine) -> None:
    g = eng.guard
    _timed(g, "_decode_rows_written", "ReqToTokenPool.write (write_decode_rows)")
    _timed(g.row_check, "begin", "begin_forward")
    _timed(g.row_check, "check", "the forward's check (record + row check)")
    _timed(g.row_check, "_verify_rows", "  of which the row check (window or full)")
    _timed(g.row_check, "end", "end_forward")


def run(page_size: int, guarded: bool, n: int = 256, steps: int = 60, hooks: bool = False) -> tuple[float, float]:
    """(median, fastest) step time of one engine, the first 10 steps left out."""
    eng = Engine(page_size=page_size, tokens=n * 512, rows=n + 8, context_len=1024)
    if guarded:
        eng.install("enforce")
    reqs = [eng.request(f"r{i}", [i % 50 + 1] * 8 + list(range(1000 + i, 1000 + i + 200)), max_new=400) for i in range(n)]
    for r in reqs:
        eng.submit(r)
    for i in range(0, n, 32):
        eng.prefill(reqs[i : i + 32])
    if guarded and hooks:
        _time_hooks(eng)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.decode()
        times.append(time.perf_counter() - t)
    if guarded:
        assert eng.guard.violations == [], eng.guard.violations[:2]
    return statistics.median(times[10:]), min(times[10:])


if __name__ == "__main__":
    from harness import sglang_context

    parser = argparse.ArgumentParser(description="kvguard's share of an SGLang decode step (256 running requests, CPU)")
    parser.add_argument("page_sizes", nargs="*", type=int, default=[16, 1], help="page sizes to measure (default: 16 1)")
    parser.add_argument("--pairs", type=int, default=5, help="unguarded/guarded pairs per page size (default: 5)")
    parser.add_argument("--hooks", action="store_true", help="also print each hook's median time")
    opts = parser.parse_args()
    if opts.pairs < 1 or any(ps < 1 for ps in opts.page_sizes):
        parser.error("--pairs and page sizes must be at least 1")
    pairs, hooks = opts.pairs, opts.hooks
    ctx = sglang_context.__wrapped__()
    next(ctx)
    for ps in opts.page_sizes:
        base, guard, ratio = [], [], []
        fastest_base, fastest_guard = [], []
        HOOKS.clear()
        for _ in range(pairs):
            b, fb = run(ps, False)
            g, fg = run(ps, True, hooks=hooks)
            fastest_base.append(fb)
            fastest_guard.append(fg)
            base.append(b)
            guard.append(g)
            ratio.append((g - b) / b)
        r = sorted(ratio)
        print(
            f"page_size {ps}: step without kvguard {statistics.median(base) * 1e6:.0f} us, with "
            f"{statistics.median(guard) * 1e6:.0f} us (medians of {pairs}); kvguard's share of the "
            f"step min/median/max {100 * r[0]:.1f} / {100 * statistics.median(r):.1f} / {100 * r[-1]:.1f} %"
        )
        fb, fg = min(fastest_base), min(fastest_guard)
        print(f"    fastest steps: {fb * 1e6:.0f} -> {fg * 1e6:.0f} us ({100 * (fg - fb) / fb:+.1f} %)")
        for label, times in HOOKS.items():
            print(f"    {label}: {statistics.median(times) * 1e6:.1f} us (median of {len(times)} calls)")
