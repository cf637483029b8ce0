"""OscarCache's compiled decode step (what it uses on CUDA by itself; ``compile=True`` here on the CPU) and the OSCAR
layer's storage, what is their own beyond the storage contract (tests/cache/test_storage_contract.py: tokens, chunked
prefill, crop, beam search, batch ops, save/load, retrieval heads): generate's compiled route (fullgraph, the step wrapper) with capacity
growing in buckets without recompiling, crop beyond the ring's reserve, prompt-lookup decoding, the retrieval heads
kept as history entries, key_offset="prefill"."""
import pytest
import torch
from torch._dynamo.utils import counters

from oscar_hf import OscarCache
from oscar_hf.cache import heads as heads_mod
from oscar_hf.cache import GrowingLayer, OscarLayer
from oscar_hf.cache import layer as compiled_mod
from oscar_hf.compat import cache_kwargs

from batch_utils import cpu_compile_config, random_left_padded
from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Capacity buckets of 16 slots, so that a few decode steps cross several of them (and no reservation of
    generate's length, which would make them fit from the start: test_generate_reserves_its_length_up_front)."""
    monkeypatch.setattr(compiled_mod, "BUCKET", 16)
    monkeypatch.setattr(compiled_mod, "HEADROOM", 0.0)
    monkeypatch.setattr(compiled_mod, "RESERVE_FACTOR", 1)


def _gen(m, ids, am, cache, n=16, **kw):
    return m.generate(ids, attention_mask=am, max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **cache_kwargs(m, cache), **kw)


def _compiled_matches_eager(m, ids, am, cache, n):
    """Greedy ``n`` tokens through ``cache`` (compile=True storage) by generate's compiled route, against the eager
    storage's: the same tokens and scores. Returns the compiled generate's dynamo counters (reset before it)."""
    ref = _gen(m, ids, am, OscarCache(m, **SMALL), n=n)
    torch._dynamo.reset()
    counters.clear()
    out = _gen(m, ids, am, cache, n=n, compile_config=cpu_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    return counters


def _oscar_layers(cache):
    return [x for x in cache.layers if isinstance(x, OscarLayer)]


def test_auto_is_eager_on_cpu_and_compile_true_gives_device_storage():
    m = tiny_model("llama")
    auto, forced = OscarCache(m, **SMALL), OscarCache(m, compile=True, **SMALL)
    assert not auto.compiled and not auto.is_compileable and all(isinstance(x, OscarLayer) for x in auto.layers)
    assert not any(x.compiled for x in auto.layers) and all(x.compiled for x in forced.layers)
    assert forced.compiled and forced.is_compileable and len(_oscar_layers(forced)) == len(forced.layers)
    # the model's compiled forward reads the property: no graph break there (fullgraph raises on one)
    reads = torch.compile(lambda c, x: x + 1 if c.is_compileable else x - 1, fullgraph=True, backend="eager")
    assert reads(forced, torch.zeros(1)).item() == 1 and reads(auto, torch.zeros(1)).item() == -1
    with pytest.raises(ValueError, match="compile"):
        OscarCache(m, compile="yes", **SMALL)


@pytest.mark.parametrize("keep", [dict(skip_layers=(0,)), dict(retrieval_heads=((1, 0), (1, 1)),
                                                                retrieval_bits=16)])
def test_compiled_generate_with_layers_kept_in_full_precision(keep):
    """skip_layers (and a layer whose every KV head is a BF16 full-precision head) in the growing compiled storage: a
    GrowingLayer beside the OSCAR layers, generate's compiled route gives the eager storage's tokens past the first
    demotion, with one graph through the capacity growth. A hybrid layer kept in full precision is refused clearly."""
    m = tiny_model("llama")
    ids, am = random_left_padded([3, 20, 31])
    cache = OscarCache(m, compile=True, **keep, **SMALL)
    kept = 0 if "skip_layers" in keep else 1
    assert isinstance(cache.layers[kept], GrowingLayer) and isinstance(cache.layers[1 - kept], OscarLayer)
    ref = _gen(m, ids, am, OscarCache(m, **keep, **SMALL), n=40)
    torch._dynamo.reset()
    counters.clear()
    out = _gen(m, ids, am, cache, n=40, compile_config=cpu_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] <= 2
    assert int(cache.layers[1 - kept].length) == cache.layers[kept].get_seq_length() == 31 + 39
    with pytest.raises(ValueError, match="hybrid"):
        OscarCache(tiny_model("falcon_h1"), compile=True, skip_layers=(0,), **SMALL)


def test_generate_reserves_its_length_up_front(monkeypatch):
    """generate tells the growing layers its max_cache_length (prompt + max_new_tokens) before the prefill: the first
    allocation holds the whole answer, so the decode step compiles once and never grows; a far-off length reserves
    at most RESERVE_FACTOR x what the prompt alone gets."""
    monkeypatch.setattr(compiled_mod, "RESERVE_FACTOR", 4)
    assert compiled_mod.capacity_for(31, 0, 70) == 80 and compiled_mod.capacity_for(31, 0, 0) == 48
    assert compiled_mod.capacity_for(31, 0, 10_000) == 4 * 48  # capped
    m = tiny_model("llama")
    ids, am = random_left_padded([3, 20, 31])
    cache = OscarCache(m, compile=True, skip_layers=(1,), **SMALL)  # an OSCAR layer and a GrowingLayer
    ref = _gen(m, ids, am, OscarCache(m, skip_layers=(1,), **SMALL), n=40)
    torch._dynamo.reset()
    counters.clear()
    out = _gen(m, ids, am, cache, n=40, compile_config=cpu_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    growing = [x for x in cache.layers if hasattr(x, "advance")]
    assert len(growing) == 2 and {x.expected_len for x in growing} == {31 + 40 - 1}  # the last token is never cached
    assert all(x.capacity == 80 for x in growing), [x.capacity for x in growing]  # 71 rounded up, not 48 -> 72 -> ...
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("heads", [(), ((1, 0),)])
def test_decode_step_computes_the_window_positions_once(heads):
    """Every OSCAR layer of a step reads the same length, left padding, window mask and history length (the layers
    step together): the step's graph takes the length and padding once and computes the rest once (StepShared), not
    once per layer, each layer brings its storage as 4 inputs (keys and values stacked in each), a layer with retrieval
    heads 3 more (their index, keys and values stacked, their metadata stacked), and calls one op (its write and
    attention); the tokens are the eager storage's."""
    import re

    m = tiny_model("llama", num_hidden_layers=3)
    ring_ops = []  # torch.remainder calls of each compiled graph: one per window mask (ring_slots)
    oscar_ops = []  # the graph's calls into OSCAR's ops: one decode op per layer, nothing else
    layer_inputs = {}  # layer index -> the names of the graph's inputs that come from that cache layer

    def count_backend(gm, example_inputs):
        ring_ops.append(sum(n.op == "call_function" and n.target is torch.remainder for n in gm.graph.nodes))
        oscar_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "oscar" in str(n.target))
        for n in gm.graph.nodes:
            hit = re.search(r"layers_(\d+)_(\w+)$", n.name) if n.op == "placeholder" else None
            if hit:
                layer_inputs.setdefault(int(hit.group(1)), set()).add(hit.group(2))
        return gm

    cc = cpu_compile_config()
    cc.backend = count_backend
    ids, am = random_left_padded([5, 14, 20])
    kw = dict(SMALL, retrieval_heads=heads, retrieval_bits=8)
    cache = OscarCache(m, compile=True, **kw)
    ref = _gen(m, ids, am, OscarCache(m, **kw), n=12)
    torch._dynamo.reset()
    out = _gen(m, ids, am, cache, n=12, compile_config=cc)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(_oscar_layers(cache)) == 3 and ring_ops == [1], ring_ops  # one graph, one mask for three layers
    assert oscar_ops == ["oscar.decode_step_.default"] * 3, oscar_ops
    assert all(x.step is cache.layers[0].step and x.step.win_mask is None for x in cache.layers)  # cleared after
    storage = {"step_storage_win", "step_storage_codes", "step_storage_meta", "params_r"}
    with_heads = storage | ({"step_heads_heads_index", "step_heads_cx", "step_heads_cmeta"} if heads else set())
    assert layer_inputs == {0: storage | {"length", "pad"}, 1: with_heads, 2: storage}, layer_inputs
    assert all(x.length is cache.layers[0].length for x in cache.layers)  # one length, advanced by the last layer
    assert [x.advances_length for x in cache.layers] == [False, False, True]
    assert int(cache.layers[0].length) == ids.shape[1] + 12 - 1  # the last token is never cached


def test_layers_share_one_length_per_device():
    """StepShared.join: the layers of one device get one length tensor, which the highest-index layer there advances
    (a model split over devices: each device's own), whatever order they join in."""
    step = compiled_mod.StepShared()

    class Layer:  # what join reads of a layer
        def __init__(self, i, device):
            self.layer_idx, self.device = i, torch.device(device)

    layers = [Layer(2, "cpu"), Layer(0, "cpu"), Layer(5, "meta"), Layer(1, "cpu"), Layer(3, "meta")]
    lengths = [step.join(x) for x in layers]
    assert lengths[0] is lengths[1] is lengths[3] and lengths[2] is lengths[4] and lengths[0] is not lengths[2]
    assert lengths[0].device.type == "cpu" and lengths[2].device.type == "meta" and lengths[0].dim() == 0
    assert [x.advances_length for x in layers] == [True, False, True, False, False]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_compiled_generate_equals_eager_with_growth_and_left_padding(model_type):
    m = tiny_model(model_type)
    ids, am = random_left_padded([3, 9, 20, 31])  # rows before, inside and past sink + recent
    cache = OscarCache(m, compile=True, **SMALL)
    counts = _compiled_matches_eager(m, ids, am, cache, n=40)
    layers = _oscar_layers(cache)
    # prompt 31 -> 32 slots; 40 steps grow it to 48, then 72 (GROWTH 1.5, rounded to 16)
    assert all(x.capacity == 80 and x.host_len == 31 + 39 == int(x.length) for x in layers)
    assert cache.get_seq_length() == 70
    assert not counts["graph_break"]
    assert counts["stats"]["unique_graphs"] <= 2, "capacity growth must not recompile per bucket"


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral", "llama4_text", "cohere2", "olmo3", "exaone4"])
def test_compiled_generate_with_sliding_layers(model_type):
    """compile=True serves a model with sliding-window layers: Transformers' StaticSlidingWindowLayer (a buffer of the
    window's width) beside the compiled OSCAR layers, the same tokens and scores as the eager storage while the window
    fills and rolls, traced at most three times (the sliding layer's length: filling, full); "auto" compiles them on
    CUDA only (tests/test_model_matrix.py checks that choice). Mistral with a sliding window: every layer sliding; Llama 4:
    chunked attention (the same cache layer, the chunking in the mask)."""
    import inspect

    from transformers import StaticSlidingWindowLayer, masking_utils

    if model_type == "llama4_text" and "block_sequence_ids" not in inspect.signature(
            masking_utils.create_chunked_causal_mask).parameters:
        pytest.skip("this Transformers (5.17) fails generate with its own StaticCache on chunked attention: "
                    "create_masks_for_generate passes create_chunked_causal_mask a block_sequence_ids it does not take")
    over = dict(sliding_window=16) if model_type == "mistral" else {}
    m = tiny_model(model_type, **over)
    ids, am = random_left_padded([9, 30])
    cache = OscarCache(m, compile=True, **SMALL)
    kinds = {type(x) for x in cache.layers}
    assert StaticSlidingWindowLayer in kinds and (model_type == "mistral") == (OscarLayer not in kinds)
    counts = _compiled_matches_eager(m, ids, am, cache, n=30)
    assert not counts["graph_break"] and counts["stats"]["unique_graphs"] <= 3
    assert not OscarCache(m, compile="auto", **SMALL).compiled  # on the CPU: the eager storage (CUDA compiles it)


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


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_crop_beyond_the_reserve_refills_from_history(monkeypatch, bits):
    """Window slots that left the ring come back from the history: the INT2 heads' codes (dequantized, rotated back,
    offset added), the retrieval heads' coded rows (decoded)."""
    from oscar_hf.quant import QuantizedRows, dequantize_rows

    monkeypatch.setattr(compiled_mod, "RING_RESERVE", 2)
    m = tiny_model("llama")
    torch.manual_seed(3)
    prompt, extra = torch.randint(1, 200, (1, 30)), torch.randint(1, 200, (1, 12))
    kw = dict(SMALL) if bits is None else dict(SMALL, retrieval_heads=((0, 1),), retrieval_bits=bits)
    with torch.no_grad():
        a = OscarCache(m, compile=True, **kw)
        m(prompt, **cache_kwargs(m, a))
        for j in range(12):
            m(extra[:, j : j + 1], **cache_kwargs(m, a))
        a.crop(-12)  # back to 30: window slots [21, 30) needed, ring (R = 11) holds [31, 42): all 9 from history
        layer = _oscar_layers(a)[0]
        s0, r, p = layer.config.sink, layer.ring, layer.params
        for s in range(21, 30):
            q = QuantizedRows(*(x[:, :, s - s0 : s - s0 + 1] for x in layer.hist_k))
            want = dequantize_rows(q, layer.config.group_size) @ p.r_k.transpose(-1, -2).unsqueeze(0)
            mu = layer.offsets()[0]  # hadamard builtin: no offsets
            want = want if mu is None else want + mu[None, :, None, :]
            got = layer.win_k[:, :, s0 + s % r : s0 + s % r + 1].float()
            torch.testing.assert_close(p.int2_part(got), want, atol=1e-5, rtol=1e-5)
            if bits is not None:  # the retrieval head: its coded row decoded, not the ring's stale entry
                coded = tuple(x[:, :, s - s0 : s - s0 + 1] for x in layer.coded_k)
                assert torch.equal(got.index_select(1, p.coded_idx), heads_mod.decode(coded, bits, torch.float32))
        logits = m(torch.randint(1, 200, (1, 1)), **cache_kwargs(m, a)).logits
    assert torch.isfinite(logits).all() and a.get_seq_length() == 31


@pytest.mark.parametrize("bits", [8, 16])
def test_retrieval_heads_are_history_entries(bits):
    """The layer keeps its retrieval heads' coded rows for the history entries only (the window holds their other
    slots), grown with the INT2 history and written by the decode step's demotion: the codes of the keys and values
    of slots [S0, T - W) (layer 0's K/V depend on the tokens only: a DynamicCache's of the whole sequence), and what
    memory() counts."""
    from transformers import DynamicCache

    m = tiny_model("llama")
    ids, am = random_left_padded([9, 30], seed=7)
    kw = dict(SMALL, retrieval_heads=((0, 1),), retrieval_bits=bits)
    cache, dyn = OscarCache(m, compile=True, **kw), DynamicCache(config=m.config)
    steps = torch.arange(5, 25).repeat(2, 1)  # [2, 20] the decoded tokens
    with torch.no_grad():
        m(ids, attention_mask=am, **cache_kwargs(m, cache))
        mask = am
        for j in range(20):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            m(steps[:, j : j + 1], attention_mask=mask, **cache_kwargs(m, cache))
        m(torch.cat([ids, steps], 1), attention_mask=mask, **cache_kwargs(m, dyn))
    layer = _oscar_layers(cache)[0]
    s0, t = layer.config.sink, layer.host_len
    n = t - layer.config.recent - s0
    # prompt 30 -> 48 slots; 20 steps grow it to 80 (buckets of 16): N = 80 - S0 - W rows, INT2 and coded alike
    assert layer.capacity == 80 and layer.coded_k[0].shape[:3] == (2, 1, 68) == layer.hist_k.codes.shape[:3]
    for coded, rows in ((layer.coded_k, dyn.layers[0].keys), (layer.coded_v, dyn.layers[0].values)):
        want = rows[:, 1:2, s0 : s0 + n]  # (every history slot: the last step demoted slot T - W)
        got = heads_mod.decode(tuple(x[:, :, :n] for x in coded), bits, torch.float32)
        step = 0 if bits == 16 else float((want.amax(-1) - want.amin(-1)).max()) / 255  # one INT8 code
        torch.testing.assert_close(got, want, atol=step / 2 + 1e-5, rtol=0)
    rows = int((n - layer.pad).clamp(min=0).sum())  # each row's history entries [pad, n)
    d = layer.head_dim
    assert layer.memory()["retrieval_heads"] == 2 * rows * heads_mod.row_bytes(bits, d, torch.float32)


def test_prompt_lookup_and_assisted_style_decoding():
    m = tiny_model("llama")
    torch.manual_seed(6)
    base = torch.randint(1, 200, (1, 12))
    ids = torch.cat([base, base, base], 1)  # repetitive: prompt lookup proposes and gets partial acceptance
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **cache_kwargs(m, OscarCache(m, **SMALL)), **kw)
    out = m.generate(ids, **cache_kwargs(m, OscarCache(m, compile=True, **SMALL)), prompt_lookup_num_tokens=4, **kw)
    assert torch.equal(out, ref)


def test_prefill_key_offset_matches_eager():
    m = tiny_model("llama")
    ids, am = random_left_padded([7, 26], seed=12)
    kw = dict(SMALL, key_offset="prefill")
    ref = _gen(m, ids, am, OscarCache(m, **kw), n=20)
    out = _gen(m, ids, am, OscarCache(m, compile=True, **kw), n=20, compile_config=cpu_compile_config())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# with two retrieval heads (stored as INT8, the default); and with a whole layer of INT8 heads (no INT2 head left)
@pytest.mark.parametrize("heads", [(), ((0, 1), (2, 5)), ((0, 1),) + tuple((3, h) for h in range(8))])
def test_gpu_default_cache_compiles_with_cuda_graphs_and_matches_eager(monkeypatch, heads):
    """On CUDA the user's default call compiles (CUDA graphs, no skipped graph), grows across buckets during decode,
    and gives the eager forwards' tokens (kernels on both)."""
    from batch_utils import cuda_qwen3

    monkeypatch.setattr(compiled_mod, "BUCKET", 256)
    m = cuda_qwen3()
    ids, am = random_left_padded([700, 1500, 2000], seed=3)
    ids, am = ids.cuda(), am.cuda()
    kw = dict(method="hadamard", group_size=64, retrieval_heads=heads or 0)
    eager = _gen(m, ids, am, OscarCache(m, compile=False, **kw), n=400)
    torch._dynamo.reset()
    counters.clear()
    cache = OscarCache(m, **kw)
    assert cache.compiled
    out = _gen(m, ids, am, cache, n=400)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # one graph a step: torch 2.11's dynamo broke it where the model reads `cache.is_compileable` while that property
    # called super() (5 graphs, ~1 ms more a step at B=1: docs/cache.md)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # prompt 2000: 2304 slots (2000 + 256, rounded up to 256); 400 steps cross into 3584 (x1.5, rounded)
    assert _oscar_layers(cache)[0].capacity == 3584, "the decode crossed a capacity bucket"
    same = (out.sequences == eager.sequences).float().mean().item()
    assert same > 0.97, same
