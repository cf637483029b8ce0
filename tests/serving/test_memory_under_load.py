"""Memory that holds under load (issue 49, item 4), on Transformers 5.17 - 5.24: the prompt chunks held in full
precision are reserved in the memory budget and admitted within ``prompt_budget``; window slots are allocated as
requests come; a stopped manager's store goes; an OSCAR block leaves other models' managers, in other threads, as
Transformers makes them. Tiny Llama (2 layers, 2 KV heads of 32, 4 query heads), sink 4 / recent 8, G 32."""
import gc
import logging
import random
import threading
import time
import weakref

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.requests import RequestState

from oscar_hf.serving import OscarPagedStore, PoolExhausted, continuous_batching_config, oscar_serving, paged_oscar
from oscar_hf.serving.batching import SECTOR_API

from tiny_models import tiny_config, tiny_model

OSCAR = dict(sink=4, recent=8, group_size=32)


@pytest.fixture(autouse=True)
def sdpa_after(request):
    """A manager built and never started (``processor``) keeps the attention Transformers 5.17 switched the model to
    (``paged|sdpa``; its ``stop`` would restore it): put sdpa back for the next test."""
    yield
    if "model" in request.fixturenames:
        m = request.getfixturevalue("model")
        if m.config._attn_implementation != "sdpa":
            m.set_attn_implementation("sdpa")


def gen_config(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


def processor(model, cb_cfg):
    """The batch processor (OSCAR cache + scheduler) a manager builds for ``model``, without starting its loop."""
    manager = model.init_continuous_batching(generation_config=gen_config(4), continuous_batching_config=cb_cfg)
    return manager, manager._create_batch_processor()


def admit(proc, state, request_len: int) -> bool:
    """The scheduler's admission of ``request_len`` tokens of ``state`` this step (5.20+: the cache's
    ``can_store_request_tokens``; 5.17 - 5.19: the scheduler's block allocation, which OSCAR wraps)."""
    if SECTOR_API:
        return proc.cache.can_store_request_tokens(state, request_len)
    return proc.scheduler._allocate_blocks_if_needed(state, request_len)


def state(rid: str, prompt_len: int) -> RequestState:
    return RequestState(request_id=rid, initial_tokens=[1] * prompt_len, max_new_tokens=4)


# ---------------------------------------------------------------------------------------------- 1. prompt transient
def test_the_memory_budget_reserves_windows_and_prompt_chunks(model, monkeypatch):
    """Sized by max_memory_percent, the INT2 pages leave room for what the store takes beside them at most: the window
    slots of max_requests requests and prompt_budget tokens of prompt chunks in full precision (with one chunk call's
    transient); a larger prompt budget costs pages."""
    budget = 12 << 20
    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: budget)
    pools = {}
    for prompt_budget in (256, 2048):
        cb_cfg = continuous_batching_config(page_size=16, max_batch_tokens=64, max_memory_percent=0.9)
        with paged_oscar(model, max_requests=16, prompt_budget=prompt_budget, **OSCAR) as store:
            _, proc = processor(model, cb_cfg)
            reserved = store.reserved_bytes(64)
            # held chunks: 2 layers x K, V x 2 heads x 32 x 4 bytes (float32 model) a token; one chunk call: keys and
            # values at 4 query heads, and the [64, T] mask
            assert store.prompt_token_bytes() == 2 * 2 * 2 * 32 * 4
            assert store.prompt_transient_bytes(64) == prompt_budget * (1024 + (2 * 4 * 32 + 64) * 4)
            assert reserved == store.windows.reserved_bytes + store.prompt_transient_bytes(64)
            assert store.windows.nbytes == store.windows.reserved_bytes > 0  # allocated when the manager starts
            assert store.pool.nbytes + reserved <= budget
            pools[prompt_budget] = store.pool.nbytes
    assert 0 < pools[2048] < pools[256]  # without the reservation the pages would not depend on the prompt budget
    if SECTOR_API:  # Transformers 5.20+ sizes OSCAR's pages from the whole budget (5.17: from its BF16 blocks' bytes)
        assert pools[2048] > budget // 4


def test_a_budget_that_pays_for_no_page_is_refused_clearly(model, monkeypatch):
    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 4 << 20)
    cb_cfg = continuous_batching_config(page_size=16, max_batch_tokens=64, max_memory_percent=0.9)
    with paged_oscar(model, max_requests=16, prompt_budget=4096, **OSCAR):
        with pytest.raises(ValueError, match="prompt_budget"):
            processor(model, cb_cfg)


