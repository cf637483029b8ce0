"""`generate` with OscarCache on real and tiny models: exactness, left padding, beam/sample/crop/multi-turn."""
import types

import pytest
import torch
from batch_utils import left_pad
from transformers import DynamicCache

from oscar_hf import OscarCache, disable_oscar
from oscar_hf.compat import cache_kwargs
from oscar_hf.cache import OscarLayer

from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens
EXACT = dict(method="hadamard", group_size=32)  # sink 64 + recent 256: nothing quantized for short prompts


def greedy(model, ids, cache=None, n=12, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache), pad_token_id=0, **kw)


def upto_eos(tokens, eos):
    out = []
    for t in tokens:
        out.append(t)
        if t in eos:
            break
    return out


def eos_ids(model):
    e = model.generation_config.eos_token_id
    return set(e if isinstance(e, list) else ([] if e is None else [e]))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"])
def test_generate_tiny_architectures(model_type):
    m = tiny_model(model_type)
    torch.manual_seed(1)
    ids = torch.randint(1, 200, (2, 30))
    ref = greedy(m, ids)
    assert torch.equal(greedy(m, ids, OscarCache(m, **EXACT)), ref), "short prompt must equal DynamicCache exactly"
    cache = OscarCache(m, **SMALL)
    out = greedy(m, ids, cache)
    assert out.shape == ref.shape
    assert cache.get_seq_length() == out.shape[1] - 1
    quantized = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
    assert quantized and all(layer.export_state()["hist_k"].codes.shape[2] > 0 for layer in quantized)
    # the patched model still serves ordinary caches exactly
    assert torch.equal(greedy(m, ids, DynamicCache(config=m.config)), ref)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_left_padded_batch_rows_equal_their_solo_runs(model_type):
    m = tiny_model(model_type)
    torch.manual_seed(2)
    lens = [5, 12, 30, 41, 9, 26, 60, 3]  # some past sink + recent = 12
    prompts = [torch.randint(1, 200, (n,)) for n in lens]
    ids, am = left_pad(prompts)
    t = ids.shape[1]
    out = m.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
                     **cache_kwargs(m, OscarCache(m, **SMALL)))
    eos = eos_ids(m)
    for i, p in enumerate(prompts):
        solo = greedy(m, p[None], OscarCache(m, **SMALL))
        assert upto_eos(solo[0, len(p) :].tolist(), eos) == upto_eos(out[i, t:].tolist(), eos), f"row {i} (len {len(p)})"


def test_beam_search_sampling_and_prompt_lookup():
    m = tiny_model("qwen3")
    torch.manual_seed(3)
    ids = torch.randint(1, 200, (1, 24))
    ids = torch.cat([ids, ids[:, :10]], 1)  # repetition so prompt lookup proposes candidates
    # exact config: identical to DynamicCache for beams, sampling and prompt lookup (crop)
    beams = dict(num_beams=3, num_return_sequences=2)
    assert torch.equal(greedy(m, ids, OscarCache(m, **EXACT), **beams), greedy(m, ids, **beams))
    torch.manual_seed(7)
    s_ref = m.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(7)
    s_osc = m.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, pad_token_id=0,
                       **cache_kwargs(m, OscarCache(m, **EXACT)))
    assert torch.equal(s_ref, s_osc)
    assert torch.equal(greedy(m, ids, OscarCache(m, **EXACT), prompt_lookup_num_tokens=3), greedy(m, ids))
    # quantizing config: all three run and keep the bookkeeping right
    for kw in (beams, dict(prompt_lookup_num_tokens=3)):
        cache = OscarCache(m, **SMALL)
        out = greedy(m, ids, cache, n=16, **kw)
        assert cache.get_seq_length() == out.shape[1] - 1
        for layer in cache.layers:
            st = layer.export_state()
            assert st["tail_start"] <= st["seq_len"] and st["seq_len"] - st["tail_start"] <= max(layer.config.recent, 1) + 16


def test_multi_turn_reuses_one_cache():
    m = tiny_model("llama")
    torch.manual_seed(4)
    turn1, turn2 = torch.randint(1, 200, (1, 20)), torch.randint(1, 200, (1, 7))
    for kw, exact in ((EXACT, True), (SMALL, False)):
        cache, dyn = OscarCache(m, **kw), DynamicCache(config=m.config)
        out1 = greedy(m, turn1, cache, n=6)
        ref1 = greedy(m, turn1, dyn, n=6)
        ids2 = torch.cat([out1, turn2], 1)
        out2 = greedy(m, ids2, cache, n=6)
        assert cache.get_seq_length() == out2.shape[1] - 1
        if exact:
            assert torch.equal(out2, greedy(m, torch.cat([ref1, turn2], 1), dyn, n=6))


