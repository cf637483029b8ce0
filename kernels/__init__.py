"""OSCAR kernels (installed as ``oscar_hf.kernels``, never as a top-level ``kernels`` module).

Data flow: ``kv`` (the bundles a storage hands the kernels: window, history, parameters), ``write_path``
(rotate + center + clip + quantize + pack, used at prefill and when a recent token is demoted: ``append``, the one
one-token write) and ``decode`` (the one read: split-K decode attention over packed INT2 history + log-sum-exp merge,
references in ``int2_attention`` / ``paged_decode``). Each is a dispatcher with its plain-torch reference beside it;
the Triton kernels (``write_triton``, ``query_triton``, ``decode_triton`` with ``decode_split`` / ``decode_combine`` / ``decode_gluon``) run on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` in the tests. ``plan`` holds the named defaults and the split-K policy. Importing this package
does not import Triton.
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
