#!/usr/bin/env python
"""KV method comparison on SmolLM2 / WikiText: writes eval/results/compare.{md,json} and compare_*.png.

    python scripts/eval_compare.py                                  # all tables (resumes from compare.json)
    python scripts/eval_compare.py --tables main --windows 4
"""
from oscar_hf.eval.compare import main

if __name__ == "__main__":
    main()
