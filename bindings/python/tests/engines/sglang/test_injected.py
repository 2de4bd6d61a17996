"""Bugs injected into SGLang's real objects: each caught on the event where it happens, with the
right kind, on the right request; under enforce exactly that request is aborted and the others go
on."""

from __future__ import annotations

import pytest
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import RadixKey

SYSTEM = list(range(100, 164))


def kinds(guard):
    return [v.kind for v in guard.violations]


def free_pages(eng):
    return set((eng.allocator.get_all_free_pages()).tolist())


def aborted_by_kvguard(req):
    return isinstance(req.to_finish, FINISH_ABORT) and "kvguard" in req.to_finish.message


@pytest.mark.parametrize("page_size", [1, 16])
def test_one_token_stub_is_refused_at_intake(engine_factory, page_size):
    """The incident: SGLang's set_finish_with_abort turns an over-long prompt into a one-token
    stub that still runs. kvguard judges the length the client sent, refuses it before any page
    or row is touched, and if the stub is scheduled anyway its row gets no page."""
    eng = engine_factory(page_size=page_size, context_len=1024)
    ok = eng.request("ok", SYSTEM + [1, 2, 3])
    assert eng.submit(ok)
    eng.prefill([ok])
    stub = eng.request("too-long", list(range(1, 3001)))
    stub.set_finish_with_abort("Input length (3000 tokens) exceeds the maximum allowed length")
    assert len(stub.origin_input_ids) == 1
    free_before = free_pages(eng)
    assert not eng.submit(stub)
    v = eng.guard.aborted["too-long"]
    assert v.kind == "exceeds_max_context" and v.op == "admit" and v.request == "too-long"
    assert free_pages(eng) == free_before
    assert eng.guard.table.request_info("too-long") is None
    # The buggy path goes on and schedules the stub: its row write is refused, its KV write
    # goes to the padding slot, the other request decodes on.
    eng.guard.violations.clear()
    eng.prefill([stub])
    assert kinds(eng.guard)[0] == "unknown_request"
    assert {rid for rid, _ in eng.guard.refusals} == {"too-long"}
    eng.decode([ok])
    assert not aborted_by_kvguard(ok)


