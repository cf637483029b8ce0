#!/usr/bin/env python
"""How much Python dynamo traces to compile the decode step: bytecode instructions by file and function, OSCAR's
compiled storage (the GPU's graph: Triton kernels on, under ``TRITON_INTERPRET=1``) against BF16 ``StaticCache``,
on the CPU (a tiny Qwen3 of ``--layers`` layers, ``generate``'s own compile route with the eager backend, as
``host_overhead.py``). Each instruction is traced once per layer by the first call's compile.

    TRITON_INTERPRET=1 python benchmarks/trace_count.py --layers 6 --out benchmarks/results/trace_count_cpu.json

Methods: ``bf16-static``; ``oscar-kernels`` (``OscarCache(compile=True, use_kernels=True)``); ``oscar-kernels-heads``
(the same with one INT8 retrieval head in every layer). Under the interpreter, ``plan.triton_enabled`` reads the
environment (a few dozen instructions a call that CUDA tensors skip).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_overhead  # noqa: E402

from oscar_hf import OscarCache  # noqa: E402


def make_cache(model, method, capacity, explicit=False):
    if method == "bf16-static":
        from bench_generate import make_cache as bench_cache

        return bench_cache(model, method, capacity, explicit=explicit)
    heads = ()
    if method == "oscar-kernels-heads":
        heads = tuple((layer, 0) for layer in range(model.config.num_hidden_layers))
    elif method != "oscar-kernels":
        raise ValueError(method)
    return OscarCache(model, method="hadamard", group_size=64, compile=True, use_kernels=True,
                      full_precision_heads=heads)


def count(method: str, layers: int) -> dict:
    from torch._dynamo import symbolic_convert

    counts = collections.Counter()
    original = symbolic_convert.InstructionTranslatorBase.step

    def step(self):
        code = self.f_code
        counts[(code.co_filename.split("site-packages/")[-1].replace(str(Path.cwd()) + "/", ""), code.co_name)] += 1
        return original(self)

    symbolic_convert.InstructionTranslatorBase.step = step
    host_overhead.make_cache = make_cache
    try:
        row = host_overhead.measure(method, layers, 5)
    finally:
        symbolic_convert.InstructionTranslatorBase.step = original
    by_file = collections.Counter()
    for (f, _), v in counts.items():
        by_file[f] += v
    return dict(method=method, layers=layers, instructions=sum(counts.values()), graph_inputs=row["graph_inputs"],
                guards=row["guards"], by_file=dict(by_file.most_common(20)),
                by_function={f"{f}:{n}": v for (f, n), v in counts.most_common(30)})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--methods", nargs="+", default=["bf16-static", "oscar-kernels", "oscar-kernels-heads"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run under TRITON_INTERPRET=1 (the kernels' path, as on the GPU)")
    torch.set_num_threads(1)
    rows = [count(m, args.layers) for m in args.methods]
    base = next((r for r in rows if r["method"] == "bf16-static"), None)
    for r in rows:
        if base is not None:
            r["extra_per_layer_vs_static"] = round((r["instructions"] - base["instructions"]) / args.layers)
        print(json.dumps({k: r[k] for k in ("method", "instructions", "graph_inputs", "guards")
                          if k in r} | {"extra_per_layer_vs_static": r.get("extra_per_layer_vs_static")}))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            what=__doc__.split("\n\n")[0], rows=rows,
            env=dict(torch=torch.__version__, command="TRITON_INTERPRET=1 python " + " ".join(sys.argv))), indent=1))


if __name__ == "__main__":
    main()
