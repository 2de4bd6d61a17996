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
    assert names.get("kvguard") == "kvguard_plugins:vllm"


@pytest.mark.parametrize("mode", ["enforce", "off"])
def test_a_kvguard_that_cannot_load_stops_vllm_when_it_was_asked_for(mode):
    """vLLM's loader logs and skips a plugin whose import fails, and would serve unguarded: the
    entry point (``kvguard_plugins.vllm``) imports nothing of kvguard, and a kvguard that cannot
    be loaded (here its native library) stops the engine when ``KVGUARD_VLLM`` asks for it.
    Without the setting nothing of kvguard is imported."""
    code = (
        "import sys; sys.modules['kvguard._kvguard'] = None;"
        "from vllm.plugins import load_general_plugins; load_general_plugins();"
        "print('SERVING', 'kvguard' in sys.modules)"
    )
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", KVGUARD_VLLM=mode)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if mode == "off":
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "SERVING False", out.stderr[-2000:]
        return
    assert out.returncode != 0 and "SERVING" not in out.stdout, out.stdout[-2000:]
    assert "kvguard cannot be loaded" in out.stderr and "refusing to serve unguarded" in out.stderr, out.stderr[-2000:]


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
    [
        ({"KVGUARD_VLLM": "enforse"}, "KVGUARD_VLLM"),
        ({"KVGUARD_VLLM": "enforce", "KVGUARD_VLLM_TENANT": "salt"}, "KVGUARD_VLLM_TENANT"),
        # Empty (a template's unset variable): not one tenant for everyone by omission.
        ({"KVGUARD_VLLM": "enforce", "KVGUARD_VLLM_TENANT": ""}, "KVGUARD_VLLM_TENANT"),
        ({"KVGUARD_VLLM": "enforce", "KVGUARD_VLLM_TENANT": " , "}, "KVGUARD_VLLM_TENANT"),
        ({"KVGUARD_VLLM": "enforce", "KVGUARD_VLLM_TENANT": "none,lora"}, "KVGUARD_VLLM_TENANT"),
    ],
    ids=["mode", "tenant", "tenant-empty", "tenant-blank", "tenant-none-and-more"],
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


def test_an_idle_steps_output_takes_no_device_verdict():
    """Model Runner V2 on a GPU, async scheduling: a step with no tokens (its output made at
    ``execute_model``) while the last checked step's output is still on its way. The device's
    verdicts on that checked step ride its own output, never the idle one's: the idle output
    taking them would let the refused request's tokens of the checked step leave."""
    from types import SimpleNamespace

    from kvguard.vllm import hooks
    from kvguard.vllm.device import V2Device

    class Ring:  # the device's violation ring; every copy lands at once
        def __init__(self):
            self.records, self.copy = [], None
            self.findings_lost = 0

        def begin_drain(self, *, stream):
            self.copy, self.records = self.records, []

        def finish_drain(self, table, *, stream, wait=True):
            out, self.copy = self.copy, None
            return out

    class Refusal:
        def client_message(self, rid):
            return f"kvguard refused {rid}"

    class Guard:
        mode = "enforce"
        table = None

        def device_refused(self, records, lost=()):
            return SimpleNamespace(refused={rid: Refusal() for rid in [*records, *lost]})

    ring = Ring()
    guard = Guard()
    guard.device = V2Device(ring, None, lambda: 3)
    owner = SimpleNamespace()
    owner._kvguard = guard
    # Step 1 is checked; the device flags request "a"; its output is asynchronous.
    guard.device.stream()
    ring.records.append("a")
    guard.device.begin_drain(guard)
    step1 = SimpleNamespace(get_output=lambda: SimpleNamespace(req_id_to_index={"a": 0}))
    step1 = hooks.annotate_output(owner, step1)
    # Step 2 schedules nothing: its output is made (and taken) first.
    idle = hooks.annotate_output(owner, SimpleNamespace(req_id_to_index={}), checked=False)
    assert not getattr(idle, "kvguard_refused", None)
    assert step1.get_output().kvguard_refused == {"a": "kvguard refused a"}


def test_a_pipeline_stage_before_the_last_lets_its_refusals_go():
    """With pipeline parallelism a stage before the last returns vLLM's ``IntermediateTensors``
    (its output goes to the next stage, not the scheduler; the last stage refuses the same
    requests): the refusals its check kept for an output are let go there, not kept step after
    step. A last stage's output still carries them."""
    from types import SimpleNamespace

    import torch
    from vllm.sequence import IntermediateTensors

    from kvguard.vllm import hooks, runner_v1

    class Refusal:
        def client_message(self, rid):
            return f"kvguard refused {rid}"

    guard = SimpleNamespace(mode="enforce", device=None)
    stage, last = SimpleNamespace(_kvguard=guard), SimpleNamespace(_kvguard=guard)
    for step in range(3):
        report = SimpleNamespace(refused={f"r{step}": Refusal()})
        for owner in (stage, last):
            runner_v1.pend(owner, guard, report)
        hidden = IntermediateTensors({"hidden_states": torch.zeros(1)})
        assert hooks.annotate_output(stage, hidden) is hidden
        assert not stage._kvguard_refused, "a stage before the last keeps nothing"
        out = hooks.annotate_output(last, SimpleNamespace(req_id_to_index={f"r{step}": 0}))
        assert out.kvguard_refused == {f"r{step}": f"kvguard refused r{step}"}


