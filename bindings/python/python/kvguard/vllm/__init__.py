"""kvguard inside vLLM (v1 engine, vLLM 0.33): every step's block table verified against an
independent ownership table before it reaches the GPU.

Turn it on with one setting in the environment vLLM starts from (it is inherited by the engine
core and worker processes)::

    KVGUARD_VLLM=enforce vllm serve ...   # refuse: abort exactly the refused requests
    KVGUARD_VLLM=report  vllm serve ...   # shadow roll-out: log and count, change nothing

kvguard checks vLLM's V1 model runner and Model Runner V2, with full-attention and
sliding-window KV cache groups (hybrid models too); V2 on host memory (vLLM's CPU platform) in
place, on a GPU (vLLM 0.33's default where Triton runs) through the device check
(:mod:`kvguard.vllm.device`; not yet run on a GPU). Speculative decoding, another kind of KV
cache group or a KV connector does not start under ``enforce`` and runs unchecked, with a
warning, under ``report``.

vLLM loads this module through its ``vllm.general_plugins`` entry point (``kvguard``) in every
process it starts; without ``KVGUARD_VLLM`` the plugin does nothing.

Two halves, one per side of vLLM:

- the **scheduler side** (:mod:`kvguard.vllm.recorder`) turns the KV cache manager's own
  decisions (allocation, prefix-cache hits, blocks that became cacheable, eviction, free on
  finish and on preemption) into ownership events, carried to the worker on the step's
  ``SchedulerOutput``;
- the **worker side** (:mod:`kvguard.vllm.guard`) applies them to its ownership table, records
  the step's KV writes (the slot mapping the block table yields), and verifies the exact int32
  block table the worker is about to copy to the GPU, with the token counts attention reads.

The tenant of a request is its ``cache_salt`` and LoRA name by default
(:func:`set_tenant_of` or ``KVGUARD_VLLM_TENANT`` change that). See docs/vllm.md.
"""

from __future__ import annotations

import os

from .guard import StepGuard, StepReport
from .recorder import EventKind, SchedulerRecorder, StepEvents, set_tenant_of, tenant_of

__all__ = [
    "EventKind",
    "MODE_ENV",
    "SchedulerRecorder",
    "StepGuard",
    "StepEvents",
    "StepReport",
    "install",
    "installed_mode",
    "register",
    "set_tenant_of",
    "tenant_of",
    "uninstall",
]

#: The environment variable that turns the plugin on: ``enforce`` or ``report``.
MODE_ENV = "KVGUARD_VLLM"

_MODES = ("enforce", "report")


def _mode_from_env() -> str | None:
    raw = os.environ.get(MODE_ENV, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw not in _MODES:
        raise ValueError(f"{MODE_ENV}={raw!r}: expected 'enforce', 'report' or 'off'")
    return raw


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the hooks when ``KVGUARD_VLLM`` is
    ``enforce`` or ``report`` (vLLM calls this once per process; calling it again is a no-op)."""
    # Both settings are read here, not at import: vLLM logs and skips a plugin whose import
    # fails (serving unguarded), but an error raised by register() stops the engine.
    mode = _mode_from_env()
    if mode is not None:
        install(mode)


def install(mode: str = "enforce") -> None:
    """Installs kvguard's hooks into vLLM's classes in this process (what :func:`register` does
    when the setting is on). ``mode`` is ``enforce`` or ``report``."""
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r}: expected 'enforce' or 'report'")
    from . import hooks, recorder

    recorder.check_settings()
    hooks.install(mode)


def uninstall() -> None:
    """Removes the hooks (tests compare runs with and without kvguard in one process)."""
    from . import hooks

    hooks.uninstall()


def installed_mode() -> str | None:
    """``enforce``/``report`` while the hooks are installed, else None."""
    from . import hooks

    return hooks.installed_mode()
