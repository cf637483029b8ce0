#!/usr/bin/env python
"""Two source trees taking turns on one GPU: ``bench_generate.py`` of each, alternately, one process per run.

    python benchmarks/compare_trees.py --old /tmp/old_site --new /tmp/oscar_site --turns 2 \
        --out benchmarks/results/speed_vs_<rev>_<gpu>.json -- --contexts 32768 --batches 8 --methods oscar

``--old`` / ``--new``: folders laid out as the package installs (``oscar_hf/`` with ``kernels/`` and ``eval/`` inside,
as ``run_gpu.sh`` builds them); each run puts one on ``PYTHONPATH`` and runs *this* tree's ``bench_generate.py``
with the arguments after ``--`` (the same benchmark code measures both). Runs go old, new, new, old, old, new, ...
(each turn reverses the one before) so that neither tree always runs first and a steady drift of the machine (clocks,
temperature) falls on both alike; the report gives every run and, per method and point, the new / old ratio of the
median step time of the turns.
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

HERE = Path(__file__).resolve().parent


def run(site: str, bench_args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = dict(os.environ, PYTHONPATH=site)
        subprocess.run([sys.executable, str(HERE / "bench_generate.py"), *bench_args, "--out", str(out)], env=env,
                       check=True, cwd=tmp)
        return json.loads(out.read_text())["results"]  # (this tree's bench_generate.py writes the document)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--old-name", default="old")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    report = dict(command="python compare_trees.py " + " ".join(argv), old=a.old_name, new="this tree", runs=[])
    ms = {}  # "<method> B=<b> T=<t>" -> {"old": [ms per token of each turn], "new": [...]}
    for turn in range(a.turns):
        for name, site in (("old", a.old), ("new", a.new))[:: 1 if turn % 2 == 0 else -1]:
            for r in run(site, bench_args):
                r.update(tree=name, turn=turn)
                report["runs"].append(r)
                ms.setdefault(f"{r['method']} B={r['batch']} T={r['context']}", {"old": [], "new": []})[name].append(
                    r["decode_ms_per_token"])
                print(json.dumps({k: r.get(k) for k in ("tree", "turn", "method", "batch", "context",
                                                        "decode_ms_per_token")}), flush=True)
            Path(a.out).write_text(json.dumps(report, indent=1))  # after every run: a cut run keeps the ones before
    report["new_over_old"] = {k: dict(old_ms=v["old"], new_ms=v["new"],
                                      ratio=statistics.median(v["new"]) / statistics.median(v["old"]))
                              for k, v in ms.items()}
    for k, v in report["new_over_old"].items():
        print(f"{k}: old {v['old_ms']} new {v['new_ms']} ms/token, new/old {v['ratio']:.3f}")
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
