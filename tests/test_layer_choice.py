"""The layer choice (``oscar_hf.layer_choice.choose_layers``): one function decides, for the cache, the paged store and
the evaluation methods, which layers are quantized and which KV heads are retrieval heads; and it warns when a cache
keeps smaller full-precision windows than its artifact chose."""
from __future__ import annotations

import warnings

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache import OscarLayer
from oscar_hf.eval.methods import OscarSpec
from oscar_hf.layer_choice import WindowsWarning, choose_layers, window_shortfall

from tiny_models import tiny_model


@pytest.fixture(scope="module")
def tiny_and_rotations():
    model = tiny_model("llama")
    rot = OscarCache(model, method="hadamard").rotations
    n, hk = rot.fingerprint.num_layers, rot.fingerprint.num_key_value_heads
    rot.retrieval_scores = torch.zeros(n, hk)
    rot.retrieval_scores[0, hk - 1] = 0.9  # one retrieval head scoring above the threshold
    return model, rot


@pytest.mark.parametrize("kw, quantized, heads", [
    (dict(skip_layers=(-1,), retrieval_heads=((0, 1), (1, 0))), [0], {0: (1,)}),  # layer 1 skipped: no heads there
    (dict(retrieval_heads=((1, 0), (1, 1)), retrieval_bits=16), [0], {1: (0, 1)}),  # layer 1 exact
    (dict(retrieval_heads=((1, 0), (1, 1)), retrieval_bits=8), [0, 1], {1: (0, 1)}),  # INT8: stays OSCAR
])
def test_cache_and_fake_quant_build_what_the_choice_says(tiny_and_rotations, kw, quantized, heads):
    model, rot = tiny_and_rotations  # 2 layers x 2 KV heads of 32
    config = OscarConfig(group_size=32, **kw)
    choice = choose_layers(model, rot, config)
    assert list(choice.quantized_layers) == quantized and choice.retrieval_heads == heads
    cache = OscarCache(model, rot, config, compile=False)
    assert [i for i, x in enumerate(cache.layers) if isinstance(x, OscarLayer)] == quantized
    assert {i: cache.layers[i].retrieval_heads for i in quantized if cache.layers[i].retrieval_heads} == {
        i: h for i, h in heads.items() if i in quantized}
    assert cache.layer_choice.config == choice.config
    spec = OscarSpec(model, rot, config)
    k = torch.randn(1, 2, 5, 32)
    assert [i for i in range(2) if spec.layer_kv(i, k, k) is not None] == quantized


def test_auto_retrieval_heads_come_from_the_artifacts_scores(tiny_and_rotations):
    model, rot = tiny_and_rotations
    hk = rot.fingerprint.num_key_value_heads
    choice = choose_layers(model, rot, OscarConfig(group_size=32, max_history_bits=16.0))
    assert choice.retrieval_heads == {0: (hk - 1,)}
    assert choice.config.retrieval_heads == ((0, hk - 1),)  # named, not "auto", once resolved
    none = choose_layers(model, None, OscarConfig(group_size=32))  # built-in rotations: no scores, no retrieval heads
    assert none.retrieval_heads == {} and none.rotations.method == "hadamard"


def test_the_cache_warns_when_its_windows_are_smaller_than_the_artifact_chose(tiny_and_rotations):
    model, rot = tiny_and_rotations
    chosen = rot.__class__(rot.fingerprint, rot.method, rot.layers, {"settings": {"chosen": {"sink": 8, "recent": 32, "group_size": 32}}})
    with pytest.warns(WindowsWarning, match=r"keeps sink 8 / recent 16 .* artifact chose sink 8 / recent 32"):
        OscarCache(model, chosen, recent=16)
    with pytest.warns(WindowsWarning, match=r"keeps sink 0 / recent 32 .* chose sink 8 / recent 32"):
        OscarCache(model, chosen, OscarConfig(sink=0, recent=32, group_size=32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", WindowsWarning)
        OscarCache(model, chosen)  # the artifact's own windows
        OscarCache(model, chosen, recent=64)  # larger: fine
        OscarCache(model, rot, recent=16, group_size=32)  # an artifact that chose none
    assert window_shortfall(OscarConfig(sink=8, recent=31), chosen) is not None
    assert window_shortfall(OscarConfig(sink=9, recent=32), chosen) is None
