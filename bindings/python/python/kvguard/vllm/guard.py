"""The worker side: the ownership table, fed by the scheduler's events, checking the block
table the worker is about to copy to the GPU.

One :meth:`StepGuard.check_step` per model step, before ``commit_block_table``:

1. apply the step's early scheduler events (admit, claim, evict, release, preempt) in order;
2. record the step's KV writes: the slot mapping the worker's block table yields for the
   scheduled positions (the formula of vLLM's slot-mapping kernel, computed in Rust from the same
   int32 rows, the computed and scheduled token counts and the block size): a write through a
   page the request does not own is refused there;
3. publish the blocks that became cacheable, then attach the prefix-cache hits;
4. verify the block table: row ``i`` of ``BlockTable.block_table.np`` for ``req_ids[i]``, reading
   ``num_computed_tokens + num_scheduled_tokens`` tokens (what attention reads).

That is one call into the Rust table per step, the GIL released inside:
``OwnershipTable.apply_record_and_verify_step`` (1 to 4), the arrays read in place; Python only
walks what was refused.

Under ``enforce`` the refused rows are rewritten to the null block before the copy (neither their
reads nor their writes reach anyone's KV) and their requests are reported back to the scheduler,
which ends exactly those with an error; under ``report`` nothing is changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

import numpy as np

import kvguard

from . import metrics
from .recorder import EventKind, StepEvents

__all__ = ["CLEAN_STEP", "Refusal", "StepGuard", "StepReport"]

#: vLLM's null block: page 0 is never allocated and pads every row.
NULL_BLOCK = 0

#: vLLM's padding slot (``PAD_SLOT_ID``): a slot-mapping entry the attention backends write nothing
#: through.
PAD_SLOT = -1

#: The step stage each event kind is refused at (what a refusal and the client's error name).
STAGES = {
    EventKind.ADMIT: "admit",
    EventKind.CLAIM: "allocate",
    EventKind.ATTACH: "prefix hit",
    EventKind.PUBLISH: "publish",
    EventKind.RELEASE: "release",
    EventKind.PREEMPT: "preempt",
    EventKind.EVICT: "evict",
    EventKind.DETACH: "window",
    EventKind.RELEASE_PAGES: "window",
}

logger = logging.getLogger("vllm.kvguard")


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the violation kind, the step stage that refused it, and the
    violation's one-line message."""

    kind: str
    stage: str
    message: str

    def client_message(self, request_id: str) -> str:
        """What the client is told: its own request id, the kind and the stage, nothing else. The
        violation's message names pages, their owners and other tenants (``salt=...``), so it goes
        to the operator's log (``vllm.kvguard``), never to a client."""
        return f"kvguard refused request {request_id}: {self.kind} ({self.stage})"


@dataclass
class StepReport:
    """What one step's check found."""

    #: request id -> the first refusal of this step.
    refused: dict[str, Refusal] = field(default_factory=dict)
    #: Batch rows refused (row order), for requests in the batch.
    refused_rows: list[int] = field(default_factory=list)
    #: Requests refused in an earlier step and refused again now (under async scheduling vLLM
    #: has scheduled the next step before it hears of a refusal): their rows are nulled again,
    #: nothing is reported or counted twice.
    again: set[str] = field(default_factory=set)

    @property
    def clean(self) -> bool:
        return not self.refused


#: The report of every clean step, shared: a clean step builds nothing (a fresh report is 3 µs
#: of cold code inside vLLM's step). Its containers are read-only, so it cannot be added to.
CLEAN_STEP = StepReport(refused=MappingProxyType({}), refused_rows=())  # type: ignore[arg-type]


