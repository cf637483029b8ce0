#!/usr/bin/env python
"""Needle in a haystack on SmolLM2 through a KV cache: writes eval/results/<name>.json and <name>.png.

    python -P scripts/eval_needle.py --dtype bfloat16 --methods fp,oscar --lengths 1024,2048,4096,8176 \
        --depths 0,0.25,0.5,0.75,1 --trials 2 --name needle --threads 1
"""
from oscar_hf.eval.needle import main

if __name__ == "__main__":
    main()
