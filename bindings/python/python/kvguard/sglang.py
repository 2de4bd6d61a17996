"""kvguard inside SGLang (0.5.23): shadow ownership of SGLang's own pool, checked at its own calls.

SGLang keeps its allocator; kvguard mirrors it (shadow mode, ``OwnershipTable.claim``) and judges
every event against its ownership table. A kvguard page is an SGLang allocator page: slot ``s``
lives in page ``s // page_size``; page 0 (SGLang's padding slot) is reserved and never readable.

What is hooked, on the instances one scheduler owns (no SGLang source is changed):

- ``ReqToTokenPool.alloc`` / ``free``: a request gets a row (its block table) / gives it back.
  The request must have been admitted (``Guard.admit``, the intake check).
- ``ReqToTokenPool.write``: slots written into a row, i.e. the pages attention will read for that
  request. A fresh page is claimed for the row's request; a radix-cache page is attached (held
  read-only, same tenant only); anything else is refused on that request.
- allocator ``_release_page_ids`` (paged) / ``free`` (page size 1): the page release every free
  ends in. Who frees is known from the caller hooked above it: ``free_kv_row`` (a request gives
  back its row's pages), ``evict`` (the radix cache drops a leaf), ``checkpoint`` (a request's
  duplicates of cached pages). A page its freer does not hold is refused and kept out of
  SGLang's free list (a double free never hands one page to two requests).
- ``RadixCache.insert`` / ``checkpoint`` / ``evict``: pages entering the tree are published as
  read-only prefixes (one key per page, so node splits change nothing); an evicted page whose
  prefix a running request still holds is refused (``evict_in_use``) and withheld until its last
  holder lets go.
- ``MHATokenToKVPool.set_kv_buffer`` (first layer of a forward): the step's writes
  (``out_cache_loc``, split per request) are recorded, then the rows of ``req_to_token`` and the
  sequence lengths attention will read are verified in one ``verify_step``. A refused row's
  writes go to the padding slot and the request is aborted.

Refusal under ``enforce``: exactly the refused request is aborted (``req.to_finish =
FINISH_ABORT``, the error its client receives), nothing is raised into the scheduler loop, which
keeps serving the others. Under ``report``: logged on the ``sglang.srt.kvguard`` logger and
counted in ``Guard.metrics``; SGLang runs as before.

PD disaggregation: :func:`audit_pd` refuses a deployment whose prefill or decode pool cannot hold
one max-context request; :class:`GuardedKVSender` / :class:`GuardedKVReceiver` wrap SGLang's
``BaseKVSender`` / ``BaseKVReceiver`` (mooncake, nixl, fake) so that every transfer carries a
kvguard manifest and the decode side refuses one that is missing or does not match.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from typing import Any

import numpy as np

from . import (
    ConfigError,
    Error,
    Manifest,
    OwnershipTable,
    PageRef,
    PoolConfig,
    Receiver,
    TransferError,
    Violation,
    ViolationError,
)

__all__ = [
    "ENV_POLICY",
    "Guard",
    "GuardedKVReceiver",
    "GuardedKVSender",
    "ManifestChannel",
    "audit_pd",
    "audit_pool",
]

ENV_POLICY = "KVGUARD_SGLANG"
"""The one setting: ``enforce`` or ``report`` turns the guard on in every SGLang scheduler."""

logger = logging.getLogger("sglang.srt.kvguard")

_TREE = object()
"""Freer marker: the radix cache itself drops pages (eviction)."""


def _pool_pages(allocator: Any) -> int:
    """Allocatable pages of an SGLang allocator (page 0 excluded)."""
    num_pages = getattr(allocator, "num_pages", None)
    return int(num_pages) if num_pages is not None else int(allocator.size) // int(allocator.page_size)


def _pool_config(allocator: Any, context_len: int, policy: str) -> PoolConfig:
    return PoolConfig(
        _pool_pages(allocator) + 1, int(allocator.page_size), int(context_len), reserved=[0], policy=policy
    )


def audit_pool(allocator: Any, context_len: int, *, side: str = "pool", policy: str = "enforce") -> PoolConfig:
    """Start-up audit of one SGLang pool: refused (``ConfigError``) unless one request of
    ``context_len`` tokens fits in its pages. The message names both numbers."""
    config = _pool_config(allocator, context_len, policy)
    capacity = config.capacity_tokens()
    if capacity < context_len:
        raise ConfigError(
            f"kvguard: the {side} KV pool holds {capacity} tokens "
            f"({_pool_pages(allocator)} pages of {allocator.page_size}), fewer than one "
            f"max-context request of {context_len} tokens; refusing to start "
            f"(lower --context-length or give the pool more memory)"
        )
    try:
        config.audit()
    except ConfigError as e:
        raise ConfigError(f"kvguard: the {side} KV pool fails the start-up audit: {e}") from e
    return config


def audit_pd(prefill_allocator: Any, decode_allocator: Any, context_len: int) -> None:
    """Start-up audit of both sides of a PD deployment against the model's context length;
    either side too small is refused, naming its capacity and the context length."""
    audit_pool(prefill_allocator, context_len, side="prefill")
    audit_pool(decode_allocator, context_len, side="decode")


def _default_tenant(req: Any) -> str:
    """A request's tenant: an explicit ``kvguard_tenant``, else its cache salt (SGLang's own
    isolation key), else ``default``. Read once, at admission."""
    return getattr(req, "kvguard_tenant", None) or getattr(req, "cache_salt", None) or "default"


def _finish_abort(message: str) -> Any:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVGuardViolation")


class Guard:
    """kvguard for one SGLang scheduler: its ``ReqToTokenPool``, token allocator, radix cache and
    KV pool, hooked on the instances (see the module doc).

    ``policy``: ``enforce`` (abort the refused request) or ``report`` (log and count).
    ``context_len``: the model's context length; the pool is audited against it at construction.
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        allocator: Any,
        *,
        tree_cache: Any = None,
        kv_pool: Any = None,
        context_len: int | None = None,
        policy: str = "enforce",
        side: str = "pool",
        tenant_of: Callable[[Any], Any] = _default_tenant,
    ) -> None:
        if policy not in ("enforce", "report"):
            raise ConfigError(f"kvguard: policy must be 'enforce' or 'report', not {policy!r}")
        self.policy = policy
        self.page_size = int(allocator.page_size)
        self.context_len = int(context_len if context_len is not None else req_to_token_pool.max_context_len)
        self.config = audit_pool(allocator, self.context_len, side=side, policy=policy)
        self.table = OwnershipTable(self.config)
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.kv_pool = kv_pool
        self.tenant_of = tenant_of
        self.metrics: Counter[str] = Counter()
        """``violations_total`` and ``violations_total:<kind>``, ``aborted_requests``, ``withheld_pages``."""
        self.aborted: dict[Any, Violation | str] = {}
        """Requests aborted under enforce, with the violation that refused them."""
        self.violations: list[Violation] = []
        """Every violation seen, in order (report and enforce)."""
        self.refusals: list[tuple[Any, Violation]] = []
        """Every violation with the SGLang ``rid`` it was charged to (None: the radix cache's)."""
        self._reqs: dict[Any, Any] = {}
        self._admitted: set[Any] = set()
        self._row_owner: dict[int, Any] = {}
        self._page_owner: dict[int, Any] = {}
        self._owned: dict[Any, set[int]] = {}
        self._tree_pages: dict[int, int] = {}
        self._tenant_ids: dict[Any, int] = {}
        self._holds: dict[Any, set[int]] = {}
        self._withheld: dict[int, int] = {}
        self._next_key = 1
        self._freer: Any = None
        self._forward: tuple[list[Any], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._forward_checked = False
        self._forward_refused_slots: np.ndarray | None = None
        self._hook()

    # ---- hooks -------------------------------------------------------------------------------

    def _hook(self) -> None:
        pool = self.req_to_token_pool
        pool.alloc = self._wrap_alloc_rows(pool.alloc)
        pool.free = self._wrap_free_row(pool.free)
        pool.write = self._wrap_row_write(pool.write)
        alloc = self.allocator
        if hasattr(alloc, "_release_page_ids"):
            alloc._release_page_ids = self._wrap_release_page_ids(alloc._release_page_ids)
        else:
            alloc.free = self._wrap_token_free(alloc.free)
        tree = self.tree_cache
        if tree is not None:
            tree.insert = self._wrap_insert(tree.insert)
            tree.checkpoint = self._wrap_freer(tree.checkpoint, lambda req, **_: self._rid(req))
            tree.free_kv_row = self._wrap_freer(tree.free_kv_row, lambda kv, *_a, **_k: self._row_rid(kv))
            tree.evict = self._wrap_freer(tree.evict, lambda *_a, **_k: _TREE)
        if self.kv_pool is not None:
            self.kv_pool.set_kv_buffer = self._wrap_set_kv_buffer(self.kv_pool.set_kv_buffer)

    def _wrap_alloc_rows(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def alloc(reqs: list[Any]) -> Any:
            fresh = [r for r in reqs if not r.kv.holds_kv]
            for req in fresh:
                rid = self._rid(req)
                if rid not in self._admitted and rid not in self.aborted:
                    self.admit(req)
            rows = inner(reqs)
            if rows is not None:
                for req in fresh:
                    self._row_owner[int(req.kv.req_pool_idx)] = self._rid(req)
            return rows

        return alloc

    def _wrap_free_row(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def free(req: Any) -> Any:
            row = req.kv.req_pool_idx
            self.release(req)
            if row is not None:
                self._row_owner.pop(int(row), None)
            return inner(req)

        return free

    def _wrap_row_write(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def write(indices: Any, values: Any) -> Any:
            rows, cols = indices
            if isinstance(cols, slice):
                self._row_written(int(rows), _host(values))
            else:
                # A decode step: one slot per row. Only a page the row's request does not own yet
                # needs the table (a new page every page_size steps).
                ps = self.page_size
                slots = _host(values).reshape(-1).tolist()
                owner, owned = self._row_owner, self._owned
                for row, slot in zip(_host(rows).reshape(-1).tolist(), slots, strict=True):
                    rid = owner.get(row)
                    mine = owned.get(rid)
                    if mine is not None and slot // ps in mine:
                        continue
                    self._row_written(int(row), np.array([slot], dtype=np.int64))
            return inner(indices, values)

        return write

    def _wrap_release_page_ids(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def release_page_ids(*page_ids: Any) -> Any:
            kept = [self._released(_host(ids).reshape(-1)) for ids in page_ids]
            kept = [k for k in kept if len(k)]
            if kept:
                import torch

                dev = self.allocator.device
                return inner(*(torch.as_tensor(k, dtype=torch.int64, device=dev) for k in kept))
            return None

        return release_page_ids

    def _wrap_token_free(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def free(free_index: Any) -> Any:
            if free_index.numel() == 0 or self.allocator.free_group is not None:
                return inner(free_index)
            kept = self._released(_host(free_index).reshape(-1))
            if len(kept) == free_index.numel():
                return inner(free_index)
            if len(kept):
                import torch

                return inner(torch.as_tensor(kept, dtype=free_index.dtype, device=free_index.device))
            return None

        return free

    def _wrap_freer(self, inner: Callable[..., Any], who: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            outer = self._freer
            self._freer = who(*args, **kwargs)
            try:
                return inner(*args, **kwargs)
            finally:
                self._freer = outer

        return call

    def _wrap_insert(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def insert(params: Any) -> Any:
            result = inner(params)
            if params.value is not None:
                key_len = len(params.key.page_aligned(self.page_size))
                new = _host(params.value[result.prefix_len : key_len]).reshape(-1)
                self._published(_pages_of(new, self.page_size))
            return result

        return insert

    def _wrap_set_kv_buffer(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        start_layer = int(getattr(self.kv_pool, "start_layer", 0) or 0)

        def set_kv_buffer(layer: Any, loc: Any, cache_k: Any, cache_v: Any, *args: Any, **kwargs: Any) -> Any:
            layer_id = kwargs.get("layer_id_override")
            if layer_id is None:
                layer_id = layer.layer_id
            if self._forward is not None and int(layer_id) == start_layer and not self._forward_checked:
                self._forward_checked = True
                loc = self._check_forward(loc)
            elif self._forward is not None and self._forward_refused_slots is not None:
                loc = self._mask_refused(loc)
            return inner(layer, loc, cache_k, cache_v, *args, **kwargs)

        return set_kv_buffer

    # ---- requests ----------------------------------------------------------------------------

    @staticmethod
    def _rid(req: Any) -> Any:
        return req.rid

    def _row_rid(self, kv: Any) -> Any:
        return self._row_owner.get(int(kv.req_pool_idx))

    def admit(self, req: Any, *, prompt_tokens: int | None = None) -> bool:
        """Intake check (the scheduler's ``_add_request_to_queue``): a request whose prompt plus
        ``max_new_tokens`` can never fit the pool or the context length is refused before any page
        or row is touched. ``prompt_tokens`` defaults to the longer of ``origin_input_ids`` and
        ``origin_input_ids_unpadded``, so SGLang's one-token abort stub is judged at the length the
        client sent. Returns whether it was admitted;
        a refused request is aborted (its ``to_finish`` names the two numbers)."""
        rid = self._rid(req)
        self._reqs[rid] = req
        if prompt_tokens is None:
            # set_finish_with_abort swaps origin_input_ids for a one-token stub; the unpadded copy
            # keeps what the client sent.
            unpadded = getattr(req, "origin_input_ids_unpadded", None) or ()
            prompt_tokens = max(len(req.origin_input_ids), len(unpadded))
        prompt = int(prompt_tokens)
        max_new = int(getattr(req.sampling_params, "max_new_tokens", None) or 0)
        try:
            self.table.admit(rid, self._tenant_key(self.tenant_of(req)), prompt, max_new)
        except ViolationError as e:
            self._refused(rid, e.violation)
            return False
        self._admitted.add(rid)
        self._owned[rid] = set()
        self._holds[rid] = set()
        return True

    def _tenant_key(self, tenant: Any) -> int:
        """A stable int per tenant. The table interns a str tenant only while one of its requests
        lives, but a radix-cache prefix outlives its publisher: with str ids, the next request of
        the same tenant would get a new id and be refused as another tenant."""
        key = self._tenant_ids.get(tenant)
        if key is None:
            key = self._tenant_ids[tenant] = len(self._tenant_ids) + 1
        return key

    def release(self, req: Any) -> None:
        """The request gives its row back: every hold and page it still has ends in kvguard."""
        rid = self._rid(req)
        if rid not in self._admitted:
            return
        self._admitted.discard(rid)
        for page in self._owned.pop(rid, ()):
            self._page_owner.pop(page, None)
        self._holds.pop(rid, None)
        try:
            self.table.release(rid)
        except ViolationError as e:
            self._violation(rid, e.violation)
        self._reqs.pop(rid, None)
        self._return_withheld()

    # ---- events ------------------------------------------------------------------------------

    def _row_written(self, row: int, slots: np.ndarray) -> None:
        rid = self._row_owner.get(row)
        if rid is None:
            return
        if rid not in self._admitted:
            # A request the intake refused (or never saw) must not get pages: the table answers
            # unknown_request, on this request.
            try:
                self.table.claim(rid, _pages_of(slots, self.page_size).tolist())
            except ViolationError as e:
                self._refused(rid, e.violation)
            return
        owned = self._owned[rid]
        fresh: list[int] = []
        for page in _pages_of(slots, self.page_size).tolist():
            if page in owned or page in fresh:
                continue
            key = self._tree_pages.get(page)
            if key is not None:
                if key not in self._holds[rid]:
                    try:
                        self.table.attach_prefix(rid, key)
                        self._holds[rid].add(key)
                    except ViolationError as e:
                        self._refused(rid, e.violation)
                        return
                continue
            fresh.append(page)
        if fresh:
            try:
                self.table.claim(rid, fresh)
            except ViolationError as e:
                self._refused(rid, e.violation)
                return
            owned.update(fresh)
            for page in fresh:
                self._page_owner[page] = rid

    def _published(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            if page in self._withheld:
                # The cache takes back a page whose eviction was refused: it is the tree's again.
                del self._withheld[page]
                continue
            if page in self._tree_pages or page == 0:
                continue
            owner = self._page_owner.get(page)
            if owner is None:
                continue
            key = self._next_key
            self._next_key += 1
            try:
                self.table.publish_prefix(owner, key, [page])
            except ViolationError as e:
                self._refused(owner, e.violation)
                continue
            self._tree_pages[page] = key
            self._holds[owner].add(key)
            self._owned[owner].discard(page)
            del self._page_owner[page]

    def _released(self, pages: np.ndarray) -> list[int]:
        """Judges one release of ``pages``; returns those SGLang may put back in its free list."""
        freer = self._freer
        kept: list[int] = []
        by_owner: dict[Any, list[int]] = {}
        for page in pages.tolist():
            key = self._tree_pages.get(page)
            if key is not None and (freer is _TREE or freer is None):
                try:
                    self.table.evict_prefix(key)
                except ViolationError as e:
                    self._violation(None, e.violation)
                    if self.policy == "enforce":
                        self._withheld[page] = key
                        self.metrics["withheld_pages"] += 1
                        continue
                del self._tree_pages[page]
                kept.append(page)
                continue
            rid = freer if freer is not None and freer is not _TREE else self._page_owner.get(page)
            by_owner.setdefault(rid, []).append(page)
        for rid, own in by_owner.items():
            kept.extend(self._release_owned(rid, own))
        return kept

    def _release_owned(self, rid: Any, pages: list[int]) -> list[int]:
        if rid is None or rid is _TREE or rid not in self._admitted:
            # Nobody in kvguard holds these pages: a release no request can make.
            owner = self._page_owner.get(pages[0]) if pages else None
            for page in pages:
                if page in self._page_owner:
                    continue
                self.metrics["unattributed_frees"] += 1
            logger.warning("kvguard: free of pages %s that no live request holds (freer %r)", pages[:8], owner)
            return pages if self.policy == "report" else []
        try:
            self.table.release_pages(rid, pages)
            ok = pages
        except ViolationError as e:
            self._refused(rid, e.violation)
            ok = []
            for page in pages:
                if self._page_owner.get(page) == rid:
                    try:
                        self.table.release_pages(rid, [page])
                        ok.append(page)
                    except ViolationError:
                        pass
            if self.policy == "report":
                ok = pages
        for page in ok:
            if self._page_owner.get(page) == rid:
                del self._page_owner[page]
                self._owned[rid].discard(page)
        return ok

    def _return_withheld(self) -> None:
        """Pages whose eviction was refused go back to SGLang once their last holder let go."""
        if not self._withheld:
            return
        back = []
        for page, key in list(self._withheld.items()):
            try:
                self.table.evict_prefix(key)
            except ViolationError:
                continue
            del self._withheld[page]
            del self._tree_pages[page]
            back.append(page)
        if back:
            import torch

            ids = torch.as_tensor(back, dtype=torch.int64, device=self.allocator.device)
            freer, self._freer = self._freer, _TREE
            try:
                if hasattr(self.allocator, "_release_page_ids"):
                    self.allocator._release_page_ids(ids)
                else:
                    self.allocator.free(ids)
            finally:
                self._freer = freer

    # ---- the forward batch ---------------------------------------------------------------------

    def begin_forward(self, req_pool_indices: Any, seq_lens: Any, extend_lens: Any = None) -> None:
        """A forward is about to run (``ModelRunner.forward``): the rows of ``req_to_token`` and
        the sequence lengths attention will read, and each request's new tokens this step
        (``extend_seq_lens``; one per request in decode). Checked at the first layer's KV store."""
        rows = _host(req_pool_indices).reshape(-1).astype(np.int64)
        lens = _host(seq_lens).reshape(-1).astype(np.int32)
        new = np.ones_like(lens) if extend_lens is None else _host(extend_lens).reshape(-1).astype(np.int32)
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(new, out=qsl[1:])
        rids = [self._row_owner.get(int(r)) for r in rows.tolist()]
        self._forward = (rids, rows, lens, qsl)
        self._forward_checked = False
        self._forward_refused_slots = None

    def end_forward(self) -> None:
        """The forward is over."""
        self._forward = None
        self._forward_refused_slots = None

    def _check_forward(self, loc: Any) -> Any:
        rids, rows, lens, qsl = self._forward
        live = [i for i, r in enumerate(rids) if r is not None and r in self._admitted]
        refused: set[int] = set()
        if len(live) != len(rids):
            refused.update(i for i in range(len(rids)) if i not in set(live))
        loc_host = _host(loc).reshape(-1).astype(np.int64)
        if live:
            ids = [rids[i] for i in live]
            if len(live) == len(rids):
                step_qsl = qsl
                slots = loc_host
            else:
                step_qsl = np.zeros(len(live) + 1, dtype=np.int32)
                np.cumsum(np.diff(qsl)[live], out=step_qsl[1:])
                slots = np.concatenate([loc_host[qsl[i] : qsl[i + 1]] for i in live])
            verdict = self.table.record_step_writes(ids, slots, step_qsl)
            for row, v in verdict.refused:
                refused.add(live[row])
                self._refused(ids[row], v)
            ok = [i for i in live if i not in refused]
            if ok:
                self._verify_rows([rids[i] for i in ok], rows[ok], lens[ok], ok, refused)
        if refused and self.policy == "enforce":
            self._forward_refused_slots = np.concatenate(
                [np.arange(qsl[i], qsl[i + 1]) for i in sorted(refused)]
            )
            return self._mask_refused(loc)
        return loc

    def _verify_rows(self, ids: list[Any], rows: np.ndarray, lens: np.ndarray, index: list[int], refused: set[int]) -> None:
        import torch

        req_to_token = self.req_to_token_pool.req_to_token
        width = int(lens.max())
        ps = self.page_size
        picked = req_to_token[torch.as_tensor(rows, device=req_to_token.device), :width]
        if ps > 1:
            picked = torch.div(picked[:, ::ps], ps, rounding_mode="floor")
        table = np.ascontiguousarray(_host(picked), dtype=np.int32)
        verdict = self.table.verify_step(ids, table, lens)
        for row, v in verdict.refused:
            refused.add(index[row])
            self._refused(ids[row], v)

    def _mask_refused(self, loc: Any) -> Any:
        """A refused request's KV writes go to SGLang's padding slot 0, never a page."""
        masked = loc.clone()
        masked[self._forward_refused_slots] = 0
        return masked

    # ---- verdicts ------------------------------------------------------------------------------

    def _imported(self, rid: Any, tokens: int) -> None:
        """A PD transfer of ``tokens`` landed and was accepted for ``rid``."""
        self.metrics["imported_tokens"] += tokens

    def _abort_plain(self, rid: Any, message: str) -> None:
        """A refusal that carries no violation (a missing manifest)."""
        self.metrics["violations_total"] += 1
        self.metrics["violations_total:missing_manifest"] += 1
        logger.warning("kvguard %s: %s (request %r)", self.policy, message, rid)
        if self.policy != "enforce" or rid in self.aborted:
            return
        self.aborted[rid] = message
        self.metrics["aborted_requests"] += 1
        req = self._reqs.get(rid)
        if req is not None and not req.finished():
            req.to_finish = _finish_abort(f"kvguard refused this request: {message}")

    def _violation(self, rid: Any, violation: Violation) -> None:
        self.violations.append(violation)
        self.refusals.append((rid, violation))
        self.metrics["violations_total"] += 1
        self.metrics[f"violations_total:{violation.kind}"] += 1
        logger.warning("kvguard %s: %s (request %r)", self.policy, violation, rid)

    def _refused(self, rid: Any, violation: Violation) -> None:
        self._violation(rid, violation)
        if self.policy != "enforce" or rid in self.aborted:
            return
        self.aborted[rid] = violation
        self.metrics["aborted_requests"] += 1
        req = self._reqs.get(rid)
        if req is not None and not req.finished():
            req.to_finish = _finish_abort(f"kvguard refused this request: {violation}")


def _host(t: Any) -> np.ndarray:
    """A tensor or array as a host numpy array (a copy only for device tensors)."""
    if isinstance(t, np.ndarray):
        return t
    if hasattr(t, "detach"):
        return t.detach().cpu().numpy()
    return np.asarray(t)


def _pages_of(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct pages of ``slots``, in first-seen order."""
    pages = slots // page_size if page_size > 1 else slots
    if page_size == 1:
        return pages
    _, first = np.unique(pages, return_index=True)
    return pages[np.sort(first)]


# ---- PD disaggregation: the manifest at SGLang's KV sender and receiver --------------------------


class ManifestChannel:
    """What travels beside a transfer, keyed by SGLang's ``bootstrap_room``: the decode side's
    destination page refs and ids (with ``send_metadata``) and the prefill side's encoded manifest
    (with ``send``). A backend carries it on its own side channel (mooncake/nixl bootstrap
    messages); in one process, a dict."""

    def __init__(self) -> None:
        self.rooms: dict[int, dict[str, Any]] = {}

    def put(self, room: int, field: str, value: Any) -> None:
        """Sets one field of a room's record."""
        self.rooms.setdefault(int(room), {})[field] = value

    def get(self, room: int, field: str) -> Any:
        """One field of a room's record, or None."""
        return self.rooms.get(int(room), {}).get(field)


def _page_bytes(kv_pool: Any, page: int, page_size: int, tokens: int | None = None) -> bytes:
    """The K and V bytes of a page's first ``tokens`` slots over every layer, as a transfer
    moves them (a request's last page carries only its own tokens)."""
    lo = page * page_size
    hi = lo + (page_size if tokens is None else tokens)
    parts = []
    for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer, strict=True):
        parts.append(k[lo:hi].contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
        parts.append(v[lo:hi].contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
    return b"".join(parts)


def _u8() -> Any:
    import torch

    return torch.uint8


def _slot_bytes(kv_pool: Any, page_size: int) -> int:
    return len(_page_bytes(kv_pool, 0, page_size)) // page_size


class GuardedKVSender:
    """Prefill side: wraps an SGLang ``BaseKVSender`` (mooncake, nixl, fake). ``send`` builds the
    kvguard manifest of the pages it sends (request and tenant as the decode side named them,
    the prompt's digest, each page's CRC32) and puts it on the channel before the bytes go."""

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: ManifestChannel, *, sender: int = 0) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.sender = sender
        self.room = int(getattr(inner, "bootstrap_room", 0) or 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None) -> Any:
        """Sends ``kv_indices`` (prefill pages) with their manifest."""
        dest = self.channel.get(self.room, "dest")
        ids = self.channel.get(self.room, "ids")
        if dest is None or ids is None:
            raise TransferError(f"kvguard: no destination for room {self.room}; the decode side sent no metadata")
        ps = self.guard.page_size
        pool = self.guard.kv_pool
        total = len(self.req.origin_input_ids)
        pages = [
            _page_bytes(pool, int(p), ps, min(ps, total - i * ps))
            for i, p in enumerate(np.asarray(kv_indices).reshape(-1).tolist())
        ]
        manifest = Manifest.build(
            ids[0], ids[1], self.sender, ps, _slot_bytes(pool, ps), np.asarray(self.req.origin_input_ids, dtype=np.int64), dest, pages
        )
        self.channel.put(self.room, "manifest", manifest.encode())
        return self.inner.send(kv_indices, state_indices, num_kv_tokens)


class GuardedKVReceiver:
    """Decode side: wraps an SGLang ``BaseKVReceiver``. ``send_metadata`` names the destination
    pages in their current incarnation; when the backend reports ``KVPoll.Success``, the manifest
    is checked against the decode side's own copy of the request and the bytes that landed. A
    missing manifest, a token count or prompt digest that differs, or a page whose CRC32 differs
    turns the poll into ``KVPoll.Failed``, aborts the request, and its pages stay unwritten, so
    attention can never read them."""

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: ManifestChannel) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.room = int(getattr(inner, "bootstrap_room", None) or getattr(req, "bootstrap_room", 0) or 0)
        self._pages: list[int] = []
        self._verdict: int | None = None
        self.refusal: Error | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None, **kwargs: Any) -> Any:
        """Offers ``kv_indices`` (decode pages, already in this request's row) to the prefill side."""
        table = self.guard.table
        rid = self.req.rid
        self._pages = [int(p) for p in np.asarray(kv_indices).reshape(-1).tolist()]
        dest = []
        for page in self._pages:
            info = table.page_info(page)
            dest.append(PageRef(page, info.generation if info is not None else 0))
        self.channel.put(self.room, "dest", dest)
        self.channel.put(
            self.room, "ids", (table.request_key(rid), self.guard._tenant_key(self.guard.tenant_of(self.req)))
        )
        return self.inner.send_metadata(kv_indices, aux_index, state_indices, **kwargs)

    def poll(self) -> int:
        """The backend's poll, then the manifest check once it says ``Success``."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        if self._verdict is not None:
            return self._verdict
        state = self.inner.poll()
        if state != KVPoll.Success:
            return state
        self._verdict = KVPoll.Success if self._accept() else KVPoll.Failed
        return self._verdict

    def _accept(self) -> bool:
        guard = self.guard
        rid = self.req.rid
        manifest = self.channel.get(self.room, "manifest")
        dest = self.channel.get(self.room, "dest") or []
        ps = guard.page_size
        total = len(self.req.origin_input_ids)
        landed = [
            _page_bytes(guard.kv_pool, p, ps, max(0, min(ps, total - i * ps))) for i, p in enumerate(self._pages)
        ]
        try:
            if manifest is None:
                raise TransferError(f"kvguard: transfer for room {self.room} arrived without a manifest")
            accepted = Receiver(guard.table).accept(
                rid,
                guard._tenant_key(guard.tenant_of(self.req)),
                np.asarray(self.req.origin_input_ids, dtype=np.int64),
                dest,
                manifest,
                landed,
                slot_bytes=_slot_bytes(guard.kv_pool, ps),
                page_size=ps,
            )
        except (TransferError, ViolationError) as e:
            self.refusal = e
            violation = getattr(e, "violation", None)
            guard.metrics["transfers_refused"] += 1
            if violation is not None:
                guard._refused(rid, violation)
            else:
                guard._abort_plain(rid, str(e))
            return False
        guard.metrics["transfers_accepted"] += 1
        guard._imported(rid, accepted.tokens)
        return True
