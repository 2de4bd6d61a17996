"""The plugin as SGLang loads it: the entry point, the setting, the hooks' glue on real pools,
Prometheus, and the choice between the host and the device check of the forward batch's rows."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import kvguard
import kvguard.sglang
import pytest
import torch
from kvguard.sglang import forward as fwd

HOOKED = [
    "sglang.srt.managers.scheduler.Scheduler.__init__",
    "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
    "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output",
    "sglang.srt.managers.scheduler.Scheduler._release_aborted_request",
]


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("kvguard") == "kvguard_plugins:sglang"


def test_a_kvguard_that_cannot_load_stops_every_scheduler_when_it_was_asked_for():
    """SGLang's loader logs a plugin whose import or call fails and serves on: the entry point
    (``kvguard_plugins.sglang``) imports nothing of kvguard, and when ``KVGUARD_SGLANG`` asks for a
    kvguard that cannot be loaded (here its native library) it hooks ``Scheduler.__init__`` with
    a refusal: every scheduler raises at start-up, naming the cause."""
    out, last = scheduler_init_refusal("enforce", before="import sys; sys.modules['kvguard._kvguard'] = None;")
    assert last.startswith("REFUSED kvguard: KVGUARD_SGLANG='enforce' but kvguard cannot be loaded"), last
    assert "refusing to serve unguarded" in last


def scheduler_init_refusal(setting: str, *, before: str = "", check: str = "True") -> tuple:
    """SGLang's own ``load_plugins`` run in a fresh process with ``KVGUARD_SGLANG=setting``
    (``before`` runs first): kvguard's one hook on ``Scheduler.__init__`` (``check`` holds too)
    called as a scheduler's start would call it. Returns the process and its last line
    (``REFUSED <message>`` when the hook refused the start)."""
    code = (
        before + "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.plugins.hook_registry import HookRegistry;"
        "hooks = [h for t, hs in HookRegistry._hooks.items() if t.endswith('Scheduler.__init__')"
        " for _, h, src in hs if src is not None and src.plugin_name == 'kvguard'];"
        f"assert {check} and len(hooks) == 1, hooks;"
        "\ntry:\n    hooks[0](None, object())\nexcept RuntimeError as e:\n    print('REFUSED', e)"
    )
    env = dict(os.environ, KVGUARD_SGLANG=setting)
    env.pop("SGLANG_PLUGINS", None)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out, out.stdout.splitlines()[-1]


@pytest.mark.parametrize("mode", ["enforce", "report", "off"])
def test_sglang_loads_the_plugin_with_the_setting(mode):
    """SGLang's own loader (what run_scheduler_process calls first) finds kvguard through the
    entry point; the setting decides whether it registers its hooks."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.plugins.hook_registry import HookRegistry;"
        "import kvguard.sglang as k;"
        "hooks = sorted(t for t, hs in HookRegistry._hooks.items() for _, _, src in hs"
        " if src is not None and src.plugin_name == 'kvguard');"
        "print(k.installed_mode(), ','.join(hooks))"
    )
    env = dict(os.environ, KVGUARD_SGLANG=mode)
    env.pop("SGLANG_PLUGINS", None)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.splitlines()[-1].strip()
    assert last == ("None" if mode == "off" else f"{mode} {','.join(sorted(HOOKED))}")


def test_a_mistyped_setting_stops_every_scheduler_at_start_up():
    """SGLang's loader catches a plugin's exception and serves on ("Failed to execute general
    plugin"): with KVGUARD_SGLANG mistyped, kvguard must not leave the server unguarded. Loaded by
    SGLang's own load_plugins, it hooks Scheduler.__init__ with a refusal: the scheduler raises at
    start-up (which ends the server) naming the setting."""
    out, last = scheduler_init_refusal(
        "enforse", check="__import__('kvguard.sglang').sglang.installed_mode() is None"
    )
    assert last.startswith("REFUSED kvguard: KVGUARD_SGLANG must be enforce, report or off, not 'enforse'"), last
    assert "Failed to execute general plugin: kvguard" in out.stderr


def scheduler_of(eng, context_len=1024):
    """The attributes of SGLang's Scheduler (and its ModelRunner) the hooks read."""
    streamed = []
    runner = SimpleNamespace()
    return SimpleNamespace(
        req_to_token_pool=eng.req_to_token_pool,
        token_to_kv_pool_allocator=eng.allocator,
        tree_cache=eng.tree,
        model_config=SimpleNamespace(context_len=context_len),
        tp_worker=SimpleNamespace(model_runner=runner),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, _lp: streamed.extend(reqs)),
        streamed=streamed,
        queued=[],
    )


