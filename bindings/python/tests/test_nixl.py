"""Prefill and decode as two processes over NIXL on loopback (kvguard.NixlLink, feature `nixl`).

Decode is this process; prefill is `nixl_prefill.py`, each with its own NIXL agent and host
pages, the agents' metadata and region layouts exchanged over the prefill process's stdin and
stdout (the side channel). For every fault of the two-process demo, in both directions (prefill
WRITEs decode's pages with the manifest as the notification; decode READs prefill's staged
pages), decode pins its pages before asking, receives, and refuses with the fault's named
error; a clean transfer is accepted and readable. A refused or aborted transfer records no
coverage (reads through its pages are refused) and its pages are scrubbed.

The same runs with decode receiving into an engine's own pool (kvguard.EnginePool over a numpy
array the "engine" owns and registered through kvguard), and into a GPU-typed pool whose pages
the engine's callbacks copy and zero (emulated here over host memory: no GPU).

Needs a wheel built with the `nixl` feature and libnixl_capi.so on LD_LIBRARY_PATH
(`source scripts/ci/nixl.sh setup`); skipped otherwise, unless KVGUARD_REQUIRE_NIXL=1 (set by
that setup, so in scripts/test), which turns the skip into a failure.
"""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvguard
import nixl_prefill

PAGES = 16
PAGE_SIZE = 4
SLOT_BYTES = 16
PAGE_BYTES = PAGE_SIZE * SLOT_BYTES
TENANT = 5
PROMPT = [11, 12, 13, 14, 15, 16]
STALE = 0xEE

# Each fault of the demo and the violation kind decode refuses it with.
FAULTS = {
    "truncate-page": "page_length_mismatch",
    "flip-byte": "page_checksum_mismatch",
    "wrong-request": "transfer_misrouted",
    "late": "stale_page",
    "dummy-prompt": "token_count_mismatch",
    "missing-checksum": "missing_checksum",
}
DIRECTIONS = ["write", "read"]
_requests = itertools.count(1)


def _nixl_or_skip():
    if hasattr(kvguard, "NixlAgent") and kvguard.nixl_library_available():
        return
    why = (
        "kvguard was built without the nixl feature"
        if not hasattr(kvguard, "NixlAgent")
        else "libnixl_capi.so cannot be loaded (LD_LIBRARY_PATH)"
    )
    if os.environ.get("KVGUARD_REQUIRE_NIXL") == "1":
        pytest.fail(f"KVGUARD_REQUIRE_NIXL=1 but {why}; set up with `source scripts/ci/nixl.sh setup`")
    pytest.skip(f"{why}; set up with `source scripts/ci/nixl.sh setup`")


class HostPages:
    """Decode's pages as kvguard's own HostRegion."""

    def __init__(self, agent):
        self.region = kvguard.HostRegion(agent, PAGES, PAGE_BYTES)

    def write(self, page, data):
        self.region.write(page, data)

    def read(self, page, length=PAGE_BYTES):
        return self.region.read(page, length)


class EnginePages:
    """Decode's pages as an engine's own pool: a numpy array the engine owns, registered with
    decode's agent through kvguard.EnginePool."""

    def __init__(self, agent):
        import numpy as np

        self.memory = np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8)
        self.region = kvguard.EnginePool(agent, self.memory, PAGE_BYTES)

    def write(self, page, data):
        self.memory[page * PAGE_BYTES : page * PAGE_BYTES + len(data)] = list(data)

    def read(self, page, length=PAGE_BYTES):
        return self.memory[page * PAGE_BYTES : page * PAGE_BYTES + length].tobytes()


class Prefill:
    """The prefill process and decode's side of the pair: agent, pages, link."""

    def __init__(self, pages=HostPages):
        tag = f"{os.getpid()}-{pages.__name__}"
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("nixl_prefill.py")), f"prefill-{tag}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.agent = kvguard.NixlAgent(f"decode-{tag}")
        self.pages = pages(self.agent)
        self.region = self.pages.region
        peer = self.read()
        self.write({"metadata": self.agent.metadata().hex(), "layout": self.region.layout().hex()})
        self.link = kvguard.NixlLink(self.agent, bytes.fromhex(peer["metadata"]), bytes.fromhex(peer["layout"]))

    def write(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self):
        line = self.proc.stdout.readline()
        assert line, f"the prefill process ended (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.write({"quit": True})
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", params=[HostPages, EnginePages], ids=["host_region", "engine_pool"])
def prefill(request):
    _nixl_or_skip()
    pair = Prefill(request.param)
    yield pair
    pair.close()
    assert pair.proc.returncode == 0


