"""OscarCache's device-resident storage (what it uses on CUDA by itself; ``compile=True`` here on the CPU): the same
tokens as the eager OscarLayer through generate's compiled route (fullgraph, the step wrapper), capacity growing in
buckets without recompiling, and every cache operation: crop (assisted / prompt-lookup decoding), beam search,
batch ops, left padding, full-precision heads, key_offset="prefill", save/load, multi-turn and chunked prefill."""
import inspect

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from oscar_hf import OscarCache
from oscar_hf.cache import OscarLayer, StaticOscarLayer
from oscar_hf.cache import static as static_mod
from oscar_hf.compat import cache_kwargs
from oscar_hf.models import tiny_model

from batch_utils import random_left_padded

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Capacity buckets of 16 slots, so that a few decode steps cross several of them."""
    monkeypatch.setattr(static_mod, "BUCKET", 16)
    monkeypatch.setattr(static_mod, "HEADROOM", 0.0)


def _compile_config():
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True  # generate's auto-compile route on the CPU
    return cc


def _gen(m, ids, am, cache, n=16, **kw):
    return m.generate(ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **cache_kwargs(m, cache), **kw)


def _oscar_layers(cache):
    return [x for x in cache.layers if isinstance(x, StaticOscarLayer)]


def test_auto_is_eager_on_cpu_and_compile_true_gives_device_storage():
    m = tiny_model("llama")
    auto, forced = OscarCache(m, **SMALL), OscarCache(m, compile=True, **SMALL)
    assert not auto.compiled and all(isinstance(x, OscarLayer) for x in auto.layers)
    assert forced.compiled and forced.is_compileable and len(_oscar_layers(forced)) == len(forced.layers)
    with pytest.raises(ValueError, match="compile"):
        OscarCache(m, compile="yes", **SMALL)
    with pytest.raises(ValueError, match="sliding-window"):
        OscarCache(tiny_model("gemma3_text"), compile=True, **SMALL)
    with pytest.raises(ValueError, match="full precision"):
        OscarCache(m, compile=True, skip_layers=(0,), **SMALL)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_compiled_generate_equals_eager_with_growth_and_left_padding(model_type):
    m = tiny_model(model_type)
    ids, am = random_left_padded([3, 9, 20, 31])  # rows before, inside and past sink + recent
    ref = _gen(m, ids, am, OscarCache(m, **SMALL), n=40)
    cache = OscarCache(m, compile=True, **SMALL)
    torch._dynamo.reset()
    counters.clear()
    out = _gen(m, ids, am, cache, n=40, compile_config=_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    layers = _oscar_layers(cache)
    # prompt 31 -> 32 slots; 40 steps grow it to 48, then 72 (GROWTH 1.5, rounded to 16)
    assert all(x.capacity == 80 and x.host_len == 31 + 39 == int(x.length) for x in layers)
    assert cache.get_seq_length() == 70
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 2, "capacity growth must not recompile per bucket"


def test_step_wrapper_counts_each_token_once():
    """The wrapper announces one token per compiled step; a forward that falls back to eager (here: the model called
    directly with an announced layer) is not counted twice."""
    m = tiny_model("llama")
    cache = OscarCache(m, compile=True, **SMALL)
    ids = torch.randint(1, 200, (1, 20))
    with torch.no_grad():
        m(ids, **cache_kwargs(m, cache))
        step = m.get_compiled_call(None)
        assert "_step" in repr(step.func)
        for layer in _oscar_layers(cache):
            layer.advance(1)
            layer.announced = True
        m(ids[:, :1], **cache_kwargs(m, cache))
    assert all(x.host_len == 21 == int(x.length) and not x.announced for x in _oscar_layers(cache))


def test_crop_is_exact_within_the_ring_reserve():
    m = tiny_model("llama")
    torch.manual_seed(2)
    prompt, extra = torch.randint(1, 200, (2, 30)), torch.randint(1, 200, (2, 10))
    with torch.no_grad():
        a, b = OscarCache(m, compile=True, **SMALL), OscarCache(m, compile=True, **SMALL)
        m(prompt, **cache_kwargs(m, a))
        m(prompt, **cache_kwargs(m, b))
        for j in range(10):  # a: decode 10 tokens, then take them back
            m(extra[:, j : j + 1], **cache_kwargs(m, a))
        a.crop(-10)
        assert a.get_seq_length() == 30
        nxt = torch.randint(1, 200, (2, 1))
        la = m(nxt, **cache_kwargs(m, a)).logits
        lb = m(nxt, **cache_kwargs(m, b)).logits
    torch.testing.assert_close(la, lb)


def test_crop_beyond_the_reserve_refills_from_history(monkeypatch):
    """Window slots that left the ring come back from their INT2 codes (dequantized, rotated back, offset added)."""
    from oscar_hf.quant import QuantizedRows, dequantize_rows

    monkeypatch.setattr(static_mod, "RING_RESERVE", 2)
    m = tiny_model("llama")
    torch.manual_seed(3)
    prompt, extra = torch.randint(1, 200, (1, 30)), torch.randint(1, 200, (1, 12))
    with torch.no_grad():
        a = OscarCache(m, compile=True, **SMALL)
        m(prompt, **cache_kwargs(m, a))
        for j in range(12):
            m(extra[:, j : j + 1], **cache_kwargs(m, a))
        a.crop(-12)  # back to 30: window slots [21, 30) needed, ring (R = 11) holds [31, 42): all 9 from history
        layer = _oscar_layers(a)[0]
        s0, r = layer.config.sink, layer.ring
        for s in range(21, 30):
            q = QuantizedRows(*(x[:, :, s - s0 : s - s0 + 1] for x in layer.hist_k))
            want = dequantize_rows(q, layer.config.group_size) @ layer.params.r_k.transpose(-1, -2).unsqueeze(0)
            mu = layer.offsets()[0]  # hadamard builtin: no offsets
            want = want if mu is None else want + mu[None, :, None, :]
            got = layer.win_k[:, :, s0 + s % r : s0 + s % r + 1].float()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        logits = m(torch.randint(1, 200, (1, 1)), **cache_kwargs(m, a)).logits
    assert torch.isfinite(logits).all() and a.get_seq_length() == 31


def test_prompt_lookup_and_assisted_style_decoding():
    m = tiny_model("llama")
    torch.manual_seed(6)
    base = torch.randint(1, 200, (1, 12))
    ids = torch.cat([base, base, base], 1)  # repetitive: prompt lookup proposes and gets partial acceptance
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **cache_kwargs(m, OscarCache(m, **SMALL)), **kw)
    out = m.generate(ids, **cache_kwargs(m, OscarCache(m, compile=True, **SMALL)), prompt_lookup_num_tokens=4, **kw)
    assert torch.equal(out, ref)


def test_beam_search_and_batch_ops():
    m = tiny_model("qwen3")
    torch.manual_seed(4)
    ids = torch.randint(1, 200, (1, 30))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **cache_kwargs(m, OscarCache(m, **SMALL)), **beams)
    got = m.generate(ids, **cache_kwargs(m, OscarCache(m, compile=True, **SMALL)), **beams)
    assert torch.equal(got, ref)
    ids2 = torch.randint(1, 200, (2, 25))
    with torch.no_grad():
        caches = OscarCache(m, **SMALL), OscarCache(m, compile=True, **SMALL)
        for c in caches:
            m(ids2, **cache_kwargs(m, c))
            c.batch_repeat_interleave(2)
            c.batch_select_indices(torch.tensor([0, 3]))
        nxt = torch.randint(1, 200, (2, 1))
        la, lb = (m(nxt, **cache_kwargs(m, c)).logits for c in caches)
    torch.testing.assert_close(lb, la, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("extra", [dict(full_precision_heads=((0, 1), (1, 0))),  # stored as INT8 (the default)
                                   dict(full_precision_heads=((0, 1), (1, 0)), full_precision_bits=16),
                                   dict(full_precision_heads=((0, 1), (1, 0)), full_precision_bits=4),
                                   dict(full_precision_heads=((1, 0), (1, 1))),  # a whole layer of INT8 heads
                                   dict(key_offset="prefill")])
def test_full_precision_heads_and_prefill_offset_match_eager(extra):
    m = tiny_model("llama")
    ids, am = random_left_padded([7, 26], seed=12)
    kw = dict(SMALL, **extra)
    ref = _gen(m, ids, am, OscarCache(m, **kw), n=20)
    out = _gen(m, ids, am, OscarCache(m, compile=True, **kw), n=20, compile_config=_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_save_load_multi_turn_continues_exactly(tmp_path):
    m = tiny_model("llama")
    torch.manual_seed(1)
    turn1, turn2 = torch.randint(1, 200, (1, 25)), torch.randint(1, 200, (1, 7))
    with torch.no_grad():
        eager, comp = OscarCache(m, **SMALL), OscarCache(m, compile=True, **SMALL)
        for c in (eager, comp):
            m(turn1, **cache_kwargs(m, c))
            for t in turn1[0, :5]:
                m(t.view(1, 1), **cache_kwargs(m, c))
        comp.save(tmp_path / "c")
        loaded = OscarCache.load(tmp_path / "c", m)
        assert not loaded.compiled  # auto on the CPU: the eager layer, from the device layer's saved state
        eager.save(tmp_path / "e")
        loaded_dev = OscarCache.load(tmp_path / "e", m, compile=True)  # and the other way round
        assert loaded_dev.compiled
        outs = [m(turn2, **cache_kwargs(m, c)).logits for c in (eager, comp, loaded, loaded_dev)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-4, rtol=1e-4)


@pytest.mark.skipif("prefill_chunk_size" not in inspect.signature(CompileConfig).parameters
                    and not hasattr(__import__("transformers").GenerationConfig(), "prefill_chunk_size"),
                    reason="generate has no prefill_chunk_size")
def test_chunked_prefill_through_the_compiled_route():
    m = tiny_model("llama")
    ids, am = random_left_padded([40], seed=8)
    # (chunks after the first read the earlier ones from the INT2 history: compare with the eager cache, chunked too)
    ref = _gen(m, ids, am, OscarCache(m, **SMALL), n=10, prefill_chunk_size=16)
    out = _gen(m, ids, am, OscarCache(m, compile=True, **SMALL), n=10, prefill_chunk_size=16,
               compile_config=_compile_config())
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# with two retrieval heads (stored as INT8, the default); and with a whole layer of INT8 heads (no INT2 head left)
@pytest.mark.parametrize("heads", [(), ((0, 1), (2, 5)), ((0, 1),) + tuple((3, h) for h in range(8))])
def test_gpu_default_cache_compiles_with_cuda_graphs_and_matches_eager(monkeypatch, heads):
    """On CUDA the user's default call compiles (CUDA graphs, no skipped graph), grows across buckets during decode,
    and gives the eager layer's tokens (kernels on both)."""
    from batch_utils import cuda_qwen3

    monkeypatch.setattr(static_mod, "BUCKET", 256)
    m = cuda_qwen3()
    ids, am = random_left_padded([700, 1500, 2000], seed=3)
    ids, am = ids.cuda(), am.cuda()
    kw = dict(method="hadamard", group_size=64, full_precision_heads=heads or 0)
    eager = _gen(m, ids, am, OscarCache(m, compile=False, **kw), n=400)
    torch._dynamo.reset()
    counters.clear()
    cache = OscarCache(m, **kw)
    assert cache.compiled
    out = _gen(m, ids, am, cache, n=400)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # prompt 2000: 2304 slots (2000 + 256, rounded up to 256); 400 steps cross into 3584 (x1.5, rounded)
    assert _oscar_layers(cache)[0].capacity == 3584, "the decode crossed a capacity bucket"
    same = (out.sequences == eager.sequences).float().mean().item()
    assert same > 0.97, same
