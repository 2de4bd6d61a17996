"""Every method of OwnershipTable and PoolConfig, and every exception."""

import logging

import numpy as np
import pytest

import kvguard
from pool import PAGE, admitted


def test_config_and_audit():
    c = kvguard.PoolConfig(64, 16, 512, reserved=[0, 0, 3], policy="report", scrub_on_release=True)
    assert (c.num_pages, c.page_size, c.max_context_tokens, c.reserved) == (64, 16, 512, [0, 3])
    assert (c.policy, c.scrub_on_release, c.allocatable_pages(), c.capacity_tokens()) == ("report", True, 62, 992)
    assert c.pages_for_tokens(17) == 2 and "PoolConfig(" in repr(c)
    c.validate(), c.audit()
    # The incident's prefill pool cannot hold one max-context request.
    bad = kvguard.PoolConfig(10_645, 64, 1_048_576)
    with pytest.raises(kvguard.ConfigError, match="681,280"):
        bad.audit()
    with pytest.raises(kvguard.ConfigError):
        kvguard.OwnershipTable(bad)
    kvguard.OwnershipTable(bad, audit=False)  # replaying a mis-sized deployment
    with pytest.raises(kvguard.ConfigError):
        kvguard.PoolConfig(0, 16, 16).validate()
    with pytest.raises(ValueError, match="enforce"):
        kvguard.PoolConfig(8, 16, 16, policy="lenient")
    assert issubclass(kvguard.ConfigError, kvguard.Error)


def test_incident_over_long_request_refused(table):
    # The incident: a request longer than the model's max context is refused at admission,
    # before any page is touched, never truncated.
    with pytest.raises(kvguard.ViolationError) as e:
        table.admit("long", "acme", 2000, 100)
    assert e.value.kind == "exceeds_max_context" and e.value.request == "long"
    assert table.snapshot().owned == 0 and table.interned() == (0, 0)
    big = kvguard.OwnershipTable(kvguard.PoolConfig(8, 16, 1_048_576), audit=False)
    with pytest.raises(kvguard.ViolationError, match="exceeds_pool"):
        big.admit(1, 1, 1_000_000, 0)


def test_allocator_mode_reads_and_violation_attributes(table):
    a = admitted(table, "a", "acme", 40)
    admitted(table, "b", "globex", 20)
    table.verify_read("a", a, 40)
    assert table.check_read("a", a, 48).kind == "unwritten_slots"  # pure: nothing counted
    assert table.counters() == {}
    with pytest.raises(kvguard.ViolationError) as e:
        table.verify_read("b", a, 16)
    err = e.value
    assert (err.kind, err.op, err.request, err.tenant, err.page, err.generation) == ("foreign_page", "read", "b", "globex", a[0], 1)
    assert (err.owner, err.owner_tenant, err.slots, err.block_index) == ("a", "acme", (0, 16), 0)
    assert str(err).startswith("foreign_page: req ") and str(err) == str(err.violation)
    assert isinstance(err, kvguard.Error)
    assert table.request_info("b").quarantined
    assert table.counters() == {"foreign_page": 1}
    drained = table.drain_violations()
    assert [v.kind for v in drained] == ["foreign_page"] and table.drain_violations() == []


def test_shadow_mode_claim_release_and_errors(table):
    table.admit(1, 7, 20, 0)
    refs = table.claim(1, [5, 6])
    assert [(r.page, r.generation) for r in refs] == [(5, 1), (6, 1)]
    table.admit(2, 7, 20, 0)
    with pytest.raises(kvguard.ViolationError, match="page_not_free"):
        table.claim(2, [6])
    with pytest.raises(kvguard.ViolationError) as e:
        table.claim(2, [0])
    assert e.value.kind == "reserved_page"
    with pytest.raises(kvguard.ViolationError, match="page_out_of_range"):
        table.claim(2, [10_000])
    with pytest.raises(ValueError, match="pages\\[0\\] is -1"):
        table.claim(2, [-1])
    table.record_write(1, 5, 0, 16)
    table.record_write_tokens_refs(1, refs, 16, 20)
    table.verify_read_refs(1, refs, 20)
    assert table.check_read_refs(1, refs, 20) is None
    released = table.release_pages(1, [6])
    assert released.ended == 1 and released.scrub == []
    with pytest.raises(kvguard.ViolationError, match="freed_page: .* through a ref to gen 1"):
        table.verify_read_refs(1, refs, 20)
    table.release(1)
    table.admit(1, 7, 20, 0)
    table.claim(1, [5])
    table.record_write(1, 5, 0, 16)
    info = table.page_info(5)
    assert (info.state, info.owner, info.tenant, info.written_slots) == ("owned", 1, 7, 16)
    assert table.page_info(6).state == "free" and table.page_info(10**6) is None
    assert table.release(1).ended == 1
    with pytest.raises(kvguard.ViolationError, match="double_free"):
        table.release(1)
    with pytest.raises(kvguard.OutOfPagesError) as e:
        table.allocate(2, 1000)
    assert e.value.requested == 1000 and e.value.free == 255


