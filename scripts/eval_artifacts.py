#!/usr/bin/env python
"""Perplexity of calibrated rotation artifacts on the same held-out harness as eval/compare.py
(SmolLM2, WikiText held-out half, 2 x 2048-token windows, every token a decode step, G=64).

    python scripts/eval_artifacts.py artifacts/smollm2-oscar artifacts/smollm2-auto --out eval/results/artifacts_ppl.json
"""
import argparse
import json
import time
from pathlib import Path

import torch

from oscar_hf import OscarRotations
from oscar_hf.eval.methods import OscarFamily, get_method
from oscar_hf.eval.perplexity import evaluation_ids, perplexity
from oscar_hf.eval.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model, tok = load_model("smollm2", dtype=torch.float32)
    ids = evaluation_ids(tok, a.windows * a.context)
    kw = dict(context_len=a.context, n_windows=a.windows, progress=False)
    res = {"fp": perplexity(model, ids, get_method("fp"), **kw)["ppl"]}
    for path in a.artifacts:
        t = time.time()
        rot = OscarRotations.from_pretrained(path)
        r = perplexity(model, ids, OscarFamily(Path(path).name, rot), **kw)
        res[Path(path).name] = dict(ppl=r["ppl"], vs_fp=r["ppl"] / res["fp"] - 1, window_ppl=r["window_ppl"],
                                    method=rot.method, clips=rot.clips(), seconds=time.time() - t)
        print(Path(path).name, round(r["ppl"], 3), f"{res[Path(path).name]['vs_fp']:+.2%}", flush=True)
    res["command"] = "python scripts/eval_artifacts.py " + " ".join(argv or __import__("sys").argv[1:])
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
