#!/usr/bin/env python
"""Drift of long self-generated continuations from BF16 on SmolLM2, per KV method: eval/results/<name>.{json,md,png}.

    python -P scripts/eval_long_generation.py --artifact /tmp/smollm2-default --tokens 2048 --prompts 2 --threads 1 \\
        --name long_generation_smollm2_cpu
"""
from oscar_hf.eval.long_generation import main

if __name__ == "__main__":
    main()
