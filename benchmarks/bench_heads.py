#!/usr/bin/env python
"""The retrieval heads' decode read (``kernels/heads_triton.py``) alone, on one CUDA GPU: time and bandwidth of the
split kernel + combine at the compiled cache's shapes, for the default tunables and a sweep of them.

Shape (Qwen3-8B: ``Hk = 8`` KV heads, ``M = 4`` query rows per KV head, ``D = 128``; sink 64 + recent 256, a ring of
321 window entries), ``B`` rows, ``P`` coded heads in the layer, INT8 or INT4 codes with a bf16 scale and zero per
token. The store has the compiled cache's capacity rows (``--capacity``, as after a 32K prefill) and the read bound
``hi`` is a device tensor, as in the CUDA graph of a decode step. Each timing is the median per call of one CUDA graph
of ``--seq`` back-to-back calls on as many separate stores (as a step runs its layers), the L2 made cold before
every replay (``bench_kernels.flush_l2``). Bandwidth: the bytes a call must read (the history's codes and metadata,
the window of its heads) over its time, against a measured device-to-device copy.

Usage: python benchmarks/bench_heads.py --out benchmarks/results/heads_kernel_h200.json [--sweep]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from oscar_hf.kernels.heads_attention import heads_decode_reference  # noqa: E402
from oscar_hf.kernels.heads_triton import heads_decode_triton  # noqa: E402
from oscar_hf.kernels.plan import HEADS_DEFAULTS, heads_plan  # noqa: E402

HK, M, D, SINK, RECENT = 8, 4, 128, 64, 256
RING = RECENT + 1 + 64
SWEEP = dict(block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))  # (INT4: the *_int4 fields alike)


def make_store(b: int, p: int, n: int, bits: int, gen: torch.Generator):
    """Random coded store ``[B, P, n, *]`` of ``bits``-bit codes, window, queries; all on the GPU."""
    dev, cols = "cuda", D * bits // 8

    def part():
        return (torch.randint(0, 256, (b, p, n, cols), generator=gen).to(torch.uint8).to(dev),
                (torch.rand(b, p, n, 1, generator=gen) * 0.05 + 0.01).to(torch.bfloat16).to(dev),
                (torch.randn(b, p, n, 1, generator=gen) * 0.5).to(torch.bfloat16).to(dev))

    w = SINK + RING
    return dict(q=torch.randn(b, HK, M, D, generator=gen).to(torch.bfloat16).to(dev),
                heads=torch.arange(p, dtype=torch.long, device=dev) * (HK // p),
                k=part(), v=part(),
                win_k=torch.randn(b, HK, w, D, generator=gen).to(torch.bfloat16).to(dev),
                win_v=torch.randn(b, HK, w, D, generator=gen).to(torch.bfloat16).to(dev),
                win_mask=torch.ones(b, w, dtype=torch.bool, device=dev),
                lo=torch.zeros(b, dtype=torch.long, device=dev))


def call(st, bits, hi, defaults):
    return heads_decode_triton(st["q"], st["heads"], st["k"], st["v"], bits, st["lo"], hi, st["win_k"], st["win_v"],
                               st["win_mask"], D**-0.5, torch.bfloat16, defaults=defaults)


def read_bytes(b, p, hist, bits):
    per_slot = 2 * (D * bits // 8 + 2 * 2)  # K and V: codes + bf16 scale + bf16 zero
    return b * p * (hist * per_slot + (SINK + RECENT + 1) * 2 * D * 2)


def measure(b, p, bits, hist, capacity, seq, defaults, gen, check=True):
    stores = [make_store(b, p, capacity, bits, gen) for _ in range(seq)]
    hi = torch.tensor(hist, device="cuda")
    if check:  # against the torch reference on the first store
        st = stores[0]
        ref = heads_decode_reference(st["q"], st["heads"], st["k"], st["v"], bits, st["lo"], hist, st["win_k"],
                                     st["win_v"], st["win_mask"], D**-0.5, torch.float32)
        err = (call(st, bits, hi, defaults).float() - ref).abs().max().item()
    ms = bk.timed_seq([lambda st=st: call(st, bits, hi, defaults) for st in stores])
    plan = heads_plan(b * p, capacity, M, torch.device("cuda"), defaults)
    gbps = read_bytes(b, p, hist, bits) / ms / 1e6
    del stores
    torch.cuda.empty_cache()
    return dict(B=b, P=p, bits=bits, hist=hist, capacity=capacity, us=ms * 1000, GBps=gbps,
                splits=plan.splits, split_len=plan.split_len, max_abs_err=err if check else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hist", type=int, default=32768 - SINK - RECENT, help="history slots read (hi)")
    ap.add_argument("--capacity", type=int, default=36864 - SINK - RECENT, help="store rows (grid size)")
    ap.add_argument("--seq", type=int, default=6, help="calls per CUDA graph")
    ap.add_argument("--points", default="8x1x8,8x3x8,8x1x4", help="BxPxbits,...")
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP combination at each point")
    ap.add_argument("--config", default="{}", help="HeadsDefaults overrides (JSON)")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    base = dataclasses.replace(HEADS_DEFAULTS, **json.loads(a.config))
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, command=" ".join(sys.argv),
               copy_GBps=bk.copy_bandwidth_gbps(), defaults=dataclasses.asdict(base), rows=[])
    print("copy GB/s", round(res["copy_GBps"]), flush=True)
    configs = [base]
    if a.sweep:
        configs += [dataclasses.replace(base, **dict(zip(SWEEP, v)), num_warps_int4=v[1], num_stages_int4=v[2])
                    for v in itertools.product(*SWEEP.values())]
    for pt in a.points.split(","):
        b, p, bits = (int(x) for x in pt.split("x"))
        for i, cfg in enumerate(configs):
            try:
                r = measure(b, p, bits, a.hist, a.capacity, a.seq, cfg, gen, check=i == 0 or a.sweep)
            except Exception as e:  # (a tile that does not fit: recorded, the sweep goes on)
                r = dict(B=b, P=p, bits=bits, error=repr(e)[:200])
            warps, stages = cfg.launch(bits)
            r.update(config=dict(block_n=cfg.block_n, num_warps=warps, num_stages=stages), default=i == 0,
                     pct_copy=r.get("GBps", 0) / res["copy_GBps"] * 100)
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
