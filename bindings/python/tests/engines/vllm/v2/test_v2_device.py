"""kvguard's GPU path for vLLM's Model Runner V2 (``kvguard.vllm.device``), run on vLLM's CPU
platform by the same engine as ``test_v2_runner.py`` (vLLM's EngineCore, V2's own
``execute_model``, ``prepare_attn`` and kernels), with the plugin told the runner is on a GPU and
``kvguard.DeviceGuard`` stood in by ``host_device.HostDevice``: the same methods, on V2's host
tensors through their pointers, by the rules the kernels implement.

What runs as on a GPU: the host copy of what V2 stages (``BlockTables.append_block_ids``), the
host judgement of the step as staged, the device calls in their order (tags synced after the early
events for the write check and again after the late ones for the reads, readers named, status
cleared, V2's own slot mapping and gathered tables checked in place, the fence), the ring drained
when the step's output is read, and the refusals reaching vLLM's scheduler. What only a GPU shows
(the kernels' verdicts on the device, stream order, no host synchronisation): ``scripts/gpu-check``
and ``tests/it/cuda_host_verify.rs`` on the simulated grid.
"""

from __future__ import annotations

import v2_engine  # noqa: I001  first: its settings must precede vLLM's import
from v2_engine import RealConfig, RealEngine

import pytest

import test_v2_hybrid as hybrid
import test_v2_runner as base
from host_device import HostDevice
from kvguard.vllm import runner_v2

SCHEDULING = base.SCHEDULING


@pytest.fixture
def on_device(monkeypatch):
    """The plugin takes its GPU path for V2, with ``HostDevice`` for ``kvguard.DeviceGuard``;
    yields the devices it made (one per guarded engine)."""
    made: list[HostDevice] = []

    def new_device_guard(runner, guard):
        dev = HostDevice(guard.table, guard.block_size, runner.max_num_reqs)
        dev.upload_all_tags(guard.table, stream=0)
        made.append(dev)
        return dev

    monkeypatch.setattr(runner_v2, "_on_device", lambda runner: True)
    monkeypatch.setattr(runner_v2, "new_device_guard", new_device_guard)
    monkeypatch.setattr(runner_v2, "engine_stream", lambda: 0)
    return made


STEP_CALLS = [
    "sync_tags",
    "set_readers",
    "clear_status",
    "verify_slot_mapping",
    "sync_tags",
    "verify_block_table",
    "fence_refused",
]


def step_calls(groups: int) -> list[str]:
    """A checked step's device calls with ``groups`` KV cache groups (each group's slot mapping,
    gathered table and fence)."""
    per_group = {"verify_slot_mapping", "verify_block_table", "fence_refused"}
    return [c for c in STEP_CALLS for _ in range(groups if c in per_group else 1)]


def assert_device_path(g: RealEngine, made: list[HostDevice], groups: int = 1) -> HostDevice:
    """The guarded engine ran on the device path: every checked step made the device calls in
    order (those of each of its ``groups`` KV cache groups), the ring was drained at the outputs,
    and nothing is left in it."""
    assert g.guard.device is not None and len(made) == 1
    dev = made[0]
    calls = dev.calls
    checked = [i for i, c in enumerate(calls) if c == "verify_slot_mapping" and calls[i - 1] != c]
    assert len(checked) > 10
    expected = step_calls(groups)
    for i in checked:
        assert calls[i - 3 : i - 3 + len(expected)] == expected, calls[i - 3 : i - 3 + len(expected)]
    assert calls.count("finish_drain") >= len(checked) // 2
    assert dev.ring == [] and dev.copy is None
    return dev


def test_clean_v2_on_device_async_prefix_caching_and_preemption(on_device):
    """Several hundred requests, three tenants, a pool that preempts and evicts, async
    scheduling: the device path refuses nothing, its host copy of V2's rows judges every step
    clean, and every output is the unguarded run's."""
    rc = RealConfig(num_blocks=32, block_size=32, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512)
    g = base.run_v2(rc, lambda e: base.workload(e, 5, 300), guarded=True)
    p = base.reference(rc, 5, 300)
    assert g.events.get("preempt", 0) > 0 and g.events.get("evict", 0) > 0
    base.assert_clean(g, p, 300)
    assert_device_path(g, on_device)


def test_clean_v2_on_device_sync(on_device):
    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=False)
    g = base.run_v2(rc, lambda e: base.workload(e, 8, 60, salts=2, max_prompt=100), guarded=True)
    p = base.reference(rc, 8, 60, salts=2, max_prompt=100)
    base.assert_clean(g, p, 60)
    assert_device_path(g, on_device)


