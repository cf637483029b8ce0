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
from typing import NamedTuple

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


def signed_permutation(hk: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``[Hk, D, D]`` float32 signed permutations: rotations whose products are exact (a kernel and its reference
    then quantize the same values)."""
    perm = torch.stack([torch.randperm(d, generator=gen) for _ in range(hk)]) if hk else torch.zeros(0, d).long()
    sign = torch.randint(0, 2, (hk, d), generator=gen).float() * 2 - 1
    r = torch.zeros(hk, d, d)
    r.scatter_(2, perm[:, :, None], sign[:, :, None])
    return r


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


# ------------------------------------------- the tests' loose arguments as the kernels' bundles (oscar_hf.kernels.kv)
def loose(fn):
    """``fn`` (``decode_triton.decode_attention_triton`` or ``int2_attention.decode_attention_reference``, which take
    ``(params, q, window, history, scaling, out_dtype, *, rotated, ...)``) called with the decode cases' loose
    arguments (``q_rot`` None: the op rotates ``q_win`` by ``r_k`` / ``mu_k``)."""

    def call(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, q_win=None, k_win=None, v_win=None,
             win_mask=None, r_v=None, mu_v=None, out_dtype=None, n_valid=None, splits=None, r_k=None, mu_k=None,
             block_n=1024, **kw):
        from oscar_hf.kernels.kv import History, KVParams, Window

        return fn(KVParams(r_k, mu_k, r_v, mu_v, group_size, block_n=block_n), q_win, Window(k_win, v_win, win_mask),
                  History(k, v, start, key_mask, n_valid, splits), scaling, out_dtype,
                  rotated=None if q_rot is None else (q_rot, qk_offset), **kw)

    return call


def rotating(qf, r_k, mu_k, k, v, start, key_mask, scaling, group_size, k_win, v_win, win_mask, r_v, mu_v,
             out_dtype=None, block_n=1024, n_valid=None, splits=None, use_kernels="auto", softcap=None, sinks=None):
    """:func:`~oscar_hf.kernels.decode.decode` from the unrotated query over a contiguous history (the caches' read)."""
    from oscar_hf.kernels.decode import decode
    from oscar_hf.kernels.kv import History, KVParams, Window

    return decode(KVParams(r_k, mu_k, r_v, mu_v, group_size, block_n=block_n), qf, Window(k_win, v_win, win_mask),
                  History(k, v, start, key_mask, n_valid, splits), scaling, out_dtype, softcap=softcap, sinks=sinks,
                  use_kernels=use_kernels)


def heads_loose(fn):
    """``fn`` (``heads_attention.heads_decode_reference`` / ``heads_decode_attention``, ``heads_triton.
    heads_decode_triton``, which take ``(q, heads, (k, v), bits, (lo, hi), window, scaling, out_dtype, *, pages, ...)``)
    called with the heads cases' loose arguments (``block_table`` / ``max_len``: a paged store, ``hi`` its lengths)."""

    def call(q, heads, k, v, bits, lo, hi, win_k, win_v, win_mask, scaling, out_dtype=None, block_n=None, *,
             block_table=None, max_len=None, **kw):
        from oscar_hf.kernels.kv import Pages, Window

        if block_n is not None:
            kw["block_n"] = block_n
        return fn(q, heads, (k, v), bits, (lo, hi), Window(win_k, win_v, win_mask), scaling, out_dtype,
                  pages=None if block_table is None else Pages(block_table, hi, max_len), **kw)

    return call


def paged_bundles(qf, r_k, mu_k, pages_k, pages_v, block_table, hist_len, win_k, win_v, win_slot, win_mask, r_v, mu_v,
                  group_size, max_hist_len=None, **_):
    """``(params, window, history)`` of a paged read's loose arguments (``win_mask [B, W]``; ``scaling`` and
    ``out_dtype`` ignored here)."""
    from oscar_hf.kernels.kv import History, KVParams, Pages, Window

    return (KVParams(r_k, mu_k, r_v, mu_v, group_size), Window(win_k, win_v, win_mask[:, None, None, :], win_slot),
            History(pages_k, pages_v, pages=Pages(block_table, hist_len, max_hist_len)))


def paged(use_kernels="auto", **case):
    """:func:`~oscar_hf.kernels.decode.decode` over a paged history (the serving store's read), from a case's
    keyword arguments (``max_hist_len``: the host bound)."""
    from oscar_hf.kernels.decode import decode

    params, window, history = paged_bundles(**case)
    return decode(params, case["qf"], window, history, case["scaling"], case["out_dtype"], use_kernels=use_kernels)


def paged_reference(**case):
    """The paged read's torch reference (``paged_decode.paged_decode_batched``), as :func:`paged` dispatches to it."""
    return paged(use_kernels=False, **case)


def paged_triton(defaults=None, **case):
    """The launcher over a paged history, as :func:`~oscar_hf.kernels.decode.decode` calls it on CUDA, with the
    given launch ``defaults``."""
    import dataclasses

    from oscar_hf.kernels import decode_triton
    from oscar_hf.kernels.plan import DEFAULTS

    params, window, history = paged_bundles(**case)
    if history.pages.max_len is None:
        history = dataclasses.replace(history, pages=dataclasses.replace(history.pages,
                                                                         max_len=int(case["hist_len"].max())))
    return decode_triton.decode_attention_triton(params, case["qf"], window, history, case["scaling"],
                                                 case["out_dtype"], defaults=defaults or DEFAULTS)


class CodedSlots(NamedTuple):
    """The retrieval heads' loose write arguments: ``k``/``v`` parts ``[B, P, N, *]`` (``encode_heads``: ``(x,)`` at
    16 bits, ``(codes, scale, zero)`` at 8 / 4), ``coded_of [Hk]`` int64 (-1: an INT2 head), ``bits``."""

    k: tuple
    v: tuple
    coded_of: torch.Tensor
    bits: int


def write_bundles(hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, quantizer, coded):
    """``(params, coded rows)`` of a one-token write's loose arguments (``coded`` a :class:`CodedSlots`)."""
    from oscar_hf.kernels.kv import HeadSplit, KVParams

    heads = None if coded is None else HeadSplit(None, None, coded.coded_of, coded.bits)
    return (KVParams(r_k, mu_k, r_v, mu_v, group_size, clip_k, clip_v, meta_dtype, quantizer, hist_of=hist_heads,
                     heads=heads), None if coded is None else (coded.k, coded.v))


def ring_write(fn):
    """``fn`` (a contiguous write taking :mod:`oscar_hf.kernels.kv`'s bundles: ``write_path.append_token_reference``,
    ``append_triton.append_token_triton``, or ``write_path.append`` with ``use_kernels``) called with the tests' loose
    arguments."""

    def call(new_k, new_v, win_k, win_v, hist_k, hist_v, length, pad, hist_heads, r_k, mu_k, clip_k, r_v, mu_v,
             clip_v, group_size, meta_dtype, sink, recent, quantizer="minmax", coded=None, **kw):
        from oscar_hf.kernels.kv import History, Ring, Window

        params, rows = write_bundles(hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype,
                                     quantizer, coded)
        return fn(params, new_k, new_v, Window(win_k, win_v), History(hist_k, hist_v, coded=rows),
                  Ring(length, pad, sink, recent), **kw)

    return call


def paged_write(fn):
    """``fn`` (a paged write taking the bundles: ``write_path.paged_append_reference``,
    ``append_triton.paged_append_triton``, or ``write_path.append``) called with the tests' loose arguments
    (``rows`` a ``kv.PagedRows``)."""

    def call(new_k, new_v, win_k, win_v, hist_k, hist_v, rows, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v,
             group_size, meta_dtype, demote=True, write_sink=True, quantizer="minmax", coded=None, **kw):
        import dataclasses

        from oscar_hf.kernels.kv import History, Window

        params, coded_rows = write_bundles(hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype,
                                           quantizer, coded)
        return fn(params, new_k, new_v, Window(win_k, win_v), History(hist_k, hist_v, coded=coded_rows),
                  dataclasses.replace(rows, demote=demote, write_sink=write_sink), **kw)

    return call


def append_token(*args, **kwargs):
    """:func:`~oscar_hf.kernels.write_path.append` at a contiguous storage's ring, from loose arguments."""
    from oscar_hf.kernels.write_path import append

    return ring_write(append)(*args, **kwargs)


def paged_append(*args, **kwargs):
    """:func:`~oscar_hf.kernels.write_path.append` at the serving step's rows, from loose arguments."""
    from oscar_hf.kernels.write_path import append

    return paged_write(append)(*args, **kwargs)
