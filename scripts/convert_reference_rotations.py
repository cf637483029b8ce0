#!/usr/bin/env python
"""Convert the OSCAR authors' rotation files (FutureMLS-Lab/OSCAR) into an oscar-hf rotation artifact.

Examples::

    python -P scripts/convert_reference_rotations.py --model smollm2 \\
        --k k_rotation_qqt_r_h_pbr.pt --v v_rotation_sst_r_h_pbr.pt --out artifacts/smollm2-reference
    python -P scripts/convert_reference_rotations.py --model Qwen/Qwen3-8B --repo USER/RotationZoo \\
        --subfolder Qwen3-8B --k k_rotation_qqt_r_h_pbr.pt --v v_rotation_sst_r_h_pbr.pt --out artifacts/qwen3-8b-ref

The files are read with ``torch.load(weights_only=True)`` only (a file whose pickle would run code is
refused) and checked against the model's config (only the config is loaded, not the weights). Use the
result with ``OscarCache.from_pretrained(OUT, model)``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_EXISTS = 2
EXIT_INVALID = 1


def build_parser() -> argparse.ArgumentParser:
    from oscar_hf.rotations import REFERENCE_CLIP_K, REFERENCE_CLIP_V

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help='hub id, local path, or "smollm2" (the packaged default)')
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    p.add_argument("--k", required=True, help="key rotation file (local path, or a file name in --repo)")
    p.add_argument("--v", required=True, help="value rotation file (local path, or a file name in --repo)")
    p.add_argument("--repo", default=None, help="Hub repo id holding --k / --v (default: they are local files)")
    p.add_argument("--subfolder", default=None, help="folder of --k / --v inside --repo")
    p.add_argument("--revision", default=None, help="branch, tag or commit of --repo")
    p.add_argument("--clip-k", type=float, default=REFERENCE_CLIP_K, help="key clip ratio (default: the authors')")
    p.add_argument("--clip-v", type=float, default=REFERENCE_CLIP_V, help="value clip ratio (default: the authors')")
    p.add_argument("--group-size", type=int, default=None,
                   help="group size recorded in the artifact (default: head_dim, one group per head as the authors)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing artifact in --out")
    return p


def load_config(name: str, gguf_file: str | None = None):
    """The model's config only: conversion needs its shapes, not its weights (a 32B model converts in seconds)."""
    from transformers import AutoConfig

    from oscar_hf.eval.models import DEFAULT_MODEL, SMOLLM2_GGUF, smollm2_dir

    if name == DEFAULT_MODEL:
        name, gguf_file = str(smollm2_dir()), SMOLLM2_GGUF
    return AutoConfig.from_pretrained(name, **({"gguf_file": gguf_file} if gguf_file else {}))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from oscar_hf.rotations import CONFIG_NAME, WEIGHTS_NAME, OscarRotations

    out = Path(args.out)
    existing = [f for f in (CONFIG_NAME, WEIGHTS_NAME) if (out / f).exists()]
    if existing and not args.force:
        print(f"error: {out} already contains an OSCAR artifact ({', '.join(existing)}); pass --force to overwrite it",
              file=sys.stderr)
        return EXIT_EXISTS
    if out.exists() and not out.is_dir():
        print(f"error: {out} exists and is not a directory", file=sys.stderr)
        return EXIT_EXISTS
    config = load_config(args.model, args.gguf_file)
    try:
        rot = OscarRotations.from_reference(
            args.k, args.v, config, clip_k=args.clip_k, clip_v=args.clip_v, group_size=args.group_size,
            repo_id=args.repo, subfolder=args.subfolder, revision=args.revision,
        )
    except (OSError, ValueError) as e:  # missing / hostile / mismatched files: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    rot.metadata["model_arg"] = args.model
    rot.save_pretrained(out)
    fp, src = rot.fingerprint, rot.metadata["source"]
    print(f"converted {src['k_file']} ({src['k_objective'] or '?'}) + {src['v_file']} ({src['v_objective'] or '?'}) "
          f"for {args.model} ({fp.architecture}): {len(rot.layers)} layers x {fp.num_key_value_heads} KV heads, "
          f"head_dim {fp.head_dim}, clip K/V {args.clip_k}/{args.clip_v}, group_size {rot.metadata['group_size']}")
    print(json.dumps({"out": str(out), "layers": len(rot.layers), "method": rot.method}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
