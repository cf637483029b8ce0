"""The Markdown tables and PNG plots of :mod:`.compare`'s results (``eval/results/compare.md``)."""
from __future__ import annotations

import math
from pathlib import Path

SWEEP_WINDOWS = ((0, 64), (16, 128), (128, 512))  # (sink, recent); (64, 256) is the main table's setting
# sweep name -> main-table label of the same method at (64, 256)
SWEEP_MAIN_LABEL = {
    "naive INT2": "naive INT2 (identity)", "naive INT2 + centering": "naive INT2 + centering",
    "Hadamard": "Hadamard", "Hadamard + centering": "Hadamard + centering",
    "raw K/V PCA": "raw K/V PCA+H+P, no centering", "raw K/V PCA + centering": "raw K/V PCA+H+P + centering",
    "OSCAR": "OSCAR (C_Q/C_S+H+P), no centering", "OSCAR + centering": "OSCAR + centering",
}


# ------------------------------------------------------------------------------------------ outputs
TITLES = {
    "main": "Methods at the target: context {ctx}, G=64, sink 64, recent 256 (all tokens of each window scored as decode steps)",
    "groups": "Group size 32 (sink 64, recent 256; G=64 rows: main table); G=128 > head_dim 64 is impossible for SmolLM2",
    "windows": "Windows (sink, recent) x rotation x centering, G=64 (sink 64 / recent 256: main table)",
    "decode": "Token-by-token protocol: prefill {pre} exact tokens, then {dec} decode steps scored per window (Transformers QuantizedCache rows: real cache, token by token; other rows: the fast path, proved equal to token-by-token decoding)",
}


def _ref_ppl(ref: dict, row: dict) -> float:
    """The reference's perplexity on the same windows as ``row`` (sweeps may use fewer windows)."""
    if ref.get("n_windows") == row.get("n_windows") and ref.get("prefill_len") == row.get("prefill_len"):
        return ref["ppl"]
    w = ref["window_ppl"][: row["n_windows"]]  # equal token counts per window: geometric mean
    return math.exp(sum(math.log(x) for x in w) / len(w))


HEADER = """Artifacts: OSCAR = `artifacts/smollm2-oscar` (8192 calibration tokens in 4 x 2048-token sequences, G=64, offsets mu_K/mu_V, clips 0.80 except one c_V of 0.82); raw PCA =
`python -P scripts/calibrate.py --model smollm2 --method pca-kv --out artifacts/eval/smollm2-pca-kv-g64` (same settings).
"naive INT2 / Hadamard + centering" = the OSCAR artifact's offsets mu_K/mu_V with an identity/Hadamard rotation and clip 1.0.
Model: SmolLM2-135M float32 on CPU; 'FP32 KV' is the reference (BF16 rounding of K/V changes nothing visible).
Rows are cached in compare.json by their settings, so runs resume; the report is rebuilt from the rows of the command.

Bits = effective bits per KV element after 2048 cached tokens, counted the same way for every row: codes + 16-bit
metadata (scale/zero or norm) of the quantized tokens + 16 bits for every token kept in full precision (sink, recent
window, KIVI/QuantizedCache residual); mean bits = averaged over the scored positions. Δ = perplexity relative to the
FP32-KV row on the same tokens.
"""


