"""PD disaggregation: the kvguard manifest at SGLang's KV sender and receiver.

:class:`GuardedKVSender` / :class:`GuardedKVReceiver` wrap SGLang's ``BaseKVSender`` /
``BaseKVReceiver`` (mooncake, nixl, fake) so that every transfer carries a kvguard manifest and the
decode side refuses one that is missing or does not match. The start-up audit of both pools is
:func:`kvguard.sglang.audit_pd`. The pool's bytes a manifest covers are read by
:mod:`kvguard.sglang.kv_bytes`; a retracted decode request's backup and restore are followed by
:mod:`kvguard.sglang.retraction`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import ConfigError, Error, Manifest, PageRef, Receiver, TransferError, ViolationError
from .kv_bytes import _pages_bytes, _pool_buffers, _slot_bytes
from .retraction import _hook_retraction

if TYPE_CHECKING:
    from .guard import Guard


# ---- PD disaggregation: the manifest at SGLang's KV sender and receiver --------------------------


class ManifestChannel:
    """What travels beside a transfer, keyed by SGLang's ``bootstrap_room``: the decode side's
    destination pages (``(page, generation)`` pairs) and ids (with ``send_metadata``) and the
    prefill side's encoded manifest (with ``send``). In one process (both schedulers in it), a
    dict; across processes, :class:`DirectoryChannel`."""

    def __init__(self) -> None:
        self.rooms: dict[int, dict[str, Any]] = {}

    def put(self, room: int, field: str, value: Any) -> None:
        """Sets one field of a room's record."""
        self.rooms.setdefault(int(room), {})[field] = value

    def get(self, room: int, field: str) -> Any:
        """One field of a room's record, or None."""
        return self.rooms.get(int(room), {}).get(field)

    def drop(self, room: int) -> None:
        """Forgets a room (its transfer was judged)."""
        self.rooms.pop(int(room), None)


