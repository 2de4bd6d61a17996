"""A :class:`~kvguard.DeviceGuard`'s verdicts brought to the host with no wait inside a step.

An engine's step queues the device's checks on its stream, then its model. The checks' records
(the device's violation ring) reach the host by a copy; a synchronisation there would wait for
the model too, and under an engine's overlapping schedule (SGLang's overlap loop, vLLM's
asynchronous scheduling) serialise the host's work with the GPU's. So the copy is queued right
behind each step's checks, before its model (:meth:`DeviceVerdicts.queued`), and finished where
the engine builds that step's output (:meth:`DeviceVerdicts.through`), where it has waited for
the step itself: the copy then waits only for the checks queued before it. Both SGLang's plugin
(``kvguard.sglang.forward.DeviceRowCheck``) and vLLM's V2 runner (``kvguard.vllm.device``) keep
their copies through it.

One copy is in flight at a time. A step whose checks are queued while a copy is in flight
finishes that copy if it has landed (never waiting: ``finish_drain(wait=False)``) and queues its
own; if it has not landed, the step's records ride a later copy (the one a later step queues, or
the one :meth:`~DeviceVerdicts.through` queues when none covers the step it needs: the one case
that waits for what was queued since). Records taken early are kept until
:meth:`~DeviceVerdicts.through` hands them out, so none is lost and none waits for an output
later than its own.

A finding the device could not hand over (``DeviceGuard.findings_lost`` grew: more flagged
sequences between two copies than half the ring holds, a torn record, a record of a kind this
build does not know) names no request, though the device fenced its sequence. The host then
cannot tell which request to refuse, and fails closed: every reader of the steps that copy
covers (``queued(readers=...)``) is handed out by :meth:`~DeviceVerdicts.take_unresolved`, to be
refused as the finding's request would have been.

Example, with a stand-in for the device (a real one needs a GPU)::

    from kvguard.device_verdicts import DeviceVerdicts

    class Ring:  # copies at once, as if every copy had landed
        def __init__(self): self.records, self.copy = [], None
        def begin_drain(self, *, stream): self.copy, self.records = self.records, []
        def finish_drain(self, table, *, stream, wait=True):
            out, self.copy = self.copy, None
            return out

    ring = Ring()
    ring.findings_lost = 0                          # DeviceGuard.findings_lost
    verdicts = DeviceVerdicts(ring)
    ring.records.append("step 1 refused")
    verdicts.queued(stream=7)                       # step 1's checks queued, its copy behind them
    verdicts.queued(stream=7)                       # step 2: step 1's copy landed, taken; a new one
    assert verdicts.through(None, 1) == ["step 1 refused"]
    assert verdicts.through(None, 2) == []
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class DeviceVerdicts:
    """The copies of ``device_guard``'s violation ring to the host, one step's checks at a time
    (see the module's documentation). Safe to call from two threads: a step's checks queued by
    one, its output read by another (some of vLLM's executors)."""

    def __init__(self, device_guard: Any) -> None:
        self.device_guard = device_guard
        #: Steps whose checks were queued (the last one's number).
        self.checked = 0
        #: The last step whose records were taken from the device.
        self.taken_through = 0
        #: The stream of the last step's checks (copies are queued and finished on it).
        self.stream = 0
        # The step the copy in flight covers (None: no copy in flight); records taken early.
        self._copy_of: int | None = None
        self._found: list[Any] = []
        # The readers of each step not taken yet; the device's lost findings last seen; the
        # readers of steps whose findings were lost, not handed out yet.
        self._readers: dict[int, Sequence[Any] | None] = {}
        self._lost_seen = 0
        self._unresolved: list[Any] = []
        self._lock = threading.Lock()

    def queued(self, table: Any = None, *, stream: int, readers: Sequence[Any] | None = None) -> None:
        """A step's checks were just queued on ``stream`` (the step is :attr:`checked` after
        it): the ring's copy is queued behind them, unless a copy in flight has not landed yet
        (finished here if it has, with ``table``, never waited for). ``readers``: the step's
        readers as ``set_readers`` named them (kept, not copied), the requests refused if a
        finding of the step is lost; without them such a loss raises."""
        dg = self.device_guard
        with self._lock:
            self.checked += 1
            self.stream = stream
            self._readers[self.checked] = readers
            if self._copy_of is not None:
                records = dg.finish_drain(table, stream=stream, wait=False)
                if records is None:
                    return
                self._took(records, self._copy_of)
            dg.begin_drain(stream=stream)
            self._copy_of = self.checked

    def through(self, table: Any, step: int | None = None) -> list[Any]:
        """The device's records of every step up to ``step`` (None: every step queued so far)
        not handed out yet, recorded in ``table`` as ``finish_drain`` records them: the copy in
        flight finished (it waits only for the checks queued before it), and another queued and
        finished if that one does not reach ``step``."""
        dg = self.device_guard
        with self._lock:
            step = self.checked if step is None else step
            while self.taken_through < step:
                if self._copy_of is None:
                    dg.begin_drain(stream=self.stream)
                    self._copy_of = self.checked
                covered, self._copy_of = self._copy_of, None
                self._took(dg.finish_drain(table, stream=self.stream), covered)
            found, self._found = self._found, []
        return found

    def take_unresolved(self) -> list[Any]:
        """The readers of every step taken so far whose findings the device lost (see the
        module's documentation), each handed out once: refuse them."""
        with self._lock:
            out, self._unresolved = self._unresolved, []
        return out

    def _took(self, records: Any, covered: int) -> None:
        before = self.taken_through
        self.taken_through = max(before, covered)
        self._found.extend(records or ())
        lost = int(self.device_guard.findings_lost)
        steps = range(before + 1, self.taken_through + 1)
        if lost > self._lost_seen:
            self._lost_seen = lost
            unknown = [s for s in steps if self._readers.get(s) is None]
            if unknown:
                raise RuntimeError(
                    f"kvguard: the device lost {lost} finding(s) and the readers of step(s) {unknown} "
                    "are unknown: no request can be refused in their place"
                )
            for s in steps:
                self._unresolved.extend(self._readers[s])  # type: ignore[arg-type]
        for s in steps:
            self._readers.pop(s, None)
