"""apply_events and record_and_verify_step judge exactly as the single calls they stand for:
random event streams and steps with violations, both policies, int32 and int64 block tables;
malformed input is a TypeError / ValueError with nothing applied, never a panic."""

import enum
import random

import numpy as np
import pytest

import kvguard

PAGE = 4
PAGES = 48


def tables(policy):
    config = kvguard.PoolConfig(PAGES, PAGE, 128, reserved=[0], policy=policy)
    return kvguard.OwnershipTable(config), kvguard.OwnershipTable(config)


REQS = ["a", "b", "c", 9]


def admitted_tables(policy, claims):
    """Two like tables (one for the reference calls, one for the fused call), REQS admitted
    ("c" of another tenant) and `claims` ({request: pages}) claimed in each."""
    pair = tables(policy)
    for t in pair:
        for r in REQS:
            t.admit(r, "acme" if r != "c" else "globex", 24, 24)
        for r, pages in claims.items():
            t.claim(r, pages)
    return pair


def random_rows(rng, n, dtype):
    """n block-table rows plus two spare ones, of owned, foreign, free and bad page ids."""
    bt = np.zeros((n + 2, 6), dtype=dtype)
    for i in range(n + 2):
        bt[i] = [rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 0, -1, PAGES + 1]) for _ in range(6)]
    return bt


def refusals_of(refused):
    return [(i, v.kind, str(v)) for i, v in refused]


def state(table):
    pages = [(i.state, i.owner, i.generation) for i in (table.page_info(p) for p in range(PAGES))]
    return pages, table.counters(), table.snapshot().requests, table.interned()


def one_by_one(table, events):
    """What apply_events stands for: each event through its single-event method."""
    refused = []
    for i, ev in enumerate(events):
        op, req = ev[0], ev[1]
        try:
            if op == "admit":
                table.admit(req, ev[2], ev[3], ev[4])
            elif op == "claim":
                table.claim(req, ev[2])
            elif op == "release":
                table.release(req)
            elif op == "preempt":
                table.preempt(req)
            elif op == "publish":
                table.publish_prefix(req, ev[2], ev[3])
            elif op == "attach":
                table.attach_prefix(req, ev[2])
            elif op == "detach":
                table.detach_prefix(req, ev[2])
            elif op == "evict":
                table.evict_prefix(ev[2])
            elif op == "release_pages":
                table.release_pages(req, ev[2])
        except kvguard.ViolationError as e:
            refused.append((i, e.kind, str(e)))
    return refused


def random_events(rng, n):
    reqs = ["a", "b", "c", 7, "zz"]
    events = []
    for _ in range(n):
        r = rng.choice(reqs)
        op = rng.choice(
            ["admit", "claim", "claim", "claim", "release", "preempt", "publish", "attach", "detach", "evict", "release_pages"]
        )
        if op == "admit":
            events.append((op, r, rng.choice(["acme", "globex", 3]), rng.randrange(1, 64), rng.randrange(0, 64)))
        elif op in ("claim", "release_pages"):
            events.append((op, r, [rng.randrange(0, PAGES + 2) for _ in range(rng.randrange(0, 3))]))
        elif op in ("release", "preempt"):
            events.append((op, r))
        elif op == "publish":
            p = rng.randrange(1, PAGES)
            events.append((op, r, p, (p,)))
        elif op == "evict":
            events.append((op, rng.choice([r, None]), rng.randrange(1, PAGES)))
        else:
            events.append((op, r, rng.randrange(1, PAGES)))
    return events


@pytest.mark.parametrize("policy", ["enforce", "report"])
def test_apply_events_judges_as_single_calls_in_order(policy):
    rng = random.Random(11)
    refusals = 0
    for _ in range(40):
        one, batch = tables(policy)
        for _ in range(4):
            events = random_events(rng, rng.randrange(0, 20))
            want = one_by_one(one, events)
            got = refusals_of(batch.apply_events(events))
            assert got == want
            assert state(batch) == state(one)
            refusals += len(got)
    assert refusals > 50  # the streams do refuse things


