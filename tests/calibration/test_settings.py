"""Cache settings chosen by calibration within a memory budget (oscar_hf/calibration/settings.py): the budget's
bits by hand, the search against a constructed KL (lowest in-budget wins, over-budget never tried, the margin, the
retrieval-head floor), and the artifact round trip (saved, used by a cache with no options, overridden by the user,
absent = today's defaults)."""
import json

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, OscarRotations, calibrate
from oscar_hf.calibration import calibration_report, plot_settings
from oscar_hf.calibration.selection import greedy_mismatch, next_token_kl
from oscar_hf.compat import cache_kwargs
from oscar_hf.calibration.settings import (check_recall_window, choose_settings, kl_frontier, recall_windows,
                                          window_candidates)
from oscar_hf.config import ModelFingerprint, artifact_settings

from tiny_models import tiny_model

# SmolLM2-135M's shape: 30 full-attention layers x 3 KV heads of 64
SMOL = ModelFingerprint("LlamaForCausalLM", "llama", 30, 9, 3, 64, ("full_attention",) * 30)
SEVEN = ((7, 2), (14, 1), (17, 1), (18, 2), (20, 2), (21, 2), (23, 0))  # its 7 INT8 heads by default


# ------------------------------------------------------------------ the budget's bits
def test_stored_bits_by_hand():
    bits = lambda **kw: OscarConfig(**kw).stored_bits(SMOL, range(30), 8192)  # noqa: E731
    # today's defaults: 320 window tokens at 16 bits; 7872 history tokens, 83 heads at 2 + 32/64 and 7 at 8 + 32/64
    assert bits(retrieval_heads=SEVEN) == pytest.approx((320 * 16 + 7872 * (83 * 2.5 + 7 * 8.5) / 90) / 8192)
    assert bits(retrieval_heads=SEVEN) == pytest.approx(3.4758, abs=1e-4) and bits(retrieval_heads=7) < 3.5
    assert bits(retrieval_heads=()) == pytest.approx((320 * 16 + 7872 * 2.5) / 8192)
    assert bits(retrieval_heads=(), group_size=32) == pytest.approx((320 * 16 + 7872 * 3.0) / 8192)
    assert bits(retrieval_heads=(), meta_dtype="float32") == pytest.approx((320 * 16 + 7872 * 3.0) / 8192)
    # INT4 heads: 4 + 32/64 bits; a window of (32, 128)
    assert bits(retrieval_heads=SEVEN, retrieval_bits=4, sink=32, recent=128) == pytest.approx(
        (160 * 16 + 8032 * (83 * 2.5 + 7 * 4.5) / 90) / 8192)
    # a skipped layer: 16 bits for every token, the other 29 as usual (their heads share the history)
    one = (320 * 16 + 7872 * 2.5) / 8192
    assert bits(retrieval_heads=(), skip_layers=(0,)) == pytest.approx((29 * one + 16) / 30)
    # a context shorter than the windows: everything at 16
    assert OscarConfig(retrieval_heads=()).stored_bits(SMOL, range(30), 100) == 16
    # head_dim 128, one KV head: an INT8 head costs 8 + 32/128
    wide = ModelFingerprint("X", "llama", 2, 8, 1, 128, ("full_attention",) * 2)
    assert OscarConfig(retrieval_heads=((0, 0),)).stored_bits(wide, [0, 1], 4096) == pytest.approx(
        (320 * 16 + 3776 * (2.5 + 8.25) / 2) / 4096)
    with pytest.raises(ValueError, match="resolved"):
        OscarConfig().stored_bits(SMOL, range(30), 8192)  # "auto" depends on the artifact's scores
    with pytest.raises(ValueError, match="context"):
        OscarConfig(retrieval_heads=0).stored_bits(SMOL, range(30), 0)


# ------------------------------------------------------------------ the search, on a constructed KL
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model("llama", head_dim=64)  # 2 layers x 2 KV heads of 64


def scored_rotations(model, scores):
    rot = OscarRotations.builtin(model, "hadamard")
    rot.retrieval_scores = torch.tensor(scores, dtype=torch.float32)
    rot.metadata["heldout_error"] = {"0": {"k_rel": 0.1, "v_rel": 0.1}, "1": {"k_rel": 0.3, "v_rel": 0.2}}
    return rot


