#!/usr/bin/env python
"""The decode step's fused write (``append_token_triton``) at its launch shapes: microseconds per layer inside one
CUDA graph of ``--layers`` writes back to back (as a decode step makes them, each layer on its own buffers), for each
``(num_warps, BLOCK_K)`` the kernel could take, with the default (``append_triton.launch_shape``) marked.

    python benchmarks/bench_append.py --batches 1 8 --out benchmarks/results/append_launch_h200.json

At B = 1 the write is one of the step's few kernels with fewer programs than the GPU has SMs (B x Hk x 2): its
latency, the serial chain of the rotation's loads, is what a layer pays. Qwen3-8B's attention shape by default
(8 KV heads, head_dim 128, group 64, bf16 window and metadata), the history half full, a demotion every step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels  # noqa: E402
from bench_kernels import timed_seq  # noqa: E402

from oscar_hf.cache.static import RING_RESERVE  # noqa: E402
from oscar_hf.kernels import append_triton  # noqa: E402
from oscar_hf.quant import QuantizedRows  # noqa: E402

SHAPES = [(4, 32), (8, 64), (8, 32), (16, 128), (16, 64), (4, 16)]  # (num_warps, BLOCK_K) at D = 128


def layer_args(b, hk, d, g, n, sink, recent, dev, gen):
    ring = recent + 1 + RING_RESERVE  # the compiled storage's ring
    win = torch.randn(2, b, hk, sink + ring, d, device=dev, generator=gen).to(torch.bfloat16)
    codes = torch.zeros(2, b, hk, n, d // 4, dtype=torch.uint8, device=dev)
    meta = torch.zeros(2, 2, b, hk, n, d // g, dtype=torch.bfloat16, device=dev)
    r = torch.linalg.qr(torch.randn(2, hk, d, d, device=dev, generator=gen))[0].contiguous()
    new = torch.randn(2, b, hk, 1, d, device=dev, generator=gen).to(torch.bfloat16)
    length = torch.tensor(sink + recent + n // 2, device=dev)  # a demotion into the middle of the history
    pad = torch.zeros(b, dtype=torch.long, device=dev)
    return (new[0], new[1], win[0], win[1], QuantizedRows(codes[0], meta[0, 0], meta[0, 1]),
            QuantizedRows(codes[1], meta[1, 0], meta[1, 1]), length, pad, None, r[0], None, 1.0, r[1], None, 1.0, g,
            torch.bfloat16, sink, recent)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--history", type=int, default=4096)
    p.add_argument("--out")
    args = p.parse_args(argv)
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    bench_kernels.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # a cold L2 before each replay
    d = args.head_dim
    default = append_triton.launch_shape(d)
    original = append_triton.launch_shape
    rows = []
    for b in args.batches:
        layers = [layer_args(b, args.kv_heads, d, args.group_size, args.history, 4, 256, dev, gen)
                  for _ in range(args.layers)]
        ref = None
        for warps, blk in SHAPES:
            if d % blk:
                continue
            append_triton.launch_shape = lambda _d, w=warps, k=blk: (w, k)
            fns = [lambda a=a: append_triton.append_token_triton(*a) for a in layers]
            us = timed_seq(fns) * 1000
            codes = torch.stack([a[4].codes for a in layers]).clone()
            same = None if ref is None else bool(torch.equal(codes, ref))
            ref = codes if ref is None else ref
            row = dict(batch=b, num_warps=warps, block_k=blk, us_per_layer=round(us, 2),
                       default=(warps, blk) == default, same_codes_as_first=same)
            rows.append(row)
            print(json.dumps(row), flush=True)
        append_triton.launch_shape = original
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            what=__doc__.split("\n\n")[0], rows=rows,
            env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                     command="python " + " ".join(sys.argv))), indent=1))


if __name__ == "__main__":
    main()
