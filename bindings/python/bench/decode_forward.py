"""SGLang's decode forward check alone (``OwnershipTable.check_decode_forward``, the core's
``decode_forward``), warm, in a loop: 256 rows x 4,096 token slots (``req_to_token``, int32),
page size 16, each row writing its 4,096th token's slot and reading its window from token 4,095
(the row's checked length set back to 4,095 before each call). Prints the median µs a call, five
runs of 200 calls. What the call costs with everything in cache; inside SGLang's step it runs
cold (``tests/engines/sglang/bench_scheduler_step.py --hooks``).

    python bindings/python/bench/decode_forward.py
"""

import statistics
import time

import kvguard
import numpy as np

R, T, PS = 256, 4096, 16
P = T // PS
t = kvguard.OwnershipTable(kvguard.PoolConfig(R * P + 1, PS, T, reserved=[0]))
rt = np.zeros((R, T), dtype=np.int32)
keys = np.arange(1, R + 1, dtype=np.int64)
for r in range(R):
    t.admit(int(keys[r]), "t%d" % (r % 8), T, 0)
    pages = list(range(1 + r * P, 1 + (r + 1) * P))
    t.claim(int(keys[r]), pages)
    rt[r] = (np.repeat(np.array(pages, dtype=np.int64) * PS, PS) + np.tile(np.arange(PS), P)).astype(np.int32)
    t.record_step_writes([int(keys[r])], rt[r, : T - 1].astype(np.int64), [0, T - 1])
rows = np.arange(R, dtype=np.int64)
lens = np.full(R, T, dtype=np.int64)
loc = rt[:, T - 1].astype(np.int64)
checked = np.zeros(R, dtype=np.int64)
claimants = keys.copy()
meds = []
for _ in range(5):
    ts = []
    for _ in range(200):
        checked[:] = T - 1
        t0 = time.perf_counter_ns()
        r = t.check_decode_forward(keys, claimants, checked, rt, rows, lens, loc)
        ts.append(time.perf_counter_ns() - t0)
        assert r is None, r
    meds.append(statistics.median(ts) / 1e3)
print("check_decode_forward µs (median of 200, 5 runs):", " ".join(f"{m:.1f}" for m in meds))