def constructed_kl(calls, budget, rot):
    """A KL that is lowest for group 32 (over the budget below), then for "std" (in it)."""
    fp = rot.fingerprint

    def score(c):
        bits = c.stored_bits(fp, list(rot.layers), 8192)
        assert bits <= budget + 1e-9, f"a setting over the budget was scored: {bits}"
        calls.append(c)
        kl = 1.0 - (0.3 if c.quantizer == "std" else 0.0) - (0.9 if c.group_size == 32 else 0.0)
        kl -= 0.05 if (c.sink, c.recent) == (32, 128) else 0.0  # 7% of 0.7: beyond the 2% margin
        kl -= 0.005 if (c.sink, c.recent) == (64, 128) else 0.0  # 0.7%: within the margin, not taken
        return kl

    return score


def test_search_picks_the_lowest_kl_within_the_budget(tiny):
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])  # no retrieval head
    calls = []
    # budget 3.2 at 8192: defaults cost (320 x 16 + 7872 x 2.5) / 8192 = 3.03, group 32 3.51: over
    e = choose_settings(tiny, rot, [torch.zeros(2048, dtype=torch.long)], budget_bits=3.2, target_context=8192,
                        score=constructed_kl(calls, 3.2, rot), progress=False)
    assert e["chosen"]["quantizer"] == "std" and e["chosen"]["group_size"] == 64
    assert (e["chosen"]["sink"], e["chosen"]["recent"]) == (32, 128)
    assert all(c.group_size == 64 for c in calls)  # group 32 was never scored ...
    assert "group_size=32" in [o["name"] for o in e["over_budget"]]  # ... and is reported as over the budget
    assert e["bits"] <= 3.2 and all(t["bits"] <= 3.2 for t in e["tried"])
    assert e["kl"] == min(t["kl"] for t in e["tried"]) == pytest.approx(0.65)
    assert {t["name"] for t in e["tried"]} >= {"defaults", "quantizer=std", "window=(64, 128)", "window=(32, 128)"}
    # with room for group 32 it is tried and wins
    calls.clear()
    e = choose_settings(tiny, rot, [torch.zeros(2048, dtype=torch.long)], budget_bits=3.6, target_context=8192,
                        score=constructed_kl(calls, 3.6, rot), progress=False)
    assert e["chosen"]["group_size"] == 32


def test_a_gain_within_the_margin_keeps_the_incumbent(tiny):
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])
    score = lambda c: 0.99 if c.quantizer == "std" else 1.0  # noqa: E731  (1% better: within the 2% margin)
    kw = dict(budget_bits=3.2, target_context=8192, score=score, progress=False)
    w = [torch.zeros(2048, dtype=torch.long)]
    assert choose_settings(tiny, rot, w, **kw)["chosen"]["quantizer"] == "minmax"
    assert choose_settings(tiny, rot, w, margin=0.0, **kw)["chosen"]["quantizer"] == "std"


def test_search_keeps_the_retrieval_heads_the_defaults_keep(tiny):
    rot = scored_rotations(tiny, [[0.9, 0.1], [0.8, 0.1]])  # 2 retrieval heads: (0, 0), (1, 0)
    calls = []
    # budget 6.0: defaults + 2 INT8 heads = (5120 + 7872 x (2.5 + 0.5 x 6)) / 8192 = 5.91 fit; group 32 keeps 2
    # heads only at 6.15 (over), 1 head would fit but the search may not trade a retrieval head for it
    e = choose_settings(tiny, rot, [torch.zeros(2048, dtype=torch.long)], budget_bits=6.0, target_context=8192,
                        score=constructed_kl(calls, 6.0, rot), progress=False)
    assert e["retrieval_heads_floor"] == 2
    assert all({(0, 0), (1, 0)} <= set(c.retrieval_heads) for c in calls)
    assert all(c.group_size == 64 for c in calls) and "group_size=32" in [o["name"] for o in e["over_budget"]]
    assert sorted(map(tuple, e["chosen"]["retrieval_heads"])) == [(0, 0), (1, 0)]


