#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over a few `generate` decode steps.

    python benchmarks/profile_decode.py --methods oscar-static bf16-static --batch 1 --context 32768 \
        --out benchmarks/results/profile_h100_t32768.json

For each method: the cache is filled with ``--context`` random tokens through its own write path
(``bench_generate.synthetic_fill``), ``generate`` runs ``--warmup`` steps (compilation, CUDA-graph
recording), then ``--steps`` more under the profiler. Reported per method: wall ms per step, device
(kernel) ms per step, their ratio (how GPU-bound the step is), and the top kernels by device time,
grouped into OSCAR's decode kernels (``_split_kernel``, ``_combine_kernel``), its write path, GEMMs,
attention (SDPA / flash), and the rest. ``--host``: Python's cProfile instead, for the host side of the same steps
(``generate`` synchronises at every step, so host time adds to the device time), and the plain step time measured
before the profiler starts. ``--op``: the decode-attention op alone (``bench_kernels.py``'s), each GPU kernel's mean
device time per call at ``--points`` (``BxT``), the L2 flush between calls left out:

    python benchmarks/profile_decode.py --op --points 1x131072 8x131072 32x32768 --out profile_op_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, StepClock, build_model, make_cache, synthetic_fill  # noqa: E402

from oscar_hf.compat import cache_kwargs  # noqa: E402

GROUPS = (  # the first group whose pattern a kernel's name contains takes it
    ("oscar retrieval heads read", ("_heads_split_kernel", "_heads_combine_kernel")),
    ("oscar decode kernels", ("_split_kernel", "_combine_kernel", "_hist_kernel", "_prologue_kernel",
                              "_rotate_query_kernel")),
    ("oscar write (append / bulk)", ("_append_token_kernel", "_rotate_quantize", "quantize")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "matmul", "addmm", "mm_")),
    ("attention (sdpa/flash)", ("flash", "fmha", "attention", "sdpa", "cudnn")),
)


def _group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return g
    return "other"


def _release(model, method: str) -> None:
    """The model's attention back to its own implementation, so that the next method of the process can take it."""
    if method.startswith("oscar"):
        from oscar_hf import disable_oscar
        disable_oscar(model)
    elif method.startswith("bf16-strong"):
        from strong_bf16 import restore
        restore(model)


