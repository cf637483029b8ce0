"""The paged store under a driver that mimics the scheduler: requests join and leave between steps."""
import math
import random

import pytest
import torch

from oscar_hf.models import tiny_config
from oscar_hf.serving import OscarPagedStore, PoolExhausted


class FakeAttention(torch.nn.Module):
    """What the base attention function reads from an attention module."""

    num_key_value_groups = 2
    is_causal = True
    training = False


REQUESTS = 1000  # each joins with a prompt of 1-29 tokens, decodes 0-7 tokens and leaves; up to 6 live


def make_store(num_pages=64, page_size=4, **kw):
    cfg = tiny_config("llama", num_hidden_layers=2)
    return cfg, OscarPagedStore(cfg, method="hadamard", sink=4, recent=8, group_size=32, num_pages=num_pages,
                                page_size=page_size, **kw)


def expected_pages(store, t):
    """Pages a request of ``t`` tokens holds: its history entries [S0, t - W) once t - W > S0."""
    s0, w = store.config.sink, store.config.recent
    n_hist = t - w - s0 if t - w > s0 else 0
    return math.ceil(n_hist / store.pool.page_size)


def test_requests_join_and_leave():
    cfg, store = make_store()
    module = FakeAttention()
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pool_ptrs = [t.data_ptr() for t in (store.pool.codes, store.pool.scale, store.pool.zero)]
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    live: dict[str, int] = {}  # request -> tokens left to decode
    started = 0
    while started < REQUESTS or live:
        batch = [(rid, store.length(rid), 1) for rid in live]  # decodes
        while started < REQUESTS and len(live) < 6 and rng.random() < 0.7:  # joins between steps, with their prompt
            rid = f"r{started}"
            started += 1
            live[rid] = rng.randrange(0, 8)
            batch.append((rid, 0, rng.randrange(1, 30)))
        for layer in range(cfg.num_hidden_layers):
            for rid, past, l in batch:
                q = torch.randn(1, hq, l, d, generator=gen)
                k, v = torch.randn(1, hk, l, d, generator=gen), torch.randn(1, hk, l, d, generator=gen)
                out = store.attend(rid, layer, past, q, k, v, d**-0.5, module, "sdpa")
                assert out.shape == (1, l, hq, d) and torch.isfinite(out).all()
        for rid in [r for r, left in live.items() if left == 0]:  # leaves between steps
            del live[rid]
            store.free(rid)
        for rid in live:
            live[rid] -= 1
        assert store.pool.num_used == sum(expected_pages(store, store.length(r)) for r in live)
    assert store.pool.num_used == 0 and store.pool.num_free == store.pool.num_pages and not store.requests
    assert store.pool.peak_used > 6  # the history did go to pages
    assert pool_ptrs == [t.data_ptr() for t in (store.pool.codes, store.pool.scale, store.pool.zero)]  # flat


def test_pool_exhaustion_and_bad_inputs():
    cfg, store = make_store(num_pages=2, page_size=4)
    module = FakeAttention()
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k = torch.randn(1, hq, 30, d), torch.randn(1, hk, 30, d)
    with pytest.raises(PoolExhausted):  # 30 tokens: 18 history entries need 5 pages of 4
        store.attend("a", 0, 0, q, k, k, 0.1, module, "sdpa")
    with pytest.raises(NotImplementedError):  # a request that did not start at position 0 (prefix sharing)
        store.attend("b", 0, 5, q[:, :, :1], k[:, :, :1], k[:, :, :1], 0.1, module, "sdpa")
    with pytest.raises(ValueError):
        OscarPagedStore(cfg, method="hadamard", group_size=32)  # no pool size
    with pytest.raises(ValueError):
        OscarPagedStore(cfg, method="hadamard", group_size=32, num_pages=4, memory_budget=1 << 20)
    with pytest.raises(NotImplementedError):
        OscarPagedStore(cfg, method="hadamard", group_size=32, num_pages=4, key_offset="prefill")


def test_memory_budget_sizes_the_pool():
    cfg, store = make_store(num_pages=1)
    per_page = store.pool.bytes_per_page
    _, sized = make_store(num_pages=None, memory_budget=10 * per_page + per_page // 2)
    assert sized.pool.num_pages == 10
