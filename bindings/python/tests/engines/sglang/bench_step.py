"""Per-step cost of kvguard at 256 running requests on CPU, with and without it, interleaved.

One step = what SGLang's allocator and cache bookkeeping do for a decode step (alloc, the
req_to_token write, the KV store at one layer, the scheduler's per-request length updates) plus,
guarded, kvguard's hooks on those calls and the forward-batch check. Runs alternate unguarded and
guarded engines (the machine may be shared), each the median of its steps; the ratio
(guarded - unguarded) / unguarded is reported as min / median / max over the pairs.
Usage: python bench_step.py [--pairs N] [page_size ...]"""

from __future__ import annotations

import statistics
import sys
import time

from harness import Engine


def run(page_size: int, guarded: bool, n: int = 256, steps: int = 60) -> float:
    eng = Engine(page_size=page_size, tokens=n * 512, rows=n + 8, context_len=1024)
    if guarded:
        eng.install("enforce")
    reqs = [eng.request(f"r{i}", [i % 50 + 1] * 8 + list(range(1000 + i, 1000 + i + 200)), max_new=400) for i in range(n)]
    for r in reqs:
        eng.submit(r)
    for i in range(0, n, 32):
        eng.prefill(reqs[i : i + 32])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.decode()
        times.append(time.perf_counter() - t)
    if guarded:
        assert eng.guard.violations == [], eng.guard.violations[:2]
    return statistics.median(times[10:])


if __name__ == "__main__":
    from harness import sglang_context

    args = sys.argv[1:]
    pairs = 5
    if args[:1] == ["--pairs"]:
        pairs, args = int(args[1]), args[2:]
    ctx = sglang_context.__wrapped__()
    next(ctx)
    for ps in [int(a) for a in args] or [16, 1]:
        base, guard, ratio = [], [], []
        for _ in range(pairs):
            b = run(ps, False)
            g = run(ps, True)
            base.append(b)
            guard.append(g)
            ratio.append((g - b) / b)
        r = sorted(ratio)
        print(
            f"page_size {ps}: step without kvguard {statistics.median(base) * 1e6:.0f} us, with "
            f"{statistics.median(guard) * 1e6:.0f} us (medians of {pairs}); kvguard's share of the "
            f"step min/median/max {100 * r[0]:.1f} / {100 * statistics.median(r):.1f} / {100 * r[-1]:.1f} %"
        )
