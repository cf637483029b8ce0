"""Split-K INT2 decode attention: the torch reference against plain softmax attention, and the
Triton kernels (``history_partial_triton``, ``decode_attention_triton``) against the references.

CPU: kernels run under the Triton interpreter (float32 dot operands there, so tolerances are
tight); GPU (``-m gpu``): compiled kernels (bf16 dot operands) at real shapes.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from kernel_utils import HAS_CUDA, random_rotation, rel_err, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels.int2_attention import (  # noqa: E402
    decode_attention_reference,
    history_partial,
    history_partial_reference,
    merge_partials,
    rotate_query_reference,
)
from oscar_hf.quant import QuantizedRows, dequantize_rows, quantize_rows  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")
on_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")


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


# ------------------------------------------------------------------------------ the reference itself


@pytest.mark.parametrize("block_n", [7, 64, 1024])
def test_reference_equals_plain_softmax(block_n):
    b, hk, m, n, d, g = 3, 2, 3, 50, 64, 32
    q, k, v, gen = make_case(b, hk, m, n, d, g, seed=block_n)
    start = torch.tensor([0, 13, n])  # row 2 has no valid history
    key_mask = torch.rand(b, 1, m, n, generator=gen) > 0.3  # per-query mask: the reference handles any
    off = torch.randn(b, hk, m, generator=gen)
    part = history_partial_reference(q, k, v, start, key_mask, off, 0.125, g, block_n)
    out, lse = normalized(part)
    ref_out, ref_lse = plain_attention(q, k, v, start, key_mask, off, 0.125, g)
    full = torch.isfinite(ref_lse)
    assert (~full[2]).all() and full[:2].all()
    assert rel_err(out[full], ref_out[full]) < 1e-5
    assert (lse[full] - ref_lse[full]).abs().max() < 1e-4
    m_, l_, acc = part
    assert torch.isinf(m_[2]).all() and (l_[2] == 0).all() and (acc[2] == 0).all()


def test_merge_partials_is_order_free_and_handles_empty():
    q, k, v, _ = make_case(2, 1, 2, 40, 64, 64, seed=1)
    start = torch.tensor([0, 5])
    whole = history_partial_reference(q, k, v, start, None, None, 0.2, 64, 1024)

    def sl(a, b):
        return QuantizedRows(*(t[:, :, a:b] for t in k)), QuantizedRows(*(t[:, :, a:b] for t in v))

    k1, v1 = sl(0, 17)
    k2, v2 = sl(17, 40)
    p1 = history_partial_reference(q, k1, v1, start, None, None, 0.2, 64, 1024)
    p2 = history_partial_reference(q, k2, v2, (start - 17).clamp_min(0), None, None, 0.2, 64, 1024)
    empty = history_partial_reference(q, k2, v2, torch.tensor([40, 40]), None, None, 0.2, 64, 1024)
    for parts in ([p1, p2], [p2, empty, p1]):
        assert_partials_close(merge_partials(parts), whole, 1e-6)


# ------------------------------------------------------------------- Triton vs reference (interpreter)

# 64-token blocks (the shapes below sit on their boundaries) and min_split lowered so that small N
# gets several splits on the CPU; every inner-loop variant ("deferred", the default, "rowdot", "factored",
# "dequant").
# programs_per_sm: the older split rule, which on the CPU's 4 nominal SMs gives more splits than the wave model
SMALL_SPLITS = {"min_split": 64, "block_n": 64, "programs_per_sm": 4}


def _loop_config(name: str) -> dict:
    """CONFIG overrides of a loop variant name: ``<loop>[-ahead][-pair][-asm]`` (metadata one block ahead; both
    groups' bf16 scale/zero as one 4-byte word; code extraction in inline PTX, GPU only)."""
    loop = name.split("-")[0]
    if loop == "gluon":  # the Gluon history kernel (kernels/decode_gluon.py, GPU only); -gsum / -negmma: its two ways of
        # removing the value codes' offset (default: CONFIG's)
        variant = {"-gsum": {"gluon_gsum": 1}, "-negmma": {"gluon_gsum": 0}}.get(name[len(loop):], {})
        return {"gluon": 1, "gluon_min_work": 0, **variant}
    return {"loop": loop, "meta_ahead": "-ahead" in name, "pair_meta": "-pair" in name, "asm_codes": int("-asm" in name),
            "gluon": 0}


@pytest.fixture(params=["rowdot", "deferred", "deferred-pair", "deferred-ahead", "deferred-ahead-pair", "factored",
                        "dequant"])
def small_splits(request, monkeypatch):
    dt = _dt()
    monkeypatch.setattr(dt, "CONFIG", {**dt.CONFIG, **SMALL_SPLITS, **_loop_config(request.param)})
    return dt


@interp
@pytest.mark.parametrize(
    "b,hk,group,q_len,n,d,g,meta,starts,mask,off",
    [
        (1, 2, 1, 1, 63, 64, 32, torch.bfloat16, (0,), None, False),  # N = BLOCK_N - 1, MHA
        (2, 1, 3, 1, 64, 64, 64, torch.float16, (0, 10), "b", True),  # N = BLOCK_N, GQA 3
        (1, 2, 4, 1, 65, 128, 32, torch.bfloat16, (0,), None, True),  # N = BLOCK_N + 1, GQA 4
        (3, 1, 8, 1, 203, 128, 64, torch.bfloat16, (0, 70, 203), "bh", True),  # odd N, splits, empty row
        (2, 2, 4, 2, 130, 128, 128, torch.float16, (64, 1), "b", False),  # q_len 2 -> M 8, G = D
        (1, 1, 8, 4, 77, 64, 32, torch.bfloat16, (5,), None, True),  # M = 32 (8 warps)
        (1, 1, 2, 1, 70, 256, 32, torch.bfloat16, (3,), None, True),  # D 256, G < D/4 (gather path)
    ],
)
def test_history_partial_kernel(small_splits, b, hk, group, q_len, n, d, g, meta, starts, mask, off):
    m = group * q_len
    q, k, v, gen = make_case(b, hk, m, n, d, g, meta=meta, seed=n + m)
    start = torch.tensor(starts)
    key_mask = None
    if mask == "b":
        key_mask = torch.rand(b, 1, 1, n, generator=gen) > 0.25
    elif mask == "bh":
        key_mask = torch.rand(b, hk, 1, n, generator=gen) > 0.25
    qk_offset = torch.randn(b, hk, m, generator=gen) * 3 if off else None
    scaling = d**-0.5
    got = small_splits.history_partial_triton(q, k, v, start, key_mask, qk_offset, scaling, g)
    ref = history_partial_reference(q, k, v, start, key_mask, qk_offset, scaling, g, 64)
    assert_partials_close(got, ref, 5e-5)
    # and through the public dispatcher
    got2 = history_partial(q, k, v, start, key_mask, qk_offset, scaling, g, use_kernels=True)
    assert_partials_close(got2, ref, 5e-5)


@interp
@pytest.mark.parametrize("n", [127, 128, 257])
def test_history_partial_default_config(n):
    """The shipped CONFIG (128-token blocks) around its block boundaries."""
    dt = _dt()
    q, k, v, gen = make_case(2, 1, 4, n, 128, 64, seed=n)
    start = torch.tensor([0, 3])
    off = torch.randn(2, 1, 4, generator=gen)
    got = dt.history_partial_triton(q, k, v, start, None, off, 0.1, 64)
    assert_partials_close(got, history_partial_reference(q, k, v, start, None, off, 0.1, 64, 128), 2e-5)


@interp
@pytest.mark.parametrize("loop", ["deferred", "deferred-ahead", "rowdot"])
@pytest.mark.parametrize("case", ["spike", "underflow"])
def test_deferred_loop_reference_guard(monkeypatch, case, loop):
    """The deferred loop exponentiates against the max of a split's first block: a later logit far
    above it (spike: ~700 log2 units, exp2 would overflow) or every logit far below the fallback
    reference 0 (underflow: first block masked out, logits ~ -3600 log2 units) must trigger its rerun
    with the split's true max, not inf / NaN / all-zero partials. (rowdot, with its running max, as a
    control; at logits of this size float32 itself leaves ~1e-4 relative error, in both loops.)"""
    dt = _dt()
    monkeypatch.setattr(dt, "CONFIG", {**dt.CONFIG, **SMALL_SPLITS, "min_split": 192, **_loop_config(loop)})
    b, hk, m, n, d, g = 1, 1, 4, 192, 64, 32
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, hk, m, d, generator=gen)
    kf = torch.randn(b, hk, n, d, generator=gen)
    key_mask, off = None, None
    if case == "spike":
        kf[0, 0, 150] = 60.0 * q[0, 0].mean(0).sign()  # one key in the last block aligned with the queries
    else:
        key_mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        key_mask[..., :64] = False  # the split's first block holds no valid token
        off = torch.full((b, hk, m), -20000.0)
    k = quantize_rows(kf, g, 1.0, torch.bfloat16)
    v = quantize_rows(torch.randn(b, hk, n, d, generator=gen), g, 1.0, torch.bfloat16)
    start = torch.zeros(b, dtype=torch.long)
    ref = history_partial_reference(q, k, v, start, key_mask, off, d**-0.5, g, 64)
    if case == "spike":
        assert ref[0].max().item() / math.log(2) > 64 + 10  # the spike really exceeds the first block's max
    got = dt.history_partial_triton(q, k, v, start, key_mask, off, d**-0.5, g)
    assert_partials_close(got, ref, 5e-4)


