"""`calibrate()`: text -> calibration windows -> statistics -> candidates -> held-out selection -> artifact."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

import torch
import transformers

from ..config import ModelFingerprint, OscarConfig, default_group_size, validate_head_dim
from ..data import calibration_windows, join_texts
from ..hadamard import hadamard_matrix
from ..rotations import LayerRotation, OscarRotations
from ..version import __version__
from .hooks import as_sequences, progress_bar
from .options import METHODS, VALUE_TARGETS, CalibrationOptions  # noqa: F401  (METHODS, VALUE_TARGETS: API)
from .retrieval_heads import find_retrieval_heads, probe_lengths
from .search import build_candidates, evaluate_candidates, select_best
from .selection import SCORED_TOKENS, next_token_kl, reference_log_probs
from .settings import choose_settings as search_settings
from .stats import CalibrationStats, collect_statistics, full_attention_layers, spectrum_summary

logger = logging.getLogger("oscar_hf")

SELECTION_CANDIDATES = ("oscar", "pca-kv", "hadamard")  # method="auto": whole-artifact alternatives to its pick
SETTINGS_WINDOWS = 2  # held-out windows the settings search scores (text input; one more than the selection's default)


def _is_texts(texts) -> bool:
    return isinstance(texts, str) or (isinstance(texts, Sequence) and len(texts) > 0
                                      and all(isinstance(t, str) for t in texts))  # (a tensor is no Sequence)


def calibrate(model, tokenizer, texts, options: CalibrationOptions | None = None, **overrides) -> OscarRotations:
    """Calibrate OSCAR rotations, offsets and clip ratios for ``model`` (the passes: docs/calibration.md).
    ``texts``: calibration text (a string or list, e.g. ``oscar_hf.data.calibration_text(...)``), or with
    ``tokenizer=None`` a ``[n, L]`` tensor / list of 1-D token ids. ``options``: a
    :class:`~.options.CalibrationOptions`; ``overrides``: its fields as keywords, on top."""
    t0, c0 = time.perf_counter(), time.process_time()
    o = (options or CalibrationOptions()).replace(**overrides)
    fp, group_size = _model_group_size(model, o.group_size)
    w = _split_windows(texts, tokenizer, o)
    window = _fitted_window(o.window, w)
    # retrieval heads first: a text too short for the probes fails before the long passes
    scores, t_ret = _retrieval_scores(model, tokenizer, texts, o)
    m = _measure(model, o, w, window, group_size)
    picked, selection, t_kl = _select_by_kl(model, o, fp, w.hold, m, window, group_size)
    settings, t_set = _search_settings(model, o, fp, w.settings, window, group_size, picked, scores)
    times = {"statistics": m.t_stats, "selection": m.t_hold, "retrieval": t_ret, "kl_selection": t_kl,
             "settings": t_set, "start": t0, "cpu_start": c0}
    meta = _metadata(model, o, w, m, window, group_size, picked, selection, settings, scores, times)
    rot = OscarRotations(fp, o.method, picked[0], meta, scores)
    rot.validate()
    logger.info("OSCAR calibration (%s) of %d layers on %d tokens took %.1f s", o.method, len(picked[0]),
                m.stats.tokens, meta["calibration"]["time_s"])
    return rot


# help(calibrate) / inspect.signature list the option fields as its keywords (they are: **overrides)
calibrate.__signature__ = inspect.signature(calibrate).replace(parameters=[
    *list(inspect.signature(calibrate).parameters.values())[:4],
    *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
      for f in dataclasses.fields(CalibrationOptions)),
])


def _model_group_size(model, group_size) -> tuple[ModelFingerprint, int]:
    """The model's fingerprint and the group size the clips are chosen for (checked against its head_dim)."""
    fp = ModelFingerprint.from_config(model.config)
    if group_size == "auto":
        group_size = default_group_size(fp.head_dim)
    group_size = fp.head_dim if group_size is None else group_size
    validate_head_dim(fp, group_size)
    if not full_attention_layers(fp):
        raise ValueError(f"{fp.architecture} has no full-attention layers: nothing for OSCAR to calibrate")
    hadamard_matrix(fp.head_dim)  # fail early (clear error) for a head_dim without a Hadamard construction
    return fp, group_size


@dataclasses.dataclass
class _Windows:
    """The token sequences of a calibration: statistics, held-out selection, settings search (its first ones are
    the held-out selection's), and the padding id."""

    stats: list[torch.Tensor]
    hold: list[torch.Tensor]
    settings: list[torch.Tensor]
    pad_id: int


