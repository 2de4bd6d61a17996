"""Each bug class of the vLLM advisories, injected into vLLM's real objects by a monkeypatch:
caught on the step it happens, with the right kind, on the right request; under enforce only
that request is aborted (finish reason ``error``, kvguard's message) and every other request's
output is what the bug-free engine produces.

Each test also runs the buggy engine without kvguard, where the stand-in attention's oracle
shows the bug is real (a request reads KV that is not its own, or never written).
"""

from __future__ import annotations

import re

import pytest
from conftest import run_unguarded
from engine import Engine, EngineConfig

import kvguard.vllm


def outputs(e: Engine) -> dict[str, list[int]]:
    return {k: f.tokens for k, f in e.finished.items()}


def check_contained(guarded: Engine, clean: Engine, victim: str, kinds: set[str]) -> int:
    """The victim alone was refused, once, with one of ``kinds``; it ended with an error the
    client sees; the others match the clean run. Returns the refusal step."""
    refusals = [(step, rid, r) for step, rep in guarded.reports for rid, r in rep.refused.items()]
    assert [rid for _, rid, _ in refusals] == [victim], refusals
    step, _, refusal = refusals[0]
    assert refusal.kind in kinds, refusal
    fin = guarded.finished[victim]
    assert fin.reason == "error" and fin.error is not None and refusal.kind in fin.error
    # The client learns its own request id, the kind and the stage: no other request, tenant
    # (cache_salt) or page, which go to the operator's log only.
    assert fin.error == f"kvguard refused request {victim}: {refusal.kind} ({refusal.stage})", fin.error
    assert not any(other in fin.error for other in guarded.finished if other != victim)
    assert "salt=" not in fin.error and not re.search(r"page \d", fin.error)
    others = {k: v for k, v in outputs(guarded).items() if k != victim}
    assert others == {k: v for k, v in outputs(clean).items() if k != victim}
    # The stand-in attention read nothing wrong except the refused row (nulled) at that step.
    assert all(rid == victim for _, rid in guarded.oracle_errors)
    return step


def test_stale_row_tail(enforce, monkeypatch):
    """A row keeps a stale tail: clearing a row on removal only resets its count (the entries
    stay, as before vLLM zeroed them), and one append moves num_blocks_per_row without writing
    the entry, so the row's used part ends with the previous occupant's block, which is free or
    belongs to another request by then."""
    from vllm.v1.worker.block_table import BlockTable

    cfg = EngineConfig(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512)
    victim = "short-b"

    def fill(e: Engine) -> None:
        e.add("long-a", list(range(1, 100)), 4)  # 7 blocks in row 0, then finishes
        e.add("c", list(range(200, 240)), 60)
        e.add(victim, list(range(300, 310)), 40)  # reuses row 0; grows into block 2 at step ~8

    clean = run_unguarded(cfg, fill)
    original = BlockTable.append_row
    armed: dict[str, Engine] = {}

    def stale_append_row(self, block_ids, row_idx):
        e = armed.get("engine")
        rid = e.input_batch.req_ids[row_idx] if e is not None and row_idx < e.input_batch.num_reqs else None
        if rid == victim and self.num_blocks_per_row[row_idx] >= 1 and armed.pop("once", None):
            self.num_blocks_per_row[row_idx] += len(block_ids)  # the bug: the entries stay stale
            return
        original(self, block_ids, row_idx)

    def stale_clear_row(self, row_idx):
        self.num_blocks_per_row[row_idx] = 0  # the bug: the entries are left as they were

    monkeypatch.setattr(BlockTable, "append_row", stale_append_row)
    monkeypatch.setattr(BlockTable, "clear_row", stale_clear_row)
    armed.update(once=True)
    buggy = Engine(cfg, guarded=False)
    armed["engine"] = buggy
    kvguard.vllm.uninstall()
    fill(buggy)
    buggy.run()
    kvguard.vllm.install("enforce")
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim

    armed.update(once=True)
    guarded = Engine(cfg, guarded=True)
    armed["engine"] = guarded
    fill(guarded)
    guarded.run()
    step = check_contained(guarded, clean, victim, {"freed_page", "foreign_page", "write_to_shared"})
    assert step == buggy.oracle_errors[0][0]


