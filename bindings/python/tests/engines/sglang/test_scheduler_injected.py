"""Bugs injected into SGLang's own Scheduler as it runs (scheduler_rig.py, the Triton row write):
each caught on the step where it happens, on the right request; under enforce only that request
is aborted, and every other request's output is the unguarded run's."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from scheduler_rig import (
    PROMPTS, attach_kvguard, build_scheduler, finish, generate_req, pool_pages, prompt_reqs, run, sent_since,
)
from scheduler_rig import loop_step as step


def reqs(max_new=24):
    return prompt_reqs(max_new)


def scheduler(page_size, policy="enforce", *, overlap=False, handed="free_list"):
    """SGLang's Scheduler, guarded under ``policy``. ``handed``: how kvguard knows the pages the
    allocator handed out: ``free_list`` (read from SGLang's free list, as for SGLang's own
    allocators) or ``marks`` (each page marked as it is handed out, as for an allocator kvguard
    does not know: here SGLang's, as a subclass)."""
    s = build_scheduler(
        page_size=page_size, tokens=1024 if page_size == 16 else 512, rows=8, context_len=256,
        disable_overlap_schedule=not overlap,
    )
    if handed == "marks":
        alloc = s.token_to_kv_pool_allocator
        alloc.__class__ = type("UnknownAllocator", (type(alloc),), {})
    guard = attach_kvguard(s, policy) if policy else None
    if guard is not None:
        alloc = s.token_to_kv_pool_allocator
        assert ("alloc" in vars(alloc)) == (handed == "marks"), "the allocator's pages marked or not as asked"
    return s, guard


HANDED = pytest.mark.parametrize("handed", ["free_list", "marks"])


@pytest.fixture(scope="module")
def unguarded():
    out = {}
    for ps in (1, 16):
        s, _ = scheduler(ps, policy=None)
        out[ps] = run(s, reqs())
    return out


def started(s, n=3):
    """The requests in, a prefill and ``n`` decode steps run."""
    for r in reqs():
        s.handle_generate_request(r)
    for _ in range(1 + n):
        step(s)
    return {r.rid: r for r in s.running_batch.reqs}


def row(s, req):
    return s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64)