def test_split_prompts_are_admitted_within_the_prompt_budget(model):
    """A prompt the scheduler splits reserves its length in prompt_budget when first admitted; another split prompt
    waits while the budget is taken (it would otherwise be held beside it), and is admitted once the first decodes.
    A prompt that arrives whole reserves nothing."""
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=24, page_size=8)
    with paged_oscar(model, prompt_budget=60, **OSCAR) as store:
        _, proc = processor(model, cb_cfg)
        a, b, c = state("a", 45), state("b", 52), state("c", 20)
        assert admit(proc, a, 24) and store.requests["a"].prompt_reserved == 45
        assert not admit(proc, b, 24)  # 45 + 52 > 60: b waits
        assert "b" not in store.requests and store.prompt_reserved == 45
        assert admit(proc, c, 20) and store.requests["c"].prompt_reserved == 0  # whole: nothing held
        store.requests["a"].prompt_reserved = 0  # a decodes (what its first decode row does)
        assert admit(proc, b, 24) and store.prompt_reserved == 52 <= store.prompt_budget


def test_split_prompts_keep_their_tokens_within_the_budget(model):
    """Through generate_batch, prompts split over steps (max_batch_tokens 24) under a prompt budget of 80 tokens: at
    no layer call do the chunks held exceed it, and every request gets the tokens of its prompt in one piece."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (45, 70, 52, 61)]

    def run(tokens, prompt_budget):
        cb_cfg = continuous_batching_config(num_blocks=128, max_batch_tokens=tokens, page_size=8)
        held, reserved = [0], [0]
        with paged_oscar(model, prompt_budget=prompt_budget, **OSCAR) as store:
            attend = store.attend

            def watched(*args):
                out = attend(*args)
                held[0] = max(held[0], store.stats()["prompt_bytes"])
                reserved[0] = max(reserved[0], store.prompt_reserved)
                return out

            store.attend = watched
            out = model.generate_batch(prompts, gen_config(8), continuous_batching_config=cb_cfg, warmup=False)
            limit = store.prompt_budget * store.prompt_token_bytes()
        return [r.generated_tokens for r in out.values()], held[0], reserved[0], limit

    whole, held, _, _ = run(4096, 80)
    assert held == 0
    split, held, reserved, limit = run(24, 80)
    assert 0 < held <= limit and 0 < reserved <= 80
    assert split == whole


def test_a_prompt_longer_than_the_budget_is_not_held(model, caplog):
    """A split prompt longer than the whole prompt_budget gets no reservation: its chunks are not held (its later
    chunks attend to its INT2 history), logged once."""
    prompts = [[(7 * i) % 250 + 1 for i in range(45)]]
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=16, page_size=8)
    held = [0]
    with paged_oscar(model, prompt_budget=30, **OSCAR) as store, caplog.at_level(logging.WARNING, "oscar_hf"):
        attend = store.attend
        store.attend = lambda *a: (attend(*a), held.__setitem__(0, max(held[0], store.stats()["prompt_bytes"])))[0]
        model.generate_batch(prompts, gen_config(4), continuous_batching_config=cb_cfg, warmup=False)
    assert held[0] == 0
    assert sum("prompt_budget is 30" in r.getMessage() for r in caplog.records) == 1


def test_bad_prompt_budget_is_refused():
    cfg = tiny_config("llama", num_hidden_layers=2)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="prompt_budget"):
            OscarPagedStore(cfg, method="hadamard", defer_pool=True, prompt_budget=bad, **OSCAR)


# ------------------------------------------------------------------------------------------------- 2. window slots
def test_window_slots_are_allocated_as_requests_come():
    """No window memory before a request comes; slots double as requests are admitted (never past max_requests),
    keep their contents through a growth, and go back when the last request left."""
    cfg = tiny_config("llama", num_hidden_layers=2)
    store = OscarPagedStore(cfg, method="hadamard", num_pages=8, page_size=4, max_requests=6, **OSCAR)
    windows = store.windows
    assert windows.nbytes == 0 and windows.capacity == 0
    assert windows.reserved_bytes == 6 * windows.slot_bytes == 6 * 2 * 2 * 2 * 13 * 32 * 4
    caps = []
    for i in range(6):
        r = store.reserve(f"r{i}")
        windows.k[r.slot].fill_(i)  # [L, Hk, S0 + R, D]
        windows.v[r.slot].fill_(-i)
        caps.append(windows.capacity)
    assert caps == [1, 2, 4, 4, 6, 6] and windows.nbytes == windows.reserved_bytes
    for i in range(6):  # contents survived every growth
        slot = store.requests[f"r{i}"].slot
        assert (windows.k[slot] == i).all() and (windows.v[slot] == -i).all()
    with pytest.raises(PoolExhausted, match="window slots"):
        store.reserve("one too many")
    store.free("r0")
    with pytest.raises(RuntimeError, match="still held"):
        windows.release_memory()
    store.release_memory()  # what a stopping manager calls
    assert windows.nbytes == 0 and not store.requests and store.pool.num_pages == 8  # the caller's pool stays
    store.reserve("again")
    assert windows.capacity == 1


# ------------------------------------------------------------------------------------------- 3. stopped managers
def collect(manager, ids, timeout: float = 300) -> dict:
    """The finished outputs of ``ids`` by request id (results come in any order; others are kept too)."""
    got, deadline = {}, time.monotonic() + timeout
    while not set(ids) <= set(got) and time.monotonic() < deadline:
        r = manager.get_result(timeout=1)
        if r is not None:
            got[r.request_id] = r
    return got


def serve_one(manager, prompt):
    manager.start()
    rid = manager.add_request(prompt, max_new_tokens=3)
    result = manager.get_result(rid, timeout=120)
    manager.stop(block=True)
    return result


def test_a_stopped_managers_store_is_released(model):
    """oscar_serving (what scripts/serve.py runs: a fresh store per manager, e.g. per model `transformers serve`
    loads): once a manager stops and is dropped, its store and its cache tensor are garbage; the block keeps no
    reference to them."""
    cb_cfg = continuous_batching_config(num_blocks=32, max_batch_tokens=64, page_size=8)
    with oscar_serving(max_requests=4, method="hadamard", **OSCAR) as stores:
        manager = model.init_continuous_batching(generation_config=gen_config(3), continuous_batching_config=cb_cfg)
        result = serve_one(manager, list(range(5, 30)))
        assert len(result.generated_tokens) == 3
        (store,) = list(stores)
        store_ref, windows_ref = weakref.ref(store), weakref.ref(store.windows)
        assert store.windows.nbytes == 0 and store.pool.released  # given back at stop
        del store, manager, result
        gc.collect()
        assert store_ref() is None and windows_ref() is None and len(stores) == 0


def test_a_kept_store_gives_its_memory_back_at_stop(model):
    """paged_oscar with the caller's store: the store outlives the manager, its memory does not (on 5.20+ its pages
    were views of the manager's cache tensor, which would stay alive with them)."""
    cb_cfg = continuous_batching_config(num_blocks=32, max_batch_tokens=64, page_size=8)
    with paged_oscar(model, max_requests=4, **OSCAR) as store:
        manager = model.init_continuous_batching(generation_config=gen_config(3), continuous_batching_config=cb_cfg)
        manager.start()
        rid = manager.add_request(list(range(5, 30)), max_new_tokens=3)
        manager.get_result(rid, timeout=120)
        pages = weakref.ref(store.pool.int2.codes.untyped_storage()) if SECTOR_API else None
        tensor = weakref.ref(store.pool.int2.codes)
        assert store.windows.nbytes > 0
        manager.stop(block=True)
        del manager
        gc.collect()
        assert store.windows.nbytes == 0 and store.pool.released and store.pool.num_used == 0
        assert tensor() is None and (pages is None or pages() is None)
        # the store serves the next manager of the block with a new pool
        again = model.init_continuous_batching(generation_config=gen_config(3), continuous_batching_config=cb_cfg)
        assert len(serve_one(again, [3, 1, 4, 1, 5]).generated_tokens) == 3
        assert store.windows.nbytes == 0 and store.pool.released


