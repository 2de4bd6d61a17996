"""Prefill and decode as two processes over NIXL on loopback (kvguard.NixlLink, feature `nixl`).

Decode is this process; prefill is `nixl_prefill.py`, each with its own NIXL agent and host
pages, the agents' metadata and region layouts exchanged over the prefill process's stdin and
stdout (the side channel). For every fault of the two-process demo, in both directions (prefill
WRITEs decode's pages with the manifest as the notification; decode READs prefill's staged
pages), decode pins its pages before asking, receives, and refuses with the fault's named
error; a clean transfer is accepted and readable. A refused or aborted transfer records no
coverage (reads through its pages are refused) and its pages are scrubbed.

Needs a wheel built with the `nixl` feature and libnixl_capi.so on LD_LIBRARY_PATH
(`source scripts/ci/nixl.sh setup`); skipped otherwise, unless KVGUARD_REQUIRE_NIXL=1 (set by
that setup, so in scripts/test), which turns the skip into a failure.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvguard

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


class Prefill:
    """The prefill process and decode's side of the pair: agent, pages, link."""

    def __init__(self):
        tag = f"{os.getpid()}"
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("nixl_prefill.py")), f"prefill-{tag}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.agent = kvguard.NixlAgent(f"decode-{tag}")
        self.region = kvguard.HostRegion(self.agent, PAGES, PAGE_BYTES)
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


@pytest.fixture(scope="module")
def prefill():
    _nixl_or_skip()
    pair = Prefill()
    yield pair
    pair.close()
    assert pair.proc.returncode == 0


class Decode:
    """One request at decode: a table of its own over the pair's region, with stale bytes of an
    earlier owner in every page."""

    def __init__(self, pair):
        self.pair = pair
        self.table = kvguard.OwnershipTable(kvguard.PoolConfig(PAGES, PAGE_SIZE, 64))
        self.receiver = kvguard.Receiver(self.table)
        self.request = next(_requests)
        for page in range(PAGES):
            pair.region.write(page, bytes([STALE]) * PAGE_BYTES)

    def pages(self):
        self.table.admit(self.request, TENANT, len(PROMPT), 8)
        return self.table.allocate(self.request, -(-len(PROMPT) // PAGE_SIZE))

    def pull(self, refs, direction, fault, timeout=20.0, land=None):
        """Pins `refs`, asks prefill, receives: the Accepted, or raises."""
        pinned = self.receiver.pin(self.request, TENANT, PROMPT, refs, slot_bytes=SLOT_BYTES)
        assert pinned.pinned
        self.pair.write(
            {
                "request": self.request,
                "tenant": TENANT,
                "prompt": PROMPT,
                "dest": [[r.page, r.generation] for r in refs],
                "direction": direction,
                "fault": fault,
            }
        )
        try:
            return self.pair.link.receive(pinned, self.pair.region, direction=direction, timeout=timeout, land=land)
        finally:
            assert not pinned.pinned, "receive ends the pinned import, whatever its outcome"
            assert self.pair.read()["done"] in (fault, "declined")

    def assert_nothing_leaked(self, refs):
        v = self.table.check_read_refs(self.request, refs, 1)
        assert v is not None, "a refused transfer's pages must not be readable"
        for r in refs:
            assert self.pair.region.read(r.page) == bytes(PAGE_BYTES), "a refused transfer's pages are scrubbed"


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
        assert prefill.region.read(r.page, len(data)) == data


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


def test_a_notification_that_never_comes_times_out_and_records_nothing(prefill):
    d = Decode(prefill)
    refs = d.pages()
    with pytest.raises(kvguard.NixlError) as aborted:
        d.pull(refs, "write", "silent", timeout=0.3)
    assert aborted.value.kind == "timeout"
    assert isinstance(aborted.value, kvguard.Error)
    assert sum(d.table.counters().values()) == 0, "a timeout is no verdict on content"
    d.assert_nothing_leaked(refs)
    # No verdict on content, and the pages are unpinned: the request can let them go.
    d.table.release(d.request)


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
