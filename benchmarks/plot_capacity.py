#!/usr/bin/env python
"""Plot throughput bars (PNG): a bench_generate.py sweep at one (batch, context), same run, and the capacity
runs (aggregate decode tokens/s of each method at its largest batch in a KV budget).

    python benchmarks/plot_capacity.py --sweep benchmarks/results/generate_h200_b8_t32768_four_caches.json \
        --capacity benchmarks/results/capacity_h100_40gib.json benchmarks/results/capacity_h100_40gib_bf16.json \
        --out benchmarks/results/throughput_capacity.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plot_generate import LABEL, STYLE  # noqa: E402


def bars(ax, names, vals, notes):
    ax.bar(range(len(names)), vals, color=[STYLE[n][0] for n in names])
    ax.set_xticks(range(len(names)), [LABEL[n].replace(" (", "\n(") for n in names], fontsize=7)
    for i, (v, note) in enumerate(zip(vals, notes)):
        ax.text(i, v, f"{v:.0f} tok/s\n{note}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(vals) * 1.25)
    ax.grid(alpha=0.3, axis="y")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", required=True, help="one bench_generate.py JSON, all rows at one (batch, context)")
    p.add_argument("--capacity", nargs="+", required=True, help="bench_generate.py --capacity-run JSONs (same budget)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    sweep = json.load(open(a.sweep))
    rows = [r for r in sweep["results"] if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ref = next(r for r in rows if r["method"] == "bf16")
    bars(axes[0], [r["method"] for r in rows], [r["tokens_per_s"] for r in rows],
         [f"{ref['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x" for r in rows])
    r0 = rows[0]
    axes[0].set(ylabel="decode tokens/s", title=f"batch {r0['batch']}, {r0['context'] // 1024}K context, same run "
                f"({sweep['env']['gpu']})\nratio vs BF16 DynamicCache")
    cap, budget = {}, None
    for f in a.capacity:
        d = json.load(open(f))
        budget, ctx = d["kv_budget_gib"], d["capacity_context"]
        cap.update({m: c for m, c in d["capacity"].items() if "aggregate_tokens_per_s" in c})
    order = [m for m in STYLE if m in cap]
    best_bf16 = max(cap[m]["aggregate_tokens_per_s"] for m in order if m.startswith("bf16"))
    bars(axes[1], order, [cap[m]["aggregate_tokens_per_s"] for m in order],
         [f"batch {cap[m]['batch']}, {cap[m]['aggregate_tokens_per_s'] / best_bf16:.2f}x" for m in order])
    axes[1].set(ylabel="aggregate decode tokens/s",
                title=f"largest batch in a {budget:g} GiB KV budget, {ctx // 1024}K context (H100)\nratio vs the best BF16")
    fig.suptitle("Qwen3-8B-shaped model (random weights), transformers generate")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
