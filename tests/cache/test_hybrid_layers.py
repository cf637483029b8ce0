"""Hybrid models: linear-attention, SSM and convolution layers (``config.layer_types`` "linear_attention" / "conv")
keep Transformers' own ``LinearAttentionLayer`` in ``OscarCache``, untouched, beside the OSCAR layers of their full
attention layers, in the eager and the compiled storage (``compile=True``; the CPU runs its torch reference; the
compiled storage's tokens past the quantization, its graph count and save's refusal: tests/test_model_matrix.py).
A "hybrid" layer (attention and a Mamba state in one decoder layer: Falcon-H1, Zamba, Zamba 2) is an OSCAR layer holding
Transformers' state beside it (``OscarHybridLayer``). Latent attention (MLA) layers, here beside linear attention
(Kimi-Linear), stay Transformers' own full-precision layers."""
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from oscar_hf import OscarCache
from oscar_hf.cache import GrowingLayer, OscarHybridLayer, OscarLayer
from oscar_hf.compat import cache_kwargs

from batch_utils import cpu_compile_config
from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens
HYBRIDS = ["qwen3_next", "jamba", "bamba", "granitemoehybrid", "lfm2", "falcon_h1", "zamba", "zamba2"]
OSCAR = {"full_attention": OscarLayer, "hybrid": OscarHybridLayer}  # by config.layer_types; else LinearAttentionLayer


def _gen(m, ids, cache=None, n=8, **kw):
    kw.update(cache_kwargs(m, cache) if cache is not None else {})
    return m.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **kw)


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request):
    torch.manual_seed(0)
    return tiny_model(request.param)


def test_state_layers_are_transformers_own_and_exact_before_quantization(model):
    """Every layer type in its place, in both storages; while nothing is quantized (T <= sink + recent) the output
    equals BF16 DynamicCache's: the state layers see exactly what Transformers' own cache gives them."""
    cache = OscarCache(model, **SMALL)
    types = list(model.config.layer_types)
    assert [type(x) for x in cache.layers] == [OSCAR.get(t, LinearAttentionLayer) for t in types]
    compiled = OscarCache(model, compile=True, **SMALL)
    assert [type(x) for x in compiled.layers] == [OSCAR.get(t, LinearAttentionLayer) for t in types]
    assert [getattr(x, "compiled", None) for x in compiled.layers] == [True if t in OSCAR else None for t in types]
    assert not OscarCache(model, compile="auto", **SMALL).compiled
    ids = torch.randint(1, 200, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = _gen(model, ids, DynamicCache(config=model.config), n=6)
    out = _gen(model, ids, cache, n=6)  # 5 + 6 <= 12
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_linear"])
def test_latent_attention_layers_are_transformers_own(model_type, caplog):
    """MLA (Transformers caches the latent and expands it through kv_b_proj at every step): its layers are
    Transformers' own full-precision layers (eager: DynamicLayer; compiled: GrowingLayer), so both storages give
    DynamicCache's tokens past sink + recent too (nothing is quantized), and the cache says why once."""
    from transformers import DynamicLayer

    m = tiny_model(model_type)
    ids = torch.randint(1, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _gen(m, ids, DynamicCache(config=m.config), n=8)
    with caplog.at_level("DEBUG", logger="oscar_hf"):
        eager = OscarCache(m, **SMALL)
    assert sum("latent" in r.getMessage() for r in caplog.records) == 1
    compiled = OscarCache(m, compile=True, **SMALL)
    latent = [t != "linear_attention" for t in getattr(m.config, "layer_types", None) or ["full_attention"] * 2]
    assert [type(x) for x in eager.layers] == [DynamicLayer if a else LinearAttentionLayer for a in latent]
    assert [type(x) for x in compiled.layers] == [GrowingLayer if a else LinearAttentionLayer for a in latent]
    torch._dynamo.reset()
    for cache, kw in ((eager, {}), (compiled, dict(compile_config=cpu_compile_config()))):
        out = _gen(m, ids, cache, n=8, **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert eager.memory_report()["latent_layers"] == sum(latent)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_a_hybrid_layer_counts_its_attention_tokens(compile_):
    """A hybrid layer's length is its attention's (Transformers 5.25 gives ``LinearAttentionLayer`` a count of its
    own, kept by the state updates, which came first in the method order): attention tokens written with no state
    update are counted, as an int, as the OSCAR layer counts them."""
    m = tiny_model("falcon_h1")
    cache = OscarCache(m, compile=compile_, **SMALL)
    i = next(i for i, layer in enumerate(cache.layers) if isinstance(layer, OscarHybridLayer))
    text = m.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    k = torch.randn(1, text.num_key_value_heads, 17, head_dim)
    cache.update(k, k.clone(), i)
    layer = cache.layers[i]
    assert layer.get_seq_length() == OscarLayer.get_seq_length(layer) == 17
    assert isinstance(layer.get_seq_length(), int) and cache.get_seq_length(i) == 17


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_a_hybrid_layer_is_croppable_as_its_state_is(compile_):
    """Whether a hybrid layer can be cropped is its state's answer (on Transformers 5.17 a property: False once the
    layer holds recurrent states, which crop cannot roll back), not the OSCAR layer's ``True``: assisted decoding
    would otherwise crop a Mamba state."""
    m = tiny_model("falcon_h1")
    ids = torch.randint(3, m.config.vocab_size, (1, 20))
    cache = OscarCache(m, compile=compile_, **SMALL)
    with torch.no_grad():
        m(ids, **cache_kwargs(m, cache))
    layer = next(x for x in cache.layers if isinstance(x, OscarHybridLayer))
    state = LinearAttentionLayer.is_croppable
    want = state.__get__(layer) if isinstance(state, property) else state
    assert layer.is_croppable is want
    assert cache.is_croppable is (want and all(x.is_croppable for x in cache.layers if x is not layer))
