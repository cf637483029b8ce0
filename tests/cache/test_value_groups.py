"""Values at a group size of their own (``OscarConfig.value_group_size``): the bit count, the storage (the values'
metadata in ``value_meta``, the keys' in ``meta``), what the history reads back, the decode op against the
multi-token path, saving and loading, the refusals, and (GPU) the compiled step under CUDA graphs giving the eager
tokens. The decode op and the GPU case over every storage the paged store does not hold (3-bit keys too)."""
import copy

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.compat import cache_kwargs
from oscar_hf.quant import dequantize_rows, quantize_rows, rows_group_size

from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=16)  # quantizes the history after 12 tokens
VARIANTS = [dict(value_group_size=64), dict(value_group_size=32, key_bits=3)]


def _prefill_and_decode(model, ids, cache, steps):
    with torch.no_grad():
        model(ids[:, :-steps], **cache_kwargs(model, cache))
        for j in range(ids.shape[1] - steps, ids.shape[1]):
            model(ids[:, j : j + 1], **cache_kwargs(model, cache))


def test_config_bits_and_checks():
    c = OscarConfig(group_size=32, value_group_size=128, key_bits=3)
    assert c.value_group(256) == 128 and OscarConfig(group_size=None).value_group(64) == 64
    assert c.history_bits(256) == pytest.approx((3 + 32 / 32 + 2 + 32 / 128) / 2)  # bf16 scale + zero a group
    assert c.history_bits(256) < OscarConfig(group_size=32, key_bits=3).history_bits(256)
    assert c.kernels_serve(256) and not c.kernels_serve(96)  # (the dequant loop and the write kernel: powers of two)
    assert OscarConfig(group_size=64, value_group_size=64).kernels_serve(96)
    for cfg in (OscarConfig(group_size=128), OscarConfig(value_group_size=128)):  # priced only where they group D
        with pytest.raises(ValueError, match="does not divide head_dim=64"):
            cfg.history_bits(64)
    for bad in (0, -32, True, 32.0, "64"):
        with pytest.raises(ValueError, match="value_group_size"):
            OscarConfig(value_group_size=bad)
    m = tiny_model("llama", head_dim=64)
    with pytest.raises(ValueError, match="does not divide head_dim=64"):  # where head_dim is first known
        with torch.no_grad():
            m(torch.tensor([[1, 2, 3]]), **cache_kwargs(m, OscarCache(m, compile=False, value_group_size=48)))


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_cache_stores_values_at_their_own_group(kw):
    """The values' rows hold ``value_group_size`` groups and read back as the model's rotated values quantized at that
    group; the keys are stored exactly as a cache whose values share their group stores them; memory counts the
    values' metadata at their group, and allocates it."""
    torch.manual_seed(0)
    m = tiny_model("llama", head_dim=64)
    ids = torch.randint(0, m.config.vocab_size, (2, 40))
    plain = OscarCache(m, compile=False, **{**SMALL, **{k: v for k, v in kw.items() if k != "value_group_size"}})
    own = OscarCache(m, compile=False, **SMALL, **kw)
    for c in (plain, own):
        _prefill_and_decode(m, ids, c, steps=6)
    a, b = plain.layers[1], own.layers[1]
    n = 40 - 1 - 8 - 4  # history entries (the last step's demotion pending)
    assert b.meta.shape[0] == 1 and b.value_meta.shape[-1] == 64 // kw["value_group_size"]
    assert rows_group_size(b.hist_v) == kw["value_group_size"] and rows_group_size(b.hist_k) == 16
    for f in ("codes", "scale", "zero"):  # the keys alike
        assert torch.equal(getattr(a.hist_k, f)[:, :, :n], getattr(b.hist_k, f)[:, :, :n])
    from transformers import DynamicCache

    dyn = DynamicCache(config=m.config)  # the model's exact values
    with torch.no_grad():
        m(ids, **cache_kwargs(m, dyn))
    _, mu_v = b.offsets()
    v = dyn.layers[1].values[:, :, 4 : 4 + n].float()
    v_rot = (v - (0 if mu_v is None else mu_v[None, :, None])) @ b.params.r_v.unsqueeze(0)
    rel = lambda x: ((x - v_rot).pow(2).mean() / v_rot.pow(2).mean()).item()  # noqa: E731
    err = {name: rel(dequantize_rows(layer.hist_v.map(lambda t: t[:, :, :n]))) for name, layer in (("plain", a),
                                                                                                   ("own", b))}
    want = rel(dequantize_rows(quantize_rows(v_rot, kw["value_group_size"], b.params.clip_v, torch.bfloat16)))
    assert err["plain"] < err["own"] == pytest.approx(want, rel=0.05), (err, want)  # INT2 at the values' group
    ma, mb = a.memory(), b.memory()
    assert mb["history_meta"] == ma["history_meta"] * (1 + 16 / kw["value_group_size"]) / 2
    assert mb["allocated"] < ma["allocated"]


