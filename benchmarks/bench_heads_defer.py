"""The retrieval heads' read alone (``heads_triton.heads_decode_triton``): the deferred history loop
(``HeadsDefaults.defer=True``, the default) against the online loop it replaced (``defer=False``), in one process.

INT8 and INT4 codes, D = 128, 8 KV heads with 4 query rows each, one retrieval head (KV head 3), a 256-entry window,
the history bound on the device (as in the compiled step). Each variant: one CUDA graph of 8 calls over 8 distinct
stores (the L2 defeated), the median of 20 replays in us per call; new / old; and each one's max relative error
(norm-wise, over the 8 stores) against the float32 torch reference. The approach of ``benchmarks/bench_heads.py`` at
a46f393.

    python3 -P benchmarks/bench_heads_defer.py --out heads_defer_h200.json          # H200: B=1 x 100K, B=8 x 32K
    python3 -P benchmarks/bench_heads_defer.py --smoke                              # CPU, interpreter: typos only

``--rounds R`` alternates new / old R times (each round 20 replays; the figure is the median of the rounds' medians).
Exits 1 where an error is past 5e-2 (or NaN).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--points", nargs="+", default=["1x100000", "8x32768"], help="BxN: rows x history slots")
ap.add_argument("--bits", nargs="+", type=int, default=[8, 4])
ap.add_argument("--rounds", type=int, default=1)
ap.add_argument("--replays", type=int, default=20)
ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1, no graphs")
ap.add_argument("--out", default=None)
a = ap.parse_args()
if a.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported)
    a.points, a.replays = ["1x600", "2x300"], 1

import torch  # noqa: E402

from oscar_hf.kernels import heads_triton as ht  # noqa: E402
from oscar_hf.kernels.heads_attention import heads_decode_reference  # noqa: E402
from oscar_hf.kernels.kv import Window  # noqa: E402
from oscar_hf.kernels.settings import HEADS_DEFAULTS  # noqa: E402

DEV = "cpu" if a.smoke else "cuda"
DT = torch.float32 if a.smoke else torch.bfloat16  # (the interpreter's dots take float32)
D, HK, M, W, NSTORES, SCALING = 128, 8, 4, 256, 2 if a.smoke else 8, 0.088
VARIANTS = {"new": dataclasses.replace(HEADS_DEFAULTS, defer=True), "old": dataclasses.replace(HEADS_DEFAULTS, defer=False)}


def timed(call, stores, replays):
    """us per call: the median of ``replays`` replays of one graph of ``call(store)`` for every store (on the CPU:
    one eager pass, wall clock)."""
    if a.smoke:
        t0 = time.perf_counter()
        for st in stores:
            call(st)
        return (time.perf_counter() - t0) * 1e6 / len(stores)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # (warm-up: compiles the variant outside the capture)
        for st in stores:
            call(st)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for st in stores:
            call(st)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1, ts = torch.cuda.Event(True), torch.cuda.Event(True), []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / len(stores))
    return sorted(ts)[len(ts) // 2]


def make_stores(b, n, bits):
    """``NSTORES`` coded stores ``(codes, scale, zero)`` of one head, capacity ``n + 512`` (INT4: two codes a byte)."""
    cap, width = n + 512, D * bits // 8
    out = []
    for _ in range(NSTORES):
        parts = []
        for _kv in "kv":
            codes = torch.randint(0, 256, (b, 1, cap, width), dtype=torch.uint8, device=DEV)
            scale = (torch.rand(b, 1, cap, 1, device=DEV) * (0.05 if bits == 8 else 0.8)).to(DT)
            parts.append((codes, scale, torch.randn(b, 1, cap, 1, device=DEV).to(DT)))
        out.append(tuple(parts))
    return out


def rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


rows = []
for pt in a.points:
    b, n = map(int, pt.split("x"))
    q = torch.randn(b, HK, M, D, device=DEV).to(DT)
    heads = torch.tensor([3], device=DEV)
    wk, wv = (torch.randn(b, HK, W, D, device=DEV).to(DT) for _ in "kv")
    win = Window(wk, wv, torch.ones(b, W, dtype=torch.bool, device=DEV))
    lo, hi = torch.zeros(b, dtype=torch.long, device=DEV), torch.tensor(n, device=DEV)
    for bits in a.bits:
        stores = make_stores(b, n, bits)
        refs = [heads_decode_reference(q, heads, st, bits, (lo, n), win, SCALING, torch.float32) for st in stores]
        us, err = {k: [] for k in VARIANTS}, {}
        for name, df in VARIANTS.items():
            err[name] = max(rel_err(ht.heads_decode_triton(q, heads, st, bits, (lo, hi), win, SCALING, DT, defaults=df),
                                    ref) for st, ref in zip(stores, refs))
        for _ in range(a.rounds):
            for name, df in VARIANTS.items():
                us[name].append(timed(lambda st, df=df: ht.heads_decode_triton(
                    q, heads, st, bits, (lo, hi), win, SCALING, DT, defaults=df), stores, a.replays))
        med = {k: sorted(v)[len(v) // 2] for k, v in us.items()}
        gbps = {k: b * n * 2 * (D * bits // 8 + 4) / v / 1e3 for k, v in med.items()}  # codes + bf16 scale / zero
        row = dict(point=pt, B=b, N=n, bits=bits, D=D, M=M, window=W, stores=NSTORES, replays=a.replays,
                   us_new=round(med["new"], 2), us_old=round(med["old"], 2),
                   new_over_old=round(med["new"] / med["old"], 4), GBps_new=round(gbps["new"], 1),
                   GBps_old=round(gbps["old"], 1), rel_err_new=err["new"], rel_err_old=err["old"],
                   rounds_new=[round(x, 2) for x in us["new"]], rounds_old=[round(x, 2) for x in us["old"]])
        print(f"B={b} N={n} INT{bits}: new {row['us_new']} us, old {row['us_old']} us, new/old {row['new_over_old']}"
              f"  (rel err new {err['new']:.2e}, old {err['old']:.2e})", flush=True)
        rows.append(row)
        del stores, refs
        if not a.smoke:
            torch.cuda.empty_cache()
meta = dict(device=torch.cuda.get_device_name() if not a.smoke else "cpu (interpreter)", torch=torch.__version__,
            smoke=a.smoke, defaults=dataclasses.asdict(HEADS_DEFAULTS))
if a.out:
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
sys.exit(0 if all(r["rel_err_new"] < 5e-2 and r["rel_err_old"] < 5e-2 for r in rows) else 1)
