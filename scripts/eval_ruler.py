#!/usr/bin/env python
"""RULER-style suite helpers (the evaluation itself is one lm-eval command, see docs/ruler.md).

    python -P scripts/eval_ruler.py samples --lengths 1024,4096 --samples 1 --out ruler_samples.jsonl
    python -P scripts/eval_ruler.py table results/hf/results_*.json results/oscar/results_*.json
"""
import sys

from oscar_hf.eval.ruler import main

if __name__ == "__main__":
    sys.exit(main())