def test_disable_restores_user_attention():
    m = tiny_model("llama")
    OscarCache(m, **SMALL)
    assert m.config._attn_implementation == "oscar_sdpa"
    disable_oscar(m)
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_smollm2_real_weights(smollm2, wikitext_text):
    model, tok = smollm2
    text = wikitext_text[5000:9000]
    ids = tok(text, return_tensors="pt").input_ids[:, :600]
    ctx, cont = ids[:, :520], ids[:, 520:]

    def nll(cache):
        with torch.no_grad():
            out = model(ctx, **cache_kwargs(model, cache), use_cache=True)
            logits = [out.logits[:, -1]]
            for t in range(cont.shape[1] - 1):
                logits.append(model(cont[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
        return torch.nn.functional.cross_entropy(torch.cat(logits), cont[0]).item()

    base = nll(DynamicCache(config=model.config))
    cache = OscarCache(model, method="hadamard")
    osc = nll(cache)
    rep = cache.memory_report()
    assert rep["history_codes"] > 0
    hist_bits = 8 * (rep["history_codes"] + rep["history_meta"]) / rep["history_elements"]
    assert hist_bits == rep["history_bits_per_element"] == 2.5  # G=64, bf16 scale + zero
    assert base < osc < base * 1.5, (base, osc)
    out = model.generate(ctx, max_new_tokens=8, do_sample=False,
                         **cache_kwargs(model, OscarCache(model, method="hadamard")))
    assert out.shape[1] == 528


def test_left_padding_mask_becomes_a_start_not_a_key_mask(monkeypatch):
    """A decode step whose mask only hides each row's left padding reaches the decode op as a later per-row start with
    no key mask (so that on the GPU it can take the Gluon history kernel, which has none); the tokens are those of
    the same run with the mask read as a key mask (masks with holes: the next test)."""
    import oscar_hf.cache.layer_eager as read_mod  # the multi-token read (EagerOps._multi_token)
    import oscar_hf.kernels.static_op as step_mod  # the decode step
    from oscar_hf.cache.layer_eager import EagerOps

    m = tiny_model("llama")
    torch.manual_seed(4)
    prompts = [torch.randint(1, 200, (n,)) for n in (40, 17, 29)]
    ids, am = left_pad(prompts)
    seen = []

    def spy(real):
        def decode(params, q, window, history, *a, **kw):
            seen.append((history.key_mask is None, history.start.clone()))
            return real(params, q, window, history, *a, **kw)
        return decode

    for mod in (read_mod, step_mod):
        monkeypatch.setattr(mod, "decode", spy(mod.decode))
    run = lambda: m.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False,  # noqa: E731
                             **cache_kwargs(m, OscarCache(m, **SMALL)), pad_token_id=0)
    out = run()
    assert seen and all(no_mask for no_mask, _ in seen)
    pads = (am == 0).sum(1)
    assert any(bool((start > 0).any()) for _, start in seen)  # the padded rows start later
    assert all(bool((start >= pads - SMALL["sink"]).all()) for _, start in seen)
    seen.clear()
    monkeypatch.setattr(EagerOps, "_left_padding_only", lambda *a: False)
    assert torch.equal(run(), out)
    assert seen and not any(no_mask for no_mask, _ in seen)


def test_left_padding_only_detects_holes_and_is_shared_by_a_forwards_layers():
    from oscar_hf.cache import layer_eager

    layer = types.SimpleNamespace(batch_size=3, pad=torch.tensor([2, 0, 1]))
    check = lambda mask, t_old: layer_eager.EagerOps._left_padding_only(layer, mask, t_old)  # noqa: E731
    ok = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None]  # [B, 1, 1, 5]
    hole = ok.clone()
    hole[1, 0, 0, 2] = False
    assert check(ok, 4)
    assert not check(hole, 4)
    assert layer_eager._LEFT_PAD_MEMO[0][0] is hole and layer_eager._LEFT_PAD_MEMO[0][1] == 4
    hole.copy_(ok)
    assert not check(hole, 4)  # the same forward (mask, step): the kept answer
    assert check(hole, 3)  # another step: asked again
    assert check(None, 4)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_cache_built_from_the_model_config_routes_the_attention(model_type):
    """``OscarCache(model.config, ...)`` switches the config the model reads at every forward: the same tokens
    as ``OscarCache(model, ...)`` (before, generate failed in SDPA on the handle: "must be Tensor, not OscarKV")."""
    m = tiny_model(model_type)
    torch.manual_seed(7)
    ids = torch.randint(1, 200, (2, 30))
    want = greedy(m, ids, OscarCache(m, **SMALL))
    disable_oscar(m)
    assert not m.config._attn_implementation.startswith("oscar_")
    cache = OscarCache(m.config, **SMALL)
    assert m.config._attn_implementation == "oscar_sdpa"
    assert torch.equal(greedy(m, ids, cache), want)
    assert any(isinstance(layer, OscarLayer) and layer.export_state()["hist_k"].codes.shape[2] > 0
               for layer in cache.layers)
    disable_oscar(m)
    assert torch.equal(greedy(m, ids), greedy(m, ids, DynamicCache(config=m.config)))