def test_the_hooks_on_a_scheduler(engine_factory, monkeypatch):
    """Scheduler.__init__ builds the guard on the scheduler's own pools; the intake refuses the
    one-token stub with an abort the client receives and never queues it; ModelRunner.forward
    brackets the KV store with the forward-batch check; violations reach Prometheus."""
    from prometheus_client import REGISTRY

    monkeypatch.setattr(kvguard.sglang, "_MODE", "enforce")
    eng = engine_factory(page_size=16, context_len=1024, policy=None)
    sched = scheduler_of(eng)
    kvguard.sglang._scheduler_started(None, sched)
    guard = sched.kvguard
    assert sched.tp_worker.model_runner.kvguard is guard and guard.policy == "enforce"
    assert guard.kv_pool is eng.kv_pool
    eng.guard = guard

    def queue(s, req, is_retracted=False):
        s.queued.append(req)

    before = REGISTRY.get_sample_value("kvguard_refused_requests_total") or 0.0
    ok = eng.request("ok", list(range(1, 40)))
    kvguard.sglang._add_request_to_queue(queue, sched, ok)
    stub = eng.request("too-long", list(range(1, 3001)))
    stub.set_finish_with_abort("Input length (3000 tokens) exceeds the maximum allowed length")
    kvguard.sglang._add_request_to_queue(queue, sched, stub)
    assert sched.queued == [ok] and sched.streamed == [stub]
    assert "kvguard refused this request" in stub.finished_reason.message
    assert stub.finished_reason.status_code == 400
    assert REGISTRY.get_sample_value("kvguard_refused_requests_total") == before + 1
    assert REGISTRY.get_sample_value(
        "kvguard_violations_total", {"kind": "exceeds_max_context", "policy": "enforce"}
    ) >= 1

    # ModelRunner.forward: the batch (the _cpu copies SGLang keeps) checked before the model
    # runs, the row check's end after.
    eng.prefill([ok])
    seen = []

    def model_forward(runner, batch):
        seen.append(guard.row_check.pending)
        eng.kv_pool.set_kv_buffer(eng.layer, batch.out_cache_loc, batch.k, batch.k)
        return "out"

    for r in eng.running:
        r.output_ids.append(7)
    rows = torch.tensor([ok.kv.req_pool_idx])
    seq = torch.tensor([ok.kv.kv_committed_len], dtype=torch.int64)
    last = eng.req_to_token_pool.req_to_token[rows, seq - 1].to(torch.int64)
    loc = eng.allocator.alloc_decode(seq + 1, seq + 1, last)
    eng.req_to_token_pool.write((rows, seq.clone()), loc.to(torch.int32))
    batch = SimpleNamespace(
        req_pool_indices=rows, seq_lens=seq + 1, req_pool_indices_cpu=rows, seq_lens_cpu=seq + 1,
        extend_seq_lens=None, out_cache_loc=loc, k=torch.ones(1, 1, 8),
        forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: False, is_split_prefill=lambda: False),
    )
    assert kvguard.sglang._forward(model_forward, sched.tp_worker.model_runner, batch) == "out"
    assert seen == [True] and not guard.row_check.pending
    assert guard.violations[1:] == [] and "ok" not in guard.aborted


