"""PD disaggregation where kvguard reads the KV pool and talks on its manifest channel, through
SGLang's own prefill and decode schedulers (pd_rig.py): a pool on a device (read through one copy
to the host), SGLang's MLA pool layout, a pool read or a channel call that fails (only that room
is refused, nothing raises into SGLang's loop), and the PD settings kvguard refuses at start."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pd_rig
import pytest
import scheduler_rig as rig
import torch
from kvguard.sglang import kv_bytes
from kvguard.sglang import pd as kvguard_pd
from scheduler_rig import attach_kvguard
from test_pd_schedulers import CONTEXT, sides, unguarded, workload

N = 6
VICTIM = 2
"""The request whose room's channel calls fail (its room is 1000 + VICTIM)."""


@pytest.fixture(autouse=True)
def process_channel(monkeypatch):
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", "process")


class DeviceTensor(torch.Tensor):
    """A CUDA tensor's stand-in on the CPU: its storage is the pool's, but ``.numpy()`` (and
    numpy's ``__array__``) fail as they fail on ``cuda:0``; ``.cpu()`` gives a host tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.cpu and isinstance(out, torch.Tensor):
            return out.as_subclass(torch.Tensor)
        return out


def on_device(pool):
    """The same pool's buffers, seen as device tensors (the same storage)."""
    return SimpleNamespace(k_buffer=[t.as_subclass(DeviceTensor) for t in pool.k_buffer],
                           v_buffer=[t.as_subclass(DeviceTensor) for t in pool.v_buffer])


def on_meta(pool):
    """The pool's buffers on torch's ``meta`` device: every read of their bytes fails."""
    return SimpleNamespace(k_buffer=[t.to("meta") for t in pool.k_buffer], v_buffer=[t.to("meta") for t in pool.v_buffer])


