#!/usr/bin/env python
"""GPU validation of the whole path on a random-initialised model of a real shape (default Qwen3-8B):

1. ``generate`` with OscarCache using the Triton kernels vs the same cache on the torch reference
   path (fake-quant semantics, also on the GPU): per-step logits must agree to tolerance;
2. calibration wall time (``oscar_hf.calibration.calibrate``) at ``--calib-tokens`` tokens.

    python benchmarks/gpu_validate.py --out benchmarks/results/gpu_validate.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, build_model  # noqa: E402

from oscar_hf import OscarCache, disable_oscar  # noqa: E402
from oscar_hf.compat import cache_kwargs  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-method", nargs="+", default=["oscar"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full-precision-heads", default="",
                   help="LAYER:HEAD,... kept in full precision (OscarConfig.full_precision_heads): the kernels then "
                        "run on the other heads of those layers")
    p.add_argument("--no-pad", action="store_true",
                   help="no left padding of the second row (a padding mask reaches the decode op as a later per-row "
                        "start, attention._left_padding_only: both take the Gluon kernel)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    fph = tuple(tuple(int(x) for x in pair.split(":")) for pair in args.full_precision_heads.split(",") if pair)
    torch.manual_seed(0)
    model = build_model(args.shape, torch.bfloat16, args.device, args.context + args.steps + 16)
    ids = torch.randint(100, model.config.vocab_size - 100, (args.batch, args.context), device=args.device)
    # left-pad the second row so the padded kernel path is exercised too
    am = torch.ones_like(ids)
    if args.batch > 1 and not args.no_pad:
        am[1, : args.context // 3] = 0
    res = {"shape": SHAPES[args.shape], "context": args.context, "batch": args.batch, "steps": args.steps,
           "left_padding": bool(args.batch > 1 and not args.no_pad),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    steps_tok = torch.randint(100, model.config.vocab_size - 100, (args.batch, args.steps), device=args.device)
    # Read-path check from identical states: at every decode step the cache is deep-copied, the copy
    # runs the torch reference (use_kernels=False) and the original runs the Triton kernels.
    launches = []  # the Gluon history kernel's launches (GPU)
    if args.device == "cuda":
        from oscar_hf.kernels import decode_triton

        glu = decode_triton._gluon_module()
        if glu is not None:
            real_launch = glu.launch_history
            glu.launch_history = lambda *a, **kw: (launches.append(kw.get("qpre") is not None), real_launch(*a, **kw))[1]
    cache = OscarCache(model, method="hadamard", group_size=64, use_kernels="auto", full_precision_heads=fph)
    res["full_precision_heads"] = [list(x) for x in fph]
    errs, agree = [], []
    with torch.no_grad():
        model(ids, attention_mask=am, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        mask = am
        for i in range(args.steps):
            tok = steps_tok[:, i : i + 1]
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            ref_cache = copy.deepcopy(cache)
            for layer in ref_cache.layers:
                if hasattr(layer, "config"):
                    layer.config = layer.config.replace(use_kernels=False)
            ref = model(tok, attention_mask=mask, **cache_kwargs(model, ref_cache), use_cache=True)
            ref = ref.logits[:, -1].float()
            ker = model(tok, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].float()
            errs.append(((ker - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item())
            agree.append((ker.argmax(-1) == ref.argmax(-1)).float().mean().item())
        # Per layer, per row: the read path's output from the same inputs, kernel vs reference (one step).
        # (the attention calls decode_attention_rotating, the op from the unrotated query; its reference is the same
        # call on the torch path, use_kernels=False)
        import oscar_hf.cache.dynamic as attn

        layer_errs = []
        real = attn.decode_attention_rotating

        def both(*a, use_kernels="auto", **kw):
            ker = real(*a, use_kernels=use_kernels, **kw)
            ref = real(*a, use_kernels=False, **kw)
            e = (ker.float() - ref.float()).flatten(1).norm(dim=-1) / ref.float().flatten(1).norm(dim=-1)
            layer_errs.append(e.tolist())
            return ker

        attn.decode_attention_rotating = both
        try:
            tok = steps_tok[:, :1]
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            model(tok, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
        finally:
            attn.decode_attention_rotating = real
        res["per_layer_rel_err_attention_output_by_row"] = layer_errs
        res["max_per_layer_rel_err_attention_output"] = max(max(r) for r in layer_errs)
    disable_oscar(model)
    # Noise floor of this random-weight model: BF16 DynamicCache with SDPA vs with eager attention
    # (two exact BF16 attentions that differ only in rounding), same tokens.
    from transformers import DynamicCache

    # (the prefill of both with SDPA, one BF16 cache, then the decode step with each: an eager prefill of a long
    # context would materialize [B, Hq, T, T] weights -- 128 GiB at 32K)
    floor = {}
    with torch.no_grad():
        dc = DynamicCache(config=model.config)
        model(ids, attention_mask=am, **cache_kwargs(model, dc), use_cache=True, logits_to_keep=1)
        m2 = torch.cat([am, torch.ones_like(steps_tok[:, :1])], 1)
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            step_cache = copy.deepcopy(dc)
            floor[impl] = model(steps_tok[:, :1], attention_mask=m2, **cache_kwargs(model, step_cache),
                                use_cache=True).logits[:, -1].float()
            del step_cache
        model.set_attn_implementation("sdpa")
        del dc
    res["noise_floor_rel_logit_err_sdpa_vs_eager"] = ((floor["sdpa"] - floor["eager"]).norm(dim=-1) / floor["eager"].norm(dim=-1)).max().item()
    res["gluon_launches"] = len(launches)
    res["gluon_launches_with_prologue_operands"] = sum(launches)
    res["per_step_max_rel_logit_err"] = errs
    res["max_rel_logit_err_kernels_vs_reference"] = max(errs)
    res["same_argmax_fraction"] = sum(agree) / len(agree)
    rel = max(errs)
    print(json.dumps(res), flush=True)
    if args.calib_tokens:
        from oscar_hf.calibration import calibrate

        n = args.calib_tokens
        seq_len = min(2048, n)
        chunks = torch.randint(100, model.config.vocab_size - 100, (n // seq_len, seq_len))
        for method in args.calib_method:
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            rot = calibrate(model, None, list(chunks.to(args.device)), method=method, tokens=n, seq_len=seq_len,
                            group_size=64, progress=False)
            if args.device == "cuda":
                torch.cuda.synchronize()
            res[f"calibration_seconds_{method}"] = time.perf_counter() - t
            res["calibration_tokens"] = n
            res["calibrated_layers"] = len(rot.layers)
            print(json.dumps({"method": method, "seconds": res[f"calibration_seconds_{method}"], "tokens": n}), flush=True)
    # The read path must match the reference per layer to BF16 precision, and the end-to-end logit
    # difference must stay within the model's own BF16 noise floor (SDPA vs eager).
    res["tolerance_ok"] = bool(
        res.get("max_per_layer_rel_err_attention_output", 0.0) < 5e-3
        and rel <= 1.5 * res["noise_floor_rel_logit_err_sdpa_vs_eager"]
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
