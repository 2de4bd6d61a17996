"""A stand-in for ``kvguard.DeviceGuard`` over host memory, so that the plugin's GPU path for
vLLM's V2 runner (``kvguard.vllm.device``) runs on vLLM's CPU platform.

The plugin hands ``DeviceGuard`` raw pointers (``tensor.data_ptr()``) and a stream; here the
pointers are V2's host tensors, read and fenced in place through ctypes. Each method does what its
kernel does, by the rules the kernels implement (``kernels/kvguard.cu``: ``kvg_check_store`` for
writes, ``kvg_check_tag`` for reads, ``kvg_fence_refused``), judged on the tags as the last
``sync_tags`` left them (a snapshot of the table's page states, as the device's tag mirror), so
a sync at the wrong moment shows up as a wrong verdict. That the kernels themselves give the host
table's verdicts is shown elsewhere: on the simulated grid (``tests/it/cuda_host_verify.rs``)
and on a GPU (``scripts/gpu-check``). What this stand-in lets the tests show is the wiring: which
tensors are checked, against which table state, what is fenced, and how the verdicts reach vLLM's
output.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np


def _view(ptr: int, n: int, ctype: Any) -> np.ndarray:
    """``n`` elements at host address ``ptr``, writable in place."""
    if n == 0:
        return np.zeros(0, dtype=np.dtype(ctype))
    return np.ctypeslib.as_array((ctype * n).from_address(ptr))


@dataclass
class Record:
    """One device violation as the plugin reads it (``kvguard.Violation``'s fields it uses)."""

    kind: str
    op: str
    request: str | None
    page: int

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) by {self.request} of page {self.page} [device]"


