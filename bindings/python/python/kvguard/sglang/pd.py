"""PD disaggregation: the kvguard manifest at SGLang's KV sender and receiver.

:class:`GuardedKVSender` / :class:`GuardedKVReceiver` wrap SGLang's ``BaseKVSender`` /
``BaseKVReceiver`` (mooncake, nixl, fake) so that every transfer carries a kvguard manifest and the
decode side refuses one that is missing or does not match. The start-up audit of both pools is
:func:`kvguard.sglang.audit_pd`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import Error, Manifest, PageRef, Receiver, TransferError, ViolationError

if TYPE_CHECKING:
    from .guard import Guard


# ---- PD disaggregation: the manifest at SGLang's KV sender and receiver --------------------------


class ManifestChannel:
    """What travels beside a transfer, keyed by SGLang's ``bootstrap_room``: the decode side's
    destination page refs and ids (with ``send_metadata``) and the prefill side's encoded manifest
    (with ``send``). A backend carries it on its own side channel (mooncake/nixl bootstrap
    messages); in one process, a dict."""

    def __init__(self) -> None:
        self.rooms: dict[int, dict[str, Any]] = {}

    def put(self, room: int, field: str, value: Any) -> None:
        """Sets one field of a room's record."""
        self.rooms.setdefault(int(room), {})[field] = value

    def get(self, room: int, field: str) -> Any:
        """One field of a room's record, or None."""
        return self.rooms.get(int(room), {}).get(field)