def test_bad_budget_and_windows():
    m = tiny_model("llama", head_dim=64)
    rot = scored_rotations(m, [[0.1, 0.1], [0.1, 0.1]])
    w = [torch.zeros(2048, dtype=torch.long)]
    for bad in (2.0, 17, "3.5", True):
        with pytest.raises(ValueError, match="budget_bits"):
            choose_settings(m, rot, w, budget_bits=bad, score=lambda c: 1.0, progress=False)
    with pytest.raises(ValueError, match="below what the defaults cost"):
        choose_settings(m, rot, w, budget_bits=2.6, target_context=8192, score=lambda c: 1.0, progress=False)
    with pytest.raises(ValueError, match="target_context"):
        calibrate(m, None, torch.zeros(3, 600, dtype=torch.long), target_context=0, progress=False,
                  retrieval_probes=0)
    # window candidates: at most a quarter of the held-out prompt (1536 tokens: sink + recent <= 384)
    assert window_candidates(64, 256, 1536) == [(32, 128), (64, 128), (128, 256)]
    assert (64, 512) in window_candidates(64, 256, 7680)


def test_windows_reach_128_2048_priced_at_the_target_context():
    """Gemma-3-270M's KV shape (one KV head of 256): on a held-out prompt of >= 4 x 2176 tokens the window step reaches
    the authors' (128, 2048), priced at 32K tokens, where it fits 3.5 bits at group 64 and not at the incumbent's 32."""
    assert (128, 2048) in window_candidates(128, 256, 8704) and (128, 1024) in window_candidates(128, 256, 4608)
    assert (128, 2048) not in window_candidates(128, 256, 8703)
    m = tiny_model("llama", head_dim=256, num_key_value_heads=1)
    rot = OscarRotations.builtin(m, "hadamard")  # no retrieval scores, no held-out error: no heads, no precise layers
    price = lambda c: c.stored_bits(rot.fingerprint, list(rot.layers), 32768)  # noqa: E731

    def score(c):  # lower for group 32, and for a longer recent window
        assert price(c) <= 3.5 + 1e-9, f"a setting over the budget was scored: {price(c)}"
        return (0.8 if c.group_size == 32 else 1.0) * 256 / c.recent

    run = lambda n: choose_settings(m, rot, [torch.zeros(n, dtype=torch.long)], budget_bits=3.5,  # noqa: E731
                                    target_context=32768, score=score, progress=False)
    e = run(8704 + 512)
    tried = {t["name"]: t for t in e["tried"]}
    wide = OscarConfig(sink=128, recent=2048, group_size=64, retrieval_heads=())
    # (128, 2048): 2176 x 16 + 30592 x (2 + 32/64) bits over 32768 tokens = 3.396; at group 32 3.863, over
    assert tried["window=(128, 2048), group_size=64"]["bits"] == pytest.approx(price(wide), abs=1e-4)
    assert price(wide) == pytest.approx((2176 * 16 + 30592 * 2.5) / 32768)
    assert price(wide.replace(group_size=32)) > 3.5
    assert tried["window=(128, 1024)"]["bits"] == pytest.approx((1152 * 16 + 31616 * 3.0) / 32768, abs=1e-4)
    assert (e["chosen"]["sink"], e["chosen"]["recent"], e["chosen"]["group_size"]) == (128, 2048, 64)
    assert e["bits"] == pytest.approx(price(wide), abs=1e-4)
    # held-out windows of 2048 tokens (the default seq_len): a quarter of the 1536-token prompt, no wide window
    short = {t["name"] for t in run(2048)["tried"]}
    assert not any("1024" in n or "2048" in n or "(128, 512)" in n for n in short)


def test_recall_windows_copy_a_flushed_novel_passage():
    """The recall term's window: the prompt's first tokens with a passage from a quarter into it permuted (novel: the
    same tokens in a seeded order, the same for every call), then a verbatim copy of that passage; a window that would
    keep part of the passage in full precision is refused; short windows give none."""
    w = torch.arange(10_000)
    (long_, n), = recall_windows([w])
    assert n == 512 and long_.numel() == 4096 + 512
    assert torch.equal(long_[:1024], w[:1024]) and torch.equal(long_[1536:4096], w[1536:4096])
    passage = long_[1024:1536]
    assert torch.equal(long_[-512:], passage) and torch.equal(passage.sort().values, w[1024:1536])
    assert (passage != w[1024:1536]).float().mean() > 0.9  # permuted, not the text's own order
    (again, _), (other, _) = recall_windows([w, w])
    assert torch.equal(again, long_) and not torch.equal(other, long_)  # seeded by the window's index
    check_recall_window(OscarConfig(sink=128, recent=2048), long_, n)
    with pytest.raises(ValueError, match="covers part of the recall term's passage"):
        check_recall_window(OscarConfig(sink=128, recent=2600), long_, n)
    (short, m), = recall_windows([torch.arange(700)])  # a 188-token prompt: a 47-token passage from token 47
    assert m == 47 and torch.equal(short[-47:], short[47:94]) and torch.equal(short[-47:].sort().values,
                                                                              torch.arange(47, 94))
    assert recall_windows([torch.arange(560)]) == []


