#!/usr/bin/env python
"""Where the decode op's host time goes (CUDA GPU): cProfile over back-to-back eager calls.

The eager op is host-bound below ~100 us of device time (``bench_kernels.py``'s ``oscar_host_us_per_call``: ~200-600
us a call against 24-200 us on the device), so an eager ``generate`` pays that per layer and step. For each point this
times ``--calls`` back-to-back calls of ``bench_kernels.oscar_op`` (the dynamic cache's op: rotation + window, history,
combine) without and with cProfile, and writes the profile's top functions by own time and by cumulative time.

    python scripts/profile_op_host.py --points 1x8192,8x32768 --calls 300 --out host.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x8192,8x32768")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    report = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, command {' '.join(sys.argv)}"]
    for pt in args.points.split(","):
        b, t = (int(x) for x in pt.split("x"))
        st = bk.make_decode(b, t, gen)
        op = bk.oscar_op(st)
        for _ in range(5):
            op()
        plain = bk.host_us_per_call(op, args.calls)
        prof = cProfile.Profile()
        prof.enable()
        profiled = bk.host_us_per_call(op, args.calls)
        prof.disable()
        report.append(f"\n=== B={b} T={t}: {plain:.1f} us a call ({profiled:.1f} under cProfile), {args.calls} calls")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            report.append(f"--- by {key}\n" + s.getvalue())
        print(f"B={b} T={t}: {plain:.1f} us a call", flush=True)
        del st, op
        torch.cuda.empty_cache()
    Path(args.out).write_text("\n".join(report))


if __name__ == "__main__":
    main()
