"""`calibrate()`: text -> calibration windows -> statistics -> candidates -> held-out selection -> artifact."""
from __future__ import annotations

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
from .retrieval_heads import LENGTHS, PROBES, find_retrieval_heads, probe_lengths
from .search import CLIP_GRID, META_DTYPES, build_candidates, center_modes, evaluate_candidates, select_best
from .selection import SCORED_TOKENS, next_token_kl, reference_log_probs
from .settings import DEFAULT_BUDGET_BITS, check_budget, choose_settings as search_settings
from .stats import collect_statistics, full_attention_layers, spectrum_summary

logger = logging.getLogger("oscar_hf")

METHODS = ("oscar", "pca-kv", "hadamard", "identity", "auto")
VALUE_TARGETS = ("sst", "score-weighted")
SELECTION_CANDIDATES = ("oscar", "pca-kv", "hadamard")  # method="auto": whole-artifact alternatives to its pick
SETTINGS_WINDOWS = 2  # held-out windows the settings search scores (text input; one more than the selection's default)


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
    method: str = "auto",
    tokens: int = 8192,
    seq_len: int = 2048,
    group_size: int | str | None = "auto",
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
    share_rotation_across_heads: bool = False,
    clips: tuple[float, float] | None = None,
    retrieval_probes: int = PROBES,
    retrieval_lengths: Sequence[int] = LENGTHS,
    select_by_kl: bool = True,
    choose_settings: bool = True,
    budget_bits: float = DEFAULT_BUDGET_BITS,
    target_context: int | None = None,
) -> OscarRotations:
    """Calibrate OSCAR rotations, offsets and clip ratios for ``model``.

    Args:
        texts: a string or list of strings (tokenized with ``tokenizer``; give calibration text only,
            e.g. ``oscar_hf.data.calibration_text(...)``), or with ``tokenizer=None`` a ``[n, L]`` tensor
            / list of 1-D token-id sequences.
        method: "oscar" (C_Q keys / value_target values), "pca-kv" (C_K / C_V), "hadamard",
            "identity" (calibrated offsets and clips only), or "auto" (best candidate per layer, KV head
            and K/V on held-out tokens, then checked end to end: that pick, all-"oscar", all-"pca-kv" and
            all-"hadamard" are scored by next-token KL through the cache on a held-out window and the lowest wins, see
            :mod:`.selection`; the metadata's ``selection`` says which).
        tokens: statistics tokens: ``ceil(tokens / seq_len)`` windows of ``min(seq_len, tokens)`` tokens
            from the start of the text (ignored for token-id input: all rows are used).
        group_size: the quantization group size the clips (and ``auto``) are chosen for; ``None``: head_dim (one
            group per head, the authors' setting); ``"auto"`` (default): 64, or where 64 does not divide head_dim
            :func:`~oscar_hf.config.default_group_size`'s (48 at 96).
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
        share_rotation_across_heads: one ``R_K`` and one ``R_V`` per layer, shared by its KV heads (as the
            authors' rotation files), from the statistics of all its KV heads pooled, replicated per head in the
            artifact; the held-out selection then picks one candidate per layer. Offsets (``center``) stay per
            head. Default: one rotation per KV head.
        clips: fixed ``(clip_k, clip_v)`` for every layer, not searched (e.g. the authors' ``(0.96, 0.92)``);
            overrides ``clip_grid``.
        retrieval_probes: synthetic key/value probes placed in the calibration text that score every KV head's
            retrieval (:mod:`.retrieval_heads`), stored as the artifact's ``retrieval_scores``: the heads that
            ``OscarConfig(full_precision_heads="auto")`` (the default) keeps in full precision. 0: no scores (then
            no full-precision heads by default). Needs string ``texts`` (token-id input is not scored) with at
            least ``max(retrieval_lengths) + retrieval_probes`` tokens.
        retrieval_lengths: probe lengths in tokens (those beyond the model's context are dropped).
        select_by_kl: ``method="auto"``'s end-to-end check (False: the held-out error's pick as it is). It needs a
            held-out window longer than ``512 + sink + recent`` tokens, else the pick stays as it is.
        choose_settings: after the rotations, choose the cache settings (window, group size, quantizer, retrieval
            heads and their width, layers kept precise) by next-token KL through the cache on held-out windows,
            within ``budget_bits`` (:mod:`.settings`), and store the choice in ``metadata["settings"]``: a cache built
            from the artifact starts from it (the user's arguments still win). Text input scores
            ``SETTINGS_WINDOWS`` held-out windows of ``seq_len`` tokens read after the statistics windows; held-out
            windows not longer than ``512 + 4 * (sink + recent)`` tokens skip the search (recorded). False: the
            cache uses ``OscarConfig``'s defaults, as artifacts calibrated before the search.
        budget_bits: the memory budget: average stored bits per cached K/V element over the quantized layers at
            ``target_context`` tokens (``OscarConfig.stored_bits``: windows at 16 bits, INT2 codes + scale / zero,
            full-precision heads at their width). Default 3.5 (today's defaults cost 3.476 on SmolLM2 at 8192).
        target_context: the context the budget is priced at; ``None``: ``min(32768, max_position_embeddings)``.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(retrieval_probes, bool) or not isinstance(retrieval_probes, int) or retrieval_probes < 0:
        raise ValueError(f"retrieval_probes must be an int >= 0, got {retrieval_probes!r}")
    if not isinstance(choose_settings, bool):
        raise ValueError(f"choose_settings must be True or False, got {choose_settings!r}")
    check_budget(budget_bits, target_context)
    if value_target not in VALUE_TARGETS:
        raise ValueError(f"value_target must be one of {VALUE_TARGETS}, got {value_target!r}")
    center_modes(center)
    if not 0.0 < holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must lie in (0, 1], got {holdout_fraction}")
    if batch_size < 1 or tokens < 2 or seq_len < 2:
        raise ValueError("batch_size must be >= 1, tokens and seq_len >= 2")
    if isinstance(meta_dtype, torch.dtype):
        meta_dtype = str(meta_dtype).removeprefix("torch.")
    if meta_dtype not in META_DTYPES:
        raise ValueError(f"meta_dtype must be one of {sorted(META_DTYPES)}, got {meta_dtype!r}")
    if clips is not None:
        if isinstance(clips, (str, bytes)) or len(clips) != 2:
            raise ValueError(f"clips must be a (clip_k, clip_v) pair, got {clips!r}")
        clips = (float(clips[0]), float(clips[1]))
        clip_grid = None
    grid = tuple(sorted({round(float(c), 6) for c in (clip_grid or (1.0,))}))
    if any(not 0.0 < c <= 1.0 for c in grid + (clips or ())):
        raise ValueError(f"clip ratios must lie in (0, 1], got {clips or clip_grid}")
    fp = ModelFingerprint.from_config(model.config)
    if group_size == "auto":
        group_size = default_group_size(fp.head_dim)
    elif isinstance(group_size, str):
        raise ValueError(f"group_size must be an int, None (head_dim) or 'auto', got {group_size!r}")
    group_size = fp.head_dim if group_size is None else group_size
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
        sl = min(seq_len, tokens)
        n_stats = math.ceil(tokens / sl)
        n_hold = max(1, math.ceil(holdout_fraction * n_stats)) if need_holdout else 0
        n_settings = max(n_hold, SETTINGS_WINDOWS) if choose_settings else n_hold  # (the first n_hold are shared)
        try:
            stats_ids, hold_ids = calibration_windows(tokenizer, texts, tokens, sl, n_settings)
        except ValueError:  # text for the selection's windows but not for the search's extra ones: it scores fewer
            if n_settings == n_hold:
                raise
            n_settings = n_hold
            stats_ids, hold_ids = calibration_windows(tokenizer, texts, tokens, sl, n_settings)
        stats_seqs = as_sequences(stats_ids)
        settings_seqs = as_sequences(hold_ids) if n_settings else []
        hold_seqs = settings_seqs[:n_hold]
        pad_id = tokenizer.pad_token_id or 0
    else:
        seqs = as_sequences(texts)
        n_hold = 0
        if need_holdout:  # (token ids: the settings search scores these held-out rows, none are taken for it)
            if len(seqs) < 2:
                raise ValueError(
                    "a clip search, method='auto' or center='auto' need at least 2 token sequences (one is held out)"
                )
            n_hold = min(len(seqs) - 1, max(1, round(len(seqs) * holdout_fraction / (1 + holdout_fraction))))
        stats_seqs, hold_seqs = seqs[: len(seqs) - n_hold], seqs[len(seqs) - n_hold :]
        settings_seqs = hold_seqs
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
    # retrieval heads first: a text too short for the probes fails before the long passes
    scores, t_ret = None, 0.0
    if retrieval_probes and not _is_texts(texts):
        logger.info("calibrate: token-id input, retrieval heads not scored (the probes are written into text)")
    elif retrieval_probes:
        t_ret = time.perf_counter()
        scores = find_retrieval_heads(model, tokenizer, join_texts(texts), retrieval_probes, tuple(retrieval_lengths),
                                      progress=progress)
        t_ret = time.perf_counter() - t_ret
    n_fw = math.ceil(len(stats_seqs) / batch_size) * (2 if need_sw else 1) + math.ceil(len(hold_seqs) / batch_size)
    bar = progress_bar(progress, n_fw, f"OSCAR calibration ({method})")
    try:
        t_stats = time.perf_counter()
        stats = collect_statistics(
            model, stats_seqs, score_weighted=need_sw, kv_skip=window[0] if window else 0, batch_size=batch_size,
            pad_id=pad_id, _bar=bar,
        )
        t_stats = time.perf_counter() - t_stats
        cands, knames, vnames = build_candidates(
            stats, method, center=center, value_target=value_target, clip_grid=grid,
            shared=share_rotation_across_heads,
        )
        if clips is not None:  # (method / center "auto"): the candidates are judged at the fixed clips
            for c in cands.values():
                c.clips_k, c.clips_v = torch.tensor([clips[0]]), torch.tensor([clips[1]])
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

    def assemble(only: str | None = None):
        """``(layers, winners, held)``: per layer and KV head the candidate ``only`` (its best clip), or the
        held-out error's pick (``None``), with the selection error of what was picked."""
        layers: dict[int, LayerRotation] = {}
        winners = {"k": {}, "v": {}}
        held: dict[str, dict] = {}
        for i, c in sorted(cands.items()):
            hk = c.k_rots.shape[1]
            if i in errors:
                e = errors[i]
                if only is None:
                    jk, wk = select_best(e.k, share_rotation_across_heads)
                    jv, wv = select_best(e.v, share_rotation_across_heads)
                else:  # one candidate everywhere: the layer's best clip for it
                    ck, cv = knames.index(only), vnames.index(only)
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
            winners["k"][str(i)] = [knames[w] for w in wk]
            winners["v"][str(i)] = [vnames[w] for w in wv]
        return layers, winners, held

    layers, winners, held = assemble()
    selection, t_kl = None, 0.0
    if method == "auto" and select_by_kl and errors:
        # the held-out error's pick against one candidate everywhere, by next-token KL through the cache
        t_kl = time.perf_counter()
        sink, recent = window or (64, 256)
        kl_ids = max(hold_seqs, key=lambda x: x.numel())
        if kl_ids.numel() - SCORED_TOKENS > sink + recent:
            options = {"auto": (layers, winners, held)}
            options.update({name: assemble(name) for name in SELECTION_CANDIDATES
                            if name in knames and name in vnames})
            ref = reference_log_probs(model, kl_ids)
            kl = {name: next_token_kl(model, OscarRotations(fp, method, opt[0], {}), kl_ids, sink=sink,
                                      recent=recent, group_size=group_size, meta_dtype=meta_dtype, reference=ref)
                  for name, opt in options.items()}
            chosen = min(kl, key=kl.get)
            layers, winners, held = options[chosen]
            selection = {"objective": f"next-token KL through OscarCache, last {SCORED_TOKENS} tokens of a held-out "
                                      f"window of {kl_ids.numel()}", "kl": kl, "chosen": chosen}
        else:
            logger.info("calibrate: held-out windows too short for the KL check; keeping the held-out error's pick")
        t_kl = time.perf_counter() - t_kl

    settings, t_set = None, 0.0
    if choose_settings:
        # the cache settings for these rotations, by next-token KL on held-out windows within the budget
        t_set = time.perf_counter()
        sink, recent = window or (64, 256)
        usable = [x for x in settings_seqs if x.numel() - SCORED_TOKENS > 4 * (sink + recent)]
        if usable:
            base = OscarConfig(sink=sink, recent=recent, group_size=group_size, meta_dtype=meta_dtype)
            draft = OscarRotations(fp, method, layers, {"heldout_error": held}, scores)
            settings = search_settings(model, draft, usable, budget_bits=budget_bits, target_context=target_context,
                                       base=base, progress=progress)
        else:
            settings = {"skipped": f"no held-out window longer than {SCORED_TOKENS} + 4 x (sink + recent) = "
                                   f"{SCORED_TOKENS + 4 * (sink + recent)} tokens (give seq_len or more text): "
                                   "the cache uses OscarConfig's defaults"}
            logger.info("calibrate: %s", settings["skipped"])
        t_set = time.perf_counter() - t_set

    spectra = {}
    for i, s in sorted(stats.layers.items()):
        entry = {name: spectrum_summary(fn()) for name, fn in (("C_Q", s.c_q), ("C_K", s.c_k))}
        for name, fn in (("C_S", s.c_s), ("C_V", s.c_v)):
            summ = spectrum_summary(fn())
            summ.pop("eigvals")
            entry[name] = summ
        spectra[str(i)] = entry
    meta = {
        "calibration": {
            "method": method,
            "value_target": value_target,
            "center": center,
            "group_size": group_size,
            "meta_dtype": meta_dtype,
            "share_rotation_across_heads": bool(share_rotation_across_heads),
            "fixed_clips": list(clips) if clips else None,
            "tokens": stats.tokens,
            "windows": stats.windows,
            "seq_len": max(s.numel() for s in stats_seqs),
            "holdout_tokens": sum(s.numel() for s in hold_seqs),
            "holdout_windows": len(hold_seqs),
            "settings_windows": len(settings_seqs) if choose_settings else 0,
            "batch_size": batch_size,
            "clip_grid": list(grid) if need_holdout else None,
            "query_samples": query_samples if need_holdout else None,
            "window": list(window) if window else None,
            "passes": ["statistics"] + (["score-weighted (2nd pass, same windows)"] if need_sw else [])
            + (["held-out selection"] if need_holdout else []) + (["retrieval probes"] if scores is not None else [])
            + (["cache settings search"] if settings and "chosen" in settings else []),
            "time_s": round(time.perf_counter() - t0, 2),
            "cpu_time_s": round(time.process_time() - c0, 2),
            "time_statistics_s": round(t_stats, 2),
            "time_selection_s": round(t_hold, 2),
            "time_retrieval_s": round(t_ret, 2),
            "time_kl_selection_s": round(t_kl, 2),
            "time_settings_s": round(t_set, 2),
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
    if selection is not None:
        meta["selection"] = selection
    if settings is not None:
        meta["settings"] = settings
    if method == "auto" or center == "auto":
        meta["auto_counts"] = {
            kind: dict(Counter(n for names in winners[kind].values() for n in names).most_common())
            for kind in ("k", "v")
        }
    if scores is not None:
        meta["retrieval_probes"] = {"n": retrieval_probes, "lengths": list(probe_lengths(model, retrieval_lengths))}
    if metadata:
        meta.update(metadata)
    rot = OscarRotations(fp, method, layers, meta, scores)
    rot.validate()
    logger.info("OSCAR calibration (%s) of %d layers on %d tokens took %.1f s", method, len(layers), stats.tokens,
                meta["calibration"]["time_s"])
    return rot