class DirectoryChannel:
    """:class:`ManifestChannel` across processes: one file per room and field in a directory both
    sides see (``KVGUARD_SGLANG_PD_CHANNEL=/path``; the same host, or a shared file system).
    Each file is written whole and renamed into place, so a reader sees a field whole or not
    at all."""

    def __init__(self, path: str) -> None:
        import os

        self.path = path
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise ConfigError(f"kvguard: PD manifest channel {path!r} is not writable")

    def _file(self, room: int, field: str) -> str:
        import os

        return os.path.join(self.path, f"{int(room)}.{field}")

    def put(self, room: int, field: str, value: Any) -> None:
        """Sets one field of a room's record (a file renamed into place): an encoded manifest as
        its bytes, None, or JSON (page/generation pairs, ids). Never pickle: the directory may be
        shared, and what is read from it is data, not code."""
        import json
        import os

        if isinstance(value, (bytes, bytearray)):
            data = b"B" + bytes(value)
        elif value is None:
            data = b"N"
        else:
            data = b"J" + json.dumps(value).encode()
        target = self._file(room, field)
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)

    def get(self, room: int, field: str) -> Any:
        """One field of a room's record, or None (missing, or not one this channel wrote). A file
        that is there but cannot be read (permissions, a directory in its place, an I/O error on
        a shared file system) raises :class:`kvguard.TransferError`: the caller refuses that room."""
        import json

        try:
            with open(self._file(room, field), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TransferError(f"kvguard: PD manifest channel {self.path!r}: cannot read {field} of room {room}: {e}") from e
        if data[:1] == b"B":
            return data[1:]
        if data[:1] == b"J":
            try:
                return json.loads(data[1:])
            except ValueError:
                return None
        return None

    def drop(self, room: int) -> None:
        """Forgets a room (its transfer was judged). A file that cannot be removed is logged and
        left: every manifest binds its request and page generations, so a stale one never passes."""
        import os

        for field in ("dest", "ids", "manifest"):
            try:
                os.remove(self._file(room, field))
            except FileNotFoundError:
                pass
            except OSError as e:
                _log().warning("kvguard: PD manifest channel %r: cannot remove %s of room %s: %s", self.path, field, room, e)


def _log() -> Any:
    import logging

    return logging.getLogger("sglang.srt.kvguard")


def _quietly(what: str, room: int, call: Any, *args: Any) -> Any:
    """A channel call that must not raise into SGLang's loop (a clean-up): its failure is logged."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001 - never into SGLang's loop
        _log().warning("kvguard: PD channel: %s for room %s failed: %r", what, room, e)
        return None


ENV_CHANNEL = "KVGUARD_SGLANG_PD_CHANNEL"
"""Where the manifests travel between a PD deployment's prefill and decode schedulers: ``process``
(both in this process), ``tcp://HOST:PORT`` (the prefill side listens there, the decode side
connects: :class:`kvguard.sglang.pd_net.TcpChannel`), or a directory both sides see."""

_PROCESS_CHANNEL = ManifestChannel()


def channel_from_env() -> Any:
    """The channel ``KVGUARD_SGLANG_PD_CHANNEL`` names: ``process`` (this process's one
    :class:`ManifestChannel`), ``tcp://HOST:PORT[?timeout=SECONDS]`` (a new
    :class:`~kvguard.sglang.pd_net.TcpChannel`, its side taken by :func:`install_pd`), an absolute
    directory (:class:`DirectoryChannel`), None when unset. Anything else raises
    :class:`kvguard.ConfigError`."""
    import os

    value = os.environ.get(ENV_CHANNEL, "").strip()
    if not value:
        return None
    if value == "process":
        return _PROCESS_CHANNEL
    if value.startswith("tcp://"):
        from .pd_net import TcpChannel

        return TcpChannel(value)
    if "://" in value or not os.path.isabs(value):
        raise ConfigError(
            f"kvguard: {ENV_CHANNEL}={value!r} is not process, tcp://HOST:PORT or an absolute directory"
        )
    return DirectoryChannel(value)


def _transfer_tokens(prompt: Any, prefix: int) -> np.ndarray:
    """The tokens a transfer carries, as its manifest states them: the whole prompt, or, when the
    decode side's radix cache holds the prompt's first ``prefix`` tokens
    (``--disaggregation-decode-enable-radix-cache``: SGLang's prefill side sends from there),
    the rest, each keyed by a digest of that prefix and its length, so the manifest's count
    is the pages sent and its digest still binds the whole prompt (a prefill side that ran
    another prefix, or assumed another prefix length, is refused)."""
    tokens = np.asarray(prompt, dtype=np.int64).reshape(-1)
    if prefix <= 0:
        return tokens
    import hashlib

    head = tokens[:prefix].tobytes() + int(prefix).to_bytes(8, "little")
    seed = np.uint64(int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") | 1)
    rest = tokens[prefix:]
    # A 32-bit key per position from the 64-bit seed (token ids are 32-bit), wrapping.
    with np.errstate(over="ignore"):
        keys = ((np.arange(1, len(rest) + 1, dtype=np.uint64) * seed) >> np.uint64(32)).astype(np.int64)
    return (rest & 0xFFFFFFFF) ^ keys


def _prefix_len(value: Any) -> int:
    """SGLang's ``decode_prefix_len`` (None or an int) as a count of tokens."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


class GuardedKVSender:
    """Prefill side: wraps an SGLang ``BaseKVSender`` (mooncake, nixl, fake). ``send`` builds the
    kvguard manifest of the pages it sends (request and tenant as the decode side named them,
    the prompt's digest, each page's CRC32) and puts it on the channel before the bytes go."""

    _OWN = frozenset(("inner", "guard", "req", "channel", "sender", "room", "_pages", "_tokens", "failure", "_total"))

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: Any, *, sender: int = 0) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.sender = sender
        self.room = int(getattr(inner, "bootstrap_room", 0) or 0)
        self._pages: list[bytes] = []
        """Every page sent so far, as bytes (a prompt goes in chunks: ``send_kv_chunk``)."""
        self._tokens = 0
        self._total: int | None = None
        """The pages this transfer sends (SGLang's ``init(num_pages)``), when SGLang said."""
        self.failure: Exception | None = None
        """Why no manifest went with the last send (the decode side then refuses the transfer)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # SGLang sets backend state on the sender it holds (mooncake's _early_send_wait_event):
        # it goes to the backend's object.
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def clear(self) -> Any:
        """SGLang is done with the sender: a network channel forgets the room's unused offer."""
        forget = getattr(self.channel, "forget_offer", None)
        if forget is not None:
            _quietly("forget_offer", self.room, forget, self.room)
        return self.inner.clear()

    def init(self, num_kv_indices: int, *args: Any, **kwargs: Any) -> Any:
        """SGLang's ``finalize_bootstrap`` says how many pages this transfer sends: the manifest
        goes with the send that completes them (fewer than the decode side offered, when the
        prefill side runs a shorter prompt than the decode side holds: the decode side refuses)."""
        self._total = int(num_kv_indices)
        return self.inner.init(num_kv_indices, *args, **kwargs)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **kwargs: Any) -> Any:
        """Sends ``kv_indices`` (prefill pages; one chunk of the prompt, as SGLang's
        ``send_kv_chunk`` sends them) with the manifest of every page sent so far. Never raises
        into SGLang's loop: a manifest that cannot be built is left out, and the decode side
        refuses the transfer (a missing manifest) under enforce. Keywords SGLang adds
        (``indices_event=``) go to the backend as given; ``indices_event`` (SGLang's mooncake path:
        ``kv_indices`` is a host tensor an asynchronous copy is still filling) is waited on before
        kvguard reads the indices."""
        try:
            event = kwargs.get("indices_event")
            if event is not None:
                event.synchronize()
            self._record(kv_indices, num_kv_tokens)
        except Exception as e:  # noqa: BLE001 - never into SGLang's loop; the decode side refuses
            self.failure = e
            self.guard.metrics["manifests_not_built"] += 1
            _quietly("put(manifest=None)", self.room, self.channel.put, self.room, "manifest", None)
            _log().warning("kvguard: no manifest for room %s (%s); the decode side will refuse the transfer", self.room, e)
        if num_kv_tokens is None and not kwargs:
            return self.inner.send(kv_indices, state_indices)
        if not kwargs:
            return self.inner.send(kv_indices, state_indices, num_kv_tokens)
        return self.inner.send(kv_indices, state_indices, num_kv_tokens, **kwargs)

    def _record(self, kv_indices: Any, num_kv_tokens: int | None) -> None:
        ps = self.guard.page_size
        pool = self.guard.kv_pool
        # After a decode-side prefix the transfer starts there (SGLang's start_send_idx).
        total = len(self.req.origin_input_ids) - _prefix_len(getattr(self.req, "disagg_decode_prefix_len", 0))
        pages = np.asarray(kv_indices.cpu() if hasattr(kv_indices, "cpu") else kv_indices).reshape(-1).tolist()
        tokens = int(num_kv_tokens) if num_kv_tokens is not None else min(len(pages) * ps, max(0, total - self._tokens))
        self._pages.extend(_pages_bytes(pool, pages, ps, [tokens - i * ps for i in range(len(pages))]))
        self._tokens += tokens
        self.failure = None
        dest = self.channel.get(self.room, "dest")
        ids = self.channel.get(self.room, "ids")
        if dest is None or ids is None:
            defer = getattr(self.channel, "defer", None)
            if defer is None:
                raise TransferError(f"kvguard: no destination for room {self.room}; the decode side sent no metadata")
            # Across hosts the decode side's offer may come after SGLang's own metadata: the
            # manifest is built when it comes (from the pages as sent so far).
            pages = list(self._pages)
            defer(self.room, lambda dest, ids: self._build(dest, ids, pages), sum(map(len, pages)))
            return
        if len(self._pages) < min(len(dest), self._total if self._total is not None else len(dest)):
            return  # more chunks to come; the manifest goes with the last
        self.channel.put(self.room, "manifest", self._build(dest, ids, self._pages))

    def _build(self, dest: Any, ids: Any, pages: list[bytes]) -> bytes | None:
        """The encoded manifest of ``pages`` for the decode side's offer (``dest``, ``ids``); None
        while pages are still to come."""
        if len(pages) < min(len(dest), self._total if self._total is not None else len(dest)):
            return None
        ps = self.guard.page_size
        manifest = Manifest.build(
            ids[0], ids[1], self.sender, ps, _slot_bytes(self.guard.kv_pool, ps),
            _transfer_tokens(self.req.origin_input_ids, _prefix_len(getattr(self.req, "disagg_decode_prefix_len", 0))),
            [PageRef(p, g) for p, g in dest[: len(pages)]], pages,
        )
        return manifest.encode()


