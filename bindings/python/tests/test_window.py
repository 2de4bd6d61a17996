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


def test_write_decode_rows_is_claim_decode_slots_with_the_mirror_updated():
    """The same claims, refusals and leftovers as claim_decode_slots on a twin table; the mirror
    is updated in place: each granted page is its request's, each row's checked length drops to
    the column written below it."""
    twin, _, *twin_mirror = mirror()
    t, rows, keys, claimants, owner, prefix = mirror()
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    for c in (claimants, twin_mirror[1]):
        c[2] = 0
    for p in (prefix, twin_mirror[3]):
        p[free[3]] = 9
    slot_rows = np.array([0, 1, 3, 2, 4, 1], dtype=np.int64)
    own = rows[1]
    slots = np.array([own[0] * PAGE + 1, free[0] * PAGE, own[1] * PAGE, free[1] * PAGE, free[3] * PAGE, 500 * PAGE], dtype=np.int32)
    checked = np.array([20, 20, 20, 20, 20, 0, 0, 0], dtype=np.int64)
    cols = np.array([20, 3, 20, 25, 20, 20], dtype=np.int64)
    want_verdict, want_left, granted = twin.claim_decode_slots(*twin_mirror, slot_rows, slots)
    verdict, left = t.write_decode_rows(keys, claimants, owner, prefix, checked, slot_rows, cols, slots)
    assert left == want_left == [3, 4]
    assert [(i, v.kind, v.request) for i, v in verdict.refused] == [
        (i, v.kind, v.request) for i, v in want_verdict.refused
    ]
    assert granted.tolist() == [[free[0], 2]]
    assert owner[free[0]] == 2 and t.page_info(free[0]).owner == 2
    assert (owner == np.where(np.arange(129) == free[0], 2, twin_mirror[2])).all()
    # Row 1 was rewritten at column 3: its window starts there next; the others kept theirs.
    assert checked.tolist() == [20, 3, 20, 20, 20, 0, 0, 0]


def test_write_decode_rows_of_a_clean_step_returns_none():
    t, rows, keys, claimants, owner, prefix = mirror()
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    checked = np.full(8, 20, dtype=np.int64)
    # Rows 0 and 1 write into their own last page, row 2 opens a fresh page.
    slots = np.array([rows[1][1] * PAGE + 4, rows[2][1] * PAGE + 4, free[0] * PAGE], dtype=np.int64)
    assert t.write_decode_rows(keys, claimants, owner, prefix, checked, [0, 1, 2], [20, 20, 20], slots) is None
    assert owner[free[0]] == 3 and t.page_info(free[0]).owner == 3
    assert checked.tolist() == [20] * 8
    # Nothing to claim at all: still None, nothing changed.
    before = owner.copy()
    assert t.write_decode_rows(keys, claimants, owner, prefix, checked, [0], [21], [rows[1][1] * PAGE + 5]) is None
    assert (owner == before).all()


def test_write_decode_rows_bad_input_is_a_typed_exception_and_changes_nothing():
    t, rows, keys, claimants, owner, prefix = mirror()
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    checked = np.full(8, 20, dtype=np.int64)
    args = (keys, claimants, owner, prefix, checked)
    fresh = [free[0] * PAGE]
    frozen = owner.copy()
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="page_owner"):
        t.write_decode_rows(keys, claimants, frozen, prefix, checked, [0], [20], fresh)
    with pytest.raises(TypeError, match="row_checked"):
        t.write_decode_rows(keys, claimants, owner, prefix, checked.astype(np.int32), [0], [20], fresh)
    with pytest.raises(ValueError, match="row_checked"):
        t.write_decode_rows(keys, claimants, owner, prefix, checked[:3], [0], [20], fresh)
    with pytest.raises(ValueError, match="cols"):
        t.write_decode_rows(*args, [0, 1], [20, 20, 20], [free[0] * PAGE, free[1] * PAGE])
    with pytest.raises(ValueError, match="rows"):
        t.write_decode_rows(*args, [8], [20], fresh)
    with pytest.raises(ValueError, match="slots"):
        t.write_decode_rows(*args, [0, 1], [20, 20], fresh)
    assert t.page_info(free[0]).state == "free" and owner[free[0]] == -1
    assert checked.tolist() == [20] * 8
    # A negative column (torch counts it from the row's end): the whole row is checked next.
    assert t.write_decode_rows(*args, [0], [-1], [rows[1][1] * PAGE + 5]) is None
    assert checked[0] == 0


