"""``kvguard.device_verdicts.DeviceVerdicts``: the device's verdicts reach the host with no wait
where a step's checks are queued, each record handed out once, none later than the output of
the step it belongs to. Driven against a stand-in ring whose copies land when the test says."""

import threading

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

    def check(self, *records: str) -> None:
        with self.lock:
            self.records.extend(records)

    def begin_drain(self, *, stream: int) -> None:
        assert self.copy is None, "one copy in flight at a time"
        self.calls.append(("begin_drain", stream))
        with self.lock:
            self.copy, self.records = self.records, []

    def finish_drain(self, table, *, stream: int, wait: bool = True):
        self.calls.append(("finish_drain", stream, wait))
        assert table == "table"
        if self.copy is None or (not wait and not self.landed):
            return None
        out, self.copy = self.copy, None
        return out


def step(verdicts: DeviceVerdicts, ring: Ring, *records: str, stream: int = 5) -> None:
    ring.check(*records)
    verdicts.queued("table", stream=stream)


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
