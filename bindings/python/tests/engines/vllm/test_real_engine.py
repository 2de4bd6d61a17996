"""kvguard on vLLM's own engine: EngineCore's step loop, its (async) scheduler and the V1 model
runner's own input preparation, only the model stood in (real_engine.py says what is real).

Async scheduling (vLLM's default on GPUs: ``step_with_batch_queue``, a step's output processed
after the next step is scheduled and run) is the default here; each case runs synchronous
scheduling too.
"""

from __future__ import annotations

import re

import pytest
from conftest import workload
from real_engine import RealConfig, RealEngine

import kvguard.vllm

SCHEDULING = pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])


def run_real(rc: RealConfig, fill, *, guarded: bool, before_prepare=None, mode: str = "enforce") -> RealEngine:
    """One engine run to the end, with kvguard's hooks installed (``guarded``) or not."""
    kvguard.vllm.uninstall()
    if guarded:
        kvguard.vllm.install(mode)
    try:
        e = RealEngine(rc, before_prepare=before_prepare)
        fill(e)
        e.run()
        return e
    finally:
        kvguard.vllm.uninstall()


def outputs(e: RealEngine) -> dict[str, tuple[list[int], str]]:
    return {k: (f.tokens, f.reason) for k, f in e.finished.items()}


def assert_clean(g: RealEngine, p: RealEngine, n: int) -> None:
    assert g.idle and p.idle
    assert g.refusals() == []
    assert g.guard is not None and g.guard.table.counters() == {}
    assert g.oracle_errors == [] and p.oracle_errors == []
    assert len(g.finished) == n
    assert outputs(g) == outputs(p)
    assert all(f.reason == "length" for f in g.finished.values())


# -- clean work -------------------------------------------------------------------------------