def forward_mirror():
    """mirror(), its rows laid out in an SGLang req_to_token (token slots), each request's 20
    tokens written, and the mirror's checked lengths at 20 (a clean check of the whole row)."""
    t, rows, keys, claimants, owner, prefix = mirror()
    rt = np.zeros((8, 64), dtype=np.int32)
    for r, pages in rows.items():
        for tok in range(64):
            rt[r - 1, tok] = pages[min(tok // PAGE, len(pages) - 1)] * PAGE + tok % PAGE
    checked = np.zeros(8, dtype=np.int64)
    checked[:5] = 20
    return t, rows, keys, claimants, checked, rt


def test_check_decode_forward_records_the_writes_and_checks_each_window():
    t, rows, keys, claimants, checked, rt = forward_mirror()
    twin, *_ = forward_mirror()
    # Each of rows 0..4 writes its 21st token (slot 20 of its row) and reads 21 tokens.
    step = np.arange(5, dtype=np.int64)
    lens = np.full(5, 21, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc) is None
    assert checked.tolist() == [21] * 5 + [0] * 3
    # What record_step_writes and check_step_window say on the twin table.
    qsl = np.arange(6, dtype=np.int64)
    assert twin.record_step_writes(keys[step], loc, qsl).clean
    assert twin.check_step_window(keys[step], rt, step, lens, np.full(5, 20), token_slots=True).clean
    # The writes were recorded: the next token is readable now, in full, on both tables.
    for table in (t, twin):
        assert table.check_step_rows(keys[step], rt, step, lens, token_slots=True).clean


def test_check_decode_forward_stops_where_the_step_is_not_clean():
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    lens = np.full(5, 21, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    # A row of no live request: nothing done at all.
    dead = claimants.copy()
    dead[3] = 0
    assert t.check_decode_forward(keys, dead, checked, rt, step, lens, loc) == ("full", None)
    # Not one slot per row: nothing done.
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc[:4]) == ("full", None)
    assert checked.tolist() == [20] * 5 + [0] * 3
    assert not t.check_step_rows(keys[step], rt, step, lens, token_slots=True).clean  # token 21 unwritten
    # Row 1 writes into request 1's page: the writes' judged verdict, nothing read.
    bad = loc.copy()
    bad[1] = rows[1][0] * PAGE + 3
    stage, verdict = t.check_decode_forward(keys, claimants, checked, rt, step, lens, bad)
    assert stage == "writes"
    assert [(i, v.kind, v.request) for i, v in verdict.refused] == [(1, "foreign_page", 2)]
    assert checked.tolist() == [20] * 5 + [0] * 3
    # A row whose window names another request's page: the writes are recorded, the window
    # check says so, and the mirror keeps the old checked lengths.
    t, rows, keys, claimants, checked, rt = forward_mirror()
    rt[4, 16:32] = rows[1][1] * PAGE + np.arange(16)
    loc = rt[step, 20].astype(np.int64)
    loc[4] = rows[5][1] * PAGE + 4
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc) == ("window", None)
    assert checked.tolist() == [20] * 5 + [0] * 3
    assert t.check_read(5, [rows[5][0], rows[5][1]], 21) is None  # 5's write was recorded
    # A window that starts at 0 is the whole row (the mirror says nothing was checked).
    t, rows, keys, claimants, checked, rt = forward_mirror()
    rt[4, 0:16] = rows[1][0] * PAGE + np.arange(16)
    loc = rt[step, 20].astype(np.int64)
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc) is None
    checked[4] = 0
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc) == ("window", None)


