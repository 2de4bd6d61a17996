"""The forward batch's check: the step's KV writes recorded, then the ``req_to_token`` rows and
sequence lengths attention will read verified, once per forward, at the forward's entry
(``ModelRunner.forward``), before any layer runs. Not at a layer's KV store: SGLang replays a
captured CUDA graph for most decode batches on a GPU (``decode_cuda_graph_runner.execute``), where
no Python runs per layer. Under enforce a refused request's KV writes go to the padding slot: the
forward batch's ``out_cache_loc`` is replaced by a copy with its slots at 0, which every layer
writes through (a graph replay copies it into its own buffer first).

One batched call each, with arrays SGLang already has: ``record_step_writes`` takes
``out_cache_loc`` as it is (split per request by the extend lengths), and the request keys are
one gather (``Guard._row_key[req_pool_indices]``). The rows are verified where they live:

- :class:`HostRowCheck`: ``req_to_token`` on the host. ``verify_step_rows`` reads each
  request's row in place by its row index (no gather): at page size 1 the row itself, otherwise
  the first slot of each page divided by the page size. A decode forward checks each row's
  window only (``check_step_window``, see :meth:`HostRowCheck._verify_rows`).
- :class:`DeviceRowCheck`: ``req_to_token`` on a GPU, read in place there by
  :class:`kvguard.DeviceGuard` on SGLang's current stream (``sync_tags``, ``set_readers``,
  ``clear_status``, ``verify_token_rows``: no gather, no host sync). The rows never come to the
  host, and nothing waits for the GPU in the forward: the device's verdicts are copied back
  behind the check's kernels, before the model's (``begin_drain``), and taken when SGLang builds
  an output (:meth:`HostRowCheck.take_verdicts`), where it has waited for the forward itself.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from .. import ConfigError, DeviceError, DeviceGuard, OwnershipTable, PoolConfig
from ..device_verdicts import DeviceVerdicts
from .arrays import _flat, _host, _in_place


class Guard(Protocol):
    """What the row checks read of the plugin's :class:`kvguard.sglang.Guard` (which they are
    handed, never import: the guard builds its check, the arrow goes one way)."""

    req_to_token_pool: Any
    table: OwnershipTable
    config: PoolConfig
    policy: str
    page_size: int
    full_check_every: int
    metrics: Any
    _row_key: Any
    _row_checked: Any
    _row_claimant: Any
    _row_live: Any
    _rows_stale: Any
    _readers: Any
    _reader_rows: Any
    _refused: Any
    _qsl_decode: Any
    _loc_host: Any

    def _stale_rows(self, *args: Any) -> Any: ...
    def _violation(self, *args: Any) -> Any: ...

logger = logging.getLogger("sglang.srt.kvguard")


def _on_device(req_to_token: Any) -> bool:
    """Whether SGLang's ``req_to_token`` lives on a CUDA device."""
    return bool(getattr(req_to_token, "is_cuda", False))


def row_check_for(guard: Guard, device_rows: bool | None) -> HostRowCheck:
    """The check for ``guard``'s pool: on the device when ``req_to_token`` is a CUDA tensor
    (``device_rows`` None or True), else on the host.

    Without a CUDA driver or NVRTC, ``DeviceGuard`` raises :class:`kvguard.DeviceError` (never a
    crash): with ``device_rows=None`` the guard falls back to the host check (as strong; it copies
    the rows), logs it and counts ``device_check_unavailable``; with ``device_rows=True`` it
    refuses to start (``ConfigError``)."""
    rows = guard.req_to_token_pool.req_to_token
    if device_rows is False or (device_rows is None and not _on_device(rows)):
        return HostRowCheck(guard)
    if not _on_device(rows):
        raise ConfigError("kvguard: device_rows=True, but SGLang's req_to_token is not on a CUDA device")
    try:
        return DeviceRowCheck(guard)
    except DeviceError as e:
        if device_rows:
            raise ConfigError(f"kvguard: the device check of req_to_token cannot start: {e}") from e
        guard.metrics["device_check_unavailable"] += 1
        logger.warning("kvguard: no device check (%s); req_to_token rows are checked on the host", e)
        return HostRowCheck(guard)


