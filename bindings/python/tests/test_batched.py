"""The batched step calls judge exactly as the unbatched ones: claim_step as claim called per
request in order, verify_step_rows as verify_step on the gathered page table; random steps with
violations, both policies, int32 and int64."""

import random

import numpy as np
import pytest

import kvguard
from pool import PAGE, admitted


def tables(policy):
    config = kvguard.PoolConfig(64, PAGE, 512, reserved=[0], policy=policy)
    return kvguard.OwnershipTable(config), kvguard.OwnershipTable(config)


def pages_state(table):
    out = []
    for p in range(64):
        info = table.page_info(p)
        out.append((info.state, info.owner, info.generation))
    return out


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, None])
def test_claim_step_judges_as_claims_in_order(policy, dtype):
    rng = random.Random(7)
    refusals = 0
    for _ in range(60):
        one, batch = tables(policy)
        for t in (one, batch):
            for r in ("a", "b", "c", 4):
                t.admit(r, "acme" if r != 4 else "globex", 32, 0)
        # Steps of claims: fresh pages, pages another request (or the same) took earlier in the
        # step, the reserved page 0, pages beyond the pool, unknown requests, repeats.
        for _ in range(3):
            n = rng.randrange(0, 8)
            reqs = [rng.choice(["a", "b", "c", 4, "ghost", 99]) for _ in range(n)]
            claims = [[rng.randrange(0, 70) for _ in range(rng.randrange(0, 3))] for _ in range(n)]
            expected = []
            for i, (r, pages) in enumerate(zip(reqs, claims)):
                try:
                    one.claim(r, pages)
                except kvguard.ViolationError as e:
                    expected.append((i, e.kind))
            flat = [p for c in claims for p in c]
            indptr = np.cumsum([0] + [len(c) for c in claims])
            pages = flat if dtype is None else np.array(flat, dtype=dtype)
            v = batch.claim_step(reqs, pages, indptr)
            assert v.rows == n
            assert [(i, x.kind) for i, x in v.refused] == expected
            assert v.refused_mask.tolist() == [i in {j for j, _ in expected} for i in range(n)]
            refusals += len(expected)
        assert pages_state(one) == pages_state(batch)
        assert one.counters() == batch.counters()
        for r in ("a", "b", "c", 4):
            assert one.request_info(r).quarantined == batch.request_info(r).quarantined
    assert refusals > 50  # the steps did have violations


def test_claim_step_negative_page_and_bad_indptr():
    t, _ = tables("enforce")
    t.admit("a", "acme", 32, 0)
    v = t.claim_step(["a"], np.array([-1], dtype=np.int64), [0, 1])
    assert v.refused_rows == [0] and v.violations[0].kind == "page_out_of_range"
    with pytest.raises(ValueError, match="indptr"):
        t.claim_step(["a"], [3], [0, 2])
    with pytest.raises(ValueError, match="indptr"):
        t.claim_step(["a", "a"], [3, 4], [0, 2, 1])
    assert t.claim_step([], [], [0]).clean


def filled(policy):
    """A table with requests of several tenants, their pages written, and the page table rows."""
    config = kvguard.PoolConfig(128, PAGE, 512, reserved=[0], policy=policy)
    t = kvguard.OwnershipTable(config)
    rows = {}
    for i, (r, tokens) in enumerate([("a", 40), ("b", 20), ("c", 64), ("d", 1), ("e", 33)]):
        rows[r] = (admitted(t, r, "acme" if i % 2 else "globex", tokens), tokens)
    return t, rows


def table_of(big, dtype, token_slots):
    """The engine's table: page ids, or (token_slots) one slot per token, page * PAGE + offset
    (what SGLang's req_to_token holds; a negative page stays negative)."""
    if not token_slots:
        return big.astype(dtype)
    pages = np.repeat(big, PAGE, axis=1)
    slots = pages * PAGE + np.tile(np.arange(PAGE), big.shape[1])
    slots[pages < 0] = -1
    return slots.astype(dtype)


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("token_slots", [False, True])
def test_verify_step_rows_judges_as_verify_step_on_the_gather(policy, dtype, token_slots):
    rng = random.Random(11)
    refusals = 0
    for _ in range(40):
        one, rows = filled(policy)
        batch, _ = filled(policy)
        names = list(rows)
        width = 6
        # The engine's big table: 20 rows, each request in a random row, the rest garbage.
        big = np.full((20, width), 0, dtype=np.int64)
        where = rng.sample(range(20), len(names))
        for r, row in zip(names, where):
            pages, _ = rows[r]
            big[row, : len(pages)] = pages
        # Corruptions: a foreign page, a page beyond the pool, a negative entry, a free page.
        for _ in range(rng.randrange(0, 3)):
            row, col = rng.choice(where), rng.randrange(0, 3)
            big[row, col] = rng.choice([rows[rng.choice(names)][0][0], 500, -1, 100])
        n = rng.randrange(1, 8)
        step = [rng.choice(names) for _ in range(n)]
        idx = np.array([where[names.index(r)] for r in step], dtype=np.int64)
        # Read lengths: what was written, sometimes one more (unwritten), or none.
        lens = np.array([max(0, rows[r][1] + rng.choice([0, 0, 1, -1])) for r in step], dtype=np.int64)
        gathered = big[idx].astype(np.int32)
        # Pure first (a judged refusal under enforce quarantines, and the next check sees it).
        expected_pure = one.check_step(step, gathered, lens)
        pure = batch.check_step_rows(step, table_of(big, dtype, token_slots), idx, lens, token_slots=token_slots)
        assert [(i, v.kind, v.page) for i, v in pure.refused] == [(i, v.kind, v.page) for i, v in expected_pure.refused]
        assert batch.counters() == {}
        expected = one.verify_step(step, gathered, lens)
        table = table_of(big, dtype, token_slots)
        got = batch.verify_step_rows(step, table, idx, lens, token_slots=token_slots)
        assert [(i, v.kind, v.page) for i, v in got.refused] == [(i, v.kind, v.page) for i, v in expected.refused]
        assert one.counters() == batch.counters()
        refusals += len(expected)
    assert refusals > 10


def test_verify_step_rows_reads_rows_in_place_and_refuses_bad_rows():
    t, rows = filled("enforce")
    big = np.zeros((40, 8), dtype=np.int32)[::2]  # a row stride that is not the width
    big[7, :3] = rows["a"][0]
    big[2, :2] = rows["b"][0]
    v = t.verify_step_rows(["a", "b"], big, [7, 2], [40, 20])
    assert v.clean
    assert t.verify_step_rows(["b", "a"], big, [7, 2], [40, 20]).refused_rows == [0, 1]
    with pytest.raises(ValueError, match="rows"):
        t.verify_step_rows(["a"], big, [20], [40])
    with pytest.raises(ValueError, match="rows"):
        t.verify_step_rows(["a"], big, [-1], [40])
