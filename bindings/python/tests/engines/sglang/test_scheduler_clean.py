"""Clean workloads through SGLang's own Scheduler (scheduler_rig.py): under enforce every request
is served with the outputs of an unguarded run, no page is lost, nothing is refused. The guarded
runs take SGLang's GPU branch of the extend row write (write_req_to_token_pool_triton, run by
Triton's interpreter on CPU tensors); the unguarded reference takes its CPU branch (the same rows,
written by ReqToTokenPool.write, much faster here)."""

from __future__ import annotations

import functools
import random

import pytest
from scheduler_rig import allocation, attach_kvguard, build_scheduler, generate_req, pool_pages, run, step

POOL = {1: 640, 16: 2560}
"""Tokens in the pool by page size: a few requests' worth, so the radix cache is evicted all the
time and requests wait for pages."""


def workload(seed: int, n: int, tenants=("acme", "zeta", "kilo")):
    """Multi-tenant traffic: shared system prompts per tenant (radix hits), random tails and
    output lengths."""
    rng = random.Random(seed)
    systems = {t: [rng.randrange(2, 30000) for _ in range(rng.randrange(20, 70))] for t in tenants}
    reqs = []
    for i in range(n):
        t = rng.choice(tenants)
        prompt = systems[t] + [rng.randrange(2, 30000) for _ in range(rng.randrange(1, 40))]
        reqs.append(generate_req(f"{t}-{i}", prompt, max_new=rng.randrange(1, 10), salt=t))
    return reqs


def scheduler(page_size: int, *, triton: bool, overlap: bool = False, graph_decode: bool = True):
    """SGLang's Scheduler on a small pool; decode forwards as SGLang's captured CUDA graph replays
    them (``graph_decode``, its default on a GPU: no Python per layer) or eager."""
    return build_scheduler(
        page_size=page_size, tokens=POOL[page_size], rows=24, context_len=256, disable_overlap_schedule=not overlap,
        graph_decode=graph_decode,
    )


@functools.lru_cache(maxsize=None)
def unguarded(page_size: int, n: int):
    """The reference: the same workload without kvguard (outputs, pages at start and end)."""
    s = scheduler(page_size, triton=False)
    start = pool_pages(s)
    out = run(s, workload(1, n))
    return out, start, pool_pages(s)


class Spy:
    """Counts frees SGLang makes inside a free group (deferred to free_group_end), and the radix
    cache's evictions."""

    def __init__(self, s):
        self.grouped = self.evicted = 0
        alloc, tree = s.token_to_kv_pool_allocator, s.tree_cache
        for name in ("free", "free_page_ids"):
            setattr(alloc, name, self._counting(alloc, getattr(alloc, name)))
        # SGLang's default cache (UnifiedRadixCache) evicts through _evict, whether asked
        # (evict) or short of pages at an allocation (evict_for_alloc); RadixCache through evict.
        name = "_evict" if hasattr(tree, "_evict") else "evict"
        evict = getattr(tree, name)

        def counting_evict(*args, **kwargs):
            result = evict(*args, **kwargs)
            self.evicted += result.num_tokens_evicted
            return result

        setattr(tree, name, counting_evict)

    def _counting(self, alloc, inner):
        def free(ids, *args, **kwargs):
            self.grouped += alloc.free_group is not None and ids.numel() > 0
            return inner(ids, *args, **kwargs)

        return free