@interp
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_history_partial_kernel_ignores_stale_storage(small_splits):
    """Padding positions (< start) and masked tokens may hold garbage (NaN metadata): never read for V."""
    b, hk, m, n, d, g = 2, 1, 4, 150, 64, 32
    q, k, v, gen = make_case(b, hk, m, n, d, g, seed=11)
    start = torch.tensor([0, 100])
    key_mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    key_mask[0, 0, 0, 30:40] = False
    ref = history_partial_reference(q, k, v, start, key_mask, None, 0.1, g, 64)
    for t in (k.scale, k.zero, v.scale, v.zero):
        t[1, :, :100] = float("nan")
        t[0, :, 30:40] = float("inf")
    got = small_splits.history_partial_triton(q, k, v, start, key_mask, None, 0.1, g)
    assert_partials_close(got, ref, 2e-5)


@interp
def test_history_partial_falls_back_for_per_query_masks_and_large_m():
    dt = _dt()
    q, k, v, gen = make_case(1, 1, 4, 40, 64, 32, seed=2)
    start = torch.tensor([0])
    key_mask = torch.rand(1, 1, 4, 40, generator=gen) > 0.5  # depends on the query row
    ref = history_partial_reference(q, k, v, start, key_mask, None, 0.1, 32, 1024)
    got = dt.history_partial_triton(q, k, v, start, key_mask, None, 0.1, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not dt.kernel_supported(torch.zeros(1, 1, 65, 64), k, 32, None)
    assert not dt.kernel_supported(torch.zeros(1, 1, 4, 64), k, 32, torch.zeros(1, 1, 1, 40))  # float mask


@interp
def test_num_splits_wave_model(monkeypatch):
    """The wave model fills the GPU's resident program slots in whole waves: on 132 SMs x 2 programs, B=1 (8 KV
    heads) takes 33 splits (one wave), B=8 4, B=32 1, where the older rule (programs_per_sm 4: 66, 9, 3 splits)
    ran a last wave mostly empty; and its waves x blocks per split is never worse than that rule's."""
    dt = _dt()
    monkeypatch.setattr(dt, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)  # only read for its type: no GPU needed
    cfg = {**dt.CONFIG, "programs_per_sm": None, "resident_programs": 2, "max_waves": 4, "min_split": 256, "block_n": 64}
    old = {**cfg, "programs_per_sm": 4}
    assert [dt.num_splits(131072, bh, dev, cfg) for bh in (8, 64, 256)] == [33, 4, 1]
    assert [dt.num_splits(131072, bh, dev, old) for bh in (8, 64, 256)] == [66, 9, 3]

    def cost(n, bh, s, half=0.0):
        return math.ceil(bh * s / 264) * (math.ceil(n / (s * 64)) + half)

    for n in (300, 1000, 8192, 32768, 100_000, 131072):
        for bh in (1, 3, 8, 24, 64, 256, 1024, 4096):
            s = dt.num_splits(n, bh, dev, cfg)
            assert 1 <= s <= max(1, math.ceil(n / 256))
            assert cost(n, bh, s) <= cost(n, bh, dt.num_splits(n, bh, dev, old))
            # num_splits tries one candidate per wave count: it must equal the exhaustive minimum (smallest S on ties)
            s_max = max(1, min(math.ceil(n / 256), 4 * 264 // bh))
            assert s == min(range(1, s_max + 1), key=lambda x: (cost(n, bh, x, 0.5), x))


def test_num_splits_and_empty_history():
    dt = _dt()
    dev = torch.device("cpu")
    assert dt.num_splits(128 * 1024, 1, dev) >= 2  # one (batch, head): split the sequence
    assert dt.num_splits(100, 8, dev) == 1
    q, k, v, _ = make_case(2, 1, 3, 0, 64, 32, seed=0)
    m, l, acc = dt.history_partial_triton(q, k, v, torch.tensor([0, 0]), None, None, 0.1, 32)
    assert torch.isinf(m).all() and (l == 0).all() and (acc == 0).all()


def test_gluon_long_split_choices():
    """CONFIG["gluon_k8"]: 0 never, 2 always, 1 only where a split holds at least gluon_long_split tokens (the int8
    query's longer setup measured slower over short splits: B=1/128K, B=8/8K); the pipeline's stages likewise
    (gluon_stages_long there, gluon_stages elsewhere or when it is unset)."""
    dt = _dt()
    cfg = {"gluon_k8": 1, "gluon_long_split": 2048, "gluon_stages": 2, "gluon_stages_long": 4}
    assert dt.gluon_stages(cfg, 131072, 195) == 2 and dt.gluon_stages(cfg, 131072, 24) == 4
    assert dt.gluon_stages(cfg, 2048, 1) == 4 and dt.gluon_stages(cfg, 2047, 1) == 2
    assert dt.gluon_stages({**cfg, "gluon_stages_long": None}, 131072, 24) == 2
    assert dt.gluon_k8(cfg, 131072, 195) == 0  # B=1/128K: 672 tokens a split
    assert dt.gluon_k8(cfg, 131072, 24) == 1  # B=8/128K: 5461
    assert dt.gluon_k8(cfg, 2048, 1) == 1 and dt.gluon_k8(cfg, 2047, 1) == 0 and dt.gluon_k8(cfg, 2048, 0) == 1
    assert dt.gluon_k8({**cfg, "gluon_k8": 2}, 100, 50) == 1
    assert dt.gluon_k8({**cfg, "gluon_k8": 0}, 10**6, 1) == 0


def test_gluon_long_split_residency():
    """Where the splits are long at the Gluon kernel's default residency, the wave model sizes the grid for
    gluon_resident_long programs an SM and the kernel runs under gluon_maxnreg_long; short splits keep the defaults."""
    dt = _dt()
    glu = SimpleNamespace(tokens_per_step=lambda m: 32 if m <= 4 else 16)
    cfg = {**dt.CONFIG, "gluon_resident": 12, "gluon_maxnreg": 168, "gluon_resident_long": 8,
           "gluon_maxnreg_long": 255, "gluon_long_split": 2048}
    dev = torch.device("cpu")  # (4 SMs: _device_sms's stand-in)
    long_ = dt.gluon_split_cfg(cfg, 4, glu, 131072, 64, dev)
    assert long_["resident_programs"] == 8 and long_["gluon_maxnreg"] == 255 and long_["block_n"] == 32
    assert dt._long_splits(long_, 131072, dt.num_splits(131072, 64, dev, long_))  # still long at the new residency
    short = dt.gluon_split_cfg(cfg, 4, glu, 8192, 8, dev)  # 8192 / S < 2048
    assert short["resident_programs"] == 12 and short["gluon_maxnreg"] == 168
    assert dt.num_splits(8192, 8, dev, short) * 2048 > 8192
    assert dt.gluon_split_cfg({**cfg, "gluon_resident_long": None}, 4, glu, 131072, 64, dev)["resident_programs"] == 12
    assert dt.gluon_split_cfg(cfg, 4, glu)["resident_programs"] == 12  # (no call size given: the defaults)


def _window_case(b, hk, m, n, w, d, g, seed, device="cpu", mu=True, wmask=True):
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
        r_v=mv(r_v), mu_v=mv(mu_v), out_dtype=torch.float32,
    )
    return args, gen


@interp
@pytest.mark.parametrize(
    "b,hk,m,n,w,d,g,mu,wmask",
    [
        (2, 2, 4, 150, 70, 64, 32, True, True),
        (1, 1, 8, 65, 320, 128, 64, False, False),  # paper window 64 + 256, GQA 8
        (1, 2, 3, 0, 33, 64, 64, True, True),  # no history yet
        (2, 1, 4, 100, 0, 128, 128, True, False),  # no window
    ],
)
@pytest.mark.parametrize("win_split", [32, 128])  # window tokens per window program (32: the Gluon path's)
def test_decode_attention_kernel(small_splits, monkeypatch, b, hk, m, n, w, d, g, mu, wmask, win_split):
    monkeypatch.setitem(small_splits.CONFIG, "win_split", win_split)
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=n + w, mu=mu, wmask=wmask)
    args["start"] = torch.tensor([0, 17][:b])
    if n:
        args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
    got = small_splits.decode_attention_triton(**args)
    ref = small_splits.decode_attention_reference(**args)
    assert got.shape == (b, hk, m, d) and got.dtype == torch.float32
    assert rel_err(got, ref) < 2e-5


@interp
@pytest.mark.parametrize("merge_block", [1, 2, 4])
def test_combine_merges_splits_in_several_blocks(monkeypatch, merge_block):
    """The combine kernel merges the split partials in blocks of ``merge_block`` with a running max (on the GPU:
    blocks of 64, and B=1 has 66 history splits): with blocks smaller than the split count, the online
    rescaling across blocks (history and window, history_partial and decode_attention) must equal the reference.
    The last history split holds keys with 30x scales (the largest logits), so a merge that kept the first
    block's max would overflow or lose the earlier blocks."""
    dt = _dt()
    monkeypatch.setattr(dt, "CONFIG", {**dt.CONFIG, **SMALL_SPLITS, "merge_block": merge_block})
    b, hk, m, n, w, d, g = 2, 1, 4, 600, 300, 64, 32
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=merge_block)
    args["start"] = torch.tensor([0, 70])
    args["k"].scale[:, :, 540:560] *= 30  # large logits (of either sign) in the last history split
    assert dt.num_splits(n, b * hk, torch.device("cpu")) > merge_block
    got = dt.decode_attention_triton(**args)
    assert rel_err(got, dt.decode_attention_reference(**args)) < 2e-5
    h = ("q_rot", "k", "v", "start", "key_mask", "qk_offset", "scaling", "group_size")
    hargs = {k: args[k] for k in h}
    assert_partials_close(dt.history_partial_triton(**hargs), history_partial_reference(**hargs, block_n=64), 5e-5)


