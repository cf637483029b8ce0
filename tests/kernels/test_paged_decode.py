"""Decode attention over the paged INT2 pool (``kernels/paged_decode.py``): the torch reference against the contiguous
path's reference, and the split kernel's ``PAGED`` mode against the reference -- under the Triton interpreter on the
CPU (float32 dot operands: tight tolerances) and, where CUDA is present, the compiled kernels (bf16 tolerances).

The cases are filled through a real :class:`~oscar_hf.serving.pool.PagedInt2Pool` (``rotate_quantize`` + ``pool.write``):
rows of different history lengths (0, and not multiples of the page or the block), shuffled page ids, the other
layer's pages holding other data, unused pages and page tails holding NaN metadata (never read), unused block-table
entries -1, window slots permuted, window masks with holes.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_utils import HAS_CUDA, loose, paged, paged_reference, paged_triton, random_rotation, rel_err, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels import paged_decode as pd  # noqa: E402
from oscar_hf.kernels import plan  # noqa: E402
from oscar_hf.kernels.int2_attention import decode_attention_reference, rotate_query_reference  # noqa: E402
from oscar_hf.kernels.kv import History, KVParams, Window  # noqa: E402
from oscar_hf.kernels.plan import DEFAULTS, triton_importable  # noqa: E402
from oscar_hf.kernels.write_path import rotate_quantize  # noqa: E402
from oscar_hf.quant import QuantizedRows  # noqa: E402
from oscar_hf.serving.pool import PagedInt2Pool  # noqa: E402

if triton_importable():  # the op (decode_triton) launches the kernels it bound at import: tests patch them there
    from oscar_hf.kernels import decode_triton

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]
LAYER = 1  # the layer read; layer 0 of the same pages holds other data
# small splits on the CPU (the grid then has several history splits, empty ones for the short rows)
SMALL = replace(DEFAULTS, min_split=16, win_split=32)


def _cdiv(a, b):
    return -(-a // b)


def paged_case(b, hk, m, d, g, page, lens, w, mu, seed, device="cpu"):
    """A batch of ``len(lens)`` rows in a pool of ``page``-entry pages: the op's keyword arguments, and the rows'
    histories as written (``[1, Hk, L, *]`` QuantizedRows per row, for the contiguous comparison)."""
    gen = torch.Generator().manual_seed(seed)
    r_k, r_v = random_rotation(hk, d, gen), random_rotation(hk, d, gen)
    mu_k = torch.randn(hk, d, generator=gen) * 0.5 if mu else None
    mu_v = torch.randn(hk, d, generator=gen) * 0.3 if mu else None
    used = [_cdiv(n, page) for n in lens]
    num_pages = sum(used) + 3  # + pages no row holds
    pool = PagedInt2Pool(num_pages, 2, hk, d, page, g, torch.bfloat16, device=device)
    pool.scale.fill_(float("nan"))  # storage nobody wrote: must never be read
    pool.zero.fill_(float("nan"))
    ids = torch.randperm(num_pages, generator=gen).tolist()  # shuffled, non-contiguous page ids
    tables, pos = [], 0
    for u in used:
        tables.append(ids[pos : pos + u])
        pos += u
    max_pages = max(used) + 1
    block_table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    written = []
    for row, n in enumerate(lens):
        block_table[row, : used[row]] = torch.tensor(tables[row], dtype=torch.int32)
        rows = {}
        for layer in (0, 1):
            for kind, r, mu_, clip, scale in (("k", r_k, mu_k, 0.96, 2.0), ("v", r_v, mu_v, 0.92, 1.0)):
                x = (torch.randn(1, hk, n, d, generator=gen) * scale).to(torch.bfloat16).to(device)
                q = rotate_quantize(x, r.to(device), None if mu_ is None else mu_.to(device), clip, g, torch.bfloat16)
                if n:
                    pool.write(tables[row], layer, kind, 0, q)
                rows[(layer, kind)] = q
        written.append((rows[(LAYER, "k")], rows[(LAYER, "v")]))
    num_slots = len(lens) + 2
    win_k = (torch.randn(num_slots, hk, w, d, generator=gen) * 2).to(torch.bfloat16)
    win_v = torch.randn(num_slots, hk, w, d, generator=gen).to(torch.bfloat16)
    win_slot = torch.randperm(num_slots, generator=gen)[: len(lens)]
    win_mask = torch.rand(len(lens), w, generator=gen) > 0.3
    qf = torch.randn(len(lens), hk, m, d, generator=gen)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = dict(
        qf=mv(qf), r_k=mv(r_k), mu_k=mv(mu_k),
        pages_k=QuantizedRows(pool.codes[:, LAYER, 0], pool.scale[:, LAYER, 0], pool.zero[:, LAYER, 0]),
        pages_v=QuantizedRows(pool.codes[:, LAYER, 1], pool.scale[:, LAYER, 1], pool.zero[:, LAYER, 1]),
        block_table=mv(block_table), hist_len=mv(torch.tensor(lens, dtype=torch.int32)),
        win_k=mv(win_k), win_v=mv(win_v), win_slot=mv(win_slot), win_mask=mv(win_mask),
        r_v=mv(r_v), mu_v=mv(mu_v), scaling=d**-0.5, group_size=g, out_dtype=torch.float32,
    )
    return args, written


# ---------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("page,lens,mu", [(16, (37, 0, 5, 50), True), (8, (9, 24, 1), False)])
def test_reference_equals_contiguous_reference(page, lens, mu):
    """Row by row, the paged reference is the contiguous decode reference over the row's history as written (here all
    rows at once: left-padded to the longest, ``start`` = the padding) and the row's window slot."""
    b, hk, m, d, g, w = len(lens), 2, 4, 64, 32, 20
    args, written = paged_case(b, hk, m, d, g, page, lens, w, mu, seed=page)
    got = paged_reference(**args)
    n = max(lens)

    def padded(i):  # [B, Hk, N, *]: row b's entries at [N - L_b, N)
        out = []
        for t in zip(*(wr[i] for wr in written)):
            full = torch.zeros(b, hk, n, t[0].shape[-1], dtype=t[0].dtype)
            for row, x in enumerate(t):
                full[row, :, n - x.shape[2] :] = x[0]
            out.append(full)
        return QuantizedRows(*out)

    q_rot, qk_off = rotate_query_reference(args["qf"], args["r_k"], args["mu_k"])
    slot = args["win_slot"]
    ref = loose(decode_attention_reference)(
        q_rot, padded(0), padded(1), torch.tensor([n - x for x in lens]), None, qk_off, args["scaling"], g,
        args["qf"], args["win_k"][slot], args["win_v"][slot], args["win_mask"][:, None, None, :], args["r_v"],
        args["mu_v"], out_dtype=torch.float32)
    assert got.shape == (b, hk, m, d)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-5


