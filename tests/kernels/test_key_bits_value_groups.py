"""The kernels on the storage the dequant loop alone reads (docs/kernels.md §3.11): 3-bit keys (their high bits'
plane) and values at a group of their own. The split kernel's read against the reference on the same rows (the
history's partials, the whole op with its window, a length on the device, the op's own rotation), and the one-token
write kernel against the write's reference, code for code: under the interpreter on the CPU, compiled on a GPU
(``-m gpu``; bf16 dot operands there, so the read's tolerance is bf16's; the cache's compiled step:
``tests/cache/test_value_groups.py``'s GPU case).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from kernel_utils import HAS_CUDA, loose, random_rotation, rel_err, setup_interpreter, signed_permutation

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from decode_cases import _rotating_case, _window_case, cut_history, rotating_op  # noqa: E402
from test_append_token import Layer  # noqa: E402

from oscar_hf.kernels import plan, write_path  # noqa: E402
from oscar_hf.kernels.int2_attention import (decode_attention_reference, history_partial_reference,  # noqa: E402
                                             rotate_query_reference)  # noqa: E402
from oscar_hf.kernels.kv import History, KVParams, PagedRows, Pages, Ring, Window  # noqa: E402
from oscar_hf.kernels.plan import DEFAULTS  # noqa: E402
from oscar_hf.quant import QuantizedRows, quantize_rows, rows_from  # noqa: E402
from oscar_hf.serving.pool import HeadLayout, PagedInt2Pool  # noqa: E402

DEV = "cpu" if INTERPRETED else "cuda"
TOL = 2e-5 if INTERPRETED else 2e-2
# both ways: interpreted (the CPU suite) or compiled (the GPU suite, -m gpu)
on = pytest.mark.skipif(not (INTERPRETED or HAS_CUDA), reason="needs Triton's interpreter or CUDA")
SMALL = replace(DEFAULTS, min_split=64, block_n=64)

# (b, hk, m, n, w, d, key group, value group, key bits): 3-bit keys alone, values at their own group alone, both
CASES = [
    (2, 2, 4, 150, 70, 64, 16, 16, 3),
    (1, 1, 4, 130, 33, 128, 32, 128, 3),
    (1, 1, 2, 100, 40, 256, 32, 128, 3),  # Gemma-3-270M's candidate: keys at 32 (channels gathered), values at 128
    (2, 1, 4, 90, 20, 256, 64, 64, 3),
    (1, 2, 3, 120, 30, 128, 32, 64, 2),
]
ids = [f"b{c[0]}-d{c[5]}-g{c[6]}-gv{c[7]}-k{c[8]}" for c in CASES]


@pytest.fixture
def dt(monkeypatch):
    monkeypatch.setattr(plan, "device_sms", lambda device: 16)  # (several splits a row: the combine merges them)
    from oscar_hf.kernels import decode_triton

    return decode_triton


def _with_storage(args, gen, g, gv, bits):
    """``args`` of a decode case with its history re-quantized: keys at ``bits`` and group ``g``, values at ``gv``."""
    k, v = args["k"], args["v"]
    b, hk, n = k.codes.shape[:3]
    d = k.codes.shape[-1] * 4
    k = quantize_rows(torch.randn(b, hk, n, d, generator=gen).to(DEV) * 2.0, g, 0.96, torch.bfloat16, bits=bits)
    v = quantize_rows(torch.randn(b, hk, n, d, generator=gen).to(DEV), gv, 0.92, torch.bfloat16)
    return {**args, "k": k, "v": v, "group_size": g}


@pytest.mark.gpu
@on
@pytest.mark.parametrize("b,hk,m,n,w,d,g,gv,bits", CASES, ids=ids)
def test_decode_reads_the_storage_as_the_reference(dt, b, hk, m, n, w, d, g, gv, bits):
    """The whole op (window, key mask, left padding), and the history's partials alone, equal the reference's."""
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=n + w, device=DEV)
    args = _with_storage(args, gen, g, gv, bits)
    assert args["k"].hi is not None or gv != g
    assert dt.kernel_supported(args["q_rot"], args["k"], g, None, None, 0, gv)
    args["start"] = torch.tensor([0, 17][:b], device=DEV)
    args["key_mask"] = (torch.rand(b, 1, 1, n, generator=gen) > 0.1).to(DEV)
    got = loose(dt.decode_attention_triton)(**args, defaults=SMALL)
    ref = loose(decode_attention_reference)(**args)
    assert got.shape == (b, hk, m, d) and rel_err(got.float(), ref.float()) < TOL
    # the partials alone (no window): the history's (m, l, acc)
    hist = [args[k_] for k_ in ("q_rot", "k", "v", "start", "key_mask", "qk_offset", "scaling", "group_size")]
    gm, gl, ga = dt.history_partial_triton(*hist, defaults=SMALL)
    rm, rl, ra = history_partial_reference(*hist)
    full = torch.isfinite(rm)
    assert torch.equal(torch.isfinite(gm), full)
    assert rel_err(ga[full] / gl[full][:, None], ra[full] / rl[full][:, None]) < TOL


@pytest.mark.gpu
@on
@pytest.mark.parametrize("n_valid", [0, 77, 150])
def test_device_length_and_the_ops_rotation(dt, n_valid):
    """A static cache's capacity with its length on the device, and the op rotating the query itself."""
    b, hk, m, n, w, d, g, gv = 2, 1, 4, 150, 40, 256, 32, 128
    args, gen = _window_case(b, hk, m, n, w, d, g, seed=n_valid, device=DEV)
    args = _with_storage(args, gen, g, gv, 3)
    args["start"] = torch.tensor([0, 9], device=DEV)
    got = loose(dt.decode_attention_triton)(**args, n_valid=torch.tensor(n_valid, device=DEV), splits=3,
                                            defaults=SMALL)
    ref = loose(decode_attention_reference)(**cut_history(args, n_valid))
    assert rel_err(got.float(), ref.float()) < TOL
    rot = _rotating_case(b, hk, m, n, w, d, g, seed=n_valid + 1, device=DEV)
    rot = _with_storage(rot, torch.Generator().manual_seed(n_valid), g, gv, 3)
    q_rot, qk_off = rotate_query_reference(rot["qf"], rot["r_k"], rot["mu_k"])
    ref = loose(decode_attention_reference)(**{k_: v_ for k_, v_ in rot.items() if k_ not in ("qf", "r_k", "mu_k")},
                                            q_rot=q_rot, qk_offset=qk_off, q_win=rot["qf"])
    assert rel_err(rotating_op(rot, defaults=SMALL).float(), ref.float()) < TOL


