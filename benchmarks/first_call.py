#!/usr/bin/env python
"""What a user's first ``generate`` call costs, and where that time goes.

One process = one user session: a random-weight model of a real shape (``bench_generate.SHAPES``), then ``--calls``
whole ``generate`` calls in a row (a fresh cache each: the prompt's prefill, ``--new-tokens`` decode steps, every
compile on the way), each timed end to end, with what the compiler did during it: torch's own compile timers by phase
(``compile_phases_s``), every Triton kernel compiled in this process (``triton_jit``: count and seconds per kernel;
Inductor's parallel workers compile elsewhere), and dynamo's unique graphs and recompilations. A second process with
the same ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` measures the warm on-disk caches::

    python benchmarks/first_call.py --method oscar --calls 2 --out first_call_oscar_cold.json

``--turns N``: the caches (``--methods``; and source trees, ``--tree NAME=SITE``, or this tree with an environment
variable set, ``--variant NAME=VAR=VALUE``) taking turns on one machine, each run a fresh process of this script
(``--calls 1``) with fresh on-disk compile caches, the order rotating from turn to turn (turn ``t`` starts at entry
``t``, ``--first-turn`` the first one's number) so that a drift of the machine falls on all of them; ``--warmup`` first
compiles a tiny model into caches of its own (a fresh machine's first compiling process pays one-time costs). The
report gives every run and, per tree and method, the medians and the ratio to the first method's::

    python benchmarks/first_call.py --turns 2 --warmup --methods bf16-static oscar oscar-fp25 --out turns.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, build_model, make_cache, run_env, write_json  # noqa: E402

from oscar_hf.compat import cache_kwargs  # noqa: E402


class TritonJitTimer:
    """Times every ``triton.compiler.compile`` in this process, by kernel name."""

    def __init__(self):
        import triton
        import triton.compiler.compiler as tc

        self.seconds, self.count = defaultdict(float), Counter()
        self._orig = tc.compile

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

    return {key: float(sum(times)) for key, times in getattr(utils, "compilation_time_metrics", {}).items()}


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


def one_run(method: str, site: str | None, bench_args: list[str], tmp: Path, extra_env: dict | None = None) -> dict:
    """One fresh process of this script, ``--calls 1``: its first call's figures."""
    out = tmp / "r.json"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), TRITON_CACHE_DIR=str(tmp / "triton"),
               **(extra_env or {}))
    if site is not None:
        env["PYTHONPATH"] = site
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--method", method, "--calls", "1", *bench_args,
                    "--out", str(out)], env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
    call = json.loads(out.read_text())["calls"][0]
    phases = call["compile_phases_s"]
    return dict(wall_s=call["wall_s"], compile_s=phases.get("_compile.compile_inner"),
                tracing_s=phases.get("bytecode_tracing"),
                triton_jit_s=round(sum(s for _, s in call["triton_jit"].values()), 3), triton_jit=call["triton_jit"],
                graphs=call["graphs"], recompiles=call["recompiles"], first_tokens=call["first_tokens"])


def _median(values) -> float | None:
    values = [v for v in values if v is not None]  # (a run that compiled nothing has no compile phases)
    return round(statistics.median(values), 3) if values else None