@SCHEDULING
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("salts", [1, 3], ids=["one-tenant", "three-tenants"])
def test_clean_shared_prefixes_chunked_prefill(async_scheduling, prefix_caching, salts):
    rc = RealConfig(
        num_blocks=160,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    fill = lambda e: workload(e, 11, 120, salts=salts)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert_clean(g, p, 120)
    if prefix_caching:
        assert g.events.get("attach", 0) > 0 and g.events.get("publish", 0) > 0
    assert g.idle_steps > 0, "vLLM sends a step with no tokens when the last request finishes"


@SCHEDULING
def test_clean_preemption_and_eviction_in_a_small_pool(async_scheduling):
    rc = RealConfig(
        num_blocks=40, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512, async_scheduling=async_scheduling
    )
    fill = lambda e: workload(e, 7, 120, salts=3, max_prompt=120)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert g.events.get("preempt", 0) > 0, "the pool is meant to force preemptions"
    assert g.events.get("evict", 0) > 0, "cached blocks are meant to be reused"
    assert_clean(g, p, 120)


def test_clean_a_thousand_requests_async():
    rc = RealConfig(num_blocks=512, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    fill = lambda e: workload(e, 1000, 1000, shared=8, salts=4)  # noqa: E731
    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert_clean(g, p, 1000)
    assert g.events.get("attach", 0) > 100
    # The worker check reads vLLM's block table in place through the core's incremental rows:
    # most rows, unchanged since the step before, are judged from their last page.
    incremental, full = g.guard.table.worker_row_counts()
    assert incremental > full > 0, (incremental, full)


# -- the cases issue 34 found, each its own minimal run ---------------------------------------


@SCHEDULING
def test_a_tenant_whose_last_request_ended_keeps_its_cached_blocks(async_scheduling):
    """Issue 34 item 7: a tenant's next request hits the blocks its finished request published,
    after the tenant had no live request (the table used to forget the tenant's name then and
    refuse the hit as cross_tenant_share)."""
    rc = RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512, async_scheduling=async_scheduling)
    prompt = list(range(1, 70))

    def fill(e: RealEngine) -> None:
        e.add("a-1", prompt, 3, cache_salt="acme")
        e.run()
        e.add("a-2", prompt + [7, 8], 3, cache_salt="acme")

    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert g.events.get("attach", 0) >= 4, "a-2 hits a-1's four full blocks"
    assert_clean(g, p, 2)


def test_tenants_without_requests_or_cached_blocks_are_forgotten():
    """300 tenants one after another through a pool that keeps only the last ones' blocks: the
    recorder forgets the tenants whose blocks were evicted (memory stays flat over tenants),
    keeps those whose blocks are cached (their next request's hit is theirs), and both kinds of
    returning tenant are served as vLLM alone serves them."""
    rc = RealConfig(num_blocks=96, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)

    def prompt(i: int) -> list[int]:
        return [(i * 7 + k) % 480 + 1 for k in range(40)]

    def fill(e: RealEngine) -> None:
        for i in range(300):
            e.add(f"t{i}-a", prompt(i), 2, cache_salt=f"t{i}")
        e.run()
        e.add("t0-b", prompt(0) + [3], 2, cache_salt="t0")
        e.add("t299-b", prompt(299) + [3], 2, cache_salt="t299")

    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert_clean(g, p, 302)
    rec = g.scheduler.kv_cache_manager._kvguard_recorder
    assert len(rec._tenant_keys) < 150, "tenants without requests or cached blocks are forgotten"
    assert g.scheduler_hits["t299-b"] == 32 and g.scheduler_hits["t0-b"] == 0


@SCHEDULING
def test_the_idle_step_releases_reach_the_table(async_scheduling):
    """Issue 34 item 8: when the last request finishes, vLLM's next step schedules nothing and
    only tells the worker what finished (the runner returns before _prepare_inputs); those
    releases must reach the table, or the next request given those pages is refused."""
    rc = RealConfig(num_blocks=16, max_num_seqs=4, max_model_len=224, prefix_caching=False, async_scheduling=async_scheduling)

    def fill(e: RealEngine) -> None:
        e.add("first", list(range(1, 150)), 4)  # 10 of the 15 usable blocks
        e.run()
        e.add("second", list(range(200, 350)), 4)  # needs blocks the first one freed

    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert g.idle_steps >= 1
    assert_clean(g, p, 2)
    assert g.guard.table.snapshot().owned == 0


def test_a_block_cached_as_its_request_finishes_stays_published():
    """Issue 34 item 6: under async scheduling update_from_output hashes a finishing request's
    last full block and frees the request in the same call; the block stays in vLLM's cache,
    so it must stay published (a later hit on it used to be refused, unknown_prefix)."""
    rc = RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512)
    prompt = list(range(1, 31))  # 30 tokens: the 2nd block fills with the 1st and 2nd output

    probe = run_real(rc, lambda e: e.add("probe", prompt, 3), guarded=False)
    t1, t2, _ = probe.finished["probe"].tokens

    def fill(e: RealEngine) -> None:
        e.add("first", prompt, 3)
        e.run()
        e.add("second", prompt + [t1, t2, 9, 9, 9], 3)

    g = run_real(rc, fill, guarded=True)
    p = run_real(rc, fill, guarded=False)
    assert g.scheduler_hits.get("second", 0) == 32, "second hits both of first's blocks"
    assert_clean(g, p, 2)


# -- injected bugs on the real engine ---------------------------------------------------------


def check_contained(guarded: RealEngine, clean: RealEngine, victim: str, kinds: set[str]) -> int:
    """The victim alone was refused, once, with one of ``kinds``; it ended with an error the
    client sees (its own id, the kind and the stage only); every other request's output is the
    clean run's. Returns the worker step of the refusal."""
    refusals = guarded.refusals()
    assert [rid for _, rid, _ in refusals] == [victim], refusals
    step, _, refusal = refusals[0]
    assert refusal.kind in kinds, refusal
    assert guarded.guard.refusals_total == 1, "a request is refused (and counted) once"
    fin = guarded.finished[victim]
    assert fin.reason == "error"
    assert fin.error == f"kvguard refused request {victim}: {refusal.kind} ({refusal.stage})", fin.error
    assert "salt=" not in fin.error and not re.search(r"page \d", fin.error)
    others = {k: v for k, v in outputs(guarded).items() if k != victim}
    assert others == {k: v for k, v in outputs(clean).items() if k != victim}
    assert all(v[1] == "length" for v in others.values())
    assert all(rid == victim for _, rid in guarded.oracle_errors)
    return step


