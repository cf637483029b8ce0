"""Cases and checks shared by the decode read path's tests (``test_int2_attention.py`` under the interpreter,
``test_decode_gpu.py`` on a GPU): random INT2 histories, windows and rotations, an independent float64 attention,
and the comparison of online-softmax partials. Imported by file name (tests/kernels has no ``__init__.py``), after
``kernel_utils.setup_interpreter``."""
from __future__ import annotations

import math

import torch
from kernel_utils import loose, random_rotation, rel_err

from oscar_hf.kernels.int2_attention import decode_attention_reference, rotate_query_reference
from oscar_hf.quant import QuantizedRows, dequantize_rows, quantize_rows


def _dt():
    from oscar_hf.kernels import decode_triton

    return decode_triton


def make_case(b, hk, m, n, d, g, *, meta=torch.bfloat16, seed=0, device="cpu", mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk, m, d, generator=gen) * mag
    k = quantize_rows(torch.randn(b, hk, n, d, generator=gen).to(device) * 2.0, g, 0.96, meta)
    v = quantize_rows(torch.randn(b, hk, n, d, generator=gen).to(device), g, 0.92, meta)
    return q.to(device), k, v, gen


def plain_attention(q_rot, k, v, start, key_mask, qk_offset, scaling, g):
    """Independent float64 computation: dequantize the whole history, mask, softmax, weighted sum.
    Returns (normalized output, log-sum-exp), with NaN/-inf rows for rows without valid keys."""
    kh = dequantize_rows(QuantizedRows(*(t.cpu() for t in k)), g, torch.float64)
    vh = dequantize_rows(QuantizedRows(*(t.cpu() for t in v)), g, torch.float64)
    logits = torch.einsum("bhmd,bhnd->bhmn", q_rot.double().cpu(), kh)
    if qk_offset is not None:
        logits = logits + qk_offset.double().cpu()[..., None]
    logits = logits * scaling
    n = kh.shape[-2]
    valid = torch.arange(n)[None, :] >= start.cpu()[:, None]  # [B, N]
    valid = valid[:, None, None, :].expand_as(logits)
    if key_mask is not None:
        valid = valid & key_mask.cpu()
    logits = logits.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("bhmn,bhnd->bhmd", torch.softmax(logits, -1), vh)
    return out, lse


def normalized(part):
    m, l, acc = (t.double().cpu() for t in part)
    return acc / l.unsqueeze(-1), m + torch.log(l)


def assert_partials_close(got, ref, tol):
    """m, l, acc individually (the contract) and the normalized output / log-sum-exp (on the CPU:
    the masks below index CPU copies, so GPU partials are moved first)."""
    (gm, gl, ga), (rm, rl, ra) = (tuple(t.cpu() for t in got), tuple(t.cpu() for t in ref))
    assert gm.shape == rm.shape and gl.shape == rl.shape and ga.shape == ra.shape
    assert gm.dtype == gl.dtype == ga.dtype == torch.float32
    empty = torch.isinf(rm)
    assert torch.equal(torch.isinf(gm), empty), "rows without valid keys must have m = -inf"
    assert (gl[empty] == 0).all() and (ga[empty] == 0).all()
    assert torch.isfinite(ga).all() and torch.isfinite(gl).all()
    full = ~empty
    assert (gm[full] - rm[full]).abs().max().item() <= tol * max(1.0, rm[full].abs().max().item())
    go, gl_ = normalized(got)
    ro, rl_ = normalized(ref)
    assert rel_err(go[full], ro[full]) <= tol
    assert (gl_[full] - rl_[full]).abs().max().item() <= tol * max(1.0, rl_[full].abs().max().item())
    # l and acc themselves are relative to m: compare after moving both to the reference's m
    shift = torch.exp(gm[full].double() - rm[full].double())
    assert rel_err(gl[full].double() * shift, rl[full]) <= tol
    assert rel_err(ga[full].double() * shift.unsqueeze(-1), ra[full]) <= tol


def _window_case(b, hk, m, n, w, d, g, seed, device="cpu", mu=True, wmask=True, out_dtype=torch.float32):
    q, k, v, gen = make_case(b, hk, m, n, d, g, seed=seed, device=device)
    q = q.cpu()
    r_k, r_v = random_rotation(hk, d, gen), random_rotation(hk, d, gen)
    q_rot = torch.matmul(q, r_k.unsqueeze(0))
    mu_v = torch.randn(hk, d, generator=gen) * 0.3 if mu else None
    k_win = (torch.randn(b, hk, w, d, generator=gen) * 2).to(torch.bfloat16) if w else None
    v_win = torch.randn(b, hk, w, d, generator=gen).to(torch.bfloat16) if w else None
    win_mask = (torch.rand(b, 1, 1, w, generator=gen) > 0.2) if (w and wmask) else None
    qk_offset = torch.randn(b, hk, m, generator=gen)
    mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    args = dict(
        q_rot=mv(q_rot), k=QuantizedRows(*map(mv, k)), v=QuantizedRows(*map(mv, v)), start=mv(torch.zeros(b, dtype=torch.long)),
        key_mask=None, qk_offset=mv(qk_offset), scaling=d**-0.5, group_size=g,
        q_win=mv(q.to(torch.bfloat16)), k_win=mv(k_win), v_win=mv(v_win), win_mask=mv(win_mask),
        r_v=mv(r_v), mu_v=mv(mu_v), out_dtype=out_dtype,
    )
    return args, gen


def _rotating_case(b, hk, m, n, w, d, g, seed, device="cpu", out_dtype=torch.float32):
    """A decode case for the rotating entry: the unrotated query (also the window's), R_K and a per-KV-head mu_K."""
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=seed, device=device, out_dtype=out_dtype)
    qf = args.pop("q_win").float()
    for k_ in ("q_rot", "qk_offset"):
        args.pop(k_)
    r_k = random_rotation(hk, d, gen).to(device)
    mu_k = (torch.randn(hk, d, generator=gen) * 0.5).to(device)
    return {"qf": qf, "r_k": r_k, "mu_k": mu_k, **args}


def cut_history(args, n):
    """``args`` with the history's ``k`` / ``v`` cut to their first ``n`` entries (what a device-side length reads)."""
    return {k_: type(v_)(*(t[:, :, :n] for t in v_)) if k_ in ("k", "v") else v_ for k_, v_ in args.items()}


def rotating_op(args, **kw):
    """The launcher from the unrotated query, as ``kernels.decode.decode`` calls it on CUDA: ``args`` of
    :func:`_rotating_case`, ``q_rot`` None (the op rotates ``qf``, also the window's query, itself)."""
    rest = {k_: v_ for k_, v_ in args.items() if k_ != "qf"}
    return loose(_dt().decode_attention_triton)(q_rot=None, qk_offset=None, q_win=args["qf"], **rest, **kw)


def _rotating_reference(args, **kw):
    q_rot, qk_off = rotate_query_reference(args["qf"], args["r_k"], args["mu_k"])
    rest = {k_: v_ for k_, v_ in args.items() if k_ not in ("qf", "r_k", "mu_k")}
    return loose(decode_attention_reference)(q_rot=q_rot, qk_offset=qk_off, q_win=args["qf"], **rest, **kw)
