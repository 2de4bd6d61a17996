"""check_step_window: check_step_rows over each request's window (tokens from_tokens[i] on).
A clean window is clean in the full check; a window of 0 is the full check; bad input is a
typed exception."""

import random

import numpy as np
import pytest

import kvguard
from pool import PAGE, admitted
from test_batched import filled, table_of


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("token_slots", [False, True])
def test_window_from_zero_is_the_full_check_and_a_clean_window_is_clean_in_full(dtype, token_slots):
    rng = random.Random(5)
    compared = refused = 0
    for _ in range(40):
        t, rows = filled("enforce")
        names = list(rows)
        width = 6
        big = np.zeros((20, width), dtype=np.int64)
        where = rng.sample(range(20), len(names))
        for r, row in zip(names, where):
            big[row, : len(rows[r][0])] = rows[r][0]
        for _ in range(rng.randrange(0, 3)):
            row, col = rng.choice(where), rng.randrange(0, 3)
            big[row, col] = rng.choice([rows[rng.choice(names)][0][0], 500, -1, 100])
        n = rng.randrange(1, 8)
        step = [rng.choice(names) for _ in range(n)]
        idx = np.array([where[names.index(r)] for r in step], dtype=np.int64)
        lens = np.array([max(0, rows[r][1] + rng.choice([0, 0, 1, -1])) for r in step], dtype=np.int64)
        engine_table = table_of(big, dtype, token_slots)
        full = t.check_step_rows(step, engine_table, idx, lens, token_slots=token_slots)
        zero = t.check_step_window(step, engine_table, idx, lens, np.zeros(n, dtype=np.int64), token_slots=token_slots)
        assert zero.refused_rows == full.refused_rows
        assert [v.kind for v in zero.violations] == [v.kind for v in full.violations]
        start = np.array([rng.randrange(0, int(x) + 3) for x in lens], dtype=np.int64)
        window = t.check_step_window(step, engine_table, idx, lens, start, token_slots=token_slots)
        # Each window is a subset of the full read: a row clean in full is clean in its window.
        assert set(window.refused_rows) <= set(full.refused_rows)
        compared += n
        refused += len(full.refused_rows)
    assert refused > 10 and compared > refused


def test_window_checks_only_the_tokens_from_its_start():
    t, rows = filled("enforce")
    a_pages, a_tokens = rows["a"]  # 40 tokens: 3 pages of PAGE=16
    b_pages, _ = rows["b"]
    big = np.zeros((4, 8), dtype=np.int32)
    big[1, :3] = a_pages
    big[1, 0] = b_pages[0]  # a's first page names b's: outside a window from token 16
    assert t.check_step_window(["a"], big, [1], [a_tokens], [PAGE]).clean
    assert t.check_step_window(["a"], big, [1], [a_tokens], [PAGE - 1]).violations[0].kind == "foreign_page"
    assert t.check_step_window(["a"], big, [1], [a_tokens], [0]).refused_rows == [0]
    # Beyond seq_lens: nothing unchecked. Pure: nothing counted.
    assert t.check_step_window(["a"], big, [1], [a_tokens], [a_tokens + 5]).clean
    assert sum(t.counters().values()) == 0
    # A window longer than the row: too short, as in the full check.
    v = t.check_step_window(["a"], big, [1], [8 * PAGE + 1], [2 * PAGE])
    assert v.violations[0].kind == "block_table_too_short"


def test_window_bad_input_is_a_typed_exception():
    t, rows = filled("enforce")
    big = np.zeros((4, 8), dtype=np.int32)
    with pytest.raises(ValueError, match="rows"):
        t.check_step_window(["a"], big, [4], [1], [0])
    with pytest.raises(ValueError, match="from_tokens"):
        t.check_step_window(["a"], big, [1], [1], [-1])
    with pytest.raises(ValueError, match="from_tokens"):
        t.check_step_window(["a", "b"], big, [1, 2], [1, 1], [0])
    with pytest.raises(TypeError, match="from_tokens"):
        t.check_step_window(["a"], big, [1], [1], "x")
    with pytest.raises(TypeError, match="table"):
        t.check_step_window(["a"], np.zeros((4, 8), dtype=np.float32), [1], [1], [0])
    assert t.check_step_window([], big, [], [], []).clean


def mirror():
    """A table whose int requests 1..5 hold rows 0..4, and kvguard.sglang's arrays for it."""
    config = kvguard.PoolConfig(128, PAGE, 512, reserved=[0], policy="enforce")
    t = kvguard.OwnershipTable(config)
    rows = {r: admitted(t, r, "acme", 20) for r in range(1, 6)}
    keys = np.array([1, 2, 3, 4, 5, 0, 0, 0], dtype=np.int64)
    owner = np.full(129, -1, dtype=np.int64)
    for r, pages in rows.items():
        owner[pages] = r
    return t, rows, keys, keys.copy(), owner, np.zeros(129, dtype=np.int64)


def test_claim_decode_slots_claims_new_pages_of_live_rows_and_leaves_the_rest():
    t, rows, keys, claimants, owner, prefix = mirror()
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    claimants[2] = 0  # request 3's row is not live: left to the engine
    prefix[free[3]] = 9  # a prefix page: left to the engine
    # Row 0 (1): its own page again (nothing new); row 1 (2): a fresh page; row 3 (4): 1's page
    # (refused, page_not_free); row 2 (3): not live; row 4 (5): the prefix page; row 1 again: a
    # page beyond the pool (refused).
    slot_rows = np.array([0, 1, 3, 2, 4, 1], dtype=np.int64)
    own = rows[1]
    slots = np.array([own[0] * PAGE + 1, free[0] * PAGE, own[1] * PAGE, free[1] * PAGE, free[3] * PAGE, 500 * PAGE], dtype=np.int32)
    verdict, left, granted = t.claim_decode_slots(keys, claimants, owner, prefix, slot_rows, slots)
    assert left == [3, 4]
    assert verdict.rows == 3
    assert [(i, v.kind, v.request) for i, v in verdict.refused] == [(1, "page_not_free", 4), (2, "page_out_of_range", 2)]
    assert granted.tolist() == [[free[0], 2]]
    assert t.page_info(free[0]).owner == 2


def test_claim_decode_slots_bad_input_is_a_typed_exception():
    t, rows, keys, claimants, owner, prefix = mirror()
    with pytest.raises(ValueError, match="rows"):
        t.claim_decode_slots(keys, claimants, owner, prefix, [len(keys)], [16])
    with pytest.raises(ValueError, match="slots"):
        t.claim_decode_slots(keys, claimants, owner, prefix, [0, 1], [16])
    with pytest.raises(ValueError, match="row_claimants"):
        t.claim_decode_slots(keys, claimants[:2], owner, prefix, [0], [16])
    with pytest.raises(ValueError, match="page_prefix"):
        t.claim_decode_slots(keys, claimants, owner, prefix[:5], [0], [16])
    with pytest.raises(TypeError, match="page_owner"):
        t.claim_decode_slots(keys, claimants, owner.astype(np.float64), prefix, [0], [16])
    verdict, left, granted = t.claim_decode_slots(keys, claimants, owner, prefix, [], [])
    assert verdict.clean and left == [] and granted.shape == (0, 2)
