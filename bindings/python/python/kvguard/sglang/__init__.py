"""kvguard inside SGLang (0.5.23): shadow ownership of SGLang's own pool, checked at its own calls.

Turned on with one setting: ``KVGUARD_SGLANG=enforce`` (or ``report``) in the environment of
``python -m sglang.launch_server``. The kvguard wheel declares an entry point in SGLang's general
plugin group ``sglang.srt.plugins``; SGLang's ``load_plugins()`` runs it first thing in every
scheduler process (``run_scheduler_process``), and :func:`register` registers five hooks with
SGLang's own ``HookRegistry`` (no SGLang source changed, nothing imported at start-up when the
setting is unset):

- ``Scheduler.__init__`` (after): a :class:`Guard` over the scheduler's ``req_to_token_pool``,
  ``token_to_kv_pool_allocator``, ``tree_cache`` and KV pool, audited against the model's
  context length (a pool that cannot hold one max-context request refuses to start);
- ``Scheduler._add_request_to_queue`` (around): the intake check; a refused request is answered
  with an abort (HTTP 400, ``KVGuardViolation``) and never queued;
- ``ModelRunner.forward`` (around): the forward batch's writes, rows and sequence lengths,
  checked before any layer runs (below);
- ``SchedulerOutputStreamer.stream_output`` (around): the whole row of each request whose output
  is about to leave, checked first;
- ``Scheduler._release_aborted_request`` (after): a request aborted while queued (no row) ends in
  kvguard too.

SGLang's ``SGLANG_PLUGINS`` whitelist, when set, must name ``kvguard``.

What the :class:`Guard` hooks on the instances:

- ``ReqToTokenPool.alloc`` / ``free``: a request gets a row (its block table) / gives it back.
- ``ReqToTokenPool.write``: slots written into a row, i.e. the pages attention will read for that
  request. A fresh page is claimed for the row's request; a radix-cache page is attached (held
  read-only, same tenant only); anything else is refused on that request. A decode step's write
  (one slot per row) is judged in one ``write_decode_rows`` call.
- ``mem_cache.allocation.write_cache_indices``: an extend batch's row write on both of SGLang's
  branches (on a GPU it writes with ``write_req_to_token_pool_triton``, not
  ``ReqToTokenPool.write``): the allocator's ``out_cache_loc`` claimed, the radix cache's prefix
  attached, never taken from the rows.
- ``managers.schedule_batch.alloc_for_extend`` / ``alloc_for_decode``: the batch's requests, so a
  request using a row it no longer holds (a stale ``req_pool_idx``) is refused, never the row's
  new owner.
- allocator: what it handed out (its decision, not a row) read from its own free list when a
  free names no freer (SGLang's two pool allocators; any other allocator's ``alloc`` /
  ``alloc_extend`` / ``alloc_decode`` marks each page it hands out instead). ``free`` / ``free_page_ids`` inside a free group: judged where the free is made,
  with its freer, not at ``free_group_end``. ``_release_page_ids`` (paged) / ``free`` (page size
  1): the release every free ends in. Who frees is known from the caller hooked above it:
  ``free_kv_row`` (a request gives back its row's pages), ``evict`` (the radix cache drops a
  leaf), ``checkpoint`` (a request's duplicates of cached pages). A page its freer does not
  hold, a free by no request of a page a live request or the radix cache holds, and a page
  never handed out (already free) are refused and kept out of SGLang's free list (one page is
  never handed to two requests); a page handed out and held by nobody goes back.
- ``output_streamer._GenerationStreamAccumulator.to_payload`` (wrapped once per process): while
  a guarded scheduler's ``stream_output`` runs, the rows of exactly the requests SGLang is about
  to send are checked in full first (a refused running request is taken out of the payload).
- the radix cache's ``insert`` / ``checkpoint`` / ``evict`` (and ``UnifiedRadixCache._evict``, SGLang
  0.5.23's default cache, which evicts there for an allocation too): pages entering the tree are published as
  read-only prefixes (one key per page, so node splits change nothing); an evicted page whose
  prefix a running request still holds is refused (``evict_in_use``) and withheld until its last
  holder lets go.
- the forward, at ``ModelRunner.forward``'s entry (not at a layer's KV store: SGLang replays a
  captured CUDA graph for most decode batches, where no Python runs per layer): the step's writes
  (``out_cache_loc``) recorded in one ``record_step_writes``, then the ``req_to_token`` rows and
  sequence lengths attention will read verified in one ``verify_step_rows`` (on the host) or by
  :class:`kvguard.DeviceGuard` on SGLang's stream (rows on a GPU). On the host a decode forward
  records its writes and checks each row's window only in one ``check_decode_forward`` (the
  tokens written since the row's last clean check); a release, eviction, violation or import anywhere, a row rewritten below its
  checked length, and every ``Guard.full_check_every``-th forward make it a full check. A refused
  row's writes go to the padding slot (the forward batch's ``out_cache_loc`` replaced by a copy,
  which every layer, and a graph replay, writes through) and the request is aborted.

Refusal under ``enforce``: exactly the refused request is aborted (``req.to_finish =
FINISH_ABORT``, the error its client receives), nothing is raised into the scheduler loop, which
keeps serving the others. Under ``report``: logged on the ``sglang.srt.kvguard`` logger, counted
in ``Guard.metrics`` and on Prometheus (``kvguard_violations_total{kind,policy}``,
``kvguard_refused_requests_total``); SGLang runs as before.

PD disaggregation: :func:`audit_pd` refuses a deployment whose prefill or decode pool cannot hold
one max-context request; :class:`GuardedKVSender` / :class:`GuardedKVReceiver` wrap SGLang's
``BaseKVSender`` / ``BaseKVReceiver`` (mooncake, nixl, mori, ascend, fake) so that every transfer
carries a kvguard manifest and the decode side refuses one that is missing or does not match. In
a PD scheduler the plugin wraps every sender / receiver SGLang creates
(``PrefillBootstrapQueue.create_sender``, ``DecodePreallocQueue._create_receiver_and_enqueue``),
the manifests on the channel ``KVGUARD_SGLANG_PD_CHANNEL`` names (``tcp://HOST:PORT``, prefill
listening and decode connecting, frames authenticated with ``KVGUARD_SGLANG_PD_KEY``; a directory
both sides see; or ``process``); under enforce a PD scheduler it cannot wrap does not start. The decode side's
preallocation (``disaggregation.decode.alloc_for_decode_prealloc``) claims its pages from the
allocator's decision.
"""

