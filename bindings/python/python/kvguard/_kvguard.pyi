"""Type stubs of the extension module kvguard._kvguard (re-exported by kvguard)."""

from collections.abc import Callable, Sequence
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

__version__: str
PADDING_SLOT: int
VIOLATION_KINDS: list[str]

Id = int | str
"""A request or tenant id: an int in 0..2**63, or a str (interned, released with the request)."""
IntArray = Any
"""An int32/int64 array read in place: a numpy array (views included), a buffer-protocol object
(memoryview, array.array, bytes, mmap, C exporters) or a host DLPack tensor (torch CPU or pinned
tensors, their .numpy() views). Every view must lie inside the memory of the object that owns it
(numpy's base chain, a buffer export, a DLPack capsule), else ValueError. Refused with TypeError:
objects exposing only __array_interface__ (their pointer cannot be checked), device tensors (use
kvguard.DeviceGuard), owners that cannot be established. Where a 1-D argument also accepts
Sequence[int], a sequence is copied. See docs/bindings.md, Arrays."""
StepEvent = tuple[Any, ...]
"""An ownership event for apply_events: ("admit", request, tenant, prompt_tokens, max_new_tokens),
("claim", request, pages), ("release", request), ("preempt", request), ("publish", request, key,
pages), ("attach", request, key), ("detach", request, key), ("evict", request | None, key) or
("release_pages", request, pages)."""

class Error(Exception): ...

class ViolationError(Error):
    violation: Violation
    kind: str
    op: str
    request: Id | None
    tenant: Id | None
    page: int | None
    generation: int | None
    owner: Id | None
    owner_tenant: Id | None
    slots: tuple[int, int] | None
    block_index: int | None
    prefix: int | None

class ConfigError(Error): ...

class OutOfPagesError(Error):
    requested: int
    free: int

class ScrubError(Error): ...

class TransferError(Error):
    kind: str | None
    violation: Violation | None

class NixlError(Error):
    """The NIXL transport failed (wheel built with the `nixl` feature): no verdict on content."""

    kind: str  # 'library' | 'call' | 'timeout' | 'declined' | 'extents' | 'notice' | 'segment'
    in_flight: list[int]
    """A push that failed with WRITEs NIXL has not reported complete: the source pages they may
    still read (reuse them once NixlLink.settle_pushes hands them back); a stage that failed
    before decode released it: the staged pages decode may still READ (reuse them once
    NixlLink.settle_stages hands them back). Empty otherwise."""

class TraceError(Error):
    line: int

class DeviceError(Error): ...

@final
class PoolConfig:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_context_tokens: int,
        *,
        reserved: Sequence[int] = (),
        policy: str = "enforce",
        scrub_on_release: bool = False,
        generation_limit: int = 2**32 - 1,
    ) -> None: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def max_context_tokens(self) -> int: ...
    @property
    def reserved(self) -> list[int]: ...
    @property
    def policy(self) -> str: ...
    @property
    def scrub_on_release(self) -> bool: ...
    @property
    def generation_limit(self) -> int: ...
    def validate(self) -> None: ...
    def audit(self) -> None: ...
    def allocatable_pages(self) -> int: ...
    def capacity_tokens(self) -> int: ...
    def pages_for_tokens(self, tokens: int) -> int: ...

@final
class PageRef:
    page: int
    generation: int
    def __init__(self, page: int, generation: int) -> None: ...
    def __index__(self) -> int: ...
    def __hash__(self) -> int: ...