@interp
@pytest.mark.parametrize("cblock", [16, 32])
@pytest.mark.parametrize(
    "b,hk,m,n,w,d,mu",
    [
        (2, 2, 4, 600, 70, 64, True),  # GQA 4, left padding, key mask, 3 window splits
        (1, 1, 8, 65, 320, 128, False),  # GQA 8, the paper's window (10 window splits of 32)
        (1, 2, 3, 0, 33, 64, True),  # no history yet
        (2, 1, 4, 100, 0, 128, True),  # no window
    ],
)
def test_combine_hoisted_loads(monkeypatch, cblock, b, hk, m, n, w, d, mu):
    """The decode op's combine with its loads hoisted (``merge_hoist``: the window partials and R_V's first chunk with
    the history partials, each next chunk ahead of its use, the window row's chunk picked by a masked sum) equals the
    reference; the last history split holds 30x key scales (the largest logits)."""
    dt = _dt()
    monkeypatch.setattr(dt, "CONFIG", {**dt.CONFIG, **SMALL_SPLITS, "win_split": 32, "merge_hoist": 1,
                                       "merge_cblock": cblock})
    hoisted = []
    real = dt._combine_kernel
    monkeypatch.setattr(dt, "_combine_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (hoisted.append(kw["HOIST"]), real[grid](*a, **kw))[1])})())
    args, gen = _window_case(b, hk, m, n, w, d, 64 if d == 128 else 32, seed=n + w + m, mu=mu)
    args["start"] = torch.tensor([0, 17][:b])
    if n:
        args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
        args["k"].scale[:, :, n - 40:n - 20] *= 30
    got = dt.decode_attention_triton(**args)
    assert hoisted == [1], "the hoisted combine did not run"
    assert rel_err(got, dt.decode_attention_reference(**args)) < 2e-5


@interp
@pytest.mark.parametrize("hoist,cblock", [(1, 16), (1, 32), (0, None)])
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("b,hk,m,n,w,d,mu,n_valid", [(2, 2, 4, 600, 70, 64, True, None),
                                                     (1, 1, 8, 65, 320, 128, False, None),
                                                     (2, 1, 4, 600, 40, 128, True, 433)])  # static: length on device
def test_combine_output_parts(monkeypatch, hoist, cblock, parts, b, hk, m, n, w, d, mu, n_valid):
    """``merge_out_parts``: the combine's rows split over ``parts`` programs, each un-rotating its slice of the output
    channels (R_V's rows), equals the reference -- the hoisted loads and the plain ones, several chunks a slice or
    one; the grid has ``parts`` programs a row. The choices for fewer rows than SMs (a GPU's) forced on: also the
    split count rounded down to a power of two (``splits_pow2_slack``, here 0.5: always)."""
    dt = _dt()
    monkeypatch.setattr(dt, "CONFIG", {**dt.CONFIG, **SMALL_SPLITS, "win_split": 32, "merge_hoist": hoist,
                                       "merge_cblock": cblock, "merge_out_parts": parts, "splits_pow2_slack": 0.5})
    monkeypatch.setattr(dt, "_few_rows", lambda rows, device: True)
    rounded = []
    real_round = dt._pow2_below_within
    monkeypatch.setattr(dt, "_pow2_below_within", lambda s_, slack: rounded.append(real_round(s_, slack)) or rounded[-1])
    grids = []
    real = dt._combine_kernel
    monkeypatch.setattr(dt, "_combine_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (grids.append((grid, kw["PARTS"], kw["HOIST"])), real[grid](*a, **kw))[1])})())
    args, gen = _window_case(b, hk, m, n, w, d, 64 if d == 128 else 32, seed=n + w + m + parts, mu=mu)
    args["start"] = torch.tensor([0, 17][:b])
    args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
    args["k"].scale[:, :, n - 40:n - 20] *= 30
    extra = {} if n_valid is None else {"n_valid": torch.tensor(n_valid)}
    got = dt.decode_attention_triton(**args, **extra)
    assert grids == [((b * hk * m * parts,), parts, hoist)], grids
    assert len(rounded) == 1 and rounded[0] & (rounded[0] - 1) == 0, rounded  # a power of two splits
    assert rel_err(got, dt.decode_attention_reference(**args, **extra)) < 2e-5


@interp
@pytest.mark.parametrize("n_valid", [0, 1, 150, 299])
def test_decode_attention_kernel_device_length(small_splits, n_valid):
    """Static cache: storage of capacity N, valid length read on the device, fixed split count:
    equals the reference over the first n_valid entries."""
    b, hk, m, n, w, d, g = 2, 2, 4, 300, 37, 64, 32
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=n_valid)
    args["start"] = torch.tensor([0, 9])
    got = small_splits.decode_attention_triton(**args, n_valid=torch.tensor(n_valid), splits=3)
    cut = {k: (type(args[k])(*(t[:, :, :n_valid] for t in args[k])) if k in ("k", "v") else args[k]) for k in args}
    ref = small_splits.decode_attention_reference(**cut)
    assert rel_err(got, ref) < 2e-5
    ref_masked = small_splits.decode_attention_reference(**args, n_valid=torch.tensor(n_valid))
    assert rel_err(ref_masked, ref) < 1e-6


def _rotating_case(b, hk, m, n, w, d, g, seed, device="cpu"):
    """A decode case for the rotating entry: the unrotated query (also the window's), R_K and a per-KV-head mu_K."""
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=seed, device=device)
    qf = args.pop("q_win").float()
    for k_ in ("q_rot", "qk_offset"):
        args.pop(k_)
    r_k = random_rotation(hk, d, gen).to(device)
    mu_k = (torch.randn(hk, d, generator=gen) * 0.5).to(device)
    return {"qf": qf, "r_k": r_k, "mu_k": mu_k, **args}


