"""vLLM's worker step call (``OwnershipTable.apply_record_and_verify_step``) with a decode step's
events in the plain form its recorder hands them (tuples headed by a str enum's members, str
request ids, lists of ints), read straight into the core's batch, beside the same events handed
as iterators, which the binding parses in full (one owned event each, then the batch): the
difference is what reading the events costs. 256 requests of 8 pages at page size 16, each step
writing and reading one token a row; the early events 18 claims of a fresh page and the 18
releases of the step before's, the late ones 13 publishes of a full page (by requests outside
the rows, admitted, given and written before the call and released after it, untimed).

Prints the median µs a call for each form, warm (call after call) and cold (a 64 MiB sweep
between calls evicts the table, the events and the arrays from the caches, as vLLM's own step
does), the two forms interleaved call by call, five rounds. ``--only plain|parsed --steps N``
runs one form alone and untimed, for callgrind
(``--toggle-collect='*__pymethod_apply_record_and_verify_step__'``; ``--cold`` sweeps before
each call, for its cache simulation: ``--cache-sim=yes``). ``--no-events``: the same
steps handed no events (the rows' and writes' share alone; the two forms are then the same call).
``--torch``: the block table and the computed counts as vLLM keeps them, numpy views of torch CPU
tensors (needs torch). ``--pages N``: rows of N pages instead of 8 (a context of about 16 N
tokens: what the rows' comparison with their checked copies costs as contexts grow).

    python bindings/python/bench/step_events.py [--only plain|parsed --steps N] [--no-events] [--torch] [--pages N]
"""

from __future__ import annotations

import argparse
import enum
import statistics
import time

import kvguard
import numpy as np

R, PS, P, WIDTH = 256, 16, 8, 128
CLAIMS, PUBLISHES = 18, 13


class Kind(enum.StrEnum):
    """The recorder's event names (``kvguard.vllm.recorder.EventKind``)."""

    CLAIM = "claim"
    PUBLISH = "publish"
    EVICT = "evict"
    RELEASE_PAGES = "release_pages"


#: ``--torch``: the block table and the computed counts as vLLM keeps them, numpy views of torch
#: CPU tensors (``CpuGpuBuffer.np``: each view's base is a tensor, whose memory the binding checks
#: the view against every call).
TORCH = False


def host_array(shape: tuple[int, ...]):  # noqa: ANN201
    """A zeroed int32 array: numpy's own, or (``--torch``) a view of a torch CPU tensor."""
    if TORCH:
        import torch

        return torch.zeros(shape, dtype=torch.int32).numpy()
    return np.zeros(shape, dtype=np.int32)