def test_a_split_prefill_is_checked_once_before_its_first_slice(engine_factory, monkeypatch):
    """SGLang's split prefill (--enable-pdmux) calls ModelRunner.forward once per slice of the
    model's layers with the same forward batch: kvguard checks it before the first slice only
    (its writes recorded once, no violation), and the next batch again."""
    monkeypatch.setattr(kvguard.sglang, "_MODE", "enforce")
    eng = engine_factory(page_size=16, context_len=1024, policy=None)
    sched = scheduler_of(eng)
    kvguard.sglang._scheduler_started(None, sched)
    guard = eng.guard = sched.kvguard
    runner = sched.tp_worker.model_runner
    checks = []
    inner = guard.row_check.check
    monkeypatch.setattr(guard.row_check, "check", lambda loc: checks.append(len(loc)) or inner(loc))
    mode = SimpleNamespace(is_idle=lambda: False, is_extend=lambda: True, is_split_prefill=lambda: True)
    slices = []

    def model_slice(runner, batch):
        slices.append(batch)
        k = torch.ones(len(batch.out_cache_loc), 1, 8)
        eng.kv_pool.set_kv_buffer(eng.layer, batch.out_cache_loc, k, k)
        return "slice"

    def split_forward(reqs, out_cache_loc, seq_lens, extend_lens):
        """The prefill's forward as --enable-pdmux runs it: one forward batch, three slices."""
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        batch = SimpleNamespace(
            req_pool_indices=rows, seq_lens=lens, req_pool_indices_cpu=rows, seq_lens_cpu=lens,
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64), out_cache_loc=out_cache_loc,
            forward_mode=mode,
        )
        for _ in range(3):
            assert kvguard.sglang._forward(model_slice, runner, batch) == "slice"

    monkeypatch.setattr(eng, "forward", split_forward)
    a, b = eng.request("a", list(range(1, 40))), eng.request("b", list(range(100, 130)))
    for r in (a, b):
        assert eng.submit(r)
    eng.prefill([a])
    assert checks == [39] and len(slices) == 3 and len({id(x) for x in slices}) == 1
    assert guard.violations == []
    eng.prefill([b])
    assert checks == [39, 30] and len(slices) == 6
    assert guard.violations == [] and guard.aborted == {}


@pytest.mark.parametrize("form", ["tensor", "int32", "strided", "numpy", "list"])
def test_the_pages_the_allocator_hands_out_are_marked_whatever_form_it_returns(engine_factory, form):
    """The allocator hook marks the page of each slot it returned (a host tensor read in place,
    anything else as a host array); a slot below 0 or past the pool marks nothing."""
    eng = engine_factory(page_size=16)
    g = eng.guard
    free = [p for p in range(1, g._page_limit) if not g._handed[p]][:5]
    slots = torch.tensor([p * 16 + 3 for p in free] + [-5, g._page_limit * 16 + 1], dtype=torch.int64)
    out = {
        "tensor": slots,
        "int32": slots.to(torch.int32),
        "strided": torch.stack([slots, slots], 1)[:, 0],
        "numpy": slots.numpy(),
        "list": slots.tolist(),
    }[form]
    expected = g._handed.copy()
    expected[free] = True
    alloc = g._wrap_alloc_pages(lambda: out)
    assert alloc() is out
    assert (g._handed == expected).all()


def test_rows_on_the_host_are_checked_on_the_host(engine_factory):
    eng = engine_factory(page_size=16)
    assert isinstance(eng.guard.row_check, fwd.HostRowCheck) and eng.guard.row_check.where == "host"
    with pytest.raises(kvguard.ConfigError, match="not on a CUDA device"):
        fwd.row_check_for(eng.guard, True)


@pytest.mark.skipif(kvguard.driver_available(), reason="a CUDA driver is present")
def test_rows_on_a_gpu_without_a_driver(engine_factory, monkeypatch):
    """req_to_token on a CUDA device, but no driver: DeviceGuard raises kvguard.DeviceError (never
    a crash). Chosen automatically, the guard falls back to the host check and says so; asked
    for explicitly, it refuses to start."""
    eng = engine_factory(page_size=16)
    monkeypatch.setattr(fwd, "_on_device", lambda rows: True)
    monkeypatch.setattr(eng.req_to_token_pool.req_to_token.__class__, "device", property(lambda t: torch.device("cpu")), raising=False)
    check = fwd.row_check_for(eng.guard, None)
    assert check.where == "host" and eng.guard.metrics["device_check_unavailable"] == 1
    with pytest.raises(kvguard.ConfigError, match="device check"):
        fwd.row_check_for(eng.guard, True)


