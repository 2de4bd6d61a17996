"""vLLM's Model Runner V2 on a GPU: the check of what V2 hands attention, on the device.

V2 builds each step's block tables (``BlockTables.gather_block_tables``) and slot mappings
(``compute_slot_mappings``) with its own kernels on the device; the host cannot read them without
a synchronisation inside vLLM's step. So the check has two halves:

- **host**: the ownership table records the step as V2 was asked to run it. :class:`HostRows`
  keeps a host copy of every row V2 stages (``BlockTables.append_block_ids``, wrapped by the
  plugin); the step's rows are gathered from it as V2 gathers its own, its slot mapping computed
  from them as V2 computes its own, and :meth:`StepGuard.check_attn_step` judges that step
  exactly as on vLLM's CPU platform (early events, writes, late events, reads);
- **device**: ``kvguard.DeviceGuard`` checks what V2 actually built, in place, on vLLM's stream,
  with no host synchronisation: V2's slot mapping against the tags as the table held them after
  the step's allocations (``verify_slot_mapping``), V2's gathered tables against the tags after
  its publishes (``verify_block_table``), then, under enforce, ``fence_refused`` sets every
  flagged sequence's rows to the null block and its slots to -1 before the forward runs.

The device's verdicts reach the host through its violation ring, whose copy is queued on the same
stream right after the fence (``begin_drain``): it has landed by the time the step's sampled
tokens have, so the step's output carries the refusals (:meth:`V2Device.drain_through`) and a
fenced request's tokens never leave.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..device_verdicts import DeviceVerdicts
from .guard import StepGuard


class HostRows:
    """A host copy of V2's persistent block tables (``BlockTables.block_tables``, one per KV cache
    group, ``[max_num_reqs, width]``), kept from the writes V2 stages: what V2 was asked to hold,
    whatever its device buffers hold."""

    def __init__(self, block_tables: Any) -> None:
        # Once, at the guard's creation (the first checked step): the rows V2 holds then, copied
        # from the device (a synchronisation, once). Every later write is mirrored as staged.
        self.rows = [np.array(b.gpu.cpu().numpy(), dtype=np.int32, copy=True) for b in block_tables.block_tables]
        self.counts = np.array(block_tables.num_blocks.np, dtype=np.int64, copy=True)

    def append(self, req_index: int, new_block_ids: Any, overwrite: bool) -> None:
        """What ``BlockTables.append_block_ids(req_index, new_block_ids, overwrite)`` staged."""
        for g, ids in enumerate(new_block_ids):
            row = self.rows[g][req_index]
            start = 0 if overwrite else int(self.counts[g, req_index])
            end = start + len(ids)
            # V2 raises for a row past its capacity before staging anything: never reached here.
            row[start : min(end, row.shape[0])] = ids[: max(0, row.shape[0] - start)]
            self.counts[g, req_index] = end

    def gather(self, idx_mapping: np.ndarray) -> list[np.ndarray]:
        """The step's rows, one table per group, row ``i`` for the request V2 keeps at
        ``idx_mapping[i]`` (as ``gather_block_tables`` gathers them)."""
        return [np.ascontiguousarray(r[idx_mapping]) for r in self.rows]


def host_slot_mappings(
    tables: list[np.ndarray], query_start_loc: np.ndarray, num_computed: np.ndarray, n: int, block_size: int
) -> np.ndarray:
    """The step's slot mapping, ``[groups, tokens]`` int64, computed from ``tables`` as V2's
    ``compute_slot_mappings`` computes its own: token ``t`` of request ``i`` (``query_start_loc[i]
    <= t < query_start_loc[i + 1]``) at position ``num_computed[i] + t - query_start_loc[i]``
    writes slot ``row[position // block_size] * block_size + position % block_size``."""
    qsl = np.asarray(query_start_loc[: n + 1], dtype=np.int64)
    tokens = int(qsl[n]) if n else 0
    out = np.full((len(tables), tokens), -1, dtype=np.int64)
    if tokens == 0:
        return out
    req = np.repeat(np.arange(n), np.diff(qsl))
    pos = np.asarray(num_computed[:n], dtype=np.int64)[req] + (np.arange(tokens) - qsl[req])
    for g, table in enumerate(tables):
        block = np.minimum(pos // block_size, table.shape[1] - 1)
        out[g] = table[req, block].astype(np.int64) * block_size + pos % block_size
    return out


def window_rows(
    table: Any, seq_lens: Any, query_start_loc: Any, n: int, window: int, block_size: int
) -> tuple[Any, Any]:
    """A sliding-window group's gathered rows as attention of the step reads them, built on the
    rows' device by tensor ops queued on the current stream (no host synchronisation): row ``i``
    from the block holding token ``first = max(seq_lens[i] - query_len[i] - (window - 1), 0)``
    on (the window of the request's first scheduled token; the entries before it V2's gather
    nulled, and vLLM's sliding window may have freed), zero-padded, with ``seq_lens`` shortened
    by as many tokens. The device's read check (which reads a row from its first entry) judges
    them as the host's ``check_step_window`` judges the staged rows."""
    import torch

    lens = seq_lens[:n].to(torch.int64)
    qsl = query_start_loc[: n + 1].to(torch.int64)
    first = torch.clamp(lens - (qsl[1:] - qsl[:-1]) - (window - 1), min=0)
    page = first // block_size
    width = int(table.shape[1])
    cols = torch.arange(width, device=table.device, dtype=torch.int64).unsqueeze(0) + page.unsqueeze(1)
    inside = cols < width
    rows = torch.where(inside, table[:n].gather(1, cols.clamp(max=width - 1)), torch.zeros_like(cols))
    return rows.to(torch.int32).contiguous(), (lens - page * block_size).to(torch.int32).contiguous()


class V2Device:
    """The device half of one V2 runner's check (see the module's documentation)."""

    def __init__(self, device_guard: Any, rows: HostRows, stream: Callable[[], int]) -> None:
        self.device_guard = device_guard
        self.rows = rows
        self._stream = stream
        #: The stream of the last checked step.
        self.last_stream = 0
        #: The device's verdicts, copied behind each step's checks, taken with its output (the
        #: checking thread queues a copy, the one reading an output, in some of vLLM's
        #: executors another, finishes it).
        self.verdicts = DeviceVerdicts(device_guard)
        # The requests this step's device checks read (``set_readers``), refused if a finding
        # of theirs is lost (``DeviceVerdicts.take_unresolved``).
        self._readers: list[str] = []

    @property
    def steps(self) -> int:
        """Steps whose device checks were queued."""
        return self.verdicts.checked

    def stream(self) -> int:
        self.last_stream = self._stream()
        return self.last_stream

    def check_writes(self, guard: StepGuard, req_ids: list[str], slot_mappings: Any, query_start_loc: Any, n: int) -> None:
        """After the step's early events were applied to the table: the tags as they now are,
        the step's readers, then V2's own slot mapping of every group checked on the device."""
        dg, s = self.device_guard, self.last_stream
        dg.sync_tags(guard.table, stream=s)
        dg.set_readers(guard.table, req_ids, stream=s)
        self._readers = req_ids
        dg.clear_status(stream=s)
        tokens = int(slot_mappings.shape[1])
        for g in range(int(slot_mappings.shape[0])):
            dg.verify_slot_mapping(slot_mappings[g].data_ptr(), tokens, query_start_loc.data_ptr(), n, stream=s)

    def check_reads(
        self,
        guard: StepGuard,
        block_tables: Any,
        seq_lens: Any,
        query_start_loc: Any,
        slot_mappings: Any,
        n: int,
        host_refused: list[int],
    ) -> None:
        """After the whole host step (writes recorded, publishes applied): the tags as they now
        are, V2's gathered tables checked on the device; under enforce every flagged sequence
        fenced in place, and the rows the host check refused too."""
        dg, s = self.device_guard, self.last_stream
        dg.sync_tags(guard.table, stream=s)
        tokens = int(slot_mappings.shape[1])
        windows = guard.windows or [None] * len(block_tables)
        for t, window in zip(block_tables, windows):
            if window is None:
                dg.verify_block_table(t.data_ptr(), seq_lens.data_ptr(), n, int(t.shape[1]), stream=s)
                continue
            rows, lens = window_rows(t, seq_lens, query_start_loc, n, window, guard.block_size)
            dg.verify_block_table(rows.data_ptr(), lens.data_ptr(), n, int(rows.shape[1]), stream=s)
            # The caching allocator reuses their memory only for work queued on this stream after
            # the check: no synchronisation needed to let them go.
            del rows, lens
        if guard.mode != "enforce":
            return
        for g, t in enumerate(block_tables):
            dg.fence_refused(
                query_start_loc.data_ptr(),
                n,
                stream=s,
                block_table=t.data_ptr(),
                max_blocks=int(t.shape[1]),
                slot_mapping=slot_mappings[g].data_ptr(),
                num_tokens=tokens,
            )
        if host_refused:
            # Refused by the host's judgement of the same step (an event, or a row as staged):
            # their device rows and slots too, on the same stream (no synchronisation).
            qsl = query_start_loc.cpu().tolist() if hasattr(query_start_loc, "cpu") else list(query_start_loc)
            for row in host_refused:
                for t in block_tables:
                    t[row].fill_(0)
                slot_mappings[:, qsl[row] : qsl[row + 1]] = -1

    def begin_drain(self, guard: StepGuard) -> None:
        """Queues the ring's copy after this step's checks (:meth:`DeviceVerdicts.queued`: a
        copy in flight finished first if it has landed; if not, this step's records ride a later
        copy)."""
        readers, self._readers = self._readers, []
        self.verdicts.queued(guard.table, stream=self.last_stream, readers=readers)

    def drain_through(self, guard: StepGuard, step: int) -> tuple[list[Any], list[str]]:
        """The device's violations of every step up to ``step`` (a step's output carries them)
        not handed out yet: the copy in flight finished (waiting only for the checks queued
        before it), and another taken if it predates ``step``; and the requests read in steps
        whose findings the device lost (each refused: the host cannot tell which one it was)."""
        records = self.verdicts.through(guard.table, step)
        return records, self.verdicts.take_unresolved()
