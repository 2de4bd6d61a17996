"""kvguard.vllm against vLLM 0.33 itself, on CPU (no GPU, no model weights, no hub).

Needs vLLM 0.33.0 and the kvguard wheel in the running interpreter (scripts/ci/vllm.sh builds
that venv); never skipped.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

import pytest

import kvguard.vllm
from real_engine import RealEngine


#: Model Runner V2's tests run in a pytest process of their own (scripts/ci/vllm.sh): V2's Triton
#: kernels need TRITON_INTERPRET=1 set before vLLM is imported, which the V1 tests run without.
collect_ignore = ["v2"]


@pytest.fixture
def enforce():
    """kvguard's hooks installed (enforce) for one test, removed after."""
    kvguard.vllm.install("enforce")
    yield
    kvguard.vllm.uninstall()


@pytest.fixture
def report_mode():
    kvguard.vllm.install("report")
    yield
    kvguard.vllm.uninstall()


def workload(engine: RealEngine, seed: int, n: int, *, shared: int = 3, salts: int = 1, max_prompt: int = 80) -> None:
    """n requests, some sharing one of ``shared`` prefixes, spread over ``salts`` tenants."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(16, 70))] for _ in range(shared)]
    for i in range(n):
        head = prefixes[rng.randrange(shared)] if shared and rng.random() < 0.6 else []
        prompt = head + [rng.randrange(500) for _ in range(rng.randrange(1, max_prompt))]
        salt = f"tenant{rng.randrange(salts)}" if salts > 1 else None
        engine.add(f"req-{i}", prompt, rng.randrange(1, 40), cache_salt=salt)


@pytest.fixture
def kvguard_log(monkeypatch):
    """The messages of the ``vllm.kvguard`` logger during one test. Read where the logger hands
    each record on (``Logger.handle``), not through a handler of the test's: vLLM's logging
    setup stops its loggers from propagating, so pytest's caplog does not see them, and each
    time vLLM applies its logging config (the first engine a process builds) ``dictConfig``
    clears the handlers of every logger under ``vllm``, a test's own among them."""
    messages: list[str] = []
    logger = logging.getLogger("vllm.kvguard")
    handle = logger.handle

    def seen(record: logging.LogRecord) -> None:
        messages.append(record.getMessage())
        handle(record)

    monkeypatch.setitem(logger.__dict__, "handle", seen)
    return messages
