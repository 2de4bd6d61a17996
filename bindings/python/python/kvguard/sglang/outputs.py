"""What leaves SGLang's scheduler: each request's whole ``req_to_token`` row checked before any of
its output is sent (a decode forward checks only its new tokens), and under enforce a refused
request's entries taken out of the output payload or emptied. ``Outputs`` is the part of
:class:`kvguard.sglang.Guard` that does it.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from .refusals import _finish_abort

_PAYLOAD_ROUTING = frozenset({"rids", "output_reqs", "http_worker_ipcs", "finished_reasons"})
"""Per-request lists of SGLang's output accumulator that say where an output goes and how it
ended, never what it holds: kept for a refused request (see :func:`_withheld`)."""


def _request_lists(acc: Any, n: int) -> list[tuple[str, list[Any]]]:
    """The per-request lists of SGLang's output accumulator ``acc`` (those of ``n`` entries,
    index-aligned with ``acc.rids``; ``customized_info``'s lists named by their key), each with
    its field's name; a list two fields share, once."""
    lists: dict[int, tuple[str, list[Any]]] = {}
    for name in type(acc).__dataclass_fields__:
        value = getattr(acc, name)
        if isinstance(value, list) and len(value) == n:
            lists.setdefault(id(value), (name, value))
        elif isinstance(value, dict) and name == "customized_info":
            for k, v in value.items():
                if isinstance(v, list) and len(v) == n:
                    lists.setdefault(id(v), (f"{name}.{k}", v))
    return list(lists.values())


def _withheld(value: Any) -> Any:
    """A refused request's entry of a per-request list of SGLang's output payload, its content
    withheld: a sequence of tokens, logprobs, ids or hidden states (list, tuple, ``array``,
    numpy array, torch tensor) emptied, of its own type; anything else (a count, a string, a
    record of timings or of cache hits) as it was."""
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, (list, tuple, array.array)):
        return value[:0]
    if isinstance(value, np.ndarray) or hasattr(value, "new_empty"):
        # An array or tensor: no entries, its trailing shape kept (a scalar: one dimension).
        return value[:0] if value.ndim else value.reshape(-1)[:0]
    return value


