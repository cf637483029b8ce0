#!/usr/bin/env python
"""Plot bench_generate.py results: decode tokens/s and KV bytes vs context, per batch size (PNG).

    python scripts/plot_generate.py benchmarks/results/generate_h100_b1.json benchmarks/results/generate_h100_b8.json \
        --out benchmarks/results/generate_h100.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows, gpu = [], ""
    for f in a.files:
        d = json.load(open(f))
        rows += [r for r in d["results"] if "error" not in r]
        gpu = d["env"]["gpu"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (m, b), style in zip(sorted({(r["method"], r["batch"]) for r in rows}), ["-o", "--o", "-s", "--s"]):
        rs = sorted((r for r in rows if r["method"] == m and r["batch"] == b), key=lambda r: r["context"])
        x = [r["context"] / 1024 for r in rs]
        ax1.plot(x, [r["tokens_per_s"] for r in rs], style, label=f"{m} B={b}")
        ax2.plot(x, [r["cache_bytes"] / 2**30 for r in rs], style, label=f"{m} B={b}")
    ax1.set(xlabel="context (K tokens)", ylabel="decode tokens/s (generate, eager)", xscale="log", title="decode throughput")
    ax2.set(xlabel="context (K tokens)", ylabel="KV cache GiB", xscale="log", yscale="log", title="KV cache size")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Qwen3-8B-shaped model (random weights), transformers generate, {gpu}; BF16 B=8 at 32K: out of memory")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
