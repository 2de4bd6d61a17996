"""A worker step begun on kvguard's own thread (begin_record_and_verify_step) judges exactly as
apply_record_and_verify_step, and the table reads as if the step had run on the calling thread:
every later call sees it applied; malformed input raises when the step is begun, with nothing
applied; a forked child runs its own steps."""

import multiprocessing
import random

import numpy as np
import pytest

import kvguard
from test_step_events import PAGE, REQS, admitted_tables, plain_events, random_events, random_rows, refusals_of, state, verdict


def same_outcome(got, want):
    assert refusals_of(got[0]) == refusals_of(want[0])
    assert verdict(got[1]) == verdict(want[1])
    assert refusals_of(got[2]) == refusals_of(want[2])
    assert verdict(got[3]) == verdict(want[3])


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_begun_step_judges_as_the_one_call_step(policy, dtype):
    """Random steps (decode steps' events, events that admit and release, garbage rows), each
    begun on one table and run in one call on a like table: the same refusals, the same table
    after; a request id the step's events reuse reads as it does then."""
    rng = random.Random(5)
    refusals = 0
    for _ in range(30):
        now, begun = admitted_tables(policy, {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7], 9: [10]})
        for _ in range(4):
            n = rng.randrange(0, 5)
            ids = [rng.choice(REQS + ["ghost", "zz"]) for _ in range(n)]
            bt = random_rows(rng, n, dtype)
            computed = np.array([rng.choice([0, 0, 2, 5]) for _ in ids] + [0, 0], np.int32)
            scheduled = np.array([rng.randrange(0, 6) for _ in ids] + [0, 0], np.int32)
            make = plain_events if rng.random() < 0.6 else random_events
            early = make(rng, rng.randrange(0, 6)) if rng.random() < 0.8 else None
            late = make(rng, rng.randrange(0, 4)) if rng.random() < 0.5 else None
            want = now.apply_record_and_verify_step(early, ids, bt, computed, scheduled, late)
            pending = begun.begin_record_and_verify_step(early, ids, bt, computed, scheduled, late)
            got = pending.result()
            assert pending.done
            same_outcome(got, want)
            same_outcome(pending.result(), want)  # again on a second call
            assert state(begun) == state(now)
            refusals += len(want[0]) + len(want[1].refused) + len(want[2]) + len(want[3].refused)
    assert refusals > 30


def big_step(table, rows=2048, pages=32):
    """A prefill step of `rows` requests of `pages` pages each, every request claiming its row's
    pages in the step's early events and writing all of them: long enough on kvguard's thread to
    be still running when the caller's next line runs."""
    for r in range(rows):
        table.admit(r, "acme", pages * PAGE, PAGE)
    bt = np.array([list(range(1 + r * pages, 1 + (r + 1) * pages)) for r in range(rows)], np.int32)
    early = [("claim", r, bt[r].tolist()) for r in range(rows)]
    computed = np.zeros(rows, np.int32)
    scheduled = np.full(rows, pages * PAGE, np.int32)
    return early, list(range(rows)), bt, computed, scheduled


def big_table(rows=2048, pages=32):
    return kvguard.OwnershipTable(kvguard.PoolConfig(rows * pages + 1, PAGE, (pages + 1) * PAGE, reserved=[0]))


def test_every_call_after_a_begun_step_sees_it_applied():
    """The table is read as if the step had run on the calling thread: the call right after
    begin_record_and_verify_step waits for the step, whatever it reads (here: the rows the step
    judged, and the owner of the last page it claimed), and a second step begun before the
    first one's result is taken sees the first applied."""
    for _ in range(5):
        table = big_table()
        early, ids, bt, computed, scheduled = big_step(table)
        pending = table.begin_record_and_verify_step(early, ids, bt, computed, scheduled)
        assert sum(table.worker_row_counts()) == len(ids)
        assert table.page_info(len(ids) * 32).owner == len(ids) - 1
        got = pending.result()
        assert got[0] == [] and got[1].clean and got[3].clean
        # The next step reads the same rows again, incrementally.
        second = table.begin_record_and_verify_step(None, ids, bt, scheduled, np.zeros_like(scheduled))
        assert second.result()[3].clean
        assert table.worker_row_counts() == (len(ids), len(ids))


def test_a_begun_steps_refusals_are_its_own():
    """A row naming another request's page is refused in the begun step's verdicts, alone: its
    write into that page, then its read."""
    table = big_table(rows=64, pages=4)
    early, ids, bt, computed, scheduled = big_step(table, rows=64, pages=4)
    bt[7, 0] = bt[8, 0]  # request 7 reads request 8's first page
    verdicts = table.begin_record_and_verify_step(early, ids, bt, computed, scheduled).result()
    assert [(row, v.kind) for row, v in verdicts[1].refused] == [(7, "foreign_page")]
    assert verdicts[3].refused_rows == [7] and verdicts[0] == []


@pytest.mark.parametrize(
    "args",
    [
        ([("claim", "a", [3]), ("claim",)], ["a"], np.array([[1, 2, 0]], np.int32), np.array([0]), np.array([1])),
        ([("claim", "a", [3])], ["a"], np.zeros(3, np.int32), np.array([0]), np.array([1])),
        ([("claim", "a", [3])], ["a", "a"], np.array([[1, 2, 0]], np.int32), np.array([0, 0]), np.array([1, 1])),
        ([("claim", "a", [3])], ["a"], np.array([[1, 2, 0]], np.int32), np.array([0]), np.array([10**9])),
        ([("claim", "a", [3])], ["a"], np.array([[1, 2, 0]], np.int32), np.array([-3], np.int32), np.array([1], np.int32)),
    ],
)
def test_a_malformed_step_raises_when_begun_with_nothing_applied(table, args):
    table.admit("a", "acme", 8, 8)
    table.claim("a", [1, 2])
    before = table.snapshot().requests, table.counters()
    with pytest.raises(ValueError):
        table.begin_record_and_verify_step(*args)
    assert (table.snapshot().requests, table.counters()) == before
    assert table.page_info(3).state == "free"


def test_a_begun_step_let_go_of_still_runs_before_the_next_call():
    """A PendingStep dropped without result() waits for its step (which reads the block table
    the PendingStep held) and leaves the table as the step made it."""
    table = big_table(rows=512, pages=8)
    early, ids, bt, computed, scheduled = big_step(table, rows=512, pages=8)
    table.begin_record_and_verify_step(early, ids, bt.copy(), computed, scheduled)  # dropped at once
    assert table.page_info(512 * 8).owner == 511
    assert table.worker_row_counts() == (0, 512)


def _child_step(out):
    table = big_table(rows=64, pages=4)
    early, ids, bt, computed, scheduled = big_step(table, rows=64, pages=4)
    verdicts = table.begin_record_and_verify_step(early, ids, bt, computed, scheduled).result()
    out.put((verdicts[3].clean, table.page_info(64 * 4).owner))


def test_a_forked_child_runs_its_own_begun_steps():
    """vLLM's worker processes may be forked from a process that already ran kvguard's thread;
    a child has no such thread, and starts its own (before: its step never ran)."""
    table = big_table(rows=64, pages=4)
    early, ids, bt, computed, scheduled = big_step(table, rows=64, pages=4)
    assert table.begin_record_and_verify_step(early, ids, bt, computed, scheduled).result()[3].clean
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_step, args=(out,))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child's begun step never finished"
    assert out.get(timeout=5) == (True, 63)