@SCHEDULING
@pytest.mark.parametrize("then", ["alone", "more-work"])
def test_injected_stale_row_tail(async_scheduling, then, monkeypatch):
    """A row keeps a stale tail (clear_row leaves the entries, one append moves the count without
    writing them): the victim's row ends with whatever the row held there, its predecessor's
    block (freed by then) or the null block vLLM's condense leaves in a vacated row."""
    from vllm.v1.worker.block_table import BlockTable

    rc = RealConfig(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
    victim = "short-b"

    def fill(e: RealEngine) -> None:
        e.add("long-a", list(range(1, 100)), 4)
        e.add("c", list(range(200, 240)), 60)
        e.add(victim, list(range(300, 310)), 40)
        if then == "more-work":
            e.run()
            _more_work(e, list(range(300, 310)) + list(range(1, 40)))

    clean = run_real(rc, fill, guarded=False)
    original = BlockTable.append_row
    armed: dict = {}

    def stale_append_row(self, block_ids, row_idx):
        batch = armed.get("batch")
        rid = batch.req_ids[row_idx] if batch is not None and row_idx < batch.num_reqs else None
        if rid == victim and self.num_blocks_per_row[row_idx] >= 1 and armed.pop("once", None):
            self.num_blocks_per_row[row_idx] += len(block_ids)
            return
        original(self, block_ids, row_idx)

    def stale_clear_row(self, row_idx):
        self.num_blocks_per_row[row_idx] = 0

    def arm(worker, so):
        armed["batch"] = worker.runner.input_batch

    monkeypatch.setattr(BlockTable, "append_row", stale_append_row)
    monkeypatch.setattr(BlockTable, "clear_row", stale_clear_row)
    armed["once"] = True
    buggy = run_real(rc, fill, guarded=False, before_prepare=arm)
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim
    armed.clear()
    armed["once"] = True
    guarded = run_real(rc, fill, guarded=True, before_prepare=arm)
    step = check_contained(guarded, clean, victim, {"freed_page", "foreign_page", "write_to_shared", "reserved_page"})
    assert step == buggy.oracle_errors[0][0]


@SCHEDULING
@pytest.mark.parametrize("device_rows", [False, True], ids=["host-rows", "device-rows"])
def test_injected_block_freed_while_still_read_then_reallocated(async_scheduling, device_rows, monkeypatch):
    """A reference-count race: shared cached blocks lose one reference too many when the first
    of two readers finishes, and the next allocation hands them to a third request while the
    second still reads them. kvguard refuses that allocation. With the rows' device copy apart
    (a GPU's), the refused rows nulled after vLLM committed them reach the copy attention and
    the slot mapping read, before the taker writes into the reader's blocks."""
    from vllm.v1.core.block_pool import BlockPool

    rc = RealConfig(
        num_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=352,
        async_scheduling=async_scheduling,
        device_rows=device_rows,
    )
    prefix = list(range(1, 65))
    taker = "taker-c"

    def fill(e: RealEngine) -> None:
        e.add("first-a", prefix + [70], 2)
        e.add("reader-b", prefix + [71], 14)
        for _ in range(6):
            e.step()
        e.add(taker, list(range(100, 420)), 4)

    clean = run_real(rc, fill, guarded=False)
    original = BlockPool.free_blocks
    armed = {"once": True}

    def racy_free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        if armed.get("once") and any(b.ref_cnt > 1 for b in blocks):
            armed.clear()
            for b in blocks:
                if b.ref_cnt > 1:
                    b.ref_cnt -= 1
        original(self, blocks)

    monkeypatch.setattr(BlockPool, "free_blocks", racy_free_blocks)
    buggy = run_real(rc, fill, guarded=False)
    assert any(rid == "reader-b" for _, rid in buggy.oracle_errors), "the reader reads the taker's KV"
    armed["once"] = True
    guarded = run_real(rc, fill, guarded=True)
    step = check_contained(guarded, clean, taker, {"evict_in_use", "page_not_free"})
    assert step <= min(s for s, rid in buggy.oracle_errors if rid == "reader-b")


def computed_token_race(monkeypatch, victim: str) -> dict:
    """Makes vLLM's scheduler advance `victim`'s computed-token count 3 past what its prefill
    chunk wrote, once, mid-prompt. Returns the trigger: set ``armed["once"] = True`` to fire it
    again in the next run."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_after_schedule
    armed = {"once": True}

    def racy(self, scheduler_output):
        original(self, scheduler_output)
        req = self.requests.get(victim)
        if armed.get("once") and req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens - 8:
            armed.clear()
            req.num_computed_tokens += 3

    monkeypatch.setattr(Scheduler, "_update_after_schedule", racy)
    return armed


@SCHEDULING
def test_injected_computed_tokens_past_what_was_written(async_scheduling, monkeypatch):
    """A race advances a prefilling request's computed-token count past what its chunk wrote."""
    rc = RealConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, async_scheduling=async_scheduling)
    victim = "long-prompt"

    def fill(e: RealEngine) -> None:
        e.add("other", list(range(1, 20)), 20)
        e.add(victim, list(range(100, 190)), 5)

    clean = run_real(rc, fill, guarded=False)
    armed = computed_token_race(monkeypatch, victim)
    buggy = run_real(rc, fill, guarded=False)
    assert buggy.oracle_errors and buggy.oracle_errors[0][1] == victim
    armed["once"] = True
    guarded = run_real(rc, fill, guarded=True)
    step = check_contained(guarded, clean, victim, {"unwritten_slots"})
    assert step == buggy.oracle_errors[0][0]


