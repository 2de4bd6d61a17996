"""kvguard's Prometheus metrics in an SGLang scheduler (``prometheus_client``, which SGLang
itself depends on), beside ``Guard.metrics``:

- ``kvguard_violations_total{kind, policy}``: violations seen, by kind;
- ``kvguard_refused_requests_total``: requests refused (aborted under enforce).

Registered once per process on the default registry; with SGLang's ``--enable-metrics`` its
multiprocess collector (``PROMETHEUS_MULTIPROC_DIR``) serves them on ``/metrics`` beside
SGLang's own. Without ``prometheus_client`` there are no metrics (the counters remain).
"""

from __future__ import annotations

from typing import Any


class SchedulerMetrics:
    """The counters of one process (all its schedulers' guards share them)."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.violations = Counter("kvguard_violations", "kvguard violations seen, by kind", ["kind", "policy"])
        self.refused_requests = Counter("kvguard_refused_requests", "requests kvguard refused (aborted)")

    def violation(self, kind: str, policy: str) -> None:
        """One violation of ``kind``."""
        self.violations.labels(kind=kind, policy=policy).inc()

    def refused(self) -> None:
        """One request refused."""
        self.refused_requests.inc()


_SINGLETON: SchedulerMetrics | None = None


def scheduler_metrics() -> Any:
    """This process's metrics, registered on first use; None without ``prometheus_client``."""
    global _SINGLETON
    if _SINGLETON is None:
        try:
            _SINGLETON = SchedulerMetrics()
        except ImportError:
            return None
    return _SINGLETON
