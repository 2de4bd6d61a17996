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
``DETACH``         a sliding window dropped a cached block    ``detach_prefix(request, block)``
``RELEASE_PAGES``  a sliding window dropped private blocks    ``release_pages(request, blocks)``
``RELEASE``        ``free`` of a finished request             ``release(request)``
``PREEMPT``        ``free`` of a preempted request            ``preempt(request)``
=================  =========================================  ======================================

A hybrid model's KV cache groups (full attention beside sliding window) share one block pool
and its ids, so one recorder hears every group's manager and one table holds them all: a
request owns the blocks of each of its groups. A sliding window's manager drops the blocks that
fell out of the window while the request runs (``remove_skipped_blocks``: each replaced by the
null block in the request's list and freed): a partial release of that request, not a free
that ends its ownership of the rest (``DETACH`` for a cached block, which stays in vLLM's cache
for others to hit; ``RELEASE_PAGES`` for the others).

Every cached block is its own prefix, keyed by its block id (a block holds at most one cached
incarnation at a time; the table's generation tells incarnations apart). The events of one
scheduler step ride to the worker on ``SchedulerOutput.kvguard_events`` (pickled with it when
the worker is another process): a few small tuples per request that changed, nothing for a
decode step that stays inside its last block.

Order: vLLM hashes a block when it schedules the tokens that fill it, before the step writes
them, and a second request may hit that block in the same step (its attention reads the KV the
first writes earlier in the same forward pass). The worker therefore applies a ``PUBLISH`` made
inside ``schedule`` after recording the step's writes and ``ATTACH`` after that; a request
preempted in the same step as it published (priority scheduling) never wrote those blocks, so
its pending publishes are dropped: a later hit on them is refused (``unknown_prefix``), which is
the truth. Under async scheduling vLLM also hashes blocks in ``update_from_output`` (the tokens
that fill them are known only then, and were written by steps already run) and may free the
request in the same call: such a ``PUBLISH`` is an early event, in the order vLLM made it, so it
lands before that request's ``RELEASE``.

Tenants reach the table as ints the recorder hands out (one per tenant string, kept while a
live request or a published block of that tenant holds it), not as strings: the table forgets a
str tenant when its last request ends, and a later request of the same tenant hitting the
blocks its predecessors published would then read as another tenant's. A tenant with no live
request is forgotten by a sweep that runs when such tenants pile up (doubling its threshold each
time, so the sweeps cost O(1) a release over time), if no published block is of that tenant:
nothing is counted per block on the step's hot paths.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from operator import attrgetter
from typing import Any, NamedTuple

logger = logging.getLogger("vllm.kvguard")

__all__ = [
    "EventKind",
    "RequestBlockMap",
    "RequestBlocks",
    "SchedulerRecorder",
    "StepEvents",
    "set_tenant_of",
    "tenant_of",
]


class EventKind(enum.StrEnum):
    """What an ownership event says (the first item of each event tuple). The tuples are the
    ones ``OwnershipTable.apply_events`` takes, so the worker applies a step's events in one
    call."""

    #: (ADMIT, request, tenant key (int), prompt_tokens, max_new_tokens)
    ADMIT = "admit"
    #: (CLAIM, request, [block ids]) freshly allocated blocks
    CLAIM = "claim"
    #: (ATTACH, request, block id) a prefix-cache hit
    ATTACH = "attach"
    #: (PUBLISH, request, block id, (block id,)) a block that became cacheable
    PUBLISH = "publish"
    #: (RELEASE, request) a finished request freed its blocks
    RELEASE = "release"
    #: (PREEMPT, request) a preempted request freed its blocks
    PREEMPT = "preempt"
    #: (EVICT, request or None, block id) a cached block dropped; request: whose allocation
    #: reused it (charged if the eviction is refused), None for a cache reset
    EVICT = "evict"
    #: (DETACH, request, block id) a sliding window dropped a cached block the request held
    DETACH = "detach"
    #: (RELEASE_PAGES, request, [block ids]) a sliding window dropped blocks of the request's
    #: own (not cached). Not an ``apply_events`` kind: the worker's guard applies it in order
    #: through ``OwnershipTable.release_pages``.
    RELEASE_PAGES = "release_pages"


class StepEvents(NamedTuple):
    """A step's events as they ride on ``SchedulerOutput.kvguard_events``: ``early`` (admit,
    claim, evict, release, preempt, in the order vLLM decided them), applied before the step's
    writes; ``late`` (publishes, then prefix hits), applied after them."""

    early: list[tuple]
    late: list[tuple]


#: Environment variable naming the request fields that make up the tenant: a comma list of
#: ``cache_salt`` and ``lora`` (default both), or ``none`` for one tenant.
TENANT_ENV = "KVGUARD_VLLM_TENANT"

_PUBLIC = "public"
#: How many steps the published blocks a preempted or finished request held are remembered after
#: it gave them back (a refusal reaches the scheduler with its step's output, a step or two after
#: the check).
_GONE_STEPS = 8
#: The prefix of the tenant a request gets when the tenant mapping fails for it (then its id).
_UNMAPPED = "kvguard-unmapped:"


def tenant_fields() -> tuple[bool, bool]:
    """Whether ``cache_salt`` and the LoRA adapter make up the tenant, from ``KVGUARD_VLLM_TENANT``;
    ValueError for a value it cannot read. Read when the plugin is registered (vLLM's loader lets
    that error stop the engine; an error at import it would only log, serving unguarded), and
    read again on each call (the setting is a few string operations)."""
    raw = os.environ.get(TENANT_ENV, "cache_salt,lora").replace(" ", "").lower()
    fields = {f for f in raw.split(",") if f}
    unknown = fields - {"cache_salt", "lora", "none"}
    if unknown:
        raise ValueError(f"{TENANT_ENV}={raw!r}: unknown field(s) {sorted(unknown)}")
    if not fields:
        # An empty setting (a template's unset variable) would make every request one tenant:
        # one tenant is said as ``none``, never by omission.
        raise ValueError(f"{TENANT_ENV}={raw!r}: no field (name cache_salt and/or lora, or none for one tenant)")
    if "none" in fields and len(fields) > 1:
        raise ValueError(f"{TENANT_ENV}={raw!r}: none goes alone")
    return "cache_salt" in fields, "lora" in fields


def default_tenant_of(request: Any) -> str:
    """The tenant of a vLLM ``Request``: its ``cache_salt`` and LoRA adapter name (the fields
    ``KVGUARD_VLLM_TENANT`` names); requests with neither share the tenant ``public``."""
    use_salt, use_lora = _TENANT_FIELDS if _TENANT_FIELDS is not None else tenant_fields()
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


#: The fields in force, set by :func:`check_settings` at registration (None: read on each call).
_TENANT_FIELDS: tuple[bool, bool] | None = None


def check_settings() -> None:
    """Reads ``KVGUARD_VLLM_TENANT`` once and keeps it; ValueError for a bad value."""
    global _TENANT_FIELDS
    _TENANT_FIELDS = tenant_fields()
_tenant_of: Callable[[Any], str] = default_tenant_of


def set_tenant_of(fn: Callable[[Any], str] | None) -> None:
    """Replaces the tenant mapping (a function of vLLM's ``Request`` returning a str); None
    restores the default. Must be set in the engine-core process (a plugin of your own, or
    before the engine starts in-process)."""
    global _tenant_of
    _tenant_of = fn if fn is not None else default_tenant_of


def tenant_of(request: Any) -> str:
    """The tenant the current mapping gives ``request``. A mapping that raises, or returns
    something other than a str, gives the request a tenant of its own (it shares nothing with
    anyone: never a wrong share, and one request's odd fields never stop the engine); logged."""
    try:
        tenant = _tenant_of(request)
    except Exception as e:
        tenant = e
    if isinstance(tenant, str):
        return tenant
    rid = getattr(request, "request_id", None)
    logger.error("kvguard: the tenant mapping gave request %r %r; it gets a tenant of its own", rid, tenant)
    return f"{_UNMAPPED}{rid}"


class RequestBlocks(list):
    """One request's block list in the manager (``req_to_blocks[request_id]``), reporting what
    the manager adds to it: the manager extends it with prefix-cache hits when the request first
    gets blocks and with blocks fresh from ``BlockPool.get_new_blocks`` when it needs more. A
    decode step inside its last block adds nothing, so it costs nothing."""

    __slots__ = ("_recorder", "_request_id")

    def extend(self, blocks: Any) -> None:
        if type(blocks) is not list:
            blocks = list(blocks)
        list.extend(self, blocks)
        if blocks:
            self._recorder.added(self._request_id, blocks)

    def append(self, block: Any) -> None:
        self.extend([block])


class RequestBlockMap(dict):
    """The manager's ``req_to_blocks`` (a ``defaultdict(list)`` in vLLM) with a
    :class:`RequestBlocks` for each request."""

    __slots__ = ("_recorder",)

    def __missing__(self, request_id: str) -> RequestBlocks:
        blocks = RequestBlocks()
        blocks._recorder = self._recorder
        blocks._request_id = request_id
        self[request_id] = blocks
        return blocks


#: The event kinds as module constants: the hooks build tuples with them on every step, and a
#: global load is cheaper than an attribute load on the enum class.
_ADMIT, _CLAIM, _ATTACH, _PUBLISH = EventKind.ADMIT, EventKind.CLAIM, EventKind.ATTACH, EventKind.PUBLISH
_RELEASE, _PREEMPT, _EVICT = EventKind.RELEASE, EventKind.PREEMPT, EventKind.EVICT
_DETACH, _RELEASE_PAGES = EventKind.DETACH, EventKind.RELEASE_PAGES
#: Tenants with no live request that trigger the first sweep (see the module doc).
_SWEEP_AT = 256
#: A block's id, read in C (a comprehension is a Python function call of its own in 3.11).
_block_id = attrgetter("block_id")
#: ``StepEvents(early, late)`` without the Python frame of the named tuple's ``__new__``.
_tuple_new = tuple.__new__


class SchedulerRecorder:
    """Ownership events of one ``KVCacheManager`` (all its KV cache groups).

    ``manager`` is a group's single-type manager, or a list of them (one per KV cache group of a
    hybrid model, sharing one block pool): each one's ``req_to_blocks`` becomes a
    :class:`RequestBlockMap` (same contents, same behaviour), so the recorder hears of each block
    a manager hands a request the moment it does; nothing else of them is written.
    ``max_model_len`` bounds admission as vLLM bounds generation. ``requests``: the scheduler's
    ``requests`` dict (request id -> vLLM ``Request``), read at admission.

    The hooks run inside vLLM's scheduler step, on every block a request gets or fills, so each
    one does the least it can: append a ready event tuple to the step's lists (no per-request
    containers, no work left for :meth:`take`). A decode step costs one call per request that
    crossed into a new block and one per request that filled one.
    """

    def __init__(self, manager: Any, max_model_len: int, requests: dict[str, Any] | None = None) -> None:
        managers = list(manager) if isinstance(manager, (list, tuple)) else [manager]
        #: The single-type managers, one per KV cache group (``manager``: the first).
        self.managers = managers
        self.manager = managers[0]
        self.max_model_len = max_model_len
        self.requests: dict[str, Any] = requests if requests is not None else {}
        self.admitted: set[str] = set()
        #: Block id -> the tenant key of its publisher, for each block published (a live prefix
        #: in the worker's table once applied).
        self.published: dict[int, int] = {}
        #: Request id -> (the step it was preempted or finished in, the published blocks it held
        #: then), kept :data:`_GONE_STEPS` steps: a refusal may reach the scheduler after its
        #: request was preempted, aborted or stopped (async scheduling: step N's output is
        #: processed after step N + 1 was scheduled), and the blocks it hashed for the refused
        #: step must leave the cache then.
        self._gone: dict[str, tuple[int, list[int]]] = {}
        self._steps = 0
        #: True while vLLM's ``schedule`` runs (a block hashed then is written by that step).
        self.in_schedule = False
        #: Tenant string <-> the int key the table knows it by; each key's admitted requests;
        #: keys whose last request ended (forgotten by the next sweep if no block holds them).
        self._tenant_keys: dict[str, int] = {}
        self._tenant_names: dict[int, str] = {}
        self._tenant_live: dict[int, int] = {}
        self._request_tenant: dict[str, int] = {}
        self._idle_tenants: set[int] = set()
        self._sweep_at = _SWEEP_AT
        self._next_tenant_key = 1
        #: The step's early events, its publishes and its prefix hits, in the order heard.
        self._events: list[tuple] = []
        self._publish: list[tuple] = []
        self._attach: list[tuple] = []
        for m in managers:
            blocks = RequestBlockMap()
            blocks._recorder = self
            for rid, old in m.req_to_blocks.items():
                mine = blocks[rid]
                list.extend(mine, old)
            m.req_to_blocks = blocks

    # -- hooks, called by the wrappers in kvguard.vllm.scheduler_side and by RequestBlocks -----

    def tenant_key(self, tenant: str) -> int:
        """The int the table knows ``tenant`` by (made on first use; see the module doc)."""
        key = self._tenant_keys.get(tenant)
        if key is None:
            key = self._next_tenant_key
            self._next_tenant_key += 1
            self._tenant_keys[tenant] = key
            self._tenant_names[key] = tenant
        return key

    def _tenant_ended(self, key: int) -> None:
        """A request of tenant ``key`` was released."""
        live = self._tenant_live.get(key, 0) - 1
        if live > 0:
            self._tenant_live[key] = live
            return
        self._tenant_live.pop(key, None)
        self._idle_tenants.add(key)
        if len(self._idle_tenants) >= self._sweep_at:
            self.sweep_tenants()

    def sweep_tenants(self) -> None:
        """Forgets the tenants with no live request and no published block (their keys are
        never handed out again: a later request of the tenant gets a new one)."""
        held = set(self.published.values())
        kept = set()
        for key in self._idle_tenants:
            if key in self._tenant_live:
                continue
            if key in held:
                kept.add(key)
                continue
            name = self._tenant_names.pop(key, None)
            if name is not None:
                del self._tenant_keys[name]
        self._idle_tenants = kept
        self._sweep_at = max(_SWEEP_AT, 2 * len(kept))

    def tenant_name(self, key: int) -> str | None:
        """The tenant string behind a key, while it is held (for the operator's log)."""
        return self._tenant_names.get(key)

    def _admit(self, rid: str) -> None:
        request = self.requests.get(rid)
        if request is None:
            # Not a request of the scheduler this recorder knows: its claims will be refused
            # as an unknown request, which is what the worker's table should say.
            return
        prompt = int(request.num_prompt_tokens)
        max_new = max(0, min(int(request.max_tokens or 0), self.max_model_len - prompt))
        key = self.tenant_key(tenant_of(request))
        self._tenant_live[key] = self._tenant_live.get(key, 0) + 1
        self._request_tenant[rid] = key
        self._events.append((_ADMIT, rid, key, prompt, max_new))
        self.admitted.add(rid)

    def _unpublish(self, block_ids: Any) -> None:
        """The blocks are no longer published."""
        pop = self.published.pop
        for b in block_ids:
            pop(b, None)

    def _publish_one(self, rid: str, block_id: int) -> None:
        self.published[block_id] = self._request_tenant.get(rid, 0)
        event = (_PUBLISH, rid, block_id, (block_id,))
        # Hashed inside schedule: written by this step, published after its writes. Hashed in
        # update_from_output (async): written already, published in order (before a release).
        (self._publish if self.in_schedule else self._events).append(event)

    def added(self, rid: str, blocks: list[Any]) -> None:
        """The manager appended ``blocks`` to request ``rid``'s list: fresh ones from
        ``get_new_blocks`` (a claim; no hash yet: vLLM drops a reused cached block's hash as it
        hands it out, and those the recorder had published are evictions), or else prefix-cache
        hits (found by their hash; attached after the step's writes). vLLM appends the two
        kinds in separate calls."""
        if rid not in self.admitted:
            self._admit(rid)
        if blocks[0].is_null:
            # A sliding window's prefix hit starts with null blocks for the tokens before its
            # window (vLLM pads with them): nothing is held there.
            blocks = [b for b in blocks if not b.is_null]
            if not blocks:
                return
        if blocks[0].block_hash is None:
            ids = list(map(_block_id, blocks))
            published = self.published
            if published and not published.keys().isdisjoint(ids):
                evicted = [b for b in ids if b in published]
                for b in evicted:
                    del published[b]
                self._events.extend([(_EVICT, rid, b) for b in evicted])
            self._events.append((_CLAIM, rid, ids))
            return
        self._attach.extend([(_ATTACH, rid, b.block_id) for b in blocks if not b.is_null])

    def cached(self, rid: str, blocks: list[Any], start: int, end: int) -> None:
        """``BlockPool.cache_full_blocks`` hashed ``blocks[start:end]`` of request ``rid``
        (those that got a hash are published after the step's writes)."""
        published = self.published
        if end - start == 1 and start < len(blocks):
            # A decode step filled one block: the common case, without a loop or a call.
            b = blocks[start]
            block_id = b.block_id
            if b.block_hash is not None and not b.is_null and block_id not in published:
                published[block_id] = self._request_tenant.get(rid, 0)
                (self._publish if self.in_schedule else self._events).append((_PUBLISH, rid, block_id, (block_id,)))
            return
        for b in blocks[start:end]:
            block_id = b.block_id
            if b.block_hash is not None and not b.is_null and block_id not in published:
                self._publish_one(rid, block_id)

    def dropped(self, rid: str, blocks: list[Any]) -> None:
        """A sliding window's manager dropped ``blocks`` of request ``rid`` (they fell out of its
        window: vLLM put the null block in their place and freed them). A partial release: the
        cached ones are detached (they stay in vLLM's cache, for others to hit), the others
        released; the request keeps the rest."""
        if rid not in self.admitted:
            return
        published = self.published
        own = []
        for b in blocks:
            if b.is_null:
                continue
            if b.block_id in published:
                self._events.append((_DETACH, rid, b.block_id))
            else:
                own.append(b.block_id)
        if own:
            self._events.append((_RELEASE_PAGES, rid, own))

    def evicted(self, block_ids: Any) -> None:
        """``BlockPool.evict_blocks`` dropped the hashes of ``block_ids`` outside an
        allocation (a KV connector's evictions)."""
        for block_id in block_ids:
            if block_id in self.published:
                self._unpublish((block_id,))
                self._events.append((_EVICT, None, block_id))

    def freed(self, request: Any, held: list[int] | None = None) -> None:
        """``free``/``pop_blocks_for_free``: a finished request releases, a live one is preempted.
        Its publishes and prefix hits still pending in this step are dropped (it never wrote the
        blocks it was to publish). ``held``: the published blocks the request held
        (:meth:`published_of`, read before vLLM freed them), remembered for a refusal to come."""
        rid = request.request_id
        if rid not in self.admitted:
            return
        if self._publish:
            kept = [e for e in self._publish if e[1] != rid]
            if len(kept) != len(self._publish):
                self._unpublish([e[2] for e in self._publish if e[1] == rid])
                self._publish = kept
        if self._attach:
            self._attach = [e for e in self._attach if e[1] != rid]
        if held:
            self._gone.pop(rid, None)  # (re-entered last: the dict stays oldest first)
            self._gone[rid] = (self._steps, held)
        if request.is_finished():
            self.admitted.discard(rid)
            key = self._request_tenant.pop(rid, None)
            if key is not None:
                self._tenant_ended(key)
            self._events.append((_RELEASE, rid))
        else:
            self._events.append((_PREEMPT, rid))

    def published_of(self, rid: str) -> list[int]:
        """The published blocks of ``rid``: those it holds (it published them or took them as
        prefix-cache hits), and those it held when it was preempted or finished in the steps
        before (run after a refusal, and as vLLM frees the request)."""
        published = self.published
        blocks = [b.block_id for m in self.managers for b in m.req_to_blocks.get(rid, ()) if b.block_id in published]
        gone = self._gone.get(rid)
        if gone is not None:
            blocks.extend(b for b in gone[1] if b in published)
            return list(dict.fromkeys(blocks))
        return blocks

    def cache_reset(self) -> None:
        """``reset_prefix_cache`` succeeded: every cached block lost its hash."""
        if self.published:
            blocks = sorted(self.published)
            self._events.extend([(_EVICT, None, b) for b in blocks])
            self._unpublish(blocks)

    def take(self) -> StepEvents | None:
        """The step's events in the order the worker applies them (None when there are none)."""
        self._steps += 1
        gone = self._gone
        if gone:
            # Oldest first (an entry is re-entered last): drop from the front, O(1) a request.
            oldest = self._steps - _GONE_STEPS
            while gone:
                rid = next(iter(gone))
                if gone[rid][0] >= oldest:
                    break
                del gone[rid]
        early, late, attach = self._events, self._publish, self._attach
        if not (early or late or attach):
            return None
        if attach:
            late.extend(attach)
            self._attach = []
        self._events, self._publish = [], []
        return _tuple_new(StepEvents, (early, late))