def test_a_device_pool_is_read_through_one_copy_to_the_host():
    """Both sides' KV pools on a device: kvguard gathers the pages there and copies them to the
    host (never ``.numpy()`` on a device tensor); every clean transfer is accepted and decodes
    as without kvguard."""
    p, d = sides(16, guard="enforce")
    p.kvguard.kv_pool = on_device(p.kvguard.kv_pool)
    d.kvguard.kv_pool = on_device(d.kvguard.kv_pool)
    out = pd_rig.run_pd(p, d, workload(7, N))
    assert p.kvguard.metrics["manifests_not_built"] == 0
    assert d.kvguard.metrics["transfers_accepted"] == N and d.kvguard.metrics["transfers_refused"] == 0
    assert d.kvguard.violations == [] and d.kvguard.aborted == {}
    assert out == unguarded(16, N)[0]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_pool_read_that_fails_refuses_the_transfer_and_never_raises(side):
    """kvguard cannot read a side's pages (here: a pool on ``meta``): SGLang's loops run on (no
    exception out of the sender's send or the receiver's poll) and every transfer is refused,
    under enforce."""
    p, d = sides(16, guard="enforce")
    s = p if side == "prefill" else d
    s.kvguard.kv_pool = on_meta(s.kvguard.kv_pool)
    pd_rig.run_pd(p, d, workload(7, N))
    assert d.kvguard.metrics["transfers_accepted"] == 0 and d.kvguard.metrics["transfers_refused"] == N
    assert len(d.kvguard.aborted) == N
    if side == "prefill":
        assert p.kvguard.metrics["manifests_not_built"] >= N


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_page_bytes_are_what_the_backend_moves(layout):
    """The bytes kvguard checks per page are exactly the bytes SGLang's transfer backends move
    for it: each layer's ``item_len`` bytes at ``ptr + page * item_len`` of the buffers SGLang's
    pool registers (``get_contiguous_buf_infos``), for SGLang's MHA and MLA pools (the MLA pool
    has one latent ``kv_buffer`` per layer, no K and V); a last page's first tokens only."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    rig.publish_server_args(page_size=16, context_length=CONTEXT)
    ps = 16
    if layout == "mla":
        pool = MLATokenToKVPool(size=256, page_size=ps, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8,
                                layer_num=3, device="cpu", enable_memory_saver=False)
        buffers = pool.kv_buffer
    else:
        pool = MHATokenToKVPool(size=256, page_size=ps, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                                device="cpu", enable_memory_saver=False)
        buffers = [b for pair in zip(pool.k_buffer, pool.v_buffer) for b in pair]
    gen = torch.Generator().manual_seed(3)
    for b in buffers:
        b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
    ptrs, _, item_lens = pool.get_contiguous_buf_infos()
    firsts = buffers if layout == "mla" else buffers[::2]  # the MLA buffers, or each layer's K
    assert ptrs[: len(firsts)] == [b.data_ptr() for b in firsts]
    if layout == "mha":
        # SGLang registers every layer's K, then every layer's V; kvguard's manifest takes each
        # layer's K then V (the same bytes; the order only has to be the same on both sides).
        layers = len(ptrs) // 2
        order = [i for layer in range(layers) for i in (layer, layers + layer)]
        ptrs, item_lens = [ptrs[i] for i in order], [item_lens[i] for i in order]
    pages = [3, 1, 7]
    moved = [b"".join(ctypes.string_at(ptr + page * item, item) for ptr, item in zip(ptrs, item_lens)) for page in pages]
    assert kv_bytes._pages_bytes(pool, pages, ps) == moved
    assert kv_bytes._slot_bytes(pool, ps) * ps == len(moved[0])
    row = [item // ps for item in item_lens]
    last = b"".join(ctypes.string_at(ptr + 7 * item, 5 * r) for ptr, item, r in zip(ptrs, item_lens, row))
    assert kv_bytes._pages_bytes(pool, [3, 7], ps, [ps, 5])[1] == last
    assert kv_bytes._page_bytes(pool, 7, ps, 5) == last


# ---- a channel call that fails refuses that room only ----------------------------------------------


FAILURES = [("get", "dest"), ("get", "manifest"), ("get", "ids"), ("put", "dest"), ("put", "ids"),
            ("put", "manifest"), ("dest-shape", "dest"), ("drop", None)]


@pytest.mark.parametrize(("call", "field"), FAILURES, ids=[f"{c}-{f}" for c, f in FAILURES])
def test_a_channel_call_that_fails_refuses_only_its_room(monkeypatch, call, field):
    """One room's channel calls fail (an I/O error, or a ``dest`` of the wrong shape as anyone
    who can write a shared channel could leave): nothing raises into SGLang's loops; that
    room's transfer is refused (a failed clean-up refuses nothing), every other one is
    accepted and decodes as without kvguard."""
    channel = kvguard_pd._PROCESS_CHANNEL
    victim = 1000 + VICTIM
    real = {name: getattr(channel, name) for name in ("get", "put", "drop")}

    def get(room, f):
        if int(room) == victim and f == field:
            if call == "get":
                raise OSError(5, "Input/output error")
            if call == "dest-shape":
                return [[1, 0, 9], [2, 0, 9]]
        return real["get"](room, f)

    def put(room, f, value):
        if call == "put" and int(room) == victim and f == field:
            raise OSError(28, "No space left on device")
        return real["put"](room, f, value)

    def drop(room):
        real["drop"](room)
        if call == "drop" and int(room) == victim:
            raise OSError(13, "Permission denied")

    monkeypatch.setattr(channel, "get", get)
    monkeypatch.setattr(channel, "put", put)
    monkeypatch.setattr(channel, "drop", drop)
    p, d = sides(16, guard="enforce")
    pairs = workload(7, N)
    out = pd_rig.run_pd(p, d, pairs)
    rid = pairs[VICTIM][0].rid
    ref = unguarded(16, N)[0]
    assert {k: v for k, v in out.items() if k != rid} == {k: v for k, v in ref.items() if k != rid}
    if call == "drop":
        assert d.kvguard.metrics["transfers_accepted"] == N and d.kvguard.aborted == {}
        assert out == ref
        return
    assert d.kvguard.metrics["transfers_accepted"] == N - 1 and d.kvguard.metrics["transfers_refused"] == 1
    assert list(d.kvguard.aborted) == [rid]


def test_a_directory_channel_that_cannot_be_read_refuses_only_its_room(monkeypatch, tmp_path):
    """The directory channel: one room's manifest path is a directory (as a shared file system
    can leave it): reading, writing and removing it fail; that room alone is refused."""
    monkeypatch.setenv("KVGUARD_SGLANG_PD_CHANNEL", str(tmp_path))
    (tmp_path / f"{1000 + VICTIM}.manifest").mkdir()
    p, d = sides(16, guard="enforce")
    pairs = workload(7, N)
    out = pd_rig.run_pd(p, d, pairs)
    rid = pairs[VICTIM][0].rid
    assert d.kvguard.metrics["transfers_accepted"] == N - 1 and d.kvguard.metrics["transfers_refused"] == 1
    assert list(d.kvguard.aborted) == [rid]
    ref = unguarded(16, N)[0]
    assert {k: v for k, v in out.items() if k != rid} == {k: v for k, v in ref.items() if k != rid}


# ---- what kvguard refuses at start --------------------------------------------------------------


UNSUPPORTED = {
    "attention-tp": dict(tp_size=2),
    "dp-attention": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "pp": dict(pp_size=2),
    "role-switch": dict(enable_pd_role_switch=True),
}


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("setting", list(UNSUPPORTED))
def test_a_pd_server_kvguard_cannot_check_does_not_start_under_enforce(side, setting):
    """More than one rank per side (attention TP, DP attention, PP: the channel is keyed by room
    alone) or ``--enable-pd-role-switch`` (it re-creates the queues kvguard wraps), as SGLang
    publishes them: under enforce the scheduler does not start; under report it starts with its
    transfers unchecked (no sender or receiver wrapped)."""
    p, d = sides(16)
    s = p if side == "prefill" else d
    rig.publish_server_args(page_size=16, context_length=CONTEXT, disaggregation_mode=side,
                            disaggregation_transfer_backend="fake", **UNSUPPORTED[setting])
    with pytest.raises(RuntimeError, match="not supported") as refused:
        attach_kvguard(s, "enforce")
    assert isinstance(refused.value.__cause__, kvguard_pd.ConfigError)
    attach_kvguard(s, "report")
    assert not hasattr(s, "kvguard_pd_channel")


def test_a_pool_kvguard_cannot_read_does_not_start_under_enforce():
    """A KV pool that is neither SGLang's MHA nor its MLA layout (here: SGLang's K-only pool):
    refused at start under enforce, rather than every transfer refused later."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool

    p, d = sides(16)
    d.published.restore()
    pool = MHATokenToKOnlyPool(size=256, page_size=16, dtype=torch.float32, head_num=1, head_dim=8, layer_num=2,
                               device="cpu", enable_memory_saver=False)
    d.token_to_kv_pool_allocator.get_kvcache = lambda: pool
    with pytest.raises(RuntimeError, match="cannot read the KV pages of a MHATokenToKOnlyPool"):
        attach_kvguard(d, "enforce")