class GuardedKVReceiver:
    """Decode side: wraps an SGLang ``BaseKVReceiver``. ``send_metadata`` names the destination
    pages in their current incarnation; when the backend reports ``KVPoll.Success``, the manifest
    is checked against the decode side's own copy of the request and the bytes that landed. A
    missing manifest, a token count or prompt digest that differs, or a page whose CRC32 differs
    turns the poll into ``KVPoll.Failed``, aborts the request, and its pages stay unwritten, so
    attention can never read them."""

    _OWN = frozenset(
        ("inner", "guard", "req", "channel", "room", "_pages", "_verdict", "refusal", "_landed", "_prefix", "_offer_failed",
         "drained")
    )

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: Any) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.room = int(getattr(inner, "bootstrap_room", None) or getattr(req, "bootstrap_room", 0) or 0)
        self._pages: list[int] = []
        self._prefix = 0
        """The prompt's tokens this side's radix cache holds (``decode_prefix_len``): not sent."""
        self._verdict: int | None = None
        self._landed: float | None = None
        """When the backend reported the transfer done (its manifest may still be on the way)."""
        self.refusal: Error | None = None
        self._offer_failed: str | None = None
        """Why the offer could not be put on the channel (the transfer is then refused)."""
        self.drained = False
        """SGLang's transfer backend confirmed no write of this transfer is still on its way
        (every prefill rank acknowledged the abort: ``is_abort_release_safe``)."""

    def may_write_late(self) -> bool:
        """Whether the backend may still write the pages offered: some were offered, the backend
        never reported the transfer done, and never confirmed its writes stopped."""
        return bool(self._pages) and self._landed is None and not self.drained

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def failure_exception(self) -> Any:
        """Why the transfer failed: kvguard's refusal when it refused it (SGLang puts this in the
        request's abort), else the backend's."""
        if self.refusal is not None:
            error = TransferError(f"kvguard refused the KV transfer: {self.refusal}")
            error.failure_reason = "kvguard refused the KV transfer"  # type: ignore[attr-defined]
            raise error
        return self.inner.failure_exception()

    def clear(self) -> Any:
        """SGLang is done with the receiver (judged, failed or aborted): the channel forgets the
        room."""
        _quietly("drop", self.room, self.channel.drop, self.room)
        return self.inner.clear()

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None, **kwargs: Any) -> Any:
        """Offers ``kv_indices`` (decode pages, already in this request's row) to the prefill side.
        A request kvguard refused already (under enforce; its preallocation wrote pages into its
        row that are not its own) offers no page: none it names is written by the transfer, and
        the transfer fails on both sides."""
        if self.guard.policy == "enforce" and self.req.rid in self.guard.aborted:
            from sglang.srt.disaggregation.base.conn import KVPoll

            self.refusal = TransferError(
                f"kvguard: request {self.req.rid!r} was refused before its transfer: {self.guard.aborted[self.req.rid]}"
            )
            self._verdict = KVPoll.Failed
            # The backend still answers the prefill side (which would otherwise wait for this
            # request until its bootstrap times out), with no page to write.
            return self.inner.send_metadata(kv_indices[:0], aux_index, state_indices, **kwargs)
        try:
            table = self.guard.table
            self._prefix = _prefix_len(kwargs.get("decode_prefix_len"))
            self._pages = [int(p) for p in np.asarray(kv_indices).reshape(-1).tolist()]
            dest = []
            for page in self._pages:
                info = table.page_info(page)
                dest.append((page, info.generation if info is not None else 0))
            self.channel.put(self.room, "dest", dest)
            self.channel.put(
                self.room, "ids", (self.guard.request_key(self.req.rid), self.guard._tenant_key(self.guard.tenant_of(self.req)))
            )
        except Exception as e:  # noqa: BLE001 - never into SGLang's loop; this room is refused at its poll
            self._offer_failed = f"its offer could not be put on the channel: {e!r}"
            _log().warning("kvguard: room %s: %s; the transfer will be refused", self.room, self._offer_failed)
        return self.inner.send_metadata(kv_indices, aux_index, state_indices, **kwargs)

    def poll(self) -> int:
        """The backend's poll, then the manifest check once it says ``Success``."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        if self._verdict is not None:
            return self._verdict
        if self._landed is None:
            state = self.inner.poll()
            if state != KVPoll.Success:
                return state
            self._landed = time.monotonic()
        # Across hosts the manifest may come a little after the backend's own completion: the
        # transfer waits for it (no longer than the channel's wait), unless it will not come.
        try:
            wait = float(getattr(self.channel, "wait", 0.0) or 0.0)
            if (
                wait > 0
                and self._offer_failed is None
                and self.channel.get(self.room, "manifest") is None
                and self.channel.failure(self.room) is None
                and time.monotonic() - self._landed < wait
            ):
                return KVPoll.Transferring
        except Exception:  # noqa: BLE001 - the channel failed: judged now (refused: no manifest read)
            pass
        try:
            accepted = self._accept()
        except Exception as e:  # noqa: BLE001 - kvguard's own failure: this room refused, never raised
            self.refusal = TransferError(f"kvguard: the manifest check for room {self.room} failed: {e!r}")
            _log().warning("%s", self.refusal)
            accepted = False
        finally:
            _quietly("drop", self.room, self.channel.drop, self.room)
        # Report mode records the refusal and lets the transfer through.
        self._verdict = KVPoll.Success if accepted or self.guard.policy == "report" else KVPoll.Failed
        if not accepted and self.guard.policy == "report":
            self._follow_engine()
        return self._verdict

    def _follow_engine(self) -> None:
        """Report mode let a refused transfer through: SGLang decodes over what landed as the
        prompt's KV, so the table follows it (the prompt's tokens written into the request's
        pages). The refusal is counted once, at the transfer, not again at every read of those
        pages."""
        total = max(0, len(self.req.origin_input_ids) - self._prefix)
        try:
            self.guard.table.record_import(self.guard.request_key(self.req.rid), self._pages, total, total)
        except Exception:  # noqa: BLE001
            pass  # pages that are not the request's: its reads are judged (and counted) as they come

    def _accept(self) -> bool:
        """The manifest check; any failure in it (the channel, the pool read, the check) refuses
        this room only, and never raises into SGLang's loop."""
        guard = self.guard
        key = guard.request_key(self.req.rid)
        try:
            if self._offer_failed is not None:
                raise TransferError(f"kvguard: transfer for room {self.room} refused: {self._offer_failed}")
            manifest = self.channel.get(self.room, "manifest")
            dest = [PageRef(int(p), int(g)) for p, g in self.channel.get(self.room, "dest") or []]
            ps = guard.page_size
            prompt = _transfer_tokens(self.req.origin_input_ids, self._prefix)
            total = len(prompt)
            landed = _pages_bytes(guard.kv_pool, self._pages, ps, [total - i * ps for i in range(len(self._pages))])
            if manifest is None:
                why = getattr(self.channel, "failure", None)
                why = why(self.room) if why is not None else None
                wait = float(getattr(self.channel, "wait", 0.0) or 0.0)
                if why is None and wait > 0:
                    why = f"none came within {wait:g} s of the backend's completion"
                raise TransferError(
                    f"kvguard: transfer for room {self.room} arrived without a manifest"
                    + (f" ({why})" if why else "")
                )
            accepted = Receiver(guard.table).accept(
                key,
                guard._tenant_key(guard.tenant_of(self.req)),
                prompt,
                dest,
                manifest,
                landed,
                slot_bytes=_slot_bytes(guard.kv_pool, ps),
                page_size=ps,
            )
        except Exception as e:  # noqa: BLE001 - any failure to check refuses (fail closed), never raises
            if not isinstance(e, (TransferError, ViolationError)):
                e = TransferError(f"kvguard: the manifest check for room {self.room} failed: {e!r}")
            self.refusal = e
            violation = getattr(e, "violation", None)
            guard.metrics["transfers_refused"] += 1
            if violation is not None:
                guard._refused(key, violation)
            else:
                guard._abort_plain(key, str(e))
            return False
        guard.metrics["transfers_accepted"] += 1
        guard._imported(key, accepted.tokens)
        return True


