"""One name for the retrieval heads: ``retrieval_heads`` / ``retrieval_bits``. The old keywords
(``full_precision_heads`` / ``full_precision_bits``) still work with a FutureWarning naming the new one; configs,
artifacts and saved caches written with the old field names load as they are."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.compat import cache_kwargs
from oscar_hf.config import artifact_settings
from oscar_hf.eval.methods import OscarFamily

from tiny_models import tiny_model

PAIRS = ((0, 1), (1, 0))


def test_old_keywords_warn_and_mean_the_new_fields():
    with pytest.warns(FutureWarning, match="full_precision_heads= is now retrieval_heads="):
        old = OscarConfig(full_precision_heads=PAIRS, retrieval_bits=16)
    with pytest.warns(FutureWarning, match="full_precision_bits= is now retrieval_bits="):
        assert OscarConfig(full_precision_bits=4).retrieval_bits == 4
    assert old == OscarConfig(retrieval_heads=PAIRS, retrieval_bits=16)
    with pytest.warns(FutureWarning, match="retrieval_heads="):
        assert OscarConfig().replace(full_precision_heads=3).retrieval_heads == 3
    with pytest.warns(FutureWarning, match="retrieval_heads="):
        assert OscarConfig.from_preset("paper", full_precision_heads=2).retrieval_heads == 2
    with pytest.raises(TypeError, match="not both"):
        OscarConfig(full_precision_heads=1, retrieval_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = OscarConfig(retrieval_heads=PAIRS)  # the new names: no warning
    with pytest.warns(FutureWarning, match=r"OscarConfig.full_precision_heads is now OscarConfig.retrieval_heads"):
        assert new.full_precision_heads == PAIRS  # read by code not yet renamed
    with pytest.warns(FutureWarning, match=r"OscarConfig.full_precision_bits is now OscarConfig.retrieval_bits"):
        assert new.full_precision_bits == new.retrieval_bits


def test_saved_configs_and_artifacts_with_old_names_load_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        c = OscarConfig.from_dict({"full_precision_heads": [[0, 1]], "full_precision_bits": 16})
        chosen = artifact_settings({"settings": {"chosen": {"sink": 8, "full_precision_heads": [[1, 0]],
                                                            "full_precision_bits": 4}}})
    assert c.retrieval_heads == ((0, 1),) and c.retrieval_bits == 16
    assert chosen == {"sink": 8, "retrieval_heads": ((1, 0),), "retrieval_bits": 4}
    assert OscarConfig.from_dict(OscarConfig(retrieval_heads=PAIRS).to_dict()).retrieval_heads == PAIRS


def test_cache_and_eval_row_take_either_name():
    m = tiny_model("llama")
    kw = dict(method="hadamard", sink=4, recent=8, group_size=32)
    with pytest.warns(FutureWarning, match="retrieval_heads="):
        old = OscarCache(m, full_precision_heads=PAIRS, **kw)
    new = OscarCache(m, retrieval_heads=PAIRS, **kw)
    assert [getattr(x, "retrieval_heads", None) for x in old.layers] == [getattr(x, "retrieval_heads", None) for x in new.layers]
    assert new.layer_choice.retrieval_heads == {0: (1,), 1: (0,)}
    with pytest.warns(FutureWarning, match="layer.retrieval_heads"):  # a layer's old attribute name
        assert new.layers[0].fp_heads == new.layers[0].retrieval_heads == (1,)
    with pytest.warns(FutureWarning, match="retrieval_bits="):
        row = OscarFamily("hadamard", full_precision_bits=16, **kw)
    assert row.config.retrieval_bits == 16


def test_a_cache_saved_with_the_old_field_names_loads(tmp_path):
    m = tiny_model("llama")
    cache = OscarCache(m, method="hadamard", sink=4, recent=8, group_size=32, retrieval_heads=PAIRS)
    ids = torch.randint(1, 200, (1, 30))
    m(ids, **cache_kwargs(m, cache))
    cache.save(tmp_path / "c")
    state = tmp_path / "c" / "cache_state.json"
    doc = json.loads(state.read_text())
    cfg = doc["config"]
    cfg["full_precision_heads"], cfg["full_precision_bits"] = cfg.pop("retrieval_heads"), cfg.pop("retrieval_bits")
    state.write_text(json.dumps(doc))  # as a cache saved before the rename
    loaded = OscarCache.load(tmp_path / "c", m)
    assert loaded.oscar_config == cache.oscar_config and loaded.get_seq_length() == 30
    nxt = torch.randint(1, 200, (1, 1))
    torch.testing.assert_close(m(nxt, **cache_kwargs(m, loaded)).logits, m(nxt, **cache_kwargs(m, cache)).logits)
