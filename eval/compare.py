"""Method comparison on held-out WikiText: a Markdown table + PNG plots in ``eval/results/``.

Tables (every perplexity is relative to the float32-KV model on the same windows):

* ``main``: every KV method at the issue's target (context 2048, G=64, sink 64, recent 256), all tokens
  of each window scored with exact decode semantics (one-forward fake-quant path);
* ``groups``: group size 32 vs 64 for each rotation (128 > head_dim 64 is impossible for SmolLM2);
* ``windows``: (sink, recent) for centered OSCAR;
* ``decode``: Transformers' ``QuantizedCache`` rows, token by token (prefill then decode), beside
  OSCAR / KIVI / FP under the same protocol.

Rows are cached in ``<out>/compare.json`` by a key of their settings, so an interrupted run resumes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from oscar_hf import OscarRotations
from oscar_hf.hadamard import hadamard_matrix
from oscar_hf.rotations import LayerRotation

from .methods import KVMethod, OscarFamily, get_method
from .perplexity import evaluation_ids, perplexity

logger = logging.getLogger("oscar_hf")
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ artifacts
def find_artifact(method: str, group_size: int = 64, root: Path = ROOT / "artifacts") -> OscarRotations | None:
    """A calibrated artifact for ``method`` (checked: method, group size) among the known locations."""
    names = [f"eval/smollm2-{method}-g{group_size}", f"smollm2-{method}"]
    for n in names:
        p = root / n
        if (p / "oscar_config.json").is_file():
            rot = OscarRotations.from_pretrained(p)
            g = rot.metadata.get("calibration", {}).get("group_size", rot.metadata.get("group_size", group_size))
            if rot.method == method and int(g) == group_size:
                rot.metadata["path"] = str(p.relative_to(root.parent))
                return rot
    return None


def calibrate_artifact(model, tok, method: str, group_size: int, root: Path = ROOT / "artifacts") -> OscarRotations:
    """Calibrate on the calibration split only (``oscar_hf.data``), 8192 tokens, cache under artifacts/eval/."""
    from oscar_hf.calibration import calibrate
    from oscar_hf.data import split_texts
    from oscar_hf.models import wikitext_path

    rot = find_artifact(method, group_size, root)
    if rot is not None:
        return rot
    text = split_texts(wikitext_path().read_text(encoding="utf-8")).calibration
    rot = calibrate(model, tok, text, method=method, tokens=8192, seq_len=2048, group_size=group_size)
    out = root / "eval" / f"smollm2-{method}-g{group_size}"
    rot.save_pretrained(out)
    rot.metadata["path"] = str(out.relative_to(root.parent))
    return rot


def swap_rotation(base: OscarRotations, kind: str, clip: float | None = 1.0) -> OscarRotations:
    """``base``'s calibrated offsets with a fixed rotation (identity / hadamard), to separate centering
    from the calibrated eigenbasis. ``clip=None`` keeps the artifact's clips."""
    layers = {}
    for i, lr in base.layers.items():
        hk, d, _ = lr.r_k.shape
        r = (torch.eye(d) if kind == "identity" else hadamard_matrix(d)).expand(hk, d, d).contiguous()
        ck, cv = (lr.clip_k, lr.clip_v) if clip is None else (clip, clip)
        layers[i] = LayerRotation(r, r.clone(), ck, cv, lr.mu_k, lr.mu_v)
    meta = dict(base.metadata, path=f"{kind} + offsets of {base.metadata.get('path', base.method)}")
    return OscarRotations(base.fingerprint, kind, layers, meta)


# ------------------------------------------------------------------------------------------ rows
SWEEP_WINDOWS = ((0, 64), (16, 128), (128, 512))  # (sink, recent); (64, 256) is the main table's setting
# sweep name -> main-table label of the same method at (64, 256)
SWEEP_MAIN_LABEL = {
    "naive INT2": "naive INT2 (identity)", "naive INT2 + centering": "naive INT2 + centering",
    "Hadamard": "Hadamard", "Hadamard + centering": "Hadamard + centering",
    "raw K/V PCA": "raw K/V PCA+H+P, no centering", "raw K/V PCA + centering": "raw K/V PCA+H+P + centering",
    "OSCAR": "OSCAR (C_Q/C_S+H+P), no centering", "OSCAR + centering": "OSCAR + centering",
}


