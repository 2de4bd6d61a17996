"""SGLang 0.5.23's own Scheduler on CPU, with only the model replaced.

The scheduler is built as SGLang's own unit tests build one (``object.__new__(Scheduler)``) and
its state set up by SGLang's own ``init_*`` methods where they run without a GPU, a model or
sockets; the pools are SGLang's (``ReqToTokenPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator``, ``MHATokenToKVPool``, and the radix cache SGLang's own
``create_tree_cache`` builds: ``UnifiedRadixCache``). Requests come in through
``handle_generate_request`` (``validate_input_length`` included) and every step is SGLang's
``get_next_batch_to_run`` / ``run_batch`` / ``process_batch_result`` (free groups included), i.e.
the body of ``event_loop_normal``. The one stand-in is the model: :class:`CpuModelRunner` writes
each new token's K/V through the real pool (``set_kv_buffer``) and reads every request's K
through its ``req_to_token`` row, as attention does; the next token is a function of what it
read, so a wrong read changes the output.

SGLang's GPU branch of the row write is taken: ``support_triton`` is true and
``write_req_to_token_pool_triton`` runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402
from array import array  # noqa: E402
from types import SimpleNamespace  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

HEAD_DIM = 4
LAYERS = 2
VOCAB = 32000


def token_k(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The stand-in model's K (and V) of a token at a position: a function of both, so two
    requests share KV exactly where their prompts share a prefix."""
    return ((tokens * 131 + positions * 7) % 1009).to(torch.float32)


class CpuModelRunner:
    """ModelRunner's stand-in: each layer's KV store through the real pool, then each request's
    read of its ``req_to_token`` row (what attention reads); the next token is a function of the
    K it read.

    ``graph_decode``: a decode forward stands for SGLang's captured decode graph, which
    ``ModelRunner._forward_raw`` replays for every decode batch it can (``decode_cuda_graph_runner
    .execute``; the default on a GPU): the kernels SGLang's ``set_kv_buffer`` launched when the
    graph was captured run again, and no Python runs per layer, so nothing installed on the pool's
    instance since (kvguard's hooks included) sees the stores. Here the pool's own class method
    stores the KV (``type(pool).set_kv_buffer``: SGLang's code, not the instance's attribute)."""

    def __init__(self, kv_pool, req_to_token_pool, *, graph_decode=False):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.layers = [SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.reads: list[tuple[int, int]] = []
        self.prefill_aware_swa = False
        self.graph_decode = graph_decode
        self.graph_forwards = 0

    def forward(self, fb):
        return self._model(fb)

    def _model(self, fb):
        rows = fb.req_pool_indices.tolist()
        lens = fb.seq_lens.tolist()
        loc = fb.out_cache_loc
        positions = fb.positions
        k = token_k(fb.input_ids.to(torch.int64), positions)[:, None, None].expand(-1, 1, HEAD_DIM).contiguous()
        if self.graph_decode and fb.forward_mode.is_decode():
            self.graph_forwards += 1
            store = type(self.kv_pool).set_kv_buffer
            for layer in self.layers:
                store(self.kv_pool, layer, loc, k, k)
        else:
            for layer in self.layers:
                self.kv_pool.set_kv_buffer(layer, loc, k, k)
        rt = self.req_to_token_pool.req_to_token
        kb = self.kv_pool.k_buffer[LAYERS - 1]
        out = []
        for row, n in zip(rows, lens):
            slots = rt[row, :n].to(torch.int64)
            read = kb[slots, 0, 0]
            weights = torch.arange(1, n + 1, dtype=torch.float64)
            out.append(int((read.to(torch.float64) * weights).sum().item()) % (VOCAB - 2) + 2)
        return out


class CpuTpWorker:
    """TpModelWorker's stand-in: the ScheduleBatch as the forward batch ModelRunner.forward
    takes (the fields kvguard and the stand-in read), the runner's forward, the sampled ids."""

    def __init__(self, runner):
        self.model_runner = runner

    def forward_batch_generation(self, batch, **_kwargs):
        extend = batch.forward_mode.is_extend()
        if extend:
            ext = torch.tensor(batch.extend_lens, dtype=torch.int64)
            pre = torch.tensor(batch.prefix_lens, dtype=torch.int64)
            positions = torch.cat([torch.arange(p, p + e) for p, e in zip(pre.tolist(), ext.tolist())])
        else:
            ext = None
            positions = batch.seq_lens.to(torch.int64) - 1
        fb = SimpleNamespace(
            forward_mode=batch.forward_mode,
            req_pool_indices=batch.req_pool_indices,
            req_pool_indices_cpu=getattr(batch, "req_pool_indices_cpu", None),
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            extend_seq_lens=ext,
            out_cache_loc=batch.out_cache_loc,
            input_ids=batch.input_ids,
            positions=positions,
        )
        ids = self.model_runner.forward(fb)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=torch.tensor(ids, dtype=torch.int64), can_run_cuda_graph=False
        )


