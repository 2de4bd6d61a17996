"""PD manifests across hosts: ``KVGUARD_SGLANG_PD_CHANNEL=tcp://HOST:PORT`` (kvguard.sglang.pd_net).

SGLang's own prefill and decode schedulers (pd_rig.py: their PD queues and event-loop step
bodies, SGLang's fake transfer backend with a CPU wire), kvguard attached to each as its plugin
attaches it. Each scheduler opens its own channel from the setting, as two servers on two hosts
would: the prefill side listens on loopback, the decode side connects, and the manifests travel
over that TCP connection only (no shared dict, no shared directory). The faults are made on the
prefill side's socket writes: what a broken or hostile peer puts on the wire."""

from __future__ import annotations

import socket
import struct

import pd_rig
import pytest
from kvguard.sglang import pd_net
from scheduler_rig import attach_kvguard, pool_pages
from test_pd_schedulers import CONTEXT, VICTIM, bystanders, incident, sides, unguarded, workload

WAIT = 5.0
"""Seconds a transfer the backend reports done waits for its manifest (the channel's timeout;
10 by default). Short, so that the refusals that wait for it come soon; long enough that a
loaded 2-core machine delivers every manifest in time."""

KEY = "a shared secret of 32 bytes.... "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def net(monkeypatch):
    """The TCP channel on a free loopback port; every channel opened is closed at the end.
    Yields the channels as they are opened (prefill's, then decode's)."""
    port = free_port()
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", f"tcp://127.0.0.1:{port}?timeout={WAIT}")
    monkeypatch.delenv("KVGUARD_SGLANG_PD_KEY", raising=False)
    opened = []
    real_open = pd_net.TcpChannel.open

    def open_(self, side, **kwargs):
        result = real_open(self, side, **kwargs)
        opened.append(self)
        return result

    monkeypatch.setattr(pd_net.TcpChannel, "open", open_)
    yield opened
    for channel in opened:
        channel.close()


def on_the_wire(monkeypatch, fault):
    """Every frame the prefill side writes goes through ``fault(conn, kind, body, write)``;
    ``write(kind, body, mac=None, header=None)`` puts a frame (or any bytes) on the wire."""
    real = pd_net._Conn._write_raw

    def write_raw(self, kind, body, key, seq):
        if self.client or kind == pd_net.HELLO:
            return real(self, kind, body, key, seq)

        def write(kind=kind, body=body, *, raw=None, consume=True):
            if raw is not None:
                self.sock.sendall(raw)
            else:
                real(self, kind, body, key, self._send_seq)
            if not consume:
                self._send_seq -= 1  # the frame was not the sender's: the sequence is not used up

        return fault(self, kind, body, write)

    monkeypatch.setattr(pd_net._Conn, "_write_raw", write_raw)


def room_of(body):
    return struct.unpack_from("<Q", body)[0]


N = 40
VICTIM_ROOM = 1005
VICTIM_RID = None


def run(page_size=16, n=N, **kw):
    prefill, decode = sides(page_size, guard="enforce", **kw)
    start = pool_pages(prefill), pool_pages(decode)
    out = pd_rig.run_pd(prefill, decode, workload(7, n))
    assert (pool_pages(prefill), pool_pages(decode)) == start, "both pools whole at the end"
    return out, prefill, decode


def rid_of_room(room, n=N):
    return next(d.rid for _, d in workload(7, n) if d.bootstrap_room == room)


def aborted(out):
    return {rid for rid, (_, reason) in out.items() if reason["type"] == "abort"}


