"""Split-K INT2 decode attention: the torch reference against plain softmax attention, and the
Triton kernels (``history_partial_triton``, ``decode_attention_triton``) against the references, under the Triton
interpreter on the CPU (float32 dot operands there, so tolerances are tight); the host-side split policy. The compiled
kernels at real shapes (the split kernel and the Gluon history): ``test_decode_gpu.py``.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from kernel_utils import loose, rel_err, rotating, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from decode_cases import (_dt, _rotating_case, _rotating_reference, _window_case, assert_partials_close,  # noqa: E402
                          cut_history, make_case, normalized, plain_attention, rotating_op)
from oscar_hf.kernels import plan  # noqa: E402
from oscar_hf.kernels.int2_attention import (  # noqa: E402
    decode_attention_reference,
    history_partial,
    history_partial_reference,
    merge_partials,
)
from oscar_hf.kernels.plan import DEFAULTS, gluon_plan, long_splits, num_splits, wave_splits  # noqa: E402
from oscar_hf.quant import QuantizedRows, dequantize_rows, quantize_rows  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


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

# 64-token blocks (the shapes below sit on their boundaries) and min_split lowered so that small N gets several
# splits on the CPU; the shapes pick both inner loops (deferred: G >= D/4 and <= 16 query rows per KV head; dequant
# otherwise) and both metadata loads of the deferred loop (both groups' bf16 scale / zero as one 4-byte word where NG = 2)
SMALL = replace(DEFAULTS, min_split=64, block_n=64)


@pytest.fixture
def small_splits(monkeypatch):
    """The split kernel's module, with 16 SMs assumed on the CPU (4 otherwise): more splits per call for the wave model
    of the split count, so that the combine merges several of them."""
    monkeypatch.setattr(plan, "device_sms", lambda device: 16)
    return _dt()


def _force_combine(monkeypatch, **fields):
    """The decode op's combine launched with ``fields`` of its :class:`~oscar_hf.kernels.plan.CombineShape` forced
    (e.g. ``c_block``, ``hoist``: the GPU's choices for many or crowded rows, under the interpreter)."""
    real = plan.combine_shape
    monkeypatch.setattr(plan, "combine_shape", lambda *a, **kw: real(*a, **kw)._replace(**fields))


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
        (2, 1, 8, 4, 150, 64, 32, torch.bfloat16, (0, 70), "b", True),  # M = 32, masks, padding: dequant loop
        (1, 2, 4, 5, 130, 128, 64, torch.float16, (9,), "bh", False),  # M = 20: dequant loop, fp16 metadata
        # head_dim 96 (Phi-3; planes of 24 channels padded to 32 lanes): groups across planes (G = 32, the dequant loop
        # gathering per channel), whole planes (G = 48: two per group, one 4-byte word for both groups' bf16 scales;
        # G = 96: one group per head)
        (2, 1, 4, 1, 130, 96, 32, torch.bfloat16, (0, 9), "b", True),
        (1, 2, 4, 1, 70, 96, 48, torch.bfloat16, (3,), None, True),
        (1, 1, 8, 1, 65, 96, 96, torch.float16, (0,), "bh", False),
        (1, 1, 2, 1, 65, 96, 24, torch.bfloat16, (0,), None, True),  # G = 24: one plane per group
        (1, 1, 4, 5, 70, 96, 32, torch.bfloat16, (2,), None, True),  # M = 20
        # head_dim 512 (Gemma 4's full layers; 16-token blocks): groups inside a plane (G = 64: dequant), whole planes
        (1, 1, 4, 1, 40, 512, 64, torch.bfloat16, (0,), None, True),
        (2, 1, 2, 1, 33, 512, 128, torch.bfloat16, (0, 5), "b", True),
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
    got = small_splits.history_partial_triton(q, k, v, start, key_mask, qk_offset, scaling, g, defaults=SMALL)
    ref = history_partial_reference(q, k, v, start, key_mask, qk_offset, scaling, g, 64)
    assert_partials_close(got, ref, 5e-5)
    # and through the public dispatcher
    got2 = history_partial(q, k, v, start, key_mask, qk_offset, scaling, g, use_kernels=True)
    assert_partials_close(got2, ref, 5e-5)


@interp
@pytest.mark.parametrize("n", [127, 128, 257])
def test_history_partial_default_config(n):
    """The shipped defaults around the block boundaries of 64- and 128-token splits."""
    dt = _dt()
    q, k, v, gen = make_case(2, 1, 4, n, 128, 64, seed=n)
    start = torch.tensor([0, 3])
    off = torch.randn(2, 1, 4, generator=gen)
    got = dt.history_partial_triton(q, k, v, start, None, off, 0.1, 64)
    assert_partials_close(got, history_partial_reference(q, k, v, start, None, off, 0.1, 64, 128), 2e-5)


@interp
@pytest.mark.parametrize("m", [4, 20])  # deferred loop; dequant (its running max) as a control
@pytest.mark.parametrize("case", ["spike", "underflow"])
def test_deferred_loop_reference_guard(case, m):
    """The deferred loop exponentiates against the max of a split's first block: a later logit far
    above it (spike: ~700 log2 units, exp2 would overflow) or every logit far below the fallback
    reference 0 (underflow: first block masked out, logits ~ -3600 log2 units) must trigger its rerun
    with the split's true max, not inf / NaN / all-zero partials. (At logits of this size float32 itself
    leaves ~1e-4 relative error, in both loops.)"""
    dt = _dt()
    b, hk, n, d, g = 1, 1, 192, 64, 32
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
    got = dt.history_partial_triton(q, k, v, start, key_mask, off, d**-0.5, g, defaults=replace(SMALL, min_split=192))
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
    q32 = torch.randn(b, hk, 32, d, generator=gen)  # the dequant loop (M = 32)
    ref = history_partial_reference(q, k, v, start, key_mask, None, 0.1, g, 64)
    ref32 = history_partial_reference(q32, k, v, start, key_mask, None, 0.1, g, 64)
    for t in (k.scale, k.zero, v.scale, v.zero):
        t[1, :, :100] = float("nan")
        t[0, :, 30:40] = float("inf")
    got = small_splits.history_partial_triton(q, k, v, start, key_mask, None, 0.1, g, defaults=SMALL)
    assert_partials_close(got, ref, 2e-5)
    got = small_splits.history_partial_triton(q32, k, v, start, key_mask, None, 0.1, g, defaults=SMALL)
    assert_partials_close(got, ref32, 2e-5)


@interp
def test_history_partial_falls_back_for_per_query_masks_and_large_m():
    dt = _dt()
    q, k, v, gen = make_case(1, 1, 4, 40, 64, 32, seed=2)
    start = torch.tensor([0])
    key_mask = torch.rand(1, 1, 4, 40, generator=gen) > 0.5  # depends on the query row
    ref = history_partial_reference(q, k, v, start, key_mask, None, 0.1, 32, 1024)
    got = history_partial(q, k, v, start, key_mask, None, 0.1, 32, use_kernels=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not dt.kernel_supported(torch.zeros(1, 1, 65, 64), k, 32, None)
    assert not dt.kernel_supported(torch.zeros(1, 1, 4, 64), k, 32, torch.zeros(1, 1, 1, 40))  # float mask


def test_num_splits_wave_model():
    """The wave model fills the GPU's resident program slots in whole waves: on 132 SMs x 2 programs, B=1 (8 KV
    heads) takes 33 splits (one wave), B=8 4, B=32 1, where the older rule (``bh * S ~ 4 x SMs``: 66, 9, 3 splits)
    ran a last wave mostly empty; and its waves x blocks per split is never worse than that rule's."""

    def splits(n, bh):
        return wave_splits(n, bh, 132, 64, 256, 4, 2)

    def old_rule(n, bh):
        return max(1, min(-(-4 * 132 // bh), max(1, min(-(-n // 256), -(-n // 64)))))

    assert [splits(131072, bh) for bh in (8, 64, 256)] == [33, 4, 1]
    assert [old_rule(131072, bh) for bh in (8, 64, 256)] == [66, 9, 3]

    def cost(n, bh, s, half=0.0):
        return math.ceil(bh * s / 264) * (math.ceil(n / (s * 64)) + half)

    for n in (300, 1000, 8192, 32768, 100_000, 131072):
        for bh in (1, 3, 8, 24, 64, 256, 1024, 4096):
            s = splits(n, bh)
            assert 1 <= s <= max(1, math.ceil(n / 256))
            assert cost(n, bh, s) <= cost(n, bh, old_rule(n, bh))
            # one candidate per wave count: it must equal the exhaustive minimum (smallest S on ties)
            s_max = max(1, min(math.ceil(n / 256), 4 * 264 // bh))
            assert s == min(range(1, s_max + 1), key=lambda x: (cost(n, bh, x, 0.5), x))


def test_num_splits_and_empty_history():
    dt = _dt()
    dev = torch.device("cpu")
    assert dt.num_splits(128 * 1024, 1, dev) >= 2  # one (batch, head): split the sequence
    assert dt.num_splits(100, 8, dev) == 1 and num_splits(100, 8, dev, static=True) == 1
    q, k, v, _ = make_case(2, 1, 3, 0, 64, 32, seed=0)
    m, l, acc = dt.history_partial_triton(q, k, v, torch.tensor([0, 0]), None, None, 0.1, 32)
    assert torch.isinf(m).all() and (l == 0).all() and (acc == 0).all()


def test_gluon_long_split_choices():
    """The Gluon kernel's int8 keys and deeper pipeline only where a split holds at least gluon_long_split tokens (the
    int8 query's longer setup measured slower over short splits: B=1/128K, B=8/8K)."""
    df = replace(DEFAULTS, gluon_long_split=2048)
    assert not long_splits(df, 131072, 195)  # B=1/128K: 672 tokens a split
    assert long_splits(df, 131072, 24)  # B=8/128K: 5461
    assert long_splits(df, 2048, 1) and not long_splits(df, 2047, 1) and long_splits(df, 2048, 0)


def test_gluon_long_split_residency():
    """Where the splits are long at the Gluon kernel's default residency, the wave model sizes the grid for
    gluon_resident_long programs an SM and the kernel runs under gluon_maxnreg_long; short splits keep the defaults."""
    df = replace(DEFAULTS, gluon_resident=12, gluon_maxnreg=168, gluon_resident_long=8, gluon_maxnreg_long=255,
                 gluon_long_split=2048)
    dev = torch.device("cpu")  # (4 SMs: device_sms's stand-in)
    long_ = gluon_plan(df, 32, 131072, 64, dev)
    assert long_.maxnreg == 255 and long_.block_n == 32
    assert long_.splits == wave_splits(131072, 64, 4, 32, df.min_split, df.max_waves, 8)
    assert long_splits(df, 131072, long_.splits)  # still long at the new residency
    short = gluon_plan(df, 32, 8192, 8, dev)  # 8192 / S < 2048
    assert short.maxnreg == 168 and short.splits == wave_splits(8192, 8, 4, 32, df.min_split, df.max_waves, 12)
    assert short.splits * 2048 > 8192
    assert gluon_plan(df, 32, 0, 64, dev).maxnreg == 168  # (no history: the defaults)


@interp
@pytest.mark.parametrize(
    "b,hk,m,n,w,d,g,mu,wmask",
    [
        (2, 2, 4, 150, 70, 64, 32, True, True),
        (1, 1, 8, 65, 320, 128, 64, False, False),  # paper window 64 + 256, GQA 8
        (1, 2, 3, 0, 33, 64, 64, True, True),  # no history yet
        (2, 1, 4, 100, 0, 128, 128, True, False),  # no window
        (2, 1, 4, 90, 40, 96, 32, True, True),  # head_dim 96 (the window's 96 channels padded to 128 lanes)
        (1, 1, 2, 70, 33, 256, 64, False, True),
        (2, 1, 4, 90, 40, 256, 32, True, True),  # two groups a plane: their columns of the metadata tiles
        (1, 2, 4, 80, 30, 128, 16, False, True),
        (1, 1, 4, 40, 33, 512, 128, True, False),
    ],
)
@pytest.mark.parametrize("win_split", [32, 128])  # window tokens per window program (32: the Gluon path's)
def test_decode_attention_kernel(small_splits, b, hk, m, n, w, d, g, mu, wmask, win_split):
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=n + w, mu=mu, wmask=wmask)
    args["start"] = torch.tensor([0, 17][:b])
    if n:
        args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
    got = loose(small_splits.decode_attention_triton)(**args, defaults=replace(SMALL, win_split=win_split))
    ref = loose(decode_attention_reference)(**args)
    assert got.shape == (b, hk, m, d) and got.dtype == torch.float32
    assert rel_err(got, ref) < 2e-5


@interp
@pytest.mark.parametrize("merge_block", [1, 2, 4])
def test_combine_merges_splits_in_several_blocks(small_splits, merge_block):
    """The combine kernel merges the split partials in blocks of ``merge_block`` with a running max (on the GPU:
    blocks of 64, and B=1 has 66 history splits): with blocks smaller than the split count, the online
    rescaling across blocks (history and window, history_partial and decode_attention) must equal the reference.
    The last history split holds keys with 30x scales (the largest logits), so a merge that kept the first
    block's max would overflow or lose the earlier blocks."""
    dt = small_splits
    df = replace(SMALL, merge_block=merge_block)
    b, hk, m, n, w, d, g = 2, 1, 4, 600, 300, 64, 32
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=merge_block)
    args["start"] = torch.tensor([0, 70])
    args["k"].scale[:, :, 540:560] *= 30  # large logits (of either sign) in the last history split
    assert wave_splits(n, b * hk, 16, 64, 64, df.max_waves, 2) > merge_block  # (D = 64: no register cap)
    got = loose(dt.decode_attention_triton)(**args, defaults=df)
    assert rel_err(got, loose(decode_attention_reference)(**args)) < 2e-5
    h = ("q_rot", "k", "v", "start", "key_mask", "qk_offset", "scaling", "group_size")
    hargs = {k: args[k] for k in h}
    assert_partials_close(dt.history_partial_triton(**hargs, defaults=df), history_partial_reference(**hargs, block_n=64),
                          5e-5)


@interp
@pytest.mark.parametrize("cblock", [16, 32])
@pytest.mark.parametrize(
    "b,hk,m,n,w,d,mu",
    [
        (2, 2, 4, 600, 70, 64, True),  # GQA 4, left padding, key mask, 3 window splits
        (1, 1, 8, 65, 320, 128, False),  # GQA 8, the paper's window (10 window splits of 32)
        (1, 2, 3, 0, 33, 64, True),  # no history yet
        (2, 1, 4, 100, 0, 128, True),  # no window
        (2, 1, 4, 300, 70, 96, True),  # head_dim 96: 6 or 3 chunks of R_V's rows, the partials' rows padded
    ],
)
def test_combine_hoisted_loads(monkeypatch, cblock, b, hk, m, n, w, d, mu):
    """The decode op's combine with its loads hoisted (the window partials and R_V's first chunk with the history
    partials, each next chunk ahead of its use, the window row's chunk picked by a masked sum), R_V in chunks of
    ``cblock`` rows (the GPU's choices for many or crowded rows), equals the reference; the last history split holds
    30x key scales (the largest logits)."""
    dt = _dt()
    _force_combine(monkeypatch, c_block=cblock, hoist=True)
    hoisted = []
    real = dt._combine_kernel
    monkeypatch.setattr(dt, "_combine_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (hoisted.append(kw["HOIST"]), real[grid](*a, **kw))[1])})())
    args, gen = _window_case(b, hk, m, n, w, d, 64 if d == 128 else 32, seed=n + w + m, mu=mu)
    args["start"] = torch.tensor([0, 17][:b])
    if n:
        args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
        args["k"].scale[:, :, n - 40:n - 20] *= 30
    got = loose(dt.decode_attention_triton)(**args, defaults=replace(SMALL, win_split=32))
    assert hoisted == [1], "the hoisted combine did not run"
    assert rel_err(got, loose(decode_attention_reference)(**args)) < 2e-5


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
    df = replace(SMALL, win_split=32, merge_out_parts=parts, splits_pow2_slack=0.5)
    monkeypatch.setattr(plan, "few_rows", lambda rows, device: True)
    real_shape = plan.combine_shape
    monkeypatch.setattr(plan, "combine_shape", lambda *a: real_shape(*a)._replace(
        hoist=bool(hoist), c_block=min(cblock or d, d // parts)))
    rounded = []
    real_round = plan.pow2_below_within
    monkeypatch.setattr(plan, "pow2_below_within",
                        lambda s_, slack: rounded.append(real_round(s_, slack)) or rounded[-1])
    grids = []
    real = dt._combine_kernel
    monkeypatch.setattr(dt, "_combine_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (grids.append((grid, kw["PARTS"], kw["HOIST"])), real[grid](*a, **kw))[1])})())
    args, gen = _window_case(b, hk, m, n, w, d, 64 if d == 128 else 32, seed=n + w + m + parts, mu=mu)
    args["start"] = torch.tensor([0, 17][:b])
    args["key_mask"] = torch.rand(b, 1, 1, n, generator=gen) > 0.1
    args["k"].scale[:, :, n - 40:n - 20] *= 30
    extra = {} if n_valid is None else {"n_valid": torch.tensor(n_valid)}
    got = loose(dt.decode_attention_triton)(**args, **extra, defaults=df)
    assert grids == [((b * hk * m * parts,), parts, hoist)], grids
    assert len(rounded) == 1 and rounded[0] & (rounded[0] - 1) == 0, rounded  # a power of two splits
    assert rel_err(got, loose(decode_attention_reference)(**args, **extra)) < 2e-5


@interp
@pytest.mark.parametrize("hoist", [True, False])
def test_combine_output_parts_head_dim_96(monkeypatch, hoist):
    """Head_dim 96 where rows are fewer than SMs: the plan's combine takes 3 programs a row of 32 output channels (a
    power-of-two chunk that divides 96, not 4 of 24), with the hoisted loads or not, and equals the reference."""
    dt = _dt()
    monkeypatch.setattr(plan, "few_rows", lambda rows, device: True)
    real_shape = plan.combine_shape
    monkeypatch.setattr(plan, "combine_shape", lambda *a: real_shape(*a)._replace(hoist=hoist))
    grids = []
    real = dt._combine_kernel
    monkeypatch.setattr(dt, "_combine_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (grids.append((grid, kw["PARTS"], kw["C_BLOCK"])), real[grid](*a, **kw))[1])})())
    args, gen = _window_case(2, 1, 4, 300, 70, 96, 32, seed=96)
    args["start"] = torch.tensor([0, 17])
    args["k"].scale[:, :, 260:280] *= 30
    got = loose(dt.decode_attention_triton)(**args, defaults=replace(SMALL, win_split=32))
    assert grids == [((2 * 1 * 4 * 3,), 3, 32)], grids
    assert rel_err(got, loose(decode_attention_reference)(**args)) < 2e-5


@interp
@pytest.mark.parametrize("n_valid", [0, 1, 150, 299])
def test_decode_attention_kernel_device_length(small_splits, n_valid):
    """Static cache: storage of capacity N, valid length read on the device, fixed split count:
    equals the reference over the first n_valid entries."""
    b, hk, m, n, w, d, g = 2, 2, 4, 300, 37, 64, 32
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=n_valid)
    args["start"] = torch.tensor([0, 9])
    got = loose(small_splits.decode_attention_triton)(**args, n_valid=torch.tensor(n_valid), splits=3, defaults=SMALL)
    ref = loose(decode_attention_reference)(**cut_history(args, n_valid))
    assert rel_err(got, ref) < 2e-5
    ref_masked = loose(decode_attention_reference)(**args, n_valid=torch.tensor(n_valid))
    assert rel_err(ref_masked, ref) < 1e-6


@interp
@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("b,hk,m,n,w,d,g", [(2, 2, 4, 150, 70, 64, 32), (1, 1, 8, 65, 320, 128, 64),
                                            (2, 1, 4, 100, 0, 128, 128), (1, 2, 3, 0, 33, 64, 64),
                                            (19, 2, 4, 40, 33, 64, 32),
                                            # the rotation's 3 column blocks of 32 at head_dim 96; K-blocked at 512
                                            (2, 1, 4, 90, 40, 96, 32), (1, 1, 2, 40, 20, 256, 64),
                                            (1, 1, 4, 40, 20, 512, 64)])
def test_decode_attention_rotating(small_splits, monkeypatch, fused, b, hk, m, n, w, d, g):
    """The op from the unrotated query (what the model's attention calls): the rotation launched by the op itself --
    as its own launch, or (the Gluon path's layout forced onto the split kernel's path) in one launch with the window
    programs (``_prologue_kernel``, which must then run whenever there are history and window) -- equals
    rotate-then-reference. B = 19: many rotation programs beside the window programs, and a per-sequence ``mu_K``
    (``key_offset="prefill"``)."""
    monkeypatch.setattr(plan, "fused_prologue", lambda gluon: bool(fused))
    args = _rotating_case(b, hk, m, n, w, d, g, seed=n + w)
    args["start"] = torch.tensor(([0, 17] * b)[:b])
    if b > 2:
        args["mu_k"] = torch.randn(b, hk, d, generator=torch.Generator().manual_seed(b)) * 0.5
    launches = []
    real = small_splits._prologue_kernel
    monkeypatch.setattr(small_splits, "_prologue_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: (launches.append(grid), real[grid])[1]})())
    got = rotating_op(args, defaults=SMALL)
    assert rel_err(got, _rotating_reference(args)) < 2e-5
    assert len(launches) == int(bool(fused and n and w)), launches


@interp
@pytest.mark.parametrize("case", ["eager", "rows", "static", "unsupported"])
def test_decode_attention_rotating_dispatch(monkeypatch, case):
    """The caches' call goes straight to one entry: the launcher from the unrotated query (eager, <= 16 query rows a
    KV head), the launcher from the torch rotation (17-64 rows, or a device-side length ``n_valid``: the compiled
    storage's read), or the torch reference (D = 32, which the kernels do not take); each equals the reference."""
    m, d, g, nv = {"eager": (4, 64, 32, None), "rows": (20, 64, 32, None), "static": (4, 64, 32, 150),
                   "unsupported": (4, 32, 16, None)}[case]
    args = _rotating_case(2, 2, m, 200, 37, d, g, seed=m + d)
    args["start"] = torch.tensor([0, 9])
    dt = _dt()
    calls = []
    real = dt.decode_attention_triton
    monkeypatch.setattr(dt, "decode_attention_triton", lambda *a, **kw: (
        calls.append("launch, rotating" if kw.get("rotated") is None else "launch"), real(*a, **kw))[1])
    extra = {} if nv is None else {"n_valid": torch.tensor(nv), "splits": 3}
    got = rotating(**args, **extra, use_kernels=True)
    want = {"eager": ["launch, rotating"], "rows": ["launch"], "static": ["launch"], "unsupported": []}[case]
    assert calls == want
    assert rel_err(got, _rotating_reference(args if nv is None else cut_history(args, nv))) < 2e-5


@interp
def test_decode_attention_kernel_property(small_splits):
    """Hypothesis: the fused Triton op equals the reference over random shapes (GQA 1-8, any history and
    window length, left padding of any row, head dims 64-128, 1-4 groups per row) and random values."""
    pytest.importorskip("hypothesis")  # (the GPU machine may lack it; this test runs under the interpreter)
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None)
    @given(b=st.integers(1, 3), hk=st.integers(1, 2), m=st.integers(1, 8), n=st.integers(0, 200),
           w=st.integers(0, 40), d=st.sampled_from([64, 128]), groups=st.sampled_from([1, 2, 4]),
           seed=st.integers(0, 2**16), pad=st.integers(0, 30))
    def prop(b, hk, m, n, w, d, groups, seed, pad):
        assume(n + w > 0)
        args, gen = _window_case(b, hk, m, n, w, d, d // groups, seed=seed)
        args["start"] = torch.randint(0, pad + 1, (b,), generator=gen).clamp(max=max(n - 1, 0))
        if w and args["win_mask"] is not None:
            args["win_mask"][..., -1] = True  # every row attends to at least its newest window token
        elif not w:
            args["start"].zero_()  # no window: every row keeps at least one history key
        assert small_splits.kernel_supported(args["q_rot"], args["k"], args["group_size"], None, args["win_mask"], w)
        got = loose(small_splits.decode_attention_triton)(**args, defaults=SMALL)
        ref = loose(decode_attention_reference)(**args)
        assert got.shape == (b, hk, m, d) and torch.isfinite(got).all()
        assert rel_err(got, ref) < 5e-5

    prop()


@interp
def test_decode_attention_reference_is_plain_attention():
    """The composed reference equals softmax over [history (dequantized, un-rotated, + mu) ; window]."""
    b, hk, m, n, w, d, g = 1, 2, 4, 40, 9, 64, 32
    args, _ = _window_case(b, hk, m, n, w, d, g, seed=4)
    ref = loose(decode_attention_reference)(**args).double()
    kh = dequantize_rows(args["k"], g, torch.float64)
    vh = dequantize_rows(args["v"], g, torch.float64)
    logits_h = (torch.einsum("bhmd,bhnd->bhmn", args["q_rot"].double(), kh) + args["qk_offset"].double()[..., None])
    v_back = torch.matmul(vh, args["r_v"].double().transpose(-1, -2).unsqueeze(0)) + args["mu_v"].double()[None, :, None]
    logits_w = torch.einsum("bhmd,bhnd->bhmn", args["q_win"].double(), args["k_win"].double())
    logits_w = logits_w.masked_fill(~args["win_mask"], -math.inf)
    p = torch.softmax(torch.cat([logits_h, logits_w], -1) * args["scaling"], -1)
    out = torch.einsum("bhmn,bhnd->bhmd", p, torch.cat([v_back, args["v_win"].double()], -2))
    assert rel_err(ref, out) < 1e-5


# ------------------------------------------------------------- attention sinks (gpt-oss) and soft-capping (Gemma 2)


def _dense_decode(args, softcap=None, sinks=None):
    """Independent float64 decode attention of a :func:`_window_case`: the dequantized history brought back to the value
    space and the window as one key set, the logits soft-capped, a sink column per row ``sinks [Hk, M]`` (value 0)."""
    q_rot, qf = args["q_rot"].double(), args["q_win"].double()
    kh = dequantize_rows(QuantizedRows(*args["k"]), args["group_size"], torch.float64)
    vh = dequantize_rows(QuantizedRows(*args["v"]), args["group_size"], torch.float64)
    r_v = args["r_v"].double()
    vh = torch.matmul(vh, r_v.transpose(-1, -2).unsqueeze(0)) + (0 if args["mu_v"] is None else args["mu_v"].double()[None, :, None])
    s = args["scaling"]
    logits_h = (torch.matmul(q_rot, kh.transpose(-1, -2)) + args["qk_offset"].double()[..., None]) * s
    logits_w = torch.matmul(qf, args["k_win"].double().transpose(-1, -2)) * s
    logits = torch.cat([logits_h, logits_w], -1)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    b, hk, m, n = logits_h.shape
    ok_h = (torch.arange(n)[None, :] >= args["start"][:, None])[:, None, None, :].expand(b, hk, m, n)
    if args["key_mask"] is not None:
        ok_h = ok_h & args["key_mask"]
    ok_w = torch.ones_like(logits_w, dtype=torch.bool) if args["win_mask"] is None else args["win_mask"].expand_as(logits_w)
    logits = logits.masked_fill(~torch.cat([ok_h, ok_w], -1), -math.inf)
    values = torch.cat([vh, args["v_win"].double()], 2)
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[None, :, :, None].expand(b, hk, m, 1)], -1)
        values = torch.cat([values, torch.zeros_like(values[:, :, :1])], 2)
    return torch.matmul(torch.softmax(logits, -1), values)


@pytest.mark.parametrize("softcap,sink", [(None, True), (3.0, False), (3.0, True)])
def test_reference_sinks_and_softcap_equal_dense_attention(softcap, sink):
    args, gen = _window_case(2, 2, 4, 150, 70, 64, 32, seed=5)
    args["start"] = torch.tensor([0, 17])
    args["key_mask"] = torch.rand(2, 1, 1, 150, generator=gen) > 0.1
    sinks = torch.randn(2, 4, generator=gen) * 3 + 2 if sink else None
    got = loose(decode_attention_reference)(**args, softcap=softcap, sinks=sinks)
    want = _dense_decode(args, softcap, sinks)
    assert rel_err(got, want) < 1e-5
    assert rel_err(loose(decode_attention_reference)(**args), want) > 1e-2  # the terms change the result


@interp
@pytest.mark.parametrize("hoist", [False, True])
@pytest.mark.parametrize("b,hk,m,n,w", [(2, 2, 4, 150, 70), (1, 2, 3, 0, 33), (2, 1, 4, 300, 320)])
def test_decode_attention_kernel_with_sinks(small_splits, monkeypatch, hoist, b, hk, m, n, w):
    """The sink as one more partial after the window's, merged by the combine (both of its window loops)."""
    if hoist:
        _force_combine(monkeypatch, hoist=True, c_block=16)
    args, gen = _window_case(b, hk, m, n, w, 64, 32, seed=n + w)
    sinks = torch.randn(hk, m, generator=gen) * 3 + 2
    got = loose(small_splits.decode_attention_triton)(**args, sinks=sinks, defaults=SMALL)
    ref = loose(decode_attention_reference)(**args, sinks=sinks)
    assert rel_err(got, ref) < 2e-5
    assert rel_err(got, loose(decode_attention_reference)(**args)) > 1e-3


@interp
@pytest.mark.parametrize("d,g,m,mag,softcap", [
    *((d, g, m, 1.0, cap) for d, g, m in ((128, 64, 4), (96, 32, 4), (64, 32, 20), (512, 128, 2))
      for cap in (None, 50.0, 5.0)),
    (128, 64, 4, 100.0, 50.0), (128, 64, 4, 100.0, 5.0)])
def test_decode_attention_kernel_softcap(small_splits, d, g, m, mag, softcap):
    """Gemma 2's logit soft-capping in the split kernel -- the history's deferred loop (D = 128, 512) and dequant loop
    (D = 96 with groups across planes, 20 query rows), the window programs -- and in the history's partials, against
    the references; a cap of 5 bites (the output moves), one of 50 barely. ``mag`` 100: logits of ~100-1000 (log2
    units), where tanh's exp2 form must neither overflow nor lose the sign."""
    args, gen = _window_case(2, 1, m, 150, 70, d, g, seed=d + m)
    args["start"] = torch.tensor([0, 17])
    args["key_mask"] = torch.rand(2, 1, 1, 150, generator=gen) > 0.1
    args["q_rot"], args["q_win"] = args["q_rot"] * mag, (args["q_win"].float() * mag).to(torch.bfloat16)
    got = loose(small_splits.decode_attention_triton)(**args, softcap=softcap, defaults=SMALL)
    ref = loose(decode_attention_reference)(**args, softcap=softcap)
    assert torch.isfinite(got).all() and rel_err(got, ref) < 2e-5
    h = {k: args[k] for k in ("q_rot", "k", "v", "start", "key_mask", "qk_offset", "scaling", "group_size")}
    assert_partials_close(small_splits.history_partial_triton(**h, softcap=softcap, defaults=SMALL),
                          history_partial_reference(**h, block_n=64, softcap=softcap), 5e-5)
    if softcap == 5.0:
        assert rel_err(ref, loose(decode_attention_reference)(**args)) > 2e-2  # the cap changes the result


@interp
@pytest.mark.parametrize("n_valid", [None, 0, 150])
def test_decode_attention_rotating_with_sinks_and_softcap(small_splits, monkeypatch, n_valid):
    """The dispatcher: sinks and soft-capping through the launcher, from the unrotated query (eager) and, with a
    device-side length, from the rotated one."""
    args = _rotating_case(2, 2, 4, 300, 70, 64, 32, seed=9)
    sinks = torch.randn(2, 4, generator=torch.Generator().manual_seed(2)) * 3 + 2
    calls = []
    real = small_splits.decode_attention_triton
    monkeypatch.setattr(small_splits, "decode_attention_triton",
                        lambda *a, **kw: (calls.append(("launch", kw.get("softcap"))), real(*a, **kw))[1])
    extra = {} if n_valid is None else {"n_valid": torch.tensor(n_valid), "splits": 4}
    for softcap in (None, 2.0):
        calls.clear()
        got = rotating(**args, **extra, use_kernels=True, sinks=sinks, softcap=softcap)
        ref = rotating(**args, **extra, use_kernels=False, sinks=sinks, softcap=softcap)
        assert rel_err(got, ref) < 2e-5
        assert calls == [("launch", softcap)]
