#!/usr/bin/env python
"""What the compiled decode step costs the host per call, apart from the graph itself: OSCAR's compiled storage
against BF16 ``StaticCache`` (CPU, a tiny Qwen3 of ``--layers`` layers, ``generate``'s own compile route with the
eager backend, ``oscar_hf.compiled_step.cpu_compile_config``).

    python benchmarks/host_overhead.py --layers 6 36 --out benchmarks/results/host_overhead_cpu.json

Per method and layer count: the step graph's inputs (placeholders), dynamo's guards (all of them, through a
``guard_filter_fn`` that keeps every one), the compiled call's host time with the graph replaced by its own first
outputs (so that only guards, input gathering and dynamo's wrapper are timed; median of ``--calls``), and the guard
check alone (``guard_manager.check``, best of 5 x 200). Per layer: the difference between the two layer counts over
their difference. The H200's host profile (``run_gpu.sh profile-host``) says how much of the step this is there.
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
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, make_cache  # noqa: E402

from oscar_hf.compat import cache_kwargs  # noqa: E402
from oscar_hf.compiled_step import cpu_compile_config  # noqa: E402


def build(layers: int):
    kw = dict(SHAPES["tiny"])
    kw.pop("note", None)
    attn = kw.pop("attn_implementation", "sdpa")
    cfg = AutoConfig.for_model(kw.pop("model_type"), **{**kw, "num_hidden_layers": layers,
                                                        "max_position_embeddings": 512})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()


def measure(method: str, layers: int, calls: int) -> dict:
    torch._dynamo.reset()
    model = build(layers)
    seen = dict(guards=0, inputs=0)
    null = dict(on=False, out=None)  # once on: the graph returns its first outputs (host overhead only)

    def keep_all(entries):
        seen["guards"] = len(entries)
        return [True] * len(entries)

    def backend(gm, example_inputs):
        seen["inputs"] = sum(n.op == "placeholder" for n in gm.graph.nodes)

        def run(*args):
            if not (null["on"] and null["out"] is not None):
                null["out"] = gm.forward(*args)
            return null["out"]
        return run

    cc = cpu_compile_config()
    cc.backend, cc.options = backend, {"guard_filter_fn": keep_all}
    cache = make_cache(model, method, 1024, explicit=True)
    step = []  # the last compiled call and its arguments
    original = model.get_compiled_call

    def get_compiled_call(*args, **kwargs):
        fn = original(*args, **kwargs)
        return lambda *a, **k: (step.append((a, k)), fn(*a, **k))[1]

    model.get_compiled_call = get_compiled_call
    ids = torch.randint(100, 900, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, compile_config=cc,
                       **cache_kwargs(model, cache))
    args, kwargs = step[-1]
    compiled = model._compiled_call
    null["on"] = True
    times = []
    with torch.no_grad():
        for _ in range(calls):  # the cache's lengths advance on the device only: the same guards hold every call
            t0 = time.perf_counter()
            compiled(*args, **kwargs)
            times.append(time.perf_counter() - t0)
    code = type(model).forward.__code__
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    f_locals = {"args": (model, *args), "kwargs": kwargs}
    f_locals.update({n: c.cell_contents for n, c in zip(code.co_freevars, type(model).forward.__closure__ or ())})
    guard = entries[0].guard_manager
    best = float("inf")
    with torch.no_grad():
        if not guard.check(f_locals):
            raise RuntimeError(f"{method}: the guard check does not hold on the step's own arguments")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                guard.check(f_locals)
            best = min(best, (time.perf_counter() - t0) / 200)
    return dict(method=method, layers=layers, graph_inputs=seen["inputs"], guards=seen["guards"],
                cache_entries=len(entries), call_ms=round(statistics.median(times) * 1e3, 4),
                guard_check_ms=round(best * 1e3, 4))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs=2, default=[6, 36], metavar=("FEW", "MANY"))
    p.add_argument("--methods", nargs="+", default=["bf16-static", "oscar-compiled"])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(m, n, args.calls) for m in args.methods for n in args.layers]
    few, many = args.layers
    per_layer = {}
    for m in args.methods:
        a, b = (next(r for r in rows if r["method"] == m and r["layers"] == n) for n in (few, many))
        per_layer[m] = {k: round((b[k] - a[k]) / (many - few), 3) for k in ("graph_inputs", "guards", "call_ms")}
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(dict(per_layer=per_layer)))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            what=__doc__.split("\n\n")[0], rows=rows, per_layer=per_layer,
            env=dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                     command="python " + " ".join(sys.argv)),
        ), indent=1))


if __name__ == "__main__":
    main()
