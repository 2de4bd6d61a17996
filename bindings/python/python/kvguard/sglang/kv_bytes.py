"""The bytes of SGLang's KV pool that a PD transfer carries and a retraction backs up: each layer's
buffers (MHA's K and V, MLA's latent buffer) in manifest order, read by page or by token slot.
"""

from __future__ import annotations

from typing import Any

from .. import ConfigError, TransferError


def _pool_buffers(kv_pool: Any) -> list[Any]:
    """The per-layer tensors a PD transfer moves for ``kv_pool``, in manifest order: an MHA pool's
    K and V of each layer (``k_buffer`` / ``v_buffer``), an MLA pool's one latent buffer per layer
    (``kv_buffer``), as SGLang's ``get_contiguous_buf_infos`` registers them. Any other pool
    raises :class:`kvguard.ConfigError` (checked at start: never a transfer kvguard cannot read)."""
    k = getattr(kv_pool, "k_buffer", None)
    v = getattr(kv_pool, "v_buffer", None)
    if k is not None and v is not None:
        if len(k) != len(v) or not len(k):
            raise ConfigError(f"kvguard: {type(kv_pool).__name__} has {len(k)} K and {len(v)} V layers")
        return [b for pair in zip(k, v) for b in pair]
    kv = getattr(kv_pool, "kv_buffer", None)
    if kv is not None and len(kv):
        return list(kv)
    raise ConfigError(
        f"kvguard: cannot read the KV pages of a {type(kv_pool).__name__} (neither k_buffer/v_buffer nor kv_buffer)"
    )


def _row_bytes(buffer: Any) -> int:
    """Bytes of one token slot of one layer's buffer."""
    return int(buffer[0].numel()) * int(buffer.element_size())


def _pages_bytes(kv_pool: Any, pages: Any, page_size: int, tokens: Any = None) -> list[bytes]:
    """Each page's bytes as a transfer moves them: the first ``tokens[i]`` slots of page
    ``pages[i]`` (a request's last page carries only its own tokens; None: whole pages) over
    every layer (K then V per layer; an MLA pool's one buffer). The pages are gathered on the
    pool's device and come to the host in one copy (``.cpu()``: never ``.numpy()`` on a device
    tensor)."""
    import torch

    buffers = _pool_buffers(kv_pool)
    pages = [int(p) for p in pages]
    if not pages:
        return []
    counts = [page_size] * len(pages) if tokens is None else [max(0, min(page_size, int(t))) for t in tokens]
    if len(counts) != len(pages):
        raise TransferError(f"kvguard: {len(pages)} pages but {len(counts)} token counts")
    rows = (torch.as_tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    device = buffers[0].device
    gathered = []
    widths = []
    for b in buffers:
        g = b.index_select(0, rows.to(b.device)).contiguous()
        gathered.append(g.view(-1).view(torch.uint8).reshape(len(pages), -1).to(device))
        widths.append(_row_bytes(b))
    host = torch.cat(gathered, dim=1).cpu().numpy()
    out = []
    for i, n in enumerate(counts):
        if n == page_size:
            out.append(host[i].tobytes())
            continue
        parts = []
        at = 0
        for w in widths:
            parts.append(host[i, at : at + n * w].tobytes())
            at += page_size * w
        out.append(b"".join(parts))
    return out


def _page_bytes(kv_pool: Any, page: int, page_size: int, tokens: int | None = None) -> bytes:
    """One page's bytes (:func:`_pages_bytes`)."""
    return _pages_bytes(kv_pool, [page], page_size, None if tokens is None else [tokens])[0]


def _slot_bytes(kv_pool: Any, page_size: int) -> int:
    """Bytes of one token slot over every layer (no page is read)."""
    return sum(_row_bytes(b) for b in _pool_buffers(kv_pool))
