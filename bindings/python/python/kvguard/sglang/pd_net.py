"""PD manifests across hosts: :class:`TcpChannel` (``KVGUARD_SGLANG_PD_CHANNEL=tcp://HOST:PORT``).

The prefill scheduler listens on ``HOST:PORT``; the decode scheduler connects to it. Per
``bootstrap_room`` the decode side sends an *offer* (its destination pages with their
generations, and the request and tenant ids, what :class:`kvguard.sglang.GuardedKVReceiver`
puts on a channel); the prefill side answers on the same connection with the encoded manifest
(or with *no manifest* and a reason). Nothing else is sent.

Wire (every integer little-endian; never pickle, only the fields below are read):

``frame = header(12) | body(length) | mac(32)``, header ``"KVGP" | version u8 = 1 | type u8 |
flags u16 = 0 | length u32``; ``mac = HMAC-SHA256(direction key, header | seq u64 | body)``,
``seq`` counting the frames of that direction on that connection from 0. Types:

- ``HELLO`` (each side, first): a 16-byte random nonce, MACed with the hello key. Each direction's
  key is ``HMAC-SHA256(K, label | client nonce | server nonce)``, ``K`` the shared secret
  (``KVGUARD_SGLANG_PD_KEY``; empty when none is set, allowed on loopback only under enforce), so
  a frame of one connection or direction is never accepted on another.
- ``OFFER`` (decode to prefill): ``room u64 | request i64 | tenant i64 | n u32 | n x (page u32,
  generation u32)``, ``n <= 2^20``.
- ``MANIFEST`` (prefill to decode): ``room u64 | manifest bytes`` (checked by
  :class:`kvguard.Receiver` as every manifest is).
- ``NOMANIFEST`` (prefill to decode): ``room u64 | reason`` (UTF-8, at most 1 KiB).

Fail closed: a frame over :data:`MAX_BODY` is read past in bounded pieces and dropped; a frame
whose MAC does not verify is dropped; both leave the stream in step, and the room they named
(unknown: nothing in them is believed) gets no manifest, so its transfer is refused when its
wait ends. A header that is not one (magic, version, flags, type), a body of the wrong shape, a
failed hello or a peer gone closes the connection: every transfer that still waits for a
manifest on it is refused at once. A manifest for a room the decode side is not waiting for is
dropped and counted. Memory is bounded: at most ``max_pending`` rooms and ``max_pending_bytes``
bytes held on either side; past that a new room is refused (decode) or its offer dropped
(prefill: the decode side is told, and refuses).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable

from .. import ConfigError

logger = logging.getLogger("sglang.srt.kvguard")

ENV_KEY = "KVGUARD_SGLANG_PD_KEY"
"""The shared secret both sides' :class:`TcpChannel` MAC every frame with (at least 16 bytes)."""

MAGIC = b"KVGP"
VERSION = 1
HELLO, OFFER, MANIFEST, NOMANIFEST = 1, 2, 3, 4
_HEADER = struct.Struct("<4sBBHI")
_MAC = 32
_NONCE = 16
MAX_PAGES = 1 << 20
"""The manifest format's page cap (``MAX_MANIFEST_PAGES``)."""
MAX_BODY = 8 + 64 + 16 * MAX_PAGES + 4
"""The largest frame body: a room and a manifest of :data:`MAX_PAGES` pages."""
_OFFER_HEAD = struct.Struct("<QqqI")
_ROOM = struct.Struct("<Q")
_SEQ = struct.Struct("<Q")
_MAX_REASON = 1024


