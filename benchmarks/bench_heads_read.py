#!/usr/bin/env python
"""A layer's decode read with a retrieval head, 36 layers' reads replayed from one CUDA graph (the decode step's
cache reads without the rest of the model): Qwen3-8B's 8 KV heads of 128, 4 query rows each, a 320-token window,
the history at the compiled storage's device-side length; the L2 flushed before each replay.

    python benchmarks/bench_heads_read.py --points 1x100000 8x32768 --out heads_read.json

Variants, one process, every point:
* ``int2``: all 8 KV heads INT2 (the reads without a retrieval head);
* ``heads``: KV head ``i % 8`` of layer ``i`` an INT8 retrieval head, read as the defaults read it (its split launch
  on the side stream, its rows merged by the INT2 heads' combine);
* ``heads-apart``: the same with ``HeadsDefaults.merged`` off: a combine of its own, then a copy into the output;
* ``heads-serial``: merged, on the layer's stream (``side_stream`` off);
* ``heads-min<S>`` (``--min-splits S ...``): the defaults with at least ``S`` history slots a split (fewer splits).
Per point: ms for the 36 reads, and each variant's cost over ``int2``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

VARIANTS = {"int2": None, "heads": {}, "heads-apart": {"merged": False}, "heads-serial": {"side_stream": False}}


def point(b: int, n: int, variants: dict, layers: int = 36, hk: int = 8, d: int = 128, w: int = 320) -> list[dict]:
    """ms of ``layers`` reads in one graph at ``b`` rows of ``n`` history tokens, per variant."""
    from oscar_hf.kernels import settings
    from oscar_hf.kernels.decode import decode
    from oscar_hf.kernels.kv import HeadSplit, History, KVParams, Window
    from oscar_hf.quant import QuantizedRows, encode_heads, quantize_rows

    rnd = lambda *shape: torch.randn(*shape, device="cuda").bfloat16()  # noqa: E731
    # 4 distinct stores taken in turn (36 layers' worth would not fit at 8 x 32K beside the flush)
    stores = [([quantize_rows(rnd(b, hk, n, d), 64, 1.0, torch.bfloat16) for _ in "kv"],
               tuple(encode_heads(rnd(b, 1, n, d).float(), 8) for _ in "kv"), [rnd(b, hk, w, d) for _ in "kv"])
              for _ in range(4)]
    rot = torch.linalg.qr(torch.randn(hk, d, d, device="cuda"))[0]
    q, start, length = rnd(b, hk, 4, d), torch.zeros(b, dtype=torch.long, device="cuda"), torch.tensor(n, device="cuda")
    rows, base = [], settings.HEADS_DEFAULTS
    try:
        for name, knobs in variants.items():
            settings.HEADS_DEFAULTS = dataclasses.replace(base, **(knobs or {}))
            calls = []
            for i in range(layers):
                (k, v), coded, win = stores[i % 4]
                params, hist = KVParams(rot, None, rot.mT.contiguous(), None, 64), History(k, v, start, n_valid=length)
                if knobs is not None:  # KV head i % hk of the layer is its retrieval head
                    h = i % hk
                    int2 = torch.tensor([j for j in range(hk) if j != h], device="cuda")
                    split = HeadSplit(int2, torch.tensor([h], device="cuda"),
                                      (torch.arange(hk, device="cuda") == h).long() - 1, 8)
                    k, v = (QuantizedRows(*(x.index_select(1, int2) for x in r)) for r in (k, v))
                    params = KVParams(rot[:hk - 1], None, rot[:hk - 1].mT.contiguous(), None, 64, heads=split)
                    hist = History(k, v, start, n_valid=length, coded=coded)
                calls.append((params, Window(*win, None), hist))
            ms = bk.timed(lambda: [decode(pa, q, wi, hi, 0.088, torch.bfloat16) for pa, wi, hi in calls], graph=True)
            rows.append(dict(B=b, T=n, variant=name, layers=layers, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        settings.HEADS_DEFAULTS = base
    int2 = rows[0]["ms"]
    for r in rows[1:]:
        r["over_int2_ms"] = r["ms"] - int2
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", default=["1x100000", "8x32768"], help="BxT")
    p.add_argument("--min-splits", nargs="*", type=int, default=[], help="more variants: HeadsDefaults.min_split")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    variants = {**VARIANTS, **{f"heads-min{s}": {"min_split": s} for s in a.min_splits}}
    rows = [r for pt in a.points for r in point(*(int(x) for x in pt.split("x")), variants)]
    doc = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                        command="python " + " ".join([Path(__file__).name, *(argv or sys.argv[1:])])), results=rows)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    for r in rows:
        extra = f"  (+{r['over_int2_ms']:.3f} ms over int2)" if "over_int2_ms" in r else ""
        print(f"{r['B']} x {r['T']}  {r['variant']:13s} {r['ms']:.3f} ms{extra}")


if __name__ == "__main__":
    main()
