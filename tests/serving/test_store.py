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
        total = sum(l for _, _, l in batch)
        for layer in range(cfg.num_hidden_layers):  # one packed forward: decodes and prompts side by side
            q = torch.randn(1, hq, total, d, generator=gen)
            k, v = torch.randn(1, hk, total, d, generator=gen), torch.randn(1, hk, total, d, generator=gen)
            out = store.attend(layer, q, k, v, batch, d**-0.5, module, "sdpa")
            assert out.shape == (1, total, hq, d) and torch.isfinite(out).all()
        for rid in [r for r, left in live.items() if left == 0]:  # leaves between steps
            del live[rid]
            store.free(rid)
        for rid in live:
            live[rid] -= 1
        # a decode step demotes the slot that left the window one step late (T - 1 - W): one entry less than a prompt
        lo = sum(expected_pages(store, store.length(r) - 1) for r in live)
        assert lo <= store.pool.num_used <= sum(expected_pages(store, store.length(r)) for r in live)
    assert store.pool.num_used == 0 and store.pool.num_free == store.pool.num_pages and not store.requests
    assert store.windows.num_free == store.windows.num_slots
    assert store.pool.peak_used > 6  # the history did go to pages
    assert pool_ptrs == [t.data_ptr() for t in (store.pool.codes, store.pool.scale, store.pool.zero)]  # flat


def test_packed_batch_equals_requests_one_by_one():
    """A forward that packs several requests (decodes batched, prompts one by one) gives each request what it gets
    alone, and stores the same state."""
    module = FakeAttention()
    stores = [make_store()[1] for _ in range(2)]
    cfg = make_store()[0]
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(1)
    lengths = {"a": 0, "b": 0, "c": 0}
    steps = [[("a", 30), ("b", 3)], [("a", 1), ("b", 1), ("c", 17)], [("a", 1), ("b", 9), ("c", 1)]]
    steps += [[("a", 1), ("b", 1), ("c", 1)]] * 12  # a crosses page boundaries; b and c leave the sink-only phase
    for step in steps:
        batch = [(rid, lengths[rid], l) for rid, l in step]
        total = sum(l for _, l in step)
        for layer in range(cfg.num_hidden_layers):
            q = torch.randn(1, hq, total, d, generator=gen)
            k, v = torch.randn(1, hk, total, d, generator=gen), torch.randn(1, hk, total, d, generator=gen)
            packed = stores[0].attend(layer, q, k, v, batch, d**-0.5, module, "sdpa")
            start = 0
            for rid, past, l in batch:
                sl = slice(start, start + l)
                alone = stores[1].attend(layer, q[:, :, sl], k[:, :, sl], v[:, :, sl], [(rid, past, l)], d**-0.5,
                                         module, "sdpa")
                torch.testing.assert_close(packed[:, sl], alone, rtol=1e-5, atol=1e-6)
                start += l
        for rid, l in step:
            lengths[rid] += l
    a, b = stores
    for rid in lengths:
        ra, rb = a.requests[rid], b.requests[rid]
        assert ra.lengths == rb.lengths and ra.table and len(ra.table) == len(rb.table)
        for pa, pb in zip(ra.table, rb.table):
            for ta, tb in zip((a.pool.codes, a.pool.scale, a.pool.zero), (b.pool.codes, b.pool.scale, b.pool.zero)):
                torch.testing.assert_close(ta[pa], tb[pb])
        torch.testing.assert_close(a.windows.k[ra.slot], b.windows.k[rb.slot])


def test_pool_exhaustion_and_bad_inputs():
    cfg, store = make_store(num_pages=2, page_size=4)
    module = FakeAttention()
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k = torch.randn(1, hq, 30, d), torch.randn(1, hk, 30, d)
    with pytest.raises(PoolExhausted):  # 30 tokens: 18 history entries need 5 pages of 4
        store.attend(0, q, k, k, [("a", 0, 30)], 0.1, module, "sdpa")
    with pytest.raises(NotImplementedError):  # a request that did not start at position 0 (prefix sharing)
        store.attend(0, q[:, :, :1], k[:, :, :1], k[:, :, :1], [("b", 5, 1)], 0.1, module, "sdpa")
    with pytest.raises(RuntimeError, match="new tokens"):  # the batch and the packed rows disagree
        store.attend(0, q, k, k, [("c", 0, 29)], 0.1, module, "sdpa")
    _, few = make_store(max_requests=1)
    few.reserve("x")
    with pytest.raises(PoolExhausted, match="window slots"):
        few.reserve("y")
    with pytest.raises(ValueError):
        OscarPagedStore(cfg, method="hadamard", group_size=32)  # no pool size
    with pytest.raises(ValueError):
        OscarPagedStore(cfg, method="hadamard", group_size=32, num_pages=4, memory_budget=1 << 20)
    with pytest.raises(NotImplementedError):
        OscarPagedStore(cfg, method="hadamard", group_size=32, num_pages=4, key_offset="prefill")


def test_memory_budget_sizes_the_pool():
    cfg, store = make_store(num_pages=1)
    per_page = store.pool.bytes_per_page
    windows = store.windows.nbytes  # the window slots are paid first
    _, sized = make_store(num_pages=None, memory_budget=windows + 10 * per_page + per_page // 2)
    assert sized.pool.num_pages == 10
    with pytest.raises(ValueError, match="windows"):
        make_store(num_pages=None, memory_budget=windows)


def test_prompt_chunk_after_history_in_row_chunks(monkeypatch):
    """A prompt chunk arriving after the request already has INT2 history (chunked prefill) is read in chunks of
    query rows when its logits would be large: the same result as in one piece."""
    from oscar_hf.serving import store as store_module

    module = FakeAttention()
    cfg = make_store()[0]
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    outs = []
    for budget in (store_module.LOGITS_BUDGET, 4 * hk * 2 * 40 * 3):  # the second: 3 query rows at a time
        monkeypatch.setattr(store_module, "LOGITS_BUDGET", budget)
        store = make_store()[1]
        gen = torch.Generator().manual_seed(2)
        for past, l in ((0, 30), (30, 1), (31, 9)):  # prompt, one decode step, then a 9-token chunk over history
            q = torch.randn(1, hq, l, d, generator=gen)
            k, v = torch.randn(1, hk, l, d, generator=gen), torch.randn(1, hk, l, d, generator=gen)
            out = store.attend(0, q, k, v, [("a", past, l)], d**-0.5, module, "sdpa")
        assert store.pool.num_used > 0 and torch.isfinite(out).all()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
