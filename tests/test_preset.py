"""The authors' settings as a preset (``OscarConfig.reference()`` / ``preset="paper"``) and calibration of rotations
shared by the KV heads of a layer (``calibrate(..., share_rotation_across_heads=True)``, ``--preset`` of
scripts/calibrate.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.calibration import calibrate, collect_statistics
from oscar_hf.calibration.search import eigvecs_desc, select_best
from oscar_hf.compat import cache_kwargs
from oscar_hf.config import PRESETS, OscarConfig, default_group_size
from oscar_hf.hadamard import oscar_rotation
from oscar_hf.eval.models import SMOLLM2_GGUF, smollm2_dir
from oscar_hf.rotations import OscarRotations
from script_utils import import_script
from tiny_models import tiny_model

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- the preset
def test_reference_is_the_authors_settings():
    c = OscarConfig.reference()
    assert c == OscarConfig.from_preset("paper")
    assert (c.sink, c.recent, c.group_size, c.meta_dtype) == (64, 256, None, "float32")
    assert (c.clip_k, c.clip_v, c.center) == (0.96, 0.92, False)
    assert c.torch_meta_dtype == torch.float32
    # group_size None is one group per head, resolved once the model's head_dim is known
    assert c.for_head_dim(128).group_size == 128 and c.for_head_dim(64).group_size == 64
    assert OscarConfig().for_head_dim(128).group_size == 64  # an explicit group size stays
    assert OscarConfig.reference(recent=128, clip_k=1.0).recent == 128  # overrides on top of the preset
    assert OscarConfig.reference(recent=128).clip_k == 0.96


@pytest.mark.parametrize("head_dim, group", [(64, 64), (128, 64), (256, 64), (512, 64), (96, 48), (80, 40),
                                             (112, 56), (192, 64), (32, 32), (40, 40), (160, 40)])
def test_default_group_size_fits_the_head_dim(head_dim, group):
    """64 where it divides head_dim, else the largest whole number of planes (head_dim / 4 channels) up to 64."""
    assert default_group_size(head_dim) == group
    assert head_dim % group == 0 and group % (head_dim // 4) == 0 or head_dim % 64 == 0
    assert OscarConfig().for_head_dim(head_dim, default_group=True).group_size == group
    assert OscarConfig().for_head_dim(head_dim).group_size == 64  # a chosen group size is never changed


def test_default_call_on_head_dim_96_takes_groups_of_48():
    """Phi-3 (head_dim 96): the default call works (groups of 48); a group size the user or the artifact chose is
    kept, and one that does not divide head_dim is an error naming the valid ones."""
    m = tiny_model("phi3")
    assert OscarCache(m).oscar_config.group_size == 48
    assert OscarCache(m, group_size=32).oscar_config.group_size == 32
    assert OscarCache(m, recent=16).oscar_config.group_size == 48  # other overrides keep the fitted default
    with pytest.raises(ValueError, match=r"group_size=64 does not divide head_dim=96.*\[16, 24, 32, 48, 96\]"):
        OscarCache(m, group_size=64)
    with pytest.raises(ValueError, match="group_size=64 does not divide head_dim=96"):
        OscarCache(m, config=OscarConfig())  # an explicit config is the user's choice


def test_bad_preset_names_the_presets():
    with pytest.raises(ValueError, match="unknown OscarConfig preset 'authors'.*paper"):
        OscarConfig.from_preset("authors")
    with pytest.raises(ValueError, match="presets: "):
        OscarConfig.build(preset="Paper")
    assert sorted(PRESETS) == ["paper"]


def test_build_merges_config_preset_and_overrides():
    assert OscarConfig.build() == OscarConfig()
    assert OscarConfig.build(OscarConfig(sink=8), recent=16) == OscarConfig(sink=8, recent=16)
    assert OscarConfig.build(preset="paper", sink=4) == OscarConfig.reference(sink=4)
    with pytest.raises(ValueError, match="either config= or preset="):
        OscarConfig.build(OscarConfig(), "paper")
    with pytest.raises(ValueError, match="must be an OscarConfig"):
        OscarConfig.build({"sink": 4})
    for bad in (0, -64, True, 64.0):
        with pytest.raises(ValueError, match="group_size"):
            OscarConfig(group_size=bad)
    with pytest.raises(ValueError, match="does not divide head_dim=32"):
        OscarCache(tiny_model("llama").config, config=OscarConfig(group_size=24))


def _cache_roundtrip(model, cache):
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :30], **cache_kwargs(model, cache), use_cache=True)
        out = model(ids[:, 30:], **cache_kwargs(model, cache), use_cache=True)
    return out.logits


def test_preset_cache_quantizes_one_group_per_head_with_fp32_metadata():
    """The preset's config resolved for the model (what OscarCache does with group_size=None): history metadata
    is float32 with one group per head, and the history costs 2 + 2 * 32 / head_dim bits per element."""
    model = tiny_model("llama")  # head_dim 32
    cfg = OscarConfig.reference(sink=4, recent=8).for_head_dim(32)
    cache = OscarCache(model.config, config=cfg)
    logits = _cache_roundtrip(model, cache)
    assert torch.isfinite(logits).all()
    layer = next(layer for layer in cache.layers if hasattr(layer, "memory"))
    assert layer.config.clip_k == 0.96 and layer.config.clip_v == 0.92 and not layer.config.center
    rep = cache.memory_report()
    assert rep["history_elements"] > 0
    assert rep["history_bits_per_element"] == pytest.approx(2 + 64 / 32)
    # per history token, KV head and K/V: one group, so one fp32 scale + one fp32 zero
    n_kv = model.config.num_key_value_heads
    tokens_hist = rep["history_elements"] / (2 * 32)
    assert rep["history_meta"] == pytest.approx(tokens_hist * 2 * 2 * 4)  # K and V, scale + zero, 4 bytes
    assert n_kv == 2


def test_cache_accepts_the_preset_by_name(tmp_path):
    """``OscarCache(model, preset="paper")`` and ``OscarCache.from_pretrained(dir, model, preset="paper")``: the
    named preset, group size resolved to head_dim."""
    model = tiny_model("llama")
    cache = OscarCache(model.config, preset="paper", sink=4, recent=8)
    c = cache.oscar_config
    assert (c.group_size, c.meta_dtype, c.clip_k, c.clip_v, c.center) == (32, "float32", 0.96, 0.92, False)
    assert torch.isfinite(_cache_roundtrip(model, cache)).all()
    OscarRotations.builtin(model, "hadamard").save_pretrained(tmp_path)
    loaded = OscarCache.from_pretrained(tmp_path, model, preset="paper", recent=16)
    assert loaded.oscar_config == OscarConfig.reference(recent=16).for_head_dim(32)
    with pytest.raises(ValueError, match="presets: \\['paper'\\]"):
        OscarCache(model.config, preset="nope")
    with pytest.raises(ValueError, match="either config= or preset="):
        OscarCache(model.config, config=OscarConfig(), preset="paper")


# ---------------------------------------------------------------------------------------------- shared rotations
def _ids(seed=0, n=3, length=40):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def test_shared_rotations_are_identical_across_heads_and_per_head_are_not():
    model = tiny_model("llama")  # 2 KV heads
    ids = _ids()
    one = dict(method="oscar", group_size=16, clip_grid=None, window=(4, 8), progress=False)
    shared = calibrate(model, None, ids, share_rotation_across_heads=True, **one)
    per_head = calibrate(model, None, ids, **one)
    stats = collect_statistics(model, ids, kv_skip=4)
    for i, lr in shared.layers.items():
        assert lr.r_k.shape[0] == 2
        for r in (lr.r_k, lr.r_v):
            assert torch.equal(r[0], r[1])
        # the shared rotation diagonalizes the statistics of both heads pooled (equal row counts: their mean)
        s = stats.layers[i]
        ck, cv = s.c_q().mean(0), s.c_s(True).mean(0)
        torch.testing.assert_close(lr.r_k[0], oscar_rotation(eigvecs_desc(ck)[1]), atol=1e-5, rtol=0)
        torch.testing.assert_close(lr.r_v[0], oscar_rotation(eigvecs_desc(cv)[1]), atol=1e-5, rtol=0)
        # offsets stay per head
        assert not torch.equal(lr.mu_k[0], lr.mu_k[1])
        ph = per_head.layers[i]
        assert (ph.r_k[0] - ph.r_k[1]).abs().max() > 1e-2 and (ph.r_v[0] - ph.r_v[1]).abs().max() > 1e-2
    assert shared.metadata["calibration"]["share_rotation_across_heads"] is True
    assert per_head.metadata["calibration"]["share_rotation_across_heads"] is False
    shared.validate()


def test_shared_auto_selection_picks_one_candidate_per_layer():
    model = tiny_model("qwen3")
    rot = calibrate(model, None, _ids(3), method="auto", center="auto", group_size=16, window=(4, 8), progress=False,
                    share_rotation_across_heads=True)
    for kind in ("k", "v"):
        for names in rot.metadata["winners"][kind].values():
            assert len(set(names)) == 1, names
    for lr in rot.layers.values():
        assert torch.equal(lr.r_k[0], lr.r_k[1]) and torch.equal(lr.r_v[0], lr.r_v[1])


def test_select_best_shared_minimizes_the_layer_sum():
    # candidates x clips x heads: per head the best would mix candidates (0 for head 0, 1 for head 1)
    e = torch.tensor([[[1.0, 5.0], [2.0, 2.0]], [[3.0, 1.0], [1.0, 3.0]]])
    assert select_best(e) == (0, [0, 1])
    # shared: candidate sums per clip are [6, 4] (clip 0) and [4, 4] (clip 1) -> clip 1 (tie: larger), candidate 0
    assert select_best(e, shared=True) == (1, [0, 0])


def test_fixed_clips_are_stored_and_not_searched():
    model = tiny_model("llama")
    rot = calibrate(model, None, _ids(1), method="oscar", group_size=None, center=False, clips=(0.96, 0.92),
                    meta_dtype="float32", window=(4, 8), progress=False, share_rotation_across_heads=True)
    assert rot.clips() == {i: (0.96, 0.92) for i in rot.layers}
    assert not rot.has_offsets
    cal = rot.metadata["calibration"]
    assert cal["group_size"] == 32 and cal["fixed_clips"] == [0.96, 0.92] and cal["clip_grid"] is None
    assert "held-out selection" not in cal["passes"]
    with pytest.raises(ValueError, match="clip_k, clip_v"):
        calibrate(model, None, _ids(1), clips=(0.9,), progress=False, group_size=16)
    with pytest.raises(ValueError, match="clip ratios"):
        calibrate(model, None, _ids(1), clips=(0.9, 1.5), progress=False, group_size=16)


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def cli():
    return import_script("calibrate")


def test_cli_preset_refuses_flags_it_sets(cli, capsys):
    parser = cli.build_parser()
    for extra in (["--group-size", "32"], ["--no-center"], ["--clip-grid", "1"], ["--center", "auto"],
                  ["--method", "pca-kv"]):
        args = parser.parse_args(["--out", "x", "--preset", "paper", *extra])
        with pytest.raises(SystemExit):
            cli.preset_settings(args, parser)
        assert "--preset paper sets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--preset", "bogus"])
    args = parser.parse_args(["--out", "x", "--preset", "paper"])
    assert cli.preset_settings(args, parser) == dict(method="oscar", group_size=None, center=False,
                                                     meta_dtype="float32", clips=(0.96, 0.92),
                                                     share_rotation_across_heads=True)
    assert cli.preset_settings(parser.parse_args(["--out", "x"]), parser) == {}


@pytest.mark.parametrize("flags", [["--preset", "paper"], ["--share-rotation-across-heads"]])
def test_cli_writes_shared_rotations(cli, tmp_path, flags):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    model_dir = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--tokens", "128", "--seq-len", "64", "--window", "4,16", "--out", str(out),
            "--no-progress", "-q", "--retrieval-probes", "0", *flags]
    if flags[0] != "--preset":
        argv += ["--group-size", "16"]
    assert cli.main(argv) == 0
    rot = OscarRotations.from_pretrained(out)
    cal = rot.metadata["calibration"]
    assert cal["share_rotation_across_heads"] is True
    for lr in rot.layers.values():
        assert torch.equal(lr.r_k[0], lr.r_k[1]) and torch.equal(lr.r_v[0], lr.r_v[1])
    if flags[0] == "--preset":
        assert rot.metadata["preset"] == "paper" and cal["group_size"] == 32 and cal["meta_dtype"] == "float32"
        assert rot.clips() == {i: (0.96, 0.92) for i in rot.layers} and not rot.has_offsets
    else:
        assert rot.metadata["preset"] is None and rot.has_offsets
