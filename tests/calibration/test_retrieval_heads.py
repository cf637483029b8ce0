"""Retrieval-head probes (oscar_hf.calibration.retrieval_heads) and retrieval heads in OscarCache."""
import pytest
import torch
from batch_utils import left_pad
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.cache import OscarLayer
from oscar_hf.calibration.retrieval_heads import probe_needles, retrieval_scores, top_heads

from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens
FPH = ((0, 1), (1, 0))  # tiny llama: 2 layers x 2 KV heads


class CharTok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 200 + 1 for c in text]}


def with_scores(model, scores):
    rot = OscarRotations.builtin(model, "hadamard")
    rot.retrieval_scores = torch.tensor(scores, dtype=torch.float32)
    return rot


# ------------------------------------------------------------------ probes and scores
def test_probe_places_fact_and_answer():
    tok = CharTok()
    hay = torch.arange(1, 3000) % 200 + 1
    probes = probe_needles(tok, hay, n=6, lengths=(300, 500), depths=(0.25, 0.75), seed=3)
    assert [len(p.ids) for p in probes] == [300, 300, 500, 500, 300, 300]
    for p in probes:
        text = "".join(chr(i - 1) for i in p.ids.tolist())  # CharTok is invertible on ASCII
        f0, f1 = p.fact
        fact = text[f0:f1]
        assert fact.startswith(" The access code of ") and fact.rstrip().endswith(".")
        value = fact.split(" is ")[1].rstrip(" .")
        assert text[p.answer[0] : p.answer[1]] == " " + value and p.answer[1] == len(p.ids)


def test_retrieval_scores_equal_eager_attention_mass():
    """The probe's attention mass (answer-predicting rows on the fact span, max over the KV head's query heads)
    equals the one read from the model's own eager attention probabilities."""
    m = tiny_model("llama", attn_implementation="eager")
    tok = CharTok()
    hay = torch.randint(1, 200, (2000,), generator=torch.Generator().manual_seed(0))
    probes = probe_needles(tok, hay, n=2, lengths=(300,), depths=(0.3,), seed=1)
    got = retrieval_scores(m, probes, progress=False)
    cfg = m.config
    hk, g = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    want = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads)
    with torch.no_grad():
        for p in probes:
            att = m(p.ids[None], output_attentions=True).attentions  # per layer [1, Hq, n, n]
            rows = torch.arange(p.answer[0] - 1, p.answer[1] - 1)
            for i, a in enumerate(att):
                want[i] += a[0][:, rows, p.fact[0] : p.fact[1]].sum(-1).mean(-1)
    want = (want / len(probes)).reshape(-1, hk, g).amax(-1)
    assert got.shape == (cfg.num_hidden_layers, hk)
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert top_heads(got, 1)[0] == tuple(int(x) for x in divmod(int(got.argmax()), hk))


# ------------------------------------------------------------------ the cache
def greedy(model, ids, cache, n=10, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache), pad_token_id=0, **kw)


def test_retrieval_heads_storage_and_memory():
    m = tiny_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 40))
    ref_cache = DynamicCache(config=m.config)
    greedy(m, ids, ref_cache)
    cache = OscarCache(m, **SMALL, retrieval_heads=FPH, retrieval_bits=16)  # stored in the model dtype
    out = greedy(m, ids, cache)
    t = out.shape[1] - 1
    for (li, h) in FPH:
        layer = cache.layers[li]
        assert isinstance(layer, OscarLayer) and layer.retrieval_heads == (h,) and layer.q_heads == (1 - h,)
        assert layer.hist_k.codes.shape[1] == 1  # the retrieval head is not in the INT2 history
        ref = ref_cache.layers[li]  # the prompt's slots (prefill is exact; later ones see quantized layers)
        st = layer.export_state()
        (fp_k,), (fp_v,) = st["fp_k"], st["fp_v"]  # every slot: the history entries' rows and the window's
        assert torch.equal(fp_k[:, :, :40], ref.keys[:, h : h + 1, :40])
        assert torch.equal(fp_v[:, :, :40], ref.values[:, h : h + 1, :40])
        assert fp_k[:, :, 40:t].abs().sum(-1).gt(0).all()  # and every decoded slot was written
    rep = cache.memory_report()
    d, el = m.config.head_dim, 4
    n = st["hist_k"].codes.shape[2]  # history entries (the retrieval heads' window slots are the window's)
    assert n > 0 and rep["retrieval_heads"] == len(FPH) * 2 * 2 * n * d * el  # 2 rows, K and V
    plain = OscarCache(m, **SMALL)
    greedy(m, ids, plain)
    prep = plain.memory_report()
    assert rep["history_codes"] * 2 == prep["history_codes"]  # half the heads of every layer left the history
    assert rep["total"] > prep["total"]


def test_retrieval_heads_change_outputs_and_left_padding_matches_solo_runs():
    m = tiny_model("llama", initializer_range=0.2)
    torch.manual_seed(2)
    lens = [5, 30, 41, 17]
    prompts = [torch.randint(1, 200, (n,)) for n in lens]
    ids, am = left_pad(prompts)
    kw = dict(output_scores=True, return_dict_in_generate=True)
    out = greedy(m, ids, OscarCache(m, **SMALL, retrieval_heads=FPH), attention_mask=am, **kw)
    for i, p in enumerate(prompts):
        solo = greedy(m, p[None], OscarCache(m, **SMALL, retrieval_heads=FPH), **kw)
        a = torch.stack([s[i] for s in out.scores])
        b = torch.stack([s[0] for s in solo.scores])
        assert torch.allclose(a, b, atol=2e-4), f"row {i}: {(a - b).abs().max()}"
    plain = greedy(m, ids, OscarCache(m, **SMALL), attention_mask=am, **kw)
    assert max((a - b).abs().max() for a, b in zip(out.scores, plain.scores)) > 1e-3  # the heads matter


