"""The one-forward fake-quant scorer equals token-by-token decoding through the real cache."""
import math

import pytest
import torch
from transformers.utils import logging as hf_logging

import oscar_hf.eval.methods as methods_mod
from oscar_hf import OscarRotations
from oscar_hf.cache import OscarLayer
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.fakequant import window_exact_mask
from oscar_hf.eval.methods import OscarFamily, get_method
from oscar_hf.eval.perplexity import cache_nll, evaluation_ids, fast_nll, perplexity
from oscar_hf.rotations import LayerRotation

from tiny_models import tiny_model

hf_logging.disable_progress_bar()


def random_artifact(model, seed=0, clip=(0.9, 0.85)):
    """A calibrated-looking artifact: random orthogonal R per KV head, offsets, clip ratios."""
    fp = OscarRotations.builtin(model, "identity").fingerprint
    g = torch.Generator().manual_seed(seed)
    hk, d = fp.num_key_value_heads, fp.head_dim
    layers = {}
    for i in range(fp.num_layers):
        r_k = torch.linalg.qr(torch.randn(hk, d, d, generator=g, dtype=torch.float64))[0].float()
        r_v = torch.linalg.qr(torch.randn(hk, d, d, generator=g, dtype=torch.float64))[0].float()
        mu = lambda: 0.3 * torch.randn(hk, d, generator=g)  # noqa: E731
        layers[i] = LayerRotation(r_k, r_v, clip[0], clip[1], mu(), mu())
    return OscarRotations(fp, "oscar", layers, {})


def both(model, ids, method, prefill):
    f = fast_nll(model, ids, prefill, method.fake_spec(model), return_token_nll=True)["token_nll"]
    c = cache_nll(model, ids, prefill, lambda: method.make_cache(model), progress=False, return_token_nll=True)
    return f, c["token_nll"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def peaky(request):
    # initializer_range=0.2: sharp attention, so a wrong window / wrong reconstruction shows clearly
    return tiny_model(request.param, initializer_range=0.2)


CASES = [
    ("identity", dict(sink=4, recent=8, group_size=16), 9),
    ("hadamard", dict(sink=3, recent=5, group_size=32, clip_k=0.9, clip_v=0.85), 1),
    ("artifact", dict(sink=2, recent=6, group_size=16), 20),
    ("artifact-nocenter", dict(sink=2, recent=6, group_size=16, center=False), 4),
    ("skip", dict(sink=4, recent=8, group_size=32, skip_layers=(0,)), 1),
    # retrieval heads, in the last quantized layer only: a float-noise code flip in a layer below would
    # propagate and hide what is tested (the fp heads' exact reads beside the other heads' INT2 history)
    ("artifact-fpheads", dict(sink=2, recent=6, group_size=16, retrieval_heads=((0, 1),), skip_layers=(1,)), 20),
    ("artifact-fpheads-decode", dict(sink=2, recent=6, group_size=16, retrieval_heads=((1, 1),)), 1),
    # a whole layer of INT8 heads (the default storage): no INT2 head left in it
    ("artifact-coded-layer", dict(sink=2, recent=6, group_size=16, retrieval_heads=((1, 0), (1, 1))), 1),
    # 3-bit keys with the values at a coarser group of their own (the references' storage)
    ("artifact-value-groups", dict(sink=2, recent=6, group_size=16, key_bits=3, value_group_size=32), 9),
]


@pytest.mark.parametrize("kind,cfg,prefill", CASES, ids=[c[0] for c in CASES])
def test_fast_equals_token_by_token_tiny(peaky, kind, cfg, prefill):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 64))
    if kind.startswith("artifact"):
        method = OscarFamily("oscar", rotations=random_artifact(peaky), **cfg)
    else:
        method = get_method("identity" if kind == "skip" else kind, **cfg)
    f, c = both(peaky, ids, method, prefill)
    fp = fast_nll(peaky, ids, prefill, None, return_token_nll=True)["token_nll"]
    assert f.shape == c.shape == (64 - prefill,)
    assert (f - c).abs().max() < 2e-5, (f - c).abs().max()
    assert (f - fp).abs().max() > 1e-2  # the quantization is visible, so the equality is not vacuous


