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


# ---- host-side helpers of the kernels' per-call launch code. Plain Python on purpose: triton.cdiv and
# triton.next_power_of_2 are constexpr functions (each call goes through Triton's constexpr wrapper, ~1-2 us), and the
# decode op called ~35 of them a call (session 20, benchmarks/results/host_profile_h200_session20j.txt)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of non-negative ints (``b > 0``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device (cached: ``get_device_capability`` costs ~10 us a call)."""
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())