@SCHEDULING
@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_injected_cross_tenant_cached_block(async_scheduling, mode, monkeypatch):
    """The block hasher forgets cache_salt: a second tenant's identical prompt hits the first
    tenant's cached blocks; refused at the hit (cross_tenant_share). Under report the refusal is
    logged and counted and every request is served as vLLM serves it."""
    import vllm.v1.core.kv_cache_utils as kcu

    rc = RealConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
    prompt = list(range(1, 70))
    victim = "bob-1"

    def fill(e: RealEngine) -> None:
        e.add("alice-1", prompt, 30, cache_salt="alice")
        e.step()
        e.step()
        e.add(victim, prompt, 10, cache_salt="bob")
        e.add("bob-2", list(range(400, 430)), 10, cache_salt="bob")

    clean = run_real(rc, fill, guarded=False)
    original = kcu.generate_block_hash_extra_keys

    def saltless(request, *args, **kwargs):
        salt, request.cache_salt = request.cache_salt, None
        try:
            return original(request, *args, **kwargs)
        finally:
            request.cache_salt = salt

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", saltless)
    guarded = run_real(rc, fill, guarded=True, mode=mode)
    assert guarded.events.get("attach", 0) > 0
    if mode == "enforce":
        check_contained(guarded, clean, victim, {"cross_tenant_share"})
        return
    buggy = run_real(rc, fill, guarded=False)
    first = guarded.refusals()[0]
    assert first[1] == victim and first[2].kind == "cross_tenant_share"
    assert outputs(guarded) == outputs(buggy) and all(f.reason == "length" for f in guarded.finished.values())
    assert guarded.guard.table.counters().get("cross_tenant_share", 0) >= 1


# -- after a refusal: only the offender pays (issue 34 items 1 and 2) -------------------------


def _more_work(e: RealEngine, prefix: list[int], n: int = 30) -> None:
    """Bystanders after a refusal: requests of the same tenant, half of them with ``prefix``
    (vLLM would serve them the refused request's cached blocks), all through a small pool (so
    the blocks the refusal left behind are evicted and handed out again)."""
    for i in range(n):
        head = prefix if i % 2 == 0 else []
        e.add(f"after-{i}", head + [(i * 37 + k) % 400 + 1 for k in range(10 + i % 23)], 3 + i % 9)
    e.run()