def test_wrong_window_rule_is_detected(peaky, monkeypatch):
    """Negative control: shifting the recent window by one token breaks the equality."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 64))
    method = get_method("identity", sink=4, recent=8, group_size=16)
    _, c = both(peaky, ids, method, 9)
    monkeypatch.setattr(methods_mod, "window_exact_mask", lambda n, p, s, r, d=None: window_exact_mask(n, p, s, r + 1, d))
    f = fast_nll(peaky, ids, 9, method.fake_spec(peaky), return_token_nll=True)["token_nll"]
    assert (f - c).abs().max() > 1e-3


def test_window_rule_matches_cache_parts():
    """The mask's quantized region is exactly the cache's history [sink, T - recent) once T - recent > sink."""
    m = window_exact_mask(40, 1, 4, 8)
    for p in range(40):
        hist = [j for j in range(p + 1) if not m[p, j]]
        want = list(range(4, p - 8)) if p - 8 > 4 else []
        assert hist == want, p


@pytest.mark.slow
def test_fast_equals_token_by_token_smollm2(smollm2):
    """Real model. Float noise (~1e-6) can flip an INT2 code or a bf16 scale, and the flip propagates
    through later quantized layers, so the full-depth check is statistical; with one layer quantized at a time
    (no flips reach a later quantized layer: with layers 0-3 together, identity flipped codes from token 48 on under
    transformers 5.23) the two paths agree per token."""
    model, tok = smollm2
    ids = evaluation_ids(tok, 96)[None]
    fp = fast_nll(model, ids, 1, None, return_token_nll=True)["token_nll"]
    for name in ("identity", "hadamard"):
        for layer in range(4):
            method = get_method(name, sink=4, recent=8, group_size=32,
                                skip_layers=tuple(i for i in range(30) if i != layer))
            f, c = both(model, ids, method, 1)
            # (a flipped code moves a token's NLL by ~2e-3: 0.00205 at layer 2 with one thread a worker, CI's setting;
            # quantizing the layer moves it by > 5e-2, checked below)
            assert (f - c).abs().max() < 5e-3, (name, layer, (f - c).abs().max())
            assert abs(f.mean() - c.mean()) / c.mean() < 1e-4
            assert (f - fp).abs().max() > 5e-2, (name, layer)  # quantizing the layer is visible
    method = get_method("hadamard", sink=8, recent=16, group_size=32)
    f, c = both(model, ids, method, 1)
    rel = abs(f.mean() - c.mean()) / c.mean()
    effect = abs(f.mean() - fp.mean()) / fp.mean()
    assert rel < 2e-3 and rel < 0.2 * effect, (rel, effect)


def test_perplexity_runner_windows_and_bits():
    model = tiny_model("llama", initializer_range=0.2)
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (200,))
    m = get_method("hadamard", sink=4, recent=16, group_size=32)
    r = perplexity(model, ids, m, context_len=64, n_windows=3, progress=False)
    assert r["tokens"] == 3 * 63 and len(r["window_ppl"]) == 3
    assert math.isclose(math.log(r["ppl"]), r["nll"], rel_tol=1e-9)
    # the runner's windows are consecutive: window 1 alone gives the runner's second window ppl
    r1 = perplexity(model, ids[64:128], m, context_len=64, n_windows=1, progress=False)
    assert math.isclose(r1["ppl"], r["window_ppl"][1], rel_tol=1e-6)
    # exact path agrees with the fast one
    r2 = perplexity(model, ids[64:128], m, context_len=64, n_windows=1, exact=True, progress=False)
    assert math.isclose(r1["ppl"], r2["ppl"], rel_tol=1e-4)
    with pytest.raises(ValueError):
        perplexity(model, ids, m, context_len=64, n_windows=4, progress=False)


def test_bits_match_memory_report():
    """Effective bits counted by the methods = OscarCache.memory_report() on a bf16 model."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    for cfg in (dict(sink=4, recent=8, group_size=16), dict(sink=2, recent=40, group_size=32)):
        m = get_method("hadamard", **cfg)
        cache = m.make_cache(model)
        for T in (30, 57):
            cache = m.make_cache(model)
            with torch.no_grad():
                model(torch.randint(0, 256, (1, T)), **cache_kwargs(model, cache), use_cache=True)
            assert math.isclose(cache.memory_report()["bits_per_element"], m.bits(T, 32), rel_tol=1e-9), (cfg, T)


