"""The 8K-needle lever study (``oscar_hf.eval.key_levers``): its key quantizers are what they claim (the cache's own
rows, KIVI's per-channel groups, block means), its views replace only what they name, and the study runs end to end
on a tiny model."""
import json

import pytest
import torch

from oscar_hf import OscarConfig, OscarRotations
from oscar_hf.eval.key_levers import (BLOCK, HeadKeysExact, KeysOrValuesFrom, history_bits, levers, main,
                                      rotated_fake_quant)
from oscar_hf.eval.methods import OscarSpec
from oscar_hf.kernels.write_path import rotate_quantize_reference
from oscar_hf.quant import dequantize_rows

from test_perplexity import random_artifact
from tiny_models import tiny_model


def rows(t=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, t, 64, generator=g) * 2 + 0.5
    r = torch.linalg.qr(torch.randn(3, 64, 64, generator=g, dtype=torch.float64))[0].float()
    return x, r, 0.1 * torch.randn(3, 64, generator=g)


def n_levels(values: torch.Tensor, tol: float = 1e-3) -> int:
    """Distinct values of a 1-D tensor up to float noise (the round trip through the rotation)."""
    v = values.flatten().sort().values
    return 1 + int((v.diff() > tol).sum())


def test_token_groups_are_the_cache_rows():
    x, r, mu = rows()
    q = rotate_quantize_reference(x, r, mu, 0.8, 64, torch.bfloat16)
    cache = dequantize_rows(q, 64) @ r.transpose(-1, -2).unsqueeze(0) + mu[None, :, None, :]
    assert torch.equal(rotated_fake_quant(x, r, mu, 0.8, 2), cache)
    assert torch.equal(rotated_fake_quant(x, r, mu, 0.8, 2, group=32),
                       dequantize_rows(rotate_quantize_reference(x, r, mu, 0.8, 32, torch.bfloat16), 32)
                       @ r.transpose(-1, -2).unsqueeze(0) + mu[None, :, None, :])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_levels_per_group(bits):
    """In the rotated space: at most 2**bits values per token-group, or per channel over a block of tokens (the
    last, partial block too)."""
    x, r, mu = rows(t=100)
    rot = lambda y: (y - mu[None, :, None, :]) @ r.unsqueeze(0)  # noqa: E731
    tok = rot(rotated_fake_quant(x, r, mu, 1.0, bits))
    assert max(n_levels(row) for row in tok.reshape(-1, 64)) <= 2**bits
    ch = rot(rotated_fake_quant(x, r, mu, 1.0, bits, axis="channel"))
    for start in range(0, 100, BLOCK):
        block = ch[0, :, start : start + BLOCK]  # [H, <=BLOCK, D]
        per_channel = [n_levels(block[h, :, d]) for h in range(3) for d in range(64)]
        assert max(per_channel) <= 2**bits
    # per-channel groups follow a channel's own range; per-token groups do not (the two differ)
    assert not torch.allclose(tok, ch)


def test_block_mean_removes_a_per_block_offset():
    """A block-constant offset per channel (what RoPE's drift looks like to a 64-token block) costs the per-token
    groups range; removing each block's mean first gives it back."""
    x, r, mu = rows(t=2 * BLOCK, seed=1)
    shift = torch.zeros_like(x)
    shift[:, :, :BLOCK] = 3 * torch.randn(1, 3, 1, 64, generator=torch.Generator().manual_seed(2))
    y = x + shift
    plain = (rotated_fake_quant(y, r, mu, 1.0, 2) - y).pow(2).mean()
    centred = (rotated_fake_quant(y, r, mu, 1.0, 2, block_mean=True) - y).pow(2).mean()
    assert centred < 0.5 * plain


def test_views_replace_only_what_they_name():
    m = tiny_model("llama", head_dim=64)
    rot = random_artifact(m)
    cfg = OscarConfig(sink=4, recent=8, group_size=64, retrieval_heads=((1, 0),))
    base = OscarSpec(m, rot, cfg)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g)
    bk, bv = base.layer_kv(0, k, v)
    ek, ev = KeysOrValuesFrom(base, lambda x, lr: x, "k").layer_kv(0, k, v)
    assert torch.equal(ek, k) and torch.equal(ev, bv) and not torch.equal(bk, k)
    ek, ev = KeysOrValuesFrom(base, lambda x, lr: x, "v", layers={1}).layer_kv(0, k, v)  # another layer only
    assert torch.equal(ek, bk) and torch.equal(ev, bv)
    # layer 1: head 0 is a retrieval head, only head 1 is replaced
    bk1, bv1 = base.layer_kv(1, k, v)
    ek1, ev1 = KeysOrValuesFrom(base, lambda x, lr: x, "k").layer_kv(1, k, v)
    assert torch.equal(ek1[:, 0], bk1[:, 0]) and torch.equal(ek1[:, 1], k[:, 1]) and torch.equal(ev1, bv1)
    hk1, hv1 = HeadKeysExact(base).layer_kv(1, k, v)  # the retrieval head's keys exact, nothing else
    assert torch.equal(hk1[:, 0], k[:, 0]) and not torch.equal(bk1[:, 0], k[:, 0])
    assert torch.equal(hk1[:, 1], bk1[:, 1]) and torch.equal(hv1, bv1)
    assert torch.equal(HeadKeysExact(base).layer_kv(0, k, v)[0], bk)  # layer 0 has none
    assert history_bits(90, 8, 2.5, 2.5, 4.5) == pytest.approx((82 * 2.5 + 8 * 4.5) / 90)