def sweep_methods(osc, pca):
    """``(name, centered, make(sink=, recent=) -> KVMethod)`` for every rotation with centering off/on, built
    exactly like the main table's rows (identity/Hadamard + centering: the OSCAR artifact's offsets, clip 1.0)."""
    out = [("naive INT2", False, lambda **w: get_method("identity", group_size=64, **w)),
           ("Hadamard", False, lambda **w: get_method("hadamard", group_size=64, **w))]
    if osc is not None:
        ic, hc = swap_rotation(osc, "identity"), swap_rotation(osc, "hadamard")
        out += [("naive INT2", True, lambda **w: OscarFamily("naive INT2 + centering", rotations=ic, group_size=64, **w)),
                ("Hadamard", True, lambda **w: OscarFamily("Hadamard + centering", rotations=hc, group_size=64, **w))]
    if pca is not None:
        out += [("raw K/V PCA", c, (lambda c: lambda **w: OscarFamily("pca-kv", rotations=pca, group_size=64, center=c, **w))(c))
                for c in (False, True)]
    if osc is not None:
        out += [("OSCAR", c, (lambda c: lambda **w: OscarFamily("oscar", rotations=osc, group_size=64, center=c, **w))(c))
                for c in (False, True)]
    return out


@dataclasses.dataclass
class Row:
    table: str
    label: str
    method: KVMethod
    context_len: int = 2048
    n_windows: int = 2
    prefill_len: int = 1
    exact: bool = False

    def key(self) -> str:
        s = dict(self.method.settings(), table=self.table, label=self.label, ctx=self.context_len, nw=self.n_windows,
                 pre=self.prefill_len, cls=type(self.method).__name__)
        return json.dumps(s, sort_keys=True, default=str)


def oscar_row(table, label, rot, **cfg) -> Row:
    """A row of ``rot`` with ``cfg``; no full-precision heads unless ``cfg`` names them (the rows compare rotations,
    not the library default ``full_precision_heads="auto"``)."""
    cfg.setdefault("full_precision_heads", 0)
    return Row(table, label, OscarFamily(label, rotations=rot, **cfg))


def build_rows(model, tok, tables, n_windows=2, context_len=2048, decode_tokens=128, calibrate_missing=True,
               sweep_windows=None, decode_windows=1):
    get = (lambda m, g: calibrate_artifact(model, tok, m, g)) if calibrate_missing else find_artifact
    osc = get("oscar", 64)
    pca = get("pca-kv", 64)
    W = dict(sink=64, recent=256)
    rows = []
    if "main" in tables:
        rows += [
            Row("main", "FP32 KV (DynamicCache)", get_method("fp")),
            Row("main", "BF16 KV", get_method("bf16-kv")),
            Row("main", "naive INT2 (identity)", get_method("identity", group_size=64, **W)),
            Row("main", "Hadamard", get_method("hadamard", group_size=64, **W)),
        ]
        if osc is not None:
            rows += [
                oscar_row("main", "naive INT2 + centering", swap_rotation(osc, "identity"), group_size=64, **W),
                oscar_row("main", "Hadamard + centering", swap_rotation(osc, "hadamard"), group_size=64, **W),
                oscar_row("main", "OSCAR (C_Q/C_S+H+P), no centering", osc, group_size=64, center=False, **W),
                oscar_row("main", "OSCAR + centering", osc, group_size=64, center=True, **W),
                # the 8 best retrieval heads of 90 in full precision (oscar_hf.calibration.retrieval_heads; artifact scores)
                *([oscar_row("main", "OSCAR + centering + 8 FP retrieval heads", osc, group_size=64, center=True,
                             full_precision_heads=8, **W)] if osc.retrieval_scores is not None else []),
            ]
        if pca is not None:
            rows += [
                oscar_row("main", "raw K/V PCA+H+P, no centering", pca, group_size=64, center=False, **W),
                oscar_row("main", "raw K/V PCA+H+P + centering", pca, group_size=64, center=True, **W),
            ]
        rows += [
            Row("main", "KIVI-2 (G=64, R=128)", get_method("kivi", bits=2, group_size=64, residual=128)),
            Row("main", "TurboQuant-style 3-bit (no windows)", get_method("turbo", bits=3)),
            Row("main", "TurboQuant-style 2-bit (no windows)", get_method("turbo", bits=2)),
        ]
    if "groups" in tables:
        for g in (32,):  # G=64 rows are in the main table
            rows += [
                Row("groups", f"identity G={g}", get_method("identity", group_size=g, **W)),
                Row("groups", f"Hadamard G={g}", get_method("hadamard", group_size=g, **W)),
            ]
            if osc is not None:
                rows.append(oscar_row("groups", f"OSCAR G={g} (no centering)", osc, group_size=g, center=False, **W))
                rows.append(oscar_row("groups", f"OSCAR G={g} + centering", osc, group_size=g, center=True, **W))
            if pca is not None:
                rows.append(oscar_row("groups", f"raw PCA G={g} (no centering)", pca, group_size=g, center=False, **W))
    if "windows" in tables:
        for s, r in SWEEP_WINDOWS:  # (64, 256) is in the main table
            for name, centered, make in sweep_methods(osc, pca):
                rows.append(Row("windows", f"{name}{' + centering' if centered else ''}, sink {s}, recent {r}",
                                make(sink=s, recent=r)))
    if "decode" in tables:
        pre = context_len - decode_tokens
        dec = lambda label, m, exact=False: Row("decode", label, m, context_len, decode_windows, pre, exact)  # noqa: E731
        rows += [dec("FP32 KV (DynamicCache)", get_method("fp")),
                 dec("naive INT2 (identity)", get_method("identity", group_size=64, **W)),
                 dec("Hadamard", get_method("hadamard", group_size=64, **W))]
        if osc is not None:
            rows.append(dec("OSCAR + centering", OscarFamily("oscar", rotations=osc, group_size=64, **W)))
        rows.append(dec("KIVI-2 (G=64, R=128)", get_method("kivi", group_size=64, residual=128)))
        for backend in ("quanto", "hqq"):
            for nb in (2, 4):
                rows.append(dec(f"QuantizedCache {backend} int{nb} (G=64, R=128)",
                                get_method(f"hf-{backend}", nbits=nb, group_size=64, residual=128), True))
    for r in rows:
        if r.table != "decode":
            r.n_windows, r.context_len = n_windows, context_len
        if r.table in ("groups", "windows") and sweep_windows:
            r.n_windows = sweep_windows
    order = {t: i for i, t in enumerate(tables)}
    return sorted(rows, key=lambda r: order[r.table])


