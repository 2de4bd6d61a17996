"""The writes SGLang makes into ``req_to_token`` and the radix cache, followed as it makes them: a
decode step's row write (one call for the batch, ``write_decode_rows``), a prefill's
``write_cache_indices``, a PD decode's pre-allocation, the cache's inserts (pages published as
prefixes), and a batch request writing through a row it no longer holds. ``RowWrites`` is the
part of :class:`kvguard.sglang.Guard` that follows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ViolationError
from .arrays import _flat, _in_place, _pages_of
from .releases import _NO_OWNER, LocalViolation

_BEYOND_ANY_POOL = 2**32 - 1
"""The page a slot outside any pool (negative, or past 32-bit page ids) is judged as: the table
refuses it as page_out_of_range, as the binding's own row checks do, instead of raising."""


class RowWrites:
    """The part of :class:`kvguard.sglang.Guard` that follows SGLang's writes of its rows and cache."""

    def _wrap_row_write(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def write(indices: Any, values: Any) -> Any:
            if self._writing_cache_indices:
                return inner(indices, values)  # judged from write_cache_indices' arguments
            rows, cols = indices
            if isinstance(cols, slice):
                row = int(rows)
                start = cols.start or 0
                if start < self._row_checked[row]:
                    self._row_checked[row] = start
                self._row_written(row, _flat(values))
            else:
                writers, self._writers = self._writers, None
                if writers is not None and len(writers) == len(rows):
                    rows_a, cols_a, slots = _flat(rows), _flat(cols), _flat(values)
                    stale = self._stale_rows(rows_a, writers, "write")
                    if stale is not None and self.policy == "enforce":
                        # The stale writer's entry is not written: the row is another request's;
                        # the slot the allocator gave it goes back (no row names it).
                        ps = self.page_size
                        dropped = slots[stale] // ps if ps > 1 else slots[stale]
                        fresh = dropped[(self._page_key[dropped] == _NO_OWNER) & (self._page_prefix[dropped] == 0)
                                        & self._handed_now()[dropped]]
                        if ps > 1:
                            # Only a page that opened for the dropped slot (its first slot).
                            fresh = fresh[(slots[stale][np.isin(dropped, fresh)] % ps) == 0]
                        self._give_back(np.unique(fresh))
                        ok = np.flatnonzero(~stale)
                        self._decode_rows_written(rows_a[ok], cols_a[ok], slots[ok])
                        if not len(ok):
                            return None
                        import torch

                        at = torch.as_tensor(ok)
                        return inner((rows[at], cols[at]), values[at])
                # SGLang's host tensors read in place by the binding; a device batch's rows and
                # columns from the host copies SGLang keeps of them (no copy of its tensors).
                known = self._decode_rows_host
                if known is not None and known[0] is rows and len(known[1]) == len(rows):
                    rows = known[1]
                    if known[2] is not None and len(known[2]) == len(rows):
                        cols = known[2]
                slots = _in_place(values)
                self._decode_rows_written(_in_place(rows), _in_place(cols), slots)
                if slots is not values:
                    # A copy (of a device tensor): kept for the batch's forward (_note_loc).
                    self._written_slots = slots
            return inner(indices, values)

        return write

    def _batch_reqs(self, reqs: Any) -> None:
        """The requests of the batch SGLang is preparing (``alloc_for_extend`` /
        ``alloc_for_decode``), in batch order: the writers of its row write and the readers of its
        forward, each judged against the row it uses (a request whose row was freed and handed to
        another is the one refused, never the row's new owner). Gathered only while a request
        whose row went back unfinished has not been given a new one (``_suspects``): only such a
        request can use a row it no longer holds, and the gather is one lookup per request."""
        if not self._suspects:
            # No request lost its row while unfinished: every batch request uses its own row.
            return
        get = self._keys.get
        keys = np.fromiter((get(r.rid, 0) for r in reqs), dtype=np.int64, count=len(reqs))
        self._writers = self._readers = keys
        self._batch = reqs

    def _stale_rows(self, rows: np.ndarray, users: np.ndarray, op: str) -> np.ndarray | None:
        """Batch positions whose request uses a ``req_to_token`` row it does not hold (its row
        freed, maybe handed to another request): each refused on that request; None when none."""
        holders = self._row_key[rows]
        stale = holders != users
        if not stale.any():
            return None
        for i in np.flatnonzero(stale).tolist():
            user, holder, row = int(users[i]), int(holders[i]), int(rows[i])
            reqs = self._batch
            name = reqs[i].rid if reqs is not None and i < len(reqs) else self._rids.get(user, user)
            whose = f"request {self._rids.get(holder, holder)!r}'s" if holder else "no request's"
            v = LocalViolation(
                "foreign_page", op, request=user or None, owner=holder or None,
                tenant=self._tenants.get(user), owner_tenant=self._tenants.get(holder),
                text=f"request {name!r} {'reads' if op == 'read' else 'writes'} through "
                f"req_to_token row {row}, which is {whose} (its own row was freed)",
            )
            self._refused_req(reqs[i] if reqs is not None and i < len(reqs) else None, user, v)
        return stale

    def _wrap_insert(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def insert(params: Any) -> Any:
            result = inner(params)
            if params.value is not None:
                key_len = len(params.key.page_aligned(self.page_size))
                new = _flat(params.value[result.prefix_len : key_len])
                self._published(_pages_of(new, self.page_size))
            return result

        return insert

    def _decode_rows_written(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """A decode step's ``req_to_token`` write, entries ``(rows[i], cols[i])`` set to
        ``slots[i]``, in one call (``write_decode_rows``), which also updates the mirror: a row's
        checked length drops to a column written below it (a decode step writes at the checked
        length: nothing to do), and each page claimed becomes its request's in ``_page_key``.
        A page its row's request already owns is nothing new (every step but one in page_size
        at page size > 1); every page a live row opens is claimed in one ``claim_step`` (each
        request's claim judged as its own claim call would be, in row order); a row that is not
        live or a prefix page goes through :meth:`_row_written`."""
        stop = self.table.write_decode_rows(
            self._row_key, self._row_claimant, self._page_key, self._page_prefix, self._row_checked, rows, cols, slots
        )
        if stop is None:
            return
        verdict, left = stop
        if not verdict.clean:
            for _, v in verdict.refused:
                self._refused(int(v.request), v)
        rows, slots = _flat(rows), _flat(slots)
        for i in left:
            self._row_written(int(rows[i]), slots[i : i + 1])

    def _note_loc(self, loc: Any, written: np.ndarray) -> None:
        """``alloc_for_decode`` returned ``loc``, the ``out_cache_loc`` SGLang hands the batch's
        forward, whose slots its row write gave as ``written`` (the row write takes them as
        int32) and kvguard copied to the host (a device tensor's copy, made on the stream that
        prepares the batch). The forward's check reads that copy while ``loc`` is the same tensor,
        unchanged since (its version): it makes no second copy at the forward's entry, on the
        forward's stream, where under SGLang's overlap schedule a copy waits for the forward
        before it (:meth:`kvguard.sglang.forward.HostRowCheck._slots`)."""
        self._loc_host = None
        if written is not None and loc is not None and len(written) == len(loc):
            self._loc_host = (loc, getattr(loc, "_version", None), written)

    def _cache_indices_written(
        self, out_cache_loc: Any, rows: Any, prefix_lens: Any, extend_lens: Any, prefix_tensors: Any
    ) -> None:
        """``write_cache_indices``: each request's row gets its prefix (the radix cache's match, or
        its own row for a later chunk) at ``[0, prefix_len)`` and its slice of the allocator's
        ``out_cache_loc`` after it. The prefix pages must already be the request's or a cached
        prefix of its tenant (attached here); only the allocator's new slots are claimed."""
        rows = _flat(rows).tolist()
        extend = _flat(extend_lens).tolist()
        out = _flat(out_cache_loc)
        pt = 0
        for i, row in enumerate(rows):
            self._row_checked[row] = 0
            prefix = prefix_tensors[i]
            if prefix is not None and prefix.numel():
                self._row_written(row, _flat(prefix), claim=False)
            n = int(extend[i])
            if n:
                self._row_written(row, out[pt : pt + n])
            pt += n

    def _preallocated(self, req: Any, kv_loc: Any) -> None:
        """A PD decode scheduler allocated ``kv_loc`` for ``req`` before its transfer
        (``alloc_for_decode_prealloc``): claimed for it now, from the allocator's decision; the
        row write that follows is judged against them."""
        row = req.kv.req_pool_idx
        if row is None or self._row_kv[int(row)] is not req.kv:
            return
        self._row_checked[int(row)] = 0
        self._row_written(int(row), _flat(kv_loc))

    def _row_written(self, row: int, slots: np.ndarray, *, claim: bool = True) -> None:
        key = int(self._row_key[row])
        if key == 0:
            return
        pages = [p if 0 <= p < _BEYOND_ANY_POOL else _BEYOND_ANY_POOL for p in _pages_of(slots, self.page_size).tolist()]
        if key not in self._admitted:
            # A request the intake refused (or never saw) must not get pages: the table answers
            # unknown_request, on this request.
            try:
                self.table.claim(key, pages)
            except ViolationError as e:
                self._refused(key, e.violation)
            return
        fresh: list[int] = []
        holds = self._holds[key]
        for page in pages:
            if 0 <= page < self._page_limit and self._page_key[page] == key:
                continue
            prefix = int(self._page_prefix[page]) if 0 <= page < self._page_limit else 0
            if prefix:
                if prefix not in holds:
                    try:
                        self.table.attach_prefix(key, prefix)
                        holds.add(prefix)
                    except ViolationError as e:
                        self._refused(key, e.violation)
                        return
                continue
            if page not in fresh:
                fresh.append(page)
        if fresh and claim:
            try:
                self.table.claim(key, fresh)
            except ViolationError as e:
                self._refused(key, e.violation)
                return
            self._page_key[fresh] = key

    def _published(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            if page in self._withheld:
                # The cache takes back a page whose eviction was refused: it is the tree's again.
                del self._withheld[page]
                continue
            if page <= 0 or page >= self._page_limit or self._page_prefix[page]:
                continue
            owner = int(self._page_key[page])
            if owner == _NO_OWNER:
                continue
            prefix = self._next_prefix
            self._next_prefix += 1
            try:
                self.table.publish_prefix(owner, prefix, [page])
            except ViolationError as e:
                self._refused(owner, e.violation)
                continue
            self._page_prefix[page] = prefix
            self._holds[owner].add(prefix)
            self._page_key[page] = _NO_OWNER
