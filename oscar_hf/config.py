"""`OscarConfig`: the cache's settings, their presets, and where a cache's settings come from
(:func:`starting_config`). Model facts (re-exported): :mod:`.fingerprint`."""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .fingerprint import (  # noqa: F401  (re-exported: the names every module imports from config)
    DUMMY_LAYER_TYPE, FULL_LAYER_TYPES, FULL_PRECISION_LAYER_TYPES, FULL_PRECISION_WHY, LATENT_LAYER_TYPE,
    SHARED_KV_LAYER_TYPE, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES, UNEQUAL_KV_LAYER_TYPE, ModelFingerprint,
    default_group_size, hybrid_state_layers, kv_sharing_modes, layer_types_of, validate_head_dim)
from .quant import QUANTIZERS, SUPPORTED_META_DTYPES, bits_per_element, check_code_bits, check_group_size

META_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_META_DTYPES}

# retrieval_heads="auto" keeps the KV heads whose retrieval score (attention mass in [0, 1]) reaches this; why 0.4:
# docs/quality.md, "Retrieval-safe defaults"
RETRIEVAL_THRESHOLD = 0.4
MAX_HISTORY_BITS = 3.0  # default cap on the history's average bits per element (INT2 heads + retrieval heads)
RETRIEVAL_HEAD_MAX_BITS = 16  # the most a retrieval head costs per element (BF16 / FP16 storage)
# retrieval_bits 8: the 3.0-bit cap holds more heads than at 16, and INT4 loses needles (same doc)
RETRIEVAL_BITS = 8
RETRIEVAL_BIT_CHOICES = (16, 8, 4)  # the model dtype, INT8, INT4 (the forms oscar_hf.cache.heads stores)
WINDOW_BITS = 16  # bits of a full-precision cached element in OscarConfig.stored_bits (BF16 / FP16)
# The settings calibrate() may choose per model, stored in metadata["settings"]["chosen"] (artifact_settings)
CHOSEN_FIELDS = ("sink", "recent", "group_size", "meta_dtype", "quantizer", "retrieval_heads", "retrieval_bits",
                 "key_bits", "value_group_size")

# Named settings (``OscarConfig.from_preset``). "paper": the method authors' runs (FutureMLS-Lab/OSCAR); it works with
# any artifact, though theirs has one rotation per layer (``OscarRotations.from_reference``).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(sink=64, recent=256, group_size=None, meta_dtype="float32", clip_k=0.96, clip_v=0.92,
                  center=False, retrieval_heads=0)}

# old field name -> today's. Keywords warn (FutureWarning); saved configs and artifacts load either name.
RENAMED_FIELDS = {"full_precision_heads": "retrieval_heads", "full_precision_bits": "retrieval_bits"}


def renamed_keywords(kw: dict, where: str, warn: bool = True) -> dict:
    """``kw`` with old field names renamed (a FutureWarning each when ``warn``); a TypeError when both are given."""
    kw = dict(kw)
    for old, new in RENAMED_FIELDS.items():
        if old in kw:
            if new in kw:
                raise TypeError(f"{where}: pass {new}= only ({old}= is its old name), not both")
            if warn:
                warnings.warn(f"{where}: {old}= is now {new}= (the retrieval heads); the old name will be removed",
                              FutureWarning, stacklevel=3)  # (the line calling the OscarConfig method)
            kw[new] = kw.pop(old)
    return kw


def _old_attribute(config, old: str):
    new = RENAMED_FIELDS[old]
    warnings.warn(f"OscarConfig.{old} is now OscarConfig.{new}; the old name will be removed", FutureWarning,
                  stacklevel=3)  # (the line reading the attribute)
    return getattr(config, new)


