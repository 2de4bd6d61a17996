"""SGLang's decode row write against its plugin's mirror alone (``OwnershipTable.write_decode_rows``,
the core's ``write_decode_rows``), warm, in a loop: 256 rows at page size 16, each writing its
next token's slot into a page it owns (the steady decode step: nothing to claim). Prints the
median µs a call, five runs of 200 calls. Inside SGLang's step it runs cold
(``tests/engines/sglang/bench_scheduler_step.py --hooks``).

    python bindings/python/bench/row_write.py
"""

import statistics
import time

import kvguard
import numpy as np

R, PS, P = 256, 16, 4
pages = R * P + 1
t = kvguard.OwnershipTable(kvguard.PoolConfig(pages, PS, P * PS, reserved=[0]))
keys = np.arange(1, R + 1, dtype=np.int64)
owner = np.zeros(pages + 1, dtype=np.int64)
slots = np.zeros(R, dtype=np.int64)
for r in range(R):
    t.admit(int(keys[r]), "t%d" % (r % 8), P * PS, 0)
    own = list(range(1 + r * P, 1 + (r + 1) * P))
    t.claim(int(keys[r]), own)
    owner[own] = keys[r]
    slots[r] = own[-1] * PS + 5
claimants = keys.copy()
prefix = np.zeros(pages + 1, dtype=np.int64)
checked = np.zeros(R, dtype=np.int64)
rows = np.arange(R, dtype=np.int64)
cols = np.array([(P - 1) * PS + 5], dtype=np.int64)
meds = []
for _ in range(5):
    ts = []
    for _ in range(200):
        checked[:] = (P - 1) * PS + 5
        t0 = time.perf_counter_ns()
        r = t.write_decode_rows(keys, claimants, owner, prefix, checked, rows, cols, slots)
        ts.append(time.perf_counter_ns() - t0)
        assert r is None, r
    meds.append(statistics.median(ts) / 1e3)
print("write_decode_rows, 256 rows, page size 16, warm: median of 200 calls, 5 runs (us):", " ".join(f"{m:.2f}" for m in meds))
