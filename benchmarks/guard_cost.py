#!/usr/bin/env python
"""How much of the compiled decode step's time is torch.compile's guard evaluation: per method, `generate` runs
(synthetic fill, B x T, Qwen3-8B shape) with full guards and under ``torch.compiler.set_stance(
skip_guard_eval_unsafe=True)``, taking turns (guards, guards, skip, guards, skip), one process; ``fixed-<method>``
is the method's heads in a ``StaticOscarCache`` (a fixed capacity: no growable, dynamic-sized buffers).

    python benchmarks/guard_cost.py --methods oscar oscar-fp25 --out benchmarks/results/guard_cost_h200_b8_t8192.json
"""
import argparse, json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg
from oscar_hf import StaticOscarCache

orig_make = bg.make_cache
def make_cache(model, method, capacity, explicit=False):
    if method.startswith("fixed-"):  # StaticOscarCache (no growable dims) with the same heads as the base method
        base = orig_make(model, method.removeprefix("fixed-"), capacity, explicit)
        cfg = base.oscar_config
        return StaticOscarCache(model, method="hadamard", group_size=64, max_cache_len=capacity,
                                full_precision_heads=cfg.full_precision_heads, full_precision_bits=cfg.full_precision_bits)
    return orig_make(model, method, capacity, explicit)
bg.make_cache = make_cache

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8); p.add_argument("--context", type=int, default=8192)
p.add_argument("--methods", nargs="+", default=["oscar", "oscar-fp25"])
p.add_argument("--new-tokens", type=int, default=48); p.add_argument("--out")
a = p.parse_args()
model = bg.build_model("qwen3-8b", torch.bfloat16, "cuda", a.context + a.new_tokens + 16)
rows = []
for m in a.methods:
    for mode in ("guards", "guards", "skip", "guards", "skip"):
        if mode == "skip":
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                r = bg.run_one(model, m, a.batch, a.context, a.new_tokens, "cuda", fill=True)
        else:
            r = bg.run_one(model, m, a.batch, a.context, a.new_tokens, "cuda", fill=True)
        r["mode"] = mode
        print(json.dumps({k: r.get(k) for k in ("method", "mode", "decode_ms_per_token", "decode_ms_mean", "first_tokens")}), flush=True)
        rows.append(r)
        if a.out:
            Path(a.out).write_text(json.dumps(dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                            command=" ".join(sys.argv)), results=rows), indent=1))
