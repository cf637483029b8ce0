"""`OscarConfig`: the cache's settings (and named presets of them), and `ModelFingerprint`: what an artifact was
made for."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from .quant import QUANTIZERS, SUPPORTED_META_DTYPES, bits_per_element, check_group_size

_META_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_META_DTYPES}

# Layer kinds (ModelFingerprint.layer_types, read by layer_types_of from Transformers' config.layer_types): the
# attention of each decoder layer as OSCAR sees it. FULL: OSCAR quantizes it (a "hybrid" layer's attention too: its
# state is hybrid_state_layers'). SLIDING: Transformers' own full-precision sliding-window layer (bounded already).
FULL_LAYER_TYPES = ("full_attention",)
SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
# Layers with a recurrent or convolution state and no per-token K/V (Qwen3-Next / Qwen3.5, Jamba, Bamba,
# GraniteMoeHybrid, LFM2, ...): Transformers' own state layer, untouched.
STATE_LAYER_TYPES = ("linear_attention", "conv")
# Full attention kept in Transformers' own full-precision layer, with the reason (logged by OscarCache, docs/usage.md):
# * MLA (DeepSeek-V2/V3, GLM-4-MoE-Lite, Kimi-Linear, ...): Transformers caches the compressed latent
#   [B, 1, S, kv_lora_rank] and its rope part [B, 1, S, qk_rope_head_dim], and rebuilds every head's keys and values
#   from the whole latent history with kv_b_proj at every step. An INT2 latent would have to be dequantized to a
#   full-precision copy of that history every step to feed kv_b_proj (which OSCAR never builds), and the latent is
#   already ~71x smaller than per-head K/V (576 vs 40,960 elements per token and layer on DeepSeek-V3); reading it in
#   INT2 needs kv_b_proj absorbed into the queries, which is model-specific code.
# * KV sharing (Gemma 3n, Gemma 4): a "store" layer's cache.update result is attended to again by later "reuse" layers,
#   which need tensors, not OSCAR's handle.
# * keys and values of different head sizes (``v_head_dim`` != ``head_dim``: MiMo-V2-Flash, 192 / 128): the INT2
#   storage, its rotations and the decode kernels pair one head_dim for both.
LATENT_LAYER_TYPE = "latent_attention"
SHARED_KV_LAYER_TYPE = "shared_kv_attention"
UNEQUAL_KV_LAYER_TYPE = "unequal_kv_attention"
FULL_PRECISION_LAYER_TYPES = (LATENT_LAYER_TYPE, SHARED_KV_LAYER_TYPE, UNEQUAL_KV_LAYER_TYPE)
FULL_PRECISION_WHY = {
    LATENT_LAYER_TYPE: "multi-head latent attention: Transformers caches the latent and expands it through kv_b_proj "
                       "at every step, so an INT2 latent would need a full-precision copy of its history every step; "
                       "the latent is already ~71x smaller than per-head keys and values",
    SHARED_KV_LAYER_TYPE: "KV sharing: later layers attend again to the keys and values this layer's cache returns",
    UNEQUAL_KV_LAYER_TYPE: "keys and values of different head sizes: OSCAR's INT2 storage and decode kernels pair one "
                           "head_dim for both",
}
# Layers that cache nothing: the "reuse" layers of KV sharing, MoE / MLP-only layers (Transformers' DummyLayer).
DUMMY_LAYER_TYPE = "dummy"
# Transformers' legacy names (remap_legacy_layer_types) and the attention kind of its "hybrid" layers
_LAYER_TYPE_ALIASES = {"mamba": "linear_attention", "attention": "full_attention", "moe": DUMMY_LAYER_TYPE,
                       "mlp": DUMMY_LAYER_TYPE, "hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}

# full_precision_heads="auto" (the default): the KV heads whose retrieval score (oscar_hf.calibration.retrieval_heads:
# attention mass that the answer of a key/value probe puts on its fact sentence, in [0, 1]) reaches this threshold,
# best first, as many as ``max_history_bits`` allows. On SmolLM2-135M (12 probes of 2-4K tokens) the 90 KV heads split
# into 8 at 0.55-0.73 and the rest at or below 0.27 (then 0.25, 0.23, 0.20, 0.17, 0.10; median 0.004): 0.4 lies in
# that gap. A head at the threshold puts 40% of its attention on a ~15-token fact among 2-4K tokens; shorter probes
# raise every score (1-2K tokens: two more heads at 0.43-0.46), so the probes keep their 2-4K default.
RETRIEVAL_THRESHOLD = 0.4
MAX_HISTORY_BITS = 3.0  # default cap on the history's average bits per element (INT2 heads + full-precision heads)
FULL_PRECISION_HEAD_BITS = 16  # the most a full-precision head costs per element (BF16 / FP16 storage)
# full_precision_bits: how those heads are stored (oscar_hf.cache.heads). 8 by default: INT8 codes with a scale and
# zero per token and head cost 8.5 bits per element at head_dim 64 (8.25 at 128) against 16, so the 3.0-bit cap holds
# 7 of SmolLM2's 8 retrieval heads instead of 3. INT4 (4.5 bits, all 8 heads) is not enough: its min-max step over
# the unrotated post-RoPE key channels is set by a few large channels and the keys lose the detail that retrieves.
# On 24 interior locker needles at 8K (BF16 22) INT4 heads found 17, INT8 heads 21, the same heads' keys exact 21;
# through the real cache INT8 heads keep >= 0.9x BF16 at every length 1K-8K, INT4 0.82x at 8K (docs/quality.md).
FULL_PRECISION_BITS = 8
FULL_PRECISION_BIT_CHOICES = (16, 8, 4)  # the model dtype, INT8, INT4 (the forms oscar_hf.cache.heads stores)
WINDOW_BITS = 16  # bits of a full-precision cached element in OscarConfig.stored_bits (BF16 / FP16)
# The cache settings calibrate() may choose per model (oscar_hf.calibration.settings) and store in the artifact's
# metadata["settings"]["chosen"]; a cache built from that artifact starts from them (artifact_settings).
CHOSEN_FIELDS = ("sink", "recent", "group_size", "meta_dtype", "quantizer", "full_precision_heads", "full_precision_bits")

# Named settings (``OscarConfig.from_preset``). "paper": the method authors' own runs (FutureMLS-Lab/OSCAR): one
# quantization group per head (group_size None = head_dim, resolved when the model is known) with float32 scale and
# zero, fixed clip ratios K 0.96 / V 0.92 (not searched), sink 64 / recent 256, no centering. Their rotations are
# one per layer shared by its KV heads: the authors' files (``OscarRotations.from_reference``) or
# ``calibrate(..., share_rotation_across_heads=True)``; the preset itself works with any artifact. The authors keep no
# head in full precision: full_precision_heads=0, not the default "auto".
PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(sink=64, recent=256, group_size=None, meta_dtype="float32", clip_k=0.96, clip_v=0.92,
                  center=False, full_precision_heads=0),
}


@dataclasses.dataclass(frozen=True)
class OscarConfig:
    """Settings of an :class:`~oscar_hf.OscarCache` (frozen: a user's config is never mutated).

    Args:
        sink: first tokens of each sequence kept in the model dtype (attention sinks), paper: 64.
        recent: last tokens before the current position kept in the model dtype, paper: 256.
        group_size: channels per quantization group along head_dim (one scale + zero each); ``None``: one group
            per head (``head_dim``), resolved by the cache (:meth:`for_head_dim`).
        bits: code width; only 2 is implemented.
        clip_k, clip_v: clip ratio override, a float for all layers or one per layer; ``None``
            takes the artifact's calibrated ratios (1.0 for artifact-free methods).
        meta_dtype: dtype of scale/zero ("bfloat16", "float16" or "float32").
        quantizer: how each group's scale and zero are set (``oscar_hf.quant``; same storage and read path):
            "minmax" (its range, shrunk by the clip ratio) or "std" (an even grid around its mean, levels 0.996
            standard deviations apart; no clip ratio).
        method: rotation for ``OscarCache(model_config, ...)`` without an artifact:
            "identity" (naive INT2) or "hadamard" (QuaRot-style).
        center: use the artifact's calibrated offsets mu_K / mu_V when it has them.
        key_offset: which key offset the INT2 history is centered on. "calibrated": the artifact's
            mu_K (with ``center``); "prefill": per sequence and KV head, the mean of the sequence's own
            non-sink keys at its first demotion (usually the prompt), fixed from then on. Any offset is
            exact for attention (``q·k = q·(k - mu) + q·mu``); the prompt's own mean follows the
            position-dependent drift of RoPE'd keys that a calibrated mean misses at long context.
            ``OscarCache`` (either storage) and ``StaticOscarCache``; the paged serving store takes
            "calibrated" only.
        skip_layers: layers kept entirely in full precision (negative indices count from the end).
        full_precision_heads: KV heads kept out of the INT2 history (keys and values, every position, stored as
            ``full_precision_bits`` says: INT8 by default), the rest of their layer quantized as usual; they give
            back retrieval of single facts from far back
            (needle in a haystack). ``"auto"`` (default): the artifact's "retrieval heads"
            (``OscarRotations.retrieval_scores``, see ``oscar_hf.calibration.retrieval_heads``) whose score
            reaches ``retrieval_threshold``, best first, at most as many as keep :meth:`history_bits` within
            ``max_history_bits``; none without scores (built-in ``method``, or an artifact calibrated with
            ``retrieval_probes=0``). An int ``k``: the ``k`` best retrieval heads; or explicit ``(layer, kv_head)``
            pairs (neither capped by ``max_history_bits``). Each head costs :meth:`full_precision_head_bits` per
            element of its share of the history instead of 2.5 (SmolLM2: 7 of 90 heads, 2.97 history bits at INT8;
            3.7 at 16 bits).
        full_precision_bits: how the full-precision heads store their keys and values (``oscar_hf.cache.heads``):
            16 (the model dtype, exact), 8 or 4 (default: codes with a scale and zero per token and head in the
            model dtype, min-max over head_dim; :data:`FULL_PRECISION_BITS` says why 8).
        max_history_bits: cap of ``full_precision_heads="auto"`` on the average bits per history element over
            all KV heads of the quantized layers (:meth:`history_bits`).
        retrieval_threshold: retrieval score (attention mass in [0, 1]) from which ``full_precision_heads="auto"``
            keeps a head; :data:`RETRIEVAL_THRESHOLD` says why 0.4.
        block_size: history tokens dequantized at once by the CPU reference decode (bounded memory).
        prefill_chunk: tokens quantized at once when a long prompt is written to history.
        use_kernels: "auto" (Triton on CUDA when available), True (require) or False (torch reference).
    """

    sink: int = 64
    recent: int = 256
    group_size: int | None = 64
    bits: int = 2
    clip_k: float | tuple[float, ...] | None = None
    clip_v: float | tuple[float, ...] | None = None
    meta_dtype: str = "bfloat16"
    quantizer: str = "minmax"
    method: str = "hadamard"
    center: bool = True
    key_offset: str = "calibrated"
    skip_layers: tuple[int, ...] = ()
    full_precision_heads: str | int | tuple[tuple[int, int], ...] = "auto"
    full_precision_bits: int = FULL_PRECISION_BITS
    max_history_bits: float = MAX_HISTORY_BITS
    retrieval_threshold: float = RETRIEVAL_THRESHOLD
    block_size: int = 1024
    prefill_chunk: int = 4096
    use_kernels: bool | str = "auto"

    def __post_init__(self):
        for name in ("sink", "recent"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"OscarConfig.{name} must be a non-negative int, got {getattr(self, name)!r}")
        if self.recent < 1:
            raise ValueError("OscarConfig.recent must be >= 1 (the current token's predecessor stays in full precision)")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"OscarConfig.group_size must be a positive int or None (= head_dim), got {g!r}")
        if self.bits != 2:
            raise NotImplementedError(f"only bits=2 is implemented, got bits={self.bits}")
        if self.meta_dtype not in _META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {sorted(_META_DTYPES)}, got {self.meta_dtype!r}")
        if self.block_size < 1 or self.prefill_chunk < 1:
            raise ValueError("block_size and prefill_chunk must be positive")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"OscarConfig.quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if self.key_offset not in ("calibrated", "prefill"):
            raise ValueError(f"key_offset must be 'calibrated' or 'prefill', got {self.key_offset!r}")
        if self.use_kernels not in ("auto", True, False):
            raise ValueError(f"use_kernels must be 'auto', True or False, got {self.use_kernels!r}")
        for name in ("clip_k", "clip_v"):
            val = getattr(self, name)
            if isinstance(val, Sequence) and not isinstance(val, str):
                object.__setattr__(self, name, tuple(float(v) for v in val))
                vals = getattr(self, name)
            elif val is None:
                vals = ()
            else:
                vals = (float(val),)
            if any(not (0.0 < v <= 1.0) for v in vals):
                raise ValueError(f"OscarConfig.{name} ratios must lie in (0, 1], got {val!r}")
        object.__setattr__(self, "skip_layers", tuple(int(i) for i in self.skip_layers))
        fph = self.full_precision_heads
        if isinstance(fph, str):
            if fph != "auto":
                raise ValueError(f"full_precision_heads must be 'auto', an int or (layer, kv_head) pairs, got {fph!r}")
        elif isinstance(fph, bool) or not isinstance(fph, (int, Sequence)):
            raise ValueError(f"full_precision_heads must be 'auto', an int or (layer, kv_head) pairs, got {fph!r}")
        elif isinstance(fph, int):
            if fph < 0:
                raise ValueError(f"full_precision_heads must be >= 0, got {fph}")
        else:
            try:
                pairs = tuple(sorted({(int(a), int(b)) for a, b in fph}))
            except (TypeError, ValueError):
                raise ValueError(f"full_precision_heads pairs must be (layer, kv_head) ints, got {fph!r}") from None
            if any(a < 0 or b < 0 for a, b in pairs):
                raise ValueError(f"full_precision_heads pairs must be non-negative, got {fph!r}")
            object.__setattr__(self, "full_precision_heads", pairs)
        if self.full_precision_bits not in FULL_PRECISION_BIT_CHOICES or isinstance(self.full_precision_bits, bool):
            raise ValueError(f"OscarConfig.full_precision_bits must be one of {FULL_PRECISION_BIT_CHOICES}, got "
                             f"{self.full_precision_bits!r}")
        ranges = (("max_history_bits", self.bits, FULL_PRECISION_HEAD_BITS), ("retrieval_threshold", 0.0, 1.0))
        for name, lo, hi in ranges:
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
                raise ValueError(f"OscarConfig.{name} must be a number in [{lo:g}, {hi:g}], got {val!r}")
            object.__setattr__(self, name, float(val))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "OscarConfig":
        """The named settings of :data:`PRESETS` (``"paper"``: the authors' own), with ``overrides`` on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown OscarConfig preset {name!r}; presets: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def reference(cls, **overrides) -> "OscarConfig":
        """The authors' settings (``from_preset("paper")``): group size = head_dim with float32 scale/zero, clips
        K 0.96 / V 0.92, sink 64, recent 256, no centering."""
        return cls.from_preset("paper", **overrides)

    @classmethod
    def build(cls, config: "OscarConfig | None" = None, preset: str | None = None, **overrides) -> "OscarConfig":
        """The config a cache runs with: ``config`` or the named ``preset`` (not both) or the defaults, with
        ``overrides`` (:class:`OscarConfig` fields) on top."""
        if config is not None and preset is not None:
            raise ValueError("pass either config= or preset=, not both (overrides apply on top of either)")
        if config is not None and not isinstance(config, cls):
            raise ValueError(f"config must be an OscarConfig, got {type(config).__name__}")
        if preset is not None:
            return cls.from_preset(preset, **overrides)
        base = config if config is not None else cls()
        return base.replace(**overrides) if overrides else base

    def for_head_dim(self, head_dim: int, *, default_group: bool = False) -> "OscarConfig":
        """This config with ``group_size=None`` resolved to ``head_dim`` (one group per head). ``default_group``: the
        group size is :class:`OscarConfig`'s default, not the user's or an artifact's choice, so where 64 does not
        divide ``head_dim`` it becomes :func:`default_group_size`'s (48 at Phi-3's 96); a chosen one stays (and is
        checked by :func:`validate_head_dim`)."""
        if self.group_size is None:
            return self.replace(group_size=int(head_dim))
        if default_group and head_dim % self.group_size:
            return self.replace(group_size=default_group_size(int(head_dim)))
        return self

    @property
    def torch_meta_dtype(self) -> torch.dtype:
        return _META_DTYPES[self.meta_dtype]

    def clip_for(self, kind: str, layer_idx: int, default: float) -> float:
        val = getattr(self, f"clip_{kind}")
        if val is None:
            return default
        if isinstance(val, tuple):
            if layer_idx >= len(val):
                raise ValueError(f"OscarConfig.clip_{kind} has {len(val)} entries, no ratio for layer {layer_idx}")
            return val[layer_idx]
        return float(val)

    def skipped(self, num_layers: int) -> set[int]:
        out = set()
        for i in self.skip_layers:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(f"skip_layers entry {i} is out of range for a model with {num_layers} layers")
            out.add(j)
        return out

    def full_precision_head_bits(self, head_dim: int) -> float:
        """Bits per element of a full-precision head as stored (``full_precision_bits``; codes + a 16-bit scale and
        zero per ``head_dim`` elements below 16)."""
        b = self.full_precision_bits
        return float(b) if b == 16 else b + 2 * 16 / head_dim

    def history_bits(self, head_dim: int, full_precision_share: float = 0.0, head_bits: float | None = None) -> float:
        """Average bits per history element when ``full_precision_share`` of the quantized layers' KV heads are
        full-precision heads (``head_bits`` each, default :meth:`full_precision_head_bits`) and the rest INT2 (code
        + scale/zero per group: 2.5 at group 64, BF16)."""
        c = self.for_head_dim(head_dim)
        q = bits_per_element(head_dim, c.group_size, c.torch_meta_dtype)
        if head_bits is None:
            head_bits = self.full_precision_head_bits(head_dim)
        return (1.0 - full_precision_share) * q + full_precision_share * head_bits

    def full_precision_head_budget(self, head_dim: int, num_heads: int, head_bits: float | None = None) -> int:
        """How many of ``num_heads`` (the quantized layers' KV heads) may be full precision (``head_bits`` each,
        default :meth:`full_precision_head_bits`) while :meth:`history_bits` stays within ``max_history_bits``
        (``full_precision_heads="auto"``)."""
        if head_bits is None:
            head_bits = self.full_precision_head_bits(head_dim)
        q = self.history_bits(head_dim)
        if num_heads <= 0 or self.max_history_bits <= q:
            return 0
        n = math.floor(num_heads * (self.max_history_bits - q) / (head_bits - q) + 1e-9)
        return min(n, num_heads)

    def stored_bits(self, fingerprint: "ModelFingerprint", quantized_layers: Sequence[int], context: int) -> float:
        """THE memory budget's measure (``calibrate(budget_bits=...)``, :mod:`oscar_hf.calibration.settings`): average
        stored bits per cached K/V element over the layers OSCAR quantizes (``quantized_layers``: the artifact's
        full-attention layers), once ``context`` tokens are cached. Per layer and KV head:

        * the ``min(context, sink + recent)`` window tokens at :data:`WINDOW_BITS` (BF16 / FP16, the dtype a cache
          serves in; a float32 calibration model's windows are counted at 16 too);
        * the other ``context - sink - recent`` tokens as history: INT2 codes + the group's scale and zero
          (:func:`~oscar_hf.quant.bits_per_element`: 2.5 at group 64, BF16), or :meth:`full_precision_head_bits` for a
          full-precision head (INT8: 8.5 at head_dim 64);
        * a ``skip_layers`` layer: :data:`WINDOW_BITS` for every token.

        Sliding-window, linear-attention and latent layers are not counted (no setting changes them). This is the
        compiled and serving storage's layout; the eager storage (the CPU's) also keeps a full-precision head's window
        tokens at its width (SmolLM2's 7 INT8 heads: +0.026 bits at 8192 tokens). ``full_precision_heads`` must be
        resolved (an int or pairs; ``"auto"`` depends on the artifact's scores:
        resolve it with :func:`oscar_hf.cache.resolve_full_precision_heads` first). Today's defaults on SmolLM2
        (30 layers x 3 KV heads of 64, 7 INT8 heads) at 8192 tokens: (320 x 16 + 7872 x 2.967) / 8192 = 3.476."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be a positive int of tokens, got {context!r}")
        layers = sorted({int(i) for i in quantized_layers})
        if not layers:
            raise ValueError("stored_bits needs at least one quantized layer")
        fph = self.full_precision_heads
        if fph == "auto":
            raise ValueError("stored_bits needs full_precision_heads resolved to an int or (layer, kv_head) pairs")
        head_dim, hk = fingerprint.head_dim, fingerprint.num_key_value_heads
        skipped = self.skipped(fingerprint.num_layers)
        live = [i for i in layers if i not in skipped]  # the layers with an INT2 history
        n_fp = (min(fph, len(live) * hk) if isinstance(fph, int)
                else len({(i, h) for i, h in fph if i in live and 0 <= h < hk}))
        window = min(context, self.sink + self.recent)
        history = self.history_bits(head_dim, n_fp / (len(live) * hk)) if live else 0.0  # bits per history element
        per_live_layer = (window * WINDOW_BITS + (context - window) * history) / context
        return (len(live) * per_live_layer + (len(layers) - len(live)) * WINDOW_BITS) / len(layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OscarConfig":
        """The config of :meth:`to_dict` (also after a JSON round trip: lists become tuples again)."""
        if not isinstance(d, dict):
            raise ValueError(f"OscarConfig.from_dict needs a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown OscarConfig fields {unknown}")
        tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v  # noqa: E731
        return cls(**{k: tup(v) for k, v in d.items()})

    def replace(self, **kw) -> "OscarConfig":
        return dataclasses.replace(self, **kw)


def artifact_settings(metadata: dict) -> dict[str, Any] | None:
    """The cache settings a calibration chose for its model (``metadata["settings"]["chosen"]``, written by
    :func:`oscar_hf.calibration.settings.choose_settings`) as :class:`OscarConfig` keywords, checked; None when the
    artifact has none (written before the search existed, or calibrated with ``choose_settings=False``): a cache from
    it then starts from today's defaults, as before."""
    entry = (metadata or {}).get("settings")
    if not isinstance(entry, dict) or entry.get("chosen") is None:
        return None
    chosen = entry["chosen"]
    if not isinstance(chosen, dict):
        raise ValueError(f"artifact metadata['settings']['chosen'] must be an object, got {type(chosen).__name__}")
    unknown = sorted(set(chosen) - set(CHOSEN_FIELDS))
    if unknown:
        raise ValueError(f"artifact metadata['settings']['chosen'] has fields no calibration chooses: {unknown} "
                         f"(known: {list(CHOSEN_FIELDS)})")
    tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v  # noqa: E731  (JSON lists -> tuples)
    out = {k: tup(v) for k, v in chosen.items()}
    OscarConfig(**out)  # a corrupted entry fails here, naming the field
    return out


def artifact_config(rotations) -> "OscarConfig | None":
    """The :class:`OscarConfig` a cache from ``rotations`` starts from: the settings its calibration chose
    (:func:`artifact_settings`), or None (no artifact, or none chosen: :class:`OscarConfig`'s defaults)."""
    chosen = artifact_settings(rotations.metadata) if rotations is not None else None
    return OscarConfig(**chosen) if chosen else None


def starting_config(config: "OscarConfig | None", preset: str | None, rotations,
                    overrides: dict) -> tuple["OscarConfig", bool]:
    """The config a cache or a serving store starts from, before the model's head_dim is known: ``config`` or the
    named ``preset``, else the settings ``rotations``' calibration chose (:func:`artifact_config`), else
    :class:`OscarConfig`'s defaults, with ``overrides`` on top; and whether its group size is the default nobody chose
    (:meth:`OscarConfig.for_head_dim` then fits it to the head_dim)."""
    default_group = config is None and preset is None and "group_size" not in overrides
    if config is None and preset is None:
        config = artifact_config(rotations)
        default_group = default_group and config is None
    return OscarConfig.build(config, preset, **overrides), default_group


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """The shape facts an artifact depends on, read from a model's text config."""

    architecture: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    name_or_path: str = ""

    @classmethod
    def from_config(cls, config) -> "ModelFingerprint":
        """The text config's facts; ``head_dim`` / ``num_key_value_heads`` are those of the layers OSCAR quantizes
        (Gemma 4's full-attention layers have their own, ``global_head_dim``: read from ``per_layer_config``)."""
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = layer_types_of(cfg)
        first = next((i for i, t in enumerate(types) if t in FULL_LAYER_TYPES), 0)
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(_layer_attr(cfg, first, "num_key_value_heads") or n_heads)
        head_dim = _layer_attr(cfg, first, "head_dim") or cfg.hidden_size // n_heads
        n_layers = int(cfg.num_hidden_layers)
        archs = getattr(config, "architectures", None) or getattr(cfg, "architectures", None) or []
        return cls(
            architecture=archs[0] if archs else type(cfg).__name__.replace("Config", "ForCausalLM"),
            model_type=str(getattr(cfg, "model_type", "")),
            num_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=int(head_dim),
            layer_types=tuple(types),
            name_or_path=str(getattr(config, "_name_or_path", "") or ""),
        )

    @property
    def has_quantized_layers(self) -> bool:
        """Whether any layer is of a kind OSCAR quantizes (MLA-only models have none)."""
        return any(t in FULL_LAYER_TYPES for t in self.layer_types)

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Human-readable differences that make an artifact unusable (the name is informative only)."""
        out = []
        for f in ("model_type", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f}: artifact has {a!r}, model has {b!r}")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelFingerprint":
        try:
            return cls(**{**d, "layer_types": tuple(d.get("layer_types", ()))})
        except TypeError as e:
            raise ValueError(f"corrupted model fingerprint in artifact: {json.dumps(d)[:200]} ({e})") from None


def _layer_attr(cfg, i: int, name: str):
    """``cfg.<name>`` as layer ``i`` sees it: heterogeneous configs (Gemma 4) hold it per layer, in ``per_layer_config``
    (whose global attribute raises); None where the config has none."""
    try:
        return getattr(cfg.per_layer_config[i], name, None)
    except (AttributeError, IndexError, KeyError, TypeError):  # no per_layer_config (older Transformers, plain objects)
        try:
            return getattr(cfg, name, None)
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            return None


def kv_sharing_modes(cfg) -> list[str | None] | None:
    """Per layer ``"store"`` (later layers reuse what its ``cache.update`` returned), ``"reuse"`` (attends to a store
    layer's keys and values, caches nothing) or None; None for a model without KV sharing. Transformers 5.2x has
    ``config.kv_sharing_modes``; 5.17 derives it in the model (Gemma 3n / Gemma 4: the last ``num_kv_shared_layers``
    layers reuse the last earlier layer of their type), as here."""
    modes = getattr(cfg, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    types = getattr(cfg, "layer_types", None)
    if shared <= 0 or types is None:
        return None
    n = int(cfg.num_hidden_layers)
    first = n - shared
    modes = [None if i < first else "reuse" for i in range(n)]
    for t in set(types[first:]):
        if t in types[:first]:
            modes[first - 1 - types[:first][::-1].index(t)] = "store"
    return modes


def layer_types_of(cfg) -> list[str]:
    """Per-layer kind as OSCAR sees it (the constants above): Transformers' ``layer_types`` (inferred as its caches do
    when absent; works on 5.10 .. 5.2x), legacy names mapped, a "hybrid" layer's attention as its attention type, MLA
    layers ``latent_attention``, KV sharing's reuse layers ``dummy`` and their store layers (when reused, and full
    attention) ``shared_kv_attention``, full attention whose values have another head size ``unequal_kv_attention``."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(cfg, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    types = [_LAYER_TYPE_ALIASES.get(t, t) for t in types]
    modes = kv_sharing_modes(cfg)
    if modes is not None:
        reused = {t for t, m in zip(types, modes) if m == "reuse"}
        types = [DUMMY_LAYER_TYPE if m == "reuse"
                 else SHARED_KV_LAYER_TYPE if m == "store" and t in reused and t in FULL_LAYER_TYPES else t
                 for t, m in zip(types, modes)]
    if getattr(cfg, "kv_lora_rank", None):  # MLA: every attention layer caches the latent
        types = [LATENT_LAYER_TYPE if t in FULL_LAYER_TYPES else t for t in types]
    elif getattr(cfg, "v_head_dim", None) is not None and cfg.v_head_dim != getattr(cfg, "head_dim", None):
        # (head_dim read only then: a heterogeneous config such as Gemma 4's raises on the global value)
        types = [UNEQUAL_KV_LAYER_TYPE if t in FULL_LAYER_TYPES else t for t in types]
    return types


def hybrid_state_layers(cfg) -> set[int]:
    """Layers that are attention and a linear-attention / SSM state in one (``layer_types`` "hybrid" /
    "hybrid_sliding": Falcon-H1, Zamba): their cache layer holds both."""
    return {i for i, t in enumerate(getattr(cfg, "layer_types", None) or ()) if t in ("hybrid", "hybrid_sliding")}


def default_group_size(head_dim: int) -> int:
    """The default quantization group at ``head_dim``: 64 channels where 64 divides it; else the largest whole
    number of planes (``head_dim / 4`` channels: the INT2 packing's unit, which the kernels' fast loop reads under one
    scale and zero) up to 64 channels -- 48 at head_dim 96 (Phi-3: 2.67 bits per element, where 32 would be 3.0 and
    take the kernels' slower per-channel loop), the whole head below 64 -- else one group per head."""
    if head_dim % 64 == 0:
        return 64
    plane = head_dim // 4
    return next((g for g in (head_dim, 2 * plane, plane) if 0 < g <= 64 and head_dim % g == 0), head_dim)


def validate_head_dim(fp: ModelFingerprint, group_size: int | None) -> None:
    """Raise ValueError naming the model when ``group_size`` (None: ``head_dim``) cannot group its heads (those of the
    quantized layers: nothing to check without one)."""
    if not fp.has_quantized_layers:
        return
    try:
        check_group_size(fp.head_dim, fp.head_dim if group_size is None else group_size)
    except ValueError as e:
        raise ValueError(f"{fp.architecture}: {e}") from None
