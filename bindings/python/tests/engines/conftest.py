"""Engine plugin tests run in their engine's own venv (scripts/ci/vllm.sh, scripts/ci/sglang.sh);
the package's plain venv (scripts/ci/python.sh) does not collect them.

Whether vLLM is installed is asked of the installed distributions, not of the import system:
this directory's own `vllm/` folder would pass for a namespace package named `vllm`."""

import importlib.metadata


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = [] if _installed("vllm") else ["vllm"]
