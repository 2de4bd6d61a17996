"""A CPU harness that drives SGLang 0.5.23's real memory objects as its scheduler does.

ReqToTokenPool, the token allocator (TokenToKVPoolAllocator for page size 1,
PagedTokenToKVPoolAllocator otherwise), MHATokenToKVPool (real CPU KV buffers, one layer) and
the radix cache SGLang's ``create_tree_cache`` builds (UnifiedRadixCache) run on device="cpu"; real Req objects go through prefix matching and locking
(Req.init_next_round_input, tree.lock), row and KV allocation and the row write (the CPU path of
alloc_for_extend / alloc_for_decode_default), the KV store (set_kv_buffer) and release
(common.release_kv_cache, which checkpoints into the radix cache, frees the row's pages and
unlocks). No model runs: each token's K/V is a value derived from the request and the position.
"""

from __future__ import annotations

import warnings
from array import array
from types import SimpleNamespace

import pytest

warnings.filterwarnings("ignore")
# Plain imports, never importorskip: conftest.py collects these tests only where SGLang and
# torch are installed, and there a failing import must fail the run, not skip it.
import sglang  # noqa: E402
import torch  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache import common  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

HEAD_DIM = 8


class Engine:
    """SGLang's memory objects for one scheduler, and the scheduler's calls on them."""

    def __init__(self, *, page_size: int, tokens: int, rows: int, context_len: int, guard=None):
        self.page_size = page_size
        self.kv_pool = MHATokenToKVPool(
            size=tokens, page_size=page_size, dtype=torch.float32, head_num=1, head_dim=HEAD_DIM,
            layer_num=1, device="cpu", enable_memory_saver=False,
        )
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", self.kv_pool, need_sort=True)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                tokens, page_size, torch.float32, "cpu", self.kv_pool, need_sort=True
            )
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=context_len + 4, device="cpu", enable_memory_saver=False
        )
        # The radix cache SGLang's own selection chain builds (a UnifiedRadixCache in 0.5.23).
        self.tree = create_tree_cache(TreeCacheBuildContext(
            server_args=None,
            params=CacheInitParams(
                disable=False, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            ),
            is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
            tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=tokens,
        ))
        self.context_len = context_len
        self.layer = SimpleNamespace(layer_id=0)
        self.guard = None
        self.running: list[Req] = []

    def install(self, policy: str = "enforce", **options):
        from kvguard.sglang import Guard

        self.guard = Guard(
            self.req_to_token_pool, self.allocator, tree_cache=self.tree, kv_pool=self.kv_pool,
            context_len=self.context_len, policy=policy, **options,
        )
        return self.guard

    # ---- requests --------------------------------------------------------------------------

    @staticmethod
    def request(rid: str, prompt, *, max_new: int = 8, salt: str | None = None) -> Req:
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new))
        req.cache_salt = salt
        return req

    def submit(self, req: Req) -> bool:
        """Scheduler._add_request_to_queue: the intake check."""
        return self.guard.admit(req) if self.guard is not None else True

    def evict_for(self, tokens: int) -> None:
        """evict_from_tree_cache, as alloc_token_slots / alloc_paged_token_slots_* call it."""
        common.evict_from_tree_cache(self.tree, tokens)

    # ---- extend (prefill) ------------------------------------------------------------------

    def prefill(self, reqs: list[Req]) -> torch.Tensor:
        """match + lock (PrefillAdder), alloc_for_extend (CPU path), then the forward's KV store."""
        ps = self.page_size
        for req in reqs:
            req.init_next_round_input(self.tree)
            req.lock = self.tree.lock(req.last_node)
            req.extend_end = len(req.full_untruncated_fill_ids)
        prefix = [self.tree.prefix_device_indices(r) for r in reqs]
        prefix_lens = [r.prefix_len for r in reqs]
        seq_lens = [r.extend_end for r in reqs]
        extend = [s - p for s, p in zip(seq_lens, prefix_lens)]
        rows = self.req_to_token_pool.alloc(reqs)
        assert rows is not None
        if ps == 1:
            self.evict_for(sum(extend))
            out = self.allocator.alloc(sum(extend))
        else:
            self.evict_for(sum(extend) + len(reqs) * ps)
            last_loc = torch.cat([t[-1:] if len(t) else torch.full((1,), -1) for t in prefix]).to(torch.int64)
            pl = torch.tensor(prefix_lens, dtype=torch.int64)
            sl = torch.tensor(seq_lens, dtype=torch.int64)
            out = self.allocator.alloc_extend(pl, pl, sl, sl, last_loc, sum(extend))
        assert out is not None, "out of KV memory"
        pt = 0
        for req, row, p, s, n, pre in zip(reqs, rows, prefix_lens, seq_lens, extend, prefix):
            self.req_to_token_pool.write((row, slice(0, p)), pre)
            self.req_to_token_pool.write((row, slice(p, s)), out[pt : pt + n])
            pt += n
            req.kv.kv_allocated_len = s
            req.kv.kv_committed_len = s
        self.forward(reqs, out, seq_lens, extend)
        for req in reqs:
            req.prefix_len = req.extend_end
            self.running.append(req)
        return out

    # ---- decode ----------------------------------------------------------------------------

    def decode(self, reqs: list[Req] | None = None) -> torch.Tensor:
        """One decode step: a sampled token per request, alloc_for_decode_default, the KV store."""
        reqs = list(self.running if reqs is None else reqs)
        for req in reqs:
            req.output_ids.append(1000 + len(req.output_ids))
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        seq = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64)
        if self.page_size == 1:
            self.evict_for(len(reqs))
            out = self.allocator.alloc(len(reqs))
        else:
            self.evict_for(len(reqs) * self.page_size)
            last_loc = self.req_to_token_pool.req_to_token[rows, seq - 1].to(torch.int64)
            out = self.allocator.alloc_decode(seq + 1, seq + 1, last_loc)
        assert out is not None, "out of KV memory"
        self.req_to_token_pool.write((rows, seq.clone()), out.to(torch.int32))
        for req in reqs:
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
        self.forward(reqs, out, [r.kv.kv_committed_len for r in reqs], None)
        return out

    def forward(self, reqs, out_cache_loc, seq_lens, extend_lens) -> None:
        """ModelRunner.forward: kvguard's check at its entry, then the KV store at layer 0 (the
        attention read follows it) through the slots the check returned."""
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        new = None if extend_lens is None else torch.tensor(extend_lens, dtype=torch.int64)
        if self.guard is not None:
            out_cache_loc = self.guard.begin_forward(rows, lens, new, out_cache_loc=out_cache_loc)
        # The model's stand-in: each request's K/V is a value derived from its rid (one tensor op).
        vals = torch.tensor([float(hash(r.rid) % 997) for r in reqs], dtype=torch.float32)
        if new is not None:
            vals = vals.repeat_interleave(new)
        k = vals[:, None, None].expand(-1, 1, HEAD_DIM).contiguous()
        self.kv_pool.set_kv_buffer(self.layer, out_cache_loc, k, k.clone())
        if self.guard is not None:
            self.guard.end_forward()

    # ---- finish ----------------------------------------------------------------------------

    def finish(self, req: Req) -> None:
        """The request ends: release_kv_cache(checkpoint=True), as process_batch_result does."""
        if req.finished_reason is None:
            req.finished_reason = req.to_finish or FINISH_LENGTH(len(req.output_ids))
        req.finished_len = len(req.output_ids)
        common.release_kv_cache(req, self.tree, checkpoint=req.to_finish is None)
        if req in self.running:
            self.running.remove(req)

    def sweep_aborted(self) -> list[Req]:
        """The scheduler's end of step: requests with to_finish set are finished and released."""
        gone = [r for r in self.running if r.to_finish is not None]
        for req in gone:
            self.finish(req)
        return gone


@pytest.fixture(scope="session", autouse=True)
def sglang_context():
    """SGLang's process config (runtime_context), published as its own test helper
    ``published_topology`` does (that module pulls in benchmark datasets, so not imported)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu")
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    yield server_args
    reset_context()


@pytest.fixture
def engine_factory():
    def make(page_size: int = 16, tokens: int = 4096, rows: int = 64, context_len: int = 1024, policy="enforce"):
        eng = Engine(page_size=page_size, tokens=tokens, rows=rows, context_len=context_len)
        if policy is not None:
            eng.install(policy)
        return eng

    return make
