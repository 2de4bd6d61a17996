"""The SGLang harness (harness.py) when SGLang is installed.

The package's own venv (scripts/ci/python.sh) has no SGLang: there these tests are not collected.
scripts/ci/sglang.sh runs them in the SGLang venv, where they are never skipped.
"""

import importlib.util
import os

# SGLang's Triton kernels (write_req_to_token_pool_triton) run on CPU tensors in Triton's
# interpreter; set before anything imports triton.
os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py", "harness.py"]
else:
    import pytest
    from harness import Engine, engine_factory, sglang_context  # noqa: F401

    @pytest.fixture
    def triton_rows(monkeypatch):
        """SGLang's GPU branch of the extend row write (write_req_to_token_pool_triton, on CPU
        tensors under TRITON_INTERPRET=1) instead of ReqToTokenPool.write."""
        from sglang.srt.mem_cache import allocation

        monkeypatch.setattr(allocation, "support_triton", lambda backend: True)
