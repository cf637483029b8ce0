"""OSCAR inside Transformers' continuous batching: each request's greedy tokens equal its run alone through
OscarCache, requests join and leave (at most 3 per batch), and the pool is empty afterwards."""
import inspect
import random

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.serving import OscarPagedStore, continuous_batching_config, paged_oscar

from tiny_models import tiny_model

OSCAR = dict(sink=4, recent=8, group_size=32)
NEW_TOKENS = 24


def greedy_alone(model, prompt, cache=None):
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    if cache is not None:
        kw.update(cache_kwargs(model, cache))  # cache= or past_key_values=, whichever this Transformers takes
    out = model.generate(torch.tensor([prompt]), **kw)
    return out[0, len(prompt):].tolist()


# the storage settings served: INT2 at one group; 3-bit keys with the values at a group of their own (what
# Gemma-3-270M's artifact chose, at its ratio of groups: keys at D/8, values at D/2)
STORAGE = [{}, dict(group_size=16, key_bits=3, value_group_size=32)]


@pytest.mark.parametrize("storage", STORAGE, ids=["int2", "k3-own-value-group"])
def test_generate_batch_matches_oscar_cache_alone(model, storage):
    settings = {**OSCAR, **storage}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (3, 10, 17, 40, 25, 6, 33, 12)]
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    # at most 3 requests per batch: the later ones join as the first ones leave; pages of 8 tokens (a request holds
    # 16 blocks for its window + its history pages: 128 blocks never make the scheduler evict one)
    cb_cfg = continuous_batching_config(num_blocks=128, max_batch_tokens=256, page_size=8, max_requests_per_batch=3)
    sizes, before = [], model.config._attn_implementation  # (an earlier OscarCache run leaves it routed: oscar_sdpa)
    with paged_oscar(model, **settings) as store:
        assert isinstance(store, OscarPagedStore)
        attend = store.attend
        store.attend = lambda layer, q, k, v, batch, *a: sizes.append(len(batch)) or attend(layer, q, k, v, batch, *a)
        out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
        assert store.pool.num_used == 0 and not store.requests  # every request left and gave its pages back
        assert (store.pool.key_hi is not None, bool(store.pool.value_meta)) == (bool(storage),) * 2  # (its storage)
        assert store.pool.peak_used >= 3  # histories did live in pages (40 + 24 tokens: 6 pages alone)
    assert max(sizes) == 3  # requests shared forwards, up to max_requests_per_batch
    assert model.config._attn_implementation == before  # restored
    got = [r.generated_tokens for r in out.values()]
    assert len(got) == len(prompts)
    want = [greedy_alone(model, p, OscarCache(model, method="hadamard", compile=False, **settings)) for p in prompts]
    assert got == want
    # OSCAR was in the loop: the full-precision model decodes at least one request differently
    assert got != [greedy_alone(model, p) for p in prompts]


def test_paged_oscar_refuses_compile_and_offload(model):
    from transformers import CompileConfig

    gen_cfg = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    from oscar_hf.serving.batching import OscarPagedCache, _check_cb_config

    if not getattr(OscarPagedCache, "updates_in_attention", False):  # 5.20 - 5.23 refuse graphs (test_cuda_graphs)
        _check_cb_config(continuous_batching_config(num_blocks=16, page_size=16, use_cuda_graph=True))  # served
    with pytest.raises(NotImplementedError, match="torch.compile"):
        _check_cb_config(continuous_batching_config(num_blocks=16, page_size=16, varlen_compile_config=CompileConfig()))
    with pytest.raises(NotImplementedError):
        _check_cb_config(ContinuousBatchingConfig(cpu_offload_space=1.0))
    from oscar_hf.attention import disable_oscar, enable_oscar

    enable_oscar(model)  # as an OscarCache run leaves it: oscar_sdpa, which the manager alone would refuse
    small = continuous_batching_config(num_blocks=16, max_batch_tokens=64, page_size=16)
    with paged_oscar(model, **OSCAR):
        assert model.generate_batch([[1, 2, 3]], gen_cfg, continuous_batching_config=small, warmup=False)
    assert model.config._attn_implementation == "oscar_sdpa"  # as it was
    disable_oscar(model)
    with paged_oscar(model, **OSCAR):
        pass  # entering and leaving restores Transformers' own cache class
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    assert continuous_api.PagedAttentionCache is PagedAttentionCache
    # plain continuous batching still works (a small cache: the default sizes it from the free memory, slow on CPU)
    assert model.generate_batch([[1, 2, 3]], gen_cfg, continuous_batching_config=small, warmup=False)


