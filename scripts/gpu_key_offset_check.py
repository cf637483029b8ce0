#!/usr/bin/env python
"""GPU check of key_offset="prefill" (issue 5 follow-up): OscarCache with the Triton kernels against the torch
reference (``use_kernels=False``) on the same CUDA model: the same per-sequence key means, the same INT2 codes
(up to rounding ties) and close logits.

    python scripts/gpu_key_offset_check.py   # writes $OUT/gpu_key_offset_prefill.json (default /tmp)
"""
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from oscar_hf import OscarCache


def run(model, ids, am, use_kernels):
    cache = OscarCache(model, method="hadamard", key_offset="prefill", use_kernels=use_kernels)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=16, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out, cache.layers[0]


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_key_offset_check.py compares the Triton kernels with the torch reference: it needs CUDA")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=1000,
                               max_position_embeddings=8192)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 1000, (3, 2048), device="cuda")
    am = torch.ones_like(ids)
    am[1, :300] = 0
    am[2, :1500] = 0
    o1, l1 = run(m, ids, am, "auto")  # Triton write path + decode kernels
    o0, l0 = run(m, ids, am, False)  # torch reference
    n = l0.n_hist
    res = dict(
        mu_rel_diff=((l1.mu_k_seq - l0.mu_k_seq).norm() / l0.mu_k_seq.norm()).item(),
        code_agreement_layer0_k=(l1.hist_k.codes[:, :, :n] == l0.hist_k.codes[:, :, :n]).float().mean().item(),
        first_step_logit_rel_diff=((o1.scores[0] - o0.scores[0]).norm() / o0.scores[0].norm()).item(),
        tokens_equal_fraction=(o1.sequences == o0.sequences).float().mean().item(),
        device=torch.cuda.get_device_name(),
    )
    print(json.dumps(res))
    ok = res["mu_rel_diff"] < 1e-5 and res["code_agreement_layer0_k"] > 0.99 and res["first_step_logit_rel_diff"] < 0.02
    out = os.environ.get("OUT", "/tmp")
    with open(f"{out}/gpu_key_offset_prefill.json", "w") as f:
        f.write(json.dumps(dict(res, ok=ok), indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
