"""Engine plugin tests run in their engine's own venv (scripts/ci/vllm.sh); the package's plain
venv (scripts/ci/python.sh) does not collect them."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
