#!/usr/bin/env bash
# One command: set up a fresh machine, then run the whole test suite (CPU; Triton kernels under TRITON_INTERPRET=1).
# Two pytest-xdist workers, a test module per worker at a time (--dist loadscope: a module's fixtures are built once),
# each with half the CPU's threads (tests/conftest.py); OSCAR_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONSAFEPATH=1  # as -P, and inherited by the workers: the repo root is not on sys.path (no top-level `kernels`)
exec "${PYTHON:-python3}" -P -m pytest -p no:cacheprovider -n "${OSCAR_TEST_WORKERS:-2}" --dist loadscope "$@"
