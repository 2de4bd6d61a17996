"""kvguard on vLLM's Model Runner V2 (vLLM 0.33's default runner where Triton runs), driven by
vLLM's own EngineCore on CPU: V2's own input preparation, block tables and slot mappings, only
the model, its sampling and one compiled attention op stood in (v2_engine.py says what is real).

Its own pytest process (scripts/ci/vllm.sh): V2's Triton kernels run under ``TRITON_INTERPRET=1``,
set before vLLM is imported. In Triton's interpreter a V2 step costs ~0.05-0.2 s, so the
workloads ask for few tokens.
"""

from __future__ import annotations

import v2_engine  # noqa: I001  first: its settings must precede vLLM's import
from v2_engine import RealConfig, RealEngine, v2_engine as make_engine

import random
from dataclasses import dataclass

import pytest

import kvguard.vllm

SCHEDULING = pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])

def workload(engine: RealEngine, seed: int, n: int, *, shared: int = 3, salts: int = 3, max_prompt: int = 150) -> None:
    """n requests over ``salts`` tenants, most sharing one of ``shared`` prefixes; most ask for a
    few tokens, one in six for 20 to 60 (those fill the pool and force preemptions). Short
    outputs keep the steps few: V2's kernels run in Triton's interpreter here."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(16, 70))] for _ in range(shared)]
    for i in range(n):
        head = prefixes[rng.randrange(shared)] if rng.random() < 0.6 else []
        prompt = head + [rng.randrange(500) for _ in range(rng.randrange(1, max_prompt))]
        max_tokens = rng.randrange(20, 60) if rng.random() < 1 / 6 else rng.randrange(1, 8)
        engine.add(f"req-{i}", prompt, max_tokens, cache_salt=f"tenant{rng.randrange(salts)}" if salts > 1 else None)


def run_v2(rc: RealConfig, fill, *, guarded: bool, setup=None, mode: str = "enforce") -> RealEngine:
    """One V2 engine run to the end, with kvguard's hooks installed (``guarded``) or not;
    ``setup(engine)`` runs once the engine is built, before any request."""
    kvguard.vllm.uninstall()
    if guarded:
        kvguard.vllm.install(mode)
    try:
        e = make_engine(rc)
        assert e.core.vllm_config.use_v2_model_runner, "vLLM's own choice: V2 where Triton runs"
        assert type(e.worker.runner).__module__ == "vllm.v1.worker.cpu.model_runner"
        if setup is not None:
            setup(e)
        fill(e)
        e.run()
        return e
    finally:
        kvguard.vllm.uninstall()


@dataclass(frozen=True)
class Reference:
    """What the clean tests read of an unguarded run."""

    idle: bool
    oracle_errors: list
    finished: dict


_references: dict[tuple, Reference] = {}


def reference(rc: RealConfig, seed: int, n: int, **kw: object) -> Reference:
    """The unguarded V2 run of ``workload(seed, n, **kw)`` on ``rc``, made once per process: the
    host's and the device path's clean tests compare against the same run (kvguard takes no part
    in it, so where the guarded run checks makes no difference to it)."""
    key = (repr(rc), seed, n, tuple(sorted(kw.items())))
    if key not in _references:
        p = run_v2(rc, lambda e: workload(e, seed, n, **kw), guarded=False)
        _references[key] = Reference(p.idle, list(p.oracle_errors), dict(p.finished))
    return _references[key]


def outputs(e: RealEngine | Reference) -> dict[str, tuple[list[int], str]]:
    return {k: (f.tokens, f.reason) for k, f in e.finished.items()}


def assert_clean(g: RealEngine, p: RealEngine | Reference, n: int) -> None:
    assert g.idle and p.idle
    assert g.refusals() == []
    assert g.guard is not None and g.guard.table.counters() == {}
    assert g.oracle_errors == [] and p.oracle_errors == []
    assert len(g.finished) == n
    assert outputs(g) == outputs(p)
    assert all(f.reason == "length" for f in g.finished.values())


# -- clean work -------------------------------------------------------------------------------


def test_clean_v2_async_prefix_caching_and_preemption():
    """Three hundred requests over three tenants through a pool small enough to preempt and
    evict (11 preemptions, about 800 evictions, 470 checked steps), async scheduling (vLLM's
    default), prefix caching: kvguard checks every step V2 hands attention, refuses nothing, and
    every output is the unguarded V2 run's."""
    rc = RealConfig(num_blocks=32, block_size=32, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512)
    g = run_v2(rc, lambda e: workload(e, 5, 300), guarded=True)
    p = reference(rc, 5, 300)
    assert g.events.get("preempt", 0) > 0, "the pool is meant to force preemptions"
    assert g.events.get("evict", 0) > 0 and g.events.get("attach", 0) > 0
    assert g.idle_steps > 0
    assert_clean(g, p, 300)
    assert g.guard.steps > 300


def test_clean_v2_sync():
    """Synchronous scheduling (EngineCore's ``step``), two tenants: nothing refused, outputs as
    the unguarded V2 run's."""
    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=False)
    g = run_v2(rc, lambda e: workload(e, 8, 60, salts=2, max_prompt=100), guarded=True)
    p = reference(rc, 8, 60, salts=2, max_prompt=100)
    assert_clean(g, p, 60)


# -- injected bugs in V2's own block tables ---------------------------------------------------