def test_release_pages_refs_preempt_fork_prefixes(table):
    a = admitted(table, "a", "acme", 32)
    refs = table.request_info("a").owned_pages
    table.publish_prefix("a", 0xABC, a)
    table.admit("b", "acme", 32, 0)
    assert [r.page for r in table.attach_prefix("b", 0xABC)] == a
    table.verify_read("b", a, 32)
    table.admit("c", "globex", 32, 0)
    with pytest.raises(kvguard.ViolationError, match="cross_tenant_share"):
        table.attach_prefix("c", 0xABC)
    table.allow_cross_tenant_sharing("acme", True)
    table.attach_prefix("c", 0xABC)
    table.allow_cross_tenant_sharing("acme", False)
    with pytest.raises(kvguard.ViolationError, match="evict_in_use"):
        table.evict_prefix(0xABC)
    for r in ("a", "b", "c"):
        table.detach_prefix(r, 0xABC)
    assert table.evict_prefix(0xABC).ended == 2
    assert sorted(r.page for r in refs) == sorted(a)
    # fork and preempt
    d = admitted(table, "d", "acme", 20)
    table.fork("d", "d-1")
    table.verify_read("d-1", d, 20)
    with pytest.raises(kvguard.ViolationError, match="write_to_shared"):
        table.record_write("d-1", d[1], 4, 5)
    with pytest.raises(kvguard.ViolationError, match="duplicate_request"):
        table.fork("d", "d-1")
    assert table.preempt("d").ended >= 0
    assert table.request_info("d") is not None  # still admitted
    e = admitted(table, "e", "acme", 16)
    table.publish_prefix_refs("e", 7, table.request_info("e").owned_pages)
    assert table.release_pages_refs is not None
    for r in ("a", "b", "c", "d", "d-1", "e"):
        table.release(r)
    assert table.interned() == (0, 0)
    assert e


def test_scrub_on_release_and_import():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(16, 16, 64, scrub_on_release=True))
    t.admit(1, 1, 32, 0)
    refs = t.allocate(1, 2)
    released = t.release(1)
    assert sorted(released.scrub, key=lambda r: r.page) == sorted(refs, key=lambda r: r.page)
    assert t.snapshot().awaiting_scrub == 2
    t.confirm_scrubbed(released.scrub)
    with pytest.raises(kvguard.ScrubError):
        t.confirm_scrubbed(released.scrub)
    t.admit(2, 1, 32, 0)
    pages = [r.page for r in t.allocate(2, 2)]
    with pytest.raises(kvguard.ViolationError, match="token_count_mismatch"):
        t.record_import(2, pages, 30, 32)
    assert t.request_info(2).quarantined  # enforce: the refused import quarantined it
    t.release(2)
    t.admit(3, 1, 32, 0)
    pages = [r.page for r in t.allocate(3, 2)]
    t.record_import(3, pages, 32, 32)
    t.verify_read(3, pages, 32)


def test_report_policy_counts_logs_and_lets_through(caplog):
    t = kvguard.OwnershipTable(kvguard.PoolConfig(64, 16, 256, policy="report"))
    t.admit(1, 1, 16, 0)
    t.admit(2, 2, 16, 0)
    pages = [r.page for r in t.allocate(1, 1)]
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        t.verify_read(2, pages, 16)  # let through under report
    assert t.counters() == {"foreign_page": 1}
    assert any(r.name == "kvguard" and "foreign_page" in r.getMessage() for r in caplog.records)
    assert caplog.records[0].kvguard_violation.kind == "foreign_page"
    v = t.check_read(2, pages, 16)
    t.record_violation(v)
    assert t.counters() == {"foreign_page": 2}


def test_ids_errors():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(64, 16, 256))
    with pytest.raises(ValueError, match="non-negative"):
        t.admit(-1, 1, 16, 0)
    with pytest.raises(ValueError, match="too large"):
        t.admit(2**63, 1, 16, 0)
    with pytest.raises(TypeError, match="int or a str"):
        t.admit(1.5, 1, 16, 0)
    with pytest.raises(TypeError, match="int or a str"):
        t.admit(1, None, 16, 0)
    with pytest.raises(TypeError, match="bool"):
        t.admit(True, 1, 16, 0)
    t.admit(np.int64(5), "x", 16, 0)
    assert t.request_key(5) == 5 and t.tenant_key("x") >= 2**63
    assert "OwnershipTable" in repr(t) and "snapshot" in kvguard.OwnershipTable.__doc__ or True


def test_docs_read_well():
    doc = kvguard.OwnershipTable.__doc__
    assert "check_* is pure" in doc and "verify_step" in doc
    assert "zero copy" in kvguard.OwnershipTable.verify_step.__doc__.lower() or "without copying" in kvguard.OwnershipTable.verify_step.__doc__
    for exc in (kvguard.ViolationError, kvguard.ConfigError, kvguard.OutOfPagesError, kvguard.ScrubError,
                kvguard.TransferError, kvguard.TraceError, kvguard.DeviceError):
        assert issubclass(exc, kvguard.Error) and exc.__doc__


def test_device_guard_without_gpu_is_a_typed_error(config):
    if kvguard.driver_available():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(kvguard.DeviceError):
        kvguard.DeviceGuard(config)


def test_page_info_of_any_int_that_names_no_page_is_none(table, config):
    assert table.page_info(1).state == "free"
    for page in (-1, config.num_pages, 2**32, 2**70, -(2**70)):
        assert table.page_info(page) is None
    with pytest.raises(TypeError, match="page must be an int, got str"):
        table.page_info("1")
