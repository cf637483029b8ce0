#!/usr/bin/env python
"""Host time of the serving store's per-step plan (``OscarPagedStore.plan_decode``: window slots, ring entries, pages,
block tables and window masks of every decode row, copied into the fixed decode buffers), on the CPU.

    python benchmarks/bench_plan_decode.py --requests 24 --context 32768 --out benchmarks/results/plan_decode_cpu.json

A one-layer tiny Llama store (the plan is per step, not per layer), ``--requests`` requests prefilled with
``--context`` tokens each (sink 64, recent 256, pages of 256), then ``--steps`` graphed decode plans (one token a row
each); reported: the median of ``--repeats`` mean times per plan.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from oscar_hf.models import tiny_config
from oscar_hf.serving import OscarPagedStore


class _Attention(torch.nn.Module):
    """What the store's prefill reads from an attention module."""

    num_key_value_groups = 2
    is_causal = True
    training = False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = tiny_config("llama", num_hidden_layers=1)
    r, t, page = args.requests, args.context, args.page_size
    store = OscarPagedStore(cfg, method="hadamard", sink=64, recent=256, group_size=32, page_size=page,
                            num_pages=r * (t // page + 2), max_requests=r)
    store.enable_graphs(r)
    store.windows.fix()
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(r):  # prefill: the requests' pages and windows
        q, k, v = (torch.randn(1, h, t, d) for h in (hq, hk, hk))
        store.attend(0, q, k, v, [(f"r{i}", 0, t)], d**-0.5, _Attention(), "sdpa")
    step, means = 0, []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            store.plan_decode([(f"r{i}", t + step, 1) for i in range(r)], r)
            step += 1
        means.append((time.perf_counter() - t0) / args.steps)
    us = round(statistics.median(means) * 1e6, 1)
    print(json.dumps(dict(requests=r, context=t, plan_us_per_step=us)))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            what=__doc__.split("\n\n")[0], requests=r, context=t, page_size=page, plan_us_per_step=us,
            env=dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                     command="python " + " ".join(sys.argv)),
        ), indent=1))


if __name__ == "__main__":
    main()
