#!/usr/bin/env bash
# One command: set up a fresh machine, then run the main job on the packaged SmolLM2-135M
# (calibrate once if needed, generate with OscarCache, print quality and memory against BF16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" scripts/demo.py "$@"
