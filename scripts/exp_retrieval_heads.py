"""Experiment (issue 5): do a few full-precision "retrieval heads" give the needle back to OSCAR?

1. Probe: synthetic needles in the CALIBRATION half of WikiText (other seed, other keys than the eval);
   per (layer, query head) the attention mass that the answer-predicting positions put on the needle span,
   pooled per KV head (max over its query heads) and averaged over probes.
2. Score: the eval needles of ``eval/results/needle.json`` (same cells: seed 0, 3 trials, interior depths),
   with ``fast_answer_scores`` (one exact prefill, one fake-quantized forward per variant): OSCAR with the
   top-k probed KV heads kept in full precision, k in --ks, plus k random heads as a control.

    python -P scripts/exp_retrieval_heads.py --threads 2
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from oscar_hf.eval.compare import find_artifact
from oscar_hf.eval.fakequant import FakeQuantSpec
from oscar_hf.eval.methods import OscarFamily
from oscar_hf.eval.needle import fast_answer_scores, make_cells, make_needle_prompt
from oscar_hf.eval.perplexity import evaluation_ids
from oscar_hf.data import split_texts, tokenize
from oscar_hf.models import load_model, wikitext_path
from oscar_hf.retrieval_heads import probe_needles, retrieval_scores, top_heads


class KeepHeads(FakeQuantSpec):
    """``base`` with the listed ``(layer, kv_head)`` pairs read in full precision."""

    def __init__(self, base: FakeQuantSpec, heads, keys_only: bool = False):
        self.base, self.heads, self.keys_only = base, {}, keys_only
        for li, h in heads:
            self.heads.setdefault(int(li), []).append(int(h))

    def layer_kv(self, i, k, v):
        fq = self.base.layer_kv(i, k, v)
        if fq is None or i not in self.heads:
            return fq
        kh, vh = fq[0].clone(), fq[1].clone()
        idx = self.heads[i]
        kh[:, idx] = k[:, idx].to(kh.dtype)
        if not self.keys_only:
            vh[:, idx] = v[:, idx].to(vh.dtype)
        return kh, vh

    def exact_mask(self, n, prefill_len, device):
        return self.base.exact_mask(n, prefill_len, device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--probes", type=int, default=12)
    p.add_argument("--lengths", default="1024,2048,4096,8176")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keys-only-ks", default="", help="also: the top k heads' keys only in full precision")
    p.add_argument("--no-random", action="store_true")
    p.add_argument("--out", default="runs/exp_retrieval_heads.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    t0 = time.time()
    cal_ids = tokenize(tok, split_texts(wikitext_path().read_text(encoding="utf-8")).calibration, 8192)
    probes = probe_needles(tok, cal_ids, n=args.probes, lengths=(2048, 4096), seed=1000)
    scores = retrieval_scores(model, probes)  # [L, Hk]
    ranked = list(top_heads(scores, scores.numel()))
    print(f"probe {time.time() - t0:.0f}s; top heads:", [(l, h, round(float(scores[l, h]), 3)) for l, h in ranked[:12]])
    osc = find_artifact("oscar", 64)
    base = OscarFamily("oscar", rotations=osc, sink=64, recent=256, group_size=64).fake_spec(model)
    rng = random.Random(7)
    specs = {"fp": None, "oscar": base}
    for k in (int(x) for x in args.ks.split(",")):
        specs[f"top{k}"] = KeepHeads(base, ranked[:k])
    for k in (int(x) for x in args.keys_only_ks.split(",") if x):
        specs[f"top{k}-keys"] = KeepHeads(base, ranked[:k], keys_only=True)
    if not args.no_random:
        k_rand = max(int(x) for x in args.ks.split(","))
        specs[f"rand{k_rand}"] = KeepHeads(base, rng.sample(ranked, k_rand))
    lengths = [int(x) for x in args.lengths.split(",")]
    hay = evaluation_ids(tok, max(lengths))
    cells = [c for c in make_cells(lengths, [0, 0.25, 0.5, 0.75, 1], 3, 0) if c[1] in (0.25, 0.5, 0.75)]
    recs = []
    from tqdm.auto import tqdm

    for L, d, key, value in tqdm(cells, desc="needles"):
        ctx, q, at = make_needle_prompt(tok, hay, L, d, key, value)
        for name, r in fast_answer_scores(model, tok, ctx, q, value, specs).items():
            recs.append(dict(method=name, length=L, depth=d, value=value, **r))
        Path(args.out).write_text(json.dumps(dict(scores=scores.tolist(), ranked=ranked[:32], records=recs), indent=1))
    summary = {}
    for r in recs:
        s = summary.setdefault(r["method"], {}).setdefault(r["length"], [0, 0, 0.0])
        s[0] += r["argmax_correct"]
        s[1] += 1
        s[2] += r["nll"] / r["n_answer_tokens"]
    for m, ld in summary.items():
        print(m, {L: f"{c}/{n} nll {x / n:.3f}" for L, (c, n, x) in ld.items()},
              "all", sum(v[0] for v in ld.values()), "/", sum(v[1] for v in ld.values()))
    Path(args.out).write_text(json.dumps(dict(scores=scores.tolist(), ranked=ranked[:32], records=recs,
                                              summary=summary, command=" ".join(sys.argv)), indent=1))


if __name__ == "__main__":
    main()