def publish_server_args(**overrides) -> ServerArgs:
    """SGLang's process config (runtime_context) for a CPU scheduler, published as SGLang's own
    test helper ``published_topology`` does."""
    args = dict(model_path="dummy", device="cpu", disable_overlap_schedule=True, skip_tokenizer_init=True)
    args.update(overrides)
    server_args = ServerArgs(**args)
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    return server_args


def build_scheduler(
    *, page_size: int, tokens: int, rows: int, context_len: int, req_to_token_pool_factory=None,
    radix_cache: bool = True, graph_decode: bool = True, **server_args
) -> Scheduler:
    """A Scheduler on SGLang's own pools (see the module doc); ``req_to_token_pool_factory``
    builds another of SGLang's row pools (the decode side's ``DecodeReqToTokenPool``);
    ``radix_cache=False`` builds the radix cache disabled (``CacheInitParams(disable=True)``, as
    SGLang builds a PD decode server's without ``--disaggregation-decode-enable-radix-cache``).
    ``graph_decode`` (default, as SGLang runs on a GPU): decode forwards stand for a captured
    CUDA graph's replay (:class:`CpuModelRunner`); ``False``: every forward eager, as SGLang runs
    a decode batch larger than its largest captured graph, or under ``--disable-cuda-graph``."""
    sa = publish_server_args(page_size=page_size, context_length=context_len, **server_args)
    s = object.__new__(Scheduler)
    _preamble(s, sa)
    kv_pool = MHATokenToKVPool(
        size=tokens, page_size=page_size, dtype=torch.float32, head_num=1, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", kv_pool, need_sort=True)
    else:
        allocator = PagedTokenToKVPoolAllocator(tokens, page_size, torch.float32, "cpu", kv_pool, need_sort=True)
    if req_to_token_pool_factory is not None:
        req_to_token_pool = req_to_token_pool_factory()
    else:
        req_to_token_pool = ReqToTokenPool(size=rows, max_context_len=context_len + 4, device="cpu", enable_memory_saver=False)
    runner = CpuModelRunner(kv_pool, req_to_token_pool, graph_decode=graph_decode)
    # The radix cache SGLang's own selection chain builds for these pools (create_tree_cache, as
    # Scheduler's KV cache builder calls it): a UnifiedRadixCache with its full-attention
    # component in SGLang 0.5.23.
    tree = create_tree_cache(TreeCacheBuildContext(
        server_args=sa,
        params=CacheInitParams(
            disable=not radix_cache, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        ),
        is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=not radix_cache,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=tokens,
    ))
    runner.token_to_kv_pool_allocator = allocator
    s.tp_worker = s.model_worker = CpuTpWorker(runner)
    s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache = req_to_token_pool, allocator, tree
    s.kv_pool = kv_pool
    s.page_size = page_size
    s.model_config = SimpleNamespace(
        context_len=context_len, vocab_size=VOCAB, hf_eos_token_id=None, is_encoder_decoder=False,
        is_multimodal=False, num_key_value_heads=1, self_opened_think_start_ids=None, think_end_ids=None,
        hf_text_config=SimpleNamespace(), attention_chunk_size=None,
    )
    s.max_total_num_tokens = tokens
    s.max_req_len = min(context_len - 1, tokens - 1)
    s.max_req_input_len = s.max_req_len - 5
    s.max_running_requests = rows
    s.max_prefill_tokens = sa.max_prefill_tokens
    s.max_queued_requests = None
    s.random_seed = 0
    s.device = "cpu"
    s.full_tokens_per_layer = tokens
    s.swa_tokens_per_layer = None
    s.kv_shard_widening = 1
    s.min_free_slots_delayer = None
    s._war_barrier_enabled = False  # as run_event_loop sets it off CUDA
    s.require_mlp_sync = False
    s.load_snapshot_writer = s.recv_from_tokenizer = s.idle_sleeper = None
    from sglang.srt.runtime_context import get_context, get_parallel

    if not get_parallel().pp_max_micro_batch_size:
        # As init_model_worker states it from the worker's max_running_requests.
        get_context().override("scheduler.pp_max_micro_batch_size_default", pp_max_micro_batch_size=max(rows, 1))
    s.forward_stream, s.schedule_stream = torch.cpu.Stream(), torch.cpu.Stream()
    runner.attn_backend = SimpleNamespace()
    runner.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda batch, chunked_req=None: batch)
    s.tp_worker.model_config = SimpleNamespace(use_ngram_embedding=False)
    s.ipc_channels = SimpleNamespace(
        send_to_detokenizer=OutputCapture(), send_metrics_from_scheduler=OutputCapture(), send_to_tokenizer=OutputCapture()
    )
    s.outputs = s.ipc_channels.send_to_detokenizer
    _init(s)
    return s