def test_apply_events_rejects_malformed_input_and_applies_nothing(table):
    table.admit("a", "acme", 8, 8)
    good = ("claim", "a", [1])
    before = state(table)
    for bad, err in [
        (5, TypeError),
        ([good, ["claim", "a", [2]]], TypeError),
        ([good, ()], ValueError),
        ([good, (3, "a")], TypeError),
        ([good, ("steal", "a")], ValueError),
        ([good, ("claim", "a")], ValueError),
        ([good, ("claim", "a", [-1])], ValueError),
        ([good, ("claim", "a", ["x"])], TypeError),
        ([good, ("claim", -1, [2])], ValueError),
        ([good, ("claim", 1.5, [2])], TypeError),
        ([good, ("admit", "b", "acme", -1, 0)], ValueError),
        ([good, ("publish", "a", -3, [1])], ValueError),
        ([good, ("evict", "a")], ValueError),
    ]:
        with pytest.raises(err):
            table.apply_events(bad)
        assert state(table) == before
    assert table.apply_events([good, ("claim", "a", np.array([2, 3], dtype=np.int32))]) == []
    assert [table.page_info(p).owner for p in (1, 2, 3)] == ["a", "a", "a"]


def reference_step(table, req_ids, bt, computed, scheduled, events):
    """What record_and_verify_step stands for: the slot mapping built as vLLM's kernel does, then
    record_step_writes, the events, verify_step."""
    n = len(req_ids)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(scheduled[:n], out=qsl[1:])
    rows = np.repeat(np.arange(n), scheduled[:n])
    pos = computed[:n].astype(np.int64)[rows] + (np.arange(int(qsl[-1])) - qsl[rows])
    col = np.minimum(pos // PAGE, bt.shape[1] - 1)
    slots = bt[rows, col].astype(np.int64) * PAGE + pos % PAGE
    w = table.record_step_writes(req_ids, slots, qsl)
    refused = one_by_one(table, events or [])
    r = table.verify_step(req_ids, bt, computed[:n].astype(np.int64) + scheduled[:n])
    return w, refused, r


def verdict(v):
    return [(row, x.kind, str(x)) for row, x in v.refused]


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_record_and_verify_step_judges_as_the_calls_it_fuses(policy, dtype):
    rng = random.Random(5)
    refusals = 0
    for _ in range(30):
        one, batch = admitted_tables(policy, {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7, 8], 9: [10]})
        written = {r: 0 for r in REQS}
        for _ in range(4):
            n = rng.randrange(0, 5)
            ids = [rng.choice(REQS + ["ghost"]) for _ in range(n)]
            bt = random_rows(rng, n, dtype)
            computed = np.array([written.get(r, 0) + rng.choice([0, 0, 0, 2]) for r in ids] + [0, 0], np.int32)
            scheduled = np.array([rng.randrange(0, 6) for _ in ids] + [0, 0], np.int32)
            late = random_events(rng, rng.randrange(0, 4)) if rng.random() < 0.5 else None
            want = reference_step(one, ids, bt, computed, scheduled, late)
            got = batch.record_and_verify_step(ids, bt, computed, scheduled, late)
            assert verdict(got[0]) == verdict(want[0])
            assert refusals_of(got[1]) == want[1]
            assert verdict(got[2]) == verdict(want[2])
            assert state(batch) == state(one)
            refusals += len(got[0].refused) + len(got[1]) + len(got[2].refused)
            for r, c, s in zip(ids, computed, scheduled):
                written[r] = max(written.get(r, 0), int(c) + int(s))
    assert refusals > 30


