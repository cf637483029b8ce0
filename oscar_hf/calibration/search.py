"""Candidates and their selection: the rotations a layer may use, their held-out attention error for every clip
ratio (:class:`ErrorRecorder`; docs/calibration.md), and :func:`select_best`'s clip per layer and candidate per KV head.
"""
from __future__ import annotations

import math

import torch

from ..config import validate_head_dim
from ..hadamard import hadamard_matrix, oscar_rotation
from ..rotations import OscarRotations
# quant_error is re-exported: tests import it from here
from .errors import ErrorRecorder, LayerCandidates, LayerErrors, quant_error  # noqa: F401
from .hooks import as_sequences, padded_batches, progress_bar, recording, run_window
from .stats import CalibrationStats, LayerStats

CLIP_GRID = tuple(round(0.80 + 0.02 * i, 2) for i in range(11))  # 0.80 .. 1.00
K_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv")
V_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv", "score-weighted")
META_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def eigvecs_desc(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of symmetric ``c [..., D, D]`` in float64, signs fixed
    so that each one's largest component is positive."""
    c = ((c + c.transpose(-1, -2)) / 2).double()
    w, u = torch.linalg.eigh(c)
    w, u = w.flip(-1), u.flip(-1)
    idx = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(u, -2, idx))
    sign[sign == 0] = 1
    return w, u * sign


