"""Where vLLM's worker check spends its time: the whole check (``worker_step``) against its one
binding call (``OwnershipTable.apply_record_and_verify_step``), per decode step of the
``vllm_step.py`` engine (256 running requests), median over its full decode steps; with
``--prewarm check`` a pure ``check_step`` of the same rows runs right before the call (it pulls
the table's state and the block table into cache), with ``--prewarm np`` numpy sums the step's
block-table rows and counts first (only the engine's arrays in cache). What a prewarm takes off
the call is what the call pays in cache misses for what that prewarm touched: the rest of vLLM's
step evicts it between two checks.

    VLLM_TARGET_DEVICE=cpu python bindings/python/bench/vllm_worker_parts.py [--prewarm none|check|np]
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
parser = argparse.ArgumentParser()
parser.add_argument("--prewarm", choices=["none", "check", "np"], default="none")
args = parser.parse_args()
sys.argv = [sys.argv[0], "--requests", "256"]
bench = runpy.run_path(str(Path(__file__).with_name("vllm_step.py")), run_name="bench")
now = time.perf_counter_ns


class Timed:
    """The guard's table, its worker-step call timed (everything else passed through)."""

    def __init__(self, table: object) -> None:
        self.__dict__.update(_table=table, call_ns=0, prewarm_ns=0)

    def __getattr__(self, name: str) -> object:
        return getattr(self._table, name)

    def apply_record_and_verify_step(self, early, req_ids, block_table, computed, scheduled, late):  # noqa: ANN001, ANN201
        t = now()
        if args.prewarm == "check":
            self._table.check_step(req_ids, block_table, computed)
        elif args.prewarm == "np":
            int(block_table[: len(req_ids)].sum()) + int(computed.sum())
        self.__dict__["prewarm_ns"] = now() - t
        t = now()
        out = self._table.apply_record_and_verify_step(early, req_ids, block_table, computed, scheduled, late)
        self.__dict__["call_ns"] = now() - t
        return out


engine = bench["make_engine"](True, time_calls=False)
timed = None
steps = []
for _ in range(2000):
    step = engine.timed_step()
    guard = getattr(engine, "_kvguard", None)
    if guard is not None and timed is None:
        timed = guard.table = Timed(guard.table)
    if step[3]:
        steps.append((step[0], step[1], timed.call_ns, timed.prewarm_ns))
    elif steps:
        break  # the requests began to finish: the full decode steps are over
med = statistics.median
print(f"{len(steps)} full decode steps of 256 requests, medians (prewarm: {args.prewarm}):")
print(f"  vLLM's step {med(s[0] for s in steps) * 1e6:.1f} us (the thread's CPU time)")
print(f"  worker check {med(s[1] for s in steps) * 1e6:.1f} us, the prewarm included")
print(f"  its binding call {med(s[2] for s in steps) / 1e3:.1f} us; the prewarm {med(s[3] for s in steps) / 1e3:.1f} us")
