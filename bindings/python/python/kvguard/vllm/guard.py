"""The worker side: the ownership table, fed by the scheduler's events, checking the block
table the worker is about to copy to the GPU.

One :meth:`StepGuard.check_step` per model step, before ``commit_block_table``:

1. apply the step's scheduler events (admit, claim, evict, release, preempt) in order;
2. record the step's KV writes: the slot mapping the worker's block table yields for the
   scheduled positions (the formula of vLLM's slot-mapping kernel, computed on the host from the
   same int32 rows) with the per-request token boundaries (``query_start_loc``): a write through a
   page the request does not own is refused there;
3. publish the blocks that became cacheable, then attach the prefix-cache hits;
4. verify the block table: row ``i`` of ``BlockTable.block_table.np`` for ``req_ids[i]``, reading
   ``num_computed_tokens + num_scheduled_tokens`` tokens (what attention reads).

All of it is a handful of batched calls into the Rust table per step (one per event, one for the
writes, one for the reads), the GIL released inside.

Under ``enforce`` the refused rows are rewritten to the null block before the copy (neither their
reads nor their writes reach anyone's KV) and their requests are reported back to the scheduler,
which ends exactly those with an error; under ``report`` nothing is changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvguard

from . import metrics
from .recorder import EventKind

__all__ = ["Refusal", "StepGuard", "StepReport"]

#: vLLM's null block: page 0 is never allocated and pads every row.
NULL_BLOCK = 0

#: The int id a request never admitted is spoken of by (the table refuses it as unknown).
UNKNOWN_REQUEST = 2**62

logger = logging.getLogger("vllm.kvguard")


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the violation kind, the step stage that refused it, and the
    violation's one-line message."""

    kind: str
    stage: str
    message: str

    def client_message(self, request_id: str) -> str:
        """What the client is told."""
        return f"kvguard refused request {request_id}: {self.kind} ({self.stage}): {self.message}"


@dataclass
class StepReport:
    """What one step's check found."""

    #: request id -> the first refusal of this step.
    refused: dict[str, Refusal] = field(default_factory=dict)
    #: Batch rows refused (row order), for requests in the batch.
    refused_rows: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.refused