from __future__ import annotations

import logging
import os
from http import HTTPStatus
from typing import Any

from .guard import Guard, NamedViolation, audit_pd, audit_pool
from .. import ConfigError
from .process_hooks import STREAMING
from .pd import ENV_CHANNEL, DirectoryChannel, GuardedKVReceiver, GuardedKVSender, ManifestChannel, channel_from_env, install_pd
from .retraction import _BACKUPS_ATTR
from .pd_net import TcpChannel

__all__ = [
    "ENV_CHANNEL",
    "ENV_POLICY",
    "DirectoryChannel",
    "Guard",
    "GuardedKVReceiver",
    "GuardedKVSender",
    "ManifestChannel",
    "NamedViolation",
    "TcpChannel",
    "audit_pd",
    "audit_pool",
    "installed_mode",
    "register",
]

ENV_POLICY = "KVGUARD_SGLANG"
"""The one setting: ``enforce`` or ``report`` turns the guard on in every SGLang scheduler."""

logger = logging.getLogger("sglang.srt.kvguard")

_MODE: str | None = None

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_OUTPUT_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"


def _mode_from_env() -> str | None:
    """``enforce``/``report`` from ``KVGUARD_SGLANG``; None when unset, empty or ``off``."""
    value = os.environ.get(ENV_POLICY, "").strip().lower()
    if value in ("", "off", "0", "none"):
        return None
    if value not in ("enforce", "report"):
        raise ValueError(f"{ENV_POLICY} must be enforce, report or off, not {value!r}")
    return value


