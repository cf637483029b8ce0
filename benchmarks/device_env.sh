# Sourced by benchmarks/run_session*.sh (run from the repository root on the lent GPU machine): R = the repository,
# the package laid out on PYTHONPATH (scripts/device_pythonpath.sh), results under $OUT, working directory /tmp
# (so that `import kernels` cannot pick up the repository's top-level folder).
set -uo pipefail
R=$PWD
export PYTHONPATH=$(bash scripts/device_pythonpath.sh) PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; cd /tmp
nvidia-smi --query-gpu=name --format=csv,noheader