@pytest.mark.parametrize("policy", ["enforce", "report"])
def test_radix_node_evicted_while_locked(engine_factory, policy):
    """The radix cache evicts a node a running request still holds (its lock dropped by a bug):
    refused on the eviction (evict_in_use); under enforce the pages stay out of SGLang's free
    list until the holder lets go, so a new request can never be handed them."""
    eng = engine_factory(page_size=16, tokens=1024, context_len=512, policy=policy)
    a = eng.request("a", SYSTEM + [1] * 20, salt="acme")
    b = eng.request("b", SYSTEM + [2] * 20, salt="acme")
    for r in (a, b):
        assert eng.submit(r)
    eng.prefill([a])
    eng.finish(a)
    eng.prefill([b])
    assert b.prefix_len >= 64
    shared = {int(s) // 16 for s in eng.req_to_token_pool.req_to_token[b.kv.req_pool_idx, :64].tolist()}
    # The bug: b's lock on its prefix is let go while b runs, then the cache evicts everything.
    eng.tree.unlock(b.lock)
    b.lock = None  # (lost: b's release unlocks nothing)
    eng.tree.evict(EvictParams(num_tokens=10_000))
    assert "evict_in_use" in kinds(eng.guard)
    v = next(v for v in eng.guard.violations if v.kind == "evict_in_use")
    assert v.op == "evict" and v.prefix is not None
    assert [rid for rid, x in eng.guard.refusals if x.kind == "evict_in_use"][0] is None
    if policy == "enforce":
        assert not shared & free_pages(eng)
        c = eng.request("c", [7] * 400, salt="zeta")
        assert eng.submit(c)
        eng.prefill([c])
        eng.decode([b])
        assert not aborted_by_kvguard(b) and not aborted_by_kvguard(c)
        assert [k for k in kinds(eng.guard) if k != "evict_in_use"] == []
        eng.finish(b)
        eng.finish(c)
        # The pages come back once b let go: to the free list, or to the tree that re-cached them.
        in_tree = {int(x) // 16 for x in eng.tree.all_values_flatten().tolist()}
        assert shared <= free_pages(eng) | in_tree
        assert eng.guard.table.snapshot().shared == len(in_tree)
    else:
        # Report: SGLang reuses the pages; the new owner's claim is the next violation.
        c = eng.request("c", [7] * 400, salt="zeta")
        assert eng.submit(c)
        eng.allocator.merge_and_sort_free()
        eng.prefill([c])
        assert "page_not_free" in kinds(eng.guard)
        assert any(x.kind == "page_not_free" and rid == "c" for rid, x in eng.guard.refusals)


@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free(engine_factory, page_size):
    """A release path frees a request's row twice; in between, the pages went to another request.
    The second free is refused on the first request (foreign_page) and the pages stay with their
    new owner."""
    eng = engine_factory(page_size=page_size, tokens=2048, context_len=512)
    a = eng.request("a", [5] * 40)
    b = eng.request("b", [6] * 40)
    for r in (a, b):
        assert eng.submit(r)
    eng.prefill([a])
    n = a.kv.kv_committed_len
    eng.tree.free_kv_row(a.kv, [(0, n)])
    eng.allocator.merge_and_sort_free()  # as an allocation that runs short does
    eng.prefill([b])
    b_pages = {int(s) // page_size for s in eng.req_to_token_pool.req_to_token[b.kv.req_pool_idx, :n].tolist()}
    a_pages = {int(s) // page_size for s in eng.req_to_token_pool.req_to_token[a.kv.req_pool_idx, :n].tolist()}
    assert a_pages & b_pages, "the allocator handed a's freed pages to b"
    eng.tree.free_kv_row(a.kv, [(0, n)])
    v = eng.guard.aborted["a"]
    assert v.kind == "foreign_page" and v.op == "release" and v.request == "a" and v.owner == "b"
    assert not b_pages & free_pages(eng)
    eng.decode([b])
    assert not aborted_by_kvguard(b) and aborted_by_kvguard(a)


def stale_row(eng):
    """Requests ``a`` and ``b`` of 40 tokens each: ``a`` prefilled, then the bug: its pages go
    back (through ``free_kv_row``: the free is its own) while its row stays as it was; the
    allocator hands them to ``b``, prefilled next. Returns (a, b)."""
    a = eng.request("a", [5] * 40)
    b = eng.request("b", [6] * 40)
    for r in (a, b):
        assert eng.submit(r)
    eng.prefill([a])
    eng.tree.free_kv_row(a.kv, [(0, a.kv.kv_committed_len)])
    eng.allocator.merge_and_sort_free()
    eng.prefill([b])
    return a, b


@pytest.mark.parametrize("page_size", [1, 16])
def test_stale_row_after_free_and_reuse(engine_factory, page_size):
    """A request's pages are freed (through free_kv_row: the free is its own) but its
    req_to_token row is left as it was; the pages go to another request. Its next forward reads the stale row: refused on the forward batch, on that
    request, and its KV write goes to the padding slot; the new owner is untouched."""
    eng = engine_factory(page_size=page_size, tokens=2048, context_len=512)
    a, b = stale_row(eng)
    n = a.kv.kv_committed_len
    b_row = eng.req_to_token_pool.req_to_token[b.kv.req_pool_idx, :n].clone()
    b_k = eng.kv_pool.k_buffer[0][b_row.long()].clone()
    eng.guard.violations.clear()
    eng.decode([a, b])
    v = eng.guard.aborted["a"]
    # Page size 1: the decode token gets a fresh page and the read of the stale row is refused.
    # Larger pages: the decode token lands in the stale row's last page, b's now, so the row
    # write of this same step is refused first.
    if page_size == 1:
        assert v.kind == "foreign_page" and v.op == "read"
    else:
        assert v.kind == "page_not_free" and v.op == "claim"
    assert v.request == "a" and v.owner == "b"
    assert {rid for rid, _ in eng.guard.refusals} == {"a"}
    assert not aborted_by_kvguard(b)
    # b's KV is intact: a's refused write went to the padding slot.
    assert (eng.kv_pool.k_buffer[0][b_row.long()] == b_k).all()
    assert [r.rid for r in eng.sweep_aborted()] == ["a"]
    eng.decode([b])
    assert not aborted_by_kvguard(b)


def test_a_refused_request_keeps_its_entry_while_it_holds_its_row(engine_factory, monkeypatch):
    """The guard keeps only the latest refusals (``KEPT``), but never drops the entry of a refused
    request that still holds its row: its row's free reads it (the pages only it held go back
    from there) and so does the check of its output. Here ``a`` is refused on its stale row,
    then more requests are refused at intake than the guard keeps, before ``a``'s row is freed:
    ``a``'s entry stays until it is released, then goes with the next trim."""
    import kvguard.sglang.refusals as refusals

    monkeypatch.setattr(refusals, "KEPT", 1)
    eng = engine_factory(page_size=1, tokens=2048, context_len=512)
    a, b = stale_row(eng)
    eng.decode([a, b])
    g = eng.guard
    assert list(g.aborted) == ["a"]

    def refuse_at_intake(i: int) -> None:
        big = eng.request(f"big{i}", [7] * 600)
        assert not eng.submit(big)
        g.drop_unscheduled(big)

    for i in range(6):
        refuse_at_intake(i)
    assert "a" in g.aborted and len(g.aborted) <= 1 + 2, list(g.aborted)
    assert aborted_by_kvguard(a)
    assert [r.rid for r in eng.sweep_aborted()] == ["a"]
    assert aborted_by_kvguard(a) and not aborted_by_kvguard(b)
    for i in range(6, 12):
        refuse_at_intake(i)
    assert "a" not in g.aborted and len(g.aborted) <= 2
    assert g.metrics["aborted_requests"] == 13


def test_cross_tenant_prefix_hit_when_salt_dropped(engine_factory, monkeypatch):
    """A regression builds radix keys without the cache salt: tenant zeta's prompt hits tenant
    acme's cached prefix. Refused where the hit lands in zeta's row (cross_tenant_share), on
    zeta's request; acme's requests are untouched."""
    eng = engine_factory(page_size=16, context_len=512)
    real = common._req_radix_key

    def salt_dropped(tree_cache, req, token_ids, max_prefix_len=None):
        key = real(tree_cache, req, token_ids, max_prefix_len)
        return RadixKey(token_ids=key.token_ids, extra_key=key.extra_key, limit=key.limit, cache_salt=None)

    monkeypatch.setattr(common, "_req_radix_key", salt_dropped)
    a = eng.request("acme-1", SYSTEM + [1] * 10, salt="acme")
    a2 = eng.request("acme-2", SYSTEM + [3] * 10, salt="acme")
    z = eng.request("zeta-1", SYSTEM + [2] * 10, salt="zeta")
    for r in (a, a2, z):
        assert eng.submit(r)  # the tenant is fixed at intake, from the salt the client sent
        r.cache_salt = None  # the regression: the salt is lost on the way to the cache
    eng.prefill([a])
    eng.finish(a)
    eng.prefill([a2])
    assert a2.kv.cache_protected_len >= 64 and not aborted_by_kvguard(a2)
    eng.prefill([z])
    assert z.kv.cache_protected_len >= 64, "the radix cache served acme's prefix to zeta"
    v = eng.guard.aborted["zeta-1"]
    assert v.kind == "cross_tenant_share" and v.op == "attach" and v.request == "zeta-1"
    assert set(eng.guard.aborted) == {"zeta-1"}
