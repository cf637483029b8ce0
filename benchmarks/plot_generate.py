#!/usr/bin/env python
"""Plot bench_generate.py results (PNG): decode ms/token vs context (B=1), tokens/s at B=8, and KV GiB.

    python benchmarks/plot_generate.py benchmarks/results/generate_h100_b1_five_caches.json \
        benchmarks/results/generate_h100_static_b1_t100000.json benchmarks/results/generate_h100_static_b8_t32768.json \
        --out benchmarks/results/generate_static_h100.png

Each file is one bench_generate.py run (ratios inside a file are same-run); rows of one method at
one (batch, context) from several files are all plotted (one marker each), errors (OOM) are listed.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"bf16": ("tab:gray", "o"), "bf16-static": ("black", "s"), "oscar": ("tab:orange", "o"),
         "oscar-static": ("tab:red", "s"), "oscar-eager": ("tab:brown", "o"), "hqq2": ("tab:blue", "^"), "hqq4": ("tab:cyan", "^"),
         "quanto2": ("tab:green", "v"), "quanto4": ("tab:olive", "v")}
LABEL = {"bf16": "BF16 DynamicCache (eager)", "bf16-static": "BF16 StaticCache (compiled)",
         "oscar": "OscarCache (the default call)", "oscar-eager": "OscarCache(compile=False) (eager)", "oscar-static": "StaticOscarCache (compiled)",
         "hqq2": "QuantizedCache HQQ 2-bit (eager)", "hqq4": "QuantizedCache HQQ 4-bit (eager)",
         "quanto2": "QuantizedCache quanto 2-bit", "quanto4": "QuantizedCache quanto 4-bit"}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows, errors, gpu = [], [], ""
    for f in a.files:
        d = json.load(open(f))
        rows += [r for r in d["results"] if "error" not in r]
        errors += [f"{r['method']} B={r['batch']} T={r['context'] // 1024}K: {r['error'][:40]}" for r in d["results"] if "error" in r]
        gpu = d["env"]["gpu"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for m in STYLE:
        c, mk = STYLE[m]
        rs = sorted((r for r in rows if r["method"] == m and r["batch"] == 1), key=lambda r: r["context"])
        if rs:
            axes[0].plot([r["context"] / 1024 for r in rs], [r["decode_ms_per_token"] for r in rs], "-" + mk, color=c, label=LABEL[m])
            axes[2].plot([r["context"] / 1024 for r in rs], [r["cache_bytes"] / 2**30 for r in rs], "-" + mk, color=c, label=LABEL[m])
    b8 = [r for r in rows if r["batch"] == 8 and r["context"] == 32768]
    names = [r["method"] for r in b8] + [e.split(" B=")[0] for e in errors if "B=8 T=32K" in e]
    vals = [r["tokens_per_s"] for r in b8] + [0] * (len(names) - len(b8))
    axes[1].bar(range(len(names)), vals, color=[STYLE[n][0] for n in names])
    axes[1].set_xticks(range(len(names)), [LABEL[n].replace(" (", "\n(") for n in names], fontsize=7)
    for i, v in enumerate(vals):
        axes[1].text(i, v, f"{v:.0f}" if v else "out of\nmemory", ha="center", va="bottom", fontsize=8)
    axes[0].set(xlabel="context (K tokens)", ylabel="decode ms/token (median)", xscale="log", title="batch 1: decode step time")
    axes[1].set(ylabel="decode tokens/s", title="batch 8, 32K context")
    axes[2].set(xlabel="context (K tokens)", ylabel="KV cache GiB", xscale="log", yscale="log", title="batch 1: KV cache size")
    for ax in (axes[0], axes[2]):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Qwen3-8B-shaped model (random weights), transformers generate, {gpu}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("errors:", errors)


if __name__ == "__main__":
    main()
