"""``kvguard.device_verdicts.DeviceVerdicts``: the device's verdicts reach the host with no wait
where a step's checks are queued, each record handed out once, none later than the output of
the step it belongs to. Driven against a stand-in ring whose copies land when the test says."""

import threading

import pytest

from kvguard.device_verdicts import DeviceVerdicts


class Ring:
    """A device's violation ring: a step's checks add records (``check``); ``begin_drain`` copies
    what is there; the copy lands when ``landed`` is True (``finish_drain(wait=True)`` waits for
    it, so it always lands then)."""

    def __init__(self) -> None:
        self.records: list[str] = []
        self.copy: list[str] | None = None
        self.landed = True
        self.calls: list[tuple] = []
        self.lock = threading.Lock()  # the device's order: a check before the copy behind it
        # ``DeviceGuard.findings_lost``: read when a copy is finished; the device's count so
        # far, and the count the copy in flight saw.
        self.findings_lost = 0
        self.lost_on_device = 0
        self.copy_lost = 0

    def check(self, *records: str, lost: int = 0) -> None:
        with self.lock:
            self.records.extend(records)
            self.lost_on_device += lost

    def begin_drain(self, *, stream: int) -> None:
        assert self.copy is None, "one copy in flight at a time"
        self.calls.append(("begin_drain", stream))
        with self.lock:
            self.copy, self.records = self.records, []
            self.copy_lost = self.lost_on_device

    def finish_drain(self, table, *, stream: int, wait: bool = True):
        self.calls.append(("finish_drain", stream, wait))
        assert table == "table"
        if self.copy is None or (not wait and not self.landed):
            return None
        out, self.copy = self.copy, None
        self.findings_lost = self.copy_lost
        return out


def step(verdicts: DeviceVerdicts, ring: Ring, *records: str, stream: int = 5, readers=None, lost: int = 0) -> None:
    ring.check(*records, lost=lost)
    verdicts.queued("table", stream=stream, readers=readers)


def test_each_steps_copy_is_queued_behind_its_checks_and_never_waited_for_there():
    ring = Ring()
    v = DeviceVerdicts(ring)
    for i in range(1, 6):
        step(v, ring, f"step {i}")
        assert v.checked == i
        assert ring.calls[-1] == ("begin_drain", 5), "a copy right behind the step's checks"
    assert all(not c[2] for c in ring.calls if c[0] == "finish_drain"), "a wait where the checks are queued"
    # Each landed copy was taken by the next step: the outputs get every record, in order, once.
    assert v.through("table", 3) == ["step 1", "step 2", "step 3", "step 4"]
    assert v.through("table", 4) == []
    assert v.through("table") == ["step 5"]
    assert v.through("table") == []
    assert ring.copy is None and ring.records == []


def test_a_copy_that_has_not_landed_is_left_and_the_next_steps_records_ride_a_later_copy():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring, "a")
    ring.landed = False
    step(v, ring, "b")  # the copy of step 1 in flight, not landed: left alone, no second copy
    assert ring.calls[-1] == ("finish_drain", 5, False)
    assert ring.records == ["b"] and ring.copy == ["a"]
    # Step 1's output waits for step 1's copy only.
    assert v.through("table", 1) == ["a"]
    assert ring.calls[-1] == ("finish_drain", 5, True) and ring.records == ["b"]
    # Step 2's output: no copy covers it, one is queued and finished.
    assert v.through("table", 2) == ["b"]
    assert ring.calls[-2:] == [("begin_drain", 5), ("finish_drain", 5, True)]
    assert v.taken_through == 2


def test_an_output_never_waits_for_a_copy_it_does_not_need():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring)
    step(v, ring)
    assert v.taken_through == 1
    calls = len(ring.calls)
    assert v.through("table", 1) == []
    assert len(ring.calls) == calls, "step 1's records were taken already"


def test_the_stream_of_the_last_step_carries_the_copies():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring, "x", stream=11)
    ring.landed = False
    step(v, ring, "y", stream=12)
    assert v.through("table") == ["x", "y"]
    assert ring.calls[-1] == ("finish_drain", 12, True)


def test_steps_queued_by_one_thread_and_outputs_read_by_another_lose_nothing():
    ring = Ring()
    v = DeviceVerdicts(ring)
    got: list[str] = []
    n = 400

    def checker():
        for i in range(n):
            ring.check(f"r{i}")
            v.queued("table", stream=1)

    def reader():
        while len(got) < n:
            got.extend(v.through("table"))

    t1, t2 = threading.Thread(target=checker), threading.Thread(target=reader)
    t2.start()
    t1.start()
    t1.join()
    t2.join(timeout=30)
    assert got == [f"r{i}" for i in range(n)]


def test_a_lost_finding_refuses_every_reader_of_the_steps_its_copy_covers_and_no_other():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring, "r1", readers=[1, 2])
    step(v, ring, readers=[3, 4], lost=1)  # a flagged sequence whose record the ring dropped
    assert v.through("table", 1) == ["r1"]
    assert v.take_unresolved() == [], "step 1's copy saw no loss"
    step(v, ring, readers=[5])
    assert v.through("table") == []
    assert v.take_unresolved() == [3, 4], "the step whose finding was lost: each of its readers"
    assert v.take_unresolved() == [], "each handed out once"


def test_a_loss_found_by_a_copy_that_covers_several_steps_refuses_the_readers_of_each():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring, readers=[1])
    ring.landed = False
    step(v, ring, readers=[2], lost=2)  # rides a later copy: step 1's has not landed
    step(v, ring, readers=[3])
    ring.landed = True
    assert v.through("table", 1) == [] and v.take_unresolved() == []
    assert v.through("table", 3) == []
    assert v.take_unresolved() == [2, 3], "the copy covering steps 2 and 3 cannot tell them apart"


def test_a_lost_finding_of_a_step_whose_readers_are_unknown_stops_rather_than_refuse_nobody():
    ring = Ring()
    v = DeviceVerdicts(ring)
    step(v, ring, lost=1)
    with pytest.raises(RuntimeError, match="readers of step"):
        v.through("table")