def rowwise_reference(qf, r_k, mu_k, pages_k, pages_v, block_table, hist_len, win_k, win_v, win_slot, win_mask, r_v,
                      mu_v, scaling, group_size, out_dtype):
    """Row by row: each row's history gathered to its own length and read by the contiguous reference."""
    params, outs = KVParams(r_k, mu_k, r_v, mu_v, group_size), []
    for b, (n, slot) in enumerate(zip(hist_len.tolist(), win_slot.tolist())):
        k, v = (pd.gather_rows(x, block_table[b : b + 1], n) for x in (pages_k, pages_v))
        window = Window(win_k[slot : slot + 1], win_v[slot : slot + 1], win_mask[b].view(1, 1, 1, -1))
        outs.append(decode_attention_reference(params, qf[b : b + 1], window,
                                               History(k, v, torch.zeros(1, dtype=torch.long)), scaling, out_dtype))
    return torch.cat(outs, 0)


@pytest.mark.parametrize("page,lens,mu", [(16, (37, 0, 5, 50), True), (8, (9, 24, 1), False)])
def test_batched_reference_equals_the_reference(page, lens, mu):
    """The batched torch path (what the serving store's decode step runs off CUDA, and what a CUDA graph may capture:
    every row gathered to a host bound, no host sync) equals the row-by-row reference, at the exact longest history
    and at a larger bound (a graphed step's bucket), with NaN in the storage past each row's entries."""
    args, _ = paged_case(len(lens), 2, 4, 64, 32, page, lens, 20, mu, seed=page + 1)
    ref = rowwise_reference(**args)
    wide = dict(args, block_table=torch.nn.functional.pad(args["block_table"], (0, 2), value=-1))
    for bound, a in ((max(lens), args), (max(lens) + 2 * page, wide)):
        got = paged(**a, use_kernels=False, max_hist_len=bound)
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < 1e-6