class HostRowCheck:
    """The forward batch checked on the host (see the module doc)."""

    where = "host"
    windows_on_host = True
    """A decode forward's windows are checked on the host, with its writes, in one call."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.pending = False
        """Between ``begin`` and ``end``: a forward is running."""
        self.split_batch: Any = None
        """The forward batch of a split prefill (``--enable-pdmux``: ``ModelRunner.forward`` runs
        once per slice of its layers, with the same batch) checked before its first slice."""
        # The forward's rows and lengths as SGLang gave them, and as numpy arrays once a path
        # needs them (the common decode forward hands SGLang's host tensors to the binding).
        self._rows_src: Any = np.zeros(0, dtype=np.int64)
        self._lens_src: Any = np.zeros(0, dtype=np.int64)
        self._rows_np: np.ndarray | None = None
        self._lens_np: np.ndarray | None = None
        self._qsl_np: np.ndarray | None = np.zeros(1, dtype=np.int32)
        self._rows_dev: Any = None
        self._lens_dev: Any = None
        self._req_to_token: np.ndarray | None = None
        self._decode = False
        self._forwards = 0
        self._readers: np.ndarray | None = None

    def begin(self, rows: Any, seq_lens: Any, extend_lens: Any, rows_cpu: Any, seq_lens_cpu: Any) -> None:
        """A forward over ``rows`` of ``req_to_token`` is about to run."""
        g = self.guard
        self._rows_dev, self._lens_dev = rows, seq_lens
        self._rows_src = rows if rows_cpu is None else rows_cpu
        self._lens_src = seq_lens if seq_lens_cpu is None else seq_lens_cpu
        self._rows_np = self._lens_np = None
        self._decode = extend_lens is None
        if extend_lens is None:
            # One token a row: made when a path reads it (the common decode forward does not).
            self._qsl_np = None
        else:
            n = len(self._rows_src)
            self._qsl_np = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(_flat(extend_lens), out=self._qsl_np[1:])
        readers, g._readers = g._readers, None
        reader_rows, g._reader_rows = g._reader_rows, None
        # The batch's requests, from its allocation, for this forward only: the same rows in the
        # same order (a forward no alloc_for_extend / alloc_for_decode prepared is not judged so).
        self._readers = None
        if readers is not None and reader_rows is not None:
            rows = self._rows
            if len(reader_rows) == len(rows) and np.array_equal(reader_rows, rows):
                self._readers = readers
        self.pending = True

    @property
    def _qsl(self) -> np.ndarray:
        """Each row's first position in the forward's slots, and their end: one a row in decode."""
        if self._qsl_np is None:
            self._qsl_np = self.guard._qsl_decode[: len(self._rows_src) + 1]
        return self._qsl_np

    @property
    def _rows(self) -> np.ndarray:
        """The forward's ``req_to_token`` rows, as a 1-D host array."""
        if self._rows_np is None:
            self._rows_np = _flat(self._rows_src)
        return self._rows_np

    @property
    def _lens(self) -> np.ndarray:
        """The forward's sequence lengths, as a 1-D host array."""
        if self._lens_np is None:
            self._lens_np = _flat(self._lens_src)
        return self._lens_np

    def end(self) -> None:
        """The forward is over."""
        self.pending = False
        self._rows_dev = self._lens_dev = None
        self.guard._loc_host = None

    def take_verdicts(self) -> None:
        """The verdicts of every forward checked so far, taken before an output leaves the
        scheduler. On the host they were taken in the check itself: nothing to do."""

    def check(self, loc: Any) -> Any:
        """The whole check, after :meth:`begin` and before any layer runs: the forward's writes
        ``loc`` (its ``out_cache_loc``, one slot per new token) recorded and its rows verified.
        Returns the slots the forward is to write: ``loc`` itself, or under enforce a copy with
        a refused request's slots at the padding slot 0."""
        g = self.guard
        self._forwards += 1
        full = g._rows_stale or not self._decode or self._forwards % g.full_check_every == 0
        stale = None if self._readers is None else g._stale_rows(self._rows, self._readers, "read")
        if stale is not None:
            full = True
        if not full and self.windows_on_host:
            # The common decode forward: the writes recorded and each row's window checked in
            # one call, the mirror's checked lengths updated in it (see _verify_rows); SGLang's
            # host tensors read in place.
            stop = g.table.check_decode_forward(
                g._row_key, g._row_claimant, g._row_checked, self._host_rows(),
                _in_place(self._rows_src), _in_place(self._lens_src),
                # (_slots' test inline: the host path keeps no copy, and pays no call for it)
                _in_place(loc) if g._loc_host is None else self._slots(loc, _in_place),
            )
            if stop is None:
                return loc
            stage, verdict = stop
            rows = self._rows
            if stage == "writes":
                keys = g._row_key[rows]
                return self._after_writes(loc, keys, np.zeros(len(rows), dtype=bool), verdict, None, full)
            if stage == "window":
                # The writes are recorded; the judged full check says what the window found.
                keys = g._row_key[rows]
                refused = np.zeros(len(rows), dtype=bool)
                for i, v in self._verify_rows(None, keys, True):
                    refused[i] = True
                    g._refused(int(keys[i]), v)
                return self._refuse(loc, refused)
            # "full": a row of no live request, or not one slot per row: the general path.
        rows, slots = self._rows, self._slots(loc, _flat)
        qsl = self._qsl
        keys = g._row_key[rows]
        live = g._row_live[rows]
        refused = ~live if stale is None else ~live | stale
        # count_nonzero: a C call (ndarray.all goes through numpy's Python wrapper), every step.
        if np.count_nonzero(refused) == 0:
            verdict = g.table.record_step_writes(keys, slots, qsl)
            if verdict.clean:
                # Every row live, every write recorded.
                refusals = self._verify_rows(None, keys, full)
                if not refusals:
                    return loc
                for i, v in refusals:
                    refused[i] = True
                    g._refused(int(keys[i]), v)
                return self._refuse(loc, refused)
            return self._after_writes(loc, keys, refused, verdict, None, full)
        # Rows of requests kvguard never admitted (or already released), and rows their reader
        # does not hold: their writes are not the table's to record; they are masked below.
        pos = np.flatnonzero(~refused)
        counts = np.diff(qsl)[pos]
        sub_qsl = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(counts, out=sub_qsl[1:])
        take = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in pos.tolist()]) if len(pos) else pos
        verdict = g.table.record_step_writes(keys[pos], slots[take], sub_qsl)
        return self._after_writes(loc, keys, refused, verdict, pos, full)

    def _slots(self, loc: Any, read: Any) -> Any:
        """The forward's slots ``loc`` on the host: the copy kvguard made of them at the decode
        row write, while ``loc`` is the tensor it was made of and unchanged since (its version;
        ``Guard._note_loc``); else ``read(loc)`` (a host tensor read in place, a device tensor
        copied)."""
        known = self.guard._loc_host
        if known is not None and known[0] is loc and getattr(loc, "_version", None) == known[1]:
            return known[2]
        return read(loc)

    def _after_writes(
        self, loc: Any, keys: np.ndarray, refused: np.ndarray, verdict: Any, pos: np.ndarray | None, full: bool
    ) -> Any:
        """The writes' verdict (over the rows at batch positions ``pos``; None: every row) taken:
        its refused rows marked, the rest verified."""
        g = self.guard
        for i, v in verdict.refused:
            at = i if pos is None else int(pos[i])
            refused[at] = True
            g._refused(int(keys[at]), v)
        ok = np.flatnonzero(~refused)
        if len(ok):
            for i, v in self._verify_rows(ok, keys[ok], full):
                refused[ok[i]] = True
                g._refused(int(keys[ok[i]]), v)
        return self._refuse(loc, refused)

    def _host_rows(self) -> np.ndarray:
        """SGLang's ``req_to_token`` as a host array (SGLang allocates it once)."""
        if self._req_to_token is None:
            self._req_to_token = _host(self.guard.req_to_token_pool.req_to_token)
        return self._req_to_token

    def _refuse(self, loc: Any, refused: np.ndarray) -> Any:
        """Under enforce, the refused rows' writes go to the padding slot 0 (every layer's: the
        forward writes through the copy returned)."""
        if refused.any() and self.guard.policy == "enforce":
            qsl = self._qsl
            bad = np.flatnonzero(refused).tolist()
            slots = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in bad])
            masked = loc.clone()
            masked[slots] = 0
            return masked
        return loc

    def _verify_rows(self, pos: np.ndarray | None, keys: np.ndarray, full: bool) -> list[tuple[int, Any]]:
        """Verifies the rows at batch positions ``pos`` (None: every row); returns (index into
        pos, violation).

        A decode forward checks each row's window only (``full`` False): the pages holding the
        tokens written since the row's last clean check (one page per row in decode), in one
        pure check (``check_step_window``, or ``check_decode_forward`` with the writes). The
        rest of the row is as it was when found clean: its entries are rewritten only through
        ``ReqToTokenPool.write`` (which lowers the row's checked length), and a checked page
        becomes unreadable only by a release (its request's rows are checked in full next), an
        eviction, a free nobody holds or a violation (each makes the next forward a full check
        of every row, ``Guard._rows_stale``). Anything the window check refuses, and every
        ``full_check_every``-th forward, goes to the full ``verify_step_rows``, so verdicts are
        exactly the full check's."""
        g = self.guard
        lens = self._lens if pos is None or len(pos) == len(self._lens) else self._lens[pos]
        rows = self._rows if pos is None or len(pos) == len(self._rows) else self._rows[pos]
        rt = self._host_rows()
        if not full:
            checked = g._row_checked[rows]
            window = g.table.check_step_window(keys, rt, rows, lens, checked, token_slots=True)
            if window.clean:
                g._row_checked[rows] = lens
                return []
        # The full check through the table's slot-row cache: a row unchanged byte for byte since
        # its last clean check, whose request lost nothing since, is judged from that check's
        # last page (the same verdicts; an entry changed behind SGLang's calls is still found).
        verdict = g.table.verify_step_rows(keys, rt, rows, lens, token_slots=True, cached=True)
        if g._rows_stale:
            # Rows outside this forward were not checked against what changed: in full next time.
            g._row_checked[:] = 0
            g._rows_stale = False
        g._row_checked[rows] = lens
        if verdict.clean:
            return []
        refused = verdict.refused
        g._row_checked[rows[[i for i, _ in refused]]] = 0
        return refused


