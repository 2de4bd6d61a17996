"""PD decode retraction through SGLang's own schedulers (pd_rig.py): under KV pressure (here
SGLang's own ``TEST_RETRACT`` switch) the decode scheduler retracts running requests, backs their
KV up to the host (``disaggregation_decode_retraction_backup``), releases their pages, and later
resumes them (``DecodePreallocQueue.resume_retracted_reqs``: ``_pre_alloc`` new pages, then
``restore_kv_cache`` copies the KV back). kvguard records the restored tokens as written when they
match the backup (count and CRC32), so a resumed request is not refused; a restore that differs
refuses that request alone."""

from __future__ import annotations

import pd_rig
import pytest
from scheduler_rig import attach_kvguard, pool_pages
from test_pd_schedulers import CONTEXT, workload

N = 40


@pytest.fixture(autouse=True)
def process_channel(monkeypatch):
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", "process")


@pytest.fixture
def retracting(monkeypatch):
    """SGLang's TEST_RETRACT on (a decode batch retracts one request every few steps); the
    retracted rids, as ``ScheduleBatch.retract_decode`` returns them."""
    import sglang.srt.managers.scheduler as scheduler_module
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    monkeypatch.setattr(scheduler_module, "TEST_RETRACT", True)
    monkeypatch.setattr(scheduler_module, "TEST_RETRACT_INTERVAL", 3)
    retracted: list[str] = []
    real = ScheduleBatch.retract_decode

    def retract_decode(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        retracted.extend(r.rid for r in out[0])
        return out

    monkeypatch.setattr(ScheduleBatch, "retract_decode", retract_decode)
    return retracted


def sides(guard, overlap=False):
    pd_rig.install_wire()
    prefill = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, chunked_prefill_size=48,
                                   disable_overlap_schedule=not overlap)
    decode = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32,
                                 disable_overlap_schedule=not overlap,
                                 disaggregation_decode_retraction_backup="cpu_tensor")
    if guard is not None:
        attach_kvguard(prefill, guard)
        attach_kvguard(decode, guard)
    return prefill, decode


def run(guard, retracted, overlap=False):
    retracted.clear()
    p, d = sides(guard, overlap)
    start = pool_pages(d)
    out = pd_rig.run_pd(p, d, workload(7, N))
    assert pool_pages(d) == start
    return out, d, list(retracted)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retracted_then_resumed_requests_are_not_refused(retracting, overlap):
    """Requests SGLang retracts and resumes decode on, under enforce, exactly as without kvguard:
    no violation, no abort, every restore recorded."""
    ref, _, plain = run(None, retracting, overlap)
    assert plain, "SGLang retracted no request: the test checks nothing"
    out, d, guarded = run("enforce", retracting, overlap)
    g = d.kvguard
    assert g.violations == [] and g.aborted == {}
    assert g.metrics["retractions_restored"] == len(guarded) > 0
    assert out == ref


def test_a_restore_that_differs_from_its_backup_refuses_that_request_alone(retracting, monkeypatch):
    """SGLang's restore of one resumed request lands other bytes than it backed up (here: one
    value of its first restored token changed after ``Req.load_kv_cache``): that request alone is
    refused (its new pages stay unwritten); every other request decodes as without kvguard."""
    from sglang.srt.managers.schedule_batch import Req

    ref, _, _ = run(None, retracting)
    real = Req.load_kv_cache
    hit: list[str] = []

    def load_kv_cache(self, req_to_token_pool, allocator):
        out = real(self, req_to_token_pool, allocator)
        if not hit:
            hit.append(self.rid)
            slot = int(req_to_token_pool.req_to_token[self.kv.req_pool_idx, 0])
            allocator.get_kvcache().k_buffer[0][slot] += 1.0
        return out

    monkeypatch.setattr(Req, "load_kv_cache", load_kv_cache)
    out, d, _ = run("enforce", retracting)
    g = d.kvguard
    assert hit and list(g.aborted) == hit
    assert "differs from its backup" in str(g.aborted[hit[0]])
    assert {k: v for k, v in out.items() if k != hit[0]} == {k: v for k, v in ref.items() if k != hit[0]}
