"""The authors' rotation files (FutureMLS-Lab/OSCAR format): conversion to our artifact, the rotation
convention, hostile files (never unpickled), the Hub path and the CLI."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_hf import OscarCache, OscarRotations
from oscar_hf.calibration import calibrate
from oscar_hf.compat import cache_kwargs
from oscar_hf.hadamard import bit_reversal_permutation, hadamard_matrix, permutation_matrix
from oscar_hf.kernels.write_path import rotate_quantize_reference
from oscar_hf.quant import quantize_rows
from oscar_hf.rotations import LayerRotation
from script_utils import import_script
from tiny_models import tiny_config, tiny_model

REPO = Path(__file__).resolve().parents[1]
D = 32  # tiny_model head_dim


def _orth(d: int, seed: int) -> torch.Tensor:
    """A random orthogonal [d, d] float32 matrix (QR), not symmetric: a transposition shows."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def _reference_doc(mats: dict[int, torch.Tensor], objective: str = "qqt_r_h_pbr", **header) -> dict:
    """Exactly what rotation/compute_kv_rotation.py writes."""
    layers = {i: {"layer_id": i, "rotation": m, "eigenvalues": torch.linspace(2, 1, m.shape[-1])} for i, m in mats.items()}
    return {"format_version": 1, "objective": objective, "source_grouping": "layer", "layers": layers, **header}


def _write(path: Path, mats, objective="qqt_r_h_pbr", **header) -> Path:
    torch.save(_reference_doc(mats, objective, **header), path)
    return path


def _pair(tmp_path, k_mats, v_mats=None):
    v_mats = k_mats if v_mats is None else v_mats
    return (_write(tmp_path / "k_rotation_qqt_r_h_pbr.pt", k_mats),
            _write(tmp_path / "v_rotation_sst_r_h_pbr.pt", v_mats, "sst_r_h_pbr"))


def _ours(model, r_k: dict, r_v: dict, clip_k=0.96, clip_v=0.92) -> OscarRotations:
    """Our own artifact with the given per-layer matrices replicated over the KV heads, no offsets."""
    ref = OscarRotations.builtin(model, "identity")
    hk, d = ref.fingerprint.num_key_value_heads, ref.fingerprint.head_dim
    layers = {i: LayerRotation(r_k[i].expand(hk, d, d).contiguous(), r_v[i].expand(hk, d, d).contiguous(), clip_k, clip_v)
              for i in ref.layers}
    return OscarRotations(ref.fingerprint, "ours", layers)


def _generate(model, cache, ids, new=3, **kw):
    return model.generate(ids, max_new_tokens=new, do_sample=False, **cache_kwargs(model, cache), **kw)