def free_pages(s):
    return set(s.token_to_kv_pool_allocator.get_all_free_pages().tolist())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_stray_free_of_a_live_requests_pages(triton_rows, unguarded, page_size, overlap):
    """A free that names no freer (not free_kv_row, evict or checkpoint) of pages r1 still maps:
    refused on the free (foreign_page: r1's own pages, and the cached prompt pages the radix
    cache holds), the pages stay out of SGLang's free list, so no other request is handed them;
    nobody is aborted and every output is the unguarded run's."""
    s, guard = scheduler(page_size, overlap=overlap)
    live = started(s)
    slots = row(s, live["r1"])
    pages = set((slots // page_size).tolist())
    s.token_to_kv_pool_allocator.free(slots.clone())  # the bug
    assert guard.violations and {(v.kind, v.op, v.request) for v in guard.violations} == {("foreign_page", "release", None)}
    assert {v.owner for v in guard.violations} <= {"r1", None} and "r1" in {v.owner for v in guard.violations}
    assert len(guard.violations) == len(pages)
    assert not pages & free_pages(s)
    out = finish(s)
    assert guard.aborted == {}
    assert out == unguarded[page_size]


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free_of_a_page_already_free(triton_rows, unguarded, page_size, handed):
    """A stray second free of a page already in SGLang's free list: refused (double_free), the
    free list keeps one copy."""
    s, guard = scheduler(page_size, handed=handed)
    started(s)
    page = min(free_pages(s))
    s.token_to_kv_pool_allocator.free(torch.tensor([page * page_size], dtype=torch.int64))
    assert [v.kind for v in guard.violations] == ["double_free"] and guard.violations[0].page == page
    allp = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)
    assert finish(s) == unguarded[page_size] and guard.aborted == {}


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_page_a_decode_step_claimed_goes_back_once(triton_rows, page_size):
    """A page a decode step's row write claimed goes back once, when its request finishes (no
    radix cache keeps it); a second free of it is a double free, refused, and SGLang's free list
    keeps one copy."""
    s = build_scheduler(
        page_size=page_size, tokens=1024 if page_size == 16 else 512, rows=8, context_len=256, radix_cache=False,
    )
    guard = attach_kvguard(s, "enforce")
    live = started(s, n=10)  # 50 tokens: the last page opened by a decode step at page size 16 too
    slots = row(s, live["r1"])
    page = int(slots[-1]) // page_size
    assert (len(slots) - 1) // page_size * page_size >= len(PROMPTS["r1"]), "a page opened after the prefill"
    assert guard.table.page_info(page).owner == guard.request_key("r1")
    out = finish(s)
    assert page in free_pages(s) and guard.violations == [] and len(out) == len(PROMPTS)
    s.token_to_kv_pool_allocator.free(torch.tensor([int(slots[-1])], dtype=torch.int64))
    assert [(v.kind, v.page) for v in guard.violations] == [("double_free", page)]
    allp = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp) and page in allp.tolist()
    assert guard.aborted == {}


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_handed_out_and_freed_before_any_row_names_them_go_back_once(triton_rows, unguarded, page_size, handed):
    """SGLang's own error paths free what its allocator just handed out, before any row names
    it: the free names no freer and goes back; a second free of the same pages is a double free,
    refused, and SGLang's free list keeps one copy."""
    s, guard = scheduler(page_size, handed=handed)
    started(s)
    alloc = s.token_to_kv_pool_allocator
    out = alloc.alloc(2 * page_size)
    pages = sorted(set((out // page_size).tolist()))
    assert not set(pages) & free_pages(s)
    alloc.free(out.clone())
    assert guard.violations == [] and set(pages) <= free_pages(s)
    alloc.free(out.clone())  # the bug
    assert sorted(v.page for v in guard.violations) == pages
    assert {v.kind for v in guard.violations} == {"double_free"}
    allp = alloc.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)
    assert finish(s) == unguarded[page_size] and guard.aborted == {}


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_page_named_twice_in_one_free_goes_back_once(triton_rows, unguarded, page_size, handed):
    """A free naming a page the allocator handed out twice (no freer): the first goes back, the
    second is a double free, refused, and SGLang's free list gets the page once."""
    s, guard = scheduler(page_size, handed=handed)
    started(s)
    alloc = s.token_to_kv_pool_allocator
    page = int(alloc.alloc(page_size)[0]) // page_size
    assert page not in free_pages(s)
    twice = torch.tensor([page, page], dtype=torch.int64)
    (alloc.free if page_size == 1 else alloc.free_page_ids)(twice)  # the bug
    assert [(v.kind, v.page) for v in guard.violations] == [("double_free", page)]
    allp = alloc.get_all_free_pages()
    assert allp.tolist().count(page) == 1 and len(torch.unique(allp)) == len(allp)
    assert finish(s) == unguarded[page_size] and guard.aborted == {}


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_second_free_inside_the_free_group_of_the_first_is_refused(triton_rows, unguarded, page_size, handed):
    """Pages the allocator handed out, freed by no request inside a free group (judged then, in
    SGLang's list only at the group's end) and freed again in the same group: the second free is
    a double free, refused; SGLang's free list gets each page once at the group's end."""
    s, guard = scheduler(page_size, handed=handed)
    started(s)
    alloc = s.token_to_kv_pool_allocator
    out = alloc.alloc(2 * page_size)
    pages = sorted(set((out // page_size).tolist()))
    alloc.free_group_begin()
    alloc.free(out.clone())
    assert guard.violations == []
    alloc.free(out.clone())  # the bug
    alloc.free_group_end()
    assert sorted(v.page for v in guard.violations) == pages and {v.kind for v in guard.violations} == {"double_free"}
    allp = alloc.get_all_free_pages()
    assert set(pages) <= set(allp.tolist()) and len(torch.unique(allp)) == len(allp)
    assert finish(s) == unguarded[page_size] and guard.aborted == {}


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_free_of_the_padding_page_is_refused(triton_rows, unguarded, page_size, handed):
    """Page 0 takes the padded tokens' writes and is never handed out: a free of it is a double
    free, refused, and it never enters SGLang's free list (a request would be handed the page
    every padded write lands in)."""
    s, guard = scheduler(page_size, handed=handed)
    started(s)
    alloc = s.token_to_kv_pool_allocator
    alloc.free(torch.arange(page_size, dtype=torch.int64))  # the bug
    assert [(v.kind, v.page) for v in guard.violations] == [("double_free", 0)]
    assert 0 not in free_pages(s)
    assert finish(s) == unguarded[page_size] and guard.aborted == {} and 0 not in free_pages(s)


@HANDED
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_page_the_radix_cache_evicts_twice_in_one_free_goes_back_once(triton_rows, unguarded, page_size, handed):
    """The radix cache's eviction freeing each page of a leaf twice in one call: the first is the
    eviction (the prefix ends, the page goes back), the second a double free, refused; SGLang's
    free list gets each page once and no page is lost."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s, guard = scheduler(page_size, handed=handed)
    start = pool_pages(s)
    started(s)
    assert finish(s) == unguarded[page_size]
    cached = s.tree_cache.evictable_size() // page_size
    assert cached > 0 and guard.violations == []
    alloc = s.token_to_kv_pool_allocator
    once = alloc.free_segment
    alloc.free_segment = lambda idx, *, start_pos: once(torch.cat([idx, idx]), start_pos=start_pos)  # the bug
    s.tree_cache.evict(EvictParams(num_tokens=10_000))
    assert s.tree_cache.evictable_size() == 0
    assert {v.kind for v in guard.violations} == {"double_free"} and len(guard.violations) == cached
    allp = alloc.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)
    assert pool_pages(s) == start


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_free_list_kvguard_cannot_read_refuses_frees_by_no_request(triton_rows, unguarded, page_size, caplog,
                                                                    monkeypatch):
    """Fail closed: SGLang's free list unreadable when a free names no freer, every page of it
    is refused (kept out of SGLang's free list, none handed to two requests), with an error
    logged; the requests are not touched and their outputs are the unguarded run's. The pages
    refused are lost to the pool, which SGLang's idle check reports (here as a warning)."""
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "false")
    s, guard = scheduler(page_size)
    start = pool_pages(s)
    started(s)
    alloc = s.token_to_kv_pool_allocator

    def unreadable():
        raise RuntimeError("free list gone")

    guard._free_pages_of = unreadable
    out = alloc.alloc(2 * page_size)
    pages = sorted(set((out // page_size).tolist()))
    alloc.free(out.clone())
    assert sorted(v.page for v in guard.violations) == pages
    assert {v.kind for v in guard.violations} == {"double_free"}
    assert not set(pages) & free_pages(s)
    assert "free list could not be read" in caplog.text
    assert finish(s) == unguarded[page_size] and guard.aborted == {}
    assert pool_pages(s) == start - len(pages)


def test_double_free_inside_a_free_group(triton_rows, unguarded):
    """SGLang's result processing releases finished requests inside a free group
    (free_group_begin/end). A release path that frees r2's tail twice in the group is refused on
    r2 when it is made (the freer is known there, not at the group's end); SGLang's free list
    gets each page once and no page is lost."""
    s, guard = scheduler(16)
    start = pool_pages(s)
    live = started(s)
    victim = live["r2"].kv
    tree = s.tree_cache
    inner = tree.free_kv_row
    seen = []

    def twice(kv, segments, *a, **k):
        inner(kv, segments, *a, **k)
        if kv is victim and s.token_to_kv_pool_allocator.free_group is not None and any(e > b for b, e in segments):
            seen.append(segments)
            inner(kv, segments, *a, **k)  # the bug

    tree.free_kv_row = twice
    out = finish(s)
    assert seen, "r2's tail was released inside a free group"
    assert {rid for rid, _ in guard.refusals} == {"r2"}
    assert {v.kind for v in guard.violations} <= {"double_free", "foreign_page"} and guard.violations
    assert all(v.op == "release" for v in guard.violations)
    allp = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)
    assert pool_pages(s) == start
    assert out == unguarded[16]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@HANDED
def test_stale_req_pool_idx_refuses_the_reader_not_the_new_owner(triton_rows, unguarded, page_size, overlap, handed):
    """r3's row is freed while r3 keeps running (a stale req_pool_idx); the row goes to a new
    request c. At the next step r3 writes and reads through c's row: r3 is refused (its write
    into c's row dropped, its read refused, its release through c's row refused), c and the
    others run on untouched, and no page is lost."""
    s, guard = scheduler(page_size, overlap=overlap, handed=handed)
    start = pool_pages(s)
    live = started(s)
    r3 = live["r3"]
    idx = r3.kv.req_pool_idx
    s.req_to_token_pool.free(r3)  # the bug: the row goes back, r3 keeps it
    r3.kv.req_pool_idx = idx
    c_prompt = [7] * 30
    s.handle_generate_request(generate_req("c", c_prompt, max_new=6, salt="zeta"))
    step(s)  # c's prefill takes the free row
    c = next(r for r in s.last_batch.reqs if r.rid == "c")
    assert c.kv.req_pool_idx == idx, "c got r3's row"
    out = finish(s)
    assert set(guard.aborted) == {"r3"}
    assert {rid for rid, _ in guard.refusals if rid is not None} <= {"r3"}
    assert isinstance(out["r3"][1], dict) and out["r3"][1]["type"] == "abort"
    for rid in ("r0", "r1", "r2"):
        assert out[rid] == unguarded[page_size][rid]
    ref, _ = scheduler(page_size, policy=None)
    want_c = run(ref, [generate_req("c", c_prompt, max_new=6, salt="zeta")])["c"]
    assert out["c"] == want_c
    # r3's own pages came back (no row names them any more), and c's were never freed twice.
    assert pool_pages(s) == start
    allp = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("stream", [False, True])
def test_entry_changed_below_the_window_is_never_served(triton_rows, unguarded, page_size, stream, overlap):
    """An entry of r1's row below its decode window is changed behind SGLang's calls (a direct
    write into req_to_token naming r0's KV); r1 finishes before the next full check
    (full_check_every=64). Its whole row is checked before any of its output leaves the
    scheduler: r1 ends with kvguard's abort instead of the output it read from r0's KV; r0 and
    the others are untouched. No token r1 made after the bug leaves, not even with its abort
    (SGLang streams an abort's payload, text included, to a streaming client)."""
    s, guard = scheduler(page_size, overlap=overlap)
    for r in reqs(max_new=6):
        r.stream = stream
        s.handle_generate_request(r)
    step(s)
    step(s)  # a decode step: rows found clean, windows from here
    live = {r.rid: r for r in s.running_batch.reqs}
    r0, r1 = live["r0"], live["r1"]
    rt = s.req_to_token_pool.req_to_token
    sent_before = len(s.outputs.sent)
    rt[r1.kv.req_pool_idx, 2] = rt[r0.kv.req_pool_idx, 2]  # the bug
    out = finish(s)
    assert set(guard.aborted) == {"r1"}
    v = guard.aborted["r1"]
    assert v.kind == "foreign_page" and v.request == "r1" and v.owner in ("r0", None)
    assert out["r1"][1]["type"] == "abort"
    # Nothing of r1 left the scheduler after the bug but the abort: no token id, no id for the
    # detokenizer.
    for reason, ids, decode_ids in sent_since(s, sent_before, "r1"):
        assert reason is not None and reason["type"] == "abort" and len(ids) == 0 and len(decode_ids) == 0
    ref = {rid: o for rid, o in unguarded[page_size].items()}
    s2, _ = scheduler(page_size, policy=None)
    want = run(s2, reqs(max_new=6))
    for rid in ("r0", "r2", "r3"):
        assert out[rid] == want[rid]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_retry_under_a_refused_requests_rid_is_judged_on_its_own(triton_rows, unguarded, page_size):
    """A client retries under the rid of a request kvguard refused, once that one has ended
    (SGLang accepts the rid again): the retry is judged on its own, served token for token as
    without kvguard, nothing of the first refusal withheld from it. A retry that itself reads
    what it must not is refused again, on its own violation."""
    for bug_again in (False, True):
        s, guard = scheduler(page_size)
        live = started(s, 1)
        r0, r1 = live["r0"], live["r1"]
        rt = s.req_to_token_pool.req_to_token
        rt[r1.kv.req_pool_idx, 2] = rt[r0.kv.req_pool_idx, 2]  # the bug
        finish(s)
        assert set(guard.aborted) == {"r1"}
        first = guard.aborted["r1"]
        before = len(s.outputs.sent)
        s.handle_generate_request(generate_req("r1", PROMPTS["r1"], max_new=24, salt="acme"))
        if bug_again:
            step(s)
            step(s)
            again = next(r for r in s.running_batch.reqs if r.rid == "r1")
            free = int(s.token_to_kv_pool_allocator.get_all_free_pages()[-1]) * page_size
            rt[again.kv.req_pool_idx, 2] = free  # the retry's own bug: a free page's KV
        finish(s)
        sent = sent_since(s, before, "r1")
        ids = [t for _, i, _ in sent for t in i]
        reason = sent[-1][0]
        if not bug_again:
            assert (ids, reason) == unguarded[page_size]["r1"]
            assert "r1" not in guard.aborted and guard.metrics["aborted_requests"] == 1
        else:
            assert reason["type"] == "abort"
            assert guard.aborted["r1"] is not first and guard.metrics["aborted_requests"] == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_misrouted_triton_row_write_is_refused_on_the_reader(monkeypatch, unguarded, page_size):
    """SGLang's GPU row write (write_req_to_token_pool_triton) goes wrong: r1's row gets r0's
    slots. kvguard's claims come from write_cache_indices' arguments (the allocator's
    out_cache_loc), never from the rows, so r1's new pages stay r1's and r0's stay r0's: r1's
    read of r0's pages is refused on the forward, r1 alone is aborted, r0 and the others are
    served as without kvguard, and r1's own pages (named by no row) go back to SGLang."""
    from scheduler_rig import allocation

    monkeypatch.setattr(allocation, "support_triton", lambda backend: True)
    real = allocation.write_req_to_token_pool_triton
    state = {"done": False}

    class Misrouted:
        def __getitem__(self, grid):
            def launch(req_to_token, rows, *args):
                real[grid](req_to_token, rows, *args)
                if not state["done"] and len(rows) >= 2:
                    state["done"] = True
                    r0, r1 = int(rows[0]), int(rows[1])
                    req_to_token[r1, :40] = req_to_token[r0, :40]  # the bug

            return launch

    monkeypatch.setattr(allocation, "write_req_to_token_pool_triton", Misrouted())
    s, guard = scheduler(page_size)
    start = pool_pages(s)
    out = run(s, reqs())
    assert state["done"]
    # r1's own pages, which no row names after the bug, came back from kvguard; none twice.
    assert pool_pages(s) == start
    allp = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert len(torch.unique(allp)) == len(allp)
    assert set(guard.aborted) == {"r1"}
    v = guard.aborted["r1"]
    assert v.kind == "foreign_page" and v.op == "read" and v.request == "r1" and v.owner == "r0"
    assert out["r1"][1]["type"] == "abort"
    for rid in ("r0", "r2", "r3"):
        assert out[rid] == unguarded[page_size][rid]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupted_row_never_reaches_the_radix_cache(triton_rows, page_size):
    """SGLang's radix cache takes the values it inserts from the finishing request's row
    (``UnifiedRadixCache.checkpoint_into_tree`` reads ``req_to_token`` and inserts it): an entry of r1's row
    past its prompt (position 43, an output token's KV) changed behind SGLang's calls to name
    r0's KV is published with r1's tokens, and a later request whose prompt is r1's prompt and
    output matches it and reads r0's KV. Without kvguard it does (its output changes); under
    enforce r1's row is refused before checkpoint inserts it (at page size 1 by the check of its
    whole row at its release, the output check; at page size 16 position 43 is in the page its
    next decode window reads): nothing of r1's row enters the tree past what was cached clean,
    and the later request is served as in a run without the bug."""
    def run_with(policy, *, bug, later_prompt=None):
        s, guard = scheduler(page_size, policy)
        inserted = []
        tree = s.tree_cache
        into_tree, insert = tree.checkpoint_into_tree, tree.insert
        caching = []  # the request whose row checkpoint_into_tree is inserting

        def spy_checkpoint(req, **kwargs):
            caching.append(req.rid)
            try:
                return into_tree(req, **kwargs)
            finally:
                caching.pop()

        def spy_insert(params):
            if caching and params.value is not None:
                inserted.append((caching[-1], params.value.clone()))
            return insert(params)

        tree.checkpoint_into_tree, tree.insert = spy_checkpoint, spy_insert
        for r in reqs(max_new=12):
            s.handle_generate_request(r)
        for _ in range(6):
            step(s)  # the prefill and five decode steps: r1's KV up to position 44 written
        live = {r.rid: r for r in s.running_batch.reqs}
        r0, r1 = live["r0"], live["r1"]
        rt = s.req_to_token_pool.req_to_token
        foreign = int(rt[r0.kv.req_pool_idx, 43])
        if bug:
            rt[r1.kv.req_pool_idx, 43] = foreign  # the bug
        out = finish(s)
        if later_prompt is not None:
            s.handle_generate_request(generate_req("r1-again", later_prompt, max_new=6, salt="acme"))
            out = finish(s)
        return out, guard, inserted, foreign

    bugged, _, inserted, foreign = run_with(None, bug=True)
    assert any(rid == "r1" and foreign in values.tolist() for rid, values in inserted)
    later = PROMPTS["r1"] + bugged["r1"][0][:8]  # what the tree holds for r1: 48 tokens
    truth, *_ = run_with(None, bug=False, later_prompt=later)
    out, *_ = run_with(None, bug=True, later_prompt=later)
    assert out["r1-again"] != truth["r1-again"]

    out, guard, inserted, foreign = run_with("enforce", bug=True, later_prompt=later)
    assert set(guard.aborted) == {"r1"} and out["r1"][1]["type"] == "abort"
    assert not any(rid == "r1" and foreign in values.tolist() for rid, values in inserted)
    assert out["r1-again"] == truth["r1-again"]
