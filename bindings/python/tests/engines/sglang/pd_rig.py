"""SGLang 0.5.23's own PD (prefill/decode disaggregation) schedulers on CPU, in one process.

Two schedulers are built as :mod:`scheduler_rig` builds one, one in SGLang's ``prefill`` mode and
one in its ``decode`` mode, each with its PD queues set up by SGLang's own
``Scheduler.init_disaggregation`` (the prefill side's ``PrefillBootstrapQueue`` and inflight
queue; the decode side's ``DecodeReqToTokenPool``, ``DecodePreallocQueue`` and
``DecodeTransferQueue``). Each side runs SGLang's own event loop (:class:`EventLoop`: the normal
or, with the overlap schedule on, the overlap PD loop, as SGLang's dispatch picks it), one
iteration per step; the socket read is the stand-in that hands control back. Both sides use
SGLang's fake transfer backend (``--disaggregation-transfer-backend fake``: ``FakeKVSender`` /
``FakeKVReceiver``, chosen by SGLang's ``get_kv_class``); requests name a prefill host
(:data:`PREFILL_HOST`), not SGLang's fake bootstrap host, whose requests SGLang never caches in a
radix cache.

What is replaced: the model (as in :mod:`scheduler_rig`) and the wire. SGLang's fake backend moves
no KV (it is there for warm-up requests: its receiver reports success as soon as the decode side
sent its metadata). :class:`WireKVSender` / :class:`WireKVReceiver` are that backend with a wire:
the sender copies the pages SGLang's ``send_kv_chunk`` gives it into the destination pages the
decode side's ``send_metadata`` named, through the two pools' buffer pointers and page item
lengths (``KVArgs.kv_data_ptrs`` / ``kv_item_lens``, what an RDMA backend such as mooncake
writes with), and the receiver reports ``KVPoll.Success`` once the pages the sender was told to
send (``init(num_kv_indices)``) have all been sent, as a real backend does. With the last chunk
it copies the request's metadata row (``MetadataBuffers``: the first output token) and it carries
the decode side's ``decode_prefix_len`` (its radix cache's match) to the prefill side, as a real
backend's aux transfer and bootstrap do. Like a real wire, it moves what it was given: it does
not know the prompt.

The two schedulers share the process: SGLang's published config (``runtime_context``) is
process-wide, so each side's is saved when it is built and put back before each of its steps.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import scheduler_rig as rig
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver, FakeKVSender
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

# ---- the wire -----------------------------------------------------------------------------------


class Wire:
    """The network between the two sides, in one process: per ``bootstrap_room``, the decode
    side's destination (its KV buffers' pointers, item lengths and the pages it offered) and
    whether the prefill side sent its last chunk.

    Across two processes (``dir`` set: :func:`install_wire` with a directory), the wire is that
    directory: the decode side's offer (its pages) is a file, each chunk the prefill side sends is
    a file of the pages' bytes, which the decode side's receiver lands in its own pool (as a
    backend's receiving end does) before it reports the transfer done."""

    rooms: dict = {}
    offered: list = []
    """Every (room, decode pages offered), in order."""
    dir: str | None = None

    @classmethod
    def reset(cls, directory: str | None = None) -> None:
        cls.rooms = {}
        cls.offered = []
        cls.dir = directory

    @classmethod
    def path(cls, room, name: str) -> str:
        import os

        return os.path.join(cls.dir, f"{int(room)}.{name}")

    @classmethod
    def write(cls, room, name: str, data: bytes) -> None:
        import os

        tmp = cls.path(room, name) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, cls.path(room, name))

    @classmethod
    def read(cls, room, name: str) -> bytes | None:
        try:
            with open(cls.path(room, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


class WireKVSender(FakeKVSender):
    """SGLang's fake sender, with a wire: ``send`` copies the given prefill pages to the decode
    side's pages for this room, in order (a prompt comes in chunks)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self.pages_sent = 0
        self.pages_total = None
        self.aux_index = None

    def init(self, num_kv_indices, aux_index=None):
        """The number of pages this transfer will send (SGLang's ``finalize_bootstrap``) and the
        prefill side's metadata row (``aux_index``: the first output token, the room)."""
        self.pages_total = int(num_kv_indices)
        self.aux_index = aux_index
        super().init(num_kv_indices, aux_index)

    def poll(self) -> KVPoll:
        if self.conclude_state is None and not self.has_sent and not self._offered():
            return KVPoll.Bootstrapping  # the decode side has not sent its metadata yet
        return super().poll()

    def pop_decode_prefix_len(self) -> int:
        """How much of the prompt the decode side already holds (its radix cache's match), as
        its ``send_metadata`` said; SGLang's prefill side sends from there."""
        room = Wire.rooms.get(int(self.bootstrap_room))
        return 0 if room is None else room["prefix"]

    def _offered(self) -> bool:
        if Wire.dir is None:
            return int(self.bootstrap_room) in Wire.rooms
        return Wire.read(self.bootstrap_room, "offer") is not None

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        if Wire.dir is not None:
            return self._send_across(kv_indices, state_indices, num_kv_tokens)
        room = Wire.rooms.get(int(self.bootstrap_room))
        pages = [int(p) for p in torch.as_tensor(kv_indices).reshape(-1).tolist()]
        if room is None or self.pages_sent + len(pages) > len(room["pages"]):
            self.conclude_state = KVPoll.Failed  # nowhere to write: the transfer fails
            return
        src = self.kv_mgr.kv_args
        dst = room["args"]
        for s_page, d_page in zip(pages, room["pages"][self.pages_sent : self.pages_sent + len(pages)]):
            for s_ptr, d_ptr, s_len, d_len in zip(src.kv_data_ptrs, dst.kv_data_ptrs, src.kv_item_lens, dst.kv_item_lens):
                assert s_len == d_len, "both sides' pages are the same size"
                ctypes.memmove(d_ptr + d_page * d_len, s_ptr + s_page * s_len, s_len)
        self.pages_sent += len(pages)
        super().send(kv_indices, state_indices, num_kv_tokens)
        if self.pages_total is not None and self.pages_sent >= self.pages_total:
            self._send_aux(src, dst, room.get("aux"))
            room["sent"] = True  # the last page is on the decode side

    def _send_aux(self, src, dst, dst_index) -> None:
        """With the last chunk, the request's metadata row (SGLang's ``MetadataBuffers``: the
        first output token, the room) into the decode side's row, as a real backend's aux
        transfer does (a request on SGLang's fake bootstrap host has no row to fill)."""
        if self.aux_index is None or dst_index is None:
            return
        for s_ptr, d_ptr, s_len, d_len in zip(src.aux_data_ptrs, dst.aux_data_ptrs, src.aux_item_lens, dst.aux_item_lens):
            assert s_len == d_len, "both sides' metadata rows are the same size"
            ctypes.memmove(d_ptr + int(dst_index) * d_len, s_ptr + int(self.aux_index) * s_len, s_len)


    def _send_across(self, kv_indices, state_indices, num_kv_tokens):
        """The chunk's pages, as bytes, into the wire directory (the decode side lands them)."""
        import json

        offer = Wire.read(self.bootstrap_room, "offer")
        pages = [int(p) for p in torch.as_tensor(kv_indices).reshape(-1).tolist()]
        if offer is None or self.pages_sent + len(pages) > len(json.loads(offer)):
            self.conclude_state = KVPoll.Failed
            return
        src = self.kv_mgr.kv_args
        data = b"".join(
            ctypes.string_at(ptr + page * size, size)
            for page in pages for ptr, size in zip(src.kv_data_ptrs, src.kv_item_lens)
        )
        Wire.write(self.bootstrap_room, f"chunk.{self.pages_sent}", data)
        self.pages_sent += len(pages)
        super().send(kv_indices, state_indices, num_kv_tokens)
        if self.pages_total is not None and self.pages_sent >= self.pages_total:
            if self.aux_index is not None:
                row = b"".join(
                    ctypes.string_at(ptr + int(self.aux_index) * size, size)
                    for ptr, size in zip(src.aux_data_ptrs, src.aux_item_lens)
                )
                Wire.write(self.bootstrap_room, "aux", row)
            Wire.write(self.bootstrap_room, "sent", str(self.pages_sent).encode())


class WireKVReceiver(FakeKVReceiver):
    """SGLang's fake receiver, with a wire: ``send_metadata`` offers its pages for the room;
    ``poll`` says ``Success`` once the prefill side sent its last chunk."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.bootstrap_room = bootstrap_room

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None):
        Wire.rooms[int(self.bootstrap_room)] = {
            "args": self.kv_mgr.kv_args,
            "pages": [int(p) for p in torch.as_tensor(kv_indices).reshape(-1).tolist()],
            "sent": False,
            # The prompt's tokens the decode side's radix cache holds: the prefill side sends
            # from there (SGLang's PD protocol, as its real backends carry it).
            "prefix": int(decode_prefix_len or 0),
            "aux": aux_index,
        }
        Wire.offered.append((int(self.bootstrap_room), Wire.rooms[int(self.bootstrap_room)]["pages"]))
        if Wire.dir is not None:
            import json

            self.landed = 0
            Wire.write(self.bootstrap_room, "offer", json.dumps(Wire.rooms[int(self.bootstrap_room)]["pages"]).encode())
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)

    def poll(self) -> KVPoll:
        if Wire.dir is not None and self.conclude_state is None and self.has_sent_metadata:
            self._land()
        state = super().poll()
        if state == KVPoll.Success and not Wire.rooms.get(int(self.bootstrap_room), {}).get("sent"):
            self.conclude_state = None
            return KVPoll.WaitingForInput
        return state


    def _land(self) -> None:
        """Across processes: the chunks that came, landed in this side's pages in order; the
        transfer is done once the prefill side's last chunk is landed."""
        import os

        room = Wire.rooms[int(self.bootstrap_room)]
        dst = self.kv_mgr.kv_args
        page_bytes = sum(dst.kv_item_lens)
        while True:
            name = f"chunk.{self.landed}"
            data = Wire.read(self.bootstrap_room, name)
            if data is None:
                break
            for i in range(len(data) // page_bytes):
                page, at = room["pages"][self.landed + i], i * page_bytes
                for ptr, size in zip(dst.kv_data_ptrs, dst.kv_item_lens):
                    ctypes.memmove(ptr + page * size, data[at : at + size], size)
                    at += size
            os.remove(Wire.path(self.bootstrap_room, name))
            self.landed += len(data) // page_bytes
        sent = Wire.read(self.bootstrap_room, "sent")
        aux = Wire.read(self.bootstrap_room, "aux")
        if sent is not None and aux is not None and room.get("aux") is not None:
            at = 0  # the request's metadata row, landed in this side's row
            for ptr, size in zip(dst.aux_data_ptrs, dst.aux_item_lens):
                ctypes.memmove(ptr + int(room["aux"]) * size, aux[at : at + size], size)
                at += size
        room["sent"] = sent is not None and int(sent) == self.landed


def install_wire(directory: str | None = None) -> None:
    """SGLang's fake backend with the wire: ``get_kv_class(FAKE, SENDER / RECEIVER)`` imports
    its classes from ``sglang.srt.disaggregation.fake`` when called, so they are set there.
    ``directory``: the two sides run in two processes, the wire is that directory."""
    import sglang.srt.disaggregation.fake as fake

    Wire.reset(directory)
    fake.FakeKVSender = WireKVSender
    fake.FakeKVReceiver = WireKVReceiver


# ---- the process-wide config, per side -----------------------------------------------------------


class Published:
    """One side's published SGLang config (``runtime_context``), saved and put back."""

    _SLOTS = ("_server_args", "_config_bags", "_overrides_log", "_publish_role", "flags", "resources", "forward")

    def __init__(self) -> None:
        from sglang.srt.runtime_context import get_context

        ctx = get_context()
        self.values = {name: getattr(ctx, name) for name in self._SLOTS}
        self.parallel = ctx.parallel._config
        self.stamp = dict(ctx.parallel._stamp)

    def restore(self) -> None:
        from sglang.srt.runtime_context import get_context

        ctx = get_context()
        for name, value in self.values.items():
            setattr(ctx, name, value)
        ctx.parallel._config = self.parallel
        ctx.parallel._stamp = dict(self.stamp)


# ---- the two schedulers ----------------------------------------------------------------------------


def _pd_ready(s, tokens: int) -> None:
    """What SGLang's PD queues read of the model runner and model config beyond what the
    NULL-mode rig sets (a one-layer-group MHA model, one KV head)."""
    runner = s.tp_worker.model_runner
    runner.effective_logical_max_total_num_tokens = tokens
    runner.kv_cache_dtype_str = "float32"
    s.tp_worker.is_hybrid_swa = False
    mc = s.model_config
    mc.num_hidden_layers = rig.LAYERS
    mc.get_total_num_kv_heads = lambda: 1
    mc.hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"])
    s.attn_cp_cpu_group = s.attn_tp_cpu_group = None
    _one_rank_process_group()
    from sglang.srt.runtime_context import get_parallel

    # A one-rank attention group (DecodeTransferQueue reads its gloo group; one rank never uses it).
    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=None, world_size=1))


def _one_rank_process_group() -> None:
    """SGLang's PD queues all-reduce their polls over the attention group (``dist.get_world_size``
    of it, one rank here): a one-rank gloo group in this process, as a one-GPU server has."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class CpuEvent:
    """``torch.cuda.Event``'s stand-in on CPU, where the forward is done when it returns.

    Under the overlap schedule SGLang's prefill side records a CUDA event on the forward stream
    before it sends a cached prefix early (``maybe_send_cached_prefix_chunk``, on by default:
    ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``), for the backend to wait on; torch has
    no event on the CPU stream the rig runs on. Part of the device stand-in, like the model."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def build_prefill(*, page_size: int, tokens: int, rows: int, context_len: int, **server_args):
    """A prefill-mode Scheduler (SGLang's ``init_disaggregation``: bootstrap and inflight queues)."""
    if not server_args.get("disable_overlap_schedule", True) and not torch.cuda.is_available():
        torch.cuda.Event = CpuEvent
    s = rig.build_scheduler(
        page_size=page_size, tokens=tokens, rows=rows, context_len=context_len,
        disaggregation_mode="prefill", disaggregation_transfer_backend="fake", **server_args,
    )
    _pd_ready(s, tokens)
    s.init_disaggregation()
    s.published = Published()
    return s


def build_decode(
    *, page_size: int, tokens: int, rows: int, context_len: int, radix_cache: bool = False, **server_args
):
    """A decode-mode Scheduler on SGLang's ``DecodeReqToTokenPool`` (rows for running and for
    preallocated requests), with its prealloc and transfer queues (``init_disaggregation``) and
    its radix cache disabled, as SGLang builds a decode server's by default; ``radix_cache``:
    enabled, as ``--disaggregation-decode-enable-radix-cache`` builds it (SGLang's argument check
    refuses that flag with the fake backend, which moves no KV; the rig's wire moves it and
    carries the decode side's prefix length, so the flag is set after that check)."""
    s = rig.build_scheduler(
        page_size=page_size, tokens=tokens, rows=rows, context_len=context_len,
        disaggregation_mode="decode", disaggregation_transfer_backend="fake",
        req_to_token_pool_factory=lambda: _decode_rows(rows, context_len), radix_cache=radix_cache, **server_args,
    )
    if radix_cache:
        from sglang.srt.runtime_context import get_context

        get_context().override("kvguard rig: the wire carries decode_prefix_len", disaggregation_decode_enable_radix_cache=True)
    _pd_ready(s, tokens)
    s.init_disaggregation()
    # What a real backend learns from the prefill server's bootstrap server (one prefill rank):
    # requests that name PREFILL_HOST resolve to it, as SGLang's fast path reads it.
    from sglang.srt.utils.network import NetworkAddress

    s.disagg_decode_prealloc_queue.kv_manager.prefill_info_table = {
        NetworkAddress(PREFILL_HOST, 0).to_host_port_str(): SimpleNamespace(dp_size=1, follow_bootstrap_room=True),
    }
    s.published = Published()
    return s


def _decode_rows(rows: int, context_len: int):
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

    return DecodeReqToTokenPool(
        size=rows, max_context_len=context_len + 4, device="cpu", enable_memory_saver=False, pre_alloc_size=rows,
    )


PREFILL_HOST = "127.0.0.1"
"""The prefill server's bootstrap host the router names (the transfer backend, SGLang's fake
one with the wire, is the servers' ``--disaggregation-transfer-backend fake``)."""


def pd_req(rid: str, prompt, *, room: int, max_new: int = 8, salt: str | None = None, host: str = PREFILL_HOST):
    """A request as the router sends it to both sides: same rid, prompt, bootstrap room and
    prefill host. ``host=FAKE_BOOTSTRAP_HOST``: SGLang's own warm-up / health probes, which SGLang
    never inserts into a radix cache (``Req.skip_radix_cache_insert``)."""
    r = rig.generate_req(rid, prompt, max_new=max_new, salt=salt)
    r.bootstrap_host = host
    r.bootstrap_port = 0
    r.bootstrap_room = room
    return r


class EventLoop:
    """SGLang's own event loop of one scheduler, run one iteration at a time.

    ``_dispatch_event_loop_once`` (SGLang's, as ``run_event_loop`` calls it) picks the loop as a
    server does: ``event_loop_normal_disagg_prefill`` / ``_decode``, or with the overlap schedule
    on (``disable_overlap_schedule=False``) ``event_loop_overlap_disagg_prefill`` / ``_decode``
    (their result queue, each batch's ``process_batch_result`` one iteration later, their
    loop-local state). It runs in a thread of its own; the socket read is the one stand-in:
    ``request_receiver.recv_requests``, which SGLang's ``ingest_requests`` calls at the top of
    every iteration, hands control back to the driver and, on the next :meth:`step`, returns the
    requests queued with :meth:`send` (SGLang's ``process_input_requests`` dispatches them). Only
    one thread runs at a time, so the driver may read and change the scheduler between steps."""

    class _Stop(BaseException):
        """Ends the loop's thread (raised from the socket read)."""

    def __init__(self, s) -> None:
        import threading

        self.s = s
        self.inbox: list = []
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._in_loop = False
        self._stopping = False
        self._ended = False
        self._error: BaseException | None = None
        # SGLang's dispatcher, for the one input type the rig sends (its full table names the
        # weight updater's and other components' handlers, which the rig does not build).
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.utils import TypeBasedDispatcher

        s._request_dispatcher = TypeBasedDispatcher([(TokenizedGenerateReqInput, s.handle_generate_request)])
        s.request_receiver = SimpleNamespace(recv_requests=self._recv)
        s.external_corpus_manager = None  # as Scheduler.__init__ leaves it without one
        self._thread = threading.Thread(target=self._run, name=f"sglang-{s.disaggregation_mode.value}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from sglang.srt.managers.scheduler import _dispatch_event_loop_once

        try:
            self._go.acquire()
            if self._stopping:
                return
            self.s.published.restore()
            _dispatch_event_loop_once(self.s)
        except EventLoop._Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
            self._error = e
        finally:
            self._ended = True
            self._back.release()

    def _recv(self, local_reqs=()):
        if self._in_loop:
            self._back.release()  # one iteration done: the driver's turn
            self._go.acquire()
        self._in_loop = True
        if self._stopping:
            raise EventLoop._Stop()
        self.s.published.restore()
        reqs, self.inbox = self.inbox, []
        return list(local_reqs) + reqs

    def send(self, req) -> None:
        """A request for the scheduler's socket, read at the top of the next iteration."""
        self.inbox.append(req)

    def step(self):
        """One iteration of the loop (from its socket read to the next); the batch it launched."""
        if self._ended:
            raise AssertionError("the event loop has ended") from self._error
        self._go.release()
        self._back.acquire()
        if self._error is not None:
            raise self._error
        if self._ended:
            raise AssertionError("SGLang's event loop returned")
        return self.s.last_batch

    def close(self) -> None:
        """Ends the thread (at its next socket read)."""
        if not self._ended:
            self._stopping = True
            self._go.release()
            self._back.acquire()
        self._thread.join()


def count_overlap(s) -> SimpleNamespace:
    """Counts, on this scheduler, the batch results SGLang processed after it had launched a
    later batch (``overlapped``): what the overlap loops do and the normal ones never do."""
    seen = SimpleNamespace(launched=0, processed=0, overlapped=0)
    run_batch, process = s.run_batch, s.process_batch_result

    def launch(batch, *args, **kwargs):
        seen.launched += 1
        return run_batch(batch, *args, **kwargs)

    def processed(batch, *args, **kwargs):
        seen.processed += 1
        seen.overlapped += seen.launched > seen.processed
        return process(batch, *args, **kwargs)

    s.run_batch, s.process_batch_result = launch, processed
    return seen


def event_loop(s) -> EventLoop:
    """The scheduler's :class:`EventLoop` (made on first use)."""
    loop = getattr(s, "rig_event_loop", None)
    if loop is None:
        loop = s.rig_event_loop = EventLoop(s)
    return loop


def prefill_step(s):
    """One iteration of the prefill side's own event loop (normal or overlap, as configured)."""
    return event_loop(s).step()


def decode_step(s):
    """One iteration of the decode side's own event loop (normal or overlap, as configured)."""
    return event_loop(s).step()


def idle(s) -> bool:
    """Nothing queued, running or in flight on this side."""
    queues = [s.waiting_queue]
    if s.disagg_prefill_bootstrap_queue is not None:
        queues += [s.disagg_prefill_bootstrap_queue.queue, s.disagg_prefill_inflight_queue]
    if s.disagg_decode_prealloc_queue is not None:
        queues += [s.disagg_decode_prealloc_queue.queue, s.disagg_decode_prealloc_queue.pending_reqs,
                   s.disagg_decode_transfer_queue.queue]
    return (all(len(q) == 0 for q in queues) and s.running_batch.is_empty() and s.chunked_req is None
            and not s.result_queue)


def run_pd(prefill, decode, pairs, *, per_step: int = 4, max_steps: int = 100_000, between=None) -> dict:
    """``pairs`` (prefill request, decode request) arrive ``per_step`` at a time, the decode side
    first (the router's order does not matter to SGLang; here the decode side's metadata is on the
    wire before prefill sends); both sides step until both are idle; returns what the decode side
    finished (:func:`scheduler_rig.finished`). ``between``: called after each round of steps,
    while neither loop runs (a client's abort, say)."""
    pending = list(pairs)
    for _ in range(max_steps):
        for p_req, d_req in pending[:per_step]:
            event_loop(decode).send(d_req)
            event_loop(prefill).send(p_req)
        del pending[:per_step]
        decode_step(decode)
        prefill_step(prefill)
        decode_step(decode)
        if between is not None:
            between()
        if not pending and idle(prefill) and idle(decode):
            return rig.finished(decode)
    raise AssertionError("the PD schedulers did not finish the workload")
