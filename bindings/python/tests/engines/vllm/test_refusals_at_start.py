"""What kvguard cannot check stops vLLM's engine as it starts (enforce), or leaves it serving
unchecked with a warning (report), never checking it wrongly: vLLM's own EngineCore, scheduler
and V1 model runner (real_engine.py), with the setting vLLM's own config path builds.

- decode context parallelism: the scheduler's blocks are ``block_size x dcp`` tokens
  (``resolve_kv_cache_block_sizes``) while the worker's block table keeps per-rank blocks; checked
  as they are, every request was refused (``reserved_page``); prefill context parallelism
  shards the KV cache across ranks too;
- a diffusion (dLLM) model: its canvas runs on the speculative-decoding path (draft tokens whose
  rejection rolls the computed-token count back), with no ``speculative_config``;
- vLLM's engine fault tolerance: its recovery aborts every request and drops the queued steps,
  whose ownership events a failed worker may never have applied (the table would then hold
  pages vLLM handed to others, and refuse the requests given them).
"""

from __future__ import annotations

import pytest
from conftest import workload
from real_engine import RealConfig
from test_real_engine import outputs, run_real

from kvguard.vllm.hooks import UnsupportedConfig

RC = RealConfig(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)


def with_config(monkeypatch, before=None, after=None) -> None:
    """vLLM's ``EngineArgs.create_engine_config`` with ``before(args)`` run on the engine args it
    reads and ``after(config)`` on the ``VllmConfig`` it returns."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if before is not None:
            before(self)
        config = original(self, *args, **kwargs)
        if after is not None:
            after(config)
        return config

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)


def decode_context_parallel(monkeypatch) -> None:
    def dcp(config) -> None:
        config.parallel_config.decode_context_parallel_size = 2

    with_config(monkeypatch, after=dcp)


def prefill_context_parallel(monkeypatch) -> None:
    def pcp(config) -> None:
        config.parallel_config.prefill_context_parallel_size = 2

    with_config(monkeypatch, after=pcp)


def diffusion(monkeypatch) -> None:
    def canvas(args) -> None:
        args.diffusion_config = {"canvas_length": 4}

    with_config(monkeypatch, before=canvas)


def fault_tolerance(monkeypatch) -> None:
    def tolerant(config) -> None:
        config.parallel_config.enable_fault_tolerance = True

    with_config(monkeypatch, after=tolerant)


SETTINGS = {
    "decode-context-parallel": (decode_context_parallel, "context parallelism"),
    "prefill-context-parallel": (prefill_context_parallel, "context parallelism"),
    "diffusion": (diffusion, "a diffusion model"),
    "fault-tolerance": (fault_tolerance, "vLLM's fault tolerance"),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_refused_when_the_engine_starts_under_enforce(setting, monkeypatch):
    """Refused as vLLM builds its scheduler, before any request."""
    configure, named = SETTINGS[setting]
    configure(monkeypatch)
    with pytest.raises(UnsupportedConfig, match=named):
        run_real(RC, lambda e: pytest.fail("the engine started"), guarded=True)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_runs_unchecked_under_report(setting, monkeypatch, kvguard_log):
    """Under report the engine serves as it does without kvguard, with a warning; the worker
    judges nothing (no guard, no refusal logged): under decode context parallelism the V1
    worker's check (``_guard_of``) refused every request."""
    configure, named = SETTINGS[setting]
    configure(monkeypatch)
    fill = lambda e: workload(e, 5, 24, salts=2)  # noqa: E731
    g = run_real(RC, fill, guarded=True, mode="report")
    p = run_real(RC, fill, guarded=False)
    assert len(p.finished) == 24
    assert g.guard is None and g.refusals() == []
    assert outputs(g) == outputs(p)
    assert any(f"cannot check {named}" in m and "runs unchecked" in m for m in kvguard_log), kvguard_log
    assert not any("refused" in m for m in kvguard_log), kvguard_log


@pytest.mark.parametrize("worker", ["unguarded", "report", "unreachable"])
def test_a_worker_that_does_not_check_in_the_schedulers_mode_stops_the_engine(worker, monkeypatch):
    """vLLM loads plugins in each process on its own: a worker without kvguard (``unguarded``: a
    node without the setting, or ``VLLM_PLUGINS`` leaving it out), in another mode, or that
    cannot run kvguard's function (``unreachable``: kvguard not installed there) would run its
    steps unchecked while the scheduler records them. EngineCore's start-up asks every worker
    (``collective_rpc``); under enforce such a worker stops the engine before any request."""
    from kvguard.vllm import scheduler_side

    def answer(_worker):
        if worker == "unreachable":
            raise ModuleNotFoundError("No module named 'kvguard'")
        return None if worker == "unguarded" else "report"

    monkeypatch.setattr(scheduler_side, "worker_mode", answer)
    with pytest.raises(UnsupportedConfig, match="worker"):
        run_real(RC, lambda e: pytest.fail("the engine started"), guarded=True)


def test_workers_in_the_schedulers_mode_start_and_are_asked_once(monkeypatch):
    """The handshake's other side: every worker answers the scheduler's mode, the engine serves."""
    from kvguard.vllm import scheduler_side

    asked = []
    real = scheduler_side.worker_mode
    monkeypatch.setattr(scheduler_side, "worker_mode", lambda w: asked.append(w) or real(w))
    g = run_real(RC, lambda e: workload(e, 5, 8, salts=2), guarded=True)
    assert len(g.finished) == 8 and g.refusals() == []
    assert len(asked) == 1
