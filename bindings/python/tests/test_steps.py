"""One call per step: verify_step (vLLM), verify_step_csr (FlashInfer), record_step_writes
(slot mapping), zero copy, dtypes, strides, shapes, errors."""

import numpy as np
import pytest

import kvguard
from pool import PAGE, admitted, block_table


def two_requests(table):
    a = admitted(table, "a", "acme", 40)
    b = admitted(table, "b", "globex", 20)
    return a, b


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_verify_step_refuses_row_by_row(table, dtype):
    a, b = two_requests(table)
    # Row 1 reads a's page (foreign), row 2 reads past what b wrote (unwritten).
    bt = block_table([a, [a[0]], b], dtype=dtype)
    v = table.verify_step(["a", "b", "b"], bt, np.array([40, 16, 32], dtype=np.int32))
    assert not v.clean and v.rows == 3 and len(v) == 2
    assert v.refused_rows == [1, 2]
    assert v.refused_mask.dtype == np.bool_ and v.refused_mask.tolist() == [False, True, True]
    assert [x.kind for x in v.violations] == ["foreign_page", "foreign_page"] or v.violations[0].kind == "foreign_page"
    assert "StepVerdict" in repr(v)


def test_check_step_is_pure(table):
    a, b = two_requests(table)
    v = table.check_step(["b"], block_table([a]), [16])
    assert v.refused_rows == [0] and table.counters() == {}
    assert not table.request_info("b").quarantined


def test_unwritten_slot_and_padding_rows(table):
    a, b = two_requests(table)
    # vLLM's block table has more rows than requests, padded with the null block 0.
    bt = np.zeros((64, 16), dtype=np.int32)
    bt[0, :3] = a
    bt[1, :2] = b
    v = table.verify_step(["a", "b"], bt, np.array([40, 21], dtype=np.int32))
    assert v.refused_rows == [1] and v.violations[0].kind == "unwritten_slots"
    assert v.violations[0].slots == (4, 5)


def test_row_stride_honoured_and_views(table):
    a, b = two_requests(table)
    big = np.zeros((8, 32), dtype=np.int32)
    big[0, :3] = a
    big[2, :2] = b
    view = big[::2, :8]  # row stride 256 bytes, not the row's width
    assert not view.flags.c_contiguous
    assert table.verify_step(["a", "b"], view, [40, 20]).clean
    # Non-contiguous columns are converted, not refused.
    cols = np.zeros((2, 16), dtype=np.int64)
    cols[0, 0:6:2] = a
    cols[1, 0:4:2] = b
    assert table.verify_step(["a", "b"], cols[:, ::2], [40, 20]).clean


def test_buffer_protocol_objects_are_read(table):
    """memoryviews and array.array are read like numpy arrays (objects exposing only
    __array_interface__ are refused: test_hostile_arrays.py)."""
    a, b = two_requests(table)
    bt = block_table([a, b])
    assert table.verify_step(["a", "b"], memoryview(bt), memoryview(np.array([40, 20], dtype=np.int32))).clean
    import array

    assert table.verify_step(["a"], bt[:1], array.array("i", [40])).clean


def test_negative_and_huge_pages_are_refused_as_out_of_range(table):
    a, _ = two_requests(table)
    bt = block_table([[-1, a[1], a[2]]])
    v = table.check_step(["a"], bt, [40])
    assert v.violations[0].kind == "page_out_of_range"
    v = table.check_step(["a"], block_table([[2**40, 1]], dtype=np.int64), [16])
    assert v.violations[0].kind == "page_out_of_range"


def test_int_request_ids_as_array(table):
    admitted(table, 3, 1, 16)
    pages = table.request_info(3).owned_pages
    v = table.verify_step(np.array([3], dtype=np.int64), block_table([[pages[0].page]]), [16])
    assert v.clean
    with pytest.raises(ValueError, match="req_ids"):
        table.verify_step(np.array([-3]), block_table([[1]]), [16])


def test_unknown_string_request_is_refused_not_raised(table):
    v = table.verify_step(["never-admitted"], block_table([[1]]), [16])
    assert v.violations[0].kind == "unknown_request"


