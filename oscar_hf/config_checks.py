"""The checks of an :class:`~oscar_hf.config.OscarConfig` (:func:`check_config`) and its renamed fields."""
from __future__ import annotations

import warnings
from collections.abc import Sequence

from .quant import QUANTIZERS

# old name -> today's. Keywords warn (FutureWarning); saved configs and artifacts load either name.
RENAMED_FIELDS = {"full_precision_heads": "retrieval_heads", "full_precision_bits": "retrieval_bits"}


def renamed_keywords(kw: dict, where: str, warn: bool = True, stacklevel: int = 3) -> dict:
    """``kw`` with old field names renamed (a FutureWarning each when ``warn``); a TypeError when both are given."""
    if not any(old in kw for old in RENAMED_FIELDS):
        return kw
    kw = dict(kw)
    for old, new in RENAMED_FIELDS.items():
        if old in kw:
            if new in kw:
                raise TypeError(f"{where}: pass {new}= only ({old}= is its old name), not both")
            if warn:
                warnings.warn(f"{where}: {old}= is now {new}= (the retrieval heads); the old name will be removed",
                              FutureWarning, stacklevel=stacklevel)
            kw[new] = kw.pop(old)
    return kw


def check_config(c, meta_dtypes, bit_choices, max_head_bits) -> None:
    """Raise ValueError naming the field of ``c`` that is out of range; normalize sequences to tuples in place."""
    for name in ("sink", "recent"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 0:
            raise ValueError(f"OscarConfig.{name} must be a non-negative int, got {getattr(c, name)!r}")
    if c.recent < 1:
        raise ValueError("OscarConfig.recent must be >= 1 (the current token's predecessor stays in full precision)")
    g = c.group_size
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise ValueError(f"OscarConfig.group_size must be a positive int or None (= head_dim), got {g!r}")
    if c.bits != 2:
        raise NotImplementedError(f"only bits=2 is implemented, got bits={c.bits}")
    if c.meta_dtype not in meta_dtypes:
        raise ValueError(f"meta_dtype must be one of {sorted(meta_dtypes)}, got {c.meta_dtype!r}")
    if c.block_size < 1 or c.prefill_chunk < 1:
        raise ValueError("block_size and prefill_chunk must be positive")
    if c.quantizer not in QUANTIZERS:
        raise ValueError(f"OscarConfig.quantizer must be one of {QUANTIZERS}, got {c.quantizer!r}")
    if c.key_offset not in ("calibrated", "prefill"):
        raise ValueError(f"key_offset must be 'calibrated' or 'prefill', got {c.key_offset!r}")
    if c.use_kernels not in ("auto", True, False):
        raise ValueError(f"use_kernels must be 'auto', True or False, got {c.use_kernels!r}")
    for name in ("clip_k", "clip_v"):
        val = getattr(c, name)
        if isinstance(val, Sequence) and not isinstance(val, str):
            object.__setattr__(c, name, tuple(float(v) for v in val))
            vals = getattr(c, name)
        elif val is None:
            vals = ()
        else:
            vals = (float(val),)
        if any(not (0.0 < v <= 1.0) for v in vals):
            raise ValueError(f"OscarConfig.{name} ratios must lie in (0, 1], got {val!r}")
    object.__setattr__(c, "skip_layers", tuple(int(i) for i in c.skip_layers))
    object.__setattr__(c, "retrieval_heads", _retrieval_heads(c.retrieval_heads))
    if c.retrieval_bits not in bit_choices or isinstance(c.retrieval_bits, bool):
        raise ValueError(f"OscarConfig.retrieval_bits (full_precision_bits before) must be one of {bit_choices}, got "
                         f"{c.retrieval_bits!r}")
    for name, lo, hi in (("max_history_bits", c.bits, max_head_bits), ("retrieval_threshold", 0.0, 1.0)):
        val = getattr(c, name)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
            raise ValueError(f"OscarConfig.{name} must be a number in [{lo:g}, {hi:g}], got {val!r}")
        object.__setattr__(c, name, float(val))


def _retrieval_heads(want):
    """``retrieval_heads`` checked: "auto", an int >= 0, or (layer, kv_head) pairs (returned sorted, deduplicated)."""
    bad = f"retrieval_heads (full_precision_heads before) must be 'auto', an int or (layer, kv_head) pairs, got {want!r}"
    if isinstance(want, str):
        if want != "auto":
            raise ValueError(bad)
        return want
    if isinstance(want, bool) or not isinstance(want, (int, Sequence)):
        raise ValueError(bad)
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
