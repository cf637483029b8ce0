"""OSCAR kernels (installed as ``oscar_hf.kernels``, never as a top-level ``kernels`` module).

Data flow: ``kv`` (the bundles a storage hands the kernels) -> ``write_path`` (quantize and pack; ``append``, the
one-token write) and ``decode`` (the one read). Each dispatches to Triton kernels on CUDA (or under
``TRITON_INTERPRET=1``) and a torch reference elsewhere; ``plan`` holds the defaults and the split-K policy.
Importing this package does not import Triton.
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
