"""A rotation artifact that lacks a full-attention layer: the layer stays unquantized, and OscarCache says so once."""
import torch

from oscar_hf.compat import cache_kwargs

from oscar_hf import OscarCache
from oscar_hf.rotations import OscarRotations

from tiny_models import tiny_model


def test_missing_full_attention_layers_are_named_once(caplog):
    m = tiny_model("llama", num_hidden_layers=4)
    m.config._name_or_path = "org/missing-layers"
    rot = OscarRotations.builtin(m.config, "hadamard")
    del rot.layers[1], rot.layers[3]
    with caplog.at_level("WARNING", logger="oscar_hf"):
        cache = OscarCache(m, rot, method="hadamard", sink=4, recent=8, group_size=32)
        OscarCache(m, rot, method="hadamard", sink=4, recent=8, group_size=32)  # the next cache: said already
    said = [r.getMessage() for r in caplog.records if "no rotation" in r.getMessage()]
    assert said == ["OscarCache: the rotation artifact has no rotation for full-attention layers 1, 3 of "
                    "org/missing-layers: they stay unquantized, in the model's dtype (BF16), not INT2"]
    assert cache.layer_kinds() == ["oscar", "full_precision", "oscar", "full_precision"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="oscar_hf"):  # a complete artifact: nothing to say
        OscarCache(m, OscarRotations.builtin(m.config, "hadamard"), method="hadamard", sink=4, recent=8, group_size=32)
    assert not [r for r in caplog.records if "no rotation" in r.getMessage()]
    assert torch.is_tensor(m(torch.randint(1, 200, (1, 12)), **cache_kwargs(m, cache), use_cache=True).logits)