def _rotating_reference(args, **kw):
    q_rot, qk_off = rotate_query_reference(args["qf"], args["r_k"], args["mu_k"])
    rest = {k_: v_ for k_, v_ in args.items() if k_ not in ("qf", "r_k", "mu_k")}
    return decode_attention_reference(q_rot=q_rot, qk_offset=qk_off, q_win=args["qf"], **rest, **kw)


@interp
@pytest.mark.parametrize("fused", [0, 2])
@pytest.mark.parametrize("b,hk,m,n,w,d,g", [(2, 2, 4, 150, 70, 64, 32), (1, 1, 8, 65, 320, 128, 64),
                                            (2, 1, 4, 100, 0, 128, 128), (1, 2, 3, 0, 33, 64, 64),
                                            (19, 2, 4, 40, 33, 64, 32)])
def test_decode_attention_rotating(small_splits, monkeypatch, fused, b, hk, m, n, w, d, g):
    """The op from the unrotated query (what the model's attention calls): the rotation launched by the op itself --
    as its own launch, or (``fused_prologue`` 2, the Gluon path's layout forced onto the Triton path) in one launch
    with the window programs (``_prologue_kernel``, which must then run whenever there are history and window) --
    equals rotate-then-reference. B = 19: many rotation programs beside the window programs, and a per-sequence
    ``mu_K`` (``key_offset="prefill"``)."""
    monkeypatch.setitem(small_splits.CONFIG, "fused_prologue", fused)
    args = _rotating_case(b, hk, m, n, w, d, g, seed=n + w)
    args["start"] = torch.tensor(([0, 17] * b)[:b])
    if b > 2:
        args["mu_k"] = torch.randn(b, hk, d, generator=torch.Generator().manual_seed(b)) * 0.5
    launches = []
    real = small_splits._prologue_kernel
    monkeypatch.setattr(small_splits, "_prologue_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: (launches.append(grid), real[grid])[1]})())
    got = small_splits.decode_attention_rotating_triton(**args)
    assert rel_err(got, _rotating_reference(args)) < 2e-5
    assert len(launches) == int(bool(fused and n and w)), launches


@interp
def test_static_op_traces_as_one_opaque_call(small_splits):
    """The static cache's kernel call compiles as one custom op (aot_eager: fake shapes + real run)."""
    from oscar_hf.kernels.int2_attention import decode_attention

    b, hk, m, n, w, d, g = 2, 2, 4, 300, 37, 64, 32
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=3)
    args["start"] = torch.tensor([0, 9])
    nv = torch.tensor(200)

    def f(nv):
        return decode_attention(**args, n_valid=nv, splits=3, use_kernels=True)

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(nv)
    cut = {k: (type(args[k])(*(t[:, :, :200] for t in args[k])) if k in ("k", "v") else args[k]) for k in args}
    assert rel_err(got.float(), small_splits.decode_attention_reference(**cut).float()) < 2e-5


