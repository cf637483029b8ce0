#!/usr/bin/env python
"""The host cost of `generate`'s compiled decode step before it runs: how many guards dynamo checks on every call
(and dynamo's one timing of them at compile time, ``guard_latency_us``: a single sample, which moved by 1.7x between
two runs of the same method on a 2-core CPU; the count is exact; ``guard_check_us``: the check of the step's own
locals, warm, the least of 20 rounds of 200), per cache, on a random model with a real shape's
layers (the guards follow the layers, heads and cache objects, not the hidden size). Runs on the CPU (the step is
compiled with the eager backend there, the guards are the same) or a GPU.

    TRITON_INTERPRET=1 python -P benchmarks/guard_cost.py --out benchmarks/results/guard_cost_cpu.json

Methods: ``oscar`` (``OscarCache(compile=True)``), ``oscar-fp25`` (with 25 INT8 retrieval heads) and ``bf16-strong``
(the strong BF16 baseline of ``strong_bf16.py``), one process each, so that each compiles its own step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Qwen3-8B's layers and heads (36 layers, 32 query / 8 KV heads of 128) at a small hidden size
SHAPE = dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=256,
             intermediate_size=256, vocab_size=512, max_position_embeddings=4096)


def one(method: str, prompt: int, new_tokens: int) -> dict:
    """Compile ``method``'s decode step through ``generate`` in this process; dynamo's record of that compile."""
    import time

    import torch
    import torch._dynamo.guards as dynamo_guards
    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoModelForCausalLM, CompileConfig, Qwen3Config

    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    sys.path.insert(0, str(HERE))
    import strong_bf16

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.float32).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    cap = prompt + new_tokens + 1
    if method == "bf16-strong":
        strong_bf16.enable(model)
        cache = strong_bf16.StrongBF16Cache(model, cap, read="split")
    else:
        heads = 25 if method == "oscar-fp25" else 0
        nl, hk = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"]
        cache = OscarCache(model, method="hadamard", group_size=64, sink=16, recent=32, compile=True,
                           retrieval_heads=tuple(((j * nl) // heads, j % hk) for j in range(heads)))
    compile_config = CompileConfig(fullgraph=True, backend="eager" if device == "cpu" else "inductor",
                                   mode=None if device == "cpu" else "reduce-overhead")
    compile_config._compile_all_devices = True  # (generate compiles its step on CUDA only, unless told)
    ids = torch.randint(1, SHAPE["vocab_size"] - 1, (1, prompt), generator=torch.Generator().manual_seed(1))
    built = []  # (guard manager, the frame's locals) of every frame dynamo compiles
    dynamo_guards.guard_manager_testing_hook_fn = lambda manager, scope, _: built.append((manager, dict(scope)))
    with torch.no_grad():
        model.generate(ids.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, compile_config=compile_config, **cache_kwargs(model, cache))
    frames = [m for m in dynamo_utils._compilation_metrics if getattr(m, "guard_count", None)]
    if not frames:
        raise RuntimeError(f"{method}: generate compiled no decode step")
    m = max(frames, key=lambda m: m.guard_count)  # (the decode step's frame: the one with the model's guards)
    # the decode step's check, warm, as every step runs it: the least of 20 rounds of 200 checks of its frame's locals
    manager, scope = next((g, s) for g, s in reversed(built) if "kwargs" in s)
    with torch.no_grad():  # (generate's grad mode: a guard of its own)
        if not manager.check(scope):
            raise RuntimeError(f"{method}: the decode step's guards fail on its own locals")
        rounds = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(200):
                manager.check(scope)
            rounds.append((time.perf_counter() - t0) / 200 * 1e6)
    return {"method": method, "guard_count": m.guard_count, "guard_latency_us": m.guard_latency_us,
            "guard_check_us": round(min(rounds), 1), "frames_compiled": len(frames), "device": device}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["bf16-strong", "oscar", "oscar-fp25"])
    p.add_argument("--prompt", type=int, default=160)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (the child process: one method)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one, a.prompt, a.new_tokens)))
        return
    rows = []
    for method in a.methods:  # one process each: each compiles its own step, from a cold dynamo
        out = subprocess.run([sys.executable, "-P", __file__, "--one", method, "--prompt", str(a.prompt),
                              "--new-tokens", str(a.new_tokens)], capture_output=True, text=True, env=os.environ)
        if out.returncode:
            raise RuntimeError(f"{method} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["method"] == "bf16-strong"), None)
    for r in rows:
        if base is not None and r is not base:
            r["extra_guards"] = r["guard_count"] - base["guard_count"]
    doc = {"command": "python -P benchmarks/guard_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "shape": SHAPE, "results": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    for r in rows:
        print(f"{r['method']:12s} {r['guard_count']:6d} guards, checked in {r['guard_check_us']} us"
              + (f" ({r['extra_guards']:+d} against bf16-strong)" if "extra_guards" in r else ""))


if __name__ == "__main__":
    main()
