"""Shared helpers of the kernel tests (imported by file name: tests/kernels has no __init__.py).

Where the kernels run: on a machine without CUDA the Triton kernels run under the Triton
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by :func:`setup_interpreter` before any
kernel module is imported: ``@triton.jit`` reads it when a kernel is defined). On a CUDA machine
the variable is left alone and the ``gpu``-marked tests run the compiled kernels.

``@triton.jit`` turns a function into an interpreted one only if ``TRITON_INTERPRET=1`` was set
when it was decorated. ``tests/conftest.py`` imports Transformers, which imports torch._dynamo and
with it triton (its standard library ``tl.zeros``, ``tl.sum``... is then compiled-mode); so when
the variable is set late, :func:`setup_interpreter` re-wraps those already-defined functions for
the interpreter and reloads kernel modules imported in compiled mode. Setting the variable before
anything imports triton (e.g. ``TRITON_INTERPRET=1 pytest``) makes that a no-op.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()


def setup_interpreter() -> bool:
    """Turn on the Triton interpreter when there is no GPU; True when kernels run interpreted."""
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted and "triton" in sys.modules:
        _reinterpret_loaded_triton()
    return interpreted


def _reinterpret_loaded_triton() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("triton.language"):
            continue
        for attr, obj in list(vars(mod).items()):
            if type(obj) is JITFunction:
                setattr(mod, attr, InterpretedFunction(obj.fn))
    for name in ("oscar_hf.kernels.write_triton", "oscar_hf.kernels.decode_triton", "oscar_hf.kernels.query_triton"):
        mod = sys.modules.get(name)
        if mod is not None and any(type(v) is JITFunction for v in vars(mod).values()):
            importlib.reload(mod)


def random_rotation(hk: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``[Hk, D, D]`` float32 orthogonal matrices."""
    a = torch.randn(hk, d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_int2_rows_close(got, ref, meta_dtype) -> None:
    """Two INT2 histories (``QuantizedRows``) written by a kernel and its reference: metadata within an ulp of the
    stored dtype (+1e-3 of the range), codes equal but for rounding ties (a matvec summed in another order lands a
    value on the other side of a half-step: at most one level, on under 0.5% of the codes)."""
    from oscar_hf.quant import unpack_int2

    for a, b in ((got.scale, ref.scale), (got.zero, ref.zero)):
        a, b = a.double(), b.double()
        tol = 1e-3 * b.abs().amax().clamp_min(1e-6) + torch.finfo(meta_dtype).eps * b.abs()
        assert ((a - b).abs() <= tol).all(), f"metadata differs by {(a - b).abs().max():.3g}"
    cg, cr = unpack_int2(got.codes).int(), unpack_int2(ref.codes).int()
    diff = (cg - cr).abs()
    assert diff.max() <= 1 and (diff > 0).double().mean() < 5e-3, f"{int((diff > 0).sum())} codes differ"