@interp
def test_decode_attention_kernel_property(small_splits):
    """Hypothesis: the fused Triton op equals the reference over random shapes (GQA 1-8, any history and
    window length, left padding of any row, head dims 32-128, 1-4 groups per row) and random values."""
    pytest.importorskip("hypothesis")  # (the GPU machine may lack it; this test runs under the interpreter)
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None)
    @given(b=st.integers(1, 3), hk=st.integers(1, 2), m=st.integers(1, 8), n=st.integers(0, 200),
           w=st.integers(0, 40), d=st.sampled_from([32, 64, 128]), groups=st.sampled_from([1, 2, 4]),
           seed=st.integers(0, 2**16), pad=st.integers(0, 30))
    def prop(b, hk, m, n, w, d, groups, seed, pad):
        assume(n + w > 0)
        args, gen = _window_case(b, hk, m, n, w, d, d // groups, seed=seed)
        args["start"] = torch.randint(0, pad + 1, (b,), generator=gen).clamp(max=max(n - 1, 0))
        if w and args["win_mask"] is not None:
            args["win_mask"][..., -1] = True  # every row attends to at least its newest window token
        elif not w:
            args["start"].zero_()  # no window: every row keeps at least one history key
        got = small_splits.decode_attention_triton(**args)
        ref = small_splits.decode_attention_reference(**args)
        assert got.shape == (b, hk, m, d) and torch.isfinite(got).all()
        assert rel_err(got, ref) < 5e-5

    prop()


@interp
def test_decode_attention_reference_is_plain_attention():
    """The composed reference equals softmax over [history (dequantized, un-rotated, + mu) ; window]."""
    dt = _dt()
    b, hk, m, n, w, d, g = 1, 2, 4, 40, 9, 64, 32
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=4)
    ref = dt.decode_attention_reference(**args).double()
    kh = dequantize_rows(args["k"], g, torch.float64)
    vh = dequantize_rows(args["v"], g, torch.float64)
    logits_h = (torch.einsum("bhmd,bhnd->bhmn", args["q_rot"].double(), kh) + args["qk_offset"].double()[..., None])
    v_back = torch.matmul(vh, args["r_v"].double().transpose(-1, -2).unsqueeze(0)) + args["mu_v"].double()[None, :, None]
    logits_w = torch.einsum("bhmd,bhnd->bhmn", args["q_win"].double(), args["k_win"].double())
    logits_w = logits_w.masked_fill(~args["win_mask"], -math.inf)
    p = torch.softmax(torch.cat([logits_h, logits_w], -1) * args["scaling"], -1)
    out = torch.einsum("bhmn,bhnd->bhmd", p, torch.cat([v_back, args["v_win"].double()], -2))
    assert rel_err(ref, out) < 1e-5


# ---------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("b,n", [(1, 131072), (4, 32771), (8, 8192)])
def test_gpu_history_partial_real_shapes(b, n):
    hq, hk, d, g = 32, 8, 128, 64
    q, k, v, gen = make_case(b, hk, hq // hk, n, d, g, seed=n, device="cuda")
    start = torch.randint(0, 300, (b,), generator=gen).cuda() if b > 1 else torch.zeros(1, dtype=torch.long, device="cuda")
    key_mask = (torch.rand(b, 1, 1, n, generator=gen) > 0.05).cuda() if b > 1 else None
    off = torch.randn(b, hk, hq // hk, generator=gen).cuda()
    got = _dt().history_partial_triton(q, k, v, start, key_mask, off, d**-0.5, g)
    ref = history_partial_reference(q, k, v, start, key_mask, off, d**-0.5, g, 4096)
    assert_partials_close(got, ref, 2e-2)  # bf16 dot operands (like a BF16 flash kernel)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("loop,prefetch", [("rowdot", 0), ("deferred", 0), ("deferred", 2), ("deferred", 4),
                                           ("deferred-pair", 4), ("deferred-ahead", 4), ("deferred-ahead-pair", 4),
                                           ("deferred-ahead", 0), ("deferred-ahead-asm", 0), ("deferred-asm", 4),
                                           ("deferred-ahead-pair-asm", 0), ("gluon-negmma", 0), ("gluon-gsum", 0)])