def pooled_over_heads(c: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``c [Hk, D, D]`` -> the layer's pooled moment ``Σ_h w_h c_h / Σ_h w_h`` replicated ``[Hk, D, D]``
    (``weights [Hk]``; None: equal)."""
    w = torch.ones(c.shape[0], dtype=c.dtype, device=c.device) if weights is None else weights.to(c)
    pooled = (w[:, None, None] * c).sum(0) / w.sum().clamp_min(1e-300)
    return pooled.expand_as(c)


def candidate_rotation(name: str, kind: str, s: LayerStats, center: bool, shared: bool = False) -> torch.Tensor:
    """``[Hk, D, D]`` float32 rotation of candidate ``name`` for ``kind`` "k" or "v". ``shared``: one rotation
    from the layer's pooled statistics (:func:`pooled_over_heads`)."""
    hk, d = s.k_sum.shape
    if name == "identity":
        return torch.eye(d).expand(hk, d, d).contiguous()
    if name == "hadamard":
        return hadamard_matrix(d).expand(hk, d, d).contiguous()
    if kind == "k":
        cov = {"oscar": lambda: s.c_q(), "pca-kv": lambda: s.c_k(center)}.get(name)
    else:
        cov = {
            "oscar": lambda: s.c_s(center),
            "sst": lambda: s.c_s(center),
            "pca-kv": lambda: s.c_v(center),
            "score-weighted": lambda: s.c_sw(center),
        }.get(name)
    if cov is None:
        raise ValueError(f"unknown {kind} rotation candidate {name!r}")
    c = cov().cpu()
    if shared:  # the score-weighted target's rows weigh w_t: head h holds sw_w[h] of the pooled weight
        c = pooled_over_heads(c, s.sw_w.cpu() if name == "score-weighted" else None)
    return oscar_rotation(eigvecs_desc(c)[1]).contiguous()


def _candidate_names(method: str, value_target: str) -> tuple[list[str], list[str]]:
    """(key candidate names, value candidate names) that the selection chooses from."""
    if method == "auto":
        return list(K_CANDIDATES), list(V_CANDIDATES)
    vname = ("score-weighted" if value_target == "score-weighted" else "oscar") if method == "oscar" else method
    return [method], [vname]


def center_modes(center) -> list[bool]:
    if center == "auto":
        return [False, True]
    if isinstance(center, bool):
        return [center]
    raise ValueError(f"center must be True, False or 'auto', got {center!r}")


def build_candidates(stats: CalibrationStats, method: str, *, center: bool | str = True, value_target: str = "sst",
                     clip_grid=CLIP_GRID,
                     shared: bool = False) -> tuple[dict[int, LayerCandidates], list[str], list[str]]:
    """Candidate rotations (and offsets) of every layer, and their names. ``center="auto"``: each candidate twice,
    uncentered and ``"+center"``. Naive INT2 is always evaluated as the report's reference, never selected."""
    names = _candidate_names(method, value_target)
    modes = center_modes(center)
    suffix = (lambda c: "+center" if c else "") if len(modes) > 1 else (lambda c: "")  # noqa: E731
    knames = [n + suffix(c) for c in modes for n in names[0]]
    vnames = [n + suffix(c) for c in modes for n in names[1]]
    grid = torch.tensor(sorted(float(c) for c in clip_grid), dtype=torch.float32)
    out = {}
    for i, s in sorted(stats.layers.items()):
        hk, d = s.k_sum.shape
        zero = torch.zeros(hk, d)
        ref = candidate_rotation("identity", "k", s, False)[None]
        mk = [s.mu_k.float().cpu() if c else zero for c in modes for _ in names[0]]
        mv = [s.mu_v.float().cpu() if c else zero for c in modes for _ in names[1]]
        out[i] = LayerCandidates(
            torch.stack([candidate_rotation(n, "k", s, c, shared) for c in modes for n in names[0]]),
            torch.stack([candidate_rotation(n, "v", s, c, shared) for c in modes for n in names[1]]),
            torch.stack(mk) if any(modes) else None,
            torch.stack(mv) if any(modes) else None,
            grid,
            grid.clone(),
            ref,
            ref)
    return out, knames, vnames


def evaluate_candidates(model, input_ids, candidates: dict[int, LayerCandidates], *, group_size: int = 64,
                        meta_dtype="bfloat16", batch_size: int = 1, pad_id: int = 0, query_samples: int = 128,
                        window: tuple[int, int] | None = None, progress: bool = False,
                        _bar=None) -> dict[int, LayerErrors]:
    """Held-out attention error of every candidate x clip of every layer."""
    meta = META_DTYPES[meta_dtype] if isinstance(meta_dtype, str) else meta_dtype
    seqs = as_sequences(input_ids)
    rec = ErrorRecorder(candidates, group_size, meta, query_samples, window)
    bar = _bar or progress_bar(progress, math.ceil(len(seqs) / batch_size), "OSCAR held-out error")
    with recording(model, rec):
        for ids, mask in padded_batches(seqs, batch_size, pad_id):
            run_window(model, ids, mask)
            bar.update(1)
    if _bar is None:
        bar.close()
    return rec.errors


def select_best(errors: torch.Tensor, shared: bool = False) -> tuple[int, list[int]]:
    """From ``errors [C, N, Hk]``: one clip index for the layer and one candidate per KV head (``shared``: one for
    all), minimizing the summed error; ties prefer the larger clip and the earlier candidate."""
    hk = errors.shape[-1]
    if shared:
        total, arg = errors.sum(-1).min(dim=0)  # [N]: the best candidate's layer error at each clip
    else:
        best, arg = errors.min(dim=0)  # [N, Hk]
        total = best.sum(-1)  # [N]
    n = total.numel()
    j = n - 1 - int(torch.argmin(total.flip(0)))
    return j, ([int(arg[j])] * hk if shared else [int(a) for a in arg[j]])


def attention_error(model, rotations: OscarRotations, input_ids, *, group_size: int = 64, center: bool = True,
                    meta_dtype="bfloat16", batch_size: int = 1, pad_id: int = 0, query_samples: int = 128,
                    window: tuple[int, int] | None = (64, 256), progress: bool = False) -> dict:
    """The selection's attention error of an artifact on held-out ``input_ids``: per layer the mean squared key-logit
    error ``k``, value output error ``v``, and both relative to the signal; their means over layers ``k_rel``,
    ``v_rel`` and ``total``. ``window=(sink, recent)``: only the pairs the cache quantizes count."""
    rotations.check_compatible(model.config)
    validate_head_dim(rotations.fingerprint, group_size)
    cands = {
        i: LayerCandidates(lr.r_k[None].float(), lr.r_v[None].float(), lr.mu_k if center else None,
                           lr.mu_v if center else None, torch.tensor([lr.clip_k]), torch.tensor([lr.clip_v]))
        for i, lr in rotations.layers.items()}
    errs = evaluate_candidates(
        model, input_ids, cands, group_size=group_size, meta_dtype=meta_dtype, batch_size=batch_size, pad_id=pad_id,
        query_samples=query_samples, window=window, progress=progress)
    per = {}
    for i, e in sorted(errs.items()):
        per[i] = {
            "k": float(e.k_mean().sum()), "v": float(e.v_mean().sum()),
            "k_rel": float(e.k.sum() / e.k_signal.sum()), "v_rel": float(e.v.sum() / e.v_signal.sum())}
    k_rel = sum(p["k_rel"] for p in per.values()) / max(len(per), 1)
    v_rel = sum(p["v_rel"] for p in per.values()) / max(len(per), 1)
    return {"layers": per, "k_rel": k_rel, "v_rel": v_rel, "total": k_rel + v_rel}
