#!/usr/bin/env python
"""How fast can ONE kernel launch read the INT2 history bytes at all? (CUDA GPU; a bound, not OSCAR's kernel.)

For each batch size at ``--length`` tokens (the benchmark shape of ``scripts/bench_kernels.py``: Hk = 8, D = 128,
G = 64, bf16 scale / zero), allocates a buffer of exactly the history's bytes (codes + metadata of K and V) and times,
under a CUDA graph with a cold L2 (as ``bench_kernels.timed``), a plain streaming-read kernel -- 16-byte loads, one
int32 written per program -- over a few grid shapes, keeping the fastest. Beside it: the best BF16 SDPA of the same
shape and what 4.5x of it leaves (issue #4's target), so that the time the decode op has left for everything that is
not reading (the query rotation, the BF16 window, the merge, its own inefficiency) is measured, not guessed.

``--pattern`` adds the floor of the history kernel's own access pattern: its grid (one-warp programs, the splits of the
wave model at its residency, 32-token steps) reading the same bytes with no arithmetic, laid out as the
cache stores them (six streams) and in two denser layouts (``PATTERNS``).

    python scripts/bench_read_floor.py --batches 1,8 --length 131072 [--pattern] --out floor.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402


@triton.jit
def _read_kernel(X, OUT, n_vec, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``p`` reads vectors ``[p * ITERS * BLOCK, (p + 1) * ITERS * BLOCK)`` of 4 int32 (16 bytes) each."""
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, 4], tl.int32)
    for i in range(ITERS):
        v = (pid * ITERS + i) * BLOCK + r
        acc ^= tl.load(X + v[:, None] * 4 + tl.arange(0, 4)[None, :], mask=(v < n_vec)[:, None], other=0)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0))


# ---- the access pattern's floor (--pattern): the history kernel's grid and streams, no arithmetic
@triton.jit
def _stream(P, bh, st, steps, WS: tl.constexpr, BLK: tl.constexpr, ok):
    """The ``WS`` words of step ``st`` of (row, head) ``bh`` of one history stream (``[bh, steps, WS]`` words)."""
    r = tl.arange(0, BLK)
    return tl.load(P + (bh.to(tl.int64) * steps + st) * WS + r, mask=r < tl.where(ok, WS, 0), other=0)


@triton.jit
def _pattern_kernel(P0, P1, P2, P3, P4, P5, OUT, steps, split_steps,
                    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                    W5: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
                    B4: tl.constexpr, B5: tl.constexpr, UNROLL: tl.constexpr):
    """Program (bh, s) reads steps ``[s * split_steps, ...)`` of every stream ``P_i`` (``W_i`` words a step, 0: no
    stream), ``UNROLL`` steps' loads at a time, and xors them (so that nothing is optimized away)."""
    bh = tl.program_id(0)
    st0 = tl.program_id(1) * split_steps
    st1 = tl.minimum(st0 + split_steps, steps)
    a0 = tl.zeros([B0], tl.int32)
    a1 = tl.zeros([B1], tl.int32)
    a2 = tl.zeros([B2], tl.int32)
    a3 = tl.zeros([B3], tl.int32)
    a4 = tl.zeros([B4], tl.int32)
    a5 = tl.zeros([B5], tl.int32)
    for st in range(st0, st1, UNROLL):
        for u in tl.static_range(UNROLL):
            ok = st + u < st1
            a0 ^= _stream(P0, bh, st + u, steps, W0, B0, ok)
            if W1 > 0:
                a1 ^= _stream(P1, bh, st + u, steps, W1, B1, ok)
            if W2 > 0:
                a2 ^= _stream(P2, bh, st + u, steps, W2, B2, ok)
            if W3 > 0:
                a3 ^= _stream(P3, bh, st + u, steps, W3, B3, ok)
            if W4 > 0:
                a4 ^= _stream(P4, bh, st + u, steps, W4, B4, ok)
            if W5 > 0:
                a5 ^= _stream(P5, bh, st + u, steps, W5, B5, ok)
    x = tl.sum(a0, 0) ^ tl.sum(a1, 0) ^ tl.sum(a2, 0) ^ tl.sum(a3, 0) ^ tl.sum(a4, 0) ^ tl.sum(a5, 0)
    tl.store(OUT + bh * tl.num_programs(1) + tl.program_id(1), x)


# words a step of 32 tokens (D = 128 at 2 bits: 32 bytes of codes a token; bf16 scale / zero of 2 groups: 4 bytes)
PATTERNS = {
    "cache6": (256, 256, 32, 32, 32, 32),  # as the cache stores them: K codes, V codes, K scale, K zero, V scale, V zero
    "meta1": (256, 256, 128),  # the four metadata words of a token in one tensor
    "one": (640,),  # a step's codes and metadata in one block
}