def test_block_freed_while_still_read_then_reallocated(enforce, monkeypatch):
    """A reference-count race (the single_type_kv_cache_manager class): when the first of two
    requests sharing cached prefix blocks finishes, the shared blocks lose one reference too
    many and go back to the free queue while the second still reads them; the next allocation
    hands them to a third request. kvguard refuses that allocation (the blocks are held), so
    the third request is aborted before it writes, and the reader keeps intact KV."""
    from vllm.v1.core.block_pool import BlockPool

    cfg = EngineConfig(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512)
    prefix = list(range(1, 65))  # 4 full blocks
    taker = "taker-c"

    def fill(e: Engine) -> None:
        e.add("first-a", prefix + [70], 2)
        e.add("reader-b", prefix + [71], 14)  # stays inside its fifth block: no allocation after

    def add_taker(e: Engine) -> None:
        e.add(taker, list(range(100, 420)), 4)  # 20 blocks: takes the freed cached ones too

    def drive(e: Engine) -> None:
        fill(e)
        for _ in range(6):
            e.step()
        add_taker(e)
        e.run(max_steps=60)

    kvguard.vllm.uninstall()
    clean = Engine(cfg, guarded=False)
    drive(clean)
    kvguard.vllm.install("enforce")

    original = BlockPool.free_blocks
    armed = {"once": True}

    def racy_free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        if armed.get("once") and any(b.ref_cnt > 1 for b in blocks):
            armed.clear()
            for b in blocks:
                if b.ref_cnt > 1:
                    b.ref_cnt -= 1  # the race: one reference lost
        original(self, blocks)

    monkeypatch.setattr(BlockPool, "free_blocks", racy_free_blocks)
    kvguard.vllm.uninstall()
    buggy = Engine(cfg, guarded=False)
    drive(buggy)
    kvguard.vllm.install("enforce")
    assert any(rid == "reader-b" for _, rid in buggy.oracle_errors), "the reader reads the taker's KV"

    armed["once"] = True
    guarded = Engine(cfg, guarded=True)
    drive(guarded)
    step = check_contained(guarded, clean, taker, {"evict_in_use", "page_not_free"})
    assert step <= min(s for s, rid in buggy.oracle_errors if rid == "reader-b")
    assert outputs(guarded)["reader-b"] == outputs(clean)["reader-b"]


def test_computed_tokens_past_what_was_written(enforce, monkeypatch):
    """A race advances a prefilling request's computed-token count past the tokens its chunk
    wrote (the FA2 class: attention then reads slots nobody wrote)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    victim = "long-prompt"

    def fill(e: Engine) -> None:
        e.add("other", list(range(1, 20)), 20)
        e.add(victim, list(range(100, 190)), 5)

    clean = run_unguarded(cfg, fill)
    original = Scheduler._update_after_schedule
    armed = {"once": True}

    def racy_update_after_schedule(self, scheduler_output):
        original(self, scheduler_output)
        req = self.requests.get(victim)
        if armed.get("once") and req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens - 8:
            armed.clear()
            req.num_computed_tokens += 3  # the race: three tokens counted, never written

    monkeypatch.setattr(Scheduler, "_update_after_schedule", racy_update_after_schedule)
    kvguard.vllm.uninstall()
    buggy = Engine(cfg, guarded=False)
    fill(buggy)
    buggy.run()
    kvguard.vllm.install("enforce")
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim

    armed["once"] = True
    guarded = Engine(cfg, guarded=True)
    fill(guarded)
    guarded.run()
    step = check_contained(guarded, clean, victim, {"unwritten_slots"})
    assert step == buggy.oracle_errors[0][0]


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_cross_tenant_cached_block(mode, monkeypatch):
    """The block hasher forgets cache_salt, so a second tenant's identical prompt hits the
    first tenant's cached blocks: refused at the hit (cross_tenant_share), not only by hash."""
    import vllm.v1.core.kv_cache_utils as kcu

    kvguard.vllm.install(mode)
    try:
        cfg = EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
        prompt = list(range(1, 70))
        victim = "bob-1"

        def fill(e: Engine) -> None:
            e.add("alice-1", prompt, 30, cache_salt="alice")
            e.step()
            e.step()
            e.add(victim, prompt, 10, cache_salt="bob")
            e.add("bob-2", list(range(400, 430)), 10, cache_salt="bob")

        clean = run_unguarded(cfg, fill)
        original = kcu.generate_block_hash_extra_keys

        def saltless(request, *args, **kwargs):
            salt, request.cache_salt = request.cache_salt, None
            try:
                return original(request, *args, **kwargs)
            finally:
                request.cache_salt = salt

        monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", saltless)
        guarded = Engine(cfg, guarded=True)
        fill(guarded)
        guarded.run()
        assert guarded.events.get("ATTACH", 0) > 0, "the hash bug makes bob hit alice's blocks"
        if mode == "enforce":
            check_contained(guarded, clean, victim, {"cross_tenant_share"})
        else:
            first = guarded.reports[0][1].refused
            assert list(first) == [victim] and first[victim].kind == "cross_tenant_share"
            assert all(f.reason == "length" for f in guarded.finished.values())
            assert guarded._kvguard.table.counters().get("cross_tenant_share", 0) >= 1
    finally:
        kvguard.vllm.uninstall()
