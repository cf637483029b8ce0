#!/usr/bin/env python
"""Perplexity of OSCAR with the calibrated key offset vs ``key_offset="prefill"`` (the sequence's own key
mean), token by token through the real OscarCache (the fake-quant fast path models the calibrated offset
only). Protocol = the "decode" table of ``eval/compare.py``: held-out WikiText windows of 2048 tokens, the
first 1536 prefilled exactly, the last 512 scored as decode steps; SmolLM2, default artifact (G=64).

    python -P scripts/eval_key_offset.py --windows 2 --threads 1
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from oscar_hf.eval.compare import ROOT, find_artifact
from oscar_hf.eval.methods import OscarFamily, get_method
from oscar_hf.eval.perplexity import evaluation_ids, perplexity
from oscar_hf.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "eval" / "results" / "key_offset_ppl.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", dtype=torch.float32)
    osc = find_artifact("oscar", 64)
    ids = evaluation_ids(tok, args.context * args.windows)
    W = dict(sink=64, recent=256, group_size=64)
    rows = {"FP32 DynamicCache": get_method("fp"),
            "OSCAR + centering (calibrated mu_K)": OscarFamily("oscar", rotations=osc, **W),
            "OSCAR + centering, key_offset=prefill": OscarFamily("oscar", rotations=osc, key_offset="prefill", **W)}
    res = {}
    for name, m in rows.items():
        r = perplexity(model, ids, m, context_len=args.context, n_windows=args.windows,
                       prefill_len=args.context - args.decode_tokens, exact=True)
        res[name] = dict(ppl=r["ppl"], nll=r["nll"], tokens=r["tokens"], window_ppl=r.get("window_ppl"))
        print(name, round(r["ppl"], 3), flush=True)
    ref = res["FP32 DynamicCache"]["ppl"]
    for r in res.values():
        r["delta_vs_fp"] = r["ppl"] / ref - 1
    Path(args.out).write_text(json.dumps(dict(command="python -P scripts/eval_key_offset.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), rows=res), indent=1))


if __name__ == "__main__":
    main()