def _split_windows(texts, tokenizer, o: CalibrationOptions) -> _Windows:
    """Text: statistics windows from its start, then the held-out ones; token ids: the last rows held out."""
    if _is_texts(texts):
        if tokenizer is None:
            raise ValueError("texts are strings: pass the model's tokenizer (or token ids with tokenizer=None)")
        sl = min(o.seq_len, o.tokens)
        n_stats = math.ceil(o.tokens / sl)
        n_hold = max(1, math.ceil(o.holdout_fraction * n_stats)) if o.need_holdout else 0
        n_settings = max(n_hold, SETTINGS_WINDOWS) if o.choose_settings else n_hold  # (the first n_hold are shared)
        try:
            stats_ids, hold_ids = calibration_windows(tokenizer, texts, o.tokens, sl, n_settings)
        except ValueError:  # text for the selection's windows but not for the search's extra ones: it scores fewer
            if n_settings == n_hold:
                raise
            n_settings = n_hold
            stats_ids, hold_ids = calibration_windows(tokenizer, texts, o.tokens, sl, n_settings)
        settings_seqs = as_sequences(hold_ids) if n_settings else []
        return _Windows(as_sequences(stats_ids), settings_seqs[:n_hold], settings_seqs, tokenizer.pad_token_id or 0)
    seqs = as_sequences(texts)
    n_hold = 0
    if o.need_holdout:  # (token ids: the settings search scores these held-out rows, none are taken for it)
        if len(seqs) < 2:
            raise ValueError("a clip search, method='auto' or center='auto' need at least 2 token sequences (one is "
                             "held out)")
        n_hold = min(len(seqs) - 1, max(1, round(len(seqs) * o.holdout_fraction / (1 + o.holdout_fraction))))
    hold = seqs[len(seqs) - n_hold :]
    return _Windows(seqs[: len(seqs) - n_hold], hold, hold, getattr(tokenizer, "pad_token_id", None) or 0)