class StepGuard:
    """The ownership table of one worker's KV pool and the per-step check.

    ``num_blocks`` and ``block_size``: the pool (``KVCacheConfig.num_blocks``, the group's block
    size); ``max_model_len`` bounds admission; ``mode``: ``enforce`` or ``report``.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, mode: str) -> None:
        self.mode = mode
        self.block_size = block_size
        config = kvguard.PoolConfig(num_blocks, block_size, max_model_len, reserved=[NULL_BLOCK], policy=mode)
        try:
            self.table = kvguard.OwnershipTable(config)
        except kvguard.ConfigError as e:
            # vLLM sizes its own pool against max_model_len; the table follows what vLLM runs.
            logger.warning("kvguard: %s; checking the pool vLLM runs anyway", e)
            self.table = kvguard.OwnershipTable(config, audit=False)
        #: Requests refused so far (their later release errors are expected, not news).
        self.refused_ever: set[str] = set()
        self.steps = 0
        self.refusals_total = 0
        self._arange = np.arange(0, dtype=np.int64)
        #: vLLM request id -> the table's int id (given at admission, dropped at release): the
        #: table is spoken to in ints, so no string is interned per call.
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self._batch_ids: np.ndarray | None = None
        self._batch_req_ids: list[str] = []
        self._metrics = metrics.pool_metrics()

    # -- events ------------------------------------------------------------------------------

    def _refuse(self, report: StepReport, rid: str | None, kind: str, stage: str, message: str) -> None:
        if self._metrics is not None:
            self._metrics.violation(kind)
        if rid is None:
            logger.warning("kvguard: %s (%s): %s", kind, stage, message)
            return
        if rid in report.refused or rid in self.refused_ever and stage in ("release", "preempt"):
            return
        report.refused[rid] = Refusal(kind, stage, message)

    def _apply(self, report: StepReport, events: list[tuple]) -> list[tuple]:
        """Applies the early events (admit, claim, evict, release, preempt) in order; returns
        the late ones (publishes and attaches), applied after the step's writes."""
        t = self.table
        ids = self._ids
        late = []
        claims: list[tuple] = []
        for ev in events:
            kind = ev[0]
            rid = ev[1]
            if kind == EventKind.CLAIM:
                # A run of claims goes to the table as one claim_step (judged as in order).
                claims.append(ev)
                continue
            if claims:
                self._claim_run(report, claims)
                claims = []
            try:
                if kind == EventKind.PUBLISH or kind == EventKind.ATTACH:
                    late.append(ev)
                elif kind == EventKind.EVICT:
                    stage = "evict"
                    for block in ev[2]:
                        try:
                            t.evict_prefix(block)
                        except kvguard.ViolationError as e:
                            self._refuse(report, rid, e.kind, stage, str(e))
                elif kind == EventKind.ADMIT:
                    stage = "admit"
                    if rid not in ids:  # else the table refuses the duplicate
                        ids[rid] = self._next_id
                        self._next_id += 1
                        self._batch_ids = None
                    t.admit(ids[rid], ev[2], ev[3], ev[4])
                elif kind == EventKind.RELEASE:
                    stage = "release"
                    self.refused_ever.discard(rid)
                    t.release(ids.pop(rid, UNKNOWN_REQUEST))
                    self._batch_ids = None
                elif kind == EventKind.PREEMPT:
                    stage = "preempt"
                    t.preempt(ids.get(rid, UNKNOWN_REQUEST))
            except kvguard.ViolationError as e:
                self._refuse(report, rid, e.kind, stage, str(e))
        if claims:
            self._claim_run(report, claims)
        return late

    def _claim_run(self, report: StepReport, claims: list[tuple]) -> None:
        """Consecutive claim events of a step, in one call under one lock."""
        get = self._ids.get
        keys = [get(ev[1], UNKNOWN_REQUEST) for ev in claims]
        pages = [b for ev in claims for b in ev[2]]
        indptr = [0]
        for ev in claims:
            indptr.append(indptr[-1] + len(ev[2]))
        for i, v in self.table.claim_step(keys, pages, indptr).refused:
            self._refuse(report, claims[i][1], v.kind, "allocate", str(v))

    def _apply_late(self, report: StepReport, late: list[tuple]) -> None:
        t = self.table
        ids = self._ids
        for kind, rid, blocks in late:
            iid = ids.get(rid, UNKNOWN_REQUEST)
            for block in blocks:
                try:
                    if kind == EventKind.PUBLISH:
                        t.publish_prefix(iid, block, [block])
                    else:
                        t.attach_prefix(iid, block)
                except kvguard.ViolationError as e:
                    self._refuse(report, rid, e.kind, "publish" if kind == EventKind.PUBLISH else "prefix hit", str(e))

    def _step_ids(self, req_ids: list[str]) -> np.ndarray:
        """The table's int ids of the step's requests (cached while the batch is unchanged)."""
        if self._batch_ids is not None and self._batch_req_ids == req_ids:
            return self._batch_ids
        get = self._ids.get
        self._batch_ids = np.array([get(r, UNKNOWN_REQUEST) for r in req_ids], dtype=np.int64)
        self._batch_req_ids = list(req_ids)
        return self._batch_ids

    # -- the step ------------------------------------------------------------------------------

    def check_step(
        self,
        req_ids: list[str],
        block_table: np.ndarray,
        num_blocks_per_row: np.ndarray,
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        events: list[tuple] | None,
    ) -> StepReport:
        """Checks one step. ``block_table``: the worker's int32 ``[max_num_reqs, width]`` array
        (rows ``0..n``, n = ``len(req_ids)``); ``num_computed_tokens``: per row, before this step;
        ``num_scheduled_tokens``: int array of n. Under enforce, refused rows are nulled in
        ``block_table`` in place."""
        report = StepReport()
        self.steps += 1
        late = self._apply(report, events) if events else None
        n = len(req_ids)
        if n:
            ids = self._step_ids(req_ids)
            sched = np.asarray(num_scheduled_tokens, dtype=np.int64)
            computed = np.asarray(num_computed_tokens[:n], dtype=np.int64)
            if self._arange.shape[0] <= n:
                self._arange = np.arange(max(n + 1, 2 * self._arange.shape[0]), dtype=np.int64)
            total = int(sched.sum())
            bs = self.block_size
            last_col = block_table.shape[1] - 1
            if total == n:
                # Every request writes one token (decode): token i at its computed count.
                qsl = self._arange[: n + 1]
                positions = computed
                rows = self._arange[:n]
            else:
                qsl = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(sched, out=qsl[1:])
                if self._arange.shape[0] < total:
                    self._arange = np.arange(max(total, 2 * self._arange.shape[0]), dtype=np.int64)
                rows = np.repeat(self._arange[:n], sched)
                positions = computed[rows] + (self._arange[:total] - qsl[rows])
            col = positions // bs
            np.minimum(col, last_col, out=col)
            slots = block_table[rows, col].astype(np.int64)
            slots *= bs
            slots += positions % bs
            writes = self.table.record_step_writes(ids, slots, qsl)
            for row, v in writes.refused:
                self._refuse(report, req_ids[row], v.kind, "write", str(v))
        if late:
            self._apply_late(report, late)
        if n:
            seq_lens = computed + sched
            reads = self.table.verify_step(ids, block_table, seq_lens)
            for row, v in reads.refused:
                self._refuse(report, req_ids[row], v.kind, "read", str(v))
        if report.refused:
            index = {rid: i for i, rid in enumerate(req_ids)} if n else {}
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
            self.refused_ever.update(report.refused)
            self.refusals_total += len(report.refused)
            if self._metrics is not None:
                self._metrics.refused(len(report.refused))
            if self.mode == "enforce":
                for row in report.refused_rows:
                    block_table[row, : max(int(num_blocks_per_row[row]), 1)] = NULL_BLOCK
        if self._metrics is not None:
            self._metrics.step(self.table)
        return report
