"""The kernel warm-up (:mod:`oscar_hf.serving.warmup`): its length grid, and that its reads meet every kernel variant
(:func:`~oscar_hf.kernels.plan.plan_variant`) a served workload within its bounds meets. The plans are recorded as a
GPU of 8 SMs would make them (rows fewer than SMs take other combine tiles) and the interpreted launches are skipped:
what is checked is which launches the warm-up plans, not their outputs (tests/kernels check those)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oscar_hf.kernels import decode_triton
from oscar_hf.kernels import plan as kernel_plan
from oscar_hf.kernels.plan import plan_variant
from oscar_hf.serving import OscarPagedStore
from oscar_hf.serving.warmup import kernels_used, length_grid, warm_kernels

from test_prefix import rand_qkv, step
from tiny_models import tiny_config

S0, W, P = 4, 8, 16


@given(st.integers(1, 1 << 20), st.integers(1, 8))
def test_the_grid_holds_every_power_of_two_and_its_bound(hi, per_octave):
    grid = length_grid(hi, per_octave)
    assert grid == sorted(set(grid)) and grid[0] == 1 and grid[-1] == hi
    assert all(1 << k in grid for k in range(hi.bit_length()))
    assert len(grid) <= per_octave * hi.bit_length() + 1  # (and at most per_octave points a doubling)


def make_store(**kw):
    # head_dim 64: a shape the paged kernels serve (the read of a smaller head runs the torch reference)
    cfg = tiny_config("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return cfg, OscarPagedStore(cfg, method="hadamard", sink=S0, recent=W, group_size=32, num_pages=16, page_size=P,
                                max_requests=3, use_kernels=True, **kw)


@pytest.fixture
def variants(monkeypatch):
    """``[(shape, (head_dim, group_size, plan_variant))]`` of every read from now on, planned for an 8-SM sm_90 GPU;
    no kernel runs."""
    from triton.runtime.interpreter import InterpretedFunction

    seen, plan = [], decode_triton.decode_plan

    def recorded(shape, device, **kwargs):
        with monkeypatch.context() as gpu:
            gpu.setattr(kernel_plan, "_cuda_properties", lambda d: type("P", (), dict(major=9,
                                                                                      multi_processor_count=8)))
            seen.append((shape, (shape.d, shape.group_size, plan_variant(plan(shape, torch.device("cuda"),
                                                                                **kwargs)))))
        return plan(shape, device, **kwargs)

    monkeypatch.setattr(decode_triton, "decode_plan", recorded)
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: None)
    return seen


def serve(cfg, store):
    """Two requests: prompts of 40 and 70 tokens, decode steps alone and together, then a 5-token chunk after decoding
    (the chunk read: the prompt's exact rows are gone)."""
    gen = torch.Generator().manual_seed(0)
    a, b = rand_qkv(cfg, 60, gen), rand_qkv(cfg, 90, gen)
    rows = lambda x, lo, hi: [tuple(t[:, :, lo:hi] for t in layer) for layer in x]  # noqa: E731
    step(store, [("a", 0, 40)], rows(a, 0, 40))
    step(store, [("a", 40, 1)], rows(a, 40, 41))
    step(store, [("b", 0, 70)], rows(b, 0, 70))
    step(store, [("a", 41, 1), ("b", 70, 1)], [tuple(torch.cat([x, y], 2) for x, y in zip(la, lb))
                                               for la, lb in zip(rows(a, 41, 42), rows(b, 70, 71))])
    step(store, [("b", 71, 5)], rows(b, 71, 76))


@pytest.mark.parametrize("kw", [{}, dict(retrieval_heads=((0, 1),), retrieval_bits=8)])
def test_the_warm_up_meets_every_variant_a_workload_within_its_bounds_meets(variants, kw):
    cfg, store = make_store(**kw)
    assert kernels_used(store)
    # the grid's bounds: chunks of up to 8 rows, decode steps of up to 3 rows, histories of up to 80 tokens
    got = warm_kernels(store, max_chunk=8, max_history=80, per_octave=1, progress=False)
    warmed = list(variants)
    assert got["calls"] > 0 and not store.requests and store.pool.num_used == 0  # (nothing of the store touched)
    variants.clear()
    serve(cfg, store)
    served = {v for _, v in variants}
    assert served <= {v for _, v in warmed}, served - {v for _, v in warmed}
    # the check can fail: without its 2- and 3-row decode reads (one row: a combine of fewer rows than SMs), the
    # warm-up would miss the workload's two-request decode step
    assert served - {v for s, v in warmed if s.m > cfg.num_attention_heads // cfg.num_key_value_heads or s.b == 1}


def test_nothing_runs_where_the_reads_use_no_kernels_and_bad_bounds_are_refused():
    cfg = tiny_config("llama")
    store = OscarPagedStore(cfg, method="hadamard", sink=S0, recent=W, group_size=32, num_pages=4, page_size=P)
    assert not kernels_used(store) and warm_kernels(store) == dict(calls=0, seconds=0.0)
    store = make_store()[1]
    with pytest.raises(ValueError, match="max_chunk must be a positive int"):
        warm_kernels(store, max_chunk=-1, max_history=8)
    deferred = OscarPagedStore(cfg, method="hadamard", sink=S0, recent=W, group_size=32, defer_pool=True,
                               use_kernels=True)
    with pytest.raises(ValueError, match="give page_size="):
        warm_kernels(deferred)


@given(st.integers(1, 64), st.integers(0, 4096))
def test_one_part_is_the_longest_chunk_read_in_one_part(hq, entries):
    from oscar_hf.kernels.paged_decode import LOGITS_BUDGET
    from oscar_hf.serving.warmup import one_part

    rows = lambda l: max(1, LOGITS_BUDGET // (4 * hq * (entries + l)))  # noqa: E731  (paged_chunk_attention's step)
    l = one_part(hq, entries)
    assert rows(l) >= l and rows(l + 1) < l + 1


def test_a_managers_cache_warms_once_a_process_with_its_bounds(model, monkeypatch):
    """``warm_kernels=True``: the cache of each manager calls the warm-up with its ``max_batch_tokens`` and its
    attached pool; a second manager of the same shapes finds it done (``warm_once``)."""
    from transformers import GenerationConfig

    from oscar_hf.serving import continuous_batching_config, paged_oscar
    from oscar_hf.serving import warmup

    calls = []
    monkeypatch.setattr(warmup, "kernels_used", lambda store: True)
    monkeypatch.setattr(warmup, "warm_kernels", lambda store, **kw: calls.append((store.pool.page_size, kw)) or
                        dict(calls=1, seconds=0.0))
    monkeypatch.setattr(warmup, "_WARMED", {})
    gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = continuous_batching_config(num_blocks=64, max_batch_tokens=96, page_size=8)
    for _ in range(2):
        with paged_oscar(model, sink=4, recent=8, group_size=32, warm_kernels=True):
            assert len(model.generate_batch([[1, 2, 3]], gen, continuous_batching_config=cb, warmup=False)) == 1
    assert calls == [(8, dict(max_chunk=96))]
    with pytest.raises(TypeError, match="warm_kernels must be True or False"):
        OscarPagedStore(tiny_config("llama"), method="hadamard", num_pages=4, warm_kernels="yes")
