"""Bad or unusual input through the public API: a typed error or the same verdict, never a panic,
never a half-applied call. A token-slot table in any dtype or layout gives the verdicts (and the
table changes) of the same table as C-contiguous int32; apply_record_and_verify_step checks every
req_ids entry before it applies anything; the Recorder keeps the order its Replayer requires."""

import logging
import random

import numpy as np
import pytest

import kvguard

logging.getLogger("kvguard").setLevel(logging.CRITICAL)

NP = 24


def layouts(a):
    """The same int32 table as int64, Fortran order, and two strided views."""
    wide = np.full((a.shape[0], a.shape[1] * 2 + 1), 7, a.dtype)
    wide[:, : a.shape[1]] = a
    rows = np.full((a.shape[0] * 2, a.shape[1]), 7, a.dtype)
    rows[::2] = a
    return {
        "int64": a.astype(np.int64),
        "fortran": np.asfortranarray(a),
        "fortran-int64": np.asfortranarray(a.astype(np.int64)),
        "column-view": wide[:, : a.shape[1]],
        "row-step-2": rows[::2],
    }


def outcome(call):
    try:
        got = call()
    except (kvguard.Error, ValueError, TypeError) as e:
        return ("raised", type(e).__name__, str(e))
    if isinstance(got, kvguard.StepVerdict):
        return [(i, v.kind, str(v)) for i, v in got.refused]
    if isinstance(got, tuple) and isinstance(got[1], kvguard.StepVerdict):
        return (got[0], [(i, v.kind, str(v)) for i, v in got[1].refused])
    return got


def state(t):
    pages = [(p, i.state, i.owner, i.written_slots) for p in range(NP) for i in [t.page_info(p)]]
    return pages, t.counters()


def fill(ps, seed, policy):
    """A table whose requests 1..4 own a few pages each, written in part or in full."""
    rng = random.Random(seed)
    t = kvguard.OwnershipTable(kvguard.PoolConfig(NP, ps, ps * 8, reserved=[0], policy=policy), audit=False)
    free = list(range(1, NP))
    rng.shuffle(free)
    owned = {}
    for r in range(1, 5):
        t.admit(r, r % 2, ps * 4, ps * 4)
        k = rng.randint(0, 4)
        owned[r], free = free[:k], free[k:]
        if owned[r]:
            t.claim(r, owned[r])
            for p in owned[r]:
                t.record_write(r, p, 0, rng.choice([ps, ps, rng.randint(0, ps)]))
    return t, owned


def slot_table(rng, ps, owned, R, W):
    """R rows of W token slots, each a request's own slots in order, some entries wrong; and
    each row's request."""
    a = np.full((R, W), -1, np.int32)
    owners = [rng.randint(1, 4) for _ in range(R)]
    for row, r in enumerate(owners):
        slots = [p * ps + o for p in owned[r] for o in range(ps)]
        m = min(W, len(slots))
        a[row, :m] = slots[:m]
        for _ in range(rng.choice([0, 0, 1, 2])):
            a[row, rng.randrange(W)] = rng.randint(-2, NP * ps + 2)
    return a, owners


def test_a_window_past_the_last_whole_page_of_a_converted_row_is_judged_not_a_panic():
    # page size 4, a row of 6 slots (not whole pages), the window starting past its last whole
    # page: the conversion's window arithmetic underflowed ("capacity overflow" panic).
    t = kvguard.OwnershipTable(kvguard.PoolConfig(16, 4, 32, reserved=[0]))
    t.admit(1, 0, 8, 0)
    t.claim(1, [2, 3])
    r2t = np.array([[8, 9, 10, 11, 12, 13]], np.int32)
    base = outcome(lambda: t.check_step_window([1], r2t, [0], [8], [8], token_slots=True))
    for name, arr in layouts(r2t).items():
        assert outcome(lambda: t.check_step_window([1], arr, [0], [8], [8], token_slots=True)) == base, name
    for from_tokens in (8, 12):
        base = None
        for arr in [r2t, *layouts(r2t).values()]:
            checked = np.array([from_tokens], np.int64)
            got = outcome(
                lambda: t.check_decode_forward(
                    np.array([1], np.int64), np.array([1], np.int64), checked, arr, np.array([0]), np.array([8]),
                    np.array([13], np.int64),
                )
            )
            base = base or (got, checked.tolist())
            assert (got, checked.tolist()) == base


def test_a_window_of_a_row_too_short_is_refused_in_every_layout():
    # The read wants 8 tokens (two pages) of a row of one page: refused in place as
    # block_table_too_short; a converted row passed it when the window was empty.
    t = kvguard.OwnershipTable(kvguard.PoolConfig(16, 4, 32, reserved=[0]))
    t.admit(1, 0, 8, 0)
    t.claim(1, [2])
    t.record_write(1, 2, 0, 4)
    r2t = np.array([[8, 9, 10, 11]], np.int32)
    for frm in (0, 4, 8, 12):
        for name, arr in [("int32", r2t), *layouts(r2t).items()]:
            v = t.check_step_window([1], arr, [0], [8], [frm], token_slots=True)
            assert [x.kind for x in v.violations] == ["block_table_too_short"], (frm, name)
    # check_decode_forward: the window stops the step, row_checked stays where it was.
    for name, arr in [("int32", r2t), *layouts(r2t).items()]:
        checked = np.array([8], np.int64)
        got = t.check_decode_forward(
            np.array([1], np.int64), np.array([1], np.int64), checked, arr, np.array([0]), np.array([8]),
            np.array([11], np.int64),
        )
        assert got == ("window", None) and checked.tolist() == [8], name


