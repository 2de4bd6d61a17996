"""The check of a request's whole row before its output leaves, on SGLang's own Scheduler
(scheduler_rig.py): made for exactly the requests SGLang sends, where it decides to send them
(its output accumulator), not for every request of every decode step. A non-streamed request's
output leaves when it finishes and every ``SGLANG_FORCE_STREAM_INTERVAL`` (50) tokens before."""

from __future__ import annotations

import pytest
from scheduler_rig import attach_kvguard, build_scheduler, finished, generate_req, run, step

PROMPTS = {f"r{i}": [1000 * (i + 1) + j for j in range(40)] for i in range(4)}
FORCE = 50
"""SGLang 0.5.23's SGLANG_FORCE_STREAM_INTERVAL default: a non-streamed request's output leaves
every 50 tokens."""


def reqs(max_new):
    return [generate_req(rid, p, max_new=max_new, salt="acme") for rid, p in PROMPTS.items()]


def scheduler(page_size, guarded=True):
    s = build_scheduler(
        page_size=page_size, tokens=1024 if page_size == 16 else 512, rows=8, context_len=256,
        disable_overlap_schedule=True,
    )
    return s, (attach_kvguard(s, "enforce") if guarded else None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_rows_are_checked_for_exactly_the_outputs_sglang_sends(page_size):
    """Step by step: the rows checked before output are those of the requests whose output SGLang
    sends that step (a finished request's at its release, a running one's at its forced send
    every 50 tokens), and a decode step that sends nothing checks no row."""
    s, guard = scheduler(page_size)
    checked: list[str] = []
    inner = guard.check_rows_before_output

    def spy(reqs_):
        checked.extend(r.rid for r in reqs_ if r.kv.req_pool_idx is not None)
        return inner(reqs_)

    guard.check_rows_before_output = spy
    for r in reqs(max_new=70):
        s.handle_generate_request(r)
    steps = quiet = 0
    while len(finished(s)) < len(PROMPTS):
        checked.clear()
        sent = len(s.outputs.sent)
        step(s)
        steps += 1
        out = [rid for payload in s.outputs.sent[sent:] for rid in payload.rids]
        assert sorted(set(checked)) == sorted(set(out)), (steps, checked, out)
        quiet += not out
        assert steps < 200
    assert quiet > 50  # most decode steps send nothing and check nothing
    assert guard.violations == []
    done = finished(s)
    assert sorted(done) == sorted(PROMPTS) and all(len(ids) == 70 for ids, _ in done.values())


@pytest.mark.parametrize("page_size", [1, 16])
def test_entry_changed_below_the_window_is_caught_at_the_forced_send(page_size):
    """r1's row is changed behind SGLang's calls below its decode window (an entry naming r0's
    KV) and no periodic full check comes (full_check_every out of reach): its first output that
    leaves, the forced send at 50 tokens, is checked first, so nothing it read from r0's KV ever
    leaves; it ends with kvguard's abort; the others are served as without kvguard."""
    s, guard = scheduler(page_size)
    guard.full_check_every = 10**9
    for r in reqs(max_new=70):
        s.handle_generate_request(r)
    step(s)
    step(s)  # a decode step: rows found clean, windows from here
    live = {r.rid: r for r in s.running_batch.reqs}
    r0, r1 = live["r0"], live["r1"]
    rt = s.req_to_token_pool.req_to_token
    rt[r1.kv.req_pool_idx, 2] = rt[r0.kv.req_pool_idx, 2]  # the bug
    sent_before = len(s.outputs.sent)
    for _ in range(FORCE - 3):
        step(s)
        assert guard.violations == []  # nothing of r1 has left yet: nothing checked its row
    for _ in range(200):
        if not s.running_batch.reqs and not s.waiting_queue:
            break
        step(s)
    assert set(guard.aborted) == {"r1"}
    v = guard.aborted["r1"]
    assert v.kind == "foreign_page" and v.request == "r1"
    for payload in s.outputs.sent[sent_before:]:
        for i, rid in enumerate(payload.rids):
            if rid == "r1":
                assert payload.finished_reasons[i] is not None and payload.finished_reasons[i]["type"] == "abort"
    out = finished(s)
    assert out["r1"][1]["type"] == "abort"
    s2, _ = scheduler(page_size, guarded=False)
    want = run(s2, reqs(max_new=70))
    for rid in ("r0", "r2", "r3"):
        assert out[rid] == want[rid]