def run_rows(model, ids, rows, store: Path, progress=True) -> list[dict]:
    done = json.loads(store.read_text()) if store.is_file() else {}
    out = []
    for i, row in enumerate(rows):
        k = row.key()
        if k not in done:
            t = time.time()
            try:
                r = perplexity(model, ids, row.method, context_len=row.context_len, n_windows=row.n_windows,
                               prefill_len=row.prefill_len, exact=row.exact, progress=progress)
                r.update(table=row.table, label=row.label, seconds=round(time.time() - t, 1))
            except (ImportError, RuntimeError, ValueError, NotImplementedError) as e:  # a backend that cannot run here
                r = dict(table=row.table, label=row.label, error=f"{type(e).__name__}: {str(e)[:300]}")
            done[k] = r
            store.write_text(json.dumps(done, indent=1, default=str))
            print(f"[{i + 1}/{len(rows)}] {row.table:8s} {row.label:45s} "
                  + (f"ppl {r['ppl']:.3f} bits {r['bits']:.2f} ({r['seconds']}s)" if "ppl" in r else r["error"]),
                  flush=True)
        out.append(done[k])
    return out


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


def main(argv=None):
    import argparse

    from transformers.utils import logging as hf_logging

    from oscar_hf.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", default="main,groups,windows,decode")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=2, help="windows of --context tokens per row")
    p.add_argument("--sweep-windows", type=int, default=None, help="windows per row of the groups/windows sweeps")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-windows", type=int, default=1, help="windows per row of the decode (token-by-token) table")
    p.add_argument("--out", default=str(ROOT / "eval" / "results"))
    p.add_argument("--no-calibrate", action="store_true", help="skip calibrated rows whose artifact is missing")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite compare.md / PNGs from compare.json only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress:
        hf_logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -P scripts/eval_compare.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.report_only:
        done = json.loads((out / "compare.json").read_text())
        results = [r for r in done.values() if r["table"] in args.tables.split(",")]
        (out / "compare.md").write_text(markdown(results, command))
        plot(results, out)
        print((out / "compare.md").read_text())
        return
    model, tok = load_model("smollm2", dtype=torch.float32)
    tables = args.tables.split(",")
    rows = build_rows(model, tok, tables, args.windows, args.context, args.decode_tokens, not args.no_calibrate,
                      args.sweep_windows, args.decode_windows)
    need = args.context * max(args.windows, args.decode_windows, args.sweep_windows or 1)
    ids = evaluation_ids(tok, need)
    results = run_rows(model, ids, rows, out / "compare.json", progress=not args.no_progress)
    (out / "compare.md").write_text(markdown(results, command))
    plot(results, out)
    print((out / "compare.md").read_text())


if __name__ == "__main__":
    main()