def build():  # noqa: ANN201
    pages = R * P + 2 * CLAIMS + PUBLISHES + 1
    t = kvguard.OwnershipTable(kvguard.PoolConfig(pages, PS, WIDTH * PS, reserved=[0]))
    ids = [f"cmpl-{r:08x}-0000-4000-8000-{r:012x}" for r in range(R)]
    bt = host_array((R, WIDTH))
    tokens = P * PS - 4  # the last page partly written
    for r, rid in enumerate(ids):
        t.admit(rid, f"t{r % 8}", WIDTH * PS, 0)
        own = list(range(1 + r * P, 1 + (r + 1) * P))
        t.claim(rid, own)
        bt[r, :P] = own
        slots = np.array([own[k // PS] * PS + k % PS for k in range(tokens - 1)], dtype=np.int64)
        t.record_step_writes([rid], slots, np.array([0, len(slots)], dtype=np.int64))
    computed = host_array((R,))
    computed[:] = tokens - 1
    scheduled = np.ones(R, dtype=np.int32)
    return t, ids, bt, computed, scheduled, list(range(R * P + 1, pages))


def steps(t, ids, spare, events: bool = True):  # noqa: ANN001, ANN201
    """The events of step after step: (early, late, after). The late publishes are of pages 13
    requests outside the rows filled before the step (admitted, given and written untimed),
    released and evicted untimed after it (``after``). ``events`` False: the same requests come
    and go, and the call is handed no events."""
    k = 0
    claimed: list[tuple[str, int]] = []
    while not events:
        pids = [f"pub-{k}-{j}" for j in range(PUBLISHES)]
        for pid in pids:
            t.admit(pid, "t0", PS, 0)

        def release(pids=pids) -> None:  # noqa: ANN001
            for pid in pids:
                t.release(pid)

        k += 1
        yield [], [], release
    while True:
        early = [(Kind.RELEASE_PAGES, rid, [p]) for rid, p in claimed]
        free = [p for p in spare if p not in {q for _, q in claimed}]
        claimed = [(ids[(k * CLAIMS + j * 7) % R], free[j]) for j in range(CLAIMS)]
        early += [(Kind.CLAIM, rid, [p]) for rid, p in claimed]
        late = []
        publishers = free[CLAIMS : CLAIMS + PUBLISHES]
        for j, p in enumerate(publishers):
            pid, key = f"pub-{k}-{j}", 10_000 + k * PUBLISHES + j
            t.admit(pid, "t0", PS, 0)
            t.claim(pid, [p])
            # Its own call, not a step's: a step's call reads req_ids through the ids the
            # worker call remembers by position, which a one-request step would displace.
            t.record_write_tokens(pid, [p], 0, PS)
            late.append((Kind.PUBLISH, pid, key, (p,)))

        def after(late=late) -> None:  # noqa: ANN001
            for _, pid, key, _ in late:
                t.release(pid)
                t.evict_prefix(key)

        k += 1
        yield early, late, after


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["plain", "parsed"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-events", dest="events", action="store_false", help="the rows alone: no events")
    parser.add_argument("--cold", action="store_true", help="with --only: a 64 MiB sweep before each call")
    parser.add_argument("--torch", action="store_true", help="the arrays as vLLM keeps them: views of torch tensors")
    parser.add_argument("--pages", type=int, default=8, help="pages a row (a context of about 16 a page)")
    args = parser.parse_args()
    global TORCH, P, WIDTH
    TORCH = args.torch
    if args.pages < 2:
        parser.error("--pages: at least 2")
    P, WIDTH = args.pages, max(WIDTH, args.pages + 8)
    t, ids, bt, computed, scheduled, spare = build()
    stream = steps(t, ids, spare, args.events)

    def call(form: str, early: list, late: list) -> None:
        if form == "parsed":
            early, late = iter(early), iter(late)
        refused_early, w, refused_late, r = t.apply_record_and_verify_step(early, ids, bt, computed, scheduled, late)
        assert not refused_early and w.clean and not refused_late and r.clean, (refused_early, refused_late)

    sweep = np.zeros(64 << 20, dtype=np.uint8)
    if args.only:
        for _ in range(args.steps):
            early, late, after = next(stream)
            if args.cold:
                sweep += 1
            call(args.only, early, late)
            after()
        return
    for cold in (False, True):
        rounds: dict[str, list[float]] = {"plain": [], "parsed": []}
        for _ in range(5):
            times: dict[str, list[int]] = {"plain": [], "parsed": []}
            for i in range(100):
                for form in ("plain", "parsed") if i % 2 else ("parsed", "plain"):
                    early, late, after = next(stream)
                    if cold:
                        sweep += 1
                    t0 = time.perf_counter_ns()
                    call(form, early, late)
                    times[form].append(time.perf_counter_ns() - t0)
                    after()
            for form, ts in times.items():
                rounds[form].append(statistics.median(ts) / 1e3)
        for form, meds in rounds.items():
            print(
                f"step_events/{'cold' if cold else 'warm'}/{form}: "
                + " ".join(f"{m:.1f}" for m in meds)
                + f" us (median a call, five rounds; "
                + (f"{CLAIMS * 2} early + {PUBLISHES} late events)" if args.events else "no events)")
            )


if __name__ == "__main__":
    main()
