"""key_offset="prefill": the INT2 history centered on each sequence's own key mean (OscarConfig.key_offset).

The exactness of attention with a per-row offset is checked in ``test_attention.py`` (the fake-quant
reference, parametrized over ``key_offset``), the write kernel in ``tests/kernels/test_write_path.py``;
here: the offset it follows, what it buys, batch bookkeeping, serialization and refusals."""
import json

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, StaticOscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.quant import dequantize_rows
from oscar_hf.cache.io import STATE_NAME

from tiny_models import tiny_model

KW = dict(method="hadamard", sink=4, recent=8, group_size=32)


def _prompt(b=2, t=48, pads=(0, 11), seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(1, 200, (b, t))
    am = torch.ones_like(ids)
    for i, p in enumerate(pads):
        am[i, :p] = 0
    return ids, am


def _history_error(key_offset):
    """Relative error of layer 0's reconstructed history keys for keys with a large per-sequence offset."""
    m = tiny_model("llama")
    cache = OscarCache(m, **KW, key_offset=key_offset)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    b, hk, t, d = 2, m.config.num_key_value_heads, 64, m.config.head_dim
    k = torch.randn(b, hk, t, d, generator=gen) + 6 * torch.randn(b, hk, 1, d, generator=gen)
    layer.write(k, torch.randn(b, hk, t, d, generator=gen))
    hist_k = layer.export_state()["hist_k"]
    mu = layer.offsets()[0]
    mu = torch.zeros(b, hk, d) if mu is None else (mu.expand(b, hk, d) if mu.dim() == 2 else mu)
    rec = dequantize_rows(hist_k, KW["group_size"]) @ layer.params.r_k.transpose(-1, -2)[None] + mu[:, :, None]
    s0 = KW["sink"]
    ref = k[:, :, s0 : s0 + hist_k.codes.shape[2]]
    return ((rec - ref).norm() / ref.norm()).item(), layer, k


def test_prefill_offset_is_the_sequence_mean_and_cuts_history_error():
    err_cal, _, _ = _history_error("calibrated")  # Hadamard artifact-free: no key offset at all
    err_pre, layer, k = _history_error("prefill")
    s0, n = KW["sink"], layer.export_state()["hist_k"].codes.shape[2]
    torch.testing.assert_close(layer.mu_k_seq, k[:, :, s0 : s0 + n].mean(2))  # the demoted slots' mean
    assert err_pre < 0.5 * err_cal, (err_pre, err_cal)


def test_generate_batch_ops_and_padding_rows():
    m = tiny_model("llama")
    ids, am = _prompt(pads=(0, 45))  # row 1 has no non-sink history slot at the first demotion
    cache = OscarCache(m, **KW, key_offset="prefill")
    m.generate(ids, attention_mask=am, **cache_kwargs(m, cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    layer = cache.layers[0]
    assert layer.mu_k_seq.shape == (2, m.config.num_key_value_heads, m.config.head_dim)
    assert torch.equal(layer.mu_k_seq[1], torch.zeros_like(layer.mu_k_seq[1]))  # fallback: no calibrated mu_K
    before = layer.mu_k_seq.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.mu_k_seq, before.flip(0))
    cache.batch_repeat_interleave(2)
    assert layer.mu_k_seq.shape[0] == 4 and torch.equal(layer.mu_k_seq[2], before[0])
    cache.reset()
    assert layer.mu_k_seq is None
    out = m.generate(ids, attention_mask=am, **cache_kwargs(m, cache), max_new_tokens=2, num_beams=2, do_sample=False,
                     pad_token_id=0)
    assert out.shape == (2, ids.shape[1] + 2)


def test_save_load_continues_exactly_and_refuses_a_mismatched_state(tmp_path):
    m = tiny_model("llama")
    ids, am = _prompt(pads=(0, 7))
    cache = OscarCache(m, **KW, key_offset="prefill")
    out1 = m.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0,
                      **cache_kwargs(m, cache))
    cache.save(tmp_path / "c")
    cont = dict(attention_mask=torch.cat([am, torch.ones(2, 4, dtype=torch.long)], 1), max_new_tokens=6,
                do_sample=False, pad_token_id=0)
    ref = m.generate(out1, **cache_kwargs(m, cache), **cont)
    loaded = OscarCache.load(tmp_path / "c", m)
    assert torch.equal(loaded.layers[0].mu_k_seq, cache.layers[0].mu_k_seq)
    assert torch.equal(m.generate(out1, **cache_kwargs(m, loaded), **cont), ref)
    doc = json.loads((tmp_path / "c" / STATE_NAME).read_text())
    doc["config"]["key_offset"] = "calibrated"
    (tmp_path / "c" / STATE_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="per-sequence key means"):
        OscarCache.load(tmp_path / "c", m)


def test_refusals():
    with pytest.raises(ValueError, match="key_offset"):
        OscarConfig(key_offset="mean")
    m = tiny_model("llama")
    from oscar_hf.eval.methods import OscarFamily

    fam = OscarFamily("oscar", method="hadamard", sink=4, recent=8, group_size=32, key_offset="prefill")
    with pytest.raises(NotImplementedError, match="fake-quant"):
        fam.fake_spec(m)
    from oscar_hf.eval.perplexity import perplexity

    r = perplexity(m, torch.randint(1, 200, (64,)), fam, context_len=32, n_windows=2, prefill_len=20, progress=False)
    assert r["path"] == "token-by-token" and r["tokens"] == 2 * 12