def test_requests_with_cancellations_leave_nothing_behind(model):
    """40 requests of 3-59 tokens (split over steps of 32 tokens), every third cancelled right after it was sent, at
    most 8 live: window slots never past max_requests, prompt reservations within the budget; after the manager stops
    no request, page, window slot or prompt reservation is left and the memory is given back."""
    rng = random.Random(5)
    cb_cfg = continuous_batching_config(num_blocks=96, max_batch_tokens=32, page_size=8, max_requests_per_batch=6)
    peak = {"capacity": 0, "reserved": 0}
    with paged_oscar(model, max_requests=8, prompt_budget=96, **OSCAR) as store:
        attend = store.attend

        def watched(*args):
            peak["capacity"] = max(peak["capacity"], store.windows.capacity)
            peak["reserved"] = max(peak["reserved"], store.prompt_reserved)
            return attend(*args)

        store.attend = watched
        manager = model.init_continuous_batching(generation_config=gen_config(6), continuous_batching_config=cb_cfg)
        manager.start()
        ids = []
        for i in range(40):
            prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 60))]
            ids.append(manager.add_request(prompt, max_new_tokens=rng.randrange(1, 8)))
            if i % 3 == 0:
                manager.cancel_request(ids[-1])
        kept = [rid for i, rid in enumerate(ids) if i % 3]
        results = collect(manager, kept)
        manager.stop(block=True)
        assert set(kept) <= set(results)
        assert not store.requests and store.prompt_reserved == 0 and store.pool.num_used == 0
        assert store.windows.nbytes == 0 and store.pool.released  # given back at stop
        assert 0 < peak["capacity"] <= 8 and 0 < peak["reserved"] <= 96 and store.pool.peak_used > 0


