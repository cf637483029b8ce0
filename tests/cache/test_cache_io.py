"""A live OscarCache saved to disk and loaded back continues generation exactly."""
import json

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.models import tiny_model
from oscar_hf.cache.io import STATE_NAME, TENSORS_NAME

KW = dict(method="hadamard", sink=4, recent=8, group_size=32)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_save_load_continues_exactly(tmp_path, model_type):
    m = tiny_model(model_type)
    torch.manual_seed(0)
    lens = [40, 25]
    ids = torch.zeros(2, 40, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, 40 - n :] = torch.randint(1, 200, (n,))
        am[i, 40 - n :] = 1
    cache = OscarCache(m, **KW)
    out1 = m.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0,
                      **cache_kwargs(m, cache))
    cache.save(tmp_path / "c")
    am2 = torch.cat([am, torch.ones(2, 6, dtype=torch.long)], 1)
    cont = dict(attention_mask=torch.cat([am2, torch.ones(2, 3, dtype=torch.long)], 1), max_new_tokens=8, do_sample=False, pad_token_id=0)
    nxt = torch.cat([out1, torch.randint(1, 200, (2, 3))], 1)
    ref = m.generate(nxt, **cache_kwargs(m, cache), **cont)
    loaded = OscarCache.load(tmp_path / "c", m)
    assert loaded.get_seq_length() == out1.shape[1] - 1
    got = m.generate(nxt, **cache_kwargs(m, loaded), **cont)
    assert torch.equal(ref, got)


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
