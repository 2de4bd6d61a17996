"""kvguard on a hybrid model under vLLM's Model Runner V2: a full-attention KV cache group beside a
sliding-window one (as gpt-oss- and Gemma-class models have), one block pool for both, driven by
vLLM's own EngineCore on CPU (v2_engine.py says what is real).

The model is a tiny Llama whose second layer is a 48-token sliding window (``layer_types``,
``v2_engine.hybrid_model_dir``): vLLM builds that layer's ``Attention`` with its window, V2 builds
each group's attention backend from the real layers, and its ``BlockTables`` gets the window's
reach, so ``gather_block_tables`` nulls a window row's entries wholly before the window of the
step's first token (blocks vLLM's ``SlidingWindowManager`` may have freed). kvguard checks a
window row over that window only (``check_step_window``), what attention reads.
"""

from __future__ import annotations

import v2_engine  # noqa: I001  first: its settings must precede vLLM's import
from v2_engine import RealConfig, RealEngine

import test_v2_runner as base
from test_v2_runner import SCHEDULING, assert_clean, check_contained, outputs, run_v2, workload
from window_bugs import early_window_drop

WINDOW = 48
WINDOW_LAYER = "model.layers.1.self_attn.attn"


def hybrid(**kw) -> RealConfig:
    return RealConfig(sliding_window=WINDOW, block_size=32, **kw)


def assert_hybrid(g: RealEngine) -> None:
    """The run was a hybrid one on V2 as vLLM builds it: a real sliding-window layer, two groups,
    the guard judging the second as a window; windows dropped blocks the persistent rows still
    named, and V2's gather nulled them in what attention got."""
    layer = g.core.vllm_config.compilation_config.static_forward_context[WINDOW_LAYER]
    assert layer.sliding_window == WINDOW
    assert g.worker.windows == [None, WINDOW] and g.guard.windows == [None, WINDOW]
    assert g.worker.runner.block_tables.has_sliding_window_groups
    assert g.events.get("release_pages", 0) + g.events.get("detach", 0) > 0, g.events
    assert g.worker.window_rows_nulled > 0


def window_group(e: RealEngine) -> int:
    return e.worker.windows.index(WINDOW)


# -- clean work -------------------------------------------------------------------------------


CLEAN_ASYNC = dict(num_blocks=32, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512)


def clean_async_fill(e: RealEngine) -> None:
    workload(e, 5, 100)


def test_clean_v2_hybrid_async_prefix_caching_and_preemption():
    """100 requests over three tenants, shared prefixes, chunked prefill, prompts longer than the
    window, a pool that preempts and evicts, async scheduling: every window drops blocks (cached
    ones detached and still hit, the rest freed and handed out again) while V2's persistent rows
    still name them. Nothing refused, nothing counted, outputs as the unguarded V2 run's."""
    rc = hybrid(**CLEAN_ASYNC)
    g = run_v2(rc, clean_async_fill, guarded=True)
    p = run_v2(rc, clean_async_fill, guarded=False)
    assert_clean(g, p, 100)
    assert g.events.get("preempt", 0) > 0 and g.events.get("evict", 0) > 0
    assert g.events.get("attach", 0) > 0 and g.events.get("detach", 0) > 0
    assert_hybrid(g)


def test_clean_v2_hybrid_sync_without_prefix_caching():
    """Synchronous scheduling, no prefix caching (every dropped block is freed, not detached):
    nothing refused, outputs as the unguarded V2 run's."""
    rc = hybrid(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=False, prefix_caching=False)
    fill = lambda e: workload(e, 8, 40, salts=2, max_prompt=120)  # noqa: E731
    g = run_v2(rc, fill, guarded=True)
    p = run_v2(rc, fill, guarded=False)
    assert_clean(g, p, 40)
    assert g.events.get("release_pages", 0) > 0
    assert_hybrid(g)


# -- injected bugs ----------------------------------------------------------------------------


def stale_window_entry_case(async_scheduling: bool, monkeypatch) -> RealEngine:
    """V2's ``BlockTables.append_block_ids`` stages the victim's new full-attention entries but,
    once, only moves its sliding-window row's count: that row keeps what its slot's previous
    occupant left there, inside the window, which V2 gathers for attention and writes the
    victim's window through. kvguard refuses the victim on the step the oracle first sees it,
    alone. Returns the guarded engine."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    rc = hybrid(num_blocks=48, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
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
        rid = base._req_ids_by_index(engine).get(req_index) if engine is not None else None
        g = window_group(engine) if engine is not None else None
        if rid == victim and not overwrite and armed.get("once") and self.num_blocks.np[g, req_index] >= 1 and len(new_block_ids[g]):
            armed.pop("once")
            staged = [ids if k != g else [] for k, ids in enumerate(new_block_ids)]
            original(self, req_index, staged, overwrite)
            self.num_blocks.np[g, req_index] += len(new_block_ids[g])
            return
        original(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(BlockTables, "append_block_ids", stale_append)
    setup = lambda e: armed.update(engine=e, once=True)  # noqa: E731
    buggy = run_v2(rc, fill, guarded=False, setup=setup)
    assert "once" not in armed, "the bug fired"
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim, buggy.oracle_errors
    guarded = run_v2(rc, fill, guarded=True, setup=setup)
    assert "once" not in armed
    step = check_contained(guarded, clean, victim, {"freed_page", "foreign_page", "reserved_page", "write_to_shared"})
    assert step == buggy.oracle_errors[0][0]
    assert len(guarded.finished) == 4
    return guarded


@SCHEDULING
def test_injected_stale_entry_in_v2s_sliding_window_staged_table(async_scheduling, monkeypatch):
    stale_window_entry_case(async_scheduling, monkeypatch)


DROP = dict(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=384)
DROP_VICTIM = "long-decode"


def drop_fill(e: RealEngine) -> None:
    e.add(DROP_VICTIM, list(range(1, 41)), 100)
    workload(e, 5, 12, salts=2, max_prompt=90)


def dropped_block_case(async_scheduling: bool, monkeypatch) -> RealEngine:
    """The early-drop case run to its checks; returns the guarded engine."""
    rc = hybrid(async_scheduling=async_scheduling, **DROP)
    clean = run_v2(rc, drop_fill, guarded=False)
    armed = early_window_drop(monkeypatch, DROP_VICTIM, WINDOW)
    buggy = run_v2(rc, drop_fill, guarded=False)
    assert "fired" in armed and buggy.oracle_errors and buggy.oracle_errors[0][1] == DROP_VICTIM, buggy.oracle_errors
    armed.clear()
    armed["once"] = True
    guarded = run_v2(rc, drop_fill, guarded=True)
    assert "fired" in armed
    # What the victim's row names there by then: the freed block, another request's, or its own
    # block claimed again for the victim's next tokens (never written at those positions).
    kinds = {"freed_page", "foreign_page", "unwritten_slots", "write_to_shared", "unknown_prefix"}
    step = check_contained(guarded, clean, DROP_VICTIM, kinds)
    assert step <= buggy.oracle_errors[0][0]
    assert len(guarded.finished) == 13
    assert outputs(guarded)[DROP_VICTIM][1] == "error"
    return guarded


@SCHEDULING
def test_injected_block_dropped_from_the_window_while_v2s_gathered_row_names_it(async_scheduling, monkeypatch):
    """The sliding window drops a block its request still reads; vLLM frees it (and the small
    pool hands it out again) while V2's gathered row still names it. kvguard refuses the victim
    on the step its window lost the block, alone; every other request, the one the block went to
    included, is served as without the bug."""
    dropped_block_case(async_scheduling, monkeypatch)