def test_the_plan_takes_the_dequant_loop():
    """``plain``: neither the deferred loop nor the Gluon kernel (neither reads a high bit or a second group)."""
    shape = plan.DecodeShape(1, 8, 4, 128, 4096, 128, 64)
    dev = torch.device("cpu")
    assert plan.decode_plan(shape, dev).deferred
    p = plan.decode_plan(shape, dev, plain=True, gluon_step=32)
    assert not p.deferred and not p.gluon


@pytest.mark.gpu
@on
@pytest.mark.parametrize("d,g,gv,bits,mu_k", [(64, 16, 16, 3, "2d"), (256, 32, 128, 3, "3d"), (128, 32, 64, 2, None),
                                              (256, 64, 256, 3, None)])
@pytest.mark.parametrize("length", [4, 12, 30])  # the sink filling; the first demotion; later ones
def test_append_writes_the_references_codes(d, g, gv, bits, mu_k, length):
    """The one-token write kernel against the write's reference: the same window, the same codes (high bits
    included), the same metadata; rotations exact (signed permutations), so both round the same values."""
    b, hk, sink, recent, n = 2, 2, 4, 6, 40
    outs = []
    for fn in (write_path.append_token_reference, _append_triton()):
        layer = Layer(b, hk, d, g, sink, recent, recent + 1, n, mu_k=mu_k, exact=True, seed=3, device=DEV)
        gen = torch.Generator().manual_seed(5)
        rand = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(DEV)  # noqa: E731
        meta = lambda gs, f: f(b, hk, n, d // gs, generator=gen).to(device=DEV, dtype=torch.bfloat16)  # noqa: E731
        k = rows_from((rand(b, hk, n, d // 4), meta(g, torch.rand), meta(g, torch.randn))
                      + ((rand(b, hk, n, d // 8),) * (bits == 3)))
        v = QuantizedRows(rand(b, hk, n, d // 4), meta(gv, torch.rand), meta(gv, torch.randn))
        win_k, win_v = layer.win_kv[0], layer.win_kv[1]
        params = KVParams(layer.r_k, layer.mu_k, layer.r_v, layer.mu_v, g, layer.clip_k, layer.clip_v, torch.bfloat16)
        pad = torch.tensor([0, 2], device=DEV)
        for t in range(length):  # every step up to `length`, so the demotions before it are checked too
            new_k = torch.randn(b, hk, 1, d, generator=gen).to(device=DEV, dtype=torch.bfloat16)
            new_v = torch.randn(b, hk, 1, d, generator=gen).to(device=DEV, dtype=torch.bfloat16)
            fn(params, new_k, new_v, Window(win_k, win_v), History(k, v, pad),
               Ring(torch.tensor(t, device=DEV), pad, sink, recent))
        outs.append((win_k, win_v, k, v))
    (wk, wv, k, v), (wk2, wv2, k2, v2) = outs
    assert torch.equal(wk, wk2) and torch.equal(wv, wv2)
    for a, b_ in ((k, k2), (v, v2)):
        assert all(torch.equal(x, y) for x, y in zip(a, b_, strict=True))


@pytest.mark.gpu
@on
@pytest.mark.parametrize("d,g,gv,bits", [(64, 16, 32, 3), (256, 32, 128, 3), (128, 32, 64, 2), (128, 64, 64, 3)])
def test_paged_storage_on_the_kernels(dt, d, g, gv, bits):
    """The serving pool's storage (3-bit keys' high bits and the values' own metadata as pool tensors of their own,
    every layer's heads on one axis): the paged read (split kernel, ``PAGED``) against the paged reference over rows
    of different lengths through shuffled block tables, then one decode step's write (the write kernel) against the
    write's reference, code for code (exact rotations: both round the same values), the trash page for a row that
    demotes nothing."""
    from oscar_hf.kernels.decode import decode

    gen = torch.Generator().manual_seed(d + g + gv + bits)
    hk, m, page, lens, sink, recent = 2, 4, 16, (37, 0, 70), 2, 5
    ring, slots = recent + 1, len(lens) + 1
    pool = PagedInt2Pool(12, 2, hk, d, page, g, torch.bfloat16, device=DEV, trash_page=True,
                         layout=HeadLayout(key_bits=bits, value_group=gv))
    ids = torch.randperm(12, generator=gen).tolist()
    tables = [ids[:3], [], ids[3:8]]
    for table, n in zip(tables, lens):
        for layer in (0, 1):  # layer 0 holds other rows on the same pages
            for kind, group, width, scale in (("k", g, bits, 2.0), ("v", gv, 2, 1.0)):
                x = torch.randn(1, hk, n, d, generator=gen).to(DEV) * scale
                if n:
                    pool.write(table, layer, kind, 0, quantize_rows(x, group, 0.95, torch.bfloat16, bits=width))
    block_table = torch.full((len(lens), 6), -1, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_table[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    rot = (signed_permutation(hk, d, gen), signed_permutation(hk, d, gen))
    params = KVParams(rot[0].to(DEV), (torch.randn(hk, d, generator=gen) * 0.5).to(DEV), rot[1].to(DEV), None, g,
                      0.95, 0.9, torch.bfloat16)
    win = [(torch.randn(slots, hk, sink + ring, d, generator=gen) * s).to(DEV, torch.bfloat16) for s in (2.0, 1.0)]
    slot = torch.tensor([2, 0, 1], device=DEV)
    mask = torch.rand(len(lens), sink + ring, generator=gen).to(DEV) > 0.3
    history = History(pool.rows(1, "k"), pool.rows(1, "v"), pages=Pages(block_table.to(DEV), torch.tensor(
        lens, dtype=torch.int32, device=DEV), max(lens)))
    assert (history.k.hi is not None) == (bits == 3) and history.v.scale.shape[-1] == d // gv
    qf = torch.randn(len(lens), hk, m, d, generator=gen).to(DEV)
    window = Window(win[0], win[1], mask[:, None, None, :], slot)
    got, want = (decode(params, qf, window, history, d**-0.5, torch.float32, use_kernels=k) for k in (True, False))
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL
    # one write: rows 0 and 2 demote their ring entry into their next history entry, row 1 (no history) the trash page
    new = [torch.randn(hk, len(lens), d, generator=gen).to(DEV, torch.bfloat16) for _ in "kv"]
    demote = [(tables[0][37 // page], 37 % page), (pool.trash_page, 0), (tables[2][70 // page], 70 % page)]
    rows = PagedRows(*(torch.tensor(c, dtype=torch.long, device=DEV) for c in (
        [0, 1, 2], slot.tolist(), [sink + 1] * 3, [sink + 1] * 3, [sink + 3] * 3, [p for p, _ in demote],
        [o for _, o in demote])))
    states = []
    for kernels in (True, False):
        pool_w = copy.copy(pool)
        pool_w.map_tensors(torch.clone)  # (its own copy of every page tensor)
        wk, wv = win[0].clone(), win[1].clone()
        write_path.append(params, *new, Window(wk, wv), History(pool_w.rows(1, "k"), pool_w.rows(1, "v")), rows,
                          use_kernels=kernels)
        states.append((wk, wv, pool_w.tensors))
    (wk, wv, t_got), (wk2, wv2, t_want) = states
    assert torch.equal(wk, wk2) and torch.equal(wv, wv2)
    assert all(torch.equal(a, b) for a, b in zip(t_got, t_want, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(t_got, pool.tensors))  # the step did write


def _append_triton():
    from oscar_hf.kernels.append_triton import append_token_triton

    return append_token_triton


def test_write_dispatch_takes_the_kernel_for_the_storage(monkeypatch):
    """``write_path.append`` sends 3-bit keys and a values' group of their own to the write kernel where it takes
    them (a power-of-two head_dim), the reference elsewhere (head_dim 96)."""
    calls = []
    from oscar_hf.kernels import append_triton

    monkeypatch.setattr(write_path, "triton_enabled", lambda x, use: True)
    monkeypatch.setattr(append_triton, "append_token_triton", lambda *a, **kw: calls.append("kernel"))
    monkeypatch.setattr(write_path, "append_token_reference", lambda *a: calls.append("reference"))
    for d in (128, 96):
        k = quantize_rows(torch.randn(1, 1, 8, d), 32, bits=3)
        v = quantize_rows(torch.randn(1, 1, 8, d), d)
        win = torch.zeros(1, 1, 6, d, dtype=torch.bfloat16)
        params = KVParams(random_rotation(1, d, torch.Generator()), None, random_rotation(1, d, torch.Generator()),
                          None, 32, 1.0, 1.0, torch.bfloat16)
        write_path.append(params, win[:, :, :1], win[:, :, :1], Window(win, win), History(k, v, torch.zeros(1)),
                          Ring(torch.tensor(3), torch.zeros(1, dtype=torch.long), 2, 3))
    assert calls == ["kernel", "reference"]
