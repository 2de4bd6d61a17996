"""Where SGLang's pages go back: every free judged where it is made, with its freer known.

``PageReleases`` is the part of :class:`kvguard.sglang.Guard` that follows SGLang's allocator:
the pages it hands out (``alloc`` / ``alloc_extend`` / ``alloc_decode``), the frees made inside a
free group (judged when made, not at ``free_group_end``), the release every free ends in
(``_release_page_ids`` paged, ``free`` at page size 1), frees that name no freer (SGLang's own
error paths, or a bug), and the pages kvguard itself gives back (withheld after a refused
eviction, or held alone by a request whose row no longer names them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ViolationError, mark_pages
from .arrays import _flat, _in_place

logger = logging.getLogger("sglang.srt.kvguard")

_TREE = object()
"""Freer marker: the radix cache itself drops pages (eviction)."""

_NO_OWNER = -1
"""``_page_key`` of a page no request owns exclusively (free, a prefix, or the padding page)."""


class LocalViolation:
    """A violation the binding finds itself, on SGLang's calls the core table does not see (a
    free that names no freer): the same fields as :class:`~kvguard.Violation`, one line of text."""

    __slots__ = ("kind", "op", "page", "request", "owner", "tenant", "owner_tenant", "generation", "slots",
                 "prefix", "block_index", "text")

    def __init__(self, kind: str, op: str, *, text: str, page: int | None = None, request: Any = None,
                 owner: Any = None, tenant: Any = None, owner_tenant: Any = None) -> None:
        self.kind, self.op, self.page, self.request, self.owner = kind, op, page, request, owner
        self.tenant, self.owner_tenant, self.text = tenant, owner_tenant, text
        self.generation = self.slots = self.prefix = self.block_index = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"



class PageReleases:
    """The release side of :class:`~kvguard.sglang.Guard` (its state is the guard's)."""

    def _handed_now(self) -> np.ndarray:
        """``_handed``, current: page -> SGLang's allocator handed it out and it was not released
        since. Only a free that names no freer (SGLang's error paths), a stale writer's dropped
        slot and a stale request's pages read it: never SGLang's common step.

        For SGLang's two pool allocators it is read from the allocator's own free list when one
        of those paths asks: every page but the padding page 0, those free in SGLang's lists and
        those freed in the open free group (judged, not yet in a list). Within one release call
        it is read once and each page let back is taken out of it at once, so a page named twice
        in one free goes back once. Another allocator's pages are marked as it hands them out
        (``_wrap_alloc_pages``) and ``_handed`` is always current. A free list kvguard cannot
        read leaves nothing handed out: every free that names no freer is then refused (a page
        kept out of SGLang, never one handed to two requests)."""
        read = self._free_pages_of
        if read is None or (self._releasing and self._handed_known):
            return self._handed
        handed = self._handed
        try:
            free = read()
            if free is None:
                raise TypeError("the allocator has no free list")
            free = _flat(free)
            inside = free[(free >= 0) & (free < len(handed))]
        except Exception as e:  # noqa: BLE001 - fail closed: nothing counts as handed out
            logger.error("kvguard: SGLang's free list could not be read (%s: %s); frees by no request are refused",
                         type(e).__name__, e)
            handed[:] = False
        else:
            handed[:] = True
            handed[0] = False  # the padding page, never handed out
            handed[inside] = False
            for page, n in self._group_judged.items():
                if n > 0 and 0 <= page < len(handed):
                    handed[page] = False
            for pages in self._let_back:
                back = np.asarray(pages, dtype=np.int64)
                handed[back[(back >= 0) & (back < len(handed))]] = False
            handed[self._page_limit :] = False
        self._handed_known = self._releasing > 0
        return handed

    def _release_call(self, inner: Callable[..., Any], *args: Any) -> Any:
        """``inner(*args)``, a wrapper's release call: ``_handed`` read from the free list at most
        once inside it, and the pages it lets back counted as free in that reading (not in
        SGLang's list until it returns: ``_let_back`` holds each judgement's list of kept pages,
        the list itself, so a page is counted as soon as it is kept, at no cost per page)."""
        self._releasing += 1
        try:
            return inner(*args)
        finally:
            self._releasing -= 1
            if not self._releasing:
                self._handed_known = False
                self._let_back.clear()

    def _wrap_alloc_pages(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        ps = self.page_size
        # The pool's entries of _handed, as bytes (the same memory): every page the allocator
        # hands out marked in one call (kvguard.mark_pages); a slot outside the pool is passed
        # over, judged where it is used.
        flags = self._handed[: self._page_limit].view(np.uint8)

        def alloc(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if out is not None:
                mark_pages(flags, _in_place(out), ps)
            return out

        return alloc

    def _judged_now(self, pages: np.ndarray) -> list[int]:
        """A free inside a free group, judged now (its freer is known here, not at the group's
        end); the pages kept go on to SGLang's group and pass its end unjudged."""
        kept = self._released(pages)
        for p in kept:
            self._group_judged[p] += 1
        return kept

    def _wrap_group_free(self, inner: Callable[..., Any], *, tokens: bool) -> Callable[..., Any]:
        """Paged ``free`` (token slots) / ``free_page_ids`` (pages): outside a free group they end
        in ``_release_page_ids`` (judged there); inside one, judged here."""
        ps = self.page_size

        def free(ids: Any, *args: Any, **kwargs: Any) -> Any:
            if self.allocator.free_group is None or self._group_ending or ids.numel() == 0:
                return inner(ids, *args, **kwargs)
            return self._release_call(in_group, ids, args, kwargs)

        def in_group(ids: Any, args: Any, kwargs: Any) -> Any:
            slots = _flat(ids)
            pages = np.unique(slots // ps) if tokens else slots
            kept = self._judged_now(pages)
            if len(kept) == len(slots) and not tokens:
                return inner(ids, *args, **kwargs)
            if not kept:
                return None
            import torch

            back = np.asarray(kept, dtype=np.int64) * (ps if tokens else 1)
            return inner(torch.as_tensor(back, dtype=ids.dtype, device=ids.device), *args, **kwargs)

        return free

    def _wrap_group_end(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def free_group_end(*args: Any, **kwargs: Any) -> Any:
            self._group_ending = True
            try:
                return inner(*args, **kwargs)
            finally:
                self._group_ending = False
                self._group_judged.clear()

        return free_group_end

    def _at_release(self, pages: np.ndarray) -> list[int]:
        """The page release SGLang makes now: pages judged when their free group was made pass;
        any other is judged here."""
        if not self._group_ending or not self._group_judged:
            return self._released(pages)
        kept, rest = [], []
        for p in pages.tolist():
            if self._group_judged[p] > 0:
                self._group_judged[p] -= 1
                kept.append(p)
            else:
                rest.append(p)
        self._let_back.append(kept)
        if rest:
            kept.extend(self._released(np.asarray(rest, dtype=np.int64)))
        return kept

    def _wrap_release_page_ids(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def release_page_ids(*page_ids: Any) -> Any:
            return self._release_call(release, page_ids)

        def release(page_ids: Any) -> Any:
            kept = [self._at_release(_flat(ids)) for ids in page_ids]
            kept = [k for k in kept if len(k)]
            if kept:
                import torch

                dev = self.allocator.device
                return inner(*(torch.as_tensor(k, dtype=torch.int64, device=dev) for k in kept))
            return None

        return release_page_ids

    def _wrap_token_free(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """Page size 1: ``free`` is both where a free is made and where the release happens."""

        def free(free_index: Any) -> Any:
            if free_index.numel() == 0:
                return inner(free_index)
            return self._release_call(release, free_index)

        def release(free_index: Any) -> Any:
            slots = _flat(free_index)
            if self.allocator.free_group is not None and not self._group_ending:
                kept = self._judged_now(slots)
            else:
                kept = self._at_release(slots)
            if len(kept) == free_index.numel():
                return inner(free_index)
            if len(kept):
                import torch

                return inner(torch.as_tensor(kept, dtype=free_index.dtype, device=free_index.device))
            return None

        return free

    def _released(self, pages: np.ndarray) -> list[int]:
        """Judges one release of ``pages``; returns those SGLang may put back in its free list."""
        freer = self._freer
        kept: list[int] = []
        self._let_back.append(kept)  # filled below: every page kept counts as let back at once
        by_owner: dict[Any, list[int]] = {}
        for page in pages.tolist():
            inside = 0 <= page < self._page_limit
            prefix = int(self._page_prefix[page]) if inside else 0
            if prefix and freer is None:
                # A page the radix cache holds, freed by no request and not by the cache's own
                # eviction: the tree still names it, so it must not be handed out.
                kept.extend(p for p in [page] if self._stray_free_ok(page, None))
                continue
            if prefix and freer is _TREE:
                self._rows_stale = True
                try:
                    self.table.evict_prefix(prefix)
                except ViolationError as e:
                    self._violation(None, e.violation)
                    if self.policy == "enforce":
                        self._withheld[page] = prefix
                        self.metrics["withheld_pages"] += 1
                        continue
                self._page_prefix[page] = 0
                self._handed[page] = False
                kept.append(page)
                continue
            if freer is not None and freer is not _TREE:
                by_owner.setdefault(freer, []).append(page)
            elif self._stray_free_ok(page, freer):
                kept.append(page)
        for key, own in by_owner.items():
            kept.extend(self._release_owned(key, own))
        return kept

    def _stray_free_ok(self, page: int, freer: Any) -> bool:
        """A free that came through none of the calls that name a freer (``free_kv_row``,
        ``checkpoint``, ``evict``): SGLang's own error paths free pages it handed out and no
        request claimed, which go back. A page a live request still holds, or one the allocator
        never handed out (already free: a double free), is refused: under enforce it stays out of
        SGLang's free list, so it is never handed to two requests. A live request's page goes
        back when that request lets go: through its own free, or, if it never frees it (SGLang
        stopped counting it at this free), when its row goes back (``_stray_owed``). The radix
        cache's page goes back at its eviction; a double free's page is in the free list once
        already. So SGLang's idle check, which counts a live request's and the cache's pages,
        balances after each refusal with nothing counted twice."""
        inside = 0 <= page < self._page_limit
        owner = int(self._page_key[page]) if inside else _NO_OWNER
        prefix = int(self._page_prefix[page]) if inside else 0
        if owner == _NO_OWNER and not prefix and inside and self._handed_now()[page]:
            self._handed[page] = False
            return True
        self._rows_stale = True
        if prefix:
            v = LocalViolation(
                "foreign_page", "release", page=page, text=f"a free by no request of page {page}, which the radix cache holds"
            )
        elif owner != _NO_OWNER:
            v = LocalViolation(
                "foreign_page", "release", page=page, owner=owner, tenant=None,
                owner_tenant=self._tenants.get(owner),
                text=f"a free by no request of page {page}, which request {self._rids.get(owner, owner)!r} still holds",
            )
        else:
            what = "that the allocator never handed out (already free)" if inside else "outside the pool"
            v = LocalViolation("double_free", "release", page=page, text=f"a second free of page {page}, {what}")
        self._violation(None, v)
        if self.policy == "enforce":
            self.metrics["withheld_pages"] += 1
            if owner != _NO_OWNER and not prefix:
                # SGLang may count the page free from now on (its own error path freed a step's
                # slots its lengths never counted): it goes back when its holder lets go.
                self._stray_held.setdefault(owner, set()).add(page)
            return False
        return True

    def _stray_owed(self, key: int, mine: np.ndarray) -> np.ndarray:
        """Request ``key``'s row goes back: the pages a free by no request named while ``key``
        held them alone (refused then) that it still holds alone now, i.e. that it never freed
        itself. SGLang's free of them is carried out by the caller once ``key`` has ended, each
        page once; they are taken out of ``mine`` (they are no orphans). SGLang's idle check
        counts them free (``_check_full_pool``), so kept they would read as a leak."""
        held = self._stray_held.pop(key, None)
        if not held:
            return np.zeros(0, dtype=np.int64)
        pages = np.fromiter(held, dtype=np.int64, count=len(held))
        owed = pages[mine[pages]]
        mine[owed] = False
        return owed

    def _release_owned(self, key: Any, pages: list[int]) -> list[int]:
        if key not in self._admitted:
            # A freer kvguard does not know (released already, or never admitted): judged as a
            # free by no request.
            return [p for p in pages if self._stray_free_ok(p, None)]
        self._forget_checks(key)
        held = self._stray_held.get(key)
        if held:
            held.difference_update(pages)  # freed by their holder: no longer owed
        try:
            self.table.release_pages(key, pages)
            ok = pages
        except ViolationError as e:
            self._refused(key, e.violation)
            ok = []
            for page in pages:
                if 0 <= page < self._page_limit and self._page_key[page] == key:
                    try:
                        self.table.release_pages(key, [page])
                        ok.append(page)
                    except ViolationError:
                        pass
            if self.policy == "report":
                ok = pages
        mine = [p for p in ok if 0 <= p < self._page_limit and self._page_key[p] == key]
        self._page_key[mine] = _NO_OWNER
        back = [p for p in ok if 0 <= p < self._page_limit]
        self._handed[back] = False
        if key in self._late_writers and self.policy == "enforce" and ok:
            # A transfer backend may still write these pages (its transfer failed with no proof
            # its writes drained): released in the table, never handed to another request.
            self._fenced.extend(ok)
            self.metrics["late_write_fenced_pages"] += len(ok)
            logger.warning(
                "kvguard: %d page(s) of request %r kept out of SGLang's pool for good: its KV "
                "transfer failed and the backend never confirmed its writes stopped",
                len(ok), self._rids.get(key, key),
            )
            return []
        return ok

    def _wrap_clear(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def clear(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self._pool_cleared()
            return out

        return clear

    def _pool_cleared(self) -> None:
        """SGLang emptied its pool at once (``Scheduler.flush_cache``, a PD role switch; both only
        while no request runs or waits): its radix cache reset, every row and every page free,
        none of it through the calls kvguard judges. kvguard's table and mirror follow: a request
        it still counts is released, every radix prefix it holds is evicted, and no page is left
        owned, cached, marked or withheld, so the next requests are handed pages nobody holds
        (without this, each was refused for writing a page the flushed cache still held)."""
        self._rows_stale = True
        for key in sorted(self._admitted):
            self._end(key)
        cached = self._page_prefix[self._page_prefix != 0].tolist()
        for prefix in sorted(set(cached) | set(self._withheld.values())):
            try:
                self.table.evict_prefix(prefix)
            except ViolationError as e:
                # Still held in the table (by nothing kvguard knows of): its pages stay refused
                # to the next requests, as before this hook.
                self._violation(None, e.violation)
        self._page_key[:] = _NO_OWNER
        self._page_prefix[:] = 0
        self._handed[:] = False
        self._handed_known = False
        self._let_back.clear()
        self._withheld.clear()
        self._fenced.clear()
        self._orphans.clear()
        self._stray_held.clear()
        self._group_judged.clear()
        self._suspects.clear()
        self._row_key[:] = 0
        self._row_claimant[:] = 0
        self._row_live[:] = False
        self._row_checked[:] = 0
        self._row_kv[:] = [None] * len(self._row_kv)

    def _return_orphans(self, kv: Any) -> None:
        """The pages a stale request held alone go back to SGLang (no other request maps them:
        nobody claimed them since, as the allocator never handed them out again)."""
        entry = self._orphans.pop(id(kv), None)
        if entry is None or entry[0] is not kv:
            return
        pages = entry[1]
        back = pages[(self._page_key[pages] == _NO_OWNER) & (self._page_prefix[pages] == 0) & self._handed_now()[pages]]
        self._give_back(back)

    def _give_back(self, pages: Any) -> None:
        """Pages kvguard itself returns to SGLang's free list (already judged), through the
        allocator's own release; inside a free group they pass its end unjudged."""
        if not len(pages):
            return
        import torch

        self._handed[pages] = False
        if self.page_size == 1 and self.allocator.free_group is not None and not self._group_ending:
            for p in np.asarray(pages).tolist():
                self._group_judged[p] += 1
        self._release_inner(torch.as_tensor(pages, dtype=torch.int64, device=self.allocator.device))

    def _return_withheld(self) -> None:
        """Pages whose eviction was refused go back to SGLang once their last holder let go."""
        if not self._withheld:
            return
        back = []
        for page, prefix in list(self._withheld.items()):
            try:
                self.table.evict_prefix(prefix)
            except ViolationError:
                continue
            del self._withheld[page]
            self._page_prefix[page] = 0
            back.append(page)
        self._give_back(back)
