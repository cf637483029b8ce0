#!/usr/bin/env python
"""Where a continuous-batching decode step goes, BF16 paged vs OSCAR paged: ``--requests`` requests of ``--context``
tokens decode ``--steps`` tokens each; every model forward and (OSCAR) every layer's attention is timed with a CUDA
synchronization around it (the numbers are for finding the cost, not for quoting as throughput), and a
``torch.profiler`` table of the decode steps' top operations is printed.

    python benchmarks/profile_serving.py --context 8192 --requests 4 --steps 16 --out profile_serving.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model  # noqa: E402
from bench_serving import PAGE, bf16_block_bytes  # noqa: E402

from oscar_hf.serving import OscarPagedStore, continuous_batching_config, paged_oscar  # noqa: E402
from oscar_hf.serving import store as store_module  # noqa: E402


def timed(fn, bucket: list):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        bucket.append(time.perf_counter() - t)
        return out

    return wrapper


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kinds", nargs="+", default=["bf16", "oscar"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    model = build_model("qwen3-8b", torch.bfloat16, torch.device("cuda"), max_pos=args.context + args.steps + 16)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(args.context)] for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.steps, do_sample=False, eos_token_id=-1, pad_token_id=0)
    result = {}
    for kind in args.kinds:
        forwards, attends = [], defaultdict(list)
        budget = 2 * args.requests * (args.context + args.steps + 2 * PAGE) * bf16_block_bytes(model.config) // PAGE
        store = None
        if kind == "oscar":
            store = OscarPagedStore(model, defer_pool=True, max_requests=args.requests, device=model.device,
                                    dtype=model.dtype, method="hadamard")
            blocks = budget // store.page_bytes(PAGE)
        else:
            blocks = budget // bf16_block_bytes(model.config)
        cb = continuous_batching_config(num_blocks=blocks, page_size=PAGE, max_batch_tokens=args.context + 64)
        orig_forward = model.forward
        model.forward = timed(orig_forward, forwards)
        orig_decode = store_module.OscarPagedStore._decode
        store_module.OscarPagedStore._decode = timed(orig_decode, attends["decode"])
        ctx = paged_oscar(model, store) if kind == "oscar" else contextlib.nullcontext()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        try:
            with ctx:
                manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
                manager.start()
                for prompt in prompts:
                    manager.add_request(prompt, max_new_tokens=args.steps)
                outs = []
                prof.start()
                while len(outs) < len(prompts):
                    r = manager.get_result(timeout=600)
                    if r is None:
                        raise RuntimeError("no result")
                    outs.append(r)
                prof.stop()
                manager.stop(block=True)
                if hasattr(model, "destroy_cached_continuous_batching_manager"):
                    model.destroy_cached_continuous_batching_manager()
        finally:
            model.forward = orig_forward
            store_module.OscarPagedStore._decode = orig_decode
        decode_fw = sorted(forwards[-(args.steps - 2):])  # the last steps: every request decoding
        row = dict(forward_ms_median=round(1e3 * decode_fw[len(decode_fw) // 2], 2),
                   forward_ms_all=[round(1e3 * t, 1) for t in forwards])
        if attends["decode"]:
            d = sorted(attends["decode"][-36 * (args.steps - 2):])
            row["oscar_decode_layer_ms_median"] = round(1e3 * d[len(d) // 2], 3)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(kind, json.dumps({k: v for k, v in row.items() if k != "forward_ms_all"}))
        print(table)
        row["profile_top_cpu"] = table
        result[kind] = row
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
