"""HeldBlockTable: a block table kvguard holds, changed only through its methods and read through
a read-only buffer; verify_held_rows judges each step from what changed, with the full check's
verdict (check_step_rows on the same rows) every step. Bad input refused with typed errors."""

import gc
import random

import numpy as np
import pytest

import kvguard

PAGE = 4
PAGES = 64
WIDTH = 8
ROWS = 8


def engine():
    """A table and six requests of two tenants, each with three pages of its own in row r of a
    held table (rows 6 and 7 spare); requests 2 and 4 also hold request 0's published prefix,
    first in their rows."""
    t = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE, WIDTH * PAGE, reserved=[0]))
    held = kvguard.HeldBlockTable(ROWS, WIDTH)
    written = {}
    for r in range(6):
        t.admit(r, f"tenant-{r % 2}", 16, 16)
    prefix = [p.page for p in t.allocate(0, 2)]
    t.record_write_tokens(0, prefix, 0, 8)
    t.publish_prefix(0, 7, prefix)
    for r in range(6):
        row = []
        if r in (0, 2, 4):
            if r:
                t.attach_prefix(r, 7)
            row = list(prefix)
        row += [p.page for p in t.allocate(r, 3)]
        held.append(r, row[:2])
        held.append(r, np.array(row[2:], dtype=np.int64))
        written[r] = 8 if r in (0, 2, 4) else 0
    return t, held, written


@pytest.mark.parametrize("seed", range(6))
def test_each_step_gets_the_full_checks_verdict(seed):
    """Forty decode steps: each request writes a token and reads one more; now and then a row
    is changed through the held table's methods (an entry set to another page, a row cut and
    grown again, two rows swapped, a row moved to a spare row), a request lets go of its prefix
    or some of its pages, or is preempted. verify_held_rows and a full check of the same rows
    refuse the same rows with the same kind, every step; rows nothing reached are judged from
    their last page."""
    rng = random.Random(seed)
    t, held, written = engine()
    at = {r: r for r in range(6)}  # request -> its row in the held table
    spare = [6, 7]
    live = list(range(6))
    view = np.asarray(held)
    for step in range(40):
        for r in live:
            row = held.row(at[r])
            if written[r] < len(row) * PAGE:
                try:
                    t.record_write_tokens(r, row, written[r], written[r] + 1)
                    written[r] += 1
                except kvguard.ViolationError:
                    pass  # its row names something it no longer owns: the write is refused
        event = rng.random()
        victim = rng.choice(live)
        row = held.row(at[victim])
        if event < 0.08:
            row[rng.randrange(len(row))] = rng.randrange(1, PAGES)
            held.set_row(at[victim], row)
        elif event < 0.12:
            cut = rng.randrange(len(row))
            held.truncate(at[victim], cut)
            held.append(at[victim], [rng.randrange(1, PAGES)] + row[cut + 1 :])
        elif event < 0.18:
            other = rng.choice(live)
            held.swap_rows(at[victim], at[other])
            at[victim], at[other] = at[other], at[victim]
        elif event < 0.24:
            to = spare.pop(0)
            held.copy_row(at[victim], to)
            held.clear_row(at[victim])
            spare.append(at[victim])
            at[victim] = to
        elif event < 0.28 and victim in (2, 4):
            try:
                t.detach_prefix(victim, 7)
            except kvguard.ViolationError:
                pass
        elif event < 0.32:
            try:
                t.release_pages(victim, held.row(at[victim])[-1:])
            except kvguard.ViolationError:
                pass
        elif event < 0.34:
            t.preempt(victim)
        rows = [at[r] for r in live]
        reads = [rng.choice([written[r], written[r], written[r] + 1, max(0, written[r] - 3)]) for r in live]
        got = t.check_held_rows(held, live, rows, reads)
        full = t.check_step_rows(live, view, rows, reads)
        assert [(i, v.kind) for i, v in got.refused] == [(i, v.kind) for i, v in full.refused], f"step {step}"
    assert held.incremental > 0 and held.full > 0


