"""Random operation sequences through Python agree with the same sequences through Rust: each
sequence runs on a Python table (shadow mode, policy report) while a Recorder writes its trace;
the trace is then replayed by the Rust `kvguard replay --json` command line and by
kvguard.Replayer. The table and the replays judge the same lines the same way up to and including
the first violation; after it they may differ by design: the table refused the violating
mutation, while replay follows the engine and assumes it happened (docs/trace-format.md). The two
replays (Python, and the Rust command line) agree on every line of the whole trace."""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

import kvguard

PAGES, PS = 24, 4


def bin_path():
    env = os.environ.get("KVGUARD_BIN")
    if env and Path(env).exists():
        return env
    root = Path(__file__).resolve().parents[3]
    for p in (root / "target/release/kvguard", root / "target/debug/kvguard"):
        if p.exists():
            return str(p)
    return None


def run_sequence(seed, n_ops=250, hostile=0.01):
    """One random sequence: mostly operations an engine would make (admit, claim free pages,
    write and read its own pages, publish, attach, detach, preempt, fork, free), each hostile
    with probability `hostile` (a foreign page, a freed page, an unknown request), recorded and
    run on a Python table at once. Returns the trace and the (line, kind) the table judged."""
    rnd = random.Random(seed)
    config = kvguard.PoolConfig(PAGES, PS, 64, reserved=[0], policy="report")
    table = kvguard.OwnershipTable(config)
    rec = kvguard.Recorder()
    rec.pool(config)
    judged = []  # (line, kind) the Python table judged
    line = 1
    next_req = 1
    live = {}  # req -> tenant
    published = set()

    def free_pages(n):
        used = {p.page for r in live for p in (table.request_info(r).owned_pages if table.request_info(r) else [])}
        shared = {p for p in range(1, PAGES) if table.page_info(p).state == "shared"}
        free = [p for p in range(1, PAGES) if p not in used and p not in shared and table.page_info(p).state == "free"]
        rnd.shuffle(free)
        return free[:n]

    for _ in range(n_ops):
        bad = rnd.random() < hostile
        op = rnd.choice(["admit", "alloc", "alloc", "write", "write", "read", "read", "read", "free",
                         "free_pages", "fork", "share", "attach", "detach", "preempt", "evict"])
        r = rnd.choice(sorted(live)) if live and not (bad and rnd.random() < 0.3) else rnd.randrange(1000, 1010)
        info = table.request_info(r) if r in live else None
        own = [p.page for p in info.owned_pages] if info else []
        before = table.snapshot().violations
        try:
            if op == "admit" or not live:
                r, next_req = next_req, next_req + 1
                tenant = rnd.choice(["acme", "globex"])
                prompt, max_new = rnd.randrange(1, 24), rnd.randrange(0, 24)
                if bad:
                    prompt = 70  # over the max context
                rec.admit(r, tenant, prompt, max_new)
                table.admit(r, tenant, prompt, max_new)
                live[r] = tenant
            elif op == "alloc":
                pages = free_pages(rnd.randrange(1, 3))
                if bad or not pages:
                    pages = [rnd.randrange(0, PAGES + 2)]
                rec.alloc(r, pages)
                table.claim(r, pages)
            elif op == "write" and (own or bad):
                page = rnd.choice(own) if own and not bad else rnd.randrange(0, PAGES)
                a, b = (0, PS) if rnd.random() < 0.7 else sorted(rnd.sample(range(PS + 1), 2))
                rec.write(r, page, a, b)
                table.record_write(r, page, a, b)
            elif op == "read" and (own or bad):
                bt = own if own and not bad else [rnd.randrange(0, PAGES) for _ in range(2)]
                full = 0
                while full < len(bt) and table.page_info(bt[full]).written_prefix == PS:
                    full += 1
                tokens = full * PS if not bad else rnd.randrange(0, len(bt) * PS + 2)
                rec.read(r, bt, tokens)
                table.verify_read(r, bt, tokens)
            elif op == "free" and (r in live or bad):
                rec.free(r)
                table.release(r)
                live.pop(r, None)
            elif op == "free_pages" and own:
                rec.free(r, own[:1])
                table.release_pages(r, own[:1])
            elif op == "fork" and (r in live or bad):
                child, next_req = next_req, next_req + 1
                rec.fork(r, child)
                table.fork(r, child)
                live[child] = live.get(r, "acme")
            elif op == "share" and own:
                k = rnd.randrange(0, 4)
                if k in published and not bad:
                    continue
                rec.share(r, f"k{k}", own)
                table.publish_prefix(r, k, own)
                published.add(k)
            elif op == "attach" and published:
                k = rnd.choice(sorted(published))
                rec.attach(r, f"k{k}")
                table.attach_prefix(r, k)
            elif op == "detach" and published:
                k = rnd.choice(sorted(published))
                if k not in (info.prefixes if info else []) and not bad:
                    continue
                rec.detach(r, f"k{k}")
                table.detach_prefix(r, k)
            elif op == "preempt" and (r in live or bad):
                rec.preempt(r)
                table.preempt(r)
            elif op == "evict" and published:
                k = rnd.choice(sorted(published))
                rec.evict(f"k{k}")
                table.evict_prefix(k)
                published.discard(k)
            else:
                continue
        except (kvguard.ViolationError, kvguard.OutOfPagesError):
            pass
        line += 1
        if table.snapshot().violations != before:
            judged.append((line, table.drain_violations()[-1].kind))
    rec.end()
    return rec.text(), judged


def until_first(verdicts, first_line):
    return [v for v in verdicts if v[0] <= first_line]


@pytest.mark.parametrize("seed", range(48))
def test_python_and_rust_agree(seed, tmp_path):
    trace, judged = run_sequence(seed)
    first = judged[0][0] if judged else float("inf")
    judged = until_first(judged, first)
    whole_by_python_replayer = [(v.line, v.kind) for v in kvguard.Replayer().replay(trace)]
    assert until_first(whole_by_python_replayer, first) == judged
    exe = bin_path()
    if exe is None:
        pytest.skip("the kvguard command line is not built (cargo build --release --bin kvguard)")
    path = tmp_path / "trace.jsonl"
    path.write_text(trace)
    out = subprocess.run([exe, "replay", str(path), "--json"], capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    lines = [json.loads(s) for s in out.stdout.splitlines() if s.strip()]
    by_rust = [(d["line"], d["kind"]) for d in lines if "line" in d and "kind" in d]
    assert until_first(by_rust, first) == judged
    assert by_rust == whole_by_python_replayer
