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

Example, with a stand-in for the device (a real one needs a GPU)::

    from kvguard.device_verdicts import DeviceVerdicts

    class Ring:  # copies at once, as if every copy had landed
        def __init__(self): self.records, self.copy = [], None
        def begin_drain(self, *, stream): self.copy, self.records = self.records, []
        def finish_drain(self, table, *, stream, wait=True):
            out, self.copy = self.copy, None
            return out

    ring = Ring()
    verdicts = DeviceVerdicts(ring)
    ring.records.append("step 1 refused")
    verdicts.queued(stream=7)                       # step 1's checks queued, its copy behind them
    verdicts.queued(stream=7)                       # step 2: step 1's copy landed, taken; a new one
    assert verdicts.through(None, 1) == ["step 1 refused"]
    assert verdicts.through(None, 2) == []
"""

from __future__ import annotations

import threading
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
        self._lock = threading.Lock()

    def queued(self, table: Any = None, *, stream: int) -> None:
        """A step's checks were just queued on ``stream`` (the step is :attr:`checked` after
        it): the ring's copy is queued behind them, unless a copy in flight has not landed yet
        (finished here if it has, with ``table``, never waited for)."""
        dg = self.device_guard
        with self._lock:
            self.checked += 1
            self.stream = stream
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

    def _took(self, records: Any, covered: int) -> None:
        self.taken_through = max(self.taken_through, covered)
        self._found.extend(records or ())
