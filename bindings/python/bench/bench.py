#!/usr/bin/env python3
"""The Python binding's cost against the Rust core, measured in the same run.

    python bindings/python/bench/bench.py        (from the repository root, kvguard installed)

1. verify_step on a 256 x 256 int32 block table (65,536 pages, all clean) from Python, against
   the Rust criterion bench `decode_step/guarded` (the same step: 256 sequences x 4,096 tokens,
   page size 16). Target: at most 1.2x.
2. A one-row verify_step call's fixed cost (one request, one page). Target: at most 3 us.
3. record_step_writes of a 256-sequence decode step (one token each, int64 slot mapping) against
   the Rust criterion bench `decode_step/writes`. Target: at most 1.2x.

The Rust figures come from `cargo bench --bench ownership -- decode_step`, run by this script
just before the Python measurements (criterion's median estimate).
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvguard

ROOT = Path(__file__).resolve().parents[3]
UNITS = {"ps": 1e-12, "ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def rust_figures():
    """Median seconds of decode_step/guarded and decode_step/writes, from criterion."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "ownership", "--", "decode_step/(guarded|writes)",
         "--warm-up-time", "1", "--measurement-time", "3"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    figures = {}
    for name in ("guarded", "writes"):
        m = re.search(rf"decode_step/{name}\s+time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", out)
        if not m:
            sys.exit(f"could not read decode_step/{name} from criterion's output:\n{out}")
        figures[name] = float(m.group(1)) * UNITS[m.group(2)]
    return figures


def best_of(f, repeat=7, number=200):
    """Median of the mean time per call over `repeat` runs of `number` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            f()
        times.append((time.perf_counter() - t0) / number)
    times.sort()
    return times[len(times) // 2]


def main():
    rust = rust_figures()
    ps, seqs, tokens = 16, 256, 4096
    per_seq = tokens // ps
    table = kvguard.OwnershipTable(kvguard.PoolConfig(seqs * per_seq + 1, ps, tokens, reserved=[0]))
    rows = []
    for s in range(seqs):
        table.admit(s, s % 8, tokens, 0)
        rows.append([r.page for r in table.allocate(s, per_seq)])
        table.record_write_tokens(s, rows[-1], 0, tokens)
    bt = np.array(rows, dtype=np.int32)
    lens = np.full(seqs, tokens, dtype=np.int32)
    ids = list(range(seqs))
    assert table.verify_step(ids, bt, lens).clean
    step = best_of(lambda: table.verify_step(ids, bt, lens))
    str_table = kvguard.OwnershipTable(kvguard.PoolConfig(seqs * per_seq + 1, ps, tokens, reserved=[0]))
    str_ids = [f"cmpl-{s:032x}" for s in range(seqs)]
    for s, rid in enumerate(str_ids):
        str_table.admit(rid, f"tenant-{s % 8}", tokens, 0)
        str_table.claim(rid, rows[s])
        str_table.record_write_tokens(rid, rows[s], 0, tokens)
    assert str_table.verify_step(str_ids, bt, lens).clean
    step_str = best_of(lambda: str_table.verify_step(str_ids, bt, lens))

    one_bt, one_len, one_id = bt[:1, :1], lens[:1].copy(), [0]
    one_len[0] = ps
    assert table.verify_step(one_id, one_bt, one_len).clean
    one = best_of(lambda: table.verify_step(one_id, one_bt, one_len), number=20_000)

    wt = kvguard.OwnershipTable(kvguard.PoolConfig(seqs * 256 + 1, ps, tokens, reserved=[0]))
    slots = []
    for s in range(seqs):
        wt.admit(s, s % 8, tokens, 0)
        slots.append(wt.allocate(s, 1)[0].page * ps + 3)
    slot_mapping = np.array(slots, dtype=np.int64)
    qsl = np.arange(seqs + 1, dtype=np.int32)
    assert wt.record_step_writes(ids, slot_mapping, qsl).clean
    writes = best_of(lambda: wt.record_step_writes(ids, slot_mapping, qsl), number=2000)

    print(f"verify_step 256x256 int32 (int ids): python {step * 1e6:9.2f} us  rust decode_step/guarded "
          f"{rust['guarded'] * 1e6:9.2f} us  ratio {step / rust['guarded']:.3f}  (target <= 1.2)")
    print(f"verify_step 256x256 int32 (str ids): python {step_str * 1e6:9.2f} us  ratio {step_str / rust['guarded']:.3f}")
    print(f"verify_step one row, fixed cost:     python {one * 1e6:9.3f} us  (target <= 3 us)")
    print(f"record_step_writes 256 seqs:         python {writes * 1e6:9.2f} us  rust decode_step/writes "
          f"{rust['writes'] * 1e6:9.2f} us  ratio {writes / rust['writes']:.3f}  (target <= 1.2)")
    print(f"RESULT step_ratio={step / rust['guarded']:.4f} step_str_ratio={step_str / rust['guarded']:.4f} "
          f"one_row_us={one * 1e6:.4f} writes_ratio={writes / rust['writes']:.4f}")


if __name__ == "__main__":
    main()
