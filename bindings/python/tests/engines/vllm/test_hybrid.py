"""kvguard on a hybrid model in vLLM's own engine: a full-attention KV cache group beside a
sliding-window one (as gpt-oss- and Gemma-class models have), one block pool for both.

What is real is what real_engine.py says: EngineCore's step loop, the (async) scheduler, the
hybrid KV cache coordinator with vLLM's ``FullAttentionManager`` and ``SlidingWindowManager``
(its ``remove_skipped_blocks`` drops the blocks that left the window: the null block in their
place, freed to the pool), the V1 model runner's ``MultiGroupBlockTable`` (one block table per
group; the worker is never told of the dropped blocks, so its sliding-window rows keep naming
them before the window). The stand-in forward writes each group through its slot mapping and
reads a sliding-window row only over the window attention reads.
"""

from __future__ import annotations

import pytest
from conftest import workload
from real_engine import RealConfig, RealEngine
from test_real_engine import SCHEDULING, assert_clean, check_contained, outputs, run_real
from window_bugs import early_window_drop

WINDOW = 48


def hybrid(**kw) -> RealConfig:
    return RealConfig(sliding_window=WINDOW, **kw)


def window_group(e: RealEngine) -> int:
    (g,) = [g for g, w in enumerate(e.worker.windows) if w is not None]
    return g


def stale_entries_read(e: RealEngine) -> None:
    """The run dropped blocks from sliding windows while the worker's rows still named them
    (what makes reading those rows in full wrong)."""
    assert e.events.get("release_pages", 0) + e.events.get("detach", 0) > 0, e.events


# -- clean work -------------------------------------------------------------------------------


@SCHEDULING
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_clean_hybrid_shared_prefixes_chunked_prefill(async_scheduling, prefix_caching):
    """120 requests over two tenants, shared prefixes, chunked prefill, prompts and outputs
    longer than the window: every sliding window drops blocks (partial releases: cached ones
    detached and still hit by others, the rest freed and handed out again) and no read of the
    window group goes before its window. No refusal, no violation counted, outputs as vLLM
    alone."""
    rc = hybrid(
        num_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    fill = lambda e: workload(e, 3, 120, salts=2, max_prompt=120)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert len(g.worker.kv) == 2 and g.guard.windows.count(WINDOW) == 1
    assert_clean(g, p, 120)
    stale_entries_read(g)
    if prefix_caching:
        assert g.events.get("attach", 0) > 0 and g.events.get("detach", 0) > 0
    else:
        assert g.events.get("release_pages", 0) > 0


@SCHEDULING
def test_clean_hybrid_preemption_and_eviction_in_a_small_pool(async_scheduling):
    rc = hybrid(num_blocks=48, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=384, async_scheduling=async_scheduling)
    fill = lambda e: workload(e, 7, 120, salts=3, max_prompt=120)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert g.events.get("preempt", 0) > 0, "the pool is meant to force preemptions"
    assert g.events.get("evict", 0) > 0, "cached blocks are meant to be reused"
    assert_clean(g, p, 120)
    stale_entries_read(g)


def test_clean_hybrid_a_thousand_requests_four_tenants_async():
    rc = hybrid(num_blocks=256, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024)
    fill = lambda e: workload(e, 1000, 1000, shared=6, salts=4, max_prompt=150)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert_clean(g, p, 1000)
    stale_entries_read(g)
    assert g.events.get("attach", 0) > 100


# -- injected bugs on a hybrid model ----------------------------------------------------------


@SCHEDULING
@pytest.mark.parametrize("at", [3, 30])
def test_injected_stale_row_tail_in_the_sliding_window_group(async_scheduling, at, monkeypatch):
    """The at-th append to a sliding-window row that already had blocks moves the row's count
    without writing its entries (the full-attention row is right): the request writes its window
    through whatever the row held there. Its request alone is refused, on the step the oracle
    first sees it; every other request is served as without the bug."""
    from vllm.v1.worker.block_table import BlockTable

    rc = hybrid(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=async_scheduling)
    fill = lambda e: workload(e, 9, 60, salts=2, max_prompt=100)  # noqa: E731
    clean = run_real(rc, fill, guarded=False)
    original = BlockTable.append_row
    armed: dict = {"at": at, "n": 0}

    def stale_append_row(self, block_ids, row_idx):
        if self is armed.get("table") and self.num_blocks_per_row[row_idx] >= 1:
            armed["n"] += 1
            if armed["n"] == armed["at"]:
                armed["victim"] = armed["batch"].req_ids[row_idx]
                self.num_blocks_per_row[row_idx] += len(block_ids)
                return
        original(self, block_ids, row_idx)

    def arm(worker, so):
        armed["batch"] = worker.runner.input_batch
        armed["table"] = worker.runner.input_batch.block_table.block_tables[worker.windows.index(WINDOW)]

    monkeypatch.setattr(BlockTable, "append_row", stale_append_row)
    armed_buggy = dict(armed)
    buggy = run_real(rc, fill, guarded=False, before_prepare=arm)
    victim = armed["victim"]
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim
    armed.clear()
    armed.update(armed_buggy)
    guarded = run_real(rc, fill, guarded=True, before_prepare=arm)
    assert armed["victim"] == victim
    step = check_contained(guarded, clean, victim, {"reserved_page", "foreign_page", "freed_page", "write_to_shared"})
    assert step == buggy.oracle_errors[0][0]
    assert len(guarded.finished) == 60


@SCHEDULING
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_injected_block_dropped_from_the_window_while_still_read(async_scheduling, prefix_caching, monkeypatch):
    """The sliding window drops a block its request still reads; vLLM frees it, and a pool this
    small hands it to another request while the victim's row still names it. kvguard refuses the
    victim on the step its window lost the block (it reads a block it no longer holds), and the
    request that got the block, innocent, is served, as is every other."""
    rc = hybrid(
        num_blocks=40,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        max_model_len=384,
        prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    victim = "long-decode"

    def fill(e: RealEngine) -> None:
        e.add(victim, list(range(1, 41)), 80)
        workload(e, 5, 40, salts=2, max_prompt=90)

    clean = run_real(rc, fill, guarded=False)
    armed = early_window_drop(monkeypatch, victim, WINDOW)
    buggy = run_real(rc, fill, guarded=False)
    assert "fired" in armed and buggy.oracle_errors and buggy.oracle_errors[0][1] == victim
    armed.clear()
    armed["once"] = True
    guarded = run_real(rc, fill, guarded=True)
    # What the victim's row names there by then: the freed block, another request's, or its own
    # block claimed again for the victim's next tokens (never written at those positions).
    kinds = {"freed_page", "foreign_page", "unwritten_slots", "write_to_shared", "unknown_prefix"}
    step = check_contained(guarded, clean, victim, kinds)
    assert step <= buggy.oracle_errors[0][0]
    assert len(guarded.finished) == 41