def test_flash_attention_available_keeps_oscar_in_the_path(monkeypatch):
    """Where flash attention is installed (made to look so here), Transformers' manager switches an sdpa model to
    it before any cache is built: inside an OSCAR block the model keeps OSCAR's attention, and the tokens are the
    ones OSCAR gives without flash available. (In BF16: 5.25 switches half-precision models only.)"""
    from transformers.generation.continuous_batching import continuous_api

    model = tiny_model("llama", dtype=torch.bfloat16)

    switch = getattr(continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if switch is None or "auto_switch_to_flash" not in inspect.signature(switch).parameters:
        pytest.skip("this Transformers' manager has no flash switch to turn off (5.17 - 5.19: the OSCAR attention "
                    "name replaces what it chose)")
    prompts = [[5, 9, 33, 2, 71, 8, 100, 4, 19, 60, 3], [7, 7, 21, 90]]
    gen_cfg = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run():
        cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=128, page_size=8)
        with paged_oscar(model, **OSCAR):
            out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
        return [r.generated_tokens for r in out.values()]

    plain = run()
    monkeypatch.setattr(continuous_api, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setattr(continuous_api, "is_flash_attn_3_available", lambda *a, **k: False)
    monkeypatch.setattr(type(model), "_supports_flash_attn", True, raising=False)
    switched = []  # what the manager asks of the model (flash itself is not installed here)
    monkeypatch.setattr(model, "set_attn_implementation", switched.append, raising=False)
    manager = object.__new__(continuous_api.ContinuousBatchingManager)
    manager.switch_to_cb_friendly_attn(model, True)  # outside an OSCAR block: the switch the block prevents
    assert switched == ["flash_attention_2"]
    switched.clear()
    assert run() == plain
    assert switched == [] and model.config._attn_implementation == "sdpa"


def test_a_batch_processor_without_the_oscar_cache_is_refused():
    """If Transformers built its paged cache another way inside an OSCAR block, serving stops instead of running
    plain BF16."""
    from types import SimpleNamespace

    from oscar_hf.serving.batching import _check_processor

    with pytest.raises(RuntimeError, match="not OSCAR's"):
        _check_processor(SimpleNamespace(cache=object()))


@pytest.mark.parametrize("max_batch_tokens", [256, 24])
def test_layers_left_in_bf16_keep_their_masks(max_batch_tokens):
    """A model with layers OSCAR leaves to Transformers' own paged cache (Gemma 3's sliding-window layers, window 16):
    those layers read Transformers' attention masks (the sliding window, and the block-diagonal mask between requests
    packed in one forward), which Transformers builds only for the attention names it knows, not OSCAR's. Requests
    packed together, prompts longer than the window, split over steps (24 tokens a forward), get the greedy tokens
    each gets alone through ``OscarCache``."""
    from tiny_models import tiny_model

    gemma = tiny_model("gemma3_text")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (40, 29, 57)]
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_cfg = continuous_batching_config(num_blocks=128, max_batch_tokens=max_batch_tokens, page_size=8,
                                        max_requests_per_batch=3)
    with paged_oscar(gemma, num_pages=32, page_size=8, **OSCAR) as store:
        assert not store.handles(0) and store.handles(1)  # the sliding layer stays BF16
        out = gemma.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
        assert store.pool.peak_used > 0
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    want = [greedy_alone(gemma, p, OscarCache(gemma, method="hadamard", compile=False, **OSCAR)) for p in prompts]
    assert got == want


