"""A retracted decode request (SGLang's ``disaggregation_decode_retraction_backup``): its KV
backed up to the host when its pages go back, and checked when SGLang copies it back into new
pages (the count and CRC32 of what was saved), with no write kvguard follows in between.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import ConfigError, TransferError
from .kv_bytes import _pool_buffers


def _log() -> Any:
    return logging.getLogger("sglang.srt.kvguard")


def _slots_crc(kv_pool: Any, slots: Any) -> int:
    """CRC32 of the bytes of token ``slots`` over every layer (gathered on the pool's device, one
    copy to the host)."""
    import zlib

    import torch

    index = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    buffers = _pool_buffers(kv_pool)
    device = buffers[0].device
    parts = [b.index_select(0, index.to(b.device)).contiguous().view(-1).view(torch.uint8).to(device) for b in buffers]
    return zlib.crc32(torch.cat(parts).cpu().numpy().tobytes())


def _restored_slots(req: Any, req_to_token_pool: Any, tokens: int) -> Any:
    """The token slots of ``req``'s first ``tokens`` tokens (its row, as SGLang's
    ``offload_kv_cache`` / ``load_kv_cache`` read it)."""
    return req_to_token_pool.req_to_token[req.kv.req_pool_idx, :tokens]


_BACKUPS_ATTR = "kvguard_retraction_backups"
"""On a decode guard: ``rid -> (tokens, crc32)`` of each retracted request's KV as SGLang backed
it up (its new pages are checked against it when SGLang restores it)."""


def _backed_up(guard: Any, req: Any, req_to_token_pool: Any) -> None:
    """SGLang backed up a retracted decode request's KV (``backup_kv_cache``, before its pages
    go back): the count and CRC32 of what it saved (``seqlen - 1`` tokens, as SGLang saves them)."""
    backups = guard.__dict__.setdefault(_BACKUPS_ATTR, {})
    backups.pop(req.rid, None)
    tokens = max(0, int(req.seqlen) - 1)
    backups[req.rid] = (tokens, _slots_crc(guard.kv_pool, _restored_slots(req, req_to_token_pool, tokens)))


def _restored(guard: Any, req: Any, req_to_token_pool: Any) -> None:
    """SGLang copied a resumed request's KV back into its new pages (``restore_kv_cache``): they
    are recorded as written when the count and CRC32 match what was backed up; else the request
    is refused (its new pages stay unwritten: attention never reads them). A request kvguard did
    not see backed up is left as it is (its reads are judged as they come)."""
    entry = guard.__dict__.get(_BACKUPS_ATTR, {}).pop(req.rid, None)
    if entry is None:
        return
    tokens, crc = entry
    key = guard.request_key(req.rid)
    try:
        if max(0, int(req.seqlen) - 1) != tokens:
            raise TransferError(
                f"kvguard: request {req.rid!r} was backed up with {tokens} tokens and restored with {int(req.seqlen) - 1}"
            )
        slots = np.asarray(_flat_host(_restored_slots(req, req_to_token_pool, tokens)), dtype=np.int64)
        if _slots_crc(guard.kv_pool, slots) != crc:
            raise TransferError(f"kvguard: request {req.rid!r}'s KV restored after its retraction differs from its backup")
        ps = guard.page_size
        guard.table.record_import(key, (slots[::ps] // ps).tolist(), tokens, tokens)
        guard.metrics["retractions_restored"] += 1
    except Exception as e:  # noqa: BLE001 - never into SGLang's loop; this request alone is refused
        violation = getattr(e, "violation", None)
        if violation is not None:
            guard._refused(key, violation)
        else:
            guard._abort_plain(key, str(e), kind="restore_mismatch")


def _flat_host(values: Any) -> Any:
    return values.cpu() if hasattr(values, "cpu") else values


_RETRACTION_HOOKED = False


def _hook_retraction() -> None:
    """SGLang's decode retraction (``disaggregation_decode_retraction_backup``): ``release_req``
    backs a retracted request's KV up (``schedule_batch.backup_kv_cache``) and
    ``DecodePreallocQueue.resume_retracted_reqs`` copies it back into new pages
    (``decode.restore_kv_cache``) without any write kvguard follows. Both module names are
    wrapped once per process; each finds the guard of the ``ReqToTokenPool`` it works on
    (``pool.kvguard_guard``). Raises ``ConfigError`` for an SGLang without them. A backup SGLang
    discards (``discard_kv_cache_backup``: a retracted request aborted, a host-staged receive
    released) drops kvguard's record of it, where SGLang's modules name that function."""
    global _RETRACTION_HOOKED
    if _RETRACTION_HOOKED:
        return
    try:
        from sglang.srt.disaggregation import decode as decode_module
        from sglang.srt.managers import schedule_batch
    except ImportError as e:
        raise ConfigError(f"kvguard: this SGLang's decode retraction cannot be followed: {e}") from e
    backup = getattr(schedule_batch, "backup_kv_cache", None)
    restore = getattr(decode_module, "restore_kv_cache", None)
    if backup is None or restore is None:
        raise ConfigError(
            "kvguard: this SGLang has no schedule_batch.backup_kv_cache / decode.restore_kv_cache to follow retraction by"
        )

    def backup_kv_cache(req: Any, tree_cache: Any, req_to_token_pool: Any, *args: Any, **kwargs: Any) -> Any:
        saved = backup(req, tree_cache, req_to_token_pool, *args, **kwargs)
        guard = getattr(req_to_token_pool, "kvguard_guard", None)
        if guard is not None and guard.kv_pool is not None:
            try:
                if saved:
                    _backed_up(guard, req, req_to_token_pool)
                else:
                    guard.__dict__.get(_BACKUPS_ATTR, {}).pop(req.rid, None)
            except Exception as e:  # noqa: BLE001 - never into SGLang's loop; its restore is then not recorded
                guard.__dict__.get(_BACKUPS_ATTR, {}).pop(req.rid, None)
                _log().warning("kvguard: request %r's retraction backup could not be read (%r): its resume is refused",
                               req.rid, e)
        return saved

    def restore_kv_cache(req: Any, tree_cache: Any, req_to_token_pool: Any, *args: Any, **kwargs: Any) -> Any:
        out = restore(req, tree_cache, req_to_token_pool, *args, **kwargs)
        guard = getattr(req_to_token_pool, "kvguard_guard", None)
        if guard is not None:
            _restored(guard, req, req_to_token_pool)
        return out

    schedule_batch.backup_kv_cache = backup_kv_cache
    decode_module.restore_kv_cache = restore_kv_cache
    _hook_backup_discard(decode_module)
    _RETRACTION_HOOKED = True


def _hook_backup_discard(decode_module: Any) -> None:
    """``discard_kv_cache_backup(req, tree_cache, backend)`` as the decode queues and the
    scheduler's ``abort_request`` call it: the request's backup record goes with SGLang's backup
    (no restore can follow: SGLang's restore needs the backup it dropped). Without this, each
    request aborted while retracted left its record for the life of the server."""
    modules = [decode_module]
    try:
        from sglang.srt.managers import scheduler as scheduler_module

        modules.append(scheduler_module)
    except ImportError:  # an SGLang whose scheduler does not import here: the decode queues' calls only
        pass
    for module in modules:
        discard = getattr(module, "discard_kv_cache_backup", None)
        if discard is None or getattr(discard, "_kvguard", False):
            continue

        def discard_kv_cache_backup(req: Any, tree_cache: Any, *args: Any, _inner: Any = discard, **kwargs: Any) -> Any:
            try:
                return _inner(req, tree_cache, *args, **kwargs)
            finally:
                pool = getattr(tree_cache, "req_to_token_pool", None)
                guard = getattr(pool, "kvguard_guard", None)
                if guard is not None:
                    guard.__dict__.get(_BACKUPS_ATTR, {}).pop(getattr(req, "rid", None), None)
                    # Nor will it use a row again: it is no longer a suspect (see Guard._suspects).
                    guard._suspects.pop(id(getattr(req, "kv", None)), None)

        discard_kv_cache_backup._kvguard = True  # type: ignore[attr-defined]
        module.discard_kv_cache_backup = discard_kv_cache_backup
