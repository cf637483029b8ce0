#!/usr/bin/env python
"""Choose the cache settings of an existing artifact (one calibrated before the search, or at another budget) and
write it with them: the settings search of ``calibrate()`` (oscar_hf/calibration/settings.py) alone, on the same
held-out windows calibration reads (the windows after the statistics windows of the calibration text).

    python -P scripts/choose_settings.py --artifact /tmp/smollm2-default --budget-bits 4.0 --out /tmp/smollm2-b4

``--heldout-len``: held-out windows of that many tokens instead of the calibration's ``seq_len`` (still after its
statistics windows): a setting's windows may cover at most a quarter of a held-out prompt, so wide ones need long
windows (Gemma-3-270M's (128, 2048) needs 9,216 tokens).

The rotations, offsets, clips and retrieval scores are copied unchanged; ``metadata["settings"]`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path


def heldout_windows(tok, text, tokens: int, seq_len: int, windows: int, heldout_len: int | None = None):
    """``[windows, heldout_len or seq_len]`` ids that follow the statistics windows of a calibration of ``tokens``
    in windows of ``seq_len`` (those it held out itself when ``heldout_len`` is None)."""
    from oscar_hf import data

    stats, held = data.calibration_windows(tok, text, tokens, seq_len, windows)
    if heldout_len:  # from the token after the statistics windows' n x seq_len (their BOS included): no overlap
        held = data.token_windows(tok, text, heldout_len, windows, offset=stats.numel())
    return held


def build_parser() -> argparse.ArgumentParser:
    from oscar_hf.calibration.pipeline import SETTINGS_WINDOWS
    from oscar_hf.calibration.settings import DEFAULT_BUDGET_BITS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", required=True, help="calibrated artifact directory")
    p.add_argument("--model", default="smollm2", help='hub id, local path, or "smollm2" (the packaged default)')
    p.add_argument("--data", default=None, help="calibration text file (default: the WikiText-2 test file)")
    p.add_argument("--budget-bits", type=float, default=DEFAULT_BUDGET_BITS)
    p.add_argument("--target-context", type=int, default=None)
    p.add_argument("--windows", type=int, default=SETTINGS_WINDOWS, help="held-out windows scored")
    p.add_argument("--heldout-len", type=int, default=None, help="held-out window length (default: calibration's)")
    p.add_argument("--out", required=True, help="output artifact directory (with --score: a JSON file)")
    p.add_argument("--score", action="append", default=[], metavar="KEY=V[,KEY=V]",
                   help="instead of searching: the search's objective (next-token KL + the recall term's greedy "
                        "mismatch; the copy's KL beside them) and the bits of these settings over the artifact's "
                        "chosen ones, on the same held-out windows (KEYs as default_perplexity's --row; repeatable; "
                        "an empty string: the chosen settings themselves)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from oscar_hf.rotations import CONFIG_NAME

    out = Path(args.out)
    if (out / CONFIG_NAME).exists() and not args.force:
        print(f"error: {out} already holds an artifact; pass --force to overwrite it", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from oscar_hf import OscarConfig, OscarRotations, data
    from oscar_hf.calibration import calibration_report, plot_settings
    from oscar_hf.calibration.hooks import as_sequences
    from oscar_hf.calibration.settings import choose_settings
    from oscar_hf.eval.models import load_model, wikitext_path

    if args.threads:
        torch.set_num_threads(args.threads)
    rot = OscarRotations.from_pretrained(args.artifact)
    cal = rot.metadata.get("calibration") or {}
    if not cal.get("tokens") or not cal.get("seq_len"):
        raise ValueError(f"{args.artifact}: no calibration record (metadata['calibration']): which windows were held "
                         "out is unknown")
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    rot.check_compatible(model.config)
    split = data.split_texts(data.load_texts(args.data or str(wikitext_path())),
                             (rot.metadata.get("data") or {}).get("calibration_fraction", data.CALIBRATION_FRACTION))
    held = heldout_windows(tok, split.calibration, int(cal["tokens"]), int(cal["seq_len"]), args.windows,
                           args.heldout_len)
    sink, recent = cal.get("window") or (64, 256)
    g = cal.get("group_size")
    base = OscarConfig(sink=sink, recent=recent, group_size=int(g) if g else None,
                       meta_dtype=cal.get("meta_dtype", "bfloat16"))
    t0 = time.perf_counter()
    if args.score:
        return score_rows(args, model, rot, as_sequences(held), base)
    entry = choose_settings(model, rot, as_sequences(held), budget_bits=args.budget_bits,
                            target_context=args.target_context, base=base)
    rot.metadata["settings"] = entry
    rot.metadata["settings_source"] = {"artifact": str(args.artifact), "command": "python -P scripts/choose_settings.py "
                                       + " ".join(argv if argv is not None else sys.argv[1:])}
    out.mkdir(parents=True, exist_ok=True)
    rot.save_pretrained(out)
    report = calibration_report(rot)
    (out / "report.txt").write_text(report)
    plot_settings(rot, out / "settings.png")
    print(report)
    print(json.dumps({"out": str(out), "time_s": round(time.perf_counter() - t0, 1), "chosen": entry["chosen"]}))
    return 0


def score_rows(args, model, rot, held, base) -> int:
    """``--score``: each row's objective (the search's: the next-token KL plus the recall term's, on its windows) and
    bits at the budget's context, as the search's report gives them, into the JSON file ``--out``."""
    from oscar_hf.calibration.settings import OBJECTIVE, _Space, default_target_context, objective
    from oscar_hf.config import OscarConfig, artifact_settings
    from oscar_hf.eval.default_perplexity import row_settings
    from oscar_hf.layer_choice import resolve_retrieval_heads

    chosen = artifact_settings(rot.metadata) or {}
    space = _Space(rot, base, args.budget_bits, args.target_context or default_target_context(model))
    measure = objective(model, rot, held)
    rows = {}
    for spec in args.score:
        config = OscarConfig(**{**chosen, **row_settings(spec)})
        if config.retrieval_heads == "auto":  # (priced as the cache resolves them)
            heads = resolve_retrieval_heads(config, rot, rot.fingerprint, config.skipped(rot.fingerprint.num_layers))
            config = config.replace(retrieval_heads=tuple(sorted((i, h) for i, hs in heads.items() for h in hs)))
        parts = measure(config)
        kl = sum(parts.get(k, 0.0) for k in OBJECTIVE)
        rows[spec or "chosen"] = {"kl": float(kl), **parts, "bits": round(space.bits(config), 4)}
        split = " + ".join(f"{k} {parts[k]:.4g}" for k in OBJECTIVE if k in parts) + "".join(
            f"; {k} {v:.4g}" for k, v in parts.items() if k not in OBJECTIVE)
        print(f"{spec or 'chosen':<60} KL {kl:.4g} ({split})  {rows[spec or 'chosen']['bits']:.3f} bits", flush=True)
    command = "python -P scripts/choose_settings.py " + shlex.join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "windows": [int(w.numel()) for w in held],
                                          "target_context": space.context, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
