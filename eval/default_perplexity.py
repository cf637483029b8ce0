"""Perplexity of the library's defaults against BF16 on two held-out texts, token by token.

Rows: a BF16 ``DynamicCache`` and ``OscarCache.from_pretrained(ARTIFACT, model)`` with its defaults (calibrated
rotations, ``retrieval_heads="auto"``), plus optional rows given by ``--rows``. Texts: the evaluation half of
WikiText (:func:`~oscar_hf.eval.perplexity.evaluation_ids`) and the prose of the Python language reference
(``pydoc``, :func:`~oscar_hf.eval.haystack.pydoc_prose`: not WikiText, never seen by calibration). Every window
starts with a ``--prefill``-token prompt (default 1; the prefill itself is exact); each later token is predicted by a
decode step of the cache under test (``--path exact``, no fake-quant shortcut), so the history holds up to
``context - sink - recent`` INT2 tokens, from the prompt's first decode step on when the prompt is long; ``--path fast``
computes the same numbers in one fake-quantized forward per window (``tests/eval/test_perplexity.py``), for more
windows at a fraction of the time.

    python -P -m oscar_hf.eval.default_perplexity --artifact /tmp/smollm2-default --context 2048 --windows 1 \\
        --path exact --dtype bfloat16 --threads 1 --name ppl_default_int8_heads_smollm2_cpu
    python -P -m oscar_hf.eval.default_perplexity --model gemma3-270m --artifact oscar_hf/pretrained/gemma-3-270m \\
        --context 2048 --windows 1 --prefill 1536 --path exact --threads 1 --name ppl_tokens_gemma3_cpu
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

TEXTS = ("wikitext", "pydoc")
TARGET = 0.05  # the bound: at most +5% perplexity over BF16


def load_ids(tokenizer, text: str, n_tokens: int) -> torch.Tensor:
    """``[n_tokens]`` held-out ids of ``text`` ("wikitext" or "pydoc")."""
    if text == "wikitext":
        from .perplexity import evaluation_ids

        return evaluation_ids(tokenizer, n_tokens)
    if text == "pydoc":
        from .haystack import load_haystack

        return load_haystack(tokenizer, "pydoc", n_tokens)
    raise ValueError(f"unknown text {text!r}; known: {TEXTS}")


def window_ids(tokenizer, text: str, context: int, windows: int) -> torch.Tensor:
    """``[context * windows]`` ids of ``text``, window after window; a tokenizer that adds a BOS token (Gemma) gets it
    at the start of every window (the window's one-token prompt), as the model always saw it in training."""
    from .haystack import bos_ids

    head = bos_ids(tokenizer)
    if not head:
        return load_ids(tokenizer, text, context * windows)
    body = load_ids(tokenizer, text, (context - 1) * windows).view(windows, context - 1)
    return torch.cat([torch.full((windows, 1), head[0], dtype=body.dtype), body], 1).reshape(-1)


def default_method(rotations, label: str, todays: bool = False, **overrides):
    """The ``OscarCache.from_pretrained`` defaults as an eval row (its config: the settings the calibration chose,
    else the artifact's group size). ``todays``: ignore the chosen settings (the defaults before the search)."""
    from oscar_hf import OscarConfig
    from oscar_hf.config import CHOSEN_FIELDS, artifact_settings

    from .methods import OscarFamily, with_label

    g = (rotations.metadata.get("calibration") or {}).get("group_size", rotations.metadata.get("group_size"))
    kw = {"group_size": int(g)} if g is not None else {}
    if todays:  # OscarFamily starts from the chosen settings: today's defaults, given explicitly, win over them
        today = OscarConfig()
        kw = {f: getattr(today, f) for f in CHOSEN_FIELDS} | kw
    elif artifact_settings(rotations.metadata):  # OscarFamily starts from them, their group size included
        kw = {}
    return with_label(OscarFamily("oscar", rotations=rotations, **{**kw, **overrides}), label)


def row_settings(spec: str) -> dict:
    """``"sink=128,recent=2048,group_size=64"`` -> the OscarFamily overrides of one ``--row``."""
    kinds = {"sink": int, "recent": int, "group_size": int, "quantizer": str, "key_bits": int, "retrieval_heads": int,
             "retrieval_bits": int, "value_group_size": int}
    kw = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in kinds or not value:
            raise ValueError(f"--row {spec!r}: entries are KEY=VALUE with KEY one of {sorted(kinds)}")
        kw[key] = kinds[key](value)
    return kw


def markdown(res: dict) -> str:
    rows = res["rows"]
    names = list(rows)
    budget = next((r[res["texts"][0]]["budget_bits"]["context"] for r in rows.values()
                   if "budget_bits" in r[res["texts"][0]]), None)  # the context the budget is priced at
    lines = ["| cache | " + " | ".join(f"{t} ppl | vs BF16" for t in res["texts"]) + " | bits / KV element | "
             "history bits | bits at " + str(budget) + " (budget measure) |", "|---" * (2 * len(res["texts"]) + 4) + "|"]
    for name in names:
        cells = []
        for t in res["texts"]:
            r = rows[name][t]
            ref = rows[names[0]][t]["ppl"]
            cells += [f"{r['ppl']:.3f}", "—" if name == names[0] else f"{r['ppl'] / ref - 1:+.2%}"]
        r0 = rows[name][res["texts"][0]]
        hist = r0.get("history_bits")
        at = r0.get("budget_bits", {}).get("bits")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r0['bits']:.2f} | "
                     + (f"{hist:.2f}" if hist is not None else "16") + " | "
                     + (f"{at:.3f}" if at is not None else "16") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None, model=None, tokenizer=None):
    """CLI. ``model`` / ``tokenizer``: run on these instead of loading ``--model``."""
    import argparse

    from oscar_hf import OscarCache, OscarRotations
    from oscar_hf.eval.models import model_for_eval

    from .methods import get_method, with_label
    from .perplexity import perplexity

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", required=True, help="calibrated artifact directory (scripts/calibrate.py --out)")
    p.add_argument("--model", default="smollm2", help='"smollm2" (default) or "gemma3-270m"')
    p.add_argument("--texts", default=",".join(TEXTS))
    p.add_argument("--context", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--prefill", type=int, default=1, help="tokens prefilled (exactly) at the start of each window; "
                                                          "the rest are scored, one decode step each")
    p.add_argument("--rows", default="", help="extra rows: comma list of no-heads (retrieval_heads=0), lloyd-max, "
                                              "g32, lloyd-max-g32 (Lloyd-Max levels: --path fast only; group 32), "
                                              "std (OscarConfig.quantizer='std'), today (OscarConfig's defaults, "
                                              "not the settings the calibration chose)")
    p.add_argument("--row", action="append", default=[], metavar="KEY=V[,KEY=V]",
                   help="an extra row of the artifact with these settings (sink, recent, group_size, quantizer, "
                        "key_bits, value_group_size, retrieval_heads, retrieval_bits) over its chosen ones, e.g. "
                        "sink=128,recent=2048,group_size=64; repeatable")
    p.add_argument("--path", choices=["exact", "fast"], default="exact",
                   help="exact: token by token through the real caches; fast: one fake-quantized forward per window")
    p.add_argument("--reference-path", choices=["exact", "fast"], default=None,
                   help="the full-precision row's path (default: --path's); fast: one forward of the plain model, "
                        "the numbers DynamicCache decoding gives up to rounding, at a fraction of the time")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="ppl_default")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = [t for t in args.texts.split(",") if t]
    dtype = getattr(torch, args.dtype)
    model, tokenizer, model_name, dtype = model_for_eval(model, tokenizer, dtype, args.model)
    rot = OscarRotations.from_pretrained(args.artifact)
    kv = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}.get(dtype, str(dtype))
    methods = {f"{kv} DynamicCache": with_label(get_method("fp"), f"{kv} DynamicCache")}
    from oscar_hf.config import FULL_LAYER_TYPES, artifact_settings

    default = default_method(rot, "defaults (the artifact's chosen settings)" if artifact_settings(rot.metadata)
                             else "defaults (artifact, auto heads)")
    # the row is the user's cache: same config as OscarCache.from_pretrained(ARTIFACT, model)
    user = OscarCache.from_pretrained(args.artifact, model)
    if default.make_cache(model).oscar_config != user.oscar_config:
        raise RuntimeError("the defaults row does not build the cache OscarCache.from_pretrained builds")
    methods[default.name] = default
    extras = {  # --rows: label and OscarFamily overrides
        "no-heads": ("artifact, retrieval_heads=0", dict(retrieval_heads=0)),
        # the retrieval heads' other storages (INT4 was the default before INT8; BF16 before INT4)
        "int4-heads": ("artifact, auto heads as INT4", dict(retrieval_bits=4)),
        "bf16-heads": ("artifact, auto heads in BF16", dict(retrieval_bits=16)),
        # item 3 of the good-by-default issue: Lloyd-Max levels (eval-only, fast path) against uniform, at G 64 / 32
        "lloyd-max": ("artifact, Lloyd-Max levels", dict(levels="lloyd-max")),
        "g32": ("artifact, group 32", dict(group_size=32)),
        "lloyd-max-g32": ("artifact, Lloyd-Max levels, group 32", dict(levels="lloyd-max", group_size=32)),
        "std": ("artifact, quantizer='std'", dict(quantizer="std")),
        # the defaults before calibration chose settings (sink 64 / recent 256, group 64, auto heads as INT8)
        "today": ("artifact, OscarConfig defaults (not the chosen settings)", dict(todays=True)),
    }
    for extra in filter(None, args.rows.split(",")):
        if extra not in extras:
            raise ValueError(f"unknown --rows entry {extra!r}; known: {sorted(extras)}")
        label, kw = extras[extra]
        if kw.get("levels") and args.path != "fast":
            raise ValueError(f"--rows {extra}: an eval-only quantizer, scored by --path fast only")
        m = default_method(rot, label, **kw)
        methods[m.name] = m
    for spec in args.row:
        kw = row_settings(spec)
        label = "artifact, " + ", ".join(f"{k} {v}" for k, v in kw.items())
        m = default_method(rot, label, **kw)
        methods[m.name] = m
    head_dim = user.fingerprint.head_dim
    # the calibration's budget measure (OscarConfig.stored_bits) at its target context: what the search priced
    target = (artifact_settings(rot.metadata) and rot.metadata["settings"].get("target_context")) or args.context
    fp = rot.fingerprint
    quantized = [i for i in sorted(rot.layers) if fp.layer_types[i] in FULL_LAYER_TYPES]
    res = dict(command="python -P -m oscar_hf.eval.default_perplexity " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
               setup=dict(model=model_name, dtype=str(dtype).removeprefix("torch."), artifact=args.artifact,
                          context=args.context, windows=args.windows, prefill_len=args.prefill,
                          path="token-by-token" if args.path == "exact" else "fast (fake-quant, one forward)",
                          reference_path=args.reference_path or args.path,
                          config=user.oscar_config.to_dict(), threads=torch.get_num_threads()),
               texts=texts, rows={})
    reference = next(iter(methods))
    for name, method in methods.items():
        res["rows"][name] = {}
        path = (args.reference_path or args.path) if name == reference else args.path
        for t in texts:
            ids = window_ids(tokenizer, t, args.context, args.windows)
            t0, c0 = time.perf_counter(), time.process_time()
            r = perplexity(model, ids, method, context_len=args.context, n_windows=args.windows,
                           prefill_len=args.prefill, exact=path == "exact", progress=False)
            row = {k: r[k] for k in ("ppl", "nll", "tokens", "window_ppl", "bits", "mean_bits", "path", "settings")}
            if hasattr(method, "retrieval_share"):
                row["history_bits"] = method.config.history_bits(head_dim, method.retrieval_share())
                row["retrieval_heads"] = [list(x) for x in method.retrieval_pairs()]
                resolved = method.config.replace(retrieval_heads=tuple(method.retrieval_pairs()))
                row["budget_bits"] = {"context": target, "bits": resolved.stored_bits(fp, quantized, target)}
            row.update(time_s=round(time.perf_counter() - t0, 1), cpu_time_s=round(time.process_time() - c0, 1))
            res["rows"][name][t] = row
            print(f"{name} / {t}: ppl {r['ppl']:.4f} ({row['time_s']} s)", flush=True)
    ref = next(iter(res["rows"]))
    res["vs_reference"] = {n: {t: res["rows"][n][t]["ppl"] / res["rows"][ref][t]["ppl"] - 1 for t in texts}
                           for n in res["rows"] if n != ref}
    res["target"] = {n: all(v <= TARGET for v in d.values()) for n, d in res["vs_reference"].items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    md = f"Command: `{res['command']}`\n\n" + markdown(res)
    md += "\n" + "\n".join(f"* {n}: " + ", ".join(f"{t} {v:+.2%}" for t, v in d.items())
                           + f" -> {'meets' if res['target'][n] else 'misses'} <= +{TARGET:.0%}"
                           for n, d in res["vs_reference"].items()) + "\n"
    (out / f"{args.name}.md").write_text(md)
    print(md)
    if not all(math.isfinite(r[t]["ppl"]) for r in res["rows"].values() for t in texts):
        raise RuntimeError("non-finite perplexity")
    return res


if __name__ == "__main__":
    main()
