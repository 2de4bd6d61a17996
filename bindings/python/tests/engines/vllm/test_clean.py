"""Clean workloads under enforce: zero violations, and the same outputs as without kvguard."""

from __future__ import annotations

import pytest
from conftest import run_unguarded, workload
from engine import Engine, EngineConfig


def run_both(cfg: EngineConfig, fill) -> tuple[Engine, Engine]:
    guarded = Engine(cfg, guarded=True)
    fill(guarded)
    guarded.run()
    plain = run_unguarded(cfg, fill)
    return guarded, plain


def assert_clean(guarded: Engine, plain: Engine) -> None:
    assert guarded.idle and plain.idle
    assert guarded.reports == []
    assert guarded._kvguard.table.counters() == {}
    assert guarded.oracle_errors == [] and plain.oracle_errors == []
    assert {k: (f.tokens, f.reason) for k, f in guarded.finished.items()} == {
        k: (f.tokens, f.reason) for k, f in plain.finished.items()
    }
    assert all(f.reason == "length" for f in guarded.finished.values())
    assert guarded.steps == plain.steps


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("seed", range(6))
def test_seeds_shared_prefixes_chunked_prefill(enforce, seed, prefix_caching):
    cfg = EngineConfig(
        num_blocks=160, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, prefix_caching=prefix_caching
    )
    g, p = run_both(cfg, lambda e: workload(e, seed, 40, salts=2))
    assert_clean(g, p)
    if prefix_caching:
        assert g.events.get("ATTACH", 0) > 0 and g.events.get("PUBLISH", 0) > 0


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_under_a_small_pool(enforce, prefix_caching):
    cfg = EngineConfig(
        num_blocks=40, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512, prefix_caching=prefix_caching
    )
    g, p = run_both(cfg, lambda e: workload(e, 7, 48, max_prompt=120))
    assert g.preemptions > 0, "the pool is meant to force preemptions"
    assert g.events.get("PREEMPT", 0) == g.preemptions
    if prefix_caching:
        assert g.events.get("EVICT", 0) > 0, "cached blocks are meant to be reused"
    assert_clean(g, p)


def test_a_thousand_requests(enforce):
    cfg = EngineConfig(num_blocks=512, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    g, p = run_both(cfg, lambda e: workload(e, 1000, 1000, shared=8, salts=4))
    assert len(g.finished) == 1000
    assert_clean(g, p)
