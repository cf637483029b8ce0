#!/usr/bin/env python
"""GPU check of key_offset="prefill" (issue 5 follow-up): Triton write/read path vs the torch reference on one CUDA model.

    python scripts/gpu_key_offset_check.py   # writes $OUT/gpu_key_offset_prefill.json (default /tmp)
"""
# GPU check of key_offset="prefill" end to end: OscarCache with Triton kernels vs the torch reference
# (use_kernels=False) on the same CUDA model: same cache codes (up to rounding ties) and close logits.
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from oscar_hf import OscarCache
torch.manual_seed(0)
cfg = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=128, vocab_size=1000, max_position_embeddings=8192)
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
ids = torch.randint(0, 1000, (3, 2048), device=dev)
am = torch.ones_like(ids); am[1, :300] = 0; am[2, :1500] = 0
res = {}
outs = {}  # kernels ("auto" on CUDA) first, then the torch reference
for uk in (("auto" if dev == "cuda" else False), False):
    c = OscarCache(m, method="hadamard", key_offset="prefill", use_kernels=uk)
    with torch.no_grad():
        out = m.generate(ids, attention_mask=am, past_key_values=c, max_new_tokens=16, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    outs[uk] = (out, c)
(o1, c1), (o0, c0) = outs[list(outs)[0]], outs[False]
l0 = c0.layers[0]; l1 = c1.layers[0]
res["mu_rel_diff"] = ((l1.mu_k_seq - l0.mu_k_seq).norm() / l0.mu_k_seq.norm()).item()
n = l0.n_hist
res["code_agreement_layer0_k"] = (l1.hist_k.codes[:, :, :n] == l0.hist_k.codes[:, :, :n]).float().mean().item()
res["first_step_logit_rel_diff"] = ((o1.scores[0] - o0.scores[0]).norm() / o0.scores[0].norm()).item()
res["tokens_equal_fraction"] = (o1.sequences == o0.sequences).float().mean().item()
res["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
print(json.dumps(res))
ok = res["mu_rel_diff"] < 1e-5 and res["code_agreement_layer0_k"] > 0.99 and res["first_step_logit_rel_diff"] < 0.02
out = os.environ.get("OUT", "/tmp")
open(f"{out}/gpu_key_offset_prefill.json", "w").write(json.dumps(dict(res, ok=ok), indent=1))
sys.exit(0 if ok else 1)