@pytest.mark.parametrize("page_size", [16, 1])
def test_a_clean_workload_over_tcp_is_served_as_without_kvguard(net, page_size):
    """300 multi-tenant requests, chunked prefill, the manifests over TCP only: every transfer
    accepted, every output the unguarded run's, no violation, both pools whole, no frame lost."""
    n = 300
    ref, *_ = unguarded(page_size, n)
    out, prefill, decode = run(page_size, n)
    assert out == ref
    assert prefill.kvguard.violations == [] and decode.kvguard.violations == []
    assert decode.kvguard.metrics["transfers_accepted"] == n and decode.kvguard.metrics["transfers_refused"] == 0
    p_chan, d_chan = prefill.kvguard_pd_channel, decode.kvguard_pd_channel
    assert isinstance(p_chan, pd_net.TcpChannel) and p_chan.side == "prefill" and d_chan.side == "decode"
    assert net == [p_chan, d_chan] and p_chan is not d_chan
    assert dict(p_chan.metrics) == {} and dict(d_chan.metrics) == {}
    assert d_chan._rooms == {} and p_chan._offers == {} and p_chan._deferred == {}, "nothing left pending"


def test_a_quiet_connection_outlives_the_timeout(net):
    """After a first transfer, the decode side offers the next, then nothing moves for longer than
    the channel's timeout (a long prefill queue): the connection stays, the transfer is accepted when it comes and served as
    without kvguard. The timeout bounds only the wait after the backend reported the transfer."""
    import time

    ref, *_ = unguarded(16, N)
    prefill, decode = sides(16, guard="enforce")
    first, (p_req, d_req), *rest = workload(7, N)
    pd_rig.run_pd(prefill, decode, [first])  # frames have gone both ways
    decode.published.restore()
    decode.handle_generate_request(d_req)
    deadline = time.monotonic() + 10
    while d_req.bootstrap_room not in prefill.kvguard_pd_channel._offers:
        assert time.monotonic() < deadline, "the offer reached the prefill side"
        pd_rig.decode_step(decode)
    time.sleep(1.5 * WAIT)
    prefill.published.restore()
    prefill.handle_generate_request(p_req)
    out = pd_rig.run_pd(prefill, decode, rest)
    assert out == ref and decode.kvguard.metrics["transfers_accepted"] == N
    assert dict(decode.kvguard_pd_channel.metrics) == {}


def test_the_one_token_stub_is_refused_over_tcp(net):
    """The incident over the network channel: the prefill side runs the one-token stub and its
    manifest says so; decode refuses the transfer before any batch reads it; only it."""
    ref, *_ = incident(stub=True)
    out, prefill, decode, batches = incident(stub=True, guard="enforce")
    ids, reason = out[VICTIM]
    assert ids == [] and reason["type"] == "abort" and "kvguard" in reason["message"]
    assert not any(VICTIM in b for b in batches)
    assert list(decode.kvguard.aborted) == [VICTIM]
    assert {v.kind for v in decode.kvguard.violations} <= {"token_count_mismatch", "prompt_digest_mismatch"}
    assert bystanders(out) == bystanders(ref)


def test_the_prefill_side_down_refuses_every_transfer(net, monkeypatch):
    """The decode side's channel names a port nobody listens on (the prefill server is down or
    unreachable): no manifest can come, so every transfer is refused once the backend reports it,
    none served unchecked, both pools whole."""
    port = free_port()
    prefill, _ = sides(16)
    attach_kvguard(prefill, "enforce")
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", f"tcp://127.0.0.1:{port}?timeout={WAIT}")
    decode = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32)
    attach_kvguard(decode, "enforce")
    start = pool_pages(prefill), pool_pages(decode)
    out = pd_rig.run_pd(prefill, decode, workload(7, 12))
    assert aborted(out) == set(out) and len(out) == 12
    assert all("cannot reach the prefill side" in reason["message"] for _, reason in out.values())
    assert decode.kvguard.metrics["transfers_accepted"] == 0 and decode.kvguard.metrics["transfers_refused"] == 12
    assert (pool_pages(prefill), pool_pages(decode)) == start


