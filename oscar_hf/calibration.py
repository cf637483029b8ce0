"""Calibration: text -> attention statistics -> rotations, offsets and clip ratios (an
:class:`~oscar_hf.rotations.OscarRotations` artifact).

Passes (all with ``use_cache=False`` so every attention call sees a whole window; the hooks live in
:mod:`oscar_hf.calib_stats`):

1. **statistics** over the statistics windows: per full-attention layer and KV head, streaming float64
   sums for ``C_Q`` (post-RoPE queries pooled over the KV head's query heads), ``C_S`` (attention
   outputs, pooled likewise; the exact ``sst`` value target), ``C_K``, ``C_V`` and the means
   ``mu_K``, ``mu_V``. The first ``sink`` tokens of every window are left out of the key/value
   statistics (the cache keeps them in full precision, and attention-sink tokens are outliers);
2. **score-weighted** (only for ``value_target="score-weighted"`` and ``method="auto"``): the
   reference implementation's value target ``Σ_t w_t v_tᵀ v_t / Σ_t w_t`` with ``w_t = k_t C_Q k_tᵀ``
   needs ``C_Q`` of the *whole* calibration set, so a second forward pass over the same windows
   accumulates it exactly (no per-batch approximation);
3. **held-out selection** (when there is a clip grid to search or ``method="auto"``): on held-out
   windows that follow the statistics windows, every candidate rotation x clip ratio is quantized
   with the INT2 reference quantizer (:mod:`oscar_hf.quant`, group size ``G``, bf16 metadata) and its
   attention error is measured on the fly, on the real held-out activations, for ``query_samples``
   evenly spaced queries per sequence:

   * keys: the squared logit error ``(scaling · q·(k - k̂))²`` summed over (query head, query, key)
     pairs (``k̂`` dequantized, rotated back and re-centered) -- the logit error weighted by real
     held-out queries;
   * values: ``||Σ_t p_t (v_t - v̂_t)||²`` per (query head, query) with the real attention
     probabilities ``p`` (the output error itself, not a proxy).

   With ``window=(sink, recent)`` (default ``(64, 256)``, the cache's defaults) only the pairs the cache
   actually quantizes count: key ``t`` for query ``i`` when ``sink <= t < i - recent``; the sink token
   (large attention mass, never quantized) would otherwise weigh heavily in the value error. With
   ``window=None`` every query and key of a sequence count (keys: all (query, key) pairs, through the
   queries' Gram matrix; values: the full causal attention).
   One clip ratio per layer (for keys and values separately) and one candidate per KV head are
   chosen jointly to minimize the layer's summed error.

Centering (``center=True``): ``mu_K``/``mu_V`` are stored, and the covariances used for ``pca-kv``
(``C_K``, ``C_V``) are taken around them. ``C_Q`` stays the uncentered query second moment (the
logit error of a centered key is still ``Δk C_Q Δkᵀ``). ``C_S`` and the score-weighted target are
centered around ``mu_V``: since attention probabilities sum to one, ``o - mu_V = Σ_t p_t (v_t - mu_V)``
is exactly the attention-weighted *centered* value, the thing that gets quantized.

Eigenvectors are taken in float64 (``torch.linalg.eigh``, descending, sign-fixed so the largest
component of each is positive) and turned into ``R = U · H · P_br`` (:func:`~oscar_hf.hadamard.oscar_rotation`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

import torch

from .calib_stats import (
    ErrorRecorder,
    LayerCandidates,
    LayerErrors,
    LayerStats,
    StatsRecorder,
    recording,
    select_best,
    spectrum_summary,
)
from .config import ModelFingerprint, validate_head_dim
from .hadamard import hadamard_matrix, oscar_rotation
from .rotations import LayerRotation, OscarRotations

logger = logging.getLogger("oscar_hf")

METHODS = ("oscar", "pca-kv", "hadamard", "identity", "auto")
VALUE_TARGETS = ("sst", "score-weighted")
CLIP_GRID = tuple(round(0.80 + 0.02 * i, 2) for i in range(11))  # 0.80 .. 1.00
K_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv")
V_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv", "score-weighted")
_META = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------- statistics
@dataclasses.dataclass
class CalibrationStats:
    """Accumulated statistics of every full-attention layer (see :class:`~oscar_hf.calib_stats.LayerStats`)."""

    fingerprint: ModelFingerprint
    layers: dict[int, LayerStats]
    tokens: int
    windows: int

    def spectra(self) -> dict[int, dict[str, dict]]:
        out = {}
        for i, s in sorted(self.layers.items()):
            out[i] = {"C_Q": spectrum_summary(s.c_q()), "C_K": spectrum_summary(s.c_k())}
        return out


def full_attention_layers(fp: ModelFingerprint) -> list[int]:
    return [i for i, t in enumerate(fp.layer_types) if t == "full_attention"]


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _forward(model, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    import inspect

    dev = _device(model)
    kw = dict(input_ids=ids.to(dev), use_cache=False)
    if mask is not None:
        kw["attention_mask"] = mask.to(dev)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1  # the LM head over the whole window is wasted work here
    model(**kw)


def _batches(seqs: list[torch.Tensor], batch_size: int, pad_id: int = 0):
    """Right-padded ``(input_ids, attention_mask | None)`` batches of 1-D sequences."""
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s : s + batch_size]
        n = max(x.numel() for x in chunk)
        if all(x.numel() == n for x in chunk):
            yield torch.stack(chunk), None
            continue
        ids = torch.full((len(chunk), n), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for j, x in enumerate(chunk):
            ids[j, : x.numel()] = x
            mask[j, : x.numel()] = 1
        yield ids, mask


def _as_sequences(input_ids) -> list[torch.Tensor]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [n, seq_len], got shape {tuple(input_ids.shape)}")
        seqs = [r for r in input_ids.long()]
    else:
        seqs = [torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in input_ids]
    seqs = [s for s in seqs if s.numel() > 0]
    if not seqs:
        raise ValueError("no calibration tokens given")
    return seqs


def _progress(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    return tqdm(total=total, desc=desc, disable=not (progress and hf_logging.is_progress_bar_enabled()))


def collect_statistics(
    model, input_ids, *, score_weighted: bool = False, kv_skip: int = 0, batch_size: int = 1, pad_id: int = 0,
    progress: bool = False, _bar=None,
) -> CalibrationStats:
    """Run ``model`` over ``input_ids`` (tensor ``[n, L]`` or a list of 1-D sequences, right-padded per
    batch) and return the accumulated statistics of every full-attention layer. With
    ``score_weighted=True`` a second pass accumulates the score-weighted value target."""
    fp = ModelFingerprint.from_config(model.config)
    layers = full_attention_layers(fp)
    if not layers:
        raise ValueError(f"{fp.architecture} has no full-attention layers: nothing for OSCAR to calibrate")
    seqs = _as_sequences(input_ids)
    rec = StatsRecorder(layers, kv_skip)
    passes = 2 if score_weighted else 1
    bar = _bar or _progress(progress, passes * math.ceil(len(seqs) / batch_size), "OSCAR statistics")
    with recording(model, rec):
        for p in range(passes):
            if p == 1:
                rec.start_score_weighted()
            for ids, mask in _batches(seqs, batch_size, pad_id):
                _forward(model, ids, mask)
                bar.update(1)
    if _bar is None:
        bar.close()
    missing = [i for i in layers if i not in rec.stats]
    if missing:
        raise RuntimeError(
            f"the calibration hook saw no attention call for layers {missing[:8]}; does this model route attention "
            "through transformers' attention interface (config._attn_implementation)?"
        )
    tokens = sum(s.numel() for s in seqs)
    return CalibrationStats(fp, rec.stats, tokens, len(seqs))


# ---------------------------------------------------------------------------------------------- rotations
def eigvecs_desc(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns, same order) of symmetric ``c [..., D, D]``
    in float64; each eigenvector's largest-magnitude component is made positive (reproducible signs)."""
    c = ((c + c.transpose(-1, -2)) / 2).double()
    w, u = torch.linalg.eigh(c)
    w, u = w.flip(-1), u.flip(-1)
    idx = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(u, -2, idx))
    sign[sign == 0] = 1
    return w, u * sign