@SCHEDULING
def test_on_device_a_stale_entry_in_v2s_staged_table_is_fenced_on_its_step(async_scheduling, monkeypatch, on_device):
    """V2's staged block table keeps a slot's previous occupant's entries (the write skipped,
    the count moved): the host copy holds what V2 was asked to stage, so only the device check
    of V2's own gathered table (and slot mapping) sees it; the victim's rows and slots are fenced
    before the forward, and it alone is refused, on the step of the bug, every other request
    served as without the bug."""
    guarded = base.stale_entry_case(async_scheduling, monkeypatch)
    assert guarded.guard.device is not None and len(on_device) == 1
    assert {r.request for r in on_device[0].drained} == {"short-b"}, on_device[0].drained


@SCHEDULING
def test_on_device_a_slot_mapping_into_another_requests_block_is_fenced(async_scheduling, monkeypatch, on_device):
    """V2's compute_slot_mappings sends one of the writer's tokens into the reader's block: the
    device check of V2's own slot mapping flags the writer and the fence turns its slots into
    padding, so the reader is served as without the bug and the writer alone is refused."""
    guarded = base.misdirected_slot_case(async_scheduling, monkeypatch)
    assert guarded.guard.device is not None and len(on_device) == 1
    drained = on_device[0].drained
    assert {r.request for r in drained} == {"writer"} and "write" in {r.op for r in drained}


@SCHEDULING
def test_on_device_a_gathered_row_naming_another_requests_block_is_fenced(async_scheduling, monkeypatch, on_device):
    """V2's gather_block_tables hands attention a row whose first entry is another request's
    block, once, mid-decode (V2's persistent table, and so its slot mapping, stay right): only
    the device check of the gathered table sees it. Unguarded, the reader reads the other
    request's KV; on the device path its row is fenced before the forward and it alone is
    refused, the owner of the block served as without the bug."""
    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)

    def corrupt(engine, block_tables, tables, rows, idx_mapping) -> None:
        tables[0][rows["reader"], 0] = int(tables[0][rows["owner"], 0])

    # Two tenants: the device lets any request of a prefix's tenant read its published blocks
    # (it does not know the prefix's holders; the host check, exact, cannot see V2's gather).
    misgathered_case(rc, 50, corrupt, monkeypatch, on_device)


# -- a hybrid model (full attention beside a sliding window) on the device path ----------------


def test_clean_v2_hybrid_on_device_async(on_device):
    """A hybrid workload (``test_v2_hybrid.py``'s pool, 60 requests, async) on the device path: V2's gathered
    sliding-window rows (their entries before the window nulled by V2) are checked on the device
    over the window of the step's first token (``device.window_rows``), as the host checks the
    staged ones; nothing refused, outputs as the unguarded run's."""
    rc = hybrid.hybrid(**hybrid.CLEAN_ASYNC)
    fill = lambda e: base.workload(e, 6, 60)  # noqa: E731
    g = base.run_v2(rc, fill, guarded=True)
    p = base.run_v2(rc, fill, guarded=False)
    base.assert_clean(g, p, 60)
    assert g.events.get("preempt", 0) > 0 and g.events.get("detach", 0) > 0
    hybrid.assert_hybrid(g)
    assert_device_path(g, on_device, groups=2)


def test_on_device_a_stale_entry_in_v2s_sliding_window_staged_table_is_fenced(monkeypatch, on_device):
    """The sliding-window group's staged row keeps its slot's previous occupant's entry (async):
    the host copy holds what V2 was asked to stage, so the device check of what V2 built sees
    it; the victim alone is refused, on the step of the bug."""
    guarded = hybrid.stale_window_entry_case(True, monkeypatch)
    assert guarded.guard.device is not None and len(on_device) == 1
    assert {r.request for r in on_device[0].drained} == {"short-b"}, on_device[0].drained


def test_on_device_a_gathered_sliding_window_row_naming_another_requests_block_is_fenced(monkeypatch, on_device):
    """V2's gather hands attention a sliding-window row whose last entry (inside the window) is
    another tenant's block, once, mid-decode; V2's persistent table and slot mapping stay right,
    so only the device's check of the gathered window rows sees it. The reader's rows are fenced
    and it alone is refused, the owner served as without the bug."""
    rc = hybrid.hybrid(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)

    def corrupt(engine, block_tables, tables, rows, idx_mapping) -> None:
        # The last entry of each row (inside the window).
        g = hybrid.window_group(engine)
        last = {r: int(block_tables.num_blocks.np[g, int(idx_mapping[rows[r]])]) - 1 for r in ("reader", "owner")}
        tables[g][rows["reader"], last["reader"]] = int(tables[g][rows["owner"], last["owner"]])

    misgathered_case(rc, 90, corrupt, monkeypatch, on_device)


