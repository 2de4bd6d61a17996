"""PD decode retraction through SGLang's own schedulers (pd_rig.py): under KV pressure (here
SGLang's own ``TEST_RETRACT`` switch) the decode scheduler retracts running requests, backs their
KV up to the host (``disaggregation_decode_retraction_backup``), releases their pages, and later
resumes them (``DecodePreallocQueue.resume_retracted_reqs``: ``_pre_alloc`` new pages, then
``restore_kv_cache`` copies the KV back). kvguard records the restored tokens as written when they
match the backup (count and CRC32), so a resumed request is not refused; a restore that differs
refuses that request alone. Both of SGLang's backup backends run: ``cpu_tensor`` (a CPU copy
kept on the request) and ``host_pool`` (SGLang's default for an MHA pool: the decode radix cache's
HiCache host pool, ``UnifiedRadixCache.backup_kv_cache`` / ``restore_kv_cache``), the latter with
its CUDA-only pieces stood in (see :func:`host_pool`)."""

from __future__ import annotations

from types import SimpleNamespace

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


@pytest.fixture
def host_pool(monkeypatch):
    """SGLang's ``host_pool`` retraction backup on CPU: the decode radix cache's HiCache host pool,
    built by SGLang's own ``create_unified_radix_cache`` -> ``init_hicache``, its backup and
    restore SGLang's own (``UnifiedRadixCache.backup_kv_cache`` / ``restore_kv_cache``, its cache
    controller and L2 transfer engine). Stood in, as a CPU lacks them: the host<->device row copy
    (``sgl_kernel.kvcacheio.transfer_kv_direct``, a CUDA kernel: here the same rows copied with
    torch indexing), the page-locking of the host buffer (``cudaHostRegister``), the scheduler's
    worker registering the cache's layer counter, and a CPU stream's ``synchronize``. The server
    arguments SGLang's ``resolve_decode_retraction_backup`` would set (``hicache_ratio``) and the
    ``direct`` / ``layer_first`` host layout (the others need CUDA kernels) go in
    :data:`HOST_POOL_ARGS`."""
    import scheduler_rig
    import torch
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host import mha as host_mha

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers):
            dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)

    monkeypatch.setattr(host_mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
    monkeypatch.setattr(host_common, "_cuda_host_register", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    build = scheduler_rig.create_tree_cache

    def create_tree_cache(ctx):
        if ctx.tp_worker is None:
            ctx.tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=lambda counter: None)
        return build(ctx)

    monkeypatch.setattr(scheduler_rig, "create_tree_cache", create_tree_cache)


HOST_POOL_ARGS = dict(hicache_ratio=2.0, hicache_io_backend="direct", hicache_mem_layout="layer_first")

BACKUPS = pytest.mark.parametrize("backup", ["cpu_tensor", "host_pool"])


def sides(guard, overlap=False, backup="cpu_tensor"):
    pd_rig.install_wire()
    prefill = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, chunked_prefill_size=48,
                                   disable_overlap_schedule=not overlap)
    decode = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32,
                                 disable_overlap_schedule=not overlap,
                                 disaggregation_decode_retraction_backup=backup,
                                 **(HOST_POOL_ARGS if backup == "host_pool" else {}))
    if backup == "host_pool":
        assert decode.tree_cache.cache_controller is not None, "SGLang built its host pool"
    if guard is not None:
        attach_kvguard(prefill, guard)
        attach_kvguard(decode, guard)
    return prefill, decode


def run(guard, retracted, overlap=False, backup="cpu_tensor", between=None):
    retracted.clear()
    p, d = sides(guard, overlap, backup)
    start = pool_pages(d)
    out = pd_rig.run_pd(p, d, workload(7, N), between=between(d) if between is not None else None)
    assert pool_pages(d) == start
    return out, d, list(retracted)


def backups(d) -> dict:
    """The decode guard's retraction backup records (rid -> (tokens, crc32))."""
    from kvguard.sglang.retraction import _BACKUPS_ATTR

    return d.kvguard.__dict__.get(_BACKUPS_ATTR, {})


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@BACKUPS
def test_retracted_then_resumed_requests_are_not_refused(retracting, host_pool, overlap, backup):
    """Requests SGLang retracts and resumes decode on, under enforce, exactly as without kvguard:
    no violation, no abort, every restore recorded, no backup record left."""
    ref, _, plain = run(None, retracting, overlap, backup)
    assert plain, "SGLang retracted no request: the test checks nothing"
    out, d, guarded = run("enforce", retracting, overlap, backup)
    g = d.kvguard
    assert g.violations == [] and g.aborted == {}
    assert g.metrics["retractions_restored"] == len(guarded) > 0
    assert backups(d) == {}
    assert out == ref


