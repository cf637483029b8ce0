#!/usr/bin/env python
"""Needle in a haystack on SmolLM2 through a KV cache: writes eval/results/<name>.json, .md and .png.

    python -P scripts/eval_needle.py --dtype bfloat16 --methods fp,oscar --lengths 1024,2048,4096,8176 \
        --depths 0,0.25,0.5,0.75,1 --trials 2 --name needle --threads 1

The needle format calibration never saw (``--format locker --haystack pydoc``) against BF16, at interior depths:

    python -P scripts/eval_needle.py --format locker --haystack pydoc --methods fp,default --share-prefill \
        --lengths 1024,2048,4096,8176 --depths 0.1,0.3,0.5,0.7,0.9 --trials 3 --hay-stride 997 \
        --dtype bfloat16 --threads 2 --name needle_unseen_smollm2_cpu
"""
from oscar_hf.eval.needle_cli import main

if __name__ == "__main__":
    main()