# ---------------------------------------------------------------------------------- 4. nothing outside the managers
@pytest.mark.skipif(not SECTOR_API, reason="5.20+ builds the paged cache through swapped module globals")
def test_a_plain_cache_built_in_another_thread_while_oscar_builds_is_transformers_own(monkeypatch):
    """While a thread builds an OSCAR cache, the cache module's allocator and memory handler are OSCAR's in that
    thread only: a plain paged cache built meanwhile in another thread gets Transformers' BF16 allocator."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from oscar_hf.serving.paged_cache import _oscar_allocation

    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 64 << 20)
    cfg = tiny_config("llama", num_hidden_layers=2)
    store = OscarPagedStore(cfg, method="hadamard", defer_pool=True, prompt_budget=64, **OSCAR)
    built = {}

    def plain():
        cb_cfg = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, page_size=16)
        built["cache"] = PagedAttentionCache(cfg, cb_cfg, "cpu", DistributedHelper(None, None), dtype=torch.float32)

    with _oscar_allocation(store):  # this thread is building an OSCAR cache
        worker = threading.Thread(target=plain)
        worker.start()
        worker.join()
    allocator = built["cache"].cache_allocators["full_attention"]
    assert type(allocator) is FullAttentionCacheAllocator
    assert allocator.bytes_per_block == 2 * 2 * 2 * 16 * 32 * 4  # BF16-style K/V blocks: 2 layers, K and V, fp32


@pytest.mark.skipif(SECTOR_API, reason="5.17 - 5.19 cap max_requests_per_batch through a swapped function")
def test_another_threads_manager_keeps_its_own_request_cap(model):
    """On 5.17 - 5.19 the cap of max_requests_per_batch follows the OSCAR pages of the cache the same thread just built;
    a plain manager's update in another thread keeps its own block count."""
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=64, page_size=8)
    with paged_oscar(model, **OSCAR) as store:
        processor(model, cb_cfg)
        assert store.pool.num_pages == 64
        other = continuous_batching_config(num_blocks=5, max_batch_tokens=64, page_size=8, max_requests_per_batch=32)
        worker = threading.Thread(target=continuous_api.update_cb_config_after_cache_creation,
                                  args=(other, 5, 64, False))
        worker.start()
        worker.join()
    assert other.max_requests_per_batch == 5


def test_a_plain_generate_batch_in_another_thread_while_oscar_serves(model):
    """An OSCAR manager serving ``model`` in its thread while another model's plain generate_batch runs in another:
    the plain one gets Transformers' tokens, OSCAR's requests OSCAR's."""
    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    other = tiny_model("llama", seed=3)
    prompts = [[5, 9, 33, 2, 71, 8, 100, 4, 19, 60, 3, 44, 12, 90, 17, 23, 61], [7, 7, 21, 90]]
    cb_cfg = lambda: continuous_batching_config(num_blocks=64, max_batch_tokens=128, page_size=8)  # noqa: E731
    out = other.generate_batch(prompts, gen_config(6), continuous_batching_config=cb_cfg(), warmup=False)
    plain = [r.generated_tokens for r in out.values()]
    got = {}
    with paged_oscar(model, **OSCAR) as store:
        manager = model.init_continuous_batching(generation_config=gen_config(6), continuous_batching_config=cb_cfg())
        manager.start()
        ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]

        def run_other():
            out = other.generate_batch(prompts, gen_config(6), continuous_batching_config=cb_cfg(), warmup=False)
            got["other"] = [r.generated_tokens for r in out.values()]

        worker = threading.Thread(target=run_other)
        worker.start()
        results = collect(manager, ids)
        ours = [results[i].generated_tokens for i in ids]
        worker.join()
        manager.stop(block=True)
        assert store.pool.peak_used > 0
    assert got["other"] == plain
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)

    def alone(p):
        cache = OscarCache(model, method="hadamard", compile=False, **OSCAR)
        return model.generate(torch.tensor([p]), **kw, **cache_kwargs(model, cache))[0, len(p):].tolist()

    want = [alone(p) for p in prompts]
    assert ours == want
