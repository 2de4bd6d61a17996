"""verify_rows: an engine's block table read in place across steps through a RowCache, each
verdict the full check's (check_step_rows on the same rows), rows unchanged judged from their
last page; shapes and types that cannot be read in place refused with ValueError."""

import random

import numpy as np
import pytest

import kvguard

PAGE = 4
PAGES = 64
WIDTH = 8


def engine(seed):
    """A table, an engine block table (one row per request) and six requests, two of them
    holding a published prefix of request 0's."""
    rng = random.Random(seed)
    t = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE, WIDTH * PAGE, reserved=[0]))
    bt = np.full((8, WIDTH), -1, dtype=np.int32)
    written = {}
    for r in range(6):
        t.admit(r, f"tenant-{r % 2}", 16, 16)
        written[r] = 0
    pages = [p.page for p in t.allocate(0, 2)]
    t.record_write_tokens(0, pages, 0, 8)
    t.publish_prefix(0, 7, pages)
    bt[0, :2] = pages
    written[0] = 8
    for r in (2, 4):  # tenant-0's: may hold tenant-0's prefix
        t.attach_prefix(r, 7)
        bt[r, :2] = pages
        written[r] = 8
    for r in range(6):
        start = 2 if r in (0, 2, 4) else 0
        own = [p.page for p in t.allocate(r, 3)]
        bt[r, start : start + 3] = own
    return rng, t, bt, written


@pytest.mark.parametrize("seed", range(6))
def test_each_step_gets_the_full_checks_verdict(seed):
    """Forty decode steps: each request writes a token and reads one more; now and then the
    engine's row changes behind kvguard's back, a request lets go of its prefix or some of its
    pages, or is preempted, and the row is left as it was. verify_rows and a fresh full check
    of the same rows refuse the same rows with the same kind, every step."""
    rng, t, bt, written = engine(seed)
    cache = kvguard.RowCache()
    live = list(range(6))
    for step in range(40):
        for r in live:
            row = [int(p) for p in bt[r] if p >= 0]
            if written[r] < len(row) * PAGE:
                try:
                    t.record_write_tokens(r, row, written[r], written[r] + 1)
                    written[r] += 1
                except kvguard.ViolationError:
                    pass  # its row names something it no longer owns: the write is refused
        event = rng.random()
        victim = rng.choice(live)
        if event < 0.08:
            bt[victim, rng.randrange(WIDTH)] = rng.randrange(1, PAGES)  # behind the engine's back
        elif event < 0.12 and victim in (2, 4):
            try:
                t.detach_prefix(victim, 7)
            except kvguard.ViolationError:
                pass
        elif event < 0.16:
            own = [int(p) for p in bt[victim, 2:] if p >= 0]
            try:
                t.release_pages(victim, own[-1:])
            except kvguard.ViolationError:
                pass
        elif event < 0.18:
            t.preempt(victim)
        reads = [rng.choice([written[r], written[r], written[r] + 1, max(0, written[r] - 3)]) for r in live]
        got = t.check_rows(cache, live, bt, live, reads)
        full = t.check_step_rows(live, bt, live, reads)
        assert [(i, v.kind) for i, v in got.refused] == [(i, v.kind) for i, v in full.refused], f"step {step}"
    assert cache.incremental > 0, "rows were judged from their last page"


def test_unchanged_rows_are_judged_from_their_last_page_and_verify_judges():
    _, t, bt, written = engine(0)
    cache = kvguard.RowCache()
    rows = [0, 2, 4]
    lens = [written[r] for r in rows]
    assert t.verify_rows(cache, rows, bt, rows, lens).clean
    assert (cache.full, cache.incremental) == (3, 0)
    assert t.verify_rows(cache, rows, bt, rows, lens).clean
    assert (cache.full, cache.incremental) == (3, 3)
    # Request 2 lets go of the prefix; its row still lists it: refused, judged (counted).
    t.detach_prefix(2, 7)
    v = t.verify_rows(cache, rows, bt, rows, lens)
    assert v.refused_rows == [1] and v.violations[0].kind == "foreign_page"
    assert t.counters() == {"foreign_page": 1}
    assert "RowCache(incremental=" in repr(cache)
    assert (cache.full, cache.incremental) == (4, 5)
    cache.clear()  # forgets the rows, keeps the counts
    assert t.check_rows(cache, [0], bt, [0], [8]).clean and cache.full == 5


def test_tables_that_cannot_be_read_in_place_are_refused():
    _, t, bt, _ = engine(0)
    cache = kvguard.RowCache()
    with pytest.raises(ValueError, match="C-contiguous 2-D int32"):
        t.verify_rows(cache, [0], bt.astype(np.int64), [0], [8])
    with pytest.raises(ValueError, match="C-contiguous 2-D int32"):
        t.verify_rows(cache, [0], bt[:, ::2], [0], [8])
    with pytest.raises(ValueError, match="C-contiguous 2-D int32"):
        t.verify_rows(cache, [0], np.asfortranarray(bt), [0], [8])
    with pytest.raises(ValueError, match="rows\\[0\\] is 8"):
        t.verify_rows(cache, [0], bt, [8], [8])
    with pytest.raises(ValueError):
        t.verify_rows(cache, [0, 2], bt, [0], [8, 8])  # rows shorter than the requests
    with pytest.raises(ValueError):
        t.verify_rows(cache, [0], bt, [-1], [8])
    with pytest.raises(TypeError):
        t.verify_rows(object(), [0], bt, [0], [8])
    assert (cache.full, cache.incremental) == (0, 0), "nothing was checked"
    # A row of the table's own slice (rows back to back) reads in place.
    assert t.verify_rows(cache, [0], bt[:4], [0], [8]).clean