def candidate_rotation(name: str, kind: str, s: LayerStats, center: bool) -> torch.Tensor:
    """``[Hk, D, D]`` float32 rotation of candidate ``name`` for ``kind`` "k" or "v"."""
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
    return oscar_rotation(eigvecs_desc(cov().cpu())[1]).contiguous()


def _candidate_names(method: str, value_target: str) -> tuple[list[str], list[str]]:
    """(key candidate names, value candidate names) that the selection chooses from."""
    if method == "auto":
        return list(K_CANDIDATES), list(V_CANDIDATES)
    vname = ("score-weighted" if value_target == "score-weighted" else "oscar") if method == "oscar" else method
    return [method], [vname]


def _center_modes(center) -> list[bool]:
    if center == "auto":
        return [False, True]
    if isinstance(center, bool):
        return [center]
    raise ValueError(f"center must be True, False or 'auto', got {center!r}")


def build_candidates(
    stats: CalibrationStats, method: str, *, center: bool | str = True, value_target: str = "sst", clip_grid=CLIP_GRID
) -> tuple[dict[int, LayerCandidates], list[str], list[str]]:
    """Candidate rotations (and offsets) of every layer, and their names.

    ``center=True``/``False``: every candidate is centered / uncentered; ``"auto"``: each rotation
    appears twice, uncentered (``"oscar"``) and centered (``"oscar+center"``, covariances taken around
    the means), so the selection also decides per layer, KV head and K/V whether to center. The
    identity rotation without offsets at clip 1.0 (naive INT2) is always evaluated as a reference
    for the report (never selected)."""
    names = _candidate_names(method, value_target)
    modes = _center_modes(center)
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
            torch.stack([candidate_rotation(n, "k", s, c) for c in modes for n in names[0]]),
            torch.stack([candidate_rotation(n, "v", s, c) for c in modes for n in names[1]]),
            torch.stack(mk) if any(modes) else None,
            torch.stack(mv) if any(modes) else None,
            grid,
            grid.clone(),
            ref,
            ref,
        )
    return out, knames, vnames