def installed_mode() -> str | None:
    """``enforce``/``report`` once :func:`register` installed the hooks in this process, else None."""
    return _MODE


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: registers kvguard's hooks with SGLang's
    ``HookRegistry`` when ``KVGUARD_SGLANG`` is ``enforce`` or ``report`` (SGLang applies them
    right after its plugins ran). Inert when the setting is unset; a second call is a no-op."""
    global _MODE
    try:
        mode = _mode_from_env()
    except ValueError as e:
        # SGLang's loader logs a plugin's exception and serves on: an operator who asked for the
        # guard and mistyped it would get an unguarded server. So the scheduler is stopped at
        # start-up instead (its __init__ raises, which ends the server), and the error is raised
        # here as well, for SGLang's log and any caller of register().
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{_SCHEDULER}.__init__", _refuse_to_start, HookType.AFTER)
        logger.error("kvguard: %s; every SGLang scheduler will refuse to start", e)
        raise
    if mode is None or _MODE is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SCHEDULER}.__init__", _scheduler_started, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}._add_request_to_queue", _add_request_to_queue, HookType.AROUND)
    HookRegistry.register(f"{_MODEL_RUNNER}.forward", _forward, HookType.AROUND)
    HookRegistry.register(f"{_OUTPUT_STREAMER}.stream_output", _stream_output, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}._release_aborted_request", _release_aborted_request, HookType.AFTER)
    _MODE = mode
    logger.info("kvguard: %s mode in every SGLang scheduler (%s)", mode, ENV_POLICY)


def _refuse_to_start(_result: Any, _scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
    """After ``Scheduler.__init__`` when ``KVGUARD_SGLANG`` holds no valid setting: the scheduler
    raises, so the server does not start unguarded (fail closed)."""
    try:
        _mode_from_env()
    except ValueError as e:
        raise RuntimeError(f"kvguard: {e}; refusing to serve without the guard that was asked for") from e
    raise RuntimeError(f"kvguard: {ENV_POLICY} was invalid when the plugins loaded; restart with a valid setting")


def _scheduler_started(_result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
    """After ``Scheduler.__init__``: the scheduler's guard, on its pools (audited now)."""
    if _MODE is None:
        return
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        # Speculative decoding writes the draft tokens' rows with its own kernels
        # (alloc_for_spec_decode: assign_req_to_token_pool), outside the calls kvguard
        # follows: every verified request would be refused, or, under report, go unchecked.
        what = f"kvguard cannot check speculative decoding ({spec}): its draft rows are written outside the calls it follows"
        if _MODE == "enforce":
            raise ConfigError(f"{what}; refusing to serve it unchecked (KVGUARD_SGLANG=enforce)")
        logger.error("%s; this scheduler's requests are not checked (report mode)", what)
        return
    unchecked = _unchecked_pools(scheduler)
    if unchecked:
        what = "kvguard cannot check " + "; ".join(unchecked)
        if _MODE == "enforce":
            raise ConfigError(f"{what}; refusing to serve it unchecked (KVGUARD_SGLANG=enforce)")
        logger.error("%s; this scheduler's requests are not checked (report mode)", what)
        return
    allocator = scheduler.token_to_kv_pool_allocator
    get_kvcache = getattr(allocator, "get_kvcache", None)
    side = str(getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) or "pool")
    guard = Guard(
        scheduler.req_to_token_pool,
        allocator,
        tree_cache=getattr(scheduler, "tree_cache", None),
        kv_pool=get_kvcache() if get_kvcache is not None else None,
        context_len=int(scheduler.model_config.context_len),
        policy=_MODE,
        side=side if side != "null" else "pool",
    )
    scheduler.kvguard = guard
    _count_kept_pages(scheduler)
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if runner is not None:
        runner.kvguard = guard
    if side in ("prefill", "decode"):
        _guard_transfers(scheduler, guard, side)


_UNCHECKED_POOLS = (
    ("is_hybrid_swa", "a sliding-window (hybrid SWA) KV pool: its frees go through the SWA allocator's "
     "segments and its SWA layers read through a mapping, neither of which kvguard follows"),
    ("is_hybrid_ssm", "a hybrid linear-attention (Mamba) model: its recurrent-state pool is not checked"),
    ("enable_hierarchical_cache", "the hierarchical cache (HiCache): KV loaded back from host memory into "
     "device pages is not seen"),
    ("enable_hicache_storage", "HiCache storage: KV prefetched from storage into device pages is not seen"),
    ("enable_lmcache", "LMCache: KV it loads into device pages is not seen"),
    ("enable_unified_memory", "unified memory: its virtual pages move under compaction, unseen"),
)