def test_shape_and_dtype_errors(table):
    two_requests(table)
    with pytest.raises(TypeError, match="int32 or int64"):
        table.verify_step(["a"], np.zeros((1, 4), dtype=np.float32), [16])
    with pytest.raises(TypeError, match="int32 or int64"):
        table.verify_step(["a"], np.zeros((1, 4), dtype=np.int16), [16])
    with pytest.raises(TypeError, match="big-endian|int32 or int64"):
        table.verify_step(["a"], np.zeros((1, 4), dtype=">i4"), [16])
    with pytest.raises(ValueError, match="2-D"):
        table.verify_step(["a"], np.zeros(4, dtype=np.int32), [16])
    with pytest.raises(ValueError, match="rows"):
        table.verify_step(["a", "b"], np.zeros((1, 4), dtype=np.int32), [16, 16])
    with pytest.raises(ValueError, match="seq_lens"):
        table.verify_step(["a"], np.zeros((1, 4), dtype=np.int32), [])
    with pytest.raises(ValueError, match=">= 0"):
        table.verify_step(["a"], np.zeros((1, 4), dtype=np.int32), [-1])
    with pytest.raises(TypeError, match="2-D int32 or int64 array"):
        table.verify_step(["a"], [[1, 2]], [16])
    with pytest.raises(TypeError, match="int or a str"):
        table.verify_step([1.5], np.zeros((1, 4), dtype=np.int32), [16])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_verify_step_csr(table, dtype):
    a, b = two_requests(table)
    indptr = np.array([0, 3, 5, 6], dtype=dtype)
    indices = np.array(a + b + [a[0]], dtype=dtype)
    last = np.array([8, 4, 16], dtype=dtype)
    assert table.check_step_csr(["a", "b"], indptr[:3], indices, last[:2]).clean
    v = table.verify_step_csr(["a", "b", "b"], indptr, indices, last)
    assert v.refused_rows == [2] and v.violations[0].kind == "foreign_page"
    with pytest.raises(ValueError, match="kv_indptr"):
        table.verify_step_csr(["a"], np.array([0, 9]), indices, last)