def evaluate_candidates(
    model, input_ids, candidates: dict[int, LayerCandidates], *, group_size: int = 64, meta_dtype="bfloat16",
    batch_size: int = 1, pad_id: int = 0, query_samples: int = 128, window: tuple[int, int] | None = None,
    progress: bool = False, _bar=None,
) -> dict[int, LayerErrors]:
    """Held-out attention error of every candidate x clip of every layer (see the module docstring)."""
    meta = _META[meta_dtype] if isinstance(meta_dtype, str) else meta_dtype
    seqs = _as_sequences(input_ids)
    rec = ErrorRecorder(candidates, group_size, meta, query_samples, window)
    bar = _bar or _progress(progress, math.ceil(len(seqs) / batch_size), "OSCAR held-out error")
    with recording(model, rec):
        for ids, mask in _batches(seqs, batch_size, pad_id):
            _forward(model, ids, mask)
            bar.update(1)
    if _bar is None:
        bar.close()
    return rec.errors


def attention_error(
    model, rotations: OscarRotations, input_ids, *, group_size: int = 64, center: bool = True,
    meta_dtype="bfloat16", batch_size: int = 1, pad_id: int = 0, query_samples: int = 128,
    window: tuple[int, int] | None = (64, 256), progress: bool = False,
) -> dict:
    """The library's attention-error measure of an artifact on ``input_ids`` (use held-out text):
    per layer the mean squared key-logit error ``k``, the mean squared output error of values ``v``,
    and both relative to the signal (``k_rel`` = / mean squared logit, ``v_rel`` = / mean ||o||²);
    plus their means over layers ``k_rel``, ``v_rel`` and ``total`` = ``k_rel + v_rel``. Uses the
    artifact's rotations, clips and (with ``center``) offsets. ``window=(sink, recent)``: only the
    (query, key) pairs the cache quantizes count (``sink <= key < query - recent``); ``None``: all pairs."""
    rotations.check_compatible(model.config)
    validate_head_dim(rotations.fingerprint, group_size)
    cands = {
        i: LayerCandidates(
            lr.r_k[None].float(), lr.r_v[None].float(),
            lr.mu_k if center else None, lr.mu_v if center else None,
            torch.tensor([lr.clip_k]), torch.tensor([lr.clip_v]),
        )
        for i, lr in rotations.layers.items()
    }
    errs = evaluate_candidates(
        model, input_ids, cands, group_size=group_size, meta_dtype=meta_dtype, batch_size=batch_size, pad_id=pad_id,
        query_samples=query_samples, window=window, progress=progress,
    )
    per = {}
    for i, e in sorted(errs.items()):
        per[i] = {
            "k": float(e.k_mean().sum()), "v": float(e.v_mean().sum()),
            "k_rel": float(e.k.sum() / e.k_signal.sum()), "v_rel": float(e.v.sum() / e.v_signal.sum()),
        }
    k_rel = sum(p["k_rel"] for p in per.values()) / max(len(per), 1)
    v_rel = sum(p["v_rel"] for p in per.values()) / max(len(per), 1)
    return {"layers": per, "k_rel": k_rel, "v_rel": v_rel, "total": k_rel + v_rel}


