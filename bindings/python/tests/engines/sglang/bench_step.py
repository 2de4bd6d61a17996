"""Per-step cost of kvguard at 256 running requests on CPU, with and without it, in one run.

One step = what SGLang's allocator and cache bookkeeping do for a decode step (alloc, the
req_to_token write, the KV store at one layer) plus, guarded, kvguard's hooks on those calls and
the forward-batch check. Usage: python bench_step.py [page_size]"""

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

    ctx = sglang_context.__wrapped__()
    next(ctx)
    for ps in [int(a) for a in sys.argv[1:]] or [16, 1]:
        base = run(ps, False)
        guard = run(ps, True)
        print(f"page_size {ps}: step without kvguard {base * 1e6:.0f} us, with {guard * 1e6:.0f} us, "
              f"kvguard {100 * (guard - base) / base:.1f} % of the step")
