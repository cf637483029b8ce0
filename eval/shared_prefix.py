#!/usr/bin/env python
"""What prefix sharing costs in tokens on a real model: requests that share a prefix, served through continuous
batching with the store's prefix sharing and without it, and in BF16 (Transformers' paged cache), greedy.

The first request is served alone; the others join once it decodes (so they can share its pages). Reported per
request: the first token at which its shared run leaves its unshared run, and where each leaves BF16.

    python -P eval/shared_prefix.py --out eval/results/shared_prefix_smollm2_cpu.json      # SmolLM2, CPU, ~1 min
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

import oscar_hf
from oscar_hf import OscarRotations
from oscar_hf.eval.models import load_smollm2, wikitext_path
from oscar_hf.serving import continuous_batching_config, paged_oscar


def serve(model, prompts, new_tokens: int, share: bool | None, rotations) -> tuple[dict, dict]:
    """``(tokens, shares)`` of ``prompts[1:]`` (``share`` None: BF16), the first served alone until it decodes."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = continuous_batching_config(num_blocks=256, max_batch_tokens=2048, page_size=64)
    ctx = contextlib.nullcontext() if share is None else paged_oscar(model, rotations=rotations, prefix_sharing=share)
    shares, out = {}, {}
    with ctx as store:
        if store is not None:
            take = store.share_prefix
            store.share_prefix = lambda rid, tokens: shares.setdefault(rid, take(rid, tokens))
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        try:
            manager.add_request(prompts[0], "r0", max_new_tokens=8 * new_tokens, streaming=True)
            while manager.get_result("r0", timeout=60) is None:  # its first token: its prompt is stored
                pass
            for i, p in enumerate(prompts[1:], 1):
                manager.add_request(p, f"r{i}", max_new_tokens=new_tokens)
            while len(out) < len(prompts) - 1:
                r = manager.get_result(timeout=60)
                if r is not None and r.request_id != "r0" and r.is_finished():
                    out[r.request_id] = r.generated_tokens
        finally:
            manager.stop(block=True)
    return out, shares


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=1000, help="tokens of the shared prefix (WikiText-2 test)")
    p.add_argument("--question", type=int, default=40, help="tokens of each request's own part")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out")
    args = p.parse_args(argv)
    model, tok = load_smollm2(torch.float32)
    rotations = OscarRotations.from_pretrained(Path(oscar_hf.__file__).parent / "pretrained" / "smollm2-135m-instruct")
    ids = tok(open(wikitext_path()).read()[:80000])["input_ids"]
    own = [ids[args.prefix + 200 * i : args.prefix + 200 * i + args.question] for i in range(args.requests)]
    prompts = [ids[: args.prefix] + q for q in own]
    t0 = time.time()
    unshared, _ = serve(model, prompts, args.new_tokens, False, rotations)
    shared, shares = serve(model, prompts, args.new_tokens, True, rotations)
    bf16, _ = serve(model, prompts, args.new_tokens, None, rotations)

    def leaves(a, b):  # the first token where a's run leaves b's (the length: never)
        return [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), len(a[k])) for k in sorted(a)]

    doc = dict(settings=vars(args), model="SmolLM2-135M-Instruct (packaged GGUF, float32), its packaged artifact",
               shared_tokens={k: v[0] for k, v in sorted(shares.items()) if k != "r0"},
               shared_leaves_unshared=leaves(shared, unshared), unshared_leaves_bf16=leaves(unshared, bf16),
               shared_leaves_bf16=leaves(shared, bf16), seconds=round(time.time() - t0, 1))
    print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
