"""Group size resolution: ``OscarCache.from_pretrained`` takes the group size an artifact was calibrated for (where
``calibrate()`` records it, ``metadata["calibration"]["group_size"]``), and the eval harness counts the bits of
``group_size=None`` (one group per head, the "paper" preset) with the model's head_dim."""
import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.calibration import calibrate
from oscar_hf.eval.methods import OscarFamily

from tiny_models import tiny_model


def _ids(seed=0, n=2, length=40):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64)  # head_dim 64: the default group size 64 is valid too


@pytest.fixture(scope="module")
def artifact_g16(model, tmp_path_factory):
    """A real ``calibrate()`` artifact for group size 16, saved and loaded back."""
    rot = calibrate(model, None, _ids(), group_size=16, clip_grid=None, window=(4, 8), progress=False)
    assert rot.metadata["calibration"]["group_size"] == 16 and "group_size" not in rot.metadata
    path = tmp_path_factory.mktemp("g16")
    rot.save_pretrained(path)
    return path


def test_from_pretrained_takes_the_calibrated_group_size(model, artifact_g16):
    cache = OscarCache.from_pretrained(artifact_g16, model)
    assert cache.oscar_config.group_size == 16
    assert all(layer.config.group_size == 16 for layer in cache.layers if hasattr(layer, "config"))


def test_explicit_settings_win_over_the_artifact(model, artifact_g16):
    assert OscarCache.from_pretrained(artifact_g16, model, group_size=32).oscar_config.group_size == 32
    assert OscarCache.from_pretrained(artifact_g16, model, config=OscarConfig()).oscar_config.group_size == 64
    assert OscarCache.from_pretrained(artifact_g16, model, preset="paper").oscar_config.group_size == 64  # head_dim


def test_top_level_group_size_wins_over_the_calibration_record(model, artifact_g16, tmp_path):
    rot = OscarRotations.from_pretrained(artifact_g16)
    rot.metadata["group_size"] = 8
    rot.save_pretrained(tmp_path)
    assert OscarCache.from_pretrained(tmp_path, model).oscar_config.group_size == 8


def test_an_artifact_without_a_group_size_keeps_the_default(model, tmp_path):
    rot = OscarRotations.builtin(model, "hadamard")
    assert "group_size" not in rot.metadata and "calibration" not in rot.metadata
    rot.save_pretrained(tmp_path)
    assert OscarCache.from_pretrained(tmp_path, model).oscar_config.group_size == OscarConfig().group_size


@pytest.mark.parametrize("meta", ["bfloat16", "float32"])
def test_eval_bits_resolve_group_size_none_with_head_dim(meta):
    head_dim, T = 64, 2048
    per_head = OscarFamily("hadamard", method="hadamard", group_size=None, meta_dtype=meta)
    explicit = OscarFamily("hadamard", method="hadamard", group_size=head_dim, meta_dtype=meta)
    meta_bits = torch.finfo(getattr(torch, meta)).bits
    n_fp, n_q = 64 + 256, T - 64 - 256
    want = (n_fp * 16 + n_q * (2 + 2 * meta_bits / head_dim)) / T
    assert per_head.bits(T, head_dim) == pytest.approx(want) == explicit.bits(T, head_dim)
    assert per_head.bits(T, 128) < per_head.bits(T, 64)  # a longer head: one group, same metadata, fewer bits


def test_eval_fake_quant_resolves_group_size_none(model):
    per_head = OscarFamily("hadamard", method="hadamard", group_size=None).fake_spec(model)
    explicit = OscarFamily("hadamard", method="hadamard", group_size=64).fake_spec(model)
    assert per_head.config.group_size == 64
    k = torch.randn(1, 2, 10, 64, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 2, 10, 64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(per_head.layer_kv(0, k, v), explicit.layer_kv(0, k, v)):
        assert torch.equal(a, b)