@pytest.fixture
def triton_rows(monkeypatch):
    """SGLang's GPU branch of the extend row write: write_req_to_token_pool_triton (CPU tensors,
    TRITON_INTERPRET=1) instead of ReqToTokenPool.write."""
    monkeypatch.setattr(allocation, "support_triton", lambda backend: True)
    calls = []
    real = allocation.write_req_to_token_pool_triton

    class Launch:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(allocation, "write_req_to_token_pool_triton", Launch())
    return calls


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy,n", [("enforce", 1000), ("report", 200)])
def test_clean_workload_on_a_small_pool(triton_rows, page_size, policy, n):
    want, start, end = unguarded(page_size, n)
    assert len(want) == n and end == start
    assert all(reason["type"] == "length" for _, reason in want.values())

    s = scheduler(page_size, triton=True)
    spy = Spy(s)
    guard = attach_kvguard(s, policy)
    got = run(s, workload(1, n))
    assert guard.violations == [] and guard.aborted == {}
    assert got == want  # every request served, token for token as without kvguard
    assert pool_pages(s) == start  # no page lost
    snap = guard.table.snapshot()
    assert snap.requests == 0 and snap.owned == 0
    assert len(triton_rows) > 0 and spy.grouped > 0 and spy.evicted > 0
    assert s.tp_worker.model_runner.graph_forwards > 0  # decode batches replayed as a captured graph
    print(f"page_size={page_size} {policy}: {len(got)} requests served, pages {start} -> {pool_pages(s)}, "
          f"{len(triton_rows)} Triton row writes, {spy.grouped} frees in free groups, {spy.evicted} tokens evicted")


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_with_eager_decode(triton_rows, page_size):
    """Decode forwards run eager (SGLang's path for a batch larger than its largest captured
    graph, or under --disable-cuda-graph: every layer's KV store a Python call); kvguard checks
    the forward at its entry either way. Under enforce: every request served as without kvguard,
    no page lost, no violation."""
    n = 200
    want, start, _ = unguarded(page_size, n)
    s = scheduler(page_size, triton=True, graph_decode=False)
    guard = attach_kvguard(s, "enforce")
    got = run(s, workload(1, n))
    assert s.tp_worker.model_runner.graph_forwards == 0
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_in_the_overlap_event_loop(triton_rows, page_size):
    """SGLang's overlap schedule (event_loop_overlap): each batch launched before the previous
    one's result is processed. Under enforce: every request served with the outputs of the
    unguarded normal loop, no page lost, no violation."""
    n = 300
    want, start, _ = unguarded(page_size, n)
    s = scheduler(page_size, triton=True, overlap=True)
    assert s.enable_overlap
    guard = attach_kvguard(s, "enforce")
    got = run(s, workload(1, n))
    assert s.overlapped > 0  # results processed after the next batch was launched
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_with_chunked_prefill(triton_rows, page_size):
    """Chunked prefill (--chunked-prefill-size 48): long prompts prefilled in chunks, each later
    chunk's prefix read from the request's own row and its pages cached by checkpoint between
    chunks. Under enforce: every request served as without kvguard, no page lost."""
    n = 200

    def chunked(guarded):
        s = build_scheduler(page_size=page_size, tokens=POOL[page_size], rows=24, context_len=256, chunked_prefill_size=48)
        s.chunks = 0
        checkpoint = s.tree_cache.checkpoint

        def counting(req, *a, **k):
            s.chunks += not req.finished()  # a chunk cached before the next
            return checkpoint(req, *a, **k)

        s.tree_cache.checkpoint = counting
        guard = attach_kvguard(s, "enforce") if guarded else None
        start = pool_pages(s)
        return s, guard, start, run(s, workload(2, n))

    _, _, start, want = chunked(False)
    s, guard, start2, got = chunked(True)
    assert start2 == start and len(want) == n and s.chunks > 0
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_with_mixed_chunks(triton_rows, page_size):
    """``--enable-mixed-chunk``: a new request's prefill (chunk) runs in one forward with the
    running requests' decode (SGLang's ``mix_with_running``: two batches prepared, one forward
    of both, its own forward mode). Under enforce: every request served as without kvguard, no
    violation, no page lost."""
    n = 200

    def mixed(guarded):
        s = build_scheduler(page_size=page_size, tokens=POOL[page_size], rows=24, context_len=256,
                            chunked_prefill_size=48, enable_mixed_chunk=True)
        s.mixed = 0
        run_batch = s.run_batch

        def counting(batch, *a, **k):
            s.mixed += batch.forward_mode.is_mixed()
            return run_batch(batch, *a, **k)

        s.run_batch = counting
        guard = attach_kvguard(s, "enforce") if guarded else None
        start = pool_pages(s)
        return s, guard, start, run(s, workload(3, n))

    _, _, start, want = mixed(False)
    s, guard, start2, got = mixed(True)
    assert start2 == start and len(want) == n and s.mixed > 0, "mixed forwards ran"
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0