@final
class Violation:
    @property
    def kind(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def request(self) -> Id | None: ...
    @property
    def tenant(self) -> Id | None: ...
    @property
    def page(self) -> int | None: ...
    @property
    def generation(self) -> int | None: ...
    @property
    def expected_generation(self) -> int | None: ...
    @property
    def block_index(self) -> int | None: ...
    @property
    def owner(self) -> Id | None: ...
    @property
    def owner_tenant(self) -> Id | None: ...
    @property
    def slots(self) -> tuple[int, int] | None: ...
    @property
    def prefix(self) -> int | None: ...
    @property
    def amounts(self) -> tuple[int, int] | None: ...

@final
class Released:
    ended: int
    scrub: list[PageRef]

@final
class PageInfo:
    state: str
    generation: int
    owner: Id | None
    tenant: Id | None
    prefix: int | None
    written_prefix: int
    written_slots: int

@final
class RequestInfo:
    tenant: Id
    prompt_tokens: int
    max_new_tokens: int
    owned_pages: list[PageRef]
    prefixes: list[int]
    quarantined: bool

@final
class PoolSnapshot:
    total_pages: int
    free: int
    owned: int
    shared: int
    reserved: int
    retired: int
    awaiting_scrub: int
    requests: int
    quarantined: int
    prefixes: int
    violations: int
    violations_dropped: int
    in_flight: int
    def as_dict(self) -> dict[str, int]: ...

@final
class StepVerdict:
    @property
    def clean(self) -> bool: ...
    @property
    def rows(self) -> int: ...
    @property
    def refused(self) -> list[tuple[int, Violation]]: ...
    @property
    def refused_rows(self) -> list[int]: ...
    @property
    def violations(self) -> list[Violation]: ...
    @property
    def refused_mask(self) -> npt.NDArray[np.bool_]: ...
    def __len__(self) -> int: ...

@final
class RowCache:
    """What an engine's block-table rows were last checked clean as, kept across steps (verify_rows)."""

    def __init__(self) -> None: ...
    @property
    def incremental(self) -> int: ...
    @property
    def full(self) -> int: ...
    def clear(self) -> None: ...

@final
class HeldBlockTable:
    """A block table the guard holds: rows of int32 page ids changed only through its methods, read
    through a read-only buffer (numpy.asarray(held): rows x width int32, -1 past each row's length);
    OwnershipTable.verify_held_rows judges each step from what changed."""

    def __init__(self, rows: int, width: int) -> None: ...
    @property
    def rows(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def incremental(self) -> int: ...
    @property
    def full(self) -> int: ...
    def row(self, row: int) -> list[int]: ...
    def append(self, row: int, entries: Sequence[int] | IntArray) -> None: ...
    def set_row(self, row: int, entries: Sequence[int] | IntArray) -> None: ...
    def truncate(self, row: int, length: int) -> None: ...
    def clear_row(self, row: int) -> None: ...
    def copy_row(self, src: int, dst: int) -> None: ...
    def swap_rows(self, a: int, b: int) -> None: ...
    def forget(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class OwnershipTable:
    def __init__(self, config: PoolConfig, *, audit: bool = True) -> None: ...
    @property
    def config(self) -> PoolConfig: ...
    @property
    def page_size(self) -> int: ...
    def admit(self, request: Id, tenant: Id, prompt_tokens: int, max_new_tokens: int) -> None: ...
    def allocate(self, request: Id, n: int) -> list[PageRef]: ...
    def claim(self, request: Id, pages: Sequence[int] | IntArray) -> list[PageRef]: ...
    def claim_step(self, req_ids: Sequence[Id] | IntArray, pages: Sequence[int] | IntArray, indptr: Sequence[int] | IntArray) -> StepVerdict:
        """A step's shadow claims under one lock: request i claims pages[indptr[i]:indptr[i+1]],
        each all or nothing, judged as claim() called in order; refused rows in the verdict."""
    def record_write(self, request: Id, page: int, start: int, end: int) -> None: ...
    def record_write_tokens(self, request: Id, block_table: Sequence[int] | IntArray, start: int, end: int) -> None: ...
    def record_write_tokens_refs(self, request: Id, refs: Sequence[PageRef], start: int, end: int) -> None: ...
    def record_step_writes(self, req_ids: Sequence[Id] | IntArray, slot_mapping: IntArray, query_start_loc: Sequence[int] | IntArray) -> StepVerdict: ...
    def check_read(self, request: Id, block_table: Sequence[int] | IntArray, tokens: int) -> Violation | None: ...
    def verify_read(self, request: Id, block_table: Sequence[int] | IntArray, tokens: int) -> None: ...
    def check_read_refs(self, request: Id, refs: Sequence[PageRef], tokens: int) -> Violation | None: ...
    def verify_read_refs(self, request: Id, refs: Sequence[PageRef], tokens: int) -> None: ...
    def check_step(self, req_ids: Sequence[Id] | IntArray, block_tables: IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def verify_step(self, req_ids: Sequence[Id] | IntArray, block_tables: IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def check_step_csr(self, req_ids: Sequence[Id] | IntArray, kv_indptr: IntArray, kv_indices: IntArray, kv_last_page_len: IntArray) -> StepVerdict: ...
    def verify_step_csr(self, req_ids: Sequence[Id] | IntArray, kv_indptr: IntArray, kv_indices: IntArray, kv_last_page_len: IntArray) -> StepVerdict: ...
    def worker_row_counts(self) -> tuple[int, int]:
        """(rows judged from their last clean page, rows judged in full) by the worker steps so far."""
    def check_held_rows(self, held: HeldBlockTable, req_ids: Sequence[Id] | IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def verify_held_rows(self, held: HeldBlockTable, req_ids: Sequence[Id] | IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict:
        """A step's reads through a block table the guard holds, judged from what changed: a row whose entries
        checked whole were not changed since, read by the same request who lost nothing since, from its last page."""
    def check_rows(self, cache: RowCache, req_ids: Sequence[Id] | IntArray, table: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def verify_rows(self, cache: RowCache, req_ids: Sequence[Id] | IntArray, table: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray) -> StepVerdict:
        """verify_step_rows across steps, incrementally: a row unchanged since cache saw it clean, its request
        having lost nothing since, is judged from its last page; table: C-contiguous 2-D int32 page ids."""
    def check_step_rows(self, req_ids: Sequence[Id] | IntArray, table: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray, *, token_slots: bool = False, cached: bool = False) -> StepVerdict: ...
    def verify_step_rows(self, req_ids: Sequence[Id] | IntArray, table: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray, *, token_slots: bool = False, cached: bool = False) -> StepVerdict:
        """verify_step reading request i's block table in place from row rows[i] of table;
        token_slots=True: one KV slot per token (SGLang's req_to_token), page j = entry j*page_size // page_size.
        cached=True (token slots, a C-contiguous int32 table): through this table's SlotRowCache, a row whose
        reader lost nothing and whose entries are unchanged since its last clean check is judged from the page
        that check ended in; the same verdict as a full check, row for row."""
    def check_step_window(self, req_ids: Sequence[Id] | IntArray, table: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray, from_tokens: Sequence[int] | IntArray, *, token_slots: bool = False) -> StepVerdict:
        """check_step_rows over each request's window: tokens from_tokens[i]..seq_lens[i] of row rows[i]
        (the pages holding them); pure. 0 checks the whole row; beyond seq_lens[i]: nothing unchecked.
        Any dtype or layout of table gives the verdicts of the same table as C-contiguous int32."""
    def claim_decode_slots(self, row_keys: IntArray, row_claimants: IntArray, page_owner: IntArray, page_prefix: IntArray, rows: Sequence[int] | IntArray, slots: Sequence[int] | IntArray) -> tuple[StepVerdict, list[int], Any]:
        """A decode step's block-table writes (one slot per row) against the engine's mirror of page owners:
        each new page of a live row, no prefix, claimed in one claim_step; returns (verdict over the claims,
        [positions left to the engine], granted (page, key) int64 array of shape (m, 2)). Writes nothing."""
    def write_decode_rows(self, row_keys: IntArray, row_claimants: IntArray, page_owner: IntArray, page_prefix: IntArray, row_checked: IntArray, rows: Sequence[int] | IntArray, cols: Sequence[int] | IntArray, slots: Sequence[int] | IntArray) -> tuple[StepVerdict, list[int]] | None:
        """claim_decode_slots with the mirror updated in place (page_owner and row_checked: writable int64):
        row_checked[rows[i]] drops to cols[i] where lower, each granted page_owner[page] = key. None when every
        row's page was its own or claimed cleanly; else (verdict over the claims, [positions left to the engine])."""
    def check_decode_forward(self, row_keys: IntArray, row_claimants: IntArray, row_checked: IntArray, req_to_token: IntArray, rows: Sequence[int] | IntArray, seq_lens: Sequence[int] | IntArray, out_cache_loc: Sequence[int] | IntArray) -> tuple[str, StepVerdict | None] | None:
        """A decode forward's first KV store in one call: the writes (one slot per row) recorded, judged, then each
        row's window (tokens row_checked[rows[i]].. of req_to_token, token slots) checked, pure; clean: row_checked
        [rows[i]] = seq_lens[i] and None. Else ("full", None): nothing done; ("writes", verdict): the writes' verdict,
        nothing read; ("window", None): the writes recorded, judge the rows with verify_step_rows. Any dtype or
        layout of req_to_token: what the same table as C-contiguous int32 gives."""
    def check_step_refs(self, req_ids: Sequence[Id] | IntArray, refs: Sequence[Sequence[PageRef]], seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def verify_step_refs(self, req_ids: Sequence[Id] | IntArray, refs: Sequence[Sequence[PageRef]], seq_lens: Sequence[int] | IntArray) -> StepVerdict: ...
    def release(self, request: Id) -> Released: ...
    def release_pages(self, request: Id, pages: Sequence[int] | IntArray) -> Released: ...
    def release_pages_refs(self, request: Id, refs: Sequence[PageRef]) -> Released: ...
    def preempt(self, request: Id) -> Released: ...
    def confirm_scrubbed(self, refs: Sequence[PageRef]) -> None: ...
    def publish_prefix(self, request: Id, key: int, pages: Sequence[int] | IntArray) -> None: ...
    def publish_prefix_refs(self, request: Id, key: int, refs: Sequence[PageRef]) -> None: ...
    def attach_prefix(self, request: Id, key: int) -> list[PageRef]: ...
    def detach_prefix(self, request: Id, key: int) -> Released: ...
    def evict_prefix(self, key: int) -> Released: ...
    def allow_cross_tenant_sharing(self, tenant: Id, allow: bool) -> None: ...
    def fork(self, parent: Id, child: Id) -> None: ...
    def record_import(self, request: Id, pages: Sequence[int] | IntArray, tokens: int, expected: int) -> None: ...
    def begin_import(self, request: Id, refs: Sequence[PageRef]) -> ImportTicket: ...
    def take_changed_pages(self) -> list[tuple[int, PageInfo]]: ...
    def record_violation(self, violation: Violation) -> None: ...
    def snapshot(self) -> PoolSnapshot: ...
    def page_info(self, page: int) -> PageInfo | None:
        """None for any int that names no page of the pool (negative, or past its end)."""
    def request_info(self, request: Id) -> RequestInfo | None: ...
    def counters(self) -> dict[str, int]: ...
    def drain_violations(self) -> list[Violation]: ...
    def request_key(self, request: Id) -> int: ...
    def tenant_key(self, tenant: Id) -> int: ...
    def interned(self) -> tuple[int, int]: ...
    # one call per step for an engine plugin (kvguard.vllm)
    def apply_events(self, events: Sequence[StepEvent]) -> list[tuple[int, Violation]]:
        """A step's ownership events in order, in one call, each judged as its single-event
        method would be; [(index, Violation)] of the refused ones. Malformed events raise
        TypeError/ValueError before any is applied."""
    def record_and_verify_step(
        self,
        req_ids: Sequence[Id] | IntArray,
        block_table: IntArray,
        num_computed_tokens: Sequence[int] | IntArray,
        num_scheduled_tokens: Sequence[int] | IntArray,
        events: Sequence[StepEvent] | None = None,
    ) -> tuple[StepVerdict, list[tuple[int, Violation]], StepVerdict]:
        """vLLM's worker step in one call: the writes (slot mapping computed from the rows), then
        `events` (as apply_events), then the reads of computed + scheduled tokens;
        (writes, refused_events, reads)."""
    def apply_record_and_verify_step(
        self,
        early: Sequence[StepEvent] | None,
        req_ids: Sequence[Id] | IntArray,
        block_table: IntArray,
        num_computed_tokens: Sequence[int] | IntArray,
        num_scheduled_tokens: Sequence[int] | IntArray,
        late: Sequence[StepEvent] | None = None,
    ) -> tuple[list[tuple[int, Violation]], StepVerdict, list[tuple[int, Violation]], StepVerdict]:
        """vLLM's whole worker step in one call: the `early` events (as apply_events), then what
        record_and_verify_step does with `late`; (refused_early, writes, refused_late, reads).
        Every event, array and req_ids entry is checked before anything is applied."""

@final
class ImportTicket:
    def finish(self, tokens: int, expected: int) -> None: ...
    def fail(self, index: int | None = None) -> Violation:
        """Landing failed at entry `index`: coverage revoked, landing_failed recorded."""
    def abort(self) -> None: ...
    @property
    def open(self) -> bool: ...
    @property
    def request(self) -> Id: ...
    @property
    def pages(self) -> list[PageRef]: ...
    def __enter__(self) -> ImportTicket: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool: ...

@final
class Manifest:
    @staticmethod
    def build(request: int, tenant: int, sender: int, page_size: int, slot_bytes: int, prompt: Sequence[int] | IntArray, dest: Sequence[PageRef], pages: Sequence[Any]) -> Manifest: ...
    @staticmethod
    def decode(data: Any) -> Manifest: ...
    def encode(self) -> bytes: ...
    @property
    def request(self) -> int: ...
    @property
    def tenant(self) -> int: ...
    @property
    def sender(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def prompt_digest(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def pages(self) -> list[tuple[PageRef, int, int]]: ...

@final
class Accepted:
    tokens: int
    pages: int

@final
class Receiver:
    def __init__(self, table: OwnershipTable) -> None: ...
    def accept(
        self,
        request: Id,
        tenant: Id,
        prompt: Sequence[int] | IntArray,
        dest: Sequence[PageRef],
        manifest: Any,
        pages: Sequence[Any],
        *,
        slot_bytes: int,
        page_size: int | None = None,
        sender: int | None = None,
        land: Callable[[int, PageRef, bytes], object] | None = None,
    ) -> Accepted: ...
    def pin(
        self,
        request: Id,
        tenant: Id,
        prompt: Sequence[int] | IntArray,
        dest: Sequence[PageRef],
        *,
        slot_bytes: int,
        page_size: int | None = None,
        sender: int | None = None,
    ) -> PinnedImport: ...

@final
class PinnedImport:
    """A transfer whose receiving pages are pinned (Receiver.pin); it ends exactly once."""

    @property
    def pages(self) -> list[PageRef]: ...
    @property
    def request(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    def accept(
        self,
        manifest: Any,
        pages: Sequence[Any],
        land: Callable[[int, PageRef, bytes], object] | None = None,
    ) -> Accepted: ...
    def abort(self) -> None:
        """Gives up with no verdict: the pages unpinned. Not for a transfer a peer may still write
        (a NIXL push offered): NixlLink.abandon fences its pages instead."""
    def __enter__(self) -> PinnedImport: ...
    def __exit__(self, *exc: object) -> bool: ...

# Checked transfers over NIXL: present only in a wheel built with the `nixl` feature.

def nixl_library_available() -> bool: ...
@final
class NixlAgent:
    """A NIXL agent (UCX back end, no progress thread)."""

    def __init__(self, name: str) -> None: ...
    @property
    def name(self) -> str: ...
    def metadata(self) -> bytes: ...

@final
class HostRegion:
    """Host pages registered with an agent; page i at page_bytes * i. A NixlLink holding a
    failed push's WRITEs keeps the region pushed from alive until it holds no page; keep a staged
    region alive yourself while NixlLink.in_flight names its pages."""

    def __init__(self, agent: NixlAgent, pages: int, page_bytes: int) -> None: ...
    @property
    def pages(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    def layout(self) -> bytes: ...
    def read(self, page: int, length: int | None = None) -> bytes: ...
    def checksum(self, page: int, length: int | None = None) -> tuple[int, int]: ...
    def write(self, page: int, data: Any) -> None: ...
    def scrub(self, pages: Sequence[int | PageRef]) -> None: ...

@final
class EnginePool:
    """An engine's own KV pool, page i at base + page_bytes * i, registered through kvguard
    (register=True) or by the engine beforehand; transfers are received into it in place. Its
    memory is the engine's: keep it allocated while NixlLink.in_flight names its pages (a held
    WRITE or READ still reads them; the link keeps only this object alive, for a failed push)."""

    def __init__(self, agent: NixlAgent, buffer: Any, page_bytes: int, *, register: bool = True) -> None: ...
    @staticmethod
    def at(
        agent: NixlAgent,
        address: int,
        length: int,
        page_bytes: int,
        *,
        segment: Literal["dram", "vram"] = "dram",
        device: int = 0,
        register: bool = True,
        owner: Any = None,
        read: Callable[[int, int], Any] | None = None,
        scrub: Callable[[list[int]], None] | None = None,
    ) -> EnginePool: ...
    @property
    def pages(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def segment(self) -> Literal["dram", "vram"]: ...
    def layout(self) -> bytes: ...

@final
class NixlLink:
    """One side's connection to its peer; the checked protocol of docs/transfer.md."""

    def __init__(
        self, agent: NixlAgent, peer_metadata: Any, peer_layout: Any, *, part_bytes: int | None = 2097152
    ) -> None: ...
    @property
    def peer(self) -> str: ...
    @property
    def malformed(self) -> int: ...
    @property
    def unasked(self) -> int:
        """Notices a selective link dropped on arrival: for requests it did not expect."""
    @property
    def evicted(self) -> int:
        """Notices dropped from a full inbox (oldest first) to make room: a transfer that lost one
        times out (a push's pages fenced), never accepted on a guess."""
    @property
    def inbox_bytes(self) -> int:
        """Bytes of notices kept for requests nobody waits for yet (at most 16 MiB)."""
    def expect(self, request: int) -> None:
        """Decode: request's transfer is coming; the first call makes the link selective."""
    def abandon(self, pinned: PinnedImport, direction: Literal["write", "read"]) -> None:
        """Decode: gives up on pinned without a receive (its request ended while its transfer was
        offered): a push's pages stay fenced until its late notice (settle_fences) or
        release_fences; a pull's are unpinned. Never abort() an offered push."""
    def forget(self, request: int) -> bool: ...
    @property
    def fenced(self) -> int:
        """Timed-out pushes whose pages stay pinned until the sender is known done."""
    def settle_fences(self, table: OwnershipTable, region: HostRegion | EnginePool) -> int: ...
    def release_fences(self, table: OwnershipTable, region: HostRegion | EnginePool) -> int: ...
    @property
    def in_flight(self) -> list[tuple[int, list[int]]]:
        """Prefill: (request, source pages) that WRITEs of failed pushes, or decode's READs of
        failed stagings, may still read, each page once: not to be reused, pushed or staged
        until settle_pushes or settle_stages hands them back."""
    @property
    def held_pages(self) -> int:
        """Prefill: how many distinct pages in_flight lists."""
    @property
    def held_by_failed_writes(self) -> int:
        """Prefill: distinct pages held by WRITEs NIXL reported failed (or posted part-way):
        only release_pushes hands them back; with a live peer, held for the link's life."""
    def settle_pushes(self) -> list[tuple[int, list[int]]]:
        """Prefill: (request, source pages) of failed pushes whose WRITEs NIXL now reports
        complete: free to reuse, each page once, when no held WRITE or staging reads it any more.
        A WRITE NIXL reports failed stays held until release_pushes."""
    def release_pushes(self) -> list[tuple[int, list[int]]]:
        """Prefill: every held push's (request, source pages), whatever NIXL says: the engine knows
        none of their WRITEs can still run (the peer is gone and its transfers failed)."""
    def settle_stages(self) -> list[tuple[int, list[int]]]:
        """Prefill: (request, staged pages) of failed stagings decode has now released (its
        Released naming their extents came): free to reuse. Moves UCX along: call it when idle."""
    def release_stages(self) -> list[tuple[int, list[int]]]:
        """Prefill: every held staging's (request, staged pages), whatever came: the engine knows
        decode will READ none of them (the peer is gone)."""
    def push(
        self,
        region: HostRegion | EnginePool,
        src: Sequence[tuple[int, int]],
        dest: Sequence[int | PageRef],
        request: int,
        manifest: Any,
        *,
        timeout: float = 20.0,
    ) -> None: ...
    def push_prompt(
        self,
        region: HostRegion | EnginePool,
        src: Sequence[tuple[int, int]],
        dest: Sequence[PageRef],
        request: int,
        tenant: int,
        sender: int,
        page_size: int,
        slot_bytes: int,
        prompt: Any,
        *,
        ahead: Sequence[tuple[int, int]] | None = None,
        timeout: float = 20.0,
    ) -> None: ...
    def stage(
        self,
        src: Sequence[tuple[int, int]],
        request: int,
        manifest: Any,
        *,
        timeout: float = 20.0,
        region: HostRegion | EnginePool | None = None,
    ) -> None:
        """Prefill, pull: returns once decode released the staged extents; NixlError otherwise,
        its in_flight the pages decode may still READ (held until settle_stages hands them back).
        With `region` (where the extents are), they are checked against it first, and the link
        keeps it alive while it holds pages of a failed stage."""
    def decline(self, request: int, *, timeout: float = 20.0) -> None: ...
    def receive(
        self,
        pinned: PinnedImport,
        region: HostRegion | EnginePool,
        *,
        direction: str = "write",
        timeout: float = 20.0,
        land: Callable[[int, PageRef, bytes], object] | None = None,
    ) -> Accepted: ...

def mark_pages(flags: npt.NDArray[np.uint8], slots: Sequence[int] | IntArray, page_size: int) -> None:
    """``flags[slot // page_size] = 1`` for each slot >= 0 whose page is below ``len(flags)``."""

def page_checksum(data: Any) -> int: ...
def prompt_digest(prompt: Sequence[int] | IntArray) -> int: ...

class Recorder:
    def __init__(self) -> None: ...
    def pool(self, config: PoolConfig) -> None: ...
    def admit(self, request: int, tenant: str, prompt: int, max_new: int) -> None: ...
    def alloc(self, request: int, pages: Sequence[int]) -> None: ...
    def write(self, request: int, page: int, start: int, end: int) -> None: ...
    def read(self, request: int, pages: Sequence[int], tokens: int) -> None: ...
    def free(self, request: int, pages: Sequence[int] | None = None) -> None: ...
    def share(self, request: int, key: str, pages: Sequence[int]) -> None: ...
    def attach(self, request: int, key: str) -> None: ...
    def evict(self, key: str) -> None: ...
    def import_kv(self, request: int, pages: Sequence[int], tokens: int, expect: int) -> None: ...
    def fork(self, request: int, child: int) -> None: ...
    def detach(self, request: int, key: str) -> None: ...
    def preempt(self, request: int) -> None: ...
    def scrub(self, pages: Sequence[int]) -> None: ...
    def grant(self, tenant: str, allow: bool) -> None: ...
    def end(self) -> None: ...
    def comment(self, text: str) -> None: ...
    @property
    def events(self) -> int: ...
    def text(self) -> str: ...

@final
class ReplayViolation:
    line: int
    event: str
    kind: str
    request: int | None
    page: int | None
    tenant: str | None
    owner: int | None
    owner_tenant: str | None
    prefix: str | None
    slots: tuple[int, int] | None
    def as_dict(self) -> dict[str, Any]: ...

class Replayer:
    def __init__(self) -> None: ...
    def feed_line(self, line: str | bytes) -> ReplayViolation | None: ...
    def replay(self, text: str | bytes) -> list[ReplayViolation]: ...
    def summary(self) -> dict[str, Any]: ...

def driver_available() -> bool: ...

@final
class DeviceGuard:
    def __init__(self, config: PoolConfig, *, device: int = 0, max_seqs: int = 1024, ring_capacity: int = 4096, cubin: bytes | None = None) -> None: ...
    def sync_tags(self, table: OwnershipTable, *, stream: int) -> int: ...
    def upload_all_tags(self, table: OwnershipTable, *, stream: int) -> None: ...
    def set_readers(self, table: OwnershipTable, req_ids: Sequence[Id], *, stream: int) -> None: ...
    def clear_status(self, *, stream: int) -> None: ...
    def verify_block_table(self, block_table: int, seq_lens: int, num_seqs: int, max_blocks: int, *, stream: int, check_canaries: bool = False, query_lens: int | None = None) -> None: ...
    def verify_paged_kv(self, kv_indptr: int, kv_indices: int, kv_last_page_len: int, num_seqs: int, num_indices: int, max_pages_per_seq: int, *, stream: int, check_canaries: bool = False, query_lens: int | None = None) -> None: ...
    def verify_token_rows(self, req_to_token: int, num_rows: int, row_stride: int, rows: int, seq_lens: int, num_seqs: int, max_pages_per_seq: int, *, stream: int) -> None:
        """SGLang's layout read in place: req_to_token int32 [num_rows, row_stride] (token slots), rows and
        seq_lens int64 [num_seqs] (device pointers); page j of sequence s is the page of
        req_to_token[rows[s], j * page_size], and every other entry read must be that page's slot at its
        offset (one that is not is checked as the page it names). No host sync."""
    def verify_slot_mapping(self, slot_mapping: int, num_tokens: int, query_start_loc: int, num_seqs: int, *, stream: int) -> None:
        """A step's KV writes checked on the device before they are stored: slot_mapping int64 [num_tokens]
        (negative: padding), query_start_loc int32 [num_seqs + 1] (device pointers); each written slot must
        lie in a page its sequence's reader owns exclusively. No host sync."""
    def fence_refused(self, query_start_loc: int, num_seqs: int, *, stream: int, block_table: int | None = None, max_blocks: int = 0, slot_mapping: int | None = None, num_tokens: int = 0) -> None:
        """After the step's checks, on the same stream: every flagged sequence's block-table row set to
        page 0 (the reserved null page) and its slots to -1, in place. One call per KV cache group."""
    def begin_drain(self, *, stream: int) -> None: ...
    def finish_drain(self, table: OwnershipTable, *, stream: int, wait: bool = True) -> list[Violation] | None:
        """The drain begin_drain started, recorded in the table; None if none was begun or (wait=False)
        its copy has not landed. wait waits only for the work queued before begin_drain."""
    def read_status(self, n: int, *, stream: int) -> list[int]: ...
    def drain(self, table: OwnershipTable, *, stream: int) -> list[Violation]: ...
    @property
    def findings_lost(self) -> int:
        """Findings that never reached the host since the guard was created, as of the last drain (first
        findings dropped on a ring whose half for them was full, torn or unknown records): 0 while every
        flagged sequence is named in a drained record; when it grows, fail closed for every request read
        since the drain before (kvguard.device_verdicts does)."""
    @property
    def status_ptr(self) -> int: ...
    @property
    def tags_ptr(self) -> int: ...
    @property
    def canaries_ptr(self) -> int: ...
