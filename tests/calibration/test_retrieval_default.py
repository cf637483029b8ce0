"""Retrieval-safe defaults: ``calibrate()`` scores retrieval heads by default, and ``OscarConfig`` keeps
``retrieval_heads="auto"``: the heads scoring at least ``retrieval_threshold``, best first, within
``max_history_bits``; none without scores. Both cache storages run with them, the eval harness counts the same
bits as ``memory_report()``, and configs round-trip through JSON."""
import inspect
import json
import logging

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, OscarRotations, calibrate
from oscar_hf.cache import OscarLayer, resolve_retrieval_heads
from oscar_hf.calibration import calibration_report
from oscar_hf.calibration.retrieval_heads import LENGTHS, PROBES
from oscar_hf.compat import cache_kwargs
from oscar_hf.config import MAX_HISTORY_BITS, RETRIEVAL_THRESHOLD, ModelFingerprint
from oscar_hf.eval.methods import OscarFamily

from script_utils import import_script
from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens; 3.0 INT2 bits


class CharTok:
    """One token per character (ids 1..200), enough of a tokenizer for calibration and the probes."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": [ord(c) % 200 + 1 for c in text]}


def text(n_chars: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    letters = torch.randint(0, 27, (n_chars,), generator=g).tolist()
    return "".join(" " if c == 26 else chr(97 + c) for c in letters)


def scored(model, scores) -> OscarRotations:
    rot = OscarRotations.builtin(model, "hadamard")
    rot.retrieval_scores = torch.tensor(scores, dtype=torch.float32)
    return rot


def resolve(model, rot, **cfg):
    config = OscarConfig(**{**SMALL, **cfg})
    fp = ModelFingerprint.from_config(model.config)
    heads = resolve_retrieval_heads(config, rot, fp, config.skipped(fp.num_layers))
    return sorted((i, h) for i, hs in heads.items() for h in hs)


# ------------------------------------------------------------------ the auto rule
def test_defaults_are_auto_with_a_three_bit_cap():
    c = OscarConfig()
    assert c.retrieval_heads == "auto" and c.max_history_bits == MAX_HISTORY_BITS == 3.0
    assert c.retrieval_threshold == RETRIEVAL_THRESHOLD
    assert OscarConfig.reference().retrieval_heads == 0  # the authors' settings keep no head in full precision
    # SmolLM2 (head_dim 64, group 64, BF16 scale/zero: 2.5 bits): 90 KV heads leave room for 7 INT8 heads (8.5
    # bits each, the default storage) at <= 3.0 bits, 7 of its 8 retrieval heads; 3 when they are stored in BF16
    assert c.history_bits(64) == 2.5 and c.retrieval_bits == 8
    assert c.retrieval_head_budget(64, 90) == 7
    assert c.history_bits(64, 7 / 90) <= 3.0 < c.history_bits(64, 8 / 90)
    bf16 = OscarConfig(retrieval_bits=16)
    assert bf16.retrieval_head_budget(64, 90) == 3
    assert bf16.history_bits(64, 3 / 90) <= 3.0 < bf16.history_bits(64, 4 / 90)


def test_auto_keeps_heads_above_the_threshold_best_first():
    m = tiny_model("llama")  # 2 layers x 2 KV heads
    rot = scored(m, [[0.1, 0.9], [0.5, 0.39]])
    assert resolve(m, rot, max_history_bits=16) == [(0, 1), (1, 0)]  # 0.39 < 0.4: not a retrieval head
    assert resolve(m, rot, max_history_bits=16, retrieval_threshold=0.05) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert resolve(m, rot, max_history_bits=16, retrieval_threshold=0.95) == []


def test_auto_is_capped_by_the_bit_budget():
    m = tiny_model("llama")
    rot = scored(m, [[0.6, 0.9], [0.7, 0.8]])  # all four pass the threshold
    # group 32 on head_dim 32: 3.0 bits per INT2 element; one of 4 heads at 16 bits -> 6.25 bits
    bf16 = dict(retrieval_bits=16)
    assert resolve(m, rot, max_history_bits=6.24, **bf16) == []
    assert resolve(m, rot, max_history_bits=6.25, **bf16) == [(0, 1)]  # the best one
    assert resolve(m, rot, max_history_bits=9.5, **bf16) == [(0, 1), (1, 1)]  # the two best
    # stored as INT8 (the default), a head costs 8 + 2 * 16 / 32 = 9 bits: one of 4 -> 4.5 bits, two -> 6.0
    assert resolve(m, rot, max_history_bits=4.49) == []
    assert resolve(m, rot, max_history_bits=4.5) == [(0, 1)]
    assert resolve(m, rot, max_history_bits=6.0) == [(0, 1), (1, 1)]
    # as INT4, 4 + 1 = 5 bits: one of 4 -> 3.5 bits, two -> 4.0
    assert resolve(m, rot, max_history_bits=3.49, retrieval_bits=4) == []
    assert resolve(m, rot, max_history_bits=4.0, retrieval_bits=4) == [(0, 1), (1, 1)]
    assert resolve(m, rot, max_history_bits=16) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # explicit counts and pairs are not capped
    assert resolve(m, rot, retrieval_heads=3, max_history_bits=3.0) == [(0, 1), (1, 0), (1, 1)]
    assert resolve(m, rot, retrieval_heads=((1, 0),), max_history_bits=3.0) == [(1, 0)]


def test_auto_counts_only_quantized_layers():
    """A skipped layer's heads are neither chosen nor part of the budget's head count."""
    m = tiny_model("llama")
    rot = scored(m, [[0.95, 0.9], [0.7, 0.8]])
    # layer 0 skipped: 2 quantized heads; one at 16 bits -> (3 + 16) / 2 = 9.5 bits
    assert resolve(m, rot, skip_layers=(0,), max_history_bits=9.5, retrieval_bits=16) == [(1, 1)]
    assert resolve(m, rot, skip_layers=(0,), max_history_bits=9.4, retrieval_bits=16) == []


def test_auto_without_scores_gives_no_heads_and_says_so(caplog):
    m = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="oscar_hf"):
        cache = OscarCache(m, **SMALL)  # built-in Hadamard rotations: no retrieval scores
    assert all(isinstance(x, OscarLayer) and x.retrieval_heads == () for x in cache.layers)
    assert cache.oscar_config.retrieval_heads == "auto"
    assert "no retrieval scores" in caplog.text
    assert resolve(m, OscarRotations.builtin(m, "identity")) == []


@pytest.mark.parametrize("compile", [False, True])
def test_a_whole_layer_of_coded_heads_keeps_its_storage(compile):
    """A layer whose every KV head is an INT8 head (the default storage) stays an OSCAR layer with no INT2 head (not a
    BF16 layer), on both storages, and both read it alike; at 16 bits such a layer is Transformers' own full-precision
    layer."""
    m = tiny_model("llama", initializer_range=0.2)
    ids = torch.randint(1, 200, (2, 30), generator=torch.Generator().manual_seed(5))
    whole = ((1, 0), (1, 1))
    caches = {c: OscarCache(m, **SMALL, retrieval_heads=whole, compile=c) for c in (False, True)}
    cache = caches[compile]
    layer = cache.layers[1]
    assert isinstance(layer, OscarLayer) and layer.compiled == compile
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    got = {c: m.generate(ids, **kw, **cache_kwargs(m, x)) for c, x in caches.items()}
    assert layer.q_heads == () and layer.retrieval_heads == (0, 1)
    rep = cache.memory_report()
    assert rep["full_precision_layers"] == 0
    assert rep["history_bits_per_element"] == pytest.approx((2 * 3.0 + 2 * 9.0) / 4)  # INT2 rows 3.0, INT8 heads 9.0
    for a, b in zip(got[False].scores, got[True].scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert type(OscarCache(m, **SMALL, retrieval_heads=whole, retrieval_bits=16).layers[1]).__name__ == \
        "DynamicLayer"


# ------------------------------------------------------------------ config validation and round trip
@pytest.mark.parametrize("bad, match", [
    (dict(retrieval_heads="all"), "retrieval_heads"),
    (dict(retrieval_heads=True), "retrieval_heads"),
    (dict(retrieval_heads=1.5), "retrieval_heads"),
    (dict(max_history_bits=1.9), "max_history_bits"),
    (dict(max_history_bits=17), "max_history_bits"),
    (dict(max_history_bits="3"), "max_history_bits"),
    (dict(max_history_bits=float("nan")), "max_history_bits"),
    (dict(retrieval_threshold=-0.1), "retrieval_threshold"),
    (dict(retrieval_threshold=1.5), "retrieval_threshold"),
    (dict(retrieval_threshold=True), "retrieval_threshold"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        OscarConfig(**bad)


@pytest.mark.parametrize("cfg", [
    dict(), dict(retrieval_heads=0), dict(retrieval_heads=5), dict(retrieval_heads=((3, 1), (0, 2))),
    dict(max_history_bits=4, retrieval_threshold=0.25, clip_k=(0.9, 0.95), skip_layers=(-1,), group_size=None),
    dict(retrieval_bits=8),
])
def test_config_round_trips_through_json(cfg):
    c = OscarConfig(**cfg)
    back = OscarConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    assert back.to_dict() == c.to_dict()
    with pytest.raises(ValueError, match="unknown OscarConfig fields"):
        OscarConfig.from_dict({**c.to_dict(), "full_precision": 1})


def test_saved_cache_keeps_auto_or_the_chosen_heads(tmp_path):
    m = tiny_model("llama")
    ids = torch.randint(1, 200, (1, 30), generator=torch.Generator().manual_seed(0))
    cases = (("builtin", None, "auto"), ("scored", scored(m, [[0.1, 0.9], [0.5, 0.2]]), ((0, 1), (1, 0))))
    for name, rot, want in cases:
        cache = OscarCache(m, rot, **SMALL, max_history_bits=16)
        assert cache.oscar_config.retrieval_heads == want
        with torch.no_grad():
            m(ids, **cache_kwargs(m, cache))
        cache.save(tmp_path / name)
        assert OscarCache.load(tmp_path / name, m).oscar_config.retrieval_heads == want


# ------------------------------------------------------------------ calibrate() scores by default
def test_calibrate_scores_retrieval_heads_by_default(caplog):
    """The default probe count and lengths are the CLI's; the scores land in the artifact and drive "auto"."""
    sig = inspect.signature(calibrate).parameters
    assert sig["retrieval_probes"].default == PROBES == 12 and tuple(sig["retrieval_lengths"].default) == LENGTHS
    cli = import_script("calibrate").build_parser()
    assert cli.get_default("retrieval_probes") == PROBES
    assert cli.get_default("retrieval_lengths") == ",".join(map(str, LENGTHS))

    m, tok = tiny_model("llama"), CharTok()
    kw = dict(tokens=256, seq_len=128, group_size=32, clip_grid=None, window=(4, 8), progress=False)
    rot = calibrate(m, tok, text(max(LENGTHS) + PROBES + 400), **kw)  # default probes: 12, of 2048 / 4096 tokens
    s = rot.retrieval_scores
    assert s is not None and s.dtype == torch.float32 and s.shape == (2, 2)
    assert 0 < float(s.max()) <= 1 + 1e-5
    assert rot.metadata["retrieval_probes"] == {"n": PROBES, "lengths": list(LENGTHS)}
    assert "retrieval probes" in rot.metadata["calibration"]["passes"]
    assert rot.metadata["calibration"]["time_retrieval_s"] > 0
    best = divmod(int(s.argmax()), 2)
    cache = OscarCache(m, rot, group_size=32, sink=4, recent=8, retrieval_threshold=0.0, max_history_bits=6.25,
                       retrieval_bits=16)
    assert cache.oscar_config.retrieval_heads == (best,)  # the best-scoring head, within the budget
    assert "retrieval heads (layer:kv_head score)" in calibration_report(rot)

    assert calibrate(m, tok, text(600), retrieval_probes=0, **kw).retrieval_scores is None
    few = calibrate(m, tok, text(600), retrieval_probes=2, retrieval_lengths=(200,), **kw)
    assert few.metadata["retrieval_probes"] == {"n": 2, "lengths": [200]}
    with caplog.at_level(logging.INFO, logger="oscar_hf"):  # token ids: no text to write the probes in
        ids = torch.randint(1, 200, (3, 128), generator=torch.Generator().manual_seed(1))
        assert calibrate(m, None, ids, **kw).retrieval_scores is None
    assert "not scored" in caplog.text
    with pytest.raises(ValueError, match="calibration text"):
        calibrate(m, tok, text(600), retrieval_lengths=(2048,), **kw)
    with pytest.raises(ValueError, match="retrieval_probes"):
        calibrate(m, tok, text(600), retrieval_probes=-1, **kw)


