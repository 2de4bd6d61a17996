#!/usr/bin/env python3
"""An engine loop shaped like vLLM's, guarded by kvguard: one verify_step per scheduler step.

The engine keeps its own allocator (shadow mode: kvguard is told what it handed out with
`claim`), a numpy int32 block table [max_num_reqs, max_blocks] padded with the null block 0
(vLLM's `BlockTable.block_table.np`), and a flat int64 `slot_mapping` with `query_start_loc`
(vLLM's `InputBatch` / `CommonAttentionMetadata`). Each step records the step's KV writes in one
call and verifies every request's reads in one call; the verdict's refused_mask tells the engine
exactly which rows to abort, and the rest of the batch runs.

Two bugs are injected at step 3: request "cmpl-b" gets one of "cmpl-a"'s pages in its block
table (a foreign page), and request "cmpl-c" reads one token more than was written (an unwritten
slot). Both rows are refused; "cmpl-a" runs on.

    pip install ./bindings/python        (or: maturin develop -m bindings/python/Cargo.toml)
    python examples/python/vllm_engine_loop.py
"""

import logging

import numpy as np

import kvguard

PAGE_SIZE, NUM_PAGES, MAX_REQS, MAX_BLOCKS = 16, 1024, 8, 32

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
table = kvguard.OwnershipTable(kvguard.PoolConfig(NUM_PAGES, PAGE_SIZE, MAX_BLOCKS * PAGE_SIZE, reserved=[0]))
free_pages = list(range(NUM_PAGES - 1, 0, -1))  # the engine's own allocator (vLLM's BlockPool)
block_table = np.zeros((MAX_REQS, MAX_BLOCKS), dtype=np.int32)  # vLLM's BlockTable.block_table.np
requests = {"cmpl-a": ("acme", 40), "cmpl-b": ("globex", 20), "cmpl-c": ("acme", 33)}
req_ids, num_computed, pages_of = [], [], {}

for rid, (tenant, prompt) in requests.items():
    table.admit(rid, tenant, prompt, 64)
    req_ids.append(rid)
    num_computed.append(0)
    pages_of[rid] = []


def schedule(new_tokens):
    """Gives each request pages for its new tokens and builds the step's slot mapping."""
    slot_mapping, query_start_loc = [], [0]
    for row, rid in enumerate(req_ids):
        start, end = num_computed[row], num_computed[row] + new_tokens[row]
        need = -(-end // PAGE_SIZE) - len(pages_of[rid])
        if need > 0:
            got = [free_pages.pop() for _ in range(need)]
            table.claim(rid, got)  # shadow mode: kvguard checks the pages were free
            pages_of[rid] += got
            block_table[row, len(pages_of[rid]) - need : len(pages_of[rid])] = got
        for t in range(start, end):
            slot_mapping.append(pages_of[rid][t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
        query_start_loc.append(len(slot_mapping))
    # vLLM pads the slot mapping for CUDA graphs; padding is PADDING_SLOT (-1).
    slot_mapping += [kvguard.PADDING_SLOT] * 3
    return np.array(slot_mapping, dtype=np.int64), np.array(query_start_loc, dtype=np.int32)


for step in range(1, 5):
    prefill = step == 1
    new_tokens = [requests[rid][1] if prefill else 1 for rid in req_ids]
    slot_mapping, query_start_loc = schedule(new_tokens)
    # The KV store wrote these slots: record them in one call.
    writes = table.record_step_writes(req_ids, slot_mapping, query_start_loc)
    for row in range(len(req_ids)):
        num_computed[row] += new_tokens[row]
    seq_lens = np.array(num_computed, dtype=np.int32)
    if step == 3:
        block_table[1, 0] = block_table[0, 0]  # bug: cmpl-b's table names cmpl-a's first page
        seq_lens[2] += 1  # bug: cmpl-c reads a slot nobody wrote
    # Before attention: verify every row's reads in one call (zero copy, GIL released).
    verdict = table.verify_step(req_ids, block_table, seq_lens)
    print(f"step {step}: {len(req_ids)} rows, writes clean={writes.clean}, reads refused={verdict.refused_rows}")
    for row, v in verdict.refused:
        print(f"  abort row {row} ({req_ids[row]}): {v.kind}, page {v.page}, owner {v.owner}")
    keep = ~verdict.refused_mask
    for row in sorted(verdict.refused_rows, reverse=True):  # abort exactly the refused rows
        rid = req_ids.pop(row)
        num_computed.pop(row)
        table.release(rid)
        block_table[row:-1] = block_table[row + 1 :].copy()
        block_table[-1] = 0
    assert keep.sum() == len(req_ids)

print("counters:", table.counters())
print("snapshot:", table.snapshot())
