"""``Guard``: kvguard's ownership table mirroring one SGLang scheduler's pool, judged at SGLang's calls.

Ids: the table knows each request by an int key (``Guard.request_key``), given at admission, so a
step's requests go to the table as one int array gathered from ``req_to_token`` row numbers
(``_row_key[req_pool_indices]``), never a Python list of ``rid`` strings. Violations come back
as :class:`NamedViolation`, with the SGLang ``rid`` and tenant names restored.

Tenants get stable int keys too (``_tenant_key``): the binding interns a str tenant only while one
of its requests lives, but a radix-cache prefix outlives its publisher; with str tenants the next
request of the same tenant would get a fresh id and be refused as another tenant on its prefix
hit. The int key keeps the tenant's identity for as long as the scheduler runs.

``Guard`` is made of parts by idea, each a module: :mod:`~kvguard.sglang.releases` (where pages go
back), :mod:`~kvguard.sglang.row_writes` (SGLang's writes of its rows and cache),
:mod:`~kvguard.sglang.outputs` (a request's row checked before its output leaves) and
:mod:`~kvguard.sglang.refusals` (a violation named, counted and acted on); this module holds the
guard's state, its hooks on SGLang's pools, and each request's admission and end.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import numpy as np

from .. import ConfigError, OwnershipTable, PoolConfig, ViolationError
from . import metrics as _metrics
from .outputs import Outputs
from .process_hooks import _hook_batch_allocs, _hook_cache_index_writer, _hook_decode_prealloc, _hook_output_payload
from .refusals import KEPT, NamedViolation, Refusals, _Latest, _LatestAborted
from .releases import _NO_OWNER, _TREE, LocalViolation, PageReleases
from .row_writes import RowWrites

__all__ = ["KEPT", "Guard", "NamedViolation", "audit_pd", "audit_pool"]

logger = logging.getLogger("sglang.srt.kvguard")


_GONE_NAMES = 4096
"""Released requests whose ``rid`` is kept to name them in a violation found after they ended."""


def _pool_pages(allocator: Any) -> int:
    """Allocatable pages of an SGLang allocator (page 0 excluded)."""
    num_pages = getattr(allocator, "num_pages", None)
    return int(num_pages) if num_pages is not None else int(allocator.size) // int(allocator.page_size)


def _free_list_reader(allocator: Any) -> Callable[[], Any] | None:
    """How to read the pages ``allocator`` holds free (``get_all_free_pages``: its free list and
    the pages freed since its last sort), for SGLang's two pool allocators, whose free structures
    kvguard knows; ``None`` for any other class (a subclass included: it may keep pages
    elsewhere), whose handed-out pages kvguard marks instead."""
    try:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    except ImportError:
        return None
    if type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        return None
    return allocator.get_all_free_pages


def audit_pool(allocator: Any, context_len: int, *, side: str = "pool", policy: str = "enforce") -> PoolConfig:
    """Start-up audit of one SGLang pool: refused (``ConfigError``) unless one request of
    ``context_len`` tokens fits in its pages. The message names both numbers."""
    config = PoolConfig(
        _pool_pages(allocator) + 1, int(allocator.page_size), int(context_len), reserved=[0], policy=policy
    )
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


_BEAM_REFUSED = "beam search (beam_width > 1) is not supported by kvguard: its beams' rows cannot be checked"


_SESSION_REFUSED = "a streaming session is not supported by kvguard: the row its turns share cannot be checked"


_EMBEDS_REFUSED = (
    "a request of input embeddings is not supported by kvguard: SGLang keys its KV by placeholder "
    "tokens, so its radix cache would share it with any request of as many embeddings"
)


def _unsupported(req: Any) -> str | None:
    """Why kvguard cannot check ``req`` (None: it can)."""
    if _beam_width(req) > 1:
        return _BEAM_REFUSED
    if getattr(getattr(req, "session", None), "streaming", False) is True:
        return _SESSION_REFUSED
    if getattr(req, "input_embeds", None) is not None:
        return _EMBEDS_REFUSED
    return None


def _beam_width(req: Any) -> int:
    """The beam width a request asks for (1: no beam search)."""
    group = getattr(req, "beam_group", None)
    if group is not None:
        return int(getattr(group, "beam_width", 2) or 2)
    width = getattr(getattr(req, "sampling_params", None), "beam_width", None)
    try:
        return int(width or 1)
    except (TypeError, ValueError):
        return 2  # not a number: not a width kvguard can vouch for


def _default_tenant(req: Any) -> str:
    """A request's tenant: an explicit ``kvguard_tenant``, else its cache salt (SGLang's own
    isolation key), else ``default``. Read once, at admission."""
    return getattr(req, "kvguard_tenant", None) or getattr(req, "cache_salt", None) or "default"


class Guard(Refusals, RowWrites, Outputs, PageReleases):
    """kvguard for one SGLang scheduler: its ``ReqToTokenPool``, token allocator, radix cache and
    KV pool, hooked on the instances (see the package doc).

    ``policy``: ``enforce`` (abort the refused request) or ``report`` (log and count).
    ``context_len``: the model's context length; the pool is audited against it at construction.
    ``device_rows``: check the forward batch's ``req_to_token`` rows on the GPU with
    :class:`kvguard.DeviceGuard` when they are CUDA tensors (``None``: whenever they are).
    ``full_check_every``: on the host, a decode forward checks only each row's tokens written
    since its last check (the rest of the row is unchanged: a ``ReqToTokenPool.write`` below a
    row's checked length and a release by its request check that row in full next; an eviction,
    a free nobody holds or a violation anywhere, every row); every ``full_check_every``-th
    forward is a full check all the same, for a row changed behind SGLang's own calls (``1``:
    every forward is a full check).
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
        device_rows: bool | None = None,
        full_check_every: int = 64,
    ) -> None:
        from .forward import row_check_for

        if int(full_check_every) < 1:
            raise ConfigError(f"kvguard: full_check_every must be >= 1, not {full_check_every!r}")
        self.full_check_every = int(full_check_every)
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
        self._keys: dict[Any, int] = {}
        """SGLang ``rid`` -> request key, while kvguard knows the request."""
        self.aborted: dict[Any, NamedViolation | str] = _LatestAborted(self._keys)
        """Requests (SGLang ``rid``) aborted under enforce, with the violation that refused them
        (the latest :data:`KEPT` at least, and every one still holding a row)."""
        self.violations: list[NamedViolation] = _Latest()
        """The violations seen, in order (report and enforce; the latest :data:`KEPT` at least)."""
        self.refusals: list[tuple[Any, NamedViolation]] = _Latest()
        """The violations with the SGLang ``rid`` each was charged to (None: the radix cache's;
        the latest :data:`KEPT` at least)."""
        self.prometheus = _metrics.scheduler_metrics()
        """The process's Prometheus metrics (None without ``prometheus_client``)."""
        num_pages = self.config.num_pages
        rows = int(req_to_token_pool.req_to_token.shape[0])
        # page -> key of the request owning it exclusively; one extra entry (never owned) takes
        # every page id out of range, so lookups need no bounds check.
        self._page_key = np.full(num_pages + 1, _NO_OWNER, dtype=np.int64)
        self._page_limit = num_pages
        # page -> key of the radix prefix it belongs to (0: none).
        self._page_prefix = np.zeros(num_pages + 1, dtype=np.int64)
        # req_to_token row -> key of the request holding it (0: none), and whether it is admitted.
        self._row_key = np.zeros(rows, dtype=np.int64)
        self._row_live = np.zeros(rows, dtype=bool)
        # req_to_token row -> its request's key while that request is admitted (0: none), for
        # the decode step's claims in one call (OwnershipTable.write_decode_rows).
        self._row_claimant = np.zeros(rows, dtype=np.int64)
        # req_to_token row -> its tokens the last forward check found clean (0: check in full),
        # and whether anything since then may have made a page unreadable to a row other than
        # its releasing request's (an eviction, a free nobody holds, a violation): then the next
        # forward checks every row in full. A request's own release resets its rows only: a
        # clean row reads no page another request may release.
        self._row_checked = np.zeros(rows, dtype=np.int64)
        self._rows_stale = True
        self._rids: dict[int, Any] = {}
        self._gone_rids: dict[int, Any] = {}
        self._reqs: dict[int, Any] = {}
        self._tenants: dict[int, Any] = {}
        self._admitted: set[int] = set()
        self._tenant_ids: dict[Any, int] = {}
        self._tenant_names: dict[int, Any] = {}
        self._holds: dict[int, set[int]] = {}
        self._withheld: dict[int, int] = {}
        # Requests whose pages a transfer backend may still write (a PD transfer that failed
        # with no proof its writes drained), while SGLang releases them; and the pages so kept
        # out of SGLang's free list for good (kvguard.sglang.pd, "late writes").
        self._late_writers: set[int] = set()
        self._fenced: list[int] = []
        self._next_request = 1
        self._next_prefix = 1
        self._freer: Any = None
        # page -> SGLang's allocator handed it out and it was not released since: read from
        # SGLang's free list when a rare path needs it (see PageReleases._handed_now), or kept by
        # marking every page the allocator hands out, for an allocator whose free list kvguard
        # does not read.
        self._handed = np.zeros(num_pages + 1, dtype=bool)
        self._free_pages_of = _free_list_reader(allocator)
        self._handed_known = False
        self._releasing = 0
        # The lists of pages the current release call lets back (see PageReleases._release_call).
        self._let_back: list[list[int]] = []
        # Pages freed inside the current free group, judged when freed (freer known).
        self._group_judged: Counter[int] = Counter()
        self._group_ending = False
        self._writing_cache_indices = False
        # The request keys of the batch being prepared (see _batch_reqs), for its row write and
        # its forward; each taken once.
        self._writers: np.ndarray | None = None
        self._readers: np.ndarray | None = None
        self._reader_rows: np.ndarray | None = None
        # A decode row write's slots as kvguard copied them from the device, until the
        # allocation they came from returns; then (out_cache_loc, its version, that copy), which
        # the batch's forward reads instead of copying out_cache_loc again (see _note_loc).
        self._written_slots: np.ndarray | None = None
        self._loc_host: tuple[Any, Any, np.ndarray] | None = None
        # While alloc_for_decode runs for a batch whose rows are on a device: (its rows, the host
        # copies SGLang keeps of them and of the columns written), for the row write.
        self._decode_rows_host: tuple[Any, Any, Any] | None = None
        # id(Req.kv) -> the record, for requests whose row went back while unfinished and that
        # have no new row yet (see _batch_reqs).
        self._suspects: dict[int, Any] = {}
        self._batch: Any = None
        # Requests report mode refused at intake and could not follow (never admitted again).
        self._intake_refused: set[int] = set()
        # Requests whose row was checked in full before their output left (see
        # check_rows_before_output), until they are released.
        self._output_checked: set[int] = set()
        # id(Req.kv) -> (the record, the pages its request held alone when its row was freed).
        self._orphans: dict[int, tuple[Any, np.ndarray]] = {}
        # request key -> pages a free by no request named while that request held them alone,
        # kept from SGLang's free list (enforce) until it lets go: those it frees itself later
        # are struck off; those it still holds when its row goes back are released then, SGLang's
        # free carried out (see PageReleases._stray_free_ok).
        self._stray_held: dict[int, set[int]] = {}
        # req_to_token row -> the KV record (Req.kv) of the request holding it.
        self._row_kv: list[Any] = [None] * rows
        self._qsl_decode = np.arange(rows + 1, dtype=np.int32)
        self.row_check = row_check_for(self, device_rows)
        """How the forward batch's rows are verified: on the host or on the device."""
        self._hook()

    # ---- hooks -------------------------------------------------------------------------------

    def _hook(self) -> None:
        pool = self.req_to_token_pool
        pool.alloc = self._wrap_alloc_rows(pool.alloc)
        pool.free = self._wrap_free_row(pool.free)
        pool.write = self._wrap_row_write(pool.write)
        alloc = self.allocator
        # A free of a page no request holds and the allocator never handed out is a double free.
        # What the allocator handed out is read from its free list where kvguard knows it; for
        # any other allocator every page it hands out (its decision, not a row) is marked until
        # it is released.
        if self._free_pages_of is None:
            for name in ("alloc", "alloc_extend", "alloc_decode"):
                if hasattr(alloc, name):
                    setattr(alloc, name, self._wrap_alloc_pages(getattr(alloc, name)))
        # Frees: judged where they are made, with their freer known, even inside a free group
        # (SGLang defers the release to free_group_end, where the freer is gone).
        if hasattr(alloc, "_release_page_ids"):
            self._release_inner = alloc._release_page_ids
            alloc._release_page_ids = self._wrap_release_page_ids(alloc._release_page_ids)
            alloc.free = self._wrap_group_free(alloc.free, tokens=True)
            if hasattr(alloc, "free_page_ids"):
                alloc.free_page_ids = self._wrap_group_free(alloc.free_page_ids, tokens=False)
        else:
            self._release_inner = alloc.free
            alloc.free = self._wrap_token_free(alloc.free)
        alloc.free_group_end = self._wrap_group_end(alloc.free_group_end)
        # SGLang empties its pools at once (flush_cache, a PD role switch): kvguard follows.
        if hasattr(alloc, "clear"):
            alloc.clear = self._wrap_clear(alloc.clear)
        pool.kvguard_guard = self
        _hook_cache_index_writer()
        _hook_batch_allocs()
        _hook_decode_prealloc()
        self._payload_hooked = _hook_output_payload()
        tree = self.tree_cache
        if tree is not None:
            tree.insert = self._wrap_insert(tree.insert)
            tree.checkpoint = self._wrap_request_release(
                tree.checkpoint, lambda req, *_a, **_k: req.kv, lambda req, *_a, **_k: self.request_key(req.rid)
            )
            tree.free_kv_row = self._wrap_request_release(
                tree.free_kv_row, lambda kv, *_a, **_k: kv, lambda kv, *_a, **_k: self._row_of(kv)
            )
            # The cache's own evictions: RadixCache's evict; SGLang 0.5.23's default cache,
            # UnifiedRadixCache, evicts through _evict both when asked (evict) and when an
            # allocation runs short (evict_for_alloc, called by the allocator's
            # evict_to_free_tokens, never through evict).
            for name in ("evict", "_evict"):
                if callable(getattr(tree, name, None)):
                    setattr(tree, name, self._wrap_freer(getattr(tree, name), lambda *_a, **_k: _TREE))

    def _wrap_alloc_rows(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def alloc(reqs: list[Any]) -> Any:
            fresh = [r for r in reqs if not r.kv.holds_kv]
            for req in fresh:
                key = self.request_key(req.rid)
                if key not in self._admitted and key not in self._intake_refused and req.rid not in self.aborted:
                    self.admit(req)
            rows = inner(reqs)
            if rows is not None:
                for req in fresh:
                    row = int(req.kv.req_pool_idx)
                    key = self.request_key(req.rid)
                    self._row_key[row] = key
                    self._row_live[row] = key in self._admitted
                    self._row_claimant[row] = key if key in self._admitted else 0
                    self._row_checked[row] = 0
                    # The row's KV record: a call through this row with another record is a
                    # stale req_pool_idx (its own row was freed and handed on).
                    self._row_kv[row] = req.kv
                    self._suspects.pop(id(req.kv), None)
            return rows

        return alloc

    def _wrap_free_row(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def free(req: Any) -> Any:
            row = req.kv.req_pool_idx
            if not hasattr(req, "rid"):
                # A holder that is not a request (a streaming session's slot, its session
                # closing: report mode only, enforce refuses those sessions at intake): the
                # request kvguard knows on that row, if it holds the same KV record, ends.
                holder = None if row is None else self._reqs.get(int(self._row_key[int(row)]))
                if holder is None or getattr(holder, "kv", None) is not req.kv:
                    return inner(req)
                return free_as(holder, lambda: inner(req))
            return free_as(req, lambda: inner(req))

        def free_as(req: Any, inner_free: Callable[[], Any]) -> Any:
            row = req.kv.req_pool_idx
            if row is not None and self._row_kv[int(row)] is not None and self._row_kv[int(row)] is not req.kv:
                # The row was freed already and handed to another request: a second free of the
                # new owner's row by a request that no longer holds it. Refused; under enforce the
                # row stays with its owner.
                holder = int(self._row_key[int(row)])
                mine = self._keys.get(req.rid, 0)
                self._refused_req(req, mine, LocalViolation(
                    "double_free", "release", request=mine or None, owner=holder or None,
                    tenant=self._tenants.get(mine), owner_tenant=self._tenants.get(holder),
                    text=f"request {req.rid!r} frees req_to_token row {int(row)}, which is "
                    f"request {self._rids.get(holder, holder)!r}'s now",
                ))
                self.release(req)
                self._suspects.pop(id(req.kv), None)
                if self.policy == "enforce":
                    self._return_orphans(req.kv)
                    return None
                return inner_free()
            if not req.finished():
                # Its row goes back while it runs (retracted, or a bug): until it gets a new row,
                # each batch is checked for a request using a row it no longer holds.
                self._suspects[id(req.kv)] = req.kv
            self.release(req)
            if self.policy == "enforce" and req.rid in self.aborted:
                # A request kvguard refused may hold pages no row names any more (its row was
                # written wrong): SGLang cannot free them, they go back from here.
                self._return_orphans(req.kv)
            if row is not None:
                self._row_kv[int(row)] = None
                self._row_key[int(row)] = 0
                self._row_live[int(row)] = False
                self._row_claimant[int(row)] = 0
                self._row_checked[int(row)] = 0
            return inner_free()

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

    def _wrap_request_release(
        self, inner: Callable[..., Any], kv_of: Callable[..., Any], who: Callable[..., Any]
    ) -> Callable[..., Any]:
        """``checkpoint`` / ``free_kv_row``: a request caches or frees what its row names. Through
        a row that is another request's now (its own was freed and handed on: a stale
        ``req_pool_idx``) it would cache or free the new owner's pages: refused on the stale
        request, and under enforce not done."""
        freer_call = self._wrap_freer(inner, who)

        def call(*args: Any, **kwargs: Any) -> Any:
            kv = kv_of(*args, **kwargs)
            row = getattr(kv, "req_pool_idx", None)
            if row is not None and self._row_kv[int(row)] is not None and self._row_kv[int(row)] is not kv:
                holder = int(self._row_key[int(row)])
                req = args[0] if args and hasattr(args[0], "rid") else None
                mine = self._keys.get(req.rid, 0) if req is not None else 0
                self._refused_req(req, mine, LocalViolation(
                    "foreign_page", "release", request=mine or None, owner=holder or None,
                    tenant=self._tenants.get(mine), owner_tenant=self._tenants.get(holder),
                    text=f"a request caches or frees through req_to_token row {int(row)}, which is "
                    f"request {self._rids.get(holder, holder)!r}'s now (its own row was freed)",
                ))
                if self.policy == "enforce":
                    self._return_orphans(kv)
                    return None
            elif row is not None:
                key = int(self._row_key[int(row)])
                req = self._reqs.get(key)
                if req is not None and key not in self._output_checked and req.finished():
                    # A finished request's output leaves the scheduler at the end of this step:
                    # its whole row is checked first, while its pages are still its own.
                    self._output_checked.add(key)
                    if self.check_rows_before_output([req]) and self.policy == "enforce" and args and args[0] is req:
                        return None  # a refused row is never cached (checkpoint)
            return freer_call(*args, **kwargs)

        return call

    # ---- requests ----------------------------------------------------------------------------

    def kept_tokens(self) -> int:
        """Tokens of the pages kvguard keeps out of SGLang's free list: withheld after a refused
        eviction (until their last holder lets go) and fenced against a failed transfer's late
        writes (for good)."""
        return (len(self._withheld) + len(self._fenced)) * self.page_size

    def request_key(self, rid: Any) -> int:
        """The int key the table knows SGLang request ``rid`` by (given on first sight)."""
        key = self._keys.get(rid)
        if key is None:
            key = self._keys[rid] = self._next_request
            self._rids[key] = rid
            self._next_request += 1
        return key

    def _row_of(self, kv: Any) -> int | None:
        """Who frees through ``kv`` (``free_kv_row``): the row's holder (a record that is not the
        row's is refused before, in ``_wrap_request_release``)."""
        key = int(self._row_key[int(kv.req_pool_idx)])
        return key or None

    def admit(self, req: Any, *, prompt_tokens: int | None = None) -> bool:
        """Intake check (the scheduler's ``_add_request_to_queue``): a request whose prompt plus
        ``max_new_tokens`` can never fit the pool or the context length is refused before any page
        or row is touched. ``prompt_tokens`` defaults to the length prefill will run: the prompt
        as SGLang holds it (cut by ``--allow-auto-truncate``), except for SGLang's one-token abort
        stub (``set_finish_with_abort``: an abort pending), which is judged at the longer of
        ``origin_input_ids`` and ``origin_input_ids_unpadded``, the length the client sent.
        Returns whether it was admitted; a refused request is aborted under enforce (its
        ``to_finish`` names the two numbers). Under report the refusal is counted once and the
        request is followed at the length it runs, so its later events add no violation."""
        if req.rid not in self._keys and req.rid in self.aborted:
            # A new request under the rid of a refused one that is gone (a client's retry, which
            # SGLang accepts once the first has ended): judged on its own, never on the old
            # refusal (its output would be withheld, and its own violations not acted on).
            del self.aborted[req.rid]
        key = self.request_key(req.rid)
        self._reqs[key] = req
        unsupported = _unsupported(req) if self.policy == "enforce" else None
        if unsupported is not None:
            # SGLang's beam search gives each beam a req_to_token row of its own
            # (ReqToTokenPool.alloc_rows) and writes the beams' slots into the rows directly
            # (beam_search/fork.py); a streaming session lends one request's row and pages to
            # the next turn (StreamingSession): calls kvguard does not follow, so their reads
            # could not be checked. Refused before anything is touched, never run unchecked.
            self._intake_refused.add(key)
            self._abort(key, unsupported, HTTPStatus.BAD_REQUEST)
            logger.warning("kvguard enforce: request %r refused at intake: %s", req.rid, unsupported)
            return False
        run_tokens = len(req.origin_input_ids)
        if prompt_tokens is None:
            prompt_tokens = run_tokens
            if getattr(req, "to_finish", None) is not None or req.finished():
                # set_finish_with_abort swaps origin_input_ids for a one-token stub; the unpadded
                # copy keeps what the client sent.
                unpadded = getattr(req, "origin_input_ids_unpadded", None) or ()
                prompt_tokens = max(run_tokens, len(unpadded))
        max_new = int(getattr(req.sampling_params, "max_new_tokens", None) or 0)
        tenant = self._tenant_key(self.tenant_of(req))
        self._tenants[key] = tenant
        try:
            self.table.admit(key, tenant, int(prompt_tokens), max_new)
        except ViolationError as e:
            self._refused(key, e.violation, HTTPStatus.BAD_REQUEST)
            if self.policy == "report":
                # Followed at the length it will run (SGLang's stub, or what fits), so one
                # over-long request is one violation, not one per event of its life.
                run_new = max(0, min(max_new, self.context_len - run_tokens))
                try:
                    self.table.admit(key, tenant, min(run_tokens, self.context_len), run_new)
                except ViolationError:
                    self._intake_refused.add(key)
                    return False
                self._admitted.add(key)
                self._holds[key] = set()
            return False
        self._admitted.add(key)
        self._holds[key] = set()
        return True

    def _tenant_key(self, tenant: Any) -> int:
        """A stable int per tenant. The table interns a str tenant only while one of its requests
        lives, but a radix-cache prefix outlives its publisher: with str ids, the next request of
        the same tenant would get a new id and be refused as another tenant."""
        key = self._tenant_ids.get(tenant)
        if key is None:
            key = self._tenant_ids[tenant] = len(self._tenant_ids) + 1
            self._tenant_names[key] = tenant
        return key

    def release(self, req: Any) -> None:
        """The request gives its row back: every hold and page it still has ends in kvguard. The
        pages a free by no request named while it held them alone, and that it still holds, go
        back to SGLang now (that free carried out; see ``PageReleases._stray_owed``)."""
        key = self._keys.get(req.rid)
        if key is None or key not in self._admitted:
            return
        mine = self._page_key == key
        owed = self._stray_owed(key, mine)
        if mine.any():
            # Pages the request still held alone when its row went back (SGLang frees them through
            # the row first): if it later releases through a row that is not its own any more,
            # they are returned from here, not from that row.
            self._orphans[id(req.kv)] = (req.kv, np.flatnonzero(mine))
        self._page_key[mine] = _NO_OWNER
        self._page_key[owed] = _NO_OWNER
        late = key in self._late_writers and self.policy == "enforce"
        self._end(key)
        if late and len(owed):
            # A failed transfer may still write them: released, never handed out again.
            self._fenced.extend(owed.tolist())
            self.metrics["late_write_fenced_pages"] += len(owed)
        else:
            self._give_back(owed)
        self._return_withheld()

    def _end(self, key: int) -> None:
        """Admitted request ``key`` ends: its rows are checked in full next, its holds and pages
        end in the table, and kvguard forgets it (its pages' mirror entries are the caller's)."""
        self._forget_checks(key)
        self._admitted.discard(key)
        self._output_checked.discard(key)
        self._stray_held.pop(key, None)
        self._holds.pop(key, None)
        try:
            self.table.release(key)
        except ViolationError as e:
            self._violation(key, e.violation)
        self._reqs.pop(key, None)
        self._forget(key)

    def drop_unscheduled(self, req: Any) -> None:
        """A request that ends without a row (aborted while queued: SGLang's
        ``_release_aborted_request``): kvguard forgets it, so the table does not keep it."""
        if getattr(req.kv, "holds_kv", False):
            return  # its row's release ends it in kvguard
        # A request retracted (its row given back unfinished) and aborted before it got another:
        # no batch will use a row of it again.
        self._suspects.pop(id(req.kv), None)
        key = self._keys.get(req.rid)
        if key is None:
            return
        if key in self._admitted:
            self.release(req)
        else:
            self._reqs.pop(key, None)
            self._forget(key)

    def _forget_checks(self, key: int) -> None:
        """``key`` releases pages: its rows are checked in full at their next forward (no other
        row found clean reads a page ``key`` owns or alone holds)."""
        self._row_checked[self._row_key == key] = 0

    def _forget(self, key: int) -> None:
        self._intake_refused.discard(key)
        rid = self._rids.pop(key, None)
        if rid is not None and self._keys.get(rid) == key:
            del self._keys[rid]
        if rid is not None:
            # Kept to name it in a later violation (the publisher of a cached page, a request
            # released in the same free group before the one refused): the newest few only.
            self._gone_rids[key] = rid
            if len(self._gone_rids) > _GONE_NAMES:
                del self._gone_rids[next(iter(self._gone_rids))]
        self._tenants.pop(key, None)

    # ---- the forward batch ---------------------------------------------------------------------

    def begin_forward(
        self,
        req_pool_indices: Any,
        seq_lens: Any,
        extend_lens: Any = None,
        *,
        out_cache_loc: Any,
        req_pool_indices_cpu: Any = None,
        seq_lens_cpu: Any = None,
    ) -> Any:
        """A forward is about to run (``ModelRunner.forward``), checked now, before any layer: its
        writes ``out_cache_loc`` (one slot per new token) recorded, and the rows of
        ``req_to_token`` and the sequence lengths attention will read verified, with each
        request's new tokens this step (``extend_seq_lens``; one per request in decode). The
        ``_cpu`` copies SGLang's forward batch already has spare a device-to-host copy. Returns
        the slots the forward is to write: ``out_cache_loc``, or under enforce a copy with a
        refused request's slots at the padding slot 0. :meth:`end_forward` after it."""
        self.row_check.begin(req_pool_indices, seq_lens, extend_lens, req_pool_indices_cpu, seq_lens_cpu)
        return self.row_check.check(out_cache_loc)

    def end_forward(self) -> None:
        """The forward is over (device verdicts, if any, are taken here)."""
        self.row_check.end()

    def _imported(self, key: int, tokens: int) -> None:
        """A PD transfer of ``tokens`` landed and was accepted for ``key``."""
        self.metrics["imported_tokens"] += tokens
