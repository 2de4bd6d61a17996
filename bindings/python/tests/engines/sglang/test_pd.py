"""PD disaggregation: the start-up audit of both pools, and the kvguard manifest at SGLang's
BaseKVSender / BaseKVReceiver (its fake backend's objects; the bytes are landed by the test, as
mooncake or nixl would land them)."""

from __future__ import annotations

import kvguard
import pytest
import torch
from kvguard.sglang import GuardedKVReceiver, GuardedKVSender, ManifestChannel, NamedViolation, audit_pd
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver, FakeKVSender
from sglang.srt.mem_cache.common import suffix_page_indices

PROMPT = list(range(1, 100))


def test_audit_refuses_a_side_that_cannot_hold_one_request(engine_factory):
    prefill = engine_factory(page_size=16, tokens=4096, policy=None)
    decode = engine_factory(page_size=16, tokens=512, policy=None)
    audit_pd(prefill.allocator, prefill.allocator, 1024)
    with pytest.raises(kvguard.ConfigError, match=r"decode KV pool holds 512 tokens.*1024 tokens"):
        audit_pd(prefill.allocator, decode.allocator, 1024)
    with pytest.raises(kvguard.ConfigError, match=r"prefill KV pool holds 512 tokens"):
        audit_pd(decode.allocator, prefill.allocator, 1024)


def transfer(prefill, decode, *, decode_prompt=PROMPT, corrupt=False, drop_manifest=False):
    """One request through prefill, the transfer, and the decode side's check."""
    channel = ManifestChannel()
    p_req = prefill.request("r", PROMPT)
    d_req = decode.request("r", decode_prompt)
    d_req.origin_input_ids_unpadded = d_req.origin_input_ids
    assert prefill.submit(p_req) and decode.submit(d_req)
    prefill.prefill([p_req])
    # Decode preallocates the request's pages (DecodePreallocQueue) without running it.
    rows = decode.req_to_token_pool.alloc([d_req])
    n = len(PROMPT)
    pages_needed = -(-n // decode.page_size)
    out = decode.allocator.alloc(pages_needed * decode.page_size)[:n]
    decode.req_to_token_pool.write((rows[0], slice(0, n)), out.to(torch.int32))
    d_pages = suffix_page_indices(decode.req_to_token_pool.req_to_token, rows[0], 0, n, decode.page_size)
    p_pages = suffix_page_indices(prefill.req_to_token_pool.req_to_token, p_req.kv.req_pool_idx, 0, n, prefill.page_size)
    receiver = GuardedKVReceiver(FakeKVReceiver(None, "fake", 7), decode.guard, d_req, channel)
    receiver.room = 7
    receiver.init(0)
    receiver.send_metadata(d_pages)
    sender = GuardedKVSender(FakeKVSender(None, "fake", 7), prefill.guard, p_req, channel)
    sender.init(len(p_pages))
    sender.send(p_pages)
    if drop_manifest:
        channel.rooms[7].pop("manifest")
    # The backend lands the bytes page for page.
    ps = prefill.page_size
    for src, dst in zip(p_pages.tolist(), d_pages.tolist()):
        for pb, db in ((prefill.kv_pool.k_buffer[0], decode.kv_pool.k_buffer[0]),
                       (prefill.kv_pool.v_buffer[0], decode.kv_pool.v_buffer[0])):
            db[dst * ps:(dst + 1) * ps] = pb[src * ps:(src + 1) * ps]
    if corrupt:
        decode.kv_pool.k_buffer[0][int(d_pages[1]) * ps] += 1.0
    return receiver, d_req, rows[0]


@pytest.fixture
def pd(engine_factory):
    return engine_factory(page_size=16, tokens=2048), engine_factory(page_size=16, tokens=2048)


def test_clean_transfer_is_accepted_and_readable(pd):
    prefill, decode = pd
    receiver, d_req, _ = transfer(prefill, decode)
    assert receiver.poll() == KVPoll.Success
    assert decode.guard.violations == [] and prefill.guard.violations == []
    decode.running.append(d_req)
    decode.decode([d_req])
    assert decode.guard.violations == []


@pytest.mark.parametrize(
    "case,kind",
    [
        ("stub", ("token_count_mismatch", "prompt_digest_mismatch")),
        ("corrupt", ("page_checksum_mismatch",)),
        ("missing", ("missing_manifest",)),
    ],
)
def test_refused_transfer_never_becomes_readable(pd, case, kind):
    prefill, decode = pd
    receiver, d_req, row = transfer(
        prefill, decode,
        decode_prompt=[0] if case == "stub" else PROMPT,
        corrupt=case == "corrupt", drop_manifest=case == "missing",
    )
    assert receiver.poll() == KVPoll.Failed
    refusal = decode.guard.aborted["r"]
    got = refusal.kind if isinstance(refusal, NamedViolation) else "missing_manifest"
    assert got in kind
    assert d_req.to_finish is not None and "kvguard" in d_req.to_finish.message
    # The pages were never covered: a read through the row is refused.
    table = decode.req_to_token_pool.req_to_token[row, : len(PROMPT)][::16] // 16
    verdict = decode.guard.table.check_step(["r"], table.reshape(1, -1).numpy().astype("int32"), [len(PROMPT)])
    assert not verdict.clean


# ---- the sender as SGLang's own send_kv_chunk calls it ------------------------------------------


class EventSender(FakeKVSender):
    """A backend that takes SGLang 0.5.23's ``indices_event=`` keyword (mooncake's does)."""

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
        self.events = getattr(self, "events", []) + [indices_event]
        return super().send(kv_indices, state_indices, num_kv_tokens)


def prefill_scheduler(prefill):
    """What SGLang's SchedulerDisaggregationPrefillMixin._send_kv_chunk reads of its scheduler."""
    from types import SimpleNamespace

    return SimpleNamespace(
        token_to_kv_pool_allocator=prefill.allocator, req_to_token_pool=prefill.req_to_token_pool,
        enable_staging=False, disagg_metadata_buffers=SimpleNamespace(set_buf=lambda req: None),
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=[]))),
        disagg_prefill_pending_chunk_rids=set(), sliding_window_size=None,
    )


