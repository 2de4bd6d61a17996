"""How kvguard's wrappers attach to vLLM's classes and come off again, the mode they check in,
and what an engine kvguard cannot check gets: refused at start-up under enforce, a warning and
an unchecked engine under report. Every part of the plugin (``scheduler_side``, ``runner_v1``,
``runner_v2``) wraps through here, so :func:`uninstall` takes all of them off."""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("vllm.kvguard")

_MODE: str | None = None
_ORIGINALS: list[tuple[type, str, Any]] = []
_ABSENT = object()


class UnsupportedConfig(RuntimeError):
    """kvguard cannot check this vLLM configuration."""


def installed_mode() -> str | None:
    """``enforce``/``report`` while the hooks are installed in this process, else None."""
    return _MODE


def set_mode(mode: str) -> None:
    """The mode the wrappers check in from now on."""
    global _MODE
    _MODE = mode


def wrap(cls: type, name: str, make: Any) -> None:
    """Replaces ``cls.name`` with ``make(original)`` (kept for :func:`uninstall`)."""
    original = cls.__dict__[name]
    _ORIGINALS.append((cls, name, original))
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__kvguard_original__ = original
    setattr(cls, name, wrapper)


def default(cls: type, name: str, value: Any) -> None:
    """A class attribute the wrappers read (removed again by :func:`uninstall`): a plain
    attribute load in the hot wrappers instead of an instance ``__dict__`` lookup."""
    _ORIGINALS.append((cls, name, cls.__dict__.get(name, _ABSENT)))
    setattr(cls, name, value)


def uninstall() -> None:
    """Takes every wrapper and class default off again, last first."""
    global _MODE
    while _ORIGINALS:
        cls, name, original = _ORIGINALS.pop()
        if original is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    _MODE = None


def unsupported(what: str) -> None:
    """kvguard cannot check ``what``: UnsupportedConfig under enforce (the engine stops), a
    warning under report (the engine runs unchecked)."""
    if _MODE == "enforce":
        raise UnsupportedConfig(f"kvguard (KVGUARD_VLLM=enforce) cannot check {what}")
    logger.warning("kvguard: cannot check %s; this engine runs unchecked", what)
