"""Model Runner V2 steps kvguard's scheduler hooks never saw, under vLLM's own EngineCore on CPU
(v2_engine.py says what is real):

- a ``--scheduler-cls`` whose ``schedule`` does not reach vLLM's ``Scheduler.schedule`` (so no
  step carries ``kvguard_events``): under enforce the engine stops at its first step that
  schedules tokens; under report it says so once and serves unchecked. (Such steps were taken
  for vLLM's warm-up and went unchecked, under enforce too.)
- vLLM's own warm-up (``warmup_kernels``, run by its worker's ``compile_or_warm_up_model``):
  made-up requests no scheduler saw, recognised as such; the engine then serves, checked.
- vLLM's engine fault tolerance (``enable_fault_tolerance``), whose recovery drops steps a
  failed worker may never have applied: refused at start-up under enforce; under report the
  engine serves unchecked, V2's own check included (it would judge every step against a table
  the scheduler no longer feeds, and refuse every request).

Its own pytest process, as the other V2 tests (TRITON_INTERPRET=1 before vLLM's import).
"""

from __future__ import annotations

import v2_engine  # noqa: I001  first: its settings must precede vLLM's import
from v2_engine import RealConfig, V2Worker

import pytest
from test_v2_runner import outputs, run_v2, workload
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

import kvguard.vllm
from kvguard.vllm.hooks import UnsupportedConfig

RC = RealConfig(num_blocks=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)


class OwnSchedule(AsyncScheduler):
    """A custom scheduler class whose ``schedule`` never reaches ``Scheduler.schedule`` as kvguard
    wrapped it: it runs vLLM's scheduling code as it was before kvguard's hooks."""

    def schedule(self, *args, **kwargs):
        unhooked = getattr(Scheduler.schedule, "__kvguard_original__", Scheduler.schedule)
        return unhooked(self, *args, **kwargs)


def own_scheduler(monkeypatch) -> None:
    """Engines built with ``scheduler_cls=OwnSchedule`` (vLLM's ``--scheduler-cls``)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        self.scheduler_cls = OwnSchedule
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)


def test_a_scheduler_that_bypasses_kvguard_stops_the_engine_under_enforce(monkeypatch):
    own_scheduler(monkeypatch)
    with pytest.raises(UnsupportedConfig, match="did not go through kvguard's scheduler hooks"):
        run_v2(RC, lambda e: workload(e, 1, 4, salts=2), guarded=True)


def test_a_scheduler_that_bypasses_kvguard_runs_unchecked_under_report(monkeypatch, kvguard_log):
    own_scheduler(monkeypatch)
    fill = lambda e: workload(e, 1, 6, salts=2)  # noqa: E731
    g = run_v2(RC, fill, guarded=True, mode="report")
    p = run_v2(RC, fill, guarded=False)
    assert type(g.scheduler) is OwnSchedule and len(p.finished) == 6
    assert g.guard is None and outputs(g) == outputs(p)
    said = [m for m in kvguard_log if "did not go through kvguard's scheduler hooks" in m]
    assert len(said) == 1 and "runs unchecked" in said[0], kvguard_log
    assert not any("refused" in m for m in kvguard_log), kvguard_log


def fault_tolerant(monkeypatch) -> None:
    """Engines built with vLLM's ``enable_fault_tolerance`` on."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        config.parallel_config.enable_fault_tolerance = True
        return config

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)


def test_fault_tolerance_stops_the_engine_at_start_under_enforce(monkeypatch):
    fault_tolerant(monkeypatch)
    with pytest.raises(UnsupportedConfig, match="fault tolerance"):
        run_v2(RC, lambda e: pytest.fail("the engine started"), guarded=True)


def test_fault_tolerance_runs_unchecked_under_report(monkeypatch, kvguard_log):
    fault_tolerant(monkeypatch)
    fill = lambda e: workload(e, 1, 6, salts=2)  # noqa: E731
    g = run_v2(RC, fill, guarded=True, mode="report")
    p = run_v2(RC, fill, guarded=False)
    assert len(p.finished) == 6
    assert g.guard is None and outputs(g) == outputs(p)
    assert any("cannot check vLLM's fault tolerance" in m and "runs unchecked" in m for m in kvguard_log), kvguard_log
    assert not any("refused" in m for m in kvguard_log), kvguard_log


class WarmingWorker(V2Worker):
    """V2Worker whose ``compile_or_warm_up_model`` runs vLLM's V2 kernel warm-up as vLLM's CPU
    worker runs it (``warmup_kernels`` through the worker's own step calls)."""

    warm_up_steps = 0

    @property
    def model_runner(self):
        return self.runner

    def initialize_from_config(self, kv_cache_config):
        # As vLLM's workers take it from WorkerWrapperBase: this rank's config.
        super().initialize_from_config([kv_cache_config])

    def compile_or_warm_up_model(self):
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu.warmup import warmup_kernels
        from vllm.v1.worker.worker_base import CompilationTimes

        before = self.steps
        with set_current_vllm_config(self.vllm_config):
            warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)
        WarmingWorker.warm_up_steps = self.steps - before
        return CompilationTimes(0.0, 0.0)


def warming_workers(monkeypatch) -> None:
    """The stand-in executor holds its worker as vLLM's executors do: a ``WorkerWrapperBase``
    whose ``init_worker`` resolves the worker class by name (a :class:`WarmingWorker`), every
    call made on that wrapper."""
    import real_engine
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    make = real_engine.executor_class

    def executor_class(rc):
        bound = make(rc)

        class Warming(bound):
            def _init_executor(self) -> None:
                self.vllm_config.parallel_config.worker_cls = f"{__name__}.WarmingWorker"
                self.wrapper = WorkerWrapperBase(rpc_rank=0)
                self.wrapper.init_worker([{"vllm_config": self.vllm_config, "rc": rc}])
                self.worker = self.wrapper.worker

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):  # noqa: ANN001
                call = getattr(self.wrapper, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
                out = [call(*args, **(kwargs or {}))]
                return real_engine._done(out) if non_block else out

        return Warming

    monkeypatch.setattr(real_engine, "executor_class", executor_class)


def test_vllms_warm_up_is_told_from_a_step_kvguard_never_saw(monkeypatch, kvguard_log):
    """vLLM's warm-up runs prefill and decode steps of made-up requests, with tokens and without
    ``kvguard_events``, before any scheduled step: the engine starts under enforce, refuses no
    one (kvguard used to check those steps and refuse the made-up requests, unknown_request, a
    refusal logged and counted at every start), and serves checked, as it serves unguarded."""
    warming_workers(monkeypatch)
    fill = lambda e: workload(e, 2, 6, salts=2)  # noqa: E731
    p = run_v2(RC, fill, guarded=False)
    WarmingWorker.warm_up_steps = 0
    g = run_v2(RC, fill, guarded=True)
    assert WarmingWorker.warm_up_steps >= 3, "vLLM's warm-up ran its steps through the runner"
    assert type(g.worker) is WarmingWorker and g.guard is not None
    assert g.refusals() == [] and g.guard.table.counters() == {}
    assert g.events.get("admit", 0) == 6
    assert outputs(g) == outputs(p) and len(g.finished) == 6
    assert not any("refused" in m for m in kvguard_log), kvguard_log
    assert kvguard.vllm.installed_mode() is None
