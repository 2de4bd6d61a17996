"""Intake through SGLang's own handle_generate_request (validate_input_length included): the
one-token stub of an over-long prompt refused at the length the client sent, a prompt SGLang
truncates (--allow-auto-truncate) judged at the length prefill runs, and report mode counting
an over-long request once."""

from __future__ import annotations

import pytest
from scheduler_rig import attach_kvguard, build_scheduler, generate_req, run

CONTEXT = 256


def scheduler(policy, **server_args):
    s = build_scheduler(page_size=16, tokens=2048, rows=8, context_len=CONTEXT, **server_args)
    return s, (attach_kvguard(s, policy) if policy else None)


def short(i):
    return generate_req(f"ok{i}", [100 + i] * 30, max_new=4)


def test_over_long_prompt_is_refused_at_intake_and_never_runs():
    """SGLang's validate_input_length turns the 400-token prompt into a one-token stub that would
    still be scheduled; kvguard judges the 400 tokens the client sent: answered at once with
    kvguard's 400, never queued, no row, no page; the others are served."""
    s, guard = scheduler("enforce")
    rows_before = len(s.req_to_token_pool.free_slots)
    s.handle_generate_request(generate_req("long", list(range(1, 401)), max_new=4))
    assert not s.waiting_queue and len(s.req_to_token_pool.free_slots) == rows_before
    v = guard.aborted["long"]
    assert v.kind == "exceeds_max_context" and v.op == "admit"
    out = run(s, [short(i) for i in range(3)])
    assert out["long"][1]["type"] == "abort" and "kvguard refused" in out["long"][1]["message"]
    assert out["long"][1]["status_code"] == 400
    assert all(out[f"ok{i}"][1]["type"] == "length" for i in range(3))
    assert set(guard.aborted) == {"long"}


def test_auto_truncated_prompt_is_judged_at_the_length_prefill_runs():
    """With --allow-auto-truncate SGLang cuts the 400-token prompt to its max input length and
    runs it: kvguard admits it at that length (not the client's), and it is served as it is
    without kvguard."""
    want = run(scheduler(None, allow_auto_truncate=True)[0], [generate_req("long", list(range(1, 401)), max_new=4)])
    s, guard = scheduler("enforce", allow_auto_truncate=True)
    out = run(s, [generate_req("long", list(range(1, 401)), max_new=4)])
    assert guard.violations == [] and guard.aborted == {}
    assert out == want and out["long"][1]["type"] == "length"


def test_report_mode_counts_an_over_long_request_once():
    s, guard = scheduler("report")
    out = run(s, [generate_req("long", list(range(1, 401)), max_new=4)] + [short(i) for i in range(2)])
    assert [v.kind for v in guard.violations] == ["exceeds_max_context"]
    assert guard.metrics["violations_total"] == 1
    assert guard.aborted == {}
    # Report changes nothing: SGLang itself aborts the stub, the others are served.
    assert out["long"][1]["type"] == "abort" and "kvguard" not in out["long"][1]["message"]
    assert all(out[f"ok{i}"][1]["type"] == "length" for i in range(2))


def test_a_beam_search_request_is_refused_at_intake():
    """SGLang's beam search gives each beam a row of its own and writes the beams' slots into
    them outside the calls kvguard follows: under enforce such a request is answered at once
    with kvguard's 400 (never queued, no row, no page); the others are served as without kvguard."""
    def at_page_size_1(policy):  # (SGLang's beam search needs page size 1)
        s = build_scheduler(page_size=1, tokens=2048, rows=8, context_len=CONTEXT)
        return s, (attach_kvguard(s, policy) if policy else None)

    s, guard = at_page_size_1("enforce")
    rows_before = len(s.req_to_token_pool.free_slots)
    beam = generate_req("beam", [7] * 30, max_new=4)
    beam.sampling_params.beam_width = 2
    s.handle_generate_request(beam)
    assert not s.waiting_queue and len(s.req_to_token_pool.free_slots) == rows_before
    out = run(s, [short(i) for i in range(3)])
    assert out["beam"][1]["type"] == "abort" and "beam search" in out["beam"][1]["message"]
    assert out["beam"][1]["status_code"] == 400
    plain, _ = at_page_size_1(None)
    assert {f"ok{i}": out[f"ok{i}"] for i in range(3)} == run(plain, [short(i) for i in range(3)])
    assert set(guard.aborted) == {"beam"} and guard.violations == []


