"""Rotation artifact: round trip, refusal of other models, hostile files (never unpickled)."""
import json

import pytest
import torch

from oscar_hf import OscarCache, OscarRotations
from oscar_hf.compat import cache_kwargs
from oscar_hf.rotations import CONFIG_NAME, WEIGHTS_NAME

from tiny_models import tiny_config, tiny_model


@pytest.fixture
def artifact(tmp_path):
    rot = OscarRotations.builtin(tiny_config("llama"), "hadamard")
    for lr in rot.layers.values():
        lr.mu_k = torch.randn(2, 32)
        lr.mu_v = torch.randn(2, 32)
        lr.clip_k, lr.clip_v = 0.96, 0.92
    rot.metadata["group_size"] = 32
    rot.save_pretrained(tmp_path / "rot")
    return tmp_path / "rot", rot


def test_round_trip_and_cache_uses_it(artifact):
    path, rot = artifact
    back = OscarRotations.from_pretrained(path)
    assert back.method == "hadamard" and back.fingerprint == rot.fingerprint
    for i, lr in rot.layers.items():
        assert torch.equal(back.layers[i].r_k, lr.r_k) and torch.equal(back.layers[i].mu_v, lr.mu_v)
        assert back.layers[i].clip_k == 0.96
    m = tiny_model("llama")
    cache = OscarCache.from_pretrained(path, m, sink=4, recent=8)
    assert cache.oscar_config.group_size == 32  # taken from the artifact
    out = m.generate(torch.randint(1, 200, (1, 30)), max_new_tokens=4, do_sample=False, **cache_kwargs(m, cache))
    assert out.shape[1] == 34 and cache.layers[0].params.mu_k is not None and cache.layers[0].params.clip_v == 0.92


@pytest.mark.parametrize(
    "other,msg",
    [
        (dict(num_key_value_heads=4), "num_key_value_heads: artifact has 2, model has 4"),
        (dict(num_hidden_layers=3), "num_layers: artifact has 2, model has 3"),
        (dict(head_dim=16), "head_dim: artifact has 32, model has 16"),
    ],
)
def test_refuses_other_model(artifact, other, msg):
    path, _ = artifact
    with pytest.raises(ValueError, match=msg):
        OscarCache.from_pretrained(path, tiny_config("llama", **other))


def test_refuses_other_architecture(artifact):
    with pytest.raises(ValueError, match="model_type: artifact has 'llama', model has 'qwen2'"):
        OscarCache.from_pretrained(artifact[0], tiny_config("qwen2"))


def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(str(path / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(path / WEIGHTS_NAME))


@pytest.mark.parametrize(
    "corrupt,msg",
    [
        (lambda t: t.__setitem__("layers.0.r_k", t["layers.0.r_k"] * 1.5), "not orthogonal"),
        (lambda t: t["layers.0.r_v"].__setitem__((0, 0, 0), float("nan")), "NaN"),
        (lambda t: t.__setitem__("layers.1.r_k", t["layers.1.r_k"][:, :16, :16].contiguous()), "shape"),
        (lambda t: t.__setitem__("layers.0.r_k", t["layers.0.r_k"].double()), "float32"),
        (lambda t: t.__setitem__("layers.0.mu_k", torch.zeros(3, 32)), "mu_k"),
        (lambda t: t.pop("layers.1.r_v"), "missing tensor layers.1.r_v"),
        (lambda t: t.__setitem__("extra", torch.zeros(1)), "unexpected tensors"),
    ],
)
def test_hostile_tensors(artifact, corrupt, msg):
    path, _ = artifact
    _rewrite(path, corrupt)
    with pytest.raises(ValueError, match=msg):
        OscarRotations.from_pretrained(path)


def test_truncated_safetensors_and_bad_json(artifact):
    path, _ = artifact
    data = (path / WEIGHTS_NAME).read_bytes()
    (path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        OscarRotations.from_pretrained(path)
    (path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="corrupted OSCAR config JSON"):
        OscarRotations.from_pretrained(path)
    (path / CONFIG_NAME).write_text(json.dumps({"format_version": 1, "fingerprint": {}, "layers": {}}))
    with pytest.raises(ValueError, match="fingerprint"):
        OscarRotations.from_pretrained(path)


def test_bad_clip_in_json(artifact):
    path, _ = artifact
    doc = json.loads((path / CONFIG_NAME).read_text())
    doc["layers"]["0"]["clip_k"] = 1.7
    (path / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="clip ratio"):
        OscarRotations.from_pretrained(path)


def test_pickle_is_never_loaded(artifact):
    path, _ = artifact
    import pickle

    (path / WEIGHTS_NAME).write_bytes(pickle.dumps({"layers.0.r_k": torch.eye(2)}))
    with pytest.raises(ValueError, match="corrupted or truncated"):
        OscarRotations.from_pretrained(path)


def test_missing_paths(tmp_path):
    with pytest.raises(OSError, match="not found"):
        OscarRotations.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="missing oscar_config.json"):
        OscarRotations.from_pretrained(tmp_path / "empty")


def test_hub_repo_id_goes_through_huggingface_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="could not fetch OSCAR rotations 'someone/oscar-rot'"):
        OscarRotations.from_pretrained("someone/oscar-rot")


def test_builtin_needs_artifact_for_calibrated_methods():
    with pytest.raises(ValueError, match="needs a calibrated artifact"):
        OscarRotations.builtin(tiny_config("llama"), "oscar")


def test_non_contiguous_rotations_save_and_load(tmp_path):
    """Rotations made by transposes or slices (e.g. ``torch.linalg.qr(...)[0]``, which is column-major) save as they
    are: safetensors refuses non-contiguous tensors unless they are packed first."""
    rot = OscarRotations.builtin(tiny_model("llama"), "hadamard")
    lr = rot.layers[0]
    lr.r_k = lr.r_k.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, column-major
    assert not lr.r_k.is_contiguous()
    rot.save_pretrained(tmp_path)
    back = OscarRotations.from_pretrained(tmp_path)
    assert torch.equal(back.layers[0].r_k, lr.r_k) and back.layers[0].r_k.is_contiguous()
