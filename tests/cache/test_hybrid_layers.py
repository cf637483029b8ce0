"""Hybrid models: linear-attention, SSM and convolution layers (``config.layer_types`` "linear_attention" / "conv")
keep Transformers' own ``LinearAttentionLayer`` in ``OscarCache``, untouched, beside the OSCAR layers of their full
attention layers, in the eager and the compiled storage (``compile=True``; the CPU runs its torch reference)."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from oscar_hf import OscarCache
from oscar_hf.cache import OscarLayer, StaticOscarLayer
from oscar_hf.compat import cache_kwargs
from oscar_hf.models import tiny_model

from batch_utils import cpu_compile_config

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens
HYBRIDS = ["qwen3_next", "jamba", "bamba", "granitemoehybrid", "lfm2"]


def _gen(m, ids, cache=None, n=8, **kw):
    kw.update(cache_kwargs(m, cache) if cache is not None else {})
    return m.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **kw)


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request):
    torch.manual_seed(0)
    return tiny_model(request.param)


def test_state_layers_are_transformers_own_and_exact_before_quantization(model):
    """Every layer type in its place; while nothing is quantized (T <= sink + recent) the output equals BF16
    DynamicCache's: the state layers see exactly what Transformers' own cache gives them."""
    cache = OscarCache(model, **SMALL)
    types = list(model.config.layer_types)
    assert [type(x) for x in cache.layers] == [OscarLayer if t == "full_attention" else LinearAttentionLayer
                                               for t in types]
    ids = torch.randint(1, 200, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = _gen(model, ids, DynamicCache(config=model.config), n=6)
    out = _gen(model, ids, cache, n=6)  # 5 + 6 <= 12
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compiled_equals_eager_past_quantization(model, tmp_path):
    """The compiled storage (StaticOscarLayer beside the state layers, generate's compiled route) gives the eager
    storage's tokens once the history is quantized, in one graph; the cache reports its memory and refuses to save."""
    ids = torch.randint(1, 200, (2, 30), generator=torch.Generator().manual_seed(2))
    ref = _gen(model, ids, OscarCache(model, **SMALL), n=12)
    cache = OscarCache(model, compile=True, **SMALL)
    assert {type(x) for x in cache.layers} == {StaticOscarLayer, LinearAttentionLayer}
    torch._dynamo.reset()
    counters.clear()
    out = _gen(model, ids, cache, n=12, compile_config=cpu_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert cache.memory_report()["history_codes"] > 0
    assert not OscarCache(model, compile="auto", **SMALL).compiled
    with pytest.raises(NotImplementedError, match="LinearAttentionLayer"):
        cache.save(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_latent_attention_is_refused_at_construction():
    """MLA (DeepSeek-V3: Transformers caches the latent, not per-head keys and values) gets a clear error when the
    cache is built, not a shape error deep inside the first forward."""
    with pytest.raises(NotImplementedError, match="latent attention"):
        OscarCache(tiny_model("deepseek_v3"), **SMALL)


def test_attention_sinks_are_refused_at_construction():
    """gpt-oss's sink logits (s_aux) are not in OSCAR's read: the cache says so when it is built for the model."""
    with pytest.raises(NotImplementedError, match="attention sinks"):
        OscarCache(tiny_model("gpt_oss", attn_implementation="eager"), **SMALL)