def test_retrieval_heads_save_load_continues_exactly(tmp_path):
    m = tiny_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 40))
    cache = OscarCache(m, **SMALL, retrieval_heads=FPH)
    out1 = greedy(m, ids, cache, n=6)
    cache.save(tmp_path / "c")
    nxt = torch.cat([out1, torch.randint(1, 200, (2, 3))], 1)
    ref = greedy(m, nxt, cache, n=8)
    loaded = OscarCache.load(tmp_path / "c", m)
    assert loaded.oscar_config.retrieval_heads == FPH
    assert torch.equal(greedy(m, nxt, loaded, n=8), ref)


def test_top_k_from_artifact_scores_and_bad_input():
    m = tiny_model("llama")
    rot = with_scores(m, [[0.1, 0.9], [0.5, 0.2]])
    cache = OscarCache(m, rot, OscarConfig(**SMALL, retrieval_heads=2))
    assert cache.oscar_config.retrieval_heads == ((0, 1), (1, 0))  # resolved: the saved config names them
    assert [layer.retrieval_heads for layer in cache.layers] == [(1,), (0,)]
    whole = ((0, 0), (0, 1))  # every head of layer 0: exact -> a full-precision layer; INT8 -> no INT2 head left
    assert not isinstance(OscarCache(m, rot, OscarConfig(**SMALL, retrieval_heads=whole,
                                                         retrieval_bits=16)).layers[0], OscarLayer)
    cache = OscarCache(m, rot, OscarConfig(**SMALL, retrieval_heads=whole))
    assert isinstance(cache.layers[0], OscarLayer) and cache.layers[0].retrieval_heads == (0, 1)
    with pytest.raises(ValueError, match="retrieval scores"):
        OscarCache(m, **SMALL, retrieval_heads=1)  # built-in rotations have no scores
    with pytest.raises(ValueError, match="must lie in"):
        OscarCache(m, rot, OscarConfig(**SMALL, retrieval_heads=5))
    with pytest.raises(ValueError, match="not a \\(layer, kv_head\\)"):
        OscarCache(m, **SMALL, retrieval_heads=((0, 2),))
    with pytest.raises(ValueError, match="pairs"):
        OscarConfig(retrieval_heads=((0, "a"),))
    with pytest.raises(ValueError, match=">= 0"):
        OscarConfig(retrieval_heads=-1)
    static = StaticOscarCache(m, max_cache_len=64, **SMALL, retrieval_heads=((0, 1),))  # both storages take them
    assert static.layers[0].retrieval_heads == (1,) and static.layers[1].retrieval_heads == ()


def test_retrieval_scores_round_trip_and_validation(tmp_path):
    m = tiny_model("llama")
    rot = with_scores(m, [[0.1, 0.9], [0.5, 0.2]])
    rot.save_pretrained(tmp_path / "a")
    back = OscarRotations.from_pretrained(tmp_path / "a")
    assert torch.equal(back.retrieval_scores, rot.retrieval_scores)
    assert back.top_retrieval_heads(3) == ((0, 1), (1, 0), (1, 1))
    rot.retrieval_scores = torch.ones(3, 2)
    with pytest.raises(ValueError, match="retrieval_scores"):
        rot.save_pretrained(tmp_path / "b")
    rot.retrieval_scores = torch.tensor([[0.1, float("nan")], [0.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        rot.validate()


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter (CPU) only")
def test_retrieval_heads_with_triton_kernels_match_reference():
    """The kernels run on the quantized heads of a layer (a head subset); the result equals the torch reference."""
    m = tiny_model("llama", initializer_range=0.2)
    torch.manual_seed(3)
    ids = torch.randint(1, 200, (2, 30))
    kw = dict(output_scores=True, return_dict_in_generate=True)
    got = greedy(m, ids, OscarCache(m, **SMALL, retrieval_heads=FPH, use_kernels=True), n=4, **kw)
    ref = greedy(m, ids, OscarCache(m, **SMALL, retrieval_heads=FPH, use_kernels=False), n=4, **kw)
    for a, b in zip(got.scores, ref.scores):
        assert (a - b).abs().max() < 1e-3 * b.abs().max(), (a - b).abs().max()


def test_memory_report_history_bits_count_retrieval_heads():
    """The report's history bits average the quantized layers' KV heads, a retrieval head at its stored
    bits (16, or INT8 / INT4 codes + a 16-bit scale and zero per token and head: 8 or 4 + 32 / D)."""
    from oscar_hf.quant import bits_per_element

    m = tiny_model("llama")
    hk, d = m.config.num_key_value_heads, m.config.head_dim
    plain = OscarCache(m, **SMALL).memory_report()["history_bits_per_element"]
    assert plain == bits_per_element(d, SMALL["group_size"], torch.bfloat16)
    share = 2 / (m.config.num_hidden_layers * hk)
    for bits, head_bits in ((16, 16), (8, 8 + 32 / d), (4, 4 + 32 / d)):
        two = OscarCache(m, **SMALL, retrieval_heads=((0, 1), (1, 0)), retrieval_bits=bits)
        assert two.memory_report()["history_bits_per_element"] == pytest.approx((1 - share) * plain + share * head_bits)
