"""Transfer manifests and the receiver; the trace recorder and replayer."""

import pytest

import kvguard


def decode_side():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(64, 4, 64))
    t.admit("req-7", "acme", 5, 0)
    dest = t.allocate("req-7", 2)
    return t, dest


def test_manifest_round_trip_and_accept():
    t, dest = decode_side()
    prompt = [11, 12, 13, 14, 15]
    pages = [bytes(range(8)), bytes([9, 10])]  # 4 tokens x 2 bytes, then 1 token
    m = kvguard.Manifest.build(t.request_key("req-7"), t.tenant_key("acme"), 3, 4, 2, prompt, dest, pages)
    assert (m.prompt_tokens, m.page_size, m.slot_bytes, m.sender) == (5, 4, 2, 3)
    assert m.prompt_digest == kvguard.prompt_digest(prompt)
    assert [e[2] for e in m.pages] == [kvguard.page_checksum(p) for p in pages]
    wire = m.encode()
    assert kvguard.Manifest.decode(wire) == m and "Manifest(" in repr(m)
    landed = []
    got = kvguard.Receiver(t).accept(
        "req-7", "acme", prompt, dest, wire, pages, slot_bytes=2, sender=3,
        land=lambda i, r, b: landed.append((i, r.page, b)),
    )
    assert (got.tokens, got.pages) == (5, 2) and [x[2] for x in landed] == pages
    t.verify_read("req-7", [r.page for r in dest], 5)


def test_receiver_fails_closed():
    t, dest = decode_side()
    prompt = [11, 12, 13, 14, 15]
    pages = [bytes(range(8)), bytes([9, 10])]
    wire = kvguard.Manifest.build(t.request_key("req-7"), t.tenant_key("acme"), 3, 4, 2, prompt, dest, pages).encode()
    rx = kvguard.Receiver(t)
    with pytest.raises(kvguard.TransferError) as e:
        rx.accept("req-7", "acme", prompt, dest, wire, [bytes(8), bytes([9, 10])], slot_bytes=2)
    assert e.value.kind == "page_checksum_mismatch" and e.value.violation.kind == "page_checksum_mismatch"
    with pytest.raises(kvguard.TransferError) as e:
        rx.accept("req-7", "acme", [1, 2, 3, 4, 5], dest, wire, pages, slot_bytes=2)
    assert e.value.kind == "prompt_digest_mismatch"
    with pytest.raises(kvguard.TransferError) as e:
        rx.accept("req-7", "acme", prompt, dest, wire[:-3], pages, slot_bytes=2)
    assert e.value.kind == "manifest_corrupt"
    with pytest.raises(kvguard.TransferError) as e:
        kvguard.Manifest.decode(b"garbage")
    assert e.value.kind == "manifest_corrupt"
    with pytest.raises(kvguard.TransferError):
        kvguard.Manifest.build(1, 1, 1, 4, 2, prompt, dest, pages[:1])
    assert t.counters()["page_checksum_mismatch"] == 1
    assert t.request_info("req-7").quarantined


def test_recorder_v1_1_events():
    rec = kvguard.Recorder()
    rec.pool(kvguard.PoolConfig(64, 16, 512, reserved=[0]))
    rec.grant("acme", True)
    rec.admit(1, "acme", 16, 0)
    rec.alloc(1, [5])
    rec.write(1, 5, 0, 16)
    rec.share(1, "k", [5])
    rec.admit(2, "globex", 16, 0)
    rec.attach(2, "k")
    rec.detach(2, "k")
    rec.grant("acme", False)
    rec.preempt(1)
    rec.free(2)
    rec.end()
    rec.end()  # once
    text = rec.text()
    assert text.count('"ev":"end"') == 1
    for ev in ("grant", "revoke", "detach", "preempt"):
        assert f'"ev":"{ev}"' in text
    r = kvguard.Replayer()
    assert r.replay(text) == []
    scrubbed = kvguard.Recorder()
    scrubbed.scrub([5])
    assert '"ev":"scrub"' in scrubbed.text()


def test_recorder_and_replayer():
    rec = kvguard.Recorder()
    rec.pool(kvguard.PoolConfig(64, 16, 512, reserved=[0]))
    rec.admit(1, "acme", 20, 8)
    rec.alloc(1, [5, 6])
    rec.write(1, 5, 0, 16)
    rec.read(1, [5, 6], 20)
    rec.comment("done")
    rec.free(1)
    assert rec.events == 6  # the pool event counts
    with pytest.raises(kvguard.TraceError, match="truncated"):
        kvguard.Replayer().replay(rec.text())
    rec.end()
    found = kvguard.Replayer().replay(rec.text())
    assert [(v.line, v.kind, v.page, v.tenant) for v in found] == [(5, "unwritten_slots", 6, "acme")]
    assert found[0].as_dict()["kind"] == "unwritten_slots" and "unwritten_slots" in str(found[0])
    r = kvguard.Replayer()
    assert [r.feed_line(line) for line in rec.text().splitlines()][4].kind == "unwritten_slots"
    assert r.summary()["by_kind"] == {"unwritten_slots": 1}
    with pytest.raises(kvguard.TraceError) as e:
        kvguard.Replayer().replay('{"ev":"admit","req":1,"tenant":"a","prompt":1,"max_new":1}\n')
    assert e.value.line == 1
