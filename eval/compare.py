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
import shlex
import sys
import time
from pathlib import Path

import torch

from oscar_hf import OscarRotations
from oscar_hf.hadamard import hadamard_matrix
from oscar_hf.rotations import LayerRotation

from .compare_report import SWEEP_MAIN_LABEL, SWEEP_WINDOWS, markdown, plot, windows_pivot  # noqa: F401  (tests)
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
    from oscar_hf.eval.models import wikitext_path

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
    """A row of ``rot`` with ``cfg``; no retrieval heads unless ``cfg`` names them (the rows compare rotations,
    not the library default ``retrieval_heads="auto"``)."""
    cfg.setdefault("retrieval_heads", 0)
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
                             retrieval_heads=8, **W)] if osc.retrieval_scores is not None else []),
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


def main(argv=None):
    import argparse

    from transformers.utils import logging as hf_logging

    from oscar_hf.eval.models import load_model

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