def test_record_step_writes_from_slot_mapping(table):
    table.admit("a", "acme", 20, 8)
    table.admit("b", "globex", 20, 8)
    pa = [r.page for r in table.allocate("a", 2)]
    pb = [r.page for r in table.allocate("b", 2)]
    # Prefill: a writes 20 tokens, b writes 3; padding at the end.
    slots = [pa[t // PAGE] * PAGE + t % PAGE for t in range(20)] + [pb[0] * PAGE + t for t in range(3)]
    slot_mapping = np.array(slots + [kvguard.PADDING_SLOT] * 5, dtype=np.int64)
    qsl = np.array([0, 20, 23], dtype=np.int32)
    v = table.record_step_writes(["a", "b"], slot_mapping, qsl)
    assert v.clean
    table.verify_read("a", pa, 20)
    # b writing into a's page is refused; a's row goes through.
    bad = np.array([pa[1] * PAGE + 4, pa[1] * PAGE + 5], dtype=np.int32)  # int32 accepted
    v = table.record_step_writes(["a", "b"], bad, np.array([0, 1, 2]))
    assert v.refused_rows == [1] and v.violations[0].kind == "foreign_page"
    with pytest.raises(ValueError, match="query_start_loc"):
        table.record_step_writes(["a"], bad, np.array([0, 5]))


def test_record_step_writes_int64_zero_copy_strided(table):
    table.admit(1, 1, 16, 0)
    p = table.allocate(1, 1)[0].page
    base = np.full(32, -1, dtype=np.int64)
    base[::2] = [p * PAGE + t for t in range(16)]
    assert table.record_step_writes([1], base[::2], [0, 16]).clean
    table.verify_read(1, [p], 16)


def test_step_ids_read_again_when_they_change(table):
    """The ids of the last step are remembered by object; a str re-interned after its request
    ended, an item replaced in place, a shorter or longer list, numpy ints and tuples all read
    as they are now."""
    a, b = two_requests(table)
    ids = ["a", "b"]
    bt = block_table([a, b])
    lens = [40, 20]
    assert table.verify_step(ids, bt, lens).clean
    assert table.verify_step(ids, bt, lens).clean  # the same objects: remembered
    # "a" ends and a new request of the same name starts: a fresh interned id.
    table.release("a")
    v = table.verify_step(ids, bt, lens)
    assert v.refused_rows == [0] and v.violations[0].kind == "unknown_request"
    a2 = admitted(table, "a", "acme", 16)
    assert table.verify_step(ids, block_table([a2, b]), [16, 20]).clean
    # Replaced in place, by an int request.
    c = admitted(table, 7, 3, 16)
    ids[0] = 7
    assert table.verify_step(ids, block_table([c, b]), [16, 20]).clean
    ids[0] = 2**40 + 7  # a big int, never admitted
    assert table.verify_step(ids, block_table([c, b]), [16, 20]).refused_rows == [0]
    # numpy ints, a tuple, a shorter and a longer list.
    assert table.verify_step([np.int64(7), "b"], block_table([c, b]), [16, 20]).clean
    assert table.verify_step((7, "b"), block_table([c, b]), [16, 20]).clean
    assert table.verify_step([7], block_table([c]), [16]).clean
    assert table.verify_step([7, "b", "a"], block_table([c, b, a2]), [16, 20, 16]).clean
    with pytest.raises(ValueError, match="non-negative"):
        table.verify_step([7, -1], block_table([c, b]), [16, 20])
    with pytest.raises(TypeError, match="int or a str"):
        table.verify_step([7, True], block_table([c, b]), [16, 20])
    # A str subclass takes the slow path and reads as its value.
    class Rid(str):
        pass
    assert table.verify_step([7, Rid("b")], block_table([c, b]), [16, 20]).clean


def test_step_ids_stay_right_while_other_requests_come_and_go():
    """Ids remembered by object outlive other requests' admissions and releases, and are read
    again exactly when their own name changes: a request released (and its name admitted again)
    at one position while the others stay, a name unknown at first admitted later, and more
    releases between two steps than the names keep a log of."""
    table = kvguard.OwnershipTable(kvguard.PoolConfig(2048, PAGE, 2048, reserved=[0]))
    names = [f"req-{i}" for i in range(6)]
    pages = {n: admitted(table, n, "acme", 16) for n in names[:5]}
    ids = list(names)  # the same str objects step after step, as vLLM's input_batch.req_ids
    lens = [16] * 6

    def step(rows):
        return table.verify_step(ids, block_table(rows), lens).refused_rows

    rows = [pages[n] for n in names[:5]] + [[0]]
    assert step(rows) == [5]  # req-5 was never admitted: unknown
    for k in range(3):  # others come and go between steps
        admitted(table, f"other-{k}", "acme", 16)
        table.release(f"other-{k}")
        assert step(rows) == [5]
    # req-5 admitted now: its name reads as its new id.
    pages["req-5"] = admitted(table, "req-5", "acme", 16)
    rows[5] = pages["req-5"]
    assert step(rows) == []
    # req-2 ends: its row is refused; admitted again under the same name, it reads anew.
    table.release("req-2")
    assert step(rows) == [2]
    rows[2] = admitted(table, "req-2", "acme", 16)
    assert step(rows) == []
    # req-4 ends amid more releases than the names log: everything is read again.
    for k in range(5000):
        table.admit(f"brief-{k}", "acme", 16, 0)
        table.release(f"brief-{k}")
    table.release("req-4")
    assert step(rows) == [4]
    rows[4] = admitted(table, "req-4", "acme", 16)
    assert step(rows) == []


def test_a_reversed_token_range_says_so(table):
    assert "token_range_reversed" in kvguard.VIOLATION_KINDS
    table.admit("r", "acme", 32, 0)
    refs = table.allocate("r", 2)
    with pytest.raises(kvguard.ViolationError) as e:
        table.record_write_tokens("r", [r.page for r in refs], 20, 10)
    assert e.value.kind == "token_range_reversed" and e.value.violation.amounts == (20, 10)
    assert "tokens 20..10 (start after end)" in str(e.value)
    with pytest.raises(kvguard.ViolationError, match="token_range_reversed"):
        table.record_write_tokens_refs("r", refs, 20, 10)