def test_a_decode_step_is_judged_from_each_rows_last_page():
    t, held, written = engine()
    live = [1, 3, 5]
    for r in live:
        t.record_write_tokens(r, held.row(r), 0, 9)
    assert t.verify_held_rows(held, live, live, [8, 8, 8]).clean
    assert t.verify_held_rows(held, live, live, [9, 9, 9]).clean
    assert (held.incremental, held.full) == (3, 3)
    # Request 3's first entry set to request 1's page: refused and judged (quarantined), alone.
    row = held.row(3)
    row[0] = held.row(1)[0]
    held.set_row(3, row)
    v = t.verify_held_rows(held, live, live, [9, 9, 9])
    assert [(i, x.kind) for i, x in v.refused] == [(1, "foreign_page")]
    assert t.counters()["foreign_page"] == 1
    assert "incremental=5, full=4" in repr(held)


def test_the_buffer_is_a_read_only_view_of_the_rows_that_shows_each_change():
    held = kvguard.HeldBlockTable(3, 4)
    view = np.asarray(held)
    assert view.shape == (3, 4) and view.dtype == np.int32 and view.flags.c_contiguous
    assert (view == -1).all()
    held.append(1, [5, 6])
    held.append(1, [7])
    assert view[1].tolist() == [5, 6, 7, -1] and held.row(1) == [5, 6, 7]
    with pytest.raises(ValueError):
        view[0, 0] = 1
    with pytest.raises(ValueError):
        view.setflags(write=True)
    with pytest.raises(TypeError):
        memoryview(held)[0:1] = b"\0\0\0\0"
    assert memoryview(held).readonly and memoryview(held).format == "i"
    assert memoryview(held).nbytes == 3 * 4 * 4
    held.swap_rows(0, 1)
    assert view[0].tolist() == [5, 6, 7, -1] and view[1].tolist() == [-1] * 4
    held.truncate(0, 1)
    assert view[0].tolist() == [5, -1, -1, -1]
    # The view keeps the table alive.
    del held
    gc.collect()
    assert view[0, 0] == 5
    assert np.asarray(kvguard.HeldBlockTable(0, 0)).shape == (0, 0)


def test_bad_input_is_refused_and_changes_nothing():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE, WIDTH * PAGE))
    held = kvguard.HeldBlockTable(2, 3)
    held.append(0, [1, 2])
    before = np.asarray(held).copy()
    with pytest.raises(ValueError, match="at most 3"):
        held.append(0, [3, 4])
    with pytest.raises(ValueError, match="at most 3"):
        held.set_row(0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="past"):
        held.append(2, [1])
    with pytest.raises(ValueError, match="rows are ints"):
        held.append(-1, [1])
    with pytest.raises(ValueError, match="int32"):
        held.append(1, [2**31])
    with pytest.raises(ValueError, match="past"):
        held.copy_row(0, 5)
    with pytest.raises(ValueError, match="past"):
        held.swap_rows(9, 0)
    with pytest.raises(ValueError, match="past"):
        held.row(2)
    with pytest.raises((ValueError, TypeError)):
        held.append(0, [[1]])
    assert (np.asarray(held) == before).all()
    with pytest.raises(ValueError, match="too large"):
        kvguard.HeldBlockTable(2**33, 4)
    with pytest.raises(OverflowError):
        kvguard.HeldBlockTable(-1, 4)
    t.admit(1, 1, 8, 0)
    with pytest.raises(ValueError, match="rows\\[0\\] is 2"):
        t.verify_held_rows(held, [1], [2], [4])
    with pytest.raises(ValueError):
        t.verify_held_rows(held, [1, 1], [0, 0], [4])
    with pytest.raises(TypeError):
        t.verify_held_rows(kvguard.RowCache(), [1], [0], [4])
    assert held.full + held.incremental == 0