def test_the_prefill_side_going_down_refuses_what_waits_on_it(net, monkeypatch):
    """The prefill side's channel closes after the fifth manifest it sends: the transfers waiting
    for a manifest on that connection are refused at once; the decode side reconnects for later
    ones, which the prefill side (down) never answers: refused too. Nothing is served unchecked,
    and what was accepted before is served as without kvguard."""
    ref, *_ = unguarded(16, N)
    sent = []

    def fault(conn, kind, body, write):
        if kind == pd_net.MANIFEST:
            sent.append(room_of(body))
            if len(sent) == 5:
                conn.channel.close()
                return None
        return write()

    on_the_wire(monkeypatch, fault)
    out, _, decode = run()
    served = set(out) - aborted(out)
    assert len(served) == 4 and all(out[rid] == ref[rid] for rid in served)
    assert all("kvguard refused the KV transfer" in out[rid][1]["message"] for rid in aborted(out))
    assert decode.kvguard.metrics["transfers_accepted"] == 4


@pytest.mark.parametrize(
    "fault,refusal,metric",
    [
        ("wrong_mac", "arrived without a manifest", "frames_bad_mac"),
        ("oversized", "arrived without a manifest", "frames_oversized"),
        ("not_a_manifest", "manifest", None),
    ],
)
def test_a_bad_frame_refuses_its_transfer_only(net, monkeypatch, fault, refusal, metric):
    """The victim's manifest frame is replaced on the wire: its MAC wrong (a frame forged or
    corrupted), a length over the cap (read past in pieces, never held), or a well-formed frame
    whose bytes are no manifest. The frame is dropped (or refused by the manifest check), the
    stream stays in step: only the victim is refused, every other request is served as without
    kvguard."""
    ref, *_ = unguarded(16, N)
    victim = rid_of_room(VICTIM_ROOM)

    def on_frame(conn, kind, body, write):
        if kind != pd_net.MANIFEST or room_of(body) != VICTIM_ROOM:
            return write()
        if fault == "wrong_mac":
            header = struct.pack("<4sBBHI", b"KVGP", 1, kind, 0, len(body))
            return write(raw=header + body + b"\x00" * 32, consume=False)
        if fault == "oversized":
            length = pd_net.MAX_BODY + 1
            header = struct.pack("<4sBBHI", b"KVGP", 1, kind, 0, length)
            return write(raw=header + bytes(length + 32), consume=False)
        return write(body=body[:8] + b"KVGM" + bytes(60))

    on_the_wire(monkeypatch, on_frame)
    out, prefill, decode = run()
    assert aborted(out) == {victim}
    assert refusal in out[victim][1]["message"] and "kvguard" in out[victim][1]["message"]
    assert {r: o for r, o in out.items() if r != victim} == {r: o for r, o in ref.items() if r != victim}
    assert list(decode.kvguard.aborted) == [victim] and decode.kvguard.metrics["transfers_refused"] == 1
    if metric:
        assert decode.kvguard_pd_channel.metrics[metric] == 1
    else:
        assert [v.kind for v in decode.kvguard.violations] == ["manifest_corrupt"]


def test_a_malformed_header_closes_the_connection(net, monkeypatch):
    """A header that is not one (wrong magic): the stream cannot be read on, so the decode side
    closes the connection and refuses every transfer still waiting for a manifest on it (the
    victim and every room offered on it whose manifest had not come: their manifests might have
    been in the stream); later transfers go over a new connection and are served. Nothing is
    served unchecked or wrong."""
    ref, *_ = unguarded(16, N)
    victim = rid_of_room(VICTIM_ROOM)

    def on_frame(conn, kind, body, write):
        if kind == pd_net.MANIFEST and room_of(body) == VICTIM_ROOM:
            return write(raw=b"JUNK" + bytes(40), consume=False)
        return write()

    on_the_wire(monkeypatch, on_frame)
    out, prefill, decode = run()
    refused = aborted(out)
    assert victim in refused and all("connection to the prefill side was lost" in out[r][1]["message"] for r in refused)
    room = {d.rid: d.bootstrap_room for _, d in workload(7, N)}
    assert max(room[r] for r in set(out) - refused) > max(room[r] for r in refused), "a new connection serves"
    assert decode.kvguard.metrics["transfers_accepted"] == N - len(refused)
    assert all(out[r] == ref[r] for r in set(out) - refused)
    assert decode.kvguard_pd_channel.metrics["connections_lost"] == 1


