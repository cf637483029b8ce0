"""The retrieval heads' decode read (``kernels/heads_attention.py``): the torch reference against plain softmax
attention over the dequantized heads, and the Triton kernels against the reference under the Triton interpreter on the
CPU (float32 dot operands there, so tolerances are tight), for every stored form (INT8, INT4, 16 bits), host- and
device-side history bounds, window masks, left padding and empty rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_utils import heads_loose, rel_err, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels.heads_attention import (check_heads_args, dequantize_heads,  # noqa: E402
                                              heads_decode_attention, heads_decode_reference)
from oscar_hf.kernels.plan import KERNEL_HEAD_DIMS  # noqa: E402
from oscar_hf.quant import pack_int4, quantize_minmax  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


def encode(x: torch.Tensor, bits: int):
    if bits == 16:
        return (x,)
    q = quantize_minmax(x, bits, x.dtype)
    return (pack_int4(q.codes) if bits == 4 else q.codes, q.scale, q.zero)


def make_case(bits, b=3, hk=4, heads=(1, 3), m=3, n=150, w=40, d=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk, m, d, generator=gen).to(dtype)
    p = len(heads)
    k = encode(torch.randn(b, p, n, d, generator=gen).to(dtype) * 2 + 0.3, bits)
    v = encode(torch.randn(b, p, n, d, generator=gen).to(dtype), bits)
    win_k = torch.randn(b, hk, w, d, generator=gen).to(dtype)
    win_v = torch.randn(b, hk, w, d, generator=gen).to(dtype)
    win_mask = torch.rand(b, w, generator=gen) > 0.3
    lo = torch.tensor([0, 17, 90][:b])
    return q, torch.tensor(heads), k, v, lo, win_k, win_v, win_mask


def plain(q, heads, k, v, bits, lo, hi, win_k, win_v, win_mask, scaling):
    """Softmax over the concatenated dequantized history and window, one matmul each."""
    qh = q.index_select(1, heads).float()
    kh, vh = (dequantize_heads(s, bits) for s in (k, v))
    keys = torch.cat([kh, win_k.index_select(1, heads).float()], 2)
    vals = torch.cat([vh, win_v.index_select(1, heads).float()], 2)
    n = kh.shape[2]
    pos = torch.arange(n)
    ok_h = (pos[None] >= lo[:, None]) & (pos[None] < hi)
    ok = torch.cat([ok_h, win_mask if win_mask is not None else torch.ones_like(win_mask)], 1)[:, None, None]
    logits = (qh @ keys.transpose(-1, -2) * scaling).masked_fill(~ok, float("-inf"))
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return p @ vals


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("block_n", [16, 1024])
def test_reference_equals_plain_softmax(bits, block_n):
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, seed=bits)
    for hi in (120, torch.tensor(120)):
        out = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, hi, wk, wv, wm, 0.125, torch.float32, block_n)
        ref = plain(q, heads, k, v, bits, lo, 120, wk, wv, wm, 0.125)
        assert rel_err(out, ref) < 1e-5


def test_empty_rows_give_zero():
    q, heads, k, v, lo, wk, wv, wm = make_case(8)
    wm[1] = False
    lo = torch.tensor([0, 200, 0])  # row 1: no history either
    out = heads_loose(heads_decode_reference)(q, heads, k, v, 8, lo, 150, wk, wv, wm, 0.1, torch.float32)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and out[0].abs().sum() > 0


def test_bad_input_is_refused():
    q, heads, k, v, lo, wk, wv, wm = make_case(8)
    with pytest.raises(ValueError, match="4, 8 or 16"):
        check_heads_args(q, heads, k, v, 2, wk, wm)
    with pytest.raises(ValueError, match="columns"):
        check_heads_args(q, heads, k, v, 4, wk, wm)
    with pytest.raises(ValueError, match="window mask"):
        check_heads_args(q, heads, k, v, 8, wk, wm[:, :5])


@interp
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("d", KERNEL_HEAD_DIMS)  # 96: planes of 96 (INT4: 48) channels padded to 128 (64) lanes
@pytest.mark.parametrize("device_hi", [False, True])
def test_triton_matches_reference(bits, d, device_hi):
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, d=d, n=300 if d <= 128 else 100, seed=d + bits)
    n_hi = 250 if d <= 128 else 80
    hi = torch.tensor(n_hi) if device_hi else n_hi
    out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, hi, wk, wv, wm, 0.09, torch.float32, use_kernels=True)
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, n_hi, wk, wv, wm, 0.09, torch.float32)
    assert out.shape == (3, 2, 3, d)
    assert rel_err(out, ref) < 1e-5


@interp
def test_triton_no_mask_no_history_and_empty_row():
    q, heads, k, v, lo, wk, wv, wm = make_case(8, m=5, heads=(0,), seed=3)
    out = heads_loose(heads_decode_attention)(q, heads, k, v, 8, lo, 0, wk, wv, None, 0.2, torch.float32, use_kernels=True)
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, 8, lo, 0, wk, wv, None, 0.2, torch.float32)
    assert rel_err(out, ref) < 1e-5
    wm[2] = False
    lo = torch.tensor([0, 5, 150])
    out = heads_loose(heads_decode_attention)(q, heads, k, v, 8, lo, 150, wk, wv, wm, 0.2, torch.float32, use_kernels=True)
    assert (out[2] == 0).all() and torch.isfinite(out).all()
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, 8, lo, 150, wk, wv, wm, 0.2, torch.float32)
    assert rel_err(out, ref) < 1e-5


@interp
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("peak", ["late", "first"])
def test_triton_deferred_rerun_and_empty_splits(bits, peak):
    """The deferred history loop against the reference, 2 splits of 320: keys along the queries' common direction in
    each split's last block (``late``: logits past the first block's by far more than ``DEFER_LIMIT``: the split
    reruns, else exp2 overflows) or in split 1's first block and ~8 nats lower in its last (``first``); row 1's split
    0 empty, its split 1 left-padded past that first key; row 2 empty."""
    import oscar_hf.kernels.heads_triton as ht

    q, heads, k, v, _, wk, wv, wm = make_case(16, n=640, d=64, seed=bits)
    u = torch.ones(64) / 8
    q, big = q + 4 * u, {"late": {313: 500.0, 633: 500.0}, "first": {323: 500.0, 633: 480.0}}[peak]
    for slot, c in big.items():  # (q . u ~ 4: logits of 0.1 * 4c nats, > 128 in log2 units above the rest)
        k[0][:, :, slot] += c * u
    k, v, lo, wm[2] = encode(k[0], bits), encode(v[0], bits), torch.tensor([0, 360, 640]), False
    args = (q, heads, k, v, bits, lo, 640, wk, wv, wm, 0.1, torch.float32)
    out = heads_loose(ht.heads_decode_triton)(*args)
    assert rel_err(out, heads_loose(heads_decode_reference)(*args)) < 1e-5 and (out[2] == 0).all()
    if peak == "late":  # without the rerun the late blocks' p overflow
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ht, "DEFER_LIMIT", ht.tl.constexpr(1e9))
            assert not torch.isfinite(heads_loose(ht.heads_decode_triton)(*args)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("d", [128, 96, 512])
def test_gpu_kernel_matches_reference_at_real_shapes(bits, d):
    """Qwen3-8B's shape (8 KV heads of 128, 4 query heads each; and head_dims 96, 512), B = 8, 8K slots, two coded
    heads, bf16: the compiled kernels (bf16 operands) against the float32 reference, with the history bound on the
    device (CUDA graphs); with a sink, and with soft-capped logits."""
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, b=8, hk=8, heads=(2, 6), m=4, n=8192, w=385, d=d,
                                               dtype=torch.bfloat16, seed=bits)
    lo = torch.tensor([0, 17, 90, 0, 5, 4000, 8000, 8191])
    args = [x.cuda() for x in (q, heads)], [tuple(x.cuda() for x in s) for s in (k, v)]
    (q, heads), (k, v) = args
    lo, wk, wv, wm = lo.cuda(), wk.cuda(), wv.cuda(), wm.cuda()
    out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, torch.tensor(8000, device="cuda"), wk, wv, wm,
                                 d ** -0.5, torch.float32)
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 8000, wk, wv, wm, d ** -0.5, torch.float32)
    assert rel_err(out, ref) < 2e-2
    # gpt-oss's s_aux by query row: the combine's last partial. Drawn from a seeded generator: the global CUDA one
    # depends on what the worker ran before, and one such draw moved the output by only 0.4% (an H100 run, 12 workers)
    sinks = (torch.randn(2, 4, generator=torch.Generator().manual_seed(0)) * 3 + 2).cuda()
    out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, torch.tensor(8000, device="cuda"), wk, wv, wm,
                                 d ** -0.5, torch.float32, sinks=sinks)
    ref_s = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 8000, wk, wv, wm, d ** -0.5, torch.float32, sinks=sinks)
    # (the sink moves this case's output by 13-17% on the CPU reference: the kernel must land well inside it)
    assert rel_err(out, ref_s) < min(2e-2, rel_err(ref_s, ref) / 4)
    # soft-capping (Gemma 2) at a cap that bites: the kernel caps, host-side bound (eager) and device-side
    for hi in (8000, torch.tensor(8000, device="cuda")):
        out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, hi, wk, wv, wm, d ** -0.5 * 4, torch.float32,
                                     softcap=5.0)
        ref_c = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 8000, wk, wv, wm, d ** -0.5 * 4, torch.float32,
                                       softcap=5.0)
        ref_u = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 8000, wk, wv, wm, d ** -0.5 * 4, torch.float32)
        assert rel_err(out, ref_c) < 2e-2 and rel_err(ref_c, ref_u) > 5e-2


def paged(parts, page: int, num_pages: int, seed: int = 0):
    """A contiguous store ``[B, P, N, X]`` scattered into ``num_pages`` pages of ``page`` slots in random order: the
    pages ``[num_pages, P, page, X]`` and the block table ``[B, N / page]`` (int32; one unused -1 entry per row)."""
    b, p, n, _ = parts[0].shape
    per_row = n // page
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: b * per_row]
    table = torch.full((b, per_row + 1), -1, dtype=torch.int32)
    table[:, :per_row] = order.view(b, per_row).int()
    out = []
    for x in parts:
        pages = torch.zeros(num_pages, p, page, x.shape[-1], dtype=x.dtype)
        pages[order] = x.view(b, p, per_row, page, -1).transpose(1, 2).reshape(b * per_row, p, page, -1)
        out.append(pages)
    return tuple(out), table


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_paged_reference_reads_the_contiguous_rows(bits):
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, n=160, seed=5)
    (kp, table), (vp, _) = paged(k, 32, 20), paged(v, 32, 20)
    hi = torch.tensor([160, 45, 100])  # one bound per row (the serving store's rows differ in length)
    out = heads_loose(heads_decode_reference)(q, heads, kp, vp, bits, lo, hi, wk, wv, wm, 0.1, torch.float32, block_table=table)
    for r in range(3):
        ref = heads_loose(heads_decode_reference)(q[r : r + 1], heads, tuple(x[r : r + 1] for x in k),
                                     tuple(x[r : r + 1] for x in v), bits, lo[r : r + 1], int(hi[r]), wk[r : r + 1],
                                     wv[r : r + 1], wm[r : r + 1], 0.1, torch.float32)
        assert rel_err(out[r : r + 1], ref) < 1e-6


@interp
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_triton_paged_matches_reference(bits):
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, n=256, d=64, seed=7)
    lo = torch.zeros(3, dtype=torch.long)
    (kp, table), (vp, _) = paged(k, 32, 40, seed=1), paged(v, 32, 40, seed=1)
    hi = torch.tensor([256, 70, 0], dtype=torch.int32)
    out = heads_loose(heads_decode_attention)(q, heads, kp, vp, bits, lo, hi, wk, wv, wm, 0.1, torch.float32, use_kernels=True,
                                 block_table=table, max_len=256)
    ref = heads_loose(heads_decode_reference)(q, heads, kp, vp, bits, lo, hi, wk, wv, wm, 0.1, torch.float32, block_table=table)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="block table"):
        heads_loose(heads_decode_attention)(q, heads, kp, vp, bits, lo, hi, wk, wv, wm, 0.1, block_table=table[:2])


@pytest.mark.parametrize("pairs,n,m", [(8, 37_000, 4), (1, 100_000, 4), (64, 4096, 3), (8, 0, 4), (2, 100, 33)])
def test_plan_covers_the_history_in_whole_blocks(pairs, n, m):
    """The launch plan is host code (no Triton): its splits cover the history exactly once, in whole blocks, with no
    empty split; the query tile is a power of two of at least 16 rows."""
    from oscar_hf.kernels.plan import heads_plan

    p = heads_plan(pairs, n, m, torch.device("cpu"))
    assert p.m_pad >= max(16, m) and p.m_pad & (p.m_pad - 1) == 0
    if n == 0:
        assert p.splits == 0
        return
    assert p.split_len % p.block_n == 0 and p.splits * p.split_len >= n > (p.splits - 1) * p.split_len


@interp
def test_triton_in_row_chunks_matches_one_launch(monkeypatch):
    """A store past the kernel's 32-bit element offsets is read in row chunks: the same output (one row a chunk
    here, with the limit lowered)."""
    import oscar_hf.kernels.heads_triton as ht

    q, heads, k, v, lo, wk, wv, wm = make_case(8, n=100, seed=9)
    hi = torch.tensor([100, 60, 100])
    whole = heads_loose(ht.heads_decode_triton)(q, heads, k, v, 8, lo, hi, wk, wv, wm, 0.1, torch.float32)
    launches = []
    kernel = ht._heads_split_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(ht, "_heads_split_kernel", Counted())
    monkeypatch.setattr(ht, "OFFSET_LIMIT", k[0].stride(0) + 1)
    chunked = heads_loose(ht.heads_decode_triton)(q, heads, k, v, 8, lo, hi, wk, wv, wm, 0.1, torch.float32)
    assert len(launches) == 3
    assert rel_err(chunked, whole) < 1e-6


@pytest.mark.parametrize("bits", [8, 16])
def test_sinks_and_softcap_reference_equal_plain_softmax(bits):
    """A sink (``[P, M]`` logits of a zero-valued key) and soft-capped logits, against the dense softmax."""
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, seed=4)
    sinks = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)) * 3 + 2
    qh = q.index_select(1, heads).float()
    kh, vh = (dequantize_heads(s, bits) for s in (k, v))
    keys = torch.cat([kh, wk.index_select(1, heads).float()], 2)
    vals = torch.cat([vh, wv.index_select(1, heads).float(), torch.zeros_like(vh[:, :, :1])], 2)
    pos = torch.arange(kh.shape[2])
    ok = torch.cat([(pos[None] >= lo[:, None]) & (pos[None] < 120), wm], 1)[:, None, None]
    logits = torch.tanh(qh @ keys.transpose(-1, -2) * 0.2 / 2.5) * 2.5
    logits = torch.cat([logits.masked_fill(~ok, float("-inf")), sinks[None, :, :, None].expand(3, 2, 3, 1)], -1)
    want = torch.softmax(logits, -1) @ vals
    got = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 120, wk, wv, wm, 0.2, torch.float32, softcap=2.5, sinks=sinks)
    assert rel_err(got, want) < 1e-5
    plain_out = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 120, wk, wv, wm, 0.2, torch.float32)
    assert rel_err(got, plain_out) > 1e-2


@interp
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("softcap", [None, 50.0, 5.0])
@pytest.mark.parametrize("d", [96, 128])
def test_triton_with_softcap_matches_reference(monkeypatch, bits, softcap, d):
    """Soft-capped logits (Gemma 2) in the heads' kernel, history (every stored form) and window, through the
    dispatcher (which takes the launcher: the spy), against the reference; a cap of 5 bites."""
    import oscar_hf.kernels.heads_triton as ht

    q, heads, k, v, lo, wk, wv, wm = make_case(bits, d=d, n=200, seed=d + bits)
    launches = []
    real = ht.heads_decode_triton
    monkeypatch.setattr(ht, "heads_decode_triton", lambda *a, **kw: (launches.append(kw.get("softcap")),
                                                                     real(*a, **kw))[1])
    scaling = d ** -0.5 * 4  # logits of a few units: a cap of 5 changes them
    out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, 150, wk, wv, wm, scaling, torch.float32, use_kernels=True,
                                 softcap=softcap)
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 150, wk, wv, wm, scaling, torch.float32, softcap=softcap)
    assert launches == [softcap] and rel_err(out, ref) < 1e-5
    if softcap == 5.0:
        plain_out = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 150, wk, wv, wm, scaling, torch.float32)
        assert rel_err(ref, plain_out) > 2e-2


@interp
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("device_hi", [False, True])
def test_triton_with_sinks_matches_reference(bits, device_hi):
    q, heads, k, v, lo, wk, wv, wm = make_case(bits, n=300, seed=bits)
    sinks = torch.randn(2, 3, generator=torch.Generator().manual_seed(bits)) * 3 + 2
    hi = torch.tensor(250) if device_hi else 250
    out = heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, hi, wk, wv, wm, 0.09, torch.float32, use_kernels=True,
                                 sinks=sinks)
    ref = heads_loose(heads_decode_reference)(q, heads, k, v, bits, lo, 250, wk, wv, wm, 0.09, torch.float32, sinks=sinks)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="sinks"):
        heads_loose(heads_decode_attention)(q, heads, k, v, bits, lo, hi, wk, wv, wm, 0.09, sinks=sinks[:1])


@interp
@pytest.mark.parametrize("mode", ["whole", "device_length", "paged", "two_heads_sinks", "rotated"])
def test_decode_reads_the_int2_heads_window_in_place(monkeypatch, mode):
    """A layer with a retrieval head (KV head 1 of 4): the INT2 heads' launch reads the layer's whole window at their
    own KV heads (``Window.kv_heads``, no copy of the window) and writes their rows straight into the layer's output,
    its combine the retrieval head's rows beside them from their split launch's partials (the heads' own combine
    never runs) -- equal to the references, which copy the INT2 heads' window out (``Window.gathered``), for the whole
    history, the compiled storage's device-side length, the paged pool (whose window pool both reads take in place
    by slot, the slots reversed against the rows), two retrieval heads with attention sinks, and the compiled
    step's pre-rotated query (whose window programs read the layer's query rows in place too). Every KV head's window
    and query differ, so a head read at another head's place would not match."""
    from oscar_hf.kernels import heads_triton
    from oscar_hf.kernels.decode import decode
    from oscar_hf.kernels.kv import HeadSplit, History, KVParams, Pages, Window
    from oscar_hf.quant import encode_heads, quantize_rows

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the retrieval heads' own combine ran beside the INT2 heads' combine")

    monkeypatch.setattr(heads_triton, "_heads_combine_kernel", Refused())
    b, hk, m, n, w, d, g = 2, 4, 3, 96, 24, 64, 32
    gen = torch.Generator().manual_seed(7)
    int2_idx, coded_idx, coded_of = torch.tensor([0, 2, 3]), torch.tensor([1]), torch.tensor([-1, 0, -1, -1])
    if mode == "two_heads_sinks":
        int2_idx, coded_idx, coded_of = torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([-1, 0, -1, 1])
    h2, p = int2_idx.numel(), coded_idx.numel()
    split = HeadSplit(int2_idx, coded_idx, coded_of, 8)
    rot = torch.linalg.qr(torch.randn(h2, d, d, generator=gen))[0]
    params = KVParams(rot, None, rot.transpose(-1, -2).contiguous(), None, g, heads=split)
    q = torch.randn(b, hk, m, d, generator=gen)
    win_k = torch.randn(b, hk, w, d, generator=gen) + torch.arange(hk).view(1, hk, 1, 1)  # each head its own
    win_v = torch.randn(b, hk, w, d, generator=gen) - torch.arange(hk).view(1, hk, 1, 1)
    hist_k, hist_v = (quantize_rows(torch.randn(b, h2, n, d, generator=gen), g, 1.0, torch.bfloat16) for _ in "kv")
    coded = tuple(encode_heads(torch.randn(b, p, n, d, generator=gen), 8) for _ in "kv")
    mask = torch.ones(b, 1, 1, w, dtype=torch.bool)
    mask[1, ..., :5] = False
    window = Window(win_k, win_v, mask)
    history = History(hist_k, hist_v, torch.tensor([0, 9]), n_valid=torch.tensor(n), coded=coded)
    sinks = None
    if mode == "device_length":  # (the compiled storage's grid: fixed splits over the capacity)
        history = dataclasses.replace(history, n_valid=torch.tensor(80), splits=2)
    elif mode == "paged":  # one page per row of the whole history, the window pool's slots reversed
        pages = Pages(torch.arange(b, dtype=torch.int32).view(b, 1), torch.tensor([n, 70], dtype=torch.int32))
        history = History(hist_k, hist_v, pages=pages, coded=coded)  # (page b: row b's whole history)
        window = Window(win_k.flip(0), win_v.flip(0), mask[:, 0, 0], torch.arange(b).flip(0))
    elif mode == "two_heads_sinks":
        sinks = torch.randn(hk, m, generator=gen) * 3
    rotated = None
    if mode == "rotated":  # (the compiled step: the INT2 heads' query rotated outside the op, a device-side length)
        from oscar_hf.kernels.int2_attention import rotate_query_reference
        history = dataclasses.replace(history, n_valid=torch.tensor(80), splits=2)
        rotated = rotate_query_reference(q.index_select(1, int2_idx), rot, None)
    got = decode(params, q, window, history, 0.1, torch.float32, sinks=sinks, rotated=rotated, use_kernels=True)
    want = decode(params, q, window, history, 0.1, torch.float32, sinks=sinks, rotated=rotated, use_kernels=False)
    assert got.shape == (b, hk, m, d)
    assert rel_err(got, want) < 2e-5
    # the window of the INT2 heads, copied out only where a reference reads it
    lazy = window.heads(int2_idx)
    assert lazy.k is window.k and torch.equal(lazy.gathered().k, window.rows().k.index_select(1, int2_idx))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("side_stream", [True, False])