def _unchecked_pools(scheduler: Any) -> list[str]:
    """What of the scheduler's KV memory kvguard cannot follow (each a reason): set where SGLang
    decides it, on the scheduler (a feature flag or the pool's kind)."""
    unchecked = [why for flag, why in _UNCHECKED_POOLS if getattr(scheduler, flag, False) is True]
    if getattr(scheduler, "dllm_config", None) is not None:
        unchecked.append(
            "a diffusion LLM (dllm_config): its scheduler trims a running request's row "
            "(_stash_dllm_context's free_segment) outside the calls kvguard follows"
        )
    return unchecked


def _count_kept_pages(scheduler: Any) -> None:
    """SGLang's memory check when idle (strict by default: a mismatch raises in its event loop)
    counts the pages kvguard keeps out of SGLang's free list (a refused eviction's, a failed
    transfer's under late writes: :meth:`Guard.kept_tokens`) as in use, not as leaked. Hooked
    once per process on the checker's class (its instances take no attributes), each checker
    reading the guard on its own ``ReqToTokenPool``."""
    checker = type(getattr(scheduler, "invariant_checker", None))
    check = getattr(checker, "_check_full_pool", None)
    if check is None or getattr(check, "_kvguard", False):
        return

    def _check_full_pool(self: Any, ps: Any, uncached: int = 0, *args: Any, **kwargs: Any) -> Any:
        guard = getattr(getattr(self, "req_to_token_pool", None), "kvguard_guard", None)
        kept = guard.kept_tokens() if guard is not None else 0
        return check(self, ps, uncached + kept, *args, **kwargs)

    _check_full_pool._kvguard = True  # type: ignore[attr-defined]
    checker._check_full_pool = _check_full_pool


def _guard_transfers(scheduler: Any, guard: Guard, side: str) -> None:
    """A PD scheduler: every KV sender / receiver SGLang creates is wrapped
    (:func:`kvguard.sglang.pd.install_pd`), its manifests on the channel ``KVGUARD_SGLANG_PD_CHANNEL``
    names. Under enforce a scheduler that cannot be wrapped (no channel named, a directory it
    cannot write, an SGLang whose creation sites moved) does not start: never an unchecked
    transfer. Under report it starts, and says so."""
    try:
        channel = channel_from_env()
        if channel is None:
            raise ConfigError(
                f"kvguard: a PD {side} scheduler needs {ENV_CHANNEL} (tcp://HOST:PORT: prefill listens, decode "
                "connects; an absolute directory both sides see; or process: prefill and decode in this process) "
                "to carry the transfer manifests"
            )
        install_pd(scheduler, guard, channel)
    except Exception as e:
        if guard.policy == "enforce":
            raise RuntimeError(f"kvguard: {e}; refusing to serve PD transfers unchecked") from e
        logger.error("kvguard: %s; this %s scheduler's transfers are not checked (report mode)", e, side)
        return
    logger.info("kvguard: %s scheduler's KV %s wrapped (manifests on %s)", side,
                "senders" if side == "prefill" else "receivers", type(channel).__name__)