class HostDevice:
    """``kvguard.DeviceGuard``'s interface, run on host memory (see the module's documentation)."""

    def __init__(self, table: Any, block_size: int, max_seqs: int) -> None:
        self.table = table
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.num_pages = table.config.num_pages
        self.tags: list[Any] = [None] * self.num_pages
        self.readers: list[tuple[str, Any]] = []
        self.status = np.zeros(max_seqs, dtype=np.uint32)
        self.ring: list[Record] = []
        self.copy: list[Record] | None = None
        #: ``DeviceGuard.findings_lost``: this stand-in's ring never loses a finding.
        self.findings_lost = 0
        #: Every record drained so far.
        self.drained: list[Record] = []
        self.calls: list[str] = []
        self.syncs = 0

    # -- tags and readers ---------------------------------------------------------------------

    def upload_all_tags(self, table: Any, *, stream: int) -> None:
        self.sync_tags(table, stream=stream)

    def sync_tags(self, table: Any, *, stream: int) -> int:
        self.calls.append("sync_tags")
        self.syncs += 1
        self.tags = [table.page_info(p) for p in range(self.num_pages)]
        return self.num_pages

    def set_readers(self, table: Any, req_ids: list[str], *, stream: int) -> None:
        self.calls.append("set_readers")
        assert len(req_ids) <= self.max_seqs
        self.readers = []
        for rid in req_ids:
            info = table.request_info(rid)
            self.readers.append((rid, None if info is None else info.tenant))

    def clear_status(self, *, stream: int) -> None:
        self.calls.append("clear_status")
        self.status[:] = 0

    def _flag(self, s: int | None, kind: str, op: str, page: int) -> None:
        rid = None
        if s is not None:
            self.status[s] = 1
            rid = self.readers[s][0]
        self.ring.append(Record(kind, op, rid, page))

    # -- the checks ---------------------------------------------------------------------------

    def verify_slot_mapping(self, slot_mapping: int, num_tokens: int, query_start_loc: int, num_seqs: int, *, stream: int) -> None:
        self.calls.append("verify_slot_mapping")
        assert num_seqs <= len(self.readers), "readers named for every sequence checked"
        slots = _view(slot_mapping, num_tokens, ctypes.c_int64)
        qsl = _view(query_start_loc, num_seqs + 1, ctypes.c_int32)
        for s in range(num_seqs):
            if qsl[s] < 0 or qsl[s + 1] < qsl[s] or qsl[s + 1] > num_tokens:
                self._flag(s, "slot_out_of_range", "write", -1)
        for t in range(num_tokens):
            slot = int(slots[t])
            if slot < 0:
                continue
            s = next((s for s in range(num_seqs) if qsl[s] <= t < qsl[s + 1]), None)
            page = slot // self.block_size
            if s is None:
                self._flag(None, "slot_out_of_range", "write", page)
                continue
            info = self.tags[page] if page < self.num_pages else None
            kind = None
            if info is None:
                kind = "page_out_of_range"
            elif info.state == "owned":
                kind = None if info.owner == self.readers[s][0] else "foreign_page"
            elif info.state == "shared":
                kind = "write_to_shared"
            elif info.state == "reserved":
                kind = "reserved_page"
            else:
                kind = "freed_page"
            if kind is not None:
                self._flag(s, kind, "write", page)

    def verify_block_table(self, block_table: int, seq_lens: int, num_seqs: int, max_blocks: int, *, stream: int, **kw: Any) -> None:
        self.calls.append("verify_block_table")
        assert num_seqs <= len(self.readers)
        table = _view(block_table, num_seqs * max_blocks, ctypes.c_int32).reshape(num_seqs, max_blocks)
        lens = _view(seq_lens, num_seqs, ctypes.c_int32)
        bs = self.block_size
        for s in range(num_seqs):
            rid, tenant = self.readers[s]
            n = int(lens[s])
            if n < 0 or n > max_blocks * bs:
                self._flag(s, "block_table_too_short", "read", -1)
                continue
            for j in range(-(-n // bs)):
                page = int(table[s, j])
                need = min(bs, n - j * bs)
                info = self.tags[page] if 0 <= page < self.num_pages else None
                if info is None:
                    kind = "page_out_of_range"
                elif info.state == "owned":
                    kind = None if info.owner == rid else "foreign_page"
                elif info.state == "shared":
                    kind = None if info.tenant == tenant else "foreign_page"
                elif info.state == "reserved":
                    kind = "reserved_page"
                else:
                    kind = "freed_page"
                if kind is None and info.written_prefix < need:
                    kind = "unwritten_slots"
                if kind is not None:
                    self._flag(s, kind, "read", page)

    def fence_refused(
        self,
        query_start_loc: int,
        num_seqs: int,
        *,
        stream: int,
        block_table: int | None = None,
        max_blocks: int = 0,
        slot_mapping: int | None = None,
        num_tokens: int = 0,
    ) -> None:
        self.calls.append("fence_refused")
        qsl = _view(query_start_loc, num_seqs + 1, ctypes.c_int32)
        if block_table is not None:
            table = _view(block_table, num_seqs * max_blocks, ctypes.c_int32).reshape(num_seqs, max_blocks)
            for s in range(num_seqs):
                if self.status[s]:
                    table[s, :] = 0
        if slot_mapping is not None:
            slots = _view(slot_mapping, num_tokens, ctypes.c_int64)
            for t in range(num_tokens):
                if slots[t] < 0:
                    continue
                s = next((s for s in range(num_seqs) if qsl[s] <= t < qsl[s + 1]), None)
                if s is None or self.status[s]:
                    slots[t] = -1

    # -- the ring -----------------------------------------------------------------------------

    def begin_drain(self, *, stream: int) -> None:
        self.calls.append("begin_drain")
        if self.copy is None:
            self.copy = list(self.ring)

    def finish_drain(self, table: Any, *, stream: int, wait: bool = True) -> list[Record] | None:
        # The host runs each call at once: a copy has always landed, waited for or not.
        self.calls.append("finish_drain")
        if self.copy is None:
            return None
        out, self.copy = self.copy, None
        del self.ring[: len(out)]
        self.drained.extend(out)
        return out
