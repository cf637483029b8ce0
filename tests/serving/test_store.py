"""The paged store under a driver that mimics the scheduler: requests join and leave between steps."""
import math
import random

import pytest
import torch

from oscar_hf.serving import OscarPagedStore, PoolExhausted
from oscar_hf.serving.store import DEFAULT_CHUNK_TOKENS

from tiny_models import tiny_config


class FakeAttention(torch.nn.Module):
    """What the base attention function reads from an attention module."""

    num_key_value_groups = 2
    is_causal = True
    training = False


REQUESTS = 1000  # each joins with a prompt of 1-29 tokens, decodes 0-7 tokens and leaves; up to 6 live
# retrieval heads (tiny Llama: 2 layers, 2 KV heads): one per layer at INT8; every head of layer 0 at INT4 (no INT2
# head left there) and one of layer 1
HEADS = [dict(retrieval_heads=((0, 1), (1, 0)), retrieval_bits=8),
         dict(retrieval_heads=((0, 0), (0, 1), (1, 1)), retrieval_bits=4)]
# 3-bit keys at group 16 and the values at 32 (their high bits' plane and the values' metadata: pool tensors of their
# own), with a retrieval head beside them
KEY_BITS = dict(group_size=16, key_bits=3, value_group_size=32, retrieval_heads=((1, 0),), retrieval_bits=8)


def make_store(num_pages=64, page_size=4, **kw):
    cfg = tiny_config("llama", num_hidden_layers=2)
    kw = {"group_size": 32, **kw}
    return cfg, OscarPagedStore(cfg, method="hadamard", sink=4, recent=8, num_pages=num_pages, page_size=page_size,
                                **kw)


def expected_pages(store, t):
    """Pages a request of ``t`` tokens holds: its history entries [S0, t - W) once t - W > S0."""
    s0, w = store.config.sink, store.config.recent
    n_hist = t - w - s0 if t - w > s0 else 0
    return math.ceil(n_hist / store.pool.page_size)


@pytest.mark.parametrize("kw,requests", [({}, REQUESTS), (HEADS[0], 200)])
def test_requests_join_and_leave(kw, requests):
    cfg, store = make_store(**kw)
    module = FakeAttention()
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pool_ptrs = [t.data_ptr() for t in (*store.pool.int2, *store.pool.coded)]
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    live: dict[str, int] = {}  # request -> tokens left to decode
    started = 0
    while started < requests or live:
        batch = [(rid, store.length(rid), 1) for rid in live]  # decodes
        while started < requests and len(live) < 6 and rng.random() < 0.7:  # joins between steps, with their prompt
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
    assert pool_ptrs == [t.data_ptr() for t in (*store.pool.int2, *store.pool.coded)]  # flat


@pytest.mark.parametrize("kw", [{}, *HEADS, KEY_BITS])
def test_packed_batch_equals_requests_one_by_one(kw):
    """A forward that packs several requests (decodes batched, prompts one by one) gives each request what it gets
    alone, and stores the same state (with retrieval heads: the decode rows' coded histories, of different lengths,
    are read padded to the longest)."""
    module = FakeAttention()
    stores = [make_store(**kw)[1] for _ in range(2)]
    cfg = make_store()[0]
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(1)
    lengths = {"a": 0, "b": 0, "c": 0}
    steps = [[("a", 30), ("b", 3)], [("a", 1), ("b", 1), ("c", 17)], [("a", 1), ("b", 9), ("c", 1)]]
    steps += [[("a", 1), ("b", 1), ("c", 1)]] * 12  # a crosses page boundaries; b and c leave the sink-only phase
    for step in steps:
        batch = [(rid, lengths[rid], l) for rid, l in step]
        total = sum(l for _, l in step)
        # a forward runs its batch through every layer before the next batch starts (the store's contract)
        qkv = [(torch.randn(1, hq, total, d, generator=gen), torch.randn(1, hk, total, d, generator=gen),
                torch.randn(1, hk, total, d, generator=gen)) for _ in range(cfg.num_hidden_layers)]
        packed = [stores[0].attend(layer, q, k, v, batch, d**-0.5, module, "sdpa") for layer, (q, k, v) in
                  enumerate(qkv)]
        start = 0
        for rid, past, l in batch:
            sl = slice(start, start + l)
            for layer, (q, k, v) in enumerate(qkv):
                alone = stores[1].attend(layer, q[:, :, sl], k[:, :, sl], v[:, :, sl], [(rid, past, l)], d**-0.5,
                                         module, "sdpa")
                torch.testing.assert_close(packed[layer][:, sl], alone, rtol=1e-5, atol=1e-6)
            start += l
        for rid, l in step:
            lengths[rid] += l
    a, b = stores
    for rid in lengths:
        ra, rb = a.requests[rid], b.requests[rid]
        assert ra.lengths == rb.lengths and ra.table and len(ra.table) == len(rb.table)
        for pa, pb in zip(ra.table, rb.table):
            for ta, tb in zip(a.pool.tensors, b.pool.tensors, strict=True):
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
    with pytest.raises(RuntimeError, match="new tokens"):  # the batch holds more tokens than the packed rows
        store.attend(0, q, k, k, [("c", 0, 31)], 0.1, module, "sdpa")
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


