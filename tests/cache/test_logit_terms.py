"""What the model's attention adds to plain softmax attention, through OscarCache: learned attention sinks (gpt-oss's
``s_aux``, one logit per query head of a zero-valued key) and logit soft-capping (Gemma 2). Decoding token by token
through the cache (eager and compiled storage, retrieval heads or not) equals the fake-quant forward, which applies
both terms to the whole logit matrix in the user's own way, an independent computation; dropping a term breaks it."""
from __future__ import annotations

import pytest
import torch

import oscar_hf.cache.layer as layer_mod
import oscar_hf.cache.layer_eager as layer_eager
from oscar_hf import OscarCache
from oscar_hf.eval.methods import get_method
from oscar_hf.eval.perplexity import cache_nll, fast_nll

from tiny_models import tiny_model

SMALL = dict(sink=4, recent=8, group_size=16)  # the history is quantized from the 13th token on
PREFILL = 9


def _model(kind: str):
    if kind == "gpt_oss":  # sinks on every layer; sliding layers are Transformers' own, full ones OSCAR's
        model = tiny_model("gpt_oss", attn_implementation="eager", initializer_range=0.2, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
        for mod in model.modules():
            if isinstance(getattr(mod, "sinks", None), torch.Tensor):
                with torch.no_grad():  # (initialized to 0 by from_config's init? make them matter either way)
                    mod.sinks.copy_(torch.randn(mod.sinks.shape, generator=torch.Generator().manual_seed(3)) * 2 + 2)
        return model
    return tiny_model("gemma2", initializer_range=0.2, attn_logit_softcapping=2.0)


@pytest.fixture(scope="module", params=["gpt_oss", "gemma2"])
def model(request):
    return _model(request.param)


def _nll(model, ids, compile=False, **cfg):
    method = get_method("hadamard", **SMALL, **cfg)  # the fake-quant view of the same settings (retrieval heads too)
    fake = fast_nll(model, ids, PREFILL, method.fake_spec(model), return_token_nll=True)["token_nll"]
    cached = cache_nll(model, ids, PREFILL, lambda: OscarCache(model, method="hadamard", **SMALL, **cfg, compile=compile),
                       progress=False, return_token_nll=True)["token_nll"]
    return fake, cached


@pytest.mark.parametrize("cache_kw", [dict(compile=False), dict(compile=True),
                                      dict(compile=False, retrieval_heads=((1, 1),)),
                                      dict(compile=True, retrieval_heads=((1, 1),))],
                         ids=["eager", "compiled-storage", "eager-retrieval-head", "compiled-retrieval-head"])
def test_cache_equals_fake_quant(model, cache_kw):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 48))
    fake, cached = _nll(model, ids, **cache_kw)
    exact = fast_nll(model, ids, PREFILL, None, return_token_nll=True)["token_nll"]
    assert (fake - cached).abs().max() < 2e-5, (fake - cached).abs().max()
    assert (fake - exact).abs().max() > 1e-2  # the quantization is visible, so the equality is not vacuous


def test_dropping_the_term_is_detected(model, monkeypatch):
    """Negative control: the layer's eager read (decode step and multi-token forward) without the model's sinks /
    soft-capping differs from the fake-quant forward (so the equality above depends on the term being applied in the
    cache's read)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 48))
    for module in (layer_mod, layer_eager):
        monkeypatch.setattr(module, "logit_terms", lambda kwargs, hk, l: (None, None))
    fake, cached = _nll(model, ids, compile=False)
    assert (fake - cached).abs().max() > 1e-3


def test_per_token_sinks_are_refused():
    from oscar_hf.attention import OscarKV, _handler

    layer = type("L", (), {"get_mask_sizes": lambda self, l: (l, 0)})()
    kv = OscarKV(layer, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    with pytest.raises(NotImplementedError, match="per-token attention sinks"):
        _handler(None, torch.zeros(1, 2, 1, 8), kv, kv, None, base="sdpa", sinks=torch.zeros(1, 2, 1, 1))