def retracting(monkeypatch) -> list[str]:
    """SGLang's own retraction test mode (TEST_RETRACT: every 5th forward retracts decoding
    requests through retract_decode); returns the list the retracted requests' rids go to."""
    import sglang.srt.managers.scheduler as scheduler_module
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    monkeypatch.setattr(scheduler_module, "TEST_RETRACT", True)
    monkeypatch.setattr(scheduler_module, "TEST_RETRACT_INTERVAL", 5)
    retracted: list[str] = []
    real = ScheduleBatch.retract_decode

    def counting(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        retracted.extend(r.rid for r in out[0])
        return out

    monkeypatch.setattr(ScheduleBatch, "retract_decode", counting)
    return retracted


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_with_retraction(triton_rows, monkeypatch, page_size):
    """SGLang's own retraction test mode (TEST_RETRACT: every 5th forward, update_running_batch
    retracts decoding requests through retract_decode, releasing their rows and pages while
    they are unfinished, and requeues them). Under enforce: no request refused, outputs as
    without kvguard, no page lost; the retracted requests get new rows, so none stays suspect."""
    retracted = retracting(monkeypatch)
    n = 200
    plain = scheduler(page_size, triton=True)
    start = pool_pages(plain)
    want = run(plain, workload(3, n))
    plain_retracted = len(retracted)
    s = scheduler(page_size, triton=True)
    guard = attach_kvguard(s, "enforce")
    got = run(s, workload(3, n))
    assert plain_retracted > 0 and len(retracted) > plain_retracted
    assert guard.violations == [] and guard.aborted == {}
    assert got == want and len(got) == n
    assert pool_pages(s) == start
    assert guard._suspects == {}
    assert guard.table.snapshot().requests == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_retracted_request_aborted_while_waiting_is_no_suspect_after(triton_rows, monkeypatch, page_size):
    """A request SGLang retracted (its row given back unfinished: a suspect until it gets a new
    one, each batch checked for it) and a client aborts while it waits to be resumed (SGLang's
    abort_request pops it from the waiting queue): kvguard forgets it as a suspect too (before,
    it stayed one for the life of the server and every batch after paid the suspects' check)."""
    from sglang.srt.managers.io_struct import AbortReq

    retracted = retracting(monkeypatch)
    s = scheduler(page_size, triton=True)
    guard = attach_kvguard(s, "enforce")
    start = pool_pages(s)
    pending = workload(3, 40)
    rids = [r.rid for r in pending]
    aborted = []
    for _ in range(5_000):
        for r in pending[:4]:
            s.handle_generate_request(r)
        del pending[:4]
        batch = step(s)
        if not aborted:
            for r in s.waiting_queue:
                if r.rid in retracted and not any(o != r.rid and o.startswith(r.rid) for o in rids):
                    aborted.append(r.rid)
                    s.abort_request(AbortReq(rid=r.rid))
                    break
        if not pending and batch is None and not s.waiting_queue and s.running_batch.is_empty():
            break
    assert aborted, "no retracted request was aborted while waiting: the test checks nothing"
    assert guard.violations == [] and guard.aborted == {}
    assert guard._suspects == {}
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_with_client_aborts(triton_rows, page_size):
    """Clients abort requests mid-flight (SGLang's own abort_request: waiting ones popped,
    running ones finished with an abort and released by process_batch_result). Under enforce:
    kvguard refuses nothing, every request ends as without kvguard, no page lost."""
    from sglang.srt.managers.io_struct import AbortReq

    n = 200

    def aborting(guarded):
        s = scheduler(page_size, triton=True)
        guard = attach_kvguard(s, "enforce") if guarded else None
        start = pool_pages(s)
        pending = workload(4, n)
        ends = {}
        for k in range(100_000):
            for r in pending[:4]:
                s.handle_generate_request(r)
            del pending[:4]
            if k % 3 == 1:
                victims = [r.rid for r in s.running_batch.reqs[:1]] + [r.rid for r in s.waiting_queue[:1]]
                for rid in victims:
                    s.abort_request(AbortReq(rid=rid))
            batch = step(s)
            if not pending and batch is None and not s.waiting_queue and s.running_batch.is_empty():
                break
        for payload in s.outputs.sent:
            for i, rid in enumerate(payload.rids):
                if payload.finished_reasons[i] is not None:
                    ends[rid] = payload.finished_reasons[i]["type"]
        return s, guard, start, ends

    _, _, start, want = aborting(False)
    s, guard, _, got = aborting(True)
    assert sum(t == "abort" for t in want.values()) > 0
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0
    snap = guard.table.snapshot()
    assert snap.requests == 0 and snap.owned == 0, "a request aborted while queued is forgotten"


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_streamed_workload(triton_rows, page_size):
    """Every request streamed (its output leaves a piece per step, each after its whole row is
    checked): under enforce nothing refused, the pieces add up to the unguarded run's outputs."""
    n = 200

    def streamed():
        reqs = workload(5, n)
        for r in reqs:
            r.stream = True
        return reqs

    plain = scheduler(page_size, triton=True)
    start = pool_pages(plain)
    want = run(plain, streamed())
    s = scheduler(page_size, triton=True)
    guard = attach_kvguard(s, "enforce")
    got = run(s, streamed())
    assert len(want) == n and sum(len(p.rids) for p in s.outputs.sent) > n  # streamed in pieces
    assert guard.violations == [] and guard.aborted == {}
    assert got == want
    assert pool_pages(s) == start
    assert guard.table.snapshot().requests == 0


@functools.lru_cache(maxsize=None)
def unguarded_across_a_flush(page_size: int, n: int):
    """The reference for a flush: ``workload(1, n)``, SGLang's ``flush_cache``, then
    ``workload(2, n)``, without kvguard (each run's outputs, pages after the flush and at the end)."""
    s = scheduler(page_size, triton=False)
    first = run(s, workload(1, n))
    assert s.flush_cache()
    flushed = pool_pages(s)
    return first, flushed, run(s, workload(2, n)), pool_pages(s)


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_after_sglangs_flush_cache_are_served_as_without_kvguard(triton_rows, page_size):
    """SGLang's ``flush_cache`` (its ``/flush_cache`` endpoint, taken when no request runs or
    waits; a PD role switch does the same) resets the radix cache and frees every row and page at
    once, through none of the calls kvguard judges. kvguard follows (the allocator's ``clear``):
    the requests after it are served with the unguarded run's outputs, nothing is refused and no
    page is lost; before, each was refused for writing a page the flushed cache still held, and
    SGLang then found the pages kvguard withheld missing from its pool."""
    first, flushed, second, end = unguarded_across_a_flush(page_size, 60)
    s = scheduler(page_size, triton=True)
    guard = attach_kvguard(s, "enforce")
    assert run(s, workload(1, 60)) == first
    held = guard.table.snapshot()
    assert held.prefixes > 0 and held.shared > 0, "the radix cache holds pages before the flush"
    assert s.flush_cache()
    snap = guard.table.snapshot()
    assert snap.requests == 0 and snap.owned == 0 and snap.shared == 0 and snap.prefixes == 0
    assert pool_pages(s) == flushed
    assert run(s, workload(2, 60)) == second
    assert guard.violations == [] and guard.aborted == {}
    assert pool_pages(s) == end