@pytest.mark.parametrize("b,n", [(1, 131072 - 320), (8, 32768 - 320)])
def test_gpu_decode_attention_real_shapes(b, n, loop, prefetch, monkeypatch):
    monkeypatch.setattr(_dt(), "CONFIG", {**_dt().CONFIG, **_loop_config(loop), "prefetch": prefetch})
    args, _ = _window_case(b, 8, 4, n, 320, 128, 64, seed=b, device="cuda")
    args["out_dtype"] = torch.bfloat16
    got = _dt().decode_attention_triton(**args)
    ref = _dt().decode_attention_reference(**args)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), ref.float()) < 2e-2


# ------------------------------------------------------------------------- the Gluon history kernel (GPU)


_GLUON_VARIANTS = {
    "negmma": {"gluon_gsum": 0, "pdl": 0},
    "gsum": {"gluon_gsum": 1, "pdl": 0},
    "gsum-pdl": {"gluon_gsum": 1, "pdl": 1},
    "regs": {"gluon_gsum": 1, "pdl": 0, "gluon_stages": 0},
    "smem4": {"gluon_gsum": 1, "pdl": 0, "gluon_stages": 4},
    "smem3": {"gluon_gsum": 1, "pdl": 0, "gluon_stages": 3},  # a ring whose length is no power of two
    "long5": {"gluon_long_split": 64, "gluon_stages_long": 5},
    "early": {"gluon_gsum": 1, "pdl": 0, "gluon_early": 1},
    "early-pdl2": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1},
    "fp16-keys": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1, "gluon_k8": 0},
    "k8": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1, "gluon_k8": 2, "gluon_qflag": 0},
    "k8-regs": {"gluon_gsum": 1, "pdl": 0, "gluon_stages": 0, "gluon_k8": 2},
    "k8-noqpre": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1, "gluon_k8": 2, "gluon_qpre": 0},
    "k8-qpre-nopdl": {"gluon_gsum": 1, "pdl": 0, "gluon_k8": 2, "gluon_qpre": 1},
    "hoist": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1, "gluon_k8": 1, "merge_hoist": 1, "merge_cblock": 32},
    "long": {"gluon_long_split": 64},  # every split long: int8 keys, 4 stages, 8 programs an SM without a cap
    "short": {"gluon_long_split": 1 << 30},  # no split long: fp16 keys, 2 stages, 12 programs an SM under a cap
    "pdl4-warp": {"gluon_gsum": 1, "pdl": 4, "gluon_early": 1, "merge_one_warp_rows": 0},
    "pdl5": {"gluon_gsum": 1, "pdl": 5, "gluon_early": 1},
    "qflag": {"gluon_gsum": 1, "pdl": 2, "gluon_early": 1, "gluon_k8": 2, "gluon_qpre": 1, "gluon_qflag": 1},
    "parts1": {"merge_out_parts": 1, "merge_warps_few": None, "splits_pow2_slack": 0},
}


@pytest.fixture(params=list(_GLUON_VARIANTS), ids=list(_GLUON_VARIANTS))
def gluon_calls(request, monkeypatch):
    """Counts the Gluon kernel's launches (so that a test fails if the dispatch silently took the Triton kernel); each
    test runs with both ways of removing the value codes' offset (CONFIG["gluon_gsum"]), with programmatic dependent
    launch of the Gluon path's launches (CONFIG["pdl"] 1; 2: only rotation -> history, where the op rotates), with
    each way of feeding the history loop's full steps: loads to registers (gluon_stages 0) or through shared memory
    (2 stages, the default, 3 and 4), with the split's first loads before the query's (gluon_early), and with the key
    logits on int8 tensor cores (gluon_k8), their query operands built by the history programs or (where the op
    rotates the query, the default) by the prologue (gluon_qpre); "hoist": the decode op's combine (loads hoisted,
    merge_hoist, the default) with R_V in 32-row chunks instead of the default 64; "long": the defaults with every split long (the long splits'
    key path, pipeline, residency and register cap; since session 20 the default from 256 tokens a split; "long5": with
    a 5-stage ring), "short":
    no split long (the short-split path, the default before session 20); "pdl4-warp": the combine under PDL (pdl 4),
    one warp per row wherever there are more rows than SMs (merge_one_warp_rows 0); "pdl5": the combine under PDL,
    launched once every history program is past its loop (pdl 5); "qflag": the history programs wait for
    counters their head's rotation programs raise, not for the prologue grid (gluon_qflag); "parts1": the combine for fewer
    rows than SMs as before session 21 (one 8-warp program a row, the split count not rounded)."""
    glu = _dt()._gluon_module()
    assert glu is not None, "this Triton has no Gluon"
    calls = []
    real = glu.launch_history
    monkeypatch.setattr(glu, "launch_history", lambda *a, **kw: (calls.append(a[0].shape), real(*a, **kw))[1])
    monkeypatch.setattr(_dt(), "CONFIG", {**_dt().CONFIG, "gluon": 1, "gluon_min_work": 0,
                                          **_GLUON_VARIANTS[request.param]})
    return calls


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "b,m,n,starts,off",
    [
        (1, 4, 1, (0,), True),  # one token (TB = 2: 32-token steps)
        (1, 4, 33, (0,), False),  # one step + 1
        (3, 4, 5003, (0, 17, 4000), True),  # left padding, odd length, splits
        (2, 1, 777, (0, 31), True),  # MHA (one query row; TB = 2)
        (2, 3, 1000, (5, 0), True),  # GQA 3 (padding columns)
        (2, 6, 2049, (0, 100), True),  # 6 rows: TB = 1 (16-token steps)
        (1, 8, 131072 - 5, (0,), True),  # GQA 8 at 128K
        (4, 4, 32768 + 7, (0, 1, 2, 3000), True),  # the benchmark shape
    ],
)
def test_gpu_gluon_history_partial(gluon_calls, b, m, n, starts, off):
    hk, d, g = 8 if b <= 2 else 2, 128, 64
    q, k, v, gen = make_case(b, hk, m, n, d, g, seed=n + m, device="cuda")
    start = torch.tensor(starts, device="cuda")
    qk_offset = (torch.randn(b, hk, m, generator=gen) * 3).cuda() if off else None
    got = _dt().history_partial_triton(q.cuda(), k, v, start, None, qk_offset, d**-0.5, g)
    ref = history_partial_reference(q.cuda(), k, v, start, None, qk_offset, d**-0.5, g, 4096)
    assert gluon_calls, "the Gluon kernel did not run"
    assert_partials_close(got, ref, 2e-2)
    # and the Triton kernel on the same case agrees with it to the same tolerance
    tri = _dt()._launch(q.cuda(), k, v, start, None, qk_offset, d**-0.5, g, cfg={**_dt().CONFIG, "gluon": 0})
    assert_partials_close(got, tri, 2e-2)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("case", ["spike", "underflow"])