def test_record_and_verify_step_rejects_bad_arrays(table):
    table.admit("a", "acme", 8, 8)
    table.claim("a", [1, 2])
    bt = np.array([[1, 2, 0]], dtype=np.int32)
    ok = (["a"], bt, np.array([0]), np.array([5]))
    w, refused, r = table.record_and_verify_step(*ok)
    assert w.clean and refused == [] and r.clean
    for args, err in [
        ((["a"], np.zeros(3, np.int32), np.array([0]), np.array([1])), ValueError),  # 1-D table
        ((["a"], np.zeros((1, 3), np.float32), np.array([0]), np.array([1])), TypeError),
        ((["a", "a"], bt, np.array([0, 0]), np.array([1, 1])), ValueError),  # rows < requests
        ((["a"], bt, np.array([-1]), np.array([1])), ValueError),
        ((["a"], bt, np.array([0]), np.array([], dtype=np.int64)), ValueError),
        ((["a"], bt, np.array([0]), np.array([10**9])), ValueError),  # more than a row addresses
        ((["a"], bt, np.array([0]), np.array([1]), [("nope",)]), ValueError),
        (([1.5], bt, np.array([0]), np.array([1])), TypeError),
    ]:
        with pytest.raises(err):
            table.record_and_verify_step(*args)
    # A position past the row's width takes its last entry (vLLM's kernel would read past the
    # row): refused, not a crash.
    w, _, r = table.record_and_verify_step(["a"], bt, np.array([40]), np.array([2]))
    assert not w.clean and not r.clean


