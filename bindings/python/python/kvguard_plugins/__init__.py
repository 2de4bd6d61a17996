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

import os

__all__ = ["sglang", "vllm"]

# The values each plugin reads as off (anything else asks for kvguard, or is an error the
# plugin itself reports).
_VLLM_OFF = ("", "0", "off", "false", "no")
_SGLANG_OFF = ("", "off", "0", "none")


def _asked(env: str, off: tuple[str, ...]) -> bool:
    return os.environ.get(env, "").strip().lower() not in off


def vllm() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: ``kvguard.vllm.register`` when
    ``KVGUARD_VLLM`` asks for kvguard (an error loading kvguard then stops the engine)."""
    if not _asked("KVGUARD_VLLM", _VLLM_OFF):
        return
    try:
        from kvguard.vllm import register
    except Exception as e:
        raise RuntimeError(
            f"kvguard: KVGUARD_VLLM={os.environ['KVGUARD_VLLM']!r} but kvguard cannot be loaded ({e!r}); "
            "refusing to serve unguarded"
        ) from e
    register()


def sglang() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point: ``kvguard.sglang.register`` when
    ``KVGUARD_SGLANG`` asks for kvguard (an error loading kvguard then stops the scheduler)."""
    if not _asked("KVGUARD_SGLANG", _SGLANG_OFF):
        return
    try:
        from kvguard.sglang import register
    except Exception as e:
        error = RuntimeError(
            f"kvguard: KVGUARD_SGLANG={os.environ['KVGUARD_SGLANG']!r} but kvguard cannot be loaded ({e!r}); "
            "refusing to serve unguarded"
        )
        # SGLang's loader logs a plugin's exception and serves on: every scheduler is stopped at
        # start-up instead (its __init__ raises, which ends the server).
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        def refuse_to_start(*_args: object, **_kwargs: object) -> None:
            raise error

        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.__init__", refuse_to_start, HookType.AFTER)
        raise error from e
    register()