# ------------------------------------------------------------------ calibrate() and the artifact
@pytest.fixture(scope="module")
def calibrated(tiny):
    ids = torch.randint(1, 200, (3, 700), generator=torch.Generator().manual_seed(0))
    return calibrate(tiny, None, ids, method="oscar", window=(4, 8), progress=False, retrieval_probes=0), ids


def test_calibrate_stores_the_choice_and_a_cache_uses_it(tiny, calibrated):
    rot, ids = calibrated
    e = rot.metadata["settings"]
    assert json.loads(json.dumps(e)) == e  # stored as JSON in the artifact
    assert e["kl"] == min(t["kl"] for t in e["tried"] if t["name"] == e["chosen_name"])
    assert "cache settings search" in rot.metadata["calibration"]["passes"]
    cache = OscarCache(tiny, rot)  # no options: the chosen settings
    for k, v in artifact_settings(rot.metadata).items():
        assert getattr(cache.oscar_config, k) == v, k
    # the KL recorded is what that cache gives on the held-out window (the last row, never in the statistics) plus
    # what it gives on that window's recall copy
    kept = next(t for t in e["tried"] if t["name"] == e["chosen_name"])
    assert next_token_kl(tiny, rot, ids[-1], config=cache.oscar_config) == pytest.approx(kept["next_kl"], rel=1e-5)
    (copy, n), = recall_windows([ids[-1]])
    assert greedy_mismatch(tiny, rot, copy, cache.oscar_config, n) == pytest.approx((kept["recall_mismatch"],
                                                                                      kept["recall_kl"],
                                                                                      kept["recall_confident"]))
    assert e["kl"] == pytest.approx(kept["next_kl"] + kept["recall_confident"])
    report = calibration_report(rot)
    assert "cache settings chosen by next-token KL" in report and "tried defaults" in report and "+ recall" in report
    off = calibrate(tiny, None, ids, method="oscar", window=(4, 8), progress=False, retrieval_probes=0,
                    choose_settings=False)
    assert "settings" not in off.metadata and "cache settings chosen" not in calibration_report(off)


CHOSEN = dict(sink=8, recent=16, group_size=32, meta_dtype="bfloat16", quantizer="std",
              retrieval_heads=[[0, 1]], retrieval_bits=4)


def test_artifact_round_trip_and_user_arguments_win(tiny, calibrated, tmp_path):
    rot, _ = calibrated
    rot = OscarRotations(rot.fingerprint, rot.method, rot.layers, {**rot.metadata, "settings": {
        **rot.metadata["settings"], "chosen": CHOSEN}}, rot.retrieval_scores)
    rot.save_pretrained(tmp_path / "a")
    loaded = OscarRotations.from_pretrained(tmp_path / "a")
    assert loaded.metadata["settings"] == rot.metadata["settings"]
    want = OscarConfig(**{**CHOSEN, "retrieval_heads": ((0, 1),)})
    for cache in (OscarCache.from_pretrained(tmp_path / "a", tiny), OscarCache(tiny, loaded)):
        assert cache.oscar_config == want
        assert [len(layer.retrieval_heads) for layer in cache.layers] == [1, 0]
    # the user's keywords win field by field; config= / preset= replace the choice wholesale
    c = OscarCache.from_pretrained(tmp_path / "a", tiny, recent=32, group_size=64).oscar_config
    assert (c.recent, c.group_size, c.sink, c.quantizer) == (32, 64, 8, "std")
    assert OscarCache(tiny, loaded, OscarConfig(retrieval_heads=0)).oscar_config == OscarConfig(
        retrieval_heads=0)
    assert OscarCache(tiny, loaded, preset="paper").oscar_config == OscarConfig.from_preset("paper").for_head_dim(64)
    # a cache saved and loaded keeps the chosen settings (it stores its config)
    cache = OscarCache(tiny, loaded)
    tiny(torch.randint(1, 200, (1, 40)), **cache_kwargs(tiny, cache))
    cache.save(tmp_path / "live")
    assert OscarCache.load(tmp_path / "live", tiny).oscar_config == want
    # a corrupted entry is refused, naming the field
    bad = OscarRotations(rot.fingerprint, rot.method, rot.layers, {"settings": {"chosen": {"window": 3}}})
    with pytest.raises(ValueError, match="window"):
        OscarCache(tiny, bad)