@dataclasses.dataclass(frozen=True)
class OscarConfig:
    """Settings of an :class:`~oscar_hf.OscarCache` (frozen: a user's config is never mutated); docs/usage.md."""

    sink: int = 64  # the first tokens kept in the model dtype
    recent: int = 256  # the last tokens before the current position kept in the model dtype
    group_size: int | None = 64  # channels per group along head_dim (one scale + zero); None: head_dim (for_head_dim)
    bits: int = 2  # the values' code width (and the keys' unless key_bits); only 2 is implemented
    # the keys' code width: 2, or 3 (8 levels, "minmax" only: the keys carry most of the INT2 loss, docs/quality.md);
    # 3-bit keys: the Triton kernels at power-of-two head_dims (kernels_serve), the serving store too
    key_bits: int = 2
    # the values' group size where it differs from the keys' (None: group_size): a coarser value group pays for the
    # keys' third bit (docs/quality.md, "Three-bit keys"); served as key_bits=3 is
    value_group_size: int | None = None
    clip_k: float | tuple[float, ...] | None = None  # clip ratio, one or one per layer; None: the artifact's (else 1)
    clip_v: float | tuple[float, ...] | None = None
    meta_dtype: str = "bfloat16"  # of scale / zero: "bfloat16", "float16" or "float32"
    quantizer: str = "minmax"  # "minmax" (range shrunk by the clip ratio) or "std" (no clip): oscar_hf.quant
    method: str = "hadamard"  # rotation without an artifact: "identity" (naive INT2) or "hadamard" (QuaRot-style)
    center: bool = True  # use the artifact's offsets mu_K / mu_V when it has them
    # "calibrated" (the artifact's mu_K) or "prefill" (each sequence's own non-sink key mean at its first demotion;
    # not the paged serving store)
    key_offset: str = "calibrated"
    skip_layers: tuple[int, ...] = ()  # layers kept in full precision (negative indices count from the end)
    # KV heads out of the INT2 history: "auto" (scoring >= retrieval_threshold, within max_history_bits), k (the k
    # best) or (layer, kv_head) pairs
    retrieval_heads: str | int | tuple[tuple[int, int], ...] = "auto"
    retrieval_bits: int = RETRIEVAL_BITS  # 16 (model dtype), 8 or 4 (codes + a scale and zero per token and head)
    max_history_bits: float = MAX_HISTORY_BITS  # "auto"'s cap on history_bits
    retrieval_threshold: float = RETRIEVAL_THRESHOLD
    block_size: int = 1024  # history tokens the CPU reference decode dequantizes at once (bounded memory)
    prefill_chunk: int = 4096  # tokens quantized at once when a long prompt is written to the history
    use_kernels: bool | str = "auto"  # "auto" (Triton on CUDA), True (require) or False (torch reference)

    def __post_init__(self):
        """Raise ValueError naming the field that is out of range; sequences become tuples (in place: frozen)."""
        for name, lo in (("sink", 0), ("recent", 1)):  # recent >= 1: the current token's predecessor stays unquantized
            val = getattr(self, name)
            if not isinstance(val, int) or val < lo:
                raise ValueError(f"OscarConfig.{name} must be an int >= {lo}, got {val!r}")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"OscarConfig.group_size must be a positive int or None (= head_dim), got {g!r}")
        gv = self.value_group_size
        if gv is not None and (isinstance(gv, bool) or not isinstance(gv, int) or gv < 1):
            raise ValueError(f"OscarConfig.value_group_size must be a positive int or None (= group_size), got {gv!r}")
        if self.bits != 2:
            raise NotImplementedError(f"only bits=2 is implemented, got bits={self.bits}")
        check_code_bits(self.key_bits, quantizer=self.quantizer, name="OscarConfig.key_bits")
        if self.block_size < 1 or self.prefill_chunk < 1:
            raise ValueError("block_size and prefill_chunk must be positive")
        for name, allowed in (("meta_dtype", sorted(META_DTYPES)), ("quantizer", QUANTIZERS),
                              ("key_offset", ("calibrated", "prefill")), ("use_kernels", ("auto", True, False))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"OscarConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("clip_k", "clip_v"):
            val = getattr(self, name)
            if seq := isinstance(val, Sequence) and not isinstance(val, str):
                object.__setattr__(self, name, tuple(float(v) for v in val))
            vals = getattr(self, name) if seq else () if val is None else (float(val),)
            if any(not (0.0 < v <= 1.0) for v in vals):
                raise ValueError(f"OscarConfig.{name} ratios must lie in (0, 1], got {val!r}")
        object.__setattr__(self, "skip_layers", tuple(int(i) for i in self.skip_layers))
        object.__setattr__(self, "retrieval_heads", _retrieval_heads(self.retrieval_heads))
        if self.retrieval_bits not in RETRIEVAL_BIT_CHOICES:  # (True and False are 1 and 0: refused too)
            raise ValueError(f"OscarConfig.retrieval_bits (full_precision_bits before) must be one of "
                             f"{RETRIEVAL_BIT_CHOICES}, got {self.retrieval_bits!r}")
        for name, lo, hi in (("max_history_bits", self.bits, RETRIEVAL_HEAD_MAX_BITS), ("retrieval_threshold", 0.0, 1.0)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
                raise ValueError(f"OscarConfig.{name} must be a number in [{lo:g}, {hi:g}], got {val!r}")
            object.__setattr__(self, name, float(val))

    # the old names, read-only and warned (code written before the rename)
    full_precision_heads = property(lambda self: _old_attribute(self, "full_precision_heads"))
    full_precision_bits = property(lambda self: _old_attribute(self, "full_precision_bits"))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "OscarConfig":
        """The named settings of :data:`PRESETS` (``"paper"``: the authors' own), with ``overrides`` on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown OscarConfig preset {name!r}; presets: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **renamed_keywords(overrides, "OscarConfig.from_preset")})

    @classmethod
    def reference(cls, **overrides) -> "OscarConfig":
        """``from_preset("paper")``."""
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
        """``group_size=None`` resolved to ``head_dim``. ``default_group``: nobody chose the group size, so where it
        does not divide ``head_dim`` it becomes :func:`default_group_size`'s (48 at 96); a chosen one stays."""
        if self.group_size is None:
            return self.replace(group_size=int(head_dim))
        if default_group and head_dim % self.group_size:
            return self.replace(group_size=default_group_size(int(head_dim)))
        return self

    def value_group(self, head_dim: int) -> int:
        """The values' group size at ``head_dim``: ``value_group_size``, else the keys' (``group_size``, None: one
        group a head)."""
        return self.value_group_size or self.for_head_dim(head_dim).group_size

    @property
    def values_own_group(self) -> bool:
        """Whether the values are grouped apart from the keys (a ``value_group_size`` other than ``group_size``)."""
        return self.value_group_size not in (None, self.group_size)

    def kernels_serve(self, head_dim: int) -> bool:
        """Whether the Triton kernels can write and read this storage at ``head_dim`` (the contiguous cache's): INT2
        keys at the values' group anywhere; 3-bit keys or a values' group of their own at a power-of-two head_dim
        (the split kernel's dequant loop and the one-token write kernel, docs/kernels.md §3.11), elsewhere the torch
        references."""
        return (self.key_bits == 2 and not self.values_own_group) or head_dim & (head_dim - 1) == 0

    @property
    def torch_meta_dtype(self) -> torch.dtype:
        return META_DTYPES[self.meta_dtype]

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
        for i in self.skip_layers:
            if not -num_layers <= i < num_layers:
                raise ValueError(f"skip_layers entry {i} is out of range for a model with {num_layers} layers")
        return {i % num_layers for i in self.skip_layers}  # (negative entries count from the end)

    def retrieval_head_bits(self, head_dim: int) -> float:
        """Bits per element of a retrieval head (codes + a 16-bit scale and zero per head below 16 bits)."""
        b = self.retrieval_bits
        return float(b) if b == 16 else b + 2 * 16 / head_dim

    def history_bits(self, head_dim: int, retrieval_share: float = 0.0) -> float:
        """Average bits per history element when ``retrieval_share`` of the KV heads are retrieval heads and the rest
        INT2 (2.5 at group 64, BF16; keys and values averaged: 3.0 with 3-bit keys)."""
        c = self.for_head_dim(head_dim)
        for g in (c.group_size, c.value_group(head_dim)):  # (a group that does not divide head_dim prices nothing)
            check_group_size(head_dim, g)
        q = (bits_per_element(head_dim, c.group_size, c.torch_meta_dtype, c.key_bits)
             + bits_per_element(head_dim, c.value_group(head_dim), c.torch_meta_dtype, c.bits)) / 2
        return (1.0 - retrieval_share) * q + retrieval_share * self.retrieval_head_bits(head_dim)

    def retrieval_head_budget(self, head_dim: int, num_heads: int) -> int:
        """How many of ``num_heads`` may be retrieval heads while :meth:`history_bits` <= ``max_history_bits``."""
        q = self.history_bits(head_dim)
        if num_heads <= 0 or self.max_history_bits <= q:
            return 0
        n = math.floor(num_heads * (self.max_history_bits - q) / (self.retrieval_head_bits(head_dim) - q) + 1e-9)
        return min(n, num_heads)

    def stored_bits(self, fingerprint: "ModelFingerprint", quantized_layers: Sequence[int], context: int) -> float:
        """The budget's measure (``calibrate(budget_bits=...)``): average stored bits per cached K/V element over
        ``quantized_layers`` at ``context`` tokens (``retrieval_heads`` resolved); docs/quality.md, "The budget"."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be a positive int of tokens, got {context!r}")
        layers = sorted({int(i) for i in quantized_layers})
        if not layers:
            raise ValueError("stored_bits needs at least one quantized layer")
        fph = self.retrieval_heads
        if fph == "auto":
            raise ValueError("stored_bits needs retrieval_heads resolved to an int or (layer, kv_head) pairs")
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
        """Inverse of :meth:`to_dict`, also after JSON (lists become tuples)."""
        if not isinstance(d, dict):
            raise ValueError(f"OscarConfig.from_dict needs a dict, got {type(d).__name__}")
        d = renamed_keywords(d, "OscarConfig.from_dict", warn=False)  # configs saved before the rename
        if unknown := sorted(set(d) - {f.name for f in dataclasses.fields(cls)}):
            raise ValueError(f"unknown OscarConfig fields {unknown}")
        return cls(**{k: _tuples(v) for k, v in d.items()})

    def replace(self, **kw) -> "OscarConfig":
        return dataclasses.replace(self, **renamed_keywords(kw, "OscarConfig.replace"))

    # the old method names
    full_precision_head_bits = retrieval_head_bits
    full_precision_head_budget = retrieval_head_budget


def _retrieval_heads(want):
    """``retrieval_heads`` checked: "auto", an int >= 0, or (layer, kv_head) pairs (returned sorted, deduplicated)."""
    if isinstance(want, str) and want == "auto":
        return want
    if isinstance(want, (bool, str)) or not isinstance(want, (int, Sequence)):
        raise ValueError(f"retrieval_heads (full_precision_heads before) must be 'auto', an int or (layer, kv_head) "
                         f"pairs, got {want!r}")
    if isinstance(want, int):
        if want < 0:
            raise ValueError(f"retrieval_heads (full_precision_heads before) must be >= 0, got {want}")
        return want
    try:
        pairs = tuple(sorted({(int(a), int(b)) for a, b in want}))
    except (TypeError, ValueError):
        raise ValueError(f"retrieval_heads pairs must be (layer, kv_head) ints, got {want!r}") from None
    if any(a < 0 or b < 0 for a, b in pairs):
        raise ValueError(f"retrieval_heads pairs must be non-negative, got {want!r}")
    return pairs


def _tuples(v):
    """JSON lists (nested too) back to tuples."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


_dataclass_init = OscarConfig.__init__


def _init_with_old_names(self, *args, **kw):  # OscarConfig(full_precision_heads=...): the old keywords, warned
    _dataclass_init(self, *args, **renamed_keywords(kw, "OscarConfig"))


OscarConfig.__init__ = functools.wraps(_dataclass_init)(_init_with_old_names)


def artifact_settings(metadata: dict) -> dict[str, Any] | None:
    """The settings a calibration chose (``metadata["settings"]["chosen"]``) as checked :class:`OscarConfig`
    keywords; None when the artifact has none."""
    entry = (metadata or {}).get("settings")
    if not isinstance(entry, dict) or entry.get("chosen") is None:
        return None
    chosen = entry["chosen"]
    if not isinstance(chosen, dict):
        raise ValueError(f"artifact metadata['settings']['chosen'] must be an object, got {type(chosen).__name__}")
    chosen = renamed_keywords(chosen, "artifact settings", warn=False)  # artifacts written before the rename
    if unknown := sorted(set(chosen) - set(CHOSEN_FIELDS)):
        raise ValueError(f"artifact metadata['settings']['chosen'] has fields no calibration chooses: {unknown} "
                         f"(known: {list(CHOSEN_FIELDS)})")
    out = {k: _tuples(v) for k, v in chosen.items()}
    OscarConfig(**out)  # a corrupted entry fails here, naming the field
    return out


def starting_config(config: "OscarConfig | None", preset: str | None, rotations,
                    overrides: dict) -> tuple["OscarConfig", bool]:
    """The config a cache or serving store starts from: ``config`` or ``preset``, else the artifact's chosen settings,
    else the defaults, with ``overrides`` on top; and whether nobody chose its group size (for :meth:`for_head_dim`)."""
    default_group = config is None and preset is None and "group_size" not in overrides
    if config is None and preset is None:
        chosen = artifact_settings(rotations.metadata) if rotations is not None else None
        config = OscarConfig(**chosen) if chosen else None
        default_group = default_group and config is None
    return OscarConfig.build(config, preset, **overrides), default_group