def check_contained(guarded: RealEngine, clean: RealEngine, victim: str, kinds: set[str]) -> int:
    """The victim alone was refused, once, with one of ``kinds``, and ended with an error the
    client sees (its own id, the kind and the stage); every other request's output is the clean
    run's. Returns the worker step of the refusal."""
    refusals = guarded.refusals()
    assert [rid for _, rid, _ in refusals] == [victim], refusals
    step, _, refusal = refusals[0]
    assert refusal.kind in kinds, refusal
    assert guarded.guard.refusals_total == 1, "a request is refused (and counted) once"
    fin = guarded.finished[victim]
    assert fin.reason == "error"
    assert fin.error == f"kvguard refused request {victim}: {refusal.kind} ({refusal.stage})", fin.error
    others = {k: v for k, v in outputs(guarded).items() if k != victim}
    assert others == {k: v for k, v in outputs(clean).items() if k != victim}
    assert all(v[1] == "length" for v in others.values())
    assert all(rid == victim for _, rid in guarded.oracle_errors), guarded.oracle_errors
    return step


def _req_ids_by_index(engine: RealEngine) -> dict[int, str]:
    return {i: r for r, i in engine.worker.runner.req_states.req_id_to_index.items()}


@SCHEDULING
def test_injected_stale_entry_in_v2_staged_block_table(async_scheduling, monkeypatch):
    """V2's BlockTables.append_block_ids moves a row's block count without staging the new
    entries, once: the victim's row in V2's persistent table keeps what its slot's previous
    occupant left there (V2 reuses request slots), which gather_block_tables hands attention and
    compute_slot_mappings writes through. kvguard refuses the victim on that step, alone."""
    stale_entry_case(async_scheduling, monkeypatch)


def stale_entry_case(async_scheduling: bool, monkeypatch) -> RealEngine:
    """The stale-entry case run to its checks; returns the guarded engine."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    rc = RealConfig(num_blocks=48, block_size=32, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
    victim = "short-b"

    def fill(e: RealEngine) -> None:
        e.add("long-a", list(range(1, 130)), 4)
        e.add("c", list(range(200, 240)), 60)
        e.add(victim, list(range(300, 310)), 60)
        e.add("d", list(range(400, 450)), 30)

    clean = run_v2(rc, fill, guarded=False)
    original = BlockTables.append_block_ids
    armed: dict = {}

    def stale_append(self, req_index, new_block_ids, overwrite):
        engine = armed.get("engine")
        rid = _req_ids_by_index(engine).get(req_index) if engine is not None else None
        if rid == victim and not overwrite and self.num_blocks.np[0, req_index] >= 1 and armed.pop("once", None):
            for g in range(self.num_kv_cache_groups):
                self.num_blocks.np[g, req_index] += len(new_block_ids[g])
            return
        original(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(BlockTables, "append_block_ids", stale_append)
    setup = lambda e: armed.update(engine=e, once=True)  # noqa: E731
    buggy = run_v2(rc, fill, guarded=False, setup=setup)
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim, buggy.oracle_errors
    guarded = run_v2(rc, fill, guarded=True, setup=setup)
    step = check_contained(guarded, clean, victim, {"freed_page", "foreign_page", "reserved_page", "write_to_shared"})
    assert step == buggy.oracle_errors[0][0]
    return guarded


@SCHEDULING
def test_injected_slot_mapping_into_another_requests_block(async_scheduling, monkeypatch):
    """V2's compute_slot_mappings sends one token of the writer into the first slot of another
    request's block, once, mid-decode: unguarded, the reader reads the writer's token there from
    that step on. kvguard refuses the writer's write (its slots go to vLLM's padding slot, so
    nothing reaches the reader's KV): the writer alone is refused, the reader is served as
    without the bug."""
    misdirected_slot_case(async_scheduling, monkeypatch)


def misdirected_slot_case(async_scheduling: bool, monkeypatch) -> RealEngine:
    """The misdirected-slot case run to its checks; returns the guarded engine."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    rc = RealConfig(num_blocks=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
    writer, reader = "writer", "reader"

    def fill(e: RealEngine) -> None:
        e.add(reader, list(range(1, 50)), 30)
        e.add(writer, list(range(100, 120)), 30)
        e.add("bystander", list(range(300, 340)), 30)

    clean = run_v2(rc, fill, guarded=False)
    original = BlockTables.compute_slot_mappings
    armed: dict = {}

    def misdirected(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        slots = original(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out)
        engine = armed.get("engine")
        if engine is None:
            return slots
        armed["calls"] += 1
        rows = {_req_ids_by_index(engine)[int(x)]: b for b, x in enumerate(idx_mapping.tolist())}
        if armed["calls"] >= 6 and armed.get("once") and writer in rows and reader in rows:
            armed.pop("once")
            first_block = int(self.block_tables[0].gpu[int(idx_mapping[rows[reader]]), 0])
            start = int(query_start_loc[rows[writer]])
            slots[0, start] = first_block * self.block_sizes[0]
        return slots

    monkeypatch.setattr(BlockTables, "compute_slot_mappings", misdirected)
    setup = lambda e: armed.update(engine=e, once=True, calls=0)  # noqa: E731
    buggy = run_v2(rc, fill, guarded=False, setup=setup)
    assert buggy.oracle_errors and (buggy.oracle_errors[0][0], reader) in buggy.oracle_errors, buggy.oracle_errors
    assert outputs(buggy)[reader] != outputs(clean)[reader]
    guarded = run_v2(rc, fill, guarded=True, setup=setup)
    step = check_contained(guarded, clean, writer, {"foreign_page", "write_to_shared"})
    assert step == buggy.oracle_errors[0][0]
    return guarded
