"""Calibration: statistics hook vs brute force, held-out error vs brute force, end to end on SmolLM2
and tiny models of every supported family, artifact round trip, CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_hf import data
from oscar_hf.calibration import attention_error, calibrate, calibration_report, collect_statistics, plot_spectra
from oscar_hf.calibration.hooks import recording
from oscar_hf.calibration.search import CLIP_GRID, ErrorRecorder, LayerCandidates, eigvecs_desc, quant_error, select_best
from oscar_hf.calibration.stats import StatsRecorder, full_attention_layers
from oscar_hf.config import ModelFingerprint
from oscar_hf.hadamard import oscar_rotation
from oscar_hf.patching import base_attention_function, patched, register_handler
from oscar_hf.quant import dequantize_rows, quantize_rows
from oscar_hf.rotations import OscarRotations
from script_utils import import_script
from tiny_models import tiny_model

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------- capture
_CAPTURED: list = []


def _capture(module, query, key, value, attention_mask, *args, base, **kwargs):
    out = base_attention_function(module, base)(module, query, key, value, attention_mask, *args, **kwargs)
    _CAPTURED.append(dict(layer=module.layer_idx, q=query.clone(), k=key.clone(), v=value.clone(), o=out[0].clone(),
                          scaling=kwargs.get("scaling")))
    return out


register_handler("oscartestcap_", _capture)


def _padded_batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, -5:] = 0  # right padding
    return ids, mask


def _activations(model, ids, mask):
    _CAPTURED.clear()
    with patched(model, "oscartestcap_"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return {c["layer"]: c for c in _CAPTURED}


def _brute_force(c, mask):
    """Per KV head: pooled queries, keys, values, outputs of real tokens only (float64)."""
    q, k, v, o = (c[n].double() for n in "qkvo")
    b, hq, _, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    out = {n: [] for n in "QKVO"}
    for h in range(hk):
        rows = {n: [] for n in "QKVO"}
        for bi in range(b):
            pos = mask[bi].bool()
            rows["K"].append(k[bi, h][pos])
            rows["V"].append(v[bi, h][pos])
            for j in range(h * g, (h + 1) * g):  # repeat_kv: query head j reads KV head j // g
                rows["Q"].append(q[bi, j][pos])
                rows["O"].append(o[bi, :, j][pos])
        for n in "QKVO":
            out[n].append(torch.cat(rows[n]))
    return out


@pytest.mark.parametrize("kv_heads,impl", [(2, "sdpa"), (2, "eager"), (4, "sdpa")], ids=["gqa-sdpa", "gqa-eager", "mha"])
def test_statistics_match_brute_force_with_padding(kv_heads, impl):
    model = tiny_model("llama", num_key_value_heads=kv_heads, attn_implementation=impl)
    ids, mask = _padded_batch(model.config.vocab_size)
    acts = _activations(model, ids, mask)
    rec = StatsRecorder(full_attention_layers(ModelFingerprint.from_config(model.config)))
    with recording(model, rec):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        rec.start_score_weighted()
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert model.config._attn_implementation == impl
    n_tok = int(mask.sum())
    for i, c in acts.items():
        bf = _brute_force(c, mask)
        s = rec.stats[i]
        assert s.n_kv == n_tok and s.n_q == n_tok * (4 // kv_heads)
        for h in range(kv_heads):
            Q, K, V, O = bf["Q"][h], bf["K"][h], bf["V"][h], bf["O"][h]
            mu_k, mu_v = K.mean(0), V.mean(0)
            close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)  # noqa: E731
            close(s.mu_k[h], mu_k)
            close(s.mu_v[h], mu_v)
            close(s.c_q()[h], Q.T @ Q / len(Q))
            close(s.c_s()[h], O.T @ O / len(O))
            close(s.c_s(center=True)[h], (O - mu_v).T @ (O - mu_v) / len(O))
            close(s.c_k()[h], K.T @ K / len(K))
            close(s.c_k(center=True)[h], (K - mu_k).T @ (K - mu_k) / len(K))
            close(s.c_v(center=True)[h], (V - mu_v).T @ (V - mu_v) / len(V))
            cq = Q.T @ Q / len(Q)
            w = ((K @ cq) * K).sum(-1)
            close(s.c_sw()[h], (V * w[:, None]).T @ V / w.sum())
            close(s.c_sw(center=True)[h], ((V - mu_v) * w[:, None]).T @ (V - mu_v) / w.sum())
        # the padded tokens really are different data: including them would change the statistics
        k_all = c["k"].double()[:, 0].reshape(-1, c["k"].shape[-1])
        assert not torch.allclose(s.mu_k[0], k_all.mean(0))
    # kv_skip: the first 3 real tokens of each sequence leave the key/value statistics only
    rec3 = StatsRecorder(rec.layers, kv_skip=3)
    with recording(model, rec3):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    skip_mask = mask * (mask.cumsum(1) > 3)
    for i, c in acts.items():
        bf, bf_all = _brute_force(c, skip_mask), _brute_force(c, mask)
        s3 = rec3.stats[i]
        assert s3.n_kv == int(skip_mask.sum()) and s3.n_q == rec.stats[i].n_q
        for h in range(kv_heads):
            K, V = bf["K"][h], bf["V"][h]
            torch.testing.assert_close(s3.mu_k[h], K.mean(0), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(s3.c_v(center=True)[h], (V - V.mean(0)).T @ (V - V.mean(0)) / len(V))
            Q = bf_all["Q"][h]
            torch.testing.assert_close(s3.c_q()[h], Q.T @ Q / len(Q))


def test_quant_error_is_the_reference_quantizer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.rand(64, generator=g) * 4
    x[0, 0] = 0.5  # a constant row (zero range)
    clips = torch.tensor([0.8, 0.9, 1.0])
    for meta in (torch.bfloat16, torch.float32):
        for gs in (16, 64):
            e = quant_error(x, clips, gs, meta)
            for j, c in enumerate(clips.tolist()):
                ref = dequantize_rows(quantize_rows(x, gs, c, meta), gs) - x
                assert torch.equal(e[..., j, :], ref)


@pytest.mark.parametrize("window", [None, (2, 3)], ids=["all-pairs", "history-only"])
def test_heldout_errors_match_brute_force(window):
    """Key: Σ (scaling q·Δk)² over (query head, query, key) pairs of a sequence; value:
    Σ ||Σ_j p_ij Δv_j||² with the true attention probabilities; padded tokens excluded. With a
    (sink, recent) window only history pairs count: sink <= j < i - recent."""
    model = tiny_model("llama")
    ids, mask = _padded_batch(model.config.vocab_size, seed=1)
    acts = _activations(model, ids, mask)
    hk, d, gs = 2, 32, 16
    g = torch.Generator().manual_seed(3)
    rots = torch.linalg.qr(torch.randn(2, hk, d, d, generator=g))[0]
    mu = torch.randn(hk, d, generator=g) * 0.1
    clips = torch.tensor([0.84, 1.0])
    cands = {i: LayerCandidates(rots, rots.flip(0), mu, -mu, clips, clips) for i in acts}
    rec = ErrorRecorder(cands, gs, torch.float32, query_samples=1000, window=window)
    with recording(model, rec):
        model(input_ids=ids, attention_mask=mask, use_cache=False)

    def roundtrip(x, r, m, clip):
        xr = (x.float() - m) @ r
        xh = dequantize_rows(quantize_rows(xr, gs, clip, torch.float32), gs).double()
        return xh @ r.double().T + m.double()

    for i, c in acts.items():
        q, k, v = (c[n].double() for n in "qkv")
        sc = c["scaling"]
        e = rec.errors[i]
        k_count = v_count = 0
        for ci in range(2):
            for j, clip in enumerate(clips.tolist()):
                for h in range(hk):
                    ek = ev = 0.0
                    for bi in range(3):
                        pos = mask[bi].bool()
                        kb, vb = k[bi, h][pos], v[bi, h][pos]
                        dk = roundtrip(kb, rots[ci, h], mu[h], clip) - kb
                        dv = roundtrip(vb, rots.flip(0)[ci, h], -mu[h], clip) - vb
                        n = int(pos.sum())
                        causal = torch.ones(n, n, dtype=torch.bool).tril()
                        t = torch.arange(n)
                        if window is None:
                            pairs, rows = torch.ones(n, n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)
                        else:
                            pairs = (t[None, :] >= window[0]) & (t[None, :] < t[:, None] - window[1])
                            rows = pairs.any(1)
                        for qh in range(2 * h, 2 * h + 2):
                            qb = q[bi, qh][pos]
                            ek += float((((sc * qb @ dk.T) ** 2) * pairs)[rows].sum())
                            p = torch.softmax((sc * qb @ kb.T).masked_fill(~causal, float("-inf")), -1)
                            ev += float(((p * pairs)[rows] @ dv).pow(2).sum())
                            if ci == j == h == 0:
                                k_count += int(pairs[rows].sum())
                                v_count += int(rows.sum())
                    torch.testing.assert_close(float(e.k[ci, j, h]), ek, rtol=2e-4, atol=1e-9)
                    torch.testing.assert_close(float(e.v[ci, j, h]), ev, rtol=2e-4, atol=1e-9)
        assert e.k_count == k_count and e.v_count == v_count
        assert float(e.k.min()) > 0 and float(e.v.min()) > 0


def test_select_best_is_joint_per_layer():
    # candidates x clips x heads
    e = torch.tensor([[[1.0, 5.0], [2.0, 2.0]], [[3.0, 1.0], [1.0, 3.0]]])
    # clip 0: best per head = (1, 1) -> 2 ; clip 1: (1, 2) -> 3
    assert select_best(e) == (0, [0, 1])
    assert select_best(torch.ones(1, 3, 2)) == (2, [0, 0])  # ties: the largest clip ratio


# ---------------------------------------------------------------------------------------------- end to end
def _check_artifact(rot: OscarRotations, model, center=True):
    fp = ModelFingerprint.from_config(model.config)
    assert sorted(rot.layers) == full_attention_layers(fp)
    assert all(t == "full_attention" for i, t in enumerate(fp.layer_types) if i in rot.layers)
    d = fp.head_dim
    for lr in rot.layers.values():
        for r in (lr.r_k, lr.r_v):
            assert r.shape == (fp.num_key_value_heads, d, d) and r.dtype == torch.float32
            torch.testing.assert_close(r.transpose(1, 2) @ r, torch.eye(d).expand_as(r), atol=1e-5, rtol=0)
        assert (lr.mu_k is not None) == center and (lr.mu_v is not None) == center
        assert lr.clip_k in CLIP_GRID and lr.clip_v in CLIP_GRID
    rot.validate()


def test_calibrate_tiny_models_every_family(tiny):
    """Every family (sliding layers of Gemma 2/3 skipped; Phi-3 head_dim 96 with G=32), method auto."""
    model = tiny
    impl = model.config._attn_implementation
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    gs = 32 if model.config.model_type == "phi3" else 16
    rot = calibrate(model, None, ids, method="auto", group_size=gs, window=(4, 8), progress=False)
    _check_artifact(rot, model)
    assert model.config._attn_implementation == impl
    fp = ModelFingerprint.from_config(model.config)
    if "sliding_attention" in fp.layer_types:
        assert len(rot.layers) < fp.num_layers
    md = rot.metadata
    assert md["calibration"]["group_size"] == gs and md["calibration"]["holdout_windows"] == 1
    assert set(md["auto_counts"]["k"]) <= {"identity", "hadamard", "oscar", "pca-kv"}
    assert sum(md["auto_counts"]["v"].values()) == len(rot.layers) * fp.num_key_value_heads


def test_methods_build_the_documented_rotations():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    stats = collect_statistics(model, ids, score_weighted=True)
    one = dict(progress=False, group_size=16, clip_grid=None, window=None)
    for method, vt in (("oscar", "sst"), ("oscar", "score-weighted"), ("pca-kv", "sst")):
        rot = calibrate(model, None, ids, method=method, value_target=vt, **one)
        for i, lr in rot.layers.items():
            s = stats.layers[i]
            ck = s.c_q() if method == "oscar" else s.c_k(center=True)
            cv = {"oscar": {"sst": s.c_s(True), "score-weighted": s.c_sw(True)}, "pca-kv": {"sst": s.c_v(True)}}[method][vt]
            torch.testing.assert_close(lr.r_k, oscar_rotation(eigvecs_desc(ck)[1]), atol=1e-5, rtol=0)
            torch.testing.assert_close(lr.r_v, oscar_rotation(eigvecs_desc(cv)[1]), atol=1e-5, rtol=0)
            assert lr.clip_k == lr.clip_v == 1.0
    rot = calibrate(model, None, ids, method="hadamard", center=False, **one)
    assert rot.layers[0].mu_k is None and not rot.has_offsets
    torch.testing.assert_close(rot.layers[0].r_k, OscarRotations.builtin(model, "hadamard").layers[0].r_k)


def test_center_auto_chooses_offsets_per_head():
    model = tiny_model("qwen3")
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    rot = calibrate(model, None, ids, method="oscar", center="auto", group_size=16, window=(4, 8), progress=False)
    stats = collect_statistics(model, ids[:3], kv_skip=4)
    for i, lr in rot.layers.items():
        for kind, mu, ref in (("k", lr.mu_k, stats.layers[i].mu_k), ("v", lr.mu_v, stats.layers[i].mu_v)):
            names = rot.metadata["winners"][kind][str(i)]
            assert set(names) <= {"oscar", "oscar+center"}
            for h, name in enumerate(names):
                if name.endswith("+center"):
                    torch.testing.assert_close(mu[h], ref[h].float())
                else:
                    assert not mu[h].any()
    assert rot.metadata["calibration"]["center"] == "auto"
    assert sum(rot.metadata["auto_counts"]["k"].values()) == 2 * 2


def test_plot_spectra_from_statistics(tmp_path):
    model = tiny_model("gemma3_text")
    stats = collect_statistics(model, torch.randint(0, 256, (1, 24)))
    assert sorted(stats.layers) == [1]  # the sliding layer 0 is skipped
    plot_spectra(stats, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(TypeError):
        plot_spectra(object(), tmp_path / "x.png")


def test_eigvecs_descending_and_sign_fixed():
    a = torch.randn(2, 8, 8, dtype=torch.float64)
    c = a @ a.transpose(1, 2)
    w, u = eigvecs_desc(c)
    assert (w[:, :-1] >= w[:, 1:]).all()
    torch.testing.assert_close(u @ torch.diag_embed(w) @ u.transpose(1, 2), c)
    idx = u.abs().argmax(1)
    assert (torch.gather(u, 1, idx[:, None]) > 0).all()


def test_bad_arguments_are_refused():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(ValueError, match="method"):
        calibrate(model, None, ids, method="pca", progress=False)
    with pytest.raises(ValueError, match="value_target"):
        calibrate(model, None, ids, value_target="x", progress=False)
    with pytest.raises(ValueError, match="group_size=24"):
        calibrate(model, None, ids, group_size=24, progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        calibrate(model, None, ["some text"], progress=False, group_size=16)
    with pytest.raises(ValueError, match="clip"):
        calibrate(model, None, ids, clip_grid=(0.0, 1.0), progress=False, group_size=16)
    with pytest.raises(ValueError, match="at least 2"):
        calibrate(model, None, ids[:1], method="auto", progress=False, group_size=16)
    with pytest.raises(ValueError, match="window"):
        calibrate(model, None, ids, progress=False, group_size=16, window=(-1, 4))


def test_too_short_windows_get_a_fitted_window(caplog):
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger="oscar_hf"):
        rot = calibrate(model, None, ids, group_size=16, progress=False)  # default window (64, 256)
    assert rot.metadata["calibration"]["window"] == [5, 10]
    assert "too short" in caplog.text
    assert all(h["k_rel"] > 0 and h["v_rel"] > 0 for h in rot.metadata["heldout_error"].values())


def test_model_is_restored_after_an_error(monkeypatch):
    model = tiny_model("llama", attn_implementation="eager")
    model.train()

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(StatsRecorder, "__call__", boom)
    with pytest.raises(RuntimeError, match="boom"):
        calibrate(model, None, torch.randint(0, 256, (2, 16)), progress=False, group_size=16, window=None)
    assert model.config._attn_implementation == "eager"
    assert model.training


def test_progress_bar_honours_transformers_switch(capsys):
    from transformers.utils import logging as hf_logging

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16))
    hf_logging.disable_progress_bar()
    try:
        calibrate(model, None, ids, group_size=16, clip_grid=None, window=None, progress=True)
        assert "OSCAR calibration" not in capsys.readouterr().err
    finally:
        hf_logging.enable_progress_bar()
    calibrate(model, None, ids, group_size=16, clip_grid=None, window=None, progress=True)
    assert "OSCAR calibration" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smol_windows(smollm2, wikitext_text):
    _, tok = smollm2
    sp = data.split_texts(wikitext_text)
    heldout = data.token_windows(tok, sp.evaluation, seq_len=512, n=1)
    return sp.calibration, heldout


@pytest.fixture(scope="module")
def smol_oscar(smollm2, smol_windows):
    model, tok = smollm2
    cal, _ = smol_windows
    return {
        center: calibrate(model, tok, cal, method="oscar", tokens=512, seq_len=256, center=center, window=(16, 64),
                          clip_grid=(0.8, 0.9, 1.0), query_samples=64, progress=False, retrieval_probes=0)
        for center in (True, False)
    }


def test_smollm2_end_to_end_and_round_trip(smollm2, smol_oscar, tmp_path):
    model, _ = smollm2
    rot = smol_oscar[True]
    _check_artifact(rot, model)
    assert len(rot.layers) == 30
    md = rot.metadata["calibration"]
    assert md["tokens"] == 512 and md["windows"] == 2 and md["seq_len"] == 256 and md["holdout_tokens"] == 256
    assert md["group_size"] == 64 and md["method"] == "oscar" and md["time_s"] > 0 and md["window"] == [16, 64]
    assert set(rot.metadata["spectra"]["0"]) == {"C_Q", "C_K", "C_S", "C_V"}
    rot.save_pretrained(tmp_path / "art")
    back = OscarRotations.from_pretrained(tmp_path / "art")
    assert back.method == "oscar" and back.fingerprint == rot.fingerprint
    assert back.metadata == rot.metadata
    for i, lr in rot.layers.items():
        b = back.layers[i]
        assert torch.equal(b.r_k, lr.r_k) and torch.equal(b.r_v, lr.r_v) and torch.equal(b.mu_v, lr.mu_v)
        assert (b.clip_k, b.clip_v) == (lr.clip_k, lr.clip_v)
    back.check_compatible(model.config)
    with pytest.raises(ValueError, match=r"num_layers: artifact has 30, model has 2.*num_attention_heads"):
        back.check_compatible(tiny_model("llama").config)
    report = calibration_report(back)
    assert "method=oscar" in report and report.count("\n") > 30
    plot_spectra(back, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smollm2_oscar_beats_identity_and_centering_helps(smollm2, smol_oscar, smol_windows):
    """Held-out attention error (the library's own measure, on evaluation text) of naive INT2
    (identity) > OSCAR without offsets > OSCAR with offsets."""
    model, _ = smollm2
    _, heldout = smol_windows
    ident = OscarRotations.builtin(model, "identity")
    err = {
        "identity": attention_error(model, ident, heldout, query_samples=64),
        "oscar": attention_error(model, smol_oscar[False], heldout, query_samples=64),
        "oscar+center": attention_error(model, smol_oscar[True], heldout, query_samples=64),
    }
    tot = {k: v["total"] for k, v in err.items()}
    assert tot["identity"] > 2 * tot["oscar"], tot
    assert tot["oscar"] > tot["oscar+center"], tot
    for kind in ("k_rel", "v_rel"):
        assert err["identity"][kind] > err["oscar"][kind] > err["oscar+center"][kind], (kind, err)


def test_smollm2_auto(smollm2, smol_windows):
    model, tok = smollm2
    cal, _ = smol_windows
    rot = calibrate(model, tok, cal, method="auto", tokens=512, seq_len=256, window=(16, 64), clip_grid=(0.8, 1.0),
                    query_samples=64, progress=False, retrieval_probes=0)
    _check_artifact(rot, model)
    counts = rot.metadata["auto_counts"]
    assert sum(counts["k"].values()) == sum(counts["v"].values()) == 30 * 3
    assert "score-weighted" in rot.metadata["calibration"]["passes"][1]
    held = rot.metadata["heldout_error"]
    assert all(h["k_rel"] < h["k_rel_identity"] and h["v_rel"] < h["v_rel_identity"] for h in held.values())


# ---------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's tokenizer, saved like a Hub checkpoint."""
    _, tok = smollm2
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_runs_and_refuses_to_overwrite(tiny_model_dir, tmp_path, capsys):
    cli = import_script("calibrate")
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dir), "--tokens", "128", "--seq-len", "64", "--method", "auto",
            "--group-size", "16", "--window", "4,16", "--out", str(out), "--no-progress", "-q",
            "--retrieval-probes", "2", "--retrieval-lengths", "160"]
    assert cli.main(argv) == 0
    for f in ("oscar_config.json", "oscar_rotations.safetensors", "report.txt", "spectra.png"):
        assert (out / f).is_file(), f
    rot = OscarRotations.from_pretrained(out)
    assert rot.method == "auto" and rot.metadata["data"]["calibration_chars"][1] < rot.metadata["data"]["total_chars"]
    fp = rot.fingerprint  # retrieval scores: attention mass in [0, 1] per (layer, KV head)
    assert rot.retrieval_scores.shape == (fp.num_layers, fp.num_key_value_heads)
    assert 0 < rot.retrieval_scores.max() <= 1 + 1e-5
    before = (out / "oscar_rotations.safetensors").read_bytes()
    capsys.readouterr()
    assert cli.main(argv) == cli.EXIT_EXISTS
    assert "--force" in capsys.readouterr().err
    assert (out / "oscar_rotations.safetensors").read_bytes() == before
    assert cli.main(argv + ["--force", "--method", "hadamard", "--clip-grid", "1", "--window", "none",
                            "--retrieval-probes", "0"]) == 0
    back = OscarRotations.from_pretrained(out)
    assert back.method == "hadamard" and back.metadata["calibration"]["window"] is None
    assert back.retrieval_scores is None


def test_cli_script_refuses_existing_artifact_before_loading(tmp_path):
    (tmp_path / "oscar_config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(REPO / "scripts/calibrate.py"), "--model", "does-not-exist/at-all",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "already contains an OSCAR artifact" in r.stderr and "--force" in r.stderr
