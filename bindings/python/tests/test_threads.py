"""The table shared by a scheduler thread and transfer threads, the GIL released in the calls."""

import threading

import numpy as np

import kvguard


def test_threads_share_one_table():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(4096, 16, 1024, reserved=[0]))
    errors = []

    def worker(w):
        try:
            for i in range(300):
                rid = f"w{w}-{i}"
                t.admit(rid, f"tenant-{w}", 64, 0)
                pages = [r.page for r in t.allocate(rid, 4)]
                slots = np.array([pages[k // 16] * 16 + k % 16 for k in range(64)], dtype=np.int64)
                assert t.record_step_writes([rid], slots, [0, 64]).clean
                bt = np.array([pages], dtype=np.int32)
                assert t.verify_step([rid], bt, [64]).clean
                t.release(rid)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    s = t.snapshot()
    assert (s.owned, s.requests, s.violations) == (0, 0, 0) and t.interned() == (0, 0)


def test_reads_run_while_another_thread_holds_the_gil():
    t = kvguard.OwnershipTable(kvguard.PoolConfig(65_537, 16, 4096, reserved=[0]))
    reqs = []
    for s in range(256):
        t.admit(s, s % 8, 4096, 0)
        reqs.append([r.page for r in t.allocate(s, 256)])
        t.record_write_tokens(s, reqs[-1], 0, 4096)
    bt = np.array(reqs, dtype=np.int32)
    lens = np.full(256, 4096, dtype=np.int32)
    ids = list(range(256))
    done = []

    def reader():
        for _ in range(50):
            done.append(t.verify_step(ids, bt, lens).clean)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert done == [True] * 200
