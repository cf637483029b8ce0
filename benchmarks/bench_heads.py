"""The retrieval heads' read alone (``heads_triton.heads_decode_triton``, INT8, D = 128, GQA 4, a 385-entry window):
one CUDA graph of 8 calls over 8 distinct stores (the L2 defeated), median of 20 replays, us per call and GB/s.

    python benchmarks/bench_heads.py --points 1x1x100000 8x1x32768 [--sweep] [--modules a.b c.d] --out heads.json

``--points`` BxPxN (rows, retrieval heads, history slots); ``--sweep``: every (block_n, num_warps, num_stages) of
32/64/128 x 4/8 x 2/3/4 beside the defaults; ``--modules``: kernel modules to compare (an older copy beside this one).
"""
import argparse, importlib, itertools, json, torch
from oscar_hf.kernels.heads_attention import heads_decode_reference
from oscar_hf.kernels.kv import Window
from oscar_hf.kernels.plan import HeadsDefaults
ap = argparse.ArgumentParser(); ap.add_argument("--points", nargs="+", default=["1x1x100000", "8x1x32768", "1x2x100000"])
ap.add_argument("--modules", nargs="+", default=["oscar_hf.kernels.heads_triton"]); ap.add_argument("--sweep", action="store_true")
ap.add_argument("--out", default=None)
a = ap.parse_args()
mods = [importlib.import_module(m) for m in a.modules]
configs = [None] + ([HeadsDefaults(block_n=bn, num_warps=w, num_stages=st)
                     for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))] if a.sweep else [])
rows, dev = [], "cuda"


def timed(call, stores):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for st in stores: call(st)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for st in stores: call(st)
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    e0, e1, ts = torch.cuda.Event(True), torch.cuda.Event(True), []
    for _ in range(20):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1000 / len(stores))
    return sorted(ts)[len(ts) // 2]


for pt in a.points:
    b, p, n = map(int, pt.split("x"))
    d, hk, m, w, nb = 128, 8, 4, 385, 8
    cap = n + 512
    stores = []
    for i in range(nb):
        kc = torch.randint(0, 256, (b, p, cap, d), dtype=torch.uint8, device=dev)
        sc = (torch.rand(b, p, cap, 1, device=dev) * 0.05).bfloat16(); z = (torch.randn(b, p, cap, 1, device=dev)).bfloat16()
        vc = torch.randint(0, 256, (b, p, cap, d), dtype=torch.uint8, device=dev)
        stores.append(((kc, sc, z), (vc, sc.clone(), z.clone())))
    q = torch.randn(b, hk, m, d, device=dev).bfloat16()
    heads = torch.arange(p, device=dev) * 3
    wk = torch.randn(b, hk, w, d, device=dev).bfloat16(); wv = torch.randn_like(wk)
    win = Window(wk, wv, torch.ones(b, w, dtype=torch.bool, device=dev))
    lo = torch.zeros(b, dtype=torch.long, device=dev); hi = torch.tensor(n, device=dev)
    ref = heads_decode_reference(q, heads, stores[0], 8, (lo, n), win, 0.088, torch.float32)
    for mod, cfg in itertools.product(mods, configs):
        kw = {} if cfg is None else {"defaults": cfg}
        call = lambda st: mod.heads_decode_triton(q, heads, st, 8, (lo, hi), win, 0.088, torch.bfloat16, **kw)
        try:
            err = ((call(stores[0]).float() - ref).norm() / ref.norm()).item()
            us = timed(call, stores)
        except Exception as e:  # noqa
            print(pt, mod.__name__, cfg, "failed", str(e)[:200]); continue
        r = dict(point=pt, module=mod.__name__, cfg=None if cfg is None else (cfg.block_n, cfg.num_warps, cfg.num_stages),
                 us=round(us, 2), GBps=round(b * p * n * (2 * d + 8) / us / 1e3, 1), rel_err=err)
        print(json.dumps(r)); rows.append(r)
    del stores; torch.cuda.empty_cache()
if a.out: json.dump(rows, open(a.out, "w"), indent=1)