def test_artifact_without_the_entry_gives_todays_defaults(tiny, calibrated, tmp_path):
    rot, _ = calibrated
    meta = {k: v for k, v in rot.metadata.items() if k != "settings"}
    old = OscarRotations(rot.fingerprint, rot.method, rot.layers, meta, rot.retrieval_scores)
    old.save_pretrained(tmp_path / "old")
    assert artifact_settings(old.metadata) is None
    assert OscarCache(tiny, old).oscar_config == OscarConfig()
    # from_pretrained applies the calibrated group size, as before
    assert OscarCache.from_pretrained(tmp_path / "old", tiny).oscar_config == OscarConfig(group_size=64)
    skipped = OscarRotations(rot.fingerprint, rot.method, rot.layers, {**meta, "settings": {"skipped": "too short"}})
    assert OscarCache(tiny, skipped).oscar_config == OscarConfig()


class CharTok:
    """One token per character (ids 1..200)."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": [ord(c) % 200 + 1 for c in text]}


def test_text_too_short_for_the_extra_window_scores_one(tiny):
    g = torch.Generator().manual_seed(3)
    text = lambda n: "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=g))  # noqa: E731
    kw = dict(method="oscar", tokens=1200, seq_len=600, window=(4, 8), progress=False, retrieval_probes=0)
    # 2 statistics windows + the selection's held-out one fit 1800 characters; the search's second needs 2400
    t = text(2500)
    short = calibrate(tiny, CharTok(), t[:2000], **kw)
    assert short.metadata["calibration"]["settings_windows"] == 1 and "chosen" in short.metadata["settings"]
    long = calibrate(tiny, CharTok(), t, **kw)
    assert long.metadata["calibration"]["settings_windows"] == 2
    assert "2 held-out window(s)" in long.metadata["settings"]["objective"]
    # the statistics and the selection read the same windows either way: same rotations and clips
    assert all(torch.equal(short.layers[i].r_k, long.layers[i].r_k) and short.layers[i].clip_k == long.layers[i].clip_k
               for i in short.layers)


def test_kl_frontier_keeps_what_nothing_cheaper_beats():
    tried = [dict(name="a", bits=3.0, kl=0.05), dict(name="b", bits=2.5, kl=0.09), dict(name="c", bits=3.2, kl=0.06),
             dict(name="d", bits=3.4, kl=0.03), dict(name="e", bits=3.0, kl=0.04), dict(name="f", bits=3.6, kl=0.03)]
    # c costs more than e for a higher KL; a ties e's bits with a higher KL; f ties d's KL at more bits
    assert [t["name"] for t in kl_frontier(tried)] == ["b", "e", "d"]
    assert kl_frontier([]) == []


def test_settings_plot_of_a_searched_artifact(calibrated, tmp_path):
    rot, _ = calibrated
    plot_settings(rot, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    meta = {k: v for k, v in rot.metadata.items() if k != "settings"}
    with pytest.raises(ValueError, match="no settings search"):
        plot_settings(OscarRotations(rot.fingerprint, rot.method, rot.layers, meta), tmp_path / "x.png")


def test_choose_settings_script_heldout_len_reads_past_the_statistics_windows():
    """``scripts/choose_settings.py --heldout-len``: held-out windows of that length, starting where the statistics
    windows of the artifact's calibration end (none of their tokens scored), the calibration's own without it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "choose_settings.py"
    spec = importlib.util.spec_from_file_location("choose_settings_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    g = torch.Generator().manual_seed(5)
    text = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (5000,), generator=g))
    ids = CharTok()(text)["input_ids"]
    own = script.heldout_windows(CharTok(), text, 1200, 600, 2)  # statistics: 2 windows of 600
    assert own.tolist() == [ids[1200:1800], ids[1800:2400]]
    long = script.heldout_windows(CharTok(), text, 1200, 600, 2, heldout_len=1000)
    assert long.tolist() == [ids[1200:2200], ids[2200:3200]]


