"""OSCAR kernels (installed as ``oscar_hf.kernels``, never as a top-level ``kernels`` module).

Data flow: ``write_path`` (rotate + center + clip + quantize + pack, used at prefill and when a recent token is
demoted) and ``int2_attention`` (split-K decode attention over packed INT2 history + log-sum-exp merge). Each is a
dispatcher with its plain-torch reference beside it; the Triton kernels (``write_triton``, ``query_triton``,
``decode_triton`` with ``decode_split`` / ``decode_combine`` / ``decode_gluon``) run on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` in the tests. ``plan`` holds the named defaults and the split-K policy. Importing this package
does not import Triton.
"""
from __future__ import annotations

from .int2_attention import (decode_attention_reference, decode_attention_rotating, history_partial,
                             history_partial_reference, rotate_query, rotate_query_reference)
from .plan import DEFAULTS, DecodeDefaults, cdiv, cuda_major, next_pow2, num_splits, triton_enabled, triton_importable
from .write_path import rotate_quantize, rotate_quantize_reference

__all__ = [
    "DEFAULTS", "DecodeDefaults", "cdiv", "cuda_major", "decode_attention_reference",
    "decode_attention_rotating", "history_partial", "history_partial_reference", "next_pow2", "num_splits",
    "rotate_query", "rotate_query_reference", "rotate_quantize", "rotate_quantize_reference", "triton_enabled",
    "triton_importable",
]