def test_gpu_gluon_reference_guard(gluon_calls, case):
    """The rerun of a split against its true max (see test_deferred_loop_reference_guard), per logit column."""
    b, hk, m, n, d, g = 1, 1, 4, 4000, 128, 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, hk, m, d, generator=gen)
    kf = torch.randn(b, hk, n, d, generator=gen)
    start = torch.zeros(b, dtype=torch.long)
    off = None
    if case == "spike":
        kf[0, 0, 3900] = 60.0 * q[0, 0].mean(0).sign()
    else:
        start[0] = 40  # the first step's tokens are padding: reference 0, logits ~ -3600 log2 units
        off = torch.full((b, hk, m), -20000.0)
    k = quantize_rows(kf, g, 1.0, torch.bfloat16)
    v = quantize_rows(torch.randn(b, hk, n, d, generator=gen), g, 1.0, torch.bfloat16)
    args = (q.cuda(), QuantizedRows(*(t.cuda() for t in k)), QuantizedRows(*(t.cuda() for t in v)), start.cuda(), None,
            None if off is None else off.cuda(), d**-0.5, g)
    ref = history_partial_reference(*args, 1024)
    got = _dt().history_partial_triton(*args)
    assert gluon_calls
    assert_partials_close(got, ref, 2e-2)


@pytest.mark.gpu
@on_gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n_valid", [0, 1, 31, 32, 2000, 2999])
def test_gpu_gluon_decode_op_device_length_and_stale_storage(gluon_calls, n_valid):
    """The fused op with the Gluon history: static storage (length on the device), a window, left padding whose
    storage holds NaN (never read for V), against the reference over the first n_valid entries."""
    b, hk, m, n, w, d, g = 2, 8, 4, 3000, 320, 128, 64
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=n_valid, device="cuda")
    args = {k_: (v_.cuda() if isinstance(v_, torch.Tensor) else v_) for k_, v_ in args.items()}
    args["start"] = torch.tensor([0, 9], device="cuda")
    cut = {k_: (type(args[k_])(*(t[:, :, :n_valid] for t in args[k_])) if k_ in ("k", "v") else args[k_]) for k_ in args}
    ref = _dt().decode_attention_reference(**cut)
    for t in (args["v"].scale, args["v"].zero):
        t[1, :, :9] = float("nan")
    got = _dt().decode_attention_triton(**args, n_valid=torch.tensor(n_valid, device="cuda"), splits=3)
    assert (not n_valid) or gluon_calls
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 2e-2


@pytest.mark.gpu
@on_gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("b,n,n_valid", [(2, 3000, None), (2, 3000, 2001), (1, 131072 - 320, None),
                                         (8, 32768 - 320, None)])
def test_gpu_gluon_decode_op_rotating(gluon_calls, monkeypatch, fused, b, n, n_valid):
    """The op from the unrotated query on the Gluon path (what the model's attention calls): the rotation in its own
    launch or with the window programs (``fused_prologue``), left padding, dynamic and device-side lengths, against
    rotate-then-reference."""
    monkeypatch.setitem(_dt().CONFIG, "fused_prologue", fused)
    args = _rotating_case(b, 8, 4, n, 320, 128, 64, seed=b + n, device="cuda")
    args["qf"] = args["qf"].cuda()
    args["start"] = torch.tensor([0, 9, 0, 1, 2, 3, 4, 5][:b], device="cuda")
    args["out_dtype"] = torch.bfloat16
    if n_valid is None:
        ref = _rotating_reference(args)
        got = _dt().decode_attention_rotating_triton(**args)
    else:
        cut = {k_: (type(args[k_])(*(t[:, :, :n_valid] for t in args[k_])) if k_ in ("k", "v") else args[k_])
               for k_ in args}
        ref = _rotating_reference(cut)
        got = _dt().decode_attention_rotating_triton(**args, n_valid=torch.tensor(n_valid, device="cuda"), splits=3)
    assert gluon_calls, "the Gluon kernel did not run"
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), ref.float()) < 2e-2


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m", [1, 4, 6, 8])
def test_gpu_gluon_prologue_query_operands(monkeypatch, m):
    """The int8 key path's query operands built once by the prologue (gluon_qpre) or by every history program: the
    rotating op's outputs agree with each other to float32 rounding and with the reference, at both token-set layouts
    (TB = 2 for <= 4 rows, else 1) and with padding columns; and the prologue's operands reach the history kernel."""
    glu = _dt()._gluon_module()
    seen = []
    real = glu.launch_history
    monkeypatch.setattr(glu, "launch_history", lambda *a, **kw: (seen.append(kw.get("qpre") is not None),
                                                                 real(*a, **kw))[1])
    args = _rotating_case(2, 8, m, 9000, 320, 128, 64, seed=m, device="cuda")
    args["qf"] = args["qf"].cuda()
    args["start"] = torch.tensor([0, 37], device="cuda")
    args["out_dtype"] = torch.float32
    outs = {}
    for qpre in (1, 0):
        monkeypatch.setattr(_dt(), "CONFIG", {**_dt().CONFIG, "gluon": 1, "gluon_min_work": 0, "gluon_k8": 2,
                                              "gluon_qpre": qpre})
        outs[qpre] = _dt().decode_attention_rotating_triton(**args)
    assert seen == [True, False]
    # The prologue's sigma_g (from the query rows' largest norm, not the largest entry) makes the operands ~5x coarser
    # (q_rot to ~3e-4 instead of ~6e-5, relative; the bf16 query itself holds ~4e-3), and the bf16 rounding of the value
    # MMA's weights p s amplifies such a change of the logits (a rounding that flips costs a bf16 step): the op with
    # either operands differs by 2-4e-3 (H100, session 23 run f) and from the reference by about as much as the
    # kernel's own operands do. A wrong tile, field or plane would be O(0.1 - 1).
    ref = _rotating_reference(args).float()
    err_pre, err_own = rel_err(outs[1], ref), rel_err(outs[0], ref)
    assert rel_err(outs[1], outs[0]) < 1e-2
    assert err_pre < 2e-2 and err_pre < err_own + 3e-3, (err_pre, err_own)


