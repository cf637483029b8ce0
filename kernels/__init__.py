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


# ---- PTX of the counters between the decode op's launches (CONFIG["gluon_qflag"], CONFIG["gluon_cflag"] of
# decode_triton), shared by its Triton and Gluon kernels (each wraps them in its own constexpr)

# Wait until the 32-bit counter at $1 reaches $2 (acquire, GPU scope): poll with a short sleep, trap after ~2^22 polls
# (seconds) rather than hang; $0 is 0, an opaque offset for the loads that must follow the wait
SPIN_PTX = ("{ .reg .pred p; .reg .u32 v, n; mov.u32 n, 0; "
            "SPIN${:uid}: ld.acquire.gpu.global.u32 v, [$1]; setp.ge.u32 p, v, $2; @p bra DONE${:uid}; "
            "add.u32 n, n, 1; setp.gt.u32 p, n, 4194304; @p trap; nanosleep.u32 32; bra SPIN${:uid}; "
            "DONE${:uid}: mov.u32 $0, 0; }")
# The program's end, counted in the 32-bit counter at $1: the PDL wait (the grid before this one complete and its
# writes visible), a barrier (every thread's stores before it), then one release add by thread 0 ($0 is a dummy)
DONE_PTX = ("{ .reg .pred p; .reg .u32 t; griddepcontrol.wait; bar.sync 0; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p red.release.gpu.global.add.u32 [$1], 1; mov.u32 $0, 0; }")


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device (cached: ``get_device_capability`` costs ~10 us a call)."""
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())