def test_gpu_decode_with_heads_replays_in_a_graph(monkeypatch, side_stream):
    """A layer of the Qwen3-8B shape with a retrieval head (KV head 3 of 8), 4K of history: the retrieval heads' read
    on its side stream (forked and joined inside :func:`decode`, ``HeadsDefaults.side_stream``) or on the layer's
    stream, eager and replayed from a CUDA graph, equals the reference; a replay after the query changed in place
    follows the new query (the join orders the coded rows before the output is read)."""
    from oscar_hf.kernels import settings
    from oscar_hf.kernels.decode import decode
    from oscar_hf.kernels.kv import HeadSplit, History, KVParams, Window
    from oscar_hf.quant import encode_heads, quantize_rows

    monkeypatch.setattr(settings, "HEADS_DEFAULTS", dataclasses.replace(settings.HEADS_DEFAULTS,
                                                                        side_stream=side_stream))
    b, hk, m, n, w, d, g = 2, 8, 4, 4096, 320, 128, 64
    gen = torch.Generator().manual_seed(3)
    int2_idx, coded_idx = torch.tensor([0, 1, 2, 4, 5, 6, 7]), torch.tensor([3])
    split = HeadSplit(int2_idx.cuda(), coded_idx.cuda(), torch.tensor([-1, -1, -1, 0, -1, -1, -1, -1]).cuda(), 8)
    rot = torch.linalg.qr(torch.randn(7, d, d, generator=gen))[0].cuda()
    params = KVParams(rot, None, rot.transpose(-1, -2).contiguous(), None, g, heads=split)
    hist = [quantize_rows(torch.randn(b, 7, n, d, generator=gen).cuda(), g, 1.0, torch.bfloat16) for _ in "kv"]
    coded = tuple(encode_heads(torch.randn(b, 1, n, d, generator=gen).cuda(), 8) for _ in "kv")
    win = [torch.randn(b, hk, w, d, generator=gen).cuda().bfloat16() for _ in "kv"]
    window = Window(*win, None)
    history = History(*hist, torch.tensor([0, 100]).cuda(), n_valid=torch.tensor(n, device="cuda"), coded=coded)
    q = torch.randn(b, hk, m, d, generator=gen).cuda().bfloat16()
    want = decode(params, q, window, history, 0.088, torch.float32, use_kernels=False)
    assert rel_err(decode(params, q, window, history, 0.088, torch.float32), want) < 2e-2
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = decode(params, q, window, history, 0.088, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, want) < 2e-2
    q.copy_(torch.randn(b, hk, m, d, generator=gen).cuda().bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, decode(params, q, window, history, 0.088, torch.float32, use_kernels=False)) < 2e-2
    assert rel_err(out, want) > 0.1