def misgathered_case(rc: RealConfig, prompt: int, corrupt, monkeypatch, on_device) -> None:
    """V2's gather_block_tables hands attention a row of "reader" (tenant beta) corrupted by
    ``corrupt(engine, block_tables, gathered, rows, idx_mapping)`` once, mid-decode, beside "owner" (tenant
    alpha) and a bystander: without kvguard the reader reads the owner's KV; on the device path
    the reader alone is refused, on that step, by the device's read check, everyone else served
    as without the bug."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    def fill(e: RealEngine) -> None:
        e.add("owner", list(range(1, prompt)), 30, cache_salt="alpha")
        e.add("reader", list(range(100, 100 + prompt)), 30, cache_salt="beta")
        e.add("bystander", list(range(300, 340)), 30, cache_salt="beta")

    clean = base.run_v2(rc, fill, guarded=False)
    original = BlockTables.gather_block_tables
    armed: dict = {}

    def misgathered(self, idx_mapping, num_reqs_padded, *args, **kw):
        tables = original(self, idx_mapping, num_reqs_padded, *args, **kw)
        engine = armed.get("engine")
        if engine is None:
            return tables
        armed["calls"] += 1
        rows = {base._req_ids_by_index(engine)[int(x)]: b for b, x in enumerate(idx_mapping.tolist())}
        if armed["calls"] >= 6 and armed.get("once") and "reader" in rows and "owner" in rows:
            armed.pop("once")
            corrupt(engine, self, tables, rows, idx_mapping)
        return tables

    monkeypatch.setattr(BlockTables, "gather_block_tables", misgathered)
    setup = lambda e: armed.update(engine=e, once=True, calls=0)  # noqa: E731
    buggy = base.run_v2(rc, fill, guarded=False, setup=setup)
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == "reader", buggy.oracle_errors
    guarded = base.run_v2(rc, fill, guarded=True, setup=setup)
    step = base.check_contained(guarded, clean, "reader", {"foreign_page"})
    assert step == buggy.oracle_errors[0][0]
    assert guarded.guard.device is not None and len(on_device) == 1
    drained = on_device[0].drained
    assert {(r.request, r.op) for r in drained} == {("reader", "read")}, drained


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_on_a_gpu_where_the_device_check_cannot_start(mode, monkeypatch):
    """V2 on a GPU, but kvguard.DeviceGuard cannot start (here: the real one, on a machine with
    no CUDA driver): under enforce the engine stops at start-up, as its worker's KV cache is set
    up, with UnsupportedConfig naming why, never serving; under report it runs unchecked, with a
    warning."""
    from kvguard.vllm.hooks import UnsupportedConfig

    monkeypatch.setattr(runner_v2, "_on_device", lambda runner: True)
    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    fill = lambda e: base.workload(e, 3, 6, salts=2, max_prompt=60)  # noqa: E731
    if mode == "enforce":
        with pytest.raises(UnsupportedConfig, match="V2 model runner on a GPU, but kvguard's device check cannot start"):
            base.run_v2(rc, lambda e: pytest.fail("the engine started"), guarded=True, mode=mode)
        return
    g = base.run_v2(rc, fill, guarded=True, mode=mode)
    assert g.guard is None and len(g.finished) == 6


def test_on_a_gpu_over_several_ranks_the_device_check_does_not_start(monkeypatch, on_device):
    """V2 on a GPU over two ranks (tensor or pipeline parallel): only the output rank's
    ModelRunnerOutput reaches vLLM's scheduler, so a refusal another rank's device check made
    would never end its request. Under enforce the engine stops at start-up, naming it."""
    from kvguard.vllm.hooks import UnsupportedConfig

    real = runner_v2._v2_device

    def two_ranks(runner, guard):
        runner.vllm_config.parallel_config.world_size = 2
        return real(runner, guard)

    monkeypatch.setattr(runner_v2, "_v2_device", two_ranks)
    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    with pytest.raises(UnsupportedConfig, match="over 2 ranks"):
        base.run_v2(rc, lambda e: pytest.fail("the engine started"), guarded=True, mode="enforce")
    assert on_device == [], "no device check was made"