def test_retrieval_heads_of_an_artifact_are_kept_and_paid_for():
    """The artifact's retrieval heads (the cache's default, retrieval_heads="auto") are kept, as OscarCache keeps
    them; each layer's pages hold its other heads in INT2 and these as coded rows, and a page's bytes count both."""
    from oscar_hf import OscarRotations

    cfg = tiny_config("llama", num_hidden_layers=2)
    rot = OscarRotations.builtin(cfg, "hadamard")
    rot.retrieval_scores = torch.tensor([[0.1, 0.9], [0.6, 0.2]])
    kw = dict(sink=4, recent=8, group_size=32, num_pages=8, page_size=4, max_history_bits=6.0)  # room for both (INT8)
    store = OscarPagedStore(cfg, rot, **kw)
    assert store.config.retrieval_heads == ((0, 1), (1, 0))
    assert {i: (p.int2_heads, p.coded_heads) for i, p in store.params.items()} == {0: ((0,), (1,)), 1: ((1,), (0,))}
    assert store.pool.int2_heads == (1, 1) and store.pool.coded_heads == (1, 1)
    # per layer, K and V, 4 entries: one INT2 row (D/4 = 8 code bytes + scale and zero of D/G = 1, BF16) and one INT8
    # row (D = 32 code bytes + scale and zero in the store's float32)
    int2_row, coded_row = 8 + 2 * 1 * 2, 32 + 2 * 4
    assert store.page_bytes(4) == store.pool.bytes_per_page == 2 * 2 * 4 * (int2_row + coded_row)
    assert store.pool.coded_bytes_per_page == 2 * 2 * 4 * coded_row
    # nothing allocated for INT2 rows nobody reads (8 pages and the pool's trash page)
    assert store.pool.nbytes == (8 + 1) * store.pool.bytes_per_page
    plain = OscarPagedStore(cfg, rot, **{**kw, "retrieval_heads": 0})
    assert all(not p.coded_heads for p in plain.params.values()) and list(plain.params) == [0, 1] and plain.page_bytes(4) == 2 * 2 * 4 * 2 * int2_row
    budget = reserved(store) + 11 * store.page_bytes(4)  # the budget pays for the heads' bytes (and a trash page)
    assert OscarPagedStore(cfg, rot, **{**kw, "num_pages": None, "memory_budget": budget}).pool.num_pages == 10
    # explicit heads; a layer whose every head is a 16-bit head is exact: Transformers' paged cache keeps it
    exact = OscarPagedStore(cfg, rot, **{**kw, "retrieval_heads": ((0, 0), (0, 1), (1, 1)),
                                         "retrieval_bits": 16})
    assert not exact.handles(0) and exact.handles(1) and exact.pool.coded_heads == (1,)
    with pytest.raises(ValueError, match="not a \\(layer, kv_head\\)"):
        OscarPagedStore(cfg, rot, **{**kw, "retrieval_heads": ((0, 2),)})  # head 2 of 2
    with pytest.raises(ValueError, match="no layer OSCAR quantizes"):
        OscarPagedStore(cfg, rot, **{**kw, "retrieval_heads": tuple((i, h) for i in (0, 1) for h in (0, 1)),
                                     "retrieval_bits": 16})


def reserved(store) -> int:
    """What a standalone store's memory_budget pays before pages: the windows of max_requests requests and the prompt
    transient for chunks of at most DEFAULT_CHUNK_TOKENS rows."""
    return store.reserved_bytes(min(DEFAULT_CHUNK_TOKENS, store.prompt_budget))


