"""StaticOscarCache: same tokens/logits as OscarCache, tensor-only decode step, compiles without graph breaks."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache

from oscar_hf import OscarCache, StaticOscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.cache import OscarLayer

from batch_utils import cpu_compile_config, random_left_padded
from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens


def _gen(m, ids, am, cache, n=16, **kw):
    return m.generate(ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **cache_kwargs(m, cache), **kw)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_static_equals_dynamic_oscar_with_left_padding(model_type):
    m = tiny_model(model_type)
    ids, am = random_left_padded([3, 9, 20, 31])  # rows before, inside and past sink + recent (12)
    dyn = _gen(m, ids, am, OscarCache(m, **SMALL))
    cache = StaticOscarCache(m, max_cache_len=ids.shape[1] + 16, **SMALL)
    sta = _gen(m, ids, am, cache)
    assert torch.equal(sta.sequences, dyn.sequences)
    for a, b in zip(sta.scores, dyn.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    layers = [x for x in cache.layers if isinstance(x, OscarLayer)]
    assert layers and all(int(x.length) == ids.shape[1] + 15 for x in layers)
    assert all(int(x.n_hist(x.length)) > 0 for x in layers)
    assert cache.is_compileable


def test_static_decode_step_is_tensor_only_and_matches_per_step():
    """Decode one token at a time from a prefilled cache; memory report equals the dynamic cache's."""
    m = tiny_model("qwen3")
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 40))
    dyn, sta = OscarCache(m, **SMALL), StaticOscarCache(m, max_cache_len=64, **SMALL)
    with torch.no_grad():
        a = m(ids, **cache_kwargs(m, dyn)).logits[:, -1]
        b = m(ids, **cache_kwargs(m, sta)).logits[:, -1]
        torch.testing.assert_close(a, b)
        for _ in range(20):
            nxt = a.argmax(-1, keepdim=True)
            a = m(nxt, **cache_kwargs(m, dyn)).logits[:, -1]
            b = m(nxt, **cache_kwargs(m, sta)).logits[:, -1]
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    md, ms = dyn.memory_report(), sta.memory_report()
    for k in ("sink", "recent", "history_codes", "history_meta"):
        assert md[k] == ms[k], k
    assert int(sta.get_seq_length()) == dyn.get_seq_length() == 60


@pytest.mark.parametrize("windows", [dict(sink=0, recent=8), dict(sink=4, recent=1), dict(quantizer="std")])
def test_static_edge_windows_match_dynamic(windows):
    m = tiny_model("llama")
    ids, am = random_left_padded([5, 26], seed=12)
    kw = dict(SMALL, **windows)
    dyn = _gen(m, ids, am, OscarCache(m, **kw), n=10)
    sta = _gen(m, ids, am, StaticOscarCache(m, max_cache_len=ids.shape[1] + 10, **kw), n=10)
    assert torch.equal(sta.sequences, dyn.sequences)


def test_static_multi_turn_prefill_continues_like_dynamic():
    m = tiny_model("llama")
    torch.manual_seed(1)
    turn1, turn2 = torch.randint(1, 200, (1, 25)), torch.randint(1, 200, (1, 7))
    dyn, sta = OscarCache(m, **SMALL), StaticOscarCache(m, max_cache_len=80, **SMALL)
    with torch.no_grad():
        for c in (dyn, sta):
            m(turn1, **cache_kwargs(m, c))
        a = m(turn2, **cache_kwargs(m, dyn)).logits
        b = m(turn2, **cache_kwargs(m, sta)).logits
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_static_compiles_without_graph_breaks(model_type):
    """generate() auto-compiles the decode step of a compileable cache; fullgraph=True makes any
    graph break an error (CPU, eager backend; the CUDA run is the -m gpu test below). Gemma 3 mixes
    StaticSlidingWindowLayer and OscarLayer. Tokens equal the dynamic OscarCache's."""
    m = tiny_model(model_type)
    ids, am = random_left_padded([6, 30], seed=9)
    ref = _gen(m, ids, am, OscarCache(m, **SMALL), n=10)
    cc = cpu_compile_config()
    torch._dynamo.reset()
    counters.clear()
    _gen(m, ids, am, StaticCache(config=m.config, max_cache_len=ids.shape[1] + 10), n=10, compile_config=cc)
    bf16_graphs = counters["stats"]["unique_graphs"]  # Transformers' own StaticCache: 1 (Llama), 2 (Gemma 3)
    torch._dynamo.reset()
    counters.clear()
    out = _gen(m, ids, am, StaticOscarCache(m, max_cache_len=ids.shape[1] + 10, **SMALL), n=10, compile_config=cc)
    assert torch.equal(out.sequences, ref.sequences)
    assert 1 <= counters["stats"]["unique_graphs"] <= bf16_graphs, "no recompilation beyond StaticCache's own"
    assert not counters["graph_break"]