def windows_pivot(results: list[dict]) -> str:
    """The windows sweep as one table: method x (sink, recent), Δ perplexity vs FP32 on the same windows; the
    (64, 256) column is the main table's row on the same window(s)."""
    sweep = [r for r in results if r["table"] == "windows" and "ppl" in r]
    main = {r["label"]: r for r in results if r["table"] == "main" and "ppl" in r}
    ref_main = next((r for lbl, r in main.items() if lbl.startswith("FP32")), None)
    if not sweep or ref_main is None:
        return ""
    cols = [*SWEEP_WINDOWS[:2], (64, 256), *SWEEP_WINDOWS[2:]]
    cell = {}
    for r in sweep:
        name, rest = r["label"].split(", sink ")
        sk, rc = rest.split(", recent ")
        cell[(name, (int(sk), int(rc)))] = r
    names = list(dict.fromkeys(n for n, _ in cell))
    n_w = sweep[0]["n_windows"]
    lines = [f"\nΔ perplexity vs FP32 KV on the same {n_w} x {sweep[0]['context_len']} tokens (perplexity in brackets; "
             "(64, 256) = the main table's rows on the same window(s); bits @2048 per column below):\n",
             "| method | " + " | ".join(f"sink {a}, recent {b}" for a, b in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for n in names:
        vals = []
        for c in cols:
            r = cell.get((n, c))
            if c == (64, 256) and n in SWEEP_MAIN_LABEL and SWEEP_MAIN_LABEL[n] in main:
                m = main[SWEEP_MAIN_LABEL[n]]
                r = dict(m, ppl=_ref_ppl(m, sweep[0]), n_windows=n_w)
            if r is None:
                vals.append("—")
                continue
            ref = _ref_ppl(ref_main, r)
            vals.append(f"{(r['ppl'] / ref - 1) * 100:+.1f}% ({r['ppl']:.2f})")
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    bits = {c: next((r["bits"] for (n, cc), r in cell.items() if cc == c), None) for c in cols}
    bits[(64, 256)] = next((r["bits"] for r in main.values() if r["label"] == "OSCAR + centering"), None)
    lines.append("| bits @2048 | " + " | ".join(f"{b:.2f}" if b is not None else "—" for b in bits.values()) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict], command: str) -> str:
    lines = ["# KV-cache method comparison (SmolLM2-135M, WikiText-2 held-out half)\n",
             f"Command: `{command}`\n", HEADER]
    for table in ("main", "groups", "windows", "decode"):
        rows = [r for r in results if r["table"] == table]
        if not rows:
            continue
        ok = [r for r in rows if "ppl" in r]
        ref = next((r for r in results if r["table"] == table and r["label"].startswith("FP32")), None) or next(
            (r for r in results if r["table"] == "main" and r["label"].startswith("FP32")), None)
        r0 = ok[0] if ok else {}
        lines.append(f"\n## {table}: " + TITLES[table].format(ctx=r0.get("context_len"), pre=r0.get("prefill_len"),
                                                               dec=(r0.get("tokens") or 0) // max(r0.get("n_windows", 1), 1)))
        lines.append(f"\nwindows: {r0.get('n_windows')} x {r0.get('context_len')} tokens, {r0.get('tokens')} scored tokens\n")
        if table == "windows":
            lines.append(windows_pivot(results))
            lines.append("All rows of the sweep:\n")
        lines.append("| method | ppl | Δ vs FP32 | bits @2048 | mean bits | per-window ppl | path | seconds |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "ppl" not in r:
                lines.append(f"| {r['label']} | — | — | — | — | failed: {r['error']} | | |")
                continue
            d = f"{(r['ppl'] / _ref_ppl(ref, r) - 1) * 100:+.1f}%" if ref and "ppl" in ref else "—"
            wp = ", ".join(f"{x:.2f}" for x in r["window_ppl"])
            lines.append(f"| {r['label']} | {r['ppl']:.3f} | {d} | {r['bits']:.2f} | {r['mean_bits']:.2f} | {wp} | "
                         f"{r['path']} | {r.get('seconds', '')} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for table in ("main", "groups", "windows", "decode"):
        rows = [r for r in results if r["table"] == table and "ppl" in r]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
        labels = [r["label"] for r in rows]
        ax.barh(range(len(rows)), [r["ppl"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            ax.text(r["ppl"], i, f" {r['ppl']:.2f} ({r['bits']:.2f} b)", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("WikiText perplexity (lower is better); bits/element @2048 in brackets")
        ax.set_xlim(0, max(r["ppl"] for r in rows) * 1.35)
        ax.set_title(f"SmolLM2-135M, {table}", fontsize=10)
        fig.tight_layout()
        p = out / f"compare_{table}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
