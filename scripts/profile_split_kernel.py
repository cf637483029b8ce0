#!/usr/bin/env python
"""Run the fused decode op a few times at one shape, for Nsight Compute to profile the split kernel.

Not a benchmark (``bench_kernels.py`` times things); this only gives ``ncu`` a warm, steady launch
of ``_split_kernel`` for one inner-loop variant (stall reasons, issue-slot use, occupancy):

    ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 scripts/profile_split_kernel.py --loop deferred --batch 8 --length 131072
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_kernels as bk  # noqa: E402
from oscar_hf.kernels import decode_triton as dt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loop", default=dt.CONFIG["loop"], choices=sorted(dt._LOOPS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--config", default="{}", help="further CONFIG overrides (JSON)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    dt.CONFIG["loop"] = args.loop
    dt.CONFIG.update(json.loads(args.config))
    op = bk.oscar_op(bk.make_decode(args.batch, args.length, torch.Generator().manual_seed(0)))
    for _ in range(args.calls):
        op()
    torch.cuda.synchronize()
    print(f"ran {args.calls} calls: loop={args.loop} B={args.batch} T={args.length} config={dt.CONFIG}")


if __name__ == "__main__":
    main()
