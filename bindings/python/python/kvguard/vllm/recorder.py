"""The scheduler side: vLLM's KV cache manager decisions as ownership events.

vLLM's ``KVCacheBlock`` has no owner: ownership lives implicitly in the manager's per-request
block lists and reference counts. The :class:`SchedulerRecorder` of a ``KVCacheManager`` writes
down each decision the moment the manager makes it, in the vocabulary of the ownership table:

=================  =========================================  ======================================
event              vLLM decision                              ownership table call (worker side)
=================  =========================================  ======================================
``ADMIT``          first allocation for a request             ``admit(request, tenant, prompt, max)``
``CLAIM``          ``allocate_slots`` handed out new blocks   ``claim(request, blocks)``
``ATTACH``         a prefix-cache hit really reused blocks    ``attach_prefix(request, block)``
``PUBLISH``        blocks became cacheable (got a hash)       ``publish_prefix(request, block, [block])``
``EVICT``          a cached block lost its hash (reuse/reset) ``evict_prefix(block)``
``RELEASE``        ``free`` of a finished request             ``release(request)``
``PREEMPT``        ``free`` of a preempted request            ``preempt(request)``
=================  =========================================  ======================================

Every cached block is its own prefix, keyed by its block id (a block holds at most one cached
incarnation at a time; the table's generation tells incarnations apart). The events of one
scheduler step ride to the worker on ``SchedulerOutput.kvguard_events`` (pickled with it when
the worker is another process): a few small tuples per request that changed, nothing for a
decode step that stays inside its last block.

Order: vLLM hashes a block when it schedules the tokens that fill it, before the step writes
them, and a second request may hit that block in the same step (its attention reads the KV the
first writes earlier in the same forward pass). The worker therefore applies ``PUBLISH`` after
recording the step's writes and ``ATTACH`` after that; a request preempted in the same step as
it published (priority scheduling) never wrote those blocks, so its pending publishes are
dropped: a later hit on them is refused (``unknown_prefix``), which is the truth.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

__all__ = ["EventKind", "SchedulerRecorder", "set_tenant_of", "tenant_of"]


class EventKind(enum.IntEnum):
    """What an ownership event says (the first item of each event tuple)."""

    #: (ADMIT, request, tenant, prompt_tokens, max_new_tokens)
    ADMIT = 0
    #: (CLAIM, request, [block ids]) freshly allocated blocks
    CLAIM = 1
    #: (ATTACH, request, [block ids]) prefix-cache hits
    ATTACH = 2
    #: (PUBLISH, request, [block ids]) blocks that became cacheable
    PUBLISH = 3
    #: (RELEASE, request) a finished request freed its blocks
    RELEASE = 4
    #: (PREEMPT, request) a preempted request freed its blocks
    PREEMPT = 5
    #: (EVICT, request or None, [block ids]) cached blocks dropped; request: whose allocation
    #: reused them (charged if the eviction is refused), None for a cache reset
    EVICT = 6


#: Environment variable naming the request fields that make up the tenant: a comma list of
#: ``cache_salt`` and ``lora`` (default both), or ``none`` for one tenant.
TENANT_ENV = "KVGUARD_VLLM_TENANT"

_PUBLIC = "public"


def _fields_from_env() -> tuple[bool, bool]:
    raw = os.environ.get(TENANT_ENV, "cache_salt,lora").replace(" ", "").lower()
    fields = {f for f in raw.split(",") if f}
    unknown = fields - {"cache_salt", "lora", "none"}
    if unknown:
        raise ValueError(f"{TENANT_ENV}={raw!r}: unknown field(s) {sorted(unknown)}")
    return "cache_salt" in fields, "lora" in fields


def default_tenant_of(request: Any) -> str:
    """The tenant of a vLLM ``Request``: its ``cache_salt`` and LoRA adapter name (the fields
    ``KVGUARD_VLLM_TENANT`` names); requests with neither share the tenant ``public``."""
    use_salt, use_lora = _TENANT_FIELDS
    parts = []
    if use_salt:
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts.append(f"salt={salt}")
    if use_lora:
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(f"lora={getattr(lora, 'lora_name', lora)}")
    return ";".join(parts) if parts else _PUBLIC


_TENANT_FIELDS = _fields_from_env()
_tenant_of: Callable[[Any], str] = default_tenant_of


def set_tenant_of(fn: Callable[[Any], str] | None) -> None:
    """Replaces the tenant mapping (a function of vLLM's ``Request`` returning a str); None
    restores the default. Must be set in the engine-core process (a plugin of your own, or
    before the engine starts in-process)."""
    global _tenant_of
    _tenant_of = fn if fn is not None else default_tenant_of


def tenant_of(request: Any) -> str:
    """The tenant the current mapping gives ``request``."""
    return _tenant_of(request)


class SchedulerRecorder:
    """Ownership events of one ``KVCacheManager`` (single full-attention KV cache group).

    ``manager`` is the group's single-type manager (its ``req_to_blocks`` and
    ``num_cached_block`` are read, never written); ``max_model_len`` bounds admission as vLLM
    bounds generation.
    """

    def __init__(self, manager: Any, max_model_len: int) -> None:
        self.manager = manager
        self.max_model_len = max_model_len
        self.admitted: set[str] = set()
        #: Block ids published (a live prefix in the worker's table once applied).
        self.published: set[int] = set()
        self._events: list[tuple] = []
        self._publish: dict[str, list[int]] = {}
        self._attach: dict[str, list[int]] = {}
        self._in_alloc = False
        self._evicted: list[int] = []

    # -- hooks, called by the wrappers in kvguard.vllm.hooks ---------------------------------

    def begin_allocation(self, request_id: str) -> tuple[int, int]:
        """Before ``allocate_slots``: the request's block count and cached count."""
        self._in_alloc = True
        self._evicted = []
        blocks = self.manager.req_to_blocks.get(request_id)
        return (len(blocks) if blocks else 0, self.manager.num_cached_block.get(request_id, 0))

    def end_allocation(self, request: Any, before: tuple[int, int], hits: Any) -> None:
        """After ``allocate_slots``: what it admitted, handed out, reused and hashed."""
        self._in_alloc = False
        rid = request.request_id
        n_before, cached_before = before
        blocks = self.manager.req_to_blocks.get(rid) or ()
        evicted, self._evicted = self._evicted, []
        if len(blocks) == n_before and not evicted and self.manager.num_cached_block.get(rid, 0) <= cached_before:
            return  # the common decode step: nothing new
        new = blocks[n_before:]
        if rid not in self.admitted:
            prompt = int(request.num_prompt_tokens)
            max_new = max(0, min(int(request.max_tokens or 0), self.max_model_len - prompt))
            self._events.append((EventKind.ADMIT, rid, tenant_of(request), prompt, max_new))
            self.admitted.add(rid)
        if evicted:
            self._events.append((EventKind.EVICT, rid, evicted))
        n_hits = len(hits) if n_before == 0 else 0
        hit_ids = [b.block_id for b in new[:n_hits] if not b.is_null]
        claimed = [b.block_id for b in new[n_hits:] if not b.is_null]
        if claimed:
            self._events.append((EventKind.CLAIM, rid, claimed))
        if hit_ids:
            self._attach.setdefault(rid, []).extend(hit_ids)
        cached_after = self.manager.num_cached_block.get(rid, 0)
        if cached_after > cached_before:
            hit_set = set(hit_ids)
            fresh = [
                b.block_id
                for b in blocks[cached_before:cached_after]
                if not b.is_null
                and b.block_hash is not None
                and b.block_id not in hit_set
                and b.block_id not in self.published
            ]
            if fresh:
                self.published.update(fresh)
                self._publish.setdefault(rid, []).extend(fresh)

    def evicted(self, block_id: int) -> None:
        """``BlockPool`` dropped the hash of ``block_id``."""
        if block_id not in self.published:
            return
        self.published.discard(block_id)
        if self._in_alloc:
            self._evicted.append(block_id)
        else:
            self._events.append((EventKind.EVICT, None, [block_id]))

    def freed(self, request: Any) -> None:
        """``free``/``pop_blocks_for_free``: a finished request releases, a live one is preempted."""
        rid = request.request_id
        if rid not in self.admitted:
            return
        for block in self._publish.pop(rid, ()):
            self.published.discard(block)
        self._attach.pop(rid, None)
        if request.is_finished():
            self.admitted.discard(rid)
            self._events.append((EventKind.RELEASE, rid))
        else:
            self._events.append((EventKind.PREEMPT, rid))

    def cache_reset(self) -> None:
        """``reset_prefix_cache`` succeeded: every cached block lost its hash."""
        if self.published:
            self._events.append((EventKind.EVICT, None, sorted(self.published)))
            self.published.clear()

    def take(self) -> list[tuple] | None:
        """The step's events in the order the worker applies them (None when there are none)."""
        events = self._events
        for rid, blocks in self._publish.items():
            events.append((EventKind.PUBLISH, rid, blocks))
        for rid, blocks in self._attach.items():
            events.append((EventKind.ATTACH, rid, blocks))
        self._events, self._publish, self._attach = [], {}, {}
        return events or None
