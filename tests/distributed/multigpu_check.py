#!/usr/bin/env python
"""OscarCache with a model split across GPUs by accelerate (a ``device_map``): every layer's cache and
rotations live on that layer's device. Greedy tokens of the split model are compared with the same
weights on one GPU (and BF16 DynamicCache split vs single as the control).

    NCCL_NVLS_ENABLE=0 python tests/distributed/multigpu_check.py --out benchmarks/results/multigpu_h200x2.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import dispatch_model
from accelerate.hooks import remove_hook_from_submodules
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # bench_generate
from bench_generate import SHAPES, build_model  # noqa: E402

from oscar_hf import OscarCache, disable_oscar  # noqa: E402
from oscar_hf.compat import cache_kwargs  # noqa: E402


def run(model, ids, am, cache, n):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             **cache_kwargs(model, cache), pad_token_id=0)
    return out[:, ids.shape[1]:].cpu()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    n_gpu = torch.cuda.device_count()
    if n_gpu < 2:
        raise SystemExit(f"needs >= 2 GPUs, found {n_gpu}")
    SHAPES["split"] = {**SHAPES["qwen3-8b"], "num_hidden_layers": a.layers}
    torch.manual_seed(0)
    model = build_model("split", torch.bfloat16, "cuda:0", a.context + a.new_tokens + 8)
    ids = torch.randint(100, 150000, (2, a.context), device="cuda:0")
    am = torch.ones_like(ids)
    am[1, : a.context // 4] = 0  # left padding in row 1
    half = a.layers // 2
    dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": n_gpu - 1, "lm_head": n_gpu - 1}
    for i in range(a.layers):
        dmap[f"model.layers.{i}"] = 0 if i < half else n_gpu - 1
    res = {"gpus": [torch.cuda.get_device_name(i) for i in range(n_gpu)], "layers": a.layers, "context": a.context}
    single = {"oscar": run(model, ids, am, OscarCache(model, method="hadamard"), a.new_tokens)}
    disable_oscar(model)
    single["bf16"] = run(model, ids, am, DynamicCache(config=model.config), a.new_tokens)
    model = dispatch_model(model, device_map=dmap)
    cache = OscarCache(model, method="hadamard")
    split = {"oscar": run(model, ids, am, cache, a.new_tokens)}
    res["cache_devices"] = sorted({str(layer.device) for layer in cache.layers if getattr(layer, "is_initialized", False)})
    res["rotation_devices"] = sorted({str(layer.params.r_k.device) for layer in cache.layers
                                      if getattr(layer, "params", None) is not None})
    disable_oscar(model)
    split["bf16"] = run(model, ids, am, DynamicCache(config=model.config), a.new_tokens)
    remove_hook_from_submodules(model)
    for k in ("oscar", "bf16"):
        res[f"{k}_split_equals_single"] = bool(torch.equal(split[k], single[k]))
        res[f"{k}_token_agreement"] = (split[k] == single[k]).float().mean().item()
    print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