class FrameError(Exception):
    """The stream cannot be read on: the connection is closed."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Conn:
    """One TCP connection after its hello: framed, MACed reads and writes. Writes go through a
    bounded queue to a writer thread (the scheduler never blocks on the network); a reader thread
    hands each verified frame to ``on_frame`` and, when the stream ends, calls ``on_close`` once."""

    def __init__(self, channel: TcpChannel, sock: socket.socket, *, client: bool) -> None:
        self.channel = channel
        self.sock = sock
        self.client = client
        self.alive = True
        self.reason = ""
        self._out: queue.Queue = queue.Queue(maxsize=4096)
        self._send_key = b""
        self._recv_key = b""
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    # ---- the handshake ----------------------------------------------------------------------

    def handshake(self) -> None:
        """Both nonces exchanged, each MACed with the hello key; the direction keys derived."""
        key = self.channel.key
        hello = hmac.new(key, b"kvguard-pd hello", hashlib.sha256).digest()
        mine = secrets.token_bytes(_NONCE)
        self.sock.settimeout(self.channel.connect_timeout)
        self._write_raw(HELLO, mine, hello, 0)
        kind, theirs = self._read_frame(hello, 0)
        if kind != HELLO or theirs is None or len(theirs) != _NONCE:
            raise FrameError("the peer's hello is not one (another secret?)")
        nonces = mine + theirs if self.client else theirs + mine
        c2s = hmac.new(key, b"kvguard-pd c2s" + nonces, hashlib.sha256).digest()
        s2c = hmac.new(key, b"kvguard-pd s2c" + nonces, hashlib.sha256).digest()
        self._send_key, self._recv_key = (c2s, s2c) if self.client else (s2c, c2s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    # ---- frames -----------------------------------------------------------------------------

    def _recv_exact(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise FrameError("the peer closed the connection")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _write_raw(self, kind: int, body: bytes, key: bytes, seq: int) -> None:
        header = _HEADER.pack(MAGIC, VERSION, kind, 0, len(body))
        mac = hmac.new(key, header + _SEQ.pack(seq) + body, hashlib.sha256).digest()
        self.sock.sendall(header + body + mac)

    def _read_frame(self, key: bytes, seq: int) -> tuple[int, bytes | None]:
        """The next frame: ``(type, body)``; body None for one dropped (oversized, or its MAC
        does not verify). Raises :class:`FrameError` when the stream cannot be read on."""
        magic, version, kind, flags, length = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if magic != MAGIC or version != VERSION or flags != 0 or kind not in (HELLO, OFFER, MANIFEST, NOMANIFEST):
            raise FrameError("malformed frame header")
        if length > MAX_BODY:
            remaining = length + _MAC
            while remaining:
                remaining -= len(self._recv_exact(min(remaining, 1 << 20)))
            self.channel._count("frames_oversized")
            return kind, None
        header = _HEADER.pack(magic, version, kind, flags, length)
        body = self._recv_exact(length)
        mac = self._recv_exact(_MAC)
        want = hmac.new(key, header + _SEQ.pack(seq) + body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            self.channel._count("frames_bad_mac")
            return kind, None
        return kind, body

    def send(self, kind: int, body: bytes) -> bool:
        """Queues a frame; False when the connection is gone or its queue is full."""
        if not self.alive:
            return False
        try:
            self._out.put_nowait((kind, body))
        except queue.Full:
            return False
        return True

    def start(self, on_frame: Callable[[_Conn, int, bytes], None], on_close: Callable[[_Conn], None]) -> None:
        threading.Thread(target=self._reader, args=(on_frame, on_close), name="kvguard-pd-read", daemon=True).start()
        threading.Thread(target=self._writer, name="kvguard-pd-write", daemon=True).start()

    def _writer(self) -> None:
        while True:
            item = self._out.get()
            if item is None or not self.alive:
                return
            kind, body = item
            try:
                # Blocking: a peer that stops reading fills the queue, and the rooms that cannot
                # be queued are refused (the scheduler never waits on it). No socket timeout after
                # the hello: it would also end the reader's wait on a quiet connection.
                self._write_raw(kind, body, self._send_key, self._send_seq)
                self._send_seq += 1
            except OSError as e:
                self.close(f"write failed: {e}")
                return

    def _reader(self, on_frame: Callable[[_Conn, int, bytes], None], on_close: Callable[[_Conn], None]) -> None:
        try:
            while self.alive:
                kind, body = self._read_frame(self._recv_key, self._recv_seq)
                if body is None:
                    continue  # dropped: nothing in it is believed; its sequence number is not used up
                self._recv_seq += 1
                on_frame(self, kind, body)
        except Exception as e:  # noqa: BLE001 - a stream that cannot be read on is closed
            if self.alive:
                self.channel._count("connections_lost")
                self.close(str(e))
        finally:
            on_close(self)

    def close(self, reason: str = "closed") -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            self.reason = reason
        try:
            self._out.put_nowait(None)
        except queue.Full:
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _Room:
    """What the decode side knows of one room it offered."""

    __slots__ = ("conn", "dest", "ids", "manifest", "failure", "at")

    def __init__(self, dest: Any) -> None:
        self.conn: _Conn | None = None
        self.dest = dest
        self.ids: Any = None
        self.manifest: bytes | None = None
        self.failure: str | None = None
        self.at = time.monotonic()


class TcpChannel:
    """The manifest channel across hosts (see the module docstring). ``open("prefill")`` listens on
    the address, ``open("decode")`` connects to it (on the first offer, from a background thread;
    again after a connection was lost). The channel methods are those of
    :class:`kvguard.sglang.ManifestChannel` (``put``/``get``/``drop``), plus :meth:`defer` (the
    prefill side: build the manifest when the offer comes), :meth:`failure` and :attr:`wait`
    (the decode side: how long a transfer the backend reports done waits for its manifest)."""

    def __init__(
        self, url: str, *, timeout: float = 10.0, key: bytes | None = None,
        max_pending: int = 4096, max_pending_bytes: int = 256 << 20,
    ) -> None:
        from urllib.parse import parse_qs, urlsplit

        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError as e:
            raise ConfigError(f"kvguard: PD channel {url!r}: {e}") from e
        if parts.scheme != "tcp" or not parts.hostname or not port or parts.path not in ("", "/"):
            raise ConfigError(f"kvguard: PD channel {url!r} is not tcp://HOST:PORT[?timeout=SECONDS]")
        query = parse_qs(parts.query, strict_parsing=False)
        if set(query) - {"timeout"}:
            raise ConfigError(f"kvguard: PD channel {url!r}: unknown option(s) {sorted(set(query) - {'timeout'})}")
        if "timeout" in query:
            try:
                timeout = float(query["timeout"][-1])
            except ValueError as e:
                raise ConfigError(f"kvguard: PD channel {url!r}: timeout is not a number of seconds") from e
            if not 0 < timeout <= 3600:
                raise ConfigError(f"kvguard: PD channel {url!r}: timeout must be in (0, 3600] seconds")
        self.url = url
        self.host = parts.hostname
        self.port = int(port)
        self.timeout = float(timeout)
        self.wait = self.timeout
        """Seconds a transfer the backend reports done waits for its manifest (then refused)."""
        self.connect_timeout = max(10.0, self.timeout)
        """Seconds a connection and its hello may take (a loaded host must not refuse the rooms
        waiting on a new connection)."""
        if key is None:
            secret = os.environ.get(ENV_KEY, "")
            if secret and len(secret.encode()) < 16:
                raise ConfigError(f"kvguard: {ENV_KEY} must be at least 16 bytes")
            key = secret.encode()
        self.key = key
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.ttl = 3600.0
        """Seconds after which a room neither side finished is forgotten (a leak's bound; a room
        forgotten on the decode side is refused)."""
        self.side: str | None = None
        self.metrics: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        # decode side
        self._rooms: dict[int, _Room] = {}
        self._conn: _Conn | None = None
        self._connecting: list[int] | None = None
        self._pending_bodies: dict[int, bytes] = {}
        """Offers made while the connection is being opened (sent once it is)."""
        self._bytes = 0
        # prefill side
        self._offers: dict[int, tuple[_Conn, Any, Any, float, int]] = {}
        self._deferred: dict[int, tuple[Callable[[Any, Any], bytes | None], float, int]] = {}

    def __repr__(self) -> str:
        return f"TcpChannel({self.url!r}, side={self.side})"

    def _count(self, name: str) -> None:
        self.metrics[name] += 1

    # ---- start -------------------------------------------------------------------------------

    def open(self, side: str, *, policy: str = "enforce") -> TcpChannel:
        """Takes this channel's side. ``prefill`` binds and listens now (an address it cannot
        bind raises :class:`kvguard.ConfigError`); ``decode`` connects when it first offers.
        Under enforce an address that is not loopback needs the shared secret (``KVGUARD_SGLANG_PD_KEY``)."""
        if side not in ("prefill", "decode"):
            raise ConfigError(f"kvguard: a PD channel's side is prefill or decode, not {side!r}")
        if self.side is not None:
            if self.side != side:
                raise ConfigError(f"kvguard: PD channel {self.url!r} is already the {self.side} side")
            return self
        if not self.key and not _is_loopback(self.host):
            message = (
                f"kvguard: PD channel {self.url!r} is not on loopback and {ENV_KEY} is not set: "
                "anyone who reaches the port could send manifests"
            )
            if policy == "enforce":
                raise ConfigError(message)
            logger.warning("%s (report mode: served anyway)", message)
        if side == "prefill":
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                family, _, _, _, addr = infos[0]
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(addr)
                listener.listen(64)
            except OSError as e:
                raise ConfigError(f"kvguard: PD channel {self.url!r}: cannot listen: {e}") from e
            self._listener = listener
            threading.Thread(target=self._accept, name="kvguard-pd-accept", daemon=True).start()
        self.side = side
        return self

    def close(self) -> None:
        """Stops listening and closes every connection (the transfers waiting on them are refused)."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close("the channel was closed")

    # ---- the prefill side: offers in, manifests out --------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None and self._listener is listener:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="kvguard-pd-hello", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(self, sock, client=False)
        try:
            conn.handshake()
        except Exception as e:  # noqa: BLE001 - any failed hello closes the connection
            self._count("handshakes_failed")
            logger.warning("kvguard: PD channel %s: a peer's hello failed (%s); connection closed", self.url, e)
            conn.close(str(e))
            return
        with self._lock:
            self._conns.add(conn)
        conn.start(self._on_prefill_frame, self._on_close)

    def _on_prefill_frame(self, conn: _Conn, kind: int, body: bytes) -> None:
        if kind != OFFER or len(body) < _OFFER_HEAD.size:
            raise FrameError(f"unexpected frame type {kind} from the decode side")
        room, request, tenant, n = _OFFER_HEAD.unpack_from(body)
        if n > MAX_PAGES or len(body) != _OFFER_HEAD.size + 8 * n:
            raise FrameError("malformed offer")
        flat = struct.unpack_from(f"<{2 * n}I", body, _OFFER_HEAD.size)
        dest = [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]
        ids = (request, tenant)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            build = self._deferred.pop(room, None)
            if build is None:
                used = sum(entry[4] for entry in self._offers.values())
                if len(self._offers) >= self.max_pending or used + len(body) > self.max_pending_bytes:
                    self._count("offers_dropped")
                    conn.send(NOMANIFEST, _ROOM.pack(room) + b"the prefill side holds too many pending offers")
                    return
                self._offers[room] = (conn, dest, ids, now, len(body))
                return
        self._send_built(conn, room, build[0], dest, ids)

    def _send_built(self, conn: _Conn, room: int, build: Callable[[Any, Any], bytes | None], dest: Any, ids: Any) -> None:
        try:
            manifest = build(dest, ids)
        except Exception as e:  # noqa: BLE001 - a manifest that cannot be built is refused on decode
            self._count("manifests_not_built")
            logger.warning("kvguard: no manifest for room %s (%s); the decode side will refuse the transfer", room, e)
            conn.send(NOMANIFEST, _ROOM.pack(room) + str(e).encode()[:_MAX_REASON])
            return
        if manifest is None:  # more pages to come: the offer waits for the sender's next send
            with self._lock:
                self._offers[room] = (conn, dest, ids, time.monotonic(), 0)
            return
        if not conn.send(MANIFEST, _ROOM.pack(room) + manifest):
            self._count("manifests_undelivered")

    def _expire(self, now: float) -> None:
        """Drops offers and deferred builds older than :attr:`ttl` (a request that ended on one
        side without its transfer); the caps bound what is held meanwhile."""
        for table in (self._offers, self._deferred):
            for room in [r for r, entry in table.items() if now - entry[-2] > self.ttl]:
                del table[room]
                self._count("rooms_expired")

    def defer(self, room: int, build: Callable[[Any, Any], bytes | None], nbytes: int = 0) -> None:
        """The prefill side sent a transfer's pages before the decode side's offer reached it:
        ``build(dest, ids)`` makes the manifest when the offer comes (None: not all pages sent
        yet). The offer may also be here already: then it is built now."""
        room = int(room)
        with self._lock:
            offer = self._offers.pop(room, None)
            if offer is None:
                self._expire(time.monotonic())
                used = sum(entry[2] for entry in self._deferred.values())
                if room not in self._deferred and (
                    len(self._deferred) >= self.max_pending or used + nbytes > self.max_pending_bytes
                ):
                    self._count("manifests_dropped")
                    logger.warning("kvguard: PD channel %s: too many transfers waiting for an offer; room %s dropped",
                                   self.url, room)
                    return
                self._deferred[room] = (build, time.monotonic(), nbytes)
                return
        self._send_built(offer[0], room, build, offer[1], offer[2])

    # ---- the channel API -------------------------------------------------------------------------

    def put(self, room: int, field: str, value: Any) -> None:
        """``dest`` / ``ids`` (decode: the offer, sent once both are set) or ``manifest`` (prefill:
        sent on the connection the room's offer came on; None sends *no manifest*)."""
        room = int(room)
        if field == "manifest":
            with self._lock:
                offer = self._offers.pop(room, None)
                if offer is None:
                    if value is None:
                        self._deferred[room] = (_no_manifest, time.monotonic(), 0)
                    else:
                        self._count("manifests_dropped")
                    return
            conn = offer[0]
            if value is None:
                conn.send(NOMANIFEST, _ROOM.pack(room) + b"the prefill side built no manifest")
            elif not conn.send(MANIFEST, _ROOM.pack(room) + bytes(value)):
                self._count("manifests_undelivered")
            return
        if field == "dest":
            with self._lock:
                now = time.monotonic()
                for stale in [r for r, st in self._rooms.items() if now - st.at > self.ttl]:
                    self._bytes -= len(self._rooms.pop(stale).manifest or b"")
                    self._count("rooms_expired")
                old = self._rooms.pop(room, None)
                if old is not None:
                    self._bytes -= len(old.manifest or b"")
                state = self._rooms[room] = _Room(value)
                if len(self._rooms) > self.max_pending:
                    state.failure = "the decode side waits for too many manifests"
                    self._count("rooms_refused")
            return
        if field == "ids":
            with self._lock:
                state = self._rooms.get(room)
                if state is None or state.failure is not None:
                    return
                state.ids = value
            dest = state.dest
            if len(dest) > MAX_PAGES:
                state.failure = "too many pages for one manifest"
                return
            body = _OFFER_HEAD.pack(room, int(value[0]), int(value[1]), len(dest))
            body += struct.pack(f"<{2 * len(dest)}I", *[int(x) for pair in dest for x in pair])
            self._offer(room, state, body)
            return
        raise KeyError(field)

    def get(self, room: int, field: str) -> Any:
        """Decode: ``dest``/``ids`` as offered, ``manifest`` once it arrived. Prefill: ``dest``/``ids``
        of the offer that reached it (None while none did)."""
        room = int(room)
        with self._lock:
            if self.side == "prefill":
                offer = self._offers.get(room)
                if offer is None:
                    return None
                return offer[1] if field == "dest" else offer[2] if field == "ids" else None
            state = self._rooms.get(room)
            if state is None:
                return None
            return getattr(state, field, None) if field in ("dest", "ids", "manifest") else None

    def failure(self, room: int) -> str | None:
        """Decode: why the room's manifest will not come (connection refused or lost, the prefill
        side sent none, too many rooms waiting); None while it may still come or has come."""
        with self._lock:
            state = self._rooms.get(int(room))
            if state is None:
                return "the room was never offered"
            return state.failure

    def forget_offer(self, room: int) -> None:
        """Prefill: SGLang is done with the room's sender; an offer it left unused is forgotten (a
        build still waiting for the offer is kept: the manifest goes when the offer comes)."""
        with self._lock:
            self._offers.pop(int(room), None)

    def drop(self, room: int) -> None:
        """Forgets a room (its transfer was judged, or SGLang is done with its receiver)."""
        room = int(room)
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is not None:
                self._bytes -= len(state.manifest or b"")
            self._offers.pop(room, None)
            self._deferred.pop(room, None)

    # ---- the decode side: offers out, manifests in -------------------------------------------------

    def _offer(self, room: int, state: _Room, body: bytes) -> None:
        with self._lock:
            conn = self._conn
            if conn is not None and conn.alive:
                state.conn = conn
            elif self._connecting is not None:
                self._connecting.append(room)
                state.conn = None
                self._pending_bodies[room] = body
                return
            else:
                self._connecting = [room]
                self._pending_bodies[room] = body
                threading.Thread(target=self._connect, name="kvguard-pd-connect", daemon=True).start()
                return
        if not conn.send(OFFER, body):
            with self._lock:
                state.failure = "the connection to the prefill side is gone or backed up"

    def _connect(self) -> None:
        conn = None
        error = ""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, sock, client=True)
            conn.handshake()
        except Exception as e:  # noqa: BLE001 - any failure refuses the rooms waiting on it
            error = f"cannot reach the prefill side's PD channel {self.host}:{self.port}: {e}"
            self._count("connects_failed")
            logger.warning("kvguard: %s; the transfers waiting on it are refused", error)
            if conn is not None:
                conn.close(error)
            conn = None
        with self._lock:
            rooms, bodies = self._connecting or [], self._pending_bodies
            self._connecting, self._pending_bodies = None, {}
            if conn is not None:
                self._conn = conn
                self._conns.add(conn)
            for room in rooms:
                state = self._rooms.get(room)
                if state is None:
                    continue
                if conn is None:
                    state.failure = error
                else:
                    state.conn = conn
        if conn is None:
            return
        conn.start(self._on_decode_frame, self._on_close)
        for room in rooms:
            if room in bodies and not conn.send(OFFER, bodies[room]):
                with self._lock:
                    state = self._rooms.get(room)
                    if state is not None:
                        state.failure = "the connection to the prefill side is gone or backed up"

    def _on_decode_frame(self, conn: _Conn, kind: int, body: bytes) -> None:
        if kind not in (MANIFEST, NOMANIFEST) or len(body) < _ROOM.size:
            raise FrameError(f"unexpected frame type {kind} from the prefill side")
        (room,) = _ROOM.unpack_from(body)
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.conn is not conn or state.manifest is not None or state.failure is not None:
                self._count("manifests_unexpected")
                logger.warning("kvguard: PD channel %s: a manifest for room %s, which waits for none; dropped",
                               self.url, room)
                return
            if kind == NOMANIFEST:
                state.failure = "the prefill side sent no manifest: " + body[_ROOM.size:_ROOM.size + _MAX_REASON].decode(
                    "utf-8", "replace")
                return
            manifest = body[_ROOM.size:]
            if self._bytes + len(manifest) > self.max_pending_bytes:
                state.failure = "the decode side holds too many manifest bytes"
                self._count("rooms_refused")
                return
            state.manifest = manifest
            self._bytes += len(manifest)

    def _on_close(self, conn: _Conn) -> None:
        """A connection ended: every room still waiting on it is refused."""
        with self._lock:
            self._conns.discard(conn)
            if self._conn is conn:
                self._conn = None
            for room, entry in list(self._offers.items()):
                if entry[0] is conn:
                    del self._offers[room]
            for state in self._rooms.values():
                if state.conn is conn and state.manifest is None and state.failure is None:
                    state.failure = f"the connection to the prefill side was lost ({conn.reason})"


def _no_manifest(_dest: Any, _ids: Any) -> bytes:
    raise ValueError("the prefill side built no manifest")
