"""OSCAR kernels (installed as ``oscar_hf.kernels``, never as a top-level ``kernels`` module).

Data flow: ``write_path`` (rotate + center + clip + quantize + pack, used at prefill and when a
recent token is demoted) and ``int2_attention`` (split-K decode attention over packed INT2
history + log-sum-exp merge). Each file holds the plain-torch reference beside the dispatch to
its Triton kernel (``*_triton.py``), which runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``
in the tests.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_enabled(t: torch.Tensor, use_kernels="auto") -> bool:
    """Whether the Triton path serves tensor ``t``: CUDA (or the interpreter when forced) and triton present."""
    if use_kernels is False:
        return False
    ok = triton_importable() and (t.is_cuda or (use_kernels is True and os.environ.get("TRITON_INTERPRET") == "1"))
    if use_kernels is True and not ok:
        raise RuntimeError(
            "use_kernels=True but the Triton kernels cannot run here "
            f"(triton importable: {triton_importable()}, device: {t.device}); install `triton` and use a CUDA device, "
            "or set use_kernels='auto'."
        )
    return ok
