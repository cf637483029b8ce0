"""Calibration: text -> attention statistics -> rotations, offsets and clip ratios (an
:class:`~oscar_hf.rotations.OscarRotations` artifact).

Passes (all with ``use_cache=False`` so every attention call sees a whole window; the hooks live in
:mod:`.hooks`, the statistics in :mod:`.stats`, candidates and selection in :mod:`.search`, the driver
:func:`calibrate` in :mod:`.pipeline`, reports in :mod:`.report`):

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

Shared rotations (``share_rotation_across_heads=True``, as the authors' rotation files): each covariance above is
pooled over the KV heads of a layer (each head's moment around its own mean when centered), one ``R_K`` / ``R_V`` per
layer is taken from it and stored for every KV head, and the held-out selection picks one candidate per layer; the
offsets stay per head.

Retrieval heads (:mod:`.retrieval_heads`): the KV heads that copy a fact from far back, scored on
synthetic needle probes, for ``OscarConfig.retrieval_heads``.

Cache settings (:mod:`.settings`): after the rotations, the window, group size, quantizer, retrieval heads' number and
width and layers kept precise are chosen by next-token KL through the cache within a memory budget
(``calibrate(budget_bits=...)``), stored in the artifact's ``metadata["settings"]``.
"""
from .options import CalibrationOptions
from .pipeline import METHODS, VALUE_TARGETS, calibrate
from .report import calibration_report, plot_settings, plot_spectra
from .retrieval_heads import find_retrieval_heads
from .search import CLIP_GRID, attention_error, build_candidates, evaluate_candidates
from .settings import choose_settings
from .stats import CalibrationStats, collect_statistics

__all__ = [
    "calibrate",
    "CalibrationOptions",
    "choose_settings",
    "attention_error",
    "calibration_report",
    "plot_settings",
    "plot_spectra",
    "find_retrieval_heads",
    "collect_statistics",
    "build_candidates",
    "evaluate_candidates",
    "CalibrationStats",
    "CLIP_GRID",
    "METHODS",
    "VALUE_TARGETS",
]
