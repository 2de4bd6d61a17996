"""SGLang's tensors as host numpy arrays, as the ownership table takes them."""

from __future__ import annotations

from typing import Any

import numpy as np


def _host(t: Any) -> np.ndarray:
    """A tensor or array as a host numpy array (no copy for CPU tensors and arrays)."""
    if type(t) is np.ndarray:
        return t
    try:
        return t.numpy()  # a CPU tensor: its memory, no copy (the common case, fastest)
    except AttributeError:
        return np.asarray(t)  # a sequence, or an ndarray subclass
    except (TypeError, RuntimeError):
        return t.detach().cpu().numpy()  # on a device, or requiring grad


def _flat(t: Any) -> np.ndarray:
    """:func:`_host`, as one dimension (a 1-D array as it is: ``reshape`` is a call of its own
    on every step)."""
    a = _host(t)
    return a if a.ndim == 1 else a.reshape(-1)


def _pages_of(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct pages of ``slots``, in first-seen order."""
    if page_size == 1:
        return slots
    pages = slots // page_size
    _, first = np.unique(pages, return_index=True)
    return pages[np.sort(first)]


def _in_place(t: Any) -> Any:
    """What a binding call reads: a 1-D host (CPU) tensor as it is, read by the binding in place
    through one DLPack export (cheaper than making a numpy view of it first, which the binding
    would then follow to the tensor that owns its memory); anything else as :func:`_flat` makes
    it (a device tensor copied to the host)."""
    if getattr(t, "is_cpu", False) and t.ndim == 1:
        return t
    return _flat(t)
