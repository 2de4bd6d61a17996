"""SGLang's strict idle memory check after kvguard refused a free that names no freer.

``PageReleases._stray_free_ok`` refuses three kinds of free (under enforce the pages stay out of
SGLang's free list): of a page a live request holds alone, of a page the radix cache holds, and
of a page the allocator never handed out (a double free). SGLang's idle check
(``Scheduler.on_idle`` -> ``SchedulerInvariantChecker._check_all_pools``, strict by default:
a leak raises in the event loop) counts free + evictable + protected + the running requests'
pages against the pool. Each test injects one refused free through SGLang's own allocator
``free``, runs SGLang's scheduler (scheduler_rig.py) until it idles with the check strict, and
asserts the check ran, found no leak, and the pool is whole: kvguard neither trips the check
nor hides a page (no page is in SGLang's free list twice, none is handed to two requests)."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from scheduler_rig import attach_kvguard, build_scheduler, finish, pool_pages, prompt_reqs
from scheduler_rig import loop_step as step

PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16])


@pytest.fixture
def idle_checks(monkeypatch):
    """SGLang's idle check strict (its default, set explicitly), and each pool check it runs
    recorded: (leak, messages)."""
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "true")
    seen = []
    inner = SchedulerInvariantChecker._check_all_pools

    def _check_all_pools(self, ps, uncached=0):
        out = inner(self, ps, uncached)
        seen.append(out)
        return out

    monkeypatch.setattr(SchedulerInvariantChecker, "_check_all_pools", _check_all_pools)
    return seen


def scheduler(page_size, policy="enforce"):
    s = build_scheduler(page_size=page_size, tokens=1024 if page_size == 16 else 512, rows=8, context_len=256)
    return s, attach_kvguard(s, policy)


def started(s, n=3):
    for r in prompt_reqs(24):
        s.handle_generate_request(r)
    for _ in range(1 + n):
        step(s)
    return {r.rid: r for r in s.running_batch.reqs}


def free_list(s):
    return s.token_to_kv_pool_allocator.get_all_free_pages()


def idle_clean(s, checks, start):
    """The scheduler run to idle: SGLang's strict check ran after the injection and found no
    leak, no page is in the free list twice, and every page is back (free or evictable)."""
    before = len(checks)
    finish(s)
    step(s)  # one more idle pass, so the check runs on the final state
    assert len(checks) > before, "SGLang's idle check ran"
    assert all(not leak for leak, _ in checks[before:]), checks[before:]
    allp = free_list(s)
    assert len(torch.unique(allp)) == len(allp)
    assert pool_pages(s) == start


@PAGE_SIZES
def test_a_live_requests_pages_freed_by_no_request(idle_checks, page_size):
    """Kind 1, the pages still counted by SGLang with their request: a stray free of r1's row
    (its own pages and the cached prompt pages it reads) is refused; r1 frees them through its
    row when it finishes, and the idle check balances."""
    s, guard = scheduler(page_size)
    start = pool_pages(s)
    live = started(s)
    r1 = live["r1"]
    slots = s.req_to_token_pool.req_to_token[r1.kv.req_pool_idx, : r1.kv.kv_committed_len].to(torch.int64)
    s.token_to_kv_pool_allocator.free(slots.clone())  # the bug
    assert guard.violations and {v.kind for v in guard.violations} == {"foreign_page"}
    idle_clean(s, idle_checks, start)
    assert guard.aborted == {}


@pytest.mark.parametrize("page_size,decodes", [(1, 3), (16, 3), (16, 8)])
def test_a_decode_steps_pages_freed_by_sglangs_error_path(idle_checks, page_size, decodes):
    """Kind 1, freed by SGLang's own error path: ``alloc_for_decode`` writes the step's slots
    into the rows (kvguard claims them for their requests), then its auxiliary allocation fails
    and SGLang frees ``out_cache_loc`` through the allocator's ``free`` and raises (the test
    catches it, and the scheduler steps on). The free is refused while the requests live (pages
    their rows name). A page the step opened (page size 1; 16 after 8 decodes: 40 + 8 = 48)
    SGLang no longer counts: it goes back when its request's row does (before the fix it was
    lost and SGLang's strict idle check raised). A page already open (16 after 3 decodes: the
    whole page of slot 43, which SGLang's paged free names) its request still counts and frees
    itself: it goes back then, once. The idle check balances, nothing is lost."""
    s, guard = scheduler(page_size)
    start = pool_pages(s)
    started(s, n=decodes)
    pool = s.req_to_token_pool
    inner = pool.alloc_aux_to_lengths
    failed = []

    def alloc_aux_to_lengths(**kwargs):
        if not failed:
            failed.append(kwargs)
            raise RuntimeError("aux pool out of memory")  # the injected failure
        return inner(**kwargs)

    pool.alloc_aux_to_lengths = alloc_aux_to_lengths
    with pytest.raises(RuntimeError, match="aux pool"):
        step(s)
    assert failed
    assert guard.violations and {v.kind for v in guard.violations} == {"foreign_page"}
    idle_clean(s, idle_checks, start)
    assert guard.aborted == {}


@PAGE_SIZES
def test_a_cached_page_freed_by_no_request(idle_checks, page_size):
    """Kind 2: with every request finished, a stray free of a page the radix cache holds is
    refused; the tree still counts it (evictable), the idle check balances, and its eviction
    gives it back once."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s, guard = scheduler(page_size)
    start = pool_pages(s)
    started(s)
    finish(s)
    cached = s.tree_cache.all_values_flatten()
    page = int(cached[0]) // page_size
    s.token_to_kv_pool_allocator.free(torch.tensor([page * page_size], dtype=torch.int64))  # the bug
    assert [(v.kind, v.page) for v in guard.violations] == [("foreign_page", page)]
    assert page not in free_list(s).tolist()
    idle_clean(s, idle_checks, start)
    s.tree_cache.evict(EvictParams(num_tokens=10_000))
    assert s.tree_cache.evictable_size() == 0 and free_list(s).tolist().count(page) == 1
    idle_clean(s, idle_checks, start)


@PAGE_SIZES
@pytest.mark.parametrize("when", ["running", "idle"])
def test_a_free_page_freed_again(idle_checks, page_size, when):
    """Kind 3: a second free of a page already in SGLang's free list (a double free) is
    refused; the free list keeps one copy and the idle check balances (without kvguard it
    would count the page twice)."""
    s, guard = scheduler(page_size)
    start = pool_pages(s)
    started(s)
    if when == "idle":
        finish(s)
    page = int(free_list(s).min())
    s.token_to_kv_pool_allocator.free(torch.arange(page * page_size, (page + 1) * page_size, dtype=torch.int64))
    assert [(v.kind, v.page) for v in guard.violations] == [("double_free", page)]
    idle_clean(s, idle_checks, start)