class StepGuard:
    """The ownership table of one worker's KV pool and the per-step check.

    ``num_blocks`` and ``block_size``: the pool (``KVCacheConfig.num_blocks``, the group's block
    size); ``max_model_len`` bounds admission; ``mode``: ``enforce`` or ``report``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, mode: str, *, windows: list[int | None] | None = None
    ) -> None:
        self.mode = mode
        self.block_size = block_size
        #: A hybrid model's KV cache groups, one entry per group (its sliding window in tokens, None
        #: for full attention; one block pool for all), checked by :meth:`check_groups_step`; None
        #: for one full-attention group, checked by :meth:`check_step`.
        self.windows = windows
        #: One row cache per full-attention group (its reads judged incrementally).
        self._row_caches = [kvguard.RowCache() if w is None else None for w in windows] if windows else []
        config = kvguard.PoolConfig(num_blocks, block_size, max_model_len, reserved=[NULL_BLOCK], policy=mode)
        try:
            self.table = kvguard.OwnershipTable(config)
        except kvguard.ConfigError as e:
            # vLLM sizes its own pool against max_model_len; the table follows what vLLM runs.
            logger.warning("kvguard: %s; checking the pool vLLM runs anyway", e)
            self.table = kvguard.OwnershipTable(config, audit=False)
        #: The report of the last step something was refused in (None once read by a test or
        #: tool that clears it); clean steps leave it alone.
        self.last_report: StepReport | None = None
        #: Blocks vLLM evicted from its prefix cache that the table could not evict yet (a
        #: request still held them here: after a refusal, the table and vLLM can disagree on
        #: who holds what). Each is evicted before vLLM's next claim of it.
        self.pending_evict: set[int] = set()
        #: Requests refused so far (their later release errors are expected, not news).
        self.refused_ever: set[str] = set()
        #: The device half of the check (``kvguard.vllm.device.V2Device``) where vLLM's V2 runner
        #: builds the step's tables on a GPU; None elsewhere.
        self.device: Any = None
        self.steps = 0
        self.refusals_total = 0
        self._metrics_failed = False
        #: Steps between metric writes (multiprocess mode), else 0: read when scraped.
        self._flush_every = 0
        try:
            self._metrics = metrics.pool_metrics()
            if self._metrics is not None:
                self._metrics.track(self)
                self._flush_every = self._metrics.flush_every or 0
        except Exception:
            # The checks do not depend on the metrics: without them the guard runs as strict.
            logger.exception("kvguard: the metrics could not be set up; the checks run without them")
            self._metrics = None
            self._flush_every = 0

    # -- the step ------------------------------------------------------------------------------

    def _metric(self, call: Any, *args: Any) -> None:
        """Calls a metrics method; its failure is logged (once) and never reaches the step."""
        try:
            call(*args)
        except Exception:
            if not self._metrics_failed:
                self._metrics_failed = True
                logger.exception("kvguard: a metrics update failed; the checks go on (logged once)")

    def _refuse(self, report: StepReport, rid: str | None, kind: str, stage: str, message: str) -> None:
        if self._metrics is not None and (rid is None or self.mode != "enforce" or rid not in self.refused_ever):
            self._metric(self._metrics.violation, kind)
        if rid is None:
            logger.warning("kvguard: %s (%s): %s", kind, stage, message)
            return
        if rid in report.refused:
            return
        if rid in self.refused_ever:
            if self.mode == "enforce":
                report.again.add(rid)
                return
            if stage == "preempt":
                return
        report.refused[rid] = Refusal(kind, stage, message)

    def _refuse_events(self, report: StepReport, events: list[tuple], refused: list) -> None:
        for i, v in refused:
            ev = events[i]
            if ev[0] == EventKind.EVICT:
                # vLLM dropped the block's hash whatever the table said; the table follows it.
                if v.kind == "evict_in_use":
                    # Still held here: evicted once nothing holds it, before vLLM hands the
                    # block out again (a claim of it is then judged against the truth).
                    self.pending_evict.add(ev[2])
                if ev[1] is None or v.kind == "unknown_prefix":
                    # A cache entry the table never had (its publish was refused), or kvguard's
                    # own clean-up after a refusal: nobody reads through it, nobody is charged.
                    logger.debug("kvguard: %s (evict, not charged): %s", v.kind, v)
                    continue
            self._refuse(report, ev[1], v.kind, STAGES[ev[0]], str(v))

    def _evict_before_claims(self, early: list[tuple]) -> list[tuple]:
        """The step's early events with the evictions the table still owes vLLM (see
        ``pending_evict``) put right before the claim of their block."""
        pending = self.pending_evict
        out: list[tuple] = []
        for ev in early:
            if ev[0] == EventKind.CLAIM and not pending.isdisjoint(ev[2]):
                for block in ev[2]:
                    if block in pending:
                        pending.discard(block)
                        out.append((EventKind.EVICT, None, block))
            out.append(ev)
        return out

    def check_step(
        self,
        req_ids: list[str],
        block_table: np.ndarray,
        num_blocks_per_row: np.ndarray,
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        events: StepEvents | None,
    ) -> StepReport:
        """Checks one step. ``block_table``: the worker's int32 ``[max_num_reqs, width]`` array
        (rows ``0..n``, n = ``len(req_ids)``); ``num_computed_tokens``: per row, before this step;
        ``num_scheduled_tokens``: int array of n. Under enforce, refused rows are nulled in
        ``block_table`` in place. A clean step returns :data:`CLEAN_STEP` (shared, read-only)."""
        # The clean step is the hot path: one binding call, a few attribute reads, no per-row
        # Python work; everything else happens only when something was refused.
        self.steps += 1
        early, late = events if events else (None, None)
        if early and self.pending_evict:
            early = self._evict_before_claims(early)
        writes = reads = refused_late = None
        if req_ids:
            # Early events, writes, late events (publishes, prefix hits), reads: one call, one
            # entry into Rust, the GIL released once.
            refused_early, writes, refused_late, reads = self.table.apply_record_and_verify_step(
                early, req_ids, block_table, num_computed_tokens, num_scheduled_tokens, late
            )
        else:
            refused_early = self.table.apply_events(early) if early else None
            if late:
                refused_late = self.table.apply_events(late)
        report = self._judge_early(early, refused_early)
        if self._flush_every and self.steps % self._flush_every == 0:
            self._metric(self._metrics.flush, self)
        if report is None and not refused_late and (writes is None or writes.clean and reads.clean):
            return CLEAN_STEP
        return self._refused_step(
            report or StepReport(), req_ids, [(block_table, num_blocks_per_row)], late, refused_late, [writes], [reads]
        )

    def _refused_step(
        self,
        report: StepReport,
        req_ids: list[str],
        tables: list[tuple[np.ndarray, np.ndarray]],
        late: list[tuple] | None,
        refused_late: list | None,
        writes: list[Any],
        reads: list[Any],
    ) -> StepReport:
        """Completes the report of a step something was refused in (``report`` holds the early
        events' refusals; then writes, late events, reads: a request's first refusal is the one
        it is told) and acts on it."""
        for verdict in writes:
            if verdict is not None and not verdict.clean:
                for row, v in verdict.refused:
                    self._refuse(report, req_ids[row], v.kind, "write", str(v))
        if refused_late:
            self._refuse_events(report, late, refused_late)
        for verdict in reads:
            if verdict is not None and not verdict.clean:
                for row, v in verdict.refused:
                    self._refuse(report, req_ids[row], v.kind, "read", str(v))
        if report.again and self.mode == "enforce":
            for row, rid in enumerate(req_ids):
                if rid in report.again:
                    _null_row(tables, row)
        if report.refused:
            index = {rid: i for i, rid in enumerate(req_ids)}
            for rid, refusal in report.refused.items():
                row = index.get(rid)
                if row is not None:
                    report.refused_rows.append(row)
                logger.warning(
                    "kvguard %s request %s: %s (%s): %s",
                    "refused" if self.mode == "enforce" else "reports",
                    rid,
                    refusal.kind,
                    refusal.stage,
                    refusal.message,
                )
            report.refused_rows.sort()
            self.last_report = report
            self.refused_ever.update(report.refused)
            self.refusals_total += len(report.refused)
            if self._metrics is not None:
                self._metric(self._metrics.refused, len(report.refused))
            if self.mode == "enforce":
                for row in report.refused_rows:
                    _null_row(tables, row)
        return report

    # -- a hybrid model's step ---------------------------------------------------------------

    def _apply_early(self, early: list[tuple]) -> list[tuple[int, Any]]:
        """Applies a hybrid step's early events in order, each sliding window's partial release
        (``RELEASE_PAGES``) among them, in one ``apply_events`` call. Returns the refused events:
        [(index in early, Violation)]."""
        return self.table.apply_events(early)

    def _judge_early(self, early: list[tuple] | None, refused_early: list | None) -> StepReport | None:
        """The report of a step's refused early events (None when none was refused); a released
        request's id may be reused by the scheduler, so its old refusal is forgotten."""
        report = None
        if refused_early:
            report = StepReport()
            self._refuse_events(report, early, refused_early)
        if early and self.refused_ever:
            for ev in early:
                if ev[0] is EventKind.RELEASE:
                    self.refused_ever.discard(ev[1])
        return report

    def _begin_groups_step(
        self, events: StepEvents | None
    ) -> tuple[StepReport | None, list[tuple] | None, list[tuple] | None]:
        """A multi-group step's start (``check_groups_step``, ``check_attn_step``): counts it and
        applies its early events (the evictions the table owes vLLM put before their claims).
        Returns (the report of the refused early events, or None; the early events as applied;
        the late events)."""
        self.steps += 1
        early, late = events if events else (None, None)
        if early and self.pending_evict:
            early = self._evict_before_claims(early)
        refused_early = self._apply_early(early) if early else None
        report = self._judge_early(early, refused_early)
        return report, early, late

    def check_groups_step(
        self,
        req_ids: list[str],
        tables: list[tuple[np.ndarray, np.ndarray]],
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray | None,
        events: StepEvents | None,
    ) -> StepReport:
        """Checks one step of a hybrid model: ``tables`` holds each KV cache group's block table
        and row lengths (``MultiGroupBlockTable``: the groups' rows name blocks of one pool), in
        the order of ``windows``. The early events (a sliding window's dropped blocks among them,
        partial releases of their request), then each group's writes (the slot mapping of its
        rows), then the late events, then each group's reads: a full-attention row for
        ``num_computed_tokens + num_scheduled_tokens`` tokens, a sliding-window row only for the
        tokens its window covers (from ``num_computed_tokens - window + 1``: what attention of
        the step's first token reads; the entries before it name blocks vLLM dropped and are
        never read). Under enforce, a refused request's rows are nulled in every group."""
        report, early, late = self._begin_groups_step(events)
        n = len(req_ids)
        writes: list[Any] = []
        reads: list[Any] = []
        bs = self.block_size
        if n:
            computed = np.asarray(num_computed_tokens[:n], dtype=np.int64)
            scheduled = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
            qsl = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(scheduled, out=qsl[1:])
            row_of = np.repeat(np.arange(n), scheduled)
            pos = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - computed, scheduled)
            for block_table, _ in tables:
                # vLLM's slot-mapping formula over this group's rows (a position past the row's
                # width takes its last entry, as the single-group step does).
                col = np.minimum(pos // bs, block_table.shape[1] - 1)
                slots = block_table[row_of, col].astype(np.int64) * bs + pos % bs
                writes.append(self.table.record_step_writes(req_ids, slots, qsl))
        refused_late = self.table.apply_events(late) if late else None
        if n:
            lens = computed + scheduled
            rows = np.arange(n, dtype=np.int64)
            for g, (block_table, _) in enumerate(tables):
                window = self.windows[g]
                if window is None:
                    reads.append(self.table.verify_rows(self._row_caches[g], req_ids, block_table, rows, lens))
                    continue
                first = np.maximum(computed - (window - 1), 0)
                v = self.table.check_step_window(req_ids, block_table, rows, lens, first)
                reads.append(v if v.clean else self._judge_window(req_ids, block_table, v, lens, first))
        if self._flush_every and self.steps % self._flush_every == 0:
            self._metric(self._metrics.flush, self)
        clean = all(v.clean for v in writes) and all(v.clean for v in reads)
        if report is None and not refused_late and clean:
            return CLEAN_STEP
        return self._refused_step(report or StepReport(), req_ids, tables, late, refused_late, writes, reads)

    # -- Model Runner V2: what prepare_attn hands attention ------------------------------------

    def check_attn_step(
        self,
        req_ids: list[str],
        tables: list[np.ndarray],
        slot_mappings: np.ndarray,
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        events: StepEvents | None,
        after_early: Callable[[], None] | None = None,
    ) -> StepReport:
        """Checks one step of vLLM's Model Runner V2 on what its ``prepare_attn`` hands attention:
        ``tables``, each KV cache group's gathered block table (``BlockTables.gather_block_tables``:
        int32 ``[num_reqs_padded, width]``, row ``i`` for ``req_ids[i]``; a sliding-window group's
        entries wholly below the first token's window already nulled by V2), and
        ``slot_mappings``, V2's ``[groups, num_tokens_padded]`` int64 slot mappings
        (``compute_slot_mappings``), request ``i`` writing tokens ``query_start_loc[i] ..
        query_start_loc[i + 1]``. Both read in place, as numpy views of V2's own buffers.

        The early events, then each group's writes (V2's own slot mapping, not one rebuilt here),
        then the late events, then each group's reads (a full-attention row for
        ``num_computed_tokens + num_scheduled_tokens`` tokens, incrementally; a sliding-window row
        over the window of the step's first token, as :meth:`check_groups_step`). Under enforce a
        refused request's rows are nulled in every group's gathered table and its tokens' slots set
        to ``-1`` (vLLM's padding slot: the attention backends write nothing there), so neither its
        reads nor its writes reach anyone's KV.

        ``after_early``, if given, runs once the early events are applied, before anything else
        (the device check of V2's writes on a GPU judges them against the table as it is then)."""
        report, early, late = self._begin_groups_step(events)
        if after_early is not None:
            after_early()
        n = len(req_ids)
        windows = self.windows or [None]
        writes: list[Any] = []
        reads: list[Any] = []
        if n:
            qsl = query_start_loc[: n + 1]
            for g in range(len(tables)):
                writes.append(self.table.record_step_writes(req_ids, slot_mappings[g], qsl))
        refused_late = self.table.apply_events(late) if late else None
        if n:
            computed = np.asarray(num_computed_tokens[:n], dtype=np.int64)
            lens = computed + np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
            rows = np.arange(n, dtype=np.int64)
            for g, block_table in enumerate(tables):
                window = windows[g]
                if window is None:
                    reads.append(self.table.verify_rows(self._attn_row_cache(g), req_ids, block_table, rows, lens))
                    continue
                first = np.maximum(computed - (window - 1), 0)
                v = self.table.check_step_window(req_ids, block_table, rows, lens, first)
                reads.append(v if v.clean else self._judge_window(req_ids, block_table, v, lens, first))
        if self._flush_every and self.steps % self._flush_every == 0:
            self._metric(self._metrics.flush, self)
        clean = all(v.clean for v in writes) and all(v.clean for v in reads)
        if report is None and not refused_late and clean:
            return CLEAN_STEP
        # Whole rows: V2's gathered rows are rebuilt every step, nothing past them is kept.
        whole = [(t, np.full(t.shape[0], t.shape[1], dtype=np.int64)) for t in tables]
        report = self._refused_step(report or StepReport(), req_ids, whole, late, refused_late, writes, reads)
        if self.mode == "enforce" and n:
            again = [row for row, rid in enumerate(req_ids) if rid in report.again]
            for row in (*report.refused_rows, *again):
                slot_mappings[:, int(query_start_loc[row]) : int(query_start_loc[row + 1])] = PAD_SLOT
        return report

    def device_refused(self, violations: list[Any], lost: Sequence[str] = ()) -> StepReport:
        """The device check's violations (drained from its ring), judged as the host's are: each
        request refused once, at its first; the rows were fenced on the device already. ``lost``:
        the requests read in steps whose findings the device could not hand over
        (``DeviceGuard.findings_lost``), each refused, since the one flagged is among them."""
        report = StepReport()
        for v in violations:
            request = v.request
            self._refuse(report, None if request is None else str(request), v.kind, v.op, str(v))
        for rid in lost:
            self._refuse(
                report,
                rid,
                "device_findings_lost",
                "read",
                "the device flagged a request of this step and the record naming it was lost "
                "(more flagged requests between two drains than half its ring holds): every "
                "request the step read is refused",
            )
        if not report.refused and not report.again:
            return CLEAN_STEP
        return self._refused_step(report, [], [], None, None, [], [])

    def _attn_row_cache(self, group: int) -> Any:
        """The row cache of a full-attention group (one per group, made on first use)."""
        caches = self._row_caches
        while len(caches) <= group:
            caches.append(None)
        if caches[group] is None:
            caches[group] = kvguard.RowCache()
        return caches[group]

    def _judge_window(
        self, req_ids: list[str], block_table: np.ndarray, checked: Any, lens: np.ndarray, first: np.ndarray
    ) -> _Refused:
        """The sliding-window rows ``check_step_window`` refused (``checked``), judged (counted,
        logged): each read as its window alone, the blocks from the one holding token ``first``
        on. A row the pure check refused stays refused whatever the judged one says."""
        rows = checked.refused_rows
        bs = self.block_size
        width = block_table.shape[1]
        windows = np.zeros((len(rows), width), dtype=block_table.dtype)
        seq = np.zeros(len(rows), dtype=np.int64)
        for k, row in enumerate(rows):
            page = int(first[row]) // bs
            windows[k, : width - page] = block_table[row, page:]
            seq[k] = int(lens[row]) - page * bs
        v = self.table.verify_step_rows([req_ids[r] for r in rows], windows, np.arange(len(rows)), seq)
        judged = {rows[k]: violation for k, violation in v.refused}
        for row, violation in checked.refused:
            judged.setdefault(row, violation)
        return _Refused(sorted(judged.items()))


@dataclass(frozen=True)
class _Refused:
    """A verdict's refused rows, as (row of the step, Violation)."""

    refused: list[tuple[int, Any]]

    @property
    def clean(self) -> bool:
        return not self.refused


def _null_row(tables: list[tuple[np.ndarray, np.ndarray]], row: int) -> None:
    """Rewrites ``row`` of each group's block table to the null block (its request's reads and
    writes reach no one's KV)."""
    for block_table, num_blocks_per_row in tables:
        block_table[row, : max(int(num_blocks_per_row[row]), 1)] = NULL_BLOCK