def test_search_tries_three_bit_keys_where_they_fit(tiny):
    """3-bit keys are tried at the incumbent's group size and the next coarser one (with "minmax": the "std" grid
    has 4 levels), chosen when they lower the KL, and reported as over the budget where they do not fit."""
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])
    w = [torch.zeros(2048, dtype=torch.long)]

    def score(c):  # lowest with 3-bit keys; "std" better than "minmax" at 2 bits
        return 1.0 - (0.5 if c.key_bits == 3 else 0.0) - (0.1 if c.quantizer == "std" else 0.0)

    # budget 3.6 at 8192: 3-bit keys at group 64 cost (320 x 16 + 7872 x 3.0) / 8192 = 3.51
    e = choose_settings(tiny, rot, w, budget_bits=3.6, target_context=8192, score=score, progress=False)
    assert e["chosen"]["key_bits"] == 3 and e["chosen"]["quantizer"] == "minmax" and e["chosen"]["group_size"] == 64
    assert e["chosen_name"] == "key_bits=3, group_size=64" and e["bits"] == pytest.approx(3.5078, abs=1e-4)
    assert OscarConfig(**artifact_settings({"settings": e})).key_bits == 3  # the artifact's entry loads
    # budget 3.2: over it at group 64 (the tiny model's head_dim: no coarser group), reported, never scored
    e = choose_settings(tiny, rot, w, budget_bits=3.2, target_context=8192, score=score, progress=False)
    assert e["chosen"]["key_bits"] == 2 and "key_bits=3, group_size=64" in [o["name"] for o in e["over_budget"]]
    assert all(t["key_bits"] == 2 for t in e["tried"])


def test_search_tries_three_bit_keys_with_values_at_a_coarser_group(tiny):
    """3-bit keys at the incumbent's group with the values at each coarser one: chosen where the KL says so and the
    budget holds it (the values' metadata pays for part of the keys' bit), and the artifact's entry loads."""
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])
    w = [torch.zeros(2048, dtype=torch.long)]

    def score(c):  # lowest with 3-bit keys at group 32 and values at 64
        return 1.0 - (0.5 if (c.key_bits, c.group_size, c.value_group(64)) == (3, 32, 64) else 0.0)

    # at 8192: keys (3 + 32/32), values (2 + 32/64): (320 x 16 + 7872 x 3.25) / 8192 = 3.748; 3-bit keys with
    # values at 32 too would cost 3.99, over the budget
    e = choose_settings(tiny, rot, w, budget_bits=3.8, target_context=8192, score=score, progress=False,
                        base=OscarConfig(group_size=32))
    assert e["chosen_name"] == "key_bits=3, group_size=32, value_group_size=64"
    assert e["bits"] == pytest.approx(3.7480, abs=1e-4)
    assert "key_bits=3, group_size=32" in [o["name"] for o in e["over_budget"]]
    cfg = OscarConfig(**artifact_settings({"settings": e}))
    assert (cfg.key_bits, cfg.group_size, cfg.value_group_size) == (3, 32, 64)
    # from the defaults' group 64: the keys are also tried at the next finer group, 32
    e = choose_settings(tiny, rot, w, budget_bits=3.8, target_context=8192, score=score, progress=False)
    assert e["chosen_name"] == "key_bits=3, group_size=32, value_group_size=64"


