#!/usr/bin/env python
"""The decode op's query rotation alone, with and without the int8 key path's query operands (CUDA GPU).

Device microseconds per launch (``torch.profiler``, cold L2 as in ``scripts/profile_decode_op.py``) of
``query_triton.rotate_query_triton`` (4 programs of 32 channels per (row, KV head)) against
``rotate_query_q8_triton`` (the same 4 programs, which also build the operands the Gluon history kernel's int8 key
path loads under ``CONFIG["gluon_qpre"]``), at the benchmark shape (Hk = 8, D = 128, GQA 4) for each batch size.

    python scripts/bench_query_prologue.py --batches 1,8,32 --out prologue.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from profile_decode_op import kernel_times  # noqa: E402
from oscar_hf.kernels import query_triton as qt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--m", type=int, default=4, help="query rows per KV head")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    hk, d = 8, 128
    gen = torch.Generator().manual_seed(0)
    r_k = torch.linalg.qr(torch.randn(hk, d, d, generator=gen))[0].cuda()
    mu_k = torch.randn(hk, d, generator=gen).cuda()
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        q = torch.randn(b, hk, a.m, d, generator=gen).cuda().bfloat16()
        variants = {"rotation": lambda: qt.rotate_query_triton(q, r_k, mu_k),
                    "rotation + int8 operands": lambda: qt.rotate_query_q8_triton(q, r_k, mu_k, 0.127)}
        for name, fn in variants.items():
            t = kernel_times(fn, a.iters)
            us = sum(v["us_per_call"] for v in t.values())
            rows.append({"batch": b, "variant": name, "us": us, "kernels": t})
            print(f"B={b:3d} {name:24s} {us:7.2f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "m": a.m, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