def _stream_output(original: Any, streamer: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
    """``SchedulerOutputStreamer.stream_output`` (around): the rows of the requests whose output
    is about to leave are checked in full first; a refused request still running leaves nothing
    now (its abort follows at the next step). The guard is the one on the streamer's radix
    cache's ``ReqToTokenPool``. Which requests leave is SGLang's decision, taken where it is made:
    the accumulator's ``to_payload`` (hooked once per process) checks exactly the requests it
    is about to send. Without that hook, every request given that still holds a row is checked."""
    pool = getattr(getattr(streamer, "tree_cache", None), "req_to_token_pool", None)
    guard = getattr(pool, "kvguard_guard", None)
    if guard is not None and reqs and (guard._suspects or guard.__dict__.get(_BACKUPS_ATTR)):
        _forget_ended(guard, reqs)
    if guard is not None and reqs and guard._payload_hooked and getattr(streamer, "is_generation", False):
        # The requests SGLang sends are judged when its accumulator builds the payload: only
        # those rows, not every request of the batch (see process_hooks._hook_output_payload).
        STREAMING.append(guard)
        try:
            return original(streamer, reqs, *args, **kwargs)
        finally:
            STREAMING.pop()
    if guard is not None and reqs:
        refused = guard.check_rows_before_output(reqs)
        if refused and guard.policy == "enforce":
            gone = {id(r) for r in refused if not r.finished()}
            reqs = [r for r in reqs if id(r) not in gone]
    return original(streamer, reqs, *args, **kwargs)


def _forget_ended(guard: Guard, reqs: Any) -> None:
    """Requests SGLang sends as finished: no restore follows, so a retraction backup record of
    theirs goes (SGLang's capacity check refusing a retracted request's return, a DSV4
    rebootstrap's backup never restored); one that holds no row (ended while retracted) is no
    suspect any more either. Before, each stayed for the life of the server."""
    backups = guard.__dict__.get(_BACKUPS_ATTR)
    for req in reqs:
        finished = getattr(req, "finished", None)
        if finished is not None and finished():
            if backups:
                backups.pop(getattr(req, "rid", None), None)
            kv = getattr(req, "kv", None)
            if not getattr(kv, "holds_kv", False):
                guard._suspects.pop(id(kv), None)


def _release_aborted_request(_result: Any, scheduler: Any, req: Any, *_args: Any, **_kwargs: Any) -> None:
    """After ``Scheduler._release_aborted_request``: a request aborted before it got a row
    (while queued) ends in kvguard too."""
    guard = getattr(scheduler, "kvguard", None)
    if guard is not None:
        guard.drop_unscheduled(req)


def _add_request_to_queue(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """The intake check before SGLang queues ``req``: refused under enforce, it is answered with
    its abort at once and never queued (no row, no page)."""
    guard = getattr(scheduler, "kvguard", None)
    is_retracted = kwargs.get("is_retracted", args[0] if args else False)
    if guard is None or is_retracted or guard.admit(req) or guard.policy != "enforce":
        return original(scheduler, req, *args, **kwargs)
    from sglang.srt.disaggregation.utils import prepare_abort

    reason = guard.aborted.get(req.rid, "refused at intake")
    prepare_abort(req, f"kvguard refused this request: {reason}", status_code=HTTPStatus.BAD_REQUEST)
    scheduler.output_streamer.stream_output([req], req.return_logprob)
    guard.drop_unscheduled(req)
    return None


def _forward(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``ModelRunner.forward``: the batch's writes, rows and lengths checked before any layer runs
    (a captured decode graph's replay included); a refused request's writes sent to the padding
    slot through the batch's ``out_cache_loc``."""
    guard = getattr(runner, "kvguard", None)
    rows = getattr(forward_batch, "req_pool_indices", None)
    if guard is None or rows is None or forward_batch.forward_mode.is_idle():
        return original(runner, forward_batch, *args, **kwargs)
    check = guard.row_check
    split = forward_batch.forward_mode.is_split_prefill()
    if split and forward_batch is check.split_batch:
        # A later slice of a split prefill's layers (--enable-pdmux): the same forward batch,
        # checked (and its out_cache_loc masked) before its first slice ran.
        return original(runner, forward_batch, *args, **kwargs)
    extend = forward_batch.extend_seq_lens if forward_batch.forward_mode.is_extend() else None
    # Guard.begin_forward / end_forward, without their frames (every step).
    check.begin(
        rows,
        forward_batch.seq_lens,
        extend,
        getattr(forward_batch, "req_pool_indices_cpu", None),
        getattr(forward_batch, "seq_lens_cpu", None),
    )
    try:
        loc = forward_batch.out_cache_loc
        checked = check.check(loc)
        if checked is not loc:
            forward_batch.out_cache_loc = checked
        check.split_batch = forward_batch if split else None
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        check.end()
