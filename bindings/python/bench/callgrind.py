"""Counting a bench's steps under valgrind's callgrind: a child run with instrumentation off until
it turns it on, the switch the child turns, and the totals read back.

Instruction counts and simulated cache misses do not move with the machine drawn or its load, so
the engine benches (``vllm_step.py --instructions``, SGLang's ``bench_scheduler_step.py
--instructions``) report them beside their timings.
"""

from __future__ import annotations

import operator
import os
import shutil
import subprocess
import sys
import tempfile
import time

#: The cache ``--cache-sim`` simulates as callgrind's last level: a 2 MiB, 16-way L2 of 64-byte
#: lines, the per-core L2 of the Intel Xeon machines these benches run on (their L3 holds both
#: engines whole: a line that misses the L2 is the latency a step waits on).
L2_CACHE = "2097152,16,64"

#: The simulated cache's misses: instruction lines, data lines read and written.
MISSES = ("ILmr", "DLmr", "DLmw")


def require(bench: str) -> None:
    """Exits with a clear message when valgrind is not installed."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit(f"{bench} --instructions: valgrind is not installed (apt-get install valgrind)")


#: Bytes of :data:`LAYOUT_VAR` per step of ``layout`` (:func:`count`).
LAYOUT_BYTES = 48

#: The environment variable whose length :func:`count`'s ``layout`` sets (nothing reads it).
LAYOUT_VAR = "KVGUARD_BENCH_LAYOUT"


def count(child: list[str], cache_sim: bool, seed: int = 0, layout: int = 0) -> dict[str, int]:
    """Runs ``child`` (a command line) under callgrind, instrumentation off until the child turns
    it on (:func:`switch`), collecting only inside :data:`COLLECTED`, with ``PYTHONHASHSEED`` set
    to ``seed`` (the same string hashes in every child of one seed: dict and set orders, and what
    they touch, alike) and :data:`LAYOUT_VAR` set to ``layout`` times :data:`LAYOUT_BYTES` bytes
    (the process's stack and first allocations shifted, nothing else changed); ``cache_sim``:
    the caches simulated, the last level as :data:`L2_CACHE`.

    The simulated misses move with the memory layout, not only with the code: the same SGLang
    child at four ``layout`` values (the same instructions to within 0.1 %) read 6,441 to 7,206
    lines a step guarded and 3,745 to 4,550 unguarded, so kvguard's extra 1,890 to 3,461 (2026-12-07).
    A reading of misses is taken over several seeds and layouts, and a difference between builds
    of less than that spread is not read from one pair. Returns the totals by event name;
    RuntimeError if the child failed."""
    with tempfile.TemporaryDirectory() as out:
        out_file = os.path.join(out, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}"]
        cmd += ["--collect-atstart=no", f"--toggle-collect={COLLECTED}"]
        if cache_sim:
            cmd += ["--cache-sim=yes", f"--LL={L2_CACHE}"]
        env = {**os.environ, "PYTHONHASHSEED": str(seed), LAYOUT_VAR: "x" * (LAYOUT_BYTES * layout)}
        done = subprocess.run(cmd + child, capture_output=True, text=True, env=env, check=False)
        events = totals(out_file) if done.returncode == 0 and os.path.exists(out_file) else {}
    if "Ir" not in events:
        raise RuntimeError(f"the bench child under valgrind failed ({' '.join(child[1:])}): {done.stderr[-2000:]}")
    return events


def _control(*args: str) -> None:
    """Runs ``callgrind_control ARGS <this pid>`` and spins until it is done. Not a blocking wait:
    valgrind takes the command while this process runs code, and a process blocked in a wait
    can leave it unanswered (a hang seen here); the spin runs outside the collected function."""
    p = subprocess.Popen(["callgrind_control", *args, str(os.getpid())], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while p.poll() is None:
        if time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"callgrind_control {' '.join(args)} did not finish in 300 s")
    if p.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} failed ({p.returncode})")


def switch(state: str) -> None:
    """Turns callgrind's instrumentation of this process ``on`` or ``off``."""
    _control("-i", state)


def zero() -> None:
    """Zeroes this process's counts so far (the simulated caches keep their contents): called
    after a few warm-up steps, so the counted steps start from the caches a step leaves, not from
    empty ones."""
    _control("-z")


def counted(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    """``fn(*args, **kwargs)`` inside :data:`COLLECTED`, the one C function the children collect in."""
    return operator.call(fn, *args, **kwargs)


#: What the children collect in (``--toggle-collect``): ``operator.call``'s C function, which
#: neither engine calls.
COLLECTED = "_operator_call"


#: Steps run with instrumentation on before the counts are zeroed (:func:`zero`).
WARM_STEPS = 4


def totals(out_file: str) -> dict[str, int]:
    """A callgrind output file's totals by event name (``Ir``; with the caches simulated also
    :data:`MISSES` and the rest); empty when it has none."""
    names: list[str] = []
    values: list[int] = []
    with open(out_file) as f:
        for line in f:
            if line.startswith("events:"):
                names = line.split()[1:]
            elif line.startswith("totals:"):
                values = [int(x) for x in line.split()[1:]]
    return dict(zip(names, values))


def misses(events: dict[str, int]) -> int:
    """Lines missed in the simulated last-level cache."""
    return sum(events[e] for e in MISSES)
