"""The device check of SGLang's rows (``req_to_token`` on a GPU: ``kvguard.sglang.forward.DeviceRowCheck``)
on SGLang's own Scheduler, in its normal and its overlap loop (scheduler_rig.py, the Triton row
write), with ``kvguard.DeviceGuard`` replaced by :class:`HostDeviceRows`, a stand-in over host
memory that judges each forward's rows as the device's read check does (by the page's owner and
tenant in the tags the last ``sync_tags`` left) and records when each call was made.

What these tests hold is the wiring: nothing in a forward waits for the GPU (under the overlap
schedule a wait when the forward ends would wait for the model just launched and serialise SGLang's
two halves), and a device verdict still refuses its request before any output of the forward that
read its rows leaves the scheduler. That the kernels give the host table's verdicts is shown on
the simulated grid (``tests/it/cuda_host_verify.rs``) and on a GPU (``scripts/gpu-check``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import kvguard.sglang.forward as fwd
from scheduler_rig import PROMPTS, attach_kvguard, build_scheduler, finish, generate_req, prompt_reqs, run, sent_since
from scheduler_rig import loop_step as step


def reqs(max_new=12):
    return prompt_reqs(max_new)


def build(page_size, overlap):
    """SGLang's Scheduler for these tests' workload (no kvguard yet)."""
    return build_scheduler(
        page_size=page_size, tokens=1024 if page_size == 16 else 512, rows=8, context_len=256,
        disable_overlap_schedule=not overlap,
    )


@dataclass
class Record:
    """One device violation, with the fields the plugin reads of a ``kvguard.Violation``."""

    kind: str
    op: str
    request: int
    page: int
    owner: int | None = None
    tenant: int | None = None
    owner_tenant: int | None = None

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) of page {self.page} [device]"


def _view(ptr: int, n: int, ctype) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * n).from_address(ptr)) if n else np.zeros(0)


class HostDeviceRows:
    """``kvguard.DeviceGuard``'s calls as SGLang's device row check makes them, run on host memory.

    ``verify_token_rows`` reads SGLang's int32 ``req_to_token`` and the batch's rows and lengths
    through their pointers and judges every page a row reads (page ``j`` is entry ``j *
    page_size`` over the page size) against the tags ``sync_tags`` took: the reader's own page,
    or a shared page of its tenant, passes; anything else is a record in the ring. ``refuse``
    names readers whose reads the device refuses whatever the tags say (a finding only the
    device makes, so a test can tell the device's verdicts from the host's). The ring's copy is
    taken at ``begin_drain`` (the host runs each call at once: the copy has always landed).
    ``calls`` keeps each call with whether it was made inside ``ModelRunner.forward``."""

    def __init__(self, config, *, device=0, max_seqs=1024):
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self.tags = []
        self.readers = []
        self.ring = []
        self.copy = None
        self.refuse = set()
        # Readers whose next finding the ring loses (``DeviceGuard.findings_lost`` counts it,
        # as of the copy that covers it).
        self.lose = set()
        self.findings_lost = 0
        self._lost_on_device = 0
        self._copy_lost = 0
        self.in_forward = False
        self.calls = []

    def _call(self, name, **kw):
        self.calls.append((name, self.in_forward, kw))

    def sync_tags(self, table, *, stream):
        self._call("sync_tags")
        self.tags = [table.page_info(p) for p in range(self.num_pages)]
        return self.num_pages

    def set_readers(self, table, req_ids, *, stream):
        self._call("set_readers")
        self.readers = [(k, table.request_info(k).tenant) for k in req_ids]

    def clear_status(self, *, stream):
        self._call("clear_status")

    def verify_token_rows(self, req_to_token, num_rows, row_stride, rows, seq_lens, num_seqs, max_pages, *, stream):
        self._call("verify_token_rows", n=num_seqs)
        rt = _view(req_to_token, num_rows * row_stride, ctypes.c_int32).reshape(num_rows, row_stride)
        at = _view(rows, num_seqs, ctypes.c_int64)
        lens = _view(seq_lens, num_seqs, ctypes.c_int64)
        ps = self.page_size
        for s in range(num_seqs):
            key, tenant = self.readers[s]
            if key in self.lose:
                self.lose.discard(key)
                self._lost_on_device += 1
                continue
            if key in self.refuse:
                self.ring.append(Record("foreign_page", "read", key, -1))
                continue
            for j in range(-(-int(lens[s]) // ps)):
                page = int(rt[int(at[s]), j * ps]) // ps
                info = self.tags[page] if 0 <= page < self.num_pages else None
                if info is not None and (
                    (info.state == "owned" and info.owner == key) or (info.state == "shared" and info.tenant == tenant)
                ):
                    continue
                self.ring.append(Record("foreign_page", "read", key, page, owner=None if info is None else info.owner))
                break

    def begin_drain(self, *, stream):
        self._call("begin_drain")
        assert self.copy is None, "one copy in flight"
        self.copy, self.ring = self.ring, []
        self._copy_lost = self._lost_on_device

    def finish_drain(self, table, *, stream, wait=True):
        self._call("finish_drain", wait=wait)
        out, self.copy = self.copy, None
        if out is not None:
            self.findings_lost = self._copy_lost
        return out

    def drain(self, table, *, stream):
        self._call("drain")
        out, self.ring = self.ring, []
        self.findings_lost = self._lost_on_device
        return out


def scheduler(monkeypatch, page_size, *, overlap):
    """SGLang's Scheduler guarded under enforce, its rows checked by the device check on the
    stand-in; ``ModelRunner.forward`` marks the stand-in's calls made inside it."""
    s = build(page_size, overlap)
    guard = attach_kvguard(s, "enforce")
    monkeypatch.setattr(fwd, "DeviceGuard", HostDeviceRows)
    monkeypatch.setattr(fwd, "_on_device", lambda rows: True)
    monkeypatch.setattr(fwd.DeviceRowCheck, "_current_stream", lambda self: 7)
    guard.row_check = fwd.row_check_for(guard, True)
    assert guard.row_check.where == "device"
    dg = guard.row_check.device_guard
    forward = s.tp_worker.model_runner.forward

    def marked(*args, **kwargs):
        dg.in_forward = True
        try:
            return forward(*args, **kwargs)
        finally:
            dg.in_forward = False

    s.tp_worker.model_runner.forward = marked
    return s, guard, dg


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_workload_waits_for_nothing_in_the_forward(triton_rows, monkeypatch, page_size, overlap):
    """Every forward's rows are checked on the device and the ring's copy begun behind the check;
    nothing in ``ModelRunner.forward`` waits for the GPU (no drain, no ``finish_drain`` that
    waits); every forward's verdicts are taken by the end; nobody is refused and every output
    is the unguarded run's."""
    s, guard, dg = scheduler(monkeypatch, page_size, overlap=overlap)
    out = run(s, reqs())
    plain = build(page_size, overlap)
    assert out == run(plain, reqs())
    assert guard.violations == [] and guard.aborted == {}
    if overlap:
        assert s.overlapped > 0, "batches were launched before the last one's result was processed"
    checks = [c for c in dg.calls if c[0] == "verify_token_rows"]
    assert len(checks) >= 12 and all(inside for _, inside, _ in checks)
    assert not [c for c in dg.calls if c[0] == "drain"]
    waits_inside = [c for c in dg.calls if c[0] == "finish_drain" and c[1] and c[2]["wait"]]
    assert waits_inside == [], "a wait for the GPU inside the forward"
    # The ring's copy follows the check it covers, inside the same forward.
    names = [(c[0], c[1]) for c in dg.calls]
    for i, (name, inside) in enumerate(names):
        if name == "verify_token_rows":
            assert names[i + 1] in (("begin_drain", True), ("finish_drain", True)), names[i : i + 3]
    check = guard.row_check
    assert check.verdicts.taken_through == check.verdicts.checked > 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("when", ["running", "finishing"])