def _logits(model, cache, ids, new=6):
    out = _generate(model, cache, ids, new, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _v2(mats: dict[int, torch.Tensor], k_means: dict | None = None, objective="qqt_r_h_pbr", **extra) -> dict:
    """A format_version 2 file: per-KV-head rotations (or a shared [D, D] one), optional k_mean and extra fields."""
    doc = _reference_doc(mats, objective, format_version=2, source_grouping="per_kv_head")
    for i, entry in doc["layers"].items():
        if k_means is not None:
            entry["k_mean"] = k_means[i]
        entry.update(extra)
    return doc


# ---------------------------------------------------------------------------------------------- conversion
def test_file_from_our_calibration_gives_the_same_cache_outputs(tmp_path):
    """Our calibrated rotations (head 0's, shared across heads) written in the authors' format, converted and
    saved as our artifact, generate exactly what our artifact with those matrices generates -- and not what
    the transposed matrices generate (so a transposition in the conversion would fail here)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    cal = calibrate(model, None, ids, method="oscar", group_size=16, center=False, clip_grid=None, window=None,
                    progress=False)
    r_k = {i: lr.r_k[0].clone() for i, lr in cal.layers.items()}
    r_v = {i: lr.r_v[0].clone() for i, lr in cal.layers.items()}
    assert all((r - r.T).abs().max() > 1e-3 for r in r_k.values())  # not symmetric
    k_file, v_file = _pair(tmp_path, r_k, r_v)

    rot = OscarRotations.from_reference(k_file, v_file, model, group_size=16)
    assert rot.method == "oscar-reference" and not rot.has_offsets and set(rot.layers) == {0, 1}
    assert rot.clips() == {0: (0.96, 0.92), 1: (0.96, 0.92)}
    src = rot.metadata["source"]
    assert (src["k_file"], src["v_file"]) == (k_file.name, v_file.name)
    assert (src["k_objective"], src["v_objective"]) == ("qqt_r_h_pbr", "sst_r_h_pbr")
    for i in (0, 1):
        assert rot.layers[i].r_k.shape == (2, D, D) and torch.equal(rot.layers[i].r_k[1], r_k[i])
        assert torch.equal(rot.layers[i].r_v[0], r_v[i])
    rot.save_pretrained(tmp_path / "art")

    prompt = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(sink=4, recent=8)
    seq, got = _logits(model, OscarCache.from_pretrained(tmp_path / "art", model, **kw), prompt)
    seq_ref, want = _logits(model, OscarCache(model, _ours(model, r_k, r_v), group_size=16, **kw), prompt)
    assert torch.equal(seq, seq_ref) and torch.equal(got, want)
    t = {i: r.T.contiguous() for i, r in r_k.items()}
    _, transposed = _logits(model, OscarCache(model, _ours(model, t, r_v), group_size=16, **kw), prompt)
    assert (transposed - want).abs().max() > 1e-4


def test_convention_authors_formula_is_applied_as_k_at_R():
    """The authors' R = U · H · P_br (U: eigenvectors of the key covariance as columns, descending) equalizes
    channel energy only as ``k @ R``; our write path applies the converted matrix exactly that way."""
    g = torch.Generator().manual_seed(0)
    basis = _orth(D, 3).double()
    x = (torch.randn(4096, D, generator=g, dtype=torch.float64) * torch.logspace(1, -1, D, dtype=torch.float64)) @ basis.T
    cov = x.T @ x / x.shape[0]
    evals, evecs = torch.linalg.eigh(cov)
    u = evecs.flip(-1)  # descending
    perm = permutation_matrix(bit_reversal_permutation(D), torch.float64)
    r = (u @ hadamard_matrix(D, torch.float64) @ perm).float()

    def spread(rows):
        e = rows.pow(2).mean(0)
        return (e.max() / e.min()).item()

    xf = x.float()
    assert spread(xf @ r) < 1.05 < 3 < spread(xf @ r.T)
    # the write path: rotate_quantize_reference(x, r) == quantize(x @ r), != quantize(x @ r.T)
    rows = xf[:64].reshape(1, 1, 64, D)
    q = rotate_quantize_reference(rows, r[None], None, 0.96, 16, torch.float32)
    assert torch.equal(q.codes, quantize_rows(rows @ r, 16, 0.96, torch.float32).codes)
    assert not torch.equal(q.codes, quantize_rows(rows @ r.T, 16, 0.96, torch.float32).codes)


def test_sliding_layers_may_be_absent_or_are_dropped(tmp_path):
    model = tiny_model("gemma3_text")  # layer_types: sliding, full
    only_full = _pair(tmp_path, {1: _orth(D, 1)})
    rot = OscarRotations.from_reference(*only_full, model)
    assert set(rot.layers) == {1} and rot.metadata["group_size"] == D  # 128 does not divide head_dim 32
    (tmp_path / "all").mkdir()
    rot_all = OscarRotations.from_reference(*_pair(tmp_path / "all", {0: _orth(D, 0), 1: _orth(D, 1)}), model)
    assert set(rot_all.layers) == {1} and rot_all.metadata["source"]["layers_in_files"] == 2
    out = _generate(model, OscarCache(model, rot, sink=4, recent=8, group_size=D), torch.randint(1, 256, (1, 30)))
    assert out.shape[1] == 33
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match=r"no rotation for full-attention layers \[1\]"):
        OscarRotations.from_reference(*_pair(tmp_path / "none", {0: _orth(D, 0)}), model)


def test_smollm2_conversion_round_trip(smollm2, tmp_path):
    model, _ = smollm2
    d, n = model.config.head_dim, model.config.num_hidden_layers
    r_k = {i: _orth(d, i) for i in range(n)}
    r_v = {i: _orth(d, 100 + i) for i in range(n)}
    rot = OscarRotations.from_reference(*_pair(tmp_path, r_k, r_v), model)
    assert len(rot.layers) == n and rot.layers[0].r_k.shape == (3, d, d) and rot.metadata["group_size"] == d
    rot.save_pretrained(tmp_path / "art")
    back = OscarRotations.from_pretrained(tmp_path / "art")
    assert back.method == "oscar-reference" and back.metadata == rot.metadata
    assert all(torch.equal(back.layers[i].r_v[2], r_v[i]) for i in range(n))
    prompt = torch.randint(1, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    kw = dict(sink=8, recent=16)
    got = _logits(model, OscarCache.from_pretrained(tmp_path / "art", model, **kw), prompt, new=3)[1]
    want = _logits(model, OscarCache(model, _ours(model, r_k, r_v), group_size=d, **kw), prompt, new=3)[1]
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- hostile files
def _mark(path):
    """What a hostile pickle would run on load (harmless here: it writes a file)."""
    Path(path).write_text("ran")
    return torch.eye(D)


class _RunsCode:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("where", ["top", "rotation", "eigenvalues"])
@pytest.mark.parametrize("fn", ["marker", "os.system"])
def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, where, fn):
    marker = tmp_path / "ran.txt"
    payload = _RunsCode(_mark, str(marker)) if fn == "marker" else _RunsCode(os.system, f"touch {marker}")
    doc = _reference_doc({0: _orth(D, 0), 1: _orth(D, 1)})
    if where == "top":
        doc["extra"] = payload
    else:
        doc["layers"][1][where] = payload
    hostile = tmp_path / "k_rotation_qqt_r_h_pbr.pt"
    torch.save(doc, hostile)
    good = _write(tmp_path / "v.pt", {0: _orth(D, 2), 1: _orth(D, 3)})
    for k, v in ((hostile, good), (good, hostile)):
        with pytest.raises(ValueError, match=r"k_rotation_qqt_r_h_pbr\.pt: not a plain-tensor rotation file"):
            OscarRotations.from_reference(k, v, tiny_config("llama"))
    assert not marker.exists(), "the hostile pickle ran code"
    if fn == "marker":  # the file is truly hostile: a full unpickle runs its code
        torch.load(hostile, weights_only=False)
        assert marker.read_text() == "ran"


def _bad(mats=None, **header):
    mats = {0: _orth(D, 0), 1: _orth(D, 1)} if mats is None else mats
    return _reference_doc(mats, **header)


def _nan():
    m = _orth(D, 1)
    m[3, 4] = float("nan")
    return m


@pytest.mark.parametrize(
    "doc,msg",
    [
        (_bad({0: _orth(16, 0), 1: _orth(16, 1)}), r"layer 0 rotation: shape \(16, 16\) does not match the model's \(32, 32\)"),
        (_bad({0: _orth(D, 0)}), r"no rotation for full-attention layers \[1\]"),
        (_bad({0: _orth(D, 0), 1: _nan()}), "layer 1 rotation: contains NaN or Inf"),
        (_bad({0: _orth(D, 0), 1: _orth(D, 1) * 1.1}), r"layer 1 rotation: not orthogonal \(max \|RᵀR - I\| = 0.21"),
        (_bad({0: _orth(D, 0), 1: torch.eye(D, dtype=torch.int64)}), "layer 1 rotation: expected a float tensor"),
        (_bad({0: _orth(D, 0), 1: _orth(D, 1), 2: _orth(D, 2)}), r"rotations for layers \[2\], but the model has 2"),
        (_bad(format_version=3), "unsupported format_version 3"),
        (_bad(format_version=2), "unsupported source_grouping 'layer' for format_version 2"),
        (_bad(source_grouping="kv_head"), "unsupported source_grouping 'kv_head'"),
        (_bad(objective=3), "'objective' must be a string"),
        ({"format_version": 1, "source_grouping": "layer", "layers": {}}, "'layers' must be a non-empty dict"),
        (_orth(D, 0), "expected a dict with 'format_version'"),
    ],
    ids=["head_dim", "missing_layer", "nan", "not_orthogonal", "int", "extra_layer", "version", "v2_grouping", "grouping",
         "objective", "no_layers", "bare_tensor"],
)
def test_invalid_files_are_refused(tmp_path, doc, msg):
    bad, good = tmp_path / "bad.pt", _write(tmp_path / "good.pt", {0: _orth(D, 0), 1: _orth(D, 1)})
    torch.save(doc, bad)
    for k, v in ((bad, good), (good, bad)):
        with pytest.raises(ValueError, match=msg) as e:
            OscarRotations.from_reference(k, v, tiny_config("llama"))
        assert "bad.pt" in str(e.value)


def test_layer_id_mismatch_and_garbage_are_refused(tmp_path):
    good = _write(tmp_path / "good.pt", {0: _orth(D, 0), 1: _orth(D, 1)})
    doc = _bad()
    doc["layers"][1]["layer_id"] = 0
    torch.save(doc, tmp_path / "ids.pt")
    with pytest.raises(ValueError, match="ids.pt: layer 1 has layer_id=0"):
        OscarRotations.from_reference(tmp_path / "ids.pt", good, tiny_config("llama"))
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02junk that is no pickle")
    with pytest.raises(ValueError, match="junk.pt: not a"):
        OscarRotations.from_reference(tmp_path / "junk.pt", good, tiny_config("llama"))


def test_key_and_value_files_must_agree(tmp_path):
    three, two = {i: _orth(D, i) for i in range(3)}, {i: _orth(D, i) for i in range(2)}
    k, v = _pair(tmp_path, three, two)
    with pytest.raises(ValueError, match=r"v_rotation_sst_r_h_pbr.pt: no rotation for full-attention layers \[2\]"):
        OscarRotations.from_reference(k, v, tiny_config("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"k_rotation_qqt_r_h_pbr.pt: rotations for layers \[2\], but the model has 2"):
        OscarRotations.from_reference(k, v, tiny_config("llama"))
    k, v = _pair(tmp_path, two, {1: two[1]})  # Gemma 3: layer 0 is sliding, so only the files' layer sets differ
    with pytest.raises(ValueError, match=r"disagree: layers only in k_rotation_qqt_r_h_pbr.pt: \[0\], only in "
                                         r"v_rotation_sst_r_h_pbr.pt: \[\]"):
        OscarRotations.from_reference(k, v, tiny_config("gemma3_text"))


def test_bad_arguments_and_missing_files(tmp_path):
    k, v = _pair(tmp_path, {0: _orth(D, 0), 1: _orth(D, 1)})
    cfg = tiny_config("llama")
    with pytest.raises(OSError, match="nope.pt' does not exist"):
        OscarRotations.from_reference(tmp_path / "nope.pt", v, cfg)
    with pytest.raises(OSError, match="is a directory"):
        OscarRotations.from_reference(k, tmp_path, cfg)
    with pytest.raises(ValueError, match="clip_v: clip ratio must be a float in"):
        OscarRotations.from_reference(k, v, cfg, clip_v=1.5)
    with pytest.raises(ValueError, match="group_size=24 does not divide head_dim=32"):
        OscarRotations.from_reference(k, v, cfg, group_size=24)


# ---------------------------------------------------------------------------------------------- Hub
def test_hub_files_go_through_hf_hub_download(tmp_path, monkeypatch):
    import huggingface_hub

    k, v = _pair(tmp_path, {0: _orth(D, 0), 1: _orth(D, 1)})
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    rot = OscarRotations.from_reference(k.name, v.name, tiny_config("llama"), repo_id="org/RotationZoo",
                                        subfolder="Qwen3-8B", revision="abc")
    assert [c[:2] for c in calls] == [("org/RotationZoo", k.name), ("org/RotationZoo", v.name)]
    assert calls[0][2]["subfolder"] == "Qwen3-8B" and calls[0][2]["revision"] == "abc"
    assert calls[0][2]["local_files_only"] is False
    src = rot.metadata["source"]
    assert (src["repo_id"], src["subfolder"], src["revision"]) == ("org/RotationZoo", "Qwen3-8B", "abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: only cached copies
    calls.clear()
    OscarRotations.from_reference(k.name, v.name, tiny_config("llama"), repo_id="org/RotationZoo")
    assert all(c[2]["local_files_only"] is True for c in calls)


def test_hub_file_not_cached_offline_is_an_oserror(tmp_path):
    with pytest.raises(OSError, match=r"could not fetch reference rotation file 'org/zoo/m/k.pt' from the Hub \(offline"):
        OscarRotations.from_reference("k.pt", "v.pt", tiny_config("llama"), repo_id="org/zoo", subfolder="m",
                                      local_files_only=True, cache_dir=str(tmp_path / "empty-cache"))


# ---------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _cli():
    return import_script("convert_reference_rotations")


def test_cli_converts_refuses_to_overwrite_and_refuses_hostile_files(tiny_dir, tmp_path, capsys):
    cli = _cli()
    r = {0: _orth(D, 0), 1: _orth(D, 1)}
    k, v = _pair(tmp_path, r)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--k", str(k), "--v", str(v), "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 layers x 2 KV heads, head_dim 32, clip K/V 0.96/0.92" in printed and "qqt_r_h_pbr" in printed
    rot = OscarRotations.from_pretrained(out)
    assert rot.method == "oscar-reference" and torch.equal(rot.layers[1].r_k[0], r[1])
    before = (out / "oscar_rotations.safetensors").read_bytes()
    assert cli.main(argv) == cli.EXIT_EXISTS
    assert "--force" in capsys.readouterr().err
    assert (out / "oscar_rotations.safetensors").read_bytes() == before
    assert cli.main(argv + ["--force", "--clip-k", "0.9", "--group-size", "16"]) == 0
    back = OscarRotations.from_pretrained(out)
    assert back.clips()[0] == (0.9, 0.92) and back.metadata["group_size"] == 16
    doc = _reference_doc(r)
    doc["layers"][0]["eigenvalues"] = _RunsCode(_mark, str(tmp_path / "ran.txt"))
    torch.save(doc, tmp_path / "evil.pt")
    assert cli.main(["--model", str(tiny_dir), "--k", str(tmp_path / "evil.pt"), "--v", str(v), "--out",
                     str(tmp_path / "out2")]) == cli.EXIT_INVALID
    assert "not a plain-tensor rotation file" in capsys.readouterr().err
    assert not (tmp_path / "ran.txt").exists() and not (tmp_path / "out2").exists()


def test_cli_script_end_to_end(tiny_dir, tmp_path):
    k, v = _pair(tmp_path, {0: _orth(D, 0), 1: _orth(D, 1)})
    cmd = [sys.executable, "-P", str(REPO / "scripts/convert_reference_rotations.py"), "--model", str(tiny_dir),
           "--k", str(k), "--v", str(v), "--out", str(tmp_path / "art")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert '"layers": 2' in r.stdout
    model = tiny_model("llama")
    cache = OscarCache.from_pretrained(tmp_path / "art", model, sink=4, recent=8)
    assert cache.oscar_config.group_size == D  # recorded by the conversion (one group per head here)
    out = _generate(model, cache, torch.randint(1, 256, (1, 30)))
    assert out.shape[1] == 33
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 2 and "already contains an OSCAR artifact" in r2.stderr


# ---------------------------------------------------------------------------------------------- format_version 2
def test_format_2_per_head_rotations_and_key_mean_give_our_cache(tmp_path):
    """A format-2 pair (a rotation per KV head, k_mean per head in the key file, q/o rotations present) converts to
    our artifact with those per-head matrices and the mean as the key offset: the cache generates exactly what our
    artifact with the same tensors generates, and not what it generates without the offset."""
    model = tiny_model("llama")
    hk = model.config.num_key_value_heads
    r_k = {i: torch.stack([_orth(D, 10 * i + h) for h in range(hk)]) for i in (0, 1)}  # [Hk, D, D], heads differ
    r_v = {i: torch.stack([_orth(D, 50 + 10 * i + h) for h in range(hk)]) for i in (0, 1)}
    mu = {i: torch.randn(hk, D, generator=torch.Generator().manual_seed(i)) for i in (0, 1)}
    torch.save(_v2(r_k, mu, q_rotation=torch.eye(D), o_rotation=torch.eye(D)), k_file := tmp_path / "k2.pt")
    torch.save(_v2(r_v, objective="sst_r_h_pbr"), v_file := tmp_path / "v2.pt")
    rot = OscarRotations.from_reference(k_file, v_file, model, group_size=16)
    src = rot.metadata["source"]
    assert (src["format_version"], src["source_grouping"], src["key_centering"]) == (2, "per_kv_head", True)
    assert not src["shared_across_heads"] and src["unused_fields"] == ["o_rotation", "q_rotation"]
    for i in (0, 1):
        assert torch.equal(rot.layers[i].r_k, r_k[i]) and torch.equal(rot.layers[i].r_v, r_v[i])
        assert torch.equal(rot.layers[i].mu_k, mu[i]) and rot.layers[i].mu_v is None
    rot.save_pretrained(tmp_path / "art")
    ours = OscarRotations(rot.fingerprint, "ours", {i: LayerRotation(r_k[i], r_v[i], 0.96, 0.92, mu_k=mu[i])
                                                    for i in (0, 1)})
    plain = OscarRotations(rot.fingerprint, "ours", {i: LayerRotation(r_k[i], r_v[i], 0.96, 0.92) for i in (0, 1)})
    prompt = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(sink=4, recent=8)
    seq, got = _logits(model, OscarCache.from_pretrained(tmp_path / "art", model, **kw), prompt)
    seq_ref, want = _logits(model, OscarCache(model, ours, group_size=16, **kw), prompt)
    assert torch.equal(seq, seq_ref) and torch.equal(got, want)
    _, uncentered = _logits(model, OscarCache(model, plain, group_size=16, **kw), prompt)
    assert (uncentered - want).abs().max() > 1e-5


def test_format_2_shared_rotations_and_one_mean_for_the_layer(tmp_path):
    """Format 2 still takes a layer's [D, D] rotation (shared by its heads) and a [D] k_mean (repeated)."""
    mats = {0: _orth(D, 0), 1: _orth(D, 1)}
    means = {0: torch.ones(D), 1: torch.zeros(D)}
    torch.save(_v2(mats, means), k_file := tmp_path / "k.pt")
    torch.save(_v2(mats), v_file := tmp_path / "v.pt")
    rot = OscarRotations.from_reference(k_file, v_file, tiny_config("llama"))
    assert rot.metadata["source"]["shared_across_heads"]
    assert rot.layers[0].r_k.shape == (2, D, D) and torch.equal(rot.layers[0].r_k[1], mats[0])
    assert torch.equal(rot.layers[0].mu_k, torch.ones(2, D))


@pytest.mark.parametrize(
    "k_doc,v_doc,msg",
    [
        (_v2({0: torch.stack([_orth(D, 0)] * 3), 1: _orth(D, 1)}), None,
         r"layer 0 rotation: shape \(3, 32, 32\) does not match .*num_kv_heads=2"),
        (_v2({0: torch.stack([_orth(D, 0), _orth(D, 1) * 1.1]), 1: _orth(D, 1)}), None, "layer 0 rotation: not orthogonal"),
        (_v2({0: _orth(D, 0), 1: _orth(D, 1)}, {0: torch.zeros(3, D), 1: torch.zeros(D)}), None,
         r"layer 0 k_mean: shape \(3, 32\)"),
        (_v2({0: _orth(D, 0), 1: _orth(D, 1)}, {0: torch.full((D,), float("nan")), 1: torch.zeros(D)}), None,
         "layer 0 k_mean: contains NaN"),
        (dict(_bad(), layers={i: dict(e, k_mean=torch.zeros(D)) for i, e in _bad()["layers"].items()}), None,
         "'k_mean' is a format_version 2 field"),
        (_v2({0: _orth(D, 0), 1: _orth(D, 1)}), _v2({0: _orth(D, 0), 1: _orth(D, 1)}, {0: torch.zeros(D), 1: torch.zeros(D)}),
         "a value rotation file with k_mean"),
        ({**_v2({0: _orth(D, 0), 1: _orth(D, 1)}),
          "layers": {0: {"rotation": _orth(D, 0), "k_mean": torch.zeros(D)}, 1: {"rotation": _orth(D, 1)}}}, None,
         r"k_mean for some full-attention layers but not for \[1\]"),
    ],
    ids=["heads", "not_orthogonal", "mean_shape", "mean_nan", "mean_in_v1", "mean_in_values", "mean_partial"],
)
def test_invalid_format_2_files_are_refused(tmp_path, k_doc, v_doc, msg):
    torch.save(k_doc, k_file := tmp_path / "k.pt")
    torch.save(v_doc if v_doc is not None else _v2({0: _orth(D, 0), 1: _orth(D, 1)}), v_file := tmp_path / "v.pt")
    with pytest.raises(ValueError, match=msg):
        OscarRotations.from_reference(k_file, v_file, tiny_config("llama"))
