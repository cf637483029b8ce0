"""Memory of the paged OSCAR cache inside Transformers' continuous batching: no BF16 K/V for the layers OSCAR
quantizes, and the scheduler's admission counts OSCAR's bytes per token (tiny Llama: 2 layers, 2 KV heads of 32,
BF16 cache, G=32 with BF16 metadata: 12 bytes per K or V row against 64)."""
import pytest
import torch
from transformers import ContinuousBatchingConfig

pytest.importorskip("transformers.generation.continuous_batching.cache_allocators",
                    reason="Transformers 5.20+ sector allocators (5.17 - 5.19: tests in test_generate_batch.py)")
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching.cache import PagedAttentionCache, PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState

from oscar_hf.serving import OscarPagedCache, OscarPagedStore

from tiny_models import tiny_config

OSCAR = dict(method="hadamard", sink=4, recent=8, group_size=32, prompt_budget=512)
DTYPE = torch.bfloat16
PAGE = 16


def build(kind, cb_cfg, config):
    helper = DistributedHelper(None, None)
    if kind == "bf16":
        return PagedAttentionCache(config, cb_cfg, "cpu", helper, dtype=DTYPE)
    store = OscarPagedStore(config, dtype=DTYPE, defer_pool=True, **OSCAR)
    return OscarPagedCache(config, cb_cfg, "cpu", helper, dtype=DTYPE, store=store)


def tensor_bytes(cache) -> int:
    """Bytes of the distinct tensor storages the cache object and its allocators (and the OSCAR store's pool, views
    into the cache tensor) hold."""
    objs = [cache, *cache.cache_allocators.values()]
    if isinstance(cache, OscarPagedCache):
        objs.append(cache.store.pool)
    seen = {}
    for obj in objs:
        for value in vars(obj).values():
            for t in value.values() if isinstance(value, dict) else [value]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def admitted(cache, prompt_len: int) -> int:
    """Requests of ``prompt_len`` tokens the scheduler's check admits one after the other (all kept alive)."""
    n = 0
    while cache.can_store_request_tokens(RequestState(request_id=f"r{n}", initial_tokens=[1] * prompt_len,
                                                      max_new_tokens=1), prompt_len):
        n += 1
    return n


@pytest.fixture(autouse=True)
def memory_budget(monkeypatch):
    """The memory Transformers' handler sees (what is free x max_memory_percent on a device): 64 MiB unless set."""
    budget = {"bytes": 64 << 20}
    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: budget["bytes"])
    return budget


@pytest.fixture(scope="module")
def config():
    return tiny_config("llama", num_hidden_layers=2)


def test_same_blocks_allocate_a_fraction_of_bf16(config):
    cb_cfg = ContinuousBatchingConfig(num_blocks=512, max_batch_tokens=64, page_size=PAGE)
    bf16, oscar = build("bf16", cb_cfg, config), build("oscar", cb_cfg, config)
    b_bytes, o_bytes = tensor_bytes(bf16), tensor_bytes(oscar)
    print(f"\n512 blocks of {PAGE} tokens: BF16 paged cache {b_bytes} B, OSCAR {o_bytes} B ({b_bytes / o_bytes:.2f}x)")
    # a BF16 block: 2 layers x K,V x 2 heads x 16 tokens x 32 x 2 B = 8 KiB; an INT2 block
    # 2 x 2 x 2 x 16 x 12 = 1.5 KiB
    assert bf16.num_blocks >= 512 and oscar.num_blocks >= 512
    assert oscar.cache_allocators["full_attention"].bytes_per_block == 1536
    assert o_bytes * 5 < b_bytes  # 64 / 12 = 5.3x, less the trash sectors
    # the OSCAR pool is laid out in Transformers' cache tensor: no memory of its own
    assert oscar.store.pool.codes.untyped_storage().data_ptr() == oscar.cache_tensor.untyped_storage().data_ptr()
    assert oscar.store.pool.num_pages == oscar.cache_allocators["full_attention"].num_blocks
    # everything Transformers swapped for the construction is back
    assert cache_module.FullAttentionCacheAllocator is FullAttentionCacheAllocator
    assert cache_module.ATTN_TYPE_TO_ALLOCATOR["full_attention"] is FullAttentionCacheAllocator
    assert cache_module.PagedAttentionMemoryHandler is PagedAttentionMemoryHandler