# ---------------------------------------------------------------------------------------------- calibrate
def _is_texts(texts) -> bool:
    return isinstance(texts, str) or (
        isinstance(texts, Sequence) and not isinstance(texts, torch.Tensor) and len(texts) > 0
        and all(isinstance(t, str) for t in texts)
    )


def calibrate(
    model,
    tokenizer,
    texts,
    *,
    method: str = "oscar",
    tokens: int = 8192,
    seq_len: int = 2048,
    group_size: int = 64,
    center: bool | str = True,
    value_target: str = "sst",
    clip_grid: Sequence[float] | None = CLIP_GRID,
    holdout_fraction: float = 0.25,
    batch_size: int = 1,
    progress: bool = True,
    meta_dtype: str = "bfloat16",
    query_samples: int = 128,
    window: tuple[int, int] | None = (64, 256),
    metadata: dict | None = None,
) -> OscarRotations:
    """Calibrate OSCAR rotations, offsets and clip ratios for ``model``.

    Args:
        texts: a string or list of strings (tokenized with ``tokenizer``; give calibration text only,
            e.g. ``oscar_hf.data.calibration_text(...)``), or with ``tokenizer=None`` a ``[n, L]`` tensor
            / list of 1-D token-id sequences.
        method: "oscar" (C_Q keys / value_target values), "pca-kv" (C_K / C_V), "hadamard",
            "identity" (calibrated offsets and clips only), or "auto" (best candidate per layer, KV head
            and K/V on held-out tokens).
        tokens: statistics tokens: ``ceil(tokens / seq_len)`` windows of ``min(seq_len, tokens)`` tokens
            from the start of the text (ignored for token-id input: all rows are used).
        group_size: the quantization group size the clips (and ``auto``) are chosen for.
        center: store and use the per-KV-head means ``mu_K``/``mu_V``; ``"auto"``: decide per layer, KV head
            and K/V on the held-out error (an unchosen offset is stored as zeros).
        value_target: "sst" (exact ``C_S = Σ oᵀo``) or "score-weighted" (the reference code's target).
        clip_grid: clip ratios searched per layer (default 0.80..1.00 step 0.02); ``None`` or one value:
            no search (clips 1.0 or that value).
        holdout_fraction: held-out windows for the clip / ``auto`` choice, as a fraction of the statistics
            windows (at least one), taken right after them (token-id input: the last rows).
        batch_size: windows per forward.
        progress: tqdm bar (also honours ``transformers.utils.logging.disable_progress_bar()``).
        meta_dtype: dtype of the quantizer's scale/zero during the clip search (as the cache will use).
        query_samples: queries per held-out sequence whose real attention probabilities weigh the errors.
        window: ``(sink, recent)`` of the cache the artifact is for (``OscarConfig`` defaults 64, 256):
            the first ``sink`` tokens of every window are left out of the key/value statistics (never
            quantized; attention sinks have atypical activations), and held-out errors count only the
            (query, key) pairs the cache quantizes, ``sink <= key < query - recent``. Windows not longer than
            ``sink + recent + 1`` get a proportionally smaller window ``(min(sink, L//8), min(recent, L//4))``
            with a warning (recorded in the metadata). ``None``: all tokens, all (query, key) pairs.
        metadata: extra JSON-able entries stored in the artifact's metadata (e.g. the data source).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if value_target not in VALUE_TARGETS:
        raise ValueError(f"value_target must be one of {VALUE_TARGETS}, got {value_target!r}")
    _center_modes(center)
    if not 0.0 < holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must lie in (0, 1], got {holdout_fraction}")
    if batch_size < 1 or tokens < 2 or seq_len < 2:
        raise ValueError("batch_size must be >= 1, tokens and seq_len >= 2")
    if isinstance(meta_dtype, torch.dtype):
        meta_dtype = str(meta_dtype).removeprefix("torch.")
    if meta_dtype not in _META:
        raise ValueError(f"meta_dtype must be one of {sorted(_META)}, got {meta_dtype!r}")
    grid = tuple(sorted({round(float(c), 6) for c in (clip_grid or (1.0,))}))
    if any(not 0.0 < c <= 1.0 for c in grid):
        raise ValueError(f"clip ratios must lie in (0, 1], got {clip_grid}")
    fp = ModelFingerprint.from_config(model.config)
    validate_head_dim(fp, group_size)
    if not full_attention_layers(fp):
        raise ValueError(f"{fp.architecture} has no full-attention layers: nothing for OSCAR to calibrate")
    hadamard_matrix(fp.head_dim)  # fail early (clear error) for a head_dim without a Hadamard construction

    if window is not None:
        window = (int(window[0]), int(window[1]))
        if window[0] < 0 or window[1] < 0:
            raise ValueError(f"window=(sink, recent) must be non-negative, got {window}")
    need_holdout = method == "auto" or len(grid) > 1 or center == "auto"
    need_sw = method == "auto" or (method == "oscar" and value_target == "score-weighted")
    pad_id = 0
    if _is_texts(texts):
        if tokenizer is None:
            raise ValueError("texts are strings: pass the model's tokenizer (or token ids with tokenizer=None)")
        from .data import calibration_windows

        sl = min(seq_len, tokens)
        n_stats = math.ceil(tokens / sl)
        n_hold = max(1, math.ceil(holdout_fraction * n_stats)) if need_holdout else 0
        stats_ids, hold_ids = calibration_windows(tokenizer, texts, tokens, sl, n_hold)
        stats_seqs, hold_seqs = _as_sequences(stats_ids), (_as_sequences(hold_ids) if n_hold else [])
        pad_id = tokenizer.pad_token_id or 0
    else:
        seqs = _as_sequences(texts)
        n_hold = 0
        if need_holdout:
            if len(seqs) < 2:
                raise ValueError(
                    "a clip search, method='auto' or center='auto' need at least 2 token sequences (one is held out)"
                )
            n_hold = min(len(seqs) - 1, max(1, round(len(seqs) * holdout_fraction / (1 + holdout_fraction))))
        stats_seqs, hold_seqs = seqs[: len(seqs) - n_hold], seqs[len(seqs) - n_hold :]
        if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
            pad_id = tokenizer.pad_token_id

    if window is not None:
        shortest = min(max(s.numel() for s in stats_seqs), max((s.numel() for s in hold_seqs), default=1 << 30))
        if shortest <= sum(window) + 1:
            fitted = (min(window[0], shortest // 8), min(window[1], shortest // 4))
            logger.warning(
                "calibration windows of %d tokens are too short for window=(sink=%d, recent=%d); using (%d, %d) "
                "(pass seq_len > %d for the cache's own window)", shortest, *window, *fitted, sum(window) + 1,
            )
            window = fitted
    n_fw = math.ceil(len(stats_seqs) / batch_size) * (2 if need_sw else 1) + math.ceil(len(hold_seqs) / batch_size)
    bar = _progress(progress, n_fw, f"OSCAR calibration ({method})")
    try:
        t_stats = time.perf_counter()
        stats = collect_statistics(
            model, stats_seqs, score_weighted=need_sw, kv_skip=window[0] if window else 0, batch_size=batch_size,
            pad_id=pad_id, _bar=bar,
        )
        t_stats = time.perf_counter() - t_stats
        cands, knames, vnames = build_candidates(
            stats, method, center=center, value_target=value_target, clip_grid=grid
        )
        errors, t_hold = {}, 0.0
        if need_holdout:
            t_hold = time.perf_counter()
            errors = evaluate_candidates(
                model, hold_seqs, cands, group_size=group_size, meta_dtype=meta_dtype, batch_size=batch_size,
                pad_id=pad_id, query_samples=query_samples, window=window, _bar=bar,
            )
            t_hold = time.perf_counter() - t_hold
    finally:
        bar.close()

    layers: dict[int, LayerRotation] = {}
    winners = {"k": {}, "v": {}}
    held: dict[str, dict] = {}
    for i, c in sorted(cands.items()):
        hk = c.k_rots.shape[1]
        if i in errors:
            e = errors[i]
            jk, wk = select_best(e.k)
            jv, wv = select_best(e.v)
            ek = sum(float(e.k[wk[h], jk, h]) for h in range(hk))
            ev = sum(float(e.v[wv[h], jv, h]) for h in range(hk))
            ks, vs = max(float(e.k_signal.sum()), 1e-300), max(float(e.v_signal.sum()), 1e-300)
            held[str(i)] = {"k_rel": ek / ks, "v_rel": ev / vs}
            if e.k_ref is not None:
                held[str(i)]["k_rel_identity"] = float(e.k_ref[0, 0].sum()) / ks
                held[str(i)]["v_rel_identity"] = float(e.v_ref[0, 0].sum()) / vs
            clip_k, clip_v = float(grid[jk]), float(grid[jv])
        else:
            wk, wv = [0] * hk, [0] * hk
            clip_k = clip_v = float(grid[-1])

        def pick(t, w, hk=hk):  # per KV head, the winning candidate's tensor
            return None if t is None else torch.stack([t[w[h], h] for h in range(hk)]).float().contiguous()

        layers[i] = LayerRotation(pick(c.k_rots, wk), pick(c.v_rots, wv), clip_k, clip_v, pick(c.mu_k, wk),
                                  pick(c.mu_v, wv))
        winners["k"][str(i)] = [knames[w] for w in wk]
        winners["v"][str(i)] = [vnames[w] for w in wv]

    spectra = {}
    for i, s in sorted(stats.layers.items()):
        entry = {name: spectrum_summary(fn()) for name, fn in (("C_Q", s.c_q), ("C_K", s.c_k))}
        for name, fn in (("C_S", s.c_s), ("C_V", s.c_v)):
            summ = spectrum_summary(fn())
            summ.pop("eigvals")
            entry[name] = summ
        spectra[str(i)] = entry
    import transformers

    from . import __version__

    meta = {
        "calibration": {
            "method": method,
            "value_target": value_target,
            "center": center,
            "group_size": group_size,
            "meta_dtype": meta_dtype,
            "tokens": stats.tokens,
            "windows": stats.windows,
            "seq_len": max(s.numel() for s in stats_seqs),
            "holdout_tokens": sum(s.numel() for s in hold_seqs),
            "holdout_windows": len(hold_seqs),
            "batch_size": batch_size,
            "clip_grid": list(grid) if need_holdout else None,
            "query_samples": query_samples if need_holdout else None,
            "window": list(window) if window else None,
            "passes": ["statistics"] + (["score-weighted (2nd pass, same windows)"] if need_sw else [])
            + (["held-out selection"] if need_holdout else []),
            "time_s": round(time.perf_counter() - t0, 2),
            "cpu_time_s": round(time.process_time() - c0, 2),
            "time_statistics_s": round(t_stats, 2),
            "time_selection_s": round(t_hold, 2),
            "oscar_hf": __version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "clips": {str(i): [lr.clip_k, lr.clip_v] for i, lr in sorted(layers.items())},
        "winners": winners,
        "spectra": spectra,
    }
    if held:
        meta["heldout_error"] = held
    if method == "auto" or center == "auto":
        meta["auto_counts"] = {
            kind: dict(Counter(n for names in winners[kind].values() for n in names).most_common())
            for kind in ("k", "v")
        }
    if metadata:
        meta.update(metadata)
    rot = OscarRotations(fp, method, layers, meta)
    rot.validate()
    logger.info("OSCAR calibration (%s) of %d layers on %d tokens took %.1f s", method, len(layers), stats.tokens,
                meta["calibration"]["time_s"])
    return rot


# ---------------------------------------------------------------------------------------------- reporting
def calibration_report(rotations: OscarRotations) -> str:
    """Human-readable summary of a calibrated artifact (settings, per-layer clips, spectra, winners)."""
    fp, md = rotations.fingerprint, rotations.metadata
    cal = md.get("calibration", {})
    lines = [
        f"OSCAR calibration report: method={rotations.method}  model={fp.name_or_path or fp.architecture}",
        f"  {fp.architecture} ({fp.model_type}): {fp.num_layers} layers, {len(rotations.layers)} quantized "
        f"(full attention), {fp.num_attention_heads} q / {fp.num_key_value_heads} kv heads, head_dim {fp.head_dim}",
    ]
    if cal:
        lines.append(
            f"  tokens: {cal.get('tokens')} statistics ({cal.get('windows')} x {cal.get('seq_len')}) + "
            f"{cal.get('holdout_tokens')} held-out; group_size={cal.get('group_size')}, meta={cal.get('meta_dtype')}, "
            f"center={cal.get('center')}, value_target={cal.get('value_target')}, "
            f"window(sink, recent)={cal.get('window')}"
        )
        lines.append(
            f"  time: {cal.get('time_s')} s (statistics {cal.get('time_statistics_s')} s, selection "
            f"{cal.get('time_selection_s')} s); passes: {', '.join(cal.get('passes', []))}"
        )
    held = md.get("heldout_error", {})
    if held:
        mean = lambda key: sum(h.get(key, float("nan")) for h in held.values()) / len(held)  # noqa: E731
        line = f"  held-out relative error (mean over layers): keys {mean('k_rel'):.4g}, values {mean('v_rel'):.4g}"
        if all("k_rel_identity" in h for h in held.values()):
            line += f"  (identity / no clip: keys {mean('k_rel_identity'):.4g}, values {mean('v_rel_identity'):.4g})"
        lines.append(line)
    if "auto_counts" in md:
        for kind, name in (("k", "keys"), ("v", "values")):
            cnt = md["auto_counts"].get(kind, {})
            lines.append(
                f"  auto winners ({name}, per layer x kv head): " + ", ".join(f"{k} {v}" for k, v in cnt.items())
            )
    clips = [(lr.clip_k, lr.clip_v) for _, lr in sorted(rotations.layers.items())]
    if clips:
        lines.append(
            f"  clips: c_K mean {sum(c[0] for c in clips) / len(clips):.3f} [{min(c[0] for c in clips):.2f}, "
            f"{max(c[0] for c in clips):.2f}], c_V mean {sum(c[1] for c in clips) / len(clips):.3f} "
            f"[{min(c[1] for c in clips):.2f}, {max(c[1] for c in clips):.2f}]"
        )
    spectra, winners = md.get("spectra", {}), md.get("winners", {})
    lines.append("")
    lines.append(
        f"{'layer':>5} {'c_K':>5} {'c_V':>5} {'k_rel':>9} {'v_rel':>9}  {'C_Q top/erank':>14} {'C_K top/erank':>14}"
        f" {'C_S top/erank':>14}  rotation k | v (per kv head)"
    )
    for i, lr in sorted(rotations.layers.items()):
        h = held.get(str(i), {})
        sp = spectra.get(str(i), {})

        def summ(name, sp=sp):
            s = sp.get(name)
            if not s:
                return f"{'-':>14}"
            top = sum(s["top_share"]) / len(s["top_share"])
            er = sum(s["eff_rank"]) / len(s["eff_rank"])
            return f"{top:>7.3f}/{er:<6.1f}"

        wk = ",".join(winners.get("k", {}).get(str(i), []))
        wv = ",".join(winners.get("v", {}).get(str(i), []))
        lines.append(
            f"{i:>5} {lr.clip_k:>5.2f} {lr.clip_v:>5.2f} {h.get('k_rel', float('nan')):>9.4g} "
            f"{h.get('v_rel', float('nan')):>9.4g}  {summ('C_Q')} {summ('C_K')} {summ('C_S')}  {wk} | {wv}"
        )
    return "\n".join(lines) + "\n"


def plot_spectra(obj: CalibrationStats | OscarRotations, path) -> None:
    """PNG of the normalized eigen-spectra of ``C_Q`` vs ``C_K`` per layer (mean over KV heads, one line
    per layer, coloured by depth) and the top-eigenvalue share per layer."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if isinstance(obj, CalibrationStats):
        spectra = {str(i): v for i, v in obj.spectra().items()}
    elif isinstance(obj, OscarRotations):
        spectra = obj.metadata.get("spectra")
        if not spectra:
            raise ValueError("this artifact has no spectra in its metadata (not produced by calibrate())")
    else:
        raise TypeError(f"plot_spectra takes CalibrationStats or OscarRotations, got {type(obj).__name__}")
    layer_ids = sorted(spectra, key=int)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes[:2], ("C_Q", "C_K")):
        for n, li in enumerate(layer_ids):
            ev = torch.tensor(spectra[li][name]["eigvals"], dtype=torch.float64).mean(0)
            color = cmap(n / max(len(layer_ids) - 1, 1))
            ax.semilogy(range(1, ev.numel() + 1), ev.clamp_min(1e-12).numpy(), color=color, lw=1)
        ax.set_title(f"{name} eigen-spectrum")
        ax.set_xlabel("eigenvalue index")
        ax.set_ylabel("share of trace")
        ax.grid(alpha=0.3)
    x = [int(li) for li in layer_ids]
    for name in ("C_Q", "C_K", "C_S", "C_V"):
        if all(name in spectra[li] for li in layer_ids):
            y = [sum(spectra[li][name]["top_share"]) / len(spectra[li][name]["top_share"]) for li in layer_ids]
            axes[2].plot(x, y, marker="o", ms=3, label=name)
    axes[2].set_title("top-eigenvalue share per layer")
    axes[2].set_xlabel("layer")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(min(x), max(x)))
    fig.colorbar(sm, ax=axes[1], label="layer")
    fig.suptitle("normalized eigenvalues (share of the trace), mean over KV heads")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
