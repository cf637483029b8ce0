#!/usr/bin/env python
"""Would a key offset that follows the sequence close the long-context gap? (issue 5, a measured proposal)

The calibrated key offset ``mu_K`` is one post-RoPE mean per KV head, and the key mean drifts with
position (``eval/results/key_centering.json``: by ~110% of its norm between positions < 2K and 6K-8K).
Any offset is exact for attention -- ``q·k = q·(k - mu_t) + q·mu_t`` -- so the history could be centered
on a mean that moves with it: per sequence, or per block of ``B`` positions (``B`` = 256 / 1024; one
``[Hk, D]`` mean per block, 2 bytes x D per head per block = 0.5 / 0.125 extra bits per element at
D=64 ... 0.0625 at B=1024, D=128), with ``q·mu_block`` added to the block's logits and
``(Σ_block p)·mu_block`` to the output, the same two terms the kernels already add for ``mu_K``/``mu_V``.

Protocol = ``scripts/eval_key_centering.py`` (SmolLM2, one 8192-token held-out window, post-RoPE q/k/v
captured, every layer fake-quantized as OscarCache stores it, KL and relative output error of the last
32 queries before each length, mean over 30 layers). Block means are taken over the block's own
positions, which a prefill knows; tokens demoted one by one during decoding would take the mean of the
block before (not modelled here). Writes ``eval/results/block_centering.json``.

    python -P scripts/eval_block_centering.py --lengths 2048,4096,8192 --threads 1
"""
import json
from pathlib import Path

import torch

from oscar_hf.eval.attention_fidelity import captured_smollm2_window, layer_errors, study_args
from oscar_hf.eval.compare import ROOT
from oscar_hf.eval.methods import OscarFamily


def moving_mean(x: torch.Tensor, block: int | None, start: int) -> torch.Tensor:
    """``[B, Hk, T, D]`` offsets: the mean of ``x`` over each block of ``block`` positions (``None``: over all
    positions ``>= start``), broadcast back to every position of the block."""
    if block is None:
        return x[:, :, start:].mean(2, keepdim=True).expand_as(x)
    t = x.shape[2]
    out = torch.empty_like(x)
    for b0 in range(0, t, block):
        out[:, :, b0 : b0 + block] = x[:, :, b0 : b0 + block].mean(2, keepdim=True)
    return out


def main():
    args = study_args(__doc__.split("\n\n")[0], str(ROOT / "eval" / "results" / "block_centering.json"))
    lengths = args.lengths_list
    n = max(lengths)
    model, osc, cap = captured_smollm2_window(n)
    W = dict(sink=64, recent=256, group_size=64)
    spec = OscarFamily("oscar", rotations=osc, **W).fake_spec(model)
    exact = spec.exact_mask(n, 1, "cpu")
    # key offset per variant: None = the calibrated mu_K (the default cache); else a moving mean
    variants = {"calibrated mu_K (default)": "calibrated", "no key offset": "none", "per-sequence key mean": None,
                "per-block key mean, 1024": 1024, "per-block key mean, 256": 256}
    res = {}
    for name, how in variants.items():
        res[name] = {L: {"kl": 0.0, "rel_err": 0.0} for L in lengths}
        for i in sorted(cap):
            q, k, v, sc = cap[i]
            lr, ck, cv, _ = spec._layer(i, k.device)
            vh = spec._fq(v, lr.r_v, lr.mu_v, cv)
            if how == "calibrated":
                kh = spec._fq(k, lr.r_k, lr.mu_k, ck)
            elif how == "none":
                kh = spec._fq(k, lr.r_k, None, ck)
            else:
                mu = moving_mean(k, how, W["sink"])  # [B, Hk, T, D]
                kh = spec._fq(k - mu, lr.r_k, None, ck) + mu
            for L in lengths:
                kl, err = layer_errors(q, k, v, sc, kh, vh, exact, range(L - args.queries, L))
                res[name][L]["kl"] += kl / len(cap)
                res[name][L]["rel_err"] += err / len(cap)
        print(name, {L: {a: round(b, 4) for a, b in r.items()} for L, r in res[name].items()}, flush=True)
    Path(args.out).write_text(json.dumps(dict(
        command="python -P scripts/eval_block_centering.py " + f"--lengths {args.lengths} --queries {args.queries}",
        note="values: calibrated mu_V in every row; keys: the offset named by the row; kl / rel_err = means over "
             "the 30 layers of the last `queries` queries before each length (attention_fidelity protocol)",
        fidelity=res), indent=1))


if __name__ == "__main__":
    main()
