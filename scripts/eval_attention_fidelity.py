#!/usr/bin/env python
"""Per-layer attention KL / relative output error vs context length on SmolLM2: eval/results/attention_fidelity.*

    python -P scripts/eval_attention_fidelity.py --lengths 512,1024,2048,4096,8192 --threads 1
"""
from oscar_hf.eval.attention_fidelity import main

if __name__ == "__main__":
    main()
