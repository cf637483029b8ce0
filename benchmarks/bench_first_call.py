"""What a user's first ``generate`` call costs, and where that time goes (issue: the first call's compile tax).

One process = one user session: a random-weight model of a real shape (``bench_generate.SHAPES``), then ``--calls``
whole ``generate`` calls in a row (a fresh cache each: the prompt's prefill, ``--new-tokens`` decode steps, every
compile on the way), each timed end to end, with what the compiler did during it:

* ``dynamo_s`` / ``inductor_s``: torch's own compile timers (``torch._dynamo.utils.compile_times``) over the call:
  tracing (``_compile.compile_inner``) and Inductor's code generation (``compile_fx``), by the phases torch names;
* ``triton_jit``: every Triton kernel compiled in this process during the call (``triton.compiler.compile``: our
  kernels' specializations and any Inductor compiles in-process; Inductor's parallel workers compile elsewhere and show
  in ``inductor_s`` only), count and seconds per kernel name;
* ``graphs`` / ``recompiles``: dynamo's unique graphs and recompilations (``torch._dynamo.utils.counters``).

A second process with the same ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` measures the warm on-disk caches
(``bash benchmarks/run_gpu.sh first-call`` runs cold, then warm, each method in its own processes)::

    python benchmarks/bench_first_call.py --shape qwen3-8b --context 32768 --batch 1 --new-tokens 128 \\
        --method oscar --calls 2 --out first_call_oscar_cold.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, build_model, make_cache  # noqa: E402

from oscar_hf.compat import cache_kwargs  # noqa: E402


class TritonJitTimer:
    """Times every ``triton.compiler.compile`` in this process, by kernel name (a no-op where Triton is absent)."""

    def __init__(self):
        self.seconds, self.count = defaultdict(float), Counter()
        try:
            import triton.compiler.compiler as tc
        except ImportError:
            self._mod = None
            return
        self._mod, self._orig = tc, tc.compile
        import triton

        def timed(src, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._orig(src, *args, **kwargs)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
                self.seconds[name] += time.perf_counter() - t0
                self.count[name] += 1

        tc.compile = timed
        import triton.compiler as tcp

        for mod in (triton, tcp):  # runtime/jit.py binds `from ..compiler import compile` when a kernel is first bound
            if getattr(mod, "compile", None) is self._orig:
                mod.compile = timed

    def take(self) -> dict:
        """The kernels compiled since the last ``take``: ``{name: [count, seconds]}``, slowest first."""
        out = {k: [self.count[k], round(self.seconds[k], 3)] for k in sorted(self.seconds, key=self.seconds.get,
                                                                              reverse=True)}
        self.seconds.clear()
        self.count.clear()
        return out


def compile_phase_seconds() -> dict:
    """torch's cumulative compile timers, ``{phase: seconds}`` (empty where this torch has none)."""
    from torch._dynamo import utils

    out = {}
    for key, times in getattr(utils, "compilation_time_metrics", {}).items():
        out[key] = float(sum(times))
    return out


def one_call(model, method: str, batch: int, context: int, new_tokens: int, device: str, jit: TritonJitTimer) -> dict:
    from torch._dynamo.utils import counters

    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (batch, context), generator=g).to(device)
    cache = make_cache(model, method, context + new_tokens)
    kwargs = cache_kwargs(model, cache) if cache is not None else dict(cache_implementation="static")
    before = compile_phase_seconds()
    counters.clear()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = compile_phase_seconds()
    phases = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 1e-3}
    res = dict(wall_s=round(wall, 3), compile_phases_s=phases, triton_jit=jit.take(),
               graphs=int(counters["stats"]["unique_graphs"]), recompiles=int(sum(counters["recompiles"].values())),
               graph_breaks=int(sum(counters["graph_break"].values())),
               compiled=bool(getattr(cache, "compiled", method == "bf16-static")),
               first_tokens=out[0, context : context + 8].tolist())
    if method.startswith("oscar"):
        from oscar_hf import disable_oscar

        disable_oscar(model)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--method", default="oscar", help="a bench_generate method: bf16, bf16-static, oscar, oscar-fp25, ...")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.calls < 1 or args.context < 1 or args.new_tokens < 1:
        raise SystemExit("--calls, --context and --new-tokens must be >= 1")
    t0 = time.perf_counter()
    jit = TritonJitTimer()
    model = build_model(args.shape, torch.bfloat16, args.device, args.context + args.new_tokens + 16)
    setup_s = time.perf_counter() - t0
    import transformers

    doc = dict(env=dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                        inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                        triton_cache_dir=os.environ.get("TRITON_CACHE_DIR"),
                        command="python " + " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:]))),
               shape=args.shape, method=args.method, batch=args.batch, context=args.context,
               new_tokens=args.new_tokens, model_setup_s=round(setup_s, 2), calls=[])
    for i in range(args.calls):
        r = one_call(model, args.method, args.batch, args.context, args.new_tokens, args.device, jit)
        doc["calls"].append(r)
        print(json.dumps(dict(call=i + 1, **{k: r[k] for k in ("wall_s", "graphs", "recompiles", "compiled")})),
              flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
