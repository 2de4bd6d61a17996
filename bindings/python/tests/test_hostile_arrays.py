"""Arrays that lie about their memory are refused with a Python exception, never read.

kvguard reads the engine's arrays in place. An array's pointer, shape and strides are only its
word: `__array_interface__` says whatever its author writes, and numpy's `as_strided` builds
views past their buffer. So every view is checked against the memory of the object that owns it
(numpy's base chain, a buffer export, a DLPack capsule), and a device tensor is refused before
its data is touched. Cases that used to crash the process run in a child process, so a
regression fails a test instead of killing pytest."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import kvguard
from pool import admitted, block_table


def two_requests(table):
    return admitted(table, "a", "acme", 40), admitted(table, "b", "globex", 20)


def refusal_in_child(call):
    """Runs `call` (Python source; `t` is a table, `bt` a clean 2x8 block table of requests a and
    b; `np`, `as_strided`, `Interface` and `DLPackOnly` imported) in a child process; returns the exception's
    `(type name, message)`, or `("ok", "")`. A crash fails the test with the child's status."""
    code = textwrap.dedent(
        """
        import numpy as np, kvguard
        from numpy.lib.stride_tricks import as_strided
        from pool import admitted, block_table, small_config
        from test_hostile_arrays import DLPackOnly, Interface
        t = kvguard.OwnershipTable(small_config())
        bt = block_table([admitted(t, "a", "acme", 40), admitted(t, "b", "globex", 20)])
        try:
        """
    ) + textwrap.indent(textwrap.dedent(call), "    ") + textwrap.dedent(
        """
        except Exception as e:
            print(type(e).__name__); print(e)
        else:
            print("ok"); print("")
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=here, timeout=60)
    assert r.returncode == 0, f"the child died (status {r.returncode}): {r.stderr[-2000:]}"
    kind, _, message = r.stdout.partition("\n")
    return kind, message.strip()


class Interface:
    """An object that only describes an array: `__array_interface__`, nothing to check it by."""

    def __init__(self, data, shape, typestr="<i4", strides=None, keep=None):
        self.keep = keep
        self.__array_interface__ = {"data": (data, False), "shape": shape, "typestr": typestr, "strides": strides, "version": 3}


class DLPackOnly:
    """Exposes another array only through DLPack, as a tensor library would."""

    def __init__(self, arr, device=(1, 0)):
        self.arr, self.device, self.exported = arr, device, 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kw):
        self.exported += 1
        return self.arr.__dlpack__(**kw)


# --- objects that only describe memory -----------------------------------------------------


def test_an_array_interface_pointing_at_address_8_is_refused_as_a_type():
    kind, message = refusal_in_child('t.verify_step(["a", "b"], Interface(8, (2, 8)), [40, 20])')
    assert kind == "TypeError"
    assert "block_tables" in message and "__array_interface__" in message and "numpy array" in message


def test_an_array_interface_with_a_huge_shape_over_a_small_buffer_is_refused():
    small = "small = np.zeros(8, dtype=np.int32)\n"  # 32 bytes
    kind, message = refusal_in_child(small + 't.verify_step(["a", "b"], Interface(small.ctypes.data, (2, 2**40)), [40, 20])')
    assert kind == "TypeError" and "block_tables" in message and "__array_interface__" in message
    kind, message = refusal_in_child(small + 't.verify_step(["a"], bt[:1], Interface(small.ctypes.data, (2**40,)))')
    assert kind == "TypeError" and "seq_lens" in message and "sequence of ints" in message


def test_a_numpy_array_made_from_an_array_interface_is_refused_as_unestablished():
    # numpy believes the interface; its base is the describing object, which owns nothing.
    kind, message = refusal_in_child(
        """
        class I:
            __array_interface__ = {"data": (8, False), "shape": (2, 8), "typestr": "<i4", "version": 3}
        t.verify_step(["a", "b"], np.asarray(I()), [40, 20])
        """
    )
    assert kind == "TypeError" and "cannot establish whose memory" in message and "block_tables" in message


def test_a_base_that_owns_other_memory_does_not_vouch_for_a_pointer_elsewhere():
    # The describer names a real array as its base, but points 1 MiB past it.
    kind, message = refusal_in_child(
        """
        real = np.zeros((2, 8), np.int32)
        class I:
            base = real
            __array_interface__ = {"data": (real.ctypes.data + 2**20, False), "shape": (2, 8), "typestr": "<i4", "version": 3}
        t.verify_step(["a", "b"], np.asarray(I()), [40, 20])
        """
    )
    assert kind == "ValueError" and "outside the memory" in message


def test_a_device_array_interface_is_refused_naming_the_device_check(table):
    class Cuda:
        __cuda_array_interface__ = {"data": (8, False), "shape": (2, 8), "typestr": "<i4", "version": 3}

    with pytest.raises(TypeError, match="DeviceGuard"):
        table.verify_step(["a", "b"], Cuda(), [40, 20])


# --- numpy views past their buffer ------------------------------------------------------------


def test_an_as_strided_view_past_the_allocation_is_refused():
    kind, message = refusal_in_child('t.verify_step(["a", "b"], as_strided(bt, shape=(2, 2**30), strides=(32, 4)), [40, 20])')
    assert kind == "ValueError" and "block_tables" in message and "outside the memory" in message
    kind, message = refusal_in_child('t.verify_step(["a", "b"], bt, as_strided(np.array([40, 20]), shape=(2,), strides=(2**40,)))')
    assert kind == "ValueError" and "seq_lens" in message


def test_an_as_strided_view_inside_the_allocation_is_read(table):
    a, b = two_requests(table)
    bt = block_table([a, b])
    # Each row read twice (stride 0 over rows): row 0 and 1 both a's.
    twice = as_strided(bt, shape=(2, 8), strides=(0, 4))
    assert table.verify_step(["a", "a"], twice, [40, 40]).clean
    assert table.verify_step(["b", "a"], twice, [20, 40]).refused_rows == [0]


def test_negative_strides_inside_the_buffer_are_read(table):
    a, b = two_requests(table)
    bt = block_table([a, b])
    assert table.verify_step(["b", "a"], bt[::-1], [20, 40]).clean
    assert table.verify_step(["b", "a"], bt[::-1, ::-1][:, ::-1], np.array([40, 20])[::-1]).clean


def test_empty_arrays_touch_nothing_and_are_read(table):
    assert table.verify_step([], np.zeros((0, 8), np.int32), np.zeros(0, np.int32)).clean
    assert table.verify_step([], as_strided(np.zeros(1, np.int32), shape=(0, 2**40), strides=(4, 4)), []).clean


def test_a_token_slot_window_far_along_a_huge_stride_0_row_allocates_only_the_window():
    """A token-slot table of 2**40 int64 entries a row (a stride-0 view of one zero) read from a
    window near its end, through the three token-slot calls: each is judged (refused: the slots
    name a page nobody owns, the read is past what the window holds) and none allocates the row."""
    kind, message = refusal_in_child(
        """
        import resource
        big = as_strided(np.zeros(1, np.int64), shape=(4, 2**40), strides=(0, 0))
        n = 2**40
        w = t.check_step_window(["a"], big, [0], [n - 5], [n - 7], token_slots=True)
        v = t.verify_step_rows(["a"], big, [0], [n - 5], token_slots=True)
        keys, live = np.array([0, 0, 0, 0], np.int64), np.array([0, 1, 0, 0], np.int64)
        d = t.check_decode_forward(keys, live, np.zeros(4, np.int64), big, [1], [n - 5], [48])
        mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        assert not w.clean and not v.clean and d is not None and mb < 500, (w, v, d, mb)
        """
    )
    assert (kind, message) == ("ok", "")


def test_a_memoryview_is_checked_against_what_it_views(table):
    a, b = two_requests(table)
    assert table.verify_step(["a", "b"], memoryview(block_table([a, b])), [40, 20]).clean
    kind, message = refusal_in_child('t.verify_step(["a", "b"], memoryview(as_strided(bt, shape=(2, 2**30), strides=(32, 4))), [40, 20])')
    assert kind == "ValueError" and "outside the memory" in message


def test_a_released_memoryview_is_refused(table):
    a, b = two_requests(table)
    m = memoryview(block_table([a, b]))
    m.release()
    with pytest.raises(ValueError, match="block_tables"):
        table.verify_step(["a", "b"], m, [40, 20])


def test_a_writable_array_past_its_allocation_is_refused_before_anything_is_written():
    """kvguard.sglang's mirror arrays are written in place: a contiguous view that claims more
    than its buffer (as_strided with the element's own stride) is refused, not written past."""
    kind, message = refusal_in_child(
        """
        from test_window import mirror
        t, rows, keys, claimants, owner, prefix = mirror()
        free = [p for p in range(1, 128) if t.page_info(p).state == "free"]
        huge = as_strided(owner, shape=(2**24,), strides=(8,))
        t.write_decode_rows(keys, claimants, huge, prefix, np.full(8, 20, np.int64), [0], [20], [free[0] * 16])
        """
    )
    assert kind == "ValueError" and "page_owner" in message and "outside the memory" in message


# --- DLPack -----------------------------------------------------------------------------------


def test_a_device_tensor_is_refused_before_its_data_is_touched(table):
    cuda = DLPackOnly(np.zeros((2, 8), np.int32), device=(2, 0))
    with pytest.raises(TypeError, match=r"block_tables is in CUDA device memory.*kvguard\.DeviceGuard"):
        table.verify_step(["a", "b"], cuda, [40, 20])
    assert cuda.exported == 0


def test_a_host_dlpack_tensor_is_read_in_place(table):
    a, b = two_requests(table)
    bt = DLPackOnly(block_table([a, b]))
    assert table.verify_step(["a", "b"], bt, DLPackOnly(np.array([40, 20], np.int64))).clean
    # Pinned host memory (kDLCUDAHost, a pinned torch CPU tensor) is host memory.
    assert table.verify_step(["a", "b"], DLPackOnly(block_table([a, b]), device=(3, 0)), [40, 20]).clean
    # Read correctly: the rows swapped are each other's pages.
    assert table.check_step(["b", "a"], bt, [20, 40]).refused_rows == [0, 1]
    assert bt.exported == 2


def test_numpy_from_dlpack_keeps_its_producers_capsule_as_owner(table):
    a, b = two_requests(table)
    assert table.verify_step(["a", "b"], np.from_dlpack(DLPackOnly(block_table([a, b]))), [40, 20]).clean


def test_a_dlpack_export_of_a_lying_numpy_view_is_refused():
    kind, message = refusal_in_child('t.verify_step(["a", "b"], DLPackOnly(as_strided(bt, shape=(2, 2**30), strides=(32, 4))), [40, 20])')
    assert kind == "ValueError" and "outside the memory" in message


class Sub(np.ndarray):
    """A numpy subclass: read through its buffer export, never through numpy's struct."""


def test_a_numpy_array_reads_the_same_through_its_struct_as_through_its_export(table):
    """An exact numpy array is read from numpy's own struct (data, dimensions, strides, dtype,
    base), a subclass through its buffer export: any view, either dtype, the same verdicts."""
    a, b = two_requests(table)
    rng = np.random.default_rng(7)
    pages = np.array(a + b + [0, 1, 255, 256, 10_000, -1], dtype=np.int64)
    for case in range(300):
        dtype = (np.int32, np.int64)[case % 2]
        grid = rng.choice(pages, size=(6, 12)).astype(dtype)
        grid[rng.integers(0, 6), : len(a)] = a
        rows = rng.choice(6, size=2, replace=False)
        step = rng.integers(1, 4)
        view = grid[rows][:, ::step] if case % 3 else grid[rows[::-1]][:, ::-1][::-1]
        lens = np.array(rng.integers(0, 41, size=2), dtype=dtype)
        ids = ["a", "b"] if case % 4 else ["b", "a"]
        exact = table.check_step(ids, view, lens)
        exported = table.check_step(ids, view.view(Sub), lens.view(Sub))
        assert type(view) is np.ndarray and type(view.view(Sub)) is Sub
        assert (exact.refused_rows, repr(exact.violations)) == (exported.refused_rows, repr(exported.violations))
    # A dtype, a byte order or a dimension count the struct does not settle goes to the export,
    # which names it as before.
    for wrong in (grid.astype(">i4"), grid.astype(np.int16), grid.astype(np.float32)):
        with pytest.raises(TypeError, match="block_tables must"):
            table.check_step(["a"], wrong[:1], [40])
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        table.check_step(["a"], np.zeros((1, 2, 8), np.int32), [40])


def test_a_numpy_array_is_written_the_same_through_its_struct_as_through_its_export():
    """A writable exact numpy array (kvguard.sglang's mirrors, the allocator's marks) is found from
    numpy's struct, a subclass through its buffer export: the same marks, and what the struct
    does not settle (read-only, strided, another dtype) refused as the export refuses it."""
    rng = np.random.default_rng(11)
    for case in range(200):
        n, page_size = int(rng.integers(1, 64)), int(rng.integers(1, 5))
        slots = rng.integers(-3, n * page_size + 3, size=int(rng.integers(0, 20)))
        exact, sub = np.zeros(n, np.uint8), np.zeros(n, np.uint8).view(Sub)
        kvguard.mark_pages(exact, slots, page_size)
        kvguard.mark_pages(sub, slots, page_size)
        assert type(exact) is np.ndarray and type(sub) is Sub
        assert exact.tolist() == np.asarray(sub).tolist()
        expected = np.zeros(n, np.uint8)
        for s in slots:
            if 0 <= s < n * page_size:
                expected[s // page_size] = 1
        assert exact.tolist() == expected.tolist()
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    for wrong in (frozen, np.zeros(16, np.uint8)[::2], np.zeros(8, np.int8), np.zeros(8, np.uint16)):
        with pytest.raises(TypeError, match="flags must be a writable, contiguous 1-D uint8 array"):
            kvguard.mark_pages(wrong, [1], 1)
        with pytest.raises(TypeError, match="flags must be a writable, contiguous 1-D uint8 array"):
            kvguard.mark_pages(wrong.view(Sub), [1], 1)
    assert not frozen.any()


def test_wrong_dtype_and_dimensions_are_still_refused(table):
    with pytest.raises(TypeError, match="block_tables must have dtype int32 or int64"):
        table.verify_step(["a"], np.zeros((1, 8), np.float64), [40])
    with pytest.raises(TypeError, match="block_tables must have dtype int32 or int64"):
        table.verify_step(["a"], DLPackOnly(np.zeros((1, 8), np.float32)), [40])
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        table.verify_step(["a"], np.zeros(8, np.int32), [40])
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        table.verify_step(["a"], DLPackOnly(np.zeros(8, np.int32)), [40])
    with pytest.raises(TypeError, match="seq_lens must be a 1-D int32 or int64 array"):
        table.verify_step(["a"], np.zeros((1, 8), np.int32), object())


# --- torch: run by scripts/ci/sglang.sh in the SGLang venv (which has torch), deselected from
# the project venv's run by name (-k "not torch"), so it never skips ---------------------------


def test_torch_cpu_tensors_and_their_numpy_views_are_read(table):
    import torch

    a, b = two_requests(table)
    t = torch.from_numpy(block_table([a, b]))
    assert table.verify_step(["a", "b"], t, torch.tensor([40, 20])).clean
    assert table.verify_step(["a", "b"], t.numpy(), torch.tensor([40, 20]).numpy()).clean
    assert table.verify_step(["a"], t[:1].numpy()[:, :4], [40]).clean
    # A subclass goes through __dlpack_device__ / __dlpack__ (only exact tensors take torch's C++
    # export directly); a tensor on a device the host cannot read is refused as a type.
    assert table.verify_step(["a", "b"], torch.nn.Buffer(t) if hasattr(torch.nn, "Buffer") else t, [40, 20]).clean
    with pytest.raises(TypeError, match="DeviceGuard"):
        table.verify_step(["a", "b"], torch.empty((2, 8), dtype=torch.int32, device="meta"), [40, 20])
    with pytest.raises(TypeError, match="dtype int32 or int64"):
        table.verify_step(["a", "b"], t.float(), [40, 20])


def test_an_int_past_int64_in_a_sequence_is_a_value_error_not_a_type_error(table):
    with pytest.raises(ValueError, match=r"seq_lens\[1\] is 1180591620717411303424: out of the int64 range"):
        table.verify_step(["a", "b"], np.zeros((2, 8), np.int32), [1, 2**70])
    with pytest.raises(TypeError, match="seq_lens must hold ints, got a str"):
        table.verify_step(["a", "b"], np.zeros((2, 8), np.int32), [1, "2"])


def test_torch_views_read_step_after_step_are_judged_against_the_memory_they_show(table):
    """A numpy view of a torch CPU tensor (vLLM's CpuGpuBuffer.np, read every step) is judged
    against its tensor's storage once, and that storage kept, so later steps read the view without
    exporting the tensor. The view stays readable when its tensor is given other memory (the
    storage kept still holds what the view shows); when torch moves the storage's data
    (share_memory_), the view points at freed memory and is refused, not read."""
    import torch

    a, b = two_requests(table)
    t = torch.zeros((2, 8), dtype=torch.int32)
    view = t.numpy()
    view[:] = block_table([a, b])
    for _ in range(3):
        assert table.verify_step(["a", "b"], view, [40, 20]).clean
    t.data = torch.zeros((2, 8), dtype=torch.int32)  # other memory for the tensor, none for the view
    assert table.verify_step(["a", "b"], view, [40, 20]).clean
    u = torch.zeros((2, 8), dtype=torch.int32)
    moved = u.numpy()
    moved[:] = block_table([a, b])
    assert table.verify_step(["a", "b"], moved, [40, 20]).clean
    u.untyped_storage().share_memory_()  # torch moves the data: `moved` now shows freed memory
    with pytest.raises(ValueError, match="block_tables"):
        table.verify_step(["a", "b"], moved, [40, 20])