def _fitted_window(window, w: _Windows):
    """``window=(sink, recent)``, made proportionally smaller (with a warning) for windows too short for it."""
    shortest = min(max(s.numel() for s in w.stats), max((s.numel() for s in w.hold), default=1 << 30))
    if window is None or shortest > sum(window) + 1:
        return window
    fitted = (min(window[0], shortest // 8), min(window[1], shortest // 4))
    logger.warning(
        "calibration windows of %d tokens are too short for window=(sink=%d, recent=%d); using (%d, %d) "
        "(pass seq_len > %d for the cache's own window)", shortest, *window, *fitted, sum(window) + 1)
    return fitted


def _retrieval_scores(model, tokenizer, texts, o: CalibrationOptions):
    """``([num_layers, Hk] retrieval scores or None, seconds)``: the probes are written into text."""
    if o.retrieval_probes and not _is_texts(texts):
        logger.info("calibrate: token-id input, retrieval heads not scored (the probes are written into text)")
    elif o.retrieval_probes:
        t = time.perf_counter()
        scores = find_retrieval_heads(model, tokenizer, join_texts(texts), o.retrieval_probes,
                                      tuple(o.retrieval_lengths), progress=o.progress)
        return scores, time.perf_counter() - t
    return None, 0.0


@dataclasses.dataclass
class _Measured:
    """The statistics, the candidates built from them and their held-out errors (``{}`` without a held-out choice)."""

    stats: CalibrationStats
    cands: dict
    knames: list[str]
    vnames: list[str]
    errors: dict
    o: CalibrationOptions
    t_stats: float = 0.0
    t_hold: float = 0.0

    def assemble(self, only: str | None = None):
        """``(layers, winners, held)``: per layer and KV head the candidate ``only`` (its best clip), or the
        held-out error's pick (``None``), with the selection error of what was picked."""
        layers: dict[int, LayerRotation] = {}
        winners = {"k": {}, "v": {}}
        held: dict[str, dict] = {}
        grid, clips, shared = self.o.grid, self.o.clips, self.o.share_rotation_across_heads
        for i, c in sorted(self.cands.items()):
            hk = c.k_rots.shape[1]
            if i in self.errors:
                e = self.errors[i]
                if only is None:
                    jk, wk = select_best(e.k, shared)
                    jv, wv = select_best(e.v, shared)
                else:  # one candidate everywhere: the layer's best clip for it
                    ck, cv = self.knames.index(only), self.vnames.index(only)
                    jk, jv = select_best(e.k[ck : ck + 1], True)[0], select_best(e.v[cv : cv + 1], True)[0]
                    wk, wv = [ck] * hk, [cv] * hk
                ek = sum(float(e.k[wk[h], jk, h]) for h in range(hk))
                ev = sum(float(e.v[wv[h], jv, h]) for h in range(hk))
                ks, vs = max(float(e.k_signal.sum()), 1e-300), max(float(e.v_signal.sum()), 1e-300)
                held[str(i)] = {"k_rel": ek / ks, "v_rel": ev / vs}
                if e.k_ref is not None:
                    held[str(i)]["k_rel_identity"] = float(e.k_ref[0, 0].sum()) / ks
                    held[str(i)]["v_rel_identity"] = float(e.v_ref[0, 0].sum()) / vs
                clip_k, clip_v = clips or (float(grid[jk]), float(grid[jv]))
            else:
                wk, wv = [0] * hk, [0] * hk
                clip_k, clip_v = clips or (float(grid[-1]), float(grid[-1]))

            def pick(t, w, hk=hk):  # per KV head, the winning candidate's tensor
                return None if t is None else torch.stack([t[w[h], h] for h in range(hk)]).float().contiguous()

            layers[i] = LayerRotation(pick(c.k_rots, wk), pick(c.v_rots, wv), clip_k, clip_v, pick(c.mu_k, wk),
                                      pick(c.mu_v, wv))
            winners["k"][str(i)] = [self.knames[w] for w in wk]
            winners["v"][str(i)] = [self.vnames[w] for w in wv]
        return layers, winners, held


def _measure(model, o: CalibrationOptions, w: _Windows, window, group_size: int) -> _Measured:
    """Statistics on the statistics windows, the candidates from them, their error on the held-out windows."""
    n_fw = (math.ceil(len(w.stats) / o.batch_size) * (2 if o.need_score_weighted else 1)
            + math.ceil(len(w.hold) / o.batch_size))
    with progress_bar(o.progress, n_fw, f"OSCAR calibration ({o.method})") as bar:
        t_stats = time.perf_counter()
        stats = collect_statistics(
            model, w.stats, score_weighted=o.need_score_weighted, kv_skip=window[0] if window else 0,
            batch_size=o.batch_size, pad_id=w.pad_id, _bar=bar)
        t_stats = time.perf_counter() - t_stats
        cands, knames, vnames = build_candidates(stats, o.method, center=o.center, value_target=o.value_target,
                                                 clip_grid=o.grid, shared=o.share_rotation_across_heads)
        if o.clips is not None:  # (method / center "auto"): the candidates are judged at the fixed clips
            for c in cands.values():
                c.clips_k, c.clips_v = torch.tensor([o.clips[0]]), torch.tensor([o.clips[1]])
        errors, t_hold = {}, 0.0
        if o.need_holdout:
            t_hold = time.perf_counter()
            errors = evaluate_candidates(
                model, w.hold, cands, group_size=group_size, meta_dtype=o.meta_dtype, batch_size=o.batch_size,
                pad_id=w.pad_id, query_samples=o.query_samples, window=window, _bar=bar)
            t_hold = time.perf_counter() - t_hold
    return _Measured(stats, cands, knames, vnames, errors, o, t_stats, t_hold)


def _select_by_kl(model, o: CalibrationOptions, fp, hold, m: _Measured, window, group_size: int):
    """``(picked, selection or None, seconds)``: ``method="auto"``'s pick against one candidate everywhere, by
    next-token KL through the cache on the longest held-out window."""
    picked = m.assemble()
    if not (o.method == "auto" and o.select_by_kl and m.errors):
        return picked, None, 0.0
    t = time.perf_counter()
    sink, recent = window or (64, 256)
    kl_ids = max(hold, key=lambda x: x.numel())
    if kl_ids.numel() - SCORED_TOKENS <= sink + recent:
        logger.info("calibrate: held-out windows too short for the KL check; keeping the held-out error's pick")
        return picked, None, time.perf_counter() - t
    options = {"auto": picked, **{name: m.assemble(name) for name in SELECTION_CANDIDATES
                                  if name in m.knames and name in m.vnames}}
    ref = reference_log_probs(model, kl_ids)
    kl = {name: next_token_kl(model, OscarRotations(fp, o.method, opt[0], {}), kl_ids, sink=sink, recent=recent,
                              group_size=group_size, meta_dtype=o.meta_dtype, reference=ref)
          for name, opt in options.items()}
    chosen = min(kl, key=kl.get)
    selection = {"objective": f"next-token KL through OscarCache, last {SCORED_TOKENS} tokens of a held-out window of "
                              f"{kl_ids.numel()}", "kl": kl, "chosen": chosen}
    return options[chosen], selection, time.perf_counter() - t


def _search_settings(model, o: CalibrationOptions, fp, windows, window, group_size: int, picked, scores):
    """``(metadata["settings"] entry or None, seconds)``: :func:`.settings.choose_settings` for these rotations."""
    if not o.choose_settings:
        return None, 0.0
    t = time.perf_counter()
    sink, recent = window or (64, 256)
    usable = [x for x in windows if x.numel() - SCORED_TOKENS > 4 * (sink + recent)]
    if usable:
        base = OscarConfig(sink=sink, recent=recent, group_size=group_size, meta_dtype=o.meta_dtype)
        draft = OscarRotations(fp, o.method, picked[0], {"heldout_error": picked[2]}, scores)
        settings = search_settings(model, draft, usable, budget_bits=o.budget_bits, target_context=o.target_context,
                                   base=base, progress=o.progress)
    else:
        settings = {"skipped": f"no held-out window longer than {SCORED_TOKENS} + 4 x (sink + recent) = "
                               f"{SCORED_TOKENS + 4 * (sink + recent)} tokens (give seq_len or more text): "
                               "the cache uses OscarConfig's defaults"}
        logger.info("calibrate: %s", settings["skipped"])
    return settings, time.perf_counter() - t


def _metadata(model, o: CalibrationOptions, w: _Windows, m: _Measured, window, group_size: int, picked, selection,
              settings, scores, times: dict) -> dict:
    """The artifact's metadata: how it was calibrated, the clips, winners, spectra, and what each step chose."""
    layers, winners, held = picked
    spectra = {str(i): entry for i, entry in m.stats.spectra().items()}  # C_Q, C_K; then C_S, C_V without eigvals
    for i, s in m.stats.layers.items():
        spectra[str(i)].update({name: {k: v for k, v in spectrum_summary(fn()).items() if k != "eigvals"}
                                for name, fn in (("C_S", s.c_s), ("C_V", s.c_v))})
    auto = o.method == "auto" or o.center == "auto"
    meta = {
        "calibration": {
            "method": o.method, "value_target": o.value_target, "center": o.center, "group_size": group_size,
            "meta_dtype": o.meta_dtype, "share_rotation_across_heads": bool(o.share_rotation_across_heads),
            "fixed_clips": list(o.clips) if o.clips else None, "tokens": m.stats.tokens, "windows": m.stats.windows,
            "seq_len": max(s.numel() for s in w.stats), "holdout_tokens": sum(s.numel() for s in w.hold),
            "holdout_windows": len(w.hold), "settings_windows": len(w.settings) if o.choose_settings else 0,
            "batch_size": o.batch_size, "clip_grid": list(o.grid) if o.need_holdout else None,
            "query_samples": o.query_samples if o.need_holdout else None, "window": list(window) if window else None,
            "passes": ["statistics"] + (["score-weighted (2nd pass, same windows)"] if o.need_score_weighted else [])
            + (["held-out selection"] if o.need_holdout else []) + (["retrieval probes"] if scores is not None else [])
            + (["cache settings search"] if settings and "chosen" in settings else []),
            "time_s": round(time.perf_counter() - times["start"], 2),
            "cpu_time_s": round(time.process_time() - times["cpu_start"], 2),
            **{f"time_{k}_s": round(times[k], 2) for k in ("statistics", "selection", "retrieval", "kl_selection",
                                                             "settings")},
            "oscar_hf": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "clips": {str(i): [lr.clip_k, lr.clip_v] for i, lr in sorted(layers.items())},
        "winners": winners, "spectra": spectra,
        # (those None or empty are left out)
        "heldout_error": held or None, "selection": selection, "settings": settings,
        "auto_counts": {kind: dict(Counter(n for names in winners[kind].values() for n in names).most_common())
                        for kind in ("k", "v")} if auto else None,
        "retrieval_probes": None if scores is None else {
            "n": o.retrieval_probes, "lengths": list(probe_lengths(model, o.retrieval_lengths))}}
    return {**{k: v for k, v in meta.items() if v is not None}, **(o.metadata or {})}
