"""Import tickets (begin_import: finish, abort, context manager, garbage collection), whole
steps through PageRefs (check_step_refs / verify_step_refs) and take_changed_pages."""

import gc

import numpy as np
import pytest

import kvguard
from pool import PAGE, admitted


def test_import_ticket_finish_in_a_with_block(table):
    table.admit("r", "acme", 40, 0)
    refs = table.allocate("r", 3)
    with table.begin_import("r", refs) as ticket:
        assert ticket.open and ticket.request == "r" and ticket.pages == refs
        assert "open" in repr(ticket)
        ticket.finish(40, 40)
        assert not ticket.open and ticket.pages == []
    assert table.snapshot().in_flight == 0
    table.verify_read("r", [r.page for r in refs], 40)
    with pytest.raises(kvguard.Error, match="already ended"):
        ticket.finish(40, 40)
    ticket.abort()  # nothing left to abort


def test_import_ticket_aborted_by_an_exception_and_pins_pages(table):
    table.admit("r", "acme", 32, 0)
    refs = table.allocate("r", 2)
    with pytest.raises(RuntimeError):
        with table.begin_import("r", refs) as ticket:
            # A release while bytes still land: the pages leave "r" but cannot be allocated
            # until the ticket ends.
            table.release("r")
            assert table.snapshot().in_flight == 2
            raise RuntimeError("the transfer failed")
    assert not ticket.open and table.snapshot().in_flight == 0


def test_import_ticket_mismatch_in_flight_and_gc(table):
    table.admit(1, 1, 32, 0)
    refs = table.allocate(1, 2)
    ticket = table.begin_import(1, refs)
    with pytest.raises(kvguard.ViolationError) as e:
        table.begin_import(1, refs[:1])
    assert e.value.kind == "import_in_flight"
    with pytest.raises(kvguard.ViolationError) as e:
        ticket.finish(30, 32)
    assert e.value.kind == "token_count_mismatch" and not ticket.open
    assert table.snapshot().in_flight == 0
    table.admit(2, 1, 32, 0)
    refs = table.allocate(2, 2)
    table.begin_import(2, refs)  # dropped at once: aborted
    gc.collect()
    assert table.snapshot().in_flight == 0
    with pytest.raises(kvguard.ViolationError) as e:
        table.begin_import(2, refs[:1] + refs[:1])  # refs of another request are refused too
    with pytest.raises(TypeError, match="PageRef"):
        table.begin_import(2, [1, 2])


def test_import_ticket_keeps_its_table_alive(config):
    def start():
        t = kvguard.OwnershipTable(config)
        t.admit("r", "acme", 16, 0)
        return t.begin_import("r", t.allocate("r", 1))

    ticket = start()
    gc.collect()
    ticket.finish(16, 16)


def test_verify_step_refs(table):
    a = admitted(table, "a", "acme", 32)
    b = admitted(table, "b", "globex", 16)
    ra = table.request_info("a").owned_pages
    rb = table.request_info("b").owned_pages
    assert table.verify_step_refs(["a", "b"], [ra, rb], np.array([32, 16])).clean
    # b's page released and handed back to b: the old ref names a past incarnation.
    table.release_pages("b", [rb[0].page])
    fresh = table.claim("b", [rb[0].page])
    table.record_write_tokens_refs("b", fresh, 0, 16)
    v = table.check_step_refs(["a", "b", "b"], [ra, rb, fresh], [32, 16, 16])
    assert v.refused_rows == [1] and v.violations[0].kind == "stale_page"
    assert table.counters() == {}  # check_* is pure
    v = table.verify_step_refs(["a", "b"], [rb, ra], [16, 32])
    assert v.refused_rows == [0, 1] and table.counters()
    with pytest.raises(ValueError, match="rows"):
        table.verify_step_refs(["a", "b"], [ra], [32, 16])
    with pytest.raises(TypeError, match="PageRef"):
        table.verify_step_refs(["a"], [a], [32])
    with pytest.raises(TypeError, match="sequence"):
        table.verify_step_refs(["a"], 3, [32])
    with pytest.raises(ValueError, match="seq_lens"):
        table.verify_step_refs(["a"], [ra], [])
    assert b  # b's pages were written


def test_take_changed_pages(table, config):
    first = table.take_changed_pages()
    assert len(first) == config.num_pages and all(isinstance(i, kvguard.PageInfo) for _, i in first)
    assert table.take_changed_pages() == []
    pages = admitted(table, "r", "acme", 20)
    changed = dict(table.take_changed_pages())
    assert sorted(changed) == sorted(pages)
    info = changed[pages[0]]
    assert info.owner == "r" and info.tenant == "acme" and info.written_slots == PAGE
    table.release("r")
    changed = dict(table.take_changed_pages())
    assert sorted(changed) == sorted(pages) and changed[pages[0]].owner is None