class OutputCapture:
    """The detokenizer's socket: every batch of outputs the scheduler sends, kept."""

    def __init__(self):
        self.sent = []

    def send_output(self, payload, *args, **kwargs):
        self.sent.append(payload)

    def send_pyobj(self, payload, *args, **kwargs):
        self.sent.append(payload)


def _init(s: Scheduler) -> None:
    """SGLang's own init_* steps that run on CPU without a model, sockets or process groups,
    in ``Scheduler.__init__``'s order; the few that cannot are set as they would leave them."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
    from sglang.srt.runtime_context import get_disagg, get_schedule

    s.init_metrics_collector()
    s.init_running_status()
    # init_chunked_prefill, without its multimodal-Transformers branch (no HF config here).
    s.chunked_prefill_size = get_schedule().chunked_prefill_size
    if s.chunked_prefill_size is not None and s.chunked_prefill_size <= 0:
        s.chunked_prefill_size = None
    s.prefill_decode_interval = get_schedule().prefill_decode_interval or 0
    s._prefill_decode_interval_remaining = 0
    s.prefill_decode_interval_min_bs = get_schedule().prefill_decode_interval_min_bs
    s.chunked_req = None
    s._pending_chunked_abort_req = None
    s.is_mixed_chunk = s.chunked_prefill_size is not None and get_schedule().enable_mixed_chunk
    s.maybe_init_dynamic_chunk_sizer()
    s.init_diffusion_llm()
    s.init_metrics_reporter()
    s.scheduler_stage_metrics = s.metrics_reporter.scheduler_stage_metrics
    s.init_kv_events_publisher()
    s.init_schedule_policy()
    s.watchdog = None  # its thread is not started here
    from sglang.srt.managers.scheduler_components.recv_skipper import SchedulerRecvSkipper
    s.recv_skipper = SchedulerRecvSkipper.maybe_create()
    s.input_blocker = None
    s.profiler_manager = SimpleNamespace(_profile_batch_predicate=lambda batch: None)
    # init_disaggregation, the NULL mode (PD rigs set their queues up themselves).
    s.mm_receiver = None
    s.disagg_prefill_bootstrap_queue = s.disagg_prefill_inflight_queue = None
    s.disagg_decode_prealloc_queue = s.disagg_decode_transfer_queue = None
    s.disaggregation_mode = DisaggregationMode(get_disagg().disaggregation_mode)
    s.transfer_backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    s.init_overlap()
    s.maybe_init_ngram_embedding()
    s.init_deterministic_inference_config()
    s.truncation_align_size = None
    s.init_mamba_truncation_align()
    s.check_truncation_align_fits_chunk()
    s.init_lora_drainer()
    s.init_lora_overlap_loader()
    s.weight_updater = SimpleNamespace(offload_tags=set())
    # init_grammar_manager on a one-rank group (skip_tokenizer_init: no grammar backend).
    s.dp_tp_cpu_group = None
    s.dp_tp_group = SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True)
    s.pp_group = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True, rank_in_group=0)
    s.init_grammar_manager()
    s.maybe_init_scripted_scheduler_hook()
    s.init_dp_attn_adapter()
    s.init_pool_stats_observer()
    s.init_invariant_checker()
    s.init_load_publisher()
    s.init_load_inquirer()
    s.init_output_streamer()
    s.init_batch_result_processor()
    s.init_internal_state()
    s.is_initializing = False


def _preamble(s: Scheduler, sa: ServerArgs) -> None:
    """``Scheduler.__init__``'s settings read from the published config (its first lines)."""
    from sglang.srt import environ
    from sglang.srt.runtime_context import get_disagg, get_lora, get_memory, get_parallel, get_schedule, get_serving, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    envs = environ.envs
    s.is_initializing = True
    s.forward_ct = 0
    s.processed_tokens_counter = 0
    s.cur_batch_for_debug = None
    s.server_args = sa
    s.nccl_port = 0
    s.schedule_policy = get_schedule().schedule_policy
    s.enable_priority_scheduling = get_schedule().enable_priority_scheduling
    s.abort_on_priority_when_disabled = get_schedule().abort_on_priority_when_disabled
    s.schedule_low_priority_values_first = get_schedule().schedule_low_priority_values_first
    s.priority_scheduling_preemption_threshold = get_schedule().priority_scheduling_preemption_threshold
    s.enable_lora = get_lora().enable_lora
    s.enable_lora_overlap_loading = get_lora().enable_lora_overlap_loading
    s.max_loras_per_batch = get_lora().max_loras_per_batch
    s.enable_overlap = not get_schedule().disable_overlap_schedule
    s.enable_overlap_mlx = False
    s.enable_pdmux = get_disagg().enable_pdmux
    s.skip_tokenizer_init = get_serving().skip_tokenizer_init
    s.stream_interval = get_serving().stream_interval
    s.spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    s.page_size = get_schedule().page_size
    s.enable_hierarchical_cache = get_memory().enable_hierarchical_cache
    s.enable_lmcache = get_memory().enable_lmcache
    s.enable_session_radix_cache = get_memory().enable_session_radix_cache
    s.enable_hicache_storage = get_memory().hicache_storage_backend is not None
    s.enable_unified_cache_external_linker = get_memory().enable_unified_cache_external_linker
    s.enable_decode_hicache = False
    s.max_recv_per_poll = envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get()
    s.max_new_tokens_limit = envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get()
    s.enable_hisparse = get_memory().enable_hisparse
    s.attn_dp_enabled = get_parallel().attn_dp_enabled
    s.enable_unified_memory = get_memory().enable_unified_memory
    s.draft_worker = None
    s.dllm_config = None
    s.hisparse_coordinator = None
    s.decode_offload_manager = None
    s.is_hybrid_swa = s.is_hybrid_ssm = False
    s.sliding_window_size = None
    s.disable_radix_cache = False
    s.rust_server = None
    s.tokenizer = None
    s.is_generation = True