@pytest.mark.gpu
@on_gpu
def test_gpu_gluon_qflag_counters(monkeypatch):
    """The prologue -> history counters (gluon_qflag): the op's output is bit-identical to the PDL wait's (the same
    kernels, only the wait differs), call after call, from a second stream too, and every call leaves the counters at
    0 (the combine resets them: a counter left raised would let the next call's history read stale operands) -- also
    a call whose launches fail after the prologue's."""
    dt = _dt()
    args = _rotating_case(2, 8, 4, 9000, 320, 128, 64, seed=3, device="cuda")
    args["qf"] = args["qf"].cuda()
    args["start"] = torch.tensor([0, 37], device="cuda")
    args["out_dtype"] = torch.float32
    base = {**dt.CONFIG, "gluon": 1, "gluon_min_work": 0, "gluon_k8": 2, "gluon_qpre": 1, "pdl": 2}
    monkeypatch.setattr(dt, "CONFIG", {**base, "gluon_qflag": 0})
    want = dt.decode_attention_rotating_triton(**args)
    monkeypatch.setattr(dt, "CONFIG", {**base, "gluon_qflag": 1})
    seen = []
    real = dt._ready_counters
    monkeypatch.setattr(dt, "_ready_counters", lambda *a: (seen.append(1), real(*a))[1])
    for _ in range(3):
        assert torch.equal(dt.decode_attention_rotating_triton(**args), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = dt.decode_attention_rotating_triton(**args)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    assert torch.equal(dt.decode_attention_rotating_triton(**args), want)
    assert len(seen) == 5
    counters = dt._READY[torch.device("cuda", torch.cuda.current_device())][0]
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
    # a launch that fails after the prologue raised the counters (here the history's) sets them back to 0, and the
    # next call is right again
    glu = dt._gluon_module()
    real_hist = glu.launch_history

    def broken(*a, **kw):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(glu, "launch_history", broken)
    with pytest.raises(RuntimeError, match="no kernel"):
        dt.decode_attention_rotating_triton(**args)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
    monkeypatch.setattr(glu, "launch_history", real_hist)
    assert torch.equal(dt.decode_attention_rotating_triton(**args), want)


@pytest.mark.gpu
@on_gpu
def test_gpu_gluon_decode_op_rotating_in_graph(gluon_calls):
    """The op from the unrotated query captured in a CUDA graph (programmatic dependent launch becomes graph edges):
    replays with new queries and window values written into the captured inputs equal the reference each time."""
    args = _rotating_case(4, 8, 4, 20000, 320, 128, 64, seed=11, device="cuda")
    args["qf"] = args["qf"].cuda()
    args["start"] = torch.tensor([0, 9, 0, 300], device="cuda")
    args["out_dtype"] = torch.bfloat16
    op = lambda: _dt().decode_attention_rotating_triton(**args)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = op()
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        args["qf"].copy_(torch.randn(args["qf"].shape, generator=gen))
        args["v_win"].copy_(torch.randn(args["v_win"].shape, generator=gen))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out.float(), _rotating_reference(args).float()) < 2e-2
    assert gluon_calls, "the Gluon kernel did not run"
    torch.cuda.synchronize()  # (gluon_qflag: every replay's combine set the prologue -> history counters back to 0)
    assert all(int(e[0].abs().sum()) == 0 for e in _dt()._READY.values())


@pytest.mark.gpu
@on_gpu
def test_gpu_gluon_timestamps(monkeypatch):
    """The diagnostic per-program timestamps (``decode_gluon.TIMES_BUF``, ``scripts/timeline_hist_programs.py``):
    the op's output is unchanged with them compiled in, every history program stamps its five points in order on a
    real SM, every prologue program (rotation / window) its entry before its exit, and every combine program its
    entry, the end of its wait (after every history program's loop) and its exit, in order."""
    monkeypatch.setattr(_dt(), "CONFIG", {**_dt().CONFIG, "gluon": 1, "gluon_min_work": 0})
    glu = _dt()._gluon_module()
    args = _rotating_case(2, 8, 4, 20000, 320, 128, 64, seed=3, device="cuda")
    args["qf"] = args["qf"].cuda()
    args["out_dtype"] = torch.bfloat16
    plain = _dt().decode_attention_rotating_triton(**args)
    buf = torch.zeros(1 << 16, glu.TIME_SLOTS.value, dtype=torch.int64, device="cuda")
    monkeypatch.setattr(glu, "TIMES_BUF", buf)
    stamped = _dt().decode_attention_rotating_triton(**args)
    torch.cuda.synchronize()
    assert torch.equal(plain, stamped)
    row, row_c = _dt().PROLOGUE_TIME_ROW.value, _dt().COMBINE_TIME_ROW.value
    hist, pro, comb = buf[:row].cpu(), buf[row:row_c].cpu(), buf[row_c:].cpu()
    hist, pro, comb = hist[hist[:, 0] != 0], pro[pro[:, 0] != 0], comb[comb[:, 0] != 0]
    # the combine's programs (2 x 8 x 4 query rows, fewer than SMs: merge_out_parts a row): entry, wait, exit -- the
    # wait ending after every history program's loop
    parts = _dt().CONFIG["merge_out_parts"] if 64 < torch.cuda.get_device_properties(0).multi_processor_count else 1
    assert comb.shape[0] == 64 * parts and (comb[:, 1] >= comb[:, 0]).all() and (comb[:, 4] >= comb[:, 1]).all()
    assert comb[:, 1].min() >= hist[:, 3].max()
    assert hist.shape[0] >= 2 * 8 and pro.shape[0] >= 2 * 8  # programs of every (row, head)
    assert (hist[:, 1:5] >= hist[:, 0:4]).all(), "history stamps out of order"
    assert (hist[:, 6] > hist[:, 5]).all() and ((hist[:, 7] & 0xFFFF) < torch.cuda.get_device_properties(0).multi_processor_count).all()
    assert (pro[:, 4] >= pro[:, 0]).all() and set(pro[:, 3].tolist()) == {0, 1}