@pytest.mark.parametrize("prompt_len,max_requests", [(64, 128), (512, 32)])
def test_same_budget_admits_more_requests(config, memory_budget, prompt_len, max_requests):
    budget = 4 << 20
    cb_cfg = ContinuousBatchingConfig(max_batch_tokens=64, page_size=PAGE)
    memory_budget["bytes"] = budget
    bf16 = build("bf16", cb_cfg, config)
    store = OscarPagedStore(config, dtype=DTYPE, defer_pool=True, max_requests=max_requests, **OSCAR)
    # the handler reserves the store's window slots (allocated as requests come) and prompt budget in the budget
    oscar = OscarPagedCache(config, cb_cfg, "cpu", DistributedHelper(None, None), dtype=DTYPE, store=store)
    n_bf16, n_oscar = admitted(bf16, prompt_len), admitted(oscar, prompt_len)
    assert 0 < store.windows.nbytes <= store.windows.reserved_bytes
    total_oscar = tensor_bytes(oscar) + store.reserved_bytes(64)
    print(f"\n{budget >> 20} MiB, {prompt_len}-token requests: BF16 {bf16.num_blocks} blocks, {n_bf16} requests; "
          f"OSCAR {oscar.num_blocks} pages + {max_requests} windows, {n_oscar} requests ({n_oscar / n_bf16:.2f}x); "
          f"bytes {tensor_bytes(bf16)} / {total_oscar}")
    assert total_oscar <= budget and tensor_bytes(bf16) <= budget
    # per request: BF16 ceil(T / 16) blocks of 8 KiB; OSCAR its history pages of 1.5 KiB, and one window slot
    pages = store.history_pages(prompt_len, PAGE)
    assert n_oscar == min(max_requests, store.pool.num_pages // pages)  # whichever runs out first
    assert n_oscar * pages <= store.pool.num_pages and n_oscar <= max_requests
    assert n_oscar > (3 if prompt_len == 512 else 1.5) * n_bf16
    assert len(store.requests) == n_oscar  # each admitted request holds a window slot


def test_layers_oscar_leaves_keep_bf16_and_need_a_pool_size(config):
    cb_cfg = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, page_size=PAGE)
    helper = DistributedHelper(None, None)
    store = OscarPagedStore(config, dtype=DTYPE, defer_pool=True, skip_layers=(0,), **OSCAR)
    with pytest.raises(ValueError, match="num_pages"):
        OscarPagedCache(config, cb_cfg, "cpu", helper, dtype=DTYPE, store=store)
    store = OscarPagedStore(config, dtype=DTYPE, num_pages=8, page_size=PAGE, skip_layers=(0,), **OSCAR)
    cache = OscarPagedCache(config, cb_cfg, "cpu", helper, dtype=DTYPE, store=store)
    assert not cache.oscar_owns_memory and type(cache.cache_allocators["full_attention"]) is FullAttentionCacheAllocator
    sized = OscarPagedStore(config, dtype=DTYPE, num_pages=8, page_size=PAGE, **OSCAR)
    with pytest.raises(ValueError, match="num_blocks"):  # every layer is OSCAR's: the pool is sized by Transformers
        OscarPagedCache(config, cb_cfg, "cpu", helper, dtype=DTYPE, store=sized)


def test_retrieval_heads_are_counted_in_blocks(config, memory_budget):
    """A retrieval head costs its coded rows (INT8: 32 code bytes + a BF16 scale and zero per K or V row) in every
    block instead of an INT2 row: Transformers' blocks, its budget and its admission count them, and the pool, coded
    rows included, is laid out in the cache tensor."""
    helper = DistributedHelper(None, None)
    heads = dict(retrieval_heads=((0, 1),), retrieval_bits=8)

    def cache(cb_cfg, **kw):
        store = OscarPagedStore(config, dtype=DTYPE, defer_pool=True, **OSCAR, **kw)
        return OscarPagedCache(config, cb_cfg, "cpu", helper, dtype=DTYPE, store=store)

    oscar = cache(ContinuousBatchingConfig(num_blocks=512, max_batch_tokens=64, page_size=PAGE), **heads)
    store, allocator = oscar.store, oscar.cache_allocators["full_attention"]
    # a block: 3 INT2 rows of 12 bytes and 1 INT8 row of 36, K and V, 16 tokens (an all-INT2 block: 1536)
    assert store.page_bytes(PAGE) == 2 * PAGE * (3 * 12 + 36) == allocator.bytes_per_block == 2304
    assert store.pool.num_pages == allocator.num_blocks >= 512
    assert store.pool.coded_heads == (1, 0) and store.pool.nbytes == (store.pool.num_pages + 1) * 2304  # + trash page
    for t in (*store.pool.int2, *store.pool.coded):  # views of Transformers' cache tensor
        assert t.untyped_storage().data_ptr() == oscar.cache_tensor.untyped_storage().data_ptr()
    # the same budget pays for fewer blocks, each request holding as many
    memory_budget["bytes"] = 3 << 20
    budget_cfg = ContinuousBatchingConfig(max_batch_tokens=64, page_size=PAGE)
    slots = dict(max_requests=256)  # pages, not window slots, limit admission (1.7 MB of the budget reserved)
    with_heads, plain = cache(budget_cfg, **heads, **slots), cache(budget_cfg, retrieval_heads=0, **slots)
    pages = with_heads.store.history_pages(64, PAGE)
    assert pages == plain.store.history_pages(64, PAGE) == 4
    assert with_heads.store.pool.num_pages * 2304 <= plain.store.pool.num_pages * 1536 + 2304
    assert admitted(with_heads, 64) == with_heads.store.pool.num_pages // pages < admitted(plain, 64)