@pytest.mark.parametrize("policy", ["enforce", "report"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_apply_record_and_verify_step_judges_as_the_calls_it_fuses(policy, dtype):
    """The whole worker step in one call is apply_events(early), then record_and_verify_step
    with the late events: the same refusals, the same table after, with and without early
    events that admit or release (the requests re-read after them)."""
    rng = random.Random(11)
    refusals = 0
    for _ in range(30):
        one, batch = admitted_tables(policy, {"a": [1, 2, 3], "b": [4, 5]})
        for _ in range(4):
            n = rng.randrange(0, 5)
            ids = [rng.choice(REQS + ["ghost", "zz"]) for _ in range(n)]
            bt = random_rows(rng, n, dtype)
            computed = np.array([rng.choice([0, 0, 2, 5]) for _ in ids] + [0, 0], np.int32)
            scheduled = np.array([rng.randrange(0, 6) for _ in ids] + [0, 0], np.int32)
            early = random_events(rng, rng.randrange(0, 6)) if rng.random() < 0.7 else None
            late = random_events(rng, rng.randrange(0, 4)) if rng.random() < 0.5 else None
            want_early = one_by_one(one, early or [])
            want = reference_step(one, ids, bt, computed, scheduled, late)
            got = batch.apply_record_and_verify_step(early, ids, bt, computed, scheduled, late)
            assert refusals_of(got[0]) == want_early
            assert verdict(got[1]) == verdict(want[0])
            assert refusals_of(got[2]) == want[1]
            assert verdict(got[3]) == verdict(want[2])
            assert state(batch) == state(one)
            refusals += len(got[0]) + len(got[1].refused) + len(got[2]) + len(got[3].refused)
    assert refusals > 30


def test_apply_record_and_verify_step_checks_everything_first(table):
    """A malformed event (early or late) or array raises with nothing applied."""
    table.admit("a", "acme", 8, 8)
    table.claim("a", [1, 2])
    bt = np.array([[1, 2, 0]], dtype=np.int32)
    before = table.snapshot().requests, table.counters()
    claim = ("claim", "a", [3])
    for args, err in [
        (([claim], ["a"], bt, np.array([0]), np.array([1]), [("nope",)]), ValueError),
        (([claim, ("claim",)], ["a"], bt, np.array([0]), np.array([1])), ValueError),
        (([claim], ["a"], np.zeros(3, np.int32), np.array([0]), np.array([1])), ValueError),
        (([claim], ["a", "a"], bt, np.array([0, 0]), np.array([1, 1])), ValueError),
        (([claim], ["a"], bt, np.array([0]), np.array([10**9])), ValueError),
    ]:
        with pytest.raises(err):
            table.apply_record_and_verify_step(*args)
        assert (table.snapshot().requests, table.counters()) == before
        assert table.page_info(3).state == "free"
    # vLLM's int32 counts are read in place: a negative one is named, and nothing is applied.
    for computed, scheduled, named in [([0, -3], [1, 1], r"num_computed_tokens\[1\] is -3"), ([0], [-1], "num_scheduled_tokens")]:
        c, s = np.array(computed, np.int32), np.array(scheduled, np.int32)
        with pytest.raises(ValueError, match=named):
            table.apply_record_and_verify_step([claim], ["a"] * len(computed), np.zeros((2, 3), np.int32), c, s)
        assert (table.snapshot().requests, table.counters()) == before
        assert table.page_info(3).state == "free"
    refused_early, w, refused_late, r = table.apply_record_and_verify_step([claim], ["a"], bt, np.array([0]), np.array([5]))
    assert refused_early == [] and w.clean and refused_late == [] and r.clean
    assert table.page_info(3).owner == "a"


class Kind(enum.StrEnum):
    """Event names as kvguard.vllm's recorder hands them: members of a str enum."""

    CLAIM = "claim"
    PUBLISH = "publish"


def plain_events(rng, n):
    """Events that admit and release nothing (a decode step's kind), in the plain form a
    recorder builds, with now and then a field in another form."""
    reqs = ["a", "b", "c", 9, "zz"]
    events = []
    for _ in range(n):
        r = rng.choice(reqs)
        op = rng.choice(["claim", "claim", "claim", "publish", "publish", "attach", "detach", "evict", "preempt", "release_pages"])
        if op in ("claim", "release_pages"):
            pages = [rng.randrange(0, PAGES + 2) for _ in range(rng.randrange(0, 3))]
            events.append((Kind.CLAIM if op == "claim" and rng.random() < 0.5 else op, r, pages))
        elif op == "publish":
            p = rng.randrange(1, PAGES)
            events.append((Kind.PUBLISH if rng.random() < 0.5 else op, r, p, (p,) if rng.random() < 0.5 else [p]))
        elif op == "evict":
            events.append((op, rng.choice([r, None]), rng.randrange(1, PAGES)))
        elif op == "preempt":
            events.append((op, r))
        else:
            events.append((op, r, rng.randrange(1, PAGES)))
    return events


def other_form(rng, events):
    """The same events with one field in a form only the full parse reads (a numpy int, a bool
    for page 0 or 1, a page array), or the list handed as an iterator."""
    if not events or rng.random() < 0.3:
        return iter(events)
    events = list(events)
    k = rng.randrange(len(events))
    ev = list(events[k])
    if ev[0] in ("claim", "release_pages") and ev[2]:
        first = ev[2][0]
        other = bool(first) if first in (0, 1) else np.int64(first)
        ev[2] = np.array(ev[2], dtype=np.int64) if rng.random() < 0.5 else [other] + ev[2][1:]
    elif ev[0] in ("publish", "attach", "detach", "evict"):
        ev[2] = np.int64(ev[2])
    elif isinstance(ev[1], int):
        ev[1] = np.int64(ev[1])
    else:
        return iter(events)
    events[k] = tuple(ev)
    return events


@pytest.mark.parametrize("policy", ["enforce", "report"])
def test_a_decode_steps_events_judge_alike_in_every_form(policy):
    """A step's events that admit and release nothing are read straight into the core's batch
    when in the plain form (exact tuples, ints and strs, str-enum names); the same events in any
    other form are parsed in full. Both judge as the single calls, with the same table after."""
    rng = random.Random(23)
    refusals = 0
    for _ in range(30):
        claims = {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7], 9: [10]}
        one, plain = admitted_tables(policy, claims)
        _, other = admitted_tables(policy, claims)
        for _ in range(4):
            n = rng.randrange(0, 4)
            ids = [rng.choice(REQS) for _ in range(n)]
            bt = random_rows(rng, n, np.int32)
            computed = np.array([rng.choice([0, 2]) for _ in ids] + [0, 0], np.int32)
            scheduled = np.array([rng.randrange(0, 4) for _ in ids] + [0, 0], np.int32)
            early = plain_events(rng, rng.randrange(0, 8))
            late = plain_events(rng, rng.randrange(0, 4))
            want_early = one_by_one(one, early)
            want = reference_step(one, ids, bt, computed, scheduled, late)
            for table, e, l in [(plain, early, late), (other, other_form(rng, early), other_form(rng, late))]:
                got = table.apply_record_and_verify_step(e, ids, bt, computed, scheduled, l)
                assert refusals_of(got[0]) == want_early
                assert verdict(got[1]) == verdict(want[0])
                assert refusals_of(got[2]) == want[1]
                assert verdict(got[3]) == verdict(want[2])
                assert state(table) == state(one)
            refusals += len(want_early) + len(want[1])
    assert refusals > 30


@pytest.mark.parametrize(
    "event, err",
    [
        (("claim", "a", [2**32]), ValueError),  # a page id past 32 bits
        (("claim", "a", [-1]), ValueError),
        (("claim", "a", [1.0]), TypeError),
        (("claim", -1, [3]), ValueError),
        (("claim", 2**63, [3]), ValueError),
        (("claim", True, [3]), TypeError),
        (("claim", "a", [3], "extra"), ValueError),
        (("publish", "a", -1, [3]), ValueError),
        (("evict", 1.5, 3), TypeError),
        (("preempt",), ValueError),
        ((1, "a"), TypeError),
        (["claim", "a", [3]], TypeError),  # an event must be a tuple
    ],
)
def test_a_plain_looking_malformed_event_raises_and_applies_nothing(table, event, err):
    table.admit("a", "acme", 8, 8)
    table.claim("a", [1, 2])
    bt = np.array([[1, 2, 0]], dtype=np.int32)
    before = table.snapshot().requests, table.counters()
    for early, late in [([("claim", "a", [4]), event], None), ([("claim", "a", [4])], [event])]:
        with pytest.raises(err):
            table.apply_record_and_verify_step(early, ["a"], bt, np.array([0]), np.array([1]), late)
        assert (table.snapshot().requests, table.counters()) == before
        assert table.page_info(4).state == "free"


def test_an_event_naming_a_remembered_request_reads_its_id_as_it_is_now():
    """vLLM's recorder and runner name a request by the same str object, so the worker step
    finds an event's request by the address of an id its req_ids held. That id is read as it is
    now: a request that ended and was admitted again under the same object claims as the new
    request; a name unknown at the last step and admitted since claims as the request admitted."""
    t = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE, 128, reserved=[0]))
    ids = ["cmpl-" + "a" * 30, "cmpl-" + "b" * 30]  # objects kept, as vLLM's input_batch.req_ids
    t.admit(ids[0], "acme", 24, 24)
    t.claim(ids[0], [1])
    bt = np.array([[1, 0], [0, 0]], dtype=np.int32)
    counts = np.zeros(2, np.int32)
    _, _, _, r = t.apply_record_and_verify_step(None, ids, bt, counts, counts)
    assert r.refused_rows == [1]  # both remembered: ids[0] live, ids[1] unknown (refused)
    t.release(ids[0])
    t.admit(ids[0], "globex", 24, 24)  # the same object, a new request
    t.admit(ids[1], "acme", 24, 24)
    early = [("claim", ids[0], [2]), ("claim", ids[1], [3])]
    bt = np.array([[2, 0], [3, 0]], dtype=np.int32)
    refused_early, w, _, r = t.apply_record_and_verify_step(early, ids, bt, counts, np.ones(2, np.int32))
    assert refused_early == [] and w.clean and r.clean
    assert (t.page_info(2).owner, t.page_info(3).owner) == (ids[0], ids[1])
