"""kvguard.vllm against vLLM 0.33 itself, on CPU (no GPU, no model, no hub).

Needs vLLM 0.33.0 and the kvguard wheel in the running interpreter (scripts/ci/vllm.sh builds
that venv); never skipped.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

import pytest

import kvguard.vllm
from engine import Engine, EngineConfig


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


def workload(engine: Engine, seed: int, n: int, *, shared: int = 3, salts: int = 1, max_prompt: int = 80) -> None:
    """n requests, some sharing one of ``shared`` prefixes, spread over ``salts`` tenants."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(16, 70))] for _ in range(shared)]
    for i in range(n):
        head = prefixes[rng.randrange(shared)] if shared and rng.random() < 0.6 else []
        prompt = head + [rng.randrange(500) for _ in range(rng.randrange(1, max_prompt))]
        salt = f"tenant{rng.randrange(salts)}" if salts > 1 else None
        engine.add(f"req-{i}", prompt, rng.randrange(1, 40), cache_salt=salt)


def run_unguarded(cfg: EngineConfig, fill) -> Engine:
    """The same workload without kvguard (hooks removed for the run, then restored)."""
    mode = kvguard.vllm.installed_mode()
    kvguard.vllm.uninstall()
    try:
        e = Engine(cfg, guarded=False)
        fill(e)
        e.run()
        return e
    finally:
        if mode is not None:
            kvguard.vllm.install(mode)