def test_reference_rejects_bad_shapes():
    args, _ = paged_case(2, 1, 2, 64, 32, 16, (5, 20), 8, False, seed=0)
    with pytest.raises(ValueError, match="win_mask"):
        paged(**{**args, "win_mask": args["win_mask"][:, :4]})
    with pytest.raises(ValueError, match="block_table"):
        paged(**{**args, "block_table": args["block_table"][:1]})
    with pytest.raises(ValueError, match="pages_v"):
        v = args["pages_v"]
        paged(**{**args, "pages_v": QuantizedRows(v.codes[:, :, :, :8], v.scale, v.zero)})


# --------------------------------------------------------------------------------- Triton path vs the reference


@pytest.fixture
def many_sms(monkeypatch):
    """16 SMs assumed on the CPU (4 otherwise): more history splits per row for the wave model."""
    monkeypatch.setattr(plan, "device_sms", lambda device: 16)


def _run_kernel(monkeypatch, args, device):
    """The Triton path (the small-split defaults on the CPU), and the split kernel's grid it launched."""
    grids = []
    real = decode_triton._split_kernel
    monkeypatch.setattr(decode_triton, "_split_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (grids.append((grid, kw["PAGED"], kw["DEFERRED"], kw["BLOCK_N"])), real[grid](*a, **kw))[1])})())
    df = SMALL if device == "cpu" else DEFAULTS
    out = paged_triton(**args, defaults=df)
    return out, grids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "d,g,m,page,lens,w,mu,loop",
    [
        (64, 64, 1, 16, (37, 0, 5, 50), 20, False, "deferred"),  # G = D, MHA, blocks of one page (16)
        (64, 32, 4, 32, (0, 70, 33), 12, True, "deferred"),  # G = D/2, GQA 4, blocks of 32 = a page
        (128, 64, 4, 16, (21, 48, 0), 40, True, "deferred"),  # D = 128
        (128, 128, 1, 32, (45, 3), 8, False, "deferred"),  # D = 128, G = D
        (64, 32, 4, 24, (130, 0, 23), 16, True, "deferred"),  # P = 24: a block spans pages (one table load a token)
        (128, 64, 4, 8, (19, 140), 24, True, "deferred"),  # P = 8 < 16: 8 pages a block
        (128, 16, 4, 16, (40, 17), 16, True, "dequant"),  # G < D/4: the dequant loop
        (64, 32, 20, 16, (30, 0, 45), 16, False, "dequant"),  # M = 20 > 16: dequant loop, torch rotation
    ],
)
def test_paged_kernel_matches_reference(monkeypatch, many_sms, device, d, g, m, page, lens, w, mu, loop):
    hk = 2
    args, _ = paged_case(len(lens), hk, m, d, g, page, lens, w, mu, seed=d + g + m + page, device=device)
    ref = paged_reference(**args)
    got, grids = _run_kernel(monkeypatch, args, device)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    [(grid, paged, deferred, block_n)] = grids
    assert paged == 1 and deferred == int(loop == "deferred")
    if device == "cpu":  # several history splits, so the short rows have empty ones
        assert grid[1] - _cdiv(w, SMALL.win_split) >= 2, grid
        assert rel_err(got, ref) < 2e-5
    else:
        assert rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_paged_kernel_edge_rows(monkeypatch, many_sms, device):
    """Rows without history and with an all-masked window give 0; a row whose window is all masked attends to its
    history only; every row of a batch without any history (window only); the table sized exactly (no spare
    column: the longest row's last page is the table's last entry)."""
    args, _ = paged_case(3, 1, 4, 64, 32, 16, (0, 32, 7), 10, True, seed=3, device=device)
    args["win_mask"][0] = False
    args["win_mask"][1] = False
    args["block_table"] = args["block_table"][:, :2].contiguous()
    ref = paged_reference(**args)
    got, _ = _run_kernel(monkeypatch, args, device)
    assert (got[0] == 0).all() and (ref[0] == 0).all()
    assert rel_err(got, ref) < (2e-5 if device == "cpu" else 2e-2)
    args["hist_len"] = torch.zeros_like(args["hist_len"])
    ref0 = paged_reference(**args)
    got0, grids = _run_kernel(monkeypatch, args, device)
    assert grids[0][0][1] == 1  # the window programs only
    assert rel_err(got0, ref0) < (2e-5 if device == "cpu" else 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher(device):
    """``decode`` over pages takes the Triton path where it may (same result as the reference within the kernel's
    tolerance) and the reference, unchanged, for shapes the kernel does not take (head_dim 96)."""
    args, _ = paged_case(2, 1, 4, 64, 32, 16, (20, 9), 8, True, seed=5, device=device)
    ref = paged_reference(**args)
    got = paged(**args, use_kernels=True)
    assert rel_err(got, ref) < (2e-5 if device == "cpu" else 2e-2)
    assert pd.paged_supported(args["qf"], args["pages_k"], args["pages_v"], 32, args["win_k"])
    args96, _ = paged_case(2, 1, 4, 96, 32, 16, (20, 9), 8, True, seed=6, device=device)
    assert not pd.paged_supported(args96["qf"], args96["pages_k"], args96["pages_v"], 32, args96["win_k"])
    assert torch.equal(paged(**args96, use_kernels=True),
                       paged_reference(**args96))


# ------------------------------------------------------------------------ a prompt chunk's rows over one history


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,m,page,n", [(64, 70, 16, 37), (128, 64, 32, 200), (128, 130, 256, 700)])
def test_chunk_history_partial_matches_reference(monkeypatch, many_sms, device, d, m, page, n):
    """A prompt chunk's ``M`` rows (more than one program's tile: the tiles are the launch's rows, each with the
    request's block table) over one request's pages: the kernels' partials, normalized, equal the reference's, with
    the same log-sum-exp; rows past ``M`` in the last tile never reach the result."""
    args, _ = paged_case(1, 2, 1, d, 32, page, (n,), 4, True, seed=d + m, device=device)
    q_rot = torch.randn(1, 2, m, d, generator=torch.Generator().manual_seed(m)).to(device)
    off = torch.randn(1, 2, m).to(device)
    pages = pd.Pages(args["block_table"][:1], args["hist_len"][:1], n)
    history = pd.History(args["pages_k"], args["pages_v"], pages=pages)
    launched = []
    real = decode_triton.decode_attention_triton if triton_importable() else None
    monkeypatch.setattr(decode_triton, "decode_attention_triton",
                        lambda *a, **kw: (launched.append(kw["rotated"][0].shape), real(*a, **kw))[1])
    got = pd.paged_history_partial(q_rot, off, history, d**-0.5, 32, use_kernels=True)
    want = pd.paged_history_partial(q_rot, off, history, d**-0.5, 32, block_n=page, use_kernels=False)
    assert launched == [(_cdiv(m, pd.ROW_TILE), 2, pd.ROW_TILE, d)]
    for x, y in zip(got, want):
        assert x.shape == y.shape
    lse = lambda p: p[0] + torch.log(p[1])  # noqa: E731
    torch.testing.assert_close(lse(got), lse(want), rtol=0, atol=1e-4 if device == "cpu" else 2e-2)
    assert rel_err(got[2] / got[1][..., None], want[2] / want[1][..., None]) < (2e-5 if device == "cpu" else 2e-2)


# ------------------------------------------------------------------------------- the Gluon history kernel, paged

on_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the Gluon kernel has no interpreter)")


