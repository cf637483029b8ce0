#!/usr/bin/env python
"""Does the calibrated key offset mu_K (a post-RoPE mean from positions < 2048) go stale at long context?

Captures SmolLM2's post-RoPE q/k/v for one 8192-token held-out window and reports (a) how far the mean of the
keys / values at late positions is from the mean at early positions (per layer, relative), (b) attention KL and
relative output error at each length for OSCAR with centering of keys+values, values only, and none.
Writes eval/results/key_centering.json.

    python -P scripts/eval_key_centering.py --lengths 2048,4096,8192 --threads 1
"""
import json
from pathlib import Path

import torch

from oscar_hf.eval.attention_fidelity import captured_smollm2_window, layer_errors, study_args
from oscar_hf.eval.compare import ROOT
from oscar_hf.eval.methods import OscarFamily
from oscar_hf.rotations import LayerRotation, OscarRotations


def values_only(rot: OscarRotations) -> OscarRotations:
    layers = {i: LayerRotation(lr.r_k, lr.r_v, lr.clip_k, lr.clip_v, None, lr.mu_v) for i, lr in rot.layers.items()}
    return OscarRotations(rot.fingerprint, rot.method, layers, dict(rot.metadata))


def main():
    args = study_args(__doc__.split("\n\n")[0], str(ROOT / "eval" / "results" / "key_centering.json"))
    lengths = args.lengths_list
    n = max(lengths)
    model, osc, cap = captured_smollm2_window(n)
    drift = {"k": [], "v": []}
    for i in sorted(cap):
        _, k, v, _ = cap[i]
        for name, x in (("k", k), ("v", v)):
            early, late = x[0, :, 64:2048].mean(1), x[0, :, n - 2048 :].mean(1)  # [Hk, D], sink excluded
            drift[name].append(((late - early).norm(dim=-1) / early.norm(dim=-1)).mean().item())
    W = dict(sink=64, recent=256, group_size=64)
    variants = {"OSCAR, no centering": OscarFamily("a", rotations=osc, center=False, **W),
                "OSCAR, values centered only": OscarFamily("b", rotations=values_only(osc), **W),
                "OSCAR + centering (keys and values)": OscarFamily("c", rotations=osc, **W)}
    res = {}
    for name, m in variants.items():
        spec = m.fake_spec(model)
        exact = spec.exact_mask(n, 1, "cpu")
        res[name] = {L: {"kl": 0.0, "rel_err": 0.0} for L in lengths}
        for i in sorted(cap):
            q, k, v, sc = cap[i]
            kh, vh = spec.layer_kv(i, k, v)
            for L in lengths:
                kl, err = layer_errors(q, k, v, sc, kh, vh, exact, range(L - args.queries, L))
                res[name][L]["kl"] += kl / len(cap)
                res[name][L]["rel_err"] += err / len(cap)
        print(name, {L: {a: round(b, 4) for a, b in r.items()} for L, r in res[name].items()}, flush=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"mean drift of the early-vs-late mean (relative): keys {mean(drift['k']):.3f}, values {mean(drift['v']):.3f}")
    Path(args.out).write_text(json.dumps(dict(
        command="python -P scripts/eval_key_centering.py " + f"--lengths {args.lengths} --queries {args.queries}",
        note="drift = ||mean(x[late 2048 positions]) - mean(x[positions 64..2047])|| / ||mean(early)||, per layer, "
             "mean over KV heads; kl / rel_err = means over the 30 layers (same protocol as attention_fidelity)",
        drift_per_layer=drift, mean_drift={k: mean(v) for k, v in drift.items()}, fidelity=res), indent=1))


if __name__ == "__main__":
    main()
