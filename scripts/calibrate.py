#!/usr/bin/env python
"""Calibrate OSCAR rotations for a model and write the artifact, a report, a spectra plot and (with the settings search)
its KL-against-bits plot.

Examples::

    python scripts/calibrate.py --model smollm2 --out artifacts/smollm2-oscar
    python scripts/calibrate.py --model smollm2 --method pca-kv --out artifacts/smollm2-pca-kv
    python scripts/calibrate.py --model smollm2 --preset paper --out artifacts/smollm2-paper   # the authors' settings
    python scripts/calibrate.py --model Qwen/Qwen3-0.6B --data wikitext --data-config wikitext-2-raw-v1 \\
        --split test --device cuda --dtype bfloat16 --out artifacts/qwen3-0.6b

Only the calibration part of the data is read (the first ~25 % of its characters, see
``oscar_hf.data``); the rest is held out for evaluation.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

EXIT_EXISTS = 2


def build_parser() -> argparse.ArgumentParser:
    from oscar_hf.calibration import CLIP_GRID, METHODS, VALUE_TARGETS
    from oscar_hf.calibration.retrieval_heads import LENGTHS, PROBES
    from oscar_hf.calibration.settings import DEFAULT_BUDGET_BITS
    from oscar_hf.config import PRESETS
    from oscar_hf.data import CALIBRATION_FRACTION

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help='hub id, local path, or "smollm2" (the packaged default)')
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model (dequantized on load)")
    p.add_argument("--data", default=None, help="file.txt | file.jsonl | file.json | datasets Hub name "
                   "(default: the WikiText-2 test file shipped with the repository)")
    p.add_argument("--data-config", default=None, help="datasets config name (Hub datasets)")
    p.add_argument("--split", default="test", help="datasets split (Hub datasets)")
    p.add_argument("--text-field", default="text", help="field holding the text (json / Hub datasets)")
    p.add_argument("--calibration-fraction", type=float, default=CALIBRATION_FRACTION,
                   help="leading fraction of the corpus reserved for calibration (the rest is evaluation text)")
    p.add_argument("--tokens", type=int, default=8192, help="statistics tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--method", default="auto", choices=METHODS,
                   help="auto (default): the per-head pick, all-oscar, all-pca-kv and all-hadamard checked by "
                        "next-token KL, the lowest kept; or one candidate everywhere")
    p.add_argument("--group-size", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="channels per scale / zero group: auto (default: 64, or where 64 does not divide head_dim the "
                        "largest whole number of head_dim/4-channel planes up to 64, 48 at head_dim 96) or a number")
    p.add_argument("--center", default="on", choices=["on", "off", "auto"],
                   help="offsets mu_K / mu_V: on (default), off, or auto (chosen per layer, KV head and K/V "
                   "on held-out error)")
    p.add_argument("--no-center", action="store_true", help="same as --center off")
    p.add_argument("--value-target", default="sst", choices=VALUE_TARGETS)
    p.add_argument("--clip-grid", default=None,
                   help=f"comma-separated clip ratios (default {CLIP_GRID[0]}..{CLIP_GRID[-1]} step 0.02); "
                   "'1' disables the search")
    p.add_argument("--share-rotation-across-heads", action="store_true",
                   help="one R_K / R_V per layer shared by its KV heads (statistics of all its KV heads pooled), "
                   "as the authors' rotation files; default: one per KV head")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="calibrate for OscarConfig.from_preset(NAME): 'paper' = method oscar, shared rotations, no centering, "
                   "group size = head_dim with float32 metadata, fixed clips K 0.96 / V 0.92 (not searched); "
                   "do not combine with --method / --group-size / --center / --no-center / --clip-grid")
    p.add_argument("--holdout-fraction", type=float, default=0.25)
    p.add_argument("--window", default="64,256",
                   help="SINK,RECENT of the cache the artifact is for (errors count only quantized history pairs, "
                   "sink tokens leave the K/V statistics); 'none': all tokens")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--retrieval-probes", type=int, default=PROBES,
                   help="synthetic key/value probes in the calibration text that score the retrieval heads (the "
                        "default OscarConfig(retrieval_heads='auto') keeps the best in full precision); "
                        "0: none (then no retrieval heads by default)")
    p.add_argument("--retrieval-lengths", default=",".join(map(str, LENGTHS)), help="probe lengths in tokens")
    p.add_argument("--budget-bits", type=float, default=DEFAULT_BUDGET_BITS,
                   help="memory budget of the cache settings search: average stored bits per cached K/V element over "
                        "the quantized layers at --target-context tokens (default %(default)s)")
    p.add_argument("--target-context", type=int, default=None,
                   help="context the budget is priced at (default: min(32768, the model's context))")
    p.add_argument("--no-choose-settings", action="store_true",
                   help="keep OscarConfig's default cache settings (no search; as artifacts before the search)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--force", action="store_true", help="overwrite an existing artifact in --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def preset_settings(args, parser) -> dict:
    """``calibrate()`` keywords of ``--preset`` (group size, centering, metadata dtype, clips, shared rotations);
    {} without one. A flag the preset sets, given explicitly too, is an error (never silently overridden)."""
    if args.preset is None:
        return {}
    from oscar_hf.config import PRESETS

    clash = [f"--{name.replace('_', '-')}" for name in ("method", "group_size", "center", "no_center", "clip_grid")
             if getattr(args, name) != parser.get_default(name)]
    if clash:
        parser.error(f"--preset {args.preset} sets {', '.join(clash)}; drop one of them")
    p = PRESETS[args.preset]
    return {"method": "oscar", "group_size": p["group_size"], "center": p["center"], "meta_dtype": p["meta_dtype"],
            "clips": (p["clip_k"], p["clip_v"]), "share_rotation_across_heads": True}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = preset_settings(args, parser)
    from oscar_hf.rotations import CONFIG_NAME, WEIGHTS_NAME

    out = Path(args.out)
    existing = [f for f in (CONFIG_NAME, WEIGHTS_NAME) if (out / f).exists()]
    if existing and not args.force:
        print(f"error: {out} already contains an OSCAR artifact ({', '.join(existing)}); "
              "pass --force to overwrite it", file=sys.stderr)
        return EXIT_EXISTS
    if out.exists() and not out.is_dir():
        print(f"error: {out} exists and is not a directory", file=sys.stderr)
        return EXIT_EXISTS
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    log = logging.getLogger("oscar_hf.calibrate")

    import torch

    from oscar_hf import data
    from oscar_hf.calibration import CLIP_GRID, calibrate, calibration_report, plot_settings, plot_spectra
    from oscar_hf.eval.models import WIKITEXT_FILE, load_model, wikitext_path

    window = None if args.window.strip().lower() == "none" else tuple(int(x) for x in args.window.split(","))
    if window is not None and len(window) != 2:
        print(f"error: --window must be SINK,RECENT or none, got {args.window!r}", file=sys.stderr)
        return 1
    clip_grid = CLIP_GRID if args.clip_grid is None else tuple(float(c) for c in args.clip_grid.split(",") if c.strip())
    source = args.data or str(wikitext_path())
    # recorded in the artifact: the shipped text by its name in the package, not this machine's path to it
    source_name = f"oscar_hf/texts/{WIKITEXT_FILE.name}" if Path(source) == WIKITEXT_FILE else source
    t0 = time.perf_counter()
    texts = data.load_texts(source, data_config=args.data_config, split=args.split, text_field=args.text_field)
    split = data.split_texts(texts, args.calibration_fraction)
    log.info("data: %s -- %s", source, split.describe())
    model, tok = load_model(args.model, gguf_file=args.gguf_file, dtype=getattr(torch, args.dtype), device=args.device)
    log.info("model %s loaded in %.1f s", args.model, time.perf_counter() - t0)
    center = {"on": True, "off": False, "auto": "auto"}["off" if args.no_center else args.center]
    settings = dict(group_size=args.group_size, center=center, clip_grid=clip_grid, window=window,
                    share_rotation_across_heads=args.share_rotation_across_heads,
                    retrieval_probes=args.retrieval_probes, choose_settings=not args.no_choose_settings,
                    budget_bits=args.budget_bits, target_context=args.target_context,
                    retrieval_lengths=tuple(int(x) for x in args.retrieval_lengths.split(",") if x.strip()))
    settings.update(preset)  # (the preset's sink 64 / recent 256 are --window's default)
    if args.preset:  # a preset names its cache settings: nothing to search
        settings["choose_settings"] = False
    rot = calibrate(
        model, tok, split.calibration,
        method=settings.pop("method", args.method), tokens=args.tokens, seq_len=args.seq_len, value_target=args.value_target,
        holdout_fraction=args.holdout_fraction, batch_size=args.batch_size, progress=not args.no_progress,
        **settings,
        metadata={"preset": args.preset, "data": {"source": source_name, "config": args.data_config, "split": args.split,
                           "text_field": args.text_field, "calibration_fraction": args.calibration_fraction,
                           "calibration_chars": [0, split.boundary], "total_chars": split.total_chars},
                  "model_arg": args.model, "dtype": args.dtype, "device": args.device},
    )
    out.mkdir(parents=True, exist_ok=True)
    rot.save_pretrained(out)
    report = calibration_report(rot)
    (out / "report.txt").write_text(report)
    plot_spectra(rot, out / "spectra.png")
    if (rot.metadata.get("settings") or {}).get("tried"):  # the settings search's KL against bits
        plot_settings(rot, out / "settings.png")
    if not args.quiet:
        print(report)
    print(json.dumps({"out": str(out), "time_s": rot.metadata["calibration"]["time_s"],
                      "tokens": rot.metadata["calibration"]["tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
