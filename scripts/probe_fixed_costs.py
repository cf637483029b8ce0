"""Diagnostic (session 27, GPU only): two fixed costs of the B=1 decode op, measured apart from the op.

1. **The rotation's first load.** The fused prologue's rotation programs need ~3 us from their entry to their product
   (``timeline_hist_programs.py``: ``product_p50`` 3.3 us, H100, B=1/128K) for one round of loads -- `R_K`'s 16 KB
   column plane and the query -- and a small product. Here 32 programs (as at B=1: 8 KV heads x 4 planes) load
   exactly those bytes and stamp ``%globaltimer`` at entry and once the loaded values are summed, under four
   conditions: after the benchmark's clean flush (zero + read back 256 MB: L2 cold, its TLB entries maybe gone);
   after a 64 MB flush (the L2 cold, fewer pages touched); after the clean flush and a one-word read of each 2 MB page
   of the matrices and the query (their translations warm, their bytes not); and hot (no flush).
2. **A graph's kernels.** CUDA-graph time (``bench_kernels.timed``: the clean flush before each replay, not timed) of
   one, two and three trivial launches (132 programs, one store each) back to back, with and without programmatic
   dependent launch: what each launch of the op's three adds to a replay besides its work.

    python3 scripts/probe_fixed_costs.py --out probe_fixed_costs.json
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402
from oscar_hf.kernels.query_triton import stamp_asm as _stamp  # noqa: E402  (%globaltimer once dep is known)


@triton.jit
def _load_probe(RK, Q, OUT, TIMES, D: tl.constexpr, M_PAD: tl.constexpr):
    # program (h, plane): R_K[h][:, 32 plane : 32 plane + 32] (fp32) and q[h] (M_PAD x D bf16), as a rotation program
    h = tl.program_id(0)
    p = tl.program_id(1)
    pid = h * tl.num_programs(1) + p
    t0 = _stamp(pid)
    offs_d = tl.arange(0, D)
    r = tl.load(RK + h * D * D + offs_d[:, None] * D + (32 * p + tl.arange(0, 32))[None, :])
    q = tl.load(Q + (h * M_PAD + tl.arange(0, M_PAD))[:, None] * D + offs_d[None, :]).to(tl.float32)
    s = tl.sum(tl.sum(r, 1), 0) + tl.sum(tl.sum(q, 1), 0)
    t1 = _stamp(s.to(tl.int32, bitcast=True))
    tl.store(OUT + pid, s)
    tl.store(TIMES + 2 * pid, t0)
    tl.store(TIMES + 2 * pid + 1, t1)


@triton.jit
def _rot_probe(RK, Q, Y, TIMES, M, D: tl.constexpr, M_PAD: tl.constexpr, MODE: tl.constexpr):
    # a rotation program's loads and product (query_triton._rotate_block: q [M_PAD, D] (rows >= M zero) times plane p
    # of R_K[h]), stamped at entry, once the loads are in (the thread that holds element 0 of both) and once the
    # product is. MODE: 0 tl.dot tf32x3 (the prologue's), 1 tl.dot tf32, 2 tl.dot ieee, 3 broadcast FMAs (M_PAD rows)
    h = tl.program_id(0)
    p = tl.program_id(1)
    pid = h * tl.num_programs(1) + p
    t0 = _stamp(pid)
    offs_m = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (h * M_PAD + offs_m)[:, None] * D + offs_d[None, :], mask=(offs_m < M)[:, None],
                other=0.0).to(tl.float32)
    r = tl.load(RK + h * D * D + offs_d[:, None] * D + (32 * p + tl.arange(0, 32))[None, :])
    first = (offs_d[:, None] == 0) & (tl.arange(0, 32)[None, :] == 0)
    tl.store(TIMES + 3 * pid + 1 + tl.zeros(r.shape, tl.int32),
             _stamp((r + tl.sum(q * (offs_m[:, None] + offs_d[None, :] == 0), 0)[:, None]).to(tl.int32, bitcast=True)),
             mask=first)
    if MODE == 0:
        y = tl.dot(q, r, input_precision="tf32x3")
    elif MODE == 1:
        y = tl.dot(q, r, input_precision="tf32")
    elif MODE == 2:
        y = tl.dot(q, r, input_precision="ieee")
    else:
        y = tl.sum(q[:, :, None] * r[None, :, :], 1)
    yfirst = (offs_m[:, None] == 0) & (tl.arange(0, 32)[None, :] == 0)
    tl.store(TIMES + 3 * pid + 2 + tl.zeros(y.shape, tl.int32), _stamp(y.to(tl.int32, bitcast=True)), mask=yfirst)
    tl.store(Y + (pid * M_PAD + offs_m)[:, None] * 32 + tl.arange(0, 32)[None, :], y)
    tl.store(TIMES + 3 * pid, t0)


@triton.jit
def _touch_pages(X, N, PAGE: tl.constexpr, OUT):
    # one word of each 2 MB page of X (its translation into the TLBs, one line into L2)
    i = tl.arange(0, 64)
    v = tl.load(X + i * PAGE, mask=i * PAGE < N, other=0)
    tl.store(OUT, tl.sum(v, 0))


@triton.jit
def _trivial(OUT, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(OUT + tl.program_id(0), tl.program_id(0))


def probe_loads(iters: int):
    d, hk, m_pad = 128, 8, 16
    rk = torch.randn(hk, d, d, device="cuda")
    q = torch.randn(hk, m_pad, d, device="cuda").to(torch.bfloat16)
    out = torch.empty(hk * 4, device="cuda")
    times = torch.zeros(hk * 4 * 2, device="cuda", dtype=torch.int64)
    small = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)
    sink = torch.empty(1, device="cuda", dtype=torch.int32)
    page_words = (2 << 20) // 4

    def touch():
        _touch_pages[(1,)](rk.view(torch.int32), rk.numel(), page_words, sink)
        _touch_pages[(1,)](q.view(torch.int16).view(torch.int32), q.numel() // 2, page_words, sink)

    conditions = {
        "clean_flush_256MB": bk.flush_l2,
        "flush_64MB": lambda: bk.flush_l2(small),
        "clean_flush_then_pages_touched": lambda: (bk.flush_l2(), touch()),
        "hot": lambda: None,
    }
    res = {}
    for name, before in conditions.items():
        lat, ends = [], []
        for i in range(iters + 2):
            before()
            _load_probe[(hk, 4)](rk, q, out, times, D=d, M_PAD=m_pad)
            torch.cuda.synchronize()
            if i >= 2:  # (compile, warm-up)
                t = times.view(-1, 2).double() / 1e3  # us
                lat += (t[:, 1] - t[:, 0]).tolist()
                ends.append(float((t[:, 1] - t[:, 0].min()).max()))
        lat.sort()
        ends.sort()
        res[name] = {"load_us_p10": lat[len(lat) // 10], "load_us_p50": lat[len(lat) // 2], "load_us_max": lat[-1],
                     "last_done_us_p50": ends[len(ends) // 2]}
        bk.log(f"loads {name:32s} " + " ".join(f"{k} {v:.3f}" for k, v in res[name].items()))
    return res


def probe_rotation(iters: int):
    """Entry -> loads in -> product of a rotation program (``_rot_probe``), each way of computing the product, after
    the clean flush: where the prologue's ~3 us before its product go."""
    d, hk, m = 128, 8, 4
    rk = torch.randn(hk, d, d, device="cuda")
    res = {}
    # (after the clean flush; "_data_in_l2": then R_K and q read into the L2 by another kernel -- this kernel's code
    # still cold; "_hot": no flush)
    variants = ((0, "dot_tf32x3", 16, "flush"), (1, "dot_tf32", 16, "flush"), (2, "dot_ieee", 16, "flush"),
                (3, "fma", 4, "flush"), (0, "dot_tf32x3_data_in_l2", 16, "data"), (0, "dot_tf32x3_hot", 16, "hot"))
    for mode, name, m_pad, cond in variants:
        q = torch.randn(hk, m_pad, d, device="cuda").to(torch.bfloat16)
        before = {"flush": bk.flush_l2, "hot": lambda: None,
                  "data": lambda: (bk.flush_l2(), rk.sum(), q.float().sum())}[cond]
        y = torch.empty(hk * 4, m_pad, 32, device="cuda")
        times = torch.zeros(hk * 4 * 3, device="cuda", dtype=torch.int64)
        loads, prods = [], []
        for i in range(iters + 2):
            before()
            _rot_probe[(hk, 4)](rk, q, y, times, m, D=d, M_PAD=m_pad, MODE=mode, num_warps=4)
            torch.cuda.synchronize()
            if i >= 2:
                t = times.view(-1, 3).double() / 1e3
                loads += (t[:, 1] - t[:, 0]).tolist()
                prods += (t[:, 2] - t[:, 0]).tolist()
        ref = torch.stack([q.float()[h, :m] @ rk[h][:, 32 * p:32 * p + 32] for h in range(hk) for p in range(4)])
        err = float((y[:, :m] - ref).abs().max() / ref.abs().max())
        loads.sort()
        prods.sort()
        res[name] = {"loads_in_us_p50": loads[len(loads) // 2], "loads_in_us_max": loads[-1],
                     "product_us_p50": prods[len(prods) // 2], "product_us_max": prods[-1], "max_rel_err": err}
        bk.log(f"rotation {name:12s} " + " ".join(f"{k} {v:.3g}" for k, v in res[name].items()))
    return res


def probe_graph(iters: int):
    out = torch.empty(132, device="cuda", dtype=torch.int32)
    res = {}
    for n in (1, 2, 3):
        for pdl in (0, 1):
            if n == 1 and pdl:
                continue

            def fn(n=n, pdl=pdl):
                for i in range(n):
                    _trivial[(132,)](out, PDL=int(pdl and i > 0), **({"launch_pdl": True} if pdl and i > 0 else {}))
            us = bk.timed(fn, graph=True, iters=iters) * 1e3
            res[f"{n}_launches_pdl{pdl}"] = us
            bk.log(f"graph {n} trivial launch(es), pdl {pdl}: {us:.2f} us")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="probe_fixed_costs.json")
    args = ap.parse_args()
    bk.FLUSH = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join(sys.argv), "flush": bk.FLUSH_MODE,
           "loads": probe_loads(args.iters), "rotation": probe_rotation(args.iters),
           "graph_us": probe_graph(args.iters)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    bk.log("wrote", args.out)


if __name__ == "__main__":
    main()