@pytest.mark.parametrize("kw", [dict(key_bits=3)] + VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_the_decode_op_reads_the_wider_storage_as_the_multi_token_path_does(kw):
    """One decode step through the decode op (its write, then its read) gives the logits of the multi-token path (the
    pending demotion, then a read of the whole history) on a copy of the same state, and both write the same rows of
    storage of 3-bit keys' high plane and of the values' own metadata."""
    torch.manual_seed(0)
    m = tiny_model("llama", head_dim=64)
    ids = torch.randint(0, m.config.vocab_size, (2, 40))
    c = OscarCache(m, compile=False, **SMALL, **kw)
    _prefill_and_decode(m, ids, c, steps=6)
    twin = copy.deepcopy(c)
    for layer in twin.layers:  # (the eager route a decode step takes under a mask that hides more than padding)
        layer._left_padding_only = lambda *a: False
    nxt = torch.tensor([[3], [7]])
    with torch.no_grad():
        op = m(nxt, **cache_kwargs(m, c)).logits
        eager = m(nxt, **cache_kwargs(m, twin)).logits
    assert torch.allclose(op, eager, atol=1e-4, rtol=1e-4)
    n = c.layers[1].host_len - 8 - 4 - 1  # (the eager route leaves this step's demotion pending for the next)
    stores = [(c.layers[1].key_hi, twin.layers[1].key_hi, 2)] if kw.get("key_bits") == 3 else []
    if "value_group_size" in kw:
        stores.append((c.layers[1].value_meta[0], twin.layers[1].value_meta[0], 2))  # [B, H2, N, D/Gv] scales
    for a, b, dim in stores:
        assert torch.equal(a.narrow(dim, 0, n), b.narrow(dim, 0, n))
        assert a.narrow(dim, n - 1, 1).any()  # (a row written by the decode steps, not zeros)


def test_save_and_load_keep_the_values_groups(tmp_path):
    torch.manual_seed(0)
    m = tiny_model("llama", head_dim=64)
    ids = torch.randint(0, m.config.vocab_size, (1, 40))
    c = OscarCache(m, compile=False, **SMALL, value_group_size=64)
    with torch.no_grad():
        m(ids, **cache_kwargs(m, c))
    c.save(tmp_path / "c")
    back = OscarCache.load(tmp_path / "c", m)
    assert back.oscar_config.value_group_size == 64
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        a = m(nxt, **cache_kwargs(m, c)).logits
        b = m(nxt, **cache_kwargs(m, back)).logits
    assert torch.allclose(a, b, atol=1e-5)
    meta = next(f for f in (tmp_path / "c").iterdir() if f.suffix == ".json")  # a config that disagrees: refused
    meta.write_text(meta.read_text().replace('"value_group_size": 64', '"value_group_size": 32'))
    with pytest.raises(ValueError, match="hist_v_scale"):
        OscarCache.load(tmp_path / "c", m)


def test_the_serving_store_holds_values_at_their_own_group():
    """The serving store keeps the values' scale and zero at their own group (pool tensors of their own, paid for in
    its pages); serving's tokens against OscarCache's: tests/serving/test_generate_batch.py."""
    from oscar_hf.serving.store import OscarPagedStore

    m = tiny_model("llama", head_dim=64)
    settings = {k: v for k, v in SMALL.items() if k != "method"}
    store = OscarPagedStore(m, None, OscarConfig(**settings, value_group_size=64), num_pages=4, page_size=16)
    same = OscarPagedStore(m, None, OscarConfig(**settings), num_pages=4, page_size=16)
    k, v = store.pool.rows(0, "k"), store.pool.rows(0, "v")
    assert (k.scale.shape[-1], v.scale.shape[-1]) == (64 // 16, 64 // 64)
    hk, layers, meta = m.config.num_key_value_heads, m.config.num_hidden_layers, store.pool.int2.scale.element_size()
    assert same.page_bytes(16) - store.page_bytes(16) == 16 * layers * hk * 2 * meta * (64 // 16 - 64 // 64)


def test_kernels_required_at_a_head_dim_they_do_not_take(monkeypatch):
    """Where the kernels would run (CUDA), 3-bit keys at head_dim 96 are refused with use_kernels=True and said once
    with 'auto'; at a power-of-two head_dim they pass."""
    import oscar_hf.cache.base as base_mod

    monkeypatch.setattr(base_mod, "triton_enabled", lambda x, use: True)
    monkeypatch.setattr(base_mod, "_SAID_REFERENCE", False)
    keys = lambda d: torch.zeros(1, 1, 2, d)  # noqa: E731
    cfg = OscarConfig(group_size=32, key_bits=3)
    base_mod.check_reference_storage(cfg.replace(use_kernels=True), keys(128))
    with pytest.raises(ValueError, match="no Triton kernels at head_dim=96"):
        base_mod.check_reference_storage(cfg.replace(use_kernels=True), keys(96))
    with pytest.warns(UserWarning, match="torch references"):
        base_mod.check_reference_storage(cfg, keys(96))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [dict(group_size=64, key_bits=3), dict(group_size=32, value_group_size=128, key_bits=3),
                                dict(group_size=32, value_group_size=128)],
                         ids=["key_bits3", "value_group128-key_bits3", "value_group128"])
def test_gpu_kernels_compiled_step_gives_the_reference_tokens(kw):
    """On the GPU: generate's compiled decode on the kernels (the dequant loop, the write kernel; use_kernels=True),
    under CUDA graphs, gives the eager references' tokens (use_kernels=False)."""
    from batch_utils import cuda_qwen3

    m = cuda_qwen3()
    torch.manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (2, 600), device="cuda")
    kw = dict(method="hadamard", sink=16, recent=64, **kw)

    def gen(cache, compile_):
        return m.generate(ids, max_new_tokens=24, do_sample=False, **cache_kwargs(m, cache),
                          **({} if compile_ else dict(disable_compile=True)))

    reference = gen(OscarCache(m, compile=False, use_kernels=False, **kw), False)
    torch._dynamo.reset()
    compiled = gen(OscarCache(m, use_kernels=True, **kw), True)
    assert (compiled == reference).float().mean().item() > 0.97
