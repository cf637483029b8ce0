#!/usr/bin/env python
"""The first ``generate`` call of a fresh process, several caches (and source trees) taking turns on one machine.

    python benchmarks/first_call_turns.py --methods bf16-static oscar oscar-fp25 --turns 2 \\
        --out benchmarks/results/first_call_<gpu>_turns.json [--tree old=/tmp/old_site --tree new=/tmp/oscar_site]
        [--variant plain=OSCAR_WARM_KERNELS=0 --variant warm=OSCAR_WARM_KERNELS=1]

Each run is one process of ``bench_first_call.py --method M --calls 1`` (its other arguments after ``--``) with fresh
``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``, so every run pays the whole compile. The order rotates from turn to
turn (turn ``t`` starts at entry ``t`` of the list of trees x methods), so that no cache is always the machine's first
or last, and a drift of the machine falls on all of them. ``--warmup`` first runs a tiny model's compile, into caches
of its own (a fresh machine's first compiling process pays one-time costs). The report gives every run and, per tree
and method, the median first call, its compile and dynamo's tracing, and its ratio to the first method's median (of
the same tree): the ratios of one machine, measured side by side. A ``--variant`` is this tree run with an
environment variable set, reported as a tree of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parent


def one_run(method: str, site: str | None, bench_args: list[str], tmp: Path, extra_env: dict | None = None) -> dict:
    """One fresh process of bench_first_call.py: its first call's figures."""
    out = tmp / "r.json"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), TRITON_CACHE_DIR=str(tmp / "triton"),
               **(extra_env or {}))
    if site is not None:
        env["PYTHONPATH"] = site
    subprocess.run([sys.executable, str(HERE / "bench_first_call.py"), "--method", method, "--calls", "1", *bench_args,
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
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["bf16-static", "oscar", "oscar-fp25"],
                   help="bench_generate methods; the first is the one the ratios divide by")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--first-turn", type=int, default=0,
                   help="the first turn's number: a later call goes on with the rotation where an earlier one stopped")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=SITE",
                   help="a source tree laid out as the package installs (PYTHONPATH of its runs); default: this one")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE",
                   help="this tree with an environment variable set (e.g. warm=OSCAR_WARM_KERNELS=1), as a tree of "
                        "its own in the report")
    p.add_argument("--warmup", action="store_true", help="a tiny model's compile first, into caches of its own")
    p.add_argument("--merge", default=None, metavar="REPORT",
                   help="an earlier call's report (e.g. --first-turn 0): its runs come first and the summary is over "
                        "both calls' runs (one device call may not hold every turn)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if args.turns < 1:
        raise SystemExit("--turns must be >= 1")
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
            one_run(args.methods[-1], trees[0][1], ["--shape", "tiny", "--context", "256", "--new-tokens", "8"],
                    Path(tmp))
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else None
    runs = list(earlier["runs"]) if earlier else []
    command = (earlier["command"] + " && " if earlier else "") + "python first_call_turns.py " + " ".join(argv)
    turns = range(args.first_turn, args.first_turn + args.turns)
    order = [(t, entries[(t + i) % len(entries)]) for t in turns for i in range(len(entries))]
    for t, ((name, site, extra_env), m) in tqdm(order, desc="first calls"):
        with tempfile.TemporaryDirectory() as tmp:
            r = dict(turn=t, tree=name or "this tree", method=m,
                     **one_run(m, site, bench_args, Path(tmp), extra_env))
        runs.append(r)
        print(json.dumps({k: r[k] for k in ("turn", "tree", "method", "wall_s", "compile_s", "tracing_s")}), flush=True)
        doc = _report(command, runs, args.methods, args.out)  # after every run: a run cut short keeps the ones before
    for row in doc["summary"]:
        print(json.dumps(row))
    return doc


def _report(command, runs, methods, out) -> dict:
    doc = dict(command=command, runs=runs, summary=summarize(runs, methods))
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