class RecordingDeviceGuard:
    """kvguard.DeviceGuard's calls as the device check makes them, with the page table it was
    given (read back from the tensor the pointer names)."""

    def __init__(self, config, *, device=0, max_seqs=1024):
        self.calls = []
        self.findings_lost = 0

    def sync_tags(self, table, *, stream):
        self.calls.append("sync_tags")

    def set_readers(self, table, req_ids, *, stream):
        self.calls.append(("set_readers", list(req_ids)))

    def clear_status(self, *, stream):
        self.calls.append("clear_status")

    def verify_block_table(self, block_table, seq_lens, num_seqs, max_blocks, *, stream):
        self.calls.append(("verify_block_table", block_table, seq_lens, num_seqs, max_blocks, stream))

    def verify_token_rows(self, req_to_token, num_rows, row_stride, rows, seq_lens, num_seqs, max_pages, *, stream):
        self.calls.append(("verify_token_rows", req_to_token, num_rows, row_stride, rows, seq_lens, num_seqs, max_pages, stream))

    def begin_drain(self, *, stream):
        self.calls.append("begin_drain")

    def finish_drain(self, table, *, stream, wait=True):
        self.calls.append(("finish_drain", wait))
        return []


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["int32", "strided"])
def test_device_check_reads_the_rows_on_the_device_and_verifies_on_the_stream(engine_factory, monkeypatch, page_size, layout):
    """The device path's logic on CPU tensors. SGLang's int32 req_to_token is read in place
    (verify_token_rows: the whole table, the batch's rows and lengths as int64, contiguous); a
    table in any other layout (here: not contiguous) is gathered first (verify_block_table: the rows' first slot of each page over the
    page size, int32, contiguous). The readers are the batch's request keys, everything on
    SGLang's stream, the ring's copy begun behind the check (never a drain that waits in the
    forward)."""
    monkeypatch.setattr(fwd, "DeviceGuard", RecordingDeviceGuard)
    monkeypatch.setattr(fwd.DeviceRowCheck, "_current_stream", lambda self: 77)
    eng = engine_factory(page_size=page_size, policy=None)
    if layout == "strided":
        # The same int32 entries, not contiguous: the rows cannot be read in place.
        eng.req_to_token_pool.req_to_token = eng.req_to_token_pool.req_to_token.t().contiguous().t()
    from kvguard.sglang import Guard

    eng.guard = Guard(eng.req_to_token_pool, eng.allocator, tree_cache=eng.tree, kv_pool=eng.kv_pool,
                      context_len=eng.context_len, device_rows=None)
    assert eng.guard.row_check.where == "host"  # CPU rows: the host path
    monkeypatch.setattr(fwd, "_on_device", lambda rows: True)
    check = fwd.row_check_for(eng.guard, True)
    eng.guard.row_check = check
    reqs = [eng.request(f"r{i}", list(range(100 * i + 1, 100 * i + 41))) for i in range(3)]
    for r in reqs:
        assert eng.submit(r)
    eng.prefill(reqs)
    kept = {}
    real = check._verify_rows

    def spy(pos, keys, full):
        out = real(pos, keys, full)
        kept["inflight"] = check._inflight
        return out

    monkeypatch.setattr(check, "_verify_rows", spy)
    eng.decode()
    dg = check.device_guard
    names = [c if isinstance(c, str) else c[0] for c in dg.calls]
    launch = "verify_token_rows" if layout == "int32" else "verify_block_table"
    last = len(names) - 1 - names[::-1].index("sync_tags")
    # The ring's copy begun behind the check; one still in flight finished first, never waited for.
    assert [n for n in names[last:] if n != "finish_drain"] == ["sync_tags", "set_readers", "clear_status", launch, "begin_drain"]
    assert all(c[1] is False for c in dg.calls[last:] if c[0] == "finish_drain")
    readers = next(c for c in reversed(dg.calls) if c[0] == "set_readers")[1]
    assert readers == [eng.guard.request_key(r.rid) for r in reqs]
    rt = eng.req_to_token_pool.req_to_token
    lengths = [r.kv.kv_committed_len for r in reqs]
    if layout == "int32":
        _, ptr, num_rows, stride, rows_ptr, lens_ptr, n, pages, stream = next(c for c in reversed(dg.calls) if c[0] == launch)
        rows, seq = kept["inflight"]
        assert (ptr, num_rows, stride) == (rt.data_ptr(), rt.shape[0], rt.shape[1])
        assert (rows_ptr, lens_ptr, n, pages, stream) == (rows.data_ptr(), seq.data_ptr(), 3, -(-max(lengths) // page_size), 77)
        assert rows.dtype == seq.dtype == torch.int64 and rows.is_contiguous() and seq.is_contiguous()
        assert rows.tolist() == [r.kv.req_pool_idx for r in reqs] and seq.tolist() == lengths
    else:
        _, bt, sl, n, width, stream = next(c for c in reversed(dg.calls) if c[0] == launch)
        table, seq = kept["inflight"]
        assert (bt, sl, n, width, stream) == (table.data_ptr(), seq.data_ptr(), 3, table.shape[1], 77)
        assert table.dtype == torch.int32 and table.is_contiguous()
        for i, r in enumerate(reqs):
            length = r.kv.kv_committed_len
            assert int(seq[i]) == length
            want = rt[r.kv.req_pool_idx, :length:page_size] // page_size
            assert torch.equal(table[i, : len(want)], want.to(torch.int32))
    assert eng.guard.violations == []


def test_a_refused_requests_payload_entries_keep_no_content():
    """``_withheld``: a refused request's entry of a per-request list of SGLang's output payload.
    Sequences of tokens, ids, logprobs or hidden states come back empty, of their own type (a
    tensor or array keeps its trailing shape); counts, strings, None and other records as they
    were."""
    import array

    import numpy as np
    from kvguard.sglang.outputs import _withheld

    assert _withheld([1, 2, 3]) == [] and type(_withheld([1])) is list
    assert _withheld((0.5, 0.25)) == ()
    ids = _withheld(array.array("q", [7, 8]))
    assert isinstance(ids, array.array) and ids.typecode == "q" and len(ids) == 0
    hidden = _withheld(torch.ones(3, 4))
    assert isinstance(hidden, torch.Tensor) and tuple(hidden.shape) == (0, 4)
    assert tuple(_withheld(torch.tensor(5.0)).shape) == (0,)
    assert _withheld(np.arange(6).reshape(2, 3)).shape == (0, 3)
    record = object()
    for kept in (17, 0.5, "text so far", None, record, {"k": [1]}):
        assert _withheld(kept) is kept


def test_a_guard_keeps_the_latest_refusals_not_all(engine_factory, monkeypatch):
    """A server refusing for days keeps the latest refused requests and violations, not all of
    them: past twice ``KEPT`` the oldest go, down to ``KEPT``. Every refusal is still counted.
    (Each is refused at intake and dropped, as SGLang's ``_release_aborted_request`` drops it.)"""
    import kvguard.sglang.refusals as refusals

    monkeypatch.setattr(refusals, "KEPT", 2)
    eng = engine_factory(page_size=16, context_len=1024)
    g = eng.guard
    for i in range(5):
        req = eng.request(f"big{i}", list(range(1, 2001)))
        assert not eng.submit(req)
        g.drop_unscheduled(req)
    assert list(g.aborted) == ["big3", "big4"]
    assert [v.request for v in g.violations] == ["big3", "big4"]
    assert [rid for rid, _ in g.refusals] == ["big3", "big4"]
    assert g.metrics["aborted_requests"] == 5 and g.metrics["violations_total"] == 5
    g.violations.clear()
    assert g.violations == []


def test_a_streaming_session_request_is_refused_at_intake_under_enforce(engine_factory):
    """A streaming session lends one turn's row and pages to the next (SGLang's
    ``StreamingSession``), outside the calls kvguard follows: under enforce its requests are
    refused at intake with a reason that names it, before any row or page; a request of no
    session is admitted as before."""
    eng = engine_factory(page_size=16)
    turn = eng.request("turn-1", [5] * 20)
    turn.session = SimpleNamespace(streaming=True)
    assert not eng.submit(turn)
    assert "streaming session" in str(eng.guard.aborted["turn-1"])
    assert eng.submit(eng.request("plain", [6] * 20))
    assert set(eng.guard.aborted) == {"turn-1"}


def test_a_session_slot_freeing_its_row_ends_the_request_on_it(engine_factory):
    """Report mode lets a streaming session run; closing it, SGLang frees the row through the
    session's slot, which is not a request (``StreamingSession.release_session``: the tree's
    ``free_kv_row`` of its KV record, then ``ReqToTokenPool.free(slot)``). The request kvguard
    knows on that row ends, as at its own free: no exception in SGLang's scheduler, nothing left
    in the table."""
    eng = engine_factory(page_size=16, policy="report")
    a = eng.request("a", [5] * 40)
    assert eng.submit(a)
    eng.prefill([a])
    slot = SimpleNamespace(kv=a.kv, lock=None)
    eng.tree.free_kv_row(slot.kv, [(slot.kv.cache_protected_len, slot.kv.kv_allocated_len)])
    eng.req_to_token_pool.free(slot)
    snap = eng.guard.table.snapshot()
    assert snap.requests == 0 and snap.owned == 0
    assert eng.guard.violations == []
