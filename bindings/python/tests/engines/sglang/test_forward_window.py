"""The forward check's incremental window: a decode forward checks only each row's tokens written
since its last clean check. A change outside that window is still caught: through SGLang's own
calls on the forward where it happens, behind them at the next full check."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT


def aborted_by_kvguard(req):
    return isinstance(req.to_finish, FINISH_ABORT) and "kvguard" in req.to_finish.message


def full_checks(eng, monkeypatch):
    """Counts the forwards that ran the full verify_step_rows."""
    calls = []
    real = eng.guard.table

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def verify_step_rows(self, *args, **kwargs):
            calls.append(args[2])
            return real.verify_step_rows(*args, **kwargs)

    monkeypatch.setattr(eng.guard, "table", Counting())
    return calls


def two_decoding(engine_factory, page_size, **options):
    eng = engine_factory(page_size=page_size, tokens=4096, context_len=512, policy=None)
    eng.install("enforce", **options)
    a = eng.request("a", [5] * 40, max_new=64)
    b = eng.request("b", [6] * 40, max_new=64)
    for r in (a, b):
        assert eng.submit(r)
    eng.prefill([a, b])
    eng.decode()
    return eng, a, b


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_decode_checks_the_window_only(engine_factory, page_size, monkeypatch):
    eng, a, b = two_decoding(engine_factory, page_size, full_check_every=8)
    calls = full_checks(eng, monkeypatch)
    for _ in range(16):
        eng.decode()
    assert len(calls) == 2  # forwards 8 and 16 of the guard (the prefill and first decode were 1, 2)
    assert eng.guard.violations == []


@pytest.mark.parametrize("page_size", [1, 16])
def test_stale_row_outside_the_window_is_caught(engine_factory, page_size):
    """Decoding in window mode, a's early pages are freed (through SGLang's own free_kv_row, so
    the free is a's) while its row still names them (the stale-row bug) and go to c: the release
    makes the next forward a full check, which refuses a's read of c's page."""
    eng, a, b = two_decoding(engine_factory, page_size)
    for _ in range(3):
        eng.decode()
    row = eng.req_to_token_pool.req_to_token[a.kv.req_pool_idx, : 2 * page_size].to("cpu").long()
    eng.tree.free_kv_row(a.kv, [(0, 2 * page_size)])  # the bug: a's first pages go back, its row still names them
    eng.allocator.merge_and_sort_free()
    c = eng.request("c", [7] * 40)
    assert eng.submit(c)
    eng.prefill([c])
    c_pages = {int(s) // page_size for s in eng.req_to_token_pool.req_to_token[c.kv.req_pool_idx, :40].tolist()}
    assert c_pages & {int(s) // page_size for s in row.tolist()}, "c got one of a's freed pages"
    eng.guard.violations.clear()
    eng.decode([a, b])
    v = eng.guard.aborted["a"]
    assert v.kind == "foreign_page" and v.op == "read" and v.request == "a" and v.owner == "c"
    assert {rid for rid, _ in eng.guard.refusals} == {"a"}
    assert not aborted_by_kvguard(b) and not aborted_by_kvguard(c)


@pytest.mark.parametrize("page_size", [1, 16])
def test_row_rewritten_below_its_window_is_caught(engine_factory, page_size):
    """ReqToTokenPool.write of an entry below a's checked length (a's first token pointed at b's
    page) is caught on that write, on a; b is untouched."""
    eng, a, b = two_decoding(engine_factory, page_size)
    for _ in range(3):
        eng.decode()
    b_slot = eng.req_to_token_pool.req_to_token[b.kv.req_pool_idx, 0].clone()
    rows = torch.tensor([a.kv.req_pool_idx], dtype=torch.int64)
    eng.req_to_token_pool.write((rows, torch.tensor([0])), b_slot.reshape(1))
    v = eng.guard.aborted["a"]
    assert v.request == "a" and v.owner == "b" and v.kind == "page_not_free"
    assert not aborted_by_kvguard(b)


@pytest.mark.parametrize("page_size", [1, 16])
def test_row_changed_behind_sglang_is_caught_at_the_next_full_check(engine_factory, page_size):
    """A write into req_to_token that bypasses every SGLang call kvguard hooks (a's first entry
    set to b's slot in the tensor itself): outside the window, so the window forwards do not
    see it; the next full check (every full_check_every-th forward) refuses a, not b."""
    eng, a, b = two_decoding(engine_factory, page_size, full_check_every=4)
    rt = eng.req_to_token_pool.req_to_token
    rt[a.kv.req_pool_idx, 0] = rt[b.kv.req_pool_idx, 0]
    steps = 0
    while "a" not in eng.guard.aborted:
        eng.decode()
        steps += 1
        assert steps <= 4, "not caught within full_check_every forwards"
    # The guard's forwards: 1 prefill, 2 decode (full), 3 the window (misses it), 4 full.
    assert steps == 2
    v = eng.guard.aborted["a"]
    assert v.kind == "foreign_page" and v.op == "read" and v.request == "a" and v.owner == "b"
    assert {rid for rid, _ in eng.guard.refusals} == {"a"}
    assert not aborted_by_kvguard(b)


def test_full_check_every_is_validated(engine_factory):
    from kvguard import ConfigError

    eng = engine_factory(policy=None)
    with pytest.raises(ConfigError, match="full_check_every"):
        eng.install("enforce", full_check_every=0)


def test_a_request_finishing_does_not_make_the_others_check_in_full(engine_factory, monkeypatch):
    """A request's release resets its own rows only: the next decode of the others stays in the
    window (no full verify_step_rows but the finishing request's own final check)."""
    eng = engine_factory(page_size=16, tokens=4096, context_len=512, policy=None)
    eng.install("enforce", full_check_every=1000)
    reqs = [eng.request(f"r{i}", [5 + i] * 40, max_new=64) for i in range(3)]
    for r in reqs:
        assert eng.submit(r)
    eng.prefill(reqs)
    eng.decode()
    eng.decode()
    calls = full_checks(eng, monkeypatch)
    row0 = reqs[0].kv.req_pool_idx
    eng.finish(reqs[0])
    for _ in range(3):
        eng.decode()
    # The finishing request's own row is checked in full once, before its output leaves (at its
    # release); nobody else's.
    assert [c.tolist() for c in calls] == [[row0]]
    assert eng.guard.violations == []


class OnDevice(torch.Tensor):
    """SGLang's req_to_token as if it lived on a GPU: is_cuda true, no numpy view, and cpu()
    a copy (as a device-to-host copy is)."""

    @property
    def is_cuda(self):
        return True

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")

    def cpu(self, *args, **kwargs):
        return torch.Tensor.clone(self).as_subclass(torch.Tensor)


@pytest.mark.parametrize("on_device", [False, True])
def test_the_check_before_output_reads_the_rows_as_they_are_now(engine_factory, on_device):
    """Guard.check_rows_before_output checks every entry of each request's row as it is now:
    on a GPU it copies those rows only (never a cached snapshot of the table), so an entry
    changed after an earlier check is seen, and a clean row passes."""
    eng, a, b = two_decoding(engine_factory, 16)
    guard = eng.guard
    rt = eng.req_to_token_pool.req_to_token
    if on_device:
        eng.req_to_token_pool.req_to_token = rt.as_subclass(OnDevice)
        guard.row_check._req_to_token = None  # no host view of a device table
    assert guard.check_rows_before_output([a, b]) == []
    rt[a.kv.req_pool_idx, 3] = rt[b.kv.req_pool_idx, 3]  # behind SGLang's calls
    assert guard.check_rows_before_output([a, b]) == [a]
    v = guard.aborted["a"]
    assert v.kind == "foreign_page" and v.request == "a" and v.owner == "b"
    assert not aborted_by_kvguard(b)