def profile_method(model, method: str, batch: int, context: int, warmup: int, steps: int, device, host=False):
    new = warmup + steps
    cache = make_cache(model, method, context + new + 1, explicit=True)
    ids = torch.randint(100, model.config.vocab_size - 100, (batch, context + 1), device=device)
    with torch.no_grad():
        synthetic_fill(model, cache, batch, context, device)
    clock, prof_box = StepClock(), {}

    class Window(LogitsProcessor):
        """Starts the profiler after `warmup` steps and stops it after `steps` more."""

        def __call__(self, input_ids, scores):
            n = len(clock.stamps)
            if n == warmup:
                if host:  # Python's profiler: the step's host time by function (no device synchronisation)
                    prof_box["p"] = cProfile.Profile()
                    prof_box["p"].enable()
                else:
                    prof_box["p"] = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else []))
                    prof_box["p"].__enter__()
                prof_box["t0"] = time.perf_counter()
            if n == warmup + steps:
                if device == "cuda":
                    torch.cuda.synchronize()
                prof_box["t1"] = time.perf_counter()
                if host:
                    prof_box["p"].disable()
                else:
                    prof_box["p"].__exit__(None, None, None)
            return scores

    with torch.no_grad():
        model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new + 1, min_new_tokens=new + 1,
                       do_sample=False,
                       pad_token_id=0, logits_processor=LogitsProcessorList([clock, Window()]))
    prof = prof_box["p"]
    wall_ms = (prof_box["t1"] - prof_box["t0"]) * 1000 / steps
    # the steps before the profiler started (after the first `warmup // 2`: compilation, graph recording)
    plain = sorted(b - a for a, b in zip(clock.stamps[warmup // 2 : warmup], clock.stamps[warmup // 2 + 1 : warmup + 1]))
    plain_ms = plain[len(plain) // 2] * 1000 if plain else None
    _release(model, method)
    if host:
        text = {}
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
            text[key] = buf.getvalue()
        # dynamo's counters for the process (one method a process): a second graph or a recompile here means a second
        # cache entry whose guards every step evaluates before the matching one
        from torch._dynamo.utils import counters

        dynamo = {k: dict(counters[k]) for k in ("stats", "recompiles", "graph_break") if counters[k]}
        return dict(method=method, batch=batch, context=context, steps=steps, wall_ms_per_step=plain_ms,
                    wall_ms_per_step_profiled=wall_ms, dynamo_counters=dynamo, host_profile=text)
    by_kernel, by_group = defaultdict(float), defaultdict(float)
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us and ev.device_type != torch.autograd.DeviceType.CPU:
            by_kernel[ev.key] += dev_us / 1000 / steps
            by_group[_group(ev.key)] += dev_us / 1000 / steps
    dev_ms = sum(by_group.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:30]
    return dict(method=method, batch=batch, context=context, steps=steps, wall_ms_per_step=wall_ms,
                device_ms_per_step=dev_ms, gpu_busy_fraction=dev_ms / wall_ms if wall_ms else None,
                groups_ms=dict(sorted(by_group.items(), key=lambda kv: -kv[1])), top_kernels_ms=dict(top))


def op_kernel_times(b: int, t: int, iters: int = 20) -> dict:
    """``bench_kernels.py``'s decode op at B x T: the CUDA-graph time of the whole op and each kernel's mean device
    microseconds per call, run eagerly under the profiler (the L2 flush's kernels left out)."""
    import bench_kernels as bk

    bk.FLUSH = bk.FLUSH if bk.FLUSH is not None else torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    op = bk.oscar_op(bk.make_decode(b, t, torch.Generator().manual_seed(0)))
    graph_ms = bk.timed(op, graph=True)
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            bk.flush_l2()
            op()
        torch.cuda.synchronize()
    tot, cnt = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA" and not any(w in e.name.lower() for w in ("fill", "zero", "reduce_kernel",
                                                                                   "memset")):
            tot[e.name[:90]] += getattr(e, "device_time_total", 0.0) / iters
            cnt[e.name[:90]] += 1
    kernels = {k: dict(us_per_call=us, launches_per_call=cnt[k] / iters) for k, us in sorted(tot.items(),
                                                                                          key=lambda kv: -kv[1])}
    return dict(B=b, T=t, graph_ms=graph_ms, kernel_sum_us=sum(tot.values()), kernels=kernels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--methods", nargs="+", default=["oscar-static", "bf16-static"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--host", action="store_true", help="cProfile of the host instead of torch.profiler: where a "
                   "step's host time goes (the text report per method in the JSON)")
    p.add_argument("--op", action="store_true", help="the decode op alone at --points, kernel by kernel")
    p.add_argument("--points", nargs="+", default=["1x131072", "8x131072", "32x32768", "8x8192"], help="--op: BxT")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               command="python " + " ".join([sys.argv[0].split("/")[-1]] + (argv or sys.argv[1:])))
    if a.op:
        rows = [op_kernel_times(*(int(x) for x in pt.split("x"))) for pt in a.points]
        for r in rows:
            print(f"B={r['B']} T={r['T']}: graph {r['graph_ms'] * 1e3:.1f} us, kernels {r['kernel_sum_us']:.1f} us")
            for name, k in r["kernels"].items():
                print(f"   {k['us_per_call']:8.1f} us  x{k['launches_per_call']:.0f}  {name}")
        return save(a.out, env, rows)
    model = build_model(a.shape, torch.bfloat16, a.device, a.context + a.warmup + a.steps + 16)
    rows = []
    for m in a.methods:
        r = profile_method(model, m, a.batch, a.context, a.warmup, a.steps, a.device, host=a.host)
        if a.host:
            print(f"== {m}: {r['wall_ms_per_step']:.2f} ms a step ({r['wall_ms_per_step_profiled']:.2f} under cProfile)")
            print(r["host_profile"]["tottime"][:6000], flush=True)
        else:
            print(json.dumps(r), flush=True)
        rows.append(r)
    return save(a.out, env, rows)


def save(out, env, rows):
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(env=env, results=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
