"""Score the retrieval heads of a model and store the scores in an existing rotation artifact.

For artifacts made without them (``--retrieval-probes 0``, older artifacts, converted reference rotations): the
default ``OscarConfig(retrieval_heads="auto")`` then keeps the best retrieval heads out of INT2 within
``max_history_bits`` (``oscar_hf.calibration.retrieval_heads``); ``retrieval_heads=k`` the ``k`` best.
``scripts/calibrate.py`` and ``calibrate()`` score new artifacts by default.

    python -P scripts/find_retrieval_heads.py --artifact artifacts/smollm2-oscar
"""
from __future__ import annotations

import argparse
import sys

import torch

from oscar_hf import OscarRotations
from oscar_hf.data import CALIBRATION_FRACTION, load_texts, split_texts
from oscar_hf.eval.models import load_model, wikitext_path
from oscar_hf.calibration.report import retrieval_summary
from oscar_hf.calibration.retrieval_heads import LENGTHS, PROBES, find_retrieval_heads, top_heads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", required=True, help="rotation artifact directory (updated in place)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--data", default=None, help="text/JSONL file or datasets name (default: the WikiText file)")
    p.add_argument("--probes", type=int, default=PROBES)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rot = OscarRotations.from_pretrained(args.artifact)
    model, tok = load_model(args.model, gguf_file=args.gguf_file, dtype=getattr(torch, args.dtype), device=args.device)
    rot.check_compatible(model.config)
    cal = split_texts(load_texts(args.data or str(wikitext_path())), CALIBRATION_FRACTION).calibration
    lengths = tuple(int(x) for x in args.lengths.split(","))
    rot.retrieval_scores = find_retrieval_heads(model, tok, cal, args.probes, lengths)
    rot.metadata["retrieval_probes"] = {"n": args.probes, "lengths": list(lengths), "data": args.data or "wikitext"}
    rot.save_pretrained(args.artifact)
    best = [(i, h, round(float(rot.retrieval_scores[i, h]), 3)) for i, h in top_heads(rot.retrieval_scores, 12)]
    print("top retrieval heads (layer, kv_head, attention mass on the fact):", best)
    print(retrieval_summary(rot).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