def test_a_manifest_for_a_room_never_offered_is_dropped(net, monkeypatch):
    """The prefill side sends a manifest for a room the decode side never asked for (with the
    victim's): it is dropped and counted, held nowhere; every request is served as without
    kvguard."""
    ref, *_ = unguarded(16, N)

    def on_frame(conn, kind, body, write):
        if kind == pd_net.MANIFEST and room_of(body) == VICTIM_ROOM:
            write(body=struct.pack("<Q", 424242) + body[8:])
            conn._send_seq += 1
        return write()

    on_the_wire(monkeypatch, on_frame)
    out, prefill, decode = run()
    assert out == ref
    assert decode.kvguard.violations == [] and decode.kvguard_pd_channel.metrics["manifests_unexpected"] == 1
    assert decode.kvguard_pd_channel._rooms == {}


def test_a_wrong_key_refuses_every_transfer(net, monkeypatch):
    """The two sides hold different secrets: the hello fails, no frame of the peer is believed,
    every transfer is refused; none served unchecked."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", KEY)
    prefill, _ = sides(16)
    attach_kvguard(prefill, "enforce")
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", KEY.replace("secret", "SECRET"))
    decode = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32)
    attach_kvguard(decode, "enforce")
    out = pd_rig.run_pd(prefill, decode, workload(7, 8))
    assert aborted(out) == set(out) and len(out) == 8
    assert all("kvguard refused the KV transfer" in reason["message"] for _, reason in out.values())
    assert decode.kvguard.metrics["transfers_accepted"] == 0
    assert prefill.kvguard_pd_channel.metrics["handshakes_failed"] >= 1


def test_the_same_key_on_both_sides_serves(net, monkeypatch):
    """With the shared secret set on both sides the workload is served as without kvguard."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", KEY)
    ref, *_ = unguarded(16, N)
    out, _, decode = run()
    assert out == ref and decode.kvguard.metrics["transfers_accepted"] == N


def test_the_decode_side_bounds_what_it_holds(net, monkeypatch):
    """A decode side that may hold two waiting rooms: rooms past the cap are refused (never
    accepted unchecked), the others served as without kvguard."""
    ref, *_ = unguarded(16, N)
    real_open = pd_net.TcpChannel.open

    def small(self, side, **kwargs):
        if side == "decode":
            self.max_pending = 2
        return real_open(self, side, **kwargs)

    monkeypatch.setattr(pd_net.TcpChannel, "open", small)
    out, _, decode = run()
    refused = aborted(out)
    assert refused and all("too many" in out[r][1]["message"] for r in refused)
    assert all(out[r] == ref[r] for r in set(out) - refused)
    assert decode.kvguard.metrics["transfers_accepted"] == N - len(refused)


def test_enforce_refuses_a_channel_off_loopback_without_a_key(net, monkeypatch):
    """Off loopback, anyone who reaches the port could send manifests: under enforce a PD
    scheduler with no shared secret does not start; with one it does; under report it starts."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", f"tcp://0.0.0.0:{free_port()}")
    pd_rig.install_wire()
    build = lambda: pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)  # noqa: E731
    with pytest.raises(RuntimeError, match="KVGUARD_SGLANG_PD_KEY is not set"):
        attach_kvguard(build(), "enforce")
    assert attach_kvguard(build(), "report").policy == "report"
    net[-1].close()
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", KEY)
    s = build()
    attach_kvguard(s, "enforce")
    assert s.kvguard_pd_channel.side == "prefill"


@pytest.mark.parametrize(
    "value,match",
    [
        ("tcp://127.0.0.1", "is not tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", "is not tcp://HOST:PORT"),
        ("tcp://127.0.0.1:99999", "Port out of range"),
        ("tcp://127.0.0.1:7000?timeout=soon", "not a number"),
        ("tcp://127.0.0.1:7000?key=x", "unknown option"),
        ("tpc://127.0.0.1:7000", "not process, tcp://HOST:PORT or an absolute directory"),
        ("channel-dir", "not process, tcp://HOST:PORT or an absolute directory"),
    ],
)
def test_a_bad_channel_setting_stops_the_start(monkeypatch, value, match):
    """A mistyped channel does not start a PD scheduler under enforce, naming the setting."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", value)
    pd_rig.install_wire()
    s = pd_rig.build_decode(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)
    with pytest.raises(RuntimeError, match=match):
        attach_kvguard(s, "enforce")