@pytest.mark.parametrize("ps", [1, 2, 3, 4])
def test_every_layout_of_a_token_slot_table_gives_the_int32_verdicts_and_table_changes(ps):
    rng = random.Random(1000 + ps)
    compared = 0
    for case in range(80):
        seed = rng.randrange(1 << 30)
        R, W = rng.randint(1, 5), rng.randint(1, 3 * ps + 5)
        n = rng.randint(1, 4)
        rows = [rng.randrange(R) for _ in range(n)]
        lens = [rng.randint(0, W + ps + 2) for _ in range(n)]
        frm = [rng.randint(0, W + ps + 2) for _ in range(n)]
        checked0 = np.array([rng.randint(0, W + 3) for _ in range(R)], np.int64)
        policy = rng.choice(["enforce", "report"])
        t, owned = fill(ps, seed, policy)
        a, owners = slot_table(random.Random(seed), ps, owned, R, W)
        reqs = [owners[r] if rng.random() < 0.8 else rng.randint(0, 5) for r in rows]
        loc = np.array(
            [a[r, min(max(l - 1, 0), W - 1)] if rng.random() < 0.8 else rng.randint(-1, NP * ps) for r, l in zip(rows, lens)],
            np.int64,
        )
        keys = np.array([o if rng.random() < 0.8 else rng.randint(1, 4) for o in owners], np.int64)

        def run(arr):
            # A fresh table each layout: judged calls and decode writes change it.
            t, _ = fill(ps, seed, policy)
            checked = checked0.copy()
            out = [
                outcome(lambda: t.check_step_rows(reqs, arr, rows, lens, token_slots=True)),
                outcome(lambda: t.check_step_window(reqs, arr, rows, lens, frm, token_slots=True)),
                outcome(lambda: t.verify_step_rows(reqs, arr, rows, lens, token_slots=True)),
                outcome(lambda: t.check_decode_forward(keys, np.ones(R, np.int64), checked, arr, np.array(rows), np.array(lens), loc)),
            ]
            return out, checked.tolist(), state(t)

        base = run(a)
        for name, arr in layouts(a).items():
            assert run(arr) == base, (case, name, a.tolist(), rows, lens, frm, checked0.tolist())
            compared += 1
    assert compared == 80 * 5


@pytest.mark.parametrize("bad", [-1, 1.5, 2**64, 2**63, None, object()])
@pytest.mark.parametrize("container", [list, tuple])
def test_apply_record_and_verify_step_checks_every_req_id_before_the_early_events(bad, container):
    t = kvguard.OwnershipTable(kvguard.PoolConfig(16, 4, 32, reserved=[0]))
    t.admit(1, 0, 4, 4)
    t.claim(1, [3])
    t.admit(7, 0, 4, 4)
    t.claim(7, [5])
    before = (t.snapshot().owned, t.counters(), [t.page_info(p).state for p in range(16)])
    bt = np.zeros((2, 4), np.int32)
    with pytest.raises((TypeError, ValueError)):
        t.apply_record_and_verify_step([("release", 7), ("admit", 8, 0, 4, 4)], container([1, bad]), bt, [0, 0], [0, 0])
    assert t.request_info(7) is not None and t.request_info(8) is None
    assert (t.snapshot().owned, t.counters(), [t.page_info(p).state for p in range(16)]) == before


def test_apply_record_and_verify_step_checks_a_req_ids_array_before_the_early_events():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(16, 4, 32, reserved=[0]))
    t.admit(7, 0, 4, 4)
    t.claim(7, [5])
    bt = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError):
        t.apply_record_and_verify_step([("release", 7)], np.array([1, -1], np.int64), bt, [0, 0], [0, 0])
    assert t.request_info(7) is not None and t.page_info(5).state == "owned"
    # Well-formed ids, str ones included, still read as the early events leave them.
    refused_early, _, _, reads = t.apply_record_and_verify_step(
        [("release", 7), ("admit", "x", 0, 4, 4), ("claim", "x", [6])], ["x"], np.array([[6]], np.int32), [0], [0]
    )
    assert refused_early == [] and reads.clean and t.request_info(7) is None


def test_the_recorder_refuses_events_out_of_the_traces_order():
    cfg = kvguard.PoolConfig(16, 4, 32, reserved=[0])
    r = kvguard.Recorder()
    with pytest.raises(kvguard.TraceError, match="before the pool event"):
        r.admit(1, "t", 4, 4)
    with pytest.raises(kvguard.TraceError, match="before the pool event"):
        r.end()
    r.pool(cfg)
    with pytest.raises(kvguard.TraceError, match="second pool"):
        r.pool(kvguard.PoolConfig(8, 2, 8))
    r.admit(1, "t", 4, 4)
    r.end()
    r.end()  # once: nothing more written
    for call in (lambda: r.admit(5, "t", 1, 1), lambda: r.alloc(1, [1]), lambda: r.read(1, [1], 4), lambda: r.pool(cfg)):
        with pytest.raises(kvguard.TraceError, match="after the end event"):
            call()
    assert r.events == 3
    p = kvguard.Replayer()
    assert p.replay(r.text()) == []
    assert p.summary()["events"] == 3