@SCHEDULING
def test_after_a_refused_write_its_cached_blocks_serve_nobody(async_scheduling, monkeypatch):
    """Issue 34 items 1 and 2: a request refused mid-prefill had its row nulled, so the blocks
    vLLM hashed for that step were never written. Left in vLLM's prefix cache, later requests of
    the tenant with that prompt hit them and were refused (15 bystanders here). They now leave
    vLLM's cache with the refusal; the table cannot evict those the refused request still holds
    there, and evicts them before vLLM hands them out again (without that, 17-25 bystanders were
    refused page_not_free): every bystander is served as in the run without the bug."""
    rc = RealConfig(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, async_scheduling=async_scheduling)
    victim = "long-prompt"
    prompt = list(range(100, 190))

    def fill(e: RealEngine) -> None:
        e.add("other", list(range(1, 20)), 20)
        e.add(victim, prompt, 5)
        e.run()
        _more_work(e, prompt)

    clean = run_real(rc, fill, guarded=False)
    assert clean.events == {} and max(clean.scheduler_hits.get(f"after-{i}", 0) for i in range(0, 30, 2)) >= 64
    armed = computed_token_race(monkeypatch, victim)
    guarded = run_real(rc, fill, guarded=True)
    assert guarded.events.get("evict", 0) > 0, "the refused request's blocks leave vLLM's cache"
    check_contained(guarded, clean, victim, {"unwritten_slots"})
    assert len(guarded.finished) == 32