def test_a_short_key_stops_the_start(net, monkeypatch):
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", "short")
    pd_rig.install_wire()
    s = pd_rig.build_prefill(page_size=16, tokens=2560, rows=24, context_len=CONTEXT)
    with pytest.raises(RuntimeError, match="at least 16 bytes"):
        attach_kvguard(s, "enforce")


# ---- two processes: nothing shared but the channel's TCP connection (and the test's KV wire) -------


@pytest.mark.parametrize("secret", ["same", "other"])
def test_two_processes_prefill_and_decode_over_tcp(net, monkeypatch, tmp_path, secret):
    """The prefill scheduler runs in another process (pd_prefill_proc.py) and listens; this
    process's decode scheduler connects. The KV moves through the wire directory (the test's
    stand-in for the backend: files of page bytes the decode side lands); the manifests only
    over the TCP channel, with the shared secret. Every transfer accepted, the outputs of the
    unguarded in-process run, no violation on either side, both pools whole, nothing left
    pending on either side. With another secret in the prefill process, every transfer is
    refused (none served unchecked), the pools whole."""
    import json
    import os
    import subprocess
    import sys
    import time

    n = 40
    ref, *_ = unguarded(16, n)
    monkeypatch.setenv("KVGUARD_SGLANG_PD_KEY", KEY)
    env = dict(os.environ, KVGUARD_SGLANG_PD_KEY=KEY if secret == "same" else KEY.upper())
    child = subprocess.Popen(
        [sys.executable, "pd_prefill_proc.py", str(tmp_path), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        first = child.stdout.readline()
        assert first, child.stderr.read()[-3000:]
        pd_rig.install_wire(str(tmp_path))
        decode = pd_rig.build_decode(
            page_size=16, tokens=2560, rows=24, context_len=CONTEXT, num_reserved_decode_tokens=32,
        )
        attach_kvguard(decode, "enforce")
        start = pool_pages(decode)
        pending = [d for _, d in workload(7, n)]
        deadline = time.monotonic() + 300
        while len(pd_rig.rig.finished(decode)) < n or not pd_rig.idle(decode):
            assert time.monotonic() < deadline, "the two processes did not finish the workload"
            for req in pending[:4]:
                decode.published.restore()
                decode.handle_generate_request(req)
            del pending[:4]
            pd_rig.decode_step(decode)
        metrics, rooms = dict(decode.kvguard_pd_channel.metrics), dict(decode.kvguard_pd_channel._rooms)
        (tmp_path / "stop").write_text("")
        out_text, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-3000:]
    seen = json.loads(out_text.strip().splitlines()[-1])
    out = pd_rig.rig.finished(decode)
    assert pool_pages(decode) == start and seen["pages"][0] == seen["pages"][1]
    if secret == "other":
        assert aborted(out) == set(out) and len(out) == n
        assert all("kvguard refused the KV transfer" in reason["message"] for _, reason in out.values())
        assert decode.kvguard.metrics["transfers_accepted"] == 0 and seen["channel"]["handshakes_failed"] >= 1
        return
    assert out == ref
    assert decode.kvguard.violations == [] and seen["violations"] == []
    assert decode.kvguard.metrics["transfers_accepted"] == n
    assert pool_pages(decode) == start and seen["pages"][0] == seen["pages"][1]
    assert metrics == {} and rooms == {} and seen["channel"] == {} and seen["offers_left"] == 0