@pytest.mark.parametrize("policy", ["enforce", "report"])
def test_speculative_decoding_is_refused_at_start_up(policy):
    """Speculative decoding writes its draft rows with its own kernels, outside the calls
    kvguard follows: under enforce the scheduler does not start (ConfigError, naming it); under
    report it starts unguarded, and says so."""
    import kvguard
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s = build_scheduler(page_size=16, tokens=2048, rows=8, context_len=CONTEXT)
    s.spec_algorithm = SpeculativeAlgorithm.from_string("EAGLE")
    if policy == "enforce":
        with pytest.raises(kvguard.ConfigError, match="speculative decoding"):
            attach_kvguard(s, policy)
    else:
        attach_kvguard(s, policy)
        assert getattr(s, "kvguard", None) is None


def test_a_request_of_input_embeddings_is_refused_at_intake():
    """SGLang keys a request of input embeddings by placeholder tokens (``[1] * n``), so its radix
    cache hands a later request of as many embeddings, whatever they are, the earlier one's KV
    (of the same tenant: every client without a cache salt). kvguard cannot tell them apart:
    under enforce such a request is answered at once with its 400, never queued; the others are
    served as without kvguard."""
    s = build_scheduler(page_size=1, tokens=640, rows=8, context_len=CONTEXT)
    guard = attach_kvguard(s, "enforce")
    rows_before = len(s.req_to_token_pool.free_slots)
    embeds = generate_req("embeds", [1] * 40, max_new=2, salt="acme")
    embeds.input_embeds = [[0.1 * i] * 8 for i in range(40)]
    s.handle_generate_request(embeds)
    assert not s.waiting_queue and len(s.req_to_token_pool.free_slots) == rows_before
    out = run(s, [short(i) for i in range(3)])
    assert out["embeds"][1]["type"] == "abort" and "input embeddings" in out["embeds"][1]["message"]
    assert out["embeds"][1]["status_code"] == 400
    plain = build_scheduler(page_size=1, tokens=640, rows=8, context_len=CONTEXT)
    assert {f"ok{i}": out[f"ok{i}"] for i in range(3)} == run(plain, [short(i) for i in range(3)])
    assert set(guard.aborted) == {"embeds"} and guard.violations == []


@pytest.mark.parametrize(
    "flag, named",
    [
        ("is_hybrid_swa", "sliding-window"),
        ("is_hybrid_ssm", "Mamba"),
        ("enable_hierarchical_cache", "HiCache"),
        ("enable_hicache_storage", "storage"),
        ("enable_lmcache", "LMCache"),
        ("enable_unified_memory", "unified memory"),
        ("dllm_config", "diffusion LLM"),
    ],
)
@pytest.mark.parametrize("policy", ["enforce", "report"])
def test_kv_memory_kvguard_cannot_follow_is_refused_at_start_up(policy, flag, named):
    """A KV pool whose pages move where kvguard does not see (SGLang's SWA allocator's segment
    frees, HiCache's load-back, LMCache's loads, unified memory's compaction) or a state pool it
    does not check (Mamba), or a scheduler that rewrites rows outside the calls kvguard follows
    (a diffusion LLM's), as the scheduler records it: under enforce the scheduler does not start
    (ConfigError naming it); under report it starts unguarded and says so."""
    import kvguard

    s = build_scheduler(page_size=16, tokens=2048, rows=8, context_len=CONTEXT)
    setattr(s, flag, True if flag != "dllm_config" else object())
    if policy == "enforce":
        with pytest.raises(kvguard.ConfigError, match=named):
            attach_kvguard(s, policy)
    else:
        attach_kvguard(s, policy)
        assert getattr(s, "kvguard", None) is None
