"""The engines' plugin entry points for kvguard, importing nothing of kvguard until a setting
asks for it.

vLLM and SGLang load their plugins by entry point and only log a plugin whose import fails,
then serve without it. Were the entry point inside the ``kvguard`` package, a broken install
(its native library missing or built for another machine) would fail at import and leave the
engine serving unguarded although ``KVGUARD_VLLM`` / ``KVGUARD_SGLANG`` asked for kvguard. Here
the import cannot fail; kvguard is imported inside the call the engine makes, where an error
stops the engine:

- ``vllm.general_plugins``: :func:`vllm` (``kvguard.vllm.register``);
- ``sglang.srt.plugins``: :func:`sglang` (``kvguard.sglang.register``).

Without the setting (unset, empty, ``off``) neither imports kvguard.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

__all__ = ["sglang", "vllm"]

# The values each plugin reads as off (anything else asks for kvguard, or is an error the
# plugin itself reports).
_VLLM_OFF = ("", "0", "off", "false", "no")
_SGLANG_OFF = ("", "off", "0", "none")


def _register(env: str, off: tuple[str, ...], engine: str) -> Callable[[], None] | None:
    """``kvguard.<engine>.register`` when the setting ``env`` asks for kvguard (None when it is
    off); a RuntimeError naming the setting and the cause when kvguard cannot be loaded."""
    setting = os.environ.get(env, "")
    if setting.strip().lower() in off:
        return None
    try:
        return importlib.import_module(f"kvguard.{engine}").register
    except Exception as e:
        raise RuntimeError(
            f"kvguard: {env}={setting!r} but kvguard cannot be loaded ({e!r}); refusing to serve unguarded"
        ) from e


def vllm() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: ``kvguard.vllm.register`` when
    ``KVGUARD_VLLM`` asks for kvguard (an error loading kvguard then stops the engine)."""
    register = _register("KVGUARD_VLLM", _VLLM_OFF, "vllm")
    if register is not None:
        register()


def sglang() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point: ``kvguard.sglang.register`` when
    ``KVGUARD_SGLANG`` asks for kvguard (an error loading kvguard then stops every scheduler)."""
    try:
        register = _register("KVGUARD_SGLANG", _SGLANG_OFF, "sglang")
    except RuntimeError as error:
        # SGLang's loader logs a plugin's exception and serves on: every scheduler is stopped at
        # start-up instead (its __init__ raises, which ends the server).
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        refusal = error  # (the except clause's name is gone once it ends)

        def refuse_to_start(*_args: object, **_kwargs: object) -> None:
            raise refusal

        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.__init__", refuse_to_start, HookType.AFTER)
        raise
    if register is not None:
        register()
