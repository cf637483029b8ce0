#!/usr/bin/env bash
# One command: set up a fresh machine, then run the whole test suite (CPU; Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -P -m pytest -p no:cacheprovider "$@"  # -P: the repo root is not on sys.path (no top-level `kernels`)