def test_default_perplexity_rows_count_the_heads_storage(tmp_path, monkeypatch):
    """The defaults' CLI: BF16, the user's cache (INT8 retrieval heads) and the heads' other storages, token by token
    through the real cache; each row's history bits follow its storage, and the report names the target."""
    from oscar_hf.eval import default_perplexity

    m = tiny_model("llama", head_dim=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    rot = random_artifact(m)
    scores = torch.zeros(4, 4)
    scores[0, 1], scores[2, 3], scores[3, 0] = 0.9, 0.7, 0.5  # three heads pass the 0.4 threshold
    rot.retrieval_scores = scores
    rot.save_pretrained(tmp_path / "art")
    monkeypatch.setattr(default_perplexity, "load_ids",
                        lambda tok, text, n: torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(3)))
    res = default_perplexity.main(["--artifact", str(tmp_path / "art"), "--context", "400", "--windows", "1",
                                   "--rows", "no-heads,int4-heads,bf16-heads", "--dtype", "float32",
                                   "--out", str(tmp_path), "--name", "ppl"], model=m, tokenizer=object())
    rows = {name: r["wikitext"] for name, r in res["rows"].items()}
    # 16 KV heads at 2.5 bits (INT2 rows, group 64) and a 3.0-bit cap: room for 1 INT8 head (8.5 bits), 4 INT4 heads
    # (4.5; three pass the threshold), no BF16 head (16)
    for name, bits, heads in (("defaults (artifact, auto heads)", 8.5, [[0, 1]]),
                              ("artifact, retrieval_heads=0", 0, []),
                              ("artifact, auto heads as INT4", 4.5, [[0, 1], [2, 3], [3, 0]]),
                              ("artifact, auto heads in BF16", 16, [])):
        assert rows[name]["retrieval_heads"] == heads, name
        assert rows[name]["history_bits"] == pytest.approx(((16 - len(heads)) * 2.5 + len(heads) * bits) / 16)
    assert all(r[t]["tokens"] == 399 and r[t]["ppl"] > 1 for r in res["rows"].values() for t in res["texts"])
    assert "| artifact, auto heads in BF16 |" in (tmp_path / "ppl.md").read_text()
    with pytest.raises(ValueError, match="unknown --rows"):
        default_perplexity.main(["--artifact", str(tmp_path / "art"), "--rows", "int2-heads", "--out", str(tmp_path)],
                                model=m, tokenizer=object())


def test_fast_equals_token_by_token_head_dim_256_one_kv_head():
    """The shapes nobody tuned the defaults on: head_dim 256 (4 groups of 64 per head), one KV head per layer,
    sliding and full-attention layers (Gemma 3). The artifact's best-scoring full layer keeps its only head as INT8
    codes (the default storage: a whole layer with no INT2 head), the other full layer is INT2, the sliding layers are
    Transformers' own; the fake-quant view equals decoding token by token through that cache."""
    model = tiny_model("gemma3_text", head_dim=256, num_attention_heads=2, num_key_value_heads=1, hidden_size=128,
                       num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                       query_pre_attn_scalar=256, initializer_range=0.2)
    rot = random_artifact(model)
    rot.retrieval_scores = torch.tensor([[0.0], [0.9], [0.0], [0.6]])  # the full layers 1 and 3 pass 0.4
    # 2 quantized KV heads: INT2 rows 2.5 bits, an INT8 head 8 + 32 / 256 = 8.125; a 6.0-bit cap keeps one
    method = OscarFamily("oscar", rotations=rot, sink=2, recent=6, group_size=64, max_history_bits=6.0)
    cache = method.make_cache(model)
    assert cache.oscar_config.retrieval_heads == ((1, 0),) and cache.oscar_config.retrieval_bits == 8
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        model(ids[:, :40], **cache_kwargs(model, cache))
    assert cache.layers[1].q_heads == () and cache.layers[1].retrieval_heads == (0,) and cache.layers[3].q_heads == (0,)
    assert not isinstance(cache.layers[0], OscarLayer) and not isinstance(cache.layers[2], OscarLayer)  # sliding
    assert cache.memory_report()["history_bits_per_element"] == pytest.approx((2.5 + 8.125) / 2)
    f, c = both(model, ids, method, 20)
    fp = fast_nll(model, ids, 20, None, return_token_nll=True)["token_nll"]
    assert (f - c).abs().max() < 2e-5, (f - c).abs().max()
    assert (f - fp).abs().max() > 1e-3  # the quantization is visible, so the equality is not vacuous


def test_fast_nll_fills_a_given_cache_for_generating_after_the_text(peaky):
    from transformers import DynamicCache

    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 40))
    plain = fast_nll(peaky, ids, 8, None, return_token_nll=True)["token_nll"]
    cache = DynamicCache(config=peaky.config)
    filled = fast_nll(peaky, ids, 8, None, return_token_nll=True, cache=cache)["token_nll"]
    assert torch.equal(plain, filled) and cache.get_seq_length() == 40
    # the cache continues the text as a fresh forward over it would
    nxt = torch.randint(0, 256, (1, 1))
    step = peaky(nxt, **cache_kwargs(peaky, cache), use_cache=True).logits[:, -1]
    whole = peaky(torch.cat([ids, nxt], 1), use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="spec=None"):
        fast_nll(peaky, ids, 8, get_method("identity", sink=4, recent=8, group_size=16).fake_spec(peaky), cache=cache)