def pattern_op(b, n, pattern, unroll, maxnreg, dev="cuda"):
    """The history kernel's grid (Gluon path: splits from the wave model at its residency, 32-token steps) reading
    the history's bytes laid out as ``pattern``; ``maxnreg`` caps this reader's registers (168: as the Gluon kernel's
    short splits), None leaves them free. (The grid follows ``gluon_split_cfg``: since session 19 it is sized for 8
    programs an SM where the splits are long, as B=8/128K's are; session 18's floors had the 12 of the older default.)"""
    from oscar_hf.kernels import decode_triton as dt

    bh, steps = b * bk.HK, n // 32
    cfg = dt.gluon_split_cfg(dt.CONFIG, bk.GQ, None, n, bh, torch.device(dev))  # (GQ = 4 rows: 32-token steps)
    s = dt.num_splits(n, bh, torch.device(dev), cfg)
    split_steps = triton.cdiv(steps, s)
    ws = PATTERNS[pattern]
    bufs = [torch.randint(-2**31, 2**31 - 1, (bh * steps * w,), dtype=torch.int32, device=dev) for w in ws]
    ws6 = list(ws) + [0] * (6 - len(ws))
    bufs += [bufs[0]] * (6 - len(bufs))
    blk = [triton.next_power_of_2(max(w, 1)) for w in ws6]
    out = torch.empty(bh * s, dtype=torch.int32, device=dev)
    kw = {f"W{i}": ws6[i] for i in range(6)} | {f"B{i}": blk[i] for i in range(6)}
    kw |= {"maxnreg": maxnreg} if maxnreg else {}
    return lambda: _pattern_kernel[(bh, s)](*bufs, out, steps, split_steps, UNROLL=unroll, num_warps=1, **kw), s


def read_op(buf, iters, block, warps):
    n_vec = buf.numel() // 4
    grid = triton.cdiv(n_vec, iters * block)
    out = torch.empty(grid, dtype=torch.int32, device=buf.device)
    return lambda: _read_kernel[(grid,)](buf, out, n_vec, ITERS=iters, BLOCK=block, num_warps=warps), grid


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pattern", action="store_true",
                    help="also the history kernel's access pattern: its grid and streams (PATTERNS), no arithmetic")
    bk.add_flush_arg(ap)
    args = ap.parse_args()
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bk.FLUSH_MODE = args.flush
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join(sys.argv), "flush": args.flush, "copy_GBps": bk.copy_bandwidth_gbps(), "rows": []}
    for b in (int(x) for x in args.batches.split(",")):
        hist, _ = bk.oscar_bytes(b, args.length)
        buf = torch.randint(-2**31, 2**31 - 1, (hist // 4,), dtype=torch.int32, device="cuda")
        shapes = []
        for iters, block, warps in [(1, 512, 4), (4, 512, 4), (16, 512, 4), (8, 1024, 8), (32, 1024, 8), (2, 128, 1),
                                    (8, 128, 1), (21, 128, 1)]:
            fn, grid = read_op(buf, iters, block, warps)
            shapes.append({"iters": iters, "block": block, "warps": warps, "programs": grid,
                           "graph_us": bk.timed(fn, graph=True) * 1e3})
        best = min(shapes, key=lambda r: r["graph_us"])
        q = torch.randn(b, bk.HQ, 1, bk.D, device="cuda", dtype=torch.bfloat16)
        sk = torch.randn(b, bk.HK, args.length, bk.D, device="cuda", dtype=torch.bfloat16)
        sv = torch.randn_like(sk)
        sdpa = []
        for be in [None, *bk.sdpa_backends().values()]:
            try:
                sdpa.append(bk.timed(bk.sdpa_op(q, sk, sv, be), graph=True) * 1e3)
            except Exception:  # (a backend that does not take this shape)
                pass
        sdpa = min(sdpa)
        patterns = []
        if args.pattern:  # the same bytes as the history kernel reads them (1-warp programs, its splits)
            for name in PATTERNS:
                for unroll, maxnreg in ((3, 168), (1, 168), (3, None)):
                    fn, s = pattern_op(b, args.length - bk.W, name, unroll, maxnreg)
                    patterns.append({"pattern": name, "unroll": unroll, "maxnreg": maxnreg, "splits": s,
                                     "graph_us": bk.timed(fn, graph=True) * 1e3})
                    print(" ", patterns[-1], flush=True)
                    del fn
                    torch.cuda.empty_cache()
        row = {"B": b, "T": args.length, "history_bytes": hist, "read_floor_us": best["graph_us"], "patterns": patterns,
               "read_floor_GBps": hist / best["graph_us"] / 1e3, "sdpa_best_graph_us": sdpa,
               "target_4_5x_us": sdpa / 4.5, "left_for_the_rest_us": sdpa / 4.5 - best["graph_us"], "shapes": shapes}
        res["rows"].append(row)
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "shapes"}, flush=True)
        del buf, sk, sv
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