@pytest.mark.parametrize("max_batch_tokens", [24, 7])
def test_tokens_do_not_depend_on_how_prompts_are_chunked(model, max_batch_tokens):
    """A prompt the scheduler splits over several steps (its later chunks beside other requests' prompts and decode
    steps) gets the tokens of the same prompt prefilled in one piece: later chunks attend exactly to the earlier
    ones (kept in full precision until the prompt is complete), not to their INT2 history."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (45, 70, 52, 61)]
    gen_cfg = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(tokens):
        cb_cfg = continuous_batching_config(num_blocks=128, max_batch_tokens=tokens, page_size=8)
        chunks, held = [], [0]  # later chunks seen; the most bytes of prompt chunks held in full precision

        def attend(layer, q, k, v, batch, *a):
            chunks.extend(b for b in batch if b[1] > 0 and b[2] > 1)
            out = plain_attend(layer, q, k, v, batch, *a)
            held[0] = max(held[0], store.stats()["prompt_bytes"])
            return out

        with paged_oscar(model, **OSCAR) as store:
            plain_attend, store.attend = store.attend, attend
            out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
            assert store.stats()["prompt_bytes"] == 0 and not store.requests
        return {k: r.generated_tokens for k, r in out.items()}, chunks, held[0]

    whole, chunks, held = run(4096)
    assert not chunks and held == 0  # the scheduler says when a prompt is complete: one-piece prompts are never held
    split, chunks, held_split = run(max_batch_tokens)
    assert chunks and held_split > 0  # prompts were split, and their chunks held until complete
    assert split == whole


def test_another_model_inside_the_block_stays_bf16(model):
    """Inside ``paged_oscar(model)`` a manager of another model (a plain ``generate_batch``, e.g. in another thread)
    gets Transformers' own cache and attention: the block's patches serve only its model's managers."""
    other = tiny_model("llama", seed=3)
    prompts = [[5, 9, 33, 2, 71, 8, 100, 4, 19, 60, 3, 44, 12, 90, 17, 23, 61], [7, 7, 21, 90]]
    gen_cfg = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_cfg = lambda: continuous_batching_config(num_blocks=64, max_batch_tokens=128, page_size=8)  # noqa: E731

    def tokens(out):
        return [r.generated_tokens for r in out.values()]

    plain = tokens(other.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg(), warmup=False))
    with paged_oscar(model, **OSCAR) as store:
        inside = tokens(other.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg(), warmup=False))
        assert store.pool is None or store.pool.peak_used == 0  # the block's store saw none of it
        ours = tokens(model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg(), warmup=False))
    assert inside == plain
    assert ours == [greedy_alone(model, p, OscarCache(model, method="hadamard", compile=False, **OSCAR))[:10]
                    for p in prompts]


def test_soft_reset_requests_are_re_prefilled_and_the_rest_stay_exact(model, monkeypatch):
    """A pool too small for the batch: Transformers soft-resets requests (frees their blocks, later re-prefills prompt +
    generated tokens). Every request still gets all its tokens and the store ends empty; a request never reset is its
    run alone through OscarCache, and a reset one is up to its reset (after it, the re-prefill computes the generated
    tokens' K/V under exact attention where the uninterrupted run read the INT2 history: docs/serving.md §6)."""
    from transformers.generation.continuous_batching.requests import RequestState

    resets = {}  # request id -> tokens generated when it was first reset
    original = RequestState.create_equivalent_initial_request

    def counted(state):
        resets.setdefault(state.request_id, len(state.generated_tokens))
        return original(state)

    monkeypatch.setattr(RequestState, "create_equivalent_initial_request", counted)
    new = 48
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(20, 90))] for _ in range(12)]
    gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    # 12 pages of 16 tokens: a request holds up to 9 of them (90 + 48 tokens) and 6 may run at once
    cb_cfg = continuous_batching_config(num_blocks=12, max_batch_tokens=128, page_size=16, max_requests_per_batch=6)
    with paged_oscar(model, **OSCAR) as store:
        out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
        assert store.pool.num_used == 0 and not store.requests
    assert len(resets) >= 2, resets  # the pool did force resets
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[-1]))  # req_0, req_1, ... in prompt order
    assert len(order) == len(prompts)
    for rid, prompt in zip(order, prompts):
        got = out[rid].generated_tokens
        assert len(got) == new, rid
        kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        alone = model.generate(torch.tensor([prompt]), **kw, **cache_kwargs(
            model, OscarCache(model, method="hadamard", compile=False, **OSCAR)))[0, len(prompt):].tolist()
        upto = resets.get(rid, new)
        assert got[:upto] == alone[:upto], (rid, upto)
        if got != alone:  # (-s prints what docs/serving.md §6 quotes)
            print(f"{rid}: reset after {upto} tokens, leaves its run alone at token "
                  f"{next(i for i, (a, b) in enumerate(zip(got, alone)) if a != b)}")
    print(f"{len(resets)} of {len(prompts)} requests reset")
    assert len(resets) < len(prompts)  # some requests ran through without a reset (checked whole above)
