"""Where kvguard attaches to vLLM 0.33, and why each attachment is a wrapper.

vLLM offers ``vllm.general_plugins`` (code run in every process it starts) but no callback on
the KV cache manager's decisions nor on the worker's block table, so the plugin wraps these
methods at load, on the classes, once (each wrapper calls the original and only observes, except
the two marked *acts*):

scheduler process (engine core)
  ``req_to_blocks`` of the manager       a dict of per-request lists that report what the manager
                                         adds: prefix-cache hits (blocks with a hash), new blocks
                                         (without one) and the evictions they cost (new blocks the
                                         recorder had published); not a method: the manager's
                                         attribute is replaced, same contents
  ``BlockPool.cache_full_blocks``        blocks that became cacheable
  ``KVCacheManager.free``                free on finish (release) and on preemption
  ``KVCacheManager.pop_blocks_for_free`` the same, for vLLM's deferred frees
  ``KVCacheManager.reset_prefix_cache``  every cached block dropped
  ``SingleTypeKVCacheManager._remove_blocks_in_range``  a sliding window dropped blocks that left
                                         it (partial releases of the request)
  ``BlockPool.evict_blocks``             a KV connector's evictions (unsupported; recorded)
  ``Scheduler.__init__``                 what kvguard cannot check, found at start-up (enforce:
                                         ``UnsupportedConfig`` stops the engine)
  ``Scheduler.schedule``                 the step's events put on ``SchedulerOutput.kvguard_events``
  ``Scheduler.update_from_output``       *acts*: the refused requests' tokens of the step are
                                         dropped and those requests end with FINISHED_ERROR and a
                                         ``RequestError`` the client sees (vLLM's per-request
                                         error path, the one grammar errors take); the blocks they
                                         published leave the prefix cache
worker process
  ``GPUModelRunner._update_states``      a step that schedules no tokens (the runner returns
                                         before ``_prepare_inputs``): its events applied
  ``GPUModelRunner._prepare_inputs``     *acts*: the check, after ``_update_states`` built the
                                         persistent batch and before ``commit_block_table`` copies
                                         it; under enforce refused rows are nulled
  ``GPUModelRunner.execute_model`` / ``sample_tokens``  refusals put on the ModelRunnerOutput
                                         (``kvguard_refused``) that goes back to the scheduler
worker process, Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``; vLLM's CPU
platform runs it as ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``)
  ``GPUModelRunner.prepare_attn``        *acts*: the check of what V2 hands attention, the gathered
                                         block tables and slot mappings its kernels just built
                                         (host tensors on the CPU platform, read in place; device
                                         tensors on a GPU, checked and fenced by kvguard's
                                         kernels on vLLM's stream: ``kvguard.vllm.device``); under
                                         enforce a refused request's rows and slots are nulled
  ``BlockTables.append_block_ids``       on a GPU only: the host copy of the rows V2 stages
  ``GPUModelRunner.initialize_kv_cache`` the runner's guard made with its pool (start-up: what
                                         kvguard cannot check stops the engine there)
  ``GPUModelRunner.execute_model``       a step with no tokens (returns before ``prepare_attn``):
                                         its events applied; refusals put on the output. A step
                                         with tokens and no events that is not vLLM's warm-up
                                         stops the engine (enforce)
  ``WorkerWrapperBase.initialize_from_config``  marks the worker class's
                                         ``compile_or_warm_up_model``, where vLLM's warm-ups run
                                         made-up requests (not checked)
  ``GPUModelRunner.sample_tokens``       refusals put on the (async) output (``pool``'s too, for
                                         a pooling model)

The scheduler's truth reaches the worker on the ``SchedulerOutput`` it already sends each step
(by reference in-process, pickled through vLLM's shared-memory broadcast otherwise), and the
refusals come back on the ``ModelRunnerOutput`` the same way: no extra channel, no extra round
trip. Supported: full-attention and sliding-window KV cache groups (hybrid models too), block
size equal to the hash block size, no KV connector, no speculative decoding (nor a diffusion
model, which runs on its path), no context parallelism, vLLM's V1 model runner
(``CPUModelRunner`` is a subclass), and Model Runner V2 with the same groups (on host
memory, vLLM's CPU platform, and on a GPU through the device check); anything else is
found when vLLM builds its scheduler (a wrapper on ``Scheduler.__init__``): refused there under
enforce, so the engine never starts, and left unchecked (with a warning) under report.

The wrappers live by side: :mod:`kvguard.vllm.scheduler_side`, :mod:`kvguard.vllm.runner_v1`,
:mod:`kvguard.vllm.runner_v2`; what kvguard can check is read in :mod:`kvguard.vllm.support`,
and every wrapper attaches and comes off through :mod:`kvguard.vllm.attach`.
"""

from __future__ import annotations

import logging

from . import runner_v1, runner_v2, scheduler_side
from .attach import UnsupportedConfig, installed_mode, set_mode, uninstall, unsupported
from .runner_v1 import annotate_output, worker_step
from .scheduler_side import withheld_output

__all__ = [
    "UnsupportedConfig",
    "annotate_output",
    "install",
    "installed_mode",
    "uninstall",
    "withheld_output",
    "worker_step",
]

logger = logging.getLogger("vllm.kvguard")


def install(mode: str) -> None:
    """Wraps vLLM's methods in this process (idempotent; a second mode replaces the first)."""
    if installed_mode() is not None:
        set_mode(mode)
        return
    set_mode(mode)
    # The user's runner is theirs to pick: kvguard checks the V1 runner, and V2 on host memory
    # (vLLM's CPU platform) and on a GPU (vLLM's default where Triton runs: the device check).
    scheduler_side.install()
    try:
        runner_v1.install()
    except ImportError as e:  # a platform without the GPU model runner module
        unsupported(f"this worker ({e})")
    runner_v2.install()
    logger.info("kvguard: checking every step's block table (%s)", mode)