def summarize(runs: list[dict], methods: list[str]) -> list[dict]:
    rows = []
    for tree in dict.fromkeys(r["tree"] for r in runs):
        base = None
        for m in methods:
            mine = [r for r in runs if r["tree"] == tree and r["method"] == m]
            row = dict(tree=tree, method=m, runs=len(mine),
                       **{f"median_{k}": _median(r[k] for r in mine)
                          for k in ("wall_s", "compile_s", "tracing_s", "triton_jit_s")})
            base = row["median_wall_s"] if m == methods[0] else base
            mine_s = row["median_wall_s"]  # (None: no run of it yet, in a report written part way)
            row[f"ratio_to_{methods[0]}"] = round(mine_s / base, 3) if mine_s and base else None
            rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--method", default="oscar", help="a bench_generate method: bf16, bf16-static, oscar, oscar-fp25, ...")
    p.add_argument("--turns", type=int, default=0, help="fresh processes taking turns (0: this process measures)")
    p.add_argument("--methods", nargs="+", default=["bf16-static", "oscar", "oscar-fp25"],
                   help="--turns: the methods; the first is the one the ratios divide by")
    p.add_argument("--first-turn", type=int, default=0, help="--turns: the first turn's number")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=SITE",
                   help="--turns: a source tree laid out as the package installs (PYTHONPATH of its runs)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE",
                   help="--turns: this tree with an environment variable set, as a tree of its own")
    p.add_argument("--warmup", action="store_true", help="--turns: a tiny model's compile first")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.turns:
        return turns(args, argv or sys.argv[1:])
    if args.calls < 1 or args.context < 1 or args.new_tokens < 1:
        raise SystemExit("--calls, --context and --new-tokens must be >= 1")
    t0 = time.perf_counter()
    jit = TritonJitTimer()
    model = build_model(args.shape, torch.bfloat16, args.device, args.context + args.new_tokens + 16)
    setup_s = time.perf_counter() - t0
    doc = dict(env=run_env(argv, inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                           triton_cache_dir=os.environ.get("TRITON_CACHE_DIR")),
               shape=args.shape, method=args.method, batch=args.batch, context=args.context,
               new_tokens=args.new_tokens, model_setup_s=round(setup_s, 2), calls=[])
    for i in range(args.calls):
        r = one_call(model, args.method, args.batch, args.context, args.new_tokens, args.device, jit)
        doc["calls"].append(r)
        print(json.dumps(dict(call=i + 1, **{k: r[k] for k in ("wall_s", "graphs", "recompiles", "compiled")})),
              flush=True)
        write_json(args.out, doc)
    return doc


def turns(args, argv) -> dict:
    shape_args = ["--shape", args.shape, "--context", str(args.context), "--batch", str(args.batch), "--new-tokens",
                  str(args.new_tokens)]
    trees = [(None, None, {})] if not (args.tree or args.variant) else []
    for t in args.tree:
        name, sep, site = t.partition("=")
        if not sep or not Path(site).is_dir():
            raise SystemExit(f"--tree takes NAME=SITE with SITE a folder, got {t!r}")
        trees.append((name, site, {}))
    for v in args.variant:
        name, var, value = (v.split("=", 2) + ["", ""])[:3]
        if not (name and var):
            raise SystemExit(f"--variant takes NAME=VAR=VALUE, got {v!r}")
        trees.append((name, None, {var: value}))
    entries = [(tree, m) for tree in trees for m in args.methods]
    if args.warmup:
        with tempfile.TemporaryDirectory() as tmp:
            one_run(args.methods[-1], trees[0][1], ["--shape", "tiny", "--context", "256", "--new-tokens", "8"], Path(tmp))
    runs, command = [], "python first_call.py " + " ".join(argv)
    turns = range(args.first_turn, args.first_turn + args.turns)
    order = [(t, entries[(t + i) % len(entries)]) for t in turns for i in range(len(entries))]
    for t, ((name, site, extra_env), m) in tqdm(order, desc="first calls"):
        with tempfile.TemporaryDirectory() as tmp:
            r = dict(turn=t, tree=name or "this tree", method=m,
                     **one_run(m, site, shape_args, Path(tmp), extra_env))
        runs.append(r)
        print(json.dumps({k: r[k] for k in ("turn", "tree", "method", "wall_s", "compile_s", "tracing_s")}), flush=True)
        doc = dict(command=command, runs=runs, summary=summarize(runs, args.methods))
        write_json(args.out, doc, indent=1)  # after every run: a run cut short keeps the ones before
    for row in doc["summary"]:
        print(json.dumps(row))
    return doc


if __name__ == "__main__":
    main()