def test_static_errors():
    m = tiny_model("llama")
    with pytest.raises(ValueError, match="max_cache_len"):
        StaticOscarCache(m, max_cache_len=0, **SMALL)
    cache = StaticOscarCache(m, max_cache_len=20, **SMALL)
    with pytest.raises(ValueError, match="max_cache_len"):
        with torch.no_grad():
            m(torch.randint(1, 200, (1, 21)), **cache_kwargs(m, cache))
    with pytest.raises(NotImplementedError, match="fixed batch size"):
        cache.batch_repeat_interleave(2)


def test_the_layers_old_names_warn_and_are_the_same_classes():
    """One layer, compiled or not ("static" names only the fixed-capacity StaticOscarCache): the old names still
    import."""
    import oscar_hf.cache as cache_mod

    renamed = (("StaticOscarLayer", OscarLayer), ("StaticOscarHybridLayer", cache_mod.OscarHybridLayer),
               ("CompiledOscarLayer", OscarLayer), ("CompiledOscarHybridLayer", cache_mod.OscarHybridLayer))
    for old, new in renamed:
        with pytest.warns(FutureWarning, match=f"{old} is now {new.__name__}"):
            assert getattr(cache_mod, old) is new
    with pytest.raises(AttributeError, match="NoSuchLayer"):
        cache_mod.NoSuchLayer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantizer", ["minmax", "std"])
def test_gpu_static_kernels_and_cuda_graphs_match_reference(quantizer):
    """On the GPU: the Triton decode path of the static cache (device-side history length) equals the
    torch reference step by step, and generate's compiled decode (CUDA graphs) gives the eager tokens."""
    from batch_utils import cuda_qwen3

    m = cuda_qwen3()
    ids, am = random_left_padded([700, 1500, 2000], seed=3)
    ids, am = ids.cuda(), am.cuda()
    kw = dict(method="hadamard", group_size=64, quantizer=quantizer)
    ker, ref = StaticOscarCache(m, max_cache_len=2100, **kw), StaticOscarCache(m, max_cache_len=2100, use_kernels=False, **kw)
    with torch.no_grad():
        a = m(ids, attention_mask=am, **cache_kwargs(m, ker)).logits[:, -1].float()
        b = m(ids, attention_mask=am, **cache_kwargs(m, ref)).logits[:, -1].float()
        am_step = am
        for _ in range(8):
            nxt = b.argmax(-1, keepdim=True)
            am_step = torch.cat([am_step, torch.ones_like(nxt)], 1)
            a = m(nxt, attention_mask=am_step, **cache_kwargs(m, ker)).logits[:, -1].float()
            b = m(nxt, attention_mask=am_step, **cache_kwargs(m, ref)).logits[:, -1].float()
            assert (a - b).norm() / b.norm() < 0.02
    eager = _gen(m, ids, am, StaticOscarCache(m, max_cache_len=2100, **kw), n=24, disable_compile=True)
    torch._dynamo.reset()
    compiled = _gen(m, ids, am, StaticOscarCache(m, max_cache_len=2100, **kw), n=24)
    same = (compiled.sequences == eager.sequences).float().mean().item()
    assert same > 0.97, same


def test_static_beam_search_and_reset_reuse():
    """Beam search reorders the static buffers in place (same beams as OscarCache); reset() makes a
    used cache behave like a fresh one."""
    m = tiny_model("qwen3")
    torch.manual_seed(4)
    ids = torch.randint(1, 200, (1, 30))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **cache_kwargs(m, OscarCache(m, **SMALL)), **beams)
    got = m.generate(ids, **cache_kwargs(m, StaticOscarCache(m, max_cache_len=40, **SMALL)), **beams)
    assert torch.equal(got, ref)
    cache = StaticOscarCache(m, max_cache_len=60, **SMALL)
    first = m.generate(ids, **cache_kwargs(m, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    other = torch.randint(1, 200, (1, 30))
    cache.reset()
    m.generate(other, **cache_kwargs(m, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache.reset()
    again = m.generate(ids, **cache_kwargs(m, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(first, again)


def test_static_from_pretrained_artifact(tmp_path):
    from oscar_hf import OscarRotations

    m = tiny_model("qwen3")
    OscarRotations.builtin(m, "hadamard").save_pretrained(tmp_path / "rot")
    cache = StaticOscarCache.from_pretrained(tmp_path / "rot", m, max_cache_len=50, sink=4, recent=8, group_size=32)
    assert isinstance(cache, StaticOscarCache) and cache.capacity == 50
    ids = torch.randint(1, 200, (1, 30))
    ref = m.generate(ids, **cache_kwargs(m, OscarCache(m, **SMALL)), max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = m.generate(ids, **cache_kwargs(m, cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