@BACKUPS
def test_a_request_aborted_while_retracted_leaves_no_backup_record(retracting, host_pool, backup):
    """A client aborts a request while it is retracted (SGLang's ``abort_request``: the request
    in the prealloc queue's ``retracted_queue``, its backup discarded through
    ``discard_kv_cache_backup``): kvguard drops its backup record with it (before, the record
    stayed for the life of the server); the others decode as without kvguard."""
    from sglang.srt.managers.io_struct import AbortReq

    rids = [p.rid for p, _ in workload(7, N)]
    ref, _, _ = run(None, retracting, backup=backup)
    aborted: list[str] = []
    seen: dict = {}

    def between(d):
        def abort_one_retracted():
            if aborted:
                return
            for req in d.disagg_decode_prealloc_queue.retracted_queue:
                if not any(r != req.rid and r.startswith(req.rid) for r in rids):
                    assert req.rid in backups(d), "kvguard recorded its backup"
                    aborted.append(req.rid)
                    d.abort_request(AbortReq(rid=req.rid))
                    seen["left"] = dict(backups(d))
                    return

        return abort_one_retracted

    out, d, _ = run("enforce", retracting, backup=backup, between=between)
    assert aborted, "no request was aborted while retracted: the test checks nothing"
    assert aborted[0] not in seen["left"], "the aborted request's backup record is dropped with it"
    assert backups(d) == {}
    g = d.kvguard
    assert g._suspects == {}, "nor is it a suspect for the life of the server (every batch checked for it)"
    assert g.violations == [] and g.aborted == {}
    assert {k: v for k, v in out.items() if k != aborted[0]} == {k: v for k, v in ref.items() if k != aborted[0]}


@BACKUPS
def test_a_retracted_request_refused_its_return_leaves_no_record(retracting, host_pool, monkeypatch, backup):
    """SGLang's own capacity check (``DecodePreallocQueue._check_if_req_exceed_kv_capacity``, here
    with the queue's token capacity read as 1 for the first retracted request's return) aborts a
    retracted request as it is queued again: its output goes out finished, no restore follows
    and SGLang discards nothing. kvguard drops its backup record and its suspect entry there
    (before, both stayed for the life of the server); nothing is refused."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    real_add = DecodePreallocQueue.add
    refused: list[str] = []

    def add(self, req, is_retracted=False, *args, **kwargs):
        if not (is_retracted and not refused):
            return real_add(self, req, is_retracted, *args, **kwargs)
        refused.append(req.rid)
        capacity = self.max_total_num_tokens
        self.max_total_num_tokens = 1
        try:
            return real_add(self, req, is_retracted, *args, **kwargs)
        finally:
            self.max_total_num_tokens = capacity

    monkeypatch.setattr(DecodePreallocQueue, "add", add)
    out, d, _ = run("enforce", retracting, backup=backup)
    assert refused, "no retracted request came back: the test checks nothing"
    g = d.kvguard
    assert backups(d) == {}
    assert g._suspects == {}
    assert g.violations == [] and g.aborted == {}


@BACKUPS
def test_a_restore_that_differs_from_its_backup_refuses_that_request_alone(retracting, host_pool, monkeypatch, backup):
    """SGLang's restore of one resumed request lands other bytes than it backed up (here: one
    value of its first restored token changed after ``Req.load_kv_cache``, or after
    ``UnifiedRadixCache.restore_kv_cache`` for the host pool): that request alone is refused (its
    new pages stay unwritten); every other request decodes as without kvguard."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    ref, _, _ = run(None, retracting, backup=backup)
    hit: list[str] = []

    def corrupt_first_restored(req, req_to_token_pool, allocator):
        if not hit:
            hit.append(req.rid)
            slot = int(req_to_token_pool.req_to_token[req.kv.req_pool_idx, 0])
            allocator.get_kvcache().k_buffer[0][slot] += 1.0

    if backup == "cpu_tensor":
        real = Req.load_kv_cache

        def load_kv_cache(self, req_to_token_pool, allocator):
            out = real(self, req_to_token_pool, allocator)
            corrupt_first_restored(self, req_to_token_pool, allocator)
            return out

        monkeypatch.setattr(Req, "load_kv_cache", load_kv_cache)
    else:
        real_restore = UnifiedRadixCache.restore_kv_cache

        def restore_kv_cache(self, req, saved):
            out = real_restore(self, req, saved)
            corrupt_first_restored(req, self.req_to_token_pool, self.token_to_kv_pool_allocator)
            return out

        monkeypatch.setattr(UnifiedRadixCache, "restore_kv_cache", restore_kv_cache)
    out, d, _ = run("enforce", retracting, backup=backup)
    g = d.kvguard
    assert hit and list(g.aborted) == hit
    assert "differs from its backup" in str(g.aborted[hit[0]])
    assert {k: v for k, v in out.items() if k != hit[0]} == {k: v for k, v in ref.items() if k != hit[0]}
