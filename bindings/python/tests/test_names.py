"""String ids: interned (never hashed), released with the request, memory flat over a million
requests."""

import os

import kvguard


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_million_string_requests_memory_flat():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(1024, 16, 1024, reserved=[0]))
    admit, release = t.admit, t.release

    def run(lo, hi):
        for i in range(lo, hi):
            rid = f"cmpl-{i:032x}"
            admit(rid, f"tenant-{i % 97}", 16, 0)
            release(rid)

    run(0, 100_000)
    before = rss_bytes()
    run(100_000, 1_000_000)
    grown = rss_bytes() - before
    assert t.interned() == (0, 0)
    assert t.snapshot().requests == 0
    # 900,000 more requests, each with a 37-byte id: a leak would be well over 50 MB.
    assert grown < 16 * 1024 * 1024, grown


def test_same_string_twice_is_a_duplicate_and_ids_never_collide():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(64, 16, 256))
    t.admit("x", "t", 16, 0)
    try:
        t.admit("x", "t", 16, 0)
    except kvguard.ViolationError as e:
        assert e.kind == "duplicate_request"
    t.admit(1, 1, 16, 0)
    assert t.request_key("x") != t.request_key(1)
    t.release("x")
    t.admit("x", "t", 16, 0)  # a new request under the old name gets a fresh id
    assert t.interned() == (1, 1)