def _aborted(req: Any) -> bool:
    """SGLang aborts ``req`` (``FINISH_ABORT`` as its finish reason or its pending one)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT) or isinstance(getattr(req, "to_finish", None), FINISH_ABORT)


class Outputs:
    """The part of :class:`kvguard.sglang.Guard` that checks a request's row before its output leaves."""

    def check_rows_before_output(self, reqs: Any) -> list[Any]:
        """Each request's whole ``req_to_token`` row, every entry up to its committed length,
        checked before any of its output leaves the scheduler (with rows on a GPU, the device's
        verdicts on the forwards run so far taken first): a decode forward checks only the
        window of new tokens, so an entry changed behind SGLang's calls below it would otherwise
        be found only at the next full check, after the request may have finished. Returns the
        requests refused (under enforce aborted: a finished one's finish reason becomes the
        abort, so its output never leaves; one still running gets ``to_finish``)."""
        # The device's verdicts on the forwards run so far (rows on a GPU), before any output.
        self.row_check.take_verdicts()
        rows, lens, held = [], [], []
        refused: list[Any] = []
        # Every request sent is passed here (all 256 rows at a forced send): the loop is kept to
        # attribute reads, its rows' keys read in one numpy gather after it.
        row_kv, aborted, enforce = self._row_kv, self.aborted, self.policy == "enforce"
        for req in reqs:
            if enforce and req.rid in aborted:
                reason = aborted[req.rid]
                if not (req.finished() and not _aborted(req) and getattr(reason, "op", None) == "release"):
                    # Refused already (checked again it would only add violations), its row
                    # maybe given back already: its output is kvguard's abort alone.
                    refused.append(req)
                    if req.finished() and not _aborted(req):
                        req.finished_reason = _finish_abort(f"kvguard refused this request: {reason}")
                    continue
                # Refused only for how its release went, after it finished: its output was
                # made before, from its own KV, and leaves as SGLang made it.
            kv = req.kv
            row = kv.req_pool_idx
            if row is None:
                continue
            row = int(row)
            if row_kv[row] is not kv:
                continue
            if not req.output_ids and _aborted(req):
                # Aborted before it produced a token (a PD transfer that failed: its pages were
                # never written, and nothing read them): only the abort leaves.
                continue
            rows.append(row)
            lens.append(kv.kv_committed_len)
            held.append(req)
        if not rows:
            return refused
        admitted = self._admitted
        row_keys = self._row_key[rows].tolist()
        if not all(k in admitted for k in row_keys):
            # Rows of requests kvguard does not hold (never admitted, or released): not checked.
            keep = [i for i, k in enumerate(row_keys) if k in admitted]
            if not keep:
                return refused
            rows, lens, held = [rows[i] for i in keep], [lens[i] for i in keep], [held[i] for i in keep]
            row_keys = [row_keys[i] for i in keep]
        keys = row_keys
        rt = self.req_to_token_pool.req_to_token
        if getattr(rt, "is_cuda", False):
            # Rows on a GPU: these requests' rows only, copied to the host now (a request
            # finishing or streaming; one small copy), never a cached snapshot of the table.
            import torch

            width = max(lens) if lens else 0
            table = rt[torch.as_tensor(rows, device=rt.device), :width].cpu().numpy()
            at = np.arange(len(rows), dtype=np.int64)
            cached = False  # a copy of these rows only: nothing to keep across checks
        else:
            # SGLang's req_to_token in place, through the table's slot-row cache (the full
            # check's verdicts, each row compared with its copy at its last clean check).
            table, at, cached = self.row_check._host_rows(), np.asarray(rows, dtype=np.int64), True
        verdict = self.table.verify_step_rows(
            np.asarray(keys, dtype=np.int64), table, at, np.asarray(lens, dtype=np.int64), token_slots=True,
            cached=cached,
        )
        if verdict.clean:
            return refused
        for i, v in verdict.refused:
            req = held[i]
            self._row_checked[rows[i]] = 0
            self._refused(keys[i], v)
            refused.append(req)
            if self.policy == "enforce" and req.finished() and req.rid in self.aborted:
                req.finished_reason = _finish_abort(f"kvguard refused this request: {self.aborted[req.rid]}")
        return refused

    def _before_payload(self, acc: Any) -> None:
        """SGLang's output accumulator is about to build the payload of this step's outputs
        (``acc.output_reqs``, the requests SGLang decided to send): their rows are checked in
        full (:meth:`check_rows_before_output`). Under enforce a refused request still running
        is taken out of the payload (every per-request list of the accumulator, index-aligned
        with ``acc.rids``): none of its output leaves, its abort follows at the next step; a
        refused finished one leaves as kvguard's abort and nothing else: its entries of the
        payload's token content (ids, detokenizer ids, logprobs, hidden states, ...) emptied
        (:func:`_withheld`). The tokens it made since its last clean send may come from KV it
        had no right to read; SGLang streams an abort's payload to the client (its text
        included), so they never reach the payload."""
        reqs = acc.output_reqs
        refused = self.check_rows_before_output(reqs)
        if not refused or self.policy != "enforce":
            return
        bad = {id(r) for r in refused}
        drop, ended = [], []
        for i, r in enumerate(reqs):
            if id(r) not in bad:
                continue
            if r.finished():
                acc.finished_reasons[i] = r.finished_reason.to_json() if r.finished_reason else None
                ended.append(i)
            else:
                drop.append(i)
        n = len(acc.rids)
        if ended:
            for name, values in _request_lists(acc, n):
                if name not in _PAYLOAD_ROUTING:
                    for i in ended:
                        values[i] = _withheld(values[i])
        if not drop:
            return
        gone = set(drop)
        for _, values in _request_lists(acc, n):
            values[:] = [v for i, v in enumerate(values) if i not in gone]
        latencies = getattr(acc, "decode_latencies", None)
        if isinstance(latencies, dict) and latencies:
            left = [i for i in range(n) if i not in gone]
            acc.decode_latencies = {left.index(i): v for i, v in latencies.items() if i not in gone}
