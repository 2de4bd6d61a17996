"""What opening an array costs on the step path: `python bench_arrays.py` (not a pytest module).

Times `verify_step` over a 256x256 int32 block table (every row a clean read of its request's
pages) and over a 1-row table, for a numpy array that owns its memory, a numpy view of one, and
(where torch imports) a torch CPU tensor and its `.numpy()` view. The 1-row call is almost all
argument handling: three arrays opened (req_ids, the table, seq_lens) beside a one-row check."""

import sys
import time

import numpy as np

import kvguard

PAGE = 16


def table_with(rows, width):
    t = kvguard.OwnershipTable(kvguard.PoolConfig(rows * width + 2, PAGE, width * PAGE + 1, reserved=[0]))
    bt = np.zeros((rows, width), dtype=np.int32)
    for i in range(rows):
        t.admit(i, 0, width * PAGE, 1)
        pages = [r.page for r in t.allocate(i, width)]
        t.record_write_tokens(i, pages, 0, width * PAGE)
        bt[i] = pages
    return t, bt


def per_call_ns(f, n):
    f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


class DLPackOnly:
    """A host tensor seen only through DLPack (what a torch CPU tensor offers), over numpy."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)


def main():
    forms = {"numpy (owner)": lambda a: a, "numpy view (a[:])": lambda a: a[:], "DLPack over numpy": DLPackOnly}
    try:
        import torch

        forms["torch CPU tensor"] = torch.from_numpy
        forms["torch .numpy() view"] = lambda a: torch.from_numpy(a.copy()).numpy()
    except ImportError:
        print("torch not importable: torch forms skipped", file=sys.stderr)
    for rows, width, n in [(256, 256, 2000), (1, 4, 100000)]:
        t, bt = table_with(rows, width)
        ids = np.arange(rows, dtype=np.int64)
        lens = np.full(rows, width * PAGE, dtype=np.int32)
        for name, form in forms.items():
            a, i, l = form(bt), form(ids), form(lens)
            assert t.verify_step(i, a, l).clean
            ns = per_call_ns(lambda: t.verify_step(i, a, l), n)
            print(f"verify_step {rows}x{width} {name:22s} {ns:10.0f} ns/call")


if __name__ == "__main__":
    main()