def test_a_device_finding_whose_record_was_lost_refuses_every_request_its_step_read():
    """Model Runner V2 on a GPU: the device flags a sequence of a step and its ring loses the
    record (``DeviceGuard.findings_lost`` grows): the sequence was fenced on the device, and the
    host cannot tell which request it was. Each request the step's device checks read is
    refused, through vLLM's own refusal path (:class:`~kvguard.vllm.guard.StepGuard`); the next
    step's requests are not."""
    from types import SimpleNamespace

    import torch

    from kvguard.vllm import hooks
    from kvguard.vllm.device import V2Device
    from kvguard.vllm.guard import StepGuard

    class Device:  # DeviceGuard's calls a V2 step makes; every copy lands at once
        def __init__(self):
            self.records, self.copy, self.findings_lost, self.lost, self.readers = [], None, 0, 0, []

        def sync_tags(self, table, *, stream):
            return 0

        def set_readers(self, table, req_ids, *, stream):
            self.readers = list(req_ids)

        def clear_status(self, *, stream):
            pass

        def verify_slot_mapping(self, slot_mapping, num_tokens, query_start_loc, num_seqs, *, stream):
            pass

        def begin_drain(self, *, stream):
            self.copy, self.records = (self.records, self.lost), []

        def finish_drain(self, table, *, stream, wait=True):
            (out, self.findings_lost), self.copy = self.copy, None
            return out

    guard = StepGuard(32, 4, 64, "enforce")
    dev = Device()
    guard.device = V2Device(dev, None, lambda: 3)
    owner = SimpleNamespace(_kvguard=guard)

    def v2_step(req_ids, *, lose):
        n = len(req_ids)
        guard.device.stream()
        guard.device.check_writes(guard, req_ids, torch.zeros((1, n), dtype=torch.int64), torch.arange(n + 1, dtype=torch.int32), n)
        dev.lost += lose
        guard.device.begin_drain(guard)
        out = SimpleNamespace(get_output=lambda: SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)}))
        return hooks.annotate_output(owner, out).get_output()

    first = v2_step(["a", "b"], lose=1)
    assert set(first.kvguard_refused) == {"a", "b"}
    assert all("device_findings_lost" in m for m in first.kvguard_refused.values()), first.kvguard_refused
    second = v2_step(["c"], lose=0)
    assert not getattr(second, "kvguard_refused", None)


def test_a_refused_requests_step_output_carries_nothing_of_it():
    """What the scheduler reads of a refused request's step: no sampled token, no prompt logprobs
    (vLLM asserts that prompt logprobs come only with an output: left in, a refused request at
    its last prompt chunk would stop the engine, every request with it), no pooling output. The
    bystanders' entries are kept, and vLLM's own output object is left as it was."""
    import torch
    from vllm.v1.outputs import ModelRunnerOutput

    from kvguard.vllm.hooks import withheld_output

    lp = object()
    out = ModelRunnerOutput(
        req_ids=["a", "b"],
        req_id_to_index={"a": 0, "b": 1},
        sampled_token_ids=[[5], [6]],
        prompt_logprobs_dict={"a": lp, "b": lp},
        prompt_token_id_logprobs_dict={"a": torch.zeros(1), "b": torch.ones(1)},
        pooler_output=[torch.zeros(2), torch.ones(2)],
    )
    got = withheld_output(out, {"a": "kvguard refused a"})
    assert got.sampled_token_ids == [[], [6]]
    assert got.prompt_logprobs_dict == {"b": lp}
    assert list(got.prompt_token_id_logprobs_dict) == ["b"]
    assert got.pooler_output[0] is None and torch.equal(got.pooler_output[1], torch.ones(2))
    assert out.sampled_token_ids == [[5], [6]] and set(out.prompt_logprobs_dict) == {"a", "b"}
    assert out.pooler_output[0] is not None


def test_a_tenant_mapping_that_fails_gives_the_request_a_tenant_of_its_own():
    """A tenant mapping (``set_tenant_of``) that raises, or returns something other than a str,
    for one request gives that request a tenant of its own: it shares nothing with anyone, and
    the engine keeps serving (the error is logged)."""
    from types import SimpleNamespace

    from kvguard.vllm import recorder

    def mapping(request):
        if request.request_id == "odd":
            raise KeyError("no tenant header")
        return None if request.request_id == "none" else "acme"

    recorder.set_tenant_of(mapping)
    try:
        assert recorder.tenant_of(SimpleNamespace(request_id="ok")) == "acme"
        odd = recorder.tenant_of(SimpleNamespace(request_id="odd"))
        none = recorder.tenant_of(SimpleNamespace(request_id="none"))
        assert len({odd, none, "acme"}) == 3 and "odd" in odd and "none" in none
    finally:
        recorder.set_tenant_of(None)


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_model_runner_v2_whose_hooks_fail_never_runs_unguarded(mode, monkeypatch, kvguard_log):
    """A vLLM whose Model Runner V2 imports but a part kvguard hooks does not (here its block
    tables' module): under enforce a V2 runner refuses to start; under report it starts, and the
    log says it runs unchecked. Before, the failure was logged at debug and V2 ran unguarded."""
    from vllm.v1.worker.gpu import model_runner as v2

    from kvguard.vllm import attach, hooks, runner_v2

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.block_table", None)  # its import fails
    monkeypatch.setattr(attach, "_MODE", mode)
    started = []
    monkeypatch.setattr(v2.GPUModelRunner, "__init__", lambda self, *a, **k: started.append(self))
    runner_v2.install()
    runner = object.__new__(v2.GPUModelRunner)
    if mode == "enforce":
        with pytest.raises(hooks.UnsupportedConfig, match="Model Runner V2"):
            v2.GPUModelRunner.__init__(runner)
        assert started == []
    else:
        v2.GPUModelRunner.__init__(runner)
        assert started == [runner]
        assert any("runs unchecked" in m for m in kvguard_log), kvguard_log