def _act_between_refusal_and_output(monkeypatch, act) -> tuple[RealEngine, RealEngine, str]:
    """Async scheduling: the worker refuses the victim (a long prompt whose computed-token count
    races its writes, :func:`computed_token_race`) at step N, and ``act(scheduler, request)``
    runs at vLLM's next ``schedule``, before step N's output (which carries the refusal) is
    processed. Returns the guarded run, the run without kvguard, and the victim's id."""
    from vllm.v1.core.sched.scheduler import Scheduler

    rc = RealConfig(num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, async_scheduling=True)
    victim = "long-prompt"
    prompt = list(range(100, 190))
    engine = {}

    def fill(e: RealEngine) -> None:
        engine["e"] = e
        e.add("other", list(range(1, 20)), 20)
        e.add(victim, prompt, 5)
        e.run()
        _more_work(e, prompt)

    clean = run_real(rc, fill, guarded=False)
    schedule = Scheduler.schedule
    acted = []

    def acting(self, *args, **kwargs):
        e = engine.get("e")
        req = self.requests.get(victim)
        refused = e is not None and e.guard is not None and any(rid == victim for _, rid, _ in e.refusals())
        if not acted and refused and req is not None and not req.is_finished() and act(self, req):
            acted.append(True)
        return schedule(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", acting)
    computed_token_race(monkeypatch, victim)
    guarded = run_real(rc, fill, guarded=True)
    assert acted, "the victim was acted on between its refusal and the output carrying it"
    assert guarded.events.get("evict", 0) > 0, "the refused request's blocks leave vLLM's cache"
    return guarded, clean, victim


def test_a_refused_request_preempted_before_its_refusal_arrives_leaves_nothing_cached(monkeypatch):
    """vLLM's scheduler preempts the refused victim before the output carrying its refusal is
    processed. The blocks vLLM hashed for the victim's refused step were never written; the
    victim holds no block any more when its refusal arrives, and its blocks must leave vLLM's
    prefix cache all the same: left there, the bystanders of its tenant that hit them read what
    nobody wrote (and were refused for it). Every bystander is served as in the run without
    the bug."""
    import time

    def preempt(scheduler, req) -> bool:
        if req not in scheduler.running:
            return False
        scheduler.running.remove(req)
        scheduler._preempt_request(req, time.monotonic())
        scheduler.waiting.prepend_request(req)
        return True

    guarded, clean, victim = _act_between_refusal_and_output(monkeypatch, preempt)
    check_contained(guarded, clean, victim, {"unwritten_slots"})


# -- what kvguard cannot check fails at start-up (enforce) or runs unchecked (report) ---------


def test_an_unsupported_kv_cache_group_is_refused_when_the_engine_starts_under_enforce():
    """A KV cache group kvguard does not check (chunked local attention beside full attention;
    hybrid full + sliding-window models are checked, test_hybrid.py): refused as vLLM builds its
    scheduler, before any request, not at the first step."""
    from kvguard.vllm.hooks import UnsupportedConfig

    rc = RealConfig(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, attention_chunk=64)
    with pytest.raises(UnsupportedConfig, match="KV cache groups.*ChunkedLocalAttentionManager"):
        run_real(rc, lambda e: pytest.fail("the engine started"), guarded=True)


def test_an_unsupported_kv_cache_group_runs_unchecked_under_report(kvguard_log):
    """Under report the same engine serves, unchecked, with a warning; its worker judges
    nothing (no guard)."""
    rc = RealConfig(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, attention_chunk=64)
    fill = lambda e: workload(e, 3, 40, salts=2)  # noqa: E731
    g = run_real(rc, fill, guarded=True, mode="report")
    p = run_real(rc, fill, guarded=False)
    assert len(p.worker.kv) == 2
    assert g.guard is None and outputs(g) == outputs(p) and len(g.finished) == 40
    assert any("cannot check KV cache groups" in m and "runs unchecked" in m for m in kvguard_log), kvguard_log


def test_speculative_decoding_is_refused_when_the_engine_starts_under_enforce():
    """Speculative decoding (here vLLM's ngram proposer): the worker writes draft tokens whose
    rejection rolls the computed-token count back, which the table does not record; refused as
    vLLM builds its scheduler."""
    from kvguard.vllm.hooks import UnsupportedConfig

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rc = RealConfig(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, speculative=spec)
    with pytest.raises(UnsupportedConfig, match="speculative decoding"):
        run_real(rc, lambda e: pytest.fail("the engine started"), guarded=True)


@SCHEDULING
@pytest.mark.parametrize("at", [3, 41])
def test_a_stale_row_tail_in_a_busy_run_costs_only_its_request(async_scheduling, at, monkeypatch):
    """The at-th append to a row that already had blocks moves the count without writing the
    entries, in a 60-request, two-tenant run through a small pool: its request alone is refused
    (it wrote through the null block), and every other request is served as in the run without
    the bug. (Before the refused request's cached blocks were evicted after its release, the
    next request handed those blocks was refused page_not_free, in every one of 16 such runs.)"""
    from vllm.v1.worker.block_table import BlockTable

    rc = RealConfig(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=async_scheduling)
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
        armed["table"] = worker.runner.input_batch.block_table.block_tables[0]

    monkeypatch.setattr(BlockTable, "append_row", stale_append_row)
    guarded = run_real(rc, fill, guarded=True, before_prepare=arm)
    check_contained(guarded, clean, armed["victim"], {"reserved_page", "foreign_page", "freed_page"})
    assert len(guarded.finished) == 60


@SCHEDULING
@pytest.mark.parametrize("at", [2, 90])
def test_a_computed_token_race_in_a_busy_run_costs_only_its_request(async_scheduling, at, monkeypatch):
    """From the at-th scheduler step, the first prefilling request's computed-token count jumps
    3 tokens past its writes, in a 60-request, two-tenant run with chunked prefill: that request
    alone is refused (unwritten_slots), every other request served as without the bug."""
    from vllm.v1.core.sched.scheduler import Scheduler

    rc = RealConfig(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512, async_scheduling=async_scheduling)
    fill = lambda e: workload(e, 4, 60, salts=2, max_prompt=120)  # noqa: E731
    clean = run_real(rc, fill, guarded=False)
    original = Scheduler._update_after_schedule
    armed: dict = {"n": 0}

    def racy(self, scheduler_output):
        original(self, scheduler_output)
        armed["n"] += 1
        if armed["n"] < at or "victim" in armed:
            return
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens - 8:
                armed["victim"] = rid
                req.num_computed_tokens += 3
                return

    monkeypatch.setattr(Scheduler, "_update_after_schedule", racy)
    guarded = run_real(rc, fill, guarded=True)
    check_contained(guarded, clean, armed["victim"], {"unwritten_slots"})
    assert len(guarded.finished) == 60


@SCHEDULING
def test_a_saltless_hasher_in_a_busy_run_refuses_exactly_the_cross_tenant_hits(async_scheduling, monkeypatch):
    """The block hasher forgets cache_salt in a 60-request, three-tenant run whose prompts share
    prefixes across tenants. The truth, from vLLM's own decisions and independent of kvguard:
    the requests whose prefix-cache hit took a block another tenant's request had cached.
    kvguard refuses exactly those (cross_tenant_share), and every other request is served as in
    the run without the bug."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    rc = RealConfig(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=async_scheduling)
    fill = lambda e: workload(e, 12, 60, salts=3, max_prompt=60)  # noqa: E731
    clean = run_real(rc, fill, guarded=False)
    salt_of_block: dict[int, str | None] = {}
    cross: set[str] = set()
    original_keys = kcu.generate_block_hash_extra_keys
    original_cache = BlockPool.cache_full_blocks
    original_hit = KVCacheManager.get_computed_blocks

    def saltless(request, *args, **kwargs):
        salt, request.cache_salt = request.cache_salt, None
        try:
            return original_keys(request, *args, **kwargs)
        finally:
            request.cache_salt = salt

    def cache_full_blocks(self, request, blocks, num_cached, num_full, *args, **kwargs):
        for b in blocks[num_cached:num_full]:
            if not b.is_null:
                salt_of_block[b.block_id] = request.cache_salt
        return original_cache(self, request, blocks, num_cached, num_full, *args, **kwargs)

    def get_computed_blocks(self, request, *args, **kwargs):
        out = original_hit(self, request, *args, **kwargs)
        for b in out[0].blocks[0]:
            if not b.is_null and salt_of_block.get(b.block_id, request.cache_salt) != request.cache_salt:
                cross.add(request.request_id)
        return out

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", saltless)
    monkeypatch.setattr(BlockPool, "cache_full_blocks", cache_full_blocks)
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    guarded = run_real(rc, fill, guarded=True)
    refused = {rid for _, rid, _ in guarded.refusals()}
    assert len(cross) >= 10, "the prompts are meant to share prefixes across tenants"
    assert refused == cross
    assert {r.kind for _, _, r in guarded.refusals()} == {"cross_tenant_share"}
    assert guarded.guard.refusals_total == len(cross), "each refused once"
    for rid in refused:
        assert guarded.finished[rid].reason == "error"
    others = {k: v for k, v in outputs(guarded).items() if k not in refused}
    assert others == {k: v for k, v in outputs(clean).items() if k not in refused}
    assert len(guarded.finished) == 60


@pytest.mark.parametrize("finish", ["aborted", "stopped"])
def test_a_refused_request_that_finishes_before_its_refusal_arrives_leaves_nothing_cached(finish, monkeypatch):
    """The refused victim finishes (a client's abort, or a stop vLLM's scheduler is told of)
    before the output carrying its refusal is processed. vLLM has popped its blocks by then;
    the blocks it hashed for the refused step were never written and must leave vLLM's prefix
    cache all the same: left there, the bystanders of its tenant that hit them read what nobody
    wrote (and were refused for it). Every bystander is served as in the run without the bug."""
    from vllm.v1.request import RequestStatus

    status = RequestStatus.FINISHED_ABORTED if finish == "aborted" else RequestStatus.FINISHED_STOPPED

    def finishing(scheduler, req) -> bool:
        scheduler.finish_requests(req.request_id, status)  # what EngineCore.abort_requests calls
        return True

    guarded, clean, victim = _act_between_refusal_and_output(monkeypatch, finishing)
    refusals = guarded.refusals()
    assert [rid for _, rid, _ in refusals] == [victim], refusals
    assert refusals[0][2].kind == "unwritten_slots"
    others = {k: v for k, v in outputs(guarded).items() if k != victim}
    assert others == {k: v for k, v in outputs(clean).items() if k != victim}
    assert len(others) == 31 and all(v[1] == "length" for v in others.values())
    assert all(rid == victim for _, rid in guarded.oracle_errors)