def test_memory_budget_sizes_the_pool():
    cfg, store = make_store(num_pages=1)
    per_page = store.pool.bytes_per_page
    first = reserved(store)  # the window slots (at max_requests) and the prompt budget are paid first
    assert first == store.windows.reserved_bytes + store.prompt_transient_bytes(DEFAULT_CHUNK_TOKENS)
    # 10 pages and the pool's trash page (where rows that demote nothing write)
    _, sized = make_store(num_pages=None, memory_budget=first + 11 * per_page + per_page // 2)
    assert sized.pool.num_pages == 10
    with pytest.raises(ValueError, match="windows .* prompt budget"):
        make_store(num_pages=None, memory_budget=first)


@pytest.mark.parametrize("kw", [{}, *HEADS, KEY_BITS])
def test_prompt_in_chunks_stores_what_one_piece_stores(kw):
    """A prompt that arrives in chunks (Transformers' scheduler splits one across steps) leaves the same pages (INT2
    and the retrieval heads' coded rows) and window as the prompt in one piece, and its later chunks attend exactly to
    the earlier ones, as the prompt in one piece does (they are held in full precision until the request decodes)."""
    module = FakeAttention()
    cfg = make_store()[0]
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(2)
    t = 41
    q, k, v = torch.randn(1, hq, t, d, generator=gen), torch.randn(1, hk, t, d, generator=gen), \
        torch.randn(1, hk, t, d, generator=gen)
    whole, chunked = make_store(**kw)[1], make_store(**kw)[1]
    exact = whole.attend(0, q, k, v, [("a", 0, t)], d**-0.5, module, "sdpa")  # a new request: exact attention
    outs = []
    for a, b in ((0, 3), (3, 26), (26, 41)):  # the second chunk ends past the sink + window, the third reads history
        sl = slice(a, b)
        outs.append(chunked.attend(0, q[:, :, sl], k[:, :, sl], v[:, :, sl], [("a", a, b - a)], d**-0.5, module,
                                   "sdpa"))
    ra, rb = whole.requests["a"], chunked.requests["a"]
    assert ra.lengths == rb.lengths == {0: t} and len(ra.table) == len(rb.table) > 0
    parts = lambda st: (*st.pool.rows(0, "k"), *st.pool.rows(0, "v"), *st.pool.coded_rows(0, "k"),  # noqa: E731
                        *st.pool.coded_rows(0, "v"))
    for pa, pb in zip(ra.table, rb.table):
        for ta, tb in zip(parts(whole), parts(chunked)):
            assert torch.equal(ta[pa], tb[pb])
    assert torch.equal(whole.windows.k[ra.slot, 0], chunked.windows.k[rb.slot, 0])
    torch.testing.assert_close(torch.cat(outs, 1), exact, rtol=1e-4, atol=1e-5)
    assert chunked.stats()["prompt_bytes"] == 2 * hk * t * d * 4 and whole.stats()["prompt_bytes"] > 0
    step = [("a", t, 1)]  # the first decode step: the prompt is complete, its full-precision chunks go
    for st in (whole, chunked):
        st.attend(0, q[:, :, :1], k[:, :, :1], v[:, :, :1], step, d**-0.5, module, "sdpa")
        assert st.stats()["prompt_bytes"] == 0


def test_store_starts_from_the_settings_the_artifact_chose():
    """A calibrated artifact's chosen settings (metadata["settings"]["chosen"]) configure the serving store as they do
    OscarCache; keywords given win field by field; an artifact without them gets OscarConfig's defaults."""
    from oscar_hf import OscarConfig, OscarRotations

    cfg = tiny_config("llama", num_hidden_layers=2)
    rot = OscarRotations.builtin(cfg, "hadamard")
    plain = OscarPagedStore(cfg, rot, num_pages=8, page_size=4, group_size=32)
    assert (plain.config.sink, plain.config.recent, plain.config.quantizer) == (64, 256, OscarConfig().quantizer)
    rot.metadata["settings"] = {"chosen": dict(sink=8, recent=16, group_size=16, quantizer="std")}
    store = OscarPagedStore(cfg, rot, num_pages=8, page_size=4)
    assert (store.config.sink, store.config.recent, store.config.group_size, store.config.quantizer) == (8, 16, 16, "std")
    mine = OscarPagedStore(cfg, rot, num_pages=8, page_size=4, recent=32)
    assert (mine.config.sink, mine.config.recent) == (8, 32)
