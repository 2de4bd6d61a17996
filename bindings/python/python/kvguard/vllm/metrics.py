"""kvguard's counters and gauges on vLLM's ``/metrics`` (``prometheus_client``).

- ``kvguard_violations_total{kind}``: violations seen, by kind;
- ``kvguard_refused_requests_total``: requests refused (aborted under enforce);
- ``kvguard_steps_total``: steps checked;
- ``kvguard_pages{state}``: pages free, owned (one request), shared (cached prefixes).

They are registered in the process that checks (the worker; the engine core when vLLM runs the
worker in-process). A clean step costs the metrics nothing: the violation and refusal counters
move only when something is refused, and the step count and page gauges are read off the
checking guards when ``/metrics`` is scraped (a custom collector).

vLLM's API server collects other processes' metrics through ``prometheus_client``'s
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), which reads only the values processes wrote
to their files, never a collector's: there the step count and page gauges are written every
:data:`FLUSH_EVERY` steps instead (so they lag by at most that many steps; the gauges use
``livemostrecent``). Without ``prometheus_client`` there are no metrics.

``kvguard_steps_total`` never goes down: a guard that is dropped (its engine shut down) keeps
counting with the steps it had at the last scrape or write; steps it checked after that are not
counted. A metrics failure never reaches the step: the guard logs it once and checks on.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["FLUSH_EVERY", "PoolMetrics", "pool_metrics"]

_SINGLETON: PoolMetrics | None = None

#: In multiprocess mode, the step count and page gauges are written every this many steps.
FLUSH_EVERY = 64


class PoolMetrics:
    """The registered metrics of this process, and the guards whose pools they describe.

    ``flush_every`` is None when the step count and the gauges are read at scrape time (one
    process), else the number of steps between writes (multiprocess mode): a guard calls
    :meth:`flush` when its step count is a multiple of it.
    """

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.violations = Counter("kvguard_violations", "kvguard violations seen, by kind", ["kind"])
        self.refused_requests = Counter("kvguard_refused_requests", "requests kvguard refused")
        #: The guards of this process (each has ``steps`` and ``table``).
        self.guards: weakref.WeakSet[Any] = weakref.WeakSet()
        #: A token per guard ever tracked, its steps when last read, and the dropped guards' sum:
        #: what keeps ``kvguard_steps_total`` from going down when a guard goes.
        self._token_of: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._tokens = itertools.count()
        self._steps_seen: dict[int, int] = {}
        self._steps_retired = 0
        #: Multiprocess mode: the steps of each live guard already written.
        self._flushed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.flush_every: int | None = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Gauge

            self.flush_every = FLUSH_EVERY
            self._steps = Counter("kvguard_steps", "scheduler steps kvguard checked")
            self._pages = Gauge(
                "kvguard_pages", "KV pages by ownership state", ["state"], multiprocess_mode="livemostrecent"
            )
        else:
            from prometheus_client import REGISTRY

            REGISTRY.register(_ScrapeCollector(self))

    def track(self, guard: Any) -> None:
        """Counts ``guard``'s steps and pool in the metrics (while it lives; its steps after)."""
        self.guards.add(guard)
        token = next(self._tokens)
        self._token_of[guard] = token
        self._steps_seen[token] = 0
        weakref.finalize(guard, self._retire, token)

    def _retire(self, token: int) -> None:
        self._steps_retired += self._steps_seen.pop(token, 0)

    def steps_total(self) -> int:
        """Steps checked by every guard this process tracked, live or dropped; never less than
        the last answer."""
        for guard in list(self.guards):
            token = self._token_of.get(guard)
            if token is not None:
                self._steps_seen[token] = max(self._steps_seen.get(token, 0), guard.steps)
        return self._steps_retired + sum(self._steps_seen.values())

    def violation(self, kind: str) -> None:
        """One violation of ``kind``."""
        self.violations.labels(kind=kind).inc()

    def refused(self, n: int) -> None:
        """``n`` requests refused."""
        self.refused_requests.inc(n)

    def flush(self, guard: Any) -> None:
        """Multiprocess mode: writes the steps ``guard`` checked since its last flush and its
        pool's page counts."""
        # Keyed by the guard itself (weakly): a new guard never inherits a dropped one's count.
        done = self._flushed.get(guard, 0)
        if guard.steps > done:
            self._steps.inc(guard.steps - done)
            self._flushed[guard] = guard.steps
        s = guard.table.snapshot()
        self._pages.labels(state="free").set(s.free)
        self._pages.labels(state="owned").set(s.owned)
        self._pages.labels(state="shared").set(s.shared)


class _ScrapeCollector:
    """``kvguard_steps_total`` and ``kvguard_pages`` read off the live guards when scraped."""

    def __init__(self, metrics: PoolMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        # Registering must not call collect() (no guard exists yet); the names are fixed.
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        return [
            CounterMetricFamily("kvguard_steps", "scheduler steps kvguard checked"),
            GaugeMetricFamily("kvguard_pages", "KV pages by ownership state", labels=["state"]),
        ]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        guards = list(self._metrics.guards)
        steps = CounterMetricFamily("kvguard_steps", "scheduler steps kvguard checked")
        steps.add_metric([], self._metrics.steps_total())
        pages = GaugeMetricFamily("kvguard_pages", "KV pages by ownership state", labels=["state"])
        free = owned = shared = 0
        for g in guards:
            s = g.table.snapshot()
            free, owned, shared = free + s.free, owned + s.owned, shared + s.shared
        pages.add_metric(["free"], free)
        pages.add_metric(["owned"], owned)
        pages.add_metric(["shared"], shared)
        yield steps
        yield pages


def pool_metrics() -> PoolMetrics | None:
    """This process's metrics, registered on first use; None without ``prometheus_client``."""
    global _SINGLETON
    if _SINGLETON is None:
        try:
            _SINGLETON = PoolMetrics()
        except ImportError:
            return None
    return _SINGLETON