def _page_bytes(kv_pool: Any, page: int, page_size: int, tokens: int | None = None) -> bytes:
    """The K and V bytes of a page's first ``tokens`` slots over every layer, as a transfer
    moves them (a request's last page carries only its own tokens)."""
    lo = page * page_size
    hi = lo + (page_size if tokens is None else tokens)
    parts = []
    for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer, strict=True):
        parts.append(k[lo:hi].contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
        parts.append(v[lo:hi].contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
    return b"".join(parts)


def _u8() -> Any:
    import torch

    return torch.uint8


def _slot_bytes(kv_pool: Any, page_size: int) -> int:
    return len(_page_bytes(kv_pool, 0, page_size)) // page_size


class GuardedKVSender:
    """Prefill side: wraps an SGLang ``BaseKVSender`` (mooncake, nixl, fake). ``send`` builds the
    kvguard manifest of the pages it sends (request and tenant as the decode side named them,
    the prompt's digest, each page's CRC32) and puts it on the channel before the bytes go."""

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: ManifestChannel, *, sender: int = 0) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.sender = sender
        self.room = int(getattr(inner, "bootstrap_room", 0) or 0)
        self._pages: list[bytes] = []
        """Every page sent so far, as bytes (a prompt goes in chunks: ``send_kv_chunk``)."""
        self._tokens = 0
        self.failure: Exception | None = None
        """Why no manifest went with the last send (the decode side then refuses the transfer)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **kwargs: Any) -> Any:
        """Sends ``kv_indices`` (prefill pages; one chunk of the prompt, as SGLang's
        ``send_kv_chunk`` sends them) with the manifest of every page sent so far. Never raises
        into SGLang's loop: a manifest that cannot be built is left out, and the decode side
        refuses the transfer (a missing manifest) under enforce. Keywords SGLang adds
        (``indices_event=``) go to the backend as given."""
        try:
            self._record(kv_indices, num_kv_tokens)
        except Exception as e:  # noqa: BLE001 - never into SGLang's loop; the decode side refuses
            self.failure = e
            self.guard.metrics["manifests_not_built"] += 1
            self.channel.put(self.room, "manifest", None)
            import logging

            logging.getLogger("sglang.srt.kvguard").warning(
                "kvguard: no manifest for room %s (%s); the decode side will refuse the transfer", self.room, e
            )
        if num_kv_tokens is None and not kwargs:
            return self.inner.send(kv_indices, state_indices)
        if not kwargs:
            return self.inner.send(kv_indices, state_indices, num_kv_tokens)
        return self.inner.send(kv_indices, state_indices, num_kv_tokens, **kwargs)

    def _record(self, kv_indices: Any, num_kv_tokens: int | None) -> None:
        ps = self.guard.page_size
        pool = self.guard.kv_pool
        total = len(self.req.origin_input_ids)
        pages = np.asarray(kv_indices.cpu() if hasattr(kv_indices, "cpu") else kv_indices).reshape(-1).tolist()
        tokens = int(num_kv_tokens) if num_kv_tokens is not None else min(len(pages) * ps, max(0, total - self._tokens))
        for i, p in enumerate(pages):
            self._pages.append(_page_bytes(pool, int(p), ps, max(0, min(ps, tokens - i * ps))))
        self._tokens += tokens
        self.failure = None
        dest = self.channel.get(self.room, "dest")
        ids = self.channel.get(self.room, "ids")
        if dest is None or ids is None:
            raise TransferError(f"kvguard: no destination for room {self.room}; the decode side sent no metadata")
        if len(self._pages) < len(dest):
            return  # more chunks to come; the manifest goes with the last
        manifest = Manifest.build(
            ids[0], ids[1], self.sender, ps, _slot_bytes(pool, ps),
            np.asarray(self.req.origin_input_ids, dtype=np.int64), dest, self._pages,
        )
        self.channel.put(self.room, "manifest", manifest.encode())


class GuardedKVReceiver:
    """Decode side: wraps an SGLang ``BaseKVReceiver``. ``send_metadata`` names the destination
    pages in their current incarnation; when the backend reports ``KVPoll.Success``, the manifest
    is checked against the decode side's own copy of the request and the bytes that landed. A
    missing manifest, a token count or prompt digest that differs, or a page whose CRC32 differs
    turns the poll into ``KVPoll.Failed``, aborts the request, and its pages stay unwritten, so
    attention can never read them."""

    def __init__(self, inner: Any, guard: Guard, req: Any, channel: ManifestChannel) -> None:
        self.inner = inner
        self.guard = guard
        self.req = req
        self.channel = channel
        self.room = int(getattr(inner, "bootstrap_room", None) or getattr(req, "bootstrap_room", 0) or 0)
        self._pages: list[int] = []
        self._verdict: int | None = None
        self.refusal: Error | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None, **kwargs: Any) -> Any:
        """Offers ``kv_indices`` (decode pages, already in this request's row) to the prefill side."""
        table = self.guard.table
        self._pages = [int(p) for p in np.asarray(kv_indices).reshape(-1).tolist()]
        dest = []
        for page in self._pages:
            info = table.page_info(page)
            dest.append(PageRef(page, info.generation if info is not None else 0))
        self.channel.put(self.room, "dest", dest)
        self.channel.put(
            self.room, "ids", (self.guard.request_key(self.req.rid), self.guard._tenant_key(self.guard.tenant_of(self.req)))
        )
        return self.inner.send_metadata(kv_indices, aux_index, state_indices, **kwargs)

    def poll(self) -> int:
        """The backend's poll, then the manifest check once it says ``Success``."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        if self._verdict is not None:
            return self._verdict
        state = self.inner.poll()
        if state != KVPoll.Success:
            return state
        accepted = self._accept()
        # Report mode records the refusal and lets the transfer through.
        self._verdict = KVPoll.Success if accepted or self.guard.policy == "report" else KVPoll.Failed
        return self._verdict

    def _accept(self) -> bool:
        guard = self.guard
        key = guard.request_key(self.req.rid)
        manifest = self.channel.get(self.room, "manifest")
        dest = self.channel.get(self.room, "dest") or []
        ps = guard.page_size
        total = len(self.req.origin_input_ids)
        landed = [
            _page_bytes(guard.kv_pool, p, ps, max(0, min(ps, total - i * ps))) for i, p in enumerate(self._pages)
        ]
        try:
            if manifest is None:
                raise TransferError(f"kvguard: transfer for room {self.room} arrived without a manifest")
            accepted = Receiver(guard.table).accept(
                key,
                guard._tenant_key(guard.tenant_of(self.req)),
                np.asarray(self.req.origin_input_ids, dtype=np.int64),
                dest,
                manifest,
                landed,
                slot_bytes=_slot_bytes(guard.kv_pool, ps),
                page_size=ps,
            )
        except (TransferError, ViolationError) as e:
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