def generate_req(rid: str, prompt, *, max_new: int = 8, salt: str | None = None) -> TokenizedGenerateReqInput:
    """What the tokenizer manager sends the scheduler for one request (greedy, no stop token)."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    params.normalize(None)
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=array("q", prompt), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=params, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False, cache_salt=salt,
    )


def step(s: Scheduler):
    """One iteration of ``Scheduler.event_loop_normal`` without the socket read: SGLang's own
    ``get_next_batch_to_run``, ``run_batch``, ``process_batch_result`` (or ``on_idle``)."""
    plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
    s.running_batch = plan.running_batch
    batch = plan.batch_to_run
    s.cur_batch_for_debug = batch
    if batch:
        result = s.run_batch(batch)
        s.process_batch_result(batch, result)
    else:
        s._sched_idled = True
        s.on_idle()
    s.last_batch = batch
    return batch


def attach_kvguard(s: Scheduler, policy: str = "enforce"):
    """kvguard's plugin hooks on this scheduler, as SGLang's HookRegistry applies them on the
    classes: ``Scheduler.__init__`` (after), ``Scheduler._add_request_to_queue`` (around),
    ``Scheduler._release_aborted_request`` (after) and ``ModelRunner.forward`` (around), here
    bound to this instance only;
    ``SchedulerOutputStreamer.stream_output`` (around) on its class."""
    import functools

    import kvguard.sglang as plugin

    mode, plugin._MODE = plugin._MODE, policy
    try:
        plugin._scheduler_started(None, s)
    finally:
        plugin._MODE = mode
    s._add_request_to_queue = functools.partial(plugin._add_request_to_queue, Scheduler._add_request_to_queue, s)
    runner = s.tp_worker.model_runner
    runner.forward = functools.partial(plugin._forward, CpuModelRunner.forward, runner)
    release_aborted = s._release_aborted_request

    def _release_aborted_request(req, *args, **kwargs):
        result = release_aborted(req, *args, **kwargs)
        plugin._release_aborted_request(result, s, req, *args, **kwargs)
        return result

    s._release_aborted_request = _release_aborted_request
    _hook_output_streamer(plugin)
    return getattr(s, "kvguard", None)


def _hook_output_streamer(plugin) -> None:
    """``SchedulerOutputStreamer.stream_output`` (a slots class: hooked on the class, as
    HookRegistry does, once; a scheduler without a guard passes straight through)."""
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    inner = SchedulerOutputStreamer.stream_output
    if getattr(inner, "kvguard_hooked", False):
        return

    def stream_output(self, reqs, *args, **kwargs):
        return plugin._stream_output(inner, self, reqs, *args, **kwargs)

    stream_output.kvguard_hooked = True
    SchedulerOutputStreamer.stream_output = stream_output


def finished(s: Scheduler) -> dict:
    """Every finished request the scheduler sent out: rid -> (output ids, finish reason)."""
    ids: dict = {}
    done = {}
    for payload in s.outputs.sent:
        for i, rid in enumerate(payload.rids):
            # A streamed request's ids come a piece per send; the others' all at the end.
            ids.setdefault(rid, []).extend(payload.output_ids[i] if payload.output_ids else [])
            reason = payload.finished_reasons[i]
            if reason is not None:
                done[rid] = (ids[rid], reason)
    return done


def pool_pages(s: Scheduler) -> int:
    """Pages SGLang can hand out now: its free list plus what the radix cache may evict."""
    return (s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()) // s.page_size


def overlap_step(s: Scheduler):
    """One iteration of ``Scheduler.event_loop_overlap`` without the socket read: the next
    batch launched before the last one's result is processed (SGLang's own methods, its order)."""
    from collections import deque

    if not hasattr(s, "result_queue") or not isinstance(s.result_queue, deque):
        s.result_queue = deque()
    s.enable_skip_finishing_decode = True

    def pop_and_process():
        done_batch, done_result = s.result_queue.popleft()
        s.process_batch_result(done_batch, done_result)

    plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
    s.running_batch = plan.running_batch
    batch = plan.batch_to_run
    s.cur_batch_for_debug = batch
    disable_overlap = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
    if disable_overlap and s.result_queue:
        pop_and_process()
    if batch:
        result = s.run_batch(batch)
        s._apply_war_barrier()
        s.result_queue.append((batch.copy(), result))
    else:
        result = None
        s._sched_idled = True
    if s.last_batch:
        if not disable_overlap and s.result_queue:
            # The last batch's result, processed after this batch was launched.
            s.overlapped = getattr(s, "overlapped", 0) + bool(batch)
            pop_and_process()
    elif batch is None:
        s.on_idle()
    s.launch_batch_sample_if_needed(result, batch)
    s.last_batch = batch
    return batch


def loop_step(s: Scheduler):
    """One step of the scheduler's event loop: :func:`overlap_step` or :func:`step`, as it is
    configured."""
    return overlap_step(s) if s.enable_overlap else step(s)


def finish(s: Scheduler, max_steps: int = 200) -> dict:
    """Steps (:func:`loop_step`) until nothing is queued, running or awaiting its result; returns
    :func:`finished`."""
    for _ in range(max_steps):
        if (loop_step(s) is None and s.running_batch.is_empty() and not s.waiting_queue
                and not getattr(s, "result_queue", None)):
            return finished(s)
    raise AssertionError("the scheduler did not finish")


def sent_since(s: Scheduler, since: int, rid: str) -> list[tuple]:
    """What the scheduler sent of ``rid`` in its payloads from the ``since``-th on: (finish
    reason, output ids, the detokenizer's ids) for each."""
    out = []
    for payload in s.outputs.sent[since:]:
        for i, r in enumerate(payload.rids):
            if r == rid:
                ids = payload.output_ids[i] if payload.output_ids else []
                decode_ids = payload.decode_ids[i] if payload.decode_ids else []
                out.append((payload.finished_reasons[i], ids, decode_ids))
    return out


PROMPTS = {f"r{i}": [1000 * (i + 1) + j for j in range(40)] for i in range(4)}
"""Four 40-token prompts, ``r0`` to ``r3``: the workload of the tests that inject a bug into one
request and compare the others with an unguarded run."""


def prompt_reqs(max_new: int) -> list:
    """:data:`PROMPTS` as requests of one tenant, ``max_new`` tokens each."""
    return [generate_req(rid, p, max_new=max_new, salt="acme") for rid, p in PROMPTS.items()]


def run(s: Scheduler, reqs, *, per_step: int = 4, max_steps: int = 100_000) -> dict:
    """``reqs`` arrive ``per_step`` at a time (``handle_generate_request``), the scheduler steps
    (:func:`overlap_step` when SGLang's overlap schedule is on, else :func:`step`) until every
    request finished; returns :func:`finished`."""
    pending = list(reqs)
    one = overlap_step if s.enable_overlap else step
    for _ in range(max_steps):
        for r in pending[:per_step]:
            s.handle_generate_request(r)
        del pending[:per_step]
        batch = one(s)
        if (not pending and batch is None and not s.waiting_queue and s.running_batch.is_empty()
                and not getattr(s, "result_queue", None)):
            return finished(s)
    raise AssertionError("the scheduler did not finish the workload")
