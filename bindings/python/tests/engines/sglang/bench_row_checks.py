"""kvguard's whole-row checks inside SGLang 0.5.23's scheduler, timed call by call.

A decode forward checks only each row's new tokens; whole rows are checked every
``full_check_every``-th forward (64) and before a request's output leaves
(``Guard.check_rows_before_output``, at each send: every 50 tokens for a non-streamed request).
They fall on one step in 50 or 64, so the median step of ``bench_scheduler_step.py`` never sees
them. This runs the same workload (256 requests in steady decode, radix cache on, the model
forward a CPU stand-in; a guarded scheduler beside an unguarded one, steps alternating) and
times each of those calls: per call, and spread over the steps.

Usage: python bench_row_checks.py [--steps N] [page_size ...]
"""

from __future__ import annotations

import argparse
import collections
import runpy
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description="kvguard's whole-row checks in SGLang's scheduler")
    parser.add_argument("page_sizes", nargs="*", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=300, help="steps timed (default 300)")
    opts = parser.parse_args()
    if opts.steps < 1 or any(ps < 1 for ps in opts.page_sizes):
        parser.error("--steps and page sizes must be at least 1")
    bench = runpy.run_path(str(Path(__file__).with_name("bench_scheduler_step.py")), run_name="bench")
    import kvguard.sglang.forward as forward
    import kvguard.sglang.guard as guard

    total: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    def timed(inner, name):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total[name] += time.perf_counter() - t
                calls[name] += 1

        return call

    guard.Guard.check_rows_before_output = timed(guard.Guard.check_rows_before_output, "output check (whole rows)")
    forward.HostRowCheck._verify_rows = timed(forward.HostRowCheck._verify_rows, "forward's row check")

    class Table:
        """The guard's table with its whole-row call timed (everything else passed through)."""

        def __init__(self, table):
            self.__dict__["_t"] = table
            self.__dict__["verify_step_rows"] = timed(table.verify_step_rows, "verify_step_rows (both)")

        def __getattr__(self, name):
            return getattr(self._t, name)

    for ps in opts.page_sizes:
        g = bench["scheduler"](ps, guarded=True)
        u = bench["scheduler"](ps, guarded=False)
        g.tp_worker.model_runner.req_to_token_pool.kvguard_guard.table = Table(
            g.tp_worker.model_runner.req_to_token_pool.kvguard_guard.table
        )
        for _ in range(10):
            bench["step"](g)
            bench["step"](u)
        total.clear()
        calls.clear()
        guarded = 0.0
        for _ in range(opts.steps):
            t = time.perf_counter()
            bench["step"](g)
            guarded += time.perf_counter() - t
            bench["step"](u)
        n = opts.steps
        print(f"page_size {ps}: guarded step {guarded / n * 1e6:.0f} us (mean, wall), {n} steps")
        for name in sorted(total):
            print(f"    {name}: {total[name] / max(calls[name], 1) * 1e6:.0f} us a call, {calls[name]} calls, "
                  f"{total[name] / n * 1e6:.1f} us a step spread over the steps")
        assert g.kvguard.violations == []


if __name__ == "__main__":
    main()