def chunked_transfer(prefill, decode, *, ends, stub=False, inner=FakeKVSender, corrupt=False):
    """The prompt prefilled, then sent by SGLang's own _send_kv_chunk in chunks ending at
    ``ends`` (the last one last_chunk=True), landed on the decode side page for page."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    channel = ManifestChannel()
    p_req = prefill.request("r", PROMPT)
    d_req = decode.request("r", PROMPT)
    d_req.origin_input_ids_unpadded = d_req.origin_input_ids
    assert prefill.submit(p_req) and decode.submit(d_req)
    if stub:
        p_req.set_finish_with_abort("the prompt is too long")  # the one-token stub
        p_req.to_finish = None  # a path that runs it all the same
    prefill.prefill([p_req])
    rows = decode.req_to_token_pool.alloc([d_req])
    n = len(PROMPT)
    out = decode.allocator.alloc(-(-n // decode.page_size) * decode.page_size)[:n]
    decode.req_to_token_pool.write((rows[0], slice(0, n)), out.to(torch.int32))
    d_pages = suffix_page_indices(decode.req_to_token_pool.req_to_token, rows[0], 0, n, decode.page_size)
    receiver = GuardedKVReceiver(FakeKVReceiver(None, "fake", 7), decode.guard, d_req, channel)
    receiver.room = 7
    receiver.init(0)
    receiver.send_metadata(d_pages)
    sender = GuardedKVSender(inner(None, "fake", 7), prefill.guard, p_req, channel)
    p_req.disagg_kv_sender = sender
    p_req.start_send_idx = 0
    p_req.disagg_decode_prefix_len = 0
    sched = prefill_scheduler(prefill)
    for i, end in enumerate(ends):
        SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, p_req, last_chunk=i == len(ends) - 1, end_idx=end)
    ps = prefill.page_size
    p_pages = suffix_page_indices(prefill.req_to_token_pool.req_to_token, p_req.kv.req_pool_idx, 0, n, ps)
    for src, dst in zip(p_pages.tolist(), d_pages.tolist()):
        for pb, db in ((prefill.kv_pool.k_buffer[0], decode.kv_pool.k_buffer[0]),
                       (prefill.kv_pool.v_buffer[0], decode.kv_pool.v_buffer[0])):
            db[dst * ps:(dst + 1) * ps] = pb[src * ps:(src + 1) * ps]
    if corrupt:
        decode.kv_pool.k_buffer[0][int(d_pages[1]) * ps] += 1.0
    return sender, receiver, d_req


def test_a_prompt_sent_in_chunks_is_accepted(pd):
    """Chunked prefill: SGLang's send_kv_chunk sends the prompt's pages in three sends (two
    page-aligned chunks and the last); the manifest covers every page, the transfer is accepted."""
    prefill, decode = pd
    sender, receiver, d_req = chunked_transfer(prefill, decode, ends=[32, 64, len(PROMPT)])
    assert sender.failure is None
    assert receiver.poll() == KVPoll.Success
    assert decode.guard.violations == [] and prefill.guard.violations == []
    decode.running.append(d_req)
    decode.decode([d_req])
    assert decode.guard.violations == []


class IndicesEvent:
    """``torch.cuda.Event``'s stand-in: SGLang records it after the asynchronous copy that fills
    the host page indices it sends (prefill.py, the mooncake path)."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_the_indices_event_keyword_reaches_the_backend(pd):
    """SGLang 0.5.23 passes ``indices_event=`` to a backend that reads host page indices: the
    sender waits on it before it reads the indices (the copy that fills them may still run),
    and hands it on."""
    prefill, decode = pd
    sender, receiver, _ = chunked_transfer(prefill, decode, ends=[len(PROMPT)], inner=EventSender)
    event = IndicesEvent()
    sender.send(torch.tensor([], dtype=torch.int64), None, num_kv_tokens=0, indices_event=event)
    assert sender.inner.events[-1] is event
    assert event.waited == 1
    assert receiver.poll() == KVPoll.Success


def test_a_one_token_stub_sent_from_prefill_never_raises_and_is_refused(pd):
    """The prefill side runs SGLang's one-token stub and sends it: the sender does not raise into
    SGLang's loop; the decode side, which holds the real prompt, refuses the transfer."""
    prefill, decode = pd
    sender, receiver, d_req = chunked_transfer(prefill, decode, ends=[1], stub=True)
    assert receiver.poll() == KVPoll.Failed
    assert "r" in decode.guard.aborted


def test_report_mode_never_fails_a_transfer(engine_factory):
    prefill = engine_factory(page_size=16, tokens=2048, policy="report")
    decode = engine_factory(page_size=16, tokens=2048, policy="report")
    sender, receiver, _ = chunked_transfer(prefill, decode, ends=[32, len(PROMPT)], corrupt=True)
    assert receiver.poll() == KVPoll.Success
    assert [v.kind for v in decode.guard.violations] == ["page_checksum_mismatch"]
    assert decode.guard.aborted == {} and decode.guard.metrics["transfers_refused"] == 1