def test_window_step_tries_three_bit_keys_at_the_next_finer_group(tiny):
    """With 3-bit keys and values at a group of their own, the window step also tries each window with the keys at
    the next finer group: a joint move neither the key step (at the incumbent's window) nor the window step (at its
    group) makes alone, and the one the search chooses where the objective is lowest there."""
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])
    w = [torch.zeros(2048, dtype=torch.long)]

    def score(c):  # lowest only with keys at group 32 and the window (64, 128)
        return 1.0 - (0.5 if (c.group_size, c.sink, c.recent) == (32, 64, 128) else 0.0)

    base = OscarConfig(key_bits=3, quantizer="minmax", group_size=64, value_group_size=64)
    e = choose_settings(tiny, rot, w, budget_bits=8.0, target_context=8192, score=score, progress=False, base=base)
    names = [t["name"] for t in e["tried"]]
    assert "window=(64, 128), group_size=32" in names and "window=(64, 128)" in names
    assert e["chosen_name"] == "window=(64, 128), group_size=32"
    assert (e["chosen"]["group_size"], e["chosen"]["value_group_size"], e["chosen"]["recent"]) == (32, 64, 128)
    # 2-bit keys: the window step tries each window at the incumbent's group only
    e = choose_settings(tiny, rot, w, budget_bits=8.0, target_context=8192, score=score, progress=False,
                        base=OscarConfig(value_group_size=64))
    assert not any(t["name"].startswith("window=") and "group_size" in t["name"] for t in e["tried"])


def test_choose_settings_script_scores_given_settings_without_searching(tiny, tmp_path):
    """``scripts/choose_settings.py --score``: each row's KL is the search's objective on the same windows (the
    artifact's chosen settings under the row's), its bits the budget's measure; one JSON file with the command."""
    import argparse
    import importlib.util
    import json
    from pathlib import Path

    from oscar_hf.calibration.settings import SCORED_TOKENS, greedy_mismatch, next_token_kl

    path = Path(__file__).resolve().parents[2] / "scripts" / "choose_settings.py"
    spec = importlib.util.spec_from_file_location("choose_settings_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rot = scored_rotations(tiny, [[0.1, 0.1], [0.1, 0.1]])
    w = [torch.randint(0, tiny.config.vocab_size, (2400,), generator=torch.Generator().manual_seed(3))]
    out = tmp_path / "kl.json"
    args = argparse.Namespace(score=["", "group_size=32", "key_bits=3"], budget_bits=3.5, target_context=8192, out=out)
    assert script.score_rows(args, tiny, rot, w, OscarConfig()) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["chosen", "group_size=32", "key_bits=3"]
    (copy, n), = recall_windows(w)
    for name, cfg in (("chosen", OscarConfig()), ("key_bits=3", OscarConfig(key_bits=3))):
        kl = next_token_kl(tiny, rot, w[0], config=cfg, scored=SCORED_TOKENS)
        mismatch, copy_kl, confident = greedy_mismatch(tiny, rot, copy, cfg, n)
        assert (rows[name]["next_kl"], rows[name]["recall_mismatch"], rows[name]["recall_kl"],
                rows[name]["recall_confident"]) == pytest.approx((kl, mismatch, copy_kl, confident))
        assert rows[name]["kl"] == pytest.approx(kl + confident)
        heads = cfg.replace(retrieval_heads=())  # (these scores pick no retrieval head: all below 0.4)
        assert rows[name]["bits"] == pytest.approx(heads.stored_bits(rot.fingerprint, sorted(rot.layers), 8192),
                                                   abs=1e-4)
    assert rows["group_size=32"]["bits"] > rows["chosen"]["bits"] and rows["chosen"]["kl"] > 0


def test_greedy_mismatch_counts_confident_flips_apart(monkeypatch):
    """``Recall.confident`` is the mismatch among the model's positions of top-token probability >= CONFIDENT only: a
    flip at a near tie raises ``mismatch`` but not it; a flip where the model was sure raises both."""
    from oscar_hf.calibration import selection

    sure, tie = [0.95, 0.03, 0.02], [0.5, 0.4, 0.1]
    ref = torch.tensor([[sure, sure, tie, tie]]).log()  # [1, 4 positions, vocab 3]; the model's top token: 0
    other = [0.1, 0.8, 0.1]  # the cache's top token: 1 (a flip)
    for flipped, want in (([2], (0.25, 0.0)), ([1, 2], (0.5, 0.5)), ([0, 1, 3], (0.75, 1.0))):
        got = torch.tensor([[other if i in flipped else sure for i in range(4)]]).log()
        monkeypatch.setattr(selection, "cached_log_probs", lambda *a, got=got, **k: got)
        r = selection.greedy_mismatch(None, None, torch.zeros(8, dtype=torch.long), None, 4, ref)
        assert (r.mismatch, r.confident) == pytest.approx(want)
        assert r.kl > 0
