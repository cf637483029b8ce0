#!/usr/bin/env python
"""Where the time of one OSCAR decode-attention call goes, kernel by kernel (CUDA GPU).

Runs the benchmark's decode op (``benchmarks/bench_kernels.py``: ``decode_attention_triton`` from the unrotated
query, the query rotation, the split-K history (Gluon or split kernel) and window programs, the combine) eagerly under
``torch.profiler`` and reports each GPU kernel's mean device time per call, for each (B, T) point and each
``--configs`` entry (overrides of the kernel defaults, ``oscar_hf.kernels.plan.DecodeDefaults`` fields, as JSON).
The L2 flush between calls (as in the benchmark) is profiled too and left out of the table. Together with the
CUDA-graph time of the whole op this separates the fixed per-call cost (small kernels, split prologue, merge)
from the per-token cost of the history loop.

    python benchmarks/profile_decode_op.py --points 1x8192,1x131072,8x131072 \\
        --configs '{}' '{"gluon_min_work": 0}' --out profile.json
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from oscar_hf.kernels.plan import DEFAULTS  # noqa: E402


def kernel_times(fn, iters):
    """Mean device microseconds per call of each kernel ``fn`` launches (flush kernels excluded)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            bk.flush_l2()
            fn()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        cnt[e.name] += 1
    out = {}
    for name, us in tot.items():
        if any(w in name.lower() for w in ("fill", "zero", "reduce_kernel", "memset")):  # the L2 flush
            continue
        out[name[:90]] = {"us_per_call": us / iters, "launches_per_call": cnt[name] / iters}
    return out


def graph_timeline(fn, iters):
    """Where each kernel of one CUDA-graph replay of ``fn`` starts and ends, in us from the replay's first kernel
    (mean over ``iters`` replays, a cold L2 each): what the eager profile cannot show, the overlap that programmatic
    dependent launch gives inside the graph. None where the profiler reports no kernels of graph replays."""
    from torch.profiler import ProfilerActivity, profile

    g = bk.capture_graph(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            bk.flush_l2()
            g.replay()
        torch.cuda.synchronize()
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CUDA" and e.name.startswith("_")), key=lambda x: x[0])
    if not evs or len(evs) % iters:
        return None
    k = len(evs) // iters
    acc = collections.defaultdict(lambda: [0.0, 0.0])
    for i in range(iters):
        grp = evs[i * k:(i + 1) * k]
        t0 = grp[0][0]
        for j, (a, b, name) in enumerate(grp):
            key = f"{j}:{name[:40]}"
            acc[key][0] += (a - t0) / iters
            acc[key][1] += (b - t0) / iters
    return {key: {"start_us": round(v[0], 2), "end_us": round(v[1], 2)} for key, v in acc.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x8192,1x131072,8x131072")
    ap.add_argument("--configs", nargs="*", default=["{}"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeline", action="store_true", help="also each kernel's start / end inside a graph replay")
    bk.add_flush_arg(ap)
    args = ap.parse_args()
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bk.FLUSH_MODE = args.flush
    gen = torch.Generator().manual_seed(0)
    base = dataclasses.asdict(DEFAULTS)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
           "flush": args.flush, "base_config": base, "rows": []}
    for pt in args.points.split(","):
        b, t = (int(x) for x in pt.split("x"))
        st = bk.make_decode(b, t, gen)
        op = bk.oscar_op(st)
        for cj in args.configs:
            bk.KERNEL_DEFAULTS = dataclasses.replace(DEFAULTS, **json.loads(cj))  # (read by bk.oscar_op's calls)
            try:
                row = {"B": b, "T": t, "config": json.loads(cj), "graph_ms": bk.timed(op, graph=True),
                       "kernels": kernel_times(op, args.iters)}
            except Exception as e:  # a config the compiler rejects (resources): record it, go on
                res["rows"].append({"B": b, "T": t, "config": json.loads(cj), "error": repr(e)[:300]})
                print(f"B={b} T={t} {cj}: failed {repr(e)[:300]}")
                continue
            row["kernel_sum_us"] = sum(k["us_per_call"] for k in row["kernels"].values())
            res["rows"].append(row)
            print(f"B={b} T={t} {cj}: graph {row['graph_ms'] * 1e3:.1f} us, kernels {row['kernel_sum_us']:.1f} us")
            for name, k in sorted(row["kernels"].items(), key=lambda kv: -kv[1]["us_per_call"]):
                print(f"   {k['us_per_call']:8.1f} us  x{k['launches_per_call']:.0f}  {name}")
            if args.timeline:
                row["graph_timeline"] = graph_timeline(op, args.iters)
                for name, se in (row["graph_timeline"] or {"(no kernels reported)": {"start_us": 0, "end_us": 0}}).items():
                    print(f"   graph: {se['start_us']:7.1f} .. {se['end_us']:7.1f} us  {name}")
            Path(args.out).write_text(json.dumps(res, indent=1))
        del st, op
        torch.cuda.empty_cache()
    bk.KERNEL_DEFAULTS = DEFAULTS


if __name__ == "__main__":
    main()
