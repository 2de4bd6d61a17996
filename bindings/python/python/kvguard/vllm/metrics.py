"""kvguard's counters and gauges on vLLM's ``/metrics`` (``prometheus_client``).

- ``kvguard_violations_total{kind}``: violations seen, by kind;
- ``kvguard_refused_requests_total``: requests refused (aborted under enforce);
- ``kvguard_steps_total``: steps checked;
- ``kvguard_pages{state}``: pages free, owned (one request), shared (cached prefixes).

They are registered in the process that checks (the worker; the engine core when vLLM runs the
worker in-process). vLLM's API server collects other processes' metrics through
``prometheus_client``'s multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), which it sets up; the
gauges use ``livemostrecent`` there. Without ``prometheus_client`` there are no metrics.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PoolMetrics", "pool_metrics"]

_SINGLETON: PoolMetrics | None = None

#: Gauges are refreshed every this many steps (a snapshot is cheap, but not free).
GAUGE_EVERY = 16


class PoolMetrics:
    """The registered metrics of this process."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.violations = Counter("kvguard_violations", "kvguard violations seen, by kind", ["kind"])
        self.refused_requests = Counter("kvguard_refused_requests", "requests kvguard refused")
        self.steps = Counter("kvguard_steps", "scheduler steps kvguard checked")
        self.pages = Gauge(
            "kvguard_pages", "KV pages by ownership state", ["state"], multiprocess_mode="livemostrecent"
        )
        self._n = 0

    def violation(self, kind: str) -> None:
        self.violations.labels(kind=kind).inc()

    def refused(self, n: int) -> None:
        self.refused_requests.inc(n)

    def step(self, table: Any) -> None:
        self.steps.inc()
        self._n += 1
        if self._n % GAUGE_EVERY == 1:
            s = table.snapshot()
            self.pages.labels(state="free").set(s.free)
            self.pages.labels(state="owned").set(s.owned)
            self.pages.labels(state="shared").set(s.shared)


def pool_metrics() -> PoolMetrics | None:
    """This process's metrics, registered on first use; None without ``prometheus_client``."""
    global _SINGLETON
    if _SINGLETON is None:
        try:
            _SINGLETON = PoolMetrics()
        except ImportError:
            return None
    return _SINGLETON