def test_the_launcher_refuses_partials_or_an_in_place_query_it_cannot_place():
    """The retrieval heads' partials without the layer's output buffer (or of other rows), and a query read at the
    window's KV heads without a rotated query or those heads: a clear error before any launch."""
    from oscar_hf.kernels.decode_triton import decode_attention_triton
    from oscar_hf.kernels.kv import CodedPartials, History, KVParams, Window
    from oscar_hf.quant import quantize_rows

    b, hk, m, n, w, d = 2, 3, 4, 64, 8, 64
    rot = torch.eye(d).expand(hk, d, d).contiguous()
    params = KVParams(rot, None, rot, None, 32)
    q = torch.randn(b, hk, m, d)
    hist = History(*(quantize_rows(torch.randn(b, hk, n, d), 32, 1.0, torch.bfloat16) for _ in "kv"))
    win = Window(torch.randn(b, hk + 1, w, d), torch.randn(b, hk + 1, w, d), kv_heads=torch.tensor([0, 1, 3]))
    out = torch.empty(b, hk + 1, m, d)
    parts = CodedPartials(torch.zeros(b, 5, 16), torch.zeros(b, 5, 16), torch.zeros(b, 5, 16, d), torch.tensor([2]))
    with pytest.raises(ValueError, match="partials need an output buffer"):
        decode_attention_triton(params, q, win, hist, 0.1, coded=parts)
    bad = parts._replace(acc=torch.zeros(b + 1, 5, 16, d))
    with pytest.raises(ValueError, match="partials need an output buffer"):
        decode_attention_triton(params, q, win, hist, 0.1, out=out, coded=bad)
    with pytest.raises(ValueError, match="q_at_kv_heads"):
        decode_attention_triton(params, q, win, hist, 0.1, out=out, q_at_kv_heads=True)
    with pytest.raises(ValueError, match="q_at_kv_heads"):
        decode_attention_triton(params, q, Window(win.k, win.v), hist, 0.1, q_at_kv_heads=True,
                                rotated=(q.float(), None))