# ------------------------------------------------------------------ both storages, and the bit counts
@pytest.mark.parametrize("compile", [False, True])
def test_auto_heads_generate_on_both_storages(compile):
    """``OscarLayer`` with eager forwards and with ``compile=True`` (its torch reference on the CPU) keep the auto heads, generate with them, and the heads change the outputs."""
    m = tiny_model("llama", initializer_range=0.2)
    rot = scored(m, [[0.1, 0.9], [0.5, 0.2]])
    ids = torch.randint(1, 200, (2, 30), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    cache = OscarCache(m, rot, compile=compile, **SMALL, max_history_bits=9.5)
    assert [(type(x), x.compiled) for x in cache.layers] == [(OscarLayer, compile)] * 2
    assert [x.retrieval_heads for x in cache.layers] == [(1,), (0,)]
    got = m.generate(ids, **kw, **cache_kwargs(m, cache))
    assert got.sequences.shape == (2, 42) and cache.get_seq_length() == 41
    plain = OscarCache(m, rot, compile=compile, **SMALL, retrieval_heads=0)
    assert all(x.retrieval_heads == () for x in plain.layers)
    ref = m.generate(ids, **kw, **cache_kwargs(m, plain))
    diff = [(a - b).nan_to_num(0.0).abs().max() for a, b in zip(got.scores, ref.scores)]  # (EOS held at -inf)
    assert max(map(float, diff)) > 1e-4  # the heads are used


def test_memory_report_and_eval_bits_agree_on_auto_heads():
    """``memory_report()["bits_per_element"]`` of a BF16 cache = the eval harness's ``bits(T)`` for the same
    config, with and without the auto heads, less (with them) the eval's second count of the retrieval heads'
    window slots at their coded bits (the layer keeps those slots in the window only)."""
    m = tiny_model("llama", dtype=torch.bfloat16)
    rot = scored(m, [[0.1, 0.9], [0.5, 0.2]])
    ids = torch.randint(1, 200, (1, 50), generator=torch.Generator().manual_seed(4))
    for extra, n_heads in ((dict(max_history_bits=9.5), 2), (dict(retrieval_heads=0), 0)):
        cache = OscarCache(m, rot, **SMALL, **extra)
        with torch.no_grad():
            m(ids, **cache_kwargs(m, cache))
        method = OscarFamily("oscar", rotations=rot, **SMALL, **extra)
        assert len(method.retrieval_pairs()) == n_heads
        assert method.settings().get("retrieval_heads", 0) == n_heads
        rep = cache.memory_report()
        c = method.config.for_head_dim(m.config.head_dim)
        twice = method.retrieval_share() * c.retrieval_head_bits(m.config.head_dim) * (c.sink + c.recent) / 50
        assert (twice > 0) == (n_heads > 0)
        assert rep["bits_per_element"] == pytest.approx(method.bits(50, m.config.head_dim) - twice, rel=1e-9)