# ---- a failed transfer's late writes: its pages never handed to another request ------------------


def _hook_late_writes(scheduler: Any, guard: Guard) -> None:
    """A decode transfer that fails (the backend's error, a timeout, an abort) may still have
    writes on the wire into the pages it was offered. SGLang holds such pages until every
    prefill rank acknowledges (deferred release, mooncake/nixl/mori), but releases them anyway
    after ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s), and at once where
    the backend cannot defer: a late write would then land in another request's KV, which
    kvguard records as that request's own (the incident's class). So a failed transfer's pages
    released with no proof that its writes stopped (``GuardedKVReceiver.may_write_late``: not
    reported done, not drained) are released in kvguard's table and kept out of SGLang's free
    list for good (``late_write_fenced_pages``; a warning each time): capacity lost, never a
    page read by the wrong request. The proof is SGLang's own (``is_abort_release_safe``), read
    where SGLang resolves its deferred releases."""
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    release = getattr(queue, "_release_request", None)
    do_release = getattr(queue, "_do_release", None)
    resolve = getattr(queue, "resolve_deferred_releases", None)
    if release is None or do_release is None or resolve is None:
        raise ConfigError(
            "kvguard: this SGLang's DecodeTransferQueue has no _release_request, _do_release or "
            "resolve_deferred_releases to wrap: a failed transfer's pages could be reused under late writes"
        )
    acks: dict[int, int] = {}

    def resolve_deferred_releases(*args: Any, **kwargs: Any) -> Any:
        # The acknowledgements each held transfer needs, as SGLang recorded them when it held it.
        acks.clear()
        for entry in getattr(queue, "_deferred_releases", ()):
            try:
                acks[id(entry[0])] = int(entry[4])
            except Exception:  # noqa: BLE001 - unknown: its release is not proven drained
                pass
        try:
            return resolve(*args, **kwargs)
        finally:
            acks.clear()

    def _do_release(decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        receiver = getattr(decode_req, "kv_receiver", None)
        if isinstance(receiver, GuardedKVReceiver):
            receiver.drained = _proven_drained(queue, decode_req, receiver, acks.get(id(decode_req)))
        return do_release(decode_req, *args, **kwargs)

    def _release_request(decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        receiver = getattr(decode_req, "kv_receiver", None)
        late = isinstance(receiver, GuardedKVReceiver) and receiver.may_write_late()
        if not late:
            return release(decode_req, *args, **kwargs)
        key = guard.request_key(decode_req.req.rid)
        guard._late_writers.add(key)
        try:
            return release(decode_req, *args, **kwargs)
        finally:
            guard._late_writers.discard(key)

    queue.resolve_deferred_releases = resolve_deferred_releases
    queue._do_release = _do_release
    queue._release_request = _release_request


def _proven_drained(queue: Any, decode_req: Any, receiver: GuardedKVReceiver, required_acks: int | None) -> bool:
    """SGLang's own proof that no write of this failed transfer is still on its way; False
    when it cannot be read."""
    try:
        if queue._is_host_destination(decode_req):
            return bool(receiver.inner.is_abort_release_safe())
        if required_acks is None:
            return False
        return bool(receiver.inner.kv_mgr.is_abort_release_safe(decode_req.req.bootstrap_room, required_acks))
    except Exception:  # noqa: BLE001 - no proof
        return False


# ---- the plugin: SGLang's senders and receivers wrapped where SGLang creates them ----------------


def _parallel_sizes(scheduler: Any) -> dict[str, int]:
    """The widths that put more than one scheduler on a side of one transfer: attention TP,
    attention DP, attention CP and PP (SGLang's published topology, else its server args)."""
    sizes: dict[str, int] = {}
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        for name in ("attn_tp_size", "attn_dp_size", "attn_cp_size", "pp_size"):
            sizes[name] = int(getattr(parallel, name))
    except Exception:  # noqa: BLE001 - an SGLang without runtime_context: its server args say
        sa = getattr(scheduler, "server_args", None)
        tp = int(getattr(sa, "tp_size", 1) or 1)
        dp = int(getattr(sa, "dp_size", 1) or 1) if getattr(sa, "enable_dp_attention", False) else 1
        sizes = {"attn_tp_size": max(1, tp // dp), "attn_dp_size": dp, "pp_size": int(getattr(sa, "pp_size", 1) or 1)}
    return sizes


def _check_pd_server(scheduler: Any, guard: Guard) -> None:
    """What kvguard's PD check cannot follow, refused at start (``ConfigError``: under enforce the
    scheduler does not start; under report it serves its transfers unchecked, and says so):
    more than one scheduler on a side (attention TP, DP attention, attention CP or PP above 1:
    the manifest channel is keyed by room alone, so the ranks' offers and manifests would
    overwrite each other and innocent transfers would be refused); a KV pool whose pages
    kvguard cannot read (neither MHA nor MLA); ``--enable-pd-role-switch`` (it re-runs SGLang's
    ``init_disaggregation``, which replaces the queues kvguard wrapped)."""
    over = {name: size for name, size in _parallel_sizes(scheduler).items() if size > 1}
    if over:
        widths = ", ".join(f"{name}={size}" for name, size in sorted(over.items()))
        raise ConfigError(
            f"kvguard: a PD server with more than one rank per side ({widths}) is not supported: its manifests "
            "are keyed by bootstrap room alone"
        )
    role_switch = None
    try:
        from sglang.srt.runtime_context import get_disagg

        role_switch = bool(get_disagg().enable_pd_role_switch)
    except Exception:  # noqa: BLE001 - an SGLang without runtime_context: its server args say
        role_switch = bool(getattr(getattr(scheduler, "server_args", None), "enable_pd_role_switch", False))
    if role_switch:
        raise ConfigError(
            "kvguard: --enable-pd-role-switch is not supported: a role switch re-creates the PD queues kvguard wraps"
        )
    if guard.kv_pool is None:
        raise ConfigError("kvguard: the PD scheduler's KV pool is unknown; its transfers cannot be checked")
    _pool_buffers(guard.kv_pool)


def install_pd(scheduler: Any, guard: Guard, channel: Any) -> str | None:
    """Wraps every KV sender (a prefill scheduler) or receiver (a decode scheduler) SGLang
    creates from now on, whichever class its transfer backend picked (``get_kv_class``: mooncake,
    nixl, mori, ascend, fake): ``PrefillBootstrapQueue.create_sender`` and
    ``DecodePreallocQueue._create_receiver_and_enqueue`` are SGLang's only creation sites. Returns
    the side wrapped (``prefill``/``decode``), None for a scheduler not in PD mode. Raises
    ``kvguard.ConfigError`` when the scheduler is in PD mode and its queue cannot be hooked (an
    SGLang whose creation sites moved) or it runs what kvguard cannot check
    (:func:`_check_pd_server`): the caller fails the scheduler's start under enforce."""
    mode = str(getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null"))
    if mode in ("prefill", "decode"):
        _check_pd_server(scheduler, guard)
    if mode in ("prefill", "decode") and hasattr(channel, "open"):
        # A network channel takes its side now: the prefill side listens (an address it cannot
        # bind, or one off loopback without the shared secret under enforce, stops the start).
        channel.open(mode, policy=guard.policy)
    if mode in ("prefill", "decode"):
        scheduler.kvguard_pd_channel = channel
    if mode == "prefill":
        queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
        inner = getattr(queue, "create_sender", None)
        if inner is None:
            raise ConfigError("kvguard: this SGLang's prefill scheduler has no PrefillBootstrapQueue.create_sender to wrap")

        def create_sender(req: Any, *args: Any, **kwargs: Any) -> Any:
            created = inner(req, *args, **kwargs)
            sender = getattr(req, "disagg_kv_sender", None)
            if created and sender is not None and not isinstance(sender, GuardedKVSender):
                req.disagg_kv_sender = GuardedKVSender(sender, guard, req, channel)
            return created

        queue.create_sender = create_sender
        return mode
    if mode == "decode":
        queue = getattr(scheduler, "disagg_decode_prealloc_queue", None)
        inner = getattr(queue, "_create_receiver_and_enqueue", None)
        if inner is None:
            raise ConfigError(
                "kvguard: this SGLang's decode scheduler has no DecodePreallocQueue._create_receiver_and_enqueue to wrap"
            )

        _hook_retraction()
        _hook_late_writes(scheduler, guard)

        def create_receiver(req: Any, *args: Any, **kwargs: Any) -> Any:
            decode_req = inner(req, *args, **kwargs)
            receiver = decode_req.kv_receiver
            if not isinstance(receiver, GuardedKVReceiver):
                decode_req.kv_receiver = GuardedKVReceiver(receiver, guard, req, channel)
            return decode_req

        queue._create_receiver_and_enqueue = create_receiver
        return mode
    return None
