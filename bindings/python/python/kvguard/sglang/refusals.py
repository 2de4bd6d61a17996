"""How :class:`kvguard.sglang.Guard` turns a violation into a refusal: named as SGLang names its
requests and tenants (:class:`NamedViolation`), counted (``Guard.metrics``, Prometheus), logged,
kept among the latest (:data:`KEPT`), and under enforce the request aborted (its ``to_finish``,
SGLang's own abort path). ``Refusals`` is the part of ``Guard`` that does it.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from .. import Violation

logger = logging.getLogger("sglang.srt.kvguard")

_UNNAMED = object()


KEPT = 4096
"""How many of the latest refused requests (``Guard.aborted``) and violations (``Guard.violations``,
``Guard.refusals``) a guard keeps, at least: a server refusing for days keeps the latest, never
all (every one is counted in ``Guard.metrics`` and the Prometheus counters, and logged). A
refused request is aborted at its next step, so its entry is long unused when it goes."""


class _Latest(list):
    """A list of the latest entries: past ``2 * KEPT`` the oldest are dropped down to
    :data:`KEPT` (amortised: one move of the kept entries every ``KEPT`` appends)."""

    def append(self, item: Any) -> None:
        list.append(self, item)
        if len(self) > 2 * KEPT:
            del self[: len(self) - KEPT]


class _LatestAborted(dict):
    """The refused requests (``rid`` -> reason), oldest first, the latest :data:`KEPT` at least:
    past twice as many the oldest go, down to ``KEPT``, except a request that still holds a row
    (its ``rid`` in the guard's live requests): the free of its row reads its entry (the pages
    only it held go back from there) and so does the check of its output. Those stay whatever
    their age; the next trim waits for twice as many entries as the last one left (amortised
    however many are live)."""

    def __init__(self, live: dict[Any, Any]) -> None:
        super().__init__()
        self._live = live
        self._trim_at = 2 * KEPT

    def __setitem__(self, rid: Any, reason: Any) -> None:
        super().__setitem__(rid, reason)
        if len(self) > max(self._trim_at, 2 * KEPT):
            live = self._live
            for old in list(self)[: len(self) - KEPT]:
                if old not in live:
                    del self[old]
            self._trim_at = 2 * len(self)


def _finish_abort(message: str, status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR) -> Any:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, status, "KVGuardViolation")


class NamedViolation:
    """A kvguard :class:`~kvguard.Violation` with its request, owner and tenants named as SGLang
    names them (``rid``, the tenant's name) instead of the table's int keys. Every other field
    (``kind``, ``op``, ``page``, ``generation``, ``slots``, ``prefix``, ...) is the violation's."""

    __slots__ = ("violation", "request", "owner", "tenant", "owner_tenant")

    def __init__(self, violation: Violation, request: Any, owner: Any, tenant: Any, owner_tenant: Any) -> None:
        self.violation = violation
        self.request = request
        self.owner = owner
        self.tenant = tenant
        self.owner_tenant = owner_tenant

    def __getattr__(self, name: str) -> Any:
        return getattr(self.violation, name)

    def __str__(self) -> str:
        named = f"request {self.request!r} (tenant {self.tenant!r})"
        if self.owner is not None or self.owner_tenant is not None:
            named += f", page owner {self.owner!r} (tenant {self.owner_tenant!r})"
        return f"{self.violation}; {named}"

    def __repr__(self) -> str:
        return f"<kvguard.sglang.NamedViolation {self}>"


class Refusals:
    """The part of :class:`kvguard.sglang.Guard` that names, counts and acts on a violation."""

    def _refused_req(self, req: Any, key: int, violation: Any) -> None:
        """:meth:`_refused` for a request kvguard may have released already (a stale row's user):
        its ``Req`` is aborted directly when its key no longer names it."""
        self._refused(key, violation)
        if req is None or self._rids.get(key) is not None or self.policy != "enforce" or req.rid in self.aborted:
            return
        named = self._name(violation)
        self.aborted[req.rid] = named
        self.metrics["aborted_requests"] += 1
        if self.prometheus is not None:
            self.prometheus.refused()
        if not req.finished():
            req.to_finish = _finish_abort(f"kvguard refused this request: {named}", HTTPStatus.INTERNAL_SERVER_ERROR)

    def _name(self, violation: Violation) -> NamedViolation:
        def rid(k: Any) -> Any:
            if not isinstance(k, int):
                return k
            name = self._rids.get(k, _UNNAMED)
            return self._gone_rids.get(k, k) if name is _UNNAMED else name

        def tenant(k: Any) -> Any:
            return self._tenant_names.get(k, k) if isinstance(k, int) else k

        return NamedViolation(
            violation,
            rid(violation.request),
            rid(violation.owner),
            tenant(violation.tenant),
            tenant(violation.owner_tenant),
        )

    def _count(self, kind: str, rid: Any, text: str) -> None:
        self.metrics["violations_total"] += 1
        self.metrics[f"violations_total:{kind}"] += 1
        if self.prometheus is not None:
            self.prometheus.violation(kind, self.policy)
        logger.warning("kvguard %s: %s (request %r)", self.policy, text, rid)

    def _violation(self, key: int | None, violation: Violation) -> NamedViolation:
        self._rows_stale = True
        named = self._name(violation)
        rid = None if key is None else self._rids.get(key)
        self.violations.append(named)
        self.refusals.append((rid, named))
        self._count(violation.kind, rid, str(named))
        return named

    def _abort(self, key: int, reason: NamedViolation | str, status: HTTPStatus) -> None:
        rid = self._rids.get(key)
        if self.policy != "enforce" or rid is None or rid in self.aborted:
            return
        self.aborted[rid] = reason
        self.metrics["aborted_requests"] += 1
        if self.prometheus is not None:
            self.prometheus.refused()
        req = self._reqs.get(key)
        if req is not None and not req.finished():
            req.to_finish = _finish_abort(f"kvguard refused this request: {reason}", status)

    def _refused(self, key: int, violation: Violation, status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR) -> None:
        named = self._violation(key, violation)
        self._abort(key, named, status)

    def _abort_plain(self, key: int, message: str, kind: str = "missing_manifest") -> None:
        """A refusal that carries no violation (a missing manifest, a device finding lost)."""
        self._rows_stale = True
        self._count(kind, self._rids.get(key), message)
        self._abort(key, message, HTTPStatus.INTERNAL_SERVER_ERROR)