def test_a_device_verdict_refuses_before_the_forwards_output_leaves(triton_rows, monkeypatch, page_size, overlap, when):
    """The device refuses r1's reads from some step on (a finding of the device alone: the
    host's checks pass its rows): after three decode steps (``running``), or for its last
    token (the forward that reads for it is refused: under the overlap schedule the one after
    the forward in flight), so that it finishes, and SGLang gives its row back, in the step
    whose verdict refuses it (``finishing``). The forward that read them still runs (nothing waits for its
    verdict there), but its verdict is taken before that forward's output is built: r1 is
    aborted and no token of r1's from that forward on leaves the scheduler, not even with the
    abort; r0, r2 and r3 are served as without kvguard."""
    s, guard, dg = scheduler(monkeypatch, page_size, overlap=overlap)
    for r in reqs():
        s.handle_generate_request(r)
    r1 = None
    for _ in range(40):
        step(s)
        r1 = next((r for r in s.running_batch.reqs if r.rid == "r1"), r1)
        if r1 is not None and len(r1.output_ids) >= (4 if when == "running" else 10 if overlap else 11):
            break
    assert r1 is not None and not r1.finished()
    tokens_before = len(r1.output_ids)
    sent_before = len(s.outputs.sent)
    dg.refuse.add(guard.request_key("r1"))
    out = finish(s)
    assert set(guard.aborted) == {"r1"}
    v = guard.aborted["r1"]
    assert v.kind == "foreign_page" and v.op == "read" and v.request == "r1"
    assert out["r1"][1]["type"] == "abort"
    # Of r1, nothing left after the refusal began but the abort: no token the refused forward
    # (or any later one) made, not even with the abort.
    for reason, ids, decode_ids in sent_since(s, sent_before, "r1"):
        assert reason is not None and reason["type"] == "abort" and len(ids) == 0 and len(decode_ids) == 0
    assert len(out["r1"][0]) <= tokens_before
    plain = build(page_size, overlap)
    want = run(plain, reqs())
    for rid in ("r0", "r2", "r3"):
        assert out[rid] == want[rid]
    assert not [c for c in dg.calls if c[0] == "finish_drain" and c[1] and c[2]["wait"]]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_device_finding_whose_record_is_lost_refuses_every_request_its_forward_read(triton_rows, monkeypatch, overlap):
    """The device flags r1 in a decode forward and its ring loses the record (more flagged
    sequences between two copies than half the ring holds): the device fenced r1's rows, and
    the host cannot tell which of the forward's requests it was. Every request that forward
    read is refused, none of their tokens from it on leaves the scheduler; a request that
    arrives afterwards is served as without kvguard."""
    s, guard, dg = scheduler(monkeypatch, 16, overlap=overlap)
    for r in reqs():
        s.handle_generate_request(r)
    for _ in range(40):
        step(s)
        if len(s.running_batch.reqs) == 4 and all(len(r.output_ids) >= 3 for r in s.running_batch.reqs):
            break
    read = {r.rid for r in s.running_batch.reqs}
    assert read == {"r0", "r1", "r2", "r3"}
    sent_before = len(s.outputs.sent)
    dg.lose.add(guard.request_key("r1"))
    step(s)
    assert not dg.lose, "r1 was read and its finding lost"
    s.handle_generate_request(generate_req("late", PROMPTS["r0"], max_new=12, salt="acme"))
    out = finish(s)
    assert set(guard.aborted) == read
    for rid in read:
        assert "record naming it was lost" in str(guard.aborted[rid])
        assert out[rid][1]["type"] == "abort"
        for reason, ids, decode_ids in sent_since(s, sent_before, rid):
            assert reason is not None and reason["type"] == "abort" and len(ids) == 0 and len(decode_ids) == 0
    assert guard.metrics["violations_total:device_findings_lost"] == 4
    plain = build(16, overlap)
    assert out["late"] == run(plain, [generate_req("late", PROMPTS["r0"], max_new=12, salt="acme")])["late"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("changed", [False, True])
def test_a_decode_forward_reads_the_slots_copied_at_the_row_write(triton_rows, monkeypatch, page_size, overlap, changed):
    """On a GPU SGLang's ``out_cache_loc`` is a device tensor: the decode row write copies its
    slots to the host (on the stream that prepares the batch), and the decode forward's check
    takes that copy instead of copying ``out_cache_loc`` again at its entry, on the forward's
    stream (under the overlap schedule a wait for the forward before it). Here the tensors are
    on the host, so the row write's arrays are taken as copies (as a device tensor's are) and
    every read of a decode forward's ``out_cache_loc`` by the check is recorded: there is none,
    and the workload is served as without kvguard. ``changed``: each decode ``out_cache_loc`` is
    changed in place (by nothing: its version moves) between its allocation and its forward;
    the check then reads it again."""
    import kvguard.sglang.row_writes as row_writes
    from kvguard.sglang.arrays import _flat, _in_place

    s = build(page_size, overlap)
    guard = attach_kvguard(s, "enforce")
    assert guard.row_check.where == "host"
    monkeypatch.setattr(row_writes, "_in_place", lambda t: np.array(_flat(t)))
    decode_locs, read = [], []
    monkeypatch.setattr(fwd, "_in_place", lambda t: read.append(t) or _in_place(t))
    monkeypatch.setattr(fwd, "_flat", lambda t: read.append(t) or _flat(t))
    forward = s.tp_worker.model_runner.forward

    def watched(fb, *args, **kwargs):
        if fb.forward_mode.is_decode():
            decode_locs.append(fb.out_cache_loc)
            if changed:
                fb.out_cache_loc.add_(0)
        return forward(fb, *args, **kwargs)

    s.tp_worker.model_runner.forward = watched
    out = run(s, reqs())
    plain = build(page_size, overlap)
    assert out == run(plain, reqs())
    assert guard.violations == [] and guard.aborted == {}
    assert len(decode_locs) >= 8
    reread = [loc for loc in decode_locs if any(t is loc for t in read)]
    assert len(reread) == (len(decode_locs) if changed else 0)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_decode_row_write_reads_the_host_copies_sglang_keeps(triton_rows, monkeypatch, page_size, overlap):
    """On a GPU a decode batch's ``req_pool_indices`` and the columns its row write writes are
    device tensors, of which SGLang keeps host copies (``req_pool_indices_cpu``, and
    ``seq_lens_cpu`` before the step's increment): the row write reads those instead of copying
    its own. Here the batch's ``req_pool_indices`` is taken for a device tensor and every array
    the row write reads is recorded: neither of the row write's index tensors is read, the host
    copies are, and the workload is served as without kvguard."""
    import kvguard.sglang.row_writes as row_writes
    import kvguard.sglang.process_hooks as hooks
    from kvguard.sglang.arrays import _flat
    from sglang.srt.managers import schedule_batch

    s = build(page_size, overlap)
    guard = attach_kvguard(s, "enforce")
    batch = [None]
    alloc = schedule_batch.alloc_for_decode

    def seen(b, *args, **kwargs):
        batch[0] = b
        if b.req_pool_indices_cpu is b.req_pool_indices:
            # On the host SGLang's copy is the tensor itself; on a GPU it is a tensor of its own.
            b.req_pool_indices_cpu = b.req_pool_indices.clone()
        return alloc(b, *args, **kwargs)

    monkeypatch.setattr(schedule_batch, "alloc_for_decode", seen)
    monkeypatch.setattr(hooks, "_on_device", lambda t: batch[0] is not None and t is batch[0].req_pool_indices)
    read = []
    monkeypatch.setattr(row_writes, "_in_place", lambda t: read.append(t) or np.array(_flat(t)))
    pool = s.req_to_token_pool
    write = pool.write
    decode_writes = []

    def watched(indices, values):
        if not isinstance(indices[1], slice):
            decode_writes.append((indices, batch[0].req_pool_indices_cpu))
        return write(indices, values)

    pool.write = watched
    out = run(s, reqs())
    plain = build(page_size, overlap)
    assert out == run(plain, reqs())
    assert guard.violations == [] and guard.aborted == {}
    assert len(decode_writes) >= 8
    for (rows, cols), rows_cpu in decode_writes:
        assert not any(t is rows for t in read), "the device rows of the row write read"
        assert not any(t is cols for t in read), "the device columns of the row write read"
        assert any(t is rows_cpu for t in read), "the host copy of the rows read"