class DeviceRowCheck(HostRowCheck):
    """The forward batch's rows checked on the GPU by :class:`kvguard.DeviceGuard`, on SGLang's
    stream. Writes are recorded on the host as before (``out_cache_loc``, one entry per new
    token); the rows (``width`` entries per request) stay on the device.

    Nothing in the forward waits for the GPU. Under SGLang's overlap schedule (its default) the
    next batch's forward is launched while the last one runs, and its result processed after:
    a drain (a synchronisation) when the forward ends would wait for the model it just launched
    and serialise the two. So the device's violation ring is copied to the host right behind the
    check's kernels, before the model's, and its verdicts are taken when SGLang builds an output
    (:meth:`take_verdicts`, from ``Guard.check_rows_before_output``): SGLang has waited for that
    forward by then, and the copy waits only for the checks queued before it
    (:class:`kvguard.device_verdicts.DeviceVerdicts`, shared with vLLM's V2 runner).
    A refused request is aborted before any output of the forward that read its rows leaves."""

    where = "device"
    windows_on_host = False

    def __init__(self, guard: Guard) -> None:
        super().__init__(guard)
        rows = guard.req_to_token_pool.req_to_token
        index = getattr(rows.device, "index", None) or 0
        self.device_guard = DeviceGuard(guard.config, device=int(index), max_seqs=int(rows.shape[0]))
        self.verdicts = DeviceVerdicts(self.device_guard)
        """The device's verdicts, copied behind each forward's checks, taken before an output."""
        self._inflight: tuple[Any, ...] | None = None

    def _current_stream(self) -> int:
        import torch

        return int(torch.cuda.current_stream(self.guard.req_to_token_pool.req_to_token.device).cuda_stream)

    def _verify_rows(self, pos: np.ndarray | None, keys: np.ndarray, full: bool) -> list[tuple[int, Any]]:
        import torch

        g = self.guard
        rt = g.req_to_token_pool.req_to_token
        if pos is None:
            pos = np.arange(len(self._rows))
        lens = self._lens if len(pos) == len(self._lens) else self._lens[pos]
        rows_dev = torch.as_tensor(self._rows_dev, device=rt.device).reshape(-1)
        lens_dev = torch.as_tensor(self._lens_dev, device=rt.device).reshape(-1)
        if len(pos) != len(self._rows):
            at = torch.as_tensor(pos, device=rt.device)
            rows_dev, lens_dev = rows_dev[at], lens_dev[at]
        ps = g.page_size
        stream = self._current_stream()
        dg = self.device_guard
        dg.sync_tags(g.table, stream=stream)
        readers = keys.tolist()
        dg.set_readers(g.table, readers, stream=stream)
        dg.clear_status(stream=stream)
        if rt.dtype == torch.int32 and rt.dim() == 2 and rt.is_contiguous():
            # SGLang's req_to_token read in place: page j of a row is its entry j * page_size.
            rows_dev = rows_dev.to(torch.int64).contiguous()
            lens_dev = lens_dev.to(torch.int64).contiguous()
            pages = -(-int(lens.max()) // ps) if len(lens) else 0
            dg.verify_token_rows(
                rt.data_ptr(), int(rt.shape[0]), int(rt.shape[1]), rows_dev.data_ptr(), lens_dev.data_ptr(),
                len(pos), pages, stream=stream,
            )
            # The launch reads these until it completes: keep them until the drain.
            self._inflight = (rows_dev, lens_dev)
        else:
            # Another layout: the page table gathered on the device first.
            width = int(lens.max()) if len(lens) else 0
            table = rt[rows_dev, :width:ps] if ps > 1 else rt[rows_dev, :width]
            if ps > 1:
                table = torch.div(table, ps, rounding_mode="floor")
            table = table.to(torch.int32).contiguous()
            seq = lens_dev.to(torch.int32).contiguous()
            dg.verify_block_table(table.data_ptr(), seq.data_ptr(), len(pos), int(table.shape[1]), stream=stream)
            self._inflight = (table, seq)
        self.verdicts.queued(g.table, stream=stream, readers=readers)
        return []

    def take_verdicts(self) -> None:
        """The device's verdicts on every forward checked so far, each refused request aborted
        (:meth:`kvguard.device_verdicts.DeviceVerdicts.through`: the copy in flight finished,
        waiting only for the checks queued before it). A request read in a forward whose
        findings the device lost is refused too: the one flagged is among them."""
        g = self.guard
        for v in self.verdicts.through(g.table):
            key = v.request
            if isinstance(key, int):
                g._refused(key, v)
            else:
                g._violation(None, v)
        for key in self.verdicts.take_unresolved():
            g._abort_plain(
                key,
                "the device flagged a request of this forward and the record naming it was lost "
                "(more flagged requests between two drains than half its ring holds): every "
                "request the forward read is refused",
                kind="device_findings_lost",
            )

    def end(self) -> None:
        """The forward is over: nothing waits for it (its verdicts are taken before its output
        leaves, :meth:`take_verdicts`). The check's rows and lengths on the device are let go:
        the caching allocator hands their memory only to work queued after the check on the
        same stream."""
        self._inflight = None
        super().end()
