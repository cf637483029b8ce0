"""A live OscarCache saved to disk and loaded back continues generation exactly."""
import json

import pytest
import torch

from oscar_hf import OscarCache, StaticOscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.cache.io import STATE_NAME, TENSORS_NAME, position_limit, weights_digest
from oscar_hf.cache.layer import capacity_for

from tiny_models import tiny_model

KW = dict(method="hadamard", sink=4, recent=8, group_size=32)


def _left_padded_batch(width: int):
    torch.manual_seed(0)
    ids = torch.zeros(2, width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate([width, width * 5 // 8]):
        ids[i, width - n :] = torch.randint(1, 200, (n,))
        am[i, width - n :] = 1
    return ids, am


def _save_mid_generation(m, cache, directory, width: int = 40):
    """Generate 6 tokens into ``cache`` after a left-padded prompt of ``width`` slots, save it; returns the next
    turn's ids (3 new prompt tokens) and the continuation's generate kwargs."""
    ids, am = _left_padded_batch(width)
    out1 = m.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0,
                      **cache_kwargs(m, cache))
    cache.save(directory)
    am2 = torch.cat([am, torch.ones(2, 6, dtype=torch.long)], 1)
    cont = dict(attention_mask=torch.cat([am2, torch.ones(2, 3, dtype=torch.long)], 1), max_new_tokens=8,
                do_sample=False, pad_token_id=0)
    return torch.cat([out1, torch.randint(1, 200, (2, 3))], 1), cont


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_save_load_continues_exactly(tmp_path, model_type):
    m = tiny_model(model_type)
    cache = OscarCache(m, **KW)
    nxt, cont = _save_mid_generation(m, cache, tmp_path / "c")
    ref = m.generate(nxt, **cache_kwargs(m, cache), **cont)
    loaded = OscarCache.load(tmp_path / "c", m)
    assert loaded.get_seq_length() == nxt.shape[1] - 4
    got = m.generate(nxt, **cache_kwargs(m, loaded), **cont)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("saved_as, model_type, width", [
    ("StaticOscarCache", "llama", 40), ("OscarCache", "llama", 40),
    ("OscarCache", "llama", 10),  # the short row's sink still in the eager layer's tail when saved
    ("OscarCache", "gemma3_text", 40),  # the sliding window (16) full when saved
    ("OscarCache", "gemma3_text", 6),  # ... filling up after loading
])
def test_static_load_continues_exactly(tmp_path, saved_as, model_type, width):
    """StaticOscarCache.load takes either class's save; its default capacity is the saved StaticOscarCache's own, or
    the saved length plus OscarCache's device-storage headroom."""
    m = tiny_model(model_type)
    cache = StaticOscarCache(m, max_cache_len=64, **KW) if saved_as == "StaticOscarCache" else OscarCache(m, **KW)
    nxt, cont = _save_mid_generation(m, cache, tmp_path / "c", width)
    saved_len = width + 5  # prompt slots (left padding included) + the generated tokens cached
    ref = m.generate(nxt, **cache_kwargs(m, cache), **cont)
    loaded = StaticOscarCache.load(tmp_path / "c", m)
    assert loaded.capacity == (64 if saved_as == "StaticOscarCache" else capacity_for(saved_len))
    assert int(loaded.get_seq_length()) == saved_len
    got = m.generate(nxt, **cache_kwargs(m, loaded), **cont)
    assert torch.equal(ref, got)
    exact = StaticOscarCache.load(tmp_path / "c", m, max_cache_len=nxt.shape[1] + 8)  # just room for the next turn
    assert exact.capacity == nxt.shape[1] + 8
    assert torch.equal(ref, m.generate(nxt, **cache_kwargs(m, exact), **cont))


def test_static_load_capacity(tmp_path):
    m = tiny_model("llama")
    cache = StaticOscarCache(m, max_cache_len=48, **KW)
    with torch.no_grad():
        m(torch.randint(1, 200, (1, 30)), **cache_kwargs(m, cache), use_cache=True)
    cache.save(tmp_path / "c")
    doc = json.loads((tmp_path / "c" / STATE_NAME).read_text())
    assert doc["max_cache_len"] == 48
    assert StaticOscarCache.load(tmp_path / "c", m, max_cache_len=30).capacity == 30
    with pytest.raises(ValueError, match="max_cache_len=29 is smaller than the saved cache, which holds 30 tokens"):
        StaticOscarCache.load(tmp_path / "c", m, max_cache_len=29)
    del doc["max_cache_len"]  # saved before the capacity was recorded: the length plus headroom
    (tmp_path / "c" / STATE_NAME).write_text(json.dumps(doc))
    assert StaticOscarCache.load(tmp_path / "c", m).capacity == capacity_for(30)
    assert OscarCache.load(tmp_path / "c", m).get_seq_length() == 30


def test_saved_cache_is_smaller_than_bf16(tmp_path):
    m = tiny_model("llama", dtype=torch.bfloat16)
    cache = OscarCache(m, **KW)
    ids = torch.randint(1, 200, (1, 600))
    with torch.no_grad():
        m(ids, **cache_kwargs(m, cache), use_cache=True)
    cache.save(tmp_path / "c")
    size = (tmp_path / "c" / TENSORS_NAME).stat().st_size
    bf16 = 2 * 2 * 2 * 600 * 32 * 2  # layers * (K,V) * kv_heads * tokens * head_dim * bytes
    assert size < bf16 / 4  # 3 bits per history element at G=32, plus 12 full-precision window slots


def test_corrupted_saved_cache_is_refused(tmp_path):
    m = tiny_model("llama")
    cache = OscarCache(m, **KW)
    with torch.no_grad():
        m(torch.randint(1, 200, (1, 30)), **cache_kwargs(m, cache), use_cache=True)
    cache.save(tmp_path / "c")
    doc = json.loads((tmp_path / "c" / STATE_NAME).read_text())
    doc["layers"][0]["seq_len"] = 31  # positions that do not match the tensors
    (tmp_path / "c" / STATE_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="tail_k"):
        OscarCache.load(tmp_path / "c", m)
    with pytest.raises(ValueError, match="another model"):
        OscarCache.load(tmp_path / "c", tiny_model("llama", num_hidden_layers=3))
    with pytest.raises(OSError, match="not a saved OscarCache"):
        OscarCache.load(tmp_path / "nope", m)


def _saved(tmp_path, m=None, cls=OscarCache, **kw):
    m = m or tiny_model("llama")
    cache = cls(m, **KW, **kw)
    with torch.no_grad():
        m(torch.randint(1, 200, (1, 30)), **cache_kwargs(m, cache), use_cache=True)
    cache.save(tmp_path / "c")
    return m, tmp_path / "c"


def _edit_json(path, edit):
    doc = json.loads((path / STATE_NAME).read_text())
    edit(doc)
    (path / STATE_NAME).write_text(json.dumps(doc))


def test_cache_from_other_weights_is_refused(tmp_path):
    """Same shapes, other weights (a fine-tune, another seed): refused, naming both; the digest ignores the dtype."""
    m, path = _saved(tmp_path)
    other = tiny_model("llama", seed=1)
    other.config._name_or_path = "org/finetune"
    with pytest.raises(ValueError, match=r"saved from other weights.*saved from 'LlamaForCausalLM' \(weights [0-9a-f]{16}"
                                         r"\), loading into 'org/finetune' \(weights [0-9a-f]{16}\)"):
        OscarCache.load(path, other)
    with pytest.raises(ValueError, match="saved from other weights"):
        StaticOscarCache.load(path, other)
    assert weights_digest(tiny_model("llama", dtype=torch.bfloat16)) == weights_digest(m)
    OscarCache.load(path, m)  # its own model
    _edit_json(path, lambda d: d.pop("weights"))  # saved before the digest was recorded: not checkable, loads
    OscarCache.load(path, other)


@pytest.mark.parametrize("key, value", [("tail_k", float("nan")), ("hist_v_scale", float("inf")),
                                        ("sink_k", float("-inf"))])
def test_non_finite_values_are_refused(tmp_path, key, value):
    from safetensors.torch import load_file, save_file

    m, path = _saved(tmp_path)
    t = load_file(str(path / TENSORS_NAME))
    t[f"layers.1.{key}"].view(-1)[3] = value
    save_file(t, str(path / TENSORS_NAME), metadata={"format": "oscar_hf.cache"})
    for cls in (OscarCache, StaticOscarCache):
        with pytest.raises(ValueError, match=rf"tensor layers\.1\.{key} holds 1 non-finite values"):
            cls.load(path, m)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(max_cache_len=10**12), r"max_cache_len=1000000000000 exceeds the model's position limit 4096"),
    (lambda d: d["config"].update(recent=10**9), r"config.recent=1000000000 exceeds the model's position limit 4096"),
    (lambda d: d["layers"][0].update(seq_len=10**13, buf_slot0=10**13 - 12), r"seq_len=10000000000000 exceeds"),
    (lambda d: d["layers"][1].update(seq_len=4030, buf_slot0=4022, tail_start=4022),
     r"layer 1: tail_start=4022 says 4018 history rows, tensor layers.1.hist_k_codes has shape \(1, 2, 18, 8\)"),
    (lambda d: d["layers"][0].update(seq_len=40), r"seq_len=40 buf_slot0=22 say 18 window slots, tensor layers.0.tail_k"),
    (lambda d: d["layers"][0].update(batch_size=4096), r"batch_size=4096, tensor layers.0.pad holds \(1,\)"),
    (lambda d: d["layers"][0].update(seq_len="30"), r"seq_len='30' is not an integer >= 0"),
    (lambda d: d["layers"][0].update(kind="pickle"), r"layer 0: not a saved layer"),
])
def test_sizes_are_bounded_before_allocation(tmp_path, monkeypatch, edit, match):
    """Sizes read from the JSON are bounded by the model's position limit and the tensors in the file, before any
    cache is built (probes asked for 25.6 GB and 32 TB)."""
    m, path = _saved(tmp_path, cls=StaticOscarCache, max_cache_len=48)
    _edit_json(path, edit)

    def built(*a, **k):
        raise AssertionError("a cache was allocated before the sizes were checked")

    monkeypatch.setattr(StaticOscarCache, "__init__", built)
    monkeypatch.setattr(OscarCache, "__init__", built)
    for cls in (OscarCache, StaticOscarCache):
        if cls is OscarCache and "max_cache_len" in match:
            continue  # a growable cache does not use the saved capacity
        with pytest.raises(ValueError, match=match):
            cls.load(path, m)


def test_position_limit_counts_rope_scaling():
    cfg = tiny_model("llama").config
    assert position_limit(cfg) == 4096
    cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    assert position_limit(cfg) == 4 * 4096