def test_check_decode_forward_bad_input_is_a_typed_exception():
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    lens = np.full(5, 21, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    with pytest.raises(TypeError, match="row_checked"):
        t.check_decode_forward(keys, claimants, checked.astype(np.int32), rt, step, lens, loc)
    with pytest.raises(ValueError, match="row_claimants"):
        t.check_decode_forward(keys, claimants[:3], checked, rt, step, lens, loc)
    with pytest.raises(ValueError, match=r"rows\[2\] is 2: req_to_token has 2 rows"):
        t.check_decode_forward(keys, claimants, checked, rt[:2], step, lens, loc)
    # A row past row_keys is named before one past the table, whichever comes first.
    with pytest.raises(ValueError, match=r"rows\[3\] is 8: row_keys has 8 rows"):
        t.check_decode_forward(keys, claimants, checked, rt[:2], np.array([0, 1, 5, 8, 2]), lens, loc)
    with pytest.raises(ValueError, match=r"rows\[1\] is -1: must be >= 0"):
        t.check_decode_forward(keys, claimants, checked, rt, np.array([0, -1, 2, 3, 4]), lens, loc)
    with pytest.raises(ValueError, match="seq_lens"):
        t.check_decode_forward(keys, claimants, checked, rt, step, lens[:2], loc)
    with pytest.raises(ValueError, match="seq_lens"):
        t.check_decode_forward(keys, claimants, checked, rt, step, -lens, loc)
    with pytest.raises(TypeError, match="req_to_token"):
        t.check_decode_forward(keys, claimants, checked, rt.astype(np.float32), step, lens, loc)
    assert checked.tolist() == [20] * 5 + [0] * 3
    assert t.check_decode_forward(keys, claimants, checked, rt, [], [], []) is None


def test_a_length_past_the_pool_allocates_nothing_and_is_refused():
    """A stride-0 view has an enormous width and no memory behind it: a length that would read
    or write more than the pool holds is refused (a read: block_table_too_short after the pool's
    worth of pages; a write: ValueError), never sized into an allocation."""
    t, rows, keys, claimants, checked, rt = forward_mirror()
    page = rows[1][0]
    wide = np.broadcast_to(np.int32(page * PAGE), (8, 2**40))
    huge = np.array([2**44], dtype=np.int64)
    # The forward's window: the write is recorded, the window refused; the judged full check
    # names it.
    assert t.check_decode_forward(keys, claimants, checked, wide, [0], huge, [page * PAGE + 5]) == ("window", None)
    v = t.verify_step_rows([1], wide, [0], huge, token_slots=True)
    assert [x.kind for x in v.violations] == ["block_table_too_short"]
    assert t.check_step_window([1], wide, [0], huge, [0], token_slots=True).refused_rows == [0]
    pages = np.broadcast_to(np.int32(page), (8, 2**40))
    assert t.check_step_rows([1], pages, [0], huge).refused_rows == [0]
    # vLLM's worker step: the slot mapping would be 2**44 entries.
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        t.record_and_verify_step([1], pages, [0], huge)
    # Each request within its row, together more than the pool's slots.
    per = np.full(5, 2048 // 4 * 3, dtype=np.int64)
    with pytest.raises(ValueError, match="pool's 2048 slots"):
        t.record_and_verify_step([1, 2, 3, 4, 5], pages, np.zeros(5, dtype=np.int64), per)


def test_positions_of_one_row_in_one_new_page_claim_it_once():
    t, rows, keys, claimants, owner, prefix = mirror()
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    checked = np.full(8, 20, dtype=np.int64)
    # Row 1 (request 2) writes two tokens of a fresh page, apart, with row 0 between them.
    slots = np.array([free[0] * PAGE, rows[1][1] * PAGE + 4, free[0] * PAGE + 1], dtype=np.int64)
    assert t.write_decode_rows(keys, claimants, owner, prefix, checked, [1, 0, 1], [32, 20, 33], slots) is None
    assert owner[free[0]] == 2 and t.page_info(free[0]).owner == 2
    assert not t.request_info(2).quarantined
    verdict, left, granted = t.claim_decode_slots(keys, claimants, owner, prefix, [2, 2], [free[1] * PAGE] * 2)
    assert verdict.clean and verdict.rows == 1 and left == [] and granted.tolist() == [[free[1], 3]]
    # A refused claim puts the mirror back: the page is nobody's in it, as in the table.
    slots = np.array([rows[1][0] * PAGE, rows[1][0] * PAGE + 1], dtype=np.int64)
    verdict, left = t.write_decode_rows(keys, claimants, owner, prefix, checked, [3, 3], [40, 41], slots)
    assert [(v.kind, v.request) for _, v in verdict.refused] == [("page_not_free", 4)]
    assert owner[rows[1][0]] == 1
    # A stale row writing into another request's page beside that request's own write there:
    # only the stale row's request is refused, and the page stays its owner's.
    t, rows, keys, claimants, owner, prefix = mirror()
    slots = np.array([rows[2][1] * PAGE + 5, rows[2][1] * PAGE + 4], dtype=np.int64)
    verdict, left = t.write_decode_rows(keys, claimants, owner, prefix, checked, [0, 1], [21, 20], slots)
    assert [(v.kind, v.request) for _, v in verdict.refused] == [("page_not_free", 1)]
    assert owner[rows[2][1]] == 2 and not t.request_info(2).quarantined


def test_the_mirror_must_cover_the_pool_and_its_spare_entry_owns_nothing():
    t, rows, keys, claimants, owner, prefix = mirror()
    checked = np.full(8, 20, dtype=np.int64)
    free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
    short_owner, short_prefix = owner[:65].copy(), prefix[:65].copy()
    with pytest.raises(ValueError, match=r"page_owner \(65\).*\(129\)"):
        t.write_decode_rows(keys, claimants, short_owner, short_prefix, checked, [1], [32], [free[0] * PAGE])
    with pytest.raises(ValueError, match="page_owner"):
        t.claim_decode_slots(keys, claimants, short_owner, short_prefix, [1], [free[0] * PAGE])
    assert t.page_info(free[0]).state == "free"
    # The spare entry, which every page out of range reads, is claimed whatever it holds: a
    # write beyond the pool, or to a negative slot, is refused, not passed as the row's own.
    owner[128] = 2
    for slot in (500 * PAGE, -5):
        verdict, left = t.write_decode_rows(keys, claimants, owner, prefix, checked, [1], [32], [slot])
        assert [(v.kind, v.request) for _, v in verdict.refused] == [("page_out_of_range", 2)]


def test_per_position_arrays_have_one_entry_per_position():
    t, rows, keys, claimants, owner, prefix = mirror()
    checked = np.full(8, 20, dtype=np.int64)
    own = rows[2][1] * PAGE + 4
    with pytest.raises(ValueError, match="slots has 2 entries, rows 1"):
        t.write_decode_rows(keys, claimants, owner, prefix, checked, [1], [20], [own, own])
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    with pytest.raises(ValueError, match="seq_lens has 6 entries, rows 5"):
        t.check_decode_forward(keys, claimants, checked, rt, step, np.full(6, 21, dtype=np.int64), loc)
    assert checked.tolist() == [20] * 5 + [0] * 3


def test_the_arrays_the_binding_writes_share_memory_with_nothing_it_reads():
    t, rows, keys, claimants, owner, prefix = mirror()
    checked = np.full(8, 20, dtype=np.int64)
    fresh = [rows[2][1] * PAGE + 4]
    with pytest.raises(ValueError, match="page_owner shares memory with page_prefix"):
        t.write_decode_rows(keys, claimants, owner, owner, checked, [1], [20], fresh)
    with pytest.raises(ValueError, match="page_owner shares memory with row_checked"):
        t.write_decode_rows(keys, claimants, owner, prefix, owner[:8], [1], [20], fresh)
    with pytest.raises(ValueError, match="row_checked shares memory with row_keys"):
        t.write_decode_rows(keys, claimants, owner, prefix, keys, [1], [20], fresh)
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    with pytest.raises(ValueError, match="row_checked shares memory with row_claimants"):
        t.check_decode_forward(keys, claimants, claimants, rt, step, np.full(5, 21, dtype=np.int64), loc)
    # The rows and lengths are read in place while row_checked is written: a view of it as
    # either would change what a later row reads.
    checked[:5] = step  # rows and lengths the checks before the overlap's pass
    with pytest.raises(ValueError, match="row_checked shares memory with rows"):
        t.check_decode_forward(keys, claimants, checked, rt, checked[:5], np.full(5, 21, dtype=np.int64), loc)
    with pytest.raises(ValueError, match="row_checked shares memory with seq_lens"):
        t.check_decode_forward(keys, claimants, checked, rt, step, checked[:5], loc)
    assert checked[:5].tolist() == list(range(5)), "nothing written"
    # Views of one buffer that do not overlap are separate arrays.
    both = np.zeros(16, dtype=np.int64)
    both[:8] = keys
    both[8:] = 20
    assert t.check_decode_forward(both[:8], claimants, both[8:], rt, step, np.full(5, 21, dtype=np.int64), loc) is None


def test_a_slot_outside_any_pool_on_a_row_left_to_the_plugin_is_refused_not_raised():
    """kvguard.sglang's row write takes the rows the binding leaves (a request refused at intake,
    a radix prefix page) itself: a negative slot there is judged as the binding judges it on a
    live row (page_out_of_range, on that request), not a ValueError out of SGLang's write."""
    from kvguard.sglang.guard import Guard

    t, rows, keys, claimants, owner, prefix = mirror()
    g = Guard.__new__(Guard)  # the row-write state only: no SGLang objects behind it
    g.table, g.page_size, g._page_limit, g.policy = t, PAGE, 128, "enforce"
    g._row_key, g._row_claimant, g._page_key, g._page_prefix = keys, claimants, owner, prefix
    g._row_checked = np.full(8, 20, dtype=np.int64)
    g._admitted, g._holds = set(rows), {r: set() for r in rows}
    refused = []
    g._refused = lambda key, v: refused.append((key, v.kind))
    claimants[1] = 0  # request 2's row is left to the plugin
    for slot in (-1, 2**40):
        g._decode_rows_written(np.array([1]), np.array([20]), np.array([slot], dtype=np.int64))
    assert refused == [(2, "page_out_of_range")] * 2


def test_every_entry_read_inside_a_page_is_that_pages_slot():
    """A per-token reader (SGLang's Triton backend) reads every entry of req_to_token, not only
    each page's first: an entry inside a page that names another request's slot is refused on
    its row, as is a row whose slots are shifted across a page boundary; entries past the tokens
    read are not looked at."""
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    lens = np.full(5, 20, dtype=np.int64)
    assert t.check_step_rows(keys[step], rt, step, lens, token_slots=True).clean
    bad = rt.copy()
    bad[1, 5] = rows[1][0] * PAGE + 5  # request 2's token 5 names request 1's slot
    v = t.check_step_rows(keys[step], bad, step, lens, token_slots=True)  # pure: nothing quarantined
    assert [(i, x.kind, x.request, x.owner) for i, x in v.refused] == [(1, "foreign_page", 2, 1)]
    assert t.check_step_window(keys[step], bad, step, lens, np.zeros(5, dtype=np.int64), token_slots=True).refused_rows == [1]
    # Only the window's pages: token 5 is in page 0, outside a window from token 16.
    assert t.check_step_window(keys[step], bad, step, lens, np.full(5, 16), token_slots=True).clean
    # Past the tokens read: not read, not refused.
    past = rt.copy()
    past[1, 21] = rows[1][1] * PAGE + 5
    assert t.check_step_rows(keys[step], past, step, lens, token_slots=True).clean
    # Shifted by 5: the page's first entry names the row's own page, the last entries the page
    # after it, which is not the reader's.
    shifted = rt.copy()
    shifted[2, :16] = rows[3][0] * PAGE + 5 + np.arange(16)
    v = t.check_step_rows(keys[step], shifted, step, lens, token_slots=True)
    assert v.refused_rows == [2]
    # int64 rows take the general path: the same verdicts; judged, the row's request is
    # quarantined and counted once.
    v = t.verify_step_rows(keys[step], bad.astype(np.int64), step, lens, token_slots=True)
    assert [(i, x.kind) for i, x in v.refused] == [(1, "foreign_page")]
    assert t.request_info(2).quarantined and sum(t.counters().values()) == 1


def test_a_decode_window_with_an_entry_off_its_page_goes_to_the_full_check():
    t, rows, keys, claimants, checked, rt = forward_mirror()
    step = np.arange(5, dtype=np.int64)
    lens = np.full(5, 21, dtype=np.int64)
    loc = rt[step, 20].astype(np.int64)
    rt[3, 18] = rows[1][1] * PAGE + 2  # request 4's token 18 names request 1's slot
    assert t.check_decode_forward(keys, claimants, checked, rt, step, lens, loc) == ("window", None)
    v = t.verify_step_rows(keys[step], rt, step, lens, token_slots=True)
    assert [(i, x.kind, x.request) for i, x in v.refused] == [(3, "foreign_page", 4)]


@pytest.mark.parametrize("page_size", [1, 4, 12, 16])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_mark_pages_marks_the_page_of_every_slot_in_the_flags_and_passes_over_the_rest(page_size, dtype):
    rng = random.Random(page_size)
    pages = 40
    handed = np.zeros(pages + 1, dtype=bool)  # as kvguard.sglang keeps it: one spare entry
    slots = np.array([rng.randrange(-3 * page_size, (pages + 5) * page_size) for _ in range(200)], dtype=dtype)
    kvguard.mark_pages(handed[:pages].view(np.uint8), slots, page_size)
    expected = np.zeros(pages + 1, dtype=bool)
    for s in slots.tolist():
        if s >= 0 and s // page_size < pages:
            expected[s // page_size] = True
    assert (handed == expected).all()
    assert not handed[pages], "the spare entry is never marked"
    # Marks are only ever set; a list and a strided view are read the same way.
    again = handed.copy()
    kvguard.mark_pages(again[:pages].view(np.uint8), slots[::-1].tolist(), page_size)
    kvguard.mark_pages(again[:pages].view(np.uint8), slots[::2], page_size)
    assert (again == expected).all()


def test_mark_pages_bad_input_is_a_typed_exception_and_marks_nothing():
    flags = np.zeros(8, dtype=np.uint8)
    with pytest.raises(TypeError, match="flags must be a writable, contiguous 1-D uint8 array"):
        kvguard.mark_pages(np.zeros(8, dtype=bool), [1], 1)  # bool itself: pass its uint8 view
    with pytest.raises(TypeError, match="flags must be a writable, contiguous 1-D uint8 array"):
        kvguard.mark_pages(np.zeros(8, dtype=np.int64), [1], 1)
    frozen = np.zeros(8, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="flags must be a writable"):
        kvguard.mark_pages(frozen, [1], 1)
    with pytest.raises(TypeError, match="flags must be a writable"):
        kvguard.mark_pages(np.zeros(16, dtype=np.uint8)[::2], [1], 1)
    with pytest.raises(ValueError, match="page_size must be at least 1"):
        kvguard.mark_pages(flags, [1], 0)
    with pytest.raises(OverflowError):
        kvguard.mark_pages(flags, [1], -4)
    with pytest.raises(TypeError, match="slots must be"):
        kvguard.mark_pages(flags, "12", 1)
    with pytest.raises(ValueError, match="flags shares memory with slots"):
        kvguard.mark_pages(flags, flags.view(np.int64), 1)
    assert not flags.any()


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_cached_token_slot_rows_get_the_full_checks_verdicts_step_after_step(policy, dtype):
    """verify_step_rows(cached=True) keeps the rows it found clean (the table's SlotRowCache):
    across steps that grow rows, change entries behind the engine's calls and put them back,
    its verdicts are the full check's, row for row; an int64 table is checked in full."""
    rng = random.Random(11)
    t, rows = filled(policy)
    names = list(rows)
    pages = np.zeros((len(names), 6), dtype=np.int64)
    for i, r in enumerate(names):
        pages[i, : len(rows[r][0])] = rows[r][0]
    own = table_of(pages, dtype, True)
    engine_table = own.copy()
    lens = {r: max(1, rows[r][1] - 8) for r in names}
    idx = np.arange(len(names), dtype=np.int64)
    refused = 0
    for _ in range(300):
        r = rng.choice(names)
        i = names.index(r)
        what = rng.random()
        if what < 0.5:
            lens[r] = min(rows[r][1], lens[r] + 1)
        elif what < 0.75:
            other = int(own[(i + 1) % len(names), 0])
            engine_table[i, rng.randrange(0, lens[r])] = rng.choice([500, -1, other, int(own[i, 0]) + PAGE])
        else:
            engine_table[i] = own[i]
        seq = np.array([lens[r] for r in names], dtype=np.int64)
        full = t.check_step_rows(names, engine_table, idx, seq, token_slots=True)
        cached = t.verify_step_rows(names, engine_table, idx, seq, token_slots=True, cached=True)
        assert cached.refused_rows == full.refused_rows
        assert [(v.kind, v.page) for v in cached.violations] == [(v.kind, v.page) for v in full.violations]
        refused += len(full.refused_rows)
    assert refused > 20
