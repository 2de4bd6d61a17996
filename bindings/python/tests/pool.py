"""What the binding's tests share: a small pool and helpers that admit and fill requests.

Imported by name (`from pool import ...`), not from conftest: the engine tests' folders have
conftest modules of their own, and two modules named `conftest` cannot both be imported."""

import numpy as np

import kvguard

PAGE = 16


def small_config():
    return kvguard.PoolConfig(256, PAGE, 2048, reserved=[0])


def admitted(table, req, tenant, tokens, pages=None):
    """Admits `req`, gives it pages for `tokens` and writes them; returns its page ids."""
    table.admit(req, tenant, tokens, 16)
    n = -(-tokens // PAGE)
    if pages is None:
        pages = [r.page for r in table.allocate(req, n)]
    else:
        table.claim(req, pages)
    table.record_write_tokens(req, pages, 0, tokens)
    return pages


def block_table(rows, dtype=np.int32, width=8):
    bt = np.zeros((len(rows), width), dtype=dtype)
    for i, pages in enumerate(rows):
        bt[i, : len(pages)] = pages
    return bt