def _gluon_paged(monkeypatch, args, defaults):
    """The op with the Gluon history kernel's launches counted (a test fails if the dispatch took the split kernel)."""
    glu = decode_triton._gluon_module()
    assert glu is not None, "this Triton has no Gluon"
    calls = []
    real = glu.launch_history
    monkeypatch.setattr(glu, "launch_history", lambda *a, **kw: (calls.append(kw.get("paged")), real(*a, **kw))[1])
    return paged_triton(**args, defaults=defaults), calls


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("split", ["short", "long"])
@pytest.mark.parametrize(
    "d,m,page,lens",
    [
        (128, 4, 256, (3001, 0, 517, 4096)),  # TB = 2, pages of 256, one row without history
        (128, 8, 32, (1999, 40, 2700)),  # TB = 1, pages of two steps
        (128, 1, 64, (5, 2048, 777)),  # one query row, a row shorter than a step
        (256, 4, 16, (1500, 301, 0)),  # D = 256: 16-token steps, pages of one step
        (64, 4, 32, (2047, 33, 1, 1024)),  # D = 64: 32-token steps of 16 two-token rows, odd lengths
        (64, 3, 256, (4095, 0, 700)),  # D = 64, 3 query rows (SmolLM2's 9 / 3)
        (64, 8, 64, (3001, 64, 0)),  # D = 64, 8 query rows: two query groups
    ],
)
def test_gpu_paged_gluon_matches_reference(monkeypatch, d, m, page, lens, split):
    """The paged history on the Gluon kernel (each step's page from the block table, loaded one step ahead; per-row
    lengths, splits past a row's end empty) against the reference: shuffled page ids, NaN metadata in unused pages
    and page tails, window slots permuted, window masks with holes; short splits (fp16 keys) and long ones (D = 128:
    int8 keys with the prologue's query operands and its counters)."""
    long_split = 64 if split == "long" else 1 << 30
    df = replace(DEFAULTS, gluon_min_work=0, gluon_long_split=long_split)
    args, _ = paged_case(len(lens), 2, m, d, 64, page, lens, 40, True, seed=d + m + page, device="cuda")
    ref = paged_reference(**args)
    got, calls = _gluon_paged(monkeypatch, args, df)
    assert len(calls) == 1 and calls[0].page == page and calls[0].max_len == max(lens)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 2e-2


@pytest.mark.gpu
@on_gpu
def test_gpu_paged_gluon_in_a_cuda_graph(monkeypatch):
    """A CUDA graph of the paged op on the Gluon kernel, replayed with other rows' lengths, block tables and window
    slots in the same buffers (as the serving step's graphs are) within the captured bound, equals the reference."""
    df = replace(DEFAULTS, gluon_min_work=0)
    args, _ = paged_case(3, 2, 4, 128, 64, 64, (1500, 900, 64), 40, True, seed=11, device="cuda")
    bound = 2048
    args["block_table"] = torch.nn.functional.pad(args["block_table"], (0, _cdiv(bound, 64)), value=-1)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    run = lambda: paged_triton(**static, max_hist_len=bound, defaults=df)  # noqa: E731
    run()  # compile, and the counters' buffer
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for lens, perm in (((1500, 900, 64), [0, 1, 2]), ((64, 1499, 0), [2, 0, 1])):
        new = dict(args, hist_len=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                   block_table=args["block_table"][perm], win_slot=args["win_slot"][perm],
                   win_mask=args["win_mask"][perm])
        for k in ("hist_len", "block_table", "win_slot", "win_mask"):
            static[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, paged_reference(**new)) < 2e-2