def test_levers_and_report_end_to_end(tmp_path, monkeypatch):
    """Every lever builds on a tiny model with an artifact, scores short needles, and the report counts them."""
    m = tiny_model("llama", head_dim=64)
    rot = random_artifact(m)
    rot.metadata["heldout_error"] = {str(i): {"k_rel": 0.1 * (i + 1)} for i in range(m.config.num_hidden_layers)}
    cfg = OscarConfig(sink=4, recent=8, group_size=64, retrieval_heads=0, max_history_bits=16)
    specs = levers(m, rot, cfg)
    assert "per-channel keys" in specs and specs["BF16 DynamicCache"] == (None, 16.0)
    # the defaults' heads are INT8: their whole-layer lever spends INT8 heads, the other width is INT4
    assert any(k.startswith("whole INT8 layers") for k in specs) and "0 INT4 retrieval heads" in specs
    # keys in 8 levels and values in 4 at twice the group: at group 32, exactly the INT2 rows' bits
    g32 = levers(m, rot, cfg.replace(group_size=32))
    same = g32["3-bit keys, keys and values at group 64"][1]
    assert same == pytest.approx(next(b for k, (_, b) in g32.items() if k.startswith("defaults")))
    assert g32["3-bit keys, values at group 64"][1] > same and "3-bit keys, keys and values at group 128" not in specs
    layers = sorted(int(i) for i in rot.layers)  # the halves name the quantized layers
    assert f"keys exact, layers {layers[len(layers) // 2]}-{layers[-1]}" in specs
    # 3-bit keys in the deeper half: between the defaults' bits and 3-bit keys everywhere
    deep = specs[f"3-bit keys, layers {layers[len(layers) // 2]}-{layers[-1]}"][1]
    assert next(b for k, (_, b) in specs.items() if k.startswith("defaults")) < deep < specs["3-bit keys"][1]
    int4 = levers(m, rot, cfg.replace(retrieval_bits=4))
    assert any(k.startswith("whole INT4 layers") for k in int4) and "0 INT8 retrieval heads" in int4
    art = tmp_path / "art"
    rot.save_pretrained(art)

    from oscar_hf.eval import key_levers

    class Tok:
        def __call__(self, text, add_special_tokens=False, **kw):
            return {"input_ids": [ord(c) % 200 + 1 for c in text]}

        def decode(self, ids, **kw):
            return "".join(chr(i) for i in ids)

    monkeypatch.setattr(key_levers, "load_haystack", lambda tok, kind, n: torch.randint(1, 200, (n,)))
    monkeypatch.setattr("oscar_hf.eval.models.model_for_eval", lambda *a: (m, Tok(), "tiny", torch.float32))
    main(["--artifact", str(art), "--length", "300", "--trials", "1", "--depths", "0.5", "--out", str(tmp_path),
          "--name", "levers"])
    res = json.loads((tmp_path / "levers.json").read_text())
    # (main runs the artifact's own defaults: its whole-layer lever may keep other layers than this config's)
    assert res["needles"] == 1 and len(res["levers"]) == len(specs) and "per-channel keys" in res["levers"]
    assert all(0 <= r["correct"] <= 1 and r["nll"] > 0 for r in res["levers"].values())
    assert "| per-channel keys |" in (tmp_path / "levers.md").read_text()
    main(["--artifact", str(art), "--length", "300", "--trials", "1", "--depths", "0.5", "--out", str(tmp_path),
          "--name", "only", "--only", "per-channel", "--retrieval-bits", "4"])
    only = json.loads((tmp_path / "only.json").read_text())["levers"]
    assert list(only)[1].endswith("INT4 retrieval heads)")  # the defaults' row, at the width asked for
    assert list(only)[:2] == list(int4)[:2] and all("per-channel" in k for k in list(only)[2:]) and len(only) > 2
    # --perplexity: every lever's perplexity on both texts, BF16 the reference
    monkeypatch.setattr("oscar_hf.eval.default_perplexity.load_ids",
                        lambda tok, text, n: torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(4)))
    main(["--artifact", str(art), "--perplexity", "--windows", "1", "--context", "400", "--out", str(tmp_path),
          "--name", "ppl"])
    res = json.loads((tmp_path / "ppl.json").read_text())
    rows = res["levers"]
    assert len(rows) == len(specs) and res["texts"] == ["wikitext", "pydoc"]
    assert all(r[t]["tokens"] == 399 and r[t]["ppl"] > 1 for r in rows.values() for t in res["texts"])
    # (400 tokens: the window is 64 + 256, so the history holds INT2 rows) the diagnosis rows read something else
    assert rows["keys exact"]["wikitext"]["ppl"] != rows["defaults (0 INT8 retrieval heads)"]["wikitext"]["ppl"]
    assert "| per-channel keys |" in (tmp_path / "ppl.md").read_text()
