"""OSCAR kernels (installed as ``oscar_hf.kernels``, never as a top-level ``kernels`` module): the bundles (``kv``),
the one write (``write_path``) and the one read (``decode``), each a Triton kernel on CUDA beside its torch reference.
Files and data flow: docs/kernels.md §2-§3. Importing this package does not import Triton.
"""
from __future__ import annotations

from .decode import decode
from .int2_attention import (decode_attention_reference, history_partial, history_partial_reference, rotate_query,
                             rotate_query_reference)
from .kv import History, KVParams, Pages, PagedRows, Ring, Window
from .plan import DEFAULTS, DecodeDefaults, cdiv, cuda_major, next_pow2, num_splits, triton_enabled, triton_importable
from .write_path import rotate_quantize, rotate_quantize_reference

__all__ = ["DEFAULTS", "DecodeDefaults", "History", "KVParams", "PagedRows", "Pages", "Ring", "Window", "cdiv",
    "cuda_major", "decode", "decode_attention_reference", "history_partial", "history_partial_reference", "next_pow2",
    "num_splits", "rotate_query", "rotate_query_reference", "rotate_quantize", "rotate_quantize_reference",
    "triton_enabled", "triton_importable"]
