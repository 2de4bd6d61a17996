"""The plugin as vLLM loads it: the entry point, the setting, the refusal on the output path."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import kvguard.vllm


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("kvguard") == "kvguard.vllm:register"


@pytest.mark.parametrize("mode", ["enforce", "report", "off"])
def test_vllm_loads_the_plugin_with_the_setting(mode):
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        "import kvguard.vllm, os; print(kvguard.vllm.installed_mode(), os.environ.get('VLLM_USE_V2_MODEL_RUNNER'))"
    )
    env = dict(os.environ, KVGUARD_VLLM=mode, VLLM_TARGET_DEVICE="cpu")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    expect = f"{None if mode == 'off' else mode} None"
    assert out.stdout.strip().splitlines()[-1] == expect


@pytest.mark.parametrize(
    "setting, named",
    [({"KVGUARD_VLLM": "enforse"}, "KVGUARD_VLLM"), ({"KVGUARD_VLLM": "enforce", "KVGUARD_VLLM_TENANT": "salt"}, "KVGUARD_VLLM_TENANT")],
    ids=["mode", "tenant"],
)
def test_a_mistyped_setting_stops_vllm_at_start_up(setting, named):
    """vLLM's own loader logs and skips a plugin whose import fails (the engine would then run
    unguarded) but lets an error of the plugin's function through: both settings are read there,
    so a mistyped one stops the engine, naming the setting."""
    code = "from vllm.plugins import load_general_plugins; load_general_plugins(); print('SERVING')"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **setting)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "SERVING" not in out.stdout, out.stdout[-2000:]
    assert f"ValueError: {named}=" in out.stderr, out.stderr[-2000:]
    assert "Failed to load plugin" not in out.stderr


def test_metrics_are_registered(enforce):
    from conftest import workload
    from real_engine import RealConfig, RealEngine
    from prometheus_client import REGISTRY

    e = RealEngine(RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512))
    workload(e, 3, 6)
    e.run()
    steps = REGISTRY.get_sample_value("kvguard_steps_total")
    assert e.guard.steps > 0 and steps is not None and steps >= e.guard.steps
    assert REGISTRY.get_sample_value("kvguard_pages", {"state": "free"}) is not None


def test_the_step_count_never_goes_down_when_an_engine_is_dropped(enforce):
    import gc

    from conftest import workload
    from real_engine import RealConfig, RealEngine
    from prometheus_client import REGISTRY

    e = RealEngine(RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512))
    workload(e, 3, 6)
    e.run()
    before = REGISTRY.get_sample_value("kvguard_steps_total")
    assert before >= e.guard.steps > 0
    del e
    gc.collect()
    assert REGISTRY.get_sample_value("kvguard_steps_total") >= before, "a counter never goes down"


def test_a_failing_metric_never_reaches_the_step(enforce, monkeypatch, kvguard_log):
    """A metrics error (a broken registry, a full disk in multiprocess mode) is logged once; the
    step is still checked, and refused requests are still refused."""
    from conftest import workload
    from real_engine import RealConfig, RealEngine
    from kvguard.vllm import metrics

    def broken(*_args, **_kwargs):
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    m = metrics.pool_metrics()
    monkeypatch.setattr(m, "violation", broken)
    monkeypatch.setattr(m, "refused", broken)
    e = RealEngine(RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512))
    workload(e, 2, 4)
    guard_of = lambda: e.guard  # noqa: E731
    e.step()
    # A refusal whose metrics fail: the table still refuses, the step goes on.
    guard = guard_of()
    from kvguard.vllm.guard import StepReport

    report = StepReport()
    guard._refuse(report, "nobody", "foreign_page", "read", "a test refusal")
    guard._metric(m.refused, 1)
    assert report.refused["nobody"].kind == "foreign_page"
    assert sum("a metrics update failed" in m for m in kvguard_log) == 1
    e.run()
    assert all(f.reason == "length" for f in e.finished.values())


def test_metrics_in_multiprocess_mode(tmp_path):
    """With ``PROMETHEUS_MULTIPROC_DIR`` (how vLLM's API server collects other processes'
    metrics) the step count and page gauges are written to the process's files every
    FLUSH_EVERY steps, where the server's collector reads them."""
    code = (
        "import kvguard.vllm\n"
        "from kvguard.vllm import metrics\n"
        "from real_engine import RealConfig, RealEngine\n"
        "from conftest import workload\n"
        "from prometheus_client import CollectorRegistry\n"
        "from prometheus_client.multiprocess import MultiProcessCollector\n"
        "kvguard.vllm.install('enforce')\n"
        "e = RealEngine(RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512))\n"
        "workload(e, 3, 12)\n"
        "e.run()\n"
        "n = e.guard.steps\n"
        "assert n >= metrics.FLUSH_EVERY, n\n"
        "r = CollectorRegistry(); MultiProcessCollector(r)\n"
        "steps = r.get_sample_value('kvguard_steps_total')\n"
        "assert steps == n - n % metrics.FLUSH_EVERY, (steps, n)\n"
        "assert r.get_sample_value('kvguard_pages', {'state': 'free'}) is not None\n"
        # A second engine after the first is dropped: its guard may land at the first one's
        # address; its count starts at 0 (a reused id made the increment negative, raising
        # inside the step), and the total only grows.
        "import gc; first = n; del e; gc.collect()\n"
        "e2 = RealEngine(RealConfig(num_blocks=64, max_num_seqs=4, max_model_len=512))\n"
        "workload(e2, 3, 12)\n"
        "e2.run()\n"
        "r = CollectorRegistry(); MultiProcessCollector(r)\n"
        "flushed = lambda n: n - n % metrics.FLUSH_EVERY\n"
        "total = r.get_sample_value('kvguard_steps_total')\n"
        "assert total == flushed(first) + flushed(e2.guard.steps), (total, first, e2.guard.steps)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), VLLM_TARGET_DEVICE="cpu")
    env.pop("KVGUARD_VLLM", None)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=here, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