class Decode:
    """One request at decode: a table of its own over the pair's region, with stale bytes of an
    earlier owner in every page."""

    def __init__(self, pair, table=None):
        """A table of its own, or another Decode's `table` (a second request beside it)."""
        self.pair = pair
        self.request = next(_requests)
        if table is not None:
            self.table, self.receiver = table, kvguard.Receiver(table)
            return
        self.table = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE_SIZE, 64))
        self.receiver = kvguard.Receiver(self.table)
        for page in range(PAGES):
            pair.pages.write(page, bytes([STALE]) * PAGE_BYTES)

    def pages(self):
        self.table.admit(self.request, TENANT, len(PROMPT), 8)
        return self.table.allocate(self.request, -(-len(PROMPT) // PAGE_SIZE))

    def pull(self, refs, direction, fault, timeout=20.0, land=None, region=None):
        """Pins `refs`, asks prefill, receives (into the pair's region, or `region`): the
        Accepted, or raises."""
        pinned = self.receiver.pin(self.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
        assert pinned.pinned
        self.ask(refs, direction, fault)
        try:
            into = self.pair.region if region is None else region
            receive = "write" if direction.startswith("write") else direction
            return self.pair.link.receive(pinned, into, direction=receive, timeout=timeout, land=land)
        finally:
            assert not pinned.pinned, "receive ends the pinned import, whatever its outcome"
            assert self.pair.read()["done"] in (fault, "declined")

    def ask(self, refs, direction, fault, **more):
        """Asks prefill for this request's KV into `refs` (the pull), injecting `fault`; the
        link expects the request first (decode's link is selective)."""
        self.pair.link.expect(self.request)
        self.pair.write(
            {
                "request": self.request,
                "tenant": TENANT,
                "prompt": PROMPT,
                "dest": [[r.page, r.generation] for r in refs],
                "direction": direction,
                "fault": fault,
                **more,
            }
        )

    def held_until_timeout(self, refs, direction, fault):
        """Pins `refs` and asks prefill, which holds its answer back (`fault`); the receive
        gives up after 0.3 s with NixlError of kind timeout."""
        pinned = self.receiver.pin(self.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
        self.ask(refs, direction, fault)
        assert self.pair.read()["done"] == "held"
        with pytest.raises(kvguard.NixlError) as timed_out:
            self.pair.link.receive(pinned, self.pair.region, direction=direction, timeout=0.3)
        assert timed_out.value.kind == "timeout"

    def assert_nothing_leaked(self, refs):
        v = self.table.check_read_refs(self.request, refs, 1)
        assert v is not None, "a refused transfer's pages must not be readable"
        for r in refs:
            assert self.pair.pages.read(r.page) == bytes(PAGE_BYTES), "a refused transfer's pages are scrubbed"


def kv_pages(prompt):
    pages = [prompt[i : i + PAGE_SIZE] for i in range(0, len(prompt), PAGE_SIZE)]
    return [b"".join(bytes([t % 251]) * SLOT_BYTES for t in page) for page in pages]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_clean_transfer_is_accepted_and_readable(prefill, direction):
    d = Decode(prefill)
    refs = d.pages()
    landed = []
    accepted = d.pull(refs, direction, "none", land=lambda i, r, b: landed.append((i, r, b)))
    assert (accepted.tokens, accepted.pages) == (len(PROMPT), 2)
    assert d.table.check_read_refs(d.request, refs, len(PROMPT)) is None
    want = kv_pages(PROMPT)
    assert [b for _, _, b in landed] == want
    assert [r for _, r, _ in landed] == refs
    for r, data in zip(refs, want):
        assert prefill.pages.read(r.page, len(data)) == data


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "late"])
def test_each_fault_is_refused_with_its_named_error_and_nothing_leaks(prefill, direction, fault):
    d = Decode(prefill)
    refs = d.pages()
    with pytest.raises(kvguard.TransferError) as refused:
        d.pull(refs, direction, fault)
    assert refused.value.kind == FAULTS[fault], str(refused.value)
    assert refused.value.violation.kind == FAULTS[fault]
    assert refused.value.violation.request == d.request
    assert d.table.counters()[FAULTS[fault]] == 1, "the refusal is recorded in decode's table"
    d.assert_nothing_leaked(refs)


@pytest.mark.parametrize("fail_at", [0, 1])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_land_that_raises_fails_the_import_and_nothing_leaks(prefill, direction, fail_at):
    """The bytes arrived and checked, but the engine's own copy of them failed: the import is
    abandoned (landing_failed, the request not quarantined), the copy's exception propagates
    with the page named, and nothing is readable or left in the pages."""
    d = Decode(prefill)
    refs = d.pages()

    def land(index, ref, data):
        if index == fail_at:
            raise MemoryError("the engine's copy into its KV cache failed")

    with pytest.raises(MemoryError) as raised:
        d.pull(refs, direction, "none", land=land)
    assert any(f"landing entry {fail_at} " in n for n in raised.value.__notes__)
    assert d.table.counters() == {"landing_failed": 1}
    assert not d.table.request_info(d.request).quarantined
    d.assert_nothing_leaked(refs)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_late_transfer_after_the_pages_were_reused_is_stale(prefill, direction):
    d = Decode(prefill)
    first = d.pages()
    # Prefill is not ready: it declines (keeping the transfer it made for these incarnations).
    with pytest.raises(kvguard.NixlError) as declined:
        d.pull(first, direction, "late")
    assert declined.value.kind == "declined"
    assert sum(d.table.counters().values()) == 0, "a decline is no verdict on content"
    d.assert_nothing_leaked(first)
    # Decode gives the pages up, and they come back to the request in a new incarnation.
    d.table.release(d.request)
    again = d.pages()
    assert sorted(r.page for r in again) == sorted(r.page for r in first)
    assert all(r.generation > first[0].generation for r in again)
    with pytest.raises(kvguard.TransferError) as refused:
        d.pull(again, direction, "late")
    assert refused.value.kind == "stale_page", str(refused.value)
    d.assert_nothing_leaked(again)


@pytest.mark.parametrize("fault", ["extra-page", "swap-page"])
@pytest.mark.parametrize("victim_is", ["bystander", "accepted"])
def test_a_push_into_a_page_decode_did_not_offer_is_refused_and_that_page_revoked(prefill, fault, victim_is):
    """Prefill WRITEs into a page decode did not offer and names it in its notice: one page more
    than the offer (extra-page) or in place of an offered one (swap-page); the victim is another
    tenant's written page, or the page of a transfer decode accepted just before. Refused, and
    the victim's page (which holds prefill's bytes now) is unreadable by its owner until
    rewritten, the overwrite recorded against the transfer; the victim is not quarantined."""
    d = Decode(prefill)
    if victim_is == "accepted":
        first = Decode(prefill, table=d.table)
        first_refs = first.pages()
        first.pull(first_refs, "write", "none")
        owner, victim = first.request, first_refs[0]
        assert d.table.check_read_refs(owner, first_refs, len(PROMPT)) is None
    else:
        owner = "victim"
        d.table.admit(owner, "other-tenant", PAGE_SIZE, 0)
        [victim] = d.table.allocate(owner, 1)
        d.table.record_write_tokens(owner, [victim.page], 0, PAGE_SIZE)
    refs = d.pages()
    pinned = d.receiver.pin(d.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    d.ask(refs, "write", fault, victim=victim.page)
    with pytest.raises(kvguard.TransferError) as refused:
        prefill.link.receive(pinned, prefill.region, direction="write", timeout=20.0)
    assert prefill.read()["done"] == fault
    assert refused.value.kind == "transfer_pages_mismatch"
    assert d.table.check_read(owner, [victim.page], 1).kind == "unwritten_slots"
    assert not d.table.request_info(owner).quarantined
    overwrites = [v for v in d.table.drain_violations() if v.page == victim.page]
    assert [(v.kind, v.request, v.owner) for v in overwrites] == [("transfer_pages_mismatch", d.request, owner)]
    d.assert_nothing_leaked(refs)


def test_a_pull_retried_after_a_timeout_is_accepted(prefill):
    """Decode's first pull times out; prefill answers it only when decode pulls again, into new
    pages. The late answer is set aside (decode releases it on prefill) and the retry is
    accepted: not refused as stale, and prefill's staging of the retry not ended by the release
    of the first."""
    d = Decode(prefill)
    first = d.pages()
    d.held_until_timeout(first, "read", "retry-late")
    d.table.release(d.request)
    again = d.pages()
    accepted = d.pull(again, "read", "retry-late")
    assert (accepted.tokens, accepted.pages) == (len(PROMPT), 2)
    assert sum(d.table.counters().values()) == 0
    assert d.table.check_read_refs(d.request, again, len(PROMPT)) is None


@pytest.mark.parametrize("direction", ["write", "read"])
def test_notices_for_requests_decode_never_asked_for_are_dropped_on_arrival(prefill, direction):
    """A hostile prefill floods decode with large notices for requests it never asked for:
    decode's selective link drops each as it arrives (none kept), and the transfer it did ask
    for is accepted."""
    d = Decode(prefill)
    refs = d.pages()
    before = prefill.link.unasked
    accepted = d.pull(refs, direction, "flood")
    assert (accepted.tokens, accepted.pages) == (len(PROMPT), 2)
    assert prefill.link.unasked - before == nixl_prefill.FLOOD
    assert prefill.link.inbox_bytes == 0
    assert prefill.link.evicted == 0, "dropped on arrival, never kept: nothing evicted to make room"


def test_a_notification_that_never_comes_times_out_and_records_nothing(prefill):
    d = Decode(prefill)
    refs = d.pages()
    with pytest.raises(kvguard.NixlError) as aborted:
        d.pull(refs, "write", "silent", timeout=0.3)
    assert aborted.value.kind == "timeout"
    assert isinstance(aborted.value, kvguard.Error)
    assert sum(d.table.counters().values()) == 0, "a timeout is no verdict on content"
    d.assert_nothing_leaked(refs)
    # A push decode gave up on may still WRITE: its pages stay fenced. The request can let them
    # go, but they are not handed out until the engine says prefill is done with them.
    assert prefill.link.fenced >= 1
    d.table.release(d.request)
    assert d.table.snapshot().in_flight == len(refs)
    assert prefill.link.settle_fences(d.table, prefill.region) == 0, "no late notice came"
    assert prefill.link.release_fences(d.table, prefill.region) == 1
    assert d.table.snapshot().in_flight == 0


@pytest.mark.parametrize("direction", ["write", "read"])
def test_an_offered_transfer_given_up_on_without_a_receive_is_fenced_if_it_may_still_land(prefill, direction):
    """The request ends while its transfer is pinned and offered: ``abandon`` ends the pinned
    import. A push may still WRITE the offered pages: they stay fenced (released, not handed
    out) until its late notice or release_fences. A pull moved nothing: its pages go back."""
    d = Decode(prefill)
    refs = d.pages()
    before = prefill.link.fenced
    pinned = d.receiver.pin(d.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    prefill.link.expect(d.request)
    with pytest.raises(ValueError, match="direction"):
        prefill.link.abandon(pinned, "sideways")
    assert pinned.pinned, "a mistyped direction ends nothing"
    prefill.link.abandon(pinned, direction)
    assert not pinned.pinned
    d.table.release(d.request)
    if direction == "write":
        assert prefill.link.fenced == before + 1
        assert d.table.snapshot().in_flight == len(refs), "released, but not handed out"
        assert prefill.link.release_fences(d.table, prefill.region) >= 1
    else:
        assert prefill.link.fenced == before
    assert d.table.snapshot().in_flight == 0


def test_a_push_decode_gave_up_on_stays_fenced_until_its_late_write_is_done(prefill):
    """Prefill pushes only after decode's wait timed out. Until that late WRITE is over, its pages
    are not handed out (released, they stay in flight); its notice lifts the fence, the pages
    zeroed, and the next owner reads nothing of them."""
    d = Decode(prefill)
    refs = d.pages()
    before = prefill.link.fenced
    d.held_until_timeout(refs, "write", "push-late")
    assert prefill.link.fenced == before + 1
    d.table.release(d.request)
    assert d.table.snapshot().in_flight == len(refs), "released, but not handed out"
    # Now prefill's WRITE lands, late, with its notice.
    prefill.write({"late": d.request})
    lifted, deadline = 0, time.monotonic() + 20
    while not lifted and time.monotonic() < deadline:
        lifted = prefill.link.settle_fences(d.table, prefill.region)
        time.sleep(0.005)
    assert prefill.read()["done"] == "pushed-late"
    assert lifted == 1 and prefill.link.fenced == before
    assert d.table.snapshot().in_flight == 0
    for r in refs:
        assert prefill.pages.read(r.page) == bytes(PAGE_BYTES), "the late bytes are zeroed"
    # The pages go to the next request with nothing written.
    d.table.admit("next", TENANT, 8, 0)
    again = d.table.claim("next", [r.page for r in refs])
    assert all(a.generation > r.generation for a, r in zip(again, refs))
    assert d.table.check_read("next", [r.page for r in refs], 1).kind == "unwritten_slots"


class InProcess:
    """Prefill and decode as two agents in this process (prefill's calls made by the test, decode's
    on a thread where it must be live): each side's HostRegion of `npages` pages of `page_bytes`,
    decode's link to prefill (`decode_link`) and prefill's to decode (`link`)."""

    def __init__(self, tag, npages, page_bytes):
        tag = f"{os.getpid()}-{tag}"
        self.decode, self.prefill = kvguard.NixlAgent(f"decode-{tag}"), kvguard.NixlAgent(f"prefill-{tag}")
        self.decode_region = kvguard.HostRegion(self.decode, npages, page_bytes)
        self.prefill_region = kvguard.HostRegion(self.prefill, npages, page_bytes)
        self.decode_link = kvguard.NixlLink(self.decode, self.prefill.metadata(), self.prefill_region.layout())
        self.link = kvguard.NixlLink(self.prefill, self.decode.metadata(), self.decode_region.layout())

    def receive_while_settling(self, pinned, direction, request, settle, reuse, land=None):
        """Decode receives `pinned` into its region on a thread of its own (20 s at most) while
        prefill settles what it holds (`settle`: its link's settle_pushes or settle_stages), the
        engine reusing each page handed back at once (`reuse(page)`), until decode is done and
        nothing is held (30 s at most). Returns decode's verdict (the Accepted, or the error) and
        the pages handed back."""
        import threading

        verdict = []

        def receive():
            try:
                verdict.append(
                    self.decode_link.receive(pinned, self.decode_region, direction=direction, timeout=20.0, land=land)
                )
            except kvguard.Error as e:
                verdict.append(e)

        receiving = threading.Thread(target=receive)
        receiving.start()
        handed, deadline = [], time.monotonic() + 30
        while (receiving.is_alive() or self.link.in_flight) and time.monotonic() < deadline:
            for r, pages in settle():
                assert r == request
                for page in pages:
                    reuse(page)
                handed += pages
            # A live prefill keeps calling NIXL (UCX moves, and decode's READ is served, only
            # inside its calls): here it declines a request decode never asked for, which decode
            # drops on arrival.
            with pytest.raises(kvguard.NixlError):
                self.link.decline(10_000, timeout=0.001)
        receiving.join(timeout=30)
        assert not receiving.is_alive()
        return verdict[0], handed


def test_a_push_that_fails_with_writes_in_flight_holds_its_source_pages_until_they_complete():
    """Prefill (a second agent in this process) pushes 4 pages of 8 MiB with its deadline already
    passed: push_prompt raises NixlError (kind timeout) whose in_flight names the source pages its
    unfinished WRITEs may still read, and the link holds them (NixlLink.in_flight) until NIXL
    reports those WRITEs complete (settle_pushes). Prefill writes the next tenant's KV into each
    page as soon as the library lets it go; decode, receiving from then on, accepts the push:
    every page landed with the KV pushed, none of the next tenant's. Before, the WRITEs were
    released at the error and every page looked free (released WRITEs go on: the Rust twin of
    this test sees them carry the next tenant's KV into decode's pages); here the released last
    part's notification never came, and decode timed out."""
    _nixl_or_skip()
    page_size, slot_bytes, npages, request = 4, 2 << 20, 4, 1
    page_bytes = page_size * slot_bytes
    pair = InProcess("in-flight", npages, page_bytes)
    prefill_region, link = pair.prefill_region, pair.link
    table = kvguard.OwnershipTable(kvguard.PoolConfig(npages, page_size, npages * page_size))
    prompt = list(range(npages * page_size))
    table.admit(request, TENANT, len(prompt), 0)
    refs = table.allocate(request, npages)
    ours, next_tenants = bytes([0xA5]) * page_bytes, bytes([0xBB]) * page_bytes
    for page in range(npages):
        prefill_region.write(page, ours)
    pinned = kvguard.Receiver(table).pin(request, TENANT, prompt, refs, slot_bytes=slot_bytes)
    pair.decode_link.expect(request)
    landed = []

    def land(index, ref, data):
        landed.append(bytes(data) == ours)

    def reuse(page):
        prefill_region.write(page, next_tenants)

    src = [(page, page_bytes) for page in range(npages)]
    # Decode's agent is not called yet, so it reads nothing from the socket: 32 MiB cannot all
    # leave by the push's first poll.
    with pytest.raises(kvguard.NixlError) as failed:
        link.push_prompt(prefill_region, src, refs, request, TENANT, 1, page_size, slot_bytes, prompt, timeout=0.0)
    held = list(getattr(failed.value, "in_flight", []))
    # The engine reuses each source page as soon as the library lets it go.
    for page in range(npages):
        if page not in held:
            reuse(page)
    verdict, handed = pair.receive_while_settling(pinned, "write", request, link.settle_pushes, reuse, land=land)
    assert isinstance(verdict, kvguard.Accepted), f"decode did not accept the push: {verdict!r}"
    assert verdict.tokens == len(prompt)
    assert landed == [True] * npages, "every page landed with the KV pushed, none with the next tenant's"
    assert failed.value.kind == "timeout", str(failed.value)
    assert held, f"the push timed out with WRITEs in flight: {failed.value}"
    assert link.in_flight == []
    assert sorted(handed) == sorted(held), "the pages held are handed back, each once, when their WRITE completed"
    assert link.release_pushes() == []


def test_a_push_with_writes_held_keeps_its_region_alive_and_refuses_a_retry_of_its_pages():
    """A push of 4 x 8 MiB fails with its WRITEs in flight: the link keeps the region it pushed
    from alive (a reference of its own) until it holds no page, so collecting the engine's last
    reference cannot free memory UCX still reads; a retry from the held pages is refused before
    anything is sent (kind 'extents'); held_pages counts each page once, held_by_failed_writes
    none (no WRITE failed); settle_pushes hands each page back once, and the reference goes.
    Before, the link kept no reference (getrefcount unchanged), and the retry was posted."""
    _nixl_or_skip()
    import threading

    npages, page_bytes, request = 4, 8 << 20, 1
    pair = InProcess("held-region", npages, page_bytes)
    prefill_region, decode_link, link = pair.prefill_region, pair.decode_link, pair.link
    for page in range(npages):
        prefill_region.write(page, bytes([0xA5]) * page_bytes)
    src, dest = [(page, page_bytes) for page in range(npages)], list(range(npages))
    refs = sys.getrefcount(prefill_region)
    # Decode's agent is not called yet: 32 MiB cannot all leave by the push's first poll.
    with pytest.raises(kvguard.NixlError) as failed:
        link.push(prefill_region, src, dest, request, b"", timeout=0.0)
    held = list(failed.value.in_flight)
    assert held and len(set(held)) == len(held), str(failed.value)
    assert link.held_pages == len(held)
    assert link.held_by_failed_writes == 0
    assert sys.getrefcount(prefill_region) == refs + 1, "the link keeps the region its WRITEs read"
    with pytest.raises(kvguard.NixlError) as retry:
        link.push(prefill_region, src, dest, request, b"", timeout=0.0)
    assert retry.value.kind == "extents" and list(retry.value.in_flight) == [], str(retry.value)
    assert sys.getrefcount(prefill_region) == refs + 1, "kept once"
    serving = threading.Event()

    def serve():
        # A live decode: its agent moves along (here: declines nobody waits for).
        while not serving.is_set():
            try:
                decode_link.decline(10_000, timeout=0.001)
            except kvguard.NixlError:
                pass

    server = threading.Thread(target=serve)
    server.start()
    try:
        handed, deadline = [], time.monotonic() + 30
        while link.in_flight and time.monotonic() < deadline:
            for r, pages in link.settle_pushes():
                assert r == request
                handed += pages
    finally:
        serving.set()
        server.join(timeout=30)
    assert sorted(handed) == sorted(held), "each held page handed back once"
    assert link.held_pages == 0 and link.in_flight == []
    assert sys.getrefcount(prefill_region) == refs, "let go once nothing is held"


def test_a_released_push_never_frees_the_region_its_writes_may_still_read():
    """release_pushes hands a failed push's held pages back (the engine knows the peer gone), but
    a released WRITE is not stopped: the region the link kept for it is never let go (leaked,
    as when a link is dropped holding pages). Before, release let it go: collected by its owner,
    it was deregistered and freed under the WRITE."""
    _nixl_or_skip()
    npages, page_bytes, request = 4, 8 << 20, 1
    pair = InProcess("released-region", npages, page_bytes)
    prefill_region, link = pair.prefill_region, pair.link
    src, dest = [(page, page_bytes) for page in range(npages)], list(range(npages))
    refs = sys.getrefcount(prefill_region)
    # Decode's agent is not called yet: 32 MiB cannot all leave by the push's first poll.
    with pytest.raises(kvguard.NixlError) as failed:
        link.push(prefill_region, src, dest, request, b"", timeout=0.0)
    held = list(failed.value.in_flight)
    assert held and sys.getrefcount(prefill_region) == refs + 1, str(failed.value)
    handed = [page for _, pages in link.release_pushes() for page in pages]
    assert sorted(handed) == sorted(held) and link.held_pages == 0
    assert sys.getrefcount(prefill_region) == refs + 1, "a released WRITE may still read it: kept for good"


def staged_prompt(prefill_region, npages, request):
    """Decode's table with ``request`` admitted and two pages allocated for PROMPT, and prefill's
    side of a pull of it: PROMPT's KV written into ``prefill_region`` from FIRST_SRC_PAGE on.
    Returns (table, refs, manifest, src extents)."""
    table = kvguard.OwnershipTable(kvguard.PoolConfig(npages, PAGE_SIZE, npages * PAGE_SIZE))
    table.admit(request, TENANT, len(PROMPT), 0)
    refs = table.allocate(request, 2)
    pages = kv_pages(PROMPT)
    manifest = nixl_prefill.manifest_for(request, TENANT, PROMPT, refs, pages)
    src = []
    for i, data in enumerate(pages):
        prefill_region.write(nixl_prefill.FIRST_SRC_PAGE + i, data)
        src.append((nixl_prefill.FIRST_SRC_PAGE + i, len(data)))
    return table, refs, manifest, src


def test_a_stage_that_times_out_holds_its_pages_until_decode_releases_them():
    """Prefill (a second agent in this process) stages a request's KV with its deadline already
    passed: stage raises NixlError (kind timeout) whose in_flight names the staged pages decode
    may still READ, and the link holds them (NixlLink.in_flight) until decode's Released naming
    them comes (settle_stages). Prefill writes the next tenant's KV into each page as soon as the
    library lets it go; decode, receiving from then on, READs the pages and accepts the KV staged.
    Before, the stage raised a bare timeout and every page looked free: decode READ the next
    tenant's KV and refused it (page_checksum_mismatch)."""
    _nixl_or_skip()
    npages, request = 8, 1
    pair = InProcess("stage-held", npages, PAGE_BYTES)
    prefill_region, link = pair.prefill_region, pair.link
    table, refs, manifest, src = staged_prompt(prefill_region, npages, request)
    staged = [page for page, _ in src]
    next_tenants = bytes([0xBB]) * PAGE_BYTES

    def reuse(page):
        prefill_region.write(page, next_tenants)

    # Decode's agent is not called yet: its Released cannot come by a deadline already passed.
    with pytest.raises(kvguard.NixlError) as failed:
        link.stage(src, request, manifest, timeout=0.0)
    held = list(getattr(failed.value, "in_flight", []))
    # The engine reuses each staged page the library does not hold, at once.
    for page in staged:
        if page not in held:
            reuse(page)
    pair.decode_link.expect(request)
    pinned = kvguard.Receiver(table).pin(request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    verdict, handed = pair.receive_while_settling(pinned, "read", request, link.settle_stages, reuse)
    assert isinstance(verdict, kvguard.Accepted), f"decode did not accept the KV staged: {verdict!r}"
    assert verdict.tokens == len(PROMPT)
    table.verify_read(request, [r.page for r in refs], len(PROMPT))
    assert failed.value.kind == "timeout", str(failed.value)
    assert held == staged, f"the staged pages decode may still READ: {failed.value}"
    assert handed == staged, "the pages held are handed back, once, when decode released them"
    assert link.in_flight == []
    assert link.release_stages() == []


def test_a_stage_told_its_region_checks_its_extents_and_keeps_it_alive_while_held():
    """stage(..., region=): an extent outside the region is refused before anything is sent
    (kind 'extents', nothing held); a stage that times out with its pages held keeps the region
    alive (a reference of the link's) until settle_stages hands the pages back, then lets it go.
    Without region= the link keeps no reference: the caller keeps a staged region alive."""
    _nixl_or_skip()
    npages, request = 8, 1
    pair = InProcess("stage-region", npages, PAGE_BYTES)
    prefill_region, link = pair.prefill_region, pair.link
    table, refs, manifest, src = staged_prompt(prefill_region, npages, request)
    refs_before = sys.getrefcount(prefill_region)
    with pytest.raises(kvguard.NixlError) as outside:
        link.stage([(npages, PAGE_BYTES)], request, manifest, timeout=5.0, region=prefill_region)
    assert outside.value.kind == "extents" and list(outside.value.in_flight) == [], str(outside.value)
    assert link.in_flight == [] and sys.getrefcount(prefill_region) == refs_before
    # Decode's agent is not called yet: its Released cannot come by a deadline already passed.
    with pytest.raises(kvguard.NixlError) as failed:
        link.stage(src, request, manifest, timeout=0.0, region=prefill_region)
    held = list(failed.value.in_flight)
    assert held == [page for page, _ in src], str(failed.value)
    assert sys.getrefcount(prefill_region) == refs_before + 1, "the link keeps the region decode may READ"
    pair.decode_link.expect(request)
    pinned = kvguard.Receiver(table).pin(request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    verdict, handed = pair.receive_while_settling(pinned, "read", request, link.settle_stages, lambda page: None)
    assert isinstance(verdict, kvguard.Accepted), f"decode did not accept the KV staged: {verdict!r}"
    assert handed == held and link.in_flight == []
    assert sys.getrefcount(prefill_region) == refs_before, "let go once the link holds no page"


def test_a_pinned_import_ends_once(prefill):
    d = Decode(prefill)
    refs = d.pages()
    with d.receiver.pin(d.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES) as pinned:
        assert pinned.pages == refs
    assert not pinned.pinned
    with pytest.raises(RuntimeError):
        prefill.link.receive(pinned, prefill.region, timeout=0.1)
    # A second pin of the same pages while one is in flight is refused.
    first = d.receiver.pin(d.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    with pytest.raises(kvguard.TransferError):
        d.receiver.pin(d.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
    first.abort()


class DeviceView:
    """A GPU-typed ('vram') EnginePool over the engine pair's memory, with the callbacks an
    engine gives for GPU memory: read copies a page to the host, scrub zeroes pages "on the
    device". Emulated over the numpy array (no GPU here), and not registered (register=False):
    NIXL cannot register device memory without CUDA, so kvguard's own transfers over it fail."""

    def __init__(self, pair):
        self.pages = pair.pages
        self.reads = []
        self.scrubbed = []
        memory = pair.pages.memory
        self.pool = kvguard.EnginePool.at(
            pair.agent,
            memory.ctypes.data,
            memory.nbytes,
            PAGE_BYTES,
            segment="vram",
            register=False,
            owner=memory,
            read=self.read,
            scrub=self.scrub,
        )

    def read(self, page, length):
        self.reads.append(page)
        return self.pages.read(page, length)

    def scrub(self, pages):
        self.scrubbed.extend(pages)
        for page in pages:
            self.pages.write(page, bytes(PAGE_BYTES))


@pytest.fixture(scope="module")
def engine_pair():
    _nixl_or_skip()
    pair = Prefill(EnginePages)
    yield pair
    pair.close()
    assert pair.proc.returncode == 0


def test_an_engine_pool_is_received_into_in_place(engine_pair):
    """The bytes land in the engine's own numpy array: no copy through kvguard's pages."""
    d = Decode(engine_pair)
    refs = d.pages()
    d.pull(refs, "write", "none")
    for r, data in zip(refs, kv_pages(PROMPT)):
        start = r.page * PAGE_BYTES
        assert engine_pair.pages.memory[start : start + len(data)].tobytes() == data
    assert engine_pair.region.segment == "dram" and engine_pair.region.pages == PAGES


def test_a_gpu_typed_pool_checks_through_the_engines_callbacks(engine_pair):
    view = DeviceView(engine_pair)
    assert view.pool.segment == "vram"
    assert view.pool.layout()[16] == 1, "the layout tells the peer it is GPU memory"
    d = Decode(engine_pair)
    refs = d.pages()
    accepted = d.pull(refs, "write", "none", region=view.pool)
    assert accepted.pages == 2 and set(view.reads) == {r.page for r in refs}
    assert d.table.check_read_refs(d.request, refs, len(PROMPT)) is None
    # A fault is refused through the same callbacks, and the pages are zeroed by the engine's.
    d = Decode(engine_pair)
    refs = d.pages()
    with pytest.raises(kvguard.TransferError) as refused:
        d.pull(refs, "write", "flip-byte", region=view.pool)
    assert refused.value.kind == "page_checksum_mismatch"
    assert sorted(view.scrubbed) == sorted(r.page for r in refs)
    d.assert_nothing_leaked(refs)


def test_a_pull_into_an_unregistered_gpu_pool_aborts_and_zeroes(engine_pair):
    """NIXL refuses to READ into memory its agent does not know: aborted, nothing recorded."""
    view = DeviceView(engine_pair)
    d = Decode(engine_pair)
    refs = d.pages()
    with pytest.raises(kvguard.NixlError) as aborted:
        d.pull(refs, "read", "none", region=view.pool)
    assert aborted.value.kind == "call", str(aborted.value)
    assert sum(d.table.counters().values()) == 0, "a transport failure is no verdict on content"
    assert sorted(view.scrubbed) == sorted(r.page for r in refs)
    d.assert_nothing_leaked(refs)


def test_a_gpu_pool_whose_callbacks_fail_aborts(engine_pair):
    def broken(*_):
        raise OSError("device lost")

    memory = engine_pair.pages.memory
    pool = kvguard.EnginePool.at(
        engine_pair.agent, memory.ctypes.data, memory.nbytes, PAGE_BYTES,
        segment="vram", register=False, owner=memory, read=broken, scrub=broken,
    )  # fmt: skip
    d = Decode(engine_pair)
    refs = d.pages()
    with pytest.raises(kvguard.NixlError) as aborted:
        d.pull(refs, "write", "none", region=pool)
    assert aborted.value.kind == "segment", str(aborted.value)
    assert d.table.check_read_refs(d.request, refs, 1) is not None, "nothing recorded"


def test_engine_pool_descriptions_that_do_not_fit_are_refused(engine_pair):
    import numpy as np

    agent = engine_pair.agent
    with pytest.raises(kvguard.NixlError) as bad:
        kvguard.EnginePool(agent, np.zeros(PAGE_BYTES * 2 + 1, dtype=np.uint8), PAGE_BYTES)
    assert bad.value.kind == "extents"
    with pytest.raises(kvguard.NixlError) as bad:
        kvguard.EnginePool(agent, np.zeros(PAGE_BYTES, dtype=np.uint8), 0)
    assert bad.value.kind == "extents"
    with pytest.raises(kvguard.NixlError) as bad:
        kvguard.EnginePool(agent, np.zeros(0, dtype=np.uint8), PAGE_BYTES)
    assert bad.value.kind == "extents"
    readonly = np.zeros(PAGE_BYTES, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        kvguard.EnginePool(agent, readonly, PAGE_BYTES)
    with pytest.raises(ValueError):
        kvguard.EnginePool(agent, np.zeros((4, PAGE_BYTES), dtype=np.uint8)[:, :8], 8)
    with pytest.raises(TypeError):
        kvguard.EnginePool(agent, [0] * PAGE_BYTES, PAGE_BYTES)
    with pytest.raises(kvguard.NixlError) as bad:
        kvguard.EnginePool.at(agent, 0, PAGE_BYTES, PAGE_BYTES, register=False)
    assert bad.value.kind == "extents"
    with pytest.raises(kvguard.NixlError) as bad:
        kvguard.EnginePool.at(agent, 2**64 - PAGE_BYTES, 2 * PAGE_BYTES, PAGE_BYTES, register=False)
    assert bad.value.kind == "extents"
    with pytest.raises(ValueError):
        kvguard.EnginePool.at(agent, 4096, PAGE_BYTES, PAGE_BYTES, segment="vram", register=False)
    with pytest.raises(ValueError):
        kvguard.EnginePool.at(agent, 4096, PAGE_BYTES, PAGE_BYTES, read=len, scrub=len, register=False)
    with pytest.raises(ValueError):
        kvguard.EnginePool.at(agent, 4096, PAGE_BYTES, PAGE_BYTES, segment="hbm", register=False)


def test_pinned_pages_outside_the_engine_pool_abort_and_record_nothing(engine_pair):
    """Decode's table has more pages than the pool it receives into: a transfer to pages the
    pool does not have is never landed, whatever prefill sends."""
    import numpy as np

    small = np.zeros(PAGE_BYTES, dtype=np.uint8)  # one page: the pinned pages lie past it
    pool = kvguard.EnginePool(engine_pair.agent, small, PAGE_BYTES)
    d = Decode(engine_pair)
    d.table.admit(d.request, TENANT, len(PROMPT), 8)
    d.table.allocate(d.request, 1)  # page 0 taken, so the prompt's pages are past the pool
    refs = d.table.allocate(d.request, 2)
    assert all(r.page >= 1 for r in refs)
    with pytest.raises((kvguard.TransferError, kvguard.NixlError)):
        d.pull(refs, "read", "none", region=pool)
    assert d.table.check_read_refs(d.request, refs, 1) is not None
    assert small.tobytes() == bytes(PAGE_BYTES)


def test_checksum_ahead_is_page_checksum_of_the_page_in_place():
    _nixl_or_skip()
    agent = kvguard.NixlAgent("checksum-ahead")
    region = kvguard.HostRegion(agent, 2, PAGE_BYTES)
    region.write(1, bytes(range(PAGE_BYTES)))
    assert region.checksum(1) == (PAGE_BYTES, kvguard.page_checksum(bytes(range(PAGE_BYTES))))
    assert region.checksum(1, 10) == (10, kvguard.page_checksum(bytes(range(10))))
    with pytest.raises(kvguard.NixlError):
        region.checksum(2)
    with pytest.raises(kvguard.NixlError):
        region.checksum(0, PAGE_BYTES + 1)


@pytest.mark.parametrize(
    "direction, fault",
    [
        (direction, fault)
        for direction in ("write-building", "write-ahead")
        for fault in ("none", "dummy-prompt", "truncate-page")
    ]
    + [("write-ahead", "flip-byte")],
)
def test_a_push_that_builds_its_manifest_on_the_way_is_checked_the_same(prefill, direction, fault):
    """Prefill's push_prompt: kvguard builds the manifest while the parts fly ("write-building"),
    or with the pages' CRCs taken ahead, before the offer ("write-ahead": HostRegion.checksum,
    push_prompt's `ahead`); decode's checks are the same (a substituted prompt is refused; extents
    that do not fit send nothing; a page changed after its CRC was taken ahead is refused)."""
    d = Decode(prefill)
    refs = d.pages()
    if fault == "none":
        accepted = d.pull(refs, direction, fault)
        assert accepted.tokens == len(PROMPT)
        assert d.table.check_read_refs(d.request, refs, len(PROMPT)) is None
        return
    with pytest.raises((kvguard.TransferError, kvguard.NixlError)) as refused:
        d.pull(refs, direction, fault, timeout=3.0)
    if fault == "truncate-page":
        # The extents no longer fit the prompt: prefill sends nothing, decode times out.
        assert getattr(refused.value, "kind", None) == "timeout", str(refused.value)
    else:
        assert refused.value.kind == FAULTS[fault], str(refused.value)
    d.assert_nothing_leaked(refs)
