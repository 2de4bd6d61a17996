"""PD disaggregation through SGLang's own prefill and decode schedulers (pd_rig.py): their
bootstrap, prealloc, transfer and inflight queues and their own event loops (normal or overlap,
``event_loop_*_disagg_prefill`` / ``_decode``), SGLang's fake transfer backend with a CPU wire
that copies the pages sent (the model and the wire are the only stand-ins). kvguard is attached as
its plugin attaches it (``_scheduler_started``), which wraps the KV senders and receivers SGLang
creates on its own."""

from __future__ import annotations

import functools
import random

import pd_rig
import pytest
from kvguard.sglang import GuardedKVReceiver, GuardedKVSender
from scheduler_rig import attach_kvguard, pool_pages
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

CONTEXT = 256


@pytest.fixture(autouse=True)
def process_channel(monkeypatch):
    """Both schedulers run in this process: the manifests travel on the process channel."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", "process")


def workload(seed: int, n: int, tenants=("acme", "zeta", "kilo")):
    """(prefill request, decode request) pairs as a router sends them: the same rid, prompt and
    bootstrap room to both sides; shared system prompts per tenant (prefill's radix cache hits)."""
    rng = random.Random(seed)
    systems = {t: [rng.randrange(2, 30000) for _ in range(rng.randrange(20, 70))] for t in tenants}
    pairs = []
    for i in range(n):
        t = rng.choice(tenants)
        prompt = systems[t] + [rng.randrange(2, 30000) for _ in range(rng.randrange(1, 40))]
        new = rng.randrange(2, 10)
        pairs.append((pd_rig.pd_req(f"{t}-{i}", prompt, room=1000 + i, max_new=new, salt=t),
                      pd_rig.pd_req(f"{t}-{i}", prompt, room=1000 + i, max_new=new, salt=t)))
    return pairs


def sides(
    page_size: int, *, prefill_tokens: int = 2560, prefill_context: int = CONTEXT, decode_tokens: int = 2560,
    guard: str | None = None, overlap: bool = False, decode_radix: bool = False,
):
    """A prefill and a decode scheduler (chunked prefill on, the prefill side's radix cache on),
    kvguard attached to both as its plugin attaches it when ``guard`` is a policy; ``overlap``:
    SGLang's overlap schedule on both sides (``event_loop_overlap_disagg_prefill`` / ``_decode``);
    ``decode_radix``: the decode side's radix cache on (``--disaggregation-decode-enable-radix-cache``)."""
    pd_rig.install_wire()
    prefill = pd_rig.build_prefill(
        page_size=page_size, tokens=prefill_tokens, rows=24, context_len=prefill_context, chunked_prefill_size=48,
        disable_overlap_schedule=not overlap,
    )
    decode = pd_rig.build_decode(
        page_size=page_size, tokens=decode_tokens, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32,
        disable_overlap_schedule=not overlap, radix_cache=decode_radix,
    )
    assert prefill.enable_overlap == decode.enable_overlap == overlap
    if guard is not None:
        attach_kvguard(prefill, guard)
        attach_kvguard(decode, guard)
    return prefill, decode


@functools.lru_cache(maxsize=None)
def unguarded(page_size: int, n: int):
    """The reference: the same workload without kvguard (decode's outputs, pages at start and end)."""
    prefill, decode = sides(page_size)
    start = pool_pages(prefill), pool_pages(decode)
    out = pd_rig.run_pd(prefill, decode, workload(7, n))
    return out, start, (pool_pages(prefill), pool_pages(decode))


LOOPS = pytest.mark.parametrize(
    "loops", [{}, {"overlap": True}, {"overlap": True, "decode_radix": True}], ids=["normal", "overlap", "overlap-decode-radix"],
)
"""SGLang's normal PD event loops; its overlap ones; the overlap ones with the decode side's radix
cache on (``--disaggregation-decode-enable-radix-cache``)."""


def decode_prefix_hits() -> int:
    """Transfers the decode side offered after a prefix its radix cache held."""
    return sum(1 for room in pd_rig.Wire.rooms.values() if room["prefix"] > 0)


@pytest.mark.parametrize("page_size", [16, 1])
@LOOPS
def test_a_clean_pd_workload_is_served_as_without_kvguard(page_size, loops):
    """300 multi-tenant requests (about 21,000 tokens through pools of 2,560: every page reused
    several times), chunked prefill (48 tokens), the prefill side's radix cache on,
    under enforce, through SGLang's normal or overlap PD event loops (and with the decode side's
    radix cache on): every transfer accepted, every request served with the unguarded run's
    output (the normal loops' without the decode side's radix cache: neither changes an output),
    no violation on either side, both pools whole at the end."""
    n = 300
    ref, ref_start, ref_end = unguarded(page_size, n)
    prefill, decode = sides(page_size, guard="enforce", **loops)
    seen = pd_rig.count_overlap(prefill), pd_rig.count_overlap(decode)
    start = pool_pages(prefill), pool_pages(decode)
    assert start == (2560 // page_size, 2560 // page_size)
    out = pd_rig.run_pd(prefill, decode, workload(7, n))
    assert len(out) == n and all(reason["type"] == "length" for _, reason in out.values())
    assert out == ref
    assert prefill.kvguard.violations == [] and decode.kvguard.violations == []
    assert decode.kvguard.metrics["transfers_accepted"] == n and decode.kvguard.metrics["transfers_refused"] == 0
    assert start == ref_start and pool_pages(prefill) == start[0] and pool_pages(decode) == start[1], (start, ref_end)
    # Each side's batch results processed one iteration late (overlap) or never (normal).
    assert all((s.overlapped > 0) == bool(loops.get("overlap")) for s in seen), [vars(s) for s in seen]
    # Both radix caches were used: the prefill side's always, the decode side's when on.
    assert prefill.tree_cache.evictable_size() > 0
    assert (decode_prefix_hits() > n // 2) == bool(loops.get("decode_radix")), decode_prefix_hits()


# ---- the incident: the prefill side runs a one-token stub of a prompt its pool cannot hold ----------

VICTIM = "victim"
VICTIM_ROOM = 7


def incident(
    *, stub: bool, guard: str | None = None, page_size: int = 16, overlap: bool = False, decode_radix: bool = False,
):
    """Bystanders of three tenants, then a long prompt (200 tokens) that the decode side accepts
    (the model's 256-token context; its pool holds 640 tokens, so its pages are used over and
    over) but the prefill side cannot: it was started with a pool of 160 tokens and a context to
    match (kvguard's start-up audit refuses a pool smaller than its own side's context, so the
    two sides' lengths differ, as in a deployment whose prefill servers got less memory). ``stub``: the prefill side runs it as SGLang's one-token stub
    (``set_finish_with_abort`` replaces ``origin_input_ids`` with ``[0]``): SGLang 0.5.23's own
    prefill queue retires a stub at its door (``is_unadmitted_reject``), earlier versions
    prefilled and sent it, and so does any path that replaces a prompt behind the decode side's
    back, so the prefill scheduler here is handed the stub as it would run it. Without ``stub``
    the prefill side has a pool that holds the prompt (the truth). Returns the decode side's
    outputs, both schedulers, and the rids each decode batch ran. ``overlap``: SGLang's overlap
    PD event loops on both sides; ``decode_radix``: the decode side's radix cache on (the
    bystanders' transfers then start after the system prompt the decode side holds; the long
    prompt shares none)."""
    rng = random.Random(3)
    pairs = workload(11, 40)
    prompt = [rng.randrange(2, 30000) for _ in range(200)]
    victim = (pd_rig.pd_req(VICTIM, [0] if stub else prompt, room=VICTIM_ROOM, max_new=6, salt="acme"),
              pd_rig.pd_req(VICTIM, prompt, room=VICTIM_ROOM, max_new=6, salt="acme"))
    pairs.insert(24, victim)
    prefill, decode = sides(
        page_size, prefill_tokens=160 if stub else 2560, prefill_context=160 if stub else CONTEXT, decode_tokens=640,
        guard=guard, overlap=overlap, decode_radix=decode_radix,
    )
    start = pool_pages(prefill), pool_pages(decode)
    batches = []
    run_batch = decode.run_batch

    def spy(batch, *args, **kwargs):
        batches.append([r.rid for r in batch.reqs])
        return run_batch(batch, *args, **kwargs)

    decode.run_batch = spy
    out = pd_rig.run_pd(prefill, decode, pairs)
    assert (pool_pages(prefill), pool_pages(decode)) == start, "both pools whole at the end"
    return out, prefill, decode, batches


def bystanders(out):
    return {rid: v for rid, v in out.items() if rid != VICTIM}


@LOOPS
def test_without_kvguard_decode_serves_other_users_kv_for_the_stub(loops):
    """The incident: the wire moves the one page the prefill side sent and reports the transfer
    done; the decode side never learns the prompt was replaced and decodes over pages that held
    other requests' KV, serving an output that is not the prompt's."""
    truth, *_ = incident(stub=False, **loops)
    out, _, decode, batches = incident(stub=True, **loops)
    assert (decode_prefix_hits() > 0) == bool(loops.get("decode_radix"))
    pages = dict(Wire_offered())[VICTIM_ROOM]
    earlier = {p for room, ps in Wire_offered() if room != VICTIM_ROOM for p in ps}
    assert set(pages[1:]) & earlier, "the stub's unwritten pages are pages other requests' KV was written to"
    assert out[VICTIM][1]["type"] == "length" and any(VICTIM in b for b in batches)
    assert out[VICTIM][0] != truth[VICTIM][0]
    assert bystanders(out) == bystanders(truth)


def Wire_offered():
    return list(pd_rig.Wire.offered)


@LOOPS
def test_under_enforce_decode_refuses_the_stub_before_attention_reads_it(loops):
    """Under enforce (kvguard's plugin wrapping SGLang's own senders and receivers): the
    manifest the prefill side sent names a one-token prompt, the decode side holds 200 tokens,
    so the transfer is refused (KVPoll.Failed) and SGLang aborts the request before it enters
    any batch; only it; every bystander served as without kvguard; both pools whole."""
    ref, *_ = incident(stub=True, **loops)
    out, prefill, decode, batches = incident(stub=True, guard="enforce", **loops)
    ids, reason = out[VICTIM]
    assert ids == [] and reason["type"] == "abort" and "kvguard" in reason["message"]
    assert not any(VICTIM in b for b in batches), "never read by attention"
    assert list(decode.kvguard.aborted) == [VICTIM] and prefill.kvguard.aborted == {}
    kinds = {v.kind for v in decode.kvguard.violations}
    assert kinds <= {"token_count_mismatch", "prompt_digest_mismatch"} and kinds
    assert decode.kvguard.metrics["transfers_refused"] == 1
    assert decode.kvguard.metrics["transfers_accepted"] == len(out) - 1
    assert bystanders(out) == bystanders(ref)


@LOOPS
def test_under_report_the_stub_is_counted_once_and_served(loops):
    """Report mode refuses nothing: the refusal is counted and logged once, the request runs as
    without kvguard."""
    ref, *_ = incident(stub=True, **loops)
    out, prefill, decode, _ = incident(stub=True, guard="report", **loops)
    assert out == ref
    assert decode.kvguard.metrics["transfers_refused"] == 1 and decode.kvguard.aborted == {}
    assert [v.request for v in decode.kvguard.violations] == [VICTIM] and prefill.kvguard.violations == []


# ---- the plugin wraps SGLang's senders and receivers on its own; fail closed --------------------------


def test_the_plugin_wraps_the_backends_sender_and_receiver():
    """SGLang creates its KV sender (prefill) and receiver (decode) from the class its transfer
    backend picked (get_kv_class); kvguard's plugin wraps each one where SGLang creates it."""
    prefill, decode = sides(16, guard="enforce")
    p_req, d_req = workload(1, 1)[0]
    decode.published.restore()
    decode.handle_generate_request(d_req)
    prefill.published.restore()
    prefill.handle_generate_request(p_req)
    receiver = decode.disagg_decode_prealloc_queue.queue[0].kv_receiver
    sender = prefill.disagg_prefill_bootstrap_queue.queue[0].disagg_kv_sender
    assert isinstance(receiver, GuardedKVReceiver) and isinstance(receiver.inner, pd_rig.WireKVReceiver)
    assert isinstance(sender, GuardedKVSender) and isinstance(sender.inner, pd_rig.WireKVSender)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_enforce_refuses_to_start_a_pd_scheduler_without_a_manifest_channel(monkeypatch, side):
    """No channel named: the transfers could not be checked, so under enforce the scheduler does
    not start (SGLang's Scheduler.__init__ raises in the plugin's hook)."""
    monkeypatch.delenv("KVGUARD_SGLANG_PD_CHANNEL")
    pd_rig.install_wire()
    build = pd_rig.build_prefill if side == "prefill" else pd_rig.build_decode
    s = build(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)
    with pytest.raises(RuntimeError, match="KVGUARD_SGLANG_PD_CHANNEL.*refusing to serve PD transfers unchecked"):
        attach_kvguard(s, "enforce")


def test_enforce_refuses_to_start_when_sglangs_creation_site_moved(monkeypatch):
    """An SGLang whose prefill queue has no create_sender (the site kvguard wraps): under
    enforce the scheduler does not start; under report it starts and says its transfers are not
    checked."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    pd_rig.install_wire()
    s = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)
    monkeypatch.delattr(PrefillBootstrapQueue, "create_sender")
    with pytest.raises(RuntimeError, match="create_sender"):
        attach_kvguard(s, "enforce")
    s = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)
    assert attach_kvguard(s, "report").policy == "report"


def test_the_manifests_travel_through_a_directory_between_processes(monkeypatch, tmp_path):
    """KVGUARD_SGLANG_PD_CHANNEL=<directory>: each scheduler opens its own channel on it (as two
    processes would), the manifests go through files; every transfer accepted, the outputs of
    the unguarded run, nothing left in the directory."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", str(tmp_path))
    n = 40
    prefill, decode = sides(16, guard="enforce")
    out = pd_rig.run_pd(prefill, decode, workload(7, n))
    ref, *_ = unguarded(16, n)
    assert out == ref
    assert decode.kvguard.metrics["transfers_accepted"] == n and decode.kvguard.violations == []
    assert list(tmp_path.iterdir()) == []


# ---- the decode side's preallocation writes rows: ownership follows them -----------------------------


def misrouted_prealloc(*, guard: str | None, inject: bool = True):
    """The decode side preallocates request ``late`` (``DecodePreallocQueue._pre_alloc`` writes
    its row with ``ReqToTokenPool.write``) while ``early`` decodes; ``inject``: the allocation
    goes wrong and ``late``'s row gets ``early``'s slots (the allocator's own pages for ``late``
    are named by no row). Returns the decode side's outputs, the decode scheduler, and whether
    the bug happened."""
    rng = random.Random(5)
    early = [rng.randrange(2, 30000) for _ in range(90)]
    late = [rng.randrange(2, 30000) for _ in range(40)]
    pairs = [(pd_rig.pd_req("early", early, room=1, max_new=30), pd_rig.pd_req("early", early, room=1, max_new=30))]
    pairs += workload(2, 6)
    pairs.append((pd_rig.pd_req("late", late, room=2, max_new=4), pd_rig.pd_req("late", late, room=2, max_new=4)))
    prefill, decode = sides(16, guard=guard)
    start = pool_pages(prefill), pool_pages(decode)
    queue = decode.disagg_decode_prealloc_queue
    real = queue._alloc_for_decode_prealloc
    done = []

    def alloc(allocator, *, req, **kwargs):
        kv_loc = real(allocator, req=req, **kwargs)
        running = {r.rid: r for r in decode.running_batch.reqs}
        if inject and req.rid == "late" and "early" in running:
            done.append(True)
            row = running["early"].kv.req_pool_idx
            return decode.req_to_token_pool.req_to_token[row, : len(kv_loc)].to(kv_loc.dtype).clone()  # the bug
        return kv_loc

    queue._alloc_for_decode_prealloc = alloc
    out = pd_rig.run_pd(prefill, decode, pairs, per_step=1)
    if guard is not None:
        assert (pool_pages(prefill), pool_pages(decode)) == start, "both pools whole at the end"
    return out, decode, bool(done)


def test_without_kvguard_a_misrouted_preallocation_overwrites_a_running_requests_kv():
    """The transfer writes ``late``'s prompt into the pages ``early`` is decoding from: ``early``
    is served an output that is not its own."""
    truth, _, _ = misrouted_prealloc(guard=None, inject=False)
    out, _, done = misrouted_prealloc(guard=None)
    assert done and out["early"] != truth["early"]


def test_under_enforce_the_misrouted_preallocation_is_refused_at_its_row_write():
    """kvguard follows the preallocation's row write as every other row write: ``early``'s pages
    in ``late``'s row are refused on ``late`` when written (page_not_free: ``early`` holds them); ``late``
    offers the prefill side no page, its transfer fails, it alone is aborted; ``early`` and the
    others are served as if nothing happened; the pages the allocator gave ``late`` come back."""
    truth, _, _ = misrouted_prealloc(guard=None, inject=False)
    out, decode, done = misrouted_prealloc(guard="enforce")
    assert done
    assert list(decode.kvguard.aborted) == ["late"]
    v = decode.kvguard.aborted["late"]
    assert v.kind == "page_not_free" and v.request == "late" and v.owner == "early"
    assert out["late"][0] == [] and out["late"][1]["type"] == "abort"
    assert {rid: o for rid, o in out.items() if rid != "late"} == {rid: o for rid, o in truth.items() if rid != "late"}


def test_the_directory_channel_reads_data_only(tmp_path):
    """What the directory holds is read as data (a manifest's bytes, JSON pairs), never run:
    a file this channel did not write reads as nothing, which the decode side refuses as a
    missing manifest."""
    import pickle

    from kvguard.sglang import DirectoryChannel

    channel = DirectoryChannel(str(tmp_path))
    channel.put(3, "dest", [(5, 1), (6, 2)])
    channel.put(3, "manifest", b"\x00bytes")
    assert channel.get(3, "dest") == [[5, 1], [6, 2]] and channel.get(3, "manifest") == b"\x00bytes"
    (tmp_path / "4.manifest").write_bytes(pickle.dumps(object()))
    assert channel.get(4, "manifest") is None and channel.get(5, "ids") is None
    channel.drop(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4.manifest"]


def test_a_decode_only_probe_reads_no_kv_unchecked(monkeypatch):
    """SGLang's own probes of a decode server (``/health_generate``, the PD warm-up) carry its
    fake bootstrap host and run on the decode side alone: SGLang's real fake receiver reports the
    transfer done at once, and the request decodes over pages no transfer wrote (which may hold
    other requests' KV). Without kvguard it is served; under enforce there is no manifest, so
    it is refused before any batch reads it (a client can send that host too); under report it
    is counted and served."""
    import sglang.srt.disaggregation.fake as fake
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

    monkeypatch.setattr(fake, "FakeKVReceiver", FakeKVReceiver)  # SGLang's own, no wire
    served, guards = {}, {}
    for guard in (None, "enforce", "report"):
        decode = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32)
        if guard:
            guards[guard] = attach_kvguard(decode, guard)
        batches = []
        run_batch = decode.run_batch
        decode.run_batch = lambda batch, *a, **k: (batches.append([r.rid for r in batch.reqs]), run_batch(batch, *a, **k))[1]
        decode.published.restore()
        decode.handle_generate_request(pd_rig.pd_req("probe", [10, 11, 12, 13], room=0, max_new=8, host=FAKE_BOOTSTRAP_HOST))
        for _ in range(50):
            pd_rig.decode_step(decode)
        served[guard] = (pd_rig.rig.finished(decode)["probe"], batches)
    (ids, reason), batches = served[None]
    assert reason["type"] == "length" and len(ids) == 8 and batches
    (ids, reason), batches = served["enforce"]
    assert ids == [] and reason["type"] == "abort" and "kvguard" in reason["message"] and not batches
    # Report mode: counted, served as without kvguard.
    assert served["report"][0] == served[None][0] and guards["report"].metrics["transfers_refused"] == 1


def _failing_room(monkeypatch, room: int) -> None:
    """The backend fails room ``room``'s transfer after the handshake (the prefill side sends as
    usual: the wire has written the decode pages offered)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    poll = pd_rig.WireKVReceiver.poll

    def failing(self):
        return KVPoll.Failed if int(self.bootstrap_room) == room and self.has_sent_metadata else poll(self)

    monkeypatch.setattr(pd_rig.WireKVReceiver, "poll", failing)


def test_a_transfer_the_backend_fails_is_no_violation_and_its_pages_are_never_reused(monkeypatch):
    """The backend fails one transfer (its receiver says ``KVPoll.Failed``) after the prefill side
    sent, and cannot prove its writes stopped (SGLang's fake backend cannot defer a release):
    SGLang aborts that request with its own error and releases its pages at once, where a late
    write could still land. kvguard adds no violation and refuses no one, but keeps exactly the
    pages that transfer was offered out of SGLang's pool for good (a late write then lands in no
    one's KV); the other requests are served as without kvguard, and the prefill pool is whole."""
    _failing_room(monkeypatch, 1003)
    outs = {}
    for guard in (None, "enforce"):
        prefill, decode = sides(16, guard=guard)
        start = pool_pages(prefill), pool_pages(decode)
        outs[guard] = pd_rig.run_pd(prefill, decode, workload(7, 12))
        fenced = decode.kvguard.metrics["late_write_fenced_pages"] if guard else 0
        assert pool_pages(prefill) == start[0]
        assert pool_pages(decode) == start[1] - fenced
    failed = [rid for rid, (_, reason) in outs["enforce"].items() if reason["type"] == "abort"]
    assert len(failed) == 1 and "kvguard" not in outs["enforce"][failed[0]][1]["message"]
    assert outs["enforce"] == outs[None]
    assert prefill.kvguard.violations == [] and decode.kvguard.violations == []
    assert fenced > 0 and fenced == len(decode.kvguard._fenced)


@pytest.mark.parametrize("drained", [True, False])
def test_a_held_failed_transfer_is_released_to_sglang_only_when_its_backend_proves_it_drained(monkeypatch, drained):
    """A backend that defers a failed transfer's release (mooncake, nixl, mori: SGLang holds the
    pages until every prefill rank acknowledges, else releases them anyway at its timeout, 0 s
    here). Acknowledged (``drained``): the pages go back to SGLang, the pool is whole. Timed out
    with no acknowledgement: SGLang releases them anyway; kvguard keeps them out of its pool."""
    from sglang.srt.disaggregation.fake.conn import FakeKVManager

    _failing_room(monkeypatch, 1003)
    monkeypatch.setattr(FakeKVManager, "enable_deferred_decode_kv_release", True, raising=False)
    monkeypatch.setattr(FakeKVManager, "is_abort_release_safe", lambda self, room, acks: drained, raising=False)
    monkeypatch.setattr(FakeKVManager, "clear_deferred_abort_state", lambda self, room: None, raising=False)
    monkeypatch.setattr(pd_rig.WireKVReceiver, "bootstrap_infos", [object()], raising=False)

    def notified(self, *, force_arm=False):
        self.abort_notified = True

    monkeypatch.setattr(pd_rig.WireKVReceiver, "ensure_abort_notified", notified)
    prefill, decode = sides(16, guard="enforce")
    decode.disagg_decode_transfer_queue.deferred_kv_release_timeout = 0.0
    start = pool_pages(decode)
    out = pd_rig.run_pd(prefill, decode, workload(7, 12))
    failed = [rid for rid, (_, reason) in out.items() if reason["type"] == "abort"]
    assert len(failed) == 1 and decode.kvguard.violations == []
    fenced = decode.kvguard.metrics["late_write_fenced_pages"]
    if drained:
        assert fenced == 0 and pool_pages(decode) == start
    else:
        assert fenced > 0 and pool_pages(decode) == start - fenced


# ---- the decode side's radix cache: the prefill side sends from the prefix the decode side holds ------


def skipped_page(*, guard: str | None, inject: bool = True, overlap: bool = False):
    """The decode side's radix cache on: it names the prefix it holds (``decode_prefix_len``) and
    offers pages for the rest. ``inject``: for the first transfer after a prefix, the prefill
    side is told one page more (a backend that carried the length wrong), so it sends one page
    fewer, from a page later: the pages land one page early and the decode side's last offered
    page is never written. Returns the decode side's outputs, the decode scheduler and the
    request it happened to."""
    real = pd_rig.WireKVSender.pop_decode_prefix_len
    hit = []

    def pop(self):
        prefix = real(self)
        if inject and prefix > 0 and not hit:
            hit.append(int(self.bootstrap_room))
            return prefix + self.kv_mgr.kv_args.page_size
        return prefix

    pd_rig.WireKVSender.pop_decode_prefix_len = pop
    try:
        prefill, decode = sides(16, guard=guard, overlap=overlap, decode_radix=True)
        start = pool_pages(prefill), pool_pages(decode)
        pairs = workload(5, 60)
        out = pd_rig.run_pd(prefill, decode, pairs)
    finally:
        pd_rig.WireKVSender.pop_decode_prefix_len = real
    assert (pool_pages(prefill), pool_pages(decode)) == start, "both pools whole at the end"
    rid = next(d.rid for _, d in pairs if d.bootstrap_room == hit[0]) if hit else None
    return out, decode, rid


def test_without_kvguard_a_transfer_past_the_decode_prefix_serves_stale_kv():
    truth, _, _ = skipped_page(guard=None, inject=False)
    out, _, rid = skipped_page(guard=None)
    assert rid is not None and out[rid][1]["type"] == "length" and out[rid] != truth[rid]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_under_enforce_a_transfer_past_the_decode_prefix_is_refused(overlap):
    """The manifest states the tokens sent after the prefix the prefill side assumed, keyed by
    that prefix: the decode side, which holds another prefix, refuses the transfer (only that
    request is aborted, before any batch reads it); every other request is served as without
    the bug."""
    truth, _, _ = skipped_page(guard=None, inject=False, overlap=overlap)
    out, decode, rid = skipped_page(guard="enforce", overlap=overlap)
    assert rid is not None and list(decode.kvguard.aborted) == [rid]
    assert out[rid][0] == [] and out[rid][1]["type"] == "abort" and "kvguard" in out[rid][1]["message"]
    assert {v.kind for v in decode.kvguard.violations} <= {"token_count_mismatch", "prompt_digest_mismatch"}
    assert {k: v for k, v in out.items() if k != rid} == {k: v for k, v in truth.items() if k != rid}


def test_the_tokens_after_a_decode_prefix_are_keyed_by_that_prefix():
    """What a transfer after a decode-side prefix states: the tokens after it, keyed by the
    prefix's digest and length; another prefix (same length, or the same tokens cut elsewhere)
    gives other tokens, so its manifest's digest differs; 32-bit token ids stay 32-bit."""
    from kvguard.sglang.pd import _transfer_tokens

    prompt = list(range(100, 140))
    other = [7] + prompt[1:]
    assert _transfer_tokens(prompt, 0).tolist() == prompt
    assert len(_transfer_tokens(prompt, 16)) == 24
    assert _transfer_tokens(prompt, 16).tolist() == _transfer_tokens(list(prompt), 16).tolist()
    assert _transfer_tokens(prompt, 16).tolist() != _transfer_tokens(other, 16).tolist()
    assert _transfer_tokens(prompt, 16).tolist()[1:] != _transfer_tokens(prompt, 17).tolist()
    assert all(0 <= t < 2**32 for t in _transfer_tokens([2**32 - 1] * 40, 16).tolist())
