"""A landing that fails fails closed, on every Python transfer path.

Whichever path lands the bytes (Receiver.accept, Receiver.pin + PinnedImport.accept, an
ImportTicket in a `with` block) and wherever the copy raises (any page, any exception,
KeyboardInterrupt included), afterwards: nothing of the import is readable, one landing_failed
violation names the page, the receiving request is not quarantined, the exception the copy
raised propagates with a note naming the page, and the rest of the table is as it was.
(NixlLink.receive is tested over two processes in test_nixl.py.)
"""

import pytest

import kvguard

PAGE, SLOT = 4, 2
PROMPT = list(range(100, 110))  # 10 tokens: 3 pages


class CopyFailed(Exception):
    pass


def decode_pool():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(32, PAGE, 64, reserved=[0]))
    # A bystander of another tenant, reading its own pages.
    t.admit("bystander", "beta", 8, 0)
    bystander = [r.page for r in t.allocate("bystander", 2)]
    t.record_write_tokens("bystander", bystander, 0, 8)
    t.admit("req-7", "acme", len(PROMPT), 4)
    dest = t.allocate("req-7", 3)
    pages = [bytes([i]) * (len(chunk) * SLOT) for i, chunk in
             enumerate(PROMPT[k:k + PAGE] for k in range(0, len(PROMPT), PAGE))]
    wire = kvguard.Manifest.build(
        t.request_key("req-7"), t.tenant_key("acme"), 1, PAGE, SLOT, PROMPT, dest, pages
    ).encode()
    return t, dest, pages, wire, bystander


def fields(obj, names):
    return None if obj is None else tuple(getattr(obj, n) for n in names)


def state(t):
    """Everything the table says of its pages and requests (not the violation counts)."""
    page = ("state", "generation", "owner", "tenant", "prefix", "written_prefix", "written_slots")
    request = ("tenant", "prompt_tokens", "max_new_tokens", "prefixes", "quarantined")
    return (
        [fields(t.page_info(p), page) for p in range(32)],
        [fields(t.request_info(r), request) + (sorted(x.page for x in t.request_info(r).owned_pages),)
         for r in ("req-7", "bystander")],
        t.snapshot().in_flight,
    )


def failing_at(fail_at, exc):
    calls = []

    def land(index, ref, data):
        calls.append(index)
        if index == fail_at:
            raise exc

    return land, calls


def accept(path, t, dest, pages, wire, land):
    rx = kvguard.Receiver(t)
    if path == "accept":
        return rx.accept("req-7", "acme", PROMPT, dest, wire, pages, slot_bytes=SLOT, land=land)
    pinned = rx.pin("req-7", "acme", PROMPT, dest, slot_bytes=SLOT)
    return pinned.accept(wire, pages, land=land)


@pytest.mark.parametrize("path", ["accept", "pinned"])
@pytest.mark.parametrize("fail_at", [0, 1, 2])
@pytest.mark.parametrize("exc", [CopyFailed("cudaMemcpy failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_landing_that_raises_leaves_nothing_readable(path, fail_at, exc):
    t, dest, pages, wire, bystander = decode_pool()
    before = state(t)
    land, calls = failing_at(fail_at, exc)

    with pytest.raises(type(exc)) as raised:
        accept(path, t, dest, pages, wire, land)

    # The copy's own exception, told which page it failed on; landing stopped there.
    assert raised.value is exc
    assert any(f"landing entry {fail_at}" in n and f"page {dest[fail_at].page}," in n
               for n in getattr(raised.value, "__notes__", []))
    assert calls == list(range(fail_at + 1))
    # One violation of its own kind, naming the page; nobody quarantined.
    assert t.counters() == {"landing_failed": 1}
    [v] = t.drain_violations()
    assert (v.kind, v.page, v.block_index) == ("landing_failed", dest[fail_at].page, fail_at)
    # The table is as before: nothing written, nothing pinned, nobody quarantined.
    assert state(t) == before
    # None of the receiving pages reads; the bystander's do.
    assert t.check_read("req-7", [r.page for r in dest], len(PROMPT)).kind == "unwritten_slots"
    assert t.check_read("bystander", bystander, 8) is None


def test_an_import_ticket_left_by_an_exception_fails_and_revokes_coverage():
    t, dest, pages, wire, bystander = decode_pool()
    # Slots the request wrote itself before the transfer: a failed copy may have overwritten them.
    t.record_write_tokens("req-7", [r.page for r in dest], 0, 6)
    with pytest.raises(CopyFailed):
        with t.begin_import("req-7", dest) as ticket:
            raise CopyFailed("the copy into the pool failed")
    assert not ticket.open
    assert t.counters() == {"landing_failed": 1}
    assert all(t.page_info(r.page).written_slots == 0 for r in dest)
    assert not t.request_info("req-7").quarantined
    assert t.check_read("req-7", [dest[0].page], 1).kind == "unwritten_slots"
    # The request recomputes: its own writes read again.
    t.record_write_tokens("req-7", [r.page for r in dest], 0, 10)
    t.verify_read("req-7", [r.page for r in dest], 10)


def test_an_import_ticket_fails_at_a_page_and_ends_once():
    t, dest, pages, wire, bystander = decode_pool()
    ticket = t.begin_import("req-7", dest)
    v = ticket.fail(1)
    assert (v.kind, v.page, v.block_index, v.request) == ("landing_failed", dest[1].page, 1, "req-7")
    assert not ticket.open and t.snapshot().in_flight == 0
    with pytest.raises(kvguard.Error, match="ended"):
        ticket.fail(1)
    # A ticket left without an exception and unfinished only aborts: nothing is recorded.
    with t.begin_import("req-7", dest):
        pass
    assert t.counters() == {"landing_failed": 1}


def test_a_violation_message_names_str_ids_as_the_engine_gave_them():
    t, dest, pages, wire, bystander = decode_pool()
    v = t.check_read("req-7", bystander, 1)
    assert v.kind == "foreign_page"
    assert str(v).startswith('foreign_page: req "req-7" (tenant "acme") read page')
    assert 'owned by req "bystander" (tenant "beta")' in str(v)
    assert str(t.request_key("req-7")) not in str(v), "no internal key in the message"
